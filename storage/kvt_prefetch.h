/* kvt_prefetch: the prefetch controller's job table (LOOKUP with `prefetch`, PREFETCH_STATUS).
 *
 * A job records what a LOOKUP found and how much of the L2 part of the prefix has been loaded
 * into L1 so far. When the whole prefix is in L1 already (or there is no L2) a job is done when
 * it is created (loaded 0); otherwise the L2 manager reports progress as loads finish. Jobs are
 * kept for `keep_ms` after they finish, then swept, so a client that never polls costs nothing
 * for long. At most `max_jobs` live at once (max_prefetch_jobs): past that a new job replaces
 * the oldest finished one, or is refused when all are still running; while more than half the
 * cap is live, finished jobs are kept only a second. Thread-safe (one mutex). */
#ifndef KVT_PREFETCH_H
#define KVT_PREFETCH_H

#include "kvt_metrics.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_prefetch kvt_prefetch_t;

kvt_prefetch_t *kvt_prefetch_new(uint64_t keep_ms, uint32_t max_jobs);
void kvt_prefetch_destroy(kvt_prefetch_t **self_p);

/* A new job for a LOOKUP that found `hits` leading keys; it is finished at once when `done`.
 * Returns its id, or 0 when max_jobs jobs are live and all still running (counted as refused):
 * the caller then starts no load and answers without a job. */
uint64_t kvt_prefetch_start(kvt_prefetch_t *self, uint32_t hits, bool done, uint64_t now_ms);

/* Progress of a running job: `loaded` more keys are in L1; `done` when the job ends. */
void kvt_prefetch_update(kvt_prefetch_t *self, uint64_t job, uint32_t loaded, bool done,
                         uint64_t now_ms);

/* Told once, from the thread that finishes the job, with the job table's lock held (so it
 * must only hand the news on: push to a queue, never call back into the table). */
typedef void (*kvt_prefetch_done_fn)(void *ctx, uint64_t job, uint32_t loaded);

/* Has fn(ctx, ...) called when the running job finishes (one watcher per job): 0, 1 when the
 * job is done already (fn is not called), or KVT_ENOTFOUND. */
int kvt_prefetch_watch(kvt_prefetch_t *self, uint64_t job, kvt_prefetch_done_fn fn, void *ctx);

/* Takes the watcher off: true when it was still there (it will never be called), false when
 * it ran already or there was none. */
bool kvt_prefetch_unwatch(kvt_prefetch_t *self, uint64_t job);

/* 0 with the job's state, or KVT_ENOTFOUND (never existed, or swept). */
int kvt_prefetch_status(kvt_prefetch_t *self, uint64_t job, bool *done, uint32_t *loaded,
                        uint32_t *hits);

/* Drops finished jobs older than keep_ms (a second while over half the cap); returns how many. */
size_t kvt_prefetch_sweep(kvt_prefetch_t *self, uint64_t now_ms);

size_t kvt_prefetch_jobs(kvt_prefetch_t *self);

/* Metrics source: kvtier_prefetch_jobs, kvtier_prefetch_refused_total. */
void kvt_prefetch_metrics_source(void *self, kvt_sample_fn emit, void *emit_ctx);

#endif
