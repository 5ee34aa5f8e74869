/* libFuzzer harness for the shared-memory ring's consumer (and producer) (common/kvt_ring.c):
 * the input is what a hostile peer can write into the region, and when.
 *
 * Input: byte 0 = selector: capacity 64 << (b & 3); bit 2 = "raw": the header's constants come
 * from the input too (attach must refuse what is not a ring), otherwise they are made valid so
 * that the run gets past attach. Then the region's bytes (header + data; zeros when the input
 * is shorter). The rest is a program of at most 512 operations, one byte each plus arguments:
 * pop (whole buffer or a small one), wait with no or a 1 µs deadline, push, close a side, and
 * "poke" — the peer writing any value into head, tail, a wait word, a closed flag or any 8
 * bytes of the data area between two calls. A popped payload is parsed with kvt_ring_parse and
 * read in full. Checked (abort = finding): every answer is one of the documented codes, a
 * popped or announced length is within the ring, and a handle that reported a malformed ring
 * keeps doing so. ASan/UBSan see any access outside the region (it is a malloc block of its
 * exact size). Build and run: make fuzz (see the Makefile's fuzz section). */
#include "kvt_error.h"
#include "kvt_ring.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define S_MAX_OPS 512

typedef struct {
    const uint8_t *p;
    size_t n;
} s_in_t;

static uint8_t s_byte(s_in_t *in)
{
    if (!in->n)
        return 0;
    in->n--;
    return *in->p++;
}

static uint64_t s_u64(s_in_t *in)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)s_byte(in) << (8 * i);
    return v;
}

static void s_require(int ok, const char *what, int rc)
{
    if (!ok) {
        fprintf(stderr, "fuzz_ring: %s (rc %d)\n", what, rc);
        abort();
    }
}

static void s_touch(const uint8_t *buf, size_t len)
{
    kvt_ring_frame_t fr[16];
    uint32_t n;
    int rc = kvt_ring_parse(buf, len, fr, 16, &n);
    s_require(rc == 0 || rc == KVT_EBADREQ || rc == KVT_ETOOBIG, "parse answer", rc);
    volatile uint8_t sink = 0;
    for (uint32_t i = 0; rc == 0 && i < n; i++) {
        s_require(fr[i].ptr >= buf && fr[i].ptr + fr[i].len <= buf + len, "frame in buffer", 0);
        if (fr[i].len)
            sink ^= fr[i].ptr[0] ^ fr[i].ptr[fr[i].len - 1];
    }
    (void)sink;
}

static void s_poke(uint8_t *region, uint32_t cap, s_in_t *in)
{
    static const uint32_t offs[] = {KVT_RING_OFF_HEAD,        KVT_RING_OFF_TAIL,
                                    KVT_RING_OFF_PROD_WAIT,   KVT_RING_OFF_CONS_WAIT,
                                    KVT_RING_OFF_PROD_CLOSED, KVT_RING_OFF_CONS_CLOSED,
                                    KVT_RING_OFF_MAGIC,       KVT_RING_OFF_CAPACITY};
    uint8_t f = s_byte(in);
    uint64_t v = s_u64(in);
    if (f & 0x80) { /* 8 bytes anywhere in the data area (8-aligned) */
        uint32_t off = KVT_RING_HDR_SIZE + ((uint32_t)s_byte(in) * 8) % cap;
        memcpy(region + off, &v, 8);
        return;
    }
    uint32_t off = offs[f % (sizeof offs / sizeof offs[0])];
    bool wide = off == KVT_RING_OFF_HEAD || off == KVT_RING_OFF_TAIL || off == KVT_RING_OFF_MAGIC;
    if (f & 0x40) { /* small moves around the current value: the interesting boundary */
        uint64_t cur = 0;
        memcpy(&cur, region + off, wide ? 8 : 4);
        v = cur + (uint64_t)(int64_t)(int8_t)v;
    }
    memcpy(region + off, &v, wide ? 8 : 4);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    uint8_t sel = data[0];
    uint32_t cap = 64u << (sel & 3);
    size_t rsize = kvt_ring_region_size(cap);
    uint8_t *region = malloc(rsize);
    if (!region)
        return 0;
    size_t img = size - 1 < rsize ? size - 1 : rsize;
    memset(region, 0, rsize);
    memcpy(region, data + 1, img);
    if (!(sel & 4)) { /* valid constants: the fuzzer drives indices, words and records */
        uint64_t magic = KVT_RING_MAGIC;
        uint32_t version = KVT_RING_VERSION, hs = KVT_RING_HDR_SIZE;
        memcpy(region + KVT_RING_OFF_MAGIC, &magic, 8);
        memcpy(region + KVT_RING_OFF_VERSION, &version, 4);
        memcpy(region + KVT_RING_OFF_HDR_SIZE, &hs, 4);
        memcpy(region + KVT_RING_OFF_CAPACITY, &cap, 4);
    }
    s_in_t in = {data + 1 + img, size - 1 - img};
    /* whatever the rest is, as a payload, goes through the parser */
    s_touch(in.p, in.n);

    char err[160];
    kvt_ring_t *cons = kvt_ring_new(region, rsize, cap, KVT_RING_CONSUMER, err, sizeof err);
    kvt_ring_t *prod = kvt_ring_new(region, rsize, cap, KVT_RING_PRODUCER, err, sizeof err);
    s_require(!cons == !prod, "both sides attach or neither does", 0);
    if (!cons)
        goto done;
    kvt_ring_set_spin(cons, 16);
    kvt_ring_set_spin(prod, 16);
    size_t maxp = kvt_ring_max_payload(cons);
    uint8_t *buf = malloc(maxp);
    uint8_t frame_bytes[256];
    memset(frame_bytes, 0x5a, sizeof frame_bytes);
    bool cons_broken = false, prod_broken = false;
    for (int op = 0; op < S_MAX_OPS && in.n; op++) {
        uint8_t code = s_byte(&in);
        int rc = 0;
        size_t len = 0;
        switch (code % 8) {
        case 0:
        case 1: {
            size_t bcap = code % 8 == 0 ? maxp : s_byte(&in);
            rc = kvt_ring_pop(cons, buf, bcap, &len);
            s_require(rc == 0 || rc == KVT_EBUSY || rc == KVT_EUNAVAIL || rc == KVT_ETOOBIG ||
                          rc == KVT_EBADREQ,
                      "pop answer", rc);
            if (rc == 0) {
                s_require(len <= bcap && len <= maxp, "popped length", (int)len);
                s_touch(buf, len);
            }
            if (rc == KVT_ETOOBIG)
                s_require(len > bcap && len <= maxp, "announced length", (int)len);
            break;
        }
        case 2:
        case 7:
            rc = kvt_ring_wait(cons, 0, code % 8 == 2 ? 0 : 1000);
            s_require(rc == 0 || rc == KVT_ETIMEDOUT || rc == KVT_EUNAVAIL || rc == KVT_EBADREQ,
                      "consumer wait answer", rc);
            break;
        case 3:
            s_poke(region, cap, &in);
            break;
        case 4: {
            kvt_ring_iov_t f[4];
            uint32_t nf = s_byte(&in) % 5;
            for (uint32_t i = 0; i < nf; i++)
                f[i] = (kvt_ring_iov_t){frame_bytes, s_byte(&in)};
            rc = kvt_ring_push(prod, f, nf);
            s_require(rc == 0 || rc == KVT_EBUSY || rc == KVT_ETOOBIG || rc == KVT_EUNAVAIL ||
                          rc == KVT_EBADREQ,
                      "push answer", rc);
            break;
        }
        case 5:
            rc = kvt_ring_wait(prod, (size_t)s_byte(&in) * 4, 0);
            s_require(rc == 0 || rc == KVT_ETIMEDOUT || rc == KVT_EUNAVAIL || rc == KVT_EBADREQ ||
                          rc == KVT_ETOOBIG,
                      "producer wait answer", rc);
            break;
        case 6:
            kvt_ring_close(s_byte(&in) & 1 ? prod : cons);
            break;
        }
        /* a handle that found the ring malformed refuses it from then on */
        uint8_t c = code % 8;
        bool cons_op = c == 0 || c == 1 || c == 2 || c == 7;
        if (cons_broken)
            s_require(kvt_ring_broken(cons) && (!cons_op || rc == KVT_EBADREQ),
                      "consumer stays broken", rc);
        if (prod_broken)
            s_require(kvt_ring_broken(prod) && ((c != 4 && c != 5) || rc == KVT_EBADREQ),
                      "producer stays broken", rc);
        cons_broken = kvt_ring_broken(cons);
        prod_broken = kvt_ring_broken(prod);
    }
    free(buf);
done:
    kvt_ring_destroy(&cons);
    kvt_ring_destroy(&prod);
    free(region);
    return 0;
}
