/* DESIGN: jobs in a czmq hash keyed by id (hex) plus a FIFO of ids in creation order, so the
 * sweep looks only at the oldest jobs. One mutex, a leaf. At most S_MAX_JOBS are kept: past
 * that the oldest finished job is dropped early. */
#include "kvt_prefetch.h"

#include "kvt_error.h"
#include "kvt_log.h"

#include <czmq.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>

#define S_MAX_JOBS 65536

typedef struct {
    uint64_t id;
    uint64_t done_ms;
    uint32_t hits, loaded;
    bool done;
} s_job_t;

struct kvt_prefetch {
    pthread_mutex_t lock;
    zhashx_t *jobs;  /* hex id -> s_job_t (owned) */
    zlistx_t *order; /* s_job_t, oldest first (borrowed) */
    uint64_t next_id;
    uint64_t keep_ms;
};

static void s_job_free(void **item)
{
    free(*item);
    *item = NULL;
}

static void s_hex(uint64_t v, char out[17])
{
    snprintf(out, 17, "%016" PRIx64, v);
}

kvt_prefetch_t *kvt_prefetch_new(uint64_t keep_ms)
{
    kvt_prefetch_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    pthread_mutex_init(&self->lock, NULL);
    self->jobs = zhashx_new();
    self->order = zlistx_new();
    kvt_assert(self->jobs && self->order);
    zhashx_set_destructor(self->jobs, s_job_free);
    self->next_id = 1;
    self->keep_ms = keep_ms;
    return self;
}

void kvt_prefetch_destroy(kvt_prefetch_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_prefetch_t *self = *self_p;
    zlistx_destroy(&self->order);
    zhashx_destroy(&self->jobs);
    pthread_mutex_destroy(&self->lock);
    free(self);
    *self_p = NULL;
}

/* Drops the oldest job; lock held. */
static void s_drop_oldest(kvt_prefetch_t *self)
{
    s_job_t *j = zlistx_detach(self->order, NULL);
    char key[17];
    s_hex(j->id, key);
    zhashx_delete(self->jobs, key);
}

uint64_t kvt_prefetch_start(kvt_prefetch_t *self, uint32_t hits, bool done, uint64_t now_ms)
{
    s_job_t *j = calloc(1, sizeof *j);
    kvt_assert(j);
    j->hits = hits;
    j->done = done;
    j->done_ms = now_ms;
    char key[17];
    pthread_mutex_lock(&self->lock);
    if (zlistx_size(self->order) >= S_MAX_JOBS)
        s_drop_oldest(self);
    j->id = self->next_id++;
    s_hex(j->id, key);
    zhashx_insert(self->jobs, key, j);
    zlistx_add_end(self->order, j);
    uint64_t id = j->id;
    pthread_mutex_unlock(&self->lock);
    return id;
}

void kvt_prefetch_update(kvt_prefetch_t *self, uint64_t job, uint32_t loaded, bool done,
                         uint64_t now_ms)
{
    char key[17];
    s_hex(job, key);
    pthread_mutex_lock(&self->lock);
    s_job_t *j = zhashx_lookup(self->jobs, key);
    if (j) {
        j->loaded += loaded;
        if (done && !j->done) {
            j->done = true;
            j->done_ms = now_ms;
        }
    }
    pthread_mutex_unlock(&self->lock);
}

int kvt_prefetch_status(kvt_prefetch_t *self, uint64_t job, bool *done, uint32_t *loaded,
                        uint32_t *hits)
{
    char key[17];
    s_hex(job, key);
    pthread_mutex_lock(&self->lock);
    s_job_t *j = zhashx_lookup(self->jobs, key);
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
    size_t n = 0;
    pthread_mutex_lock(&self->lock);
    for (s_job_t *j = zlistx_first(self->order);
         j && j->done && now_ms - j->done_ms > self->keep_ms; j = zlistx_first(self->order)) {
        s_drop_oldest(self);
        n++;
    }
    pthread_mutex_unlock(&self->lock);
    return n;
}

size_t kvt_prefetch_jobs(kvt_prefetch_t *self)
{
    pthread_mutex_lock(&self->lock);
    size_t n = zhashx_size(self->jobs);
    pthread_mutex_unlock(&self->lock);
    return n;
}
