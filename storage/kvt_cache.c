/* DESIGN: the service is a composition of the storage modules plus two small things of its own.
 *
 * Owners: a map id -> kind under one leaf mutex; ids come from one counter (1, 2, ...), so no
 * door needs a range of its own, and the count across kinds is what max_instances limits.
 * Closing releases the owner's leases in L1 first, then tells the listeners, outside the lock.
 *
 * Lookups: the L1 part runs on the caller's thread. A lookup with keys past the L1 prefix and
 * an L2 tier goes, whole, to a detached kvt_workers pool of l2_lookup_threads threads (4096
 * queued at most); a thread probes the adapters (kvt_l2mgr_lookup, deadline l2_lookup_timeout_ms),
 * starts the prefetch job and its loads, and hands the lookup back: at once, or, with until_loaded,
 * from the job's watcher when the loads finish (on the prefetch thread that finished them). A
 * lookup's `stage` says where it is, so that a caller going away can call off the wait for
 * loads (kvt_prefetch_unwatch decides the race with the watcher under the job table's lock). */
#include "kvt_cache.h"

#include "kvt_error.h"
#include "kvt_evlog.h"
#include "kvt_log.h"
#include "kvt_u64map.h"
#include "kvt_workers.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define S_MAX_LISTENERS 4
#define S_QUEUE 4096 /* lookups waiting for a lookup thread; past it: busy */
#define S_EVLOG_BYTES (64u << 20) /* keys the event log keeps, whatever event_log_size says */

enum { S_AT_CALLER, S_QUEUED, S_PROBING, S_LOADING, S_BACK };

typedef struct {
    kvt_owner_gone_fn fn;
    void *ctx;
} s_listener_t;

struct kvt_cache {
    const kvt_config_t *cfg;
    kvt_l1_t *l1;
    kvt_prefetch_t *prefetch;
    kvt_l2mgr_t *l2;
    kvt_evlog_t *evlog; /* NULL: event_log_size 0 */

    pthread_mutex_t lock; /* owners; a leaf */
    kvt_u64map_t *owners; /* id -> kind, as a pointer-sized integer */
    uint64_t next_owner;
    uint32_t nkind[4];
    s_listener_t listeners[S_MAX_LISTENERS];
    int nlisteners;

    kvt_sup_t *sup;
    kvt_workers_t *lookups; /* a detached pool: each lookup hands itself back */
    atomic_bool stopping;   /* queued lookups come back without probing */
    _Atomic uint64_t l2_lookups, l2_refused;
};

static const kvt_ev_kind_t s_l1_kinds[] = {[KVT_L1_STORED] = KVT_EV_STORED,
                                           [KVT_L1_EVICTED] = KVT_EV_EVICTED,
                                           [KVT_L1_REMOVED] = KVT_EV_REMOVED,
                                           [KVT_L1_LOADED] = KVT_EV_STORED};

/* L1 changes: objects clients stored go to L2 write-behind; every change to the event log. */
static void s_on_l1(void *ctx, const kvt_l1_change_t *c)
{
    kvt_cache_t *self = ctx;
    kvt_evlog_append(self->evlog, s_l1_kinds[c->event], c->ns, c->keys, c->sizes, c->labels,
                     c->n);
    if (c->event == KVT_L1_STORED)
        kvt_l2mgr_on_stored(self->l2, c->ns, c->keys, c->n);
}

static void s_on_l2(void *ctx, const char *event, const kvt_ns_t *ns, const kvt_key_t *keys,
                    const uint64_t *sizes, uint32_t n, const char *adapter)
{
    (void)adapter;
    kvt_cache_t *self = ctx;
    kvt_evlog_append(self->evlog,
                     strcmp(event, "l2_stored") == 0 ? KVT_EV_L2_STORED : KVT_EV_L2_REMOVED, ns,
                     keys, sizes, NULL, n);
}

/* ---- lookups ---- */

static void s_back(kvt_lookup_t *lk)
{
    atomic_store(&lk->stage, S_BACK);
    kvt_assert(kvt_queue_push(lk->done, lk, 1) == 0); /* bounded by what callers sent */
}

static void s_loaded(void *ctx, uint64_t job, uint32_t loaded)
{
    (void)job;
    kvt_lookup_t *lk = ctx;
    lk->loaded = loaded;
    s_back(lk);
}

/* The L2 part, on a lookup thread: the keys past the L1 prefix in L2, then their loads. */
static void s_lookup_l2(kvt_cache_t *self, kvt_lookup_t *lk)
{
    uint32_t rest = lk->n - lk->l1_hits;
    uint64_t *sizes = malloc(rest * sizeof *sizes);
    kvt_assert(sizes);
    const kvt_key_t *keys = lk->keys + lk->l1_hits;
    uint32_t in_l2 = kvt_l2mgr_lookup(self->l2, &lk->ns, keys, rest,
                                      kvt_now_ms() + self->cfg->l2_lookup_timeout_ms, sizes);
    lk->hits = lk->l1_hits + in_l2;
    atomic_fetch_add(&self->l2_lookups, 1);
    if (lk->prefetch && (in_l2 || !lk->until_loaded)) {
        lk->job = kvt_prefetch_start(self->prefetch, lk->hits, in_l2 == 0, kvt_now_ms());
        if (lk->job && in_l2) { /* no job: max_prefetch_jobs loads are running */
            bool wait = false;
            if (lk->until_loaded) {
                atomic_store(&lk->stage, S_LOADING);
                wait = kvt_prefetch_watch(self->prefetch, lk->job, s_loaded, lk) == 0;
            }
            kvt_l2mgr_prefetch(self->l2, lk->job, &lk->ns, keys, sizes, in_l2);
            if (wait) {
                free(sizes);
                return; /* s_loaded hands it back */
            }
        }
    }
    free(sizes);
    s_back(lk);
}

/* A lookup thread's job (freed by the thread that runs it). */
typedef struct {
    kvt_cache_t *cache;
    kvt_lookup_t *lk;
} s_job_t;

static void s_run(void *arg)
{
    s_job_t *j = arg;
    kvt_cache_t *self = j->cache;
    kvt_lookup_t *lk = j->lk;
    free(j);
    atomic_store(&lk->stage, S_PROBING);
    if (atomic_load(&self->stopping))
        s_back(lk); /* hits: the L1 prefix */
    else
        s_lookup_l2(self, lk);
}

bool kvt_cache_lookup(kvt_cache_t *self, kvt_lookup_t *lk)
{
    atomic_store(&lk->stage, S_AT_CALLER);
    lk->rc = 0;
    lk->err[0] = '\0';
    lk->lease = lk->job = 0;
    lk->l1_hits = lk->hits = lk->loaded = 0;
    uint32_t hits = 0;
    int rc =
        kvt_l1_lookup(self->l1, lk->owner, &lk->ns, lk->keys, lk->n, lk->lock, &hits, &lk->lease);
    if (rc) {
        lk->rc = rc;
        if (rc == KVT_ENOSPC) /* max_leased_bytes */
            kvt_l1_owner_limit_error(self->l1, lk->owner, lk->err, sizeof lk->err);
        return false;
    }
    lk->l1_hits = lk->hits = lk->loaded = hits;
    if (hits < lk->n && self->lookups && lk->done) {
        atomic_store(&lk->stage, S_QUEUED);
        s_job_t *j = malloc(sizeof *j);
        kvt_assert(j);
        *j = (s_job_t){self, lk};
        if (kvt_workers_submit(self->lookups, s_run, j) == 0)
            return true;
        free(j);
        atomic_fetch_add(&self->l2_refused, 1);
        if (lk->lease)
            kvt_l1_release(self->l1, lk->owner, lk->lease);
        lk->lease = 0;
        lk->rc = KVT_EBUSY;
        snprintf(lk->err, sizeof lk->err, "the L2 lookup queue is full, retry later");
        atomic_store(&lk->stage, S_AT_CALLER);
        return false;
    }
    if (lk->prefetch && !lk->until_loaded) /* a job done at once, for PREFETCH_STATUS */
        lk->job = kvt_prefetch_start(self->prefetch, hits, true, kvt_now_ms());
    return false;
}

bool kvt_cache_lookup_cancel(kvt_cache_t *self, kvt_lookup_t *lk)
{
    return atomic_load(&lk->stage) == S_LOADING && kvt_prefetch_unwatch(self->prefetch, lk->job);
}

/* ---- owners ---- */

int kvt_cache_owner_open(kvt_cache_t *self, kvt_owner_kind_t kind, uint64_t *owner, char *err,
                         size_t errlen)
{
    kvt_assert(kind >= KVT_OWNER_V1 && kind <= KVT_OWNER_LMCACHE_CLIENT);
    pthread_mutex_lock(&self->lock);
    size_t open = kvt_u64map_size(self->owners);
    if (open >= self->cfg->max_instances) {
        pthread_mutex_unlock(&self->lock);
        snprintf(err, errlen,
                 "the daemon serves max_instances (%u) clients (v1 instances and LMCache "
                 "workers together): retry later, or end unused ones",
                 self->cfg->max_instances);
        return KVT_EBUSY;
    }
    uint64_t id = self->next_owner++;
    kvt_u64map_set(self->owners, id, (void *)(uintptr_t)kind);
    self->nkind[kind]++;
    pthread_mutex_unlock(&self->lock);
    *owner = id;
    return 0;
}

uint64_t kvt_cache_owner_close(kvt_cache_t *self, uint64_t owner, bool expired)
{
    pthread_mutex_lock(&self->lock);
    uintptr_t kind = (uintptr_t)kvt_u64map_remove(self->owners, owner);
    if (kind)
        self->nkind[kind]--;
    int n = self->nlisteners;
    pthread_mutex_unlock(&self->lock);
    if (!kind)
        return 0;
    uint64_t released = kvt_l1_release_owner(self->l1, owner, expired);
    for (int i = 0; i < n; i++)
        self->listeners[i].fn(self->listeners[i].ctx, (kvt_owner_kind_t)kind, owner, expired);
    return released;
}

void kvt_cache_on_owner_gone(kvt_cache_t *self, kvt_owner_gone_fn fn, void *ctx)
{
    pthread_mutex_lock(&self->lock);
    kvt_assert(self->nlisteners < S_MAX_LISTENERS);
    self->listeners[self->nlisteners++] = (s_listener_t){fn, ctx};
    pthread_mutex_unlock(&self->lock);
}

uint32_t kvt_cache_owners(kvt_cache_t *self, int kind)
{
    pthread_mutex_lock(&self->lock);
    uint32_t n = kind >= KVT_OWNER_V1 && kind <= KVT_OWNER_LMCACHE_CLIENT
                     ? self->nkind[kind]
                     : (uint32_t)kvt_u64map_size(self->owners);
    pthread_mutex_unlock(&self->lock);
    return n;
}

uint64_t kvt_cache_owner_keepalive_ms(const kvt_cache_t *self, kvt_owner_kind_t kind)
{
    uint64_t lease = self->cfg->lease_ms;
    if (kind != KVT_OWNER_LMCACHE)
        return lease;
    uint64_t reap = (uint64_t)self->cfg->lmcache_reap_timeout_s * 1000;
    return reap == 0 ? UINT64_MAX : reap > lease ? reap : lease;
}

kvt_liveness_t kvt_cache_owner_liveness(const kvt_cache_t *self, kvt_owner_kind_t kind,
                                        uint64_t silent_ms)
{
    if (silent_ms > kvt_cache_owner_keepalive_ms(self, kind))
        return KVT_OWNER_EXPIRED;
    return silent_ms > self->cfg->lease_ms ? KVT_OWNER_LEASES_VOID : KVT_OWNER_ALIVE;
}

/* ---- life cycle ---- */

kvt_cache_t *kvt_cache_new(const kvt_config_t *cfg, kvt_sup_t *sup, int *code, char *err,
                           size_t errlen)
{
    *code = KVT_EINTERNAL;
    kvt_cache_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->cfg = cfg;
    self->sup = sup;
    pthread_mutex_init(&self->lock, NULL);
    self->owners = kvt_u64map_new();
    self->next_owner = 1;
    if (cfg->event_log_size)
        self->evlog = kvt_evlog_new(cfg->event_log_size, S_EVLOG_BYTES);
    self->l1 = kvt_l1_new(cfg, err, errlen);
    if (!self->l1)
        goto fail;
    self->prefetch = kvt_prefetch_new(60000, cfg->max_prefetch_jobs);
    self->l2 = kvt_l2mgr_new(cfg, self->l1, self->prefetch, sup, code, err, errlen);
    if (!self->l2)
        goto fail;
    kvt_l2mgr_set_events(self->l2, s_on_l2, self);
    kvt_l1_set_listener(self->l1, s_on_l1, self);
    /* a probe may take l2_lookup_timeout_ms, and one adapter call past it */
    if (kvt_l2mgr_count(self->l2) && !(self->lookups = kvt_workers_new_detached(
                                           "lookup", (int)cfg->l2_lookup_threads, S_QUEUE,
                                           10000 + cfg->l2_lookup_timeout_ms, sup, err, errlen)))
        goto fail;
    *code = 0;
    return self;
fail:
    kvt_cache_stop(self);
    kvt_cache_destroy(&self);
    return NULL;
}

int kvt_cache_start(kvt_cache_t *self)
{
    return kvt_l1_start(self->l1, self->sup) == 0 ? 0 : KVT_EINTERNAL;
}

void kvt_cache_quiesce(kvt_cache_t *self)
{
    if (self)
        atomic_store(&self->stopping, true);
}

void kvt_cache_stop(kvt_cache_t *self)
{
    if (!self)
        return;
    atomic_store(&self->stopping, true);
    kvt_workers_destroy(&self->lookups); /* what is queued comes back first, unprobed */
    if (self->l1)
        kvt_l1_stop(self->l1); /* no evictions (and their events) from here on */
    /* queued write-behind reaches L2; running loads end, their watchers told */
    kvt_l2mgr_destroy(&self->l2);
}

void kvt_cache_destroy(kvt_cache_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_cache_t *self = *self_p;
    kvt_assert(!self->l2 && !self->lookups); /* kvt_cache_stop ran */
    kvt_prefetch_destroy(&self->prefetch);
    if (self->l1)
        kvt_l1_set_listener(self->l1, NULL, NULL);
    kvt_l1_destroy(&self->l1);
    kvt_evlog_destroy(&self->evlog); /* after L1's last event */
    kvt_u64map_destroy(&self->owners);
    pthread_mutex_destroy(&self->lock);
    free(self);
    *self_p = NULL;
}

kvt_l1_t *kvt_cache_l1(kvt_cache_t *self)
{
    return self->l1;
}

kvt_l2mgr_t *kvt_cache_l2(kvt_cache_t *self)
{
    return self->l2;
}

kvt_prefetch_t *kvt_cache_prefetch(kvt_cache_t *self)
{
    return self->prefetch;
}

kvt_evlog_t *kvt_cache_evlog(kvt_cache_t *self)
{
    return self->evlog;
}

void kvt_cache_metrics_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    kvt_cache_t *self = ctx;
    static const char *const kinds[] = {[KVT_OWNER_V1] = "v1",
                                        [KVT_OWNER_LMCACHE] = "lmcache",
                                        [KVT_OWNER_LMCACHE_CLIENT] = "lmcache_client"};
    for (int k = KVT_OWNER_V1; k <= KVT_OWNER_LMCACHE_CLIENT; k++) {
        kvt_sample_t s = {.name = "owners",
                          .help = "Open lease owners, by door (max_instances counts them all).",
                          .kind = KVT_METRIC_GAUGE,
                          .label = "kind",
                          .label_value = kinds[k],
                          .value = kvt_cache_owners(self, k)};
        emit(emit_ctx, &s);
    }
    kvt_sample_t l = {.name = "lookup_l2_total",
                      .help = "Lookups (either door) whose L2 part ran on the lookup threads.",
                      .kind = KVT_METRIC_COUNTER,
                      .value = (double)atomic_load(&self->l2_lookups)};
    emit(emit_ctx, &l);
    kvt_sample_t r = {.name = "lookup_l2_refused_total",
                      .help = "Lookups answered busy: the lookup threads' queue was full.",
                      .kind = KVT_METRIC_COUNTER,
                      .value = (double)atomic_load(&self->l2_refused)};
    emit(emit_ctx, &r);
    kvt_sample_t q = {.name = "lookup_l2_queued",
                      .help = "Lookups waiting for or running on a lookup thread.",
                      .kind = KVT_METRIC_GAUGE,
                      .value = self->lookups ? (double)kvt_workers_pending(self->lookups) : 0};
    emit(emit_ctx, &q);
    if (self->evlog) {
        kvt_sample_t e = {.name = "event_log_records_total",
                          .help = "Records the event log took (L1 and L2 changes): its newest "
                                  "sequence number.",
                          .kind = KVT_METRIC_COUNTER,
                          .value = (double)kvt_evlog_span(self->evlog).last};
        emit(emit_ctx, &e);
    }
}
