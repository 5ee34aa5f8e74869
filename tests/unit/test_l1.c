/* Unit tests of storage/kvt_l1 through its API, on a 16 MiB arena in /dev/shm (allow_unpinned,
 * no eviction controller running, so every eviction here is one the test asked for or an
 * on-demand one inside RESERVE): the store and retrieve paths, nil slots for present keys,
 * invisibility until COMMIT, failed indices, the longest-prefix-that-fits partial batch and
 * KVT_ENOSPC, on-demand eviction, the prefix-aware LRU (for stores and for ACQUIRE), pins
 * against eviction, REMOVE of a pinned object, CLEAR, ns/salt isolation, owner release with and
 * without expiry, counters, and an index test with 100k objects; the bytes each owner holds
 * under leases (exact through RESERVE, COMMIT, ACQUIRE, RELEASE, expiry and BYE), the
 * max_leased_bytes prefix rule and its no_space, and l1_checksum (COMMIT, GET's verify, the
 * write-behind check, checksums brought by a prefetch). */
#include "kvt_config.h"
#include "kvt_error.h"
#include "kvt_l1.h"
#include "kvt_log.h"
#include "kvt_supervisor.h"

#include <fcntl.h>
#include <jansson.h>
#include <sys/mman.h>
#include <unistd.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include <cmocka.h>

#define KiB (1024ull)
#define MiB (1024ull * 1024ull)
#define MAXN 256


typedef struct {
    kvt_config_t *cfg;
    kvt_l1_t *l1;
    uint8_t *base;
    uint64_t cap;
} fx_t;

/* An L1 of `size` for these tests, with one more option (opt = value) unless opt is NULL. */
static kvt_l1_t *s_l1_new_with(const char *size, const char *opt, const char *value,
                               kvt_config_t **cfg_out)
{
    char err[KVT_ERR_LEN] = "";
    kvt_config_t *cfg = kvt_config_new();
    assert_non_null(cfg);
    assert_int_equal(kvt_config_set(cfg, "l1_size", size, false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "allow_unpinned", "true", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "l1.hugepages", "off", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "l1.adopt", "false", false, err, sizeof err), 0);
    if (opt)
        assert_int_equal(kvt_config_set(cfg, opt, value, false, err, sizeof err), 0);
    kvt_l1_t *l1 = kvt_l1_new(cfg, err, sizeof err);
    if (!l1)
        fail_msg("kvt_l1_new: %s", err);
    *cfg_out = cfg;
    return l1;
}

static kvt_l1_t *s_l1_new(const char *size, kvt_config_t **cfg_out)
{
    return s_l1_new_with(size, NULL, NULL, cfg_out);
}

static int s_setup(void **state)
{
    kvt_log_set_level(KVT_LOG_ERROR);
    fx_t *f = calloc(1, sizeof *f);
    f->l1 = s_l1_new("16M", &f->cfg);
    f->base = kvt_l1_base(f->l1);
    f->cap = kvt_l1_capacity(f->l1);
    *state = f;
    return 0;
}

static int s_teardown(void **state)
{
    fx_t *f = *state;
    kvt_l1_destroy(&f->l1);
    assert_null(f->l1);
    kvt_config_destroy(&f->cfg);
    free(f);
    return 0;
}

static kvt_ns_t s_ns(const char *ns, const char *salt)
{
    kvt_ns_t r = {(const uint8_t *)ns, (uint32_t)strlen(ns), (const uint8_t *)salt,
                     salt ? (uint32_t)strlen(salt) : 0};
    return r;
}

/* key (tag, id): 16 bytes, distinct for distinct (tag, id) */
static void s_key(kvt_key_t *key, uint8_t tag, uint32_t id)
{
    uint8_t *k = key->b;
    memset(k, 0xA5, KVT_KEY_LEN);
    k[0] = tag;
    memcpy(k + 1, &id, sizeof id);
    k[15] = (uint8_t)(id * 31u + tag);
}

static void s_keys(kvt_key_t *keys, uint8_t tag, uint32_t first, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        s_key(&keys[i], tag, first + i);
}

static uint64_t s_mix(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static uint64_t s_seed_of(const uint8_t *key)
{
    uint64_t a, b;
    memcpy(&a, key, 8);
    memcpy(&b, key + 8, 8);
    return s_mix(a ^ s_mix(b));
}

/* The pattern a writer puts in its slot: derived from the key, different at every word. */
static void s_fill(uint8_t *p, uint64_t len, const kvt_key_t *kp)
{
    const uint8_t *key = kp->b;
    uint64_t seed = s_seed_of(key);
    uint64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w = s_mix(seed + i);
        memcpy(p + i, &w, 8);
    }
    uint64_t w = s_mix(seed + i);
    memcpy(p + i, &w, len - i);
}

static bool s_verify(const uint8_t *p, uint64_t len, const kvt_key_t *kp)
{
    const uint8_t *key = kp->b;
    uint64_t seed = s_seed_of(key);
    uint64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w = s_mix(seed + i);
        if (memcmp(p + i, &w, 8) != 0)
            return false;
    }
    uint64_t w = s_mix(seed + i);
    return memcmp(p + i, &w, len - i) == 0;
}

static void s_check_slot(const fx_t *f, kvt_slot_t s, uint64_t size)
{
    assert_int_equal(s.length, size);
    assert_int_equal(s.offset % 4096, 0);
    assert_true(s.offset + s.length <= f->cap);
}

/* RESERVE n keys of `size`, fill the non-nil slots, COMMIT. Returns how many were stored. */
static uint32_t s_store(fx_t *f, uint64_t owner, const kvt_ns_t *ns, const kvt_key_t *keys,
                        uint32_t n, uint64_t size)
{
    kvt_slot_t slots[MAXN];
    uint32_t nslots = 0, stored = 0;
    uint64_t lease = 0;
    char err[KVT_ERR_LEN] = "";
    int rc = kvt_l1_reserve(f->l1, owner, ns, keys, n, NULL, size, slots, &nslots, &lease, err,
                            sizeof err);
    if (rc)
        fail_msg("reserve: %s (%s)", kvt_err_name(rc), err);
    assert_int_equal(nslots, n);
    uint32_t fresh = 0;
    for (uint32_t i = 0; i < nslots; i++) {
        if (!slots[i].length)
            continue;
        s_check_slot(f, slots[i], size);
        s_fill(f->base + slots[i].offset, slots[i].length, &keys[i]);
        fresh++;
    }
    if (!fresh) {
        assert_int_equal(lease, 0);
        return 0;
    }
    assert_true(lease != 0);
    rc = kvt_l1_commit(f->l1, owner, lease, NULL, 0, &stored, err, sizeof err);
    if (rc)
        fail_msg("commit: %s (%s)", kvt_err_name(rc), err);
    assert_int_equal(stored, fresh);
    return stored;
}

static uint32_t s_hits(fx_t *f, const kvt_ns_t *ns, const kvt_key_t *keys, uint32_t n)
{
    uint32_t hits = 99999;
    uint64_t lease = 1;
    assert_int_equal(kvt_l1_lookup(f->l1, 0, ns, keys, n, false, &hits, &lease), 0);
    assert_true(hits <= n);
    return hits;
}

static bool s_present(fx_t *f, const kvt_ns_t *ns, const kvt_key_t *key)
{
    return s_hits(f, ns, key, 1) == 1;
}

static kvt_l1_counts_t s_counts(fx_t *f)
{
    kvt_l1_counts_t c;
    memset(&c, 0xff, sizeof c);
    kvt_l1_counts(f->l1, &c);
    return c;
}

/* ---- store and retrieve ---------------------------------------------------------------- */

static void test_reserve_commit_acquire_release(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("model-a", "");
    kvt_key_t k[4];
    s_keys(k, 1, 0, 4);
    kvt_l1_counts_t c = s_counts(f);
    assert_int_equal(c.capacity, 16 * MiB);
    assert_int_equal(f->cap, 16 * MiB);
    assert_non_null(kvt_l1_shm_path(f->l1));
    assert_int_equal(strncmp(kvt_l1_shm_path(f->l1), "/dev/shm/", 9), 0);
    assert_int_equal(c.used, 0);
    assert_int_equal(c.objects, 0);
    assert_int_equal(c.leases_active, 0);

    kvt_slot_t slots[4];
    uint32_t nslots = 0;
    uint64_t wlease = 0;
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_l1_reserve(f->l1, 7, &ns, k, 4, NULL, 10000, slots,
                                    &nslots, &wlease, err, sizeof err),
                     0);
    assert_int_equal(nslots, 4);
    assert_true(wlease != 0);
    for (int i = 0; i < 4; i++) {
        s_check_slot(f, slots[i], 10000);
        for (int j = 0; j < i; j++) /* disjoint */
            assert_true(slots[i].offset >= slots[j].offset + 12288 ||
                        slots[j].offset >= slots[i].offset + 12288);
        s_fill(f->base + slots[i].offset, slots[i].length, &k[i]);
    }
    c = s_counts(f);
    assert_int_equal(c.reserved, 4);
    assert_int_equal(c.objects, 0);
    assert_int_equal(c.used, 4 * 12288);
    assert_int_equal(c.leases_active, 1);

    /* invisible until COMMIT */
    assert_int_equal(s_hits(f, &ns, k, 4), 0);
    kvt_slot_t rs[4];
    uint32_t rn = 99;
    uint64_t rlease = 99;
    assert_int_equal(kvt_l1_acquire(f->l1, 8, &ns, k, 4, rs, &rn, &rlease), 0);
    assert_int_equal(rn, 0);
    assert_int_equal(rlease, 0);
    uint32_t hits = 99;
    assert_int_equal(kvt_l1_lookup(f->l1, 8, &ns, k, 4, true, &hits, &rlease), 0);
    assert_int_equal(hits, 0);
    assert_int_equal(rlease, 0);
    /* being stored counts as present for RESERVE: nil slots, no lease */
    kvt_slot_t again[4];
    uint64_t lease2 = 99;
    assert_int_equal(kvt_l1_reserve(f->l1, 8, &ns, k, 4, NULL, 10000, again,
                                    &nslots, &lease2, err, sizeof err),
                     0);
    assert_int_equal(nslots, 4);
    for (int i = 0; i < 4; i++)
        assert_int_equal(again[i].length, 0);
    assert_int_equal(lease2, 0);

    /* COMMIT by another owner: unknown lease, and the lease stays the writer's */
    uint32_t stored = 99;
    assert_int_equal(kvt_l1_commit(f->l1, 8, wlease, NULL, 0, &stored, err, sizeof err),
                     KVT_EUNKLEASE);
    assert_int_equal(kvt_l1_commit(f->l1, 7, wlease + 1000, NULL, 0, &stored, err, sizeof err),
                     KVT_EUNKLEASE);
    assert_int_equal(kvt_l1_commit(f->l1, 7, wlease, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(stored, 4);
    /* a lease is acted on once */
    assert_int_equal(kvt_l1_commit(f->l1, 7, wlease, NULL, 0, &stored, err, sizeof err),
                     KVT_EUNKLEASE);
    assert_int_equal(kvt_l1_release(f->l1, 7, wlease), KVT_EUNKLEASE);
    c = s_counts(f);
    assert_int_equal(c.reserved, 0);
    assert_int_equal(c.objects, 4);
    assert_int_equal(c.used, 4 * 12288);
    assert_int_equal(c.leases_active, 0);

    /* visible: LOOKUP, ACQUIRE gives the same slots and the bytes written */
    assert_int_equal(s_hits(f, &ns, k, 4), 4);
    assert_int_equal(kvt_l1_acquire(f->l1, 8, &ns, k, 4, rs, &rn, &rlease), 0);
    assert_int_equal(rn, 4);
    assert_true(rlease != 0);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(rs[i].offset, slots[i].offset);
        assert_int_equal(rs[i].length, 10000);
        assert_true(s_verify(f->base + rs[i].offset, rs[i].length, &k[i]));
    }
    assert_int_equal(s_counts(f).leases_active, 1);
    /* a read lease is not committed; it stays */
    assert_int_equal(kvt_l1_commit(f->l1, 8, rlease, NULL, 0, &stored, err, sizeof err),
                     KVT_EBADREQ);
    assert_int_equal(kvt_l1_release(f->l1, 7, rlease), KVT_EUNKLEASE); /* not the owner */
    assert_int_equal(kvt_l1_release(f->l1, 8, rlease), 0);
    assert_int_equal(kvt_l1_release(f->l1, 8, rlease), KVT_EUNKLEASE);
    assert_int_equal(s_counts(f).leases_active, 0);

    /* RESERVE of stored keys: nil, no lease; a mixed batch gets slots for the new ones only */
    kvt_key_t mixed[3];
    mixed[0] = k[0];
    s_key(&mixed[1], 1, 100);
    mixed[2] = k[3];
    assert_int_equal(kvt_l1_reserve(f->l1, 7, &ns, mixed, 3, NULL, 5000, again,
                                    &nslots, &lease2, err, sizeof err),
                     0);
    assert_int_equal(nslots, 3);
    assert_int_equal(again[0].length, 0);
    s_check_slot(f, again[1], 5000);
    assert_int_equal(again[2].length, 0);
    assert_true(lease2 != 0);
    s_fill(f->base + again[1].offset, again[1].length, &mixed[1]);
    assert_int_equal(kvt_l1_commit(f->l1, 7, lease2, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(stored, 1);
    assert_int_equal(s_counts(f).objects, 5);

    /* leading keys only: a gap stops LOOKUP and ACQUIRE */
    kvt_key_t gap[4];
    gap[0] = k[0];
    gap[1] = k[1];
    s_key(&gap[2], 1, 999); /* absent */
    gap[3] = k[3];
    assert_int_equal(s_hits(f, &ns, gap, 4), 2);
    assert_int_equal(kvt_l1_acquire(f->l1, 8, &ns, gap, 4, rs, &rn, &rlease), 0);
    assert_int_equal(rn, 2);
    assert_int_equal(kvt_l1_release(f->l1, 8, rlease), 0);
    assert_int_equal(s_hits(f, &ns, &gap[2], 2), 0);
}

static void test_sizes_array(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    kvt_key_t k[4];
    s_keys(k, 2, 0, 4);
    uint64_t sizes[4] = {1, 4096, 4097, 300000};
    kvt_slot_t slots[4];
    uint32_t nslots = 0, stored = 0;
    uint64_t lease = 0;
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_l1_reserve(f->l1, 1, &ns, k, 4, sizes, 0, slots, &nslots,
                                    &lease, err, sizeof err),
                     0);
    assert_int_equal(nslots, 4);
    for (int i = 0; i < 4; i++) {
        s_check_slot(f, slots[i], sizes[i]);
        s_fill(f->base + slots[i].offset, slots[i].length, &k[i]);
    }
    assert_int_equal(s_counts(f).used, 4096 + 4096 + 8192 + 74 * 4096);
    assert_int_equal(kvt_l1_commit(f->l1, 1, lease, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(stored, 4);
    kvt_slot_t rs[4];
    uint32_t rn;
    uint64_t rl;
    assert_int_equal(kvt_l1_acquire(f->l1, 2, &ns, k, 4, rs, &rn, &rl), 0);
    assert_int_equal(rn, 4);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(rs[i].length, sizes[i]);
        assert_true(s_verify(f->base + rs[i].offset, rs[i].length, &k[i]));
    }
    assert_int_equal(kvt_l1_release(f->l1, 2, rl), 0);
}

static void test_commit_failed_indices(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    kvt_key_t k[4];
    s_keys(k, 3, 0, 4);
    kvt_slot_t slots[4];
    uint32_t nslots = 0, stored = 99;
    uint64_t lease = 0;
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_l1_reserve(f->l1, 1, &ns, k, 4, NULL, 8192, slots,
                                    &nslots, &lease, err, sizeof err),
                     0);
    for (int i = 0; i < 4; i++)
        s_fill(f->base + slots[i].offset, slots[i].length, &k[i]);
    /* an index out of range: bad request, and the lease is not lost */
    uint64_t bad[1] = {4};
    err[0] = '\0';
    assert_int_equal(kvt_l1_commit(f->l1, 1, lease, bad, 1, &stored, err, sizeof err), KVT_EBADREQ);
    assert_true(strlen(err) > 0);
    assert_int_equal(s_counts(f).reserved, 4);
    uint64_t failed[2] = {1, 3};
    assert_int_equal(kvt_l1_commit(f->l1, 1, lease, failed, 2, &stored, err, sizeof err), 0);
    assert_int_equal(stored, 2);
    assert_true(s_present(f, &ns, &k[0]));
    assert_false(s_present(f, &ns, &k[1]));
    assert_true(s_present(f, &ns, &k[2]));
    assert_false(s_present(f, &ns, &k[3]));
    kvt_l1_counts_t c = s_counts(f);
    assert_int_equal(c.objects, 2);
    assert_int_equal(c.reserved, 0);
    assert_int_equal(c.used, 2 * 8192); /* the failed ones' space is back */
    /* a discarded key can be stored again */
    assert_int_equal(s_store(f, 1, &ns, &k[1], 1, 8192), 1);

    /* RELEASE of a write lease discards everything */
    kvt_key_t d[2];
    s_keys(d, 3, 10, 2);
    assert_int_equal(kvt_l1_reserve(f->l1, 1, &ns, d, 2, NULL, 8192, slots,
                                    &nslots, &lease, err, sizeof err),
                     0);
    assert_int_equal(kvt_l1_release(f->l1, 1, lease), 0);
    assert_int_equal(s_counts(f).reserved, 0);
    assert_int_equal(s_counts(f).used, 3 * 8192);
    assert_int_equal(s_hits(f, &ns, d, 2), 0);
    assert_int_equal(s_store(f, 1, &ns, d, 2, 8192), 2);
    /* all failed: stored 0 */
    kvt_key_t e[2];
    s_keys(e, 3, 20, 2);
    assert_int_equal(kvt_l1_reserve(f->l1, 1, &ns, e, 2, NULL, 8192, slots,
                                    &nslots, &lease, err, sizeof err),
                     0);
    uint64_t both[2] = {0, 1};
    assert_int_equal(kvt_l1_commit(f->l1, 1, lease, both, 2, &stored, err, sizeof err), 0);
    assert_int_equal(stored, 0);
    assert_int_equal(s_hits(f, &ns, e, 2), 0);
    assert_int_equal(s_counts(f).used, 5 * 8192);
}

/* ---- space: partial batches, ENOSPC, on-demand eviction -------------------------------- */

static void test_partial_batch_and_enospc(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    uint32_t total = (uint32_t)(f->cap / MiB); /* 16 */
    uint32_t pinned = total - 4;
    kvt_key_t p[MAXN];
    s_keys(p, 4, 0, pinned);
    assert_int_equal(s_store(f, 1, &ns, p, pinned, MiB), pinned);
    /* pin every READY object: nothing can be evicted */
    kvt_slot_t rs[MAXN];
    uint32_t rn = 0;
    uint64_t rlease = 0;
    assert_int_equal(kvt_l1_acquire(f->l1, 2, &ns, p, pinned, rs, &rn, &rlease),
                     0);
    assert_int_equal(rn, pinned);

    /* 8 keys, room for 4: the first 4 */
    kvt_key_t q[8];
    s_keys(q, 5, 0, 8);
    kvt_slot_t slots[8];
    uint32_t nslots = 0, stored = 0;
    uint64_t lease = 0;
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_l1_reserve(f->l1, 3, &ns, q, 8, NULL, MiB, slots, &nslots,
                                    &lease, err, sizeof err),
                     0);
    assert_int_equal(nslots, 4);
    assert_true(lease != 0);
    for (uint32_t i = 0; i < nslots; i++) {
        s_check_slot(f, slots[i], MiB);
        s_fill(f->base + slots[i].offset, slots[i].length, &q[i]);
    }
    kvt_l1_counts_t c = s_counts(f);
    assert_int_equal(c.used, f->cap);
    assert_int_equal(c.reserved, 4);
    assert_int_equal(c.evictions, 0);

    /* not even the first fits: ENOSPC, nothing held */
    kvt_key_t z[2];
    s_keys(z, 6, 0, 2);
    uint64_t zl = 0;
    err[0] = '\0';
    assert_int_equal(kvt_l1_reserve(f->l1, 3, &ns, z, 2, NULL, 4096, slots + 4,
                                    &nslots, &zl, err, sizeof err),
                     KVT_ENOSPC);
    assert_true(strlen(err) > 0);
    kvt_l1_counts_t c2 = s_counts(f);
    assert_int_equal(c2.reserved, 4);
    assert_int_equal(c2.leases_active, 2);
    assert_int_equal(c2.used, f->cap);
    /* bigger than the whole arena: ENOSPC as well */
    assert_int_equal(kvt_l1_reserve(f->l1, 3, &ns, z, 1, NULL, f->cap + 1,
                                    slots + 4, &nslots, &zl, err, sizeof err),
                     KVT_ENOSPC);

    assert_int_equal(kvt_l1_commit(f->l1, 3, lease, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(stored, 4);
    assert_int_equal(s_hits(f, &ns, q, 8), 4); /* q4..q7 never reserved */
    /* the pins held through all of it: the pinned data is intact */
    for (uint32_t i = 0; i < pinned; i++)
        assert_true(s_verify(f->base + rs[i].offset, rs[i].length, &p[i]));
    assert_int_equal(s_counts(f).evictions, 0);
    assert_int_equal(kvt_l1_release(f->l1, 2, rlease), 0);
}

static void test_partial_batch_is_a_prefix(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    /* hold 12 MiB under a write lease (RESERVED objects are never evicted) */
    kvt_key_t h[12];
    s_keys(h, 7, 0, 12);
    kvt_slot_t hs[12];
    uint32_t n = 0, stored = 0;
    uint64_t hl = 0;
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_l1_reserve(f->l1, 1, &ns, h, 12, NULL, MiB, hs, &n, &hl,
                                    err, sizeof err),
                     0);
    assert_int_equal(n, 12);
    /* 4 MiB left: 1 + 1 fit, 3 does not, and the 4 KiB after it is not taken either */
    kvt_key_t k[4];
    s_keys(k, 8, 0, 4);
    uint64_t sizes[4] = {MiB, MiB, 3 * MiB, 4096};
    kvt_slot_t slots[4];
    uint64_t lease = 0;
    assert_int_equal(kvt_l1_reserve(f->l1, 2, &ns, k, 4, sizes, 0, slots, &n,
                                    &lease, err, sizeof err),
                     0);
    assert_int_equal(n, 2);
    assert_int_equal(s_counts(f).reserved, 14);
    assert_int_equal(s_counts(f).used, 14 * MiB);
    assert_int_equal(kvt_l1_commit(f->l1, 2, lease, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(stored, 2);
    /* k3 was not reserved: it can be now (evicting nothing: there is room) */
    assert_false(s_present(f, &ns, &k[3]));
    assert_int_equal(s_store(f, 2, &ns, &k[3], 1, 4096), 1);
    assert_int_equal(s_counts(f).evictions, 0);
    assert_int_equal(kvt_l1_release(f->l1, 1, hl), 0);
    assert_int_equal(s_counts(f).used, 2 * MiB + 4096);
}

static void test_on_demand_eviction(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    uint32_t total = (uint32_t)(f->cap / MiB);
    kvt_key_t o[MAXN];
    s_keys(o, 9, 0, total);
    for (uint32_t i = 0; i < total; i++) /* one batch each: o0 is the oldest */
        assert_int_equal(s_store(f, 1, &ns, &o[i], 1, MiB), 1);
    kvt_l1_counts_t c = s_counts(f);
    assert_int_equal(c.used, f->cap);
    assert_int_equal(c.objects, total);
    assert_int_equal(c.evictions, 0);

    /* full: RESERVE evicts from the LRU tail to make room */
    kvt_key_t nk[4];
    s_keys(nk, 10, 0, 4);
    assert_int_equal(s_store(f, 1, &ns, nk, 4, MiB), 4);
    c = s_counts(f);
    assert_true(c.evictions >= 4);
    assert_true(c.used <= f->cap);
    for (uint32_t i = 0; i < 4; i++)
        assert_false(s_present(f, &ns, &o[i]));
    /* evicted oldest first: whatever is left of o is a suffix o[j..total) */
    uint32_t first_left = total;
    for (uint32_t i = total; i-- > 0;)
        if (s_present(f, &ns, &o[i]))
            first_left = i;
        else
            break;
    assert_true(first_left < total); /* the newest survived */
    for (uint32_t i = 0; i < first_left; i++)
        assert_false(s_present(f, &ns, &o[i]));
    assert_int_equal(c.objects, 4 + (total - first_left));
    assert_int_equal(c.evictions, first_left);
    assert_int_equal(s_hits(f, &ns, nk, 4), 4);
    /* the survivors and the new ones hold their own bytes */
    kvt_slot_t rs[4];
    uint32_t rn;
    uint64_t rl;
    assert_int_equal(kvt_l1_acquire(f->l1, 1, &ns, nk, 4, rs, &rn, &rl), 0);
    for (int i = 0; i < 4; i++)
        assert_true(s_verify(f->base + rs[i].offset, rs[i].length, &nk[i]));
    assert_int_equal(kvt_l1_release(f->l1, 1, rl), 0);
    assert_int_equal(kvt_l1_acquire(f->l1, 1, &ns, &o[total - 1], 1, rs, &rn, &rl),
                     0);
    assert_int_equal(rn, 1);
    assert_true(s_verify(f->base + rs[0].offset, rs[0].length, &o[total - 1]));
    assert_int_equal(kvt_l1_release(f->l1, 1, rl), 0);
}

/* Pins on every other 64 KiB object: eviction can free half the arena, but never two adjacent
 * pages' worth of 64 KiB blocks, so a 128 KiB object cannot fit (ENOSPC) and a 64 KiB one can. */
static void test_on_demand_eviction_fragmented(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    uint32_t total = (uint32_t)(f->cap / (64 * KiB)); /* 256 */
    kvt_key_t *o = calloc(total, sizeof *o);
    s_keys(o, 32, 0, total);
    for (uint32_t i = 0; i < total; i++)
        assert_int_equal(s_store(f, 1, &ns, &o[i], 1, 64 * KiB), 1);
    assert_int_equal(s_counts(f).used, f->cap);
    /* pin every object whose slot starts at an even multiple of 64 KiB */
    uint64_t *pins = calloc(total, sizeof *pins);
    kvt_slot_t *ps = calloc(total, sizeof *ps);
    uint32_t npins = 0;
    for (uint32_t i = 0; i < total; i++) {
        kvt_slot_t s;
        uint32_t n;
        uint64_t l;
        assert_int_equal(kvt_l1_acquire(f->l1, 2, &ns, &o[i], 1, &s, &n, &l), 0);
        assert_int_equal(n, 1);
        if ((s.offset / (64 * KiB)) % 2 == 0) {
            ps[npins] = s;
            o[npins] = o[i]; /* o[0..npins) = the pinned keys (npins <= i) */
            pins[npins++] = l;
        } else {
            assert_int_equal(kvt_l1_release(f->l1, 2, l), 0);
        }
    }
    assert_int_equal(npins, total / 2);
    kvt_key_t big[1];
    s_keys(big, 33, 0, 1);
    kvt_slot_t slot;
    uint32_t n;
    uint64_t lease = 0;
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_l1_reserve(f->l1, 3, &ns, big, 1, NULL, 128 * KiB, &slot,
                                    &n, &lease, err, sizeof err),
                     KVT_ENOSPC);
    assert_int_equal(s_store(f, 3, &ns, big, 1, 64 * KiB), 1);
    assert_true(s_counts(f).evictions >= 1);
    for (uint32_t i = 0; i < npins; i++) {
        assert_true(s_present(f, &ns, &o[i]));
        assert_true(s_verify(f->base + ps[i].offset, ps[i].length, &o[i]));
        assert_int_equal(kvt_l1_release(f->l1, 2, pins[i]), 0);
    }
    free(o);
    free(pins);
    free(ps);
}

/* The free space is one hole of exactly 101 pages (not a size-class boundary of the
 * allocator): an object of 101 pages fits there, with no eviction ... */
static void test_exact_fit_no_needless_eviction(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    uint64_t pages = f->cap / 4096, hole = 101;
    kvt_key_t k[2];
    s_keys(k, 34, 0, 2);
    assert_int_equal(s_store(f, 1, &ns, k, 1, (pages - hole) * 4096), 1);
    assert_int_equal(s_store(f, 1, &ns, &k[1], 1, hole * 4096), 1);
    kvt_l1_counts_t c = s_counts(f);
    if (c.evictions != 0)
        fail_msg("storing %llu pages into a free hole of %llu pages evicted %llu object(s) "
                 "(%llu pages)",
                 (unsigned long long)hole, (unsigned long long)hole,
                 (unsigned long long)c.evictions, (unsigned long long)(pages - hole));
    assert_int_equal(c.objects, 2);
    assert_int_equal(c.used, f->cap);
}

/* ... and, with everything else pinned, no ENOSPC. */
static void test_exact_fit_pinned_no_enospc(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    uint64_t pages = f->cap / 4096, hole = 101;
    kvt_key_t k[2];
    s_keys(k, 35, 0, 2);
    assert_int_equal(s_store(f, 1, &ns, k, 1, (pages - hole) * 4096), 1);
    kvt_slot_t s, slot;
    uint32_t n;
    uint64_t rl, wl = 0;
    assert_int_equal(kvt_l1_acquire(f->l1, 2, &ns, k, 1, &s, &n, &rl), 0);
    assert_int_equal(n, 1);
    assert_int_equal(s_counts(f).used, (pages - hole) * 4096);
    char err[KVT_ERR_LEN] = "";
    int rc = kvt_l1_reserve(f->l1, 1, &ns, &k[1], 1, NULL, hole * 4096, &slot, &n,
                            &wl, err, sizeof err);
    if (rc)
        fail_msg("reserve of %llu pages with exactly %llu pages free: %s (%s)",
                 (unsigned long long)hole, (unsigned long long)hole, kvt_err_name(rc), err);
    assert_int_equal(kvt_l1_release(f->l1, 1, wl), 0);
    assert_int_equal(kvt_l1_release(f->l1, 2, rl), 0);
}

/* ---- LRU ------------------------------------------------------------------------------- */

/* Evicts one 64 KiB object and checks it was `expect`. */
static void s_evict_one(fx_t *f, const kvt_ns_t *ns, const kvt_key_t *expect, const char *name)
{
    kvt_l1_counts_t before = s_counts(f);
    uint64_t freed = kvt_l1_evict(f->l1, 64 * KiB);
    kvt_l1_counts_t after = s_counts(f);
    assert_int_equal(freed, 64 * KiB);
    assert_int_equal(after.evictions, before.evictions + 1);
    assert_int_equal(after.objects, before.objects - 1);
    assert_int_equal(after.used, before.used - 64 * KiB);
    if (s_present(f, ns, expect))
        fail_msg("eviction took another object than %s", name);
}

static void test_lru_prefix_aware_store(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    kvt_key_t k[8];
    s_keys(k, 11, 0, 8);
    assert_int_equal(s_store(f, 1, &ns, k, 8, 64 * KiB), 8);
    /* the tail of the prefix goes first: k7, k6, ..., k0 */
    for (int i = 7; i >= 0; i--) {
        char name[16];
        snprintf(name, sizeof name, "k%d", i);
        s_evict_one(f, &ns, &k[i], name);
    }
    assert_int_equal(s_counts(f).objects, 0);
    assert_int_equal(s_counts(f).used, 0);
    assert_int_equal(kvt_l1_evict(f->l1, 64 * KiB), 0); /* nothing left */
}

static void test_lru_acquire_touches(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    kvt_key_t a[8], b[8];
    s_keys(a, 12, 0, 8);
    s_keys(b, 13, 0, 8);
    assert_int_equal(s_store(f, 1, &ns, a, 8, 64 * KiB), 8);
    assert_int_equal(s_store(f, 1, &ns, b, 8, 64 * KiB), 8);
    /* a is older; ACQUIRE of a's prefix makes it the most recent, a7 older than a0 */
    kvt_slot_t rs[8];
    uint32_t rn;
    uint64_t rl;
    assert_int_equal(kvt_l1_acquire(f->l1, 2, &ns, a, 8, rs, &rn, &rl), 0);
    assert_int_equal(rn, 8);
    assert_int_equal(kvt_l1_release(f->l1, 2, rl), 0);
    char name[16];
    for (int i = 7; i >= 0; i--) {
        snprintf(name, sizeof name, "b%d", i);
        s_evict_one(f, &ns, &b[i], name);
    }
    for (int i = 7; i >= 0; i--) {
        snprintf(name, sizeof name, "a%d", i);
        s_evict_one(f, &ns, &a[i], name);
    }
}

static void test_lru_partial_acquire_touches(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    kvt_key_t a[4], b[4];
    s_keys(a, 14, 0, 4);
    s_keys(b, 15, 0, 4);
    assert_int_equal(s_store(f, 1, &ns, a, 4, 64 * KiB), 4);
    assert_int_equal(s_store(f, 1, &ns, b, 4, 64 * KiB), 4);
    /* ACQUIRE a0 a1 (+ an absent key): only the two leading keys move up */
    kvt_key_t q[3];
    q[0] = a[0];
    q[1] = a[1];
    s_key(&q[2], 14, 777);
    kvt_slot_t rs[3];
    uint32_t rn;
    uint64_t rl;
    assert_int_equal(kvt_l1_acquire(f->l1, 2, &ns, q, 3, rs, &rn, &rl), 0);
    assert_int_equal(rn, 2);
    assert_int_equal(kvt_l1_release(f->l1, 2, rl), 0);
    /* order now (oldest first): a3 a2 b3 b2 b1 b0 a1 a0 */
    const kvt_key_t *order[8] = {&a[3], &a[2], &b[3], &b[2], &b[1], &b[0], &a[1], &a[0]};
    const char *names[8] = {"a3", "a2", "b3", "b2", "b1", "b0", "a1", "a0"};
    for (int i = 0; i < 8; i++)
        s_evict_one(f, &ns, order[i], names[i]);
}

/* ---- pins ------------------------------------------------------------------------------ */

static void test_pinned_never_evicted(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    kvt_key_t p[8], u[4];
    s_keys(p, 16, 0, 8);
    s_keys(u, 17, 0, 4);
    assert_int_equal(s_store(f, 1, &ns, p, 8, 64 * KiB), 8);
    kvt_slot_t rs[8];
    uint32_t rn;
    uint64_t rl;
    assert_int_equal(kvt_l1_acquire(f->l1, 2, &ns, p, 8, rs, &rn, &rl), 0);
    assert_int_equal(rn, 8);
    /* everything pinned: evict frees nothing, less than asked */
    assert_int_equal(kvt_l1_evict(f->l1, f->cap), 0);
    assert_int_equal(kvt_l1_evict(f->l1, 4096), 0);
    assert_int_equal(s_counts(f).objects, 8);
    assert_int_equal(s_counts(f).evictions, 0);
    /* unpinned ones (newer than the pinned ones) go, the pinned ones stay */
    assert_int_equal(s_store(f, 1, &ns, u, 4, 64 * KiB), 4);
    assert_int_equal(kvt_l1_evict(f->l1, f->cap), 4 * 64 * KiB);
    assert_int_equal(s_hits(f, &ns, u, 4), 0);
    assert_int_equal(s_hits(f, &ns, p, 8), 8);
    for (int i = 0; i < 8; i++)
        assert_true(s_verify(f->base + rs[i].offset, rs[i].length, &p[i]));
    /* two pins on the same objects: both must go before eviction can take them */
    uint32_t hits = 0;
    uint64_t ll = 0;
    assert_int_equal(kvt_l1_lookup(f->l1, 3, &ns, p, 8, true, &hits, &ll), 0);
    assert_int_equal(hits, 8);
    assert_true(ll != 0 && ll != rl);
    assert_int_equal(kvt_l1_release(f->l1, 2, rl), 0);
    assert_int_equal(kvt_l1_evict(f->l1, f->cap), 0); /* still pinned by the LOOKUP lock */
    assert_int_equal(s_hits(f, &ns, p, 8), 8);
    assert_int_equal(kvt_l1_release(f->l1, 3, ll), 0);
    assert_int_equal(kvt_l1_evict(f->l1, f->cap), 8 * 64 * KiB);
    assert_int_equal(s_counts(f).used, 0);
    assert_int_equal(s_counts(f).objects, 0);
}

static void test_reserved_never_evicted(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    kvt_key_t k[2];
    s_keys(k, 18, 0, 2);
    kvt_slot_t slots[2];
    uint32_t n, stored;
    uint64_t lease;
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_l1_reserve(f->l1, 1, &ns, k, 2, NULL, MiB, slots, &n,
                                    &lease, err, sizeof err),
                     0);
    for (int i = 0; i < 2; i++)
        s_fill(f->base + slots[i].offset, slots[i].length, &k[i]);
    assert_int_equal(kvt_l1_evict(f->l1, f->cap), 0);
    assert_int_equal(kvt_l1_commit(f->l1, 1, lease, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(stored, 2);
    assert_int_equal(kvt_l1_evict(f->l1, 1), MiB); /* at least 1 byte: one object */
}

static void test_remove_pinned(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    kvt_key_t k[4];
    s_keys(k, 19, 0, 4);
    assert_int_equal(s_store(f, 1, &ns, k, 4, MiB), 4);
    kvt_slot_t rs[2];
    uint32_t rn, removed = 99;
    uint64_t rl;
    assert_int_equal(kvt_l1_acquire(f->l1, 2, &ns, k, 2, rs, &rn, &rl), 0);
    assert_int_equal(rn, 2);
    assert_int_equal(kvt_l1_remove(f->l1, &ns, k, 4, &removed), 0);
    assert_int_equal(removed, 4);
    /* gone from the index at once, the pinned ones keep their space until RELEASE */
    assert_int_equal(s_hits(f, &ns, k, 1), 0);
    assert_false(s_present(f, &ns, &k[1]));
    assert_false(s_present(f, &ns, &k[3]));
    assert_int_equal(s_counts(f).used, 2 * MiB);
    /* fill every free byte with new objects: none may land on the pinned slots */
    kvt_key_t n[MAXN];
    uint32_t nn = (uint32_t)(f->cap / MiB) - 2;
    s_keys(n, 20, 0, nn);
    assert_int_equal(s_store(f, 3, &ns, n, nn, MiB), nn);
    assert_int_equal(s_counts(f).used, f->cap);
    for (int i = 0; i < 2; i++)
        assert_true(s_verify(f->base + rs[i].offset, rs[i].length, &k[i]));
    /* a new object of a removed key may be stored while the old one is still pinned */
    assert_int_equal(kvt_l1_evict(f->l1, MiB), MiB);
    assert_int_equal(s_store(f, 3, &ns, &k[0], 1, MiB), 1);
    assert_true(s_verify(f->base + rs[0].offset, rs[0].length, &k[0]));
    /* the last pin goes: the space comes back */
    uint64_t used = s_counts(f).used;
    assert_int_equal(kvt_l1_release(f->l1, 2, rl), 0);
    assert_int_equal(s_counts(f).used, used - 2 * MiB);
    assert_true(s_present(f, &ns, &k[0])); /* the new object, not the old one */

    /* REMOVE leaves absent and RESERVED keys alone */
    kvt_key_t r[1];
    s_keys(r, 21, 0, 1);
    kvt_slot_t slot;
    uint32_t ns1, stored;
    uint64_t wl;
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_l1_reserve(f->l1, 1, &ns, r, 1, NULL, 4096, &slot, &ns1,
                                    &wl, err, sizeof err),
                     0);
    s_fill(f->base + slot.offset, slot.length, &r[0]);
    kvt_key_t absent[1];
    s_keys(absent, 21, 5, 1);
    assert_int_equal(kvt_l1_remove(f->l1, &ns, absent, 1, &removed), 0);
    assert_int_equal(removed, 0);
    assert_int_equal(kvt_l1_remove(f->l1, &ns, r, 1, &removed), 0);
    assert_int_equal(removed, 0);
    assert_int_equal(kvt_l1_commit(f->l1, 1, wl, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(stored, 1);
    assert_true(s_present(f, &ns, &r[0]));
}

/* ---- namespaces, CLEAR ------------------------------------------------------------------ */

static void test_ns_salt_isolation(void **state)
{
    fx_t *f = *state;
    kvt_ns_t a = s_ns("a", ""), as = s_ns("a", "x"), b = s_ns("b", "");
    kvt_ns_t ab = s_ns("ab", ""), a_b = s_ns("a", "b");
    static const uint8_t zero = 0;
    kvt_ns_t a0 = {(const uint8_t *)"a", 1, &zero, 1}; /* salt "\0" is not "" */
    kvt_key_t k[1];
    s_keys(k, 22, 0, 1);
    assert_int_equal(s_store(f, 1, &a, k, 1, 4096), 1);
    assert_false(s_present(f, &as, &k[0]));
    assert_false(s_present(f, &b, &k[0]));
    assert_false(s_present(f, &a0, &k[0]));
    /* the same key elsewhere is another object */
    assert_int_equal(s_store(f, 1, &as, k, 1, 8192), 1);
    assert_int_equal(s_store(f, 1, &b, k, 1, 4096), 1);
    assert_int_equal(s_store(f, 1, &a0, k, 1, 4096), 1);
    /* "ab"+"" and "a"+"b" must not collide */
    assert_int_equal(s_store(f, 1, &ab, k, 1, 4096), 1);
    assert_false(s_present(f, &a_b, &k[0]));
    assert_int_equal(s_store(f, 1, &a_b, k, 1, 4096), 1);
    assert_int_equal(s_counts(f).objects, 6);
    kvt_slot_t s1, s2;
    uint32_t n;
    uint64_t l1, l2;
    assert_int_equal(kvt_l1_acquire(f->l1, 2, &a, k, 1, &s1, &n, &l1), 0);
    assert_int_equal(kvt_l1_acquire(f->l1, 2, &as, k, 1, &s2, &n, &l2), 0);
    assert_true(s1.offset != s2.offset);
    assert_int_equal(s1.length, 4096);
    assert_int_equal(s2.length, 8192);
    kvt_l1_release(f->l1, 2, l1);
    kvt_l1_release(f->l1, 2, l2);
    uint32_t removed;
    assert_int_equal(kvt_l1_remove(f->l1, &as, k, 1, &removed), 0);
    assert_int_equal(removed, 1);
    assert_true(s_present(f, &a, &k[0]));
    assert_true(s_present(f, &a_b, &k[0]));
    assert_int_equal(s_counts(f).objects, 5);
}

static void test_clear(void **state)
{
    fx_t *f = *state;
    kvt_ns_t a = s_ns("a", ""), as = s_ns("a", "s1"), b = s_ns("b", ""), ab = s_ns("ab", "");
    kvt_key_t k[3];
    s_keys(k, 23, 0, 3);
    assert_int_equal(s_store(f, 1, &a, k, 3, 4096), 3);
    assert_int_equal(s_store(f, 1, &as, k, 3, 4096), 3);
    assert_int_equal(s_store(f, 1, &b, k, 3, 4096), 3);
    assert_int_equal(s_store(f, 1, &ab, k, 3, 4096), 3);
    /* a reservation in "a" survives CLEAR */
    kvt_key_t r[1];
    s_keys(r, 24, 0, 1);
    kvt_slot_t slot;
    uint32_t n, stored;
    uint64_t wl, removed = 99;
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_l1_reserve(f->l1, 1, &a, r, 1, NULL, 4096, &slot, &n, &wl,
                                    err, sizeof err),
                     0);
    s_fill(f->base + slot.offset, slot.length, &r[0]);

    assert_int_equal(kvt_l1_clear(f->l1, (const uint8_t *)"a", 1, &removed), 0);
    assert_int_equal(removed, 6); /* both salts of "a", not "ab" */
    assert_int_equal(s_hits(f, &a, k, 3), 0);
    assert_int_equal(s_hits(f, &as, k, 3), 0);
    assert_int_equal(s_hits(f, &b, k, 3), 3);
    assert_int_equal(s_hits(f, &ab, k, 3), 3);
    assert_int_equal(kvt_l1_clear(f->l1, (const uint8_t *)"zzz", 3, &removed), 0);
    assert_int_equal(removed, 0);
    assert_int_equal(kvt_l1_commit(f->l1, 1, wl, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(stored, 1);
    assert_true(s_present(f, &a, &r[0]));
    assert_int_equal(s_counts(f).objects, 7);

    assert_int_equal(kvt_l1_clear(f->l1, NULL, 0, &removed), 0);
    assert_int_equal(removed, 7);
    kvt_l1_counts_t c = s_counts(f);
    assert_int_equal(c.objects, 0);
    assert_int_equal(c.used, 0);
    assert_int_equal(kvt_l1_clear(f->l1, NULL, 0, &removed), 0);
    assert_int_equal(removed, 0);
    /* cleared keys can be stored again */
    assert_int_equal(s_store(f, 1, &a, k, 3, 4096), 3);
}

/* ---- owners ----------------------------------------------------------------------------- */

static void test_release_owner_expired(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    kvt_key_t s[4], w[3];
    s_keys(s, 25, 0, 4);
    s_keys(w, 26, 0, 3);
    assert_int_equal(s_store(f, 1, &ns, s, 4, MiB), 4);
    /* owner 7: a read lease on s0..s3 and a write lease on w0..w2 */
    kvt_slot_t rs[4], ws[3];
    uint32_t n, stored;
    uint64_t rl, wl, rl2;
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_l1_acquire(f->l1, 7, &ns, s, 4, rs, &n, &rl), 0);
    assert_int_equal(kvt_l1_reserve(f->l1, 7, &ns, w, 3, NULL, MiB, ws, &n, &wl,
                                    err, sizeof err),
                     0);
    assert_int_equal(n, 3);
    /* owner 8 holds a pin too, which survives owner 7's expiry */
    assert_int_equal(kvt_l1_acquire(f->l1, 8, &ns, s, 1, rs, &n, &rl2), 0);
    kvt_l1_counts_t c = s_counts(f);
    assert_int_equal(c.leases_active, 3);
    assert_int_equal(c.reserved, 3);
    assert_int_equal(c.used, 7 * MiB);

    assert_int_equal(kvt_l1_release_owner(f->l1, 7, true), 2);
    c = s_counts(f);
    assert_int_equal(c.leases_active, 1);
    assert_int_equal(c.leases_expired, 2);
    assert_int_equal(c.reserved, 0);
    assert_int_equal(c.used, 4 * MiB); /* the reservations are discarded */
    assert_int_equal(s_hits(f, &ns, w, 3), 0);
    /* a late COMMIT / RELEASE: lease_expired */
    err[0] = '\0';
    assert_int_equal(kvt_l1_commit(f->l1, 7, wl, NULL, 0, &stored, err, sizeof err), KVT_ELEXPIRED);
    assert_true(strlen(err) > 0);
    assert_int_equal(kvt_l1_release(f->l1, 7, rl), KVT_ELEXPIRED);
    assert_int_equal(kvt_l1_release(f->l1, 7, wl), KVT_ELEXPIRED);
    assert_int_equal(kvt_l1_release_owner(f->l1, 7, true), 0);
    /* the read pins are gone: s1..s3 are evictable, s0 is still pinned by owner 8 */
    assert_int_equal(kvt_l1_evict(f->l1, f->cap), 3 * MiB);
    assert_true(s_present(f, &ns, &s[0]));
    /* the discarded keys can be reserved again by someone else */
    assert_int_equal(s_store(f, 9, &ns, w, 3, MiB), 3);
    assert_int_equal(kvt_l1_release(f->l1, 8, rl2), 0);
    assert_int_equal(s_counts(f).leases_active, 0);
    assert_int_equal(s_counts(f).leases_expired, 2);
}

static void test_release_owner_bye(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "");
    kvt_key_t s[2], w[2];
    s_keys(s, 27, 0, 2);
    s_keys(w, 28, 0, 2);
    assert_int_equal(s_store(f, 1, &ns, s, 2, MiB), 2);
    kvt_slot_t slots[2];
    uint32_t n, stored, hits;
    uint64_t rl, wl, ll;
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_l1_acquire(f->l1, 7, &ns, s, 2, slots, &n, &rl), 0);
    assert_int_equal(kvt_l1_lookup(f->l1, 7, &ns, s, 2, true, &hits, &ll), 0);
    assert_int_equal(kvt_l1_reserve(f->l1, 7, &ns, w, 2, NULL, MiB, slots, &n, &wl,
                                    err, sizeof err),
                     0);
    assert_int_equal(kvt_l1_release_owner(f->l1, 7, false), 3);
    kvt_l1_counts_t c = s_counts(f);
    assert_int_equal(c.leases_active, 0);
    assert_int_equal(c.leases_expired, 0);
    assert_int_equal(c.reserved, 0);
    assert_int_equal(kvt_l1_commit(f->l1, 7, wl, NULL, 0, &stored, err, sizeof err), KVT_EUNKLEASE);
    assert_int_equal(kvt_l1_release(f->l1, 7, rl), KVT_EUNKLEASE);
    assert_int_equal(kvt_l1_evict(f->l1, f->cap), 2 * MiB);
    assert_int_equal(s_counts(f).used, 0);
    assert_int_equal(kvt_l1_release_owner(f->l1, 12345, false), 0);
}

/* destroy with objects, pins and reservations still there: ASan checks nothing leaks */
static void test_destroy_with_everything_held(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("m", "salt");
    kvt_key_t k[4];
    s_keys(k, 29, 0, 4);
    assert_int_equal(s_store(f, 1, &ns, k, 2, MiB), 2);
    kvt_slot_t slots[4];
    uint32_t n, removed;
    uint64_t l;
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_l1_acquire(f->l1, 2, &ns, k, 2, slots, &n, &l), 0);
    assert_int_equal(kvt_l1_remove(f->l1, &ns, k, 1, &removed), 0);
    assert_int_equal(kvt_l1_reserve(f->l1, 3, &ns, &k[2], 2, NULL, MiB, slots, &n,
                                    &l, err, sizeof err),
                     0);
    /* teardown destroys it */
}

/* ---- index ------------------------------------------------------------------------------ */

static int s_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void test_index_100k(void **state)
{
    (void)state;
    enum { N = 100000, B = 64 };
    fx_t f = {0};
    f.l1 = s_l1_new("512M", &f.cfg);
    f.base = kvt_l1_base(f.l1);
    f.cap = kvt_l1_capacity(f.l1);
    kvt_ns_t ns = s_ns("big", "");
    uint64_t *offs = malloc(N * sizeof *offs);
    kvt_key_t keys[B];
    kvt_slot_t slots[B];
    char err[KVT_ERR_LEN];
    for (uint32_t i = 0; i < N; i += B) {
        uint32_t n = N - i < B ? N - i : B, ns_ = 0, stored = 0;
        uint64_t lease = 0;
        s_keys(keys, 30, i, n);
        assert_int_equal(kvt_l1_reserve(f.l1, 1, &ns, keys, n, NULL, 4096, slots,
                                        &ns_, &lease, err, sizeof err),
                         0);
        assert_int_equal(ns_, n);
        for (uint32_t j = 0; j < n; j++) {
            assert_int_equal(slots[j].length, 4096);
            offs[i + j] = slots[j].offset;
        }
        assert_int_equal(kvt_l1_commit(f.l1, 1, lease, NULL, 0, &stored, err, sizeof err), 0);
        assert_int_equal(stored, n);
    }
    kvt_l1_counts_t c = s_counts(&f);
    assert_int_equal(c.objects, N);
    assert_int_equal(c.used, (uint64_t)N * 4096);
    assert_int_equal(c.evictions, 0);
    qsort(offs, N, sizeof *offs, s_cmp_u64);
    for (uint32_t i = 1; i < N; i++)
        assert_true(offs[i] >= offs[i - 1] + 4096);
    assert_true(offs[N - 1] + 4096 <= f.cap);

    /* every key found, one by one and as 64-key prefixes (crossing batch boundaries) */
    for (uint32_t i = 0; i < N; i++) {
        s_key(&keys[0], 30, i);
        assert_true(s_present(&f, &ns, &keys[0]));
    }
    for (uint32_t i = 17; i + B <= N; i += 997) {
        s_keys(keys, 30, i, B);
        assert_int_equal(s_hits(&f, &ns, keys, B), B);
    }
    /* absent keys miss: other ids, other tag, other namespace */
    kvt_ns_t other = s_ns("big", "salt");
    for (uint32_t i = 0; i < N; i++) {
        s_key(&keys[0], 30, N + i);
        assert_false(s_present(&f, &ns, &keys[0]));
        s_key(&keys[0], 31, i);
        assert_false(s_present(&f, &ns, &keys[0]));
        if (i % 10 == 0) {
            s_key(&keys[0], 30, i);
            assert_false(s_present(&f, &other, &keys[0]));
        }
    }
    /* a prefix of present keys stopped by an absent one */
    s_keys(keys, 30, 500, B);
    s_key(&keys[40], 30, N + 40);
    assert_int_equal(s_hits(&f, &ns, keys, B), 40);

    uint64_t removed = 0;
    assert_int_equal(kvt_l1_clear(f.l1, NULL, 0, &removed), 0);
    assert_int_equal(removed, N);
    assert_int_equal(s_counts(&f).used, 0);
    free(offs);
    kvt_l1_destroy(&f.l1);
    kvt_config_destroy(&f.cfg);
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, s_setup, s_teardown)

/* A fresh 16 MiB tier with one config option set. */
static void s_fx_with(fx_t *fx, const char *name, const char *value)
{
    char err[KVT_ERR_LEN] = "";
    fx->cfg = kvt_config_new();
    assert_int_equal(kvt_config_set(fx->cfg, "l1_size", "16M", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(fx->cfg, "allow_unpinned", "true", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(fx->cfg, "l1.hugepages", "off", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(fx->cfg, "l1.adopt", "false", false, err, sizeof err), 0);
    if (kvt_config_set(fx->cfg, name, value, false, err, sizeof err) != 0)
        fail_msg("%s", err);
    fx->l1 = kvt_l1_new(fx->cfg, err, sizeof err);
    assert_non_null(fx->l1);
    fx->base = kvt_l1_base(fx->l1);
    fx->cap = kvt_l1_capacity(fx->l1);
}

static void s_fx_done(fx_t *fx)
{
    kvt_l1_destroy(&fx->l1);
    kvt_config_destroy(&fx->cfg);
}

/* Every lease's bytes are counted to its owner, page-rounded, and given back exactly when the
 * lease goes, however it goes; the daemon's leases are not counted. No limit by default. */
static void test_owner_bytes(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("acct", "");
    kvt_key_t k[8];
    s_keys(k, 0x61, 0, 8);
    kvt_slot_t slots[8];
    uint64_t sizes[3] = {1, 4096, 10000}, lease = 0, rl = 0, dl = 0;
    uint32_t n = 0, stored = 0;
    char err[KVT_ERR_LEN] = "";
    assert_int_equal(kvt_l1_owner_bytes(f->l1, 7), 0);
    assert_int_equal(kvt_l1_reserve(f->l1, 7, &ns, k, 3, sizes, 0, slots, &n,
                                    &lease, err, sizeof err),
                     0);
    assert_int_equal(kvt_l1_owner_bytes(f->l1, 7), 4096 + 4096 + 12288);
    assert_int_equal(kvt_l1_owner_bytes(f->l1, 8), 0);
    assert_int_equal(kvt_l1_commit(f->l1, 7, lease, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(kvt_l1_owner_bytes(f->l1, 7), 0);
    /* read pins: two owners on the same objects, each counted */
    assert_int_equal(kvt_l1_acquire(f->l1, 7, &ns, k, 3, slots, &n, &rl), 0);
    assert_int_equal(kvt_l1_acquire(f->l1, 8, &ns, k, 2, slots, &n, &dl), 0);
    assert_int_equal(kvt_l1_owner_bytes(f->l1, 7), 20480);
    assert_int_equal(kvt_l1_owner_bytes(f->l1, 8), 8192);
    assert_int_equal(kvt_l1_release(f->l1, 8, dl), 0);
    assert_int_equal(kvt_l1_owner_bytes(f->l1, 8), 0);
    uint32_t hits = 0;
    assert_int_equal(kvt_l1_lookup(f->l1, 7, &ns, k, 1, true, &hits, &dl), 0);
    assert_int_equal(kvt_l1_owner_bytes(f->l1, 7), 20480 + 4096);
    /* a write lease with a failed index and a nil slot */
    uint64_t wl = 0;
    assert_int_equal(kvt_l1_reserve(f->l1, 7, &ns, &k[2], 3, NULL, 5000, slots, &n,
                                    &wl, err, sizeof err),
                     0);
    assert_int_equal(slots[0].length, 0); /* k[2] is stored: nothing charged for it */
    assert_int_equal(kvt_l1_owner_bytes(f->l1, 7), 24576 + 2 * 8192);
    /* expiry settles them all */
    assert_int_equal(kvt_l1_release_owner(f->l1, 7, true), 3);
    assert_int_equal(kvt_l1_owner_bytes(f->l1, 7), 0);
    /* the daemon's leases are never counted, and unlimited */
    assert_int_equal(kvt_l1_reserve(f->l1, KVT_OWNER_DAEMON, &ns, &k[5], 2, NULL,
                                    5000, slots, &n, &lease, err, sizeof err),
                     0);
    assert_int_equal(kvt_l1_owner_bytes(f->l1, KVT_OWNER_DAEMON), 0);
    assert_int_equal(kvt_l1_release(f->l1, KVT_OWNER_DAEMON, lease), 0);
}

/* max_leased_bytes: RESERVE and ACQUIRE stop before the key that would pass it (no_space when
 * that is the first), what was charged is given back, and BYE frees the room. */
static void test_max_leased_bytes(void **state)
{
    (void)state;
    fx_t fx = {0};
    s_fx_with(&fx, "max_leased_bytes", "40k");
    kvt_ns_t ns = s_ns("limit", "");
    kvt_key_t k[16];
    s_keys(k, 0x62, 0, 16);
    kvt_slot_t slots[16];
    uint32_t n = 0, stored = 0;
    uint64_t lease = 0, l2 = 0;
    char err[KVT_ERR_LEN] = "";
    /* 12 KiB each: three fit in 40 KiB, the fourth does not */
    assert_int_equal(kvt_l1_reserve(fx.l1, 3, &ns, k, 5, NULL, 12288, slots, &n,
                                    &lease, err, sizeof err),
                     0);
    assert_int_equal(n, 3);
    assert_int_equal(kvt_l1_owner_bytes(fx.l1, 3), 36864);
    assert_int_equal(s_counts(&fx).reserved, 3);
    err[0] = '\0';
    assert_int_equal(kvt_l1_reserve(fx.l1, 3, &ns, &k[3], 1, NULL, 8192, slots, &n,
                                    &l2, err, sizeof err),
                     KVT_ENOSPC);
    assert_int_equal(l2, 0);
    assert_non_null(strstr(err, "max_leased_bytes (40960)"));
    assert_non_null(strstr(err, "36864"));
    assert_int_equal(kvt_l1_owner_bytes(fx.l1, 3), 36864);
    /* a key that fits in what is left (4 KiB) still goes */
    assert_int_equal(kvt_l1_reserve(fx.l1, 3, &ns, &k[3], 2, NULL, 4096, slots, &n,
                                    &l2, err, sizeof err),
                     0);
    assert_int_equal(n, 1);
    assert_int_equal(kvt_l1_owner_bytes(fx.l1, 3), 40960);
    /* another owner is not limited by this one */
    uint64_t other = 0;
    assert_int_equal(kvt_l1_reserve(fx.l1, 4, &ns, &k[8], 3, NULL, 12288, slots,
                                    &n, &other, err, sizeof err),
                     0);
    assert_int_equal(n, 3);
    assert_int_equal(kvt_l1_release_owner(fx.l1, 4, false), 1);
    assert_int_equal(kvt_l1_commit(fx.l1, 3, l2, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(kvt_l1_owner_bytes(fx.l1, 3), 36864);
    /* ACQUIRE under the same limit: k[3] (4 KiB) fits, nothing more */
    uint64_t rl = 0;
    assert_int_equal(kvt_l1_acquire(fx.l1, 3, &ns, &k[3], 1, slots, &n, &rl), 0);
    assert_int_equal(n, 1);
    assert_int_equal(kvt_l1_acquire(fx.l1, 3, &ns, &k[3], 1, slots, &n, &l2),
                     KVT_ENOSPC);
    assert_int_equal(n, 0);
    assert_int_equal(l2, 0);
    kvt_l1_owner_limit_error(fx.l1, 3, err, sizeof err);
    assert_non_null(strstr(err, "40960 bytes under leases"));
    uint32_t hits = 0;
    assert_int_equal(kvt_l1_lookup(fx.l1, 3, &ns, &k[3], 1, true, &hits, &l2),
                     KVT_ENOSPC);
    assert_int_equal(kvt_l1_lookup(fx.l1, 3, &ns, &k[3], 1, false, &hits, &l2), 0);
    assert_int_equal(hits, 1); /* a plain LOOKUP pins nothing: not limited */
    /* BYE: everything back */
    assert_int_equal(kvt_l1_release_owner(fx.l1, 3, false), 2);
    assert_int_equal(kvt_l1_owner_bytes(fx.l1, 3), 0);
    assert_int_equal(s_counts(&fx).reserved, 0);
    s_fx_done(&fx);
}

/* l1_checksum: COMMIT keeps the checksum; bytes changed afterwards are caught by GET's verify
 * (the object leaves the index, the lease still pins it) and by the write-behind check, each
 * counted once; a prefetch's checksum is taken as given. */
static void test_l1_checksum(void **state)
{
    (void)state;
    fx_t fx = {0};
    s_fx_with(&fx, "l1_checksum", "true");
    kvt_ns_t ns = s_ns("sum", "");
    kvt_key_t k[4];
    s_keys(k, 0x63, 0, 4);
    assert_int_equal(s_store(&fx, 1, &ns, k, 3, 10000), 3);
    kvt_slot_t slots[4];
    uint32_t n = 0;
    uint64_t rl = 0;
    assert_int_equal(
        kvt_l1_acquire(fx.l1, KVT_OWNER_DAEMON, &ns, k, 3, slots, &n, &rl), 0);
    assert_int_equal(kvt_l1_verify(fx.l1, KVT_OWNER_DAEMON, rl, 3), 3);
    fx.base[slots[1].offset + 9999] ^= 0x80; /* a late writer */
    assert_int_equal(kvt_l1_verify(fx.l1, KVT_OWNER_DAEMON, rl, 3), 1);
    assert_int_equal(s_hits(&fx, &ns, k, 3), 1);
    assert_int_equal(kvt_l1_verify(fx.l1, KVT_OWNER_DAEMON, rl, 1), 1);
    assert_int_equal(kvt_l1_release(fx.l1, KVT_OWNER_DAEMON, rl), 0);
    assert_int_equal(s_counts(&fx).objects, 2);
    /* write-behind: the caller's checksum against the kept one */
    assert_int_equal(
        kvt_l1_acquire(fx.l1, KVT_OWNER_DAEMON, &ns, &k[2], 1, slots, &n, &rl), 0);
    uint64_t sum = XXH3_64bits(fx.base + slots[0].offset, slots[0].length);
    assert_int_equal(kvt_l1_check_sum(fx.l1, KVT_OWNER_DAEMON, rl, 0, sum), 0);
    assert_int_equal(kvt_l1_check_sum(fx.l1, KVT_OWNER_DAEMON, rl, 0, sum + 1), KVT_EIO);
    /* still not to be written, but counted once */
    assert_int_equal(kvt_l1_check_sum(fx.l1, KVT_OWNER_DAEMON, rl, 0, sum + 1), KVT_EIO);
    assert_int_equal(kvt_l1_check_sum(fx.l1, KVT_OWNER_DAEMON, rl, 5, sum), KVT_EUNKLEASE);
    assert_int_equal(kvt_l1_release(fx.l1, KVT_OWNER_DAEMON, rl), 0);
    assert_false(s_present(&fx, &ns, &k[2]));
    assert_int_equal(kvt_l1_verify(fx.l1, KVT_OWNER_DAEMON, 999999, 2), 0); /* no such lease */
    /* a prefetch brings its verified checksum: taken as is (here a wrong one, to see it kept) */
    uint64_t wl = 0, sums[1] = {12345};
    uint32_t stored = 0;
    char err[KVT_ERR_LEN] = "";
    assert_int_equal(kvt_l1_reserve(fx.l1, KVT_OWNER_DAEMON, &ns, &k[3], 1, NULL,
                                    4096, slots, &n, &wl, err, sizeof err),
                     0);
    assert_int_equal(
        kvt_l1_commit_loaded(fx.l1, KVT_OWNER_DAEMON, wl, NULL, 0, sums, &stored, err, sizeof err),
        0);
    assert_int_equal(
        kvt_l1_acquire(fx.l1, KVT_OWNER_DAEMON, &ns, &k[3], 1, slots, &n, &rl), 0);
    assert_int_equal(kvt_l1_check_sum(fx.l1, KVT_OWNER_DAEMON, rl, 0, 12345), 0);
    assert_int_equal(kvt_l1_release(fx.l1, KVT_OWNER_DAEMON, rl), 0);
    json_t *st = kvt_l1_status_json(fx.l1);
    assert_int_equal(json_integer_value(json_object_get(st, "corrupt")), 2);
    json_decref(st);
    s_fx_done(&fx);
}

/* Without l1_checksum nothing is hashed and nothing is judged. */
static void test_l1_checksum_off(void **state)
{
    fx_t *f = *state;
    kvt_ns_t ns = s_ns("nosum", "");
    kvt_key_t k[1];
    s_keys(k, 0x64, 0, 1);
    assert_int_equal(s_store(f, 1, &ns, k, 1, 4096), 1);
    kvt_slot_t slot;
    uint32_t n = 0;
    uint64_t rl = 0;
    assert_int_equal(
        kvt_l1_acquire(f->l1, KVT_OWNER_DAEMON, &ns, k, 1, &slot, &n, &rl), 0);
    f->base[slot.offset] ^= 1;
    assert_int_equal(kvt_l1_verify(f->l1, KVT_OWNER_DAEMON, rl, 1), 1);
    assert_int_equal(kvt_l1_check_sum(f->l1, KVT_OWNER_DAEMON, rl, 0, 0), 0);
    assert_int_equal(kvt_l1_release(f->l1, KVT_OWNER_DAEMON, rl), 0);
}

/* l2_backlog_max: objects waiting for their L2 write are kept while they fill at most that
 * fraction of L1; past it a RESERVE that needs room evicts the oldest of them, unwritten and
 * counted (l2_skipped). With 1 they all wait: a full L1 refuses until they are written. */
static void test_l2_backlog(void **state)
{
    (void)state;
    for (int mode = 0; mode < 2; mode++) {
        char err[KVT_ERR_LEN] = "";
        fx_t fx = {0}, *f = &fx;
        f->cfg = kvt_config_new();
        assert_int_equal(kvt_config_set(f->cfg, "l1_size", "16M", false, err, sizeof err), 0);
        assert_int_equal(kvt_config_set(f->cfg, "allow_unpinned", "true", false, err, sizeof err),
                         0);
        assert_int_equal(kvt_config_set(f->cfg, "l1.hugepages", "off", false, err, sizeof err), 0);
        assert_int_equal(kvt_config_set(f->cfg, "l1.adopt", "false", false, err, sizeof err), 0);
        assert_int_equal(kvt_config_set(f->cfg, "l2_backlog_max", mode == 0 ? "0.5" : "1", false,
                                        err, sizeof err),
                         0);
        f->l1 = kvt_l1_new(f->cfg, err, sizeof err);
        assert_non_null(f->l1);
        f->base = kvt_l1_base(f->l1);
        f->cap = kvt_l1_capacity(f->l1);
        kvt_l1_set_l2_writes(f->l1, 1);
        kvt_ns_t ns = s_ns("b", "");
        uint32_t total = (uint32_t)(f->cap / MiB); /* 16 */
        kvt_key_t o[MAXN];
        s_keys(o, 11, 0, total);
        for (uint32_t i = 0; i < total; i++) /* o0 is the oldest */
            assert_int_equal(s_store(f, 1, &ns, &o[i], 1, MiB), 1);
        /* the first half is written to L2: evictable as usual */
        for (uint32_t i = 0; i < total / 2; i++)
            kvt_l1_l2_written(f->l1, &ns, &o[i]);
        json_t *st = kvt_l1_status_json(f->l1);
        json_t *bl = json_object_get(st, "l2_backlog");
        assert_int_equal(json_integer_value(json_object_get(bl, "objects")), total / 2);
        assert_int_equal(json_integer_value(json_object_get(bl, "bytes")), (total / 2) * MiB);
        assert_int_equal(json_integer_value(json_object_get(bl, "max_bytes")),
                         mode == 0 ? (json_int_t)(f->cap / 2) : -1);
        json_decref(st);

        /* 8 more: the 8 written ones go first, the backlog (exactly half) is left alone */
        kvt_key_t n1[8];
        s_keys(n1, 12, 0, 8);
        assert_int_equal(s_store(f, 1, &ns, n1, 8, MiB), 8);
        for (uint32_t i = 0; i < total / 2; i++)
            assert_false(s_present(f, &ns, &o[i]));
        for (uint32_t i = total / 2; i < total; i++)
            assert_true(s_present(f, &ns, &o[i]));
        /* now all 16 wait (8 of o, 8 of n1): past 0.5 the oldest of them go; at 1 L1 refuses */
        kvt_key_t n2[4];
        s_keys(n2, 13, 0, 4);
        kvt_slot_t slots[4];
        uint32_t nslots = 0;
        uint64_t lease = 0;
        assert_int_equal(kvt_l1_reserve(f->l1, 1, &ns, n2, 4, NULL, MiB, slots, &nslots, &lease,
                                        err, sizeof err),
                         mode == 0 ? 0 : KVT_ENOSPC);
        st = kvt_l1_status_json(f->l1);
        bl = json_object_get(st, "l2_backlog");
        if (mode == 0) {
            assert_int_equal(nslots, 4);
            uint32_t stored = 0;
            assert_int_equal(kvt_l1_commit(f->l1, 1, lease, NULL, 0, &stored, err, sizeof err), 0);
            for (uint32_t i = total / 2; i < total / 2 + 4; i++) /* the oldest waiting */
                assert_false(s_present(f, &ns, &o[i]));
            for (uint32_t i = total / 2 + 4; i < total; i++)
                assert_true(s_present(f, &ns, &o[i]));
            assert_int_equal(json_integer_value(json_object_get(bl, "skipped")), 4);
            assert_int_equal(json_integer_value(json_object_get(bl, "skipped_bytes")), 4 * MiB);
        } else {
            for (uint32_t i = total / 2; i < total; i++)
                assert_true(s_present(f, &ns, &o[i]));
            assert_int_equal(json_integer_value(json_object_get(bl, "skipped")), 0);
            /* once written they may go, and the store goes through */
            for (uint32_t i = total / 2; i < total; i++)
                kvt_l1_l2_written(f->l1, &ns, &o[i]);
            assert_int_equal(s_store(f, 1, &ns, n2, 4, MiB), 4);
        }
        json_decref(st);
        kvt_l1_destroy(&f->l1);
        kvt_config_destroy(&f->cfg);
    }
}

/* debug.fail_alloc_every: the injected failures answer ENOSPC (a first key) or cut the batch to
 * the prefix before it, never harm what is stored, and the next allocation works again. */
static void test_fail_alloc_injection(void **state)
{
    (void)state;
    kvt_config_t *cfg = NULL;
    char err[KVT_ERR_LEN] = "";
    fx_t fx = {0};
    fx.l1 = s_l1_new("16M", &cfg);
    fx.cfg = cfg;
    kvt_l1_destroy(&fx.l1);
    assert_int_equal(kvt_config_set(cfg, "debug.fail_alloc_every", "3", false, err, sizeof err),
                     0);
    fx.l1 = kvt_l1_new(cfg, err, sizeof err);
    assert_non_null(fx.l1);
    fx.base = kvt_l1_base(fx.l1);
    fx.cap = kvt_l1_capacity(fx.l1);
    kvt_ns_t ns = s_ns("inj", "");
    kvt_key_t k[6];
    s_keys(k, 0x51, 0, 6);
    /* allocations 1 and 2 succeed, 3 fails: a batch of three gets the prefix of two */
    kvt_slot_t slots[6];
    uint32_t n = 0, stored = 0;
    uint64_t lease = 0;
    assert_int_equal(kvt_l1_reserve(fx.l1, 1, &ns, k, 3, NULL, 8192, slots, &n,
                                    &lease, err, sizeof err),
                     0);
    assert_int_equal(n, 2);
    for (uint32_t i = 0; i < n; i++)
        s_fill(fx.base + slots[i].offset, slots[i].length, &k[i]);
    assert_int_equal(kvt_l1_commit(fx.l1, 1, lease, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(stored, 2);
    /* 4, 5 succeed (k[2], k[3]); 6 fails on the first key of its batch: ENOSPC, nothing held */
    assert_int_equal(s_store(&fx, 1, &ns, &k[2], 2, 8192), 2);
    assert_int_equal(kvt_l1_reserve(fx.l1, 1, &ns, &k[4], 1, NULL, 8192, slots,
                                    &n, &lease, err, sizeof err),
                     KVT_ENOSPC);
    assert_int_equal(n, 0);
    assert_int_equal(lease, 0);
    assert_int_equal(s_counts(&fx).reserved, 0);
    /* 7 succeeds again */
    assert_int_equal(s_store(&fx, 1, &ns, &k[4], 1, 8192), 1);
    assert_int_equal(s_hits(&fx, &ns, k, 6), 5);
    uint64_t rl = 0;
    assert_int_equal(kvt_l1_acquire(fx.l1, 2, &ns, k, 5, slots, &n, &rl), 0);
    assert_int_equal(n, 5);
    for (uint32_t i = 0; i < n; i++)
        assert_true(s_verify(fx.base + slots[i].offset, slots[i].length, &k[i]));
    assert_int_equal(kvt_l1_release(fx.l1, 2, rl), 0);
    kvt_l1_destroy(&fx.l1);
    kvt_config_destroy(&cfg);
}

/* Issue 30: an adopted object is checked against its journaled checksum before it is served.
 * Before the background check (kvt_l1_start) runs, a read checks the object itself: one whose
 * bytes changed while no daemon ran is a miss; the check, once started, removes it and counts
 * it; the others are served. */
static void test_adopted_objects_checked_before_served(void **state)
{
    (void)state;
    kvt_log_set_level(KVT_LOG_ERROR);
    char dir[] = "/tmp/kvt-l1-adopt-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char err[KVT_ERR_LEN] = "";
    kvt_config_t *cfg = kvt_config_new();
    const char *set[][2] = {{"l1_size", "16M"},      {"allow_unpinned", "true"},
                            {"l1.hugepages", "off"}, {"run_dir", dir},
                            {"l1.adopt", "true"},    {"l1_checksum", "true"}};
    for (size_t i = 0; i < sizeof set / sizeof set[0]; i++)
        assert_int_equal(kvt_config_set(cfg, set[i][0], set[i][1], false, err, sizeof err), 0);
    fx_t f = {.cfg = cfg};
    f.l1 = kvt_l1_new(cfg, err, sizeof err);
    if (!f.l1)
        fail_msg("kvt_l1_new: %s", err);
    f.base = kvt_l1_base(f.l1);
    f.cap = kvt_l1_capacity(f.l1);
    kvt_ns_t ns = s_ns("adopt", NULL);
    kvt_key_t keys[3];
    s_keys(keys, 0xad, 0, 3);
    assert_int_equal(s_store(&f, 1, &ns, keys, 3, 64 * 1024), 3);
    kvt_slot_t slots[3];
    uint32_t n = 0;
    uint64_t lease = 0;
    assert_int_equal(kvt_l1_acquire(f.l1, 1, &ns, keys, 3, slots, &n, &lease), 0);
    assert_int_equal(n, 3);
    uint64_t off1 = slots[1].offset;
    assert_int_equal(kvt_l1_release(f.l1, 1, lease), 0);
    char path[256];
    snprintf(path, sizeof path, "%s", kvt_l1_shm_path(f.l1));
    kvt_l1_destroy(&f.l1); /* the arena and its journal stay for the next one */

    FILE *a = fopen(path, "r+b"); /* a client scribbling while no daemon runs */
    assert_non_null(a);
    assert_int_equal(fseek(a, (long)off1 + 100, SEEK_SET), 0);
    int was = fgetc(a);
    assert_true(was != EOF);
    assert_int_equal(fseek(a, (long)off1 + 100, SEEK_SET), 0);
    assert_int_equal(fputc(was ^ 0x5a, a), was ^ 0x5a);
    fclose(a);

    f.l1 = kvt_l1_new(cfg, err, sizeof err);
    if (!f.l1)
        fail_msg("kvt_l1_new (adopting): %s", err);
    f.base = kvt_l1_base(f.l1);
    json_t *st = kvt_l1_status_json(f.l1);
    json_t *ad = json_object_get(st, "adopt");
    assert_true(json_is_true(json_object_get(ad, "adopted")));
    assert_int_equal(json_integer_value(json_object_get(ad, "verify_pending")), 3);
    json_decref(st);
    /* not started: no check has run; the reads check for themselves */
    assert_int_equal(s_hits(&f, &ns, keys, 1), 1);
    assert_int_equal(s_hits(&f, &ns, keys, 3), 1); /* the second was changed: a miss */
    assert_int_equal(s_hits(&f, &ns, keys + 2, 1), 1);
    kvt_sup_t *sup = kvt_sup_new(NULL);
    assert_int_equal(kvt_l1_start(f.l1, sup), 0);
    int64_t pending = -1;
    for (int i = 0; i < 500 && pending != 0; i++) {
        st = kvt_l1_status_json(f.l1);
        pending =
            json_integer_value(json_object_get(json_object_get(st, "adopt"), "verify_pending"));
        json_decref(st);
        if (pending)
            usleep(10000);
    }
    assert_int_equal(pending, 0);
    st = kvt_l1_status_json(f.l1);
    ad = json_object_get(st, "adopt");
    assert_int_equal(json_integer_value(json_object_get(ad, "objects")), 2);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(ad, "left_out"), "damaged")), 1);
    assert_true(json_integer_value(json_object_get(ad, "verified_ms")) > 0);
    json_decref(st);
    assert_false(s_present(&f, &ns, &keys[1]));
    assert_true(s_present(&f, &ns, &keys[0]) && s_present(&f, &ns, &keys[2]));
    kvt_l1_stop(f.l1);
    kvt_l1_destroy(&f.l1);
    kvt_sup_destroy(&sup);
    unlink(path);
    char j[300];
    snprintf(j, sizeof j, "%s/kvtier-l1.journal", dir);
    unlink(j);
    rmdir(dir);
    kvt_config_destroy(&cfg);
}

/* ---- the residency map ----------------------------------------------------------------- */

/* The map (what a fast-path client maps, through a read-only descriptor of it) follows the
 * READY objects: nothing at RESERVE, the keys at COMMIT, each namespace and salt apart, gone
 * at REMOVE (pinned or not), eviction and CLEAR. */
static void test_resident_map_follows_ready(void **state)
{
    fx_t *f = *state;
    kvt_resident_t *r = kvt_l1_resident(f->l1);
    assert_non_null(r);
    char path[64], why[160];
    snprintf(path, sizeof path, "/proc/self/fd/%d", kvt_resident_fd(r));
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    assert_true(fd >= 0);
    void *map = mmap(NULL, kvt_resident_size(r), PROT_READ, MAP_SHARED, fd, 0);
    assert_true(map != MAP_FAILED);
    close(fd);
    kvt_resident_view_t v;
    assert_int_equal(kvt_resident_view(map, kvt_resident_size(r), &v, why, sizeof why), 0);

    kvt_ns_t a = s_ns("a", ""), as = s_ns("a", "x"), ab = s_ns("ab", ""), a_b = s_ns("a", "b");
    kvt_key_t k[8];
    s_keys(k, 40, 0, 8);
    kvt_slot_t slots[8];
    uint32_t nslots, stored;
    uint64_t lease;
    char err[KVT_ERR_LEN];
    assert_int_equal(kvt_l1_reserve(f->l1, 1, &a, k, 4, NULL, 4096, slots, &nslots, &lease, err,
                                    sizeof err),
                     0);
    assert_int_equal(kvt_resident_prefix(&v, &a, k, 4), 0); /* reserved is not there yet */
    assert_int_equal(kvt_l1_commit(f->l1, 1, lease, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(kvt_resident_prefix(&v, &a, k, 8), 4);
    assert_int_equal(kvt_resident_prefix(&v, &as, k, 4), 0);
    assert_int_equal(kvt_resident_prefix(&v, &a_b, k, 4), 0);
    assert_int_equal(s_store(f, 1, &ab, k, 2, 4096), 2);
    assert_int_equal(kvt_resident_prefix(&v, &ab, k, 4), 2);
    assert_int_equal(kvt_resident_prefix(&v, &a_b, k, 4), 0); /* "ab"+"" is not "a"+"b" */

    /* REMOVE of a pinned object: gone from the map at once, freed at its unpin */
    kvt_slot_t s1;
    uint32_t n;
    uint64_t rl;
    assert_int_equal(kvt_l1_acquire(f->l1, 2, &a, &k[1], 1, &s1, &n, &rl), 0);
    uint32_t removed;
    assert_int_equal(kvt_l1_remove(f->l1, &a, &k[1], 1, &removed), 0);
    assert_int_equal(removed, 1);
    assert_int_equal(kvt_resident_prefix(&v, &a, k, 4), 1);
    assert_int_equal(kvt_resident_prefix(&v, &a, &k[2], 2), 2);
    kvt_l1_release(f->l1, 2, rl);

    /* eviction */
    assert_true(kvt_l1_evict(f->l1, f->cap) > 0);
    assert_int_equal(kvt_resident_prefix(&v, &a, k, 1), 0);
    assert_int_equal(kvt_resident_prefix(&v, &a, &k[2], 1), 0);
    assert_int_equal(kvt_resident_prefix(&v, &ab, k, 1), 0);

    /* CLEAR of one namespace */
    assert_int_equal(s_store(f, 1, &a, k, 3, 4096), 3);
    assert_int_equal(s_store(f, 1, &as, k, 3, 4096), 3);
    uint64_t cleared;
    assert_int_equal(kvt_l1_clear(f->l1, (const uint8_t *)"a", 1, &cleared), 0);
    assert_int_equal(kvt_resident_prefix(&v, &a, k, 3), 0);
    assert_int_equal(kvt_resident_prefix(&v, &as, k, 3), 0);
    kvt_resident_stats_t st;
    kvt_resident_stats(r, &st);
    assert_int_equal(st.entries, 0);
    munmap(map, kvt_resident_size(r));
}

/* resident_map false: no map. */
static void test_resident_map_off(void **state)
{
    (void)state;
    kvt_config_t *cfg;
    kvt_l1_t *l1 = s_l1_new_with("16M", "resident_map", "false", &cfg);
    assert_null(kvt_l1_resident(l1));
    kvt_l1_destroy(&l1);
    kvt_config_destroy(&cfg);
}

/* What the listener was told, copied (its views last only for the call). */
typedef struct {
    kvt_l1_event_t event;
    uint32_t n;
    kvt_key_t keys[8];
    uint64_t sizes[8];
    bool labeled;
    char labels[8][KVT_MAX_LABEL + 1]; /* "" for a key without one */
} s_change_t;

static s_change_t s_changes[16];
static int s_nchanges;

static void s_listen(void *ctx, const kvt_l1_change_t *c)
{
    (void)ctx;
    assert_true(s_nchanges < 16 && c->n <= 8);
    s_change_t *r = &s_changes[s_nchanges++];
    memset(r, 0, sizeof *r);
    r->event = c->event;
    r->n = c->n;
    r->labeled = c->labels != NULL;
    for (uint32_t i = 0; i < c->n; i++) {
        r->keys[i] = c->keys[i];
        assert_non_null(c->sizes);
        r->sizes[i] = c->sizes[i];
        if (c->labels && c->labels[i].len)
            memcpy(r->labels[i], c->labels[i].ptr, c->labels[i].len);
    }
}

/* kvt_l1_write's fill: writes nothing, commits all. */
static int s_fill_ok(void *ctx, uint8_t *base, const kvt_slot_t *slots, uint32_t n,
                     uint64_t *failed, uint32_t *nfailed, uint64_t *sums, char *err,
                     size_t errlen)
{
    (void)ctx, (void)base, (void)slots, (void)n, (void)failed, (void)nfailed, (void)sums;
    (void)err, (void)errlen;
    return 0;
}

static kvt_bytes_t s_label(const char *s)
{
    return (kvt_bytes_t){(const uint8_t *)s, s ? (uint32_t)strlen(s) : 0};
}

/* Every event says each object's length and the label it was stored with (RESERVE or the
 * daemon's write), whether it leaves by REMOVE or eviction; a key already present keeps its
 * first label; a batch without labels has none; a label longer than KVT_MAX_LABEL is cut. */
static void test_events_carry_sizes_and_labels(void **state)
{
    fx_t *f = *state;
    s_nchanges = 0;
    kvt_l1_set_listener(f->l1, s_listen, NULL);
    kvt_ns_t ns = s_ns("vllm-ec/m/bfloat16/h8", NULL);
    kvt_key_t k[6];
    s_keys(k, 0x51, 0, 6);
    uint64_t sizes[3] = {5000, 6000, 7000};
    kvt_bytes_t labels[3] = {s_label("mm-a"), s_label(NULL), s_label("mm-c")};
    uint64_t one = 3000;
    kvt_slot_t slots[3];
    uint32_t n = 0, stored = 0, removed = 0;
    uint64_t lease = 0;
    char err[KVT_ERR_LEN] = "";
    assert_int_equal(kvt_l1_reserve_labeled(f->l1, 4, &ns, k, labels, 3, sizes, 0, slots, &n,
                                            &lease, err, sizeof err),
                     0);
    assert_int_equal(n, 3);
    assert_int_equal(s_nchanges, 0); /* nothing until COMMIT */
    assert_int_equal(kvt_l1_commit(f->l1, 4, lease, NULL, 0, &stored, err, sizeof err), 0);
    assert_int_equal(s_nchanges, 1);
    s_change_t *c = &s_changes[0];
    assert_int_equal(c->event, KVT_L1_STORED);
    assert_int_equal(c->n, 3);
    assert_true(c->labeled);
    assert_int_equal(c->sizes[0], 5000);
    assert_int_equal(c->sizes[2], 7000);
    assert_string_equal(c->labels[0], "mm-a");
    assert_string_equal(c->labels[1], "");
    assert_string_equal(c->labels[2], "mm-c");
    /* the same key again with another label: present, nothing new, the first label stays */
    kvt_bytes_t other = s_label("mm-other");
    assert_int_equal(kvt_l1_reserve_labeled(f->l1, 4, &ns, k, &other, 1, NULL, 5000, slots, &n,
                                            &lease, err, sizeof err),
                     0);
    assert_int_equal(slots[0].length, 0);
    /* unlabeled objects: no labels at all */
    assert_int_equal(s_store(f, 4, &ns, &k[3], 1, 4096), 1);
    assert_int_equal(s_nchanges, 2);
    assert_false(s_changes[1].labeled);
    assert_int_equal(s_changes[1].sizes[0], 4096);
    /* the daemon's own write (PUT), with a label past the limit: cut to KVT_MAX_LABEL, or
     * before a character that would cross it (here a 2-byte one at 254..255) */
    char longest[KVT_MAX_LABEL + 10];
    memset(longest, 'L', sizeof longest - 1);
    longest[sizeof longest - 1] = 0;
    kvt_bytes_t crossing = s_label(longest);
    memcpy(longest + KVT_MAX_LABEL - 1, "\xc3\xa9", 2);
    assert_int_equal(kvt_l1_write(f->l1, &ns, &k[5], &crossing, 1, &one, 0, false, s_fill_ok,
                                  NULL, &stored, NULL, err, sizeof err),
                     0);
    assert_int_equal(strlen(s_changes[s_nchanges - 1].labels[0]), KVT_MAX_LABEL - 1);
    assert_int_equal(kvt_l1_remove(f->l1, &ns, &k[5], 1, &removed), 0);
    s_nchanges = 2;
    memset(longest, 'L', sizeof longest - 1);
    kvt_bytes_t ll = s_label(longest);
    assert_int_equal(kvt_l1_write(f->l1, &ns, &k[4], &ll, 1, &one, 0, false, s_fill_ok, NULL,
                                  &stored, NULL, err, sizeof err),
                     0);
    assert_int_equal(s_nchanges, 3);
    assert_int_equal(strlen(s_changes[2].labels[0]), KVT_MAX_LABEL);
    /* REMOVE: the label and size of what went */
    assert_int_equal(kvt_l1_remove(f->l1, &ns, &k[2], 1, &removed), 0);
    assert_int_equal(removed, 1);
    assert_int_equal(s_nchanges, 4);
    c = &s_changes[3];
    assert_int_equal(c->event, KVT_L1_REMOVED);
    assert_true(c->labeled && c->n == 1);
    assert_string_equal(c->labels[0], "mm-c");
    assert_int_equal(c->sizes[0], 7000);
    /* eviction of everything: the rest, each with its own label or none */
    kvt_l1_evict(f->l1, f->cap);
    assert_int_equal(s_nchanges, 5);
    c = &s_changes[4];
    assert_int_equal(c->event, KVT_L1_EVICTED);
    assert_int_equal(c->n, 4);
    assert_true(c->labeled);
    int seen = 0;
    for (uint32_t i = 0; i < c->n; i++) {
        if (kvt_key_eq(&c->keys[i], &k[0])) {
            assert_string_equal(c->labels[i], "mm-a");
            assert_int_equal(c->sizes[i], 5000);
            seen |= 1;
        } else if (kvt_key_eq(&c->keys[i], &k[1])) {
            assert_string_equal(c->labels[i], "");
            assert_int_equal(c->sizes[i], 6000);
            seen |= 2;
        } else if (kvt_key_eq(&c->keys[i], &k[3])) {
            assert_string_equal(c->labels[i], "");
            seen |= 4;
        } else if (kvt_key_eq(&c->keys[i], &k[4])) {
            assert_int_equal(strlen(c->labels[i]), KVT_MAX_LABEL);
            assert_int_equal(c->sizes[i], 3000);
            seen |= 8;
        }
    }
    assert_int_equal(seen, 15);
    kvt_l1_set_listener(f->l1, NULL, NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_reserve_commit_acquire_release),
        T(test_events_carry_sizes_and_labels),
        T(test_sizes_array),
        T(test_commit_failed_indices),
        T(test_partial_batch_and_enospc),
        T(test_partial_batch_is_a_prefix),
        T(test_on_demand_eviction),
        T(test_on_demand_eviction_fragmented),
        T(test_exact_fit_no_needless_eviction),
        T(test_exact_fit_pinned_no_enospc),
        T(test_lru_prefix_aware_store),
        T(test_lru_acquire_touches),
        T(test_lru_partial_acquire_touches),
        T(test_pinned_never_evicted),
        T(test_reserved_never_evicted),
        T(test_remove_pinned),
        T(test_ns_salt_isolation),
        T(test_clear),
        T(test_release_owner_expired),
        T(test_release_owner_bye),
        T(test_destroy_with_everything_held),
        T(test_owner_bytes),
        T(test_l1_checksum_off),
        cmocka_unit_test(test_index_100k),
        cmocka_unit_test(test_fail_alloc_injection),
        cmocka_unit_test(test_l2_backlog),
        cmocka_unit_test(test_max_leased_bytes),
        cmocka_unit_test(test_l1_checksum),
        cmocka_unit_test(test_adopted_objects_checked_before_served),
        T(test_resident_map_follows_ready),
        cmocka_unit_test(test_resident_map_off),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
