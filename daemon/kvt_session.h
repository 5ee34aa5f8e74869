/* kvt_session: the clients the daemon knows — the connections requests arrive on and the
 * client instances (HELLO ... BYE or silence) that leases belong to.
 *
 * A connection (kvt_conn_t) is made at its first message and is known by its ZMQ routing id
 * together with the descriptor libzmq read it from (ZMQ_SRCFD): a routing id that turns up on
 * another descriptor is a new connection (a client may pick its own routing id, so the id alone
 * proves nothing), and a descriptor the monitor reports closed ends its connection.
 *
 * A connection acts only for the instances it said HELLO as (at most
 * max_instances_per_connection); requests that take leases act for the last one. An instance
 * is created by the first HELLO naming it, which returns a random token; another connection
 * joins the instance only by presenting that token (a client re-attaching after a reconnect,
 * or a helper connection such as a heartbeat). Without it the name is taken. Any request on a
 * connection renews its instances; an instance silent for lease_ms is dropped with its leases,
 * and its connections then answer instance_dropped until they say HELLO again.
 *
 * Replies in flight are counted per connection (kvt_conn_reply_start/_end): the bytes of
 * daemon memory they hold and the arena bytes they pin. kvt_sessions_sweep() cuts a connection
 * whose replies have not moved for reply_timeout_ms, or that leaves more than
 * max_reply_backlog bytes unread: shutdown() of its descriptor makes libzmq close it and free
 * everything queued for it (unpinning the arena).
 *
 * Threads: the server thread calls everything, except kvt_sessions_json and the metrics source
 * (HTTP thread) and kvt_conn_reply_end / kvt_conn_unref (any thread: libzmq's I/O threads free
 * sent frames). One mutex guards the tables; the reply counters are atomics. A connection
 * lives while the table, a request or a reply in flight holds a reference. */
#ifndef KVT_SESSION_H
#define KVT_SESSION_H

#include "kvt_metrics.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_sessions kvt_sessions_t;
typedef struct kvt_conn kvt_conn_t;

#define KVT_TOKEN_HEX 32 /* an instance token: 128 random bits as hex */

typedef struct {
    uint64_t lease_ms;      /* silence after which an instance is dropped */
    uint32_t max_instances_per_conn;
    uint64_t reply_timeout_ms;  /* replies that do not move for this long: the connection goes */
    uint64_t max_reply_backlog; /* bytes of daemon memory one connection's unread replies hold */
} kvt_session_limits_t;

/* Called (server thread, no lock held) when an instance says BYE or goes silent (`expired`);
 * returns how many leases were released for it. */
typedef uint64_t (*kvt_session_gone_fn)(void *ctx, uint64_t owner, bool expired);

/* Called (lock held) for a new instance: its lease owner id, or KVT_EBUSY with a sentence
 * (the cache service's owner registry: max_instances across both doors). */
typedef int (*kvt_session_new_fn)(void *ctx, uint64_t *owner, char *err, size_t errlen);

kvt_sessions_t *kvt_sessions_new(const kvt_session_limits_t *lim, kvt_session_new_fn on_new,
                                 kvt_session_gone_fn on_gone, void *ctx);

/* Frees the tables. Connections still referenced by replies in flight are freed by their last
 * kvt_conn_unref. */
void kvt_sessions_destroy(kvt_sessions_t **self_p);

/* ---- connections ---- */

/* The connection of a message from routing id `rid` read on descriptor `fd` (-1: unknown),
 * made on first sight (`gen`: which connection on that descriptor it is, see kvt_accept);
 * renews the instances it acts for. The caller owns one reference. */
kvt_conn_t *kvt_sessions_conn(kvt_sessions_t *self, const uint8_t *rid, size_t rid_len, int fd,
                              uint32_t gen, uint64_t now_ms);

/* A request on connection c that did not come through the socket (the fast path's rings act
 * for the connection that asked for them): renews its instances as kvt_sessions_conn does. */
void kvt_sessions_touch(kvt_sessions_t *self, kvt_conn_t *c, uint64_t now_ms);

/* The descriptor the connection's messages are read from (-1: unknown), and which connection
 * on it (kvt_accept's generation). */
int kvt_conn_fd(const kvt_conn_t *c);
uint32_t kvt_conn_gen(const kvt_conn_t *c);

/* The connection is gone (out of the tables); references may outlive it. Any thread. */
bool kvt_conn_retired(const kvt_conn_t *c);

/* The caller keeps state on c (an LMCache worker's registration) or lets it go: a held
 * connection is not forgotten for silence, only when its close is reported. */
void kvt_conn_hold(kvt_sessions_t *self, kvt_conn_t *c, bool hold);

kvt_conn_t *kvt_conn_ref(kvt_conn_t *c);
void kvt_conn_unref(kvt_conn_t **c_p);

/* Owner id of the instance the connection acts for (its last HELLO), 0 when none. */
uint64_t kvt_conn_owner(const kvt_conn_t *c);

/* Why a connection has no instance, as a sentence for an instance_dropped error. */
void kvt_conn_why_no_instance(const kvt_conn_t *c, const char *request, char *out, size_t len);

/* The monitor saw connection `gen` of descriptor `fd` close: it is gone (its instances stay
 * until they expire or another connection joins them). */
void kvt_sessions_on_disconnect(kvt_sessions_t *self, int fd, uint32_t gen);

/* A reply of `bytes` of daemon memory pinning `pinned` arena bytes goes to libzmq (server
 * thread); every start is matched by one kvt_conn_reply_end (any thread, once the reply's last
 * frame is freed), which also drops the reference the start took. */
void kvt_conn_reply_start(kvt_conn_t *c, uint64_t bytes, uint64_t pinned, uint64_t now_ms);
void kvt_conn_reply_end(kvt_conn_t *c, uint64_t bytes, uint64_t pinned);

/* Arena bytes that replies in flight to this connection pin. */
uint64_t kvt_conn_pinned(const kvt_conn_t *c);

/* ---- instances ---- */

/* HELLO: makes `instance` the one the connection acts for. A new name creates an instance
 * (*created); an existing one is joined when the connection already acts for it or `token`
 * (may be NULL) is its token. token_out receives the instance's token (KVT_TOKEN_HEX + 1).
 * Returns 0 and *owner, KVT_EBADREQ (name taken, too many instances on this connection) or
 * KVT_EBUSY (max_instances reached), with a sentence in err. */
int kvt_sessions_hello(kvt_sessions_t *self, kvt_conn_t *c, const char *instance,
                       const char *client, const char *token, uint64_t now_ms, uint64_t *owner,
                       char *token_out, bool *created, char *err, size_t errlen);

/* BYE: ends `instance`, for every connection acting for it, if this connection acts for it;
 * *released counts its leases. KVT_EBADREQ when the connection does not act for it,
 * KVT_ENOINST when it did and the instance was dropped. */
int kvt_sessions_bye(kvt_sessions_t *self, kvt_conn_t *c, const char *instance, uint64_t *released,
                     char *err, size_t errlen);

/* PING with `instance`: 0 when the connection acts for it, else KVT_ENOINST. */
int kvt_sessions_check(kvt_sessions_t *self, const kvt_conn_t *c, const char *instance, char *err,
                       size_t errlen);

/* Periodic (server thread): drops every instance silent for more than lease_ms and cuts
 * connections that stopped reading their replies. Returns the instances dropped. */
size_t kvt_sessions_sweep(kvt_sessions_t *self, uint64_t now_ms);

size_t kvt_sessions_count(kvt_sessions_t *self);

/* Bytes an owner holds under leases, for /status (called under the sessions mutex). */
typedef uint64_t (*kvt_owner_bytes_fn)(void *ctx, uint64_t owner);

/* {clients: [...at most 100], clients_total, connections: {...}} for /status; bounded in
 * size whatever the number of clients. `leased` (may be NULL) fills each instance's
 * leased_bytes. Any thread. */
json_t *kvt_sessions_json(kvt_sessions_t *self, uint64_t now_ms, kvt_owner_bytes_fn leased,
                          void *ctx);

/* Metrics source: kvtier_clients_connected, kvtier_connections_cut_total{reason},
 * kvtier_reply_pending, kvtier_reply_pinned_bytes, kvtier_reply_backlog_bytes. */
void kvt_sessions_metrics_source(void *self, kvt_sample_fn emit, void *emit_ctx);

#endif
