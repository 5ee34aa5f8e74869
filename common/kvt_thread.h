/* kvt_thread: one long-lived internal thread, started, supervised and joined the same way
 * everywhere.
 *
 * Owns the pthread and its supervisor slot. The main thread (or whoever owns the module that
 * runs the thread) calls start and join; the body runs on the new thread and may call beat and
 * idle_ms. A body returns true when it stops because it was asked to (its queue closed) and
 * false when it gives up on its own, which the supervisor then reports as a dead thread. A
 * thread started without a supervisor (sup NULL) beats into nothing. */
#ifndef KVT_THREAD_H
#define KVT_THREAD_H

#include "kvt_supervisor.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct kvt_thread kvt_thread_t;

typedef bool (*kvt_thread_fn)(kvt_thread_t *t, void *arg);

/* Registers `name` with `sup` (start-up only, when sup is not NULL: kvt_sup_register's rule)
 * and starts fn(t, arg) on a new thread. NULL when the thread cannot be started. */
kvt_thread_t *kvt_thread_start(kvt_sup_t *sup, const char *name, uint32_t max_silence_ms,
                               kvt_thread_fn fn, void *arg);

/* Waits for the thread to return and frees it; the body must have been told to stop (its queue
 * closed). Accepts NULL. */
void kvt_thread_join(kvt_thread_t **self_p);

/* The thread itself: records a heartbeat. False when it must exit now (debug fault "exit"). */
bool kvt_thread_beat(kvt_thread_t *t);

/* How long the thread may wait idle between beats: a tenth of its silence limit, at most 200 ms
 * (so a stuck thread is told from an idle one long before the limit); 200 ms without a
 * supervisor too, since bodies also do periodic work when they wake. A body that has nothing
 * periodic to do (gpu-closer) pops without a timeout instead. */
int64_t kvt_thread_idle_ms(const kvt_thread_t *t);

#endif
