/* Unit tests of the protocol decoder (protocol/kvt_msg.c): pre-scan bounds, uid/type frames,
 * field decoding per request type, error codes and messages, a seeded random-input run under
 * ASan/UBSan, and the run class of every request type. */
#include "kvt_error.h"
#include "kvt_msg.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

static kvt_limits_t s_lim;

static int s_setup(void **state)
{
    (void)state;
    kvt_limits_init(&s_lim, 256u << 20, 65536);
    return 0;
}

/* A small body builder over msgpack-c. */
typedef struct {
    msgpack_sbuffer sb;
    msgpack_packer pk;
} body_t;

static void b_init(body_t *b, uint32_t nfields)
{
    msgpack_sbuffer_init(&b->sb);
    msgpack_packer_init(&b->pk, &b->sb, msgpack_sbuffer_write);
    msgpack_pack_map(&b->pk, nfields);
}

static void b_key(body_t *b, const char *k)
{
    kvt_pack_str(&b->pk, k);
}

static void b_keys(body_t *b, uint32_t n, size_t keylen)
{
    b_key(b, "keys");
    msgpack_pack_array(&b->pk, n);
    uint8_t key[32];
    for (uint32_t i = 0; i < n; i++) {
        memset(key, (int)(i & 0xff), sizeof key);
        msgpack_pack_bin(&b->pk, keylen);
        msgpack_pack_bin_body(&b->pk, key, keylen);
    }
}

static int b_decode(body_t *b, kvt_req_type_t t, kvt_req_t *req)
{
    int rc = kvt_msg_decode((const uint8_t *)b->sb.data, b->sb.size, t, &s_lim, req);
    return rc;
}

static int raw_decode(const char *bytes, size_t len, kvt_req_type_t t, kvt_req_t *req)
{
    return kvt_msg_decode((const uint8_t *)bytes, len, t, &s_lim, req);
}

static void test_prescan_hostile_lengths(void **state)
{
    (void)state;
    char err[160];
    static const struct {
        const char *bytes;
        size_t len;
        int want;
    } cases[] = {
        {"\xdd\xff\xff\xff\xff", 5, KVT_EBADREQ},     /* array32 of 4 billion elements */
        {"\xdf\xff\xff\xff\xff", 5, KVT_EBADREQ},     /* map32 */
        {"\xc6\xff\xff\xff\xff", 5, KVT_EBADREQ},     /* bin32 of 4 GiB */
        {"\xdb\x00\x01\x00\x00", 5, KVT_EBADREQ},     /* str32 longer than the body */
        {"\xc9\x00\x00\x00\x10\x01", 6, KVT_EBADREQ}, /* ext32 */
        {"\x82\xa1\x61", 3, KVT_EBADREQ},             /* truncated map */
        {"\xc1", 1, KVT_EBADREQ},                     /* never-used byte */
        {"\x80\x00", 2, KVT_EBADREQ},                 /* trailing byte */
        {"", 0, KVT_EBADREQ},
        {"\x80", 1, 0},
        {"\x81\xa1\x61\xc0", 4, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        err[0] = '\0';
        int rc =
            kvt_msg_prescan((const uint8_t *)cases[i].bytes, cases[i].len, &s_lim, err, sizeof err);
        assert_int_equal(rc, cases[i].want);
        if (rc)
            assert_true(strlen(err) > 0);
    }
}

static void test_prescan_depth_and_items(void **state)
{
    (void)state;
    char err[160];
    size_t n = 100000;
    uint8_t *deep = malloc(n + 1);
    memset(deep, 0x91, n); /* fixarray of one, nested */
    deep[n] = 0xc0;
    assert_int_equal(kvt_msg_prescan(deep, n + 1, &s_lim, err, sizeof err), KVT_EBADREQ);
    assert_non_null(strstr(err, "nesting"));
    /* exactly max_depth levels pass */
    memset(deep, 0x91, s_lim.max_depth);
    deep[s_lim.max_depth] = 0xc0;
    assert_int_equal(kvt_msg_prescan(deep, s_lim.max_depth + 1, &s_lim, err, sizeof err), 0);
    free(deep);

    kvt_limits_t small;
    kvt_limits_init(&small, 1 << 20, 4); /* max_items = 1032 */
    size_t cnt = small.max_items + 1;
    uint8_t *arr = malloc(5 + cnt);
    arr[0] = 0xdd;
    arr[1] = (uint8_t)(cnt >> 24);
    arr[2] = (uint8_t)(cnt >> 16);
    arr[3] = (uint8_t)(cnt >> 8);
    arr[4] = (uint8_t)cnt;
    memset(arr + 5, 0xc0, cnt);
    assert_int_equal(kvt_msg_prescan(arr, 5 + cnt, &small, err, sizeof err), KVT_ETOOBIG);
    assert_int_equal(kvt_msg_prescan(arr, 5 + cnt, &s_lim, err, sizeof err), 0);
    free(arr);
}

static void test_read_uint(void **state)
{
    (void)state;
    uint64_t v = 0;
    assert_int_equal(kvt_msg_read_uint((const uint8_t *)"\x05", 1, &v), 0);
    assert_int_equal(v, 5);
    assert_int_equal(kvt_msg_read_uint((const uint8_t *)"\xcd\x01\x00", 3, &v), 0);
    assert_int_equal(v, 256);
    assert_int_equal(
        kvt_msg_read_uint((const uint8_t *)"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", 9, &v), 0);
    assert_true(v == UINT64_MAX);
    assert_int_equal(kvt_msg_read_uint((const uint8_t *)"\xd0\x07", 2, &v), 0);
    assert_int_equal(v, 7);
    assert_int_equal(kvt_msg_read_uint((const uint8_t *)"\xd0\xff", 2, &v), KVT_EBADREQ);
    assert_int_equal(kvt_msg_read_uint((const uint8_t *)"\xff", 1, &v), KVT_EBADREQ);
    assert_int_equal(kvt_msg_read_uint((const uint8_t *)"\x05\x05", 2, &v), KVT_EBADREQ);
    assert_int_equal(kvt_msg_read_uint((const uint8_t *)"\xcd\x01", 2, &v), KVT_EBADREQ);
    assert_int_equal(kvt_msg_read_uint((const uint8_t *)"\xa1x", 2, &v), KVT_EBADREQ);
    assert_int_equal(kvt_msg_read_uint((const uint8_t *)"", 0, &v), KVT_EBADREQ);
}

static void test_hello_fields(void **state)
{
    (void)state;
    body_t b;
    b_init(&b, 4);
    b_key(&b, "version");
    msgpack_pack_uint32(&b.pk, 1);
    b_key(&b, "client");
    kvt_pack_str(&b.pk, "vllm");
    b_key(&b, "instance");
    kvt_pack_str(&b.pk, "rank-3");
    b_key(&b, "future_field"); /* ignored */
    msgpack_pack_array(&b.pk, 0);
    kvt_req_t req;
    assert_int_equal(b_decode(&b, KVT_REQ_HELLO, &req), 0);
    assert_int_equal(req.version, 1);
    assert_int_equal(req.instance.len, 6);
    assert_memory_equal(req.instance.ptr, "rank-3", 6);
    assert_memory_equal(req.client.ptr, "vllm", 4);
    assert_true(req.present & KVT_F_INSTANCE);
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
}

/* HELLO's token (1-64 bytes) and PING's instance are optional; elsewhere they are ignored. */
static void test_hello_token_and_ping_instance(void **state)
{
    (void)state;
    static const size_t lens[] = {1, 32, 64, 65, 0};
    static const int want[] = {0, 0, 0, KVT_EBADREQ, KVT_EBADREQ};
    char tok[80];
    memset(tok, 'a', sizeof tok);
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        body_t b;
        b_init(&b, 4);
        b_key(&b, "version");
        msgpack_pack_uint32(&b.pk, 1);
        b_key(&b, "client");
        kvt_pack_str(&b.pk, "c");
        b_key(&b, "instance");
        kvt_pack_str(&b.pk, "i");
        b_key(&b, "token");
        kvt_pack_strn(&b.pk, tok, lens[i]);
        kvt_req_t req;
        assert_int_equal(b_decode(&b, KVT_REQ_HELLO, &req), want[i]);
        if (want[i] == 0) {
            assert_true(req.present & KVT_F_TOKEN);
            assert_int_equal(req.token.len, lens[i]);
        } else {
            assert_non_null(strstr(req.error, "token"));
        }
        kvt_req_release(&req);
        msgpack_sbuffer_destroy(&b.sb);
    }
    body_t b;
    b_init(&b, 1);
    b_key(&b, "instance");
    kvt_pack_str(&b.pk, "engine-0");
    kvt_req_t req;
    assert_int_equal(b_decode(&b, KVT_REQ_PING, &req), 0);
    assert_true(req.present & KVT_F_INSTANCE);
    assert_memory_equal(req.instance.ptr, "engine-0", 8);
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
}

/* Every wire code has one index; the codes that share a wire string share it. */
static void test_wire_error_table(void **state)
{
    (void)state;
    assert_string_equal(kvt_err_wire(KVT_ENOINST), "instance_dropped");
    assert_int_equal(kvt_err_from_wire("instance_dropped", 16), KVT_ENOINST);
    assert_int_equal(kvt_err_wire_index(KVT_ENOINST), KVT_WIRE_ERRORS - 1);
    assert_string_equal(kvt_err_wire_name(KVT_WIRE_ERRORS - 1), "instance_dropped");
    assert_int_equal(kvt_err_wire_index(KVT_ENOMEM), kvt_err_wire_index(KVT_EINTERNAL));
    assert_int_equal(kvt_err_wire_index(KVT_EINVAL), kvt_err_wire_index(KVT_EBADREQ));
    for (int i = 0; i < KVT_WIRE_ERRORS; i++) {
        const char *w = kvt_err_wire_name(i);
        assert_int_equal(kvt_err_wire_index(kvt_err_from_wire(w, strlen(w))), i);
        for (int j = 0; j < i; j++)
            assert_string_not_equal(kvt_err_wire_name(j), w);
    }
}

static void test_missing_and_wrong_fields(void **state)
{
    (void)state;
    body_t b;
    kvt_req_t req;
    /* missing instance */
    b_init(&b, 2);
    b_key(&b, "version");
    msgpack_pack_uint32(&b.pk, 1);
    b_key(&b, "client");
    kvt_pack_str(&b.pk, "x");
    assert_int_equal(b_decode(&b, KVT_REQ_HELLO, &req), KVT_EBADREQ);
    assert_non_null(strstr(req.error, "instance"));
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
    /* wrong type */
    b_init(&b, 3);
    b_key(&b, "version");
    kvt_pack_str(&b.pk, "1");
    b_key(&b, "client");
    kvt_pack_str(&b.pk, "x");
    b_key(&b, "instance");
    kvt_pack_str(&b.pk, "i");
    assert_int_equal(b_decode(&b, KVT_REQ_HELLO, &req), KVT_EBADREQ);
    assert_non_null(strstr(req.error, "'version': expected uint, got str"));
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
    /* nil means absent: a required field given as nil is missing */
    b_init(&b, 3);
    b_key(&b, "version");
    msgpack_pack_uint32(&b.pk, 1);
    b_key(&b, "client");
    kvt_pack_str(&b.pk, "x");
    b_key(&b, "instance");
    msgpack_pack_nil(&b.pk);
    assert_int_equal(b_decode(&b, KVT_REQ_HELLO, &req), KVT_EBADREQ);
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
    /* duplicate field */
    b_init(&b, 2);
    b_key(&b, "instance");
    kvt_pack_str(&b.pk, "a");
    b_key(&b, "instance");
    kvt_pack_str(&b.pk, "b");
    assert_int_equal(b_decode(&b, KVT_REQ_BYE, &req), KVT_EBADREQ);
    assert_non_null(strstr(req.error, "twice"));
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
    /* non-map body, int keys */
    assert_int_equal(raw_decode("\x92\x01\x02", 3, KVT_REQ_PING, &req), KVT_EBADREQ);
    assert_non_null(strstr(req.error, "map"));
    kvt_req_release(&req);
    assert_int_equal(raw_decode("\x81\x01\x02", 3, KVT_REQ_PING, &req), KVT_EBADREQ);
    kvt_req_release(&req);
    assert_int_equal(raw_decode("\x80", 1, KVT_REQ_PING, &req), 0);
    kvt_req_release(&req);
}

static void test_keys(void **state)
{
    (void)state;
    body_t b;
    kvt_req_t req;
    b_init(&b, 3);
    b_key(&b, "ns");
    kvt_pack_str(&b.pk, "llama-3-8b/bf16");
    b_key(&b, "salt");
    kvt_pack_str(&b.pk, "tenant-a");
    b_keys(&b, 64, 16);
    assert_int_equal(b_decode(&b, KVT_REQ_LOOKUP, &req), 0);
    assert_int_equal(req.nkeys, 64);
    assert_int_equal(req.keys[63].b[0], 63);
    assert_int_equal(req.keys[63].b[15], 63);
    assert_int_equal(req.ns.salt_len, 8);
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);

    b_init(&b, 2);
    b_key(&b, "ns");
    kvt_pack_str(&b.pk, "m");
    b_keys(&b, 3, 15);
    assert_int_equal(b_decode(&b, KVT_REQ_GET, &req), KVT_EBADREQ);
    assert_non_null(strstr(req.error, "16-byte"));
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);

    kvt_limits_t small = s_lim;
    small.max_keys = 8;
    b_init(&b, 2);
    b_key(&b, "ns");
    kvt_pack_str(&b.pk, "m");
    b_keys(&b, 9, 16);
    assert_int_equal(
        kvt_msg_decode((const uint8_t *)b.sb.data, b.sb.size, KVT_REQ_ACQUIRE, &small, &req),
        KVT_ETOOBIG);
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);

    /* ns bounds */
    char longns[KVT_MAX_NS + 2];
    memset(longns, 'n', sizeof longns - 1);
    longns[sizeof longns - 1] = '\0';
    b_init(&b, 2);
    b_key(&b, "ns");
    kvt_pack_str(&b.pk, longns);
    b_keys(&b, 1, 16);
    assert_int_equal(b_decode(&b, KVT_REQ_REMOVE, &req), KVT_EBADREQ);
    assert_non_null(strstr(req.error, "ns"));
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
    b_init(&b, 2);
    b_key(&b, "ns");
    kvt_pack_str(&b.pk, "");
    b_keys(&b, 1, 16);
    assert_int_equal(b_decode(&b, KVT_REQ_REMOVE, &req), KVT_EBADREQ);
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
}

static void test_reserve_rules(void **state)
{
    (void)state;
    body_t b;
    kvt_req_t req;
    /* sizes count must match keys */
    b_init(&b, 3);
    b_key(&b, "ns");
    kvt_pack_str(&b.pk, "m");
    b_keys(&b, 2, 16);
    b_key(&b, "sizes");
    msgpack_pack_array(&b.pk, 1);
    msgpack_pack_uint32(&b.pk, 4096);
    assert_int_equal(b_decode(&b, KVT_REQ_RESERVE, &req), KVT_EBADREQ);
    assert_non_null(strstr(req.error, "sizes"));
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
    /* neither sizes nor size */
    b_init(&b, 2);
    b_key(&b, "ns");
    kvt_pack_str(&b.pk, "m");
    b_keys(&b, 2, 16);
    assert_int_equal(b_decode(&b, KVT_REQ_RESERVE, &req), KVT_EBADREQ);
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
    /* size for all */
    b_init(&b, 3);
    b_key(&b, "ns");
    kvt_pack_str(&b.pk, "m");
    b_keys(&b, 2, 16);
    b_key(&b, "size");
    msgpack_pack_uint32(&b.pk, 1 << 20);
    assert_int_equal(b_decode(&b, KVT_REQ_RESERVE, &req), 0);
    assert_int_equal(req.size, 1 << 20);
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
}

/* RESERVE (and PUT) with `labels` built from raw str payloads: n entries, NULL for nil. The
 * decoded labels view the body: s_labels_done frees both. */
static body_t s_lb;

static int s_labels_decode(kvt_req_type_t t, uint32_t nkeys, const char *const *labels,
                           const uint32_t *lens, uint32_t n, kvt_req_t *req)
{
    body_t *b = &s_lb;
    b_init(b, t == KVT_REQ_RESERVE ? 4 : 3);
    b_key(b, "ns");
    kvt_pack_str(&b->pk, "m");
    b_keys(b, nkeys, 16);
    if (t == KVT_REQ_RESERVE) {
        b_key(b, "size");
        msgpack_pack_uint32(&b->pk, 4096);
    }
    b_key(b, "labels");
    msgpack_pack_array(&b->pk, n);
    for (uint32_t i = 0; i < n; i++)
        if (labels[i]) {
            msgpack_pack_str(&b->pk, lens[i]);
            msgpack_pack_str_body(&b->pk, labels[i], lens[i]);
        } else {
            msgpack_pack_nil(&b->pk);
        }
    return b_decode(b, t, req);
}

static void s_labels_done(kvt_req_t *req)
{
    kvt_req_release(req);
    msgpack_sbuffer_destroy(&s_lb.sb);
}

/* labels: one per key, str or nil, at most 255 bytes of strict UTF-8; on RESERVE and PUT. */
static void test_labels(void **state)
{
    (void)state;
    kvt_req_t req;
    const char *ok[3] = {"mm-9f2c", NULL, "\xe6\x97\xa5\xf0\x9f\x98\x80"};
    uint32_t oklen[3] = {7, 0, 7};
    assert_int_equal(s_labels_decode(KVT_REQ_RESERVE, 3, ok, oklen, 3, &req), 0);
    assert_true(req.present & KVT_F_LABELS);
    assert_int_equal(req.nlabels, 3);
    assert_int_equal(req.labels[0].len, 7);
    assert_memory_equal(req.labels[0].ptr, "mm-9f2c", 7);
    assert_int_equal(req.labels[1].len, 0);
    assert_int_equal(req.labels[2].len, 7);
    s_labels_done(&req);
    assert_int_equal(s_labels_decode(KVT_REQ_PUT, 3, ok, oklen, 3, &req), 0);
    assert_int_equal(req.nlabels, 3);
    s_labels_done(&req);
    /* other requests do not take labels: ignored like any unknown field */
    assert_int_equal(s_labels_decode(KVT_REQ_ACQUIRE, 3, ok, oklen, 3, &req), 0);
    assert_false(req.present & KVT_F_LABELS);
    assert_null(req.labels);
    s_labels_done(&req);
    /* one per key */
    assert_int_equal(s_labels_decode(KVT_REQ_RESERVE, 2, ok, oklen, 3, &req), KVT_EBADREQ);
    assert_non_null(strstr(req.error, "'labels' has 3 entries for 2 keys"));
    s_labels_done(&req);
    /* 255 bytes pass, 256 do not */
    char big[256];
    memset(big, 'a', sizeof big);
    const char *one[1] = {big};
    uint32_t len = 255;
    assert_int_equal(s_labels_decode(KVT_REQ_RESERVE, 1, one, &len, 1, &req), 0);
    s_labels_done(&req);
    len = 256;
    assert_int_equal(s_labels_decode(KVT_REQ_RESERVE, 1, one, &len, 1, &req), KVT_EBADREQ);
    assert_non_null(strstr(req.error, "at most 255"));
    s_labels_done(&req);
    /* not UTF-8: a stray continuation byte, a cut sequence, an overlong '/', a surrogate,
     * past U+10FFFF, 0xFF */
    static const char *const bad[] = {"a\x80", "\xe6\x97", "\xc0\xaf", "\xed\xa0\x80",
                                      "\xf4\x90\x80\x80", "\xff"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        const char *l[1] = {bad[i]};
        uint32_t bl = (uint32_t)strlen(bad[i]);
        assert_int_equal(s_labels_decode(KVT_REQ_RESERVE, 1, l, &bl, 1, &req), KVT_EBADREQ);
        assert_non_null(strstr(req.error, "not UTF-8"));
        s_labels_done(&req);
    }
    /* a bin is not a label */
    body_t b;
    b_init(&b, 4);
    b_key(&b, "ns");
    kvt_pack_str(&b.pk, "m");
    b_keys(&b, 1, 16);
    b_key(&b, "size");
    msgpack_pack_uint32(&b.pk, 4096);
    b_key(&b, "labels");
    msgpack_pack_array(&b.pk, 1);
    msgpack_pack_bin(&b.pk, 2);
    msgpack_pack_bin_body(&b.pk, "ab", 2);
    assert_int_equal(b_decode(&b, KVT_REQ_RESERVE, &req), KVT_EBADREQ);
    assert_non_null(strstr(req.error, "labels"));
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
}

static void test_type_limits_and_tokens(void **state)
{
    (void)state;
    kvt_req_t req;
    /* control requests have a small body bound of their own */
    size_t n = 70000;
    char *big = malloc(n);
    big[0] = (char)0xc6; /* bin32 covering the rest */
    uint32_t len = (uint32_t)(n - 5);
    big[1] = (char)(len >> 24);
    big[2] = (char)(len >> 16);
    big[3] = (char)(len >> 8);
    big[4] = (char)len;
    memset(big + 5, 'x', n - 5);
    assert_int_equal(raw_decode(big, n, KVT_REQ_PING, &req), KVT_ETOOBIG);
    kvt_req_release(&req);
    free(big);
    assert_int_equal(raw_decode("\x80", 1, (kvt_req_type_t)99, &req), KVT_EUNKTYPE);
    kvt_req_release(&req);

    body_t b;
    b_init(&b, 1);
    b_key(&b, "tokens");
    msgpack_pack_bin(&b.pk, 6);
    msgpack_pack_bin_body(&b.pk, "abcdef", 6);
    assert_int_equal(b_decode(&b, KVT_REQ_HASH_TOKENS, &req), KVT_EBADREQ);
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
}

static void test_error_body_roundtrip(void **state)
{
    (void)state;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    kvt_pack_error(&pk, KVT_ENOMEM, "");
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    assert_int_equal(msgpack_unpack_next(&up, sb.data, sb.size, &off), MSGPACK_UNPACK_SUCCESS);
    const msgpack_object *err = &up.data.via.map.ptr[1].val;
    assert_int_equal(err->type, MSGPACK_OBJECT_MAP);
    assert_int_equal(err->via.map.ptr[0].val.via.str.size, strlen("internal"));
    assert_memory_equal(err->via.map.ptr[0].val.via.str.ptr, "internal", 8);
    assert_memory_equal(err->via.map.ptr[1].val.via.str.ptr, "out of memory", 13);
    msgpack_unpacked_destroy(&up);
    msgpack_sbuffer_destroy(&sb);
    assert_string_equal(kvt_err_wire(KVT_ENOSPC), "no_space");
    assert_int_equal(kvt_err_from_wire("lease_expired", 13), KVT_ELEXPIRED);
    assert_int_equal(kvt_err_from_wire("nonsense", 8), KVT_EINTERNAL);
}

/* Seeded random bytes and mutations of valid bodies: every outcome is 0 or a KVT_E* code,
 * and ASan/UBSan see no fault or leak. */
static void test_random_inputs(void **state)
{
    (void)state;
    body_t b;
    b_init(&b, 4);
    b_key(&b, "ns");
    kvt_pack_str(&b.pk, "model");
    b_key(&b, "lock");
    msgpack_pack_true(&b.pk);
    b_key(&b, "prefetch");
    msgpack_pack_false(&b.pk);
    b_keys(&b, 8, 16);
    uint8_t buf[512];
    unsigned seed = 12345;
    int ok = 0;
    for (int i = 0; i < 50000; i++) {
        size_t len;
        if (i % 2) {
            len = (size_t)(rand_r(&seed) % 64);
            for (size_t j = 0; j < len; j++)
                buf[j] = (uint8_t)rand_r(&seed);
        } else {
            len = b.sb.size;
            memcpy(buf, b.sb.data, len);
            for (int m = 0; m < 1 + rand_r(&seed) % 4; m++)
                buf[rand_r(&seed) % len] = (uint8_t)rand_r(&seed);
            if (rand_r(&seed) % 4 == 0)
                len = (size_t)rand_r(&seed) % (len + 1);
        }
        kvt_req_type_t t = (kvt_req_type_t)(1 + rand_r(&seed) % (KVT_REQ_SLOTS - 1));
        kvt_req_t req;
        int rc = kvt_msg_decode(buf, len, t, &s_lim, &req);
        assert_true(rc == 0 || (rc < 0 && rc >= KVT_EINVAL));
        if (rc)
            assert_true(strlen(req.error) > 0);
        ok += rc == 0;
        kvt_req_release(&req);
    }
    assert_true(ok > 0); /* mutations that keep the body valid do decode */
    msgpack_sbuffer_destroy(&b.sb);
}

/* REGISTER_GPU body: `nh` handles of `hlen` bytes, `layers`, optional offsets. */
static void b_register(body_t *b, uint32_t nh, size_t hlen, uint64_t layers, int noffsets)
{
    b_init(b, 7 + (noffsets >= 0));
    b_key(b, "device");
    msgpack_pack_uint32(&b->pk, 1);
    b_key(b, "layers");
    msgpack_pack_uint64(&b->pk, layers);
    b_key(b, "num_blocks");
    msgpack_pack_uint32(&b->pk, 1000);
    b_key(b, "block_tokens");
    msgpack_pack_uint32(&b->pk, 16);
    b_key(b, "token_bytes");
    msgpack_pack_uint32(&b->pk, 512);
    b_key(b, "dtype");
    kvt_pack_str(&b->pk, "float16");
    b_key(b, "handles");
    msgpack_pack_array(&b->pk, nh);
    uint8_t h[128];
    for (uint32_t i = 0; i < nh; i++) {
        memset(h, (int)(i + 1), sizeof h);
        msgpack_pack_bin(&b->pk, hlen);
        msgpack_pack_bin_body(&b->pk, h, hlen);
    }
    if (noffsets >= 0) {
        b_key(b, "offsets");
        msgpack_pack_array(&b->pk, (uint32_t)noffsets);
        for (int i = 0; i < noffsets; i++)
            msgpack_pack_uint32(&b->pk, (uint32_t)i * 4096);
    }
}

static void test_register_gpu_decode(void **state)
{
    (void)state;
    body_t b;
    kvt_req_t req;
    b_register(&b, 3, 64, 3, 3);
    assert_int_equal(b_decode(&b, KVT_REQ_REGISTER_GPU, &req), 0);
    assert_int_equal(req.nhandles, 3);
    assert_int_equal(req.layers, 3);
    assert_int_equal(req.device, 1);
    assert_int_equal(req.num_blocks, 1000);
    assert_int_equal(req.block_tokens, 16);
    assert_int_equal(req.token_bytes, 512);
    assert_memory_equal(req.dtype.ptr, "float16", 7);
    assert_int_equal(req.handles[2][63], 3);
    assert_int_equal(req.noffsets, 3);
    assert_int_equal(req.offsets[2], 8192);
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);

    static const struct {
        uint32_t nh;
        size_t hlen;
        uint64_t layers;
        int noffsets;
        int want;
        const char *mention;
    } bad[] = {
        {2, 63, 2, -1, KVT_EBADREQ, "64-byte bin"},
        {2, 65, 2, -1, KVT_EBADREQ, "64-byte bin"},
        {2, 16, 2, -1, KVT_EBADREQ, "entry 0"},
        {2, 64, 3, -1, KVT_EBADREQ, "'layers' is 3"},
        {2, 64, 2, 1, KVT_EBADREQ, "'offsets' has 1"},
        {KVT_MAX_GPU_LAYERS + 1, 64, 1, -1, KVT_ETOOBIG, "at most 4096"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        b_register(&b, bad[i].nh, bad[i].hlen, bad[i].layers, bad[i].noffsets);
        assert_int_equal(b_decode(&b, KVT_REQ_REGISTER_GPU, &req), bad[i].want);
        if (!strstr(req.error, bad[i].mention))
            fail_msg("case %zu: '%s' does not mention '%s'", i, req.error, bad[i].mention);
        kvt_req_release(&req);
        msgpack_sbuffer_destroy(&b.sb);
    }
    /* a missing layout field is named */
    b_init(&b, 1);
    b_key(&b, "device");
    msgpack_pack_uint32(&b.pk, 0);
    assert_int_equal(b_decode(&b, KVT_REQ_REGISTER_GPU, &req), KVT_EBADREQ);
    assert_non_null(strstr(req.error, "register_gpu needs field"));
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
}

/* STORE_GPU / RETRIEVE_GPU body: nkeys keys, nids block ids, an event of elen bytes (0: none). */
static void b_copy(body_t *b, uint32_t nkeys, uint32_t nids, size_t elen)
{
    b_init(b, 4 + (elen > 0));
    b_key(b, "ns");
    kvt_pack_str(&b->pk, "m");
    b_keys(b, nkeys, 16);
    b_key(b, "device");
    msgpack_pack_uint32(&b->pk, 0);
    b_key(b, "block_ids");
    msgpack_pack_array(&b->pk, nids);
    for (uint32_t i = 0; i < nids; i++)
        msgpack_pack_uint32(&b->pk, 1000 - i);
    if (elen) {
        uint8_t ev[80];
        memset(ev, 7, sizeof ev);
        b_key(b, "event");
        msgpack_pack_bin(&b->pk, elen);
        msgpack_pack_bin_body(&b->pk, ev, elen);
    }
}

static void test_gpu_copy_decode(void **state)
{
    (void)state;
    body_t b;
    kvt_req_t req;
    for (int t = KVT_REQ_STORE_GPU; t <= KVT_REQ_RETRIEVE_GPU; t++) {
        b_copy(&b, 4, 64, 64);
        assert_int_equal(b_decode(&b, (kvt_req_type_t)t, &req), 0);
        assert_int_equal(req.nkeys, 4);
        assert_int_equal(req.nblock_ids, 64);
        assert_int_equal(req.block_ids[63], 1000 - 63);
        assert_int_equal(req.event.len, 64);
        kvt_req_release(&req);
        msgpack_sbuffer_destroy(&b.sb);
        static const struct {
            uint32_t nkeys, nids;
            size_t elen;
        } bad[] = {{4, 63, 0}, {4, 0, 0}, {0, 4, 0}, {2, 4, 63}, {2, 4, 65}};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            b_copy(&b, bad[i].nkeys, bad[i].nids, bad[i].elen);
            assert_int_equal(b_decode(&b, (kvt_req_type_t)t, &req), KVT_EBADREQ);
            assert_true(strstr(req.error, "block_ids") || strstr(req.error, "event"));
            kvt_req_release(&req);
            msgpack_sbuffer_destroy(&b.sb);
        }
    }
    /* block ids are bounded by the body's element budget, not by max_keys */
    kvt_limits_t small;
    kvt_limits_init(&small, 256u << 20, 16);
    b_copy(&b, 16, 16 * 80, 0); /* 1296 elements > max_items (2 x 16 + 1024) */
    assert_int_equal(
        kvt_msg_decode((const uint8_t *)b.sb.data, b.sb.size, KVT_REQ_STORE_GPU, &small, &req),
        KVT_ETOOBIG);
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
    b_copy(&b, 16, 16 * 16, 0);
    assert_int_equal(
        kvt_msg_decode((const uint8_t *)b.sb.data, b.sb.size, KVT_REQ_STORE_GPU, &small, &req), 0);
    kvt_req_release(&req);
    msgpack_sbuffer_destroy(&b.sb);
}

/* Where the server runs each type (KVT_REQ_MAP's run class): the slow ones on the worker pool,
 * LOOKUP inline and then, for its L2 part, on the lookup pool, everything else inline. */
static void test_run_classes(void **state)
{
    (void)state;
    for (uint64_t t = 0; t < KVT_REQ_SLOTS + 2; t++) {
        const kvt_req_info_t *info = kvt_proto_info(t);
        if (t == 0 || t >= KVT_REQ_SLOTS) {
            assert_null(info);
            continue;
        }
        assert_non_null(info);
        kvt_run_class_t want = KVT_RUN_INLINE;
        switch (t) {
        case KVT_REQ_PUT:
        case KVT_REQ_CLEAR:
        case KVT_REQ_REGISTER_GPU:
        case KVT_REQ_UNREGISTER_GPU:
        case KVT_REQ_STORE_GPU:
        case KVT_REQ_RETRIEVE_GPU:
            want = KVT_RUN_WORKER;
            break;
        case KVT_REQ_LOOKUP:
            want = KVT_RUN_INLINE_THEN_LOOKUP;
            break;
        }
        assert_int_equal(info->run, want);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prescan_hostile_lengths),
        cmocka_unit_test(test_prescan_depth_and_items),
        cmocka_unit_test(test_read_uint),
        cmocka_unit_test(test_hello_fields),
        cmocka_unit_test(test_hello_token_and_ping_instance),
        cmocka_unit_test(test_wire_error_table),
        cmocka_unit_test(test_missing_and_wrong_fields),
        cmocka_unit_test(test_keys),
        cmocka_unit_test(test_reserve_rules),
        cmocka_unit_test(test_labels),
        cmocka_unit_test(test_type_limits_and_tokens),
        cmocka_unit_test(test_error_body_roundtrip),
        cmocka_unit_test(test_random_inputs),
        cmocka_unit_test(test_register_gpu_decode),
        cmocka_unit_test(test_gpu_copy_decode),
        cmocka_unit_test(test_run_classes),
    };
    return cmocka_run_group_tests(tests, s_setup, NULL);
}
