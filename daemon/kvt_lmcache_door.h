/* kvt_lmcache_door: the LMCache-compatible front door — a second ROUTER endpoint (lmcache.listen)
 * that answers LMCache's multiprocess client (vLLM's LMCacheMPConnector, engine-driven
 * shared-memory mode) on the same L1 arena, leases, L2 tiers, events and metrics as
 * protocol v1. docs/integrations.md says what it serves and how its objects map to v1's.
 *
 * Owns the socket, its thread ("lmcache", supervised), the registered worker contexts (by
 * LMCache instance_id, each with its own lease owner), their prepared transfers, and the
 * per-request lookup state (by request_id, bounded, with a deadline). Its lookups are the
 * cache service's tiered lookups (the L2 part on the service's threads, the result pushed to
 * the door's queue), and its workers are owners in the service's registry (max_instances
 * counts them with v1's instances). Every lock it takes in
 * L1 is a lease: a worker's reservations and pins are its owner's (released when it
 * unregisters, stays silent past lease_ms, or after lease_ms unfinished), and a lookup's read
 * locks are daemon leases released when the workers have read them, the scheduler frees them,
 * the session ends, or lease_ms after the lookup.
 *
 * Threads: new/destroy on the main thread; the door's own thread serves the socket; the
 * status and metrics calls are safe from the HTTP thread (one mutex guards the tables). */
#ifndef KVT_LMCACHE_DOOR_H
#define KVT_LMCACHE_DOOR_H

#include "kvt_cache.h"
#include "kvt_config.h"
#include "kvt_metrics.h"
#include "kvt_supervisor.h"

#include <jansson.h>
#include <stddef.h>

typedef struct kvt_lmcache_door kvt_lmcache_door_t;

/* The namespace prefix of every object the door stores: "lmcache/<model>/<world>/<worker>". */
#define KVT_LMCACHE_NS_PREFIX "lmcache/"

/* Binds cfg->lmcache_listen and starts the door's thread (start-up, before kvt_sup_start).
 * NULL with a sentence in err (endpoint in use or malformed, an arena the client cannot open
 * by name). */
kvt_lmcache_door_t *kvt_lmcache_door_new(const kvt_config_t *cfg, kvt_sup_t *sup, kvt_cache_t *cache,
                               char *err, size_t errlen);

/* Stops the thread, waits for (or calls off) its lookups in the cache service, closes its
 * workers' owners (their leases go) and the socket. Before kvt_cache_stop. Accepts NULL. */
void kvt_lmcache_door_destroy(kvt_lmcache_door_t **self_p);

/* {endpoint, shm_name, pool_size, chunk_tokens, contexts: [...at most 100], contexts_total,
 * requests_tracked, lookup_locks} for /status. */
json_t *kvt_lmcache_door_status_json(kvt_lmcache_door_t *self);

/* Metrics source: kvtier_lmcache_requests_total{op}, kvtier_lmcache_errors_total{type},
 * kvtier_lmcache_contexts, kvtier_lmcache_requests_tracked, kvtier_lmcache_lookup_chunks_total,
 * kvtier_lmcache_lookup_hit_chunks_total, kvtier_lmcache_replies_dropped_total. */
void kvt_lmcache_door_metrics_source(void *self, kvt_sample_fn emit, void *emit_ctx);

#endif
