/* DESIGN: two tables under one mutex: instance name -> s_session_t (owned) and routing id ->
 * kvt_conn_t (a reference), plus a descriptor -> connection array for the monitor's
 * disconnect events. Connections and instances point at each other (a connection lists the
 * instances it acts for, an instance the connections acting for it); both lists are short
 * and bounded (max_instances_per_conn; the connections of one client), and every unlink
 * removes both directions. The expiry sweep walks all instances every 100 ms: there are at
 * most max_instances, so it is cheap, and nobody waits for a batch.
 *
 * The reply counters of a connection are atomics written by the server thread (start) and by
 * libzmq's I/O threads (end); the mutex is never taken there. Lock order: the mutex is a leaf;
 * on_gone and logging of drops run outside it. */
#include "kvt_session.h"

#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_proto.h"

#include <czmq.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xxhash.h>

#define S_MAX_RID 256
#define S_STATUS_CLIENTS 100 /* /status lists at most this many instances ... */
#define S_STATUS_CONNS 20    /* ... and this many connections with replies in flight */
#define S_CONN_IDLE_MS                                                                             \
    60000 /* a connection without instances or replies, silent this long,                          \
           * is forgotten even if its close was never reported */

typedef struct s_session s_session_t;

typedef struct {
    uint32_t len;
    uint8_t bytes[S_MAX_RID];
} s_rid_t;

struct kvt_conn {
    _Atomic uint32_t refs;
    s_rid_t rid; /* the table's key */
    int fd;
    uint32_t gen; /* its connection's generation on fd */
    uint64_t id;
    bool cut;
    _Atomic bool retired; /* out of the tables: its connection is gone */
    uint64_t last_ms;
    s_session_t **inst; /* instances it acts for; the last one is current */
    uint32_t ninst;
    uint64_t owner;                 /* owner id of inst[ninst - 1], 0 when none */
    char dropped[KVT_MAX_NAME + 1]; /* the last of its instances dropped for silence */
    _Atomic uint64_t pending;       /* replies handed to libzmq, not yet written out */
    _Atomic uint64_t backlog;       /* daemon memory they hold */
    _Atomic uint64_t pinned;        /* arena bytes they pin */
    _Atomic uint64_t progress_ms;   /* a reply last completed (or the first one started) */
    uint32_t held;                  /* kvt_conn_hold: its caller keeps state on it */
};

struct s_session {
    char *instance;
    char *client;
    uint64_t owner;
    char token[KVT_TOKEN_HEX + 1];
    uint64_t last_seen_ms;
    uint64_t requests;
    kvt_conn_t **conns; /* connections acting for it */
    uint32_t nconns, cap;
};

typedef enum { S_CUT_STALLED, S_CUT_BACKLOG, S_CUT_REASONS } s_cut_reason_t;
static const char *const s_cut_names[S_CUT_REASONS] = {"replies_stalled", "reply_backlog"};

struct kvt_sessions {
    pthread_mutex_t lock;
    kvt_session_limits_t lim;
    zhashx_t *by_instance; /* instance -> s_session_t (owned) */
    zhashx_t *by_rid;      /* &conn->rid -> kvt_conn_t (one reference) */
    kvt_conn_t **by_fd;    /* descriptor -> connection, NULL when none */
    size_t nfd;
    kvt_session_new_fn on_new; /* NULL: ids from next_owner, no ceiling (unit tests) */
    uint64_t next_owner;
    uint64_t next_conn;
    kvt_session_gone_fn on_gone;
    void *ctx;
    _Atomic uint64_t cuts[S_CUT_REASONS];
    _Atomic uint64_t conns; /* connections in the table */
};

/* ---- routing id keys (no hex formatting: hashed and compared as bytes) ---- */

/* Clients choose routing ids and instance names: both tables hash them with a secret seed, so
 * that nobody can send keys that collide (a zhashx grows its table on every lookup that meets
 * a long chain, until the allocation fails and czmq aborts). Set once, before any thread. */
static uint64_t s_seed;

static size_t s_rid_hash(const void *key)
{
    const s_rid_t *r = key;
    return (size_t)XXH3_64bits_withSeed(r->bytes, r->len, s_seed);
}

static size_t s_name_hash(const void *key)
{
    return (size_t)XXH3_64bits_withSeed(key, strlen(key), s_seed);
}

static int s_rid_cmp(const void *a, const void *b)
{
    const s_rid_t *x = a, *y = b;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1;
    return memcmp(x->bytes, y->bytes, x->len);
}

/* ---- instances ---- */

static void s_session_free(void **item)
{
    s_session_t *s = *item;
    if (s) {
        free(s->conns);
        free(s->instance);
        free(s->client);
        free(s);
        *item = NULL;
    }
}

static void s_new_token(char out[KVT_TOKEN_HEX + 1])
{
    uint8_t raw[KVT_TOKEN_HEX / 2];
    size_t got = 0;
    while (got < sizeof raw) {
        ssize_t n = getrandom(raw + got, sizeof raw - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        kvt_assert(n > 0); /* the kernel's CSPRNG does not fail once seeded */
        got += (size_t)n;
    }
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < sizeof raw; i++) {
        out[2 * i] = digits[raw[i] >> 4];
        out[2 * i + 1] = digits[raw[i] & 15];
    }
    out[KVT_TOKEN_HEX] = '\0';
}

/* Compares in time independent of where the strings differ: a token is a credential. */
static bool s_token_eq(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    unsigned diff = la != lb;
    for (size_t i = 0; i < la && i < lb; i++)
        diff |= (unsigned)(a[i] ^ b[i]);
    return diff == 0;
}

static bool s_acts_for(const kvt_conn_t *c, const s_session_t *s)
{
    for (uint32_t i = 0; i < c->ninst; i++)
        if (c->inst[i] == s)
            return true;
    return false;
}

static void s_set_owner(kvt_conn_t *c)
{
    c->owner = c->ninst ? c->inst[c->ninst - 1]->owner : 0;
}

/* Links connection and instance both ways (the instance becomes the current one); lock held.
 * The caller checked the connection's limit. */
static void s_link(kvt_conn_t *c, s_session_t *s)
{
    if (s_acts_for(c, s)) { /* move it to the end: current */
        uint32_t i = 0;
        while (c->inst[i] != s)
            i++;
        memmove(&c->inst[i], &c->inst[i + 1], (c->ninst - i - 1) * sizeof *c->inst);
        c->inst[c->ninst - 1] = s;
    } else {
        c->inst[c->ninst++] = s;
        if (s->nconns == s->cap) {
            s->cap = s->cap ? 2 * s->cap : 2;
            s->conns = realloc(s->conns, s->cap * sizeof *s->conns);
            kvt_assert(s->conns);
        }
        s->conns[s->nconns++] = c;
    }
    s_set_owner(c);
}

static void s_unlink(kvt_conn_t *c, s_session_t *s)
{
    for (uint32_t i = 0; i < c->ninst; i++)
        if (c->inst[i] == s) {
            memmove(&c->inst[i], &c->inst[i + 1], (c->ninst - i - 1) * sizeof *c->inst);
            c->ninst--;
            break;
        }
    for (uint32_t i = 0; i < s->nconns; i++)
        if (s->conns[i] == c) {
            s->conns[i] = s->conns[--s->nconns];
            break;
        }
    s_set_owner(c);
}

/* Unlinks an instance from its connections and frees it; lock held. Returns its owner id.
 * `dropped`: its connections remember the name, for their instance_dropped errors. */
static uint64_t s_session_remove(kvt_sessions_t *self, s_session_t *s, bool dropped)
{
    uint64_t owner = s->owner;
    while (s->nconns) {
        kvt_conn_t *c = s->conns[0];
        if (dropped)
            snprintf(c->dropped, sizeof c->dropped, "%s", s->instance);
        s_unlink(c, s);
    }
    zhashx_delete(self->by_instance, s->instance); /* frees s */
    return owner;
}

/* ---- connections ---- */

void kvt_conn_hold(kvt_sessions_t *self, kvt_conn_t *c, bool hold)
{
    pthread_mutex_lock(&self->lock);
    if (hold)
        c->held++;
    else if (c->held)
        c->held--;
    pthread_mutex_unlock(&self->lock);
}

kvt_conn_t *kvt_conn_ref(kvt_conn_t *c)
{
    if (c)
        atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
    return c;
}

void kvt_conn_unref(kvt_conn_t **c_p)
{
    if (!c_p || !*c_p)
        return;
    kvt_conn_t *c = *c_p;
    *c_p = NULL;
    if (atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) == 1) {
        free(c->inst);
        free(c);
    }
}

/* Takes a connection out of the tables (its connection is gone, or its routing id moved to
 * another one); lock held. Its instances stay until they expire or are joined again. */
static void s_conn_retire(kvt_sessions_t *self, kvt_conn_t *c)
{
    atomic_store_explicit(&c->retired, true, memory_order_relaxed);
    while (c->ninst)
        s_unlink(c, c->inst[0]);
    if (c->fd >= 0 && (size_t)c->fd < self->nfd && self->by_fd[c->fd] == c)
        self->by_fd[c->fd] = NULL;
    zhashx_delete(self->by_rid, &c->rid);
    atomic_fetch_sub_explicit(&self->conns, 1, memory_order_relaxed);
    kvt_conn_unref(&c);
}

static void s_by_fd_set(kvt_sessions_t *self, int fd, kvt_conn_t *c)
{
    if (fd < 0)
        return;
    if ((size_t)fd >= self->nfd) {
        size_t n = self->nfd ? self->nfd : 64;
        while (n <= (size_t)fd)
            n *= 2;
        kvt_conn_t **a = realloc(self->by_fd, n * sizeof *a);
        kvt_assert(a);
        memset(a + self->nfd, 0, (n - self->nfd) * sizeof *a);
        self->by_fd = a;
        self->nfd = n;
    }
    self->by_fd[fd] = c;
}

/* A request arrived for c: it and its instances are alive (lock held). */
static void s_touch(kvt_conn_t *c, uint64_t now_ms)
{
    c->last_ms = now_ms;
    for (uint32_t i = 0; i < c->ninst; i++) {
        c->inst[i]->last_seen_ms = now_ms;
        c->inst[i]->requests++;
    }
}

kvt_conn_t *kvt_sessions_conn(kvt_sessions_t *self, const uint8_t *rid, size_t rid_len, int fd,
                              uint32_t gen, uint64_t now_ms)
{
    s_rid_t key;
    key.len = (uint32_t)(rid_len < S_MAX_RID ? rid_len : S_MAX_RID);
    memcpy(key.bytes, rid, key.len);
    pthread_mutex_lock(&self->lock);
    kvt_conn_t *c = zhashx_lookup(self->by_rid, &key);
    if (c && fd >= 0 && c->fd >= 0 && c->fd != fd) {
        s_conn_retire(self, c); /* the routing id now names another connection */
        c = NULL;
    }
    if (!c) {
        if (fd >= 0 && (size_t)fd < self->nfd && self->by_fd[fd])
            s_conn_retire(self, self->by_fd[fd]); /* its descriptor closed and was reused */
        c = calloc(1, sizeof *c);
        kvt_assert(c);
        c->inst = calloc(self->lim.max_instances_per_conn, sizeof *c->inst);
        kvt_assert(c->inst);
        atomic_init(&c->refs, 1); /* the table's */
        c->rid = key;
        c->fd = fd;
        c->gen = gen;
        c->id = ++self->next_conn;
        zhashx_insert(self->by_rid, &c->rid, c);
        s_by_fd_set(self, fd, c);
        atomic_fetch_add_explicit(&self->conns, 1, memory_order_relaxed);
    }
    s_touch(c, now_ms);
    kvt_conn_ref(c);
    pthread_mutex_unlock(&self->lock);
    return c;
}

void kvt_sessions_touch(kvt_sessions_t *self, kvt_conn_t *c, uint64_t now_ms)
{
    pthread_mutex_lock(&self->lock);
    s_touch(c, now_ms);
    pthread_mutex_unlock(&self->lock);
}

int kvt_conn_fd(const kvt_conn_t *c)
{
    return c ? c->fd : -1;
}

uint32_t kvt_conn_gen(const kvt_conn_t *c)
{
    return c->gen;
}

bool kvt_conn_retired(const kvt_conn_t *c)
{
    return atomic_load_explicit(&c->retired, memory_order_relaxed);
}

uint64_t kvt_conn_owner(const kvt_conn_t *c)
{
    return c ? c->owner : 0;
}

void kvt_conn_why_no_instance(const kvt_conn_t *c, const char *request, char *out, size_t len)
{
    if (c && c->dropped[0])
        snprintf(out, len,
                 "%s: instance '%.64s' was silent for over lease_ms and was dropped with its "
                 "leases: say HELLO again",
                 request, c->dropped);
    else
        snprintf(out, len,
                 "%s takes a lease: this connection has no client instance (send HELLO first; "
                 "a reconnect or a daemon restart needs a new HELLO)",
                 request);
}

void kvt_sessions_on_disconnect(kvt_sessions_t *self, int fd, uint32_t gen)
{
    pthread_mutex_lock(&self->lock);
    /* a report about an earlier connection on the descriptor leaves the current one alone */
    if (fd >= 0 && (size_t)fd < self->nfd && self->by_fd[fd] && self->by_fd[fd]->gen == gen)
        s_conn_retire(self, self->by_fd[fd]);
    pthread_mutex_unlock(&self->lock);
}

void kvt_conn_reply_start(kvt_conn_t *c, uint64_t bytes, uint64_t pinned, uint64_t now_ms)
{
    kvt_conn_ref(c);
    if (atomic_fetch_add_explicit(&c->pending, 1, memory_order_relaxed) == 0)
        atomic_store_explicit(&c->progress_ms, now_ms, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->backlog, bytes, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->pinned, pinned, memory_order_relaxed);
}

void kvt_conn_reply_end(kvt_conn_t *c, uint64_t bytes, uint64_t pinned)
{
    atomic_fetch_sub_explicit(&c->backlog, bytes, memory_order_relaxed);
    atomic_fetch_sub_explicit(&c->pinned, pinned, memory_order_relaxed);
    atomic_store_explicit(&c->progress_ms, kvt_now_ms(), memory_order_relaxed);
    atomic_fetch_sub_explicit(&c->pending, 1, memory_order_relaxed);
    kvt_conn_unref(&c);
}

uint64_t kvt_conn_pinned(const kvt_conn_t *c)
{
    return atomic_load_explicit(&((kvt_conn_t *)c)->pinned, memory_order_relaxed);
}

/* ---- life cycle ---- */

kvt_sessions_t *kvt_sessions_new(const kvt_session_limits_t *lim, kvt_session_new_fn on_new,
                                 kvt_session_gone_fn on_gone, void *ctx)
{
    kvt_sessions_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    pthread_mutex_init(&self->lock, NULL);
    self->lim = *lim;
    if (self->lim.max_instances_per_conn == 0)
        self->lim.max_instances_per_conn = 1;
    if (!s_seed && getrandom(&s_seed, sizeof s_seed, 0) != sizeof s_seed)
        s_seed = kvt_now_ns() ^ (uint64_t)getpid();
    self->by_instance = zhashx_new();
    self->by_rid = zhashx_new();
    kvt_assert(self->by_instance && self->by_rid);
    zhashx_set_destructor(self->by_instance, s_session_free);
    zhashx_set_key_hasher(self->by_instance, s_name_hash);
    zhashx_set_key_hasher(self->by_rid, s_rid_hash);
    zhashx_set_key_comparator(self->by_rid, s_rid_cmp);
    zhashx_set_key_duplicator(self->by_rid, NULL); /* the key lives in the connection */
    zhashx_set_key_destructor(self->by_rid, NULL);
    self->on_new = on_new;
    self->next_owner = 1;
    self->on_gone = on_gone;
    self->ctx = ctx;
    return self;
}

void kvt_sessions_destroy(kvt_sessions_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_sessions_t *self = *self_p;
    pthread_mutex_lock(&self->lock);
    for (kvt_conn_t *c; (c = zhashx_first(self->by_rid)) != NULL;)
        s_conn_retire(self, c);
    pthread_mutex_unlock(&self->lock);
    zhashx_destroy(&self->by_rid);
    zhashx_destroy(&self->by_instance);
    free(self->by_fd);
    pthread_mutex_destroy(&self->lock);
    free(self);
    *self_p = NULL;
}

/* ---- HELLO, BYE, PING ---- */

int kvt_sessions_hello(kvt_sessions_t *self, kvt_conn_t *c, const char *instance,
                       const char *client, const char *token, uint64_t now_ms, uint64_t *owner,
                       char *token_out, bool *created, char *err, size_t errlen)
{
    int rc = 0;
    *created = false;
    pthread_mutex_lock(&self->lock);
    s_session_t *s = zhashx_lookup(self->by_instance, instance);
    bool joined = s && s_acts_for(c, s);
    if (s && !joined && !(token && s_token_eq(token, s->token))) {
        snprintf(err, errlen,
                 "instance '%.64s' belongs to another connection: choose another name, or pass "
                 "the token its first HELLO returned to share it",
                 instance);
        rc = KVT_EBADREQ;
        goto out;
    }
    if (!joined && c->ninst >= self->lim.max_instances_per_conn) {
        snprintf(err, errlen,
                 "this connection already acts for %u instances (max_instances_per_connection): "
                 "say BYE to one first",
                 c->ninst);
        rc = KVT_EBADREQ;
        goto out;
    }
    uint64_t id = 0;
    if (!s && self->on_new && (rc = self->on_new(self->ctx, &id, err, errlen)) != 0)
        goto out;
    if (!s && !self->on_new)
        id = self->next_owner++;
    if (!s) {
        s = calloc(1, sizeof *s);
        kvt_assert(s);
        s->instance = strdup(instance);
        kvt_assert(s->instance);
        s->owner = id;
        s_new_token(s->token);
        zhashx_insert(self->by_instance, instance, s);
        *created = true;
    }
    free(s->client);
    s->client = strdup(client);
    kvt_assert(s->client);
    s_link(c, s);
    c->dropped[0] = '\0';
    s->last_seen_ms = now_ms;
    *owner = s->owner;
    memcpy(token_out, s->token, KVT_TOKEN_HEX + 1);
out:
    pthread_mutex_unlock(&self->lock);
    return rc;
}

int kvt_sessions_bye(kvt_sessions_t *self, kvt_conn_t *c, const char *instance, uint64_t *released,
                     char *err, size_t errlen)
{
    *released = 0;
    pthread_mutex_lock(&self->lock);
    s_session_t *s = zhashx_lookup(self->by_instance, instance);
    if (!s || !s_acts_for(c, s)) {
        bool dropped = strcmp(c->dropped, instance) == 0;
        pthread_mutex_unlock(&self->lock);
        if (dropped) {
            snprintf(err, errlen, "instance '%.64s' was already dropped (silent for over lease_ms)",
                     instance);
            return KVT_ENOINST;
        }
        snprintf(err, errlen,
                 "this connection did not say HELLO as instance '%.64s': BYE ends only the "
                 "connection's own instances",
                 instance);
        return KVT_EBADREQ;
    }
    uint64_t owner = s_session_remove(self, s, false);
    pthread_mutex_unlock(&self->lock);
    *released = self->on_gone ? self->on_gone(self->ctx, owner, false) : 0;
    return 0;
}

int kvt_sessions_check(kvt_sessions_t *self, const kvt_conn_t *c, const char *instance, char *err,
                       size_t errlen)
{
    pthread_mutex_lock(&self->lock);
    s_session_t *s = zhashx_lookup(self->by_instance, instance);
    bool ok = s && s_acts_for(c, s);
    pthread_mutex_unlock(&self->lock);
    if (ok)
        return 0;
    snprintf(err, errlen,
             "this connection does not act for instance '%.64s' (dropped after lease_ms of "
             "silence, or never said HELLO here): say HELLO again",
             instance);
    return KVT_ENOINST;
}

/* ---- periodic ---- */

/* shutdown() of a connection's descriptor: libzmq sees the end of the stream, closes it and
 * frees every message queued for it. Only connections with replies stalled for seconds are
 * cut, and a connection libzmq closed itself frees its queue at once (no longer stalled), so
 * the descriptor is still this connection's even if its close has not been reported yet. */
static void s_cut(kvt_sessions_t *self, kvt_conn_t *c, s_cut_reason_t why, uint64_t now_ms)
{
    c->cut = true;
    atomic_fetch_add_explicit(&self->cuts[why], 1, memory_order_relaxed);
    uint64_t pending = atomic_load(&c->pending), pinned = atomic_load(&c->pinned),
             backlog = atomic_load(&c->backlog), since = atomic_load(&c->progress_ms);
    const char *name = c->ninst ? c->inst[c->ninst - 1]->instance : "(no instance)";
    if (c->fd >= 0)
        shutdown(c->fd, SHUT_RDWR);
    kvt_log(KVT_LOG_WARN,
            "connection %llu (instance %.64s) %s: disconnected (%llu replies unread, %llu bytes "
            "of replies, %llu arena bytes pinned, none sent for %llu ms)",
            (unsigned long long)c->id, name,
            why == S_CUT_STALLED ? "stopped reading its replies"
                                 : "left more reply bytes unread than max_reply_backlog",
            (unsigned long long)pending, (unsigned long long)backlog, (unsigned long long)pinned,
            (unsigned long long)(now_ms > since ? now_ms - since : 0));
}

size_t kvt_sessions_sweep(kvt_sessions_t *self, uint64_t now_ms)
{
    size_t cap = 16, n = 0;
    uint64_t *owners = malloc(cap * sizeof *owners);
    char **names = malloc(cap * sizeof *names);
    kvt_assert(owners && names);
    pthread_mutex_lock(&self->lock);
    for (s_session_t *s = zhashx_first(self->by_instance); s; s = zhashx_next(self->by_instance))
        if (now_ms > s->last_seen_ms && now_ms - s->last_seen_ms > self->lim.lease_ms) {
            if (n == cap) {
                cap *= 2;
                owners = realloc(owners, cap * sizeof *owners);
                names = realloc(names, cap * sizeof *names);
                kvt_assert(owners && names);
            }
            owners[n] = s->owner;
            names[n] = strdup(s->instance);
            kvt_assert(names[n]);
            n++;
        }
    for (size_t i = 0; i < n; i++)
        s_session_remove(self, zhashx_lookup(self->by_instance, names[i]), true);
    kvt_conn_t *idle[64];
    size_t nidle = 0;
    for (kvt_conn_t *c = zhashx_first(self->by_rid); c; c = zhashx_next(self->by_rid)) {
        uint64_t pending = atomic_load_explicit(&c->pending, memory_order_relaxed);
        uint64_t since = atomic_load_explicit(&c->progress_ms, memory_order_relaxed);
        if (c->cut) {
            continue;
        } else if (pending && now_ms > since && now_ms - since > self->lim.reply_timeout_ms) {
            s_cut(self, c, S_CUT_STALLED, now_ms);
        } else if (pending && atomic_load_explicit(&c->backlog, memory_order_relaxed) >
                                  self->lim.max_reply_backlog) {
            s_cut(self, c, S_CUT_BACKLOG, now_ms);
        } else if (!pending && !c->ninst && !c->held && now_ms - c->last_ms > S_CONN_IDLE_MS &&
                   nidle < sizeof idle / sizeof idle[0]) {
            idle[nidle++] = c; /* retired after the walk: the table must not change under it */
        }
    }
    for (size_t i = 0; i < nidle; i++)
        s_conn_retire(self, idle[i]);
    pthread_mutex_unlock(&self->lock);
    for (size_t i = 0; i < n; i++) {
        uint64_t released = self->on_gone ? self->on_gone(self->ctx, owners[i], true) : 0;
        kvt_log(KVT_LOG_INFO, "client instance %s silent for over %llu ms: dropped (%llu leases)",
                names[i], (unsigned long long)self->lim.lease_ms, (unsigned long long)released);
        free(names[i]);
    }
    free(owners);
    free(names);
    return n;
}

size_t kvt_sessions_count(kvt_sessions_t *self)
{
    pthread_mutex_lock(&self->lock);
    size_t n = zhashx_size(self->by_instance);
    pthread_mutex_unlock(&self->lock);
    return n;
}

/* ---- /status and metrics ---- */

static json_t *s_conn_json(const kvt_conn_t *c, uint64_t now_ms)
{
    json_t *names = json_array();
    for (uint32_t i = 0; i < c->ninst; i++)
        json_array_append_new(names, json_string(c->inst[i]->instance));
    uint64_t since = atomic_load(&((kvt_conn_t *)c)->progress_ms);
    return json_pack("{s:I,s:i,s:o,s:I,s:I,s:I,s:I,s:b}", "id", (json_int_t)c->id, "fd", c->fd,
                     "instances", names, "replies_pending",
                     (json_int_t)atomic_load(&((kvt_conn_t *)c)->pending), "reply_bytes",
                     (json_int_t)atomic_load(&((kvt_conn_t *)c)->backlog), "pinned_bytes",
                     (json_int_t)atomic_load(&((kvt_conn_t *)c)->pinned), "stalled_ms",
                     (json_int_t)(now_ms > since ? now_ms - since : 0), "cut", c->cut);
}

json_t *kvt_sessions_json(kvt_sessions_t *self, uint64_t now_ms, kvt_owner_bytes_fn leased,
                          void *ctx)
{
    json_t *clients = json_array(), *busy = json_array();
    uint64_t pending = 0, pinned = 0, backlog = 0;
    pthread_mutex_lock(&self->lock);
    size_t total = zhashx_size(self->by_instance), nconns = zhashx_size(self->by_rid);
    size_t listed = 0;
    for (s_session_t *s = zhashx_first(self->by_instance); s && listed < S_STATUS_CLIENTS;
         s = zhashx_next(self->by_instance), listed++)
        json_array_append_new(
            clients,
            json_pack("{s:s,s:s,s:I,s:I,s:I,s:I,s:I}", "instance", s->instance, "client", s->client,
                      "owner", (json_int_t)s->owner, "connections", (json_int_t)s->nconns,
                      "idle_ms",
                      (json_int_t)(now_ms > s->last_seen_ms ? now_ms - s->last_seen_ms : 0),
                      "requests", (json_int_t)s->requests, "leased_bytes",
                      (json_int_t)(leased ? leased(ctx, s->owner) : 0)));
    for (kvt_conn_t *c = zhashx_first(self->by_rid); c; c = zhashx_next(self->by_rid)) {
        uint64_t p = atomic_load(&c->pending);
        pending += p;
        pinned += atomic_load(&c->pinned);
        backlog += atomic_load(&c->backlog);
        if (p && json_array_size(busy) < S_STATUS_CONNS)
            json_array_append_new(busy, s_conn_json(c, now_ms));
    }
    pthread_mutex_unlock(&self->lock);
    json_t *cuts = json_object();
    for (int i = 0; i < S_CUT_REASONS; i++)
        json_object_set_new(cuts, s_cut_names[i],
                            json_integer((json_int_t)atomic_load(&self->cuts[i])));
    return json_pack("{s:o,s:I,s:{s:I,s:I,s:I,s:I,s:o,s:o}}", "clients", clients, "clients_total",
                     (json_int_t)total, "connections", "known", (json_int_t)nconns,
                     "replies_pending", (json_int_t)pending, "reply_bytes", (json_int_t)backlog,
                     "pinned_bytes", (json_int_t)pinned, "cut", cuts, "with_replies_pending", busy);
}

static void s_gauge(kvt_sample_fn emit, void *ctx, const char *name, const char *help, double v)
{
    kvt_sample_t s = {.name = name, .help = help, .kind = KVT_METRIC_GAUGE, .value = v};
    emit(ctx, &s);
}

void kvt_sessions_metrics_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    kvt_sessions_t *self = ctx;
    uint64_t pending = 0, pinned = 0, backlog = 0;
    pthread_mutex_lock(&self->lock);
    double instances = (double)zhashx_size(self->by_instance);
    for (kvt_conn_t *c = zhashx_first(self->by_rid); c; c = zhashx_next(self->by_rid)) {
        pending += atomic_load(&c->pending);
        pinned += atomic_load(&c->pinned);
        backlog += atomic_load(&c->backlog);
    }
    pthread_mutex_unlock(&self->lock);
    s_gauge(emit, emit_ctx, "clients_connected",
            "Client instances that said HELLO and are neither gone nor silent past lease_ms.",
            instances);
    s_gauge(emit, emit_ctx, "reply_pending", "Replies handed to ZeroMQ and not yet sent.",
            (double)pending);
    s_gauge(emit, emit_ctx, "reply_pinned_bytes", "L1 bytes pinned by GET replies not yet sent.",
            (double)pinned);
    s_gauge(emit, emit_ctx, "reply_backlog_bytes", "Daemon memory held by replies not yet sent.",
            (double)backlog);
    for (int i = 0; i < S_CUT_REASONS; i++) {
        kvt_sample_t s = {.name = "connections_cut_total",
                          .help = "Connections the daemon closed because they did not read "
                                  "their replies.",
                          .kind = KVT_METRIC_COUNTER,
                          .label = "reason",
                          .label_value = s_cut_names[i],
                          .value = (double)atomic_load(&self->cuts[i])};
        emit(emit_ctx, &s);
    }
}
