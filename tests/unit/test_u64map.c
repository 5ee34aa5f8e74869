/* Unit tests of common/kvt_u64map: many ids in, every one found with its own value, removal
 * of half of them leaving the others, replacement, and the ids a narrower scheme would confuse
 * (0 and UINT64_MAX, ids equal in their low or high 32 bits, ids a table size apart: with
 * 100 000 entries the buckets hold chains, so the comparator, not the hash, tells them apart). */
#include "kvt_u64map.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

/* The i-th of a set of distinct ids that share low halves, high halves and residues. */
static uint64_t s_id(uint32_t i)
{
    switch (i % 4) {
    case 0:
        return (uint64_t)(i / 4); /* 0, 1, 2 ... */
    case 1:
        return (uint64_t)(i / 4 + 1) << 32; /* low half 0, like each other's */
    case 2:
        return UINT64_MAX - i / 4; /* UINT64_MAX down */
    default:
        return ((uint64_t)(i / 4) << 32) | 0x9e3779b9u; /* high half i/4, low half fixed */
    }
}

static void test_many_ids(void **state)
{
    (void)state;
    enum { N = 100000 };
    uint32_t *vals = malloc(N * sizeof *vals);
    assert_non_null(vals);
    kvt_u64map_t *m = kvt_u64map_new();
    for (uint32_t i = 0; i < N; i++) {
        vals[i] = i;
        assert_null(kvt_u64map_get(m, s_id(i)));
        kvt_u64map_set(m, s_id(i), &vals[i]);
    }
    assert_int_equal(kvt_u64map_size(m), N);
    for (uint32_t i = 0; i < N; i++)
        assert_ptr_equal(kvt_u64map_get(m, s_id(i)), &vals[i]);
    /* every value once in an iteration */
    size_t seen = 0;
    uint64_t sum = 0;
    for (uint32_t *v = kvt_u64map_first(m); v; v = kvt_u64map_next(m)) {
        seen++;
        sum += *v;
    }
    assert_int_equal(seen, N);
    assert_true(sum == (uint64_t)N * (N - 1) / 2);
    /* remove the odd ones: the even ones stay, removed ones are gone, removing twice is a no */
    for (uint32_t i = 1; i < N; i += 2)
        assert_ptr_equal(kvt_u64map_remove(m, s_id(i)), &vals[i]);
    for (uint32_t i = 1; i < N; i += 2)
        assert_null(kvt_u64map_remove(m, s_id(i)));
    assert_int_equal(kvt_u64map_size(m), N / 2);
    for (uint32_t i = 0; i < N; i++)
        if (i % 2)
            assert_null(kvt_u64map_get(m, s_id(i)));
        else
            assert_ptr_equal(kvt_u64map_get(m, s_id(i)), &vals[i]);
    kvt_u64map_destroy(&m);
    assert_null(m);
    kvt_u64map_destroy(NULL);
    free(vals);
}

static void test_replace_and_extremes(void **state)
{
    (void)state;
    int a, b;
    kvt_u64map_t *m = kvt_u64map_new();
    assert_null(kvt_u64map_first(m));
    kvt_u64map_set(m, 0, &a);
    kvt_u64map_set(m, UINT64_MAX, &b);
    assert_ptr_equal(kvt_u64map_get(m, 0), &a);
    assert_ptr_equal(kvt_u64map_get(m, UINT64_MAX), &b);
    assert_null(kvt_u64map_get(m, 1));
    assert_null(kvt_u64map_get(m, UINT64_MAX - 1));
    kvt_u64map_set(m, 0, &b); /* replaces */
    assert_int_equal(kvt_u64map_size(m), 2);
    assert_ptr_equal(kvt_u64map_get(m, 0), &b);
    assert_ptr_equal(kvt_u64map_remove(m, 0), &b);
    assert_ptr_equal(kvt_u64map_get(m, UINT64_MAX), &b);
    assert_int_equal(kvt_u64map_size(m), 1);
    kvt_u64map_destroy(&m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_many_ids),
        cmocka_unit_test(test_replace_and_extremes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
