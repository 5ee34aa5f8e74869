/* Unit tests of storage/kvt_lease: ids unique and never 0, take by the owner only (a wrong
 * owner leaves the lease in place), a lease acted on at most once, kind checks and restore,
 * take_owner with and without expiry (a late take says lease_expired, or unknown_lease after
 * BYE), the bounded memory of expired ids, active / expired counters, destroy handing the
 * leases left to `drop`, and many leases of owners that agree in their low 32 bits. */
#include "kvt_error.h"
#include "kvt_lease.h"

#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

static int s_items[8];

static kvt_lease_t *s_new(uint64_t owner, kvt_lease_kind_t kind, uint32_t n)
{
    void *items[8];
    for (uint32_t i = 0; i < n; i++)
        items[i] = &s_items[i];
    kvt_lease_t *l = kvt_lease_new(owner, kind, items, n);
    assert_non_null(l);
    return l;
}

static int s_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void test_new_copies_items(void **state)
{
    (void)state;
    void *items[3] = {&s_items[0], &s_items[1], &s_items[2]};
    kvt_lease_t *l = kvt_lease_new(7, KVT_LEASE_WRITE, items, 3);
    items[0] = items[1] = items[2] = NULL; /* the lease holds a copy */
    assert_int_equal(l->owner, 7);
    assert_int_equal(l->kind, KVT_LEASE_WRITE);
    assert_int_equal(l->nitems, 3);
    assert_ptr_equal(l->items[0], &s_items[0]);
    assert_ptr_equal(l->items[2], &s_items[2]);
    kvt_lease_free(l);
    kvt_lease_t *empty = kvt_lease_new(7, KVT_LEASE_READ, NULL, 0);
    assert_non_null(empty);
    assert_int_equal(empty->nitems, 0);
    kvt_lease_free(empty);
    kvt_lease_free(NULL);
}

static void test_ids_unique_nonzero(void **state)
{
    (void)state;
    enum { N = 5000 };
    kvt_leases_t *t = kvt_leases_new();
    assert_non_null(t);
    static uint64_t ids[N];
    for (int i = 0; i < N; i++) {
        ids[i] = kvt_leases_add(t, s_new((uint64_t)(i % 7) + 1, KVT_LEASE_READ, 1));
        assert_true(ids[i] != 0);
    }
    assert_int_equal(kvt_leases_active(t), N);
    /* take some out: their ids are never handed out again */
    for (int i = 0; i < N; i += 3) {
        kvt_lease_t *l = NULL;
        assert_int_equal(kvt_leases_take(t, ids[i], (uint64_t)(i % 7) + 1, 0, &l), 0);
        assert_non_null(l);
        assert_int_equal(l->id, ids[i]);
        kvt_lease_free(l);
    }
    static uint64_t all[2 * N];
    memcpy(all, ids, sizeof ids);
    for (int i = 0; i < N; i++) {
        all[N + i] = kvt_leases_add(t, s_new(99, KVT_LEASE_WRITE, 2));
        assert_true(all[N + i] != 0);
    }
    qsort(all, 2 * N, sizeof all[0], s_cmp_u64);
    for (int i = 1; i < 2 * N; i++)
        assert_true(all[i] != all[i - 1]);
    kvt_leases_destroy(&t, NULL, NULL);
    assert_null(t);
}

static void test_take_owner_and_once(void **state)
{
    (void)state;
    kvt_leases_t *t = kvt_leases_new();
    uint64_t id = kvt_leases_add(t, s_new(1, KVT_LEASE_READ, 2));
    kvt_lease_t *l = (kvt_lease_t *)0x1;

    /* another owner: unknown_lease, and the lease stays */
    assert_int_equal(kvt_leases_take(t, id, 2, 0, &l), KVT_EUNKLEASE);
    assert_null(l);
    assert_int_equal(kvt_leases_take(t, id, 2, KVT_LEASE_READ, &l), KVT_EUNKLEASE);
    assert_int_equal(kvt_leases_active(t), 1);
    /* never existed */
    assert_int_equal(kvt_leases_take(t, id + 1000, 1, 0, &l), KVT_EUNKLEASE);
    assert_int_equal(kvt_leases_take(t, 0, 1, 0, &l), KVT_EUNKLEASE);

    /* the right owner, the right kind */
    assert_int_equal(kvt_leases_take(t, id, 1, KVT_LEASE_READ, &l), 0);
    assert_non_null(l);
    assert_int_equal(l->id, id);
    assert_int_equal(l->owner, 1);
    assert_int_equal(l->nitems, 2);
    assert_int_equal(kvt_leases_active(t), 0);
    /* taken twice: the second is unknown */
    kvt_lease_t *l2 = NULL;
    assert_int_equal(kvt_leases_take(t, id, 1, 0, &l2), KVT_EUNKLEASE);
    assert_null(l2);
    kvt_lease_free(l);
    assert_int_equal(kvt_leases_expired_total(t), 0);
    kvt_leases_destroy(&t, NULL, NULL);
}

static void test_kind_and_restore(void **state)
{
    (void)state;
    kvt_leases_t *t = kvt_leases_new();
    uint64_t w = kvt_leases_add(t, s_new(5, KVT_LEASE_WRITE, 1));
    uint64_t r = kvt_leases_add(t, s_new(5, KVT_LEASE_READ, 1));
    kvt_lease_t *l = NULL;
    /* COMMIT of a read lease: bad request, and the lease stays */
    assert_int_equal(kvt_leases_take(t, r, 5, KVT_LEASE_WRITE, &l), KVT_EBADREQ);
    assert_null(l);
    assert_int_equal(kvt_leases_active(t), 2);
    /* kind 0 takes any kind */
    assert_int_equal(kvt_leases_take(t, r, 5, 0, &l), 0);
    assert_int_equal(l->kind, KVT_LEASE_READ);
    kvt_lease_free(l);
    assert_int_equal(kvt_leases_take(t, w, 5, KVT_LEASE_WRITE, &l), 0);
    /* the request turned out invalid after the take: restore under the same id */
    kvt_leases_restore(t, l);
    assert_int_equal(l->id, w);
    assert_int_equal(kvt_leases_active(t), 1);
    /* a restored lease is still the owner's: BYE takes it */
    size_t n = 0;
    kvt_lease_t *list = kvt_leases_take_owner(t, 5, false, &n);
    assert_int_equal(n, 1);
    assert_ptr_equal(list, l);
    assert_null(list->next_of_owner);
    kvt_lease_free(list);
    assert_int_equal(kvt_leases_take(t, w, 5, 0, &l), KVT_EUNKLEASE);
    kvt_leases_destroy(&t, NULL, NULL);
}

static void test_take_owner_expired(void **state)
{
    (void)state;
    kvt_leases_t *t = kvt_leases_new();
    uint64_t a[5], b[3];
    for (int i = 0; i < 5; i++)
        a[i] = kvt_leases_add(t, s_new(10, i % 2 ? KVT_LEASE_READ : KVT_LEASE_WRITE, 1));
    for (int i = 0; i < 3; i++)
        b[i] = kvt_leases_add(t, s_new(20, KVT_LEASE_READ, 1));
    assert_int_equal(kvt_leases_active(t), 8);

    /* take one of owner 10 out first: take_owner gets the 4 left */
    kvt_lease_t *one = NULL;
    assert_int_equal(kvt_leases_take(t, a[2], 10, 0, &one), 0);
    size_t n = 0;
    kvt_lease_t *list = kvt_leases_take_owner(t, 10, true, &n);
    assert_int_equal(n, 4);
    uint64_t got[4];
    size_t k = 0;
    for (kvt_lease_t *l = list, *next; l; l = next) {
        next = l->next_of_owner;
        assert_int_equal(l->owner, 10);
        assert_true(k < 4);
        got[k++] = l->id;
        kvt_lease_free(l);
    }
    assert_int_equal(k, 4);
    qsort(got, 4, sizeof got[0], s_cmp_u64);
    assert_int_equal(got[0], a[0]);
    assert_int_equal(got[1], a[1]);
    assert_int_equal(got[2], a[3]);
    assert_int_equal(got[3], a[4]);
    assert_int_equal(kvt_leases_expired_total(t), 4);
    assert_int_equal(kvt_leases_active(t), 3);

    /* a late COMMIT / RELEASE of those ids: lease_expired */
    kvt_lease_t *l = NULL;
    for (int i = 0; i < 5; i++) {
        if (i == 2)
            continue;
        assert_int_equal(kvt_leases_take(t, a[i], 10, 0, &l), KVT_ELEXPIRED);
        assert_int_equal(kvt_leases_take(t, a[i], 10, KVT_LEASE_WRITE, &l), KVT_ELEXPIRED);
        assert_null(l);
    }
    /* the one taken out before was not expired */
    kvt_lease_free(one);
    assert_int_equal(kvt_leases_take(t, a[2], 10, 0, &l), KVT_EUNKLEASE);
    /* owner 20 untouched */
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvt_leases_take(t, b[i], 20, 0, &l), 0);
        kvt_lease_free(l);
    }
    /* nothing left: an empty list, count 0, NULL count pointer allowed */
    n = 99;
    assert_null(kvt_leases_take_owner(t, 10, true, &n));
    assert_int_equal(n, 0);
    assert_null(kvt_leases_take_owner(t, 12345, false, NULL));
    assert_int_equal(kvt_leases_expired_total(t), 4);
    assert_int_equal(kvt_leases_active(t), 0);
    kvt_leases_destroy(&t, NULL, NULL);
}

static void test_take_owner_bye(void **state)
{
    (void)state;
    kvt_leases_t *t = kvt_leases_new();
    uint64_t id[3];
    for (int i = 0; i < 3; i++)
        id[i] = kvt_leases_add(t, s_new(30, KVT_LEASE_WRITE, 1));
    size_t n = 0;
    kvt_lease_t *list = kvt_leases_take_owner(t, 30, false, &n);
    assert_int_equal(n, 3);
    while (list) {
        kvt_lease_t *next = list->next_of_owner;
        kvt_lease_free(list);
        list = next;
    }
    kvt_lease_t *l = NULL;
    for (int i = 0; i < 3; i++)
        assert_int_equal(kvt_leases_take(t, id[i], 30, 0, &l), KVT_EUNKLEASE);
    assert_int_equal(kvt_leases_expired_total(t), 0);
    assert_int_equal(kvt_leases_active(t), 0);
    kvt_leases_destroy(&t, NULL, NULL);
}

/* Expired ids are remembered in a bounded window (the last 65536): older ones fall back to
 * unknown_lease, so a client that never comes back cannot grow the table forever. */
static void test_expired_window_bounded(void **state)
{
    (void)state;
    enum { OLD = 10, WINDOW = 65536 };
    kvt_leases_t *t = kvt_leases_new();
    uint64_t old[OLD];
    for (int i = 0; i < OLD; i++)
        old[i] = kvt_leases_add(t, s_new(1, KVT_LEASE_READ, 0));
    size_t n = 0;
    kvt_lease_t *list = kvt_leases_take_owner(t, 1, true, &n);
    assert_int_equal(n, OLD);
    while (list) {
        kvt_lease_t *next = list->next_of_owner;
        kvt_lease_free(list);
        list = next;
    }
    uint64_t first_new = 0, last_new = 0;
    for (int i = 0; i < WINDOW; i++) {
        uint64_t id = kvt_leases_add(t, s_new(2, KVT_LEASE_READ, 0));
        if (i == 0)
            first_new = id;
        last_new = id;
    }
    list = kvt_leases_take_owner(t, 2, true, &n);
    assert_int_equal(n, WINDOW);
    while (list) {
        kvt_lease_t *next = list->next_of_owner;
        kvt_lease_free(list);
        list = next;
    }
    assert_int_equal(kvt_leases_expired_total(t), OLD + WINDOW);
    kvt_lease_t *l = NULL;
    for (int i = 0; i < OLD; i++)
        assert_int_equal(kvt_leases_take(t, old[i], 1, 0, &l), KVT_EUNKLEASE);
    assert_int_equal(kvt_leases_take(t, first_new, 2, 0, &l), KVT_ELEXPIRED);
    assert_int_equal(kvt_leases_take(t, last_new, 2, 0, &l), KVT_ELEXPIRED);
    kvt_leases_destroy(&t, NULL, NULL);
}

typedef struct {
    int calls;
    uint64_t id_sum;
    int items;
} drop_ctx_t;

static void s_drop(kvt_lease_t *lease, void *ctx)
{
    drop_ctx_t *d = ctx;
    d->calls++;
    d->id_sum += lease->id;
    d->items += (int)lease->nitems;
}

static void test_destroy_drops_leftovers(void **state)
{
    (void)state;
    kvt_leases_t *t = kvt_leases_new();
    uint64_t sum = 0;
    for (int i = 0; i < 6; i++) {
        uint64_t id = kvt_leases_add(t, s_new((uint64_t)i % 3 + 1, KVT_LEASE_READ, 2));
        if (i != 4)
            sum += id;
        else {
            kvt_lease_t *l = NULL;
            assert_int_equal(kvt_leases_take(t, id, (uint64_t)i % 3 + 1, 0, &l), 0);
            kvt_lease_free(l);
        }
    }
    drop_ctx_t d = {0};
    kvt_leases_destroy(&t, s_drop, &d);
    assert_null(t);
    assert_int_equal(d.calls, 5);
    assert_int_equal(d.id_sum, sum);
    assert_int_equal(d.items, 10);
    /* NULL-safe; drop may be NULL with leases left (ASan checks they are freed) */
    kvt_leases_destroy(&t, s_drop, &d);
    t = kvt_leases_new();
    kvt_leases_add(t, s_new(1, KVT_LEASE_WRITE, 3));
    kvt_leases_destroy(&t, NULL, NULL);
}

/* One thread adds leases for an owner while another expires that owner over and over (a
 * request racing the expiry of its silent instance): every add returns a fresh non-zero id
 * (ASan: the lease may be taken and freed by the other thread as soon as it is in the table,
 * so the id must not be read back from it), and every lease is taken exactly once. */
typedef struct {
    kvt_leases_t *t;
    _Atomic bool stop;
    _Atomic uint64_t taken;
} race_t;

static void *s_expirer(void *arg)
{
    race_t *r = arg;
    while (!atomic_load(&r->stop)) {
        size_t n = 0;
        kvt_lease_t *list = kvt_leases_take_owner(r->t, 3, true, &n);
        while (list) {
            kvt_lease_t *next = list->next_of_owner;
            kvt_lease_free(list);
            list = next;
        }
        atomic_fetch_add(&r->taken, n);
    }
    return NULL;
}

static void test_add_races_take_owner(void **state)
{
    (void)state;
    enum { N = 100000 };
    race_t r = {.t = kvt_leases_new()};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, s_expirer, &r), 0);
    uint64_t *ids = malloc(N * sizeof *ids);
    for (int i = 0; i < N; i++) {
        ids[i] = kvt_leases_add(r.t, s_new(3, KVT_LEASE_READ, 1));
        assert_true(ids[i] != 0);
    }
    atomic_store(&r.stop, true);
    pthread_join(th, NULL);
    size_t n = 0;
    kvt_lease_t *list = kvt_leases_take_owner(r.t, 3, true, &n);
    while (list) {
        kvt_lease_t *next = list->next_of_owner;
        kvt_lease_free(list);
        list = next;
    }
    assert_int_equal(atomic_load(&r.taken) + n, N);
    assert_int_equal(kvt_leases_expired_total(r.t), N);
    qsort(ids, N, sizeof *ids, s_cmp_u64);
    for (int i = 1; i < N; i++)
        assert_true(ids[i] != ids[i - 1]);
    free(ids);
    kvt_leases_destroy(&r.t, NULL, NULL);
}

/* Many leases of many owners whose ids agree in their low 32 bits (a table keyed by a
 * truncated owner would merge them): each lease is found for its owner only, takes and expiry
 * of some owners leave every other lease and account alone, and the expired ring keeps exactly
 * the last 65536 ids however often it wraps. */
static void s_free_list(kvt_lease_t *list)
{
    while (list) {
        kvt_lease_t *next = list->next_of_owner;
        kvt_lease_free(list);
        list = next;
    }
}

static void test_many_owners_and_ids(void **state)
{
    (void)state;
    enum { OWNERS = 64, N = 20000, WINDOW = 65536 };
    kvt_leases_t *t = kvt_leases_new();
    uint64_t owners[OWNERS];
    kvt_account_t *acct[OWNERS];
    for (int k = 0; k < OWNERS; k++) {
        owners[k] = ((uint64_t)k << 32) | 7;
        acct[k] = kvt_leases_account(t, owners[k]);
        assert_true(kvt_account_charge(acct[k], (uint64_t)k + 1, 0, NULL));
    }
    uint64_t *ids = malloc(N * sizeof *ids);
    assert_non_null(ids);
    for (int i = 0; i < N; i++)
        ids[i] = kvt_leases_add(t, s_new(owners[i % OWNERS], KVT_LEASE_READ, 1));
    for (int i = 0; i < N; i++) {
        kvt_lease_t *l = kvt_leases_peek(t, ids[i], owners[i % OWNERS]);
        assert_non_null(l);
        assert_int_equal(l->id, ids[i]);
        assert_null(kvt_leases_peek(t, ids[i], owners[(i + 1) % OWNERS]));
    }
    for (int k = 0; k < OWNERS; k++)
        assert_int_equal(kvt_leases_owner_bytes(t, owners[k]), k + 1);
    /* every third lease taken by id */
    for (int i = 0; i < N; i += 3) {
        kvt_lease_t *l = NULL;
        assert_int_equal(kvt_leases_take(t, ids[i], owners[(i + 1) % OWNERS], 0, &l),
                         KVT_EUNKLEASE);
        assert_int_equal(kvt_leases_take(t, ids[i], owners[i % OWNERS], 0, &l), 0);
        kvt_lease_free(l);
    }
    /* the even owners expire: their leases say lease_expired, the odd owners' stay */
    size_t expired = 0;
    for (int k = 0; k < OWNERS; k += 2) {
        size_t n = 0;
        s_free_list(kvt_leases_take_owner(t, owners[k], true, &n));
        expired += n;
    }
    assert_int_equal(kvt_leases_expired_total(t), expired);
    assert_int_equal(kvt_leases_active(t), N - N / 3 - 1 - expired);
    for (int i = 0; i < N; i++) {
        kvt_lease_t *l = NULL;
        int rc = kvt_leases_take(t, ids[i], owners[i % OWNERS], 0, &l);
        if (i % 3 == 0)
            assert_int_equal(rc, KVT_EUNKLEASE);
        else if (i % OWNERS % 2 == 0)
            assert_int_equal(rc, KVT_ELEXPIRED);
        else
            assert_int_equal(rc, 0);
        kvt_lease_free(l);
    }
    assert_int_equal(kvt_leases_active(t), 0);
    for (int k = 0; k < OWNERS; k++) {
        assert_int_equal(kvt_leases_owner_bytes(t, owners[k]), k + 1);
        kvt_account_uncharge(acct[k], (uint64_t)k + 1);
        kvt_leases_account_put(t, acct[k]);
        assert_int_equal(kvt_leases_owner_bytes(t, owners[k]), 0);
    }
    /* the ring wraps twice more: exactly the last WINDOW expired ids are remembered (expired in
     * batches of 1024, aligned with the window: a batch expires its newest lease first) */
    uint64_t total = expired;
    size_t cap = 2 * WINDOW + 3 * 1024;
    uint64_t *late = malloc(cap * sizeof *late);
    assert_non_null(late);
    for (size_t i = 0; i < cap; i++) {
        late[i] = kvt_leases_add(t, s_new(owners[1], KVT_LEASE_READ, 0));
        if (i % 1024 == 1023) {
            size_t n = 0;
            s_free_list(kvt_leases_take_owner(t, owners[1], true, &n));
            total += n;
        }
    }
    assert_int_equal(kvt_leases_expired_total(t), total);
    kvt_lease_t *l = NULL;
    for (size_t i = 0; i < cap; i++)
        assert_int_equal(kvt_leases_take(t, late[i], owners[1], 0, &l),
                         i < cap - WINDOW ? KVT_EUNKLEASE : KVT_ELEXPIRED);
    for (int i = 0; i < N; i++) /* older than the window */
        assert_int_equal(kvt_leases_take(t, ids[i], owners[i % OWNERS], 0, &l), KVT_EUNKLEASE);
    free(late);
    free(ids);
    kvt_leases_destroy(&t, NULL, NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_new_copies_items),
        cmocka_unit_test(test_ids_unique_nonzero),
        cmocka_unit_test(test_take_owner_and_once),
        cmocka_unit_test(test_kind_and_restore),
        cmocka_unit_test(test_take_owner_expired),
        cmocka_unit_test(test_take_owner_bye),
        cmocka_unit_test(test_expired_window_bounded),
        cmocka_unit_test(test_destroy_drops_leftovers),
        cmocka_unit_test(test_add_races_take_owner),
        cmocka_unit_test(test_many_owners_and_ids),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
