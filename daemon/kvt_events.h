/* kvt_events: the cache-event publisher (--events ENDPOINT), for cache-aware routers.
 *
 * Each event is one ZMQ message, a msgpack map {event, ns, salt, keys: [bin16], tier}, one per
 * record of the cache service's event log (storage/kvt_evlog: one per request or eviction round
 * and namespace). The publisher's own supervised thread follows the log with its cursor and owns
 * the socket; nothing else touches either, so publishing costs the rest of the daemon nothing.
 * Records the log dropped before the thread read them are counted as dropped. The socket is an
 * XPUB with XPUB_NODROP and a send high-water mark, sending with DONTWAIT: a subscriber that
 * stops reading makes events drop (counted) instead of queueing without bound or blocking. */
#ifndef KVT_EVENTS_H
#define KVT_EVENTS_H

#include "kvt_evlog.h"
#include "kvt_metrics.h"
#include "kvt_supervisor.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kvt_events kvt_events_t;

/* Binds `endpoint` and starts the thread, which publishes the records `log` gets from now on
 * (the log outlives the publisher). NULL with a sentence in err. */
kvt_events_t *kvt_events_new(const char *endpoint, kvt_evlog_t *log, kvt_sup_t *sup, char *err,
                             size_t errlen);

/* Publishes what the log holds past its cursor, then stops. */
void kvt_events_destroy(kvt_events_t **self_p);

/* Metrics source: kvtier_events_published_total, kvtier_events_dropped_total. */
void kvt_events_metrics_source(void *self, kvt_sample_fn emit, void *emit_ctx);

#endif
