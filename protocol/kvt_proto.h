/* kvt_proto: the request-type and field tables of wire protocol v1 (DESIGN.md, binding).
 *
 * KVT_REQ_MAP is the single source of truth for request types: frozen wire id, name, where the
 * server runs it (its run class), the fields it requires and accepts, and its own body-size
 * bound. The table is append-only: ids and field meanings never
 * change. Pure data; any thread. */
#ifndef KVT_PROTO_H
#define KVT_PROTO_H

#include "kvt_key.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVT_PROTO_VERSION 1
#define KVT_MAX_NAME 256 /* client and instance names */
#define KVT_MAX_TOKEN 64 /* HELLO's instance token (the daemon issues 32 hex digits) */

/* XX(FIELD, "wire name", kind) — kinds: UINT, BOOL, STR, BIN, KEYS (array of bin16),
 * UINTS (array of uint), HANDLES (array of bin64: CUDA IPC memory handles), LABELS (array of
 * UTF-8 str of at most KVT_MAX_LABEL bytes, or nil). `present` is a
 * uint32 bitmask: at most 32 fields. */
#define KVT_FIELD_MAP(XX)                                                                      \
    XX(VERSION, "version", UINT)                                                               \
    XX(CLIENT, "client", STR)                                                                  \
    XX(INSTANCE, "instance", STR)                                                              \
    XX(NS, "ns", STR)                                                                          \
    XX(SALT, "salt", STR)                                                                      \
    XX(KEYS, "keys", KEYS)                                                                     \
    XX(LOCK, "lock", BOOL)                                                                     \
    XX(PREFETCH, "prefetch", BOOL)                                                             \
    XX(JOB, "job", UINT)                                                                       \
    XX(SIZES, "sizes", UINTS)                                                                  \
    XX(SIZE, "size", UINT)                                                                     \
    XX(LEASE, "lease", UINT)                                                                   \
    XX(FAILED, "failed", UINTS)                                                                \
    XX(TOKENS, "tokens", BIN)                                                                  \
    XX(CHUNK_TOKENS, "chunk_tokens", UINT)                                                     \
    XX(HANDLES, "handles", HANDLES)                                                            \
    XX(OFFSETS, "offsets", UINTS)                                                              \
    XX(DEVICE, "device", UINT)                                                                 \
    XX(LAYERS, "layers", UINT)                                                                 \
    XX(NUM_BLOCKS, "num_blocks", UINT)                                                         \
    XX(BLOCK_TOKENS, "block_tokens", UINT)                                                     \
    XX(TOKEN_BYTES, "token_bytes", UINT)                                                       \
    XX(DTYPE, "dtype", STR)                                                                    \
    XX(BLOCK_IDS, "block_ids", UINTS)                                                          \
    XX(EVENT, "event", BIN)                                                                    \
    XX(TOKEN, "token", STR)                                                                    \
    XX(FASTPATH, "fastpath", BOOL)                                                             \
    XX(RESIDENT, "resident", BOOL)                                                             \
    XX(LABELS, "labels", LABELS)

typedef enum {
#define KVT_XX(f, name, kind) KVT_FI_##f,
    KVT_FIELD_MAP(KVT_XX)
#undef KVT_XX
        KVT_FIELD_COUNT
} kvt_field_idx_t;

_Static_assert(KVT_FIELD_COUNT <= 32, "kvt_req_t.present is a uint32 bitmask");

#define KVT_XX(f, name, kind) KVT_F_##f = 1u << KVT_FI_##f,
enum { KVT_FIELD_MAP(KVT_XX) };
#undef KVT_XX

/* Where the server runs a request: INLINE on the server loop; WORKER on the worker pool;
 * INLINE_THEN_LOOKUP on the server loop, then, when that part leaves work for L2 (LOOKUP: keys
 * past the L1 prefix, with an L2 tier), on the lookup pool, which answers. */
typedef enum {
    KVT_RUN_INLINE = 0,
    KVT_RUN_WORKER = 1,
    KVT_RUN_INLINE_THEN_LOOKUP = 2
} kvt_run_class_t;

#define KVT_NONE 0u
#define KVT_KEYED (KVT_F_NS | KVT_F_KEYS)
#define KVT_GPU_LAYOUT                                                                         \
    (KVT_F_HANDLES | KVT_F_DEVICE | KVT_F_LAYERS | KVT_F_NUM_BLOCKS | KVT_F_BLOCK_TOKENS |      \
     KVT_F_TOKEN_BYTES | KVT_F_DTYPE)
#define KVT_GPU_COPY (KVT_KEYED | KVT_F_DEVICE | KVT_F_BLOCK_IDS)

/* XX(id, NAME, "name", run class, required fields, optional fields, max body bytes (0 = the
 * configured max_message)) */
#define KVT_REQ_MAP(XX)                                                                        \
    XX(1, HELLO, "hello", INLINE, KVT_F_VERSION | KVT_F_CLIENT | KVT_F_INSTANCE,               \
       KVT_F_TOKEN | KVT_F_FASTPATH | KVT_F_RESIDENT,                                          \
       65536)                                                                                  \
    XX(2, BYE, "bye", INLINE, KVT_F_INSTANCE, KVT_NONE, 65536)                                 \
    XX(3, PING, "ping", INLINE, KVT_NONE, KVT_F_INSTANCE, 65536)                               \
    XX(4, LOOKUP, "lookup", INLINE_THEN_LOOKUP, KVT_KEYED,                                     \
       KVT_F_SALT | KVT_F_LOCK | KVT_F_PREFETCH, 0)                                             \
    XX(5, PREFETCH_STATUS, "prefetch_status", INLINE, KVT_F_JOB, KVT_NONE, 65536)              \
    XX(6, RESERVE, "reserve", INLINE, KVT_KEYED,                                               \
       KVT_F_SALT | KVT_F_SIZES | KVT_F_SIZE | KVT_F_LABELS, 0)                                 \
    XX(7, COMMIT, "commit", INLINE, KVT_F_LEASE, KVT_F_FAILED, 0)                              \
    XX(8, ACQUIRE, "acquire", INLINE, KVT_KEYED, KVT_F_SALT, 0)                                \
    XX(9, RELEASE, "release", INLINE, KVT_F_LEASE, KVT_NONE, 65536)                            \
    XX(10, PUT, "put", WORKER, KVT_KEYED, KVT_F_SALT | KVT_F_LABELS, 0)                        \
    XX(11, GET, "get", INLINE, KVT_KEYED, KVT_F_SALT, 0)                                       \
    XX(12, REMOVE, "remove", INLINE, KVT_KEYED, KVT_F_SALT, 0)                                 \
    XX(13, CLEAR, "clear", WORKER, KVT_NONE, KVT_F_NS, 65536)                                  \
    XX(14, STATS, "stats", INLINE, KVT_NONE, KVT_NONE, 65536)                                  \
    XX(15, HASH_TOKENS, "hash_tokens", INLINE, KVT_F_TOKENS, KVT_F_CHUNK_TOKENS | KVT_F_SALT, 0) \
    XX(16, REGISTER_GPU, "register_gpu", WORKER, KVT_GPU_LAYOUT, KVT_F_OFFSETS, 1048576)         \
    XX(17, UNREGISTER_GPU, "unregister_gpu", WORKER, KVT_F_DEVICE, KVT_NONE, 65536)             \
    XX(18, STORE_GPU, "store_gpu", WORKER, KVT_GPU_COPY, KVT_F_SALT | KVT_F_EVENT, 0)           \
    XX(19, RETRIEVE_GPU, "retrieve_gpu", WORKER, KVT_GPU_COPY, KVT_F_SALT | KVT_F_EVENT, 0)

typedef enum {
    KVT_REQ_UNKNOWN = 0,
#define KVT_XX(id, NAME, name, cls, req, opt, max) KVT_REQ_##NAME = id,
    KVT_REQ_MAP(KVT_XX)
#undef KVT_XX
} kvt_req_type_t;

/* One past the highest wire id: arrays indexed by type are this long. */
#define KVT_REQ_SLOTS 20

typedef struct {
    kvt_req_type_t type;
    const char *name;
    kvt_run_class_t run;
    uint32_t required;
    uint32_t optional;
    uint32_t max_body;
} kvt_req_info_t;

/* Table row for a wire id, or NULL when the id is not a known request type. */
const kvt_req_info_t *kvt_proto_info(uint64_t type);

/* Lower-case name of a type ("lookup"), "unknown" for ids outside the table. */
const char *kvt_proto_name(uint64_t type);

/* Wire name of field index i ("keys"). */
const char *kvt_proto_field_name(int i);

#endif
