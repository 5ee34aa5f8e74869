/* Unit tests of storage/kvt_l2mgr through the mock and fs adapters, with a real L1 (8 MiB in
 * /dev/shm, allow_unpinned): objects committed to L1 and handed to kvt_l2mgr_on_stored reach
 * L2 (l2_stored events, kvt_l2mgr_lookup finds them with their sizes); after L1 is cleared a
 * prefetch job loads them back into L1 with their bytes; an object whose bytes come back
 * corrupt (mock corrupt_rate=1) is a miss, counted in l2_corrupt_total and announced as
 * l2_removed; an adapter that fails every call (fail_rate=1) stores nothing, finds nothing and
 * is not ready; destroy right after queueing writes writes them first (an fs
 * directory opened again afterwards holds every object). Waits poll with a 10 s cap; nothing
 * here depends on timing otherwise. */
#include "kvt_config.h"
#include "kvt_error.h"
#include "kvt_l1.h"
#include "kvt_l2.h"
#include "kvt_l2mgr.h"
#include "kvt_log.h"
#include "kvt_prefetch.h"
#include "kvt_supervisor.h"

#include <errno.h>
#include <ftw.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#define N 6
#define OBJ 10000u
#define NS "test-l2mgr/ns"

/* The fs adapter's syncfs (sync=batch) binds to this one ahead of libc's: counted, and made to
 * fail on demand. */
static atomic_int s_syncfs_calls, s_syncfs_errno;

int syncfs(int fd)
{
    atomic_fetch_add(&s_syncfs_calls, 1);
    int e = atomic_load(&s_syncfs_errno);
    if (e) {
        errno = e;
        return -1;
    }
    return (int)syscall(SYS_syncfs, fd);
}

typedef struct {
    kvt_config_t *cfg;
    kvt_sup_t *sup;
    kvt_l1_t *l1;
    kvt_prefetch_t *pf;
    kvt_l2mgr_t *mgr;
    kvt_key_t keys[N];
    atomic_uint stored, removed;
} rig_t;

static void s_on_event(void *ctx, const char *event, const kvt_ns_t *ns, const kvt_key_t *keys,
                       const uint64_t *sizes, uint32_t n, const char *adapter)
{
    rig_t *g = ctx;
    (void)keys, (void)adapter;
    assert_int_equal(ns->name_len, strlen(NS));
    assert_int_equal(ns->salt_len, 0);
    if (strcmp(event, "l2_stored") == 0) {
        assert_non_null(sizes); /* each written object's length */
        for (uint32_t i = 0; i < n; i++)
            assert_int_equal(sizes[i], OBJ);
        atomic_fetch_add(&g->stored, n);
    } else if (strcmp(event, "l2_removed") == 0) {
        assert_null(sizes);
        atomic_fetch_add(&g->removed, n);
    }
}

/* The one place that builds the namespace argument of the storage calls. */
static kvt_ns_t s_ns(void)
{
    return (kvt_ns_t){.name = (const uint8_t *)NS, .name_len = (uint32_t)strlen(NS)};
}

static void s_fill(uint8_t *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(seed * 131u + i * 7u + (i >> 9));
}

static void s_open(rig_t *g, const char *spec)
{
    char err[KVT_ERR_LEN] = "";
    memset(g, 0, sizeof *g);
    g->cfg = kvt_config_new();
    assert_int_equal(kvt_config_set(g->cfg, "l1_size", "8M", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(g->cfg, "allow_unpinned", "true", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(g->cfg, "l1.hugepages", "off", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(g->cfg, "l1.adopt", "false", false, err, sizeof err), 0);
    if (kvt_config_set(g->cfg, "l2", spec, false, err, sizeof err))
        fail_msg("l2 %s: %s", spec, err);
    g->sup = kvt_sup_new(NULL);
    g->l1 = kvt_l1_new(g->cfg, err, sizeof err);
    if (!g->l1)
        fail_msg("l1: %s", err);
    g->pf = kvt_prefetch_new(60000, 64);
    int code = 0;
    g->mgr = kvt_l2mgr_new(g->cfg, g->l1, g->pf, g->sup, &code, err, sizeof err);
    if (!g->mgr)
        fail_msg("l2mgr %s: %s", spec, err);
    assert_int_equal(kvt_l2mgr_count(g->mgr), 1);
    kvt_l2mgr_set_events(g->mgr, s_on_event, g);
    for (unsigned i = 0; i < N; i++) {
        memset(g->keys[i].b, 0x3c, KVT_KEY_LEN);
        memcpy(g->keys[i].b, &i, sizeof i);
    }
}

static void s_close(rig_t *g)
{
    kvt_l2mgr_destroy(&g->mgr);
    assert_null(g->mgr);
    kvt_prefetch_destroy(&g->pf);
    kvt_l1_destroy(&g->l1);
    kvt_sup_destroy(&g->sup);
    kvt_config_destroy(&g->cfg);
}

/* RESERVE + fill + COMMIT of the N objects as the daemon, then queued for write-behind. */
static void s_commit_and_queue(rig_t *g)
{
    kvt_ns_t ns = s_ns();
    kvt_slot_t slots[N];
    uint32_t n = 0, stored = 0;
    uint64_t lease = 0;
    char err[KVT_ERR_LEN] = "";
    assert_int_equal(kvt_l1_reserve(g->l1, KVT_OWNER_DAEMON, &ns, g->keys, N,
                                    NULL, OBJ, slots, &n, &lease, err, sizeof err),
                     0);
    assert_int_equal(n, N);
    uint8_t *base = kvt_l1_base(g->l1);
    for (unsigned i = 0; i < N; i++)
        s_fill(base + slots[i].offset, OBJ, i);
    assert_int_equal(
        kvt_l1_commit(g->l1, KVT_OWNER_DAEMON, lease, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(stored, N);
    kvt_l2mgr_on_stored(g->mgr, &ns, g->keys, N);
}

static void s_sleep_ms(unsigned ms)
{
    struct timespec ts = {0, (long)ms * 1000000L};
    nanosleep(&ts, NULL);
}

static void s_wait_stored(rig_t *g, unsigned want)
{
    for (int i = 0; i < 1000 && atomic_load(&g->stored) < want; i++)
        s_sleep_ms(10);
    assert_int_equal(atomic_load(&g->stored), want);
}

static uint32_t s_in_l1(rig_t *g, bool check_bytes)
{
    kvt_ns_t ns = s_ns();
    uint32_t found = 0;
    uint8_t want[OBJ];
    for (unsigned i = 0; i < N; i++) {
        kvt_slot_t slot;
        uint32_t got = 0;
        uint64_t lease = 0;
        kvt_l1_acquire(g->l1, KVT_OWNER_DAEMON, &ns, &g->keys[i], 1, &slot, &got,
                       &lease);
        if (got != 1)
            continue;
        found++;
        s_fill(want, OBJ, i);
        assert_int_equal(slot.length, OBJ);
        if (check_bytes)
            assert_memory_equal((uint8_t *)kvt_l1_base(g->l1) + slot.offset, want, OBJ);
        kvt_l1_release(g->l1, KVT_OWNER_DAEMON, lease);
    }
    return found;
}

/* Clears L1, looks the keys up in L2 and prefetches what it found; the job's loaded count. */
static uint32_t s_clear_and_prefetch(rig_t *g, uint32_t *hits_out)
{
    kvt_ns_t ns = s_ns();
    uint64_t removed = 0, sizes[N];
    assert_int_equal(kvt_l1_clear(g->l1, (const uint8_t *)NS, (uint32_t)strlen(NS), &removed), 0);
    assert_int_equal(removed, N);
    assert_int_equal(s_in_l1(g, false), 0);
    uint32_t hits = kvt_l2mgr_lookup(g->mgr, &ns, g->keys, N,
                                     kvt_now_ms() + 10000, sizes);
    *hits_out = hits;
    if (hits == 0)
        return 0;
    for (uint32_t i = 0; i < hits; i++)
        assert_true(sizes[i] >= OBJ); /* the payload, and the adapter's object holds more */
    uint64_t job = kvt_prefetch_start(g->pf, hits, false, kvt_now_ms());
    assert_true(job != 0);
    kvt_l2mgr_prefetch(g->mgr, job, &ns, g->keys, sizes, hits);
    bool done = false;
    uint32_t loaded = 0, h = 0;
    for (int i = 0; i < 1000 && !done; i++) {
        s_sleep_ms(10);
        assert_int_equal(kvt_prefetch_status(g->pf, job, &done, &loaded, &h), 0);
    }
    assert_true(done);
    return loaded;
}

typedef struct {
    const char *name;
    double value;
} s_metric_t;

static void s_emit(void *ctx, const kvt_sample_t *s)
{
    s_metric_t *m = ctx;
    if (strcmp(s->name, m->name) == 0)
        m->value += s->value;
}

static double s_metric(rig_t *g, const char *name)
{
    s_metric_t m = {name, 0};
    kvt_l2mgr_metrics_source(g->mgr, s_emit, &m);
    return m.value;
}

static void test_write_behind_then_prefetch(void **state)
{
    (void)state;
    rig_t g;
    s_open(&g, "mock:latency_ms=0,fail_rate=0");
    char why[256] = "";
    assert_true(kvt_l2mgr_ready(g.mgr, why, sizeof why));
    s_commit_and_queue(&g);
    s_wait_stored(&g, N);
    assert_true(s_metric(&g, "l2_stored_total") == N);
    uint32_t hits = 0;
    assert_int_equal(s_clear_and_prefetch(&g, &hits), N);
    assert_int_equal(hits, N);
    assert_int_equal(s_in_l1(&g, true), N);
    assert_true(s_metric(&g, "l2_loaded_total") == N);
    assert_true(s_metric(&g, "l2_corrupt_total") == 0);

    /* REMOVE reaches L2 too: afterwards the lookup finds nothing */
    kvt_ns_t ns = s_ns();
    kvt_l2mgr_remove(g.mgr, &ns, g.keys, N);
    uint64_t sizes[N];
    uint32_t left = N;
    for (int i = 0; i < 1000 && left; i++) {
        s_sleep_ms(10);
        left = kvt_l2mgr_lookup(g.mgr, &ns, g.keys, N, kvt_now_ms() + 1000,
                                sizes);
    }
    assert_int_equal(left, 0);
    json_t *st = kvt_l2mgr_status_json(g.mgr);
    assert_true(json_is_array(st) && json_array_size(st) == 1);
    json_decref(st);
    s_close(&g);
}

/* Every load comes back with a byte flipped: the trailer check refuses it. */
static void test_corrupt_is_a_miss(void **state)
{
    (void)state;
    rig_t g;
    s_open(&g, "mock:latency_ms=0,fail_rate=0,corrupt_rate=1");
    s_commit_and_queue(&g);
    s_wait_stored(&g, N);
    uint32_t hits = 0;
    uint32_t loaded = s_clear_and_prefetch(&g, &hits);
    assert_int_equal(hits, N);
    assert_int_equal(loaded, 0);
    assert_int_equal(s_in_l1(&g, false), 0);
    assert_true(s_metric(&g, "l2_corrupt_total") >= 1);
    assert_true(atomic_load(&g.removed) >= 1); /* the corrupt copy is removed, and said so */
    s_close(&g);
}

static void test_failing_adapter(void **state)
{
    (void)state;
    rig_t g;
    s_open(&g, "mock:latency_ms=0,fail_rate=1");
    char why[256] = "";
    for (int i = 0; i < 300 && kvt_l2mgr_ready(g.mgr, why, sizeof why); i++)
        s_sleep_ms(10); /* the health probe runs every second */
    assert_false(kvt_l2mgr_ready(g.mgr, why, sizeof why));
    assert_true(strlen(why) > 0);
    s_commit_and_queue(&g);
    uint64_t sizes[N];
    kvt_ns_t ns = s_ns();
    assert_int_equal(
        kvt_l2mgr_lookup(g.mgr, &ns, g.keys, N, kvt_now_ms() + 1000, sizes), 0);
    s_close(&g); /* gives the retries up: does not hang */
    assert_int_equal(atomic_load(&g.stored), 0);
}

static int s_rm(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

/* destroy writes what is queued before it stops. */
static void test_stop_drains(void **state)
{
    (void)state;
    char dir[] = "/tmp/kvt-l2mgr-XXXXXX", spec[128];
    assert_non_null(mkdtemp(dir));
    snprintf(spec, sizeof spec, "fs:%s", dir);
    rig_t g;
    s_open(&g, spec);
    s_commit_and_queue(&g);
    s_close(&g); /* at once */
    const kvt_l2_ops_t *fs = kvt_l2_fs_ops();
    void *st = NULL;
    char err[256] = "";
    assert_int_equal(fs->open(dir, &st, err, sizeof err), 0);
    uint64_t bytes = 0, objects = 0;
    fs->usage(st, &bytes, &objects);
    assert_int_equal(objects, N);
    assert_true(bytes >= (uint64_t)N * OBJ);
    fs->close(st);
    nftw(dir, s_rm, 16, FTW_DEPTH | FTW_PHYS);
}

/* fs with sync=batch: objects are announced as l2_stored only after a flush (one syncfs for a
 * group) succeeded; a failed flush announces nothing, counts the errors and still lets the
 * objects go from L1 (nothing waits forever). sync=object never calls syncfs. */
static void test_flush_before_stored(void **state)
{
    (void)state;
    for (int round = 0; round < 3; round++) {
        char dir[] = "/tmp/kvt-l2mgr-XXXXXX", spec[160];
        assert_non_null(mkdtemp(dir));
        snprintf(spec, sizeof spec, "fs:%s,sync=%s", dir, round == 2 ? "object" : "batch");
        atomic_store(&s_syncfs_calls, 0);
        atomic_store(&s_syncfs_errno, round == 1 ? EIO : 0);
        rig_t g;
        s_open(&g, spec);
        s_commit_and_queue(&g);
        if (round == 1) {
            for (int i = 0; i < 1000 && s_metric(&g, "l2_errors_total") < N; i++)
                s_sleep_ms(10);
            assert_true(s_metric(&g, "l2_errors_total") >= N);
            assert_int_equal(atomic_load(&g.stored), 0);
            assert_true(atomic_load(&s_syncfs_calls) >= 1);
        } else {
            s_wait_stored(&g, N);
            if (round == 0) {
                assert_true(atomic_load(&s_syncfs_calls) >= 1);
                assert_true(atomic_load(&s_syncfs_calls) <= N); /* grouped, never more */
                assert_true(s_metric(&g, "l2_flushes_total") >= 1);
            } else {
                assert_int_equal(atomic_load(&s_syncfs_calls), 0);
            }
        }
        /* either way nothing is left waiting for L2 in L1 */
        json_t *st = kvt_l1_status_json(g.l1);
        json_t *bl = json_object_get(st, "l2_backlog");
        for (int i = 0; i < 1000 && json_integer_value(json_object_get(bl, "objects")) != 0; i++) {
            json_decref(st);
            s_sleep_ms(10);
            st = kvt_l1_status_json(g.l1);
            bl = json_object_get(st, "l2_backlog");
        }
        assert_int_equal(json_integer_value(json_object_get(bl, "objects")), 0);
        json_decref(st);
        atomic_store(&s_syncfs_errno, 0);
        s_close(&g);
        nftw(dir, s_rm, 16, FTW_DEPTH | FTW_PHYS);
    }
}

int main(void)
{
    kvt_log_set_level(KVT_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_write_behind_then_prefetch),
        cmocka_unit_test(test_corrupt_is_a_miss),
        cmocka_unit_test(test_failing_adapter),
        cmocka_unit_test(test_stop_drains),
        cmocka_unit_test(test_flush_before_stored),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
