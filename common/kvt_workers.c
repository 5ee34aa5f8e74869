/* DESIGN: two kvt_queues of job nodes — `todo` (bounded by max_queue; the workers pop it) and
 * `done` (its eventfd is what the owner's loop polls; none in a detached pool, whose nodes are
 * freed after the job ran). A node moves from one to the other, so a job needs no allocation
 * on the way back. A worker beats for the supervisor between jobs and at least every 200 ms
 * while idle (kvt_thread_idle_ms); a job that runs longer than the worker's silence limit (10 s,
 * or the detached pool's) makes /readyz say so, which is the point. On destroy the todo queue
 * is closed: workers run what is queued, then return. */
#include "kvt_workers.h"

#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_queue.h"
#include "kvt_thread.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define S_MAX_THREADS 64

typedef struct {
    kvt_job_fn fn;
    void *job;
} s_node_t;

struct kvt_workers {
    kvt_queue_t *todo, *done;
    _Atomic size_t pending;
    int nthreads;
    kvt_thread_t *threads[S_MAX_THREADS];
};

static bool s_run(kvt_thread_t *t, void *arg)
{
    kvt_workers_t *self = arg;
    for (;;) {
        s_node_t *n;
        int rc = kvt_queue_pop(self->todo, (void **)&n, kvt_thread_idle_ms(t));
        if (rc == KVT_EUNAVAIL) /* closed and drained */
            return true;
        if (rc != 0) {
            if (!kvt_thread_beat(t))
                return false;
            continue;
        }
        kvt_thread_beat(t);
        n->fn(n->job);
        kvt_thread_beat(t);
        if (self->done) {
            kvt_assert(kvt_queue_push(self->done, n, 1) == 0);
        } else {
            free(n);
            atomic_fetch_sub(&self->pending, 1);
        }
        kvt_queue_task_done(self->todo, 1);
    }
}

static kvt_workers_t *s_new(const char *name, int n, size_t max_queue, uint32_t silence_ms,
                            bool handback, kvt_sup_t *sup, char *err, size_t errlen)
{
    if (n < 1 || n > S_MAX_THREADS) {
        snprintf(err, errlen, "workers: %d threads, want 1 to %d", n, S_MAX_THREADS);
        return NULL;
    }
    kvt_workers_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    char qerr[160];
    self->todo = kvt_queue_new(max_queue, 0, qerr, sizeof qerr);
    /* holds what was submitted and not collected yet: at most the requests in flight */
    if (handback)
        self->done = kvt_queue_new(KVT_QUEUE_BOUNDED_BY_CALLER, KVT_QUEUE_FD, qerr, sizeof qerr);
    if (!self->todo || (handback && !self->done)) {
        snprintf(err, errlen, "workers: %s", qerr);
        goto fail;
    }
    for (int i = 0; i < n; i++) {
        char tname[32];
        snprintf(tname, sizeof tname, "%s-%d", name, i);
        self->threads[i] = kvt_thread_start(sup, tname, silence_ms, s_run, self);
        if (!self->threads[i]) {
            snprintf(err, errlen, "workers: cannot start thread %d", i);
            goto fail;
        }
        self->nthreads = i + 1;
    }
    return self;
fail:
    kvt_workers_destroy(&self);
    return NULL;
}

kvt_workers_t *kvt_workers_new(const char *name, int n, size_t max_queue, kvt_sup_t *sup,
                               char *err, size_t errlen)
{
    return s_new(name, n, max_queue, 10000, true, sup, err, errlen);
}

kvt_workers_t *kvt_workers_new_detached(const char *name, int n, size_t max_queue,
                                        uint32_t silence_ms, kvt_sup_t *sup, char *err,
                                        size_t errlen)
{
    return s_new(name, n, max_queue, silence_ms, false, sup, err, errlen);
}

void kvt_workers_destroy(kvt_workers_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_workers_t *self = *self_p;
    kvt_queue_close(self->todo);
    for (int i = 0; i < self->nthreads; i++)
        kvt_thread_join(&self->threads[i]);
    void *n;
    while (self->done && kvt_queue_pop(self->done, &n, 0) == 0) {
        kvt_log(KVT_LOG_WARN, "workers: a finished job was never collected");
        free(n);
    }
    kvt_queue_destroy(&self->todo);
    kvt_queue_destroy(&self->done);
    free(self);
    *self_p = NULL;
}

int kvt_workers_submit(kvt_workers_t *self, kvt_job_fn fn, void *job)
{
    s_node_t *n = malloc(sizeof *n);
    kvt_assert(n);
    n->fn = fn;
    n->job = job;
    if (kvt_queue_push(self->todo, n, 1) != 0) { /* full, or stopping */
        free(n);
        return KVT_EBUSY;
    }
    /* after the push is fine: only this (the server) thread collects and reads it */
    atomic_fetch_add(&self->pending, 1);
    return 0;
}

void *kvt_workers_done(kvt_workers_t *self)
{
    s_node_t *n;
    if (!self->done || kvt_queue_pop(self->done, (void **)&n, 0) != 0)
        return NULL;
    kvt_queue_task_done(self->done, 1);
    void *job = n->job;
    free(n);
    atomic_fetch_sub(&self->pending, 1);
    return job;
}

int kvt_workers_fd(const kvt_workers_t *self)
{
    return self->done ? kvt_queue_fd(self->done) : -1;
}

size_t kvt_workers_pending(const kvt_workers_t *self)
{
    return atomic_load(&((kvt_workers_t *)self)->pending);
}
