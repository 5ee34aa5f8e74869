/* kvt_u64map: a hash map from uint64 ids (leases, prefetch jobs, owners) to pointers the caller
 * owns. Ids are hashed and compared as integers: no formatting to strings on the way in.
 * Iteration order is unspecified. Not thread-safe: the owner's lock guards it. */
#ifndef KVT_U64MAP_H
#define KVT_U64MAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvt_u64map kvt_u64map_t;

kvt_u64map_t *kvt_u64map_new(void);

/* Frees the map; the values stay the caller's. */
void kvt_u64map_destroy(kvt_u64map_t **self_p);

/* Puts `value` (not NULL) under `key`, replacing what was there. */
void kvt_u64map_set(kvt_u64map_t *self, uint64_t key, void *value);

/* The value under `key`, NULL when there is none. */
void *kvt_u64map_get(kvt_u64map_t *self, uint64_t key);

/* Takes `key` out of the map; returns its value, NULL when there was none. */
void *kvt_u64map_remove(kvt_u64map_t *self, uint64_t key);

size_t kvt_u64map_size(kvt_u64map_t *self);

/* Iteration over the values (in no given order); the map must not change meanwhile. */
void *kvt_u64map_first(kvt_u64map_t *self);
void *kvt_u64map_next(kvt_u64map_t *self);

#endif
