/* Unit tests of storage/kvt_arena: a segment of the configured size under /dev/shm, mode 0600,
 * owned by this user, mapped read-write at its base (bytes written through the mapping are in
 * the file), pinned when mlock allows it and otherwise only with allow_unpinned (as far as this
 * machine lets a test see both); two arenas have different paths; destroy
 * unlinks the segment and accepts NULL. l1.hugepages: off gives 4 KiB pages in /dev/shm and
 * says so; on with a directory that is not a 2 MiB hugetlbfs refuses, naming it, and auto
 * with one falls back to /dev/shm. (Real hugetlbfs arenas, which need root and reserved pages,
 * are tested by tests/integration/test_hugepages.py.) */
#include "kvt_arena.h"
#include "kvt_config.h"
#include "kvt_error.h"
#include "kvt_log.h"

#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

static kvt_config_t *s_cfg(const char *size, const char *unpinned)
{
    char err[KVT_ERR_LEN] = "";
    kvt_config_t *cfg = kvt_config_new();
    assert_non_null(cfg);
    assert_int_equal(kvt_config_set(cfg, "l1_size", size, false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "allow_unpinned", unpinned, false, err, sizeof err), 0);
    /* the segment is l1_size alone, the fast path on or off (test_no_fastpath_tail) */
    assert_int_equal(kvt_config_set(cfg, "fastpath.enabled", "false", false, err, sizeof err), 0);
    /* nothing kept in /dev/shm after a test (test_segment turns it on in a run dir of its own) */
    assert_int_equal(kvt_config_set(cfg, "l1.adopt", "false", false, err, sizeof err), 0);
    return cfg;
}

/* With the fast path on, the segment is still l1_size alone: each ring pair is a memfd of its
 * own (issue 28: no client's rings in memory other clients map), of a page-rounded pair of
 * 384-byte headers and ring_bytes each. */
static void test_no_fastpath_tail(void **state)
{
    (void)state;
    kvt_config_t *cfg = s_cfg("4M", "true");
    char err[KVT_ERR_LEN] = "";
    assert_int_equal(kvt_config_set(cfg, "l1.hugepages", "off", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "fastpath.enabled", "true", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "fastpath.rings", "3", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "fastpath.ring_bytes", "8K", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_fastpath_pair_bytes(cfg), 20480u); /* 2 x (384 + 8192) -> 5 pages */
    kvt_arena_t *a = kvt_arena_new(cfg, err, sizeof err);
    if (!a)
        fail_msg("kvt_arena_new: %s", err);
    assert_int_equal(kvt_arena_size(a), 4u << 20);
    kvt_arena_destroy(&a);
    kvt_config_destroy(&cfg);
}

static void test_segment(void **state)
{
    (void)state;
    kvt_config_t *cfg = s_cfg("4M", "true");
    char err[KVT_ERR_LEN] = "";
    /* /dev/shm whatever hugetlbfs this machine has mounted */
    assert_int_equal(kvt_config_set(cfg, "l1.hugepages", "off", false, err, sizeof err), 0);
    char dir[] = "/tmp/kvt-arena-XXXXXX";
    assert_non_null(mkdtemp(dir));
    assert_int_equal(kvt_config_set(cfg, "run_dir", dir, false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "l1.adopt", "true", false, err, sizeof err), 0);
    kvt_arena_t *a = kvt_arena_new(cfg, err, sizeof err);
    if (!a)
        fail_msg("kvt_arena_new: %s", err);
    kvt_arena_t *b = kvt_arena_new(cfg, err, sizeof err);
    assert_non_null(b);
    assert_int_equal(kvt_arena_size(a), 4u << 20);
    const char *path = kvt_arena_path(a);
    assert_non_null(strstr(path, "/dev/shm/kvtier-"));
    assert_string_not_equal(path, kvt_arena_path(b));
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    assert_int_equal(st.st_uid, getuid());
    assert_int_equal((uint64_t)st.st_size, 4u << 20);

    uint8_t *base = kvt_arena_base(a);
    memcpy(base + 12345, "kvtier", 6);
    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    char back[6];
    assert_int_equal(pread(fd, back, 6, 12345), 6);
    assert_memory_equal(back, "kvtier", 6);
    close(fd);
    print_message("pinned: %d, huge pages: %d\n", kvt_arena_pinned(a), kvt_arena_huge(a));
    assert_int_equal(kvt_arena_page_size(a), 4096); /* off: no THP request */
    assert_false(kvt_arena_huge(a));

    /* l1.adopt (the default): a has the run dir's kept name, b (the name in use) a private
     * one; a's file stays after it, b's does not */
    assert_true(strlen(path) > 3 && strcmp(path + strlen(path) - 3, "-l1") == 0);
    assert_false(kvt_arena_reused(a));
    assert_non_null(strstr(kvt_arena_why_new(a), "no arena left"));
    char *saved = strdup(path), *saved_b = strdup(kvt_arena_path(b));
    kvt_arena_destroy(&a);
    assert_null(a);
    assert_int_equal(access(saved, F_OK), 0); /* kept for the next daemon */
    kvt_arena_destroy(&b);
    assert_int_equal(access(saved_b, F_OK), -1); /* unlinked */
    /* the next one reuses it, bytes and all */
    kvt_arena_t *c = kvt_arena_new(cfg, err, sizeof err);
    assert_non_null(c);
    assert_string_equal(kvt_arena_path(c), saved);
    assert_true(kvt_arena_reused(c));
    assert_memory_equal((uint8_t *)kvt_arena_base(c) + 12345, "kvtier", 6);
    kvt_arena_destroy(&c);
    /* with l1.adopt off the kept file goes, and the new one goes at destroy */
    assert_int_equal(kvt_config_set(cfg, "l1.adopt", "false", false, err, sizeof err), 0);
    kvt_arena_t *d = kvt_arena_new(cfg, err, sizeof err);
    assert_non_null(d);
    assert_int_equal(access(saved, F_OK), -1);
    assert_false(kvt_arena_reused(d));
    assert_string_equal(kvt_arena_why_new(d), "l1.adopt is off");
    char *saved_d = strdup(kvt_arena_path(d));
    kvt_arena_destroy(&d);
    assert_int_equal(access(saved_d, F_OK), -1);
    free(saved);
    free(saved_b);
    free(saved_d);
    kvt_arena_destroy(&a);
    kvt_config_destroy(&cfg);
    rmdir(dir);
}

/* Without allow_unpinned an arena is pinned or refused, never unpinned; with it, the same size
 * always starts, pinned exactly when it could be pinned without (this machine decides which:
 * RLIMIT_MEMLOCK, CAP_IPC_LOCK). */
static void test_pinning(void **state)
{
    (void)state;
    struct rlimit rl;
    assert_int_equal(getrlimit(RLIMIT_MEMLOCK, &rl), 0);
    kvt_config_t *cfg = s_cfg("64M", "false");
    char err[KVT_ERR_LEN] = "";
    kvt_arena_t *a = kvt_arena_new(cfg, err, sizeof err);
    bool lockable = a != NULL;
    if (a) {
        assert_true(kvt_arena_pinned(a));
        kvt_arena_destroy(&a);
    } else {
        assert_non_null(strstr(err, "allow-unpinned"));
    }
    print_message("64 MiB with RLIMIT_MEMLOCK %lld: %s\n",
                  rl.rlim_cur == RLIM_INFINITY ? -1LL : (long long)rl.rlim_cur,
                  lockable ? "pinned" : err);
    kvt_config_destroy(&cfg);
    cfg = s_cfg("64M", "true");
    a = kvt_arena_new(cfg, err, sizeof err);
    kvt_config_destroy(&cfg);
    assert_non_null(a);
    bool pinned = kvt_arena_pinned(a);
    kvt_arena_destroy(&a);
    assert_true(pinned == lockable);
}

static void test_hugepages_modes(void **state)
{
    (void)state;
    char err[KVT_ERR_LEN * 2] = "";
    char dir[] = "/tmp/kvt-arena-XXXXXX"; /* a directory, not a hugetlbfs mount */
    assert_non_null(mkdtemp(dir));
    kvt_config_t *cfg = s_cfg("3M", "true");
    assert_int_equal(kvt_config_set(cfg, "l1.hugepages", "on", false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(cfg, "l1.hugepages_dir", dir, false, err, sizeof err), 0);
    kvt_arena_t *a = kvt_arena_new(cfg, err, sizeof err);
    assert_null(a);
    char want[KVT_ERR_LEN];
    snprintf(want, sizeof want,
             "l1.hugepages is on but l1.hugepages_dir %s is not a hugetlbfs mount with 2 MiB pages",
             dir);
    assert_string_equal(err, want);
    assert_int_equal(kvt_config_set(cfg, "l1.hugepages", "auto", false, err, sizeof err), 0);
    a = kvt_arena_new(cfg, err, sizeof err);
    assert_non_null(a);
    assert_non_null(strstr(kvt_arena_path(a), "/dev/shm/kvtier-"));
    assert_int_equal(kvt_arena_size(a), 3u << 20); /* /dev/shm: l1_size as given */
    assert_true(kvt_arena_page_size(a) == 4096 || kvt_arena_page_size(a) == (2u << 20));
    kvt_arena_destroy(&a);
    kvt_config_destroy(&cfg);
    assert_int_equal(rmdir(dir), 0); /* nothing was left in it */
}

/* Issue 28 item 5: another process truncates the arena file. A daemon thread touching the
 * lost part is not killed: the SIGBUS guard gives the file its size back and the access reads
 * a fresh (zero) page; kvt_arena_check reports the lowest size seen once, and restores the
 * size itself when nothing touched the lost part. */
static void test_truncation_guard(void **state)
{
    (void)state;
    kvt_config_t *cfg = s_cfg("4M", "true");
    char err[KVT_ERR_LEN] = "";
    assert_int_equal(kvt_config_set(cfg, "l1.hugepages", "off", false, err, sizeof err), 0);
    kvt_arena_t *a = kvt_arena_new(cfg, err, sizeof err);
    if (!a)
        fail_msg("kvt_arena_new: %s", err);
    volatile uint8_t *base = kvt_arena_base(a);
    uint64_t size = kvt_arena_size(a);
    memset((void *)base, 0xab, size);
    assert_int_equal(kvt_arena_check(a), UINT64_MAX); /* never cut */
    /* cut to half, then touch the lost part: the guard, not a crash */
    assert_int_equal(truncate(kvt_arena_path(a), (off_t)(size / 2)), 0);
    assert_int_equal(base[size - 1], 0);
    assert_int_equal(base[size / 2 - 1], 0xab); /* before the cut: intact */
    struct stat st;
    assert_int_equal(stat(kvt_arena_path(a), &st), 0);
    assert_int_equal((uint64_t)st.st_size, size);
    assert_int_equal(kvt_arena_check(a), size / 2);
    assert_int_equal(kvt_arena_check(a), UINT64_MAX); /* reported once */
    /* cut again, nothing touches it: the check restores the size and reports it */
    assert_int_equal(truncate(kvt_arena_path(a), 4096), 0);
    assert_int_equal(kvt_arena_check(a), 4096);
    assert_int_equal(stat(kvt_arena_path(a), &st), 0);
    assert_int_equal((uint64_t)st.st_size, size);
    base[size - 1] = 7; /* writable again */
    assert_int_equal(base[size - 1], 7);
    kvt_arena_destroy(&a);
    kvt_config_destroy(&cfg);
}

/* The background thread reads every page (warm), leaves the bytes as they were, and a destroy
 * right after its start stops it (no wait for a whole pass, no crash). */
static void test_background_warm(void **state)
{
    (void)state;
    kvt_config_t *cfg = s_cfg("64M", "true");
    char err[KVT_ERR_LEN] = "";
    kvt_arena_t *a = kvt_arena_new(cfg, err, sizeof err);
    if (!a)
        fail_msg("kvt_arena_new: %s", err);
    uint8_t *base = kvt_arena_base(a);
    uint64_t size = kvt_arena_size(a);
    memset(base, 0x5a, size);
    assert_false(kvt_arena_warm(a));
    kvt_arena_background_start(a);
    kvt_arena_background_start(a); /* the second time: nothing */
    for (int i = 0; i < 3000 && !kvt_arena_warm(a); i++)
        usleep(10000);
    assert_true(kvt_arena_warm(a));
    for (uint64_t off = 0; off < size; off += 4096)
        assert_int_equal(base[off], 0x5a);
    kvt_arena_destroy(&a);
    a = kvt_arena_new(cfg, err, sizeof err);
    assert_non_null(a);
    kvt_arena_background_start(a);
    kvt_arena_destroy(&a); /* at once */
    assert_null(a);
    kvt_config_destroy(&cfg);
}

int main(void)
{
    kvt_log_set_level(KVT_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_segment),
        cmocka_unit_test(test_no_fastpath_tail),
        cmocka_unit_test(test_truncation_guard),
        cmocka_unit_test(test_background_warm),
        cmocka_unit_test(test_pinning),
        cmocka_unit_test(test_hugepages_modes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
