/* mock_cudart: a stand-in libcudart.so.<major> for the integration tests on machines without a
 * GPU. kvtierd dlopens the CUDA runtime by soname, so with LD_LIBRARY_PATH pointing here it
 * runs its whole GPU path — registration, the arena's cudaHostRegister, handle dedupe and
 * offsets, run coalescing, batched and plain copies, event waits, closing on BYE and expiry —
 * against host memory, and a test can check every byte.
 *
 * "Device memory" is a file the test creates; its "IPC handle" is 64 bytes: "KVTMOCK" NUL and
 * the file's path (NUL-padded). cudaIpcOpenMemHandle maps the file MAP_SHARED, so what the
 * daemon writes the test reads back. Copies are synchronous memcpy. Only the functions kvtierd
 * uses exist, with the toolkit's own prototypes (compiled against its headers).
 *
 * Environment: KVT_MOCK_CUDA_DEVICES (default 1; 0: cudaGetDeviceCount fails with
 * cudaErrorNoDevice), KVT_MOCK_CUDA_FAIL_HOST_REGISTER=1 (cudaHostRegister fails),
 * KVT_MOCK_CUDA_NO_BATCH=1 (cudaMemcpyBatchAsync answers cudaErrorNotSupported),
 * KVT_MOCK_CUDA_KERNELS=1 (cudaLibraryLoadData accepts the daemon's fatbin, and cudaLaunchKernel
 * runs its kernel, kvt_gpu_blocks, on the CPU; otherwise it answers cudaErrorNotSupported and the
 * daemon copies direct), KVT_MOCK_CUDA_NO_MALLOC=1 (cudaMalloc fails: no device memory),
 * KVT_MOCK_CUDA_LOG=FILE (one line per open, close, host register, copy, malloc and kernel). */
#include "kvt_gpu_kernels.h"

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define S_MAGIC "KVTMOCK"
#define S_MAX_MAPS 256

static pthread_mutex_t s_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    void *ptr;
    size_t len;
    char path[64];
} s_maps[S_MAX_MAPS];
static __thread int s_device;

static void s_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void s_log(const char *fmt, ...)
{
    const char *path = getenv("KVT_MOCK_CUDA_LOG");
    if (!path)
        return;
    pthread_mutex_lock(&s_lock);
    FILE *f = fopen(path, "a");
    if (f) {
        va_list ap;
        va_start(ap, fmt);
        vfprintf(f, fmt, ap);
        va_end(ap);
        fputc('\n', f);
        fclose(f);
    }
    pthread_mutex_unlock(&s_lock);
}

static int s_env_int(const char *name, int dflt)
{
    const char *v = getenv(name);
    return v && *v ? atoi(v) : dflt;
}

cudaError_t cudaGetDeviceCount(int *count)
{
    *count = s_env_int("KVT_MOCK_CUDA_DEVICES", 1);
    return *count > 0 ? cudaSuccess : cudaErrorNoDevice;
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected (mock)";
    case cudaErrorInvalidValue: return "invalid argument (mock)";
    case cudaErrorInvalidDevice: return "invalid device ordinal (mock)";
    case cudaErrorNotSupported: return "operation not supported (mock)";
    case cudaErrorHostMemoryAlreadyRegistered:
        return "part or all of the requested memory range is already mapped (mock)";
    case cudaErrorMapBufferObjectFailed: return "mapping of buffer object failed (mock)";
    default: return "unknown error (mock)";
    }
}

cudaError_t cudaGetLastError(void)
{
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    if (device < 0 || device >= s_env_int("KVT_MOCK_CUDA_DEVICES", 1))
        return cudaErrorInvalidDevice;
    s_device = device;
    return cudaSuccess;
}

cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags)
{
    if (s_env_int("KVT_MOCK_CUDA_FAIL_HOST_REGISTER", 0))
        return cudaErrorHostMemoryAlreadyRegistered;
    s_log("hostregister %zu flags %u", size, flags);
    (void)ptr;
    return cudaSuccess;
}

cudaError_t cudaHostUnregister(void *ptr)
{
    (void)ptr;
    s_log("hostunregister");
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *ptr)
{
    memset(a, 0, sizeof *a);
    a->type = cudaMemoryTypeHost;
    a->hostPointer = (void *)ptr;
    return cudaSuccess;
}

cudaError_t cudaIpcOpenMemHandle(void **dev, cudaIpcMemHandle_t handle, unsigned int flags)
{
    (void)flags;
    char h[64];
    memcpy(h, &handle, sizeof h);
    if (memcmp(h, S_MAGIC, sizeof S_MAGIC) != 0)
        return cudaErrorInvalidValue;
    char path[64];
    memcpy(path, h + 8, 56);
    path[56] = '\0';
    int fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size == 0) {
        if (fd >= 0)
            close(fd);
        return cudaErrorMapBufferObjectFailed;
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return cudaErrorMapBufferObjectFailed;
    pthread_mutex_lock(&s_lock);
    int i = 0;
    while (i < S_MAX_MAPS && s_maps[i].ptr)
        i++;
    if (i < S_MAX_MAPS) {
        s_maps[i].ptr = p;
        s_maps[i].len = (size_t)st.st_size;
        snprintf(s_maps[i].path, sizeof s_maps[i].path, "%s", path);
    }
    pthread_mutex_unlock(&s_lock);
    if (i == S_MAX_MAPS) {
        munmap(p, (size_t)st.st_size);
        return cudaErrorMapBufferObjectFailed;
    }
    s_log("open %s device %d", path, s_device);
    *dev = p;
    return cudaSuccess;
}

cudaError_t cudaIpcCloseMemHandle(void *dev)
{
    char path[64] = "";
    size_t len = 0;
    pthread_mutex_lock(&s_lock);
    for (int i = 0; i < S_MAX_MAPS; i++)
        if (s_maps[i].ptr == dev) {
            len = s_maps[i].len;
            memcpy(path, s_maps[i].path, sizeof path);
            s_maps[i].ptr = NULL;
            break;
        }
    pthread_mutex_unlock(&s_lock);
    if (!len)
        return cudaErrorInvalidValue;
    munmap(dev, len);
    s_log("close %s", path);
    return cudaSuccess;
}

cudaError_t cudaIpcOpenEventHandle(cudaEvent_t *ev, cudaIpcEventHandle_t handle)
{
    (void)handle;
    *ev = (cudaEvent_t)malloc(16);
    s_log("event open");
    return *ev ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaEventDestroy(cudaEvent_t ev)
{
    free(ev);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *st, unsigned int flags)
{
    (void)flags;
    *st = (cudaStream_t)malloc(16);
    return *st ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaStreamDestroy(cudaStream_t st)
{
    free(st);
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t ev, unsigned int flags)
{
    (void)st, (void)flags;
    return ev ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t cudaStreamSynchronize(cudaStream_t st)
{
    (void)st;
    return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t st)
{
    (void)st;
    return cudaSuccess;
}

cudaError_t cudaSetDeviceFlags(unsigned int flags)
{
    s_log("deviceflags %u", flags);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t st)
{
    (void)st;
    if (kind != cudaMemcpyDefault)
        return cudaErrorInvalidValue;
    memcpy(dst, src, count);
    s_log("memcpy %zu", count);
    return cudaSuccess;
}

cudaError_t cudaMemcpyBatchAsync(void *const *dsts, const void *const *srcs, const size_t *sizes,
                                 size_t count, struct cudaMemcpyAttributes *attrs,
                                 size_t *attrsIdxs, size_t numAttrs, cudaStream_t st)
{
    (void)st;
    if (s_env_int("KVT_MOCK_CUDA_NO_BATCH", 0))
        return cudaErrorNotSupported;
    if (numAttrs != 1 || attrsIdxs[0] != 0 ||
        attrs[0].srcAccessOrder != cudaMemcpySrcAccessOrderStream)
        return cudaErrorInvalidValue;
    for (size_t i = 0; i < count; i++)
        memcpy(dsts[i], srcs[i], sizes[i]);
    s_log("batch %zu", count);
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t size)
{
    if (s_env_int("KVT_MOCK_CUDA_NO_MALLOC", 0))
        return cudaErrorMemoryAllocation;
    *p = malloc(size);
    s_log("malloc %zu", size);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFree(void *p)
{
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t size)
{
    *p = malloc(size);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFreeHost(void *p)
{
    free(p);
    return cudaSuccess;
}

/* copies are synchronous here: an event is always complete */
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned int flags)
{
    (void)flags;
    *ev = (cudaEvent_t)malloc(16);
    return *ev ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t st)
{
    (void)st;
    return ev ? cudaSuccess : cudaErrorInvalidValue;
}

static char s_library, s_kernel; /* the handles' addresses */

cudaError_t cudaLibraryLoadData(cudaLibrary_t *lib, const void *code,
                                enum cudaJitOption *jit, void **jit_values, unsigned int njit,
                                enum cudaLibraryOption *opts, void **opt_values,
                                unsigned int nopts)
{
    (void)jit, (void)jit_values, (void)njit, (void)opts, (void)opt_values, (void)nopts;
    if (!s_env_int("KVT_MOCK_CUDA_KERNELS", 0))
        return cudaErrorNotSupported;
    /* a fatbin starts with its magic number (0xBA55ED50, little-endian) */
    static const unsigned char magic[4] = {0x50, 0xed, 0x55, 0xba};
    if (!code || memcmp(code, magic, 4) != 0)
        return cudaErrorInvalidValue;
    *lib = (cudaLibrary_t)&s_library;
    return cudaSuccess;
}

cudaError_t cudaLibraryGetKernel(cudaKernel_t *k, cudaLibrary_t lib, const char *name)
{
    if (lib != (cudaLibrary_t)&s_library || strcmp(name, KVT_GPU_KERNEL_NAME) != 0)
        return cudaErrorSymbolNotFound;
    *k = (cudaKernel_t)&s_kernel;
    return cudaSuccess;
}

/* kvt_gpu_blocks on the CPU: "device" addresses are host addresses here */
cudaError_t cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args,
                             size_t shared, cudaStream_t st)
{
    (void)st;
    if (func != (const void *)&s_kernel || shared || grid.y != 1 || grid.z != 1 ||
        block.x != KVT_GPU_KERNEL_THREADS || block.y != 1 || block.z != 1)
        return cudaErrorInvalidValue;
    const kvt_gpu_blocks_args_t *a = args[0];
    if (a->per == 0 || grid.x % a->per)
        return cudaErrorInvalidValue;
    const uint64_t *ptrs = (const uint64_t *)(uintptr_t)a->ptrs;
    const uint64_t *ids = (const uint64_t *)(uintptr_t)a->ids;
    for (uint64_t i = 0; i < grid.x; i++) {
        uint8_t *dev = (uint8_t *)(uintptr_t)ptrs[a->l0 + i / a->per] + ids[i % a->per] * a->block_bytes;
        uint8_t *stg = (uint8_t *)(uintptr_t)a->stage + i * a->block_bytes;
        if (a->to_stage)
            memcpy(stg, dev, a->block_bytes);
        else
            memcpy(dev, stg, a->block_bytes);
    }
    s_log("kernel %u %u %s", grid.x, a->l0, a->to_stage ? "gather" : "scatter");
    return cudaSuccess;
}
