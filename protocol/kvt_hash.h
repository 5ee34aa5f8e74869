/* kvt_hash: chunk keys of a token sequence (HASH_TOKENS), shared by the daemon and libkvtier so
 * that a client can compute the same keys locally.
 *
 *   prev_0 = 16 zero bytes                      when salt is empty
 *          = XXH128_canonical(XXH3_128(salt))   otherwise
 *   key_i  = XXH128_canonical(XXH3_128(prev_i || chunk_i))      (seed 0)
 *   prev_{i+1} = key_i
 *
 * chunk_i is the i-th run of chunk_tokens tokens as little-endian uint32 bytes; a trailing
 * partial chunk gets no key. Each key depends on every token before it, so equal keys mean
 * equal prefixes. XXH128_canonical is the big-endian byte form (XXH128_canonicalFromHash).
 * Pure functions; any thread. */
#ifndef KVT_HASH_H
#define KVT_HASH_H

#include <stddef.h>
#include <stdint.h>

#define KVT_HASH_KEY_LEN 16

/* Keys of the full chunks of `tokens` (ntoken_bytes / 4 tokens, little-endian uint32). Writes
 * at most `max_keys` keys and returns the number of full chunks (which may be larger: the
 * caller compares). chunk_tokens must be > 0. */
uint32_t kvt_hash_tokens(const uint8_t *token_bytes, size_t ntoken_bytes, uint32_t chunk_tokens,
                         const void *salt, size_t salt_len, uint8_t (*keys)[KVT_HASH_KEY_LEN],
                         uint32_t max_keys);

#endif
