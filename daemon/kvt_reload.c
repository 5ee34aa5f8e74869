/* DESIGN: the two configurations are compared through kvt_config_to_json, the form
 * --print-config writes, so every option (and any added later) is covered without a list kept
 * here. Values other than log_level are not logged: an l2 spec may hold a password. The state is
 * static because a signal is process-wide: the handler can reach nothing else. The main thread
 * (the server loop) starts each reload on a thread of its own with a copy of what it reads
 * (s_job_t), joins it at the next call after it ended, and at stop waits 2 s at most for it. */
#include "kvt_reload.h"

#include "kvt_error.h"
#include "kvt_log.h"

#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

struct kvt_reload {
    int argc;
    char *const *argv;
    const kvt_config_t *running;
    pthread_t thread;     /* the reload running, while `busy` */
    atomic_bool busy;     /* a reload thread runs (or ran and was not joined yet) */
    atomic_bool finished; /* it returned: join it */
};

static volatile sig_atomic_t s_requested;
static kvt_reload_t *s_active;

static void s_on_sighup(int sig)
{
    (void)sig;
    kvt_reload_request();
}

void kvt_reload_request(void)
{
    s_requested = 1;
}

kvt_reload_t *kvt_reload_new(int argc, char *const argv[], const kvt_config_t *running)
{
    kvt_assert(!s_active);
    kvt_reload_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->argc = argc;
    self->argv = argv;
    self->running = running;
    s_active = self;
    struct sigaction sa = {.sa_handler = s_on_sighup};
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGHUP, &sa, NULL);
    return self;
}

void kvt_reload_destroy(kvt_reload_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    signal(SIGHUP, SIG_IGN); /* a late SIGHUP must not kill a daemon that is stopping */
    kvt_reload_t *self = *self_p;
    if (s_active == self)
        s_active = NULL;
    *self_p = NULL;
    if (atomic_load(&self->busy)) {
        /* a reload stuck on a file system is not waited for past 2 s: it and its context are
         * left to the process's end */
        struct timespec at;
        clock_gettime(CLOCK_REALTIME, &at);
        at.tv_sec += 2;
        if (pthread_timedjoin_np(self->thread, NULL, &at) != 0) {
            kvt_log(KVT_LOG_WARN, "config: a SIGHUP reload is still reading its files at stop");
            return;
        }
    }
    free(self);
}

/* The options (dotted names for grouped ones) whose values differ; returns how many. */
static int s_report_changes(const json_t *was, const json_t *now, const char *group,
                            const char *file)
{
    int changed = 0;
    const json_t *sides[2] = {was, now};
    for (int side = 0; side < 2; side++) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)sides[side], k, v)
        {
            const json_t *other = json_object_get(sides[!side], k);
            if (side == 1 && other)
                continue; /* compared from the first side */
            char name[128];
            snprintf(name, sizeof name, "%s%s%s", group, *group ? "." : "", k);
            if (!*group && strcmp(k, "log_level") == 0)
                continue; /* applied by the caller */
            if (json_is_object(v) && json_is_object(other)) { /* a group: curve.*, debug.* */
                changed += s_report_changes(v, other, name, file);
            } else if (!other || !json_equal(v, (json_t *)other)) {
                kvt_log(KVT_LOG_WARN,
                        "config: SIGHUP: %s changed in %s: it takes effect at the next restart",
                        name, file);
                changed++;
            }
        }
    }
    return changed;
}

static json_t *s_json(const kvt_config_t *cfg)
{
    char *text = kvt_config_to_json(cfg);
    json_t *obj = text ? json_loads(text, 0, NULL) : NULL;
    free(text);
    return obj ? obj : json_object();
}

/* What one reload reads, its own copy: the thread may outlive the daemon's stop (a hung file
 * system), and the running configuration is freed then. */
typedef struct {
    int argc;
    char *const *argv; /* main's: lives as long as the process */
    char *file;        /* the running configuration's file, NULL when none */
    json_t *running;   /* kvt_config_to_json of the running configuration */
    bool curve;        /* curve.clients is set */
    kvt_reload_t *owner; /* told when done; kept past a stop that did not wait for this */
} s_job_t;

static void s_job_free(s_job_t *job)
{
    free(job->file);
    json_decref(job->running);
    free(job);
}

static void s_reload(const s_job_t *self)
{
    const char *file = self->file;
    if (!file) {
        kvt_log(KVT_LOG_INFO, "config: SIGHUP: no config file (--config, KVTIER_CONFIG) to "
                              "re-read; nothing changed");
        return;
    }
    char err[KVT_ERR_LEN] = "";
    kvt_config_action_t action;
    kvt_config_t *fresh = kvt_config_new();
    if (kvt_config_load(fresh, self->argc, self->argv, &action, err, sizeof err) != 0) {
        kvt_log(KVT_LOG_ERROR, "config: SIGHUP: %s; the running configuration stays", err);
        kvt_config_destroy(&fresh);
        return;
    }
    int changed = 0;
    kvt_log_level_t was = kvt_log_get_level(), now = was;
    kvt_log_level_parse(fresh->log_level, &now); /* validated by the load */
    if (now != was) {
        /* said at the more verbose of the two levels, so that it shows */
        if (now > was)
            kvt_log_set_level(now);
        kvt_log(KVT_LOG_INFO, "config: SIGHUP: log_level %s -> %s (applied)",
                kvt_log_level_name(was), kvt_log_level_name(now));
        kvt_log_set_level(now);
        changed++;
    }
    json_t *b = s_json(fresh);
    changed += s_report_changes(self->running, b, "", file);
    json_decref(b);
    kvt_log(KVT_LOG_INFO, "config: SIGHUP: re-read %s: %d change%s%s", file, changed,
            changed == 1 ? "" : "s",
            self->curve
                ? " (CURVE client certificates need no reload: zauth re-reads curve.clients)"
                : "");
    kvt_config_destroy(&fresh);
}

static void *s_reload_thread(void *arg)
{
    s_job_t *job = arg;
    kvt_reload_t *owner = job->owner;
    s_reload(job);
    s_job_free(job);
    atomic_store(&owner->finished, true);
    return NULL;
}

/* The reload reads files (the config, and what it names): on a thread of its own, so that a
 * slow or hung file system never stalls the server loop that calls this. */
void kvt_reload_run_pending(void)
{
    kvt_reload_t *self = s_active;
    if (!self)
        return;
    if (atomic_load(&self->busy) && atomic_load(&self->finished)) {
        pthread_join(self->thread, NULL);
        atomic_store(&self->busy, false);
    }
    if (!s_requested)
        return;
    static bool told; /* once per reload waited for */
    if (atomic_load(&self->busy)) {
        if (!told)
            kvt_log(KVT_LOG_WARN, "config: SIGHUP: the previous reload is still reading its "
                                  "files; this one runs after it");
        told = true;
        return; /* s_requested stays: it runs once that one ends */
    }
    told = false;
    s_requested = 0;
    s_job_t *job = calloc(1, sizeof *job);
    kvt_assert(job);
    job->argc = self->argc;
    job->argv = self->argv;
    job->file = self->running->config_file ? strdup(self->running->config_file) : NULL;
    job->running = s_json(self->running);
    job->curve = self->running->curve_clients[0] != '\0';
    job->owner = self;
    atomic_store(&self->finished, false);
    atomic_store(&self->busy, true);
    if (pthread_create(&self->thread, NULL, s_reload_thread, job) != 0) {
        atomic_store(&self->busy, false);
        s_job_free(job);
        kvt_log(KVT_LOG_ERROR, "config: SIGHUP: cannot start the reload; nothing changed");
    }
}
