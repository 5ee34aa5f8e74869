/* DESIGN: the ROUTER and an inproc PAIR reading its monitor (unbounded receive queue: libzmq's
 * monitor would otherwise drop events and the connection counts of kvt_accept would drift; it
 * holds a few dozen bytes per connection event). The monitor starts before the first bind, so
 * no listener or connection escapes it. Bound ipc paths are remembered and unlinked at destroy. */
#include "kvt_router.h"

#include "kvt_accept.h"
#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_rundir.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define S_SNDBUF (4 << 20) /* send buffer of an accepted connection: a 4 MiB chunk at once */
#define S_MAX_BOUND 16

struct kvt_router {
    kvt_router_opts_t opts;
    zsock_t *router, *monitor;
    void *sock;
    char *ipc[S_MAX_BOUND]; /* ipc paths bound: ours to remove */
    int nipc;
};

kvt_router_t *kvt_router_new(const kvt_router_opts_t *opts, char *err, size_t errlen)
{
    kvt_router_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->opts = *opts;
    self->router = zsock_new(ZMQ_ROUTER);
    if (!self->router) {
        snprintf(err, errlen, "%s: cannot create the ROUTER socket: %s", opts->label,
                 zmq_strerror(errno));
        goto fail;
    }
    self->sock = zsock_resolve(self->router);
    zsock_set_router_mandatory(self->router, 1);
    zsock_set_sndhwm(self->router, opts->sndhwm);
    zsock_set_linger(self->router, opts->linger_ms);
    uint64_t cut = opts->max_message + 65536;
    zsock_set_maxmsgsize(self->router, (int)(cut > INT32_MAX ? INT32_MAX : cut));
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://kvt-router-monitor-%p", (void *)self);
    if (zmq_socket_monitor(self->sock, ep,
                           ZMQ_EVENT_LISTENING | ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED) !=
            0 ||
        !(self->monitor = zsock_new(ZMQ_PAIR))) {
        snprintf(err, errlen, "%s: cannot monitor the ROUTER socket: %s", opts->label,
                 zmq_strerror(errno));
        goto fail;
    }
    zsock_set_rcvhwm(self->monitor, 0);
    if (zsock_connect(self->monitor, "%s", ep) != 0) {
        snprintf(err, errlen, "%s: cannot connect the ROUTER socket's monitor", opts->label);
        goto fail;
    }
    return self;
fail:
    kvt_router_destroy(&self);
    return NULL;
}

int kvt_router_bind(kvt_router_t *self, const kvt_config_t *cfg, const char *ep, char *err,
                    size_t errlen)
{
    bool ipc = strncmp(ep, "ipc://", 6) == 0;
    if (ipc && self->nipc == S_MAX_BOUND) {
        snprintf(err, errlen, "%s: more than %d ipc endpoints", self->opts.label, S_MAX_BOUND);
        return KVT_EINVAL;
    }
    int rc = ipc ? kvt_rundir_check_ipc(ep, err, errlen) : 0;
    if (rc)
        return rc;
    if (zsock_bind(self->router, "%s", ep) < 0) {
        snprintf(err, errlen, "%s: cannot bind %s: %s", self->opts.label, ep, zmq_strerror(errno));
        return KVT_EIO;
    }
    if (ipc) {
        self->ipc[self->nipc] = strdup(ep + 6);
        kvt_assert(self->ipc[self->nipc]);
        self->nipc++;
    }
    kvt_router_events(self); /* the listener's descriptor: its connections count from now on */
    return ipc ? kvt_rundir_share_ipc(cfg, self->opts.label, ep + 6, err, errlen) : 0;
}

/* libzmq applies ZMQ_SNDBUF to tcp connections only: on ipc a 4 MiB GET reply would leave
 * through the default unix socket buffer (208 KiB) in some twenty writes, each one waking the
 * client's I/O thread, so the send buffer of an accepted ipc connection is raised here (the
 * kernel caps it at net.core.wmem_max). Tcp keeps the kernel's autotuning, which a fixed
 * SO_SNDBUF would switch off; checking the domain also keeps a descriptor number reused since
 * the event (an L2 connection, the HTTP socket) out of it. */
static void s_raise_sndbuf(int fd)
{
    int size = S_SNDBUF, domain = 0;
    socklen_t dlen = sizeof domain;
    if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &dlen) == 0 && domain == AF_UNIX &&
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size))
        kvt_log(KVT_LOG_DEBUG, "SO_SNDBUF on a new connection: %s", strerror(errno));
}

void kvt_router_events(kvt_router_t *self)
{
    for (;;) {
        zmsg_t *ev = zmsg_recv_nowait(self->monitor);
        if (!ev)
            return;
        zframe_t *f = zmsg_first(ev);
        if (f && zframe_size(f) == 6) {
            uint16_t event;
            int32_t fd;
            memcpy(&event, zframe_data(f), 2);
            memcpy(&fd, zframe_data(f) + 2, 4);
            if (event == ZMQ_EVENT_LISTENING) {
                kvt_accept_watch(fd);
            } else if (event == ZMQ_EVENT_ACCEPTED && fd >= 0) {
                s_raise_sndbuf(fd);
            } else if (event == ZMQ_EVENT_DISCONNECTED) {
                uint32_t gen = kvt_accept_closed(fd);
                if (gen && self->opts.on_closed)
                    self->opts.on_closed(self->opts.ctx, fd, gen);
            }
        }
        zmsg_destroy(&ev);
    }
}

int kvt_router_recv(kvt_router_t *self, kvt_router_slot_fn slot, void *ctx, kvt_router_msg_t *m)
{
    m->parts = 0;
    m->total = 0;
    bool more = true;
    while (more) {
        zmq_msg_t drop;
        zmq_msg_t *part = slot(ctx, m->parts);
        if (!part)
            part = &drop;
        zmq_msg_init(part);
        int n;
        /* the first part may not be there; once it is, libzmq has the whole message and a
         * signal only interrupts the call */
        while ((n = zmq_msg_recv(part, self->sock, ZMQ_DONTWAIT)) < 0 && errno == EINTR)
            ;
        if (n < 0) {
            int e = errno;
            zmq_msg_close(part);
            zmq_msg_init(part); /* the caller closes what its slots hold */
            if (m->parts == 0)
                return e == EAGAIN ? 0 : -1;
            return 1; /* cannot happen mid-message: answered as the truncated message it is */
        }
        more = zmq_msg_more(part);
        if (m->parts)
            m->total += zmq_msg_size(part);
        m->parts++;
        if (part == &drop)
            zmq_msg_close(&drop);
    }
    return 1;
}

void *kvt_router_socket(kvt_router_t *self)
{
    return self->sock;
}

zsock_t *kvt_router_zsock(kvt_router_t *self)
{
    return self->router;
}

void *kvt_router_monitor(kvt_router_t *self)
{
    return zsock_resolve(self->monitor);
}

void kvt_router_destroy(kvt_router_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_router_t *self = *self_p;
    zsock_destroy(&self->monitor);
    if (self->sock)
        zmq_socket_monitor(self->sock, NULL, 0);
    zsock_destroy(&self->router);
    for (int i = 0; i < self->nipc; i++) {
        unlink(self->ipc[i]);
        free(self->ipc[i]);
    }
    free(self);
    *self_p = NULL;
}
