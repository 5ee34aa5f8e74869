/* DESIGN: one thread serves the door's ROUTER socket and answers each message before reading
 * the next; the only reply it defers is wait_prefetch_status, answered when its lookup comes
 * back or its time is up. A lookup is one tiered lookup of the cache service per worker of the
 * deployment (prefetch, until_loaded): the L1 prefix at once, the L2 probe and the loads on
 * the service's threads, each lookup pushed back to the door's queue, whose eventfd is in the
 * door's poll; when the last one is back, the request takes its read locks. The door's thread
 * never waits on a backend. Tables (contexts by instance_id, requests by request_id with an
 * age list, waiters) are the thread's, under one mutex so that /status can read them. L1 and
 * service calls are made under that mutex: neither calls back into the door.
 *
 * Failures are answered in-band where the reply type can say so (a miss, false, an empty slot
 * list, the registration's `error`), because the newest merged LMCache client does not know
 * the LMCACHE_RPC_ERROR_V1 form and would wait out its mq_timeout (300 s) on anything else;
 * the error form is kept for what has no in-band answer (malformed frames, refused ops). */
#include "kvt_lmcache_door.h"

#include "kvt_accept.h"
#include "kvt_error.h"
#include "kvt_hash.h"
#include "kvt_lmc.h"
#include "kvt_lmc_events.h"
#include "kvt_lmc_registry.h"
#include "kvt_log.h"
#include "kvt_router.h"
#include "kvt_session.h"
#include "kvt_thread.h"
#include "kvt_u64map.h"

#include <czmq.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
               "token ids are hashed as the little-endian uint32 array they are decoded into");

#define S_MAX_FRAMES 16      /* identity, uid, op and at most 13 arguments */
#define S_MAX_XFERS 4096     /* prepared, uncommitted transfers of one worker */
#define S_MAX_WAITS 1024     /* wait_prefetch_status replies held back */
#define S_MAX_PENDING 256    /* requests waiting for L2 loads at once */
#define S_MAX_WAIT_S 60.0    /* longest wait_prefetch_status */
#define S_SWEEP_MS 100
#define S_SNDHWM 10000       /* replies a client may leave unread before they are dropped */
#define S_STATUS_MAX 100
#define S_MAX_TOLD 4096  /* unknown workers whose ping was answered false, at once */
#define S_TOLD_MS 600000 /* ... remembered that long */

/* Error replies carry a KVT_ERRNO_MAP code; the wire's error type is its wire string
 * ("bad_request", "unknown_type", "too_large", "internal"), as in protocol v1. */

/* A prepared transfer of one worker: the lease its prepare_* took, found again by the
 * identity of (kind, namespace, range, last chunk key) when the commit names the same key. */
typedef struct s_xfer {
    XXH128_hash_t id;
    bool store;
    uint64_t lease[KVT_LMC_MAX_OGROUPS]; /* one per object group (hybrid), else [0]; 0: none */
    uint64_t t_ms;
    struct s_xfer *next;
} s_xfer_t;

/* A registered worker (register_kv_cache_engine_driven_context). */
typedef struct {
    uint64_t instance_id;
    uint64_t owner; /* its L1 lease owner */
    char model[KVT_LMC_MAX_MODEL + 1];
    uint32_t world_size, num_layers, block_size;
    uint64_t hidden;
    char dtype[KVT_MAX_DTYPE + 1];
    bool use_mla;
    uint64_t shape[KVT_LMC_MAX_SHAPE];
    uint32_t ndim;
    uint64_t obj_size;
    uint32_t nog; /* hybrid: object groups, each chunk one object per group (0: plain layout) */
    kvt_lmc_ogroup_t og[KVT_LMC_MAX_OGROUPS];
    uint64_t og_size[KVT_LMC_MAX_OGROUPS]; /* bytes of a chunk's object of each group */
    uint64_t registered_ms, last_seen_ms;
    bool restored;    /* known from the previous daemon's registry, not registered with this one */
    kvt_conn_t *conn; /* the connection that registered it: only it acts for the worker while
                       * it is open; once it closed, the next one that does takes it over */
    s_xfer_t *xfers;
    uint32_t nxfers;
} s_ctx_t;

/* A connection that looked up: its lookup locks are leases of an owner of its own, so
 * max_leased_bytes holds it as it holds a v1 client, and its close releases them. */
typedef struct {
    kvt_conn_t *conn; /* a reference; the table's key is its address */
    uint64_t owner;
    uint64_t last_ms;
} s_asker_t;

/* One request's lookup: its hit count and the read locks on the hit chunks of every worker. */
typedef struct s_req {
    char *id;
    uint64_t hash; /* s_req_hash(id) */
    char model[KVT_LMC_MAX_MODEL + 1];
    char salt[KVT_MAX_SALT + 1];
    uint32_t salt_len;
    uint32_t world;
    uint32_t nog;     /* a hybrid deployment's object groups (0: the plain layout) */
    uint32_t lanes;   /* namespaces looked up: world x object groups (or x 1) */
    uint32_t readers; /* retrieves per worker after which its locks go (num_kv_readers) */
    uint32_t hits;    /* chunks every worker has (valid when !pending) */
    uint32_t target;  /* pending: chunks the L2 loads should complete */
    bool pending, consumed;
    bool dropped;     /* out of the tables, its lookups still out: freed when they are back */
    uint32_t out;     /* pending: the cache service's lookups not back yet */
    kvt_key_t *keys;  /* pending: the chunk keys (the lookups borrow them) */
    kvt_lookup_t *lks; /* pending: one tiered lookup per lane */
    char *nsbufs;     /* their namespaces, KVT_MAX_NS + 1 bytes each */
    uint64_t owner;   /* whose read leases they are: the asking connection's */
    uint64_t *leases; /* read lease per lane, 0 when none or released */
    uint32_t *reads;
    uint64_t deadline_ms;
    struct s_req *older, *newer;
} s_req_t;

/* A worker not known whose ping was answered false (s_do_ping). */
typedef struct {
    uint64_t id, t_ms;
} s_told_t;

/* A wait_prefetch_status reply held back until its lookup is done or it times out. */
typedef struct s_wait {
    zmq_msg_t head[3]; /* identity, uid, op */
    kvt_conn_t *conn;  /* whose reply it is (a reference) */
    char *request_id;
    uint64_t deadline_ms;
    struct s_wait *next;
} s_wait_t;

/* What a handler answers. */
typedef enum { S_R_NONE, S_R_VALUE, S_R_ERROR, S_R_LATER } s_rkind_t;

typedef struct {
    s_rkind_t kind;
    msgpack_sbuffer sbuf;
    msgpack_packer pk;
    int code; /* S_R_ERROR: a KVT_E* code */
    char msg[KVT_LMC_MAX_REQUEST + 128]; /* S_R_ERROR: the message; S_R_LATER: request_id */
    double wait_s; /* S_R_LATER: how long to hold the reply back */
} s_answer_t;

struct kvt_lmcache_door {
    const kvt_config_t *cfg;
    kvt_cache_t *cache;
    kvt_l1_t *l1;              /* kvt_cache_l1(cache) */
    kvt_queue_t *lookups_done; /* the service's lookups coming back (its fd is in the poll) */
    s_req_t *orphans;          /* dropped requests with lookups still out (by `newer`) */
    kvt_router_t *router;
    void *sock;
    kvt_thread_t *thread;
    atomic_bool stop;
    char shm_name[256];
    uint64_t pool_size;
    uint32_t chunk;
    kvt_lmc_limits_t lim;

    kvt_lmc_events_t *events;     /* poll_kv_events over the cache service's event log */
    kvt_lmc_registry_t *registry; /* the registrations a restarted daemon still knows */
    uint32_t restored;            /* registrations taken from the previous daemon */
    kvt_sessions_t *conns; /* the client connections: who registered what, reply accounting */
    kvt_conn_t *cur;       /* the connection of the message being handled (a reference) */

    pthread_mutex_t lock;
    kvt_u64map_t *ctxs;
    kvt_u64map_t *askers; /* s_asker_t by connection key (fd << 32 | gen) */
    kvt_u64map_t *told;   /* s_told_t: unknown workers whose ping was answered false */
    /* requests by a keyed hash of their request_id (clients choose the ids: an unkeyed hash
     * could be made to collide), the id compared on lookup; the age list owns them */
    kvt_u64map_t *reqs;
    uint64_t seed;
    s_req_t *oldest, *newest;
    uint32_t npending;
    s_wait_t *waits;
    uint32_t nwaits;
    uint64_t next_sweep_ms;
    uint64_t lookup_locks;         /* daemon read leases held by lookups */

    atomic_uint_fast64_t requests[KVT_LMC_NOPS]; /* by wire id; [0]: unknown or bad op */
    atomic_uint_fast64_t errors[KVT_WIRE_ERRORS]; /* by kvt_err_wire_index */
    atomic_uint_fast64_t lookup_chunks, hit_chunks, dropped;
    atomic_uint_fast64_t unknown_worker; /* transfers of a worker not registered */
    atomic_size_t nctxs, nreqs; /* table sizes, for the metrics */
    bool refused_logged[KVT_LMC_NOPS];
};

static kvt_errrep_t s_rep_unknown = KVT_ERRREP_INIT(10000);
static kvt_errrep_t s_rep_worker = KVT_ERRREP_INIT(10000);
static kvt_errrep_t s_rep_bad = KVT_ERRREP_INIT(10000);
static kvt_errrep_t s_rep_foreign = KVT_ERRREP_INIT(10000);

/* ---- replies ------------------------------------------------------------------------------ */

static void s_answer_init(s_answer_t *r)
{
    memset(r, 0, sizeof *r);
    msgpack_sbuffer_init(&r->sbuf);
    msgpack_packer_init(&r->pk, &r->sbuf, msgpack_sbuffer_write);
}

static msgpack_packer *s_value(s_answer_t *r)
{
    r->kind = S_R_VALUE;
    return &r->pk;
}

__attribute__((format(printf, 3, 4))) static void s_error(s_answer_t *r, int code,
                                                          const char *fmt, ...)
{
    r->kind = S_R_ERROR;
    r->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->msg, sizeof r->msg, fmt, ap);
    va_end(ap);
}

/* The last part of a reply, zero-copy: libzmq frees it once written to the client's socket,
 * which ends the reply's accounting on its connection (unread bytes, reply_timeout_ms). */
typedef struct {
    kvt_conn_t *conn;
    uint64_t bytes;
} s_sent_t;

static void s_sent_free(void *data, void *hint)
{
    s_sent_t *t = hint;
    if (t->conn)
        kvt_conn_reply_end(t->conn, t->bytes, 0);
    free(t);
    free(data);
}

/* Sends identity, uid and op as received, then the value (or the error form), counted against
 * self->cur's unread replies: a connection that stops reading is cut at max_reply_backlog
 * bytes or after reply_timeout_ms (kvt_sessions_sweep), as on protocol v1. A client that is gone
 * or leaves S_SNDHWM replies unread loses this one (counted). */
static void s_send(kvt_lmcache_door_t *self, zmq_msg_t *head, s_answer_t *r)
{
    msgpack_sbuffer ebuf;
    msgpack_sbuffer_init(&ebuf);
    const void *parts[5];
    size_t sizes[5];
    int n = 0;
    for (int i = 0; i < 3; i++) {
        parts[n] = zmq_msg_data(&head[i]);
        sizes[n++] = zmq_msg_size(&head[i]);
    }
    if (r->kind == S_R_VALUE) {
        parts[n] = r->sbuf.data;
        sizes[n++] = r->sbuf.size;
    } else if (r->kind == S_R_ERROR) {
        msgpack_packer pk;
        msgpack_packer_init(&pk, &ebuf, msgpack_sbuffer_write);
        kvt_lmc_pack_error(&pk, kvt_err_wire(r->code), r->msg);
        parts[n] = KVT_LMC_ERROR_MARKER;
        sizes[n++] = strlen(KVT_LMC_ERROR_MARKER);
        parts[n] = ebuf.data;
        sizes[n++] = ebuf.size;
    }
    uint64_t total = 0;
    for (int i = 0; i < n; i++)
        total += sizes[i];
    for (int i = 0; i < n; i++) {
        int flags = ZMQ_DONTWAIT | (i + 1 < n ? ZMQ_SNDMORE : 0);
        int rc;
        if (i + 1 < n) {
            rc = zmq_send(self->sock, parts[i], sizes[i], flags);
        } else {
            s_sent_t *t = malloc(sizeof *t);
            void *copy = malloc(sizes[i] ? sizes[i] : 1);
            kvt_assert(t && copy);
            memcpy(copy, parts[i], sizes[i]);
            *t = (s_sent_t){self->cur, total};
            if (t->conn)
                kvt_conn_reply_start(t->conn, total, 0, kvt_now_ms());
            zmq_msg_t m;
            zmq_msg_init_data(&m, copy, sizes[i], s_sent_free, t);
            rc = zmq_msg_send(&m, self->sock, flags);
            if (rc < 0)
                zmq_msg_close(&m);
        }
        if (rc < 0) {
            /* only the first part can fail: a ROUTER queues a message whole or not at all */
            atomic_fetch_add(&self->dropped, 1);
            kvt_log(KVT_LOG_DEBUG, "lmcache: reply dropped: %s", zmq_strerror(errno));
            break;
        }
    }
    msgpack_sbuffer_destroy(&ebuf);
}

/* ---- keys and namespaces ------------------------------------------------------------------- */

/* "lmcache/<model>/<world>/<worker>" with the salt: what the door stores a worker's chunk
 * under (docs/integrations.md gives the v1 equivalent). */
static kvt_ns_t s_ns(const char *model, uint32_t world, uint32_t worker, const char *salt,
                     uint32_t salt_len, char *buf, size_t cap)
{
    int len = snprintf(buf, cap, KVT_LMCACHE_NS_PREFIX "%s/%" PRIu32 "/%" PRIu32, model, world,
                       worker);
    return (kvt_ns_t){(const uint8_t *)buf, (uint32_t)len, (const uint8_t *)salt, salt_len};
}

/* Object group g's namespace of a hybrid worker: the worker's with ".g<g>" (nog 0: the
 * worker's own, the plain layout). */
static kvt_ns_t s_ns_g(const char *model, uint32_t world, uint32_t worker, uint32_t g,
                       uint32_t nog, const char *salt, uint32_t salt_len, char *buf, size_t cap)
{
    kvt_ns_t ns = s_ns(model, world, worker, salt, salt_len, buf, cap);
    if (nog) {
        int len = snprintf(buf + ns.name_len, cap - ns.name_len, ".g%" PRIu32, g);
        ns.name_len += (uint32_t)len;
    }
    return ns;
}

static kvt_ns_t s_ns_og(const kvt_lmc_key_t *key, uint32_t g, uint32_t nog, char *buf, size_t cap)
{
    return s_ns_g(key->model, key->world_size, key->worker_id, g, nog, key->salt, key->salt_len,
                  buf, cap);
}

/* The chunk keys 0..n of a key's token_ids (n full chunks must be there). */
static kvt_key_t *s_hash(const kvt_lmcache_door_t *self, const kvt_lmc_key_t *key, uint32_t n)
{
    kvt_key_t *keys = malloc((n ? n : 1) * sizeof *keys);
    kvt_assert(keys);
    kvt_hash_tokens((const uint8_t *)key->tokens, (size_t)key->ntokens * 4u, self->chunk,
                    key->salt, key->salt_len, (uint8_t(*)[KVT_HASH_KEY_LEN])keys, n);
    return keys;
}

/* A transfer's [start, end) as chunk indices: both aligned, inside token_ids, at most max_keys
 * chunks. False with the reason in r->msg. */
static bool s_range(const kvt_lmcache_door_t *self, const kvt_lmc_key_t *key, uint32_t *c0,
                    uint32_t *c1, char *why, size_t whylen)
{
    uint64_t c = self->chunk;
    if (key->start % c || key->end % c) {
        snprintf(why, whylen, "[%" PRIu64 ", %" PRIu64 ") is not aligned to the chunk size %u",
                 key->start, key->end, self->chunk);
        return false;
    }
    if (key->end > key->ntokens) {
        snprintf(why, whylen, "end %" PRIu64 " is past the %u token_ids", key->end,
                 key->ntokens);
        return false;
    }
    if (key->end / c > self->cfg->max_keys) {
        snprintf(why, whylen, "%" PRIu64 " chunks exceed max_keys (%u)", key->end / c,
                 self->cfg->max_keys);
        return false;
    }
    *c0 = (uint32_t)(key->start / c);
    *c1 = (uint32_t)(key->end / c);
    return true;
}

/* The request is part of it: two requests with the same prompt prepare the same range, and
 * one's commit must never publish what the other reserved and has not written. */
static XXH128_hash_t s_xfer_id(bool store, const kvt_lmc_key_t *key, const kvt_ns_t *ns,
                               uint32_t c0, uint32_t c1, const kvt_key_t *last)
{
    uint8_t buf[1 + KVT_MAX_NS + 4 + KVT_MAX_SALT + 8 + KVT_KEY_LEN + KVT_LMC_MAX_REQUEST + 1];
    size_t n = 0, rlen = strlen(key->request_id);
    memcpy(buf + n, key->request_id, rlen + 1);
    n += rlen + 1;
    buf[n++] = store;
    memcpy(buf + n, ns->name, ns->name_len);
    n += ns->name_len;
    memcpy(buf + n, &ns->salt_len, 4);
    n += 4;
    if (ns->salt_len)
        memcpy(buf + n, ns->salt, ns->salt_len);
    n += ns->salt_len;
    memcpy(buf + n, &c0, 4);
    memcpy(buf + n + 4, &c1, 4);
    n += 8;
    memcpy(buf + n, last->b, KVT_KEY_LEN);
    return XXH3_128bits(buf, n + KVT_KEY_LEN);
}

/* Takes the prepared transfer with this identity out of the worker's list; NULL if none. */
static s_xfer_t *s_xfer_take(s_ctx_t *ctx, XXH128_hash_t id, bool store)
{
    for (s_xfer_t **pp = &ctx->xfers; *pp; pp = &(*pp)->next) {
        s_xfer_t *x = *pp;
        if (x->store == store && XXH128_isEqual(x->id, id)) {
            *pp = x->next;
            ctx->nxfers--;
            return x;
        }
    }
    return NULL;
}

/* Gives back every lease of a transfer that will not be committed. */
static void s_xfer_release(kvt_lmcache_door_t *self, const s_ctx_t *ctx, const s_xfer_t *x)
{
    for (uint32_t g = 0; g < KVT_LMC_MAX_OGROUPS; g++)
        if (x->lease[g])
            kvt_l1_release(self->l1, ctx->owner, x->lease[g]);
}

static void s_xfers_free(s_ctx_t *ctx)
{
    for (s_xfer_t *x = ctx->xfers, *next; x; x = next) {
        next = x->next;
        free(x);
    }
    ctx->xfers = NULL;
    ctx->nxfers = 0;
}

/* ---- workers ------------------------------------------------------------------------------ */

/* Whether c's descriptor still holds that connection: closed (EBADF) or given to another one
 * (a new accept generation) before the monitor's report of the close reached this thread,
 * which a worker reconnecting at once must not wait for. */
static bool s_conn_open(const kvt_conn_t *c)
{
    int fd = kvt_conn_fd(c);
    if (fd < 0)
        return true; /* unknown: only the report tells */
    return fcntl(fd, F_GETFD) != -1 && kvt_accept_generation(fd) == kvt_conn_gen(c);
}

/* ctx belongs to conn from now on (NULL: to none). */
static void s_ctx_bind(kvt_lmcache_door_t *self, s_ctx_t *ctx, kvt_conn_t *conn)
{
    if (ctx->conn)
        kvt_conn_hold(self->conns, ctx->conn, false);
    kvt_conn_unref(&ctx->conn);
    if (conn) {
        ctx->conn = kvt_conn_ref(conn);
        kvt_conn_hold(self->conns, conn, true);
    }
}

/* Whether the connection of the message being handled may act for ctx: the one that
 * registered it, or any once that one closed (LMCache replaces its DEALER after an outage and
 * keeps its instance_id; the first connection to act for the worker then takes it over). */
static bool s_ctx_mine(kvt_lmcache_door_t *self, s_ctx_t *ctx, const char *op)
{
    if (!self->cur || ctx->conn == self->cur)
        return true;
    if (ctx->conn && !kvt_conn_retired(ctx->conn) && s_conn_open(ctx->conn)) {
        kvt_errrep_report(&s_rep_foreign, KVT_LOG_WARN,
                          "lmcache: %s for a worker from a connection other than the one that "
                          "registered it, which is still open: refused",
                          op);
        return false;
    }
    s_ctx_bind(self, ctx, self->cur);
    kvt_log(KVT_LOG_INFO, "lmcache: instance %" PRId64 " continues on a new connection (%s)",
            (int64_t)ctx->instance_id, op);
    return true;
}

/* The worker `instance_id` when the current connection may act for it (s_ctx_mine), else
 * NULL (logged: an unknown or unregistered worker, or another connection's). */
static s_ctx_t *s_ctx(kvt_lmcache_door_t *self, uint64_t instance_id, const char *op)
{
    s_ctx_t *ctx = kvt_u64map_get(self->ctxs, instance_id);
    if (ctx && !s_ctx_mine(self, ctx, op))
        return NULL;
    if (ctx) {
        ctx->last_seen_ms = kvt_now_ms();
        return ctx;
    }
    atomic_fetch_add(&self->unknown_worker, 1);
    kvt_errrep_report(&s_rep_worker, KVT_LOG_WARN,
                      "lmcache: %s from instance %" PRId64 ", which is not registered (never, "
                      "unregistered, reaped, or not restored after a restart): answered as a "
                      "miss; its next ping is answered false, so that it registers again",
                      op, (int64_t)instance_id);
    return NULL;
}

/* The worker is no longer registered (unregistered, reaped; at stop, when the registry is gone
 * already, it stays in the registry's file for the next daemon). */
static void s_ctx_drop(kvt_lmcache_door_t *self, s_ctx_t *ctx, bool expired)
{
    kvt_u64map_remove(self->ctxs, ctx->instance_id);
    if (self->registry)
        kvt_lmc_registry_remove(self->registry, ctx->instance_id);
    atomic_store(&self->nctxs, kvt_u64map_size(self->ctxs));
    kvt_cache_owner_close(self->cache, ctx->owner, expired);
    s_xfers_free(ctx);
    s_ctx_bind(self, ctx, NULL);
    free(ctx);
}

static void s_slot(const s_ctx_t *ctx, const kvt_slot_t *s, kvt_lmc_slot_t *out)
{
    out->offset = s->offset;
    out->length = s->length;
    memcpy(out->shape, ctx->shape, sizeof out->shape);
    out->ndim = ctx->ndim;
    out->dtype = ctx->dtype;
}

/* ---- lookups ------------------------------------------------------------------------------ */

static uint64_t s_req_hash(const kvt_lmcache_door_t *self, const char *id)
{
    return XXH3_64bits_withSeed(id, strlen(id), self->seed);
}

static s_req_t *s_req_find(kvt_lmcache_door_t *self, const char *id)
{
    s_req_t *q = kvt_u64map_get(self->reqs, s_req_hash(self, id));
    return q && strcmp(q->id, id) == 0 ? q : NULL;
}

static void s_req_release_locks(kvt_lmcache_door_t *self, s_req_t *q)
{
    for (uint32_t l = 0; l < q->lanes; l++)
        if (q->leases[l]) {
            kvt_l1_release(self->l1, q->owner, q->leases[l]); /* gone with its owner: a no-op */
            q->leases[l] = 0;
            self->lookup_locks--;
        }
}

/* Takes q out of a list linked by older/newer whose older end is *first and newer end *last
 * (NULL: a list without one). */
static void s_unlink(s_req_t *q, s_req_t **first, s_req_t **last)
{
    if (q->older)
        q->older->newer = q->newer;
    else
        *first = q->newer;
    if (q->newer)
        q->newer->older = q->older;
    else if (last)
        *last = q->older;
}

static void s_req_free(s_req_t *q)
{
    free(q->id);
    free(q->keys);
    free(q->lks);
    free(q->nsbufs);
    free(q->leases);
    free(q->reads);
    free(q);
}

/* Out of the tables; freed now, or when its last lookup is back (an orphan till then). */
static void s_req_drop(kvt_lmcache_door_t *self, s_req_t *q)
{
    s_req_release_locks(self, q);
    kvt_u64map_remove(self->reqs, q->hash);
    s_unlink(q, &self->oldest, &self->newest);
    if (q->pending)
        self->npending--;
    atomic_store(&self->nreqs, kvt_u64map_size(self->reqs));
    if (q->out) {
        q->dropped = true;
        q->older = NULL;
        q->newer = self->orphans;
        if (self->orphans)
            self->orphans->older = q;
        self->orphans = q;
        return;
    }
    s_req_free(q);
}

/* Lane l's namespace: worker l / groups, object group l % groups. */
static kvt_ns_t s_lane_ns(const s_req_t *q, uint32_t l, char *buf, size_t cap)
{
    uint32_t per = q->nog ? q->nog : 1;
    return s_ns_g(q->model, q->world, l / per, l % per, q->nog, q->salt, q->salt_len, buf, cap);
}

/* Locks the first `n` chunks of every lane (what is still there of them): hits = the
 * shortest prefix locked. A sliding-window group is held to the same leading run as the
 * others (every group stores every chunk): never a hit that cannot be read back. */
static void s_req_lock(kvt_lmcache_door_t *self, s_req_t *q, const kvt_key_t *keys, uint32_t n)
{
    char nsbuf[KVT_MAX_NS + 1];
    uint32_t hits = n;
    for (uint32_t l = 0; l < q->lanes && n; l++) {
        kvt_ns_t ns = s_lane_ns(q, l, nsbuf, sizeof nsbuf);
        uint32_t got = 0;
        uint64_t lease = 0;
        /* the asking connection's lease: held to max_leased_bytes like a v1 client's */
        if (kvt_l1_lookup(self->l1, q->owner, &ns, keys, n, true, &got, &lease) != 0)
            got = 0, lease = 0;
        q->leases[l] = lease;
        if (lease)
            self->lookup_locks++;
        if (got < hits)
            hits = got;
    }
    q->hits = n ? hits : 0;
    atomic_fetch_add(&self->hit_chunks, q->hits);
}

static void s_waits_run(kvt_lmcache_door_t *self, bool all);

/* One of a request's lookups is back from the cache service. The last one ends the wait: the
 * request locks what every worker has in L1 now, up to the shortest prefix found. */
static void s_lookup_back(kvt_lmcache_door_t *self, kvt_lookup_t *lk)
{
    s_req_t *q = lk->ctx;
    kvt_assert(q->out > 0);
    if (--q->out)
        return;
    if (q->dropped) {
        s_unlink(q, &self->orphans, NULL);
        s_req_free(q);
        return;
    }
    uint32_t target = UINT32_MAX;
    for (uint32_t l = 0; l < q->lanes; l++)
        if (q->lks[l].hits < target)
            target = q->lks[l].hits;
    q->pending = false;
    self->npending--;
    s_req_lock(self, q, q->keys, target);
    free(q->keys);
    free(q->lks);
    free(q->nsbufs);
    q->keys = NULL;
    q->lks = NULL;
    q->nsbufs = NULL;
    if (self->nwaits)
        s_waits_run(self, false);
}

static s_req_t *s_req_new(kvt_lmcache_door_t *self, const kvt_lmc_key_t *key, uint32_t world,
                          uint32_t nog)
{
    uint64_t h = s_req_hash(self, key->request_id);
    s_req_t *old = kvt_u64map_get(self->reqs, h); /* the same id (or, once in 2^64, not) */
    if (old)
        s_req_drop(self, old);
    if (kvt_u64map_size(self->reqs) >= self->cfg->lmcache_max_requests && self->oldest)
        s_req_drop(self, self->oldest);
    s_req_t *q = calloc(1, sizeof *q);
    kvt_assert(q);
    q->id = strdup(key->request_id);
    kvt_assert(q->id);
    memcpy(q->model, key->model, sizeof q->model);
    memcpy(q->salt, key->salt, sizeof q->salt);
    q->salt_len = key->salt_len;
    q->world = world;
    q->nog = nog;
    q->lanes = world * (nog ? nog : 1);
    q->readers = key->num_kv_readers ? key->num_kv_readers : 1;
    q->leases = calloc(q->lanes ? q->lanes : 1, sizeof *q->leases);
    q->reads = calloc(world ? world : 1, sizeof *q->reads);
    kvt_assert(q->leases && q->reads);
    q->deadline_ms = kvt_now_ms() + self->cfg->lease_ms;
    q->hash = h;
    kvt_u64map_set(self->reqs, h, q);
    atomic_store(&self->nreqs, kvt_u64map_size(self->reqs));
    q->older = self->newest;
    if (self->newest)
        self->newest->newer = q;
    else
        self->oldest = q;
    self->newest = q;
    return q;
}

/* The asking connection's lease owner, opened at its first lookup (closed when it closes or
 * stays silent past lease_ms: s_sweep); 0 when max_instances owners are open. */
static uint64_t s_asker_owner(kvt_lmcache_door_t *self)
{
    if (!self->cur)
        return 0;
    uint64_t key = (uint64_t)(uintptr_t)self->cur;
    s_asker_t *a = kvt_u64map_get(self->askers, key);
    if (!a) {
        uint64_t owner = 0;
        char why[160];
        if (kvt_cache_owner_open(self->cache, KVT_OWNER_LMCACHE_CLIENT, &owner, why,
                                 sizeof why) != 0) {
            kvt_errrep_report(&s_rep_foreign, KVT_LOG_WARN,
                              "lmcache: a lookup locks nothing (0 hits): %s", why);
            return 0;
        }
        a = calloc(1, sizeof *a);
        kvt_assert(a);
        a->owner = owner;
        a->conn = kvt_conn_ref(self->cur);
        kvt_u64map_set(self->askers, key, a);
    }
    a->last_ms = kvt_now_ms();
    return a->owner;
}

/* Closes the lookup owners of connections that closed or went silent (lock held). */
static void s_askers_sweep(kvt_lmcache_door_t *self, uint64_t now, bool all)
{
    s_asker_t *gone[64];
    size_t n = 0;
    for (s_asker_t *a = kvt_u64map_first(self->askers); a && n < 64;
         a = kvt_u64map_next(self->askers))
        if (all || kvt_conn_retired(a->conn) ||
            kvt_cache_owner_liveness(self->cache, KVT_OWNER_LMCACHE_CLIENT,
                                     now > a->last_ms ? now - a->last_ms : 0) ==
                KVT_OWNER_EXPIRED)
            gone[n++] = a;
    for (size_t i = 0; i < n; i++) {
        s_asker_t *a = gone[i];
        kvt_u64map_remove(self->askers, (uint64_t)(uintptr_t)a->conn);
        kvt_cache_owner_close(self->cache, a->owner, !all && !kvt_conn_retired(a->conn));
        kvt_conn_unref(&a->conn);
        free(a);
    }
}

static void s_op_lookup(kvt_lmcache_door_t *self, const kvt_lmc_key_t *key, s_answer_t *r)
{
    uint64_t end = key->end < key->ntokens ? key->end : key->ntokens;
    uint64_t nchunks = end / self->chunk;
    /* like LMCache's server: no worker of this deployment registered, nothing to lock (this
     * also bounds world_size, and the per-request arrays, by real registrations) */
    bool known = false;
    uint32_t nog = 0; /* a hybrid deployment: every object group's namespace is looked up */
    for (s_ctx_t *c = kvt_u64map_first(self->ctxs); c && !known; c = kvt_u64map_next(self->ctxs))
        if ((known = c->world_size == key->world_size && strcmp(c->model, key->model) == 0))
            nog = c->nog;
    /* one index probe per chunk and namespace: bounded like one v1 request's keys */
    uint64_t per = nog ? nog : 1;
    if (nchunks * key->world_size * per > self->cfg->max_keys) {
        s_error(r, KVT_ETOOBIG,
                "lookup: %" PRIu64 " chunks x world_size %u x %" PRIu64 " object groups exceed "
                "max_keys (%u)",
                nchunks, key->world_size, per, self->cfg->max_keys);
        return;
    }
    uint64_t owner = known && nchunks ? s_asker_owner(self) : 0;
    uint32_t n = owner ? (uint32_t)nchunks : 0;
    s_req_t *q = s_req_new(self, key, known ? key->world_size : 0, nog);
    q->owner = owner;
    kvt_key_t *keys = s_hash(self, key, n);
    atomic_fetch_add(&self->lookup_chunks, n);
    r->kind = S_R_NONE;
    if (!n || !q->world) {
        s_req_lock(self, q, keys, 0);
        free(keys);
        return;
    }
    /* past S_MAX_PENDING requests loading, a lookup is its L1 part only */
    bool l2 = self->npending < S_MAX_PENDING;
    q->lks = calloc(q->lanes, sizeof *q->lks);
    q->nsbufs = malloc((size_t)q->lanes * (KVT_MAX_NS + 1));
    kvt_assert(q->lks && q->nsbufs);
    q->keys = keys;
    for (uint32_t l = 0; l < q->lanes; l++) {
        kvt_lookup_t *lk = &q->lks[l];
        lk->owner = q->owner;
        lk->ns = s_lane_ns(q, l, q->nsbufs + (size_t)l * (KVT_MAX_NS + 1), KVT_MAX_NS + 1);
        lk->keys = keys;
        lk->n = n;
        lk->prefetch = lk->until_loaded = true;
        lk->done = l2 ? self->lookups_done : NULL;
        lk->ctx = q;
        if (kvt_cache_lookup(self->cache, lk))
            q->out++;
    }
    if (q->out) {
        q->pending = true; /* s_lookup_back takes the locks */
        self->npending++;
        return;
    }
    uint32_t target = n;
    for (uint32_t l = 0; l < q->lanes; l++)
        if (q->lks[l].hits < target)
            target = q->lks[l].hits;
    s_req_lock(self, q, keys, target);
    free(q->keys);
    free(q->lks);
    free(q->nsbufs);
    q->keys = NULL;
    q->lks = NULL;
    q->nsbufs = NULL;
}

/* query_prefetch_status / query_prefetch_lookup_hits: None while loads run, then the hit
 * count; `consume` answers it once (later: 0), like an unknown request. */
static void s_op_status(kvt_lmcache_door_t *self, const char *request_id, bool consume,
                        s_answer_t *r)
{
    s_req_t *q = s_req_find(self, request_id);
    if (q && q->pending) {
        r->kind = S_R_NONE;
        return;
    }
    uint32_t hits = q && !q->consumed ? q->hits : 0;
    if (q && consume)
        q->consumed = true;
    msgpack_pack_uint32(s_value(r), hits);
}

static void s_op_free_locks(kvt_lmcache_door_t *self, const kvt_lmc_key_t *key)
{
    /* vLLM frees [0, n) when it loads none of the hits, or what it computed itself; a later
     * range (start > 0) is kept until read, the session ends or the deadline: holding a lock
     * a little long is harmless, dropping one the worker still reads is a miss */
    s_req_t *q = s_req_find(self, key->request_id);
    if (q && key->start < self->chunk)
        s_req_release_locks(self, q);
}

/* A worker read chunks of a request it looked up: once each worker was read by all its
 * readers up to the hits, its locks go. */
static void s_lookup_read(kvt_lmcache_door_t *self, const kvt_lmc_key_t *key, uint32_t c1)
{
    s_req_t *q = s_req_find(self, key->request_id);
    uint32_t w = key->worker_id, per = q && q->nog ? q->nog : 1;
    if (!q || !key->has_worker || q->pending || w >= q->world || c1 < q->hits)
        return;
    if (++q->reads[w] < q->readers)
        return;
    for (uint32_t l = w * per; l < (w + 1) * per; l++) /* the worker's object groups */
        if (q->leases[l]) {
            kvt_l1_release(self->l1, q->owner, q->leases[l]);
            q->leases[l] = 0;
            self->lookup_locks--;
        }
}

/* ---- transfers ---------------------------------------------------------------------------- */

static bool s_worker_key(const kvt_lmc_key_t *key, const char *op, s_answer_t *r)
{
    if (!key->has_worker) {
        s_error(r, KVT_EBADREQ, "%s: key.worker_id is nil (it names the worker's piece)", op);
        return false;
    }
    return true;
}

/* The checks both prepares start with: a worker key, the worker (NULL: unknown, answered
 * in-band by the caller) and its chunk range. False when r holds the error. */
static bool s_prepare_begin(kvt_lmcache_door_t *self, const kvt_lmc_key_t *key,
                            uint64_t instance, const char *op, s_answer_t *r, s_ctx_t **ctx,
                            uint32_t *c0, uint32_t *c1)
{
    if (!s_worker_key(key, op, r))
        return false;
    *ctx = s_ctx(self, instance, op);
    *c0 = *c1 = 0;
    char why[160];
    if (*ctx && !s_range(self, key, c0, c1, why, sizeof why)) {
        s_error(r, KVT_EBADREQ, "%s: %s", op, why);
        return false;
    }
    return true;
}

/* Bytes of one tensor of a hybrid chunk object (checked against overflow at registration). */
static uint64_t s_tensor_bytes(const kvt_lmc_tensor_t *t)
{
    uint64_t b = kvt_lmc_dtype_size(t->dtype);
    for (uint32_t d = 0; d < t->ndim; d++)
        b *= t->shape[d];
    return b;
}

/* The slots of a hybrid chunk object at `offset`: its tensors one after the other. */
static void s_tensor_slots(const kvt_lmc_ogroup_t *og, uint64_t offset, kvt_lmc_slot_t *out)
{
    for (uint32_t t = 0; t < og->ntensors; t++) {
        const kvt_lmc_tensor_t *ts = &og->t[t];
        out[t] = (kvt_lmc_slot_t){.offset = offset, .length = s_tensor_bytes(ts),
                                  .ndim = ts->ndim, .dtype = ts->dtype};
        memcpy(out[t].shape, ts->shape, sizeof out[t].shape);
        offset += out[t].length;
    }
}

/* A transfer of a worker, its leases given: kept until its commit names it. */
static void s_xfer_add(s_ctx_t *ctx, bool store, XXH128_hash_t id, const uint64_t *lease,
                       uint32_t nlease)
{
    s_xfer_t *x = calloc(1, sizeof *x);
    kvt_assert(x);
    x->id = id;
    x->store = store;
    memcpy(x->lease, lease, nlease * sizeof *lease);
    x->t_ms = kvt_now_ms();
    x->next = ctx->xfers;
    ctx->xfers = x;
    ctx->nxfers++;
}

/* prepare_store of a hybrid worker: in each object group's namespace, an object for every
 * selected chunk that group does not have yet, under a lease per group. All or nothing: when
 * one group cannot reserve, no group gets slots. */
static void s_prepare_store_groups(kvt_lmcache_door_t *self, s_ctx_t *ctx,
                                   const kvt_lmc_key_t *key, uint32_t c0, uint32_t c1,
                                   const kvt_key_t *keys, const kvt_key_t *sel,
                                   const uint32_t *idx, uint32_t m, s_answer_t *r)
{
    kvt_lmc_ogroup_reply_t rep[KVT_LMC_MAX_OGROUPS];
    uint64_t lease[KVT_LMC_MAX_OGROUPS] = {0};
    if ((uint64_t)m * ctx->nog > self->cfg->max_keys) {
        kvt_errrep_report(&s_rep_worker, KVT_LOG_WARN,
                          "lmcache: prepare_store of %u chunks x %u object groups exceeds "
                          "max_keys (%u): answered with no slots",
                          m, ctx->nog, self->cfg->max_keys);
        m = 0;
    }
    size_t per = m ? m : 1;
    kvt_slot_t *slots = malloc(per * sizeof *slots);
    uint32_t *chunks = malloc(ctx->nog * per * sizeof *chunks);
    kvt_lmc_slot_t *out = malloc(ctx->nog * per * KVT_LMC_MAX_KGROUPS * sizeof *out);
    kvt_assert(slots && chunks && out);
    bool ok = true, any = false;
    for (uint32_t g = 0; g < ctx->nog; g++) {
        const kvt_lmc_ogroup_t *og = &ctx->og[g];
        kvt_lmc_ogroup_reply_t *rg = &rep[g];
        *rg = (kvt_lmc_ogroup_reply_t){g, chunks + g * per, 0,
                                       out + g * per * KVT_LMC_MAX_KGROUPS, og->ntensors};
        if (!m || !ok)
            continue;
        char nsbuf[KVT_MAX_NS + 1], err[200];
        kvt_ns_t ns = s_ns_og(key, g, ctx->nog, nsbuf, sizeof nsbuf);
        uint32_t nslots = 0;
        if (kvt_l1_reserve(self->l1, ctx->owner, &ns, sel, m, NULL, ctx->og_size[g], slots,
                           &nslots, &lease[g], err, sizeof err) != 0) {
            kvt_errrep_report(&s_rep_worker, KVT_LOG_WARN,
                              "lmcache: prepare_store of %u chunks, object group %u: %s "
                              "(answered with no slots)",
                              m, g, err);
            ok = false;
            continue;
        }
        uint32_t *gchunks = chunks + g * per;
        kvt_lmc_slot_t *gout = out + g * per * KVT_LMC_MAX_KGROUPS;
        for (uint32_t i = 0; i < nslots; i++) {
            if (!slots[i].length)
                continue; /* this group has it already */
            s_tensor_slots(og, slots[i].offset, gout + rg->n * og->ntensors);
            gchunks[rg->n++] = idx[i];
        }
        any |= lease[g] != 0;
    }
    if (!ok) {
        for (uint32_t g = 0; g < ctx->nog; g++) {
            if (lease[g])
                kvt_l1_release(self->l1, ctx->owner, lease[g]);
            lease[g] = 0;
            rep[g].n = 0;
        }
        any = false;
    }
    if (any) {
        char nsbuf[KVT_MAX_NS + 1];
        kvt_ns_t ns = s_ns_og(key, 0, 0, nsbuf, sizeof nsbuf);
        s_xfer_add(ctx, true, s_xfer_id(true, key, &ns, c0, c1, &keys[c1 - 1]), lease, ctx->nog);
    }
    kvt_lmc_pack_prepare_store_groups(s_value(r), rep, ctx->nog);
    free(slots);
    free(chunks);
    free(out);
}

static void s_op_prepare_store(kvt_lmcache_door_t *self, const kvt_lmc_key_t *key,
                               uint64_t instance, s_answer_t *r)
{
    s_ctx_t *ctx;
    uint32_t c0, c1;
    if (!s_prepare_begin(self, key, instance, "prepare_store", r, &ctx, &c0, &c1))
        return;
    s_ctx_t *worker = ctx; /* a hybrid worker is answered in its form even with no slots */
    if (ctx && ctx->nxfers >= S_MAX_XFERS) {
        kvt_errrep_report(&s_rep_worker, KVT_LOG_WARN,
                          "lmcache: instance %" PRId64 " has %u transfers prepared and not "
                          "committed: prepare_store answered with no slots",
                          (int64_t)instance, ctx->nxfers);
        ctx = NULL;
    }
    uint32_t n = c1 - c0, m = 0;
    kvt_key_t *keys = ctx && n ? s_hash(self, key, c1) : NULL;
    kvt_key_t *sel = keys ? malloc(n * sizeof *sel) : NULL;
    uint32_t *idx = keys ? malloc(n * sizeof *idx) : NULL;
    for (uint32_t i = 0; keys && i < n; i++) {
        /* the mask is per chunk of [start, end), or of the whole sequence when that long */
        uint32_t mi = key->null_mask_len == n ? i : c0 + i;
        if (key->null_mask && mi < key->null_mask_len && key->null_mask[mi])
            continue;
        sel[m] = keys[c0 + i];
        idx[m++] = i;
    }
    if (m) /* what poll_kv_events tells of these chunks needs their tokens */
        kvt_lmc_events_bind(self->events, keys, key->tokens, c0, idx, m);
    if (worker && worker->nog) {
        s_prepare_store_groups(self, worker, key, c0, c1, keys, sel, idx, m, r);
        free(keys);
        free(sel);
        free(idx);
        return;
    }
    kvt_slot_t *slots = m ? malloc(m * sizeof *slots) : NULL;
    kvt_lmc_slot_t *out = m ? malloc(m * sizeof *out) : NULL;
    uint32_t *chunk = m ? malloc(m * sizeof *chunk) : NULL;
    uint32_t nslots = 0, nout = 0;
    uint64_t lease = 0;
    char nsbuf[KVT_MAX_NS + 1];
    kvt_ns_t ns = {0};
    if (m) {
        ns = s_ns(key->model, key->world_size, key->worker_id, key->salt, key->salt_len, nsbuf,
                  sizeof nsbuf);
        char err[200];
        int rc = kvt_l1_reserve(self->l1, ctx->owner, &ns, sel, m, NULL, ctx->obj_size, slots,
                                &nslots, &lease, err, sizeof err);
        if (rc != 0) {
            kvt_errrep_report(&s_rep_worker, KVT_LOG_WARN,
                              "lmcache: prepare_store of %u chunks: %s (answered with no slots)",
                              m, err);
            nslots = 0;
        }
    }
    for (uint32_t i = 0; i < nslots; i++) {
        if (!slots[i].length)
            continue; /* stored already */
        s_slot(ctx, &slots[i], &out[nout]);
        chunk[nout++] = idx[i];
    }
    if (lease)
        s_xfer_add(ctx, true, s_xfer_id(true, key, &ns, c0, c1, &keys[c1 - 1]), &lease, 1);
    kvt_lmc_pack_prepare_store(s_value(r), out, chunk, nout);
    free(keys);
    free(sel);
    free(idx);
    free(slots);
    free(out);
    free(chunk);
}

/* The prepared transfer a commit names (NULL when there is none), taken out of its list. */
static s_xfer_t *s_commit_find(kvt_lmcache_door_t *self, s_ctx_t *ctx, const kvt_lmc_key_t *key,
                               bool store, uint32_t *c1_out)
{
    uint32_t c0, c1;
    char why[160];
    if (!ctx || !key->has_worker || !s_range(self, key, &c0, &c1, why, sizeof why) || c1 == c0)
        return NULL;
    kvt_key_t *keys = s_hash(self, key, c1);
    char nsbuf[KVT_MAX_NS + 1];
    kvt_ns_t ns = s_ns(key->model, key->world_size, key->worker_id, key->salt, key->salt_len,
                       nsbuf, sizeof nsbuf);
    s_xfer_t *x = s_xfer_take(ctx, s_xfer_id(store, key, &ns, c0, c1, &keys[c1 - 1]), store);
    free(keys);
    *c1_out = c1;
    return x;
}

static void s_op_commit_store(kvt_lmcache_door_t *self, const kvt_lmc_key_t *key, uint64_t instance,
                              uint64_t data_len, s_answer_t *r)
{
    s_ctx_t *ctx = s_ctx(self, instance, "commit_store");
    bool ok = false;
    uint32_t c1 = 0;
    if (data_len) {
        kvt_errrep_report(&s_rep_worker, KVT_LOG_WARN,
                          "lmcache: commit_store with %" PRIu64 " bytes of data (the pickle "
                          "transfer mode, which kvtier does not take): answered false",
                          data_len);
    }
    s_xfer_t *x = s_commit_find(self, ctx, key, true, &c1);
    if (x && !data_len) {
        ok = true; /* a hybrid worker's chunk is stored when every group's object is */
        for (uint32_t g = 0; g < KVT_LMC_MAX_OGROUPS; g++) {
            uint32_t stored = 0;
            char err[200];
            if (x->lease[g] && kvt_l1_commit(self->l1, ctx->owner, x->lease[g], NULL, 0, &stored,
                                             err, sizeof err) != 0) {
                ok = false;
                kvt_log(KVT_LOG_INFO, "lmcache: commit_store of instance %" PRId64 ": %s",
                        (int64_t)instance, err);
            }
        }
    } else if (x) {
        s_xfer_release(self, ctx, x);
    }
    free(x);
    ok ? msgpack_pack_true(s_value(r)) : msgpack_pack_false(s_value(r));
}

/* abort_store: the worker could not fill the slots its prepare_store got (its copy failed):
 * the reservation goes at once, nothing of it is ever readable. True when there was one. */
static void s_op_abort_store(kvt_lmcache_door_t *self, const kvt_lmc_key_t *key, uint64_t instance,
                             s_answer_t *r)
{
    s_ctx_t *ctx = s_ctx(self, instance, "abort_store");
    uint32_t c1 = 0;
    s_xfer_t *x = s_commit_find(self, ctx, key, true, &c1);
    if (x)
        s_xfer_release(self, ctx, x);
    x ? msgpack_pack_true(s_value(r)) : msgpack_pack_false(s_value(r));
    free(x);
}

/* prepare_retrieve of a hybrid worker: every object group's objects of the chunks it needs
 * (the last sw_chunks of the range for a sliding-window group, all of them otherwise), each
 * read-locked, or a miss with an empty context (LMCache's all-or-nothing). */
static void s_prepare_retrieve_groups(kvt_lmcache_door_t *self, s_ctx_t *ctx,
                                      const kvt_lmc_key_t *key, uint64_t instance, uint32_t c0,
                                      uint32_t c1, s_answer_t *r)
{
    uint32_t n = c1 - c0;
    /* one object per chunk and group: bounded like one v1 request's keys */
    if (!n || ctx->nxfers >= S_MAX_XFERS || (uint64_t)n * ctx->nog > self->cfg->max_keys) {
        kvt_lmc_pack_prepare_retrieve_groups(s_value(r), false, NULL, 0);
        return;
    }
    kvt_key_t *keys = s_hash(self, key, c1);
    kvt_lmc_ogroup_reply_t rep[KVT_LMC_MAX_OGROUPS];
    uint64_t lease[KVT_LMC_MAX_OGROUPS] = {0};
    kvt_slot_t *slots = malloc(n * sizeof *slots);
    uint32_t *chunks = malloc((size_t)ctx->nog * n * sizeof *chunks);
    kvt_lmc_slot_t *out = malloc((size_t)ctx->nog * n * KVT_LMC_MAX_KGROUPS * sizeof *out);
    kvt_assert(slots && chunks && out);
    bool ok = true;
    for (uint32_t g = 0; g < ctx->nog && ok; g++) {
        const kvt_lmc_ogroup_t *og = &ctx->og[g];
        uint32_t first = og->sw_chunks > 0 && n > (uint32_t)og->sw_chunks ? c1 - og->sw_chunks
                                                                          : c0;
        uint32_t want = c1 - first, nslots = 0;
        char nsbuf[KVT_MAX_NS + 1];
        kvt_ns_t ns = s_ns_og(key, g, ctx->nog, nsbuf, sizeof nsbuf);
        ok = kvt_l1_acquire(self->l1, ctx->owner, &ns, keys + first, want, slots, &nslots,
                            &lease[g]) == 0 &&
             nslots == want;
        uint32_t *gchunks = chunks + (size_t)g * n;
        kvt_lmc_slot_t *gout = out + (size_t)g * n * KVT_LMC_MAX_KGROUPS;
        rep[g] = (kvt_lmc_ogroup_reply_t){g, gchunks, want, gout, og->ntensors};
        for (uint32_t i = 0; ok && i < want; i++) {
            if (slots[i].length != ctx->og_size[g]) {
                kvt_errrep_report(&s_rep_worker, KVT_LOG_WARN,
                                  "lmcache: prepare_retrieve: a chunk of %s holds %" PRIu64
                                  " bytes, instance %" PRId64 "'s object group %u %" PRIu64
                                  ": a miss",
                                  nsbuf, slots[i].length, (int64_t)instance, g, ctx->og_size[g]);
                ok = false;
            }
            gchunks[i] = first - c0 + i;
            s_tensor_slots(og, slots[i].offset, gout + i * og->ntensors);
        }
        if (ok && kvt_l1_verify(self->l1, ctx->owner, lease[g], want) < want)
            ok = false; /* l1_checksum found a damaged object (logged and removed by L1) */
    }
    if (ok) {
        char nsbuf[KVT_MAX_NS + 1];
        kvt_ns_t ns = s_ns_og(key, 0, 0, nsbuf, sizeof nsbuf);
        s_xfer_add(ctx, false, s_xfer_id(false, key, &ns, c0, c1, &keys[c1 - 1]), lease, ctx->nog);
    } else {
        for (uint32_t g = 0; g < ctx->nog; g++)
            if (lease[g])
                kvt_l1_release(self->l1, ctx->owner, lease[g]);
    }
    kvt_lmc_pack_prepare_retrieve_groups(s_value(r), ok, rep, ctx->nog);
    free(keys);
    free(slots);
    free(chunks);
    free(out);
}

static void s_op_prepare_retrieve(kvt_lmcache_door_t *self, const kvt_lmc_key_t *key,
                                  uint64_t instance, s_answer_t *r)
{
    s_ctx_t *ctx;
    uint32_t c0, c1;
    if (!s_prepare_begin(self, key, instance, "prepare_retrieve", r, &ctx, &c0, &c1))
        return;
    if (ctx && ctx->nog) {
        s_prepare_retrieve_groups(self, ctx, key, instance, c0, c1, r);
        return;
    }
    uint32_t n = c1 - c0, nslots = 0;
    if (!ctx || !n || ctx->nxfers >= S_MAX_XFERS) {
        kvt_lmc_pack_prepare_retrieve(s_value(r), false, NULL, 0);
        return;
    }
    kvt_key_t *keys = s_hash(self, key, c1);
    kvt_slot_t *slots = malloc(n * sizeof *slots);
    kvt_lmc_slot_t *out = malloc(n * sizeof *out);
    kvt_assert(slots && out);
    char nsbuf[KVT_MAX_NS + 1];
    kvt_ns_t ns = s_ns(key->model, key->world_size, key->worker_id, key->salt, key->salt_len,
                       nsbuf, sizeof nsbuf);
    uint64_t lease = 0;
    int rc = kvt_l1_acquire(self->l1, ctx->owner, &ns, keys + c0, n, slots, &nslots, &lease);
    if (rc) { /* max_leased_bytes: the worker holds too much already; a miss, said why */
        char limit[200];
        kvt_l1_owner_limit_error(self->l1, ctx->owner, limit, sizeof limit);
        kvt_errrep_report(&s_rep_worker, KVT_LOG_WARN, "lmcache: prepare_retrieve of instance %"
                          PRId64 ": %s: a miss", (int64_t)instance, limit);
        nslots = 0;
    }
    bool ok = nslots == n;
    for (uint32_t i = 0; ok && i < n; i++) {
        if (slots[i].length != ctx->obj_size) {
            kvt_errrep_report(&s_rep_worker, KVT_LOG_WARN,
                              "lmcache: prepare_retrieve: a chunk of %s holds %" PRIu64
                              " bytes, instance %" PRId64 "'s layout %" PRIu64 ": a miss",
                              nsbuf, slots[i].length, (int64_t)instance, ctx->obj_size);
            ok = false;
        }
        s_slot(ctx, &slots[i], &out[i]);
    }
    if (ok && kvt_l1_verify(self->l1, ctx->owner, lease, n) < n)
        ok = false; /* l1_checksum found a damaged chunk (logged and removed by L1) */
    if (ok) {
        s_xfer_add(ctx, false, s_xfer_id(false, key, &ns, c0, c1, &keys[c1 - 1]), &lease, 1);
    } else if (lease) {
        kvt_l1_release(self->l1, ctx->owner, lease);
    }
    kvt_lmc_pack_prepare_retrieve(s_value(r), ok, out, ok ? n : 0);
    free(keys);
    free(slots);
    free(out);
}

static void s_op_commit_retrieve(kvt_lmcache_door_t *self, const kvt_lmc_key_t *key,
                                 uint64_t instance, s_answer_t *r)
{
    s_ctx_t *ctx = s_ctx(self, instance, "commit_retrieve");
    uint32_t c1 = 0;
    s_xfer_t *x = s_commit_find(self, ctx, key, false, &c1);
    if (x) {
        s_xfer_release(self, ctx, x);
        s_lookup_read(self, key, c1);
        free(x);
    }
    /* true also after a failed prepare: the client sends this whatever happened */
    ctx ? msgpack_pack_true(s_value(r)) : msgpack_pack_false(s_value(r));
}

/* ---- registration ------------------------------------------------------------------------- */

/* A hybrid registration's object groups: known dtypes, each chunk object (its tensors) at
 * most a fourth of the arena, the worker's tokens per chunk kvtierd's. NULL, or why not. */
static const char *s_ogroups_check(const kvt_lmcache_door_t *self, const kvt_lmc_ctx_t *p,
                                   char *why, size_t whylen)
{
    if (p->tokens_per_chunk != self->chunk) {
        snprintf(why, whylen, "the worker's chunks are %u tokens, kvtierd's chunk_tokens is %u: "
                              "start kvtierd with --chunk-tokens %u",
                 p->tokens_per_chunk, self->chunk, p->tokens_per_chunk);
        return why;
    }
    for (uint32_t g = 0; g < p->nogroups; g++) {
        uint64_t total = 0;
        for (uint32_t k = 0; k < p->og[g].ntensors; k++) {
            const kvt_lmc_tensor_t *t = &p->og[g].t[k];
            uint64_t b = kvt_lmc_dtype_size(t->dtype);
            if (!b) {
                snprintf(why, whylen, "object group %u: dtype '%s' is not a dtype kvtier knows",
                         g, t->dtype);
                return why;
            }
            bool over = false;
            for (uint32_t d = 0; d < t->ndim && !over; d++)
                over = __builtin_mul_overflow(b, t->shape[d], &b);
            over = over || __builtin_add_overflow(total, b, &total);
            if (over || b > self->pool_size || total > self->pool_size / 4) {
                snprintf(why, whylen, "object group %u: a chunk's object does not fit a fourth "
                                      "of the L1 arena (%" PRIu64 " bytes)",
                         g, self->pool_size);
                return why;
            }
        }
    }
    return NULL;
}

/* Checks a registration against what the door can serve; NULL, or why not. */
static const char *s_ctx_check(const kvt_lmcache_door_t *self, const kvt_lmc_ctx_t *p, char *why,
                               size_t whylen, uint64_t *obj_size)
{
    uint32_t item = kvt_lmc_dtype_size(p->dtype);
    if (!item)
        snprintf(why, whylen, "dtype_str '%s' is not a dtype kvtier knows", p->dtype);
    else if (!p->model[0])
        snprintf(why, whylen, "model_name is empty");
    else if (p->world_size < 1 || p->world_size > KVT_LMC_MAX_WORLD)
        snprintf(why, whylen, "world_size %u is outside 1..%u", p->world_size,
                 KVT_LMC_MAX_WORLD);
    else if (p->ngroups > 1 && !p->nogroups)
        snprintf(why, whylen, "%u engine groups without object_group_layout_shapes: this "
                              "worker's hybrid layout is one kvtier does not know; start "
                              "vLLM with --disable-hybrid-kv-cache-manager", p->ngroups);
    else if (p->nogroups)
        return s_ogroups_check(self, p, why, whylen);
    else if (p->num_physical_slots && p->num_physical_slots != self->chunk)
        snprintf(why, whylen, "the worker gathers %" PRIu64 " tokens per chunk, kvtierd's "
                              "chunk_tokens is %u: start kvtierd with --chunk-tokens %" PRIu64,
                 p->num_physical_slots, self->chunk, p->num_physical_slots);
    else if (!p->block_size || self->chunk % p->block_size)
        snprintf(why, whylen, "chunk_tokens %u is not a multiple of block_size %u", self->chunk,
                 p->block_size);
    else if (!p->num_layers || !p->hidden_dim_size)
        snprintf(why, whylen, "num_layers and hidden_dim_size must be positive");
    else {
        /* every factor is below 2^32 and the product is checked step by step */
        uint64_t size = (p->use_mla ? 1u : 2u) * (uint64_t)p->num_layers;
        uint64_t f[3] = {self->chunk, p->hidden_dim_size, item};
        bool over = false;
        for (int i = 0; i < 3 && !over; i++) {
            over = f[i] && size > UINT64_MAX / f[i];
            size *= f[i];
        }
        if (over || size > self->pool_size / 2) {
            snprintf(why, whylen, "a chunk of this layout (%" PRIu64 " bytes) does not fit the "
                                  "L1 arena (%" PRIu64 " bytes) twice",
                     over ? UINT64_MAX : size, self->pool_size);
        } else {
            *obj_size = size;
            return NULL;
        }
    }
    return why;
}

/* A registration again with the same instance_id must describe the same slots: the worker's
 * chunks already stored have that shape. */
static bool s_same_layout(const s_ctx_t *c, const kvt_lmc_ctx_t *p)
{
    return strcmp(c->model, p->model) == 0 && strcmp(c->dtype, p->dtype) == 0 &&
           c->world_size == p->world_size && c->num_layers == p->num_layers &&
           c->block_size == p->block_size && c->hidden == p->hidden_dim_size &&
           c->use_mla == p->use_mla && c->nog == p->nogroups &&
           memcmp(c->og, p->og, p->nogroups * sizeof *p->og) == 0;
}

/* Workers the current connection registered (bounded like v1's instances per connection). */
static uint32_t s_registrations(kvt_lmcache_door_t *self)
{
    uint32_t n = 0;
    for (s_ctx_t *c = kvt_u64map_first(self->ctxs); c; c = kvt_u64map_next(self->ctxs))
        n += self->cur && c->conn == self->cur;
    return n;
}

static s_ctx_t *s_ctx_new(kvt_lmcache_door_t *self, uint64_t id, uint64_t owner, kvt_conn_t *conn)
{
    s_ctx_t *ctx = calloc(1, sizeof *ctx);
    kvt_assert(ctx);
    ctx->instance_id = id;
    ctx->owner = owner;
    s_ctx_bind(self, ctx, conn);
    ctx->registered_ms = kvt_now_ms();
    kvt_u64map_set(self->ctxs, id, ctx);
    atomic_store(&self->nctxs, kvt_u64map_size(self->ctxs));
    return ctx;
}

/* The layout of a registration that passed s_ctx_check (size: its chunk's bytes). */
static void s_ctx_fill(kvt_lmcache_door_t *self, s_ctx_t *ctx, const kvt_lmc_ctx_t *p,
                       uint64_t size)
{
    memcpy(ctx->model, p->model, sizeof ctx->model);
    memcpy(ctx->dtype, p->dtype, sizeof ctx->dtype);
    ctx->world_size = p->world_size;
    ctx->num_layers = p->num_layers;
    ctx->block_size = p->block_size;
    ctx->hidden = p->hidden_dim_size;
    ctx->use_mla = p->use_mla;
    ctx->obj_size = size;
    ctx->ndim = 0;
    if (!p->use_mla)
        ctx->shape[ctx->ndim++] = 2;
    ctx->shape[ctx->ndim++] = p->num_layers;
    ctx->shape[ctx->ndim++] = self->chunk;
    ctx->shape[ctx->ndim++] = p->hidden_dim_size;
    ctx->nog = p->nogroups;
    memcpy(ctx->og, p->og, sizeof ctx->og);
    for (uint32_t g = 0; g < ctx->nog; g++) {
        ctx->og_size[g] = 0;
        for (uint32_t k = 0; k < ctx->og[g].ntensors; k++)
            ctx->og_size[g] += s_tensor_bytes(&ctx->og[g].t[k]);
        ctx->obj_size += ctx->og_size[g]; /* a chunk's bytes, all groups together */
    }
    ctx->last_seen_ms = kvt_now_ms();
}

/* payload: the registration as the worker sent it, kept for the next daemon (kvt_lmc_registry). */
static void s_op_register(kvt_lmcache_door_t *self, const kvt_lmc_ctx_t *p, const uint8_t *payload,
                          size_t len, s_answer_t *r)
{
    char why[256];
    uint64_t size = 0;
    const char *error = s_ctx_check(self, p, why, sizeof why, &size);
    s_ctx_t *ctx = kvt_u64map_get(self->ctxs, p->instance_id);
    uint64_t owner = 0; /* max_instances counts v1 instances and LMCache workers together */
    if (!error && ctx && !s_ctx_mine(self, ctx, "register_kv_cache_engine_driven_context"))
        error = "this instance_id is registered by another connection, which is still open";
    else if (!error && ctx && !s_same_layout(ctx, p))
        error = "this instance_id is registered with another layout: unregister it first";
    else if (!error && !ctx && s_registrations(self) >= self->cfg->max_instances_per_connection) {
        snprintf(why, sizeof why,
                 "this connection has %u registrations already (max_instances_per_connection)",
                 self->cfg->max_instances_per_connection);
        error = why;
    } else if (!error && !ctx &&
               kvt_cache_owner_open(self->cache, KVT_OWNER_LMCACHE, &owner, why, sizeof why) != 0)
        error = why;
    if (error) {
        kvt_log(KVT_LOG_WARN, "lmcache: registration of instance %" PRId64 " refused: %s",
                (int64_t)p->instance_id, error);
        kvt_lmc_pack_register(s_value(r), self->shm_name, self->pool_size, error);
        return;
    }
    bool created = !ctx;
    if (created)
        ctx = s_ctx_new(self, p->instance_id, owner, self->cur);
    s_ctx_fill(self, ctx, p, size);
    ctx->restored = false;
    kvt_lmc_registry_set(self->registry, p->instance_id, payload, len);
    kvt_log(KVT_LOG_INFO,
            "lmcache: instance %" PRId64 " %s: %s, world_size %u, %u layers x %" PRIu64
            " x %s%s (%" PRIu64 " bytes per chunk%s)",
            (int64_t)p->instance_id, created ? "registered" : "registered again", p->model,
            p->world_size, p->num_layers, p->hidden_dim_size, p->dtype,
            p->use_mla ? ", MLA" : "", ctx->obj_size, ctx->nog ? ", hybrid: object groups" : "");
    kvt_lmc_pack_register(s_value(r), self->shm_name, self->pool_size, NULL);
}

/* A registration the previous daemon kept (kvt_lmc_registry_load): checked as a new one
 * would be, against this daemon's configuration; taken back into the registry when good. */
static void s_restore(void *arg, const uint8_t *payload, size_t len)
{
    kvt_lmcache_door_t *self = arg;
    kvt_lmc_ctx_t p;
    char why[256];
    uint64_t size = 0, owner = 0;
    const char *error = NULL;
    if (kvt_lmc_decode_ctx(payload, len, &self->lim, &p, why, sizeof why) != 0)
        error = why;
    else if (kvt_u64map_get(self->ctxs, p.instance_id))
        error = "its instance_id is there twice";
    else if (!(error = s_ctx_check(self, &p, why, sizeof why, &size)) &&
             kvt_cache_owner_open(self->cache, KVT_OWNER_LMCACHE, &owner, why, sizeof why) != 0)
        error = why;
    if (error) {
        kvt_log(KVT_LOG_WARN, "lmcache: a registration of the previous daemon is not restored: %s",
                error);
        return;
    }
    s_ctx_t *ctx = s_ctx_new(self, p.instance_id, owner, NULL);
    s_ctx_fill(self, ctx, &p, size);
    ctx->restored = true;
    kvt_lmc_registry_set(self->registry, p.instance_id, payload, len);
    self->restored++;
}

/* Opens the registry of RUN_DIR and takes back what the previous daemon's workers registered,
 * when this daemon serves the arena file they map. */
static int s_registry_open(kvt_lmcache_door_t *self, const char *shm_path, char *err, size_t errlen)
{
    struct stat st;
    if (stat(shm_path, &st) != 0) {
        snprintf(err, errlen, "lmcache.listen: cannot stat the arena %s: %s", shm_path,
                 strerror(errno));
        return -1;
    }
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", self->cfg->run_dir, KVT_LMC_REGISTRY_FILE);
    kvt_lmc_arena_t arena = {.shm_name = self->shm_name,
                             .pool_size = self->pool_size,
                             .dev = (uint64_t)st.st_dev,
                             .ino = (uint64_t)st.st_ino,
                             .chunk_tokens = self->chunk};
    self->registry = kvt_lmc_registry_new(path, &arena);
    kvt_assert(self->registry);
    char why[4400];
    int n = kvt_lmc_registry_load(self->registry, s_restore, self, why, sizeof why);
    if (n < 0)
        kvt_log(KVT_LOG_WARN,
                "lmcache: the previous daemon's registrations are not restored "
                "(the workers must register again): %s",
                why);
    else if (n > 0)
        kvt_log(KVT_LOG_INFO,
                "lmcache: %u of the previous daemon's %d worker registrations "
                "restored (the workers go on without registering again)",
                self->restored, n);
    return 0;
}

/* ---- dispatch ----------------------------------------------------------------------------- */

/* One op's handler: decodes its arguments (frames a->f[0..a->n)) and answers in r. Returns 0,
 * or the decoder's KVT_E* code with the reason in why (the caller answers the error form). */
typedef struct {
    zmq_msg_t *f; /* the argument frames */
    int n;
} s_args_t;

typedef int (*s_op_fn)(kvt_lmcache_door_t *self, kvt_lmc_op_t op, const s_args_t *a, s_answer_t *r,
                       char *why, size_t whylen);

#define S_ARG(i) zmq_msg_data(&a->f[(i)]), zmq_msg_size(&a->f[(i)])

/* lookup, free_lookup_locks: (key, tp_size). */
static int s_do_lookup(kvt_lmcache_door_t *self, kvt_lmc_op_t op, const s_args_t *a, s_answer_t *r,
                       char *why, size_t whylen)
{
    kvt_lmc_key_t key = {0};
    uint64_t tp = 0;
    int rc = kvt_lmc_decode_key(S_ARG(0), &self->lim, &key, why, whylen);
    if (!rc)
        rc = kvt_lmc_decode_uint(S_ARG(1), UINT32_MAX, &tp, why, whylen);
    if (!rc && op == KVT_LMC_LOOKUP)
        s_op_lookup(self, &key, r);
    else if (!rc)
        s_op_free_locks(self, &key);
    kvt_lmc_key_free(&key);
    return rc;
}

/* query_prefetch_status, query_prefetch_lookup_hits: (request_id). */
static int s_do_status(kvt_lmcache_door_t *self, kvt_lmc_op_t op, const s_args_t *a, s_answer_t *r,
                       char *why, size_t whylen)
{
    char rid[KVT_LMC_MAX_REQUEST + 1];
    int rc = kvt_lmc_decode_str(S_ARG(0), rid, sizeof rid, why, whylen);
    if (!rc)
        s_op_status(self, rid, op == KVT_LMC_QUERY_PREFETCH_STATUS, r);
    return rc;
}

/* wait_prefetch_status: (request_id, timeout_s); held back while the lookup loads. */
static int s_do_wait(kvt_lmcache_door_t *self, kvt_lmc_op_t op, const s_args_t *a, s_answer_t *r,
                     char *why, size_t whylen)
{
    (void)op;
    char rid[KVT_LMC_MAX_REQUEST + 1];
    double d = 0;
    int rc = kvt_lmc_decode_str(S_ARG(0), rid, sizeof rid, why, whylen);
    if (!rc)
        rc = kvt_lmc_decode_double(S_ARG(1), &d, why, whylen);
    if (rc)
        return rc;
    s_req_t *q = s_req_find(self, rid);
    if (q && q->pending && d > 0 && self->nwaits < S_MAX_WAITS) {
        r->kind = S_R_LATER;
        snprintf(r->msg, sizeof r->msg, "%s", rid);
        r->wait_s = d < S_MAX_WAIT_S ? d : S_MAX_WAIT_S;
    } else {
        s_op_status(self, rid, true, r);
    }
    return 0;
}

/* end_session: (request_id[, end_info]). */
static int s_do_end_session(kvt_lmcache_door_t *self, kvt_lmc_op_t op, const s_args_t *a,
                            s_answer_t *r, char *why, size_t whylen)
{
    (void)op, (void)r;
    char rid[KVT_LMC_MAX_REQUEST + 1];
    int rc = kvt_lmc_decode_str(S_ARG(0), rid, sizeof rid, why, whylen);
    s_req_t *q = rc ? NULL : s_req_find(self, rid);
    if (q)
        s_req_drop(self, q); /* its waiters, if any, are answered 0 on the next tick */
    return rc;
}

/* register_kv_cache_engine_driven_context: (payload). A payload that does not decode is
 * refused in the response's `error`, a form every client reads. */
static int s_do_register(kvt_lmcache_door_t *self, kvt_lmc_op_t op, const s_args_t *a,
                         s_answer_t *r, char *why, size_t whylen)
{
    (void)op;
    kvt_lmc_ctx_t ctx;
    if (kvt_lmc_decode_ctx(S_ARG(0), &self->lim, &ctx, why, whylen) == 0) {
        s_op_register(self, &ctx, zmq_msg_data(&a->f[0]), zmq_msg_size(&a->f[0]), r);
    } else {
        kvt_log(KVT_LOG_WARN, "lmcache: registration refused: %s", why);
        kvt_lmc_pack_register(s_value(r), self->shm_name, self->pool_size, why);
    }
    return 0;
}

/* unregister_kv_cache_engine_driven_context: (instance_id). */
static int s_do_unregister(kvt_lmcache_door_t *self, kvt_lmc_op_t op, const s_args_t *a,
                           s_answer_t *r, char *why, size_t whylen)
{
    (void)op, (void)r;
    uint64_t u = 0;
    bool nil = false;
    int rc = kvt_lmc_decode_int(S_ARG(0), false, &u, &nil, why, whylen);
    if (rc)
        return rc;
    s_ctx_t *c = kvt_u64map_get(self->ctxs, u);
    if (c && s_ctx_mine(self, c, "unregister_kv_cache_engine_driven_context")) {
        kvt_log(KVT_LOG_INFO, "lmcache: instance %" PRId64 " unregistered", (int64_t)u);
        s_ctx_drop(self, c, false);
    } else if (!c) {
        kvt_log(KVT_LOG_INFO, "lmcache: unregister of instance %" PRId64
                              ", which is not registered", (int64_t)u);
    }
    return 0;
}

/* prepare_store, prepare_retrieve, commit_retrieve, abort_store: (key, instance_id);
 * commit_store: (key, instance_id, data). */
static int s_do_transfer(kvt_lmcache_door_t *self, kvt_lmc_op_t op, const s_args_t *a,
                         s_answer_t *r, char *why, size_t whylen)
{
    kvt_lmc_key_t key = {0};
    uint64_t instance = 0, data_len = 0;
    bool nil = false;
    int rc = kvt_lmc_decode_key(S_ARG(0), &self->lim, &key, why, whylen);
    if (!rc)
        rc = kvt_lmc_decode_int(S_ARG(1), false, &instance, &nil, why, whylen);
    if (!rc && op == KVT_LMC_COMMIT_STORE)
        rc = kvt_lmc_decode_bin_len(S_ARG(2), &data_len, why, whylen);
    if (!rc) {
        if (op == KVT_LMC_PREPARE_STORE)
            s_op_prepare_store(self, &key, instance, r);
        else if (op == KVT_LMC_PREPARE_RETRIEVE)
            s_op_prepare_retrieve(self, &key, instance, r);
        else if (op == KVT_LMC_COMMIT_STORE)
            s_op_commit_store(self, &key, instance, data_len, r);
        else if (op == KVT_LMC_ABORT_STORE)
            s_op_abort_store(self, &key, instance, r);
        else
            s_op_commit_retrieve(self, &key, instance, r);
    }
    kvt_lmc_key_free(&key);
    return rc;
}

/* clear: ([force]); without force, chunks under read locks stay. */
static int s_do_clear(kvt_lmcache_door_t *self, kvt_lmc_op_t op, const s_args_t *a, s_answer_t *r,
                      char *why, size_t whylen)
{
    (void)op, (void)r;
    bool force = false;
    int rc = a->n ? kvt_lmc_decode_bool(S_ARG(0), &force, why, whylen) : 0;
    if (rc)
        return rc;
    uint64_t removed = 0;
    pthread_mutex_unlock(&self->lock); /* a walk of all of L1 */
    kvt_l1_clear_prefix(self->l1, (const uint8_t *)KVT_LMCACHE_NS_PREFIX,
                        strlen(KVT_LMCACHE_NS_PREFIX), !force, &removed);
    pthread_mutex_lock(&self->lock);
    kvt_log(KVT_LOG_INFO, "lmcache: clear(force=%s) removed %" PRIu64 " objects",
            force ? "true" : "false", removed);
    return 0;
}

/* Whether a ping of the unknown worker `id` is the first since it was last answered: false
 * then, true for the next one (the pair is what makes LMCache's adapter register again). */
static bool s_told_first(kvt_lmcache_door_t *self, uint64_t id)
{
    s_told_t *t = kvt_u64map_remove(self->told, id);
    if (t) {
        free(t);
        return false;
    }
    if (kvt_u64map_size(self->told) >= S_MAX_TOLD)
        return false; /* bounded: such a worker only waits for an entry to expire */
    t = malloc(sizeof *t);
    kvt_assert(t);
    *t = (s_told_t){id, kvt_now_ms()};
    kvt_u64map_set(self->told, id, t);
    return true;
}

/* ping: ([instance_id | None]). True for the scheduler's probe (nil) and a registered worker.
 * For a worker this daemon does not know (never registered, unregistered, reaped, or not
 * restored after a restart) false, then true on its next ping: LMCache's adapter (its
 * HeartbeatThread) takes an unhealthy ping into degraded mode, where it sends no stores and
 * fails its loads (nothing is silently lost), and registers its KV caches again when a ping
 * is healthy after an unhealthy one. Always false would keep it degraded for good. */
static int s_do_ping(kvt_lmcache_door_t *self, kvt_lmc_op_t op, const s_args_t *a, s_answer_t *r,
                     char *why, size_t whylen)
{
    (void)op;
    uint64_t u = 0;
    bool nil = true;
    int rc = a->n ? kvt_lmc_decode_int(S_ARG(0), true, &u, &nil, why, whylen) : 0;
    if (rc)
        return rc;
    s_ctx_t *c = nil ? NULL : kvt_u64map_get(self->ctxs, u);
    bool healthy = true;
    if (c && s_ctx_mine(self, c, "ping")) { /* another connection's ping renews nothing */
        c->last_seen_ms = kvt_now_ms();
    } else if (!nil && !c) {
        atomic_fetch_add(&self->unknown_worker, 1);
        healthy = !s_told_first(self, u);
        if (!healthy)
            kvt_errrep_report(&s_rep_worker, KVT_LOG_WARN,
                              "lmcache: ping from instance %" PRId64 ", which is not "
                              "registered: answered false once, so that the worker registers "
                              "again",
                              (int64_t)u);
    }
    healthy ? msgpack_pack_true(s_value(r)) : msgpack_pack_false(s_value(r));
    return 0;
}

/* report_block_allocation: (instance_id, model_name, records): checked, counts as a sign of
 * life; kvtier keeps no block tables. */
static int s_do_report(kvt_lmcache_door_t *self, kvt_lmc_op_t op, const s_args_t *a, s_answer_t *r,
                       char *why, size_t whylen)
{
    (void)op, (void)r;
    char model[KVT_LMC_MAX_REQUEST + 1];
    uint64_t u = 0;
    bool nil = false;
    int rc = kvt_lmc_decode_int(S_ARG(0), false, &u, &nil, why, whylen);
    if (!rc)
        rc = kvt_lmc_decode_str(S_ARG(1), model, sizeof model, why, whylen);
    if (!rc)
        rc = kvt_lmc_check_records(S_ARG(2), &self->lim, why, whylen);
    s_ctx_t *c = rc ? NULL : kvt_u64map_get(self->ctxs, u);
    if (c && s_ctx_mine(self, c, "report_block_allocation"))
        c->last_seen_ms = kvt_now_ms();
    return rc;
}

/* poll_kv_events: (model_name, cursor, max_events); an argument that does not decode is named. */
static int s_do_poll(kvt_lmcache_door_t *self, kvt_lmc_op_t op, const s_args_t *a, s_answer_t *r,
                     char *why, size_t whylen)
{
    (void)op;
    static const char *const names[] = {"model_name", "cursor", "max_events"};
    char model[KVT_LMC_MAX_MODEL + 1];
    uint64_t cursor = 0, max = 0;
    int i = 0;
    int rc = kvt_lmc_decode_str(S_ARG(0), model, sizeof model, why, whylen);
    if (!rc && ++i)
        rc = kvt_lmc_decode_uint(S_ARG(1), INT64_MAX, &cursor, why, whylen);
    if (!rc && ++i)
        rc = kvt_lmc_decode_uint(S_ARG(2), UINT32_MAX, &max, why, whylen);
    if (rc) {
        char inner[200];
        snprintf(inner, sizeof inner, "%s", why);
        snprintf(why, whylen, "%s: %s", names[i], inner);
        return rc;
    }
    if (max == 0) {
        snprintf(why, whylen, "max_events must be at least 1");
        return KVT_EBADREQ;
    }
    kvt_lmc_events_poll(self->events, model, cursor, (uint32_t)max, s_value(r));
    return 0;
}

/* get_chunk_size, noop, get_experimental: no arguments, a constant answer. get_experimental
 * lists "kv_events" while the event log is on: LMCache's worker then polls poll_kv_events
 * instead of announcing its own stores. */
static int s_do_const(kvt_lmcache_door_t *self, kvt_lmc_op_t op, const s_args_t *a, s_answer_t *r,
                      char *why, size_t whylen)
{
    (void)a, (void)why, (void)whylen;
    if (op == KVT_LMC_GET_CHUNK_SIZE)
        msgpack_pack_uint32(s_value(r), self->chunk);
    else if (op == KVT_LMC_NOOP)
        msgpack_pack_str_with_body(s_value(r), "OK", 2);
    else if (kvt_lmc_events_enabled(self->events)) {
        msgpack_pack_array(s_value(r), 1);
        msgpack_pack_str_with_body(s_value(r), "kv_events", 9);
    } else
        msgpack_pack_array(s_value(r), 0);
    return 0;
}

#undef S_ARG

/* The handler of every op the wire table (protocol/kvt_lmc.h) marks served; kvt_lmcache_door_new
 * checks that the two agree. */
static const s_op_fn s_ops[KVT_LMC_NOPS] = {
    [KVT_LMC_LOOKUP] = s_do_lookup,
    [KVT_LMC_FREE_LOOKUP_LOCKS] = s_do_lookup,
    [KVT_LMC_QUERY_PREFETCH_STATUS] = s_do_status,
    [KVT_LMC_QUERY_PREFETCH_LOOKUP_HITS] = s_do_status,
    [KVT_LMC_WAIT_PREFETCH_STATUS] = s_do_wait,
    [KVT_LMC_END_SESSION] = s_do_end_session,
    [KVT_LMC_REGISTER_CONTEXT] = s_do_register,
    [KVT_LMC_UNREGISTER_CONTEXT] = s_do_unregister,
    [KVT_LMC_PREPARE_STORE] = s_do_transfer,
    [KVT_LMC_COMMIT_STORE] = s_do_transfer,
    [KVT_LMC_PREPARE_RETRIEVE] = s_do_transfer,
    [KVT_LMC_COMMIT_RETRIEVE] = s_do_transfer,
    [KVT_LMC_CLEAR] = s_do_clear,
    [KVT_LMC_GET_CHUNK_SIZE] = s_do_const,
    [KVT_LMC_PING] = s_do_ping,
    [KVT_LMC_REPORT_BLOCK_ALLOCATION] = s_do_report,
    [KVT_LMC_NOOP] = s_do_const,
    [KVT_LMC_GET_EXPERIMENTAL] = s_do_const,
    [KVT_LMC_POLL_KV_EVENTS] = s_do_poll,
    [KVT_LMC_ABORT_STORE] = s_do_transfer,
};

/* A served op with its argument count checked: its handler, and the error form for what its
 * arguments do not decode to. Lock held. */
static void s_dispatch(kvt_lmcache_door_t *self, kvt_lmc_op_t op, zmq_msg_t *f, int nargs,
                       s_answer_t *r)
{
    char why[200] = "";
    s_args_t a = {f + 3, nargs};
    int rc = s_ops[op](self, op, &a, r, why, sizeof why);
    if (rc != 0)
        s_error(r, rc == KVT_ETOOBIG ? KVT_ETOOBIG : KVT_EBADREQ, "%s: %s",
                kvt_lmc_opinfo(op)->name, why);
}

/* Holds a wait_prefetch_status reply back (the frames move into the waiter). */
static void s_wait_add(kvt_lmcache_door_t *self, zmq_msg_t *f, const char *rid, double seconds)
{
    s_wait_t *w = calloc(1, sizeof *w);
    kvt_assert(w);
    for (int i = 0; i < 3; i++) {
        zmq_msg_init(&w->head[i]);
        zmq_msg_move(&w->head[i], &f[i]);
    }
    w->request_id = strdup(rid);
    kvt_assert(w->request_id);
    w->conn = self->cur ? kvt_conn_ref(self->cur) : NULL;
    w->deadline_ms = kvt_now_ms() + (uint64_t)(seconds * 1000.0);
    w->next = self->waits;
    self->waits = w;
    self->nwaits++;
}

/* Answers the waiters whose lookup finished (or vanished) or whose time is up. */
static void s_waits_run(kvt_lmcache_door_t *self, bool all)
{
    uint64_t now = kvt_now_ms();
    for (s_wait_t **pp = &self->waits; *pp;) {
        s_wait_t *w = *pp;
        s_req_t *q = s_req_find(self, w->request_id);
        bool ready = !q || !q->pending;
        if (!ready && !all && now < w->deadline_ms) {
            pp = &w->next;
            continue;
        }
        s_answer_t r;
        s_answer_init(&r);
        if (ready)
            s_op_status(self, w->request_id, true, &r);
        else
            r.kind = S_R_NONE; /* timed out: None, as the reference answers */
        kvt_conn_t *cur = self->cur;
        self->cur = w->conn;
        s_send(self, w->head, &r);
        self->cur = cur;
        msgpack_sbuffer_destroy(&r.sbuf);
        *pp = w->next;
        for (int i = 0; i < 3; i++)
            zmq_msg_close(&w->head[i]);
        kvt_conn_unref(&w->conn);
        free(w->request_id);
        free(w);
        self->nwaits--;
    }
}

/* One message: frames f[0..n) (identity, uid, op, arguments). */
static void s_message(kvt_lmcache_door_t *self, zmq_msg_t *f, int n, bool too_many)
{
    if (n < 3) {
        kvt_errrep_report(&s_rep_bad, KVT_LOG_WARN,
                          "lmcache: a message of %d frames (uid and op are needed) dropped", n - 1);
        atomic_fetch_add(&self->requests[0], 1);
        atomic_fetch_add(&self->errors[kvt_err_wire_index(KVT_EBADREQ)], 1);
        return;
    }
    if (zmq_msg_size(&f[2]) == 0)
        return; /* a stream-control frame (ack, cancel): never answered */
    int fd = zmq_msg_get(&f[n - 1], ZMQ_SRCFD);
    self->cur = kvt_sessions_conn(self->conns, zmq_msg_data(&f[0]), zmq_msg_size(&f[0]), fd,
                                  fd >= 0 ? kvt_accept_generation(fd) : 0, kvt_now_ms());
    char name[64];
    kvt_lmc_op_t op = kvt_lmc_op_decode(zmq_msg_data(&f[2]), zmq_msg_size(&f[2]), name,
                                        sizeof name);
    const kvt_lmc_opinfo_t *info = kvt_lmc_opinfo(op);
    atomic_fetch_add(&self->requests[info ? (int)op : 0], 1);
    s_answer_t r;
    s_answer_init(&r);
    int nargs = n - 3;
    if (!info) {
        kvt_errrep_report(&s_rep_unknown, KVT_LOG_WARN,
                          "lmcache: unknown operation %s refused", name);
        s_error(&r, KVT_EUNKTYPE, "unknown operation %s", name);
    } else if (!info->served) {
        if (!self->refused_logged[op]) {
            self->refused_logged[op] = true;
            kvt_log(KVT_LOG_WARN,
                    "lmcache: operation %s refused: kvtier serves the engine-driven shared-memory "
                    "path only (lmcache.mp.mp_transfer_mode = engine_driven)",
                    info->name);
        }
        s_error(&r, KVT_EUNKTYPE,
                "operation %s is not served by kvtier (engine-driven shared-memory mode only)",
                info->name);
    } else if (too_many || nargs < info->min_args || nargs > info->max_args) {
        s_error(&r, KVT_EBADREQ, "%s: %s%d argument frames, expected %d to %d", info->name,
                too_many ? "more than " : "", nargs, info->min_args, info->max_args);
    } else {
        pthread_mutex_lock(&self->lock);
        s_dispatch(self, op, f, nargs, &r);
        if (r.kind == S_R_LATER)
            s_wait_add(self, f, r.msg, r.wait_s);
        pthread_mutex_unlock(&self->lock);
    }
    if (r.kind == S_R_ERROR) {
        atomic_fetch_add(&self->errors[kvt_err_wire_index(r.code)], 1);
        if (r.code != KVT_EUNKTYPE)
            kvt_errrep_report(&s_rep_bad, KVT_LOG_WARN, "lmcache: %s", r.msg);
    }
    if (r.kind != S_R_LATER)
        s_send(self, f, &r);
    msgpack_sbuffer_destroy(&r.sbuf);
    kvt_conn_unref(&self->cur);
}

/* The frames of one message: at most S_MAX_FRAMES kept, the rest read and dropped. */
typedef struct {
    zmq_msg_t f[S_MAX_FRAMES];
    int n;
    bool too_many;
} s_frames_t;

static zmq_msg_t *s_frame_slot(void *ctx, uint32_t n)
{
    s_frames_t *fr = ctx;
    if (n < S_MAX_FRAMES) {
        fr->n = (int)n + 1;
        return &fr->f[n];
    }
    fr->too_many = true;
    return NULL;
}

/* Reads and answers one message; false when none is waiting. */
static bool s_recv_one(kvt_lmcache_door_t *self)
{
    s_frames_t fr = {.n = 0};
    kvt_router_msg_t m;
    int rc = kvt_router_recv(self->router, s_frame_slot, &fr, &m);
    if (rc == 1)
        s_message(self, fr.f, fr.n, fr.too_many);
    for (int i = 0; i < fr.n; i++)
        zmq_msg_close(&fr.f[i]);
    return rc == 1;
}

/* ---- periodic ----------------------------------------------------------------------------- */

/* The cache service's liveness rule for each worker; below it, a prepared transfer not
 * committed within lease_ms is void on its own (LMCache has no call that abandons one). */
/* Forgets the unknown workers told false longer ago than S_TOLD_MS (all: every one). */
static void s_told_sweep(kvt_lmcache_door_t *self, uint64_t now, bool all)
{
    size_t n = kvt_u64map_size(self->told), k = 0;
    s_told_t **old = n ? malloc(n * sizeof *old) : NULL;
    kvt_assert(old || !n);
    for (s_told_t *t = old ? kvt_u64map_first(self->told) : NULL; t;
         t = kvt_u64map_next(self->told))
        if (all || now - t->t_ms > S_TOLD_MS)
            old[k++] = t;
    for (size_t i = 0; i < k; i++)
        free(kvt_u64map_remove(self->told, old[i]->id));
    free(old);
}

static void s_sweep(kvt_lmcache_door_t *self, uint64_t now)
{
    uint64_t lease = self->cfg->lease_ms;
    size_t nctx = kvt_u64map_size(self->ctxs), ndrop = 0;
    s_ctx_t **drop = nctx ? calloc(nctx, sizeof *drop) : NULL;
    for (s_ctx_t *c = kvt_u64map_first(self->ctxs); c; c = kvt_u64map_next(self->ctxs)) {
        uint64_t idle = now > c->last_seen_ms ? now - c->last_seen_ms : 0;
        kvt_liveness_t live = kvt_cache_owner_liveness(self->cache, KVT_OWNER_LMCACHE, idle);
        if (live == KVT_OWNER_EXPIRED) {
            drop[ndrop++] = c;
        } else if (live == KVT_OWNER_LEASES_VOID && c->nxfers) {
            kvt_log(KVT_LOG_INFO,
                    "lmcache: instance %" PRId64 " silent for %" PRIu64 " ms: its %u prepared "
                    "transfers are released",
                    (int64_t)c->instance_id, idle, c->nxfers);
            kvt_l1_release_owner(self->l1, c->owner, true); /* the worker stays registered */
            s_xfers_free(c);
        } else {
            for (s_xfer_t **pp = &c->xfers; *pp;) {
                s_xfer_t *x = *pp;
                if (now - x->t_ms <= lease) {
                    pp = &x->next;
                    continue;
                }
                s_xfer_release(self, c, x); /* never committed: discarded */
                *pp = x->next;
                c->nxfers--;
                free(x);
            }
        }
    }
    for (size_t i = 0; i < ndrop; i++) {
        kvt_log(KVT_LOG_INFO, "lmcache: instance %" PRId64 " silent past lmcache.reap_timeout_s: "
                              "its registration is dropped",
                (int64_t)drop[i]->instance_id);
        s_ctx_drop(self, drop[i], true);
    }
    free(drop);
    while (self->oldest && self->oldest->deadline_ms <= now)
        s_req_drop(self, self->oldest);
    kvt_sessions_sweep(self->conns, now); /* cuts connections that stopped reading replies */
    s_askers_sweep(self, now, false);
    s_told_sweep(self, now, false);
}

/* The router saw a client connection close (door thread). */
static void s_on_closed(void *ctx, int fd, uint32_t gen)
{
    kvt_lmcache_door_t *self = ctx;
    kvt_sessions_on_disconnect(self->conns, fd, gen);
}

/* The cache service's lookups that came back. Lock held. */
static void s_collect(kvt_lmcache_door_t *self)
{
    kvt_lookup_t *lk;
    while (kvt_queue_pop(self->lookups_done, (void **)&lk, 0) == 0) {
        kvt_queue_task_done(self->lookups_done, 1);
        s_lookup_back(self, lk);
    }
}

/* How long the poll may sleep: the idle beat, or until the first held reply's deadline. */
static long s_poll_ms(kvt_lmcache_door_t *self, kvt_thread_t *t)
{
    long ms = (long)kvt_thread_idle_ms(t);
    uint64_t now = kvt_now_ms();
    pthread_mutex_lock(&self->lock);
    for (s_wait_t *w = self->waits; w; w = w->next) {
        long left = w->deadline_ms > now ? (long)(w->deadline_ms - now) : 0;
        if (left < ms)
            ms = left;
    }
    pthread_mutex_unlock(&self->lock);
    return ms;
}

static bool s_run(kvt_thread_t *t, void *arg)
{
    kvt_lmcache_door_t *self = arg;
    zmq_pollitem_t items[3] = {{self->sock, 0, ZMQ_POLLIN, 0},
                               {kvt_router_monitor(self->router), 0, ZMQ_POLLIN, 0},
                               {NULL, kvt_queue_fd(self->lookups_done), ZMQ_POLLIN, 0}};
    while (!atomic_load(&self->stop)) {
        if (!kvt_thread_beat(t))
            return false;
        if (zmq_poll(items, 3, s_poll_ms(self, t)) < 0 && errno != EINTR) {
            kvt_log(KVT_LOG_ERROR, "lmcache: poll failed: %s", zmq_strerror(errno));
            return false;
        }
        kvt_router_events(self->router);
        pthread_mutex_lock(&self->lock);
        s_collect(self); /* before the messages: a status query then sees the loads done */
        pthread_mutex_unlock(&self->lock);
        for (int i = 0; i < 256 && s_recv_one(self); i++)
            if (i % 16 == 15 && !kvt_thread_beat(t))
                return false;
        uint64_t now = kvt_now_ms();
        pthread_mutex_lock(&self->lock);
        if (self->nwaits)
            s_waits_run(self, false);
        if (now >= self->next_sweep_ms) {
            self->next_sweep_ms = now + S_SWEEP_MS;
            s_sweep(self, now);
        }
        pthread_mutex_unlock(&self->lock);
    }
    return true;
}

/* ---- life cycle --------------------------------------------------------------------------- */

kvt_lmcache_door_t *kvt_lmcache_door_new(const kvt_config_t *cfg, kvt_sup_t *sup,
                                         kvt_cache_t *cache, char *err, size_t errlen)
{
    kvt_l1_t *l1 = kvt_cache_l1(cache);
    const char *path = kvt_l1_shm_path(l1);
    const char *dir = "/dev/shm/";
    if (strncmp(path, dir, strlen(dir)) != 0 || strchr(path + strlen(dir), '/')) {
        snprintf(err, errlen, "lmcache.listen: the L1 arena %s is not a POSIX shared-memory "
                              "object, which the LMCache client opens by name",
                 path);
        return NULL;
    }
    for (int op = 1; op < KVT_LMC_NOPS; op++) /* the wire table and the handlers agree */
        kvt_assert(!kvt_lmc_opinfo((kvt_lmc_op_t)op)->served == !s_ops[op]);
    kvt_lmcache_door_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->cfg = cfg;
    self->cache = cache;
    self->l1 = l1;
    snprintf(self->shm_name, sizeof self->shm_name, "%s", path + strlen(dir));
    self->pool_size = kvt_l1_capacity(l1);
    self->chunk = cfg->chunk_tokens;
    self->events = kvt_lmc_events_new(kvt_cache_evlog(cache), self->chunk);
    uint64_t tokens = (uint64_t)cfg->max_keys * cfg->chunk_tokens;
    self->lim.max_tokens = tokens > UINT32_MAX ? UINT32_MAX : (uint32_t)tokens;
    self->lim.max_items = self->lim.max_tokens + 2u * cfg->max_keys + 4096u;
    pthread_mutex_init(&self->lock, NULL);
    self->ctxs = kvt_u64map_new();
    self->reqs = kvt_u64map_new();
    self->askers = kvt_u64map_new();
    self->told = kvt_u64map_new();
    kvt_assert(self->ctxs && self->reqs && self->askers && self->told);
    /* connections as v1 has them: the same cuts for replies left unread (issue 28, item 8) */
    kvt_session_limits_t slim = {.lease_ms = cfg->lease_ms,
                                 .max_instances_per_conn = 1,
                                 .reply_timeout_ms = cfg->reply_timeout_ms,
                                 .max_reply_backlog = cfg->max_reply_backlog};
    self->conns = kvt_sessions_new(&slim, NULL, NULL, NULL);
    if (s_registry_open(self, path, err, errlen) != 0)
        goto fail;
    if (getrandom(&self->seed, sizeof self->seed, 0) != sizeof self->seed)
        self->seed = kvt_now_ns() ^ (uint64_t)getpid();
    char qerr[160];
    /* bounded by the lookups out: S_MAX_PENDING requests of at most KVT_LMC_MAX_WORLD each */
    self->lookups_done = kvt_queue_new(KVT_QUEUE_BOUNDED_BY_CALLER, KVT_QUEUE_FD, qerr,
                                       sizeof qerr);
    if (!self->lookups_done) {
        snprintf(err, errlen, "lmcache.listen: %s", qerr);
        goto fail;
    }
    const char *ep = cfg->lmcache_listen;
    kvt_router_opts_t ropts = {.label = "lmcache.listen",
                               .sndhwm = S_SNDHWM,
                               .linger_ms = 500,
                               .max_message = cfg->max_message,
                               .on_closed = s_on_closed,
                               .ctx = self};
    self->router = kvt_router_new(&ropts, err, errlen);
    if (!self->router || kvt_router_bind(self->router, cfg, ep, err, errlen) != 0)
        goto fail;
    self->sock = kvt_router_socket(self->router);
    self->thread = kvt_thread_start(sup, "lmcache", 2000, s_run, self);
    if (!self->thread) {
        snprintf(err, errlen, "lmcache.listen: cannot start the door's thread");
        goto fail;
    }
    kvt_log(KVT_LOG_INFO,
            "lmcache: LMCache-compatible endpoint on %s (arena %s, %" PRIu64 " bytes, "
            "chunk_tokens %u)%s",
            ep, self->shm_name, self->pool_size, self->chunk,
            strncmp(ep, "tcp://", 6) == 0 ? ": plain tcp, every local user can use it" : "");
    return self;
fail:
    kvt_lmcache_door_destroy(&self);
    return NULL;
}

void kvt_lmcache_door_destroy(kvt_lmcache_door_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_lmcache_door_t *self = *self_p;
    atomic_store(&self->stop, true);
    kvt_thread_join(&self->thread);
    pthread_mutex_lock(&self->lock);
    s_waits_run(self, true);
    while (self->oldest)
        s_req_drop(self, self->oldest);
    /* lookups still out: a wait for loads is called off, a probe is waited for (it comes back
     * within l2_lookup_timeout_ms; kvt_cache_quiesce made queued ones come back at once) */
    while (self->orphans) {
        for (s_req_t *q = self->orphans, *next; q; q = next) {
            next = q->newer;
            for (uint32_t l = 0; l < q->lanes; l++) {
                if (!kvt_cache_lookup_cancel(self->cache, &q->lks[l]))
                    continue;
                bool last = q->out == 1;
                s_lookup_back(self, &q->lks[l]); /* it will not come back: count it */
                if (last)
                    break; /* q is freed */
            }
        }
        s_collect(self);
        if (self->orphans) {
            pthread_mutex_unlock(&self->lock);
            zmq_pollitem_t item = {NULL, kvt_queue_fd(self->lookups_done), ZMQ_POLLIN, 0};
            zmq_poll(&item, 1, 10);
            pthread_mutex_lock(&self->lock);
        }
    }
    kvt_lmc_registry_destroy(&self->registry); /* what is registered stays in its file */
    for (s_ctx_t *c; self->ctxs && (c = kvt_u64map_first(self->ctxs));)
        s_ctx_drop(self, c, false);
    while (self->askers && kvt_u64map_size(self->askers))
        s_askers_sweep(self, kvt_now_ms(), true);
    pthread_mutex_unlock(&self->lock);
    kvt_router_destroy(&self->router); /* its ipc file goes with it */
    kvt_u64map_destroy(&self->ctxs);
    kvt_u64map_destroy(&self->reqs);
    kvt_u64map_destroy(&self->askers);
    if (self->told)
        s_told_sweep(self, 0, true);
    kvt_u64map_destroy(&self->told);
    kvt_sessions_destroy(&self->conns); /* replies still in libzmq hold their connections */
    kvt_queue_destroy(&self->lookups_done);
    kvt_lmc_events_destroy(&self->events);
    pthread_mutex_destroy(&self->lock);
    free(self);
    *self_p = NULL;
}

/* ---- operations --------------------------------------------------------------------------- */

/* What /status shows for a worker instead of its instance_id, the only credential LMCache's
 * wire has: 12 hex digits of a keyed hash, enough to tell workers apart, useless to act. */
static const char *s_worker_digest(const kvt_lmcache_door_t *self, uint64_t id, char *out)
{
    snprintf(out, 13, "%012" PRIx64,
             XXH3_64bits_withSeed(&id, sizeof id, self->seed ^ 0x5f3759df) >> 16);
    return out;
}

json_t *kvt_lmcache_door_status_json(kvt_lmcache_door_t *self)
{
    uint64_t now = kvt_now_ms();
    char digest[13];
    json_t *list = json_array();
    pthread_mutex_lock(&self->lock);
    size_t total = kvt_u64map_size(self->ctxs), shown = 0;
    for (s_ctx_t *c = kvt_u64map_first(self->ctxs); c && shown < S_STATUS_MAX;
         c = kvt_u64map_next(self->ctxs), shown++) {
        json_t *shape = json_array(), *groups = json_array();
        for (uint32_t i = 0; i < c->ndim; i++)
            json_array_append_new(shape, json_integer((json_int_t)c->shape[i]));
        for (uint32_t g = 0; g < c->nog; g++)
            json_array_append_new(groups, json_integer((json_int_t)c->og_size[g]));
        json_array_append_new(
            list,
            json_pack("{s:s,s:s,s:i,s:i,s:I,s:s,s:b,s:o,s:I,s:o,s:I,s:i,s:I,s:b}", "worker",
                      s_worker_digest(self, c->instance_id, digest), "model_name", c->model,
                      "world_size", (int)c->world_size, "num_layers", (int)c->num_layers,
                      "hidden_dim_size", (json_int_t)c->hidden, "dtype", c->dtype, "use_mla",
                      c->use_mla, "slot_shape", shape, "chunk_bytes", (json_int_t)c->obj_size,
                      "object_group_bytes", groups,
                      "idle_ms", (json_int_t)(now - c->last_seen_ms), "prepared_transfers",
                      (int)c->nxfers, "leased_bytes",
                      (json_int_t)kvt_l1_owner_bytes(self->l1, c->owner), "restored", c->restored));
    }
    json_t *st = json_pack("{s:s,s:s,s:I,s:i,s:o,s:I,s:I,s:I,s:I}", "endpoint",
                           self->cfg->lmcache_listen, "shm_name", self->shm_name, "pool_size",
                           (json_int_t)self->pool_size, "chunk_tokens", (int)self->chunk,
                           "contexts", list, "contexts_total", (json_int_t)total,
                           "requests_tracked", (json_int_t)kvt_u64map_size(self->reqs),
                           "lookups_loading", (json_int_t)self->npending, "lookup_locks",
                           (json_int_t)self->lookup_locks);
    json_object_set_new(st, "registry",
                        json_pack("{s:s,s:I,s:b,s:i,s:I}", "file", KVT_LMC_REGISTRY_FILE, "kept",
                                  (json_int_t)kvt_lmc_registry_size(self->registry), "ok",
                                  kvt_lmc_registry_ok(self->registry), "restored",
                                  (int)self->restored, "unknown_worker_requests",
                                  (json_int_t)atomic_load(&self->unknown_worker)));
    pthread_mutex_unlock(&self->lock);
    return st;
}

void kvt_lmcache_door_metrics_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    kvt_lmcache_door_t *self = ctx;
    kvt_sample_t s = {.name = "lmcache_requests_total",
                      .help = "Requests on the LMCache-compatible endpoint, by operation",
                      .kind = KVT_METRIC_COUNTER,
                      .label = "op"};
    for (int op = 1; op < KVT_LMC_NOPS; op++) {
        const kvt_lmc_opinfo_t *info = kvt_lmc_opinfo((kvt_lmc_op_t)op);
        s.label_value = info->name;
        s.value = (double)atomic_load(&self->requests[op]);
        emit(emit_ctx, &s);
    }
    s.label_value = "unknown";
    s.value = (double)atomic_load(&self->requests[0]);
    emit(emit_ctx, &s);
    s = (kvt_sample_t){.name = "lmcache_errors_total",
                       .help = "Error replies of the LMCache-compatible endpoint, by type",
                       .kind = KVT_METRIC_COUNTER,
                       .label = "type"};
    for (int i = 0; i < KVT_WIRE_ERRORS; i++) {
        s.label_value = kvt_err_wire_name(i);
        s.value = (double)atomic_load(&self->errors[i]);
        emit(emit_ctx, &s);
    }
    /* counts kept in atomics: STATS runs this on the v1 server loop, which must never wait
     * for the door */
    double contexts = (double)atomic_load(&self->nctxs);
    double tracked = (double)atomic_load(&self->nreqs);
    emit(emit_ctx, &(kvt_sample_t){.name = "lmcache_contexts",
                                   .help = "LMCache workers registered (engine-driven contexts)",
                                   .kind = KVT_METRIC_GAUGE,
                                   .value = contexts});
    emit(emit_ctx, &(kvt_sample_t){.name = "lmcache_requests_tracked",
                                   .help = "LMCache requests whose lookup state is kept",
                                   .kind = KVT_METRIC_GAUGE,
                                   .value = tracked});
    emit(emit_ctx, &(kvt_sample_t){.name = "lmcache_lookup_chunks_total",
                                   .help = "Chunks LMCache lookups asked for",
                                   .kind = KVT_METRIC_COUNTER,
                                   .value = (double)atomic_load(&self->lookup_chunks)});
    emit(emit_ctx, &(kvt_sample_t){.name = "lmcache_lookup_hit_chunks_total",
                                   .help = "Chunks LMCache lookups found for every worker",
                                   .kind = KVT_METRIC_COUNTER,
                                   .value = (double)atomic_load(&self->hit_chunks)});
    emit(emit_ctx, &(kvt_sample_t){.name = "lmcache_unknown_worker_requests_total",
                                   .help = "LMCache transfers from a worker that is not "
                                           "registered (never, unregistered or reaped)",
                                   .kind = KVT_METRIC_COUNTER,
                                   .value = (double)atomic_load(&self->unknown_worker)});
    emit(emit_ctx, &(kvt_sample_t){.name = "lmcache_replies_dropped_total",
                                   .help = "LMCache replies dropped: client gone or not reading",
                                   .kind = KVT_METRIC_COUNTER,
                                   .value = (double)atomic_load(&self->dropped)});
    kvt_lmc_events_metrics_source(self->events, emit, emit_ctx);
}
