/* kvt_gpu: the GPU path — engines whose KV cache lives on the GPU register it once (CUDA IPC
 * memory handles, one per layer) and the daemon copies between their blocks and L1 objects.
 *
 * Owns: the CUDA runtime (dlopen'ed at the first GPU request, never at start-up), the
 * cudaHostRegister of the L1 arena (once, verified), the registrations (instance x device: the
 * opened IPC allocations and the KV layout), the daemon's copy streams, and a closer thread
 * (started with the first registration) that closes the handles of instances that went away.
 *
 * Threads: kvt_gpu_register/unregister/store/retrieve run on workers (they block on CUDA);
 * kvt_gpu_owner_gone runs on the server thread and never calls CUDA (it only unlinks and hands
 * the registrations to the closer). new/destroy: main thread, destroy after the workers stopped.
 * Built without the CUDA toolkit (no KVT_HAVE_CUDA), every request still validates and then
 * answers KVT_EUNAVAIL. A data-path module: it takes plain arguments (the daemon's handlers
 * decode the wire), so it needs no protocol header. */
#ifndef KVT_GPU_H
#define KVT_GPU_H

#include "kvt_key.h"
#include "kvt_l1.h"
#include "kvt_metrics.h"

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_gpu kvt_gpu_t;

/* Devices a registration may name (device index < this; the real count is CUDA's). */
#define KVT_GPU_MAX_DEVICES 64
#define KVT_GPU_MAX_BLOCK_TOKENS 65536
#define KVT_GPU_MAX_TOKEN_BYTES (1u << 24)
#define KVT_GPU_MAX_BLOCKS (1ull << 32)
#define KVT_GPU_MAX_CHUNK_BLOCKS 65536

/* A validated KV layout: `layers` device buffers of num_blocks blocks each; block b of a layer
 * holds block_tokens x token_bytes bytes at byte offset b x block_bytes of that buffer. */
typedef struct {
    uint32_t device;
    uint32_t layers;
    uint64_t num_blocks;
    uint32_t block_tokens;
    uint32_t token_bytes;
    uint32_t dtype_size;
    uint64_t block_bytes; /* block_tokens x token_bytes */
    uint64_t layer_bytes; /* num_blocks x block_bytes */
} kvt_gpu_layout_t;

/* What REGISTER_GPU asks for, as decoded (borrowed for the call): `layers` device buffers,
 * handles[l] (KVT_IPC_HANDLE_LEN bytes each, nhandles of them, contiguous) the CUDA IPC handle
 * of layer l's allocation and offsets[l] its buffer's byte offset in it (offsets NULL: 0). */
typedef struct {
    uint64_t device, layers, num_blocks, block_tokens, token_bytes;
    const uint8_t *dtype;
    uint32_t dtype_len;
    const uint8_t *handles;
    uint32_t nhandles;
    const uint64_t *offsets;
    uint32_t noffsets;
} kvt_gpu_reg_args_t;

/* What STORE_GPU / RETRIEVE_GPU ask for (borrowed for the call): chunk i (key i of ns) is made
 * of the blocks block_ids[i * per, (i + 1) * per) of the registration on `device`, per =
 * nblock_ids / nkeys. event: NULL, or the KVT_IPC_HANDLE_LEN bytes of a cudaIpcEventHandle_t
 * that the copies wait for. */
typedef struct {
    uint64_t device;
    kvt_ns_t ns;
    const kvt_key_t *keys;
    uint32_t nkeys;
    const uint64_t *block_ids;
    uint32_t nblock_ids;
    const uint8_t *event;
} kvt_gpu_copy_args_t;

/* Pure: checks the layout of a REGISTER_GPU (layers = handles >= 1, block and token sizes in
 * range, dtype known and dividing token_bytes, no handle all zeros, offsets and sizes without
 * overflow) and fills *out. 0 or KVT_EBADREQ with a sentence in err. */
int kvt_gpu_layout_check(const kvt_gpu_reg_args_t *r, kvt_gpu_layout_t *out, char *err,
                         size_t errlen);

/* Pure: bytes per element of a dtype name ("bfloat16" -> 2), 0 when unknown. */
uint32_t kvt_gpu_dtype_size(const uint8_t *name, uint32_t len);

/* Pure: checks the block ids of a STORE_GPU / RETRIEVE_GPU against a layout: nkeys runs of
 * *per_chunk ids each, every id < num_blocks; *chunk_bytes = layers x per_chunk x block_bytes
 * (the size of one L1 object). 0 or KVT_EBADREQ with a sentence in err. */
int kvt_gpu_chunk_check(const kvt_gpu_layout_t *lay, const uint64_t *ids, uint32_t nids,
                        uint32_t nkeys, uint32_t *per_chunk, uint64_t *chunk_bytes, char *err,
                        size_t errlen);

/* Pure: splits ids[0..n) into runs of consecutive block ids (id[i+1] == id[i] + 1), so that
 * one copy moves a whole run. Writes the start index and length of each run; returns the
 * number of runs (<= n). */
uint32_t kvt_gpu_runs(const uint64_t *ids, uint32_t n, uint32_t *start, uint32_t *len);

/* Creates the module; touches no CUDA and starts no thread. */
kvt_gpu_t *kvt_gpu_new(kvt_l1_t *l1);

/* Closes every registration and stream and unregisters the arena. After the workers stopped,
 * before the L1 arena is unmapped. */
void kvt_gpu_destroy(kvt_gpu_t **self_p);

/* REGISTER_GPU for `owner` (worker): validates, loads CUDA on first use (KVT_EUNAVAIL "no CUDA
 * device: ..." without one), pins the arena once, opens the handles. A second registration of
 * the same instance on the same device: KVT_EBADREQ. Fills *lay on success. */
int kvt_gpu_register(kvt_gpu_t *self, uint64_t owner, const kvt_gpu_reg_args_t *r,
                     kvt_gpu_layout_t *lay, char *err, size_t errlen);

/* UNREGISTER_GPU (worker): drops the registration; the handles close once no copy uses them.
 * KVT_ENOTFOUND when there is none. */
int kvt_gpu_unregister(kvt_gpu_t *self, uint64_t owner, uint64_t device, char *err,
                       size_t errlen);

/* STORE_GPU (worker): reserves one L1 object per key (the longest prefix that fits; keys
 * already stored are skipped), gathers each chunk's blocks into it (layer-major, see
 * docs/protocol.md), waits for the copies and commits. *stored as COMMIT counts it. */
int kvt_gpu_store(kvt_gpu_t *self, uint64_t owner, const kvt_gpu_copy_args_t *r,
                  uint32_t *stored, char *err, size_t errlen);

/* RETRIEVE_GPU (worker): pins the leading keys found in L1 with this layout's object size,
 * scatters them into the chunks' blocks, waits for the copies and unpins. *found: chunks
 * written. */
int kvt_gpu_retrieve(kvt_gpu_t *self, uint64_t owner, const kvt_gpu_copy_args_t *r,
                     uint32_t *found, char *err, size_t errlen);

/* The instance `owner` said BYE or went silent (server thread): its registrations are
 * unlinked at once and closed off this thread once no copy uses them. Returns how many. */
uint32_t kvt_gpu_owner_gone(kvt_gpu_t *self, uint64_t owner);

/* Registrations currently linked (tests, /status). Any thread. */
uint32_t kvt_gpu_registrations(kvt_gpu_t *self);

/* For /status: whether the runtime is loaded (or why it is unavailable), whether the arena is
 * registered, and every registration's layout with its owner (the session id of /status's
 * clients). Any thread. */
json_t *kvt_gpu_status_json(kvt_gpu_t *self);

/* Metrics source (kvt_metrics_add_source): kvtier_gpu_runtime_loaded,
 * kvtier_gpu_arena_registered, kvtier_gpu_registrations, kvtier_gpu_copied_bytes_total
 * {direction="to_l1"|"to_gpu"}, kvtier_gpu_copy_errors_total. Any thread; never waits for
 * CUDA. */
void kvt_gpu_metrics_source(void *self, kvt_sample_fn emit, void *emit_ctx);

#endif
