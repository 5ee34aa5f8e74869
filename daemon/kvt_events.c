/* DESIGN: producers (server, workers, evictor, HTTP) encode under no lock and append the bytes
 * to a bounded FIFO under `lock`; the publisher thread takes the whole FIFO at once and sends
 * it. The socket is created by the main thread at start-up (so a bad endpoint fails the start)
 * and from then on used only by the publisher thread. */
#include "kvt_events.h"

#include "kvt_error.h"
#include "kvt_instance.h"
#include "kvt_log.h"
#include "kvt_msg.h"

#include <czmq.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define S_MAX_QUEUED 4096
#define S_SNDHWM 10000
#define S_TICK_MS 200

typedef struct s_ev {
    struct s_ev *next;
    size_t len;
    char data[];
} s_ev_t;

struct kvt_events {
    zsock_t *pub;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    s_ev_t *head, *tail;
    size_t queued;
    bool stop;
    pthread_t tid;
    bool started;
    kvt_sup_thread_t *beat;
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
    ev->next = NULL;
    ev->len = sb.size;
    memcpy(ev->data, sb.data, sb.size);
    msgpack_sbuffer_destroy(&sb);
    pthread_mutex_lock(&self->lock);
    if (self->queued >= S_MAX_QUEUED) {
        pthread_mutex_unlock(&self->lock);
        free(ev);
        s_drop(self, "publisher queue full");
        return;
    }
    if (self->tail)
        self->tail->next = ev;
    else
        self->head = ev;
    self->tail = ev;
    self->queued++;
    pthread_cond_signal(&self->cond);
    pthread_mutex_unlock(&self->lock);
}

static void s_send_all(kvt_events_t *self, s_ev_t *ev)
{
    void *sock = zsock_resolve(self->pub);
    while (ev) {
        s_ev_t *next = ev->next;
        if (zmq_send(sock, ev->data, ev->len, ZMQ_DONTWAIT) < 0)
            s_drop(self, errno == EAGAIN ? "a subscriber is not reading (high-water mark)"
                                         : zmq_strerror(errno));
        else
            atomic_fetch_add_explicit(&self->published, 1, memory_order_relaxed);
        free(ev);
        ev = next;
    }
    /* subscription messages queue up on an XPUB: read and discard them */
    char buf[256];
    while (zmq_recv(sock, buf, sizeof buf, ZMQ_DONTWAIT) >= 0)
        ;
}

static void *s_run(void *arg)
{
    kvt_events_t *self = arg;
    pthread_mutex_lock(&self->lock);
    for (;;) {
        if (!self->head && !self->stop) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += S_TICK_MS * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&self->cond, &self->lock, &ts);
        }
        s_ev_t *batch = self->head;
        self->head = self->tail = NULL;
        self->queued = 0;
        bool stop = self->stop;
        pthread_mutex_unlock(&self->lock);
        s_send_all(self, batch);
        if (stop)
            break;
        if (!kvt_sup_beat(self->beat)) {
            kvt_sup_thread_exit(self->beat, false);
            return NULL;
        }
        pthread_mutex_lock(&self->lock);
    }
    kvt_sup_thread_exit(self->beat, true);
    return NULL;
}

kvt_events_t *kvt_events_new(const char *endpoint, kvt_sup_t *sup, char *err, size_t errlen)
{
    kvt_events_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->cond, NULL);
    self->pub = zsock_new(ZMQ_XPUB);
    if (!self->pub) {
        snprintf(err, errlen, "events: cannot create the socket: %s", zmq_strerror(errno));
        goto fail;
    }
    zsock_set_sndhwm(self->pub, S_SNDHWM);
    zsock_set_linger(self->pub, 500);
    zsock_set_xpub_nodrop(self->pub, 1);
    /* libzmq would silently unlink a live daemon's socket file and cut its subscribers off */
    if (kvt_instance_check_ipc(endpoint, err, errlen) != 0)
        goto fail;
    if (zsock_bind(self->pub, "%s", endpoint) < 0) {
        snprintf(err, errlen, "events: cannot bind %s: %s", endpoint, zmq_strerror(errno));
        goto fail;
    }
    self->beat = kvt_sup_register(sup, "events", 2000);
    if (pthread_create(&self->tid, NULL, s_run, self) != 0) {
        snprintf(err, errlen, "events: cannot start thread");
        goto fail;
    }
    self->started = true;
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
    if (self->started) {
        pthread_mutex_lock(&self->lock);
        self->stop = true;
        pthread_cond_signal(&self->cond);
        pthread_mutex_unlock(&self->lock);
        pthread_join(self->tid, NULL);
    }
    for (s_ev_t *ev = self->head, *next; ev; ev = next) {
        next = ev->next;
        free(ev);
    }
    zsock_destroy(&self->pub);
    pthread_cond_destroy(&self->cond);
    pthread_mutex_destroy(&self->lock);
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
