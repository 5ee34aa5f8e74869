/* DESIGN: two czmq hash tables under one mutex: instance -> session (owns it) and routing id
 * (hex) -> session (borrowed). Each session lists the routing ids bound to it so removal unbinds
 * them all. The number of sessions is the number of client processes on the node, so the O(n)
 * expiry sweep is cheap. Lock order: this mutex is a leaf; on_gone is called outside it. */
#include "kvt_session.h"

#include "kvt_log.h"

#include <czmq.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define S_RID_HEX (2 * 256 + 1)

typedef struct {
    char *instance;
    char *client;
    uint64_t owner;
    zlistx_t *rids; /* hex routing ids bound to this session */
    uint64_t last_seen_ms;
    uint64_t requests;
} s_session_t;

struct kvt_sessions {
    pthread_mutex_t lock;
    zhashx_t *by_instance; /* instance -> s_session_t (owned) */
    zhashx_t *by_rid;      /* rid hex -> s_session_t (borrowed) */
    uint64_t next_owner;
    kvt_session_gone_fn on_gone;
    void *ctx;
};

static void s_session_free(void **item)
{
    s_session_t *s = *item;
    if (s) {
        zlistx_destroy(&s->rids);
        free(s->instance);
        free(s->client);
        free(s);
        *item = NULL;
    }
}

static void s_hex(const uint8_t *rid, size_t len, char *out)
{
    static const char digits[] = "0123456789abcdef";
    if (len > 256)
        len = 256;
    for (size_t i = 0; i < len; i++) {
        out[2 * i] = digits[rid[i] >> 4];
        out[2 * i + 1] = digits[rid[i] & 15];
    }
    out[2 * len] = '\0';
}

kvt_sessions_t *kvt_sessions_new(kvt_session_gone_fn on_gone, void *ctx)
{
    kvt_sessions_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    pthread_mutex_init(&self->lock, NULL);
    self->by_instance = zhashx_new();
    self->by_rid = zhashx_new();
    kvt_assert(self->by_instance && self->by_rid);
    zhashx_set_destructor(self->by_instance, s_session_free);
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
    zhashx_destroy(&self->by_rid);
    zhashx_destroy(&self->by_instance);
    pthread_mutex_destroy(&self->lock);
    free(self);
    *self_p = NULL;
}

/* Removes `hex` from a session's list of routing ids; lock held. */
static void s_unbind(s_session_t *s, const char *hex)
{
    for (char *r = zlistx_first(s->rids); r; r = zlistx_next(s->rids))
        if (strcmp(r, hex) == 0) {
            zlistx_delete(s->rids, zlistx_cursor(s->rids));
            return;
        }
}

uint64_t kvt_sessions_hello(kvt_sessions_t *self, const uint8_t *rid, size_t rid_len,
                            const char *instance, const char *client, uint64_t now_ms,
                            bool *created)
{
    char hex[S_RID_HEX];
    s_hex(rid, rid_len, hex);
    pthread_mutex_lock(&self->lock);
    s_session_t *s = zhashx_lookup(self->by_instance, instance);
    *created = s == NULL;
    if (!s) {
        s = calloc(1, sizeof *s);
        kvt_assert(s);
        s->instance = strdup(instance);
        s->rids = zlistx_new();
        kvt_assert(s->instance && s->rids);
        zlistx_set_destructor(s->rids, (zlistx_destructor_fn *)zstr_free);
        s->owner = self->next_owner++;
        zhashx_insert(self->by_instance, instance, s);
    }
    free(s->client);
    s->client = strdup(client);
    kvt_assert(s->client);
    s_session_t *prev = zhashx_lookup(self->by_rid, hex);
    if (prev != s) {
        if (prev)
            s_unbind(prev, hex);
        char *copy = strdup(hex);
        kvt_assert(copy);
        zlistx_add_end(s->rids, copy);
        zhashx_update(self->by_rid, hex, s);
    }
    s->last_seen_ms = now_ms;
    s->requests++;
    uint64_t owner = s->owner;
    pthread_mutex_unlock(&self->lock);
    return owner;
}

uint64_t kvt_sessions_touch(kvt_sessions_t *self, const uint8_t *rid, size_t rid_len,
                            uint64_t now_ms)
{
    char hex[S_RID_HEX];
    s_hex(rid, rid_len, hex);
    pthread_mutex_lock(&self->lock);
    s_session_t *s = zhashx_lookup(self->by_rid, hex);
    if (s) {
        s->last_seen_ms = now_ms;
        s->requests++;
    }
    uint64_t owner = s ? s->owner : 0;
    pthread_mutex_unlock(&self->lock);
    return owner;
}

/* Unlinks and frees a session; lock held. Returns its owner id. */
static uint64_t s_remove_locked(kvt_sessions_t *self, s_session_t *s)
{
    uint64_t owner = s->owner;
    for (char *r = zlistx_first(s->rids); r; r = zlistx_next(s->rids))
        zhashx_delete(self->by_rid, r);
    zhashx_delete(self->by_instance, s->instance); /* frees s */
    return owner;
}

int64_t kvt_sessions_bye(kvt_sessions_t *self, const char *instance)
{
    pthread_mutex_lock(&self->lock);
    s_session_t *s = zhashx_lookup(self->by_instance, instance);
    uint64_t owner = s ? s_remove_locked(self, s) : 0;
    pthread_mutex_unlock(&self->lock);
    if (!owner)
        return -1;
    return (int64_t)(self->on_gone ? self->on_gone(self->ctx, owner, false) : 0);
}

size_t kvt_sessions_expire(kvt_sessions_t *self, uint64_t now_ms, uint64_t lease_ms)
{
    enum { S_BATCH = 64 };
    uint64_t owners[S_BATCH];
    char *names[S_BATCH];
    size_t n = 0;
    pthread_mutex_lock(&self->lock);
    for (s_session_t *s = zhashx_first(self->by_instance); s && n < S_BATCH;
         s = zhashx_next(self->by_instance))
        if (now_ms > s->last_seen_ms && now_ms - s->last_seen_ms > lease_ms) {
            owners[n] = s->owner;
            names[n] = strdup(s->instance);
            kvt_assert(names[n]);
            n++;
        }
    for (size_t i = 0; i < n; i++)
        s_remove_locked(self, zhashx_lookup(self->by_instance, names[i]));
    pthread_mutex_unlock(&self->lock);
    /* at most S_BATCH per sweep; the next sweep (100 ms later) takes the rest */
    for (size_t i = 0; i < n; i++) {
        uint64_t released = self->on_gone ? self->on_gone(self->ctx, owners[i], true) : 0;
        kvt_log(KVT_LOG_INFO, "client instance %s silent for over %llu ms: dropped (%llu leases)",
                names[i], (unsigned long long)lease_ms, (unsigned long long)released);
        free(names[i]);
    }
    return n;
}

size_t kvt_sessions_count(kvt_sessions_t *self)
{
    pthread_mutex_lock(&self->lock);
    size_t n = zhashx_size(self->by_instance);
    pthread_mutex_unlock(&self->lock);
    return n;
}

json_t *kvt_sessions_json(kvt_sessions_t *self, uint64_t now_ms)
{
    json_t *arr = json_array();
    pthread_mutex_lock(&self->lock);
    for (s_session_t *s = zhashx_first(self->by_instance); s; s = zhashx_next(self->by_instance))
        json_array_append_new(
            arr, json_pack("{s:s,s:s,s:I,s:I,s:I,s:I}", "instance", s->instance, "client",
                           s->client, "owner", (json_int_t)s->owner, "connections",
                           (json_int_t)zlistx_size(s->rids), "idle_ms",
                           (json_int_t)(now_ms > s->last_seen_ms ? now_ms - s->last_seen_ms : 0),
                           "requests", (json_int_t)s->requests));
    pthread_mutex_unlock(&self->lock);
    return arr;
}
