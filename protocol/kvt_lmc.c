/* DESIGN: the LMCache MP wire's frames as pure functions of bytes. The key, the one frame on the
 * hot path (4 096 token ids, six times per prompt), is read in a single pass by a cursor that
 * makes the pre-scan's checks element by element and reads each value where it lies, token_ids
 * straight into its array (no pre-scan, no object tree: ≈ 10× faster). Every other decoder runs
 * the bounded pre-scan of kvt_msg over the whole frame (depth 8, an element budget) and only then
 * lets msgpack-c unpack it into a zone of its own, which is destroyed before returning; the only
 * memory that outlives a call is a key's token_ids and null-mask copies (kvt_lmc_key_free).
 * Structs are msgspec maps: a per-struct list of field names, unknown keys skipped, a known one
 * given twice refused. Any thread; no shared state. */
#include "kvt_lmc.h"

#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_msg.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define S_MAX_DEPTH 8
/* a scalar frame has no elements; a few let a wrong-typed small container say what it is */
#define S_SCALAR_ITEMS 16
#define S_MAX_ERROR_MSG 4096

/* ---- the op table ---- */

#define S_CHECK_ID(N, ID, NAME, MIN, MAX, SERVED)                                              \
    _Static_assert((ID) > 0 && (ID) < KVT_LMC_NOPS && (MIN) <= (MAX), #N ": bad table row");
KVT_LMC_OP_MAP(S_CHECK_ID)
#undef S_CHECK_ID

static const kvt_lmc_opinfo_t s_ops[KVT_LMC_NOPS] = {
#define XX(N, ID, NAME, MIN, MAX, SERVED) [ID] = {NAME, MIN, MAX, SERVED},
    KVT_LMC_OP_MAP(XX)
#undef XX
};

const kvt_lmc_opinfo_t *kvt_lmc_opinfo(kvt_lmc_op_t op)
{
    if ((int)op < 1 || (int)op >= KVT_LMC_NOPS || !s_ops[op].name)
        return NULL;
    return &s_ops[op];
}

/* ---- helpers ---- */

static void s_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void s_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static const char *s_type_name(const msgpack_object *o)
{
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return "nil";
    case MSGPACK_OBJECT_BOOLEAN: return "bool";
    case MSGPACK_OBJECT_POSITIVE_INTEGER: return "int";
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return "negative int";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: return "float";
    case MSGPACK_OBJECT_STR: return "str";
    case MSGPACK_OBJECT_ARRAY: return "array";
    case MSGPACK_OBJECT_MAP: return "map";
    case MSGPACK_OBJECT_BIN: return "bin";
    case MSGPACK_OBJECT_EXT: return "ext";
    }
    return "?";
}

/* Pre-scan, then unpack one object filling buf[0..len). On 0 the caller destroys *mp; on
 * failure nothing is left to free. `what` prefixes the sentence in err. */
static int s_unpack(const uint8_t *buf, size_t len, uint32_t max_items, msgpack_unpacked *mp,
                    const char *what, char *err, size_t errlen)
{
    kvt_limits_t lim = {
        .max_body = len > UINT32_MAX ? UINT32_MAX : (uint32_t)len,
        .max_depth = S_MAX_DEPTH,
        .max_items = max_items,
    };
    char why[128];
    int rc = kvt_msg_prescan(buf, len, &lim, why, sizeof why);
    if (rc) {
        s_err(err, errlen, "%s: %s", what, why);
        return rc;
    }
    msgpack_unpacked_init(mp);
    size_t off = 0;
    if (msgpack_unpack_next(mp, (const char *)buf, len, &off) != MSGPACK_UNPACK_SUCCESS ||
        off != len) {
        msgpack_unpacked_destroy(mp);
        s_err(err, errlen, "%s: not one msgpack value", what);
        return KVT_EBADREQ;
    }
    return 0;
}

static int s_wrong(const char *what, const char *field, const char *want,
                   const msgpack_object *o, char *err, size_t errlen)
{
    s_err(err, errlen, "%s: %s must be %s, got %s", what, field, want, s_type_name(o));
    return KVT_EBADREQ;
}

/* A non-negative int in lo..hi (bool is not an int). */
static int s_uint(const msgpack_object *o, const char *what, const char *field, uint64_t lo,
                  uint64_t hi, uint64_t *out, char *err, size_t errlen)
{
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER && o->type != MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return s_wrong(what, field, "an int", o, err, errlen);
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER || o->via.u64 < lo || o->via.u64 > hi) {
        s_err(err, errlen, "%s: %s must be %llu to %llu", what, field, (unsigned long long)lo,
              (unsigned long long)hi);
        return KVT_EBADREQ;
    }
    *out = o->via.u64;
    return 0;
}

/* A str of lo..hi bytes with no NUL and none of `bad`, copied NUL-terminated into out (hi + 1
 * bytes). */
static int s_str(const msgpack_object *o, const char *what, const char *field, uint32_t lo,
                 uint32_t hi, const char *bad, char *out, uint32_t *outlen, char *err,
                 size_t errlen)
{
    if (o->type != MSGPACK_OBJECT_STR)
        return s_wrong(what, field, "a str", o, err, errlen);
    const char *p = o->via.str.ptr;
    uint32_t n = o->via.str.size;
    if (n < lo || n > hi) {
        s_err(err, errlen, "%s: %s must be %u to %u bytes, got %u", what, field, lo, hi, n);
        return KVT_EBADREQ;
    }
    if (n && memchr(p, 0, n)) {
        s_err(err, errlen, "%s: %s contains a NUL byte", what, field);
        return KVT_EBADREQ;
    }
    for (const char *b = bad; b && *b; b++)
        if (n && memchr(p, *b, n)) {
            s_err(err, errlen, "%s: %s contains '%c'", what, field, *b);
            return KVT_EBADREQ;
        }
    if (n)
        memcpy(out, p, n);
    out[n] = '\0';
    if (outlen)
        *outlen = n;
    return 0;
}

/* Collects the values of a msgspec map by field name into vals[] (NULL = absent). Keys must
 * be str; unknown ones are skipped (later versions append fields); a known one given twice is
 * refused, since msgspec and this decoder could disagree on which one wins. */
static int s_fields(const msgpack_object *o, const char *what, const char *const *names, int n,
                    const msgpack_object **vals, char *err, size_t errlen)
{
    if (o->type != MSGPACK_OBJECT_MAP) {
        s_err(err, errlen, "%s: must be a map, got %s", what, s_type_name(o));
        return KVT_EBADREQ;
    }
    for (int f = 0; f < n; f++)
        vals[f] = NULL;
    for (uint32_t i = 0; i < o->via.map.size; i++) {
        const msgpack_object_kv *kv = &o->via.map.ptr[i];
        if (kv->key.type != MSGPACK_OBJECT_STR) {
            s_err(err, errlen, "%s: field names must be str, got %s", what,
                  s_type_name(&kv->key));
            return KVT_EBADREQ;
        }
        for (int f = 0; f < n; f++) {
            size_t flen = strlen(names[f]);
            if (kv->key.via.str.size != flen || memcmp(kv->key.via.str.ptr, names[f], flen))
                continue;
            if (vals[f]) {
                s_err(err, errlen, "%s: field '%s' given twice", what, names[f]);
                return KVT_EBADREQ;
            }
            vals[f] = &kv->val;
            break;
        }
    }
    return 0;
}

static int s_missing(const char *what, const char *field, char *err, size_t errlen)
{
    s_err(err, errlen, "%s: missing required field '%s'", what, field);
    return KVT_EBADREQ;
}

/* ---- op frames ---- */

static void s_name(char *name, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void s_name(char *name, size_t cap, const char *fmt, ...)
{
    if (!name || cap == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, cap, fmt, ap);
    va_end(ap);
}

kvt_lmc_op_t kvt_lmc_op_decode(const uint8_t *buf, size_t len, char *name, size_t cap)
{
    msgpack_unpacked mp;
    if (s_unpack(buf, len, S_SCALAR_ITEMS, &mp, "op", NULL, 0) != 0) {
        s_name(name, cap, "?");
        return KVT_LMC_OP_BAD;
    }
    const msgpack_object *o = &mp.data;
    kvt_lmc_op_t op = KVT_LMC_OP_UNKNOWN;
    switch (o->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        if (o->via.u64 <= KVT_LMC_LEGACY_MAX && kvt_lmc_opinfo((kvt_lmc_op_t)o->via.u64)) {
            op = (kvt_lmc_op_t)o->via.u64;
            s_name(name, cap, "%s", s_ops[op].name);
        } else {
            s_name(name, cap, "#%llu", (unsigned long long)o->via.u64);
        }
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        s_name(name, cap, "#%lld", (long long)o->via.i64);
        break;
    case MSGPACK_OBJECT_STR: {
        const char *p = o->via.str.ptr;
        uint32_t n = o->via.str.size;
        for (int id = 1; id < KVT_LMC_NOPS; id++)
            if (s_ops[id].name && strlen(s_ops[id].name) == n && memcmp(s_ops[id].name, p, n) == 0)
                op = (kvt_lmc_op_t)id;
        if (op != KVT_LMC_OP_UNKNOWN) {
            s_name(name, cap, "%s", s_ops[op].name);
        } else if (name && cap) {
            /* the name goes into logs and metric labels: printable ASCII only */
            size_t k = 0;
            for (; k < n && k + 1 < cap; k++) {
                unsigned char c = (unsigned char)p[k];
                name[k] = c >= 0x20 && c < 0x7f ? (char)c : '?';
            }
            name[k] = '\0';
        }
        break;
    }
    default:
        op = KVT_LMC_OP_BAD;
        s_name(name, cap, "?");
        break;
    }
    msgpack_unpacked_destroy(&mp);
    return op;
}

/* ---- a cursor over msgpack bytes (the key's single pass) ---- */

/* The key is decoded in one pass over its bytes, with no pre-scan and no object tree: the
 * cursor makes kvt_msg_prescan's checks element by element, in the same pre-order and with the
 * same sentences (truncation, invalid bytes, each length against the bytes left, each element
 * count against the bytes left before anything is allocated or looped over, the element budget
 * as KVT_ETOOBIG, nesting past S_MAX_DEPTH, trailing bytes), while the caller reads each value
 * where it lies. A malformed frame is therefore refused exactly as the pre-scan refused it,
 * whatever field faults come before the malformation. */
typedef struct {
    const uint8_t *buf;
    size_t len, off;    /* off <= len */
    uint64_t items;     /* array elements + 2 x map entries met so far */
    uint32_t max_items;
    char why[128];      /* the structural fault, once a function returned non-0 */
} s_cur_t;

static uint64_t s_be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

/* Reads the head of one element at nesting `level` (the frame's object is level 0) into *o: a
 * scalar whole (a str's or bin's bytes point into the frame), a container's type and count (its
 * elements follow: s_cur_rest or the caller). Returns 0, or KVT_EBADREQ / KVT_ETOOBIG with
 * c->why set. */
static int s_cur_head(s_cur_t *c, uint32_t level, msgpack_object *o)
{
    const size_t len = c->len;
    if (c->off >= len) {
        snprintf(c->why, sizeof c->why, "truncated msgpack at byte %zu", c->off);
        return KVT_EBADREQ;
    }
    const uint8_t *buf = c->buf;
    uint8_t b = buf[c->off++];
    if (b <= 0x7f) {
        o->type = MSGPACK_OBJECT_POSITIVE_INTEGER;
        o->via.u64 = b;
        return 0;
    }
    if (b >= 0xe0) {
        o->type = MSGPACK_OBJECT_NEGATIVE_INTEGER;
        o->via.i64 = (int8_t)b;
        return 0;
    }
    int lenbytes = 0, extra = 0, container = 0; /* container: 1 array, 2 map */
    uint64_t payload = 0, n = 0;
    if (b <= 0x8f) {
        container = 2;
        n = b & 0x0f;
    } else if (b <= 0x9f) {
        container = 1;
        n = b & 0x0f;
    } else if (b <= 0xbf) {
        o->type = MSGPACK_OBJECT_STR;
        payload = b & 0x1f;
    } else {
        switch (b) {
        case 0xc0: o->type = MSGPACK_OBJECT_NIL; return 0;
        case 0xc2:
        case 0xc3:
            o->type = MSGPACK_OBJECT_BOOLEAN;
            o->via.boolean = b == 0xc3;
            return 0;
        case 0xc4: o->type = MSGPACK_OBJECT_BIN; lenbytes = 1; break;
        case 0xc5: o->type = MSGPACK_OBJECT_BIN; lenbytes = 2; break;
        case 0xc6: o->type = MSGPACK_OBJECT_BIN; lenbytes = 4; break;
        case 0xd9: o->type = MSGPACK_OBJECT_STR; lenbytes = 1; break;
        case 0xda: o->type = MSGPACK_OBJECT_STR; lenbytes = 2; break;
        case 0xdb: o->type = MSGPACK_OBJECT_STR; lenbytes = 4; break;
        case 0xc7: o->type = MSGPACK_OBJECT_EXT; lenbytes = 1; extra = 1; break; /* + type */
        case 0xc8: o->type = MSGPACK_OBJECT_EXT; lenbytes = 2; extra = 1; break;
        case 0xc9: o->type = MSGPACK_OBJECT_EXT; lenbytes = 4; extra = 1; break;
        case 0xca: o->type = MSGPACK_OBJECT_FLOAT32; payload = 4; break;
        case 0xcb: o->type = MSGPACK_OBJECT_FLOAT64; payload = 8; break;
        case 0xcc: case 0xd0: payload = 1; break;
        case 0xcd: case 0xd1: payload = 2; break;
        case 0xce: case 0xd2: payload = 4; break;
        case 0xcf: case 0xd3: payload = 8; break;
        case 0xd4: o->type = MSGPACK_OBJECT_EXT; payload = 2; break; /* fixext 1..16 + type */
        case 0xd5: o->type = MSGPACK_OBJECT_EXT; payload = 3; break;
        case 0xd6: o->type = MSGPACK_OBJECT_EXT; payload = 5; break;
        case 0xd7: o->type = MSGPACK_OBJECT_EXT; payload = 9; break;
        case 0xd8: o->type = MSGPACK_OBJECT_EXT; payload = 17; break;
        case 0xdc: container = 1; lenbytes = 2; break;
        case 0xdd: container = 1; lenbytes = 4; break;
        case 0xde: container = 2; lenbytes = 2; break;
        case 0xdf: container = 2; lenbytes = 4; break;
        default:
            snprintf(c->why, sizeof c->why, "invalid msgpack byte 0x%02x at %zu", b, c->off - 1);
            return KVT_EBADREQ;
        }
    }
    if (lenbytes) {
        if ((size_t)lenbytes > len - c->off) {
            snprintf(c->why, sizeof c->why, "truncated msgpack length at byte %zu", c->off);
            return KVT_EBADREQ;
        }
        uint64_t v = s_be(buf + c->off, lenbytes);
        c->off += (size_t)lenbytes;
        if (container)
            n = v;
        else
            payload = v + (uint64_t)extra;
    }
    if (payload > len - c->off) {
        snprintf(c->why, sizeof c->why, "declared length %llu exceeds the %zu bytes left",
                 (unsigned long long)payload, len - c->off);
        return KVT_EBADREQ;
    }
    const uint8_t *p = buf + c->off;
    c->off += (size_t)payload;
    if (container) {
        uint64_t children = container == 2 ? 2 * n : n;
        if (container == 2) {
            o->type = MSGPACK_OBJECT_MAP;
            o->via.map.size = (uint32_t)n;
            o->via.map.ptr = NULL;
        } else {
            o->type = MSGPACK_OBJECT_ARRAY;
            o->via.array.size = (uint32_t)n;
            o->via.array.ptr = NULL;
        }
        if (children == 0)
            return 0;
        if (children > len - c->off) {
            snprintf(c->why, sizeof c->why, "declared %llu elements but only %zu bytes left",
                     (unsigned long long)children, len - c->off);
            return KVT_EBADREQ;
        }
        c->items += children;
        if (c->items > c->max_items) {
            snprintf(c->why, sizeof c->why, "more than %u elements in one body", c->max_items);
            return KVT_ETOOBIG;
        }
        if (level + 1 > S_MAX_DEPTH) {
            snprintf(c->why, sizeof c->why, "nesting deeper than %u", S_MAX_DEPTH);
            return KVT_EBADREQ;
        }
        return 0;
    }
    switch (b) {
    case 0xcc: case 0xcd: case 0xce: case 0xcf:
        o->type = MSGPACK_OBJECT_POSITIVE_INTEGER;
        o->via.u64 = s_be(p, (int)payload);
        break;
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        int bits = 8 * (int)payload;
        uint64_t u = s_be(p, (int)payload);
        int64_t v = bits == 64 ? (int64_t)u
                               : (int64_t)(u ^ (1ull << (bits - 1))) - (int64_t)(1ll << (bits - 1));
        if (v >= 0) {
            o->type = MSGPACK_OBJECT_POSITIVE_INTEGER;
            o->via.u64 = (uint64_t)v;
        } else {
            o->type = MSGPACK_OBJECT_NEGATIVE_INTEGER;
            o->via.i64 = v;
        }
        break;
    }
    case 0xca: {
        uint32_t u = (uint32_t)s_be(p, 4);
        float f;
        memcpy(&f, &u, sizeof f);
        o->via.f64 = f;
        break;
    }
    case 0xcb: {
        uint64_t u = s_be(p, 8);
        memcpy(&o->via.f64, &u, sizeof u);
        break;
    }
    default:
        if (o->type == MSGPACK_OBJECT_STR) {
            o->via.str.ptr = (const char *)p;
            o->via.str.size = (uint32_t)payload;
        } else if (o->type == MSGPACK_OBJECT_BIN) {
            o->via.bin.ptr = (const char *)p;
            o->via.bin.size = (uint32_t)payload;
        }
        break;
    }
    return 0;
}

static int s_cur_skip(s_cur_t *c, uint32_t level);

/* Skips the elements of the head *o just read at `level` (none for a scalar). s_cur_head let a
 * container with elements through only below S_MAX_DEPTH, so the recursion is bounded. */
static int s_cur_rest(s_cur_t *c, uint32_t level, const msgpack_object *o)
{
    uint64_t n = o->type == MSGPACK_OBJECT_ARRAY ? o->via.array.size
                 : o->type == MSGPACK_OBJECT_MAP ? 2ull * o->via.map.size
                                                 : 0;
    for (uint64_t i = 0; i < n; i++) {
        int rc = s_cur_skip(c, level + 1);
        if (rc)
            return rc;
    }
    return 0;
}

/* Skips one whole element at `level`. */
static int s_cur_skip(s_cur_t *c, uint32_t level)
{
    msgpack_object o;
    int rc = s_cur_head(c, level, &o);
    return rc ? rc : s_cur_rest(c, level, &o);
}

/* ---- IPCCacheServerKey ---- */

enum {
    K_MODEL,
    K_WORLD,
    K_WORKER,
    K_TOKENS,
    K_START,
    K_END,
    K_REQUEST,
    K_SALT,
    K_CONFIGS,
    K_READERS,
    K_MASK,
    K_COUNT
};
static const char *const s_key_fields[K_COUNT] = {
    [K_MODEL] = "model_name",          [K_WORLD] = "world_size",
    [K_WORKER] = "worker_id",          [K_TOKENS] = "token_ids",
    [K_START] = "start",               [K_END] = "end",
    [K_REQUEST] = "request_id",        [K_SALT] = "cache_salt",
    [K_CONFIGS] = "request_configs",   [K_READERS] = "num_kv_readers",
    [K_MASK] = "null_chunk_mask",
};

/* A field's first fault, kept while the pass goes on (a malformation later in the frame still
 * takes precedence) and reported in the fixed order of s_key_check. */
typedef struct {
    int rc;
    char msg[160];
} s_fault_t;

static int s_key_field(const char *p, uint32_t n)
{
    for (int f = 0; f < K_COUNT; f++)
        if (strlen(s_key_fields[f]) == n && memcmp(s_key_fields[f], p, n) == 0)
            return f;
    return -1;
}

/* token_ids, read in place into a malloc'ed array of its declared count (no more than the bytes
 * left, s_cur_head). Every element is read (the frame must be well-formed to the end); the first
 * one that is not an unsigned 32-bit int is the fault. */
static int s_cur_tokens(s_cur_t *c, const kvt_lmc_limits_t *lim, kvt_lmc_key_t *out,
                        s_fault_t *f)
{
    msgpack_object o;
    int rc = s_cur_head(c, 1, &o);
    if (rc)
        return rc;
    if (o.type != MSGPACK_OBJECT_ARRAY) {
        f->rc = s_wrong("key", "token_ids", "an array of int", &o, f->msg, sizeof f->msg);
        return s_cur_rest(c, 1, &o);
    }
    uint32_t n = o.via.array.size;
    if (n > lim->max_tokens) {
        s_err(f->msg, sizeof f->msg, "key: token_ids has %u entries, at most %u", n,
              lim->max_tokens);
        f->rc = KVT_ETOOBIG;
        return s_cur_rest(c, 1, &o);
    }
    if (n == 0)
        return 0;
    uint32_t *t = malloc((size_t)n * sizeof *t); /* NULL: checked on, ENOMEM if all is well */
    const uint8_t *buf = c->buf;
    const size_t len = c->len;
    size_t off = c->off;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t v;
        size_t left = len - off;
        uint8_t b = left ? buf[off] : 0xc1;
        /* the encodings msgspec writes for token ids; anything else takes the general path */
        if (b <= 0x7f) {
            v = b;
            off += 1;
        } else if (b == 0xcd && left >= 3) {
            v = (uint32_t)buf[off + 1] << 8 | buf[off + 2];
            off += 3;
        } else if (b == 0xce && left >= 5) {
            v = (uint32_t)buf[off + 1] << 24 | (uint32_t)buf[off + 2] << 16 |
                (uint32_t)buf[off + 3] << 8 | buf[off + 4];
            off += 5;
        } else if (b == 0xcc && left >= 2) {
            v = buf[off + 1];
            off += 2;
        } else {
            msgpack_object e;
            c->off = off;
            if ((rc = s_cur_head(c, 2, &e)) || (rc = s_cur_rest(c, 2, &e))) {
                free(t);
                return rc;
            }
            off = c->off;
            if (e.type != MSGPACK_OBJECT_POSITIVE_INTEGER || e.via.u64 > UINT32_MAX) {
                if (!f->rc) {
                    s_err(f->msg, sizeof f->msg,
                          "key: token_ids[%u] is not an unsigned 32-bit int", i);
                    f->rc = KVT_EBADREQ;
                }
                continue;
            }
            v = (uint32_t)e.via.u64;
        }
        if (t)
            t[i] = v;
    }
    c->off = off;
    if (f->rc) {
        free(t);
    } else if (!t) {
        s_err(f->msg, sizeof f->msg, "key: token_ids: out of memory");
        f->rc = KVT_ENOMEM;
    } else {
        out->tokens = t;
        out->ntokens = n;
    }
    return 0;
}

/* null_chunk_mask: nil, or [group][chunk] bools; every group is checked, only the first is kept
 * (read in place). */
static int s_cur_mask(s_cur_t *c, kvt_lmc_key_t *out, s_fault_t *f)
{
    msgpack_object o;
    int rc = s_cur_head(c, 1, &o);
    if (rc || o.type == MSGPACK_OBJECT_NIL)
        return rc;
    if (o.type != MSGPACK_OBJECT_ARRAY) {
        f->rc = s_wrong("key", "null_chunk_mask", "nil or an array of arrays of bool", &o,
                        f->msg, sizeof f->msg);
        return s_cur_rest(c, 1, &o);
    }
    bool *m = NULL;
    uint32_t mlen = 0;
    for (uint32_t g = 0; g < o.via.array.size; g++) {
        msgpack_object grp;
        if ((rc = s_cur_head(c, 2, &grp)))
            goto fail;
        if (grp.type != MSGPACK_OBJECT_ARRAY) {
            if (!f->rc) {
                s_err(f->msg, sizeof f->msg,
                      "key: null_chunk_mask[%u] must be an array of bool, got %s", g,
                      s_type_name(&grp));
                f->rc = KVT_EBADREQ;
            }
            if ((rc = s_cur_rest(c, 2, &grp)))
                goto fail;
            continue;
        }
        uint32_t nc = grp.via.array.size;
        if (g == 0 && nc > 0) {
            m = malloc((size_t)nc * sizeof *m); /* nc <= the bytes left */
            mlen = nc;
        }
        for (uint32_t k = 0; k < nc; k++) {
            msgpack_object e;
            if ((rc = s_cur_head(c, 3, &e)) || (rc = s_cur_rest(c, 3, &e)))
                goto fail;
            if (e.type != MSGPACK_OBJECT_BOOLEAN) {
                if (!f->rc) {
                    s_err(f->msg, sizeof f->msg, "key: null_chunk_mask[%u][%u] is not a bool",
                          g, k);
                    f->rc = KVT_EBADREQ;
                }
                continue;
            }
            if (g == 0 && m)
                m[k] = e.via.boolean;
        }
    }
    if (f->rc || mlen == 0) {
        free(m);
    } else if (!m) {
        s_err(f->msg, sizeof f->msg, "key: null_chunk_mask: out of memory");
        f->rc = KVT_ENOMEM;
    } else {
        out->null_mask = m;
        out->null_mask_len = mlen;
    }
    return 0;
fail:
    free(m);
    return rc;
}

static int s_fault(const s_fault_t *f, char *err, size_t errlen)
{
    s_err(err, errlen, "%s", f->msg);
    return f->rc;
}

/* The field checks, in the order (and with the sentences) of the tree decoder this pass
 * replaced: the map's shape, the required fields, then field by field. v[f] holds a scalar
 * field's value (a container's type and count only), seen[f] whether it was given. */
static int s_key_check(const msgpack_object *v, const bool *seen, const s_fault_t *shape,
                       const s_fault_t *tok, const s_fault_t *mask, kvt_lmc_key_t *out,
                       char *err, size_t errlen)
{
    if (shape->rc)
        return s_fault(shape, err, errlen);
    static const int required[] = {K_MODEL, K_WORLD, K_TOKENS, K_START, K_END, K_REQUEST};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
        if (!seen[required[i]])
            return s_missing("key", s_key_fields[required[i]], err, errlen);

    uint64_t u;
    int rc;
    if ((rc = s_str(&v[K_MODEL], "key", "model_name", 1, KVT_LMC_MAX_MODEL, NULL, out->model,
                    NULL, err, errlen)))
        return rc;
    if ((rc = s_uint(&v[K_WORLD], "key", "world_size", 1, KVT_LMC_MAX_WORLD, &u, err, errlen)))
        return rc;
    out->world_size = (uint32_t)u;
    if (seen[K_WORKER] && v[K_WORKER].type != MSGPACK_OBJECT_NIL) {
        if ((rc = s_uint(&v[K_WORKER], "key", "worker_id", 0, out->world_size - 1, &u, err,
                         errlen)))
            return rc;
        out->has_worker = true;
        out->worker_id = (uint32_t)u;
    }
    if (tok->rc)
        return s_fault(tok, err, errlen);
    if ((rc = s_uint(&v[K_START], "key", "start", 0, UINT64_MAX, &out->start, err, errlen)))
        return rc;
    if ((rc = s_uint(&v[K_END], "key", "end", 0, UINT64_MAX, &out->end, err, errlen)))
        return rc;
    if (out->start > out->end) {
        s_err(err, errlen, "key: start %llu is after end %llu", (unsigned long long)out->start,
              (unsigned long long)out->end);
        return KVT_EBADREQ;
    }
    if ((rc = s_str(&v[K_REQUEST], "key", "request_id", 0, KVT_LMC_MAX_REQUEST, NULL,
                    out->request_id, NULL, err, errlen)))
        return rc;
    /* the salt becomes part of an object's identity and of L2 names: the same bytes msgspec's
     * IPCCacheServerKey refuses */
    if (seen[K_SALT] && (rc = s_str(&v[K_SALT], "key", "cache_salt", 0, KVT_MAX_SALT, "@/\\",
                                    out->salt, &out->salt_len, err, errlen)))
        return rc;
    /* request_configs: any value, not part of identity */
    if (seen[K_READERS]) {
        if ((rc = s_uint(&v[K_READERS], "key", "num_kv_readers", 0, UINT32_MAX, &u, err,
                         errlen)))
            return rc;
        out->num_kv_readers = (uint32_t)u;
    }
    if (mask->rc)
        return s_fault(mask, err, errlen);
    return 0;
}

/* One pass: the map's header, each key str, each value in place (token_ids and the mask's first
 * group straight into their arrays, scalars into v[], request_configs and unknown fields
 * skipped); a structural fault ends the pass at once and wins, field faults wait for
 * s_key_check. */
int kvt_lmc_decode_key(const uint8_t *buf, size_t len, const kvt_lmc_limits_t *lim,
                       kvt_lmc_key_t *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    s_cur_t c = {.buf = buf, .len = len, .max_items = lim->max_items};
    msgpack_object v[K_COUNT];
    bool seen[K_COUNT] = {false};
    s_fault_t shape, tok, mask;
    shape.rc = tok.rc = mask.rc = 0;
    shape.msg[0] = tok.msg[0] = mask.msg[0] = '\0';

    msgpack_object root;
    int rc = s_cur_head(&c, 0, &root);
    if (!rc && root.type != MSGPACK_OBJECT_MAP) {
        s_err(shape.msg, sizeof shape.msg, "key: must be a map, got %s", s_type_name(&root));
        shape.rc = KVT_EBADREQ;
        rc = s_cur_rest(&c, 0, &root);
    }
    uint32_t npairs = !rc && root.type == MSGPACK_OBJECT_MAP ? root.via.map.size : 0;
    for (uint32_t i = 0; !rc && i < npairs; i++) {
        msgpack_object k;
        if ((rc = s_cur_head(&c, 1, &k)) || (rc = s_cur_rest(&c, 1, &k)))
            break;
        int f = -1;
        if (!shape.rc) {
            if (k.type != MSGPACK_OBJECT_STR) {
                s_err(shape.msg, sizeof shape.msg, "key: field names must be str, got %s",
                      s_type_name(&k));
                shape.rc = KVT_EBADREQ;
            } else if ((f = s_key_field(k.via.str.ptr, k.via.str.size)) >= 0 && seen[f]) {
                /* msgspec and this decoder could disagree on which one wins */
                s_err(shape.msg, sizeof shape.msg, "key: field '%s' given twice",
                      s_key_fields[f]);
                shape.rc = KVT_EBADREQ;
                f = -1;
            }
        }
        if (f >= 0)
            seen[f] = true;
        if (f < 0 || f == K_CONFIGS)
            rc = s_cur_skip(&c, 1);
        else if (f == K_TOKENS)
            rc = s_cur_tokens(&c, lim, out, &tok);
        else if (f == K_MASK)
            rc = s_cur_mask(&c, out, &mask);
        else if (!(rc = s_cur_head(&c, 1, &v[f])))
            rc = s_cur_rest(&c, 1, &v[f]);
    }
    if (!rc && c.off != len) {
        snprintf(c.why, sizeof c.why, "%zu trailing bytes after the body", len - c.off);
        rc = KVT_EBADREQ;
    }
    if (rc)
        s_err(err, errlen, "key: %s", c.why);
    else
        rc = s_key_check(v, seen, &shape, &tok, &mask, out, err, errlen);
    if (rc)
        kvt_lmc_key_free(out);
    return rc;
}

void kvt_lmc_key_free(kvt_lmc_key_t *key)
{
    if (!key)
        return;
    free(key->tokens);
    free(key->null_mask);
    key->tokens = NULL;
    key->ntokens = 0;
    key->null_mask = NULL;
    key->null_mask_len = 0;
}

/* ---- RegisterEngineDrivenContextPayload ---- */

enum { C_INSTANCE, C_MODEL, C_WORLD, C_BLOCK, C_LAYERS, C_HIDDEN, C_DTYPE, C_MLA, C_SLOTS,
       C_GROUPS, C_SHAPES, C_DTYPES, C_SW, C_META, C_COUNT };
static const char *const s_ctx_fields[C_COUNT] = {
    [C_INSTANCE] = "instance_id",     [C_MODEL] = "model_name",
    [C_WORLD] = "world_size",         [C_BLOCK] = "block_size",
    [C_LAYERS] = "num_layers",        [C_HIDDEN] = "hidden_dim_size",
    [C_DTYPE] = "dtype_str",          [C_MLA] = "use_mla",
    [C_SLOTS] = "num_physical_slots", [C_GROUPS] = "engine_group_infos",
    [C_SHAPES] = "object_group_layout_shapes",
    [C_DTYPES] = "object_group_layout_dtype_strs",
    [C_SW] = "num_chunks_in_sw",      [C_META] = "transfer_metadata_wire",
};

/* An array of lo..hi elements (nil counts as empty when lo is 0). */
static int s_array(const msgpack_object *o, const char *what, const char *field, uint32_t lo,
                   uint32_t hi, uint32_t *n, char *err, size_t errlen)
{
    *n = 0;
    if (o && o->type == MSGPACK_OBJECT_NIL && lo == 0)
        return 0;
    if (!o || o->type != MSGPACK_OBJECT_ARRAY)
        return o ? s_wrong(what, field, "an array", o, err, errlen)
                 : s_missing(what, field, err, errlen);
    if (o->via.array.size < lo || o->via.array.size > hi) {
        s_err(err, errlen, "%s: %s must have %u to %u entries, got %u", what, field, lo, hi,
              o->via.array.size);
        return KVT_EBADREQ;
    }
    *n = o->via.array.size;
    return 0;
}

/* A hybrid registration's object groups: shapes [og][kg][dim], dtypes [og][kg], windows [og]
 * (empty: every group full attention), and the transfer metadata's tokens_per_chunk, object
 * group ids in order and kernel group counts, which must agree with the shapes. */
static int s_ogroups(const msgpack_object *const *v, kvt_lmc_ctx_t *out, char *err, size_t errlen)
{
    static const char W[] = "payload";
    uint32_t nog = 0, n;
    int rc = v[C_SHAPES] ? s_array(v[C_SHAPES], W, "object_group_layout_shapes", 0,
                                   KVT_LMC_MAX_OGROUPS, &nog, err, errlen)
                         : 0;
    if (rc || nog == 0)
        return rc;
    if ((rc = s_array(v[C_DTYPES], W, "object_group_layout_dtype_strs", nog, nog, &n, err,
                      errlen)))
        return rc;
    uint32_t nsw = 0;
    if (v[C_SW] && (rc = s_array(v[C_SW], W, "num_chunks_in_sw", 0, nog, &nsw, err, errlen)))
        return rc;
    if (nsw && nsw != nog) {
        s_err(err, errlen, "%s: num_chunks_in_sw has %u entries for %u object groups", W, nsw,
              nog);
        return KVT_EBADREQ;
    }
    for (uint32_t g = 0; g < nog; g++) {
        kvt_lmc_ogroup_t *og = &out->og[g];
        const msgpack_object *sh = &v[C_SHAPES]->via.array.ptr[g];
        const msgpack_object *dt = &v[C_DTYPES]->via.array.ptr[g];
        uint32_t nt, nd;
        char f[64], f2[64];
        snprintf(f, sizeof f, "object_group_layout_shapes[%u]", g);
        snprintf(f2, sizeof f2, "object_group_layout_dtype_strs[%u]", g);
        if ((rc = s_array(sh, W, f, 1, KVT_LMC_MAX_KGROUPS, &nt, err, errlen)) ||
            (rc = s_array(dt, W, f2, nt, nt, &nd, err, errlen)))
            return rc;
        og->ntensors = nt;
        for (uint32_t k = 0; k < nt; k++) {
            kvt_lmc_tensor_t *t = &og->t[k];
            const msgpack_object *dims = &sh->via.array.ptr[k];
            snprintf(f, sizeof f, "object_group_layout_shapes[%u][%u]", g, k);
            if ((rc = s_array(dims, W, f, 1, KVT_LMC_MAX_SHAPE, &t->ndim, err, errlen)))
                return rc;
            for (uint32_t d = 0; d < t->ndim; d++)
                if ((rc = s_uint(&dims->via.array.ptr[d], W, f, 1, UINT32_MAX, &t->shape[d], err,
                                 errlen)))
                    return rc;
            snprintf(f2, sizeof f2, "object_group_layout_dtype_strs[%u][%u]", g, k);
            if ((rc = s_str(&dt->via.array.ptr[k], W, f2, 1, KVT_MAX_DTYPE, NULL, t->dtype, NULL,
                            err, errlen)))
                return rc;
        }
        og->sw_chunks = -1; /* -1 (or 0): full attention */
        const msgpack_object *w = nsw ? &v[C_SW]->via.array.ptr[g] : NULL;
        uint64_t sw = 0;
        if (w && w->type != MSGPACK_OBJECT_NEGATIVE_INTEGER &&
            (rc = s_uint(w, W, "num_chunks_in_sw[]", 0, INT32_MAX, &sw, err, errlen)))
            return rc;
        if (sw)
            og->sw_chunks = (int32_t)sw;
    }
    out->nogroups = nog;
    /* the transfer metadata: LMCache's server refuses object groups without it */
    const msgpack_object *m = v[C_META];
    if (!m || m->type == MSGPACK_OBJECT_NIL)
        return s_missing(W, "transfer_metadata_wire (object groups need it)", err, errlen);
    static const char *const mf[] = {"tokens_per_chunk", "object_groups"};
    const msgpack_object *mv[2];
    if ((rc = s_fields(m, "transfer_metadata_wire", mf, 2, mv, err, errlen)))
        return rc;
    uint64_t tpc;
    if (!mv[0])
        return s_missing("transfer_metadata_wire", "tokens_per_chunk", err, errlen);
    if ((rc = s_uint(mv[0], "transfer_metadata_wire", "tokens_per_chunk", 1, UINT32_MAX, &tpc, err,
                     errlen)))
        return rc;
    out->tokens_per_chunk = (uint32_t)tpc;
    uint32_t nmog;
    if ((rc = s_array(mv[1], "transfer_metadata_wire", "object_groups", nog, nog, &nmog, err,
                      errlen)))
        return rc;
    static const char *const gf[] = {"object_group_id", "kernel_group_ids", "sw_size_chunks"};
    for (uint32_t g = 0; g < nog; g++) {
        const msgpack_object *gv[3];
        uint64_t id;
        uint32_t nk;
        if ((rc = s_fields(&mv[1]->via.array.ptr[g], "transfer_metadata_wire.object_groups[g]",
                           gf, 3, gv, err, errlen)))
            return rc;
        if (!gv[0] || !gv[1])
            return s_missing("transfer_metadata_wire.object_groups[g]",
                             gv[0] ? "kernel_group_ids" : "object_group_id", err, errlen);
        if ((rc = s_uint(gv[0], "transfer_metadata_wire.object_groups[g]", "object_group_id", 0,
                         UINT32_MAX, &id, err, errlen)) ||
            (rc = s_array(gv[1], "transfer_metadata_wire.object_groups[g]", "kernel_group_ids",
                          0, UINT32_MAX, &nk, err, errlen)))
            return rc;
        if (id != g || nk != out->og[g].ntensors) {
            s_err(err, errlen,
                  "transfer_metadata_wire: object group %u has id %llu and %u kernel groups; the "
                  "layout shapes have %u",
                  g, (unsigned long long)id, nk, out->og[g].ntensors);
            return KVT_EBADREQ;
        }
    }
    return 0;
}

static int s_ctx(const msgpack_object *root, kvt_lmc_ctx_t *out, char *err, size_t errlen)
{
    static const char W[] = "payload";
    const msgpack_object *v[C_COUNT];
    int rc = s_fields(root, W, s_ctx_fields, C_COUNT, v, err, errlen);
    if (rc)
        return rc;
    static const int required[] = {C_INSTANCE, C_MODEL,  C_WORLD, C_BLOCK,
                                   C_LAYERS,   C_HIDDEN, C_DTYPE};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
        if (!v[required[i]])
            return s_missing(W, s_ctx_fields[required[i]], err, errlen);

    const msgpack_object *o = v[C_INSTANCE];
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER && o->type != MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return s_wrong(W, "instance_id", "an int", o, err, errlen);
    out->instance_id = o->via.u64; /* i64 and u64 share the bits */
    if ((rc = s_str(v[C_MODEL], W, "model_name", 1, KVT_LMC_MAX_MODEL, NULL, out->model, NULL,
                    err, errlen)))
        return rc;
    uint64_t u;
    if ((rc = s_uint(v[C_WORLD], W, "world_size", 1, KVT_LMC_MAX_WORLD, &u, err, errlen)))
        return rc;
    out->world_size = (uint32_t)u;
    if ((rc = s_uint(v[C_BLOCK], W, "block_size", 1, UINT32_MAX, &u, err, errlen)))
        return rc;
    out->block_size = (uint32_t)u;
    if ((rc = s_uint(v[C_LAYERS], W, "num_layers", 1, 65536, &u, err, errlen)))
        return rc;
    out->num_layers = (uint32_t)u;
    if ((rc = s_uint(v[C_HIDDEN], W, "hidden_dim_size", 1, UINT64_MAX, &out->hidden_dim_size,
                     err, errlen)))
        return rc;
    if ((rc = s_str(v[C_DTYPE], W, "dtype_str", 0, KVT_MAX_DTYPE, NULL, out->dtype, NULL, err,
                    errlen)))
        return rc;
    if ((o = v[C_MLA])) {
        if (o->type != MSGPACK_OBJECT_BOOLEAN)
            return s_wrong(W, "use_mla", "a bool", o, err, errlen);
        out->use_mla = o->via.boolean;
    }
    if ((o = v[C_SLOTS]) && o->type != MSGPACK_OBJECT_NIL &&
        (rc = s_uint(o, W, "num_physical_slots", 0, UINT64_MAX, &out->num_physical_slots, err,
                     errlen)))
        return rc;
    /* nil is taken as "none" too: a version may declare the list optional */
    if ((o = v[C_GROUPS]) && o->type != MSGPACK_OBJECT_NIL) {
        if (o->type != MSGPACK_OBJECT_ARRAY)
            return s_wrong(W, "engine_group_infos", "an array of maps", o, err, errlen);
        for (uint32_t i = 0; i < o->via.array.size; i++)
            if (o->via.array.ptr[i].type != MSGPACK_OBJECT_MAP) {
                s_err(err, errlen, "%s: engine_group_infos[%u] must be a map, got %s", W, i,
                      s_type_name(&o->via.array.ptr[i]));
                return KVT_EBADREQ;
            }
        out->ngroups = o->via.array.size;
    }
    return s_ogroups(v, out, err, errlen);
}

int kvt_lmc_decode_ctx(const uint8_t *buf, size_t len, const kvt_lmc_limits_t *lim,
                       kvt_lmc_ctx_t *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    msgpack_unpacked mp;
    int rc = s_unpack(buf, len, lim->max_items, &mp, "payload", err, errlen);
    if (rc)
        return rc;
    rc = s_ctx(&mp.data, out, err, errlen);
    msgpack_unpacked_destroy(&mp);
    if (rc)
        memset(out, 0, sizeof *out);
    return rc;
}

/* ---- top-level scalars ---- */

/* A scalar frame: anything bigger than S_SCALAR_ITEMS is simply the wrong type, so the
 * pre-scan's "too many elements" is reported as a bad request, not as too big. */
static int s_scalar(const uint8_t *buf, size_t len, msgpack_unpacked *mp, char *err,
                    size_t errlen)
{
    int rc = s_unpack(buf, len, S_SCALAR_ITEMS, mp, "argument", err, errlen);
    return rc == KVT_ETOOBIG ? KVT_EBADREQ : rc;
}

int kvt_lmc_decode_int(const uint8_t *buf, size_t len, bool allow_nil, uint64_t *out,
                       bool *is_nil, char *err, size_t errlen)
{
    msgpack_unpacked mp;
    int rc = s_scalar(buf, len, &mp, err, errlen);
    if (rc)
        return rc;
    const msgpack_object *o = &mp.data;
    if (is_nil)
        *is_nil = false;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER || o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *out = o->via.u64;
    } else if (allow_nil && o->type == MSGPACK_OBJECT_NIL) {
        *out = 0;
        if (is_nil)
            *is_nil = true;
    } else {
        rc = s_wrong("argument", "value", allow_nil ? "an int or nil" : "an int", o, err, errlen);
    }
    msgpack_unpacked_destroy(&mp);
    return rc;
}

int kvt_lmc_decode_uint(const uint8_t *buf, size_t len, uint64_t max, uint64_t *out, char *err,
                        size_t errlen)
{
    msgpack_unpacked mp;
    int rc = s_scalar(buf, len, &mp, err, errlen);
    if (rc)
        return rc;
    rc = s_uint(&mp.data, "argument", "value", 0, max, out, err, errlen);
    msgpack_unpacked_destroy(&mp);
    return rc;
}

int kvt_lmc_decode_bool(const uint8_t *buf, size_t len, bool *out, char *err, size_t errlen)
{
    msgpack_unpacked mp;
    int rc = s_scalar(buf, len, &mp, err, errlen);
    if (rc)
        return rc;
    const msgpack_object *o = &mp.data;
    if (o->type == MSGPACK_OBJECT_BOOLEAN)
        *out = o->via.boolean;
    else if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER ||
             o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        *out = o->via.u64 != 0;
    else
        rc = s_wrong("argument", "value", "a bool", o, err, errlen);
    msgpack_unpacked_destroy(&mp);
    return rc;
}

int kvt_lmc_decode_double(const uint8_t *buf, size_t len, double *out, char *err, size_t errlen)
{
    msgpack_unpacked mp;
    int rc = s_scalar(buf, len, &mp, err, errlen);
    if (rc)
        return rc;
    const msgpack_object *o = &mp.data;
    switch (o->type) {
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        /* a NaN or infinite timeout would reach a float-to-int conversion in the caller */
        if (!isfinite(o->via.f64)) {
            s_err(err, errlen, "argument: value must be a finite number");
            rc = KVT_EBADREQ;
        } else {
            *out = o->via.f64;
        }
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER: *out = (double)o->via.u64; break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: *out = (double)o->via.i64; break;
    default: rc = s_wrong("argument", "value", "a float or an int", o, err, errlen); break;
    }
    msgpack_unpacked_destroy(&mp);
    return rc;
}

int kvt_lmc_decode_str(const uint8_t *buf, size_t len, char *out, size_t cap, char *err,
                       size_t errlen)
{
    if (cap == 0) {
        s_err(err, errlen, "argument: no room for a str");
        return KVT_EBADREQ;
    }
    uint32_t hi = cap - 1 > UINT32_MAX ? UINT32_MAX : (uint32_t)(cap - 1);
    msgpack_unpacked mp;
    int rc = s_scalar(buf, len, &mp, err, errlen);
    if (rc)
        return rc;
    rc = s_str(&mp.data, "argument", "value", 0, hi, NULL, out, NULL, err, errlen);
    msgpack_unpacked_destroy(&mp);
    return rc;
}

int kvt_lmc_decode_bin_len(const uint8_t *buf, size_t len, uint64_t *out, char *err,
                           size_t errlen)
{
    msgpack_unpacked mp;
    int rc = s_scalar(buf, len, &mp, err, errlen);
    if (rc)
        return rc;
    if (mp.data.type == MSGPACK_OBJECT_BIN)
        *out = mp.data.via.bin.size;
    else
        rc = s_wrong("argument", "value", "a bin", &mp.data, err, errlen);
    msgpack_unpacked_destroy(&mp);
    return rc;
}

/* ---- BlockAllocationRecord list ---- */

enum { R_REQ, R_BLOCKS, R_TOKENS, R_COUNT };
static const char *const s_rec_fields[R_COUNT] = {"req_id", "new_block_ids", "new_token_ids"};

static int s_int_array(const msgpack_object *o, const char *what, const char *field, char *err,
                       size_t errlen)
{
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return s_wrong(what, field, "an array of int", o, err, errlen);
    for (uint32_t i = 0; i < o->via.array.size; i++) {
        msgpack_object_type t = o->via.array.ptr[i].type;
        if (t != MSGPACK_OBJECT_POSITIVE_INTEGER && t != MSGPACK_OBJECT_NEGATIVE_INTEGER) {
            s_err(err, errlen, "%s: %s[%u] is not an int", what, field, i);
            return KVT_EBADREQ;
        }
    }
    return 0;
}

static int s_records(const msgpack_object *root, char *err, size_t errlen)
{
    if (root->type != MSGPACK_OBJECT_ARRAY)
        return s_wrong("records", "value", "an array of maps", root, err, errlen);
    for (uint32_t i = 0; i < root->via.array.size; i++) {
        char what[32];
        snprintf(what, sizeof what, "records[%u]", i);
        const msgpack_object *v[R_COUNT];
        int rc = s_fields(&root->via.array.ptr[i], what, s_rec_fields, R_COUNT, v, err, errlen);
        if (rc)
            return rc;
        for (int f = 0; f < R_COUNT; f++)
            if (!v[f])
                return s_missing(what, s_rec_fields[f], err, errlen);
        if (v[R_REQ]->type != MSGPACK_OBJECT_STR)
            return s_wrong(what, "req_id", "a str", v[R_REQ], err, errlen);
        if ((rc = s_int_array(v[R_BLOCKS], what, "new_block_ids", err, errlen)) ||
            (rc = s_int_array(v[R_TOKENS], what, "new_token_ids", err, errlen)))
            return rc;
    }
    return 0;
}

int kvt_lmc_check_records(const uint8_t *buf, size_t len, const kvt_lmc_limits_t *lim,
                          char *err, size_t errlen)
{
    msgpack_unpacked mp;
    int rc = s_unpack(buf, len, lim->max_items, &mp, "records", err, errlen);
    if (rc)
        return rc;
    rc = s_records(&mp.data, err, errlen);
    msgpack_unpacked_destroy(&mp);
    return rc;
}

/* ---- dtypes ---- */

uint32_t kvt_lmc_dtype_size(const char *dtype)
{
    static const struct {
        const char *name;
        uint32_t size;
    } tab[] = {
        {"bfloat16", 2},      {"float16", 2},     {"half", 2},  {"float32", 4},
        {"float", 4},         {"float64", 8},     {"double", 8}, {"float8_e4m3fn", 1},
        {"float8_e5m2", 1},   {"uint8", 1},       {"int8", 1},  {"int16", 2},
        {"int32", 4},         {"int64", 8},       {"bool", 1},
    };
    if (!dtype)
        return 0;
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        if (strcmp(tab[i].name, dtype) == 0)
            return tab[i].size;
    return 0;
}

/* ---- replies (msgspec writes every field, in declaration order) ---- */

static void s_pack_slot(msgpack_packer *pk, const kvt_lmc_slot_t *s)
{
    kvt_assert(s->ndim <= KVT_LMC_MAX_SHAPE && s->dtype);
    msgpack_pack_map(pk, 4);
    kvt_pack_str(pk, "offset");
    msgpack_pack_uint64(pk, s->offset);
    kvt_pack_str(pk, "length");
    msgpack_pack_uint64(pk, s->length);
    kvt_pack_str(pk, "shape");
    msgpack_pack_array(pk, s->ndim);
    for (uint32_t d = 0; d < s->ndim; d++)
        msgpack_pack_uint64(pk, s->shape[d]);
    kvt_pack_str(pk, "dtype");
    kvt_pack_str(pk, s->dtype);
}

static void s_pack_slots(msgpack_packer *pk, const kvt_lmc_slot_t *slots, uint32_t n)
{
    kvt_pack_str(pk, "slots");
    msgpack_pack_array(pk, n);
    for (uint32_t i = 0; i < n; i++)
        s_pack_slot(pk, &slots[i]);
}

void kvt_lmc_pack_register(msgpack_packer *pk, const char *shm_name, uint64_t pool_size,
                           const char *error)
{
    msgpack_pack_map(pk, 5);
    kvt_pack_str(pk, "shm_name");
    kvt_pack_str(pk, shm_name ? shm_name : "");
    kvt_pack_str(pk, "pool_size");
    msgpack_pack_uint64(pk, pool_size);
    kvt_pack_str(pk, "scratch_offset");
    msgpack_pack_uint64(pk, 0);
    kvt_pack_str(pk, "scratch_size");
    msgpack_pack_uint64(pk, 0);
    kvt_pack_str(pk, "error");
    if (error)
        kvt_pack_str(pk, error);
    else
        msgpack_pack_nil(pk);
}

void kvt_lmc_pack_prepare_store(msgpack_packer *pk, const kvt_lmc_slot_t *slots,
                                const uint32_t *chunk_indices, uint32_t n)
{
    msgpack_pack_map(pk, 1);
    kvt_pack_str(pk, "context");
    msgpack_pack_map(pk, 2);
    s_pack_slots(pk, slots, n);
    kvt_pack_str(pk, "chunk_indices");
    msgpack_pack_array(pk, n);
    for (uint32_t i = 0; i < n; i++)
        msgpack_pack_uint32(pk, chunk_indices[i]);
}

void kvt_lmc_pack_prepare_retrieve(msgpack_packer *pk, bool success, const kvt_lmc_slot_t *slots,
                                   uint32_t n)
{
    msgpack_pack_map(pk, 3);
    kvt_pack_str(pk, "success");
    if (success)
        msgpack_pack_true(pk);
    else
        msgpack_pack_false(pk);
    kvt_pack_str(pk, "data");
    msgpack_pack_bin(pk, 0); /* bin, never str: the client checks the type */
    kvt_pack_str(pk, "context");
    msgpack_pack_map(pk, 1);
    s_pack_slots(pk, slots, n);
}

static void s_pack_ogroups(msgpack_packer *pk, const kvt_lmc_ogroup_reply_t *g, uint32_t ng)
{
    msgpack_pack_map(pk, 1);
    kvt_pack_str(pk, "object_groups");
    msgpack_pack_array(pk, ng);
    for (uint32_t i = 0; i < ng; i++) {
        msgpack_pack_map(pk, 3);
        kvt_pack_str(pk, "object_group_id");
        msgpack_pack_uint32(pk, g[i].id);
        kvt_pack_str(pk, "chunk_indices");
        msgpack_pack_array(pk, g[i].n);
        for (uint32_t c = 0; c < g[i].n; c++)
            msgpack_pack_uint32(pk, g[i].chunk_indices[c]);
        kvt_pack_str(pk, "slots");
        msgpack_pack_array(pk, g[i].n);
        for (uint32_t c = 0; c < g[i].n; c++) {
            msgpack_pack_array(pk, g[i].ntensors);
            for (uint32_t t = 0; t < g[i].ntensors; t++)
                s_pack_slot(pk, &g[i].slots[(size_t)c * g[i].ntensors + t]);
        }
    }
}

void kvt_lmc_pack_prepare_store_groups(msgpack_packer *pk, const kvt_lmc_ogroup_reply_t *g,
                                       uint32_t ng)
{
    msgpack_pack_map(pk, 1);
    kvt_pack_str(pk, "context");
    s_pack_ogroups(pk, g, ng);
}

void kvt_lmc_pack_prepare_retrieve_groups(msgpack_packer *pk, bool success,
                                          const kvt_lmc_ogroup_reply_t *g, uint32_t ng)
{
    msgpack_pack_map(pk, 3);
    kvt_pack_str(pk, "success");
    success ? msgpack_pack_true(pk) : msgpack_pack_false(pk);
    kvt_pack_str(pk, "data");
    msgpack_pack_bin(pk, 0);
    kvt_pack_str(pk, "context");
    if (success)
        s_pack_ogroups(pk, g, ng);
    else
        msgpack_pack_map(pk, 0); /* LMCache's server: a failed retrieve has an empty context */
}

void kvt_lmc_pack_poll_head(msgpack_packer *pk, bool enabled, uint64_t incarnation,
                            uint64_t next_cursor, bool lost, uint32_t nevents)
{
    msgpack_pack_map(pk, 5);
    kvt_pack_str(pk, "enabled");
    enabled ? msgpack_pack_true(pk) : msgpack_pack_false(pk);
    kvt_pack_str(pk, "incarnation");
    msgpack_pack_uint64(pk, incarnation);
    kvt_pack_str(pk, "next_cursor");
    msgpack_pack_uint64(pk, next_cursor);
    kvt_pack_str(pk, "lost");
    lost ? msgpack_pack_true(pk) : msgpack_pack_false(pk);
    kvt_pack_str(pk, "events");
    msgpack_pack_array(pk, nevents);
}

void kvt_lmc_pack_kv_event(msgpack_packer *pk, const kvt_lmc_kv_event_t *ev)
{
    msgpack_pack_map(pk, 8);
    kvt_pack_str(pk, "seq");
    msgpack_pack_uint64(pk, ev->seq);
    kvt_pack_str(pk, "kind");
    kvt_pack_str(pk, ev->stored ? "stored" : "removed");
    kvt_pack_str(pk, "medium");
    kvt_pack_str(pk, ev->storage ? "STORAGE" : "CPU");
    kvt_pack_str(pk, "model_name");
    kvt_pack_str(pk, ev->model);
    kvt_pack_str(pk, "block_hashes");
    msgpack_pack_array(pk, ev->n);
    for (uint32_t i = 0; i < ev->n; i++) {
        msgpack_pack_bin(pk, KVT_KEY_LEN);
        msgpack_pack_bin_body(pk, ev->hashes[i].b, KVT_KEY_LEN);
    }
    kvt_pack_str(pk, "parent_block_hash");
    if (ev->parent) {
        msgpack_pack_bin(pk, KVT_KEY_LEN);
        msgpack_pack_bin_body(pk, ev->parent->b, KVT_KEY_LEN);
    } else {
        msgpack_pack_nil(pk);
    }
    kvt_pack_str(pk, "token_ids");
    uint64_t ntok = ev->tokens ? (uint64_t)ev->n * ev->block_size : 0;
    kvt_assert(ntok <= UINT32_MAX); /* the caller keeps an event's run short */
    msgpack_pack_array(pk, (uint32_t)ntok);
    for (uint32_t i = 0; ev->tokens && i < ev->n; i++)
        for (uint32_t t = 0; t < ev->block_size; t++)
            msgpack_pack_uint32(pk, ev->tokens[i][t]);
    kvt_pack_str(pk, "block_size");
    msgpack_pack_uint32(pk, ev->block_size);
}

void kvt_lmc_pack_error(msgpack_packer *pk, const char *error_type, const char *message)
{
    if (!message)
        message = "";
    size_t n = strlen(message);
    if (n > S_MAX_ERROR_MSG) {
        /* back off to the start of a UTF-8 sequence (at most 3 continuation bytes) */
        n = S_MAX_ERROR_MSG;
        for (int k = 0; k < 3 && n > 0 && ((unsigned char)message[n] & 0xc0) == 0x80; k++)
            n--;
    }
    msgpack_pack_map(pk, 2);
    kvt_pack_str(pk, "error_type");
    kvt_pack_str(pk, error_type ? error_type : "");
    kvt_pack_str(pk, "message");
    kvt_pack_strn(pk, message, n);
}
