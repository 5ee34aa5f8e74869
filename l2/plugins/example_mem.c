/* DESIGN: an example L2 adapter plugin, kind "example-mem": objects in process memory, in a
 * chained hash table under one mutex. It shows what a plugin needs and nothing more: the
 * kvt_l2_ops_t table of l2/kvt_l2.h, the KVT_E* codes of common/kvt_error.h (header only: a
 * plugin links no daemon symbol, so it loads into any build of kvtierd with the same ABI),
 * and one exported function, kvt_l2_plugin_v1. Everything else is static.
 *
 * Build: cc -std=gnu11 -O2 -shared -fPIC -Icommon -Il2 l2/plugins/example_mem.c -lpthread
 *          -o kvtier-l2-example.so
 * Use:   plugin:/path/kvtier-l2-example.so (l2/kvt_l2_plugin.h loads it)
 *
 * It implements ABI 2 (the vectored storev/loadv the daemon calls) and, for plugins written
 * against ABI 1, the plain store/load. Built with -DKVT_EXAMPLE_ABI=1 it presents an ABI 1
 * table (what an old plugin looks like; `make` builds build/kvtier-l2-example-abi1.so so the
 * tests can check that such plugins still load and work).
 *
 * Spec: "" or "capacity=BYTES" (plain decimal; 0 or absent means unlimited). Contract notes:
 * store replaces atomically under the lock; load copies under the lock, so a concurrent
 * replace never tears; a store past capacity is KVT_ENOSPC. Up to 4 threads call in at once. */
#include "kvt_error.h"
#include "kvt_l2.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define S_BUCKETS 4096 /* fixed: an example, not a production index */

#ifndef KVT_EXAMPLE_ABI
#define KVT_EXAMPLE_ABI KVT_L2_ABI
#endif

typedef struct s_obj {
    struct s_obj *next;
    char name[KVT_L2_NAME_LEN];
    size_t len;
    unsigned char data[];
} s_obj_t;

typedef struct {
    pthread_mutex_t lock;
    s_obj_t *buckets[S_BUCKETS];
    uint64_t capacity, bytes, objects;
} s_mem_t;

/* FNV-1a: names are already hashes, any mixing will do. */
static size_t s_bucket(const char *name)
{
    uint32_t h = 2166136261u;
    for (; *name; name++)
        h = (h ^ (unsigned char)*name) * 16777619u;
    return h % S_BUCKETS;
}

static int s_name_ok(const char *name)
{
    size_t n = strnlen(name, KVT_L2_NAME_LEN);
    return n > 0 && n < KVT_L2_NAME_LEN;
}

/* The link that points at `name`'s object (or at the NULL ending its chain). Lock held. */
static s_obj_t **s_find(s_mem_t *m, const char *name)
{
    s_obj_t **p = &m->buckets[s_bucket(name)];
    while (*p && strcmp((*p)->name, name) != 0)
        p = &(*p)->next;
    return p;
}

static void s_close(void *state)
{
    s_mem_t *m = state;
    if (!m)
        return;
    for (size_t i = 0; i < S_BUCKETS; i++) {
        s_obj_t *o = m->buckets[i];
        while (o) {
            s_obj_t *next = o->next;
            free(o);
            o = next;
        }
    }
    pthread_mutex_destroy(&m->lock);
    free(m);
}

static int s_open(const char *args, void **state, char *err, size_t errlen)
{
    uint64_t capacity = 0;
    if (args && *args) {
        char *end;
        errno = 0;
        const char *v = strncmp(args, "capacity=", 9) == 0 ? args + 9 : NULL;
        unsigned long long c = v ? strtoull(v, &end, 10) : 0;
        if (!v || *v < '0' || *v > '9' || errno || *end != '\0') {
            snprintf(err, errlen, "example-mem: bad spec \"%s\" (want capacity=BYTES)", args);
            return KVT_EINVAL;
        }
        capacity = c;
    }
    s_mem_t *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(err, errlen, "example-mem: out of memory");
        return KVT_ENOMEM;
    }
    pthread_mutex_init(&m->lock, NULL);
    m->capacity = capacity;
    *state = m;
    return 0;
}

static int s_storev(void *state, const char *name, const struct iovec *iov, int iovcnt)
{
    s_mem_t *m = state;
    if (!s_name_ok(name) || iovcnt < 1)
        return KVT_EINVAL;
    size_t len = 0;
    for (int i = 0; i < iovcnt; i++)
        len += iov[i].iov_len;
    if (m->capacity && len > m->capacity)
        return KVT_ENOSPC;
    s_obj_t *o = malloc(sizeof *o + len);
    if (!o)
        return KVT_ENOMEM;
    snprintf(o->name, sizeof o->name, "%s", name);
    o->len = len;
    size_t off = 0;
    for (int i = 0; i < iovcnt; off += iov[i++].iov_len)
        if (iov[i].iov_len)
            memcpy(o->data + off, iov[i].iov_base, iov[i].iov_len);
    int rc = 0;
    pthread_mutex_lock(&m->lock);
    s_obj_t **p = s_find(m, name);
    s_obj_t *old = *p;
    uint64_t bytes = m->bytes - (old ? old->len : 0) + len;
    if (m->capacity && bytes > m->capacity) {
        rc = KVT_ENOSPC;
    } else {
        o->next = old ? old->next : NULL;
        *p = o;
        m->bytes = bytes;
        m->objects += old ? 0 : 1;
        o = old; /* freed below, outside the lock */
    }
    pthread_mutex_unlock(&m->lock);
    free(o);
    return rc;
}

static int s_lookup(void *state, const char *name, size_t *len)
{
    s_mem_t *m = state;
    if (!s_name_ok(name))
        return KVT_EINVAL;
    pthread_mutex_lock(&m->lock);
    const s_obj_t *o = *s_find(m, name);
    if (o)
        *len = o->len;
    pthread_mutex_unlock(&m->lock);
    return o ? 0 : KVT_ENOTFOUND;
}

static int s_store(void *state, const char *name, const void *data, size_t len)
{
    struct iovec iov = {(void *)data, len};
    return s_storev(state, name, &iov, 1);
}

static int s_loadv(void *state, const char *name, const struct iovec *iov, int iovcnt, size_t *len)
{
    s_mem_t *m = state;
    if (!s_name_ok(name) || iovcnt < 1)
        return KVT_EINVAL;
    size_t cap = 0;
    for (int i = 0; i < iovcnt; i++)
        cap += iov[i].iov_len;
    int rc = 0;
    pthread_mutex_lock(&m->lock);
    const s_obj_t *o = *s_find(m, name);
    if (!o) {
        rc = KVT_ENOTFOUND;
    } else {
        *len = o->len;
        if (o->len > cap)
            rc = KVT_ENOSPC;
        for (size_t off = 0, i = 0; !rc && off < o->len; i++) { /* scatter */
            size_t k = o->len - off < iov[i].iov_len ? o->len - off : iov[i].iov_len;
            memcpy(iov[i].iov_base, o->data + off, k);
            off += k;
        }
    }
    pthread_mutex_unlock(&m->lock);
    return rc;
}

static int s_load(void *state, const char *name, void *buf, size_t cap, size_t *len)
{
    struct iovec iov = {buf, cap};
    return s_loadv(state, name, &iov, 1, len);
}

static int s_remove(void *state, const char *name)
{
    s_mem_t *m = state;
    if (!s_name_ok(name))
        return KVT_EINVAL;
    pthread_mutex_lock(&m->lock);
    s_obj_t **p = s_find(m, name);
    s_obj_t *o = *p;
    if (o) {
        *p = o->next;
        m->bytes -= o->len;
        m->objects--;
    }
    pthread_mutex_unlock(&m->lock);
    free(o);
    return o ? 0 : KVT_ENOTFOUND;
}

static int s_health(void *state, char *why, size_t whylen)
{
    (void)state;
    (void)why;
    (void)whylen;
    return 0; /* memory always answers */
}

static void s_usage(void *state, uint64_t *bytes, uint64_t *objects)
{
    s_mem_t *m = state;
    pthread_mutex_lock(&m->lock);
    *bytes = m->bytes;
    *objects = m->objects;
    pthread_mutex_unlock(&m->lock);
}

static const kvt_l2_ops_t s_ops = {
    .abi = KVT_EXAMPLE_ABI,
    .kind = "example-mem",
    .max_threads = 4,
    .open = s_open,
    .close = s_close,
    .store = s_store,
    .lookup = s_lookup,
    .load = s_load,
    .remove = s_remove,
    .health = s_health,
    .usage = s_usage,
#if KVT_EXAMPLE_ABI >= 2
    .storev = s_storev,
    .loadv = s_loadv,
#endif
};

/* The one exported symbol (KVT_L2_PLUGIN_SYMBOL); declared here for -Wmissing-prototypes. */
__attribute__((visibility("default"))) const kvt_l2_ops_t *kvt_l2_plugin_v1(void);

const kvt_l2_ops_t *kvt_l2_plugin_v1(void)
{
    return &s_ops;
}
