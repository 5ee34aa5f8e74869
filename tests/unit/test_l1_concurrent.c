/* Concurrency test of storage/kvt_l1: 4 worker threads for about 2 s doing random RESERVE /
 * COMMIT / ACQUIRE / RELEASE / LOOKUP / REMOVE on an overlapping key space with their own owner
 * ids, one thread calling kvt_l1_evict and one calling kvt_l1_release_owner for a rotating
 * owner. Writers fill each slot with a pattern derived from the key; readers verify it after
 * ACQUIRE and again just before RELEASE, so an object reused (or written) under a pin shows up
 * as a mismatch. At the end every lease is released and, after CLEAR, the counters are zero.
 *
 * Owners: each worker has one "checked" owner that no other thread touches (its leases must
 * behave exactly: every COMMIT/RELEASE answers 0) and a few "victim" owners that the
 * release_owner thread expires or BYEs at random. Victim write leases are never committed with
 * data (a client whose lease expired may not write), only released or committed with every
 * index failed; victim read leases are never read. Their late COMMIT/RELEASE may answer 0,
 * lease_expired (expired) or unknown_lease (BYE), nothing else.
 *
 * The tier runs with l1_checksum: every COMMIT hashes its objects while other threads work, and
 * every read checks them with kvt_l1_verify (nothing writes after COMMIT here, so all match).
 *
 * A second test shares one owner between 4 threads under max_leased_bytes while another thread
 * expires it again and again: the owner never holds more than the limit (sampled after every
 * lease and by a monitor), and everything is given back at the end.
 *
 * Runs under ASan+UBSan (make unit) and ThreadSanitizer (make tsan). */
#include "kvt_config.h"
#include "kvt_error.h"
#include "kvt_l1.h"
#include "kvt_log.h"

#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#define NWORKERS 4
#define NVICTIMS 3 /* victim owners per worker */
#define NKEYS 512  /* shared key space */
#define MAXBATCH 8
#define RUN_MS 2000    /* wall-clock duration */
#define MAX_OPS 400000 /* per worker: a bound when the machine is fast */
#define MAX_HELD 16    /* victim leases a worker keeps before resolving the oldest */


static kvt_l1_t *s_l1;
static uint8_t *s_base;
static uint64_t s_cap;
static _Atomic bool s_stop;
static _Atomic uint64_t s_errors;
static _Atomic uint64_t s_mismatches;
static _Atomic uint64_t s_verified_bytes;
static _Atomic uint64_t s_ops[8];
static kvt_key_t s_keys[NKEYS];
static const kvt_ns_t s_ns = {(const uint8_t *)"conc", 4, (const uint8_t *)"s", 1};

enum { OP_STORE, OP_READ, OP_LOOKUP, OP_LOCK, OP_REMOVE, OP_VICTIM_W, OP_VICTIM_R, OP_N };

static uint64_t s_owner(int worker, int victim) /* victim -1: the checked owner */
{
    return 1000u * (uint64_t)(worker + 1) + (uint64_t)(victim + 1);
}

static uint64_t s_rand(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

static uint64_t s_mix(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Size of key i: 4 KiB .. 64 KiB, fixed per key (so any writer of a key writes the same). The
 * key space holds about 1.1x the 16 MiB arena, so RESERVE evicts on demand. */
static uint64_t s_size_of(uint32_t i)
{
    return 4096u * (1 + s_mix(i) % 16) - (s_mix(i + 7) % 4096) / 2;
}

static uint32_t s_id_of(const kvt_key_t *key)
{
    uint32_t id;
    memcpy(&id, key->b + 4, sizeof id);
    return id;
}

static void s_fill(uint8_t *p, uint64_t len, uint32_t id)
{
    uint64_t seed = s_mix(0xC0FFEEull ^ id), i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w = seed ^ (i * 0x100000001B3ull);
        memcpy(p + i, &w, 8);
    }
    uint64_t w = seed ^ (i * 0x100000001B3ull);
    memcpy(p + i, &w, len - i);
}

static bool s_check(const uint8_t *p, uint64_t len, uint32_t id)
{
    uint64_t seed = s_mix(0xC0FFEEull ^ id), i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w = seed ^ (i * 0x100000001B3ull);
        if (memcmp(p + i, &w, 8) != 0)
            return false;
    }
    uint64_t w = seed ^ (i * 0x100000001B3ull);
    return memcmp(p + i, &w, len - i) == 0;
}

#define ERR(...)                                                                                   \
    do {                                                                                           \
        if (atomic_fetch_add(&s_errors, 1) < 20)                                                   \
            fprintf(stderr, "test_l1_concurrent: " __VA_ARGS__);                                   \
    } while (0)

static void s_verify_slots(const kvt_slot_t *slots, uint32_t n, const kvt_key_t *keys,
                           const char *when)
{
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id = s_id_of(&keys[i]);
        if (slots[i].length != s_size_of(id) || slots[i].offset % 4096 ||
            slots[i].offset + slots[i].length > s_cap) {
            ERR("key %u: bad slot {%llu, %llu} (%s)\n", id, (unsigned long long)slots[i].offset,
                (unsigned long long)slots[i].length, when);
            continue;
        }
        if (!s_check(s_base + slots[i].offset, slots[i].length, id)) {
            if (atomic_fetch_add(&s_mismatches, 1) < 10)
                fprintf(stderr,
                        "test_l1_concurrent: key %u: data mismatch at {%llu, %llu} %s (an "
                        "object reused or written under a pin)\n",
                        id, (unsigned long long)slots[i].offset,
                        (unsigned long long)slots[i].length, when);
        } else {
            atomic_fetch_add_explicit(&s_verified_bytes, slots[i].length, memory_order_relaxed);
        }
    }
}

typedef struct {
    uint64_t id;
    uint64_t owner;
    bool write;
    uint32_t nslots;
} held_t;

typedef struct {
    int w;
    uint64_t seed;
    held_t held[MAX_HELD];
    int nheld;
    _Atomic uint64_t ops;
} worker_t;

static uint32_t s_pick(worker_t *t, kvt_key_t *keys)
{
    uint32_t n = 1 + (uint32_t)(s_rand(&t->seed) % MAXBATCH);
    uint32_t first = (uint32_t)(s_rand(&t->seed) % NKEYS);
    for (uint32_t i = 0; i < n; i++)
        keys[i] = s_keys[(first + i) % NKEYS];
    return n;
}

/* A victim lease's late COMMIT / RELEASE: the release_owner thread may have taken it. */
static void s_resolve(worker_t *t, held_t *h)
{
    char err[KVT_ERR_LEN];
    int rc;
    if (h->write && s_rand(&t->seed) % 2) {
        uint64_t failed[MAXBATCH];
        for (uint32_t i = 0; i < h->nslots; i++)
            failed[i] = i;
        uint32_t stored = 99;
        rc = kvt_l1_commit(s_l1, h->owner, h->id, failed, h->nslots, &stored, err, sizeof err);
        if (rc == 0 && stored != 0)
            ERR("commit with every index failed stored %u\n", stored);
    } else {
        rc = kvt_l1_release(s_l1, h->owner, h->id);
    }
    if (rc != 0 && rc != KVT_ELEXPIRED && rc != KVT_EUNKLEASE)
        ERR("victim lease %llu: %s\n", (unsigned long long)h->id, kvt_err_name(rc));
}

static void s_hold(worker_t *t, uint64_t id, uint64_t owner, bool write, uint32_t nslots)
{
    if (t->nheld == MAX_HELD) {
        s_resolve(t, &t->held[0]);
        memmove(&t->held[0], &t->held[1], (MAX_HELD - 1) * sizeof t->held[0]);
        t->nheld--;
    }
    t->held[t->nheld++] = (held_t){id, owner, write, nslots};
}

static void s_op_store(worker_t *t, kvt_key_t *keys, uint32_t n)
{
    uint64_t owner = s_owner(t->w, -1), sizes[MAXBATCH], lease = 0;
    kvt_slot_t slots[MAXBATCH];
    uint32_t nslots = 0, stored = 0;
    char err[KVT_ERR_LEN];
    for (uint32_t i = 0; i < n; i++)
        sizes[i] = s_size_of(s_id_of(&keys[i]));
    int rc = kvt_l1_reserve(s_l1, owner, &s_ns, keys, n, sizes, 0, slots, &nslots,
                            &lease, err, sizeof err);
    if (rc == KVT_ENOSPC)
        return;
    if (rc || nslots == 0 || nslots > n) {
        ERR("reserve: %s nslots %u of %u (%s)\n", kvt_err_name(rc), nslots, n, err);
        return;
    }
    uint64_t failed[MAXBATCH];
    uint32_t nfailed = 0, fresh = 0;
    for (uint32_t i = 0; i < nslots; i++) {
        if (!slots[i].length)
            continue;
        fresh++;
        uint32_t id = s_id_of(&keys[i]);
        if (slots[i].length != sizes[i] || slots[i].offset % 4096 ||
            slots[i].offset + slots[i].length > s_cap) {
            ERR("reserve: key %u bad slot {%llu, %llu}\n", id, (unsigned long long)slots[i].offset,
                (unsigned long long)slots[i].length);
            return;
        }
        if (s_rand(&t->seed) % 10 == 0)
            failed[nfailed++] = i; /* this one "failed to copy": not written */
        else
            s_fill(s_base + slots[i].offset, slots[i].length, id);
    }
    if (!fresh) {
        if (lease != 0)
            ERR("reserve: every slot nil but lease %llu\n", (unsigned long long)lease);
        return;
    }
    if (lease == 0) {
        ERR("reserve: fresh slots without a lease\n");
        return;
    }
    if (s_rand(&t->seed) % 20 == 0) {
        rc = kvt_l1_release(s_l1, owner, lease); /* gave up: discard */
    } else {
        rc = kvt_l1_commit(s_l1, owner, lease, failed, nfailed, &stored, err, sizeof err);
        if (rc == 0 && stored != fresh - nfailed)
            ERR("commit stored %u, expected %u\n", stored, fresh - nfailed);
    }
    if (rc)
        ERR("commit/release of own write lease: %s (%s)\n", kvt_err_name(rc), err);
}

static void s_op_read(worker_t *t, kvt_key_t *keys, uint32_t n)
{
    uint64_t owner = s_owner(t->w, -1), lease = 0;
    kvt_slot_t slots[MAXBATCH];
    uint32_t nslots = 0;
    int rc = kvt_l1_acquire(s_l1, owner, &s_ns, keys, n, slots, &nslots, &lease);
    if (rc || nslots > n || (nslots == 0) != (lease == 0)) {
        ERR("acquire: %s nslots %u lease %llu\n", kvt_err_name(rc), nslots,
            (unsigned long long)lease);
        return;
    }
    if (!nslots)
        return;
    s_verify_slots(slots, nslots, keys, "after ACQUIRE");
    uint32_t good = kvt_l1_verify(s_l1, owner, lease, nslots);
    if (good != nslots)
        ERR("l1_checksum: %u of %u objects match their COMMIT checksum\n", good, nslots);
    sched_yield(); /* let writers, the evictor and REMOVE run while we hold the pin */
    s_verify_slots(slots, nslots, keys, "before RELEASE");
    rc = kvt_l1_release(s_l1, owner, lease);
    if (rc)
        ERR("release of own read lease: %s\n", kvt_err_name(rc));
}

static void s_op_lookup(worker_t *t, kvt_key_t *keys, uint32_t n, bool lock)
{
    uint64_t owner = s_owner(t->w, -1), lease = 0;
    uint32_t hits = 0;
    int rc = kvt_l1_lookup(s_l1, owner, &s_ns, keys, n, lock, &hits, &lease);
    if (rc || hits > n || (!lock && lease) || (lock && (hits == 0) != (lease == 0))) {
        ERR("lookup: %s hits %u lease %llu\n", kvt_err_name(rc), hits, (unsigned long long)lease);
        return;
    }
    if (lock && lease) {
        /* pinned like ACQUIRE: the data must be there and stay */
        kvt_slot_t slots[MAXBATCH];
        uint32_t nslots = 0;
        uint64_t l2 = 0;
        rc = kvt_l1_acquire(s_l1, owner, &s_ns, keys, hits, slots, &nslots, &l2);
        /* the pinned keys cannot be evicted, but REMOVE may take them: nslots <= hits */
        if (rc || nslots > hits)
            ERR("acquire under a LOOKUP lock: %s nslots %u of %u\n", kvt_err_name(rc), nslots,
                hits);
        if (!rc && nslots) {
            s_verify_slots(slots, nslots, keys, "under a LOOKUP lock");
            if (kvt_l1_release(s_l1, owner, l2))
                ERR("release after lookup-lock acquire failed\n");
        }
        if (kvt_l1_release(s_l1, owner, lease))
            ERR("release of own lookup lock failed\n");
    }
}

static void s_op_remove(worker_t *t, kvt_key_t *keys, uint32_t n)
{
    (void)t;
    uint32_t removed = 99;
    int rc = kvt_l1_remove(s_l1, &s_ns, keys, n, &removed);
    if (rc || removed > n)
        ERR("remove: %s removed %u of %u\n", kvt_err_name(rc), removed, n);
}

static void s_op_victim(worker_t *t, kvt_key_t *keys, uint32_t n, bool write)
{
    uint64_t owner = s_owner(t->w, (int)(s_rand(&t->seed) % NVICTIMS)), lease = 0;
    kvt_slot_t slots[MAXBATCH];
    uint32_t nslots = 0;
    char err[KVT_ERR_LEN];
    int rc;
    if (write) {
        uint64_t sizes[MAXBATCH];
        for (uint32_t i = 0; i < n; i++)
            sizes[i] = s_size_of(s_id_of(&keys[i]));
        rc = kvt_l1_reserve(s_l1, owner, &s_ns, keys, n, sizes, 0, slots, &nslots,
                            &lease, err, sizeof err);
        if (rc && rc != KVT_ENOSPC)
            ERR("victim reserve: %s\n", kvt_err_name(rc));
    } else {
        rc = kvt_l1_acquire(s_l1, owner, &s_ns, keys, n, slots, &nslots, &lease);
        if (rc)
            ERR("victim acquire: %s\n", kvt_err_name(rc));
    }
    if (!rc && lease)
        s_hold(t, lease, owner, write, nslots);
}

static void *s_worker(void *arg)
{
    worker_t *t = arg;
    kvt_key_t keys[MAXBATCH];
    while (!atomic_load(&s_stop) && t->ops < MAX_OPS) {
        uint32_t n = s_pick(t, keys);
        uint64_t r = s_rand(&t->seed) % 100;
        int op = r < 35   ? OP_STORE
                 : r < 70 ? OP_READ
                 : r < 80 ? OP_LOOKUP
                 : r < 85 ? OP_LOCK
                 : r < 88 ? OP_REMOVE
                 : r < 94 ? OP_VICTIM_W
                          : OP_VICTIM_R;
        switch (op) {
        case OP_STORE:
            s_op_store(t, keys, n);
            break;
        case OP_READ:
            s_op_read(t, keys, n);
            break;
        case OP_LOOKUP:
            s_op_lookup(t, keys, n, false);
            break;
        case OP_LOCK:
            s_op_lookup(t, keys, n, true);
            break;
        case OP_REMOVE:
            s_op_remove(t, keys, n);
            break;
        default:
            s_op_victim(t, keys, n, op == OP_VICTIM_W);
            break;
        }
        atomic_fetch_add_explicit(&s_ops[op], 1, memory_order_relaxed);
        t->ops++;
    }
    while (t->nheld)
        s_resolve(t, &t->held[--t->nheld]);
    return NULL;
}

static _Atomic uint64_t s_evicted_bytes, s_owner_released, s_evict_calls, s_release_calls;

static void s_sleep_us(long us)
{
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

static void *s_evictor(void *arg)
{
    uint64_t seed = (uint64_t)(uintptr_t)arg;
    while (!atomic_load(&s_stop)) {
        uint64_t want = 4096 * (1 + s_rand(&seed) % 256);
        uint64_t got = kvt_l1_evict(s_l1, want);
        if (got > s_cap)
            ERR("evict returned %llu\n", (unsigned long long)got);
        atomic_fetch_add(&s_evicted_bytes, got);
        atomic_fetch_add(&s_evict_calls, 1);
        s_sleep_us(200 + (long)(s_rand(&seed) % 800));
    }
    return NULL;
}

static void *s_releaser(void *arg)
{
    uint64_t seed = (uint64_t)(uintptr_t)arg;
    unsigned k = 0;
    while (!atomic_load(&s_stop)) {
        /* rotate over every victim owner of every worker */
        int w = (int)(k % NWORKERS), v = (int)((k / NWORKERS) % NVICTIMS);
        k++;
        uint64_t n = kvt_l1_release_owner(s_l1, s_owner(w, v), s_rand(&seed) % 2 == 0);
        atomic_fetch_add(&s_owner_released, n);
        atomic_fetch_add(&s_release_calls, 1);
        s_sleep_us(100 + (long)(s_rand(&seed) % 400));
    }
    return NULL;
}

static void s_sample_counts(void)
{
    kvt_l1_counts_t c;
    kvt_l1_counts(s_l1, &c);
    if (c.used > c.capacity)
        ERR("counts: used %llu > capacity %llu\n", (unsigned long long)c.used,
            (unsigned long long)c.capacity);
}

static void test_concurrent(void **state)
{
    (void)state;
    kvt_log_set_level(KVT_LOG_ERROR);
    char err[KVT_ERR_LEN] = "";
    kvt_config_t *cfg = kvt_config_new();
    assert_int_equal(kvt_config_set(cfg, "l1_size", "16M", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "allow_unpinned", "true", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "l1.hugepages", "off", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "l1.adopt", "false", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "l1_checksum", "true", false, err, sizeof err), 0);
    s_l1 = kvt_l1_new(cfg, err, sizeof err);
    if (!s_l1)
        fail_msg("kvt_l1_new: %s", err);
    s_base = kvt_l1_base(s_l1);
    s_cap = kvt_l1_capacity(s_l1);
    for (uint32_t i = 0; i < NKEYS; i++) {
        memset(s_keys[i].b, 0x3C, KVT_KEY_LEN);
        memcpy(s_keys[i].b + 4, &i, sizeof i);
        uint64_t h = s_mix(i);
        memcpy(s_keys[i].b + 8, &h, 8);
    }

    static worker_t workers[NWORKERS];
    pthread_t wt[NWORKERS], et, rt;
    for (int i = 0; i < NWORKERS; i++) {
        workers[i] = (worker_t){.w = i, .seed = 0x1234567ull * (uint64_t)(i + 1)};
        assert_int_equal(pthread_create(&wt[i], NULL, s_worker, &workers[i]), 0);
    }
    assert_int_equal(pthread_create(&et, NULL, s_evictor, (void *)(uintptr_t)77), 0);
    assert_int_equal(pthread_create(&rt, NULL, s_releaser, (void *)(uintptr_t)99), 0);

    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        s_sleep_us(20000);
        s_sample_counts();
        clock_gettime(CLOCK_MONOTONIC, &now);
        long ms = (now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000;
        bool all_done = true;
        for (int i = 0; i < NWORKERS; i++)
            all_done &= atomic_load_explicit(&workers[i].ops, memory_order_relaxed) >= MAX_OPS;
        if (ms >= RUN_MS || all_done)
            break;
    }
    atomic_store(&s_stop, true);
    for (int i = 0; i < NWORKERS; i++)
        pthread_join(wt[i], NULL);
    pthread_join(et, NULL);
    pthread_join(rt, NULL);

    uint64_t total = 0;
    for (int i = 0; i < OP_N; i++)
        total += atomic_load(&s_ops[i]);
    fprintf(stderr,
            "test_l1_concurrent: %llu ops (store %llu, read %llu, lookup %llu, lock %llu, remove "
            "%llu, victim %llu/%llu), %llu MiB verified, %llu evict calls freed %llu MiB, %llu "
            "release_owner calls released %llu leases\n",
            (unsigned long long)total, (unsigned long long)s_ops[OP_STORE],
            (unsigned long long)s_ops[OP_READ], (unsigned long long)s_ops[OP_LOOKUP],
            (unsigned long long)s_ops[OP_LOCK], (unsigned long long)s_ops[OP_REMOVE],
            (unsigned long long)s_ops[OP_VICTIM_W], (unsigned long long)s_ops[OP_VICTIM_R],
            (unsigned long long)(s_verified_bytes >> 20), (unsigned long long)s_evict_calls,
            (unsigned long long)(s_evicted_bytes >> 20), (unsigned long long)s_release_calls,
            (unsigned long long)s_owner_released);

    /* every worker resolved its own leases; the victims' are resolved or released above */
    for (int w = 0; w < NWORKERS; w++)
        for (int v = -1; v < NVICTIMS; v++)
            assert_int_equal(kvt_l1_release_owner(s_l1, s_owner(w, v), false), 0);
    kvt_l1_counts_t c;
    kvt_l1_counts(s_l1, &c);
    assert_int_equal(c.leases_active, 0);
    assert_int_equal(c.reserved, 0);
    assert_true(c.used <= c.capacity);

    /* every READY object still holds its key's pattern */
    uint32_t checked = 0;
    for (uint32_t i = 0; i < NKEYS; i++) {
        kvt_slot_t slot;
        uint32_t n = 0;
        uint64_t lease = 0;
        assert_int_equal(
            kvt_l1_acquire(s_l1, 1, &s_ns, &s_keys[i], 1, &slot, &n, &lease), 0);
        if (n) {
            s_verify_slots(&slot, 1, &s_keys[i], "at the end");
            assert_int_equal(kvt_l1_release(s_l1, 1, lease), 0);
            checked++;
        }
    }
    uint64_t removed = 0;
    assert_int_equal(kvt_l1_clear(s_l1, NULL, 0, &removed), 0);
    assert_int_equal(removed, checked);
    kvt_l1_counts(s_l1, &c);
    assert_int_equal(c.used, 0);
    assert_int_equal(c.objects, 0);
    assert_int_equal(c.reserved, 0);
    assert_int_equal(c.leases_active, 0);

    assert_int_equal(atomic_load(&s_mismatches), 0);
    assert_int_equal(atomic_load(&s_errors), 0);
    assert_true(s_ops[OP_STORE] > 0 && s_ops[OP_READ] > 0);
    assert_true(s_verified_bytes > 0);
    assert_true(s_evicted_bytes > 0 || c.evictions > 0);

    kvt_l1_destroy(&s_l1);
    kvt_config_destroy(&cfg);
}

/* ---- one owner, 4 threads, max_leased_bytes, expiry in between ---- */

#define LIMIT_BYTES (256u * 1024u)
#define SHARED_OWNER 4242u

static _Atomic uint64_t s_limit_max_seen, s_limit_refusals, s_limit_ops;

static void s_limit_sample(void)
{
    uint64_t b = kvt_l1_owner_bytes(s_l1, SHARED_OWNER);
    uint64_t m = atomic_load(&s_limit_max_seen);
    while (b > m && !atomic_compare_exchange_weak(&s_limit_max_seen, &m, b))
        ;
}

static void *s_limit_worker(void *arg)
{
    uint64_t seed = (uint64_t)(uintptr_t)arg;
    kvt_key_t keys[4];
    kvt_slot_t slots[4];
    char err[KVT_ERR_LEN];
    while (!atomic_load(&s_stop)) {
        uint32_t n = 1 + (uint32_t)(s_rand(&seed) % 4), first = (uint32_t)(s_rand(&seed) % 64);
        for (uint32_t i = 0; i < n; i++)
            keys[i] = s_keys[first + i];
        uint32_t got = 0, stored = 0;
        uint64_t lease = 0;
        int rc;
        if (s_rand(&seed) % 2) {
            uint64_t size = 16384 * (1 + s_rand(&seed) % 3);
            rc = kvt_l1_reserve(s_l1, SHARED_OWNER, &s_ns, keys, n, NULL, size,
                                slots, &got, &lease, err, sizeof err);
        } else {
            rc = kvt_l1_acquire(s_l1, SHARED_OWNER, &s_ns, keys, n, slots, &got,
                                &lease);
        }
        s_limit_sample();
        atomic_fetch_add(&s_limit_ops, 1);
        if (rc == KVT_ENOSPC) {
            atomic_fetch_add(&s_limit_refusals, 1);
            continue;
        }
        if (rc) {
            ERR("limit: %s (%s)\n", kvt_err_name(rc), err);
            continue;
        }
        if (!lease)
            continue;
        /* commit a write lease with every index failed (no data), or release either kind */
        uint64_t failed[4] = {0, 1, 2, 3};
        rc = s_rand(&seed) % 2
                 ? kvt_l1_release(s_l1, SHARED_OWNER, lease)
                 : kvt_l1_commit(s_l1, SHARED_OWNER, lease, failed, 0, &stored, err, sizeof err);
        if (rc == KVT_EBADREQ) /* COMMIT of a read lease */
            rc = kvt_l1_release(s_l1, SHARED_OWNER, lease);
        if (rc && rc != KVT_ELEXPIRED)
            ERR("limit: settle: %s\n", kvt_err_name(rc));
    }
    return NULL;
}

static void *s_limit_expirer(void *arg)
{
    (void)arg;
    while (!atomic_load(&s_stop)) {
        s_sleep_us(3000);
        kvt_l1_release_owner(s_l1, SHARED_OWNER, true);
        s_limit_sample();
    }
    return NULL;
}

static void test_owner_limit_concurrent(void **state)
{
    (void)state;
    char err[KVT_ERR_LEN] = "";
    kvt_config_t *cfg = kvt_config_new();
    assert_int_equal(kvt_config_set(cfg, "l1_size", "16M", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "allow_unpinned", "true", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "l1.hugepages", "off", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "l1.adopt", "false", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "max_leased_bytes", "256k", false, err, sizeof err), 0);
    s_l1 = kvt_l1_new(cfg, err, sizeof err);
    assert_non_null(s_l1);
    atomic_store(&s_stop, false);
    atomic_store(&s_errors, 0);
    pthread_t wt[NWORKERS], et;
    for (uintptr_t i = 0; i < NWORKERS; i++)
        assert_int_equal(pthread_create(&wt[i], NULL, s_limit_worker, (void *)(i * 77 + 5)), 0);
    assert_int_equal(pthread_create(&et, NULL, s_limit_expirer, NULL), 0);
    for (int i = 0; i < 100; i++) /* 1 s */
        s_sleep_us(10000);
    atomic_store(&s_stop, true);
    for (int i = 0; i < NWORKERS; i++)
        pthread_join(wt[i], NULL);
    pthread_join(et, NULL);
    kvt_l1_release_owner(s_l1, SHARED_OWNER, false);
    fprintf(stderr, "test_owner_limit_concurrent: %llu ops, %llu refused, most held %llu\n",
            (unsigned long long)s_limit_ops, (unsigned long long)s_limit_refusals,
            (unsigned long long)s_limit_max_seen);
    assert_int_equal(atomic_load(&s_errors), 0);
    assert_true(atomic_load(&s_limit_max_seen) <= LIMIT_BYTES);
    assert_true(atomic_load(&s_limit_refusals) > 0);
    assert_int_equal(kvt_l1_owner_bytes(s_l1, SHARED_OWNER), 0);
    kvt_l1_counts_t c;
    kvt_l1_counts(s_l1, &c);
    assert_int_equal(c.leases_active, 0);
    assert_int_equal(c.reserved, 0);
    uint64_t removed = 0;
    kvt_l1_clear(s_l1, NULL, 0, &removed);
    kvt_l1_destroy(&s_l1);
    kvt_config_destroy(&cfg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_concurrent),
        cmocka_unit_test(test_owner_limit_concurrent),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
