/* kvt_reload: SIGHUP re-reads the configuration and applies what can change while running.
 *
 * The configuration is loaded again exactly as at start-up (defaults, the --config /
 * KVTIER_CONFIG file, the same flags, the environment) and compared with the running one.
 * log_level takes effect at once; every other change is logged as needing a restart (the
 * running configuration is never touched: other threads hold it). CURVE client certificates need
 * no reload: czmq's zauth re-reads curve.clients as it changes. A file that does not load is
 * reported and changes nothing.
 *
 * The SIGHUP handler only sets a flag (kvt_reload_request); the server loop's
 * kvt_reload_run_pending starts the reload on a thread of its own (reading files must never
 * stall requests), one at a time. One reload context
 * per process (a signal is process-wide), created by main before the server loop runs. */
#ifndef KVT_RELOAD_H
#define KVT_RELOAD_H

#include "kvt_config.h"

typedef struct kvt_reload kvt_reload_t;

/* Remembers argv (which must outlive it) and the running configuration, and installs the
 * SIGHUP handler. Main thread, once. */
kvt_reload_t *kvt_reload_new(int argc, char *const argv[], const kvt_config_t *running);

/* SIGHUP is ignored from here on. Accepts NULL. */
void kvt_reload_destroy(kvt_reload_t **self_p);

/* Async-signal-safe: a reload is wanted (the SIGHUP handler). */
void kvt_reload_request(void);

/* Runs the reload asked for since the last call, if any; cheap when none was. Main thread. */
void kvt_reload_run_pending(void);

#endif
