/* DESIGN: see client/kvtier.c ("Liveness"). This file is the heartbeat: a thread (kvtier-hb)
 * and a DEALER of its own per handle; the caller's thread and it share only kvc_hb_t's token
 * and generation (under its mutex, a leaf) and the atomic `dropped` flag. */
#include "kvtier_int.h"

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

/* The heartbeat of one kvtier_t (see "the heartbeat" below). */
struct kvc_hb {
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

static void s_hb_wake(kvc_hb_t *hb)
{
    uint64_t one = 1;
    ssize_t n = write(hb->wake, &one, sizeof one);
    (void)n; /* a full counter already wakes it */
}

static void s_hb_drain(kvc_hb_t *hb)
{
    uint64_t n;
    ssize_t got = read(hb->wake, &n, sizeof n);
    (void)got;
}

/* Sleeps up to ms unless woken. false when the heartbeat must stop. */
static bool s_hb_sleep(kvc_hb_t *hb, int ms)
{
    struct pollfd p = {hb->wake, POLLIN, 0};
    if (poll(&p, 1, ms) > 0)
        s_hb_drain(hb);
    return !atomic_load(&hb->stop);
}

/* Waits up to ms for items[0] (the socket) to be ready. A wake on items[1] ends the wait and
 * sets *woken: a stop, or a new token to act on at once (a request still unanswered then is
 * given up; its late reply is skipped as stale). */
static bool s_hb_poll(kvc_hb_t *hb, zmq_pollitem_t items[2], int ms, bool *woken)
{
    uint64_t end = kvc_mono_ns() + (uint64_t)ms * 1000000u;
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
        uint64_t now = kvc_mono_ns();
        if (now >= end)
            return false;
        ms = (int)((end - now) / 1000000u) + 1;
    }
}

static void *s_hb_socket(const kvc_hb_t *hb)
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
static int s_hb_exchange(kvc_hb_t *hb, void *sock, uint64_t uid, uint32_t type,
                         const msgpack_sbuffer *body, kvc_reply_t *r, bool *woken)
{
    int interval = atomic_load(&hb->interval_ms);
    zmq_pollitem_t items[2] = {{sock, 0, ZMQ_POLLOUT, 0}, {NULL, hb->wake, ZMQ_POLLIN, 0}};
    if (!s_hb_poll(hb, items, interval, woken) ||
        kvc_send_on(sock, ZMQ_DONTWAIT, uid, type, body->data, body->size, NULL, NULL, 0) != 0)
        return KVT_EUNAVAIL;
    items[0].events = ZMQ_POLLIN;
    int wait_ms = interval < hb->timeout_ms ? interval : hb->timeout_ms;
    uint64_t end = kvc_mono_ns() + (uint64_t)wait_ms * 1000000u;
    for (;;) {
        uint64_t now = kvc_mono_ns();
        if (now >= end || !s_hb_poll(hb, items, (int)((end - now) / 1000000u) + 1, woken))
            return KVT_ETIMEDOUT;
        const char *why, *msg;
        size_t msg_len;
        bool undecodable;
        int rc = kvc_recv_on(sock, 0, uid, KVC_DATA_NONE, r, &why);
        if (rc != KVT_ETIMEDOUT) /* ETIMEDOUT: it read a stale reply, and nothing else yet */
            return rc ? rc : kvc_decode(r, &msg, &msg_len, &undecodable);
    }
}

/* After the heartbeat's HELLO for generation gen: it joined when its token came back; another
 * token means the instance was gone and this HELLO made it anew — the caller's thread must
 * join that one (it keeps nothing of the old) and re-register. */
static void s_hb_joined(kvc_hb_t *hb, uint64_t gen, const char *presented, int rc,
                        const kvc_reply_t *r, uint64_t *joined)
{
    const msgpack_object *t = rc == 0 ? kvc_get(&r->up.data, "token") : NULL;
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
static void s_hb_lost(kvc_hb_t *hb, uint64_t gen)
{
    pthread_mutex_lock(&hb->lock);
    if (hb->gen == gen)
        atomic_store_explicit(&hb->dropped, true, memory_order_release);
    pthread_mutex_unlock(&hb->lock);
}

static void *s_hb_run(void *arg)
{
    kvc_hb_t *hb = arg;
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
            kvc_hello_body(&sb, hb->client, hb->instance, token, false);
        else
            kvc_instance_body(&sb, hb->instance);
        kvc_reply_t r;
        kvc_reply_init(&r);
        int rc =
            s_hb_exchange(hb, sock, uid++, hello ? KVT_REQ_HELLO : KVT_REQ_PING, &sb, &r, &woken);
        msgpack_sbuffer_destroy(&sb);
        if (hello) {
            s_hb_joined(hb, gen, token, rc, &r, &joined);
        } else if (rc == KVT_ENOINST) {
            s_hb_lost(hb, gen);
            dead = gen;
        }
        kvc_reply_free(&r);
    }
    if (sock)
        zmq_close(sock);
    return NULL;
}

/* The interval: KVTIER_HEARTBEAT_MS (0: no heartbeat; at least 10 ms), else lease_ms / 3
 * within [100 ms, 10 s] (10 s when HELLO gave no lease_ms). */
static int s_hb_interval(uint32_t lease_ms, bool *fixed)
{
    int env = kvc_env_int("KVTIER_HEARTBEAT_MS", -1, 0, 3600000);
    *fixed = env >= 0;
    if (env >= 0)
        return env > 0 && env < 10 ? 10 : env;
    uint32_t ms = lease_ms ? lease_ms / 3 : 10000;
    return ms < 100 ? 100 : ms > 10000 ? 10000 : (int)ms;
}

static void s_hb_free(kvc_hb_t *hb, bool destroy_sync)
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
int kvc_hb_start(kvtier_t *self, const char *endpoint, const kvtier_curve_t *curve, char *err,
                      size_t errlen)
{
    bool fixed;
    int interval = s_hb_interval(self->info.lease_ms, &fixed);
    if (interval == 0)
        return 0;
    kvc_hb_t *hb = calloc(1, sizeof *hb);
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
void kvc_hb_stop(kvc_hb_t **hb_p)
{
    kvc_hb_t *hb = *hb_p;
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
static kvc_hb_t *s_hb_mine(const kvtier_t *self)
{
    return self->hb && self->hb->pid == getpid() ? self->hb : NULL;
}

/* The token to present when saying HELLO again: the heartbeat's when it made the instance
 * anew, else the caller's own. */
void kvc_hb_token(const kvtier_t *self, char out[KVT_MAX_TOKEN + 1])
{
    kvc_hb_t *hb = s_hb_mine(self);
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
bool kvc_hb_newer_token(const kvtier_t *self, char presented[KVT_MAX_TOKEN + 1])
{
    kvc_hb_t *hb = s_hb_mine(self);
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
void kvc_hb_publish(kvtier_t *self)
{
    kvc_hb_t *hb = s_hb_mine(self);
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

bool kvc_hb_dropped(const kvc_hb_t *hb)
{
    return atomic_load_explicit(&((kvc_hb_t *)hb)->dropped, memory_order_acquire);
}
