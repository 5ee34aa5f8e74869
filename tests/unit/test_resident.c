/* Unit tests of common/kvt_resident: the writer's adds and deletes as a reader of the shared
 * region sees them (prefixes, namespaces and salts apart), deletions that keep every live key
 * findable and never fill the map,
 * a full window counted and never answered wrong, the header checks of kvt_resident_view, the
 * seals (no one but the daemon's own mapping writes the map), and a reader racing the writer
 * that never finds a key that was never added. */
#include "kvt_error.h"
#include "kvt_resident.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

static kvt_ns_t s_ns(const char *name, const char *salt)
{
    return (kvt_ns_t){(const uint8_t *)name, (uint32_t)strlen(name), (const uint8_t *)salt,
                      salt ? (uint32_t)strlen(salt) : 0};
}

static void s_keys(kvt_key_t *keys, uint32_t tag, uint32_t first, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        memset(keys[i].b, 0x5a, KVT_KEY_LEN);
        uint32_t id = first + i;
        memcpy(keys[i].b, &tag, 4);
        memcpy(keys[i].b + 4, &id, 4);
    }
}

/* A reader's view: a read-only mapping of the map's descriptor, as a client has it. */
typedef struct {
    void *map;
    size_t size;
    kvt_resident_view_t v;
} reader_t;

static void s_reader(kvt_resident_t *r, reader_t *rd)
{
    char path[64], why[160];
    snprintf(path, sizeof path, "/proc/self/fd/%d", kvt_resident_fd(r));
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    assert_true(fd >= 0);
    rd->size = kvt_resident_size(r);
    rd->map = mmap(NULL, rd->size, PROT_READ, MAP_SHARED, fd, 0);
    assert_true(rd->map != MAP_FAILED);
    close(fd);
    if (kvt_resident_view(rd->map, rd->size, &rd->v, why, sizeof why) != 0)
        fail_msg("view: %s", why);
}

/* A map of `slots` and a reader of it. */
static kvt_resident_t *s_map(uint32_t slots, reader_t *rd)
{
    char err[160];
    kvt_resident_t *r = kvt_resident_new(slots, err, sizeof err);
    if (!r)
        fail_msg("kvt_resident_new: %s", err);
    s_reader(r, rd);
    return r;
}

static void s_add(kvt_resident_t *r, const kvt_ns_t *ns, const kvt_key_t *keys, uint32_t n)
{
    uint64_t nsh = kvt_resident_ns_hash(kvt_resident_seed(r), ns);
    for (uint32_t i = 0; i < n; i++)
        kvt_resident_add(r, kvt_resident_tag(nsh, &keys[i]));
}

static void s_del(kvt_resident_t *r, const kvt_ns_t *ns, const kvt_key_t *keys, uint32_t n)
{
    uint64_t nsh = kvt_resident_ns_hash(kvt_resident_seed(r), ns);
    for (uint32_t i = 0; i < n; i++)
        kvt_resident_del(r, kvt_resident_tag(nsh, &keys[i]));
}

static void test_prefix_and_namespaces(void **state)
{
    (void)state;
    reader_t rd;
    kvt_resident_t *r = s_map(4096, &rd);
    assert_int_equal(rd.v.mask + 1, 4096);
    kvt_ns_t a = s_ns("m", NULL), as = s_ns("m", "s"), ab = s_ns("ab", NULL), a_b = s_ns("a", "b");
    kvt_key_t k[64];
    s_keys(k, 1, 0, 64);
    assert_int_equal(kvt_resident_prefix(&rd.v, &a, k, 64), 0);
    s_add(r, &a, k, 32);
    assert_int_equal(kvt_resident_prefix(&rd.v, &a, k, 64), 32);
    assert_int_equal(kvt_resident_prefix(&rd.v, &a, k, 0), 0);
    assert_int_equal(kvt_resident_prefix(&rd.v, &as, k, 64), 0);
    s_add(r, &ab, k, 4);
    assert_int_equal(kvt_resident_prefix(&rd.v, &a_b, k, 4), 0);
    assert_int_equal(kvt_resident_prefix(&rd.v, &ab, k, 4), 4);
    /* a hole stops the prefix; adding twice is one entry */
    s_del(r, &a, &k[10], 1);
    assert_int_equal(kvt_resident_prefix(&rd.v, &a, k, 64), 10);
    assert_int_equal(kvt_resident_prefix(&rd.v, &a, &k[11], 21), 21);
    s_add(r, &a, &k[11], 1);
    kvt_resident_stats_t st;
    kvt_resident_stats(r, &st);
    assert_int_equal(st.entries, 31 + 4);
    /* deleting what is not there changes nothing */
    s_del(r, &as, k, 8);
    kvt_resident_stats(r, &st);
    assert_int_equal(st.entries, 35);
    /* the writer beats at creation, and closing says it is gone */
    assert_true(kvt_resident_fresh(&rd.v));
    kvt_resident_close(r);
    assert_false(kvt_resident_fresh(&rd.v));
    kvt_resident_beat(r);
    assert_true(kvt_resident_fresh(&rd.v));
    munmap(rd.map, rd.size);
    kvt_resident_destroy(&r);
    assert_null(r);
    kvt_resident_destroy(&r); /* accepts NULL */
}

/* Churn of 2000 adds and deletes through 1024 slots holding 200 live keys: every live key
 * is still found, none is left out, and the runs deleted from are as short as before (the
 * deletions shifted the tags back). */
static void test_deletions_keep_live_keys(void **state)
{
    (void)state;
    reader_t rd;
    kvt_resident_t *r = s_map(1024, &rd);
    kvt_ns_t ns = s_ns("churn", NULL);
    enum { LIVE = 200, ROUNDS = 40, STEP = 50 };
    kvt_key_t live[LIVE], k[STEP];
    s_keys(live, 7, 0, LIVE);
    s_add(r, &ns, live, LIVE);
    for (uint32_t round = 0; round < ROUNDS; round++) {
        s_keys(k, 8, round * STEP, STEP);
        s_add(r, &ns, k, STEP);
        assert_int_equal(kvt_resident_prefix(&rd.v, &ns, k, STEP), STEP);
        s_del(r, &ns, k, STEP);
        assert_int_equal(kvt_resident_prefix(&rd.v, &ns, k, 1), 0);
    }
    kvt_resident_stats_t st;
    kvt_resident_stats(r, &st);
    assert_int_equal(st.entries + st.full, LIVE);
    /* a key left out (its window full) is a miss, never a wrong hit; at 20 % load none is */
    assert_int_equal(st.full, 0);
    assert_int_equal(kvt_resident_prefix(&rd.v, &ns, live, LIVE), LIVE);
    uint64_t used = 0; /* nothing but the live tags is left in the slots */
    for (uint64_t i = 0; i <= rd.v.mask; i++)
        used += rd.v.slots[i] != 0;
    assert_int_equal(used, LIVE);
    munmap(rd.map, rd.size);
    kvt_resident_destroy(&r);
}

/* Random adds and deletes against a model (1500 keys at most in 4096 slots, runs wrapping the
 * end of the table included): the map answers exactly the model for every key, and holds
 * exactly its entries. */
static void test_random_against_a_model(void **state)
{
    (void)state;
    reader_t rd;
    kvt_resident_t *r = s_map(4096, &rd);
    kvt_ns_t ns = s_ns("model", "salt");
    enum { POOL = 1500, OPS = 30000 };
    static kvt_key_t keys[POOL];
    static bool in[POOL];
    s_keys(keys, 11, 0, POOL);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    uint32_t live = 0;
    for (uint32_t op = 0; op < OPS; op++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        uint32_t k = (uint32_t)(x % POOL);
        if (in[k])
            s_del(r, &ns, &keys[k], 1), live--;
        else
            s_add(r, &ns, &keys[k], 1), live++;
        in[k] = !in[k];
        if (op % 5000 == 4999 || op == OPS - 1) {
            kvt_resident_stats_t st;
            kvt_resident_stats(r, &st);
            assert_int_equal(st.full, 0);
            assert_int_equal(st.entries, live);
            uint64_t used = 0;
            for (uint64_t i = 0; i <= rd.v.mask; i++)
                used += rd.v.slots[i] != 0;
            assert_int_equal(used, live);
            for (uint32_t i = 0; i < POOL; i++)
                if (kvt_resident_prefix(&rd.v, &ns, &keys[i], 1) != (uint32_t)in[i])
                    fail_msg("op %u: key %u is %s in the model but %s in the map", op, i,
                             in[i] ? "present" : "absent", in[i] ? "absent" : "present");
        }
    }
    munmap(rd.map, rd.size);
    kvt_resident_destroy(&r);
}

/* More keys than slots: the windows fill, the rest is counted and reads as absent. */
static void test_full_windows(void **state)
{
    (void)state;
    reader_t rd;
    kvt_resident_t *r = s_map(1, &rd); /* rounded up to 1024 */
    assert_int_equal(rd.v.mask + 1, KVT_RES_MIN_SLOTS);
    kvt_ns_t ns = s_ns("full", NULL);
    enum { N = 3000 };
    kvt_key_t *k = malloc(N * sizeof *k);
    s_keys(k, 9, 0, N);
    s_add(r, &ns, k, N);
    kvt_resident_stats_t st;
    kvt_resident_stats(r, &st);
    assert_int_equal(st.entries + st.full, N);
    assert_true(st.entries <= KVT_RES_MIN_SLOTS && st.full >= N - KVT_RES_MIN_SLOTS);
    uint32_t found = 0;
    for (uint32_t i = 0; i < N; i++)
        found += kvt_resident_prefix(&rd.v, &ns, &k[i], 1);
    assert_int_equal(found, st.entries);
    kvt_key_t other[64];
    s_keys(other, 10, 0, 64);
    for (uint32_t i = 0; i < 64; i++)
        assert_int_equal(kvt_resident_prefix(&rd.v, &ns, &other[i], 1), 0);
    free(k);
    munmap(rd.map, rd.size);
    kvt_resident_destroy(&r);
}

static void test_view_checks_the_header(void **state)
{
    (void)state;
    char why[160];
    kvt_resident_view_t v;
    size_t size = kvt_resident_region_size(1024);
    uint8_t *m = calloc(1, size);
    assert_int_equal(kvt_resident_view(m, size, &v, why, sizeof why), KVT_EINVAL);
    assert_non_null(strstr(why, "not a residency map"));
    assert_int_equal(kvt_resident_view(m, 64, &v, why, sizeof why), KVT_EINVAL);
    assert_int_equal(kvt_resident_view(NULL, size, &v, why, sizeof why), KVT_EINVAL);
    uint64_t magic = KVT_RES_MAGIC, seed = 42;
    uint32_t version = KVT_RES_VERSION, hdr = KVT_RES_HDR_SIZE, slots = 1024, window = 16;
    memcpy(m + KVT_RES_OFF_MAGIC, &magic, 8);
    memcpy(m + KVT_RES_OFF_VERSION, &version, 4);
    memcpy(m + KVT_RES_OFF_HDR_SIZE, &hdr, 4);
    memcpy(m + KVT_RES_OFF_SLOTS, &slots, 4);
    memcpy(m + KVT_RES_OFF_WINDOW, &window, 4);
    memcpy(m + KVT_RES_OFF_SEED, &seed, 8);
    assert_int_equal(kvt_resident_view(m, size, &v, why, sizeof why), 0);
    assert_int_equal(v.seed, 42);
    /* slots past the region, not a power of two, a window of 0 */
    assert_int_equal(kvt_resident_view(m, size - 8, &v, why, sizeof why), KVT_EINVAL);
    assert_non_null(strstr(why, "does not fit"));
    slots = 1000;
    memcpy(m + KVT_RES_OFF_SLOTS, &slots, 4);
    assert_int_equal(kvt_resident_view(m, size, &v, why, sizeof why), KVT_EINVAL);
    slots = 1024;
    window = 0;
    memcpy(m + KVT_RES_OFF_SLOTS, &slots, 4);
    memcpy(m + KVT_RES_OFF_WINDOW, &window, 4);
    assert_int_equal(kvt_resident_view(m, size, &v, why, sizeof why), KVT_EINVAL);
    /* the beat: 0 (closed) and a second old are not fresh, now is */
    assert_false(kvt_resident_fresh(&v));
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    uint64_t old = now - KVT_RES_STALE_NS - 1000000;
    memcpy(m + KVT_RES_OFF_BEAT, &old, 8);
    assert_false(kvt_resident_fresh(&v));
    uint64_t ahead = now + 10 * KVT_RES_STALE_NS; /* another clock's: says nothing */
    memcpy(m + KVT_RES_OFF_BEAT, &ahead, 8);
    assert_false(kvt_resident_fresh(&v));
    memcpy(m + KVT_RES_OFF_BEAT, &now, 8);
    assert_true(kvt_resident_fresh(&v));
    version = 2;
    window = 16;
    memcpy(m + KVT_RES_OFF_WINDOW, &window, 4);
    memcpy(m + KVT_RES_OFF_VERSION, &version, 4);
    assert_int_equal(kvt_resident_view(m, size, &v, why, sizeof why), KVT_EINVAL);
    free(m);
}

/* Only the daemon's own mapping writes: the memfd cannot be mapped writable, written,
 * resized or unsealed by whoever holds a descriptor of it. */
static void test_sealed_against_writers(void **state)
{
    (void)state;
    char err[160];
    kvt_resident_t *r = kvt_resident_new(4096, err, sizeof err);
    assert_non_null(r);
    int fd = kvt_resident_fd(r);
    size_t size = kvt_resident_size(r);
    void *w = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(w == MAP_FAILED);
    uint64_t zero = 0;
    assert_true(pwrite(fd, &zero, sizeof zero, KVT_RES_HDR_SIZE) < 0);
    assert_true(ftruncate(fd, (off_t)size / 2) != 0);
    assert_true(fcntl(fd, F_ADD_SEALS, 0) != 0 || errno == EPERM);
    /* a read-only mapping cannot be made writable afterwards */
    void *ro = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    assert_true(ro != MAP_FAILED);
    assert_int_not_equal(mprotect(ro, size, PROT_READ | PROT_WRITE), 0);
    munmap(ro, size);
    kvt_resident_destroy(&r);
}

typedef struct {
    const kvt_resident_view_t *v;
    _Atomic bool stop;
    _Atomic uint64_t probes;
    uint64_t wrong;
} race_t;

static void *s_race_reader(void *arg)
{
    race_t *rc = arg;
    kvt_ns_t ns = s_ns("race", NULL);
    kvt_key_t never[16];
    s_keys(never, 99, 0, 16);
    while (!atomic_load(&rc->stop)) {
        for (uint32_t i = 0; i < 16; i++)
            rc->wrong += kvt_resident_prefix(rc->v, &ns, &never[i], 1);
        atomic_fetch_add(&rc->probes, 16);
    }
    return NULL;
}

static void test_reader_races_writer(void **state)
{
    (void)state;
    reader_t rd;
    kvt_resident_t *r = s_map(1024, &rd);
    race_t rc = {.v = &rd.v};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, s_race_reader, &rc), 0);
    kvt_ns_t ns = s_ns("race", NULL);
    kvt_key_t k[64];
    /* at least 400 rounds, and on until the reader has probed (a serializing runner such as
     * valgrind may not have scheduled it yet), within 30 s */
    time_t until = time(NULL) + 30;
    for (uint32_t round = 0; round < 400 || (atomic_load(&rc.probes) < 1600 && time(NULL) < until);
         round++) {
        s_keys(k, 98, round * 64, 64);
        s_add(r, &ns, k, 64);
        s_del(r, &ns, k, 64);
    }
    atomic_store(&rc.stop, true);
    pthread_join(t, NULL);
    kvt_resident_stats_t st;
    kvt_resident_stats(r, &st);
    assert_true(atomic_load(&rc.probes) >= 1600);
    assert_int_equal(rc.wrong, 0);
    munmap(rd.map, rd.size);
    kvt_resident_destroy(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefix_and_namespaces),
        cmocka_unit_test(test_deletions_keep_live_keys),
        cmocka_unit_test(test_random_against_a_model),
        cmocka_unit_test(test_full_windows),
        cmocka_unit_test(test_view_checks_the_header),
        cmocka_unit_test(test_sealed_against_writers),
        cmocka_unit_test(test_reader_races_writer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
