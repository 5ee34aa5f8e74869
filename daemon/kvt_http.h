/* kvt_http: the operator's HTTP endpoints (libmicrohttpd) on their own supervised thread.
 *
 *   GET /          the status page: one self-contained HTML document (daemon/kvt_status_page.html,
 *                  embedded at build time) that polls /status and /metrics every second and plots
 *                  the last minutes; also /index.html. Its CSP allows no other origin.
 *   GET /healthz   200 while the process runs
 *   GET /readyz    200 when kvt_sup_ready holds (threads alive, L2 adapters answering), else 503
 *                  with the reason
 *   GET /metrics   Prometheus text format
 *   GET /status    JSON: version, uptime, readiness, threads, clients, config
 *   POST /clear    drops cached objects (all, or ?ns=NAME); JSON {ok, removed}; an ns the wire
 *                  protocol would refuse is a 400 {ok: false, error: {code, message}}
 *
 * Handlers only read atomics or take short module locks; they never wait on the server loop.
 * kvt_http_new/destroy are called from the main thread. */
#ifndef KVT_HTTP_H
#define KVT_HTTP_H

#include "kvt_config.h"
#include "kvt_metrics.h"
#include "kvt_supervisor.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_http kvt_http_t;

typedef struct {
    /* extra /status members (endpoints, clients, storage...). Returns a new object. */
    json_t *(*status)(void *ctx);
    /* removes cached objects of the ns_len bytes at `ns` (NULL: all); 0 or a KVT_E* code */
    int (*clear)(void *ctx, const char *ns, size_t ns_len, uint64_t *removed);
    void *ctx;
} kvt_http_hooks_t;

/* Binds cfg->http and starts the thread, serving at most max_connections connections at once
 * (http_max_connections as kvt_accept_setup shared the descriptors out). NULL with a sentence
 * in err on failure. */
kvt_http_t *kvt_http_new(const kvt_config_t *cfg, kvt_metrics_t *metrics, kvt_sup_t *sup,
                         const kvt_http_hooks_t *hooks, unsigned max_connections, char *err,
                         size_t errlen);

void kvt_http_destroy(kvt_http_t **self_p);

#endif
