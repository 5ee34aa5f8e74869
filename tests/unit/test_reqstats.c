/* Unit tests of daemon/kvt_reqstats through its metrics source: every request type of the table
 * (and "unknown") has a requests_total and a duration histogram, every wire error code a
 * request_errors_total; a request counts under its type (ids outside the table as "unknown"),
 * its error under its wire code (NOMEM and IO under "internal"), its duration in the
 * histogram's count and sum; dropped messages and failed replies count apart. Four threads
 * counting at once lose nothing. */
#include "kvt_error.h"
#include "kvt_proto.h"
#include "kvt_reqstats.h"

#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

typedef struct {
    const char *name, *label_value; /* the sample wanted (label_value NULL: unlabelled) */
    double value;
    uint64_t count;
    double sum;
    int seen;
} s_want_t;

static void s_emit(void *ctx, const kvt_sample_t *s)
{
    s_want_t *w = ctx;
    if (strcmp(s->name, w->name) != 0)
        return;
    if (w->label_value ? !s->label_value || strcmp(s->label_value, w->label_value) != 0
                       : s->label_value != NULL)
        return;
    w->seen++;
    w->value = s->value;
    w->count = s->count;
    w->sum = s->sum;
}

static s_want_t s_get(kvt_reqstats_t *rs, const char *name, const char *label_value)
{
    s_want_t w = {.name = name, .label_value = label_value};
    kvt_reqstats_source(rs, s_emit, &w);
    assert_int_equal(w.seen, 1);
    return w;
}

static void test_every_row_has_its_samples(void **state)
{
    (void)state;
    kvt_reqstats_t *rs = kvt_reqstats_new();
    assert_true(s_get(rs, "requests_total", "unknown").value == 0);
    for (uint64_t t = 1; t < KVT_REQ_SLOTS; t++) {
        assert_true(s_get(rs, "requests_total", kvt_proto_name(t)).value == 0);
        assert_int_equal(s_get(rs, "request_duration_seconds", kvt_proto_name(t)).count, 0);
    }
    for (int e = 0; e < KVT_WIRE_ERRORS; e++)
        assert_true(s_get(rs, "request_errors_total", kvt_err_wire_name(e)).value == 0);
    kvt_reqstats_destroy(&rs);
    assert_null(rs);
    kvt_reqstats_destroy(&rs);
}

static void test_counts(void **state)
{
    (void)state;
    kvt_reqstats_t *rs = kvt_reqstats_new();
    kvt_reqstats_request(rs, KVT_REQ_PUT, 0, 2000000);        /* 2 ms */
    kvt_reqstats_request(rs, KVT_REQ_PUT, KVT_ENOSPC, 1000000); /* 1 ms */
    kvt_reqstats_request(rs, KVT_REQ_GET, KVT_ENOMEM, 0);
    kvt_reqstats_request(rs, KVT_REQ_GET, KVT_EIO, 0);
    kvt_reqstats_request(rs, 999, KVT_EUNKTYPE, 0);
    kvt_reqstats_dropped(rs);
    kvt_reqstats_reply_failed(rs);
    kvt_reqstats_reply_failed(rs);
    assert_true(s_get(rs, "requests_total", "put").value == 2);
    assert_true(s_get(rs, "requests_total", "get").value == 2);
    assert_true(s_get(rs, "requests_total", "unknown").value == 1);
    assert_true(s_get(rs, "requests_total", "ping").value == 0);
    assert_true(s_get(rs, "request_errors_total", "no_space").value == 1);
    assert_true(s_get(rs, "request_errors_total", "internal").value == 2);
    assert_true(s_get(rs, "request_errors_total", "unknown_type").value == 1);
    assert_true(s_get(rs, "request_errors_total", "busy").value == 0);
    s_want_t h = s_get(rs, "request_duration_seconds", "put");
    assert_int_equal(h.count, 2);
    assert_true(h.sum > 0.0029 && h.sum < 0.0031);
    assert_true(s_get(rs, "messages_dropped_total", NULL).value == 1);
    assert_true(s_get(rs, "replies_failed_total", NULL).value == 2);
    kvt_reqstats_destroy(&rs);
}

static void *s_count(void *arg)
{
    for (int i = 0; i < 10000; i++)
        kvt_reqstats_request(arg, KVT_REQ_LOOKUP, i % 2 ? KVT_EBUSY : 0, 1000);
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    kvt_reqstats_t *rs = kvt_reqstats_new();
    pthread_t t[4];
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&t[i], NULL, s_count, rs), 0);
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);
    assert_true(s_get(rs, "requests_total", "lookup").value == 40000);
    assert_true(s_get(rs, "request_errors_total", "busy").value == 20000);
    assert_int_equal(s_get(rs, "request_duration_seconds", "lookup").count, 40000);
    kvt_reqstats_destroy(&rs);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_row_has_its_samples),
        cmocka_unit_test(test_counts),
        cmocka_unit_test(test_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
