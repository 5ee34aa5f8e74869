/* Unit tests of storage/kvt_alloc: a seeded random get/put run checked against a page map
 * (no overlap, inside the capacity, 4 KiB aligned, size >= request, `used` equal to the sum of
 * the rounded sizes, largest_free equal to the model's longest free run), kvt_alloc_check()
 * every few hundred operations, full coalescing, the fragmentation metric, exact fits,
 * out-of-space, capacities that are not a page multiple, and a short multi-thread run. */
#include "kvt_alloc.h"
#include "kvt_error.h"

#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#define PG ((uint64_t)KVT_PAGE)

static uint64_t s_pages_of(uint64_t bytes)
{
    return bytes ? (bytes + PG - 1) / PG : 1;
}

/* xorshift64*: a seeded generator independent of libc's rand. */
static uint64_t s_rand(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

/* 1 byte .. 8 MiB, log-uniform: as many requests below 4 KiB as between 4 and 8 MiB. */
static uint64_t s_size(uint64_t *seed)
{
    unsigned bits = (unsigned)(s_rand(seed) % 24); /* 0..23 */
    uint64_t top = 1ull << bits;                   /* 1 .. 8 MiB */
    return 1 + s_rand(seed) % top;
}

/* The model: one byte per page, 1 = allocated. */
typedef struct {
    uint8_t *map;
    uint64_t pages;
    uint64_t used_pages;
} model_t;

static uint64_t s_model_largest_free(const model_t *m)
{
    uint64_t best = 0, run = 0;
    for (uint64_t p = 0; p < m->pages; p++) {
        run = m->map[p] ? 0 : run + 1;
        if (run > best)
            best = run;
    }
    return best;
}

static void s_model_take(model_t *m, const kvt_block_t *b, uint64_t requested)
{
    uint64_t off = kvt_block_offset(b), size = kvt_block_size(b);
    assert_int_equal(off % PG, 0);
    assert_int_equal(size % PG, 0);
    assert_true(size >= requested);
    assert_int_equal(size, s_pages_of(requested) * PG);
    assert_true(off + size <= m->pages * PG);
    for (uint64_t p = off / PG; p < (off + size) / PG; p++) {
        if (m->map[p])
            fail_msg("block [%llu, +%llu) overlaps an allocated page %llu", (unsigned long long)off,
                     (unsigned long long)size, (unsigned long long)p);
        m->map[p] = 1;
    }
    m->used_pages += size / PG;
}

static void s_model_give(model_t *m, const kvt_block_t *b)
{
    uint64_t off = kvt_block_offset(b), size = kvt_block_size(b);
    for (uint64_t p = off / PG; p < (off + size) / PG; p++) {
        assert_int_equal(m->map[p], 1);
        m->map[p] = 0;
    }
    m->used_pages -= size / PG;
}

static void s_check_stats(kvt_alloc_t *a, const model_t *m, uint64_t nlive)
{
    kvt_alloc_stats_t st;
    kvt_alloc_stats(a, &st);
    assert_int_equal(st.capacity, m->pages * PG);
    assert_int_equal(st.used, m->used_pages * PG);
    assert_int_equal(st.free, st.capacity - st.used);
    assert_int_equal(st.used_blocks, nlive);
    assert_int_equal(st.largest_free, s_model_largest_free(m) * PG);
    assert_true(st.largest_free <= st.free);
    assert_true(st.fragmentation >= 0.0 && st.fragmentation < 1.0);
    if (st.free)
        assert_true(st.free_blocks >= 1);
}

static void s_random_run(uint64_t capacity, uint64_t seed, int nops, int check_every)
{
    kvt_alloc_t *a = kvt_alloc_new(capacity);
    assert_non_null(a);
    model_t m = {.pages = capacity / PG};
    m.map = calloc(m.pages, 1);
    assert_non_null(m.map);
    size_t cap_live = 1u << 16, nlive = 0;
    kvt_block_t **live = calloc(cap_live, sizeof *live);
    assert_non_null(live);
    uint64_t gets = 0, nulls = 0, puts = 0;

    for (int op = 0; op < nops; op++) {
        /* drift between filling up (55 % gets) and draining (45 %) in phases of 20k ops, so
         * the run sees both an almost empty and an almost full arena */
        int phase_fill = (op / 20000) % 2 == 0;
        unsigned pget = phase_fill ? 60 : 40;
        if (nlive == 0 || (nlive < cap_live && s_rand(&seed) % 100 < pget)) {
            uint64_t bytes = s_size(&seed);
            kvt_block_t *b = kvt_alloc_get(a, bytes);
            gets++;
            if (!b) {
                /* NULL only when no free run is large enough; TLSF good-fit may miss a fit
                 * only within the size class of the request (1/16 of it) */
                nulls++;
                uint64_t want = s_pages_of(bytes), largest = s_model_largest_free(&m);
                if (largest >= want + want / 16 + 1)
                    fail_msg("get(%llu) returned NULL with a free run of %llu pages",
                             (unsigned long long)bytes, (unsigned long long)largest);
                continue;
            }
            s_model_take(&m, b, bytes);
            live[nlive++] = b;
        } else {
            size_t i = (size_t)(s_rand(&seed) % nlive);
            kvt_block_t *b = live[i];
            live[i] = live[--nlive];
            s_model_give(&m, b);
            kvt_alloc_put(a, b);
            puts++;
        }
        assert_int_equal(kvt_alloc_used(a), m.used_pages * PG);
        if (op % check_every == 0) {
            assert_int_equal(kvt_alloc_check(a), 0);
            s_check_stats(a, &m, nlive);
        }
    }
    assert_int_equal(kvt_alloc_check(a), 0);
    s_check_stats(a, &m, nlive);
    assert_true(puts > 0 && gets > puts);
    assert_true(nulls > 0); /* the run did reach a full arena */

    /* full coalescing: free everything (in random order) -> one free block of everything */
    while (nlive) {
        size_t i = (size_t)(s_rand(&seed) % nlive);
        kvt_block_t *b = live[i];
        live[i] = live[--nlive];
        s_model_give(&m, b);
        kvt_alloc_put(a, b);
    }
    assert_int_equal(kvt_alloc_check(a), 0);
    kvt_alloc_stats_t st;
    kvt_alloc_stats(a, &st);
    assert_int_equal(st.used, 0);
    assert_int_equal(kvt_alloc_used(a), 0);
    assert_int_equal(st.free, m.pages * PG);
    assert_int_equal(st.largest_free, m.pages * PG);
    assert_int_equal(st.free_blocks, 1);
    assert_int_equal(st.used_blocks, 0);
    assert_true(st.fragmentation == 0.0);

    free(live);
    free(m.map);
    kvt_alloc_destroy(&a);
    assert_null(a);
}

static void test_random_model(void **state)
{
    (void)state;
    /* 128 MiB: up to 16 of the largest requests fill it, so NULL does happen */
    s_random_run(128ull << 20, 0x9E3779B97F4A7C15ull, 200000, 500);
}

static void test_random_model_odd_capacity(void **state)
{
    (void)state;
    /* not a power of two and not a page multiple: the tail is ignored */
    s_random_run((37ull << 20) + 5 * PG + 1234, 42, 60000, 250);
}

static void test_coalesce_neighbours(void **state)
{
    (void)state;
    kvt_alloc_t *a = kvt_alloc_new(64 * PG);
    assert_non_null(a);
    kvt_block_t *b[4];
    for (int i = 0; i < 4; i++) {
        b[i] = kvt_alloc_get(a, 16 * PG);
        assert_non_null(b[i]);
    }
    assert_null(kvt_alloc_get(a, 1));
    kvt_alloc_stats_t st;
    /* free 1 and 3, then 2 in the middle: coalesces with both neighbours */
    kvt_alloc_put(a, b[1]);
    kvt_alloc_put(a, b[3]);
    kvt_alloc_stats(a, &st);
    assert_int_equal(st.free_blocks, 2);
    assert_int_equal(kvt_alloc_check(a), 0);
    kvt_alloc_put(a, b[2]);
    kvt_alloc_stats(a, &st);
    assert_int_equal(st.free_blocks, 1);
    assert_int_equal(st.largest_free, 48 * PG);
    assert_int_equal(kvt_alloc_check(a), 0);
    kvt_alloc_put(a, b[0]);
    kvt_alloc_stats(a, &st);
    assert_int_equal(st.free_blocks, 1);
    assert_int_equal(st.largest_free, 64 * PG);
    assert_true(st.fragmentation == 0.0);
    assert_int_equal(kvt_alloc_check(a), 0);
    kvt_alloc_destroy(&a);
}

static int s_cmp_off(const void *x, const void *y)
{
    uint64_t a = kvt_block_offset(*(kvt_block_t *const *)x);
    uint64_t b = kvt_block_offset(*(kvt_block_t *const *)y);
    return a < b ? -1 : a > b;
}

static void test_fragmentation_metric(void **state)
{
    (void)state;
    enum { K = 16, B = 8 }; /* 2K blocks of B pages fill the arena exactly */
    kvt_alloc_t *a = kvt_alloc_new(2 * K * B * PG);
    assert_non_null(a);
    kvt_block_t *blk[2 * K];
    for (int i = 0; i < 2 * K; i++) {
        blk[i] = kvt_alloc_get(a, B * PG - 100);
        assert_non_null(blk[i]);
        assert_int_equal(kvt_block_size(blk[i]), B * PG);
    }
    assert_null(kvt_alloc_get(a, 1));
    kvt_alloc_stats_t st;
    kvt_alloc_stats(a, &st);
    assert_int_equal(st.free, 0);
    assert_int_equal(st.largest_free, 0);
    assert_true(st.fragmentation == 0.0); /* nothing free: 0 by definition */

    qsort(blk, 2 * K, sizeof blk[0], s_cmp_off);
    for (int i = 0; i < 2 * K; i += 2)
        kvt_alloc_put(a, blk[i]);
    assert_int_equal(kvt_alloc_check(a), 0);
    kvt_alloc_stats(a, &st);
    assert_int_equal(st.free, K * B * PG);
    assert_int_equal(st.free_blocks, K);
    assert_int_equal(st.used_blocks, K);
    assert_int_equal(st.largest_free, B * PG);
    assert_true(st.fragmentation > 0.4);
    assert_true(st.fragmentation > 1.0 - 1.0 / K - 1e-9 && st.fragmentation < 1.0 - 1.0 / K + 1e-9);
    /* half the arena is free, yet two blocks' worth does not fit anywhere */
    assert_null(kvt_alloc_get(a, B * PG + 1));
    kvt_block_t *again = kvt_alloc_get(a, B * PG);
    assert_non_null(again);
    kvt_alloc_put(a, again);

    for (int i = 1; i < 2 * K; i += 2)
        kvt_alloc_put(a, blk[i]);
    kvt_alloc_stats(a, &st);
    assert_int_equal(st.free_blocks, 1);
    assert_true(st.fragmentation == 0.0);
    assert_int_equal(kvt_alloc_check(a), 0);
    kvt_alloc_destroy(&a);
}

/* The header's contract: NULL only "when no free block is large enough". A free block of
 * exactly the requested size must be found, whatever its size class. */
static void test_exact_fit_whole_capacity(void **state)
{
    (void)state;
    /* sizes on and off power-of-two / size-class boundaries */
    static const uint64_t pages[] = {1, 2, 15, 16, 17, 31, 64, 100, 101, 255, 1000, 4096, 4097};
    for (size_t i = 0; i < sizeof pages / sizeof pages[0]; i++) {
        kvt_alloc_t *a = kvt_alloc_new(pages[i] * PG + 17); /* + a partial page, ignored */
        assert_non_null(a);
        kvt_block_t *b = kvt_alloc_get(a, pages[i] * PG);
        if (!b)
            fail_msg("capacity %llu pages: get(capacity) returned NULL (exact fit of the only "
                     "free block)",
                     (unsigned long long)pages[i]);
        assert_int_equal(kvt_block_offset(b), 0);
        assert_int_equal(kvt_block_size(b), pages[i] * PG);
        assert_null(kvt_alloc_get(a, 1));
        kvt_alloc_put(a, b);
        assert_int_equal(kvt_alloc_check(a), 0);
        kvt_alloc_destroy(&a);
    }
}

static void test_exact_fit_hole(void **state)
{
    (void)state;
    static const uint64_t hole[] = {1, 3, 16, 17, 40, 101, 333};
    for (size_t i = 0; i < sizeof hole / sizeof hole[0]; i++) {
        enum { CAP = 1024 };
        kvt_alloc_t *a = kvt_alloc_new(CAP * PG);
        kvt_block_t *x = kvt_alloc_get(a, 100 * PG);
        kvt_block_t *h = kvt_alloc_get(a, hole[i] * PG);
        assert_non_null(x);
        assert_non_null(h);
        /* fill the rest page by page (no reliance on any other fit) */
        kvt_block_t *rest[CAP];
        int nrest = 0;
        while ((rest[nrest] = kvt_alloc_get(a, 1)) != NULL)
            nrest++;
        assert_int_equal(nrest, CAP - 100 - (int)hole[i]);
        uint64_t hoff = kvt_block_offset(h);
        kvt_alloc_put(a, h); /* the only free space: a hole of hole[i] pages */
        kvt_alloc_stats_t st;
        kvt_alloc_stats(a, &st);
        assert_int_equal(st.largest_free, hole[i] * PG);
        assert_null(kvt_alloc_get(a, hole[i] * PG + 1)); /* out of space by one byte */
        kvt_block_t *b = kvt_alloc_get(a, hole[i] * PG - (hole[i] > 1 ? PG - 1 : 0));
        if (!b)
            fail_msg("a free hole of %llu pages: get of %llu pages returned NULL",
                     (unsigned long long)hole[i], (unsigned long long)hole[i]);
        assert_int_equal(kvt_block_offset(b), hoff);
        kvt_alloc_put(a, b);
        kvt_alloc_put(a, x);
        while (nrest)
            kvt_alloc_put(a, rest[--nrest]);
        assert_int_equal(kvt_alloc_check(a), 0);
        kvt_alloc_destroy(&a);
    }
}

static void test_out_of_space_and_edges(void **state)
{
    (void)state;
    assert_null(kvt_alloc_new(0));
    assert_null(kvt_alloc_new(PG - 1));

    kvt_alloc_t *a = kvt_alloc_new(PG); /* exactly one page */
    assert_non_null(a);
    kvt_block_t *b = kvt_alloc_get(a, 0); /* 0 bytes = one page */
    assert_non_null(b);
    assert_int_equal(kvt_block_size(b), PG);
    assert_null(kvt_alloc_get(a, 0));
    assert_null(kvt_alloc_get(a, 1));
    kvt_alloc_put(a, b);
    assert_null(kvt_alloc_get(a, PG + 1));
    assert_null(kvt_alloc_get(a, UINT64_MAX));
    assert_null(kvt_alloc_get(a, UINT64_MAX - PG + 2));
    assert_int_equal(kvt_alloc_used(a), 0);
    assert_int_equal(kvt_alloc_check(a), 0);
    kvt_alloc_destroy(&a);
    kvt_alloc_destroy(&a); /* NULL-safe */

    /* not a page multiple: rounded down */
    a = kvt_alloc_new(10 * PG + 4095);
    assert_non_null(a);
    kvt_alloc_stats_t st;
    kvt_alloc_stats(a, &st);
    assert_int_equal(st.capacity, 10 * PG);
    assert_int_equal(st.free, 10 * PG);
    assert_int_equal(st.largest_free, 10 * PG);
    assert_int_equal(st.free_blocks, 1);
    assert_null(kvt_alloc_get(a, 10 * PG + 1));
    kvt_block_t *one[10];
    for (int i = 0; i < 10; i++) {
        one[i] = kvt_alloc_get(a, 1);
        assert_non_null(one[i]);
        assert_true(kvt_block_offset(one[i]) + PG <= 10 * PG);
    }
    assert_null(kvt_alloc_get(a, 1));
    assert_int_equal(kvt_alloc_used(a), 10 * PG);
    kvt_alloc_stats(a, &st);
    assert_int_equal(st.used_blocks, 10);
    assert_int_equal(st.free_blocks, 0);
    for (int i = 9; i >= 0; i--)
        kvt_alloc_put(a, one[i]);
    assert_int_equal(kvt_alloc_check(a), 0);
    kvt_alloc_destroy(&a);
}

/* A short multi-thread run: each thread allocates and frees its own blocks and stamps them, so
 * two threads given overlapping blocks would show up as a mismatch in the stamp. */
typedef struct {
    kvt_alloc_t *a;
    uint8_t *owner_of_page; /* one byte per page: which thread holds it, 0 = none */
    uint64_t seed;
    int id;
    int errors;
} thr_t;

static void *s_thread(void *arg)
{
    thr_t *t = arg;
    kvt_block_t *mine[64];
    int n = 0;
    for (int op = 0; op < 20000; op++) {
        if (n < 64 && (n == 0 || s_rand(&t->seed) % 2)) {
            uint64_t bytes = 1 + s_rand(&t->seed) % (256 * 1024);
            kvt_block_t *b = kvt_alloc_get(t->a, bytes);
            if (!b)
                continue;
            for (uint64_t p = kvt_block_offset(b) / PG;
                 p < (kvt_block_offset(b) + kvt_block_size(b)) / PG; p++) {
                if (__atomic_exchange_n(&t->owner_of_page[p], (uint8_t)t->id, __ATOMIC_RELAXED))
                    t->errors++;
            }
            mine[n++] = b;
        } else {
            int i = (int)(s_rand(&t->seed) % (uint64_t)n);
            kvt_block_t *b = mine[i];
            mine[i] = mine[--n];
            for (uint64_t p = kvt_block_offset(b) / PG;
                 p < (kvt_block_offset(b) + kvt_block_size(b)) / PG; p++) {
                if (__atomic_exchange_n(&t->owner_of_page[p], 0, __ATOMIC_RELAXED) != t->id)
                    t->errors++;
            }
            kvt_alloc_put(t->a, b);
        }
    }
    while (n) {
        kvt_block_t *b = mine[--n];
        for (uint64_t p = kvt_block_offset(b) / PG;
             p < (kvt_block_offset(b) + kvt_block_size(b)) / PG; p++)
            __atomic_store_n(&t->owner_of_page[p], 0, __ATOMIC_RELAXED);
        kvt_alloc_put(t->a, b);
    }
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    enum { NT = 4 };
    uint64_t cap = 32ull << 20;
    kvt_alloc_t *a = kvt_alloc_new(cap);
    uint8_t *owner = calloc(cap / PG, 1);
    thr_t t[NT];
    pthread_t th[NT];
    for (int i = 0; i < NT; i++) {
        t[i] = (thr_t){.a = a, .owner_of_page = owner, .seed = 1000 + (uint64_t)i, .id = i + 1};
        assert_int_equal(pthread_create(&th[i], NULL, s_thread, &t[i]), 0);
    }
    for (int i = 0; i < NT; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(t[i].errors, 0);
    }
    assert_int_equal(kvt_alloc_used(a), 0);
    assert_int_equal(kvt_alloc_check(a), 0);
    kvt_alloc_stats_t st;
    kvt_alloc_stats(a, &st);
    assert_int_equal(st.free_blocks, 1);
    assert_int_equal(st.largest_free, cap);
    free(owner);
    kvt_alloc_destroy(&a);
}

/* kvt_alloc_claim (arena adoption): exact ranges in ascending order, then out of order; the
 * space between them stays free and usable; overlapping, misaligned or out-of-range claims are
 * refused and change nothing. */
static void test_claim(void **state)
{
    (void)state;
    kvt_alloc_t *a = kvt_alloc_new(64 * KVT_PAGE);
    kvt_block_t *b1 = kvt_alloc_claim(a, 2 * KVT_PAGE, 3 * KVT_PAGE);
    kvt_block_t *b2 = kvt_alloc_claim(a, 5 * KVT_PAGE, 1);              /* right after: one page */
    kvt_block_t *b3 = kvt_alloc_claim(a, 40 * KVT_PAGE, 24 * KVT_PAGE); /* up to the end */
    assert_non_null(b1);
    assert_non_null(b2);
    assert_non_null(b3);
    assert_int_equal(kvt_block_offset(b1), 2 * KVT_PAGE);
    assert_int_equal(kvt_block_size(b1), 3 * KVT_PAGE);
    assert_int_equal(kvt_block_offset(b2), 5 * KVT_PAGE);
    assert_int_equal(kvt_block_size(b2), KVT_PAGE);
    assert_int_equal(kvt_block_offset(b3), 40 * KVT_PAGE);
    assert_int_equal(kvt_alloc_check(a), 0);
    kvt_block_t *b0 = kvt_alloc_claim(a, 0, KVT_PAGE); /* out of order: before the others */
    assert_non_null(b0);
    assert_null(kvt_alloc_claim(a, 4 * KVT_PAGE, 1));              /* inside b1 */
    assert_null(kvt_alloc_claim(a, 30 * KVT_PAGE, 11 * KVT_PAGE)); /* runs into b3 */
    assert_null(kvt_alloc_claim(a, 7 * KVT_PAGE + 1, 1));          /* misaligned */
    assert_null(kvt_alloc_claim(a, 64 * KVT_PAGE, 1));             /* past the end */
    assert_null(kvt_alloc_claim(a, 63 * KVT_PAGE, UINT64_MAX));    /* overflow */
    assert_int_equal(kvt_alloc_used(a), (1 + 3 + 1 + 24) * KVT_PAGE);
    assert_int_equal(kvt_alloc_check(a), 0);
    /* the gaps are free space: page 1 and pages 6..39 */
    kvt_block_t *g = kvt_alloc_get(a, 34 * KVT_PAGE);
    assert_non_null(g);
    assert_int_equal(kvt_block_offset(g), 6 * KVT_PAGE);
    kvt_block_t *g1 = kvt_alloc_get(a, KVT_PAGE);
    assert_non_null(g1);
    assert_int_equal(kvt_block_offset(g1), KVT_PAGE);
    assert_null(kvt_alloc_get(a, KVT_PAGE)); /* full */
    kvt_alloc_put(a, b1);
    kvt_alloc_put(a, g);
    assert_non_null(kvt_alloc_claim(a, 3 * KVT_PAGE, 2 * KVT_PAGE)); /* after frees */
    assert_int_equal(kvt_alloc_check(a), 0);
    kvt_alloc_destroy(&a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_model),
        cmocka_unit_test(test_random_model_odd_capacity),
        cmocka_unit_test(test_coalesce_neighbours),
        cmocka_unit_test(test_fragmentation_metric),
        cmocka_unit_test(test_exact_fit_whole_capacity),
        cmocka_unit_test(test_exact_fit_hole),
        cmocka_unit_test(test_out_of_space_and_edges),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_claim),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
