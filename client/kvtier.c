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
 * Outputs are zeroed on entry, so they read as "nothing" after any failure.
 *
 * Liveness (docs/protocol.md, "Client liveness"). The daemon drops an instance silent for
 * lease_ms, with its leases and GPU registrations. Each kvtier_t therefore has a heartbeat
 * (s_hb_t): a thread of its own with a DEALER of its own, which joins the instance with the
 * token HELLO returned and sends PING {instance} every interval. The caller's thread and the
 * heartbeat share only s_hb_t's token and generation (under its mutex, never taken on the hot
 * path) and one atomic flag, `dropped`, that a call reads with one load. When a call answers
 * instance_dropped, or the heartbeat raised the flag, s_reestablish says HELLO again (same
 * name and token), remaps the arena if the daemon announced another, re-registers the GPU
 * layouts it keeps copies of, hands the new token to the heartbeat, and the call is sent once
 * more (s_retried: not COMMIT/RELEASE, whose lease is gone). Lock order: s_hb_t.lock is a leaf;
 * s_ctx_lock is never held with it.
 *
 * Faulting the arena in (KVTIER_MAP_POPULATE): lazily by default (each page on first touch),
 * all at once with MAP_POPULATE ("1"), or by a thread of its own ("background", s_prefault_t)
 * that walks the mapping in chunks with MADV_POPULATE_WRITE while the caller goes on; the only
 * thing it shares is an atomic stop flag, and it is joined before the mapping is unmapped.
 *
 * The fast path (issue 17; docs/protocol.md "Fast path"). HELLO asks for a ring pair
 * (`fastpath: true`, unless KVTIER_FASTPATH=0), the arena is mapped to shm.map_size so the
 * rings past the L1 objects are in it, and the offer's two regions are attached with
 * common/kvt_ring: this handle produces on the request ring and consumes the reply ring. Then
 * every request without data frames whose message fits in a record goes over the ring
 * (s_ring_push, s_ring_recv), the rest (PUT, GET, HELLO, BYE, big bodies) over the socket;
 * both carry the same frames and one uid sequence, so each transport's receive loop skips the
 * replies to timed-out or posted calls by uid. The daemon reads the two transports
 * independently, so a request posted on the ring (kvtier_release_async) is confirmed by a ring
 * reply before anything goes over the socket (s_ring_settle): the next call sees it done, as
 * on one socket. The pair is dropped (our sides closed, the handles freed) before every HELLO
 * and BYE (the daemon replaces or reclaims it then), before the arena is unmapped, when the
 * daemon closes it (KVT_EUNAVAIL), when the ring turns out malformed, and when a wait times
 * out and the arena file is gone (a dead daemon closes nothing); calls then use the socket
 * until a later HELLO brings a new pair. A child forked after connect never touches the pair
 * (the region is shared with its parent): s_fork_gen. */
#include "kvtier.h"

#include "kvtier_curve.h"
#include "kvt_error.h"
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

_Static_assert(KVTIER_KEY_LEN == KVT_KEY_LEN, "kvtier.h and the protocol disagree on keys");
_Static_assert(KVTIER_KEY_LEN == KVT_HASH_KEY_LEN, "kvtier.h and kvt_hash disagree on keys");

typedef struct s_hb s_hb_t;
typedef struct s_prefault s_prefault_t;

/* A REGISTER_GPU the caller made, kept to be said again when the instance is re-established. */
typedef struct {
    uint32_t device;
    bool live;  /* registered with the current instance */
    void *body; /* the request body as sent */
    size_t len;
} s_gpu_reg_t;

struct kvtier {
    void *ctx;
    void *sock;
    uint64_t next_uid;
    int timeout_ms;
    pid_t pid; /* the process that connected: a forked child does not speak for it */
    char client[KVT_MAX_NAME + 1];
    char instance[KVT_MAX_NAME + 1];
    char token[KVT_MAX_TOKEN + 1]; /* from the last HELLO; "" when the daemon gave none */
    kvtier_info_t info;
    void *arena; /* MAP_SHARED mapping of HELLO's shm.path; NULL when it could not be mapped */
    size_t arena_size;
    size_t arena_map_len;         /* bytes mapped: shm.map_size (rings included) or arena_size */
    char *arena_path;             /* the shm.path HELLO announced last (NULL: none) ... */
    uint64_t arena_announced;     /* ... and its shm.size: a restarted daemon announces another */
    uint64_t arena_map_announced; /* ... and the length mapped for it */
    dev_t arena_dev;              /* the mapped file: a daemon's arena file goes with it */
    ino_t arena_ino;
    char arena_why[384]; /* why arena is NULL: the message of a local KVT_EUNAVAIL */
    s_prefault_t *prefault; /* the background fault-in of the arena, NULL when none runs */
    char error[256];
    uint64_t spin_ns; /* busy-poll for a reply this long before sleeping (0: never) */
    s_hb_t *hb;       /* NULL when disabled (KVTIER_HEARTBEAT_MS=0) */
    s_gpu_reg_t *gpu; /* the caller's GPU registrations, one per device */
    uint32_t ngpu, gpu_cap;
    /* the fast path: both NULL, or the pair the last HELLO offered (see DESIGN) */
    bool fastpath_on;      /* KVTIER_FASTPATH is not "0": HELLO asks for a pair */
    kvt_ring_t *req_ring;  /* producer of the request ring */
    kvt_ring_t *rep_ring;  /* consumer of the reply ring */
    unsigned ring_gen;     /* s_fork_gen when attached */
    uint64_t ring_posted;  /* uid of the last request posted on the ring not yet confirmed */
    uint64_t ring_seen_ns; /* when the pair last answered (or was attached) */
    uint8_t *ring_buf;     /* one reply record (kvt_ring_max_payload bytes), kept across calls */
    size_t ring_buf_cap;
};

/* The heartbeat of one kvtier_t (see "the heartbeat" below). */
struct s_hb {
    atomic_bool dropped; /* raised by the heartbeat: the instance is gone, say HELLO again */
    atomic_bool stop;
    atomic_int interval_ms;
    int wake;  /* eventfd: written to stop the thread, or to hand it a new token */
    pid_t pid; /* the process whose thread it is: a forked child has none */
    pthread_t thread;
    pthread_mutex_t lock;          /* guards token, gen and busy; a leaf */
    pthread_cond_t idle;           /* busy went false */
    char token[KVT_MAX_TOKEN + 1]; /* the token to present: the caller's, or a newer one */
    uint64_t gen;                  /* bumped by the caller's thread after each HELLO it said */
    bool busy;                     /* the heartbeat's own HELLO is on the wire */
    /* set before the thread starts, read-only after */
    void *ctx;
    int timeout_ms;
    bool interval_fixed; /* KVTIER_HEARTBEAT_MS chose it, not lease_ms */
    char *endpoint, *server_key, *client_cert;
    char client[KVT_MAX_NAME + 1], instance[KVT_MAX_NAME + 1];
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

/* Bumped in the child at each fork: a ring pair belongs to the process that attached it (its
 * region is shared with the parent, so a child that pushed, popped or closed would act for the
 * parent). One relaxed load per call, where getpid() would be a system call. */
static _Atomic unsigned s_fork_gen;

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
    atomic_fetch_add_explicit(&s_fork_gen, 1, memory_order_relaxed);
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

/* Sends [uid, type, body, data...] on `sock` (flags: 0, or ZMQ_DONTWAIT). 0, or -1 with
 * zmq_errno() set. A multipart message is queued atomically: once the uid frame is accepted,
 * the rest cannot block, so a failure leaves nothing half-sent. */
static int s_send_on(void *sock, int flags, uint64_t uid, uint32_t type, const void *body,
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
    if (s_send_on(self->sock, 0, uid, type, body, len, data, lens, ndata) != 0)
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
static int s_spin_recv(void *sock, uint64_t spin_ns, zmq_msg_t *part)
{
    uint64_t end = s_mono_ns() + spin_ns;
    do {
        int n = zmq_msg_recv(part, sock, ZMQ_DONTWAIT);
        if (n >= 0 || zmq_errno() != EAGAIN)
            return n;
    } while (s_mono_ns() < end);
    return -1;
}

/* Receives on `sock` until the reply to `uid` arrives (copying its body, and copying or keeping
 * its data frames as `mode` says), skipping replies to earlier calls that timed out. Every
 * message is read to its last part, so the socket never gets out of step, even when a copy
 * fails. On failure *why is a sentence; KVT_ETIMEDOUT when nothing came within the socket's
 * receive timeout. */
static int s_recv_on(void *sock, uint64_t spin_ns, uint64_t uid, s_data_mode_t mode, s_reply_t *r,
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
static bool s_pair_mine(const kvtier_t *self)
{
    return self->req_ring &&
           self->ring_gen == atomic_load_explicit(&s_fork_gen, memory_order_relaxed);
}

/* Drops the pair: closes this client's sides, so the daemon drops its own, and frees the
 * handles. A forked child only frees its copies (closing would end the parent's pair). */
static void s_pair_drop(kvtier_t *self)
{
    if (s_pair_mine(self)) {
        kvt_ring_close(self->req_ring);
        kvt_ring_close(self->rep_ring);
    }
    kvt_ring_destroy(&self->req_ring);
    kvt_ring_destroy(&self->rep_ring);
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
    if (self->arena_path && stat(self->arena_path, &st) == 0 && st.st_dev == self->arena_dev &&
        st.st_ino == self->arena_ino)
        return;
    s_pair_drop(self);
}

static int64_t s_left_ns(uint64_t deadline)
{
    uint64_t now = s_mono_ns();
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
        s_fail(self, KVT_EUNAVAIL,
               "the daemon closed the fast path (a request in flight on it may or may not have "
               "run); later calls go over the socket");
    else if (rc)
        s_fail(self, KVT_EUNAVAIL,
               "the fast path's reply ring is malformed (%s); later calls go over the socket",
               kvt_ring_broken(self->rep_ring) ? kvt_ring_why(self->rep_ring)
                                               : "an unparsable record");
    if (rc) {
        s_pair_drop(self);
        return KVT_EUNAVAIL;
    }
    if (*nf == 0 || kvt_msg_read_uint(f[0].ptr, f[0].len, ruid) != 0)
        *ruid = 0;
    if (self->ring_posted && *ruid >= self->ring_posted)
        self->ring_posted = 0;
    self->ring_seen_ns = s_mono_ns();
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
    while (s_pair_mine(self) && s_ring_take(self, 0, f, &nf, &ruid) == 0)
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
    while (self->ring_posted && s_pair_mine(self) &&
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
    if (s_mono_ns() - self->ring_seen_ns > S_RING_IDLE_NS) {
        s_pair_check_owner(self); /* idle a while: its daemon may have died meanwhile */
        if (!s_pair_mine(self))
            return 1;
    }
    int rc;
    while ((rc = kvt_ring_push(self->req_ring, iov, 3)) == KVT_EBUSY) {
        s_ring_drain(self); /* a daemon stuck on a full reply ring reads no requests */
        if (!s_pair_mine(self))
            return 1;
        rc = kvt_ring_wait(self->req_ring, need, s_left_ns(deadline));
        if (rc == KVT_ETIMEDOUT) {
            s_pair_check_owner(self);
            return s_fail(self, rc, "timed out waiting for room on the fast path's request ring");
        }
        if (rc)
            break;
    }
    if (rc == 0)
        return 0;
    s_pair_drop(self); /* KVT_EUNAVAIL: the daemon closed it; KVT_EBADREQ: malformed */
    return 1;
}

/* Waits on the reply ring for the reply to `uid`, skipping stale ones, and fills r as
 * s_recv_on does (a ring reply has no data frames: only S_DATA_NONE calls come here). */
static int s_ring_recv(kvtier_t *self, uint64_t uid, uint64_t deadline, s_reply_t *r)
{
    kvt_ring_frame_t f[S_RING_FRAMES];
    uint32_t nf;
    uint64_t ruid;
    for (;;) {
        int rc = s_ring_take(self, deadline, f, &nf, &ruid);
        if (rc == KVT_ETIMEDOUT) {
            s_pair_check_owner(self);
            return s_fail(self, rc, "timed out waiting for the daemon (fast path)");
        }
        if (rc)
            return rc;
        if (ruid != uid)
            continue;
        if (nf < 3)
            return s_fail(self, KVT_EINTERNAL,
                          "a reply of fewer than 3 frames, expected [uid, type, body]");
        r->len = f[2].len;
        r->buf = malloc(r->len ? r->len : 1);
        if (!r->buf)
            return s_fail(self, KVT_ENOMEM, "out of memory copying the reply");
        memcpy(r->buf, f[2].ptr, r->len);
        return 0;
    }
}

static uint64_t s_deadline(const kvtier_t *self)
{
    return s_mono_ns() + (uint64_t)self->timeout_ms * 1000000u;
}

/* One request and its reply, over the ring when it can go there, else the socket. The
 * receive timeout is the handle's (the socket's ZMQ_RCVTIMEO). */
static int s_exchange(kvtier_t *self, uint32_t type, const void *body, size_t len,
                      const void *const *data, const size_t *lens, uint32_t ndata,
                      s_data_mode_t mode, s_reply_t *r)
{
    self->error[0] = '\0';
    uint64_t uid = self->next_uid++;
    if (type == KVT_REQ_HELLO || type == KVT_REQ_BYE) {
        /* the daemon replaces (a HELLO that asks) or reclaims the pair at either: our sides
         * are closed first, and never written after */
        s_pair_drop(self);
    } else if (ndata == 0 && mode == S_DATA_NONE && s_pair_mine(self)) {
        uint64_t deadline = s_deadline(self);
        int rc = s_ring_push(self, uid, type, body, len, deadline);
        if (rc <= 0)
            return rc ? rc : s_ring_recv(self, uid, deadline, r);
    }
    if (self->ring_posted)
        s_ring_settle(self, s_deadline(self));
    int rc = s_send_request(self, uid, type, body, len, data, lens, ndata);
    const char *why = "";
    if (rc == 0 && (rc = s_recv_on(self->sock, self->spin_ns, uid, mode, r, &why)) != 0)
        s_fail(self, rc, "%s", why);
    return rc;
}

/* Sends a request whose reply nobody awaits (a later call skips it by uid, on the transport it
 * comes back on): over the ring when it can go there, else the socket. */
static int s_post(kvtier_t *self, uint32_t type, const void *body, size_t len)
{
    self->error[0] = '\0';
    uint64_t uid = self->next_uid++;
    if (s_pair_mine(self)) {
        s_ring_drain(self);
        int rc = s_pair_mine(self) ? s_ring_push(self, uid, type, body, len, s_deadline(self)) : 1;
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

/* Decodes r's body: 0 when it is ok; otherwise the daemon's error as a KVT_E* code, with
 * *msg and *msg_len its message (pointing into r; NULL when it has none), or KVT_EINTERNAL with
 * *undecodable set when the body is not a msgpack map. No state: the heartbeat uses it too. */
static int s_decode(s_reply_t *r, const char **msg, size_t *msg_len, bool *undecodable)
{
    *msg = NULL;
    *msg_len = 0;
    size_t off = 0;
    *undecodable = msgpack_unpack_next(&r->up, r->buf, r->len, &off) != MSGPACK_UNPACK_SUCCESS ||
                   r->up.data.type != MSGPACK_OBJECT_MAP;
    if (*undecodable)
        return KVT_EINTERNAL;
    const msgpack_object *ok = s_get(&r->up.data, "ok");
    if (ok && ok->type == MSGPACK_OBJECT_BOOLEAN && ok->via.boolean)
        return 0;
    const msgpack_object *error = s_get(&r->up.data, "error");
    const msgpack_object *code = error ? s_get(error, "code") : NULL;
    const msgpack_object *m = error ? s_get(error, "message") : NULL;
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
static int s_call_once(kvtier_t *self, uint32_t type, const void *body, size_t len,
                       const void *const *data, const size_t *lens, uint32_t ndata,
                       s_data_mode_t mode, s_reply_t *r)
{
    int rc = s_exchange(self, type, body, len, data, lens, ndata, mode, r);
    if (rc)
        return rc;
    const char *msg;
    size_t msg_len;
    bool undecodable;
    rc = s_decode(r, &msg, &msg_len, &undecodable);
    if (undecodable)
        s_fail(self, rc, "undecodable %s reply from the daemon", kvt_proto_name(type));
    else if (rc && msg)
        s_fail(self, rc, "%.*s", (int)msg_len, msg);
    else if (rc)
        s_fail(self, rc, "daemon error without a message (%s)", kvt_err_wire(rc));
    return rc;
}

static int s_reestablish(kvtier_t *self);

/* HELLO and BYE are the session itself: nothing re-establishes an instance around them. */
static bool s_recovers(uint32_t type)
{
    return type != KVT_REQ_HELLO && type != KVT_REQ_BYE;
}

/* Before a call: when the heartbeat found the instance dropped, say HELLO again first (one
 * atomic load otherwise: this is every call's path). A daemon that does not answer fails the
 * call; one that answers the HELLO with an error leaves the flag up and the call goes out. */
static int s_revive(kvtier_t *self, uint32_t type)
{
    if (!self->hb || !atomic_load_explicit(&self->hb->dropped, memory_order_acquire) ||
        !s_recovers(type))
        return 0;
    int rc = s_reestablish(self);
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
                        s_data_mode_t mode, s_reply_t *r)
{
    char answer[sizeof self->error];
    memcpy(answer, self->error, sizeof answer);
    int rc = s_reestablish(self);
    if (rc) {
        s_reply_free(r);
        s_reply_init(r);
        return rc;
    }
    if (!s_retried(type)) {
        memcpy(self->error, answer, sizeof answer);
        return KVT_ENOINST;
    }
    s_reply_free(r);
    s_reply_init(r);
    return s_call_once(self, type, body, len, data, lens, ndata, mode, r);
}

/* Sends `body` (consumed) plus data frames and decodes the reply, re-establishing a dropped
 * instance on the way (s_revive, s_after_drop). On 0, r->up.data is the ok body. The caller
 * frees r either way. */
static int s_call_data(kvtier_t *self, uint32_t type, msgpack_sbuffer *body,
                       const void *const *data, const size_t *lens, uint32_t ndata,
                       s_data_mode_t mode, s_reply_t *r)
{
    s_reply_init(r);
    int rc = s_revive(self, type);
    if (rc == 0)
        rc = s_call_once(self, type, body->data, body->size, data, lens, ndata, mode, r);
    if (rc == KVT_ENOINST && s_recovers(type))
        rc = s_after_drop(self, type, body->data, body->size, data, lens, ndata, mode, r);
    msgpack_sbuffer_destroy(body);
    return rc;
}

static int s_call(kvtier_t *self, uint32_t type, msgpack_sbuffer *body, s_reply_t *r)
{
    return s_call_data(self, type, body, NULL, NULL, 0, S_DATA_NONE, r);
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
    int rc = s_revive(self, type);
    if (rc == 0)
        rc = s_call_once(self, type, body, len, NULL, NULL, 0, S_DATA_NONE, &r);
    if (rc == KVT_ENOINST && s_recovers(type))
        rc = s_after_drop(self, type, body, len, NULL, NULL, 0, S_DATA_NONE, &r);
    if (r.buf) { /* an answer, ok or not: its raw body is the caller's */
        *reply_body = r.buf;
        *reply_len = r.len;
        r.buf = NULL;
        self->error[0] = '\0';
        rc = 0;
    }
    s_reply_free(&r);
    return rc;
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

/* ---- faulting the arena in ---- */

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels answer EINVAL: pages are touched */
#endif
#define S_PREFAULT_CHUNK (16u << 20) /* the stop flag is read this often */

struct s_prefault {
    char *base;
    size_t size;
    atomic_bool stop;
    pid_t pid; /* the process whose thread it is: a forked child has none to join */
    pthread_t thread;
};

typedef enum { S_MAP_LAZY, S_MAP_POPULATE, S_MAP_BACKGROUND } s_map_mode_t;

/* KVTIER_MAP_POPULATE: "1" (or "true"), "background", anything else lazy. */
static s_map_mode_t s_map_mode(void)
{
    const char *v = getenv("KVTIER_MAP_POPULATE");
    if (!v)
        return S_MAP_LAZY;
    if (strcmp(v, "1") == 0 || strcmp(v, "true") == 0)
        return S_MAP_POPULATE;
    return strcmp(v, "background") == 0 ? S_MAP_BACKGROUND : S_MAP_LAZY;
}

static void *s_prefault_run(void *arg)
{
    s_prefault_t *pf = arg;
    for (size_t off = 0; off < pf->size && !atomic_load(&pf->stop); off += S_PREFAULT_CHUNK) {
        size_t len = pf->size - off < S_PREFAULT_CHUNK ? pf->size - off : S_PREFAULT_CHUNK;
        if (madvise(pf->base + off, len, MADV_POPULATE_WRITE) == 0)
            continue;
        if (errno != EINVAL) /* not an old kernel: touching would only turn it into SIGBUS */
            break;
        for (size_t p = 0; p < len; p += 4096) /* a read maps the page as well */
            (void)*(volatile const char *)(pf->base + off + p);
    }
    return NULL;
}

/* Starts the background fault-in; without a thread the mapping simply stays lazy. */
static s_prefault_t *s_prefault_start(void *base, size_t size)
{
    s_prefault_t *pf = calloc(1, sizeof *pf);
    if (!pf)
        return NULL;
    pf->base = base;
    pf->size = size;
    pf->pid = getpid();
    atomic_init(&pf->stop, false);
    sigset_t all, old;
    sigfillset(&all); /* the caller's signals stay on the caller's threads */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&pf->thread, NULL, s_prefault_run, pf);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        free(pf);
        return NULL;
    }
    return pf;
}

static void s_prefault_stop(s_prefault_t **pf_p)
{
    s_prefault_t *pf = *pf_p;
    if (!pf)
        return;
    atomic_store(&pf->stop, true);
    if (pf->pid == getpid())
        pthread_join(pf->thread, NULL);
    free(pf);
    *pf_p = NULL;
}

/* Unmaps the arena, after the thread faulting it in (if any) has stopped and the ring pair in
 * it has been dropped (nothing may touch a ring after this). */
static void s_unmap_arena(kvtier_t *self)
{
    s_pair_drop(self);
    s_prefault_stop(&self->prefault);
    if (self->arena)
        munmap(self->arena, self->arena_map_len);
    self->arena = NULL;
    self->arena_size = 0;
    self->arena_map_len = 0;
}

/* Maps map_len (>= size: the L1 objects and, past them, the fast path's rings) bytes of the
 * arena file; arena_size stays `size`, the bound of every slot. Failure is not an error of
 * connect: a client on another host has no such file, and PUT/GET still work for it. The
 * reason is kept for the KVT_EUNAVAIL that RESERVE and ACQUIRE then answer. */
static void s_map_arena(kvtier_t *self, const char *file, uint64_t size, uint64_t map_len)
{
    const char *why = NULL;
    int fd = open(file, O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd < 0)
        why = strerror(errno);
    else if (fstat(fd, &st) != 0)
        why = strerror(errno);
    else if (map_len > SIZE_MAX || (uint64_t)st.st_size < size)
        /* a mapping past the end of the file would SIGBUS on the first touch */
        why = "the file is smaller than the size HELLO announced";
    else if ((uint64_t)st.st_size < map_len)
        map_len = size; /* the L1 objects alone: no fast path */
    if (!why) {
        s_map_mode_t mode = s_map_mode();
        void *p = mmap(NULL, (size_t)map_len, PROT_READ | PROT_WRITE,
                       MAP_SHARED | (mode == S_MAP_POPULATE ? MAP_POPULATE : 0), fd, 0);
        if (p == MAP_FAILED) {
            why = strerror(errno);
        } else {
            self->arena = p;
            self->arena_size = (size_t)size;
            self->arena_map_len = (size_t)map_len;
            self->arena_dev = st.st_dev;
            self->arena_ino = st.st_ino;
            if (mode == S_MAP_BACKGROUND)
                self->prefault = s_prefault_start(p, (size_t)map_len);
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

/* Follows the arena a HELLO announced: the mapping stays while the announcement is the same;
 * another one (a restarted daemon) unmaps the old arena — slots into it are dead — and maps
 * the new one. A client that wants the fast path maps shm.map_size bytes (shm.size when the
 * daemon predates it). */
static void s_follow_arena(kvtier_t *self, const msgpack_object *hello)
{
    const msgpack_object *shm = s_get(hello, "shm");
    const msgpack_object *path = shm ? s_get(shm, "path") : NULL;
    uint64_t size = s_uint(shm ? s_get(shm, "size") : NULL);
    uint64_t map_len = self->fastpath_on ? s_uint(shm ? s_get(shm, "map_size") : NULL) : 0;
    if (map_len < size)
        map_len = size;
    bool named = path && path->type == MSGPACK_OBJECT_STR && path->via.str.size && size;
    if (named && self->arena_path && self->arena_announced == size &&
        self->arena_map_announced == map_len && strlen(self->arena_path) == path->via.str.size &&
        memcmp(self->arena_path, path->via.str.ptr, path->via.str.size) == 0)
        return;
    s_unmap_arena(self);
    free(self->arena_path);
    self->arena_path = NULL;
    self->arena_announced = self->arena_map_announced = 0;
    if (!named) {
        snprintf(self->arena_why, sizeof self->arena_why,
                 "the daemon's HELLO named no shared-memory arena (use kvtier_put/kvtier_get)");
        return;
    }
    if (path->via.str.size >= 4096 || memchr(path->via.str.ptr, 0, path->via.str.size)) {
        snprintf(self->arena_why, sizeof self->arena_why,
                 "the daemon's HELLO named an unusable shared-memory path");
        return;
    }
    self->arena_path = strndup(path->via.str.ptr, path->via.str.size);
    if (!self->arena_path) {
        snprintf(self->arena_why, sizeof self->arena_why, "out of memory");
        return;
    }
    self->arena_announced = size;
    self->arena_map_announced = map_len;
    s_map_arena(self, self->arena_path, size, map_len);
}

/* Attaches the pair HELLO offered, `fastpath: {request, reply, capacity}` (the previous one is
 * dropped already: s_exchange, before the HELLO went out). Each region must lie in the mapped
 * arena past the L1 objects, apart from the other, and hold a ring of that capacity; offsets
 * need only the 8-byte alignment a ring needs (kvtierd packs a pair as one region: its reply
 * ring starts right after the request ring, not on a page). false, with nothing attached, when
 * the offer does not check out: the socket serves, as it does without an offer. */
static bool s_pair_attach(kvtier_t *self, const msgpack_object *offer)
{
    uint64_t req = s_uint(s_get(offer, "request")), rep = s_uint(s_get(offer, "reply"));
    uint64_t cap = s_uint(s_get(offer, "capacity"));
    if (!self->arena || cap < KVT_RING_MIN_CAPACITY || cap > KVT_RING_MAX_CAPACITY ||
        (cap & (cap - 1)))
        return false;
    uint64_t region = kvt_ring_region_size((uint32_t)cap), lo = self->arena_size,
             hi = self->arena_map_len;
    bool placed = req % 8 == 0 && rep % 8 == 0 && req >= lo && rep >= lo && req <= hi &&
                  rep <= hi && region <= hi - req && region <= hi - rep &&
                  (req + region <= rep || rep + region <= req);
    char why[160];
    uint8_t *base = self->arena;
    kvt_ring_t *p = placed ? kvt_ring_new(base + req, (size_t)region, (uint32_t)cap,
                                          KVT_RING_PRODUCER, why, sizeof why)
                           : NULL;
    kvt_ring_t *c = p ? kvt_ring_new(base + rep, (size_t)region, (uint32_t)cap,
                                     KVT_RING_CONSUMER, why, sizeof why)
                      : NULL;
    size_t need = c ? kvt_ring_max_payload(c) : 0;
    if (c && self->ring_buf_cap < need) {
        uint8_t *b = realloc(self->ring_buf, need);
        if (b) {
            self->ring_buf = b;
            self->ring_buf_cap = need;
        }
    }
    if (!c || self->ring_buf_cap < need) {
        kvt_ring_destroy(&p);
        kvt_ring_destroy(&c);
        return false;
    }
    self->req_ring = p;
    self->rep_ring = c;
    self->ring_gen = atomic_load_explicit(&s_fork_gen, memory_order_relaxed);
    self->ring_posted = 0;
    self->ring_seen_ns = s_mono_ns();
    return true;
}

/* Whether HELLO asks for a pair: not with KVTIER_FASTPATH=0, nor once this handle knows that
 * the arena does not map here (a client on another host). The first HELLO cannot know. */
static bool s_fastpath_ask(const kvtier_t *self)
{
    return self->fastpath_on && (self->arena || !self->arena_path);
}

/* Takes in what a HELLO answered: server facts, the instance's token, the arena, the pair. */
static void s_apply_hello(kvtier_t *self, const msgpack_object *body)
{
    const msgpack_object *server = s_get(body, "server"), *token = s_get(body, "token");
    self->info.version = (uint32_t)s_uint(s_get(body, "version"));
    self->info.chunk_tokens = (uint32_t)s_uint(s_get(body, "chunk_tokens"));
    self->info.lease_ms = (uint32_t)s_uint(s_get(body, "lease_ms"));
    self->info.max_message = s_uint(s_get(body, "max_message"));
    if (server && server->type == MSGPACK_OBJECT_STR)
        snprintf(self->info.server, sizeof self->info.server, "%.*s", (int)server->via.str.size,
                 server->via.str.ptr);
    self->token[0] = '\0';
    if (token && token->type == MSGPACK_OBJECT_STR && token->via.str.size <= KVT_MAX_TOKEN &&
        !memchr(token->via.str.ptr, 0, token->via.str.size)) {
        memcpy(self->token, token->via.str.ptr, token->via.str.size);
        self->token[token->via.str.size] = '\0';
    }
    s_follow_arena(self, body);
    const msgpack_object *offer = s_get(body, "fastpath");
    if (offer && self->fastpath_on)
        s_pair_attach(self, offer); /* an offer that does not check out: the socket serves */
}

/* HELLO {version, client, instance, token?, fastpath?}: token joins an instance that exists;
 * fastpath asks for a ring pair. */
static void s_hello_body(msgpack_sbuffer *sb, const char *client, const char *instance,
                         const char *token, bool fastpath)
{
    msgpack_packer pk;
    bool with_token = token && *token;
    s_body_begin(sb, &pk, 3 + (with_token ? 1 : 0) + (fastpath ? 1 : 0));
    kvt_pack_str(&pk, "version");
    msgpack_pack_uint32(&pk, KVT_PROTO_VERSION);
    kvt_pack_str(&pk, "client");
    kvt_pack_str(&pk, client);
    kvt_pack_str(&pk, "instance");
    kvt_pack_str(&pk, instance);
    if (with_token) {
        kvt_pack_str(&pk, "token");
        kvt_pack_str(&pk, token);
    }
    if (fastpath) {
        kvt_pack_str(&pk, "fastpath");
        msgpack_pack_true(&pk);
    }
}

/* A body naming the instance: PING (alive only if this connection acts for it) and BYE. */
static void s_instance_body(msgpack_sbuffer *sb, const char *instance)
{
    msgpack_packer pk;
    s_body_begin(sb, &pk, 1);
    kvt_pack_str(&pk, "instance");
    kvt_pack_str(&pk, instance);
}

static int s_hello(kvtier_t *self, const char *token, bool fastpath, s_reply_t *r)
{
    msgpack_sbuffer sb;
    s_hello_body(&sb, self->client, self->instance, token, fastpath);
    int rc = s_call_once(self, KVT_REQ_HELLO, sb.data, sb.size, NULL, NULL, 0, S_DATA_NONE, r);
    msgpack_sbuffer_destroy(&sb);
    return rc;
}

/* BYE, best effort: an instance that is not told expires after lease_ms anyway. */
static void s_bye(kvtier_t *self)
{
    msgpack_sbuffer sb;
    s_instance_body(&sb, self->instance);
    s_reply_t r;
    s_reply_init(&r);
    s_call_once(self, KVT_REQ_BYE, sb.data, sb.size, NULL, NULL, 0, S_DATA_NONE, &r);
    s_reply_free(&r);
    msgpack_sbuffer_destroy(&sb);
}

/* ---- the heartbeat ----
 * Its own thread (named kvtier-hb) and its own DEALER on the process's context. It sleeps one
 * interval before it opens its connection, so a connection that lives shorter (a CLI command)
 * never pays for it; then it joins the instance with HELLO {instance, token} and sends
 * PING {instance} every interval. Every wait is a poll(2) or zmq_poll on the wake eventfd
 * too, so kvtier_close stops it at once, daemon or no daemon; ZMQ_IMMEDIATE keeps PINGs from
 * queueing while the daemon is away. What it learns goes to the caller's thread through
 * `dropped` (PING answered instance_dropped) or a newer token (its HELLO found the instance
 * gone and made it anew: the caller's thread then joins that one). It never re-creates an
 * instance it lost: that is the caller's thread's HELLO, which also re-registers the GPU
 * layouts. */

static void s_hb_wake(s_hb_t *hb)
{
    uint64_t one = 1;
    ssize_t n = write(hb->wake, &one, sizeof one);
    (void)n; /* a full counter already wakes it */
}

static void s_hb_drain(s_hb_t *hb)
{
    uint64_t n;
    ssize_t got = read(hb->wake, &n, sizeof n);
    (void)got;
}

/* Sleeps up to ms unless woken. false when the heartbeat must stop. */
static bool s_hb_sleep(s_hb_t *hb, int ms)
{
    struct pollfd p = {hb->wake, POLLIN, 0};
    if (poll(&p, 1, ms) > 0)
        s_hb_drain(hb);
    return !atomic_load(&hb->stop);
}

/* Waits up to ms for items[0] (the socket) to be ready. A wake on items[1] ends the wait and
 * sets *woken: a stop, or a new token to act on at once (a request still unanswered then is
 * given up; its late reply is skipped as stale). */
static bool s_hb_poll(s_hb_t *hb, zmq_pollitem_t items[2], int ms, bool *woken)
{
    uint64_t end = s_mono_ns() + (uint64_t)ms * 1000000u;
    for (;;) {
        items[0].revents = items[1].revents = 0;
        int n = zmq_poll(items, 2, ms);
        if (n < 0 && zmq_errno() != EINTR)
            return false;
        if (items[1].revents) {
            s_hb_drain(hb);
            *woken = true;
            return false;
        }
        if (items[0].revents)
            return true;
        uint64_t now = s_mono_ns();
        if (now >= end)
            return false;
        ms = (int)((end - now) / 1000000u) + 1;
    }
}

static void *s_hb_socket(const s_hb_t *hb)
{
    void *sock = zmq_socket(hb->ctx, ZMQ_DEALER);
    if (!sock)
        return NULL;
    int zero = 0, one = 1;
    zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &zero, sizeof zero); /* waits are s_hb_poll's */
    zmq_setsockopt(sock, ZMQ_IMMEDIATE, &one, sizeof one);
    kvtier_curve_t curve = {hb->server_key, hb->client_cert};
    bool used;
    char err[256];
    if (kvt__curve_setup(sock, hb->endpoint, &curve, &used, err, sizeof err) != 0 ||
        zmq_connect(sock, hb->endpoint) != 0) {
        zmq_close(sock);
        return NULL;
    }
    return sock;
}

/* One request of the heartbeat and its decoded reply: 0, the daemon's KVT_E* answer, or
 * KVT_EUNAVAIL / KVT_ETIMEDOUT when it could not be sent (no connection within an interval)
 * or was not answered within an interval (at most the handle's timeout): a daemon that
 * restarted lost it, and the next beat asks again. */
static int s_hb_exchange(s_hb_t *hb, void *sock, uint64_t uid, uint32_t type,
                         const msgpack_sbuffer *body, s_reply_t *r, bool *woken)
{
    int interval = atomic_load(&hb->interval_ms);
    zmq_pollitem_t items[2] = {{sock, 0, ZMQ_POLLOUT, 0}, {NULL, hb->wake, ZMQ_POLLIN, 0}};
    if (!s_hb_poll(hb, items, interval, woken) ||
        s_send_on(sock, ZMQ_DONTWAIT, uid, type, body->data, body->size, NULL, NULL, 0) != 0)
        return KVT_EUNAVAIL;
    items[0].events = ZMQ_POLLIN;
    int wait_ms = interval < hb->timeout_ms ? interval : hb->timeout_ms;
    uint64_t end = s_mono_ns() + (uint64_t)wait_ms * 1000000u;
    for (;;) {
        uint64_t now = s_mono_ns();
        if (now >= end || !s_hb_poll(hb, items, (int)((end - now) / 1000000u) + 1, woken))
            return KVT_ETIMEDOUT;
        const char *why, *msg;
        size_t msg_len;
        bool undecodable;
        int rc = s_recv_on(sock, 0, uid, S_DATA_NONE, r, &why);
        if (rc != KVT_ETIMEDOUT) /* ETIMEDOUT: it read a stale reply, and nothing else yet */
            return rc ? rc : s_decode(r, &msg, &msg_len, &undecodable);
    }
}

/* After the heartbeat's HELLO for generation gen: it joined when its token came back; another
 * token means the instance was gone and this HELLO made it anew — the caller's thread must
 * join that one (it keeps nothing of the old) and re-register. */
static void s_hb_joined(s_hb_t *hb, uint64_t gen, const char *presented, int rc, const s_reply_t *r,
                        uint64_t *joined)
{
    const msgpack_object *t = rc == 0 ? s_get(&r->up.data, "token") : NULL;
    pthread_mutex_lock(&hb->lock);
    if (rc == 0) {
        *joined = gen;
        bool anew = t && t->type == MSGPACK_OBJECT_STR && t->via.str.size <= KVT_MAX_TOKEN &&
                    !memchr(t->via.str.ptr, 0, t->via.str.size) &&
                    !(t->via.str.size == strlen(presented) &&
                      memcmp(t->via.str.ptr, presented, t->via.str.size) == 0);
        if (anew && hb->gen == gen) {
            memcpy(hb->token, t->via.str.ptr, t->via.str.size);
            hb->token[t->via.str.size] = '\0';
            atomic_store_explicit(&hb->dropped, true, memory_order_release);
        }
    }
    hb->busy = false;
    pthread_cond_broadcast(&hb->idle);
    pthread_mutex_unlock(&hb->lock);
}

/* PING for generation gen answered instance_dropped. A HELLO of the caller's thread since
 * (a newer generation) already answered it. */
static void s_hb_lost(s_hb_t *hb, uint64_t gen)
{
    pthread_mutex_lock(&hb->lock);
    if (hb->gen == gen)
        atomic_store_explicit(&hb->dropped, true, memory_order_release);
    pthread_mutex_unlock(&hb->lock);
}

static void *s_hb_run(void *arg)
{
    s_hb_t *hb = arg;
    void *sock = NULL;
    uint64_t uid = 1, joined = 0, dead = 0;
    bool woken = false;
    while (woken || s_hb_sleep(hb, atomic_load(&hb->interval_ms))) {
        woken = false;
        if (atomic_load(&hb->stop))
            break;
        if (!sock && !(sock = s_hb_socket(hb)))
            continue; /* tried again next interval */
        char token[KVT_MAX_TOKEN + 1];
        pthread_mutex_lock(&hb->lock);
        uint64_t gen = hb->gen;
        memcpy(token, hb->token, sizeof token);
        bool hello = gen != joined && gen != dead;
        hb->busy = hello;
        pthread_mutex_unlock(&hb->lock);
        if (gen == dead)
            continue; /* lost: the caller's next call says HELLO, and gen moves on */
        msgpack_sbuffer sb;
        if (hello)
            s_hello_body(&sb, hb->client, hb->instance, token, false);
        else
            s_instance_body(&sb, hb->instance);
        s_reply_t r;
        s_reply_init(&r);
        int rc =
            s_hb_exchange(hb, sock, uid++, hello ? KVT_REQ_HELLO : KVT_REQ_PING, &sb, &r, &woken);
        msgpack_sbuffer_destroy(&sb);
        if (hello) {
            s_hb_joined(hb, gen, token, rc, &r, &joined);
        } else if (rc == KVT_ENOINST) {
            s_hb_lost(hb, gen);
            dead = gen;
        }
        s_reply_free(&r);
    }
    if (sock)
        zmq_close(sock);
    return NULL;
}

/* The interval: KVTIER_HEARTBEAT_MS (0: no heartbeat; at least 10 ms), else lease_ms / 3
 * within [100 ms, 10 s] (10 s when HELLO gave no lease_ms). */
static int s_hb_interval(uint32_t lease_ms, bool *fixed)
{
    int env = s_env_int("KVTIER_HEARTBEAT_MS", -1, 0, 3600000);
    *fixed = env >= 0;
    if (env >= 0)
        return env > 0 && env < 10 ? 10 : env;
    uint32_t ms = lease_ms ? lease_ms / 3 : 10000;
    return ms < 100 ? 100 : ms > 10000 ? 10000 : (int)ms;
}

static void s_hb_free(s_hb_t *hb, bool destroy_sync)
{
    if (hb->wake >= 0)
        close(hb->wake);
    if (destroy_sync) {
        pthread_mutex_destroy(&hb->lock);
        pthread_cond_destroy(&hb->idle);
    }
    free(hb->endpoint);
    free(hb->server_key);
    free(hb->client_cert);
    free(hb);
}

static char *s_dup_opt(const char *s, bool *oom)
{
    char *d = s ? strdup(s) : NULL;
    *oom = *oom || (s && !d);
    return d;
}

/* Starts the heartbeat of a connected handle (nothing when KVTIER_HEARTBEAT_MS=0). The CURVE
 * settings are copied (the environment's when curve is NULL): its socket is made later. */
static int s_hb_start(kvtier_t *self, const char *endpoint, const kvtier_curve_t *curve, char *err,
                      size_t errlen)
{
    bool fixed;
    int interval = s_hb_interval(self->info.lease_ms, &fixed);
    if (interval == 0)
        return 0;
    s_hb_t *hb = calloc(1, sizeof *hb);
    if (!hb) {
        snprintf(err, errlen, "out of memory");
        return KVT_ENOMEM;
    }
    pthread_mutex_init(&hb->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&hb->idle, &ca);
    pthread_condattr_destroy(&ca);
    bool oom = false;
    hb->endpoint = s_dup_opt(endpoint, &oom);
    hb->server_key = s_dup_opt(curve ? curve->server_key : getenv("KVTIER_CURVE_SERVERKEY"), &oom);
    hb->client_cert = s_dup_opt(curve ? curve->client_cert : getenv("KVTIER_CURVE_CERT"), &oom);
    hb->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    atomic_init(&hb->dropped, false);
    atomic_init(&hb->stop, false);
    atomic_init(&hb->interval_ms, interval);
    hb->interval_fixed = fixed;
    hb->pid = self->pid;
    hb->ctx = self->ctx;
    hb->timeout_ms = self->timeout_ms;
    hb->gen = 1;
    memcpy(hb->token, self->token, sizeof hb->token);
    memcpy(hb->client, self->client, sizeof hb->client);
    memcpy(hb->instance, self->instance, sizeof hb->instance);
    int e = oom ? ENOMEM : hb->wake < 0 ? errno : 0;
    if (e == 0) {
        /* the heartbeat takes no signal: the application's threads get them all */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        e = pthread_create(&hb->thread, NULL, s_hb_run, hb);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (e == 0) /* named here, not in the thread: it shows as such from connect on */
            pthread_setname_np(hb->thread, "kvtier-hb");
    }
    if (e) {
        snprintf(err, errlen,
                 "cannot start the heartbeat thread: %s (KVTIER_HEARTBEAT_MS=0 "
                 "runs without one)",
                 strerror(e));
        s_hb_free(hb, true);
        return e == ENOMEM ? KVT_ENOMEM : KVT_EINTERNAL;
    }
    self->hb = hb;
    return 0;
}

/* Stops and joins the heartbeat: its waits end at the wake, so this takes no longer than a
 * poll wake-up, daemon or no daemon. In a forked child there is no thread (nor may its lock
 * be taken: the parent's thread may have held it at the fork): only the memory goes. */
static void s_hb_stop(s_hb_t **hb_p)
{
    s_hb_t *hb = *hb_p;
    if (!hb)
        return;
    *hb_p = NULL;
    if (hb->pid != getpid()) {
        s_hb_free(hb, false);
        return;
    }
    atomic_store(&hb->stop, true);
    s_hb_wake(hb);
    pthread_join(hb->thread, NULL);
    s_hb_free(hb, true);
}

/* The heartbeat of this process (not one inherited through fork), or NULL. */
static s_hb_t *s_hb_mine(const kvtier_t *self)
{
    return self->hb && self->hb->pid == getpid() ? self->hb : NULL;
}

/* The token to present when saying HELLO again: the heartbeat's when it made the instance
 * anew, else the caller's own. */
static void s_hb_token(const kvtier_t *self, char out[KVT_MAX_TOKEN + 1])
{
    s_hb_t *hb = s_hb_mine(self);
    if (!hb) {
        memcpy(out, self->token, KVT_MAX_TOKEN + 1);
        return;
    }
    pthread_mutex_lock(&hb->lock);
    memcpy(out, hb->token, KVT_MAX_TOKEN + 1);
    pthread_mutex_unlock(&hb->lock);
}

/* After a HELLO refused bad_request: waits (bounded) for a HELLO of the heartbeat in flight —
 * it may just be making the instance anew — and tells whether it brought a token other than
 * `presented` (then copied there). */
static bool s_hb_newer_token(const kvtier_t *self, char presented[KVT_MAX_TOKEN + 1])
{
    s_hb_t *hb = s_hb_mine(self);
    if (!hb)
        return false;
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += self->timeout_ms / 1000;
    until.tv_nsec += (long)(self->timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&hb->lock);
    while (hb->busy && pthread_cond_timedwait(&hb->idle, &hb->lock, &until) == 0)
        ;
    bool newer = strcmp(hb->token, presented) != 0;
    if (newer)
        memcpy(presented, hb->token, KVT_MAX_TOKEN + 1);
    pthread_mutex_unlock(&hb->lock);
    return newer;
}

/* After a HELLO of the caller's thread: the heartbeat joins with the new token now, and its
 * interval follows the daemon's lease_ms (unless KVTIER_HEARTBEAT_MS set it). */
static void s_hb_publish(kvtier_t *self)
{
    s_hb_t *hb = s_hb_mine(self);
    if (!hb)
        return;
    bool fixed;
    if (!hb->interval_fixed)
        atomic_store(&hb->interval_ms, s_hb_interval(self->info.lease_ms, &fixed));
    pthread_mutex_lock(&hb->lock);
    memcpy(hb->token, self->token, sizeof hb->token);
    hb->gen++;
    atomic_store_explicit(&hb->dropped, false, memory_order_release);
    pthread_mutex_unlock(&hb->lock);
    s_hb_wake(hb);
}

/* ---- GPU registrations kept for re-establishment ---- */

static int s_gpu_find(const kvtier_t *self, uint32_t device)
{
    for (uint32_t i = 0; i < self->ngpu; i++)
        if (self->gpu[i].device == device)
            return (int)i;
    return -1;
}

/* Room for one more, made before REGISTER_GPU is sent: once the daemon holds a registration,
 * keeping its copy cannot fail. */
static int s_gpu_room(kvtier_t *self)
{
    if (self->ngpu < self->gpu_cap)
        return 0;
    uint32_t cap = self->gpu_cap ? 2 * self->gpu_cap : 4;
    s_gpu_reg_t *g = realloc(self->gpu, cap * sizeof *g);
    if (!g)
        return KVT_ENOMEM;
    self->gpu = g;
    self->gpu_cap = cap;
    return 0;
}

/* Keeps (owns) the body of a registration the daemon accepted. */
static void s_gpu_keep(kvtier_t *self, uint32_t device, void *body, size_t len)
{
    int i = s_gpu_find(self, device);
    if (i < 0)
        i = (int)self->ngpu++;
    else
        free(self->gpu[i].body);
    self->gpu[i] = (s_gpu_reg_t){device, true, body, len};
}

static void s_gpu_forget(kvtier_t *self, uint32_t device)
{
    int i = s_gpu_find(self, device);
    if (i < 0)
        return;
    free(self->gpu[i].body);
    self->gpu[i] = self->gpu[--self->ngpu];
}

/* Says one kept registration again; it is live when the daemon accepts it. */
static int s_gpu_register_again(kvtier_t *self, s_gpu_reg_t *g)
{
    s_reply_t r;
    s_reply_init(&r);
    int rc =
        s_call_once(self, KVT_REQ_REGISTER_GPU, g->body, g->len, NULL, NULL, 0, S_DATA_NONE, &r);
    s_reply_free(&r);
    g->live = rc == 0;
    return rc;
}

/* Before STORE_GPU / RETRIEVE_GPU: a registration whose re-establishment failed is tried once
 * more, and if it fails again the call fails saying why (not a bare "send REGISTER_GPU"). */
static int s_gpu_ensure(kvtier_t *self, uint32_t type, uint32_t device)
{
    int i = s_gpu_find(self, device);
    if (i < 0 || self->gpu[i].live)
        return 0;
    int rc = s_gpu_register_again(self, &self->gpu[i]);
    if (rc == 0)
        return 0;
    char why[sizeof self->error];
    memcpy(why, self->error, sizeof why);
    return s_fail(self, rc,
                  "%s: the GPU registration of device %u was lost with the instance, and "
                  "registering it again failed: %s",
                  kvt_proto_name(type), device, why);
}

/* ---- re-establishment ---- */

/* The instance is gone (a call answered instance_dropped, or the heartbeat said so): HELLO
 * again under the same name with the freshest token. The token that comes back tells what
 * happened: the caller's own (only this connection had lost the instance, e.g. after a
 * reconnect: its leases and registrations live on) or a new one (the instance is new: every
 * lease is gone, and the GPU layouts are registered again). */
static int s_reestablish(kvtier_t *self)
{
    char presented[KVT_MAX_TOKEN + 1], before[KVT_MAX_TOKEN + 1];
    memcpy(before, self->token, sizeof before);
    s_hb_token(self, presented);
    s_reply_t r;
    s_reply_init(&r);
    int rc = s_hello(self, presented, s_fastpath_ask(self), &r);
    if (rc == KVT_EBADREQ && s_hb_newer_token(self, presented)) {
        s_reply_free(&r);
        s_reply_init(&r);
        rc = s_hello(self, presented, s_fastpath_ask(self), &r);
    }
    if (rc) {
        char why[sizeof self->error];
        memcpy(why, self->error, sizeof why);
        s_reply_free(&r);
        return s_fail(self, rc,
                      "instance '%.64s' was dropped by the daemon, and saying HELLO again "
                      "failed: %s",
                      self->instance, why);
    }
    s_apply_hello(self, &r.up.data);
    s_reply_free(&r);
    bool same = self->token[0] && strcmp(self->token, before) == 0;
    s_hb_publish(self);
    for (uint32_t i = 0; !same && i < self->ngpu; i++)
        s_gpu_register_again(self, &self->gpu[i]); /* a failure: s_gpu_ensure reports it */
    self->error[0] = '\0';
    return 0;
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
    if (strlen(client) > KVT_MAX_NAME || (instance && strlen(instance) > KVT_MAX_NAME)) {
        snprintf(err, errlen, "client and instance names are at most %d bytes", KVT_MAX_NAME);
        return NULL;
    }
    kvtier_t *self = calloc(1, sizeof *self);
    if (!self) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    self->timeout_ms = timeout_ms > 0 ? timeout_ms : 5000;
    self->next_uid = 1;
    self->pid = getpid();
    snprintf(self->client, sizeof self->client, "%s", client);
    if (instance)
        snprintf(self->instance, sizeof self->instance, "%s", instance);
    else
        snprintf(self->instance, sizeof self->instance, "%s-%d-%u", client, (int)self->pid,
                 atomic_fetch_add(&s_seq, 1));
    self->spin_ns = (uint64_t)s_env_int("KVTIER_SPIN_US", 0, 0, 100000) * 1000u;
    const char *fastpath = getenv("KVTIER_FASTPATH");
    self->fastpath_on = !fastpath || strcmp(fastpath, "0") != 0;
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
    s_reply_t r;
    s_reply_init(&r);
    int rc = s_hello(self, NULL, s_fastpath_ask(self), &r);
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
    s_apply_hello(self, &r.up.data);
    s_reply_free(&r);
    if (s_hb_start(self, endpoint, curve, err, errlen) != 0) {
        s_bye(self);
        goto fail;
    }
    return self;
fail:
    s_unmap_arena(self);
    free(self->arena_path);
    free(self->ring_buf);
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
    /* the heartbeat first: nothing may join or ping the instance after its BYE */
    s_hb_stop(&self->hb);
    /* the pair: our sides closed before BYE (a forked child only frees its copies) */
    s_pair_drop(self);
    /* a child forked after connect inherited the parent's instance: it is not its to end */
    if (self->pid == getpid())
        s_bye(self);
    s_unmap_arena(self);
    free(self->arena_path);
    free(self->ring_buf);
    for (uint32_t i = 0; i < self->ngpu; i++)
        free(self->gpu[i].body);
    free(self->gpu);
    zmq_close(self->sock);
    s_ctx_release(self->ctx);
    free(self);
    *self_p = NULL;
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
    return self && s_pair_mine(self) ? 1 : 0;
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
    s_instance_body(&sb, self->instance); /* alive only if this connection acts for it */
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
        int rc = s_post(self, KVT_REQ_RELEASE, sb.data, sb.size);
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
    /* a copy to say again after a re-establishment, and room for it, before it is sent */
    void *copy = s_gpu_room(self) == 0 ? malloc(sb.size) : NULL;
    size_t len = sb.size;
    if (!copy) {
        msgpack_sbuffer_destroy(&sb);
        return s_fail(self, KVT_ENOMEM, "register_gpu: out of memory");
    }
    memcpy(copy, sb.data, len);
    s_reply_t r;
    int rc = s_call(self, KVT_REQ_REGISTER_GPU, &sb, &r);
    s_reply_free(&r);
    if (rc == 0)
        s_gpu_keep(self, lay->device, copy, len);
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
    s_body_begin(&sb, &pk, 1);
    s_pack_uint_field(&pk, "device", device);
    s_gpu_forget(self, device);
    s_reply_t r;
    int rc = s_call(self, KVT_REQ_UNREGISTER_GPU, &sb, &r);
    s_reply_free(&r);
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
        return s_fail(self, KVT_EINVAL, "%s: block_ids is NULL", kvt_proto_name(type));
    rc = s_revive(self, type);
    if (rc == 0)
        rc = s_gpu_ensure(self, type, device);
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

/* ---- the fast-path ring for other languages (thin wrappers over common/kvt_ring) ---- */

struct kvtier_ring {
    kvt_ring_t *ring;
};

kvtier_ring_t *kvtier_ring_attach(void *region, size_t size, uint32_t capacity, int producer,
                                  char *err, size_t errlen)
{
    char why[160] = "";
    kvt_ring_t *r = region ? kvt_ring_new(region, size, capacity,
                                          producer ? KVT_RING_PRODUCER : KVT_RING_CONSUMER, why,
                                          sizeof why)
                           : NULL;
    kvtier_ring_t *self = r ? malloc(sizeof *self) : NULL;
    if (!self) {
        if (err && errlen)
            snprintf(err, errlen, "%s", !region ? "no region" : r ? "out of memory" : why);
        kvt_ring_destroy(&r);
        return NULL;
    }
    self->ring = r;
    return self;
}

void kvtier_ring_detach(kvtier_ring_t *self)
{
    if (!self)
        return;
    kvt_ring_destroy(&self->ring);
    free(self);
}

size_t kvtier_ring_max_payload(const kvtier_ring_t *self)
{
    return kvt_ring_max_payload(self->ring);
}

int kvtier_ring_push(kvtier_ring_t *self, const void *const *frames, const size_t *lens,
                     uint32_t n)
{
    kvt_ring_iov_t iov[16];
    if (n > 16 || (n && (!frames || !lens)))
        return KVT_EINVAL;
    for (uint32_t i = 0; i < n; i++)
        iov[i] = (kvt_ring_iov_t){frames[i], lens[i]};
    return kvt_ring_push(self->ring, iov, n);
}

int kvtier_ring_pop(kvtier_ring_t *self, void *buf, size_t cap, size_t *len)
{
    return kvt_ring_pop(self->ring, buf, cap, len);
}

int kvtier_ring_wait(kvtier_ring_t *self, size_t need, int64_t timeout_ns)
{
    return kvt_ring_wait(self->ring, need, timeout_ns);
}

void kvtier_ring_close(kvtier_ring_t *self)
{
    kvt_ring_close(self->ring);
}
