/* DESIGN: single-threaded loop on the main thread. zmq_poll on the ROUTER with a 100 ms
 * timeout, then up to S_BATCH messages per wake-up, then the periodic work (supervisor beat,
 * session expiry), so a flood of requests cannot starve the heartbeat. Each message is handled
 * start to finish here; a request owns its frames (zmsg) and its decoded body (a msgpack zone)
 * until the reply is sent, then both are freed in one place (s_handle_message). Replies go out
 * with ZMQ_DONTWAIT and ROUTER_MANDATORY so a client that vanished or stopped reading costs a
 * counter, never a blocked loop. */
#include "kvt_server.h"

#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_msg.h"
#include "kvt_proto.h"
#include "kvt_session.h"

#include <czmq.h>
#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define S_BATCH 256
#define S_POLL_MS 100
#define S_SWEEP_MS 100

struct kvt_server {
    const kvt_config_t *cfg;
    kvt_metrics_t *metrics;
    kvt_sup_thread_t *beat;
    kvt_sessions_t *sessions;
    kvt_l1_t *l1;
    zsock_t *router;
    kvt_limits_t lim;
    uint64_t next_sweep_ms;
    msgpack_sbuffer sbuf;
    int nbound; /* cfg->listen[0..nbound) are bound: their ipc files are ours to remove */
};

/* Everything one request needs while it is handled. */
typedef struct {
    kvt_server_t *srv;
    const zframe_t *rid;
    uint64_t owner; /* session of this connection, 0 before HELLO */
    kvt_req_t req;
    zmsg_t *data; /* the request's data frames */
    msgpack_packer pk;
    char err[200];
} s_ctx_t;

typedef int (*s_handler_fn)(s_ctx_t *c);

static kvt_errrep_t s_rep_bad = KVT_ERRREP_INIT(10000);
static kvt_errrep_t s_rep_send = KVT_ERRREP_INIT(10000);

/* ---- handlers ---- */

static char *s_cstr(const kvt_bytes_t *b)
{
    char *s = malloc(b->len + 1u);
    kvt_assert(s);
    memcpy(s, b->ptr, b->len);
    s[b->len] = '\0';
    return s;
}

static int s_hello(s_ctx_t *c)
{
    const kvt_config_t *cfg = c->srv->cfg;
    if (c->req.version != KVT_PROTO_VERSION) {
        snprintf(c->err, sizeof c->err, "server speaks protocol version %d, client asked for %llu",
                 KVT_PROTO_VERSION, (unsigned long long)c->req.version);
        return KVT_EVERSION;
    }
    if (memchr(c->req.instance.ptr, 0, c->req.instance.len) ||
        memchr(c->req.client.ptr, 0, c->req.client.len)) {
        snprintf(c->err, sizeof c->err, "'client' and 'instance' must not contain NUL bytes");
        return KVT_EBADREQ;
    }
    char *instance = s_cstr(&c->req.instance), *client = s_cstr(&c->req.client);
    bool created = false;
    c->owner = kvt_sessions_hello(c->srv->sessions, zframe_data((zframe_t *)c->rid),
                                  zframe_size((zframe_t *)c->rid), instance, client,
                                  kvt_now_ms(), &created);
    if (created)
        kvt_log(KVT_LOG_INFO, "client %s (instance %s) connected", client, instance);
    free(instance);
    free(client);
    kvt_metrics_set_clients(c->srv->metrics, kvt_sessions_count(c->srv->sessions));
    msgpack_packer *pk = &c->pk;
    kvt_pack_ok(pk, 6);
    kvt_pack_str(pk, "shm");
    msgpack_pack_map(pk, 2);
    kvt_pack_str(pk, "path");
    kvt_pack_str(pk, kvt_l1_shm_path(c->srv->l1));
    kvt_pack_str(pk, "size");
    msgpack_pack_uint64(pk, kvt_l1_capacity(c->srv->l1));
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
    return 0;
}

static int s_bye(s_ctx_t *c)
{
    char *instance = s_cstr(&c->req.instance);
    int64_t released = kvt_sessions_bye(c->srv->sessions, instance);
    if (released >= 0)
        kvt_log(KVT_LOG_INFO, "client instance %s said bye", instance);
    free(instance);
    kvt_metrics_set_clients(c->srv->metrics, kvt_sessions_count(c->srv->sessions));
    kvt_pack_ok(&c->pk, 1);
    kvt_pack_str(&c->pk, "released");
    msgpack_pack_uint64(&c->pk, released < 0 ? 0 : (uint64_t)released);
    return 0;
}

static int s_ping(s_ctx_t *c)
{
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
        json_object_foreach((json_t *)v, k, e) {
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
    case JSON_STRING: kvt_pack_strn(pk, json_string_value(v), json_string_length(v)); break;
    case JSON_INTEGER: msgpack_pack_int64(pk, json_integer_value(v)); break;
    case JSON_REAL: msgpack_pack_double(pk, json_real_value(v)); break;
    case JSON_TRUE: msgpack_pack_true(pk); break;
    case JSON_FALSE: msgpack_pack_false(pk); break;
    case JSON_NULL: msgpack_pack_nil(pk); break;
    }
}

static int s_stats(s_ctx_t *c)
{
    json_t *m = kvt_metrics_json(c->srv->metrics);
    kvt_pack_ok(&c->pk, (uint32_t)json_object_size(m));
    const char *k;
    json_t *e;
    json_object_foreach(m, k, e) {
        kvt_pack_str(&c->pk, k);
        s_pack_json(&c->pk, e);
    }
    json_decref(m);
    return 0;
}

/* ---- L1 requests ---- */

static kvt_nsref_t s_nsref(const kvt_req_t *r)
{
    return (kvt_nsref_t){r->ns.ptr, r->ns.len, r->salt.ptr, r->salt.len};
}

/* Requests that take a lease need an owner: the instance this connection said HELLO as. */
static int s_need_owner(s_ctx_t *c)
{
    if (c->owner)
        return 0;
    snprintf(c->err, sizeof c->err,
             "%s takes a lease: send HELLO first (or again: the instance was silent for over "
             "lease_ms and was dropped)",
             kvt_proto_name(c->req.type));
    return KVT_EBADREQ;
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

static int s_reserve(s_ctx_t *c)
{
    int rc = s_need_owner(c);
    if (rc)
        return rc;
    const kvt_req_t *r = &c->req;
    kvt_nsref_t ns = s_nsref(r);
    kvt_slot_t *slots = s_slots(r->nkeys);
    uint32_t n = 0;
    uint64_t lease = 0;
    rc = kvt_l1_reserve(c->srv->l1, c->owner, &ns, (const uint8_t(*)[KVT_KEY_LEN])r->keys,
                        r->nkeys, (r->present & KVT_F_SIZES) ? r->sizes : NULL, r->size, slots,
                        &n, &lease, c->err, sizeof c->err);
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 2);
        s_pack_slots(&c->pk, slots, n);
        s_pack_uint_field(&c->pk, "lease", lease);
    }
    free(slots);
    return rc;
}

static int s_commit(s_ctx_t *c)
{
    uint32_t stored = 0;
    int rc = kvt_l1_commit(c->srv->l1, c->owner, c->req.lease, c->req.failed, c->req.nfailed,
                           &stored, c->err, sizeof c->err);
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 1);
        s_pack_uint_field(&c->pk, "stored", stored);
    }
    return rc;
}

static int s_acquire(s_ctx_t *c)
{
    int rc = s_need_owner(c);
    if (rc)
        return rc;
    const kvt_req_t *r = &c->req;
    kvt_nsref_t ns = s_nsref(r);
    kvt_slot_t *slots = s_slots(r->nkeys);
    uint32_t n = 0;
    uint64_t lease = 0;
    rc = kvt_l1_acquire(c->srv->l1, c->owner, &ns, (const uint8_t(*)[KVT_KEY_LEN])r->keys,
                        r->nkeys, slots, &n, &lease);
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 2);
        s_pack_slots(&c->pk, slots, n);
        s_pack_uint_field(&c->pk, "lease", lease);
    }
    free(slots);
    return rc;
}

static int s_release(s_ctx_t *c)
{
    int rc = kvt_l1_release(c->srv->l1, c->owner, c->req.lease);
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

static int s_lookup(s_ctx_t *c)
{
    const kvt_req_t *r = &c->req;
    int rc = r->lock ? s_need_owner(c) : 0;
    if (rc)
        return rc;
    kvt_nsref_t ns = s_nsref(r);
    uint32_t hits = 0;
    uint64_t lease = 0;
    rc = kvt_l1_lookup(c->srv->l1, c->owner, &ns, (const uint8_t(*)[KVT_KEY_LEN])r->keys,
                       r->nkeys, r->lock, &hits, &lease);
    if (rc)
        return rc;
    kvt_pack_ok(&c->pk, lease ? 3 : 2);
    s_pack_uint_field(&c->pk, "hits", hits);
    s_pack_uint_field(&c->pk, "l1", hits);
    if (lease)
        s_pack_uint_field(&c->pk, "lease", lease);
    return 0;
}

static int s_remove(s_ctx_t *c)
{
    const kvt_req_t *r = &c->req;
    kvt_nsref_t ns = s_nsref(r);
    uint32_t removed = 0;
    int rc = kvt_l1_remove(c->srv->l1, &ns, (const uint8_t(*)[KVT_KEY_LEN])r->keys, r->nkeys,
                           &removed);
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 1);
        s_pack_uint_field(&c->pk, "removed", removed);
    }
    return rc;
}

static int s_clear(s_ctx_t *c)
{
    const kvt_req_t *r = &c->req;
    uint64_t removed = 0;
    int rc = kvt_l1_clear(c->srv->l1, (r->present & KVT_F_NS) ? r->ns.ptr : NULL, r->ns.len,
                          &removed);
    if (rc == 0) {
        kvt_pack_ok(&c->pk, 1);
        s_pack_uint_field(&c->pk, "removed", removed);
    }
    return rc;
}

static const s_handler_fn s_handlers[KVT_REQ_SLOTS] = {
    [KVT_REQ_HELLO] = s_hello,
    [KVT_REQ_BYE] = s_bye,
    [KVT_REQ_PING] = s_ping,
    [KVT_REQ_LOOKUP] = s_lookup,
    [KVT_REQ_RESERVE] = s_reserve,
    [KVT_REQ_COMMIT] = s_commit,
    [KVT_REQ_ACQUIRE] = s_acquire,
    [KVT_REQ_RELEASE] = s_release,
    [KVT_REQ_REMOVE] = s_remove,
    [KVT_REQ_CLEAR] = s_clear,
    [KVT_REQ_STATS] = s_stats,
};

/* ---- envelope ---- */

static int s_send(kvt_server_t *self, zframe_t **frame, bool more)
{
    return zframe_send(frame, self->router, (more ? ZFRAME_MORE : 0) | ZFRAME_DONTWAIT);
}

/* Sends [rid, uid, type, body, data...]; takes ownership of every frame. */
static void s_reply(kvt_server_t *self, zframe_t *rid, zframe_t *uid, uint64_t type,
                    zmsg_t *data)
{
    msgpack_sbuffer tbuf;
    msgpack_sbuffer_init(&tbuf);
    msgpack_packer tpk;
    msgpack_packer_init(&tpk, &tbuf, msgpack_sbuffer_write);
    msgpack_pack_uint64(&tpk, type);
    zframe_t *typef = zframe_new(tbuf.data, tbuf.size);
    msgpack_sbuffer_destroy(&tbuf);
    zframe_t *body = zframe_new(self->sbuf.data, self->sbuf.size);
    bool has_data = data && zmsg_size(data) > 0;
    int rc = s_send(self, &rid, true);
    if (rc == 0) {
        s_send(self, &uid, true);
        s_send(self, &typef, true);
        s_send(self, &body, has_data);
        for (zframe_t *f = has_data ? zmsg_pop(data) : NULL; f; f = zmsg_pop(data))
            s_send(self, &f, zmsg_size(data) > 0);
    } else {
        kvt_metrics_reply_failed(self->metrics);
        kvt_errrep_report(&s_rep_send, KVT_LOG_WARN, "reply dropped: %s", zmq_strerror(errno));
    }
    zframe_destroy(&rid);
    zframe_destroy(&uid);
    zframe_destroy(&typef);
    zframe_destroy(&body);
}

static int s_dispatch(s_ctx_t *c, zmsg_t *msg, uint64_t type, size_t total)
{
    kvt_server_t *self = c->srv;
    if (total > self->cfg->max_message) {
        snprintf(c->err, sizeof c->err, "message of %zu bytes exceeds max_message %llu", total,
                 (unsigned long long)self->cfg->max_message);
        return KVT_ETOOBIG;
    }
    const kvt_req_info_t *info = kvt_proto_info(type);
    if (!info) {
        snprintf(c->err, sizeof c->err, "unknown request type %llu", (unsigned long long)type);
        return KVT_EUNKTYPE;
    }
    zframe_t *body = zmsg_pop(msg);
    if (!body) {
        snprintf(c->err, sizeof c->err, "expected frames [uid, type, body, data...]");
        return KVT_EBADREQ;
    }
    int rc = kvt_msg_decode(zframe_data(body), zframe_size(body), info->type, &self->lim,
                            &c->req);
    if (rc == 0 && zmsg_size(msg) > 0 && info->type != KVT_REQ_PUT) {
        snprintf(c->err, sizeof c->err, "%s takes no data frames (got %zu)", info->name,
                 zmsg_size(msg));
        rc = KVT_EBADREQ;
    } else if (rc) {
        snprintf(c->err, sizeof c->err, "%s", c->req.error);
    } else if (!s_handlers[type]) {
        snprintf(c->err, sizeof c->err, "%s is not available in this version of kvtierd",
                 info->name);
        rc = KVT_EUNAVAIL;
    } else {
        c->data = msg;
        rc = s_handlers[type](c);
    }
    kvt_req_release(&c->req);
    zframe_destroy(&body);
    return rc;
}

static void s_handle_message(kvt_server_t *self, zmsg_t *msg)
{
    uint64_t t0 = kvt_now_ns();
    zframe_t *rid = zmsg_pop(msg);
    zframe_t *uid = zmsg_pop(msg);
    uint64_t uidv, type = 0;
    if (!rid || !uid || kvt_msg_read_uint(zframe_data(uid), zframe_size(uid), &uidv) != 0) {
        /* without a uid there is nothing a reply could be matched to */
        kvt_metrics_dropped(self->metrics);
        kvt_errrep_report(&s_rep_bad, KVT_LOG_WARN,
                          "dropped a message whose first frame is not a msgpack uint uid");
        zframe_destroy(&rid);
        zframe_destroy(&uid);
        zmsg_destroy(&msg);
        return;
    }
    uint64_t owner =
        kvt_sessions_touch(self->sessions, zframe_data(rid), zframe_size(rid), kvt_now_ms());
    size_t total = zmsg_content_size(msg) + zframe_size(uid);
    s_ctx_t c = {.srv = self, .rid = rid, .owner = owner};
    msgpack_sbuffer_clear(&self->sbuf);
    msgpack_packer_init(&c.pk, &self->sbuf, msgpack_sbuffer_write);
    zframe_t *typef = zmsg_pop(msg);
    int rc;
    if (!typef) {
        snprintf(c.err, sizeof c.err, "expected frames [uid, type, body, data...]");
        rc = KVT_EBADREQ;
    } else if (kvt_msg_read_uint(zframe_data(typef), zframe_size(typef), &type) != 0) {
        snprintf(c.err, sizeof c.err, "the type frame is not a msgpack uint");
        rc = KVT_EBADREQ;
    } else {
        rc = s_dispatch(&c, msg, type, total);
    }
    zframe_destroy(&typef);
    zmsg_t *data = NULL;
    if (rc) {
        msgpack_sbuffer_clear(&self->sbuf);
        kvt_pack_error(&c.pk, rc, c.err);
        kvt_log(KVT_LOG_DEBUG, "request %s uid %llu: %s: %s", kvt_proto_name(type),
                (unsigned long long)uidv, kvt_err_wire(rc), c.err);
    }
    s_reply(self, rid, uid, type, data);
    zmsg_destroy(&msg);
    kvt_metrics_request(self->metrics, type, rc, kvt_now_ns() - t0);
}

/* ---- set-up ---- */

/* Refuses an ipc path where another process is listening; removes a stale socket file left by
 * a crash (libzmq would silently unlink a live one). */
static int s_check_ipc(const char *endpoint, char *err, size_t errlen)
{
    const char *path = endpoint + strlen("ipc://");
    struct stat st;
    if (stat(path, &st) != 0)
        return 0;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) {
        snprintf(err, errlen, "listen: ipc path %s is too long", path);
        return KVT_EINVAL;
    }
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return 0;
    int live = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    close(fd);
    if (live) {
        snprintf(err, errlen, "listen: another process is already serving %s", endpoint);
        return KVT_EINVAL;
    }
    unlink(path);
    return 0;
}

static uint64_t s_on_gone(void *ctx, uint64_t owner, bool expired)
{
    kvt_server_t *self = ctx;
    return kvt_l1_release_owner(self->l1, owner, expired);
}

kvt_server_t *kvt_server_new(const kvt_config_t *cfg, kvt_metrics_t *metrics, kvt_sup_t *sup,
                             kvt_l1_t *l1, char *err, size_t errlen)
{
    kvt_server_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->cfg = cfg;
    self->metrics = metrics;
    self->l1 = l1;
    kvt_limits_init(&self->lim, cfg->max_message, cfg->max_keys);
    msgpack_sbuffer_init(&self->sbuf);
    self->sessions = kvt_sessions_new(s_on_gone, self);
    self->router = zsock_new(ZMQ_ROUTER);
    if (!self->router) {
        snprintf(err, errlen, "cannot create the ROUTER socket: %s", zmq_strerror(errno));
        goto fail;
    }
    zsock_set_router_mandatory(self->router, 1);
    zsock_set_linger(self->router, 1000);
    /* one frame far above max_message is cut at the transport instead of being buffered */
    zsock_set_maxmsgsize(self->router, (int)(cfg->max_message + 65536 > INT32_MAX
                                                 ? INT32_MAX
                                                 : cfg->max_message + 65536));
    for (int i = 0; i < cfg->n_listen; i++) {
        const char *ep = cfg->listen[i];
        if (strncmp(ep, "ipc://", 6) == 0 && s_check_ipc(ep, err, errlen) != 0)
            goto fail;
        if (zsock_bind(self->router, "%s", ep) < 0) {
            snprintf(err, errlen, "listen: cannot bind %s: %s", ep, zmq_strerror(errno));
            goto fail;
        }
        self->nbound = i + 1;
        kvt_log(KVT_LOG_INFO, "listening on %s", ep);
    }
    self->beat = kvt_sup_register(sup, "server", 1000);
    return self;
fail:
    kvt_server_destroy(&self);
    return NULL;
}

void kvt_server_destroy(kvt_server_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_server_t *self = *self_p;
    zsock_destroy(&self->router);
    for (int i = 0; i < self->nbound; i++)
        if (strncmp(self->cfg->listen[i], "ipc://", 6) == 0)
            unlink(self->cfg->listen[i] + 6);
    kvt_sessions_destroy(&self->sessions);
    msgpack_sbuffer_destroy(&self->sbuf);
    free(self);
    *self_p = NULL;
}

static void s_periodic(kvt_server_t *self)
{
    uint64_t now = kvt_now_ms();
    if (now < self->next_sweep_ms)
        return;
    self->next_sweep_ms = now + S_SWEEP_MS;
    if (kvt_sessions_expire(self->sessions, now, self->cfg->lease_ms))
        kvt_metrics_set_clients(self->metrics, kvt_sessions_count(self->sessions));
}

int kvt_server_run(kvt_server_t *self, volatile sig_atomic_t *stop)
{
    zmq_pollitem_t item = {zsock_resolve(self->router), 0, ZMQ_POLLIN, 0};
    while (!*stop) {
        if (!kvt_sup_beat(self->beat)) {
            kvt_sup_thread_exit(self->beat, false);
            return KVT_EINTERNAL;
        }
        int n = zmq_poll(&item, 1, S_POLL_MS);
        if (n < 0 && errno != EINTR) {
            kvt_log(KVT_LOG_ERROR, "server: poll failed: %s", zmq_strerror(errno));
            kvt_sup_thread_exit(self->beat, false);
            return KVT_EINTERNAL;
        }
        for (int i = 0; i < S_BATCH && !*stop && (zsock_events(self->router) & ZMQ_POLLIN); i++) {
            zmsg_t *msg = zmsg_recv(self->router);
            if (!msg)
                break;
            s_handle_message(self, msg);
        }
        s_periodic(self);
    }
    kvt_sup_thread_exit(self->beat, true);
    return 0;
}

json_t *kvt_server_status_json(kvt_server_t *self)
{
    json_t *eps = json_array();
    for (int i = 0; i < self->cfg->n_listen; i++)
        json_array_append_new(eps, json_string(self->cfg->listen[i]));
    return json_pack("{s:o,s:o}", "endpoints", eps, "clients",
                     kvt_sessions_json(self->sessions, kvt_now_ms()));
}
