/* kvt_server: the ROUTER server loop — the only code that touches the client socket.
 *
 * Binds one ROUTER socket to every configured endpoint, decodes each message's envelope
 * [uid, type, body, data...], validates the body (protocol/), dispatches by request type and
 * sends the reply [uid, type, body, data...]. It never blocks: sends use DONTWAIT (a reply to
 * a vanished or stalled client is dropped and counted), and periodic work (heartbeat, session
 * expiry) runs between message batches. Runs on the main thread; kvt_server_status_json and
 * kvt_server_clients are safe from the HTTP thread. */
#ifndef KVT_SERVER_H
#define KVT_SERVER_H

#include "kvt_cache.h"
#include "kvt_config.h"
#include "kvt_gpu.h"
#include "kvt_metrics.h"
#include "kvt_reqstats.h"
#include "kvt_supervisor.h"

#include <jansson.h>
#include <signal.h>
#include <stddef.h>

typedef struct kvt_server kvt_server_t;

/* Creates the socket and binds every endpoint, serving requests on `cache` and `gpu` (the
 * caller's, outliving the server; the server builds only what is the v1 door's own:
 * sessions, workers, the fast path); finished requests are counted in `stats` (owned by the
 * caller, which outlives the server). NULL with a sentence in err on failure (an
 * endpoint in use, another daemon on the ipc path, a bad endpoint). */
kvt_server_t *kvt_server_new(const kvt_config_t *cfg, kvt_metrics_t *metrics,
                             kvt_reqstats_t *stats, kvt_sup_t *sup, kvt_cache_t *cache,
                             kvt_gpu_t *gpu, char *err, size_t errlen);

/* Closes the socket (pending replies get the linger time) and frees everything; waits for the
 * LOOKUPs the cache service still has (kvt_cache_quiesce first makes that short). */
void kvt_server_destroy(kvt_server_t **self_p);

/* Serves until *stop becomes non-zero. Returns 0 on a requested stop, or a KVT_E* code when
 * the loop cannot go on. */
int kvt_server_run(kvt_server_t *self, volatile sig_atomic_t *stop);

/* {endpoints: [...], clients: [...]} for /status. Any thread. */
json_t *kvt_server_status_json(kvt_server_t *self);

#endif
