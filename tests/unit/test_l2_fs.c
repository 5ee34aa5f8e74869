/* Unit tests of l2/kvt_l2_fs (the `fs` L2 adapter) and kvt_l2_name, beyond the adapter contract
 * (test_l2_conformance.c): the files on disk agree with usage through stores at the 4 KiB
 * edges, unaligned data, an empty object and removes; the index rebuilt at open (foreign files
 * ignored, crash leftovers removed, LRU order from mtimes), capacity and LRU eviction, a
 * 4-thread run under a capacity with self-checking payloads, O_DIRECT (real tmpfs and disk
 * directories, plus a refusal injected below), disk errors injected below (no partial file,
 * temp cleaned, health says why), a removed directory, and bad arguments.
 *
 * The vectored storev/loadv (ABI 2): payload + trailer at the 4 KiB edges, with and without
 * O_DIRECT, in place and through the bounce pages, short and long buffers, and write errors on
 * the buffered (pwritev) path.
 *
 * Fault injection: this file defines openat, pwritev (every write of the adapter goes through it)
 * and fdatasync, which the adapter's calls bind to ahead of libc; they forward to the system
 * calls unless a s_fault_* flag is set. */
#include "kvt_error.h"
#include "kvt_l2.h"
#include "kvt_l2_name.h"
#include "kvt_log.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include <cmocka.h>

#define PG 4096u
#define KIB 1024u
#define MIB (1024u * 1024u)

/* ---- fault injection ----------------------------------------------------------------------- */

static atomic_int s_fault_open_direct;      /* openat with O_DIRECT fails with EINVAL */
static atomic_int s_fault_write_direct;     /* pwritev on an O_DIRECT fd fails with EINVAL */
static atomic_int s_fault_write_errno;      /* every pwritev fails with this errno */
static atomic_int s_fault_sync_errno;       /* every fdatasync and syncfs fails with this errno */
static atomic_int s_fault_sync_pass;        /* ... but for the next this many fdatasync calls */
static atomic_int s_fdatasyncs, s_syncfses; /* calls made */
static atomic_int s_direct_opens;           /* successful openat calls with O_DIRECT */

int openat(int dirfd, const char *path, int flags, ...)
{
    mode_t mode = 0;
    if (flags & (O_CREAT | __O_TMPFILE)) {
        va_list ap;
        va_start(ap, flags);
        mode = va_arg(ap, mode_t);
        va_end(ap);
    }
    if ((flags & O_DIRECT) && atomic_load(&s_fault_open_direct)) {
        errno = EINVAL;
        return -1;
    }
    int fd = (int)syscall(SYS_openat, dirfd, path, flags, mode);
    if (fd >= 0 && (flags & O_DIRECT))
        atomic_fetch_add(&s_direct_opens, 1);
    return fd;
}

ssize_t pwritev(int fd, const struct iovec *iov, int n, off_t off)
{
    int e = atomic_load(&s_fault_write_errno);
    if (e) {
        errno = e;
        return -1;
    }
    if (atomic_load(&s_fault_write_direct) && (fcntl(fd, F_GETFL) & O_DIRECT)) {
        errno = EINVAL;
        return -1;
    }
    return (ssize_t)syscall(SYS_pwritev, fd, iov, n, (long)off, 0L);
}

int fdatasync(int fd)
{
    atomic_fetch_add(&s_fdatasyncs, 1);
    int e = atomic_load(&s_fault_sync_errno);
    if (e && atomic_fetch_sub(&s_fault_sync_pass, 1) > 0)
        e = 0;
    if (e) {
        errno = e;
        return -1;
    }
    return (int)syscall(SYS_fdatasync, fd);
}

int syncfs(int fd)
{
    atomic_fetch_add(&s_syncfses, 1);
    int e = atomic_load(&s_fault_sync_errno);
    if (e) {
        errno = e;
        return -1;
    }
    return (int)syscall(SYS_syncfs, fd);
}

static void s_faults_clear(void)
{
    atomic_store(&s_fault_open_direct, 0);
    atomic_store(&s_fault_write_direct, 0);
    atomic_store(&s_fault_write_errno, 0);
    atomic_store(&s_fault_sync_errno, 0);
    atomic_store(&s_fault_sync_pass, 0);
    atomic_store(&s_direct_opens, 0);
}

/* ---- helpers ------------------------------------------------------------------------------- */

typedef struct {
    char dir[256];  /* a fresh directory that the adapter may create things in */
    char spec[512]; /* scratch for "DIR,options" */
    bool segments;  /* the test runs on layout=segments (else layout=files) */
} ctx_t;

static const kvt_l2_ops_t *s_ops(void)
{
    return kvt_l2_fs_ops();
}

static size_t s_round(size_t n)
{
    return (n + PG - 1) / PG * PG;
}

static int s_rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static void s_rmrf(const char *path)
{
    nftw(path, s_rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static int s_mkdtemp(ctx_t *c, const char *base)
{
    snprintf(c->dir, sizeof c->dir, "%s/kvt-l2fs-XXXXXX", base);
    return mkdtemp(c->dir) ? 0 : -1;
}

/* Each test gets a directory on a disk filesystem (/var/tmp, else the build directory). */
static int s_setup(void **state)
{
    ctx_t *c = calloc(1, sizeof *c);
    if (!c)
        return -1;
    if (s_mkdtemp(c, "/var/tmp") != 0 && s_mkdtemp(c, "build") != 0) {
        free(c);
        return -1;
    }
    s_faults_clear();
    *state = c;
    return 0;
}

static int s_setup_seg(void **state)
{
    int rc = s_setup(state);
    if (!rc)
        ((ctx_t *)*state)->segments = true;
    return rc;
}

static int s_teardown(void **state)
{
    ctx_t *c = *state;
    s_faults_clear();
    s_rmrf(c->dir);
    free(c);
    return 0;
}

static const char *s_spec(ctx_t *c, const char *dir, const char *opts)
{
    snprintf(c->spec, sizeof c->spec, "%s,layout=%s%s%s", dir, c->segments ? "segments" : "files",
             opts ? "," : "", opts ? opts : "");
    return c->spec;
}

static void *s_open(ctx_t *c, const char *opts)
{
    char err[256] = "x";
    void *fs = NULL;
    int rc = s_ops()->open(s_spec(c, c->dir, opts), &fs, err, sizeof err);
    if (rc != 0)
        fail_msg("open %s: %s: %s", c->spec, kvt_err_name(rc), err);
    assert_non_null(fs);
    assert_string_equal(err, "");
    return fs;
}

/* The name of key number i in a test namespace. */
static void s_name(unsigned i, char out[KVT_L2_NAME_LEN])
{
    kvt_key_t key = {{0}};
    memcpy(key.b, &i, sizeof i);
    key.b[15] = 0x5a;
    kvt_ns_t ns = {(const uint8_t *)"test-model", 10, (const uint8_t *)"t", 1};
    kvt_l2_name(&ns, &key, out);
}

/* Deterministic bytes from a seed (xorshift64*). */
static void s_fill(uint8_t *p, size_t len, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1, w = 0;
    for (size_t i = 0; i < len; i++) {
        if (i % 8 == 0) {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            w = x * 0x2545F4914F6CDD1Dull;
        }
        p[i] = (uint8_t)(w >> (8 * (i % 8)));
    }
}

static uint8_t *s_alloc(size_t len)
{
    uint8_t *p = aligned_alloc(PG, s_round(len ? len : 1));
    assert_non_null(p);
    return p;
}

static void s_store_seed(void *fs, const char *name, size_t len, uint64_t seed)
{
    uint8_t *d = s_alloc(len);
    s_fill(d, len, seed);
    int rc = s_ops()->store(fs, name, d, len);
    free(d);
    if (rc != 0)
        fail_msg("store %s (%zu bytes): %s", name, len, kvt_err_name(rc));
}

/* Loads `name` and checks it is `len` bytes made from `seed`. */
static void s_check_seed(void *fs, const char *name, size_t len, uint64_t seed)
{
    size_t cap = s_round(len ? len : 1), got = 0;
    uint8_t *buf = s_alloc(cap), *want = s_alloc(len);
    s_fill(want, len, seed);
    int rc = s_ops()->load(fs, name, buf, cap, &got);
    if (rc != 0)
        fail_msg("load %s: %s", name, kvt_err_name(rc));
    assert_int_equal(got, len);
    assert_memory_equal(buf, want, len);
    free(buf);
    free(want);
}

static void s_usage(void *fs, uint64_t *bytes, uint64_t *objects)
{
    s_ops()->usage(fs, bytes, objects);
}

/* Files and bytes on disk, outside .tmp/, seg/ and the lock file; segment files and bytes. */
static uint64_t s_du_files, s_du_bytes, s_du_segs, s_du_seg_bytes;

static int s_du_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    if (flag == FTW_F && S_ISREG(st->st_mode) && strstr(path, "/seg/")) {
        s_du_segs++;
        s_du_seg_bytes += (uint64_t)st->st_size;
    } else if (flag == FTW_F && S_ISREG(st->st_mode) && !strstr(path, "/.tmp/") &&
               strcmp(path + ftw->base, ".lock") != 0) {
        s_du_files++;
        s_du_bytes += (uint64_t)st->st_size;
    }
    return 0;
}

static void s_du(const char *dir, uint64_t *files, uint64_t *bytes)
{
    s_du_files = s_du_bytes = s_du_segs = s_du_seg_bytes = 0;
    nftw(dir, s_du_one, 16, FTW_PHYS);
    *files = s_du_files;
    *bytes = s_du_bytes;
}

static int s_count_tmp(const char *dir)
{
    char p[400];
    snprintf(p, sizeof p, "%s/.tmp", dir);
    DIR *d = opendir(p);
    if (!d)
        return -1;
    int n = 0;
    for (struct dirent *de; (de = readdir(d));)
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
            n++;
    closedir(d);
    return n;
}

/* Index and disk agree, and nothing is left in .tmp/. */
static void s_check_disk(const ctx_t *c, void *fs, uint64_t foreign_files, uint64_t foreign_bytes)
{
    uint64_t bytes, objects, files, dbytes;
    s_usage(fs, &bytes, &objects);
    s_du(c->dir, &files, &dbytes);
    if (c->segments) {
        /* every object is in a segment: no file of its own, the segments hold its bytes */
        assert_int_equal(files, foreign_files);
        assert_int_equal(dbytes, foreign_bytes);
        assert_true(s_du_seg_bytes >= bytes + objects * 64);
        assert_true(objects == 0 || s_du_segs > 0);
    } else {
        assert_int_equal(files, objects + foreign_files);
        assert_int_equal(dbytes, bytes + foreign_bytes);
        assert_int_equal(s_du_segs, 0);
    }
    assert_int_equal(s_count_tmp(c->dir), 0);
}

/* The object file of `name` (white box: DIR/xx/NAME, xx from XXH3_64 of the name). */
static void s_obj_path(const ctx_t *c, const char *name, char *out, size_t outlen)
{
    unsigned fan = (unsigned)(XXH3_64bits(name, strlen(name)) & 0xff);
    snprintf(out, outlen, "%s/%02x/%s", c->dir, fan, name);
}

static void s_write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* ---- kvt_l2_name --------------------------------------------------------------------------- */

/* Vectors from Python: xxhash.xxh3_128(struct.pack('<I', len(ns)) + ns + salt).hexdigest()
 * + '-' + key.hex(). */
static void test_name_vectors(void **state)
{
    (void)state;
    kvt_key_t key, zero = {{0}}, ff;
    for (int i = 0; i < 16; i++)
        key.b[i] = (uint8_t)i;
    memset(ff.b, 0xff, sizeof ff.b);
    char out[KVT_L2_NAME_LEN];
    const uint8_t *ns = (const uint8_t *)"llama-3-8b/kv";
    kvt_l2_name(&(kvt_ns_t){ns, 13, (const uint8_t *)"tenant-a", 8}, &key, out);
    assert_string_equal(out, "00cc070c13bdc9dbc1da88310a2d1e65-000102030405060708090a0b0c0d0e0f");
    kvt_l2_name(&(kvt_ns_t){ns, 13, NULL, 0}, &key, out);
    assert_string_equal(out, "d8277ff729d4eed7252f258a9e8bc714-000102030405060708090a0b0c0d0e0f");
    kvt_l2_name(&(kvt_ns_t){NULL, 0, NULL, 0}, &zero, out);
    assert_string_equal(out, "2a33816ed7e0c373dbe563c737220b65-00000000000000000000000000000000");
    /* longer than the stack buffer: the streamed path */
    uint8_t big_ns[300], big_salt[200];
    memset(big_ns, 'x', sizeof big_ns);
    memset(big_salt, 's', sizeof big_salt);
    kvt_l2_name(&(kvt_ns_t){big_ns, 300, big_salt, 200}, &ff, out);
    assert_string_equal(out, "9c09de5e6528aa04cf1151104760571b-ffffffffffffffffffffffffffffffff");
    assert_int_equal(strlen(out), KVT_L2_NAME_LEN - 1);

    /* the ns length is hashed: ("ab", "c") and ("a", "bc") are different namespaces */
    char a[KVT_L2_NAME_LEN], b[KVT_L2_NAME_LEN];
    kvt_l2_name(&(kvt_ns_t){(const uint8_t *)"ab", 2, (const uint8_t *)"c", 1}, &key, a);
    kvt_l2_name(&(kvt_ns_t){(const uint8_t *)"a", 1, (const uint8_t *)"bc", 2}, &key, b);
    assert_string_not_equal(a, b);
}

/* ---- round trips --------------------------------------------------------------------------- */

/* Usage and the files on disk agree through stores, an unaligned one, an empty object and
 * removes. */
static void test_files_on_disk(void **state)
{
    ctx_t *c = *state;
    void *fs = s_open(c, NULL);
    static const size_t sizes[] = {1, 4095, 4096, 4097, 3 * MIB};
    const size_t n = sizeof sizes / sizeof sizes[0];
    char names[8][KVT_L2_NAME_LEN];
    uint64_t total = 0, bytes, objects;
    for (size_t i = 0; i < n; i++) {
        s_name((unsigned)i, names[i]);
        size_t len = 7;
        assert_int_equal(s_ops()->lookup(fs, names[i], &len), KVT_ENOTFOUND);
        s_store_seed(fs, names[i], sizes[i], i + 100);
        assert_int_equal(s_ops()->lookup(fs, names[i], &len), 0);
        assert_int_equal(len, sizes[i]);
        total += sizes[i];
        s_usage(fs, &bytes, &objects);
        assert_int_equal(bytes, total);
        assert_int_equal(objects, i + 1);
    }
    s_check_disk(c, fs, 0, 0);
    for (size_t i = 0; i < n; i++)
        s_check_seed(fs, names[i], sizes[i], i + 100);

    /* the caller's data need not be aligned (buffered for that object) */
    uint8_t *raw = malloc(5000 + 1);
    assert_non_null(raw);
    s_fill(raw + 1, 5000, 77);
    assert_int_equal(s_ops()->store(fs, names[0], raw + 1, 5000), 0);
    free(raw);
    s_check_seed(fs, names[0], 5000, 77);
    total += 5000 - sizes[0];

    /* an empty object */
    char empty[KVT_L2_NAME_LEN];
    s_name(99, empty);
    assert_int_equal(s_ops()->store(fs, empty, NULL, 0), 0);
    size_t got = 1;
    uint8_t *buf = s_alloc(PG);
    assert_int_equal(s_ops()->load(fs, empty, buf, PG, &got), 0);
    assert_int_equal(got, 0);
    free(buf);
    s_usage(fs, &bytes, &objects);
    assert_int_equal(bytes, total);
    assert_int_equal(objects, n + 1);
    s_check_disk(c, fs, 0, 0);

    for (size_t i = 0; i < n; i++) {
        assert_int_equal(s_ops()->remove(fs, names[i]), 0);
        assert_int_equal(s_ops()->remove(fs, names[i]), KVT_ENOTFOUND);
        assert_int_equal(s_ops()->lookup(fs, names[i], NULL), KVT_ENOTFOUND);
        buf = s_alloc(PG);
        assert_int_equal(s_ops()->load(fs, names[i], buf, PG, &got), KVT_ENOTFOUND);
        free(buf);
    }
    assert_int_equal(s_ops()->remove(fs, empty), 0);
    s_usage(fs, &bytes, &objects);
    assert_int_equal(bytes, 0);
    assert_int_equal(objects, 0);
    s_check_disk(c, fs, 0, 0);

    char why[256] = "x";
    assert_int_equal(s_ops()->health(fs, why, sizeof why), 0);
    assert_string_equal(why, "");
    s_ops()->close(fs);
}

static void test_bad_names(void **state)
{
    ctx_t *c = *state;
    void *fs = s_open(c, NULL);
    char longest[201], too_long[202];
    memset(longest, 'n', 200);
    longest[200] = '\0';
    memset(too_long, 'n', 201);
    too_long[201] = '\0';
    const char *bad[] = {"", ".hidden", "a/b", "..", "with space", "tab\there", too_long};
    uint8_t *buf = s_alloc(PG);
    memset(buf, 1, PG);
    size_t len;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(s_ops()->store(fs, bad[i], buf, 10), KVT_EINVAL);
        assert_int_equal(s_ops()->lookup(fs, bad[i], &len), KVT_EINVAL);
        assert_int_equal(s_ops()->load(fs, bad[i], buf, PG, &len), KVT_EINVAL);
        assert_int_equal(s_ops()->remove(fs, bad[i]), KVT_EINVAL);
    }
    assert_int_equal(s_ops()->store(fs, longest, buf, 10), 0);
    assert_int_equal(s_ops()->lookup(fs, longest, &len), 0);
    assert_int_equal(len, 10);
    free(buf);
    s_check_disk(c, fs, 0, 0);
    s_ops()->close(fs);
}

/* ---- the index at open --------------------------------------------------------------------- */

/* Stores n objects of sizes from 1 byte to 70,000 (names[i] from s_name(i), seed i). */
static void s_store_many(void *fs, char names[][KVT_L2_NAME_LEN], size_t *sizes, unsigned n)
{
    for (unsigned i = 0; i < n; i++) {
        s_name(i, names[i]);
        sizes[i] = 1 + (size_t)i * 3001 % 70000;
        s_store_seed(fs, names[i], sizes[i], i);
    }
}

static void test_reopen_rebuilds_index(void **state)
{
    ctx_t *c = *state;
    void *fs = s_open(c, NULL);
    enum { N = 40 };
    char names[N][KVT_L2_NAME_LEN];
    size_t sizes[N];
    s_store_many(fs, names, sizes, N);
    assert_int_equal(s_ops()->remove(fs, names[3]), 0);
    uint64_t bytes, objects;
    s_usage(fs, &bytes, &objects);
    s_ops()->close(fs);

    /* foreign files: in the root, in a non-fan-out directory, hidden, and a valid-looking
     * name in the wrong fan-out directory; none is counted, none is touched */
    char p[600], q[600];
    snprintf(p, sizeof p, "%s/README", c->dir);
    s_write_file(p, "hello");
    snprintf(p, sizeof p, "%s/zz", c->dir);
    assert_int_equal(mkdir(p, 0700), 0);
    snprintf(p, sizeof p, "%s/zz/notes", c->dir);
    s_write_file(p, "12345678");
    s_obj_path(c, names[0], q, sizeof q);
    snprintf(p, sizeof p, "%.*s/.hidden", (int)(strrchr(q, '/') - q), q);
    s_write_file(p, "abc");
    unsigned fan = (unsigned)(XXH3_64bits("stray", 5) & 0xff);
    snprintf(p, sizeof p, "%s/%02x", c->dir, (fan + 1) & 0xff);
    mkdir(p, 0700);
    snprintf(p, sizeof p, "%s/%02x/stray", c->dir, (fan + 1) & 0xff);
    s_write_file(p, "stray!");
    const uint64_t foreign_files = 4, foreign_bytes = 5 + 8 + 3 + 6;

    fs = s_open(c, NULL);
    uint64_t bytes2, objects2;
    s_usage(fs, &bytes2, &objects2);
    assert_int_equal(bytes2, bytes);
    assert_int_equal(objects2, objects);
    assert_int_equal(objects2, N - 1);
    for (unsigned i = 0; i < N; i++) {
        size_t len = 0;
        if (i == 3) {
            assert_int_equal(s_ops()->lookup(fs, names[i], &len), KVT_ENOTFOUND);
            continue;
        }
        assert_int_equal(s_ops()->lookup(fs, names[i], &len), 0);
        assert_int_equal(len, sizes[i]);
        s_check_seed(fs, names[i], sizes[i], i);
    }
    assert_int_equal(s_ops()->lookup(fs, "stray", NULL), KVT_ENOTFOUND);
    assert_int_equal(s_ops()->lookup(fs, "README", NULL), KVT_ENOTFOUND);
    s_check_disk(c, fs, foreign_files, foreign_bytes);
    s_ops()->close(fs);
}

static void test_leftover_temp_removed(void **state)
{
    ctx_t *c = *state;
    void *fs = s_open(c, NULL);
    char name[KVT_L2_NAME_LEN], kept[KVT_L2_NAME_LEN];
    s_name(1, name);
    s_name(2, kept);
    s_store_seed(fs, kept, 100, 5);
    s_ops()->close(fs);

    /* what a crash in the middle of two stores leaves */
    char p[600];
    snprintf(p, sizeof p, "%s/.tmp/%s.17", c->dir, name);
    s_write_file(p, "half of an object");
    snprintf(p, sizeof p, "%s/.tmp/%s.18", c->dir, kept);
    s_write_file(p, "half of a new version");
    assert_int_equal(s_count_tmp(c->dir), 2);

    fs = s_open(c, NULL);
    assert_int_equal(s_count_tmp(c->dir), 0);
    assert_int_equal(s_ops()->lookup(fs, name, NULL), KVT_ENOTFOUND);
    s_check_seed(fs, kept, 100, 5);
    uint64_t bytes, objects;
    s_usage(fs, &bytes, &objects);
    assert_int_equal(bytes, 100);
    assert_int_equal(objects, 1);
    s_check_disk(c, fs, 0, 0);
    s_ops()->close(fs);
}

/* ---- capacity ------------------------------------------------------------------------------ */

static bool s_present(void *fs, const char *name)
{
    return s_ops()->lookup(fs, name, NULL) == 0;
}

static void test_capacity_lru(void **state)
{
    ctx_t *c = *state;
    const size_t sz = 64 * KIB;
    void *fs = s_open(c, "capacity=192K");
    char n[5][KVT_L2_NAME_LEN];
    for (unsigned i = 0; i < 5; i++)
        s_name(i, n[i]);
    s_store_seed(fs, n[0], sz, 0);
    s_store_seed(fs, n[1], sz, 1);
    s_store_seed(fs, n[2], sz, 2);
    s_check_seed(fs, n[0], sz, 0);                        /* n0: the most recently used */
    assert_int_equal(s_ops()->lookup(fs, n[1], NULL), 0); /* a lookup does not touch */
    s_store_seed(fs, n[3], sz, 3);
    s_store_seed(fs, n[4], sz, 4);
    assert_true(s_present(fs, n[0]));
    assert_false(s_present(fs, n[1]));
    assert_false(s_present(fs, n[2]));
    assert_true(s_present(fs, n[3]));
    assert_true(s_present(fs, n[4]));
    uint64_t bytes, objects;
    s_usage(fs, &bytes, &objects);
    assert_int_equal(bytes, 3 * sz);
    assert_int_equal(objects, 3);
    s_check_disk(c, fs, 0, 0);

    /* overwriting an object with one of the same size at full capacity evicts nothing */
    s_store_seed(fs, n[3], sz, 33);
    assert_true(s_present(fs, n[0]) && s_present(fs, n[3]) && s_present(fs, n[4]));
    s_check_seed(fs, n[3], sz, 33);

    /* a double-size one makes room for itself: the two least recently used (n4, then n3) go,
     * n0, loaded last, stays */
    s_check_seed(fs, n[0], sz, 0);
    s_store_seed(fs, n[1], 2 * sz, 11);
    assert_false(s_present(fs, n[4]));
    assert_false(s_present(fs, n[3]));
    assert_true(s_present(fs, n[1]));
    assert_true(s_present(fs, n[0]));
    s_usage(fs, &bytes, &objects);
    assert_true(bytes <= 3 * sz);
    s_check_disk(c, fs, 0, 0);
    s_ops()->close(fs);
}

static void test_capacity_too_big(void **state)
{
    ctx_t *c = *state;
    void *fs = s_open(c, "capacity=64K");
    char a[KVT_L2_NAME_LEN], b[KVT_L2_NAME_LEN];
    s_name(1, a);
    s_name(2, b);
    s_store_seed(fs, a, 1000, 1);
    uint8_t *d = s_alloc(64 * KIB + 1);
    memset(d, 7, 64 * KIB + 1);
    assert_int_equal(s_ops()->store(fs, b, d, 64 * KIB + 1), KVT_ENOSPC);
    free(d);
    assert_int_equal(s_ops()->lookup(fs, b, NULL), KVT_ENOTFOUND);
    s_check_seed(fs, a, 1000, 1); /* a refused store evicts nothing */
    char why[256];
    assert_int_equal(s_ops()->health(fs, why, sizeof why), 0); /* not a disk failure */
    /* exactly the capacity fits */
    s_store_seed(fs, b, 64 * KIB, 2);
    assert_false(s_present(fs, a));
    s_check_seed(fs, b, 64 * KIB, 2);
    s_check_disk(c, fs, 0, 0);
    s_ops()->close(fs);
}

static void s_set_mtime(const ctx_t *c, const char *name, time_t t)
{
    char p[600];
    s_obj_path(c, name, p, sizeof p);
    struct timespec ts[2] = {{t, 0}, {t, 0}};
    assert_int_equal(utimensat(AT_FDCWD, p, ts, 0), 0);
}

/* After a restart the LRU order is the files' mtime order; a lowered capacity trims at open. */
static void test_capacity_reopen_order(void **state)
{
    ctx_t *c = *state;
    const size_t sz = 8 * KIB;
    void *fs = s_open(c, NULL);
    char n[4][KVT_L2_NAME_LEN];
    for (unsigned i = 0; i < 4; i++)
        s_name(i, n[i]);
    for (unsigned i = 0; i < 3; i++)
        s_store_seed(fs, n[i], sz, i);
    s_ops()->close(fs);
    time_t now = time(NULL);
    s_set_mtime(c, n[0], now - 10);
    s_set_mtime(c, n[1], now - 30); /* the oldest */
    s_set_mtime(c, n[2], now - 20);

    fs = s_open(c, "capacity=24K");
    s_store_seed(fs, n[3], sz, 3);
    assert_false(s_present(fs, n[1]));
    assert_true(s_present(fs, n[0]) && s_present(fs, n[2]) && s_present(fs, n[3]));
    s_ops()->close(fs);

    s_set_mtime(c, n[0], now - 10);
    s_set_mtime(c, n[2], now - 20);
    s_set_mtime(c, n[3], now - 5);
    fs = s_open(c, "capacity=16K");
    assert_false(s_present(fs, n[2]));
    assert_true(s_present(fs, n[0]) && s_present(fs, n[3]));
    uint64_t bytes, objects;
    s_usage(fs, &bytes, &objects);
    assert_int_equal(bytes, 2 * sz);
    assert_int_equal(objects, 2);
    s_check_disk(c, fs, 0, 0);
    s_ops()->close(fs);
}

/* ---- threads ------------------------------------------------------------------------------- */

enum { T_THREADS = 4, T_NAMES = 32, T_MAXLEN = 300000 };

typedef struct {
    void *fs;
    const char (*names)[KVT_L2_NAME_LEN];
    uint64_t seed;
    uint64_t deadline_ms;
    uint64_t stores, loads, hits, removes;
    int failures;
    char msg[256];
} worker_t;

static uint64_t s_rand(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

/* Self-describing payload: [seed:8][len:8] then s_fill(seed), so any load can be checked. */
static void s_payload(uint8_t *p, size_t len, uint64_t seed)
{
    memcpy(p, &seed, 8);
    uint64_t l = len;
    memcpy(p + 8, &l, 8);
    s_fill(p + 16, len - 16, seed);
}

static void s_fail(worker_t *w, const char *what, const char *name, int rc)
{
    if (!w->failures++)
        snprintf(w->msg, sizeof w->msg, "%s %s: %s", what, name, kvt_err_name(rc));
}

static void *s_worker(void *arg)
{
    worker_t *w = arg;
    const size_t cap = s_round(T_MAXLEN);
    uint8_t *out = aligned_alloc(PG, cap), *in = aligned_alloc(PG, cap), *chk = malloc(cap);
    if (!out || !in || !chk) {
        w->failures++;
        snprintf(w->msg, sizeof w->msg, "out of memory");
        goto done;
    }
    while (kvt_now_ms() < w->deadline_ms && !w->failures) {
        const char *name = w->names[s_rand(&w->seed) % T_NAMES];
        unsigned op = (unsigned)(s_rand(&w->seed) % 10);
        size_t len = 0;
        int rc;
        if (op < 4) {
            size_t l = 16 + s_rand(&w->seed) % (T_MAXLEN - 16);
            s_payload(out, l, s_rand(&w->seed));
            rc = s_ops()->store(w->fs, name, out, l);
            if (rc != 0)
                s_fail(w, "store", name, rc);
            w->stores++;
        } else if (op < 8) {
            rc = s_ops()->load(w->fs, name, in, cap, &len);
            w->loads++;
            if (rc == KVT_ENOTFOUND)
                continue;
            if (rc != 0) {
                s_fail(w, "load", name, rc);
                continue;
            }
            w->hits++;
            uint64_t seed, l;
            memcpy(&seed, in, 8);
            memcpy(&l, in + 8, 8);
            if (len < 16 || l != len) {
                s_fail(w, "load (torn length)", name, 0);
                continue;
            }
            s_payload(chk, len, seed);
            if (memcmp(in, chk, len) != 0)
                s_fail(w, "load (bad bytes)", name, 0);
        } else if (op == 8) {
            rc = s_ops()->lookup(w->fs, name, &len);
            if (rc != 0 && rc != KVT_ENOTFOUND)
                s_fail(w, "lookup", name, rc);
            if (rc == 0 && (len < 16 || len > T_MAXLEN))
                s_fail(w, "lookup (bad size)", name, 0);
        } else {
            rc = s_ops()->remove(w->fs, name);
            if (rc != 0 && rc != KVT_ENOTFOUND)
                s_fail(w, "remove", name, rc);
            w->removes++;
        }
    }
done:
    free(out);
    free(in);
    free(chk);
    return NULL;
}

static void s_run_threads(ctx_t *c, const char *opts, uint64_t capacity)
{
    void *fs = s_open(c, opts);
    char names[T_NAMES][KVT_L2_NAME_LEN];
    for (unsigned i = 0; i < T_NAMES; i++)
        s_name(i, names[i]);
    worker_t w[T_THREADS];
    pthread_t th[T_THREADS];
    uint64_t deadline = kvt_now_ms() + 1200;
    for (int i = 0; i < T_THREADS; i++) {
        w[i] = (worker_t){.fs = fs,
                          .names = (const char(*)[KVT_L2_NAME_LEN])names,
                          .seed = 0x1234567ull * (uint64_t)(i + 1),
                          .deadline_ms = deadline};
        assert_int_equal(pthread_create(&th[i], NULL, s_worker, &w[i]), 0);
    }
    uint64_t stores = 0, hits = 0;
    for (int i = 0; i < T_THREADS; i++) {
        pthread_join(th[i], NULL);
        if (w[i].failures)
            fail_msg("thread %d: %d failures, first: %s", i, w[i].failures, w[i].msg);
        stores += w[i].stores;
        hits += w[i].hits;
    }
    print_message("%s: %llu stores, %llu load hits\n", opts ? opts : "unlimited",
                  (unsigned long long)stores, (unsigned long long)hits);
    assert_true(stores > 0);

    /* quiescent: every name's lookup, the usage and the disk agree */
    uint64_t bytes, objects, sum = 0, count = 0;
    s_usage(fs, &bytes, &objects);
    for (unsigned i = 0; i < T_NAMES; i++) {
        size_t len;
        if (s_ops()->lookup(fs, names[i], &len) == 0) {
            sum += len;
            count++;
        }
    }
    assert_int_equal(sum, bytes);
    assert_int_equal(count, objects);
    if (capacity)
        assert_true(bytes <= capacity);
    s_check_disk(c, fs, 0, 0);
    /* the disk itself (segments: dead records, tombstones and index files too) stays within the
     * capacity however many stores ran at once; else the reopen below trims it */
    if (capacity && c->segments)
        assert_true(s_du_seg_bytes <= capacity);
    char why[256];
    assert_int_equal(s_ops()->health(fs, why, sizeof why), 0);
    s_ops()->close(fs);

    fs = s_open(c, opts);
    uint64_t bytes2, objects2;
    s_usage(fs, &bytes2, &objects2);
    assert_int_equal(bytes2, bytes);
    assert_int_equal(objects2, objects);
    s_ops()->close(fs);
}

static void test_threads_capacity(void **state)
{
    s_run_threads(*state, "capacity=2M", 2 * MIB);
}

/* ---- O_DIRECT ------------------------------------------------------------------------------ */

static void s_round_trip_some(void *fs)
{
    static const size_t sizes[] = {1, 4095, 4096, 4097, 3 * MIB};
    char name[KVT_L2_NAME_LEN];
    for (unsigned i = 0; i < 5; i++) {
        s_name(i, name);
        s_store_seed(fs, name, sizes[i], i + 7);
        s_check_seed(fs, name, sizes[i], i + 7);
    }
}

/* tmpfs: before Linux 6.6 it refuses O_DIRECT (direct=on must then fail cleanly at open);
 * later kernels accept it. direct=auto works either way. */
static void test_direct_tmpfs(void **state)
{
    ctx_t *c = *state;
    ctx_t shm;
    if (s_mkdtemp(&shm, "/dev/shm") != 0)
        skip();
    char err[256] = "";
    void *fs = NULL;
    int rc = s_ops()->open(s_spec(c, shm.dir, "direct=on"), &fs, err, sizeof err);
    if (rc == 0) {
        print_message("tmpfs accepts O_DIRECT on this kernel\n");
        s_round_trip_some(fs);
        s_ops()->close(fs);
    } else {
        assert_int_equal(rc, KVT_EINVAL);
        assert_null(fs);
        assert_non_null(strstr(err, "O_DIRECT"));
    }
    rc = s_ops()->open(s_spec(c, shm.dir, "direct=auto"), &fs, err, sizeof err);
    assert_int_equal(rc, 0);
    s_round_trip_some(fs);
    s_ops()->close(fs);
    s_rmrf(shm.dir);
}

/* A filesystem that refuses O_DIRECT (injected): on -> KVT_EINVAL, auto -> buffered. */
static void test_direct_refused(void **state)
{
    ctx_t *c = *state;
    atomic_store(&s_fault_open_direct, 1);
    char err[256] = "";
    void *fs = (void *)1;
    assert_int_equal(s_ops()->open(s_spec(c, c->dir, "direct=on"), &fs, err, sizeof err),
                     KVT_EINVAL);
    assert_null(fs);
    assert_non_null(strstr(err, "O_DIRECT"));
    assert_non_null(strstr(err, c->dir));

    fs = s_open(c, "direct=auto");
    s_round_trip_some(fs);
    s_check_disk(c, fs, 0, 0);
    s_ops()->close(fs);
    assert_int_equal(atomic_load(&s_direct_opens), 0);

    fs = s_open(c, "direct=off");
    atomic_store(&s_fault_open_direct, 0);
    s_round_trip_some(fs);
    assert_int_equal(atomic_load(&s_direct_opens), 0); /* off means off */
    s_ops()->close(fs);
}

/* A disk directory: direct=on uses O_DIRECT for stores and aligned loads. */
static void test_direct_disk(void **state)
{
    ctx_t *c = *state;
    char err[256] = "";
    void *fs = NULL;
    int rc = s_ops()->open(s_spec(c, c->dir, "direct=on"), &fs, err, sizeof err);
    if (rc == KVT_EINVAL && strstr(err, "O_DIRECT")) {
        print_message("%s refuses O_DIRECT: %s\n", c->dir, err);
        skip();
    }
    assert_int_equal(rc, 0);
    atomic_store(&s_direct_opens, 0);
    s_round_trip_some(fs);
    if (c->segments) /* segment files are opened once each, with O_DIRECT */
        assert_true(atomic_load(&s_direct_opens) >= 1);
    else
        assert_int_equal(atomic_load(&s_direct_opens), 10); /* 5 stores + 5 loads */

    /* an unaligned load buffer is read without O_DIRECT */
    char name[KVT_L2_NAME_LEN];
    s_name(3, name);
    uint8_t *raw = malloc(2 * PG + 1);
    size_t got = 0;
    atomic_store(&s_direct_opens, 0);
    assert_int_equal(s_ops()->load(fs, name, raw + 1, 2 * PG, &got), 0);
    assert_int_equal(got, 4097);
    assert_int_equal(atomic_load(&s_direct_opens), 0);
    uint8_t *want = s_alloc(4097);
    s_fill(want, 4097, 3 + 7);
    assert_memory_equal(raw + 1, want, 4097);
    free(want);
    free(raw);
    s_check_disk(c, fs, 0, 0);
    s_ops()->close(fs);

    fs = s_open(c, "direct=auto");
    s_round_trip_some(fs);
    s_ops()->close(fs);
}

/* direct=auto: the first write refused with EINVAL switches to buffered I/O for good. */
static void test_direct_write_fallback(void **state)
{
    ctx_t *c = *state;
    void *fs = s_open(c, "direct=auto");
    if (atomic_load(&s_direct_opens) == 0) { /* the probe already said no */
        s_ops()->close(fs);
        skip();
    }
    atomic_store(&s_fault_write_direct, 1);
    char name[KVT_L2_NAME_LEN];
    s_name(1, name);
    s_store_seed(fs, name, 4097, 1);
    atomic_store(&s_fault_write_direct, 0);
    atomic_store(&s_direct_opens, 0);
    s_store_seed(fs, name, 3 * MIB, 2);
    s_check_seed(fs, name, 3 * MIB, 2);
    assert_int_equal(atomic_load(&s_direct_opens), 0);
    s_check_disk(c, fs, 0, 0);

    /* direct=on does not fall back: the store fails cleanly */
    s_ops()->close(fs);
    fs = s_open(c, "direct=on");
    atomic_store(&s_fault_write_direct, 1);
    uint8_t *d = s_alloc(PG);
    memset(d, 1, PG);
    assert_int_equal(s_ops()->store(fs, name, d, PG), KVT_EIO);
    free(d);
    atomic_store(&s_fault_write_direct, 0);
    s_check_seed(fs, name, 3 * MIB, 2); /* the old object is intact */
    s_check_disk(c, fs, 0, 0);
    s_ops()->close(fs);
}

/* ---- errors -------------------------------------------------------------------------------- */

static void test_disk_errors(void **state)
{
    ctx_t *c = *state;
    void *fs = s_open(c, NULL);
    char a[KVT_L2_NAME_LEN], b[KVT_L2_NAME_LEN];
    s_name(1, a);
    s_name(2, b);
    s_store_seed(fs, a, 5000, 1);
    uint8_t *d = s_alloc(3 * MIB);
    s_fill(d, 3 * MIB, 9);
    char why[256];

    atomic_store(&s_fault_write_errno, ENOSPC);
    assert_int_equal(s_ops()->store(fs, b, d, 3 * MIB), KVT_ENOSPC);
    assert_int_equal(s_ops()->store(fs, a, d, 3 * MIB), KVT_ENOSPC);
    atomic_store(&s_fault_write_errno, 0);
    assert_int_equal(s_ops()->lookup(fs, b, NULL), KVT_ENOTFOUND);
    s_check_seed(fs, a, 5000, 1); /* a failed overwrite keeps the old object */
    s_check_disk(c, fs, 0, 0);    /* no partial file, no temp file */
    assert_int_equal(s_ops()->health(fs, why, sizeof why), KVT_EIO);
    assert_non_null(strstr(why, "last write failed: No space left on device"));
    assert_non_null(strstr(why, c->dir));

    atomic_store(&s_fault_write_errno, EDQUOT);
    assert_int_equal(s_ops()->store(fs, b, d, 100), KVT_ENOSPC);
    atomic_store(&s_fault_write_errno, EIO);
    assert_int_equal(s_ops()->store(fs, b, d, 100), KVT_EIO);
    atomic_store(&s_fault_write_errno, 0);
    /* sync=object: a store whose fdatasync fails is not stored */
    s_ops()->close(fs);
    fs = s_open(c, "sync=object");
    atomic_store(&s_fault_sync_errno, EIO);
    assert_int_equal(s_ops()->store(fs, b, d, 100), KVT_EIO);
    assert_int_equal(s_ops()->health(fs, why, sizeof why), KVT_EIO);
    assert_non_null(strstr(why, "last write failed: Input/output error"));
    atomic_store(&s_fault_sync_errno, 0);
    assert_int_equal(s_ops()->lookup(fs, b, NULL), KVT_ENOTFOUND);
    s_check_disk(c, fs, 0, 0);

    /* a good store clears the failure */
    assert_int_equal(s_ops()->store(fs, b, d, 100), 0);
    assert_int_equal(s_ops()->health(fs, why, sizeof why), 0);
    free(d);

    if (c->segments) {
        s_ops()->close(fs);
        return;
    }
    /* an object deleted behind the adapter's back is forgotten at the first load */
    char p[600];
    s_obj_path(c, a, p, sizeof p);
    assert_int_equal(unlink(p), 0);
    uint8_t *buf = s_alloc(2 * PG);
    size_t got;
    assert_int_equal(s_ops()->load(fs, a, buf, 2 * PG, &got), KVT_ENOTFOUND);
    free(buf);
    assert_int_equal(s_ops()->lookup(fs, a, NULL), KVT_ENOTFOUND);
    s_check_disk(c, fs, 0, 0);
    s_ops()->close(fs);
}

/* Root ignores permissions, so an unwritable directory is simulated by removing it. */
/* What each sync mode syncs, and when: object per store (fdatasync), batch once per flush
 * (syncfs, none when nothing was stored since), none never. A failed syncfs fails the flush
 * and turns health red; the objects stay readable (their bytes are in the page cache). */
static void test_sync_modes(void **state)
{
    ctx_t *c = *state;
    static const struct {
        const char *opts;
        int fdatasyncs, syncfs_first, syncfs_again;
    } modes[] = {
        {"sync=object", 3, 0, 0}, {NULL, 0, 1, 0}, {"sync=batch", 0, 1, 0}, {"sync=none", 0, 0, 0}};
    uint8_t *d = s_alloc(64 * 1024);
    for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++) {
        void *fs = s_open(c, modes[m].opts);
        atomic_store(&s_fdatasyncs, 0);
        atomic_store(&s_syncfses, 0);
        for (unsigned i = 0; i < 3; i++) {
            char name[KVT_L2_NAME_LEN];
            s_name(100 * (unsigned)m + i, name);
            s_fill(d, 64 * 1024, i);
            assert_int_equal(s_ops()->store(fs, name, d, 64 * 1024), 0);
        }
        /* segments: the record, then its index entry */
        assert_int_equal(atomic_load(&s_fdatasyncs), modes[m].fdatasyncs * (c->segments ? 2 : 1));
        assert_int_equal(atomic_load(&s_syncfses), 0);
        assert_int_equal(s_ops()->flush(fs), 0);
        assert_int_equal(atomic_load(&s_syncfses), modes[m].syncfs_first);
        assert_int_equal(s_ops()->flush(fs), 0);
        assert_int_equal(atomic_load(&s_syncfses), modes[m].syncfs_first + modes[m].syncfs_again);
        for (unsigned i = 0; i < 3; i++) {
            char name[KVT_L2_NAME_LEN];
            s_name(100 * (unsigned)m + i, name);
            s_check_seed(fs, name, 64 * 1024, i);
        }
        s_ops()->close(fs);
    }

    /* batch: the store succeeds, its flush fails and says so */
    void *fs = s_open(c, "sync=batch");
    char name[KVT_L2_NAME_LEN], why[256];
    s_name(999, name);
    s_fill(d, 64 * 1024, 7);
    atomic_store(&s_fault_sync_errno, EIO);
    assert_int_equal(s_ops()->store(fs, name, d, 64 * 1024), 0);
    assert_int_equal(s_ops()->flush(fs), KVT_EIO);
    assert_int_equal(s_ops()->health(fs, why, sizeof why), KVT_EIO);
    assert_non_null(strstr(why, "last write failed: Input/output error"));
    atomic_store(&s_fault_sync_errno, 0);
    assert_int_equal(s_ops()->flush(fs), 0); /* not covered yet: synced now */
    s_check_seed(fs, name, 64 * 1024, 7);
    s_ops()->close(fs);
    free(d);
}

static void test_health_removed_dir(void **state)
{
    ctx_t *c = *state;
    void *fs = s_open(c, NULL);
    char a[KVT_L2_NAME_LEN];
    s_name(1, a);
    s_store_seed(fs, a, 100, 1);
    char why[256] = "x";
    assert_int_equal(s_ops()->health(fs, why, sizeof why), 0);
    assert_string_equal(why, "");

    s_rmrf(c->dir);
    assert_int_equal(s_ops()->health(fs, why, sizeof why), KVT_EIO);
    assert_non_null(strstr(why, c->dir));
    assert_non_null(strstr(why, "fs:"));
    print_message("health: %s\n", why);
    uint8_t *d = s_alloc(PG);
    memset(d, 1, PG);
    assert_int_equal(s_ops()->store(fs, a, d, 100), KVT_EIO);
    size_t got;
    /* files: the object's file went with the directory; segments: the open segment still
     * holds the bytes stored before */
    assert_int_equal(s_ops()->load(fs, a, d, PG, &got), c->segments ? 0 : KVT_ENOTFOUND);
    free(d);

    /* a new directory at the same path is not the one the index describes */
    assert_int_equal(mkdir(c->dir, 0700), 0);
    assert_int_equal(s_ops()->health(fs, why, sizeof why), KVT_EIO);
    assert_non_null(strstr(why, "replaced"));
    s_ops()->close(fs);
}

static void test_bad_args(void **state)
{
    ctx_t *c = *state;
    char bad[12][300];
    snprintf(bad[0], sizeof bad[0], "%s", "");
    snprintf(bad[1], sizeof bad[1], "%s", ",capacity=1G");
    snprintf(bad[2], sizeof bad[2], "%s,capacity=xyz", c->dir);
    snprintf(bad[3], sizeof bad[3], "%s,capacity=", c->dir);
    snprintf(bad[4], sizeof bad[4], "%s,bogus=1", c->dir);
    snprintf(bad[5], sizeof bad[5], "%s,direct=maybe", c->dir);
    snprintf(bad[6], sizeof bad[6], "%s,capacity", c->dir);
    snprintf(bad[7], sizeof bad[7], "%s/file/sub", c->dir); /* under a regular file */
    snprintf(bad[8], sizeof bad[8], "%s,sync=always", c->dir);
    snprintf(bad[9], sizeof bad[9], "%s,layout=sideways", c->dir);
    snprintf(bad[10], sizeof bad[10], "%s,segment_size=4K", c->dir);
    snprintf(bad[11], sizeof bad[11], "%s,segment_size=big", c->dir);
    char p[600];
    snprintf(p, sizeof p, "%s/file", c->dir);
    s_write_file(p, "x");
    for (int i = 0; i < 12; i++) {
        char err[256] = "";
        void *fs = (void *)1;
        int rc = s_ops()->open(bad[i], &fs, err, sizeof err);
        if (rc != KVT_EINVAL)
            fail_msg("'%s': %s (%s)", bad[i], kvt_err_name(rc), err);
        assert_null(fs);
        assert_true(strlen(err) > 0);
        print_message("'%s' -> %s\n", bad[i], err);
    }
    char err[256] = "";
    void *fs = NULL;
    assert_int_equal(s_ops()->open(NULL, &fs, err, sizeof err), KVT_EINVAL);

    /* valid options; a missing directory is created with its parents */
    char deep[400];
    snprintf(deep, sizeof deep, "%s/a/b/c", c->dir);
    snprintf(p, sizeof p, "%s,capacity=10G,direct=off", deep);
    assert_int_equal(s_ops()->open(p, &fs, err, sizeof err), 0);
    struct stat st;
    assert_int_equal(stat(deep, &st), 0);
    assert_true(S_ISDIR(st.st_mode));
    assert_int_equal(st.st_mode & 0777, 0700);

    /* one directory, one adapter: a second open is refused while the first holds it */
    void *fs2 = (void *)1;
    assert_int_equal(s_ops()->open(deep, &fs2, err, sizeof err), KVT_EBUSY);
    assert_null(fs2);
    assert_non_null(strstr(err, "in use"));
    s_ops()->close(fs);
    assert_int_equal(s_ops()->open(deep, &fs2, err, sizeof err), 0);
    s_ops()->close(fs2);
    s_ops()->close(NULL);
}

/* storev of payload + trailer, then loadv of the same shape: every size around the page edges,
 * with O_DIRECT (the aligned body straight from and to the buffer, the rest through bounce
 * pages) and without (pwritev / preadv). */
static void s_vectored_round_trips(void *fs)
{
    static const size_t sizes[] = {1,      100,          PG - 40,  PG - 1, PG,
                                   PG + 1, 2 * PG + 123, MIB - 40, MIB,    MIB + 7};
    uint8_t trailer[40], tback[40];
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t len = sizes[i], got = 0;
        char name[KVT_L2_NAME_LEN];
        s_name(100 + (unsigned)i, name);
        uint8_t *d = s_alloc(len), *back = s_alloc(len);
        s_fill(d, len, i + 1);
        s_fill(trailer, sizeof trailer, 1000 + i);
        struct iovec in[2] = {{d, len}, {trailer, sizeof trailer}};
        assert_int_equal(s_ops()->storev(fs, name, in, 2), 0);
        size_t olen = 0;
        assert_int_equal(s_ops()->lookup(fs, name, &olen), 0);
        assert_int_equal(olen, len + sizeof trailer);
        memset(back, 0, len);
        memset(tback, 0, sizeof tback);
        struct iovec out[2] = {{back, len}, {tback, sizeof tback}};
        assert_int_equal(s_ops()->loadv(fs, name, out, 2, &got), 0);
        assert_int_equal(got, len + sizeof trailer);
        assert_memory_equal(back, d, len);
        assert_memory_equal(tback, trailer, sizeof trailer);
        /* one byte short: the object does not fit */
        out[1].iov_len = sizeof tback - 1;
        assert_int_equal(s_ops()->loadv(fs, name, out, 2, &got), KVT_ENOSPC);
        assert_int_equal(got, len + sizeof trailer);
        /* plain load of the whole object into one page-rounded buffer */
        size_t cap = s_round(len + sizeof trailer);
        uint8_t *whole = s_alloc(cap);
        assert_int_equal(s_ops()->load(fs, name, whole, cap, &got), 0);
        assert_int_equal(got, len + sizeof trailer);
        assert_memory_equal(whole, d, len);
        assert_memory_equal(whole + len, trailer, sizeof trailer);
        free(whole);
        free(d);
        free(back);
    }
}

static void test_vectored(void **state)
{
    ctx_t *c = *state;
    void *fs = s_open(c, "direct=off");
    s_vectored_round_trips(fs);
    s_check_disk(c, fs, 0, 0);
    /* a larger buffer than the object: the first *len bytes are filled */
    char name[KVT_L2_NAME_LEN];
    s_name(100, name); /* 1 byte + 40 */
    uint8_t big[64], tail[64];
    memset(big, 0xee, sizeof big);
    struct iovec out[2] = {{big, 30}, {tail, sizeof tail}};
    size_t got = 0;
    assert_int_equal(s_ops()->loadv(fs, name, out, 2, &got), 0);
    assert_int_equal(got, 41);
    /* a failed vectored write leaves nothing behind */
    uint8_t d[5000];
    s_fill(d, sizeof d, 7);
    struct iovec in[3] = {{d, 100}, {d + 100, 4000}, {d + 4100, 900}};
    s_name(200, name);
    atomic_store(&s_fault_write_errno, ENOSPC);
    assert_int_equal(s_ops()->storev(fs, name, in, 3), KVT_ENOSPC);
    atomic_store(&s_fault_write_errno, 0);
    assert_int_equal(s_ops()->lookup(fs, name, NULL), KVT_ENOTFOUND);
    assert_int_equal(s_ops()->storev(fs, name, in, 3), 0);
    s_check_seed(fs, name, sizeof d, 7);
    /* bad arguments */
    assert_int_equal(s_ops()->storev(fs, name, in, 0), KVT_EINVAL);
    assert_int_equal(s_ops()->storev(fs, name, in, KVT_L2_IOV_MAX + 1), KVT_EINVAL);
    assert_int_equal(s_ops()->loadv(fs, name, out, 0, &got), KVT_EINVAL);
    s_ops()->close(fs);

    /* the same with O_DIRECT where the filesystem allows it */
    atomic_store(&s_direct_opens, 0);
    fs = s_open(c, NULL);
    s_vectored_round_trips(fs);
    s_check_disk(c, fs, 0, 0);
    print_message("vectored: %d O_DIRECT opens\n", atomic_load(&s_direct_opens));
    s_ops()->close(fs);
}

/* ---- layout=segments ---------------------------------------------------------------------- */

static int s_seg_files(const ctx_t *c, char names[][32], int max)
{
    char p[400];
    snprintf(p, sizeof p, "%s/seg", c->dir);
    DIR *d = opendir(p);
    if (!d)
        return 0;
    int n = 0;
    for (struct dirent *de; (de = readdir(d));)
        if (strlen(de->d_name) == 16 && n < max) /* segments, not their .idx files */
            snprintf(names[n++], 32, "%.31s", de->d_name);
    closedir(d);
    return n;
}

/* Objects, replacements and removals come back from the segments at open, in write order;
 * segments left with nothing live are deleted. */
static void test_seg_reopen(void **state)
{
    ctx_t *c = *state;
    void *fs = s_open(c, NULL);
    enum { N = 40 };
    char names[N][KVT_L2_NAME_LEN];
    size_t sizes[N];
    s_store_many(fs, names, sizes, N);
    assert_int_equal(s_ops()->remove(fs, names[3]), 0);
    assert_int_equal(s_ops()->remove(fs, names[3]), KVT_ENOTFOUND);
    sizes[5] = 12345;
    s_store_seed(fs, names[5], sizes[5], 555); /* replaced: the later record wins */
    assert_int_equal(s_ops()->remove(fs, names[7]), 0);
    s_store_seed(fs, names[7], 77, 777); /* removed, then stored again */
    sizes[7] = 77;
    uint64_t bytes, objects;
    s_usage(fs, &bytes, &objects);
    assert_int_equal(objects, N - 1);
    s_check_disk(c, fs, 0, 0);
    s_ops()->close(fs);

    fs = s_open(c, NULL);
    uint64_t bytes2, objects2;
    s_usage(fs, &bytes2, &objects2);
    assert_int_equal(bytes2, bytes);
    assert_int_equal(objects2, objects);
    for (unsigned i = 0; i < N; i++) {
        size_t len = 0;
        if (i == 3) {
            assert_int_equal(s_ops()->lookup(fs, names[i], &len), KVT_ENOTFOUND);
            continue;
        }
        assert_int_equal(s_ops()->lookup(fs, names[i], &len), 0);
        assert_int_equal(len, sizes[i]);
        s_check_seed(fs, names[i], sizes[i], i == 5 ? 555 : i == 7 ? 777 : i);
    }
    char p[600];
    snprintf(p, sizeof p, "%s/%02x", c->dir,
             (unsigned)(XXH3_64bits(names[0], strlen(names[0])) & 0xff));
    struct stat st;
    assert_int_not_equal(stat(p, &st), 0); /* no file of the files layout */
    s_check_disk(c, fs, 0, 0);

    /* everything removed: after a reopen no segment is left */
    for (unsigned i = 0; i < N; i++)
        if (i != 3)
            assert_int_equal(s_ops()->remove(fs, names[i]), 0);
    s_usage(fs, &bytes, &objects);
    assert_int_equal(bytes, 0);
    assert_int_equal(objects, 0);
    s_ops()->close(fs);
    fs = s_open(c, NULL);
    s_usage(fs, &bytes, &objects);
    assert_int_equal(objects, 0);
    char segs[64][32];
    assert_int_equal(s_seg_files(c, segs, 64), 0);
    s_ops()->close(fs);
}

/* What a crash leaves at the end of a segment — a record cut short, pages of garbage, a segment
 * whose header never made it, an index file lost — is skipped at open: the rest loads
 * byte-exact, nothing else appears. */
static void s_seg_expect(ctx_t *c, char names[][KVT_L2_NAME_LEN], unsigned n, unsigned want)
{
    void *fs = s_open(c, NULL);
    uint64_t bytes, objects;
    s_usage(fs, &bytes, &objects);
    assert_int_equal(objects, want);
    unsigned present = 0;
    for (unsigned i = 0; i < n; i++) {
        size_t len = 0;
        int rc = s_ops()->lookup(fs, names[i], &len);
        if (rc == KVT_ENOTFOUND)
            continue;
        assert_int_equal(rc, 0);
        s_check_seed(fs, names[i], 5000 + i * 1000, i);
        present++;
    }
    assert_int_equal(present, want);
    s_ops()->close(fs);
}

static void test_seg_torn_tail(void **state)
{
    ctx_t *c = *state;
    void *fs = s_open(c, NULL);
    enum { N = 24 };
    char names[N][KVT_L2_NAME_LEN];
    for (unsigned i = 0; i < N; i++) {
        s_name(i, names[i]);
        s_store_seed(fs, names[i], 5000 + i * 1000, i);
    }
    s_ops()->close(fs);
    char segs[64][32], p[700];
    int nseg = s_seg_files(c, segs, 64);
    assert_true(nseg >= 1);
    /* the last record of each segment loses its last page (its footer): its index entry points
     * past the end of the file and is left out */
    for (int i = 0; i < nseg; i++) {
        snprintf(p, sizeof p, "%.255s/seg/%.31s", c->dir, segs[i]);
        struct stat st;
        assert_int_equal(stat(p, &st), 0);
        assert_int_equal(truncate(p, st.st_size - PG), 0);
    }
    snprintf(p, sizeof p, "%s/seg/00000000000000ff", c->dir);
    s_write_file(p, "a header a crash cut short");
    s_seg_expect(c, names, N, N - (unsigned)nseg);
    assert_int_not_equal(access(p, F_OK), 0); /* the headless segment is gone */

    /* an index file damaged in its middle (what follows cannot be trusted to be complete): the
     * segment's footers are read instead, and say the same */
    snprintf(p, sizeof p, "%.255s/seg/%.31s.idx", c->dir, segs[0]);
    struct stat ist;
    assert_int_equal(stat(p, &ist), 0);
    FILE *fi = fopen(p, "r+");
    assert_non_null(fi);
    assert_int_equal(fseek(fi, (long)ist.st_size / 2, SEEK_SET), 0);
    int ch = fgetc(fi);
    assert_int_equal(fseek(fi, (long)ist.st_size / 2, SEEK_SET), 0);
    fputc(ch ^ 0x40, fi);
    fclose(fi);
    s_seg_expect(c, names, N, N - (unsigned)nseg);

    /* no index files: the footers, read from the end of each segment, say the same, past
     * pages of garbage */
    uint8_t junk[3 * PG];
    s_fill(junk, sizeof junk, 99);
    for (int i = 0; i < nseg; i++) {
        snprintf(p, sizeof p, "%.255s/seg/%.31s.idx", c->dir, segs[i]);
        assert_int_equal(unlink(p), 0);
        snprintf(p, sizeof p, "%.255s/seg/%.31s", c->dir, segs[i]);
        FILE *f = fopen(p, "a");
        assert_non_null(f);
        assert_int_equal(fwrite(junk, 1, sizeof junk, f), sizeof junk);
        fclose(f);
    }
    s_seg_expect(c, names, N, N - (unsigned)nseg);

    /* appends go on in new segments; the old ones still serve */
    fs = s_open(c, NULL);
    char extra[KVT_L2_NAME_LEN];
    s_name(1000, extra);
    s_store_seed(fs, extra, 3000, 1000);
    s_ops()->close(fs);
    fs = s_open(c, NULL);
    s_check_seed(fs, extra, 3000, 1000);
    uint64_t bytes, objects;
    s_usage(fs, &bytes, &objects);
    assert_int_equal(objects, N - nseg + 1);
    s_ops()->close(fs);
}

/* capacity bounds the segment files: the oldest segments go, with what they hold, but for the
 * objects loaded since they were written (moved on: a second chance); the newest objects stay,
 * every object still indexed loads byte-exact, and a reopen agrees. */
static void test_seg_capacity(void **state)
{
    ctx_t *c = *state;
    const uint64_t cap = 2 * MIB;
    void *fs = s_open(c, "capacity=2M");
    enum { N = 200 };
    char names[N][KVT_L2_NAME_LEN];
    for (unsigned i = 0; i < N; i++) {
        s_name(i, names[i]);
        s_store_seed(fs, names[i], 24 * KIB, i);
        if (i >= 2 && i % 4 == 0) /* names[0] is read now and then, names[1] never */
            s_check_seed(fs, names[0], 24 * KIB, 0);
        uint64_t files, dbytes;
        s_du(c->dir, &files, &dbytes);
        if (s_du_seg_bytes > cap)
            fail_msg("store %u: %llu segment bytes over %llu", i,
                     (unsigned long long)s_du_seg_bytes, (unsigned long long)cap);
    }
    uint64_t bytes, objects;
    s_usage(fs, &bytes, &objects);
    print_message("segments: %llu objects (%llu bytes) of %d kept in %llu segment bytes\n",
                  (unsigned long long)objects, (unsigned long long)bytes, N,
                  (unsigned long long)s_du_seg_bytes);
    assert_true(objects < N);
    assert_true(bytes >= cap / 2); /* the bound is used, not wasted */
    assert_true(s_present(fs, names[N - 1]));
    assert_true(s_present(fs, names[0]));  /* as old, but in use */
    assert_false(s_present(fs, names[1])); /* as old, never read */
    assert_false(s_present(fs, names[2]));
    unsigned kept = 0;
    for (unsigned i = 0; i < N; i++)
        if (s_present(fs, names[i])) {
            s_check_seed(fs, names[i], 24 * KIB, i);
            kept++;
        }
    assert_int_equal(kept, objects);
    s_check_disk(c, fs, 0, 0);
    s_ops()->close(fs);

    /* a lower capacity at open reclaims down to it */
    fs = s_open(c, "capacity=1M");
    uint64_t files, dbytes;
    s_du(c->dir, &files, &dbytes);
    assert_true(s_du_seg_bytes <= MIB);
    uint64_t bytes2, objects2;
    s_usage(fs, &bytes2, &objects2);
    assert_true(objects2 < objects && objects2 > 0);
    assert_true(s_present(fs, names[N - 1]));
    s_ops()->close(fs);
}

/* Without a capacity, the dead space of replaced and removed objects goes too: at a flush the
 * oldest segment, while it or the whole log is mostly dead, has its live objects moved and is
 * deleted. */
static void test_seg_compact(void **state)
{
    ctx_t *c = *state;
    void *fs = s_open(c, "segment_size=1M");
    enum { N = 400 };
    char names[N][KVT_L2_NAME_LEN];
    for (unsigned i = 0; i < N; i++) {
        s_name(i, names[i]);
        s_store_seed(fs, names[i], 128 * KIB, i);
    }
    for (unsigned i = 0; i < N; i++)
        if (i % 10)
            assert_int_equal(s_ops()->remove(fs, names[i]), 0);
    uint64_t files, dbytes;
    s_du(c->dir, &files, &dbytes);
    uint64_t before = s_du_seg_bytes;
    for (int i = 0; i < 64; i++) /* one segment per flush */
        assert_int_equal(s_ops()->flush(fs), 0);
    s_du(c->dir, &files, &dbytes);
    print_message("compaction: %llu -> %llu segment bytes for %u objects of 128 KiB\n",
                  (unsigned long long)before, (unsigned long long)s_du_seg_bytes, N / 10);
    assert_true(s_du_seg_bytes < before / 2);
    for (unsigned i = 0; i < N; i += 10)
        s_check_seed(fs, names[i], 128 * KIB, i);
    s_check_disk(c, fs, 0, 0);
    s_ops()->close(fs);
    fs = s_open(c, "segment_size=1M");
    uint64_t bytes, objects;
    s_usage(fs, &bytes, &objects);
    assert_int_equal(objects, N / 10);
    for (unsigned i = 0; i < N; i++) {
        if (i % 10)
            assert_false(s_present(fs, names[i]));
        else
            s_check_seed(fs, names[i], 128 * KIB, i);
    }
    s_ops()->close(fs);
}

/* A store that reports failure after its record was listed (sync=object: the index entry's
 * fdatasync failed) leaves the previous object in place, also after a reopen. */
static void test_seg_failed_store_stays_failed(void **state)
{
    ctx_t *c = *state;
    void *fs = s_open(c, "sync=object");
    char a[KVT_L2_NAME_LEN];
    s_name(1, a);
    s_store_seed(fs, a, 5000, 1);
    uint8_t *d = s_alloc(7000);
    s_fill(d, 7000, 2);
    atomic_store(&s_fault_sync_pass, 1); /* the record's fdatasync passes, its entry's fails */
    atomic_store(&s_fault_sync_errno, EIO);
    assert_int_equal(s_ops()->store(fs, a, d, 7000), KVT_EIO);
    atomic_store(&s_fault_sync_errno, 0);
    free(d);
    s_check_seed(fs, a, 5000, 1);
    s_ops()->close(fs);
    fs = s_open(c, "sync=object");
    s_check_seed(fs, a, 5000, 1);
    s_ops()->close(fs);
}

/* layout=auto keeps a directory's layout; an explicit layout that does not match is refused. */
static void test_seg_auto_layout(void **state)
{
    ctx_t *c = *state;
    char a[KVT_L2_NAME_LEN], spec[400], err[256];
    s_name(1, a);
    c->segments = false;
    void *fs = s_open(c, NULL); /* layout=files */
    s_store_seed(fs, a, 100, 1);
    s_ops()->close(fs);
    snprintf(spec, sizeof spec, "%s", c->dir); /* auto */
    assert_int_equal(s_ops()->open(spec, &fs, err, sizeof err), 0);
    s_check_seed(fs, a, 100, 1);
    s_check_disk(c, fs, 0, 0); /* still one file per object */
    s_ops()->close(fs);
    snprintf(spec, sizeof spec, "%s,layout=segments", c->dir);
    assert_int_equal(s_ops()->open(spec, &fs, err, sizeof err), KVT_EINVAL);
    assert_non_null(strstr(err, "layout=files"));
    print_message("%s\n", err);

    /* a new directory gets segments, and keeps them */
    char sub[300];
    snprintf(sub, sizeof sub, "%s/new", c->dir);
    snprintf(spec, sizeof spec, "%s", sub);
    assert_int_equal(s_ops()->open(spec, &fs, err, sizeof err), 0);
    s_store_seed(fs, a, 100, 2);
    s_ops()->close(fs);
    snprintf(spec, sizeof spec, "%s/seg", sub);
    struct stat st;
    assert_int_equal(stat(spec, &st), 0);
    snprintf(spec, sizeof spec, "%s,layout=files", sub);
    assert_int_equal(s_ops()->open(spec, &fs, err, sizeof err), KVT_EINVAL);
    assert_non_null(strstr(err, "layout=segments"));
    snprintf(spec, sizeof spec, "%s", sub);
    assert_int_equal(s_ops()->open(spec, &fs, err, sizeof err), 0);
    s_check_seed(fs, a, 100, 2);
    s_ops()->close(fs);
}

#define T(f) cmocka_unit_test_setup_teardown(f, s_setup, s_teardown)
#define TS(f) cmocka_unit_test_setup_teardown(f, s_setup_seg, s_teardown)

int main(void)
{
    kvt_log_set_level(KVT_LOG_ERROR); /* the injected failures would log warnings */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_name_vectors),
        T(test_files_on_disk),
        T(test_bad_names),
        T(test_reopen_rebuilds_index),
        T(test_leftover_temp_removed),
        T(test_capacity_lru),
        T(test_capacity_too_big),
        T(test_capacity_reopen_order),
        T(test_threads_capacity),
        T(test_direct_tmpfs),
        T(test_direct_refused),
        T(test_direct_disk),
        T(test_direct_write_fallback),
        T(test_disk_errors),
        T(test_vectored),
        T(test_sync_modes),
        T(test_health_removed_dir),
        T(test_bad_args),
        /* layout=segments: what does not depend on the layout, then its own */
        TS(test_bad_names),
        TS(test_threads_capacity),
        TS(test_direct_disk),
        TS(test_disk_errors),
        TS(test_vectored),
        TS(test_sync_modes),
        TS(test_health_removed_dir),
        TS(test_seg_reopen),
        TS(test_seg_torn_tail),
        TS(test_seg_capacity),
        TS(test_seg_auto_layout),
        TS(test_seg_compact),
        TS(test_seg_failed_store_stays_failed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
