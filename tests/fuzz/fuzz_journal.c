/* libFuzzer harness for the L1 journal's reader (storage/kvt_journal.c: kvt_journal_parse and
 * kvt_journal_live), which decides what a restarted daemon adopts (issue 30).
 *
 * Input: byte 0 = selector. Bit 0 set: the rest is taken as the journal file as is. Clear: the
 * rest is a program that builds a journal with correct frames and checksums (framed here
 * independently of the writer, from the format in kvt_journal.h): a header (arena size from
 * the input), then up to 256 writes of 1 to 3 records each — PUT (offset, length, key,
 * namespace and label of any length, including out-of-bounds ones), SUM, DROP, CLEAR, L2DONE,
 * or a record of an unknown type — followed by a mutation (none, a cut, a flipped byte).
 * Checked (abort = a finding): the valid prefix is within the input and, for a journal of
 * well-formed records left intact, the whole file; the live set is sorted by offset,
 * page-aligned, disjoint and inside the arena, with seqs that were put, namespaces and labels
 * within bounds; a second parse of the valid prefix alone gives the same prefix. ASan/UBSan see any
 * read outside the input. Build and run: make fuzz. */
#include "fuzz_input.h"
#include "kvt_error.h"
#include "kvt_journal.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct {
    uint8_t *b;
    size_t n, cap;
} s_out_t;

static uint8_t *s_grow(s_out_t *o, size_t add)
{
    if (o->n + add > o->cap) {
        size_t cap = o->cap ? o->cap : 1024;
        while (cap < o->n + add)
            cap *= 2;
        uint8_t *b = realloc(o->b, cap);
        if (!b)
            abort();
        o->b = b;
        o->cap = cap;
    }
    uint8_t *at = o->b + o->n;
    memset(at, 0, add);
    o->n += add;
    return at;
}

static void s_le(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* A framed record: u32 len, u16 type, u16 flags, payload, pad to 8, u64 XXH3(seed salt). */
static void s_record(s_out_t *o, uint16_t type, bool more, const uint8_t *payload, size_t len,
                     uint64_t salt)
{
    size_t body = 8 + ((len + 7) & ~(size_t)7);
    uint8_t *r = s_grow(o, body + 8);
    s_le(r, len, 4);
    s_le(r + 4, type, 2);
    s_le(r + 6, more, 2);
    if (len)
        memcpy(r + 8, payload, len);
    s_le(r + body, XXH3_64bits_withSeed(r, body, salt), 8);
}

static void s_check(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "fuzz_journal: %s\n", what);
        abort();
    }
}

static void s_verify(const uint8_t *buf, size_t len, bool whole)
{
    kvt_journal_header_t h;
    kvt_journal_put_t *live = NULL;
    size_t n = 0, valid = 0;
    uint64_t rejected = 0;
    char err[200];
    int rc = kvt_journal_live(buf, len, &h, &live, &n, &rejected, &valid, err, sizeof err);
    s_check(rc == 0 || rc == KVT_EBADREQ || rc == KVT_ENOMEM, "unexpected code");
    s_check(valid <= len, "valid prefix past the input");
    if (rc) {
        s_check(!live && n == 0, "a refused journal gave objects");
        return;
    }
    if (whole)
        s_check(valid == len, "an intact journal was not read to its end");
    uint64_t end = 0;
    for (size_t i = 0; i < n; i++) {
        const kvt_journal_put_t *p = &live[i];
        uint64_t ext = p->length ? (p->length + 4095) / 4096 * 4096 : 4096;
        s_check(p->offset % 4096 == 0, "misaligned live object");
        s_check(ext <= h.arena_size && p->offset <= h.arena_size - ext, "outside the arena");
        s_check(i == 0 || p->offset >= end, "overlapping or unsorted live objects");
        s_check(p->ns.name_len >= 1 && p->ns.name_len <= KVT_MAX_NS &&
                    p->ns.salt_len <= KVT_MAX_SALT,
                "namespace out of bounds");
        s_check(p->ns.name >= buf && p->ns.name + p->ns.name_len <= buf + valid,
                "namespace outside the valid prefix");
        s_check(p->label.len <= KVT_MAX_LABEL &&
                    (!p->label.len ||
                     (p->label.ptr >= buf && p->label.ptr + p->label.len <= buf + valid)),
                "label out of bounds");
        end = p->offset + ext;
    }
    free(live);
    /* the valid prefix on its own reads the same */
    size_t again = 0;
    kvt_journal_header_t h2;
    s_check(kvt_journal_parse(buf, valid, &h2, NULL, NULL, &again, err, sizeof err) == 0 &&
                again == valid,
            "the valid prefix does not read as itself");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    s_in_t in = {data + 1, size - 1};
    if (data[0] & 1) {
        s_verify(in.p, in.n, false);
        return 0;
    }
    s_out_t o = {0};
    uint64_t salt = s_take(&in, 8) | 1;
    uint64_t arena = s_take(&in, 3) << 12; /* up to 64 GiB, whole pages */
    uint8_t hdr[56 + 16];
    memset(hdr, 0, sizeof hdr);
    s_le(hdr, KVT_JOURNAL_VERSION, 4);
    s_le(hdr + 8, salt, 8);
    s_le(hdr + 16, arena, 8);
    s_le(hdr + 24, 4096, 8);
    memcpy(hdr + 56, "/dev/shm/kvtier-", 16);
    s_record(&o, KVT_JREC_HEADER, false, hdr, sizeof hdr, 0);
    uint64_t seq = 1;
    bool wellformed = true; /* every record one the reader takes */
    for (int w = 0; w < 256 && in.n; w++) {
        int nrec = 1 + (int)(s_take(&in, 1) % 3);
        for (int r = 0; r < nrec; r++) {
            uint8_t op = (uint8_t)s_take(&in, 1);
            uint8_t pay[56 + 700];
            memset(pay, 0, sizeof pay);
            bool more = r + 1 < nrec;
            switch (op % 7) {
            case 0:
            case 1: { /* PUT */
                s_le(pay, seq++, 8);
                s_le(pay + 8, s_take(&in, 1) % 2 ? s_take(&in, 8) : s_take(&in, 2) << 12, 8);
                s_le(pay + 16, s_take(&in, 1) % 2 ? s_take(&in, 8) : s_take(&in, 3), 8);
                s_le(pay + 24, s_take(&in, 8), 8);
                pay[32] = (uint8_t)(s_take(&in, 1) % 3); /* 2: malformed has_sum */
                pay[33] = (uint8_t)s_take(&in, 1);
                uint32_t nl = (uint32_t)s_take(&in, 2) % 300, sl = (uint32_t)s_take(&in, 1);
                uint32_t ll = (uint32_t)s_take(&in, 2) % 300; /* version 3's label */
                uint32_t room = (uint32_t)sizeof pay - 56;
                if (nl > room)
                    nl = room;
                if (sl > room - nl)
                    sl = room - nl;
                if (ll > room - nl - sl)
                    ll = room - nl - sl;
                s_le(pay + 34, nl, 2);
                s_le(pay + 36, sl, 2);
                s_le(pay + 38, ll, 2);
                pay[40] = op;
                wellformed &= pay[32] <= 1 && nl >= 1 && nl <= KVT_MAX_NS && sl <= KVT_MAX_SALT &&
                              ll <= KVT_MAX_LABEL;
                s_record(&o, KVT_JREC_PUT, more, pay, 56 + nl + sl + ll, salt);
                break;
            }
            case 2: /* SUM of some earlier (or later) seq */
                s_le(pay, s_take(&in, 1) % (seq + 2), 8);
                s_le(pay + 8, s_take(&in, 8), 8);
                s_record(&o, KVT_JREC_SUM, more, pay, 16, salt);
                break;
            case 3:
                s_le(pay, s_take(&in, 1) % (seq + 2), 8);
                s_record(&o, KVT_JREC_DROP, more, pay, 8, salt);
                break;
            case 4:
                s_record(&o, KVT_JREC_CLEAR, more, pay, 0, salt);
                break;
            case 5: /* L2DONE of some earlier (or later) seq */
                s_le(pay, s_take(&in, 1) % (seq + 2), 8);
                s_record(&o, KVT_JREC_L2DONE, more, pay, 8, salt);
                break;
            default: /* unknown type or wrong length: a reader stops there */
                s_record(&o, (uint16_t)(7 + op % 4), more, pay, op % 24, salt);
                wellformed = false;
                break;
            }
        }
    }
    uint8_t mut = (uint8_t)s_take(&in, 1);
    size_t at = o.n ? (size_t)(s_take(&in, 4) % o.n) : 0;
    bool whole = true;
    if (mut % 3 == 1) {
        o.n = at;
        whole = false;
    } else if (mut % 3 == 2 && o.n) {
        o.b[at] ^= (uint8_t)(1u << (mut % 8));
        whole = false;
    }
    /* an unknown type or malformed content legitimately ends the valid prefix early */
    s_verify(o.b ? o.b : (const uint8_t *)"", o.n, whole && wellformed);
    free(o.b);
    return 0;
}
