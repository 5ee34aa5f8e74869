/* kvt_alloc: allocator of byte ranges inside the L1 arena (offsets, not pointers).
 *
 * Two-level segregated fit (TLSF) over 4 KiB pages: allocation and free are O(1), blocks are
 * split on allocation and coalesced with free neighbours on free, so KiB embeddings and tens-of-
 * MiB KV chunks share one arena without size classes wasting space. Block metadata lives outside
 * the arena (clients write into the arena; nothing there is trusted). Thread-safe: one mutex,
 * held for O(1) work (kvt_alloc_stats walks one free list). */
#ifndef KVT_ALLOC_H
#define KVT_ALLOC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVT_PAGE 4096u

typedef struct kvt_alloc kvt_alloc_t;
typedef struct kvt_block kvt_block_t;

typedef struct {
    uint64_t capacity;     /* bytes managed */
    uint64_t used;         /* bytes in allocated blocks (page-rounded) */
    uint64_t free;         /* capacity - used */
    uint64_t largest_free; /* largest single free block */
    uint64_t free_blocks;  /* number of free blocks */
    uint64_t used_blocks;
    double fragmentation; /* 1 - largest_free / free (0 when nothing is free) */
} kvt_alloc_stats_t;

/* Manages [0, capacity) rounded down to whole pages. NULL when capacity < one page. */
kvt_alloc_t *kvt_alloc_new(uint64_t capacity);

/* Frees the metadata; blocks still allocated become invalid. */
void kvt_alloc_destroy(kvt_alloc_t **self_p);

/* A block of at least `bytes` (rounded up to pages), or NULL when no free block is large enough
 * (KVT_ENOSPC for the caller). bytes == 0 is treated as one page. */
kvt_block_t *kvt_alloc_get(kvt_alloc_t *self, uint64_t bytes);

/* The block of exactly [offset, offset + bytes rounded up to pages), taken from the free space
 * that holds it: for adopting an arena whose objects already lie at known offsets. NULL when
 * offset is not page-aligned, the range leaves the arena or any of it is in use. O(1) when
 * claims come in ascending offset order (each starts where the previous left off), a walk of
 * the blocks otherwise. */
kvt_block_t *kvt_alloc_claim(kvt_alloc_t *self, uint64_t offset, uint64_t bytes);

/* Returns a block; it is coalesced with free neighbours. */
void kvt_alloc_put(kvt_alloc_t *self, kvt_block_t *block);

uint64_t kvt_block_offset(const kvt_block_t *block);
uint64_t kvt_block_size(const kvt_block_t *block); /* page-rounded */

/* Bytes currently allocated (cheap: one atomic read). */
uint64_t kvt_alloc_used(const kvt_alloc_t *self);

void kvt_alloc_stats(kvt_alloc_t *self, kvt_alloc_stats_t *out);

/* Walks every block in address order and checks the invariants (no gaps, no overlap, no two
 * adjacent free blocks, free lists consistent, counters right). For tests; 0 or KVT_EINTERNAL. */
int kvt_alloc_check(kvt_alloc_t *self);

#endif
