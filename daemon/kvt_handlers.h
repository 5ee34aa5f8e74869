/* kvt_handlers: the request handlers — what each request type does once its envelope and body
 * have been decoded — and kvt_rq_t, the per-request context they work on.
 *
 * The server loop (kvt_server.c) owns the socket: it builds a kvt_rq_t from a message, runs it
 * by the run class of its type in KVT_REQ_MAP (INLINE: kvt_handle() on the server thread;
 * WORKER: kvt_handle() on a worker; INLINE_THEN_LOOKUP: kvt_handle() on the server thread,
 * and when the cache service took the rest, kvt_handle_resume() once it handed it back) and
 * sends the reply the handler packed. Handlers that run on workers touch only thread-safe
 * modules (the cache service, L1, metrics). */
#ifndef KVT_HANDLERS_H
#define KVT_HANDLERS_H

#include "kvt_cache.h"
#include "kvt_config.h"
#include "kvt_fastpath.h"
#include "kvt_gpu.h"
#include "kvt_l1.h"
#include "kvt_metrics.h"
#include "kvt_msg.h"
#include "kvt_reqstats.h"
#include "kvt_session.h"

#include <czmq.h>
#include <stdbool.h>
#include <stdint.h>

/* The modules handlers reach; owned by the server. */
typedef struct {
    const kvt_config_t *cfg;
    kvt_metrics_t *metrics;
    kvt_reqstats_t *reqstats; /* LOOKUP hit counters */
    kvt_sessions_t *sessions;
    kvt_cache_t *cache;          /* the tiers, owners and tiered lookups */
    kvt_l1_t *l1;                /* kvt_cache_l1(cache) */
    kvt_queue_t *lookups_done;   /* LOOKUPs the cache service hands back (the server polls it) */
    kvt_gpu_t *gpu; /* the GPU path (CUDA loaded on first use) */
    kvt_fastpath_t *fastpath; /* NULL: fastpath.enabled is false */
} kvt_services_t;

/* One request from receipt to reply. Owns its frames, its decoded body (whose strings point
 * into `body`) and its reply. The frames are libzmq messages as received (no copies). */
typedef struct kvt_rq {
    kvt_services_t *svc;
    zmq_msg_t rid, uid, body;
    zmq_msg_t *data; /* the request's data frames, data[0..ndata) */
    uint32_t ndata, data_cap;
    uint64_t type;
    kvt_conn_t *conn; /* the connection it came on (a reference) */
    kvt_fastpath_ref_t ring; /* the fast-path ring pair it came through; .slot 0: the socket */
    uint64_t owner;   /* the instance the connection acts for, 0 when none */
    uint64_t t0_ns;
    kvt_req_t req;
    msgpack_sbuffer sbuf; /* the reply body */
    msgpack_packer pk;
    /* GET: the reply's data frames are these arena ranges, pinned under out_lease (a daemon
     * read lease) until libzmq has sent them */
    kvt_slot_t *out;
    uint32_t nout;
    uint64_t out_lease;
    kvt_lookup_t lookup; /* LOOKUP (run class INLINE_THEN_LOOKUP): the cache service's */
    bool lookup_pending; /* the service has it: it comes back through svc->lookups_done */
    int rc;
    char err[200];
} kvt_rq_t;

/* Runs the handler of rq->type on a decoded request: packs the ok body into rq->pk and returns
 * 0, or returns a KVT_E* code with rq->err set (the caller packs the error body). For a type of
 * run class INLINE_THEN_LOOKUP this is the inline part; see kvt_handle_pending. */
int kvt_handle(kvt_rq_t *rq);

/* After kvt_handle returned 0 for an INLINE_THEN_LOOKUP type: true when the cache service has
 * the request's L2 part (nothing is packed yet); it comes back through svc->lookups_done. */
bool kvt_handle_pending(const kvt_rq_t *rq);

/* A request the cache service handed back: packs its answer; returns like kvt_handle. Server
 * thread. */
int kvt_handle_resume(kvt_rq_t *rq);

/* Checks that need the data frames (PUT: one non-empty frame per key; others: none).
 * 0 or KVT_EBADREQ with rq->err set. Server thread, before kvt_handle. */
int kvt_handle_check_frames(kvt_rq_t *rq);

#endif
