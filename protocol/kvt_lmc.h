/* kvt_lmc: the LMCache multiprocess wire (docs/integrations.md; ../shared/LMCACHE_MP.md) — its
 * frozen op table, the msgpack shapes of the engine-driven path's arguments, and the encoders
 * of its replies. Separate from protocol v1 (kvt_msg): another framing, another op table,
 * msgspec's encodings.
 *
 * A request is [uid, op, arg1 ... argN] after the ROUTER's identity: uid is echoed byte for
 * byte, op is a msgpack int from the frozen table or a method name as a msgpack str, and each
 * argument is one msgpack frame. Structs arrive as maps keyed by field name: fields are looked
 * up by name, unknown ones ignored, a missing one takes its default or is an error when it has
 * none; scalar types are strict (bool is not int, str is not bin).
 *
 * The key (IPCCacheServerKey, sent six times per prompt with the whole token_ids) is decoded in
 * one bounded pass over its bytes that reads each value in place; every other decoder first runs
 * the bounded pre-scan of kvt_msg and only then unpacks. Both make the same checks (depth 8,
 * each length and element count against the bytes present, the element budget), so no frame can
 * make a decoder allocate more than the frame's own size allows. Pure functions of bytes; any
 * thread; no shared state. */
#ifndef KVT_LMC_H
#define KVT_LMC_H

#include "kvt_key.h"

#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* XX(NAME, wire id, "method name", min args, max args, served) — the frozen table of
 * LMCache's wire.py (ids 1..34), then the ops newer clients send by method name only (their id
 * is kvtier's own, never read from the wire). `served`: the engine-driven shared-memory path kvtier
 * answers, and poll_kv_events; the rest (CUDA-IPC mode, blend, p2p) are refused with an error
 * reply naming the op. Argument counts are those of the served ops' RequestClient signatures (defaults are sent too;
 * clear's `force` and ping's `instance_id` may be left out, end_session may carry a second frame).
 */
#define KVT_LMC_OP_MAP(XX)                                                                         \
    XX(REGISTER_KV_CACHE, 1, "register_kv_cache", 0, 0, false)                                     \
    XX(UNREGISTER_KV_CACHE, 2, "unregister_kv_cache", 0, 0, false)                                 \
    XX(REGISTER_Q_CACHE, 3, "register_q_cache", 0, 0, false)                                       \
    XX(UNREGISTER_Q_CACHE, 4, "unregister_q_cache", 0, 0, false)                                   \
    XX(STORE_Q, 5, "store_q", 0, 0, false)                                                         \
    XX(STORE, 6, "store", 0, 0, false)                                                             \
    XX(RETRIEVE, 7, "retrieve", 0, 0, false)                                                       \
    XX(LOOKUP, 8, "lookup", 2, 2, true)                                                            \
    XX(QUERY_PREFETCH_STATUS, 9, "query_prefetch_status", 1, 1, true)                              \
    XX(WAIT_PREFETCH_STATUS, 10, "wait_prefetch_status", 2, 2, true)                               \
    XX(QUERY_PREFETCH_LOOKUP_HITS, 11, "query_prefetch_lookup_hits", 1, 1, true)                   \
    XX(FREE_LOOKUP_LOCKS, 12, "free_lookup_locks", 2, 2, true)                                     \
    XX(END_SESSION, 13, "end_session", 1, 2, true)                                                 \
    XX(REGISTER_CONTEXT, 14, "register_kv_cache_engine_driven_context", 1, 1, true)                \
    XX(UNREGISTER_CONTEXT, 15, "unregister_kv_cache_engine_driven_context", 1, 1, true)            \
    XX(PREPARE_STORE, 16, "prepare_store", 2, 2, true)                                             \
    XX(COMMIT_STORE, 17, "commit_store", 3, 3, true)                                               \
    XX(PREPARE_RETRIEVE, 18, "prepare_retrieve", 2, 2, true)                                       \
    XX(COMMIT_RETRIEVE, 19, "commit_retrieve", 2, 2, true)                                         \
    XX(CLEAR, 20, "clear", 0, 1, true)                                                             \
    XX(GET_CHUNK_SIZE, 21, "get_chunk_size", 0, 0, true)                                           \
    XX(PING, 22, "ping", 0, 1, true)                                                               \
    XX(REPORT_BLOCK_ALLOCATION, 23, "report_block_allocation", 3, 3, true)                         \
    XX(NOOP, 24, "noop", 0, 0, true)                                                               \
    XX(CB_REGISTER_ROPE, 25, "cb_register_rope", 0, 0, false)                                      \
    XX(CB_UNREGISTER_ROPE, 26, "cb_unregister_rope", 0, 0, false)                                  \
    XX(CB_RETRIEVE_PRE_COMPUTED, 27, "cb_retrieve_pre_computed", 0, 0, false)                      \
    XX(CB_UNIFIED_LOOKUP, 28, "cb_unified_lookup", 0, 0, false)                                    \
    XX(P2P_LOOKUP_AND_LOCK, 29, "p2p_lookup_and_lock", 0, 0, false)                                \
    XX(P2P_QUERY_LOOKUP_RESULTS, 30, "p2p_query_lookup_results", 0, 0, false)                      \
    XX(P2P_UNLOCK_OBJECTS, 31, "p2p_unlock_objects", 0, 0, false)                                  \
    XX(GET_EXPERIMENTAL, 32, "get_experimental", 0, 0, true)                                       \
    XX(CB_PROTOCOL_HANDSHAKE, 33, "cb_protocol_handshake", 0, 0, false)                            \
    XX(POLL_KV_EVENTS, 34, "poll_kv_events", 3, 3, true)                                           \
    XX(ABORT_STORE, 35, "abort_store", 2, 2, true)

typedef enum {
    KVT_LMC_OP_BAD = -2,     /* the op frame is not one msgpack int or str */
    KVT_LMC_OP_UNKNOWN = -1, /* an int outside the table, or a name kvtier does not know */
#define XX(N, ID, NAME, MIN, MAX, SERVED) KVT_LMC_##N = ID,
    KVT_LMC_OP_MAP(XX)
#undef XX
} kvt_lmc_op_t;

#define KVT_LMC_NOPS 36          /* table rows are 1..35 */
#define KVT_LMC_LEGACY_MAX 34    /* wire ids are 1..34; later ops come by method name only */
#define KVT_LMC_MAX_MODEL 200    /* bytes of model_name (it goes into the namespace) */
#define KVT_LMC_MAX_REQUEST 512  /* bytes of a request_id */
#define KVT_LMC_MAX_WORLD 1024   /* world_size */
#define KVT_LMC_MAX_SHAPE 4      /* dimensions of a slot */
#define KVT_LMC_ERROR_MARKER "LMCACHE_RPC_ERROR_V1"

typedef struct {
    const char *name;
    int8_t min_args, max_args;
    bool served;
} kvt_lmc_opinfo_t;

/* The table row of an op, NULL outside 1..KVT_LMC_NOPS-1. */
const kvt_lmc_opinfo_t *kvt_lmc_opinfo(kvt_lmc_op_t op);

/* Decodes an op frame. Returns the op, KVT_LMC_OP_UNKNOWN or KVT_LMC_OP_BAD; `name` (cap
 * bytes, may be NULL) gets a printable name for logs and metrics either way: the table's name,
 * the unknown str itself (sanitised, cut), "#<id>" for an unknown int, "?" for a bad frame. An
 * empty frame is the stream-control form: the caller checks len == 0 first. */
kvt_lmc_op_t kvt_lmc_op_decode(const uint8_t *buf, size_t len, char *name, size_t cap);

/* Limits of one argument frame. */
typedef struct {
    uint32_t max_tokens; /* entries of token_ids */
    uint32_t max_items;  /* array elements + map entries in one frame */
} kvt_lmc_limits_t;

/* IPCCacheServerKey. token_ids and null_mask are malloc'ed (kvt_lmc_key_free). */
typedef struct {
    char model[KVT_LMC_MAX_MODEL + 1];
    uint32_t world_size;             /* 1..KVT_LMC_MAX_WORLD */
    bool has_worker;                 /* worker_id nil (scheduler lookups): false */
    uint32_t worker_id;              /* < world_size when has_worker */
    uint32_t *tokens;                /* token_ids, each 0..2^32-1 */
    uint32_t ntokens;
    uint64_t start, end;             /* [start, end), start <= end (alignment is the caller's) */
    char request_id[KVT_LMC_MAX_REQUEST + 1];
    char salt[KVT_MAX_SALT + 1];     /* cache_salt, no '@' '/' '\\' or NUL */
    uint32_t salt_len;
    uint32_t num_kv_readers;         /* default 0 */
    bool *null_mask;                 /* null_chunk_mask's first group, NULL when nil or empty */
    uint32_t null_mask_len;
} kvt_lmc_key_t;

#define KVT_LMC_MAX_OGROUPS 8 /* object groups of a hybrid registration */
#define KVT_LMC_MAX_KGROUPS 8 /* kernel groups (tensors) in one object group */

/* One tensor of a hybrid chunk object: a kernel group's piece, as the worker declared it. */
typedef struct {
    uint64_t shape[KVT_LMC_MAX_SHAPE];
    uint32_t ndim;
    char dtype[KVT_MAX_DTYPE + 1];
} kvt_lmc_tensor_t;

/* One object group of a hybrid registration: per chunk, one object of its tensors in order. */
typedef struct {
    int32_t sw_chunks; /* a retrieve needs the last sw_chunks chunks; <= 0: every chunk */
    uint32_t ntensors;
    kvt_lmc_tensor_t t[KVT_LMC_MAX_KGROUPS];
} kvt_lmc_ogroup_t;

/* RegisterEngineDrivenContextPayload (the fields kvtier uses; others are ignored). */
typedef struct {
    uint64_t instance_id; /* an int of either sign, kept as its 64 bits */
    char model[KVT_LMC_MAX_MODEL + 1];
    uint32_t world_size;
    uint32_t block_size;
    uint32_t num_layers;
    uint64_t hidden_dim_size;
    char dtype[KVT_MAX_DTYPE + 1];
    bool use_mla;
    uint64_t num_physical_slots; /* 0 when nil */
    uint32_t ngroups;            /* entries of engine_group_infos (0: one non-hybrid group) */
    /* hybrid models: object_group_layout_shapes / _dtype_strs, num_chunks_in_sw and
     * transfer_metadata_wire.tokens_per_chunk (0: no object groups, the plain layout) */
    uint32_t nogroups;
    uint32_t tokens_per_chunk;
    kvt_lmc_ogroup_t og[KVT_LMC_MAX_OGROUPS];
} kvt_lmc_ctx_t;

/* Argument decoders: one msgpack object filling the whole frame. Return 0, or KVT_EBADREQ /
 * KVT_ETOOBIG with a sentence in err naming the field. */
int kvt_lmc_decode_key(const uint8_t *buf, size_t len, const kvt_lmc_limits_t *lim,
                       kvt_lmc_key_t *out, char *err, size_t errlen);
void kvt_lmc_key_free(kvt_lmc_key_t *key);
int kvt_lmc_decode_ctx(const uint8_t *buf, size_t len, const kvt_lmc_limits_t *lim,
                       kvt_lmc_ctx_t *out, char *err, size_t errlen);
/* An int of either sign (msgspec's top-level int), as its 64 bits; *is_nil when nil is allowed
 * (allow_nil) and given. */
int kvt_lmc_decode_int(const uint8_t *buf, size_t len, bool allow_nil, uint64_t *out,
                       bool *is_nil, char *err, size_t errlen);
/* A non-negative int that fits `max`. */
int kvt_lmc_decode_uint(const uint8_t *buf, size_t len, uint64_t max, uint64_t *out, char *err,
                        size_t errlen);
/* A bool (msgspec coerces top-level ints too: 0 / non-0). */
int kvt_lmc_decode_bool(const uint8_t *buf, size_t len, bool *out, char *err, size_t errlen);
/* A float or an int, as seconds. */
int kvt_lmc_decode_double(const uint8_t *buf, size_t len, double *out, char *err, size_t errlen);
/* A str of at most cap - 1 bytes, NUL-terminated (no NUL inside). */
int kvt_lmc_decode_str(const uint8_t *buf, size_t len, char *out, size_t cap, char *err,
                       size_t errlen);
/* bin (not str): its length (commit_store's data: kvtier takes only the empty one). */
int kvt_lmc_decode_bin_len(const uint8_t *buf, size_t len, uint64_t *out, char *err,
                           size_t errlen);
/* report_block_allocation's records: an array of {req_id, new_block_ids, new_token_ids} maps;
 * checked for shape only (kvtier keeps no block telemetry). */
int kvt_lmc_check_records(const uint8_t *buf, size_t len, const kvt_lmc_limits_t *lim,
                          char *err, size_t errlen);

/* Bytes per element of a torch dtype attribute name ("bfloat16", "float16", "half",
 * "float32", "float", "float64", "double", "float8_e4m3fn", "float8_e5m2", "uint8", "int8",
 * "int16", "int32", "int64", "bool"), 0 for any other. */
uint32_t kvt_lmc_dtype_size(const char *dtype);

/* ---- replies: each packs one value frame with msgspec's encodings ---- */

typedef struct {
    uint64_t offset, length;
    uint64_t shape[KVT_LMC_MAX_SHAPE];
    uint32_t ndim;
    const char *dtype;
} kvt_lmc_slot_t;

/* One object group's part of a hybrid prepare reply: n chunk_indices, and n x ntensors slots
 * (chunk by chunk, each chunk's tensors in order). */
typedef struct {
    uint32_t id;
    const uint32_t *chunk_indices;
    uint32_t n;
    const kvt_lmc_slot_t *slots;
    uint32_t ntensors;
} kvt_lmc_ogroup_reply_t;

/* PrepareStoreResponse of a hybrid worker: {context: {object_groups: [{object_group_id,
 * chunk_indices, slots: [[slot, ...], ...]}, ...]}}. */
void kvt_lmc_pack_prepare_store_groups(msgpack_packer *pk, const kvt_lmc_ogroup_reply_t *g,
                                       uint32_t ng);
/* PrepareRetrieveResponse of a hybrid worker: {success, data: bin "", context}, context as
 * above when success, {} otherwise. */
void kvt_lmc_pack_prepare_retrieve_groups(msgpack_packer *pk, bool success,
                                          const kvt_lmc_ogroup_reply_t *g, uint32_t ng);

/* RegisterEngineDrivenContextResponse: {shm_name, pool_size, scratch_offset: 0,
 * scratch_size: 0, error}; error NULL packs nil. */
void kvt_lmc_pack_register(msgpack_packer *pk, const char *shm_name, uint64_t pool_size,
                           const char *error);
/* PrepareStoreResponse: {context: {slots: [...], chunk_indices: [...]}}. */
void kvt_lmc_pack_prepare_store(msgpack_packer *pk, const kvt_lmc_slot_t *slots,
                                const uint32_t *chunk_indices, uint32_t n);
/* PrepareRetrieveResponse: {success, data: bin "", context: {slots: [...]}}. */
void kvt_lmc_pack_prepare_retrieve(msgpack_packer *pk, bool success, const kvt_lmc_slot_t *slots,
                                   uint32_t n);
/* KVEventPollResult's head: {enabled, incarnation, next_cursor, lost, events: [...]}, the
 * events array's header for `nevents` records, each packed next by kvt_lmc_pack_kv_event. */
void kvt_lmc_pack_poll_head(msgpack_packer *pk, bool enabled, uint64_t incarnation,
                            uint64_t next_cursor, bool lost, uint32_t nevents);

/* One KVEventRecord: a run of n blocks (chunks) of one model. */
typedef struct {
    uint64_t seq;
    bool stored;  /* kind "stored" (else "removed") */
    bool storage; /* medium "STORAGE" (L2; else "CPU": L1) */
    const char *model;
    const kvt_key_t *hashes; /* block_hashes, each a bin of KVT_KEY_LEN */
    uint32_t n;
    const kvt_key_t *parent;       /* parent_block_hash, NULL packs nil */
    const uint32_t *const *tokens; /* stored: n blocks of block_size token ids; else NULL */
    uint32_t block_size;
} kvt_lmc_kv_event_t;

/* {seq, kind, medium, model_name, block_hashes, parent_block_hash, token_ids, block_size}:
 * a removed record carries token_ids [] and parent nil. */
void kvt_lmc_pack_kv_event(msgpack_packer *pk, const kvt_lmc_kv_event_t *ev);

/* The error reply's value frame (after the KVT_LMC_ERROR_MARKER frame): {error_type, message},
 * message cut to 4096 bytes. */
void kvt_lmc_pack_error(msgpack_packer *pk, const char *error_type, const char *message);

#endif
