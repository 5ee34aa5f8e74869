/* libFuzzer harness for the LMCache MP wire (protocol/kvt_lmc.c).
 *
 * Input: byte 0 picks the target (low nibble mod S_NTARGETS: op frame, key, registration
 * payload, int with and without nil, uint, bool, double, str, bin length, block-allocation
 * records, error reply encoder, the registry file a restarted daemon reads: daemon/
 * kvt_lmc_registry.c) and, with bit 7, small limits instead of large ones; the rest is the
 * frame (for the registry, with bit 4: payloads to encode into a valid file, one byte of it
 * then flipped with bit 5; else the file as is). Decoded values are read back and their documented
 * invariants checked, so a decoder that returns 0 with a broken result aborts too. Any crash,
 * sanitizer report, leak or abort is a finding. Build and run: make fuzz (see the Makefile's fuzz
 * section). */
#include "kvt_error.h"
#include "kvt_lmc.h"
#include "kvt_lmc_registry.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum {
    T_OP,
    T_KEY,
    T_CTX,
    T_INT_NIL,
    T_INT,
    T_UINT,
    T_BOOL,
    T_DOUBLE,
    T_STR,
    T_BIN,
    T_RECORDS,
    T_PACK_ERROR,
    T_REGISTRY,
    S_NTARGETS
};

#define CHECK(x)                                                                               \
    do {                                                                                       \
        if (!(x))                                                                              \
            abort();                                                                           \
    } while (0)

static void s_check_err(int rc, const char *err)
{
    CHECK(rc == 0 || rc == KVT_EBADREQ || rc == KVT_ETOOBIG);
    CHECK(rc == 0 || err[0] != '\0');
    CHECK(strlen(err) < 160);
}

static bool s_printable(const char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || (unsigned char)*s >= 0x7f)
            return false;
    return true;
}

static void s_key(const uint8_t *buf, size_t len, const kvt_lmc_limits_t *lim)
{
    char err[160] = "";
    kvt_lmc_key_t k;
    int rc = kvt_lmc_decode_key(buf, len, lim, &k, err, sizeof err);
    s_check_err(rc, err);
    if (rc == 0) {
        size_t ml = strlen(k.model);
        CHECK(ml >= 1 && ml <= KVT_LMC_MAX_MODEL);
        CHECK(k.world_size >= 1 && k.world_size <= KVT_LMC_MAX_WORLD);
        CHECK(!k.has_worker || k.worker_id < k.world_size);
        CHECK(k.ntokens <= lim->max_tokens && (k.ntokens == 0) == (k.tokens == NULL));
        CHECK(k.start <= k.end);
        CHECK(strlen(k.request_id) <= KVT_LMC_MAX_REQUEST);
        CHECK(k.salt_len <= KVT_MAX_SALT && strlen(k.salt) == k.salt_len);
        CHECK(!strpbrk(k.salt, "@/\\"));
        CHECK((k.null_mask_len == 0) == (k.null_mask == NULL));
        volatile uint32_t sink = 0;
        for (uint32_t i = 0; i < k.ntokens; i++)
            sink ^= k.tokens[i];
        for (uint32_t i = 0; i < k.null_mask_len; i++)
            sink ^= k.null_mask[i];
        (void)sink;
    } else {
        CHECK(k.tokens == NULL && k.null_mask == NULL);
    }
    kvt_lmc_key_free(&k);
}

static void s_ctx(const uint8_t *buf, size_t len, const kvt_lmc_limits_t *lim)
{
    char err[160] = "";
    kvt_lmc_ctx_t c;
    int rc = kvt_lmc_decode_ctx(buf, len, lim, &c, err, sizeof err);
    s_check_err(rc, err);
    if (rc == 0) {
        size_t ml = strlen(c.model);
        CHECK(ml >= 1 && ml <= KVT_LMC_MAX_MODEL);
        CHECK(c.world_size >= 1 && c.world_size <= KVT_LMC_MAX_WORLD);
        CHECK(c.block_size >= 1 && c.num_layers >= 1 && c.num_layers <= 65536);
        CHECK(c.hidden_dim_size >= 1);
        CHECK(strlen(c.dtype) <= KVT_MAX_DTYPE);
        (void)kvt_lmc_dtype_size(c.dtype);
        CHECK(c.nogroups <= KVT_LMC_MAX_OGROUPS);
        CHECK(!c.nogroups || c.tokens_per_chunk >= 1);
        for (uint32_t g = 0; g < c.nogroups; g++) {
            CHECK(c.og[g].ntensors >= 1 && c.og[g].ntensors <= KVT_LMC_MAX_KGROUPS);
            for (uint32_t k = 0; k < c.og[g].ntensors; k++) {
                const kvt_lmc_tensor_t *t = &c.og[g].t[k];
                CHECK(t->ndim >= 1 && t->ndim <= KVT_LMC_MAX_SHAPE);
                for (uint32_t d = 0; d < t->ndim; d++)
                    CHECK(t->shape[d] >= 1 && t->shape[d] <= UINT32_MAX);
                CHECK(strlen(t->dtype) >= 1 && strlen(t->dtype) <= KVT_MAX_DTYPE);
            }
        }
    }
}

/* The message is cut to 4096 bytes and the reply still unpacks as {error_type, message}. */
static void s_pack_error(const uint8_t *buf, size_t len)
{
    char *msg = malloc(len + 1);
    if (!msg)
        return;
    memcpy(msg, buf, len);
    msg[len] = '\0';
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    kvt_lmc_pack_error(&pk, "E", msg);
    msgpack_unpacked mp;
    msgpack_unpacked_init(&mp);
    size_t off = 0;
    CHECK(msgpack_unpack_next(&mp, sb.data, sb.size, &off) == MSGPACK_UNPACK_SUCCESS);
    CHECK(off == sb.size && mp.data.type == MSGPACK_OBJECT_MAP && mp.data.via.map.size == 2);
    const msgpack_object *m = &mp.data.via.map.ptr[1].val;
    size_t want = strlen(msg);
    CHECK(m->type == MSGPACK_OBJECT_STR && m->via.str.size <= 4096);
    CHECK(m->via.str.size == want || (want > 4096 && m->via.str.size >= 4093));
    CHECK(memcmp(m->via.str.ptr, msg, m->via.str.size) == 0);
    msgpack_unpacked_destroy(&mp);
    msgpack_sbuffer_destroy(&sb);
    free(msg);
}

/* The registry: what parses is handed over whole, each payload then read as the door reads it
 * (kvt_lmc_decode_ctx); a file encoded from payloads and left intact parses back to them. */
typedef struct {
    const kvt_lmc_limits_t *lim;
    size_t n;
    const uint8_t *const *want;
    const size_t *wlen;
    bool mismatch;
} s_reg_t;

static void s_reg_payload(void *ctx, const uint8_t *payload, size_t len)
{
    s_reg_t *r = ctx;
    kvt_lmc_ctx_t c;
    char err[160];
    (void)kvt_lmc_decode_ctx(payload, len, r->lim, &c, err, sizeof err);
    if (r->want && (r->wlen[r->n] != len || memcmp(r->want[r->n], payload, len) != 0))
        r->mismatch = true;
    r->n++;
}

static void s_registry(uint8_t sel, const uint8_t *buf, size_t len, const kvt_lmc_limits_t *lim)
{
    const kvt_lmc_arena_t arena = {.shm_name = "kvtier-0123456789abcdef-l1",
                                   .pool_size = 1u << 26,
                                   .dev = 2049,
                                   .ino = 12345,
                                   .chunk_tokens = 256};
    char why[300];
    if (!(sel & 0x10)) {
        s_reg_t r = {.lim = lim};
        int rc = kvt_lmc_registry_parse(buf, len, &arena, s_reg_payload, &r, why, sizeof why);
        CHECK(rc == 0 || (rc == -1 && r.n == 0 && why[0]));
        return;
    }
    /* payloads: u8 length-prefixed pieces of the input, at most 16 */
    const uint8_t *ps[16];
    size_t lens[16], n = 0, at = 0;
    while (n < 16 && at < len) {
        size_t l = buf[at++];
        if (l > len - at)
            l = len - at;
        ps[n] = buf + at;
        lens[n++] = l;
        at += l;
    }
    uint8_t *file = NULL;
    size_t flen = 0;
    CHECK(kvt_lmc_registry_encode(&arena, ps, lens, n, &file, &flen) == 0);
    bool flipped = (sel & 0x20) && flen;
    if (flipped)
        file[(len ? buf[len - 1] * 257u + len : 0) % flen] ^= 0x01; /* a byte the input picks */
    s_reg_t r = {.lim = lim, .want = flipped ? NULL : ps, .wlen = lens};
    int rc = kvt_lmc_registry_parse(file, flen, &arena, s_reg_payload, &r, why, sizeof why);
    if (flipped)
        CHECK(rc == -1 && r.n == 0); /* the checksum covers every byte */
    else
        CHECK(rc == 0 && r.n == n && !r.mismatch);
    free(file);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    uint8_t sel = data[0];
    const uint8_t *buf = data + 1;
    size_t len = size - 1;
    const kvt_lmc_limits_t lim = (sel & 0x80)
                                     ? (kvt_lmc_limits_t){.max_tokens = 16, .max_items = 64}
                                     : (kvt_lmc_limits_t){.max_tokens = 1u << 20,
                                                          .max_items = 1u << 20};
    char err[160] = "";
    int rc = 0;
    uint64_t u = 0;
    bool b = false;
    switch ((sel & 0x0f) % S_NTARGETS) {
    case T_OP: {
        /* bits 4..6: a name buffer of 0..7 bytes, or a roomy one */
        size_t cap = (sel >> 4) & 7;
        char name[64];
        memset(name, 'x', sizeof name);
        kvt_lmc_op_t op = kvt_lmc_op_decode(buf, len, cap ? name : NULL, cap ? cap : 0);
        CHECK(op == KVT_LMC_OP_BAD || op == KVT_LMC_OP_UNKNOWN || kvt_lmc_opinfo(op));
        op = kvt_lmc_op_decode(buf, len, name, sizeof name);
        CHECK(strlen(name) < sizeof name && s_printable(name));
        if (op > 0)
            CHECK(strcmp(name, kvt_lmc_opinfo(op)->name) == 0);
        if (op == KVT_LMC_OP_BAD)
            CHECK(strcmp(name, "?") == 0);
        return 0;
    }
    case T_KEY: s_key(buf, len, &lim); return 0;
    case T_CTX: s_ctx(buf, len, &lim); return 0;
    case T_INT_NIL:
        rc = kvt_lmc_decode_int(buf, len, true, &u, &b, err, sizeof err);
        CHECK(rc || !b || u == 0);
        break;
    case T_INT:
        rc = kvt_lmc_decode_int(buf, len, false, &u, &b, err, sizeof err);
        CHECK(!b);
        break;
    case T_UINT: {
        uint64_t max = (sel & 0x80) ? 256 : UINT64_MAX;
        rc = kvt_lmc_decode_uint(buf, len, max, &u, err, sizeof err);
        CHECK(rc || u <= max);
        break;
    }
    case T_BOOL: rc = kvt_lmc_decode_bool(buf, len, &b, err, sizeof err); break;
    case T_DOUBLE: {
        double d = 0;
        rc = kvt_lmc_decode_double(buf, len, &d, err, sizeof err);
        CHECK(rc || d == d);
        break;
    }
    case T_STR: {
        size_t cap = (sel & 0x80) ? 8 : 600;
        char s[600];
        rc = kvt_lmc_decode_str(buf, len, s, cap, err, sizeof err);
        CHECK(rc || strlen(s) < cap);
        break;
    }
    case T_BIN:
        rc = kvt_lmc_decode_bin_len(buf, len, &u, err, sizeof err);
        CHECK(rc || u < len);
        break;
    case T_RECORDS:
        rc = kvt_lmc_check_records(buf, len, &lim, err, sizeof err);
        s_check_err(rc, err);
        return 0;
    case T_PACK_ERROR: s_pack_error(buf, len); return 0;
    case T_REGISTRY:
        s_registry(sel, buf, len, &lim);
        return 0;
    }
    /* a container where a scalar belongs is the wrong type, never "too big" */
    CHECK(rc != KVT_ETOOBIG);
    s_check_err(rc, err);
    return 0;
}
