/* Unit tests of storage/kvt_prefetch: ids unique and never 0; at max_jobs a new job replaces
 * the oldest finished one, and is refused (0, counted) only while every live job is running; a
 * running job at the head never holds back the sweep of jobs that finished after it; over half
 * the cap finished jobs are kept a second instead of keep_ms, down to half the cap; many jobs
 * each found by their own id. */
#include "kvt_error.h"
#include "kvt_prefetch.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

static bool s_exists(kvt_prefetch_t *p, uint64_t job)
{
    bool done;
    uint32_t loaded, hits;
    return kvt_prefetch_status(p, job, &done, &loaded, &hits) == 0;
}

typedef struct {
    double jobs, refused;
} s_metrics_t;

static void s_emit(void *ctx, const kvt_sample_t *s)
{
    s_metrics_t *m = ctx;
    if (strcmp(s->name, "prefetch_jobs") == 0)
        m->jobs = s->value;
    else if (strcmp(s->name, "prefetch_refused_total") == 0)
        m->refused = s->value;
    else
        fail_msg("unexpected sample %s", s->name);
}

static s_metrics_t s_metrics(kvt_prefetch_t *p)
{
    s_metrics_t m = {-1, -1};
    kvt_prefetch_metrics_source(p, s_emit, &m);
    return m;
}

static void test_cap_refuses_only_when_all_run(void **state)
{
    (void)state;
    kvt_prefetch_t *p = kvt_prefetch_new(60000, 4);
    uint64_t ids[4];
    for (int i = 0; i < 4; i++) {
        ids[i] = kvt_prefetch_start(p, 3, false, 100);
        assert_true(ids[i] != 0);
        for (int k = 0; k < i; k++)
            assert_true(ids[k] != ids[i]);
    }
    assert_int_equal(kvt_prefetch_start(p, 3, false, 100), 0); /* four loads running */
    assert_int_equal(kvt_prefetch_start(p, 3, true, 100), 0);
    s_metrics_t m = s_metrics(p);
    assert_true(m.jobs == 4 && m.refused == 2);

    /* the second finishes: a new job takes its place, the running ones stay */
    kvt_prefetch_update(p, ids[1], 3, true, 200);
    bool done;
    uint32_t loaded, hits;
    assert_int_equal(kvt_prefetch_status(p, ids[1], &done, &loaded, &hits), 0);
    assert_true(done && loaded == 3 && hits == 3);
    uint64_t next = kvt_prefetch_start(p, 1, false, 300);
    assert_true(next != 0);
    assert_false(s_exists(p, ids[1]));
    assert_true(s_exists(p, ids[0]) && s_exists(p, ids[2]) && s_exists(p, ids[3]));
    assert_int_equal(kvt_prefetch_jobs(p), 4);
    assert_int_equal(kvt_prefetch_start(p, 1, false, 300), 0);
    m = s_metrics(p);
    assert_true(m.jobs == 4 && m.refused == 3);

    /* updates of a job that is gone, or never was, change nothing */
    kvt_prefetch_update(p, ids[1], 5, true, 400);
    kvt_prefetch_update(p, 999999, 5, true, 400);
    assert_int_equal(kvt_prefetch_jobs(p), 4);
    kvt_prefetch_destroy(&p);
    assert_null(p);
    kvt_prefetch_destroy(NULL);
}

static void test_running_head_does_not_block_sweep(void **state)
{
    (void)state;
    kvt_prefetch_t *p = kvt_prefetch_new(1000, 100);
    uint64_t slow = kvt_prefetch_start(p, 8, false, 0);
    uint64_t a = kvt_prefetch_start(p, 1, true, 0);
    uint64_t b = kvt_prefetch_start(p, 2, false, 0);
    kvt_prefetch_update(p, b, 2, true, 500);
    assert_int_equal(kvt_prefetch_sweep(p, 1000), 0); /* kept keep_ms after they finished */
    assert_int_equal(kvt_prefetch_sweep(p, 1001), 1);
    assert_false(s_exists(p, a));
    assert_true(s_exists(p, b));
    assert_int_equal(kvt_prefetch_sweep(p, 1501), 1);
    assert_false(s_exists(p, b));
    assert_true(s_exists(p, slow)); /* running: never swept */
    assert_int_equal(kvt_prefetch_sweep(p, 1000000), 0);
    kvt_prefetch_update(p, slow, 8, true, 1000000);
    assert_int_equal(kvt_prefetch_sweep(p, 1001001), 1);
    assert_int_equal(kvt_prefetch_jobs(p), 0);
    kvt_prefetch_destroy(&p);
}

static void test_pressure_sweeps_sooner(void **state)
{
    (void)state;
    kvt_prefetch_t *p = kvt_prefetch_new(60000, 8);
    uint64_t ids[6];
    for (int i = 0; i < 6; i++)
        ids[i] = kvt_prefetch_start(p, 1, true, (uint64_t)i);
    assert_int_equal(kvt_prefetch_sweep(p, 900), 0);
    /* over half the cap: a second is enough, oldest first, down to half */
    assert_int_equal(kvt_prefetch_sweep(p, 1002), 2);
    assert_false(s_exists(p, ids[0]) || s_exists(p, ids[1]));
    assert_true(s_exists(p, ids[2]) && s_exists(p, ids[5]));
    assert_int_equal(kvt_prefetch_sweep(p, 59000), 0); /* at half the cap: keep_ms again */
    assert_int_equal(kvt_prefetch_sweep(p, 60006), 4);

    /* a start sweeps too: past half the cap a burst of finished jobs is short-lived */
    for (int i = 0; i < 8; i++)
        assert_true(kvt_prefetch_start(p, 1, true, 70000) != 0);
    assert_int_equal(kvt_prefetch_jobs(p), 8);
    assert_true(kvt_prefetch_start(p, 1, true, 71001) != 0);
    assert_int_equal(kvt_prefetch_jobs(p), 5); /* swept down to half, then the new one */
    assert_true(s_metrics(p).refused == 0);
    kvt_prefetch_destroy(&p);
}

/* Many jobs: each id finds its own job (hits, loaded, done) until it is swept, and ids that
 * agree with a live one in their low 32 bits, or were never handed out, find nothing. */
static void test_many_jobs(void **state)
{
    (void)state;
    enum { N = 20000 };
    kvt_prefetch_t *p = kvt_prefetch_new(1000, N);
    uint64_t *ids = malloc(N * sizeof *ids);
    assert_non_null(ids);
    for (uint32_t i = 0; i < N; i++) {
        ids[i] = kvt_prefetch_start(p, i, i % 2 == 0, 0); /* the even ones finish at once */
        assert_true(ids[i] != 0);
    }
    for (uint32_t i = 1; i < N; i += 2)
        kvt_prefetch_update(p, ids[i], i / 2, false, 0);
    bool done;
    uint32_t loaded, hits;
    for (uint32_t i = 0; i < N; i++) {
        assert_int_equal(kvt_prefetch_status(p, ids[i], &done, &loaded, &hits), 0);
        assert_int_equal(hits, i);
        assert_int_equal(done, i % 2 == 0);
        assert_int_equal(loaded, i % 2 ? i / 2 : 0);
        uint64_t twin = ids[i] + ((uint64_t)1 << 32);
        assert_int_equal(kvt_prefetch_status(p, twin, &done, &loaded, &hits), KVT_ENOTFOUND);
    }
    assert_int_equal(kvt_prefetch_status(p, 0, &done, &loaded, &hits), KVT_ENOTFOUND);
    assert_int_equal(kvt_prefetch_status(p, UINT64_MAX, &done, &loaded, &hits), KVT_ENOTFOUND);
    /* the finished half is swept, the running half stays as it was */
    assert_int_equal(kvt_prefetch_sweep(p, 5000), N / 2);
    for (uint32_t i = 0; i < N; i++) {
        int rc = kvt_prefetch_status(p, ids[i], &done, &loaded, &hits);
        assert_int_equal(rc, i % 2 ? 0 : KVT_ENOTFOUND);
        if (rc == 0)
            assert_true(!done && hits == i && loaded == i / 2);
    }
    free(ids);
    kvt_prefetch_destroy(&p); /* frees the running jobs (ASan) */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cap_refuses_only_when_all_run),
        cmocka_unit_test(test_running_head_does_not_block_sweep),
        cmocka_unit_test(test_pressure_sweeps_sooner),
        cmocka_unit_test(test_many_jobs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
