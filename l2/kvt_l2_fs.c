/* DESIGN: the `fs` L2 adapter — objects under one directory (local NVMe), in one of two layouts.
 *
 * Spec: "fs:DIR[,capacity=SIZE][,direct=auto|on|off][,sync=batch|object|none]
 *        [,layout=auto|segments|files][,segment_size=SIZE]".
 * layout=segments (the default for a new directory; auto keeps a directory's layout): objects
 * are records appended to large segment files, DIR/seg/ (kvt_seglog.h has the format). A store
 * costs its data and no filesystem metadata; remove appends a tombstone; capacity bounds the
 * segment files, and when they would exceed it the oldest segment goes with the objects it still
 * holds (FIFO by segment: evictions counted like the files layout's). The index is rebuilt at
 * open from the segments' footers, in write order. sync=object fdatasyncs the segment after
 * every record, batch leaves it to flush()'s syncfs, none to the kernel.
 * layout=files: one file per object, as below. Layout of DIR:
 *   DIR/.lock       flock()ed while open: two daemons on one DIR would unlink each other's
 *                   temp files and keep two different indexes, so the second open is refused.
 *   DIR/.tmp/       NAME.<seq> files being written; anything found there at open is a leftover
 *                   of a crash and is removed.
 *   DIR/xx/NAME     the objects; xx = two hex digits of XXH3_64(NAME), so that the 256
 *                   directories stay small and evenly filled whatever the names look like (the
 *                   first characters of kvt_l2_name are the namespace hash, shared by all keys).
 * Anything else (other files, hidden files, names in the wrong xx) is foreign and left alone.
 *
 * store writes DIR/.tmp/NAME.<seq> and renames it over DIR/xx/NAME: a crash of the daemon
 * leaves the old object, the new one or none, never a torn one. What a crash of the machine
 * leaves depends on `sync`:
 *   object  the temp file is fdatasync()ed before the rename and DIR/xx fsync()ed after it: a
 *           store that returned is on the disk (one or two journal commits per object);
 *   batch   (default) no sync per store; flush() — which the daemon calls after each group of
 *           writes, before it reports any of them as written — runs one syncfs() for them all.
 *           A machine crash may leave renamed files whose bytes never reached the disk (zeros
 *           or a short file): the daemon's trailer checksum refuses those on load;
 *   none    nothing is synced: the kernel writes back in its own time. Survives a crash of the
 *           daemon (the page cache has it), not of the machine.
 * With O_DIRECT (direct=on, or auto when the probe at open succeeds) the 4 KiB-aligned body is
 * written from the caller's buffer and the tail (less than a page, plus the trailer) through the
 * page cache; direct=auto turns O_DIRECT off for good the first time the kernel answers EINVAL.
 * remove and eviction do not fsync the directory: an object that a crash brings back is the same
 * bytes under the same content-addressed key, and at worst is evicted again.
 *
 * The index (name -> size, generation; chained hash table plus an LRU list, head = most
 * recently stored or loaded) is rebuilt at open by scanning DIR, in mtime order, so lookup and
 * usage never touch the disk. The list replaces an access tick: same order, O(1) eviction.
 *
 * Threads: any number of the adapter's threads (max_threads) may call store, load, lookup,
 * remove, health and usage at once; open and close are single-threaded. No lock is held
 * across data I/O. Locks, in order:
 *   stripe[hash(NAME) % 64]  serialises the namespace operations on one name (rename + index
 *                            update in store; unlink + index update in remove and eviction),
 *                            so the index never disagrees with the directory after a race;
 *   lock                     the index, the usage counters, the LRU list and the health state.
 * No thread holds two stripes, and `lock` is never held while taking a stripe. A load does not
 * take the stripe: it reads whatever file the name has (rename is atomic) and, when the file
 * has vanished, drops the index entry only if it is still the generation the load saw.
 *
 * Capacity: a store first reserves its length and evicts least-recently-used objects until the
 * committed bytes plus the reservations fit (crediting the object it replaces), then evicts
 * again after its commit, since concurrent stores may each have found the space free. */
#include "kvt_error.h"
#include "kvt_l2.h"
#include "kvt_log.h"
#include "kvt_seglog.h"
#include "kvt_size.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define S_TAG 0x4b564653u      /* "KVFS" */
#define S_TAG_DEAD 0xdeadf500u /* poisoned by close */
#define S_ALIGN 4096u          /* O_DIRECT buffer, offset and length alignment */
#define S_STRIPES 64u
#define S_BUCKETS0 1024u
/* Longest accepted name: leaves room for ".<seq>" in the temp name within NAME_MAX (255). */
#define S_NAME_MAX 200u
/* A failed store keeps health red this long (long enough for /readyz polls to see it). */
#define S_HEALTH_WINDOW_MS 10000u
#define S_ERRREP_MS 10000u
#define S_TMPDIR ".tmp"
#define S_LOCKFILE ".lock"

typedef enum { S_DIRECT_OFF, S_DIRECT_AUTO, S_DIRECT_ON } s_direct_t;
typedef enum { S_SYNC_BATCH, S_SYNC_OBJECT, S_SYNC_NONE } s_sync_t;
typedef enum { S_LAYOUT_AUTO, S_LAYOUT_SEGMENTS, S_LAYOUT_FILES } s_layout_t;
/* Default segment size: large enough that creating one is rare, small enough that the oldest
 * one is a small part of a typical capacity. */
#define S_SEGMENT_SIZE (256ull << 20)

typedef struct s_obj {
    struct s_obj *hnext; /* hash chain */
    struct s_obj *newer; /* LRU neighbours */
    struct s_obj *older;
    uint64_t hash; /* XXH3_64 of the name */
    uint64_t size;
    uint64_t gen;          /* unique per commit: tells a re-stored object from the one seen */
    struct timespec mtime; /* at open only: the scan's sort key */
    kvt_segloc_t loc;      /* layout=segments: where the record is */
    bool hit;              /* layout=segments: loaded since written: a reclaim moves it */
    char name[];
} s_obj_t;

typedef struct {
    uint32_t tag;
    char *path; /* DIR, resolved: messages and health */
    int dirfd;
    int lockfd;
    dev_t dev; /* DIR's identity, to tell when it was removed or replaced */
    ino_t ino;
    uint64_t capacity; /* 0 = unlimited */
    s_direct_t mode;
    s_sync_t sync;
    s_layout_t layout;
    uint64_t segment_size;
    kvt_seglog_t *log;         /* layout=segments */
    pthread_mutex_t room_lock; /* layout=segments: one reclaim at a time, and room_held */
    uint64_t room_held;        /* bytes granted by s_seg_room to appends still running */
    atomic_bool direct;        /* O_DIRECT in use now: auto may switch it off once */
    atomic_uint_fast64_t seq;
    /* sync=batch: stores that returned so far, and how many of them the last syncfs covered
     * (taken before it started). flush_lock makes concurrent flushes share one syncfs. */
    atomic_uint_fast64_t stores_done;
    atomic_uint_fast64_t stores_synced;
    pthread_mutex_t flush_lock;
    pthread_mutex_t stripes[S_STRIPES];

    pthread_mutex_t lock; /* guards every field below */
    s_obj_t **buckets;
    size_t nbuckets; /* a power of two */
    s_obj_t *newest, *oldest;
    uint64_t used, objects;
    uint64_t reserved; /* bytes of stores in flight (only counted with a capacity) */
    uint64_t next_gen;
    uint64_t fail_ms; /* kvt_now_ms() of the last failed store, 0 after a success */
    int fail_errno;
    kvt_errrep_t rep;
} s_fs_t;

static void s_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void s_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || !errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static bool s_is(const s_fs_t *self)
{
    return self && self->tag == S_TAG;
}

/* A disk errno as a KVT_E* code: a full disk or quota is "no space", the rest is I/O. */
static int s_code(int e)
{
    switch (e) {
    case ENOSPC:
    case EDQUOT:
        return KVT_ENOSPC;
    case ENOMEM:
        return KVT_ENOMEM;
    default:
        return KVT_EIO;
    }
}

/* Names are opaque, but they become path components: no '/', no leading '.' (hidden entries
 * are the adapter's own), printable ASCII, and short enough for the temp name. */
static bool s_name_ok(const char *name, size_t *len)
{
    if (!name || name[0] == '\0' || name[0] == '.')
        return false;
    size_t n = 0;
    for (; name[n]; n++) {
        unsigned char c = (unsigned char)name[n];
        if (c <= 0x20 || c >= 0x7f || c == '/' || n >= S_NAME_MAX)
            return false;
    }
    *len = n;
    return true;
}

static uint64_t s_hash(const char *name, size_t len)
{
    return XXH3_64bits(name, len);
}

/* "xx/NAME": the fan-out directory is the low byte of the name's hash. */
static void s_rel(char *out, size_t outlen, const char *name, uint64_t hash)
{
    snprintf(out, outlen, "%02x/%s", (unsigned)(hash & 0xff), name);
}

static pthread_mutex_t *s_stripe(s_fs_t *self, uint64_t hash)
{
    return &self->stripes[(hash >> 8) % S_STRIPES];
}

/* ---- index (under self->lock) ------------------------------------------------------------- */

static s_obj_t *s_find(const s_fs_t *self, const char *name, uint64_t hash)
{
    for (s_obj_t *o = self->buckets[hash & (self->nbuckets - 1)]; o; o = o->hnext)
        if (o->hash == hash && strcmp(o->name, name) == 0)
            return o;
    return NULL;
}

static void s_lru_unlink(s_fs_t *self, s_obj_t *o)
{
    if (o->newer)
        o->newer->older = o->older;
    else
        self->newest = o->older;
    if (o->older)
        o->older->newer = o->newer;
    else
        self->oldest = o->newer;
    o->newer = o->older = NULL;
}

static void s_lru_push(s_fs_t *self, s_obj_t *o)
{
    o->newer = NULL;
    o->older = self->newest;
    if (self->newest)
        self->newest->newer = o;
    else
        self->oldest = o;
    self->newest = o;
}

/* Doubles the table when it is full; a failed allocation only leaves longer chains. */
static void s_grow(s_fs_t *self)
{
    size_t n = self->nbuckets * 2;
    s_obj_t **b = calloc(n, sizeof *b);
    if (!b)
        return;
    for (size_t i = 0; i < self->nbuckets; i++) {
        s_obj_t *o = self->buckets[i];
        while (o) {
            s_obj_t *next = o->hnext;
            o->hnext = b[o->hash & (n - 1)];
            b[o->hash & (n - 1)] = o;
            o = next;
        }
    }
    free(self->buckets);
    self->buckets = b;
    self->nbuckets = n;
}

/* Adds o as the most recently used object; the caller has checked that its name is absent. */
static void s_insert(s_fs_t *self, s_obj_t *o)
{
    if (self->objects >= self->nbuckets)
        s_grow(self);
    s_obj_t **b = &self->buckets[o->hash & (self->nbuckets - 1)];
    o->hnext = *b;
    *b = o;
    s_lru_push(self, o);
    o->gen = ++self->next_gen;
    self->used += o->size;
    self->objects++;
}

/* Takes o out of the index; the caller frees it. */
static void s_detach(s_fs_t *self, s_obj_t *o)
{
    s_obj_t **p = &self->buckets[o->hash & (self->nbuckets - 1)];
    while (*p != o)
        p = &(*p)->hnext;
    *p = o->hnext;
    s_lru_unlink(self, o);
    self->used -= o->size;
    self->objects--;
}

/* Drops the index entry of `name` if it is still generation `gen`; returns it (to free). */
static s_obj_t *s_forget(s_fs_t *self, const char *name, uint64_t hash, uint64_t gen)
{
    pthread_mutex_lock(&self->lock);
    s_obj_t *o = s_find(self, name, hash);
    if (o && o->gen == gen)
        s_detach(self, o);
    else
        o = NULL;
    pthread_mutex_unlock(&self->lock);
    return o;
}

/* ---- eviction ----------------------------------------------------------------------------- */

/* Evicts `name` if it is still generation `gen`: under its stripe, so that a store of the same
 * name cannot slip its new file in between the index update and the unlink. */
static void s_evict(s_fs_t *self, const char *name, uint64_t hash, uint64_t gen)
{
    pthread_mutex_t *stripe = s_stripe(self, hash);
    pthread_mutex_lock(stripe);
    s_obj_t *o = s_forget(self, name, hash, gen);
    if (o) {
        char rel[S_NAME_MAX + 8];
        s_rel(rel, sizeof rel, name, hash);
        /* A file that cannot be unlinked is only forgotten: the next open counts it again. */
        if (unlinkat(self->dirfd, rel, 0) != 0 && errno != ENOENT)
            kvt_errrep_report(&self->rep, KVT_LOG_WARN, "l2 fs:%s: evict %s: %s", self->path, rel,
                              strerror(errno));
    }
    pthread_mutex_unlock(stripe);
    free(o);
}

/* Evicts least-recently-used objects until the committed bytes plus the reservations fit the
 * capacity, never `keep` (the object being stored). With `credit_keep`, the bytes of the old
 * `keep` do not count: the store in flight replaces them. Returns when it fits or when only
 * `keep` is left (concurrent reservations may then overshoot until their own commits). */
static void s_make_room(s_fs_t *self, const char *keep, uint64_t keep_hash, bool credit_keep)
{
    char victim[S_NAME_MAX + 1];
    for (;;) {
        pthread_mutex_lock(&self->lock);
        s_obj_t *k = s_find(self, keep, keep_hash);
        uint64_t want = self->used + self->reserved - (credit_keep && k ? k->size : 0);
        s_obj_t *v = self->oldest;
        if (v && v == k)
            v = v->newer;
        if (want <= self->capacity || !v) {
            pthread_mutex_unlock(&self->lock);
            return;
        }
        uint64_t vhash = v->hash, vgen = v->gen;
        memcpy(victim, v->name, strlen(v->name) + 1);
        pthread_mutex_unlock(&self->lock);
        s_evict(self, victim, vhash, vgen);
    }
}

/* ---- I/O helpers (return 0 or a positive errno) ------------------------------------------- */

static size_t s_iov_total(const struct iovec *iov, int n)
{
    size_t t = 0;
    for (int i = 0; i < n; i++)
        t += iov[i].iov_len;
    return t;
}

/* pwritev / preadv of the first `len` bytes of iov at file offset `off`, resuming after short
 * transfers. A read that ends early means the file was truncated behind our back (EIO). */
static int s_rwv_all(int fd, bool write, const struct iovec *iov, int n, size_t len, off_t off,
                     size_t *done)
{
    struct iovec v[KVT_L2_IOV_MAX];
    int k = 0;
    for (size_t left = len; k < n && k < KVT_L2_IOV_MAX && left; k++) {
        v[k] = iov[k];
        if (v[k].iov_len > left)
            v[k].iov_len = left;
        left -= v[k].iov_len;
    }
    *done = 0;
    for (int i = 0; *done < len && i < k;) {
        ssize_t r = write ? pwritev(fd, v + i, k - i, off + (off_t)*done)
                          : preadv(fd, v + i, k - i, off + (off_t)*done);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (r == 0)
            return EIO;
        *done += (size_t)r;
        size_t adv = (size_t)r;
        for (; i < k && adv >= v[i].iov_len; i++)
            adv -= v[i].iov_len;
        if (i < k) {
            v[i].iov_base = (char *)v[i].iov_base + adv;
            v[i].iov_len -= adv;
        }
    }
    return 0;
}

static int s_pwrite_all(int fd, const void *buf, size_t len, off_t off, size_t *done)
{
    struct iovec iov = {(void *)buf, len};
    return s_rwv_all(fd, true, &iov, 1, len, off, done);
}

/* Turns O_DIRECT off on fd (F_SETFL may change it on Linux): for the unaligned tail. */
static int s_buffered(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 || fcntl(fd, F_SETFL, fl & ~O_DIRECT) != 0 ? errno : 0;
}

/* The part of a direct transfer after its aligned body: O_DIRECT off, then `len` bytes at file
 * offset `body` from or into iov past its first `body` bytes (the body lies in iov[0]). */
static int s_tail(int fd, bool write, const struct iovec *iov, int n, size_t body, size_t len,
                  size_t *done)
{
    *done = 0;
    int e = s_buffered(fd);
    if (e)
        return e;
    struct iovec rest[KVT_L2_IOV_MAX];
    int k = 0;
    for (int i = 0; i < n; i++) {
        size_t skip = i == 0 ? body : 0;
        if (iov[i].iov_len > skip)
            rest[k++] = (struct iovec){(char *)iov[i].iov_base + skip, iov[i].iov_len - skip};
    }
    return s_rwv_all(fd, write, rest, k, len, (off_t)body, done);
}

/* O_DIRECT write: the aligned body straight from the first (aligned) vector, then O_DIRECT off
 * and the rest — the first vector's tail and the others, in the daemon's case less than a page
 * plus the trailer — through the page cache, from the caller's vectors. The file gets its exact
 * length with no truncate: truncating a directly written file to mid-block makes the kernel
 * read and zero that block, one synchronous read per object. An EINVAL after the first bytes
 * went out is not a refusal of O_DIRECT but a failed write. */
static int s_write_direct(int fd, const struct iovec *iov, int n)
{
    size_t total = s_iov_total(iov, n);
    size_t body = iov[0].iov_len & ~(size_t)(S_ALIGN - 1), done = 0;
    int e = s_pwrite_all(fd, iov[0].iov_base, body, 0, &done);
    if (!e && body < total) {
        size_t tdone = 0;
        e = s_tail(fd, true, iov, n, body, total - body, &tdone);
        done += tdone;
    }
    if (e == EINVAL && done > 0)
        e = EIO;
    return e;
}

static void s_direct_refused(s_fs_t *self, const char *what)
{
    if (atomic_exchange(&self->direct, false))
        kvt_log(KVT_LOG_INFO, "l2 fs:%s: O_DIRECT refused on %s, using buffered I/O", self->path,
                what);
}

/* Creates and fills the temp file `tmp` (fdatasynced with sync=object); removes it on any
 * error. */
static int s_write_tmp(s_fs_t *self, const char *tmp, const struct iovec *iov, int n)
{
    bool direct = atomic_load(&self->direct) && (uintptr_t)iov[0].iov_base % S_ALIGN == 0;
    for (;;) {
        int fd = openat(self->dirfd, tmp,
                        O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | (direct ? O_DIRECT : 0), 0600);
        int e = fd < 0 ? errno : 0;
        bool refused = e == EINVAL; /* only open and write answers say "no O_DIRECT here" */
        if (fd >= 0) {
            size_t done;
            e = direct ? s_write_direct(fd, iov, n)
                       : s_rwv_all(fd, true, iov, n, s_iov_total(iov, n), 0, &done);
            refused = e == EINVAL;
            if (!e && self->sync == S_SYNC_OBJECT && fdatasync(fd) != 0)
                e = errno;
            if (close(fd) != 0 && !e && errno != EINTR)
                e = errno;
            if (e)
                unlinkat(self->dirfd, tmp, 0);
        }
        if (refused && direct && self->mode == S_DIRECT_AUTO) {
            s_direct_refused(self, fd < 0 ? "open" : "write");
            direct = false;
            continue;
        }
        return e;
    }
}

static int s_fsync_dir(int dirfd, const char *rel)
{
    int fd = openat(dirfd, rel, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    int e = fsync(fd) != 0 ? errno : 0;
    close(fd);
    return e;
}

/* Renames the temp file over the object (made durable with sync=object), under the name's
 * stripe, then swaps o into the index (o is owned by the index on success). */
static int s_commit(s_fs_t *self, const char *tmp, s_obj_t *o)
{
    char rel[S_NAME_MAX + 8], sub[3];
    s_rel(rel, sizeof rel, o->name, o->hash);
    memcpy(sub, rel, 2);
    sub[2] = '\0';
    pthread_mutex_t *stripe = s_stripe(self, o->hash);
    pthread_mutex_lock(stripe);
    bool durable = self->sync == S_SYNC_OBJECT;
    int e = renameat(self->dirfd, tmp, self->dirfd, rel) != 0 ? errno : 0;
    if (e == ENOENT) {
        /* First object of this fan-out directory: create it (and make that durable). */
        if (mkdirat(self->dirfd, sub, 0700) == 0)
            e = durable && fsync(self->dirfd) != 0 ? errno : 0;
        else
            e = errno == EEXIST ? 0 : errno;
        if (!e)
            e = renameat(self->dirfd, tmp, self->dirfd, rel) != 0 ? errno : 0;
    }
    bool renamed = !e;
    if (!e && durable)
        e = s_fsync_dir(self->dirfd, sub);
    if (e) {
        /* Not durable is not stored: a store that reports failure leaves no new object. The old
         * one is gone too once the rename happened, so its index entry goes with it. */
        unlinkat(self->dirfd, renamed ? rel : tmp, 0);
    }
    pthread_mutex_lock(&self->lock);
    s_obj_t *old = s_find(self, o->name, o->hash);
    if (old && renamed)
        s_detach(self, old);
    else
        old = NULL;
    if (!e)
        s_insert(self, o);
    pthread_mutex_unlock(&self->lock);
    pthread_mutex_unlock(stripe);
    free(old);
    return e;
}

/* ---- layout=segments ---------------------------------------------------------------------- */

typedef struct {
    uint64_t hash, gen, size;
    char name[S_NAME_MAX + 1];
} s_cand_t;

/* Moves one object of the segment being reclaimed to a new record, under its name's stripe (if
 * free: the reclaimer may hold another stripe, and must not wait for one). 1: moved; 0: nothing
 * to move (replaced or removed meanwhile); -1: not moved (the stripe was busy, an I/O error). */
static int s_seg_move(s_fs_t *self, kvt_seg_t *seg, const s_cand_t *c)
{
    pthread_mutex_t *stripe = s_stripe(self, c->hash);
    if (pthread_mutex_trylock(stripe) != 0)
        return -1;
    pthread_mutex_lock(&self->lock);
    s_obj_t *o = s_find(self, c->name, c->hash);
    bool same = o && o->gen == c->gen && o->loc.seg == seg;
    kvt_segloc_t loc = same ? o->loc : (kvt_segloc_t){0};
    pthread_mutex_unlock(&self->lock);
    if (!same) {
        pthread_mutex_unlock(stripe);
        return 0;
    }
    size_t cap = (c->size + S_ALIGN - 1) & ~(size_t)(S_ALIGN - 1);
    void *b = aligned_alloc(S_ALIGN, cap ? cap : S_ALIGN);
    bool moved = false;
    if (b) {
        struct iovec rd = {b, cap}, wr = {b, c->size};
        kvt_segloc_t nloc;
        if (kvt_seglog_read(self->log, &loc, c->size, &rd, 1) == 0 &&
            kvt_seglog_append(self->log, c->name, strlen(c->name), &wr, 1, &nloc) == 0) {
            pthread_mutex_lock(&self->lock);
            o = s_find(self, c->name, c->hash);
            moved = o && o->gen == c->gen;
            if (moved) { /* the old record goes with its segment: no kvt_seglog_dead */
                o->loc = nloc;
                o->hit = false;
            } else {
                kvt_seglog_dead(self->log, &nloc);
            }
            pthread_mutex_unlock(&self->lock);
            kvt_seglog_done(self->log, &nloc);
        }
        free(b);
    }
    pthread_mutex_unlock(stripe);
    return moved ? 1 : -1;
}

/* The live objects of seg (all of them, or those loaded since written), most recently used
 * first, up to `budget` bytes. */
static size_t s_seg_cands(s_fs_t *self, kvt_seg_t *seg, bool hits_only, uint64_t budget,
                          s_cand_t **out)
{
    s_cand_t *c = NULL;
    size_t n = 0, cap = 0;
    pthread_mutex_lock(&self->lock);
    for (s_obj_t *o = self->newest; o; o = o->older) {
        if (o->loc.seg != seg || (hits_only && !o->hit) || o->size > budget)
            continue;
        if (n == cap) {
            size_t ncap = cap ? cap * 2 : 16;
            s_cand_t *x = realloc(c, ncap * sizeof *x);
            if (!x)
                break;
            c = x;
            cap = ncap;
        }
        c[n] = (s_cand_t){o->hash, o->gen, o->size, ""};
        memcpy(c[n++].name, o->name, strlen(o->name) + 1);
        budget -= o->size;
    }
    pthread_mutex_unlock(&self->lock);
    *out = c;
    return n;
}

/* sync=batch: moved records reach the disk before the segment that held them is deleted (a
 * machine crash in between would lose objects already announced as written). */
static int s_seg_settle(s_fs_t *self, uint64_t moved)
{
    return moved && self->sync == S_SYNC_BATCH && syncfs(self->dirfd) != 0 ? errno : 0;
}

/* Compaction, for the dead space a capacity would never reclaim: when the oldest segment (or the
 * whole log) is mostly dead, its live objects move to new records and it goes. Runs at flush,
 * where no stripe is held, one segment per flush (a flush delays its group's announcement); a
 * busy stripe leaves the segment for the next one. */
static void s_seg_compact(s_fs_t *self)
{
    if (pthread_mutex_trylock(&self->room_lock) != 0)
        return; /* a reclaim is running */
    kvt_seg_t *seg = kvt_seglog_sparse(self->log);
    if (seg) {
        s_cand_t *c;
        size_t n = s_seg_cands(self, seg, false, UINT64_MAX, &c);
        bool all = true;
        for (size_t i = 0; i < n && all; i++)
            all = s_seg_move(self, seg, &c[i]) >= 0;
        free(c);
        if (!all || s_seg_settle(self, n) != 0)
            kvt_seglog_unclaim(self->log, seg);
        else
            kvt_seglog_reclaim(self->log, seg); /* every entry that pointed into it moved */
    }
    pthread_mutex_unlock(&self->room_lock);
}

/* Reclaim's second chance: objects loaded since they were written move to a new segment
 * instead of going with the old one, up to half a segment's bytes per reclaim (so a reclaim
 * always frees room) — FIFO with reinsertion, close to LRU at a fraction of its writes. */
static uint64_t s_seg_rescue(s_fs_t *self, kvt_seg_t *seg, uint64_t seg_bytes)
{
    s_cand_t *c;
    size_t n = s_seg_cands(self, seg, true, seg_bytes / 2, &c);
    uint64_t moved = 0;
    for (size_t i = 0; i < n; i++)
        moved += s_seg_move(self, seg, &c[i]) > 0;
    free(c);
    return moved;
}

/* Reclaims the oldest segments until `need` more bytes fit the capacity, counting the bytes
 * granted to appends still running (so concurrent stores cannot each see the same free room and
 * overshoot together), then grants `need` until s_seg_unroom. Evicted objects leave the index
 * first, so no load can find them once the file goes; loads already reading hold the segment.
 * Gives up (and grants anyway) when the only segments left are taking appends. */
static void s_seg_room(s_fs_t *self, uint64_t need)
{
    if (!self->capacity)
        return;
    pthread_mutex_lock(&self->room_lock);
    uint64_t n = 0, bytes = 0, rescued = 0;
    for (;;) {
        uint64_t disk;
        kvt_seglog_usage(self->log, &disk, NULL);
        if (disk + self->room_held + need <= self->capacity)
            break;
        uint64_t seg_bytes = 0;
        kvt_seg_t *seg = kvt_seglog_oldest(self->log, &seg_bytes);
        if (!seg)
            break;
        uint64_t moved = s_seg_rescue(self, seg, seg_bytes);
        rescued += moved;
        s_seg_settle(self, moved); /* best effort: the capacity comes first */
        s_obj_t *gone = NULL;
        pthread_mutex_lock(&self->lock);
        for (size_t i = 0; i < self->nbuckets; i++)
            for (s_obj_t *o = self->buckets[i], *next; o; o = next) {
                next = o->hnext;
                if (o->loc.seg != seg)
                    continue;
                s_detach(self, o); /* no kvt_seglog_dead: the whole segment goes */
                o->hnext = gone;
                gone = o;
            }
        pthread_mutex_unlock(&self->lock);
        kvt_seglog_reclaim(self->log, seg);
        for (s_obj_t *o; (o = gone);) {
            gone = o->hnext;
            n++;
            bytes += o->size;
            free(o);
        }
    }
    self->room_held += need;
    pthread_mutex_unlock(&self->room_lock);
    if (n || rescued)
        kvt_log(KVT_LOG_DEBUG,
                "l2 fs:%s: %llu objects (%llu bytes) evicted with their segments, %llu moved on",
                self->path, (unsigned long long)n, (unsigned long long)bytes,
                (unsigned long long)rescued);
}

/* Gives back what s_seg_room granted once the append is over. */
static void s_seg_unroom(s_fs_t *self, uint64_t need)
{
    if (!self->capacity)
        return;
    pthread_mutex_lock(&self->room_lock);
    self->room_held -= need;
    pthread_mutex_unlock(&self->room_lock);
}

/* Puts o (appended at o->loc) into the index in place of the name's previous record. */
static void s_seg_index(s_fs_t *self, s_obj_t *o)
{
    pthread_mutex_lock(&self->lock);
    s_obj_t *old = s_find(self, o->name, o->hash);
    if (old) {
        s_detach(self, old);
        kvt_seglog_dead(self->log, &old->loc);
    }
    s_insert(self, o);
    pthread_mutex_unlock(&self->lock);
    free(old);
}

/* Under the name's stripe, so the log has a name's records in the order the index saw them. */
static int s_seg_store(s_fs_t *self, s_obj_t *o, size_t nlen, const struct iovec *iov, int n)
{
    pthread_mutex_t *stripe = s_stripe(self, o->hash);
    pthread_mutex_lock(stripe);
    /* the record, its index entry, the header page of a new segment */
    uint64_t need = o->size + nlen + 2 * S_ALIGN + 512;
    s_seg_room(self, need);
    int e = kvt_seglog_append(self->log, o->name, nlen, iov, n, &o->loc);
    s_seg_unroom(self, need); /* the log's bytes hold the record now (or it failed) */
    if (!e) {
        kvt_segloc_t loc = o->loc; /* o may be gone once indexed (replaced, reclaimed) */
        s_seg_index(self, o);
        kvt_seglog_done(self->log, &loc);
    }
    pthread_mutex_unlock(stripe);
    return e;
}

static int s_seg_remove(s_fs_t *self, const char *name, size_t nlen, uint64_t hash)
{
    pthread_mutex_t *stripe = s_stripe(self, hash);
    pthread_mutex_lock(stripe);
    pthread_mutex_lock(&self->lock);
    bool found = s_find(self, name, hash) != NULL;
    pthread_mutex_unlock(&self->lock);
    int e = found ? kvt_seglog_tombstone(self->log, name, nlen) : ENOENT;
    if (!e) {
        pthread_mutex_lock(&self->lock);
        s_obj_t *o = s_find(self, name, hash); /* a reclaim may have taken it meanwhile */
        if (o) {
            s_detach(self, o);
            kvt_seglog_dead(self->log, &o->loc);
        }
        pthread_mutex_unlock(&self->lock);
        free(o);
    }
    pthread_mutex_unlock(stripe);
    return e;
}

/* Loads under a hold on the record's segment; the index lock is not held across the read. */
static int s_seg_load(s_fs_t *self, const char *name, uint64_t hash, const struct iovec *iov, int n,
                      size_t cap, size_t *len)
{
    pthread_mutex_lock(&self->lock);
    s_obj_t *o = s_find(self, name, hash);
    kvt_segloc_t loc = o ? o->loc : (kvt_segloc_t){0};
    uint64_t size = o ? o->size : 0;
    if (o && size <= cap)
        kvt_seglog_hold(self->log, loc.seg);
    pthread_mutex_unlock(&self->lock);
    if (!o)
        return ENOENT;
    if (len)
        *len = size;
    if (size > cap)
        return ENOBUFS;
    int e = kvt_seglog_read(self->log, &loc, size, iov, n);
    kvt_seglog_put(self->log, loc.seg);
    if (!e) {
        pthread_mutex_lock(&self->lock);
        s_obj_t *cur = s_find(self, name, hash);
        if (cur) {
            s_lru_unlink(self, cur);
            s_lru_push(self, cur);
            cur->hit = true;
        }
        pthread_mutex_unlock(&self->lock);
    }
    return e;
}

/* kvt_seglog_scan's visitor at open: replays one record into the index. */
static void s_seg_visit(void *arg, const char *name, size_t nlen, uint64_t size, bool tombstone,
                        const kvt_segloc_t *loc)
{
    s_fs_t *self = arg;
    size_t ok;
    uint64_t hash = s_hash(name, nlen);
    s_obj_t *o = NULL;
    if (!tombstone && s_name_ok(name, &ok) && ok == nlen)
        o = calloc(1, sizeof *o + nlen + 1);
    if (o) {
        memcpy(o->name, name, nlen + 1);
        o->hash = hash;
        o->size = size;
        o->loc = *loc;
        s_seg_index(self, o);
        return;
    }
    /* a tombstone, or a record the index cannot hold: what it names is gone */
    pthread_mutex_lock(&self->lock);
    s_obj_t *old = s_find(self, name, hash);
    if (old) {
        s_detach(self, old);
        kvt_seglog_dead(self->log, &old->loc);
    }
    pthread_mutex_unlock(&self->lock);
    free(old);
    if (!tombstone)
        kvt_seglog_dead(self->log, loc);
}

/* ---- operations --------------------------------------------------------------------------- */

static int s_storev(void *state, const char *name, const struct iovec *iov, int iovcnt)
{
    s_fs_t *self = state;
    kvt_assert(s_is(self));
    size_t nlen;
    if (!s_name_ok(name, &nlen) || iovcnt < 1 || iovcnt > KVT_L2_IOV_MAX)
        return KVT_EINVAL;
    for (int i = 0; i < iovcnt; i++)
        if (iov[i].iov_len && !iov[i].iov_base)
            return KVT_EINVAL;
    size_t len = s_iov_total(iov, iovcnt);
    if (self->capacity && len > self->capacity)
        return KVT_ENOSPC;
    s_obj_t *o = calloc(1, sizeof *o + nlen + 1);
    if (!o)
        return KVT_ENOMEM;
    uint64_t hash = s_hash(name, nlen); /* o belongs to the index after the commit */
    memcpy(o->name, name, nlen + 1);
    o->hash = hash;
    o->size = len;

    int e;
    if (self->log) {
        e = s_seg_store(self, o, nlen, iov, iovcnt);
        pthread_mutex_lock(&self->lock);
    } else {
        if (self->capacity) {
            pthread_mutex_lock(&self->lock);
            self->reserved += len;
            pthread_mutex_unlock(&self->lock);
            s_make_room(self, name, hash, true);
        }
        char tmp[S_NAME_MAX + 32];
        snprintf(tmp, sizeof tmp, S_TMPDIR "/%s.%llu", name,
                 (unsigned long long)atomic_fetch_add(&self->seq, 1));
        e = s_write_tmp(self, tmp, iov, iovcnt);
        if (!e)
            e = s_commit(self, tmp, o);
        pthread_mutex_lock(&self->lock);
        if (self->capacity)
            self->reserved -= len;
    }
    if (!e || s_code(e) != KVT_ENOMEM) { /* health reports the disk, not the heap */
        self->fail_ms = e ? kvt_now_ms() : 0;
        self->fail_errno = e;
    }
    pthread_mutex_unlock(&self->lock);
    if (e) {
        free(o);
        kvt_errrep_report(&self->rep, KVT_LOG_WARN, "l2 fs:%s: store %s: %s", self->path, name,
                          strerror(e));
        return s_code(e);
    }
    atomic_fetch_add(&self->stores_done, 1);
    if (self->capacity && !self->log)
        s_make_room(self, name, hash, false);
    return 0;
}

/* sync=batch: one syncfs() for every store that returned before the call. A flush that finds
 * a syncfs started after its stores returned waits for it instead of starting another. */
static int s_flush(void *state)
{
    s_fs_t *self = state;
    kvt_assert(s_is(self));
    if (self->log)
        s_seg_compact(self);
    if (self->sync != S_SYNC_BATCH)
        return 0;
    uint64_t want = atomic_load(&self->stores_done);
    if (atomic_load(&self->stores_synced) >= want)
        return 0;
    pthread_mutex_lock(&self->flush_lock);
    int e = 0;
    if (atomic_load(&self->stores_synced) < want) {
        uint64_t covers = atomic_load(&self->stores_done);
        e = syncfs(self->dirfd) != 0 ? errno : 0;
        if (!e)
            atomic_store(&self->stores_synced, covers);
    }
    pthread_mutex_unlock(&self->flush_lock);
    if (e) {
        pthread_mutex_lock(&self->lock);
        self->fail_ms = kvt_now_ms();
        self->fail_errno = e;
        pthread_mutex_unlock(&self->lock);
        kvt_errrep_report(&self->rep, KVT_LOG_WARN, "l2 fs:%s: syncfs: %s", self->path,
                          strerror(e));
        return s_code(e);
    }
    return 0;
}

static int s_store(void *state, const char *name, const void *data, size_t len)
{
    struct iovec iov = {(void *)data, len};
    return s_storev(state, name, &iov, 1);
}

static int s_lookup(void *state, const char *name, size_t *len)
{
    s_fs_t *self = state;
    kvt_assert(s_is(self));
    size_t nlen;
    if (!s_name_ok(name, &nlen))
        return KVT_EINVAL;
    uint64_t hash = s_hash(name, nlen);
    pthread_mutex_lock(&self->lock);
    const s_obj_t *o = s_find(self, name, hash);
    if (o && len)
        *len = o->size;
    pthread_mutex_unlock(&self->lock);
    return o ? 0 : KVT_ENOTFOUND;
}

/* Reads `size` bytes at `off` (asking for `want` >= size: the aligned length under O_DIRECT).
 * A file that ends early was truncated behind our back. */
static int s_pread_all(int fd, void *buf, size_t size, size_t want, off_t off, size_t *got)
{
    *got = 0;
    while (*got < size) {
        ssize_t n = pread(fd, (char *)buf + *got, want - *got, off + (off_t)*got);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (n == 0)
            return EIO;
        *got += (size_t)n;
    }
    return 0;
}

/* O_DIRECT read of `size` bytes into iov: the aligned body straight into the first (aligned)
 * vector — all of the object when that vector has room for its page-rounded length — then the
 * rest (in the daemon's case less than a page plus the trailer) through the page cache, where
 * the write left it. */
static int s_read_direct(int fd, const struct iovec *iov, int n, size_t size, size_t *got)
{
    size_t rounded = (size + S_ALIGN - 1) & ~(size_t)(S_ALIGN - 1);
    size_t body = size < iov[0].iov_len ? size : iov[0].iov_len;
    body = iov[0].iov_len >= rounded ? size : body & ~(size_t)(S_ALIGN - 1);
    size_t want = body == size ? rounded : body;
    int e = s_pread_all(fd, iov[0].iov_base, body, want, 0, got);
    if (e || body == size)
        return e;
    size_t tgot = 0;
    e = s_tail(fd, false, iov, n, body, size - body, &tgot);
    *got += tgot;
    return e;
}

static int s_loadv(void *state, const char *name, const struct iovec *iov, int iovcnt, size_t *len)
{
    s_fs_t *self = state;
    kvt_assert(s_is(self));
    size_t nlen;
    if (!s_name_ok(name, &nlen) || iovcnt < 1 || iovcnt > KVT_L2_IOV_MAX)
        return KVT_EINVAL;
    for (int i = 0; i < iovcnt; i++)
        if (iov[i].iov_len && !iov[i].iov_base)
            return KVT_EINVAL;
    uint64_t hash = s_hash(name, nlen), gen;
    size_t cap = s_iov_total(iov, iovcnt);
    if (self->log) {
        int e = s_seg_load(self, name, hash, iov, iovcnt, cap, len);
        if (e == ENOENT || e == ENOBUFS)
            return e == ENOENT ? KVT_ENOTFOUND : KVT_ENOSPC;
        if (e)
            kvt_errrep_report(&self->rep, KVT_LOG_WARN, "l2 fs:%s: load %s: %s", self->path, name,
                              strerror(e));
        return e ? s_code(e) : 0;
    }
    pthread_mutex_lock(&self->lock);
    const s_obj_t *o = s_find(self, name, hash);
    gen = o ? o->gen : 0;
    pthread_mutex_unlock(&self->lock);
    if (!o)
        return KVT_ENOTFOUND;

    char rel[S_NAME_MAX + 8];
    s_rel(rel, sizeof rel, name, hash);
    bool direct = atomic_load(&self->direct) && (uintptr_t)iov[0].iov_base % S_ALIGN == 0;
    size_t size = 0;
    int e;
    for (;;) {
        int fd = openat(self->dirfd, rel, O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
        if (fd < 0) {
            e = errno;
        } else {
            struct stat st;
            e = fstat(fd, &st) != 0 ? errno : 0;
            size = e ? 0 : (size_t)st.st_size;
            size_t got = 0;
            if (!e && size > cap) {
                close(fd);
                if (len)
                    *len = size;
                return KVT_ENOSPC;
            }
            if (!e)
                e = direct ? s_read_direct(fd, iov, iovcnt, size, &got)
                           : s_rwv_all(fd, false, iov, iovcnt, size, 0, &got);
            close(fd);
            if (e == EINVAL && got > 0)
                e = EIO;
        }
        if (e == EINVAL && direct && self->mode == S_DIRECT_AUTO) {
            s_direct_refused(self, "read");
            direct = false;
            continue;
        }
        break;
    }
    if (e == ENOENT) {
        /* Evicted or removed since the index said present, or deleted by hand: forget it. */
        free(s_forget(self, name, hash, gen));
        return KVT_ENOTFOUND;
    }
    if (e) {
        kvt_errrep_report(&self->rep, KVT_LOG_WARN, "l2 fs:%s: load %s: %s", self->path, name,
                          strerror(e));
        return s_code(e);
    }
    pthread_mutex_lock(&self->lock);
    s_obj_t *cur = s_find(self, name, hash);
    if (cur) {
        s_lru_unlink(self, cur);
        s_lru_push(self, cur);
    }
    pthread_mutex_unlock(&self->lock);
    if (len)
        *len = size;
    return 0;
}

static int s_load(void *state, const char *name, void *buf, size_t cap, size_t *len)
{
    if (cap && !buf)
        return KVT_EINVAL;
    struct iovec iov = {buf, cap};
    return s_loadv(state, name, &iov, 1, len);
}

static int s_remove(void *state, const char *name)
{
    s_fs_t *self = state;
    kvt_assert(s_is(self));
    size_t nlen;
    if (!s_name_ok(name, &nlen))
        return KVT_EINVAL;
    uint64_t hash = s_hash(name, nlen), gen;
    if (self->log) {
        int e = s_seg_remove(self, name, nlen, hash);
        if (e && e != ENOENT)
            kvt_errrep_report(&self->rep, KVT_LOG_WARN, "l2 fs:%s: remove %s: %s", self->path, name,
                              strerror(e));
        return e == ENOENT ? KVT_ENOTFOUND : e ? s_code(e) : 0;
    }
    pthread_mutex_t *stripe = s_stripe(self, hash);
    pthread_mutex_lock(stripe);
    pthread_mutex_lock(&self->lock);
    const s_obj_t *o = s_find(self, name, hash);
    gen = o ? o->gen : 0;
    pthread_mutex_unlock(&self->lock);
    if (!o) {
        pthread_mutex_unlock(stripe);
        return KVT_ENOTFOUND;
    }
    char rel[S_NAME_MAX + 8];
    s_rel(rel, sizeof rel, name, hash);
    int e = unlinkat(self->dirfd, rel, 0) != 0 ? errno : 0;
    if (!e || e == ENOENT)
        free(s_forget(self, name, hash, gen));
    pthread_mutex_unlock(stripe);
    if (e == ENOENT)
        return KVT_ENOTFOUND;
    if (e) {
        kvt_errrep_report(&self->rep, KVT_LOG_WARN, "l2 fs:%s: remove %s: %s", self->path, name,
                          strerror(e));
        return s_code(e);
    }
    return 0;
}

static int s_health(void *state, char *why, size_t whylen)
{
    s_fs_t *self = state;
    kvt_assert(s_is(self));
    s_err(why, whylen, "%s", "");
    struct stat st;
    if (stat(self->path, &st) != 0) {
        s_err(why, whylen, "fs:%s: directory unusable: %s", self->path, strerror(errno));
        return KVT_EIO;
    }
    if (!S_ISDIR(st.st_mode)) {
        s_err(why, whylen, "fs:%s: not a directory", self->path);
        return KVT_EIO;
    }
    if (st.st_dev != self->dev || st.st_ino != self->ino) {
        s_err(why, whylen, "fs:%s: directory was removed or replaced since open", self->path);
        return KVT_EIO;
    }
    if (access(self->path, W_OK) != 0) {
        s_err(why, whylen, "fs:%s: not writable: %s", self->path, strerror(errno));
        return KVT_EIO;
    }
    pthread_mutex_lock(&self->lock);
    uint64_t fail_ms = self->fail_ms;
    int fail_errno = self->fail_errno;
    pthread_mutex_unlock(&self->lock);
    if (fail_ms && kvt_now_ms() - fail_ms < S_HEALTH_WINDOW_MS) {
        s_err(why, whylen, "fs:%s: last write failed: %s", self->path, strerror(fail_errno));
        return KVT_EIO;
    }
    return 0;
}

static void s_usage(void *state, uint64_t *bytes, uint64_t *objects)
{
    s_fs_t *self = state;
    kvt_assert(s_is(self));
    pthread_mutex_lock(&self->lock);
    if (bytes)
        *bytes = self->used;
    if (objects)
        *objects = self->objects;
    pthread_mutex_unlock(&self->lock);
}

/* ---- open / close ------------------------------------------------------------------------- */

static void s_close(void *state)
{
    s_fs_t *self = state;
    if (!self)
        return;
    kvt_assert(s_is(self));
    if (self->buckets) {
        for (size_t i = 0; i < self->nbuckets; i++) {
            s_obj_t *o = self->buckets[i];
            while (o) {
                s_obj_t *next = o->hnext;
                free(o);
                o = next;
            }
        }
        free(self->buckets);
    }
    kvt_seglog_destroy(&self->log);
    if (self->dirfd >= 0)
        close(self->dirfd);
    if (self->lockfd >= 0)
        close(self->lockfd); /* releases the flock */
    for (size_t i = 0; i < S_STRIPES; i++)
        pthread_mutex_destroy(&self->stripes[i]);
    pthread_mutex_destroy(&self->lock);
    pthread_mutex_destroy(&self->flush_lock);
    pthread_mutex_destroy(&self->room_lock);
    pthread_mutex_destroy(&self->rep.lock);
    free(self->path);
    self->tag = S_TAG_DEAD;
    free(self);
}

/* mkdir -p with mode 0700 for what it creates; existing directories are left as they are. */
static int s_mkdirs(const char *dir)
{
    char *p = strdup(dir);
    if (!p)
        return ENOMEM;
    int e = 0;
    for (char *s = p + 1; !e; s++) {
        if (*s != '/' && *s != '\0')
            continue;
        char c = *s;
        *s = '\0';
        if (mkdir(p, 0700) != 0 && errno != EEXIST)
            e = errno;
        *s = c;
        if (c == '\0')
            break;
    }
    free(p);
    return e;
}

/* The index of `val` in the NULL-terminated `names`, or -1. */
static int s_choice(const char *val, const char *const *names)
{
    for (int i = 0; names[i]; i++)
        if (strcmp(val, names[i]) == 0)
            return i;
    return -1;
}

/* s_choice for option `opt`; -1 with "fs:DIR: OPT 'VAL' is not CHOICES" in err. */
static int s_mode(const char *dir, const char *opt, const char *val, const char *const *names,
                  const char *choices, char *err, size_t errlen)
{
    int m = s_choice(val, names);
    if (m < 0)
        s_err(err, errlen, "fs:%s: %s '%s' is not %s", dir, opt, val, choices);
    return m;
}

/* Parses "DIR[,capacity=SIZE][,direct=...][,sync=...]" into self; *dir points into `copy`. */
static int s_parse(s_fs_t *self, char *copy, char **dir, char *err, size_t errlen)
{
    static const char usage[] = "use fs:DIR[,capacity=SIZE][,direct=auto|on|off][,sync=batch|"
                                "object|none][,layout=auto|segments|files][,segment_size=SIZE]";
    char *save = NULL;
    *dir = copy[0] == ',' ? NULL : strtok_r(copy, ",", &save);
    if (!*dir || !**dir) {
        s_err(err, errlen, "fs: missing directory (%s)", usage);
        return KVT_EINVAL;
    }
    for (char *opt; (opt = strtok_r(NULL, ",", &save));) {
        char *val = strchr(opt, '=');
        if (val)
            *val++ = '\0';
        if (strcmp(opt, "capacity") == 0 && val) {
            if (kvt_size_parse(val, &self->capacity) != 0) {
                s_err(err, errlen, "fs:%s: capacity '%s' is not a size (like 512M or 10G)", *dir,
                      val);
                return KVT_EINVAL;
            }
        } else if (strcmp(opt, "direct") == 0 && val) {
            static const char *const modes[] = {"off", "auto", "on", NULL}; /* s_direct_t */
            int m = s_mode(*dir, opt, val, modes, "auto, on or off", err, errlen);
            if (m < 0)
                return KVT_EINVAL;
            self->mode = (s_direct_t)m;
        } else if (strcmp(opt, "sync") == 0 && val) {
            static const char *const modes[] = {"batch", "object", "none", NULL}; /* s_sync_t */
            int m = s_mode(*dir, opt, val, modes, "batch, object or none", err, errlen);
            if (m < 0)
                return KVT_EINVAL;
            self->sync = (s_sync_t)m;
        } else if (strcmp(opt, "layout") == 0 && val) {
            static const char *const modes[] = {"auto", "segments", "files", NULL}; /* s_layout_t */
            int m = s_mode(*dir, opt, val, modes, "auto, segments or files", err, errlen);
            if (m < 0)
                return KVT_EINVAL;
            self->layout = (s_layout_t)m;
        } else if (strcmp(opt, "segment_size") == 0 && val) {
            if (kvt_size_parse(val, &self->segment_size) != 0 || self->segment_size < (1u << 20)) {
                s_err(err, errlen, "fs:%s: segment_size '%s' is not a size of at least 1M", *dir,
                      val);
                return KVT_EINVAL;
            }
        } else {
            s_err(err, errlen, "fs:%s: unknown option '%s%s%s' (%s)", *dir, opt, val ? "=" : "",
                  val ? val : "", usage);
            return KVT_EINVAL;
        }
    }
    return 0;
}

/* Writes one aligned page with O_DIRECT into a temp file: 0 when the filesystem takes it,
 * EINVAL when it refuses O_DIRECT, another errno when the probe could not tell. */
static int s_probe_direct(s_fs_t *self)
{
    char tmp[64];
    snprintf(tmp, sizeof tmp, S_TMPDIR "/direct-probe.%d", (int)getpid());
    int fd = openat(self->dirfd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0600);
    if (fd < 0)
        return errno;
    void *page = aligned_alloc(S_ALIGN, S_ALIGN);
    int e = ENOMEM;
    if (page) {
        memset(page, 0, S_ALIGN);
        size_t done;
        e = s_pwrite_all(fd, page, S_ALIGN, 0, &done);
        free(page);
    }
    close(fd);
    unlinkat(self->dirfd, tmp, 0);
    return e;
}

/* Removes everything in DIR/.tmp: temp files of stores a crash interrupted. */
static int s_clean_tmp(s_fs_t *self, uint64_t *removed)
{
    int fd = openat(self->dirfd, S_TMPDIR, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    DIR *d = fdopendir(fd);
    if (!d) {
        int e = errno;
        close(fd);
        return e;
    }
    for (struct dirent *de; (de = readdir(d));) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        if (unlinkat(fd, de->d_name, 0) == 0)
            (*removed)++;
        else
            kvt_log(KVT_LOG_WARN, "l2 fs:%s: cannot remove %s/%s: %s", self->path, S_TMPDIR,
                    de->d_name, strerror(errno));
    }
    closedir(d);
    return 0;
}

static int s_cmp_mtime(const void *a, const void *b)
{
    const s_obj_t *x = *(s_obj_t *const *)a, *y = *(s_obj_t *const *)b;
    if (x->mtime.tv_sec != y->mtime.tv_sec)
        return x->mtime.tv_sec < y->mtime.tv_sec ? -1 : 1;
    if (x->mtime.tv_nsec != y->mtime.tv_nsec)
        return x->mtime.tv_nsec < y->mtime.tv_nsec ? -1 : 1;
    return strcmp(x->name, y->name);
}

static bool s_is_fanout(const char *n)
{
    return strlen(n) == 2 && strchr("0123456789abcdef", n[0]) && strchr("0123456789abcdef", n[1]);
}

/* Collects the objects of fan-out directory `sub` into *list (grown as needed). */
static int s_scan_sub(s_fs_t *self, const char *sub, s_obj_t ***list, size_t *n, size_t *cap)
{
    int fd = openat(self->dirfd, sub, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return errno == ENOTDIR || errno == ELOOP ? 0 : errno; /* a foreign file named "ab" */
    DIR *d = fdopendir(fd);
    if (!d) {
        int e = errno;
        close(fd);
        return e;
    }
    unsigned want = (unsigned)strtoul(sub, NULL, 16);
    int e = 0;
    for (struct dirent *de; !e && (de = readdir(d));) {
        size_t nlen;
        if (!s_name_ok(de->d_name, &nlen))
            continue;
        uint64_t hash = s_hash(de->d_name, nlen);
        struct stat st;
        if ((hash & 0xff) != want || fstatat(fd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
            !S_ISREG(st.st_mode))
            continue;
        if (*n == *cap) {
            size_t ncap = *cap ? *cap * 2 : 1024;
            s_obj_t **l = realloc(*list, ncap * sizeof *l);
            if (!l) {
                e = ENOMEM;
                break;
            }
            *list = l;
            *cap = ncap;
        }
        s_obj_t *o = calloc(1, sizeof *o + nlen + 1);
        if (!o) {
            e = ENOMEM;
            break;
        }
        memcpy(o->name, de->d_name, nlen + 1);
        o->hash = hash;
        o->size = (uint64_t)st.st_size;
        o->mtime = st.st_mtim;
        (*list)[(*n)++] = o;
    }
    closedir(d);
    return e;
}

/* Rebuilds the index from the fan-out directories, least recently written first. */
static int s_scan(s_fs_t *self)
{
    int fd = openat(self->dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        return e;
    }
    s_obj_t **list = NULL;
    size_t n = 0, cap = 0;
    int e = 0;
    for (struct dirent *de; !e && (de = readdir(d));)
        if (s_is_fanout(de->d_name))
            e = s_scan_sub(self, de->d_name, &list, &n, &cap);
    closedir(d);
    if (!e && n)
        qsort(list, n, sizeof *list, s_cmp_mtime);
    for (size_t i = 0; i < n; i++) {
        if (e)
            free(list[i]);
        else
            s_insert(self, list[i]);
    }
    free(list);
    return e;
}

/* The layout DIR holds: segments where DIR/seg exists, files where fan-out directories do
 * (a kvtier before segments wrote them), AUTO for a directory with neither. */
static s_layout_t s_detect_layout(s_fs_t *self)
{
    struct stat st;
    if (fstatat(self->dirfd, KVT_SEGLOG_DIR, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode))
        return S_LAYOUT_SEGMENTS;
    int fd = openat(self->dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0)
            close(fd);
        return S_LAYOUT_AUTO;
    }
    s_layout_t l = S_LAYOUT_AUTO;
    for (struct dirent *de; l == S_LAYOUT_AUTO && (de = readdir(d));)
        if (s_is_fanout(de->d_name))
            l = S_LAYOUT_FILES;
    closedir(d);
    return l;
}

static const char *s_layout_name(s_layout_t l)
{
    return l == S_LAYOUT_FILES ? "files" : "segments";
}

/* At open, when the directory holds more than the capacity (it was lowered): oldest first. */
static void s_trim(s_fs_t *self)
{
    uint64_t n = 0, bytes = 0;
    while (self->capacity && self->used > self->capacity && self->oldest) {
        s_obj_t *o = self->oldest;
        char rel[S_NAME_MAX + 8];
        s_rel(rel, sizeof rel, o->name, o->hash);
        if (unlinkat(self->dirfd, rel, 0) != 0 && errno != ENOENT)
            kvt_log(KVT_LOG_WARN, "l2 fs:%s: evict %s: %s", self->path, rel, strerror(errno));
        bytes += o->size;
        n++;
        s_detach(self, o);
        free(o);
    }
    if (n)
        kvt_log(KVT_LOG_INFO, "l2 fs:%s: evicted %llu objects (%llu bytes) over the capacity",
                self->path, (unsigned long long)n, (unsigned long long)bytes);
}

static int s_open(const char *args, void **state, char *err, size_t errlen)
{
    s_err(err, errlen, "%s", "");
    if (!state)
        return KVT_EINVAL;
    *state = NULL;
    char *copy = strdup(args ? args : "");
    s_fs_t *self = calloc(1, sizeof *self);
    if (!copy || !self) {
        free(copy);
        free(self);
        s_err(err, errlen, "fs: out of memory");
        return KVT_ENOMEM;
    }
    self->tag = S_TAG;
    self->dirfd = self->lockfd = -1;
    self->mode = S_DIRECT_AUTO;
    self->rep = (kvt_errrep_t)KVT_ERRREP_INIT(S_ERRREP_MS);
    pthread_mutex_init(&self->lock, NULL);
    pthread_mutex_init(&self->flush_lock, NULL);
    pthread_mutex_init(&self->room_lock, NULL);
    self->segment_size = S_SEGMENT_SIZE;
    for (size_t i = 0; i < S_STRIPES; i++)
        pthread_mutex_init(&self->stripes[i], NULL);
    self->nbuckets = S_BUCKETS0;
    self->buckets = calloc(self->nbuckets, sizeof *self->buckets);

    char *dir;
    int rc = s_parse(self, copy, &dir, err, errlen);
    if (rc)
        goto fail;
    rc = KVT_ENOMEM;
    if (!self->buckets) {
        s_err(err, errlen, "fs:%s: out of memory", dir);
        goto fail;
    }
    int e = s_mkdirs(dir);
    if (e) {
        s_err(err, errlen, "fs:%s: cannot create the directory: %s", dir, strerror(e));
        rc = e == ENOTDIR || e == EEXIST ? KVT_EINVAL : s_code(e);
        goto fail;
    }
    self->dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct stat st;
    if (self->dirfd < 0 || fstat(self->dirfd, &st) != 0) {
        e = errno;
        s_err(err, errlen, "fs:%s: %s", dir, strerror(e));
        rc = e == ENOTDIR ? KVT_EINVAL : s_code(e);
        goto fail;
    }
    self->dev = st.st_dev;
    self->ino = st.st_ino;
    self->path = realpath(dir, NULL);
    if (!self->path) {
        s_err(err, errlen, "fs:%s: %s", dir, strerror(errno));
        rc = s_code(errno);
        goto fail;
    }

    self->lockfd = openat(self->dirfd, S_LOCKFILE, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (self->lockfd < 0 || flock(self->lockfd, LOCK_EX | LOCK_NB) != 0) {
        e = errno;
        if (e == EWOULDBLOCK) {
            s_err(err, errlen, "fs:%s: in use by another adapter or daemon (%s/%s is locked)",
                  self->path, self->path, S_LOCKFILE);
            rc = KVT_EBUSY;
        } else {
            s_err(err, errlen, "fs:%s: cannot lock %s: %s", self->path, S_LOCKFILE, strerror(e));
            rc = s_code(e);
        }
        goto fail;
    }
    uint64_t leftovers = 0;
    if (mkdirat(self->dirfd, S_TMPDIR, 0700) != 0 && errno != EEXIST)
        e = errno;
    else
        e = s_clean_tmp(self, &leftovers);
    if (e) {
        s_err(err, errlen, "fs:%s: %s/: %s", self->path, S_TMPDIR, strerror(e));
        rc = s_code(e);
        goto fail;
    }

    if (self->mode != S_DIRECT_OFF) {
        e = s_probe_direct(self);
        if (e == EINVAL && self->mode == S_DIRECT_ON) {
            s_err(err, errlen, "fs:%s: direct=on but the filesystem refuses O_DIRECT", self->path);
            rc = KVT_EINVAL;
            goto fail;
        }
        if (e && e != EINVAL) /* cannot tell (a full disk?): try it, auto falls back on EINVAL */
            kvt_log(KVT_LOG_WARN, "l2 fs:%s: O_DIRECT probe: %s", self->path, strerror(e));
        atomic_store(&self->direct, e != EINVAL);
    }

    s_layout_t found = s_detect_layout(self);
    if (self->layout == S_LAYOUT_AUTO) {
        self->layout = found == S_LAYOUT_AUTO ? S_LAYOUT_SEGMENTS : found;
    } else if (found != S_LAYOUT_AUTO && found != self->layout) {
        s_err(err, errlen,
              "fs:%s: holds objects of layout=%s, not %s (use layout=auto or another "
              "directory)",
              self->path, s_layout_name(found), s_layout_name(self->layout));
        rc = KVT_EINVAL;
        goto fail;
    }
    uint64_t skipped = 0;
    if (self->layout == S_LAYOUT_SEGMENTS) {
        /* the oldest segment is what a reclaim frees: a small part of the capacity, and every
         * stream's appending segment together well under it */
        uint64_t seg = self->segment_size;
        if (self->capacity && seg > self->capacity / 32)
            seg = self->capacity / 32 > (64u << 10) ? self->capacity / 32 : 64u << 10;
        self->log = kvt_seglog_new(self->dirfd, self->path, seg,
                                   self->sync == S_SYNC_OBJECT ? KVT_SEGLOG_SYNC_OBJECT
                                                               : KVT_SEGLOG_SYNC_NONE,
                                   atomic_load(&self->direct), err, errlen);
        if (!self->log) {
            rc = KVT_EIO;
            goto fail;
        }
        e = kvt_seglog_scan(self->log, s_seg_visit, self, &skipped);
    } else {
        e = s_scan(self);
    }
    if (e) {
        s_err(err, errlen, "fs:%s: cannot read the directory: %s", self->path, strerror(e));
        rc = s_code(e);
        goto fail;
    }
    if (self->log)
        s_seg_room(self, 0);
    else
        s_trim(self);
    char capstr[32] = "unlimited";
    if (self->capacity)
        snprintf(capstr, sizeof capstr, "%llu bytes", (unsigned long long)self->capacity);
    uint64_t segs = 0;
    if (self->log)
        kvt_seglog_usage(self->log, NULL, &segs);
    char layout[96] = "files";
    if (self->log)
        snprintf(layout, sizeof layout, "segments (%llu, %llu pages without a record skipped)",
                 (unsigned long long)segs, (unsigned long long)skipped);
    kvt_log(KVT_LOG_INFO,
            "l2 fs:%s: %llu objects, %llu bytes, capacity %s, layout %s, O_DIRECT %s, sync=%s, "
            "%llu temp files removed",
            self->path, (unsigned long long)self->objects, (unsigned long long)self->used, capstr,
            layout, atomic_load(&self->direct) ? "on" : "off",
            self->sync == S_SYNC_BATCH    ? "batch"
            : self->sync == S_SYNC_OBJECT ? "object"
                                          : "none",
            (unsigned long long)leftovers);
    free(copy);
    *state = self;
    return 0;

fail:
    s_close(self);
    free(copy);
    return rc;
}

static const kvt_l2_ops_t s_ops = {
    .abi = KVT_L2_ABI,
    .kind = "fs",
    /* Deep enough to keep an NVMe queue busy with fsyncs in flight; the locks allow more. */
    .max_threads = 16,
    .open = s_open,
    .close = s_close,
    .store = s_store,
    .lookup = s_lookup,
    .load = s_load,
    .remove = s_remove,
    .health = s_health,
    .usage = s_usage,
    .storev = s_storev,
    .loadv = s_loadv,
    .flush = s_flush,
};

const kvt_l2_ops_t *kvt_l2_fs_ops(void)
{
    return &s_ops;
}
