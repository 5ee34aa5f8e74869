/* DESIGN: two FIFOs of nodes under one mutex — `todo` (bounded, with a condition variable the
 * workers wait on) and `done` (signalled to the server loop through an eventfd). A worker
 * beats for the supervisor between jobs and at least every 200 ms while idle; a job that runs
 * longer than the worker's silence limit (10 s) makes /readyz say so, which is the point. */
#include "kvt_workers.h"

#include "kvt_error.h"
#include "kvt_log.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#define S_MAX_THREADS 16
#define S_IDLE_MS 200

typedef struct s_node {
    struct s_node *next;
    kvt_job_fn fn;
    void *job;
} s_node_t;

typedef struct {
    s_node_t *head, *tail;
    size_t len;
} s_fifo_t;

typedef struct {
    kvt_workers_t *pool;
    kvt_sup_thread_t *beat;
    pthread_t tid;
    bool started;
} s_thread_t;

struct kvt_workers {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    s_fifo_t todo, done;
    size_t max_queue;
    _Atomic size_t pending;
    bool stop;
    int efd;
    int nthreads;
    s_thread_t threads[S_MAX_THREADS];
};

static void s_push(s_fifo_t *q, s_node_t *n)
{
    n->next = NULL;
    if (q->tail)
        q->tail->next = n;
    else
        q->head = n;
    q->tail = n;
    q->len++;
}

static s_node_t *s_pop(s_fifo_t *q)
{
    s_node_t *n = q->head;
    if (n) {
        q->head = n->next;
        if (!q->head)
            q->tail = NULL;
        q->len--;
    }
    return n;
}

static void *s_run(void *arg)
{
    s_thread_t *me = arg;
    kvt_workers_t *self = me->pool;
    pthread_mutex_lock(&self->lock);
    for (;;) {
        s_node_t *n = s_pop(&self->todo);
        if (!n) {
            if (self->stop)
                break;
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += S_IDLE_MS * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&self->cond, &self->lock, &ts);
            pthread_mutex_unlock(&self->lock);
            bool go_on = kvt_sup_beat(me->beat);
            pthread_mutex_lock(&self->lock);
            if (!go_on) {
                pthread_mutex_unlock(&self->lock);
                kvt_sup_thread_exit(me->beat, false);
                return NULL;
            }
            continue;
        }
        pthread_mutex_unlock(&self->lock);
        kvt_sup_beat(me->beat);
        n->fn(n->job);
        kvt_sup_beat(me->beat);
        pthread_mutex_lock(&self->lock);
        bool was_empty = self->done.len == 0;
        s_push(&self->done, n);
        if (was_empty) {
            uint64_t one = 1;
            ssize_t w = write(self->efd, &one, sizeof one);
            (void)w;
        }
    }
    pthread_mutex_unlock(&self->lock);
    kvt_sup_thread_exit(me->beat, true);
    return NULL;
}

kvt_workers_t *kvt_workers_new(const char *name, int n, size_t max_queue, kvt_sup_t *sup,
                               char *err, size_t errlen)
{
    if (n < 1 || n > S_MAX_THREADS) {
        snprintf(err, errlen, "workers: %d threads, want 1 to %d", n, S_MAX_THREADS);
        return NULL;
    }
    kvt_workers_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->cond, NULL);
    self->max_queue = max_queue;
    self->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->efd < 0) {
        snprintf(err, errlen, "workers: eventfd: %s", strerror(errno));
        goto fail;
    }
    for (int i = 0; i < n; i++) {
        char tname[32];
        snprintf(tname, sizeof tname, "%s-%d", name, i);
        s_thread_t *t = &self->threads[i];
        t->pool = self;
        t->beat = kvt_sup_register(sup, tname, 10000);
        if (pthread_create(&t->tid, NULL, s_run, t) != 0) {
            snprintf(err, errlen, "workers: cannot start thread %d", i);
            goto fail;
        }
        t->started = true;
        self->nthreads = i + 1;
    }
    return self;
fail:
    kvt_workers_destroy(&self);
    return NULL;
}

void kvt_workers_destroy(kvt_workers_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_workers_t *self = *self_p;
    pthread_mutex_lock(&self->lock);
    self->stop = true;
    pthread_cond_broadcast(&self->cond);
    pthread_mutex_unlock(&self->lock);
    for (int i = 0; i < self->nthreads; i++)
        if (self->threads[i].started)
            pthread_join(self->threads[i].tid, NULL);
    s_node_t *n;
    while ((n = s_pop(&self->done)) != NULL) {
        kvt_log(KVT_LOG_WARN, "workers: a finished job was never collected");
        free(n);
    }
    if (self->efd >= 0)
        close(self->efd);
    pthread_cond_destroy(&self->cond);
    pthread_mutex_destroy(&self->lock);
    free(self);
    *self_p = NULL;
}

int kvt_workers_submit(kvt_workers_t *self, kvt_job_fn fn, void *job)
{
    s_node_t *n = malloc(sizeof *n);
    kvt_assert(n);
    n->fn = fn;
    n->job = job;
    pthread_mutex_lock(&self->lock);
    if (self->todo.len >= self->max_queue || self->stop) {
        pthread_mutex_unlock(&self->lock);
        free(n);
        return KVT_EBUSY;
    }
    s_push(&self->todo, n);
    atomic_fetch_add(&self->pending, 1);
    pthread_cond_signal(&self->cond);
    pthread_mutex_unlock(&self->lock);
    return 0;
}

void *kvt_workers_done(kvt_workers_t *self)
{
    pthread_mutex_lock(&self->lock);
    s_node_t *n = s_pop(&self->done);
    if (self->done.len == 0) {
        uint64_t v;
        ssize_t r = read(self->efd, &v, sizeof v);
        (void)r;
    }
    pthread_mutex_unlock(&self->lock);
    if (!n)
        return NULL;
    void *job = n->job;
    free(n);
    atomic_fetch_sub(&self->pending, 1);
    return job;
}

int kvt_workers_fd(const kvt_workers_t *self)
{
    return self->efd;
}

size_t kvt_workers_pending(const kvt_workers_t *self)
{
    return atomic_load(&((kvt_workers_t *)self)->pending);
}
