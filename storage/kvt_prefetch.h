/* kvt_prefetch: the prefetch controller's job table (LOOKUP with `prefetch`, PREFETCH_STATUS).
 *
 * A job records what a LOOKUP found and how much of the L2 part of the prefix has been loaded
 * into L1 so far. When the whole prefix is in L1 already (or there is no L2) a job is done when
 * it is created (loaded 0); otherwise the L2 manager reports progress as loads finish. Jobs are
 * kept for `keep_ms` after they finish, then swept, so a client that never polls costs nothing
 * for long. Thread-safe (one mutex). */
#ifndef KVT_PREFETCH_H
#define KVT_PREFETCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_prefetch kvt_prefetch_t;

kvt_prefetch_t *kvt_prefetch_new(uint64_t keep_ms);
void kvt_prefetch_destroy(kvt_prefetch_t **self_p);

/* A new job for a LOOKUP that found `hits` leading keys; it is finished at once when `done`.
 * Returns its id (never 0). */
uint64_t kvt_prefetch_start(kvt_prefetch_t *self, uint32_t hits, bool done, uint64_t now_ms);

/* Progress of a running job: `loaded` more keys are in L1; `done` when the job ends. */
void kvt_prefetch_update(kvt_prefetch_t *self, uint64_t job, uint32_t loaded, bool done,
                         uint64_t now_ms);

/* 0 with the job's state, or KVT_ENOTFOUND (never existed, or swept). */
int kvt_prefetch_status(kvt_prefetch_t *self, uint64_t job, bool *done, uint32_t *loaded,
                        uint32_t *hits);

/* Drops finished jobs older than keep_ms; returns how many. */
size_t kvt_prefetch_sweep(kvt_prefetch_t *self, uint64_t now_ms);

size_t kvt_prefetch_jobs(kvt_prefetch_t *self);

#endif
