/* Unit tests of storage/kvt_cache, the service under both doors, with a real L1 (8 MiB in
 * /dev/shm, allow_unpinned) and the mock L2: the owner registry (ids, max_instances across
 * kinds, listeners told with the kind, leases released on close), the tiered lookup (answered
 * at once without an L2 part; handed back through the caller's queue after the probe, or after
 * the loads with until_loaded; a wait for loads called off by kvt_cache_lookup_cancel), and
 * shutdown (kvt_cache_quiesce: queued lookups come back without a probe). Waits are bounded
 * (10 s); the only timing assumed is that a 300 ms mock load is still running 20 ms in. */
#include "kvt_cache.h"
#include "kvt_config.h"
#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_queue.h"
#include "kvt_supervisor.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#define N 4
#define OBJ 8192u
#define NS "test-cache/ns"

typedef struct {
    kvt_config_t *cfg;
    kvt_sup_t *sup;
    kvt_cache_t *cache;
    kvt_queue_t *done;
    kvt_key_t keys[N];
    int gone[3];
    uint64_t last_gone;
} rig_t;

static kvt_ns_t s_ns(void)
{
    return (kvt_ns_t){.name = (const uint8_t *)NS, .name_len = (uint32_t)strlen(NS)};
}

static void s_set(rig_t *g, const char *name, const char *value)
{
    char err[KVT_ERR_LEN] = "";
    if (kvt_config_set(g->cfg, name, value, false, err, sizeof err))
        fail_msg("%s=%s: %s", name, value, err);
}

static void s_open(rig_t *g, const char *l2, const char *max_instances)
{
    char err[KVT_ERR_LEN] = "";
    memset(g, 0, sizeof *g);
    g->cfg = kvt_config_new();
    s_set(g, "l1_size", "8M");
    s_set(g, "allow_unpinned", "true");
    s_set(g, "l1.hugepages", "off");
    s_set(g, "l1.adopt", "false");
    s_set(g, "l2", l2);
    s_set(g, "max_instances", max_instances);
    g->sup = kvt_sup_new(NULL);
    int code = 0;
    g->cache = kvt_cache_new(g->cfg, g->sup, &code, err, sizeof err);
    if (!g->cache)
        fail_msg("cache: %s", err);
    assert_int_equal(kvt_cache_start(g->cache), 0);
    g->done = kvt_queue_new(KVT_QUEUE_BOUNDED_BY_CALLER, KVT_QUEUE_FD, err, sizeof err);
    assert_non_null(g->done);
    for (unsigned i = 0; i < N; i++) {
        memset(g->keys[i].b, 0x5a, KVT_KEY_LEN);
        memcpy(g->keys[i].b, &i, sizeof i);
    }
}

static void s_close(rig_t *g)
{
    kvt_cache_quiesce(g->cache);
    kvt_cache_stop(g->cache);
    kvt_cache_destroy(&g->cache);
    assert_null(g->cache);
    kvt_queue_destroy(&g->done);
    kvt_sup_destroy(&g->sup);
    kvt_config_destroy(&g->cfg);
}

static void s_gone(void *ctx, kvt_owner_kind_t kind, uint64_t owner, bool expired)
{
    rig_t *g = ctx;
    (void)expired;
    g->gone[kind]++;
    g->last_gone = owner;
}

static int s_fill(void *ctx, uint8_t *base, const kvt_slot_t *slots, uint32_t n, uint64_t *failed,
                  uint32_t *nfailed, uint64_t *sums, char *err, size_t errlen)
{
    (void)ctx, (void)sums, (void)failed, (void)nfailed, (void)err, (void)errlen;
    for (uint32_t i = 0; i < n; i++)
        memset(base + slots[i].offset, (int)(0x40 + i), slots[i].length);
    return 0;
}

/* The N objects stored (as the daemon), written behind to L2, then dropped from L1. */
static void s_in_l2_only(rig_t *g)
{
    kvt_ns_t ns = s_ns();
    uint64_t sizes[N];
    uint32_t stored = 0;
    char err[KVT_ERR_LEN] = "";
    for (int i = 0; i < N; i++)
        sizes[i] = OBJ;
    kvt_l1_t *l1 = kvt_cache_l1(g->cache);
    assert_int_equal(kvt_l1_write(l1, &ns, g->keys, NULL, N, sizes, 0, false, s_fill, NULL,
                                  &stored, NULL, err, sizeof err),
                     0);
    assert_int_equal(stored, N);
    uint64_t found[N];
    for (int t = 0; t < 1000; t++) {
        if (kvt_l2mgr_lookup(kvt_cache_l2(g->cache), &ns, g->keys, N, kvt_now_ms() + 1000, found) ==
            N)
            break;
        usleep(10000);
    }
    assert_int_equal(
        kvt_l2mgr_lookup(kvt_cache_l2(g->cache), &ns, g->keys, N, kvt_now_ms() + 1000, found), N);
    uint64_t removed = 0;
    assert_int_equal(kvt_l1_clear(l1, (const uint8_t *)NS, (uint32_t)strlen(NS), &removed), 0);
    assert_int_equal(removed, N);
}

static kvt_lookup_t s_lookup(rig_t *g, bool prefetch, bool until_loaded)
{
    return (kvt_lookup_t){.owner = KVT_OWNER_DAEMON,
                          .ns = s_ns(),
                          .keys = g->keys,
                          .n = N,
                          .prefetch = prefetch,
                          .until_loaded = until_loaded,
                          .done = g->done};
}

static kvt_lookup_t *s_back(rig_t *g, int64_t timeout_ms)
{
    kvt_lookup_t *lk = NULL;
    if (kvt_queue_pop(g->done, (void **)&lk, timeout_ms) != 0)
        return NULL;
    kvt_queue_task_done(g->done, 1);
    return lk;
}

static void test_owners(void **state)
{
    (void)state;
    rig_t g;
    s_open(&g, "none", "3");
    kvt_cache_on_owner_gone(g.cache, s_gone, &g);
    uint64_t a, b, c, d;
    char err[KVT_ERR_LEN] = "";
    assert_int_equal(kvt_cache_owner_open(g.cache, KVT_OWNER_V1, &a, err, sizeof err), 0);
    assert_int_equal(kvt_cache_owner_open(g.cache, KVT_OWNER_LMCACHE, &b, err, sizeof err), 0);
    assert_int_equal(kvt_cache_owner_open(g.cache, KVT_OWNER_V1, &c, err, sizeof err), 0);
    assert_true(a != b && b != c && a != c && a != KVT_OWNER_DAEMON);
    /* the ceiling counts both kinds */
    assert_int_equal(kvt_cache_owner_open(g.cache, KVT_OWNER_LMCACHE, &d, err, sizeof err),
                     KVT_EBUSY);
    assert_non_null(strstr(err, "max_instances (3)"));
    assert_int_equal(kvt_cache_owners(g.cache, KVT_OWNER_V1), 2);
    assert_int_equal(kvt_cache_owners(g.cache, KVT_OWNER_LMCACHE), 1);
    assert_int_equal(kvt_cache_owners(g.cache, 0), 3);
    /* a lease of b goes with it, and the listeners hear of it with its kind */
    kvt_ns_t ns = s_ns();
    kvt_slot_t slots[N];
    uint32_t n = 0;
    uint64_t lease = 0;
    assert_int_equal(kvt_l1_reserve(kvt_cache_l1(g.cache), b, &ns, g.keys, N, NULL, OBJ, slots, &n,
                                    &lease, err, sizeof err),
                     0);
    assert_int_equal(n, N);
    assert_int_equal(kvt_cache_owner_close(g.cache, b, false), 1);
    assert_int_equal(g.gone[KVT_OWNER_LMCACHE], 1);
    assert_int_equal(g.last_gone, b);
    assert_int_equal(kvt_l1_release(kvt_cache_l1(g.cache), b, lease), KVT_EUNKLEASE);
    assert_int_equal(kvt_cache_owner_close(g.cache, b, false), 0); /* closed already */
    assert_int_equal(g.gone[KVT_OWNER_LMCACHE], 1);
    assert_int_equal(kvt_cache_owner_open(g.cache, KVT_OWNER_LMCACHE, &d, err, sizeof err), 0);
    assert_true(d != b);
    kvt_cache_owner_close(g.cache, a, true);
    assert_int_equal(g.gone[KVT_OWNER_V1], 1);
    s_close(&g);
}

/* One rule for both kinds: leases void past lease_ms, the owner closed past its keep-alive
 * (v1: lease_ms; LMCache: lmcache.reap_timeout_s, never below lease_ms, 0 = never). */
static void test_liveness_rule(void **state)
{
    (void)state;
    rig_t g;
    s_open(&g, "none", "3");
    s_set(&g, "lease_ms", "1000");
    s_set(&g, "lmcache.reap_timeout_s", "5");
    assert_int_equal(kvt_cache_owner_keepalive_ms(g.cache, KVT_OWNER_V1), 1000);
    assert_int_equal(kvt_cache_owner_keepalive_ms(g.cache, KVT_OWNER_LMCACHE), 5000);
    assert_int_equal(kvt_cache_owner_liveness(g.cache, KVT_OWNER_V1, 1000), KVT_OWNER_ALIVE);
    assert_int_equal(kvt_cache_owner_liveness(g.cache, KVT_OWNER_V1, 1001), KVT_OWNER_EXPIRED);
    assert_int_equal(kvt_cache_owner_liveness(g.cache, KVT_OWNER_LMCACHE, 1000), KVT_OWNER_ALIVE);
    assert_int_equal(kvt_cache_owner_liveness(g.cache, KVT_OWNER_LMCACHE, 1001),
                     KVT_OWNER_LEASES_VOID);
    assert_int_equal(kvt_cache_owner_liveness(g.cache, KVT_OWNER_LMCACHE, 5001),
                     KVT_OWNER_EXPIRED);
    s_set(&g, "lmcache.reap_timeout_s", "0"); /* never for silence; leases still go */
    assert_int_equal(kvt_cache_owner_liveness(g.cache, KVT_OWNER_LMCACHE, 86400000),
                     KVT_OWNER_LEASES_VOID);
    s_set(&g, "lease_ms", "30000"); /* a reap shorter than the lease waits for the lease */
    s_set(&g, "lmcache.reap_timeout_s", "1");
    assert_int_equal(kvt_cache_owner_keepalive_ms(g.cache, KVT_OWNER_LMCACHE), 30000);
    assert_int_equal(kvt_cache_owner_liveness(g.cache, KVT_OWNER_LMCACHE, 2000), KVT_OWNER_ALIVE);
    s_close(&g);
}

static void test_lookup_without_l2_is_answered_at_once(void **state)
{
    (void)state;
    rig_t g;
    s_open(&g, "none", "16");
    kvt_lookup_t lk = s_lookup(&g, true, false);
    lk.lock = true;
    assert_false(kvt_cache_lookup(g.cache, &lk));
    assert_int_equal(lk.rc, 0);
    assert_int_equal(lk.hits, 0);
    assert_int_equal(lk.lease, 0);
    assert_true(lk.job != 0); /* done at once: PREFETCH_STATUS answers it */
    bool done = false;
    uint32_t loaded = 9, hits = 9;
    assert_int_equal(
        kvt_prefetch_status(kvt_cache_prefetch(g.cache), lk.job, &done, &loaded, &hits), 0);
    assert_true(done);
    assert_int_equal(hits, 0);
    s_close(&g);
}

static void test_lookup_l2_part_comes_back(void **state)
{
    (void)state;
    rig_t g;
    s_open(&g, "mock:latency_ms=0", "16");
    s_in_l2_only(&g);
    /* after the probe: the hits, a job still loading (or done), nothing in L1 yet counted */
    kvt_lookup_t lk = s_lookup(&g, true, false);
    assert_true(kvt_cache_lookup(g.cache, &lk));
    assert_ptr_equal(s_back(&g, 10000), &lk);
    assert_int_equal(lk.rc, 0);
    assert_int_equal(lk.l1_hits, 0);
    assert_int_equal(lk.hits, N);
    assert_true(lk.job != 0);
    /* until_loaded: back when the loads are done, and then L1 has them */
    uint64_t removed = 0;
    for (int t = 0; t < 1000; t++) { /* the first lookup's loads land first */
        bool done = false;
        uint32_t loaded = 0, hits = 0;
        kvt_prefetch_status(kvt_cache_prefetch(g.cache), lk.job, &done, &loaded, &hits);
        if (done)
            break;
        usleep(10000);
    }
    kvt_l1_clear(kvt_cache_l1(g.cache), (const uint8_t *)NS, (uint32_t)strlen(NS), &removed);
    kvt_lookup_t lk2 = s_lookup(&g, true, true);
    assert_true(kvt_cache_lookup(g.cache, &lk2));
    assert_ptr_equal(s_back(&g, 10000), &lk2);
    assert_int_equal(lk2.hits, N);
    assert_int_equal(lk2.loaded, N);
    kvt_lookup_t l1only = s_lookup(&g, false, false);
    l1only.done = NULL; /* no queue: the L1 part only */
    assert_false(kvt_cache_lookup(g.cache, &l1only));
    assert_int_equal(l1only.l1_hits, N);
    assert_null(s_back(&g, 0));
    s_close(&g);
}

static void test_cancel_and_quiesce(void **state)
{
    (void)state;
    rig_t g;
    s_open(&g, "mock:latency_ms=150", "16");
    s_in_l2_only(&g);
    /* a wait for loads called off: it never comes back */
    kvt_lookup_t lk = s_lookup(&g, true, true);
    assert_true(kvt_cache_lookup(g.cache, &lk));
    bool cancelled = false;
    for (int t = 0; t < 1000 && !cancelled; t++) {
        cancelled = kvt_cache_lookup_cancel(g.cache, &lk);
        if (!cancelled)
            usleep(5000);
    }
    assert_true(cancelled);
    assert_null(s_back(&g, 1500)); /* N loads of 150 ms finish meanwhile, unannounced */
    assert_false(kvt_cache_lookup_cancel(g.cache, &lk));
    /* quiesced: a lookup queued then comes back with its L1 part only, without a probe */
    uint64_t removed = 0;
    kvt_l1_clear(kvt_cache_l1(g.cache), (const uint8_t *)NS, (uint32_t)strlen(NS), &removed);
    kvt_cache_quiesce(g.cache);
    kvt_lookup_t q = s_lookup(&g, false, false);
    uint64_t t0 = kvt_now_ms();
    assert_true(kvt_cache_lookup(g.cache, &q));
    assert_ptr_equal(s_back(&g, 10000), &q);
    assert_int_equal(q.hits, 0);
    assert_true(kvt_now_ms() - t0 < 150); /* no 150 ms probe ran */
    s_close(&g);
}

int main(void)
{
    kvt_log_set_level(KVT_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_owners),
        cmocka_unit_test(test_liveness_rule),
        cmocka_unit_test(test_lookup_without_l2_is_answered_at_once),
        cmocka_unit_test(test_lookup_l2_part_comes_back),
        cmocka_unit_test(test_cancel_and_quiesce),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
