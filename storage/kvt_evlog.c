/* DESIGN: a ring of record pointers, slot seq % capacity, holding seq first..last. An append
 * allocates the record outside the lock (keys and namespace copied into it), then under the
 * lock takes the next seq and drops the oldest records while the ring is full or the bytes are
 * over max_bytes (never the one just added). The log holds one reference to each record it
 * keeps, a reader one more per record read: whoever drops the last one frees it. Waiters sleep
 * on one condition variable, broadcast on every append. */
#include "kvt_evlog.h"

#include "kvt_log.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct kvt_evlog {
    pthread_mutex_t lock;
    pthread_cond_t grew;
    kvt_evrec_t **ring;
    uint32_t capacity;
    size_t max_bytes, bytes;
    uint64_t first, last; /* the records kept: first..last; none when first > last */
    bool closed;
    uint64_t incarnation;
};

static const char *const s_names[] = {[KVT_EV_STORED] = "stored",
                                      [KVT_EV_EVICTED] = "evicted",
                                      [KVT_EV_REMOVED] = "removed",
                                      [KVT_EV_L2_STORED] = "l2_stored",
                                      [KVT_EV_L2_REMOVED] = "l2_removed"};

const char *kvt_ev_name(kvt_ev_kind_t kind)
{
    return s_names[kind];
}

const char *kvt_ev_tier(kvt_ev_kind_t kind)
{
    return kind >= KVT_EV_L2_STORED ? "l2" : "l1";
}

static void s_unref(kvt_evrec_t *r)
{
    if (atomic_fetch_sub_explicit(&r->refs, 1, memory_order_acq_rel) == 1)
        free(r);
}

kvt_evlog_t *kvt_evlog_new(uint32_t capacity, size_t max_bytes)
{
    kvt_assert(capacity >= 1);
    kvt_evlog_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->ring = calloc(capacity, sizeof *self->ring);
    kvt_assert(self->ring);
    self->capacity = capacity;
    self->max_bytes = max_bytes;
    self->first = 1;
    pthread_mutex_init(&self->lock, NULL);
    kvt_cond_init_mono(&self->grew);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    self->incarnation = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    return self;
}

void kvt_evlog_destroy(kvt_evlog_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_evlog_t *self = *self_p;
    for (uint64_t s = self->first; s <= self->last; s++)
        s_unref(self->ring[s % self->capacity]);
    free(self->ring);
    pthread_cond_destroy(&self->grew);
    pthread_mutex_destroy(&self->lock);
    free(self);
    *self_p = NULL;
}

/* Lock held: drops the oldest record. */
static void s_drop_oldest(kvt_evlog_t *self)
{
    kvt_evrec_t **slot = &self->ring[self->first % self->capacity];
    self->bytes -= (*slot)->bytes;
    s_unref(*slot);
    *slot = NULL;
    self->first++;
}

uint64_t kvt_evlog_append(kvt_evlog_t *self, kvt_ev_kind_t kind, const kvt_ns_t *ns,
                          const kvt_key_t *keys, const uint64_t *sizes,
                          const kvt_bytes_t *labels, uint32_t n)
{
    if (!self || n == 0)
        return 0;
    /* one allocation: the record, sizes, labels (views), keys, namespace, label bytes */
    size_t lb = 0;
    for (uint32_t i = 0; labels && i < n; i++)
        lb += labels[i].len;
    size_t nsb = kvt_ns_size(ns), szb = sizes ? n * sizeof *sizes : 0;
    size_t lvb = labels ? n * sizeof *labels : 0;
    size_t bytes = sizeof(kvt_evrec_t) + szb + lvb + n * sizeof *keys + nsb + lb;
    kvt_evrec_t *r = malloc(bytes);
    kvt_assert(r);
    uint8_t *p = (uint8_t *)(r + 1);
    r->sizes = sizes ? memcpy(p, sizes, szb) : NULL;
    p += szb;
    kvt_bytes_t *lv = labels ? (kvt_bytes_t *)(void *)p : NULL;
    p += lvb;
    kvt_key_t *k = memcpy(p, keys, n * sizeof *keys);
    p += n * sizeof *keys;
    r->ns = kvt_ns_copy(ns, p);
    p += nsb;
    for (uint32_t i = 0; lv && i < n; i++) {
        lv[i] = (kvt_bytes_t){labels[i].len ? memcpy(p, labels[i].ptr, labels[i].len) : NULL,
                              labels[i].len};
        p += labels[i].len;
    }
    r->labels = lv;
    r->bytes = bytes;
    r->keys = k;
    r->n = n;
    r->kind = kind;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    r->wall_ms = (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
    atomic_init(&r->refs, 1);
    pthread_mutex_lock(&self->lock);
    r->seq = ++self->last;
    if (self->last - self->first >= self->capacity) /* full: the new one takes the oldest slot */
        s_drop_oldest(self);
    self->ring[r->seq % self->capacity] = r;
    self->bytes += r->bytes;
    while (self->max_bytes && self->bytes > self->max_bytes && self->first < self->last)
        s_drop_oldest(self);
    uint64_t seq = r->seq;
    pthread_cond_broadcast(&self->grew);
    pthread_mutex_unlock(&self->lock);
    return seq;
}

uint32_t kvt_evlog_read(kvt_evlog_t *self, uint64_t cursor, kvt_evrec_t **out, uint32_t max,
                        kvt_evlog_span_t *span)
{
    uint32_t n = 0;
    pthread_mutex_lock(&self->lock);
    uint64_t s = cursor + 1 > self->first ? cursor + 1 : self->first;
    for (; s <= self->last && n < max; s++) {
        kvt_evrec_t *r = self->ring[s % self->capacity];
        atomic_fetch_add_explicit(&r->refs, 1, memory_order_relaxed);
        out[n++] = r;
    }
    if (span)
        *span = (kvt_evlog_span_t){self->first, self->last};
    pthread_mutex_unlock(&self->lock);
    return n;
}

void kvt_evlog_put(kvt_evrec_t **recs, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        s_unref(recs[i]);
}

bool kvt_evlog_wait(kvt_evlog_t *self, uint64_t cursor, long timeout_ms)
{
    struct timespec until = kvt_mono_deadline(timeout_ms);
    pthread_mutex_lock(&self->lock);
    int rc = 0;
    while (!self->closed && self->last <= cursor && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&self->grew, &self->lock, &until);
    bool more = !self->closed && self->last > cursor;
    pthread_mutex_unlock(&self->lock);
    return more;
}

void kvt_evlog_close(kvt_evlog_t *self)
{
    pthread_mutex_lock(&self->lock);
    self->closed = true;
    pthread_cond_broadcast(&self->grew);
    pthread_mutex_unlock(&self->lock);
}

uint64_t kvt_evlog_incarnation(const kvt_evlog_t *self)
{
    return self->incarnation;
}

kvt_evlog_span_t kvt_evlog_span(kvt_evlog_t *self)
{
    pthread_mutex_lock(&self->lock);
    kvt_evlog_span_t sp = {self->first, self->last};
    pthread_mutex_unlock(&self->lock);
    return sp;
}
