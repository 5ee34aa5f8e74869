/* kvt_accept: the daemon's own accept() — a cap on client connections, and no abort or spin
 * when the process runs out of file descriptors.
 *
 * libzmq accepts connections on its I/O threads, has no connection limit, and Debian's libzmq
 * 4.3.4 aborts the whole process when accept() fails with EMFILE on an ipc listener
 * (errno_assert in ipc_listener.cpp; on tcp it spins on the listener instead, starving the
 * HTTP server). kvtierd therefore defines accept() and accept4() itself: the dynamic linker
 * binds libzmq's and libmicrohttpd's calls to them, and they call the C library's through
 * dlsym(RTLD_NEXT). They
 *  - refuse a connection on a client listener (kvt_accept_watch) once max connections are
 *    open: it is closed at once and the caller sees ECONNABORTED, which libzmq takes as a
 *    failed accept (ZMQ_EVENT_ACCEPT_FAILED) and goes on;
 *  - refuse any connection that would use one of the last descriptors of the open-files limit,
 *    which stay free for L2 files, HTTP and libzmq's own needs;
 *  - turn EMFILE/ENFILE into ECONNABORTED, after taking the pending connection off the
 *    listener with a spare descriptor kept for that (so nothing spins on it).
 * The server loop reports each closed client connection (the socket monitor's DISCONNECTED
 * event) with kvt_accept_closed.
 *
 * The state is process-wide (an interposed accept has no context argument). Before
 * kvt_accept_setup the interposers only pass through. Setup and watch: main thread, before
 * serving; the rest: any thread (atomics, and a mutex around the spare descriptor). */
#ifndef KVT_ACCEPT_H
#define KVT_ACCEPT_H

#include "kvt_metrics.h"

#include <stddef.h>
#include <stdint.h>

/* How the descriptors are shared out: client connections and HTTP connections. */
typedef struct {
    uint32_t clients;  /* client connections allowed at once (the cap the interposers apply) */
    uint32_t http;     /* HTTP connections (libmicrohttpd's limit) */
    uint64_t fd_limit; /* the soft RLIMIT_NOFILE after the raise */
} kvt_accept_budget_t;

/* Raises the soft RLIMIT_NOFILE to the hard limit, then shares the descriptors that are not
 * open yet and not kept in reserve between `max_connections` client connections and
 * `http_connections` HTTP ones (0 without HTTP); when they do not fit, HTTP gets a quarter of
 * the room (at least 16) and clients the rest. Logs the limit and what it lowered. Returns 0,
 * or KVT_EINVAL with a sentence in err when the limit leaves room for fewer than 8 clients. */
int kvt_accept_setup(uint32_t max_connections, uint32_t http_connections,
                     kvt_accept_budget_t *out, char *err, size_t errlen);

/* Counts and caps the connections accepted on listening descriptor `fd` from now on. */
void kvt_accept_watch(int fd);

/* Client connections accepted on descriptor `fd` so far: the generation of the one open on it
 * now (0: none counted). Any thread. */
uint32_t kvt_accept_generation(int fd);

/* A client connection on descriptor `fd` closed (the monitor's DISCONNECTED event: the server
 * thread, or the LMCache door's for its own socket). Returns the generation it closed, 0 when
 * that connection was never counted. */
uint32_t kvt_accept_closed(int fd);

/* Client connections open now. */
uint64_t kvt_accept_open(void);

/* Metrics source: kvtier_connections, kvtier_connections_max,
 * kvtier_connections_refused_total{reason}, kvtier_open_files_limit. */
void kvt_accept_metrics_source(void *ctx, kvt_sample_fn emit, void *emit_ctx);

#endif
