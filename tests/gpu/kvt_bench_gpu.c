/* make bench-gpu: GPU <-> L1 throughput of STORE_GPU and RETRIEVE_GPU against a plain pinned
 * cudaMemcpy of the same bytes, measured in the same run on the same device.
 *
 *   build/kvt-bench-gpu [--daemon PATH] [--quick] [--json FILE]
 *
 * An engine child allocates a paged KV cache (32 layers x 1024 blocks x 16 tokens x 4 KiB per
 * token = 64 KiB blocks, 2 GiB; --quick: 8 layers x 256 blocks) and registers it with a private
 * kvtierd (L1 3 GiB). One request moves 16 chunks of 256 tokens (16 blocks x 32 layers = 32 MiB
 * each, 512 MiB in all). Each figure is the median of 7 requests, timed by the client from send
 * to reply (so it includes the round trip, L1 reserve/commit or acquire/release, and the wait
 * for the copies). Block tables: "contiguous" (ids in order: one copy per layer and chunk) and
 * "shuffled" (a random permutation: one copy per 64 KiB block). Baseline: cudaMemcpy between
 * one device buffer and one cudaMallocHost buffer of the request's size (D2H and H2D).
 * Target: >= 0.9x the baseline. Without a CUDA device: one "skipped" line, exit 0. */
#include "gpu_harness.h"

static struct {
    const char *daemon;
    const char *json;
    bool quick;
} s_opt = {"build/kvtierd", NULL, false};

static h_daemon_t s_d;

#define BLOCK_TOKENS 16
#define TOKEN_BYTES 4096
#define BLOCK_BYTES ((size_t)BLOCK_TOKENS * TOKEN_BYTES)
#define REPS 7

static int s_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double s_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, s_cmp);
    return v[n / 2];
}

typedef struct {
    const char *name;
    double gbps, base_gbps;
} s_result_t;

static int s_bench(void *arg)
{
    (void)arg;
    uint32_t layers = s_opt.quick ? 8 : 32, num_blocks = s_opt.quick ? 256 : 1024;
    uint32_t chunks = s_opt.quick ? 4 : 16;
    size_t layer_bytes = (size_t)num_blocks * BLOCK_BYTES;
    H_CUDA(cudaSetDevice(0));
    struct cudaDeviceProp prop;
    H_CUDA(cudaGetDeviceProperties(&prop, 0));
    uint8_t **layer = calloc(layers, sizeof *layer);
    uint8_t(*handles)[KVTIER_IPC_HANDLE_LEN] = calloc(layers, KVTIER_IPC_HANDLE_LEN);
    H_CHECK(layer && handles, "calloc");
    for (uint32_t l = 0; l < layers; l++) {
        H_CUDA(cudaMalloc((void **)&layer[l], layer_bytes));
        H_CUDA(cudaMemset(layer[l], (int)l + 1, layer_bytes));
        cudaIpcMemHandle_t h;
        H_CUDA(cudaIpcGetMemHandle(&h, layer[l]));
        memcpy(handles[l], &h, sizeof h);
    }
    H_CUDA(cudaDeviceSynchronize());
    kvtier_t *c = h_connect(&s_d, "engine-bench", 60000);
    H_CHECK(c, "connect");
    uint32_t chunk_tokens = kvtier_info(c)->chunk_tokens;
    uint32_t per = chunk_tokens / BLOCK_TOKENS;
    H_CHECK(per * chunks <= num_blocks, "%u blocks needed", per * chunks);
    kvtier_gpu_layout_t lay = {.device = 0, .layers = layers, .num_blocks = num_blocks,
                               .block_tokens = BLOCK_TOKENS, .token_bytes = TOKEN_BYTES,
                               .dtype = "bfloat16",
                               .handles = (const uint8_t(*)[KVTIER_IPC_HANDLE_LEN])handles};
    int rc = kvtier_register_gpu(c, &lay);
    H_CHECK(rc == 0, "register_gpu: %s", kvtier_last_error(c));
    size_t bytes = (size_t)chunks * per * layers * BLOCK_BYTES;
    uint32_t n = per * chunks;
    uint64_t *ids = malloc(num_blocks * sizeof *ids);
    uint32_t ntok = chunk_tokens * chunks;
    uint32_t *tokens = malloc(ntok * sizeof *tokens);
    uint8_t(*keys)[KVTIER_KEY_LEN] = malloc(chunks * KVTIER_KEY_LEN);
    H_CHECK(ids && tokens && keys, "malloc");

    /* baseline: one pinned cudaMemcpy of the same bytes each way */
    uint8_t *dbuf = NULL, *hbuf = NULL;
    H_CUDA(cudaMalloc((void **)&dbuf, bytes));
    H_CUDA(cudaMallocHost((void **)&hbuf, bytes));
    memset(hbuf, 1, bytes);
    double d2h[REPS], h2d[REPS];
    for (int r = 0; r < REPS; r++) {
        double t = h_now();
        H_CUDA(cudaMemcpy(hbuf, dbuf, bytes, cudaMemcpyDeviceToHost));
        d2h[r] = (double)bytes / (h_now() - t) / 1e9;
        t = h_now();
        H_CUDA(cudaMemcpy(dbuf, hbuf, bytes, cudaMemcpyHostToDevice));
        h2d[r] = (double)bytes / (h_now() - t) / 1e9;
    }
    double base_d2h = s_median(d2h, REPS), base_h2d = s_median(h2d, REPS);
    cudaFree(dbuf);
    cudaFreeHost(hbuf);

    s_result_t res[4];
    int nres = 0;
    printf("kvt-bench-gpu: %s, %u layers x %u blocks of %zu KiB; %u chunks of %u blocks = "
           "%.0f MiB per request; median of %d\n",
           prop.name, layers, num_blocks, BLOCK_BYTES >> 10, chunks, per,
           (double)bytes / (1 << 20), REPS);
    printf("  baseline pinned cudaMemcpy: D2H %.1f GB/s, H2D %.1f GB/s\n", base_d2h, base_h2d);
    for (int shuffled = 0; shuffled < 2; shuffled++) {
        for (uint32_t i = 0; i < num_blocks; i++)
            ids[i] = i;
        if (shuffled)
            h_shuffle(ids, num_blocks, 1234);
        double st[REPS], rt[REPS];
        for (int r = 0; r < REPS; r++) {
            for (uint32_t i = 0; i < ntok; i++)
                tokens[i] = i + (uint32_t)(shuffled * 1000000 + r * 100000);
            kvtier_hash_tokens_local(tokens, ntok, chunk_tokens, NULL, keys);
            uint32_t stored = 0, found = 0;
            double t = h_now();
            rc = kvtier_store_gpu(c, "bench-gpu", NULL, 0, (const uint8_t(*)[16])keys, chunks,
                                  ids, n, NULL, &stored);
            st[r] = (double)bytes / (h_now() - t) / 1e9;
            H_CHECK(rc == 0 && stored == chunks, "store_gpu: %d %u %s", rc, stored,
                    kvtier_last_error(c));
            t = h_now();
            rc = kvtier_retrieve_gpu(c, "bench-gpu", NULL, 0, (const uint8_t(*)[16])keys,
                                     chunks, ids, n, NULL, &found);
            rt[r] = (double)bytes / (h_now() - t) / 1e9;
            H_CHECK(rc == 0 && found == chunks, "retrieve_gpu: %d %u %s", rc, found,
                    kvtier_last_error(c));
            rc = kvtier_remove(c, "bench-gpu", NULL, (const uint8_t(*)[16])keys, chunks, NULL);
            H_CHECK(rc == 0, "remove: %s", kvtier_last_error(c));
        }
        const char *sn = shuffled ? "store_gpu_shuffled" : "store_gpu_contiguous";
        const char *rn = shuffled ? "retrieve_gpu_shuffled" : "retrieve_gpu_contiguous";
        res[nres++] = (s_result_t){sn, s_median(st, REPS), base_d2h};
        res[nres++] = (s_result_t){rn, s_median(rt, REPS), base_h2d};
    }
    int below = 0;
    for (int i = 0; i < nres; i++) {
        double ratio = res[i].gbps / res[i].base_gbps;
        below += ratio < 0.9;
        printf("  %-24s %6.1f GB/s  %.2fx pinned cudaMemcpy %s\n", res[i].name, res[i].gbps,
               ratio, ratio < 0.9 ? "(below the 0.9x target)" : "");
    }
    if (s_opt.json) {
        FILE *f = fopen(s_opt.json, "w");
        H_CHECK(f, "open %s", s_opt.json);
        fprintf(f, "{\"device\": \"%s\", \"layers\": %u, \"block_bytes\": %zu, "
                   "\"request_bytes\": %zu, \"baseline_d2h_gbps\": %.2f, "
                   "\"baseline_h2d_gbps\": %.2f, \"results\": [",
                prop.name, layers, BLOCK_BYTES, bytes, base_d2h, base_h2d);
        for (int i = 0; i < nres; i++)
            fprintf(f, "%s{\"name\": \"%s\", \"gbps\": %.2f, \"ratio\": %.3f}", i ? ", " : "",
                    res[i].name, res[i].gbps, res[i].gbps / res[i].base_gbps);
        fprintf(f, "]}\n");
        fclose(f);
    }
    kvtier_close(&c);
    for (uint32_t l = 0; l < layers; l++)
        cudaFree(layer[l]);
    free(layer);
    free(handles);
    free(ids);
    free(tokens);
    free(keys);
    /* a benchmark reports; it does not fail on timings */
    return 0;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--daemon") && i + 1 < argc)
            s_opt.daemon = argv[++i];
        else if (!strcmp(argv[i], "--json") && i + 1 < argc)
            s_opt.json = argv[++i];
        else if (!strcmp(argv[i], "--quick"))
            s_opt.quick = true;
        else {
            fprintf(stderr, "usage: kvt-bench-gpu [--daemon PATH] [--quick] [--json FILE]\n");
            return 2;
        }
    }
    char why[256];
    int p = h_probe(why, sizeof why);
    if (p == H_SKIP) {
        printf("bench-gpu: skipped: no CUDA device (%s)\n", why);
        return 0;
    }
    if (p != 0)
        return 1;
    alarm(540);
    if (!h_daemon_start(&s_d, s_opt.daemon, s_opt.quick ? "1G" : "3G"))
        return 1;
    int rc = h_run_child(s_bench, NULL);
    int drc = h_daemon_stop(&s_d);
    if (rc != 0 || drc != 0) {
        fprintf(stderr, "bench-gpu: FAILED (engine %d, kvtierd %d; log %s)\n", rc, drc, s_d.log);
        return 1;
    }
    return 0;
}
