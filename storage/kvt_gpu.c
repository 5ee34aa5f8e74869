/* DESIGN: CUDA is loaded with dlopen("libcudart.so.<major of the headers>") at the first GPU
 * request, so start-up (and a daemon that never sees a GPU client) maps no CUDA library and
 * creates no context; the function pointers are typed from the toolkit's own prototypes
 * (__typeof__), so a signature change is a compile error. Loading once, the result (or the
 * reason it failed) is kept: a machine without a driver answers every GPU request
 * `unavailable` with cudaGetErrorString's text.
 *
 * Registrations: a list of s_reg_t under `lock` (a leaf, held only for list work, never across
 * a CUDA call). Each carries a refcount: one for being linked, one per copy in flight. When the
 * last reference goes on a worker the handles are closed there; when it goes on the server
 * thread (owner_gone), the registration is queued (a kvt_queue, bounded by the registrations
 * themselves) to the closer thread, because cudaIpcCloseMemHandle may block. The closer is not
 * supervised: a close that hangs in the driver must not turn /readyz red; it waits without a
 * timeout and, on destroy, closes what was queued before it returns. `init_lock` serialises loading CUDA and pinning the arena
 * (slow, once); it is never taken by the server thread.
 *
 * Copies: one request = one stream from a per-device free list (created on demand, so there
 * are at most as many as concurrent workers). A client event (cudaIpcEventHandle_t) is waited
 * for on the stream before the first copy; the worker then waits for the stream. Two ways:
 * - direct: consecutive block ids are coalesced into one copy (kvt_gpu_runs) per layer and
 *   run, issued with cudaMemcpyBatchAsync (one call for up to S_OPS copies) when the runtime
 *   has it, else one cudaMemcpyAsync each;
 * - staged: the kernel of kvt_gpu_kernels.cu gathers a slice of a chunk (as many whole layers
 *   as fit) into the stream's staging buffer in device memory, laid out as the L1 object, and
 *   one DMA copy moves the slice (RETRIEVE: the copy, then the scatter). For short runs (a
 *   shuffled block table: one 32-64 KiB DMA per block and layer), where the copy engine's
 *   per-copy cost caps PCIe well below its rate.
 * KVT_GPU_COPY=auto (default) takes staged when the kernel loaded and the direct copies would
 * average under S_AUTO_RUN bytes; `direct` and `staged` force one (benchmarks, tests). */
#include "kvt_gpu.h"

#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_queue.h"
#include "kvt_thread.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef KVT_HAVE_CUDA
#include <cuda_runtime_api.h>
#if defined(KVT_HAVE_GPU_KERNELS) && CUDART_VERSION >= 12000
#include "kvt_gpu_kernels.h"
#define S_KERNELS 1
/* the fatbin nvcc built from kvt_gpu_kernels.cu (build/gen/, see the Makefile) */
static const unsigned char s_fatbin[] __attribute__((aligned(64))) = {
#include "kvt_gpu_kernels.inc"
};
#endif
#endif

#define S_OPS 4096                   /* copies issued per batch */
#define S_STAGE_BYTES (32ull << 20)  /* staging buffer per stream (KVT_GPU_STAGING_BYTES) */
#define S_SLICE (16ull << 20)        /* a staged slice's target size (KVT_GPU_SLICE_BYTES) */
#define S_AUTO_RUN (2ull << 20)      /* auto: staged when direct copies average less */

/* ---- pure validation ---- */

static const struct {
    const char *name;
    uint32_t size;
} s_dtypes[] = {
    {"float16", 2},      {"bfloat16", 2},    {"float32", 4}, {"float8_e4m3fn", 1},
    {"float8_e5m2", 1},  {"int8", 1},        {"uint8", 1},
};

uint32_t kvt_gpu_dtype_size(const uint8_t *name, uint32_t len)
{
    for (size_t i = 0; i < sizeof s_dtypes / sizeof s_dtypes[0]; i++)
        if (strlen(s_dtypes[i].name) == len && memcmp(s_dtypes[i].name, name, len) == 0)
            return s_dtypes[i].size;
    return 0;
}

static int s_bad(char *err, size_t errlen, const char *fmt, unsigned long long a,
                 unsigned long long b)
{
    snprintf(err, errlen, fmt, a, b);
    return KVT_EBADREQ;
}

/* Handle of layer i. */
static const uint8_t *s_handle(const kvt_gpu_reg_args_t *r, uint32_t i)
{
    return r->handles + (size_t)i * KVT_IPC_HANDLE_LEN;
}

int kvt_gpu_layout_check(const kvt_gpu_reg_args_t *r, kvt_gpu_layout_t *out, char *err,
                         size_t errlen)
{
    memset(out, 0, sizeof *out);
    if (r->layers < 1 || r->layers > KVT_MAX_GPU_LAYERS)
        return s_bad(err, errlen, "'layers' is %llu: must be 1 to %llu", r->layers,
                     KVT_MAX_GPU_LAYERS);
    if (r->nhandles != r->layers)
        return s_bad(err, errlen, "'handles' has %llu entries for %llu layers", r->nhandles,
                     r->layers);
    if (r->offsets && r->noffsets != r->layers)
        return s_bad(err, errlen, "'offsets' has %llu entries for %llu layers", r->noffsets,
                     r->layers);
    if (r->device >= KVT_GPU_MAX_DEVICES)
        return s_bad(err, errlen, "'device' is %llu: must be below %llu", r->device,
                     KVT_GPU_MAX_DEVICES);
    if (r->num_blocks < 1 || r->num_blocks > KVT_GPU_MAX_BLOCKS)
        return s_bad(err, errlen, "'num_blocks' is %llu: must be 1 to %llu", r->num_blocks,
                     KVT_GPU_MAX_BLOCKS);
    if (r->block_tokens < 1 || r->block_tokens > KVT_GPU_MAX_BLOCK_TOKENS)
        return s_bad(err, errlen, "'block_tokens' is %llu: must be 1 to %llu", r->block_tokens,
                     KVT_GPU_MAX_BLOCK_TOKENS);
    if (r->token_bytes < 1 || r->token_bytes > KVT_GPU_MAX_TOKEN_BYTES)
        return s_bad(err, errlen, "'token_bytes' is %llu: must be 1 to %llu", r->token_bytes,
                     KVT_GPU_MAX_TOKEN_BYTES);
    uint32_t dsize = kvt_gpu_dtype_size(r->dtype, r->dtype_len);
    if (dsize == 0) {
        snprintf(err, errlen,
                 "'dtype' %.*s is not one of float16, bfloat16, float32, float8_e4m3fn, "
                 "float8_e5m2, int8, uint8",
                 (int)(r->dtype_len > KVT_MAX_DTYPE ? KVT_MAX_DTYPE : r->dtype_len),
                 (const char *)r->dtype);
        return KVT_EBADREQ;
    }
    if (r->token_bytes % dsize)
        return s_bad(err, errlen, "'token_bytes' %llu is not a multiple of the dtype's %llu "
                                  "bytes", r->token_bytes, dsize);
    /* block_tokens <= 2^16 and token_bytes <= 2^24: block_bytes < 2^40, num_blocks <= 2^32 */
    uint64_t block_bytes = r->block_tokens * r->token_bytes;
    uint64_t layer_bytes;
    if (__builtin_mul_overflow(block_bytes, r->num_blocks, &layer_bytes))
        return s_bad(err, errlen, "%llu blocks of %llu bytes overflow a 64-bit size",
                     r->num_blocks, block_bytes);
    static const uint8_t zero[KVT_IPC_HANDLE_LEN];
    for (uint32_t i = 0; i < r->nhandles; i++) {
        if (memcmp(s_handle(r, i), zero, sizeof zero) == 0) {
            snprintf(err, errlen, "handle %u is all zeros (not a cudaIpcMemHandle_t)", i);
            return KVT_EBADREQ;
        }
        uint64_t end;
        if (r->offsets && __builtin_add_overflow(r->offsets[i], layer_bytes, &end))
            return s_bad(err, errlen, "'offsets'[%llu] = %llu overflows with the layer size", i,
                         r->offsets[i]);
    }
    out->device = (uint32_t)r->device;
    out->layers = (uint32_t)r->layers;
    out->num_blocks = r->num_blocks;
    out->block_tokens = (uint32_t)r->block_tokens;
    out->token_bytes = (uint32_t)r->token_bytes;
    out->dtype_size = dsize;
    out->block_bytes = block_bytes;
    out->layer_bytes = layer_bytes;
    return 0;
}

int kvt_gpu_chunk_check(const kvt_gpu_layout_t *lay, const uint64_t *ids, uint32_t nids,
                        uint32_t nkeys, uint32_t *per_chunk, uint64_t *chunk_bytes, char *err,
                        size_t errlen)
{
    *per_chunk = 0;
    *chunk_bytes = 0;
    if (nkeys == 0) {
        if (nids)
            return s_bad(err, errlen, "%llu block ids for %llu keys", nids, 0);
        return 0;
    }
    if (nids == 0 || nids % nkeys)
        return s_bad(err, errlen, "'block_ids' has %llu entries: not a positive multiple of "
                                  "the %llu keys", nids, nkeys);
    uint32_t per = nids / nkeys;
    if (per > KVT_GPU_MAX_CHUNK_BLOCKS)
        return s_bad(err, errlen, "%llu blocks per chunk: at most %llu", per,
                     KVT_GPU_MAX_CHUNK_BLOCKS);
    for (uint32_t i = 0; i < nids; i++)
        if (ids[i] >= lay->num_blocks)
            return s_bad(err, errlen, "'block_ids' entry %llu is %llu: the registered cache "
                                      "has fewer blocks", i, ids[i]);
    uint64_t bytes;
    if (__builtin_mul_overflow((uint64_t)lay->layers * per, lay->block_bytes, &bytes))
        return s_bad(err, errlen, "chunks of %llu blocks x %llu layers overflow", per,
                     lay->layers);
    *per_chunk = per;
    *chunk_bytes = bytes;
    return 0;
}

uint32_t kvt_gpu_runs(const uint64_t *ids, uint32_t n, uint32_t *start, uint32_t *len)
{
    uint32_t runs = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (runs && ids[i] == ids[i - 1] + 1 && ids[i - 1] != UINT64_MAX) {
            len[runs - 1]++;
            continue;
        }
        start[runs] = i;
        len[runs] = 1;
        runs++;
    }
    return runs;
}

/* ---- the module ---- */

typedef struct s_reg {
    struct s_reg *next;
    uint64_t owner;
    kvt_gpu_layout_t lay;
    uint32_t nbases;
    void **bases;    /* distinct opened allocations (cudaIpcCloseMemHandle each) */
    uint8_t **ptrs;  /* per layer: its buffer (base + offset) */
    uint32_t refs;   /* linked + copies in flight */
    bool linked;
    bool ready;      /* handles open: copies may use it */
} s_reg_t;

/* A copy stream of one device. The staged copies add (at its first staged copy) a second
 * stream for the kernel, the staging buffer in S_SLOTS slots with an event each for "filled"
 * and "free", and the request's layer pointers and block ids on both sides. */
#define S_SLOTS 8
typedef struct s_stream {
    struct s_stream *next;
    void *stream;  /* cudaStream_t: the copies (and every direct copy) */
    bool staged;   /* what follows is allocated */
    void *kstream; /* cudaStream_t: the kernels */
    void *stage;   /* stage_bytes of device memory */
    void *full[S_SLOTS], *free[S_SLOTS], *done; /* cudaEvent_t */
    void *meta;    /* meta_cap bytes of device memory */
    size_t meta_cap;
    void *hmeta;   /* hmeta_cap bytes of pinned host memory: meta's source */
    size_t hmeta_cap;
} s_stream_t;

typedef enum { S_COPY_AUTO, S_COPY_DIRECT, S_COPY_STAGED } s_copy_mode_t;
/* How a worker waits for its copies (KVT_GPU_SYNC): spin in cudaStreamSynchronize (the
 * runtime's default with fewer contexts than cores), block in it (cudaDeviceScheduleBlockingSync:
 * an interrupt and a wake-up per request), or poll (the default): when the copies should take
 * long (at the fastest rate seen so far), sleep through 3/4 of that, then poll cudaStreamQuery,
 * yielding: a copy of hundreds of MiB no longer keeps a core busy for its milliseconds. */
typedef enum { S_SYNC_POLL, S_SYNC_SPIN, S_SYNC_BLOCKING } s_sync_mode_t;

#ifdef KVT_HAVE_CUDA
#define S_FN(name) __typeof__(name) *name
typedef struct {
    S_FN(cudaGetDeviceCount);
    S_FN(cudaGetErrorString);
    S_FN(cudaGetLastError);
    S_FN(cudaSetDevice);
    S_FN(cudaHostRegister);
    S_FN(cudaHostUnregister);
    S_FN(cudaPointerGetAttributes);
    S_FN(cudaIpcOpenMemHandle);
    S_FN(cudaIpcCloseMemHandle);
    S_FN(cudaIpcOpenEventHandle);
    S_FN(cudaEventDestroy);
    S_FN(cudaStreamCreateWithFlags);
    S_FN(cudaStreamDestroy);
    S_FN(cudaStreamWaitEvent);
    S_FN(cudaStreamSynchronize);
    S_FN(cudaStreamQuery);
    S_FN(cudaSetDeviceFlags);
    S_FN(cudaMemcpyAsync);
    S_FN(cudaMemcpyBatchAsync); /* optional: NULL before CUDA 12.8 */
#ifdef S_KERNELS
    /* optional, for the staged copies: without them (or the kernel) copies are direct */
    S_FN(cudaMalloc);
    S_FN(cudaFree);
    S_FN(cudaMallocHost);
    S_FN(cudaFreeHost);
    S_FN(cudaEventCreateWithFlags);
    S_FN(cudaEventRecord);
    S_FN(cudaLibraryLoadData);
    S_FN(cudaLibraryGetKernel);
    S_FN(cudaLaunchKernel);
#endif
} s_api_t;
#undef S_FN
#endif

struct kvt_gpu {
    kvt_l1_t *l1;
    pthread_mutex_t init_lock; /* loading CUDA, pinning the arena */
    _Atomic int cuda_rc;       /* 1 untried, 0 loaded, KVT_EUNAVAIL failed */
    char cuda_err[200];
    int ndev;
    _Atomic bool arena_pinned;
    void *lib;
#ifdef KVT_HAVE_CUDA
    s_api_t api;
#endif
    _Atomic bool batch_ok; /* cudaMemcpyBatchAsync usable (cleared after it refuses once) */
    void *kernel;          /* cudaKernel_t of kvt_gpu_blocks, NULL: no staged copies */
    _Atomic bool stage_warned;
    s_copy_mode_t copy_mode;
    size_t stage_bytes, slice_bytes;
    s_sync_mode_t sync_mode;
    _Atomic uint64_t fastest; /* poll: the fastest copy seen, bytes per ms */
    pthread_mutex_t lock; /* leaf: regs, streams */
    s_reg_t *regs;
    s_stream_t *streams[KVT_GPU_MAX_DEVICES];
    kvt_queue_t *dead;     /* unlinked, unreferenced: for the closer */
    kvt_thread_t *closer;  /* started (under init_lock) with the first registration */
    _Atomic uint64_t bytes_to_l1, bytes_to_gpu, copy_errors; /* metrics */
};

kvt_gpu_t *kvt_gpu_new(kvt_l1_t *l1)
{
    kvt_gpu_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->l1 = l1;
    self->cuda_rc = 1;
    pthread_mutex_init(&self->init_lock, NULL);
    pthread_mutex_init(&self->lock, NULL);
    self->dead = kvt_queue_new(KVT_QUEUE_BOUNDED_BY_CALLER, 0, NULL, 0); /* cannot fail */
    return self;
}

#ifdef KVT_HAVE_CUDA

#ifndef KVT_CUDA_LIBDIR
#define KVT_CUDA_LIBDIR "/usr/local/cuda/lib64"
#endif

/* Points self->api.fn at the runtime's fn; ok stays true while every one is found. */
#define S_DLSYM(ok, fn)                                                                        \
    do {                                                                                       \
        *(void **)&self->api.fn = dlsym(self->lib, #fn);                                       \
        ok = ok && self->api.fn != NULL;                                                       \
    } while (0)

/* A positive byte count from the environment, else dflt. */
static size_t s_env_bytes(const char *name, size_t dflt)
{
    const char *v = getenv(name);
    char *end = NULL;
    unsigned long long n = v && *v ? strtoull(v, &end, 10) : 0;
    return n && end && !*end ? (size_t)n : dflt;
}

/* The index in choices[3] of environment variable `name`; unset or empty: 0; anything else is
 * logged and 0. */
static int s_env_choice(const char *name, const char *const choices[3])
{
    const char *v = getenv(name);
    for (int i = 0; v && *v && i < 3; i++)
        if (!strcmp(v, choices[i]))
            return i;
    if (v && *v)
        kvt_log(KVT_LOG_WARN, "gpu: %s=%s is not %s, %s or %s: %s", name, v, choices[0],
                choices[1], choices[2], choices[0]);
    return 0;
}

/* The staged copies' kernel and the copy settings (KVT_GPU_COPY, KVT_GPU_SYNC,
 * KVT_GPU_STAGING_BYTES, KVT_GPU_SLICE_BYTES); init_lock held. Without the kernel every copy is
 * direct, whatever KVT_GPU_COPY says. */
static void s_copy_setup(kvt_gpu_t *self)
{
    /* in the enums' order */
    static const char *const copy[3] = {"auto", "direct", "staged"};
    static const char *const sync[3] = {"poll", "spin", "blocking"};
    self->copy_mode = (s_copy_mode_t)s_env_choice("KVT_GPU_COPY", copy);
    self->sync_mode = (s_sync_mode_t)s_env_choice("KVT_GPU_SYNC", sync);
    for (int d = 0; self->sync_mode == S_SYNC_BLOCKING && d < self->ndev; d++) {
        /* before the device's context exists (this is the first CUDA work of the process) */
        if (self->api.cudaSetDevice(d) != cudaSuccess ||
            self->api.cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync) != cudaSuccess) {
            self->api.cudaGetLastError();
            kvt_log(KVT_LOG_WARN, "gpu: cannot set blocking sync on device %d", d);
        }
    }
    self->stage_bytes = s_env_bytes("KVT_GPU_STAGING_BYTES", S_STAGE_BYTES);
    self->slice_bytes = s_env_bytes("KVT_GPU_SLICE_BYTES", S_SLICE);
#ifdef S_KERNELS
    s_api_t *a = &self->api;
    bool ok = true;
    S_DLSYM(ok, cudaMalloc);
    S_DLSYM(ok, cudaFree);
    S_DLSYM(ok, cudaMallocHost);
    S_DLSYM(ok, cudaFreeHost);
    S_DLSYM(ok, cudaEventCreateWithFlags);
    S_DLSYM(ok, cudaEventRecord);
    S_DLSYM(ok, cudaLibraryLoadData);
    S_DLSYM(ok, cudaLibraryGetKernel);
    S_DLSYM(ok, cudaLaunchKernel);
    if (self->copy_mode == S_COPY_DIRECT)
        return;
    if (!ok) {
        kvt_log(KVT_LOG_INFO, "gpu: the CUDA runtime has no cudaLibraryLoadData: direct copies");
        return;
    }
    cudaLibrary_t lib = NULL;
    cudaKernel_t k = NULL;
    cudaError_t e = a->cudaLibraryLoadData(&lib, s_fatbin, NULL, NULL, 0, NULL, NULL, 0);
    if (e == cudaSuccess)
        e = a->cudaLibraryGetKernel(&k, lib, KVT_GPU_KERNEL_NAME);
    if (e != cudaSuccess) { /* e.g. a GPU older than the fatbin's oldest (sm_75) */
        a->cudaGetLastError();
        kvt_log(KVT_LOG_WARN, "gpu: cannot load the copy kernel (%s): direct copies",
                a->cudaGetErrorString(e));
        return;
    }
    self->kernel = (void *)k; /* the library stays loaded, as the runtime does */
#endif
}

/* Loads libcudart and asks for devices; init_lock held. */
static void s_load(kvt_gpu_t *self)
{
    char name[64], path[sizeof KVT_CUDA_LIBDIR + 64];
    snprintf(name, sizeof name, "libcudart.so.%d", CUDART_VERSION / 1000);
    snprintf(path, sizeof path, "%s/%s", KVT_CUDA_LIBDIR, name);
    self->lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!self->lib)
        self->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!self->lib) {
        const char *why = dlerror();
        snprintf(self->cuda_err, sizeof self->cuda_err,
                 "no CUDA device: cannot load the CUDA runtime %s (%s)", name, why ? why : "?");
        self->cuda_rc = KVT_EUNAVAIL;
        return;
    }
    s_api_t *a = &self->api;
    bool ok = true;
    S_DLSYM(ok, cudaGetDeviceCount);
    S_DLSYM(ok, cudaGetErrorString);
    S_DLSYM(ok, cudaGetLastError);
    S_DLSYM(ok, cudaSetDevice);
    S_DLSYM(ok, cudaHostRegister);
    S_DLSYM(ok, cudaHostUnregister);
    S_DLSYM(ok, cudaPointerGetAttributes);
    S_DLSYM(ok, cudaIpcOpenMemHandle);
    S_DLSYM(ok, cudaIpcCloseMemHandle);
    S_DLSYM(ok, cudaIpcOpenEventHandle);
    S_DLSYM(ok, cudaEventDestroy);
    S_DLSYM(ok, cudaStreamCreateWithFlags);
    S_DLSYM(ok, cudaStreamDestroy);
    S_DLSYM(ok, cudaStreamWaitEvent);
    S_DLSYM(ok, cudaStreamSynchronize);
    S_DLSYM(ok, cudaStreamQuery);
    S_DLSYM(ok, cudaSetDeviceFlags);
    S_DLSYM(ok, cudaMemcpyAsync);
    *(void **)&a->cudaMemcpyBatchAsync = dlsym(self->lib, "cudaMemcpyBatchAsync");
    self->batch_ok = a->cudaMemcpyBatchAsync != NULL && getenv("KVT_GPU_NO_BATCH") == NULL;
    if (!ok) {
        snprintf(self->cuda_err, sizeof self->cuda_err,
                 "no CUDA device: %s lacks a function kvtierd needs", name);
        self->cuda_rc = KVT_EUNAVAIL;
        return;
    }
    int n = 0;
    cudaError_t e = a->cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n <= 0) {
        snprintf(self->cuda_err, sizeof self->cuda_err, "no CUDA device: %s",
                 e != cudaSuccess ? a->cudaGetErrorString(e) : "cudaGetDeviceCount found none");
        self->cuda_rc = KVT_EUNAVAIL;
        return;
    }
    self->ndev = n;
    s_copy_setup(self);
    self->cuda_rc = 0;
    kvt_log(KVT_LOG_INFO, "gpu: loaded %s, %d CUDA device(s)%s, %s copies%s", name, n,
            self->batch_ok ? ", batched" : "", self->kernel ? "staged and direct" : "direct",
            self->copy_mode == S_COPY_AUTO     ? ""
            : self->copy_mode == S_COPY_DIRECT ? " (KVT_GPU_COPY=direct)"
                                               : " (KVT_GPU_COPY=staged)");
}

static const char *s_cerr(kvt_gpu_t *self, cudaError_t e)
{
    return self->api.cudaGetErrorString(e);
}

/* cudaHostRegister of the whole arena, once; init_lock held, device set. Verified: the
 * runtime must then see the arena as host memory it can DMA (never pageable copies). */
static int s_pin_arena(kvt_gpu_t *self, char *err, size_t errlen)
{
    if (self->arena_pinned)
        return 0;
    void *base = kvt_l1_base(self->l1);
    size_t size = kvt_l1_capacity(self->l1);
    cudaError_t e = self->api.cudaHostRegister(base, size, cudaHostRegisterPortable);
    if (e != cudaSuccess) {
        self->api.cudaGetLastError();
        snprintf(err, errlen, "cudaHostRegister of the L1 arena (%zu bytes) failed: %s "
                              "(no fallback to pageable copies; check RLIMIT_MEMLOCK)",
                 size, s_cerr(self, e));
        return KVT_EUNAVAIL;
    }
    struct cudaPointerAttributes at;
    memset(&at, 0, sizeof at);
    e = self->api.cudaPointerGetAttributes(&at, (char *)base + size - 1);
    if (e != cudaSuccess || at.type != cudaMemoryTypeHost) {
        self->api.cudaGetLastError();
        self->api.cudaHostUnregister(base);
        snprintf(err, errlen, "the L1 arena is not page-locked after cudaHostRegister (%s)",
                 e != cudaSuccess ? s_cerr(self, e) : "pointer type is not host");
        return KVT_EUNAVAIL;
    }
    self->arena_pinned = true;
    kvt_log(KVT_LOG_INFO, "gpu: L1 arena (%zu bytes) page-locked with cudaHostRegister", size);
    return 0;
}

static void s_close_reg_cuda(kvt_gpu_t *self, s_reg_t *reg)
{
    if (reg->nbases && self->api.cudaSetDevice((int)reg->lay.device) != cudaSuccess)
        self->api.cudaGetLastError();
    for (uint32_t i = 0; i < reg->nbases; i++) {
        cudaError_t e = self->api.cudaIpcCloseMemHandle(reg->bases[i]);
        if (e != cudaSuccess)
            kvt_log(KVT_LOG_WARN, "gpu: cudaIpcCloseMemHandle: %s", s_cerr(self, e));
    }
    reg->nbases = 0;
}

/* Opens the distinct handles (tensors sharing one allocation share its handle) and points
 * each layer at its buffer. Device set. */
static int s_open_reg(kvt_gpu_t *self, s_reg_t *reg, const kvt_gpu_reg_args_t *r, char *err,
                      size_t errlen)
{
    uint32_t L = reg->lay.layers;
    uint32_t *first = malloc(L * sizeof *first); /* layer -> index of its base */
    kvt_assert(first);
    int rc = 0;
    for (uint32_t i = 0; i < L && rc == 0; i++) {
        uint32_t j = 0;
        for (; j < i; j++)
            if (memcmp(s_handle(r, j), s_handle(r, i), KVT_IPC_HANDLE_LEN) == 0)
                break;
        if (j < i) {
            first[i] = first[j];
        } else {
            cudaIpcMemHandle_t h;
            memcpy(&h, s_handle(r, i), sizeof h);
            void *p = NULL;
            cudaError_t e = self->api.cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
            if (e != cudaSuccess) {
                self->api.cudaGetLastError();
                snprintf(err, errlen, "cudaIpcOpenMemHandle of layer %u failed: %s", i,
                         s_cerr(self, e));
                rc = KVT_EBADREQ;
                break;
            }
            first[i] = reg->nbases;
            reg->bases[reg->nbases++] = p;
        }
        reg->ptrs[i] = (uint8_t *)reg->bases[first[i]] + (r->offsets ? r->offsets[i] : 0);
    }
    free(first);
    if (rc)
        s_close_reg_cuda(self, reg);
    return rc;
}

static s_stream_t *s_stream_get(kvt_gpu_t *self, uint32_t dev, char *err, size_t errlen)
{
    pthread_mutex_lock(&self->lock);
    s_stream_t *s = self->streams[dev];
    if (s)
        self->streams[dev] = s->next;
    pthread_mutex_unlock(&self->lock);
    if (s) {
        s->next = NULL;
        return s;
    }
    cudaStream_t st = NULL;
    cudaError_t e = self->api.cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        self->api.cudaGetLastError();
        snprintf(err, errlen, "cudaStreamCreateWithFlags: %s", s_cerr(self, e));
        return NULL;
    }
    s = calloc(1, sizeof *s);
    kvt_assert(s);
    s->stream = st;
    return s;
}

static void s_stream_put(kvt_gpu_t *self, uint32_t dev, s_stream_t *s)
{
    pthread_mutex_lock(&self->lock);
    s->next = self->streams[dev];
    self->streams[dev] = s;
    pthread_mutex_unlock(&self->lock);
}

/* Frees a stream and its staged resources; its device is set, nothing is queued on it. */
static void s_stream_free(kvt_gpu_t *self, s_stream_t *s)
{
#ifdef S_KERNELS
    const s_api_t *a = &self->api;
    if (s->staged) {
        a->cudaStreamDestroy(s->kstream);
        for (int i = 0; i < S_SLOTS; i++) {
            a->cudaEventDestroy(s->full[i]);
            a->cudaEventDestroy(s->free[i]);
        }
        a->cudaEventDestroy(s->done);
        a->cudaFree(s->stage);
    }
    if (s->meta)
        a->cudaFree(s->meta);
    if (s->hmeta)
        a->cudaFreeHost(s->hmeta);
#endif
    self->api.cudaStreamDestroy(s->stream);
    free(s);
}

/* The copies of one request, collected then issued S_OPS at a time on one stream. */
typedef struct {
    kvt_gpu_t *gpu;
    cudaStream_t stream;
    void *dst[S_OPS];
    const void *src[S_OPS];
    size_t size[S_OPS];
    uint32_t n;
    cudaError_t e;
} s_copies_t;

static void s_flush(s_copies_t *c)
{
    if (c->n == 0 || c->e != cudaSuccess)
        return;
    const s_api_t *a = &c->gpu->api;
    if (c->gpu->batch_ok && c->n > 1) {
        struct cudaMemcpyAttributes attr;
        memset(&attr, 0, sizeof attr);
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        size_t idx = 0;
        cudaError_t e = a->cudaMemcpyBatchAsync((void *const *)c->dst, (const void *const *)c->src,
                                                c->size, c->n, &attr, &idx, 1, c->stream);
        if (e == cudaSuccess) {
            c->n = 0;
            return;
        }
        /* refused before anything was queued (e.g. not supported here): plain copies from
         * now on */
        a->cudaGetLastError();
        c->gpu->batch_ok = false;
        kvt_log(KVT_LOG_WARN, "gpu: cudaMemcpyBatchAsync refused (%s): using cudaMemcpyAsync",
                a->cudaGetErrorString(e));
    }
    for (uint32_t i = 0; i < c->n && c->e == cudaSuccess; i++)
        c->e = a->cudaMemcpyAsync(c->dst[i], c->src[i], c->size[i], cudaMemcpyDefault,
                                  c->stream);
    c->n = 0;
}

static void s_add(s_copies_t *c, void *dst, const void *src, size_t size)
{
    if (c->n == S_OPS)
        s_flush(c);
    c->dst[c->n] = dst;
    c->src[c->n] = src;
    c->size[c->n] = size;
    c->n++;
}

#define S_POLL_SLEEP_MIN_NS 750000 /* shorter waits poll all along (a sleep wakes up late) */

/* Waits for stream st, whose copies of `bytes` were queued from t0 on (KVT_GPU_SYNC). */
static cudaError_t s_wait(kvt_gpu_t *self, cudaStream_t st, uint64_t bytes, uint64_t t0)
{
    const s_api_t *a = &self->api;
    if (self->sync_mode != S_SYNC_POLL || bytes == 0)
        return a->cudaStreamSynchronize(st);
    uint64_t fastest = atomic_load_explicit(&self->fastest, memory_order_relaxed);
    if (fastest) { /* sleep through 3/4 of the shortest time the copies can take, if long */
        uint64_t ns = bytes * 1000000 / fastest * 3 / 4, spent = kvt_now_ns() - t0;
        if (ns > spent + S_POLL_SLEEP_MIN_NS) {
            struct timespec ts = {.tv_sec = (time_t)((ns - spent) / 1000000000),
                                  .tv_nsec = (long)((ns - spent) % 1000000000)};
            nanosleep(&ts, NULL);
        }
    }
    cudaError_t e;
    while ((e = a->cudaStreamQuery(st)) == cudaErrorNotReady)
        sched_yield();
    uint64_t took = kvt_now_ns() - t0; /* this request's rate, bytes per ms */
    uint64_t rate = took ? bytes * 1000000 / took : 0;
    if (e == cudaSuccess && rate > fastest)
        atomic_store_explicit(&self->fastest, rate, memory_order_relaxed);
    return e;
}

/* The direct copies of a request (see the top); rstart and rlen hold per entries. */
static void s_copy_direct(s_copies_t *c, const s_reg_t *reg, bool to_gpu, const uint64_t *ids,
                          uint32_t per, const uint64_t *off, uint32_t n, uint32_t *rstart,
                          uint32_t *rlen)
{
    const kvt_gpu_layout_t *lay = &reg->lay;
    uint8_t *arena = kvt_l1_base(c->gpu->l1);
    uint64_t bb = lay->block_bytes;
    for (uint32_t k = 0; k < n && c->e == cudaSuccess; k++) {
        const uint64_t *cid = ids + (size_t)k * per;
        uint32_t runs = kvt_gpu_runs(cid, per, rstart, rlen);
        for (uint32_t l = 0; l < lay->layers; l++) {
            uint8_t *host = arena + off[k] + (uint64_t)l * per * bb;
            for (uint32_t q = 0; q < runs; q++) {
                uint8_t *dev = reg->ptrs[l] + cid[rstart[q]] * bb;
                uint8_t *h = host + (uint64_t)rstart[q] * bb;
                size_t sz = (size_t)rlen[q] * bb;
                if (to_gpu)
                    s_add(c, dev, h, sz);
                else
                    s_add(c, h, dev, sz);
            }
        }
    }
    s_flush(c);
}

#ifdef S_KERNELS
#define S_META_MAX (64ull << 20) /* layer pointers + block ids of one staged request */

/* Whether a request goes staged: the kernel loaded, one layer of a chunk fits the staging
 * buffer, the block ids fit S_META_MAX, and (auto) the direct copies would be short. */
static bool s_use_staged(const kvt_gpu_t *self, const kvt_gpu_layout_t *lay,
                         const uint64_t *ids, uint32_t per, uint32_t n, uint32_t *rstart,
                         uint32_t *rlen)
{
    if (!self->kernel || self->copy_mode == S_COPY_DIRECT || n == 0 ||
        (uint64_t)per * lay->block_bytes > self->stage_bytes ||
        ((uint64_t)lay->layers + (uint64_t)n * per) * 8 > S_META_MAX)
        return false;
    if (self->copy_mode == S_COPY_STAGED)
        return true;
    uint64_t runs = 0;
    for (uint32_t k = 0; k < n; k++)
        runs += kvt_gpu_runs(ids + (size_t)k * per, per, rstart, rlen);
    return (uint64_t)n * per * lay->block_bytes < runs * S_AUTO_RUN;
}

/* The stream's staged resources, once: the kernel stream, the staging buffer, the events. */
static cudaError_t s_staged_init(kvt_gpu_t *self, s_stream_t *s)
{
    if (s->staged)
        return cudaSuccess;
    const s_api_t *a = &self->api;
    cudaStream_t k = NULL;
    void *stage = NULL;
    cudaEvent_t ev[2 * S_SLOTS + 1] = {0};
    int nev = 0;
    cudaError_t e = a->cudaStreamCreateWithFlags(&k, cudaStreamNonBlocking);
    if (e == cudaSuccess)
        e = a->cudaMalloc(&stage, self->stage_bytes);
    for (; e == cudaSuccess && nev < 2 * S_SLOTS + 1; nev++)
        e = a->cudaEventCreateWithFlags(&ev[nev], cudaEventDisableTiming);
    if (e != cudaSuccess) {
        a->cudaGetLastError();
        for (int i = 0; i < nev; i++)
            if (ev[i])
                a->cudaEventDestroy(ev[i]);
        if (stage)
            a->cudaFree(stage);
        if (k)
            a->cudaStreamDestroy(k);
        return e;
    }
    s->kstream = k;
    s->stage = stage;
    for (int i = 0; i < S_SLOTS; i++) {
        s->full[i] = ev[i];
        s->free[i] = ev[S_SLOTS + i];
    }
    s->done = ev[2 * S_SLOTS];
    s->staged = true;
    return cudaSuccess;
}

/* The request's layer pointers and block ids: device and pinned host buffers that hold `need`
 * bytes (grown, never shrunk; the streams are idle). */
static cudaError_t s_meta_init(kvt_gpu_t *self, s_stream_t *s, size_t need)
{
    const s_api_t *a = &self->api;
    cudaError_t e = cudaSuccess;
    if (s->meta_cap < need) {
        if (s->meta)
            a->cudaFree(s->meta);
        s->meta_cap = 0;
        e = a->cudaMalloc(&s->meta, need);
        s->meta_cap = e == cudaSuccess ? need : 0;
        if (e != cudaSuccess)
            s->meta = NULL;
    }
    if (e == cudaSuccess && s->hmeta_cap < need) {
        if (s->hmeta)
            a->cudaFreeHost(s->hmeta);
        s->hmeta_cap = 0;
        e = a->cudaMallocHost(&s->hmeta, need);
        s->hmeta_cap = e == cudaSuccess ? need : 0;
        if (e != cudaSuccess)
            s->hmeta = NULL;
    }
    if (e != cudaSuccess)
        a->cudaGetLastError();
    return e;
}


/* The staged copies of a request (see the top): its chunks go in slices of whole layers
 * (about slice_bytes) through a ring of S_SLOTS slots of the staging buffer. STORE: the
 * kernel stream gathers slice i into its slot, the copy stream moves it to L1 once it is full;
 * RETRIEVE: the copy stream fills the slot, the kernel stream scatters it. A slot is reused only
 * after its last use is done (the `free` event), so the two streams overlap. Everything is
 * queued behind the client's event `ev` (NULL: none) on the kernel stream; the copy stream
 * finishes after the kernel stream (`done`), so synchronising it waits for both. Sets *direct
 * (queueing nothing) when the device has no memory for the buffers. */
static cudaError_t s_copy_staged(kvt_gpu_t *self, s_stream_t *s, const s_reg_t *reg,
                                 bool to_gpu, const uint64_t *ids, uint32_t per,
                                 const uint64_t *off, uint32_t n, cudaEvent_t ev, bool *direct)
{
    const s_api_t *a = &self->api;
    const kvt_gpu_layout_t *lay = &reg->lay;
    uint32_t L = lay->layers;
    uint64_t bb = lay->block_bytes, slice = per * bb; /* one layer of a chunk */
    uint64_t nl = self->slice_bytes / slice ? self->slice_bytes / slice : 1;
    if (nl > L)
        nl = L;
    if (nl * per > INT32_MAX) /* the grid's x */
        nl = INT32_MAX / per;
    if (nl * slice > self->stage_bytes) /* a small staging buffer: one slot */
        nl = self->stage_bytes / slice; /* >= 1: s_use_staged */
    uint64_t slots = self->stage_bytes / (nl * slice);
    if (slots > S_SLOTS)
        slots = S_SLOTS;
    size_t meta_bytes = ((size_t)L + (size_t)n * per) * sizeof(uint64_t);
    cudaError_t e = s_staged_init(self, s);
    if (e == cudaSuccess)
        e = s_meta_init(self, s, meta_bytes);
    if (e != cudaSuccess) { /* the engines hold the device's memory: direct copies need none */
        if (!atomic_exchange(&self->stage_warned, true))
            kvt_log(KVT_LOG_WARN, "gpu: no memory for the %zu-byte staging buffer on device %u "
                                  "(%s): direct copies where it is missing",
                    self->stage_bytes, lay->device, a->cudaGetErrorString(e));
        *direct = true;
        return cudaSuccess;
    }
    uint64_t *meta = s->hmeta;
    for (uint32_t l = 0; l < L; l++)
        meta[l] = (uint64_t)(uintptr_t)reg->ptrs[l];
    memcpy(meta + L, ids, (size_t)n * per * sizeof *ids);
    cudaStream_t ks = s->kstream, cs = s->stream;
    if (ev)
        e = a->cudaStreamWaitEvent(ks, ev, 0);
    if (e == cudaSuccess)
        e = a->cudaMemcpyAsync(s->meta, meta, meta_bytes, cudaMemcpyDefault, ks);
    uint8_t *arena = kvt_l1_base(self->l1);
    uint64_t dmeta = (uint64_t)(uintptr_t)s->meta, i = 0;
    for (uint32_t k = 0; k < n && e == cudaSuccess; k++) {
        for (uint32_t l0 = 0; l0 < L && e == cudaSuccess; l0 += (uint32_t)nl, i++) {
            uint32_t cnt = L - l0 < nl ? L - l0 : (uint32_t)nl, q = (uint32_t)(i % slots);
            size_t bytes = (size_t)cnt * slice;
            uint8_t *slot = (uint8_t *)s->stage + q * nl * slice;
            uint8_t *host = arena + off[k] + (uint64_t)l0 * slice;
            kvt_gpu_blocks_args_t args = {.stage = (uint64_t)(uintptr_t)slot,
                                          .ptrs = dmeta,
                                          .ids = dmeta + ((uint64_t)L + (uint64_t)k * per) * 8,
                                          .block_bytes = bb,
                                          .per = per,
                                          .l0 = l0,
                                          .to_stage = !to_gpu};
            void *argv[] = {&args};
            dim3 grid = {cnt * per, 1, 1}, block = {KVT_GPU_KERNEL_THREADS, 1, 1};
            /* the slot's previous use (slices i - slots) is done */
            cudaStream_t first = to_gpu ? cs : ks, second = to_gpu ? ks : cs;
            if (i >= slots)
                e = a->cudaStreamWaitEvent(first, s->free[q], 0);
            if (e == cudaSuccess)
                e = to_gpu ? a->cudaMemcpyAsync(slot, host, bytes, cudaMemcpyDefault, cs)
                           : a->cudaLaunchKernel(self->kernel, grid, block, argv, 0, ks);
            if (e == cudaSuccess)
                e = a->cudaEventRecord(s->full[q], first);
            if (e == cudaSuccess)
                e = a->cudaStreamWaitEvent(second, s->full[q], 0);
            if (e == cudaSuccess)
                e = to_gpu ? a->cudaLaunchKernel(self->kernel, grid, block, argv, 0, ks)
                           : a->cudaMemcpyAsync(host, slot, bytes, cudaMemcpyDefault, cs);
            if (e == cudaSuccess)
                e = a->cudaEventRecord(s->free[q], second);
        }
    }
    /* the copy stream ends after the kernel stream, also after an error */
    cudaError_t e2 = a->cudaEventRecord(s->done, ks);
    if (e2 == cudaSuccess)
        e2 = a->cudaStreamWaitEvent(cs, s->done, 0);
    if (e2 != cudaSuccess) /* cannot chain them: wait here */
        e2 = a->cudaStreamSynchronize(ks);
    return e != cudaSuccess ? e : e2;
}
#endif

/* Copies between the chunks' blocks and their L1 objects at arena offsets off[0..n). An L1
 * object is layer-major: layer 0's blocks in chunk order, then layer 1's, ... */
static int s_copy(kvt_gpu_t *self, const s_reg_t *reg, bool to_gpu, const uint64_t *ids,
                  uint32_t per, const uint64_t *off, uint32_t n, const uint8_t *event, char *err,
                  size_t errlen)
{
    const kvt_gpu_layout_t *lay = &reg->lay;
    const s_api_t *a = &self->api;
    cudaError_t e = a->cudaSetDevice((int)lay->device);
    if (e != cudaSuccess) {
        a->cudaGetLastError();
        snprintf(err, errlen, "cudaSetDevice(%u): %s", lay->device, s_cerr(self, e));
        return KVT_EINTERNAL;
    }
    s_stream_t *s = s_stream_get(self, lay->device, err, errlen);
    if (!s)
        return KVT_EINTERNAL;
    s_copies_t *c = malloc(sizeof *c);
    uint32_t *rstart = malloc(per * sizeof *rstart), *rlen = malloc(per * sizeof *rlen);
    if (!c || !rstart || !rlen) {
        free(c);
        free(rstart);
        free(rlen);
        s_stream_put(self, lay->device, s);
        snprintf(err, errlen, "out of memory for the copy list");
        return KVT_ENOMEM;
    }
    c->gpu = self;
    c->stream = s->stream;
    c->n = 0;
    c->e = cudaSuccess;
    cudaEvent_t ev = NULL;
    if (event) {
        cudaIpcEventHandle_t h;
        memcpy(&h, event, sizeof h);
        c->e = a->cudaIpcOpenEventHandle(&ev, h);
    }
    bool direct = true;
    uint64_t t0 = kvt_now_ns();
#ifdef S_KERNELS
    if (c->e == cudaSuccess && s_use_staged(self, lay, ids, per, n, rstart, rlen)) {
        direct = false;
        c->e = s_copy_staged(self, s, reg, to_gpu, ids, per, off, n, ev, &direct);
    }
#endif
    if (c->e == cudaSuccess && direct) {
        if (ev)
            c->e = a->cudaStreamWaitEvent(s->stream, ev, 0);
        s_copy_direct(c, reg, to_gpu, ids, per, off, n, rstart, rlen);
    }
    /* even after an error, wait for what was queued: the arena slots are about to be reused */
    cudaError_t se = s_wait(self, s->stream, c->e == cudaSuccess ? (uint64_t)n * per * lay->layers
                                                                   * lay->block_bytes : 0, t0);
    e = c->e != cudaSuccess ? c->e : se;
    if (ev)
        a->cudaEventDestroy(ev);
    int rc = 0;
    if (e != cudaSuccess) {
        a->cudaGetLastError();
        snprintf(err, errlen, "%s copy failed: %s", to_gpu ? "L1 -> GPU" : "GPU -> L1",
                 s_cerr(self, e));
        rc = KVT_EINTERNAL;
    }
    if (se == cudaSuccess)
        s_stream_put(self, lay->device, s);
    else
        s_stream_free(self, s);
    free(c);
    free(rstart);
    free(rlen);
    return rc;
}

#else /* !KVT_HAVE_CUDA: the requests validate, then answer `unavailable` here */

static void s_load(kvt_gpu_t *self)
{
    snprintf(self->cuda_err, sizeof self->cuda_err,
             "no CUDA device: this kvtierd was built without the CUDA toolkit (make found no "
             "nvcc, or CUDA=0)");
    self->cuda_rc = KVT_EUNAVAIL;
}

static int s_pin_arena(kvt_gpu_t *self, char *err, size_t errlen)
{
    snprintf(err, errlen, "%s", self->cuda_err);
    return KVT_EUNAVAIL;
}

static void s_close_reg_cuda(kvt_gpu_t *self, s_reg_t *reg)
{
    (void)self;
    reg->nbases = 0;
}

static int s_open_reg(kvt_gpu_t *self, s_reg_t *reg, const kvt_gpu_reg_args_t *r, char *err,
                      size_t errlen)
{
    (void)reg, (void)r;
    snprintf(err, errlen, "%s", self->cuda_err);
    return KVT_EUNAVAIL;
}

static int s_copy(kvt_gpu_t *self, const s_reg_t *reg, bool to_gpu, const uint64_t *ids,
                  uint32_t per, const uint64_t *off, uint32_t n, const uint8_t *event, char *err,
                  size_t errlen)
{
    (void)reg, (void)to_gpu, (void)ids, (void)per, (void)off, (void)n, (void)event;
    snprintf(err, errlen, "%s", self->cuda_err);
    return KVT_EUNAVAIL;
}

#endif

/* CUDA loaded and a device present, or KVT_EUNAVAIL with the reason. Workers only. */
static int s_cuda(kvt_gpu_t *self, char *err, size_t errlen)
{
    pthread_mutex_lock(&self->init_lock);
    if (self->cuda_rc == 1)
        s_load(self);
    int rc = self->cuda_rc;
    if (rc)
        snprintf(err, errlen, "%s", self->cuda_err);
    pthread_mutex_unlock(&self->init_lock);
    return rc;
}

static void s_reg_free(kvt_gpu_t *self, s_reg_t *reg)
{
    s_close_reg_cuda(self, reg);
    free(reg->bases);
    free(reg->ptrs);
    free(reg);
}

static bool s_closer(kvt_thread_t *t, void *arg)
{
    (void)t;
    kvt_gpu_t *self = arg;
    s_reg_t *reg;
    while (kvt_queue_pop(self->dead, (void **)&reg, -1) == 0) {
        kvt_log(KVT_LOG_INFO, "gpu: closing the handles of instance %llu on device %u",
                (unsigned long long)reg->owner, reg->lay.device);
        s_reg_free(self, reg);
        kvt_queue_task_done(self->dead, 1);
    }
    return true; /* closed, and everything queued before is closed too */
}

/* Unlinks reg; lock held. */
static void s_unlink(kvt_gpu_t *self, s_reg_t *reg)
{
    for (s_reg_t **pp = &self->regs; *pp; pp = &(*pp)->next)
        if (*pp == reg) {
            *pp = reg->next;
            break;
        }
    reg->next = NULL;
    reg->linked = false;
}

/* Drops a reference on a worker: the last one closes here. */
static void s_reg_put(kvt_gpu_t *self, s_reg_t *reg)
{
    pthread_mutex_lock(&self->lock);
    bool last = --reg->refs == 0;
    pthread_mutex_unlock(&self->lock);
    if (last)
        s_reg_free(self, reg);
}

/* The ready registration of (owner, device) with a reference taken, or NULL. */
static s_reg_t *s_reg_get(kvt_gpu_t *self, uint64_t owner, uint64_t device)
{
    pthread_mutex_lock(&self->lock);
    s_reg_t *reg = self->regs;
    while (reg && !(reg->owner == owner && reg->lay.device == device))
        reg = reg->next;
    if (reg && reg->ready)
        reg->refs++;
    else
        reg = NULL;
    pthread_mutex_unlock(&self->lock);
    return reg;
}

void kvt_gpu_destroy(kvt_gpu_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_gpu_t *self = *self_p;
    kvt_queue_close(self->dead);
    kvt_thread_join(&self->closer); /* it closes what is queued before it returns */
    for (void *reg; kvt_queue_pop(self->dead, &reg, 0) == 0;) /* no closer was started */
        s_reg_free(self, reg);
    /* the workers have stopped: no references are held but the lists' */
    while (self->regs) {
        s_reg_t *reg = self->regs;
        self->regs = reg->next;
        s_reg_free(self, reg);
    }
    for (uint32_t d = 0; d < KVT_GPU_MAX_DEVICES; d++)
        while (self->streams[d]) {
            s_stream_t *s = self->streams[d];
            self->streams[d] = s->next;
#ifdef KVT_HAVE_CUDA
            if (self->api.cudaSetDevice((int)d) != cudaSuccess)
                self->api.cudaGetLastError();
            s_stream_free(self, s);
#else
            free(s);
#endif
        }
#ifdef KVT_HAVE_CUDA
    if (self->arena_pinned)
        self->api.cudaHostUnregister(kvt_l1_base(self->l1));
#endif
    /* libcudart stays loaded: unloading the CUDA runtime at exit is not supported */
    kvt_queue_destroy(&self->dead);
    pthread_mutex_destroy(&self->lock);
    pthread_mutex_destroy(&self->init_lock);
    free(self);
    *self_p = NULL;
}

int kvt_gpu_register(kvt_gpu_t *self, uint64_t owner, const kvt_gpu_reg_args_t *r,
                     kvt_gpu_layout_t *lay, char *err, size_t errlen)
{
    int rc = kvt_gpu_layout_check(r, lay, err, errlen);
    if (rc)
        return rc;
    rc = s_cuda(self, err, errlen);
    if (rc)
        return rc;
    if ((int)lay->device >= self->ndev) {
        snprintf(err, errlen, "'device' is %u but this machine has %d CUDA device(s)",
                 lay->device, self->ndev);
        return KVT_EBADREQ;
    }
    s_reg_t *reg = calloc(1, sizeof *reg);
    kvt_assert(reg);
    reg->owner = owner;
    reg->lay = *lay;
    reg->bases = calloc(lay->layers, sizeof *reg->bases);
    reg->ptrs = calloc(lay->layers, sizeof *reg->ptrs);
    kvt_assert(reg->bases && reg->ptrs);
    /* linked before the slow part (not ready yet), so that a concurrent second REGISTER of the
     * same instance and device is refused */
    pthread_mutex_lock(&self->lock);
    bool dup = false;
    for (s_reg_t *o = self->regs; o && !dup; o = o->next)
        dup = o->owner == owner && o->lay.device == lay->device;
    if (!dup) {
        reg->refs = 2; /* the list's and ours */
        reg->linked = true;
        reg->next = self->regs;
        self->regs = reg;
    }
    pthread_mutex_unlock(&self->lock);
    if (dup) {
        snprintf(err, errlen, "this instance already registered GPU memory on device %u "
                              "(once per device: UNREGISTER_GPU first)", lay->device);
        s_reg_free(self, reg);
        return KVT_EBADREQ;
    }
    pthread_mutex_lock(&self->init_lock);
#ifdef KVT_HAVE_CUDA
    cudaError_t e = self->api.cudaSetDevice((int)lay->device);
    if (e != cudaSuccess) {
        self->api.cudaGetLastError();
        snprintf(err, errlen, "cudaSetDevice(%u): %s", lay->device, s_cerr(self, e));
        rc = KVT_EUNAVAIL;
    }
#endif
    if (rc == 0)
        rc = s_pin_arena(self, err, errlen);
    if (rc == 0 && !self->closer) {
        self->closer = kvt_thread_start(NULL, "gpu-closer", 0, s_closer, self);
        if (!self->closer) {
            snprintf(err, errlen, "cannot start the GPU handle closer thread");
            rc = KVT_EINTERNAL;
        }
    }
    pthread_mutex_unlock(&self->init_lock);
    if (rc == 0)
        rc = s_open_reg(self, reg, r, err, errlen);
    pthread_mutex_lock(&self->lock);
    if (rc == 0) {
        reg->ready = true;
    } else if (reg->linked) {
        s_unlink(self, reg);
        reg->refs--;
    }
    pthread_mutex_unlock(&self->lock);
    s_reg_put(self, reg);
    if (rc == 0)
        kvt_log(KVT_LOG_INFO, "gpu: instance %llu registered %u layers x %llu blocks of %llu "
                              "bytes on device %u",
                (unsigned long long)owner, lay->layers, (unsigned long long)lay->num_blocks,
                (unsigned long long)lay->block_bytes, lay->device);
    return rc;
}

int kvt_gpu_unregister(kvt_gpu_t *self, uint64_t owner, uint64_t device, char *err,
                       size_t errlen)
{
    pthread_mutex_lock(&self->lock);
    s_reg_t *reg = self->regs;
    while (reg && !(reg->owner == owner && reg->lay.device == device && reg->ready))
        reg = reg->next;
    if (reg)
        s_unlink(self, reg);
    pthread_mutex_unlock(&self->lock);
    if (!reg) {
        snprintf(err, errlen, "this instance has no GPU registration on device %llu",
                 (unsigned long long)device);
        return KVT_ENOTFOUND;
    }
    s_reg_put(self, reg); /* the list's reference */
    return 0;
}

uint32_t kvt_gpu_owner_gone(kvt_gpu_t *self, uint64_t owner)
{
    uint32_t n = 0;
    s_reg_t *dead = NULL;
    pthread_mutex_lock(&self->lock);
    s_reg_t **pp = &self->regs;
    while (*pp) {
        s_reg_t *reg = *pp;
        if (reg->owner != owner) {
            pp = &reg->next;
            continue;
        }
        *pp = reg->next;
        reg->next = NULL;
        reg->linked = false;
        n++;
        if (--reg->refs == 0) {
            reg->next = dead;
            dead = reg;
        }
    }
    pthread_mutex_unlock(&self->lock);
    while (dead) { /* no CUDA here: the closer closes them */
        s_reg_t *reg = dead;
        dead = reg->next;
        reg->next = NULL;
        kvt_assert(kvt_queue_push(self->dead, reg, 1) == 0); /* closed only by destroy */
    }
    return n;
}

uint32_t kvt_gpu_registrations(kvt_gpu_t *self)
{
    uint32_t n = 0;
    pthread_mutex_lock(&self->lock);
    for (s_reg_t *r = self->regs; r; r = r->next)
        n++;
    pthread_mutex_unlock(&self->lock);
    return n;
}

json_t *kvt_gpu_status_json(kvt_gpu_t *self)
{
    int rc = atomic_load(&self->cuda_rc);
    json_t *regs = json_array();
    pthread_mutex_lock(&self->lock);
    for (s_reg_t *r = self->regs; r; r = r->next)
        json_array_append_new(
            regs, json_pack("{s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:b}", "owner", (json_int_t)r->owner,
                            "device", (json_int_t)r->lay.device, "layers",
                            (json_int_t)r->lay.layers, "num_blocks",
                            (json_int_t)r->lay.num_blocks, "block_tokens",
                            (json_int_t)r->lay.block_tokens, "token_bytes",
                            (json_int_t)r->lay.token_bytes, "block_bytes",
                            (json_int_t)r->lay.block_bytes, "ready", r->ready));
    pthread_mutex_unlock(&self->lock);
    /* cuda_err is written before cuda_rc leaves 1, and never again */
    return json_pack("{s:s,s:s,s:b,s:o}", "runtime",
                     rc == 1 ? "not loaded" : rc == 0 ? "loaded" : "unavailable", "error",
                     rc < 0 ? self->cuda_err : "", "arena_registered",
                     (int)atomic_load(&self->arena_pinned), "registrations", regs);
}

/* Common start of STORE/RETRIEVE: CUDA, the registration, the block ids. *reg is NULL (and
 * holds no reference) unless there is something to copy. */
static int s_copy_begin(kvt_gpu_t *self, uint64_t owner, const kvt_gpu_copy_args_t *r,
                        s_reg_t **reg, uint32_t *per, uint64_t *chunk_bytes, char *err,
                        size_t errlen)
{
    int rc = s_cuda(self, err, errlen);
    if (rc)
        return rc;
    *reg = s_reg_get(self, owner, r->device);
    if (!*reg) {
        snprintf(err, errlen, "this instance has no GPU registration on device %llu: send "
                              "REGISTER_GPU first (registrations end with BYE or silence)",
                 (unsigned long long)r->device);
        return KVT_ENOTFOUND;
    }
    rc = kvt_gpu_chunk_check(&(*reg)->lay, r->block_ids, r->nblock_ids, r->nkeys, per,
                             chunk_bytes, err, errlen);
    if (rc || r->nkeys == 0) { /* nothing to copy */
        s_reg_put(self, *reg);
        *reg = NULL;
    }
    return rc;
}

/* One STORE_GPU on its way into L1 (kvt_l1_write's context). */
typedef struct {
    kvt_gpu_t *gpu;
    const s_reg_t *reg;
    const kvt_gpu_copy_args_t *r;
    uint32_t per;
    uint64_t chunk_bytes;
} s_store_t;

/* STORE_GPU's fill: one gather copy into the new objects; a failed copy discards them all. */
static int s_store_fill(void *ctx, uint8_t *base, const kvt_slot_t *slots, uint32_t n,
                        uint64_t *failed, uint32_t *nfailed, uint64_t *sums, char *err,
                        size_t errlen)
{
    const s_store_t *st = ctx;
    uint32_t per = st->per;
    (void)base, (void)failed, (void)nfailed, (void)sums;
    uint64_t *off = malloc(n * sizeof *off);
    uint64_t *ids = malloc((size_t)n * per * sizeof *ids);
    kvt_assert(off && ids);
    uint32_t m = 0;
    /* only the new objects (a nil slot: that key is stored already) */
    for (uint32_t i = 0; i < n; i++)
        if (slots[i].length) {
            kvt_assert(slots[i].length == st->chunk_bytes);
            off[m] = slots[i].offset;
            memcpy(ids + (size_t)m * per, st->r->block_ids + (size_t)i * per, per * sizeof *ids);
            m++;
        }
    int rc = s_copy(st->gpu, st->reg, false, ids, per, off, m, st->r->event, err, errlen);
    atomic_fetch_add_explicit(rc ? &st->gpu->copy_errors : &st->gpu->bytes_to_l1,
                              rc ? 1 : (uint64_t)m * st->chunk_bytes, memory_order_relaxed);
    free(ids);
    free(off);
    return rc;
}

int kvt_gpu_store(kvt_gpu_t *self, uint64_t owner, const kvt_gpu_copy_args_t *r,
                  uint32_t *stored, char *err, size_t errlen)
{
    *stored = 0;
    s_reg_t *reg = NULL;
    uint32_t per = 0;
    uint64_t chunk_bytes = 0;
    int rc = s_copy_begin(self, owner, r, &reg, &per, &chunk_bytes, err, errlen);
    if (!reg)
        return rc;
    s_store_t st = {self, reg, r, per, chunk_bytes};
    rc = kvt_l1_write(self->l1, &r->ns, r->keys, NULL, r->nkeys, NULL, chunk_bytes, false,
                      s_store_fill, &st, stored, NULL, err, errlen);
    s_reg_put(self, reg);
    return rc;
}

int kvt_gpu_retrieve(kvt_gpu_t *self, uint64_t owner, const kvt_gpu_copy_args_t *r,
                     uint32_t *found, char *err, size_t errlen)
{
    *found = 0;
    s_reg_t *reg = NULL;
    uint32_t per = 0;
    uint64_t chunk_bytes = 0;
    int rc = s_copy_begin(self, owner, r, &reg, &per, &chunk_bytes, err, errlen);
    if (!reg)
        return rc;
    kvt_slot_t *slots = malloc(r->nkeys * sizeof *slots);
    uint64_t *off = malloc(r->nkeys * sizeof *off);
    kvt_assert(slots && off);
    uint32_t n = 0, m = 0;
    uint64_t lease = 0;
    rc = kvt_l1_acquire(self->l1, KVT_OWNER_DAEMON, &r->ns, r->keys, r->nkeys, slots, &n,
                        &lease);
    n = kvt_l1_verify(self->l1, KVT_OWNER_DAEMON, lease, n); /* l1_checksum: no damaged bytes */
    /* an object of another size was not written with this layout: the prefix ends there */
    while (rc == 0 && m < n && slots[m].length == chunk_bytes) {
        off[m] = slots[m].offset;
        m++;
    }
    if (rc == 0 && m) {
        rc = s_copy(self, reg, true, r->block_ids, per, off, m, r->event, err, errlen);
        atomic_fetch_add_explicit(rc ? &self->copy_errors : &self->bytes_to_gpu,
                                  rc ? 1 : (uint64_t)m * chunk_bytes, memory_order_relaxed);
    }
    if (lease)
        kvt_l1_release(self->l1, KVT_OWNER_DAEMON, lease);
    if (rc == 0)
        *found = m;
    free(off);
    free(slots);
    s_reg_put(self, reg);
    return rc;
}

void kvt_gpu_metrics_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    kvt_gpu_t *self = ctx;
    static const char copied_help[] = "Bytes copied between GPU blocks and L1 objects.";
    const struct {
        const char *name, *help, *label_value;
        kvt_metric_kind_t kind;
        double v;
    } rows[] = {
        {"gpu_runtime_loaded", "1 once the CUDA runtime is loaded and has a device.", NULL,
         KVT_METRIC_GAUGE, atomic_load(&self->cuda_rc) == 0 ? 1.0 : 0.0},
        {"gpu_arena_registered", "1 once the L1 arena is page-locked with cudaHostRegister.",
         NULL, KVT_METRIC_GAUGE, atomic_load(&self->arena_pinned) ? 1.0 : 0.0},
        {"gpu_registrations", "GPU KV caches registered (instance x device).", NULL,
         KVT_METRIC_GAUGE, (double)kvt_gpu_registrations(self)},
        {"gpu_copied_bytes_total", copied_help, "to_l1", KVT_METRIC_COUNTER,
         (double)atomic_load_explicit(&self->bytes_to_l1, memory_order_relaxed)},
        {"gpu_copied_bytes_total", copied_help, "to_gpu", KVT_METRIC_COUNTER,
         (double)atomic_load_explicit(&self->bytes_to_gpu, memory_order_relaxed)},
        {"gpu_copy_errors_total", "STORE_GPU / RETRIEVE_GPU requests whose copy failed.", NULL,
         KVT_METRIC_COUNTER,
         (double)atomic_load_explicit(&self->copy_errors, memory_order_relaxed)},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        kvt_sample_t smp = {.name = rows[i].name, .help = rows[i].help, .kind = rows[i].kind,
                            .label = rows[i].label_value ? "direction" : NULL,
                            .label_value = rows[i].label_value, .value = rows[i].v};
        emit(emit_ctx, &smp);
    }
}
