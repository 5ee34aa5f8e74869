/* kvt_l2mgr: the L2 tier manager — the configured adapters (l2/), the store controller
 * (write-behind of every committed L1 object), the lookup of keys past the L1 prefix, and the
 * prefetch controller (L2 -> L1 loads for LOOKUP with prefetch).
 *
 * Each adapter has its own threads and a bounded write-behind queue: a full queue drops its
 * oldest writes (counted; those objects become evictable without an L2 copy), so the request
 * path never waits on a backend. Failed writes are retried with backoff, then given up and
 * counted; the adapter's health (probed every second) feeds /readyz and /status. Lookups run on
 * the caller's thread (a lookup worker, never the server loop) and skip unhealthy adapters;
 * prefetch loads run on the manager's prefetch threads, each key under the daemon's write lease
 * on its L1 space, so nothing is freed under a running load and a stop abandons loads cleanly.
 * Every call is thread-safe. */
#ifndef KVT_L2MGR_H
#define KVT_L2MGR_H

#include "kvt_config.h"
#include "kvt_l1.h"
#include "kvt_metrics.h"
#include "kvt_prefetch.h"
#include "kvt_supervisor.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_l2mgr kvt_l2mgr_t;

/* Told about l2_stored / l2_removed: keys of one namespace, per batch, with the objects' sizes
 * (l2_stored; NULL for l2_removed, which does not know them). */
typedef void (*kvt_l2_event_fn)(void *ctx, const char *event, const kvt_ns_t *ns,
                                const kvt_key_t *keys, const uint64_t *sizes, uint32_t n,
                                const char *adapter);

/* Opens every adapter of cfg->l2 ("none" or an empty list: no L2) and starts their threads.
 * A backend that does not answer yet is not an error (it shows on /readyz); a bad spec is.
 * NULL with a sentence in err and the KVT_E* code in *code (KVT_EINVAL: a bad spec). */
kvt_l2mgr_t *kvt_l2mgr_new(const kvt_config_t *cfg, kvt_l1_t *l1, kvt_prefetch_t *prefetch,
                           kvt_sup_t *sup, int *code, char *err, size_t errlen);

/* --check-config: every adapter spec parses and opens (then is closed again; an fs directory
 * is created if missing). 0, or a KVT_E* code with one line in err. */
int kvt_l2mgr_check(const kvt_config_t *cfg, char *err, size_t errlen);

/* Writes what is queued (up to a few seconds), abandons running loads, stops the threads and
 * closes the adapters. Must run before the L1 tier is destroyed. */
void kvt_l2mgr_destroy(kvt_l2mgr_t **self_p);

/* Number of adapters (0: no L2). */
uint32_t kvt_l2mgr_count(const kvt_l2mgr_t *self);

void kvt_l2mgr_set_events(kvt_l2mgr_t *self, kvt_l2_event_fn fn, void *ctx);

/* The L1 listener's STORED events: queue the keys for write-behind to every adapter. */
void kvt_l2mgr_on_stored(kvt_l2mgr_t *self, const kvt_ns_t *ns, const kvt_key_t *keys,
                         uint32_t n);

/* How many leading keys are present in some healthy adapter, asking them in order until the
 * first key no adapter has or until `deadline_ms` (monotonic). sizes[i] gets each size. Blocks
 * on backend I/O: call from a worker thread. */
uint32_t kvt_l2mgr_lookup(kvt_l2mgr_t *self, const kvt_ns_t *ns, const kvt_key_t *keys,
                          uint32_t n, uint64_t deadline_ms,
                          uint64_t *sizes);

/* Queues loads of keys[0..n) (sizes from kvt_l2mgr_lookup) into L1 for prefetch job `job`. */
void kvt_l2mgr_prefetch(kvt_l2mgr_t *self, uint64_t job, const kvt_ns_t *ns,
                        const kvt_key_t *keys, const uint64_t *sizes, uint32_t n);

/* Queues removal of keys from every adapter (REMOVE). */
void kvt_l2mgr_remove(kvt_l2mgr_t *self, const kvt_ns_t *ns, const kvt_key_t *keys,
                      uint32_t n);

/* True when every adapter answers its health probe; otherwise why names the first that does
 * not ("l2 redis:127.0.0.1:6379: connection refused"). */
bool kvt_l2mgr_ready(kvt_l2mgr_t *self, char *why, size_t whylen);

/* An adapter spec as it may be shown (logs, metrics, /status): password=... masked. */
void kvt_l2mgr_redact(const char *spec, char *out, size_t outlen);

/* Metrics source: kvtier_l2_* by adapter. */
void kvt_l2mgr_metrics_source(void *self, kvt_sample_fn emit, void *emit_ctx);

/* [{adapter, kind, healthy, last_error, queue_depth, stored, loaded, errors, ...}]. */
json_t *kvt_l2mgr_status_json(kvt_l2mgr_t *self);

#endif
