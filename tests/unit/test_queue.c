/* Unit tests of common/kvt_queue and common/kvt_thread: the bound (count and weight), FIFO
 * order across ring growth, displacing the oldest, batch pops, timed pops (they return after
 * the timeout and well before ten times it), close waking a blocked popper while what was
 * queued is still handed out, the eventfd readable exactly while items wait, wait_idle, counts
 * under several producers and consumers, and supervised threads (idle waits, verdicts,
 * kvtier_thread_up and kvtier_ready, the owner's extra readiness check). */
#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_queue.h"
#include "kvt_supervisor.h"
#include "kvt_thread.h"

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

static kvt_queue_t *s_new(size_t cap, unsigned flags)
{
    char err[128];
    kvt_queue_t *q = kvt_queue_new(cap, flags, err, sizeof err);
    assert_non_null(q);
    return q;
}

static void *s_int(uintptr_t v)
{
    return (void *)v;
}

static void s_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void test_bound_and_fifo(void **state)
{
    (void)state;
    kvt_queue_t *q = s_new(100, 0);
    for (uintptr_t i = 1; i <= 100; i++) /* past the ring's first size: it grows */
        assert_int_equal(kvt_queue_push(q, s_int(i), 1), 0);
    assert_int_equal(kvt_queue_push(q, s_int(101), 1), KVT_EBUSY);
    assert_int_equal(kvt_queue_depth(q), 100);
    void *it;
    for (uintptr_t i = 1; i <= 40; i++) {
        assert_int_equal(kvt_queue_pop(q, &it, 0), 0);
        assert_ptr_equal(it, s_int(i));
    }
    for (uintptr_t i = 101; i <= 140; i++) /* wraps around the ring */
        assert_int_equal(kvt_queue_push(q, s_int(i), 1), 0);
    for (uintptr_t i = 41; i <= 140; i++) {
        assert_int_equal(kvt_queue_pop(q, &it, 0), 0);
        assert_ptr_equal(it, s_int(i));
    }
    assert_int_equal(kvt_queue_pop(q, &it, 0), KVT_ETIMEDOUT);
    assert_null(it);
    kvt_queue_stats_t st;
    kvt_queue_stats(q, &st);
    assert_int_equal(st.pushed, 140);
    assert_int_equal(st.rejected, 1);
    assert_int_equal(st.high_water, 100);
    assert_int_equal(st.len, 0);
    kvt_queue_destroy(&q);
    assert_null(q);
    kvt_queue_destroy(&q); /* NULL is fine */
}

static void test_weights(void **state)
{
    (void)state;
    kvt_queue_t *q = s_new(10, 0);
    assert_int_equal(kvt_queue_push(q, s_int(1), 6), 0);
    assert_int_equal(kvt_queue_push(q, s_int(2), 5), KVT_EBUSY);
    assert_int_equal(kvt_queue_push(q, s_int(3), 4), 0);
    assert_int_equal(kvt_queue_depth(q), 10);
    assert_int_equal(kvt_queue_push(q, s_int(4), 0), 0); /* weightless fits a full queue */
    assert_int_equal(kvt_queue_push(q, s_int(5), 11), KVT_EBUSY);
    void *it;
    assert_int_equal(kvt_queue_pop(q, &it, 0), 0);
    assert_int_equal(kvt_queue_depth(q), 4);
    kvt_queue_destroy(&q);
}

typedef struct {
    uintptr_t got[16];
    size_t n;
} s_dropped_t;

static void s_drop(void *ctx, void *item)
{
    s_dropped_t *d = ctx;
    d->got[d->n++] = (uintptr_t)item;
}

static void test_displace_oldest(void **state)
{
    (void)state;
    kvt_queue_t *q = s_new(10, 0);
    s_dropped_t d = {.n = 0};
    for (uintptr_t i = 1; i <= 4; i++)
        assert_int_equal(kvt_queue_push_displace(q, s_int(i), 3, s_drop, &d), 0);
    assert_int_equal(d.n, 1); /* 4 x 3 > 10: the oldest went */
    assert_int_equal(d.got[0], 1);
    assert_int_equal(kvt_queue_push_displace(q, s_int(5), 25, s_drop, &d), 0);
    assert_int_equal(d.n, 4); /* heavier than the bound: alone */
    assert_int_equal(kvt_queue_depth(q), 25);
    assert_int_equal(kvt_queue_push(q, s_int(6), 1), KVT_EBUSY);
    assert_int_equal(kvt_queue_push_displace(q, s_int(7), 1, s_drop, &d), 0);
    assert_int_equal(d.got[4], 5);
    kvt_queue_stats_t st;
    kvt_queue_stats(q, &st);
    assert_int_equal(st.displaced, 5);
    void *it;
    assert_int_equal(kvt_queue_pop(q, &it, 0), 0);
    assert_ptr_equal(it, s_int(7));
    kvt_queue_destroy(&q);
}

static void test_batch(void **state)
{
    (void)state;
    kvt_queue_t *q = s_new(64, 0);
    for (uintptr_t i = 1; i <= 20; i++)
        kvt_queue_push(q, s_int(i), 1);
    void *items[8];
    size_t n;
    assert_int_equal(kvt_queue_pop_batch(q, items, 8, &n, 0), 0);
    assert_int_equal(n, 8);
    assert_ptr_equal(items[7], s_int(8));
    void *all[64];
    assert_int_equal(kvt_queue_pop_batch(q, all, 64, &n, 10), 0);
    assert_int_equal(n, 12);
    assert_ptr_equal(all[0], s_int(9));
    assert_int_equal(kvt_queue_pop_batch(q, all, 64, &n, 0), KVT_ETIMEDOUT);
    assert_int_equal(n, 0);
    kvt_queue_destroy(&q);
}

static void test_timeout_bounded(void **state)
{
    (void)state;
    kvt_queue_t *q = s_new(4, 0);
    void *it;
    for (int ms = 20; ms <= 80; ms *= 2) {
        uint64_t t0 = kvt_now_ms();
        assert_int_equal(kvt_queue_pop(q, &it, ms), KVT_ETIMEDOUT);
        uint64_t took = kvt_now_ms() - t0;
        assert_true(took >= (uint64_t)ms);
        assert_true(took < (uint64_t)ms * 10);
    }
    uint64_t t0 = kvt_now_ms();
    assert_int_equal(kvt_queue_wait_idle(q, 50), 0); /* idle already: at once */
    kvt_queue_push(q, s_int(1), 1);
    assert_int_equal(kvt_queue_wait_idle(q, 30), KVT_ETIMEDOUT);
    assert_true(kvt_now_ms() - t0 >= 30);
    assert_int_equal(kvt_queue_pop(q, &it, 0), 0);
    assert_int_equal(kvt_queue_wait_idle(q, 0), KVT_ETIMEDOUT); /* popped, not done */
    kvt_queue_task_done(q, 1);
    assert_int_equal(kvt_queue_wait_idle(q, 0), 0);
    kvt_queue_destroy(&q);
}

typedef struct {
    kvt_queue_t *q;
    _Atomic int rc;
    _Atomic uint64_t returned_ms;
    void *item;
} s_popper_t;

static void *s_pop_forever(void *arg)
{
    s_popper_t *p = arg;
    p->rc = kvt_queue_pop(p->q, &p->item, -1);
    p->returned_ms = kvt_now_ms();
    return NULL;
}

static void test_close_wakes_poppers(void **state)
{
    (void)state;
    kvt_queue_t *q = s_new(4, 0);
    s_popper_t p[3];
    pthread_t tid[3];
    for (int i = 0; i < 3; i++) {
        p[i] = (s_popper_t){.q = q, .rc = 1};
        assert_int_equal(pthread_create(&tid[i], NULL, s_pop_forever, &p[i]), 0);
    }
    s_sleep_ms(30);
    assert_int_equal(kvt_queue_push(q, s_int(7), 1), 0); /* exactly one of them gets it */
    s_sleep_ms(30);
    uint64_t closed_at = kvt_now_ms();
    kvt_queue_close(q);
    kvt_queue_close(q); /* idempotent */
    int got = 0, unavail = 0;
    for (int i = 0; i < 3; i++) {
        pthread_join(tid[i], NULL);
        if (p[i].rc == 0) {
            got++;
            assert_ptr_equal(p[i].item, s_int(7));
        } else {
            unavail += p[i].rc == KVT_EUNAVAIL;
            assert_true(p[i].returned_ms - closed_at < 1000);
        }
    }
    assert_int_equal(got, 1);
    assert_int_equal(unavail, 2);
    assert_true(kvt_queue_closed(q));
    assert_int_equal(kvt_queue_push(q, s_int(8), 1), KVT_EUNAVAIL);
    kvt_queue_destroy(&q);
}

static void test_close_drains_first(void **state)
{
    (void)state;
    kvt_queue_t *q = s_new(4, 0);
    kvt_queue_push(q, s_int(1), 1);
    kvt_queue_push(q, s_int(2), 1);
    kvt_queue_close(q);
    s_dropped_t d = {.n = 0};
    assert_int_equal(kvt_queue_push_displace(q, s_int(3), 1, s_drop, &d), KVT_EUNAVAIL);
    void *it;
    assert_int_equal(kvt_queue_pop(q, &it, -1), 0);
    assert_ptr_equal(it, s_int(1));
    assert_int_equal(kvt_queue_pop(q, &it, -1), 0);
    assert_ptr_equal(it, s_int(2));
    assert_int_equal(kvt_queue_pop(q, &it, -1), KVT_EUNAVAIL);
    kvt_queue_destroy(&q);
}

static bool s_readable(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 0) == 1;
}

static void test_eventfd(void **state)
{
    (void)state;
    kvt_queue_t *q = s_new(8, KVT_QUEUE_FD);
    int fd = kvt_queue_fd(q);
    assert_true(fd >= 0);
    assert_false(s_readable(fd));
    kvt_queue_push(q, s_int(1), 1);
    kvt_queue_push(q, s_int(2), 1);
    assert_true(s_readable(fd));
    void *it;
    kvt_queue_pop(q, &it, 0);
    assert_true(s_readable(fd));
    kvt_queue_pop(q, &it, 0);
    assert_false(s_readable(fd));
    assert_int_equal(kvt_queue_pop(q, &it, 0), KVT_ETIMEDOUT);
    assert_false(s_readable(fd));
    kvt_queue_destroy(&q);
    kvt_queue_t *plain = s_new(8, 0);
    assert_int_equal(kvt_queue_fd(plain), -1);
    kvt_queue_destroy(&plain);
}

#define S_PRODUCERS 4
#define S_CONSUMERS 3
#define S_PER_PRODUCER 5000

typedef struct {
    kvt_queue_t *q;
    int id;
    _Atomic uint64_t *pushed, *busy;
    uint64_t sum, count;
    uint32_t last[S_PRODUCERS]; /* per producer: sequence numbers arrive in order */
    bool ordered;
} s_mpmc_t;

static void *s_producer(void *arg)
{
    s_mpmc_t *p = arg;
    for (uint32_t i = 1; i <= S_PER_PRODUCER; i++) {
        uintptr_t v = ((uintptr_t)p->id << 32) | i;
        while (kvt_queue_push(p->q, s_int(v), 1) == KVT_EBUSY) {
            atomic_fetch_add(p->busy, 1);
            sched_yield();
        }
        atomic_fetch_add(p->pushed, 1);
    }
    return NULL;
}

static void *s_consumer(void *arg)
{
    s_mpmc_t *c = arg;
    c->ordered = true;
    for (;;) {
        void *items[5];
        size_t n;
        int rc = kvt_queue_pop_batch(c->q, items, 5, &n, 100);
        if (rc == KVT_EUNAVAIL)
            break;
        for (size_t i = 0; i < n; i++) {
            uintptr_t v = (uintptr_t)items[i];
            uint32_t prod = (uint32_t)(v >> 32), seq = (uint32_t)v;
            if (seq <= c->last[prod])
                c->ordered = false;
            c->last[prod] = seq;
            c->sum += seq;
            c->count++;
        }
        kvt_queue_task_done(c->q, n);
    }
    return NULL;
}

static void test_mpmc_counts(void **state)
{
    (void)state;
    kvt_queue_t *q = s_new(16, 0); /* small: producers meet a full queue */
    _Atomic uint64_t pushed = 0, busy = 0;
    s_mpmc_t prod[S_PRODUCERS], cons[S_CONSUMERS];
    pthread_t pt[S_PRODUCERS], ct[S_CONSUMERS];
    for (int i = 0; i < S_CONSUMERS; i++) {
        cons[i] = (s_mpmc_t){.q = q};
        assert_int_equal(pthread_create(&ct[i], NULL, s_consumer, &cons[i]), 0);
    }
    for (int i = 0; i < S_PRODUCERS; i++) {
        prod[i] = (s_mpmc_t){.q = q, .id = i, .pushed = &pushed, .busy = &busy};
        assert_int_equal(pthread_create(&pt[i], NULL, s_producer, &prod[i]), 0);
    }
    for (int i = 0; i < S_PRODUCERS; i++)
        pthread_join(pt[i], NULL);
    assert_int_equal(kvt_queue_wait_idle(q, 30000), 0);
    kvt_queue_close(q);
    uint64_t count = 0, sum = 0;
    for (int i = 0; i < S_CONSUMERS; i++) {
        pthread_join(ct[i], NULL);
        count += cons[i].count;
        sum += cons[i].sum;
        assert_true(cons[i].ordered); /* FIFO: one consumer sees a producer's items in order */
    }
    assert_int_equal(count, (uint64_t)S_PRODUCERS * S_PER_PRODUCER);
    assert_int_equal(sum, (uint64_t)S_PRODUCERS * S_PER_PRODUCER * (S_PER_PRODUCER + 1) / 2);
    kvt_queue_stats_t st;
    kvt_queue_stats(q, &st);
    assert_int_equal(st.pushed, (uint64_t)S_PRODUCERS * S_PER_PRODUCER);
    assert_int_equal(st.rejected, atomic_load(&busy));
    assert_true(st.high_water <= 16);
    assert_int_equal(st.active, 0);
    kvt_queue_destroy(&q);
}

/* ---- kvt_thread ---- */

typedef struct {
    kvt_queue_t *q;
    _Atomic int handled, idle_rounds;
    int64_t idle_ms;
} s_body_t;

static bool s_body(kvt_thread_t *t, void *arg)
{
    s_body_t *b = arg;
    b->idle_ms = kvt_thread_idle_ms(t);
    for (;;) {
        void *it;
        int rc = kvt_queue_pop(b->q, &it, kvt_thread_idle_ms(t));
        if (rc == KVT_EUNAVAIL)
            return true;
        if (!kvt_thread_beat(t))
            return false;
        if (rc == 0)
            b->handled++;
        else
            b->idle_rounds++;
    }
}

/* The value of the kvtier_<name>{thread=<label>} sample the supervisor emits (label NULL: none);
 * -1 when it has none. */
typedef struct {
    const char *name, *label;
    double value;
} s_probe_t;

static void s_probe_emit(void *ctx, const kvt_sample_t *s)
{
    s_probe_t *p = ctx;
    if (strcmp(s->name, p->name) == 0 &&
        (!p->label || (s->label_value && strcmp(s->label_value, p->label) == 0)))
        p->value = s->value;
}

static double s_sup_sample(kvt_sup_t *sup, const char *name, const char *label)
{
    s_probe_t p = {name, label, -1};
    kvt_sup_metrics_source(sup, s_probe_emit, &p);
    return p.value;
}

static bool s_l2_down(void *ctx, char *why, size_t whylen)
{
    snprintf(why, whylen, "l2 %s: connection refused", (const char *)ctx);
    return false;
}

static void test_thread_supervised(void **state)
{
    (void)state;
    kvt_sup_t *sup = kvt_sup_new(NULL);
    s_body_t b = {.q = s_new(8, 0)};
    kvt_thread_t *t = kvt_thread_start(sup, "qtest", 500, s_body, &b);
    assert_non_null(t);
    kvt_queue_push(b.q, s_int(1), 1);
    kvt_queue_push(b.q, s_int(2), 1);
    s_sleep_ms(200);
    char why[128];
    assert_true(kvt_sup_ready(sup, why, sizeof why)); /* idle, yet beating */
    assert_true(atomic_load(&b.idle_rounds) >= 1);
    kvt_queue_close(b.q);
    kvt_thread_join(&t);
    assert_null(t);
    assert_int_equal(b.handled, 2);
    assert_int_equal(b.idle_ms, 50);
    assert_true(kvt_sup_ready(sup, why, sizeof why)); /* asked to stop: not dead */
    /* ... and not down on /metrics either (kvtier_thread_up during a normal shutdown) */
    assert_true(s_sup_sample(sup, "thread_up", "qtest") == 1.0);
    assert_true(s_sup_sample(sup, "ready", NULL) == 1.0);
    /* the owner's extra check (L2) makes kvt_sup_ready, hence /readyz and kvtier_ready, false */
    kvt_sup_set_ready_check(sup, s_l2_down, "redis:x");
    assert_false(kvt_sup_ready(sup, why, sizeof why));
    assert_string_equal(why, "l2 redis:x: connection refused");
    assert_true(s_sup_sample(sup, "ready", NULL) == 0.0);
    assert_true(s_sup_sample(sup, "thread_up", "qtest") == 1.0);
    kvt_sup_set_ready_check(sup, NULL, NULL);
    assert_true(kvt_sup_ready(sup, why, sizeof why));
    kvt_queue_destroy(&b.q);
    kvt_sup_destroy(&sup);
}

static void test_thread_fault_exit_is_dead(void **state)
{
    (void)state;
    kvt_sup_fault_t f = {.thread = "qfault", .mode = "exit", .after_ms = 0};
    kvt_sup_t *sup = kvt_sup_new(&f);
    s_body_t b = {.q = s_new(8, 0)};
    kvt_thread_t *t = kvt_thread_start(sup, "qfault", 2000, s_body, &b);
    kvt_thread_join(&t); /* the first beat says exit */
    char why[128];
    assert_false(kvt_sup_ready(sup, why, sizeof why));
    assert_non_null(strstr(why, "qfault is dead"));
    assert_true(s_sup_sample(sup, "thread_up", "qfault") == 0.0);
    assert_true(s_sup_sample(sup, "ready", NULL) == 0.0);
    assert_int_equal(b.idle_ms, 200);
    kvt_queue_destroy(&b.q);
    kvt_sup_destroy(&sup);
}

static void test_thread_unsupervised(void **state)
{
    (void)state;
    s_body_t b = {.q = s_new(8, 0)};
    kvt_thread_t *t = kvt_thread_start(NULL, "closer", 0, s_body, &b);
    kvt_queue_push(b.q, s_int(1), 1);
    kvt_queue_close(b.q); /* what was queued is still handled */
    kvt_thread_join(&t);
    assert_int_equal(b.handled, 1);
    assert_int_equal(b.idle_ms, 200); /* still wakes for periodic work */
    kvt_queue_destroy(&b.q);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bound_and_fifo),
        cmocka_unit_test(test_weights),
        cmocka_unit_test(test_displace_oldest),
        cmocka_unit_test(test_batch),
        cmocka_unit_test(test_timeout_bounded),
        cmocka_unit_test(test_close_wakes_poppers),
        cmocka_unit_test(test_close_drains_first),
        cmocka_unit_test(test_eventfd),
        cmocka_unit_test(test_mpmc_counts),
        cmocka_unit_test(test_thread_supervised),
        cmocka_unit_test(test_thread_fault_exit_is_dead),
        cmocka_unit_test(test_thread_unsupervised),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
