/* kvt_session: the client instances the daemon knows (HELLO ... BYE or silence).
 *
 * A session is keyed by the client's `instance` and gets a numeric owner id (never reused) that
 * leases are held under. Every connection (ZMQ routing id) that said HELLO with that instance is
 * bound to it, so a process may use several sockets under one instance; any request on a bound
 * connection renews the session. An instance silent for longer than lease_ms is dropped, and the
 * `on_gone` callback lets the storage manager release its leases. Written by the server thread;
 * the mutex lets the HTTP thread list sessions for /status. */
#ifndef KVT_SESSION_H
#define KVT_SESSION_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_sessions kvt_sessions_t;

/* Called (server thread) when an instance says BYE or goes silent (`expired`); returns how many
 * leases were released for it. */
typedef uint64_t (*kvt_session_gone_fn)(void *ctx, uint64_t owner, bool expired);

kvt_sessions_t *kvt_sessions_new(kvt_session_gone_fn on_gone, void *ctx);
void kvt_sessions_destroy(kvt_sessions_t **self_p);

/* Binds routing id `rid` to `instance`, creating the session when it is new (*created). A
 * connection bound to another instance before is moved. Returns the session's owner id. */
uint64_t kvt_sessions_hello(kvt_sessions_t *self, const uint8_t *rid, size_t rid_len,
                            const char *instance, const char *client, uint64_t now_ms,
                            bool *created);

/* Renews the session bound to `rid`. Returns its owner id, or 0 when the connection never said
 * HELLO or its instance is gone. */
uint64_t kvt_sessions_touch(kvt_sessions_t *self, const uint8_t *rid, size_t rid_len,
                            uint64_t now_ms);

/* Removes an instance; returns leases released through on_gone, or -1 when unknown. */
int64_t kvt_sessions_bye(kvt_sessions_t *self, const char *instance);

/* Drops sessions silent for more than `lease_ms`; returns how many were dropped. */
size_t kvt_sessions_expire(kvt_sessions_t *self, uint64_t now_ms, uint64_t lease_ms);

size_t kvt_sessions_count(kvt_sessions_t *self);

/* [{instance, client, idle_ms, requests}] for /status. Any thread. */
json_t *kvt_sessions_json(kvt_sessions_t *self, uint64_t now_ms);

#endif
