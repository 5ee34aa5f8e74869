/* DESIGN: XXH3-128 over (previous key || chunk bytes), streamed so that no chunk is copied. */
#include "kvt_hash.h"

#include <string.h>
#include <xxhash.h>

uint32_t kvt_hash_tokens(const uint8_t *token_bytes, size_t ntoken_bytes, uint32_t chunk_tokens,
                         const void *salt, size_t salt_len, uint8_t (*keys)[KVT_HASH_KEY_LEN],
                         uint32_t max_keys)
{
    size_t chunk_bytes = (size_t)chunk_tokens * 4u;
    size_t nchunks = chunk_bytes ? ntoken_bytes / chunk_bytes : 0;
    uint8_t prev[KVT_HASH_KEY_LEN] = {0};
    if (salt_len) {
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits(salt, salt_len));
        memcpy(prev, c.digest, sizeof prev);
    }
    XXH3_state_t *st = XXH3_createState();
    if (!st)
        return 0;
    for (size_t i = 0; i < nchunks && i < max_keys; i++) {
        XXH3_128bits_reset(st);
        XXH3_128bits_update(st, prev, sizeof prev);
        XXH3_128bits_update(st, token_bytes + i * chunk_bytes, chunk_bytes);
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits_digest(st));
        memcpy(keys[i], c.digest, KVT_HASH_KEY_LEN);
        memcpy(prev, c.digest, sizeof prev);
    }
    XXH3_freeState(st);
    return nchunks > UINT32_MAX ? UINT32_MAX : (uint32_t)nchunks;
}
