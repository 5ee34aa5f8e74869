/* kvt_router: one client-facing ROUTER socket, as both doors (protocol v1: kvt_server; LMCache:
 * kvt_lmcache_door) use it. It creates the socket with the daemon's rules (mandatory routing, a
 * frame far above max_message cut at the transport), watches it with a socket monitor (each
 * listener's and each accepted connection's descriptor goes to kvt_accept, which counts and caps
 * client connections across doors; accepted ipc connections get a 4 MiB send buffer), binds
 * endpoints (ipc: refused while a live daemon listens there, then handed to shm_group), receives
 * whole messages into the caller's frames, and removes its ipc files at destroy.
 *
 * Everything is called from the owning door's thread. */
#ifndef KVT_ROUTER_H
#define KVT_ROUTER_H

#include "kvt_config.h"

#include <czmq.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_router kvt_router_t;

/* A client connection closed (descriptor fd, accept generation gen, non-zero). */
typedef void (*kvt_router_closed_fn)(void *ctx, int fd, uint32_t gen);

typedef struct {
    const char *label;    /* the option naming the endpoints: "listen", "lmcache.listen" */
    int sndhwm;           /* replies queued per connection before they drop; 0: no limit */
    int linger_ms;        /* what unsent replies get at close */
    uint64_t max_message; /* a frame past max_message + 64 KiB is cut at the transport */
    kvt_router_closed_fn on_closed; /* may be NULL */
    void *ctx;
} kvt_router_opts_t;

/* The socket and its monitor, nothing bound. NULL with a sentence in err. */
kvt_router_t *kvt_router_new(const kvt_router_opts_t *opts, char *err, size_t errlen);

/* Binds one endpoint (the ipc rules above). 0, or a KVT_E* code with a sentence. */
int kvt_router_bind(kvt_router_t *self, const kvt_config_t *cfg, const char *ep, char *err,
                    size_t errlen);

/* Handles every event the monitor has queued. Call before reading requests in each turn, so a
 * close is known before a message from a connection that reused its descriptor. */
void kvt_router_events(kvt_router_t *self);

/* Where part n of a message goes (0: the routing id): an uninitialised zmq_msg_t the router
 * initialises and receives into, or NULL to read the part and drop it. */
typedef zmq_msg_t *(*kvt_router_slot_fn)(void *ctx, uint32_t n);

typedef struct {
    uint32_t parts; /* parts read, the routing id included */
    size_t total;   /* bytes of the parts after the routing id */
} kvt_router_msg_t;

/* Receives one whole message if one is waiting: 1 (every part read, whatever it holds, so the
 * socket stays in step), 0 when none is waiting, -1 on a socket error. */
int kvt_router_recv(kvt_router_t *self, kvt_router_slot_fn slot, void *ctx, kvt_router_msg_t *m);

void *kvt_router_socket(kvt_router_t *self);   /* the libzmq socket: send, poll */
zsock_t *kvt_router_zsock(kvt_router_t *self); /* for options set before a bind (CURVE) */
void *kvt_router_monitor(kvt_router_t *self);  /* to poll, with the socket */

/* Closes the socket (unsent replies get linger_ms) and removes the ipc files it bound. */
void kvt_router_destroy(kvt_router_t **self_p);

#endif
