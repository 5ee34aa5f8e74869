/* DESIGN: one libzmq DEALER per kvtier_t, used only by the calling thread (a kvtier_t has no lock:
 * one per thread). Requests carry an increasing uid; the reply loop drops replies with other uids
 * (answers to calls that timed out), data frames included. Bodies are encoded with msgpack-c; a
 * reply body is copied out of its frame and decoded into a zone, both freed per call (kvc_reply_t,
 * kvtier_wire.c).
 *
 * Two data paths. The shared-memory one is zero-copy: connect maps the arena HELLO names (shm.path,
 * MAP_SHARED, read-write) and RESERVE/ACQUIRE slots are pointers into that mapping. When the arena
 * cannot be mapped (a client on another host over tcp), connect still succeeds and only
 * RESERVE/ACQUIRE refuse, locally, with KVT_EUNAVAIL. The inline one (PUT/GET) carries the bytes in
 * raw frames: PUT lets zmq_send copy each buffer (libzmq may still be sending after a timed-out
 * call returns, when the caller has already freed its data), and GET copies each reply frame into
 * one malloc'd buffer that the caller owns.
 *
 * Every reply field is checked before it is used: a daemon that breaks the protocol gets
 * KVT_EINTERNAL with a sentence naming the field, never a crash or an out-of-arena pointer. Outputs
 * are zeroed on entry, so they read as "nothing" after any failure.
 *
 * Liveness (docs/protocol.md, "Client liveness"). The daemon drops an instance silent for lease_ms,
 * with its leases and GPU registrations. Each kvtier_t therefore has a heartbeat (kvc_hb_t,
 * kvtier_hb.c): a thread of its own with a DEALER of its own, which joins the instance with the
 * token HELLO returned and sends PING {instance} every interval. The caller's thread and the
 * heartbeat share only kvc_hb_t's token and generation (under its mutex, never taken on the hot
 * path) and one atomic flag, `dropped`, that a call reads with one load. When a call answers
 * instance_dropped, or the heartbeat raised the flag, kvc_reestablish (kvtier_conn.c) says HELLO
 * again (same name and token), remaps the arena if the daemon announced another, re-registers the
 * GPU layouts it keeps copies of, hands the new token to the heartbeat, and the call is sent once
 * more (kvtier_wire.c s_retried: not COMMIT/RELEASE, whose lease is gone). Lock order:
 * kvc_hb_t.lock is a leaf; kvtier_wire.c's s_ctx_lock is never held with it.
 *
 * Faulting the arena in (KVTIER_MAP_POPULATE): lazily by default (each page on first touch), all at
 * once with MAP_POPULATE ("1"), or by a thread of its own ("background", kvc_prefault_t in
 * kvtier_conn.c) that walks the mapping in chunks with MADV_POPULATE_WRITE while the caller goes
 * on; the only thing it shares is an atomic stop flag, and it is joined before the mapping is
 * unmapped.
 *
 * The fast path (issue 17; docs/protocol.md "Fast path"). HELLO asks for a ring pair (`fastpath:
 * true`, unless KVTIER_FASTPATH=0); the pair, a memfd of its own, is collected from the daemon's
 * handoff socket with the offer's ticket (common/kvt_fdpass), mapped, and its two regions are
 * attached with common/kvt_ring: this handle
 * produces on the request ring and consumes the reply ring. Then every request without data frames
 * whose message fits in a record goes over the ring (kvtier_wire.c: s_ring_push, s_ring_recv), the
 * rest (PUT, GET, HELLO, BYE, big bodies) over the socket; both carry the same frames and one uid
 * sequence, so each transport's receive loop skips the replies to timed-out or posted calls by uid.
 * The daemon reads the two transports independently, so a request posted on the ring
 * (kvtier_release_async) is confirmed by a ring reply before anything goes over the socket
 * (s_ring_settle): the next call sees it done, as on one socket. The pair is dropped (our sides
 * closed, the handles freed) before every HELLO and BYE (the daemon replaces or reclaims it then),
 * before the arena is unmapped, when the daemon closes it (KVT_EUNAVAIL), when the ring turns out
 * malformed, and when a wait times out and the arena file is gone (a dead daemon closes nothing);
 * calls then use the socket until a later HELLO brings a new pair. A child forked after connect
 * never touches the pair (the region is shared with its parent): kvc_fork_gen.
 *
 * The files (kvtier_int.h says which owns what): kvtier_wire.c, kvtier_conn.c, kvtier_hb.c and this
 * one, the API. */
#include "kvtier_int.h"

#include "kvt_error.h"
#include "kvt_hash.h"
#include "kvt_msg.h"
#include "kvt_proto.h"
#include "kvt_resident.h"
#include "kvt_utf8.h"
#include "kvt_fdpass.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <msgpack.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

_Static_assert(KVTIER_KEY_LEN == KVT_KEY_LEN, "kvtier.h and the protocol disagree on keys");
_Static_assert(KVTIER_KEY_LEN == KVT_HASH_KEY_LEN, "kvtier.h and kvt_hash disagree on keys");
_Static_assert(KVTIER_MAX_LABEL == KVT_MAX_LABEL, "kvtier.h and the protocol disagree on labels");

/* ---- request bodies ---- */

void kvc_body_begin(msgpack_sbuffer *sb, msgpack_packer *pk, uint32_t n)
{
    msgpack_sbuffer_init(sb);
    msgpack_packer_init(pk, sb, msgpack_sbuffer_write);
    msgpack_pack_map(pk, n);
}

static bool s_has_salt(const char *salt)
{
    return salt && *salt;
}

static void s_pack_bin(msgpack_packer *pk, const void *p, size_t n)
{
    msgpack_pack_bin(pk, n);
    msgpack_pack_bin_body(pk, p, n);
}

static void s_pack_uint_field(msgpack_packer *pk, const char *name, uint64_t v)
{
    kvt_pack_str(pk, name);
    msgpack_pack_uint64(pk, v);
}

/* Begins a keyed body {ns, salt?, keys, + `extra` fields}; salt is left out when NULL or "". */
static void s_body_keyed(msgpack_sbuffer *sb, msgpack_packer *pk, const char *ns, const char *salt,
                         const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, uint32_t extra)
{
    kvc_body_begin(sb, pk, 2 + (s_has_salt(salt) ? 1 : 0) + extra);
    kvt_pack_str(pk, "ns");
    kvt_pack_str(pk, ns);
    if (s_has_salt(salt)) {
        kvt_pack_str(pk, "salt");
        kvt_pack_str(pk, salt);
    }
    kvt_pack_str(pk, "keys");
    msgpack_pack_array(pk, n);
    for (uint32_t i = 0; i < n; i++)
        s_pack_bin(pk, keys[i], KVTIER_KEY_LEN);
}

/* ---- argument checks: bad input is KVT_EINVAL with a sentence, never a crash ---- */

/* labels: NULL, or per key NULL / "" (none) or UTF-8 of at most KVT_MAX_LABEL bytes. */
static int s_check_labels(kvtier_t *self, const char *what, const char *const *labels, uint32_t n)
{
    for (uint32_t i = 0; labels && i < n; i++) {
        size_t len = labels[i] ? strlen(labels[i]) : 0;
        if (len > KVT_MAX_LABEL)
            return kvc_fail(self, KVT_EINVAL, "%s: labels[%u] is %zu bytes, at most %d", what, i,
                            len, KVT_MAX_LABEL);
        if (!kvt_utf8_valid((const uint8_t *)labels[i], len))
            return kvc_fail(self, KVT_EINVAL, "%s: labels[%u] is not UTF-8", what, i);
    }
    return 0;
}

/* The `labels` field: one str per key, nil for none. */
static void s_pack_labels(msgpack_packer *pk, const char *const *labels, uint32_t n)
{
    kvt_pack_str(pk, "labels");
    msgpack_pack_array(pk, n);
    for (uint32_t i = 0; i < n; i++)
        if (labels[i] && labels[i][0])
            kvt_pack_str(pk, labels[i]);
        else
            msgpack_pack_nil(pk);
}

static int s_check_salt(kvtier_t *self, const char *what, const char *salt)
{
    if (salt && strlen(salt) > KVT_MAX_SALT)
        return kvc_fail(self, KVT_EINVAL, "%s: salt is longer than %d bytes", what, KVT_MAX_SALT);
    return 0;
}

static int s_check_ns(kvtier_t *self, const char *what, const char *ns)
{
    if (!ns)
        return kvc_fail(self, KVT_EINVAL, "%s: ns is NULL", what);
    size_t len = strlen(ns);
    if (len == 0 || len > KVT_MAX_NS)
        return kvc_fail(self, KVT_EINVAL, "%s: ns must be 1 to %d bytes", what, KVT_MAX_NS);
    return 0;
}

static int s_check_keyed(kvtier_t *self, const char *what, const char *ns, const char *salt,
                         const void *keys, uint32_t n)
{
    self->error[0] = '\0';
    int rc = s_check_ns(self, what, ns);
    if (rc == 0)
        rc = s_check_salt(self, what, salt);
    if (rc == 0 && n && !keys)
        rc = kvc_fail(self, KVT_EINVAL, "%s: keys is NULL with n = %u", what, n);
    return rc;
}

static int s_check_arena(kvtier_t *self, const char *what)
{
    if (self->arena)
        return 0;
    return kvc_fail(self, KVT_EUNAVAIL, "%s needs the shared-memory arena, and %s", what,
                    self->arena_why);
}

/* The public codes are the internal vocabulary's numbers: keep them in step (every row). */
_Static_assert(KVTIER_EBADREQ == KVT_EBADREQ && KVTIER_EUNKTYPE == KVT_EUNKTYPE &&
                   KVTIER_EVERSION == KVT_EVERSION && KVTIER_ETOOBIG == KVT_ETOOBIG &&
                   KVTIER_ENOSPC == KVT_ENOSPC && KVTIER_ENOTFOUND == KVT_ENOTFOUND &&
                   KVTIER_ELEXPIRED == KVT_ELEXPIRED && KVTIER_EUNKLEASE == KVT_EUNKLEASE &&
                   KVTIER_EBUSY == KVT_EBUSY && KVTIER_EINTERNAL == KVT_EINTERNAL &&
                   KVTIER_EUNAVAIL == KVT_EUNAVAIL && KVTIER_ENOMEM == KVT_ENOMEM &&
                   KVTIER_EIO == KVT_EIO && KVTIER_ETIMEDOUT == KVT_ETIMEDOUT &&
                   KVTIER_EINVAL == KVT_EINVAL && KVTIER_ENOINST == KVT_ENOINST,
               "kvtier.h error codes differ from kvt_error.h");
/* ... and a new row of kvt_error.h needs its KVTIER_ name (and the check above) */
#define S_ROWS(name, num, wire, msg) +1
_Static_assert(0 KVT_ERRNO_MAP(S_ROWS) == -KVTIER_ENOINST,
               "kvt_error.h has a code kvtier.h does not name");
#undef S_ROWS

const char *kvtier_strerror(int code)
{
    return kvt_strerror(code);
}

const char *kvtier_error_code(int code)
{
    return code == 0 ? "ok" : kvt_err_wire(code);
}

const kvtier_info_t *kvtier_info(const kvtier_t *self)
{
    return &self->info;
}

const char *kvtier_last_error(const kvtier_t *self)
{
    return self ? self->error : "no kvtier handle";
}

int kvtier_fastpath_active(const kvtier_t *self)
{
    return self && kvc_pair_mine(self) ? 1 : 0;
}

void *kvtier_arena(const kvtier_t *self, size_t *size)
{
    if (size)
        *size = self ? self->arena_size : 0;
    return self ? self->arena : NULL;
}

int kvtier_ping(kvtier_t *self)
{
    if (!self)
        return KVT_EINVAL;
    msgpack_sbuffer sb;
    kvc_instance_body(&sb, self->instance); /* alive only if this connection acts for it */
    kvc_reply_t r;
    int rc = kvc_call(self, KVT_REQ_PING, &sb, &r);
    kvc_reply_free(&r);
    return rc;
}

static json_t *s_to_json(const msgpack_object *o)
{
    switch (o->type) {
    case MSGPACK_OBJECT_NIL:
        return json_null();
    case MSGPACK_OBJECT_BOOLEAN:
        return json_boolean(o->via.boolean);
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        return json_integer((json_int_t)o->via.u64);
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        return json_integer(o->via.i64);
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        return json_real(o->via.f64);
    case MSGPACK_OBJECT_STR:
        return json_stringn(o->via.str.ptr, o->via.str.size);
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
    default:
        return json_null();
    }
}

int kvtier_stats(kvtier_t *self, char **json_out)
{
    if (!self || !json_out)
        return self ? kvc_fail(self, KVT_EINVAL, "kvtier_stats: json_out is NULL") : KVT_EINVAL;
    *json_out = NULL;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    kvc_body_begin(&sb, &pk, 0);
    kvc_reply_t r;
    int rc = kvc_call(self, KVT_REQ_STATS, &sb, &r);
    if (rc == 0) {
        json_t *j = s_to_json(&r.up.data);
        json_object_del(j, "ok");
        *json_out = json_dumps(j, JSON_INDENT(2) | JSON_SORT_KEYS);
        json_decref(j);
        if (!*json_out)
            rc = kvc_fail(self, KVT_ENOMEM, "cannot encode stats");
    }
    kvc_reply_free(&r);
    return rc;
}

/* ---- the cache ---- */

/* Best-effort RELEASE of a lease whose reply could not be used, so that the reservation or
 * pin does not wait for lease_ms; the caller's error message is kept. */
static void s_abandon(kvtier_t *self, uint64_t lease)
{
    char saved[sizeof self->error];
    memcpy(saved, self->error, sizeof saved);
    msgpack_sbuffer sb;
    msgpack_packer pk;
    kvc_body_begin(&sb, &pk, 1);
    s_pack_uint_field(&pk, "lease", lease);
    kvc_reply_t r;
    kvc_call(self, KVT_REQ_RELEASE, &sb, &r);
    kvc_reply_free(&r);
    memcpy(self->error, saved, sizeof saved);
}

/* slots: [{offset, length} | nil], at most n of them, each inside this client's arena. */
static int s_parse_slots(kvtier_t *self, uint32_t type, const msgpack_object *body, uint32_t n,
                         bool allow_nil, kvtier_slot_t *slots, uint32_t *nslots)
{
    const msgpack_object *a = kvc_get(body, "slots");
    if (!a || a->type != MSGPACK_OBJECT_ARRAY)
        return kvc_bad_reply(self, type, "slots", a ? "is not an array" : "is missing");
    if (a->via.array.size > n)
        return kvc_bad_reply(self, type, "slots", "has more entries than keys");
    for (uint32_t i = 0; i < a->via.array.size; i++) {
        const msgpack_object *e = &a->via.array.ptr[i];
        slots[i] = (kvtier_slot_t){NULL, 0, 0};
        if (e->type == MSGPACK_OBJECT_NIL && allow_nil)
            continue;
        uint64_t off, len;
        int rc =
            e->type == MSGPACK_OBJECT_MAP ? 0 : kvc_bad_reply(self, type, "slots", "has a non-map");
        if (rc == 0)
            rc = kvc_need_uint(self, type, e, "offset", &off);
        if (rc == 0)
            rc = kvc_need_uint(self, type, e, "length", &len);
        if (rc)
            return rc;
        if (len == 0 || off > self->arena_size || len > self->arena_size - off)
            return kvc_bad_reply(self, type, "slots", "has a range outside the arena");
        slots[i] = (kvtier_slot_t){(uint8_t *)self->arena + off, off, len};
    }
    *nslots = a->via.array.size;
    return 0;
}

int kvtier_resident(kvtier_t *self, const char *ns, const char *salt,
                    const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, uint32_t *l1)
{
    if (l1)
        *l1 = 0;
    if (!self)
        return KVT_EINVAL;
    int rc = s_check_keyed(self, "resident", ns, salt, keys, n);
    if (rc)
        return rc;
    if (!l1)
        return kvc_fail(self, KVT_EINVAL, "resident: l1 is NULL");
    if (!self->res_map || !kvc_pair_mine(self))
        return kvc_fail(self, KVT_EUNAVAIL, "resident: no residency map (%s)",
                        self->req_ring ? "the daemon offered none" : "no fast-path pair");
    uint64_t now = kvc_mono_ns();
    if (now - self->res_checked_ns > KVTIER_RESIDENT_PEER_CHECK_MS * 1000000u) {
        if (kvt_fdpass_peer_gone(self->ring_sock)) {
            kvc_pair_drop(self);
            return kvc_fail(self, KVT_EUNAVAIL, "resident: the daemon let the pair go");
        }
        self->res_checked_ns = now;
    }
    kvt_resident_view_t v;
    char why[160];
    if (kvt_resident_view(self->res_map, self->res_map_len, &v, why, sizeof why) != 0)
        return kvc_fail(self, KVT_EUNAVAIL, "resident: %s", why);
    if (!kvt_resident_fresh(&v))
        return kvc_fail(self, KVT_EUNAVAIL, "resident: the daemon has not kept the map for a "
                                            "second (stopped, wedged or gone)");
    kvt_ns_t nsv = {(const uint8_t *)ns, (uint32_t)strlen(ns), (const uint8_t *)salt,
                    salt ? (uint32_t)strlen(salt) : 0};
    *l1 = kvt_resident_prefix(&v, &nsv, (const kvt_key_t *)keys, n);
    return 0;
}

int kvtier_lookup(kvtier_t *self, const char *ns, const char *salt,
                  const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, unsigned flags, uint32_t *hits,
                  uint32_t *l1, uint64_t *lease, uint64_t *job)
{
    if (hits)
        *hits = 0;
    if (l1)
        *l1 = 0;
    if (lease)
        *lease = 0;
    if (job)
        *job = 0;
    if (!self)
        return KVT_EINVAL;
    int rc = s_check_keyed(self, "lookup", ns, salt, keys, n);
    if (rc)
        return rc;
    if (!hits)
        return kvc_fail(self, KVT_EINVAL, "lookup: hits is NULL");
    if (flags & ~(KVTIER_LOCK | KVTIER_PREFETCH))
        return kvc_fail(self, KVT_EINVAL, "lookup: unknown flags 0x%x", flags);
    if ((flags & KVTIER_LOCK) && !lease)
        return kvc_fail(self, KVT_EINVAL, "lookup: KVTIER_LOCK needs a lease pointer");
    if ((flags & KVTIER_PREFETCH) && !job)
        return kvc_fail(self, KVT_EINVAL, "lookup: KVTIER_PREFETCH needs a job pointer");
    bool lock = flags & KVTIER_LOCK, prefetch = flags & KVTIER_PREFETCH;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_keyed(&sb, &pk, ns, salt, keys, n, (lock ? 1 : 0) + (prefetch ? 1 : 0));
    if (lock) {
        kvt_pack_str(&pk, "lock");
        msgpack_pack_true(&pk);
    }
    if (prefetch) {
        kvt_pack_str(&pk, "prefetch");
        msgpack_pack_true(&pk);
    }
    kvc_reply_t r;
    rc = kvc_call(self, KVT_REQ_LOOKUP, &sb, &r);
    uint64_t h = 0, in_l1 = 0, ls = 0, jb = 0;
    if (rc == 0)
        rc = kvc_opt_uint(self, KVT_REQ_LOOKUP, &r.up.data, "lease", &ls);
    if (rc == 0)
        rc = kvc_need_count(self, KVT_REQ_LOOKUP, &r.up.data, "hits", n, &h);
    if (rc == 0)
        rc = kvc_need_count(self, KVT_REQ_LOOKUP, &r.up.data, "l1", h, &in_l1);
    if (rc == 0)
        rc = kvc_opt_uint(self, KVT_REQ_LOOKUP, &r.up.data, "job", &jb);
    if (rc == 0) {
        *hits = (uint32_t)h;
        if (l1)
            *l1 = (uint32_t)in_l1;
        if (lease)
            *lease = ls;
        if (job)
            *job = jb;
    } else if (ls) {
        s_abandon(self, ls);
    }
    kvc_reply_free(&r);
    return rc;
}

int kvtier_prefetch_status(kvtier_t *self, uint64_t job, int *done, uint32_t *loaded,
                           uint32_t *hits)
{
    if (done)
        *done = 0;
    if (loaded)
        *loaded = 0;
    if (hits)
        *hits = 0;
    if (!self)
        return KVT_EINVAL;
    self->error[0] = '\0';
    if (!done)
        return kvc_fail(self, KVT_EINVAL, "prefetch_status: done is NULL");
    msgpack_sbuffer sb;
    msgpack_packer pk;
    kvc_body_begin(&sb, &pk, 1);
    s_pack_uint_field(&pk, "job", job);
    kvc_reply_t r;
    int rc = kvc_call(self, KVT_REQ_PREFETCH_STATUS, &sb, &r);
    const msgpack_object *d = rc ? NULL : kvc_get(&r.up.data, "done");
    uint64_t ld = 0, h = 0;
    if (rc == 0 && (!d || d->type != MSGPACK_OBJECT_BOOLEAN))
        rc = kvc_bad_reply(self, KVT_REQ_PREFETCH_STATUS, "done",
                           d ? "is not a bool" : "is missing");
    if (rc == 0)
        rc = kvc_need_uint(self, KVT_REQ_PREFETCH_STATUS, &r.up.data, "loaded", &ld);
    if (rc == 0)
        rc = kvc_need_uint(self, KVT_REQ_PREFETCH_STATUS, &r.up.data, "hits", &h);
    if (rc == 0) {
        *done = d->via.boolean;
        if (loaded)
            *loaded = ld > UINT32_MAX ? UINT32_MAX : (uint32_t)ld;
        if (hits)
            *hits = h > UINT32_MAX ? UINT32_MAX : (uint32_t)h;
    }
    kvc_reply_free(&r);
    return rc;
}

/* The common checks of RESERVE and ACQUIRE: outputs zeroed, arguments present. */
static int s_check_slots_call(kvtier_t *self, const char *name, const char *ns, const char *salt,
                              const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n,
                              const kvtier_slot_t *slots, uint32_t *nslots, uint64_t *lease)
{
    if (nslots)
        *nslots = 0;
    if (lease)
        *lease = 0;
    if (!self)
        return KVT_EINVAL;
    int rc = s_check_keyed(self, name, ns, salt, keys, n);
    if (rc)
        return rc;
    if (!nslots || !lease || (n && !slots))
        return kvc_fail(self, KVT_EINVAL, "%s: slots, nslots and lease must not be NULL", name);
    return 0;
}

int kvtier_reserve(kvtier_t *self, const char *ns, const char *salt,
                   const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, const uint64_t *sizes,
                   uint64_t size, kvtier_slot_t *slots, uint32_t *nslots, uint64_t *lease)
{
    return kvtier_reserve_labeled(self, ns, salt, keys, n, NULL, sizes, size, slots, nslots,
                                  lease);
}

int kvtier_reserve_labeled(kvtier_t *self, const char *ns, const char *salt,
                           const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n,
                           const char *const *labels, const uint64_t *sizes, uint64_t size,
                           kvtier_slot_t *slots, uint32_t *nslots, uint64_t *lease)
{
    int rc = s_check_slots_call(self, "reserve", ns, salt, keys, n, slots, nslots, lease);
    if (rc == 0)
        rc = s_check_labels(self, "reserve", labels, n);
    if (rc)
        return rc;
    if (!sizes && size == 0 && n)
        return kvc_fail(self, KVT_EINVAL, "reserve: sizes is NULL and size is 0");
    for (uint32_t i = 0; sizes && i < n; i++)
        if (sizes[i] == 0)
            return kvc_fail(self, KVT_EINVAL, "reserve: sizes[%u] is 0", i);
    rc = s_check_arena(self, "reserve");
    if (rc)
        return rc;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_keyed(&sb, &pk, ns, salt, keys, n, 1 + (labels ? 1 : 0));
    if (labels)
        s_pack_labels(&pk, labels, n);
    if (sizes) {
        kvt_pack_str(&pk, "sizes");
        msgpack_pack_array(&pk, n);
        for (uint32_t i = 0; i < n; i++)
            msgpack_pack_uint64(&pk, sizes[i]);
    } else {
        s_pack_uint_field(&pk, "size", size);
    }
    kvc_reply_t r;
    rc = kvc_call(self, KVT_REQ_RESERVE, &sb, &r);
    uint64_t ls = 0;
    uint32_t got = 0;
    if (rc == 0)
        rc = kvc_need_uint(self, KVT_REQ_RESERVE, &r.up.data, "lease", &ls);
    if (rc == 0)
        rc = s_parse_slots(self, KVT_REQ_RESERVE, &r.up.data, n, true, slots, &got);
    for (uint32_t i = 0; rc == 0 && i < got; i++)
        if (slots[i].ptr && slots[i].length != (sizes ? sizes[i] : size))
            rc = kvc_bad_reply(self, KVT_REQ_RESERVE, "slots", "has a length other than asked");
        else if (slots[i].ptr && !ls)
            rc = kvc_bad_reply(self, KVT_REQ_RESERVE, "lease", "is 0 with slots reserved");
    if (rc == 0) {
        *nslots = got;
        *lease = ls;
    } else if (ls) {
        s_abandon(self, ls);
    }
    kvc_reply_free(&r);
    return rc;
}

int kvtier_commit(kvtier_t *self, uint64_t lease, const uint32_t *failed, uint32_t nfailed,
                  uint32_t *stored)
{
    if (stored)
        *stored = 0;
    if (!self)
        return KVT_EINVAL;
    self->error[0] = '\0';
    if (nfailed && !failed)
        return kvc_fail(self, KVT_EINVAL, "commit: failed is NULL with nfailed = %u", nfailed);
    msgpack_sbuffer sb;
    msgpack_packer pk;
    kvc_body_begin(&sb, &pk, nfailed ? 2 : 1);
    s_pack_uint_field(&pk, "lease", lease);
    if (nfailed) {
        kvt_pack_str(&pk, "failed");
        msgpack_pack_array(&pk, nfailed);
        for (uint32_t i = 0; i < nfailed; i++)
            msgpack_pack_uint32(&pk, failed[i]);
    }
    kvc_reply_t r;
    int rc = kvc_call(self, KVT_REQ_COMMIT, &sb, &r);
    uint64_t st = 0;
    if (rc == 0)
        rc = kvc_need_uint(self, KVT_REQ_COMMIT, &r.up.data, "stored", &st);
    if (rc == 0 && stored)
        *stored = st > UINT32_MAX ? UINT32_MAX : (uint32_t)st;
    kvc_reply_free(&r);
    return rc;
}

int kvtier_acquire(kvtier_t *self, const char *ns, const char *salt,
                   const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, kvtier_slot_t *slots,
                   uint32_t *nslots, uint64_t *lease)
{
    int rc = s_check_slots_call(self, "acquire", ns, salt, keys, n, slots, nslots, lease);
    if (rc)
        return rc;
    rc = s_check_arena(self, "acquire");
    if (rc)
        return rc;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_keyed(&sb, &pk, ns, salt, keys, n, 0);
    kvc_reply_t r;
    rc = kvc_call(self, KVT_REQ_ACQUIRE, &sb, &r);
    uint64_t ls = 0;
    uint32_t got = 0;
    if (rc == 0)
        rc = kvc_need_uint(self, KVT_REQ_ACQUIRE, &r.up.data, "lease", &ls);
    if (rc == 0)
        rc = s_parse_slots(self, KVT_REQ_ACQUIRE, &r.up.data, n, false, slots, &got);
    if (rc == 0 && got && !ls)
        rc = kvc_bad_reply(self, KVT_REQ_ACQUIRE, "lease", "is 0 with slots pinned");
    if (rc == 0) {
        *nslots = got;
        *lease = ls;
    } else if (ls) {
        s_abandon(self, ls);
    }
    kvc_reply_free(&r);
    return rc;
}

/* RELEASE, waiting for its answer or (wait false) not: then the reply is skipped by a later
 * call's receive loop, like a timed-out call's. */
static int s_release(kvtier_t *self, uint64_t lease, bool wait)
{
    if (!self)
        return KVT_EINVAL;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    kvc_body_begin(&sb, &pk, 1);
    s_pack_uint_field(&pk, "lease", lease);
    if (!wait) {
        int rc = kvc_post(self, KVT_REQ_RELEASE, sb.data, sb.size);
        msgpack_sbuffer_destroy(&sb);
        return rc;
    }
    kvc_reply_t r;
    int rc = kvc_call(self, KVT_REQ_RELEASE, &sb, &r);
    kvc_reply_free(&r);
    return rc;
}

int kvtier_release(kvtier_t *self, uint64_t lease)
{
    return s_release(self, lease, true);
}

int kvtier_release_async(kvtier_t *self, uint64_t lease)
{
    return s_release(self, lease, false);
}

int kvtier_put(kvtier_t *self, const char *ns, const char *salt,
               const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, const void *const *data,
               const size_t *lens, uint32_t *stored)
{
    return kvtier_put_labeled(self, ns, salt, keys, n, NULL, data, lens, stored);
}

int kvtier_put_labeled(kvtier_t *self, const char *ns, const char *salt,
                       const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n,
                       const char *const *labels, const void *const *data, const size_t *lens,
                       uint32_t *stored)
{
    if (stored)
        *stored = 0;
    if (!self)
        return KVT_EINVAL;
    int rc = s_check_keyed(self, "put", ns, salt, keys, n);
    if (rc == 0)
        rc = s_check_labels(self, "put", labels, n);
    if (rc)
        return rc;
    if (n && (!data || !lens))
        return kvc_fail(self, KVT_EINVAL, "put: data and lens must not be NULL with n = %u", n);
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!data[i] && lens[i])
            return kvc_fail(self, KVT_EINVAL, "put: data[%u] is NULL with %zu bytes", i, lens[i]);
        if (lens[i] > UINT64_MAX - total)
            return kvc_fail(self, KVT_ETOOBIG, "put: the sizes overflow 64 bits");
        total += lens[i];
    }
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_keyed(&sb, &pk, ns, salt, keys, n, labels ? 1 : 0);
    if (labels)
        s_pack_labels(&pk, labels, n);
    /* The daemon refuses a message over max_message anyway; saying so here spares sending it. */
    if (self->info.max_message && total + sb.size > self->info.max_message) {
        msgpack_sbuffer_destroy(&sb);
        return kvc_fail(self, KVT_ETOOBIG,
                        "put: %llu bytes exceed the daemon's max_message of %llu: put fewer "
                        "objects per call",
                        (unsigned long long)(total + sb.size),
                        (unsigned long long)self->info.max_message);
    }
    kvc_reply_t r;
    rc = kvc_call_data(self, KVT_REQ_PUT, &sb, data, lens, n, KVC_DATA_NONE, &r);
    uint64_t st = 0;
    if (rc == 0)
        rc = kvc_need_count(self, KVT_REQ_PUT, &r.up.data, "stored", n, &st);
    if (rc == 0 && stored)
        *stored = (uint32_t)st;
    kvc_reply_free(&r);
    return rc;
}

/* GET with the data frames copied (KVC_DATA_COPY: out[i] owned by the caller) or kept
 * (KVC_DATA_KEEP: out[i] point into *frames). */
static int s_get_data(kvtier_t *self, const char *ns, const char *salt,
                      const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, kvtier_buf_t *out,
                      uint32_t *found, kvc_data_mode_t mode, kvtier_frames_t **frames)
{
    if (found)
        *found = 0;
    if (frames)
        *frames = NULL;
    for (uint32_t i = 0; out && i < n; i++)
        out[i] = (kvtier_buf_t){NULL, 0};
    if (!self)
        return KVT_EINVAL;
    int rc = s_check_keyed(self, "get", ns, salt, keys, n);
    if (rc)
        return rc;
    if (!found || (n && !out) || (mode == KVC_DATA_KEEP && !frames))
        return kvc_fail(self, KVT_EINVAL, "get: out, found and frames must not be NULL");
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_keyed(&sb, &pk, ns, salt, keys, n, 0);
    kvc_reply_t r;
    rc = kvc_call_data(self, KVT_REQ_GET, &sb, NULL, NULL, 0, mode, &r);
    uint64_t f = 0;
    uint32_t got = mode == KVC_DATA_KEEP ? (r.frames ? r.frames->n : 0) : r.ndata;
    if (rc == 0)
        rc = kvc_need_count(self, KVT_REQ_GET, &r.up.data, "found", n, &f);
    if (rc == 0 && f != got)
        rc = kvc_fail(self, KVT_EINTERNAL,
                      "malformed get reply from the daemon: found %llu with %u data frames",
                      (unsigned long long)f, got);
    if (rc == 0 && mode == KVC_DATA_COPY) {
        /* the copies change owner: the caller frees them */
        for (uint32_t i = 0; i < r.ndata; i++)
            out[i] = r.data[i];
        r.ndata = 0;
    } else if (rc == 0 && got) {
        for (uint32_t i = 0; i < got; i++)
            out[i] =
                (kvtier_buf_t){zmq_msg_data(&r.frames->msgs[i]), zmq_msg_size(&r.frames->msgs[i])};
        *frames = r.frames;
        r.frames = NULL;
    }
    if (rc == 0)
        *found = (uint32_t)f;
    kvc_reply_free(&r);
    return rc;
}

int kvtier_get(kvtier_t *self, const char *ns, const char *salt,
               const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, kvtier_buf_t *out,
               uint32_t *found)
{
    return s_get_data(self, ns, salt, keys, n, out, found, KVC_DATA_COPY, NULL);
}

int kvtier_get_frames(kvtier_t *self, const char *ns, const char *salt,
                      const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, kvtier_buf_t *out,
                      uint32_t *found, kvtier_frames_t **frames)
{
    return s_get_data(self, ns, salt, keys, n, out, found, KVC_DATA_KEEP, frames);
}

int kvtier_remove(kvtier_t *self, const char *ns, const char *salt,
                  const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, uint32_t *removed)
{
    if (removed)
        *removed = 0;
    if (!self)
        return KVT_EINVAL;
    int rc = s_check_keyed(self, "remove", ns, salt, keys, n);
    if (rc)
        return rc;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_keyed(&sb, &pk, ns, salt, keys, n, 0);
    kvc_reply_t r;
    rc = kvc_call(self, KVT_REQ_REMOVE, &sb, &r);
    uint64_t rm = 0;
    if (rc == 0)
        rc = kvc_need_count(self, KVT_REQ_REMOVE, &r.up.data, "removed", n, &rm);
    if (rc == 0 && removed)
        *removed = (uint32_t)rm;
    kvc_reply_free(&r);
    return rc;
}

int kvtier_clear(kvtier_t *self, const char *ns, uint64_t *removed)
{
    if (removed)
        *removed = 0;
    if (!self)
        return KVT_EINVAL;
    self->error[0] = '\0';
    int rc = ns ? s_check_ns(self, "clear", ns) : 0;
    if (rc)
        return rc;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    kvc_body_begin(&sb, &pk, ns ? 1 : 0);
    if (ns) {
        kvt_pack_str(&pk, "ns");
        kvt_pack_str(&pk, ns);
    }
    kvc_reply_t r;
    rc = kvc_call(self, KVT_REQ_CLEAR, &sb, &r);
    uint64_t rm = 0;
    if (rc == 0)
        rc = kvc_need_uint(self, KVT_REQ_CLEAR, &r.up.data, "removed", &rm);
    if (rc == 0 && removed)
        *removed = rm;
    kvc_reply_free(&r);
    return rc;
}

/* ---- GPU KV cache ---- */

int kvtier_register_gpu(kvtier_t *self, const kvtier_gpu_layout_t *lay)
{
    if (!self)
        return KVT_EINVAL;
    self->error[0] = '\0';
    if (!lay || !lay->handles || !lay->dtype || lay->layers == 0)
        return kvc_fail(self, KVT_EINVAL,
                        "register_gpu: layout, handles, dtype and layers "
                        "are required");
    msgpack_sbuffer sb;
    msgpack_packer pk;
    kvc_body_begin(&sb, &pk, 7 + (lay->offsets ? 1 : 0));
    s_pack_uint_field(&pk, "device", lay->device);
    s_pack_uint_field(&pk, "layers", lay->layers);
    s_pack_uint_field(&pk, "num_blocks", lay->num_blocks);
    s_pack_uint_field(&pk, "block_tokens", lay->block_tokens);
    s_pack_uint_field(&pk, "token_bytes", lay->token_bytes);
    kvt_pack_str(&pk, "dtype");
    kvt_pack_str(&pk, lay->dtype);
    kvt_pack_str(&pk, "handles");
    msgpack_pack_array(&pk, lay->layers);
    for (uint32_t i = 0; i < lay->layers; i++)
        s_pack_bin(&pk, lay->handles[i], KVTIER_IPC_HANDLE_LEN);
    if (lay->offsets) {
        kvt_pack_str(&pk, "offsets");
        msgpack_pack_array(&pk, lay->layers);
        for (uint32_t i = 0; i < lay->layers; i++)
            msgpack_pack_uint64(&pk, lay->offsets[i]);
    }
    /* a copy to say again after a re-establishment, and room for it, before it is sent */
    void *copy = kvc_gpu_room(self) == 0 ? malloc(sb.size) : NULL;
    size_t len = sb.size;
    if (!copy) {
        msgpack_sbuffer_destroy(&sb);
        return kvc_fail(self, KVT_ENOMEM, "register_gpu: out of memory");
    }
    memcpy(copy, sb.data, len);
    kvc_reply_t r;
    int rc = kvc_call(self, KVT_REQ_REGISTER_GPU, &sb, &r);
    kvc_reply_free(&r);
    if (rc == 0)
        kvc_gpu_keep(self, lay->device, copy, len);
    else
        free(copy);
    return rc;
}

int kvtier_unregister_gpu(kvtier_t *self, uint32_t device)
{
    if (!self)
        return KVT_EINVAL;
    self->error[0] = '\0';
    msgpack_sbuffer sb;
    msgpack_packer pk;
    kvc_body_begin(&sb, &pk, 1);
    s_pack_uint_field(&pk, "device", device);
    kvc_gpu_forget(self, device);
    kvc_reply_t r;
    int rc = kvc_call(self, KVT_REQ_UNREGISTER_GPU, &sb, &r);
    kvc_reply_free(&r);
    if (rc == KVT_ENOINST) { /* re-established without it: gone, as asked */
        self->error[0] = '\0';
        rc = 0;
    }
    return rc;
}

static int s_gpu_copy(kvtier_t *self, uint32_t type, const char *ns, const char *salt,
                      uint32_t device, const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n,
                      const uint64_t *block_ids, uint32_t nblock_ids, const void *event,
                      const char *count_name, uint32_t *count)
{
    if (count)
        *count = 0;
    if (!self)
        return KVT_EINVAL;
    int rc = s_check_keyed(self, kvt_proto_name(type), ns, salt, keys, n);
    if (rc)
        return rc;
    if (nblock_ids && !block_ids)
        return kvc_fail(self, KVT_EINVAL, "%s: block_ids is NULL", kvt_proto_name(type));
    rc = kvc_revive(self, type);
    if (rc == 0)
        rc = kvc_gpu_ensure(self, type, device);
    if (rc)
        return rc;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_keyed(&sb, &pk, ns, salt, keys, n, 2 + (event ? 1 : 0));
    s_pack_uint_field(&pk, "device", device);
    kvt_pack_str(&pk, "block_ids");
    msgpack_pack_array(&pk, nblock_ids);
    for (uint32_t i = 0; i < nblock_ids; i++)
        msgpack_pack_uint64(&pk, block_ids[i]);
    if (event) {
        kvt_pack_str(&pk, "event");
        s_pack_bin(&pk, event, KVTIER_IPC_HANDLE_LEN);
    }
    kvc_reply_t r;
    rc = kvc_call(self, type, &sb, &r);
    uint64_t v = 0;
    if (rc == 0)
        rc = kvc_need_count(self, type, &r.up.data, count_name, n, &v);
    if (rc == 0 && count)
        *count = (uint32_t)v;
    kvc_reply_free(&r);
    return rc;
}

int kvtier_store_gpu(kvtier_t *self, const char *ns, const char *salt, uint32_t device,
                     const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, const uint64_t *block_ids,
                     uint32_t nblock_ids, const void *event, uint32_t *stored)
{
    return s_gpu_copy(self, KVT_REQ_STORE_GPU, ns, salt, device, keys, n, block_ids, nblock_ids,
                      event, "stored", stored);
}

int kvtier_retrieve_gpu(kvtier_t *self, const char *ns, const char *salt, uint32_t device,
                        const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n,
                        const uint64_t *block_ids, uint32_t nblock_ids, const void *event,
                        uint32_t *found)
{
    return s_gpu_copy(self, KVT_REQ_RETRIEVE_GPU, ns, salt, device, keys, n, block_ids, nblock_ids,
                      event, "found", found);
}

/* ---- token hashing ---- */

/* tokens as the little-endian bytes HASH_TOKENS and kvt_hash_tokens take. On a little-endian
 * host that is the array itself; elsewhere a converted copy in *owned (caller frees). */
static const uint8_t *s_le_tokens(const uint32_t *tokens, size_t ntokens, uint8_t **owned)
{
    *owned = NULL;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    (void)ntokens;
    return (const uint8_t *)tokens;
#else
    uint8_t *b = malloc(ntokens * 4 + 1);
    if (!b)
        return NULL;
    for (size_t i = 0; i < ntokens; i++)
        for (int j = 0; j < 4; j++)
            b[i * 4 + j] = (uint8_t)(tokens[i] >> (8 * j));
    *owned = b;
    return b;
#endif
}

uint32_t kvtier_hash_tokens_local(const uint32_t *tokens, size_t ntokens, uint32_t chunk_tokens,
                                  const char *salt, uint8_t (*keys)[KVTIER_KEY_LEN])
{
    /* No connection, so no daemon default for chunk_tokens: 0 (like bad input) gives 0 keys. */
    if (chunk_tokens == 0 || (ntokens && !tokens) || ntokens > SIZE_MAX / 4)
        return 0;
    size_t want = ntokens / chunk_tokens;
    if (want == 0)
        return 0;
    if (!keys || want > UINT32_MAX || (salt && strlen(salt) > KVT_MAX_SALT))
        return 0;
    uint8_t *owned;
    const uint8_t *bytes = s_le_tokens(tokens, ntokens, &owned);
    if (!bytes)
        return 0;
    uint32_t n = kvt_hash_tokens(bytes, ntokens * 4, chunk_tokens, salt, salt ? strlen(salt) : 0,
                                 keys, (uint32_t)want);
    free(owned);
    return n < want ? n : (uint32_t)want;
}

int kvtier_hash_tokens(kvtier_t *self, const uint32_t *tokens, size_t ntokens,
                       uint32_t chunk_tokens, const char *salt, uint8_t (*keys)[KVTIER_KEY_LEN],
                       uint32_t *nkeys)
{
    if (nkeys)
        *nkeys = 0;
    if (!self)
        return KVT_EINVAL;
    self->error[0] = '\0';
    uint32_t ct = chunk_tokens ? chunk_tokens : self->info.chunk_tokens;
    if (!nkeys || (ntokens && !tokens))
        return kvc_fail(self, KVT_EINVAL, "hash_tokens: tokens and nkeys must not be NULL");
    if (ct == 0)
        return kvc_fail(self, KVT_EINVAL, "hash_tokens: chunk_tokens is 0 and HELLO gave none");
    if (ntokens > UINT32_MAX / 4 ||
        (self->info.max_message && (uint64_t)ntokens * 4 > self->info.max_message))
        return kvc_fail(self, KVT_ETOOBIG, "hash_tokens: %zu tokens exceed max_message", ntokens);
    int rc = s_check_salt(self, "hash_tokens", salt);
    if (rc)
        return rc;
    size_t want = ntokens / ct;
    if (want && !keys)
        return kvc_fail(self, KVT_EINVAL, "hash_tokens: keys is NULL for %zu keys", want);
    uint8_t *owned = NULL;
    const uint8_t *bytes = ntokens ? s_le_tokens(tokens, ntokens, &owned) : NULL;
    if (ntokens && !bytes)
        return kvc_fail(self, KVT_ENOMEM, "hash_tokens: out of memory");
    msgpack_sbuffer sb;
    msgpack_packer pk;
    kvc_body_begin(&sb, &pk, 1 + (chunk_tokens ? 1 : 0) + (s_has_salt(salt) ? 1 : 0));
    kvt_pack_str(&pk, "tokens");
    s_pack_bin(&pk, bytes, ntokens * 4);
    free(owned);
    if (chunk_tokens)
        s_pack_uint_field(&pk, "chunk_tokens", chunk_tokens);
    if (s_has_salt(salt)) {
        kvt_pack_str(&pk, "salt");
        kvt_pack_str(&pk, salt);
    }
    kvc_reply_t r;
    rc = kvc_call(self, KVT_REQ_HASH_TOKENS, &sb, &r);
    const msgpack_object *a = rc ? NULL : kvc_get(&r.up.data, "keys");
    if (rc == 0 && (!a || a->type != MSGPACK_OBJECT_ARRAY))
        rc = kvc_bad_reply(self, KVT_REQ_HASH_TOKENS, "keys", a ? "is not an array" : "is missing");
    if (rc == 0 && a->via.array.size != want)
        rc = kvc_fail(self, KVT_EINTERNAL,
                      "malformed hash_tokens reply from the daemon: %u keys for %zu full chunks",
                      a->via.array.size, want);
    for (uint32_t i = 0; rc == 0 && i < a->via.array.size; i++) {
        const msgpack_object *e = &a->via.array.ptr[i];
        if (e->type != MSGPACK_OBJECT_BIN || e->via.bin.size != KVTIER_KEY_LEN)
            rc = kvc_bad_reply(self, KVT_REQ_HASH_TOKENS, "keys", "has an entry not a 16-byte bin");
        else
            memcpy(keys[i], e->via.bin.ptr, KVTIER_KEY_LEN);
    }
    if (rc == 0)
        *nkeys = (uint32_t)want;
    kvc_reply_free(&r);
    return rc;
}
