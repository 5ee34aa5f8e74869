/* kvt_l2_trailer: the integrity trailer the daemon appends to every object it stores in L2, and
 * checks on every load (issue #13: corrupt L2 bytes are never served).
 *
 * An L2 object is `payload || trailer`. The trailer is 40 bytes, little-endian:
 *   0  magic        "KVTL"
 *   4  version      u16 = KVT_L2_TRAILER_VERSION
 *   6  trailer_len  u16 = KVT_L2_TRAILER_LEN
 *   8  payload_len  u64
 *  16  payload_sum  u64  XXH3-64 of the payload (seed 0: the same value l1_checksum keeps)
 *  24  name_sum     u64  XXH3-64 of the object's name: a copy filed under another name is caught
 *  32  trailer_sum  u64  XXH3-64 of bytes 0..31, so a damaged trailer is told from a damaged
 *                        payload
 * A trailer rather than a header: the payload then starts at offset 0 of the object, so the fs
 * adapter keeps reading and writing it straight from and to the 4 KiB-aligned L1 arena with
 * O_DIRECT. Objects written before the trailer existed end in payload bytes: "no trailer".
 * Pure functions; any thread. */
#ifndef KVT_L2_TRAILER_H
#define KVT_L2_TRAILER_H

#include <stdint.h>

#define KVT_L2_TRAILER_LEN 40
#define KVT_L2_TRAILER_VERSION 1

/* What a check found (X-macro: name, text for the log). */
#define KVT_L2_VERDICTS(XX)                                                                        \
    XX(OK, "intact")                                                                               \
    XX(SHORT, "too short to hold a trailer")                                                       \
    XX(NO_TRAILER, "no kvtier trailer (written by an earlier kvtier, or not by kvtier)")           \
    XX(NEWER, "written in a newer object format")                                                  \
    XX(TRAILER, "trailer damaged")                                                                 \
    XX(LENGTH, "length differs from the one its trailer records (truncated or extended)")          \
    XX(NAME, "trailer of another object")                                                          \
    XX(CHECKSUM, "payload checksum mismatch")

typedef enum {
#define KVT_XX(name, text) KVT_L2_V_##name,
    KVT_L2_VERDICTS(KVT_XX)
#undef KVT_XX
} kvt_l2_verdict_t;

/* The sentence of a verdict, for the log; never NULL. */
const char *kvt_l2_verdict_str(kvt_l2_verdict_t v);

/* Writes the trailer of a payload of `payload_len` bytes whose XXH3-64 is `payload_sum`,
 * stored under `name`. */
void kvt_l2_trailer_make(uint8_t out[KVT_L2_TRAILER_LEN], const char *name, uint64_t payload_len,
                         uint64_t payload_sum);

/* Checks the trailer `t` of an object of `object_len` bytes (payload + trailer) read under
 * `name`. On KVT_L2_V_OK, *payload_sum is the checksum the payload must have; the caller hashes
 * the payload and compares (a mismatch is KVT_L2_V_CHECKSUM). */
kvt_l2_verdict_t kvt_l2_trailer_check(const uint8_t t[KVT_L2_TRAILER_LEN], const char *name,
                                      uint64_t object_len, uint64_t *payload_sum);

#endif
