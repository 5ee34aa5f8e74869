/* DESIGN: a fixed table of slots, each pair in a sealed memfd of its own made at HELLO and
 * handed to that client alone through kvt_handoff; one thread. The thread takes the server
 * lock, sweeps every open slot (connection gone? held replies to flush? up to S_POP_BATCH
 * requests, each handed to the server), and lets it go. While requests keep coming it sweeps
 * again at once; after fastpath.spin_us without one it arms every request ring (kvt_ring_arm:
 * wait word 1, fence, look again) and sleeps in one futex_waitv on all their words plus a
 * private doorbell (rung when a slot opens, a reply is held, or on stop), for at most the
 * supervisor's idle interval; a slot whose replies are held is waited on through its reply
 * ring instead (the client's pop makes room and wakes us). A client's push clears the word it
 * finds armed and wakes the thread; an idle daemon makes one wake-up per idle interval. The
 * lock is taken per slot, and a server loop waiting for it goes first (s_lock).
 *
 * A slot whose instance goes while its own request runs (BYE, a HELLO asking again) closes
 * after that request's reply is pushed, so those replies still reach the client. */
#include "kvt_fastpath.h"

#include "kvt_error.h"
#include "kvt_fdpass.h"
#include "kvt_log.h"
#include "kvt_thread.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <netinet/in.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define S_MAX_SLOTS 127       /* futex_waitv takes 128 words: one is the doorbell */
#define S_POP_BATCH 32        /* requests of one slot per sweep, so one client cannot starve */
#define S_QUARANTINE_MS 100   /* a closed slot rests this long before it is formatted again */
#define S_HELD_MAX 256        /* replies held for a full reply ring, then the slot closes */
#define S_POLL_MIN_NS 10000   /* the shortest poll window: a looping client's next request */
#define S_POLL_WORTH_NS 50000  /* a request this soon after the thread slept: polling pays */
#define S_BUSY_NS 1000000000LL /* a lost spin this recent: the node is busy */
#define S_HELD_POLL_NS 1000000 /* without futex_waitv: the idle thread looks this often */
#define S_SPURIOUS_MAX 8      /* wake-ups for nothing in a row before a slot is left out */
#define S_QUIET_MS 200        /* ... for this long */
#define S_BEAT_NS 10000000    /* beat at most every 10 ms while busy */
#define S_CLAIM_MS 5000       /* a pair not collected from the handoff socket by then closes */
#define S_CHECK_MS 50         /* how often a slot looks whether its client's handoff is gone */

#ifndef FUTEX_32
#define FUTEX_32 2
struct futex_waitv {
    uint64_t val;
    uint64_t uaddr;
    uint32_t flags;
    uint32_t __reserved;
};
#endif
#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449
#endif

typedef enum {
    S_DROP_BYE,
    S_DROP_EXPIRED,
    S_DROP_DISCONNECTED,
    S_DROP_REHELLO,
    S_DROP_MALFORMED,
    S_DROP_CLIENT_CLOSED,
    S_DROP_BACKLOG,
    S_DROP_SHUTDOWN,
    S_DROP_UNCLAIMED,
    S_DROP_CLIENT_GONE,
    S_DROP_REASONS
} s_drop_t;

static const char *const s_drop_names[S_DROP_REASONS] = {
    "bye",           "expired",       "disconnected", "rehello",   "malformed",
    "client_closed", "reply_backlog", "shutdown",     "unclaimed", "client_gone"};

/* Pairs broken by their clients (malformed records, replies never read): one line per 10 s
 * whatever a client does in a loop, the rest counted in it (issue 28, item 4). */
static kvt_errrep_t s_rep_broken = KVT_ERRREP_INIT(10000);

/* A reply that found the reply ring full: its frames, copied. */
typedef struct s_held {
    struct s_held *next;
    uint32_t nframes;
    size_t bytes;
    kvt_ring_iov_t frames[];
} s_held_t;

typedef struct {
    bool open;
    _Atomic bool live; /* `open`, for the sweep's look without the lock */
    bool closing;      /* close once the request being handled is answered */
    s_drop_t closing_why;
    uint32_t gen;      /* bumped at each close: replies to an earlier use are dropped */
    uint64_t freed_ms; /* when it closed (0: never used) */
    int memfd;         /* the pair's memory, -1 while closed */
    uint8_t *map;      /* its mapping: request ring at 0, reply ring right after */
    uint64_t handoff;  /* its offer on the handoff socket */
    uint64_t checked_ms; /* when the offer's state was last looked at */
    uint8_t *req_region, *rep_region;
    kvt_ring_t *req, *rep; /* the daemon's sides: consumer, producer */
    kvt_ring_t *armed;     /* the side s_sleep armed (req, or rep while replies are held) */
    uint32_t *word;        /* its wait word */
    uint32_t spurious;     /* wake-ups through it in a row that found nothing to do */
    uint64_t quiet_until_ms; /* left out of the wait until then */
    uint32_t epoch;        /* of the next format: ours, never read back from the region */
    kvt_conn_t *conn; /* a reference */
    uint64_t owner;
    s_held_t *held, *held_tail;
    uint32_t nheld;
    uint64_t held_bytes;
    bool owed; /* a reply published on the fastpath thread, its wake left to the sweep's end */
} s_slot_t;

struct kvt_fastpath {
    const kvt_config_t *cfg;
    kvt_handoff_t *handoff;
    uint64_t pair_bytes, ring_region;
    uint32_t cap, nslots;
    uint64_t held_bytes_max;
    uint64_t spin_ns;
    pthread_mutex_t *lock;
    _Atomic uint32_t *server_waiting; /* the server loop waits for `lock` */
    kvt_sessions_t *sessions;
    kvt_fastpath_request_fn fn;
    void *ctx;
    s_slot_t slots[S_MAX_SLOTS];
    int current; /* the slot whose request is being handled, -1 */
    uint32_t nowed; /* slots owed a wake (under the lock) */
    uint8_t *buf; /* a popped request (kvt_ring_max_payload bytes) */
    size_t buflen;
    kvt_thread_t *thread;
    _Atomic uint32_t doorbell;
    _Atomic bool stop;
    bool no_waitv; /* the kernel lacks futex_waitv: doorbell sleeps of S_HELD_POLL_NS */
    _Atomic uint64_t open_count, requests, declined, quieted, cooled, dropped[S_DROP_REASONS];
    int resident_fd; /* a read-only descriptor of the residency map, -1 */
    size_t resident_size;
};

static uint64_t s_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void s_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static void s_ring_bell(kvt_fastpath_t *self)
{
    atomic_fetch_add_explicit(&self->doorbell, 1, memory_order_release);
    (void)syscall(SYS_futex, (uint32_t *)&self->doorbell, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

/* ---- slots ---- */

static void s_free_held(s_slot_t *s)
{
    while (s->held) {
        s_held_t *h = s->held;
        s->held = h->next;
        free(h);
    }
    s->held_tail = NULL;
    s->nheld = 0;
    s->held_bytes = 0;
}

/* Lets the pair's memory go: the handoff offer ends (the client's handoff connection sees
 * EOF), the daemon's mapping and descriptor go; the client's mapping keeps the pages alive
 * while it still looks at them. */
static void s_pair_free(kvt_fastpath_t *self, s_slot_t *s)
{
    if (s->handoff)
        kvt_handoff_cancel(self->handoff, s->handoff);
    s->handoff = 0;
    if (s->map)
        munmap(s->map, self->pair_bytes);
    s->map = s->req_region = s->rep_region = NULL;
    if (s->memfd >= 0)
        close(s->memfd);
    s->memfd = -1;
}

/* Closes both daemon sides (the client's calls answer unavailable and it goes back to ZMQ)
 * and frees the slot for a later HELLO (lock held). */
static void s_close(kvt_fastpath_t *self, s_slot_t *s, s_drop_t why)
{
    if (!s->open)
        return;
    /* counted before the client can see its rings closed */
    atomic_fetch_sub_explicit(&self->open_count, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&self->dropped[why], 1, memory_order_relaxed);
    kvt_ring_close(s->req); /* wakes the client, owed or not */
    kvt_ring_close(s->rep);
    if (s->owed) {
        s->owed = false;
        self->nowed--;
    }
    kvt_ring_destroy(&s->req);
    kvt_ring_destroy(&s->rep);
    s_free_held(s);
    kvt_conn_unref(&s->conn);
    s_pair_free(self, s);
    s->open = s->closing = false;
    atomic_store_explicit(&s->live, false, memory_order_relaxed);
    s->armed = NULL;
    s->spurious = 0;
    s->quiet_until_ms = 0;
    s->gen++;
    s->freed_ms = kvt_now_ms();
    if (why == S_DROP_BACKLOG)
        kvt_errrep_report(&s_rep_broken, KVT_LOG_WARN,
                          "fastpath: ring pair %ld of owner %llu closed (%s)",
                          (long)(s - self->slots), (unsigned long long)s->owner, s_drop_names[why]);
    else /* a malformed ring was reported (rate-limited) where it was found */
        kvt_log(KVT_LOG_DEBUG, "fastpath: ring pair %ld of owner %llu closed (%s)",
                (long)(s - self->slots), (unsigned long long)s->owner, s_drop_names[why]);
}

/* Closes now, or after the request being handled is answered when it is this slot's. */
static void s_close_soon(kvt_fastpath_t *self, s_slot_t *s, s_drop_t why)
{
    if (self->current == (int)(s - self->slots)) {
        s->closing = true;
        s->closing_why = why;
    } else {
        s_close(self, s, why);
    }
}

static s_slot_t *s_slot_of(kvt_fastpath_t *self, kvt_fastpath_ref_t ref)
{
    if (ref.slot == 0 || ref.slot > self->nslots)
        return NULL;
    s_slot_t *s = &self->slots[ref.slot - 1];
    return s->open && s->gen == ref.gen ? s : NULL;
}

/* Publishes a reply. On the fastpath thread the client's wake waits for the end of the sweep
 * (s_wake_owed): with more runnable threads than CPUs, a client woken at once would take the
 * CPU from the thread halfway through the sweep, and every other client's reply behind it would
 * wait for the thread's next turn (issue 29: 32 clients on 2 CPUs made 50 k requests/s that way,
 * 90 k with the wakes at the end). */
static int s_push(kvt_fastpath_t *self, s_slot_t *s, const kvt_ring_iov_t *frames, uint32_t nframes,
                  bool later)
{
    if (!later)
        return kvt_ring_push(s->rep, frames, nframes);
    int rc = kvt_ring_push_later(s->rep, frames, nframes);
    if (rc == 0 && !s->owed) {
        s->owed = true;
        self->nowed++;
    }
    return rc;
}

/* Pushes held replies while the ring has room (fastpath thread): 0, or the ring's error. */
static int s_flush(kvt_fastpath_t *self, s_slot_t *s)
{
    while (s->held) {
        s_held_t *h = s->held;
        int rc = s_push(self, s, h->frames, h->nframes, true);
        if (rc == KVT_EBUSY)
            return 0;
        if (rc)
            return rc;
        s->held = h->next;
        if (!s->held)
            s->held_tail = NULL;
        s->nheld--;
        s->held_bytes -= h->bytes;
        free(h);
    }
    return 0;
}

static s_drop_t s_ring_error(int rc)
{
    return rc == KVT_EUNAVAIL ? S_DROP_CLIENT_CLOSED : S_DROP_MALFORMED;
}

/* ---- the thread ---- */

/* Takes the server lock, but lets a waiting server loop have it first: a mutex is not fair, and
 * a thread that unlocks and locks again at once would keep the loop out for as long as requests
 * keep coming. */
static void s_lock(kvt_fastpath_t *self)
{
    for (int i = 0; i < 10000 && atomic_load_explicit(self->server_waiting, memory_order_acquire);
         i++)
        sched_yield();
    pthread_mutex_lock(self->lock);
}

/* One slot's turn (lock held): how many requests were handled. */
static uint32_t s_serve(kvt_fastpath_t *self, uint32_t i)
{
    s_slot_t *s = &self->slots[i];
    if (!s->open)
        return 0;
    if (kvt_conn_retired(s->conn)) {
        s_close(self, s, S_DROP_DISCONNECTED);
        return 0;
    }
    uint64_t now = kvt_now_ms();
    if (now - s->checked_ms >= S_CHECK_MS) {
        s->checked_ms = now;
        kvt_handoff_state_t st = kvt_handoff_state(self->handoff, s->handoff);
        if (st == KVT_HANDOFF_EXPIRED || st == KVT_HANDOFF_GONE) {
            s_close(self, s, st == KVT_HANDOFF_GONE ? S_DROP_CLIENT_GONE : S_DROP_UNCLAIMED);
            return 0;
        }
    }
    int rc = s_flush(self, s);
    if (rc) {
        s_close(self, s, s_ring_error(rc));
        return 0;
    }
    uint32_t n = 0;
    for (uint32_t k = 0; k < S_POP_BATCH && s->open; k++) {
        size_t len = 0;
        rc = kvt_ring_pop(s->req, self->buf, self->buflen, &len);
        if (rc == KVT_EBUSY)
            break;
        if (rc) {
            if (rc != KVT_EUNAVAIL)
                kvt_errrep_report(&s_rep_broken, KVT_LOG_WARN,
                                  "fastpath: request ring %u of owner %llu: %s", i,
                                  (unsigned long long)s->owner, kvt_ring_why(s->req));
            s_close(self, s, s_ring_error(rc));
            break;
        }
        n++;
        s->spurious = 0;
        atomic_fetch_add_explicit(&self->requests, 1, memory_order_relaxed);
        kvt_fastpath_ref_t ref = {i + 1, s->gen};
        self->current = (int)i;
        self->fn(self->ctx, ref, s->conn, self->buf, len);
        self->current = -1;
        if (s->closing)
            s_close(self, s, s->closing_why);
    }
    return n;
}

/* The wakes the sweep left for its end: the lock taken per slot, as the sweep does. */
static void s_wake_owed(kvt_fastpath_t *self)
{
    for (uint32_t i = 0; i < self->nslots; i++) {
        if (!atomic_load_explicit(&self->slots[i].live, memory_order_relaxed))
            continue;
        s_lock(self);
        s_slot_t *s = &self->slots[i];
        if (s->open && s->owed) {
            kvt_ring_wake(s->rep);
            s->owed = false;
            self->nowed--;
        }
        bool more = self->nowed > 0;
        pthread_mutex_unlock(self->lock);
        if (!more)
            break;
    }
}

/* One sweep over the slots, the lock taken per slot (the loop gets it between two): how many
 * requests were handled. *held: replies wait for room in some reply ring. */
static uint32_t s_sweep(kvt_fastpath_t *self, kvt_thread_t *t, bool *held, bool *stop)
{
    uint32_t n = 0;
    *held = false;
    uint64_t beat = s_now_ns();
    bool owed = false;
    for (uint32_t i = 0; i < self->nslots; i++) {
        /* a look without the lock: a slot that opens meanwhile rings the bell */
        if (!atomic_load_explicit(&self->slots[i].live, memory_order_relaxed))
            continue;
        s_lock(self);
        n += s_serve(self, i);
        if (self->slots[i].open && self->slots[i].held)
            *held = true;
        owed |= self->nowed > 0;
        pthread_mutex_unlock(self->lock);
        if (s_now_ns() - beat >= S_BEAT_NS) {
            if (!kvt_thread_beat(t))
                *stop = true;
            beat = s_now_ns();
        }
    }
    if (owed)
        s_wake_owed(self);
    return n;
}

/* Sleeps until a request ring has a record, a reply ring with held replies has room, the
 * doorbell rings or the timeout passes. A slot whose wait word keeps waking the thread with
 * nothing to do (a client flipping it) is left out of the wait for a while: its requests are
 * then found by the idle sweeps, so it slows only itself. */
static void s_sleep(kvt_fastpath_t *self, int64_t timeout_ns)
{
    struct futex_waitv wv[S_MAX_SLOTS + 1];
    uint32_t n = 0;
    memset(wv, 0, sizeof wv);
    uint32_t bell = atomic_load_explicit(&self->doorbell, memory_order_acquire);
    wv[n].val = bell;
    wv[n].uaddr = (uint64_t)(uintptr_t)&self->doorbell;
    wv[n++].flags = FUTEX_32 | FUTEX_PRIVATE_FLAG;
    bool ready = false;
    uint64_t now_ms = kvt_now_ms();
    s_lock(self);
    for (uint32_t i = 0; i < self->nslots && !ready; i++) {
        s_slot_t *s = &self->slots[i];
        if (!s->open || s->quiet_until_ms > now_ms)
            continue;
        /* the reply ring's producer side when replies are held (room wakes us), else the
         * request ring's consumer side */
        kvt_ring_t *r = s->held ? s->rep : s->req;
        size_t need = s->held ? s->held->bytes : 0;
        uint32_t *word = NULL;
        int rc = kvt_ring_arm(r, need, &word);
        s->armed = r;
        s->word = word;
        if (rc != 0) /* ready, or an error the next sweep deals with */
            ready = true;
        else if (n < S_MAX_SLOTS + 1) { /* shared futex: woken through the client's mapping */
            wv[n].val = 1;
            wv[n].uaddr = (uint64_t)(uintptr_t)word;
            wv[n++].flags = FUTEX_32;
        }
    }
    pthread_mutex_unlock(self->lock);
    if (!ready && !atomic_load_explicit(&self->stop, memory_order_acquire)) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t at = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec +
                      (uint64_t)timeout_ns;
        ts.tv_sec = (time_t)(at / 1000000000u);
        ts.tv_nsec = (long)(at % 1000000000u);
        if (!self->no_waitv &&
            syscall(SYS_futex_waitv, wv, n, 0, &ts, CLOCK_MONOTONIC) < 0 && errno == ENOSYS) {
            self->no_waitv = true;
            kvt_log(KVT_LOG_WARN, "fastpath: the kernel has no futex_waitv (Linux 5.16+): the "
                                  "fast-path thread polls its rings every millisecond when idle");
        }
        if (self->no_waitv) {
            struct timespec rel = {0, S_HELD_POLL_NS};
            (void)syscall(SYS_futex, (uint32_t *)&self->doorbell, FUTEX_WAIT_PRIVATE, bell, &rel,
                          NULL, 0);
        }
    }
    now_ms = kvt_now_ms();
    s_lock(self);
    for (uint32_t i = 0; i < self->nslots; i++) {
        s_slot_t *s = &self->slots[i];
        if (!s->open || !s->armed)
            continue;
        kvt_ring_t *r = s->armed;
        /* the client cleared our word: fine when it has made progress (a record, room), a
         * spurious wake-up when it has not */
        bool cleared = atomic_load_explicit((_Atomic uint32_t *)s->word, memory_order_relaxed) != 1;
        uint32_t *w;
        bool progress = kvt_ring_arm(r, r == s->rep ? s->held->bytes : 0, &w) != 0;
        kvt_ring_disarm(r);
        s->armed = NULL;
        if (!cleared || progress) {
            s->spurious = progress ? 0 : s->spurious;
            continue;
        }
        if (++s->spurious >= S_SPURIOUS_MAX) {
            s->spurious = 0;
            s->quiet_until_ms = now_ms + S_QUIET_MS;
            atomic_fetch_add_explicit(&self->quieted, 1, memory_order_relaxed);
            kvt_log(KVT_LOG_DEBUG, "fastpath: ring %u of owner %llu wakes the thread for nothing: "
                                   "left out of its wait for %d ms", i,
                    (unsigned long long)s->owner, S_QUIET_MS);
        }
    }
    pthread_mutex_unlock(self->lock);
}

static bool s_run(kvt_thread_t *t, void *arg)
{
    kvt_fastpath_t *self = arg;
    uint64_t last_work = 0, last_spin = 0, slept_at = 0;
    uint64_t window = self->spin_ns; /* how long to poll after work: adapts below spin_ns */
    kvt_ring_cool_t cool = {0};
    bool stop = false;
    while (!stop && !atomic_load_explicit(&self->stop, memory_order_acquire)) {
        if (!kvt_thread_beat(t))
            return false;
        bool held;
        uint32_t n = s_sweep(self, t, &held, &stop);
        if (n) {
            uint64_t now = s_now_ns();
            /* polling paid (a request came while polling, or so soon after the sleep began
             * that polling would have caught it): poll longer next time */
            if (last_spin || (slept_at && now - slept_at < S_POLL_WORTH_NS))
                window = window * 2 > self->spin_ns ? self->spin_ns : window * 2;
            last_work = now;
            last_spin = slept_at = 0; /* the time since the last poll step went to work */
            continue;
        }
        /* Poll for the next request while this thread keeps its CPU and polling pays: once it
         * was descheduled mid-poll (CPU-bound neighbours, more spinners than cores) the
         * clients need that CPU more: sleep at once after work for a pause (kvt_ring_cool,
         * issue 29); on a busy node a poll that ran out also halves the next (clients that
         * copy or compute between requests: their next one does not come within it). */
        uint64_t now = s_now_ns();
        if (now - last_work < window && (int64_t)now >= cool.until) {
            if (last_spin && now - last_spin > KVT_RING_PREEMPTED_NS) {
                kvt_ring_cool(&cool, (int64_t)now);
                atomic_fetch_add_explicit(&self->cooled, 1, memory_order_relaxed);
                last_spin = 0;
            } else {
                last_spin = now;
                for (int i = 0; i < 32; i++)
                    s_relax();
                continue;
            }
        }
        /* a poll that ran out while the node is busy (a lost spin within S_BUSY_NS) halves
         * the next; on an idle node polling is free and the full window covers a client's
         * own wake-up (tens of µs on a VM whose idle cores sleep) */
        if ((int64_t)now - cool.until >= S_BUSY_NS)
            window = self->spin_ns;
        else if (last_spin && window / 2 >= S_POLL_MIN_NS)
            window /= 2;
        last_spin = 0;
        slept_at = s_now_ns();
        s_sleep(self, kvt_thread_idle_ms(t) * 1000000);
    }
    return !stop;
}

/* ---- API ---- */

kvt_fastpath_t *kvt_fastpath_new(const kvt_config_t *cfg, kvt_handoff_t *handoff,
                                 pthread_mutex_t *lock, _Atomic uint32_t *server_waiting,
                                 kvt_sessions_t *sessions, kvt_fastpath_request_fn fn, void *ctx)
{
    if (!cfg->fastpath_enabled)
        return NULL;
    kvt_fastpath_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->cfg = cfg;
    self->handoff = handoff;
    self->cap = (uint32_t)cfg->fastpath_ring_bytes;
    self->ring_region = kvt_ring_region_size(self->cap);
    self->pair_bytes = kvt_config_fastpath_pair_bytes(cfg); /* whole pages */
    self->nslots = cfg->fastpath_rings < S_MAX_SLOTS ? cfg->fastpath_rings : S_MAX_SLOTS;
    self->held_bytes_max = 4 * (uint64_t)self->cap;
    self->spin_ns = (uint64_t)cfg->fastpath_spin_us * 1000u;
    self->lock = lock;
    self->server_waiting = server_waiting;
    self->sessions = sessions;
    self->fn = fn;
    self->ctx = ctx;
    self->current = -1;
    self->resident_fd = -1;
    self->buflen = self->cap - KVT_RING_REC_HDR; /* kvt_ring_max_payload */
    self->buf = malloc(self->buflen);
    kvt_assert(self->buf);
    uint32_t epoch0 = 0; /* epochs start anywhere: a client of an earlier daemon cannot guess */
    if (getrandom(&epoch0, sizeof epoch0, 0) != sizeof epoch0)
        epoch0 = (uint32_t)s_now_ns();
    for (uint32_t i = 0; i < self->nslots; i++) {
        s_slot_t *s = &self->slots[i];
        s->memfd = -1;
        s->epoch = epoch0 + i * 0x10000u;
    }
    return self;
}

int kvt_fastpath_start(kvt_fastpath_t *self, kvt_sup_t *sup)
{
    self->thread = kvt_thread_start(sup, "fastpath", 2000, s_run, self);
    if (!self->thread)
        return KVT_EINTERNAL;
    kvt_log(KVT_LOG_INFO, "fastpath: up to %u ring pairs of 2 x %u bytes, handed over at %s",
            self->nslots, self->cap, kvt_handoff_path(self->handoff));
    return 0;
}

void kvt_fastpath_stop(kvt_fastpath_t *self)
{
    if (!self || !self->thread)
        return;
    atomic_store_explicit(&self->stop, true, memory_order_release);
    s_ring_bell(self);
    kvt_thread_join(&self->thread);
    /* no request is taken from here on: clients find their request rings closed and go to
     * the socket, while the replies of pooled requests still reach the reply rings (closed
     * with the slots by kvt_fastpath_destroy) */
    pthread_mutex_lock(self->lock);
    for (uint32_t i = 0; i < self->nslots; i++)
        if (self->slots[i].open)
            kvt_ring_close(self->slots[i].req);
    pthread_mutex_unlock(self->lock);
}

void kvt_fastpath_destroy(kvt_fastpath_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_fastpath_t *self = *self_p;
    kvt_fastpath_stop(self);
    for (uint32_t i = 0; i < self->nslots; i++)
        s_close(self, &self->slots[i], S_DROP_SHUTDOWN);
    if (self->resident_fd >= 0)
        close(self->resident_fd);
    free(self->buf);
    free(self);
    *self_p = NULL;
}

void kvt_fastpath_set_resident(kvt_fastpath_t *self, int fd, size_t size)
{
    if (!self || fd < 0)
        return;
    /* a read-only open of the memfd: besides its seals, the descriptor itself cannot write */
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int ro = open(path, O_RDONLY | O_CLOEXEC);
    if (ro < 0)
        ro = fcntl(fd, F_DUPFD_CLOEXEC, 3); /* no /proc: the seals still forbid writing */
    if (ro < 0) {
        kvt_log(KVT_LOG_WARN, "fastpath: the residency map is not offered: %s", strerror(errno));
        return;
    }
    self->resident_fd = ro;
    self->resident_size = size;
}

bool kvt_fastpath_local(int fd)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (fd < 0 || getpeername(fd, (struct sockaddr *)&ss, &len) != 0)
        return false;
    if (ss.ss_family == AF_UNIX)
        return true;
    if (ss.ss_family == AF_INET)
        return (ntohl(((struct sockaddr_in *)&ss)->sin_addr.s_addr) >> 24) == 127;
    if (ss.ss_family == AF_INET6) {
        const struct in6_addr *a = &((struct sockaddr_in6 *)&ss)->sin6_addr;
        return IN6_IS_ADDR_LOOPBACK(a) ||
               (IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127);
    }
    return false;
}

/* Who may collect a pair offered on conn: the process at the other end of its unix socket;
 * anyone who can reach the handoff socket when the connection is TCP (loopback). */
static kvt_handoff_peer_t s_peer_of(kvt_conn_t *conn)
{
    kvt_handoff_peer_t peer = {0, 0};
    struct ucred cr;
    socklen_t len = sizeof cr;
    int fd = kvt_conn_fd(conn);
    struct sockaddr_storage ss;
    socklen_t slen = sizeof ss;
    if (fd >= 0 && getsockname(fd, (struct sockaddr *)&ss, &slen) == 0 && ss.ss_family == AF_UNIX &&
        getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0 && cr.pid > 0)
        peer = (kvt_handoff_peer_t){cr.pid, cr.uid};
    return peer;
}

/* The pair's memory: a memfd sealed at its size (no one can shrink it under the other side's
 * mapping: no SIGBUS either way), formatted, and offered to conn's process alone. */
static int s_pair_new(kvt_fastpath_t *self, s_slot_t *s, kvt_conn_t *conn, bool resident,
                      char *ticket)
{
    char err[160];
    s->memfd = memfd_create("kvtier-ring-pair", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (s->memfd < 0 || ftruncate(s->memfd, (off_t)self->pair_bytes) != 0 ||
        fcntl(s->memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        kvt_log(KVT_LOG_WARN, "fastpath: cannot make a ring pair: %s", strerror(errno));
        goto fail;
    }
    void *p = mmap(NULL, self->pair_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s->memfd, 0);
    if (p == MAP_FAILED) {
        kvt_log(KVT_LOG_WARN, "fastpath: cannot map a ring pair: %s", strerror(errno));
        goto fail;
    }
    s->map = p;
    s->req_region = s->map;
    s->rep_region = s->map + self->ring_region;
    s->epoch++;
    if (kvt_ring_format(s->req_region, self->ring_region, self->cap, s->epoch) != 0 ||
        kvt_ring_format(s->rep_region, self->ring_region, self->cap, s->epoch) != 0 ||
        !(s->req = kvt_ring_new(s->req_region, self->ring_region, self->cap, KVT_RING_CONSUMER, err,
                                sizeof err)) ||
        !(s->rep = kvt_ring_new(s->rep_region, self->ring_region, self->cap, KVT_RING_PRODUCER, err,
                                sizeof err)))
        goto fail; /* cannot happen: the regions are ours and aligned */
    s->handoff = kvt_handoff_offer(self->handoff, s->memfd, resident ? self->resident_fd : -1,
                                   s_peer_of(conn), S_CLAIM_MS, ticket);
    if (!s->handoff)
        goto fail;
    return 0;
fail:
    kvt_ring_destroy(&s->req);
    kvt_ring_destroy(&s->rep);
    s_pair_free(self, s);
    return KVT_EINTERNAL;
}

int kvt_fastpath_open(kvt_fastpath_t *self, kvt_conn_t *conn, uint64_t owner, bool resident,
                      kvt_fastpath_offer_t *offer)
{
    resident = resident && self->resident_fd >= 0;
    uint64_t now = kvt_now_ms();
    s_slot_t *pick = NULL, *own = NULL;
    for (uint32_t i = 0; i < self->nslots; i++) {
        s_slot_t *s = &self->slots[i];
        if (s->open && s->conn == conn && !s->closing)
            own = s;
        else if (!s->open && (s->freed_ms == 0 || now - s->freed_ms >= S_QUARANTINE_MS) &&
                 (!pick || s->freed_ms < pick->freed_ms))
            pick = s; /* the one that rested longest */
    }
    /* the connection's own pair goes: its client asks again (and closed its sides first).
     * With no other slot free it is formatted again for the same connection at once, unless
     * this HELLO came through it (its reply still has to go there) */
    if (own && !pick && self->current != (int)(own - self->slots)) {
        s_close(self, own, S_DROP_REHELLO);
        pick = own;
    } else if (own) {
        s_close_soon(self, own, S_DROP_REHELLO);
    }
    if (!pick) {
        atomic_fetch_add_explicit(&self->declined, 1, memory_order_relaxed);
        return KVT_EBUSY;
    }
    char ticket[KVT_FDPASS_TICKET_HEX + 1];
    if (s_pair_new(self, pick, conn, resident, ticket) != 0) {
        atomic_fetch_add_explicit(&self->declined, 1, memory_order_relaxed);
        return KVT_EINTERNAL;
    }
    pick->open = true;
    atomic_store_explicit(&pick->live, true, memory_order_relaxed);
    pick->closing = false;
    pick->conn = kvt_conn_ref(conn);
    pick->owner = owner;
    pick->checked_ms = kvt_now_ms();
    atomic_fetch_add_explicit(&self->open_count, 1, memory_order_relaxed);
    *offer = (kvt_fastpath_offer_t){.socket = kvt_handoff_path(self->handoff),
                                    .size = self->pair_bytes,
                                    .request = 0,
                                    .reply = self->ring_region,
                                    .capacity = self->cap,
                                    .resident = resident ? self->resident_size : 0};
    memcpy(offer->ticket, ticket, sizeof offer->ticket);
    s_ring_bell(self); /* a sleeping thread adds the new ring to its wait */
    return 0;
}

bool kvt_fastpath_reply_fits(kvt_fastpath_t *self, kvt_fastpath_ref_t ref,
                             const kvt_ring_iov_t *frames, uint32_t nframes)
{
    s_slot_t *s = s_slot_of(self, ref);
    if (!s)
        return true; /* kvt_fastpath_reply drops it */
    size_t plen = kvt_ring_msg_size(frames, nframes);
    return plen != SIZE_MAX && plen <= kvt_ring_max_payload(s->rep);
}

int kvt_fastpath_reply(kvt_fastpath_t *self, kvt_fastpath_ref_t ref, const kvt_ring_iov_t *frames,
                       uint32_t nframes)
{
    s_slot_t *s = s_slot_of(self, ref);
    if (!s)
        return KVT_EUNAVAIL;
    size_t plen = kvt_ring_msg_size(frames, nframes);
    if (plen == SIZE_MAX || plen > kvt_ring_max_payload(s->rep))
        return KVT_ETOOBIG;
    int rc = s->held ? KVT_EBUSY : s_push(self, s, frames, nframes, self->current >= 0);
    if (rc == 0)
        return 0;
    if (rc != KVT_EBUSY) {
        s_close_soon(self, s, s_ring_error(rc));
        return KVT_EUNAVAIL;
    }
    /* the client has not read its earlier replies yet: hold this one, within bounds */
    if (s->nheld >= S_HELD_MAX || s->held_bytes + plen > self->held_bytes_max) {
        s_close_soon(self, s, S_DROP_BACKLOG);
        return KVT_EUNAVAIL;
    }
    size_t total = sizeof(s_held_t) + nframes * sizeof(kvt_ring_iov_t);
    for (uint32_t i = 0; i < nframes; i++)
        total += frames[i].len;
    s_held_t *h = malloc(total);
    kvt_assert(h);
    h->next = NULL;
    h->nframes = nframes;
    h->bytes = plen;
    uint8_t *p = (uint8_t *)&h->frames[nframes];
    for (uint32_t i = 0; i < nframes; i++) {
        if (frames[i].len)
            memcpy(p, frames[i].ptr, frames[i].len);
        h->frames[i] = (kvt_ring_iov_t){p, frames[i].len};
        p += frames[i].len;
    }
    if (s->held_tail)
        s->held_tail->next = h;
    else
        s->held = h;
    s->held_tail = h;
    s->nheld++;
    s->held_bytes += plen;
    s_ring_bell(self); /* the thread waits for room in this reply ring from now on */
    return 0;
}

void kvt_fastpath_reject(kvt_fastpath_t *self, kvt_fastpath_ref_t ref, const char *why)
{
    s_slot_t *s = s_slot_of(self, ref);
    if (!s)
        return;
    kvt_errrep_report(&s_rep_broken, KVT_LOG_WARN, "fastpath: ring %u of owner %llu: %s",
                      ref.slot - 1, (unsigned long long)s->owner, why);
    s_close_soon(self, s, S_DROP_MALFORMED);
}

void kvt_fastpath_owner_gone(kvt_fastpath_t *self, uint64_t owner, bool expired)
{
    if (!self)
        return;
    for (uint32_t i = 0; i < self->nslots; i++) {
        s_slot_t *s = &self->slots[i];
        if (s->open && s->owner == owner)
            s_close_soon(self, s, expired ? S_DROP_EXPIRED : S_DROP_BYE);
    }
}

json_t *kvt_fastpath_json(kvt_fastpath_t *self)
{
    json_t *dropped = json_object();
    for (int i = 0; i < S_DROP_REASONS; i++)
        json_object_set_new(dropped, s_drop_names[i],
                            json_integer(self ? (json_int_t)atomic_load(&self->dropped[i]) : 0));
    return json_pack(
        "{s:b,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:o}", "enabled", self != NULL, "rings_max",
        (json_int_t)(self ? self->nslots : 0), "rings_open",
        (json_int_t)(self ? atomic_load(&self->open_count) : 0), "ring_bytes",
        (json_int_t)(self ? self->cap : 0), "requests",
        (json_int_t)(self ? atomic_load(&self->requests) : 0), "declined",
        (json_int_t)(self ? atomic_load(&self->declined) : 0), "quieted",
        (json_int_t)(self ? atomic_load(&self->quieted) : 0), "cooled",
        (json_int_t)(self ? atomic_load(&self->cooled) : 0), "dropped", dropped);
}

void kvt_fastpath_metrics_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    kvt_fastpath_t *self = ctx;
    kvt_sample_t s = {.name = "fastpath_rings",
                      .help = "Fast-path ring pairs open (clients using the shared-memory path).",
                      .kind = KVT_METRIC_GAUGE,
                      .value = (double)atomic_load(&self->open_count)};
    emit(emit_ctx, &s);
    s = (kvt_sample_t){.name = "fastpath_requests_total",
                       .help = "Requests that came through fast-path rings.",
                       .kind = KVT_METRIC_COUNTER,
                       .value = (double)atomic_load(&self->requests)};
    emit(emit_ctx, &s);
    s = (kvt_sample_t){.name = "fastpath_declined_total",
                       .help = "HELLOs that asked for a ring pair when none was free.",
                       .kind = KVT_METRIC_COUNTER,
                       .value = (double)atomic_load(&self->declined)};
    emit(emit_ctx, &s);
    for (int i = 0; i < S_DROP_REASONS; i++) {
        s = (kvt_sample_t){.name = "fastpath_dropped_total",
                           .help = "Fast-path ring pairs closed, by reason.",
                           .kind = KVT_METRIC_COUNTER,
                           .label = "reason",
                           .label_value = s_drop_names[i],
                           .value = (double)atomic_load(&self->dropped[i])};
        emit(emit_ctx, &s);
    }
}
