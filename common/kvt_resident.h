/* kvt_resident: the residency map, which (namespace, key) pairs are READY in L1, as a table
 * of 64-bit tags in shared memory that the daemon writes and each fast-path client maps
 * read-only. A client learns that a whole batch of keys is in L1 without a round trip
 * (SGLang's batch_exists before every prefetch), where waking the daemon costs more than the
 * answer on a busy or small machine (docs/performance.md, "SGLang backend").
 *
 * Advisory in one direction only: a tag found means its key was READY a moment ago (a later
 * ACQUIRE may still miss it, as after any LOOKUP); a tag not found means nothing (the key may
 * be in L2, or the map was full): the client asks the daemon (LOOKUP).
 *
 * Layout (docs/protocol.md "Residency map"): a 128-byte header, then `slots` u64 tags (a power
 * of two). A tag is never 0 (an empty slot) or 1 (reserved); a key's tag sits within
 * KVT_RES_WINDOW slots of (tag & (slots - 1)), wrapping.
 *
 * Writer: the daemon's L1 (kvt_l1), under the key's shard lock so one key's changes land in
 * order; any thread, the map's own mutex (a leaf). Readers: any thread of any process,
 * lock-free, through a read-only mapping of a sealed memfd. */
#ifndef KVT_RESIDENT_H
#define KVT_RESIDENT_H

#include "kvt_key.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVT_RES_MAGIC 0x313053455254564bull /* "KVTRES01" as little-endian bytes */
#define KVT_RES_VERSION 1u
#define KVT_RES_HDR_SIZE 128u
#define KVT_RES_WINDOW 16u /* slots a tag may sit past its home slot */
#define KVT_RES_MIN_SLOTS 1024u
#define KVT_RES_MAX_SLOTS (1u << 27) /* 1 GiB of tags */

/* Byte offsets of the header's fields. */
#define KVT_RES_OFF_MAGIC 0u
#define KVT_RES_OFF_VERSION 8u   /* u32 */
#define KVT_RES_OFF_HDR_SIZE 12u /* u32 */
#define KVT_RES_OFF_SLOTS 16u    /* u32 */
#define KVT_RES_OFF_WINDOW 20u   /* u32 */
#define KVT_RES_OFF_SEED 24u     /* u64: the daemon's, per run */
#define KVT_RES_OFF_BEAT 32u     /* u64: CLOCK_MONOTONIC ns of the daemon's last beat; 0: closed */
#define KVT_RES_STALE_NS 1000000000ull /* a map whose beat is older is not believed */

/* ---- both sides ---- */

/* Bytes of a map of `slots` slots (before page rounding). */
size_t kvt_resident_region_size(uint32_t slots);

/* The namespace part of a tag: computed once per namespace (name, then salt). */
uint64_t kvt_resident_ns_hash(uint64_t seed, const kvt_ns_t *ns);

/* A key's tag in namespace `nsh` (never 0 or 1). */
uint64_t kvt_resident_tag(uint64_t nsh, const kvt_key_t *key);

/* ---- the reader (clients) ---- */

typedef struct {
    const uint64_t *slots;
    const uint64_t *beat;
    uint64_t mask;
    uint64_t seed;
    uint32_t window;
} kvt_resident_view_t;

/* Checks the header of a mapped region of `size` bytes and fills *v. 0, or KVT_EINVAL with a
 * sentence in why. */
int kvt_resident_view(const void *region, size_t size, kvt_resident_view_t *v, char *why,
                      size_t whylen);

/* Whether the daemon still keeps the map: it beat within KVT_RES_STALE_NS (a daemon killed,
 * stopped or wedged stops beating; one that stopped cleanly closed it). Answers from a map
 * that is not fresh are not to be believed. */
bool kvt_resident_fresh(const kvt_resident_view_t *v);

/* How many of keys[0..n) lead the batch in L1 according to the map (stops at the first not
 * found). */
uint32_t kvt_resident_prefix(const kvt_resident_view_t *v, const kvt_ns_t *ns,
                             const kvt_key_t *keys, uint32_t n);

/* ---- the writer (the daemon) ---- */

typedef struct kvt_resident kvt_resident_t;

/* A map of `slots` (rounded up to a power of two within [KVT_RES_MIN_SLOTS,
 * KVT_RES_MAX_SLOTS]) in a sealed memfd (no one can resize it; no one can map it writable
 * after us) with a random seed. NULL with a sentence in err. */
kvt_resident_t *kvt_resident_new(uint32_t slots, char *err, size_t errlen);

/* Accepts NULL. */
void kvt_resident_destroy(kvt_resident_t **self_p);

uint64_t kvt_resident_seed(const kvt_resident_t *self);

/* The memfd (ours; the handoff sends a duplicate) and the bytes to map. */
int kvt_resident_fd(const kvt_resident_t *self);
size_t kvt_resident_size(const kvt_resident_t *self);

/* Says the daemon keeps the map (the L1's evictor, every tick). kvt_resident_close says it
 * no longer does (at stop). */
void kvt_resident_beat(kvt_resident_t *self);
void kvt_resident_close(kvt_resident_t *self);

/* Adds or deletes the tag of `key` (kvt_resident_tag). A tag that finds no free slot in its
 * window is left out (counted: `full`). Deleting shifts the tags after it back towards
 * their home slots (readers meanwhile may miss a moving tag: they then ask the daemon). */
void kvt_resident_add(kvt_resident_t *self, uint64_t tag);
void kvt_resident_del(kvt_resident_t *self, uint64_t tag);

typedef struct {
    uint64_t slots, entries, full;
} kvt_resident_stats_t;

void kvt_resident_stats(kvt_resident_t *self, kvt_resident_stats_t *out);

#endif
