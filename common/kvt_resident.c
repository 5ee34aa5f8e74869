/* DESIGN: open addressing with linear probing inside a fixed window, one writer at a time
 * (the mutex) and lock-free readers. A slot only ever holds a whole tag or 0, stored and
 * loaded as one aligned 64-bit atomic, so a reader sees each slot either before or after a
 * change, never torn. A reader may miss a live key whose tag is being moved by a deletion (it
 * then asks the daemon); it never sees a tag that was not live at some moment during its
 * scan, because a tag is written only for a key that is READY and overwritten before its key
 * stops being READY returns. Tags hash the namespace and the key with XXH3 under a
 * per-run seed (xxhash.h inlined: the Python package builds this file without libxxhash). */
#define XXH_INLINE_ALL
#include "kvt_resident.h"

#include "kvt_error.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define S_EMPTY 0u
#define S_RESERVED 1u /* never a tag (the first version marked deleted slots with it) */

size_t kvt_resident_region_size(uint32_t slots)
{
    return KVT_RES_HDR_SIZE + (size_t)slots * sizeof(uint64_t);
}

uint64_t kvt_resident_ns_hash(uint64_t seed, const kvt_ns_t *ns)
{
    uint64_t h = XXH3_64bits_withSeed(ns->name, ns->name_len, seed ^ ns->name_len);
    return XXH3_64bits_withSeed(ns->salt, ns->salt_len, h ^ ((uint64_t)ns->salt_len << 32));
}

uint64_t kvt_resident_tag(uint64_t nsh, const kvt_key_t *key)
{
    uint64_t t = XXH3_64bits_withSeed(key->b, KVT_KEY_LEN, nsh);
    return t > S_RESERVED ? t : t + 2;
}

static uint64_t s_load(const uint64_t *p)
{
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

static void s_store(uint64_t *p, uint64_t v)
{
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

/* ---- reader ---- */

int kvt_resident_view(const void *region, size_t size, kvt_resident_view_t *v, char *why,
                      size_t whylen)
{
    const uint8_t *p = region;
    uint64_t magic, seed;
    uint32_t version, hdr, slots, window;
    if (!p || size < KVT_RES_HDR_SIZE) {
        snprintf(why, whylen, "the residency map is smaller than its header");
        return KVT_EINVAL;
    }
    memcpy(&magic, p + KVT_RES_OFF_MAGIC, 8);
    memcpy(&version, p + KVT_RES_OFF_VERSION, 4);
    memcpy(&hdr, p + KVT_RES_OFF_HDR_SIZE, 4);
    memcpy(&slots, p + KVT_RES_OFF_SLOTS, 4);
    memcpy(&window, p + KVT_RES_OFF_WINDOW, 4);
    memcpy(&seed, p + KVT_RES_OFF_SEED, 8);
    if (magic != KVT_RES_MAGIC || version != KVT_RES_VERSION || hdr != KVT_RES_HDR_SIZE) {
        snprintf(why, whylen, "not a residency map of version %u", KVT_RES_VERSION);
        return KVT_EINVAL;
    }
    if (slots < KVT_RES_MIN_SLOTS || slots > KVT_RES_MAX_SLOTS || (slots & (slots - 1)) ||
        window == 0 || window > slots || kvt_resident_region_size(slots) > size) {
        snprintf(why, whylen, "the residency map's header does not fit its %zu bytes", size);
        return KVT_EINVAL;
    }
    *v = (kvt_resident_view_t){(const uint64_t *)(p + KVT_RES_HDR_SIZE),
                               (const uint64_t *)(p + KVT_RES_OFF_BEAT), slots - 1u, seed, window};
    return 0;
}

static uint64_t s_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

bool kvt_resident_fresh(const kvt_resident_view_t *v)
{
    /* beat first, the clock after: on one CLOCK_MONOTONIC now >= beat; a beat ahead of the
     * clock is another clock's (another time namespace) and says nothing */
    uint64_t beat = s_load(v->beat), now = s_mono_ns();
    return beat != 0 && now >= beat && now - beat <= KVT_RES_STALE_NS;
}

static bool s_found(const uint64_t *slots, uint64_t mask, uint32_t window, uint64_t tag)
{
    for (uint64_t i = 0; i < window; i++) {
        uint64_t s = s_load(&slots[(tag + i) & mask]);
        if (s == tag)
            return true;
        if (s == S_EMPTY)
            return false;
    }
    return false;
}

/* Keys go in groups whose home slots are all prefetched before the first is looked at: each
 * lands on its own page of the map, and a batch after the caches went cold (SGLang asks
 * between large copies) would otherwise wait for one miss (and page walk) after another. */
#define S_GROUP 16u

uint32_t kvt_resident_prefix(const kvt_resident_view_t *v, const kvt_ns_t *ns,
                             const kvt_key_t *keys, uint32_t n)
{
    uint64_t nsh = kvt_resident_ns_hash(v->seed, ns);
    uint64_t tags[S_GROUP];
    for (uint64_t base = 0; base < n; base += S_GROUP) {
        uint32_t m = n - base < S_GROUP ? (uint32_t)(n - base) : S_GROUP;
        for (uint32_t j = 0; j < m; j++) {
            tags[j] = kvt_resident_tag(nsh, &keys[base + j]);
            __builtin_prefetch(&v->slots[tags[j] & v->mask]);
        }
        for (uint32_t j = 0; j < m; j++)
            if (!s_found(v->slots, v->mask, v->window, tags[j]))
                return (uint32_t)base + j;
    }
    return n;
}

/* ---- writer ---- */

struct kvt_resident {
    int fd;
    uint8_t *map;
    size_t size;
    uint64_t *slots;
    uint64_t mask, seed;
    pthread_mutex_t lock; /* the writer's; a leaf */
    uint64_t entries, full;
};

kvt_resident_t *kvt_resident_new(uint32_t slots, char *err, size_t errlen)
{
    uint32_t n = KVT_RES_MIN_SLOTS;
    while (n < slots && n < KVT_RES_MAX_SLOTS)
        n <<= 1;
    kvt_resident_t *self = calloc(1, sizeof *self);
    if (!self) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    self->fd = -1;
    self->map = MAP_FAILED;
    long page = sysconf(_SC_PAGESIZE);
    size_t psz = page > 0 ? (size_t)page : 4096;
    self->size = (kvt_resident_region_size(n) + psz - 1) / psz * psz;
    if (getrandom(&self->seed, sizeof self->seed, 0) != sizeof self->seed) {
        snprintf(err, errlen, "getrandom: %s", strerror(errno));
        goto fail;
    }
    self->fd = memfd_create("kvtier-residency", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (self->fd < 0 || ftruncate(self->fd, (off_t)self->size) != 0) {
        snprintf(err, errlen, "the residency map's memory (%zu bytes): %s", self->size,
                 strerror(errno));
        goto fail;
    }
    /* populated: the memory is there from the start and no write of ours faults */
    self->map =
        mmap(NULL, self->size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, self->fd, 0);
    if (self->map == MAP_FAILED) {
        snprintf(err, errlen, "mapping the residency map: %s", strerror(errno));
        goto fail;
    }
    /* after our own writable mapping: no one else can map it writable, resize it or unseal */
    if (fcntl(self->fd, F_ADD_SEALS,
              F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0 &&
        /* before Linux 5.1 there is no FUTURE_WRITE: the read-only descriptors clients get
         * still cannot write (kvt_fastpath_set_resident) */
        (errno != EINVAL ||
         fcntl(self->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)) {
        snprintf(err, errlen, "sealing the residency map: %s", strerror(errno));
        goto fail;
    }
    uint64_t magic = KVT_RES_MAGIC;
    uint32_t version = KVT_RES_VERSION, hdr = KVT_RES_HDR_SIZE, window = KVT_RES_WINDOW;
    memcpy(self->map + KVT_RES_OFF_MAGIC, &magic, 8);
    memcpy(self->map + KVT_RES_OFF_VERSION, &version, 4);
    memcpy(self->map + KVT_RES_OFF_HDR_SIZE, &hdr, 4);
    memcpy(self->map + KVT_RES_OFF_SLOTS, &n, 4);
    memcpy(self->map + KVT_RES_OFF_WINDOW, &window, 4);
    memcpy(self->map + KVT_RES_OFF_SEED, &self->seed, 8);
    self->slots = (uint64_t *)(self->map + KVT_RES_HDR_SIZE);
    self->mask = n - 1u;
    pthread_mutex_init(&self->lock, NULL);
    kvt_resident_beat(self);
    return self;
fail:
    if (self->map != MAP_FAILED)
        munmap(self->map, self->size);
    if (self->fd >= 0)
        close(self->fd);
    free(self);
    return NULL;
}

void kvt_resident_destroy(kvt_resident_t **self_p)
{
    kvt_resident_t *self = *self_p;
    if (!self)
        return;
    *self_p = NULL;
    munmap(self->map, self->size);
    close(self->fd);
    pthread_mutex_destroy(&self->lock);
    free(self);
}

void kvt_resident_beat(kvt_resident_t *self)
{
    s_store((uint64_t *)(self->map + KVT_RES_OFF_BEAT), s_mono_ns());
}

void kvt_resident_close(kvt_resident_t *self)
{
    s_store((uint64_t *)(self->map + KVT_RES_OFF_BEAT), 0);
}

uint64_t kvt_resident_seed(const kvt_resident_t *self)
{
    return self->seed;
}

int kvt_resident_fd(const kvt_resident_t *self)
{
    return self->fd;
}

size_t kvt_resident_size(const kvt_resident_t *self)
{
    return self->size;
}

/* Places tag (not present) in the first empty slot of its window: true, or false when the
 * window is full. Lock held. */
static bool s_place(kvt_resident_t *self, uint64_t tag)
{
    for (uint64_t i = 0; i < KVT_RES_WINDOW; i++) {
        uint64_t *s = &self->slots[(tag + i) & self->mask];
        if (*s == S_EMPTY) {
            s_store(s, tag);
            self->entries++;
            return true;
        }
    }
    self->full++;
    return false;
}

void kvt_resident_add(kvt_resident_t *self, uint64_t tag)
{
    pthread_mutex_lock(&self->lock);
    if (!s_found(self->slots, self->mask, KVT_RES_WINDOW, tag))
        (void)s_place(self, tag);
    pthread_mutex_unlock(&self->lock);
}

/* Backward-shift deletion: the tag's slot is overwritten by the next tag of its run that may
 * move back to it (closer to its home slot), whose old slot is filled the same way, and the
 * last slot so freed is emptied. No deleted-slot markers pile up, so the map never needs a
 * rebuild under the lock; every store puts a whole live tag or 0 in a slot. A reader racing
 * it can miss a tag on the move (it sees the slot before it arrives, the old slot after it
 * left): a miss, which only sends it to the daemon; it can only find tags that are live. */
void kvt_resident_del(kvt_resident_t *self, uint64_t tag)
{
    pthread_mutex_lock(&self->lock);
    uint64_t hole = UINT64_MAX;
    for (uint64_t i = 0; i < KVT_RES_WINDOW; i++) {
        uint64_t at = (tag + i) & self->mask, t = self->slots[at];
        if (t == tag) {
            hole = at;
            break;
        }
        if (t == S_EMPTY)
            break;
    }
    if (hole != UINT64_MAX) {
        self->entries--;
        for (uint64_t j = (hole + 1) & self->mask, n = 0; n <= self->mask;
             j = (j + 1) & self->mask, n++) {
            uint64_t t = self->slots[j];
            if (t == S_EMPTY)
                break;
            /* t may fill the hole when its home is not after the hole on the way to j */
            if (((j - (t & self->mask)) & self->mask) >= ((j - hole) & self->mask)) {
                s_store(&self->slots[hole], t);
                hole = j;
            }
        }
        s_store(&self->slots[hole], S_EMPTY);
    }
    pthread_mutex_unlock(&self->lock);
}

void kvt_resident_stats(kvt_resident_t *self, kvt_resident_stats_t *out)
{
    pthread_mutex_lock(&self->lock);
    *out = (kvt_resident_stats_t){self->mask + 1, self->entries, self->full};
    pthread_mutex_unlock(&self->lock);
}
