/* kvt_gpu_kernels: the one kernel of the GPU path's staged copies — its name, launch shape and
 * parameter block, shared by the kernel (kvt_gpu_kernels.cu, built by nvcc into a fatbin that
 * kvt_gpu.c embeds), its launch (kvt_gpu.c, on a worker) and the tests' stand-in CUDA runtime
 * (tests/gpu/mock_cudart.c, which runs it on the CPU). One parameter, passed by value, so the
 * three cannot disagree on the order. */
#ifndef KVT_GPU_KERNELS_H
#define KVT_GPU_KERNELS_H

#include <stdint.h>

#define KVT_GPU_KERNEL_NAME "kvt_gpu_blocks"
#define KVT_GPU_KERNEL_THREADS 256

/* One CUDA block per (layer, block of the chunk) of a slice of layers [l0, l0 + n): grid x is
 * per x n. Block i moves block_bytes between block ids[i % per] of layer l0 + i / per (at
 * ptrs[layer] + id x block_bytes) and stage + i x block_bytes, which is where that block lies
 * in the L1 object (layer-major, blocks in chunk order) counted from layer l0. Addresses are
 * device addresses in the daemon's context. */
typedef struct {
    uint64_t stage;       /* the staging buffer */
    uint64_t ptrs;        /* uint64_t[layers]: each layer's buffer */
    uint64_t ids;         /* uint64_t[per]: the chunk's block ids */
    uint64_t block_bytes;
    uint32_t per;         /* blocks per chunk */
    uint32_t l0;          /* the slice's first layer */
    uint32_t to_stage;    /* 1: cache -> stage (STORE_GPU); 0: stage -> cache (RETRIEVE_GPU) */
    uint32_t reserved;
} kvt_gpu_blocks_args_t;

#endif
