/* libFuzzer harness for the fs L2 segment log's reader (l2/kvt_seglog.c: kvt_seglog_scan and
 * kvt_seglog_read), which decides what a restarted daemon finds in its disk tier (issue 31).
 *
 * Input: a program run against a real log in a scratch directory (64 KiB segments, buffered
 * I/O): up to 128 appends (one of 16 names, 0..20,000 bytes made from the name and a version)
 * and removes (tombstones), written by the real writer; then one damage to the files it left —
 * none, a segment cut at any length, a byte flipped in a segment or an index file, an index file
 * deleted, or an index file replaced by the rest of the input. The log is opened again and
 * scanned. Checked (abort = a finding): every record visited is a page-aligned range after the
 * header page with room for its payload, name and footer, named like a name the program used;
 * every object left after the replay reads without a crash; with no damage, the replay gives
 * exactly what the program left (names, sizes, bytes). ASan/UBSan see any read outside a
 * buffer. Build and run: make fuzz. */
#include "fuzz_input.h"
#include "kvt_error.h"
#include "kvt_seglog.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define S_NAMES 16
#define S_MAXLEN 20000u
#define S_PAGE 4096u

static void s_fill(uint8_t *b, size_t len, unsigned id, unsigned ver)
{
    for (size_t i = 0; i < len; i++)
        b[i] = (uint8_t)(i * 31 + id * 7 + ver * 13);
}

typedef struct {
    bool present;
    uint64_t size;
    unsigned ver;
    kvt_segloc_t loc;
} s_slot_t;

static s_slot_t s_want[S_NAMES], s_got[S_NAMES];

static int s_id(const char *name, size_t nlen)
{
    unsigned id;
    char tail;
    if (nlen < 2 || nlen > 3 || sscanf(name, "n%u%c", &id, &tail) != 1 || id >= S_NAMES)
        return -1;
    return (int)id;
}

static void s_visit(void *arg, const char *name, size_t nlen, uint64_t size, bool tombstone,
                    const kvt_segloc_t *loc)
{
    (void)arg;
    int id = s_id(name, nlen);
    if (id < 0 || strlen(name) != nlen) /* only the program's names were ever written */
        abort();
    if (loc->off < S_PAGE || loc->off % S_PAGE || loc->bytes % S_PAGE ||
        size + nlen + 64 > loc->bytes || (tombstone && size))
        abort();
    s_got[id] = (s_slot_t){!tombstone, size, 0, *loc};
}

static char s_dir[64];

static void s_clean(void)
{
    char p[160];
    snprintf(p, sizeof p, "%s/seg", s_dir);
    DIR *d = opendir(p);
    if (!d)
        return;
    for (struct dirent *de; (de = readdir(d));)
        if (de->d_name[0] != '.') {
            char f[600];
            snprintf(f, sizeof f, "%s/%s", p, de->d_name);
            unlink(f);
        }
    closedir(d);
}

/* The name of file number k (by readdir order) under seg/ with (idx) or without an .idx. */
static bool s_pick(unsigned k, bool idx, char *out, size_t outlen)
{
    char p[160];
    snprintf(p, sizeof p, "%s/seg", s_dir);
    DIR *d = opendir(p);
    if (!d)
        return false;
    unsigned n = 0;
    char names[64][32];
    for (struct dirent *de; (de = readdir(d)) && n < 64;)
        if (strlen(de->d_name) == (idx ? 20u : 16u))
            snprintf(names[n++], 32, "%.31s", de->d_name);
    closedir(d);
    if (!n)
        return false;
    snprintf(out, outlen, "%s/%s", p, names[k % n]);
    return true;
}

/* Returns whether it changed anything. */
static bool s_damage(s_in_t *in)
{
    unsigned what = (unsigned)s_take(in, 1) % 5, k = (unsigned)s_take(in, 1);
    char f[256];
    struct stat st;
    if (what == 0 || !s_pick(k, what >= 2 && (k & 0x80), f, sizeof f) || stat(f, &st) != 0)
        return false;
    uint64_t at = st.st_size ? s_take(in, 3) % (uint64_t)st.st_size : 0;
    if (what == 1) {
        if (truncate(f, (off_t)at) != 0)
            abort();
    } else if (what == 2) {
        int fd = open(f, O_RDWR);
        uint8_t b;
        if (fd < 0 || pread(fd, &b, 1, (off_t)at) != 1)
            abort();
        b ^= (uint8_t)(1u << (s_take(in, 1) % 8));
        if (pwrite(fd, &b, 1, (off_t)at) != 1)
            abort();
        close(fd);
    } else if (what == 3 && s_pick(k, true, f, sizeof f)) {
        unlink(f);
    } else if (what == 4 && s_pick(k, true, f, sizeof f)) {
        FILE *o = fopen(f, "w");
        if (!o)
            abort();
        fwrite(in->p, 1, in->n, o);
        fclose(o);
        in->n = 0;
    } else {
        return false;
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!s_dir[0]) {
        snprintf(s_dir, sizeof s_dir, "/tmp/kvt-fuzz-seglog-XXXXXX");
        if (!mkdtemp(s_dir))
            abort();
    }
    s_clean();
    s_in_t in = {data, size};
    int dirfd = open(s_dir, O_RDONLY | O_DIRECTORY);
    char err[256];
    kvt_seglog_t *log =
        kvt_seglog_new(dirfd, s_dir, 64u << 10, KVT_SEGLOG_SYNC_NONE, false, err, sizeof err);
    if (!log)
        abort();
    uint64_t skipped;
    if (kvt_seglog_scan(log, s_visit, NULL, &skipped) != 0)
        abort();
    memset(s_want, 0, sizeof s_want);
    uint8_t *buf = malloc(S_MAXLEN + S_PAGE);
    if (!buf)
        abort();
    for (unsigned op = 0; op < 128 && in.n; op++) {
        unsigned code = (unsigned)s_take(&in, 1), id = code % S_NAMES;
        char name[8];
        int nlen = snprintf(name, sizeof name, "n%u", id);
        if (code & 0x80) {
            if (kvt_seglog_tombstone(log, name, (size_t)nlen) != 0)
                abort();
            s_want[id].present = false;
            continue;
        }
        uint64_t len = s_take(&in, 2) % S_MAXLEN;
        unsigned ver = op + 1;
        s_fill(buf, len, id, ver);
        struct iovec v = {buf, len};
        kvt_segloc_t loc;
        if (kvt_seglog_append(log, name, (size_t)nlen, &v, 1, &loc) != 0)
            abort();
        kvt_seglog_done(log, &loc);
        s_want[id] = (s_slot_t){true, len, ver, loc};
    }
    kvt_seglog_destroy(&log);
    bool damaged = s_damage(&in);

    log = kvt_seglog_new(dirfd, s_dir, 64u << 10, KVT_SEGLOG_SYNC_NONE, false, err, sizeof err);
    if (!log)
        abort();
    memset(s_got, 0, sizeof s_got);
    if (kvt_seglog_scan(log, s_visit, NULL, &skipped) != 0)
        abort();
    for (unsigned id = 0; id < S_NAMES; id++) {
        if (!damaged && s_got[id].present != s_want[id].present)
            abort();
        if (!s_got[id].present)
            continue;
        uint64_t len = s_got[id].size;
        if (len > S_MAXLEN)
            continue; /* a flipped length: the daemon's trailer check refuses it */
        struct iovec v = {buf, S_MAXLEN + S_PAGE};
        int rc = kvt_seglog_read(log, &s_got[id].loc, len, &v, 1);
        if (!damaged) {
            uint8_t *w = malloc(len ? len : 1);
            if (!w)
                abort();
            s_fill(w, len, id, s_want[id].ver);
            if (rc != 0 || len != s_want[id].size || memcmp(buf, w, len) != 0)
                abort();
            free(w);
        }
    }
    kvt_seglog_destroy(&log);
    free(buf);
    close(dirfd);
    return 0;
}
