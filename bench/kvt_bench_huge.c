/* kvt-bench-huge: what a client pays to fault in a fresh mapping of the L1 arena, on 2 MiB
 * pages (hugetlbfs) against 4 KiB pages (/dev/shm), in the same run: each round opens the
 * arena file, maps it as a client does (MAP_SHARED, lazy), writes one byte per 4 KiB and
 * unmaps it. Both arenas are made by kvt_arena (l1.hugepages on / off), as the daemon makes
 * them.
 *
 *   build/kvt-bench-huge [--quick] [--json FILE]
 *
 * It needs root: it reserves the 2 MiB pages (vm.nr_hugepages, put back afterwards) and mounts
 * a private hugetlbfs (unmounted afterwards). Without root, or when the kernel will not
 * reserve the pages, it prints one line saying so and exits 0. The full run maps 1 GiB (twice,
 * 5 rounds each, < 10 s); --quick maps 64 MiB once and judges nothing. */
#include "kvt_arena.h"
#include "kvt_config.h"
#include "kvt_log.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define S_POOL "/proc/sys/vm/nr_hugepages"
#define S_FREE "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages"
#define S_HUGE (2ull << 20)

static double s_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static long s_read(const char *file)
{
    FILE *f = fopen(file, "re");
    long v = -1;
    if (f) {
        if (fscanf(f, "%ld", &v) != 1)
            v = -1;
        fclose(f);
    }
    return v;
}

static int s_write(const char *file, long v)
{
    FILE *f = fopen(file, "we");
    if (!f)
        return -1;
    int rc = fprintf(f, "%ld\n", v) < 0;
    return fclose(f) != 0 || rc ? -1 : 0;
}

static kvt_arena_t *s_arena(const char *size, const char *mode, const char *dir,
                            const char *run_dir)
{
    char err[KVT_ERR_LEN * 2] = "";
    kvt_config_t *cfg = kvt_config_new();
    kvt_arena_t *a = NULL;
    if (kvt_config_set(cfg, "l1_size", size, false, err, sizeof err) == 0 &&
        kvt_config_set(cfg, "allow_unpinned", "true", false, err, sizeof err) == 0 &&
        kvt_config_set(cfg, "run_dir", run_dir, false, err, sizeof err) == 0 &&
        kvt_config_set(cfg, "l1.hugepages", mode, false, err, sizeof err) == 0 &&
        kvt_config_set(cfg, "l1.hugepages_dir", dir, false, err, sizeof err) == 0 &&
        /* the arena alone: the fast path's rings would add their tail to it */
        kvt_config_set(cfg, "fastpath.enabled", "false", false, err, sizeof err) == 0 &&
        /* nothing kept in /dev/shm after the benchmark */
        kvt_config_set(cfg, "l1.adopt", "false", false, err, sizeof err) == 0)
        a = kvt_arena_new(cfg, err, sizeof err);
    if (!a)
        fprintf(stderr, "kvt-bench-huge: %s\n", err);
    kvt_config_destroy(&cfg);
    return a;
}

/* Seconds to map the arena file afresh and write one byte per 4 KiB of it, as a client's
 * first touch does; -1 when it cannot be mapped. */
static double s_first_touch(const kvt_arena_t *a)
{
    int fd = open(kvt_arena_path(a), O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t size = (size_t)kvt_arena_size(a);
    double t0 = s_now();
    volatile uint8_t *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return -1;
    for (size_t off = 0; off < size; off += 4096)
        p[off] = (uint8_t)off;
    double t = s_now() - t0;
    munmap((void *)p, size);
    return t;
}

int main(int argc, char **argv)
{
    bool quick = false;
    const char *json_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            quick = true;
        } else if (strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
            json_path = argv[++i];
        } else {
            fprintf(stderr, "usage: %s [--quick] [--json FILE]\n", argv[0]);
            return 2;
        }
    }
    kvt_log_set_level(KVT_LOG_WARN);
    const uint64_t size = quick ? 64ull << 20 : 1ull << 30;
    const char *size_s = quick ? "64M" : "1G";
    const int rounds = quick ? 1 : 5;
    const long pages = (long)(size / S_HUGE);

    if (geteuid() != 0) {
        printf("huge pages: skipped (not root: cannot reserve 2 MiB pages or mount hugetlbfs)\n");
        return 0;
    }
    long before = s_read(S_POOL), free0 = s_read(S_FREE);
    if (before < 0 || free0 < 0) {
        printf("huge pages: skipped (this kernel has no 2 MiB huge page pool)\n");
        return 0;
    }
    char dir[] = "/tmp/kvt-bench-huge-XXXXXX";
    if (!mkdtemp(dir)) {
        perror("kvt-bench-huge: mkdtemp");
        return 1;
    }
    char run_dir[sizeof dir + 8];
    snprintf(run_dir, sizeof run_dir, "%s/run", dir);
    char mnt[sizeof dir + 8];
    snprintf(mnt, sizeof mnt, "%s/mnt", dir);
    mkdir(run_dir, 0700);
    mkdir(mnt, 0700);
    bool mounted = false;
    int rc = 0;
    kvt_arena_t *huge = NULL, *small = NULL;
    if (s_write(S_POOL, before + pages) != 0 || s_read(S_FREE) < free0 + pages) {
        printf("huge pages: skipped (the kernel reserved %ld of the %ld 2 MiB pages asked for)\n",
               s_read(S_FREE) - free0, pages);
        goto out;
    }
    if (mount("none", mnt, "hugetlbfs", 0, "pagesize=2M") != 0) {
        printf("huge pages: skipped (cannot mount hugetlbfs: %s)\n", strerror(errno));
        goto out;
    }
    mounted = true;
    huge = s_arena(size_s, "on", mnt, run_dir);
    small = s_arena(size_s, "off", "", run_dir);
    if (!huge || !small || !kvt_arena_huge(huge) || kvt_arena_huge(small)) {
        rc = 1;
        goto out;
    }
    double best_small = 1e9, best_huge = 1e9;
    for (int r = 0; r < rounds; r++) {
        double s = s_first_touch(small), h = s_first_touch(huge);
        if (s < 0 || h < 0) {
            perror("kvt-bench-huge: mapping the arena");
            rc = 1;
            goto out;
        }
        best_small = s < best_small ? s : best_small;
        best_huge = h < best_huge ? h : best_huge;
    }
    double ratio = best_small / best_huge;
    printf("\nFirst touch of a fresh %s client mapping of the arena (one byte written per 4 KiB, "
           "best of %d)\n",
           size_s, rounds);
    printf("  4 KiB pages (/dev/shm)     %9.2f ms  %8.2f GiB/s\n", best_small * 1e3,
           (double)size / best_small / (1 << 30));
    printf("  2 MiB pages (hugetlbfs)    %9.2f ms  %8.2f GiB/s\n", best_huge * 1e3,
           (double)size / best_huge / (1 << 30));
    printf("  ratio                      %9.1fx  (target >= 5x)\n", ratio);
    if (json_path) {
        json_t *o = json_pack("{s:s,s:I,s:i,s:f,s:f,s:f}", "case", "first_touch", "mapping_bytes",
                              (json_int_t)size, "rounds", rounds, "small_pages_ms",
                              best_small * 1e3, "huge_pages_ms", best_huge * 1e3, "ratio", ratio);
        if (json_dump_file(o, json_path, JSON_INDENT(2)) != 0) {
            fprintf(stderr, "kvt-bench-huge: cannot write %s\n", json_path);
            rc = 1;
        }
        json_decref(o);
    }
out:
    kvt_arena_destroy(&huge);
    kvt_arena_destroy(&small);
    if (mounted && umount2(mnt, 0) != 0)
        fprintf(stderr, "kvt-bench-huge: cannot unmount %s: %s\n", mnt, strerror(errno));
    if (s_write(S_POOL, before) != 0)
        fprintf(stderr, "kvt-bench-huge: cannot put vm.nr_hugepages back to %ld\n", before);
    rmdir(mnt);
    rmdir(run_dir);
    rmdir(dir);
    return rc;
}
