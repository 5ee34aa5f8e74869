/* Unit tests of common/kvt_ring: push/pop round trips of many sizes across many wrap-arounds,
 * empty and full, records too large for the ring, a caller buffer too small, attach refusing
 * malformed headers, every header field and record length set to hostile values at run time
 * (detected, sticky, and never an out-of-bounds access: the region is a malloc block of exactly
 * the ring's size, so ASan would see one), the frame parser on malformed payloads, a producer
 * and a consumer thread exchanging messages byte-exact with spinning off (both sides sleep on
 * their futex words), a request/reply ping-pong over two rings, the timeout path and close. */
#include "kvt_error.h"
#include "kvt_ring.h"

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

#define S_CAP 256u

typedef struct {
    uint8_t *region;
    size_t size;
    uint32_t cap;
    kvt_ring_t *prod, *cons;
} s_ring_t;

static void s_open(s_ring_t *r, uint32_t cap)
{
    char err[160];
    r->cap = cap;
    r->size = kvt_ring_region_size(cap);
    r->region = malloc(r->size); /* exactly the ring: ASan flags a byte past it */
    assert_non_null(r->region);
    memset(r->region, 0xa5, r->size);
    assert_int_equal(kvt_ring_format(r->region, r->size, cap, 1), 0);
    r->prod = kvt_ring_new(r->region, r->size, cap, KVT_RING_PRODUCER, err, sizeof err);
    assert_non_null(r->prod);
    r->cons = kvt_ring_new(r->region, r->size, cap, KVT_RING_CONSUMER, err, sizeof err);
    assert_non_null(r->cons);
}

static void s_close(s_ring_t *r)
{
    kvt_ring_destroy(&r->prod);
    kvt_ring_destroy(&r->cons);
    assert_null(r->prod);
    free(r->region);
}

static uint64_t s_rand(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void s_fill(uint8_t *p, size_t n, uint64_t seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(seed * 131 + i * 7 + (i >> 8));
}

static int64_t s_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void s_put64(uint8_t *region, uint32_t off, uint64_t v)
{
    memcpy(region + off, &v, 8);
}

static void s_put32(uint8_t *region, uint32_t off, uint32_t v)
{
    memcpy(region + off, &v, 4);
}

static uint64_t s_get64(const uint8_t *region, uint32_t off)
{
    uint64_t v;
    memcpy(&v, region + off, 8);
    return v;
}

/* Pushes a one-frame message of n bytes; the payload is 8 + n bytes (count, length, bytes). */
static int s_push1(kvt_ring_t *p, const void *buf, size_t n)
{
    kvt_ring_iov_t f = {buf, n};
    return kvt_ring_push(p, &f, 1);
}

static void test_format_and_attach(void **state)
{
    (void)state;
    char err[160];
    size_t sz = kvt_ring_region_size(S_CAP);
    assert_int_equal(sz, KVT_RING_HDR_SIZE + S_CAP);
    uint64_t *buf = malloc(sz);
    assert_non_null(buf);
    assert_int_equal(kvt_ring_format(buf, sz, 100, 1), KVT_EINVAL);       /* not a power of 2 */
    assert_int_equal(kvt_ring_format(buf, sz, 32, 1), KVT_EINVAL);        /* below the minimum */
    assert_int_equal(kvt_ring_format(buf, sz - 1, S_CAP, 1), KVT_EINVAL); /* region too small */
    assert_int_equal(kvt_ring_format((uint8_t *)buf + 4, sz - 4, 128, 1), KVT_EINVAL); /* align */
    assert_int_equal(kvt_ring_format(buf, sz, S_CAP, 1), 0);
    assert_null(kvt_ring_new(buf, sz, S_CAP, (kvt_ring_role_t)3, err, sizeof err));
    assert_null(kvt_ring_new(buf, sz, S_CAP / 2, KVT_RING_CONSUMER, err, sizeof err));
    assert_non_null(strstr(err, "capacity"));
    assert_null(kvt_ring_new(buf, sz - 8, S_CAP, KVT_RING_CONSUMER, err, sizeof err));
    uint8_t *r = (uint8_t *)buf;
    const struct {
        uint32_t off, width;
        uint64_t bad;
    } fields[] = {
        {KVT_RING_OFF_MAGIC, 8, 0},
        {KVT_RING_OFF_MAGIC, 8, KVT_RING_MAGIC + 1},
        {KVT_RING_OFF_VERSION, 4, 2},
        {KVT_RING_OFF_VERSION, 4, UINT32_MAX},
        {KVT_RING_OFF_HDR_SIZE, 4, 0},
        {KVT_RING_OFF_HDR_SIZE, 4, UINT32_MAX},
        {KVT_RING_OFF_CAPACITY, 4, S_CAP * 2},
        {KVT_RING_OFF_CAPACITY, 4, UINT32_MAX},
        {KVT_RING_OFF_HEAD, 8, S_CAP + 8},  /* more waiting than the ring holds */
        {KVT_RING_OFF_HEAD, 8, 4},          /* misaligned */
        {KVT_RING_OFF_HEAD, 8, UINT64_MAX}, /* behind the tail */
        {KVT_RING_OFF_TAIL, 8, 8},          /* tail past head */
    };
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        assert_int_equal(kvt_ring_format(buf, sz, S_CAP, 1), 0);
        if (fields[i].width == 8)
            s_put64(r, fields[i].off, fields[i].bad);
        else
            s_put32(r, fields[i].off, (uint32_t)fields[i].bad);
        err[0] = 0;
        assert_null(kvt_ring_new(buf, sz, S_CAP, KVT_RING_CONSUMER, err, sizeof err));
        assert_null(kvt_ring_new(buf, sz, S_CAP, KVT_RING_PRODUCER, err, sizeof err));
        assert_true(strlen(err) > 0);
    }
    /* a ring with records waiting attaches at its indices */
    assert_int_equal(kvt_ring_format(buf, sz, S_CAP, 1), 0);
    s_put64(r, KVT_RING_OFF_HEAD, 1000 * 8 + 64);
    s_put64(r, KVT_RING_OFF_TAIL, 1000 * 8);
    kvt_ring_t *c = kvt_ring_new(buf, sz, S_CAP, KVT_RING_CONSUMER, err, sizeof err);
    assert_non_null(c);
    kvt_ring_destroy(&c);
    kvt_ring_destroy(&c); /* NULL is fine */
    free(buf);
}

static void test_round_trips_wrap(void **state)
{
    (void)state;
    s_ring_t r;
    s_open(&r, S_CAP);
    uint8_t src[S_CAP], dst[S_CAP];
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    size_t max = kvt_ring_max_payload(r.prod);
    assert_int_equal(max, S_CAP - 8);
    /* 1..3 messages in flight, payloads of every size up to the maximum, 3000 rounds: the
     * indices wrap the 256-byte area hundreds of times at every alignment */
    uint32_t pending = 0;
    uint64_t seq_in = 0, seq_out = 0;
    size_t lens[4];
    for (int round = 0; round < 3000; round++) {
        uint32_t want = 1 + (uint32_t)(s_rand(&rng) % 3);
        while (pending < want) {
            uint32_t nf = (uint32_t)(s_rand(&rng) % 4); /* 0..3 frames */
            size_t room = max - 4 - 4 * (size_t)nf;
            size_t total = s_rand(&rng) % 5 == 0 ? room : s_rand(&rng) % (room / 2 + 1);
            kvt_ring_iov_t f[3];
            size_t left = total;
            s_fill(src, total, seq_in);
            for (uint32_t i = 0; i < nf; i++) {
                size_t l = i + 1 == nf ? left : s_rand(&rng) % (left + 1);
                f[i].ptr = src + (total - left);
                f[i].len = l;
                left -= l;
            }
            if (nf == 0)
                total = 0;
            size_t plen = kvt_ring_msg_size(f, nf);
            int rc = kvt_ring_push(r.prod, f, nf);
            if (rc == KVT_EBUSY)
                break;
            assert_int_equal(rc, 0);
            lens[seq_in % 4] = plen;
            seq_in++;
            pending++;
        }
        uint32_t take = 1 + (uint32_t)(s_rand(&rng) % pending);
        for (uint32_t k = 0; k < take; k++) {
            size_t len = 0;
            assert_int_equal(kvt_ring_pop(r.cons, dst, sizeof dst, &len), 0);
            assert_int_equal(len, lens[seq_out % 4]);
            kvt_ring_frame_t fr[4];
            uint32_t n;
            assert_int_equal(kvt_ring_parse(dst, len, fr, 4, &n), 0);
            /* the frames' bytes, concatenated, are the message's bytes */
            uint8_t cat[S_CAP];
            size_t cl = 0;
            for (uint32_t i = 0; i < n; i++) {
                memcpy(cat + cl, fr[i].ptr, fr[i].len);
                cl += fr[i].len;
            }
            uint8_t expect[S_CAP];
            s_fill(expect, cl, seq_out);
            assert_memory_equal(cat, expect, cl);
            seq_out++;
            pending--;
        }
    }
    size_t len;
    while (pending--)
        assert_int_equal(kvt_ring_pop(r.cons, dst, sizeof dst, &len), 0);
    assert_int_equal(kvt_ring_pop(r.cons, dst, sizeof dst, &len), KVT_EBUSY);
    kvt_ring_stats_t ps, cs;
    kvt_ring_stats(r.prod, &ps);
    kvt_ring_stats(r.cons, &cs);
    assert_int_equal(ps.records, seq_in);
    assert_int_equal(cs.records, seq_in);
    assert_int_equal(ps.bytes, cs.bytes);
    assert_true(ps.bytes > 100 * S_CAP);
    s_close(&r);
}

static void test_full_empty_and_sizes(void **state)
{
    (void)state;
    s_ring_t r;
    s_open(&r, S_CAP);
    uint8_t buf[S_CAP] = {0}, out[S_CAP];
    size_t len = 99;
    assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), KVT_EBUSY);
    assert_int_equal(len, 0);
    assert_int_equal(kvt_ring_wait(r.cons, 0, 0), KVT_ETIMEDOUT);
    /* 24-byte payload (8 + 16) -> 32-byte records: exactly 8 fit */
    for (int i = 0; i < 8; i++)
        assert_int_equal(s_push1(r.prod, buf, 16), 0);
    assert_int_equal(s_push1(r.prod, buf, 16), KVT_EBUSY);
    assert_int_equal(s_push1(r.prod, buf, 0), KVT_EBUSY); /* an empty message still needs 16 */
    assert_int_equal(kvt_ring_wait(r.prod, 24, 0), KVT_ETIMEDOUT);
    assert_int_equal(kvt_ring_wait(r.prod, S_CAP, 0), KVT_ETOOBIG);
    assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), 0);
    assert_int_equal(len, 24);
    assert_int_equal(kvt_ring_wait(r.prod, 24, 0), 0);
    assert_int_equal(s_push1(r.prod, buf, 16), 0);
    /* a buffer too small: told the length, the record stays */
    assert_int_equal(kvt_ring_pop(r.cons, out, 23, &len), KVT_ETOOBIG);
    assert_int_equal(len, 24);
    for (int i = 0; i < 8; i++)
        assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), 0);
    assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), KVT_EBUSY);
    /* the largest record fits in an empty ring at any offset (it wraps byte-wise); one byte
     * more never does */
    size_t max = kvt_ring_max_payload(r.prod);
    for (int k = 0; k < 40; k++) {
        s_fill(buf, max - 8, (uint64_t)k);
        assert_int_equal(s_push1(r.prod, buf, max - 8), 0);
        assert_int_equal(s_push1(r.prod, buf, 0), KVT_EBUSY);
        assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), 0);
        assert_int_equal(len, max);
        assert_memory_equal(out + 8, buf, max - 8);
        assert_int_equal(s_push1(r.prod, buf, 8 * (size_t)(k % 5)), 0); /* shifts the offset */
        assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), 0);
    }
    assert_int_equal(s_push1(r.prod, buf, max - 7), KVT_ETOOBIG);
    kvt_ring_iov_t huge = {buf, (size_t)UINT32_MAX + 1};
    assert_int_equal(kvt_ring_push(r.prod, &huge, 1), KVT_ETOOBIG);
    assert_false(kvt_ring_broken(r.prod));
    assert_false(kvt_ring_broken(r.cons));
    assert_string_equal(kvt_ring_why(r.cons), "");
    s_close(&r);
}

static void test_parse(void **state)
{
    (void)state;
    kvt_ring_frame_t fr[4];
    uint32_t n = 77;
    uint8_t b[64] = {0};
    assert_int_equal(kvt_ring_parse(b, 3, fr, 4, &n), KVT_EBADREQ);
    assert_int_equal(n, 0);
    assert_int_equal(kvt_ring_parse(b, 4, fr, 4, &n), 0); /* zero frames */
    assert_int_equal(n, 0);
    assert_int_equal(kvt_ring_parse(b, 5, fr, 4, &n), KVT_EBADREQ); /* trailing byte */
    s_put32(b, 0, 5);
    assert_int_equal(kvt_ring_parse(b, 64, fr, 4, &n), KVT_ETOOBIG); /* more than max */
    s_put32(b, 0, UINT32_MAX);
    assert_int_equal(kvt_ring_parse(b, 64, fr, 4, &n), KVT_ETOOBIG);
    s_put32(b, 0, 2);
    s_put32(b, 4, 3);
    memcpy(b + 8, "abc", 3);
    s_put32(b, 11, 0);
    assert_int_equal(kvt_ring_parse(b, 15, fr, 4, &n), 0);
    assert_int_equal(n, 2);
    assert_int_equal(fr[0].len, 3);
    assert_memory_equal(fr[0].ptr, "abc", 3);
    assert_int_equal(fr[1].len, 0);
    assert_int_equal(kvt_ring_parse(b, 14, fr, 4, &n), KVT_EBADREQ); /* length cut */
    assert_int_equal(kvt_ring_parse(b, 16, fr, 4, &n), KVT_EBADREQ); /* trailing */
    s_put32(b, 4, UINT32_MAX);                                       /* frame past the end */
    assert_int_equal(kvt_ring_parse(b, 15, fr, 4, &n), KVT_EBADREQ);
    s_put32(b, 4, 8);
    assert_int_equal(kvt_ring_parse(b, 15, fr, 4, &n), KVT_EBADREQ);
}

/* One hostile write, after which the victim side must report KVT_EBADREQ and keep doing so. */
typedef struct {
    const char *what;
    bool consumer; /* the victim */
    uint32_t off;  /* in the region; record fields are relative to the data area + 0x10000 */
    uint32_t width;
    uint64_t value;
} s_attack_t;

#define S_REC 0x10000u /* marks an offset into the data area (the first record's header) */

static void test_hostile_values(void **state)
{
    (void)state;
    const s_attack_t attacks[] = {
        {"head far ahead", true, KVT_RING_OFF_HEAD, 8, 1ull << 40},
        {"head one ring ahead", true, KVT_RING_OFF_HEAD, 8, 32 + S_CAP + 8},
        {"head misaligned", true, KVT_RING_OFF_HEAD, 8, 33},
        {"head behind tail", true, KVT_RING_OFF_HEAD, 8, 0},
        {"head max", true, KVT_RING_OFF_HEAD, 8, UINT64_MAX},
        {"record length max", true, S_REC + 0, 4, UINT32_MAX},
        {"record runs past head", true, S_REC + 0, 4, 25},
        {"record kind 0", true, S_REC + 4, 4, 0},
        {"record kind max", true, S_REC + 4, 4, UINT32_MAX},
        {"tail ahead of head", false, KVT_RING_OFF_TAIL, 8, 72},
        {"tail far behind", false, KVT_RING_OFF_TAIL, 8, 0ull - S_CAP},
        {"tail misaligned", false, KVT_RING_OFF_TAIL, 8, 4},
        {"tail max", false, KVT_RING_OFF_TAIL, 8, UINT64_MAX},
    };
    for (size_t a = 0; a < sizeof attacks / sizeof attacks[0]; a++) {
        const s_attack_t *at = &attacks[a];
        s_ring_t r;
        s_open(&r, S_CAP);
        uint8_t buf[S_CAP] = {1, 2, 3}, out[S_CAP];
        size_t len;
        /* one record popped, one waiting: head 64, tail 32 */
        assert_int_equal(s_push1(r.prod, buf, 16), 0);
        assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), 0);
        assert_int_equal(s_push1(r.prod, buf, 16), 0);
        uint32_t off = at->off >= S_REC ? KVT_RING_HDR_SIZE + 32 + (at->off - S_REC) : at->off;
        if (at->width == 8)
            s_put64(r.region, off, at->value);
        else
            s_put32(r.region, off, (uint32_t)at->value);
        int rc;
        if (at->consumer) {
            rc = kvt_ring_pop(r.cons, out, sizeof out, &len);
            if (rc == 0) /* "head behind tail" reads as tail + 2^64 - 32: impossible too */
                fail_msg("%s: popped %zu bytes", at->what, len);
            assert_int_equal(rc, KVT_EBADREQ);
            assert_true(kvt_ring_broken(r.cons));
            assert_true(strlen(kvt_ring_why(r.cons)) > 0);
            /* sticky: put the ring right again, the handle still refuses it */
            s_put64(r.region, KVT_RING_OFF_HEAD, 64);
            s_put32(r.region, KVT_RING_HDR_SIZE + 32, 24);
            s_put32(r.region, KVT_RING_HDR_SIZE + 36, KVT_RING_KIND_MSG);
            assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), KVT_EBADREQ);
            assert_int_equal(kvt_ring_wait(r.cons, 0, 1000000), KVT_EBADREQ);
        } else {
            rc = s_push1(r.prod, buf, 16);
            if (rc != KVT_EBADREQ)
                fail_msg("%s: push answered %d", at->what, rc);
            assert_true(kvt_ring_broken(r.prod));
            s_put64(r.region, KVT_RING_OFF_TAIL, 32);
            assert_int_equal(s_push1(r.prod, buf, 16), KVT_EBADREQ);
            assert_int_equal(kvt_ring_wait(r.prod, 16, 1000000), KVT_EBADREQ);
        }
        s_close(&r);
    }
}

/* Wait words, closed flags and the header constants rewritten at run time: the constants are
 * never read again after attach, hostile wait words cost a wake or an early return at most,
 * closed flags end the exchange with KVT_EUNAVAIL. */
static void test_hostile_words(void **state)
{
    (void)state;
    s_ring_t r;
    s_open(&r, S_CAP);
    uint8_t buf[S_CAP] = {9}, out[S_CAP];
    size_t len;
    /* magic, version, capacity and the padding: all garbage (the epoch is test_reformat's) */
    memset(r.region, 0xff, KVT_RING_OFF_EPOCH);
    memset(r.region + KVT_RING_OFF_EPOCH + 4, 0xff, KVT_RING_OFF_HEAD - KVT_RING_OFF_EPOCH - 4);
    s_put32(r.region, KVT_RING_OFF_PROD_WAIT, 0xffffffffu);
    s_put32(r.region, KVT_RING_OFF_CONS_WAIT, 0x12345678u);
    for (int i = 0; i < 100; i++) {
        assert_int_equal(s_push1(r.prod, buf, 100), 0);
        assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), 0);
        assert_int_equal(len, 108);
        s_put32(r.region, KVT_RING_OFF_PROD_WAIT, (uint32_t)i + 1);
        s_put32(r.region, KVT_RING_OFF_CONS_WAIT, (uint32_t)i * 7 + 1);
    }
    kvt_ring_stats_t st;
    kvt_ring_stats(r.cons, &st);
    assert_true(st.wakes > 0); /* woke a producer that never slept: harmless */
    /* a consumer waiting while the peer scribbles on its wait word returns by its deadline */
    int64_t t0 = s_now_ns();
    assert_int_equal(kvt_ring_wait(r.cons, 0, 20000000), KVT_ETIMEDOUT);
    assert_true(s_now_ns() - t0 < 2000000000LL);
    /* a closed flag with any non-zero value closes */
    s_put32(r.region, KVT_RING_OFF_CONS_CLOSED, 0x80000000u);
    assert_int_equal(s_push1(r.prod, buf, 8), KVT_EUNAVAIL);
    assert_int_equal(kvt_ring_wait(r.prod, 8, -1), KVT_EUNAVAIL);
    s_put32(r.region, KVT_RING_OFF_CONS_CLOSED, 0);
    assert_int_equal(s_push1(r.prod, buf, 8), 0);
    s_put32(r.region, KVT_RING_OFF_PROD_CLOSED, 2);
    assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), 0); /* drained first */
    assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), KVT_EUNAVAIL);
    assert_int_equal(kvt_ring_wait(r.cons, 0, -1), KVT_EUNAVAIL);
    assert_false(kvt_ring_broken(r.cons));
    assert_false(kvt_ring_broken(r.prod));
    s_close(&r);
}

/* The daemon formats a ring slot again for its next client: handles still attached from the
 * last use (a client resumed after its pair was reclaimed) find it closed, whatever the new
 * indices are, and the new handles work. */
static void test_reformat_closes_old_handles(void **state)
{
    (void)state;
    s_ring_t r;
    s_open(&r, S_CAP);
    uint8_t buf[64] = {1}, out[S_CAP];
    size_t len;
    for (int i = 0; i < 3; i++)
        assert_int_equal(s_push1(r.prod, buf, 40), 0);
    assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), 0);
    uint32_t epoch;
    memcpy(&epoch, r.region + KVT_RING_OFF_EPOCH, 4);
    assert_int_equal(epoch, 1u);
    assert_int_equal(kvt_ring_format(r.region, r.size, S_CAP, epoch + 1), 0);
    uint32_t epoch2;
    memcpy(&epoch2, r.region + KVT_RING_OFF_EPOCH, 4);
    assert_int_equal(epoch2, epoch + 1);
    assert_int_equal(s_push1(r.prod, buf, 8), KVT_EUNAVAIL);
    assert_int_equal(kvt_ring_wait(r.prod, 8, -1), KVT_EUNAVAIL);
    assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), KVT_EUNAVAIL);
    assert_int_equal(kvt_ring_wait(r.cons, 0, -1), KVT_EUNAVAIL);
    assert_false(kvt_ring_broken(r.cons));
    char err[160];
    kvt_ring_t *p2 = kvt_ring_new(r.region, r.size, S_CAP, KVT_RING_PRODUCER, err, sizeof err);
    kvt_ring_t *c2 = kvt_ring_new(r.region, r.size, S_CAP, KVT_RING_CONSUMER, err, sizeof err);
    assert_non_null(p2);
    assert_non_null(c2);
    /* the old handles' close (a client dropping a pair it had not noticed was reclaimed)
     * leaves the new use alone */
    kvt_ring_close(r.prod);
    kvt_ring_close(r.cons);
    assert_int_equal(s_push1(p2, buf, 8), 0);
    assert_int_equal(kvt_ring_pop(c2, out, sizeof out, &len), 0);
    assert_int_equal(len, 16);
    assert_int_equal(kvt_ring_wait(p2, 8, 0), 0);             /* not closed by the consumer */
    assert_int_equal(kvt_ring_wait(c2, 0, 0), KVT_ETIMEDOUT); /* empty, not closed */
    kvt_ring_destroy(&p2);
    kvt_ring_destroy(&c2);
    s_close(&r);
}

/* kvt_ring_arm: a side that would sleep sees data that came before, and one that armed is
 * woken through its word by the peer's next push. */
static void test_arm(void **state)
{
    (void)state;
    s_ring_t r;
    s_open(&r, S_CAP);
    uint8_t buf[64] = {1}, out[S_CAP];
    size_t len;
    uint32_t *word = NULL;
    assert_int_equal(kvt_ring_arm(r.cons, 0, &word), 0); /* empty: may sleep */
    assert_non_null(word);
    assert_int_equal(*word, 1u);
    assert_int_equal(s_push1(r.prod, buf, 8), 0); /* clears the word (and wakes) */
    assert_int_equal(*word, 0u);
    kvt_ring_disarm(r.cons);
    assert_int_equal(kvt_ring_arm(r.cons, 0, &word), 1); /* data: do not sleep */
    kvt_ring_disarm(r.cons);
    assert_int_equal(*word, 0u);
    assert_int_equal(kvt_ring_pop(r.cons, out, sizeof out, &len), 0);
    kvt_ring_close(r.prod);
    assert_int_equal(kvt_ring_arm(r.cons, 0, &word), KVT_EUNAVAIL);
    kvt_ring_disarm(r.cons);
    s_close(&r);
}

static void *s_push_later(void *arg)
{
    s_ring_t *r = arg;
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
    uint8_t one[8] = {0};
    if (s_push1(r->prod, one, 8) != 0)
        abort();
    return NULL;
}

static void test_timeout(void **state)
{
    (void)state;
    s_ring_t r;
    s_open(&r, S_CAP);
    kvt_ring_set_spin(r.cons, 0);
    int64_t t0 = s_now_ns();
    assert_int_equal(kvt_ring_wait(r.cons, 0, 30000000), KVT_ETIMEDOUT); /* 30 ms */
    int64_t el = s_now_ns() - t0;
    assert_true(el >= 30000000);
    assert_true(el < 1000000000);
    kvt_ring_stats_t st;
    kvt_ring_stats(r.cons, &st);
    assert_true(st.sleeps >= 1);
    assert_int_equal(st.spin_hits, 0);
    /* a deadline past the end of the clock is no deadline (no overflow: UBSan would say) */
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, s_push_later, &r), 0);
    assert_int_equal(kvt_ring_wait(r.cons, 0, INT64_MAX), 0);
    pthread_join(t, NULL);
    size_t l1;
    uint8_t o1[64];
    assert_int_equal(kvt_ring_pop(r.cons, o1, sizeof o1, &l1), 0);
    /* with spinning: the spin stops at the deadline too */
    kvt_ring_set_spin(r.cons, 1u << 30);
    t0 = s_now_ns();
    assert_int_equal(kvt_ring_wait(r.cons, 0, 2000000), KVT_ETIMEDOUT);
    assert_true(s_now_ns() - t0 < 1000000000);
    /* producer side: full ring */
    uint8_t buf[S_CAP] = {0};
    while (s_push1(r.prod, buf, 100) == 0)
        ;
    kvt_ring_set_spin(r.prod, 0);
    t0 = s_now_ns();
    assert_int_equal(kvt_ring_wait(r.prod, 100, 10000000), KVT_ETIMEDOUT);
    assert_true(s_now_ns() - t0 >= 10000000);
    s_close(&r);
}

/* ---- two threads ---- */

#define S_N 20000

typedef struct {
    s_ring_t *r;
    int rc;
    char msg[160];
} s_side_t;

/* message i: frames [i as 8 bytes, i % 300 bytes of pattern, (i*7) % 50 bytes of pattern] */
static void *s_producer(void *arg)
{
    s_side_t *s = arg;
    uint8_t a[300], b[50];
    for (uint64_t i = 0; i < S_N; i++) {
        s_fill(a, i % 300, i);
        s_fill(b, (i * 7) % 50, i + 1);
        kvt_ring_iov_t f[3] = {{&i, 8}, {a, i % 300}, {b, (i * 7) % 50}};
        int rc;
        while ((rc = kvt_ring_push(s->r->prod, f, 3)) == KVT_EBUSY) {
            rc = kvt_ring_wait(s->r->prod, kvt_ring_msg_size(f, 3), 5000000000LL);
            if (rc) {
                snprintf(s->msg, sizeof s->msg, "producer wait %llu: %d", (unsigned long long)i,
                         rc);
                s->rc = rc;
                return NULL;
            }
        }
        if (rc) {
            snprintf(s->msg, sizeof s->msg, "push %llu: %d", (unsigned long long)i, rc);
            s->rc = rc;
            return NULL;
        }
    }
    kvt_ring_close(s->r->prod);
    return NULL;
}

static void *s_consumer(void *arg)
{
    s_side_t *s = arg;
    uint8_t buf[1024], exp[300];
    for (uint64_t i = 0;; i++) {
        size_t len;
        int rc = kvt_ring_wait(s->r->cons, 0, 5000000000LL);
        if (rc == KVT_EUNAVAIL && i == S_N)
            return NULL; /* the producer closed after the last one */
        if (rc == 0)
            rc = kvt_ring_pop(s->r->cons, buf, sizeof buf, &len);
        kvt_ring_frame_t fr[4];
        uint32_t n = 0;
        uint64_t seq = UINT64_MAX;
        if (rc == 0)
            rc = kvt_ring_parse(buf, len, fr, 4, &n);
        if (rc == 0 &&
            (n != 3 || fr[0].len != 8 || fr[1].len != i % 300 || fr[2].len != (i * 7) % 50))
            rc = -100;
        if (rc == 0) {
            memcpy(&seq, fr[0].ptr, 8);
            s_fill(exp, i % 300, i);
            if (seq != i || memcmp(fr[1].ptr, exp, i % 300))
                rc = -101;
            s_fill(exp, (i * 7) % 50, i + 1);
            if (rc == 0 && memcmp(fr[2].ptr, exp, (i * 7) % 50))
                rc = -102;
        }
        if (rc) {
            snprintf(s->msg, sizeof s->msg, "message %llu: %d", (unsigned long long)i, rc);
            s->rc = rc;
            kvt_ring_close(s->r->cons); /* lets a sleeping producer go */
            return NULL;
        }
    }
}

static void s_exchange(uint32_t cap, uint32_t spin)
{
    s_ring_t r;
    s_open(&r, cap);
    kvt_ring_set_spin(r.prod, spin);
    kvt_ring_set_spin(r.cons, spin);
    s_side_t p = {.r = &r}, c = {.r = &r};
    pthread_t tp, tc;
    assert_int_equal(pthread_create(&tc, NULL, s_consumer, &c), 0);
    assert_int_equal(pthread_create(&tp, NULL, s_producer, &p), 0);
    pthread_join(tp, NULL);
    pthread_join(tc, NULL);
    if (p.rc || c.rc)
        fail_msg("spin %u: %s / %s", spin, p.msg, c.msg);
    kvt_ring_stats_t ps, cs;
    kvt_ring_stats(r.prod, &ps);
    kvt_ring_stats(r.cons, &cs);
    assert_int_equal(ps.records, S_N);
    assert_int_equal(cs.records, S_N);
    if (spin == 0) {
        /* nobody spins: the consumer slept for data and the (small) ring made the producer
         * sleep for room, each woken by the other's futex wake */
        print_message("spin 0: producer slept %llu, woken %llu; consumer slept %llu, woken %llu\n",
                      (unsigned long long)ps.sleeps, (unsigned long long)cs.wakes,
                      (unsigned long long)cs.sleeps, (unsigned long long)ps.wakes);
        assert_true(ps.sleeps > 0);
        assert_true(cs.sleeps > 0);
        assert_true(ps.wakes > 0);
        assert_true(cs.wakes > 0);
    }
    s_close(&r);
}

static void test_threads_sleeping(void **state)
{
    (void)state;
    s_exchange(1024, 0);
}

static void test_threads_spinning(void **state)
{
    (void)state;
    s_exchange(4096, 4096);
}

/* Request/reply over two rings, both sides sleeping between messages (spin 0). */
typedef struct {
    s_ring_t *req, *rep;
    int rc;
} s_echo_t;

static void *s_echo_server(void *arg)
{
    s_echo_t *e = arg;
    uint8_t buf[512];
    for (;;) {
        size_t len;
        int rc = kvt_ring_wait(e->req->cons, 0, 5000000000LL);
        if (rc == KVT_EUNAVAIL)
            return NULL;
        if (rc == 0)
            rc = kvt_ring_pop(e->req->cons, buf, sizeof buf, &len);
        kvt_ring_frame_t fr[4];
        uint32_t n;
        if (rc == 0)
            rc = kvt_ring_parse(buf, len, fr, 4, &n);
        if (rc == 0) {
            kvt_ring_iov_t f[4];
            for (uint32_t i = 0; i < n; i++)
                f[i] = (kvt_ring_iov_t){fr[i].ptr, fr[i].len};
            rc = kvt_ring_push(e->rep->prod, f, n); /* one outstanding: never full */
        }
        if (rc) {
            e->rc = rc;
            return NULL;
        }
    }
}

static void test_ping_pong(void **state)
{
    (void)state;
    s_ring_t req, rep;
    s_open(&req, 4096);
    s_open(&rep, 4096);
    kvt_ring_set_spin(req.cons, 0);
    kvt_ring_set_spin(rep.cons, 0);
    s_echo_t e = {.req = &req, .rep = &rep};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, s_echo_server, &e), 0);
    uint8_t body[200], out[512];
    for (uint64_t uid = 1; uid <= 2000; uid++) {
        s_fill(body, uid % 200, uid);
        kvt_ring_iov_t f[3] = {{&uid, 8}, {"\x04", 1}, {body, uid % 200}};
        assert_int_equal(kvt_ring_push(req.prod, f, 3), 0);
        assert_int_equal(kvt_ring_wait(rep.cons, 0, 5000000000LL), 0);
        size_t len;
        assert_int_equal(kvt_ring_pop(rep.cons, out, sizeof out, &len), 0);
        assert_int_equal(len, kvt_ring_msg_size(f, 3));
        kvt_ring_frame_t fr[4];
        uint32_t n;
        assert_int_equal(kvt_ring_parse(out, len, fr, 4, &n), 0);
        assert_int_equal(n, 3);
        assert_memory_equal(fr[0].ptr, &uid, 8);
        assert_memory_equal(fr[2].ptr, body, uid % 200);
    }
    kvt_ring_close(req.prod);
    pthread_join(t, NULL);
    assert_int_equal(e.rc, 0);
    kvt_ring_stats_t st;
    kvt_ring_stats(rep.cons, &st);
    assert_true(st.sleeps > 0);
    assert_int_equal(s_get64(rep.region, KVT_RING_OFF_HEAD), st.bytes);
    s_close(&req);
    s_close(&rep);
}

/* A consumer asleep without a deadline is woken by the producer's close. */
static void *s_wait_forever(void *arg)
{
    s_side_t *s = arg;
    s->rc = kvt_ring_wait(s->r->cons, 0, -1);
    return NULL;
}

static void test_close_wakes(void **state)
{
    (void)state;
    s_ring_t r;
    s_open(&r, S_CAP);
    kvt_ring_set_spin(r.cons, 0);
    s_side_t c = {.r = &r, .rc = 1};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, s_wait_forever, &c), 0);
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
    kvt_ring_close(r.prod);
    kvt_ring_close(r.prod); /* idempotent */
    pthread_join(t, NULL);
    assert_int_equal(c.rc, KVT_EUNAVAIL);
    s_close(&r);
}

/* Issue 29: a spinner that loses its CPU (a CPU-bound neighbour on the same core) stops
 * spinning: its waits sleep at once for a while (cooled), so the peer gets the CPU. Pinned to
 * one CPU with a hog thread, a waiter that spins (a long budget) on an empty ring is
 * descheduled mid-spin within a few scheduler slices, and then stops spinning. */
static atomic_int s_hog_stop;

static void *s_hog(void *arg)
{
    (void)arg;
    while (!atomic_load_explicit(&s_hog_stop, memory_order_relaxed))
        ;
    return NULL;
}

static void test_spinning_stops_when_the_cpu_is_taken(void **state)
{
    (void)state;
    s_ring_t r;
    s_open(&r, S_CAP);
    kvt_ring_set_spin(r.cons, 1u << 20); /* spin up to ~ms: long enough to be preempted */
    cpu_set_t one, was;
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu() >= 0 ? sched_getcpu() : 0, &one);
    assert_int_equal(pthread_getaffinity_np(pthread_self(), sizeof was, &was), 0);
    assert_int_equal(pthread_setaffinity_np(pthread_self(), sizeof one, &one), 0);
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setaffinity_np(&at, sizeof one, &one);
    pthread_t hog;
    atomic_store(&s_hog_stop, 0);
    assert_int_equal(pthread_create(&hog, &at, s_hog, NULL), 0);
    kvt_ring_stats_t st = {0};
    int64_t t0 = s_now_ns();
    for (int i = 0; i < 2000 && s_now_ns() - t0 < 5000000000LL; i++) {
        assert_int_equal(kvt_ring_wait(r.cons, 0, 2000000), KVT_ETIMEDOUT); /* 2 ms */
        kvt_ring_stats(r.cons, &st);
        if (st.cooled)
            break;
    }
    assert_true(st.cooled >= 1);
    assert_int_equal(st.spin, 32); /* back to the small budget it grows from */
    atomic_store(&s_hog_stop, 1);
    pthread_join(hog, NULL);
    pthread_attr_destroy(&at);
    pthread_setaffinity_np(pthread_self(), sizeof was, &was);
    s_close(&r);
}

/* The pause after a lost spin (kvt_ring_cool): 1 ms, doubling up to 50 ms while the losses come
 * back within 100 ms of the previous pause's end, halved per quiet 100 ms before a loss. */
static void test_cool_rule(void **state)
{
    (void)state;
    kvt_ring_cool_t c = {0};
    const int64_t ms = 1000000;
    int64_t now = 5000 * ms;
    kvt_ring_cool(&c, now);
    assert_int_equal(c.len, 1 * ms);
    assert_int_equal(c.until, now + 1 * ms);
    static const int64_t want[] = {2, 4, 8, 16, 32, 50, 50};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        now = c.until + 99 * ms; /* lost again 99 ms after the pause ended */
        kvt_ring_cool(&c, now);
        assert_int_equal(c.len, want[i] * ms);
        assert_int_equal(c.until, now + want[i] * ms);
    }
    now = c.until + 100 * ms; /* one quiet 100 ms: halved */
    kvt_ring_cool(&c, now);
    assert_int_equal(c.len, 25 * ms);
    now = c.until + 250 * ms; /* two more: a quarter */
    kvt_ring_cool(&c, now);
    assert_int_equal(c.len, 6250000);
    now = c.until + 10000 * ms; /* long quiet: a lone loss costs 1 ms again */
    kvt_ring_cool(&c, now);
    assert_int_equal(c.len, 1 * ms);
    assert_int_equal(c.until, now + 1 * ms);
    kvt_ring_cool(&c, c.until + 350 * ms); /* losses every ~300 ms (idle node): 1 ms each */
    assert_int_equal(c.len, 1 * ms);
    kvt_ring_cool(&c, c.until - ms / 2); /* within the pause (a second spinner's report) */
    assert_int_equal(c.len, 2 * ms);
    kvt_ring_cool(&c, INT64_MAX / 2); /* after ages: no overflow in the shift */
    assert_int_equal(c.len, 1 * ms);
}

/* kvt_ring_push_later publishes without waking; kvt_ring_wake wakes a consumer asleep on the
 * futex. The consumer never spins and sleeps on an empty ring (its wait word armed); a record
 * pushed later must not end its sleep (its futex sleep lasts up to 1 s), the wake must. */
static atomic_int s_woke;

static void *s_wait_flag(void *arg)
{
    s_side_t *s = arg;
    s->rc = kvt_ring_wait(s->r->cons, 0, 5000000000LL);
    atomic_store(&s_woke, 1);
    return NULL;
}

static void test_push_later_then_wake(void **state)
{
    (void)state;
    s_ring_t r;
    s_open(&r, S_CAP);
    kvt_ring_set_spin(r.cons, 0);
    s_side_t c = {.r = &r, .rc = 1};
    atomic_store(&s_woke, 0);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, s_wait_flag, &c), 0);
    int64_t t0 = s_now_ns();
    while (atomic_load((_Atomic uint32_t *)(void *)(r.region + KVT_RING_OFF_CONS_WAIT)) != 1 &&
           s_now_ns() - t0 < 5000000000LL)
        sched_yield();
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL); /* into futex_wait (the word is 1: it sleeps, or has slept) */
    static const char msg[] = "later";
    kvt_ring_iov_t iov = {msg, sizeof msg};
    int64_t pushed = s_now_ns();
    assert_int_equal(kvt_ring_push_later(r.prod, &iov, 1), 0);
    ts.tv_nsec = 100000000;
    nanosleep(&ts, NULL);
    assert_int_equal(atomic_load(&s_woke), 0); /* published, but nobody woke it */
    kvt_ring_wake(r.prod);
    pthread_join(t, NULL);
    assert_int_equal(c.rc, 0);
    assert_true(s_now_ns() - pushed < 900000000LL); /* the wake, not the 1 s re-check */
    kvt_ring_stats_t st;
    kvt_ring_stats(r.prod, &st);
    assert_int_equal(st.wakes, 1);
    kvt_ring_wake(r.prod); /* nobody asleep: no wake */
    kvt_ring_stats(r.prod, &st);
    assert_int_equal(st.wakes, 1);
    s_close(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_format_and_attach),
        cmocka_unit_test(test_round_trips_wrap),
        cmocka_unit_test(test_full_empty_and_sizes),
        cmocka_unit_test(test_parse),
        cmocka_unit_test(test_hostile_values),
        cmocka_unit_test(test_hostile_words),
        cmocka_unit_test(test_reformat_closes_old_handles),
        cmocka_unit_test(test_arm),
        cmocka_unit_test(test_timeout),
        cmocka_unit_test(test_threads_sleeping),
        cmocka_unit_test(test_threads_spinning),
        cmocka_unit_test(test_ping_pong),
        cmocka_unit_test(test_close_wakes),
        cmocka_unit_test(test_spinning_stops_when_the_cpu_is_taken),
        cmocka_unit_test(test_cool_rule),
        cmocka_unit_test(test_push_later_then_wake),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
