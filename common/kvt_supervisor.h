/* kvt_supervisor: the registry of internal threads and the thread that watches them.
 *
 * Every long-lived thread registers at start-up (main thread) and calls kvt_sup_beat() at least
 * every `max_silence_ms`. A thread that stops beating is "stuck"; one that returns without
 * saying it was asked to is "dead". Either makes kvt_sup_ready() false with a reason (for
 * /readyz) and is logged once by the supervisor thread. Beats and readiness checks are lock-free
 * and callable from any thread. The hidden debug.fault_* knobs inject a stall or an exit into
 * one named thread, through kvt_sup_beat(), so tests can see the supervisor at work. */
#ifndef KVT_SUPERVISOR_H
#define KVT_SUPERVISOR_H

#include "kvt_metrics.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_sup kvt_sup_t;
typedef struct kvt_sup_thread kvt_sup_thread_t;

/* A fault to inject (debug.fault_* in the config): `thread` is the name of the thread that
 * stalls for `for_ms` ("stall") or exits ("exit") `after_ms` after kvt_sup_new. */
typedef struct {
    const char *thread; /* NULL or "" for none */
    const char *mode;   /* "stall" | "exit" */
    uint32_t after_ms;
    uint32_t for_ms;
} kvt_sup_fault_t;

/* `fault` may be NULL; it is copied. */
kvt_sup_t *kvt_sup_new(const kvt_sup_fault_t *fault);

/* Stops the supervisor thread (if started) and frees everything. */
void kvt_sup_destroy(kvt_sup_t **self_p);

/* Registers a thread by name; start-up only. The handle lives as long as the supervisor. */
kvt_sup_thread_t *kvt_sup_register(kvt_sup_t *self, const char *name, uint32_t max_silence_ms);

/* Called by the thread itself: records a heartbeat. Returns false when the thread must exit
 * (fault injection "exit"); may sleep (fault injection "stall"). */
bool kvt_sup_beat(kvt_sup_thread_t *t);

/* Called by the thread itself when it returns. `expected` is false when it ends on its own
 * (an error), which marks it dead. */
void kvt_sup_thread_exit(kvt_sup_thread_t *t, bool expected);

/* Starts the supervisor thread, which registers itself as "supervisor". 0 or KVT_EINTERNAL. */
int kvt_sup_start(kvt_sup_t *self);

/* Readiness beyond the threads: true, or false with a reason in why. Called from whichever
 * thread asks kvt_sup_ready (HTTP, the metrics' readers), never from the supervisor thread, so
 * it must be thread-safe. */
typedef bool (*kvt_sup_ready_fn)(void *ctx, char *why, size_t whylen);

/* Sets the extra readiness check (NULL: none); start-up only, before any thread that asks
 * kvt_sup_ready or renders the metrics runs. It must stay callable until those threads end. */
void kvt_sup_set_ready_check(kvt_sup_t *self, kvt_sup_ready_fn fn, void *ctx);

/* True when every registered thread is alive and beating (one that exited as asked counts as
 * healthy) and the extra check, if any, holds; otherwise false and `why` names the first fault
 * ("thread server stuck for 1520 ms", or the check's reason). Any thread. /readyz and
 * kvtier_ready both read it. The systemd keep-alives follow the threads only. */
bool kvt_sup_ready(kvt_sup_t *self, char *why, size_t whylen);

/* [{name, alive, stuck, last_beat_ms_ago, max_silence_ms}, ...]. Caller decrefs. */
json_t *kvt_sup_status_json(kvt_sup_t *self);

/* Metrics source: kvtier_thread_up{thread=...} (0: stuck or dead) and kvtier_ready
 * (kvt_sup_ready). */
void kvt_sup_metrics_source(void *self, kvt_sample_fn emit, void *emit_ctx);

#endif
