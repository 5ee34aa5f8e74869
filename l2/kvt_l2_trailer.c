/* DESIGN: the L2 integrity trailer (see kvt_l2_trailer.h for the layout and why it trails).
 * XXH3-64 rather than XXH3-128: the checks are against accidents (a flipped bit, a torn or
 * truncated file, a value overwritten in a shared Redis), for which 64 bits leave a 2^-64 chance
 * per damaged object; it runs at the same speed as XXH3-128 here (docs/performance.md), takes
 * 8 bytes instead of 16 in each L1 index entry when l1_checksum keeps it there, and is the hash
 * the daemon already uses for names. Neither is a defence against a party that can write the
 * backend on purpose: it can write a matching trailer too. Pure functions; any thread. */
#include "kvt_l2_trailer.h"

#include "kvt_le.h"

#include <string.h>
#include <xxhash.h>

static const uint8_t s_magic[4] = {'K', 'V', 'T', 'L'};

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
    kvt_le_put16(out + 4, KVT_L2_TRAILER_VERSION);
    kvt_le_put16(out + 6, KVT_L2_TRAILER_LEN);
    kvt_le_put64(out + 8, payload_len);
    kvt_le_put64(out + 16, payload_sum);
    kvt_le_put64(out + 24, XXH3_64bits(name, strlen(name)));
    kvt_le_put64(out + 32, XXH3_64bits(out, 32));
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
    if (kvt_le_get16(t + 4) > KVT_L2_TRAILER_VERSION)
        return KVT_L2_V_NEWER;
    if (kvt_le_get16(t + 4) != KVT_L2_TRAILER_VERSION ||
        kvt_le_get16(t + 6) != KVT_L2_TRAILER_LEN || kvt_le_get64(t + 32) != XXH3_64bits(t, 32))
        return KVT_L2_V_TRAILER;
    if (kvt_le_get64(t + 8) != object_len - KVT_L2_TRAILER_LEN)
        return KVT_L2_V_LENGTH;
    if (kvt_le_get64(t + 24) != XXH3_64bits(name, strlen(name)))
        return KVT_L2_V_NAME;
    *payload_sum = kvt_le_get64(t + 16);
    return KVT_L2_V_OK;
}
