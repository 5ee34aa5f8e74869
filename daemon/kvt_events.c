/* DESIGN: the publisher thread waits on the log (at most 200 ms, so it beats and sees a stop),
 * reads up to S_BATCH records past its cursor, encodes and sends each, gives them back, and goes
 * on from the last one. On destroy it is told to stop: it sends what the log holds by then and
 * returns. The socket is created by the main thread at start-up (so a bad endpoint fails the
 * start) and from then on used only by the publisher thread. */
#include "kvt_events.h"

#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_msg.h"
#include "kvt_rundir.h"
#include "kvt_thread.h"

#include <czmq.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define S_BATCH 1024
#define S_SNDHWM 10000
#define S_WAIT_MS 200

struct kvt_events {
    zsock_t *pub;
    kvt_evlog_t *log;
    kvt_thread_t *thread;
    atomic_bool stop;
    uint64_t cursor;             /* the publisher thread's: the last record it took */
    kvt_evrec_t *batch[S_BATCH]; /* the publisher thread's */
    msgpack_sbuffer sb;          /* the publisher thread's */
    _Atomic uint64_t published, dropped;
};

static kvt_errrep_t s_rep_drop = KVT_ERRREP_INIT(10000);

static void s_drop(kvt_events_t *self, uint64_t n, const char *why)
{
    atomic_fetch_add_explicit(&self->dropped, n, memory_order_relaxed);
    kvt_errrep_report(&s_rep_drop, KVT_LOG_WARN, "events: dropped %llu event(s): %s",
                      (unsigned long long)n, why);
}

static void s_encode(msgpack_sbuffer *sb, const kvt_evrec_t *r)
{
    msgpack_sbuffer_clear(sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 5 + (r->sizes != NULL) + (r->labels != NULL));
    kvt_pack_str(&pk, "event");
    kvt_pack_str(&pk, kvt_ev_name(r->kind));
    kvt_pack_str(&pk, "ns");
    kvt_pack_strn(&pk, r->ns.name, r->ns.name_len);
    kvt_pack_str(&pk, "salt");
    kvt_pack_strn(&pk, r->ns.salt ? (const void *)r->ns.salt : "", r->ns.salt_len);
    kvt_pack_str(&pk, "keys");
    msgpack_pack_array(&pk, r->n);
    for (uint32_t i = 0; i < r->n; i++) {
        msgpack_pack_bin(&pk, KVT_KEY_LEN);
        msgpack_pack_bin_body(&pk, r->keys[i].b, KVT_KEY_LEN);
    }
    kvt_pack_str(&pk, "tier");
    kvt_pack_str(&pk, kvt_ev_tier(r->kind));
    if (r->sizes) {
        kvt_pack_str(&pk, "sizes");
        msgpack_pack_array(&pk, r->n);
        for (uint32_t i = 0; i < r->n; i++)
            msgpack_pack_uint64(&pk, r->sizes[i]);
    }
    if (r->labels) { /* checked UTF-8 when they came in, so str; nil for a key without one */
        kvt_pack_str(&pk, "labels");
        msgpack_pack_array(&pk, r->n);
        for (uint32_t i = 0; i < r->n; i++)
            if (r->labels[i].len)
                kvt_pack_strn(&pk, r->labels[i].ptr, r->labels[i].len);
            else
                msgpack_pack_nil(&pk);
    }
}

/* Sends what the log holds past the cursor, S_BATCH records at a time; false once it is all
 * sent. */
static bool s_send_batch(kvt_events_t *self)
{
    void *sock = zsock_resolve(self->pub);
    kvt_evlog_span_t span;
    uint32_t n = kvt_evlog_read(self->log, self->cursor, self->batch, S_BATCH, &span);
    if (span.first > self->cursor + 1)
        s_drop(self, span.first - self->cursor - 1,
               "the publisher fell behind the event log (event_log_size)");
    for (uint32_t i = 0; i < n; i++) {
        s_encode(&self->sb, self->batch[i]);
        if (zmq_send(sock, self->sb.data, self->sb.size, ZMQ_DONTWAIT) < 0)
            s_drop(self, 1,
                   errno == EAGAIN ? "a subscriber is not reading (high-water mark)"
                                   : zmq_strerror(errno));
        else
            atomic_fetch_add_explicit(&self->published, 1, memory_order_relaxed);
    }
    if (n)
        self->cursor = self->batch[n - 1]->seq;
    else if (span.last > self->cursor)
        self->cursor = span.last;
    kvt_evlog_put(self->batch, n);
    /* subscription messages queue up on an XPUB: read and discard them */
    char buf[256];
    while (zmq_recv(sock, buf, sizeof buf, ZMQ_DONTWAIT) >= 0)
        ;
    return n == S_BATCH;
}

static bool s_run(kvt_thread_t *t, void *arg)
{
    kvt_events_t *self = arg;
    for (;;) {
        long wait = kvt_thread_idle_ms(t);
        kvt_evlog_wait(self->log, self->cursor, wait < S_WAIT_MS ? wait : S_WAIT_MS);
        bool stop = atomic_load(&self->stop); /* read before the send: what came before goes */
        while (s_send_batch(self)) /* catching up: still beat between batches */
            if (!stop && !kvt_thread_beat(t))
                return false;
        if (stop)
            return true;
        if (!kvt_thread_beat(t))
            return false;
    }
}

kvt_events_t *kvt_events_new(const char *endpoint, kvt_evlog_t *log, kvt_sup_t *sup, char *err,
                             size_t errlen)
{
    kvt_events_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->log = log;
    self->cursor = kvt_evlog_span(log).last;
    msgpack_sbuffer_init(&self->sb);
    self->pub = zsock_new(ZMQ_XPUB);
    if (!self->pub) {
        snprintf(err, errlen, "events: cannot create the socket: %s", zmq_strerror(errno));
        goto fail;
    }
    zsock_set_sndhwm(self->pub, S_SNDHWM);
    zsock_set_linger(self->pub, 500);
    zsock_set_xpub_nodrop(self->pub, 1);
    /* libzmq would silently unlink a live daemon's socket file and cut its subscribers off */
    if (kvt_rundir_check_ipc(endpoint, err, errlen) != 0)
        goto fail;
    if (zsock_bind(self->pub, "%s", endpoint) < 0) {
        snprintf(err, errlen, "events: cannot bind %s: %s", endpoint, zmq_strerror(errno));
        goto fail;
    }
    self->thread = kvt_thread_start(sup, "events", 2000, s_run, self);
    if (!self->thread) {
        snprintf(err, errlen, "events: cannot start thread");
        goto fail;
    }
    kvt_log(KVT_LOG_INFO, "events on %s", endpoint);
    return self;
fail:
    kvt_events_destroy(&self);
    return NULL;
}

void kvt_events_destroy(kvt_events_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_events_t *self = *self_p;
    atomic_store(&self->stop, true);
    kvt_thread_join(&self->thread);
    msgpack_sbuffer_destroy(&self->sb);
    zsock_destroy(&self->pub);
    free(self);
    *self_p = NULL;
}

void kvt_events_metrics_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    kvt_events_t *self = ctx;
    kvt_sample_t p = {.name = "events_published_total",
                      .help = "Cache events sent on the events socket.",
                      .kind = KVT_METRIC_COUNTER,
                      .value = (double)atomic_load(&self->published)};
    emit(emit_ctx, &p);
    kvt_sample_t d = {.name = "events_dropped_total",
                      .help =
                          "Cache events not sent: the publisher fell behind the event log, or a "
                          "subscriber was not reading.",
                      .kind = KVT_METRIC_COUNTER,
                      .value = (double)atomic_load(&self->dropped)};
    emit(emit_ctx, &d);
}
