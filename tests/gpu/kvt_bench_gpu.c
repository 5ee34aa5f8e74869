/* make bench-gpu: GPU <-> L1 throughput of STORE_GPU and RETRIEVE_GPU against a plain pinned
 * cudaMemcpy of the same bytes, measured in the same run on the same device.
 *
 *   build/kvt-bench-gpu [--daemon PATH] [--quick] [--modes direct,staged,auto] [--json FILE]
 *
 * A mode may carry a slice size for the staged copies and a wait: staged@8 runs with
 * KVT_GPU_SLICE_BYTES of 8 MiB, auto#spin with KVT_GPU_SYNC=spin.
 *
 * The engine (a child process) allocates a paged KV cache with K and V separate, as vLLM and
 * SGLang keep it: 2 x 80 buffers of 512 blocks x 16 tokens x 2 KiB (8 KV heads of 128 in bf16:
 * 32 KiB blocks, 2.5 GiB). It registers the first 2 x 32 buffers (a 32-layer model), then all
 * 160 (80 layers), with a private kvtierd (L1 3 GiB), and times, from the client's send to the
 * reply, requests of 16, 64 and 256 blocks (1, 4 and 16 chunks of 256 tokens) with two block
 * tables: "contiguous" (ids in order: one copy per buffer and chunk when direct) and "shuffled"
 * (a random permutation: one 32 KiB copy per block and buffer when direct). Each figure is the
 * median of 7 requests (new keys each time, removed after); the baseline is one cudaMemcpy of
 * the request's bytes between a device buffer and a cudaMallocHost buffer, median of 7.
 *
 * Each copy mode (KVT_GPU_COPY of the daemon: direct, staged, auto) runs against its own daemon.
 * With auto (the default mode) also:
 * - latency: one STORE_GPU of one chunk (32 layers, 32 MiB), p50 / p99 of 30, against the p50
 *   of one cudaMemcpy of 32 MiB;
 * - LOOKUP under copies: a CPU client (another process) sends LOOKUPs of 64 keys back to back;
 *   p50 / p99 while the engine idles, then while it stores and retrieves without pause.
 * Targets (docs/performance.md): >= 0.9x the baseline contiguous, >= 0.8x shuffled; LOOKUP p99
 * under copies <= 1.2x idle. A benchmark reports; it does not fail on figures. Without a CUDA
 * device: one "skipped" line, exit 0. */
#include "gpu_harness.h"

#include <math.h>
#include <stdatomic.h>
#include <sys/mman.h>

#define BLOCK_TOKENS 16
#define SIDE_BYTES 2048 /* one token of K (or of V) in one layer */
#define BLOCK_BYTES ((size_t)BLOCK_TOKENS * SIDE_BYTES)
#define NUM_BLOCKS 512
#define MAX_LAYERS 80
#define REPS 7
#define LAT_REPS 30
#define MAX_SAMPLES (1u << 21)
#define MAX_RES 128
#define PROBE_KEYS 64

static struct {
    const char *daemon;
    const char *json;
    const char *modes;
    bool quick;
} s_opt = {"build/kvtierd", NULL, "direct,staged,auto", false};

static h_daemon_t s_d;

typedef struct {
    char mode[16];
    uint32_t layers, blocks;
    bool shuffled;
    double store, retrieve, base_d2h, base_h2d; /* GB/s */
} s_res_t;

/* Shared by the parent, the engine and the LOOKUP prober (MAP_SHARED before the forks). */
/* The latency and LOOKUP figures of one auto mode. */
typedef struct {
    char label[16];
    int prober_fastpath;
    double idle_t0, idle_t1, busy_t0, busy_t1; /* CLOCK_MONOTONIC windows, from the engine */
    double dma_t0, dma_t1;                     /* plain cudaMemcpy loop, no kvtier */
    double split_us[4];                        /* 32 MiB D2H as 1, 4, 8, 32 copies */
    double lat_p50, lat_p99, lat_base_p50;    /* seconds */
    double lat_zero_p50, lat_ping_p50;
    uint64_t lat_bytes;
    /* LOOKUP p50 / p99 idle, while copying, while the engine copies without kvtier */
    double i50, i99, b50, b99, d50, d99;
    uint32_t ni, nb, nd;
} s_extra_t;

#define MAX_EXTRA 8

typedef struct {
    char device[256];
    _Atomic int prober_ready, prober_stop, probing; /* probing: the engine's windows are open */
    uint32_t nextra;
    s_extra_t extra[MAX_EXTRA];
    uint32_t nres;
    s_res_t res[MAX_RES];
    _Atomic uint32_t nsamples;
    struct {
        double t, lat;
    } samples[MAX_SAMPLES];
} s_shared_t;

static s_shared_t *s_sh;
static s_extra_t *s_x; /* this mode's, when it is an auto mode */
static const char *s_mode;  /* KVT_GPU_COPY */
static char s_label[16];   /* as given: mode[@slice MiB] */

static int s_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The q-quantile (0..1) of v[0..n), sorting v. */
static double s_quantile(double *v, uint32_t n, double q)
{
    if (n == 0)
        return NAN;
    qsort(v, n, sizeof *v, s_cmp);
    uint32_t i = (uint32_t)(q * (n - 1) + 0.5);
    return v[i];
}

/* ---- the LOOKUP prober: a CPU client, no CUDA ---- */

static int s_prober(void *arg)
{
    (void)arg;
    kvtier_t *c = h_connect(&s_d, "lookup-prober", 30000);
    H_CHECK(c, "prober: connect");
    uint32_t tokens[PROBE_KEYS * 16];
    for (uint32_t i = 0; i < PROBE_KEYS * 16; i++)
        tokens[i] = i * 31 + 7;
    uint8_t keys[PROBE_KEYS][KVTIER_KEY_LEN];
    H_CHECK(kvtier_hash_tokens_local(tokens, PROBE_KEYS * 16, 16, NULL, keys) == PROBE_KEYS,
            "prober: hash");
    static uint8_t obj[4096];
    const void *data[PROBE_KEYS];
    size_t lens[PROBE_KEYS];
    for (int i = 0; i < PROBE_KEYS; i++)
        data[i] = obj, lens[i] = sizeof obj;
    uint32_t stored = 0;
    int rc = kvtier_put(c, "probe", NULL, (const uint8_t(*)[16])keys, PROBE_KEYS, data, lens,
                        &stored);
    H_CHECK(rc == 0 && stored == PROBE_KEYS, "prober: put: %d %u", rc, stored);
    s_x->prober_fastpath = kvtier_fastpath_active(c);
    s_sh->prober_ready = 1;
    while (!s_sh->prober_stop) {
        uint32_t hits = 0;
        double t = h_now();
        rc = kvtier_lookup(c, "probe", NULL, (const uint8_t(*)[16])keys, PROBE_KEYS, 0, &hits,
                           NULL, NULL, NULL);
        double lat = h_now() - t;
        H_CHECK(rc == 0 && hits == PROBE_KEYS, "prober: lookup: %d %u", rc, hits);
        if (!s_sh->probing)
            continue;
        uint32_t i = atomic_fetch_add(&s_sh->nsamples, 1);
        if (i >= MAX_SAMPLES)
            break;
        s_sh->samples[i].t = t;
        s_sh->samples[i].lat = lat;
    }
    kvtier_close(&c);
    return 0;
}

/* LOOKUP latencies that started in [t0, t1): p50 and p99 in *p50, *p99; returns the count. */
static uint32_t s_window(double t0, double t1, double *p50, double *p99)
{
    uint32_t n = atomic_load(&s_sh->nsamples), m = 0;
    if (n > MAX_SAMPLES)
        n = MAX_SAMPLES;
    double *v = malloc((n ? n : 1) * sizeof *v);
    H_CHECK(v, "malloc");
    for (uint32_t i = 0; i < n; i++)
        if (s_sh->samples[i].t >= t0 && s_sh->samples[i].t < t1)
            v[m++] = s_sh->samples[i].lat;
    *p99 = s_quantile(v, m, 0.99);
    *p50 = s_quantile(v, m, 0.50);
    free(v);
    return m;
}

/* ---- the engine ---- */

typedef struct {
    kvtier_t *c;
    uint8_t **buf;   /* 2 x MAX_LAYERS buffers: K0, V0, K1, V1, ... */
    uint8_t (*handles)[KVTIER_IPC_HANDLE_LEN];
    uint32_t chunk_tokens, per;
    uint64_t ids[NUM_BLOCKS];
    uint8_t *dbuf, *hbuf; /* the baseline's buffers */
    uint32_t seq;         /* key generation: every request gets new keys */
} s_engine_t;

static void s_keys(s_engine_t *e, uint32_t chunks, uint8_t (*keys)[KVTIER_KEY_LEN])
{
    uint32_t ntok = e->chunk_tokens * chunks;
    uint32_t *tokens = malloc(ntok * sizeof *tokens);
    H_CHECK(tokens, "malloc");
    e->seq++;
    for (uint32_t i = 0; i < ntok; i++)
        tokens[i] = i + e->seq * 1000003u;
    kvtier_hash_tokens_local(tokens, ntok, e->chunk_tokens, NULL, keys);
    free(tokens);
}

static void s_register(s_engine_t *e, uint32_t layers)
{
    kvtier_gpu_layout_t lay = {.device = 0, .layers = 2 * layers, .num_blocks = NUM_BLOCKS,
                               .block_tokens = BLOCK_TOKENS, .token_bytes = SIDE_BYTES,
                               .dtype = "bfloat16",
                               .handles = (const uint8_t(*)[KVTIER_IPC_HANDLE_LEN])e->handles};
    int rc = kvtier_register_gpu(e->c, &lay);
    H_CHECK(rc == 0, "register_gpu (%u layers): %s", layers, kvtier_last_error(e->c));
}

/* One STORE_GPU then RETRIEVE_GPU of `chunks` new keys from ids; GB/s of each (or seconds
 * with `secs`), then REMOVE. */
static void s_round(s_engine_t *e, uint32_t chunks, uint64_t bytes, double *st, double *rt,
                    bool secs)
{
    uint8_t(*keys)[KVTIER_KEY_LEN] = malloc((size_t)chunks * KVTIER_KEY_LEN);
    H_CHECK(keys, "malloc");
    s_keys(e, chunks, keys);
    uint32_t n = e->per * chunks, stored = 0, found = 0;
    double t = h_now();
    int rc = kvtier_store_gpu(e->c, "bench-gpu", NULL, 0, (const uint8_t(*)[16])keys, chunks,
                              e->ids, n, NULL, &stored);
    double ds = h_now() - t;
    H_CHECK(rc == 0 && stored == chunks, "store_gpu: %d %u %s", rc, stored,
            kvtier_last_error(e->c));
    double dr = 0;
    if (rt) {
        t = h_now();
        rc = kvtier_retrieve_gpu(e->c, "bench-gpu", NULL, 0, (const uint8_t(*)[16])keys, chunks,
                                 e->ids, n, NULL, &found);
        dr = h_now() - t;
        H_CHECK(rc == 0 && found == chunks, "retrieve_gpu: %d %u %s", rc, found,
                kvtier_last_error(e->c));
    }
    rc = kvtier_remove(e->c, "bench-gpu", NULL, (const uint8_t(*)[16])keys, chunks, NULL);
    H_CHECK(rc == 0, "remove: %s", kvtier_last_error(e->c));
    *st = secs ? ds : (double)bytes / ds / 1e9;
    if (rt)
        *rt = secs ? dr : (double)bytes / dr / 1e9;
    free(keys);
}

static void s_baseline(s_engine_t *e, uint64_t bytes, double *d2h, double *h2d)
{
    double a[REPS], b[REPS];
    for (int r = 0; r < REPS; r++) {
        double t = h_now();
        H_CUDA(cudaMemcpy(e->hbuf, e->dbuf, bytes, cudaMemcpyDeviceToHost));
        a[r] = (double)bytes / (h_now() - t) / 1e9;
        t = h_now();
        H_CUDA(cudaMemcpy(e->dbuf, e->hbuf, bytes, cudaMemcpyHostToDevice));
        b[r] = (double)bytes / (h_now() - t) / 1e9;
    }
    *d2h = s_quantile(a, REPS, 0.5);
    *h2d = s_quantile(b, REPS, 0.5);
}

static void s_order(s_engine_t *e, bool shuffled)
{
    for (uint32_t i = 0; i < NUM_BLOCKS; i++)
        e->ids[i] = i;
    if (shuffled)
        h_shuffle(e->ids, NUM_BLOCKS, 1234);
}

/* Latency of one chunk, then LOOKUP while idle and while copying (auto only). */
static void s_auto_extras(s_engine_t *e)
{
    s_order(e, true);
    uint64_t bytes = (uint64_t)e->per * 2 * 32 * BLOCK_BYTES;
    double lat[LAT_REPS], base[LAT_REPS];
    for (int r = 0; r < LAT_REPS; r++)
        s_round(e, 1, bytes, &lat[r], NULL, true);
    for (int r = 0; r < LAT_REPS; r++) {
        double t = h_now();
        H_CUDA(cudaMemcpy(e->hbuf, e->dbuf, bytes, cudaMemcpyDeviceToHost));
        base[r] = h_now() - t;
    }
    /* the request path alone: a STORE_GPU of no keys (to a worker and back), and a PING */
    double zero[LAT_REPS], ping[LAT_REPS];
    for (int r = 0; r < LAT_REPS; r++) {
        uint32_t stored = 0;
        double t = h_now();
        int rc = kvtier_store_gpu(e->c, "bench-gpu", NULL, 0, NULL, 0, e->ids, 0, NULL, &stored);
        zero[r] = rc == 0 ? h_now() - t : NAN;
        t = h_now();
        rc = kvtier_ping(e->c);
        ping[r] = rc == 0 ? h_now() - t : NAN;
    }
    s_x->lat_zero_p50 = s_quantile(zero, LAT_REPS, 0.5);
    s_x->lat_ping_p50 = s_quantile(ping, LAT_REPS, 0.5);
    s_x->lat_bytes = bytes;
    s_x->lat_p99 = s_quantile(lat, LAT_REPS, 0.99);
    s_x->lat_p50 = s_quantile(lat, LAT_REPS, 0.5);
    s_x->lat_base_p50 = s_quantile(base, LAT_REPS, 0.5);
    /* LOOKUP windows: the prober runs throughout */
    for (int i = 0; i < 1000 && !s_sh->prober_ready; i++)
        usleep(10000);
    H_CHECK(s_sh->prober_ready, "the LOOKUP prober did not start");
    double win = s_opt.quick ? 0.5 : 1.5;
    s_sh->probing = 1;
    s_x->idle_t0 = h_now();
    usleep((useconds_t)(win * 1e6));
    s_x->idle_t1 = h_now();
    s_x->busy_t0 = h_now();
    while (h_now() < s_x->busy_t0 + win) {
        double st, rt;
        s_round(e, 4, 0, &st, &rt, true);
    }
    s_x->busy_t1 = h_now();
    /* control: the same memory traffic without kvtier (the engine's own pinned copies) */
    s_x->dma_t0 = h_now();
    while (h_now() < s_x->dma_t0 + win) {
        H_CUDA(cudaMemcpy(e->hbuf, e->dbuf, 128u << 20, cudaMemcpyDeviceToHost));
        H_CUDA(cudaMemcpy(e->dbuf, e->hbuf, 128u << 20, cudaMemcpyHostToDevice));
    }
    s_x->dma_t1 = h_now();
    s_sh->probing = 0;
    /* what slicing costs the copy engine: 32 MiB D2H in 1, 4, 8 and 32 async copies */
    static const int parts[4] = {1, 4, 8, 32};
    cudaStream_t st;
    H_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (int p = 0; p < 4; p++) {
        double v[LAT_REPS];
        size_t part = (32u << 20) / parts[p];
        for (int r = 0; r < LAT_REPS; r++) {
            double t = h_now();
            for (int q = 0; q < parts[p]; q++)
                H_CUDA(cudaMemcpyAsync(e->hbuf + q * part, e->dbuf + q * part, part,
                                       cudaMemcpyDeviceToHost, st));
            H_CUDA(cudaStreamSynchronize(st));
            v[r] = h_now() - t;
        }
        s_x->split_us[p] = s_quantile(v, LAT_REPS, 0.5) * 1e6;
    }
    cudaStreamDestroy(st);
}

static int s_bench(void *arg)
{
    (void)arg;
    H_CUDA(cudaSetDevice(0));
    struct cudaDeviceProp prop;
    H_CUDA(cudaGetDeviceProperties(&prop, 0));
    snprintf(s_sh->device, sizeof s_sh->device, "%s", prop.name);
    s_engine_t e = {0};
    uint32_t nbuf = 2 * MAX_LAYERS;
    size_t buf_bytes = (size_t)NUM_BLOCKS * BLOCK_BYTES;
    e.buf = calloc(nbuf, sizeof *e.buf);
    e.handles = calloc(nbuf, KVTIER_IPC_HANDLE_LEN);
    H_CHECK(e.buf && e.handles, "calloc");
    for (uint32_t i = 0; i < nbuf; i++) {
        H_CUDA(cudaMalloc((void **)&e.buf[i], buf_bytes));
        H_CUDA(cudaMemset(e.buf[i], (int)i + 1, buf_bytes));
        cudaIpcMemHandle_t h;
        H_CUDA(cudaIpcGetMemHandle(&h, e.buf[i]));
        memcpy(e.handles[i], &h, sizeof h);
    }
    uint64_t max_bytes = (uint64_t)256 * nbuf * BLOCK_BYTES;
    H_CUDA(cudaMalloc((void **)&e.dbuf, max_bytes));
    H_CUDA(cudaMallocHost((void **)&e.hbuf, max_bytes));
    memset(e.hbuf, 1, max_bytes);
    H_CUDA(cudaDeviceSynchronize());
    e.c = h_connect(&s_d, "engine-bench", 60000);
    H_CHECK(e.c, "connect");
    e.chunk_tokens = kvtier_info(e.c)->chunk_tokens;
    e.per = e.chunk_tokens / BLOCK_TOKENS;
    H_CHECK(e.per && 256 % e.per == 0, "chunk_tokens %u", e.chunk_tokens);

    static const uint32_t layer_sets[] = {32, 80}, block_sets[] = {16, 64, 256};
    uint32_t nl = s_opt.quick ? 1 : 2, nb = s_opt.quick ? 2 : 3;
    for (uint32_t li = 0; li < nl; li++) {
        uint32_t layers = layer_sets[li];
        s_register(&e, layers);
        for (uint32_t bi = 0; bi < nb; bi++) {
            uint32_t blocks = block_sets[bi], chunks = blocks / e.per;
            uint64_t bytes = (uint64_t)blocks * 2 * layers * BLOCK_BYTES;
            double d2h, h2d;
            s_baseline(&e, bytes, &d2h, &h2d);
            for (int sh = 0; sh < 2; sh++) {
                s_order(&e, sh);
                double st[REPS], rt[REPS];
                for (int r = 0; r < REPS; r++)
                    s_round(&e, chunks, bytes, &st[r], &rt[r], false);
                H_CHECK(s_sh->nres < MAX_RES, "too many results");
                s_res_t *res = &s_sh->res[s_sh->nres++];
                snprintf(res->mode, sizeof res->mode, "%s", s_label);
                res->layers = layers;
                res->blocks = blocks;
                res->shuffled = sh;
                res->store = s_quantile(st, REPS, 0.5);
                res->retrieve = s_quantile(rt, REPS, 0.5);
                res->base_d2h = d2h;
                res->base_h2d = h2d;
            }
        }
        if (layers == 32 && s_x)
            s_auto_extras(&e);
        int rc = kvtier_unregister_gpu(e.c, 0);
        H_CHECK(rc == 0, "unregister_gpu: %s", kvtier_last_error(e.c));
    }
    kvtier_close(&e.c);
    for (uint32_t i = 0; i < nbuf; i++)
        cudaFree(e.buf[i]);
    cudaFree(e.dbuf);
    cudaFreeHost(e.hbuf);
    free(e.buf);
    free(e.handles);
    return 0;
}

/* ---- report ---- */

static void s_report(void)
{
    printf("kvt-bench-gpu: %s; K and V separate, blocks of 16 tokens x 2 KiB (32 KiB); "
           "median of %d; x = / pinned cudaMemcpy of the same bytes\n", s_sh->device, REPS);
    printf("  %-9s %6s %6s %8s %-10s  %-16s %-16s %s\n", "mode", "layers", "blocks", "MiB",
           "order", "store GB/s (x)", "retrieve GB/s (x)", "baseline D2H/H2D GB/s");
    for (uint32_t i = 0; i < s_sh->nres; i++) {
        const s_res_t *r = &s_sh->res[i];
        double mib = (double)r->blocks * 2 * r->layers * BLOCK_BYTES / (1 << 20);
        printf("  %-9s %6u %6u %8.0f %-10s  %5.1f (%.2fx)    %5.1f (%.2fx)     %.1f / %.1f\n",
               r->mode, r->layers, r->blocks, mib, r->shuffled ? "shuffled" : "contiguous",
               r->store, r->store / r->base_d2h, r->retrieve, r->retrieve / r->base_h2d,
               r->base_d2h, r->base_h2d);
    }
    for (uint32_t k = 0; k < s_sh->nextra; k++) {
        const s_extra_t *x = &s_sh->extra[k];
        printf("  [%s] one STORE_GPU of one chunk (%.0f MiB, 64 buffers, shuffled): p50 %.0f us, "
               "p99 %.0f us; cudaMemcpy D2H of the same bytes p50 %.0f us (%.2fx)\n", x->label,
               (double)x->lat_bytes / (1 << 20), x->lat_p50 * 1e6, x->lat_p99 * 1e6,
               x->lat_base_p50 * 1e6, x->lat_p50 / x->lat_base_p50);
        printf("  [%s] the request path: STORE_GPU of no keys p50 %.1f us, PING p50 %.1f us\n",
               x->label, x->lat_zero_p50 * 1e6, x->lat_ping_p50 * 1e6);
        printf("  [%s] 32 MiB D2H (cudaMemcpyAsync, one stream) as 1 / 4 / 8 / 32 copies: p50 "
               "%.0f / %.0f / %.0f / %.0f us\n", x->label, x->split_us[0], x->split_us[1],
               x->split_us[2], x->split_us[3]);
        printf("  [%s] LOOKUP of %d keys (%s, another process): idle p50 %.1f us p99 %.1f us "
               "(%u); while copying p50 %.1f us p99 %.1f us (%u): p99 %.2fx idle; while the "
               "engine runs plain cudaMemcpy (no kvtier): p50 %.1f us p99 %.1f us (%u): p99 "
               "%.2fx idle\n", x->label, PROBE_KEYS, x->prober_fastpath ? "fast path" : "socket",
               x->i50 * 1e6, x->i99 * 1e6, x->ni, x->b50 * 1e6, x->b99 * 1e6, x->nb,
               x->b99 / x->i99, x->d50 * 1e6, x->d99 * 1e6, x->nd, x->d99 / x->i99);
    }
    if (!s_opt.json)
        return;
    FILE *f = fopen(s_opt.json, "w");
    H_CHECK(f, "open %s", s_opt.json);
    fprintf(f, "{\"device\": \"%s\", \"block_bytes\": %zu, \"results\": [", s_sh->device,
            BLOCK_BYTES);
    for (uint32_t i = 0; i < s_sh->nres; i++) {
        const s_res_t *r = &s_sh->res[i];
        fprintf(f, "%s{\"mode\": \"%s\", \"layers\": %u, \"blocks\": %u, \"order\": \"%s\", "
                   "\"store_gbps\": %.2f, \"retrieve_gbps\": %.2f, \"base_d2h_gbps\": %.2f, "
                   "\"base_h2d_gbps\": %.2f}", i ? ", " : "", r->mode, r->layers, r->blocks,
                r->shuffled ? "shuffled" : "contiguous", r->store, r->retrieve, r->base_d2h,
                r->base_h2d);
    }
    fprintf(f, "], \"extras\": [");
    for (uint32_t k = 0; k < s_sh->nextra; k++) {
        const s_extra_t *x = &s_sh->extra[k];
        const struct {
            const char *name;
            double v;
        } kv[] = {
            {"store_latency_bytes", (double)x->lat_bytes}, {"store_p50_us", x->lat_p50 * 1e6},
            {"store_p99_us", x->lat_p99 * 1e6}, {"memcpy_p50_us", x->lat_base_p50 * 1e6},
            {"no_keys_p50_us", x->lat_zero_p50 * 1e6}, {"ping_p50_us", x->lat_ping_p50 * 1e6},
            {"split_32mib_1_us", x->split_us[0]}, {"split_32mib_4_us", x->split_us[1]},
            {"split_32mib_8_us", x->split_us[2]}, {"split_32mib_32_us", x->split_us[3]},
            {"lookup_fastpath", x->prober_fastpath}, {"lookup_idle_p50_us", x->i50 * 1e6},
            {"lookup_idle_p99_us", x->i99 * 1e6}, {"lookup_busy_p50_us", x->b50 * 1e6},
            {"lookup_busy_p99_us", x->b99 * 1e6}, {"lookup_dma_p50_us", x->d50 * 1e6},
            {"lookup_dma_p99_us", x->d99 * 1e6}, {"lookup_idle_n", x->ni},
            {"lookup_busy_n", x->nb}, {"lookup_dma_n", x->nd},
        };
        fprintf(f, "%s{\"mode\": \"%s\"", k ? ", " : "", x->label);
        for (size_t j = 0; j < sizeof kv / sizeof kv[0]; j++) {
            if (isnan(kv[j].v)) /* no samples: JSON has no NaN */
                fprintf(f, ", \"%s\": null", kv[j].name);
            else
                fprintf(f, ", \"%s\": %.2f", kv[j].name, kv[j].v);
        }
        fprintf(f, "}");
    }
    fprintf(f, "]");
    fprintf(f, "}\n");
    fclose(f);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--daemon") && i + 1 < argc)
            s_opt.daemon = argv[++i];
        else if (!strcmp(argv[i], "--json") && i + 1 < argc)
            s_opt.json = argv[++i];
        else if (!strcmp(argv[i], "--modes") && i + 1 < argc)
            s_opt.modes = argv[++i];
        else if (!strcmp(argv[i], "--quick"))
            s_opt.quick = true;
        else {
            fprintf(stderr, "usage: kvt-bench-gpu [--daemon PATH] [--quick] "
                            "[--modes direct,staged,auto] [--json FILE]\n");
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
    s_sh = mmap(NULL, sizeof *s_sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (s_sh == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    alarm(540);
    char modes[256];
    snprintf(modes, sizeof modes, "%s", s_opt.modes);
    for (char *save = NULL, *m = strtok_r(modes, ",", &save); m; m = strtok_r(NULL, ",", &save)) {
        snprintf(s_label, sizeof s_label, "%s", m);
        char *hash = strchr(m, '#'); /* mode#sync: that KVT_GPU_SYNC */
        if (hash) {
            *hash++ = '\0';
            setenv("KVT_GPU_SYNC", hash, 1);
        } else {
            unsetenv("KVT_GPU_SYNC");
        }
        char *at = strchr(m, '@'); /* mode@MiB: that KVT_GPU_SLICE_BYTES */
        if (at) {
            *at++ = '\0';
            char sl[32];
            snprintf(sl, sizeof sl, "%llu", strtoull(at, NULL, 10) << 20);
            setenv("KVT_GPU_SLICE_BYTES", sl, 1);
        } else {
            unsetenv("KVT_GPU_SLICE_BYTES");
        }
        if (strcmp(m, "direct") && strcmp(m, "staged") && strcmp(m, "auto")) {
            fprintf(stderr, "bench-gpu: mode %s is not direct, staged or auto\n", m);
            return 2;
        }
        s_mode = m;
        if (!h_daemon_start(&s_d, s_opt.daemon, s_opt.quick ? "1G" : "3G", m))
            return 1;
        bool probe = !strcmp(m, "auto") && s_sh->nextra < MAX_EXTRA;
        pid_t prober = 0;
        s_x = NULL;
        if (probe) {
            s_x = &s_sh->extra[s_sh->nextra++];
            snprintf(s_x->label, sizeof s_x->label, "%s", s_label);
            s_sh->prober_ready = 0;
            s_sh->prober_stop = 0;
            s_sh->nsamples = 0;
            prober = h_spawn(s_prober, NULL);
        }
        int rc = h_run_child(s_bench, NULL);
        int prc = 0;
        if (probe) {
            s_sh->prober_stop = 1;
            prc = h_wait(prober);
            s_x->ni = s_window(s_x->idle_t0, s_x->idle_t1, &s_x->i50, &s_x->i99);
            s_x->nb = s_window(s_x->busy_t0, s_x->busy_t1, &s_x->b50, &s_x->b99);
            s_x->nd = s_window(s_x->dma_t0, s_x->dma_t1, &s_x->d50, &s_x->d99);
        }
        bool kernel = h_log_has(&s_d, "staged and direct copies");
        int drc = h_daemon_stop(&s_d);
        if (rc != 0 || drc != 0 || prc != 0) {
            fprintf(stderr, "bench-gpu: FAILED (%s: engine %d, prober %d, kvtierd %d; log %s)\n",
                    m, rc, prc, drc, s_d.log);
            return 1;
        }
        if (!strcmp(m, "staged") && !kernel)
            fprintf(stderr, "bench-gpu: the copy kernel did not load: 'staged' ran direct\n");
    }
    s_report();
    return 0;
}
