/* kvt-bench-l1: microbenchmark of the L1 tier's allocator and index, in process (no sockets,
 * no daemon): allocator get/put with mixed sizes (1 and 2 threads), LOOKUP of 64-key prefixes
 * with 10k / 100k / 1M objects present, RESERVE+COMMIT and ACQUIRE+RELEASE rates, and the
 * resident memory each object costs (index + allocator + namespace bookkeeping; the arena
 * itself is pre-faulted at creation and so is not part of the difference).
 *
 *   build/kvt-bench-l1 [--quick] [--json FILE]
 *
 * --quick is a smoke run (< 5 s, 10k / 100k objects). The full run stays under a minute on the
 * 2-core development machine; it maps a 4 GiB + 64 MiB arena in /dev/shm. */
#include "kvt_alloc.h"
#include "kvt_config.h"
#include "kvt_error.h"
#include "kvt_l1.h"
#include "kvt_log.h"

#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define KEYS_PER_LOOKUP 64
#define OBJ_SIZE 4096u


typedef struct {
    bool quick;
    const char *json_path;
    uint64_t alloc_iters;
    uint32_t stages[3];
    int nstages;
    uint32_t lookups_per_stage;
    uint32_t rc_ops;
    uint32_t acq_ops;
    const char *l1_size;
} opts_t;

static json_t *s_out;

static double s_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t s_mix(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static uint64_t s_rand(uint64_t *s)
{
    *s = s_mix(*s);
    return *s;
}

/* 128-bit chunk-hash-like keys: uniformly random bits, distinct per id. */
static void s_key(kvt_key_t *key, uint64_t id, uint64_t tag)
{
    uint8_t *k = key->b;
    uint64_t a = s_mix(id ^ (tag << 56)), b = s_mix(a ^ id);
    memcpy(k, &a, 8);
    memcpy(k + 8, &b, 8);
}

/* Resident and shared pages (/proc/self/statm fields 2 and 3), in bytes. */
static void s_statm(uint64_t *resident, uint64_t *shared)
{
    unsigned long size = 0, res = 0, shr = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
        if (fscanf(f, "%lu %lu %lu", &size, &res, &shr) != 3)
            res = shr = 0;
        fclose(f);
    }
    long pg = sysconf(_SC_PAGESIZE);
    *resident = (uint64_t)res * (uint64_t)pg;
    *shared = (uint64_t)shr * (uint64_t)pg;
}

static void s_cpu_model(char *out, size_t len)
{
    snprintf(out, len, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[256];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) == 0) {
            char *p = strchr(line, ':');
            if (p) {
                p++;
                while (*p == ' ')
                    p++;
                p[strcspn(p, "\n")] = '\0';
                snprintf(out, len, "%s", p);
            }
            break;
        }
    }
    fclose(f);
}

static void s_row(const char *what, double value, const char *unit, const char *note)
{
    printf("  %-46s %12.2f %-8s %s\n", what, value, unit, note ? note : "");
}

/* ---- allocator ------------------------------------------------------------------------- */

/* log-uniform 4 KiB .. 8 MiB: as many 4-8 KiB requests as 4-8 MiB ones */
static uint64_t s_alloc_size(uint64_t *seed)
{
    unsigned bits = 12 + (unsigned)(s_rand(seed) % 12); /* 2^12 .. 2^23 */
    uint64_t lo = 1ull << bits;
    return lo + s_rand(seed) % lo;
}

typedef struct {
    kvt_alloc_t *a;
    uint64_t iters;
    uint64_t seed;
    uint64_t gets, puts, nulls;
    double secs;
} alloc_job_t;

#define ALLOC_LIVE 256 /* live blocks per thread; ~50 % of the arena on average */

static void *s_alloc_job(void *arg)
{
    alloc_job_t *j = arg;
    kvt_block_t *live[ALLOC_LIVE] = {0};
    uint64_t *sizes = malloc(4096 * sizeof *sizes); /* pre-drawn, so the RNG is not timed */
    for (int i = 0; i < 4096; i++)
        sizes[i] = s_alloc_size(&j->seed);
    uint32_t *slots = malloc(4096 * sizeof *slots);
    for (int i = 0; i < 4096; i++)
        slots[i] = (uint32_t)(s_rand(&j->seed) % ALLOC_LIVE);
    for (int i = 0; i < ALLOC_LIVE; i++) /* warm: fill the ring */
        live[i] = kvt_alloc_get(j->a, sizes[i]);
    double t0 = s_now();
    for (uint64_t it = 0; it < j->iters; it++) {
        uint32_t s = slots[it & 4095];
        if (live[s]) {
            kvt_alloc_put(j->a, live[s]);
            j->puts++;
        }
        live[s] = kvt_alloc_get(j->a, sizes[(it * 7) & 4095]);
        j->gets++;
        j->nulls += live[s] == NULL;
    }
    j->secs = s_now() - t0;
    for (int i = 0; i < ALLOC_LIVE; i++)
        if (live[i])
            kvt_alloc_put(j->a, live[i]);
    free(sizes);
    free(slots);
    return NULL;
}

static void s_bench_alloc(const opts_t *o)
{
    printf("allocator (kvt_alloc, TLSF over 4 KiB pages), sizes log-uniform 4 KiB .. 8 MiB\n");
    json_t *arr = json_array();
    for (int nthreads = 1; nthreads <= 2; nthreads++) {
        uint64_t cap = (uint64_t)nthreads << 30; /* 1 GiB per thread */
        kvt_alloc_t *a = kvt_alloc_new(cap);
        alloc_job_t jobs[2];
        pthread_t th[2];
        for (int i = 0; i < nthreads; i++) {
            jobs[i] = (alloc_job_t){.a = a, .iters = o->alloc_iters, .seed = 17 + (uint64_t)i};
            pthread_create(&th[i], NULL, s_alloc_job, &jobs[i]);
        }
        uint64_t ops = 0, nulls = 0, gets = 0;
        double secs = 0;
        for (int i = 0; i < nthreads; i++) {
            pthread_join(th[i], NULL);
            ops += jobs[i].gets + jobs[i].puts;
            gets += jobs[i].gets;
            nulls += jobs[i].nulls;
            if (jobs[i].secs > secs)
                secs = jobs[i].secs;
        }
        kvt_alloc_stats_t st;
        kvt_alloc_stats(a, &st);
        if (kvt_alloc_check(a) != 0 || st.used != 0)
            fprintf(stderr, "kvt-bench-l1: allocator inconsistent after the run\n");
        kvt_alloc_destroy(&a);
        double rate = (double)ops / secs;
        char what[64], note[96];
        snprintf(what, sizeof what, "alloc get/put, %d thread%s", nthreads,
                 nthreads > 1 ? "s" : "");
        snprintf(note, sizeof note, "(%.0f ns/op, %.1f %% of gets NULL)", 1e9 / rate * nthreads,
                 100.0 * (double)nulls / (double)gets);
        s_row(what, rate / 1e6, "Mops/s", note);
        json_array_append_new(arr, json_pack("{s:i,s:I,s:f,s:f,s:f}", "threads", nthreads, "ops",
                                             (json_int_t)ops, "seconds", secs, "ops_per_s", rate,
                                             "null_fraction", (double)nulls / (double)gets));
    }
    json_object_set_new(s_out, "alloc", arr);
}

/* ---- L1 -------------------------------------------------------------------------------- */

typedef struct {
    kvt_l1_t *l1;
    kvt_ns_t ns;
    kvt_key_t *keys; /* keys[i] = object i */
    uint32_t stored;
} l1_ctx_t;

/* Stores objects [c->stored, upto) in RESERVE batches of 64 and COMMITs them (no data copy:
 * this measures the tier, not memcpy). Returns seconds. */
static double s_fill(l1_ctx_t *c, uint32_t upto, uint32_t batch)
{
    kvt_slot_t slots[KEYS_PER_LOOKUP];
    char err[KVT_ERR_LEN];
    double t0 = s_now();
    while (c->stored < upto) {
        uint32_t n = upto - c->stored < batch ? upto - c->stored : batch, ns = 0, st = 0;
        uint64_t lease = 0;
        int rc = kvt_l1_reserve(c->l1, 1, &c->ns, &c->keys[c->stored], n, NULL,
                                OBJ_SIZE, slots, &ns, &lease, err, sizeof err);
        if (rc || ns != n || !lease) {
            fprintf(stderr, "kvt-bench-l1: reserve failed at %u: %s (%s)\n", c->stored,
                    kvt_err_name(rc), err);
            exit(1);
        }
        rc = kvt_l1_commit(c->l1, 1, lease, NULL, 0, &st, err, sizeof err);
        if (rc || st != n) {
            fprintf(stderr, "kvt-bench-l1: commit failed: %s\n", kvt_err_name(rc));
            exit(1);
        }
        c->stored += n;
    }
    return s_now() - t0;
}

static void s_bench_lookup(l1_ctx_t *c, uint32_t nlookups, json_t *arr)
{
    uint64_t seed = 99 + c->stored;
    uint32_t *starts = malloc(nlookups * sizeof *starts);
    for (uint32_t i = 0; i < nlookups; i++)
        starts[i] = (uint32_t)(s_rand(&seed) % (c->stored - KEYS_PER_LOOKUP + 1));
    uint64_t probes = 0;
    double t0 = s_now();
    for (uint32_t i = 0; i < nlookups; i++) {
        uint32_t hits = 0;
        uint64_t lease = 0;
        kvt_l1_lookup(c->l1, 0, &c->ns, &c->keys[starts[i]], KEYS_PER_LOOKUP,
                      false, &hits, &lease);
        if (hits != KEYS_PER_LOOKUP) {
            fprintf(stderr, "kvt-bench-l1: lookup found %u of 64\n", hits);
            exit(1);
        }
        probes += hits;
    }
    double hit_s = s_now() - t0;
    /* a miss on the first key: one probe per LOOKUP */
    kvt_key_t absent[1];
    double t1 = s_now();
    for (uint32_t i = 0; i < nlookups; i++) {
        s_key(&absent[0], c->stored + 1000000000ull + i, 7);
        uint32_t hits = 0;
        uint64_t lease = 0;
        kvt_l1_lookup(c->l1, 0, &c->ns, absent, 1, false, &hits, &lease);
        if (hits) {
            fprintf(stderr, "kvt-bench-l1: absent key found\n");
            exit(1);
        }
    }
    double miss_s = s_now() - t1;
    free(starts);
    double ns_key = hit_s * 1e9 / (double)probes;
    double us_lookup = hit_s * 1e6 / nlookups;
    double ns_miss = miss_s * 1e9 / nlookups;
    char what[64], note[96];
    snprintf(what, sizeof what, "LOOKUP 64-key prefix, %u objects", c->stored);
    snprintf(note, sizeof note, "(%.2f us per LOOKUP; absent key %.0f ns)", us_lookup, ns_miss);
    s_row(what, ns_key, "ns/key", note);
    json_array_append_new(arr, json_pack("{s:i,s:i,s:f,s:f,s:f}", "objects", c->stored, "lookups",
                                         nlookups, "ns_per_key", ns_key, "us_per_lookup", us_lookup,
                                         "ns_per_absent_lookup", ns_miss));
}

static void s_bench_l1(const opts_t *o)
{
    char err[KVT_ERR_LEN] = "";
    kvt_config_t *cfg = kvt_config_new();
    if (kvt_config_set(cfg, "l1_size", o->l1_size, false, err, sizeof err) ||
        kvt_config_set(cfg, "allow_unpinned", "true", false, err, sizeof err) ||
        /* L1 alone, no journal: nothing kept in /dev/shm after the benchmark */
        kvt_config_set(cfg, "l1.adopt", "false", false, err, sizeof err)) {
        fprintf(stderr, "kvt-bench-l1: %s\n", err);
        exit(1);
    }
    uint32_t maxobj = o->stages[o->nstages - 1];
    kvt_key_t *keys = malloc((size_t)maxobj * sizeof *keys);
    for (uint32_t i = 0; i < maxobj; i++)
        s_key(&keys[i], i, 1);

    double t0 = s_now();
    kvt_l1_t *l1 = kvt_l1_new(cfg, err, sizeof err);
    if (!l1) {
        fprintf(stderr, "kvt-bench-l1: %s\n", err);
        exit(1);
    }
    double create_s = s_now() - t0;
    json_t *status = kvt_l1_status_json(l1);
    bool pinned = json_is_true(json_object_get(status, "pinned"));
    bool huge = json_is_true(json_object_get(status, "huge_pages"));
    json_decref(status);
    printf("\nL1 tier (kvt_l1), %s arena (%s, %s), created in %.2f s, objects of %u B\n",
           o->l1_size, pinned ? "mlocked" : "not mlocked", huge ? "2 MiB pages" : "4 KiB pages",
           create_s, OBJ_SIZE);

    l1_ctx_t c = {.l1 = l1, .keys = keys};
    c.ns = (kvt_ns_t){(const uint8_t *)"bench/model", 11, (const uint8_t *)"", 0};

    uint64_t res0, shr0, res1, shr1;
    s_statm(&res0, &shr0);
    json_t *lk = json_array();
    double fill_s = 0;
    for (int s = 0; s < o->nstages; s++) {
        fill_s += s_fill(&c, o->stages[s], KEYS_PER_LOOKUP);
        if (s == o->nstages - 1)
            s_statm(&res1, &shr1);
        s_bench_lookup(&c, o->lookups_per_stage, lk);
    }
    json_object_set_new(s_out, "lookup", lk);
    double per_obj = (double)(res1 - res0) / (double)c.stored;
    double per_obj_anon = ((double)(res1 - shr1) - (double)(res0 - shr0)) / (double)c.stored;
    char what[64], note[128];
    snprintf(what, sizeof what, "RSS per object (%u objects)", c.stored);
    snprintf(note, sizeof note, "(statm resident delta %.1f MiB; anonymous %.0f B/object)",
             (double)(res1 - res0) / 1048576.0, per_obj_anon);
    s_row(what, per_obj, "B/object", note);
    double fill_rate = (double)c.stored / fill_s;
    snprintf(note, sizeof note, "(filling to %u objects, batches of 64)", c.stored);
    s_row("RESERVE+COMMIT, 64-key batches", fill_rate / 1e6, "Mkeys/s", note);
    json_object_set_new(s_out, "rss",
                        json_pack("{s:i,s:I,s:I,s:f,s:f}", "objects", c.stored, "resident_before",
                                  (json_int_t)res0, "resident_after", (json_int_t)res1,
                                  "bytes_per_object", per_obj, "anon_bytes_per_object",
                                  per_obj_anon));

    /* RESERVE+COMMIT of one key per request, on an empty tier (no eviction) */
    uint64_t removed = 0;
    kvt_l1_clear(l1, NULL, 0, &removed);
    c.stored = 0;
    double rc1_s = s_fill(&c, o->rc_ops, 1);
    double rc1 = (double)o->rc_ops / rc1_s;
    snprintf(note, sizeof note, "(%.2f us per pair, %u ops)", 1e6 / rc1, o->rc_ops);
    s_row("RESERVE+COMMIT, 1 key, 4 KiB", rc1 / 1e6, "Mops/s", note);

    /* ACQUIRE+RELEASE, 1 key and 64 keys */
    kvt_slot_t slots[KEYS_PER_LOOKUP];
    uint64_t seed = 5;
    double acq[2];
    const uint32_t width[2] = {1, KEYS_PER_LOOKUP};
    for (int w = 0; w < 2; w++) {
        double t = s_now();
        for (uint32_t i = 0; i < o->acq_ops; i++) {
            uint32_t start = (uint32_t)(s_rand(&seed) % (c.stored - width[w] + 1));
            uint32_t n = 0;
            uint64_t lease = 0;
            kvt_l1_acquire(l1, 2, &c.ns, &keys[start], width[w], slots, &n,
                           &lease);
            if (n != width[w] || kvt_l1_release(l1, 2, lease) != 0) {
                fprintf(stderr, "kvt-bench-l1: acquire/release failed\n");
                exit(1);
            }
        }
        acq[w] = (double)o->acq_ops / (s_now() - t);
    }
    snprintf(note, sizeof note, "(%.2f us per pair)", 1e6 / acq[0]);
    s_row("ACQUIRE+RELEASE, 1 key", acq[0] / 1e6, "Mops/s", note);
    snprintf(note, sizeof note, "(%.2f us per pair, %.0f ns/key)", 1e6 / acq[1],
             1e9 / acq[1] / KEYS_PER_LOOKUP);
    s_row("ACQUIRE+RELEASE, 64 keys", acq[1] / 1e6, "Mops/s", note);
    json_object_set_new(s_out, "ops",
                        json_pack("{s:f,s:f,s:f,s:f}", "reserve_commit_64_keys_per_s", fill_rate,
                                  "reserve_commit_1_ops_per_s", rc1, "acquire_release_1_ops_per_s",
                                  acq[0], "acquire_release_64_ops_per_s", acq[1]));
    json_object_set_new(s_out, "l1",
                        json_pack("{s:s,s:b,s:b,s:f,s:i}", "l1_size", o->l1_size, "pinned", pinned,
                                  "huge_pages", huge, "create_seconds", create_s, "object_bytes",
                                  OBJ_SIZE));

    kvt_l1_destroy(&l1);
    kvt_config_destroy(&cfg);
    free(keys);
}

int main(int argc, char **argv)
{
    opts_t o = {.alloc_iters = 4000000,
                .stages = {10000, 100000, 1000000},
                .nstages = 3,
                .lookups_per_stage = 200000,
                .rc_ops = 300000,
                .acq_ops = 300000,
                .l1_size = "4160M"};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            o.quick = true;
        } else if (strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
            o.json_path = argv[++i];
        } else {
            fprintf(stderr, "usage: %s [--quick] [--json FILE]\n", argv[0]);
            return 2;
        }
    }
    if (o.quick) {
        o.alloc_iters = 300000;
        o.nstages = 2;
        o.lookups_per_stage = 20000;
        o.rc_ops = 30000;
        o.acq_ops = 30000;
        o.l1_size = "448M";
    }
    kvt_log_set_level(KVT_LOG_ERROR);
    char cpu[128];
    s_cpu_model(cpu, sizeof cpu);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    printf("kvt-bench-l1 %s (%s mode): %ld CPUs, %s\n\n", KVT_VERSION, o.quick ? "quick" : "full",
           ncpu, cpu);
    s_out = json_pack("{s:s,s:s,s:i,s:s}", "bench", "kvt-bench-l1", "mode",
                      o.quick ? "quick" : "full", "cpus", (int)ncpu, "cpu", cpu);
    double t0 = s_now();
    s_bench_alloc(&o);
    s_bench_l1(&o);
    double total = s_now() - t0;
    printf("\ntotal %.1f s\n", total);
    json_object_set_new(s_out, "total_seconds", json_real(total));
    if (o.json_path) {
        if (json_dump_file(s_out, o.json_path, JSON_INDENT(2)) != 0) {
            fprintf(stderr, "kvt-bench-l1: cannot write %s\n", o.json_path);
            return 1;
        }
        printf("wrote %s\n", o.json_path);
    }
    json_decref(s_out);
    return 0;
}
