/* DESIGN: a czmq zhashx with integer keys: the hasher (XXH3 of the 8 bytes), the comparator and
 * the key duplicator work on uint64_t, so a lookup neither formats nor allocates, and collisions
 * in a bucket are told apart by the comparator on the whole 64-bit key. zhashx keeps a key by
 * pointer, so each entry holds a small copy of its key (8 bytes, freed with the entry). */
#include "kvt_u64map.h"

#include "kvt_log.h"

#include <czmq.h>
#include <stdlib.h>
#include <xxhash.h>

struct kvt_u64map {
    zhashx_t *h;
};

static size_t s_hash(const void *key)
{
    return (size_t)XXH3_64bits(key, sizeof(uint64_t));
}

static int s_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void *s_dup(const void *key)
{
    uint64_t *copy = malloc(sizeof *copy);
    kvt_assert(copy);
    *copy = *(const uint64_t *)key;
    return copy;
}

static void s_free(void **key)
{
    free(*key);
    *key = NULL;
}

kvt_u64map_t *kvt_u64map_new(void)
{
    kvt_u64map_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->h = zhashx_new();
    kvt_assert(self->h);
    zhashx_set_key_hasher(self->h, s_hash);
    zhashx_set_key_comparator(self->h, s_cmp);
    zhashx_set_key_duplicator(self->h, s_dup);
    zhashx_set_key_destructor(self->h, s_free);
    return self;
}

void kvt_u64map_destroy(kvt_u64map_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    zhashx_destroy(&(*self_p)->h);
    free(*self_p);
    *self_p = NULL;
}

void kvt_u64map_set(kvt_u64map_t *self, uint64_t key, void *value)
{
    kvt_assert(value);
    zhashx_update(self->h, &key, value);
}

void *kvt_u64map_get(kvt_u64map_t *self, uint64_t key)
{
    return zhashx_lookup(self->h, &key);
}

void *kvt_u64map_remove(kvt_u64map_t *self, uint64_t key)
{
    void *value = zhashx_lookup(self->h, &key);
    if (value)
        zhashx_delete(self->h, &key);
    return value;
}

size_t kvt_u64map_size(kvt_u64map_t *self)
{
    return zhashx_size(self->h);
}

void *kvt_u64map_first(kvt_u64map_t *self)
{
    return zhashx_first(self->h);
}

void *kvt_u64map_next(kvt_u64map_t *self)
{
    return zhashx_next(self->h);
}
