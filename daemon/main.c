/* kvtierd: start-up, signals and orderly shutdown.
 *
 * DESIGN: the main thread loads the config, builds the modules in dependency order (metrics,
 * supervisor, server, http), runs the server loop, and on SIGTERM/SIGINT tears them down in
 * reverse order. Signal handlers only set a flag; a second SIGINT exits at once. */
#include "kvt_config.h"
#include "kvt_error.h"
#include "kvt_events.h"
#include "kvt_http.h"
#include "kvt_l1.h"
#include "kvt_log.h"
#include "kvt_metrics.h"
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

/* What the HTTP hooks reach. */
typedef struct {
    kvt_server_t *server;
    kvt_l1_t *l1;
} s_parts_t;

static const char *const s_event_names[] = {
    [KVT_L1_STORED] = "stored", [KVT_L1_EVICTED] = "evicted", [KVT_L1_REMOVED] = "removed"};

static void s_on_l1_event(void *ctx, kvt_l1_event_t event, const uint8_t *ns, uint32_t ns_len,
                          const uint8_t *salt, uint32_t salt_len,
                          const uint8_t (*keys)[KVT_KEY_LEN], uint32_t n)
{
    kvt_events_publish(ctx, s_event_names[event], ns, ns_len, salt, salt_len, keys, n, "l1");
}

static json_t *s_status_hook(void *ctx)
{
    s_parts_t *p = ctx;
    json_t *st = kvt_server_status_json(p->server);
    json_object_set_new(st, "l1", kvt_l1_status_json(p->l1));
    return st;
}

static int s_clear_hook(void *ctx, const char *ns, uint64_t *removed)
{
    s_parts_t *p = ctx;
    return kvt_l1_clear(p->l1, (const uint8_t *)ns, ns ? (uint32_t)strlen(ns) : 0, removed);
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
        printf("kvtierd: configuration is valid\n");
        kvt_config_destroy(&cfg);
        return 0;
    case KVT_CONFIG_RUN:
        break;
    }

    kvt_log_level_t level = KVT_LOG_INFO;
    kvt_log_level_parse(cfg->log_level, &level);
    kvt_log_set_level(level);
    /* the ipc socket, and later the arena and L2 files, are private to the service user */
    umask(0077);
    zsys_handler_set(NULL);
    zsys_set_logstream(NULL);

    struct sigaction sa = {.sa_handler = s_on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    int status = 1;
    kvt_metrics_t *metrics = NULL;
    kvt_sup_t *sup = NULL;
    kvt_server_t *server = NULL;
    kvt_l1_t *l1 = NULL;
    kvt_events_t *events = NULL;
    kvt_http_t *http = NULL;
    if (s_mkdirs(cfg->run_dir, err, sizeof err, "run_dir") ||
        s_mkdirs(cfg->data_dir, err, sizeof err, "data_dir"))
        goto done;
    metrics = kvt_metrics_new();
    sup = kvt_sup_new(cfg);
    kvt_metrics_add_source(metrics, kvt_sup_metrics_source, sup);
    l1 = kvt_l1_new(cfg, err, sizeof err);
    if (!l1)
        goto done;
    kvt_metrics_add_source(metrics, kvt_l1_metrics_source, l1);
    if (cfg->events[0]) {
        events = kvt_events_new(cfg->events, sup, err, sizeof err);
        if (!events)
            goto done;
        kvt_metrics_add_source(metrics, kvt_events_metrics_source, events);
        kvt_l1_set_listener(l1, s_on_l1_event, events);
    }
    server = kvt_server_new(cfg, metrics, sup, l1, err, sizeof err);
    if (!server)
        goto done;
    if (kvt_l1_start(l1, sup) != 0) {
        snprintf(err, sizeof err, "cannot start the eviction thread");
        goto done;
    }
    s_parts_t parts = {server, l1};
    if (cfg->http[0]) {
        kvt_http_hooks_t hooks = {s_status_hook, s_clear_hook, &parts};
        http = kvt_http_new(cfg, metrics, sup, &hooks, err, sizeof err);
        if (!http)
            goto done;
    }
    if (kvt_sup_start(sup) != 0) {
        snprintf(err, sizeof err, "cannot start the supervisor thread");
        goto done;
    }
    kvt_log(KVT_LOG_INFO, "kvtierd %s ready (pid %d, chunk_tokens %u, lease_ms %u)", KVT_VERSION,
            (int)getpid(), cfg->chunk_tokens, cfg->lease_ms);
    int rc = kvt_server_run(server, &s_stop);
    kvt_log(KVT_LOG_INFO, "kvtierd stopping%s", rc ? " after a server loop failure" : "");
    status = rc ? 1 : 0;
done:
    if (err[0])
        kvt_log(KVT_LOG_ERROR, "%s", err);
    kvt_http_destroy(&http);
    kvt_server_destroy(&server);
    kvt_l1_destroy(&l1);
    kvt_events_destroy(&events);
    kvt_sup_destroy(&sup);
    kvt_metrics_destroy(&metrics);
    kvt_config_destroy(&cfg);
    if (status == 0)
        kvt_log(KVT_LOG_INFO, "kvtierd stopped");
    return status;
}
