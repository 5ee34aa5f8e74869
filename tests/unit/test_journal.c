/* Unit tests for storage/kvt_journal (issue 30): what is written is read back; a file cut at
 * any byte (a process killed inside a write) yields exactly the whole records before the cut;
 * a damaged record ends the valid prefix; another format or version is refused with a reason;
 * the live set applies SUM, DROP and CLEAR and leaves out extents that cannot be right. */
#include "kvt_error.h"
#include "kvt_journal.h"
#include "kvt_le.h"

#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cmocka.h>

#define S_ARENA (1u << 20)

static char s_dir[64];
static char s_path[128];

static int s_setup(void **state)
{
    (void)state;
    snprintf(s_dir, sizeof s_dir, "/tmp/kvt-journal-XXXXXX");
    assert_non_null(mkdtemp(s_dir));
    snprintf(s_path, sizeof s_path, "%s/kvtier-l1.journal", s_dir);
    return 0;
}

static int s_teardown(void **state)
{
    (void)state;
    unlink(s_path);
    rmdir(s_dir);
    return 0;
}

static uint8_t *s_read(size_t *len)
{
    int fd = open(s_path, O_RDONLY);
    assert_true(fd >= 0);
    struct stat st;
    assert_int_equal(fstat(fd, &st), 0);
    uint8_t *b = malloc((size_t)st.st_size + 1);
    assert_non_null(b);
    assert_int_equal(read(fd, b, (size_t)st.st_size), st.st_size);
    close(fd);
    *len = (size_t)st.st_size;
    return b;
}

static kvt_journal_t *s_new(const kvt_journal_put_t *live, size_t n)
{
    kvt_journal_header_t h = {.arena_size = S_ARENA,
                              .page_size = 4096,
                              .arena_dev = 7,
                              .arena_ino = 99,
                              .created = 123456789};
    snprintf(h.path, sizeof h.path, "/dev/shm/kvtier-test-l1");
    char err[160] = "";
    kvt_journal_t *j = kvt_journal_create(s_path, &h, live, n, err, sizeof err);
    assert_non_null(j);
    assert_true(h.salt != 0);
    return j;
}

static kvt_journal_put_t s_obj(uint64_t offset, uint64_t length, const char *ns, uint8_t k)
{
    kvt_journal_put_t p = {.offset = offset, .length = length};
    memset(p.key.b, k, sizeof p.key.b);
    p.ns = (kvt_ns_t){(const uint8_t *)ns, (uint32_t)strlen(ns), NULL, 0};
    return p;
}

static void test_round_trip(void **state)
{
    (void)state;
    kvt_journal_t *j = s_new(NULL, 0);
    kvt_journal_put_t puts[3] = {s_obj(8192, 5000, "ns-a", 1), s_obj(0, 4096, "ns-b", 2),
                                 s_obj(65536, 1, "ns-a", 3)};
    puts[1].ns.salt = (const uint8_t *)"pepper";
    puts[1].ns.salt_len = 6;
    puts[2].has_sum = true;
    puts[2].sum = 0xabcdef;
    puts[2].l2_pending = 2;
    assert_int_equal(kvt_journal_put(j, puts, 3), 0);
    assert_int_equal(puts[0].seq, 1);
    assert_int_equal(puts[2].seq, 3);
    assert_int_equal(kvt_journal_sum(j, puts[0].seq, 0x1234), 0);
    uint64_t gone = puts[1].seq;
    assert_int_equal(kvt_journal_drop(j, &gone, 1), 0);
    kvt_journal_put_t later = s_obj(4096, 4096, "ns-c", 4); /* reuses freed space */
    assert_int_equal(kvt_journal_put(j, &later, 1), 0);
    assert_int_equal(later.seq, 4);
    kvt_journal_put_t bad = s_obj(0, 1, "", 5);
    assert_int_equal(kvt_journal_put(j, &bad, 1), KVT_EINVAL);
    uint64_t bytes = kvt_journal_bytes(j);
    kvt_journal_destroy(&j);

    size_t len = 0;
    uint8_t *b = s_read(&len);
    assert_int_equal(len, bytes);
    kvt_journal_header_t h;
    kvt_journal_put_t *live = NULL;
    size_t n = 0, valid = 0;
    uint64_t rejected = 9;
    char err[160] = "";
    assert_int_equal(kvt_journal_live(b, len, &h, &live, &n, &rejected, &valid, err, sizeof err),
                     0);
    assert_int_equal(valid, len);
    assert_int_equal(rejected, 0);
    assert_int_equal(h.version, KVT_JOURNAL_VERSION);
    assert_int_equal(h.arena_size, S_ARENA);
    assert_int_equal(h.arena_ino, 99);
    assert_string_equal(h.path, "/dev/shm/kvtier-test-l1");
    assert_int_equal(n, 3);
    /* by offset: 4096 (later), 8192 (puts[0], summed later), 65536 (puts[2], summed at put) */
    assert_int_equal(live[0].offset, 4096);
    assert_int_equal(live[0].seq, 4);
    assert_false(live[0].has_sum);
    assert_memory_equal(live[0].ns.name, "ns-c", 4);
    assert_int_equal(live[1].offset, 8192);
    assert_int_equal(live[1].length, 5000);
    assert_true(live[1].has_sum);
    assert_int_equal(live[1].sum, 0x1234);
    assert_int_equal(live[1].key.b[0], 1);
    assert_int_equal(live[2].sum, 0xabcdef);
    assert_int_equal(live[2].l2_pending, 2);
    free(live);

    /* carried over into a new journal (compaction, adoption): seqs kept, the next is after */
    j = s_new(&puts[2], 1);
    kvt_journal_put_t more = s_obj(131072, 10, "ns-d", 6);
    assert_int_equal(kvt_journal_put(j, &more, 1), 0);
    assert_int_equal(more.seq, 4);
    assert_int_equal(kvt_journal_clear(j), 0);
    kvt_journal_put_t after = s_obj(0, 10, "ns-e", 7);
    assert_int_equal(kvt_journal_put(j, &after, 1), 0);
    kvt_journal_destroy(&j);
    free(b);
    b = s_read(&len);
    assert_int_equal(kvt_journal_live(b, len, &h, &live, &n, &rejected, &valid, err, sizeof err),
                     0);
    assert_int_equal(n, 1); /* the CLEAR took the carried and the earlier put */
    assert_int_equal(live[0].seq, 5);
    free(live);
    free(b);
}

/* Counts what the visitor saw. */
typedef struct {
    unsigned puts, sums, drops, clears;
} s_count_t;

static void s_cput(void *c, const kvt_journal_put_t *p)
{
    (void)p;
    ((s_count_t *)c)->puts++;
}
static void s_csum(void *c, uint64_t seq, uint64_t sum)
{
    (void)seq;
    (void)sum;
    ((s_count_t *)c)->sums++;
}
static void s_cdrop(void *c, uint64_t seq)
{
    (void)seq;
    ((s_count_t *)c)->drops++;
}
static void s_cclear(void *c)
{
    ((s_count_t *)c)->clears++;
}

static void test_torn_and_damaged(void **state)
{
    (void)state;
    kvt_journal_t *j = s_new(NULL, 0);
    size_t ends[32], nends = 0;
    ends[nends++] = kvt_journal_bytes(j); /* the header */
    for (int i = 0; i < 6; i++) {
        kvt_journal_put_t p = s_obj((uint64_t)i * 8192, 100 + i, "torn", (uint8_t)i);
        assert_int_equal(kvt_journal_put(j, &p, 1), 0);
        ends[nends++] = kvt_journal_bytes(j);
        if (i % 2) {
            assert_int_equal(kvt_journal_sum(j, p.seq, 77), 0);
            ends[nends++] = kvt_journal_bytes(j);
        }
    }
    uint64_t d[2] = {1, 2};
    assert_int_equal(kvt_journal_drop(j, d, 2), 0);
    ends[nends++] = kvt_journal_bytes(j);
    kvt_journal_destroy(&j);
    size_t len = 0;
    uint8_t *b = s_read(&len);
    kvt_journal_visitor_t v = {s_cput, s_csum, s_cdrop, s_cclear, NULL};
    kvt_journal_header_t h;
    char err[160];
    /* cut at every byte: the valid prefix is the last record end at or before the cut */
    for (size_t cut = 0; cut <= len; cut++) {
        uint8_t *c = malloc(cut ? cut : 1);
        memcpy(c, b, cut);
        size_t valid = 1;
        s_count_t cnt = {0};
        int rc = kvt_journal_parse(c, cut, &h, &v, &cnt, &valid, err, sizeof err);
        if (cut < ends[0]) {
            assert_int_equal(rc, KVT_EBADREQ);
            assert_int_equal(valid, 0);
        } else {
            assert_int_equal(rc, 0);
            size_t want = ends[0];
            for (size_t k = 0; k < nends; k++)
                if (ends[k] <= cut)
                    want = ends[k];
            assert_int_equal(valid, want);
        }
        free(c);
    }
    /* one flipped byte inside the third PUT: the parse stops before it */
    b[ends[2] + 20] ^= 0x40;
    size_t valid = 0;
    s_count_t cnt = {0};
    assert_int_equal(kvt_journal_parse(b, len, &h, &v, &cnt, &valid, err, sizeof err), 0);
    assert_int_equal(valid, ends[2]);
    assert_int_equal(cnt.puts, 2);
    /* other version, garbage, empty: refused with a reason */
    uint8_t junk[64];
    memset(junk, 0x5a, sizeof junk);
    assert_int_equal(kvt_journal_parse(junk, sizeof junk, &h, &v, &cnt, &valid, err, sizeof err),
                     KVT_EBADREQ);
    assert_non_null(strstr(err, "header"));
    assert_int_equal(kvt_journal_parse(junk, 0, &h, &v, &cnt, &valid, err, sizeof err),
                     KVT_EBADREQ);
    assert_non_null(strstr(err, "empty"));
    free(b);
}

static void test_live_leaves_out_impossible_extents(void **state)
{
    (void)state;
    kvt_journal_t *j = s_new(NULL, 0);
    kvt_journal_put_t p[6] = {
        s_obj(0, 8192, "x", 1),              /* fine: pages 0-1 */
        s_obj(4096, 10, "x", 2),             /* overlaps the first */
        s_obj(S_ARENA - 4096, 4097, "x", 3), /* runs past the arena */
        s_obj(12288 + 1, 10, "x", 4),        /* misaligned */
        s_obj(16384, 4096, "x", 5),          /* fine */
        s_obj(UINT64_MAX - 4095, 1, "x", 6), /* far outside */
    };
    assert_int_equal(kvt_journal_put(j, p, 6), 0);
    kvt_journal_destroy(&j);
    size_t len = 0;
    uint8_t *b = s_read(&len);
    kvt_journal_header_t h;
    kvt_journal_put_t *live = NULL;
    size_t n = 0, valid = 0;
    uint64_t rejected = 0;
    char err[160];
    assert_int_equal(kvt_journal_live(b, len, &h, &live, &n, &rejected, &valid, err, sizeof err),
                     0);
    assert_int_equal(n, 2);
    assert_int_equal(rejected, 4);
    assert_int_equal(live[0].seq, 1);
    assert_int_equal(live[1].seq, 5);
    free(live);
    free(b);
    struct stat st;
    assert_int_equal(stat(s_path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
}

/* Compaction: the rewritten file holds exactly what it was given (seqs and sums kept), appends
 * go on into it with seqs after the old ones, and its size starts over. */
static void test_rewrite(void **state)
{
    (void)state;
    kvt_journal_t *j = s_new(NULL, 0);
    kvt_journal_put_t p[40];
    char longest[KVT_MAX_LABEL];
    memset(longest, 'z', sizeof longest);
    for (int i = 0; i < 40; i++)
        p[i] = s_obj((uint64_t)i * 4096, 100, "rw", (uint8_t)i);
    p[38].label = (kvt_bytes_t){(const uint8_t *)longest, KVT_MAX_LABEL}; /* kept: version 3 */
    assert_int_equal(kvt_journal_put(j, p, 40), 0);
    for (int i = 0; i < 38; i++)
        assert_int_equal(kvt_journal_drop(j, &p[i].seq, 1), 0);
    uint64_t before = kvt_journal_bytes(j);
    p[39].has_sum = true;
    p[39].sum = 4242;
    char err[160] = "";
    /* appended between the mark and the rewrite (the snapshot was being taken): carried over */
    kvt_journal_mark(j);
    assert_int_equal(kvt_journal_sum(j, p[38].seq, 55), 0);
    assert_int_equal(kvt_journal_drop(j, &p[39].seq, 1), 0);
    assert_int_equal(kvt_journal_rewrite(j, &p[38], 2, err, sizeof err), 0);
    assert_true(kvt_journal_bytes(j) < before / 4);
    kvt_journal_put_t more = s_obj(200 * 4096, 7, "rw2", 99);
    more.label = (kvt_bytes_t){(const uint8_t *)"mm-more", 7};
    assert_int_equal(kvt_journal_put(j, &more, 1), 0);
    assert_int_equal(more.seq, 41);
    /* a second compaction with nothing appended meanwhile; then a later SUM */
    kvt_journal_mark(j);
    kvt_journal_put_t two[2] = {p[38], more};
    assert_int_equal(kvt_journal_rewrite(j, two, 2, err, sizeof err), 0);
    assert_int_equal(kvt_journal_sum(j, p[38].seq, 77), 0);
    kvt_journal_destroy(&j);
    size_t len = 0;
    uint8_t *b = s_read(&len);
    kvt_journal_header_t h;
    kvt_journal_put_t *live = NULL;
    size_t n = 0, valid = 0;
    uint64_t rejected = 0;
    assert_int_equal(kvt_journal_live(b, len, &h, &live, &n, &rejected, &valid, err, sizeof err),
                     0);
    assert_int_equal(valid, len);
    assert_int_equal(n, 2); /* seq 40 was dropped while the first snapshot was taken */
    assert_int_equal(rejected, 0);
    assert_int_equal(live[0].seq, 39);
    assert_int_equal(live[0].sum, 77);
    assert_int_equal(live[0].label.len, KVT_MAX_LABEL); /* through two rewrites */
    assert_memory_equal(live[0].label.ptr, longest, KVT_MAX_LABEL);
    assert_int_equal(live[1].seq, 41);
    assert_int_equal(live[1].label.len, 7);
    assert_memory_equal(live[1].label.ptr, "mm-more", 7);
    assert_string_equal(h.path, "/dev/shm/kvtier-test-l1");
    free(live);
    free(b);
}

/* L2DONE: the write-behind of an object is done; the live set then owes nothing to L2 for it
 * (an object without it is written again by the next daemon). Unknown seqs are ignored. */
static void test_l2done(void **state)
{
    (void)state;
    kvt_journal_t *j = s_new(NULL, 0);
    kvt_journal_put_t p[2] = {s_obj(0, 4096, "x", 1), s_obj(8192, 100, "x", 2)};
    p[0].l2_pending = p[1].l2_pending = 1;
    assert_int_equal(kvt_journal_put(j, p, 2), 0);
    assert_int_equal(kvt_journal_l2done(j, p[1].seq), 0);
    assert_int_equal(kvt_journal_l2done(j, 999), 0);
    kvt_journal_destroy(&j);
    size_t len = 0, n = 0, valid = 0;
    uint8_t *b = s_read(&len);
    kvt_journal_header_t h;
    kvt_journal_put_t *live = NULL;
    uint64_t rejected = 0;
    char err[160] = "";
    assert_int_equal(kvt_journal_live(b, len, &h, &live, &n, &rejected, &valid, err, sizeof err),
                     0);
    assert_int_equal(valid, len);
    assert_int_equal(n, 2);
    assert_int_equal(live[0].l2_pending, 1);
    assert_int_equal(live[1].l2_pending, 0);
    free(live);
    /* a version 1 journal (written before L2DONE existed) is still read */
    assert_int_equal(h.version, KVT_JOURNAL_VERSION);
    size_t hl = kvt_le_get32(b), body = 8 + ((hl + 7) & ~(size_t)7);
    b[8] = 1; /* the header's version, after u32 len, u16 type, u16 flags; then its check */
    assert_int_equal(kvt_journal_parse(b, len, &h, NULL, NULL, &valid, err, sizeof err),
                     KVT_EBADREQ);
    kvt_le_put64(b + body, XXH3_64bits_withSeed(b, body, 0));
    assert_int_equal(kvt_journal_parse(b, len, &h, NULL, NULL, &valid, err, sizeof err), 0);
    assert_int_equal(h.version, 1);
    assert_int_equal(valid, len);
    b[8] = 2; /* version 2: no labels, the same PUT records */
    kvt_le_put64(b + body, XXH3_64bits_withSeed(b, body, 0));
    assert_int_equal(kvt_journal_parse(b, len, &h, NULL, NULL, &valid, err, sizeof err), 0);
    assert_int_equal(valid, len);
    b[8] = 4; /* a later format: refused, naming it */
    kvt_le_put64(b + body, XXH3_64bits_withSeed(b, body, 0));
    assert_int_equal(kvt_journal_parse(b, len, &h, NULL, NULL, &valid, err, sizeof err),
                     KVT_EBADREQ);
    assert_non_null(strstr(err, "version 4"));
    free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_round_trip, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_torn_and_damaged, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_live_leaves_out_impossible_extents, s_setup,
                                        s_teardown),
        cmocka_unit_test_setup_teardown(test_rewrite, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_l2done, s_setup, s_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
