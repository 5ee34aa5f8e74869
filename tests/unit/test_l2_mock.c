/* Unit tests of what only l2/kvt_l2_mock does (its contract as an adapter is
 * test_l2_conformance.c): latency applied to every call (bounded timing, generous margins),
 * fail_rate 0.5 over 1000 calls failing 35-65 % with every successful load exact, fail_rate 0
 * never failing, fail_rate 1 failing and unhealthy, corrupt_rate, and bad specs rejected with
 * KVT_EINVAL. */
#include "kvt_error.h"
#include "kvt_l2.h"
#include "kvt_log.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#include <cmocka.h>

static void *s_open(const char *args)
{
    const kvt_l2_ops_t *ops = kvt_l2_mock_ops();
    void *st = NULL;
    char err[256] = "";
    int rc = ops->open(args, &st, err, sizeof err);
    if (rc)
        fail_msg("open \"%s\": %s (%s)", args, kvt_err_name(rc), err);
    return st;
}

static void s_name(char out[KVT_L2_NAME_LEN], unsigned i)
{
    snprintf(out, KVT_L2_NAME_LEN, "%032x-%032x", 0xabcu, i);
}

static void s_fill(uint8_t *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(seed * 131 + i * 7 + (i >> 8));
}

static void test_latency(void **state)
{
    (void)state;
    const kvt_l2_ops_t *ops = kvt_l2_mock_ops();
    void *st = s_open("latency_ms=30,fail_rate=0");
    char name[KVT_L2_NAME_LEN];
    s_name(name, 3);
    size_t len;
    uint8_t *buf = aligned_alloc(4096, 4096);
    uint64_t t0 = kvt_now_ms();
    assert_int_equal(ops->store(st, name, "abc", 3), 0);
    uint64_t t1 = kvt_now_ms();
    assert_int_equal(ops->lookup(st, name, &len), 0);
    uint64_t t2 = kvt_now_ms();
    assert_int_equal(ops->load(st, name, buf, 4096, &len), 0);
    uint64_t t3 = kvt_now_ms();
    assert_int_equal(ops->remove(st, name), 0);
    uint64_t t4 = kvt_now_ms();
    /* at least the latency each; at most a generous bound for a loaded CI machine */
    assert_true(t1 - t0 >= 30 && t2 - t1 >= 30 && t3 - t2 >= 30 && t4 - t3 >= 30);
    assert_true(t4 - t0 < 4 * 30 + 2000);
    ops->close(st);
    free(buf);
}

static void test_fail_rate_half(void **state)
{
    (void)state;
    const kvt_l2_ops_t *ops = kvt_l2_mock_ops();
    void *st = s_open("latency_ms=0,fail_rate=0.5,seed=42");
    uint8_t *buf = aligned_alloc(4096, 8192);
    uint8_t data[5000];
    int fails = 0, calls = 0, stored[50] = {0};
    for (int i = 0; i < 1000; i++) {
        char name[KVT_L2_NAME_LEN];
        unsigned k = (unsigned)(i % 50);
        s_name(name, k);
        int rc;
        size_t len = 0;
        if (i % 2 == 0) {
            s_fill(data, sizeof data, k);
            rc = ops->store(st, name, data, sizeof data - k);
            if (rc == 0)
                stored[k] = 1;
        } else {
            memset(buf, 0xee, 8192);
            rc = ops->load(st, name, buf, 8192, &len);
            if (rc == 0) {
                assert_true(stored[k]);
                s_fill(data, sizeof data, k);
                assert_int_equal(len, sizeof data - k);
                assert_memory_equal(buf, data, len);
            } else if (rc == KVT_EUNAVAIL) {
                /* a failed load leaves the buffer alone: no partial bytes */
                for (size_t j = 0; j < 8192; j++)
                    assert_int_equal(buf[j], 0xee);
            } else {
                assert_int_equal(rc, KVT_ENOTFOUND);
                assert_false(stored[k]);
                rc = 0;
            }
        }
        assert_true(rc == 0 || rc == KVT_EUNAVAIL);
        fails += rc != 0;
        calls++;
    }
    assert_int_equal(calls, 1000);
    print_message("fail_rate=0.5: %d of 1000 calls failed\n", fails);
    assert_in_range(fails, 350, 650);
    char why[128] = "";
    assert_int_equal(ops->health(st, why, sizeof why), 0);
    ops->close(st);
    free(buf);
}

static void test_fail_rate_zero_and_one(void **state)
{
    (void)state;
    const kvt_l2_ops_t *ops = kvt_l2_mock_ops();
    void *st = s_open("latency_ms=0,fail_rate=0");
    char name[KVT_L2_NAME_LEN];
    s_name(name, 9);
    size_t len;
    for (int i = 0; i < 2000; i++) {
        assert_int_equal(ops->store(st, name, "x", 1), 0);
        assert_int_equal(ops->lookup(st, name, &len), 0);
    }
    ops->close(st);

    st = s_open("fail_rate=1");
    assert_int_equal(ops->store(st, name, "x", 1), KVT_EUNAVAIL);
    assert_int_equal(ops->lookup(st, name, &len), KVT_EUNAVAIL);
    assert_int_equal(ops->remove(st, name), KVT_EUNAVAIL);
    char why[128] = "";
    assert_int_equal(ops->health(st, why, sizeof why), KVT_EUNAVAIL);
    assert_true(strlen(why) > 0);
    ops->close(st);

    st = s_open(""); /* every option has a default */
    assert_int_equal(ops->store(st, name, "x", 1), 0);
    ops->close(st);
}

/* storev / loadv, and corrupt_rate: every load (rate 1) returns the object with its middle
 * byte flipped, while the object held stays intact (rate 0 on the same data). */
static void test_vectored_and_corrupt(void **state)
{
    (void)state;
    const kvt_l2_ops_t *ops = kvt_l2_mock_ops();
    assert_non_null(ops->storev);
    assert_non_null(ops->loadv);
    for (int rate = 0; rate <= 1; rate++) {
        void *st = s_open(rate ? "corrupt_rate=1" : "corrupt_rate=0");
        char name[KVT_L2_NAME_LEN];
        s_name(name, 7);
        uint8_t a[1000], b[40], back[1000], tb[40];
        s_fill(a, sizeof a, 3);
        s_fill(b, sizeof b, 4);
        struct iovec in[2] = {{a, sizeof a}, {b, sizeof b}};
        struct iovec out[2] = {{back, sizeof back}, {tb, sizeof tb}};
        size_t len = 0;
        assert_int_equal(ops->storev(st, name, in, 2), 0);
        for (int round = 0; round < 2; round++) {
            assert_int_equal(ops->loadv(st, name, out, 2, &len), 0);
            assert_int_equal(len, sizeof a + sizeof b);
            assert_memory_equal(tb, b, sizeof b);
            assert_memory_equal(back, a, 520); /* the middle byte is 520 */
            assert_int_equal(back[520], a[520] ^ (rate ? 1 : 0));
            assert_memory_equal(back + 521, a + 521, sizeof a - 521);
        }
        out[1].iov_len = 10;
        assert_int_equal(ops->loadv(st, name, out, 2, &len), KVT_ENOSPC);
        ops->close(st);
    }
}

static void test_bad_specs(void **state)
{
    (void)state;
    static const char *const bad[] = {
        "latency_ms",
        "latency_ms=",
        "latency_ms=-1",
        "latency_ms=abc",
        "latency_ms=10x",
        "latency_ms=3600001",
        "fail_rate=1.5",
        "fail_rate=-0.1",
        "fail_rate=nan",
        "fail_rate=",
        "fail_rate=0.5x",
        "corrupt_rate=2",
        "corrupt_rate=x",
        "seed=-3",
        "seed=1e3",
        "capacity=10Q",
        "capacity=-1",
        "capacity=1KB",
        "capacity=99999999999999999999",
        "colour=blue",
        "latency_ms=1,latency_ms=2",
        "latency_ms=1,,=",
    };
    const kvt_l2_ops_t *ops = kvt_l2_mock_ops();
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        void *st = NULL;
        char err[256] = "";
        int rc = ops->open(bad[i], &st, err, sizeof err);
        if (rc != KVT_EINVAL)
            fail_msg("spec \"%s\" gave %s", bad[i], kvt_err_name(rc));
        assert_null(st);
        assert_true(strlen(err) > 0);
    }
    void *st = s_open("latency_ms=1,fail_rate=0.25,seed=7,capacity=4G");
    ops->close(st);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_latency),
        cmocka_unit_test(test_fail_rate_half),
        cmocka_unit_test(test_fail_rate_zero_and_one),
        cmocka_unit_test(test_vectored_and_corrupt),
        cmocka_unit_test(test_bad_specs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
