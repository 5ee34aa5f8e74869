/* kvt_msg: decode and encode protocol v1 message parts.
 *
 * The decoder is a pure function of bytes (no socket, global or clock), so unit tests and
 * fuzzers drive it directly. msgpack-c sizes arrays and maps from their declared counts before
 * reading them, so every body first goes through a bounded pre-scan (depth, element counts
 * against the bytes actually present, total elements) and only then is unpacked — into a
 * per-request zone that kvt_req_release() frees in one go. Any thread; no shared state. */
#ifndef KVT_MSG_H
#define KVT_MSG_H

#include "kvt_proto.h"

#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t max_body;  /* bytes of one body */
    uint32_t max_depth; /* nesting of arrays/maps */
    uint32_t max_items; /* array elements + map keys and values, whole body */
    uint32_t max_keys;  /* entries of `keys` (and `sizes`, `failed`) */
} kvt_limits_t;

/* Limits derived from max_message and max_keys (the config's), used by the server. */
void kvt_limits_init(kvt_limits_t *lim, uint64_t max_message, uint32_t max_keys);

/* A decoded request body. Pointers stay valid until kvt_req_release(); `present` has a
 * KVT_F_* bit for every field that was given (a nil value counts as absent). */
typedef struct kvt_req {
    kvt_req_type_t type;
    uint32_t present;
    uint64_t version;
    kvt_bytes_t client, instance, tokens;
    kvt_ns_t ns; /* `ns` and `salt` (HASH_TOKENS has a salt only; CLEAR an ns only) */
    const kvt_key_t *keys;
    uint32_t nkeys;
    uint64_t *sizes;
    uint32_t nsizes;
    uint64_t size;
    bool lock, prefetch;
    bool fastpath; /* HELLO: the client asks for a fast-path ring pair */
    bool resident; /* HELLO: ... and for the residency map with it */
    uint64_t job, lease, chunk_tokens;
    uint64_t *failed;
    uint32_t nfailed;
    /* GPU requests (REGISTER_GPU ... RETRIEVE_GPU) */
    uint8_t (*handles)[KVT_IPC_HANDLE_LEN];
    uint32_t nhandles;
    uint64_t *offsets;
    uint32_t noffsets;
    uint64_t device, layers, num_blocks, block_tokens, token_bytes;
    kvt_bytes_t dtype, event;
    kvt_bytes_t token; /* HELLO: the token of an instance to join */
    kvt_bytes_t *labels; /* RESERVE, PUT: nlabels == nkeys; len 0 for a key without one */
    uint32_t nlabels;
    uint64_t *block_ids; /* nkeys runs of nblock_ids / nkeys ids each, chunk by chunk */
    uint32_t nblock_ids;
    msgpack_unpacked mp; /* the per-request zone */
    bool mp_live;
    char error[160]; /* why decoding failed, for the error reply */
} kvt_req_t;

/* Decodes the body of a request of (known) type `type`. On success returns 0 and `out` owns a
 * zone; on failure returns KVT_EBADREQ or KVT_ETOOBIG with out->error set. Either way the
 * caller calls kvt_req_release(out). Checks shapes, types, lengths and cross-field rules;
 * semantics (version numbers, lease ids) are the handler's. */
int kvt_msg_decode(const uint8_t *buf, size_t len, kvt_req_type_t type, const kvt_limits_t *lim,
                   kvt_req_t *out);

void kvt_req_release(kvt_req_t *req);

/* The wire's rule for an `ns` of `len` bytes (1 to KVT_MAX_NS), for every place that takes one
 * (the decoder, HTTP POST /clear). 0, or KVT_EBADREQ with the reason in err. */
int kvt_msg_check_ns(size_t len, char *err, size_t errlen);

/* Bounded structural check of one msgpack object filling exactly buf[0..len). Returns 0,
 * KVT_EBADREQ (malformed, too deep, truncated, trailing bytes) or KVT_ETOOBIG (too many
 * elements), with a reason in err. */
int kvt_msg_prescan(const uint8_t *buf, size_t len, const kvt_limits_t *lim, char *err,
                    size_t errlen);

/* Reads a frame that must hold exactly one msgpack non-negative integer (the uid and type
 * frames). Returns 0 or KVT_EBADREQ. */
int kvt_msg_read_uint(const uint8_t *buf, size_t len, uint64_t *out);

/* Encoding helpers for reply bodies. */
void kvt_pack_str(msgpack_packer *pk, const char *s);
void kvt_pack_strn(msgpack_packer *pk, const void *s, size_t n);

/* A whole error body: {ok: false, error: {code, message}}. */
void kvt_pack_error(msgpack_packer *pk, int code, const char *message);

/* Starts an ok body with `extra` more entries to follow: map header + "ok": true. */
void kvt_pack_ok(msgpack_packer *pk, uint32_t extra);

#endif
