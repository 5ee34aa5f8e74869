/* Unit tests of common/kvt_workers.c, the pool the server loop hands slow requests to: every
 * job runs once on a pool thread and comes back through the done queue, whose eventfd is
 * readable exactly while finished jobs wait; a full queue answers KVT_EBUSY at once (the server
 * loop never blocks); destroy runs what was queued; the threads are supervised by name; a
 * detached pool's jobs run once and come back through no queue. */
#include "kvt_error.h"
#include "kvt_supervisor.h"
#include "kvt_workers.h"

#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

typedef struct {
    int id;
    atomic_int runs;
    pthread_t ran_on;
} job_t;

static void s_run(void *arg)
{
    job_t *j = arg;
    j->ran_on = pthread_self();
    atomic_fetch_add(&j->runs, 1);
}

/* A job that holds its worker until the test opens the gate. */
static pthread_mutex_t s_gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t s_gate_cond = PTHREAD_COND_INITIALIZER;
static bool s_gate_open;
static atomic_int s_blocked;

static void s_blocking(void *arg)
{
    atomic_fetch_add(&s_blocked, 1);
    pthread_mutex_lock(&s_gate_lock);
    while (!s_gate_open)
        pthread_cond_wait(&s_gate_cond, &s_gate_lock);
    pthread_mutex_unlock(&s_gate_lock);
    s_run(arg);
}

static void s_gate(bool open)
{
    pthread_mutex_lock(&s_gate_lock);
    s_gate_open = open;
    pthread_cond_broadcast(&s_gate_cond);
    pthread_mutex_unlock(&s_gate_lock);
}

static bool s_readable(int fd, int timeout_ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, timeout_ms) == 1 && (p.revents & POLLIN);
}

static void s_sleep_ms(int ms)
{
    struct timespec ts = {0, ms * 1000000L};
    nanosleep(&ts, NULL);
}

/* Collects `want` finished jobs the way the server loop does: poll the fd, then drain. */
static int s_collect(kvt_workers_t *w, job_t **out, int want)
{
    int got = 0;
    for (int spins = 0; got < want && spins < 500; spins++) {
        if (!s_readable(kvt_workers_fd(w), 20))
            continue;
        job_t *j;
        while ((j = kvt_workers_done(w)))
            out[got++] = j;
    }
    return got;
}

static void test_jobs_run_once_and_come_back(void **state)
{
    (void)state;
    char err[256] = "";
    kvt_sup_t *sup = kvt_sup_new(NULL);
    kvt_workers_t *w = kvt_workers_new("tw", 3, 64, sup, err, sizeof err);
    assert_non_null(w);
    assert_false(s_readable(kvt_workers_fd(w), 0)); /* nothing finished yet */
    enum { N = 50 };
    job_t jobs[N];
    memset(jobs, 0, sizeof jobs);
    for (int i = 0; i < N; i++) {
        jobs[i].id = i;
        assert_int_equal(kvt_workers_submit(w, s_run, &jobs[i]), 0);
    }
    job_t *back[N];
    assert_int_equal(s_collect(w, back, N), N);
    assert_int_equal(kvt_workers_pending(w), 0);
    bool seen[N] = {false};
    for (int i = 0; i < N; i++) {
        assert_false(seen[back[i]->id]);
        seen[back[i]->id] = true;
        assert_int_equal(atomic_load(&back[i]->runs), 1);
        assert_false(pthread_equal(back[i]->ran_on, pthread_self()));
    }
    /* drained: the eventfd is no longer readable */
    assert_false(s_readable(kvt_workers_fd(w), 0));
    assert_null(kvt_workers_done(w));

    /* the threads are registered with the supervisor under the pool's name */
    json_t *st = kvt_sup_status_json(sup);
    int named = 0;
    for (size_t i = 0; i < json_array_size(st); i++) {
        const char *name = json_string_value(json_object_get(json_array_get(st, i), "name"));
        named += name && strncmp(name, "tw-", 3) == 0;
    }
    json_decref(st);
    assert_int_equal(named, 3);
    char why[128];
    assert_true(kvt_sup_ready(sup, why, sizeof why));
    kvt_workers_destroy(&w);
    assert_null(w);
    kvt_sup_destroy(&sup);
}

/* One worker held busy, a queue of 4: the fifth waiting job is refused at once, nothing is
 * lost, and once the worker is free everything accepted comes back. */
static void test_full_queue_is_busy_not_blocking(void **state)
{
    (void)state;
    char err[256] = "";
    kvt_workers_t *w = kvt_workers_new("tb", 1, 4, NULL, err, sizeof err);
    assert_non_null(w);
    s_gate(false);
    atomic_store(&s_blocked, 0);
    job_t hold = {.id = 100};
    assert_int_equal(kvt_workers_submit(w, s_blocking, &hold), 0);
    for (int i = 0; i < 200 && atomic_load(&s_blocked) == 0; i++)
        s_sleep_ms(5);
    assert_int_equal(atomic_load(&s_blocked), 1); /* the worker is inside the job */
    job_t jobs[5];
    memset(jobs, 0, sizeof jobs);
    for (int i = 0; i < 4; i++) {
        jobs[i].id = i;
        assert_int_equal(kvt_workers_submit(w, s_run, &jobs[i]), 0);
    }
    int full = kvt_workers_submit(w, s_run, &jobs[4]);
    size_t pending = kvt_workers_pending(w);
    s_gate(true); /* before any check can fail: the held worker must not outlive the test */
    assert_int_equal(full, KVT_EBUSY);
    assert_int_equal(pending, 5);
    job_t *back[5];
    assert_int_equal(s_collect(w, back, 5), 5);
    assert_int_equal(atomic_load(&jobs[4].runs), 0); /* refused means never run */
    for (int i = 0; i < 4; i++)
        assert_int_equal(atomic_load(&jobs[i].runs), 1);
    /* room again */
    assert_int_equal(kvt_workers_submit(w, s_run, &jobs[4]), 0);
    assert_int_equal(s_collect(w, back, 1), 1);
    assert_ptr_equal(back[0], &jobs[4]);
    kvt_workers_destroy(&w);
}

static void *s_open_gate_later(void *arg)
{
    (void)arg;
    s_sleep_ms(50);
    s_gate(true);
    return NULL;
}

/* Destroy runs the jobs still queued before the threads go (a clean stop loses no accepted
 * request); results nobody collected are let go with a warning, the jobs themselves untouched. */
static void test_destroy_runs_what_was_queued(void **state)
{
    (void)state;
    char err[256] = "";
    kvt_workers_t *w = kvt_workers_new("td", 1, 16, NULL, err, sizeof err);
    assert_non_null(w);
    s_gate(false);
    atomic_store(&s_blocked, 0);
    job_t hold = {.id = 100};
    assert_int_equal(kvt_workers_submit(w, s_blocking, &hold), 0);
    job_t jobs[8];
    memset(jobs, 0, sizeof jobs);
    for (int i = 0; i < 8; i++)
        assert_int_equal(kvt_workers_submit(w, s_run, &jobs[i]), 0);
    for (int i = 0; i < 200 && atomic_load(&s_blocked) == 0; i++)
        s_sleep_ms(5);
    assert_int_equal(atomic_load(&jobs[0].runs), 0); /* still queued behind the held job */
    pthread_t opener;
    assert_int_equal(pthread_create(&opener, NULL, s_open_gate_later, NULL), 0);
    kvt_workers_destroy(&w); /* waits for the held job, then runs the 8 queued ones */
    pthread_join(opener, NULL);
    assert_null(w);
    assert_int_equal(atomic_load(&hold.runs), 1);
    for (int i = 0; i < 8; i++)
        assert_int_equal(atomic_load(&jobs[i].runs), 1);
}

/* A detached pool (the cache service's lookup threads): jobs run once and hand themselves on;
 * nothing comes back through a done queue, and a job no longer counts once it has run. */
static void test_detached_jobs_hand_themselves_on(void **state)
{
    (void)state;
    char err[256];
    kvt_workers_t *w = kvt_workers_new_detached("tdet", 2, 16, 5000, NULL, err, sizeof err);
    assert_non_null(w);
    assert_int_equal(kvt_workers_fd(w), -1);
    job_t jobs[6];
    memset(jobs, 0, sizeof jobs);
    for (int i = 0; i < 6; i++)
        assert_int_equal(kvt_workers_submit(w, s_run, &jobs[i]), 0);
    for (int t = 0; t < 1000 && kvt_workers_pending(w) > 0; t++)
        nanosleep(&(struct timespec){.tv_nsec = 5000000}, NULL);
    assert_int_equal(kvt_workers_pending(w), 0);
    assert_null(kvt_workers_done(w));
    for (int i = 0; i < 6; i++)
        assert_int_equal(atomic_load(&jobs[i].runs), 1);
    kvt_workers_destroy(&w);
    assert_null(w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_jobs_run_once_and_come_back),
        cmocka_unit_test(test_full_queue_is_busy_not_blocking),
        cmocka_unit_test(test_destroy_runs_what_was_queued),
        cmocka_unit_test(test_detached_jobs_hand_themselves_on),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
