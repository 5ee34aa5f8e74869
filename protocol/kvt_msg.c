/* DESIGN: pure functions of bytes. The pre-scan walks the msgpack encoding with an explicit
 * stack, never allocating, and rejects anything whose declared lengths or element counts
 * exceed the bytes actually present (each element takes at least one byte), so the later
 * msgpack_unpack_next() allocation is bounded by a small multiple of the body size and by
 * max_items. Field decoding is table-driven from KVT_FIELD_MAP. */
#include "kvt_msg.h"

#include "kvt_error.h"
#include "kvt_utf8.h"

#include <stdio.h>
#include <string.h>

#define S_MAX_DEPTH 32

void kvt_limits_init(kvt_limits_t *lim, uint64_t max_message, uint32_t max_keys)
{
    lim->max_body = max_message > UINT32_MAX ? UINT32_MAX : (uint32_t)max_message;
    lim->max_depth = 8;
    lim->max_keys = max_keys;
    /* keys + sizes (or failed) of max_keys entries, plus room for the small fields */
    lim->max_items = 2u * max_keys + 1024u;
}

static uint64_t s_be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

int kvt_msg_prescan(const uint8_t *buf, size_t len, const kvt_limits_t *lim, char *err,
                    size_t errlen)
{
    uint64_t left[S_MAX_DEPTH + 1]; /* elements still expected at each nesting level */
    uint32_t max_depth = lim->max_depth < S_MAX_DEPTH ? lim->max_depth : S_MAX_DEPTH;
    int depth = 0;
    size_t off = 0;
    uint64_t items = 0;
    left[0] = 1;
    while (depth >= 0) {
        if (left[depth] == 0) {
            depth--;
            continue;
        }
        left[depth]--;
        if (off >= len) {
            snprintf(err, errlen, "truncated msgpack at byte %zu", off);
            return KVT_EBADREQ;
        }
        uint8_t b = buf[off++];
        int lenbytes = 0;     /* size of a length/count field that follows */
        uint64_t payload = 0; /* bytes to skip */
        uint64_t children = 0;
        int is_container = 0, extra = 0;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
            /* fixint, nil, bool */
        } else if (b <= 0x8f) {
            children = 2u * (b & 0x0f);
            is_container = 1;
        } else if (b <= 0x9f) {
            children = b & 0x0f;
            is_container = 1;
        } else if (b <= 0xbf) {
            payload = b & 0x1f;
        } else {
            switch (b) {
            case 0xc4: case 0xd9: lenbytes = 1; break;             /* bin8, str8 */
            case 0xc5: case 0xda: lenbytes = 2; break;             /* bin16, str16 */
            case 0xc6: case 0xdb: lenbytes = 4; break;             /* bin32, str32 */
            case 0xc7: lenbytes = 1; extra = 1; break;             /* ext8 + type */
            case 0xc8: lenbytes = 2; extra = 1; break;
            case 0xc9: lenbytes = 4; extra = 1; break;
            case 0xca: payload = 4; break;                         /* float32 */
            case 0xcb: payload = 8; break;                         /* float64 */
            case 0xcc: case 0xd0: payload = 1; break;
            case 0xcd: case 0xd1: payload = 2; break;
            case 0xce: case 0xd2: payload = 4; break;
            case 0xcf: case 0xd3: payload = 8; break;
            case 0xd4: payload = 2; break;                         /* fixext 1..16 + type */
            case 0xd5: payload = 3; break;
            case 0xd6: payload = 5; break;
            case 0xd7: payload = 9; break;
            case 0xd8: payload = 17; break;
            case 0xdc: lenbytes = 2; is_container = 1; break;      /* array16 */
            case 0xdd: lenbytes = 4; is_container = 1; break;      /* array32 */
            case 0xde: lenbytes = 2; is_container = 2; break;      /* map16 */
            case 0xdf: lenbytes = 4; is_container = 2; break;      /* map32 */
            default:
                snprintf(err, errlen, "invalid msgpack byte 0x%02x at %zu", b, off - 1);
                return KVT_EBADREQ;
            }
        }
        if (lenbytes) {
            if ((size_t)lenbytes > len - off) {
                snprintf(err, errlen, "truncated msgpack length at byte %zu", off);
                return KVT_EBADREQ;
            }
            uint64_t n = s_be(buf + off, lenbytes);
            off += (size_t)lenbytes;
            if (is_container)
                children = is_container == 2 ? 2 * n : n;
            else
                payload = n + (uint64_t)extra;
        }
        if (payload > len - off) {
            snprintf(err, errlen, "declared length %llu exceeds the %zu bytes left",
                     (unsigned long long)payload, len - off);
            return KVT_EBADREQ;
        }
        off += (size_t)payload;
        if (!is_container || children == 0)
            continue;
        if (children > len - off) {
            snprintf(err, errlen, "declared %llu elements but only %zu bytes left",
                     (unsigned long long)children, len - off);
            return KVT_EBADREQ;
        }
        items += children;
        if (items > lim->max_items) {
            snprintf(err, errlen, "more than %u elements in one body", lim->max_items);
            return KVT_ETOOBIG;
        }
        if ((uint32_t)depth + 1 > max_depth) {
            snprintf(err, errlen, "nesting deeper than %u", max_depth);
            return KVT_EBADREQ;
        }
        left[++depth] = children;
    }
    if (off != len) {
        snprintf(err, errlen, "%zu trailing bytes after the body", len - off);
        return KVT_EBADREQ;
    }
    return 0;
}

int kvt_msg_read_uint(const uint8_t *buf, size_t len, uint64_t *out)
{
    if (len == 0)
        return KVT_EBADREQ;
    uint8_t b = buf[0];
    if (b <= 0x7f && len == 1) {
        *out = b;
        return 0;
    }
    int n = 0;
    bool is_signed = false;
    switch (b) {
    case 0xcc: n = 1; break;
    case 0xcd: n = 2; break;
    case 0xce: n = 4; break;
    case 0xcf: n = 8; break;
    case 0xd0: n = 1; is_signed = true; break;
    case 0xd1: n = 2; is_signed = true; break;
    case 0xd2: n = 4; is_signed = true; break;
    case 0xd3: n = 8; is_signed = true; break;
    default: return KVT_EBADREQ;
    }
    if (len != (size_t)n + 1)
        return KVT_EBADREQ;
    /* some encoders write small non-negative values in signed forms */
    if (is_signed && (buf[1] & 0x80))
        return KVT_EBADREQ;
    *out = s_be(buf + 1, n);
    return 0;
}

/* ---- body decoding ---- */

typedef enum { S_UINT, S_BOOL, S_STR, S_BIN, S_KEYS, S_UINTS, S_HANDLES, S_LABELS } s_kind_t;

static const s_kind_t s_kinds[KVT_FIELD_COUNT] = {
#define KVT_XX(f, name, kind) [KVT_FI_##f] = S_##kind,
    KVT_FIELD_MAP(KVT_XX)
#undef KVT_XX
};

static int s_fail(kvt_req_t *r, int code, const char *fmt, const char *field)
{
    snprintf(r->error, sizeof r->error, fmt, field);
    return code;
}

static const char *s_type_name(msgpack_object_type t)
{
    switch (t) {
    case MSGPACK_OBJECT_NIL: return "nil";
    case MSGPACK_OBJECT_BOOLEAN: return "bool";
    case MSGPACK_OBJECT_POSITIVE_INTEGER: return "uint";
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

static int s_wrong_type(kvt_req_t *r, int fi, const char *want, const msgpack_object *o)
{
    snprintf(r->error, sizeof r->error, "field '%s': expected %s, got %s",
             kvt_proto_field_name(fi), want, s_type_name(o->type));
    return KVT_EBADREQ;
}

static int s_uint_array(kvt_req_t *r, int fi, const msgpack_object *o, uint32_t max,
                        uint64_t **out, uint32_t *n)
{
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return s_wrong_type(r, fi, "array of uint", o);
    if (o->via.array.size > max)
        return s_fail(r, KVT_ETOOBIG, "field '%s': too many entries", kvt_proto_field_name(fi));
    uint32_t cnt = o->via.array.size;
    uint64_t *v = NULL;
    if (cnt) {
        v = msgpack_zone_malloc(r->mp.zone, (size_t)cnt * sizeof *v);
        if (!v)
            return s_fail(r, KVT_ENOMEM, "%s: out of memory", kvt_proto_field_name(fi));
    }
    for (uint32_t i = 0; i < cnt; i++) {
        const msgpack_object *e = &o->via.array.ptr[i];
        if (e->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return s_wrong_type(r, fi, "array of uint", e);
        v[i] = e->via.u64;
    }
    *out = v;
    *n = cnt;
    return 0;
}

static int s_labels(kvt_req_t *r, const msgpack_object *o, const kvt_limits_t *lim)
{
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return s_wrong_type(r, KVT_FI_LABELS, "array of str", o);
    uint32_t cnt = o->via.array.size;
    if (cnt > lim->max_keys)
        return s_fail(r, KVT_ETOOBIG, "field '%s': too many entries", "labels");
    kvt_bytes_t *v = NULL;
    if (cnt) {
        v = msgpack_zone_malloc(r->mp.zone, (size_t)cnt * sizeof *v);
        if (!v)
            return s_fail(r, KVT_ENOMEM, "%s: out of memory", "labels");
    }
    for (uint32_t i = 0; i < cnt; i++) {
        const msgpack_object *e = &o->via.array.ptr[i];
        v[i] = (kvt_bytes_t){0};
        if (e->type == MSGPACK_OBJECT_NIL)
            continue;
        if (e->type != MSGPACK_OBJECT_STR)
            return s_wrong_type(r, KVT_FI_LABELS, "array of str or nil", e);
        if (e->via.str.size > KVT_MAX_LABEL) {
            snprintf(r->error, sizeof r->error,
                     "field 'labels': entry %u is %u bytes, at most %d", i, e->via.str.size,
                     KVT_MAX_LABEL);
            return KVT_EBADREQ;
        }
        if (!kvt_utf8_valid((const uint8_t *)e->via.str.ptr, e->via.str.size)) {
            snprintf(r->error, sizeof r->error, "field 'labels': entry %u is not UTF-8", i);
            return KVT_EBADREQ;
        }
        v[i] = (kvt_bytes_t){(const uint8_t *)e->via.str.ptr, e->via.str.size};
    }
    r->labels = v;
    r->nlabels = cnt;
    return 0;
}

static int s_field(kvt_req_t *r, int fi, const msgpack_object *o, const kvt_limits_t *lim)
{
    kvt_bytes_t str = {0};
    switch (s_kinds[fi]) {
    case S_UINT:
        if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return s_wrong_type(r, fi, "uint", o);
        break;
    case S_BOOL:
        if (o->type != MSGPACK_OBJECT_BOOLEAN)
            return s_wrong_type(r, fi, "bool", o);
        break;
    case S_STR:
        if (o->type != MSGPACK_OBJECT_STR)
            return s_wrong_type(r, fi, "str", o);
        str.ptr = (const uint8_t *)o->via.str.ptr;
        str.len = o->via.str.size;
        break;
    case S_BIN:
        if (o->type != MSGPACK_OBJECT_BIN)
            return s_wrong_type(r, fi, "bin", o);
        str.ptr = (const uint8_t *)o->via.bin.ptr;
        str.len = o->via.bin.size;
        break;
    case S_KEYS: {
        if (o->type != MSGPACK_OBJECT_ARRAY)
            return s_wrong_type(r, fi, "array of 16-byte bin", o);
        uint32_t cnt = o->via.array.size;
        if (cnt > lim->max_keys) {
            snprintf(r->error, sizeof r->error, "field 'keys': %u keys, at most %u per request",
                     cnt, lim->max_keys);
            return KVT_ETOOBIG;
        }
        kvt_key_t *keys = NULL;
        if (cnt) {
            keys = msgpack_zone_malloc(r->mp.zone, (size_t)cnt * sizeof *keys);
            if (!keys)
                return s_fail(r, KVT_ENOMEM, "%s: out of memory", "keys");
        }
        for (uint32_t i = 0; i < cnt; i++) {
            const msgpack_object *e = &o->via.array.ptr[i];
            if (e->type != MSGPACK_OBJECT_BIN || e->via.bin.size != KVT_KEY_LEN) {
                snprintf(r->error, sizeof r->error,
                         "field 'keys': entry %u is not a 16-byte bin", i);
                return KVT_EBADREQ;
            }
            memcpy(keys[i].b, e->via.bin.ptr, KVT_KEY_LEN);
        }
        r->keys = keys;
        r->nkeys = cnt;
        return 0;
    }
    case S_HANDLES: {
        if (o->type != MSGPACK_OBJECT_ARRAY)
            return s_wrong_type(r, fi, "array of 64-byte bin", o);
        uint32_t cnt = o->via.array.size;
        if (cnt > KVT_MAX_GPU_LAYERS) {
            snprintf(r->error, sizeof r->error, "field 'handles': %u handles, at most %u", cnt,
                     KVT_MAX_GPU_LAYERS);
            return KVT_ETOOBIG;
        }
        if (cnt) {
            r->handles = msgpack_zone_malloc(r->mp.zone, (size_t)cnt * KVT_IPC_HANDLE_LEN);
            if (!r->handles)
                return s_fail(r, KVT_ENOMEM, "%s: out of memory", "handles");
        }
        for (uint32_t i = 0; i < cnt; i++) {
            const msgpack_object *e = &o->via.array.ptr[i];
            if (e->type != MSGPACK_OBJECT_BIN || e->via.bin.size != KVT_IPC_HANDLE_LEN) {
                snprintf(r->error, sizeof r->error,
                         "field 'handles': entry %u is not a 64-byte bin (a cudaIpcMemHandle_t)",
                         i);
                return KVT_EBADREQ;
            }
            memcpy(r->handles[i], e->via.bin.ptr, KVT_IPC_HANDLE_LEN);
        }
        r->nhandles = cnt;
        return 0;
    }
    case S_LABELS:
        return s_labels(r, o, lim);
    case S_UINTS:
        break;
    }
    switch (fi) {
    case KVT_FI_VERSION: r->version = o->via.u64; break;
    case KVT_FI_JOB: r->job = o->via.u64; break;
    case KVT_FI_SIZE: r->size = o->via.u64; break;
    case KVT_FI_LEASE: r->lease = o->via.u64; break;
    case KVT_FI_CHUNK_TOKENS: r->chunk_tokens = o->via.u64; break;
    case KVT_FI_LOCK: r->lock = o->via.boolean; break;
    case KVT_FI_PREFETCH: r->prefetch = o->via.boolean; break;
    case KVT_FI_FASTPATH: r->fastpath = o->via.boolean; break;
    case KVT_FI_RESIDENT: r->resident = o->via.boolean; break;
    case KVT_FI_TOKENS: r->tokens = str; break;
    case KVT_FI_DEVICE: r->device = o->via.u64; break;
    case KVT_FI_LAYERS: r->layers = o->via.u64; break;
    case KVT_FI_NUM_BLOCKS: r->num_blocks = o->via.u64; break;
    case KVT_FI_BLOCK_TOKENS: r->block_tokens = o->via.u64; break;
    case KVT_FI_TOKEN_BYTES: r->token_bytes = o->via.u64; break;
    case KVT_FI_SIZES: return s_uint_array(r, fi, o, lim->max_keys, &r->sizes, &r->nsizes);
    case KVT_FI_FAILED: return s_uint_array(r, fi, o, lim->max_keys, &r->failed, &r->nfailed);
    case KVT_FI_OFFSETS:
        return s_uint_array(r, fi, o, KVT_MAX_GPU_LAYERS, &r->offsets, &r->noffsets);
    /* several block ids per key: bounded by the body's element budget, not by max_keys */
    case KVT_FI_BLOCK_IDS:
        return s_uint_array(r, fi, o, lim->max_items, &r->block_ids, &r->nblock_ids);
    case KVT_FI_DTYPE:
        if (str.len == 0 || str.len > KVT_MAX_DTYPE)
            return s_fail(r, KVT_EBADREQ, "field '%s': must be 1 to 32 bytes", "dtype");
        r->dtype = str;
        break;
    case KVT_FI_EVENT:
        if (str.len != KVT_IPC_HANDLE_LEN)
            return s_fail(r, KVT_EBADREQ,
                          "field '%s': must be a 64-byte bin (a cudaIpcEventHandle_t)", "event");
        r->event = str;
        break;
    case KVT_FI_CLIENT:
    case KVT_FI_INSTANCE:
        if (str.len == 0 || str.len > KVT_MAX_NAME)
            return s_fail(r, KVT_EBADREQ, "field '%s': must be 1 to 256 bytes",
                          kvt_proto_field_name(fi));
        if (fi == KVT_FI_CLIENT)
            r->client = str;
        else
            r->instance = str;
        break;
    case KVT_FI_TOKEN:
        if (str.len == 0 || str.len > KVT_MAX_TOKEN)
            return s_fail(r, KVT_EBADREQ, "field '%s': must be 1 to 64 bytes", "token");
        r->token = str;
        break;
    case KVT_FI_NS:
        if (kvt_msg_check_ns(str.len, r->error, sizeof r->error) != 0)
            return KVT_EBADREQ;
        r->ns.name = str.ptr;
        r->ns.name_len = str.len;
        break;
    case KVT_FI_SALT:
        if (str.len > KVT_MAX_SALT)
            return s_fail(r, KVT_EBADREQ, "field '%s': longer than 128 bytes", "salt");
        r->ns.salt = str.ptr;
        r->ns.salt_len = str.len;
        break;
    default:
        break;
    }
    return 0;
}

int kvt_msg_check_ns(size_t len, char *err, size_t errlen)
{
    if (len >= 1 && len <= KVT_MAX_NS)
        return 0;
    snprintf(err, errlen, "field 'ns': must be 1 to %d bytes", KVT_MAX_NS);
    return KVT_EBADREQ;
}

static int s_lookup_field(const char *name, uint32_t len)
{
    for (int i = 0; i < KVT_FIELD_COUNT; i++) {
        const char *f = kvt_proto_field_name(i);
        if (strlen(f) == len && memcmp(f, name, len) == 0)
            return i;
    }
    return -1;
}

/* Rules between fields that the table cannot say. */
static int s_cross_check(kvt_req_t *r)
{
    if ((r->present & KVT_F_LABELS) && r->nlabels != r->nkeys) {
        snprintf(r->error, sizeof r->error, "'labels' has %u entries for %u keys", r->nlabels,
                 r->nkeys);
        return KVT_EBADREQ;
    }
    switch (r->type) {
    case KVT_REQ_RESERVE: {
        bool has_sizes = r->present & KVT_F_SIZES, has_size = r->present & KVT_F_SIZE;
        if (has_sizes == has_size)
            return s_fail(r, KVT_EBADREQ, "%s", "reserve needs exactly one of 'sizes' or 'size'");
        if (has_sizes && r->nsizes != r->nkeys) {
            snprintf(r->error, sizeof r->error, "'sizes' has %u entries for %u keys", r->nsizes,
                     r->nkeys);
            return KVT_EBADREQ;
        }
        if (has_size && r->size == 0)
            return s_fail(r, KVT_EBADREQ, "%s", "'size' must be positive");
        for (uint32_t i = 0; i < r->nsizes; i++)
            if (r->sizes[i] == 0)
                return s_fail(r, KVT_EBADREQ, "%s", "'sizes' entries must be positive");
        break;
    }
    case KVT_REQ_REGISTER_GPU:
        if (r->layers != r->nhandles) {
            snprintf(r->error, sizeof r->error, "'layers' is %llu but 'handles' has %u entries",
                     (unsigned long long)r->layers, r->nhandles);
            return KVT_EBADREQ;
        }
        if ((r->present & KVT_F_OFFSETS) && r->noffsets != r->nhandles) {
            snprintf(r->error, sizeof r->error, "'offsets' has %u entries for %u handles",
                     r->noffsets, r->nhandles);
            return KVT_EBADREQ;
        }
        break;
    case KVT_REQ_STORE_GPU:
    case KVT_REQ_RETRIEVE_GPU:
        /* every chunk names the same number of blocks (chunk_tokens / block_tokens) */
        if (r->nkeys == 0 ? r->nblock_ids != 0
                          : r->nblock_ids == 0 || r->nblock_ids % r->nkeys != 0) {
            snprintf(r->error, sizeof r->error,
                     "'block_ids' has %u entries: must be a positive multiple of the %u keys "
                     "(the same number of blocks per chunk)",
                     r->nblock_ids, r->nkeys);
            return KVT_EBADREQ;
        }
        break;
    case KVT_REQ_HASH_TOKENS:
        if (r->tokens.len % 4)
            return s_fail(r, KVT_EBADREQ, "%s",
                          "'tokens' must be little-endian uint32 values (length % 4 == 0)");
        if ((r->present & KVT_F_CHUNK_TOKENS) && r->chunk_tokens == 0)
            return s_fail(r, KVT_EBADREQ, "%s", "'chunk_tokens' must be positive");
        break;
    default:
        break;
    }
    return 0;
}

int kvt_msg_decode(const uint8_t *buf, size_t len, kvt_req_type_t type, const kvt_limits_t *lim,
                   kvt_req_t *out)
{
    memset(out, 0, sizeof *out);
    out->type = type;
    const kvt_req_info_t *info = kvt_proto_info(type);
    if (!info)
        return s_fail(out, KVT_EUNKTYPE, "%s", "unknown request type");
    uint32_t max_body = info->max_body && info->max_body < lim->max_body ? info->max_body
                                                                          : lim->max_body;
    if (len > max_body) {
        snprintf(out->error, sizeof out->error, "%s body of %zu bytes exceeds %u", info->name,
                 len, max_body);
        return KVT_ETOOBIG;
    }
    int rc = kvt_msg_prescan(buf, len, lim, out->error, sizeof out->error);
    if (rc)
        return rc;
    msgpack_unpacked_init(&out->mp);
    out->mp_live = true;
    size_t off = 0;
    if (msgpack_unpack_next(&out->mp, (const char *)buf, len, &off) != MSGPACK_UNPACK_SUCCESS)
        return s_fail(out, KVT_EBADREQ, "%s", "body is not valid msgpack");
    const msgpack_object *root = &out->mp.data;
    if (root->type != MSGPACK_OBJECT_MAP)
        return s_fail(out, KVT_EBADREQ, "body must be a map, got %s", s_type_name(root->type));
    uint32_t allowed = info->required | info->optional;
    for (uint32_t i = 0; i < root->via.map.size; i++) {
        const msgpack_object_kv *kv = &root->via.map.ptr[i];
        if (kv->key.type != MSGPACK_OBJECT_STR)
            return s_fail(out, KVT_EBADREQ, "body keys must be str, got %s",
                          s_type_name(kv->key.type));
        int fi = s_lookup_field(kv->key.via.str.ptr, kv->key.via.str.size);
        /* unknown fields are ignored: newer clients may send fields this server predates */
        if (fi < 0 || !(allowed & (1u << fi)))
            continue;
        if (out->present & (1u << fi))
            return s_fail(out, KVT_EBADREQ, "field '%s' given twice", kvt_proto_field_name(fi));
        if (kv->val.type == MSGPACK_OBJECT_NIL)
            continue;
        rc = s_field(out, fi, &kv->val, lim);
        if (rc)
            return rc;
        out->present |= 1u << fi;
    }
    uint32_t missing = info->required & ~out->present;
    if (missing) {
        int fi = __builtin_ctz(missing);
        snprintf(out->error, sizeof out->error, "%s needs field '%s'", info->name,
                 kvt_proto_field_name(fi));
        return KVT_EBADREQ;
    }
    return s_cross_check(out);
}

void kvt_req_release(kvt_req_t *req)
{
    if (req && req->mp_live) {
        msgpack_unpacked_destroy(&req->mp);
        req->mp_live = false;
    }
}

void kvt_pack_strn(msgpack_packer *pk, const void *s, size_t n)
{
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

void kvt_pack_str(msgpack_packer *pk, const char *s)
{
    kvt_pack_strn(pk, s, strlen(s));
}

void kvt_pack_error(msgpack_packer *pk, int code, const char *message)
{
    msgpack_pack_map(pk, 2);
    kvt_pack_str(pk, "ok");
    msgpack_pack_false(pk);
    kvt_pack_str(pk, "error");
    msgpack_pack_map(pk, 2);
    kvt_pack_str(pk, "code");
    kvt_pack_str(pk, kvt_err_wire(code));
    kvt_pack_str(pk, "message");
    kvt_pack_str(pk, message && *message ? message : kvt_strerror(code));
}

void kvt_pack_ok(msgpack_packer *pk, uint32_t extra)
{
    msgpack_pack_map(pk, extra + 1);
    kvt_pack_str(pk, "ok");
    msgpack_pack_true(pk);
}
