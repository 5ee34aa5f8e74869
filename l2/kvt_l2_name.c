/* DESIGN: kvt_l2_name, the one place that turns (ns, salt, key) into the object name every L2
 * adapter stores under. The namespace part is a hash so that names have a fixed length whatever
 * the ns and salt (up to 256 + 128 bytes on the wire) and are safe as file names and Redis keys;
 * ns_len is hashed first (little-endian) so that ("ab", "c") and ("a", "bc") differ. The key is
 * already a 128-bit hash and is printed as is, so an operator can find a key's object by eye.
 * Pure function; any thread. */
#include "kvt_l2_name.h"

#include "kvt_log.h"

#include <string.h>
#include <xxhash.h>

/* Up to this many hashed bytes are hashed from a stack buffer in one call; longer inputs (not
 * produced by protocol v1, whose ns and salt are bounded) are streamed. */
#define S_STACK_BYTES 512

static void s_hex(const uint8_t *bytes, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[bytes[i] >> 4];
        out[2 * i + 1] = digits[bytes[i] & 15];
    }
}

void kvt_l2_name(const kvt_ns_t *n, const kvt_key_t *key, char out[KVT_L2_NAME_LEN])
{
    const uint8_t *ns = n->name, *salt = n->salt;
    uint32_t ns_len = n->name_len, salt_len = n->salt_len;
    const uint8_t le[4] = {(uint8_t)ns_len, (uint8_t)(ns_len >> 8), (uint8_t)(ns_len >> 16),
                           (uint8_t)(ns_len >> 24)};
    XXH128_hash_t h;
    if ((size_t)ns_len + salt_len <= S_STACK_BYTES - sizeof le) {
        uint8_t buf[S_STACK_BYTES];
        memcpy(buf, le, sizeof le);
        if (ns_len)
            memcpy(buf + sizeof le, ns, ns_len);
        if (salt_len)
            memcpy(buf + sizeof le + ns_len, salt, salt_len);
        h = XXH3_128bits(buf, sizeof le + ns_len + salt_len);
    } else {
        /* A small bookkeeping allocation: aborting on OOM is allowed here (STYLE 4). */
        XXH3_state_t *st = XXH3_createState();
        kvt_assert(st != NULL);
        XXH3_128bits_reset(st);
        XXH3_128bits_update(st, le, sizeof le);
        XXH3_128bits_update(st, ns, ns_len);
        XXH3_128bits_update(st, salt, salt_len);
        h = XXH3_128bits_digest(st);
        XXH3_freeState(st);
    }
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, h);
    s_hex(c.digest, sizeof c.digest, out);
    out[32] = '-';
    s_hex(key->b, KVT_KEY_LEN, out + 33);
    out[65] = '\0';
}
