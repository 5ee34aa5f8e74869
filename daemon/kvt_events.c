/* DESIGN: producers (server, workers, evictor, HTTP) encode under no lock and push the bytes
 * into a bounded kvt_queue; the publisher thread takes everything queued at once and sends it,
 * beating between batches and at least every 200 ms while idle. On destroy the queue is closed:
 * the thread sends what was queued before, then returns. The socket is created by the main
 * thread at start-up (so a bad endpoint fails the start) and from then on used only by the
 * publisher thread. */
#include "kvt_events.h"

#include "kvt_error.h"
#include "kvt_rundir.h"
#include "kvt_log.h"
#include "kvt_msg.h"
#include "kvt_queue.h"
#include "kvt_thread.h"

#include <czmq.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define S_MAX_QUEUED 4096
#define S_SNDHWM 10000

typedef struct {
    size_t len;
    char data[];
} s_ev_t;

struct kvt_events {
    zsock_t *pub;
    kvt_queue_t *queue;
    kvt_thread_t *thread;
    void *batch[S_MAX_QUEUED]; /* the publisher thread's */
    _Atomic uint64_t published, dropped;
};

static kvt_errrep_t s_rep_drop = KVT_ERRREP_INIT(10000);

static void s_drop(kvt_events_t *self, const char *why)
{
    atomic_fetch_add_explicit(&self->dropped, 1, memory_order_relaxed);
    kvt_errrep_report(&s_rep_drop, KVT_LOG_WARN, "events: dropped an event: %s", why);
}

void kvt_events_publish(kvt_events_t *self, const char *event, const kvt_ns_t *ns,
                        const kvt_key_t *keys, uint32_t n, const char *tier)
{
    if (!self || n == 0)
        return;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 5);
    kvt_pack_str(&pk, "event");
    kvt_pack_str(&pk, event);
    kvt_pack_str(&pk, "ns");
    kvt_pack_strn(&pk, ns->name, ns->name_len);
    kvt_pack_str(&pk, "salt");
    kvt_pack_strn(&pk, ns->salt ? (const void *)ns->salt : "", ns->salt_len);
    kvt_pack_str(&pk, "keys");
    msgpack_pack_array(&pk, n);
    for (uint32_t i = 0; i < n; i++) {
        msgpack_pack_bin(&pk, KVT_KEY_LEN);
        msgpack_pack_bin_body(&pk, keys[i].b, KVT_KEY_LEN);
    }
    kvt_pack_str(&pk, "tier");
    kvt_pack_str(&pk, tier);
    s_ev_t *ev = malloc(sizeof *ev + sb.size);
    kvt_assert(ev);
    ev->len = sb.size;
    memcpy(ev->data, sb.data, sb.size);
    msgpack_sbuffer_destroy(&sb);
    int rc = kvt_queue_push(self->queue, ev, 1);
    if (rc != 0)
        free(ev);
    if (rc == KVT_EBUSY) /* KVT_EUNAVAIL: stopping; not counted, as nothing is sent any more */
        s_drop(self, "publisher queue full");
}

static void s_send_all(kvt_events_t *self, void **batch, size_t n)
{
    void *sock = zsock_resolve(self->pub);
    for (size_t i = 0; i < n; i++) {
        s_ev_t *ev = batch[i];
        if (zmq_send(sock, ev->data, ev->len, ZMQ_DONTWAIT) < 0)
            s_drop(self, errno == EAGAIN ? "a subscriber is not reading (high-water mark)"
                                         : zmq_strerror(errno));
        else
            atomic_fetch_add_explicit(&self->published, 1, memory_order_relaxed);
        free(ev);
    }
    /* subscription messages queue up on an XPUB: read and discard them */
    char buf[256];
    while (zmq_recv(sock, buf, sizeof buf, ZMQ_DONTWAIT) >= 0)
        ;
}

static bool s_run(kvt_thread_t *t, void *arg)
{
    kvt_events_t *self = arg;
    for (;;) {
        size_t n = 0;
        int rc = kvt_queue_pop_batch(self->queue, self->batch, S_MAX_QUEUED, &n,
                                     kvt_thread_idle_ms(t));
        s_send_all(self, self->batch, n); /* n = 0: still reads the subscriptions */
        kvt_queue_task_done(self->queue, n);
        if (rc == KVT_EUNAVAIL) /* closed, and what was queued before is sent */
            return true;
        if (!kvt_thread_beat(t))
            return false;
    }
}

kvt_events_t *kvt_events_new(const char *endpoint, kvt_sup_t *sup, char *err, size_t errlen)
{
    kvt_events_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->queue = kvt_queue_new(S_MAX_QUEUED, 0, err, errlen);
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
    kvt_queue_close(self->queue);
    kvt_thread_join(&self->thread);
    for (void *ev; kvt_queue_pop(self->queue, &ev, 0) == 0;) /* a thread that died left them */
        free(ev);
    kvt_queue_destroy(&self->queue);
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
                      .help = "Cache events dropped: queue full or a subscriber not reading.",
                      .kind = KVT_METRIC_COUNTER,
                      .value = (double)atomic_load(&self->dropped)};
    emit(emit_ctx, &d);
}
