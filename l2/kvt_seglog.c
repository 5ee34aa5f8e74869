/* kvt_seglog: see kvt_seglog.h. */
#include "kvt_seglog.h"

#include "kvt_error.h"
#include "kvt_log.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define S_PAGE 4096u
#define S_BOUNCE (1u << 20) /* most of a record's non-direct part goes through at a time */
#define S_HDR_MAGIC 0x3176474553545655ull /* "UVTSEGv1" */
#define S_REC_MAGIC 0x31434552545655ull   /* "UVTREC1" */
#define S_FLAG_TOMBSTONE 1u
#define S_FLAG_VOID 2u /* index entries only: the record at this offset failed; ignore it */
#define S_NAME_MAX 255u
/* Segments taking appends at once: appends to one file wait for each other in the filesystem
 * (an appending O_DIRECT write holds the inode's lock), appends to several do not. A name
 * always goes to the same stream, so its records stay in segment order. */
#define S_STREAMS 16u

typedef struct {
    uint64_t magic;
    uint64_t seq;
    uint64_t nonce;
    uint64_t check; /* XXH3 of the fields above */
} s_hdr_t;

typedef struct {
    uint64_t magic;
    uint64_t size;  /* payload bytes */
    uint64_t pages; /* record length / S_PAGE */
    uint32_t nlen;
    uint32_t flags;
    uint64_t spare[3];
    uint64_t check; /* XXH3 of the fields above and the name, seeded with the segment's nonce */
} s_foot_t;
_Static_assert(sizeof(s_foot_t) == 64, "footer is 64 bytes");

/* One entry of a segment's index file (NNNN.idx), followed by the name: appended once the
 * record is written, so an open reads one small file per segment instead of a footer per
 * record. */
typedef struct {
    uint64_t off;
    uint64_t size;
    uint32_t pages;
    uint16_t nlen;
    uint16_t flags;
    uint64_t check; /* XXH3 of the fields above and the name, seeded with the segment's nonce */
} s_ient_t;
_Static_assert(sizeof(s_ient_t) == 32, "index entry is 32 bytes");

struct kvt_seg {
    kvt_seg_t *newer, *older; /* the log's list, oldest first */
    uint64_t seq;
    uint64_t nonce;
    int fd;
    int ifd;          /* its index file, for appends; -1 once the segment is closed */
    uint64_t ibytes;  /* of its index file */
    uint64_t end;     /* bytes reserved so far (the file's length once appends finished) */
    uint64_t live;    /* bytes of live records */
    int writers;      /* appends in flight */
    int stream;       /* of the appending segment */
    bool closed;      /* takes no more appends */
    bool reclaiming;  /* handed out by kvt_seglog_oldest: goes by kvt_seglog_reclaim only */
    bool doomed;      /* unlinked; freed when the last hold is put */
    atomic_int holds; /* readers */
};

struct kvt_seglog {
    int dirfd; /* DIR/seg */
    char *path;
    uint64_t seg_size;
    int sync;
    bool direct;
    pthread_mutex_t lock; /* everything below and every segment's fields but holds */
    kvt_seg_t *oldest, *newest;
    kvt_seg_t *active[S_STREAMS]; /* take appends; NULL until the first */
    uint64_t next_seq;
    uint64_t bytes, segments;
};

static const char s_zeros[S_PAGE];

static uint64_t s_round(uint64_t n)
{
    return (n + S_PAGE - 1) & ~(uint64_t)(S_PAGE - 1);
}

static uint64_t s_hdr_check(const s_hdr_t *h)
{
    return XXH3_64bits(h, offsetof(s_hdr_t, check));
}

/* XXH3 of `flen` bytes of fields and the name, seeded with the segment's nonce: footers and index
 * entries. */
static uint64_t s_keyed(const void *fields, size_t flen, const char *name, size_t nlen,
                        uint64_t nonce)
{
    char buf[64 + S_NAME_MAX];
    nlen = nlen <= S_NAME_MAX ? nlen : S_NAME_MAX;
    memcpy(buf, fields, flen);
    memcpy(buf + flen, name, nlen);
    return XXH3_64bits_withSeed(buf, flen + nlen, nonce);
}

static uint64_t s_foot_check(const s_foot_t *f, const char *name, uint64_t nonce)
{
    return s_keyed(f, offsetof(s_foot_t, check), name, f->nlen, nonce);
}

static void s_segname(char *out, size_t len, uint64_t seq)
{
    snprintf(out, len, "%016" PRIx64, seq);
}

static void s_idxname(char *out, size_t len, uint64_t seq)
{
    snprintf(out, len, "%016" PRIx64 ".idx", seq);
}

static uint64_t s_ient_check(const s_ient_t *x, const char *name, uint64_t nonce)
{
    return s_keyed(x, offsetof(s_ient_t, check), name, x->nlen, nonce);
}

/* pwritev/preadv of all of v at off, resuming after short transfers (v is used up). */
static int s_iov_io(int fd, bool write, struct iovec *v, int n, uint64_t off)
{
    for (;;) {
        while (n > 0 && !v[0].iov_len) /* nothing to move: not an end of file */
            v++, n--;
        if (!n)
            break;
        ssize_t r = write ? pwritev(fd, v, n, (off_t)off) : preadv(fd, v, n, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return errno;
        if (r == 0)
            return EIO;
        off += (uint64_t)r;
        for (size_t adv = (size_t)r; n > 0 && adv;) {
            size_t t = adv < v[0].iov_len ? adv : v[0].iov_len;
            v[0].iov_base = (char *)v[0].iov_base + t;
            v[0].iov_len -= t;
            adv -= t;
            if (!v[0].iov_len)
                v++, n--;
        }
    }
    return 0;
}

/* pwritev/pread of exactly len bytes; a read past the end is EIO. */
static int s_io(int fd, bool write, void *buf, size_t len, uint64_t off)
{
    struct iovec v = {buf, len};
    return s_iov_io(fd, write, &v, 1, off);
}

static int s_openseg(kvt_seglog_t *self, uint64_t seq, int flags)
{
    char name[24];
    s_segname(name, sizeof name, seq);
    return openat(self->dirfd, name, flags | O_CLOEXEC | (self->direct ? O_DIRECT : 0), 0600);
}

/* Links seg as the newest segment (under lock). */
static void s_link(kvt_seglog_t *self, kvt_seg_t *seg)
{
    seg->older = self->newest;
    if (self->newest)
        self->newest->newer = seg;
    else
        self->oldest = seg;
    self->newest = seg;
    self->bytes += seg->end + seg->ibytes;
    self->segments++;
}

static void s_free(kvt_seg_t *seg)
{
    if (seg->fd >= 0)
        close(seg->fd);
    if (seg->ifd >= 0)
        close(seg->ifd);
    free(seg);
}

/* A closed segment with no append in flight needs its index fd no more (under lock). */
static void s_retire(kvt_seg_t *seg)
{
    if (seg->closed && !seg->writers && seg->ifd >= 0) {
        close(seg->ifd);
        seg->ifd = -1;
    }
}

/* Unlinks seg from the list and from the directory (under lock); freed now or by the last put. */
static void s_doom(kvt_seglog_t *self, kvt_seg_t *seg)
{
    if (seg->newer)
        seg->newer->older = seg->older;
    else
        self->newest = seg->older;
    if (seg->older)
        seg->older->newer = seg->newer;
    else
        self->oldest = seg->newer;
    if (!seg->closed && self->active[seg->stream] == seg)
        self->active[seg->stream] = NULL;
    self->bytes -= seg->end + seg->ibytes;
    self->segments--;
    char name[24];
    s_segname(name, sizeof name, seg->seq);
    if (unlinkat(self->dirfd, name, 0) != 0 && errno != ENOENT)
        kvt_log(KVT_LOG_WARN, "l2 fs:%s: cannot remove segment %s: %s", self->path, name,
                strerror(errno));
    s_idxname(name, sizeof name, seg->seq);
    unlinkat(self->dirfd, name, 0);
    seg->doomed = true;
    if (atomic_load(&seg->holds) == 0)
        s_free(seg);
}

/* Deletes empty closed segments from the oldest end (under lock): nothing older can still need
 * their tombstones. */
static void s_drop_empty(kvt_seglog_t *self)
{
    while (self->oldest && self->oldest->closed && !self->oldest->writers && !self->oldest->live &&
           !self->oldest->reclaiming)
        s_doom(self, self->oldest);
}

/* A new segment file with its header page, made stream's appending one (under lock). */
static int s_create(kvt_seglog_t *self, int stream)
{
    kvt_seg_t *seg = calloc(1, sizeof *seg);
    void *page = aligned_alloc(S_PAGE, S_PAGE);
    int e = !seg || !page ? ENOMEM : 0;
    if (seg)
        seg->fd = seg->ifd = -1;
    if (!e) {
        seg->seq = self->next_seq++;
        seg->fd = s_openseg(self, seg->seq, O_RDWR | O_CREAT | O_EXCL);
        e = seg->fd < 0 ? errno : 0;
    }
    char iname[24];
    if (!e) {
        s_idxname(iname, sizeof iname, seg->seq);
        seg->ifd =
            openat(self->dirfd, iname, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0600);
        e = seg->ifd < 0 ? errno : 0;
    }
    if (!e && getrandom(&seg->nonce, sizeof seg->nonce, 0) != sizeof seg->nonce)
        e = errno ? errno : EIO;
    if (!e) {
        memset(page, 0, S_PAGE);
        s_hdr_t h = {S_HDR_MAGIC, seg->seq, seg->nonce, 0};
        h.check = s_hdr_check(&h);
        memcpy(page, &h, sizeof h);
        e = s_io(seg->fd, true, page, S_PAGE, 0);
        /* sync=object: the name now, the header with the first record's fdatasync */
        if (!e && self->sync == KVT_SEGLOG_SYNC_OBJECT && fsync(self->dirfd) != 0)
            e = errno;
    }
    free(page);
    if (e) {
        if (seg && seg->fd >= 0) {
            char name[24];
            s_segname(name, sizeof name, seg->seq);
            unlinkat(self->dirfd, name, 0);
            if (seg->ifd >= 0)
                unlinkat(self->dirfd, iname, 0);
        }
        if (seg)
            s_free(seg);
        return e;
    }
    seg->end = S_PAGE;
    seg->stream = stream;
    s_link(self, seg);
    if (self->active[stream]) {
        self->active[stream]->closed = true;
        s_retire(self->active[stream]);
    }
    self->active[stream] = seg;
    return 0;
}

/* Reserves `bytes` in the appending segment (a new one when it is full); *seg gets a writer. */
static int s_reserve(kvt_seglog_t *self, int stream, uint64_t bytes, kvt_seg_t **seg, uint64_t *off)
{
    pthread_mutex_lock(&self->lock);
    int e = 0;
    kvt_seg_t *a = self->active[stream];
    if (!a || (a->end > S_PAGE && a->end + bytes > self->seg_size))
        e = s_create(self, stream);
    if (!e) {
        a = self->active[stream];
        *seg = a;
        *off = a->end;
        a->end += bytes;
        a->live += bytes;
        a->writers++;
        self->bytes += bytes;
    }
    pthread_mutex_unlock(&self->lock);
    return e;
}

/* Ends an append; a failed one leaves a hole the scan skips and counts as dead. */
static void s_unreserve(kvt_seglog_t *self, kvt_seg_t *seg, uint64_t bytes, bool failed)
{
    pthread_mutex_lock(&self->lock);
    seg->writers--;
    if (failed)
        seg->live -= bytes;
    s_retire(seg);
    s_drop_empty(self);
    pthread_mutex_unlock(&self->lock);
}

/* Copies up to `want` bytes from v (from vector *i, byte *skip on) into b; advances i/skip. */
static size_t s_gather(char *b, size_t want, const struct iovec *v, int n, int *i, size_t *skip)
{
    size_t fill = 0;
    while (fill < want && *i < n) {
        size_t take = v[*i].iov_len - *skip;
        if (take > want - fill)
            take = want - fill;
        memcpy(b + fill, (const char *)v[*i].iov_base + *skip, take);
        fill += take;
        *skip += take;
        if (*skip == v[*i].iov_len) {
            (*i)++;
            *skip = 0;
        }
    }
    return fill;
}

/* Writes `bytes` (a page multiple) at off: the first vector's page-aligned body straight from
 * the caller (with O_DIRECT it must be page-aligned), the rest through a bounce buffer of whole
 * pages — in the common case (the rest fits one bounce) body and rest in one pwritev, one
 * request to the disk. */
static int s_write(kvt_seglog_t *self, int fd, uint64_t off, const struct iovec *v, int n,
                   uint64_t bytes)
{
    size_t body = 0;
    if (n > 0 && (!self->direct || (uintptr_t)v[0].iov_base % S_PAGE == 0))
        body = self->direct ? v[0].iov_len & ~(size_t)(S_PAGE - 1) : v[0].iov_len;
    int i = body && body == v[0].iov_len ? 1 : 0;
    size_t skip = i ? 0 : body;
    uint64_t rest = bytes - body;
    if (!rest) {
        struct iovec one = {v[0].iov_base, body};
        return s_iov_io(fd, true, &one, 1, off);
    }
    size_t cap = rest < S_BOUNCE ? (size_t)rest : S_BOUNCE; /* unaligned without O_DIRECT */
    char *b = aligned_alloc(S_PAGE, s_round(cap));
    if (!b)
        return ENOMEM;
    int e = 0;
    if (rest <= cap) {
        s_gather(b, cap, v, n, &i, &skip);
        struct iovec two[2] = {{v[0].iov_base, body}, {b, cap}};
        e = body ? s_iov_io(fd, true, two, 2, off) : s_iov_io(fd, true, two + 1, 1, off);
    } else {
        struct iovec one = {v[0].iov_base, body};
        e = body ? s_iov_io(fd, true, &one, 1, off) : 0;
        for (uint64_t pos = body; !e && pos < bytes;) {
            size_t want = bytes - pos < cap ? (size_t)(bytes - pos) : cap;
            s_gather(b, want, v, n, &i, &skip);
            e = s_io(fd, true, b, want, off + pos);
            pos += want;
        }
    }
    free(b);
    return e;
}

/* Appends one index entry (O_APPEND: whole, or torn only by a short write, which the scan at
 * open detects); *listed: some of it reached the file. */
static int s_ient_append(kvt_seglog_t *self, kvt_seg_t *seg, uint64_t off, uint64_t size,
                         uint64_t bytes, const char *name, size_t nlen, uint32_t flags,
                         bool *listed)
{
    char ent[sizeof(s_ient_t) + S_NAME_MAX];
    s_ient_t x = {off, size, (uint32_t)(bytes / S_PAGE), (uint16_t)nlen, (uint16_t)flags, 0};
    x.check = s_ient_check(&x, name, seg->nonce);
    memcpy(ent, &x, sizeof x);
    memcpy(ent + sizeof x, name, nlen);
    ssize_t w = write(seg->ifd, ent, sizeof x + nlen);
    if (w > 0) {
        *listed = true;
        pthread_mutex_lock(&self->lock);
        seg->ibytes += (uint64_t)w;
        self->bytes += (uint64_t)w;
        pthread_mutex_unlock(&self->lock);
    }
    return w == (ssize_t)(sizeof x + nlen) ? 0 : w < 0 ? errno : EIO;
}

int kvt_seglog_append(kvt_seglog_t *self, const char *name, size_t nlen, const struct iovec *iov,
                      int iovcnt, kvt_segloc_t *loc)
{
    if (nlen > S_NAME_MAX || iovcnt < 0 || iovcnt > 60)
        return EINVAL;
    uint64_t size = 0;
    for (int i = 0; i < iovcnt; i++)
        size += iov[i].iov_len;
    bool tomb = iovcnt == 0;
    uint64_t bytes = s_round(size + nlen + sizeof(s_foot_t));
    kvt_seg_t *seg;
    uint64_t off;
    int e = s_reserve(self, (int)(XXH3_64bits(name, nlen) % S_STREAMS), bytes, &seg, &off);
    if (e)
        return e;
    s_foot_t f = {S_REC_MAGIC, size, bytes / S_PAGE, (uint32_t)nlen, tomb ? S_FLAG_TOMBSTONE : 0,
                  {0},         0};
    f.check = s_foot_check(&f, name, seg->nonce);
    /* payload | zeros | name | footer */
    struct iovec v[64];
    int n = 0;
    for (int i = 0; i < iovcnt; i++)
        if (iov[i].iov_len)
            v[n++] = iov[i];
    for (uint64_t pad = bytes - size - nlen - sizeof f; pad;) {
        size_t z = pad < S_PAGE ? (size_t)pad : S_PAGE;
        v[n++] = (struct iovec){(void *)s_zeros, z};
        pad -= z;
    }
    v[n++] = (struct iovec){(void *)name, nlen};
    v[n++] = (struct iovec){&f, sizeof f};
    e = s_write(self, seg->fd, off, v, n, bytes);
    if (!e && self->sync == KVT_SEGLOG_SYNC_OBJECT && fdatasync(seg->fd) != 0)
        e = errno;
    /* a segment deleted behind the log's back (DIR removed) would take appends and lose them */
    struct stat st;
    if (!e && (fstat(seg->fd, &st) != 0 || st.st_nlink == 0))
        e = ENOENT;
    if (!e) {
        bool listed = false;
        e = s_ient_append(self, seg, off, size, bytes, name, nlen, f.flags, &listed);
        if (!e && self->sync == KVT_SEGLOG_SYNC_OBJECT && fdatasync(seg->ifd) != 0)
            e = errno;
        if (e && listed) /* reported failed: the record must not come back at the next open */
            s_ient_append(self, seg, off, size, bytes, name, nlen, S_FLAG_VOID, &listed);
    }
    if (e || tomb)
        s_unreserve(self, seg, bytes, true);
    else
        *loc = (kvt_segloc_t){seg, off, bytes};
    return e;
}

int kvt_seglog_tombstone(kvt_seglog_t *self, const char *name, size_t nlen)
{
    return kvt_seglog_append(self, name, nlen, NULL, 0, NULL);
}

void kvt_seglog_done(kvt_seglog_t *self, const kvt_segloc_t *loc)
{
    s_unreserve(self, loc->seg, loc->bytes, false);
}

void kvt_seglog_dead(kvt_seglog_t *self, const kvt_segloc_t *loc)
{
    pthread_mutex_lock(&self->lock);
    kvt_assert(loc->seg->live >= loc->bytes);
    loc->seg->live -= loc->bytes;
    s_drop_empty(self);
    pthread_mutex_unlock(&self->lock);
}

void kvt_seglog_hold(kvt_seglog_t *self, kvt_seg_t *seg)
{
    (void)self;
    atomic_fetch_add(&seg->holds, 1);
}

void kvt_seglog_put(kvt_seglog_t *self, kvt_seg_t *seg)
{
    pthread_mutex_lock(&self->lock);
    if (atomic_fetch_sub(&seg->holds, 1) == 1 && seg->doomed)
        s_free(seg);
    pthread_mutex_unlock(&self->lock);
}

/* Copies `have` bytes of b out into v (from vector *i, byte *skip on); advances i/skip. */
static void s_scatter(const char *b, size_t have, const struct iovec *v, int n, int *i,
                      size_t *skip)
{
    for (size_t used = 0; used < have && *i < n;) {
        size_t take = v[*i].iov_len - *skip;
        if (take > have - used)
            take = have - used;
        memcpy((char *)v[*i].iov_base + *skip, b + used, take);
        used += take;
        *skip += take;
        if (*skip == v[*i].iov_len) {
            (*i)++;
            *skip = 0;
        }
    }
}

/* The mirror of s_write: the payload's page-aligned body straight into the first vector (all of
 * it when the vector has room for the last page), the rest through a bounce buffer — in the
 * common case in the same preadv. */
int kvt_seglog_read(kvt_seglog_t *self, const kvt_segloc_t *loc, uint64_t size,
                    const struct iovec *iov, int iovcnt)
{
    int fd = loc->seg->fd;
    size_t body = 0;
    if (iovcnt > 0 && (!self->direct || (uintptr_t)iov[0].iov_base % S_PAGE == 0)) {
        body = iov[0].iov_len < size ? iov[0].iov_len : (size_t)size;
        if (self->direct)
            body = iov[0].iov_len >= s_round(size) ? (size_t)s_round(size)
                                                   : body & ~(size_t)(S_PAGE - 1);
    }
    uint64_t done = body < size ? body : size; /* payload bytes that land in iov[0] */
    int i = 0;
    size_t skip = (size_t)done;
    if (iovcnt > 0 && skip == iov[0].iov_len)
        i = 1, skip = 0;
    /* direct: whole pages from a page boundary; else exactly the bytes */
    uint64_t rest = done >= size ? 0 : self->direct ? s_round(size) - body : size - body;
    struct iovec two[2] = {{iovcnt > 0 ? iov[0].iov_base : NULL, body}, {NULL, 0}};
    if (!rest)
        return body ? s_iov_io(fd, false, two, 1, loc->off) : 0;
    size_t cap = rest < S_BOUNCE ? (size_t)rest : S_BOUNCE;
    char *b = aligned_alloc(S_PAGE, s_round(cap));
    if (!b)
        return ENOMEM;
    int e = 0;
    if (rest <= cap) {
        two[1] = (struct iovec){b, (size_t)rest};
        e = body ? s_iov_io(fd, false, two, 2, loc->off)
                 : s_iov_io(fd, false, two + 1, 1, loc->off);
        if (!e)
            s_scatter(b, (size_t)(size - done), iov, iovcnt, &i, &skip);
    } else {
        e = body ? s_iov_io(fd, false, two, 1, loc->off) : 0;
        for (uint64_t pos = body; !e && pos < size;) {
            size_t want = body + rest - pos < cap ? (size_t)(body + rest - pos) : cap;
            e = s_io(fd, false, b, want, loc->off + pos);
            size_t have = size - pos < want ? (size_t)(size - pos) : want;
            if (!e)
                s_scatter(b, have, iov, iovcnt, &i, &skip);
            pos += want;
        }
    }
    free(b);
    return e;
}

void kvt_seglog_usage(kvt_seglog_t *self, uint64_t *bytes, uint64_t *segments)
{
    pthread_mutex_lock(&self->lock);
    if (bytes)
        *bytes = self->bytes;
    if (segments)
        *segments = self->segments;
    pthread_mutex_unlock(&self->lock);
}

kvt_seg_t *kvt_seglog_oldest(kvt_seglog_t *self, uint64_t *bytes)
{
    pthread_mutex_lock(&self->lock);
    kvt_seg_t *o = self->oldest;
    if (o && !o->closed && !o->writers) {
        self->active[o->stream] = NULL;
        o->closed = true;
        s_retire(o);
    }
    if (o && (!o->closed || o->writers || o->reclaiming))
        o = NULL;
    if (o) {
        o->reclaiming = true;
        *bytes = o->end;
    }
    pthread_mutex_unlock(&self->lock);
    return o;
}

kvt_seg_t *kvt_seglog_sparse(kvt_seglog_t *self)
{
    pthread_mutex_lock(&self->lock);
    uint64_t live = 0;
    for (kvt_seg_t *s = self->oldest; s; s = s->newer)
        live += s->live;
    kvt_seg_t *o = self->oldest;
    /* worth it when the oldest is mostly dead, or when the log as a whole is: then the disk
     * never holds more than twice what is live (and a segment's worth) */
    if (o && (!o->closed || o->writers || o->reclaiming ||
              (o->live >= o->end / 4 && live >= self->bytes / 2)))
        o = NULL;
    if (o)
        o->reclaiming = true;
    pthread_mutex_unlock(&self->lock);
    return o;
}

void kvt_seglog_unclaim(kvt_seglog_t *self, kvt_seg_t *seg)
{
    pthread_mutex_lock(&self->lock);
    seg->reclaiming = false;
    s_drop_empty(self);
    pthread_mutex_unlock(&self->lock);
}

void kvt_seglog_reclaim(kvt_seglog_t *self, kvt_seg_t *seg)
{
    pthread_mutex_lock(&self->lock);
    s_doom(self, seg);
    s_drop_empty(self);
    pthread_mutex_unlock(&self->lock);
}

/* ---- open ---------------------------------------------------------------------------------- */

typedef struct {
    uint64_t off, bytes, size;
    uint32_t nlen;
    bool tomb;
    char name[S_NAME_MAX + 1];
} s_rec_t;

static int s_push(s_rec_t **recs, size_t *n, size_t *cap, s_rec_t **r)
{
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 256;
        s_rec_t *x = realloc(*recs, c * sizeof *x);
        if (!x)
            return ENOMEM;
        *recs = x;
        *cap = c;
    }
    *r = &(*recs)[(*n)++];
    return 0;
}

/* The records of one segment, newest first, read backwards footer to footer. */
static int s_scan_seg(kvt_seg_t *seg, int fd, uint64_t len, s_rec_t **recs, size_t *n, size_t *cap,
                      uint64_t *skipped)
{
    char buf[512];
    uint64_t end = len & ~(uint64_t)(S_PAGE - 1);
    while (end > S_PAGE) {
        int e = s_io(fd, false, buf, sizeof buf, end - sizeof buf);
        if (e)
            return e;
        s_foot_t f;
        memcpy(&f, buf + sizeof buf - sizeof f, sizeof f);
        const char *name = buf + sizeof buf - sizeof f - (f.nlen <= S_NAME_MAX ? f.nlen : 0);
        bool ok =
            f.magic == S_REC_MAGIC && f.nlen <= S_NAME_MAX && f.nlen > 0 && f.pages >= 1 &&
            f.pages <= (end - S_PAGE) / S_PAGE && f.size <= f.pages * S_PAGE - f.nlen - sizeof f &&
            (f.flags & ~S_FLAG_TOMBSTONE) == 0 && s_foot_check(&f, name, seg->nonce) == f.check;
        if (!ok) {
            end -= S_PAGE;
            (*skipped)++;
            continue;
        }
        s_rec_t *r;
        int pe = s_push(recs, n, cap, &r);
        if (pe)
            return pe;
        r->bytes = f.pages * S_PAGE;
        r->off = end - r->bytes;
        r->size = f.size;
        r->nlen = f.nlen;
        r->tomb = f.flags & S_FLAG_TOMBSTONE;
        memcpy(r->name, name, f.nlen);
        r->name[f.nlen] = '\0';
        end = r->off;
    }
    return 0;
}

/* The records of one segment as its index file lists them. ENOENT: there is none. Entries
 * after the first damaged one (a write a crash cut short) and entries of records past the
 * segment's end (data that never reached the file) are left out and counted in *skipped. */
static int s_read_idx(kvt_seglog_t *self, kvt_seg_t *seg, s_rec_t **recs, size_t *n, size_t *cap,
                      uint64_t *skipped)
{
    char iname[24];
    s_idxname(iname, sizeof iname, seg->seq);
    int fd = openat(self->dirfd, iname, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        return e;
    }
    size_t len = (size_t)st.st_size;
    seg->ibytes = len;
    char *buf = malloc(len ? len : 1);
    int e = buf ? s_io(fd, false, buf, len, 0) : ENOMEM;
    close(fd);
    size_t first = *n;
    for (size_t at = 0; !e && at < len;) {
        s_ient_t x;
        const char *name = buf + at + sizeof x;
        if (len - at >= sizeof x)
            memcpy(&x, buf + at, sizeof x);
        if (len - at < sizeof x || x.nlen == 0 || x.nlen > S_NAME_MAX ||
            x.nlen > len - at - sizeof x || (x.flags & ~(S_FLAG_TOMBSTONE | S_FLAG_VOID)) ||
            s_ient_check(&x, name, seg->nonce) != x.check) {
            /* a torn or damaged entry: what follows it cannot be trusted to be all there is */
            *n = first;
            e = EBADMSG;
            break;
        }
        at += sizeof x + x.nlen;
        uint64_t bytes = (uint64_t)x.pages * S_PAGE;
        if (x.off < S_PAGE || x.off % S_PAGE || !x.pages || x.off > seg->end ||
            bytes > seg->end - x.off || x.nlen + sizeof(s_foot_t) > bytes ||
            x.size > bytes - x.nlen - sizeof(s_foot_t)) {
            (*skipped)++;
            continue;
        }
        if (x.flags & S_FLAG_VOID) { /* an append that reported failure: not a record */
            for (size_t k = first; k < *n; k++)
                if ((*recs)[k].off == x.off)
                    (*recs)[k].bytes = 0;
            continue;
        }
        s_rec_t *r;
        e = s_push(recs, n, cap, &r);
        if (e)
            break;
        *r = (s_rec_t){x.off, bytes, x.size, x.nlen, x.flags & S_FLAG_TOMBSTONE, ""};
        memcpy(r->name, name, x.nlen);
        r->name[x.nlen] = '\0';
    }
    size_t kept = first; /* drop the voided ones */
    for (size_t k = first; !e && k < *n; k++)
        if ((*recs)[k].bytes)
            (*recs)[kept++] = (*recs)[k];
    if (!e)
        *n = kept;
    free(buf);
    return e;
}

static int s_cmp_rec(const void *a, const void *b)
{
    uint64_t x = ((const s_rec_t *)a)->off, y = ((const s_rec_t *)b)->off;
    return x < y ? -1 : x > y;
}

static int s_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Opens the segment file `seq` for the log: its header must be ours. Returns NULL (and the file
 * removed) for a segment whose header a crash cut short. */
static kvt_seg_t *s_load_seg(kvt_seglog_t *self, uint64_t seq, int *err)
{
    char name[24];
    s_segname(name, sizeof name, seq);
    int fd = openat(self->dirfd, name, O_RDONLY | O_CLOEXEC); /* scanned through the cache */
    struct stat st;
    s_hdr_t h = {0};
    *err = fd < 0 || fstat(fd, &st) != 0 ? errno : 0;
    if (!*err && st.st_size >= (off_t)sizeof h)
        *err = s_io(fd, false, &h, sizeof h, 0);
    if (*err) {
        if (fd >= 0)
            close(fd);
        return NULL;
    }
    if (h.magic != S_HDR_MAGIC || h.seq != seq || h.check != s_hdr_check(&h)) {
        close(fd);
        kvt_log(KVT_LOG_WARN, "l2 fs:%s: segment %s has no valid header: removed", self->path,
                name);
        unlinkat(self->dirfd, name, 0);
        s_idxname(name, sizeof name, seq);
        unlinkat(self->dirfd, name, 0);
        return NULL;
    }
    kvt_seg_t *seg = calloc(1, sizeof *seg);
    if (!seg) {
        close(fd);
        *err = ENOMEM;
        return NULL;
    }
    seg->seq = seq;
    seg->nonce = h.nonce;
    seg->fd = fd;
    seg->ifd = -1;
    seg->end = (uint64_t)st.st_size;
    seg->closed = true;
    return seg;
}

int kvt_seglog_scan(kvt_seglog_t *self, kvt_seglog_visit_fn *visit, void *arg, uint64_t *skipped)
{
    *skipped = 0;
    int fd = openat(self->dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        return e;
    }
    uint64_t *seqs = NULL;
    size_t nseq = 0, cap = 0;
    int e = 0;
    for (struct dirent *de; !e && (de = readdir(d));) {
        if (strlen(de->d_name) == 20 && strcmp(de->d_name + 16, ".idx") == 0) {
            char seg[17]; /* an index whose segment is gone (a crash between the unlinks) */
            memcpy(seg, de->d_name, 16);
            seg[16] = '\0';
            if (faccessat(self->dirfd, seg, F_OK, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT)
                unlinkat(self->dirfd, de->d_name, 0);
            continue;
        }
        if (strlen(de->d_name) != 16 || strspn(de->d_name, "0123456789abcdef") != 16)
            continue; /* only the names s_segname makes */
        uint64_t seq = strtoull(de->d_name, NULL, 16);
        if (nseq == cap) {
            cap = cap ? cap * 2 : 64;
            uint64_t *s = realloc(seqs, cap * sizeof *s);
            if (!s) {
                e = ENOMEM;
                break;
            }
            seqs = s;
        }
        seqs[nseq++] = seq;
    }
    closedir(d);
    if (nseq)
        qsort(seqs, nseq, sizeof *seqs, s_cmp_u64);
    s_rec_t *recs = NULL;
    size_t rcap = 0;
    for (size_t i = 0; !e && i < nseq; i++) {
        kvt_seg_t *seg = s_load_seg(self, seqs[i], &e);
        if (!seg)
            continue;
        size_t n = 0;
        e = s_read_idx(self, seg, &recs, &n, &rcap, skipped);
        if (e == ENOENT || e == EBADMSG) { /* no usable index: read the footers, end to start */
            kvt_log(KVT_LOG_INFO,
                    "l2 fs:%s: segment %016" PRIx64 " has %s index: reading its records' footers",
                    self->path, seg->seq, e == ENOENT ? "no" : "a damaged");
            e = s_scan_seg(seg, seg->fd, seg->end, &recs, &n, &rcap, skipped);
        }
        if (!e && n)
            qsort(recs, n, sizeof *recs, s_cmp_rec);
        close(seg->fd);
        seg->fd = e ? -1 : s_openseg(self, seg->seq, O_RDONLY);
        if (!e && seg->fd < 0)
            e = errno;
        if (e) {
            s_free(seg);
            break;
        }
        pthread_mutex_lock(&self->lock);
        s_link(self, seg);
        self->next_seq = seg->seq + 1;
        for (size_t k = 0; k < n; k++)
            if (!recs[k].tomb)
                seg->live += recs[k].bytes;
        pthread_mutex_unlock(&self->lock);
        for (size_t k = 0; k < n; k++) {
            kvt_segloc_t loc = {seg, recs[k].off, recs[k].bytes};
            visit(arg, recs[k].name, recs[k].nlen, recs[k].size, recs[k].tomb, &loc);
        }
    }
    free(recs);
    free(seqs);
    pthread_mutex_lock(&self->lock);
    s_drop_empty(self);
    pthread_mutex_unlock(&self->lock);
    return e;
}

kvt_seglog_t *kvt_seglog_new(int dirfd, const char *path, uint64_t seg_size, int sync, bool direct,
                             char *err, size_t errlen)
{
    if (mkdirat(dirfd, KVT_SEGLOG_DIR, 0700) != 0 && errno != EEXIST) {
        snprintf(err, errlen, "fs:%s: cannot create %s/: %s", path, KVT_SEGLOG_DIR,
                 strerror(errno));
        return NULL;
    }
    kvt_seglog_t *self = calloc(1, sizeof *self);
    if (self)
        self->path = strdup(path);
    if (!self || !self->path) {
        if (self)
            free(self);
        snprintf(err, errlen, "fs:%s: out of memory", path);
        return NULL;
    }
    self->dirfd = openat(dirfd, KVT_SEGLOG_DIR, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (self->dirfd < 0) {
        snprintf(err, errlen, "fs:%s: %s/: %s", path, KVT_SEGLOG_DIR, strerror(errno));
        free(self->path);
        free(self);
        return NULL;
    }
    self->seg_size = s_round(seg_size < 2 * S_PAGE ? 2 * S_PAGE : seg_size);
    self->sync = sync;
    self->direct = direct;
    self->next_seq = 1;
    pthread_mutex_init(&self->lock, NULL);
    return self;
}

void kvt_seglog_destroy(kvt_seglog_t **self_p)
{
    kvt_seglog_t *self = *self_p;
    if (!self)
        return;
    *self_p = NULL;
    for (kvt_seg_t *s = self->oldest; s;) {
        kvt_seg_t *next = s->newer;
        s_free(s);
        s = next;
    }
    close(self->dirfd);
    pthread_mutex_destroy(&self->lock);
    free(self->path);
    free(self);
}
