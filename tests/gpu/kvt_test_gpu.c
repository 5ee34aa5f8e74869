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
 * handles. That engine runs three times, each against a fresh daemon: with direct copies
 * (KVT_GPU_COPY=direct), with staged copies (the gather/scatter kernel), and staged with layer
 * 3 at an offset that is not a multiple of 16 (the kernel's byte loop).
 *
 * Then two engines on the same device: A registers and stores, B stores 512 MiB requests in a
 * loop and is SIGKILLed while one is in flight. The daemon must close B's handles, keep every
 * object B had stored (byte-exact), hold the in-flight request whole or not at all, and serve A
 * (retrieve, compare, store more) as before.
 *
 * Without a CUDA device it prints one "skipped" line and exits 0. */
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

typedef struct {
    const char *mode;  /* the daemon's KVT_GPU_COPY */
    uint64_t misalign; /* added to layer 3's offset in the shared allocation */
} s_pass_t;

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
    const s_pass_t *pass = arg;
    H_CUDA(cudaSetDevice(0));
    /* the paged KV cache: layers 0 and 1 alone, 2 and 3 in one allocation */
    uint8_t *layer[LAYERS], *shared = NULL;
    H_CUDA(cudaMalloc((void **)&layer[0], LAYER_BYTES));
    H_CUDA(cudaMalloc((void **)&layer[1], LAYER_BYTES));
    H_CUDA(cudaMalloc((void **)&shared, 2 * LAYER_BYTES + 4096 + 16));
    layer[2] = shared;
    layer[3] = shared + LAYER_BYTES + 4096 + pass->misalign;
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
    uint64_t offsets[LAYERS] = {0, 0, 0, LAYER_BYTES + 4096 + pass->misalign};
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
    printf("test-gpu: engine (%s copies%s): register, store %u chunks (%u blocks x %d layers "
           "each), clear, retrieve (same and other blocks), prefix, unregister, bye: ok\n",
           pass->mode, pass->misalign ? ", a layer at an odd offset" : "", CHUNKS, per, LAYERS);
    return 0;
}

/* ---- two engines, one SIGKILLed while a copy is in flight ---- */

#define B_LAYERS 32
#define B_BLOCKS 1024
#define B_CHUNKS 16
#define B_MAX_STORES 6 /* 3 GiB: the daemon's L1 (4 GiB) holds them all, nothing is evicted */

/* Connects as `instance` and registers `layers` buffers of `blocks` blocks; *per: blocks per
 * chunk. */
static kvtier_t *s_connect_register(const char *instance, uint32_t layers, uint32_t blocks,
                                    const uint8_t (*handles)[KVTIER_IPC_HANDLE_LEN],
                                    uint32_t *per)
{
    kvtier_t *c = h_connect(&s_d, instance, 30000);
    H_CHECK(c, "%s: connect", instance);
    *per = kvtier_info(c)->chunk_tokens / BLOCK_TOKENS;
    kvtier_gpu_layout_t lay = {.device = 0, .layers = layers, .num_blocks = blocks,
                               .block_tokens = BLOCK_TOKENS, .token_bytes = TOKEN_BYTES,
                               .dtype = "bfloat16", .handles = handles};
    int rc = kvtier_register_gpu(c, &lay);
    H_CHECK(rc == 0, "%s: register_gpu: %s", instance, kvtier_last_error(c));
    return c;
}

/* Engine A: 4 layers, stores 3 chunks, says ready, waits for go, then retrieves them into
 * other blocks, compares, and stores and finds 3 more. fds[0]: ready (write), fds[1]: go. */
static int s_engine_a(void *arg)
{
    const int *fds = arg;
    H_CUDA(cudaSetDevice(0));
    uint8_t *layer[LAYERS];
    uint8_t handles[LAYERS][KVTIER_IPC_HANDLE_LEN];
    uint8_t *orig = malloc(LAYERS * LAYER_BYTES);
    H_CHECK(orig, "malloc");
    s_fill(orig, LAYERS * LAYER_BYTES, 77);
    for (int l = 0; l < LAYERS; l++) {
        H_CUDA(cudaMalloc((void **)&layer[l], LAYER_BYTES));
        H_CUDA(cudaMemcpy(layer[l], orig + (size_t)l * LAYER_BYTES, LAYER_BYTES,
                          cudaMemcpyHostToDevice));
        cudaIpcMemHandle_t h;
        H_CUDA(cudaIpcGetMemHandle(&h, layer[l]));
        memcpy(handles[l], &h, sizeof h);
    }
    uint32_t per = 0;
    kvtier_t *c = s_connect_register("engine-a", LAYERS, NUM_BLOCKS,
                                     (const uint8_t(*)[KVTIER_IPC_HANDLE_LEN])handles, &per);
    uint32_t chunk_tokens = kvtier_info(c)->chunk_tokens;
    int rc;
    uint32_t ntok = chunk_tokens * CHUNKS * 2, n = per * CHUNKS, got = 0;
    uint32_t *tokens = malloc(ntok * sizeof *tokens);
    H_CHECK(tokens, "malloc");
    for (uint32_t i = 0; i < ntok; i++)
        tokens[i] = i * 13 + 5;
    uint8_t keys[2 * CHUNKS][KVTIER_KEY_LEN];
    kvtier_hash_tokens_local(tokens, ntok, chunk_tokens, "engine-a", keys);
    uint64_t all[NUM_BLOCKS];
    for (uint64_t i = 0; i < NUM_BLOCKS; i++)
        all[i] = i;
    h_shuffle(all, NUM_BLOCKS, 99);
    uint64_t *ids = all, *ids2 = all + n;
    rc = kvtier_store_gpu(c, "test-gpu-a", NULL, 0, (const uint8_t(*)[16])keys, CHUNKS, ids, n,
                          NULL, &got);
    H_CHECK(rc == 0 && got == CHUNKS, "engine A: store_gpu: %d %u %s", rc, got,
            kvtier_last_error(c));
    char ch = 'r';
    H_CHECK(write(fds[0], &ch, 1) == 1, "engine A: ready");
    H_CHECK(read(fds[1], &ch, 1) == 1, "engine A: go");
    /* B is dead by now: A is served as before */
    for (int l = 0; l < LAYERS; l++)
        H_CUDA(cudaMemset(layer[l], 0, LAYER_BYTES));
    H_CUDA(cudaDeviceSynchronize());
    rc = kvtier_retrieve_gpu(c, "test-gpu-a", NULL, 0, (const uint8_t(*)[16])keys, CHUNKS, ids2,
                             n, NULL, &got);
    H_CHECK(rc == 0 && got == CHUNKS, "engine A: retrieve_gpu after the kill: %d %u %s", rc, got,
            kvtier_last_error(c));
    s_expect(layer, orig, ids, ids2, n, "engine A: retrieve after the kill");
    rc = kvtier_store_gpu(c, "test-gpu-a", NULL, 0, (const uint8_t(*)[16])keys + CHUNKS, CHUNKS,
                          ids2, n, NULL, &got);
    H_CHECK(rc == 0 && got == CHUNKS, "engine A: store_gpu after the kill: %d %u %s", rc, got,
            kvtier_last_error(c));
    uint32_t hits = 0;
    rc = kvtier_lookup(c, "test-gpu-a", NULL, (const uint8_t(*)[16])keys + CHUNKS, CHUNKS, 0,
                       &hits, NULL, NULL, NULL);
    H_CHECK(rc == 0 && hits == CHUNKS, "engine A: lookup: %d %u", rc, hits);
    kvtier_close(&c);
    for (int l = 0; l < LAYERS; l++)
        cudaFree(layer[l]);
    free(tokens);
    free(orig);
    return 0;
}

/* The keys of B's store number i. */
static void s_b_keys(uint32_t chunk_tokens, uint32_t i, uint8_t (*keys)[KVTIER_KEY_LEN])
{
    uint32_t ntok = chunk_tokens * B_CHUNKS;
    uint32_t *tokens = malloc(ntok * sizeof *tokens);
    H_CHECK(tokens, "malloc");
    for (uint32_t t = 0; t < ntok; t++)
        tokens[t] = t + i * 1000003u;
    kvtier_hash_tokens_local(tokens, ntok, chunk_tokens, "engine-b", keys);
    free(tokens);
}

/* Engine B: 32 layers x 1024 blocks (2 GiB), layer l filled with byte l + 1; stores 16 chunks
 * from shuffled blocks, again and again, one byte to *arg after each. */
static int s_engine_b(void *arg)
{
    int wfd = *(const int *)arg;
    H_CUDA(cudaSetDevice(0));
    size_t layer_bytes = (size_t)B_BLOCKS * BLOCK_BYTES;
    uint8_t(*handles)[KVTIER_IPC_HANDLE_LEN] = calloc(B_LAYERS, KVTIER_IPC_HANDLE_LEN);
    H_CHECK(handles, "calloc");
    for (int l = 0; l < B_LAYERS; l++) {
        uint8_t *p = NULL;
        H_CUDA(cudaMalloc((void **)&p, layer_bytes));
        H_CUDA(cudaMemset(p, l + 1, layer_bytes));
        cudaIpcMemHandle_t h;
        H_CUDA(cudaIpcGetMemHandle(&h, p));
        memcpy(handles[l], &h, sizeof h);
    }
    H_CUDA(cudaDeviceSynchronize());
    uint32_t per = 0;
    kvtier_t *c = s_connect_register("engine-b", B_LAYERS, B_BLOCKS,
                                     (const uint8_t(*)[KVTIER_IPC_HANDLE_LEN])handles, &per);
    uint32_t chunk_tokens = kvtier_info(c)->chunk_tokens;
    int rc;
    uint64_t ids[B_BLOCKS];
    for (uint64_t i = 0; i < B_BLOCKS; i++)
        ids[i] = i;
    h_shuffle(ids, B_BLOCKS, 5);
    uint8_t keys[B_CHUNKS][KVTIER_KEY_LEN];
    for (uint32_t i = 0; i < B_MAX_STORES; i++) {
        s_b_keys(chunk_tokens, i, keys);
        uint32_t got = 0;
        rc = kvtier_store_gpu(c, "test-gpu-b", NULL, 0, (const uint8_t(*)[16])keys, B_CHUNKS,
                              ids, per * B_CHUNKS, NULL, &got);
        H_CHECK(rc == 0 && got == B_CHUNKS, "engine B: store_gpu: %d %u %s", rc, got,
                kvtier_last_error(c));
        char ch = 's';
        H_CHECK(write(wfd, &ch, 1) == 1, "engine B: progress");
    }
    pause(); /* the parent kills us */
    return 0;
}

/* Every object of B's store i is present (or, with may_miss, all are absent) and holds, per
 * layer l, bytes l + 1. Returns the objects found. */
static uint32_t s_check_b(kvtier_t *c, uint32_t i, bool may_miss)
{
    uint32_t chunk_tokens = kvtier_info(c)->chunk_tokens, per = chunk_tokens / BLOCK_TOKENS;
    uint8_t keys[B_CHUNKS][KVTIER_KEY_LEN];
    s_b_keys(chunk_tokens, i, keys);
    kvtier_slot_t slots[B_CHUNKS];
    uint32_t n = 0;
    uint64_t lease = 0;
    int rc = kvtier_acquire(c, "test-gpu-b", NULL, (const uint8_t(*)[16])keys, B_CHUNKS, slots,
                            &n, &lease);
    H_CHECK(rc == 0, "acquire B's store %u: %d %s", i, rc, kvtier_last_error(c));
    H_CHECK(n == B_CHUNKS || (may_miss && n == 0),
            "B's store %u: %u of %d objects (a store is whole or absent)", i, n, B_CHUNKS);
    size_t seg = (size_t)per * BLOCK_BYTES;
    uint8_t *want = malloc(seg);
    H_CHECK(want, "malloc");
    for (uint32_t k = 0; k < n; k++) {
        H_CHECK(slots[k].length == B_LAYERS * seg, "B's object %u/%u: %llu bytes", i, k,
                (unsigned long long)slots[k].length);
        for (int l = 0; l < B_LAYERS; l++) {
            memset(want, l + 1, seg);
            H_CHECK(memcmp((uint8_t *)slots[k].ptr + l * seg, want, seg) == 0,
                    "B's store %u, object %u, layer %d differs", i, k, l);
        }
    }
    free(want);
    if (lease)
        kvtier_release(c, lease);
    return n;
}

static int s_kill_test(void)
{
    if (!h_daemon_start(&s_d, s_daemon, "4G", NULL))
        return 1;
    int a_ready[2], a_go[2], b_prog[2];
    H_CHECK(pipe(a_ready) == 0 && pipe(a_go) == 0, "pipe");
    int a_fds[2] = {a_ready[1], a_go[0]};
    pid_t a = h_spawn(s_engine_a, a_fds);
    char ch;
    H_CHECK(read(a_ready[0], &ch, 1) == 1, "engine A did not get ready");
    H_CHECK(pipe(b_prog) == 0, "pipe"); /* after A: only B holds its write end */
    pid_t b = h_spawn(s_engine_b, &b_prog[1]);
    close(b_prog[1]);
    uint32_t done = 0;
    while (done < 2 && read(b_prog[0], &ch, 1) == 1)
        done++;
    H_CHECK(done == 2, "engine B failed before its second store (%u done)", done);
    usleep(2000); /* the third 512 MiB store is being copied */
    kill(b, SIGKILL);
    h_wait(b);
    while (read(b_prog[0], &ch, 1) == 1)
        done++;
    close(b_prog[0]);
    for (int i = 0; i < 200 && !h_log_has(&s_d, "gpu: closing the handles"); i++)
        usleep(50000);
    H_CHECK(h_log_has(&s_d, "gpu: closing the handles"),
            "the daemon did not close the killed engine's handles");
    H_CHECK(write(a_go[1], "g", 1) == 1, "go");
    int rc_a = h_wait(a);
    H_CHECK(rc_a == 0, "engine A failed after B was killed (status %d)", rc_a);
    kvtier_t *c = h_connect(&s_d, "verifier", 30000);
    H_CHECK(c, "verifier: connect");
    for (uint32_t i = 0; i < done; i++)
        s_check_b(c, i, false);
    uint32_t in_flight = done < B_MAX_STORES ? s_check_b(c, done, true) : 0;
    kvtier_close(&c);
    printf("test-gpu: two engines: B SIGKILLed after %u stores of 512 MiB (the next one %s), "
           "its handles closed, its %u stored objects intact, A served: ok\n", done,
           done == B_MAX_STORES ? "was never sent: B was done"
           : in_flight ? "committed whole" : "dropped whole", done * B_CHUNKS);
    int drc = h_daemon_stop(&s_d);
    H_CHECK(drc == 0, "kvtierd exit status %d after the kill test; log %s", drc, s_d.log);
    close(a_ready[0]);
    close(a_ready[1]);
    close(a_go[0]);
    close(a_go[1]);
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
    static const s_pass_t passes[] = {{"direct", 0}, {"staged", 0}, {"staged", 8}};
    for (size_t i = 0; i < sizeof passes / sizeof passes[0]; i++) {
        if (!h_daemon_start(&s_d, s_daemon, "512M", passes[i].mode))
            return 1;
        int rc = h_run_child(s_engine, (void *)&passes[i]);
        /* staged must really be staged: the kernel loaded (else the daemon copies direct) */
        bool kernel = h_log_has(&s_d, "staged and direct copies");
        int drc = h_daemon_stop(&s_d);
        if (rc != 0 || drc != 0 || (!strcmp(passes[i].mode, "staged") && !kernel)) {
            fprintf(stderr, "test-gpu: FAILED (%s copies: engine status %d, kvtierd status %d%s; "
                            "log %s)\n", passes[i].mode, rc, drc,
                    kernel ? "" : ", the copy kernel did not load", s_d.log);
            return 1;
        }
    }
    if (s_kill_test() != 0)
        return 1;
    printf("test-gpu: passed\n");
    return 0;
}
