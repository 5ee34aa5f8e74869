/* kvtier-bench: end-to-end benchmark of the kvtier daemon through libkvtier, each case with its
 * baseline measured in the same run and the ratio to it, judged against the targets of the
 * benchmarks issue (PASS / MISS; --quick judges nothing).
 *
 *   build/kvtier-bench [--quick] [--json FILE] [--daemon PATH] [--redis PATH] [--only CASES]
 *
 * DESIGN: the benchmark owns everything it measures. It makes a private run dir (mkdtemp),
 * spawns build/kvtierd there (ipc only, --http "", --l2 none unless the case needs L2, --l1-size
 * sized for the case), a redis-server on a free loopback port (no persistence) and an in-process
 * czmq ROUTER echo thread on another ipc path, and kills all of them at the end (children also
 * die with it: PR_SET_PDEATHSIG). Every loop is bounded by a count and a deadline; an alarm
 * ends a run that hangs. Cases:
 *   1 LOOKUP of a 64-key prefix (all hits), p50/p99/p999, vs a DEALER->ROUTER echo of the same
 *     request size;
 *   2 RESERVE->memcpy->COMMIT and ACQUIRE->memcpy->RELEASE of 4 MiB vs memcpy through the
 *     same arena mapping;
 *   3 inline PUT/GET of 4 MiB vs redis-server SET/GET via hiredis;
 *   4 PING and LOOKUP requests/s with 1, 8, 32 client threads (one kvtier_t each), with p99;
 *   5 store throughput with continuous eviction (4x L1 stored, --l2 none) vs below watermark;
 *   6 LOOKUP p99 while 16x4 MiB GETs run in another thread, and while a slow L2
 *     (mock:latency_ms=20) loads prefetches, vs the idle p99 of the same daemon;
 *   7 LOOKUP cost at 10k/100k/1M objects of 4 KiB and daemon RSS minus shared memory per
 *     object;
 *   8 one prompt of 16 chunks of 1 MiB stored and loaded through the LMCache door
 *     (--lmcache-listen: lookup, prepare/commit_store, lookup, prepare/commit_retrieve,
 *     end_session, from a DEALER speaking LMCache's wire) vs the same through protocol v1
 *     (LOOKUP, RESERVE, COMMIT, LOOKUP, ACQUIRE, RELEASE), p50 of the whole sequence;
 *   9 the fast path (issue 17) against the socket on daemon A, each client's transport chosen
 *     with KVTIER_FASTPATH at connect and checked with kvtier_fastpath_active: LOOKUP p50/p99
 *     vs the echo p50; one 4 MiB object per RESERVE/COMMIT and ACQUIRE/RELEASE vs memcpy;
 *     LOOKUP requests/s at 1-32 clients, best fast vs best socket; daemon CPU while 32
 *     fast-path clients sit idle;
 *  10 restart of a daemon whose L1 (8 GiB, or what /dev/shm and free memory allow) is 90% full
 *     of 1 MiB and 64 KiB objects: SIGTERM, start again (l1.adopt), exec -> /readyz 200 and
 *     exec -> first LOOKUP hit, exec -> every object verified, the verification's rate vs XXH3
 *     over the same bytes here (one thread).
 * Cases 1-8 use whatever transport libkvtier picks (the fast path, by default).
 * --quick is a smoke mode (< 20 s): small counts, same code paths, no verdicts. */
#include "kvtier.h"

#include <czmq.h>
#include <errno.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <jansson.h>
#include <msgpack.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>
#include <zmq.h>

#define MiB (1024ull * 1024ull)
#define LOOKUP_KEYS 64
/* bytes of a 64-key LOOKUP request on the wire (header + msgpack map with ns and 64 bin16 keys),
 * the size of the echo baseline's message */
#define ECHO_BYTES (64 * 18 + 64)
#define BIG (4 * MiB)
#define CALL_TIMEOUT_MS 20000
#define MAX_THREADS 32

typedef uint8_t key16_t[KVTIER_KEY_LEN];

typedef struct {
    bool quick;
    const char *json_path;
    const char *daemon;
    const char *redis;
    char run_dir[128];
    const char *only; /* --only 1,3,6a: the cases to run; NULL: all */
} opts_t;

typedef struct {
    pid_t pid;
    char endpoint[300];
    char dir[200];
} daemon_t;

static opts_t s_opt;

/* Whether case `c` ("1", "6a") was asked for: --only lists cases separated by commas; "6"
 * selects 6a and 6b. */
static bool s_want(const char *c)
{
    if (!s_opt.only)
        return true;
    for (const char *p = s_opt.only; *p;) {
        size_t n = strcspn(p, ",");
        if ((n == strlen(c) && !strncmp(p, c, n)) ||
            (n == 1 && !strncmp(p, c, 1) && strlen(c) == 2 && c[1] >= 'a'))
            return true;
        p += n + (p[n] == ',');
    }
    return false;
}
static json_t *s_json;
static int s_npass, s_nmiss, s_nerr;
static pid_t s_children[8];
static int s_nchildren;

/* ---- small helpers ------------------------------------------------------------------------ */

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

/* 128-bit chunk-hash-like keys, distinct per (tag, id). */
static void s_key(uint8_t *k, uint64_t id, uint64_t tag)
{
    uint64_t a = s_mix(id ^ (tag << 48)), b = s_mix(a ^ id);
    memcpy(k, &a, 8);
    memcpy(k + 8, &b, 8);
}

static key16_t *s_keys(uint32_t n, uint64_t tag)
{
    key16_t *k = malloc((size_t)n * sizeof *k);
    if (!k) {
        fprintf(stderr, "kvtier-bench: out of memory\n");
        exit(1);
    }
    for (uint32_t i = 0; i < n; i++)
        s_key(k[i], i, tag);
    return k;
}

static void *s_xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "kvtier-bench: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

static int s_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Percentile q (0..1) of v[0..n), sorting v in place; microseconds in, microseconds out. */
static double s_pct(double *v, size_t n, double q)
{
    if (!n)
        return 0;
    qsort(v, n, sizeof *v, s_cmp_double);
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

static void s_fail(const char *what, int rc, kvtier_t *c)
{
    fprintf(stderr, "kvtier-bench: %s failed: %s (%s)\n", what, kvtier_strerror(rc),
            c ? kvtier_last_error(c) : "");
    s_nerr++;
}

/* ---- results ------------------------------------------------------------------------------ */

/* One line of the table and of the JSON: `value` and `base` in `unit`, `ratio` as the case
 * defines it (NAN: none), `target` a sentence, `judge` whether the line gets a verdict. */
static void s_row(int ncase, const char *what, double value, double base, const char *unit,
                  double ratio, const char *target, bool judge, bool pass)
{
    const char *verdict = "-";
    if (judge && !s_opt.quick) {
        verdict = pass ? "PASS" : "MISS";
        if (pass)
            s_npass++;
        else
            s_nmiss++;
    }
    char vb[32], bb[32], rb[32];
    snprintf(vb, sizeof vb, "%.4g", value);
    snprintf(bb, sizeof bb, base == base ? "%.4g" : "-", base);
    snprintf(rb, sizeof rb, ratio == ratio ? "%.3g" : "-", ratio);
    printf("%-2d %-46s %10s %10s %-7s %7s  %-24s %s\n", ncase, what, vb, bb, unit, rb,
           target ? target : "", verdict);
    fflush(stdout);
    json_t *o = json_pack("{s:i, s:s, s:f, s:s, s:s, s:s}", "case", ncase, "what", what,
                          "value", value, "unit", unit, "target", target ? target : "",
                          "verdict", verdict);
    if (base == base)
        json_object_set_new(o, "baseline", json_real(base));
    if (ratio == ratio)
        json_object_set_new(o, "ratio", json_real(ratio));
    json_array_append_new(json_object_get(s_json, "results"), o);
}

static double s_t0;

static void s_header(const char *title)
{
    printf("-- %s [t=%.1f s]\n", title, s_now() - s_t0);
}

/* ---- child processes ---------------------------------------------------------------------- */

static pid_t s_spawn(char *const argv[], const char *log)
{
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        exit(1);
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        int nul = open("/dev/null", O_RDONLY);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        if (nul >= 0)
            dup2(nul, 0);
        execv(argv[0], argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    if (s_nchildren < (int)(sizeof s_children / sizeof s_children[0]))
        s_children[s_nchildren++] = pid;
    return pid;
}

/* SIGTERM, then SIGKILL after 10 s. */
static void s_stop(pid_t pid)
{
    if (pid <= 0)
        return;
    kill(pid, SIGTERM);
    for (int i = 0; i < 1000; i++) {
        if (waitpid(pid, NULL, WNOHANG) == pid)
            goto gone;
        usleep(10000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
gone:
    for (int i = 0; i < s_nchildren; i++)
        if (s_children[i] == pid)
            s_children[i] = 0;
}

static void s_on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "kvtier-bench: time limit reached, killing children\n";
    if (write(2, msg, sizeof msg - 1) < 0) {
    }
    for (int i = 0; i < s_nchildren; i++)
        if (s_children[i] > 0)
            kill(s_children[i], SIGKILL);
    _exit(3);
}

static int s_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

static kvtier_t *s_connect(const daemon_t *d, const char *instance, int timeout_ms)
{
    char err[256] = "";
    kvtier_t *c = kvtier_connect(d->endpoint, "kvtier-bench", instance, timeout_ms, err,
                                 sizeof err);
    if (!c && timeout_ms >= CALL_TIMEOUT_MS)
        fprintf(stderr, "kvtier-bench: connect %s: %s\n", d->endpoint, err);
    return c;
}

/* Spawns kvtierd on its own dir under the run dir (the same dir for the same name) and returns
 * at once. extra: NULL, or more arguments (NULL-terminated, at most 8) appended to its command
 * line (a later --http replaces the "" given here). */
static void s_daemon_spawn(daemon_t *d, const char *name, const char *l1_size, const char *l2,
                           const char *hwm, const char *lwm, const char *const *extra)
{
    snprintf(d->dir, sizeof d->dir, "%s/%s", s_opt.run_dir, name);
    mkdir(d->dir, 0700);
    char data[320], log[320];
    snprintf(data, sizeof data, "%s/data", d->dir);
    snprintf(log, sizeof log, "%s/kvtierd.log", d->dir);
    mkdir(data, 0700);
    snprintf(d->endpoint, sizeof d->endpoint, "ipc://%s/kvtier.sock", d->dir);
    char *argv[32];
    int n = 0;
    argv[n++] = (char *)s_opt.daemon;
    argv[n++] = "--run-dir";
    argv[n++] = d->dir;
    argv[n++] = "--data-dir";
    argv[n++] = data;
    argv[n++] = "--listen";
    argv[n++] = d->endpoint;
    argv[n++] = "--http";
    argv[n++] = "";
    argv[n++] = "--l1-size";
    argv[n++] = (char *)l1_size;
    argv[n++] = "--l2";
    argv[n++] = (char *)l2;
    argv[n++] = "--log-level";
    argv[n++] = "warn";
    argv[n++] = "--allow-unpinned";
    argv[n++] = "--lease-ms";
    argv[n++] = "120000";
    if (hwm) {
        argv[n++] = "--high-watermark";
        argv[n++] = (char *)hwm;
        argv[n++] = "--low-watermark";
        argv[n++] = (char *)lwm;
    }
    for (int i = 0; extra && extra[i] && i < 8; i++)
        argv[n++] = (char *)extra[i];
    argv[n] = NULL;
    d->pid = s_spawn(argv, log);
}

/* Starts kvtierd (s_daemon_spawn); waits (<= 90 s) until it answers HELLO. */
static bool s_daemon_start_ex(daemon_t *d, const char *name, const char *l1_size, const char *l2,
                              const char *hwm, const char *lwm, const char *const *extra)
{
    s_daemon_spawn(d, name, l1_size, l2, hwm, lwm, extra);
    char log[320];
    snprintf(log, sizeof log, "%s/kvtierd.log", d->dir);
    double deadline = s_now() + 90;
    while (s_now() < deadline) {
        if (waitpid(d->pid, NULL, WNOHANG) == d->pid) {
            fprintf(stderr, "kvtier-bench: kvtierd (%s) exited at start; see %s\n", name, log);
            d->pid = 0;
            s_nerr++;
            return false;
        }
        kvtier_t *c = s_connect(d, "probe", 300);
        if (c) {
            kvtier_close(&c);
            return true;
        }
        usleep(50000);
    }
    fprintf(stderr, "kvtier-bench: kvtierd (%s) not ready in 90 s; see %s\n", name, log);
    s_stop(d->pid);
    d->pid = 0;
    s_nerr++;
    return false;
}

static bool s_daemon_start(daemon_t *d, const char *name, const char *l1_size, const char *l2,
                           const char *hwm, const char *lwm)
{
    return s_daemon_start_ex(d, name, l1_size, l2, hwm, lwm, NULL);
}

/* The arena a stopped daemon kept for its successor (l1.adopt, the default: the benchmark
 * measures that configuration) is the benchmark's to remove: the header record of
 * RUN_DIR/kvtier-l1.journal names it (storage/kvt_journal.h: u32 length, 4 bytes, then 56
 * bytes of numbers before the path). */
static void s_remove_kept_arena(const daemon_t *d)
{
    char path[400];
    snprintf(path, sizeof path, "%s/kvtier-l1.journal", d->dir);
    FILE *f = fopen(path, "rb");
    if (!f)
        return;
    uint8_t head[8 + 56 + 1024];
    size_t got = fread(head, 1, sizeof head, f);
    fclose(f);
    uint32_t len = got >= 8 ? (uint32_t)head[0] | (uint32_t)head[1] << 8 | (uint32_t)head[2] << 16 |
                                  (uint32_t)head[3] << 24
                            : 0;
    if (len <= 56 || 8 + (size_t)len > got)
        return;
    char arena[1025];
    memcpy(arena, head + 8 + 56, len - 56);
    arena[len - 56] = '\0';
    const char *base = strrchr(arena, '/');
    size_t n = strlen(arena);
    if (base && strncmp(base + 1, "kvtier-", 7) == 0 && n > 3 && strcmp(arena + n - 3, "-l1") == 0)
        unlink(arena);
}

static void s_daemon_stop(daemon_t *d)
{
    s_stop(d->pid);
    d->pid = 0;
    s_remove_kept_arena(d);
}

/* CPU time (user + system, all threads) the process has used, in seconds; -1 when unknown. */
static double s_cpu_seconds(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* fields after the command name, which is in parentheses and may hold spaces */
    const char *p = strrchr(buf, ')');
    unsigned long long ut = 0, st = 0;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut,
                     &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* Daemon RSS minus its shared memory (the arena), in bytes, from /proc/PID/status. */
static int64_t s_private_rss(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    long long rss = -1, shm = 0, v;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "VmRSS: %lld kB", &v) == 1)
            rss = v;
        else if (sscanf(line, "RssShmem: %lld kB", &v) == 1)
            shm = v;
    }
    fclose(f);
    return rss < 0 ? -1 : (int64_t)(rss - shm) * 1024;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* Maps every page of this client's arena mapping writable now (MADV_POPULATE_WRITE: page tables
 * only, contents unchanged), then reads a byte of each, so that no case times the first touches
 * of its mapping: under a hypervisor that shadows page tables the first access to a page still
 * exits to it after the populate (about 5 us a page on the development VM: a 4 MiB RESERVE +
 * memcpy + COMMIT into untouched pages ran at 1.7 GB/s, 0.08x memcpy). */
static void s_prefault(kvtier_t *c)
{
    size_t size = 0;
    char *a = kvtier_arena(c, &size);
    if (!a || !size)
        return;
    if (madvise(a, size, MADV_POPULATE_WRITE) != 0)
        fprintf(stderr, "kvtier-bench: MADV_POPULATE_WRITE: %s (first touches are timed)\n",
                strerror(errno));
    else
        for (size_t p = 0; p < size; p += 4096)
            (void)*(volatile const char *)(a + p);
}

/* ---- common operations -------------------------------------------------------------------- */

/* Stores n objects of `size` bytes (keys[i]) with RESERVE (batches of `batch`) + COMMIT,
 * copying `src` (when not NULL) into each slot. Retries a partial reservation and no_space (the
 * eviction catching up) within a deadline of 60 s. Returns the count stored, or -1. */
static int64_t s_store(kvtier_t *c, const char *ns, const key16_t *keys, uint32_t n,
                       uint64_t size, const void *src, uint32_t batch, uint64_t *retries)
{
    kvtier_slot_t slots[64];
    if (batch > 64)
        batch = 64;
    uint32_t i = 0;
    double deadline = s_now() + 60;
    while (i < n) {
        uint32_t want = n - i < batch ? n - i : batch, got = 0;
        uint64_t lease = 0;
        int rc = kvtier_reserve(c, ns, NULL, keys + i, want, NULL, size, slots, &got, &lease);
        if (rc == KVTIER_ENOSPC || (rc == 0 && got == 0)) {
            if (lease)
                kvtier_commit(c, lease, NULL, 0, NULL);
            if (retries)
                (*retries)++;
            if (s_now() > deadline) {
                fprintf(stderr, "kvtier-bench: store: no space for 60 s\n");
                return -1;
            }
            usleep(500);
            continue;
        }
        if (rc) {
            s_fail("reserve", rc, c);
            return -1;
        }
        if (src)
            for (uint32_t j = 0; j < got; j++)
                if (slots[j].ptr)
                    memcpy(slots[j].ptr, src, size);
        rc = kvtier_commit(c, lease, NULL, 0, NULL);
        if (rc) {
            s_fail("commit", rc, c);
            return -1;
        }
        if (got < want && retries)
            (*retries)++;
        i += got;
    }
    return i;
}

static void s_remove_all(kvtier_t *c, const char *ns, const key16_t *keys, uint32_t n)
{
    for (uint32_t i = 0; i < n; i += 64) {
        uint32_t m = n - i < 64 ? n - i : 64;
        kvtier_remove(c, ns, NULL, keys + i, m, NULL);
    }
}

/* n LOOKUPs of keys[0..LOOKUP_KEYS) into lat[] (µs); returns the count that hit fully. */
static uint32_t s_lookups(kvtier_t *c, const char *ns, const key16_t *keys, uint32_t n,
                          double *lat, double max_s)
{
    uint32_t ok = 0, i;
    double deadline = s_now() + max_s;
    for (i = 0; i < n; i++) {
        uint32_t hits = 0;
        double t0 = s_now();
        int rc = kvtier_lookup(c, ns, NULL, keys, LOOKUP_KEYS, 0, &hits, NULL, NULL, NULL);
        lat[i] = (s_now() - t0) * 1e6;
        if (rc) {
            s_fail("lookup", rc, c);
            break;
        }
        ok += hits == LOOKUP_KEYS;
        if ((i & 255) == 255 && s_now() > deadline) {
            i++;
            break;
        }
    }
    return ok == i ? i : ok;
}

/* ---- case 1: LOOKUP vs echo --------------------------------------------------------------- */

static volatile int s_echo_stop;

static void *s_echo_thread(void *arg)
{
    zsock_t *router = arg;
    while (!s_echo_stop) {
        zmsg_t *m = zmsg_recv(router);
        if (!m)
            continue;
        zmsg_send(&m, router);
    }
    return NULL;
}

/* p50/p99/p999 of a DEALER->ROUTER round trip of ECHO_BYTES over ipc, czmq on both ends. */
static bool s_echo(uint32_t n, double out[3])
{
    char ep[320];
    snprintf(ep, sizeof ep, "ipc://%s/echo.sock", s_opt.run_dir);
    zsock_t *router = zsock_new_router(ep);
    zsock_t *dealer = zsock_new_dealer(ep);
    if (!router || !dealer) {
        fprintf(stderr, "kvtier-bench: echo sockets on %s failed\n", ep);
        zsock_destroy(&router);
        zsock_destroy(&dealer);
        s_nerr++;
        return false;
    }
    zsock_set_rcvtimeo(router, 100);
    zsock_set_rcvtimeo(dealer, 5000);
    s_echo_stop = 0;
    pthread_t th;
    pthread_create(&th, NULL, s_echo_thread, router);
    char *buf = s_xmalloc(ECHO_BYTES);
    memset(buf, 0xA5, ECHO_BYTES);
    double *lat = s_xmalloc(n * sizeof *lat);
    uint32_t i;
    bool ok = true;
    for (i = 0; i < n + n / 10; i++) { /* the first n/10 are warm-up */
        double t0 = s_now();
        zframe_t *f = zframe_new(buf, ECHO_BYTES);
        zframe_send(&f, dealer, 0);
        zframe_t *r = zframe_recv(dealer);
        double dt = (s_now() - t0) * 1e6;
        if (!r) {
            fprintf(stderr, "kvtier-bench: echo reply timed out\n");
            ok = false;
            s_nerr++;
            break;
        }
        zframe_destroy(&r);
        if (i >= n / 10)
            lat[i - n / 10] = dt;
    }
    s_echo_stop = 1;
    pthread_join(th, NULL);
    if (ok) {
        out[0] = s_pct(lat, n, 0.50);
        out[1] = s_pct(lat, n, 0.99);
        out[2] = s_pct(lat, n, 0.999);
    }
    free(lat);
    free(buf);
    zsock_destroy(&dealer);
    zsock_destroy(&router);
    return ok;
}

static void s_case_lookup(const daemon_t *d, const key16_t *lk, double *idle_p99)
{
    s_header("case 1: LOOKUP of a 64-key prefix (all hits) vs DEALER->ROUTER echo");
    uint32_t n = s_opt.quick ? 500 : 20000;
    double echo[3];
    if (!s_echo(n, echo))
        return;
    kvtier_t *c = s_connect(d, "c1", CALL_TIMEOUT_MS);
    if (!c) {
        s_nerr++;
        return;
    }
    double *lat = s_xmalloc(n * sizeof *lat);
    s_lookups(c, "bench", lk, n / 10, lat, 10); /* warm-up */
    uint32_t got = s_lookups(c, "bench", lk, n, lat, 60);
    if (got < n)
        fprintf(stderr, "kvtier-bench: case 1: %u of %u LOOKUPs were full hits\n", got, n);
    double p50 = s_pct(lat, got, 0.50), p99 = s_pct(lat, got, 0.99);
    double p999 = s_pct(lat, got, 0.999);
    *idle_p99 = p99;
    s_row(1, "LOOKUP 64 keys p50 (base: echo p50)", p50, echo[0], "us", p50 / echo[0],
          "<= 1.5x echo p50", true, p50 <= 1.5 * echo[0]);
    s_row(1, "LOOKUP 64 keys p99 (base: echo p50)", p99, echo[0], "us", p99 / echo[0],
          "<= 3x echo p50", true, p99 <= 3 * echo[0]);
    s_row(1, "LOOKUP 64 keys p999 (base: echo p999)", p999, echo[2], "us", p999 / echo[2], "",
          false, false);
    s_row(1, "echo p99 (1216 B DEALER->ROUTER, ipc)", echo[1], NAN, "us", NAN, "", false, false);
    free(lat);
    kvtier_close(&c);
}

/* ---- case 2: shared-memory store / retrieve of 4 MiB vs memcpy ---------------------------- */

static void s_case_shm(const daemon_t *d)
{
    s_header("case 2: 4 MiB via shared memory (RESERVE/COMMIT, ACQUIRE/RELEASE) vs memcpy");
    uint32_t nobj = s_opt.quick ? 8 : 96, rounds = s_opt.quick ? 1 : 4;
    kvtier_t *c = s_connect(d, "c2", CALL_TIMEOUT_MS);
    if (!c) {
        s_nerr++;
        return;
    }
    size_t asize = 0;
    uint8_t *arena = kvtier_arena(c, &asize);
    if (!arena || asize < (nobj + 1) * BIG) {
        fprintf(stderr, "kvtier-bench: case 2: arena not mapped or too small\n");
        s_nerr++;
        kvtier_close(&c);
        return;
    }
    s_prefault(c);
    uint8_t *src = s_xmalloc(BIG), *dst = s_xmalloc(BIG);
    for (size_t i = 0; i < BIG; i++)
        src[i] = (uint8_t)s_mix(i);
    memset(dst, 0, BIG);
    /* baseline: memcpy into / out of the same mapping, nothing stored yet (free arena space);
     * the first pass also maps the pages in this process, as the kvtier passes need too */
    for (uint32_t i = 0; i < nobj; i++)
        memcpy(arena + (size_t)i * BIG, src, BIG);
    double t0 = s_now();
    for (uint32_t r = 0; r < rounds; r++)
        for (uint32_t i = 0; i < nobj; i++)
            memcpy(arena + (size_t)i * BIG, src, BIG);
    double base_w = (double)rounds * nobj * BIG / (s_now() - t0) / 1e9;
    t0 = s_now();
    for (uint32_t r = 0; r < rounds; r++)
        for (uint32_t i = 0; i < nobj; i++)
            memcpy(dst, arena + (size_t)i * BIG, BIG);
    double base_r = (double)rounds * nobj * BIG / (s_now() - t0) / 1e9;

    key16_t *keys = s_keys(nobj, 2);
    double store_s = 0;
    bool ok = true;
    for (uint32_t r = 0; r < rounds && ok; r++) {
        s_remove_all(c, "bench2", keys, nobj);
        t0 = s_now();
        ok = s_store(c, "bench2", keys, nobj, BIG, src, 1, NULL) == nobj;
        store_s += s_now() - t0;
    }
    /* load_s[1]: the same with kvtier_release_async (the RELEASE is not waited for) */
    double load_s[2] = {0, 0};
    kvtier_slot_t slot;
    for (uint32_t r = 0; r < rounds && ok; r++) {
        for (int async = 0; async < 2 && ok; async++) {
            t0 = s_now();
            for (uint32_t i = 0; i < nobj && ok; i++) {
                uint32_t got = 0;
                uint64_t lease = 0;
                int rc = kvtier_acquire(c, "bench2", NULL, keys + i, 1, &slot, &got, &lease);
                if (rc || got != 1) {
                    s_fail("acquire", rc ? rc : KVTIER_ENOTFOUND, c);
                    ok = false;
                    break;
                }
                memcpy(dst, slot.ptr, BIG);
                rc = async ? kvtier_release_async(c, lease) : kvtier_release(c, lease);
                if (rc) {
                    s_fail("release", rc, c);
                    ok = false;
                }
            }
            load_s[async] += s_now() - t0;
        }
    }
    /* the same, 16 objects per RESERVE / ACQUIRE (an engine stores a prompt's chunks at once) */
    double bstore_s = 0, bload_s = 0;
    kvtier_slot_t bs[16];
    for (uint32_t r = 0; r < rounds && ok; r++) {
        s_remove_all(c, "bench2", keys, nobj);
        t0 = s_now();
        ok = s_store(c, "bench2", keys, nobj, BIG, src, 16, NULL) == nobj;
        bstore_s += s_now() - t0;
        t0 = s_now();
        for (uint32_t i = 0; i < nobj && ok; i += 16) {
            uint32_t want = nobj - i < 16 ? nobj - i : 16, got = 0;
            uint64_t lease = 0;
            int rc = kvtier_acquire(c, "bench2", NULL, keys + i, want, bs, &got, &lease);
            if (rc || got != want) {
                s_fail("acquire", rc ? rc : KVTIER_ENOTFOUND, c);
                ok = false;
                break;
            }
            for (uint32_t j = 0; j < got; j++)
                memcpy(dst, bs[j].ptr, BIG);
            kvtier_release(c, lease);
        }
        bload_s += s_now() - t0;
    }
    if (ok && memcmp(dst, src, BIG) != 0) {
        fprintf(stderr, "kvtier-bench: case 2: retrieved bytes differ from stored ones\n");
        s_nerr++;
        ok = false;
    }
    s_remove_all(c, "bench2", keys, nobj);
    if (ok) {
        double w = (double)rounds * nobj * BIG / store_s / 1e9;
        double rd = (double)rounds * nobj * BIG / load_s[0] / 1e9;
        s_row(2, "store RESERVE+memcpy+COMMIT 4 MiB (b: memcpy)", w, base_w, "GB/s", w / base_w,
              ">= 0.8x memcpy", true, w >= 0.8 * base_w);
        s_row(2, "load ACQUIRE+memcpy+RELEASE 4 MiB (b: memcpy)", rd, base_r, "GB/s",
              rd / base_r, ">= 0.8x memcpy", true, rd >= 0.8 * base_r);
        rd = (double)rounds * nobj * BIG / load_s[1] / 1e9;
        s_row(2, "  load, RELEASE not waited for (b: memcpy)", rd, base_r, "GB/s", rd / base_r,
              "", false, false);
        w = (double)rounds * nobj * BIG / bstore_s / 1e9;
        rd = (double)rounds * nobj * BIG / bload_s / 1e9;
        s_row(2, "  store, 16 objects per RESERVE (b: memcpy)", w, base_w, "GB/s", w / base_w, "",
              false, false);
        s_row(2, "  load, 16 objects per ACQUIRE (b: memcpy)", rd, base_r, "GB/s", rd / base_r,
              "", false, false);
    }
    free(keys);
    free(src);
    free(dst);
    kvtier_close(&c);
}

/* ---- case 3: inline PUT/GET of 4 MiB vs Redis SET/GET ------------------------------------- */

static pid_t s_redis_start(int *port_out, redisContext **rc_out)
{
    int port = s_free_port();
    char pbuf[16], log[320];
    snprintf(pbuf, sizeof pbuf, "%d", port);
    snprintf(log, sizeof log, "%s/redis.log", s_opt.run_dir);
    char *argv[] = {(char *)s_opt.redis, "--port", pbuf, "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", s_opt.run_dir, "--protected-mode", "yes",
                    NULL};
    pid_t pid = s_spawn(argv, log);
    double deadline = s_now() + 10;
    while (s_now() < deadline) {
        struct timeval tv = {.tv_sec = 1};
        redisContext *r = redisConnectWithTimeout("127.0.0.1", port, tv);
        if (r && !r->err) {
            redisReply *rep = redisCommand(r, "PING");
            bool up = rep && rep->type == REDIS_REPLY_STATUS;
            if (rep)
                freeReplyObject(rep);
            if (up) {
                redisSetTimeout(r, (struct timeval){.tv_sec = 20});
                *port_out = port;
                *rc_out = r;
                return pid;
            }
        }
        if (r)
            redisFree(r);
        if (waitpid(pid, NULL, WNOHANG) == pid)
            break;
        usleep(50000);
    }
    fprintf(stderr, "kvtier-bench: redis-server did not start; see %s\n", log);
    s_stop(pid);
    return 0;
}

static void s_case_inline(const daemon_t *d)
{
    s_header("case 3: inline PUT/GET of 4 MiB vs redis-server SET/GET (hiredis, loopback)");
    uint32_t n = s_opt.quick ? 8 : 64, rounds = s_opt.quick ? 1 : 3;
    int port = 0;
    redisContext *r = NULL;
    pid_t rpid = s_redis_start(&port, &r);
    if (!rpid) {
        s_nerr++;
        return;
    }
    kvtier_t *c = s_connect(d, "c3", CALL_TIMEOUT_MS);
    if (!c) {
        s_nerr++;
        redisFree(r);
        s_stop(rpid);
        return;
    }
    uint8_t *val = s_xmalloc(BIG);
    for (size_t i = 0; i < BIG; i++)
        val[i] = (uint8_t)s_mix(i * 7);
    key16_t *keys = s_keys(n, 3);
    size_t m = (size_t)n * rounds;
    double *kput = s_xmalloc(m * sizeof(double)), *kget = s_xmalloc(m * sizeof(double));
    double *kgz = s_xmalloc(m * sizeof(double));
    double *rset = s_xmalloc(m * sizeof(double)), *rget = s_xmalloc(m * sizeof(double));
    bool ok = true;
    size_t k = 0;
    for (uint32_t rd = 0; rd < rounds && ok; rd++) {
        s_remove_all(c, "bench3", keys, n);
        redisReply *rep = redisCommand(r, "FLUSHALL");
        if (rep)
            freeReplyObject(rep);
        for (uint32_t i = 0; i < n && ok; i++, k++) {
            const void *data = val;
            size_t len = BIG;
            uint32_t stored = 0;
            double t0 = s_now();
            int rc = kvtier_put(c, "bench3", NULL, keys + i, 1, &data, &len, &stored);
            kput[k] = (s_now() - t0) * 1e6;
            if (rc) {
                s_fail("put", rc, c);
                ok = false;
                break;
            }
            t0 = s_now();
            rep = redisCommand(r, "SET %b %b", keys[i], (size_t)KVTIER_KEY_LEN, val, len);
            rset[k] = (s_now() - t0) * 1e6;
            if (!rep || rep->type != REDIS_REPLY_STATUS) {
                fprintf(stderr, "kvtier-bench: redis SET failed\n");
                ok = false;
                s_nerr++;
            }
            if (rep)
                freeReplyObject(rep);
        }
        for (uint32_t i = 0; i < n && ok; i++) {
            kvtier_buf_t buf = {0};
            uint32_t found = 0;
            double t0 = s_now();
            int rc = kvtier_get(c, "bench3", NULL, keys + i, 1, &buf, &found);
            kget[k - n + i] = (s_now() - t0) * 1e6;
            if (rc || found != 1 || buf.len != BIG) {
                s_fail("get", rc ? rc : KVTIER_ENOTFOUND, c);
                ok = false;
            }
            if (rd == 0 && i == 0 && ok && memcmp(buf.data, val, BIG) != 0) {
                fprintf(stderr, "kvtier-bench: case 3: GET bytes differ from PUT ones\n");
                ok = false;
                s_nerr++;
            }
            free(buf.data);
            /* the zero-copy GET: bytes read in place, then the frames freed */
            kvtier_frames_t *fr = NULL;
            t0 = s_now();
            rc = kvtier_get_frames(c, "bench3", NULL, keys + i, 1, &buf, &found, &fr);
            kgz[k - n + i] = (s_now() - t0) * 1e6;
            if (ok && (rc || found != 1 || buf.len != BIG ||
                       (rd == 0 && i == 0 && memcmp(buf.data, val, BIG) != 0))) {
                s_fail("get_frames", rc ? rc : KVTIER_ENOTFOUND, c);
                ok = false;
            }
            kvtier_frames_free(&fr);
            t0 = s_now();
            rep = redisCommand(r, "GET %b", keys[i], (size_t)KVTIER_KEY_LEN);
            rget[k - n + i] = (s_now() - t0) * 1e6;
            if (!rep || rep->type != REDIS_REPLY_STRING || rep->len != BIG) {
                fprintf(stderr, "kvtier-bench: redis GET failed\n");
                ok = false;
                s_nerr++;
            }
            if (rep)
                freeReplyObject(rep);
        }
    }
    s_remove_all(c, "bench3", keys, n);
    if (ok) {
        double kp = s_pct(kput, m, 0.5), kg = s_pct(kget, m, 0.5), kz = s_pct(kgz, m, 0.5);
        double rs = s_pct(rset, m, 0.5), rg = s_pct(rget, m, 0.5);
        s_row(3, "GET 4 MiB p50, zero-copy (b: Redis GET p50)", kz, rg, "us", rg / kz,
              ">= 1.5x Redis", true, rg / kz >= 1.5);
        s_row(3, "GET 4 MiB p50, copy to malloc (b: Redis)", kg, rg, "us", rg / kg, "", false,
              false);
        s_row(3, "PUT 4 MiB p50 (b: Redis SET p50), speedup", kp, rs, "us", rs / kp, "", false,
              false);
        s_row(3, "GET 4 MiB p99 (b: Redis GET p99)", s_pct(kget, m, 0.99),
              s_pct(rget, m, 0.99), "us", NAN, "", false, false);
    }
    free(kput);
    free(kget);
    free(kgz);
    free(rset);
    free(rget);
    free(keys);
    free(val);
    kvtier_close(&c);
    redisFree(r);
    s_stop(rpid);
}

/* ---- case 4: control requests/s with 1, 8, 32 clients ------------------------------------- */

typedef struct {
    const daemon_t *d;
    const key16_t *keys;
    bool lookup;
    int idx;
    double *lat;
    size_t cap, n;
    double dur;
    pthread_barrier_t *bar;
    int fast; /* 1: the fast path must be in use; 0: the socket; -1: whatever libkvtier picks */
    int err;
} load_t;

static void *s_load_thread(void *arg)
{
    load_t *t = arg;
    char inst[32];
    snprintf(inst, sizeof inst, "c4-%d", t->idx);
    kvtier_t *c = s_connect(t->d, inst, CALL_TIMEOUT_MS);
    pthread_barrier_wait(t->bar); /* all connected: the caller may put KVTIER_FASTPATH back */
    if (!c) {
        t->err = 1;
        return NULL;
    }
    if (t->fast >= 0 && kvtier_fastpath_active(c) != t->fast) {
        fprintf(stderr, "kvtier-bench: client %d: fast path %s, wanted %s\n", t->idx,
                kvtier_fastpath_active(c) ? "on" : "off", t->fast ? "on" : "off");
        t->err = KVTIER_EUNAVAIL;
        kvtier_close(&c);
        return NULL;
    }
    double end = s_now() + t->dur;
    while (t->n < t->cap) {
        double t0 = s_now();
        uint32_t hits = 0;
        int rc = t->lookup ? kvtier_lookup(c, "bench", NULL, t->keys, LOOKUP_KEYS, 0, &hits,
                                           NULL, NULL, NULL)
                           : kvtier_ping(c);
        double t1 = s_now();
        if (rc) {
            t->err = rc;
            break;
        }
        t->lat[t->n++] = (t1 - t0) * 1e6;
        if (t1 >= end)
            break;
    }
    kvtier_close(&c);
    return NULL;
}

/* Runs nthr clients for dur seconds; returns the aggregate rate, *p99 in µs. */
static double s_load(const daemon_t *d, const key16_t *keys, bool lookup, int nthr, double dur,
                     double *p99, double *cpu_us, int fast)
{
    /* libkvtier reads KVTIER_FASTPATH at connect: set while the threads connect, and only
     * then (no other thread reads the environment meanwhile) */
    if (fast >= 0)
        setenv("KVTIER_FASTPATH", fast ? "1" : "0", 1);
    double cpu0 = s_cpu_seconds(d->pid);
    load_t t[MAX_THREADS];
    pthread_t th[MAX_THREADS];
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)nthr + 1);
    size_t cap = 400000;
    for (int i = 0; i < nthr; i++) {
        t[i] = (load_t){.d = d, .keys = keys, .lookup = lookup, .idx = i, .cap = cap,
                        .dur = dur, .bar = &bar, .fast = fast};
        t[i].lat = s_xmalloc(cap * sizeof(double));
        pthread_create(&th[i], NULL, s_load_thread, &t[i]);
    }
    pthread_barrier_wait(&bar);
    if (fast >= 0)
        unsetenv("KVTIER_FASTPATH");
    double t0 = s_now();
    for (int i = 0; i < nthr; i++)
        pthread_join(th[i], NULL);
    double el = s_now() - t0;
    pthread_barrier_destroy(&bar);
    size_t total = 0;
    for (int i = 0; i < nthr; i++)
        total += t[i].n;
    double *all = s_xmalloc(total * sizeof(double));
    size_t k = 0;
    for (int i = 0; i < nthr; i++) {
        if (t[i].err) {
            fprintf(stderr, "kvtier-bench: case 4: client %d failed (%d)\n", i, t[i].err);
            s_nerr++;
        }
        memcpy(all + k, t[i].lat, t[i].n * sizeof(double));
        k += t[i].n;
        free(t[i].lat);
    }
    *p99 = s_pct(all, total, 0.99);
    double cpu1 = s_cpu_seconds(d->pid);
    *cpu_us = cpu0 >= 0 && cpu1 >= 0 && total ? (cpu1 - cpu0) * 1e6 / (double)total : NAN;
    free(all);
    return (double)total / el;
}

static void s_case_rate(const daemon_t *d, const key16_t *lk)
{
    s_header("case 4: control requests/s, N client threads (one kvtier_t each)");
    static const int counts[] = {1, 8, 32};
    double dur = s_opt.quick ? 0.3 : 2.0;
    for (int op = 0; op < 2; op++) {
        double best = 0, best_cpu = NAN;
        for (int i = 0; i < 3; i++) {
            double p99 = 0, cpu_us = NAN;
            double rate = s_load(d, lk, op == 1, counts[i], dur, &p99, &cpu_us, -1);
            char what[96];
            snprintf(what, sizeof what, "%s, %d client%s: req/s (p99 us as base)",
                     op ? "LOOKUP 64 keys" : "PING", counts[i], counts[i] > 1 ? "s" : "");
            s_row(4, what, rate, p99, "req/s", NAN, "", false, false);
            snprintf(what, sizeof what, "  daemon CPU per request, %d client%s", counts[i],
                     counts[i] > 1 ? "s" : "");
            s_row(4, what, cpu_us, NAN, "us", NAN, "", false, false);
            if (rate > best) {
                best = rate;
                best_cpu = cpu_us;
            }
        }
        s_row(4, op ? "LOOKUP peak aggregate" : "PING peak aggregate", best, NAN, "req/s", NAN,
              ">= 100k req/s", true, best >= 100000);
        /* what the daemon alone could answer per core it is given: its CPU time per request
         * at the peak, all its threads (server loop, zmq I/O) counted */
        s_row(4, op ? "LOOKUP rate per daemon CPU core (1 / CPU per req)"
                    : "PING rate per daemon CPU core (1 / CPU per req)",
              1e6 / best_cpu, NAN, "req/s", NAN, "", false, false);
    }
}

/* ---- case 9: the fast path (shared-memory rings) vs the socket, same daemon, same run ---- */

/* A client on the fast path (fast) or on the socket; NULL (an error counted) when libkvtier
 * did not get what was asked. Single-threaded callers only (it sets the environment). */
static kvtier_t *s_connect_tp(const daemon_t *d, const char *instance, bool fast)
{
    setenv("KVTIER_FASTPATH", fast ? "1" : "0", 1);
    kvtier_t *c = s_connect(d, instance, CALL_TIMEOUT_MS);
    unsetenv("KVTIER_FASTPATH");
    if (c && kvtier_fastpath_active(c) != (int)fast) {
        fprintf(stderr, "kvtier-bench: case 9: %s: fast path %s, wanted %s\n", instance,
                kvtier_fastpath_active(c) ? "on" : "off", fast ? "on" : "off");
        kvtier_close(&c);
    }
    if (!c)
        s_nerr++;
    return c;
}

/* One 4 MiB object per call: RESERVE -> memcpy -> COMMIT, then ACQUIRE -> memcpy -> RELEASE,
 * over `c`; GB/s of each into out[0..2). False on an error. */
static bool s_big_round_trips(kvtier_t *c, const key16_t *keys, uint32_t nobj, uint32_t rounds,
                              const uint8_t *src, uint8_t *dst, double out[2])
{
    double store_s = 0, load_s = 0;
    for (uint32_t r = 0; r < rounds; r++) {
        s_remove_all(c, "bench9", keys, nobj);
        double t0 = s_now();
        if (s_store(c, "bench9", keys, nobj, BIG, src, 1, NULL) != nobj)
            return false;
        store_s += s_now() - t0;
        t0 = s_now();
        for (uint32_t i = 0; i < nobj; i++) {
            kvtier_slot_t slot;
            uint32_t got = 0;
            uint64_t lease = 0;
            int rc = kvtier_acquire(c, "bench9", NULL, keys + i, 1, &slot, &got, &lease);
            if (rc || got != 1) {
                s_fail("acquire", rc ? rc : KVTIER_ENOTFOUND, c);
                return false;
            }
            memcpy(dst, slot.ptr, BIG);
            if ((rc = kvtier_release(c, lease)) != 0) {
                s_fail("release", rc, c);
                return false;
            }
        }
        load_s += s_now() - t0;
    }
    s_remove_all(c, "bench9", keys, nobj);
    if (memcmp(dst, src, BIG) != 0) {
        fprintf(stderr, "kvtier-bench: case 9: retrieved bytes differ from stored ones\n");
        return false;
    }
    out[0] = (double)rounds * nobj * BIG / store_s / 1e9;
    out[1] = (double)rounds * nobj * BIG / load_s / 1e9;
    return true;
}

/* One 4 MiB object per call as s_big_round_trips, each call timed on its own, over two clients
 * (c[0] the socket, c[1] the fast path) taking turns call by call, so both meet the same
 * neighbours; their arena pages mapped first (s_prefault) and the objects' extents written
 * once untimed, so the calls time the transport and the copy rather than first touches. The
 * median store and load GB/s of each into out[client][0..2). With busy CPUs a copy is
 * sometimes preempted whatever the transport; the median says what a call usually costs.
 * False on an error. */
static bool s_big_medians(kvtier_t *c[2], const key16_t *keys, uint32_t nobj, const uint8_t *src,
                          uint8_t *dst, double out[2][2])
{
    static const char *ns[2] = {"bench9e-zmq", "bench9e-fast"};
    double *t[2][2];
    for (int k = 0; k < 4; k++)
        t[k / 2][k % 2] = s_xmalloc(nobj * sizeof(double));
    bool ok = true;
    for (int f = 0; f < 2 && ok; f++) {
        s_prefault(c[f]);
        s_remove_all(c[f], ns[f], keys, nobj);
        ok = s_store(c[f], ns[f], keys, nobj, BIG, src, 1, NULL) == nobj;
        s_remove_all(c[f], ns[f], keys, nobj);
    }
    for (uint32_t i = 0; i < nobj && ok; i++)
        for (int f = 0; f < 2 && ok; f++) {
            double t0 = s_now();
            ok = s_store(c[f], ns[f], keys + i, 1, BIG, src, 1, NULL) == 1;
            t[f][0][i] = BIG / (s_now() - t0) / 1e9;
        }
    for (uint32_t i = 0; i < nobj && ok; i++)
        for (int f = 0; f < 2 && ok; f++) {
            kvtier_slot_t slot;
            uint32_t got = 0;
            uint64_t lease = 0;
            double t0 = s_now();
            int rc = kvtier_acquire(c[f], ns[f], NULL, keys + i, 1, &slot, &got, &lease);
            ok = rc == 0 && got == 1;
            if (ok) {
                memcpy(dst, slot.ptr, BIG);
                ok = kvtier_release(c[f], lease) == 0;
            }
            t[f][1][i] = BIG / (s_now() - t0) / 1e9;
        }
    for (int f = 0; f < 2; f++) {
        s_remove_all(c[f], ns[f], keys, nobj);
        for (int k = 0; k < 2; k++) {
            if (ok)
                out[f][k] = s_pct(t[f][k], nobj, 0.50);
            free(t[f][k]);
        }
    }
    return ok;
}

/* A CPU-bound neighbour (a tokenizer, a scheduler's busy loop): a child process that spins
 * until killed. */
static pid_t s_spinner(void)
{
    pid_t p = fork();
    if (p == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        for (volatile uint64_t x = 0;; x++)
            ;
    }
    return p;
}

/* 9e (issue 29): with 0, N and 2N CPU-bound neighbours (N = online CPUs; --quick: N only), the
 * fast path against the socket in the same run: PING/s with 1 and 4 client threads, LOOKUP
 * p50/p99, one 4 MiB store/load per call. The target is the fast path at least as fast as the
 * socket under every load. */
static void s_fastpath_under_load(const daemon_t *d, const key16_t *lk)
{
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int loads[3] = {0, (int)(ncpu > 0 ? ncpu : 1), (int)(ncpu > 0 ? 2 * ncpu : 2)};
    double dur = s_opt.quick ? 0.3 : 2.0;
    uint32_t nlk = s_opt.quick ? 200 : 3000, nobj = s_opt.quick ? 3 : 21;
    uint8_t *src = s_xmalloc(BIG), *dst = s_xmalloc(BIG);
    for (size_t i = 0; i < BIG; i++)
        src[i] = (uint8_t)s_mix(i * 11);
    key16_t *keys = s_keys(nobj, 10);
    double *lat = s_xmalloc(nlk * sizeof *lat);
    for (int li = s_opt.quick ? 1 : 0; li < (s_opt.quick ? 2 : 3); li++) {
        int k = loads[li];
        pid_t kids[64];
        int nk = 0;
        for (int i = 0; i < k && i < 64; i++)
            if ((kids[nk] = s_spinner()) > 0)
                nk++;
        usleep(100000); /* the spinners are running */
        double ping[2][2], p50[2] = {NAN, NAN}, p99[2] = {NAN, NAN};
        double gbs[2][2] = {{NAN, NAN}, {NAN, NAN}};
        kvtier_t *c[2] = {NULL, NULL};
        for (int fast = 0; fast < 2; fast++) {
            double q99, cpu;
            ping[fast][0] = s_load(d, lk, false, 1, dur, &q99, &cpu, fast);
            ping[fast][1] = s_load(d, lk, false, 4, dur, &q99, &cpu, fast);
            c[fast] = s_connect_tp(d, fast ? "c9e-fast" : "c9e-zmq", fast);
            if (!c[fast])
                continue;
            uint32_t got = s_lookups(c[fast], "bench", lk, nlk, lat, 60);
            p50[fast] = s_pct(lat, got, 0.50);
            p99[fast] = s_pct(lat, got, 0.99);
        }
        if (c[0] && c[1] && !s_big_medians(c, keys, nobj, src, dst, gbs))
            s_nerr++;
        kvtier_close(&c[0]);
        kvtier_close(&c[1]);
        for (int i = 0; i < nk; i++) {
            kill(kids[i], SIGKILL);
            waitpid(kids[i], NULL, 0);
        }
        char what[96];
        snprintf(what, sizeof what, "%d busy: PING/s, 1 thread, fast (b: socket)", k);
        s_row(9, what, ping[1][0], ping[0][0], "req/s", ping[1][0] / ping[0][0],
              ">= 1x socket", true, ping[1][0] >= ping[0][0]);
        snprintf(what, sizeof what, "%d busy: PING/s, 4 threads, fast (b: socket)", k);
        s_row(9, what, ping[1][1], ping[0][1], "req/s", ping[1][1] / ping[0][1],
              ">= 1x socket", true, ping[1][1] >= ping[0][1]);
        snprintf(what, sizeof what, "%d busy: LOOKUP p50, fast (b: socket)", k);
        s_row(9, what, p50[1], p50[0], "us", p50[1] / p50[0], "<= 1x socket", true,
              p50[1] <= p50[0]);
        snprintf(what, sizeof what, "%d busy: LOOKUP p99, fast (b: socket)", k);
        s_row(9, what, p99[1], p99[0], "us", p99[1] / p99[0], "<= 1x socket", true,
              p99[1] <= p99[0]);
        snprintf(what, sizeof what, "%d busy: store 4 MiB median, fast (b: socket)", k);
        s_row(9, what, gbs[1][0], gbs[0][0], "GB/s", gbs[1][0] / gbs[0][0], ">= 1x socket",
              true, gbs[1][0] >= gbs[0][0]);
        snprintf(what, sizeof what, "%d busy: load 4 MiB median, fast (b: socket)", k);
        s_row(9, what, gbs[1][1], gbs[0][1], "GB/s", gbs[1][1] / gbs[0][1], ">= 1x socket",
              true, gbs[1][1] >= gbs[0][1]);
    }
    free(lat);
    free(keys);
    free(src);
    free(dst);
}

static void s_case_fastpath(const daemon_t *d, const key16_t *lk)
{
    s_header("case 9: the fast path (shared-memory rings) vs the socket, same daemon");
    /* 9a: LOOKUP latency over each transport, against the bare echo */
    uint32_t n = s_opt.quick ? 500 : 20000;
    double echo[3];
    if (!s_echo(n, echo))
        return;
    double *lat = s_xmalloc(n * sizeof *lat);
    double p50[2] = {NAN, NAN}, p99[2] = {NAN, NAN};
    for (int fast = 0; fast < 2; fast++) {
        kvtier_t *c = s_connect_tp(d, fast ? "c9-fast" : "c9-zmq", fast);
        if (!c)
            continue;
        s_lookups(c, "bench", lk, n / 10, lat, 10); /* warm-up */
        uint32_t got = s_lookups(c, "bench", lk, n, lat, 60);
        if (got < n)
            fprintf(stderr, "kvtier-bench: case 9: %u of %u LOOKUPs were full hits\n", got, n);
        p50[fast] = s_pct(lat, got, 0.50);
        p99[fast] = s_pct(lat, got, 0.99);
        kvtier_close(&c);
    }
    free(lat);
    s_row(9, "LOOKUP 64 keys p50, fast path (b: echo p50)", p50[1], echo[0], "us",
          p50[1] / echo[0], "<= 0.3x echo p50", true, p50[1] <= 0.3 * echo[0]);
    s_row(9, "LOOKUP 64 keys p99, fast path (b: echo p50)", p99[1], echo[0], "us",
          p99[1] / echo[0], "<= 1x echo p50", true, p99[1] <= echo[0]);
    s_row(9, "  LOOKUP 64 keys p50, socket (b: echo p50)", p50[0], echo[0], "us",
          p50[0] / echo[0], "", false, false);
    s_row(9, "  LOOKUP 64 keys p99, socket (b: echo p50)", p99[0], echo[0], "us",
          p99[0] / echo[0], "", false, false);

    /* 9b: one 4 MiB object per call over each transport, against memcpy of the same bytes */
    uint32_t nobj = s_opt.quick ? 8 : 96, rounds = s_opt.quick ? 1 : 4;
    uint8_t *src = s_xmalloc(BIG), *dst = s_xmalloc(BIG);
    for (size_t i = 0; i < BIG; i++)
        src[i] = (uint8_t)s_mix(i * 7);
    key16_t *keys = s_keys(nobj, 9);
    for (int fast = 1; fast >= 0; fast--) {
        kvtier_t *c = s_connect_tp(d, fast ? "c9b-fast" : "c9b-zmq", fast);
        size_t asize = 0;
        uint8_t *arena = c ? kvtier_arena(c, &asize) : NULL;
        if (!arena || asize < (nobj + 1) * BIG) {
            if (c)
                fprintf(stderr, "kvtier-bench: case 9: arena not mapped or too small\n");
            s_nerr += c != NULL;
            kvtier_close(&c);
            continue;
        }
        s_prefault(c);
        /* memcpy into and out of the same mapping (its pages already mapped here) */
        for (uint32_t i = 0; i < nobj; i++)
            memcpy(arena + (size_t)i * BIG, src, BIG);
        double t0 = s_now();
        for (uint32_t r = 0; r < rounds; r++)
            for (uint32_t i = 0; i < nobj; i++)
                memcpy(arena + (size_t)i * BIG, src, BIG);
        double base_w = (double)rounds * nobj * BIG / (s_now() - t0) / 1e9;
        t0 = s_now();
        for (uint32_t r = 0; r < rounds; r++)
            for (uint32_t i = 0; i < nobj; i++)
                memcpy(dst, arena + (size_t)i * BIG, BIG);
        double base_r = (double)rounds * nobj * BIG / (s_now() - t0) / 1e9;
        double gbs[2];
        if (!s_big_round_trips(c, keys, nobj, rounds, src, dst, gbs)) {
            s_nerr++;
        } else if (fast) {
            s_row(9, "store RESERVE+memcpy+COMMIT 4 MiB, fast (b: memcpy)", gbs[0], base_w,
                  "GB/s", gbs[0] / base_w, ">= 0.8x memcpy", true, gbs[0] >= 0.8 * base_w);
            s_row(9, "load ACQUIRE+memcpy+RELEASE 4 MiB, fast (b: memcpy)", gbs[1], base_r,
                  "GB/s", gbs[1] / base_r, ">= 0.8x memcpy", true, gbs[1] >= 0.8 * base_r);
        } else {
            s_row(9, "  store 4 MiB, socket (b: memcpy)", gbs[0], base_w, "GB/s",
                  gbs[0] / base_w, "", false, false);
            s_row(9, "  load 4 MiB, socket (b: memcpy)", gbs[1], base_r, "GB/s", gbs[1] / base_r,
                  "", false, false);
        }
        kvtier_close(&c);
    }
    free(keys);
    free(src);
    free(dst);

    /* 9c: LOOKUP requests/s with N clients over each transport; the best of each */
    static const int counts[] = {1, 2, 4, 8, 32};
    double dur = s_opt.quick ? 0.3 : 2.0, best[2] = {0, 0};
    for (int fast = 0; fast < 2; fast++)
        for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
            double q99 = 0, cpu_us = NAN;
            double rate = s_load(d, lk, true, counts[i], dur, &q99, &cpu_us, fast);
            char what[96];
            snprintf(what, sizeof what, "  LOOKUP, %d client%s, %s: req/s (p99 us as base)",
                     counts[i], counts[i] > 1 ? "s" : "", fast ? "fast" : "socket");
            s_row(9, what, rate, q99, "req/s", NAN, "", false, false);
            if (rate > best[fast])
                best[fast] = rate;
        }
    s_row(9, "LOOKUP req/s at best N, fast (b: socket's best)", best[1], best[0], "req/s",
          best[1] / best[0], ">= 3x socket", true, best[1] >= 3 * best[0]);

    /* 9d: an idle daemon with 32 fast-path clients connected (after the 100 ms a closed ring
     * pair rests before it is handed out again: 9c just closed 32) */
    usleep(150000);
    kvtier_t *idle[32] = {0};
    int nidle = 0;
    for (int i = 0; i < 32; i++) {
        char inst[32];
        snprintf(inst, sizeof inst, "c9-idle-%d", i);
        if ((idle[i] = s_connect_tp(d, inst, true)) != NULL)
            nidle++;
    }
    double win = s_opt.quick ? 1.0 : 10.0;
    usleep(200000); /* the fast-path thread's spin after the last HELLO is over */
    double cpu0 = s_cpu_seconds(d->pid), t0 = s_now();
    usleep((useconds_t)(win * 1e6));
    double cpu1 = s_cpu_seconds(d->pid), el = s_now() - t0;
    double pct = cpu0 >= 0 && cpu1 >= 0 ? (cpu1 - cpu0) / el * 100 : NAN;
    char what[96];
    snprintf(what, sizeof what, "idle daemon CPU, %d fast-path clients, %.0f s", nidle, win);
    s_row(9, what, pct, NAN, "% core", NAN, "<= 2% of a core", true, nidle == 32 && pct <= 2.0);
    for (int i = 0; i < 32; i++)
        kvtier_close(&idle[i]);
    s_fastpath_under_load(d, lk);
}

/* ---- case 6: LOOKUP p99 under load -------------------------------------------------------- */

typedef struct {
    const daemon_t *d;
    const key16_t *keys;
    uint32_t nkeys;
    volatile int stop;
    uint64_t ops;
    uint64_t bytes;
    int err;
} bg_t;

static void *s_get_thread(void *arg)
{
    bg_t *b = arg;
    kvtier_t *c = s_connect(b->d, "c6-get", CALL_TIMEOUT_MS);
    if (!c) {
        b->err = 1;
        return NULL;
    }
    kvtier_buf_t out[16];
    double end = s_now() + 120;
    while (!b->stop && s_now() < end) {
        uint32_t found = 0;
        int rc = kvtier_get(c, "bench6", NULL, b->keys, b->nkeys, out, &found);
        if (rc) {
            b->err = rc;
            break;
        }
        for (uint32_t i = 0; i < found; i++) {
            b->bytes += out[i].len;
            free(out[i].data);
        }
        b->ops++;
    }
    kvtier_close(&c);
    return NULL;
}

/* Loops: LOOKUP with prefetch of L2-only keys, PREFETCH_STATUS until done, CLEAR of their ns. */
static void *s_prefetch_thread(void *arg)
{
    bg_t *b = arg;
    kvtier_t *c = s_connect(b->d, "c6-l2", CALL_TIMEOUT_MS);
    if (!c) {
        b->err = 1;
        return NULL;
    }
    double end = s_now() + 120;
    while (!b->stop && s_now() < end) {
        uint64_t job = 0;
        uint32_t hits = 0;
        int rc = kvtier_lookup(c, "bench6l2", NULL, b->keys, b->nkeys, KVTIER_PREFETCH, &hits,
                               NULL, NULL, &job);
        if (rc) {
            b->err = rc;
            break;
        }
        int done = !job;
        uint32_t loaded = 0;
        double jend = s_now() + 10;
        while (!done && !b->stop && s_now() < jend) {
            usleep(2000);
            if (kvtier_prefetch_status(c, job, &done, &loaded, NULL))
                break;
        }
        b->bytes += loaded;
        b->ops++;
        kvtier_clear(c, "bench6l2", NULL);
    }
    kvtier_close(&c);
    return NULL;
}

static double s_p99_with(const daemon_t *d, const key16_t *lk, uint32_t n, double max_s,
                         void *(*fn)(void *), bg_t *bg)
{
    kvtier_t *c = s_connect(d, "c6", CALL_TIMEOUT_MS);
    if (!c) {
        s_nerr++;
        return NAN;
    }
    double *lat = s_xmalloc(n * sizeof *lat);
    pthread_t th;
    if (fn) {
        pthread_create(&th, NULL, fn, bg);
        usleep(200000); /* let the background work get going */
    }
    uint32_t got = s_lookups(c, "bench", lk, n, lat, max_s);
    if (fn) {
        bg->stop = 1;
        pthread_join(th, NULL);
        if (bg->err) {
            fprintf(stderr, "kvtier-bench: case 6: background client failed (%d)\n", bg->err);
            s_nerr++;
        }
    }
    double p99 = s_pct(lat, got, 0.99);
    free(lat);
    kvtier_close(&c);
    return p99;
}

static void s_case_busy_get(const daemon_t *d, const key16_t *lk)
{
    s_header("case 6a: LOOKUP p99 while 16 x 4 MiB GETs run in another thread");
    uint32_t n = s_opt.quick ? 2000 : 30000;
    double max_s = s_opt.quick ? 0.5 : 3.0;
    kvtier_t *c = s_connect(d, "c6-fill", CALL_TIMEOUT_MS);
    if (!c) {
        s_nerr++;
        return;
    }
    key16_t *keys = s_keys(16, 6);
    uint8_t *src = s_xmalloc(BIG);
    memset(src, 0x5A, BIG);
    if (s_store(c, "bench6", keys, 16, BIG, src, 16, NULL) != 16) {
        kvtier_close(&c);
        free(keys);
        free(src);
        s_nerr++;
        return;
    }
    double idle = s_p99_with(d, lk, n, max_s, NULL, NULL);
    bg_t bg = {.d = d, .keys = (const key16_t *)keys, .nkeys = 16};
    double t0 = s_now();
    double busy = s_p99_with(d, lk, n, max_s, s_get_thread, &bg);
    double el = s_now() - t0;
    s_row(6, "LOOKUP p99 during 16x4 MiB GETs (b: idle p99)", busy, idle, "us", busy / idle,
          "<= 1.2x idle p99", true, busy <= 1.2 * idle);
    s_row(6, "  background GET throughput", (double)bg.bytes / el / 1e9, NAN, "GB/s", NAN, "",
          false, false);
    s_remove_all(c, "bench6", keys, 16);
    kvtier_close(&c);
    free(keys);
    free(src);
}

static void s_case_busy_l2(const key16_t *lk)
{
    s_header("case 6b: LOOKUP p99 while a slow L2 (mock:latency_ms=20) loads prefetches");
    daemon_t d = {0};
    if (!s_daemon_start(&d, "d6", s_opt.quick ? "64M" : "256M", "mock:latency_ms=20", NULL,
                        NULL))
        return;
    uint32_t n = s_opt.quick ? 4000 : 30000, nl2 = 16;
    double max_s = s_opt.quick ? 0.8 : 3.0;
    kvtier_t *c = s_connect(&d, "c6-fill", CALL_TIMEOUT_MS);
    key16_t *keys = s_keys(nl2, 61);
    uint8_t *src = s_xmalloc(256 * 1024);
    memset(src, 0x3C, 256 * 1024);
    /* the l2 keys first: their write-behind (20 ms each, one adapter thread) must be done
     * before CLEAR, which drops what is still queued; then CLEAR leaves them in L2 only */
    bool ok = c && s_store(c, "bench6l2", keys, nl2, 256 * 1024, src, 16, NULL) == nl2;
    uint32_t hits = 0;
    if (ok) {
        usleep(nl2 * 20000 * 2 + 300000);
        kvtier_clear(c, "bench6l2", NULL);
        kvtier_lookup(c, "bench6l2", NULL, keys, nl2, 0, &hits, NULL, NULL, NULL);
        ok = s_store(c, "bench", lk, LOOKUP_KEYS, 4096, NULL, 64, NULL) == LOOKUP_KEYS;
    }
    if (ok && hits == 0) {
        fprintf(stderr, "kvtier-bench: case 6b: no key reached the mock L2\n");
        s_nerr++;
        ok = false;
    }
    if (ok) {
        double idle = s_p99_with(&d, lk, n, max_s, NULL, NULL);
        bg_t bg = {.d = &d, .keys = (const key16_t *)keys, .nkeys = hits};
        double busy = s_p99_with(&d, lk, n, max_s, s_prefetch_thread, &bg);
        s_row(6, "LOOKUP p99 during slow-L2 prefetch (b: idle)", busy, idle, "us", busy / idle,
              "<= 1.2x idle p99", true, busy <= 1.2 * idle);
        s_row(6, "  prefetch jobs of 16 L2 keys run meanwhile", (double)bg.ops, NAN, "jobs", NAN,
              "", false, false);
    }
    kvtier_close(&c);
    free(keys);
    free(src);
    s_daemon_stop(&d);
}

/* ---- case 5: store with continuous eviction ----------------------------------------------- */

static void s_case_evict(void)
{
    s_header("case 5: store throughput with continuous eviction vs below the watermark");
    uint64_t l1 = (s_opt.quick ? 64 : 256) * MiB, obj = MiB;
    char size[32];
    snprintf(size, sizeof size, "%lluM", (unsigned long long)(l1 / MiB));
    daemon_t d = {0};
    if (!s_daemon_start(&d, "d5", size, "none", NULL, NULL))
        return;
    kvtier_t *c = s_connect(&d, "c5", CALL_TIMEOUT_MS);
    if (!c) {
        s_nerr++;
        s_daemon_stop(&d);
        return;
    }
    s_prefault(c);
    uint32_t per = (uint32_t)(l1 / obj), below = per * 3 / 4, total = per * 4;
    key16_t *keys = s_keys(total, 5);
    uint8_t *src = s_xmalloc(obj);
    memset(src, 0x77, obj);
    uint64_t retries = 0;
    double t0 = s_now();
    bool ok = s_store(c, "bench5", keys, below, obj, src, 8, &retries) == below;
    double ta = s_now() - t0;
    ok = ok && s_store(c, "bench5", keys + below, per - below, obj, src, 8, &retries) ==
                   per - below;
    uint64_t retries_a = retries;
    t0 = s_now();
    ok = ok && s_store(c, "bench5", keys + per, total - per, obj, src, 8, &retries) ==
                   total - per;
    double tb = s_now() - t0;
    if (ok) {
        double ra = (double)below * obj / ta / 1e9, rb = (double)(total - per) * obj / tb / 1e9;
        s_row(5, "store 1 MiB, evicting (b: below watermark)", rb, ra, "GB/s", rb / ra,
              ">= 0.95x below", true, rb >= 0.95 * ra);
        s_row(5, "  RESERVE retries (partial / no_space) evicting", (double)(retries - retries_a),
              NAN, "count", NAN, "", false, false);
    }
    free(keys);
    free(src);
    kvtier_close(&c);
    s_daemon_stop(&d);
}

/* ---- case 7: object-count scale ----------------------------------------------------------- */

static void s_case_scale(void)
{
    s_header("case 7: LOOKUP cost and daemon metadata per object at 10k / 100k / 1M objects");
    static const uint32_t full[] = {10000, 100000, 1000000}, quick[] = {10000, 20000};
    const uint32_t *stages = s_opt.quick ? quick : full;
    int nst = s_opt.quick ? 2 : 3;
    daemon_t d = {0};
    if (!s_daemon_start(&d, "d7", s_opt.quick ? "96M" : "4224M", "none", "0.99", "0.98"))
        return;
    kvtier_t *c = s_connect(&d, "c7", CALL_TIMEOUT_MS);
    if (!c) {
        s_nerr++;
        s_daemon_stop(&d);
        return;
    }
    uint32_t n = s_opt.quick ? 300 : 5000, maxobj = stages[nst - 1];
    key16_t *keys = s_keys(maxobj, 7);
    double *lat = s_xmalloc(n * sizeof *lat);
    /* the first LOOKUP creates nothing; a first store of one batch brings in the namespace */
    int64_t rss0 = s_private_rss(d.pid);
    uint32_t have = 0;
    double p50_first = 0;
    for (int s = 0; s < nst; s++) {
        if (s_store(c, "bench7", keys + have, stages[s] - have, 4096, NULL, 64, NULL) !=
            stages[s] - have)
            break;
        have = stages[s];
        int64_t rss = s_private_rss(d.pid);
        /* LOOKUPs of 64-key prefixes starting at spread positions, every key a hit */
        uint32_t done = 0;
        double deadline = s_now() + 30;
        for (uint32_t i = 0; i < n && s_now() < deadline; i++, done++) {
            uint32_t start = (uint32_t)(s_mix(i) % (have - LOOKUP_KEYS)), hits = 0;
            double t0 = s_now();
            int rc = kvtier_lookup(c, "bench7", NULL, keys + start, LOOKUP_KEYS, 0, &hits, NULL,
                                   NULL, NULL);
            lat[i] = (s_now() - t0) * 1e6;
            if (rc || hits != LOOKUP_KEYS) {
                s_fail("lookup (scale)", rc ? rc : KVTIER_ENOTFOUND, c);
                break;
            }
        }
        double p50 = s_pct(lat, done, 0.5);
        if (s == 0)
            p50_first = p50;
        char what[96];
        snprintf(what, sizeof what, "LOOKUP 64 keys p50, %u objects (b: at %u)", have,
                 stages[0]);
        s_row(7, what, p50, p50_first, "us", p50 / p50_first, s ? "<= 1.5x (flat)" : "",
              s > 0, p50 <= 1.5 * p50_first);
        double per = rss0 >= 0 && rss >= 0 ? (double)(rss - rss0) / have : NAN;
        snprintf(what, sizeof what, "daemon RSS - shmem per object, %u objects", have);
        s_row(7, what, per, NAN, "B", NAN, s == nst - 1 ? "< 256 B" : "", s == nst - 1,
              per < 256);
    }
    free(lat);
    free(keys);
    kvtier_close(&c);
    s_daemon_stop(&d);
}

/* ---- case 8: one prompt through the LMCache door vs protocol v1 --------------------------- */

/* 16 chunks of 256 tokens; the registered layout [2, 8 layers, 256 tokens, 128] bfloat16 makes
 * one chunk 2 * 8 * 256 * 128 * 2 = 1 MiB. */
#define C8_CHUNKS 16
#define C8_TOKENS 256
#define C8_LAYERS 8
#define C8_HIDDEN 128
#define C8_OBJ MiB
#define C8_MODEL "bench8-model"
#define C8_NS "bench8"
#define C8_CLEAR_EVERY 4 /* iterations (both doors) between clears, which are not timed */

/* LMCache wire op ids (LMCACHE_MP.md §2.1; protocol/kvt_lmc.h) */
enum {
    LMC_LOOKUP = 8,
    LMC_QUERY_PREFETCH_STATUS = 9,
    LMC_END_SESSION = 13,
    LMC_REGISTER = 14,
    LMC_PREPARE_STORE = 16,
    LMC_COMMIT_STORE = 17,
    LMC_PREPARE_RETRIEVE = 18,
    LMC_COMMIT_RETRIEVE = 19,
    LMC_CLEAR = 20,
};

/* One LMCache client: a DEALER with the options LMCache's client sets, a uid counter from 0,
 * and the frames of the request being built, back to back in one buffer. */
typedef struct {
    void *ctx, *sock;
    uint64_t uid;
    int op;
    msgpack_sbuffer buf;
    msgpack_packer pk;
    size_t cut[8]; /* end offset of each frame in buf */
    int nframes;
    char uidb[9], opb[9]; /* the uid and op frames sent, to check the echo */
    size_t uidlen, oplen;
    msgpack_unpacked val;
} s_lmc_t;

static bool s_lmc_open(s_lmc_t *l, const char *endpoint)
{
    memset(l, 0, sizeof *l);
    msgpack_sbuffer_init(&l->buf);
    msgpack_packer_init(&l->pk, &l->buf, msgpack_sbuffer_write);
    msgpack_unpacked_init(&l->val);
    l->ctx = zmq_ctx_new();
    l->sock = l->ctx ? zmq_socket(l->ctx, ZMQ_DEALER) : NULL;
    if (!l->sock)
        return false;
    int v = 5000, ivl = 1000, linger = 0, rcv = CALL_TIMEOUT_MS;
    zmq_setsockopt(l->sock, ZMQ_CONNECT_TIMEOUT, &v, sizeof v);
    zmq_setsockopt(l->sock, ZMQ_RECONNECT_IVL_MAX, &ivl, sizeof ivl);
    zmq_setsockopt(l->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(l->sock, ZMQ_RCVTIMEO, &rcv, sizeof rcv);
    return zmq_connect(l->sock, endpoint) == 0;
}

static void s_lmc_close(s_lmc_t *l)
{
    if (l->sock)
        zmq_close(l->sock);
    if (l->ctx)
        zmq_ctx_term(l->ctx);
    msgpack_sbuffer_destroy(&l->buf);
    msgpack_unpacked_destroy(&l->val);
    l->sock = l->ctx = NULL;
}

/* Starts a request: the uid frame (msgpack int) and the op frame (msgpack int). Each argument
 * is then packed with l->pk and closed with s_lmc_arg. */
static msgpack_packer *s_lmc_begin(s_lmc_t *l, int op)
{
    msgpack_sbuffer_clear(&l->buf);
    l->nframes = 0;
    l->op = op;
    msgpack_pack_uint64(&l->pk, l->uid++);
    l->cut[l->nframes++] = l->buf.size;
    msgpack_pack_int(&l->pk, op);
    l->cut[l->nframes++] = l->buf.size;
    l->uidlen = l->cut[0];
    l->oplen = l->cut[1] - l->cut[0];
    memcpy(l->uidb, l->buf.data, l->uidlen);
    memcpy(l->opb, l->buf.data + l->cut[0], l->oplen);
    return &l->pk;
}

static void s_lmc_arg(s_lmc_t *l)
{
    l->cut[l->nframes++] = l->buf.size;
}

static void s_pack_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* Sends the request and reads its reply. Returns 1 with *out the value (a 3-frame reply), 0
 * for a 2-frame reply (a None return), -1 on a failure (printed: no reply, a wrong echo, the
 * error form). */
static int s_lmc_call(s_lmc_t *l, const msgpack_object **out)
{
    for (int i = 0; i < l->nframes; i++) {
        size_t a = i ? l->cut[i - 1] : 0;
        if (zmq_send(l->sock, l->buf.data + a, l->cut[i] - a,
                     i + 1 < l->nframes ? ZMQ_SNDMORE : 0) < 0) {
            fprintf(stderr, "kvtier-bench: case 8: send of op %d: %s\n", l->op,
                    zmq_strerror(errno));
            return -1;
        }
    }
    zmq_msg_t f[4];
    int n = 0, more = 1;
    bool bad = false;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, l->sock, 0) < 0) {
            fprintf(stderr, "kvtier-bench: case 8: no reply to op %d: %s\n", l->op,
                    zmq_strerror(errno));
            zmq_msg_close(&m);
            for (int i = 0; i < n; i++)
                zmq_msg_close(&f[i]);
            return -1;
        }
        more = zmq_msg_more(&m);
        if (n < 4)
            f[n++] = m;
        else {
            bad = true;
            zmq_msg_close(&m);
        }
    }
    int rc = -1;
    if (bad || n < 2 || zmq_msg_size(&f[0]) != l->uidlen ||
        memcmp(zmq_msg_data(&f[0]), l->uidb, l->uidlen) || zmq_msg_size(&f[1]) != l->oplen ||
        memcmp(zmq_msg_data(&f[1]), l->opb, l->oplen)) {
        fprintf(stderr, "kvtier-bench: case 8: reply to op %d: %d frames, uid/op not echoed\n",
                l->op, n);
    } else if (n == 2) {
        rc = 0;
    } else if (n == 3) {
        if (msgpack_unpack_next(&l->val, zmq_msg_data(&f[2]), zmq_msg_size(&f[2]), NULL) ==
            MSGPACK_UNPACK_SUCCESS) {
            *out = &l->val.data;
            rc = 1;
        } else {
            fprintf(stderr, "kvtier-bench: case 8: reply to op %d does not decode\n", l->op);
        }
    } else {
        fprintf(stderr, "kvtier-bench: case 8: op %d answered with an error: %.*s\n", l->op,
                (int)zmq_msg_size(&f[3]), (const char *)zmq_msg_data(&f[3]));
    }
    for (int i = 0; i < n; i++)
        zmq_msg_close(&f[i]);
    return rc;
}

/* The value of `name` in a msgpack map with str keys, NULL when absent or not a map. */
static const msgpack_object *s_mp_get(const msgpack_object *o, const char *name)
{
    if (!o || o->type != MSGPACK_OBJECT_MAP)
        return NULL;
    size_t n = strlen(name);
    for (uint32_t i = 0; i < o->via.map.size; i++) {
        const msgpack_object *k = &o->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n &&
            !memcmp(k->via.str.ptr, name, n))
            return &o->via.map.ptr[i].val;
    }
    return NULL;
}

static bool s_mp_uint(const msgpack_object *o, uint64_t *v)
{
    if (!o || o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return false;
    *v = o->via.u64;
    return true;
}

/* IPCCacheServerKey as msgspec encodes it: all 11 fields in declaration order. worker < 0:
 * nil (the scheduler's lookups). */
static void s_lmc_key(msgpack_packer *pk, const uint32_t *tokens, uint32_t ntok, int worker,
                      uint64_t start, uint64_t end, const char *request_id)
{
    msgpack_pack_map(pk, 11);
    s_pack_str(pk, "model_name");
    s_pack_str(pk, C8_MODEL);
    s_pack_str(pk, "world_size");
    msgpack_pack_int(pk, 1);
    s_pack_str(pk, "worker_id");
    if (worker < 0)
        msgpack_pack_nil(pk);
    else
        msgpack_pack_int(pk, worker);
    s_pack_str(pk, "token_ids");
    msgpack_pack_array(pk, ntok);
    for (uint32_t i = 0; i < ntok; i++)
        msgpack_pack_uint32(pk, tokens[i]);
    s_pack_str(pk, "start");
    msgpack_pack_uint64(pk, start);
    s_pack_str(pk, "end");
    msgpack_pack_uint64(pk, end);
    s_pack_str(pk, "request_id");
    s_pack_str(pk, request_id);
    s_pack_str(pk, "cache_salt");
    s_pack_str(pk, "");
    s_pack_str(pk, "request_configs");
    msgpack_pack_nil(pk);
    s_pack_str(pk, "num_kv_readers");
    msgpack_pack_int(pk, 1);
    s_pack_str(pk, "null_chunk_mask");
    msgpack_pack_nil(pk);
}

/* lookup(key with worker_id nil, tp_size 1) then query_prefetch_status(request_id) until it is
 * an int (it is None while L2 loads run; this daemon has no L2). Returns the hits, -1. */
static int64_t s_lmc_lookup(s_lmc_t *l, const uint32_t *tokens, uint32_t ntok, const char *rid)
{
    const msgpack_object *v = NULL;
    s_lmc_key(s_lmc_begin(l, LMC_LOOKUP), tokens, ntok, -1, 0, ntok, rid);
    s_lmc_arg(l);
    msgpack_pack_int(&l->pk, 1);
    s_lmc_arg(l);
    if (s_lmc_call(l, &v) != 0)
        return -1;
    for (int tries = 0; tries < 10000; tries++) {
        s_pack_str(s_lmc_begin(l, LMC_QUERY_PREFETCH_STATUS), rid);
        s_lmc_arg(l);
        int rc = s_lmc_call(l, &v);
        uint64_t hits;
        if (rc == 1 && s_mp_uint(v, &hits))
            return (int64_t)hits;
        if (rc != 0)
            return -1;
        usleep(100);
    }
    return -1;
}

/* prepare_store / prepare_retrieve / commit_store / commit_retrieve of [0, ntok) for worker 0
 * with the key and the instance id (and commit_store's data b""). */
static int s_lmc_xfer(s_lmc_t *l, int op, const uint32_t *tokens, uint32_t ntok,
                      const char *rid, uint64_t instance, const msgpack_object **v)
{
    s_lmc_key(s_lmc_begin(l, op), tokens, ntok, 0, 0, ntok, rid);
    s_lmc_arg(l);
    msgpack_pack_uint64(&l->pk, instance);
    s_lmc_arg(l);
    if (op == LMC_COMMIT_STORE) {
        msgpack_pack_bin(&l->pk, 0);
        msgpack_pack_bin_body(&l->pk, "", 0);
        s_lmc_arg(l);
    }
    return s_lmc_call(l, v);
}

/* The slots of a prepare reply's context: off[chunk index] for each; how many, -1 when one is
 * malformed, not 1 MiB or outside the pool. */
static int s_lmc_slots(const msgpack_object *ctx, uint64_t pool, uint64_t *off)
{
    const msgpack_object *slots = s_mp_get(ctx, "slots"), *idx = s_mp_get(ctx, "chunk_indices");
    if (!slots || slots->type != MSGPACK_OBJECT_ARRAY || slots->via.array.size > C8_CHUNKS)
        return -1;
    uint32_t n = slots->via.array.size;
    if (idx && (idx->type != MSGPACK_OBJECT_ARRAY || idx->via.array.size != n))
        return -1;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t o, len, c = i;
        if (!s_mp_uint(s_mp_get(&slots->via.array.ptr[i], "offset"), &o) ||
            !s_mp_uint(s_mp_get(&slots->via.array.ptr[i], "length"), &len) || len != C8_OBJ ||
            o > pool || pool - o < len || (idx && !s_mp_uint(&idx->via.array.ptr[i], &c)) ||
            c >= C8_CHUNKS)
            return -1;
        off[c] = o;
    }
    return (int)n;
}

/* phases timed within one sequence (for the per-op breakdown) */
#define C8_PHASES 9
static const char *const s_c8_lmc_phase[C8_PHASES] = {
    "lookup+status", "prepare_store", "memcpy in", "commit_store", "lookup+status",
    "prepare_retrieve", "memcpy out", "commit_retrieve", "end_session"};
static const char *const s_c8_v1_phase[C8_PHASES] = {
    "hash+LOOKUP", "RESERVE", "memcpy in", "COMMIT", "LOOKUP", "ACQUIRE", "memcpy out",
    "RELEASE", "-"};

static uint64_t s_ns_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* One prompt through the LMCache door; t[0..C8_PHASES] the phase boundaries (ns). */
static bool s_c8_lmc(s_lmc_t *l, uint8_t *pool, uint64_t pool_size, uint64_t instance,
                     const uint32_t *tokens, const char *rid, const uint8_t *src, uint8_t *dst,
                     uint64_t *t)
{
    const uint32_t ntok = C8_CHUNKS * C8_TOKENS;
    const msgpack_object *v = NULL;
    uint64_t off[C8_CHUNKS];
    int p = 0;
    t[p++] = s_ns_now();
    int64_t hits = s_lmc_lookup(l, tokens, ntok, rid);
    t[p++] = s_ns_now();
    if (hits != 0) {
        fprintf(stderr, "kvtier-bench: case 8: first lookup: %lld hits, want 0\n",
                (long long)hits);
        return false;
    }
    if (s_lmc_xfer(l, LMC_PREPARE_STORE, tokens, ntok, rid, instance, &v) != 1 ||
        s_lmc_slots(s_mp_get(v, "context"), pool_size, off) != C8_CHUNKS) {
        fprintf(stderr, "kvtier-bench: case 8: prepare_store: not %d slots of 1 MiB\n",
                C8_CHUNKS);
        return false;
    }
    t[p++] = s_ns_now();
    for (int i = 0; i < C8_CHUNKS; i++)
        memcpy(pool + off[i], src + (size_t)i * C8_OBJ, C8_OBJ);
    t[p++] = s_ns_now();
    if (s_lmc_xfer(l, LMC_COMMIT_STORE, tokens, ntok, rid, instance, &v) != 1 ||
        v->type != MSGPACK_OBJECT_BOOLEAN || !v->via.boolean) {
        fprintf(stderr, "kvtier-bench: case 8: commit_store did not answer true\n");
        return false;
    }
    t[p++] = s_ns_now();
    hits = s_lmc_lookup(l, tokens, ntok, rid);
    t[p++] = s_ns_now();
    if (hits != C8_CHUNKS) {
        fprintf(stderr, "kvtier-bench: case 8: second lookup: %lld hits, want %d\n",
                (long long)hits, C8_CHUNKS);
        return false;
    }
    const msgpack_object *ok = NULL;
    if (s_lmc_xfer(l, LMC_PREPARE_RETRIEVE, tokens, ntok, rid, instance, &v) != 1 ||
        !(ok = s_mp_get(v, "success")) || ok->type != MSGPACK_OBJECT_BOOLEAN ||
        !ok->via.boolean || s_lmc_slots(s_mp_get(v, "context"), pool_size, off) != C8_CHUNKS) {
        fprintf(stderr, "kvtier-bench: case 8: prepare_retrieve: not a success of %d slots\n",
                C8_CHUNKS);
        return false;
    }
    t[p++] = s_ns_now();
    for (int i = 0; i < C8_CHUNKS; i++)
        memcpy(dst + (size_t)i * C8_OBJ, pool + off[i], C8_OBJ);
    t[p++] = s_ns_now();
    if (s_lmc_xfer(l, LMC_COMMIT_RETRIEVE, tokens, ntok, rid, instance, &v) != 1 ||
        v->type != MSGPACK_OBJECT_BOOLEAN || !v->via.boolean) {
        fprintf(stderr, "kvtier-bench: case 8: commit_retrieve did not answer true\n");
        return false;
    }
    t[p++] = s_ns_now();
    s_pack_str(s_lmc_begin(l, LMC_END_SESSION), rid);
    s_lmc_arg(l);
    if (s_lmc_call(l, &v) != 0) {
        fprintf(stderr, "kvtier-bench: case 8: end_session not acknowledged\n");
        return false;
    }
    t[p++] = s_ns_now();
    return true;
}

/* A failed libkvtier call of case 8, printed (counted once by the case). */
static void s_c8_fail(const char *what, int rc, kvtier_t *c)
{
    fprintf(stderr, "kvtier-bench: case 8: %s failed: %s (%s)\n", what, kvtier_strerror(rc),
            kvtier_last_error(c));
}

/* The same prompt through protocol v1 (libkvtier): LOOKUP, RESERVE, memcpy in, COMMIT, LOOKUP,
 * ACQUIRE, memcpy out, RELEASE. */
static bool s_c8_v1(kvtier_t *c, const uint32_t *tokens, const uint8_t *src, uint8_t *dst,
                    uint64_t *t)
{
    key16_t keys[C8_CHUNKS];
    kvtier_slot_t slots[C8_CHUNKS];
    uint32_t hits = 0, got = 0;
    uint64_t lease = 0;
    int p = 0, rc;
    t[p++] = s_ns_now();
    if (kvtier_hash_tokens_local(tokens, C8_CHUNKS * C8_TOKENS, C8_TOKENS, NULL, keys) !=
        C8_CHUNKS) {
        fprintf(stderr, "kvtier-bench: case 8: kvtier_hash_tokens_local failed\n");
        return false;
    }
    if ((rc = kvtier_lookup(c, C8_NS, NULL, (const key16_t *)keys, C8_CHUNKS, 0, &hits, NULL,
                            NULL, NULL)) != 0 ||
        hits != 0) {
        s_c8_fail("lookup (case 8, want 0 hits)", rc ? rc : KVTIER_EINTERNAL, c);
        return false;
    }
    t[p++] = s_ns_now();
    if ((rc = kvtier_reserve(c, C8_NS, NULL, (const key16_t *)keys, C8_CHUNKS, NULL, C8_OBJ,
                             slots, &got, &lease)) != 0 ||
        got != C8_CHUNKS) {
        s_c8_fail("reserve (case 8)", rc ? rc : KVTIER_ENOSPC, c);
        if (lease)
            kvtier_commit(c, lease, NULL, 0, NULL);
        return false;
    }
    t[p++] = s_ns_now();
    for (int i = 0; i < C8_CHUNKS; i++)
        memcpy(slots[i].ptr, src + (size_t)i * C8_OBJ, C8_OBJ);
    t[p++] = s_ns_now();
    if ((rc = kvtier_commit(c, lease, NULL, 0, NULL)) != 0) {
        s_c8_fail("commit (case 8)", rc, c);
        return false;
    }
    t[p++] = s_ns_now();
    if ((rc = kvtier_lookup(c, C8_NS, NULL, (const key16_t *)keys, C8_CHUNKS, 0, &hits, NULL,
                            NULL, NULL)) != 0 ||
        hits != C8_CHUNKS) {
        s_c8_fail("lookup (case 8, want 16 hits)", rc ? rc : KVTIER_ENOTFOUND, c);
        return false;
    }
    t[p++] = s_ns_now();
    if ((rc = kvtier_acquire(c, C8_NS, NULL, (const key16_t *)keys, C8_CHUNKS, slots, &got,
                             &lease)) != 0 ||
        got != C8_CHUNKS) {
        s_c8_fail("acquire (case 8)", rc ? rc : KVTIER_ENOTFOUND, c);
        if (lease)
            kvtier_release(c, lease);
        return false;
    }
    t[p++] = s_ns_now();
    for (int i = 0; i < C8_CHUNKS; i++)
        memcpy(dst + (size_t)i * C8_OBJ, slots[i].ptr, C8_OBJ);
    t[p++] = s_ns_now();
    if ((rc = kvtier_release(c, lease)) != 0) {
        s_c8_fail("release (case 8)", rc, c);
        return false;
    }
    t[p++] = s_ns_now();
    t[p] = t[p - 1]; /* no ninth phase */
    return true;
}

/* Marks the first 8 bytes of each chunk of src (what is written) and dst (what must be
 * overwritten by the read) with a value of this sequence. */
static void s_c8_stamp(uint8_t *src, uint8_t *dst, uint64_t seq)
{
    for (int i = 0; i < C8_CHUNKS; i++) {
        uint64_t v = s_mix(seq * C8_CHUNKS + (uint64_t)i);
        uint64_t w = ~v;
        memcpy(src + (size_t)i * C8_OBJ, &v, 8);
        memcpy(dst + (size_t)i * C8_OBJ, &w, 8);
    }
}

/* The p50 of each phase over n sequences (t: n rows of C8_PHASES + 1 boundaries), in µs. */
static void s_c8_phases(const uint64_t *t, uint32_t n, double *p50)
{
    double *v = s_xmalloc(n * sizeof *v);
    for (int ph = 0; ph < C8_PHASES; ph++) {
        for (uint32_t i = 0; i < n; i++)
            v[i] = (double)(t[i * (C8_PHASES + 1) + ph + 1] - t[i * (C8_PHASES + 1) + ph]) / 1e3;
        p50[ph] = s_pct(v, n, 0.5);
    }
    free(v);
}

static void s_case_lmcache(void)
{
    s_header("case 8: one prompt of 16 x 1 MiB chunks through the LMCache door vs protocol v1");
    uint32_t iters = s_opt.quick ? 10 : 200, warm = s_opt.quick ? 2 : 20;
    daemon_t d = {0};
    char lep[300];
    snprintf(lep, sizeof lep, "ipc://%s/d8/lmcache.sock", s_opt.run_dir);
    char chunk[16];
    snprintf(chunk, sizeof chunk, "%d", C8_TOKENS);
    const char *extra[] = {"--lmcache-listen", lep, "--chunk-tokens", chunk, NULL};
    /* room for C8_CLEAR_EVERY iterations of both doors (2 x 16 MiB each), far below the
     * watermarks: nothing is evicted */
    if (!s_daemon_start_ex(&d, "d8", s_opt.quick ? "256M" : "512M", "none", NULL, NULL, extra))
        return;
    kvtier_t *c = s_connect(&d, "c8", CALL_TIMEOUT_MS);
    s_lmc_t l;
    bool lok = s_lmc_open(&l, lep);
    uint8_t *pool = MAP_FAILED;
    uint64_t pool_size = 0, instance = (s_mix((uint64_t)getpid() ^ (uint64_t)s_ns_now()) >> 2) |
                                       (1ull << 62);
    uint8_t *src = NULL, *dst = NULL;
    uint32_t *tokens = NULL;
    uint64_t *tl = NULL, *tv = NULL;
    double *sl = NULL, *sv = NULL;
    bool ok = c && lok;
    if (!ok) {
        fprintf(stderr, "kvtier-bench: case 8: cannot connect to both doors\n");
        s_nerr++;
        goto out;
    }
    /* register_kv_cache_engine_driven_context: RegisterEngineDrivenContextPayload, 13 fields in
     * declaration order */
    {
        msgpack_packer *pk = s_lmc_begin(&l, LMC_REGISTER);
        msgpack_pack_map(pk, 13);
        s_pack_str(pk, "instance_id");
        msgpack_pack_uint64(pk, instance);
        s_pack_str(pk, "model_name");
        s_pack_str(pk, C8_MODEL);
        s_pack_str(pk, "world_size");
        msgpack_pack_int(pk, 1);
        s_pack_str(pk, "block_size");
        msgpack_pack_int(pk, 16);
        s_pack_str(pk, "num_layers");
        msgpack_pack_int(pk, C8_LAYERS);
        s_pack_str(pk, "hidden_dim_size");
        msgpack_pack_int(pk, C8_HIDDEN);
        s_pack_str(pk, "dtype_str");
        s_pack_str(pk, "bfloat16");
        s_pack_str(pk, "use_mla");
        msgpack_pack_false(pk);
        s_pack_str(pk, "num_physical_slots");
        msgpack_pack_int(pk, C8_TOKENS);
        s_pack_str(pk, "engine_group_infos");
        msgpack_pack_array(pk, 0);
        s_pack_str(pk, "group_hidden_dim_sizes");
        msgpack_pack_nil(pk);
        s_pack_str(pk, "group_layout_descs");
        msgpack_pack_nil(pk);
        s_pack_str(pk, "enable_l1_kvweave_quant");
        msgpack_pack_false(pk);
        s_lmc_arg(&l);
        const msgpack_object *v = NULL, *name, *err;
        char path[300] = "";
        if (s_lmc_call(&l, &v) == 1 && (err = s_mp_get(v, "error")) &&
            err->type == MSGPACK_OBJECT_NIL && (name = s_mp_get(v, "shm_name")) &&
            name->type == MSGPACK_OBJECT_STR && name->via.str.size &&
            name->via.str.size < 200 && s_mp_uint(s_mp_get(v, "pool_size"), &pool_size) &&
            pool_size) {
            const char *nm = name->via.str.ptr;
            uint32_t nl = name->via.str.size;
            while (nl && *nm == '/')
                nm++, nl--;
            snprintf(path, sizeof path, "/dev/shm/%.*s", (int)nl, nm);
        }
        int fd = path[0] ? open(path, O_RDWR | O_CLOEXEC) : -1;
        if (fd >= 0) {
            pool = mmap(NULL, pool_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            close(fd);
        }
        if (pool == MAP_FAILED) {
            fprintf(stderr, "kvtier-bench: case 8: registration failed or arena %s not mapped\n",
                    path[0] ? path : "(none)");
            s_nerr++;
            ok = false;
            goto out;
        }
    }
    /* both mappings of the arena populated first, as in case 2: no first-touch faults timed */
    if (madvise(pool, pool_size, MADV_POPULATE_WRITE) != 0)
        fprintf(stderr, "kvtier-bench: MADV_POPULATE_WRITE: %s (first touches are timed)\n",
                strerror(errno));
    s_prefault(c);
    src = s_xmalloc(C8_CHUNKS * C8_OBJ);
    dst = s_xmalloc(C8_CHUNKS * C8_OBJ);
    for (size_t i = 0; i < C8_CHUNKS * C8_OBJ; i += 8) {
        uint64_t v = s_mix(i);
        memcpy(src + i, &v, 8);
    }
    memset(dst, 0, C8_CHUNKS * C8_OBJ);
    tokens = s_xmalloc(C8_CHUNKS * C8_TOKENS * sizeof *tokens);
    tl = s_xmalloc((size_t)iters * (C8_PHASES + 1) * sizeof *tl);
    tv = s_xmalloc((size_t)iters * (C8_PHASES + 1) * sizeof *tv);
    sl = s_xmalloc(iters * sizeof *sl);
    sv = s_xmalloc(iters * sizeof *sv);
    double deadline = s_now() + (s_opt.quick ? 10 : 120);
    uint32_t done = 0;
    for (uint32_t i = 0; i < warm + iters && ok && s_now() < deadline; i++) {
        /* alternate which door goes first */
        for (int k = 0; k < 2 && ok; k++) {
            int door = (int)((i + (uint32_t)k) & 1); /* 0: LMCache, 1: v1 */
            uint64_t seq = (uint64_t)i * 2 + (uint64_t)door;
            for (uint32_t j = 0; j < C8_CHUNKS * C8_TOKENS; j++)
                tokens[j] = (uint32_t)(s_mix(seq * 65536 + j + 0x8000000000ull) % 128256);
            s_c8_stamp(src, dst, seq);
            uint64_t tb[C8_PHASES + 1];
            char rid[48];
            snprintf(rid, sizeof rid, "bench8-req-%u", i);
            ok = door == 0 ? s_c8_lmc(&l, pool, pool_size, instance, tokens, rid, src, dst, tb)
                           : s_c8_v1(c, tokens, src, dst, tb);
            if (ok && memcmp(dst, src, C8_CHUNKS * C8_OBJ) != 0) {
                fprintf(stderr, "kvtier-bench: case 8: bytes read back through %s differ from "
                                "those written\n",
                        door == 0 ? "the LMCache door" : "protocol v1");
                ok = false;
            }
            if (ok && i >= warm) {
                memcpy((door == 0 ? tl : tv) + (size_t)(i - warm) * (C8_PHASES + 1), tb,
                       sizeof tb);
                (door == 0 ? sl : sv)[i - warm] = (double)(tb[C8_PHASES] - tb[0]) / 1e3;
            }
        }
        if (ok && i >= warm)
            done++;
        if (ok && i % C8_CLEAR_EVERY == C8_CLEAR_EVERY - 1) { /* not timed */
            s_lmc_begin(&l, LMC_CLEAR);
            msgpack_pack_true(&l.pk);
            s_lmc_arg(&l);
            const msgpack_object *v = NULL;
            int rc = kvtier_clear(c, C8_NS, NULL);
            if (s_lmc_call(&l, &v) != 0 || rc != 0) {
                fprintf(stderr, "kvtier-bench: case 8: clear failed\n");
                ok = false;
            }
        }
    }
    if (!ok) {
        s_nerr++;
        goto out;
    }
    if (done < 10) {
        fprintf(stderr, "kvtier-bench: case 8: only %u iterations in the time allowed\n", done);
        s_nerr++;
        goto out;
    }
    {
        double pl[C8_PHASES], pv[C8_PHASES];
        s_c8_phases(tl, done, pl);
        s_c8_phases(tv, done, pv);
        /* the requests alone: the sequence minus its two memcpy phases */
        double *rl = s_xmalloc(done * sizeof *rl), *rv = s_xmalloc(done * sizeof *rv);
        for (uint32_t i = 0; i < done; i++) {
            const uint64_t *a = tl + (size_t)i * (C8_PHASES + 1), *b = tv + (size_t)i * (C8_PHASES + 1);
            rl[i] = (double)((a[C8_PHASES] - a[0]) - (a[3] - a[2]) - (a[7] - a[6])) / 1e3;
            rv[i] = (double)((b[C8_PHASES] - b[0]) - (b[3] - b[2]) - (b[7] - b[6])) / 1e3;
        }
        double l50 = s_pct(sl, done, 0.5), v50 = s_pct(sv, done, 0.5);
        double l99 = s_pct(sl, done, 0.99), v99 = s_pct(sv, done, 0.99);
        double rl50 = s_pct(rl, done, 0.5), rv50 = s_pct(rv, done, 0.5);
        s_row(8, "LMCache door, 16x1 MiB store+load p50 (b: v1)", l50, v50, "us", l50 / v50,
              "<= 1.2x v1", true, l50 <= 1.2 * v50);
        s_row(8, "  p99 (b: v1 p99)", l99, v99, "us", l99 / v99, "", false, false);
        s_row(8, "  requests only (memcpy excluded) p50 (b: v1)", rl50, rv50, "us",
              rl50 / rv50, "", false, false);
        printf("   LMCache door, p50 of each step (us):");
        for (int ph = 0; ph < C8_PHASES; ph++)
            printf(" %s %.1f%s", s_c8_lmc_phase[ph], pl[ph], ph + 1 < C8_PHASES ? "," : "\n");
        printf("   protocol v1,   p50 of each step (us):");
        for (int ph = 0; ph < C8_PHASES - 1; ph++)
            printf(" %s %.1f%s", s_c8_v1_phase[ph], pv[ph], ph + 2 < C8_PHASES ? "," : "\n");
        json_t *steps = json_object(), *jl = json_array(), *jv = json_array();
        for (int ph = 0; ph < C8_PHASES; ph++) {
            json_array_append_new(jl, json_pack("{s:s, s:f}", "step", s_c8_lmc_phase[ph],
                                                "p50_us", pl[ph]));
            if (ph < C8_PHASES - 1)
                json_array_append_new(jv, json_pack("{s:s, s:f}", "step", s_c8_v1_phase[ph],
                                                    "p50_us", pv[ph]));
        }
        json_object_set_new(steps, "lmcache", jl);
        json_object_set_new(steps, "v1", jv);
        json_object_set_new(steps, "iterations", json_integer(done));
        json_object_set_new(s_json, "case8_steps", steps);
        free(rl);
        free(rv);
    }
out:
    if (pool != MAP_FAILED)
        munmap(pool, pool_size);
    free(src);
    free(dst);
    free(tokens);
    free(tl);
    free(tv);
    free(sl);
    free(sv);
    s_lmc_close(&l);
    kvtier_close(&c);
    s_daemon_stop(&d);
}

/* ---- case 10: restart with an adopted L1 (issue 30) ---------------------------------------- */

/* The status code of GET path on 127.0.0.1:port (0: no answer), and the body into out. */
static int s_http_get(int port, const char *path, char *out, size_t cap)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int code = 0;
    if (fd < 0)
        return 0;
    struct timeval tv = {.tv_sec = 2};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char req[256];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
    size_t got = 0;
    if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0 && write(fd, req, (size_t)n) == n) {
        for (ssize_t r; got + 1 < cap && (r = read(fd, out + got, cap - 1 - got)) > 0;)
            got += (size_t)r;
        out[got] = '\0';
        if (sscanf(out, "HTTP/1.%*d %d", &code) != 1)
            code = 0;
    }
    close(fd);
    if (cap)
        out[got < cap ? got : cap - 1] = '\0';
    return code;
}

/* /status l1.adopt of the daemon on port: objects, bytes, verify_pending, verified_ms (all -1
 * when unknown or not adopted). */
static void s_adopt_status(int port, double *objects, double *bytes, double *pending,
                           double *verified_ms)
{
    *objects = *bytes = *pending = *verified_ms = -1;
    size_t cap = 4 * MiB;
    char *buf = s_xmalloc(cap);
    if (s_http_get(port, "/status", buf, cap) == 200) {
        char *body = strstr(buf, "\r\n\r\n");
        json_t *j = body ? json_loads(body + 4, 0, NULL) : NULL;
        json_t *ad = json_object_get(json_object_get(j, "l1"), "adopt");
        if (json_is_true(json_object_get(ad, "adopted"))) {
            *objects = json_number_value(json_object_get(ad, "objects"));
            *bytes = json_number_value(json_object_get(ad, "bytes"));
            *pending = json_number_value(json_object_get(ad, "verify_pending"));
            /* the check's own time: it starts when the adoption ("ms") ends */
            *verified_ms = json_number_value(json_object_get(ad, "verified_ms")) -
                           json_number_value(json_object_get(ad, "ms"));
        }
        json_decref(j);
    }
    free(buf);
}

/* Fills 90% of an L1 of `l1` bytes (half with 1 MiB objects, half with 64 KiB ones), stops the
 * daemon with SIGTERM and starts it again on the same run dir: exec -> /readyz 200, exec -> the
 * first LOOKUP that hits (a new connection), exec -> every adopted object checked (in the
 * background after the start; an object asked for first is checked then), and the check's
 * rate (bytes / the time from the adoption's end to the last check, while the arena is being
 * pinned too) against XXH3 over the same bytes here, one thread, in the same run. */
static void s_case_restart(void)
{
    s_header("case 10: restart with a full L1 adopted (l1.adopt) vs XXH3 over the same bytes");
    uint64_t l1 = (s_opt.quick ? 256 : 8192) * MiB;
    struct statvfs vfs;
    if (!s_opt.quick && statvfs("/dev/shm", &vfs) == 0) {
        uint64_t room = (uint64_t)vfs.f_bavail * vfs.f_frsize;
        long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        uint64_t ram = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : room;
        uint64_t fit = (room < ram ? room : ram);
        fit = fit > 2048 * MiB ? fit - 2048 * MiB : 0; /* head room for everything else */
        if (fit < l1)
            l1 = fit / (256 * MiB) * (256 * MiB);
        if (l1 < 512 * MiB) {
            printf("   (skipped: %llu MiB of /dev/shm and free memory)\n",
                   (unsigned long long)(fit / MiB));
            return;
        }
    }
    char size[32], http[64];
    snprintf(size, sizeof size, "%lluM", (unsigned long long)(l1 / MiB));
    int port = s_free_port();
    snprintf(http, sizeof http, "127.0.0.1:%d", port);
    const char *extra[] = {"--http", http, "--high-watermark", "0.99", "--low-watermark",
                           "0.98",   NULL};
    daemon_t d = {0};
    if (!s_daemon_start_ex(&d, "d10", size, "none", NULL, NULL, extra))
        return;
    kvtier_t *c = s_connect(&d, "c10", CALL_TIMEOUT_MS);
    uint64_t half = l1 * 9 / 20; /* 90% of L1, half in each size */
    uint32_t nbig = (uint32_t)(half / MiB), nsmall = (uint32_t)(half / (64 * 1024));
    key16_t *big = s_keys(nbig, 10), *small = s_keys(nsmall, 11);
    uint8_t *src = s_xmalloc(MiB);
    for (size_t i = 0; i < MiB; i++)
        src[i] = (uint8_t)(i * 131 + 7);
    bool ok = c && s_store(c, "bench10", big, nbig, MiB, src, 16, NULL) == nbig &&
              s_store(c, "bench10", small, nsmall, 64 * 1024, src, 64, NULL) == nsmall;
    kvtier_close(&c);
    if (!ok) {
        s_nerr++;
        goto out;
    }
    s_stop(d.pid); /* SIGTERM: the checksum thread finishes first, the arena is kept */
    double t0 = s_now(), t_ready = -1, t_hit = -1;
    s_daemon_spawn(&d, "d10", size, "none", NULL, NULL, extra);
    char buf[512];
    while (s_now() - t0 < 60 && t_ready < 0) {
        if (s_http_get(port, "/readyz", buf, sizeof buf) == 200)
            t_ready = s_now() - t0;
        else
            usleep(1000);
    }
    while (t_ready >= 0 && s_now() - t0 < 60 && t_hit < 0) {
        kvtier_t *h = s_connect(&d, "first-hit", 2000);
        uint32_t hits = 0;
        if (h && kvtier_lookup(h, "bench10", NULL, big, 1, 0, &hits, NULL, NULL, NULL) == 0 &&
            hits == 1)
            t_hit = s_now() - t0;
        kvtier_close(&h);
    }
    double objects = -1, bytes = -1, pending = -1, ms = -1, t_verified = -1;
    while (t_hit >= 0 && s_now() - t0 < 60 && t_verified < 0) {
        s_adopt_status(port, &objects, &bytes, &pending, &ms);
        if (pending == 0)
            t_verified = s_now() - t0;
        else
            usleep(5000);
    }
    if (t_verified < 0 || objects != (double)(nbig + nsmall)) {
        fprintf(stderr,
                "kvtier-bench: case 10: ready %.3f s, first hit %.3f s, verified %.3f s, "
                "%g of %u objects adopted (see %s/kvtierd.log)\n",
                t_ready, t_hit, t_verified, objects, nbig + nsmall, d.dir);
        s_nerr++;
        goto out;
    }
    /* the baseline: XXH3 over the same bytes, through this process's mapping of the arena */
    c = s_connect(&d, "c10-xxh3", CALL_TIMEOUT_MS);
    size_t asize = 0;
    const uint8_t *arena = c ? kvtier_arena(c, &asize) : NULL;
    double xrate = 0;
    if (arena && asize >= (size_t)bytes) {
        uint64_t acc = 0;
        double tx = s_now();
        for (size_t off = 0; off < (size_t)bytes; off += MiB)
            acc ^= XXH3_64bits(arena + off, (size_t)bytes - off < MiB ? (size_t)bytes - off : MiB);
        xrate = bytes / (s_now() - tx) / 1e9;
        if (acc == 42)
            printf("   (xxh3 %llu)\n", (unsigned long long)acc);
    }
    kvtier_close(&c);
    double vrate = ms > 0 ? bytes / (ms / 1000) / 1e9 : NAN;
    printf("   %u x 1 MiB + %u x 64 KiB = %.2f GiB adopted, all checked in %.0f ms after the "
           "adoption\n",
           nbig, nsmall, bytes / (double)(1024 * MiB), ms);
    s_row(10, "restart: exec -> /readyz 200", t_ready, NAN, "s", NAN, "<= 2 s", true,
          t_ready <= 2.0);
    s_row(10, "restart: exec -> first L1 hit", t_hit, NAN, "s", NAN, "<= 1 s", true, t_hit <= 1.0);
    s_row(10, "restart: exec -> every object verified", t_verified, NAN, "s", NAN, "", false,
          false);
    s_row(10, "verification rate vs XXH3 (1 thread)", vrate, xrate, "GB/s", vrate / xrate,
          ">= 0.8x", xrate > 0, vrate >= 0.8 * xrate);
out:
    free(big);
    free(small);
    free(src);
    s_daemon_stop(&d);
}

/* ---- main --------------------------------------------------------------------------------- */

static void s_usage(FILE *out, int status)
{
    fprintf(out,
            "usage: kvtier-bench [--quick] [--json FILE] [--daemon PATH] [--redis PATH] "
            "[--only CASES]\n"
            "  --quick        smoke mode: small counts, no verdicts\n"
            "  --json FILE    the results as JSON\n"
            "  --daemon PATH  kvtierd to start (default build/kvtierd)\n"
            "  --redis PATH   redis-server for case 3 (default /usr/bin/redis-server)\n"
            "  --only CASES   the cases to run, e.g. 1,3,6a (6: 6a and 6b); default all:\n"
            "    1   LOOKUP of a 64-key prefix vs a DEALER->ROUTER echo\n"
            "    2   4 MiB RESERVE/COMMIT and ACQUIRE/RELEASE vs memcpy\n"
            "    3   inline PUT/GET of 4 MiB vs redis-server SET/GET\n"
            "    4   PING and LOOKUP requests/s with 1, 8, 32 clients\n"
            "    5   store throughput with continuous eviction vs below the watermark\n"
            "    6a  LOOKUP p99 during 16 x 4 MiB GETs vs idle\n"
            "    6b  LOOKUP p99 during slow-L2 prefetches vs idle\n"
            "    7   LOOKUP cost and RSS per object at 10k / 100k / 1M objects\n"
            "    8   one prompt of 16 x 1 MiB through the LMCache door vs protocol v1\n");
    exit(status);
}

int main(int argc, char **argv)
{
    s_opt.daemon = "build/kvtierd";
    s_opt.redis = "/usr/bin/redis-server";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            s_opt.quick = true;
        else if (!strcmp(argv[i], "--json") && i + 1 < argc)
            s_opt.json_path = argv[++i];
        else if (!strcmp(argv[i], "--daemon") && i + 1 < argc)
            s_opt.daemon = argv[++i];
        else if (!strcmp(argv[i], "--redis") && i + 1 < argc)
            s_opt.redis = argv[++i];
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            s_opt.only = argv[++i];
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            s_usage(stdout, 0);
        else
            s_usage(stderr, 2);
    }
    if (access(s_opt.daemon, X_OK) != 0) {
        fprintf(stderr, "kvtier-bench: %s is not executable (make build/kvtierd)\n",
                s_opt.daemon);
        return 2;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(s_opt.run_dir, sizeof s_opt.run_dir, "%s/kvtier-bench-XXXXXX",
             tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(s_opt.run_dir)) {
        perror("mkdtemp");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    signal(SIGALRM, s_on_alarm);
    alarm(s_opt.quick ? 60 : 420);
    zsys_init();
    zsys_handler_set(NULL);
    s_json = json_pack("{s:s, s:b, s:i, s:[]}", "benchmark", "kvtier-bench", "quick",
                       s_opt.quick, "cpus", (int)sysconf(_SC_NPROCESSORS_ONLN), "results");
    double t_start = s_now();
    s_t0 = t_start;
    printf("kvtier-bench%s: %ld CPUs, run dir %s\n", s_opt.quick ? " --quick (no verdicts)" : "",
           sysconf(_SC_NPROCESSORS_ONLN), s_opt.run_dir);
    printf("%-2s %-46s %10s %10s %-7s %7s  %-24s %s\n", "#", "measurement", "value", "baseline",
           "unit", "ratio", "target", "verdict");

    /* daemon A: cases 1-4 and 6a, L2 none, arena for 96 x 4 MiB + 16 x 4 MiB (not started
     * when --only names none of them nor 6b) */
    daemon_t a = {0};
    bool want_a = s_want("1") || s_want("2") || s_want("3") || s_want("4") || s_want("6a") ||
                  s_want("6b") || s_want("9");
    if (want_a && s_daemon_start(&a, "dA", s_opt.quick ? "160M" : "1G", "none", NULL, NULL)) {
        kvtier_t *c = s_connect(&a, "fill", CALL_TIMEOUT_MS);
        key16_t *lk = s_keys(LOOKUP_KEYS, 1);
        if (c && s_store(c, "bench", lk, LOOKUP_KEYS, 4096, NULL, 64, NULL) == LOOKUP_KEYS) {
            double idle_p99 = 0;
            if (s_want("1"))
                s_case_lookup(&a, lk, &idle_p99);
            if (s_want("2"))
                s_case_shm(&a);
            if (s_want("3"))
                s_case_inline(&a);
            if (s_want("4"))
                s_case_rate(&a, lk);
            if (s_want("6a"))
                s_case_busy_get(&a, lk);
            if (s_want("9"))
                s_case_fastpath(&a, lk);
        } else {
            s_nerr++;
        }
        kvtier_close(&c);
        s_daemon_stop(&a);
        if (s_want("6b"))
            s_case_busy_l2(lk);
        free(lk);
    }
    if (s_want("5"))
        s_case_evict();
    if (s_want("7"))
        s_case_scale();
    if (s_want("8"))
        s_case_lmcache();
    if (s_want("10"))
        s_case_restart();

    double total = s_now() - t_start;
    printf("%d PASS, %d MISS, %d errors; %.1f s\n", s_npass, s_nmiss, s_nerr, total);
    json_object_set_new(s_json, "pass", json_integer(s_npass));
    json_object_set_new(s_json, "miss", json_integer(s_nmiss));
    json_object_set_new(s_json, "errors", json_integer(s_nerr));
    json_object_set_new(s_json, "seconds", json_real(total));
    if (s_opt.json_path && json_dump_file(s_json, s_opt.json_path, JSON_INDENT(2)) != 0) {
        fprintf(stderr, "kvtier-bench: cannot write %s\n", s_opt.json_path);
        s_nerr++;
    }
    json_decref(s_json);
    if (!s_nerr) { /* keep the logs of a failed run */
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", s_opt.run_dir);
        if (system(cmd) != 0) {
        }
    } else {
        fprintf(stderr, "kvtier-bench: logs kept in %s\n", s_opt.run_dir);
    }
    return s_nerr ? 1 : 0;
}
