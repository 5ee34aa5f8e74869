/* DESIGN: see client/kvtier.c for libkvtier as a whole (one DEALER per handle, uids, the two
 * data paths, liveness, the fast path). This file is its wire: the process's zmq context, the
 * envelope, reply decoding, the ring pair's client side and one call's round trip. Caller's
 * thread only. */
#include "kvtier_int.h"

#include "kvt_error.h"
#include "kvt_fdpass.h"
#include "kvt_hash.h"
#include "kvt_msg.h"
#include "kvt_proto.h"
#include "kvt_ring.h"

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

int kvc_fail(kvtier_t *self, int code, const char *fmt, ...)
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

/* Bumped in the child at each fork: a ring pair belongs to the process that attached it (its
 * region is shared with the parent, so a child that pushed, popped or closed would act for the
 * parent). One relaxed load per call, where getpid() would be a system call. */
_Atomic unsigned kvc_fork_gen;

/* An integer from the environment within [lo, hi], else def. */
int kvc_env_int(const char *name, int def, int lo, int hi)
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
    atomic_fetch_add_explicit(&kvc_fork_gen, 1, memory_order_relaxed);
}

static void s_ctx_once(void)
{
    pthread_atfork(NULL, NULL, s_ctx_atfork_child);
}

void *kvc_ctx_acquire(void)
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
            zmq_ctx_set(s_ctx, ZMQ_IO_THREADS, kvc_env_int("KVTIER_IO_THREADS", 2, 1, 16));
        s_ctx_pid = getpid();
    }
    void *ctx = s_ctx;
    if (ctx)
        s_ctx_refs++;
    pthread_mutex_unlock(&s_ctx_lock);
    return ctx;
}

void kvc_ctx_release(void *ctx)
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

static int s_send_frame(void *sock, const void *data, size_t len, int flags)
{
    return zmq_send(sock, data, len, flags) < 0 ? -1 : 0;
}

/* A msgpack uint in its shortest form (as msgpack_pack_uint64 writes it, without a buffer to
 * allocate: this is on every request's path). buf holds 9 bytes. */
static int s_pack_uint(char *buf, uint64_t v)
{
    uint8_t *b = (uint8_t *)buf;
    int n;
    if (v < 0x80) {
        b[0] = (uint8_t)v;
        return 1;
    }
    if (v <= UINT8_MAX)
        b[0] = 0xcc, n = 1;
    else if (v <= UINT16_MAX)
        b[0] = 0xcd, n = 2;
    else if (v <= UINT32_MAX)
        b[0] = 0xce, n = 4;
    else
        b[0] = 0xcf, n = 8;
    for (int i = 0; i < n; i++)
        b[1 + i] = (uint8_t)(v >> (8 * (n - 1 - i)));
    return n + 1;
}


void kvc_reply_init(kvc_reply_t *r)
{
    memset(r, 0, sizeof *r);
    msgpack_unpacked_init(&r->up);
}

void kvc_reply_free(kvc_reply_t *r)
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
static int s_keep_frame(kvc_reply_t *r, zmq_msg_t *part)
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

static int s_keep_data(kvc_reply_t *r, const zmq_msg_t *part)
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

/* Sends [uid, type, body, data...] on `sock` (flags: 0, or ZMQ_DONTWAIT). 0, or -1 with
 * zmq_errno() set. A multipart message is queued atomically: once the uid frame is accepted,
 * the rest cannot block, so a failure leaves nothing half-sent. */
int kvc_send_on(void *sock, int flags, uint64_t uid, uint32_t type, const void *body,
                     size_t len, const void *const *data, const size_t *lens, uint32_t ndata)
{
    char ubuf[16], tbuf[16];
    int ulen = s_pack_uint(ubuf, uid), tlen = s_pack_uint(tbuf, type);
    int bad = s_send_frame(sock, ubuf, (size_t)ulen, flags | ZMQ_SNDMORE) ||
              s_send_frame(sock, tbuf, (size_t)tlen, ZMQ_SNDMORE) ||
              s_send_frame(sock, body, len, ndata > 0 ? ZMQ_SNDMORE : 0);
    for (uint32_t i = 0; !bad && i < ndata; i++)
        bad = s_send_frame(sock, data[i], lens[i], i + 1 < ndata ? ZMQ_SNDMORE : 0);
    return bad ? -1 : 0;
}

static int s_send_request(kvtier_t *self, uint64_t uid, uint32_t type, const void *body, size_t len,
                          const void *const *data, const size_t *lens, uint32_t ndata)
{
    if (kvc_send_on(self->sock, 0, uid, type, body, len, data, lens, ndata) != 0)
        return kvc_fail(self, KVT_EUNAVAIL, "cannot send to the daemon: %s",
                      zmq_errno() == EAGAIN ? "no connection (timed out)"
                                            : zmq_strerror(zmq_errno()));
    return 0;
}

uint64_t kvc_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Busy-polls for the first part of a message for up to spin_ns: a reply that comes back within
 * it costs no sleep and wake-up of this thread (tens of microseconds on a VM). -1 when none
 * came (the caller then blocks). */
static int s_spin_recv(void *sock, uint64_t spin_ns, zmq_msg_t *part)
{
    uint64_t end = kvc_mono_ns() + spin_ns;
    do {
        int n = zmq_msg_recv(part, sock, ZMQ_DONTWAIT);
        if (n >= 0 || zmq_errno() != EAGAIN)
            return n;
    } while (kvc_mono_ns() < end);
    return -1;
}

/* Receives on `sock` until the reply to `uid` arrives (copying its body, and copying or keeping
 * its data frames as `mode` says), skipping replies to earlier calls that timed out. Every
 * message is read to its last part, so the socket never gets out of step, even when a copy
 * fails. On failure *why is a sentence; KVT_ETIMEDOUT when nothing came within the socket's
 * receive timeout. */
int kvc_recv_on(void *sock, uint64_t spin_ns, uint64_t uid, kvc_data_mode_t mode, kvc_reply_t *r,
                     const char **why)
{
    for (;;) {
        bool mine = false;
        uint32_t idx = 0;
        int rc = 0, more = 1;
        while (more) {
            zmq_msg_t part;
            zmq_msg_init(&part);
            int got = idx == 0 && spin_ns ? s_spin_recv(sock, spin_ns, &part) : -1;
            if (got < 0 && zmq_msg_recv(&part, sock, 0) < 0) {
                int e = zmq_errno();
                zmq_msg_close(&part);
                if (idx > 0 && e == EINTR)
                    continue; /* the rest of a multipart message is already here */
                *why = e == EAGAIN ? "timed out waiting for the daemon" : zmq_strerror(e);
                return e == EAGAIN ? KVT_ETIMEDOUT : KVT_EUNAVAIL;
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
            } else if (mine && idx > 2 && mode == KVC_DATA_COPY && rc == 0) {
                rc = s_keep_data(r, &part);
            } else if (mine && idx > 2 && mode == KVC_DATA_KEEP && rc == 0) {
                rc = s_keep_frame(r, &part);
            }
            zmq_msg_close(&part);
            idx++;
        }
        if (!mine)
            continue;
        *why = rc        ? "out of memory copying the reply"
               : idx < 3 ? "a reply of fewer than 3 frames, expected [uid, type, body]"
                         : "";
        return rc ? rc : idx < 3 ? KVT_EINTERNAL : 0;
    }
}

/* ---- the fast path: requests and replies over the ring pair (see DESIGN) ---- */

#define S_RING_FRAMES 64 /* frames a reply record may have: [uid, type, body], data unused */
#define S_RING_IDLE_NS 50000000u /* a pair idle this long is checked before use (one stat) */

/* Whether this process may use the handle's pair (a forked child may not). */
bool kvc_pair_mine(const kvtier_t *self)
{
    return self->req_ring &&
           self->ring_gen == atomic_load_explicit(&kvc_fork_gen, memory_order_relaxed);
}

/* Drops the pair: closes this client's sides, so the daemon drops its own, and frees the
 * handles. A forked child only frees its copies (closing would end the parent's pair). */
void kvc_pair_drop(kvtier_t *self)
{
    if (kvc_pair_mine(self)) {
        kvt_ring_close(self->req_ring);
        kvt_ring_close(self->rep_ring);
    }
    kvt_ring_destroy(&self->req_ring);
    kvt_ring_destroy(&self->rep_ring);
    if (self->ring_map)
        munmap(self->ring_map, self->ring_map_len);
    self->ring_map = NULL;
    self->ring_map_len = 0;
    if (self->res_map)
        munmap((void *)self->res_map, self->res_map_len);
    self->res_map = NULL;
    self->res_map_len = 0;
    if (self->ring_sock >= 0)
        close(self->ring_sock); /* the daemon sees this client let go */
    self->ring_sock = -1;
    self->ring_posted = 0;
}

/* After a ring wait timed out, and before using a pair idle for S_RING_IDLE_NS. A daemon that
 * died closed nothing, but its arena file goes (removed as stale by the next daemon): then the
 * ring is never served again, so the pair is dropped and the call goes over the socket, where
 * a restarted daemon answers (instance_dropped, then the HELLO that brings a new pair).
 * Without this a handle with no heartbeat would push into the dead ring forever. */
static void s_pair_check_owner(kvtier_t *self)
{
    struct stat st;
    if (self->ring_sock >= 0 && kvt_fdpass_peer_gone(self->ring_sock)) {
        kvc_pair_drop(self); /* the daemon let the pair go, or died */
        return;
    }
    if (self->arena_path && stat(self->arena_path, &st) == 0 && st.st_dev == self->arena_dev &&
        st.st_ino == self->arena_ino)
        return;
    kvc_pair_drop(self);
}

static int64_t s_left_ns(uint64_t deadline)
{
    uint64_t now = kvc_mono_ns();
    return deadline > now ? (int64_t)(deadline - now) : 0;
}

/* Takes the next record off the reply ring (waiting until `deadline`; a deadline passed takes
 * only what is there) into ring_buf and splits it into f[0..*nf), *ruid its uid (0 when
 * unreadable: no request has uid 0). 0; KVT_ETIMEDOUT; KVT_EUNAVAIL when the daemon closed the
 * pair or the ring is malformed: the pair is dropped and self->error says so. Any reply
 * confirms the requests posted on the ring before it: the daemon reads its ring in order. */
static int s_ring_take(kvtier_t *self, uint64_t deadline, kvt_ring_frame_t *f, uint32_t *nf,
                       uint64_t *ruid)
{
    size_t len = 0;
    int rc;
    do {
        rc = kvt_ring_wait(self->rep_ring, 0, s_left_ns(deadline));
        if (rc == 0)
            rc = kvt_ring_pop(self->rep_ring, self->ring_buf, self->ring_buf_cap, &len);
    } while (rc == KVT_EBUSY);
    if (rc == KVT_ETIMEDOUT)
        return rc;
    if (rc == 0)
        rc = kvt_ring_parse(self->ring_buf, len, f, S_RING_FRAMES, nf);
    if (rc == KVT_EUNAVAIL)
        kvc_fail(self, KVT_EUNAVAIL,
               "the daemon closed the fast path (a request in flight on it may or may not have "
               "run); later calls go over the socket");
    else if (rc)
        kvc_fail(self, KVT_EUNAVAIL,
               "the fast path's reply ring is malformed (%s); later calls go over the socket",
               kvt_ring_broken(self->rep_ring) ? kvt_ring_why(self->rep_ring)
                                               : "an unparsable record");
    if (rc) {
        kvc_pair_drop(self);
        return KVT_EUNAVAIL;
    }
    if (*nf == 0 || kvt_msg_read_uint(f[0].ptr, f[0].len, ruid) != 0)
        *ruid = 0;
    if (self->ring_posted && *ruid >= self->ring_posted)
        self->ring_posted = 0;
    self->ring_seen_ns = kvc_mono_ns();
    return 0;
}

/* Takes the replies waiting on the reply ring, without waiting. While no call awaits one they
 * are all stale (posted or timed-out calls), and a ring left full makes the daemon drop the
 * pair. Leaves self->error empty: it runs before a request is sent. */
static void s_ring_drain(kvtier_t *self)
{
    kvt_ring_frame_t f[S_RING_FRAMES];
    uint32_t nf;
    uint64_t ruid;
    while (kvc_pair_mine(self) && s_ring_take(self, 0, f, &nf, &ruid) == 0)
        ;
    self->error[0] = '\0';
}

/* Before a request goes over the socket while one posted on the ring is unconfirmed: waits
 * (until `deadline`) for a ring reply to it or a later request. kvtier_release_async promises
 * that the next call sees the lease released, and the daemon reads the ring and the socket
 * independently. Best effort: if none comes the request goes out anyway. */
static void s_ring_settle(kvtier_t *self, uint64_t deadline)
{
    kvt_ring_frame_t f[S_RING_FRAMES];
    uint32_t nf;
    uint64_t ruid;
    while (self->ring_posted && kvc_pair_mine(self) &&
           s_ring_take(self, deadline, f, &nf, &ruid) == 0)
        ;
    self->ring_posted = 0;
    self->error[0] = '\0';
}

/* Pushes [uid, type, body] on the request ring, waiting for room until `deadline`. 0 when
 * pushed; 1 when the request must go over the socket (its message does not fit in a record, or
 * the daemon closed the pair or broke the ring: the pair is dropped); KVT_ETIMEDOUT when the
 * ring stayed full (sending it over the socket instead could overtake what is queued). */
static int s_ring_push(kvtier_t *self, uint64_t uid, uint32_t type, const void *body, size_t len,
                       uint64_t deadline)
{
    char ubuf[16], tbuf[16];
    kvt_ring_iov_t iov[3] = {{ubuf, (size_t)s_pack_uint(ubuf, uid)},
                             {tbuf, (size_t)s_pack_uint(tbuf, type)},
                             {body, len}};
    size_t need = kvt_ring_msg_size(iov, 3);
    if (need > kvt_ring_max_payload(self->req_ring))
        return 1;
    if (kvc_mono_ns() - self->ring_seen_ns > S_RING_IDLE_NS) {
        s_pair_check_owner(self); /* idle a while: its daemon may have died meanwhile */
        if (!kvc_pair_mine(self))
            return 1;
    }
    int rc;
    while ((rc = kvt_ring_push(self->req_ring, iov, 3)) == KVT_EBUSY) {
        s_ring_drain(self); /* a daemon stuck on a full reply ring reads no requests */
        if (!kvc_pair_mine(self))
            return 1;
        rc = kvt_ring_wait(self->req_ring, need, s_left_ns(deadline));
        if (rc == KVT_ETIMEDOUT) {
            s_pair_check_owner(self);
            return kvc_fail(self, rc, "timed out waiting for room on the fast path's request ring");
        }
        if (rc)
            break;
    }
    if (rc == 0)
        return 0;
    kvc_pair_drop(self); /* KVT_EUNAVAIL: the daemon closed it; KVT_EBADREQ: malformed */
    return 1;
}

/* Waits on the reply ring for the reply to `uid`, skipping stale ones, and fills r as
 * kvc_recv_on does (a ring reply has no data frames: only KVC_DATA_NONE calls come here). */
static int s_ring_recv(kvtier_t *self, uint64_t uid, uint64_t deadline, kvc_reply_t *r)
{
    kvt_ring_frame_t f[S_RING_FRAMES];
    uint32_t nf;
    uint64_t ruid;
    for (;;) {
        int rc = s_ring_take(self, deadline, f, &nf, &ruid);
        if (rc == KVT_ETIMEDOUT) {
            s_pair_check_owner(self);
            return kvc_fail(self, rc, "timed out waiting for the daemon (fast path)");
        }
        if (rc)
            return rc;
        if (ruid != uid)
            continue;
        if (nf < 3)
            return kvc_fail(self, KVT_EINTERNAL,
                          "a reply of fewer than 3 frames, expected [uid, type, body]");
        r->len = f[2].len;
        r->buf = malloc(r->len ? r->len : 1);
        if (!r->buf)
            return kvc_fail(self, KVT_ENOMEM, "out of memory copying the reply");
        memcpy(r->buf, f[2].ptr, r->len);
        return 0;
    }
}

static uint64_t s_deadline(const kvtier_t *self)
{
    return kvc_mono_ns() + (uint64_t)self->timeout_ms * 1000000u;
}

/* One request and its reply, over the ring when it can go there, else the socket. The
 * receive timeout is the handle's (the socket's ZMQ_RCVTIMEO). */
int kvc_exchange(kvtier_t *self, uint32_t type, const void *body, size_t len,
                      const void *const *data, const size_t *lens, uint32_t ndata,
                      kvc_data_mode_t mode, kvc_reply_t *r)
{
    self->error[0] = '\0';
    uint64_t uid = self->next_uid++;
    if (type == KVT_REQ_HELLO || type == KVT_REQ_BYE) {
        /* the daemon replaces (a HELLO that asks) or reclaims the pair at either: our sides
         * are closed first, and never written after */
        kvc_pair_drop(self);
    } else if (ndata == 0 && mode == KVC_DATA_NONE && kvc_pair_mine(self)) {
        uint64_t deadline = s_deadline(self);
        int rc = s_ring_push(self, uid, type, body, len, deadline);
        if (rc <= 0)
            return rc ? rc : s_ring_recv(self, uid, deadline, r);
    }
    if (self->ring_posted)
        s_ring_settle(self, s_deadline(self));
    int rc = s_send_request(self, uid, type, body, len, data, lens, ndata);
    const char *why = "";
    if (rc == 0 && (rc = kvc_recv_on(self->sock, self->spin_ns, uid, mode, r, &why)) != 0)
        kvc_fail(self, rc, "%s", why);
    return rc;
}

/* Sends a request whose reply nobody awaits (a later call skips it by uid, on the transport it
 * comes back on): over the ring when it can go there, else the socket. */
int kvc_post(kvtier_t *self, uint32_t type, const void *body, size_t len)
{
    self->error[0] = '\0';
    uint64_t uid = self->next_uid++;
    if (kvc_pair_mine(self)) {
        s_ring_drain(self);
        int rc =
            kvc_pair_mine(self) ? s_ring_push(self, uid, type, body, len, s_deadline(self)) : 1;
        if (rc == 0)
            self->ring_posted = uid;
        if (rc <= 0)
            return rc;
    }
    if (self->ring_posted)
        s_ring_settle(self, s_deadline(self));
    return s_send_request(self, uid, type, body, len, NULL, NULL, 0);
}

/* ---- reply bodies ---- */

static bool s_key_is(const msgpack_object *k, const char *name)
{
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == strlen(name) &&
           memcmp(k->via.str.ptr, name, k->via.str.size) == 0;
}

/* The value of `name` in a map; NULL when absent or nil (nil counts as absent, as in
 * requests). */
const msgpack_object *kvc_get(const msgpack_object *map, const char *name)
{
    if (map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    for (uint32_t i = 0; i < map->via.map.size; i++)
        if (s_key_is(&map->via.map.ptr[i].key, name))
            return map->via.map.ptr[i].val.type == MSGPACK_OBJECT_NIL ? NULL
                                                                      : &map->via.map.ptr[i].val;
    return NULL;
}

int kvc_bad_reply(kvtier_t *self, uint32_t type, const char *field, const char *want)
{
    return kvc_fail(self, KVT_EINTERNAL, "malformed %s reply from the daemon: '%s' %s",
                  kvt_proto_name(type), field, want);
}

/* Decodes r's body: 0 when it is ok; otherwise the daemon's error as a KVT_E* code, with
 * *msg and *msg_len its message (pointing into r; NULL when it has none), or KVT_EINTERNAL with
 * *undecodable set when the body is not a msgpack map. No state: the heartbeat uses it too. */
int kvc_decode(kvc_reply_t *r, const char **msg, size_t *msg_len, bool *undecodable)
{
    *msg = NULL;
    *msg_len = 0;
    size_t off = 0;
    *undecodable = msgpack_unpack_next(&r->up, r->buf, r->len, &off) != MSGPACK_UNPACK_SUCCESS ||
                   r->up.data.type != MSGPACK_OBJECT_MAP;
    if (*undecodable)
        return KVT_EINTERNAL;
    const msgpack_object *ok = kvc_get(&r->up.data, "ok");
    if (ok && ok->type == MSGPACK_OBJECT_BOOLEAN && ok->via.boolean)
        return 0;
    const msgpack_object *error = kvc_get(&r->up.data, "error");
    const msgpack_object *code = error ? kvc_get(error, "code") : NULL;
    const msgpack_object *m = error ? kvc_get(error, "message") : NULL;
    if (m && m->type == MSGPACK_OBJECT_STR && m->via.str.size) {
        *msg = m->via.str.ptr;
        *msg_len = m->via.str.size;
    }
    return code && code->type == MSGPACK_OBJECT_STR
               ? kvt_err_from_wire(code->via.str.ptr, code->via.str.size)
               : KVT_EINTERNAL;
}

/* One request and its decoded reply (r initialised by the caller, freed by the caller). On 0,
 * r->up.data is the ok body; otherwise the daemon's error is mapped to a KVT_E* code and its
 * message kept. */
int kvc_call_once(kvtier_t *self, uint32_t type, const void *body, size_t len,
                       const void *const *data, const size_t *lens, uint32_t ndata,
                       kvc_data_mode_t mode, kvc_reply_t *r)
{
    int rc = kvc_exchange(self, type, body, len, data, lens, ndata, mode, r);
    if (rc)
        return rc;
    const char *msg;
    size_t msg_len;
    bool undecodable;
    rc = kvc_decode(r, &msg, &msg_len, &undecodable);
    if (undecodable)
        kvc_fail(self, rc, "undecodable %s reply from the daemon", kvt_proto_name(type));
    else if (rc && msg)
        kvc_fail(self, rc, "%.*s", (int)msg_len, msg);
    else if (rc)
        kvc_fail(self, rc, "daemon error without a message (%s)", kvt_err_wire(rc));
    return rc;
}


/* HELLO and BYE are the session itself: nothing re-establishes an instance around them. */
static bool s_recovers(uint32_t type)
{
    return type != KVT_REQ_HELLO && type != KVT_REQ_BYE;
}

/* Before a call: when the heartbeat found the instance dropped, say HELLO again first (one
 * atomic load otherwise: this is every call's path). A daemon that does not answer fails the
 * call; one that answers the HELLO with an error leaves the flag up and the call goes out. */
int kvc_revive(kvtier_t *self, uint32_t type)
{
    if (!self->hb || !kvc_hb_dropped(self->hb) ||
        !s_recovers(type))
        return 0;
    int rc = kvc_reestablish(self);
    return rc == KVT_ETIMEDOUT || rc == KVT_EUNAVAIL ? rc : 0;
}

/* Whether a call answered instance_dropped is sent once more after the instance was
 * re-established. Not COMMIT and RELEASE: the lease they name died with the instance. Not
 * UNREGISTER_GPU: the registration died with it too, which is what it asked for. */
static bool s_retried(uint32_t type)
{
    return type != KVT_REQ_COMMIT && type != KVT_REQ_RELEASE && type != KVT_REQ_UNREGISTER_GPU;
}

/* After an answer instance_dropped (type s_recovers): re-establishes the instance and, for the
 * calls s_retried names, sends the request once more. Returns the final answer (in r); a
 * failed re-establishment's own error (r emptied); or, for a call not retried,
 * instance_dropped with its message (r kept). */
static int s_after_drop(kvtier_t *self, uint32_t type, const void *body, size_t len,
                        const void *const *data, const size_t *lens, uint32_t ndata,
                        kvc_data_mode_t mode, kvc_reply_t *r)
{
    char answer[sizeof self->error];
    memcpy(answer, self->error, sizeof answer);
    int rc = kvc_reestablish(self);
    if (rc) {
        kvc_reply_free(r);
        kvc_reply_init(r);
        return rc;
    }
    if (!s_retried(type)) {
        memcpy(self->error, answer, sizeof answer);
        return KVT_ENOINST;
    }
    kvc_reply_free(r);
    kvc_reply_init(r);
    return kvc_call_once(self, type, body, len, data, lens, ndata, mode, r);
}

/* Sends `body` (consumed) plus data frames and decodes the reply, re-establishing a dropped
 * instance on the way (kvc_revive, s_after_drop). On 0, r->up.data is the ok body. The caller
 * frees r either way. */
int kvc_call_data(kvtier_t *self, uint32_t type, msgpack_sbuffer *body,
                       const void *const *data, const size_t *lens, uint32_t ndata,
                       kvc_data_mode_t mode, kvc_reply_t *r)
{
    kvc_reply_init(r);
    int rc = kvc_revive(self, type);
    if (rc == 0)
        rc = kvc_call_once(self, type, body->data, body->size, data, lens, ndata, mode, r);
    if (rc == KVT_ENOINST && s_recovers(type))
        rc = s_after_drop(self, type, body->data, body->size, data, lens, ndata, mode, r);
    msgpack_sbuffer_destroy(body);
    return rc;
}

int kvc_call(kvtier_t *self, uint32_t type, msgpack_sbuffer *body, kvc_reply_t *r)
{
    return kvc_call_data(self, type, body, NULL, NULL, 0, KVC_DATA_NONE, r);
}

int kvtier_call(kvtier_t *self, uint32_t type, const void *body, size_t len, void **reply_body,
                size_t *reply_len)
{
    if (!self || !reply_body || !reply_len || (!body && len))
        return self ? kvc_fail(self, KVT_EINVAL, "kvtier_call: NULL argument") : KVT_EINVAL;
    *reply_body = NULL;
    *reply_len = 0;
    kvc_reply_t r;
    kvc_reply_init(&r);
    int rc = kvc_revive(self, type);
    if (rc == 0)
        rc = kvc_call_once(self, type, body, len, NULL, NULL, 0, KVC_DATA_NONE, &r);
    if (rc == KVT_ENOINST && s_recovers(type))
        rc = s_after_drop(self, type, body, len, NULL, NULL, 0, KVC_DATA_NONE, &r);
    if (r.buf) { /* an answer, ok or not: its raw body is the caller's */
        *reply_body = r.buf;
        *reply_len = r.len;
        r.buf = NULL;
        self->error[0] = '\0';
        rc = 0;
    }
    kvc_reply_free(&r);
    return rc;
}

/* A required non-negative integer of a reply body. */
int kvc_need_uint(kvtier_t *self, uint32_t type, const msgpack_object *body,
                       const char *name, uint64_t *out)
{
    const msgpack_object *o = kvc_get(body, name);
    if (!o || o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return kvc_bad_reply(self, type, name, o ? "is not a uint" : "is missing");
    *out = o->via.u64;
    return 0;
}

/* An optional one: 0 when absent. */
int kvc_opt_uint(kvtier_t *self, uint32_t type, const msgpack_object *body,
                      const char *name, uint64_t *out)
{
    *out = 0;
    return kvc_get(body, name) ? kvc_need_uint(self, type, body, name, out) : 0;
}

/* A count that must not exceed `max` (the keys asked for). */
int kvc_need_count(kvtier_t *self, uint32_t type, const msgpack_object *body,
                        const char *name, uint64_t max, uint64_t *out)
{
    int rc = kvc_need_uint(self, type, body, name, out);
    if (rc == 0 && *out > max)
        return kvc_bad_reply(self, type, name, "exceeds the number of keys asked for");
    return rc;
}
