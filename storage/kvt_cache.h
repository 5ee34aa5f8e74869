/* kvt_cache: the cache service under the front doors. It builds, owns and tears down together
 * the L1 tier, the prefetch job table and the L2 manager (with L1 -> L2 write-behind wired in),
 * and offers the doors (protocol v1: daemon/kvt_server, LMCache: daemon/kvt_lmcache_door) what they
 * used to each do their own way:
 *
 *   - one registry of lease owners: every client owner (a v1 instance, an LMCache worker) gets
 *     its id here, at most max_instances of them across both doors; closing one releases its
 *     leases and tells the listeners (GPU registrations, fast-path slots);
 *   - the tiered lookup: the L1 prefix inline on the caller's thread, then the L2 probe (one
 *     deadline, l2_lookup_timeout_ms) and the prefetch loads on the service's own threads, the
 *     finished lookup pushed to the caller's queue (its eventfd wakes the caller's poll), never
 *     polled for;
 *   - the event log (kvt_evlog) of every L1 and L2 change, which the events socket and the
 *     LMCache door's poll_kv_events read, each with its own cursor.
 *
 * Every call is thread-safe. The lookup threads ("lookup-i") are the service's; watchers of
 * prefetch jobs run on the L2 manager's prefetch threads. */
#ifndef KVT_CACHE_H
#define KVT_CACHE_H

#include "kvt_config.h"
#include "kvt_evlog.h"
#include "kvt_l1.h"
#include "kvt_l2mgr.h"
#include "kvt_prefetch.h"
#include "kvt_queue.h"
#include "kvt_supervisor.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_cache kvt_cache_t;

/* Who holds leases: a protocol v1 client instance, an LMCache worker, an LMCache client
 * connection (the scheduler's lookups lock chunks for it). The daemon itself is
 * KVT_OWNER_DAEMON and never registered. */
typedef enum {
    KVT_OWNER_V1 = 1,
    KVT_OWNER_LMCACHE = 2,        /* a registered LMCache worker */
    KVT_OWNER_LMCACHE_CLIENT = 3, /* an LMCache door connection holding lookup locks */
} kvt_owner_kind_t;

/* Told when an owner closes, after its leases went: drop what else it held. Called on the
 * thread that closed it (the door of its kind). */
typedef void (*kvt_owner_gone_fn)(void *ctx, kvt_owner_kind_t kind, uint64_t owner, bool expired);

/* One tiered lookup. The caller fills the first part and keeps the struct, its namespace and
 * its keys alive until kvt_cache_lookup answers it at once or it comes back through `done`. */
typedef struct kvt_lookup {
    uint64_t owner; /* whose read lease `lock` takes (KVT_OWNER_DAEMON allowed) */
    kvt_ns_t ns;
    const kvt_key_t *keys;
    uint32_t n;
    bool lock;         /* pin the L1 prefix under a read lease of owner */
    bool prefetch;     /* load the L2 part of the prefix into L1 (a prefetch job) */
    bool until_loaded; /* come back once those loads finished, not when they start */
    kvt_queue_t *done; /* where a lookup with an L2 part comes back */
    void *ctx;         /* the caller's */
    /* the answer */
    int rc;            /* 0, or KVT_EBUSY (the lookup threads' queue is full) ... */
    uint32_t l1_hits;  /* the prefix in L1 when it was asked */
    uint32_t hits;     /* l1_hits + the prefix found in L2 after it */
    uint32_t loaded;   /* until_loaded: how many of those are in L1 now */
    uint64_t lease;    /* lock: the read lease on the L1 prefix, 0 when none */
    uint64_t job;      /* prefetch: the job (0: none, max_prefetch_jobs were running) */
    char err[160];     /* with rc */
    _Atomic int stage; /* the service's: where the lookup is (kvt_cache_lookup_cancel) */
} kvt_lookup_t;

/* The arena, the L2 adapters and their threads, the lookup threads. NULL with a sentence in
 * err and the KVT_E* code in *code (KVT_EINVAL: a bad L2 spec, a configuration error). */
kvt_cache_t *kvt_cache_new(const kvt_config_t *cfg, kvt_sup_t *sup, int *code, char *err,
                           size_t errlen);

/* Starts the eviction controller (after the doors are built). 0 or KVT_EINTERNAL. */
int kvt_cache_start(kvt_cache_t *self);

/* Shutdown begins: lookups still queued come back at once with their L1 part only, running
 * ones after their probe. The doors can then drain what they have out. */
void kvt_cache_quiesce(kvt_cache_t *self);

/* The first half of shutdown, once no door asks anything new: lookups queued or running come
 * back to their queues, no more evictions, queued write-behind reaches L2, running loads are
 * abandoned (their watchers told). The doors then drain their queues and release what they
 * hold; kvt_cache_destroy frees the rest. */
void kvt_cache_stop(kvt_cache_t *self);
void kvt_cache_destroy(kvt_cache_t **self_p);

kvt_l1_t *kvt_cache_l1(kvt_cache_t *self);
kvt_l2mgr_t *kvt_cache_l2(kvt_cache_t *self);
kvt_prefetch_t *kvt_cache_prefetch(kvt_cache_t *self);

/* The log of L1 and L2 changes (kvt_evlog), for the events socket and LMCache's
 * poll_kv_events; NULL when event_log_size is 0. */
kvt_evlog_t *kvt_cache_evlog(kvt_cache_t *self);

/* ---- owners ---- */

/* A new owner id. KVT_EBUSY with a sentence when max_instances owners are open. */
int kvt_cache_owner_open(kvt_cache_t *self, kvt_owner_kind_t kind, uint64_t *owner, char *err,
                         size_t errlen);

/* Closes an owner: its leases are released (expired: counted as expired), then every listener
 * is told. Returns how many leases went. An owner already closed is left alone (0). */
uint64_t kvt_cache_owner_close(kvt_cache_t *self, uint64_t owner, bool expired);

/* Adds a listener for closed owners (start-up only, at most 4). */
void kvt_cache_on_owner_gone(kvt_cache_t *self, kvt_owner_gone_fn fn, void *ctx);

/* Open owners of `kind` (0: all kinds). */
uint32_t kvt_cache_owners(kvt_cache_t *self, int kind);

/* The one liveness rule, for every owner whichever door serves it. An owner is alive while it
 * is heard from (any request; a v1 heartbeat, an LMCache ping). Silent past lease_ms, the leases
 * it holds are void; silent past its kind's keep-alive it is closed (kvt_cache_owner_close,
 * expired), registration and all. The keep-alive is lease_ms for a v1 instance (libkvtier beats
 * every lease_ms / 3) and lmcache.reap_timeout_s for an LMCache worker (LMCache pings every
 * 10 s and cannot tell it was dropped; 0: never closed), never below lease_ms. Each door
 * keeps its owners' last-heard times and asks here on its sweep, so closing runs on its thread. */
typedef enum {
    KVT_OWNER_ALIVE = 0,
    KVT_OWNER_LEASES_VOID, /* release its leases (counted as expired), keep it */
    KVT_OWNER_EXPIRED,     /* close it */
} kvt_liveness_t;

kvt_liveness_t kvt_cache_owner_liveness(const kvt_cache_t *self, kvt_owner_kind_t kind,
                                        uint64_t silent_ms);

/* Its kind's keep-alive in ms (UINT64_MAX: never closed for silence). */
uint64_t kvt_cache_owner_keepalive_ms(const kvt_cache_t *self, kvt_owner_kind_t kind);

/* ---- lookups ---- */

/* Runs the L1 part of lk now. Returns false when lk is answered (lk->rc and the counts set):
 * no L2 part, or an error. Returns true when the L2 part runs on the lookup threads: lk comes
 * back through lk->done (rc set there: KVT_EBUSY when the queue was full is answered at once,
 * false, with the L1 lease given back). */
bool kvt_cache_lookup(kvt_cache_t *self, kvt_lookup_t *lk);

/* For a caller going away with lookups out: lk's wait for its loads is called off when it is
 * in that stage (true: it will not come back, the caller may free it); false when it is still
 * on a lookup thread (it comes back within l2_lookup_timeout_ms) or came back already. */
bool kvt_cache_lookup_cancel(kvt_cache_t *self, kvt_lookup_t *lk);

/* Metrics source: kvtier_lookup_l2_* and kvtier_owners{kind}. */
void kvt_cache_metrics_source(void *self, kvt_sample_fn emit, void *emit_ctx);

#endif
