/* The L2 adapter contract (l2/kvt_l2.h), one suite run against every adapter's ops table: fs
 * (a fresh directory per test), redis (a private redis-server on a free 127.0.0.1 port; skipped
 * when redis-server is not installed), mock (no latency, no faults), and the example plugin
 * loaded through kvt_l2_plugin_load, both its ABI 2 build (KVT_L2_EXAMPLE_PLUGIN) and its ABI 1
 * build (KVT_L2_EXAMPLE_PLUGIN_ABI1; each skipped when its variable is unset).
 *
 * Contract: the table (ABI, kind, max_threads, the operations its ABI requires; an ABI 1 copy
 * has no storev/loadv); absent objects are KVT_ENOTFOUND for lookup, load and remove; round
 * trips from 1 byte to 4 MiB + 1 at the 4 KiB edges, into exact, larger and too small (NOSPC
 * with the size needed) buffers; overwrite with larger and smaller objects; empty objects exist;
 * a capacity of 64 KiB holds exactly 64 KiB and refuses one byte more with NOSPC, keeping the
 * old object (adapters with a capacity); vectored storev/loadv with 1..KVT_L2_IOV_MAX vectors
 * split anywhere, binary bytes (CR LF, NUL), buffers larger and one byte short, and iovcnt 0
 * refused (ABI 2); names: the empty name is KVT_EINVAL, names differing in one character are
 * distinct objects; health answers 0; usage (where the adapter keeps it) counts bytes and
 * objects exactly; max_threads threads (up to 8) at once on private and shared names, every
 * load self-checking, and usage equal to the sum of lookups afterwards.
 *
 * What only one adapter does stays in its own file: test_l2_fs.c (files on disk, index rebuilt
 * at open, capacity LRU, O_DIRECT, disk faults), test_l2_redis.c (prefix, auth, timeouts,
 * reconnects, cluster), test_l2_mock.c (latency, fault and corruption injection, specs),
 * test_l2_plugin.c (loading errors, kvt_l2_plugin_check). */
#include "kvt_error.h"
#include "kvt_l2.h"
#include "kvt_l2_plugin.h"
#include "kvt_log.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#define PG 4096u
#define KIB 1024u
#define MIB (1024u * 1024u)

/* ---- the per-adapter fixtures ------------------------------------------------------------ */

typedef struct fx fx_t;
struct fx {
    const char *label;
    /* once per adapter: 0, or 1 to skip its tests (why printed); fills ops */
    int (*up)(fx_t *f);
    void (*down)(fx_t *f);
    /* per test: the open spec in f->spec (cap: with a 64 KiB capacity) */
    void (*mkspec)(fx_t *f, bool cap);
    bool has_capacity; /* a capacity option that refuses a store past it */
    bool exact_usage;  /* usage() counts what it holds, exactly */
    const kvt_l2_ops_t *ops;
    bool skip;
    void *st;   /* the state open for the running test */
    void *dl;   /* plugin handle */
    pid_t pid;  /* redis-server */
    int port;   /* its port */
    unsigned n; /* tests run: a fresh directory / prefix each */
    char base[128];
    char dir[192];
    char spec[512];
};

static int s_rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

static void s_rmrf(const char *path)
{
    nftw(path, s_rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static int s_up_fs(fx_t *f)
{
    f->ops = kvt_l2_fs_ops();
    snprintf(f->base, sizeof f->base, "/var/tmp/kvt-l2conf-XXXXXX");
    if (!mkdtemp(f->base)) {
        snprintf(f->base, sizeof f->base, "/tmp/kvt-l2conf-XXXXXX");
        if (!mkdtemp(f->base))
            return -1;
    }
    return 0;
}

static void s_down_fs(fx_t *f)
{
    s_rmrf(f->base);
}

static void s_spec_fs(fx_t *f, bool cap)
{
    snprintf(f->dir, sizeof f->dir, "%s/t%u", f->base, f->n);
    snprintf(f->spec, sizeof f->spec, "%s%s", f->dir, cap ? ",capacity=64K" : "");
}

static int s_up_mock(fx_t *f)
{
    f->ops = kvt_l2_mock_ops();
    return 0;
}

static void s_spec_mock(fx_t *f, bool cap)
{
    snprintf(f->spec, sizeof f->spec, "latency_ms=0,fail_rate=0%s", cap ? ",capacity=64k" : "");
}

static int s_up_plugin_var(fx_t *f, const char *var)
{
    const char *path = getenv(var);
    if (!path || !*path) {
        print_message("%s is not set: the %s tests are skipped\n", var, f->label);
        return 1;
    }
    char err[512] = "";
    int rc = kvt_l2_plugin_load(path, &f->ops, &f->dl, err, sizeof err);
    if (rc) {
        print_message("load %s: %s\n", path, err);
        return -1;
    }
    return 0;
}

static int s_up_plugin(fx_t *f)
{
    return s_up_plugin_var(f, "KVT_L2_EXAMPLE_PLUGIN");
}

static int s_up_plugin_abi1(fx_t *f)
{
    return s_up_plugin_var(f, "KVT_L2_EXAMPLE_PLUGIN_ABI1");
}

static void s_down_plugin(fx_t *f)
{
    kvt_l2_plugin_unload(f->dl);
}

static void s_spec_plugin(fx_t *f, bool cap)
{
    snprintf(f->spec, sizeof f->spec, "%s", cap ? "capacity=65536" : "");
}

/* redis: a free port from the kernel, redis-server on it without persistence; ready when the
 * adapter's own health probe answers. */
static int s_up_redis(fx_t *f)
{
    f->ops = kvt_l2_redis_ops();
    f->pid = -1;
    signal(SIGPIPE, SIG_IGN); /* as the daemon does */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || getsockname(fd, (void *)&a, &al))
        return -1;
    close(fd);
    f->port = ntohs(a.sin_port);
    char port[16];
    snprintf(port, sizeof port, "%d", f->port);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 1);
        dup2(null, 2);
        execlp("redis-server", "redis-server", "--port", port, "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", "/tmp", (char *)NULL);
        _exit(127);
    }
    f->pid = pid;
    void *st = NULL;
    char err[256] = "", why[256] = "";
    snprintf(f->spec, sizeof f->spec, "127.0.0.1:%d", f->port);
    if (f->ops->open(f->spec, &st, err, sizeof err))
        return -1;
    int rc = -1, status;
    for (int i = 0; i < 250 && rc; i++) { /* 10 s */
        if (waitpid(pid, &status, WNOHANG) == pid) {
            f->pid = -1;
            break; /* exec failed (127: not installed) or the server died */
        }
        rc = f->ops->health(st, why, sizeof why);
        if (rc)
            usleep(40000);
    }
    f->ops->close(st);
    if (rc && f->pid < 0) {
        print_message("redis-server did not start (not installed?): redis tests skipped\n");
        return 1;
    }
    return rc ? -1 : 0;
}

static void s_down_redis(fx_t *f)
{
    if (f->pid > 0) {
        kill(f->pid, SIGKILL);
        waitpid(f->pid, NULL, 0);
    }
}

static void s_spec_redis(fx_t *f, bool cap)
{
    (void)cap;
    snprintf(f->spec, sizeof f->spec, "127.0.0.1:%d,prefix=conf%u:,timeout_ms=5000", f->port, f->n);
}

#define S_FX(lbl, u, d, m, cap, usage)                                                             \
    {.label = lbl, .up = u, .down = d, .mkspec = m, .has_capacity = cap, .exact_usage = usage}
static fx_t s_fs = S_FX("fs", s_up_fs, s_down_fs, s_spec_fs, true, true);
static fx_t s_redis = S_FX("redis", s_up_redis, s_down_redis, s_spec_redis, false, false);
static fx_t s_mock = S_FX("mock", s_up_mock, NULL, s_spec_mock, true, true);
static fx_t s_plugin = S_FX("plugin", s_up_plugin, s_down_plugin, s_spec_plugin, true, true);
static fx_t s_plugin1 =
    S_FX("plugin-abi1", s_up_plugin_abi1, s_down_plugin, s_spec_plugin, true, true);

/* ---- helpers ----------------------------------------------------------------------------- */

/* Per test: skipped when the adapter is not there; else its state open (no capacity). */
static int s_setup(void **state)
{
    fx_t *f = *state;
    if (f->skip)
        return 0;
    f->n++;
    f->mkspec(f, false);
    char err[256] = "";
    f->st = NULL;
    int rc = f->ops->open(f->spec, &f->st, err, sizeof err);
    if (rc) {
        print_message("%s: open \"%s\": %s (%s)\n", f->label, f->spec, kvt_err_name(rc), err);
        return -1;
    }
    return 0;
}

static int s_teardown(void **state)
{
    fx_t *f = *state;
    if (f->st)
        f->ops->close(f->st);
    f->st = NULL;
    if (f->dir[0])
        s_rmrf(f->dir);
    return 0;
}

static fx_t *s_fx(void **state)
{
    fx_t *f = *state;
    if (f->skip)
        skip();
    return f;
}

/* Name i: 65 characters as kvt_l2_name writes them (adapters treat them as opaque). */
static void s_name(char out[KVT_L2_NAME_LEN], unsigned i)
{
    snprintf(out, KVT_L2_NAME_LEN, "%032x-%032x", 0xc0f0u, i);
}

static void s_fill(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        p[i] = (uint8_t)((x * 0x2545F4914F6CDD1Dull) >> 56);
    }
}

static size_t s_round(size_t n)
{
    return n ? (n + PG - 1) / PG * PG : PG;
}

static uint8_t *s_alloc(size_t n)
{
    uint8_t *p = aligned_alloc(PG, s_round(n));
    assert_non_null(p);
    return p;
}

/* store / load through what the table has: the ABI 1 pair, else the vectored one. */
static int s_store(const fx_t *f, void *st, const char *name, const void *data, size_t len)
{
    if (f->ops->store)
        return f->ops->store(st, name, data, len);
    struct iovec v = {(void *)data, len};
    return f->ops->storev(st, name, &v, 1);
}

static int s_load(const fx_t *f, void *st, const char *name, void *buf, size_t cap, size_t *len)
{
    if (f->ops->load)
        return f->ops->load(st, name, buf, cap, len);
    struct iovec v = {buf, cap};
    return f->ops->loadv(st, name, &v, 1, len);
}

static void s_store_seed(const fx_t *f, const char *name, size_t len, uint64_t seed)
{
    uint8_t *d = s_alloc(len);
    s_fill(d, len, seed);
    int rc = s_store(f, f->st, name, d, len);
    free(d);
    if (rc)
        fail_msg("%s: store %zu bytes: %s", f->label, len, kvt_err_name(rc));
}

static void s_check_seed(const fx_t *f, const char *name, size_t len, uint64_t seed)
{
    size_t cap = s_round(len), got = 7;
    uint8_t *buf = s_alloc(cap), *want = s_alloc(len);
    s_fill(want, len, seed);
    int rc = s_load(f, f->st, name, buf, cap, &got);
    if (rc)
        fail_msg("%s: load %zu bytes: %s", f->label, len, kvt_err_name(rc));
    assert_int_equal(got, len);
    assert_memory_equal(buf, want, len);
    size_t n = 0;
    assert_int_equal(f->ops->lookup(f->st, name, &n), 0);
    assert_int_equal(n, len);
    free(buf);
    free(want);
}

static void s_usage_is(const fx_t *f, uint64_t bytes, uint64_t objects)
{
    if (!f->exact_usage || !f->ops->usage)
        return;
    uint64_t b = 0, o = 0;
    f->ops->usage(f->st, &b, &o);
    assert_int_equal(b, bytes);
    assert_int_equal(o, objects);
}

/* ---- the contract ------------------------------------------------------------------------ */

static void test_ops_table(void **state)
{
    fx_t *f = s_fx(state);
    const kvt_l2_ops_t *o = f->ops;
    assert_true(o->abi >= KVT_L2_ABI_MIN && o->abi <= KVT_L2_ABI);
    assert_non_null(o->kind);
    assert_true(strlen(o->kind) > 0);
    assert_true(o->max_threads >= 1);
    assert_non_null(o->open);
    assert_non_null(o->close);
    assert_non_null(o->lookup);
    assert_non_null(o->remove);
    assert_non_null(o->health);
    if (o->abi >= 2) {
        assert_non_null(o->storev);
        assert_non_null(o->loadv);
    } else {
        assert_non_null(o->store);
        assert_non_null(o->load);
        assert_null(o->storev); /* the loader's copy of an ABI 1 table ends there */
        assert_null(o->loadv);
    }
}

static void test_not_found(void **state)
{
    fx_t *f = s_fx(state);
    char name[KVT_L2_NAME_LEN];
    s_name(name, 1);
    uint8_t *buf = s_alloc(PG);
    size_t len = 77;
    assert_int_equal(f->ops->lookup(f->st, name, &len), KVT_ENOTFOUND);
    assert_int_equal(s_load(f, f->st, name, buf, PG, &len), KVT_ENOTFOUND);
    assert_int_equal(f->ops->remove(f->st, name), KVT_ENOTFOUND);
    s_usage_is(f, 0, 0);
    free(buf);
}

static void test_round_trip_sizes(void **state)
{
    fx_t *f = s_fx(state);
    static const size_t sizes[] = {1, 2, 100, PG - 1, PG, PG + 1, 65536, MIB + 3, 4 * MIB + 1};
    enum { N = sizeof sizes / sizeof sizes[0] };
    char names[N][KVT_L2_NAME_LEN];
    uint64_t total = 0;
    for (size_t i = 0; i < N; i++) {
        s_name(names[i], 10 + (unsigned)i);
        s_store_seed(f, names[i], sizes[i], i + 100);
        total += sizes[i];
        s_usage_is(f, total, i + 1);
    }
    for (size_t i = 0; i < N; i++) {
        s_check_seed(f, names[i], sizes[i], i + 100);
        /* a larger buffer is fine; one page too small: NOSPC and the size needed */
        size_t cap = s_round(sizes[i]) + 2 * PG, got = 0;
        uint8_t *buf = s_alloc(cap);
        assert_int_equal(s_load(f, f->st, names[i], buf, cap, &got), 0);
        assert_int_equal(got, sizes[i]);
        if (s_round(sizes[i]) > PG) {
            got = 0;
            assert_int_equal(s_load(f, f->st, names[i], buf, s_round(sizes[i]) - PG, &got),
                             KVT_ENOSPC);
            assert_int_equal(got, sizes[i]);
        }
        free(buf);
    }
    for (size_t i = 0; i < N; i++) {
        assert_int_equal(f->ops->remove(f->st, names[i]), 0);
        assert_int_equal(f->ops->remove(f->st, names[i]), KVT_ENOTFOUND);
        assert_int_equal(f->ops->lookup(f->st, names[i], &(size_t){0}), KVT_ENOTFOUND);
        total -= sizes[i];
        s_usage_is(f, total, N - 1 - i);
    }
}

static void test_overwrite(void **state)
{
    fx_t *f = s_fx(state);
    char name[KVT_L2_NAME_LEN];
    s_name(name, 2);
    s_store_seed(f, name, 10000, 1);
    s_store_seed(f, name, 5000, 2);
    s_check_seed(f, name, 5000, 2);
    s_usage_is(f, 5000, 1);
    s_store_seed(f, name, 3 * MIB + 1, 3);
    s_check_seed(f, name, 3 * MIB + 1, 3);
    s_usage_is(f, 3 * MIB + 1, 1);
}

static void test_empty_object(void **state)
{
    fx_t *f = s_fx(state);
    char name[KVT_L2_NAME_LEN];
    s_name(name, 3);
    assert_int_equal(s_store(f, f->st, name, NULL, 0), 0);
    size_t len = 9;
    assert_int_equal(f->ops->lookup(f->st, name, &len), 0);
    assert_int_equal(len, 0);
    uint8_t *buf = s_alloc(PG);
    len = 9;
    assert_int_equal(s_load(f, f->st, name, buf, PG, &len), 0);
    assert_int_equal(len, 0);
    s_usage_is(f, 0, 1);
    assert_int_equal(f->ops->remove(f->st, name), 0);
    assert_int_equal(f->ops->lookup(f->st, name, &len), KVT_ENOTFOUND);
    free(buf);
}

/* 64 KiB of capacity: exactly that fits; one byte more is NOSPC and the old object stays. */
static void test_capacity_nospc(void **state)
{
    fx_t *f = s_fx(state);
    if (!f->has_capacity)
        skip();
    f->ops->close(f->st);
    f->st = NULL;
    if (f->dir[0])
        s_rmrf(f->dir);
    f->mkspec(f, true);
    char err[256] = "";
    assert_int_equal(f->ops->open(f->spec, &f->st, err, sizeof err), 0);
    char a[KVT_L2_NAME_LEN], b[KVT_L2_NAME_LEN];
    s_name(a, 4);
    s_name(b, 5);
    s_store_seed(f, a, 64 * KIB, 4);
    uint8_t *big = s_alloc(64 * KIB + 1);
    memset(big, 7, 64 * KIB + 1);
    assert_int_equal(s_store(f, f->st, a, big, 64 * KIB + 1), KVT_ENOSPC);
    assert_int_equal(s_store(f, f->st, b, big, 64 * KIB + 1), KVT_ENOSPC);
    assert_int_equal(f->ops->lookup(f->st, b, &(size_t){0}), KVT_ENOTFOUND);
    s_check_seed(f, a, 64 * KIB, 4);
    s_usage_is(f, 64 * KIB, 1);
    char why[256] = "";
    assert_int_equal(f->ops->health(f->st, why, sizeof why), 0); /* not a backend failure */
    free(big);
}

/* storev / loadv: every split of payload + trailer, binary bytes, short and long buffers. */
static void test_vectored(void **state)
{
    fx_t *f = s_fx(state);
    if (f->ops->abi < 2)
        skip();
    static const size_t sizes[] = {1, 100, PG - 40, PG, PG + 1, 2 * PG + 123, MIB + 7};
    uint8_t trailer[40], tb[40];
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t n = sizes[i], got = 0;
        char name[KVT_L2_NAME_LEN];
        s_name(name, 100 + (unsigned)i);
        uint8_t *d = s_alloc(n), *back = s_alloc(n), *whole = s_alloc(n + 40 + PG);
        s_fill(d, n, i + 9);
        s_fill(trailer, sizeof trailer, i + 1000);
        memcpy(trailer, "\r\n\0\r", 4); /* binary-safe: no delimiters */
        for (int cnt = 1; cnt <= KVT_L2_IOV_MAX; cnt++) {
            /* cnt vectors: the payload cut in cnt-1 pieces (one may be empty), then the
             * trailer; with 1 vector, payload and trailer glued */
            struct iovec in[KVT_L2_IOV_MAX];
            size_t total = n + 40;
            if (cnt == 1) {
                memcpy(whole, d, n);
                memcpy(whole + n, trailer, 40);
                in[0] = (struct iovec){whole, total};
            } else {
                size_t off = 0;
                for (int k = 0; k < cnt - 1; k++) {
                    size_t piece = k == cnt - 2 ? n - off : (n - off) / 3;
                    in[k] = (struct iovec){d + off, piece};
                    off += piece;
                }
                in[cnt - 1] = (struct iovec){trailer, 40};
            }
            assert_int_equal(f->ops->storev(f->st, name, in, cnt), 0);
            size_t olen = 0;
            assert_int_equal(f->ops->lookup(f->st, name, &olen), 0);
            assert_int_equal(olen, total);
            /* loaded back into payload + trailer */
            memset(back, 0, n);
            memset(tb, 0, sizeof tb);
            struct iovec out[3] = {{back, n / 2}, {back + n / 2, n - n / 2}, {tb, sizeof tb}};
            assert_int_equal(f->ops->loadv(f->st, name, out, 3, &got), 0);
            assert_int_equal(got, total);
            assert_memory_equal(back, d, n);
            assert_memory_equal(tb, trailer, sizeof tb);
            /* one byte short: NOSPC with the size */
            out[2].iov_len = sizeof tb - 1;
            got = 0;
            assert_int_equal(f->ops->loadv(f->st, name, out, 3, &got), KVT_ENOSPC);
            assert_int_equal(got, total);
        }
        /* a plain load of the whole object; and a vector larger than the object */
        size_t cap = s_round(n + 40 + PG);
        uint8_t *one = s_alloc(cap);
        assert_int_equal(s_load(f, f->st, name, one, cap, &got), 0);
        assert_int_equal(got, n + 40);
        assert_memory_equal(one, d, n);
        assert_memory_equal(one + n, trailer, 40);
        struct iovec big[2] = {{one, 1}, {one + 1, cap - 1}};
        memset(one, 0, cap);
        assert_int_equal(f->ops->loadv(f->st, name, big, 2, &got), 0);
        assert_int_equal(got, n + 40);
        assert_memory_equal(one, d, n);
        free(one);
        assert_int_equal(f->ops->remove(f->st, name), 0);
        free(d);
        free(back);
        free(whole);
    }
    char name[KVT_L2_NAME_LEN];
    s_name(name, 99);
    struct iovec v = {tb, 1};
    assert_int_equal(f->ops->storev(f->st, name, &v, 0), KVT_EINVAL);
    assert_int_equal(f->ops->lookup(f->st, name, &(size_t){0}), KVT_ENOTFOUND);
}

static void test_names(void **state)
{
    fx_t *f = s_fx(state);
    size_t len;
    uint8_t *buf = s_alloc(PG);
    assert_int_equal(s_store(f, f->st, "", "x", 1), KVT_EINVAL);
    /* names one character apart, first and last, are different objects */
    char a[KVT_L2_NAME_LEN], b[KVT_L2_NAME_LEN], c[KVT_L2_NAME_LEN];
    s_name(a, 0x10);
    memcpy(b, a, sizeof b);
    memcpy(c, a, sizeof c);
    b[0] = b[0] == 'f' ? 'e' : 'f';
    c[KVT_L2_NAME_LEN - 2] = c[KVT_L2_NAME_LEN - 2] == 'f' ? 'e' : 'f';
    s_store_seed(f, a, 100, 1);
    s_store_seed(f, b, 200, 2);
    s_store_seed(f, c, 300, 3);
    s_check_seed(f, a, 100, 1);
    s_check_seed(f, b, 200, 2);
    s_check_seed(f, c, 300, 3);
    assert_int_equal(f->ops->remove(f->st, b), 0);
    s_check_seed(f, a, 100, 1);
    s_check_seed(f, c, 300, 3);
    assert_int_equal(f->ops->lookup(f->st, b, &len), KVT_ENOTFOUND);
    s_usage_is(f, 400, 2);
    free(buf);
}

static void test_health(void **state)
{
    fx_t *f = s_fx(state);
    char why[256] = "";
    assert_int_equal(f->ops->health(f->st, why, sizeof why), 0);
}

/* ---- threads ----------------------------------------------------------------------------- */

#define T_SHARED 8
#define T_ROUNDS 150
#define T_MAXLEN 20000u

typedef struct {
    const fx_t *f;
    unsigned id;
    uint64_t seed;
    int bad;
    char msg[160];
} s_worker_t;

static uint64_t s_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}

/* Self-describing payload: [seed:8][len:8] then s_fill(seed). */
static void s_payload(uint8_t *p, size_t len, uint64_t seed)
{
    uint64_t l = len;
    memcpy(p, &seed, 8);
    memcpy(p + 8, &l, 8);
    s_fill(p + 16, len - 16, seed);
}

static void s_bad(s_worker_t *w, const char *what, int rc)
{
    if (!w->bad++)
        snprintf(w->msg, sizeof w->msg, "%s: %s", what, kvt_err_name(rc));
}

static void *s_worker(void *arg)
{
    s_worker_t *w = arg;
    const fx_t *f = w->f;
    size_t cap = s_round(T_MAXLEN);
    uint8_t *out = s_alloc(cap), *in = s_alloc(cap), *chk = s_alloc(cap);
    for (unsigned i = 0; i < T_ROUNDS && !w->bad; i++) {
        char name[KVT_L2_NAME_LEN];
        bool shared = s_next(&w->seed) % 2;
        s_name(name, shared ? (unsigned)(s_next(&w->seed) % T_SHARED) : 1000 + w->id * 100 + i % 7);
        size_t l = 16 + s_next(&w->seed) % (T_MAXLEN - 16), len = 0;
        s_payload(out, l, s_next(&w->seed));
        int rc = s_store(f, f->st, name, out, l);
        if (rc) {
            s_bad(w, "store", rc);
            break;
        }
        rc = s_load(f, f->st, name, in, cap, &len);
        if (rc == KVT_ENOTFOUND && shared)
            continue; /* another thread removed it */
        if (rc) {
            s_bad(w, "load", rc);
            break;
        }
        uint64_t seed, l2;
        memcpy(&seed, in, 8);
        memcpy(&l2, in + 8, 8);
        if (len < 16 || l2 != len) {
            s_bad(w, "load: torn length", 0);
            break;
        }
        s_payload(chk, len, seed);
        if (memcmp(in, chk, len) != 0)
            s_bad(w, "load: wrong bytes", 0);
        if (!shared && memcmp(in, out, l) != 0)
            s_bad(w, "load: not what this thread stored", 0);
        if (s_next(&w->seed) % 5 == 0) {
            rc = f->ops->remove(f->st, name);
            if (rc && !(shared && rc == KVT_ENOTFOUND))
                s_bad(w, "remove", rc);
        }
    }
    free(out);
    free(in);
    free(chk);
    return NULL;
}

static void test_concurrent(void **state)
{
    fx_t *f = s_fx(state);
    unsigned nt = f->ops->max_threads < 8 ? f->ops->max_threads : 8; /* what the table allows */
    pthread_t th[8];
    s_worker_t w[8];
    for (unsigned i = 0; i < nt; i++) {
        w[i] = (s_worker_t){.f = f, .id = i, .seed = 0x9e37ull * (i + 1)};
        assert_int_equal(pthread_create(&th[i], NULL, s_worker, &w[i]), 0);
    }
    for (unsigned i = 0; i < nt; i++) {
        pthread_join(th[i], NULL);
        if (w[i].bad)
            fail_msg("%s: thread %u: %d failures, first: %s", f->label, i, w[i].bad, w[i].msg);
    }
    /* quiescent: usage is the sum of what lookup finds */
    uint64_t sum = 0, count = 0;
    for (unsigned k = 0; k < 1000 + 100 * nt; k++) {
        char name[KVT_L2_NAME_LEN];
        size_t len;
        s_name(name, k);
        if (f->ops->lookup(f->st, name, &len) == 0) {
            sum += len;
            count++;
        }
    }
    assert_true(count > 0);
    s_usage_is(f, sum, count);
}

/* ---- the runs ---------------------------------------------------------------------------- */

#define S_T(fn, f) cmocka_unit_test_prestate_setup_teardown(fn, s_setup, s_teardown, &(f))
#define S_SUITE(f)                                                                                 \
    {                                                                                              \
        S_T(test_ops_table, f), S_T(test_not_found, f), S_T(test_round_trip_sizes, f),             \
            S_T(test_overwrite, f), S_T(test_empty_object, f), S_T(test_capacity_nospc, f),        \
            S_T(test_vectored, f), S_T(test_names, f), S_T(test_health, f),                        \
            S_T(test_concurrent, f),                                                               \
    }

static int s_run(fx_t *f, const struct CMUnitTest *tests, size_t n)
{
    int up = f->up(f);
    if (up < 0) {
        print_message("%s: the fixture failed to start\n", f->label);
        return 1;
    }
    f->skip = up > 0;
    int failed = _cmocka_run_group_tests(f->label, tests, n, NULL, NULL);
    if (!f->skip && f->down)
        f->down(f);
    return failed;
}

int main(void)
{
    kvt_log_set_level(KVT_LOG_ERROR);
    const struct CMUnitTest fs[] = S_SUITE(s_fs), redis[] = S_SUITE(s_redis),
                            mock[] = S_SUITE(s_mock), plugin[] = S_SUITE(s_plugin),
                            plugin1[] = S_SUITE(s_plugin1);
    int failed = 0;
    failed += s_run(&s_fs, fs, sizeof fs / sizeof fs[0]);
    failed += s_run(&s_redis, redis, sizeof redis / sizeof redis[0]);
    failed += s_run(&s_mock, mock, sizeof mock / sizeof mock[0]);
    failed += s_run(&s_plugin, plugin, sizeof plugin / sizeof plugin[0]);
    failed += s_run(&s_plugin1, plugin1, sizeof plugin1 / sizeof plugin1[0]);
    return failed;
}
