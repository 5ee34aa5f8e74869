/* DESIGN: one s_adapter_t per configured spec, each with l2_write_threads writers (at most the
 * adapter's max_threads): supervised threads, each with its own kvt_queue of write-behind jobs
 * (store or remove, one namespace and a batch of keys each, weighed by their keys). A key always
 * goes to the same writer (by its hash), so a REMOVE right after a PUT of one key is never
 * overtaken by the PUT's write, while different keys are written side by side — what keeps a
 * disk's queue busy. Whichever writer sees it due probes the backend's health (every second).
 *
 * Durability in groups: a writer keeps the objects it has written and runs the adapter's flush
 * (ABI 3: fs sync=batch is one syncfs) once its queue is empty or it holds S_FLUSH_BYTES /
 * S_FLUSH_JOBS; only then are they reported (l2_stored) and evictable. A writer that keeps up
 * flushes after every job; one that falls behind flushes less often: group commit.
 * Prefetch loads go to one manager-wide kvt_queue served by l2_prefetch_threads threads. Stop
 * closes every queue: adapter threads still run the jobs queued before it, prefetch threads
 * abandon theirs (each job is still reported done).
 * Lookups are synchronous on the caller's thread. Adapter operations are thread-safe by the
 * contract of kvt_l2.h, so the three kinds of callers may use one adapter at once.
 *
 * A store job pins each object in L1 (a daemon read lease) for the time of the write, so the
 * bytes cannot be reused under it; whatever the outcome, the object is then reported written
 * (kvt_l1_l2_written) so that it becomes evictable. Lock order: an adapter's lock and the
 * prefetch lock are leaves; L1 is called without them.
 *
 * Integrity (kvt_l2_trailer.h): every object goes to L2 as payload + trailer, the payload's
 * XXH3-64 computed once per write on the adapter thread; every load is checked (trailer, length,
 * name, checksum) before its L1 slot is committed. A corrupt object is a miss: counted
 * (kvtier_l2_corrupt_total), logged once (it is removed from that adapter at once, so it is not
 * seen again), announced as l2_removed, and the next adapter is asked. An object in a newer
 * format is a miss left in place (a newer daemon sharing the backend wrote it). */
#include "kvt_l2mgr.h"

#include "kvt_alloc.h"
#include "kvt_error.h"
#include "kvt_l2.h"
#include "kvt_l2_name.h"
#include "kvt_l2_plugin.h"
#include "kvt_l2_trailer.h"
#include "kvt_log.h"
#include "kvt_queue.h"
#include "kvt_thread.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

#define S_MAX_ADAPTERS 8
#define S_WRITERS_MAX 16 /* the most l2_write_threads allows */
#define S_FLUSH_BYTES (256ull << 20)
#define S_FLUSH_JOBS 256
#define S_PREFETCH_THREADS 64 /* the most l2_prefetch_threads allows */
#define S_QUEUE_KEYS 65536    /* write-behind keys waiting per adapter (all writers) before drops */
#define S_TICK_MS 1000       /* health probe period */
#define S_STORE_DEADLINE_MS 60000
#define S_DRAIN_MS 5000
#define S_RETRIES 3

typedef enum { S_STORE, S_REMOVE, S_LOAD } s_kind_t;

/* The parts of one prefetch: the last part to finish ends the prefetch job. */
typedef struct {
    _Atomic uint32_t left;
} s_parts_t;

typedef struct s_job {
    s_kind_t kind;
    s_parts_t *parts; /* load: shared by the parts of one prefetch (the last frees it) */
    uint64_t deadline_ms;
    uint64_t prefetch_job;
    struct s_job *next; /* a writer's written, not yet flushed jobs */
    uint64_t ok_bytes;  /* store: bytes of keys[0..nok) */
    uint32_t nok;       /* store: keys[0..nok) written, waiting for the flush */
    uint32_t n;
    kvt_ns_t ns;     /* views bytes */
    kvt_key_t *keys; /* in bytes */
    uint64_t *sizes; /* loads: the sizes to load; stores: of keys[0..nok); in bytes */
    uint8_t bytes[];
} s_job_t;

struct s_adapter;

typedef struct {
    struct s_adapter *a;
    int index;
} s_writer_t;

typedef struct s_adapter {
    struct kvt_l2mgr *mgr;
    int index;
    char label[256]; /* the spec, as configured */
    const kvt_l2_ops_t *ops;
    void *state;
    void *plugin; /* dlopen handle of a plugin adapter */
    pthread_mutex_t lock;
    /* writer i's jobs; weight: keys; a job is task_done once flushed (the drain waits) */
    kvt_queue_t *queues[S_WRITERS_MAX];
    kvt_thread_t *threads[S_WRITERS_MAX];
    s_writer_t writers[S_WRITERS_MAX];
    int nthreads;
    uint64_t next_probe_ms; /* under lock */
    _Atomic bool healthy;
    /* Errors for /status, under lock. last_error is current: once the adapter is healthy again
     * (the probe answers after failing, or, for an error of one operation, an operation has
     * succeeded since) it moves to past_error, so an operator is not shown a cured outage. */
    char last_error[256];
    double last_error_at; /* wall-clock seconds, 0 when last_error is "" */
    bool error_from_op;   /* last_error came from an operation, not from the health probe */
    char past_error[256];
    double past_error_at, recovered_at;
    _Atomic uint64_t ok_ms; /* wall-clock ms of the last store, load or remove that succeeded */
    _Atomic uint64_t stored, loaded, removed, errors, dropped, bytes_stored, bytes_loaded;
    _Atomic uint64_t corrupt, flushes;
    kvt_hist_t latency;
    kvt_errrep_t rep;
} s_adapter_t;

struct kvt_l2mgr {
    const kvt_config_t *cfg;
    kvt_l1_t *l1;
    kvt_prefetch_t *prefetch;
    s_adapter_t adapters[S_MAX_ADAPTERS];
    uint32_t nadapters;
    _Atomic bool stop;
    kvt_l2_event_fn on_event;
    void *event_ctx;
    /* prefetch loads: at most max_prefetch_jobs, as LOOKUP starts no job past that */
    kvt_queue_t *loads;
    kvt_thread_t *pthreads[S_PREFETCH_THREADS];
    int npthreads;
};

static uint64_t s_inc(_Atomic uint64_t *v, uint64_t n)
{
    return atomic_fetch_add_explicit(v, n, memory_order_relaxed) + n;
}

static uint64_t s_get(_Atomic uint64_t *v)
{
    return atomic_load_explicit(v, memory_order_relaxed);
}

static void s_sleep_ms(uint64_t ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- jobs ---- */

static s_job_t *s_job_new(s_kind_t kind, const kvt_ns_t *ns, const kvt_key_t *keys,
                          const uint64_t *sizes, uint32_t n)
{
    bool with_sizes = sizes || kind == S_STORE;
    size_t extra = kvt_ns_size(ns) + (size_t)n * sizeof *keys +
                   (with_sizes ? (size_t)n * sizeof(uint64_t) : 0) + sizeof(uint64_t);
    s_job_t *j = calloc(1, sizeof *j + extra);
    kvt_assert(j);
    j->kind = kind;
    j->n = n;
    uint8_t *p = j->bytes;
    if (with_sizes) { /* first, for alignment */
        j->sizes = (uint64_t *)(void *)p;
        if (sizes)
            memcpy(j->sizes, sizes, (size_t)n * sizeof(uint64_t));
        p += (size_t)n * sizeof(uint64_t);
    }
    j->keys = (kvt_key_t *)(void *)p; /* kvt_key_t is bytes: any alignment */
    memcpy(j->keys, keys, (size_t)n * sizeof *keys);
    p += (size_t)n * sizeof *keys;
    j->ns = kvt_ns_copy(ns, p);
    return j;
}

/* Every key of a store job that will not be written is still reported, so it can be evicted. */
static void s_give_up(kvt_l2mgr_t *m, const s_job_t *j)
{
    for (uint32_t i = 0; i < j->n; i++)
        kvt_l1_l2_written(m->l1, &j->ns, &j->keys[i]);
}

static void s_event(kvt_l2mgr_t *m, const char *event, const kvt_ns_t *ns,
                    const kvt_key_t *keys, const uint64_t *sizes, uint32_t n,
                    const s_adapter_t *a)
{
    if (m->on_event && n)
        m->on_event(m->event_ctx, event, ns, keys, sizes, n, a->label);
}

static void s_note_ok(s_adapter_t *a)
{
    atomic_store_explicit(&a->ok_ms, (uint64_t)(kvt_wall_s() * 1000.0), memory_order_relaxed);
}

/* Lock held. */
static void s_set_error_locked(s_adapter_t *a, bool from_op)
{
    a->last_error_at = kvt_wall_s();
    a->error_from_op = from_op;
}

static void s_note_error(s_adapter_t *a, int rc, const char *op, const char *name)
{
    s_inc(&a->errors, 1);
    pthread_mutex_lock(&a->lock);
    snprintf(a->last_error, sizeof a->last_error, "%s %s: %s", op, name, kvt_strerror(rc));
    s_set_error_locked(a, true);
    pthread_mutex_unlock(&a->lock);
    /* health is the probe's call (every second): one failed call must not flap /readyz */
    kvt_errrep_report(&a->rep, KVT_LOG_WARN, "l2 %s: %s %s failed: %s", a->label, op, name,
                      kvt_strerror(rc));
}

static void s_probe(s_adapter_t *a);

/* ---- integrity ---- */

/* A corrupt object: counted, logged, removed from this adapter and announced as l2_removed.
 * One log line per object: once removed it is not found again. */
static void s_corrupt(s_adapter_t *a, const kvt_ns_t *ns, const kvt_key_t *key,
                      const char *name, const char *why)
{
    s_inc(&a->corrupt, 1);
    int rc = a->ops->remove(a->state, name);
    kvt_log(KVT_LOG_WARN, "l2 %s: object %s is corrupt (%s): not served, %s", a->label, name, why,
            rc == 0 || rc == KVT_ENOTFOUND ? "removed" : "and could not be removed");
    if (rc == 0) {
        s_inc(&a->removed, 1);
        s_event(a->mgr, "l2_removed", ns, key, NULL, 1, a);
    } else if (rc != KVT_ENOTFOUND) {
        s_note_error(a, rc, "remove", name);
    }
}

/* Stores payload + trailer: vectored (ABI 2: the payload straight from the arena), or joined in
 * a bounce buffer for an ABI 1 plugin. */
static int s_write_obj(s_adapter_t *a, const char *name, const uint8_t *payload, size_t len,
                       const uint8_t trailer[KVT_L2_TRAILER_LEN])
{
    if (a->ops->storev) {
        struct iovec iov[2] = {{(void *)payload, len}, {(void *)trailer, KVT_L2_TRAILER_LEN}};
        return a->ops->storev(a->state, name, iov, 2);
    }
    uint8_t *buf = malloc(len + KVT_L2_TRAILER_LEN); /* large: fails softly (STYLE 4) */
    if (!buf)
        return KVT_ENOMEM;
    memcpy(buf, payload, len);
    memcpy(buf + len, trailer, KVT_L2_TRAILER_LEN);
    int rc = a->ops->store(a->state, name, buf, len + KVT_L2_TRAILER_LEN);
    free(buf);
    return rc;
}

/* Reads payload (len bytes, into dst: an L1 block of cap bytes) + trailer; *got is the
 * object's size. ABI 2: vectored, in place. ABI 1: in place when the block has room for the
 * trailer after the payload, else through an aligned bounce buffer (the ABI 1 load contract:
 * a 4 KiB-aligned buffer of whole pages). */
static int s_read_obj(s_adapter_t *a, const char *name, uint8_t *dst, size_t len, size_t cap,
                      uint8_t trailer[KVT_L2_TRAILER_LEN], size_t *got)
{
    size_t want = len + KVT_L2_TRAILER_LEN;
    if (a->ops->loadv) {
        struct iovec iov[2] = {{dst, len}, {trailer, KVT_L2_TRAILER_LEN}};
        return a->ops->loadv(a->state, name, iov, 2, got);
    }
    if (cap >= want) {
        int rc = a->ops->load(a->state, name, dst, cap, got);
        if (rc == 0 && *got == want)
            memcpy(trailer, dst + len, KVT_L2_TRAILER_LEN);
        return rc;
    }
    size_t bcap = (want + KVT_PAGE - 1) / KVT_PAGE * KVT_PAGE;
    uint8_t *buf = aligned_alloc(KVT_PAGE, bcap);
    if (!buf)
        return KVT_ENOMEM;
    int rc = a->ops->load(a->state, name, buf, bcap, got);
    if (rc == 0 && *got == want) {
        memcpy(dst, buf, len);
        memcpy(trailer, buf + len, KVT_L2_TRAILER_LEN);
    }
    free(buf);
    return rc;
}

/* ---- write-behind (adapter threads) ---- */

/* Writes a store job's objects. Those written stay waiting (keys[0..nok)) for the writer's
 * next flush; the others — removed since, damaged, or failed — are done with at once. */
static void s_do_store(s_adapter_t *a, s_job_t *j)
{
    kvt_l2mgr_t *m = a->mgr;
    const kvt_ns_t *ns = &j->ns;
    uint8_t *base = kvt_l1_base(m->l1);
    j->nok = 0;
    j->ok_bytes = 0;
    for (uint32_t i = 0; i < j->n; i++) {
        kvt_slot_t slot;
        uint32_t got = 0;
        uint64_t lease = 0;
        kvt_l1_acquire(m->l1, KVT_OWNER_DAEMON, ns, &j->keys[i], 1, &slot, &got, &lease);
        if (got == 0) { /* removed (or evicted past l2_backlog_max) since: nothing to write */
            kvt_l1_l2_written(m->l1, ns, &j->keys[i]);
            continue;
        }
        char name[KVT_L2_NAME_LEN];
        kvt_l2_name(ns, &j->keys[i], name);
        const uint8_t *payload = base + slot.offset;
        uint64_t sum = XXH3_64bits(payload, slot.length); /* once: trailer and L1 check */
        if (kvt_l1_check_sum(m->l1, KVT_OWNER_DAEMON, lease, 0, sum) != 0) {
            /* damaged after its COMMIT (l1_checksum): L1 dropped it, L2 must not get it */
            kvt_l1_release(m->l1, KVT_OWNER_DAEMON, lease);
            continue;
        }
        uint8_t trailer[KVT_L2_TRAILER_LEN];
        kvt_l2_trailer_make(trailer, name, slot.length, sum);
        int rc = atomic_load(&a->healthy) ? KVT_ETIMEDOUT : KVT_EUNAVAIL;
        for (int attempt = 0; attempt < S_RETRIES && atomic_load(&a->healthy); attempt++) {
            if (kvt_now_ms() > j->deadline_ms)
                break;
            uint64_t t0 = kvt_now_ns();
            rc = s_write_obj(a, name, payload, slot.length, trailer);
            kvt_hist_observe(&a->latency, kvt_now_ns() - t0);
            if (rc == 0 || rc == KVT_ENOSPC)
                break; /* done, or retrying cannot help */
            /* a failure is a good moment to ask the backend how it is: a dead one is not
             * retried (and /readyz learns it now, not at the next tick) */
            s_probe(a);
            if (!atomic_load(&a->healthy))
                break;
            s_sleep_ms(50u << (2 * attempt)); /* 50, 200 ms */
        }
        /* the bytes are the adapter's now; the object stays unevictable until the flush */
        kvt_l1_release(m->l1, KVT_OWNER_DAEMON, lease);
        if (rc == 0) {
            j->sizes[j->nok] = slot.length;
            j->keys[j->nok++] = j->keys[i]; /* nok <= i: compacts in place */
            j->ok_bytes += slot.length;
        } else {
            kvt_l1_l2_written(m->l1, ns, &j->keys[i]);
            s_note_error(a, rc, "store", name);
        }
    }
}

/* Flushes the adapter for the written jobs in `held`, then reports them: l2_stored when the
 * flush succeeded, errors when not; either way they become evictable. Frees the list. */
static void s_flush_held(s_adapter_t *a, s_job_t *held, bool report)
{
    if (!held)
        return;
    kvt_l2mgr_t *m = a->mgr;
    int rc = 0;
    if (report && a->ops->flush) {
        uint64_t t0 = kvt_now_ns();
        rc = a->ops->flush(a->state);
        kvt_hist_observe(&a->latency, kvt_now_ns() - t0);
        s_inc(&a->flushes, 1);
    }
    for (s_job_t *j = held, *next; j; j = next) {
        next = j->next;
        for (uint32_t i = 0; i < j->nok; i++)
            kvt_l1_l2_written(m->l1, &j->ns, &j->keys[i]);
        if (report && rc == 0 && j->nok) {
            s_note_ok(a);
            s_inc(&a->stored, j->nok);
            s_inc(&a->bytes_stored, j->ok_bytes);
            s_event(m, "l2_stored", &j->ns, j->keys, j->sizes, j->nok, a);
        } else if (report && j->nok) {
            char what[64];
            snprintf(what, sizeof what, "%u objects", j->nok);
            s_inc(&a->errors, j->nok - 1); /* s_note_error counts one */
            s_note_error(a, rc, "flush", what);
        }
        free(j);
    }
}

static void s_do_remove(s_adapter_t *a, s_job_t *j)
{
    kvt_key_t *done = malloc((size_t)j->n * sizeof *done);
    kvt_assert(done);
    uint32_t ndone = 0;
    for (uint32_t i = 0; i < j->n && !atomic_load(&a->mgr->stop); i++) {
        char name[KVT_L2_NAME_LEN];
        kvt_l2_name(&j->ns, &j->keys[i], name);
        int rc = a->ops->remove(a->state, name);
        if (rc == 0) {
            s_note_ok(a);
            s_inc(&a->removed, 1);
            done[ndone++] = j->keys[i];
        } else if (rc != KVT_ENOTFOUND) {
            s_note_error(a, rc, "remove", name);
        }
    }
    s_event(a->mgr, "l2_removed", &j->ns, done, NULL, ndone, a);
    free(done);
}

static void s_probe(s_adapter_t *a)
{
    char why[200] = "";
    int rc = a->ops->health(a->state, why, sizeof why);
    bool was = atomic_exchange(&a->healthy, rc == 0);
    pthread_mutex_lock(&a->lock);
    /* an operation's error is cured by a later success of an operation, a probe's by a probe */
    bool op_ok_since =
        a->error_from_op && (double)atomic_load(&a->ok_ms) >= a->last_error_at * 1000.0;
    if (rc) {
        snprintf(a->last_error, sizeof a->last_error, "%s", why[0] ? why : kvt_strerror(rc));
        s_set_error_locked(a, false);
    } else if (a->last_error[0] && (!was || op_ok_since)) {
        /* healthy again: the error is history, kept with its times for /status */
        snprintf(a->past_error, sizeof a->past_error, "%s", a->last_error);
        a->past_error_at = a->last_error_at;
        a->recovered_at = kvt_wall_s();
        a->last_error[0] = '\0';
        a->last_error_at = 0;
    }
    pthread_mutex_unlock(&a->lock);
    if (rc && was)
        kvt_log(KVT_LOG_ERROR, "l2 %s: unhealthy: %s", a->label, why);
    else if (!rc && !was)
        kvt_log(KVT_LOG_WARN, "l2 %s: healthy again", a->label);
}

/* The health probe is due (every S_TICK_MS, whichever of the adapter's threads sees it). */
static bool s_probe_due(s_adapter_t *a)
{
    uint64_t now = kvt_now_ms();
    pthread_mutex_lock(&a->lock);
    bool due = now >= a->next_probe_ms;
    if (due)
        a->next_probe_ms = now + S_TICK_MS;
    pthread_mutex_unlock(&a->lock);
    return due;
}

/* Gives up the written jobs in `held` without reporting them (the writer is told to stop). */
static void s_drop_held(s_adapter_t *a, s_job_t *held)
{
    s_flush_held(a, held, false);
}

static bool s_writer_run(kvt_thread_t *t, void *arg)
{
    s_writer_t *w = arg;
    s_adapter_t *a = w->a;
    kvt_l2mgr_t *m = a->mgr;
    kvt_queue_t *q = a->queues[w->index];
    s_job_t *held = NULL, **tail = &held;
    size_t nheld = 0;
    uint64_t held_bytes = 0;
    for (;;) {
        s_job_t *j = NULL;
        if (kvt_queue_pop(q, (void **)&j, kvt_thread_idle_ms(t)) == KVT_EUNAVAIL)
            return true; /* closed, and what was queued before is done (held is empty) */
        bool probe = s_probe_due(a);
        if (!kvt_thread_beat(t)) {
            if (j)
                s_give_up(m, j);
            free(j); /* not task_done: the stop's drain waits for it until its deadline */
            s_drop_held(a, held);
            return false;
        }
        if (probe)
            s_probe(a);
        if (!j)
            continue;
        if (j->kind == S_STORE && !atomic_load(&a->healthy)) {
            /* fail fast: the backend is down, the objects must not wait in L1 for it */
            s_inc(&a->errors, j->n);
            s_give_up(m, j);
            free(j);
            kvt_queue_task_done(q, 1);
        } else if (j->kind == S_STORE) {
            s_do_store(a, j);
            held_bytes += j->ok_bytes;
            *tail = j;
            tail = &j->next;
            nheld++;
        } else {
            s_do_remove(a, j);
            free(j);
            kvt_queue_task_done(q, 1);
        }
        if (nheld &&
            (kvt_queue_depth(q) == 0 || held_bytes >= S_FLUSH_BYTES || nheld >= S_FLUSH_JOBS)) {
            s_flush_held(a, held, true);
            kvt_queue_task_done(q, nheld);
            held = NULL;
            tail = &held;
            nheld = 0;
            held_bytes = 0;
        }
    }
}

/* A job the full queue pushed out: the oldest writes go, never the caller's time. */
static void s_displaced(void *ctx, void *item)
{
    s_adapter_t *a = ctx;
    s_job_t *j = item;
    if (j->kind == S_STORE) {
        s_inc(&a->dropped, j->n);
        s_give_up(a->mgr, j);
        kvt_errrep_report(&a->rep, KVT_LOG_WARN,
                          "l2 %s: write-behind queue full: dropped %u oldest writes", a->label,
                          j->n);
    }
    free(j);
}

static void s_enqueue(s_adapter_t *a, int writer, s_job_t *j)
{
    if (kvt_queue_push_displace(a->queues[writer], j, j->n, s_displaced, a) != 0) {
        /* stopping: the threads take no more work; the objects need not wait for L2 */
        if (j->kind == S_STORE)
            s_give_up(a->mgr, j);
        free(j);
    }
}

/* Queues keys[0..n) to every adapter, each key to its writer (by its hash): one job per writer
 * that gets keys. */
static void s_submit(kvt_l2mgr_t *self, s_kind_t kind, const kvt_ns_t *ns, const kvt_key_t *keys,
                     uint32_t n)
{
    uint8_t *writer = NULL;
    kvt_key_t *part = NULL;
    for (uint32_t i = 0; i < self->nadapters; i++) {
        s_adapter_t *a = &self->adapters[i];
        if (a->nthreads <= 1) {
            s_job_t *j = s_job_new(kind, ns, keys, NULL, n);
            j->deadline_ms = kvt_now_ms() + S_STORE_DEADLINE_MS;
            s_enqueue(a, 0, j);
            continue;
        }
        if (!writer) {
            writer = malloc(n);
            part = malloc((size_t)n * sizeof *part);
            kvt_assert(writer && part);
            for (uint32_t k = 0; k < n; k++)
                writer[k] = (uint8_t)(XXH3_64bits(keys[k].b, sizeof keys[k].b) % S_WRITERS_MAX);
        }
        for (int w = 0; w < a->nthreads; w++) {
            uint32_t np = 0;
            for (uint32_t k = 0; k < n; k++)
                if (writer[k] % a->nthreads == w)
                    part[np++] = keys[k];
            if (!np)
                continue;
            s_job_t *j = s_job_new(kind, ns, part, NULL, np);
            j->deadline_ms = kvt_now_ms() + S_STORE_DEADLINE_MS;
            s_enqueue(a, w, j);
        }
    }
    free(writer);
    free(part);
}

void kvt_l2mgr_on_stored(kvt_l2mgr_t *self, const kvt_ns_t *ns, const kvt_key_t *keys, uint32_t n)
{
    if (self && n)
        s_submit(self, S_STORE, ns, keys, n);
}

void kvt_l2mgr_remove(kvt_l2mgr_t *self, const kvt_ns_t *ns, const kvt_key_t *keys,
                      uint32_t n)
{
    if (self && n)
        s_submit(self, S_REMOVE, ns, keys, n);
}

/* ---- lookup (caller's thread) ---- */

uint32_t kvt_l2mgr_lookup(kvt_l2mgr_t *self, const kvt_ns_t *ns, const kvt_key_t *keys,
                          uint32_t n, uint64_t deadline_ms, uint64_t *sizes)
{
    uint32_t k = 0;
    for (; self && k < n && kvt_now_ms() < deadline_ms; k++) {
        char name[KVT_L2_NAME_LEN];
        kvt_l2_name(ns, &keys[k], name);
        bool found = false;
        for (uint32_t i = 0; i < self->nadapters && !found; i++) {
            s_adapter_t *a = &self->adapters[i];
            if (!atomic_load(&a->healthy))
                continue;
            size_t len = 0;
            int rc = a->ops->lookup(a->state, name, &len);
            if (rc == 0 && len > KVT_L2_TRAILER_LEN) {
                sizes[k] = len - KVT_L2_TRAILER_LEN; /* what the load will put in L1 */
                found = true;
            } else if (rc == 0) {
                s_corrupt(a, ns, &keys[k], name, kvt_l2_verdict_str(KVT_L2_V_SHORT));
            } else if (rc != KVT_ENOTFOUND) {
                s_note_error(a, rc, "lookup", name);
            }
        }
        if (!found)
            break;
    }
    return k;
}

/* ---- prefetch (manager threads) ---- */

/* Checks what s_read_obj read: the trailer, then the payload's checksum. */
static kvt_l2_verdict_t s_verify(const char *name, const uint8_t *payload, size_t len,
                                 const uint8_t trailer[KVT_L2_TRAILER_LEN], size_t got,
                                 uint64_t *sum)
{
    if (got != len + KVT_L2_TRAILER_LEN) /* not the size the lookup saw: torn or truncated */
        return got < KVT_L2_TRAILER_LEN ? KVT_L2_V_SHORT : KVT_L2_V_LENGTH;
    kvt_l2_verdict_t v = kvt_l2_trailer_check(trailer, name, got, sum);
    if (v == KVT_L2_V_OK && XXH3_64bits(payload, len) != *sum)
        v = KVT_L2_V_CHECKSUM;
    return v;
}

/* Loads one key into its reserved slot from the first adapter that has it intact; *sum is the
 * payload's XXH3-64 (checked). A corrupt copy is a miss in its adapter (and removed there). */
static int s_load_one(kvt_l2mgr_t *m, const s_job_t *j, uint32_t i, const kvt_slot_t *slot,
                      uint64_t *sum)
{
    char name[KVT_L2_NAME_LEN];
    kvt_l2_name(&j->ns, &j->keys[i], name);
    uint8_t *dst = (uint8_t *)kvt_l1_base(m->l1) + slot->offset;
    size_t cap = (slot->length + KVT_PAGE - 1) / KVT_PAGE * KVT_PAGE; /* the block is page-sized */
    int rc = KVT_ENOTFOUND;
    for (uint32_t a_i = 0; a_i < m->nadapters; a_i++) {
        s_adapter_t *a = &m->adapters[a_i];
        if (!atomic_load(&a->healthy))
            continue;
        uint8_t trailer[KVT_L2_TRAILER_LEN];
        size_t got = 0;
        uint64_t t0 = kvt_now_ns();
        rc = s_read_obj(a, name, dst, slot->length, cap, trailer, &got);
        kvt_hist_observe(&a->latency, kvt_now_ns() - t0);
        if (rc == KVT_ENOTFOUND)
            continue;
        if (rc != 0 && rc != KVT_ENOSPC) { /* the backend failed, not the object */
            s_note_error(a, rc, "load", name);
            continue;
        }
        s_note_ok(a);
        kvt_l2_verdict_t v = s_verify(name, dst, slot->length, trailer, rc ? SIZE_MAX : got, sum);
        if (v == KVT_L2_V_OK) {
            s_inc(&a->loaded, 1);
            s_inc(&a->bytes_loaded, slot->length);
            return 0;
        }
        rc = KVT_ENOTFOUND;
        if (v == KVT_L2_V_NEWER)
            kvt_errrep_report(&a->rep, KVT_LOG_WARN,
                              "l2 %s: object %s is %s: skipped, left for the daemon that wrote it",
                              a->label, name, kvt_l2_verdict_str(v));
        else
            s_corrupt(a, &j->ns, &j->keys[i], name, kvt_l2_verdict_str(v));
    }
    return rc;
}

/* One load job on its way into L1 (kvt_l1_write's context). */
typedef struct {
    kvt_l2mgr_t *m;
    const s_job_t *j;
} s_load_t;

/* A load's fill: each new object from L2; a key that cannot be loaded (or comes too late) is
 * failed alone. */
static int s_load_fill(void *ctx, uint8_t *base, const kvt_slot_t *slots, uint32_t n,
                       uint64_t *failed, uint32_t *nfailed, uint64_t *sums, char *err,
                       size_t errlen)
{
    const s_load_t *ld = ctx;
    (void)base, (void)err, (void)errlen;
    for (uint32_t i = 0; i < n; i++) {
        if (slots[i].length == 0)
            continue; /* already in L1 (stored meanwhile) */
        if (atomic_load(&ld->m->stop) || kvt_now_ms() > ld->j->deadline_ms ||
            s_load_one(ld->m, ld->j, i, &slots[i], &sums[i]) != 0)
            failed[(*nfailed)++] = i;
    }
    return 0;
}

/* One part of a prefetch is over (loaded or abandoned): the last one ends the job. */
static void s_load_done(kvt_l2mgr_t *m, s_job_t *j, uint32_t loaded)
{
    bool last = !j->parts || atomic_fetch_sub(&j->parts->left, 1) == 1;
    kvt_prefetch_update(m->prefetch, j->prefetch_job, loaded, last, kvt_now_ms());
    if (last)
        free(j->parts);
    j->parts = NULL;
}

static void s_do_load(kvt_l2mgr_t *m, s_job_t *j)
{
    uint32_t stored = 0, present = 0;
    char err[160];
    s_load_t ld = {m, j};
    kvt_l1_write(m->l1, &j->ns, j->keys, NULL, j->n, j->sizes, 0, true, s_load_fill, &ld,
                 &stored, &present, err, sizeof err);
    s_load_done(m, j, stored + present);
}

static bool s_prefetch_run(kvt_thread_t *t, void *arg)
{
    kvt_l2mgr_t *m = arg;
    for (;;) {
        s_job_t *j = NULL;
        if (kvt_queue_pop(m->loads, (void **)&j, kvt_thread_idle_ms(t)) == KVT_EUNAVAIL)
            return true;
        bool go_on = kvt_thread_beat(t);
        if (j) {
            if (go_on && !atomic_load(&m->stop))
                s_do_load(m, j);
            else
                s_load_done(m, j, 0);
            free(j);
            kvt_queue_task_done(m->loads, 1);
        }
        if (!go_on)
            return false;
    }
}

/* Loads of one prefetch are split into parts of about equal bytes, one per prefetch thread, at
 * least S_PART_BYTES each: one thread reads at queue depth 1, a disk wants more. */
#define S_PART_BYTES (1ull << 20)

void kvt_l2mgr_prefetch(kvt_l2mgr_t *self, uint64_t job, const kvt_ns_t *ns,
                        const kvt_key_t *keys, const uint64_t *sizes, uint32_t n)
{
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++)
        total += sizes[i];
    uint64_t nparts = total / S_PART_BYTES;
    if (nparts > (uint64_t)self->npthreads)
        nparts = (uint64_t)self->npthreads;
    if (nparts > n)
        nparts = n;
    if (nparts < 1)
        nparts = 1;
    s_parts_t *parts = NULL;
    if (nparts > 1) {
        parts = malloc(sizeof *parts);
        kvt_assert(parts);
        atomic_init(&parts->left, (uint32_t)nparts);
    }
    uint64_t deadline = kvt_now_ms() + self->cfg->lease_ms, share = total / nparts, acc = 0;
    uint32_t from = 0;
    for (uint64_t p = 0; p < nparts; p++) {
        uint32_t to = from + 1; /* every part gets a key; the last takes the rest */
        if (p + 1 == nparts) {
            to = n;
        } else {
            acc = sizes[from];
            while (to < n - (uint32_t)(nparts - p - 1) && acc + sizes[to] <= share)
                acc += sizes[to++];
        }
        s_job_t *j = s_job_new(S_LOAD, ns, keys + from, sizes + from, to - from);
        j->prefetch_job = job;
        j->deadline_ms = deadline;
        j->parts = parts;
        if (kvt_queue_push(self->loads, j, 1) != 0) { /* stopping */
            s_load_done(self, j, 0);
            free(j);
        }
        from = to;
    }
}

/* ---- life cycle ---- */

void kvt_l2mgr_redact(const char *spec, char *out, size_t outlen)
{
    size_t o = 0;
    for (const char *p = spec; *p && o + 1 < outlen;) {
        if (strncmp(p, "password=", 9) == 0 && (p == spec || p[-1] == ',' || p[-1] == ':')) {
            int w = snprintf(out + o, outlen - o, "password=***");
            o += w > 0 ? (size_t)w : 0;
            p += strcspn(p, ",");
            continue;
        }
        out[o++] = *p++;
    }
    out[o < outlen ? o : outlen - 1] = '\0';
}

/* The adapter table for a spec (loading a plugin), and where its own arguments start. */
static int s_resolve(const char *spec, const char *label, const kvt_l2_ops_t **ops,
                     void **plugin, const char **args_out, char *err, size_t errlen)
{
    const char *colon = strchr(spec, ':');
    size_t kind_len = colon ? (size_t)(colon - spec) : strlen(spec);
    const char *args = colon ? colon + 1 : "";
    *plugin = NULL;
    if (kind_len == 2 && strncmp(spec, "fs", 2) == 0) {
        *ops = kvt_l2_fs_ops();
    } else if (kind_len == 5 && strncmp(spec, "redis", 5) == 0) {
        *ops = kvt_l2_redis_ops();
    } else if (kind_len == 4 && strncmp(spec, "mock", 4) == 0) {
        *ops = kvt_l2_mock_ops();
    } else if (kind_len == 6 && strncmp(spec, "plugin", 6) == 0) {
        /* plugin:PATH.so[,ARGS]: the plugin's own options follow the first comma */
        char path[4096], perr[200] = "";
        const char *comma = strchr(args, ',');
        size_t plen = comma ? (size_t)(comma - args) : strlen(args);
        if (plen >= sizeof path) {
            snprintf(err, errlen, "l2: %s: path too long", label);
            return KVT_EINVAL;
        }
        memcpy(path, args, plen);
        path[plen] = '\0';
        if (kvt_l2_plugin_load(path, ops, plugin, perr, sizeof perr) != 0) {
            snprintf(err, errlen, "l2: %s: %s", label, perr);
            return KVT_EINVAL;
        }
        args = comma ? comma + 1 : "";
    } else {
        snprintf(err, errlen, "l2: %s: unknown adapter kind", label);
        return KVT_EINVAL;
    }
    *args_out = args;
    return 0;
}

int kvt_l2mgr_check(const kvt_config_t *cfg, char *err, size_t errlen)
{
    for (int i = 0; i < cfg->n_l2; i++) {
        if (strcmp(cfg->l2[i], "none") == 0)
            continue;
        char label[256], aerr[200] = "";
        kvt_l2mgr_redact(cfg->l2[i], label, sizeof label);
        const kvt_l2_ops_t *ops;
        void *plugin, *state = NULL;
        const char *args;
        int rc = s_resolve(cfg->l2[i], label, &ops, &plugin, &args, err, errlen);
        if (rc)
            return rc;
        rc = ops->open(args, &state, aerr, sizeof aerr);
        if (rc == 0)
            ops->close(state);
        if (plugin)
            kvt_l2_plugin_unload(plugin);
        if (rc && rc != KVT_EBUSY) { /* busy: in use by a running daemon, so it is valid */
            snprintf(err, errlen, "l2: %s: %s", label, aerr[0] ? aerr : kvt_strerror(rc));
            return rc;
        }
    }
    return 0;
}

static int s_open_adapter(kvt_l2mgr_t *m, s_adapter_t *a, const char *spec, kvt_sup_t *sup,
                          char *err, size_t errlen)
{
    const char *args;
    kvt_l2mgr_redact(spec, a->label, sizeof a->label);
    a->mgr = m;
    a->rep = (kvt_errrep_t)KVT_ERRREP_INIT(10000);
    pthread_mutex_init(&a->lock, NULL);
    int rrc = s_resolve(spec, a->label, &a->ops, &a->plugin, &args, err, errlen);
    if (rrc)
        return rrc;
    char aerr[200] = "";
    int rc = a->ops->open(args, &a->state, aerr, sizeof aerr);
    if (rc) {
        snprintf(err, errlen, "l2: %s: %s", a->label, aerr[0] ? aerr : kvt_strerror(rc));
        a->ops = NULL;
        return rc;
    }
    atomic_store(&a->healthy, true);
    s_probe(a);
    a->next_probe_ms = kvt_now_ms() + S_TICK_MS;
    uint32_t nthreads = m->cfg->l2_write_threads;
    if (nthreads > a->ops->max_threads)
        nthreads = a->ops->max_threads;
    if (nthreads > S_WRITERS_MAX)
        nthreads = S_WRITERS_MAX;
    if (nthreads < 1)
        nthreads = 1;
    /* the bound on waiting writes is the adapter's, shared by its writers */
    for (uint32_t t = 0; t < nthreads; t++)
        a->queues[t] = kvt_queue_new(S_QUEUE_KEYS / nthreads, 0, err, errlen); /* no eventfd */
    for (int t = 0; t < (int)nthreads; t++) {
        char name[32];
        snprintf(name, sizeof name, "l2-%d-%d", a->index, t);
        a->writers[t] = (s_writer_t){a, t};
        a->threads[t] =
            kvt_thread_start(sup, name, 30000 + S_TICK_MS, s_writer_run, &a->writers[t]);
        if (!a->threads[t]) {
            snprintf(err, errlen, "l2: %s: cannot start a thread", a->label);
            return KVT_EINTERNAL;
        }
        a->nthreads = t + 1;
    }
    kvt_log(KVT_LOG_INFO, "l2 %s: open (%s)", a->label,
            atomic_load(&a->healthy) ? "healthy" : "not answering yet");
    return 0;
}

kvt_l2mgr_t *kvt_l2mgr_new(const kvt_config_t *cfg, kvt_l1_t *l1, kvt_prefetch_t *prefetch,
                           kvt_sup_t *sup, int *code, char *err, size_t errlen)
{
    *code = KVT_EINTERNAL;
    kvt_l2mgr_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->cfg = cfg;
    self->l1 = l1;
    self->prefetch = prefetch;
    /* one load per running prefetch job, and kvt_prefetch caps those (max_prefetch_jobs; it never
     * drops a running one): the queue itself refuses nothing but loads after the stop */
    self->loads = kvt_queue_new(KVT_QUEUE_BOUNDED_BY_CALLER, 0, err, errlen);
    for (int i = 0; i < cfg->n_l2 && i < S_MAX_ADAPTERS; i++) {
        if (strcmp(cfg->l2[i], "none") == 0)
            continue;
        s_adapter_t *a = &self->adapters[self->nadapters];
        a->index = (int)self->nadapters;
        self->nadapters++;
        int rc = s_open_adapter(self, a, cfg->l2[i], sup, err, errlen);
        if (rc != 0) {
            *code = rc;
            goto fail;
        }
    }
    if (self->nadapters) {
        for (int t = 0; t < (int)cfg->l2_prefetch_threads && t < S_PREFETCH_THREADS; t++) {
            char name[32];
            snprintf(name, sizeof name, "prefetch-%d", t);
            self->pthreads[t] = kvt_thread_start(sup, name, 2000, s_prefetch_run, self);
            if (!self->pthreads[t]) {
                snprintf(err, errlen, "l2: cannot start a prefetch thread");
                goto fail;
            }
            self->npthreads = t + 1;
        }
        kvt_l1_set_l2_writes(l1, self->nadapters);
    }
    *code = 0;
    return self;
fail:
    kvt_l2mgr_destroy(&self);
    return NULL;
}

void kvt_l2mgr_destroy(kvt_l2mgr_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_l2mgr_t *self = *self_p;
    /* write what is queued first, for a bounded time: acknowledged data should reach L2 */
    uint64_t deadline = kvt_now_ms() + S_DRAIN_MS;
    for (uint32_t i = 0; i < self->nadapters; i++) {
        s_adapter_t *a = &self->adapters[i];
        for (int t = 0; t < a->nthreads; t++) {
            uint64_t now = kvt_now_ms();
            if (now < deadline)
                kvt_queue_wait_idle(a->queues[t], (int64_t)(deadline - now));
        }
    }
    atomic_store(&self->stop, true);
    /* from here every thread leaves as soon as its queue is empty (adapter threads still run
     * what is queued; prefetch threads abandon it) */
    kvt_queue_close(self->loads);
    for (uint32_t i = 0; i < self->nadapters; i++)
        for (int t = 0; t < S_WRITERS_MAX; t++)
            if (self->adapters[i].queues[t])
                kvt_queue_close(self->adapters[i].queues[t]);
    for (int t = 0; t < self->npthreads; t++)
        kvt_thread_join(&self->pthreads[t]);
    for (s_job_t *j; kvt_queue_pop(self->loads, (void **)&j, 0) == 0;) { /* a dead thread's */
        s_load_done(self, j, 0);
        free(j);
    }
    for (uint32_t i = 0; i < self->nadapters; i++) {
        s_adapter_t *a = &self->adapters[i];
        for (int t = 0; t < a->nthreads; t++)
            kvt_thread_join(&a->threads[t]);
        size_t lost = 0;
        for (int t = 0; t < S_WRITERS_MAX; t++) {
            if (!a->queues[t])
                continue;
            for (s_job_t *j; kvt_queue_pop(a->queues[t], (void **)&j, 0) == 0; free(j))
                lost += j->kind == S_STORE ? j->n : 0;
            kvt_queue_destroy(&a->queues[t]);
        }
        if (lost)
            kvt_log(KVT_LOG_WARN, "l2 %s: %zu queued writes not done at stop", a->label, lost);
        if (a->ops)
            a->ops->close(a->state);
        if (a->plugin)
            kvt_l2_plugin_unload(a->plugin);
        pthread_mutex_destroy(&a->lock);
    }
    kvt_queue_destroy(&self->loads);
    free(self);
    *self_p = NULL;
}

/* Writes waiting for the adapter, all writers together. */
static size_t s_depth(s_adapter_t *a)
{
    size_t d = 0;
    for (int t = 0; t < a->nthreads; t++)
        d += kvt_queue_depth(a->queues[t]);
    return d;
}

uint32_t kvt_l2mgr_count(const kvt_l2mgr_t *self)
{
    return self ? self->nadapters : 0;
}

void kvt_l2mgr_set_events(kvt_l2mgr_t *self, kvt_l2_event_fn fn, void *ctx)
{
    self->on_event = fn;
    self->event_ctx = ctx;
}

bool kvt_l2mgr_ready(kvt_l2mgr_t *self, char *why, size_t whylen)
{
    for (uint32_t i = 0; self && i < self->nadapters; i++) {
        s_adapter_t *a = &self->adapters[i];
        if (atomic_load(&a->healthy))
            continue;
        pthread_mutex_lock(&a->lock);
        snprintf(why, whylen, "l2 %s: %s", a->label, a->last_error);
        pthread_mutex_unlock(&a->lock);
        return false;
    }
    return true;
}

void kvt_l2mgr_metrics_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    kvt_l2mgr_t *self = ctx;
    static const struct {
        const char *name, *help;
        kvt_metric_kind_t kind;
        size_t off;
    } rows[] = {
        {"l2_stored_total", "Objects written to the L2 adapter.", KVT_METRIC_COUNTER,
         offsetof(s_adapter_t, stored)},
        {"l2_loaded_total", "Objects loaded from the L2 adapter into L1.", KVT_METRIC_COUNTER,
         offsetof(s_adapter_t, loaded)},
        {"l2_removed_total", "Objects removed from the L2 adapter.", KVT_METRIC_COUNTER,
         offsetof(s_adapter_t, removed)},
        {"l2_errors_total", "Failed L2 operations (after retries).", KVT_METRIC_COUNTER,
         offsetof(s_adapter_t, errors)},
        {"l2_dropped_total", "Writes dropped because the write-behind queue was full.",
         KVT_METRIC_COUNTER, offsetof(s_adapter_t, dropped)},
        {"l2_stored_bytes_total", "Bytes written to the L2 adapter.", KVT_METRIC_COUNTER,
         offsetof(s_adapter_t, bytes_stored)},
        {"l2_loaded_bytes_total", "Bytes loaded from the L2 adapter.", KVT_METRIC_COUNTER,
         offsetof(s_adapter_t, bytes_loaded)},
        {"l2_flushes_total",
         "Flushes that made a group of written objects durable (fs sync=batch: one syncfs).",
         KVT_METRIC_COUNTER, offsetof(s_adapter_t, flushes)},
        {"l2_corrupt_total",
         "Objects that failed their integrity check on load (not served; removed).",
         KVT_METRIC_COUNTER, offsetof(s_adapter_t, corrupt)},
    };
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++)
        for (uint32_t i = 0; i < self->nadapters; i++) {
            s_adapter_t *a = &self->adapters[i];
            kvt_sample_t s = {.name = rows[r].name, .help = rows[r].help, .kind = rows[r].kind,
                              .label = "adapter", .label_value = a->label,
                              .value = (double)s_get((_Atomic uint64_t *)((char *)a + rows[r].off))};
            emit(emit_ctx, &s);
        }
    for (uint32_t i = 0; i < self->nadapters; i++) {
        s_adapter_t *a = &self->adapters[i];
        double depth = (double)s_depth(a);
        kvt_sample_t s = {.name = "l2_queue_depth", .help = "Writes waiting for the adapter.",
                          .kind = KVT_METRIC_GAUGE, .label = "adapter", .label_value = a->label,
                          .value = depth};
        emit(emit_ctx, &s);
    }
    for (uint32_t i = 0; i < self->nadapters; i++) {
        s_adapter_t *a = &self->adapters[i];
        kvt_sample_t s = {.name = "l2_up", .help = "1 when the adapter answers its health probe.",
                          .kind = KVT_METRIC_GAUGE, .label = "adapter", .label_value = a->label,
                          .value = atomic_load(&a->healthy) ? 1.0 : 0.0};
        emit(emit_ctx, &s);
    }
    for (uint32_t i = 0; i < self->nadapters; i++) {
        s_adapter_t *a = &self->adapters[i];
        uint64_t bytes = 0, objects = 0;
        if (a->ops->usage)
            a->ops->usage(a->state, &bytes, &objects);
        kvt_sample_t s = {.name = "l2_bytes", .help = "Bytes the adapter holds (as it reports).",
                          .kind = KVT_METRIC_GAUGE, .label = "adapter", .label_value = a->label,
                          .value = (double)bytes};
        emit(emit_ctx, &s);
    }
    for (uint32_t i = 0; i < self->nadapters; i++)
        kvt_hist_emit(&self->adapters[i].latency, "l2_operation_duration_seconds",
                      "Time of one L2 store or load.", "adapter", self->adapters[i].label, emit,
                      emit_ctx);
}

json_t *kvt_l2mgr_status_json(kvt_l2mgr_t *self)
{
    json_t *arr = json_array();
    for (uint32_t i = 0; self && i < self->nadapters; i++) {
        s_adapter_t *a = &self->adapters[i];
        uint64_t bytes = 0, objects = 0;
        if (a->ops->usage)
            a->ops->usage(a->state, &bytes, &objects);
        size_t depth = s_depth(a);
        pthread_mutex_lock(&a->lock);
        json_t *past = a->past_error[0]
                           ? json_pack("{s:s,s:f,s:f}", "error", a->past_error, "at",
                                       a->past_error_at, "recovered_at", a->recovered_at)
                           : json_null();
        json_t *o = json_pack(
            "{s:s,s:s,s:b,s:s,s:f,s:o,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:i,s:I}", "adapter",
            a->label, "kind", a->ops->kind, "healthy", atomic_load(&a->healthy), "last_error",
            a->last_error, "last_error_at", a->last_error_at, "past_error", past, "queue_depth",
            (json_int_t)depth, "stored", (json_int_t)s_get(&a->stored), "loaded",
            (json_int_t)s_get(&a->loaded), "errors", (json_int_t)s_get(&a->errors), "dropped",
            (json_int_t)s_get(&a->dropped), "removed", (json_int_t)s_get(&a->removed), "corrupt",
            (json_int_t)s_get(&a->corrupt), "bytes", (json_int_t)bytes, "objects",
            (json_int_t)objects, "writers", a->nthreads, "flushes", (json_int_t)s_get(&a->flushes));
        pthread_mutex_unlock(&a->lock);
        json_array_append_new(arr, o);
    }
    return arr;
}
