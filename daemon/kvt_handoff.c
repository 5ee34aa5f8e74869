/* DESIGN: a fixed table of offers and one poll() thread. The poll set is rebuilt each round
 * from the listener, an eventfd (stop, cancel), the connections still owing a ticket (at most
 * S_PENDING, one second each) and the claimants' connections. A claimant's connection is
 * closed only on this thread: kvt_handoff_cancel shuts it down (the client sees EOF at once)
 * and leaves the close to the next round, so no descriptor is closed under a poll. Tickets are
 * compared in constant time and are single-use; a claimant that is not the process that asked
 * is refused without using up the offer. */
#include "kvt_handoff.h"

#include "kvt_error.h"
#include "kvt_fdpass.h"
#include "kvt_log.h"
#include "kvt_rundir.h"
#include "kvt_thread.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define S_PENDING 64     /* connections that have not presented their ticket yet */
#define S_TICKET_MS 1000 /* ... each has this long */
#define S_TICKET_LEN (KVT_FDPASS_TICKET_HEX / 2)

typedef enum { S_R_UNKNOWN, S_R_PEER, S_R_MALFORMED, S_R_SLOW, S_R_BUSY, S_REASONS } s_reason_t;
static const char *const s_reason_names[S_REASONS] = {"unknown_ticket", "wrong_process",
                                                      "malformed", "timeout", "busy"};

typedef struct {
    uint64_t id; /* 0: a free entry */
    uint8_t ticket[S_TICKET_LEN];
    int fd;   /* the offered descriptor (ours), -1 once sent */
    int fd2;  /* a second one sent with it (the residency map), or -1 */
    int sock; /* the claimant's connection, -1 */
    kvt_handoff_peer_t peer;
    uint64_t deadline_ms;
    kvt_handoff_state_t state;
    bool cancelled; /* freed once the thread closed sock */
} s_offer_t;

typedef struct {
    int sock;
    uint64_t deadline_ms;
    uint32_t got;
    char buf[KVT_FDPASS_TICKET_HEX];
} s_pending_t;

struct kvt_handoff {
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    int lsock, wake;
    pthread_mutex_t lock; /* offers; a leaf */
    s_offer_t *offers;
    uint32_t noffers; /* entries (twice max_offers: cancelled ones wait for the thread) */
    uint32_t max_open, open;
    uint64_t next_id;
    s_pending_t pending[S_PENDING];
    uint32_t npending;
    kvt_thread_t *thread;
    _Atomic bool stop;
    _Atomic uint64_t claimed, refused[S_REASONS];
};

static kvt_errrep_t s_refusals = KVT_ERRREP_INIT(10000);

static void s_wake(kvt_handoff_t *self)
{
    uint64_t one = 1;
    (void)!write(self->wake, &one, sizeof one);
}

static void s_refuse(kvt_handoff_t *self, int sock, s_reason_t r, const char *why)
{
    atomic_fetch_add_explicit(&self->refused[r], 1, memory_order_relaxed);
    kvt_errrep_report(&s_refusals, KVT_LOG_WARN, "handoff: a ring-pair claim refused: %s", why);
    (void)kvt_fdpass_refuse(sock, why);
    close(sock);
}

static int s_hex(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* A complete ticket on `sock`: the descriptor goes, or a refusal. Thread only. */
static void s_claim(kvt_handoff_t *self, int sock, const char *hex)
{
    uint8_t t[S_TICKET_LEN];
    for (int i = 0; i < S_TICKET_LEN; i++) {
        int hi = s_hex(hex[2 * i]), lo = s_hex(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            s_refuse(self, sock, S_R_MALFORMED, "not a ticket (32 lowercase hex digits)");
            return;
        }
        t[i] = (uint8_t)(hi << 4 | lo);
    }
    struct ucred cr = {0, (uid_t)-1, (gid_t)-1};
    socklen_t crlen = sizeof cr;
    (void)getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cr, &crlen);
    uint64_t now = kvt_now_ms();
    pthread_mutex_lock(&self->lock);
    s_offer_t *hit = NULL;
    for (uint32_t i = 0; i < self->noffers; i++) {
        s_offer_t *o = &self->offers[i];
        uint8_t diff = o->id == 0 || o->state != KVT_HANDOFF_WAITING || o->cancelled;
        for (int k = 0; k < S_TICKET_LEN; k++) /* constant time: no early exit on a prefix */
            diff |= o->ticket[k] ^ t[k];
        if (!diff)
            hit = o;
    }
    if (hit && now > hit->deadline_ms) {
        hit->state = KVT_HANDOFF_EXPIRED;
        hit = NULL;
    }
    if (!hit) {
        pthread_mutex_unlock(&self->lock);
        s_refuse(self, sock, S_R_UNKNOWN, "no such ticket (never given, already used or expired)");
        return;
    }
    if (hit->peer.pid > 0 && (cr.pid != hit->peer.pid || cr.uid != hit->peer.uid)) {
        pthread_mutex_unlock(&self->lock);
        char why[160];
        snprintf(why, sizeof why,
                 "process %ld (uid %ld) is not the process that said HELLO (%ld, uid %ld)",
                 (long)cr.pid, (long)cr.uid, (long)hit->peer.pid, (long)hit->peer.uid);
        s_refuse(self, sock, S_R_PEER, why);
        return;
    }
    int fds[2] = {hit->fd, hit->fd2};
    int rc = kvt_fdpass_send(sock, fds, hit->fd2 >= 0 ? 2 : 1);
    if (rc == 0) {
        close(hit->fd);
        if (hit->fd2 >= 0)
            close(hit->fd2);
        hit->fd = hit->fd2 = -1;
        hit->sock = sock;
        hit->state = KVT_HANDOFF_CLAIMED;
        atomic_fetch_add_explicit(&self->claimed, 1, memory_order_relaxed);
    }
    pthread_mutex_unlock(&self->lock);
    if (rc) {
        kvt_log(KVT_LOG_DEBUG, "handoff: sending a ring pair to pid %ld: %s", (long)cr.pid,
                strerror(-rc));
        close(sock);
    }
}

static void s_pending_drop(kvt_handoff_t *self, uint32_t i)
{
    self->pending[i] = self->pending[--self->npending];
}

/* Reads what a pending connection sent; false when it is done with (claimed or refused). */
static bool s_pending_read(kvt_handoff_t *self, s_pending_t *p)
{
    ssize_t n = recv(p->sock, p->buf + p->got, sizeof p->buf - p->got, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return true;
    if (n <= 0) {
        close(p->sock);
        return false;
    }
    p->got += (uint32_t)n;
    if (p->got < sizeof p->buf)
        return true;
    s_claim(self, p->sock, p->buf);
    return false;
}

static void s_accept(kvt_handoff_t *self, uint64_t now)
{
    for (;;) {
        int s = accept4(self->lsock, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (s < 0)
            return;
        if (self->npending == S_PENDING) {
            /* the one waiting longest goes: a real claimant sends its ticket at once, so
             * connections held open empty cannot keep it out */
            uint32_t old = 0;
            for (uint32_t i = 1; i < self->npending; i++)
                if (self->pending[i].deadline_ms < self->pending[old].deadline_ms)
                    old = i;
            s_refuse(self, self->pending[old].sock, S_R_BUSY, "too many claims at once");
            s_pending_drop(self, old);
        }
        self->pending[self->npending++] = (s_pending_t){s, now + S_TICKET_MS, 0, {0}};
    }
}

/* Claimants' connections: closes those of cancelled offers (freeing them) and marks the
 * ones whose client went. Lock held. */
static void s_reap(kvt_handoff_t *self, const struct pollfd *pf, uint32_t from, uint32_t n)
{
    for (uint32_t i = 0; i < self->noffers; i++) {
        s_offer_t *o = &self->offers[i];
        if (o->id && o->cancelled) {
            if (o->sock >= 0)
                close(o->sock);
            memset(o, 0, sizeof *o);
            o->fd = o->fd2 = o->sock = -1;
        }
    }
    for (uint32_t k = from; k < from + n; k++) {
        if (!pf[k].revents)
            continue;
        for (uint32_t i = 0; i < self->noffers; i++) {
            s_offer_t *o = &self->offers[i];
            if (o->id && o->sock == pf[k].fd && o->state == KVT_HANDOFF_CLAIMED) {
                close(o->sock);
                o->sock = -1;
                o->state = KVT_HANDOFF_GONE;
            }
        }
    }
}

static bool s_run(kvt_thread_t *t, void *arg)
{
    kvt_handoff_t *self = arg;
    struct pollfd *pf = calloc(2 + S_PENDING + self->noffers, sizeof *pf);
    kvt_assert(pf);
    while (!atomic_load_explicit(&self->stop, memory_order_acquire)) {
        if (!kvt_thread_beat(t))
            break;
        uint32_t n = 0;
        pf[n++] = (struct pollfd){self->lsock, POLLIN, 0};
        pf[n++] = (struct pollfd){self->wake, POLLIN, 0};
        for (uint32_t i = 0; i < self->npending; i++)
            pf[n++] = (struct pollfd){self->pending[i].sock, POLLIN, 0};
        uint32_t claimants = n;
        pthread_mutex_lock(&self->lock);
        for (uint32_t i = 0; i < self->noffers; i++)
            if (self->offers[i].id && self->offers[i].sock >= 0 && !self->offers[i].cancelled)
                pf[n++] = (struct pollfd){self->offers[i].sock, POLLIN | POLLRDHUP, 0};
        pthread_mutex_unlock(&self->lock);
        int ms = (int)kvt_thread_idle_ms(t);
        if (self->npending && ms > 100)
            ms = 100;
        if (poll(pf, n, ms) < 0 && errno != EINTR) {
            kvt_log(KVT_LOG_ERROR, "handoff: poll: %s", strerror(errno));
            free(pf);
            return false;
        }
        uint64_t now = kvt_now_ms();
        if (pf[1].revents) {
            uint64_t v;
            (void)!read(self->wake, &v, sizeof v);
        }
        /* pending connections: index i of the array is pf[2 + i] as built (walk backwards:
         * dropping one moves the last into its place) */
        for (uint32_t i = self->npending; i-- > 0;) {
            s_pending_t *p = &self->pending[i];
            bool keep = true;
            if (pf[2 + i].revents)
                keep = s_pending_read(self, p);
            if (keep && now > p->deadline_ms) {
                s_refuse(self, p->sock, S_R_SLOW, "no ticket within a second");
                keep = false;
            }
            if (!keep)
                s_pending_drop(self, i);
        }
        if (pf[0].revents)
            s_accept(self, now);
        pthread_mutex_lock(&self->lock);
        s_reap(self, pf, claimants, n - claimants);
        pthread_mutex_unlock(&self->lock);
    }
    free(pf);
    return true;
}

/* ---- API ---- */

kvt_handoff_t *kvt_handoff_new(const kvt_config_t *cfg, uint32_t max_offers, char *err,
                               size_t errlen)
{
    kvt_handoff_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->lsock = self->wake = -1;
    pthread_mutex_init(&self->lock, NULL);
    self->max_open = max_offers ? max_offers : 1;
    self->noffers = 2 * self->max_open;
    self->offers = calloc(self->noffers, sizeof *self->offers);
    kvt_assert(self->offers);
    for (uint32_t i = 0; i < self->noffers; i++)
        self->offers[i].fd = self->offers[i].fd2 = self->offers[i].sock = -1;
    self->next_id = 1;
    int n = snprintf(self->path, sizeof self->path, "%s/%s", cfg->run_dir, KVT_HANDOFF_SOCK);
    if (n < 0 || (size_t)n >= sizeof self->path) {
        snprintf(err, errlen,
                 "run_dir: %s/%s is longer than a unix socket path may be (%zu bytes): "
                 "choose a shorter run_dir or set fastpath.enabled false",
                 cfg->run_dir, KVT_HANDOFF_SOCK, sizeof self->path - 1);
        goto fail;
    }
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    strcpy(sa.sun_path, self->path);
    self->lsock = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    self->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->lsock < 0 || self->wake < 0) {
        snprintf(err, errlen, "handoff socket: %s", strerror(errno));
        goto fail;
    }
    (void)unlink(self->path); /* a crashed daemon's; run_dir's lock is ours */
    if (bind(self->lsock, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(self->lsock, 64) != 0) {
        snprintf(err, errlen, "handoff socket %s: %s", self->path, strerror(errno));
        goto fail;
    }
    if (kvt_rundir_share_ipc(cfg, "shm_group", self->path, err, errlen) != 0)
        goto fail;
    return self;
fail:
    if (self->lsock >= 0 && self->path[0])
        (void)unlink(self->path);
    self->path[0] = '\0';
    kvt_handoff_destroy(&self);
    return NULL;
}

int kvt_handoff_start(kvt_handoff_t *self, kvt_sup_t *sup)
{
    self->thread = kvt_thread_start(sup, "handoff", 2000, s_run, self);
    return self->thread ? 0 : KVT_EINTERNAL;
}

void kvt_handoff_destroy(kvt_handoff_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_handoff_t *self = *self_p;
    if (self->thread) {
        atomic_store_explicit(&self->stop, true, memory_order_release);
        s_wake(self);
        kvt_thread_join(&self->thread);
    }
    for (uint32_t i = 0; i < self->npending; i++)
        close(self->pending[i].sock);
    for (uint32_t i = 0; i < self->noffers; i++) {
        if (self->offers[i].fd >= 0)
            close(self->offers[i].fd);
        if (self->offers[i].fd2 >= 0)
            close(self->offers[i].fd2);
        if (self->offers[i].sock >= 0)
            close(self->offers[i].sock);
    }
    if (self->lsock >= 0) {
        close(self->lsock);
        if (self->path[0])
            (void)unlink(self->path);
    }
    if (self->wake >= 0)
        close(self->wake);
    pthread_mutex_destroy(&self->lock);
    free(self->offers);
    free(self);
    *self_p = NULL;
}

const char *kvt_handoff_path(const kvt_handoff_t *self)
{
    return self->path;
}

uint64_t kvt_handoff_offer(kvt_handoff_t *self, int fd, int fd2, kvt_handoff_peer_t peer,
                           uint64_t ttl_ms, char *ticket)
{
    uint8_t t[S_TICKET_LEN];
    if (getrandom(t, sizeof t, 0) != (ssize_t)sizeof t)
        return 0;
    int dup = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (dup < 0)
        return 0;
    int dup2 = fd2 >= 0 ? fcntl(fd2, F_DUPFD_CLOEXEC, 3) : -1;
    if (fd2 >= 0 && dup2 < 0) {
        close(dup);
        return 0;
    }
    uint64_t id = 0;
    pthread_mutex_lock(&self->lock);
    s_offer_t *o = NULL;
    for (uint32_t i = 0; i < self->noffers && !o; i++)
        if (!self->offers[i].id)
            o = &self->offers[i];
    if (o && self->open < self->max_open) {
        id = self->next_id++;
        *o = (s_offer_t){.id = id,
                         .fd = dup,
                         .fd2 = dup2,
                         .sock = -1,
                         .peer = peer,
                         .deadline_ms = kvt_now_ms() + ttl_ms,
                         .state = KVT_HANDOFF_WAITING};
        memcpy(o->ticket, t, sizeof t);
        self->open++;
    }
    pthread_mutex_unlock(&self->lock);
    if (!id) {
        close(dup);
        if (dup2 >= 0)
            close(dup2);
        return 0;
    }
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < S_TICKET_LEN; i++) {
        ticket[2 * i] = hex[t[i] >> 4];
        ticket[2 * i + 1] = hex[t[i] & 15];
    }
    ticket[KVT_FDPASS_TICKET_HEX] = '\0';
    return id;
}

static s_offer_t *s_find(kvt_handoff_t *self, uint64_t id)
{
    for (uint32_t i = 0; id && i < self->noffers; i++)
        if (self->offers[i].id == id && !self->offers[i].cancelled)
            return &self->offers[i];
    return NULL;
}

kvt_handoff_state_t kvt_handoff_state(kvt_handoff_t *self, uint64_t id)
{
    pthread_mutex_lock(&self->lock);
    s_offer_t *o = s_find(self, id);
    kvt_handoff_state_t st = KVT_HANDOFF_EXPIRED;
    if (o) {
        if (o->state == KVT_HANDOFF_WAITING && kvt_now_ms() > o->deadline_ms)
            o->state = KVT_HANDOFF_EXPIRED;
        st = o->state;
    }
    pthread_mutex_unlock(&self->lock);
    return st;
}

void kvt_handoff_cancel(kvt_handoff_t *self, uint64_t id)
{
    pthread_mutex_lock(&self->lock);
    s_offer_t *o = s_find(self, id);
    if (o) {
        if (o->fd >= 0)
            close(o->fd);
        if (o->fd2 >= 0)
            close(o->fd2);
        o->fd = o->fd2 = -1;
        if (o->sock >= 0)
            shutdown(o->sock, SHUT_RDWR); /* closed by the thread, which may be polling it */
        o->cancelled = true;
        self->open--;
    }
    pthread_mutex_unlock(&self->lock);
    if (o)
        s_wake(self);
}

json_t *kvt_handoff_json(kvt_handoff_t *self)
{
    json_t *refused = json_object();
    for (int i = 0; i < S_REASONS; i++)
        json_object_set_new(refused, s_reason_names[i],
                            json_integer((json_int_t)atomic_load(&self->refused[i])));
    pthread_mutex_lock(&self->lock);
    json_int_t open = self->open;
    pthread_mutex_unlock(&self->lock);
    return json_pack("{s:s,s:I,s:I,s:o}", "socket", self->path, "offers", open, "claimed",
                     (json_int_t)atomic_load(&self->claimed), "refused", refused);
}
