/* DESIGN: the ring is two free-running u64 byte counters in shared memory — `head` (bytes ever
 * produced, written only by the producer) and `tail` (bytes ever consumed, written only by the
 * consumer) — over a power-of-two data area, so `head - tail` is what waits and
 * `capacity - (head - tail)` what is free, with no wrap state to agree on. Records are
 * 8-byte aligned, so their {u32 length, u32 kind} header is never split; a payload may wrap at
 * the end of the area (the consumer copies it out in two pieces anyway).
 *
 * Ordering: the producer writes a record, then publishes `head` with a release store; the
 * consumer reads `head` with acquire before it reads the bytes (and symmetrically `tail` before
 * the producer reuses space). Sleeping is Dekker-style: a side about to sleep stores 1 into its
 * wait word, issues a seq_cst fence and looks at the ring once more; the other side, after
 * publishing its index, issues a seq_cst fence and wakes the sleeper only when that word is 1
 * (exchanging it to 0, so a burst costs one wake). One of the two always sees the other, so no
 * wake-up is lost, and neither side makes a system call while the other is awake. The futex is
 * a shared (not private) futex: the sides may be two processes.
 *
 * Trust: each handle keeps its own index, the capacity and its mask privately, and never reads
 * them back from the region. What it does read there — the peer's index, a record's length and
 * kind, the wait word — is checked against what the ring can hold before anything is copied: an
 * index more than `capacity` away from ours, a misaligned one, a record that runs past `head`
 * or a kind other than a message break the handle (KVT_EBADREQ, sticky). A wait word set by a
 * hostile peer costs at most one extra wake or one early return from a futex sleep; waits are
 * bounded by their deadline.
 *
 * Threads: a handle belongs to one thread at a time; the producer and consumer handles of one
 * ring may be used concurrently (that is the point).
 *
 * Self-contained (libc and the KVT_E* constants): libkvtier links it without kvt_log, so a
 * misused handle (wrong side, destroyed) aborts through s_check rather than kvt_assert. */
#include "kvt_ring.h"

#include "kvt_error.h"

#include <linux/futex.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define S_TAG 0x6b767272u /* "kvrr" */
#define S_DEFAULT_SPIN 4096u
#define S_MIN_SPIN 32u
#define S_SPIN_WORTH_NS 50000       /* a sleep that ended sooner would have been caught spinning */
#define S_SPIN_CLOCK_EVERY 256u     /* spin iterations between looks at the clock */
#define S_COOL_MIN_NS 1000000LL     /* the first pause after a spin lost its CPU */
#define S_COOL_MAX_NS 50000000LL    /* the longest (the CPUs stay full) */
#define S_COOL_AGAIN_NS                                                                            \
    100000000LL                     /* a loss this soon after a pause ended doubles the next;      \
                                     * each quiet stretch this long halves it */
#define S_MAX_SLEEP_NS 1000000000LL /* one futex sleep at most; the loop re-checks after it */

/* The header as it lies in the region (offsets are part of the format: see kvt_ring.h). */
typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t hdr_size;
    uint32_t capacity;
    _Atomic uint32_t epoch; /* bumped by each format: a handle of an earlier use is closed */
    uint8_t pad0[128 - 24];
    _Atomic uint64_t head;
    _Atomic uint32_t prod_wait;
    _Atomic uint32_t prod_closed;
    uint8_t pad1[128 - 16];
    _Atomic uint64_t tail;
    _Atomic uint32_t cons_wait;
    _Atomic uint32_t cons_closed;
    uint8_t pad2[128 - 16];
} s_hdr_t;

_Static_assert(sizeof(s_hdr_t) == KVT_RING_HDR_SIZE, "ring header size");
_Static_assert(offsetof(s_hdr_t, version) == KVT_RING_OFF_VERSION, "layout");
_Static_assert(offsetof(s_hdr_t, hdr_size) == KVT_RING_OFF_HDR_SIZE, "layout");
_Static_assert(offsetof(s_hdr_t, capacity) == KVT_RING_OFF_CAPACITY, "layout");
_Static_assert(offsetof(s_hdr_t, epoch) == KVT_RING_OFF_EPOCH, "layout");
_Static_assert(offsetof(s_hdr_t, head) == KVT_RING_OFF_HEAD, "layout");
_Static_assert(offsetof(s_hdr_t, prod_wait) == KVT_RING_OFF_PROD_WAIT, "layout");
_Static_assert(offsetof(s_hdr_t, prod_closed) == KVT_RING_OFF_PROD_CLOSED, "layout");
_Static_assert(offsetof(s_hdr_t, tail) == KVT_RING_OFF_TAIL, "layout");
_Static_assert(offsetof(s_hdr_t, cons_wait) == KVT_RING_OFF_CONS_WAIT, "layout");
_Static_assert(offsetof(s_hdr_t, cons_closed) == KVT_RING_OFF_CONS_CLOSED, "layout");
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2,
               "shared-memory atomics must be lock-free");
_Static_assert(sizeof(_Atomic uint32_t) == 4, "futex words are 32 bits");

struct kvt_ring {
    uint32_t tag;
    kvt_ring_role_t role;
    s_hdr_t *hdr;  /* shared: only the fields above are read, each checked */
    uint8_t *data; /* shared: capacity bytes */
    uint64_t cap;  /* ours, from attach time */
    uint64_t mask;
    uint64_t pos; /* ours: head (producer) or tail (consumer); never read back */
    uint32_t epoch; /* the region's epoch at attach */
    uint32_t spin_max;
    bool broken;
    kvt_ring_cool_t cool; /* waits sleep at once before cool.until: spinning lost the CPU */
    kvt_ring_stats_t st;
    char why[128];
};

#define s_check(expr) ((expr) ? (void)0 : s_check_fail(#expr, __LINE__))

__attribute__((noreturn)) static void s_check_fail(const char *expr, int line)
{
    fprintf(stderr, "kvt_ring.c:%d: assertion failed: %s\n", line, expr);
    abort();
}

static uint64_t s_align8(uint64_t n)
{
    return (n + 7) & ~(uint64_t)7;
}

static int64_t s_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void s_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    atomic_signal_fence(memory_order_seq_cst);
#endif
}

static void s_futex_wait(_Atomic uint32_t *word, uint32_t val, int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    /* EAGAIN (the word changed), EINTR and ETIMEDOUT all mean: look again */
    (void)syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void s_futex_wake(_Atomic uint32_t *word)
{
    (void)syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, 1, NULL, NULL, 0);
}

__attribute__((format(printf, 2, 3))) static int s_break(kvt_ring_t *self, const char *fmt, ...)
{
    if (!self->broken) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(self->why, sizeof self->why, fmt, ap);
        va_end(ap);
        self->broken = true;
    }
    return KVT_EBADREQ;
}

/* Wakes the peer when its wait word says it sleeps (or is about to). */
static void s_wake(kvt_ring_t *self, _Atomic uint32_t *word)
{
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(word, memory_order_relaxed) != 0 &&
        atomic_exchange_explicit(word, 0, memory_order_relaxed) != 0) {
        s_futex_wake(word);
        self->st.wakes++;
    }
}

/* ---- region ---- */

static bool s_capacity_ok(uint64_t cap)
{
    return cap >= KVT_RING_MIN_CAPACITY && cap <= KVT_RING_MAX_CAPACITY && (cap & (cap - 1)) == 0;
}

size_t kvt_ring_region_size(uint32_t capacity)
{
    return (size_t)KVT_RING_HDR_SIZE + capacity;
}

int kvt_ring_format(void *region, size_t size, uint32_t capacity, uint32_t epoch)
{
    if (!region || ((uintptr_t)region & 7) || !s_capacity_ok(capacity) ||
        size < kvt_ring_region_size(capacity))
        return KVT_EINVAL;
    s_hdr_t *h = region;
    memset(h, 0, sizeof *h);
    atomic_init(&h->epoch, epoch);
    h->magic = KVT_RING_MAGIC;
    h->version = KVT_RING_VERSION;
    h->hdr_size = KVT_RING_HDR_SIZE;
    h->capacity = capacity;
    atomic_init(&h->head, 0);
    atomic_init(&h->tail, 0);
    atomic_init(&h->prod_wait, 0);
    atomic_init(&h->cons_wait, 0);
    atomic_init(&h->prod_closed, 0);
    atomic_init(&h->cons_closed, 0);
    atomic_thread_fence(memory_order_release);
    return 0;
}

kvt_ring_t *kvt_ring_new(void *region, size_t size, uint32_t capacity, kvt_ring_role_t role,
                         char *err, size_t errlen)
{
    s_hdr_t *h = region;
    if (role != KVT_RING_PRODUCER && role != KVT_RING_CONSUMER) {
        snprintf(err, errlen, "ring: no such role %d", (int)role);
        return NULL;
    }
    if (!region || ((uintptr_t)region & 7) || !s_capacity_ok(capacity) ||
        size < kvt_ring_region_size(capacity)) {
        snprintf(err, errlen, "ring: a region of %zu bytes cannot hold a ring of %u bytes", size,
                 capacity);
        return NULL;
    }
    /* each field read once into a local: the peer may change the region while we look */
    uint64_t magic = h->magic;
    uint32_t version = h->version, hdr_size = h->hdr_size, cap = h->capacity;
    if (magic != KVT_RING_MAGIC || version != KVT_RING_VERSION || hdr_size != KVT_RING_HDR_SIZE) {
        snprintf(err, errlen, "ring: not a version %u ring (magic %#llx, version %u, header %u)",
                 KVT_RING_VERSION, (unsigned long long)magic, version, hdr_size);
        return NULL;
    }
    if (cap != capacity) {
        snprintf(err, errlen, "ring: capacity %u, expected %u", cap, capacity);
        return NULL;
    }
    uint64_t head = atomic_load_explicit(&h->head, memory_order_acquire);
    uint64_t tail = atomic_load_explicit(&h->tail, memory_order_acquire);
    if (head - tail > capacity || ((head | tail) & 7)) {
        snprintf(err, errlen, "ring: head %llu and tail %llu do not describe a ring of %u bytes",
                 (unsigned long long)head, (unsigned long long)tail, capacity);
        return NULL;
    }
    kvt_ring_t *self = calloc(1, sizeof *self);
    if (!self) {
        snprintf(err, errlen, "ring: out of memory");
        return NULL;
    }
    self->tag = S_TAG;
    self->role = role;
    self->hdr = h;
    self->data = (uint8_t *)region + KVT_RING_HDR_SIZE;
    self->cap = capacity;
    self->mask = capacity - 1;
    self->pos = role == KVT_RING_PRODUCER ? head : tail;
    self->epoch = atomic_load_explicit(&h->epoch, memory_order_acquire);
    self->spin_max = S_DEFAULT_SPIN;
    self->st.spin = S_DEFAULT_SPIN;
    return self;
}

void kvt_ring_destroy(kvt_ring_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_ring_t *self = *self_p;
    s_check(self->tag == S_TAG);
    self->tag = 0xdeadbeefu;
    free(self);
    *self_p = NULL;
}

size_t kvt_ring_max_payload(const kvt_ring_t *self)
{
    return (size_t)(self->cap - KVT_RING_REC_HDR);
}

/* ---- the two sides' views of the ring ---- */

/* Consumer: bytes waiting (records, headers and padding), or KVT_EBADREQ. */
static int s_avail(kvt_ring_t *self, uint64_t *avail)
{
    uint64_t head = atomic_load_explicit(&self->hdr->head, memory_order_acquire);
    uint64_t n = head - self->pos;
    if (n > self->cap || (n & 7))
        return s_break(self, "head %llu is not within %llu bytes after tail %llu",
                       (unsigned long long)head, (unsigned long long)self->cap,
                       (unsigned long long)self->pos);
    *avail = n;
    return 0;
}

/* Producer: bytes free, or KVT_EBADREQ. */
static int s_free(kvt_ring_t *self, uint64_t *free_bytes)
{
    uint64_t tail = atomic_load_explicit(&self->hdr->tail, memory_order_acquire);
    uint64_t used = self->pos - tail;
    if (used > self->cap || (used & 7))
        return s_break(self, "tail %llu is not within %llu bytes before head %llu",
                       (unsigned long long)tail, (unsigned long long)self->cap,
                       (unsigned long long)self->pos);
    *free_bytes = self->cap - used;
    return 0;
}

/* The peer closed its side, or the region was formatted again for another use. */
static bool s_peer_closed(const kvt_ring_t *self)
{
    _Atomic uint32_t *w =
        self->role == KVT_RING_PRODUCER ? &self->hdr->cons_closed : &self->hdr->prod_closed;
    return atomic_load_explicit(w, memory_order_acquire) != 0 ||
           atomic_load_explicit(&self->hdr->epoch, memory_order_relaxed) != self->epoch;
}

/* Bytes of the record carrying a payload of n bytes. */
static uint64_t s_record_bytes(uint64_t n)
{
    return KVT_RING_REC_HDR + s_align8(n);
}

/* 1 when the side can go on (a record to pop; room for a `need`-byte payload), 0 when not yet,
 * or a negative code. */
static int s_ready(kvt_ring_t *self, size_t need)
{
    if (self->broken)
        return KVT_EBADREQ;
    int rc;
    if (atomic_load_explicit(&self->hdr->epoch, memory_order_relaxed) != self->epoch)
        return KVT_EUNAVAIL; /* formatted again: nothing of this use is left */
    if (self->role == KVT_RING_CONSUMER) {
        uint64_t avail;
        if ((rc = s_avail(self, &avail)))
            return rc;
        if (avail)
            return 1;
        if (!s_peer_closed(self))
            return 0;
        /* closed: what was pushed before the close is still ours to take */
        if ((rc = s_avail(self, &avail)))
            return rc;
        return avail ? 1 : KVT_EUNAVAIL;
    }
    if (need > kvt_ring_max_payload(self))
        return KVT_ETOOBIG;
    if (s_peer_closed(self))
        return KVT_EUNAVAIL;
    uint64_t free_bytes;
    if ((rc = s_free(self, &free_bytes)))
        return rc;
    return free_bytes >= s_record_bytes(need) ? 1 : 0;
}

/* ---- producer ---- */

static void s_copy_in(kvt_ring_t *self, uint64_t pos, const void *src, size_t n)
{
    uint64_t off = pos & self->mask;
    size_t first = n < self->cap - off ? n : (size_t)(self->cap - off);
    memcpy(self->data + off, src, first);
    if (n > first)
        memcpy(self->data, (const uint8_t *)src + first, n - first);
}

static void s_copy_out(const kvt_ring_t *self, uint64_t pos, void *dst, size_t n)
{
    uint64_t off = pos & self->mask;
    size_t first = n < self->cap - off ? n : (size_t)(self->cap - off);
    memcpy(dst, self->data + off, first);
    if (n > first)
        memcpy((uint8_t *)dst + first, self->data, n - first);
}

size_t kvt_ring_msg_size(const kvt_ring_iov_t *frames, uint32_t nframes)
{
    uint64_t n = 4;
    for (uint32_t i = 0; i < nframes; i++) {
        if (frames[i].len > UINT32_MAX)
            return SIZE_MAX;
        n += 4 + (uint64_t)frames[i].len;
        if (n > UINT32_MAX)
            return SIZE_MAX;
    }
    return (size_t)n;
}

int kvt_ring_push_later(kvt_ring_t *self, const kvt_ring_iov_t *frames, uint32_t nframes)
{
    s_check(self && self->tag == S_TAG && self->role == KVT_RING_PRODUCER);
    if (self->broken)
        return KVT_EBADREQ;
    size_t plen = kvt_ring_msg_size(frames, nframes);
    if (plen == SIZE_MAX || plen > kvt_ring_max_payload(self))
        return KVT_ETOOBIG;
    if (s_peer_closed(self))
        return KVT_EUNAVAIL;
    uint64_t free_bytes, total = s_record_bytes(plen);
    int rc = s_free(self, &free_bytes);
    if (rc)
        return rc;
    if (free_bytes < total)
        return KVT_EBUSY;
    uint32_t rh[2] = {(uint32_t)plen, KVT_RING_KIND_MSG};
    s_copy_in(self, self->pos, rh, sizeof rh);
    uint64_t p = self->pos + KVT_RING_REC_HDR;
    uint32_t n32 = nframes;
    s_copy_in(self, p, &n32, 4);
    p += 4;
    for (uint32_t i = 0; i < nframes; i++) {
        uint32_t l = (uint32_t)frames[i].len;
        s_copy_in(self, p, &l, 4);
        p += 4;
        if (l)
            s_copy_in(self, p, frames[i].ptr, l);
        p += l;
    }
    self->pos += total;
    atomic_store_explicit(&self->hdr->head, self->pos, memory_order_release);
    self->st.records++;
    self->st.bytes += total;
    return 0;
}

void kvt_ring_wake(kvt_ring_t *self)
{
    s_check(self && self->tag == S_TAG && self->role == KVT_RING_PRODUCER);
    s_wake(self, &self->hdr->cons_wait);
}

int kvt_ring_push(kvt_ring_t *self, const kvt_ring_iov_t *frames, uint32_t nframes)
{
    int rc = kvt_ring_push_later(self, frames, nframes);
    if (rc == 0)
        s_wake(self, &self->hdr->cons_wait);
    return rc;
}

/* ---- consumer ---- */

int kvt_ring_pop(kvt_ring_t *self, void *buf, size_t cap, size_t *len)
{
    s_check(self && self->tag == S_TAG && self->role == KVT_RING_CONSUMER);
    *len = 0;
    int rc = s_ready(self, 0);
    if (rc <= 0)
        return rc == 0 ? KVT_EBUSY : rc;
    uint64_t avail;
    if ((rc = s_avail(self, &avail)))
        return rc;
    /* avail is a non-zero multiple of 8, so the 8-byte record header is there */
    uint32_t rh[2];
    s_copy_out(self, self->pos, rh, sizeof rh);
    if (rh[1] != KVT_RING_KIND_MSG)
        return s_break(self, "record at %llu has kind %u", (unsigned long long)self->pos, rh[1]);
    uint64_t total = s_record_bytes(rh[0]);
    if (total > avail)
        return s_break(self, "record at %llu of %u bytes runs past head (%llu bytes waiting)",
                       (unsigned long long)self->pos, rh[0], (unsigned long long)avail);
    if (rh[0] > cap) {
        *len = rh[0];
        return KVT_ETOOBIG;
    }
    s_copy_out(self, self->pos + KVT_RING_REC_HDR, buf, rh[0]);
    *len = rh[0];
    self->pos += total;
    atomic_store_explicit(&self->hdr->tail, self->pos, memory_order_release);
    self->st.records++;
    self->st.bytes += total;
    s_wake(self, &self->hdr->prod_wait);
    return 0;
}

static uint32_t s_rd32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

int kvt_ring_parse(const uint8_t *buf, size_t len, kvt_ring_frame_t *frames, uint32_t max,
                   uint32_t *nframes)
{
    *nframes = 0;
    if (len < 4)
        return KVT_EBADREQ;
    uint32_t count = s_rd32(buf);
    if (count > max)
        return KVT_ETOOBIG;
    size_t p = 4;
    for (uint32_t i = 0; i < count; i++) {
        if (len - p < 4)
            return KVT_EBADREQ;
        uint32_t fl = s_rd32(buf + p);
        p += 4;
        if (fl > len - p)
            return KVT_EBADREQ;
        frames[i].ptr = buf + p;
        frames[i].len = fl;
        p += fl;
    }
    if (p != len)
        return KVT_EBADREQ;
    *nframes = count;
    return 0;
}

/* ---- waiting ---- */

void kvt_ring_cool(kvt_ring_cool_t *c, int64_t now)
{
    int64_t quiet = now - c->until; /* since the last pause ended (< 0: within it) */
    if (!c->len)
        c->len = S_COOL_MIN_NS;
    else if (quiet < S_COOL_AGAIN_NS)
        c->len = c->len * 2 > S_COOL_MAX_NS ? S_COOL_MAX_NS : c->len * 2;
    else /* halved for each quiet S_COOL_AGAIN_NS */
        c->len = quiet / S_COOL_AGAIN_NS >= 63 ? 0 : c->len >> (quiet / S_COOL_AGAIN_NS);
    if (c->len < S_COOL_MIN_NS)
        c->len = S_COOL_MIN_NS;
    c->until = now + c->len;
}

/* This side's spinning lost the CPU: sleep at once for a while, then start small. */
static void s_cool(kvt_ring_t *self, int64_t now)
{
    kvt_ring_cool(&self->cool, now);
    self->st.cooled++;
    uint32_t floor = S_MIN_SPIN < self->spin_max ? S_MIN_SPIN : self->spin_max;
    self->st.spin = floor;
}

int kvt_ring_wait(kvt_ring_t *self, size_t need, int64_t timeout_ns)
{
    s_check(self && self->tag == S_TAG);
    int rc = s_ready(self, need);
    if (rc)
        return rc < 0 ? rc : 0;
    if (timeout_ns == 0)
        return KVT_ETIMEDOUT;
    int64_t t0 = s_now_ns();
    int64_t deadline = timeout_ns < 0 || timeout_ns > INT64_MAX - t0 ? INT64_MAX : t0 + timeout_ns;
    /* Spinning pays only while this side and the peer both have a CPU. When the CPUs are
     * busy (CPU-bound neighbours, more spinners than cores) a spinner is descheduled mid-spin
     * and holds the CPU the peer needs: it then sleeps at once for a pause (kvt_ring_cool),
     * and spins again (from the small budget up) only after that. */
    uint32_t spin = t0 < self->cool.until ? 0 : self->st.spin;
    int64_t last = t0;
    for (uint32_t i = 0; i < spin; i++) {
        s_relax();
        if ((rc = s_ready(self, need))) {
            if (rc > 0) {
                self->st.spin_hits++;
                int64_t now = s_now_ns();
                if (now - last > KVT_RING_PREEMPTED_NS) /* served, but after losing the CPU */
                    s_cool(self, now);
                else
                    self->st.spin =
                        self->st.spin * 2 > self->spin_max ? self->spin_max : self->st.spin * 2;
            }
            return rc < 0 ? rc : 0;
        }
        if ((i + 1) % S_SPIN_CLOCK_EVERY == 0) {
            int64_t now = s_now_ns();
            if (now - last >
                KVT_RING_PREEMPTED_NS) { /* lost the CPU (whatever the deadline says) */
                s_cool(self, now);
                break;
            }
            if (now >= deadline)
                break;
            last = now;
        }
    }
    _Atomic uint32_t *word =
        self->role == KVT_RING_CONSUMER ? &self->hdr->cons_wait : &self->hdr->prod_wait;
    bool slept = false;
    for (;;) {
        atomic_store_explicit(word, 1, memory_order_seq_cst);
        atomic_thread_fence(memory_order_seq_cst);
        if ((rc = s_ready(self, need)))
            break;
        int64_t now = s_now_ns();
        if (now >= deadline) {
            rc = KVT_ETIMEDOUT;
            break;
        }
        int64_t left = deadline - now;
        s_futex_wait(word, 1, left < S_MAX_SLEEP_NS ? left : S_MAX_SLEEP_NS);
        self->st.sleeps++;
        slept = true;
    }
    atomic_store_explicit(word, 0, memory_order_relaxed);
    if (slept && self->spin_max && s_now_ns() >= self->cool.until) {
        /* adapt: a wait short enough that spinning would have served it earns a longer spin */
        if (rc > 0 && s_now_ns() - t0 < S_SPIN_WORTH_NS)
            self->st.spin = self->st.spin * 2 > self->spin_max ? self->spin_max : self->st.spin * 2;
        else {
            uint32_t floor = S_MIN_SPIN < self->spin_max ? S_MIN_SPIN : self->spin_max;
            self->st.spin = self->st.spin / 2 < floor ? floor : self->st.spin / 2;
        }
    }
    return rc < 0 ? rc : 0;
}

int kvt_ring_arm(kvt_ring_t *self, size_t need, uint32_t **word)
{
    s_check(self && self->tag == S_TAG && word);
    _Atomic uint32_t *w =
        self->role == KVT_RING_CONSUMER ? &self->hdr->cons_wait : &self->hdr->prod_wait;
    atomic_store_explicit(w, 1, memory_order_seq_cst);
    atomic_thread_fence(memory_order_seq_cst);
    *word = (uint32_t *)w;
    int rc = s_ready(self, need);
    if (rc == 0)
        self->st.sleeps++;
    return rc;
}

void kvt_ring_disarm(kvt_ring_t *self)
{
    s_check(self && self->tag == S_TAG);
    _Atomic uint32_t *w =
        self->role == KVT_RING_CONSUMER ? &self->hdr->cons_wait : &self->hdr->prod_wait;
    atomic_store_explicit(w, 0, memory_order_relaxed);
}

void kvt_ring_close(kvt_ring_t *self)
{
    s_check(self && self->tag == S_TAG);
    s_hdr_t *h = self->hdr;
    /* formatted again since attach: the region is another client's now (the daemon reuses a
     * closed slot after a quarantine), and its flags are not this handle's to set */
    if (atomic_load_explicit(&h->epoch, memory_order_acquire) != self->epoch)
        return;
    _Atomic uint32_t *mine = self->role == KVT_RING_PRODUCER ? &h->prod_closed : &h->cons_closed;
    _Atomic uint32_t *peer_word = self->role == KVT_RING_PRODUCER ? &h->cons_wait : &h->prod_wait;
    atomic_store_explicit(mine, 1, memory_order_release);
    s_wake(self, peer_word);
}

bool kvt_ring_broken(const kvt_ring_t *self)
{
    return self->broken;
}

const char *kvt_ring_why(const kvt_ring_t *self)
{
    return self->why;
}

void kvt_ring_set_spin(kvt_ring_t *self, uint32_t max_iterations)
{
    self->spin_max = max_iterations;
    self->st.spin = max_iterations;
}

void kvt_ring_stats(const kvt_ring_t *self, kvt_ring_stats_t *out)
{
    *out = self->st;
}
