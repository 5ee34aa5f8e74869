/* DESIGN: jobs in a uint64 map keyed by id, each also on one of two FIFOs: `running`
 * (creation order) or `finished` (the order they finished). A sweep looks only at the head of
 * `finished`, so a job still running never holds back the sweep of those that finished after
 * it; the map's order matters nowhere. One mutex, a leaf.
 *
 * At most max_jobs are live. A new job past that takes the place of the oldest finished one,
 * or is refused (counted; the LOOKUP answers without a job) when every live job is still
 * running: a running job is an L2 load its client may be waiting for, never dropped. While more
 * than half the cap is live, finished jobs are kept only S_PRESSURE_KEEP_MS instead of keep_ms,
 * swept at each start as well as by the periodic sweep, so a flood of LOOKUPs that never poll
 * costs little for long. */
#include "kvt_prefetch.h"

#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_u64map.h"

#include <czmq.h>
#include <pthread.h>
#include <stdlib.h>

#define S_PRESSURE_KEEP_MS 1000

typedef struct {
    uint64_t id;
    uint64_t done_ms;
    uint32_t hits, loaded;
    bool done;
    void *handle; /* in `running` or `finished` */
    kvt_prefetch_done_fn on_done; /* kvt_prefetch_watch: called once, at done */
    void *on_done_ctx;
} s_job_t;

struct kvt_prefetch {
    pthread_mutex_t lock;
    kvt_u64map_t *jobs; /* id -> s_job_t (owned) */
    zlistx_t *running;  /* s_job_t, oldest first (borrowed) */
    zlistx_t *finished; /* s_job_t, first finished first (borrowed) */
    uint64_t next_id;
    uint64_t keep_ms;
    uint32_t max_jobs;
    uint64_t refused;
};

kvt_prefetch_t *kvt_prefetch_new(uint64_t keep_ms, uint32_t max_jobs)
{
    kvt_assert(max_jobs > 0);
    kvt_prefetch_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    pthread_mutex_init(&self->lock, NULL);
    self->jobs = kvt_u64map_new();
    self->running = zlistx_new();
    self->finished = zlistx_new();
    kvt_assert(self->jobs && self->running && self->finished);
    self->next_id = 1;
    self->keep_ms = keep_ms;
    self->max_jobs = max_jobs;
    return self;
}

void kvt_prefetch_destroy(kvt_prefetch_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_prefetch_t *self = *self_p;
    zlistx_destroy(&self->finished);
    zlistx_destroy(&self->running);
    for (s_job_t *j = kvt_u64map_first(self->jobs); j; j = kvt_u64map_next(self->jobs))
        free(j);
    kvt_u64map_destroy(&self->jobs);
    pthread_mutex_destroy(&self->lock);
    free(self);
    *self_p = NULL;
}

/* Drops the oldest finished job; lock held, `finished` not empty. */
static void s_drop_finished(kvt_prefetch_t *self)
{
    s_job_t *j = zlistx_detach(self->finished, NULL);
    kvt_u64map_remove(self->jobs, j->id);
    free(j);
}

/* Drops finished jobs kept long enough: keep_ms, or S_PRESSURE_KEEP_MS while more than half
 * the cap is live. Lock held. */
static size_t s_sweep(kvt_prefetch_t *self, uint64_t now_ms)
{
    size_t n = 0;
    for (s_job_t *j = zlistx_first(self->finished); j; j = zlistx_first(self->finished)) {
        bool pressure = kvt_u64map_size(self->jobs) > self->max_jobs / 2;
        uint64_t keep =
            pressure && S_PRESSURE_KEEP_MS < self->keep_ms ? S_PRESSURE_KEEP_MS : self->keep_ms;
        if (now_ms - j->done_ms <= keep)
            break;
        s_drop_finished(self);
        n++;
    }
    return n;
}

uint64_t kvt_prefetch_start(kvt_prefetch_t *self, uint32_t hits, bool done, uint64_t now_ms)
{
    pthread_mutex_lock(&self->lock);
    s_sweep(self, now_ms);
    if (kvt_u64map_size(self->jobs) >= self->max_jobs) {
        if (zlistx_size(self->finished) == 0) {
            self->refused++;
            pthread_mutex_unlock(&self->lock);
            return 0; /* every live job is a load in progress */
        }
        s_drop_finished(self);
    }
    s_job_t *j = calloc(1, sizeof *j);
    kvt_assert(j);
    j->hits = hits;
    j->done = done;
    j->done_ms = now_ms;
    j->id = self->next_id++;
    kvt_u64map_set(self->jobs, j->id, j);
    j->handle = zlistx_add_end(done ? self->finished : self->running, j);
    kvt_assert(j->handle);
    uint64_t id = j->id;
    pthread_mutex_unlock(&self->lock);
    return id;
}

void kvt_prefetch_update(kvt_prefetch_t *self, uint64_t job, uint32_t loaded, bool done,
                         uint64_t now_ms)
{
    pthread_mutex_lock(&self->lock);
    s_job_t *j = kvt_u64map_get(self->jobs, job);
    if (j) {
        j->loaded += loaded;
        if (done && !j->done) {
            j->done = true;
            j->done_ms = now_ms;
            zlistx_detach(self->running, j->handle);
            j->handle = zlistx_add_end(self->finished, j);
            kvt_assert(j->handle);
            if (j->on_done) /* under the lock: kvt_prefetch_unwatch then never races it */
                j->on_done(j->on_done_ctx, j->id, j->loaded);
            j->on_done = NULL;
        }
    }
    pthread_mutex_unlock(&self->lock);
}

int kvt_prefetch_watch(kvt_prefetch_t *self, uint64_t job, kvt_prefetch_done_fn fn, void *ctx)
{
    pthread_mutex_lock(&self->lock);
    s_job_t *j = kvt_u64map_get(self->jobs, job);
    int rc = !j ? KVT_ENOTFOUND : j->done ? 1 : 0;
    if (rc == 0) {
        kvt_assert(!j->on_done);
        j->on_done = fn;
        j->on_done_ctx = ctx;
    }
    pthread_mutex_unlock(&self->lock);
    return rc;
}

bool kvt_prefetch_unwatch(kvt_prefetch_t *self, uint64_t job)
{
    pthread_mutex_lock(&self->lock);
    s_job_t *j = kvt_u64map_get(self->jobs, job);
    bool was = j && j->on_done;
    if (was)
        j->on_done = NULL;
    pthread_mutex_unlock(&self->lock);
    return was;
}

int kvt_prefetch_status(kvt_prefetch_t *self, uint64_t job, bool *done, uint32_t *loaded,
                        uint32_t *hits)
{
    pthread_mutex_lock(&self->lock);
    s_job_t *j = kvt_u64map_get(self->jobs, job);
    if (j) {
        *done = j->done;
        *loaded = j->loaded;
        *hits = j->hits;
    }
    pthread_mutex_unlock(&self->lock);
    return j ? 0 : KVT_ENOTFOUND;
}

size_t kvt_prefetch_sweep(kvt_prefetch_t *self, uint64_t now_ms)
{
    pthread_mutex_lock(&self->lock);
    size_t n = s_sweep(self, now_ms);
    pthread_mutex_unlock(&self->lock);
    return n;
}

size_t kvt_prefetch_jobs(kvt_prefetch_t *self)
{
    pthread_mutex_lock(&self->lock);
    size_t n = kvt_u64map_size(self->jobs);
    pthread_mutex_unlock(&self->lock);
    return n;
}

void kvt_prefetch_metrics_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    kvt_prefetch_t *self = ctx;
    pthread_mutex_lock(&self->lock);
    double jobs = (double)kvt_u64map_size(self->jobs), refused = (double)self->refused;
    pthread_mutex_unlock(&self->lock);
    kvt_sample_t j = {.name = "prefetch_jobs",
                      .help = "Prefetch jobs kept (running, or finished and not yet swept).",
                      .kind = KVT_METRIC_GAUGE,
                      .value = jobs};
    emit(emit_ctx, &j);
    kvt_sample_t r = {.name = "prefetch_refused_total",
                      .help = "LOOKUPs with prefetch answered without a job: max_prefetch_jobs "
                              "loads were running.",
                      .kind = KVT_METRIC_COUNTER,
                      .value = refused};
    emit(emit_ctx, &r);
}
