/* kvt_events: the cache-event publisher (--events ENDPOINT), for cache-aware routers.
 *
 * Each event is one ZMQ message, a msgpack map {event, ns, salt, keys: [bin16], tier}, one per
 * request (or eviction round) and namespace. Any thread calls kvt_events_publish: it encodes
 * and appends to a bounded queue (full: dropped and counted) and returns; the publisher's own
 * supervised thread owns the socket. The socket is an XPUB with XPUB_NODROP and a send
 * high-water mark, sending with DONTWAIT: a subscriber that stops reading makes events drop
 * (counted) instead of queueing without bound or blocking anything. */
#ifndef KVT_EVENTS_H
#define KVT_EVENTS_H

#include "kvt_key.h"
#include "kvt_metrics.h"
#include "kvt_supervisor.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kvt_events kvt_events_t;

/* Binds `endpoint` and starts the thread. NULL with a sentence in err. */
kvt_events_t *kvt_events_new(const char *endpoint, kvt_sup_t *sup, char *err, size_t errlen);

/* Publishes what is queued (bounded wait), then stops. */
void kvt_events_destroy(kvt_events_t **self_p);

/* Queues one event; any thread, never blocks on subscribers. */
void kvt_events_publish(kvt_events_t *self, const char *event, const kvt_ns_t *ns,
                        const kvt_key_t *keys, uint32_t n, const char *tier);

/* Metrics source: kvtier_events_published_total, kvtier_events_dropped_total. */
void kvt_events_metrics_source(void *self, kvt_sample_fn emit, void *emit_ctx);

#endif
