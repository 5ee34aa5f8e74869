/* Unit tests of storage/kvt_evlog: records numbered from 1 and read back in order after a
 * cursor, with their kind, namespace, salt and keys; the capacity and the byte bound dropping
 * the oldest (a reader then sees the gap in the span); a record read before it was dropped
 * still readable after; wait waking on an append, timing out, and returning at once once
 * closed; and four writers against one reader that must see every seq once, in order. */
#include "kvt_evlog.h"

#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

static kvt_key_t s_key(uint32_t v)
{
    kvt_key_t k;
    memset(&k, 0, sizeof k);
    memcpy(k.b, &v, sizeof v);
    return k;
}

static kvt_ns_t s_ns(const char *name, const char *salt)
{
    return (kvt_ns_t){(const uint8_t *)name, (uint32_t)strlen(name), (const uint8_t *)salt,
                      salt ? (uint32_t)strlen(salt) : 0};
}

static uint64_t s_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void test_append_and_read_in_order(void **state)
{
    (void)state;
    kvt_evlog_t *log = kvt_evlog_new(8, 0);
    kvt_evlog_span_t sp = kvt_evlog_span(log);
    assert_int_equal(sp.first, 1);
    assert_int_equal(sp.last, 0);
    kvt_key_t keys[3] = {s_key(1), s_key(2), s_key(3)};
    kvt_ns_t a = s_ns("lmcache/m/1/0", "salty"), b = s_ns("other", NULL);
    assert_int_equal(kvt_evlog_append(log, KVT_EV_STORED, &a, keys, NULL, NULL, 3), 1);
    assert_int_equal(kvt_evlog_append(log, KVT_EV_L2_REMOVED, &b, keys + 1, NULL, NULL, 1), 2);
    assert_int_equal(kvt_evlog_append(log, KVT_EV_EVICTED, &a, keys, NULL, NULL, 0), 0); /* none */
    kvt_evrec_t *out[8];
    uint32_t n = kvt_evlog_read(log, 0, out, 8, &sp);
    assert_int_equal(n, 2);
    assert_int_equal(sp.first, 1);
    assert_int_equal(sp.last, 2);
    assert_int_equal(out[0]->seq, 1);
    assert_int_equal(out[0]->kind, KVT_EV_STORED);
    assert_int_equal(out[0]->n, 3);
    assert_memory_equal(out[0]->keys, keys, sizeof keys);
    assert_int_equal(out[0]->ns.name_len, strlen("lmcache/m/1/0"));
    assert_memory_equal(out[0]->ns.name, "lmcache/m/1/0", out[0]->ns.name_len);
    assert_int_equal(out[0]->ns.salt_len, 5);
    assert_memory_equal(out[0]->ns.salt, "salty", 5);
    assert_int_equal(out[1]->seq, 2);
    assert_string_equal(kvt_ev_name(out[1]->kind), "l2_removed");
    assert_string_equal(kvt_ev_tier(out[1]->kind), "l2");
    assert_string_equal(kvt_ev_tier(out[0]->kind), "l1");
    assert_int_equal(out[1]->ns.salt_len, 0);
    kvt_evlog_put(out, n);
    /* after the cursor only; at the end: nothing */
    n = kvt_evlog_read(log, 1, out, 8, &sp);
    assert_int_equal(n, 1);
    assert_int_equal(out[0]->seq, 2);
    kvt_evlog_put(out, n);
    assert_int_equal(kvt_evlog_read(log, 2, out, 8, &sp), 0);
    assert_int_equal(kvt_evlog_read(log, 99, out, 8, &sp), 0);
    /* max */
    n = kvt_evlog_read(log, 0, out, 1, NULL);
    assert_int_equal(n, 1);
    assert_int_equal(out[0]->seq, 1);
    kvt_evlog_put(out, n);
    assert_true(kvt_evlog_incarnation(log) > 0);
    kvt_evlog_destroy(&log);
    assert_null(log);
}

/* Sizes and labels are copied into the record (the caller's buffers may go at once), a key
 * without a label reads back as len 0, and they count against the byte bound. */
static void test_sizes_and_labels(void **state)
{
    (void)state;
    kvt_evlog_t *log = kvt_evlog_new(8, 0);
    kvt_key_t keys[3] = {s_key(1), s_key(2), s_key(3)};
    kvt_ns_t ns = s_ns("vllm-ec/m/bfloat16/h4096", NULL);
    uint64_t sizes[3] = {9437312, 4096, 1};
    char a[] = "mm-0123abcd", c[] = "caf\xc3\xa9";
    kvt_bytes_t labels[3] = {{(const uint8_t *)a, 11}, {NULL, 0}, {(const uint8_t *)c, 5}};
    assert_int_equal(kvt_evlog_append(log, KVT_EV_STORED, &ns, keys, sizes, labels, 3), 1);
    assert_int_equal(kvt_evlog_append(log, KVT_EV_L2_REMOVED, &ns, keys, NULL, NULL, 1), 2);
    memset(sizes, 0xee, sizeof sizes);
    memset(a, 'x', sizeof a - 1);
    memset(c, 'y', sizeof c - 1);
    kvt_evrec_t *out[2];
    assert_int_equal(kvt_evlog_read(log, 0, out, 2, NULL), 2);
    assert_non_null(out[0]->sizes);
    assert_int_equal(out[0]->sizes[0], 9437312);
    assert_int_equal(out[0]->sizes[1], 4096);
    assert_int_equal(out[0]->sizes[2], 1);
    assert_non_null(out[0]->labels);
    assert_int_equal(out[0]->labels[0].len, 11);
    assert_memory_equal(out[0]->labels[0].ptr, "mm-0123abcd", 11);
    assert_int_equal(out[0]->labels[1].len, 0);
    assert_int_equal(out[0]->labels[2].len, 5);
    assert_memory_equal(out[0]->labels[2].ptr, "caf\xc3\xa9", 5);
    assert_memory_equal(out[0]->keys, keys, sizeof keys);
    assert_null(out[1]->sizes);
    assert_null(out[1]->labels);
    assert_true(out[0]->bytes >= sizeof(kvt_evrec_t) + 3 * (8 + sizeof(kvt_bytes_t) + 16) + 16);
    assert_true(out[1]->bytes < out[0]->bytes);
    kvt_evlog_put(out, 2);
    kvt_evlog_destroy(&log);
    /* a bound that holds one labeled record but not two keeps the newest */
    kvt_evlog_t *small = kvt_evlog_new(8, 2 * sizeof(kvt_evrec_t) + 600);
    char big[255];
    memset(big, 'b', sizeof big);
    kvt_bytes_t bl[2] = {{(const uint8_t *)big, 255}, {(const uint8_t *)big, 255}};
    kvt_evlog_append(small, KVT_EV_STORED, &ns, keys, NULL, bl, 2);
    kvt_evlog_append(small, KVT_EV_STORED, &ns, keys, NULL, bl, 2);
    kvt_evlog_span_t sp = kvt_evlog_span(small);
    assert_int_equal(sp.first, 2);
    assert_int_equal(sp.last, 2);
    kvt_evlog_destroy(&small);
}

static void test_capacity_drops_the_oldest(void **state)
{
    (void)state;
    kvt_evlog_t *log = kvt_evlog_new(4, 0);
    kvt_ns_t ns = s_ns("ns", NULL);
    kvt_evrec_t *held[1];
    for (uint32_t i = 1; i <= 10; i++) {
        kvt_key_t k = s_key(i);
        assert_int_equal(kvt_evlog_append(log, KVT_EV_STORED, &ns, &k, NULL, NULL, 1), i);
        if (i == 2) /* a reader holds seq 1 while the log drops it */
            assert_int_equal(kvt_evlog_read(log, 0, held, 1, NULL), 1);
    }
    kvt_evrec_t *out[16];
    kvt_evlog_span_t sp;
    uint32_t n = kvt_evlog_read(log, 0, out, 16, &sp);
    assert_int_equal(sp.first, 7);
    assert_int_equal(sp.last, 10);
    assert_int_equal(n, 4);
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(out[i]->seq, 7 + i);
        kvt_key_t k = s_key(7 + i);
        assert_memory_equal(out[i]->keys, &k, sizeof k);
    }
    kvt_evlog_put(out, n);
    assert_int_equal(held[0]->seq, 1); /* still whole (ASan would see a use after free) */
    kvt_key_t k1 = s_key(1);
    assert_memory_equal(held[0]->keys, &k1, sizeof k1);
    kvt_evlog_put(held, 1);
    /* a cursor inside the kept range reads from there */
    n = kvt_evlog_read(log, 8, out, 16, &sp);
    assert_int_equal(n, 2);
    assert_int_equal(out[0]->seq, 9);
    kvt_evlog_put(out, n);
    kvt_evlog_destroy(&log);
}

static void test_byte_bound_keeps_the_newest(void **state)
{
    (void)state;
    enum { N = 64 };
    kvt_key_t keys[N];
    for (uint32_t i = 0; i < N; i++)
        keys[i] = s_key(i);
    kvt_ns_t ns = s_ns("ns", NULL);
    /* room for about three records of 64 keys */
    kvt_evlog_t *log = kvt_evlog_new(1000, 3 * N * sizeof(kvt_key_t) + 512);
    for (int i = 0; i < 10; i++)
        kvt_evlog_append(log, KVT_EV_STORED, &ns, keys, NULL, NULL, N);
    kvt_evlog_span_t sp = kvt_evlog_span(log);
    assert_int_equal(sp.last, 10);
    assert_true(sp.last - sp.first + 1 >= 2);
    assert_true(sp.last - sp.first + 1 <= 3);
    /* one record bigger than the bound is still kept (alone) */
    kvt_evlog_t *tiny = kvt_evlog_new(1000, 16);
    kvt_evlog_append(tiny, KVT_EV_STORED, &ns, keys, NULL, NULL, N);
    kvt_evlog_append(tiny, KVT_EV_STORED, &ns, keys, NULL, NULL, N);
    sp = kvt_evlog_span(tiny);
    assert_int_equal(sp.first, 2);
    assert_int_equal(sp.last, 2);
    kvt_evlog_destroy(&tiny);
    kvt_evlog_destroy(&log);
}

typedef struct {
    kvt_evlog_t *log;
    int delay_ms;
} s_later_t;

static void *s_append_later(void *arg)
{
    s_later_t *l = arg;
    struct timespec ts = {0, (long)l->delay_ms * 1000000L};
    nanosleep(&ts, NULL);
    kvt_key_t k = s_key(7);
    kvt_ns_t ns = s_ns("ns", NULL);
    kvt_evlog_append(l->log, KVT_EV_REMOVED, &ns, &k, NULL, NULL, 1);
    return NULL;
}

static void test_wait_wakes_times_out_and_closes(void **state)
{
    (void)state;
    kvt_evlog_t *log = kvt_evlog_new(16, 0);
    uint64_t t0 = s_now_ms();
    assert_false(kvt_evlog_wait(log, 0, 100));
    uint64_t dt = s_now_ms() - t0;
    assert_true(dt >= 90 && dt < 1000);
    s_later_t l = {log, 50};
    pthread_t th;
    pthread_create(&th, NULL, s_append_later, &l);
    t0 = s_now_ms();
    assert_true(kvt_evlog_wait(log, 0, 5000));
    assert_true(s_now_ms() - t0 < 4000);
    pthread_join(th, NULL);
    assert_true(kvt_evlog_wait(log, 0, 0)); /* something is there already */
    assert_false(kvt_evlog_wait(log, 1, 0));
    kvt_evlog_close(log);
    t0 = s_now_ms();
    assert_false(kvt_evlog_wait(log, 1, 5000));
    assert_true(s_now_ms() - t0 < 1000);
    kvt_key_t k = s_key(1);
    kvt_ns_t ns = s_ns("ns", NULL);
    /* still logs */
    assert_int_equal(kvt_evlog_append(log, KVT_EV_STORED, &ns, &k, NULL, NULL, 1), 2);
    kvt_evlog_destroy(&log);
}

enum { S_WRITERS = 4, S_PER_WRITER = 5000 };

static void *s_writer(void *arg)
{
    kvt_evlog_t *log = arg;
    kvt_ns_t ns = s_ns("ns", NULL);
    for (uint32_t i = 0; i < S_PER_WRITER; i++) {
        kvt_key_t k = s_key(i);
        kvt_evlog_append(log, KVT_EV_STORED, &ns, &k, NULL, NULL, 1);
    }
    return NULL;
}

static void test_concurrent_writers_one_reader(void **state)
{
    (void)state;
    /* big enough that the reader never falls behind: it must see each seq exactly once */
    kvt_evlog_t *log = kvt_evlog_new(S_WRITERS * S_PER_WRITER, 0);
    pthread_t th[S_WRITERS];
    for (int i = 0; i < S_WRITERS; i++)
        pthread_create(&th[i], NULL, s_writer, log);
    uint64_t cursor = 0;
    kvt_evrec_t *out[256];
    while (cursor < S_WRITERS * S_PER_WRITER) {
        kvt_evlog_wait(log, cursor, 100);
        kvt_evlog_span_t sp;
        uint32_t n = kvt_evlog_read(log, cursor, out, 256, &sp);
        assert_int_equal(sp.first, 1);
        for (uint32_t i = 0; i < n; i++)
            assert_int_equal(out[i]->seq, cursor + 1 + i);
        if (n)
            cursor = out[n - 1]->seq;
        kvt_evlog_put(out, n);
    }
    for (int i = 0; i < S_WRITERS; i++)
        pthread_join(th[i], NULL);
    assert_int_equal(kvt_evlog_span(log).last, S_WRITERS * S_PER_WRITER);
    kvt_evlog_destroy(&log);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_append_and_read_in_order),
        cmocka_unit_test(test_sizes_and_labels),
        cmocka_unit_test(test_capacity_drops_the_oldest),
        cmocka_unit_test(test_byte_bound_keeps_the_newest),
        cmocka_unit_test(test_wait_wakes_times_out_and_closes),
        cmocka_unit_test(test_concurrent_writers_one_reader),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
