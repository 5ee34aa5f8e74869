/* DESIGN: single-threaded loop on the main thread — the only code that touches the ROUTER.
 * zmq_poll waits on the ROUTER and on the worker pool's eventfd (100 ms at most); a wake-up
 * takes up to S_BATCH messages, then the finished worker jobs, then the periodic work
 * (supervisor beat, session expiry, prefetch sweep), so a flood cannot starve the heartbeat.
 *
 * A message becomes a kvt_rq_t (kvt_handlers.h) that owns its frames, its decoded body and its
 * reply until s_finish() sends the reply and frees everything in one place. It runs by the run
 * class of its type: INLINE requests on this loop; WORKER requests (PUT, CLEAR, GPU copies) on
 * the worker pool; INLINE_THEN_LOOKUP requests (LOOKUP) on this loop, then, when their inline
 * part leaves L2 work, on the lookup pool. Pooled requests come back through the pool's done
 * queue, so replies may leave out of order (the uid matches them). Replies go out with
 * ZMQ_DONTWAIT and ROUTER_MANDATORY: a client that vanished or stopped reading costs a
 * counter, never a blocked loop. On stop, intake ends and the jobs in flight are finished and
 * answered (bounded wait) before the socket closes.
 *
 * Requests from the fast path's rings (kvt_fastpath) run through the same prepare / dispatch /
 * finish on the fastpath thread; the loop holds `lock` while it works (not while it polls) and
 * the fastpath thread while it handles, so the request path stays single-threaded. Only this
 * thread touches the socket: a ring request's reply goes back into its ring. */
#include "kvt_server.h"

#include "kvt_accept.h"
#include "kvt_curve.h"
#include "kvt_error.h"
#include "kvt_fastpath.h"
#include "kvt_handlers.h"
#include "kvt_handoff.h"
#include "kvt_log.h"
#include "kvt_msg.h"
#include "kvt_proto.h"
#include "kvt_reload.h"
#include "kvt_reqstats.h"
#include "kvt_router.h"
#include "kvt_session.h"
#include "kvt_workers.h"

#include <czmq.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define S_BATCH 256
#define S_POLL_MS 100
#define S_SWEEP_MS 100
#define S_DRAIN_MS 5000
#define S_WORKER_QUEUE 1024
#define S_SPARE_FRAMES 64   /* a spare request keeps a data array up to this many frames */
#define S_SPARE_REPLY 65536 /* and a reply buffer up to this size */

struct kvt_server {
    const kvt_config_t *cfg;
    kvt_reqstats_t *stats; /* not owned */
    kvt_sup_thread_t *beat;
    kvt_services_t svc;
    kvt_handoff_t *handoff; /* the fast path's ring pairs go out through it */
    kvt_workers_t *workers;
    size_t lookups_out; /* LOOKUPs the cache service has (lock held) */
    kvt_router_t *router;
    void *sock;          /* the router's libzmq socket */
    kvt_rq_t *spare;     /* a finished request kept for reuse */
    uint32_t max_frames; /* data frames one request may carry (PUT: one per key) */
    kvt_curve_t *curve;  /* CURVE for the tcp endpoints, or NULL */
    kvt_limits_t lim;
    uint64_t next_sweep_ms;
    /* held by this loop while it works and by the fastpath thread while it handles a ring
     * request: sessions, leases, the spare request and the rings see one thread at a time */
    pthread_mutex_t lock;
    _Atomic uint32_t lock_waiting; /* this loop waits for it: the fastpath thread stands back */
};

static void s_lock(kvt_server_t *self);
static void s_drain_lookups(kvt_server_t *self, uint64_t deadline_ms);

static kvt_errrep_t s_rep_bad = KVT_ERRREP_INIT(10000);
static kvt_errrep_t s_rep_send = KVT_ERRREP_INIT(10000);

/* ---- requests ---- */

/* A request's frames are received straight into libzmq messages (no czmq frame objects, no
 * copies), and one finished request is kept for the next message with its buffers (data frame
 * array, reply buffer): the control path allocates nothing per request but the decoded body. */
static kvt_rq_t *s_rq_new(kvt_server_t *self)
{
    kvt_rq_t *rq = self->spare;
    self->spare = NULL;
    if (!rq) {
        rq = calloc(1, sizeof *rq);
        kvt_assert(rq);
        msgpack_sbuffer_init(&rq->sbuf);
        msgpack_packer_init(&rq->pk, &rq->sbuf, msgpack_sbuffer_write);
    }
    rq->svc = &self->svc;
    rq->lookup_pending = false;
    zmq_msg_init(&rq->rid);
    zmq_msg_init(&rq->uid);
    zmq_msg_init(&rq->body);
    return rq;
}

static void s_rq_free(kvt_server_t *self, kvt_rq_t *rq)
{
    kvt_req_release(&rq->req);
    zmq_msg_close(&rq->rid);
    zmq_msg_close(&rq->uid);
    zmq_msg_close(&rq->body);
    for (uint32_t i = 0; i < rq->ndata; i++)
        zmq_msg_close(&rq->data[i]);
    if (rq->out_lease) /* a GET whose reply was never built */
        kvt_l1_release(rq->svc->l1, KVT_OWNER_DAEMON, rq->out_lease);
    free(rq->out);
    kvt_conn_unref(&rq->conn);
    if (self && !self->spare && rq->data_cap <= S_SPARE_FRAMES && rq->sbuf.alloc <= S_SPARE_REPLY) {
        /* kept for the next request, with its data array and reply buffer */
        zmq_msg_t *data = rq->data;
        uint32_t cap = rq->data_cap;
        msgpack_sbuffer sbuf = rq->sbuf;
        memset(rq, 0, sizeof *rq);
        rq->data = data;
        rq->data_cap = cap;
        rq->sbuf = sbuf;
        msgpack_sbuffer_clear(&rq->sbuf);
        msgpack_packer_init(&rq->pk, &rq->sbuf, msgpack_sbuffer_write);
        self->spare = rq;
        return;
    }
    free(rq->data);
    msgpack_sbuffer_destroy(&rq->sbuf);
    free(rq);
}

/* Sends one small frame from a buffer: libzmq copies it into its own message (small messages
 * live inside zmq_msg_t), which costs less than building a czmq frame for it. */
static int s_send_buf(void *sock, const void *data, size_t len, bool more)
{
    return zmq_send(sock, data, len, (more ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT) < 0 ? -1 : 0;
}

/* A reply in libzmq's hands: the hint of the free callback of its body frame and data frames.
 * It holds the body (daemon memory the connection's backlog counts) and, for GET, the read
 * lease that pins the arena ranges its data frames point into. The last frame freed — written
 * out, or dropped with its connection — ends it, on whichever thread frees it. */
typedef struct {
    kvt_conn_t *conn;
    kvt_l1_t *l1;
    uint64_t lease;
    uint64_t bytes, pinned;
    _Atomic uint32_t frames;
    uint8_t body[];
} s_outgoing_t;

static void s_outgoing_frame_free(void *data, void *hint)
{
    (void)data;
    s_outgoing_t *r = hint;
    if (atomic_fetch_sub_explicit(&r->frames, 1, memory_order_acq_rel) == 1) {
        if (r->lease)
            kvt_l1_release(r->l1, KVT_OWNER_DAEMON, r->lease);
        kvt_conn_reply_end(r->conn, r->bytes, r->pinned);
        free(r);
    }
}

/* The reply's body and data frames, counted against the connection from here until libzmq
 * frees them. The read lease of a GET moves into the reply. */
static s_outgoing_t *s_outgoing_new(kvt_server_t *self, kvt_rq_t *rq, zmq_msg_t *frames)
{
    size_t blen = rq->sbuf.size;
    s_outgoing_t *r = malloc(sizeof *r + blen);
    kvt_assert(r);
    memcpy(r->body, rq->sbuf.data, blen);
    r->conn = rq->conn;
    r->l1 = self->svc.l1;
    r->lease = rq->out_lease;
    rq->out_lease = 0;
    r->bytes = sizeof *r + blen;
    r->pinned = 0;
    atomic_init(&r->frames, 1 + rq->nout);
    zmq_msg_init_data(&frames[0], r->body, blen, s_outgoing_frame_free, r);
    uint8_t *base = kvt_l1_base(self->svc.l1);
    for (uint32_t i = 0; i < rq->nout; i++) {
        zmq_msg_init_data(&frames[1 + i], base + rq->out[i].offset, rq->out[i].length,
                          s_outgoing_frame_free, r);
        r->pinned += rq->out[i].length;
    }
    kvt_conn_reply_start(r->conn, r->bytes, r->pinned, kvt_now_ms());
    return r;
}

/* Counts a fast-path request, then puts its reply [uid, type, body, out...] into its reply
 * ring (GET's data frames copied in; its read lease is released with the request). A reply the
 * ring can never hold is answered too_large instead, so the client is not left waiting. */
static void s_reply_ring(kvt_server_t *self, kvt_rq_t *rq, const uint8_t *type, size_t tlen)
{
    kvt_ring_iov_t stack_iov[8];
    uint32_t n = 3 + rq->nout;
    kvt_ring_iov_t *iov = n <= 8 ? stack_iov : malloc(n * sizeof *iov);
    kvt_assert(iov);
    iov[0] = (kvt_ring_iov_t){zmq_msg_data(&rq->uid), zmq_msg_size(&rq->uid)};
    iov[1] = (kvt_ring_iov_t){type, tlen};
    iov[2] = (kvt_ring_iov_t){rq->sbuf.data, rq->sbuf.size};
    uint8_t *base = kvt_l1_base(self->svc.l1);
    for (uint32_t i = 0; i < rq->nout; i++)
        iov[3 + i] = (kvt_ring_iov_t){base + rq->out[i].offset, rq->out[i].length};
    if (!kvt_fastpath_reply_fits(self->svc.fastpath, rq->ring, iov, n)) {
        size_t want = kvt_ring_msg_size(iov, n);
        msgpack_sbuffer_clear(&rq->sbuf);
        char msg[200];
        snprintf(msg, sizeof msg,
                 "%s: a reply of %zu bytes does not fit in the fast-path ring (fastpath.ring_bytes "
                 "%llu): send it over the socket",
                 kvt_proto_name(rq->type), want,
                 (unsigned long long)self->cfg->fastpath_ring_bytes);
        kvt_pack_error(&rq->pk, KVT_ETOOBIG, msg);
        iov[2] = (kvt_ring_iov_t){rq->sbuf.data, rq->sbuf.size};
        rq->rc = KVT_ETOOBIG;
        n = 3;
    }
    kvt_reqstats_request(self->stats, rq->type, rq->rc, kvt_now_ns() - rq->t0_ns);
    if (kvt_fastpath_reply(self->svc.fastpath, rq->ring, iov, n))
        kvt_reqstats_reply_failed(self->stats);
    if (iov != stack_iov)
        free(iov);
    rq->nout = 0;
}

/* Counts the request, sends the reply [rid, uid, type, body, out...] and frees it. Counted
 * first, so a client that has its reply finds it in /metrics. The ROUTER queues without a
 * limit (ZMQ_SNDHWM 0), so a send fails only when the client connection is gone; what a
 * connection may leave unread is bounded per connection instead (kvt_session). */
static void s_finish(kvt_server_t *self, kvt_rq_t *rq)
{
    if (rq->rc) {
        msgpack_sbuffer_clear(&rq->sbuf);
        kvt_pack_error(&rq->pk, rq->rc, rq->err);
        kvt_log(KVT_LOG_DEBUG, "request %s: %s: %s", kvt_proto_name(rq->type), kvt_err_wire(rq->rc),
                rq->err);
        if (rq->out_lease)
            kvt_l1_release(self->svc.l1, KVT_OWNER_DAEMON, rq->out_lease);
        rq->out_lease = 0;
        rq->nout = 0;
    }
    uint8_t typebuf[16];
    /* packs into typebuf (a uint64 needs at most 9 bytes, so the sbuffer never grows) */
    msgpack_sbuffer tbuf = {.size = 0, .data = (char *)typebuf, .alloc = sizeof typebuf};
    msgpack_packer tpk;
    msgpack_packer_init(&tpk, &tbuf, msgpack_sbuffer_write);
    msgpack_pack_uint64(&tpk, rq->type);
    if (rq->ring.slot) {
        s_reply_ring(self, rq, typebuf, tbuf.size);
        s_rq_free(self, rq);
        return;
    }
    uint32_t nframes = 1 + rq->nout;
    zmq_msg_t stack_frames[8];
    zmq_msg_t *frames = nframes <= 8 ? stack_frames : malloc(nframes * sizeof *frames);
    kvt_assert(frames);
    s_outgoing_new(self, rq, frames);
    kvt_reqstats_request(self->stats, rq->type, rq->rc, kvt_now_ns() - rq->t0_ns);
    void *sock = self->sock;
    uint32_t sent = 0;
    if (s_send_buf(sock, zmq_msg_data(&rq->rid), zmq_msg_size(&rq->rid), true) == 0 &&
        s_send_buf(sock, zmq_msg_data(&rq->uid), zmq_msg_size(&rq->uid), true) == 0 &&
        s_send_buf(sock, tbuf.data, tbuf.size, true) == 0)
        while (sent < nframes &&
               zmq_msg_send(&frames[sent], sock,
                            (sent + 1 < nframes ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT) >= 0)
            sent++;
    if (sent < nframes) {
        kvt_reqstats_reply_failed(self->stats);
        kvt_errrep_report(&s_rep_send, KVT_LOG_WARN, "reply dropped: %s", zmq_strerror(errno));
        for (uint32_t i = sent; i < nframes; i++)
            zmq_msg_close(&frames[i]); /* their free callbacks end the reply */
    }
    if (frames != stack_frames)
        free(frames);
    rq->nout = 0;
    s_rq_free(self, rq);
}

static void s_run_job(void *job)
{
    kvt_rq_t *rq = job;
    rq->rc = kvt_handle(rq);
}

/* One received message: its routing id and uid are in rq, the type frame in `type`, the
 * body and data frames in rq; `parts` counts the frames after the routing id. */
typedef struct {
    zmq_msg_t type;
    uint32_t parts;
    size_t total;         /* bytes of every frame after the routing id */
    bool too_many_frames; /* data frames past the limit were read and dropped */
} s_msg_t;

/* Where part n (0 = the uid) of a message goes; NULL: read and drop it. */
static zmq_msg_t *s_part_slot(kvt_server_t *self, kvt_rq_t *rq, s_msg_t *m, uint32_t n)
{
    if (n == 0)
        return &rq->uid;
    if (n == 1)
        return &m->type;
    if (n == 2)
        return &rq->body;
    if (rq->ndata >= self->max_frames) {
        m->too_many_frames = true;
        return NULL;
    }
    if (rq->ndata == rq->data_cap) {
        uint32_t cap = rq->data_cap ? rq->data_cap * 2 : 8;
        zmq_msg_t *d = realloc(rq->data, cap * sizeof *d);
        kvt_assert(d);
        rq->data = d;
        rq->data_cap = cap;
    }
    return &rq->data[rq->ndata++];
}

typedef struct {
    kvt_server_t *self;
    kvt_rq_t *rq;
    s_msg_t *m;
} s_slot_ctx_t;

static zmq_msg_t *s_socket_slot(void *ctx, uint32_t n)
{
    s_slot_ctx_t *c = ctx;
    return n == 0 ? &c->rq->rid : s_part_slot(c->self, c->rq, c->m, n - 1);
}

/* Receives one whole message if one is waiting: 1 when read, 0 when none is, -1 on a socket
 * error. */
static int s_recv(kvt_server_t *self, kvt_rq_t *rq, s_msg_t *m)
{
    s_slot_ctx_t ctx = {self, rq, m};
    kvt_router_msg_t got;
    int rc = kvt_router_recv(self->router, s_socket_slot, &ctx, &got);
    if (rc != 1)
        return rc;
    rq->t0_ns = kvt_now_ns();
    m->parts = got.parts - 1; /* after the routing id */
    m->total = got.total;
    return 1;
}

/* Decodes and validates; returns 0 when the request can run. */
static int s_prepare(kvt_server_t *self, kvt_rq_t *rq, s_msg_t *m)
{
    int rc = 0;
    if (m->parts < 2) {
        snprintf(rq->err, sizeof rq->err, "expected frames [uid, type, body, data...]");
        return KVT_EBADREQ;
    }
    rc = kvt_msg_read_uint(zmq_msg_data(&m->type), zmq_msg_size(&m->type), &rq->type);
    if (rc) {
        rq->type = 0;
        snprintf(rq->err, sizeof rq->err, "the type frame is not a msgpack uint");
        return KVT_EBADREQ;
    }
    if (m->total > self->cfg->max_message) {
        snprintf(rq->err, sizeof rq->err, "message of %zu bytes exceeds max_message %llu", m->total,
                 (unsigned long long)self->cfg->max_message);
        return KVT_ETOOBIG;
    }
    const kvt_req_info_t *info = kvt_proto_info(rq->type);
    if (!info) {
        snprintf(rq->err, sizeof rq->err, "unknown request type %llu",
                 (unsigned long long)rq->type);
        return KVT_EUNKTYPE;
    }
    if (m->parts < 3) {
        snprintf(rq->err, sizeof rq->err, "expected frames [uid, type, body, data...]");
        return KVT_EBADREQ;
    }
    rc = kvt_msg_decode(zmq_msg_data(&rq->body), zmq_msg_size(&rq->body), info->type, &self->lim,
                        &rq->req);
    if (rc) {
        snprintf(rq->err, sizeof rq->err, "%s", rq->req.error);
        return rc;
    }
    if (m->too_many_frames) { /* after decoding: more keys than max_keys is too_large */
        snprintf(rq->err, sizeof rq->err, "%s: more than %u data frames", info->name,
                 self->max_frames);
        return KVT_EBADREQ;
    }
    return kvt_handle_check_frames(rq);
}

/* Runs a valid request by the run class of its type: false when it is done (rq->rc set, the
 * reply packed), true when a pool has it and answers it later. */
static bool s_dispatch(kvt_server_t *self, kvt_rq_t *rq)
{
    const kvt_req_info_t *info = kvt_proto_info(rq->type);
    switch (info->run) {
    case KVT_RUN_WORKER:
        if (kvt_workers_submit(self->workers, s_run_job, rq) == 0)
            return true;
        snprintf(rq->err, sizeof rq->err, "%s: the worker queue is full, retry later", info->name);
        rq->rc = KVT_EBUSY;
        return false;
    case KVT_RUN_INLINE_THEN_LOOKUP:
        rq->rc = kvt_handle(rq);
        if (rq->rc || !kvt_handle_pending(rq))
            return false;
        self->lookups_out++; /* the cache service hands it back through lookups_done */
        return true;
    case KVT_RUN_INLINE:
        break;
    }
    rq->rc = kvt_handle(rq);
    return false;
}

/* Runs one received message to its reply, or hands it to a pool. */
static void s_handle_message(kvt_server_t *self, kvt_rq_t *rq, s_msg_t *m)
{
    uint64_t uidv;
    if (m->parts < 1 ||
        kvt_msg_read_uint(zmq_msg_data(&rq->uid), zmq_msg_size(&rq->uid), &uidv) != 0) {
        /* without a uid there is nothing a reply could be matched to */
        kvt_reqstats_dropped(self->stats);
        kvt_errrep_report(&s_rep_bad, KVT_LOG_WARN,
                          "dropped a message whose first frame is not a msgpack uint uid");
        s_rq_free(self, rq);
        return;
    }
    /* the descriptor of the connection it was read from: libzmq records it in the frames it
     * reads (the routing id frame is the ROUTER's own and has none) */
    int fd = zmq_msg_get(&rq->uid, ZMQ_SRCFD);
    rq->conn = kvt_sessions_conn(self->svc.sessions, zmq_msg_data(&rq->rid), zmq_msg_size(&rq->rid),
                                 fd, kvt_accept_generation(fd), kvt_now_ms());
    rq->owner = kvt_conn_owner(rq->conn);
    rq->rc = s_prepare(self, rq, m);
    if (rq->rc == 0 && s_dispatch(self, rq))
        return; /* answered when its job comes back */
    s_finish(self, rq);
}

/* A request from a fast-path ring (fastpath thread, lock held): its frames are copied into
 * libzmq messages and it runs exactly as one from the socket, acting for the connection that
 * asked for the ring. A record that is not a message closes the ring. */
static void s_ring_request(void *ctx, kvt_fastpath_ref_t ref, kvt_conn_t *conn,
                           const uint8_t *payload, size_t len)
{
    kvt_server_t *self = ctx;
    kvt_ring_frame_t stack_fr[8], *fr = stack_fr;
    uint32_t count = 0, n = 0;
    if (len >= 4)
        memcpy(&count, payload, 4);
    if (count > 8 && count <= len / 4) /* each frame takes 4 bytes at least */
        fr = malloc(count * sizeof *fr);
    kvt_assert(fr);
    if (kvt_ring_parse(payload, len, fr, count > 8 && fr != stack_fr ? count : 8, &n) != 0) {
        kvt_reqstats_dropped(self->stats);
        kvt_fastpath_reject(self->svc.fastpath, ref,
                            "a record that is not a message (u32 count, u32 length + bytes ...)");
        if (fr != stack_fr)
            free(fr);
        return;
    }
    kvt_rq_t *rq = s_rq_new(self);
    rq->ring = ref;
    rq->t0_ns = kvt_now_ns();
    s_msg_t m = {.parts = 0};
    zmq_msg_init(&m.type);
    for (uint32_t i = 0; i < n; i++) {
        zmq_msg_t *part = s_part_slot(self, rq, &m, i);
        m.total += fr[i].len;
        m.parts++;
        if (!part)
            continue;
        /* uid, type and body hold empty messages, data slots nothing yet: no close needed */
        kvt_assert(zmq_msg_init_size(part, fr[i].len) == 0);
        if (fr[i].len)
            memcpy(zmq_msg_data(part), fr[i].ptr, fr[i].len);
    }
    if (fr != stack_fr)
        free(fr);
    uint64_t uidv;
    if (m.parts < 1 ||
        kvt_msg_read_uint(zmq_msg_data(&rq->uid), zmq_msg_size(&rq->uid), &uidv) != 0) {
        kvt_reqstats_dropped(self->stats);
        kvt_errrep_report(&s_rep_bad, KVT_LOG_WARN,
                          "dropped a fast-path message whose first frame is not a msgpack uint uid");
        s_rq_free(self, rq);
        zmq_msg_close(&m.type);
        return;
    }
    kvt_sessions_touch(self->svc.sessions, conn, kvt_now_ms());
    rq->conn = kvt_conn_ref(conn);
    rq->owner = kvt_conn_owner(conn);
    rq->rc = s_prepare(self, rq, &m);
    if (!(rq->rc == 0 && s_dispatch(self, rq)))
        s_finish(self, rq);
    zmq_msg_close(&m.type);
}

/* Reads and handles up to S_BATCH waiting messages. */
static void s_intake(kvt_server_t *self, volatile sig_atomic_t *stop)
{
    for (int i = 0; i < S_BATCH && !*stop; i++) {
        kvt_rq_t *rq = s_rq_new(self);
        s_msg_t m = {.parts = 0};
        zmq_msg_init(&m.type);
        int got = s_recv(self, rq, &m);
        if (got == 1)
            s_handle_message(self, rq, &m);
        else
            s_rq_free(self, rq);
        zmq_msg_close(&m.type);
        if (got != 1)
            break;
    }
}

static void s_collect(kvt_server_t *self)
{
    kvt_rq_t *rq;
    while (self->workers && (rq = kvt_workers_done(self->workers)) != NULL)
        s_finish(self, rq);
    kvt_lookup_t *lk;
    while (self->svc.lookups_done && kvt_queue_pop(self->svc.lookups_done, (void **)&lk, 0) == 0) {
        kvt_queue_task_done(self->svc.lookups_done, 1);
        self->lookups_out--;
        rq = lk->ctx;
        rq->rc = kvt_handle_resume(rq);
        s_finish(self, rq);
    }
}

/* ---- set-up ---- */

/* A v1 instance ended (BYE, silence): the cache service releases its leases and tells the
 * listeners, s_owner_gone among them. */
static uint64_t s_on_gone(void *ctx, uint64_t owner, bool expired)
{
    kvt_server_t *self = ctx;
    return kvt_cache_owner_close(self->svc.cache, owner, expired);
}

static int s_on_new(void *ctx, uint64_t *owner, char *err, size_t errlen)
{
    kvt_server_t *self = ctx;
    return kvt_cache_owner_open(self->svc.cache, KVT_OWNER_V1, owner, err, errlen);
}

/* A v1 owner closed (on this loop's thread, or the fastpath thread under the lock): its
 * fast-path slots go. LMCache workers hold none. */
static void s_owner_gone(void *ctx, kvt_owner_kind_t kind, uint64_t owner, bool expired)
{
    kvt_server_t *self = ctx;
    if (kind == KVT_OWNER_V1)
        kvt_fastpath_owner_gone(self->svc.fastpath, owner, expired);
}

/* A client connection closed: the sessions forget it (kvt_router's monitor). */
static void s_on_closed(void *ctx, int fd, uint32_t gen)
{
    kvt_server_t *self = ctx;
    kvt_sessions_on_disconnect(self->svc.sessions, fd, gen);
}

kvt_server_t *kvt_server_new(const kvt_config_t *cfg, kvt_metrics_t *metrics,
                             kvt_reqstats_t *stats, kvt_sup_t *sup, kvt_cache_t *cache,
                             kvt_gpu_t *gpu, char *err, size_t errlen)
{
    kvt_l1_t *l1 = kvt_cache_l1(cache);
    kvt_server_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->cfg = cfg;
    self->stats = stats;
    self->svc.cfg = cfg;
    self->svc.metrics = metrics;
    self->svc.reqstats = stats;
    self->svc.cache = cache;
    self->svc.l1 = l1;
    char qerr[160];
    /* holds what the service handed back and the loop has not collected: at most the LOOKUPs
     * out, which the request intake bounds */
    self->svc.lookups_done = kvt_queue_new(KVT_QUEUE_BOUNDED_BY_CALLER, KVT_QUEUE_FD, qerr,
                                           sizeof qerr);
    if (!self->svc.lookups_done) {
        snprintf(err, errlen, "server: %s", qerr);
        free(self);
        return NULL;
    }
    /* the service's liveness rule: a v1 instance's keep-alive is its lease */
    kvt_session_limits_t slim = {.lease_ms = kvt_cache_owner_keepalive_ms(cache, KVT_OWNER_V1),
                                 .max_instances_per_conn = cfg->max_instances_per_connection,
                                 .reply_timeout_ms = cfg->reply_timeout_ms,
                                 .max_reply_backlog = cfg->max_reply_backlog};
    self->svc.sessions = kvt_sessions_new(&slim, s_on_new, s_on_gone, self);
    kvt_metrics_add_source(metrics, kvt_sessions_metrics_source, self->svc.sessions);
    pthread_mutex_init(&self->lock, NULL);
    /* each ring pair is a memfd handed to its client alone over the handoff socket */
    if (cfg->fastpath_enabled &&
        !(self->handoff = kvt_handoff_new(cfg, cfg->fastpath_rings, err, errlen)))
        goto fail;
    self->svc.fastpath = kvt_fastpath_new(cfg, self->handoff, &self->lock, &self->lock_waiting,
                                          self->svc.sessions, s_ring_request, self);
    if (self->svc.fastpath)
        kvt_metrics_add_source(metrics, kvt_fastpath_metrics_source, self->svc.fastpath);
    if (self->svc.fastpath && kvt_l1_resident(l1))
        kvt_fastpath_set_resident(self->svc.fastpath, kvt_resident_fd(kvt_l1_resident(l1)),
                                  kvt_resident_size(kvt_l1_resident(l1)));
    self->svc.gpu = gpu;
    kvt_cache_on_owner_gone(cache, s_owner_gone, self);
    kvt_limits_init(&self->lim, cfg->max_message, cfg->max_keys);
    self->workers = kvt_workers_new("worker", (int)cfg->workers, S_WORKER_QUEUE, sup, err, errlen);
    if (!self->workers)
        goto fail;
    /* no queue limit in libzmq: a reply is never dropped because a client reads slowly; what a
     * connection may leave unread is bounded by kvt_session instead */
    kvt_router_opts_t ropts = {.label = "listen",
                               .sndhwm = 0,
                               .linger_ms = 1000,
                               .max_message = cfg->max_message,
                               .on_closed = s_on_closed,
                               .ctx = self};
    self->router = kvt_router_new(&ropts, err, errlen);
    if (!self->router)
        goto fail;
    self->sock = kvt_router_socket(self->router);
    self->max_frames = cfg->max_keys;
    if (cfg->curve_server_cert[0] && !(self->curve = kvt_curve_new(cfg, err, errlen)))
        goto fail;
    for (int i = 0; i < cfg->n_listen; i++) {
        const char *ep = cfg->listen[i];
        kvt_curve_prepare_bind(self->curve, kvt_router_zsock(self->router), ep);
        if (kvt_router_bind(self->router, cfg, ep, err, errlen) != 0)
            goto fail;
        kvt_log(KVT_LOG_INFO, "listening on %s%s", ep,
                self->curve && strncmp(ep, "tcp://", 6) == 0 ? " (CURVE)" : "");
    }
    self->beat = kvt_sup_register(sup, "server", 1000);
    if (self->svc.fastpath && (kvt_handoff_start(self->handoff, sup) != 0 ||
                               kvt_fastpath_start(self->svc.fastpath, sup) != 0)) {
        snprintf(err, errlen, "cannot start the fastpath thread");
        goto fail;
    }
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
    kvt_fastpath_stop(self->svc.fastpath); /* no ring request runs from here on */
    if (self->workers) {
        s_collect(self); /* kvt_server_run drained; this only catches a failed start */
        kvt_workers_destroy(&self->workers);
    }
    if (self->svc.lookups_done) {
        s_lock(self);
        s_drain_lookups(self, 0); /* the service hands each back after its probe at most */
        pthread_mutex_unlock(&self->lock);
        kvt_queue_destroy(&self->svc.lookups_done);
    }
    if (self->spare) {
        free(self->spare->data); /* its messages are closed already */
        msgpack_sbuffer_destroy(&self->spare->sbuf);
        free(self->spare);
        self->spare = NULL;
    }
    kvt_router_destroy(&self->router); /* its ipc files go with it */
    kvt_curve_destroy(&self->curve);
    kvt_fastpath_destroy(&self->svc.fastpath); /* its slots hold connections and offers */
    kvt_handoff_destroy(&self->handoff);
    kvt_sessions_destroy(&self->svc.sessions);
    pthread_mutex_destroy(&self->lock);
    free(self);
    *self_p = NULL;
}

static void s_periodic(kvt_server_t *self)
{
    uint64_t now = kvt_now_ms();
    if (now < self->next_sweep_ms)
        return;
    self->next_sweep_ms = now + S_SWEEP_MS;
    kvt_sessions_sweep(self->svc.sessions, now);
    kvt_prefetch_sweep(kvt_cache_prefetch(self->svc.cache), now);
    kvt_reload_run_pending(); /* a SIGHUP's reload, on this (the main) thread */
}

static size_t s_in_flight(const kvt_server_t *self)
{
    return (self->workers ? kvt_workers_pending(self->workers) : 0) + self->lookups_out;
}

/* After a stop: no new requests; answer the jobs already with the workers and the lookups the
 * cache service has (bounded: S_DRAIN_MS, or without a limit when `deadline_ms` is 0 and only
 * lookups are out, which the service always hands back). Lock held. */
static void s_drain_lookups(kvt_server_t *self, uint64_t deadline_ms)
{
    while (s_in_flight(self) > 0 && (!deadline_ms || kvt_now_ms() < deadline_ms)) {
        zmq_pollitem_t items[2] = {
            {NULL, self->workers ? kvt_workers_fd(self->workers) : -1, ZMQ_POLLIN, 0},
            {NULL, kvt_queue_fd(self->svc.lookups_done), ZMQ_POLLIN, 0}};
        zmq_poll(items, 2, 50);
        s_collect(self);
        if (self->beat)
            kvt_sup_beat(self->beat);
    }
}

static void s_drain(kvt_server_t *self)
{
    s_drain_lookups(self, kvt_now_ms() + S_DRAIN_MS);
    if (s_in_flight(self) > 0)
        kvt_log(KVT_LOG_WARN, "stopping with %zu requests still running", s_in_flight(self));
}

/* The loop's turn with the lock: the fastpath thread sees it waiting and lets it in. */
static void s_lock(kvt_server_t *self)
{
    atomic_fetch_add_explicit(&self->lock_waiting, 1, memory_order_release);
    pthread_mutex_lock(&self->lock);
    atomic_fetch_sub_explicit(&self->lock_waiting, 1, memory_order_relaxed);
}

int kvt_server_run(kvt_server_t *self, volatile sig_atomic_t *stop)
{
    zmq_pollitem_t items[4] = {
        {self->sock, 0, ZMQ_POLLIN, 0},
        {NULL, kvt_workers_fd(self->workers), ZMQ_POLLIN, 0},
        {kvt_router_monitor(self->router), -1, ZMQ_POLLIN, 0},
        {NULL, kvt_queue_fd(self->svc.lookups_done), ZMQ_POLLIN, 0},
    };
    int rc = 0;
    while (!*stop) {
        if (!kvt_sup_beat(self->beat)) {
            rc = KVT_EINTERNAL;
            break;
        }
        if (zmq_poll(items, 4, S_POLL_MS) < 0 && errno != EINTR) {
            kvt_log(KVT_LOG_ERROR, "server: poll failed: %s", zmq_strerror(errno));
            rc = KVT_EINTERNAL;
            break;
        }
        s_lock(self);
        kvt_router_events(self->router);
        s_intake(self, stop);
        s_collect(self);
        s_periodic(self);
        pthread_mutex_unlock(&self->lock);
    }
    kvt_fastpath_stop(self->svc.fastpath); /* ring requests end; their pooled jobs drain */
    s_lock(self);
    s_drain(self);
    pthread_mutex_unlock(&self->lock);
    kvt_sup_thread_exit(self->beat, rc == 0);
    return rc;
}

static uint64_t s_owner_bytes(void *l1, uint64_t owner)
{
    return kvt_l1_owner_bytes(l1, owner);
}

json_t *kvt_server_status_json(kvt_server_t *self)
{
    json_t *eps = json_array();
    for (int i = 0; i < self->cfg->n_listen; i++)
        json_array_append_new(eps, json_string(self->cfg->listen[i]));
    json_t *st = json_pack("{s:o,s:I,s:I,s:o}", "endpoints", eps, "requests_in_workers",
                           (json_int_t)s_in_flight(self), "prefetch_jobs",
                           (json_int_t)kvt_prefetch_jobs(kvt_cache_prefetch(self->svc.cache)), "gpu",
                           kvt_gpu_status_json(self->svc.gpu));
    json_t *clients =
        kvt_sessions_json(self->svc.sessions, kvt_now_ms(), s_owner_bytes, self->svc.l1);
    json_object_update(st, clients); /* clients, clients_total, connections */
    json_decref(clients);
    json_object_set_new(json_object_get(st, "connections"), "open",
                        json_integer((json_int_t)kvt_accept_open()));
    json_t *fp = kvt_fastpath_json(self->svc.fastpath);
    if (self->handoff)
        json_object_set_new(fp, "handoff", kvt_handoff_json(self->handoff));
    json_object_set_new(st, "fastpath", fp);
    return st;
}
