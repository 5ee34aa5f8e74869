/* kvt_session: the client instances the daemon knows (HELLO ... BYE or silence).
 *
 * A session is keyed by the client's `instance` and bound to the ZMQ routing id of the
 * connection that said HELLO; any request on that connection renews it. An instance silent for
 * longer than lease_ms is dropped, and the `on_gone` callback lets the storage manager release
 * its leases. Written by the server thread; the mutex lets the HTTP thread list sessions for
 * /status. */
#ifndef KVT_SESSION_H
#define KVT_SESSION_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_sessions kvt_sessions_t;

/* Called (server thread) when an instance says BYE or goes silent; returns how many leases
 * were released for it. */
typedef uint64_t (*kvt_session_gone_fn)(void *ctx, const char *instance, int why_expired);

kvt_sessions_t *kvt_sessions_new(kvt_session_gone_fn on_gone, void *ctx);
void kvt_sessions_destroy(kvt_sessions_t **self_p);

/* Binds routing id `rid` to `instance` (creating the session, or moving an existing one to a
 * new connection). Returns 1 when the session is new, 0 when it existed. */
int kvt_sessions_hello(kvt_sessions_t *self, const uint8_t *rid, size_t rid_len,
                       const char *instance, const char *client, uint64_t now_ms);

/* Renews the session bound to `rid`, if any. Returns the instance name or NULL (valid until the
 * session is removed). */
const char *kvt_sessions_touch(kvt_sessions_t *self, const uint8_t *rid, size_t rid_len,
                               uint64_t now_ms);

/* Removes an instance; returns leases released through on_gone, or -1 when unknown. */
int64_t kvt_sessions_bye(kvt_sessions_t *self, const char *instance);

/* Drops sessions silent for more than `lease_ms`; returns how many were dropped. */
size_t kvt_sessions_expire(kvt_sessions_t *self, uint64_t now_ms, uint64_t lease_ms);

size_t kvt_sessions_count(kvt_sessions_t *self);

/* [{instance, client, idle_ms, requests}] for /status. Any thread. */
json_t *kvt_sessions_json(kvt_sessions_t *self, uint64_t now_ms);

#endif
