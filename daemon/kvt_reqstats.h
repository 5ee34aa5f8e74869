/* kvt_reqstats: the request counters of protocol v1 — answered requests by type, errors by wire
 * code, request durations, dropped messages and failed replies — as one metrics source.
 *
 * Written by the threads that finish requests (relaxed atomics, no locks); read by whichever
 * thread renders the metrics (HTTP, STATS on the server thread). */
#ifndef KVT_REQSTATS_H
#define KVT_REQSTATS_H

#include "kvt_metrics.h"

#include <stdint.h>

typedef struct kvt_reqstats kvt_reqstats_t;

kvt_reqstats_t *kvt_reqstats_new(void);
void kvt_reqstats_destroy(kvt_reqstats_t **self_p);

/* Counts one finished request of wire type `type` (unknown ids count as "unknown") with
 * result `rc` (0 or a KVT_E* code) that took `ns` nanoseconds. Any thread. */
void kvt_reqstats_request(kvt_reqstats_t *self, uint64_t type, int rc, uint64_t ns);

/* One answered LOOKUP: `keys` asked, the leading `l1` found in L1 and the `l2` after them
 * found in L2 (the cache's hit rate: hit keys over keys asked). Any thread. */
void kvt_reqstats_lookup(kvt_reqstats_t *self, uint32_t keys, uint32_t l1, uint32_t l2);

/* Messages dropped without a reply (no uid frame) and replies that could not be sent. */
void kvt_reqstats_dropped(kvt_reqstats_t *self);
void kvt_reqstats_reply_failed(kvt_reqstats_t *self);

/* Metrics source (kvt_metrics_add_source): requests_total, request_errors_total,
 * request_duration_seconds, lookup_keys_total, lookup_hit_keys_total{tier}, messages_dropped_total,
 * replies_failed_total. */
void kvt_reqstats_source(void *self, kvt_sample_fn emit, void *emit_ctx);

#endif
