/* kvt_lmc_events: LMCache's poll_kv_events over the cache service's event log (storage/kvt_evlog).
 *
 * LMCache's worker republishes what this returns as vLLM KV events (BlockStored, BlockRemoved),
 * so a KV-aware router sees which prefixes kvtier holds on the node. A BlockStored needs the
 * token ids of its blocks and the hash of the block before them, which the log (keys only) does
 * not have: the door binds each chunk key it is asked to store to its tokens and its parent key
 * (kvt_lmc_events_bind, at prepare_store), in a bounded table that forgets the oldest first; a
 * stored change of a chunk no longer bound is left out and counted (the worker would drop a
 * BlockStored without token ids anyway).
 *
 * A poll reads the log after the caller's cursor and answers the records of the door's
 * namespaces of that model ("lmcache/<model>/<world>/<worker>"): L1 stored -> stored "CPU", L1
 * evicted or removed -> removed "CPU", L2 stored / removed -> "STORAGE". The copies each TP
 * worker keeps of one chunk come to one block: within one reply a block is reported again only
 * when its state changed. Every record read, of any model or namespace, moves the cursor on.
 *
 * Called on the LMCache door's thread only. */
#ifndef KVT_LMC_EVENTS_H
#define KVT_LMC_EVENTS_H

#include "kvt_evlog.h"
#include "kvt_metrics.h"

#include <msgpack.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct kvt_lmc_events kvt_lmc_events_t;

#define KVT_LMC_EVENTS_MAX 1024 /* events in one reply (LMCache's worker asks for 1024) */

/* log NULL (event_log_size 0): polls answer enabled false and nothing is bound. chunk: tokens
 * per chunk (the LMCache block). */
kvt_lmc_events_t *kvt_lmc_events_new(kvt_evlog_t *log, uint32_t chunk);
void kvt_lmc_events_destroy(kvt_lmc_events_t **self_p);

bool kvt_lmc_events_enabled(const kvt_lmc_events_t *self);

/* Binds chunk c = base + idx[j] (j < m), keys[c], to tokens[c * chunk ...] and its parent
 * keys[c - 1] (none for chunk 0): keys are a prompt's chained chunk keys from chunk 0, tokens
 * its ids. */
void kvt_lmc_events_bind(kvt_lmc_events_t *self, const kvt_key_t *keys, const uint32_t *tokens,
                         uint32_t base, const uint32_t *idx, uint32_t m);

/* Packs the KVEventPollResult for (model, cursor, max_events) into pk; max_events 1..
 * KVT_LMC_EVENTS_MAX (more is taken as that). A cursor past the log's newest record is lost
 * (the log is another daemon's): answered with no events and next_cursor at the newest. */
void kvt_lmc_events_poll(kvt_lmc_events_t *self, const char *model, uint64_t cursor,
                         uint32_t max_events, msgpack_packer *pk);

/* Metrics source: kvtier_lmcache_kv_events_total, kvtier_lmcache_kv_events_unbound_total. */
void kvt_lmc_events_metrics_source(void *self, kvt_sample_fn emit, void *emit_ctx);

#endif
