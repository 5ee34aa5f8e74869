/* DESIGN: one libzmq DEALER per kvtier_t, used only by the calling thread. Requests carry an
 * increasing uid; the reply loop drops replies with other uids (answers to calls that timed
 * out). Bodies are encoded with msgpack-c and replies decoded into a zone freed per call. */
#include "kvtier.h"

#include "kvt_error.h"
#include "kvt_msg.h"
#include "kvt_proto.h"

#include <jansson.h>
#include <msgpack.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

struct kvtier {
    void *ctx;
    void *sock;
    uint64_t next_uid;
    int timeout_ms;
    char instance[KVT_MAX_NAME + 1];
    kvtier_info_t info;
    char error[256];
};

static _Atomic unsigned s_seq;

static int s_fail(kvtier_t *self, int code, const char *msg)
{
    snprintf(self->error, sizeof self->error, "%s", msg);
    return code;
}

static int s_send_frame(void *sock, const void *data, size_t len, int more)
{
    return zmq_send(sock, data, len, more ? ZMQ_SNDMORE : 0) < 0 ? -1 : 0;
}

static int s_pack_uint(char *buf, uint64_t v)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_uint64(&pk, v);
    int n = (int)sb.size;
    memcpy(buf, sb.data, sb.size);
    msgpack_sbuffer_destroy(&sb);
    return n;
}

int kvtier_call(kvtier_t *self, uint32_t type, const void *body, size_t len, void **reply_body,
                size_t *reply_len)
{
    self->error[0] = '\0';
    *reply_body = NULL;
    *reply_len = 0;
    uint64_t uid = self->next_uid++;
    char ubuf[16], tbuf[16];
    int ulen = s_pack_uint(ubuf, uid), tlen = s_pack_uint(tbuf, type);
    if (s_send_frame(self->sock, ubuf, (size_t)ulen, 1) || s_send_frame(self->sock, tbuf, (size_t)tlen, 1) ||
        s_send_frame(self->sock, body, len, 0))
        return s_fail(self, KVT_EUNAVAIL, zmq_strerror(zmq_errno()));
    for (;;) {
        zmq_msg_t parts[3];
        int nparts = 0, more = 1, rc = 0;
        while (more) {
            zmq_msg_t part;
            zmq_msg_init(&part);
            if (zmq_msg_recv(&part, self->sock, 0) < 0) {
                zmq_msg_close(&part);
                rc = zmq_errno() == EAGAIN ? KVT_ETIMEDOUT : KVT_EUNAVAIL;
                break;
            }
            more = zmq_msg_more(&part);
            if (nparts < 3)
                parts[nparts++] = part;
            else
                zmq_msg_close(&part); /* data frames: not used by these calls yet */
        }
        uint64_t ruid = 0;
        bool mine = rc == 0 && nparts == 3 &&
                    kvt_msg_read_uint(zmq_msg_data(&parts[0]), zmq_msg_size(&parts[0]), &ruid) == 0 &&
                    ruid == uid;
        if (mine) {
            *reply_len = zmq_msg_size(&parts[2]);
            *reply_body = malloc(*reply_len ? *reply_len : 1);
            if (*reply_body)
                memcpy(*reply_body, zmq_msg_data(&parts[2]), *reply_len);
            else
                rc = KVT_ENOMEM;
        }
        for (int i = 0; i < nparts; i++)
            zmq_msg_close(&parts[i]);
        if (rc)
            return s_fail(self, rc, rc == KVT_ETIMEDOUT ? "timed out waiting for the daemon"
                                                         : zmq_strerror(zmq_errno()));
        if (mine)
            return 0;
    }
}

/* A decoded reply: the body buffer stays alive because msgpack objects point into it. */
typedef struct {
    void *buf;
    msgpack_unpacked up;
} s_reply_t;

static void s_reply_free(s_reply_t *r)
{
    msgpack_unpacked_destroy(&r->up);
    free(r->buf);
    r->buf = NULL;
}

static bool s_key_is(const msgpack_object *k, const char *name)
{
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == strlen(name) &&
           memcmp(k->via.str.ptr, name, k->via.str.size) == 0;
}

static const msgpack_object *s_get(const msgpack_object *map, const char *name)
{
    if (map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    for (uint32_t i = 0; i < map->via.map.size; i++)
        if (s_key_is(&map->via.map.ptr[i].key, name))
            return &map->via.map.ptr[i].val;
    return NULL;
}

/* Calls and decodes. On 0, r->up.data is the ok body; the caller frees r either way. */
static int s_call(kvtier_t *self, uint32_t type, msgpack_sbuffer *body, s_reply_t *r)
{
    size_t len = 0;
    msgpack_unpacked_init(&r->up);
    r->buf = NULL;
    int rc = kvtier_call(self, type, body->data, body->size, &r->buf, &len);
    msgpack_sbuffer_destroy(body);
    if (rc)
        return rc;
    size_t off = 0;
    if (msgpack_unpack_next(&r->up, r->buf, len, &off) != MSGPACK_UNPACK_SUCCESS ||
        r->up.data.type != MSGPACK_OBJECT_MAP)
        return s_fail(self, KVT_EBADREQ, "undecodable reply");
    const msgpack_object *ok = s_get(&r->up.data, "ok");
    if (ok && ok->type == MSGPACK_OBJECT_BOOLEAN && ok->via.boolean)
        return 0;
    const msgpack_object *error = s_get(&r->up.data, "error");
    const msgpack_object *code = error ? s_get(error, "code") : NULL;
    const msgpack_object *msg = error ? s_get(error, "message") : NULL;
    rc = code && code->type == MSGPACK_OBJECT_STR
             ? kvt_err_from_wire(code->via.str.ptr, code->via.str.size)
             : KVT_EINTERNAL;
    if (msg && msg->type == MSGPACK_OBJECT_STR)
        snprintf(self->error, sizeof self->error, "%.*s", (int)msg->via.str.size,
                 msg->via.str.ptr);
    else
        snprintf(self->error, sizeof self->error, "daemon error without a message");
    return rc;
}

static void s_body_begin(msgpack_sbuffer *sb, msgpack_packer *pk, uint32_t n)
{
    msgpack_sbuffer_init(sb);
    msgpack_packer_init(pk, sb, msgpack_sbuffer_write);
    msgpack_pack_map(pk, n);
}

static uint64_t s_uint(const msgpack_object *o)
{
    return o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? o->via.u64 : 0;
}

kvtier_t *kvtier_connect(const char *endpoint, const char *client, const char *instance,
                         int timeout_ms, char *err, size_t errlen)
{
    kvtier_t *self = calloc(1, sizeof *self);
    if (!self) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    self->timeout_ms = timeout_ms > 0 ? timeout_ms : 5000;
    self->next_uid = 1;
    if (instance)
        snprintf(self->instance, sizeof self->instance, "%s", instance);
    else
        snprintf(self->instance, sizeof self->instance, "%s-%d-%u", client, (int)getpid(),
                 atomic_fetch_add(&s_seq, 1));
    self->ctx = zmq_ctx_new();
    self->sock = self->ctx ? zmq_socket(self->ctx, ZMQ_DEALER) : NULL;
    if (!self->sock) {
        snprintf(err, errlen, "cannot create a socket: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    int linger = 0;
    zmq_setsockopt(self->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(self->sock, ZMQ_RCVTIMEO, &self->timeout_ms, sizeof self->timeout_ms);
    zmq_setsockopt(self->sock, ZMQ_SNDTIMEO, &self->timeout_ms, sizeof self->timeout_ms);
    if (zmq_connect(self->sock, endpoint) != 0) {
        snprintf(err, errlen, "cannot connect to %s: %s", endpoint, zmq_strerror(zmq_errno()));
        goto fail;
    }
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_begin(&sb, &pk, 3);
    kvt_pack_str(&pk, "version");
    msgpack_pack_uint32(&pk, KVT_PROTO_VERSION);
    kvt_pack_str(&pk, "client");
    kvt_pack_str(&pk, client);
    kvt_pack_str(&pk, "instance");
    kvt_pack_str(&pk, self->instance);
    s_reply_t r;
    int rc = s_call(self, KVT_REQ_HELLO, &sb, &r);
    if (rc) {
        snprintf(err, errlen, "HELLO to %s failed: %s (%s)", endpoint, self->error,
                 kvt_err_wire(rc));
        s_reply_free(&r);
        goto fail;
    }
    const msgpack_object *body = &r.up.data, *server = s_get(body, "server");
    self->info.version = (uint32_t)s_uint(s_get(body, "version"));
    self->info.chunk_tokens = (uint32_t)s_uint(s_get(body, "chunk_tokens"));
    self->info.lease_ms = (uint32_t)s_uint(s_get(body, "lease_ms"));
    self->info.max_message = s_uint(s_get(body, "max_message"));
    if (server && server->type == MSGPACK_OBJECT_STR)
        snprintf(self->info.server, sizeof self->info.server, "%.*s", (int)server->via.str.size,
                 server->via.str.ptr);
    s_reply_free(&r);
    return self;
fail:
    if (self->sock)
        zmq_close(self->sock);
    if (self->ctx)
        zmq_ctx_term(self->ctx);
    free(self);
    return NULL;
}

void kvtier_close(kvtier_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvtier_t *self = *self_p;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_begin(&sb, &pk, 1);
    kvt_pack_str(&pk, "instance");
    kvt_pack_str(&pk, self->instance);
    s_reply_t r;
    s_call(self, KVT_REQ_BYE, &sb, &r); /* best effort: leases expire anyway */
    s_reply_free(&r);
    zmq_close(self->sock);
    zmq_ctx_term(self->ctx);
    free(self);
    *self_p = NULL;
}

const kvtier_info_t *kvtier_info(const kvtier_t *self)
{
    return &self->info;
}

const char *kvtier_last_error(const kvtier_t *self)
{
    return self->error;
}

int kvtier_ping(kvtier_t *self)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_begin(&sb, &pk, 0);
    s_reply_t r;
    int rc = s_call(self, KVT_REQ_PING, &sb, &r);
    s_reply_free(&r);
    return rc;
}

static json_t *s_to_json(const msgpack_object *o)
{
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return json_null();
    case MSGPACK_OBJECT_BOOLEAN: return json_boolean(o->via.boolean);
    case MSGPACK_OBJECT_POSITIVE_INTEGER: return json_integer((json_int_t)o->via.u64);
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return json_integer(o->via.i64);
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: return json_real(o->via.f64);
    case MSGPACK_OBJECT_STR: return json_stringn(o->via.str.ptr, o->via.str.size);
    case MSGPACK_OBJECT_ARRAY: {
        json_t *a = json_array();
        for (uint32_t i = 0; i < o->via.array.size; i++)
            json_array_append_new(a, s_to_json(&o->via.array.ptr[i]));
        return a;
    }
    case MSGPACK_OBJECT_MAP: {
        json_t *m = json_object();
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            const msgpack_object_kv *kv = &o->via.map.ptr[i];
            if (kv->key.type == MSGPACK_OBJECT_STR) {
                char key[256];
                snprintf(key, sizeof key, "%.*s", (int)kv->key.via.str.size, kv->key.via.str.ptr);
                json_object_set_new(m, key, s_to_json(&kv->val));
            }
        }
        return m;
    }
    default: return json_null();
    }
}

int kvtier_stats(kvtier_t *self, char **json_out)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_begin(&sb, &pk, 0);
    s_reply_t r;
    int rc = s_call(self, KVT_REQ_STATS, &sb, &r);
    if (rc == 0) {
        json_t *j = s_to_json(&r.up.data);
        json_object_del(j, "ok");
        *json_out = json_dumps(j, JSON_INDENT(2) | JSON_SORT_KEYS);
        json_decref(j);
        if (!*json_out)
            rc = s_fail(self, KVT_ENOMEM, "cannot encode stats");
    }
    s_reply_free(&r);
    return rc;
}
