/* DESIGN: a ring of (item, weight) slots that doubles when it is full of items (the bound is on
 * the weight, which the ring does not know in items), one mutex and two condition variables:
 * `nonempty` for poppers, `idle` for kvt_queue_wait_idle. Both are created with
 * pthread_condattr_setclock(CLOCK_MONOTONIC), and deadlines are computed once on that clock, so
 * a spurious wake-up does not restart a wait and a wall-clock step does not move it. The
 * optional eventfd is written when the queue goes from empty to not empty and read back when it
 * empties, both under the lock, so it is readable exactly while items wait. Nothing is called
 * back under the lock (displaced items are collected, then handed over). */
#include "kvt_queue.h"

#include "kvt_error.h"
#include "kvt_log.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#define S_SLOTS0 16

typedef struct {
    void *item;
    size_t weight;
} s_slot_t;

struct kvt_queue {
    pthread_mutex_t lock;
    pthread_cond_t nonempty, idle;
    s_slot_t *ring;
    size_t nslots, head, len;
    size_t capacity, depth;
    bool closed;
    int efd;
    kvt_queue_stats_t st; /* len and depth are filled in by kvt_queue_stats */
};

kvt_queue_t *kvt_queue_new(size_t capacity, unsigned flags, char *err, size_t errlen)
{
    kvt_queue_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->efd = -1;
    pthread_mutex_init(&self->lock, NULL);
    kvt_cond_init_mono(&self->nonempty);
    kvt_cond_init_mono(&self->idle);
    self->capacity = capacity;
    self->nslots = S_SLOTS0;
    self->ring = calloc(self->nslots, sizeof *self->ring);
    kvt_assert(self->ring);
    if (flags & KVT_QUEUE_FD) {
        self->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (self->efd < 0) {
            snprintf(err, errlen, "eventfd: %s", strerror(errno));
            kvt_queue_destroy(&self);
            return NULL;
        }
    }
    return self;
}

void kvt_queue_destroy(kvt_queue_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_queue_t *self = *self_p;
    if (self->efd >= 0)
        close(self->efd);
    free(self->ring);
    pthread_cond_destroy(&self->nonempty);
    pthread_cond_destroy(&self->idle);
    pthread_mutex_destroy(&self->lock);
    free(self);
    *self_p = NULL;
}

/* ---- the ring (lock held) ---- */

static void s_append(kvt_queue_t *self, void *item, size_t weight)
{
    if (self->len == self->nslots) { /* full of items: double, unwrapping the old ring */
        s_slot_t *ring = calloc(self->nslots * 2, sizeof *ring);
        kvt_assert(ring);
        for (size_t i = 0; i < self->len; i++)
            ring[i] = self->ring[(self->head + i) % self->nslots];
        free(self->ring);
        self->ring = ring;
        self->head = 0;
        self->nslots *= 2;
    }
    self->ring[(self->head + self->len) % self->nslots] = (s_slot_t){item, weight};
    if (self->len++ == 0 && self->efd >= 0) {
        uint64_t one = 1;
        ssize_t w = write(self->efd, &one, sizeof one);
        (void)w; /* cannot fail: the counter is 0 or 1 */
    }
    self->depth += weight;
    if (self->depth > self->st.high_water)
        self->st.high_water = self->depth;
    self->st.pushed++;
}

static void *s_take(kvt_queue_t *self)
{
    s_slot_t s = self->ring[self->head];
    self->head = (self->head + 1) % self->nslots;
    self->depth -= s.weight;
    if (--self->len == 0 && self->efd >= 0) {
        uint64_t v;
        ssize_t r = read(self->efd, &v, sizeof v);
        (void)r;
    }
    return s.item;
}

/* ---- producers ---- */

/* Lock held. depth passes capacity only after an overweight displacing push. */
static bool s_fits(const kvt_queue_t *self, size_t weight)
{
    return self->depth <= self->capacity && weight <= self->capacity - self->depth;
}

int kvt_queue_push(kvt_queue_t *self, void *item, size_t weight)
{
    pthread_mutex_lock(&self->lock);
    int rc = self->closed ? KVT_EUNAVAIL : !s_fits(self, weight) ? KVT_EBUSY : 0;
    if (rc == 0) {
        s_append(self, item, weight);
        pthread_cond_signal(&self->nonempty);
    } else {
        self->st.rejected++;
    }
    pthread_mutex_unlock(&self->lock);
    return rc;
}

int kvt_queue_push_displace(kvt_queue_t *self, void *item, size_t weight,
                            void (*drop)(void *ctx, void *item), void *ctx)
{
    void **out = NULL;
    size_t nout = 0, cap = 0;
    pthread_mutex_lock(&self->lock);
    if (self->closed) {
        self->st.rejected++;
        pthread_mutex_unlock(&self->lock);
        return KVT_EUNAVAIL;
    }
    while (self->len && !s_fits(self, weight)) {
        if (nout == cap) {
            cap = cap ? cap * 2 : 8;
            out = realloc(out, cap * sizeof *out);
            kvt_assert(out);
        }
        out[nout++] = s_take(self);
        self->st.displaced++;
    }
    s_append(self, item, weight);
    pthread_cond_signal(&self->nonempty);
    pthread_mutex_unlock(&self->lock);
    for (size_t i = 0; i < nout; i++)
        drop(ctx, out[i]);
    free(out);
    return 0;
}

/* ---- consumers ---- */

int kvt_queue_pop_batch(kvt_queue_t *self, void **items, size_t max, size_t *n,
                        int64_t timeout_ms)
{
    *n = 0;
    pthread_mutex_lock(&self->lock);
    if (self->len == 0 && !self->closed && timeout_ms != 0) {
        struct timespec until = kvt_mono_deadline(timeout_ms > 0 ? timeout_ms : 0);
        while (self->len == 0 && !self->closed) {
            if (timeout_ms < 0)
                pthread_cond_wait(&self->nonempty, &self->lock);
            else if (pthread_cond_timedwait(&self->nonempty, &self->lock, &until) == ETIMEDOUT)
                break;
        }
    }
    while (*n < max && self->len)
        items[(*n)++] = s_take(self);
    self->st.active += *n;
    int rc = *n ? 0 : self->closed ? KVT_EUNAVAIL : KVT_ETIMEDOUT;
    if (*n && self->len) /* more left: another waiting popper may take them */
        pthread_cond_signal(&self->nonempty);
    pthread_mutex_unlock(&self->lock);
    return rc;
}

int kvt_queue_pop(kvt_queue_t *self, void **item, int64_t timeout_ms)
{
    size_t n;
    *item = NULL;
    return kvt_queue_pop_batch(self, item, 1, &n, timeout_ms);
}

void kvt_queue_task_done(kvt_queue_t *self, size_t n)
{
    pthread_mutex_lock(&self->lock);
    kvt_assert(self->st.active >= n);
    self->st.active -= n;
    if (self->st.active == 0 && self->len == 0)
        pthread_cond_broadcast(&self->idle);
    pthread_mutex_unlock(&self->lock);
}

int kvt_queue_wait_idle(kvt_queue_t *self, int64_t timeout_ms)
{
    pthread_mutex_lock(&self->lock);
    struct timespec until = kvt_mono_deadline(timeout_ms > 0 ? timeout_ms : 0);
    int rc = 0;
    while (self->len || self->st.active) {
        if (timeout_ms == 0 || (timeout_ms > 0 && pthread_cond_timedwait(&self->idle, &self->lock,
                                                                         &until) == ETIMEDOUT)) {
            rc = self->len || self->st.active ? KVT_ETIMEDOUT : 0;
            break;
        }
        if (timeout_ms < 0)
            pthread_cond_wait(&self->idle, &self->lock);
    }
    pthread_mutex_unlock(&self->lock);
    return rc;
}

/* ---- state ---- */

void kvt_queue_close(kvt_queue_t *self)
{
    pthread_mutex_lock(&self->lock);
    self->closed = true;
    pthread_cond_broadcast(&self->nonempty);
    pthread_mutex_unlock(&self->lock);
}

bool kvt_queue_closed(kvt_queue_t *self)
{
    pthread_mutex_lock(&self->lock);
    bool closed = self->closed;
    pthread_mutex_unlock(&self->lock);
    return closed;
}

size_t kvt_queue_depth(kvt_queue_t *self)
{
    pthread_mutex_lock(&self->lock);
    size_t d = self->depth;
    pthread_mutex_unlock(&self->lock);
    return d;
}

void kvt_queue_stats(kvt_queue_t *self, kvt_queue_stats_t *out)
{
    pthread_mutex_lock(&self->lock);
    *out = self->st;
    out->len = self->len;
    out->depth = self->depth;
    pthread_mutex_unlock(&self->lock);
}

int kvt_queue_fd(const kvt_queue_t *self)
{
    return self->efd;
}
