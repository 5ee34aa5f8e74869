/* DESIGN: the L2 integrity trailer (see kvt_l2_trailer.h for the layout and why it trails).
 * XXH3-64 rather than XXH3-128: the checks are against accidents (a flipped bit, a torn or
 * truncated file, a value overwritten in a shared Redis), for which 64 bits leave a 2^-64 chance
 * per damaged object; it runs at the same speed as XXH3-128 here (docs/performance.md), takes
 * 8 bytes instead of 16 in each L1 index entry when l1_checksum keeps it there, and is the hash
 * the daemon already uses for names. Neither is a defence against a party that can write the
 * backend on purpose: it can write a matching trailer too. Pure functions; any thread. */
#include "kvt_l2_trailer.h"

#include <string.h>
#include <xxhash.h>

static const uint8_t s_magic[4] = {'K', 'V', 'T', 'L'};

static void s_put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void s_put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t s_get16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

static uint64_t s_get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

const char *kvt_l2_verdict_str(kvt_l2_verdict_t v)
{
    static const char *const text[] = {
#define KVT_XX(name, t) t,
        KVT_L2_VERDICTS(KVT_XX)
#undef KVT_XX
    };
    return (unsigned)v < sizeof text / sizeof text[0] ? text[v] : "unknown verdict";
}

void kvt_l2_trailer_make(uint8_t out[KVT_L2_TRAILER_LEN], const char *name, uint64_t payload_len,
                         uint64_t payload_sum)
{
    memcpy(out, s_magic, sizeof s_magic);
    s_put16(out + 4, KVT_L2_TRAILER_VERSION);
    s_put16(out + 6, KVT_L2_TRAILER_LEN);
    s_put64(out + 8, payload_len);
    s_put64(out + 16, payload_sum);
    s_put64(out + 24, XXH3_64bits(name, strlen(name)));
    s_put64(out + 32, XXH3_64bits(out, 32));
}

kvt_l2_verdict_t kvt_l2_trailer_check(const uint8_t t[KVT_L2_TRAILER_LEN], const char *name,
                                      uint64_t object_len, uint64_t *payload_sum)
{
    if (object_len < KVT_L2_TRAILER_LEN)
        return KVT_L2_V_SHORT;
    if (memcmp(t, s_magic, sizeof s_magic) != 0)
        return KVT_L2_V_NO_TRAILER;
    /* the version is read before the trailer's own checksum: a newer format may lay out (and
     * checksum) the rest differently */
    if (s_get16(t + 4) > KVT_L2_TRAILER_VERSION)
        return KVT_L2_V_NEWER;
    if (s_get16(t + 4) != KVT_L2_TRAILER_VERSION || s_get16(t + 6) != KVT_L2_TRAILER_LEN ||
        s_get64(t + 32) != XXH3_64bits(t, 32))
        return KVT_L2_V_TRAILER;
    if (s_get64(t + 8) != object_len - KVT_L2_TRAILER_LEN)
        return KVT_L2_V_LENGTH;
    if (s_get64(t + 24) != XXH3_64bits(name, strlen(name)))
        return KVT_L2_V_NAME;
    *payload_sum = s_get64(t + 16);
    return KVT_L2_V_OK;
}
