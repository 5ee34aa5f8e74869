/* DESIGN: a fixed table of thread slots, filled at start-up by the main thread before any
 * supervised thread runs, then read by everyone. Slot fields that change are atomics (last
 * beat, state), so beats and readiness checks take no lock. The supervisor thread wakes every
 * 200 ms, logs state changes once each (stuck, recovered, dead) and beats for itself; if it
 * dies, its own slot goes stale and /readyz says so. Under systemd (Type=notify, WatchdogSec=)
 * the same tick sends WATCHDOG=1, but only while kvt_sup_ready() holds: a stuck or dead thread
 * (the supervisor itself included) stops the keep-alives and the service manager restarts us.
 * The owner's extra readiness check (kvt_sup_set_ready_check: L2) counts for kvt_sup_ready and
 * kvtier_ready, never for the keep-alives, and the supervisor thread never calls it. */
#include "kvt_supervisor.h"

#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_notify.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Every thread the configuration can ask for: lookup (64) + prefetch (64) + 8 adapters x 16
 * writers + workers (16) + adopt verifiers (16) + the fixed ones, with room to spare. */
#define S_MAX_THREADS 320
#define S_TICK_MS 200

enum { S_RUNNING = 0, S_EXITED = 1, S_DEAD = 2 };

struct kvt_sup_thread {
    char name[32];
    uint32_t max_silence_ms;
    _Atomic uint64_t last_beat_ms;
    _Atomic int state;
    bool logged_stuck; /* supervisor thread only */
    bool logged_dead;
    /* fault injection (this thread only) */
    bool fault;
    bool fault_done;
    uint64_t fault_at_ms;
    bool fault_exit;     /* else stall */
    uint32_t fault_for_ms;
};

struct kvt_sup {
    char fault_thread[32]; /* "" for none */
    bool fault_exit;
    uint32_t fault_after_ms;
    uint32_t fault_for_ms;
    kvt_sup_thread_t threads[S_MAX_THREADS];
    _Atomic int nthreads;
    kvt_sup_thread_t *self_slot;
    pthread_t tid;
    bool started;
    _Atomic bool stop;
    uint64_t started_ms;
    /* service manager (supervisor thread only after start) */
    uint64_t wd_interval_ms; /* 0: no watchdog asked for */
    uint64_t wd_last_ms;
    bool notified_ready;
    /* readiness beyond the threads (L2 adapters answering); set before any reader runs */
    kvt_sup_ready_fn ready_check;
    void *ready_ctx;
};

kvt_sup_t *kvt_sup_new(const kvt_sup_fault_t *fault)
{
    kvt_sup_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    if (fault && fault->thread && fault->thread[0]) {
        snprintf(self->fault_thread, sizeof self->fault_thread, "%s", fault->thread);
        self->fault_exit = fault->mode && strcmp(fault->mode, "exit") == 0;
        self->fault_after_ms = fault->after_ms;
        self->fault_for_ms = fault->for_ms;
    }
    self->started_ms = kvt_now_ms();
    return self;
}

void kvt_sup_destroy(kvt_sup_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_sup_t *self = *self_p;
    if (self->started) {
        atomic_store(&self->stop, true);
        pthread_join(self->tid, NULL);
    }
    free(self);
    *self_p = NULL;
}

kvt_sup_thread_t *kvt_sup_register(kvt_sup_t *self, const char *name, uint32_t max_silence_ms)
{
    int i = atomic_load(&self->nthreads);
    kvt_assert(i < S_MAX_THREADS);
    kvt_sup_thread_t *t = &self->threads[i];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->max_silence_ms = max_silence_ms;
    atomic_store(&t->last_beat_ms, kvt_now_ms());
    atomic_store(&t->state, S_RUNNING);
    if (self->fault_thread[0] && strcmp(self->fault_thread, name) == 0) {
        t->fault = true;
        t->fault_exit = self->fault_exit;
        t->fault_for_ms = self->fault_for_ms;
        t->fault_at_ms = self->started_ms + self->fault_after_ms;
    }
    atomic_store(&self->nthreads, i + 1);
    return t;
}

bool kvt_sup_beat(kvt_sup_thread_t *t)
{
    uint64_t now = kvt_now_ms();
    atomic_store_explicit(&t->last_beat_ms, now, memory_order_relaxed);
    if (!t->fault || t->fault_done || now < t->fault_at_ms)
        return true;
    t->fault_done = true;
    if (t->fault_exit) {
        kvt_log(KVT_LOG_WARN, "debug fault: thread %s exits now", t->name);
        return false;
    }
    kvt_log(KVT_LOG_WARN, "debug fault: thread %s stalls for %u ms", t->name, t->fault_for_ms);
    struct timespec ts = {t->fault_for_ms / 1000, (long)(t->fault_for_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    atomic_store_explicit(&t->last_beat_ms, kvt_now_ms(), memory_order_relaxed);
    return true;
}

void kvt_sup_thread_exit(kvt_sup_thread_t *t, bool expected)
{
    atomic_store(&t->state, expected ? S_EXITED : S_DEAD);
}

/* Problem of one slot, or 0 when healthy. */
static int s_check(const kvt_sup_thread_t *t, uint64_t now, uint64_t *silent)
{
    int st = atomic_load(&t->state);
    if (st == S_DEAD)
        return S_DEAD;
    if (st == S_EXITED)
        return 0;
    uint64_t last = atomic_load_explicit(&t->last_beat_ms, memory_order_relaxed);
    *silent = now > last ? now - last : 0;
    return *silent > t->max_silence_ms ? -1 : 0;
}

void kvt_sup_set_ready_check(kvt_sup_t *self, kvt_sup_ready_fn fn, void *ctx)
{
    self->ready_check = fn;
    self->ready_ctx = ctx;
}

/* The threads only: what the watchdog keep-alives follow (an L2 outage must not make systemd
 * restart a daemon whose L1 still serves). */
static bool s_threads_ok(kvt_sup_t *self, char *why, size_t whylen)
{
    uint64_t now = kvt_now_ms();
    int n = atomic_load(&self->nthreads);
    for (int i = 0; i < n; i++) {
        uint64_t silent = 0;
        int p = s_check(&self->threads[i], now, &silent);
        if (p == S_DEAD) {
            snprintf(why, whylen, "thread %s is dead", self->threads[i].name);
            return false;
        }
        if (p < 0) {
            snprintf(why, whylen, "thread %s stuck for %llu ms", self->threads[i].name,
                     (unsigned long long)silent);
            return false;
        }
    }
    if (whylen)
        why[0] = '\0';
    return true;
}

bool kvt_sup_ready(kvt_sup_t *self, char *why, size_t whylen)
{
    if (!s_threads_ok(self, why, whylen))
        return false;
    return !self->ready_check || self->ready_check(self->ready_ctx, why, whylen);
}

/* Health as the service manager sees it: a STATUS= line on each change, and WATCHDOG=1 only
 * while every thread is healthy, sent at the last tick before the interval would pass. */
static void s_notify(kvt_sup_t *self, uint64_t now)
{
    char why[128];
    bool ok = s_threads_ok(self, why, sizeof why);
    if (ok != self->notified_ready) {
        kvt_notify_health(ok, why);
        self->notified_ready = ok;
    }
    if (ok && self->wd_interval_ms && now - self->wd_last_ms + S_TICK_MS > self->wd_interval_ms) {
        kvt_notify_watchdog();
        self->wd_last_ms = now;
    }
}

static void *s_run(void *arg)
{
    kvt_sup_t *self = arg;
    kvt_sup_thread_t *me = self->self_slot;
    /* a watchdog shorter than our tick (tests, odd units) still gets its keep-alives in time */
    uint64_t tick_ms = self->wd_interval_ms && self->wd_interval_ms < S_TICK_MS
                           ? self->wd_interval_ms
                           : S_TICK_MS;
    while (!atomic_load(&self->stop)) {
        if (!kvt_sup_beat(me)) {
            kvt_sup_thread_exit(me, false);
            return NULL;
        }
        uint64_t now = kvt_now_ms();
        int n = atomic_load(&self->nthreads);
        for (int i = 0; i < n; i++) {
            kvt_sup_thread_t *t = &self->threads[i];
            uint64_t silent = 0;
            int p = s_check(t, now, &silent);
            if (p == S_DEAD && !t->logged_dead) {
                kvt_log(KVT_LOG_ERROR, "supervisor: thread %s died; not ready", t->name);
                t->logged_dead = true;
            } else if (p < 0 && !t->logged_stuck) {
                kvt_log(KVT_LOG_ERROR, "supervisor: thread %s stuck for %llu ms; not ready",
                        t->name, (unsigned long long)silent);
                t->logged_stuck = true;
            } else if (p == 0 && t->logged_stuck) {
                kvt_log(KVT_LOG_WARN, "supervisor: thread %s recovered", t->name);
                t->logged_stuck = false;
            }
        }
        s_notify(self, now);
        struct timespec ts = {0, (long)tick_ms * 1000000L};
        nanosleep(&ts, NULL);
    }
    kvt_sup_thread_exit(me, true);
    return NULL;
}

int kvt_sup_start(kvt_sup_t *self)
{
    self->self_slot = kvt_sup_register(self, "supervisor", 5 * S_TICK_MS);
    self->wd_interval_ms = kvt_notify_watchdog_interval_ms();
    self->notified_ready = true;
    if (self->wd_interval_ms)
        kvt_log(KVT_LOG_INFO, "supervisor: watchdog keep-alive every %llu ms while healthy",
                (unsigned long long)self->wd_interval_ms);
    if (pthread_create(&self->tid, NULL, s_run, self) != 0)
        return KVT_EINTERNAL;
    self->started = true;
    return 0;
}

json_t *kvt_sup_status_json(kvt_sup_t *self)
{
    json_t *arr = json_array();
    uint64_t now = kvt_now_ms();
    int n = atomic_load(&self->nthreads);
    for (int i = 0; i < n; i++) {
        const kvt_sup_thread_t *t = &self->threads[i];
        uint64_t silent = 0;
        int p = s_check(t, now, &silent);
        int st = atomic_load(&t->state);
        uint64_t last = atomic_load(&t->last_beat_ms);
        json_array_append_new(
            arr, json_pack("{s:s,s:b,s:b,s:b,s:I,s:I}", "name", t->name, "alive",
                           st == S_RUNNING, "stuck", p < 0, "dead", st == S_DEAD,
                           "last_beat_ms_ago", (json_int_t)(now > last ? now - last : 0),
                           "max_silence_ms", (json_int_t)t->max_silence_ms));
    }
    return arr;
}

void kvt_sup_metrics_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    kvt_sup_t *self = ctx;
    uint64_t now = kvt_now_ms();
    int n = atomic_load(&self->nthreads);
    for (int i = 0; i < n; i++) {
        uint64_t silent = 0;
        kvt_sample_t s = {.name = "thread_up",
                          .help = "0 when the internal thread is stuck or dead.",
                          .kind = KVT_METRIC_GAUGE, .label = "thread",
                          .label_value = self->threads[i].name,
                          /* 0 for a stuck or dead thread, as kvt_sup_ready sees it; one
                           * that exited as asked (shutdown) is not a fault */
                          .value = s_check(&self->threads[i], now, &silent) == 0 ? 1.0 : 0.0};
        emit(emit_ctx, &s);
    }
    char why[256];
    kvt_sample_t r = {.name = "ready", .help = "1 when /readyz answers 200.",
                      .kind = KVT_METRIC_GAUGE, .value = kvt_sup_ready(self, why, sizeof why)};
    emit(emit_ctx, &r);
}
