/* libkvtier: the C client of the kvtier daemon (wire protocol v1).
 *
 * A kvtier_t is one DEALER connection that has said HELLO under a stable instance name. It is
 * NOT thread-safe: use one kvtier_t per thread (several per process is fine; give each its own
 * instance name, or share one name to share leases). Calls are synchronous with a per-call
 * timeout; a reply that arrives after its call timed out is discarded by uid. Every call returns
 * 0 or a negative KVT_E* code (kvt_error.h); kvtier_last_error() has the server's message. */
#ifndef KVTIER_H
#define KVTIER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvtier kvtier_t;

/* What HELLO answered. */
typedef struct {
    uint32_t version;
    char server[64];
    uint32_t chunk_tokens;
    uint32_t lease_ms;
    uint64_t max_message;
} kvtier_info_t;

/* Connects to `endpoint` ("ipc:///run/kvtier/kvtier.sock", "tcp://127.0.0.1:5555"), says HELLO
 * as `client` with instance `instance` (NULL: "<client>-<pid>-<n>"). NULL on failure with a
 * sentence in err. `timeout_ms` bounds every later call (0: 5000). */
kvtier_t *kvtier_connect(const char *endpoint, const char *client, const char *instance,
                         int timeout_ms, char *err, size_t errlen);

/* Says BYE (releasing every lease of the instance), closes and frees. Accepts NULL. */
void kvtier_close(kvtier_t **self_p);

const kvtier_info_t *kvtier_info(const kvtier_t *self);

int kvtier_ping(kvtier_t *self);

/* STATS as a JSON text (caller frees with free()). */
int kvtier_stats(kvtier_t *self, char **json_out);

/* Sends a raw request (body: one msgpack map) and waits for its reply; *reply_body is a
 * malloc'd copy of the reply body (caller frees). For request types this header has no call for
 * yet. */
int kvtier_call(kvtier_t *self, uint32_t type, const void *body, size_t len, void **reply_body,
                size_t *reply_len);

/* The server's message (or a local one) for the last failed call; "" after a success. */
const char *kvtier_last_error(const kvtier_t *self);

#ifdef __cplusplus
}
#endif

#endif
