/* Unit tests of the LMCache MP wire (protocol/kvt_lmc.c): the example bytes of
 * shared/LMCACHE_MP.md §13, the op table and op frames, IPCCacheServerKey and the registration
 * payload as msgspec encodes them (field order, unknown fields, defaults, strict types, limits),
 * the top-level scalar decoders, the block-allocation records, dtype sizes, the exact bytes of
 * every reply encoder, and a seeded random-input run under ASan/UBSan. */
#include "kvt_error.h"
#include "kvt_lmc.h"
#include "kvt_msg.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#define B(lit) (const uint8_t *)(lit), sizeof(lit) - 1
#define L(lit) {(lit), sizeof(lit) - 1}

static const kvt_lmc_limits_t s_lim = {.max_tokens = 1u << 20, .max_items = 1u << 22};

/* ---- a packer into a growing buffer ---- */

typedef struct {
    msgpack_sbuffer sb;
    msgpack_packer pk;
} buf_t;

static void p_init(buf_t *b)
{
    msgpack_sbuffer_init(&b->sb);
    msgpack_packer_init(&b->pk, &b->sb, msgpack_sbuffer_write);
}

static void p_free(buf_t *b)
{
    msgpack_sbuffer_destroy(&b->sb);
}

static void p_str(buf_t *b, const char *s)
{
    kvt_pack_str(&b->pk, s);
}

static void p_bytes_eq(const buf_t *b, const uint8_t *want, size_t n)
{
    assert_int_equal(b->sb.size, n);
    assert_memory_equal(b->sb.data, want, n);
}

/* ---- §13 example bytes ---- */

static void test_spec_examples(void **state)
{
    (void)state;
    char name[64];
    assert_int_equal(kvt_lmc_op_decode(B("\x15"), name, sizeof name), KVT_LMC_GET_CHUNK_SIZE);
    assert_string_equal(name, "get_chunk_size");
    assert_int_equal(kvt_lmc_op_decode(B("\xa4noop"), name, sizeof name), KVT_LMC_NOOP);
    assert_string_equal(name, "noop");
    assert_int_equal(kvt_lmc_op_decode(B("\x08"), name, sizeof name), KVT_LMC_LOOKUP);

    buf_t b;
    p_init(&b);
    msgpack_pack_uint64(&b.pk, 256);
    p_bytes_eq(&b, B("\xcd\x01\x00"));
    p_free(&b);

    p_init(&b);
    p_str(&b, "OK");
    p_bytes_eq(&b, B("\xa2\x4f\x4b"));
    p_free(&b);

    p_init(&b);
    msgpack_pack_true(&b.pk);
    p_bytes_eq(&b, B("\xc3"));
    p_free(&b);

    char err[160];
    uint64_t n = 99;
    assert_int_equal(kvt_lmc_decode_bin_len(B("\xc4\x00"), &n, err, sizeof err), 0);
    assert_int_equal(n, 0);
    bool v = false;
    assert_int_equal(kvt_lmc_decode_bool(B("\xc3"), &v, err, sizeof err), 0);
    assert_true(v);
}

/* ---- the op table and op frames ---- */

static void test_op_table_roundtrip(void **state)
{
    (void)state;
    assert_null(kvt_lmc_opinfo((kvt_lmc_op_t)0));
    assert_null(kvt_lmc_opinfo((kvt_lmc_op_t)KVT_LMC_NOPS));
    assert_null(kvt_lmc_opinfo(KVT_LMC_OP_UNKNOWN));
    assert_null(kvt_lmc_opinfo(KVT_LMC_OP_BAD));
    int served = 0;
    for (int id = 1; id <= 34; id++) {
        const kvt_lmc_opinfo_t *info = kvt_lmc_opinfo((kvt_lmc_op_t)id);
        assert_non_null(info);
        assert_non_null(info->name);
        assert_true(info->min_args >= 0 && info->min_args <= info->max_args);
        served += info->served;

        char name[64];
        buf_t b;
        p_init(&b);
        p_str(&b, info->name);
        assert_int_equal(kvt_lmc_op_decode((const uint8_t *)b.sb.data, b.sb.size, name,
                                           sizeof name),
                         id);
        assert_string_equal(name, info->name);
        p_free(&b);

        p_init(&b);
        msgpack_pack_int(&b.pk, id);
        assert_int_equal(kvt_lmc_op_decode((const uint8_t *)b.sb.data, b.sb.size, name,
                                           sizeof name),
                         id);
        assert_string_equal(name, info->name);
        p_free(&b);
    }
    /* the engine-driven path of §4: ops 8..24 and 32, and poll_kv_events (34) */
    assert_int_equal(served, 19);
    assert_string_equal(kvt_lmc_opinfo(KVT_LMC_REGISTER_CONTEXT)->name,
                        "register_kv_cache_engine_driven_context");
    assert_string_equal(kvt_lmc_opinfo(KVT_LMC_POLL_KV_EVENTS)->name, "poll_kv_events");

    /* ops after the frozen table come by name only: their row id is never read off the wire */
    char name[64];
    buf_t b;
    p_init(&b);
    p_str(&b, "abort_store");
    assert_int_equal(kvt_lmc_op_decode((const uint8_t *)b.sb.data, b.sb.size, name, sizeof name),
                     KVT_LMC_ABORT_STORE);
    assert_string_equal(name, "abort_store");
    p_free(&b);
    p_init(&b);
    msgpack_pack_int(&b.pk, KVT_LMC_ABORT_STORE);
    assert_int_equal(kvt_lmc_op_decode((const uint8_t *)b.sb.data, b.sb.size, name, sizeof name),
                     KVT_LMC_OP_UNKNOWN);
    assert_string_equal(name, "#35");
    p_free(&b);
    assert_true(kvt_lmc_opinfo(KVT_LMC_ABORT_STORE)->served);
}

static void test_op_frames(void **state)
{
    (void)state;
    char name[64];
    /* any int encoding of a tabled id */
    assert_int_equal(kvt_lmc_op_decode(B("\xcc\x15"), name, sizeof name), KVT_LMC_GET_CHUNK_SIZE);
    assert_int_equal(kvt_lmc_op_decode(B("\xd0\x15"), name, sizeof name), KVT_LMC_GET_CHUNK_SIZE);
    assert_int_equal(kvt_lmc_op_decode(B("\xcf\x00\x00\x00\x00\x00\x00\x00\x16"), name,
                                       sizeof name),
                     KVT_LMC_PING);
    /* any str encoding of a name */
    assert_int_equal(kvt_lmc_op_decode(B("\xd9\x04noop"), name, sizeof name), KVT_LMC_NOOP);
    assert_int_equal(kvt_lmc_op_decode(B("\xda\x00\x04noop"), name, sizeof name), KVT_LMC_NOOP);

    /* unknown ints and names */
    assert_int_equal(kvt_lmc_op_decode(B("\x00"), name, sizeof name), KVT_LMC_OP_UNKNOWN);
    assert_string_equal(name, "#0");
    assert_int_equal(kvt_lmc_op_decode(B("\x23"), name, sizeof name), KVT_LMC_OP_UNKNOWN);
    assert_string_equal(name, "#35");
    assert_int_equal(kvt_lmc_op_decode(B("\xff"), name, sizeof name), KVT_LMC_OP_UNKNOWN);
    assert_string_equal(name, "#-1");
    assert_int_equal(kvt_lmc_op_decode(B("\xcf\xff\xff\xff\xff\xff\xff\xff\xff"), name,
                                       sizeof name),
                     KVT_LMC_OP_UNKNOWN);
    assert_string_equal(name, "#18446744073709551615");
    assert_int_equal(kvt_lmc_op_decode(B("\xb3subscribe_kv_events"), name, sizeof name),
                     KVT_LMC_OP_UNKNOWN);
    assert_string_equal(name, "subscribe_kv_events");
    assert_int_equal(kvt_lmc_op_decode(B("\xa6no\x01op\xff"), name, sizeof name),
                     KVT_LMC_OP_UNKNOWN);
    assert_string_equal(name, "no?op?");
    assert_int_equal(kvt_lmc_op_decode(B("\xa5NOOP!"), name, 4), KVT_LMC_OP_UNKNOWN);
    assert_string_equal(name, "NOO");
    assert_int_equal(kvt_lmc_op_decode(B("\xa3noo"), name, sizeof name), KVT_LMC_OP_UNKNOWN);
    assert_int_equal(kvt_lmc_op_decode(B("\xa0"), name, sizeof name), KVT_LMC_OP_UNKNOWN);
    assert_string_equal(name, "");
    assert_int_equal(kvt_lmc_op_decode(B("\x15"), name, 4), KVT_LMC_GET_CHUNK_SIZE);
    assert_string_equal(name, "get");

    /* not one int or str filling the frame */
    static const struct {
        const char *bytes;
        size_t len;
    } bad[] = {
        L(""),         L("\xc0"),         L("\xc3"),     L("\x91\x15"),
        L("\x81\x15\x15"), L("\xc4\x04noop"), L("\x15\x15"), L("\xa4noo"),
        L("\xcb\x40\x35\x00\x00\x00\x00\x00\x00"), L("\xd4\x01\x15"), L("\xc1"),
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        strcpy(name, "x");
        assert_int_equal(kvt_lmc_op_decode((const uint8_t *)bad[i].bytes, bad[i].len, name,
                                           sizeof name),
                         KVT_LMC_OP_BAD);
        assert_string_equal(name, "?");
    }
    /* name is optional */
    assert_int_equal(kvt_lmc_op_decode(B("\xa4noop"), NULL, 0), KVT_LMC_NOOP);
    assert_int_equal(kvt_lmc_op_decode(B("\xa1z"), NULL, 0), KVT_LMC_OP_UNKNOWN);
    assert_int_equal(kvt_lmc_op_decode(B("\xc0"), name, 0), KVT_LMC_OP_BAD);
}

/* ---- IPCCacheServerKey ---- */

/* Every field in msgspec's declaration order, each value in its smallest encoding. */
static const char s_key_golden[] =
    "\x8b"
    "\xaa" "model_name" "\xa5" "llama"
    "\xaa" "world_size" "\x02"
    "\xa9" "worker_id" "\x01"
    "\xa9" "token_ids" "\x95" "\x01" "\xcc\xff" "\xcd\x01\x00" "\xce\x00\x01\x00\x00"
                              "\xce\xff\xff\xff\xff"
    "\xa5" "start" "\x00"
    "\xa3" "end" "\xcd\x01\x00"
    "\xaa" "request_id" "\xa5" "req-1"
    "\xaa" "cache_salt" "\xa0"
    "\xaf" "request_configs" "\xc0"
    "\xae" "num_kv_readers" "\x01"
    "\xaf" "null_chunk_mask" "\x91\x92\xc2\xc3";

static void test_key_golden(void **state)
{
    (void)state;
    kvt_lmc_key_t k;
    char err[160] = "";
    assert_int_equal(kvt_lmc_decode_key(B(s_key_golden), &s_lim, &k, err, sizeof err), 0);
    assert_string_equal(k.model, "llama");
    assert_int_equal(k.world_size, 2);
    assert_true(k.has_worker);
    assert_int_equal(k.worker_id, 1);
    assert_int_equal(k.ntokens, 5);
    static const uint32_t want[] = {1, 255, 256, 65536, UINT32_MAX};
    assert_memory_equal(k.tokens, want, sizeof want);
    assert_int_equal(k.start, 0);
    assert_int_equal(k.end, 256);
    assert_string_equal(k.request_id, "req-1");
    assert_int_equal(k.salt_len, 0);
    assert_string_equal(k.salt, "");
    assert_int_equal(k.num_kv_readers, 1);
    assert_int_equal(k.null_mask_len, 2);
    assert_false(k.null_mask[0]);
    assert_true(k.null_mask[1]);
    kvt_lmc_key_free(&k);
    assert_null(k.tokens);
    assert_null(k.null_mask);
    kvt_lmc_key_free(&k); /* twice is fine */
    kvt_lmc_key_free(NULL);

    /* §13: a key map starts 8b aa "model_name" */
    assert_memory_equal(s_key_golden, "\x8b\xaamodel_name", 12);
}

/* Fields of a standard key, each writable alone, so a test can leave one out, replace it, or
 * append extra ones. */
enum { F_MODEL, F_WORLD, F_WORKER, F_TOKENS, F_START, F_END, F_REQ, F_SALT, F_CFG, F_READERS,
       F_MASK, F_N };

static void key_field(buf_t *b, int f)
{
    msgpack_packer *pk = &b->pk;
    switch (f) {
    case F_MODEL: p_str(b, "model_name"); p_str(b, "m"); break;
    case F_WORLD: p_str(b, "world_size"); msgpack_pack_uint64(pk, 4); break;
    case F_WORKER: p_str(b, "worker_id"); msgpack_pack_nil(pk); break;
    case F_TOKENS:
        p_str(b, "token_ids");
        msgpack_pack_array(pk, 4);
        for (int i = 0; i < 4; i++)
            msgpack_pack_uint64(pk, 1000 + i);
        break;
    case F_START: p_str(b, "start"); msgpack_pack_uint64(pk, 0); break;
    case F_END: p_str(b, "end"); msgpack_pack_uint64(pk, 4); break;
    case F_REQ: p_str(b, "request_id"); p_str(b, "r"); break;
    case F_SALT: p_str(b, "cache_salt"); p_str(b, "tenant-a"); break;
    case F_CFG:
        p_str(b, "request_configs");
        msgpack_pack_map(pk, 1);
        p_str(b, "lmcache.tag");
        msgpack_pack_array(pk, 1);
        msgpack_pack_float(pk, 1.5f);
        break;
    case F_READERS: p_str(b, "num_kv_readers"); msgpack_pack_uint64(pk, 2); break;
    case F_MASK: p_str(b, "null_chunk_mask"); msgpack_pack_nil(pk); break;
    }
}

/* A key map without the fields in `skip` (bit per F_*), with `extra` more entries that the
 * caller packs next. */
static void key_begin(buf_t *b, uint32_t skip, uint32_t extra)
{
    p_init(b);
    msgpack_pack_map(&b->pk, (uint32_t)(F_N - __builtin_popcount(skip)) + extra);
    for (int f = 0; f < F_N; f++)
        if (!(skip & (1u << f)))
            key_field(b, f);
}

static int key_decode(buf_t *b, const kvt_lmc_limits_t *lim, kvt_lmc_key_t *k, char *err,
                      size_t errlen)
{
    err[0] = '\0';
    int rc = kvt_lmc_decode_key((const uint8_t *)b->sb.data, b->sb.size, lim, k, err, errlen);
    p_free(b);
    if (rc) {
        assert_true(strlen(err) > 0);
        assert_null(k->tokens);
        assert_null(k->null_mask);
    }
    return rc;
}

/* Decodes the standard key with field f replaced by what pack() writes; returns the code and
 * checks err mentions `needle`. */
static int key_with(int f, void (*pack)(buf_t *), const char *needle)
{
    buf_t b;
    key_begin(&b, f < F_N ? 1u << f : 0, 1);
    pack(&b);
    kvt_lmc_key_t k;
    char err[160];
    int rc = key_decode(&b, &s_lim, &k, err, sizeof err);
    if (rc && needle && !strstr(err, needle))
        fail_msg("error '%s' does not mention '%s'", err, needle);
    kvt_lmc_key_free(&k);
    return rc;
}

static void test_key_unknown_and_defaults(void **state)
{
    (void)state;
    buf_t b;
    kvt_lmc_key_t k;
    char err[160];

    /* unknown fields (of a later version) anywhere, with any values, are skipped */
    p_init(&b);
    msgpack_pack_map(&b.pk, F_N + 2);
    p_str(&b, "object_group");
    msgpack_pack_map(&b.pk, 1);
    p_str(&b, "x");
    msgpack_pack_array(&b.pk, 0);
    for (int f = F_N - 1; f >= 0; f--) /* and any order */
        key_field(&b, f);
    p_str(&b, "future_field");
    msgpack_pack_bin(&b.pk, 0);
    assert_int_equal(key_decode(&b, &s_lim, &k, err, sizeof err), 0);
    assert_string_equal(k.model, "m");
    assert_int_equal(k.world_size, 4);
    assert_false(k.has_worker);
    assert_int_equal(k.ntokens, 4);
    assert_int_equal(k.tokens[3], 1003);
    assert_string_equal(k.salt, "tenant-a");
    assert_int_equal(k.salt_len, 8);
    assert_int_equal(k.num_kv_readers, 2);
    assert_null(k.null_mask);
    kvt_lmc_key_free(&k);

    /* optional fields left out take their defaults */
    key_begin(&b, 1u << F_WORKER | 1u << F_SALT | 1u << F_CFG | 1u << F_READERS | 1u << F_MASK,
              0);
    assert_int_equal(key_decode(&b, &s_lim, &k, err, sizeof err), 0);
    assert_false(k.has_worker);
    assert_string_equal(k.salt, "");
    assert_int_equal(k.salt_len, 0);
    assert_int_equal(k.num_kv_readers, 0);
    assert_null(k.null_mask);
    kvt_lmc_key_free(&k);

    /* empty token_ids: no allocation */
    key_begin(&b, 1u << F_TOKENS | 1u << F_END, 2);
    p_str(&b, "token_ids");
    msgpack_pack_array(&b.pk, 0);
    p_str(&b, "end");
    msgpack_pack_uint64(&b.pk, 0);
    assert_int_equal(key_decode(&b, &s_lim, &k, err, sizeof err), 0);
    assert_int_equal(k.ntokens, 0);
    assert_null(k.tokens);
    kvt_lmc_key_free(&k);
}

static void test_key_missing_required(void **state)
{
    (void)state;
    static const struct {
        int f;
        const char *name;
    } req[] = {{F_MODEL, "model_name"}, {F_WORLD, "world_size"}, {F_TOKENS, "token_ids"},
               {F_START, "start"},      {F_END, "end"},          {F_REQ, "request_id"}};
    for (size_t i = 0; i < sizeof req / sizeof req[0]; i++) {
        buf_t b;
        key_begin(&b, 1u << req[i].f, 0);
        kvt_lmc_key_t k;
        char err[160];
        assert_int_equal(key_decode(&b, &s_lim, &k, err, sizeof err), KVT_EBADREQ);
        assert_non_null(strstr(err, req[i].name));
        assert_non_null(strstr(err, "missing"));
    }
}

static void pk_true(buf_t *b) { msgpack_pack_true(&b->pk); }
static void pk_model_bin(buf_t *b)
{
    p_str(b, "model_name");
    msgpack_pack_bin(&b->pk, 1);
    msgpack_pack_bin_body(&b->pk, "m", 1);
}
static void pk_model_empty(buf_t *b) { p_str(b, "model_name"); p_str(b, ""); }
static void pk_model_nul(buf_t *b) { p_str(b, "model_name"); kvt_pack_strn(&b->pk, "a\0b", 3); }
static void pk_model_long(buf_t *b)
{
    char s[KVT_LMC_MAX_MODEL + 2];
    memset(s, 'm', sizeof s - 1);
    s[sizeof s - 1] = '\0';
    p_str(b, "model_name");
    p_str(b, s);
}
static void pk_model_max(buf_t *b)
{
    char s[KVT_LMC_MAX_MODEL + 1];
    memset(s, 'm', sizeof s - 1);
    s[sizeof s - 1] = '\0';
    p_str(b, "model_name");
    p_str(b, s);
}
static void pk_world_bool(buf_t *b) { p_str(b, "world_size"); pk_true(b); }
static void pk_world_0(buf_t *b) { p_str(b, "world_size"); msgpack_pack_uint64(&b->pk, 0); }
static void pk_world_big(buf_t *b)
{
    p_str(b, "world_size");
    msgpack_pack_uint64(&b->pk, KVT_LMC_MAX_WORLD + 1);
}
static void pk_world_float(buf_t *b) { p_str(b, "world_size"); msgpack_pack_double(&b->pk, 4.0); }
static void pk_start_bool(buf_t *b) { p_str(b, "start"); msgpack_pack_false(&b->pk); }
static void pk_start_neg(buf_t *b) { p_str(b, "start"); msgpack_pack_int64(&b->pk, -256); }
static void pk_start_after_end(buf_t *b) { p_str(b, "start"); msgpack_pack_uint64(&b->pk, 5); }
static void pk_worker_3(buf_t *b) { p_str(b, "worker_id"); msgpack_pack_uint64(&b->pk, 3); }
static void pk_worker_4(buf_t *b) { p_str(b, "worker_id"); msgpack_pack_uint64(&b->pk, 4); }
static void pk_worker_str(buf_t *b) { p_str(b, "worker_id"); p_str(b, "0"); }
static void pk_req_bin(buf_t *b) { p_str(b, "request_id"); msgpack_pack_bin(&b->pk, 0); }
static void pk_req_nil(buf_t *b) { p_str(b, "request_id"); msgpack_pack_nil(&b->pk); }
static void pk_req_long(buf_t *b)
{
    char s[KVT_LMC_MAX_REQUEST + 2];
    memset(s, 'r', sizeof s - 1);
    s[sizeof s - 1] = '\0';
    p_str(b, "request_id");
    p_str(b, s);
}
static void pk_salt_slash(buf_t *b) { p_str(b, "cache_salt"); p_str(b, "a/b"); }
static void pk_salt_at(buf_t *b) { p_str(b, "cache_salt"); p_str(b, "a@b"); }
static void pk_salt_bslash(buf_t *b) { p_str(b, "cache_salt"); p_str(b, "a\\b"); }
static void pk_salt_nul(buf_t *b) { p_str(b, "cache_salt"); kvt_pack_strn(&b->pk, "a\0", 2); }
static void pk_salt_bin(buf_t *b) { p_str(b, "cache_salt"); msgpack_pack_bin(&b->pk, 0); }
static void pk_salt_nil(buf_t *b) { p_str(b, "cache_salt"); msgpack_pack_nil(&b->pk); }
static void pk_salt_len(buf_t *b, size_t n)
{
    char s[KVT_MAX_SALT + 2];
    memset(s, 's', n);
    s[n] = '\0';
    p_str(b, "cache_salt");
    p_str(b, s);
}
static void pk_salt_max(buf_t *b) { pk_salt_len(b, KVT_MAX_SALT); }
static void pk_salt_long(buf_t *b) { pk_salt_len(b, KVT_MAX_SALT + 1); }
static void pk_tokens_with(buf_t *b, void (*bad)(msgpack_packer *))
{
    p_str(b, "token_ids");
    msgpack_pack_array(&b->pk, 5);
    for (int i = 0; i < 3; i++)
        msgpack_pack_uint64(&b->pk, 7);
    bad(&b->pk);
    msgpack_pack_uint64(&b->pk, 7);
}
static void tok_2p32(msgpack_packer *pk) { msgpack_pack_uint64(pk, 1ull << 32); }
static void tok_neg(msgpack_packer *pk) { msgpack_pack_int64(pk, -1); }
static void tok_bool(msgpack_packer *pk) { msgpack_pack_true(pk); }
static void tok_float(msgpack_packer *pk) { msgpack_pack_double(pk, 7.0); }
static void pk_tokens_2p32(buf_t *b) { pk_tokens_with(b, tok_2p32); }
static void pk_tokens_neg(buf_t *b) { pk_tokens_with(b, tok_neg); }
static void pk_tokens_bool(buf_t *b) { pk_tokens_with(b, tok_bool); }
static void pk_tokens_float(buf_t *b) { pk_tokens_with(b, tok_float); }
static void pk_tokens_map(buf_t *b) { p_str(b, "token_ids"); msgpack_pack_map(&b->pk, 0); }
static void pk_readers_neg(buf_t *b)
{
    p_str(b, "num_kv_readers");
    msgpack_pack_int64(&b->pk, -1);
}
static void pk_readers_big(buf_t *b)
{
    p_str(b, "num_kv_readers");
    msgpack_pack_uint64(&b->pk, 1ull << 32);
}
static void pk_readers_nil(buf_t *b) { p_str(b, "num_kv_readers"); msgpack_pack_nil(&b->pk); }
static void pk_mask_flat(buf_t *b)
{
    p_str(b, "null_chunk_mask");
    msgpack_pack_array(&b->pk, 1);
    pk_true(b);
}
static void pk_mask_int(buf_t *b)
{
    p_str(b, "null_chunk_mask");
    msgpack_pack_array(&b->pk, 2);
    msgpack_pack_array(&b->pk, 1);
    pk_true(b);
    msgpack_pack_array(&b->pk, 1);
    msgpack_pack_uint64(&b->pk, 1);
}
static void pk_mask_empty(buf_t *b) { p_str(b, "null_chunk_mask"); msgpack_pack_array(&b->pk, 0); }
static void pk_mask_empty_group(buf_t *b)
{
    p_str(b, "null_chunk_mask");
    msgpack_pack_array(&b->pk, 2);
    msgpack_pack_array(&b->pk, 0);
    msgpack_pack_array(&b->pk, 1);
    pk_true(b);
}
static void pk_cfg_any(buf_t *b) { p_str(b, "request_configs"); msgpack_pack_uint64(&b->pk, 3); }
static void pk_dup_model(buf_t *b) { p_str(b, "model_name"); p_str(b, "m"); }
static void pk_int_key(buf_t *b) { msgpack_pack_uint64(&b->pk, 1); msgpack_pack_uint64(&b->pk, 1); }

static void test_key_types_and_ranges(void **state)
{
    (void)state;
    static const struct {
        int f;
        void (*pack)(buf_t *);
        int want;
        const char *needle;
    } cases[] = {
        {F_MODEL, pk_model_bin, KVT_EBADREQ, "model_name must be a str, got bin"},
        {F_MODEL, pk_model_empty, KVT_EBADREQ, "model_name"},
        {F_MODEL, pk_model_nul, KVT_EBADREQ, "NUL"},
        {F_MODEL, pk_model_long, KVT_EBADREQ, "model_name"},
        {F_MODEL, pk_model_max, 0, NULL},
        {F_WORLD, pk_world_bool, KVT_EBADREQ, "world_size must be an int, got bool"},
        {F_WORLD, pk_world_0, KVT_EBADREQ, "world_size"},
        {F_WORLD, pk_world_big, KVT_EBADREQ, "world_size"},
        {F_WORLD, pk_world_float, KVT_EBADREQ, "world_size"},
        {F_START, pk_start_bool, KVT_EBADREQ, "start must be an int, got bool"},
        {F_START, pk_start_neg, KVT_EBADREQ, "start"},
        {F_START, pk_start_after_end, KVT_EBADREQ, "after end"},
        {F_WORKER, pk_worker_3, 0, NULL},
        {F_WORKER, pk_worker_4, KVT_EBADREQ, "worker_id"},
        {F_WORKER, pk_worker_str, KVT_EBADREQ, "worker_id"},
        {F_REQ, pk_req_bin, KVT_EBADREQ, "request_id must be a str, got bin"},
        {F_REQ, pk_req_nil, KVT_EBADREQ, "request_id"},
        {F_REQ, pk_req_long, KVT_EBADREQ, "request_id"},
        {F_SALT, pk_salt_slash, KVT_EBADREQ, "'/'"},
        {F_SALT, pk_salt_at, KVT_EBADREQ, "'@'"},
        {F_SALT, pk_salt_bslash, KVT_EBADREQ, "'\\'"},
        {F_SALT, pk_salt_nul, KVT_EBADREQ, "NUL"},
        {F_SALT, pk_salt_bin, KVT_EBADREQ, "cache_salt must be a str, got bin"},
        {F_SALT, pk_salt_nil, KVT_EBADREQ, "cache_salt"},
        {F_SALT, pk_salt_max, 0, NULL},
        {F_SALT, pk_salt_long, KVT_EBADREQ, "cache_salt"},
        {F_TOKENS, pk_tokens_2p32, KVT_EBADREQ,
         "key: token_ids[3] is not an unsigned 32-bit int"},
        {F_TOKENS, pk_tokens_neg, KVT_EBADREQ, "token_ids[3]"},
        {F_TOKENS, pk_tokens_bool, KVT_EBADREQ, "token_ids[3]"},
        {F_TOKENS, pk_tokens_float, KVT_EBADREQ, "token_ids[3]"},
        {F_TOKENS, pk_tokens_map, KVT_EBADREQ, "token_ids"},
        {F_READERS, pk_readers_neg, KVT_EBADREQ, "num_kv_readers"},
        {F_READERS, pk_readers_big, KVT_EBADREQ, "num_kv_readers"},
        {F_READERS, pk_readers_nil, KVT_EBADREQ, "num_kv_readers"},
        {F_MASK, pk_mask_flat, KVT_EBADREQ, "null_chunk_mask[0]"},
        {F_MASK, pk_mask_int, KVT_EBADREQ, "null_chunk_mask[1][0]"},
        {F_MASK, pk_mask_empty, 0, NULL},
        {F_MASK, pk_mask_empty_group, 0, NULL},
        {F_CFG, pk_cfg_any, 0, NULL},
        /* the standard key has model_name: a second one is a duplicate */
        {F_N, pk_dup_model, KVT_EBADREQ, "given twice"},
        {F_N, pk_int_key, KVT_EBADREQ, "must be str"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = key_with(cases[i].f, cases[i].pack, cases[i].needle);
        if (rc != cases[i].want)
            fail_msg("case %zu: got %d, want %d", i, rc, cases[i].want);
    }
}

static void test_key_limits_and_shape(void **state)
{
    (void)state;
    kvt_lmc_key_t k;
    char err[160];
    buf_t b;

    /* token_ids longer than max_tokens: too big, not malformed */
    kvt_lmc_limits_t lim = {.max_tokens = 3, .max_items = 1024};
    key_begin(&b, 0, 0);
    assert_int_equal(key_decode(&b, &lim, &k, err, sizeof err), KVT_ETOOBIG);
    assert_non_null(strstr(err, "token_ids"));
    lim.max_tokens = 4;
    key_begin(&b, 0, 0);
    assert_int_equal(key_decode(&b, &lim, &k, err, sizeof err), 0);
    kvt_lmc_key_free(&k);

    /* the frame's element budget */
    lim.max_items = 10;
    key_begin(&b, 0, 0);
    assert_int_equal(key_decode(&b, &lim, &k, err, sizeof err), KVT_ETOOBIG);

    /* first group of the null mask is kept */
    key_begin(&b, 1u << F_MASK, 1);
    p_str(&b, "null_chunk_mask");
    msgpack_pack_array(&b.pk, 2);
    msgpack_pack_array(&b.pk, 3);
    msgpack_pack_true(&b.pk);
    msgpack_pack_false(&b.pk);
    msgpack_pack_true(&b.pk);
    msgpack_pack_array(&b.pk, 1);
    msgpack_pack_false(&b.pk);
    assert_int_equal(key_decode(&b, &s_lim, &k, err, sizeof err), 0);
    assert_int_equal(k.null_mask_len, 3);
    assert_true(k.null_mask[0] && !k.null_mask[1] && k.null_mask[2]);
    kvt_lmc_key_free(&k);

    /* not a map; trailing bytes; truncated; hostile counts */
    static const struct {
        const char *bytes;
        size_t len;
    } bad[] = {
        L(""),
        L("\x90"),
        L("\xa3key"),
        L("\x80\xc0"),
        L("\x8b\xaamodel_name"),
        L("\xdf\xff\xff\xff\xff"),
        L("\x81\xa9token_ids\xdd\xff\xff\xff\xff"),
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        assert_int_equal(kvt_lmc_decode_key((const uint8_t *)bad[i].bytes, bad[i].len, &s_lim,
                                            &k, err, sizeof err),
                         KVT_EBADREQ);
        assert_true(strncmp(err, "key: ", 5) == 0);
        assert_null(k.tokens);
    }
    /* an empty map: the first required field is missing */
    assert_int_equal(kvt_lmc_decode_key(B("\x80"), &s_lim, &k, err, sizeof err), KVT_EBADREQ);
    assert_non_null(strstr(err, "model_name"));
    /* err may be NULL */
    assert_int_equal(kvt_lmc_decode_key(B("\x80"), &s_lim, &k, NULL, 0), KVT_EBADREQ);
}

/* The single-pass key decoder's own edges: every int encoding of a token, str8/16/32 names and
 * values, wrong types inside token_ids and where scalars are expected, truncation anywhere
 * (inside token_ids too), counts larger than the bytes, the nesting limit inside skipped
 * values, and a malformation later in the frame winning over an earlier field fault. */

static void p_raw(buf_t *b, const char *bytes, size_t n)
{
    msgpack_sbuffer_write(&b->sb, bytes, n);
}
#define P_RAW(b, lit) p_raw((b), (lit), sizeof(lit) - 1)

static void test_key_single_pass(void **state)
{
    (void)state;
    kvt_lmc_key_t k;
    char err[160];
    buf_t b;

    /* every int encoding of a non-negative value is a token */
    key_begin(&b, 1u << F_TOKENS, 1);
    p_str(&b, "token_ids");
    P_RAW(&b, "\x99" "\x05" "\xcc\x80" "\xcd\x01\x00" "\xce\x00\x01\x00\x00"
              "\xcf\x00\x00\x00\x00\xff\xff\xff\xff" "\xd0\x07" "\xd1\x01\x00"
              "\xd2\x00\x01\x00\x00" "\xd3\x00\x00\x00\x00\x00\x00\x00\x09");
    assert_int_equal(key_decode(&b, &s_lim, &k, err, sizeof err), 0);
    static const uint32_t want[] = {5, 128, 256, 65536, UINT32_MAX, 7, 256, 65536, 9};
    assert_int_equal(k.ntokens, 9);
    assert_memory_equal(k.tokens, want, sizeof want);
    kvt_lmc_key_free(&k);

    /* anything else in token_ids is refused, naming the index */
    static const struct {
        const char *bytes;
        size_t len;
    } bad_tok[] = {
        L("\xe0"),                                 /* negative fixint */
        L("\xd0\xff"),                             /* int8 -1 */
        L("\xd3\xff\xff\xff\xff\xff\xff\xff\xff"), /* int64 -1 */
        L("\xcf\x00\x00\x00\x01\x00\x00\x00\x00"), /* 2^32 */
        L("\xca\x3f\x80\x00\x00"),                 /* float32 1.0 */
        L("\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00"), /* float64 1.0 */
        L("\xc0"), L("\xc3"), L("\xa1" "1"), L("\xc4\x01" "1"), L("\x90"), L("\x80"),
        L("\xd4\x01\x02"),
    };
    for (size_t i = 0; i < sizeof bad_tok / sizeof bad_tok[0]; i++) {
        key_begin(&b, 1u << F_TOKENS, 1);
        p_str(&b, "token_ids");
        P_RAW(&b, "\x93\x01");
        p_raw(&b, bad_tok[i].bytes, bad_tok[i].len);
        P_RAW(&b, "\x02");
        assert_int_equal(key_decode(&b, &s_lim, &k, err, sizeof err), KVT_EBADREQ);
        assert_string_equal(err, "key: token_ids[1] is not an unsigned 32-bit int");
    }

    /* str8 / str16 / str32 for field names and str values */
    key_begin(&b, 1u << F_MODEL | 1u << F_REQ | 1u << F_SALT, 3);
    P_RAW(&b, "\xd9\x0a" "model_name" "\xda\x00\x02" "mm");
    P_RAW(&b, "\xda\x00\x0a" "request_id" "\xdb\x00\x00\x00\x03" "req");
    P_RAW(&b, "\xdb\x00\x00\x00\x0a" "cache_salt" "\xd9\x01" "s");
    assert_int_equal(key_decode(&b, &s_lim, &k, err, sizeof err), 0);
    assert_string_equal(k.model, "mm");
    assert_string_equal(k.request_id, "req");
    assert_string_equal(k.salt, "s");
    assert_int_equal(k.ntokens, 4);
    kvt_lmc_key_free(&k);

    /* a float where an int is expected */
    static const char *const int_fields[] = {"world_size", "worker_id", "start", "end",
                                             "num_kv_readers"};
    static const int int_f[] = {F_WORLD, F_WORKER, F_START, F_END, F_READERS};
    for (size_t i = 0; i < sizeof int_f / sizeof int_f[0]; i++) {
        key_begin(&b, 1u << int_f[i], 1);
        p_str(&b, int_fields[i]);
        P_RAW(&b, "\xcb\x40\x00\x00\x00\x00\x00\x00\x00"); /* 2.0 */
        assert_int_equal(key_decode(&b, &s_lim, &k, err, sizeof err), KVT_EBADREQ);
        assert_non_null(strstr(err, int_fields[i]));
        assert_non_null(strstr(err, "got float"));
    }

    /* truncated anywhere, in the middle of token_ids too: malformed, nothing kept */
    key_begin(&b, 1u << F_TOKENS, 1);
    p_str(&b, "token_ids");
    msgpack_pack_array(&b.pk, 100);
    for (uint32_t i = 0; i < 100; i++)
        msgpack_pack_uint32(&b.pk, i * 1000u);
    size_t full = b.sb.size;
    for (size_t n = 0; n < full; n++) {
        err[0] = '\0';
        assert_int_equal(kvt_lmc_decode_key((const uint8_t *)b.sb.data, n, &s_lim, &k, err,
                                            sizeof err),
                         KVT_EBADREQ);
        assert_true(strncmp(err, "key: ", 5) == 0);
        assert_null(k.tokens);
        assert_null(k.null_mask);
    }
    assert_int_equal(kvt_lmc_decode_key((const uint8_t *)b.sb.data, full, &s_lim, &k, err,
                                        sizeof err),
                     0);
    assert_int_equal(k.ntokens, 100);
    assert_int_equal(k.tokens[99], 99000);
    kvt_lmc_key_free(&k);
    p_free(&b);

    /* a declared count larger than the bytes left: refused before any allocation or loop, even
     * under limits that would admit it */
    kvt_lmc_limits_t big = {.max_tokens = UINT32_MAX, .max_items = UINT32_MAX};
    key_begin(&b, 1u << F_TOKENS, 1);
    p_str(&b, "token_ids");
    P_RAW(&b, "\xdd\x00\x00\x03\xe8" "\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a");
    assert_int_equal(key_decode(&b, &big, &k, err, sizeof err), KVT_EBADREQ);
    assert_string_equal(err, "key: declared 1000 elements but only 10 bytes left");
    key_begin(&b, 1u << F_TOKENS, 1);
    p_str(&b, "token_ids");
    P_RAW(&b, "\xdd\xff\xff\xff\xff" "\x01\x02");
    assert_int_equal(key_decode(&b, &big, &k, err, sizeof err), KVT_EBADREQ);
    key_begin(&b, 1u << F_MASK, 1);
    p_str(&b, "null_chunk_mask");
    P_RAW(&b, "\x91\xdd\xff\xff\xff\xff\xc3");
    assert_int_equal(key_decode(&b, &big, &k, err, sizeof err), KVT_EBADREQ);

    /* nesting inside a skipped value (an unknown field, request_configs): 8 levels below the
     * frame's map are fine, a 9th container with elements is refused */
    static const char *const skipped[] = {"later_field", "request_configs"};
    for (size_t s = 0; s < 2; s++) {
        for (int depth = 6; depth <= 9; depth++) {
            key_begin(&b, s ? 1u << F_CFG : 0, 1);
            p_str(&b, skipped[s]);
            for (int d = 0; d < depth; d++)
                P_RAW(&b, "\x91");
            P_RAW(&b, "\xc0");
            int rc = key_decode(&b, &s_lim, &k, err, sizeof err);
            if (depth <= 7) {
                assert_int_equal(rc, 0);
                kvt_lmc_key_free(&k);
            } else {
                assert_int_equal(rc, KVT_EBADREQ);
                assert_string_equal(err, "key: nesting deeper than 8");
            }
        }
        /* an empty container at the deepest level has no elements */
        key_begin(&b, s ? 1u << F_CFG : 0, 1);
        p_str(&b, skipped[s]);
        P_RAW(&b, "\x91\x91\x91\x91\x91\x91\x91\x90");
        assert_int_equal(key_decode(&b, &s_lim, &k, err, sizeof err), 0);
        kvt_lmc_key_free(&k);
    }

    /* a malformation later in the frame wins over an earlier field fault, and the element
     * budget stays too big */
    p_init(&b);
    msgpack_pack_map(&b.pk, F_N);
    p_str(&b, "model_name");
    msgpack_pack_uint64(&b.pk, 7); /* not a str */
    for (int f = 1; f < F_N; f++)
        key_field(&b, f);
    P_RAW(&b, "\xc0");
    assert_int_equal(key_decode(&b, &s_lim, &k, err, sizeof err), KVT_EBADREQ);
    assert_string_equal(err, "key: 1 trailing bytes after the body");
    p_init(&b);
    msgpack_pack_map(&b.pk, F_N);
    p_str(&b, "model_name");
    msgpack_pack_uint64(&b.pk, 7);
    for (int f = 1; f < F_N; f++)
        key_field(&b, f);
    kvt_lmc_limits_t tight = {.max_tokens = 1024, .max_items = 10};
    assert_int_equal(key_decode(&b, &tight, &k, err, sizeof err), KVT_ETOOBIG);
    /* a field fault inside token_ids, then a truncation after it */
    key_begin(&b, 1u << F_TOKENS, 1);
    p_str(&b, "token_ids");
    P_RAW(&b, "\x93\x01\xc0\xcd\x01"); /* the third element is cut short */
    assert_int_equal(key_decode(&b, &s_lim, &k, err, sizeof err), KVT_EBADREQ);
    assert_string_equal(err, "key: declared length 2 exceeds the 1 bytes left");
    /* the fields are still judged in their fixed order, whatever the map's order */
    p_init(&b);
    msgpack_pack_map(&b.pk, F_N);
    for (int f = F_N - 1; f >= 0; f--) {
        if (f == F_MASK) {
            p_str(&b, "null_chunk_mask");
            msgpack_pack_true(&b.pk);
        } else if (f == F_WORLD) {
            p_str(&b, "world_size");
            msgpack_pack_true(&b.pk);
        } else {
            key_field(&b, f);
        }
    }
    assert_int_equal(key_decode(&b, &s_lim, &k, err, sizeof err), KVT_EBADREQ);
    assert_string_equal(err, "key: world_size must be an int, got bool");
}

/* ---- RegisterEngineDrivenContextPayload ---- */

/* A payload as msgspec encodes the Struct: every field in order, then a later branch's extra
 * trailing fields. */
static const char s_ctx_golden[] =
    "\x8f"
    "\xab" "instance_id" "\xcf\x25\x89\x5f\x01\x02\x03\x04\x05"
    "\xaa" "model_name" "\xb3" "Qwen/Qwen3-8B-local"
    "\xaa" "world_size" "\x02"
    "\xaa" "block_size" "\x10"
    "\xaa" "num_layers" "\x24"
    "\xaf" "hidden_dim_size" "\xcd\x04\x00"
    "\xa9" "dtype_str" "\xa8" "bfloat16"
    "\xa7" "use_mla" "\xc2"
    "\xb2" "num_physical_slots" "\xcd\x01\x00"
    "\xb2" "engine_group_infos" "\x90"
    "\xb6" "group_hidden_dim_sizes" "\xc0"
    "\xb2" "group_layout_descs" "\xc0"
    "\xb7" "enable_l1_kvweave_quant" "\xc2"
    "\xad" "kernel_groups" "\x92\x01\x02"
    "\xb6" "transfer_metadata_wire" "\x81\xa1" "k" "\xc4\x01" "x";

static void test_ctx_golden(void **state)
{
    (void)state;
    kvt_lmc_ctx_t c;
    char err[160] = "";
    int rc = kvt_lmc_decode_ctx(B(s_ctx_golden), &s_lim, &c, err, sizeof err);
    if (rc)
        fail_msg("%s", err);
    assert_int_equal(c.instance_id, 0x25895f0102030405ull);
    assert_string_equal(c.model, "Qwen/Qwen3-8B-local");
    assert_int_equal(c.world_size, 2);
    assert_int_equal(c.block_size, 16);
    assert_int_equal(c.num_layers, 36);
    assert_int_equal(c.hidden_dim_size, 1024);
    assert_string_equal(c.dtype, "bfloat16");
    assert_false(c.use_mla);
    assert_int_equal(c.num_physical_slots, 256);
    assert_int_equal(c.ngroups, 0);
}

typedef struct {
    const char *field;
    void (*pack)(msgpack_packer *);
} ctx_over_t;

/* A payload with its required fields, where `over` (if any) replaces or adds one field and
 * `skip` names one to leave out. */
static int ctx_decode(const char *skip, const ctx_over_t *over, kvt_lmc_ctx_t *c, char *err,
                      size_t errlen)
{
    static const char *const names[] = {"instance_id", "model_name",      "world_size",
                                        "block_size",  "num_layers",      "hidden_dim_size",
                                        "dtype_str",   "use_mla",         "num_physical_slots",
                                        "engine_group_infos"};
    buf_t b;
    p_init(&b);
    uint32_t n = 0;
    for (size_t i = 0; i < 10; i++)
        n += !(skip && strcmp(skip, names[i]) == 0) &&
             !(over && strcmp(over->field, names[i]) == 0);
    msgpack_pack_map(&b.pk, n + (over != NULL));
    for (size_t i = 0; i < 10; i++) {
        if ((skip && strcmp(skip, names[i]) == 0) || (over && strcmp(over->field, names[i]) == 0))
            continue;
        p_str(&b, names[i]);
        switch (i) {
        case 0: msgpack_pack_int64(&b.pk, -5); break;
        case 1: p_str(&b, "m"); break;
        case 2: msgpack_pack_uint64(&b.pk, 1); break;
        case 3: msgpack_pack_uint64(&b.pk, 16); break;
        case 4: msgpack_pack_uint64(&b.pk, 2); break;
        case 5: msgpack_pack_uint64(&b.pk, 128); break;
        case 6: p_str(&b, "float16"); break;
        case 7: msgpack_pack_true(&b.pk); break;
        case 8: msgpack_pack_nil(&b.pk); break;
        case 9:
            msgpack_pack_array(&b.pk, 1);
            msgpack_pack_map(&b.pk, 1);
            p_str(&b, "engine_group_id");
            msgpack_pack_uint64(&b.pk, 0);
            break;
        }
    }
    if (over) {
        p_str(&b, over->field);
        over->pack(&b.pk);
    }
    err[0] = '\0';
    int rc = kvt_lmc_decode_ctx((const uint8_t *)b.sb.data, b.sb.size, &s_lim, c, err, errlen);
    p_free(&b);
    if (rc)
        assert_true(strlen(err) > 0);
    return rc;
}

static void cp_int(msgpack_packer *pk) { msgpack_pack_uint64(pk, 1); }
static void cp_zero(msgpack_packer *pk) { msgpack_pack_uint64(pk, 0); }
static void cp_65537(msgpack_packer *pk) { msgpack_pack_uint64(pk, 65537); }
static void cp_65536(msgpack_packer *pk) { msgpack_pack_uint64(pk, 65536); }
static void cp_true(msgpack_packer *pk) { msgpack_pack_true(pk); }
static void cp_nil(msgpack_packer *pk) { msgpack_pack_nil(pk); }
static void cp_neg(msgpack_packer *pk) { msgpack_pack_int64(pk, -1); }
static void cp_str(msgpack_packer *pk) { kvt_pack_str(pk, "7"); }
static void cp_long_dtype(msgpack_packer *pk)
{
    kvt_pack_str(pk, "float8_e4m3fn_float8_e4m3fn_float8");
}
static void cp_groups_bad(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 2);
    msgpack_pack_map(pk, 0);
    msgpack_pack_uint64(pk, 1);
}
static void cp_groups_3(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 3);
    for (int i = 0; i < 3; i++)
        msgpack_pack_map(pk, 0);
}
static void cp_map(msgpack_packer *pk) { msgpack_pack_map(pk, 0); }

static void test_ctx_fields(void **state)
{
    (void)state;
    kvt_lmc_ctx_t c;
    char err[160];
    assert_int_equal(ctx_decode(NULL, NULL, &c, err, sizeof err), 0);
    assert_int_equal(c.instance_id, (uint64_t)-5); /* a negative id keeps its bits */
    assert_true(c.use_mla);
    assert_int_equal(c.num_physical_slots, 0); /* nil */
    assert_int_equal(c.ngroups, 1);
    assert_string_equal(c.dtype, "float16");

    /* optional fields left out */
    assert_int_equal(ctx_decode("use_mla", NULL, &c, err, sizeof err), 0);
    assert_false(c.use_mla);
    assert_int_equal(ctx_decode("engine_group_infos", NULL, &c, err, sizeof err), 0);
    assert_int_equal(c.ngroups, 0);
    assert_int_equal(ctx_decode("num_physical_slots", NULL, &c, err, sizeof err), 0);

    static const char *const required[] = {"instance_id", "model_name", "world_size",
                                           "block_size",  "num_layers", "hidden_dim_size",
                                           "dtype_str"};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
        assert_int_equal(ctx_decode(required[i], NULL, &c, err, sizeof err), KVT_EBADREQ);
        assert_non_null(strstr(err, required[i]));
    }

    static const struct {
        ctx_over_t over;
        int want;
        const char *needle;
    } cases[] = {
        {{"instance_id", cp_true}, KVT_EBADREQ, "instance_id"},
        {{"instance_id", cp_nil}, KVT_EBADREQ, "instance_id"},
        {{"block_size", cp_zero}, KVT_EBADREQ, "block_size"},
        {{"num_layers", cp_zero}, KVT_EBADREQ, "num_layers"},
        {{"num_layers", cp_65537}, KVT_EBADREQ, "num_layers"},
        {{"num_layers", cp_65536}, 0, NULL},
        {{"hidden_dim_size", cp_zero}, KVT_EBADREQ, "hidden_dim_size"},
        {{"world_size", cp_zero}, KVT_EBADREQ, "world_size"},
        {{"dtype_str", cp_long_dtype}, KVT_EBADREQ, "dtype_str"},
        {{"dtype_str", cp_int}, KVT_EBADREQ, "dtype_str"},
        {{"use_mla", cp_int}, KVT_EBADREQ, "use_mla must be a bool"},
        {{"use_mla", cp_nil}, KVT_EBADREQ, "use_mla"},
        {{"num_physical_slots", cp_neg}, KVT_EBADREQ, "num_physical_slots"},
        {{"num_physical_slots", cp_str}, KVT_EBADREQ, "num_physical_slots"},
        {{"num_physical_slots", cp_int}, 0, NULL},
        {{"engine_group_infos", cp_groups_bad}, KVT_EBADREQ, "engine_group_infos[1]"},
        {{"engine_group_infos", cp_map}, KVT_EBADREQ, "engine_group_infos"},
        {{"engine_group_infos", cp_nil}, 0, NULL},
        {{"engine_group_infos", cp_groups_3}, 0, NULL},
        {{"group_layout_descs", cp_groups_bad}, 0, NULL}, /* unknown to kvtier: ignored */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = ctx_decode(NULL, &cases[i].over, &c, err, sizeof err);
        if (rc != cases[i].want)
            fail_msg("case %zu (%s): got %d, want %d (%s)", i, cases[i].over.field, rc,
                     cases[i].want, err);
        if (rc && !strstr(err, cases[i].needle))
            fail_msg("case %zu: '%s' does not mention '%s'", i, err, cases[i].needle);
        if (rc)
            assert_true(strncmp(err, "payload: ", 9) == 0);
    }
    assert_int_equal(ctx_decode(NULL, &cases[18].over, &c, err, sizeof err), 0);
    assert_int_equal(c.ngroups, 3);

    assert_int_equal(kvt_lmc_decode_ctx(B("\x91\x80"), &s_lim, &c, err, sizeof err),
                     KVT_EBADREQ);
    assert_int_equal(kvt_lmc_decode_ctx(B("\x81\xa1x"), &s_lim, &c, err, sizeof err),
                     KVT_EBADREQ);
}

/* ---- top-level scalars ---- */

static void test_scalars(void **state)
{
    (void)state;
    char err[160];
    uint64_t u = 7;
    bool nil = true;

    assert_int_equal(kvt_lmc_decode_int(B("\x00"), false, &u, &nil, err, sizeof err), 0);
    assert_int_equal(u, 0);
    assert_false(nil);
    assert_int_equal(kvt_lmc_decode_int(B("\xcf\x25\x89\x5f\x01\x02\x03\x04\x05"), false, &u,
                                        NULL, err, sizeof err),
                     0);
    assert_int_equal(u, 0x25895f0102030405ull);
    assert_int_equal(kvt_lmc_decode_int(B("\xff"), false, &u, NULL, err, sizeof err), 0);
    assert_int_equal(u, UINT64_MAX);
    assert_int_equal(kvt_lmc_decode_int(B("\xd3\x80\x00\x00\x00\x00\x00\x00\x00"), false, &u,
                                        NULL, err, sizeof err),
                     0);
    assert_int_equal(u, 0x8000000000000000ull);
    assert_int_equal(kvt_lmc_decode_int(B("\xc0"), true, &u, &nil, err, sizeof err), 0);
    assert_true(nil);
    assert_int_equal(kvt_lmc_decode_int(B("\xc0"), false, &u, &nil, err, sizeof err),
                     KVT_EBADREQ);
    assert_int_equal(kvt_lmc_decode_int(B("\xc3"), true, &u, &nil, err, sizeof err),
                     KVT_EBADREQ);
    assert_non_null(strstr(err, "bool"));
    assert_int_equal(kvt_lmc_decode_int(B("\xa1" "1"), false, &u, NULL, err, sizeof err),
                     KVT_EBADREQ);
    assert_int_equal(kvt_lmc_decode_int(B("\x01\x02"), false, &u, NULL, err, sizeof err),
                     KVT_EBADREQ);
    assert_int_equal(kvt_lmc_decode_int(B(""), false, &u, NULL, err, sizeof err), KVT_EBADREQ);
    /* a container where a scalar belongs is the wrong type, whatever its size */
    uint8_t big[3 + 40];
    big[0] = 0xdc;
    big[1] = 0;
    big[2] = 40;
    memset(big + 3, 1, 40);
    assert_int_equal(kvt_lmc_decode_int(big, sizeof big, false, &u, NULL, err, sizeof err),
                     KVT_EBADREQ);

    assert_int_equal(kvt_lmc_decode_uint(B("\xcd\x01\x00"), 256, &u, err, sizeof err), 0);
    assert_int_equal(u, 256);
    assert_int_equal(kvt_lmc_decode_uint(B("\xcd\x01\x01"), 256, &u, err, sizeof err),
                     KVT_EBADREQ);
    assert_int_equal(kvt_lmc_decode_uint(B("\xd0\x05"), 256, &u, err, sizeof err), 0);
    assert_int_equal(u, 5);
    assert_int_equal(kvt_lmc_decode_uint(B("\xff"), UINT64_MAX, &u, err, sizeof err),
                     KVT_EBADREQ);
    assert_int_equal(kvt_lmc_decode_uint(B("\xc2"), 1, &u, err, sizeof err), KVT_EBADREQ);

    bool b = true;
    assert_int_equal(kvt_lmc_decode_bool(B("\xc2"), &b, err, sizeof err), 0);
    assert_false(b);
    assert_int_equal(kvt_lmc_decode_bool(B("\x00"), &b, err, sizeof err), 0);
    assert_false(b);
    assert_int_equal(kvt_lmc_decode_bool(B("\x05"), &b, err, sizeof err), 0);
    assert_true(b);
    assert_int_equal(kvt_lmc_decode_bool(B("\xff"), &b, err, sizeof err), 0);
    assert_true(b);
    assert_int_equal(kvt_lmc_decode_bool(B("\xc0"), &b, err, sizeof err), KVT_EBADREQ);
    assert_int_equal(kvt_lmc_decode_bool(B("\xa4true"), &b, err, sizeof err), KVT_EBADREQ);

    double d = 0;
    assert_int_equal(kvt_lmc_decode_double(B("\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00"), &d, err,
                                           sizeof err),
                     0);
    assert_true(d == 1.5);
    assert_int_equal(kvt_lmc_decode_double(B("\xca\x40\x20\x00\x00"), &d, err, sizeof err), 0);
    assert_true(d == 2.5);
    assert_int_equal(kvt_lmc_decode_double(B("\x03"), &d, err, sizeof err), 0);
    assert_true(d == 3.0);
    assert_int_equal(kvt_lmc_decode_double(B("\xfe"), &d, err, sizeof err), 0);
    assert_true(d == -2.0);
    assert_int_equal(kvt_lmc_decode_double(B("\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00"), &d, err,
                                           sizeof err),
                     KVT_EBADREQ); /* NaN */
    assert_int_equal(kvt_lmc_decode_double(B("\xca\x7f\x80\x00\x00"), &d, err, sizeof err),
                     KVT_EBADREQ); /* inf */
    assert_int_equal(kvt_lmc_decode_double(B("\xc3"), &d, err, sizeof err), KVT_EBADREQ);

    char s[8];
    assert_int_equal(kvt_lmc_decode_str(B("\xa5hello"), s, 6, err, sizeof err), 0);
    assert_string_equal(s, "hello");
    assert_int_equal(kvt_lmc_decode_str(B("\xd9\x00"), s, sizeof s, err, sizeof err), 0);
    assert_string_equal(s, "");
    assert_int_equal(kvt_lmc_decode_str(B("\xa5hello"), s, 5, err, sizeof err), KVT_EBADREQ);
    assert_int_equal(kvt_lmc_decode_str(B("\xa3h\0i"), s, sizeof s, err, sizeof err),
                     KVT_EBADREQ);
    assert_int_equal(kvt_lmc_decode_str(B("\xc4\x02hi"), s, sizeof s, err, sizeof err),
                     KVT_EBADREQ); /* bin is not str */
    assert_non_null(strstr(err, "bin"));
    assert_int_equal(kvt_lmc_decode_str(B("\xa0"), s, 0, err, sizeof err), KVT_EBADREQ);

    assert_int_equal(kvt_lmc_decode_bin_len(B("\xc4\x03" "abc"), &u, err, sizeof err), 0);
    assert_int_equal(u, 3);
    assert_int_equal(kvt_lmc_decode_bin_len(B("\xc5\x00\x00"), &u, err, sizeof err), 0);
    assert_int_equal(u, 0);
    assert_int_equal(kvt_lmc_decode_bin_len(B("\xa0"), &u, err, sizeof err),
                     KVT_EBADREQ); /* str is not bin */
    assert_non_null(strstr(err, "str"));
    assert_int_equal(kvt_lmc_decode_bin_len(B("\xc0"), &u, err, sizeof err), KVT_EBADREQ);
    assert_int_equal(kvt_lmc_decode_bin_len(B("\xc4\x04" "abc"), &u, err, sizeof err),
                     KVT_EBADREQ);
}

/* ---- report_block_allocation records ---- */

static void test_records(void **state)
{
    (void)state;
    char err[160];
    buf_t b;
    p_init(&b);
    msgpack_pack_array(&b.pk, 2);
    for (int i = 0; i < 2; i++) {
        msgpack_pack_map(&b.pk, 4);
        p_str(&b, "req_id");
        p_str(&b, "r1");
        p_str(&b, "new_block_ids");
        msgpack_pack_array(&b.pk, 2);
        msgpack_pack_uint64(&b.pk, 3);
        msgpack_pack_int64(&b.pk, -1);
        p_str(&b, "new_token_ids");
        msgpack_pack_array(&b.pk, 1);
        msgpack_pack_uint64(&b.pk, 70000);
        p_str(&b, "later_field");
        msgpack_pack_nil(&b.pk);
    }
    assert_int_equal(kvt_lmc_check_records((const uint8_t *)b.sb.data, b.sb.size, &s_lim, err,
                                           sizeof err),
                     0);
    kvt_lmc_limits_t small = {.max_tokens = 8, .max_items = 8};
    assert_int_equal(kvt_lmc_check_records((const uint8_t *)b.sb.data, b.sb.size, &small, err,
                                           sizeof err),
                     KVT_ETOOBIG);
    p_free(&b);

    assert_int_equal(kvt_lmc_check_records(B("\x90"), &s_lim, err, sizeof err), 0);
    static const struct {
        struct {
            const char *bytes;
            size_t len;
        } f;
        const char *needle;
    } bad[] = {
        {L("\x80"), "array"},
        {L("\x91\x90"), "records[0]"},
        {L("\x91\x82\xa6req_id\xa1r\xadnew_block_ids\x90"), "new_token_ids"},
        {L("\x91\x83\xa6req_id\xc4\x01r\xadnew_block_ids\x90\xadnew_token_ids\x90"), "req_id"},
        {L("\x91\x83\xa6req_id\xa1r\xadnew_block_ids\x91\xc3\xadnew_token_ids\x90"),
         "new_block_ids[0]"},
        {L("\x91\x83\xa6req_id\xa1r\xadnew_block_ids\x90\xadnew_token_ids\x80"),
         "new_token_ids"},
        {L("\x91\x83\xa6req_id\xa1r\xa6req_id\xa1r\xadnew_block_ids\x90"), "twice"},
        {L("\x91\x81\x01\x90"), "must be str"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        int rc = kvt_lmc_check_records((const uint8_t *)bad[i].f.bytes, bad[i].f.len, &s_lim,
                                       err, sizeof err);
        if (rc != KVT_EBADREQ || !strstr(err, bad[i].needle))
            fail_msg("case %zu: rc %d, '%s' (want '%s')", i, rc, err, bad[i].needle);
    }
}

/* ---- dtypes ---- */

static void test_dtype_sizes(void **state)
{
    (void)state;
    static const struct {
        const char *name;
        uint32_t size;
    } tab[] = {
        {"bfloat16", 2}, {"float16", 2},       {"half", 2},        {"float32", 4},
        {"float", 4},    {"float64", 8},       {"double", 8},      {"float8_e4m3fn", 1},
        {"float8_e5m2", 1}, {"uint8", 1},      {"int8", 1},        {"int16", 2},
        {"int32", 4},    {"int64", 8},         {"bool", 1},
    };
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        assert_int_equal(kvt_lmc_dtype_size(tab[i].name), tab[i].size);
    assert_int_equal(kvt_lmc_dtype_size("torch.float16"), 0);
    assert_int_equal(kvt_lmc_dtype_size("Float16"), 0);
    assert_int_equal(kvt_lmc_dtype_size("float16 "), 0);
    assert_int_equal(kvt_lmc_dtype_size("complex64"), 0);
    assert_int_equal(kvt_lmc_dtype_size(""), 0);
    assert_int_equal(kvt_lmc_dtype_size(NULL), 0);
}

/* ---- reply encoders ---- */

static void test_pack_register(void **state)
{
    (void)state;
    buf_t b;
    p_init(&b);
    kvt_lmc_pack_register(&b.pk, "kvtier-ab-1", 1ull << 30, NULL);
    p_bytes_eq(&b, B("\x85"
                     "\xa8" "shm_name" "\xab" "kvtier-ab-1"
                     "\xa9" "pool_size" "\xce\x40\x00\x00\x00"
                     "\xae" "scratch_offset" "\x00"
                     "\xac" "scratch_size" "\x00"
                     "\xa5" "error" "\xc0"));
    p_free(&b);

    p_init(&b);
    kvt_lmc_pack_register(&b.pk, "", 0, "unknown dtype");
    p_bytes_eq(&b, B("\x85"
                     "\xa8" "shm_name" "\xa0"
                     "\xa9" "pool_size" "\x00"
                     "\xae" "scratch_offset" "\x00"
                     "\xac" "scratch_size" "\x00"
                     "\xa5" "error" "\xad" "unknown dtype"));
    p_free(&b);
}

static const kvt_lmc_slot_t s_slot = {
    .offset = 4096, .length = 16384, .shape = {2, 2, 256, 8}, .ndim = 4, .dtype = "bfloat16"};

#define SLOT_BYTES                                                                             \
    "\x84"                                                                                     \
    "\xa6" "offset" "\xcd\x10\x00"                                                             \
    "\xa6" "length" "\xcd\x40\x00"                                                             \
    "\xa5" "shape" "\x94\x02\x02\xcd\x01\x00\x08"                                              \
    "\xa5" "dtype" "\xa8" "bfloat16"

static void test_pack_prepare_store(void **state)
{
    (void)state;
    buf_t b;
    p_init(&b);
    uint32_t idx[2] = {1, 300};
    kvt_lmc_slot_t slots[2] = {s_slot, s_slot};
    slots[1].offset = 1ull << 32;
    slots[1].ndim = 3;
    slots[1].dtype = "float32";
    kvt_lmc_pack_prepare_store(&b.pk, slots, idx, 2);
    p_bytes_eq(&b, B("\x81"
                     "\xa7" "context" "\x82"
                     "\xa5" "slots" "\x92" SLOT_BYTES
                     "\x84"
                     "\xa6" "offset" "\xcf\x00\x00\x00\x01\x00\x00\x00\x00"
                     "\xa6" "length" "\xcd\x40\x00"
                     "\xa5" "shape" "\x93\x02\x02\xcd\x01\x00"
                     "\xa5" "dtype" "\xa7" "float32"
                     "\xad" "chunk_indices" "\x92\x01\xcd\x01\x2c"));
    p_free(&b);

    /* all cached: an empty slots list, never a context without one */
    p_init(&b);
    kvt_lmc_pack_prepare_store(&b.pk, NULL, NULL, 0);
    p_bytes_eq(&b, B("\x81\xa7" "context" "\x82\xa5" "slots" "\x90\xad" "chunk_indices" "\x90"));
    p_free(&b);
}

static void test_pack_prepare_retrieve(void **state)
{
    (void)state;
    buf_t b;
    p_init(&b);
    kvt_lmc_pack_prepare_retrieve(&b.pk, true, &s_slot, 1);
    p_bytes_eq(&b, B("\x83"
                     "\xa7" "success" "\xc3"
                     "\xa4" "data" "\xc4\x00"
                     "\xa7" "context" "\x81"
                     "\xa5" "slots" "\x91" SLOT_BYTES));
    p_free(&b);

    p_init(&b);
    kvt_lmc_pack_prepare_retrieve(&b.pk, false, NULL, 0);
    p_bytes_eq(&b, B("\x83\xa7" "success" "\xc2\xa4" "data" "\xc4\x00\xa7" "context"
                     "\x81\xa5" "slots" "\x90"));
    p_free(&b);
}

static void test_pack_error(void **state)
{
    (void)state;
    buf_t b;
    p_init(&b);
    kvt_lmc_pack_error(&b.pk, "KeyError", "boom");
    p_bytes_eq(&b, B("\x82\xaa" "error_type" "\xa8" "KeyError" "\xa7" "message" "\xa4" "boom"));
    p_free(&b);

    /* cut to 4096 bytes, never inside a UTF-8 sequence */
    static const char head[] = "\x82\xaa" "error_type" "\xa1" "E" "\xa7" "message";
    const size_t hl = sizeof head - 1;
    char *msg = malloc(5002);
    assert_non_null(msg);
    memset(msg, 'x', 5001);
    msg[5001] = '\0';
    p_init(&b);
    kvt_lmc_pack_error(&b.pk, "E", msg);
    assert_int_equal(b.sb.size, hl + 3 + 4096);
    assert_memory_equal(b.sb.data, head, hl);
    assert_memory_equal(b.sb.data + hl, "\xda\x10\x00", 3);
    p_free(&b);

    msg[0] = 'a'; /* then "é" (c3 a9) pairs: byte 4096 is a continuation byte */
    for (size_t i = 1; i + 1 < 5001; i += 2) {
        msg[i] = (char)0xc3;
        msg[i + 1] = (char)0xa9;
    }
    p_init(&b);
    kvt_lmc_pack_error(&b.pk, "E", msg);
    assert_int_equal(b.sb.size, hl + 3 + 4095);
    assert_memory_equal(b.sb.data + hl, "\xda\x0f\xff", 3);
    assert_int_equal((unsigned char)b.sb.data[b.sb.size - 1], 0xa9);
    p_free(&b);

    /* exactly 4096 bytes stays whole */
    msg[4096] = '\0';
    p_init(&b);
    kvt_lmc_pack_error(&b.pk, "E", msg);
    assert_int_equal(b.sb.size, hl + 3 + 4096);
    p_free(&b);
    free(msg);

    p_init(&b);
    kvt_lmc_pack_error(&b.pk, NULL, NULL);
    p_bytes_eq(&b, B("\x82\xaa" "error_type" "\xa0\xa7" "message" "\xa0"));
    p_free(&b);
}

/* ---- random inputs ---- */

static void test_random_inputs(void **state)
{
    (void)state;
    static const char *const seeds[] = {s_key_golden, s_ctx_golden};
    static const size_t seed_len[] = {sizeof s_key_golden - 1, sizeof s_ctx_golden - 1};
    uint8_t buf[512];
    unsigned seed = 4242;
    int ok_key = 0, ok_ctx = 0;
    kvt_lmc_limits_t lim = {.max_tokens = 64, .max_items = 256};
    for (int i = 0; i < 40000; i++) {
        size_t len;
        int which = rand_r(&seed) % 2;
        if (i % 3 == 0) {
            len = (size_t)(rand_r(&seed) % 48);
            for (size_t j = 0; j < len; j++)
                buf[j] = (uint8_t)rand_r(&seed);
        } else {
            len = seed_len[which];
            memcpy(buf, seeds[which], len);
            for (int m = 0; m < 1 + rand_r(&seed) % 3; m++)
                buf[rand_r(&seed) % len] = (uint8_t)rand_r(&seed);
            if (rand_r(&seed) % 4 == 0)
                len = (size_t)rand_r(&seed) % (len + 1);
        }
        char err[160] = "";
        kvt_lmc_key_t k;
        int rc = kvt_lmc_decode_key(buf, len, &lim, &k, err, sizeof err);
        assert_true(rc == 0 || rc == KVT_EBADREQ || rc == KVT_ETOOBIG);
        assert_true(rc == 0 || strlen(err) > 0);
        if (rc == 0)
            assert_true(k.start <= k.end && k.ntokens <= lim.max_tokens);
        ok_key += rc == 0;
        kvt_lmc_key_free(&k);
        kvt_lmc_ctx_t c;
        rc = kvt_lmc_decode_ctx(buf, len, &lim, &c, err, sizeof err);
        assert_true(rc == 0 || rc == KVT_EBADREQ || rc == KVT_ETOOBIG);
        ok_ctx += rc == 0;
        (void)kvt_lmc_check_records(buf, len, &lim, err, sizeof err);
        char name[32];
        kvt_lmc_op_t op = kvt_lmc_op_decode(buf, len, name, sizeof name);
        assert_true(op == KVT_LMC_OP_BAD || op == KVT_LMC_OP_UNKNOWN ||
                    kvt_lmc_opinfo(op) != NULL);
        for (const char *p = name; *p; p++)
            assert_true(*p >= 0x20 && *p < 0x7f);
        uint64_t u;
        bool bv;
        double d;
        (void)kvt_lmc_decode_int(buf, len, true, &u, &bv, err, sizeof err);
        (void)kvt_lmc_decode_uint(buf, len, 1000, &u, err, sizeof err);
        (void)kvt_lmc_decode_bool(buf, len, &bv, err, sizeof err);
        (void)kvt_lmc_decode_double(buf, len, &d, err, sizeof err);
        (void)kvt_lmc_decode_str(buf, len, name, sizeof name, err, sizeof err);
        (void)kvt_lmc_decode_bin_len(buf, len, &u, err, sizeof err);
    }
    assert_true(ok_key > 0 && ok_ctx > 0); /* mutations that keep a frame valid decode */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spec_examples),
        cmocka_unit_test(test_op_table_roundtrip),
        cmocka_unit_test(test_op_frames),
        cmocka_unit_test(test_key_golden),
        cmocka_unit_test(test_key_unknown_and_defaults),
        cmocka_unit_test(test_key_missing_required),
        cmocka_unit_test(test_key_types_and_ranges),
        cmocka_unit_test(test_key_limits_and_shape),
        cmocka_unit_test(test_key_single_pass),
        cmocka_unit_test(test_ctx_golden),
        cmocka_unit_test(test_ctx_fields),
        cmocka_unit_test(test_scalars),
        cmocka_unit_test(test_records),
        cmocka_unit_test(test_dtype_sizes),
        cmocka_unit_test(test_pack_register),
        cmocka_unit_test(test_pack_prepare_store),
        cmocka_unit_test(test_pack_prepare_retrieve),
        cmocka_unit_test(test_pack_error),
        cmocka_unit_test(test_random_inputs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
