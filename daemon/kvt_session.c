/* DESIGN: two czmq hash tables under one mutex: instance -> session (owns it) and routing id
 * (hex) -> instance name. A connection is bound to at most one instance and an instance to its
 * latest connection. The number of sessions is the number of client processes on the node, so
 * the O(n) expiry sweep is cheap. Lock order: this mutex is a leaf; on_gone is called outside
 * it. */
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
    char rid[S_RID_HEX];
    uint64_t last_seen_ms;
    uint64_t requests;
} s_session_t;

struct kvt_sessions {
    pthread_mutex_t lock;
    zhashx_t *by_instance; /* instance -> s_session_t (owned) */
    zhashx_t *by_rid;      /* rid hex -> s_session_t (borrowed) */
    kvt_session_gone_fn on_gone;
    void *ctx;
};

static void s_session_free(void **item)
{
    s_session_t *s = *item;
    if (s) {
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

int kvt_sessions_hello(kvt_sessions_t *self, const uint8_t *rid, size_t rid_len,
                       const char *instance, const char *client, uint64_t now_ms)
{
    char hex[S_RID_HEX];
    s_hex(rid, rid_len, hex);
    pthread_mutex_lock(&self->lock);
    /* this connection may have spoken for another instance before */
    s_session_t *prev = zhashx_lookup(self->by_rid, hex);
    if (prev && strcmp(prev->instance, instance) != 0) {
        prev->rid[0] = '\0';
        zhashx_delete(self->by_rid, hex);
    }
    s_session_t *s = zhashx_lookup(self->by_instance, instance);
    int created = 0;
    if (!s) {
        s = calloc(1, sizeof *s);
        kvt_assert(s);
        s->instance = strdup(instance);
        s->client = strdup(client);
        kvt_assert(s->instance && s->client);
        zhashx_insert(self->by_instance, instance, s);
        created = 1;
    } else {
        if (s->rid[0] && strcmp(s->rid, hex) != 0)
            zhashx_delete(self->by_rid, s->rid);
        free(s->client);
        s->client = strdup(client);
        kvt_assert(s->client);
    }
    memcpy(s->rid, hex, sizeof hex);
    zhashx_update(self->by_rid, hex, s);
    s->last_seen_ms = now_ms;
    s->requests++;
    pthread_mutex_unlock(&self->lock);
    return created;
}

const char *kvt_sessions_touch(kvt_sessions_t *self, const uint8_t *rid, size_t rid_len,
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
    pthread_mutex_unlock(&self->lock);
    return s ? s->instance : NULL;
}

/* Unlinks a session; the caller holds the lock and frees the returned name. */
static char *s_remove_locked(kvt_sessions_t *self, s_session_t *s)
{
    char *name = strdup(s->instance);
    kvt_assert(name);
    if (s->rid[0])
        zhashx_delete(self->by_rid, s->rid);
    zhashx_delete(self->by_instance, name);
    return name;
}

int64_t kvt_sessions_bye(kvt_sessions_t *self, const char *instance)
{
    pthread_mutex_lock(&self->lock);
    s_session_t *s = zhashx_lookup(self->by_instance, instance);
    char *name = s ? s_remove_locked(self, s) : NULL;
    pthread_mutex_unlock(&self->lock);
    if (!name)
        return -1;
    uint64_t released = self->on_gone ? self->on_gone(self->ctx, name, 0) : 0;
    free(name);
    return (int64_t)released;
}

size_t kvt_sessions_expire(kvt_sessions_t *self, uint64_t now_ms, uint64_t lease_ms)
{
    zlistx_t *gone = zlistx_new();
    kvt_assert(gone);
    zlistx_set_destructor(gone, (zlistx_destructor_fn *)zstr_free);
    pthread_mutex_lock(&self->lock);
    zlistx_t *stale = zlistx_new();
    kvt_assert(stale);
    for (s_session_t *s = zhashx_first(self->by_instance); s; s = zhashx_next(self->by_instance))
        if (now_ms > s->last_seen_ms && now_ms - s->last_seen_ms > lease_ms)
            zlistx_add_end(stale, s);
    for (s_session_t *s = zlistx_first(stale); s; s = zlistx_next(stale))
        zlistx_add_end(gone, s_remove_locked(self, s));
    zlistx_destroy(&stale);
    pthread_mutex_unlock(&self->lock);
    size_t n = zlistx_size(gone);
    for (char *name = zlistx_first(gone); name; name = zlistx_next(gone)) {
        uint64_t released = self->on_gone ? self->on_gone(self->ctx, name, 1) : 0;
        kvt_log(KVT_LOG_INFO, "client instance %s silent for over %llu ms: dropped (%llu leases)",
                name, (unsigned long long)lease_ms, (unsigned long long)released);
    }
    zlistx_destroy(&gone);
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
            arr, json_pack("{s:s,s:s,s:I,s:I}", "instance", s->instance, "client", s->client,
                           "idle_ms",
                           (json_int_t)(now_ms > s->last_seen_ms ? now_ms - s->last_seen_ms : 0),
                           "requests", (json_int_t)s->requests));
    pthread_mutex_unlock(&self->lock);
    return arr;
}
