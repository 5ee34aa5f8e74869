/* DESIGN: one function per request type, picked from s_handlers[] by wire id. A handler reads
 * the decoded body (rq->req), calls the modules in rq->svc and packs its ok body into rq->pk;
 * on failure it returns a KVT_E* code with a sentence in rq->err and packs nothing. Handlers of
 * WORKER types (PUT, CLEAR and the GPU requests) may run on any worker thread at the same time
 * as each other and as the server thread's handlers: they only use thread-safe modules.
 *
 * Types of run class INLINE_THEN_LOOKUP (LOOKUP) also have a row in s_staged[]: whether the
 * inline part left work to the cache service (its L2 part, on the service's lookup threads),
 * and the answer packed once the service handed the request back. The request's typed state
 * (rq->lookup) is the service's kvt_lookup_t. */
#include "kvt_handlers.h"

#include "kvt_error.h"
#include "kvt_hash.h"
#include "kvt_log.h"
#include "kvt_proto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*s_handler_fn)(kvt_rq_t *c);

/* ---- handlers ---- */

static char *s_cstr(const kvt_bytes_t *b)
{
    char *s = malloc(b->len + 1u);
    kvt_assert(s);
    memcpy(s, b->ptr, b->len);
    s[b->len] = '\0';
    return s;
}

static int s_hello(kvt_rq_t *c)
{
    const kvt_config_t *cfg = c->svc->cfg;
    if (c->req.version != KVT_PROTO_VERSION) {
        snprintf(c->err, sizeof c->err, "server speaks protocol version %d, client asked for %llu",
                 KVT_PROTO_VERSION, (unsigned long long)c->req.version);
        return KVT_EVERSION;
    }
    if (memchr(c->req.instance.ptr, 0, c->req.instance.len) ||
        memchr(c->req.client.ptr, 0, c->req.client.len) ||
        (c->req.token.len && memchr(c->req.token.ptr, 0, c->req.token.len))) {
        snprintf(c->err, sizeof c->err,
                 "'client', 'instance' and 'token' must not contain NUL bytes");
        return KVT_EBADREQ;
    }
    char *instance = s_cstr(&c->req.instance), *client = s_cstr(&c->req.client);
    char *token = (c->req.present & KVT_F_TOKEN) ? s_cstr(&c->req.token) : NULL;
    char issued[KVT_TOKEN_HEX + 1];
    bool created = false;
    int rc = kvt_sessions_hello(c->svc->sessions, c->conn, instance, client, token, kvt_now_ms(),
                                &c->owner, issued, &created, c->err, sizeof c->err);
    if (rc == 0 && created)
        kvt_log(KVT_LOG_INFO, "client %s (instance %s) connected", client, instance);
    free(instance);
    free(client);
    free(token);
    if (rc)
        return rc;
    /* a client that mapped the arena may ask for a ring pair; none free: it stays on ZMQ */
    kvt_fastpath_offer_t offer;
    bool offered = (c->req.present & KVT_F_FASTPATH) && c->req.fastpath && c->svc->fastpath &&
                   c->conn && (c->ring.slot || kvt_fastpath_local(kvt_conn_fd(c->conn))) &&
                   kvt_fastpath_open(c->svc->fastpath, c->conn, c->owner,
                                     (c->req.present & KVT_F_RESIDENT) && c->req.resident,
                                     &offer) == 0;
    msgpack_packer *pk = &c->pk;
    kvt_pack_ok(pk, offered ? 8 : 7);
    kvt_pack_str(pk, "shm");
    msgpack_pack_map(pk, 4);
    kvt_pack_str(pk, "path");
    kvt_pack_str(pk, kvt_l1_shm_path(c->svc->l1));
    kvt_pack_str(pk, "size");
    msgpack_pack_uint64(pk, kvt_l1_capacity(c->svc->l1));
    kvt_pack_str(pk, "map_size");
    msgpack_pack_uint64(pk, kvt_l1_map_size(c->svc->l1));
    kvt_pack_str(pk, "page_size");
    msgpack_pack_uint64(pk, kvt_l1_page_size(c->svc->l1));
    if (offered) {
        kvt_pack_str(pk, "fastpath");
        msgpack_pack_map(pk, offer.resident ? 7 : 6);
        kvt_pack_str(pk, "socket");
        kvt_pack_str(pk, offer.socket);
        kvt_pack_str(pk, "ticket");
        kvt_pack_str(pk, offer.ticket);
        kvt_pack_str(pk, "size");
        msgpack_pack_uint64(pk, offer.size);
        kvt_pack_str(pk, "request");
        msgpack_pack_uint64(pk, offer.request);
        kvt_pack_str(pk, "reply");
        msgpack_pack_uint64(pk, offer.reply);
        kvt_pack_str(pk, "capacity");
        msgpack_pack_uint32(pk, offer.capacity);
        if (offer.resident) {
            kvt_pack_str(pk, "resident");
            msgpack_pack_uint64(pk, offer.resident);
        }
    }
    kvt_pack_str(pk, "version");
    msgpack_pack_uint32(pk, KVT_PROTO_VERSION);
    kvt_pack_str(pk, "server");
    kvt_pack_str(pk, "kvtier " KVT_VERSION);
    kvt_pack_str(pk, "chunk_tokens");
    msgpack_pack_uint32(pk, cfg->chunk_tokens);
    kvt_pack_str(pk, "lease_ms");
    msgpack_pack_uint32(pk, cfg->lease_ms);
    kvt_pack_str(pk, "max_message");
    msgpack_pack_uint64(pk, cfg->max_message);
    kvt_pack_str(pk, "token");
    kvt_pack_str(pk, issued);
    return 0;
}

static int s_bye(kvt_rq_t *c)
{
    char *instance = s_cstr(&c->req.instance);
    uint64_t released = 0;
    int rc =
        kvt_sessions_bye(c->svc->sessions, c->conn, instance, &released, c->err, sizeof c->err);
    if (rc == 0)
        kvt_log(KVT_LOG_INFO, "client instance %s said bye", instance);
    free(instance);
    if (rc)
        return rc;
    kvt_pack_ok(&c->pk, 1);
    kvt_pack_str(&c->pk, "released");
    msgpack_pack_uint64(&c->pk, released);
    return 0;
}

/* PING renews the connection's instances (every request does); with `instance` it also
 * checks that the connection still acts for it, which is how a heartbeat learns of a drop. */
static int s_ping(kvt_rq_t *c)
{
    if (c->req.present & KVT_F_INSTANCE) {
        char *instance = s_cstr(&c->req.instance);
        int rc = kvt_sessions_check(c->svc->sessions, c->conn, instance, c->err, sizeof c->err);
        free(instance);
        if (rc)
            return rc;
    }
    kvt_pack_ok(&c->pk, 0);
    return 0;
}

static void s_pack_json(msgpack_packer *pk, const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        const char *k;
        json_t *e;
        msgpack_pack_map(pk, json_object_size(v));
        json_object_foreach((json_t *)v, k, e)
        {
            kvt_pack_str(pk, k);
            s_pack_json(pk, e);
        }
        break;
    }
    case JSON_ARRAY: {
        size_t i;
        json_t *e;
        msgpack_pack_array(pk, json_array_size(v));
        json_array_foreach(v, i, e) s_pack_json(pk, e);
        break;
    }
    case JSON_STRING:
        kvt_pack_strn(pk, json_string_value(v), json_string_length(v));
        break;
    case JSON_INTEGER:
        msgpack_pack_int64(pk, json_integer_value(v));
        break;
    case JSON_REAL:
        msgpack_pack_double(pk, json_real_value(v));
        break;
    case JSON_TRUE:
        msgpack_pack_true(pk);
        break;
    case JSON_FALSE:
        msgpack_pack_false(pk);
        break;
    case JSON_NULL:
        msgpack_pack_nil(pk);
        break;
    }
}

static int s_stats(kvt_rq_t *c)
{
    json_t *m = kvt_metrics_json(c->svc->metrics);
    kvt_pack_ok(&c->pk, (uint32_t)json_object_size(m));
    const char *k;
    json_t *e;
    json_object_foreach(m, k, e)
    {
        kvt_pack_str(&c->pk, k);
        s_pack_json(&c->pk, e);
    }
    json_decref(m);
    return 0;
}

/* ---- L1 requests ---- */

/* Requests that take a lease need an owner: the instance this connection said HELLO as.
 * Without one the answer is instance_dropped, which tells a client to say HELLO again. */
static int s_need_owner(kvt_rq_t *c)
{
    if (c->owner)
        return 0;
    kvt_conn_why_no_instance(c->conn, kvt_proto_name(c->req.type), c->err, sizeof c->err);
    return KVT_ENOINST;
}

static void s_pack_slots(msgpack_packer *pk, const kvt_slot_t *slots, uint32_t n)
{
    kvt_pack_str(pk, "slots");
    msgpack_pack_array(pk, n);
    for (uint32_t i = 0; i < n; i++) {
        if (slots[i].length == 0) {
            msgpack_pack_nil(pk);
            continue;
        }
        msgpack_pack_map(pk, 2);
        kvt_pack_str(pk, "offset");
        msgpack_pack_uint64(pk, slots[i].offset);
        kvt_pack_str(pk, "length");
        msgpack_pack_uint64(pk, slots[i].length);
    }
}

static void s_pack_uint_field(msgpack_packer *pk, const char *name, uint64_t v)
{
    kvt_pack_str(pk, name);
    msgpack_pack_uint64(pk, v);
}

static kvt_slot_t *s_slots(uint32_t n)
{
    kvt_slot_t *slots = malloc((n ? n : 1) * sizeof *slots);
    kvt_assert(slots);
    return slots;
}

/* RESERVE and ACQUIRE: both take a lease for the leading keys and answer {slots, lease}. */
static int s_slots_request(kvt_rq_t *c, bool reserve)
{
    int rc = s_need_owner(c);
    if (rc)
        return rc;
    const kvt_req_t *r = &c->req;
    kvt_slot_t *slots = s_slots(r->nkeys);
    uint32_t n = 0;
    uint64_t lease = 0;
    if (reserve)
        rc = kvt_l1_reserve_labeled(c->svc->l1, c->owner, &r->ns, r->keys, r->labels, r->nkeys,
                                    (r->present & KVT_F_SIZES) ? r->sizes : NULL, r->size,
                                    slots, &n, &lease, c->err, sizeof c->err);
    else
        rc = kvt_l1_acquire(c->svc->l1, c->owner, &r->ns, r->keys, r->nkeys, slots, &n, &lease);
    if (rc == KVT_ENOSPC && !reserve) /* max_leased_bytes */
        kvt_l1_owner_limit_error(c->svc->l1, c->owner, c->err, sizeof c->err);
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 2);
        s_pack_slots(&c->pk, slots, n);
        s_pack_uint_field(&c->pk, "lease", lease);
    }
    free(slots);
    return rc;
}

static int s_reserve(kvt_rq_t *c)
{
    return s_slots_request(c, true);
}

static int s_commit(kvt_rq_t *c)
{
    uint32_t stored = 0;
    int rc = kvt_l1_commit(c->svc->l1, c->owner, c->req.lease, c->req.failed, c->req.nfailed,
                           &stored, c->err, sizeof c->err);
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 1);
        s_pack_uint_field(&c->pk, "stored", stored);
    }
    return rc;
}

static int s_acquire(kvt_rq_t *c)
{
    return s_slots_request(c, false);
}

static int s_release(kvt_rq_t *c)
{
    int rc = kvt_l1_release(c->svc->l1, c->owner, c->req.lease);
    if (rc == KVT_ELEXPIRED)
        snprintf(c->err, sizeof c->err,
                 "lease %llu expired: its instance was silent for over lease_ms",
                 (unsigned long long)c->req.lease);
    else if (rc)
        snprintf(c->err, sizeof c->err, "no lease %llu held by this instance",
                 (unsigned long long)c->req.lease);
    else
        kvt_pack_ok(&c->pk, 0);
    return rc;
}

static void s_pack_lookup(kvt_rq_t *c)
{
    const kvt_lookup_t *lk = &c->lookup;
    kvt_reqstats_lookup(c->svc->reqstats, c->req.nkeys, lk->l1_hits, lk->hits - lk->l1_hits);
    kvt_pack_ok(&c->pk, 2 + (lk->lease != 0) + (lk->job != 0));
    s_pack_uint_field(&c->pk, "hits", lk->hits);
    s_pack_uint_field(&c->pk, "l1", lk->l1_hits);
    if (lk->lease)
        s_pack_uint_field(&c->pk, "lease", lk->lease);
    if (lk->job)
        s_pack_uint_field(&c->pk, "job", lk->job);
}

/* The cache service's answer (now, or when the lookup came back): packed, or its error. */
static int s_lookup_answer(kvt_rq_t *c)
{
    if (c->lookup.rc) {
        snprintf(c->err, sizeof c->err, "%s: %s", kvt_proto_name(c->type), c->lookup.err);
        return c->lookup.rc;
    }
    s_pack_lookup(c);
    return 0;
}

static bool s_lookup_pending(const kvt_rq_t *c)
{
    return c->lookup_pending;
}

/* The L1 prefix now; keys past it are the cache service's to ask of L2 (its lookup threads),
 * and the lookup comes back through svc->lookups_done. */
static int s_lookup(kvt_rq_t *c)
{
    const kvt_req_t *r = &c->req;
    int rc = r->lock ? s_need_owner(c) : 0;
    if (rc)
        return rc;
    kvt_lookup_t *lk = &c->lookup;
    lk->owner = c->owner;
    lk->ns = r->ns;
    lk->keys = r->keys;
    lk->n = r->nkeys;
    lk->lock = r->lock;
    lk->prefetch = r->prefetch;
    lk->until_loaded = false;
    lk->done = c->svc->lookups_done;
    lk->ctx = c;
    if (kvt_cache_lookup(c->svc->cache, lk)) {
        c->lookup_pending = true; /* nothing is packed yet */
        return 0;
    }
    if (lk->rc == KVT_ENOSPC) { /* max_leased_bytes: the sentence as it is */
        snprintf(c->err, sizeof c->err, "%s", lk->err);
        return lk->rc;
    }
    return s_lookup_answer(c);
}

static int s_remove(kvt_rq_t *c)
{
    const kvt_req_t *r = &c->req;
    uint32_t removed = 0;
    int rc = kvt_l1_remove(c->svc->l1, &r->ns, r->keys, r->nkeys, &removed);
    kvt_l2mgr_remove(kvt_cache_l2(c->svc->cache), &r->ns, r->keys, r->nkeys);
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 1);
        s_pack_uint_field(&c->pk, "removed", removed);
    }
    return rc;
}

static int s_clear(kvt_rq_t *c)
{
    const kvt_req_t *r = &c->req;
    uint64_t removed = 0;
    int rc =
        kvt_l1_clear(c->svc->l1, (r->present & KVT_F_NS) ? r->ns.name : NULL, r->ns.name_len,
                     &removed);
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 1);
        s_pack_uint_field(&c->pk, "removed", removed);
    }
    return rc;
}

static int s_prefetch_status(kvt_rq_t *c)
{
    bool done = false;
    uint32_t loaded = 0, hits = 0;
    if (kvt_prefetch_status(kvt_cache_prefetch(c->svc->cache), c->req.job, &done, &loaded, &hits) != 0) {
        snprintf(c->err, sizeof c->err,
                 "no prefetch job %llu (never started, or finished and swept: after 60 s, or 1 s "
                 "while over half of max_prefetch_jobs are in use)",
                 (unsigned long long)c->req.job);
        return KVT_ENOTFOUND;
    }
    kvt_pack_ok(&c->pk, 3);
    kvt_pack_str(&c->pk, "done");
    if (done)
        msgpack_pack_true(&c->pk);
    else
        msgpack_pack_false(&c->pk);
    s_pack_uint_field(&c->pk, "loaded", loaded);
    s_pack_uint_field(&c->pk, "hits", hits);
    return 0;
}

static int s_hash_tokens(kvt_rq_t *c)
{
    const kvt_req_t *r = &c->req;
    uint64_t chunk =
        (r->present & KVT_F_CHUNK_TOKENS) ? r->chunk_tokens : c->svc->cfg->chunk_tokens;
    if (chunk > UINT32_MAX / 4) {
        snprintf(c->err, sizeof c->err, "'chunk_tokens' %llu is too large",
                 (unsigned long long)chunk);
        return KVT_EBADREQ;
    }
    uint64_t nchunks = r->tokens.len / 4 / chunk;
    if (nchunks > c->svc->cfg->max_keys) {
        snprintf(c->err, sizeof c->err, "%llu chunks: at most max_keys (%u) keys per request",
                 (unsigned long long)nchunks, c->svc->cfg->max_keys);
        return KVT_ETOOBIG;
    }
    uint8_t(*keys)[KVT_HASH_KEY_LEN] = malloc((nchunks ? nchunks : 1) * KVT_HASH_KEY_LEN);
    kvt_assert(keys);
    uint32_t n = kvt_hash_tokens(r->tokens.ptr, r->tokens.len, (uint32_t)chunk, r->ns.salt,
                                 r->ns.salt_len, keys, (uint32_t)nchunks);
    kvt_pack_ok(&c->pk, 1);
    kvt_pack_str(&c->pk, "keys");
    msgpack_pack_array(&c->pk, n);
    for (uint32_t i = 0; i < n; i++) {
        msgpack_pack_bin(&c->pk, KVT_KEY_LEN);
        msgpack_pack_bin_body(&c->pk, keys[i], KVT_KEY_LEN);
    }
    free(keys);
    return 0;
}

/* PUT's fill: each data frame copied into its slot. */
static int s_put_fill(void *ctx, uint8_t *base, const kvt_slot_t *slots, uint32_t n,
                      uint64_t *failed, uint32_t *nfailed, uint64_t *sums, char *err,
                      size_t errlen)
{
    const kvt_rq_t *c = ctx;
    (void)failed, (void)nfailed, (void)sums, (void)err, (void)errlen;
    for (uint32_t i = 0; i < n; i++)
        if (slots[i].length)
            memcpy(base + slots[i].offset, zmq_msg_data(&c->data[i]), slots[i].length);
    return 0;
}

/* PUT (worker thread): the data frames are copied into reserved slots, then committed. */
static int s_put(kvt_rq_t *c)
{
    const kvt_req_t *r = &c->req;
    uint64_t *sizes = malloc((r->nkeys ? r->nkeys : 1) * sizeof *sizes);
    kvt_assert(sizes);
    for (uint32_t i = 0; i < r->nkeys; i++)
        sizes[i] = zmq_msg_size(&c->data[i]);
    uint32_t stored = 0;
    int rc = kvt_l1_write(c->svc->l1, &r->ns, r->keys, r->labels, r->nkeys, sizes, 0, false,
                          s_put_fill, c, &stored, NULL, c->err, sizeof c->err);
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 1);
        s_pack_uint_field(&c->pk, "stored", stored);
    }
    free(sizes);
    return rc;
}

/* GET (server thread): the reply's data frames point into the arena — no copy — pinned under a
 * daemon read lease until libzmq has sent them (the server builds the frames from c->out). A
 * connection that does not read its replies would keep them pinned, so past max_reply_pinned
 * bytes unsent GET answers busy until the earlier replies have left. */
static int s_get(kvt_rq_t *c)
{
    const kvt_req_t *r = &c->req;
    uint64_t pinned = c->conn ? kvt_conn_pinned(c->conn) : 0;
    if (pinned >= c->svc->cfg->max_reply_pinned) {
        snprintf(c->err, sizeof c->err,
                 "get: %llu bytes of earlier GET replies to this connection are not sent yet "
                 "(max_reply_pinned): read them, then retry",
                 (unsigned long long)pinned);
        return KVT_EBUSY;
    }
    kvt_slot_t *slots = s_slots(r->nkeys);
    uint32_t n = 0;
    uint64_t lease = 0;
    int rc = kvt_l1_acquire(c->svc->l1, KVT_OWNER_DAEMON, &r->ns, r->keys, r->nkeys, slots, &n,
                            &lease);
    n = kvt_l1_verify(c->svc->l1, KVT_OWNER_DAEMON, lease, n); /* l1_checksum: no damaged bytes */
    /* a reply stays under max_message: stop before the object that would cross it */
    uint64_t total = 0;
    uint32_t found = 0;
    while (found < n && (found == 0 || total + slots[found].length <= c->svc->cfg->max_message))
        total += slots[found++].length;
    if (rc == 0 && found) {
        c->out = slots;
        c->nout = found;
        c->out_lease = lease;
        slots = NULL;
    } else if (lease) {
        kvt_l1_release(c->svc->l1, KVT_OWNER_DAEMON, lease);
    }
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 1);
        s_pack_uint_field(&c->pk, "found", found);
    }
    free(slots);
    return rc;
}

/* ---- GPU requests (worker threads: they wait for CUDA) ---- */

static int s_register_gpu(kvt_rq_t *c)
{
    int rc = s_need_owner(c);
    if (rc)
        return rc;
    const kvt_req_t *r = &c->req;
    kvt_gpu_reg_args_t args = {
        .device = r->device, .layers = r->layers, .num_blocks = r->num_blocks,
        .block_tokens = r->block_tokens, .token_bytes = r->token_bytes,
        .dtype = r->dtype.ptr, .dtype_len = r->dtype.len,
        .handles = (const uint8_t *)r->handles, .nhandles = r->nhandles,
        .offsets = (r->present & KVT_F_OFFSETS) ? r->offsets : NULL, .noffsets = r->noffsets};
    kvt_gpu_layout_t lay;
    rc = kvt_gpu_register(c->svc->gpu, c->owner, &args, &lay, c->err, sizeof c->err);
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 3);
        s_pack_uint_field(&c->pk, "device", lay.device);
        s_pack_uint_field(&c->pk, "layers", lay.layers);
        s_pack_uint_field(&c->pk, "block_bytes", lay.block_bytes);
    }
    return rc;
}

static int s_unregister_gpu(kvt_rq_t *c)
{
    int rc = s_need_owner(c);
    if (rc == 0)
        rc = kvt_gpu_unregister(c->svc->gpu, c->owner, c->req.device, c->err, sizeof c->err);
    if (rc == 0)
        kvt_pack_ok(&c->pk, 0);
    return rc;
}

/* STORE_GPU's and RETRIEVE_GPU's arguments: the request's keys and block ids, in place. */
static kvt_gpu_copy_args_t s_copy_args(const kvt_req_t *r)
{
    return (kvt_gpu_copy_args_t){
        .device = r->device, .ns = r->ns, .keys = r->keys, .nkeys = r->nkeys,
        .block_ids = r->block_ids, .nblock_ids = r->nblock_ids,
        .event = r->event.len == KVT_IPC_HANDLE_LEN ? r->event.ptr : NULL};
}

static int s_store_gpu(kvt_rq_t *c)
{
    int rc = s_need_owner(c);
    uint32_t stored = 0;
    kvt_gpu_copy_args_t args = s_copy_args(&c->req);
    if (rc == 0)
        rc = kvt_gpu_store(c->svc->gpu, c->owner, &args, &stored, c->err, sizeof c->err);
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 1);
        s_pack_uint_field(&c->pk, "stored", stored);
    }
    return rc;
}

static int s_retrieve_gpu(kvt_rq_t *c)
{
    int rc = s_need_owner(c);
    uint32_t found = 0;
    kvt_gpu_copy_args_t args = s_copy_args(&c->req);
    if (rc == 0)
        rc = kvt_gpu_retrieve(c->svc->gpu, c->owner, &args, &found, c->err, sizeof c->err);
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 1);
        s_pack_uint_field(&c->pk, "found", found);
    }
    return rc;
}

static const s_handler_fn s_handlers[KVT_REQ_SLOTS] = {
    [KVT_REQ_HELLO] = s_hello,
    [KVT_REQ_BYE] = s_bye,
    [KVT_REQ_PING] = s_ping,
    [KVT_REQ_LOOKUP] = s_lookup,
    [KVT_REQ_PREFETCH_STATUS] = s_prefetch_status,
    [KVT_REQ_RESERVE] = s_reserve,
    [KVT_REQ_COMMIT] = s_commit,
    [KVT_REQ_ACQUIRE] = s_acquire,
    [KVT_REQ_RELEASE] = s_release,
    [KVT_REQ_PUT] = s_put,
    [KVT_REQ_GET] = s_get,
    [KVT_REQ_REMOVE] = s_remove,
    [KVT_REQ_CLEAR] = s_clear,
    [KVT_REQ_STATS] = s_stats,
    [KVT_REQ_HASH_TOKENS] = s_hash_tokens,
    [KVT_REQ_REGISTER_GPU] = s_register_gpu,
    [KVT_REQ_UNREGISTER_GPU] = s_unregister_gpu,
    [KVT_REQ_STORE_GPU] = s_store_gpu,
    [KVT_REQ_RETRIEVE_GPU] = s_retrieve_gpu,
};

/* Types of run class INLINE_THEN_LOOKUP: see the DESIGN note. */
typedef struct {
    bool (*pending)(const kvt_rq_t *c);
    s_handler_fn answer; /* server thread, once the cache service handed it back */
} s_staged_t;

static const s_staged_t s_staged[KVT_REQ_SLOTS] = {
    [KVT_REQ_LOOKUP] = {s_lookup_pending, s_lookup_answer},
};

/* The staged row of rq's type: only types of that run class reach here. */
static const s_staged_t *s_staged_of(const kvt_rq_t *rq)
{
    const kvt_req_info_t *info = kvt_proto_info(rq->type);
    kvt_assert(info && info->run == KVT_RUN_INLINE_THEN_LOOKUP && s_staged[rq->type].answer);
    return &s_staged[rq->type];
}

bool kvt_handle_pending(const kvt_rq_t *rq)
{
    return s_staged_of(rq)->pending(rq);
}

int kvt_handle_resume(kvt_rq_t *rq)
{
    return s_staged_of(rq)->answer(rq);
}

int kvt_handle(kvt_rq_t *rq)
{
    s_handler_fn fn = rq->type < KVT_REQ_SLOTS ? s_handlers[rq->type] : NULL;
    if (!fn) {
        snprintf(rq->err, sizeof rq->err, "%s is not available in this version of kvtierd",
                 kvt_proto_name(rq->type));
        return KVT_EUNAVAIL;
    }
    return fn(rq);
}

int kvt_handle_check_frames(kvt_rq_t *rq)
{
    size_t frames = rq->ndata;
    if (rq->type != KVT_REQ_PUT) {
        if (frames == 0)
            return 0;
        snprintf(rq->err, sizeof rq->err, "%s takes no data frames (got %zu)",
                 kvt_proto_name(rq->type), frames);
        return KVT_EBADREQ;
    }
    if (frames != rq->req.nkeys) {
        snprintf(rq->err, sizeof rq->err, "put has %u keys but %zu data frames", rq->req.nkeys,
                 frames);
        return KVT_EBADREQ;
    }
    for (uint32_t i = 0; i < rq->ndata; i++)
        if (zmq_msg_size(&rq->data[i]) == 0) {
            snprintf(rq->err, sizeof rq->err, "put data frame %u is empty", i);
            return KVT_EBADREQ;
        }
    return 0;
}
