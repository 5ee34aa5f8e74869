/* kvt-bench-l2: focused benchmark of the L2 tier's data path, in process (no sockets, no
 * daemon): write-behind of committed L1 objects to an adapter and prefetch loads from it back
 * into L1, through the real L2 manager (kvt_l2mgr: its writer threads, its prefetch threads, and
 * whatever it does to the bytes on the way), each against baselines measured in the same run on
 * the same bytes: memcpy, and for the fs adapter plain pwrite+fdatasync / pread of one file per
 * object in the same directory. Also the hash throughput the integrity checks pay (XXH3-64 and
 * XXH3-128 against memcpy), and the COMMIT of L1 objects with and without `l1_checksum`.
 *
 * --disk DIR adds the comparisons with the tools that define the device's speed, alternating
 * rounds of each in the same run: the fs adapter (default settings) against fio's sequential
 * write and read on DIR (O_DIRECT, libaio, queue depth 16, end_fsync) for 1 MiB, 16 MiB and
 * 64 KiB objects/blocks; the open of an fs directory holding --open-objects objects (time, and
 * RSS per object); and, when redis-server is installed, the redis adapter against
 * redis-benchmark SET/GET of the same sizes on a private server.
 *
 *   build/kvt-bench-l2 [--quick] [--json FILE] [--dir DIR] [--count N] [--size BYTES]
 *                      [--rounds R] [--disk DIR] [--disk-mib N] [--open-objects N]
 *                      [--fs-options OPTS] [--set KEY=VALUE]...
 *
 * Defaults: 64 objects of 4 MiB, 3 rounds (the best round is reported), the fs adapter in a
 * fresh directory under /dev/shm (tmpfs: the page cache, so the figures are CPU-bound and show
 * what the daemon itself costs; --dir puts it on a disk). --quick: 8 objects of 1 MiB, 1 round.
 * Everything it creates is removed at the end. */
#include "kvt_config.h"
#include "kvt_error.h"
#include "kvt_l1.h"
#include "kvt_l2.h"
#include "kvt_l2_name.h"
#include "kvt_l2mgr.h"
#include "kvt_log.h"
#include "kvt_prefetch.h"
#include "kvt_size.h"
#include "kvt_supervisor.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <jansson.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define NS "bench-l2"

typedef struct {
    bool quick;
    const char *json_path;
    const char *dir;
    uint32_t count;
    uint64_t size;
    int rounds;
    const char *disk;    /* --disk: the fio / redis / open comparisons on this directory */
    const char *only;    /* --only fio|open|redis: that disk comparison alone */
    const char *fs_opts; /* --fs-options: appended to the fs spec there ("" = defaults) */
    const char *sets[8]; /* --set KEY=VALUE: configuration of the rigs */
    int nsets;
    uint64_t disk_bytes; /* bytes per workload round there */
    uint32_t open_objects;
} opts_t;

static json_t *s_out;
static _Atomic uint64_t s_l2_stored; /* keys reported by l2_stored events */

static double s_now(void)
{
    return (double)kvt_now_ns() * 1e-9;
}

/* Random-looking 64-bit values from a counter (xorshift-multiply; the fills are not timed). */
static uint64_t s_scramble(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x * 0xc4ceb9fe1a85ec53ull;
}

static void s_key(kvt_key_t *key, uint64_t id)
{
    uint8_t *k = key->b;
    uint64_t a = s_scramble(id + 0x4c32ull), b = s_scramble(a ^ id);
    memcpy(k, &a, 8);
    memcpy(k + 8, &b, 8);
}

/* Pseudo-random bytes, different for every object (a compressing or deduplicating store would
 * otherwise flatter itself). */
static void s_fill_bytes(uint8_t *p, uint64_t len, uint64_t seed)
{
    uint64_t x = seed << 32;
    for (uint64_t i = 0; i + 8 <= len; i += 8) {
        uint64_t v = s_scramble(++x);
        memcpy(p + i, &v, 8);
    }
    for (uint64_t i = len & ~7ull; i < len; i++)
        p[i] = (uint8_t)s_scramble(x + i);
}

static void *s_xalloc(size_t n)
{
    void *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (!p) {
        fprintf(stderr, "kvt-bench-l2: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    memset(p, 0x5a, n); /* fault the pages in before anything is timed */
    return p;
}

static void s_die(const char *what, const char *why)
{
    fprintf(stderr, "kvt-bench-l2: %s: %s\n", what, why);
    exit(1);
}

static void s_row(const char *what, double gbps, double base, const char *base_name)
{
    if (base > 0)
        printf("  %-44s %7.2f GB/s   %-28s %7.2f GB/s  %5.2fx\n", what, gbps, base_name, base,
               gbps / base);
    else
        printf("  %-44s %7.2f GB/s\n", what, gbps);
}

static double s_best(const double *v, int n)
{
    double b = 0;
    for (int i = 0; i < n; i++)
        if (v[i] > b)
            b = v[i];
    return b;
}

/* ---- hashing vs memcpy ------------------------------------------------------------------ */

static volatile uint64_t s_sink;

static void s_bench_hash(const opts_t *o)
{
    uint64_t total = (uint64_t)o->count * o->size;
    uint8_t *src = s_xalloc(total), *dst = s_xalloc(total);
    for (uint32_t i = 0; i < o->count; i++)
        s_fill_bytes(src + (uint64_t)i * o->size, o->size, i + 1);
    double mc[8] = {0}, h64[8] = {0}, h128[8] = {0};
    for (int r = 0; r < o->rounds && r < 8; r++) {
        double t = s_now();
        for (uint32_t i = 0; i < o->count; i++)
            memcpy(dst + (uint64_t)i * o->size, src + (uint64_t)i * o->size, o->size);
        mc[r] = (double)total / (s_now() - t) / 1e9;
        t = s_now();
        for (uint32_t i = 0; i < o->count; i++)
            s_sink += XXH3_64bits(src + (uint64_t)i * o->size, o->size);
        h64[r] = (double)total / (s_now() - t) / 1e9;
        t = s_now();
        for (uint32_t i = 0; i < o->count; i++)
            s_sink += XXH3_128bits(src + (uint64_t)i * o->size, o->size).low64;
        h128[r] = (double)total / (s_now() - t) / 1e9;
    }
    printf("hashing %u objects of %llu bytes (one pass each), against memcpy of the same bytes\n",
           o->count, (unsigned long long)o->size);
    s_row("memcpy", s_best(mc, o->rounds), 0, "");
    s_row("XXH3-64", s_best(h64, o->rounds), s_best(mc, o->rounds), "memcpy");
    s_row("XXH3-128", s_best(h128, o->rounds), s_best(mc, o->rounds), "memcpy");
    json_object_set_new(s_out, "hash",
                        json_pack("{s:f,s:f,s:f}", "memcpy_gbps", s_best(mc, o->rounds),
                                  "xxh3_64_gbps", s_best(h64, o->rounds), "xxh3_128_gbps",
                                  s_best(h128, o->rounds)));
    free(src);
    free(dst);
}

static int s_rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

/* ---- the L2 path ------------------------------------------------------------------------ */

static void s_on_event(void *ctx, const char *event, const kvt_ns_t *ns, const kvt_key_t *keys,
                       const uint64_t *sizes, uint32_t n, const char *adapter)
{
    (void)ctx, (void)ns, (void)keys, (void)sizes, (void)adapter;
    if (strcmp(event, "l2_stored") == 0)
        atomic_fetch_add(&s_l2_stored, n);
}

typedef struct {
    kvt_config_t *cfg;
    kvt_sup_t *sup;
    kvt_l1_t *l1;
    kvt_prefetch_t *pf;
    kvt_l2mgr_t *mgr;
    kvt_ns_t ns;
    kvt_key_t *keys;
    uint64_t *sizes;
} rig_t;

static void s_rig_open(rig_t *g, const opts_t *o, const char *spec)
{
    char err[KVT_ERR_LEN] = "", size[32];
    memset(g, 0, sizeof *g);
    g->cfg = kvt_config_new();
    /* room for every object twice over (a store round and a load round overlap) */
    snprintf(size, sizeof size, "%lluM",
             (unsigned long long)((2 * (uint64_t)o->count * (o->size + 8192)) >> 20) + 64);
    if (kvt_config_set(g->cfg, "l1_size", size, false, err, sizeof err) ||
        kvt_config_set(g->cfg, "allow_unpinned", "true", false, err, sizeof err) ||
        kvt_config_set(g->cfg, "lease_ms", "600000", false, err, sizeof err) ||
        kvt_config_set(g->cfg, "l1.adopt", "false", false, err, sizeof err) ||
        kvt_config_set(g->cfg, "l2", spec, false, err, sizeof err))
        s_die("config", err);
    for (int i = 0; i < o->nsets; i++) {
        char kv[256];
        snprintf(kv, sizeof kv, "%s", o->sets[i]);
        char *eq = strchr(kv, '=');
        if (!eq)
            s_die(o->sets[i], "want KEY=VALUE");
        *eq = '\0';
        if (kvt_config_set(g->cfg, kv, eq + 1, false, err, sizeof err))
            s_die("--set", err);
    }
    g->sup = kvt_sup_new(NULL);
    g->l1 = kvt_l1_new(g->cfg, err, sizeof err);
    if (!g->l1)
        s_die("l1", err);
    g->pf = kvt_prefetch_new(60000, 65536);
    int code = 0;
    g->mgr = kvt_l2mgr_new(g->cfg, g->l1, g->pf, g->sup, &code, err, sizeof err);
    if (!g->mgr)
        s_die(spec, err);
    kvt_l2mgr_set_events(g->mgr, s_on_event, NULL);
    g->ns = (kvt_ns_t){(const uint8_t *)NS, (uint32_t)strlen(NS), NULL, 0};
    g->keys = calloc(o->count, sizeof *g->keys);
    g->sizes = calloc(o->count, sizeof *g->sizes);
    for (uint32_t i = 0; i < o->count; i++)
        s_key(&g->keys[i], i);
}

static void s_rig_close(rig_t *g)
{
    kvt_l2mgr_destroy(&g->mgr);
    kvt_prefetch_destroy(&g->pf);
    kvt_l1_destroy(&g->l1);
    kvt_sup_destroy(&g->sup);
    kvt_config_destroy(&g->cfg);
    free(g->keys);
    free(g->sizes);
}

/* RESERVE + fill + COMMIT of every object (the daemon's owner: nothing is written behind until
 * the benchmark asks). */
static void s_rig_fill(rig_t *g, const opts_t *o)
{
    kvt_slot_t *slots = calloc(o->count, sizeof *slots);
    uint32_t n = 0, stored = 0;
    uint64_t lease = 0;
    char err[KVT_ERR_LEN] = "";
    int rc = kvt_l1_reserve(g->l1, KVT_OWNER_DAEMON, &g->ns, g->keys, o->count, NULL, o->size,
                            slots, &n, &lease, err, sizeof err);
    if (rc || n != o->count)
        s_die("reserve", rc ? err : "partial");
    uint8_t *base = kvt_l1_base(g->l1);
    for (uint32_t i = 0; i < n; i++)
        s_fill_bytes(base + slots[i].offset, o->size, i + 1);
    rc = kvt_l1_commit(g->l1, KVT_OWNER_DAEMON, lease, NULL, 0, &stored, err, sizeof err);
    if (rc || stored != n)
        s_die("commit", rc ? err : "partial");
    free(slots);
}

/* Every object in L1 holds its bytes (checked after each load round, not timed). */
static void s_rig_check(rig_t *g, const opts_t *o)
{
    uint8_t *want = s_xalloc(o->size);
    uint8_t *base = kvt_l1_base(g->l1);
    for (uint32_t i = 0; i < o->count; i++) {
        kvt_slot_t slot;
        uint32_t got = 0;
        uint64_t lease = 0;
        kvt_l1_acquire(g->l1, KVT_OWNER_DAEMON, &g->ns, &g->keys[i], 1, &slot, &got, &lease);
        s_fill_bytes(want, o->size, i + 1);
        if (got != 1 || slot.length != o->size || memcmp(base + slot.offset, want, o->size))
            s_die("check", "an object loaded back from L2 does not hold its bytes");
        kvt_l1_release(g->l1, KVT_OWNER_DAEMON, lease);
    }
    free(want);
}

/* Seconds to write every object behind (from the queueing to the last l2_stored event). */
static double s_rig_store(rig_t *g, const opts_t *o)
{
    atomic_store(&s_l2_stored, 0);
    double t = s_now();
    kvt_l2mgr_on_stored(g->mgr, &g->ns, g->keys, o->count);
    while (atomic_load(&s_l2_stored) < o->count) {
        if (s_now() - t > 300)
            s_die("store", "write-behind did not finish within 300 s");
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    return s_now() - t;
}

/* Removes every object from L2 (REMOVE's write-behind) and waits until none is found. */
static void s_rig_unstore(rig_t *g, const opts_t *o)
{
    kvt_l2mgr_remove(g->mgr, &g->ns, g->keys, o->count);
    double t = s_now();
    uint64_t *sizes = calloc(o->count, sizeof *sizes);
    while (
        kvt_l2mgr_lookup(g->mgr, &g->ns, g->keys, 1, kvt_now_ms() + 1000, sizes) ||
        kvt_l2mgr_lookup(g->mgr, &g->ns, g->keys + o->count - 1, 1, kvt_now_ms() + 1000, sizes)) {
        if (s_now() - t > 300)
            s_die("remove", "L2 still holds the objects after 300 s");
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    free(sizes);
    sync();
}

/* Seconds to load every object back into an empty L1 (one prefetch job, as a LOOKUP with
 * prefetch starts it; the L2 lookup of the sizes is timed apart, in *lookup_s). */
static double s_rig_load(rig_t *g, const opts_t *o, double *lookup_s)
{
    uint64_t removed = 0;
    kvt_l1_clear(g->l1, (const uint8_t *)NS, (uint32_t)strlen(NS), &removed);
    if (removed != o->count)
        s_die("clear", "not every object was in L1");
    double t = s_now();
    uint32_t hits =
        kvt_l2mgr_lookup(g->mgr, &g->ns, g->keys, o->count, kvt_now_ms() + 60000, g->sizes);
    *lookup_s = s_now() - t;
    if (hits != o->count)
        s_die("lookup", "not every object was found in L2");
    t = s_now();
    uint64_t job = kvt_prefetch_start(g->pf, hits, false, kvt_now_ms());
    kvt_l2mgr_prefetch(g->mgr, job, &g->ns, g->keys, g->sizes, hits);
    bool done = false;
    uint32_t loaded = 0, h = 0;
    while (!done) {
        if (s_now() - t > 300)
            s_die("load", "the prefetch did not finish within 300 s");
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
        kvt_prefetch_status(g->pf, job, &done, &loaded, &h);
    }
    double secs = s_now() - t;
    if (loaded != o->count)
        s_die("load", "the prefetch loaded fewer objects than were stored");
    return secs;
}

/* The same bytes with plain syscalls, one file per object in dir/raw: open + pwrite +
 * fdatasync + close, then open + pread + close, buffered and (*rdd, 0 when the filesystem
 * refuses it) with O_DIRECT. Returns GB/s. */
static void s_raw_fs(const char *dir, const opts_t *o, const uint8_t *src, uint8_t *dst, double *wr,
                     double *rd, double *rdd)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/raw", dir);
    mkdir(path, 0700);
    uint64_t total = (uint64_t)o->count * o->size;
    double t = s_now();
    for (uint32_t i = 0; i < o->count; i++) {
        snprintf(path, sizeof path, "%s/raw/%u", dir, i);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd < 0 || pwrite(fd, src + (uint64_t)i * o->size, o->size, 0) != (ssize_t)o->size ||
            fdatasync(fd) != 0)
            s_die(path, strerror(errno));
        close(fd);
    }
    *wr = (double)total / (s_now() - t) / 1e9;
    t = s_now();
    for (uint32_t i = 0; i < o->count; i++) {
        snprintf(path, sizeof path, "%s/raw/%u", dir, i);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || pread(fd, dst + (uint64_t)i * o->size, o->size, 0) != (ssize_t)o->size)
            s_die(path, strerror(errno));
        close(fd);
    }
    *rd = (double)total / (s_now() - t) / 1e9;
    /* the fs adapter reads with O_DIRECT where the filesystem allows it: so does this line */
    *rdd = 0;
    t = s_now();
    for (uint32_t i = 0; i < o->count; i++) {
        snprintf(path, sizeof path, "%s/raw/%u", dir, i);
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
        if (fd < 0)
            return; /* not on this filesystem */
        ssize_t n = pread(fd, dst + (uint64_t)i * o->size, (o->size + 4095) & ~4095ull, 0);
        close(fd);
        if (n != (ssize_t)o->size)
            return;
    }
    *rdd = (double)total / (s_now() - t) / 1e9;
}

static void s_bench_adapter(const opts_t *o, const char *kind, const char *spec, const char *dir)
{
    rig_t g;
    s_rig_open(&g, o, spec);
    s_rig_fill(&g, o);
    uint64_t total = (uint64_t)o->count * o->size;
    uint8_t *src = s_xalloc(total), *dst = s_xalloc(total);
    for (uint32_t i = 0; i < o->count; i++)
        s_fill_bytes(src + (uint64_t)i * o->size, o->size, i + 1);
    double st[8] = {0}, ld[8] = {0}, lk[8] = {0}, mc[8] = {0}, rw[8] = {0}, rr[8] = {0};
    double rd[8] = {0};
    for (int r = 0; r < o->rounds && r < 8; r++) {
        st[r] = (double)total / s_rig_store(&g, o) / 1e9;
        double lookup_s = 0;
        ld[r] = (double)total / s_rig_load(&g, o, &lookup_s) / 1e9;
        lk[r] = lookup_s * 1e6 / o->count;
        s_rig_check(&g, o);
        double t = s_now();
        for (uint32_t i = 0; i < o->count; i++)
            memcpy(dst + (uint64_t)i * o->size, src + (uint64_t)i * o->size, o->size);
        mc[r] = (double)total / (s_now() - t) / 1e9;
        if (dir)
            s_raw_fs(dir, o, src, dst, &rw[r], &rr[r], &rd[r]);
    }
    double bst = s_best(st, o->rounds), bld = s_best(ld, o->rounds), bmc = s_best(mc, o->rounds);
    double brw = s_best(rw, o->rounds), brr = s_best(rr, o->rounds), brd = s_best(rd, o->rounds);
    double blk = lk[0];
    for (int r = 1; r < o->rounds; r++)
        blk = lk[r] < blk ? lk[r] : blk;
    printf("\nL2 adapter %s (%s)\n", kind, spec);
    char what[96];
    snprintf(what, sizeof what, "store (write-behind of %u x %llu B)", o->count,
             (unsigned long long)o->size);
    if (dir)
        s_row(what, bst, brw, "raw pwrite+fdatasync");
    s_row(dir ? "" : what, bst, bmc, "memcpy");
    snprintf(what, sizeof what, "load (prefetch into L1 of %u x %llu B)", o->count,
             (unsigned long long)o->size);
    if (dir)
        s_row(what, bld, brr, "raw pread");
    if (dir && brd > 0)
        s_row("", bld, brd, "raw pread O_DIRECT");
    s_row(dir ? "" : what, bld, bmc, "memcpy");
    printf("  %-44s %7.2f us per key\n", "L2 lookup (sizes of the keys to load)", blk);
    json_object_set_new(s_out, kind,
                        json_pack("{s:s,s:f,s:f,s:f,s:f,s:f,s:f,s:f}", "spec", spec, "store_gbps",
                                  bst, "load_gbps", bld, "memcpy_gbps", bmc, "raw_write_gbps", brw,
                                  "raw_read_gbps", brr, "raw_read_direct_gbps", brd,
                                  "lookup_us_per_key", blk));
    free(src);
    free(dst);
    s_rig_close(&g);
}

/* ---- COMMIT with and without l1_checksum ------------------------------------------------- */

static void s_bench_commit(const opts_t *o)
{
    double secs[2] = {0, 0};
    for (int on = 0; on < 2; on++) {
        rig_t g = {0};
        char err[KVT_ERR_LEN] = "", size[32];
        g.cfg = kvt_config_new();
        snprintf(size, sizeof size, "%lluM",
                 (unsigned long long)(((uint64_t)o->count * (o->size + 8192)) >> 20) + 64);
        if (kvt_config_set(g.cfg, "l1_size", size, false, err, sizeof err) ||
            kvt_config_set(g.cfg, "l1.adopt", "false", false, err, sizeof err) ||
            kvt_config_set(g.cfg, "allow_unpinned", "true", false, err, sizeof err))
            s_die("config", err);
        if (on && kvt_config_set(g.cfg, "l1_checksum", "true", false, err, sizeof err)) {
            printf("\nCOMMIT with l1_checksum: not measured (%s)\n", err);
            kvt_config_destroy(&g.cfg);
            return;
        }
        g.l1 = kvt_l1_new(g.cfg, err, sizeof err);
        if (!g.l1)
            s_die("l1", err);
        g.ns = (kvt_ns_t){(const uint8_t *)NS, (uint32_t)strlen(NS), NULL, 0};
        kvt_slot_t slot;
        double best = 1e9;
        for (int r = 0; r < o->rounds; r++) {
            double sum = 0;
            for (uint32_t i = 0; i < o->count; i++) {
                kvt_key_t k;
                s_key(&k, 1000000u * (uint64_t)(r + 1) + i);
                uint32_t n = 0, stored = 0;
                uint64_t lease = 0;
                if (kvt_l1_reserve(g.l1, 1, &g.ns, &k, 1, NULL, o->size, &slot, &n, &lease, err,
                                   sizeof err) ||
                    n != 1)
                    s_die("reserve", err);
                s_fill_bytes((uint8_t *)kvt_l1_base(g.l1) + slot.offset, 64, i);
                double t = s_now();
                kvt_l1_commit(g.l1, 1, lease, NULL, 0, &stored, err, sizeof err);
                sum += s_now() - t;
            }
            best = sum < best ? sum : best;
            uint64_t removed = 0;
            kvt_l1_clear(g.l1, NULL, 0, &removed);
        }
        secs[on] = best / o->count;
        kvt_l1_destroy(&g.l1);
        kvt_config_destroy(&g.cfg);
    }
    printf("\nCOMMIT of one %llu-byte object (L1 only)\n", (unsigned long long)o->size);
    printf("  %-44s %7.1f us\n", "l1_checksum off", secs[0] * 1e6);
    printf("  %-44s %7.1f us  (+%.1f us, XXH3 at %.2f GB/s)\n", "l1_checksum on", secs[1] * 1e6,
           (secs[1] - secs[0]) * 1e6, (double)o->size / (secs[1] - secs[0]) / 1e9);
    json_object_set_new(
        s_out, "commit",
        json_pack("{s:f,s:f}", "us_checksum_off", secs[0] * 1e6, "us_checksum_on", secs[1] * 1e6));
}

/* ---- against fio, redis-benchmark, and the open of a large directory (--disk) ---------- */

/* A command's standard output (NULL when it cannot be run or fails). */
static char *s_run(const char *cmd)
{
    FILE *f = popen(cmd, "r");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (size_t r; buf && (r = fread(buf + n, 1, cap - n - 1, f)) > 0;) {
        n += r;
        if (cap - n < 4096) {
            char *b = realloc(buf, cap * 2);
            if (!b) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = b;
            cap *= 2;
        }
    }
    int st = pclose(f);
    if (!buf || st != 0) {
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    return buf;
}

/* fio's bandwidth in GB/s for one pass ("write", "read" or "randread") of `total` bytes in `bs`
 * blocks over DIR/fio.dat: O_DIRECT, libaio, queue depth 16, fsync at the end of a write.
 * 0 when fio is missing or fails. */
static double s_fio(const char *dir, const char *rw, uint64_t bs, uint64_t total)
{
    char cmd[4600];
    snprintf(cmd, sizeof cmd,
             "fio --name=kvt-bench --directory='%s' --filename=fio.dat --rw=%s --bs=%llu "
             "--size=%llu --iodepth=16 --ioengine=libaio --direct=1 --end_fsync=1 "
             "--output-format=json 2>/dev/null",
             dir, rw, (unsigned long long)bs, (unsigned long long)total);
    char *out = s_run(cmd);
    if (!out)
        return 0;
    json_error_t je;
    const char *start = strchr(out, '{'); /* fio may print a notice before its JSON */
    json_t *j = start ? json_loads(start, JSON_DISABLE_EOF_CHECK, &je) : NULL;
    free(out);
    json_t *job = json_array_get(json_object_get(j, "jobs"), 0);
    const char *side = strstr(rw, "read") ? "read" : "write"; /* randread reports as read */
    double bw = json_number_value(json_object_get(json_object_get(job, side), "bw_bytes"));
    json_decref(j);
    return bw / 1e9;
}

static const char *s_verdict(double ratio)
{
    return ratio >= 0.8 ? "ok" : "BELOW 0.8";
}

/* The fs adapter (default settings: O_DIRECT, sync=batch, l2_write_threads and
 * l2_prefetch_threads at their defaults) against fio on the same directory, alternating. */
static void s_bench_fio(const opts_t *o, const char *dir)
{
    static const struct {
        const char *label;
        uint64_t size;
    } wl[] = {{"1 MiB", 1u << 20}, {"16 MiB", 16u << 20}, {"64 KiB", 64u << 10}};
    if (s_fio(dir, "write", 1u << 20, 4u << 20) == 0) {
        printf("\nfs L2 against fio: not measured (fio is not installed or fails on %s)\n", dir);
        return;
    }
    printf("\nfs L2 (%s) against fio on %s, %llu MiB per round, best of %d alternating rounds\n",
           o->fs_opts[0] ? o->fs_opts : "default settings", dir,
           (unsigned long long)(o->disk_bytes >> 20), o->rounds);
    printf("  %-8s %8s %8s %6s %-9s  %8s %8s %6s %-9s\n", "objects", "write", "fio", "ratio", "",
           "read", "fio", "ratio", "");
    json_t *rows = json_array();
    char spec[1200], l2dir[1100], fiofile[1100];
    snprintf(l2dir, sizeof l2dir, "%s/l2", dir);
    snprintf(spec, sizeof spec, "fs:%s%s%s", l2dir, o->fs_opts[0] ? "," : "", o->fs_opts);
    snprintf(fiofile, sizeof fiofile, "%s/fio.dat", dir);
    for (size_t w = 0; w < sizeof wl / sizeof wl[0]; w++) {
        opts_t wo = *o;
        wo.size = wl[w].size;
        wo.count = (uint32_t)(o->disk_bytes / wl[w].size);
        uint64_t total = (uint64_t)wo.count * wo.size;
        rig_t g;
        s_rig_open(&g, &wo, spec);
        s_rig_fill(&g, &wo);
        /* objects small enough that the disk's reads are per request (64 KiB): fio's random
         * read too, the pattern of a cache that loads what a request needs, not a file in order */
        bool rand = wo.size < (1u << 20);
        double kw[8] = {0}, kr[8] = {0}, fw[8] = {0}, fr[8] = {0}, frr[8] = {0}, lk = 1e9;
        for (int r = 0; r < o->rounds && r < 8; r++) {
            unlink(fiofile);
            fw[r] = s_fio(dir, "write", wo.size, total);
            /* write-behind writes new objects: the last round's go first (untimed), so a
             * round does not pay for replacing files (an unlink, and on a filesystem mounted
             * with `discard` a synchronous discard each) where fio overwrites in place */
            s_rig_unstore(&g, &wo);
            kw[r] = (double)total / s_rig_store(&g, &wo) / 1e9;
            fr[r] = s_fio(dir, "read", wo.size, total);
            if (rand)
                frr[r] = s_fio(dir, "randread", wo.size, total);
            double lookup_s = 0;
            kr[r] = (double)total / s_rig_load(&g, &wo, &lookup_s) / 1e9;
            lk = lookup_s < lk ? lookup_s : lk;
            if (r == 0)
                s_rig_check(&g, &wo);
        }
        unlink(fiofile);
        s_rig_close(&g);
        nftw(l2dir, s_rm_one, 16, FTW_DEPTH | FTW_PHYS);
        double bkw = s_best(kw, o->rounds), bkr = s_best(kr, o->rounds);
        double bfw = s_best(fw, o->rounds), bfr = s_best(fr, o->rounds);
        printf("  %-8s %5.2f GB/s %5.2f GB/s %5.2fx %-9s  %5.2f GB/s %5.2f GB/s %5.2fx %-9s\n",
               wl[w].label, bkw, bfw, bkw / bfw, s_verdict(bkw / bfw), bkr, bfr, bkr / bfr,
               s_verdict(bkr / bfr));
        double bfrr = s_best(frr, o->rounds);
        if (rand)
            printf("  %-8s read against fio's random read of the same blocks: %5.2f GB/s %5.2fx\n",
                   "", bfrr, bkr / bfrr);
        /* issue 31: a LOOKUP of L2-only keys takes less than reading their bytes at fio's rate */
        double at_fio = (double)total / 1e9 / bfr;
        printf("  %-8s LOOKUP of %u L2-only keys %.1f ms; their bytes at fio's read rate %.0f ms "
               "(%.3fx)\n",
               "", wo.count, lk * 1e3, at_fio * 1e3, lk / at_fio);
        json_t *row = json_pack(
            "{s:s,s:I,s:I,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f}", "objects", wl[w].label, "size",
            (json_int_t)wo.size, "count", (json_int_t)wo.count, "write_gbps", bkw, "fio_write_gbps",
            bfw, "write_ratio", bkw / bfw, "read_gbps", bkr, "fio_read_gbps", bfr, "read_ratio",
            bkr / bfr, "lookup_s", lk, "lookup_vs_fio_read", lk / at_fio);
        if (rand)
            json_object_set_new(row, "fio_randread_gbps", json_real(bfrr));
        json_array_append_new(rows, row);
    }
    json_object_set_new(s_out, "fio", rows);
}

/* Heap bytes in use (glibc), for the index's cost per object. */
static size_t s_heap_used(void)
{
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
}

/* The open of an fs directory holding `n` objects: the index is rebuilt by scanning it. Warm
 * (directory entries and inodes cached), then cold when this process may drop the caches. */
static void s_bench_open(const opts_t *o, const char *dir)
{
    const kvt_l2_ops_t *ops = kvt_l2_fs_ops();
    char spec[1200], err[256] = "", path[1100];
    snprintf(path, sizeof path, "%s/open", dir);
    snprintf(spec, sizeof spec, "%s,sync=none%s%s", path, o->fs_opts[0] ? "," : "", o->fs_opts);
    void *fs = NULL;
    if (ops->open(spec, &fs, err, sizeof err) != 0)
        s_die(spec, err);
    uint8_t *obj = s_xalloc(4096);
    kvt_ns_t ns = {(const uint8_t *)NS, (uint32_t)strlen(NS), NULL, 0};
    double t = s_now();
    for (uint32_t i = 0; i < o->open_objects; i++) {
        kvt_key_t k;
        char name[KVT_L2_NAME_LEN];
        s_key(&k, i);
        kvt_l2_name(&ns, &k, name);
        s_fill_bytes(obj, 64, i);
        if (ops->store(fs, name, obj, 4096) != 0)
            s_die("open: store", name);
    }
    double fill_s = s_now() - t;
    ops->close(fs);
    free(obj);
    sync();
    /* pass 0 warms the caches (untimed), pass 1 is the warm open, pass 2 the cold one: page
     * cache, dentries and inodes dropped (what a reboot leaves) */
    double secs[3] = {0, 0, 0};
    size_t heap = 0;
    bool cold = false;
    for (int pass = 0; pass < 3; pass++) {
        if (pass == 2) {
            FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
            cold = f && fputs("3\n", f) >= 0;
            if (f && fclose(f) != 0)
                cold = false;
            if (!cold)
                break;
        }
        size_t h0 = s_heap_used();
        t = s_now();
        if (ops->open(spec, &fs, err, sizeof err) != 0)
            s_die(spec, err);
        secs[pass] = s_now() - t;
        uint64_t objects = 0;
        ops->usage(fs, NULL, &objects);
        if (objects != o->open_objects)
            s_die("open", "the index does not hold every object");
        if (pass == 1)
            heap = s_heap_used() - h0;
        ops->close(fs);
    }
    nftw(path, s_rm_one, 16, FTW_DEPTH | FTW_PHYS);
    printf("\nfs (%s) open of a directory with %u objects (written in %.1f s; index rebuilt by a "
           "scan)\n",
           o->fs_opts[0] ? o->fs_opts : "default settings", o->open_objects, fill_s);
    printf("  %-44s %7.3f s  (%.1f us per object)\n", "open, cached", secs[1],
           secs[1] * 1e6 / o->open_objects);
    if (cold)
        printf("  %-44s %7.3f s  (%.1f us per object)\n", "open, cold (drop_caches 3)", secs[2],
               secs[2] * 1e6 / o->open_objects);
    else
        printf("  %-44s not measured (cannot write /proc/sys/vm/drop_caches)\n", "open, cold");
    printf("  %-44s %7.0f bytes per object\n", "index heap", (double)heap / o->open_objects);
    json_object_set_new(s_out, "open",
                        json_pack("{s:I,s:f,s:f,s:b,s:f}", "objects", (json_int_t)o->open_objects,
                                  "warm_s", secs[1], "cold_s", secs[2], "cold_measured", cold,
                                  "heap_bytes_per_object", (double)heap / o->open_objects));
}

/* redis-benchmark's requests per second for SET and GET of `size` bytes, 4 clients. */
static bool s_redis_benchmark(int port, uint64_t size, uint32_t n, double *set_rps, double *get_rps)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd,
             "redis-benchmark -h 127.0.0.1 -p %d -t set,get -d %llu -n %u -c 4 --csv 2>/dev/null",
             port, (unsigned long long)size, n < 200 ? 200 : n);
    char *out = s_run(cmd);
    if (!out)
        return false;
    *set_rps = *get_rps = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        double v = 0;
        if (sscanf(line, "\"SET\",\"%lf\"", &v) == 1)
            *set_rps = v;
        else if (sscanf(line, "\"GET\",\"%lf\"", &v) == 1)
            *get_rps = v;
    }
    free(out);
    return *set_rps > 0 && *get_rps > 0;
}

/* The redis adapter against redis-benchmark on a private redis-server (loopback, no
 * persistence), 1 MiB objects, alternating rounds. */
static void s_bench_redis(const opts_t *o, const char *dir)
{
    if (access("/usr/bin/redis-server", X_OK) != 0) {
        printf("\nredis L2 against redis-benchmark: not measured (no redis-server)\n");
        return;
    }
    int port = 20000 + (int)(getpid() % 20000);
    char cmd[4600];
    snprintf(cmd, sizeof cmd,
             "redis-server --port %d --bind 127.0.0.1 --save '' --appendonly no --daemonize yes "
             "--dir '%s' --pidfile '%s/redis.pid' --logfile '%s/redis.log' >/dev/null 2>&1",
             port, dir, dir, dir);
    if (system(cmd) != 0) {
        printf("\nredis L2 against redis-benchmark: not measured (redis-server did not start)\n");
        return;
    }
    snprintf(cmd, sizeof cmd, "redis-cli -p %d ping 2>/dev/null", port);
    for (int i = 0; i < 100; i++) {
        char *out = s_run(cmd);
        bool up = out && strncmp(out, "PONG", 4) == 0;
        free(out);
        if (up)
            break;
        struct timespec ts = {0, 50000000};
        nanosleep(&ts, NULL);
    }
    opts_t wo = *o;
    wo.size = 1u << 20;
    wo.count = (uint32_t)(o->disk_bytes / wo.size / 4); /* the server holds it in memory */
    if (wo.count < 16)
        wo.count = 16;
    uint64_t total = (uint64_t)wo.count * wo.size;
    char spec[128];
    snprintf(spec, sizeof spec, "redis:127.0.0.1:%d,timeout_ms=10000", port);
    rig_t g;
    s_rig_open(&g, &wo, spec);
    s_rig_fill(&g, &wo);
    double kw[8] = {0}, kr[8] = {0}, bw[8] = {0}, br[8] = {0};
    bool ok = true;
    for (int r = 0; r < o->rounds && r < 8 && ok; r++) {
        double set_rps = 0, get_rps = 0;
        ok = s_redis_benchmark(port, wo.size, wo.count, &set_rps, &get_rps);
        bw[r] = set_rps * (double)wo.size / 1e9;
        br[r] = get_rps * (double)wo.size / 1e9;
        kw[r] = (double)total / s_rig_store(&g, &wo) / 1e9;
        double lookup_s = 0;
        kr[r] = (double)total / s_rig_load(&g, &wo, &lookup_s) / 1e9;
        if (r == 0)
            s_rig_check(&g, &wo);
    }
    s_rig_close(&g);
    snprintf(cmd, sizeof cmd, "redis-cli -p %d shutdown nosave >/dev/null 2>&1", port);
    if (system(cmd) != 0) { /* already gone: nothing to stop */
    }
    if (!ok) {
        printf("\nredis L2 against redis-benchmark: not measured (redis-benchmark failed)\n");
        return;
    }
    double bkw = s_best(kw, o->rounds), bkr = s_best(kr, o->rounds);
    double bbw = s_best(bw, o->rounds), bbr = s_best(br, o->rounds);
    printf("\nredis L2 against redis-benchmark (4 clients), %u objects of 1 MiB, private "
           "redis-server without persistence\n",
           wo.count);
    printf("  %-44s %7.2f GB/s   %-28s %7.2f GB/s  %5.2fx\n", "store (write-behind)", bkw,
           "redis-benchmark SET", bbw, bkw / bbw);
    printf("  %-44s %7.2f GB/s   %-28s %7.2f GB/s  %5.2fx\n", "load (prefetch into L1)", bkr,
           "redis-benchmark GET", bbr, bkr / bbr);
    json_object_set_new(s_out, "redis",
                        json_pack("{s:I,s:f,s:f,s:f,s:f}", "count", (json_int_t)wo.count,
                                  "store_gbps", bkw, "set_gbps", bbw, "load_gbps", bkr, "get_gbps",
                                  bbr));
}

static void s_bench_disk(const opts_t *o)
{
    char dir[1024];
    if (strlen(o->disk) > 900)
        s_die(o->disk, "path too long");
    snprintf(dir, sizeof dir, "%s/kvt-bench-l2-disk-%d", o->disk, (int)getpid());
    if (mkdir(dir, 0700) != 0)
        s_die(dir, strerror(errno));
    if (!o->only || strcmp(o->only, "fio") == 0)
        s_bench_fio(o, dir);
    if (!o->only || strcmp(o->only, "open") == 0)
        s_bench_open(o, dir);
    if (!o->only || strcmp(o->only, "redis") == 0)
        s_bench_redis(o, dir);
    nftw(dir, s_rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* ---- main -------------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
    opts_t o = {.count = 64,
                .size = 4u << 20,
                .rounds = 3,
                .dir = "/dev/shm",
                .disk_bytes = 1024u << 20,
                .open_objects = 100000,
                .fs_opts = ""};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            o.quick = true;
            o.count = 8;
            o.size = 1u << 20;
            o.rounds = 1;
            o.disk_bytes = 64u << 20;
            o.open_objects = 5000;
        } else if (strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
            o.json_path = argv[++i];
        } else if (strcmp(argv[i], "--dir") == 0 && i + 1 < argc) {
            o.dir = argv[++i];
        } else if (strcmp(argv[i], "--count") == 0 && i + 1 < argc) {
            o.count = (uint32_t)strtoul(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--size") == 0 && i + 1 < argc) {
            uint64_t v = 0;
            if (kvt_size_parse(argv[++i], &v) != 0)
                v = 0;
            o.size = v;
        } else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) {
            o.rounds = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--disk") == 0 && i + 1 < argc) {
            o.disk = argv[++i];
        } else if (strcmp(argv[i], "--set") == 0 && i + 1 < argc && o.nsets < 8) {
            o.sets[o.nsets++] = argv[++i];
        } else if (strcmp(argv[i], "--fs-options") == 0 && i + 1 < argc) {
            o.fs_opts = argv[++i];
        } else if (strcmp(argv[i], "--disk-mib") == 0 && i + 1 < argc) {
            o.disk_bytes = strtoull(argv[++i], NULL, 10) << 20;
        } else if (strcmp(argv[i], "--open-objects") == 0 && i + 1 < argc) {
            o.open_objects = (uint32_t)strtoul(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc &&
                   (strcmp(argv[i + 1], "fio") == 0 || strcmp(argv[i + 1], "open") == 0 ||
                    strcmp(argv[i + 1], "redis") == 0)) {
            o.only = argv[++i];
        } else {
            fprintf(stderr,
                    "usage: %s [--quick] [--json FILE] [--dir DIR] [--count N] [--size BYTES] "
                    "[--rounds R] [--disk DIR [--only fio|open|redis]] [--disk-mib N] "
                    "[--open-objects N] [--fs-options OPTS] [--set KEY=VALUE]\n",
                    argv[0]);
            return 2;
        }
    }
    if (o.only && !o.disk) {
        fprintf(stderr, "kvt-bench-l2: --only needs --disk\n");
        return 2;
    }
    if (o.count == 0 || o.size == 0 || o.rounds < 1 || o.rounds > 8 || o.disk_bytes < (16u << 20) ||
        o.open_objects == 0) {
        fprintf(stderr, "kvt-bench-l2: --count and --size > 0, --rounds 1..8, --disk-mib >= 16, "
                        "--open-objects > 0\n");
        return 2;
    }
    kvt_log_set_level(KVT_LOG_ERROR);
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/kvt-bench-l2-%d", o.dir, (int)getpid());
    if (mkdir(dir, 0700) != 0)
        s_die(dir, strerror(errno));
    printf("kvt-bench-l2 %s (%s mode): %u objects of %llu bytes, best of %d rounds, fs in %s\n\n",
           KVT_VERSION, o.quick ? "quick" : "full", o.count, (unsigned long long)o.size, o.rounds,
           dir);
    s_out = json_pack("{s:s,s:s,s:i,s:I,s:i,s:s}", "bench", "kvt-bench-l2", "mode",
                      o.quick ? "quick" : "full", "count", (int)o.count, "size", (json_int_t)o.size,
                      "rounds", o.rounds, "dir", dir);
    double t0 = s_now();
    if (!o.only) {
        s_bench_hash(&o);
        char spec[4200];
        snprintf(spec, sizeof spec, "fs:%s/l2", dir);
        s_bench_adapter(&o, "fs", spec, dir);
        s_bench_adapter(&o, "mock", "mock:seed=1", NULL);
        s_bench_commit(&o);
    }
    nftw(dir, s_rm_one, 16, FTW_DEPTH | FTW_PHYS);
    if (o.disk)
        s_bench_disk(&o);
    double total = s_now() - t0;
    printf("\ntotal %.1f s\n", total);
    json_object_set_new(s_out, "total_seconds", json_real(total));
    if (o.json_path) {
        if (json_dump_file(s_out, o.json_path, JSON_INDENT(2)) != 0)
            s_die(o.json_path, "cannot write");
        printf("wrote %s\n", o.json_path);
    }
    json_decref(s_out);
    return 0;
}
