/* DESIGN: one libzmq DEALER per kvtier_t, used only by the calling thread (a kvtier_t has no
 * lock: one per thread). Requests carry an increasing uid; the reply loop drops replies with
 * other uids (answers to calls that timed out), data frames included. Bodies are encoded with
 * msgpack-c; a reply body is copied out of its frame and decoded into a zone, both freed per
 * call (s_reply_t).
 *
 * Two data paths. The shared-memory one is zero-copy: connect maps the arena HELLO names
 * (shm.path, MAP_SHARED, read-write) and RESERVE/ACQUIRE slots are pointers into that mapping.
 * When the arena cannot be mapped (a client on another host over tcp), connect still succeeds
 * and only RESERVE/ACQUIRE refuse, locally, with KVT_EUNAVAIL. The inline one (PUT/GET) carries
 * the bytes in raw frames: PUT lets zmq_send copy each buffer (libzmq may still be sending after
 * a timed-out call returns, when the caller has already freed its data), and GET copies each
 * reply frame into one malloc'd buffer that the caller owns.
 *
 * Every reply field is checked before it is used: a daemon that breaks the protocol gets
 * KVT_EINTERNAL with a sentence naming the field, never a crash or an out-of-arena pointer.
 * Outputs are zeroed on entry, so they read as "nothing" after any failure. */
#include "kvtier.h"

#include "kvtier_curve.h"
#include "kvt_error.h"
#include "kvt_hash.h"
#include "kvt_msg.h"
#include "kvt_proto.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

_Static_assert(KVTIER_KEY_LEN == KVT_KEY_LEN, "kvtier.h and the protocol disagree on keys");
_Static_assert(KVTIER_KEY_LEN == KVT_HASH_KEY_LEN, "kvtier.h and kvt_hash disagree on keys");

struct kvtier {
    void *ctx;
    void *sock;
    uint64_t next_uid;
    int timeout_ms;
    char instance[KVT_MAX_NAME + 1];
    kvtier_info_t info;
    void *arena; /* MAP_SHARED mapping of HELLO's shm.path; NULL when it could not be mapped */
    size_t arena_size;
    char arena_why[384]; /* why arena is NULL: the message of a local KVT_EUNAVAIL */
    char error[256];
    uint64_t spin_ns; /* busy-poll for a reply this long before sleeping (0: never) */
};

static _Atomic unsigned s_seq;

static int s_fail(kvtier_t *self, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int s_fail(kvtier_t *self, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(self->error, sizeof self->error, fmt, ap);
    va_end(ap);
    return code;
}

/* ---- the process's zmq context ---- */

/* One zmq context for every connection of a process, as zmq intends: eight threads with a
 * connection each would otherwise run eight I/O threads, and on a small machine those, not the
 * daemon, bound the request rate. It has two I/O threads (KVTIER_IO_THREADS), and zmq puts a
 * new connection on the less loaded one, so a connection moving bulk GETs does not hold up the
 * replies of another. Created at the first connect, terminated after the last close. A child
 * forked while connections were open gets a context of its own (the parent's has no I/O thread
 * in the child). */
static pthread_mutex_t s_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static void *s_ctx;
static unsigned s_ctx_refs;
static pid_t s_ctx_pid;

/* An integer from the environment within [lo, hi], else def. */
static int s_env_int(const char *name, int def, int lo, int hi)
{
    const char *v = getenv(name);
    char *end;
    long n = v && *v ? strtol(v, &end, 10) : def;
    return v && *v && (*end || n < lo || n > hi) ? def : (int)n;
}

/* A child forked while another thread held the lock would never see it released. */
static void s_ctx_atfork_child(void)
{
    pthread_mutex_init(&s_ctx_lock, NULL);
}

static void s_ctx_once(void)
{
    pthread_atfork(NULL, NULL, s_ctx_atfork_child);
}

static void *s_ctx_acquire(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, s_ctx_once);
    pthread_mutex_lock(&s_ctx_lock);
    if (s_ctx && s_ctx_pid != getpid()) {
        s_ctx = NULL; /* the parent's: left alone */
        s_ctx_refs = 0;
    }
    if (!s_ctx) {
        s_ctx = zmq_ctx_new();
        if (s_ctx)
            zmq_ctx_set(s_ctx, ZMQ_IO_THREADS, s_env_int("KVTIER_IO_THREADS", 2, 1, 16));
        s_ctx_pid = getpid();
    }
    void *ctx = s_ctx;
    if (ctx)
        s_ctx_refs++;
    pthread_mutex_unlock(&s_ctx_lock);
    return ctx;
}

static void s_ctx_release(void *ctx)
{
    if (!ctx)
        return;
    pthread_mutex_lock(&s_ctx_lock);
    /* a handle inherited through fork: its context belongs to the parent (no I/O thread here,
     * so terminating it would hang) */
    bool last = ctx == s_ctx && s_ctx_pid == getpid() && --s_ctx_refs == 0;
    if (last)
        s_ctx = NULL;
    pthread_mutex_unlock(&s_ctx_lock);
    if (last)
        zmq_ctx_term(ctx); /* its sockets are closed (linger 0): returns at once */
}

/* ---- envelope ---- */

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

/* What a call keeps of a reply's data frames: nothing, copies, or the frames themselves. */
typedef enum { S_DATA_NONE, S_DATA_COPY, S_DATA_KEEP } s_data_mode_t;

/* Data frames kept as received (kvtier_get_frames): the caller's views point into them. */
struct kvtier_frames {
    uint32_t n, cap;
    zmq_msg_t *msgs;
};

/* A reply: body copied out of its frame (msgpack objects point into it) and, when the caller
 * asked for them, copies of the data frames or the frames themselves. s_reply_free releases
 * whatever is still owned. */
typedef struct {
    void *buf;
    size_t len;
    msgpack_unpacked up;
    kvtier_buf_t *data;
    uint32_t ndata, cap;
    kvtier_frames_t *frames;
} s_reply_t;

static void s_reply_init(s_reply_t *r)
{
    memset(r, 0, sizeof *r);
    msgpack_unpacked_init(&r->up);
}

static void s_reply_free(s_reply_t *r)
{
    msgpack_unpacked_destroy(&r->up);
    free(r->buf);
    r->buf = NULL;
    for (uint32_t i = 0; i < r->ndata; i++)
        free(r->data[i].data);
    free(r->data);
    r->data = NULL;
    r->ndata = r->cap = 0;
    kvtier_frames_free(&r->frames);
}

void kvtier_frames_free(kvtier_frames_t **frames_p)
{
    if (!frames_p || !*frames_p)
        return;
    kvtier_frames_t *f = *frames_p;
    for (uint32_t i = 0; i < f->n; i++)
        zmq_msg_close(&f->msgs[i]);
    free(f->msgs);
    free(f);
    *frames_p = NULL;
}

/* Moves a received data frame into r->frames (no copy of its bytes). */
static int s_keep_frame(s_reply_t *r, zmq_msg_t *part)
{
    if (!r->frames && !(r->frames = calloc(1, sizeof *r->frames)))
        return KVT_ENOMEM;
    kvtier_frames_t *f = r->frames;
    if (f->n == f->cap) {
        uint32_t cap = f->cap ? f->cap * 2 : 8;
        zmq_msg_t *m = realloc(f->msgs, cap * sizeof *m);
        if (!m)
            return KVT_ENOMEM;
        f->msgs = m;
        f->cap = cap;
    }
    zmq_msg_init(&f->msgs[f->n]);
    zmq_msg_move(&f->msgs[f->n], part);
    f->n++;
    return 0;
}

static int s_keep_data(s_reply_t *r, const zmq_msg_t *part)
{
    if (r->ndata == r->cap) {
        uint32_t cap = r->cap ? r->cap * 2 : 8;
        kvtier_buf_t *d = realloc(r->data, cap * sizeof *d);
        if (!d)
            return KVT_ENOMEM;
        r->data = d;
        r->cap = cap;
    }
    size_t len = zmq_msg_size(part);
    void *copy = malloc(len ? len : 1);
    if (!copy)
        return KVT_ENOMEM;
    memcpy(copy, zmq_msg_data((zmq_msg_t *)part), len);
    r->data[r->ndata++] = (kvtier_buf_t){copy, len};
    return 0;
}

static int s_send_request(kvtier_t *self, uint64_t uid, uint32_t type, const void *body,
                          size_t len, const void *const *data, const size_t *lens, uint32_t ndata)
{
    char ubuf[16], tbuf[16];
    int ulen = s_pack_uint(ubuf, uid), tlen = s_pack_uint(tbuf, type);
    /* A multipart message is queued atomically: once the uid frame is accepted, the rest
     * cannot block, so a failure here leaves nothing half-sent. */
    int bad = s_send_frame(self->sock, ubuf, (size_t)ulen, 1) ||
              s_send_frame(self->sock, tbuf, (size_t)tlen, 1) ||
              s_send_frame(self->sock, body, len, ndata > 0);
    for (uint32_t i = 0; !bad && i < ndata; i++)
        bad = s_send_frame(self->sock, data[i], lens[i], i + 1 < ndata);
    if (bad)
        return s_fail(self, KVT_EUNAVAIL, "cannot send to the daemon: %s",
                      zmq_errno() == EAGAIN ? "no connection (timed out)"
                                            : zmq_strerror(zmq_errno()));
    return 0;
}

static uint64_t s_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Busy-polls for the first part of a message for up to spin_ns: a reply that comes back within
 * it costs no sleep and wake-up of this thread (tens of microseconds on a VM). -1 when none
 * came (the caller then blocks). */
static int s_spin_recv(kvtier_t *self, zmq_msg_t *part)
{
    uint64_t end = s_mono_ns() + self->spin_ns;
    do {
        int n = zmq_msg_recv(part, self->sock, ZMQ_DONTWAIT);
        if (n >= 0 || zmq_errno() != EAGAIN)
            return n;
    } while (s_mono_ns() < end);
    return -1;
}

/* Receives until the reply to `uid` arrives (copying its body, and copying or keeping its data
 * frames as `mode` says), skipping replies to earlier calls that timed out. Every message is read to its
 * last part, so the socket never gets out of step, even when a copy fails. */
static int s_recv_reply(kvtier_t *self, uint64_t uid, s_data_mode_t mode, s_reply_t *r)
{
    for (;;) {
        bool mine = false;
        uint32_t idx = 0;
        int rc = 0, more = 1;
        while (more) {
            zmq_msg_t part;
            zmq_msg_init(&part);
            int got = idx == 0 && self->spin_ns ? s_spin_recv(self, &part) : -1;
            if (got < 0 && zmq_msg_recv(&part, self->sock, 0) < 0) {
                int e = zmq_errno();
                zmq_msg_close(&part);
                if (idx > 0 && e == EINTR)
                    continue; /* the rest of a multipart message is already here */
                if (e == EAGAIN)
                    return s_fail(self, KVT_ETIMEDOUT, "timed out waiting for the daemon");
                return s_fail(self, KVT_EUNAVAIL, "%s", zmq_strerror(e));
            }
            more = zmq_msg_more(&part);
            if (idx == 0) {
                uint64_t ruid = 0;
                mine = kvt_msg_read_uint(zmq_msg_data(&part), zmq_msg_size(&part), &ruid) == 0 &&
                       ruid == uid;
            } else if (mine && idx == 2) {
                r->len = zmq_msg_size(&part);
                r->buf = malloc(r->len ? r->len : 1);
                if (r->buf)
                    memcpy(r->buf, zmq_msg_data(&part), r->len);
                else
                    rc = KVT_ENOMEM;
            } else if (mine && idx > 2 && mode == S_DATA_COPY && rc == 0) {
                rc = s_keep_data(r, &part);
            } else if (mine && idx > 2 && mode == S_DATA_KEEP && rc == 0) {
                rc = s_keep_frame(r, &part);
            }
            zmq_msg_close(&part);
            idx++;
        }
        if (!mine)
            continue;
        if (rc)
            return s_fail(self, rc, "out of memory copying the reply");
        if (idx < 3)
            return s_fail(self, KVT_EINTERNAL, "reply of %u frames, expected [uid, type, body]",
                          idx);
        return 0;
    }
}

static int s_exchange(kvtier_t *self, uint32_t type, const void *body, size_t len,
                      const void *const *data, const size_t *lens, uint32_t ndata,
                      s_data_mode_t mode, s_reply_t *r)
{
    self->error[0] = '\0';
    uint64_t uid = self->next_uid++;
    int rc = s_send_request(self, uid, type, body, len, data, lens, ndata);
    return rc ? rc : s_recv_reply(self, uid, mode, r);
}

int kvtier_call(kvtier_t *self, uint32_t type, const void *body, size_t len, void **reply_body,
                size_t *reply_len)
{
    if (!self || !reply_body || !reply_len || (!body && len))
        return self ? s_fail(self, KVT_EINVAL, "kvtier_call: NULL argument") : KVT_EINVAL;
    *reply_body = NULL;
    *reply_len = 0;
    s_reply_t r;
    s_reply_init(&r);
    int rc = s_exchange(self, type, body, len, NULL, NULL, 0, S_DATA_NONE, &r);
    if (rc == 0) {
        *reply_body = r.buf;
        *reply_len = r.len;
        r.buf = NULL;
    }
    s_reply_free(&r);
    return rc;
}

/* ---- reply bodies ---- */

static bool s_key_is(const msgpack_object *k, const char *name)
{
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == strlen(name) &&
           memcmp(k->via.str.ptr, name, k->via.str.size) == 0;
}

/* The value of `name` in a map; NULL when absent or nil (nil counts as absent, as in
 * requests). */
static const msgpack_object *s_get(const msgpack_object *map, const char *name)
{
    if (map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    for (uint32_t i = 0; i < map->via.map.size; i++)
        if (s_key_is(&map->via.map.ptr[i].key, name))
            return map->via.map.ptr[i].val.type == MSGPACK_OBJECT_NIL ? NULL
                                                                      : &map->via.map.ptr[i].val;
    return NULL;
}

static int s_bad_reply(kvtier_t *self, uint32_t type, const char *field, const char *want)
{
    return s_fail(self, KVT_EINTERNAL, "malformed %s reply from the daemon: '%s' %s",
                  kvt_proto_name(type), field, want);
}

/* Sends `body` (consumed) plus data frames and decodes the reply. On 0, r->up.data is the ok
 * body; otherwise the daemon's error is mapped to a KVT_E* code and its message kept. The
 * caller frees r either way. */
static int s_call_data(kvtier_t *self, uint32_t type, msgpack_sbuffer *body,
                       const void *const *data, const size_t *lens, uint32_t ndata,
                       s_data_mode_t mode, s_reply_t *r)
{
    s_reply_init(r);
    int rc = s_exchange(self, type, body->data, body->size, data, lens, ndata, mode, r);
    msgpack_sbuffer_destroy(body);
    if (rc)
        return rc;
    size_t off = 0;
    if (msgpack_unpack_next(&r->up, r->buf, r->len, &off) != MSGPACK_UNPACK_SUCCESS ||
        r->up.data.type != MSGPACK_OBJECT_MAP)
        return s_fail(self, KVT_EINTERNAL, "undecodable %s reply from the daemon",
                      kvt_proto_name(type));
    const msgpack_object *ok = s_get(&r->up.data, "ok");
    if (ok && ok->type == MSGPACK_OBJECT_BOOLEAN && ok->via.boolean)
        return 0;
    const msgpack_object *error = s_get(&r->up.data, "error");
    const msgpack_object *code = error ? s_get(error, "code") : NULL;
    const msgpack_object *msg = error ? s_get(error, "message") : NULL;
    rc = code && code->type == MSGPACK_OBJECT_STR
             ? kvt_err_from_wire(code->via.str.ptr, code->via.str.size)
             : KVT_EINTERNAL;
    if (msg && msg->type == MSGPACK_OBJECT_STR && msg->via.str.size)
        s_fail(self, rc, "%.*s", (int)msg->via.str.size, msg->via.str.ptr);
    else
        s_fail(self, rc, "daemon error without a message (%s)", kvt_err_wire(rc));
    return rc;
}

static int s_call(kvtier_t *self, uint32_t type, msgpack_sbuffer *body, s_reply_t *r)
{
    return s_call_data(self, type, body, NULL, NULL, 0, S_DATA_NONE, r);
}

/* A required non-negative integer of a reply body. */
static int s_need_uint(kvtier_t *self, uint32_t type, const msgpack_object *body,
                       const char *name, uint64_t *out)
{
    const msgpack_object *o = s_get(body, name);
    if (!o || o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return s_bad_reply(self, type, name, o ? "is not a uint" : "is missing");
    *out = o->via.u64;
    return 0;
}

/* An optional one: 0 when absent. */
static int s_opt_uint(kvtier_t *self, uint32_t type, const msgpack_object *body,
                      const char *name, uint64_t *out)
{
    *out = 0;
    return s_get(body, name) ? s_need_uint(self, type, body, name, out) : 0;
}

/* A count that must not exceed `max` (the keys asked for). */
static int s_need_count(kvtier_t *self, uint32_t type, const msgpack_object *body,
                        const char *name, uint64_t max, uint64_t *out)
{
    int rc = s_need_uint(self, type, body, name, out);
    if (rc == 0 && *out > max)
        return s_bad_reply(self, type, name, "exceeds the number of keys asked for");
    return rc;
}

/* ---- request bodies ---- */

static void s_body_begin(msgpack_sbuffer *sb, msgpack_packer *pk, uint32_t n)
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
static void s_body_keyed(msgpack_sbuffer *sb, msgpack_packer *pk, const char *ns,
                         const char *salt, const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n,
                         uint32_t extra)
{
    s_body_begin(sb, pk, 2 + (s_has_salt(salt) ? 1 : 0) + extra);
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

static int s_check_salt(kvtier_t *self, const char *what, const char *salt)
{
    if (salt && strlen(salt) > KVT_MAX_SALT)
        return s_fail(self, KVT_EINVAL, "%s: salt is longer than %d bytes", what, KVT_MAX_SALT);
    return 0;
}

static int s_check_ns(kvtier_t *self, const char *what, const char *ns)
{
    if (!ns)
        return s_fail(self, KVT_EINVAL, "%s: ns is NULL", what);
    size_t len = strlen(ns);
    if (len == 0 || len > KVT_MAX_NS)
        return s_fail(self, KVT_EINVAL, "%s: ns must be 1 to %d bytes", what, KVT_MAX_NS);
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
        rc = s_fail(self, KVT_EINVAL, "%s: keys is NULL with n = %u", what, n);
    return rc;
}

static int s_check_arena(kvtier_t *self, const char *what)
{
    if (self->arena)
        return 0;
    return s_fail(self, KVT_EUNAVAIL, "%s needs the shared-memory arena, and %s", what,
                  self->arena_why);
}

/* ---- connection ---- */

static uint64_t s_uint(const msgpack_object *o)
{
    return o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? o->via.u64 : 0;
}

/* Maps the arena HELLO announced. Failure is not an error of connect: a client on another
 * host has no such file, and PUT/GET still work for it. The reason is kept for the
 * KVT_EUNAVAIL that RESERVE and ACQUIRE then answer. */
static void s_map_arena(kvtier_t *self, const msgpack_object *hello)
{
    const msgpack_object *shm = s_get(hello, "shm");
    const msgpack_object *path = shm ? s_get(shm, "path") : NULL;
    uint64_t size = s_uint(shm ? s_get(shm, "size") : NULL);
    if (!path || path->type != MSGPACK_OBJECT_STR || path->via.str.size == 0 || size == 0) {
        snprintf(self->arena_why, sizeof self->arena_why,
                 "the daemon's HELLO named no shared-memory arena (use kvtier_put/kvtier_get)");
        return;
    }
    char file[4096];
    if (path->via.str.size >= sizeof file || memchr(path->via.str.ptr, 0, path->via.str.size)) {
        snprintf(self->arena_why, sizeof self->arena_why,
                 "the daemon's HELLO named an unusable shared-memory path");
        return;
    }
    memcpy(file, path->via.str.ptr, path->via.str.size);
    file[path->via.str.size] = '\0';
    const char *why = NULL;
    int fd = open(file, O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd < 0)
        why = strerror(errno);
    else if (fstat(fd, &st) != 0)
        why = strerror(errno);
    else if (size > SIZE_MAX || (uint64_t)st.st_size < size)
        /* a mapping past the end of the file would SIGBUS on the first touch */
        why = "the file is smaller than the size HELLO announced";
    if (!why) {
        void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            why = strerror(errno);
        } else {
            self->arena = p;
            self->arena_size = (size_t)size;
        }
    }
    if (fd >= 0)
        close(fd); /* the mapping keeps the memory; the descriptor is not needed */
    if (why)
        snprintf(self->arena_why, sizeof self->arena_why,
                 "the daemon's arena %.120s cannot be mapped here (%s): a client on another "
                 "host uses kvtier_put/kvtier_get",
                 file, why);
}

kvtier_t *kvtier_connect(const char *endpoint, const char *client, const char *instance,
                         int timeout_ms, char *err, size_t errlen)
{
    return kvtier_connect_curve(endpoint, client, instance, timeout_ms, NULL, err, errlen);
}

kvtier_t *kvtier_connect_curve(const char *endpoint, const char *client, const char *instance,
                               int timeout_ms, const kvtier_curve_t *curve, char *err,
                               size_t errlen)
{
    if (!endpoint) {
        snprintf(err, errlen, "no endpoint given");
        return NULL;
    }
    if (!client || !*client)
        client = "kvtier";
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
    self->spin_ns = (uint64_t)s_env_int("KVTIER_SPIN_US", 0, 0, 100000) * 1000u;
    self->ctx = s_ctx_acquire();
    self->sock = self->ctx ? zmq_socket(self->ctx, ZMQ_DEALER) : NULL;
    if (!self->sock) {
        snprintf(err, errlen, "cannot create a socket: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    int linger = 0;
    zmq_setsockopt(self->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(self->sock, ZMQ_RCVTIMEO, &self->timeout_ms, sizeof self->timeout_ms);
    zmq_setsockopt(self->sock, ZMQ_SNDTIMEO, &self->timeout_ms, sizeof self->timeout_ms);
    bool curved = false;
    if (kvt__curve_setup(self->sock, endpoint, curve, &curved, err, errlen) != 0)
        goto fail;
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
        snprintf(err, errlen, "HELLO to %s failed: %s (%s)%s", endpoint, self->error,
                 kvt_err_wire(rc),
                 curved && rc == KVT_ETIMEDOUT
                     ? "; with CURVE, check the server key and that this client's "
                       "certificate is in the daemon's curve.clients"
                     : "");
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
    s_map_arena(self, body);
    s_reply_free(&r);
    return self;
fail:
    if (self->sock)
        zmq_close(self->sock);
    s_ctx_release(self->ctx);
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
    if (self->arena)
        munmap(self->arena, self->arena_size);
    zmq_close(self->sock);
    s_ctx_release(self->ctx);
    free(self);
    *self_p = NULL;
}

/* The public codes are the internal vocabulary's numbers: keep them in step. */
_Static_assert(KVTIER_EBADREQ == KVT_EBADREQ && KVTIER_ENOSPC == KVT_ENOSPC &&
                   KVTIER_ELEXPIRED == KVT_ELEXPIRED && KVTIER_EUNAVAIL == KVT_EUNAVAIL &&
                   KVTIER_ETIMEDOUT == KVT_ETIMEDOUT && KVTIER_EINVAL == KVT_EINVAL,
               "kvtier.h error codes differ from kvt_error.h");

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
    if (!self || !json_out)
        return self ? s_fail(self, KVT_EINVAL, "kvtier_stats: json_out is NULL") : KVT_EINVAL;
    *json_out = NULL;
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

/* ---- the cache ---- */

/* Best-effort RELEASE of a lease whose reply could not be used, so that the reservation or
 * pin does not wait for lease_ms; the caller's error message is kept. */
static void s_abandon(kvtier_t *self, uint64_t lease)
{
    char saved[sizeof self->error];
    memcpy(saved, self->error, sizeof saved);
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_begin(&sb, &pk, 1);
    s_pack_uint_field(&pk, "lease", lease);
    s_reply_t r;
    s_call(self, KVT_REQ_RELEASE, &sb, &r);
    s_reply_free(&r);
    memcpy(self->error, saved, sizeof saved);
}

/* slots: [{offset, length} | nil], at most n of them, each inside this client's arena. */
static int s_parse_slots(kvtier_t *self, uint32_t type, const msgpack_object *body, uint32_t n,
                         bool allow_nil, kvtier_slot_t *slots, uint32_t *nslots)
{
    const msgpack_object *a = s_get(body, "slots");
    if (!a || a->type != MSGPACK_OBJECT_ARRAY)
        return s_bad_reply(self, type, "slots", a ? "is not an array" : "is missing");
    if (a->via.array.size > n)
        return s_bad_reply(self, type, "slots", "has more entries than keys");
    for (uint32_t i = 0; i < a->via.array.size; i++) {
        const msgpack_object *e = &a->via.array.ptr[i];
        slots[i] = (kvtier_slot_t){NULL, 0, 0};
        if (e->type == MSGPACK_OBJECT_NIL && allow_nil)
            continue;
        uint64_t off, len;
        int rc = e->type == MSGPACK_OBJECT_MAP ? 0
                                               : s_bad_reply(self, type, "slots", "has a non-map");
        if (rc == 0)
            rc = s_need_uint(self, type, e, "offset", &off);
        if (rc == 0)
            rc = s_need_uint(self, type, e, "length", &len);
        if (rc)
            return rc;
        if (len == 0 || off > self->arena_size || len > self->arena_size - off)
            return s_bad_reply(self, type, "slots", "has a range outside the arena");
        slots[i] = (kvtier_slot_t){(uint8_t *)self->arena + off, off, len};
    }
    *nslots = a->via.array.size;
    return 0;
}

int kvtier_lookup(kvtier_t *self, const char *ns, const char *salt,
                  const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, unsigned flags,
                  uint32_t *hits, uint32_t *l1, uint64_t *lease, uint64_t *job)
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
        return s_fail(self, KVT_EINVAL, "lookup: hits is NULL");
    if (flags & ~(KVTIER_LOCK | KVTIER_PREFETCH))
        return s_fail(self, KVT_EINVAL, "lookup: unknown flags 0x%x", flags);
    if ((flags & KVTIER_LOCK) && !lease)
        return s_fail(self, KVT_EINVAL, "lookup: KVTIER_LOCK needs a lease pointer");
    if ((flags & KVTIER_PREFETCH) && !job)
        return s_fail(self, KVT_EINVAL, "lookup: KVTIER_PREFETCH needs a job pointer");
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
    s_reply_t r;
    rc = s_call(self, KVT_REQ_LOOKUP, &sb, &r);
    uint64_t h = 0, in_l1 = 0, ls = 0, jb = 0;
    if (rc == 0)
        rc = s_opt_uint(self, KVT_REQ_LOOKUP, &r.up.data, "lease", &ls);
    if (rc == 0)
        rc = s_need_count(self, KVT_REQ_LOOKUP, &r.up.data, "hits", n, &h);
    if (rc == 0)
        rc = s_need_count(self, KVT_REQ_LOOKUP, &r.up.data, "l1", h, &in_l1);
    if (rc == 0)
        rc = s_opt_uint(self, KVT_REQ_LOOKUP, &r.up.data, "job", &jb);
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
    s_reply_free(&r);
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
        return s_fail(self, KVT_EINVAL, "prefetch_status: done is NULL");
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_begin(&sb, &pk, 1);
    s_pack_uint_field(&pk, "job", job);
    s_reply_t r;
    int rc = s_call(self, KVT_REQ_PREFETCH_STATUS, &sb, &r);
    const msgpack_object *d = rc ? NULL : s_get(&r.up.data, "done");
    uint64_t ld = 0, h = 0;
    if (rc == 0 && (!d || d->type != MSGPACK_OBJECT_BOOLEAN))
        rc = s_bad_reply(self, KVT_REQ_PREFETCH_STATUS, "done", d ? "is not a bool" : "is missing");
    if (rc == 0)
        rc = s_need_uint(self, KVT_REQ_PREFETCH_STATUS, &r.up.data, "loaded", &ld);
    if (rc == 0)
        rc = s_need_uint(self, KVT_REQ_PREFETCH_STATUS, &r.up.data, "hits", &h);
    if (rc == 0) {
        *done = d->via.boolean;
        if (loaded)
            *loaded = ld > UINT32_MAX ? UINT32_MAX : (uint32_t)ld;
        if (hits)
            *hits = h > UINT32_MAX ? UINT32_MAX : (uint32_t)h;
    }
    s_reply_free(&r);
    return rc;
}

/* The common checks of RESERVE and ACQUIRE: outputs zeroed, arguments present. */
static int s_check_slots_call(kvtier_t *self, const char *name, const char *ns,
                              const char *salt, const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n,
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
        return s_fail(self, KVT_EINVAL, "%s: slots, nslots and lease must not be NULL", name);
    return 0;
}

int kvtier_reserve(kvtier_t *self, const char *ns, const char *salt,
                   const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, const uint64_t *sizes,
                   uint64_t size, kvtier_slot_t *slots, uint32_t *nslots, uint64_t *lease)
{
    int rc = s_check_slots_call(self, "reserve", ns, salt, keys, n, slots, nslots, lease);
    if (rc)
        return rc;
    if (!sizes && size == 0 && n)
        return s_fail(self, KVT_EINVAL, "reserve: sizes is NULL and size is 0");
    for (uint32_t i = 0; sizes && i < n; i++)
        if (sizes[i] == 0)
            return s_fail(self, KVT_EINVAL, "reserve: sizes[%u] is 0", i);
    rc = s_check_arena(self, "reserve");
    if (rc)
        return rc;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_keyed(&sb, &pk, ns, salt, keys, n, 1);
    if (sizes) {
        kvt_pack_str(&pk, "sizes");
        msgpack_pack_array(&pk, n);
        for (uint32_t i = 0; i < n; i++)
            msgpack_pack_uint64(&pk, sizes[i]);
    } else {
        s_pack_uint_field(&pk, "size", size);
    }
    s_reply_t r;
    rc = s_call(self, KVT_REQ_RESERVE, &sb, &r);
    uint64_t ls = 0;
    uint32_t got = 0;
    if (rc == 0)
        rc = s_need_uint(self, KVT_REQ_RESERVE, &r.up.data, "lease", &ls);
    if (rc == 0)
        rc = s_parse_slots(self, KVT_REQ_RESERVE, &r.up.data, n, true, slots, &got);
    for (uint32_t i = 0; rc == 0 && i < got; i++)
        if (slots[i].ptr && slots[i].length != (sizes ? sizes[i] : size))
            rc = s_bad_reply(self, KVT_REQ_RESERVE, "slots", "has a length other than asked");
        else if (slots[i].ptr && !ls)
            rc = s_bad_reply(self, KVT_REQ_RESERVE, "lease", "is 0 with slots reserved");
    if (rc == 0) {
        *nslots = got;
        *lease = ls;
    } else if (ls) {
        s_abandon(self, ls);
    }
    s_reply_free(&r);
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
        return s_fail(self, KVT_EINVAL, "commit: failed is NULL with nfailed = %u", nfailed);
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_begin(&sb, &pk, nfailed ? 2 : 1);
    s_pack_uint_field(&pk, "lease", lease);
    if (nfailed) {
        kvt_pack_str(&pk, "failed");
        msgpack_pack_array(&pk, nfailed);
        for (uint32_t i = 0; i < nfailed; i++)
            msgpack_pack_uint32(&pk, failed[i]);
    }
    s_reply_t r;
    int rc = s_call(self, KVT_REQ_COMMIT, &sb, &r);
    uint64_t st = 0;
    if (rc == 0)
        rc = s_need_uint(self, KVT_REQ_COMMIT, &r.up.data, "stored", &st);
    if (rc == 0 && stored)
        *stored = st > UINT32_MAX ? UINT32_MAX : (uint32_t)st;
    s_reply_free(&r);
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
    s_reply_t r;
    rc = s_call(self, KVT_REQ_ACQUIRE, &sb, &r);
    uint64_t ls = 0;
    uint32_t got = 0;
    if (rc == 0)
        rc = s_need_uint(self, KVT_REQ_ACQUIRE, &r.up.data, "lease", &ls);
    if (rc == 0)
        rc = s_parse_slots(self, KVT_REQ_ACQUIRE, &r.up.data, n, false, slots, &got);
    if (rc == 0 && got && !ls)
        rc = s_bad_reply(self, KVT_REQ_ACQUIRE, "lease", "is 0 with slots pinned");
    if (rc == 0) {
        *nslots = got;
        *lease = ls;
    } else if (ls) {
        s_abandon(self, ls);
    }
    s_reply_free(&r);
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
    s_body_begin(&sb, &pk, 1);
    s_pack_uint_field(&pk, "lease", lease);
    if (!wait) {
        self->error[0] = '\0';
        int rc = s_send_request(self, self->next_uid++, KVT_REQ_RELEASE, sb.data, sb.size, NULL,
                                NULL, 0);
        msgpack_sbuffer_destroy(&sb);
        return rc;
    }
    s_reply_t r;
    int rc = s_call(self, KVT_REQ_RELEASE, &sb, &r);
    s_reply_free(&r);
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
    if (stored)
        *stored = 0;
    if (!self)
        return KVT_EINVAL;
    int rc = s_check_keyed(self, "put", ns, salt, keys, n);
    if (rc)
        return rc;
    if (n && (!data || !lens))
        return s_fail(self, KVT_EINVAL, "put: data and lens must not be NULL with n = %u", n);
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!data[i] && lens[i])
            return s_fail(self, KVT_EINVAL, "put: data[%u] is NULL with %zu bytes", i, lens[i]);
        if (lens[i] > UINT64_MAX - total)
            return s_fail(self, KVT_ETOOBIG, "put: the sizes overflow 64 bits");
        total += lens[i];
    }
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_keyed(&sb, &pk, ns, salt, keys, n, 0);
    /* The daemon refuses a message over max_message anyway; saying so here spares sending it. */
    if (self->info.max_message && total + sb.size > self->info.max_message) {
        msgpack_sbuffer_destroy(&sb);
        return s_fail(self, KVT_ETOOBIG,
                      "put: %llu bytes exceed the daemon's max_message of %llu: put fewer "
                      "objects per call",
                      (unsigned long long)(total + sb.size),
                      (unsigned long long)self->info.max_message);
    }
    s_reply_t r;
    rc = s_call_data(self, KVT_REQ_PUT, &sb, data, lens, n, S_DATA_NONE, &r);
    uint64_t st = 0;
    if (rc == 0)
        rc = s_need_count(self, KVT_REQ_PUT, &r.up.data, "stored", n, &st);
    if (rc == 0 && stored)
        *stored = (uint32_t)st;
    s_reply_free(&r);
    return rc;
}

/* GET with the data frames copied (S_DATA_COPY: out[i] owned by the caller) or kept
 * (S_DATA_KEEP: out[i] point into *frames). */
static int s_get_data(kvtier_t *self, const char *ns, const char *salt,
                 const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, kvtier_buf_t *out,
                 uint32_t *found, s_data_mode_t mode, kvtier_frames_t **frames)
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
    if (!found || (n && !out) || (mode == S_DATA_KEEP && !frames))
        return s_fail(self, KVT_EINVAL, "get: out, found and frames must not be NULL");
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_keyed(&sb, &pk, ns, salt, keys, n, 0);
    s_reply_t r;
    rc = s_call_data(self, KVT_REQ_GET, &sb, NULL, NULL, 0, mode, &r);
    uint64_t f = 0;
    uint32_t got = mode == S_DATA_KEEP ? (r.frames ? r.frames->n : 0) : r.ndata;
    if (rc == 0)
        rc = s_need_count(self, KVT_REQ_GET, &r.up.data, "found", n, &f);
    if (rc == 0 && f != got)
        rc = s_fail(self, KVT_EINTERNAL,
                    "malformed get reply from the daemon: found %llu with %u data frames",
                    (unsigned long long)f, got);
    if (rc == 0 && mode == S_DATA_COPY) {
        /* the copies change owner: the caller frees them */
        for (uint32_t i = 0; i < r.ndata; i++)
            out[i] = r.data[i];
        r.ndata = 0;
    } else if (rc == 0 && got) {
        for (uint32_t i = 0; i < got; i++)
            out[i] = (kvtier_buf_t){zmq_msg_data(&r.frames->msgs[i]),
                                    zmq_msg_size(&r.frames->msgs[i])};
        *frames = r.frames;
        r.frames = NULL;
    }
    if (rc == 0)
        *found = (uint32_t)f;
    s_reply_free(&r);
    return rc;
}

int kvtier_get(kvtier_t *self, const char *ns, const char *salt,
               const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, kvtier_buf_t *out,
               uint32_t *found)
{
    return s_get_data(self, ns, salt, keys, n, out, found, S_DATA_COPY, NULL);
}

int kvtier_get_frames(kvtier_t *self, const char *ns, const char *salt,
                      const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, kvtier_buf_t *out,
                      uint32_t *found, kvtier_frames_t **frames)
{
    return s_get_data(self, ns, salt, keys, n, out, found, S_DATA_KEEP, frames);
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
    s_reply_t r;
    rc = s_call(self, KVT_REQ_REMOVE, &sb, &r);
    uint64_t rm = 0;
    if (rc == 0)
        rc = s_need_count(self, KVT_REQ_REMOVE, &r.up.data, "removed", n, &rm);
    if (rc == 0 && removed)
        *removed = (uint32_t)rm;
    s_reply_free(&r);
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
    s_body_begin(&sb, &pk, ns ? 1 : 0);
    if (ns) {
        kvt_pack_str(&pk, "ns");
        kvt_pack_str(&pk, ns);
    }
    s_reply_t r;
    rc = s_call(self, KVT_REQ_CLEAR, &sb, &r);
    uint64_t rm = 0;
    if (rc == 0)
        rc = s_need_uint(self, KVT_REQ_CLEAR, &r.up.data, "removed", &rm);
    if (rc == 0 && removed)
        *removed = rm;
    s_reply_free(&r);
    return rc;
}

/* ---- GPU KV cache ---- */

int kvtier_register_gpu(kvtier_t *self, const kvtier_gpu_layout_t *lay)
{
    if (!self)
        return KVT_EINVAL;
    self->error[0] = '\0';
    if (!lay || !lay->handles || !lay->dtype || lay->layers == 0)
        return s_fail(self, KVT_EINVAL, "register_gpu: layout, handles, dtype and layers "
                                        "are required");
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_begin(&sb, &pk, 7 + (lay->offsets ? 1 : 0));
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
    s_reply_t r;
    int rc = s_call(self, KVT_REQ_REGISTER_GPU, &sb, &r);
    s_reply_free(&r);
    return rc;
}

int kvtier_unregister_gpu(kvtier_t *self, uint32_t device)
{
    if (!self)
        return KVT_EINVAL;
    self->error[0] = '\0';
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_begin(&sb, &pk, 1);
    s_pack_uint_field(&pk, "device", device);
    s_reply_t r;
    int rc = s_call(self, KVT_REQ_UNREGISTER_GPU, &sb, &r);
    s_reply_free(&r);
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
        return s_fail(self, KVT_EINVAL, "%s: block_ids is NULL", kvt_proto_name(type));
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
    s_reply_t r;
    rc = s_call(self, type, &sb, &r);
    uint64_t v = 0;
    if (rc == 0)
        rc = s_need_count(self, type, &r.up.data, count_name, n, &v);
    if (rc == 0 && count)
        *count = (uint32_t)v;
    s_reply_free(&r);
    return rc;
}

int kvtier_store_gpu(kvtier_t *self, const char *ns, const char *salt, uint32_t device,
                     const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n,
                     const uint64_t *block_ids, uint32_t nblock_ids, const void *event,
                     uint32_t *stored)
{
    return s_gpu_copy(self, KVT_REQ_STORE_GPU, ns, salt, device, keys, n, block_ids,
                      nblock_ids, event, "stored", stored);
}

int kvtier_retrieve_gpu(kvtier_t *self, const char *ns, const char *salt, uint32_t device,
                        const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n,
                        const uint64_t *block_ids, uint32_t nblock_ids, const void *event,
                        uint32_t *found)
{
    return s_gpu_copy(self, KVT_REQ_RETRIEVE_GPU, ns, salt, device, keys, n, block_ids,
                      nblock_ids, event, "found", found);
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
    uint32_t n = kvt_hash_tokens(bytes, ntokens * 4, chunk_tokens, salt,
                                 salt ? strlen(salt) : 0, keys, (uint32_t)want);
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
        return s_fail(self, KVT_EINVAL, "hash_tokens: tokens and nkeys must not be NULL");
    if (ct == 0)
        return s_fail(self, KVT_EINVAL, "hash_tokens: chunk_tokens is 0 and HELLO gave none");
    if (ntokens > UINT32_MAX / 4 ||
        (self->info.max_message && (uint64_t)ntokens * 4 > self->info.max_message))
        return s_fail(self, KVT_ETOOBIG, "hash_tokens: %zu tokens exceed max_message", ntokens);
    int rc = s_check_salt(self, "hash_tokens", salt);
    if (rc)
        return rc;
    size_t want = ntokens / ct;
    if (want && !keys)
        return s_fail(self, KVT_EINVAL, "hash_tokens: keys is NULL for %zu keys", want);
    uint8_t *owned = NULL;
    const uint8_t *bytes = ntokens ? s_le_tokens(tokens, ntokens, &owned) : NULL;
    if (ntokens && !bytes)
        return s_fail(self, KVT_ENOMEM, "hash_tokens: out of memory");
    msgpack_sbuffer sb;
    msgpack_packer pk;
    s_body_begin(&sb, &pk, 1 + (chunk_tokens ? 1 : 0) + (s_has_salt(salt) ? 1 : 0));
    kvt_pack_str(&pk, "tokens");
    s_pack_bin(&pk, bytes, ntokens * 4);
    free(owned);
    if (chunk_tokens)
        s_pack_uint_field(&pk, "chunk_tokens", chunk_tokens);
    if (s_has_salt(salt)) {
        kvt_pack_str(&pk, "salt");
        kvt_pack_str(&pk, salt);
    }
    s_reply_t r;
    rc = s_call(self, KVT_REQ_HASH_TOKENS, &sb, &r);
    const msgpack_object *a = rc ? NULL : s_get(&r.up.data, "keys");
    if (rc == 0 && (!a || a->type != MSGPACK_OBJECT_ARRAY))
        rc = s_bad_reply(self, KVT_REQ_HASH_TOKENS, "keys", a ? "is not an array" : "is missing");
    if (rc == 0 && a->via.array.size != want)
        rc = s_fail(self, KVT_EINTERNAL,
                    "malformed hash_tokens reply from the daemon: %u keys for %zu full chunks",
                    a->via.array.size, want);
    for (uint32_t i = 0; rc == 0 && i < a->via.array.size; i++) {
        const msgpack_object *e = &a->via.array.ptr[i];
        if (e->type != MSGPACK_OBJECT_BIN || e->via.bin.size != KVTIER_KEY_LEN)
            rc = s_bad_reply(self, KVT_REQ_HASH_TOKENS, "keys", "has an entry not a 16-byte bin");
        else
            memcpy(keys[i], e->via.bin.ptr, KVTIER_KEY_LEN);
    }
    if (rc == 0)
        *nkeys = (uint32_t)want;
    s_reply_free(&r);
    return rc;
}
