/* DESIGN: TLSF over page counts. Every block (free or used) is in the address-ordered list
 * (phys_prev/phys_next); free blocks are also in one of FL x SL segregated lists, found through
 * two bitmap levels, so get and put are O(1). The first level is floor(log2(pages)), the second
 * splits each power of two into 16 ranges. A search rounds the request up to the next range
 * boundary so any block of the chosen list fits (good-fit, no list walk). One mutex guards
 * everything; `used` is also an atomic so the hot path can read usage without the lock. */
#include "kvt_alloc.h"

#include "kvt_error.h"
#include "kvt_log.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#define S_SL_LOG 4
#define S_SL (1u << S_SL_LOG)
#define S_FL 40

struct kvt_block {
    uint64_t page;  /* first page */
    uint64_t pages; /* length in pages */
    kvt_block_t *phys_prev, *phys_next;
    kvt_block_t *free_prev, *free_next;
    bool is_free;
};

struct kvt_alloc {
    pthread_mutex_t lock;
    uint64_t pages;
    _Atomic uint64_t used_pages;
    uint64_t free_blocks, used_blocks;
    uint64_t fl_bitmap;
    uint32_t sl_bitmap[S_FL];
    kvt_block_t *heads[S_FL][S_SL];
    kvt_block_t *first; /* lowest address */
    kvt_block_t *hint;  /* where the last claim left off (a free block, or NULL) */
};

static int s_msb(uint64_t v)
{
    return 63 - __builtin_clzll(v);
}

static void s_mapping(uint64_t pages, int *fl, int *sl)
{
    if (pages < S_SL) {
        *fl = 0;
        *sl = (int)pages;
        return;
    }
    int m = s_msb(pages);
    *fl = m - S_SL_LOG + 1;
    *sl = (int)((pages >> (m - S_SL_LOG)) ^ S_SL);
}

static void s_free_insert(kvt_alloc_t *a, kvt_block_t *b)
{
    int fl, sl;
    s_mapping(b->pages, &fl, &sl);
    b->free_prev = NULL;
    b->free_next = a->heads[fl][sl];
    if (b->free_next)
        b->free_next->free_prev = b;
    a->heads[fl][sl] = b;
    a->fl_bitmap |= 1ull << fl;
    a->sl_bitmap[fl] |= 1u << sl;
    b->is_free = true;
    a->free_blocks++;
}

static void s_free_remove(kvt_alloc_t *a, kvt_block_t *b)
{
    int fl, sl;
    s_mapping(b->pages, &fl, &sl);
    if (b->free_prev)
        b->free_prev->free_next = b->free_next;
    else
        a->heads[fl][sl] = b->free_next;
    if (b->free_next)
        b->free_next->free_prev = b->free_prev;
    if (!a->heads[fl][sl]) {
        a->sl_bitmap[fl] &= ~(1u << sl);
        if (!a->sl_bitmap[fl])
            a->fl_bitmap &= ~(1ull << fl);
    }
    b->free_prev = b->free_next = NULL;
    b->is_free = false;
    a->free_blocks--;
}

/* The rounded search skips the request's own size range, whose blocks may or may not fit;
 * when nothing larger is free, look there before giving up (an exact fit must not fail). */
static kvt_block_t *s_find_in_own_class(kvt_alloc_t *a, uint64_t pages)
{
    int fl, sl;
    s_mapping(pages, &fl, &sl);
    if (fl >= S_FL)
        return NULL;
    for (kvt_block_t *b = a->heads[fl][sl]; b; b = b->free_next)
        if (b->pages >= pages)
            return b;
    return NULL;
}

/* A free block with at least `pages` pages, or NULL. */
static kvt_block_t *s_find(kvt_alloc_t *a, uint64_t pages)
{
    uint64_t want = pages;
    if (want >= S_SL) {
        uint64_t round = (1ull << (s_msb(want) - S_SL_LOG)) - 1;
        if (want + round < want)
            return NULL;
        want += round;
    }
    int fl, sl;
    s_mapping(want, &fl, &sl);
    uint32_t sl_map = fl < S_FL ? a->sl_bitmap[fl] & (~0u << sl) : 0;
    if (!sl_map) {
        uint64_t fl_map = fl + 1 < S_FL ? a->fl_bitmap & (~0ull << (fl + 1)) : 0;
        if (!fl_map)
            return s_find_in_own_class(a, pages);
        fl = __builtin_ctzll(fl_map);
        sl_map = a->sl_bitmap[fl];
    }
    sl = __builtin_ctz(sl_map);
    kvt_block_t *b = a->heads[fl][sl];
    kvt_assert(b && b->pages >= pages);
    return b;
}

kvt_alloc_t *kvt_alloc_new(uint64_t capacity)
{
    uint64_t pages = capacity / KVT_PAGE;
    if (pages == 0)
        return NULL;
    kvt_alloc_t *a = calloc(1, sizeof *a);
    kvt_block_t *b = calloc(1, sizeof *b);
    kvt_assert(a && b);
    pthread_mutex_init(&a->lock, NULL);
    a->pages = pages;
    b->pages = pages;
    a->first = b;
    s_free_insert(a, b);
    return a;
}

void kvt_alloc_destroy(kvt_alloc_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_alloc_t *a = *self_p;
    for (kvt_block_t *b = a->first, *next; b; b = next) {
        next = b->phys_next;
        free(b);
    }
    pthread_mutex_destroy(&a->lock);
    free(a);
    *self_p = NULL;
}

kvt_block_t *kvt_alloc_get(kvt_alloc_t *a, uint64_t bytes)
{
    uint64_t pages = bytes ? (bytes + KVT_PAGE - 1) / KVT_PAGE : 1;
    if (pages > a->pages || bytes > UINT64_MAX - KVT_PAGE)
        return NULL;
    kvt_block_t *rest = calloc(1, sizeof *rest); /* outside the lock; freed when not needed */
    if (!rest)
        return NULL;
    pthread_mutex_lock(&a->lock);
    a->hint = NULL; /* blocks split or merged from here on: claims walk from the start */
    kvt_block_t *b = s_find(a, pages);
    if (b) {
        s_free_remove(a, b);
        if (b->pages > pages) {
            rest->page = b->page + pages;
            rest->pages = b->pages - pages;
            rest->phys_prev = b;
            rest->phys_next = b->phys_next;
            if (b->phys_next)
                b->phys_next->phys_prev = rest;
            b->phys_next = rest;
            b->pages = pages;
            s_free_insert(a, rest);
            rest = NULL;
        }
        a->used_blocks++;
        atomic_fetch_add_explicit(&a->used_pages, pages, memory_order_relaxed);
    }
    pthread_mutex_unlock(&a->lock);
    free(rest);
    return b;
}

/* A free block split at `page` (inside it): the part from `page` on, linked after `b` and free;
 * `b` keeps the part before. NULL when out of memory. */
static kvt_block_t *s_split_free(kvt_alloc_t *a, kvt_block_t *b, uint64_t page)
{
    kvt_block_t *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    s_free_remove(a, b);
    r->page = page;
    r->pages = b->page + b->pages - page;
    b->pages = page - b->page;
    r->phys_prev = b;
    r->phys_next = b->phys_next;
    if (b->phys_next)
        b->phys_next->phys_prev = r;
    b->phys_next = r;
    s_free_insert(a, b);
    s_free_insert(a, r);
    return r;
}

kvt_block_t *kvt_alloc_claim(kvt_alloc_t *a, uint64_t offset, uint64_t bytes)
{
    uint64_t pages = bytes ? (bytes + KVT_PAGE - 1) / KVT_PAGE : 1;
    if (offset % KVT_PAGE || bytes > UINT64_MAX - KVT_PAGE)
        return NULL;
    uint64_t page = offset / KVT_PAGE;
    if (page >= a->pages || pages > a->pages - page)
        return NULL;
    pthread_mutex_lock(&a->lock);
    kvt_block_t *b = a->hint && a->hint->page <= page ? a->hint : a->first;
    while (b && b->page + b->pages <= page)
        b = b->phys_next;
    if (!b || !b->is_free || b->page + b->pages < page + pages) {
        pthread_mutex_unlock(&a->lock);
        return NULL;
    }
    if (b->page < page && !(b = s_split_free(a, b, page))) {
        pthread_mutex_unlock(&a->lock);
        return NULL;
    }
    kvt_block_t *rest = b->pages > pages ? s_split_free(a, b, page + pages) : NULL;
    if (b->pages > pages && !rest) {
        pthread_mutex_unlock(&a->lock);
        return NULL;
    }
    s_free_remove(a, b);
    a->hint = rest;
    a->used_blocks++;
    atomic_fetch_add_explicit(&a->used_pages, pages, memory_order_relaxed);
    pthread_mutex_unlock(&a->lock);
    return b;
}

void kvt_alloc_put(kvt_alloc_t *a, kvt_block_t *b)
{
    kvt_block_t *garbage[2] = {NULL, NULL};
    pthread_mutex_lock(&a->lock);
    a->hint = NULL;
    kvt_assert(!b->is_free);
    atomic_fetch_sub_explicit(&a->used_pages, b->pages, memory_order_relaxed);
    a->used_blocks--;
    kvt_block_t *prev = b->phys_prev, *next = b->phys_next;
    if (next && next->is_free) {
        s_free_remove(a, next);
        b->pages += next->pages;
        b->phys_next = next->phys_next;
        if (next->phys_next)
            next->phys_next->phys_prev = b;
        garbage[0] = next;
    }
    if (prev && prev->is_free) {
        s_free_remove(a, prev);
        prev->pages += b->pages;
        prev->phys_next = b->phys_next;
        if (b->phys_next)
            b->phys_next->phys_prev = prev;
        garbage[1] = b;
        b = prev;
    }
    s_free_insert(a, b);
    pthread_mutex_unlock(&a->lock);
    free(garbage[0]);
    free(garbage[1]);
}

uint64_t kvt_block_offset(const kvt_block_t *b)
{
    return b->page * KVT_PAGE;
}

uint64_t kvt_block_size(const kvt_block_t *b)
{
    return b->pages * KVT_PAGE;
}

uint64_t kvt_alloc_used(const kvt_alloc_t *a)
{
    return atomic_load_explicit(&((kvt_alloc_t *)a)->used_pages, memory_order_relaxed) *
           KVT_PAGE;
}

void kvt_alloc_stats(kvt_alloc_t *a, kvt_alloc_stats_t *out)
{
    pthread_mutex_lock(&a->lock);
    uint64_t used = atomic_load(&a->used_pages);
    uint64_t largest = 0;
    if (a->fl_bitmap) {
        int fl = s_msb(a->fl_bitmap);
        int sl = 31 - __builtin_clz(a->sl_bitmap[fl]);
        for (kvt_block_t *b = a->heads[fl][sl]; b; b = b->free_next)
            if (b->pages > largest)
                largest = b->pages;
    }
    out->capacity = a->pages * KVT_PAGE;
    out->used = used * KVT_PAGE;
    out->free = (a->pages - used) * KVT_PAGE;
    out->largest_free = largest * KVT_PAGE;
    out->free_blocks = a->free_blocks;
    out->used_blocks = a->used_blocks;
    pthread_mutex_unlock(&a->lock);
    out->fragmentation =
        out->free ? 1.0 - (double)out->largest_free / (double)out->free : 0.0;
}

int kvt_alloc_check(kvt_alloc_t *a)
{
    int rc = 0;
    pthread_mutex_lock(&a->lock);
    uint64_t page = 0, used = 0, nfree = 0, nused = 0;
    kvt_block_t *prev = NULL;
    for (kvt_block_t *b = a->first; b; prev = b, b = b->phys_next) {
        if (b->page != page || b->pages == 0 || b->phys_prev != prev)
            rc = KVT_EINTERNAL;
        if (prev && prev->is_free && b->is_free)
            rc = KVT_EINTERNAL; /* missed coalescing */
        if (b->is_free) {
            nfree++;
            int fl, sl;
            s_mapping(b->pages, &fl, &sl);
            bool listed = false;
            for (kvt_block_t *f = a->heads[fl][sl]; f; f = f->free_next)
                listed |= f == b;
            if (!listed)
                rc = KVT_EINTERNAL;
        } else {
            nused++;
            used += b->pages;
        }
        page += b->pages;
    }
    if (page != a->pages || used != atomic_load(&a->used_pages) || nfree != a->free_blocks ||
        nused != a->used_blocks)
        rc = KVT_EINTERNAL;
    pthread_mutex_unlock(&a->lock);
    return rc;
}
