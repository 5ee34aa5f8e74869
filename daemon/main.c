/* kvtierd: start-up, signals and orderly shutdown.
 *
 * DESIGN: the main thread loads the config, builds the modules in dependency order (metrics,
 * supervisor, server, http), runs the server loop, and on SIGTERM/SIGINT tears them down in
 * reverse order. Signal handlers only set a flag; a second SIGINT exits at once. Under systemd
 * (Type=notify) READY=1 goes out only once every socket is bound, the arena is pinned and every
 * thread runs, and STOPPING=1 as soon as the loop ends (kvt_notify). */
#include "kvt_accept.h"
#include "kvt_cache.h"
#include "kvt_config.h"
#include "kvt_curve.h"
#include "kvt_error.h"
#include "kvt_events.h"
#include "kvt_http.h"
#include "kvt_rundir.h"
#include "kvt_l1.h"
#include "kvt_l2mgr.h"
#include "kvt_lmcache_door.h"
#include "kvt_log.h"
#include "kvt_metrics.h"
#include "kvt_notify.h"
#include "kvt_prefetch.h"
#include "kvt_reload.h"
#include "kvt_reqstats.h"
#include "kvt_server.h"
#include "kvt_supervisor.h"

#include <czmq.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static volatile sig_atomic_t s_stop;

static void s_on_signal(int sig)
{
    if (s_stop && sig == SIGINT) {
        kvt_log_raw_from_handler("<3>kvtierd: second SIGINT, exiting now\n");
        _exit(1);
    }
    s_stop = 1;
}

/* mkdir -p with private permissions for directories we create. */
static int s_mkdirs(const char *path, char *err, size_t errlen, const char *what)
{
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) {
        snprintf(err, errlen, "%s: path too long", what);
        return KVT_EINVAL;
    }
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(buf, 0750) != 0 && errno != EEXIST)
            goto fail;
        *p = '/';
    }
    if (mkdir(buf, 0750) != 0 && errno != EEXIST)
        goto fail;
    return 0;
fail:
    snprintf(err, errlen, "%s: cannot create %.160s: %s", what, buf, strerror(errno));
    return KVT_EIO;
}

/* Before anything another daemon could be using (arena, sockets, HTTP): run_dir's lock and the
 * ipc endpoints. A refused start exits 2: another daemon owns the run_dir or an endpoint, and a
 * restart would not change that (the unit's RestartPreventExitStatus=2). */
static kvt_rundir_t *s_single_instance(const kvt_config_t *cfg, int *status, char *err,
                                         size_t errlen)
{
    int rc = 0;
    kvt_rundir_t *inst = kvt_rundir_claim(cfg, &rc, err, errlen);
    if (!inst)
        *status = rc == KVT_EIO ? 1 : 2;
    return inst;
}

/* A tcp:// listen endpoint without CURVE has no authentication: on loopback every local user
 * can read, write and clear the cache (curve.require turns this into a refusal). */
static void s_warn_plain_tcp(const kvt_config_t *cfg)
{
    for (int i = 0; i < cfg->n_listen && !cfg->curve_server_cert[0]; i++)
        if (strncmp(cfg->listen[i], "tcp://", 6) == 0)
            kvt_log(KVT_LOG_WARN,
                    "listen: %s has no CURVE: every local user (and any host that can reach a "
                    "non-loopback address) can read, write and clear the cache; use ipc:// "
                    "(guarded by file permissions) or configure curve.server_cert and "
                    "curve.clients (curve.require refuses plain tcp)",
                    cfg->listen[i]);
}

/* What the HTTP hooks reach. */
typedef struct {
    const kvt_config_t *cfg;
    kvt_server_t *server;
    kvt_lmcache_door_t *lmcache; /* NULL without lmcache.listen */
    kvt_l1_t *l1;
    kvt_l2mgr_t *l2;
    kvt_sup_t *sup;
} s_parts_t;

/* A v1 instance ended: its GPU registrations go (never blocks: closing is the gpu's own
 * thread's). LMCache workers register none. */
static void s_gpu_owner_gone(void *ctx, kvt_owner_kind_t kind, uint64_t owner, bool expired)
{
    (void)expired;
    if (kind == KVT_OWNER_V1)
        kvt_gpu_owner_gone(ctx, owner);
}

static json_t *s_status_hook(void *ctx)
{
    s_parts_t *p = ctx;
    json_t *st = kvt_server_status_json(p->server);
    json_object_set_new(st, "l1", kvt_l1_status_json(p->l1));
    if (p->lmcache)
        json_object_set_new(st, "lmcache", kvt_lmcache_door_status_json(p->lmcache));
    json_object_set_new(st, "l2", kvt_l2mgr_status_json(p->l2));
    /* the effective config, with adapter secrets masked (--print-config keeps them) */
    char *text = kvt_config_to_json(p->cfg);
    json_t *cfg = text ? json_loads(text, 0, NULL) : NULL;
    free(text);
    json_t *l2 = cfg ? json_object_get(cfg, "l2") : NULL;
    size_t i;
    json_t *spec;
    json_array_foreach(l2, i, spec)
    {
        char shown[512];
        kvt_l2mgr_redact(json_string_value(spec), shown, sizeof shown);
        json_string_set(spec, shown);
    }
    if (cfg) {
        /* the level a SIGHUP may have changed, not the one of the start */
        json_object_set_new(cfg, "log_level", json_string(kvt_log_level_name(kvt_log_get_level())));
        json_object_set_new(st, "config", cfg);
    }
    return st;
}

/* Readiness beyond the threads, for /readyz and kvtier_ready alike (kvt_sup_set_ready_check).
 * kvt_l2mgr_ready reads an atomic and copies last_error under the adapter's short lock: safe
 * from the HTTP thread and from the server thread (STATS), which both end before L2 is gone. */
static bool s_ready_check(void *ctx, char *why, size_t whylen)
{
    kvt_l2mgr_t *l2 = ctx;
    return kvt_l2mgr_ready(l2, why, whylen);
}

static int s_clear_hook(void *ctx, const char *ns, size_t ns_len, uint64_t *removed)
{
    s_parts_t *p = ctx;
    return kvt_l1_clear(p->l1, (const uint8_t *)ns, (uint32_t)ns_len, removed);
}

/* The STATUS= line `systemctl status kvtier` shows while serving. */
static void s_ready_status(const kvt_config_t *cfg, kvt_l1_t *l1, char *buf, size_t len)
{
    size_t n = (size_t)snprintf(buf, len, "serving on");
    for (int i = 0; i < cfg->n_listen && n < len; i++)
        n += (size_t)snprintf(buf + n, len - n, "%s %s", i ? "," : "", cfg->listen[i]);
    json_t *st = kvt_l1_status_json(l1);
    bool pinned = json_is_true(json_object_get(st, "pinned"));
    json_decref(st);
    if (n < len)
        snprintf(buf + n, len - n, ", L1 %llu bytes %s",
                 (unsigned long long)kvt_l1_capacity(l1), pinned ? "pinned" : "NOT pinned");
}

int main(int argc, char **argv)
{
    char err[KVT_ERR_LEN] = "";
    kvt_config_action_t action = KVT_CONFIG_RUN;
    kvt_config_t *cfg = kvt_config_new();
    if (kvt_config_load(cfg, argc, argv, &action, err, sizeof err) != 0) {
        fprintf(stderr, "kvtierd: %s\n", err);
        kvt_config_destroy(&cfg);
        return 2;
    }
    switch (action) {
    case KVT_CONFIG_VERSION:
        printf("kvtierd (kvtier) %s, protocol 1\n", KVT_VERSION);
        kvt_config_destroy(&cfg);
        return 0;
    case KVT_CONFIG_HELP:
        kvt_config_usage(stdout);
        kvt_config_destroy(&cfg);
        return 0;
    case KVT_CONFIG_PRINT: {
        char *text = kvt_config_to_json(cfg);
        printf("%s\n", text ? text : "{}");
        free(text);
        kvt_config_destroy(&cfg);
        return text ? 0 : 1;
    }
    case KVT_CONFIG_CHECK:
        if (kvt_curve_check(cfg, err, sizeof err) != 0 ||
            kvt_l2mgr_check(cfg, err, sizeof err) != 0) {
            fprintf(stderr, "kvtierd: %s\n", err);
            kvt_config_destroy(&cfg);
            return 2;
        }
        printf("kvtierd: configuration is valid\n");
        kvt_config_destroy(&cfg);
        return 0;
    case KVT_CONFIG_RUN:
        /* an unusable certificate is a configuration error (status 2), found before any
         * resource is taken */
        if (kvt_curve_check(cfg, err, sizeof err) != 0) {
            fprintf(stderr, "kvtierd: %s\n", err);
            kvt_config_destroy(&cfg);
            return 2;
        }
        break;
    }

    kvt_log_level_t level = KVT_LOG_INFO;
    kvt_log_level_parse(cfg->log_level, &level);
    kvt_log_set_level(level);
    /* the ipc socket, and later the arena and L2 files, are private to the service user */
    umask(0077);
    zsys_handler_set(NULL);
    zsys_set_logstream(NULL);
    /* before the first socket: a connection moving a large GET reply then holds up only the
     * connections on its own I/O thread */
    zsys_set_io_threads(cfg->io_threads);

    struct sigaction sa = {.sa_handler = s_on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    /* SIGHUP re-reads the config file (the server loop runs the reload) */
    kvt_reload_t *reload = kvt_reload_new(argc, argv, cfg);

    int status = 1;
    kvt_metrics_t *metrics = NULL;
    kvt_reqstats_t *reqstats = NULL;
    kvt_sup_t *sup = NULL;
    kvt_server_t *server = NULL;
    kvt_lmcache_door_t *lmcache = NULL;
    kvt_cache_t *cache = NULL;
    kvt_gpu_t *gpu = NULL;
    kvt_l1_t *l1 = NULL;
    kvt_l2mgr_t *l2 = NULL;
    kvt_events_t *events = NULL;
    kvt_http_t *http = NULL;
    kvt_rundir_t *instance = NULL;
    kvt_accept_budget_t fds = {0};
    if (s_mkdirs(cfg->run_dir, err, sizeof err, "run_dir") ||
        s_mkdirs(cfg->data_dir, err, sizeof err, "data_dir"))
        goto done;
    if (!(instance = s_single_instance(cfg, &status, err, sizeof err)))
        goto done;
    s_warn_plain_tcp(cfg);
    /* the open-files limit up to its hard limit, shared between client and HTTP connections
     * (libzmq must never meet EMFILE: see kvt_accept.h) */
    if (kvt_accept_setup(cfg->max_connections, cfg->http[0] ? cfg->http_max_connections : 0,
                         &fds, err, sizeof err) != 0)
        goto done;
    metrics = kvt_metrics_new();
    /* the order of the families on /metrics, /status and STATS is this order */
    reqstats = kvt_reqstats_new();
    kvt_metrics_add_source(metrics, kvt_reqstats_source, reqstats);
    kvt_metrics_add_source(metrics, kvt_metrics_uptime_source, metrics);
    kvt_metrics_add_source(metrics, kvt_accept_metrics_source, NULL);
    kvt_sup_fault_t fault = {.thread = cfg->debug_fault_thread,
                             .mode = cfg->debug_fault_mode,
                             .after_ms = cfg->debug_fault_after_ms,
                             .for_ms = cfg->debug_fault_for_ms};
    sup = kvt_sup_new(&fault);
    kvt_metrics_add_source(metrics, kvt_sup_metrics_source, sup);
    /* the tiers, the owner registry and the lookup threads: the service both doors call */
    int crc = 0;
    cache = kvt_cache_new(cfg, sup, &crc, err, sizeof err);
    if (!cache) {
        status = crc == KVT_EINVAL ? 2 : 1; /* a bad adapter spec is a bad configuration */
        goto done;
    }
    l1 = kvt_cache_l1(cache);
    l2 = kvt_cache_l2(cache);
    kvt_metrics_add_source(metrics, kvt_l1_metrics_source, l1);
    if (cfg->events[0]) {
        /* the cache service's log of L1 and L2 changes feeds the events socket */
        events = kvt_events_new(cfg->events, kvt_cache_evlog(cache), sup, err, sizeof err);
        if (!events)
            goto done;
        kvt_metrics_add_source(metrics, kvt_events_metrics_source, events);
    }
    kvt_metrics_add_source(metrics, kvt_prefetch_metrics_source, kvt_cache_prefetch(cache));
    kvt_metrics_add_source(metrics, kvt_l2mgr_metrics_source, l2);
    kvt_metrics_add_source(metrics, kvt_cache_metrics_source, cache);
    /* before any thread that renders the metrics or answers /readyz starts */
    kvt_sup_set_ready_check(sup, s_ready_check, l2);
    gpu = kvt_gpu_new(l1); /* touches no CUDA until a GPU request */
    kvt_metrics_add_source(metrics, kvt_gpu_metrics_source, gpu);
    kvt_cache_on_owner_gone(cache, s_gpu_owner_gone, gpu);
    s_parts_t parts = {cfg, NULL, NULL, l1, l2, sup};
    server = kvt_server_new(cfg, metrics, reqstats, sup, cache, gpu, err, sizeof err);
    if (!server)
        goto done;
    if (cfg->lmcache_listen[0]) {
        lmcache = kvt_lmcache_door_new(cfg, sup, cache, err, sizeof err);
        if (!lmcache)
            goto done;
        kvt_metrics_add_source(metrics, kvt_lmcache_door_metrics_source, lmcache);
        parts.lmcache = lmcache;
    }
    if (kvt_cache_start(cache) != 0) {
        snprintf(err, sizeof err, "cannot start the eviction thread");
        goto done;
    }
    parts.server = server;
    if (cfg->http[0]) {
        kvt_http_hooks_t hooks = {.status = s_status_hook,
                                  .clear = s_clear_hook,
                                  .ctx = &parts};
        http = kvt_http_new(cfg, metrics, sup, &hooks, fds.http, err, sizeof err);
        if (!http)
            goto done;
    }
    if (kvt_sup_start(sup) != 0) {
        snprintf(err, sizeof err, "cannot start the supervisor thread");
        goto done;
    }
    kvt_log(KVT_LOG_INFO, "kvtierd %s ready (pid %d, chunk_tokens %u, lease_ms %u)", KVT_VERSION,
            (int)getpid(), cfg->chunk_tokens, cfg->lease_ms);
    char ready[256];
    s_ready_status(cfg, l1, ready, sizeof ready);
    kvt_notify_ready(ready);
    int rc = kvt_server_run(server, &s_stop);
    kvt_notify_stopping();
    kvt_log(KVT_LOG_INFO, "kvtierd stopping%s", rc ? " after a server loop failure" : "");
    status = rc ? 1 : 0;
done:
    if (err[0]) {
        kvt_log(KVT_LOG_ERROR, "%s", err);
        kvt_notify_status("failed: %s", err);
    }
    kvt_http_destroy(&http);
    kvt_cache_quiesce(cache); /* lookups still queued come back without probing L2 */
    /* the door first: closing its workers tells the server's owner listeners (GPU, rings) */
    kvt_lmcache_door_destroy(&lmcache);
    kvt_server_destroy(&server);
    kvt_gpu_destroy(&gpu); /* after the server's workers, before L1 goes */
    /* no evictions from here on; queued write-behind reaches L2, running loads end */
    kvt_cache_stop(cache);
    kvt_events_destroy(&events); /* after the last L1 and L2 event */
    /* GET replies still lingering in libzmq point into the arena and unpin it from their free
     * callbacks: the ZMQ context must be gone (all messages freed) before L1 is */
    zsys_shutdown();
    kvt_cache_destroy(&cache); /* L1 */
    kvt_sup_destroy(&sup);
    kvt_metrics_destroy(&metrics);
    kvt_reqstats_destroy(&reqstats); /* after the server and HTTP, its writer and a reader */
    kvt_reload_destroy(&reload);
    kvt_rundir_release(&instance); /* the arena and the socket files are gone */
    kvt_config_destroy(&cfg);
    if (status == 0)
        kvt_log(KVT_LOG_INFO, "kvtierd stopped");
    return status;
}
