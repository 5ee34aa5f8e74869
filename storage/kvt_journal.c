/* DESIGN: see kvt_journal.h for the format and why it is a journal. Records are built in a
 * growable buffer and written with one write() per call, so a reader never sees half of a
 * call's records unless the process died inside that write() (the torn tail the parser stops
 * at). Integers are little-endian on disk: written and read byte by byte, so the parser also
 * runs on big-endian hosts and never makes an unaligned load. */
#include "kvt_journal.h"

#include "kvt_error.h"
#include "kvt_le.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define S_REC_HDR 8u
#define S_MORE 1u /* record flag: the next record belongs to the same write */
#define S_HEADER_FIXED 56u
#define S_PUT_FIXED 56u
#define S_MAX_PAYLOAD (S_HEADER_FIXED + KVT_JOURNAL_MAX_PATH)
#define S_PAGE 4096u /* the allocator's page (kvt_alloc.h KVT_PAGE): extents are whole pages */

struct kvt_journal {
    pthread_mutex_t lock;
    int fd;
    bool broken;
    uint64_t salt; /* of the current file */
    uint64_t next_seq;
    kvt_journal_header_t hdr; /* what each new file's header says (its salt: the file's) */
    /* between kvt_journal_mark and kvt_journal_rewrite: a copy of every record appended, so
     * that the rewrite carries them into the new file */
    bool capturing, capture_failed;
    uint8_t *capt;
    size_t capt_len, capt_size;
    _Atomic uint64_t bytes;
    uint8_t *buf;
    size_t cap;
    char path[PATH_MAX];
};

/* ---- encoding ---- */

static size_t s_pad8(size_t n)
{
    return (n + 7) & ~(size_t)7;
}

/* Bytes of a whole record with `len` payload bytes. */
static size_t s_rec_size(size_t len)
{
    return S_REC_HDR + s_pad8(len) + 8;
}

/* Writes the frame around payload p[S_REC_HDR .. S_REC_HDR + len) (already in place); `more`:
 * further records of the same call follow (S_MORE), so a reader takes the call's records all
 * or none. */
static void s_frame(uint8_t *p, uint16_t type, size_t len, uint64_t salt, bool more)
{
    kvt_le_put32(p, (uint32_t)len);
    kvt_le_put16(p + 4, type);
    kvt_le_put16(p + 6, more ? S_MORE : 0);
    size_t body = S_REC_HDR + s_pad8(len);
    memset(p + S_REC_HDR + len, 0, s_pad8(len) - len);
    kvt_le_put64(p + body, XXH3_64bits_withSeed(p, body, salt));
}

static size_t s_put_payload(const kvt_journal_put_t *p)
{
    return S_PUT_FIXED + p->ns.name_len + p->ns.salt_len + p->label.len;
}

static void s_put_encode(uint8_t *q, const kvt_journal_put_t *p)
{
    kvt_le_put64(q, p->seq);
    kvt_le_put64(q + 8, p->offset);
    kvt_le_put64(q + 16, p->length);
    kvt_le_put64(q + 24, p->sum);
    q[32] = p->has_sum;
    q[33] = p->l2_pending;
    kvt_le_put16(q + 34, (uint16_t)p->ns.name_len);
    kvt_le_put16(q + 36, (uint16_t)p->ns.salt_len);
    kvt_le_put16(q + 38, (uint16_t)p->label.len);
    memcpy(q + 40, p->key.b, KVT_KEY_LEN);
    memcpy(q + S_PUT_FIXED, p->ns.name, p->ns.name_len);
    if (p->ns.salt_len)
        memcpy(q + S_PUT_FIXED + p->ns.name_len, p->ns.salt, p->ns.salt_len);
    if (p->label.len)
        memcpy(q + S_PUT_FIXED + p->ns.name_len + p->ns.salt_len, p->label.ptr, p->label.len);
}

/* ---- parsing ---- */

/* The record at buf[0..len) when whole and valid under `salt`: its type, payload, size and
 * whether more of its write follow. */
static bool s_record(const uint8_t *buf, size_t len, uint64_t salt, uint16_t *type,
                     const uint8_t **payload, size_t *plen, size_t *size, bool *more)
{
    if (len < S_REC_HDR + 8)
        return false;
    uint32_t l = kvt_le_get32(buf);
    if (l > S_MAX_PAYLOAD || (kvt_le_get16(buf + 6) & ~S_MORE) != 0 || s_rec_size(l) > len)
        return false;
    size_t body = S_REC_HDR + s_pad8(l);
    if (XXH3_64bits_withSeed(buf, body, salt) != kvt_le_get64(buf + body))
        return false;
    for (size_t i = S_REC_HDR + l; i < body; i++)
        if (buf[i])
            return false;
    *type = kvt_le_get16(buf + 4);
    *more = kvt_le_get16(buf + 6) & S_MORE;
    *payload = buf + S_REC_HDR;
    *plen = l;
    *size = s_rec_size(l);
    return true;
}

static bool s_put_decode(const uint8_t *q, size_t len, kvt_journal_put_t *p)
{
    if (len < S_PUT_FIXED)
        return false;
    p->seq = kvt_le_get64(q);
    p->offset = kvt_le_get64(q + 8);
    p->length = kvt_le_get64(q + 16);
    p->sum = kvt_le_get64(q + 24);
    if (q[32] > 1)
        return false;
    p->has_sum = q[32];
    p->l2_pending = q[33];
    /* versions 1 and 2 wrote 0 where version 3 writes the label's length */
    uint32_t nl = kvt_le_get16(q + 34), sl = kvt_le_get16(q + 36), ll = kvt_le_get16(q + 38);
    if (nl == 0 || nl > KVT_MAX_NS || sl > KVT_MAX_SALT || ll > KVT_MAX_LABEL ||
        len != S_PUT_FIXED + nl + sl + ll)
        return false;
    memcpy(p->key.b, q + 40, KVT_KEY_LEN);
    p->ns = (kvt_ns_t){q + S_PUT_FIXED, nl, sl ? q + S_PUT_FIXED + nl : NULL, sl};
    p->label = (kvt_bytes_t){ll ? q + S_PUT_FIXED + nl + sl : NULL, ll};
    return true;
}

/* Whether a record's content is one the parser delivers (PUT decoded into *p). */
static bool s_content_ok(uint16_t type, const uint8_t *q, size_t plen, kvt_journal_put_t *p)
{
    switch (type) {
    case KVT_JREC_PUT:
        return s_put_decode(q, plen, p);
    case KVT_JREC_SUM:
        return plen == 16;
    case KVT_JREC_DROP:
    case KVT_JREC_L2DONE:
        return plen == 8;
    case KVT_JREC_CLEAR:
        return plen == 0;
    default:
        return false;
    }
}

/* The end of the write (group of records) starting at buf[at]: > at when all of it is there
 * and valid, `at` otherwise (a torn or damaged tail). */
static size_t s_group(const uint8_t *buf, size_t len, size_t at, uint64_t salt)
{
    size_t g = at, size, plen;
    uint16_t type;
    const uint8_t *q;
    bool more = true;
    kvt_journal_put_t p;
    while (more) {
        if (!s_record(buf + g, len - g, salt, &type, &q, &plen, &size, &more) ||
            !s_content_ok(type, q, plen, &p))
            return at;
        g += size;
    }
    return g;
}

int kvt_journal_parse(const uint8_t *buf, size_t len, kvt_journal_header_t *hdr,
                      const kvt_journal_visitor_t *v, void *ctx, size_t *valid, char *err,
                      size_t errlen)
{
    *valid = 0;
    memset(hdr, 0, sizeof *hdr);
    uint16_t type;
    const uint8_t *q;
    size_t plen, size;
    bool more;
    if (!s_record(buf, len, 0, &type, &q, &plen, &size, &more) || type != KVT_JREC_HEADER || more ||
        plen < S_HEADER_FIXED) {
        snprintf(err, errlen, "%s",
                 len ? "the journal does not begin with a kvtier header" : "the journal is empty");
        return KVT_EBADREQ;
    }
    hdr->version = kvt_le_get32(q);
    if (hdr->version < KVT_JOURNAL_VERSION_MIN || hdr->version > KVT_JOURNAL_VERSION) {
        snprintf(err, errlen, "journal format version %u (this daemon reads %u to %u)",
                 hdr->version, KVT_JOURNAL_VERSION_MIN, KVT_JOURNAL_VERSION);
        return KVT_EBADREQ;
    }
    hdr->salt = kvt_le_get64(q + 8);
    hdr->arena_size = kvt_le_get64(q + 16);
    hdr->page_size = kvt_le_get64(q + 24);
    hdr->arena_dev = kvt_le_get64(q + 32);
    hdr->arena_ino = kvt_le_get64(q + 40);
    hdr->created = kvt_le_get64(q + 48);
    size_t pl = plen - S_HEADER_FIXED;
    memcpy(hdr->path, q + S_HEADER_FIXED, pl);
    hdr->path[pl] = '\0';
    if (pl == 0 || memchr(hdr->path, '\0', pl)) {
        snprintf(err, errlen, "the journal's header names no arena");
        return KVT_EBADREQ;
    }
    size_t at = size;
    for (size_t end; (end = s_group(buf, len, at, hdr->salt)) > at; at = end)
        for (size_t r = at; r < end; r += size) {
            kvt_journal_put_t p;
            s_record(buf + r, len - r, hdr->salt, &type, &q, &plen, &size, &more);
            s_content_ok(type, q, plen, &p);
            if (!v)
                continue;
            if (type == KVT_JREC_PUT && v->put)
                v->put(ctx, &p);
            else if (type == KVT_JREC_SUM && v->sum)
                v->sum(ctx, kvt_le_get64(q), kvt_le_get64(q + 8));
            else if (type == KVT_JREC_DROP && v->drop)
                v->drop(ctx, kvt_le_get64(q));
            else if (type == KVT_JREC_CLEAR && v->clear)
                v->clear(ctx);
            else if (type == KVT_JREC_L2DONE && v->l2done)
                v->l2done(ctx, kvt_le_get64(q));
        }
    *valid = at;
    return 0;
}

/* ---- the live set ---- */

typedef struct {
    kvt_journal_put_t *v;
    size_t n, cap;
    uint64_t last_seq;
    uint64_t rejected;
    bool bad;
} s_live_t;

static kvt_journal_put_t *s_find_seq(s_live_t *l, uint64_t seq)
{
    /* seqs increase along the journal, so `v` is sorted by seq: binary search */
    size_t lo = 0, hi = l->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (l->v[mid].seq < seq)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < l->n && l->v[lo].seq == seq ? &l->v[lo] : NULL;
}

static void s_live_put(void *ctx, const kvt_journal_put_t *p)
{
    s_live_t *l = ctx;
    if (l->bad)
        return;
    if (l->n && p->seq <= l->last_seq) { /* out of order: the file is not what we wrote */
        l->rejected++;
        return;
    }
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 256;
        kvt_journal_put_t *v = realloc(l->v, cap * sizeof *v);
        if (!v) {
            l->bad = true;
            return;
        }
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = *p;
    l->last_seq = p->seq;
}

static void s_live_sum(void *ctx, uint64_t seq, uint64_t sum)
{
    kvt_journal_put_t *p = s_find_seq(ctx, seq);
    if (p) {
        p->sum = sum;
        p->has_sum = true;
    }
}

static void s_live_drop(void *ctx, uint64_t seq)
{
    kvt_journal_put_t *p = s_find_seq(ctx, seq);
    if (p)
        p->length = UINT64_MAX; /* dropped: compacted away below */
}

static void s_live_l2done(void *ctx, uint64_t seq)
{
    kvt_journal_put_t *p = s_find_seq(ctx, seq);
    if (p)
        p->l2_pending = 0;
}

static void s_live_clear(void *ctx)
{
    s_live_t *l = ctx;
    for (size_t i = 0; i < l->n; i++)
        l->v[i].length = UINT64_MAX;
}

static int s_by_offset(const void *a, const void *b)
{
    const kvt_journal_put_t *x = a, *y = b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

int kvt_journal_live(const uint8_t *buf, size_t len, kvt_journal_header_t *hdr,
                     kvt_journal_put_t **out, size_t *n, uint64_t *rejected, size_t *valid,
                     char *err, size_t errlen)
{
    *out = NULL;
    *n = 0;
    *rejected = 0;
    s_live_t l = {0};
    kvt_journal_visitor_t v = {s_live_put, s_live_sum, s_live_drop, s_live_clear, s_live_l2done};
    int rc = kvt_journal_parse(buf, len, hdr, &v, &l, valid, err, errlen);
    if (rc == 0 && l.bad) {
        snprintf(err, errlen, "out of memory reading the journal");
        rc = KVT_ENOMEM;
    }
    if (rc) {
        free(l.v);
        return rc;
    }
    size_t m = 0;
    for (size_t i = 0; i < l.n; i++)
        if (l.v[i].length != UINT64_MAX)
            l.v[m++] = l.v[i];
    if (m)
        qsort(l.v, m, sizeof *l.v, s_by_offset);
    /* extents inside the arena, page-aligned, disjoint: anything else is left out */
    size_t k = 0;
    uint64_t end = 0, page = S_PAGE;
    for (size_t i = 0; i < m; i++) {
        kvt_journal_put_t *p = &l.v[i];
        bool inside =
            p->offset % page == 0 && p->length <= hdr->arena_size && p->length <= UINT64_MAX - page;
        uint64_t ext = p->length ? (p->length + page - 1) / page * page : page;
        inside = inside && ext <= hdr->arena_size && p->offset <= hdr->arena_size - ext;
        bool overlaps = k && p->offset < end;
        if (!inside || overlaps) {
            l.rejected++;
            if (overlaps && inside && p->offset + ext > end)
                end = p->offset + ext; /* the next one must clear this one too */
            continue;
        }
        l.v[k++] = *p;
        end = p->offset + ext;
    }
    *rejected = l.rejected;
    *n = k;
    if (k)
        *out = l.v;
    else
        free(l.v);
    return 0;
}

/* ---- the writer ---- */

static bool s_reserve(kvt_journal_t *self, size_t need)
{
    if (need <= self->cap)
        return true;
    size_t cap = self->cap ? self->cap : 4096;
    while (cap < need)
        cap *= 2;
    uint8_t *b = realloc(self->buf, cap);
    if (!b)
        return false;
    self->buf = b;
    self->cap = cap;
    return true;
}

static int s_write_all(int fd, const uint8_t *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return KVT_EIO;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Writes self->buf[0..n) (lock held). */
static int s_flush(kvt_journal_t *self, size_t n)
{
    if (self->broken)
        return KVT_EIO;
    if (s_write_all(self->fd, self->buf, n) != 0) {
        self->broken = true;
        return KVT_EIO;
    }
    atomic_fetch_add_explicit(&self->bytes, n, memory_order_relaxed);
    if (self->capturing && !self->capture_failed) {
        if (self->capt_len + n > self->capt_size) {
            size_t size = self->capt_size ? self->capt_size : 4096;
            while (size < self->capt_len + n)
                size *= 2;
            uint8_t *c = realloc(self->capt, size);
            if (!c) {
                self->capture_failed = true; /* the rewrite is refused, nothing lost */
                return 0;
            }
            self->capt = c;
            self->capt_size = size;
        }
        memcpy(self->capt + self->capt_len, self->buf, n);
        self->capt_len += n;
    }
    return 0;
}

/* Appends the PUT records of puts[0..n) to the buffer at *at (lock held); seqs given when
 * `assign`. False when out of memory. */
static bool s_encode_puts(kvt_journal_t *self, kvt_journal_put_t *puts, size_t n, bool assign,
                          size_t *at)
{
    for (size_t i = 0; i < n; i++) {
        size_t pl = s_put_payload(&puts[i]);
        if (!s_reserve(self, *at + s_rec_size(pl)))
            return false;
        if (assign)
            puts[i].seq = self->next_seq++;
        else if (puts[i].seq >= self->next_seq)
            self->next_seq = puts[i].seq + 1;
        s_put_encode(self->buf + *at + S_REC_HDR, &puts[i]);
        s_frame(self->buf + *at, KVT_JREC_PUT, pl, self->salt, i + 1 < n);
        *at += s_rec_size(pl);
    }
    return true;
}

/* The record's variable parts fit the format: namespace, salt and label lengths. */
static bool s_put_ok(const kvt_journal_put_t *p)
{
    return p->ns.name_len >= 1 && p->ns.name_len <= KVT_MAX_NS && p->ns.salt_len <= KVT_MAX_SALT &&
           p->label.len <= KVT_MAX_LABEL;
}

/* A fresh file for self->hdr (a new salt) holding the PUT records of live[0..n), written to
 * path.new and renamed over path; its descriptor in *fd_out (lock held, or before any thread
 * sees self). 0, or an error code with the reason in err. */
static int s_write_file(kvt_journal_t *self, const kvt_journal_put_t *live, size_t n, int *fd_out,
                        char *err, size_t errlen)
{
    for (size_t i = 0; i < n; i++)
        if (!s_put_ok(&live[i])) {
            snprintf(err, errlen, "a carried-over object has an invalid namespace or label");
            return KVT_EINVAL;
        }
    uint64_t salt = 0;
    while (salt == 0)
        if (getrandom(&salt, sizeof salt, 0) != (ssize_t)sizeof salt) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            salt = XXH3_64bits(&ts, sizeof ts) ^ (uint64_t)getpid();
        }
    char tmp[PATH_MAX + 8];
    snprintf(tmp, sizeof tmp, "%s.new", self->path);
    (void)unlink(tmp);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_APPEND, 0600);
    if (fd < 0) {
        snprintf(err, errlen, "%s: %s", tmp, strerror(errno));
        return KVT_EIO;
    }
    kvt_journal_header_t *h = &self->hdr;
    size_t pl = strlen(h->path), hl = S_HEADER_FIXED + pl, at = s_rec_size(hl);
    kvt_journal_put_t *copy = n ? malloc(n * sizeof *copy) : NULL;
    int rc = KVT_ENOMEM;
    uint64_t old_salt = self->salt;
    if ((copy || !n) && s_reserve(self, at)) {
        uint8_t *q = self->buf + S_REC_HDR;
        kvt_le_put32(q, KVT_JOURNAL_VERSION);
        kvt_le_put32(q + 4, 0);
        kvt_le_put64(q + 8, salt);
        kvt_le_put64(q + 16, h->arena_size);
        kvt_le_put64(q + 24, h->page_size);
        kvt_le_put64(q + 32, h->arena_dev);
        kvt_le_put64(q + 40, h->arena_ino);
        kvt_le_put64(q + 48, h->created);
        memcpy(q + S_HEADER_FIXED, h->path, pl);
        s_frame(self->buf, KVT_JREC_HEADER, hl, 0, false);
        if (n)
            memcpy(copy, live, n * sizeof *copy);
        self->salt = salt; /* the records are framed with the new file's salt */
        rc = s_encode_puts(self, copy, n, false, &at) ? 0 : KVT_ENOMEM;
        /* records appended since kvt_journal_mark, framed again with the new salt */
        uint16_t type;
        const uint8_t *rp;
        size_t plen, size;
        bool more;
        for (size_t r = 0; rc == 0 && r < self->capt_len; r += size) {
            if (!s_record(self->capt + r, self->capt_len - r, old_salt, &type, &rp, &plen, &size,
                          &more)) {
                rc = KVT_EINTERNAL; /* our own bytes: cannot be */
                break;
            }
            if (!s_reserve(self, at + size)) {
                rc = KVT_ENOMEM;
                break;
            }
            memcpy(self->buf + at + S_REC_HDR, rp, plen);
            s_frame(self->buf + at, type, plen, salt, more);
            at += size;
        }
        if (rc == 0)
            rc = s_write_all(fd, self->buf, at);
        if (rc == 0 && rename(tmp, self->path) != 0)
            rc = KVT_EIO;
        if (rc) {
            self->salt = old_salt;
            snprintf(err, errlen, "%s: %s", tmp,
                     rc == KVT_ENOMEM ? "out of memory" : strerror(errno ? errno : EIO));
        }
    } else {
        snprintf(err, errlen, "out of memory");
    }
    free(copy);
    if (rc) {
        close(fd);
        (void)unlink(tmp);
        return rc;
    }
    h->salt = salt;
    *fd_out = fd;
    atomic_store_explicit(&self->bytes, at, memory_order_relaxed);
    return 0;
}

kvt_journal_t *kvt_journal_create(const char *path, kvt_journal_header_t *hdr,
                                  const kvt_journal_put_t *live, size_t nlive, char *err,
                                  size_t errlen)
{
    size_t pl = strlen(hdr->path);
    if (pl == 0 || pl > KVT_JOURNAL_MAX_PATH || strlen(path) + 5 > PATH_MAX) {
        snprintf(err, errlen, "journal or arena path too long");
        return NULL;
    }
    kvt_journal_t *self = calloc(1, sizeof *self);
    if (!self) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&self->lock, NULL);
    self->fd = -1;
    self->next_seq = 1;
    snprintf(self->path, sizeof self->path, "%s", path);
    hdr->version = KVT_JOURNAL_VERSION;
    self->hdr = *hdr;
    if (s_write_file(self, live, nlive, &self->fd, err, errlen) != 0) {
        pthread_mutex_destroy(&self->lock);
        free(self->buf);
        free(self);
        return NULL;
    }
    hdr->salt = self->salt;
    return self;
}

/* Ends a capture (lock held). */
static void s_unmark(kvt_journal_t *self)
{
    self->capturing = false;
    free(self->capt);
    self->capt = NULL;
    self->capt_len = self->capt_size = 0;
}

void kvt_journal_mark(kvt_journal_t *self)
{
    pthread_mutex_lock(&self->lock);
    self->capturing = true;
    self->capture_failed = false;
    self->capt_len = 0;
    pthread_mutex_unlock(&self->lock);
}

int kvt_journal_rewrite(kvt_journal_t *self, const kvt_journal_put_t *live, size_t n, char *err,
                        size_t errlen)
{
    pthread_mutex_lock(&self->lock);
    int fd = -1, rc = 0;
    if (self->broken) {
        rc = KVT_EIO;
        snprintf(err, errlen, "the journal is broken");
    } else if (self->capture_failed) {
        rc = KVT_ENOMEM;
        snprintf(err, errlen, "out of memory keeping the records appended meanwhile");
    } else {
        rc = s_write_file(self, live, n, &fd, err, errlen);
    }
    if (rc == 0) {
        close(self->fd); /* the old file is gone (renamed over): nothing more goes to it */
        self->fd = fd;
    }
    s_unmark(self);
    pthread_mutex_unlock(&self->lock);
    return rc;
}

void kvt_journal_unmark(kvt_journal_t *self)
{
    pthread_mutex_lock(&self->lock);
    s_unmark(self);
    pthread_mutex_unlock(&self->lock);
}

void kvt_journal_destroy(kvt_journal_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_journal_t *self = *self_p;
    if (self->fd >= 0)
        close(self->fd);
    pthread_mutex_destroy(&self->lock);
    free(self->buf);
    free(self->capt);
    free(self);
    *self_p = NULL;
}

int kvt_journal_put(kvt_journal_t *self, kvt_journal_put_t *puts, size_t n)
{
    if (n == 0)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!s_put_ok(&puts[i]))
            return KVT_EINVAL;
    pthread_mutex_lock(&self->lock);
    size_t at = 0;
    int rc = s_encode_puts(self, puts, n, true, &at) ? s_flush(self, at) : KVT_ENOMEM;
    if (rc == KVT_ENOMEM)
        self->broken = true; /* seqs were handed out for records never written */
    pthread_mutex_unlock(&self->lock);
    return rc;
}

/* One fixed-size record of `type` holding u64 words w[0..nw). */
static int s_small(kvt_journal_t *self, uint16_t type, const uint64_t *w, size_t nw)
{
    pthread_mutex_lock(&self->lock);
    int rc = KVT_ENOMEM;
    if (s_reserve(self, s_rec_size(nw * 8))) {
        for (size_t i = 0; i < nw; i++)
            kvt_le_put64(self->buf + S_REC_HDR + 8 * i, w[i]);
        s_frame(self->buf, type, nw * 8, self->salt, false);
        rc = s_flush(self, s_rec_size(nw * 8));
    }
    pthread_mutex_unlock(&self->lock);
    return rc;
}

int kvt_journal_sum(kvt_journal_t *self, uint64_t seq, uint64_t sum)
{
    uint64_t w[2] = {seq, sum};
    return s_small(self, KVT_JREC_SUM, w, 2);
}

int kvt_journal_drop(kvt_journal_t *self, const uint64_t *seqs, size_t n)
{
    if (n == 0)
        return 0;
    pthread_mutex_lock(&self->lock);
    int rc = KVT_ENOMEM;
    size_t one = s_rec_size(8);
    if (n <= SIZE_MAX / one && s_reserve(self, n * one)) {
        for (size_t i = 0; i < n; i++) {
            kvt_le_put64(self->buf + i * one + S_REC_HDR, seqs[i]);
            s_frame(self->buf + i * one, KVT_JREC_DROP, 8, self->salt, i + 1 < n);
        }
        rc = s_flush(self, n * one);
    }
    pthread_mutex_unlock(&self->lock);
    return rc;
}

int kvt_journal_clear(kvt_journal_t *self)
{
    return s_small(self, KVT_JREC_CLEAR, NULL, 0);
}

int kvt_journal_l2done(kvt_journal_t *self, uint64_t seq)
{
    return s_small(self, KVT_JREC_L2DONE, &seq, 1);
}

uint64_t kvt_journal_bytes(kvt_journal_t *self)
{
    return atomic_load_explicit(&self->bytes, memory_order_relaxed);
}

const char *kvt_journal_path(const kvt_journal_t *self)
{
    return self->path;
}
