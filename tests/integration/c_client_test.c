/* kvtier-client-test: libkvtier against a running kvtierd, one scenario per process, so that
 * test_c_client.py can run the store and the load of one prefix in different processes (the
 * data-parallel case: rank 0 computes a prefix, rank 1 finds it).
 *
 *   kvtier-client-test ENDPOINT SCENARIO
 *
 *   rank-store  hash 4 chunks of a known token sequence locally, RESERVE, write a per-chunk
 *               pattern through slot.ptr, COMMIT
 *   rank-load   LOOKUP (hits 4), ACQUIRE, check every byte, RELEASE (after rank-store)
 *   salt        the same keys under other salts are other objects
 *   embed       PUT/GET round trip of objects of 1, 4097 and 3 MiB bytes
 *   hash        kvtier_hash_tokens_local == kvtier_hash_tokens == the documented vectors
 *   errors      unknown leases, invalid arguments, an unreachable daemon
 *   prefetch    LOOKUP with KVTIER_PREFETCH, PREFETCH_STATUS (and not_found for a bad job)
 *   labels      kvtier_put_labeled / kvtier_reserve_labeled (bad labels EINVAL; the test reads
 *               the stored events)
 *   remote      a client that cannot map the arena: RESERVE/ACQUIRE refuse, PUT/GET work
 *
 * Liveness (the heartbeat and re-establishment; run with a short --lease-ms):
 *   idle          the heartbeat keeps an idle handle's instance and write lease for 3 x lease_ms
 *   no-heartbeat  KVTIER_HEARTBEAT_MS=0: the instance is dropped (pause "dropped"), COMMIT of
 *                 the old lease fails, the next RESERVE re-establishes it by itself; with
 *                 KVT_TEST_GPU_FILE (the mock CUDA runtime) the GPU layout comes back too
 *                 (pause "reregistered") and STORE_GPU works
 *   restart       pause "restart" (the driver starts another daemon on the endpoint): the next
 *                 call works, in the new daemon's arena (pause "after")
 *   adopt         pause "restart" (the driver restarts the daemon with l1.adopt, which keeps
 *                 the arena file): the object stored before is read back byte-exact through the
 *                 same mapping (never remapped), and new stores work (pause "after")
 *   close         kvtier_close with the daemon gone (pause "joined": the driver kills it)
 *                 returns within the timeout, and no thread is left
 *   fork          a child closes its copy of the handle at once without ending the parent's
 *                 instance, and connects on its own
 *
 * The fast path (the ring pair HELLO offers; KVT_TEST_FASTPATH=1 or 0 says whether this
 * connection must have one, default 1):
 *   fastpath       kvtier_fastpath_active() as expected; RESERVE/COMMIT/LOOKUP/ACQUIRE/RELEASE
 *                  with byte-exact data, kvtier_release_async, and requests that go over the
 *                  socket in between (GET, a LOOKUP too big for a ring record); the pair stays
 *   fastpath-redo  KVTIER_HEARTBEAT_MS=0: the instance is dropped (pause "idle") and the daemon
 *                  closes the pair; the next calls fall back to the socket, the first that answers
 *                  instance_dropped says HELLO again and gets a new pair
 *   fastpath-fake  against the fake daemon of tests/integration/fastpath_fake.py: ordering of a
 *                  posted RELEASE before a socket request, fork, timeouts and stale replies, the
 *                  daemon closing the pair idle or in flight, a daemon gone without closing
 *                  it, re-HELLOs; the pauses ("fork", "slow", "redo-ring", "drop-in-flight",
 *                  "redo-socket", "closed-idle", "redo-gone", "gone", "redo-bye") let the
 *                  driver arm the fake in between
 * A pause prints "pause: WHAT" and waits for a line on stdin (none with stdin /dev/null).
 * KVT_TEST_INSTANCE names the instance of the scenario's connection.
 *
 * Uses only the public API: kvtier.h and the KVT_E* codes of kvt_error.h. Prints one line per
 * scenario; exit 0 passed, 1 failed (the failed check on stderr), 2 usage. */
#include "kvt_error.h"
#include "kvtier.h"

#include <dirent.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define S_NS "c-client-test"
#define S_CHUNKS 4

/* On failure: say where and why, then leave through the scenario's `out:` cleanup. */
#define S_CHECK(cond, ...)                                                                         \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            rc = 1;                                                                                \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

/* A call that must succeed; on failure shows the code and the daemon's message. */
#define S_OK(c, call)                                                                              \
    do {                                                                                           \
        int s_rc_ = (call);                                                                        \
        S_CHECK(s_rc_ == 0, "%s: %s", kvt_err_name(s_rc_), kvtier_last_error(c));                  \
    } while (0)

/* A call that must fail with `code` and say why. */
#define S_FAILS(c, code, call)                                                                     \
    do {                                                                                           \
        int s_rc_ = (call);                                                                        \
        S_CHECK(s_rc_ == (code), "got %s (%s), want %s", kvt_err_name(s_rc_),                      \
                kvtier_last_error(c), kvt_err_name(code));                                         \
        S_CHECK(kvtier_last_error(c)[0] != '\0', "no message with %s", kvt_err_name(code));        \
    } while (0)

typedef const uint8_t (*s_keys_t)[KVTIER_KEY_LEN];

/* ---- the shared prefix of rank-store and rank-load ---- */

static uint32_t s_token(size_t i)
{
    return (uint32_t)(i * 2654435761u) ^ 0x5bd1e995u;
}

static uint64_t s_chunk_size(uint32_t i)
{
    return 64 * 1024 + i * 4096 + 100; /* odd sizes: lengths must come back exact */
}

static uint8_t s_pattern(uint32_t chunk, uint64_t j)
{
    return (uint8_t)((chunk + 1) * 37u + j * 13u + (j >> 9));
}

/* Keys of the first n chunks of the known sequence, at the daemon's chunk_tokens. */
static uint32_t s_prefix_keys(kvtier_t *c, const char *salt, uint32_t n,
                              uint8_t (*keys)[KVTIER_KEY_LEN])
{
    uint32_t ct = kvtier_info(c)->chunk_tokens;
    size_t ntokens = (size_t)ct * n + ct / 2; /* a partial chunk at the end gets no key */
    uint32_t *tokens = malloc(ntokens * sizeof *tokens);
    if (!tokens)
        return 0;
    for (size_t i = 0; i < ntokens; i++)
        tokens[i] = s_token(i);
    uint32_t got = kvtier_hash_tokens_local(tokens, ntokens, ct, salt, keys);
    free(tokens);
    return got;
}

static int s_rank_store(kvtier_t *c)
{
    int rc = 0;
    uint8_t keys[S_CHUNKS][KVTIER_KEY_LEN];
    kvtier_slot_t slots[S_CHUNKS];
    uint64_t sizes[S_CHUNKS], lease = 0;
    uint32_t nslots = 0, stored = 0;
    size_t arena_size = 0;
    uint8_t *arena = kvtier_arena(c, &arena_size);
    S_CHECK(arena && arena_size > 0, "no arena mapped");
    S_CHECK(s_prefix_keys(c, NULL, S_CHUNKS, keys) == S_CHUNKS, "local hash");
    for (uint32_t i = 0; i < S_CHUNKS; i++)
        sizes[i] = s_chunk_size(i);
    S_OK(c,
         kvtier_reserve(c, S_NS, NULL, (s_keys_t)keys, S_CHUNKS, sizes, 0, slots, &nslots, &lease));
    S_CHECK(nslots == S_CHUNKS && lease != 0, "nslots %u lease %llu", nslots,
            (unsigned long long)lease);
    for (uint32_t i = 0; i < S_CHUNKS; i++) {
        S_CHECK(slots[i].ptr == arena + slots[i].offset, "slot %u ptr is not arena + offset", i);
        S_CHECK(slots[i].length == sizes[i], "slot %u length %llu", i,
                (unsigned long long)slots[i].length);
        S_CHECK(slots[i].offset % 4096 == 0, "slot %u offset not 4 KiB aligned", i);
        uint8_t *p = slots[i].ptr;
        for (uint64_t j = 0; j < slots[i].length; j++)
            p[j] = s_pattern(i, j);
    }
    S_OK(c, kvtier_commit(c, lease, NULL, 0, &stored));
    S_CHECK(stored == S_CHUNKS, "stored %u", stored);
    /* a second writer of the same prefix gets nil slots and nothing to commit */
    S_OK(c,
         kvtier_reserve(c, S_NS, NULL, (s_keys_t)keys, S_CHUNKS, sizes, 0, slots, &nslots, &lease));
    S_CHECK(nslots == S_CHUNKS && lease == 0, "re-reserve: nslots %u lease %llu", nslots,
            (unsigned long long)lease);
    for (uint32_t i = 0; i < S_CHUNKS; i++)
        S_CHECK(!slots[i].ptr && slots[i].length == 0, "re-reserve: slot %u is not nil", i);
    printf("rank-store: stored %u chunks\n", stored);
out:
    return rc;
}

static int s_rank_load(kvtier_t *c)
{
    int rc = 0;
    uint8_t keys[S_CHUNKS + 1][KVTIER_KEY_LEN];
    kvtier_slot_t slots[S_CHUNKS + 1];
    uint64_t lease = 0;
    uint32_t hits = 0, l1 = 0, nslots = 0;
    S_CHECK(kvtier_arena(c, NULL), "no arena mapped");
    /* one chunk more than rank-store wrote: the prefix stops at 4 */
    S_CHECK(s_prefix_keys(c, NULL, S_CHUNKS + 1, keys) == S_CHUNKS + 1, "local hash");
    S_OK(c, kvtier_lookup(c, S_NS, NULL, (s_keys_t)keys, S_CHUNKS + 1, 0, &hits, &l1, NULL, NULL));
    S_CHECK(hits == S_CHUNKS && l1 == S_CHUNKS, "lookup: hits %u l1 %u", hits, l1);
    S_OK(c, kvtier_acquire(c, S_NS, NULL, (s_keys_t)keys, S_CHUNKS + 1, slots, &nslots, &lease));
    S_CHECK(nslots == S_CHUNKS && lease != 0, "acquire: nslots %u lease %llu", nslots,
            (unsigned long long)lease);
    for (uint32_t i = 0; i < S_CHUNKS; i++) {
        S_CHECK(slots[i].ptr && slots[i].length == s_chunk_size(i), "slot %u: length %llu", i,
                (unsigned long long)slots[i].length);
        const uint8_t *p = slots[i].ptr;
        for (uint64_t j = 0; j < slots[i].length; j++)
            S_CHECK(p[j] == s_pattern(i, j), "chunk %u byte %llu is %u, want %u", i,
                    (unsigned long long)j, p[j], s_pattern(i, j));
    }
    S_OK(c, kvtier_release(c, lease));
    S_FAILS(c, KVT_EUNKLEASE, kvtier_release(c, lease));
    /* LOOKUP with lock pins the hits under a lease of its own */
    S_OK(c, kvtier_lookup(c, S_NS, NULL, (s_keys_t)keys, S_CHUNKS, KVTIER_LOCK, &hits, NULL, &lease,
                          NULL));
    S_CHECK(hits == S_CHUNKS && lease != 0, "locked lookup: hits %u lease %llu", hits,
            (unsigned long long)lease);
    S_OK(c, kvtier_release(c, lease));
    /* an unanswered RELEASE takes effect before the next call, whose own reply it does not
     * take: the lease is gone, and the sync RELEASE gets its own unknown_lease */
    S_OK(c, kvtier_acquire(c, S_NS, NULL, (s_keys_t)keys, 1, slots, &nslots, &lease));
    S_CHECK(nslots == 1 && lease != 0, "acquire of one: nslots %u", nslots);
    S_OK(c, kvtier_release_async(c, lease));
    S_FAILS(c, KVT_EUNKLEASE, kvtier_release(c, lease));
    S_OK(c, kvtier_lookup(c, S_NS, NULL, (s_keys_t)keys, S_CHUNKS, 0, &hits, NULL, NULL, NULL));
    S_CHECK(hits == S_CHUNKS, "lookup after async release: hits %u", hits);
    nslots = S_CHUNKS;
    printf("rank-load: %u chunks verified\n", nslots);
out:
    return rc;
}

/* ---- salt isolation ---- */

static int s_store_fill(kvtier_t *c, const char *salt, s_keys_t keys, uint32_t n, uint8_t fill)
{
    int rc = 0;
    kvtier_slot_t slots[4];
    uint64_t lease = 0;
    uint32_t nslots = 0, stored = 0;
    S_OK(c, kvtier_reserve(c, S_NS "-salt", salt, keys, n, NULL, 4096, slots, &nslots, &lease));
    S_CHECK(nslots == n && lease, "reserve under salt '%s': nslots %u", salt ? salt : "", nslots);
    for (uint32_t i = 0; i < n; i++) {
        S_CHECK(slots[i].ptr, "slot %u nil under salt '%s'", i, salt ? salt : "");
        memset(slots[i].ptr, fill, slots[i].length);
    }
    S_OK(c, kvtier_commit(c, lease, NULL, 0, &stored));
    S_CHECK(stored == n, "stored %u", stored);
out:
    return rc;
}

static int s_first_byte(kvtier_t *c, const char *salt, s_keys_t keys, int *byte)
{
    int rc = 0;
    kvtier_slot_t slots[1];
    uint64_t lease = 0;
    uint32_t nslots = 0;
    *byte = -1;
    S_OK(c, kvtier_acquire(c, S_NS "-salt", salt, keys, 1, slots, &nslots, &lease));
    if (nslots == 1)
        *byte = *(const uint8_t *)slots[0].ptr;
    if (lease)
        S_OK(c, kvtier_release(c, lease));
out:
    return rc;
}

static int s_salt(kvtier_t *c)
{
    int rc = 0, byte = -1;
    uint8_t plain[2][KVTIER_KEY_LEN], salted[2][KVTIER_KEY_LEN];
    uint32_t hits = 9, removed = 0, nslots = 9;
    uint64_t lease = 9, cleared = 0;
    kvtier_slot_t slots[2];
    S_CHECK(s_prefix_keys(c, NULL, 2, plain) == 2, "local hash");
    S_CHECK(s_prefix_keys(c, "tenant-a", 2, salted) == 2, "local hash");
    S_CHECK(memcmp(plain, salted, sizeof plain) != 0, "a salt does not change the keys");
    S_CHECK(s_store_fill(c, "tenant-a", (s_keys_t)salted, 2, 0xa1) == 0, "store tenant-a");
    S_OK(c, kvtier_lookup(c, S_NS "-salt", "tenant-a", (s_keys_t)salted, 2, 0, &hits, NULL, NULL,
                          NULL));
    S_CHECK(hits == 2, "tenant-a: hits %u", hits);
    static const char *const others[] = {NULL, "", "tenant-b", "tenant-a "};
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
        S_OK(c, kvtier_lookup(c, S_NS "-salt", others[i], (s_keys_t)salted, 2, 0, &hits, NULL, NULL,
                              NULL));
        S_CHECK(hits == 0, "salt '%s' sees tenant-a's keys: hits %u",
                others[i] ? others[i] : "(null)", hits);
    }
    S_OK(c,
         kvtier_acquire(c, S_NS "-salt", "tenant-b", (s_keys_t)salted, 2, slots, &nslots, &lease));
    S_CHECK(nslots == 0 && lease == 0, "tenant-b acquires tenant-a's keys: %u", nslots);
    /* the same key bytes under another salt are another object with other bytes */
    S_CHECK(s_store_fill(c, "tenant-b", (s_keys_t)salted, 2, 0xb2) == 0, "store tenant-b");
    S_CHECK(s_first_byte(c, "tenant-a", (s_keys_t)salted, &byte) == 0 && byte == 0xa1,
            "tenant-a reads %d", byte);
    S_CHECK(s_first_byte(c, "tenant-b", (s_keys_t)salted, &byte) == 0 && byte == 0xb2,
            "tenant-b reads %d", byte);
    S_OK(c, kvtier_remove(c, S_NS "-salt", "tenant-a", (s_keys_t)salted, 2, &removed));
    S_CHECK(removed == 2, "removed %u", removed);
    S_OK(c, kvtier_lookup(c, S_NS "-salt", "tenant-b", (s_keys_t)salted, 2, 0, &hits, NULL, NULL,
                          NULL));
    S_CHECK(hits == 2, "removing tenant-a's objects removed tenant-b's: hits %u", hits);
    S_OK(c, kvtier_clear(c, S_NS "-salt", &cleared));
    S_CHECK(cleared == 2, "clear removed %llu", (unsigned long long)cleared);
    printf("salt: isolated\n");
out:
    return rc;
}

/* ---- PUT/GET ---- */

static void s_fill_random(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = (uint8_t)x;
    }
}

static void s_free_bufs(kvtier_buf_t *b, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        free(b[i].data);
        b[i].data = NULL;
    }
}

static int s_embed(kvtier_t *c)
{
    enum { N = 3 };
    static const size_t lens[N] = {1, 4097, 3u << 20};
    int rc = 0;
    uint8_t *data[N] = {0}, keys[N][KVTIER_KEY_LEN], gapped[3][KVTIER_KEY_LEN];
    kvtier_buf_t out[N] = {{0}};
    kvtier_frames_t *frames = NULL;
    uint32_t stored = 0, found = 0, hits = 0, removed = 0;
    uint64_t cleared = 0;
    for (uint32_t i = 0; i < N; i++) {
        data[i] = malloc(lens[i]);
        S_CHECK(data[i], "out of memory");
        s_fill_random(data[i], lens[i], i + 1);
        /* any 16 bytes make a key; a media hash would do, here a one-chunk token hash */
        uint32_t tokens[2] = {0xe3b0c442u, i};
        S_CHECK(kvtier_hash_tokens_local(tokens, 2, 2, "embed", &keys[i]) == 1, "local hash");
    }
    const void *const ptrs[N] = {data[0], data[1], data[2]};
    S_OK(c, kvtier_put(c, S_NS "-embed", NULL, (s_keys_t)keys, N, ptrs, lens, &stored));
    S_CHECK(stored == N, "put stored %u", stored);
    S_OK(c, kvtier_put(c, S_NS "-embed", NULL, (s_keys_t)keys, N, ptrs, lens, &stored));
    S_CHECK(stored == 0, "a second put of the same keys stored %u", stored);
    S_OK(c, kvtier_get(c, S_NS "-embed", NULL, (s_keys_t)keys, N, out, &found));
    S_CHECK(found == N, "get found %u", found);
    for (uint32_t i = 0; i < N; i++)
        S_CHECK(out[i].len == lens[i] && memcmp(out[i].data, data[i], lens[i]) == 0,
                "object %u: %zu bytes back for %zu, or other bytes", i, out[i].len, lens[i]);
    s_free_bufs(out, N);
    /* the zero-copy GET: the same bytes, read in place from the received frames */
    S_OK(c, kvtier_get_frames(c, S_NS "-embed", NULL, (s_keys_t)keys, N, out, &found, &frames));
    S_CHECK(found == N && frames, "get_frames found %u", found);
    for (uint32_t i = 0; i < N; i++)
        S_CHECK(out[i].len == lens[i] && memcmp(out[i].data, data[i], lens[i]) == 0,
                "get_frames object %u: %zu bytes back for %zu, or other bytes", i, out[i].len,
                lens[i]);
    kvtier_frames_free(&frames);
    S_CHECK(frames == NULL, "kvtier_frames_free left the pointer set");
    memset(out, 0, sizeof out);
    S_OK(c, kvtier_lookup(c, S_NS "-embed", NULL, (s_keys_t)keys, N, 0, &hits, NULL, NULL, NULL));
    S_CHECK(hits == N, "lookup hits %u", hits);
    /* prefix semantics: GET stops at the first missing key */
    memcpy(gapped[0], keys[0], KVTIER_KEY_LEN);
    memset(gapped[1], 0x5a, KVTIER_KEY_LEN);
    memcpy(gapped[2], keys[2], KVTIER_KEY_LEN);
    S_OK(c, kvtier_get(c, S_NS "-embed", NULL, (s_keys_t)gapped, 3, out, &found));
    S_CHECK(found == 1 && out[0].len == 1 && out[1].data == NULL, "gapped get found %u", found);
    s_free_bufs(out, 1);
    S_OK(c, kvtier_get(c, S_NS "-embed", NULL, (s_keys_t)&gapped[1], 1, out, &found));
    S_CHECK(found == 0 && out[0].data == NULL, "get of a missing key found %u", found);
    S_OK(c, kvtier_get_frames(c, S_NS "-embed", NULL, (s_keys_t)&gapped[1], 1, out, &found,
                              &frames));
    S_CHECK(found == 0 && frames == NULL, "get_frames of a missing key found %u", found);
    S_OK(c, kvtier_get(c, S_NS "-embed", "tenant-a", (s_keys_t)keys, N, out, &found));
    S_CHECK(found == 0, "get under another salt found %u", found);
    S_OK(c, kvtier_remove(c, S_NS "-embed", NULL, (s_keys_t)&keys[2], 1, &removed));
    S_CHECK(removed == 1, "removed %u", removed);
    S_OK(c, kvtier_get(c, S_NS "-embed", NULL, (s_keys_t)keys, N, out, &found));
    S_CHECK(found == 2, "get after remove found %u", found);
    s_free_bufs(out, found);
    S_OK(c, kvtier_clear(c, S_NS "-embed", &cleared));
    S_CHECK(cleared == 2, "clear removed %llu", (unsigned long long)cleared);
    printf("embed: %zu, %zu and %zu bytes round-tripped\n", lens[0], lens[1], lens[2]);
out:
    kvtier_frames_free(&frames);
    s_free_bufs(out, N);
    for (uint32_t i = 0; i < N; i++)
        free(data[i]);
    return rc;
}

/* ---- token hashing ---- */

static void s_hex(const uint8_t *k, char out[2 * KVTIER_KEY_LEN + 1])
{
    for (int i = 0; i < KVTIER_KEY_LEN; i++)
        snprintf(out + 2 * i, 3, "%02x", k[i]);
}

static int s_hash(kvtier_t *c)
{
    static const struct {
        const char *salt;
        const char *keys[2];
    } vec[] = {
        {NULL, {"361d40d624bc45847cb55c04878d9596", "390d55d1f642cbe361c5f27bacda5d77"}},
        {"tenant-a", {"d94d032fdacc9824ff9e899c1d74acfc", "dafdfb4cdf651f440368d67cab9efb68"}},
    };
    int rc = 0;
    uint32_t tokens[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, *many = NULL, nkeys = 0;
    uint8_t local[4][KVTIER_KEY_LEN], remote[4][KVTIER_KEY_LEN], (*lk)[KVTIER_KEY_LEN] = NULL,
                                                                 (*rk)[KVTIER_KEY_LEN] = NULL;
    char hex[2 * KVTIER_KEY_LEN + 1];
    for (size_t v = 0; v < sizeof vec / sizeof vec[0]; v++) {
        /* 8 tokens: two full chunks; 10 tokens: the partial third chunk gets no key */
        for (size_t nt = 8; nt <= 10; nt += 2) {
            S_CHECK(kvtier_hash_tokens_local(tokens, nt, 4, vec[v].salt, local) == 2,
                    "local: not 2 keys");
            S_OK(c, kvtier_hash_tokens(c, tokens, nt, 4, vec[v].salt, remote, &nkeys));
            S_CHECK(nkeys == 2, "daemon: %u keys", nkeys);
            for (int i = 0; i < 2; i++) {
                s_hex(local[i], hex);
                S_CHECK(strcmp(hex, vec[v].keys[i]) == 0, "local key %d (salt %s): %s", i,
                        vec[v].salt ? vec[v].salt : "none", hex);
                s_hex(remote[i], hex);
                S_CHECK(strcmp(hex, vec[v].keys[i]) == 0, "daemon key %d (salt %s): %s", i,
                        vec[v].salt ? vec[v].salt : "none", hex);
            }
        }
    }
    /* "" is no salt, as NULL is */
    S_OK(c, kvtier_hash_tokens(c, tokens, 8, 4, "", remote, &nkeys));
    s_hex(remote[0], hex);
    S_CHECK(nkeys == 2 && strcmp(hex, vec[0].keys[0]) == 0, "salt \"\": %s", hex);
    S_CHECK(kvtier_hash_tokens_local(tokens, 8, 4, "", local) == 2 &&
                memcmp(local, remote, 2 * KVTIER_KEY_LEN) == 0,
            "local salt \"\" differs");
    /* fewer tokens than one chunk: no keys */
    S_OK(c, kvtier_hash_tokens(c, tokens, 3, 4, NULL, remote, &nkeys));
    S_CHECK(nkeys == 0 && kvtier_hash_tokens_local(tokens, 3, 4, NULL, local) == 0, "3 tokens");
    /* chunk_tokens 0: the daemon's, from HELLO */
    uint32_t ct = kvtier_info(c)->chunk_tokens;
    size_t nt = (size_t)ct * 3 + 5;
    many = malloc(nt * sizeof *many);
    lk = malloc(3 * KVTIER_KEY_LEN);
    rk = malloc(3 * KVTIER_KEY_LEN);
    S_CHECK(ct && many && lk && rk, "chunk_tokens %u / out of memory", ct);
    for (size_t i = 0; i < nt; i++)
        many[i] = s_token(i);
    S_OK(c, kvtier_hash_tokens(c, many, nt, 0, "tenant-a", rk, &nkeys));
    S_CHECK(nkeys == 3, "daemon default chunk: %u keys", nkeys);
    S_CHECK(kvtier_hash_tokens_local(many, nt, ct, "tenant-a", lk) == 3 &&
                memcmp(lk, rk, 3 * KVTIER_KEY_LEN) == 0,
            "local and daemon keys differ at chunk_tokens %u", ct);
    S_CHECK(kvtier_hash_tokens_local(many, nt, 0, NULL, lk) == 0, "local chunk_tokens 0");
    printf("hash: local == daemon == documented vectors\n");
out:
    free(many);
    free(lk);
    free(rk);
    return rc;
}

/* ---- error paths ---- */

static int s_errors(kvtier_t *c)
{
    int rc = 0;
    uint8_t keys[2][KVTIER_KEY_LEN] = {{1}, {2}};
    kvtier_slot_t slots[2];
    kvtier_buf_t out[2];
    uint64_t lease = 0, sizes[2] = {4096, 0};
    uint32_t n = 0, hits = 0, tk[8] = {0};
    size_t lens[2] = {1, 1};
    const void *data[2] = {"a", NULL};
    char longns[300], err[256] = "";
    memset(longns, 'n', sizeof longns - 1);
    longns[sizeof longns - 1] = '\0';
    const uint64_t bogus = 0x7ead5eedull;

    /* the public codes name the daemon's, instance_dropped included */
    S_CHECK(KVTIER_ENOINST == KVT_ENOINST && KVTIER_EINVAL == KVT_EINVAL, "codes differ");
    S_CHECK(!strcmp(kvtier_error_code(KVTIER_ENOINST), "instance_dropped"), "%s",
            kvtier_error_code(KVTIER_ENOINST));
    S_CHECK(strcmp(kvtier_strerror(KVTIER_ENOINST), kvtier_strerror(-99)) != 0, "%s",
            kvtier_strerror(KVTIER_ENOINST));
    S_FAILS(c, KVT_EUNKLEASE, kvtier_release(c, bogus));
    S_FAILS(c, KVT_EUNKLEASE, kvtier_commit(c, bogus, NULL, 0, NULL));
    S_OK(c, kvtier_ping(c));
    S_CHECK(kvtier_last_error(c)[0] == '\0', "last_error after a success: %s",
            kvtier_last_error(c));

    S_FAILS(c, KVT_EINVAL,
            kvtier_lookup(c, NULL, NULL, (s_keys_t)keys, 2, 0, &hits, NULL, NULL, NULL));
    S_FAILS(c, KVT_EINVAL,
            kvtier_lookup(c, longns, NULL, (s_keys_t)keys, 2, 0, &hits, NULL, NULL, NULL));
    S_FAILS(c, KVT_EINVAL,
            kvtier_lookup(c, S_NS, longns, (s_keys_t)keys, 2, 0, &hits, NULL, NULL, NULL));
    S_FAILS(c, KVT_EINVAL, kvtier_lookup(c, S_NS, NULL, NULL, 2, 0, &hits, NULL, NULL, NULL));
    S_FAILS(c, KVT_EINVAL,
            kvtier_lookup(c, S_NS, NULL, (s_keys_t)keys, 2, 0, NULL, NULL, NULL, NULL));
    S_FAILS(c, KVT_EINVAL,
            kvtier_lookup(c, S_NS, NULL, (s_keys_t)keys, 2, 0x80, &hits, NULL, NULL, NULL));
    S_FAILS(c, KVT_EINVAL,
            kvtier_lookup(c, S_NS, NULL, (s_keys_t)keys, 2, KVTIER_LOCK, &hits, NULL, NULL, NULL));
    S_FAILS(c, KVT_EINVAL,
            kvtier_reserve(c, S_NS, NULL, (s_keys_t)keys, 2, NULL, 0, slots, &n, &lease));
    S_FAILS(c, KVT_EINVAL,
            kvtier_reserve(c, S_NS, NULL, (s_keys_t)keys, 2, sizes, 0, slots, &n, &lease));
    S_FAILS(c, KVT_EINVAL,
            kvtier_reserve(c, S_NS, NULL, (s_keys_t)keys, 2, NULL, 4096, NULL, &n, &lease));
    S_FAILS(c, KVT_EINVAL,
            kvtier_reserve(c, "", NULL, (s_keys_t)keys, 2, NULL, 4096, slots, &n, &lease));
    S_FAILS(c, KVT_EINVAL, kvtier_commit(c, bogus, NULL, 1, NULL));
    S_FAILS(c, KVT_EINVAL, kvtier_acquire(c, S_NS, NULL, NULL, 2, slots, &n, &lease));
    S_FAILS(c, KVT_EINVAL, kvtier_acquire(c, S_NS, NULL, (s_keys_t)keys, 2, slots, NULL, &lease));
    S_FAILS(c, KVT_EINVAL, kvtier_put(c, S_NS, NULL, (s_keys_t)keys, 2, data, NULL, NULL));
    S_FAILS(c, KVT_EINVAL, kvtier_put(c, S_NS, NULL, (s_keys_t)keys, 2, NULL, lens, NULL));
    S_FAILS(c, KVT_EINVAL, kvtier_put(c, S_NS, NULL, (s_keys_t)keys, 2, data, lens, NULL));
    S_FAILS(c, KVT_EINVAL, kvtier_put(c, NULL, NULL, (s_keys_t)keys, 1, data, lens, NULL));
    S_FAILS(c, KVT_EINVAL, kvtier_get(c, S_NS, NULL, (s_keys_t)keys, 2, NULL, &n));
    S_FAILS(c, KVT_EINVAL, kvtier_get(c, S_NS, NULL, (s_keys_t)keys, 2, out, NULL));
    S_FAILS(c, KVT_EINVAL, kvtier_get_frames(c, S_NS, NULL, (s_keys_t)keys, 2, out, &n, NULL));
    S_FAILS(c, KVT_EINVAL, kvtier_remove(c, S_NS, NULL, NULL, 2, NULL));
    S_FAILS(c, KVT_EINVAL, kvtier_clear(c, "", NULL));
    S_FAILS(c, KVT_EINVAL, kvtier_hash_tokens(c, NULL, 8, 4, NULL, keys, &n));
    S_FAILS(c, KVT_EINVAL, kvtier_hash_tokens(c, tk, 8, 4, NULL, keys, NULL));
    S_FAILS(c, KVT_EINVAL, kvtier_hash_tokens(c, tk, 8, 4, NULL, NULL, &n));
    S_FAILS(c, KVT_EINVAL, kvtier_stats(c, NULL));
    S_CHECK(kvtier_ping(NULL) == KVT_EINVAL && kvtier_release(NULL, 1) == KVT_EINVAL,
            "NULL handle");
    S_CHECK(kvtier_last_error(NULL) != NULL, "last_error(NULL)");
    S_CHECK(kvtier_hash_tokens_local(NULL, 8, 4, NULL, keys) == 0, "local hash of NULL");
    /* the connection is still good after all that */
    S_OK(c, kvtier_ping(c));

    /* a daemon that is not there: connect fails in bounded time, with a sentence */
    kvtier_t *none = kvtier_connect("ipc:///nonexistent/kvtier-test.sock", "c-client-test", NULL,
                                    300, err, sizeof err);
    S_CHECK(none == NULL && err[0], "connect to nowhere: %p '%s'", (void *)none, err);
    err[0] = '\0';
    none = kvtier_connect("bogus://endpoint", "c-client-test", NULL, 300, err, sizeof err);
    S_CHECK(none == NULL && err[0], "connect to a bogus endpoint: '%s'", err);
    kvtier_close(&none); /* accepts NULL */
    printf("errors: ok\n");
out:
    return rc;
}

/* ---- labels: kvtier_reserve_labeled / kvtier_put_labeled (the test reads the events) ---- */

static int s_labels(kvtier_t *c)
{
    int rc = 0;
    uint8_t keys[3][KVTIER_KEY_LEN] = {{0x51}, {0x52}, {0x53}};
    char long_label[KVTIER_MAX_LABEL + 2], max_label[KVTIER_MAX_LABEL + 1];
    memset(long_label, 'y', sizeof long_label - 1);
    long_label[sizeof long_label - 1] = '\0';
    memset(max_label, 'x', sizeof max_label - 1);
    max_label[sizeof max_label - 1] = '\0';
    const void *data[2] = {"embedding-a", "embedding-b"};
    size_t lens[2] = {11, 11};
    uint64_t sizes[1] = {4096}, lease = 0;
    kvtier_slot_t slots[2];
    uint32_t n = 0, stored = 0;
    /* refused before anything is sent: too long, not UTF-8 (a cut sequence, an overlong one) */
    const char *bad[][2] = {{long_label, NULL}, {"ok", "\xff"}, {"\xe6\x97", NULL},
                            {"\xc0\xaf", NULL}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        S_FAILS(c, KVT_EINVAL, kvtier_put_labeled(c, S_NS "-labels", NULL, (s_keys_t)keys, 2,
                                                  bad[i], data, lens, &stored));
        S_CHECK(strstr(kvtier_last_error(c), "labels["), "put: %s", kvtier_last_error(c));
        S_FAILS(c, KVT_EINVAL, kvtier_reserve_labeled(c, S_NS "-labels", NULL, (s_keys_t)keys, 2,
                                                      bad[i], NULL, 4096, slots, &n, &lease));
    }
    /* a label of its own for the first object, none for the second (NULL; "" is none too) */
    const char *labels[2] = {"image-\xe6\x97\xa5\xe6\x9c\xac", NULL};
    S_OK(c, kvtier_put_labeled(c, S_NS "-labels", NULL, (s_keys_t)keys, 2, labels, data, lens,
                               &stored));
    S_CHECK(stored == 2, "stored %u", stored);
    const char *one[1] = {max_label};
    S_OK(c, kvtier_reserve_labeled(c, S_NS "-labels", NULL, (s_keys_t)&keys[2], 1, one, sizes, 0,
                                   slots, &n, &lease));
    S_CHECK(n == 1 && slots[0].ptr, "reserved %u", n);
    memset(slots[0].ptr, 0x5a, slots[0].length);
    S_OK(c, kvtier_commit(c, lease, NULL, 0, &stored));
    S_CHECK(stored == 1, "committed %u", stored);
    printf("labels: ok\n");
out:
    return rc;
}

/* ---- prefetch ---- */

static int s_prefetch(kvtier_t *c)
{
    int rc = 0, done = 0;
    uint8_t keys[1][KVTIER_KEY_LEN] = {{0x42}};
    const void *data[1] = {"prefetched"};
    size_t lens[1] = {10};
    uint32_t stored = 0, hits = 0, loaded = 0, phits = 0;
    uint64_t job = 0;
    S_OK(c, kvtier_put(c, S_NS "-prefetch", NULL, (s_keys_t)keys, 1, data, lens, &stored));
    S_OK(c, kvtier_lookup(c, S_NS "-prefetch", NULL, (s_keys_t)keys, 1, KVTIER_PREFETCH, &hits,
                          NULL, NULL, &job));
    S_CHECK(hits == 1, "hits %u", hits);
    if (job) {
        struct timespec t0, now, nap = {0, 10 * 1000 * 1000};
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (;;) {
            S_OK(c, kvtier_prefetch_status(c, job, &done, &loaded, &phits));
            clock_gettime(CLOCK_MONOTONIC, &now);
            if (done || now.tv_sec - t0.tv_sec > 10)
                break;
            nanosleep(&nap, NULL);
        }
        S_CHECK(done, "prefetch job %llu not done within 10 s", (unsigned long long)job);
    }
    printf("prefetch: job %llu done %d loaded %u hits %u\n", (unsigned long long)job, done, loaded,
           phits);
    S_FAILS(c, KVT_ENOTFOUND, kvtier_prefetch_status(c, 0x7fffffffffffull, &done, NULL, NULL));
    S_OK(c, kvtier_clear(c, S_NS "-prefetch", NULL));
out:
    return rc;
}

/* ---- a client that cannot map the arena ---- */

static int s_remote(kvtier_t *c)
{
    int rc = 0;
    uint8_t keys[1][KVTIER_KEY_LEN] = {{0x7e}};
    kvtier_slot_t slots[1];
    kvtier_buf_t out[1] = {{0}};
    uint64_t lease = 0;
    uint32_t n = 0, stored = 0, found = 0;
    size_t size = 1, lens[1] = {4097};
    uint8_t *data = malloc(lens[0]);
    S_CHECK(data, "out of memory");
    s_fill_random(data, lens[0], 7);
    S_CHECK(kvtier_arena(c, &size) == NULL && size == 0, "the arena was mapped");
    S_FAILS(
        c, KVT_EUNAVAIL,
        kvtier_reserve(c, S_NS "-remote", NULL, (s_keys_t)keys, 1, NULL, 4096, slots, &n, &lease));
    S_CHECK(strstr(kvtier_last_error(c), "arena"), "unclear message: %s", kvtier_last_error(c));
    S_FAILS(c, KVT_EUNAVAIL,
            kvtier_acquire(c, S_NS "-remote", NULL, (s_keys_t)keys, 1, slots, &n, &lease));
    const void *ptrs[1] = {data};
    S_OK(c, kvtier_put(c, S_NS "-remote", NULL, (s_keys_t)keys, 1, ptrs, lens, &stored));
    S_CHECK(stored == 1, "stored %u", stored);
    S_OK(c, kvtier_get(c, S_NS "-remote", NULL, (s_keys_t)keys, 1, out, &found));
    S_CHECK(found == 1 && out[0].len == lens[0] && !memcmp(out[0].data, data, lens[0]),
            "get found %u", found);
    S_OK(c, kvtier_clear(c, S_NS "-remote", NULL));
    printf("remote: no arena, put/get work\n");
out:
    free(out[0].data);
    free(data);
    return rc;
}

/* The GPU calls on a machine without a CUDA device: validated, then `unavailable`. */
static int s_gpu_none(kvtier_t *c)
{
    int rc = 0;
    uint8_t handles[2][KVTIER_IPC_HANDLE_LEN], keys[1][KVTIER_KEY_LEN] = {{9}};
    memset(handles, 0x5a, sizeof handles);
    uint64_t ids[2] = {0, 1};
    uint32_t n = 7;
    kvtier_gpu_layout_t lay = {.device = 0, .layers = 2, .num_blocks = 16, .block_tokens = 16,
                               .token_bytes = 512, .dtype = "float16",
                               .handles = (const uint8_t(*)[KVTIER_IPC_HANDLE_LEN])handles};
    S_FAILS(c, KVT_EINVAL, kvtier_register_gpu(c, NULL));
    S_FAILS(c, KVT_EUNAVAIL, kvtier_register_gpu(c, &lay));
    S_CHECK(strncmp(kvtier_last_error(c), "no CUDA device: ", 16) == 0, "%s",
            kvtier_last_error(c));
    lay.dtype = "float64";
    S_FAILS(c, KVT_EBADREQ, kvtier_register_gpu(c, &lay));
    S_FAILS(c, KVT_EUNAVAIL, kvtier_store_gpu(c, S_NS, NULL, 0, keys, 1, ids, 2, NULL, &n));
    S_CHECK(n == 0, "stored %u", n);
    S_FAILS(c, KVT_EUNAVAIL,
            kvtier_retrieve_gpu(c, S_NS, "salt", 0, keys, 1, ids, 2, handles[0], &n));
    S_FAILS(c, KVT_EBADREQ, kvtier_retrieve_gpu(c, S_NS, NULL, 0, keys, 1, ids, 0, NULL, &n));
    S_FAILS(c, KVT_EINVAL, kvtier_store_gpu(c, S_NS, NULL, 0, keys, 1, NULL, 2, NULL, &n));
    S_FAILS(c, KVT_ENOTFOUND, kvtier_unregister_gpu(c, 0));
    S_OK(c, kvtier_ping(c));
    printf("gpu-none: ok\n");
out:
    return rc;
}

/* ---- liveness: the heartbeat, re-establishment, close and fork ---- */

static const char *s_endpoint; /* argv[1], for the scenarios that connect themselves */

/* Waits for the test driver: "pause: WHAT" on stdout, then one line on stdin (at once when
 * stdin is /dev/null). */
static void s_pause(const char *what)
{
    printf("pause: %s\n", what);
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin))
        return;
}

/* Threads of this process whose name starts with `name` (/proc/self/task/N/comm); every
 * thread for NULL. */
static int s_threads(const char *name)
{
    DIR *d = opendir("/proc/self/task");
    if (!d)
        return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.')
            continue;
        char path[300], comm[32] = "";
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
        FILE *f = name ? fopen(path, "r") : NULL;
        if (f && fgets(comm, sizeof comm, f))
            comm[strcspn(comm, "\n")] = '\0';
        if (f)
            fclose(f);
        n += !name || !strncmp(comm, name, strlen(name));
    }
    closedir(d);
    return n;
}

static uint64_t s_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void s_sleep_ms(uint64_t ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0)
        ;
}

/* RESERVE one 4 KiB object under `key`, fill it, COMMIT, then ACQUIRE it and check the bytes. */
static int s_roundtrip(kvtier_t *c, uint8_t key, uint8_t fill)
{
    int rc = 0;
    uint8_t keys[1][KVTIER_KEY_LEN] = {{0x11, key}};
    kvtier_slot_t slot;
    uint32_t n = 0, stored = 0;
    uint64_t lease = 0;
    S_OK(c,
         kvtier_reserve(c, S_NS "-live", NULL, (s_keys_t)keys, 1, NULL, 4096, &slot, &n, &lease));
    S_CHECK(n == 1 && slot.ptr && lease, "reserve: %u slots, lease %llu", n,
            (unsigned long long)lease);
    memset(slot.ptr, fill, slot.length);
    S_OK(c, kvtier_commit(c, lease, NULL, 0, &stored));
    S_CHECK(stored == 1, "stored %u", stored);
    S_OK(c, kvtier_acquire(c, S_NS "-live", NULL, (s_keys_t)keys, 1, &slot, &n, &lease));
    S_CHECK(n == 1 && ((const uint8_t *)slot.ptr)[0] == fill &&
                ((const uint8_t *)slot.ptr)[4095] == fill,
            "acquire: %u slots or other bytes", n);
    S_OK(c, kvtier_release(c, lease));
out:
    return rc;
}

static int s_idle(kvtier_t *c)
{
    int rc = 0;
    uint32_t lease_ms = kvtier_info(c)->lease_ms, n = 0, stored = 0;
    uint8_t keys[1][KVTIER_KEY_LEN] = {{0x1d}};
    kvtier_slot_t slot;
    uint64_t lease = 0;
    S_CHECK(s_threads("kvtier-hb") == 1, "%d heartbeat threads", s_threads("kvtier-hb"));
    S_OK(c,
         kvtier_reserve(c, S_NS "-live", NULL, (s_keys_t)keys, 1, NULL, 4096, &slot, &n, &lease));
    S_CHECK(n == 1 && slot.ptr && lease, "reserve: %u slots", n);
    memset(slot.ptr, 0x1d, slot.length);
    s_sleep_ms(3u * lease_ms);
    S_OK(c, kvtier_commit(c, lease, NULL, 0, &stored)); /* the write lease outlived the idle */
    S_CHECK(stored == 1, "stored %u", stored);
    S_CHECK(s_roundtrip(c, 2, 0x2e) == 0, "a store after the idle time");
    printf("idle: %u ms without a call, instance and lease kept\n", 3u * lease_ms);
out:
    return rc;
}

/* The mock CUDA runtime's layout of tests/gpu/mock_cudart.c: one layer in KVT_TEST_GPU_FILE
 * (the IPC handle is "KVTMOCK\0" + its path), 16 blocks of 4 tokens x 256 bytes. */
static void s_mock_layout(const char *file, uint8_t handle[KVTIER_IPC_HANDLE_LEN],
                          kvtier_gpu_layout_t *lay)
{
    memset(handle, 0, KVTIER_IPC_HANDLE_LEN);
    memcpy(handle, "KVTMOCK", 8);
    snprintf((char *)handle + 8, KVTIER_IPC_HANDLE_LEN - 8, "%s", file);
    *lay = (kvtier_gpu_layout_t){.device = 0,
                                 .layers = 1,
                                 .num_blocks = 16,
                                 .block_tokens = 4,
                                 .token_bytes = 256,
                                 .dtype = "float16",
                                 .handles = (const uint8_t(*)[KVTIER_IPC_HANDLE_LEN])handle};
}

static int s_no_heartbeat(kvtier_t *c)
{
    int rc = 0;
    const char *gpu = getenv("KVT_TEST_GPU_FILE");
    uint8_t handle[KVTIER_IPC_HANDLE_LEN], keys[1][KVTIER_KEY_LEN] = {{0x0d}};
    kvtier_gpu_layout_t lay;
    kvtier_slot_t slot;
    uint32_t n = 0, stored = 0;
    uint64_t lease = 0, ids[2] = {3, 4};
    S_CHECK(s_threads("kvtier-hb") == 0, "KVTIER_HEARTBEAT_MS=0, yet %d heartbeat threads",
            s_threads("kvtier-hb"));
    if (gpu) {
        s_mock_layout(gpu, handle, &lay);
        S_OK(c, kvtier_register_gpu(c, &lay));
    }
    S_OK(c,
         kvtier_reserve(c, S_NS "-live", NULL, (s_keys_t)keys, 1, NULL, 4096, &slot, &n, &lease));
    S_CHECK(n == 1 && lease, "reserve: %u slots", n);
    s_pause("dropped");
    /* not retried: the lease died with the instance */
    S_FAILS(c, KVT_ELEXPIRED, kvtier_commit(c, lease, NULL, 0, &stored));
    /* RESERVE answers instance_dropped: HELLO again (GPU layout included), then retried */
    S_CHECK(s_roundtrip(c, 3, 0x3f) == 0, "a store after the drop");
    if (gpu) {
        s_pause("reregistered");
        S_OK(c, kvtier_store_gpu(c, S_NS "-live-gpu", NULL, 0, (s_keys_t)keys, 1, ids, 2, NULL,
                                 &stored));
        S_CHECK(stored == 1, "store_gpu stored %u", stored);
        S_OK(c, kvtier_unregister_gpu(c, 0));
    }
    printf("no-heartbeat: dropped, re-established%s\n", gpu ? " with the GPU layout" : "");
out:
    return rc;
}

static int s_restart(kvtier_t *c)
{
    int rc = 0;
    size_t before = 0, after = 0;
    uint8_t keys[1][KVTIER_KEY_LEN] = {{0x11, 5}};
    uint32_t hits = 9;
    S_CHECK(kvtier_arena(c, &before) && before, "no arena");
    S_CHECK(s_roundtrip(c, 5, 0x55) == 0, "a store before the restart");
    s_pause("restart");
    S_CHECK(s_roundtrip(c, 6, 0x66) == 0, "a store in the restarted daemon");
    S_CHECK(kvtier_arena(c, &after) && after != before,
            "the arena is still the old one (%zu bytes)", after);
    S_OK(c, kvtier_lookup(c, S_NS "-live", NULL, (s_keys_t)keys, 1, 0, &hits, NULL, NULL, NULL));
    S_CHECK(hits == 0, "the new daemon has the old daemon's object");
    printf("restart: arena of %zu bytes, then %zu bytes\n", before, after);
    s_pause("after");
out:
    return rc;
}

static int s_adopt(kvtier_t *c)
{
    int rc = 0;
    size_t before = 0, after = 0;
    uint8_t keys[1][KVTIER_KEY_LEN] = {{0x11, 7}};
    kvtier_slot_t slot;
    uint32_t n = 0;
    uint64_t lease = 0;
    void *base = kvtier_arena(c, &before);
    S_CHECK(base && before, "no arena");
    S_CHECK(s_roundtrip(c, 7, 0x77) == 0, "a store before the restart");
    s_pause("restart");
    S_OK(c, kvtier_acquire(c, S_NS "-live", NULL, (s_keys_t)keys, 1, &slot, &n, &lease));
    S_CHECK(n == 1 && slot.length == 4096, "the object of before the restart: %u slots", n);
    for (size_t i = 0; i < slot.length; i++)
        S_CHECK(((const uint8_t *)slot.ptr)[i] == 0x77, "byte %zu differs after the restart", i);
    S_OK(c, kvtier_release(c, lease));
    S_CHECK(kvtier_arena(c, &after) == base && after == before,
            "the arena was mapped again (%p, %zu bytes; was %p, %zu)", kvtier_arena(c, &after),
            after, base, before);
    S_CHECK(s_roundtrip(c, 8, 0x88) == 0, "a store in the restarted daemon");
    printf("adopt: the object of before read back, the arena of %zu bytes kept\n", after);
    s_pause("after");
out:
    return rc;
}

static int s_close(kvtier_t *unused)
{
    (void)unused;
    int rc = 0;
    char err[256] = "";
    kvtier_t *c = NULL, *quiet = NULL;
    c = kvtier_connect(s_endpoint, "c-client-test", getenv("KVT_TEST_INSTANCE"), 300, err,
                       sizeof err);
    S_CHECK(c, "connect: %s", err);
    S_CHECK(s_threads("kvtier-hb") == 1 && s_threads("ZMQbg") > 0, "%d heartbeat threads",
            s_threads("kvtier-hb"));
    setenv("KVTIER_HEARTBEAT_MS", "0", 1);
    quiet = kvtier_connect(s_endpoint, "c-client-test", NULL, 300, err, sizeof err);
    unsetenv("KVTIER_HEARTBEAT_MS");
    S_CHECK(quiet, "connect: %s", err);
    S_CHECK(s_threads("kvtier-hb") == 1, "KVTIER_HEARTBEAT_MS=0 started a heartbeat");
    kvtier_close(&quiet);
    s_pause("joined");
    uint64_t t0 = s_now_ms();
    kvtier_close(&c);
    uint64_t took = s_now_ms() - t0;
    S_CHECK(took < 300 + 300, "kvtier_close took %llu ms without a daemon",
            (unsigned long long)took);
    /* the heartbeat's, and libzmq's (ZMQbg/IO/N, ZMQbg/Reaper: the context ends with the last
     * handle). A joined thread can stay listed in /proc/self/task for a moment after
     * pthread_join returns (the kernel wakes the joiner before it has released the task):
     * allowed up to 1 s to leave the list. */
    for (int i = 0; i < 100 && (s_threads("kvtier-hb") || s_threads("ZMQbg")); i++)
        usleep(10000);
    S_CHECK(s_threads("kvtier-hb") == 0 && s_threads("ZMQbg") == 0,
            "threads left after the last close: %d kvtier-hb, %d ZMQbg", s_threads("kvtier-hb"),
            s_threads("ZMQbg"));
    printf("close: %llu ms without a daemon, no thread left\n", (unsigned long long)took);
out:
    kvtier_close(&quiet);
    kvtier_close(&c);
    return rc;
}

static int s_fork(kvtier_t *c)
{
    int rc = 0, status = 0;
    uint8_t keys[1][KVTIER_KEY_LEN] = {{0xf0}};
    kvtier_slot_t slot;
    uint32_t n = 0, stored = 0;
    uint64_t lease = 0;
    S_OK(c,
         kvtier_reserve(c, S_NS "-live", NULL, (s_keys_t)keys, 1, NULL, 4096, &slot, &n, &lease));
    S_CHECK(n == 1 && lease, "reserve: %u slots", n);
    fflush(NULL);
    pid_t pid = fork();
    S_CHECK(pid >= 0, "fork failed");
    if (pid == 0) {
        /* the copy of the parent's handle: freed at once, without a word to the daemon */
        uint64_t t0 = s_now_ms();
        kvtier_close(&c);
        uint64_t took = s_now_ms() - t0;
        char err[256] = "";
        kvtier_t *own = kvtier_connect(s_endpoint, "c-fork-child", NULL, 2000, err, sizeof err);
        int ok = took < 1000 && own && kvtier_ping(own) == 0;
        if (!ok)
            fprintf(stderr, "fork child: close took %llu ms; own connection: %s\n",
                    (unsigned long long)took, own ? kvtier_last_error(own) : err);
        kvtier_close(&own);
        _exit(ok ? 0 : 3);
    }
    S_CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
            "the child failed (status 0x%x)", status);
    memset(slot.ptr, 0xf0, slot.length);
    S_OK(c, kvtier_commit(c, lease, NULL, 0, &stored)); /* the parent's instance lives on */
    S_CHECK(stored == 1, "stored %u", stored);
    printf("fork: the child closed its copy and connected; the parent's lease is intact\n");
out:
    return rc;
}

/* Megabyte objects written through the arena (RESERVE, the pointer, COMMIT) come back byte
 * for byte through GET (the daemon reads the arena) and ACQUIRE (this mapping), whatever page
 * size the arena has and however KVTIER_MAP_POPULATE faults it in. */
static int s_arena(kvtier_t *c)
{
    enum { N = 6, LEN = (1u << 20) + 4096 * 3 + 17 }; /* objects that straddle 2 MiB pages */
    int rc = 0;
    uint8_t keys[N][KVTIER_KEY_LEN];
    kvtier_slot_t slots[N];
    kvtier_buf_t out[N];
    memset(out, 0, sizeof out);
    uint32_t n = 0, stored = 0, found = 0;
    uint64_t lease = 0, cleared = 0;
    S_OK(c, kvtier_clear(c, S_NS "-arena", &cleared)); /* run again on one daemon: fresh keys */
    for (uint32_t i = 0; i < N; i++) {
        memset(keys[i], 0, KVTIER_KEY_LEN);
        keys[i][0] = 0xa7;
        keys[i][1] = (uint8_t)i;
    }
    S_OK(c, kvtier_reserve(c, S_NS "-arena", NULL, (s_keys_t)keys, N, NULL, LEN, slots, &n,
                           &lease));
    S_CHECK(n == N, "reserve: %u slots", n);
    for (uint32_t i = 0; i < N; i++)
        S_CHECK(slots[i].ptr != NULL, "slot %u: already stored", i);
    for (uint32_t i = 0; i < N; i++)
        for (size_t b = 0; b < LEN; b++)
            ((uint8_t *)slots[i].ptr)[b] = (uint8_t)(b * 31u + i * 7u + (b >> 12));
    S_OK(c, kvtier_commit(c, lease, NULL, 0, &stored));
    S_CHECK(stored == N, "stored %u", stored);
    S_OK(c, kvtier_get(c, S_NS "-arena", NULL, (s_keys_t)keys, N, out, &found));
    S_CHECK(found == N, "get found %u", found);
    for (uint32_t i = 0; i < N; i++) {
        S_CHECK(out[i].len == LEN, "object %u: %zu bytes", i, out[i].len);
        for (size_t b = 0; b < LEN; b++)
            S_CHECK(((const uint8_t *)out[i].data)[b] == (uint8_t)(b * 31u + i * 7u + (b >> 12)),
                    "object %u byte %zu differs", i, b);
    }
    S_OK(c, kvtier_acquire(c, S_NS "-arena", NULL, (s_keys_t)keys, N, slots, &n, &lease));
    S_CHECK(n == N, "acquire: %u slots", n);
    for (uint32_t i = 0; i < N; i++)
        S_CHECK(slots[i].length == LEN && memcmp(slots[i].ptr, out[i].data, LEN) == 0,
                "acquired object %u differs", i);
    S_OK(c, kvtier_release(c, lease));
    printf("arena: %d objects of %d bytes round-tripped (KVTIER_MAP_POPULATE=%s)\n", N, LEN,
           getenv("KVTIER_MAP_POPULATE") ? getenv("KVTIER_MAP_POPULATE") : "");
out:
    s_free_bufs(out, N);
    return rc;
}

/* ---- the fast path ---- */

static int s_fastpath_want(void)
{
    const char *v = getenv("KVT_TEST_FASTPATH");
    return v && !strcmp(v, "0") ? 0 : 1;
}

static uint8_t s_fp_byte(uint32_t i, uint64_t j)
{
    return (uint8_t)(i * 71u + j * 7u + (j >> 10) + 3u);
}

/* RESERVE/COMMIT/LOOKUP/ACQUIRE/RELEASE of odd-sized objects, bytes checked through ACQUIRE and
 * GET, release_async ordered before the next call on either transport; the pair (or its
 * absence) is what KVT_TEST_FASTPATH says all along. */
static int s_fastpath(kvtier_t *c)
{
    enum { N = 8, BIG = 6000 }; /* BIG keys: a LOOKUP of ~108 KB, more than a 64 KiB ring record */
    int rc = 0, want = s_fastpath_want();
    uint8_t keys[N][KVTIER_KEY_LEN], (*big)[KVTIER_KEY_LEN] = NULL;
    uint64_t sizes[N], lease = 0, cleared = 0;
    kvtier_slot_t slots[N];
    kvtier_buf_t out[N];
    memset(out, 0, sizeof out);
    uint32_t n = 0, stored = 0, hits = 0, l1 = 0, found = 0;
    S_CHECK(kvtier_fastpath_active(c) == want, "fastpath active %d after connect, want %d",
            kvtier_fastpath_active(c), want);
    S_OK(c, kvtier_clear(c, S_NS "-fp", &cleared));
    for (uint32_t i = 0; i < N; i++) {
        memset(keys[i], 0, KVTIER_KEY_LEN);
        keys[i][0] = 0xfa;
        keys[i][1] = (uint8_t)i;
        sizes[i] = 4096u * (i + 1) + 123u * i + 1;
    }
    S_OK(c, kvtier_reserve(c, S_NS "-fp", NULL, (s_keys_t)keys, N, sizes, 0, slots, &n, &lease));
    S_CHECK(n == N && lease, "reserve: %u slots, lease %llu", n, (unsigned long long)lease);
    for (uint32_t i = 0; i < N; i++) {
        S_CHECK(slots[i].ptr && slots[i].length == sizes[i], "slot %u", i);
        for (uint64_t j = 0; j < sizes[i]; j++)
            ((uint8_t *)slots[i].ptr)[j] = s_fp_byte(i, j);
    }
    S_OK(c, kvtier_commit(c, lease, NULL, 0, &stored));
    S_CHECK(stored == N, "stored %u", stored);
    S_OK(c, kvtier_lookup(c, S_NS "-fp", NULL, (s_keys_t)keys, N, 0, &hits, &l1, NULL, NULL));
    S_CHECK(hits == N && l1 == N, "lookup: hits %u l1 %u", hits, l1);
    /* the residency map came with the pair (and only with it): the same answer, no request */
    uint32_t rl1 = 99;
    if (want) {
        S_OK(c, kvtier_resident(c, S_NS "-fp", NULL, (s_keys_t)keys, N, &rl1));
        S_CHECK(rl1 == N, "resident: %u of %u", rl1, N);
        S_OK(c, kvtier_resident(c, S_NS "-fp", "salted", (s_keys_t)keys, N, &rl1));
        S_CHECK(rl1 == 0, "resident with another salt: %u", rl1);
    } else {
        S_FAILS(c, KVT_EUNAVAIL, kvtier_resident(c, S_NS "-fp", NULL, (s_keys_t)keys, N, &rl1));
    }
    S_OK(c, kvtier_acquire(c, S_NS "-fp", NULL, (s_keys_t)keys, N, slots, &n, &lease));
    S_CHECK(n == N && lease, "acquire: %u slots", n);
    for (uint32_t i = 0; i < N; i++) {
        S_CHECK(slots[i].length == sizes[i], "acquired slot %u: %llu bytes", i,
                (unsigned long long)slots[i].length);
        for (uint64_t j = 0; j < sizes[i]; j++)
            S_CHECK(((const uint8_t *)slots[i].ptr)[j] == s_fp_byte(i, j),
                    "object %u byte %llu differs", i, (unsigned long long)j);
    }
    S_OK(c, kvtier_release(c, lease));
    S_FAILS(c, KVT_EUNKLEASE, kvtier_release(c, lease));
    /* release_async, then a call on the same transport and one on the socket (GET) */
    S_OK(c, kvtier_acquire(c, S_NS "-fp", NULL, (s_keys_t)keys, 1, slots, &n, &lease));
    S_CHECK(n == 1 && lease, "acquire of one: %u", n);
    S_OK(c, kvtier_release_async(c, lease));
    S_FAILS(c, KVT_EUNKLEASE, kvtier_release(c, lease));
    S_OK(c, kvtier_acquire(c, S_NS "-fp", NULL, (s_keys_t)keys, 1, slots, &n, &lease));
    S_OK(c, kvtier_release_async(c, lease));
    S_OK(c, kvtier_get(c, S_NS "-fp", NULL, (s_keys_t)keys, N, out, &found));
    S_CHECK(found == N, "get found %u", found);
    for (uint32_t i = 0; i < N; i++) {
        S_CHECK(out[i].len == sizes[i], "get object %u: %zu bytes", i, out[i].len);
        for (uint64_t j = 0; j < sizes[i]; j++)
            S_CHECK(((const uint8_t *)out[i].data)[j] == s_fp_byte(i, j),
                    "get object %u byte %llu differs", i, (unsigned long long)j);
    }
    S_FAILS(c, KVT_EUNKLEASE, kvtier_release(c, lease));
    /* a request too big for a ring record goes over the socket, the pair stays */
    big = calloc(BIG, sizeof *big);
    S_CHECK(big, "out of memory");
    memcpy(big, keys, sizeof keys);
    S_OK(c, kvtier_lookup(c, S_NS "-fp", NULL, (s_keys_t)big, BIG, 0, &hits, NULL, NULL, NULL));
    S_CHECK(hits == N, "big lookup: hits %u", hits);
    S_OK(c, kvtier_ping(c));
    S_CHECK(kvtier_fastpath_active(c) == want, "fastpath active %d at the end, want %d",
            kvtier_fastpath_active(c), want);
    S_OK(c, kvtier_clear(c, S_NS "-fp", &cleared));
    S_CHECK(cleared == N, "clear removed %llu", (unsigned long long)cleared);
    if (want) {
        S_OK(c, kvtier_resident(c, S_NS "-fp", NULL, (s_keys_t)keys, N, &rl1));
        S_CHECK(rl1 == 0, "resident after clear: %u", rl1);
    }
    printf("fastpath: active %d, %d objects round-tripped\n", want, N);
out:
    free(big);
    s_free_bufs(out, N);
    return rc;
}

/* The instance dropped (KVTIER_HEARTBEAT_MS=0, idle past lease_ms): the daemon closed the pair
 * with it; the next call finds it closed, goes over the socket, says HELLO again (which asks
 * again) and is retried; from then on the new pair serves. */
static int s_fastpath_redo(kvtier_t *c)
{
    int rc = 0;
    uint32_t hits = 0;
    uint8_t keys[1][KVTIER_KEY_LEN] = {{0x11, 0x51}};
    S_CHECK(kvtier_fastpath_active(c) == 1, "no pair after connect");
    S_CHECK(s_roundtrip(c, 0x51, 0x5a) == 0, "round trip before the drop");
    s_pause("idle");
    /* a LOOKUP needs no instance: it goes over the socket (the pair is closed) and is answered */
    S_OK(c, kvtier_lookup(c, S_NS "-live", NULL, (s_keys_t)keys, 1, 0, &hits, NULL, NULL, NULL));
    S_CHECK(kvtier_fastpath_active(c) == 0, "the closed pair is still attached");
    /* RESERVE answers instance_dropped: HELLO again, which asks again, and the retry */
    S_CHECK(s_roundtrip(c, 0x52, 0xa5) == 0, "round trip after the drop");
    S_CHECK(kvtier_fastpath_active(c) == 1, "no new pair after the re-HELLO");
    S_CHECK(kvtier_fastpath_active(c) == 1, "the new pair was dropped");
    printf("fastpath-redo: a new pair after the drop (hits %u)\n", hits);
out:
    return rc;
}

/* Against the fake daemon of test_c_client.py (its ring requests answered by Python through
 * libkvtier's kvtier_ring_*); the driver checks what the fake saw. Own connection: a short
 * timeout, no heartbeat (the driver sets KVTIER_HEARTBEAT_MS=0). */
static int s_fastpath_fake(kvtier_t *unused)
{
    (void)unused;
    int rc = 0, want = s_fastpath_want(), status = 0;
    char err[256] = "", *json = NULL;
    void *reply = NULL;
    size_t reply_len = 0;
    static uint8_t pad[8192];
    kvtier_t *c = kvtier_connect(s_endpoint, "c-fastpath-fake", "c-fake", 700, err, sizeof err);
    S_CHECK(c, "connect: %s", err);
    S_CHECK(kvtier_fastpath_active(c) == want, "fastpath active %d, want %d",
            kvtier_fastpath_active(c), want);
    S_OK(c, kvtier_ping(c));
    S_OK(c, kvtier_stats(c, &json));
    free(json);
    json = NULL;
    S_OK(c, kvtier_release_async(c, 101));
    if (!want) {
        S_OK(c, kvtier_ping(c));
        printf("fastpath-fake: socket only\n");
        goto out;
    }
    /* a body bigger than a record goes over the socket, after the RELEASE posted on the ring
     * (the fake answers that one late) was answered */
    {
        /* {"pad": bin 8000}: a STATS body the fake does not read */
        pad[0] = 0x81;
        pad[1] = 0xa3;
        memcpy(pad + 2, "pad", 3);
        pad[5] = 0xc5;
        pad[6] = 8000 >> 8;
        pad[7] = 8000 & 0xff;
        S_OK(c, kvtier_call(c, 14, pad, 8 + 8000, &reply, &reply_len));
        free(reply);
        reply = NULL;
    }
    S_CHECK(kvtier_fastpath_active(c) == 1, "the pair went with the big request");
    /* a forked child never uses nor closes the parent's pair */
    fflush(NULL);
    pid_t pid = fork();
    S_CHECK(pid >= 0, "fork failed");
    if (pid == 0) {
        int active = kvtier_fastpath_active(c);
        kvtier_close(&c);
        _exit(active == 0 ? 0 : 3);
    }
    S_CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
            "the child saw the pair (status 0x%x)", status);
    s_pause("fork"); /* the driver checks that the pair is not closed */
    S_OK(c, kvtier_ping(c));
    S_CHECK(kvtier_fastpath_active(c) == 1, "no pair after the child closed its copy");
    /* a reply later than the timeout: this call times out, the next skips the stale reply */
    s_pause("slow");
    S_FAILS(c, KVT_ETIMEDOUT, kvtier_ping(c));
    S_CHECK(strstr(kvtier_last_error(c), "timed out"), "timeout message: %s", kvtier_last_error(c));
    S_OK(c, kvtier_stats(c, &json));
    S_CHECK(strstr(json, "\"type\": 14"), "the STATS call took another reply: %s", json);
    free(json);
    json = NULL;
    S_CHECK(kvtier_fastpath_active(c) == 1, "the pair went with a timeout");
    /* instance_dropped over the ring: HELLO again (our sides closed first), a new pair, the
     * PING retried on it */
    s_pause("redo-ring");
    S_OK(c, kvtier_ping(c));
    S_CHECK(kvtier_fastpath_active(c) == 1, "no pair after the re-HELLO");
    /* the daemon closes the pair while a request is on it: the call fails, later calls use the
     * socket */
    s_pause("drop-in-flight");
    S_FAILS(c, KVT_EUNAVAIL, kvtier_ping(c));
    S_CHECK(strstr(kvtier_last_error(c), "closed the fast path"), "message: %s",
            kvtier_last_error(c));
    S_CHECK(kvtier_fastpath_active(c) == 0, "the pair stays after the daemon closed it");
    S_OK(c, kvtier_release_async(c, 102));
    S_OK(c, kvtier_ping(c));
    /* instance_dropped over the socket: the re-HELLO asks again and gets a pair */
    s_pause("redo-socket");
    S_OK(c, kvtier_ping(c));
    S_CHECK(kvtier_fastpath_active(c) == 1, "no pair after the second re-HELLO");
    /* the daemon closes the pair while idle: the next call goes over the socket */
    s_pause("closed-idle");
    S_OK(c, kvtier_ping(c));
    S_CHECK(kvtier_fastpath_active(c) == 0, "the pair stays after the daemon closed it");
    s_pause("redo-gone");
    S_OK(c, kvtier_ping(c)); /* instance_dropped again: a new pair */
    S_CHECK(kvtier_fastpath_active(c) == 1, "no pair after the third re-HELLO");
    /* the daemon stops serving without closing anything (it died) and its arena file is gone:
     * the call times out, the pair goes, the next call is answered over the socket */
    s_pause("gone");
    S_FAILS(c, KVT_ETIMEDOUT, kvtier_ping(c));
    S_CHECK(kvtier_fastpath_active(c) == 0, "the pair of a vanished arena file stays");
    S_OK(c, kvtier_ping(c));
    s_pause("redo-bye");
    S_OK(c, kvtier_ping(c)); /* instance_dropped again: a pair for the BYE check */
    S_CHECK(kvtier_fastpath_active(c) == 1, "no pair after the fourth re-HELLO");
    printf("fastpath-fake: ring, fork, timeout, re-HELLOs and closes\n");
out:
    free(json);
    free(reply);
    kvtier_close(&c);
    return rc;
}

static const struct {
    const char *name;
    int (*run)(kvtier_t *c);
    bool own; /* the scenario connects by itself (main passes NULL) */
} s_scenarios[] = {
    {"gpu-none", s_gpu_none, false},
    {"arena", s_arena, false},
    {"rank-store", s_rank_store, false},
    {"rank-load", s_rank_load, false},
    {"salt", s_salt, false},
    {"embed", s_embed, false},
    {"hash", s_hash, false},
    {"errors", s_errors, false},
    {"prefetch", s_prefetch, false},
    {"labels", s_labels, false},
    {"remote", s_remote, false},
    {"idle", s_idle, false},
    {"no-heartbeat", s_no_heartbeat, false},
    {"restart", s_restart, false},
    {"adopt", s_adopt, false},
    {"close", s_close, true},
    {"fork", s_fork, false},
    {"fastpath", s_fastpath, false},
    {"fastpath-redo", s_fastpath_redo, false},
    {"fastpath-fake", s_fastpath_fake, true},
};

int main(int argc, char **argv)
{
    size_t ns = sizeof s_scenarios / sizeof s_scenarios[0], i = 0;
    for (; argc == 3 && i < ns; i++)
        if (!strcmp(argv[2], s_scenarios[i].name))
            break;
    if (argc != 3 || i == ns) {
        fprintf(stderr, "usage: kvtier-client-test ENDPOINT SCENARIO\nscenarios:");
        for (size_t j = 0; j < ns; j++)
            fprintf(stderr, " %s", s_scenarios[j].name);
        fputc('\n', stderr);
        return 2;
    }
    char err[256];
    s_endpoint = argv[1];
    kvtier_t *c = s_scenarios[i].own
                      ? NULL
                      : kvtier_connect(argv[1], "c-client-test", getenv("KVT_TEST_INSTANCE"), 10000,
                                       err, sizeof err);
    if (!c && !s_scenarios[i].own) {
        fprintf(stderr, "%s: %s\n", argv[2], err);
        return 1;
    }
    int rc = s_scenarios[i].run(c);
    kvtier_close(&c);
    if (rc)
        fprintf(stderr, "%s: FAILED\n", argv[2]);
    return rc;
}
