/* kvt_gpu_kernels: the gather/scatter kernel of the staged GPU copies (see kvt_gpu_kernels.h
 * for its contract, kvt_gpu.c for when it runs). Built by nvcc into a fatbin only; the daemon
 * links no CUDA code and loads it with cudaLibraryLoadData from the libcudart it dlopens.
 *
 * Why a kernel: a shuffled block table turns a chunk into one DMA copy per block and layer
 * (32 to 64 KiB each), and the copy engine's per-copy cost then caps PCIe at about 0.7x. The
 * kernel gathers the blocks into a contiguous staging buffer in device memory (or scatters them
 * from it) at HBM speed, so PCIe sees one large copy per slice. It runs for microseconds per
 * slice, so it takes little from the engine's kernels that it time-slices with. */
#include "kvt_gpu_kernels.h"

#define S_UNROLL 4

extern "C" __global__ void __launch_bounds__(KVT_GPU_KERNEL_THREADS)
kvt_gpu_blocks(kvt_gpu_blocks_args_t a)
{
    uint64_t i = blockIdx.x;
    uint32_t layer = a.l0 + (uint32_t)(i / a.per);
    uint64_t id = ((const uint64_t *)a.ids)[i % a.per];
    uint8_t *dev = (uint8_t *)((const uint64_t *)a.ptrs)[layer] + id * a.block_bytes;
    uint8_t *stg = (uint8_t *)a.stage + i * a.block_bytes;
    uint8_t *dst = a.to_stage ? stg : dev;
    const uint8_t *src = a.to_stage ? dev : stg;
    if ((((uintptr_t)dst | (uintptr_t)src | a.block_bytes) & 15) == 0) {
        uint4 *d = (uint4 *)dst;
        const uint4 *s = (const uint4 *)src;
        uint64_t n = a.block_bytes >> 4, k = threadIdx.x;
        /* S_UNROLL loads in flight per thread before the stores */
        for (; k + (S_UNROLL - 1) * blockDim.x < n; k += S_UNROLL * blockDim.x) {
            uint4 v[S_UNROLL];
#pragma unroll
            for (int u = 0; u < S_UNROLL; u++)
                v[u] = s[k + u * blockDim.x];
#pragma unroll
            for (int u = 0; u < S_UNROLL; u++)
                d[k + u * blockDim.x] = v[u];
        }
        for (; k < n; k += blockDim.x)
            d[k] = s[k];
    } else { /* an odd block size or offset: bytes */
        for (uint64_t k = threadIdx.x; k < a.block_bytes; k += blockDim.x)
            dst[k] = src[k];
    }
}
