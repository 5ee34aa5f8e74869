/* kvt_workers: a pool of supervised threads running jobs off a caller's loop: the server's slow
 * requests (inline PUT copies, CLEAR, GPU copies), so that LOOKUPs never wait behind a large
 * transfer, and the cache service's L2 lookups.
 *
 * The owner submits jobs into a bounded FIFO (a full queue answers `busy` at once, it never
 * blocks); N supervised threads run them. In a pool made by kvt_workers_new finished jobs come
 * back through a done queue whose eventfd the owner polls (the server: only its thread sends
 * replies); in one made by kvt_workers_new_detached each job hands its result on itself.
 * submit/done/fd are for the owner's thread; the pool's threads run only the job functions. */
#ifndef KVT_WORKERS_H
#define KVT_WORKERS_H

#include "kvt_supervisor.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kvt_workers kvt_workers_t;

/* Runs on a worker thread; the job is handed back through kvt_workers_done afterwards. */
typedef void (*kvt_job_fn)(void *job);

/* Starts `n` threads (1 to 64, supervised as "<name>-0" ... with a 10 s silence limit) with
 * room for `max_queue` waiting jobs. */
kvt_workers_t *kvt_workers_new(const char *name, int n, size_t max_queue, kvt_sup_t *sup,
                               char *err, size_t errlen);

/* The same without a done queue (kvt_workers_done and _fd are not for it): a job hands its
 * result on itself. A job may block up to `silence_ms` before the supervisor calls its thread
 * stuck. */
kvt_workers_t *kvt_workers_new_detached(const char *name, int n, size_t max_queue,
                                        uint32_t silence_ms, kvt_sup_t *sup, char *err,
                                        size_t errlen);

/* Stops the threads after the jobs already queued have run (their results stay in the done
 * queue: the caller drains it first with kvt_workers_done). */
void kvt_workers_destroy(kvt_workers_t **self_p);

/* Queues a job. 0, or KVT_EBUSY when the queue is full. */
int kvt_workers_submit(kvt_workers_t *self, kvt_job_fn fn, void *job);

/* A finished job, or NULL. Reading also clears the eventfd when the done queue empties. */
void *kvt_workers_done(kvt_workers_t *self);

/* Readable when finished jobs wait in the done queue. */
int kvt_workers_fd(const kvt_workers_t *self);

/* Jobs submitted and not yet taken back with kvt_workers_done (detached: not yet run). */
size_t kvt_workers_pending(const kvt_workers_t *self);

#endif
