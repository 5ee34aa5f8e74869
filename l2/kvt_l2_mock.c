/* DESIGN: the "mock" L2 adapter — an in-memory store with injected latency and failures, so
 * that tests can exercise the daemon's slow-backend and failing-backend paths without a real
 * backend.
 *
 * Spec (after "mock:"): [latency_ms=N][,fail_rate=F][,seed=S][,capacity=SIZE]
 * [,corrupt_rate=F], all optional (defaults: 0, 0, 1, unlimited, 0). Every store/lookup/load/
 * remove first sleeps latency_ms, then fails with probability fail_rate. A load that does not
 * fail returns, with probability corrupt_rate, the object with one byte flipped (the object
 * held stays intact): what a backend that damages data in flight looks like to the daemon. An
 * injected failure is KVT_EUNAVAIL — what a real backend outage returns (redis), so the daemon's
 * retry/backoff path is what the mock exercises — and it happens before any state is read or
 * written: a failed store stores nothing, a failed load leaves the caller's buffer untouched.
 * health is deterministic: KVT_EUNAVAIL only when fail_rate >= 1 (every call fails), so /readyz is
 * not flapping at random in tests.
 *
 * The random draws are splitmix64 of seed + an atomic counter: thread-safe without a lock,
 * and one seed gives one sequence of draws (which thread gets which draw is up to the
 * scheduler). capacity bounds the bytes held; a store past it is KVT_ENOSPC (no eviction).
 *
 * Threads: any number; one mutex (a leaf) guards the map and the gauges, never held while
 * sleeping. */
#include "kvt_error.h"
#include "kvt_l2.h"
#include "kvt_log.h"

#include <czmq.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define S_TAG 0x4d4f434bu      /* "MOCK" */
#define S_TAG_DEAD 0xdeadbeefu /* poisoned on close */
#define S_MAX_THREADS 16
#define S_MAX_LATENCY_MS 3600000

typedef struct {
    size_t len;
    uint8_t data[];
} s_obj_t;

typedef struct {
    uint32_t tag;
    uint32_t latency_ms;
    double fail_rate;
    double corrupt_rate;
    uint64_t seed;
    uint64_t capacity; /* 0: unlimited */
    _Atomic uint64_t draws;
    pthread_mutex_t lock; /* leaf: objects, bytes */
    zhashx_t *objects;    /* name -> s_obj_t (owned) */
    uint64_t bytes;
} s_mock_t;

static void s_obj_free(void **item)
{
    free(*item);
    *item = NULL;
}

/* ---- spec -------------------------------------------------------------------------------- */

static int s_parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    char *end;
    if (*s < '0' || *s > '9')
        return KVT_EINVAL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end != '\0' || v > max)
        return KVT_EINVAL;
    *out = v;
    return 0;
}

/* "4096", "64k", "512M", "4G", "1T" (binary multiples, as in the config file). */
static int s_parse_size(const char *s, uint64_t *out)
{
    char *end;
    if (*s < '0' || *s > '9')
        return KVT_EINVAL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno)
        return KVT_EINVAL;
    unsigned shift = 0;
    switch (*end) {
    case '\0':
        break;
    case 'k':
    case 'K':
        shift = 10;
        break;
    case 'm':
    case 'M':
        shift = 20;
        break;
    case 'g':
    case 'G':
        shift = 30;
        break;
    case 't':
    case 'T':
        shift = 40;
        break;
    default:
        return KVT_EINVAL;
    }
    if (*end && end[1] != '\0')
        return KVT_EINVAL;
    if (v > (UINT64_MAX >> shift))
        return KVT_EINVAL;
    *out = (uint64_t)v << shift;
    return 0;
}

static int s_parse_spec(s_mock_t *m, const char *args, char *err, size_t errlen)
{
    static const char *const keys[] = {"latency_ms", "fail_rate", "seed", "capacity",
                                       "corrupt_rate"};
    enum { S_NKEYS = sizeof keys / sizeof keys[0] };
    bool seen[S_NKEYS] = {false};
    char *copy = strdup(args ? args : "");
    kvt_assert(copy);
    int rc = 0;
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok && rc == 0; tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        if (!eq) {
            snprintf(err, errlen, "mock: \"%s\" is not KEY=VALUE", tok);
            rc = KVT_EINVAL;
            break;
        }
        *eq = '\0';
        const char *v = eq + 1;
        size_t k = 0;
        while (k < S_NKEYS && strcmp(tok, keys[k]) != 0)
            k++;
        if (k == S_NKEYS || seen[k]) {
            snprintf(err, errlen, "mock: %s option \"%s\"", k == S_NKEYS ? "unknown" : "duplicate",
                     tok);
            rc = KVT_EINVAL;
            break;
        }
        seen[k] = true;
        uint64_t u = 0;
        switch (k) {
        case 0:
            rc = s_parse_u64(v, S_MAX_LATENCY_MS, &u);
            m->latency_ms = (uint32_t)u;
            break;
        case 1:
        case 4: {
            char *end;
            errno = 0;
            double *rate = k == 1 ? &m->fail_rate : &m->corrupt_rate;
            *rate = strtod(v, &end);
            if (errno || end == v || *end != '\0' || !(*rate >= 0 && *rate <= 1))
                rc = KVT_EINVAL; /* !(a && b) also catches NaN */
            break;
        }
        case 2:
            rc = s_parse_u64(v, UINT64_MAX, &m->seed);
            break;
        case 3:
            rc = s_parse_size(v, &m->capacity);
            break;
        }
        if (rc)
            snprintf(err, errlen, "mock: bad %s \"%s\"%s", tok, v,
                     k == 1 || k == 4 ? " (want 0..1)"
                     : k == 0         ? " (want 0..3600000)"
                                      : "");
    }
    free(copy);
    return rc;
}

/* ---- behaviour --------------------------------------------------------------------------- */

static uint64_t s_splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* One uniform draw in [0, 1) from the shared sequence. */
static double s_draw(s_mock_t *m)
{
    uint64_t n = atomic_fetch_add_explicit(&m->draws, 1, memory_order_relaxed);
    return (double)(s_splitmix64(m->seed + n * 0x9e3779b97f4a7c15ull) >> 11) * 0x1.0p-53;
}

/* Sleeps latency_ms, then 0 or the injected failure. */
static int s_delay_and_fail(s_mock_t *m)
{
    if (m->latency_ms) {
        struct timespec ts = {.tv_sec = m->latency_ms / 1000,
                              .tv_nsec = (long)(m->latency_ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
            ;
    }
    if (m->fail_rate <= 0)
        return 0;
    return s_draw(m) < m->fail_rate ? KVT_EUNAVAIL : 0;
}

static s_mock_t *s_self(void *state)
{
    s_mock_t *m = state;
    kvt_assert(m && m->tag == S_TAG);
    return m;
}

static int s_name_ok(const char *name)
{
    size_t n = strnlen(name, KVT_L2_NAME_LEN);
    return n > 0 && n < KVT_L2_NAME_LEN;
}

static void s_close(void *state)
{
    if (!state)
        return;
    s_mock_t *m = s_self(state);
    zhashx_destroy(&m->objects);
    pthread_mutex_destroy(&m->lock);
    m->tag = S_TAG_DEAD;
    free(m);
}

static int s_open(const char *args, void **state, char *err, size_t errlen)
{
    s_mock_t *m = calloc(1, sizeof *m);
    kvt_assert(m);
    m->tag = S_TAG;
    m->seed = 1; /* fixed by default: a test run is reproducible unless it asks otherwise */
    pthread_mutex_init(&m->lock, NULL);
    m->objects = zhashx_new();
    kvt_assert(m->objects);
    zhashx_set_destructor(m->objects, s_obj_free);
    int rc = s_parse_spec(m, args, err, errlen);
    if (rc) {
        s_close(m);
        return rc;
    }
    *state = m;
    return 0;
}

static int s_storev(void *state, const char *name, const struct iovec *iov, int iovcnt)
{
    s_mock_t *m = s_self(state);
    if (!s_name_ok(name) || iovcnt < 1 || iovcnt > KVT_L2_IOV_MAX)
        return KVT_EINVAL;
    size_t len = 0;
    for (int i = 0; i < iovcnt; i++)
        len += iov[i].iov_len;
    int rc = s_delay_and_fail(m);
    if (rc)
        return rc;
    if (m->capacity && len > m->capacity)
        return KVT_ENOSPC;
    /* Object bytes are a large allocation: fail softly (STYLE 4). Copied before the lock. */
    s_obj_t *o = malloc(sizeof *o + len);
    if (!o)
        return KVT_ENOMEM;
    o->len = len;
    for (size_t off = 0, i = 0; i < (size_t)iovcnt; off += iov[i++].iov_len)
        if (iov[i].iov_len)
            memcpy(o->data + off, iov[i].iov_base, iov[i].iov_len);
    pthread_mutex_lock(&m->lock);
    const s_obj_t *old = zhashx_lookup(m->objects, name);
    uint64_t bytes = m->bytes - (old ? old->len : 0) + len;
    if (m->capacity && bytes > m->capacity) {
        rc = KVT_ENOSPC;
    } else {
        zhashx_update(m->objects, name, o); /* replaces (and frees) any old object */
        m->bytes = bytes;
        o = NULL;
    }
    pthread_mutex_unlock(&m->lock);
    free(o);
    return rc;
}

static int s_lookup(void *state, const char *name, size_t *len)
{
    s_mock_t *m = s_self(state);
    if (!s_name_ok(name))
        return KVT_EINVAL;
    int rc = s_delay_and_fail(m);
    if (rc)
        return rc;
    pthread_mutex_lock(&m->lock);
    const s_obj_t *o = zhashx_lookup(m->objects, name);
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
    s_mock_t *m = s_self(state);
    if (!s_name_ok(name) || iovcnt < 1 || iovcnt > KVT_L2_IOV_MAX)
        return KVT_EINVAL;
    int rc = s_delay_and_fail(m);
    if (rc)
        return rc;
    size_t cap = 0;
    for (int i = 0; i < iovcnt; i++)
        cap += iov[i].iov_len;
    bool corrupt = m->corrupt_rate > 0 && s_draw(m) < m->corrupt_rate;
    pthread_mutex_lock(&m->lock);
    const s_obj_t *o = zhashx_lookup(m->objects, name);
    if (!o) {
        rc = KVT_ENOTFOUND;
    } else {
        *len = o->len;
        if (o->len > cap)
            rc = KVT_ENOSPC;
        /* copied under the lock: a replace cannot tear it */
        for (size_t off = 0, i = 0; !rc && off < o->len; i++) {
            size_t k = o->len - off < iov[i].iov_len ? o->len - off : iov[i].iov_len;
            memcpy(iov[i].iov_base, o->data + off, k);
            if (corrupt && off <= o->len / 2 && o->len / 2 < off + k)
                ((uint8_t *)iov[i].iov_base)[o->len / 2 - off] ^= 0x01;
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
    s_mock_t *m = s_self(state);
    if (!s_name_ok(name))
        return KVT_EINVAL;
    int rc = s_delay_and_fail(m);
    if (rc)
        return rc;
    pthread_mutex_lock(&m->lock);
    const s_obj_t *o = zhashx_lookup(m->objects, name);
    if (o) {
        m->bytes -= o->len;
        zhashx_delete(m->objects, name);
    }
    pthread_mutex_unlock(&m->lock);
    return o ? 0 : KVT_ENOTFOUND;
}

static int s_health(void *state, char *why, size_t whylen)
{
    s_mock_t *m = s_self(state);
    if (m->fail_rate >= 1) {
        snprintf(why, whylen, "mock: fail_rate=1, every call fails");
        return KVT_EUNAVAIL;
    }
    return 0;
}

static void s_usage(void *state, uint64_t *bytes, uint64_t *objects)
{
    s_mock_t *m = s_self(state);
    pthread_mutex_lock(&m->lock);
    *bytes = m->bytes;
    *objects = zhashx_size(m->objects);
    pthread_mutex_unlock(&m->lock);
}

static const kvt_l2_ops_t s_ops = {
    .abi = KVT_L2_ABI,
    .kind = "mock",
    .max_threads = S_MAX_THREADS,
    .open = s_open,
    .close = s_close,
    .store = s_store,
    .lookup = s_lookup,
    .load = s_load,
    .remove = s_remove,
    .health = s_health,
    .usage = s_usage,
    .storev = s_storev,
    .loadv = s_loadv,
};

const kvt_l2_ops_t *kvt_l2_mock_ops(void)
{
    return &s_ops;
}
