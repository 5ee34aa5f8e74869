/* make test-gpu: the GPU path end to end, on a machine with a CUDA device.
 *
 *   build/kvt-test-gpu --daemon build/kvtierd
 *
 * Starts a private kvtierd, then an engine child process allocates a paged KV cache (4 layers
 * of 128 blocks x 16 tokens x 4 KiB; layers 2 and 3 share one allocation at different offsets,
 * as a caching allocator would place them), fills it with random bytes, registers it, stores
 * three chunks from shuffled block ids (waiting on an IPC event), clears the cache on the GPU
 * (cudaMemset), retrieves into the same blocks and into other blocks, and compares every byte
 * with the original. Also: a second REGISTER on the device is refused, STORE of stored keys
 * stores nothing, UNREGISTER ends the registration, and BYE makes the daemon close the
 * handles. Without a CUDA device it prints one "skipped" line and exits 0. */
#include "gpu_harness.h"

#define LAYERS 4
#define NUM_BLOCKS 128
#define BLOCK_TOKENS 16
#define TOKEN_BYTES 4096 /* K+V x 8 heads x 128 x bf16 */
#define BLOCK_BYTES ((size_t)BLOCK_TOKENS * TOKEN_BYTES)
#define LAYER_BYTES ((size_t)NUM_BLOCKS * BLOCK_BYTES)
#define CHUNKS 3

static const char *s_daemon;
static h_daemon_t s_d;

static void s_fill(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t x = seed | 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        p[i] = (uint8_t)x;
    }
}

/* Compares layer contents on the GPU with what must be there: for every j, block dst[j]
 * holds the original block src[j]; every other block is zero. */
static void s_expect(uint8_t *const *layer, const uint8_t *orig, const uint64_t *src,
                     const uint64_t *dst, uint32_t n, const char *what)
{
    uint8_t *got = malloc(LAYER_BYTES);
    uint8_t *zero = calloc(1, BLOCK_BYTES);
    H_CHECK(got && zero, "malloc");
    for (int l = 0; l < LAYERS; l++) {
        H_CUDA(cudaMemcpy(got, layer[l], LAYER_BYTES, cudaMemcpyDeviceToHost));
        for (uint64_t b = 0; b < NUM_BLOCKS; b++) {
            const uint8_t *want = zero;
            for (uint32_t j = 0; j < n; j++)
                if (dst[j] == b)
                    want = orig + (size_t)l * LAYER_BYTES + src[j] * BLOCK_BYTES;
            H_CHECK(memcmp(got + b * BLOCK_BYTES, want, BLOCK_BYTES) == 0,
                    "%s: layer %d block %llu differs", what, l, (unsigned long long)b);
        }
    }
    free(zero);
    free(got);
}

static int s_engine(void *arg)
{
    (void)arg;
    H_CUDA(cudaSetDevice(0));
    /* the paged KV cache: layers 0 and 1 alone, 2 and 3 in one allocation */
    uint8_t *layer[LAYERS], *shared = NULL;
    H_CUDA(cudaMalloc((void **)&layer[0], LAYER_BYTES));
    H_CUDA(cudaMalloc((void **)&layer[1], LAYER_BYTES));
    H_CUDA(cudaMalloc((void **)&shared, 2 * LAYER_BYTES + 4096));
    layer[2] = shared;
    layer[3] = shared + LAYER_BYTES + 4096;
    uint8_t *orig = malloc(LAYERS * LAYER_BYTES);
    H_CHECK(orig, "malloc");
    s_fill(orig, LAYERS * LAYER_BYTES, 42);
    cudaStream_t st;
    H_CUDA(cudaStreamCreate(&st));
    for (int l = 0; l < LAYERS; l++)
        H_CUDA(cudaMemcpyAsync(layer[l], orig + (size_t)l * LAYER_BYTES, LAYER_BYTES,
                               cudaMemcpyHostToDevice, st));
    /* the daemon waits for this event instead of the engine synchronising */
    cudaEvent_t ev;
    H_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess));
    H_CUDA(cudaEventRecord(ev, st));
    cudaIpcEventHandle_t evh;
    H_CUDA(cudaIpcGetEventHandle(&evh, ev));

    uint8_t handles[LAYERS][KVTIER_IPC_HANDLE_LEN];
    uint64_t offsets[LAYERS] = {0, 0, 0, LAYER_BYTES + 4096};
    for (int l = 0; l < LAYERS; l++) {
        cudaIpcMemHandle_t h;
        H_CUDA(cudaIpcGetMemHandle(&h, l >= 2 ? shared : layer[l]));
        memcpy(handles[l], &h, sizeof h);
    }
    kvtier_t *c = h_connect(&s_d, "engine-test", 30000);
    H_CHECK(c, "connect");
    uint32_t chunk_tokens = kvtier_info(c)->chunk_tokens;
    H_CHECK(chunk_tokens % BLOCK_TOKENS == 0, "chunk_tokens %u", chunk_tokens);
    uint32_t per = chunk_tokens / BLOCK_TOKENS;
    H_CHECK(per * CHUNKS * 2 <= NUM_BLOCKS && per <= 64, "%u blocks per chunk: too many", per);

    kvtier_gpu_layout_t lay = {.device = 0, .layers = LAYERS, .num_blocks = NUM_BLOCKS,
                               .block_tokens = BLOCK_TOKENS, .token_bytes = TOKEN_BYTES,
                               .dtype = "bfloat16",
                               .handles = (const uint8_t(*)[KVTIER_IPC_HANDLE_LEN])handles,
                               .offsets = offsets};
    int rc = kvtier_register_gpu(c, &lay);
    H_CHECK(rc == 0, "register_gpu: %d %s", rc, kvtier_last_error(c));
    rc = kvtier_register_gpu(c, &lay);
    H_CHECK(rc == KVTIER_EBADREQ, "second register_gpu: %d %s", rc, kvtier_last_error(c));

    /* three chunks from shuffled blocks (a few consecutive runs survive the shuffle) */
    uint32_t ntok = chunk_tokens * CHUNKS;
    uint32_t *tokens = malloc(ntok * sizeof *tokens);
    H_CHECK(tokens, "malloc");
    for (uint32_t i = 0; i < ntok; i++)
        tokens[i] = i * 7 + 3;
    uint8_t keys[CHUNKS][KVTIER_KEY_LEN];
    H_CHECK(kvtier_hash_tokens_local(tokens, ntok, chunk_tokens, NULL, keys) == CHUNKS, "hash");
    uint64_t all[NUM_BLOCKS];
    for (uint64_t i = 0; i < NUM_BLOCKS; i++)
        all[i] = i;
    h_shuffle(all, NUM_BLOCKS, 7);
    uint64_t *ids = all, *ids2 = all + per * CHUNKS; /* disjoint sets */
    uint32_t n = per * CHUNKS, stored = 0, found = 0;
    rc = kvtier_store_gpu(c, "test-gpu", NULL, 0, (const uint8_t(*)[16])keys, CHUNKS, ids, n,
                          &evh, &stored);
    H_CHECK(rc == 0 && stored == CHUNKS, "store_gpu: %d stored %u: %s", rc, stored,
            kvtier_last_error(c));
    rc = kvtier_store_gpu(c, "test-gpu", NULL, 0, (const uint8_t(*)[16])keys, CHUNKS, ids, n,
                          NULL, &stored);
    H_CHECK(rc == 0 && stored == 0, "store_gpu again: %d stored %u", rc, stored);

    /* clear the cache on the GPU, retrieve into the same blocks */
    for (int l = 0; l < LAYERS; l++)
        H_CUDA(cudaMemset(layer[l], 0, LAYER_BYTES));
    H_CUDA(cudaDeviceSynchronize());
    rc = kvtier_retrieve_gpu(c, "test-gpu", NULL, 0, (const uint8_t(*)[16])keys, CHUNKS, ids, n,
                             NULL, &found);
    H_CHECK(rc == 0 && found == CHUNKS, "retrieve_gpu: %d found %u: %s", rc, found,
            kvtier_last_error(c));
    s_expect(layer, orig, ids, ids, n, "retrieve into the same blocks");

    /* again into other blocks (a new request's block table), waiting on an event */
    for (int l = 0; l < LAYERS; l++)
        H_CUDA(cudaMemsetAsync(layer[l], 0, LAYER_BYTES, st));
    H_CUDA(cudaEventRecord(ev, st));
    rc = kvtier_retrieve_gpu(c, "test-gpu", NULL, 0, (const uint8_t(*)[16])keys, CHUNKS, ids2,
                             n, &evh, &found);
    H_CHECK(rc == 0 && found == CHUNKS, "retrieve_gpu (moved): %d found %u: %s", rc, found,
            kvtier_last_error(c));
    s_expect(layer, orig, ids, ids2, n, "retrieve into other blocks");

    /* a prefix: the first chunk only is found when the second key is unknown */
    uint8_t keys2[2][KVTIER_KEY_LEN];
    memcpy(keys2[0], keys[0], 16);
    memset(keys2[1], 0xee, 16);
    rc = kvtier_retrieve_gpu(c, "test-gpu", NULL, 0, (const uint8_t(*)[16])keys2, 2, ids,
                             2 * per, NULL, &found);
    H_CHECK(rc == 0 && found == 1, "retrieve_gpu prefix: %d found %u", rc, found);

    /* block ids out of range: bad_request, nothing copied */
    uint64_t bad[64];
    for (uint32_t i = 0; i < per; i++)
        bad[i] = NUM_BLOCKS + i;
    rc = kvtier_store_gpu(c, "test-gpu", NULL, 0, (const uint8_t(*)[16])keys2 + 1, 1, bad, per,
                          NULL, &stored);
    H_CHECK(rc == KVTIER_EBADREQ, "out-of-range block ids: %d", rc);

    rc = kvtier_unregister_gpu(c, 0);
    H_CHECK(rc == 0, "unregister_gpu: %d %s", rc, kvtier_last_error(c));
    rc = kvtier_unregister_gpu(c, 0);
    H_CHECK(rc == KVTIER_ENOTFOUND, "second unregister_gpu: %d", rc);
    rc = kvtier_retrieve_gpu(c, "test-gpu", NULL, 0, (const uint8_t(*)[16])keys, CHUNKS, ids, n,
                             NULL, &found);
    H_CHECK(rc == KVTIER_ENOTFOUND, "retrieve_gpu after unregister: %d", rc);
    /* register again, then BYE: the daemon closes the handles itself */
    rc = kvtier_register_gpu(c, &lay);
    H_CHECK(rc == 0, "register_gpu again: %d %s", rc, kvtier_last_error(c));
    kvtier_close(&c);
    for (int i = 0; i < 100 && !h_log_has(&s_d, "gpu: closing the handles"); i++)
        usleep(50000);
    H_CHECK(h_log_has(&s_d, "gpu: closing the handles"), "BYE did not close the handles");
    free(tokens);
    free(orig);
    cudaEventDestroy(ev);
    cudaStreamDestroy(st);
    cudaFree(layer[0]);
    cudaFree(layer[1]);
    cudaFree(shared);
    printf("test-gpu: engine: register, store %u chunks (%u blocks x %d layers each), clear, "
           "retrieve (same and other blocks), prefix, unregister, bye: ok\n",
           CHUNKS, per, LAYERS);
    return 0;
}

int main(int argc, char **argv)
{
    s_daemon = "build/kvtierd";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--daemon") && i + 1 < argc)
            s_daemon = argv[++i];
        else {
            fprintf(stderr, "usage: kvt-test-gpu [--daemon PATH]\n");
            return 2;
        }
    }
    char why[256];
    int p = h_probe(why, sizeof why);
    if (p == H_SKIP) {
        printf("test-gpu: skipped: no CUDA device (%s)\n", why);
        return 0;
    }
    if (p != 0) {
        fprintf(stderr, "test-gpu: the CUDA probe failed (status %d)\n", p);
        return 1;
    }
    alarm(240); /* a hang is a failure; children die with us (PDEATHSIG) */
    if (!h_daemon_start(&s_d, s_daemon, "512M"))
        return 1;
    int rc = h_run_child(s_engine, NULL);
    int drc = h_daemon_stop(&s_d);
    if (rc != 0 || drc != 0) {
        fprintf(stderr, "test-gpu: FAILED (engine status %d, kvtierd status %d; log %s)\n", rc,
                drc, s_d.log);
        return 1;
    }
    printf("test-gpu: passed\n");
    return 0;
}
