/* DESIGN: the L1 manager. Objects live in a striped hash index (64 shards, a mutex each, chained
 * buckets that double when full); READY objects are also on one LRU list (head = most recent).
 * Namespaces (ns + salt) are interned and reference-counted, so an object compares its
 * namespace by pointer and CLEAR of one ns matches names exactly.
 *
 * Lock order: shard -> LRU. The allocator, lease table and namespace table locks are leaves and
 * are never held while taking another. Eviction holds the LRU lock and only try-locks shards
 * (a busy shard's object is skipped this round), so it cannot deadlock with the normal order.
 * An object's state and pin count are guarded by its shard's lock.
 *
 * Ownership: a RESERVED object belongs to its write lease (nothing else can reach it: readers,
 * REMOVE, CLEAR and eviction only act on READY objects). A READY object belongs to the index;
 * removal unlinks it from the index and the LRU under its shard lock, and whoever unlinks it
 * frees it — unless it is pinned, in which case it becomes DOOMED and the last unpin frees it.
 *
 * max_leased_bytes: each client owner's leases charge its byte account in the lease table (the
 * object sizes rounded up to pages, key by key, before the block is allocated or the object
 * pinned), and settling a lease — COMMIT, RELEASE, expiry, BYE — gives them back. A request
 * stops at the first key that would pass the limit: the prefix before it is answered, and
 * no_space when that prefix is empty (as for a full L1). The daemon's own leases are not
 * counted.
 *
 * l1_checksum: COMMIT stores the XXH3-64 of each object in its index entry (outside every lock:
 * the object is still RESERVED, ours alone; a prefetch load brings the checksum it verified
 * against the L2 trailer). GET (kvt_l1_verify) and write-behind (kvt_l1_check_sum) hash the
 * bytes again under their own read pin; an object that differs was written after its COMMIT —
 * by a client whose lease had ended, into space that went to another object — and is removed
 * from the index instead of being served or written to L2.
 *
 * l1.adopt (issue 30): the journal (kvt_journal) mirrors the index — a PUT for each committed
 * object, written while it is still RESERVED (so no DROP can precede it), a DROP when it leaves
 * (removal, CLEAR, eviction, truncation), written before its block can be reused, and a SUM
 * from the summer thread for objects COMMIT did not checksum. At start the objects the journal
 * names are verified against their checksums and claimed in the allocator (kvt_alloc_claim),
 * then a new journal is begun holding what was adopted; nothing in the arena itself is
 * believed. Objects not yet summed when the process died are left out. */
#include "kvt_l1.h"

#include "kvt_alloc.h"
#include "kvt_arena.h"
#include "kvt_error.h"
#include "kvt_journal.h"
#include "kvt_lease.h"
#include "kvt_log.h"
#include "kvt_queue.h"
#include "kvt_resident.h"
#include "kvt_thread.h"
#include "kvt_utf8.h"

#include <czmq.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define S_SHARD_BITS 6
#define S_SHARDS (1u << S_SHARD_BITS)
#define S_BUCKETS0 1024u
#define S_EVICT_TICK_MS 50
#define S_JOURNAL "kvtier-l1.journal"
#define S_SUM_QUEUE 65536          /* objects waiting for the summer; past it: not adoptable */
#define S_JOURNAL_MAX (4ull << 30) /* a journal larger than this is not read (damage) */
/* compaction: once past debug.journal_compact_bytes and four times this per object */
#define S_RECORD_EST 160u

enum { S_RESERVED = 1, S_READY = 2, S_DOOMED = 3 };

/* An interned namespace; `key` views its own bytes and is also the ns table key. */
typedef struct {
    kvt_ns_t key; /* first: the hash table key points here */
    uint64_t hash;
    uint64_t rhash; /* its part of a residency tag (kvt_resident_ns_hash) */
    uint64_t refs; /* objects + requests in flight; under ns_lock */
    uint8_t bytes[];
} s_ns_t;

typedef struct s_obj {
    kvt_key_t key;
    uint8_t state;
    bool in_lru;
    uint8_t l2_pending; /* adapters that have not written it yet: not evictable until 0 */
    bool has_sum;       /* l1_checksum: `sum` is the XXH3-64 of the bytes at COMMIT */
    bool owed_l2;       /* adopted while still owed to L2: queued again at kvt_l1_start */
    bool jsummed;       /* `sum` is the one journaled for it (the summer's, or adopted) */
    bool unverified;    /* adopted, its bytes not yet checked against `sum`: never served so */
    uint32_t pins;
    uint64_t jseq; /* its seq in the journal (0: not journaled) */
    uint64_t sum;
    uint64_t hash;
    uint64_t length;
    s_ns_t *ns;
    uint8_t *label; /* RESERVE/PUT `labels`: [0] its length (1..255), then its bytes; or NULL */
    kvt_block_t *block;
    struct s_obj *hnext;
    struct s_obj *lru_prev, *lru_next;
} s_obj_t;

typedef struct {
    pthread_mutex_t lock;
    s_obj_t **buckets;
    uint32_t nbuckets;
    uint32_t count;
} s_shard_t;

struct kvt_l1 {
    const kvt_config_t *cfg;
    kvt_arena_t *arena;
    kvt_alloc_t *alloc;
    kvt_leases_t *leases;
    s_shard_t shards[S_SHARDS];
    pthread_mutex_t lru_lock;
    s_obj_t *lru_head, *lru_tail;
    pthread_mutex_t ns_lock;
    zhashx_t *ns_table;
    uint64_t capacity, high_bytes, low_bytes;
    _Atomic uint64_t objects, reserved, evictions, evicted_bytes, corrupt;
    _Atomic uint64_t truncations; /* the arena file found cut short by another process */
    /* eviction controller: woken through a queue of one token (a full queue is a wake-up
     * already pending, so wake-ups coalesce and none is lost); closed to stop it */
    kvt_thread_t *evictor;
    kvt_queue_t *ev_wake;
    bool started;
    kvt_l1_listener_fn listener;
    void *listener_ctx;
    uint32_t l2_writes;
    _Atomic uint64_t l2_pending_objects, l2_pending_bytes;
    /* l2_backlog_max in bytes: past it eviction also takes objects still waiting for L2 (they
     * go unwritten, counted in l2_skipped); UINT64_MAX when they always wait */
    uint64_t backlog_bytes;
    _Atomic uint64_t l2_skipped, l2_skipped_bytes;
    _Atomic uint64_t alloc_calls; /* for debug.fail_alloc_every */
    /* l1.adopt: the journal of what L1 holds (NULL when off), the thread that checksums
     * committed objects for it (those COMMIT did not sum), and what the start adopted */
    kvt_journal_t *journal;
    /* resident_slots: the residency map clients read (NULL when off); follows the READY
     * objects under their shard locks */
    kvt_resident_t *resident;
    _Atomic bool journal_lost; /* a write failed: the file is gone, nothing more is promised */
    kvt_thread_t *summer;
    kvt_queue_t *sum_q;
    _Atomic bool sum_on; /* the summer takes objects (from start to stop) */
    /* commits hold it shared from their PUT records to READY; compaction exclusively, so that
     * no object is journaled in the old file and READY only after the rewrite's snapshot */
    pthread_rwlock_t commit_lock;
    _Atomic uint64_t compactions;
    _Atomic uint64_t sums_skipped; /* objects the summer could not take (queue full) */
    /* adopted objects are checked after the start (kvt_l1_start), by threads of their own that
     * each take the next of vlist (most recent first; each pinned until checked); a read that
     * meets one first checks it itself (s_ready_prefix) */
    s_obj_t **vlist;
    size_t vn;
    atomic_size_t vnext;
    atomic_bool vstop;
    pthread_t vthreads[16];
    size_t nvthreads;
    _Atomic uint64_t vpending, vdamaged, vdamaged_bytes, vdone_ms;
    int64_t vt0; /* when the adoption began (ns) */
    struct {
        bool adopted;
        uint64_t objects, bytes, unverified, damaged, rejected, ms;
        char why[PATH_MAX + 400]; /* why the start was cold ("" when adopted) */
    } adopt;
};

static void s_inc(_Atomic uint64_t *v, uint64_t n)
{
    atomic_fetch_add_explicit(v, n, memory_order_relaxed);
}

static void s_dec(_Atomic uint64_t *v, uint64_t n)
{
    atomic_fetch_sub_explicit(v, n, memory_order_relaxed);
}

static uint64_t s_get(_Atomic uint64_t *v)
{
    return atomic_load_explicit(v, memory_order_relaxed);
}

/* ---- namespaces ---- */

/* Namespaces and keys are the clients' choice: the namespace table (a zhashx, which grows on
 * lookups that meet long chains) and the object index hash them under a secret seed, so that
 * nobody can make them collide. Set once, before any thread. */
static uint64_t s_seed;

static size_t s_nskey_hash(const void *k)
{
    const kvt_ns_t *key = k;
    uint64_t h = XXH3_64bits_withSeed(key->name, key->name_len, s_seed ^ key->name_len);
    return (size_t)XXH3_64bits_withSeed(key->salt, key->salt_len, h);
}

static int s_nskey_cmp(const void *a, const void *b)
{
    const kvt_ns_t *x = a, *y = b;
    if (x->name_len != y->name_len || x->salt_len != y->salt_len)
        return 1;
    return memcmp(x->name, y->name, x->name_len) || memcmp(x->salt, y->salt, x->salt_len);
}

/* The interned namespace with one more reference, or NULL when absent and !create. */
static s_ns_t *s_ns_get(kvt_l1_t *self, const kvt_ns_t *ref, bool create)
{
    kvt_ns_t key = *ref;
    if (!key.salt)
        key.salt = key.name; /* memcmp wants a pointer even for 0 bytes */
    pthread_mutex_lock(&self->ns_lock);
    s_ns_t *ns = zhashx_lookup(self->ns_table, &key);
    if (!ns && create) {
        ns = calloc(1, sizeof *ns + kvt_ns_size(ref));
        kvt_assert(ns);
        ns->key = kvt_ns_copy(ref, ns->bytes);
        ns->hash = s_nskey_hash(&ns->key);
        if (self->resident)
            ns->rhash = kvt_resident_ns_hash(kvt_resident_seed(self->resident), &ns->key);
        zhashx_insert(self->ns_table, &ns->key, ns);
    }
    if (ns)
        ns->refs++;
    pthread_mutex_unlock(&self->ns_lock);
    return ns;
}

static void s_ns_put(kvt_l1_t *self, s_ns_t *ns)
{
    if (!ns)
        return;
    pthread_mutex_lock(&self->ns_lock);
    if (--ns->refs == 0) {
        zhashx_delete(self->ns_table, &ns->key);
        free(ns);
    }
    pthread_mutex_unlock(&self->ns_lock);
}

static void s_ns_ref(kvt_l1_t *self, s_ns_t *ns)
{
    pthread_mutex_lock(&self->ns_lock);
    ns->refs++;
    pthread_mutex_unlock(&self->ns_lock);
}

/* A copy of an object's label ([0]: its length, then the bytes); NULL for none. An event
 * batch or a journal snapshot holds it past the object, which may go once its shard is
 * unlocked; either views the bytes at copy + 1. */
static uint8_t *s_label_dup(const uint8_t *label)
{
    if (!label)
        return NULL;
    uint8_t *copy = malloc(1 + (size_t)label[0]);
    kvt_assert(copy);
    memcpy(copy, label, 1 + (size_t)label[0]);
    return copy;
}

/* ---- event batches: keys grouped by namespace, each holding a namespace reference ---- */

typedef struct {
    s_ns_t *ns;
    kvt_key_t *keys;
    uint64_t *sizes;
    kvt_bytes_t *labels; /* NULL until a key with a label comes; each views an s_label_dup */
    uint32_t n, cap;
} s_batch_t;

typedef struct {
    s_batch_t *b;
    uint32_t n, cap;
} s_batches_t;

/* Notes object `o` (alive, under its shard lock or ours alone) for the next event. */
static void s_batches_add(kvt_l1_t *self, s_batches_t *bs, const s_obj_t *o)
{
    if (!self->listener)
        return;
    s_ns_t *ns = o->ns;
    s_batch_t *b = NULL;
    for (uint32_t i = bs->n; i-- > 0;) /* the last batch is the likely one */
        if (bs->b[i].ns == ns) {
            b = &bs->b[i];
            break;
        }
    if (!b) {
        if (bs->n == bs->cap) {
            bs->cap = bs->cap ? 2 * bs->cap : 4;
            bs->b = realloc(bs->b, bs->cap * sizeof *bs->b);
            kvt_assert(bs->b);
        }
        b = &bs->b[bs->n++];
        *b = (s_batch_t){.ns = ns};
        s_ns_ref(self, ns);
    }
    if (b->n == b->cap) {
        b->cap = b->cap ? 2 * b->cap : 16;
        b->keys = realloc(b->keys, b->cap * sizeof *b->keys);
        b->sizes = realloc(b->sizes, b->cap * sizeof *b->sizes);
        kvt_assert(b->keys && b->sizes);
        if (b->labels) {
            b->labels = realloc(b->labels, b->cap * sizeof *b->labels);
            kvt_assert(b->labels);
        }
    }
    if (o->label && !b->labels) {
        b->labels = calloc(b->cap, sizeof *b->labels);
        kvt_assert(b->labels);
    }
    if (b->labels) {
        uint8_t *copy = s_label_dup(o->label);
        b->labels[b->n] = copy ? (kvt_bytes_t){copy + 1, copy[0]} : (kvt_bytes_t){NULL, 0};
    }
    b->keys[b->n] = o->key;
    b->sizes[b->n++] = o->length;
}

/* Tells the listener (no L1 lock may be held) and frees the batches. */
static void s_batches_emit(kvt_l1_t *self, s_batches_t *bs, kvt_l1_event_t event)
{
    for (uint32_t i = 0; i < bs->n; i++) {
        s_batch_t *b = &bs->b[i];
        kvt_l1_change_t c = {event, &b->ns->key, b->keys, b->sizes, b->labels, b->n};
        self->listener(self->listener_ctx, &c);
        for (uint32_t k = 0; b->labels && k < b->n; k++)
            if (b->labels[k].ptr)
                free((void *)(b->labels[k].ptr - 1)); /* s_label_dup's copy */
        free(b->labels);
        free(b->sizes);
        free(b->keys);
        s_ns_put(self, b->ns);
    }
    free(bs->b);
    *bs = (s_batches_t){0};
}

/* ---- index ---- */

static uint64_t s_hash(const s_ns_t *ns, const kvt_key_t *key)
{
    return XXH3_64bits_withSeed(key->b, KVT_KEY_LEN, ns->hash);
}

/* The residency map follows READY objects: called under the object's shard lock. */
static void s_resident(kvt_l1_t *self, const s_obj_t *o, bool ready)
{
    if (!self->resident)
        return;
    uint64_t tag = kvt_resident_tag(o->ns->rhash, &o->key);
    if (ready)
        kvt_resident_add(self->resident, tag);
    else
        kvt_resident_del(self->resident, tag);
}

static s_shard_t *s_shard(kvt_l1_t *self, uint64_t h)
{
    return &self->shards[h >> (64 - S_SHARD_BITS)];
}

static s_obj_t *s_find(s_shard_t *sh, const s_ns_t *ns, const kvt_key_t *key, uint64_t h)
{
    for (s_obj_t *o = sh->buckets[h & (sh->nbuckets - 1)]; o; o = o->hnext)
        if (o->hash == h && o->ns == ns && kvt_key_eq(&o->key, key))
            return o;
    return NULL;
}

static void s_grow(s_shard_t *sh)
{
    uint32_t nb = sh->nbuckets * 2;
    s_obj_t **b = calloc(nb, sizeof *b);
    if (!b)
        return; /* longer chains, still correct */
    for (uint32_t i = 0; i < sh->nbuckets; i++)
        for (s_obj_t *o = sh->buckets[i], *next; o; o = next) {
            next = o->hnext;
            o->hnext = b[o->hash & (nb - 1)];
            b[o->hash & (nb - 1)] = o;
        }
    free(sh->buckets);
    sh->buckets = b;
    sh->nbuckets = nb;
}

static void s_insert(s_shard_t *sh, s_obj_t *o)
{
    if (sh->count >= sh->nbuckets)
        s_grow(sh);
    s_obj_t **head = &sh->buckets[o->hash & (sh->nbuckets - 1)];
    o->hnext = *head;
    *head = o;
    sh->count++;
}

static void s_unlink(s_shard_t *sh, s_obj_t *o)
{
    s_obj_t **p = &sh->buckets[o->hash & (sh->nbuckets - 1)];
    while (*p && *p != o)
        p = &(*p)->hnext;
    kvt_assert(*p == o);
    *p = o->hnext;
    o->hnext = NULL;
    sh->count--;
}

/* ---- LRU (lru_lock held) ---- */

static void s_lru_remove(kvt_l1_t *self, s_obj_t *o)
{
    if (!o->in_lru)
        return;
    if (o->lru_prev)
        o->lru_prev->lru_next = o->lru_next;
    else
        self->lru_head = o->lru_next;
    if (o->lru_next)
        o->lru_next->lru_prev = o->lru_prev;
    else
        self->lru_tail = o->lru_prev;
    o->lru_prev = o->lru_next = NULL;
    o->in_lru = false;
}

static void s_lru_push_head(kvt_l1_t *self, s_obj_t *o)
{
    s_lru_remove(self, o);
    o->lru_prev = NULL;
    o->lru_next = self->lru_head;
    if (self->lru_head)
        self->lru_head->lru_prev = o;
    self->lru_head = o;
    if (!self->lru_tail)
        self->lru_tail = o;
    o->in_lru = true;
}

/* ---- objects ---- */

/* An object's own copy of a label ([0]: its length, then the bytes; at most KVT_MAX_LABEL of
 * them, a longer one cut before the character that crosses the limit); NULL for none. */
static uint8_t *s_label_new(const kvt_bytes_t *l)
{
    uint32_t len = l->len;
    if (len > KVT_MAX_LABEL)
        for (len = KVT_MAX_LABEL; len && (l->ptr[len] & 0xC0) == 0x80; len--)
            ;
    if (!len)
        return NULL;
    uint8_t *p = malloc(1 + len);
    kvt_assert(p);
    p[0] = (uint8_t)len;
    memcpy(p + 1, l->ptr, len);
    return p;
}

/* Frees an object nobody can reach any more. */
static void s_destroy_obj(kvt_l1_t *self, s_obj_t *o)
{
    kvt_alloc_put(self->alloc, o->block);
    s_ns_put(self, o->ns);
    free(o->label);
    free(o);
}

/* ---- the journal (l1.adopt) ---- */

/* A journal write failed: the file goes, so that the next daemon starts empty rather than
 * trust a journal that misses what happened since; said once. */
static void s_journal_lost(kvt_l1_t *self, int rc)
{
    if (atomic_exchange(&self->journal_lost, true))
        return;
    unlink(kvt_journal_path(self->journal));
    kvt_log(KVT_LOG_ERROR,
            "l1: cannot write the journal %s (%s): removed; L1 works on, but the next daemon "
            "will start with an empty L1",
            kvt_journal_path(self->journal), kvt_strerror(rc));
}

/* The DROP record of an object leaving L1 (shard lock held): written before its block can go
 * to another object, whose PUT therefore comes after it. */
static void s_journal_drop(kvt_l1_t *self, s_obj_t *o)
{
    if (!self->journal || !o->jseq)
        return;
    int rc = kvt_journal_drop(self->journal, &o->jseq, 1);
    if (rc)
        s_journal_lost(self, rc);
    o->jseq = 0;
}

/* An object's PUT record as the journal holds it (at commit, and in a compaction's snapshot). */
static kvt_journal_put_t s_put_of(const s_obj_t *o, bool l2_pending)
{
    return (kvt_journal_put_t){.seq = o->jseq,
                               .offset = kvt_block_offset(o->block),
                               .length = o->length,
                               .sum = o->sum,
                               .has_sum = o->has_sum || o->jsummed,
                               .l2_pending = l2_pending,
                               .key = o->key,
                               .ns = o->ns->key,
                               .label = {o->label ? o->label + 1 : NULL,
                                         o->label ? o->label[0] : 0u}};
}

/* The PUT records of a commit's objects, written while they are still RESERVED (ours alone),
 * before any becomes READY: nothing can drop one before its PUT is in the file, and what a
 * COMMIT acknowledges is. */
static void s_journal_puts(kvt_l1_t *self, kvt_lease_t *l, bool loaded)
{
    kvt_journal_put_t stack[16];
    kvt_journal_put_t *puts = l->nitems <= 16 ? stack : malloc(l->nitems * sizeof *puts);
    kvt_assert(puts);
    size_t n = 0;
    for (uint32_t i = 0; i < l->nitems; i++) {
        s_obj_t *o = l->items[i];
        if (o)
            puts[n++] = s_put_of(o, !loaded && self->l2_writes > 0);
    }
    int rc = kvt_journal_put(self->journal, puts, n);
    if (rc)
        s_journal_lost(self, rc);
    for (uint32_t i = 0, k = 0; rc == 0 && i < l->nitems; i++)
        if (l->items[i])
            ((s_obj_t *)l->items[i])->jseq = puts[k++].seq;
    if (puts != stack)
        free(puts);
}

/* An object starts waiting for `n` L2 writes, or stops waiting (shard lock held): the counts
 * behind l2_backlog_max. */
static void s_pending_set(kvt_l1_t *self, s_obj_t *o, uint32_t n)
{
    o->l2_pending = (uint8_t)n;
    s_inc(&self->l2_pending_objects, 1);
    s_inc(&self->l2_pending_bytes, kvt_block_size(o->block));
}

static void s_pending_clear(kvt_l1_t *self, s_obj_t *o)
{
    o->l2_pending = 0;
    s_dec(&self->l2_pending_objects, 1);
    s_dec(&self->l2_pending_bytes, kvt_block_size(o->block));
}

/* Unlinks a READY object from index and LRU (shard lock held). Returns true when the caller
 * must free it (no pins); a pinned one is DOOMED and freed by its last unpin. */
static bool s_remove_ready(kvt_l1_t *self, s_shard_t *sh, s_obj_t *o)
{
    s_journal_drop(self, o);
    s_resident(self, o, false);
    s_unlink(sh, o);
    pthread_mutex_lock(&self->lru_lock);
    s_lru_remove(self, o);
    pthread_mutex_unlock(&self->lru_lock);
    s_dec(&self->objects, 1);
    if (o->l2_pending)
        s_pending_clear(self, o);
    if (o->pins) {
        o->state = S_DOOMED;
        return false;
    }
    return true;
}

/* Discards a RESERVED object of a write lease. */
static void s_discard(kvt_l1_t *self, s_obj_t *o)
{
    s_shard_t *sh = s_shard(self, o->hash);
    pthread_mutex_lock(&sh->lock);
    s_unlink(sh, o);
    pthread_mutex_unlock(&sh->lock);
    s_dec(&self->reserved, 1);
    s_destroy_obj(self, o);
}

static void s_unpin(kvt_l1_t *self, s_obj_t *o)
{
    s_shard_t *sh = s_shard(self, o->hash);
    pthread_mutex_lock(&sh->lock);
    kvt_assert(o->pins > 0);
    bool dead = --o->pins == 0 && o->state == S_DOOMED;
    pthread_mutex_unlock(&sh->lock);
    if (dead)
        s_destroy_obj(self, o);
}

/* Acts on a lease taken out of the table: unpin (read) or discard (write), and gives its bytes
 * back to its owner's account. */
static void s_drop_lease(kvt_lease_t *l, void *ctx)
{
    kvt_l1_t *self = ctx;
    for (uint32_t i = 0; i < l->nitems; i++) {
        s_obj_t *o = l->items[i];
        if (!o)
            continue;
        if (l->kind == KVT_LEASE_WRITE)
            s_discard(self, o);
        else
            s_unpin(self, o);
    }
    kvt_leases_settle(self->leases, l);
}

/* What an object of `len` bytes holds of the arena, as leases are charged for it. */
static uint64_t s_pages(uint64_t len)
{
    return len ? (len + KVT_PAGE - 1) / KVT_PAGE * KVT_PAGE : KVT_PAGE;
}

/* The byte account of a client owner; NULL for the daemon, whose leases are not counted. */
static kvt_account_t *s_account(kvt_l1_t *self, uint64_t owner)
{
    return owner == KVT_OWNER_DAEMON ? NULL : kvt_leases_account(self->leases, owner);
}

/* Charges one key's bytes while a lease is built. Under a limit each key is charged at once,
 * so the limit holds exactly even against the owner's other requests; without one nothing can
 * be refused, and the bytes are added in one go by s_account_done. */
static bool s_charge(kvt_l1_t *self, kvt_account_t *acct, uint64_t bytes, uint64_t *held)
{
    uint64_t limit = self->cfg->max_leased_bytes;
    return !acct || !limit || kvt_account_charge(acct, bytes, limit, held);
}

static void s_uncharge(kvt_l1_t *self, kvt_account_t *acct, uint64_t bytes)
{
    if (acct && self->cfg->max_leased_bytes)
        kvt_account_uncharge(acct, bytes);
}

/* Attaches the bytes charged while a lease was built (and the account reference) to it, or
 * hands them back when no lease was made. */
static void s_account_done(kvt_l1_t *self, kvt_account_t *acct, uint64_t charged, kvt_lease_t *l)
{
    if (!acct)
        return;
    if (!self->cfg->max_leased_bytes && l) /* not charged key by key: now, in one go */
        kvt_account_charge(acct, charged, 0, NULL);
    if (l) {
        l->account = acct;
        l->bytes = charged;
        return;
    }
    s_uncharge(self, acct, charged);
    kvt_leases_account_put(self->leases, acct);
}

static void s_wake_evictor(kvt_l1_t *self)
{
    if (self->started && kvt_alloc_used(self->alloc) > self->high_bytes)
        kvt_queue_push(self->ev_wake, self, 1); /* full or closed: nothing to do */
}

static uint64_t s_evict(kvt_l1_t *self, uint64_t bytes, uint64_t *skipped);
static int s_clear(kvt_l1_t *self, const uint8_t *ns, uint32_t ns_len, bool prefix,
                   bool keep_pinned, uint64_t *removed);

/* Allocates, evicting on demand while something evictable is left. Eviction skips objects of
 * shards busy at that instant, so a round that freed nothing but skipped some is retried. */
static kvt_block_t *s_alloc(kvt_l1_t *self, uint64_t size)
{
    /* test hook (debug.fail_alloc_every): this allocation fails as if the arena were full with
     * nothing evictable, so tests can see the no_space path without filling the arena */
    uint32_t every = self->cfg->debug_fail_alloc_every;
    if (every &&
        (atomic_fetch_add_explicit(&self->alloc_calls, 1, memory_order_relaxed) + 1) % every == 0)
        return NULL;
    kvt_block_t *b = kvt_alloc_get(self->alloc, size);
    for (int idle_rounds = 0; !b; b = kvt_alloc_get(self->alloc, size)) {
        uint64_t skipped = 0;
        if (s_evict(self, size, &skipped) > 0)
            continue;
        if (skipped == 0 || ++idle_rounds > 1000)
            return NULL;
        sched_yield();
    }
    return b;
}

/* ---- API ---- */

int kvt_l1_reserve(kvt_l1_t *self, uint64_t owner, const kvt_ns_t *ref, const kvt_key_t *keys,
                   uint32_t n, const uint64_t *sizes,
                   uint64_t size, kvt_slot_t *slots, uint32_t *nslots, uint64_t *lease,
                   char *err, size_t errlen)
{
    return kvt_l1_reserve_labeled(self, owner, ref, keys, NULL, n, sizes, size, slots, nslots,
                                  lease, err, errlen);
}

int kvt_l1_reserve_labeled(kvt_l1_t *self, uint64_t owner, const kvt_ns_t *ref,
                           const kvt_key_t *keys, const kvt_bytes_t *labels, uint32_t n,
                           const uint64_t *sizes, uint64_t size, kvt_slot_t *slots,
                           uint32_t *nslots, uint64_t *lease, char *err, size_t errlen)
{
    *nslots = 0;
    *lease = 0;
    if (n == 0)
        return 0;
    s_ns_t *ns = s_ns_get(self, ref, true);
    void **items = calloc(n, sizeof *items);
    kvt_assert(items);
    kvt_account_t *acct = s_account(self, owner);
    uint64_t limit = self->cfg->max_leased_bytes, charged = 0, held = 0;
    uint32_t i, nobj = 0;
    int rc = 0;
    for (i = 0; i < n; i++) {
        uint64_t sz = sizes ? sizes[i] : size;
        uint64_t h = s_hash(ns, &keys[i]);
        s_shard_t *sh = s_shard(self, h);
        pthread_mutex_lock(&sh->lock);
        bool present = s_find(sh, ns, &keys[i], h) != NULL;
        pthread_mutex_unlock(&sh->lock);
        if (present) {
            slots[i] = (kvt_slot_t){0, 0};
            continue;
        }
        if (!s_charge(self, acct, s_pages(sz), &held)) {
            if (i == 0) {
                snprintf(err, errlen,
                         "instance holds %llu bytes under leases; %llu more would pass "
                         "max_leased_bytes (%llu): commit or release leases first",
                         (unsigned long long)held, (unsigned long long)s_pages(sz),
                         (unsigned long long)limit);
                rc = KVT_ENOSPC;
            }
            break;
        }
        kvt_block_t *b = sz <= self->capacity ? s_alloc(self, sz) : NULL;
        if (!b)
            s_uncharge(self, acct, s_pages(sz));
        if (!b) {
            if (i == 0) {
                snprintf(err, errlen,
                         "no space in L1 for %llu bytes (capacity %llu, %llu in use, "
                         "nothing evictable)",
                         (unsigned long long)sz, (unsigned long long)self->capacity,
                         (unsigned long long)kvt_alloc_used(self->alloc));
                rc = KVT_ENOSPC;
            }
            break;
        }
        s_obj_t *o = calloc(1, sizeof *o);
        kvt_assert(o);
        o->key = keys[i];
        o->state = S_RESERVED;
        o->hash = h;
        o->length = sz;
        o->ns = ns;
        o->block = b;
        if (labels)
            o->label = s_label_new(&labels[i]);
        pthread_mutex_lock(&sh->lock);
        if (s_find(sh, ns, &keys[i], h)) { /* another writer got there first */
            pthread_mutex_unlock(&sh->lock);
            kvt_alloc_put(self->alloc, b);
            free(o->label);
            free(o);
            s_uncharge(self, acct, s_pages(sz));
            slots[i] = (kvt_slot_t){0, 0};
            continue;
        }
        s_insert(sh, o);
        pthread_mutex_unlock(&sh->lock);
        s_ns_ref(self, ns);
        s_inc(&self->reserved, 1);
        items[i] = o;
        nobj++;
        charged += s_pages(sz);
        slots[i] = (kvt_slot_t){kvt_block_offset(b), sz};
    }
    *nslots = rc ? 0 : i;
    kvt_lease_t *l = nobj ? kvt_lease_new(owner, KVT_LEASE_WRITE, items, i) : NULL;
    s_account_done(self, acct, charged, l);
    if (l)
        *lease = kvt_leases_add(self->leases, l);
    free(items);
    s_ns_put(self, ns);
    s_wake_evictor(self);
    return rc;
}

static int s_lease_error(int rc, uint64_t id, const char *what, char *err, size_t errlen)
{
    if (rc == KVT_ELEXPIRED)
        snprintf(err, errlen, "lease %llu expired: its instance was silent for over lease_ms",
                 (unsigned long long)id);
    else if (rc == KVT_EBADREQ)
        snprintf(err, errlen, "lease %llu is not a %s lease", (unsigned long long)id, what);
    else
        snprintf(err, errlen, "no lease %llu held by this instance", (unsigned long long)id);
    return rc;
}

static int s_commit(kvt_l1_t *self, uint64_t owner, uint64_t id, const uint64_t *failed,
                    uint32_t nfailed, bool loaded, const uint64_t *sums, uint32_t *stored,
                    char *err, size_t errlen)
{
    *stored = 0;
    kvt_lease_t *l = NULL;
    int rc = kvt_leases_take(self->leases, id, owner, KVT_LEASE_WRITE, &l);
    if (rc)
        return s_lease_error(rc, id, "write", err, errlen);
    for (uint32_t f = 0; f < nfailed; f++)
        if (failed[f] >= l->nitems) {
            snprintf(err, errlen, "failed index %llu out of range: the lease covers %u keys",
                     (unsigned long long)failed[f], l->nitems);
            kvt_leases_restore(self->leases, l);
            return KVT_EBADREQ;
        }
    for (uint32_t f = 0; f < nfailed; f++) {
        s_obj_t *o = l->items[failed[f]];
        if (o) {
            s_discard(self, o);
            l->items[failed[f]] = NULL;
        }
    }
    /* checksummed while the objects are still RESERVED (ours alone, so without a lock); a load
     * from L2 brings the checksum it verified */
    const uint8_t *base = kvt_arena_base(self->arena);
    for (uint32_t i = 0; self->cfg->l1_checksum && i < l->nitems; i++) {
        s_obj_t *o = l->items[i];
        if (!o)
            continue;
        o->sum = sums ? sums[i] : XXH3_64bits(base + kvt_block_offset(o->block), o->length);
        o->has_sum = true;
    }
    if (self->journal) {
        pthread_rwlock_rdlock(&self->commit_lock);
        s_journal_puts(self, l, loaded);
    }
    /* noted while the objects are still RESERVED (ours alone): once READY, another thread may
     * evict them at any moment */
    s_batches_t bs = {0};
    for (uint32_t i = 0; i < l->nitems; i++)
        if (l->items[i])
            s_batches_add(self, &bs, l->items[i]);
    /* in reverse, so the head of the prefix ends up most recent; an object COMMIT did not sum
     * goes to the summer (pinned until summed) so that the journal gets its checksum */
    bool summing = atomic_load(&self->sum_on) && !atomic_load(&self->journal_lost);
    s_obj_t *one[16], **tosum = summing && l->nitems > 16 ? malloc(l->nitems * sizeof *tosum) : one;
    kvt_assert(tosum);
    uint32_t nsum = 0;
    for (uint32_t i = l->nitems; i-- > 0;) {
        s_obj_t *o = l->items[i];
        if (!o)
            continue;
        s_shard_t *sh = s_shard(self, o->hash);
        pthread_mutex_lock(&sh->lock);
        if (summing && o->jseq && !o->has_sum) {
            o->pins++;
            tosum[nsum++] = o;
        }
        o->state = S_READY;
        s_resident(self, o, true);
        o->l2_pending = 0;
        if (!loaded && self->l2_writes)
            s_pending_set(self, o, self->l2_writes);
        pthread_mutex_lock(&self->lru_lock);
        s_lru_push_head(self, o);
        pthread_mutex_unlock(&self->lru_lock);
        pthread_mutex_unlock(&sh->lock);
        s_dec(&self->reserved, 1);
        s_inc(&self->objects, 1);
        (*stored)++;
    }
    if (self->journal)
        pthread_rwlock_unlock(&self->commit_lock);
    for (uint32_t i = 0; i < nsum; i++)
        if (kvt_queue_push(self->sum_q, tosum[i], 1) != 0) {
            s_inc(&self->sums_skipped, 1);
            s_unpin(self, tosum[i]);
        }
    if (tosum != one)
        free(tosum);
    kvt_leases_settle(self->leases, l);
    kvt_lease_free(l);
    s_batches_emit(self, &bs, loaded ? KVT_L1_LOADED : KVT_L1_STORED);
    return 0;
}

int kvt_l1_commit(kvt_l1_t *self, uint64_t owner, uint64_t id, const uint64_t *failed,
                  uint32_t nfailed, uint32_t *stored, char *err, size_t errlen)
{
    return s_commit(self, owner, id, failed, nfailed, false, NULL, stored, err, errlen);
}

int kvt_l1_commit_loaded(kvt_l1_t *self, uint64_t owner, uint64_t id, const uint64_t *failed,
                         uint32_t nfailed, const uint64_t *sums, uint32_t *stored, char *err,
                         size_t errlen)
{
    return s_commit(self, owner, id, failed, nfailed, true, sums, stored, err, errlen);
}

int kvt_l1_write(kvt_l1_t *self, const kvt_ns_t *ns, const kvt_key_t *keys,
                 const kvt_bytes_t *labels, uint32_t n, const uint64_t *sizes, uint64_t size,
                 bool loaded, kvt_l1_fill_fn fill, void *ctx, uint32_t *stored,
                 uint32_t *present, char *err, size_t errlen)
{
    *stored = 0;
    if (present)
        *present = 0;
    kvt_slot_t *slots = malloc((n ? n : 1) * sizeof *slots);
    uint64_t *failed = malloc((n ? n : 1) * sizeof *failed);
    uint64_t *sums = loaded ? calloc(n ? n : 1, sizeof *sums) : NULL;
    kvt_assert(slots && failed && (sums || !loaded));
    uint32_t nslots = 0, nfailed = 0;
    uint64_t lease = 0;
    int rc = kvt_l1_reserve_labeled(self, KVT_OWNER_DAEMON, ns, keys, labels, n, sizes, size,
                                    slots, &nslots, &lease, err, errlen);
    for (uint32_t i = 0; present && i < nslots; i++)
        *present += slots[i].length == 0;
    if (rc == 0 && lease) {
        rc = fill(ctx, kvt_arena_base(self->arena), slots, nslots, failed, &nfailed, sums, err,
                  errlen);
        if (rc == 0)
            rc = s_commit(self, KVT_OWNER_DAEMON, lease, failed, nfailed, loaded, sums, stored,
                          err, errlen);
        else
            kvt_l1_release(self, KVT_OWNER_DAEMON, lease); /* discards the reservations */
    }
    free(sums);
    free(failed);
    free(slots);
    return rc;
}

void kvt_l1_set_l2_writes(kvt_l1_t *self, uint32_t n)
{
    self->l2_writes = n > 255 ? 255 : n;
}

/* An object pinned by the caller whose bytes no longer match its checksum: out of the index
 * (DOOMED: the caller's pin frees it), counted and logged once — whoever finds it first. */
static void s_damaged(kvt_l1_t *self, s_obj_t *o, const char *instead)
{
    s_shard_t *sh = s_shard(self, o->hash);
    s_batches_t bs = {0};
    pthread_mutex_lock(&sh->lock);
    bool found = o->state == S_READY;
    if (found) {
        s_batches_add(self, &bs, o);
        bool free_it = s_remove_ready(self, sh, o);
        kvt_assert(!free_it); /* pinned by the caller: its release frees it */
    }
    pthread_mutex_unlock(&sh->lock);
    if (!found)
        return;
    s_inc(&self->corrupt, 1);
    char key[2 * KVT_KEY_LEN + 1], ns[65];
    for (int i = 0; i < KVT_KEY_LEN; i++)
        snprintf(key + 2 * i, 3, "%02x", o->key.b[i]);
    uint32_t nl = o->ns->key.name_len < sizeof ns - 1 ? o->ns->key.name_len : sizeof ns - 1;
    for (uint32_t i = 0; i < nl; i++) { /* ns is client text: printable in the log */
        uint8_t c = o->ns->key.name[i];
        ns[i] = c >= 0x20 && c < 0x7f ? (char)c : '?';
    }
    ns[nl] = '\0';
    kvt_log(KVT_LOG_WARN,
            "l1: object %s of ns '%s' does not match the checksum taken at its COMMIT (written "
            "into after its lease ended?): removed, not %s",
            key, ns, instead);
    s_batches_emit(self, &bs, KVT_L1_REMOVED);
}

uint32_t kvt_l1_verify(kvt_l1_t *self, uint64_t owner, uint64_t lease, uint32_t n)
{
    if (!self->cfg->l1_checksum || n == 0)
        return n;
    kvt_lease_t *l = kvt_leases_peek(self->leases, lease, owner);
    if (!l || l->kind != KVT_LEASE_READ)
        return 0;
    const uint8_t *base = kvt_arena_base(self->arena);
    uint32_t k = 0;
    for (; k < n && k < l->nitems; k++) {
        s_obj_t *o = l->items[k];
        if (o->has_sum && XXH3_64bits(base + kvt_block_offset(o->block), o->length) != o->sum) {
            s_damaged(self, o, "served");
            break;
        }
    }
    return k;
}

int kvt_l1_check_sum(kvt_l1_t *self, uint64_t owner, uint64_t lease, uint32_t i, uint64_t sum)
{
    if (!self->cfg->l1_checksum)
        return 0;
    kvt_lease_t *l = kvt_leases_peek(self->leases, lease, owner);
    if (!l || l->kind != KVT_LEASE_READ || i >= l->nitems)
        return KVT_EUNKLEASE;
    s_obj_t *o = l->items[i];
    if (!o->has_sum || o->sum == sum)
        return 0;
    s_damaged(self, o, "written to L2");
    return KVT_EIO;
}

uint64_t kvt_l1_owner_bytes(kvt_l1_t *self, uint64_t owner)
{
    return kvt_leases_owner_bytes(self->leases, owner);
}

void kvt_l1_owner_limit_error(kvt_l1_t *self, uint64_t owner, char *err, size_t errlen)
{
    snprintf(err, errlen,
             "instance holds %llu bytes under leases; pinning more would pass max_leased_bytes "
             "(%llu): release leases first",
             (unsigned long long)kvt_leases_owner_bytes(self->leases, owner),
             (unsigned long long)self->cfg->max_leased_bytes);
}

void kvt_l1_l2_written(kvt_l1_t *self, const kvt_ns_t *ref, const kvt_key_t *key)
{
    s_ns_t *ns = s_ns_get(self, ref, false);
    if (!ns)
        return;
    uint64_t h = s_hash(ns, key);
    s_shard_t *sh = s_shard(self, h);
    pthread_mutex_lock(&sh->lock);
    s_obj_t *o = s_find(sh, ns, key, h);
    uint64_t done = 0;
    if (o && o->state == S_READY && o->l2_pending == 1) {
        s_pending_clear(self, o);
        done = o->jseq;
    } else if (o && o->state == S_READY && o->l2_pending) {
        o->l2_pending--;
    }
    pthread_mutex_unlock(&sh->lock);
    s_ns_put(self, ns);
    /* the next daemon need not write it again; outside the lock: a DROP of the same seq in
     * between only makes this record one the reader ignores (seqs are never reused) */
    if (done && self->journal) {
        int rc = kvt_journal_l2done(self->journal, done);
        if (rc)
            s_journal_lost(self, rc);
    }
}

/* Counts the leading READY keys. With `pinned`, also pins them, puts them in pinned[] and
 * touches them in the LRU; with `acct`, each pin is first charged to it (s_charge): the prefix
 * ends before the first that does not fit, and *limited says so. */
static uint32_t s_ready_prefix(kvt_l1_t *self, s_ns_t *ns, const kvt_key_t *keys,
                               uint32_t n, s_obj_t **pinned, kvt_account_t *acct, uint64_t *charged,
                               bool *limited)
{
    uint32_t k = 0;
    for (; k < n; k++) {
        uint64_t h = s_hash(ns, &keys[k]);
        s_shard_t *sh = s_shard(self, h);
        pthread_mutex_lock(&sh->lock);
        s_obj_t *o = s_find(sh, ns, &keys[k], h);
        bool ok = o && o->state == S_READY;
        if (ok && o->unverified) { /* adopted, not checked yet: checked now (the check's
                                    * thread removes it when the bytes differ) */
            ok = XXH3_64bits((const uint8_t *)kvt_arena_base(self->arena) +
                                 kvt_block_offset(o->block),
                             o->length) == o->sum;
            o->unverified = !ok;
            if (ok) /* the map shows adopted objects once they are checked */
                s_resident(self, o, true);
        }
        if (ok && acct && !s_charge(self, acct, s_pages(o->length), NULL)) {
            ok = false;
            *limited = true;
        } else if (ok && acct) {
            *charged += s_pages(o->length);
        }
        if (ok && pinned)
            o->pins++;
        pthread_mutex_unlock(&sh->lock);
        if (!ok)
            break;
        if (pinned)
            pinned[k] = o;
    }
    if (!pinned)
        return k;
    /* touch in reverse so the head of the prefix is the most recent */
    for (uint32_t j = k; j-- > 0;) {
        s_obj_t *o = pinned[j];
        s_shard_t *sh = s_shard(self, o->hash);
        pthread_mutex_lock(&sh->lock);
        if (o->state == S_READY) {
            pthread_mutex_lock(&self->lru_lock);
            s_lru_push_head(self, o);
            pthread_mutex_unlock(&self->lru_lock);
        }
        pthread_mutex_unlock(&sh->lock);
    }
    return k;
}

int kvt_l1_acquire(kvt_l1_t *self, uint64_t owner, const kvt_ns_t *ref, const kvt_key_t *keys,
                   uint32_t n, kvt_slot_t *slots,
                   uint32_t *nslots, uint64_t *lease)
{
    *nslots = 0;
    *lease = 0;
    s_ns_t *ns = n ? s_ns_get(self, ref, false) : NULL;
    if (!ns)
        return 0;
    s_obj_t **pinned = malloc(n * sizeof *pinned);
    kvt_assert(pinned);
    kvt_account_t *acct = s_account(self, owner);
    uint64_t charged = 0;
    bool limited = false;
    uint32_t k = s_ready_prefix(self, ns, keys, n, pinned, acct, &charged, &limited);
    for (uint32_t j = 0; j < k; j++)
        slots[j] = (kvt_slot_t){kvt_block_offset(pinned[j]->block), pinned[j]->length};
    kvt_lease_t *l = k ? kvt_lease_new(owner, KVT_LEASE_READ, (void *const *)pinned, k) : NULL;
    s_account_done(self, acct, charged, l);
    if (l)
        *lease = kvt_leases_add(self->leases, l);
    *nslots = k;
    free(pinned);
    s_ns_put(self, ns);
    return k == 0 && limited ? KVT_ENOSPC : 0;
}

int kvt_l1_lookup(kvt_l1_t *self, uint64_t owner, const kvt_ns_t *ref, const kvt_key_t *keys,
                  uint32_t n, bool lock, uint32_t *hits,
                  uint64_t *lease)
{
    *hits = 0;
    *lease = 0;
    if (lock) {
        kvt_slot_t *slots = malloc((n ? n : 1) * sizeof *slots);
        kvt_assert(slots);
        int rc = kvt_l1_acquire(self, owner, ref, keys, n, slots, hits, lease);
        free(slots);
        return rc;
    }
    s_ns_t *ns = n ? s_ns_get(self, ref, false) : NULL;
    if (!ns)
        return 0;
    *hits = s_ready_prefix(self, ns, keys, n, NULL, NULL, NULL, NULL);
    s_ns_put(self, ns);
    return 0;
}

int kvt_l1_release(kvt_l1_t *self, uint64_t owner, uint64_t id)
{
    kvt_lease_t *l = NULL;
    int rc = kvt_leases_take(self->leases, id, owner, 0, &l);
    if (rc)
        return rc;
    s_drop_lease(l, self);
    kvt_lease_free(l);
    return 0;
}

int kvt_l1_remove(kvt_l1_t *self, const kvt_ns_t *ref, const kvt_key_t *keys,
                  uint32_t n, uint32_t *removed)
{
    *removed = 0;
    s_ns_t *ns = n ? s_ns_get(self, ref, false) : NULL;
    if (!ns)
        return 0;
    s_batches_t bs = {0};
    for (uint32_t i = 0; i < n; i++) {
        uint64_t h = s_hash(ns, &keys[i]);
        s_shard_t *sh = s_shard(self, h);
        pthread_mutex_lock(&sh->lock);
        s_obj_t *o = s_find(sh, ns, &keys[i], h);
        bool gone = o && o->state == S_READY;
        if (gone)
            s_batches_add(self, &bs, o);
        bool free_it = gone && s_remove_ready(self, sh, o);
        pthread_mutex_unlock(&sh->lock);
        if (free_it)
            s_destroy_obj(self, o);
        *removed += gone;
    }
    s_batches_emit(self, &bs, KVT_L1_REMOVED);
    s_ns_put(self, ns);
    return 0;
}

int kvt_l1_clear(kvt_l1_t *self, const uint8_t *ns, uint32_t ns_len, uint64_t *removed)
{
    return s_clear(self, ns, ns_len, false, false, removed);
}

int kvt_l1_clear_prefix(kvt_l1_t *self, const uint8_t *prefix, uint32_t prefix_len,
                        bool keep_pinned, uint64_t *removed)
{
    return s_clear(self, prefix, prefix_len, true, keep_pinned, removed);
}

/* Removes every READY object `pick` chooses (pinned ones go when their readers let go) and
 * reports them as removed; returns how many. */
typedef bool (*s_pick_fn)(const s_obj_t *o, const void *ctx);

static uint64_t s_remove_if(kvt_l1_t *self, s_pick_fn pick, const void *ctx)
{
    uint64_t removed = 0;
    s_batches_t bs = {0};
    for (uint32_t s = 0; s < S_SHARDS; s++) {
        s_shard_t *sh = &self->shards[s];
        s_obj_t *victims = NULL;
        pthread_mutex_lock(&sh->lock);
        for (uint32_t b = 0; b < sh->nbuckets; b++) {
            for (s_obj_t *o = sh->buckets[b], *next; o; o = next) {
                next = o->hnext;
                if (o->state != S_READY || !pick(o, ctx))
                    continue;
                removed++;
                s_batches_add(self, &bs, o);
                if (s_remove_ready(self, sh, o)) {
                    o->hnext = victims;
                    victims = o;
                }
            }
        }
        pthread_mutex_unlock(&sh->lock);
        for (s_obj_t *o = victims, *next; o; o = next) {
            next = o->hnext;
            s_destroy_obj(self, o);
        }
    }
    s_batches_emit(self, &bs, KVT_L1_REMOVED);
    return removed;
}

typedef struct {
    const uint8_t *ns;
    uint32_t ns_len;
    bool prefix, keep_pinned;
} s_clear_t;

static bool s_clear_pick(const s_obj_t *o, const void *ctx)
{
    const s_clear_t *c = ctx;
    if (c->keep_pinned && o->pins)
        return false;
    uint32_t len = o->ns->key.name_len;
    if (c->ns && (c->prefix ? len < c->ns_len : len != c->ns_len))
        return false;
    return !c->ns || memcmp(o->ns->key.name, c->ns, c->ns_len) == 0;
}

/* CLEAR's walk: READY objects of every namespace, of the one named `ns`, or (`prefix`) of
 * those whose name starts with it; `keep_pinned` leaves objects someone reads alone. */
static int s_clear(kvt_l1_t *self, const uint8_t *ns, uint32_t ns_len, bool prefix,
                   bool keep_pinned, uint64_t *removed)
{
    s_clear_t c = {ns, ns_len, prefix, keep_pinned};
    *removed = s_remove_if(self, s_clear_pick, &c);
    return 0;
}

uint64_t kvt_l1_release_owner(kvt_l1_t *self, uint64_t owner, bool expired)
{
    size_t n = 0;
    kvt_lease_t *l = kvt_leases_take_owner(self->leases, owner, expired, &n);
    while (l) {
        kvt_lease_t *next = l->next_of_owner;
        s_drop_lease(l, self);
        kvt_lease_free(l);
        l = next;
    }
    return n;
}

uint64_t kvt_l1_evict(kvt_l1_t *self, uint64_t bytes)
{
    uint64_t skipped = 0;
    return s_evict(self, bytes, &skipped);
}

static uint64_t s_evict(kvt_l1_t *self, uint64_t bytes, uint64_t *skipped)
{
    uint64_t freed = 0, count = 0, unwritten = 0, unwritten_bytes = 0;
    s_obj_t *victims = NULL, **tail = &victims; /* in eviction order */
    s_batches_t bs = {0};
    pthread_mutex_lock(&self->lru_lock);
    for (s_obj_t *o = self->lru_tail, *prev; o && freed < bytes; o = prev) {
        prev = o->lru_prev;
        s_shard_t *sh = s_shard(self, o->hash);
        if (pthread_mutex_trylock(&sh->lock) != 0) {
            (*skipped)++; /* busy shard: against the lock order, so skip it this round */
            continue;
        }
        /* past l2_backlog_max the oldest objects still waiting for L2 go too: new objects
         * are worth more to the cache than old ones the disk has no time for */
        bool take_unwritten = o->l2_pending && s_get(&self->l2_pending_bytes) > self->backlog_bytes;
        if (o->state == S_READY && o->pins == 0 && (o->l2_pending == 0 || take_unwritten)) {
            if (o->l2_pending) {
                s_pending_clear(self, o);
                unwritten++;
                unwritten_bytes += kvt_block_size(o->block);
            }
            s_resident(self, o, false);
            s_unlink(sh, o);
            s_lru_remove(self, o);
            o->state = S_DOOMED;
            o->hnext = NULL;
            *tail = o;
            tail = &o->hnext;
            freed += kvt_block_size(o->block);
            count++;
        }
        pthread_mutex_unlock(&sh->lock);
    }
    pthread_mutex_unlock(&self->lru_lock);
    /* DOOMED and unreachable: ours alone, so their event (label copies and all) is noted
     * outside the global lock */
    for (s_obj_t *o = victims; o; o = o->hnext)
        s_batches_add(self, &bs, o);
    if (self->journal && count) { /* one write of their DROP records, before the blocks go */
        uint64_t *seqs = malloc(count * sizeof *seqs);
        kvt_assert(seqs);
        size_t n = 0;
        for (s_obj_t *o = victims; o; o = o->hnext)
            if (o->jseq)
                seqs[n++] = o->jseq;
        int rc = kvt_journal_drop(self->journal, seqs, n);
        if (rc)
            s_journal_lost(self, rc);
        free(seqs);
    }
    for (s_obj_t *o = victims, *next; o; o = next) {
        next = o->hnext;
        s_destroy_obj(self, o);
    }
    s_batches_emit(self, &bs, KVT_L1_EVICTED);
    s_dec(&self->objects, count);
    s_inc(&self->evictions, count);
    s_inc(&self->evicted_bytes, freed);
    if (unwritten) {
        s_inc(&self->l2_skipped, unwritten);
        s_inc(&self->l2_skipped_bytes, unwritten_bytes);
    }
    return freed;
}

/* ---- eviction controller ---- */

/* Objects with bytes at or past the cut (lost to a truncation of the arena file). */
static bool s_past_pick(const s_obj_t *o, const void *ctx)
{
    return kvt_block_offset(o->block) + o->length > *(const uint64_t *)ctx;
}

/* The arena file cut short by another process: its size is back (kvt_arena_check), the
 * objects whose bytes went are dropped, and the operator is told. */
static void s_check_arena(kvt_l1_t *self)
{
    uint64_t cut = kvt_arena_check(self->arena);
    if (cut == UINT64_MAX)
        return;
    uint64_t dropped = s_remove_if(self, s_past_pick, &cut);
    s_inc(&self->truncations, 1);
    kvt_log(KVT_LOG_ERROR,
            "l1: the arena file %s was truncated to %llu bytes by another process (any process "
            "that may write it can): its size is restored and the %llu objects past that offset "
            "are dropped; objects being written then may hold zeros (l1_checksum does not catch "
            "bytes lost before COMMIT)",
            kvt_arena_path(self->arena), (unsigned long long)cut, (unsigned long long)dropped);
}

/* By seq, on kvt_journal_put_t or on anything that begins with one (s_adopted_t). */
static int s_by_seq_put(const void *a, const void *b)
{
    const kvt_journal_put_t *x = a, *y = b;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* The journal gains a record per commit, removal and eviction; once past 16 MiB
 * (debug.journal_compact_bytes) and four times what the objects in L1 need, it is rewritten
 * holding them alone. Commits are held off (commit_lock: every object journaled before is
 * READY, so in the snapshot, and no PUT can come meanwhile); the snapshot takes one shard lock
 * at a time, and the DROP and SUM records appended while it runs are carried into the new file
 * (kvt_journal_mark), so none is lost whether the snapshot saw its object or not. Evictor. */
typedef struct {
    s_ns_t *ns;
    uint8_t *label;
} s_snap_hold_t;

static void s_maybe_compact(kvt_l1_t *self)
{
    if (!self->journal || atomic_load(&self->journal_lost))
        return;
    uint64_t bytes = kvt_journal_bytes(self->journal), objs = s_get(&self->objects);
    if (bytes < self->cfg->debug_journal_compact_bytes || bytes / 4 < objs * S_RECORD_EST)
        return;
    int64_t t0 = kvt_now_ns();
    pthread_rwlock_wrlock(&self->commit_lock);
    kvt_journal_mark(self->journal);
    size_t n = 0, cap = 0;
    kvt_journal_put_t *live = NULL;
    /* an object may go (its label freed, its namespace's last reference dropped) once its
     * shard is unlocked, before the rewrite reads the snapshot: the snapshot holds a reference
     * to each namespace and a copy of each label */
    s_snap_hold_t *hold = NULL;
    bool oom = false;
    for (uint32_t s = 0; s < S_SHARDS && !oom; s++) {
        s_shard_t *sh = &self->shards[s];
        pthread_mutex_lock(&sh->lock);
        if (n + sh->count > cap) {
            cap = (n + sh->count) * 2 + 64;
            kvt_journal_put_t *v = realloc(live, cap * sizeof *live);
            s_snap_hold_t *h = v ? realloc(hold, cap * sizeof *hold) : NULL;
            live = v ? v : live;
            hold = h ? h : hold;
            if (!h) {
                pthread_mutex_unlock(&sh->lock);
                oom = true;
                break;
            }
        }
        for (uint32_t b = 0; b < sh->nbuckets; b++)
            for (s_obj_t *o = sh->buckets[b]; o; o = o->hnext)
                if (o->state == S_READY && o->jseq) {
                    live[n] = s_put_of(o, o->l2_pending > 0);
                    uint8_t *label = s_label_dup(o->label);
                    if (label)
                        live[n].label.ptr = label + 1;
                    s_ns_ref(self, o->ns);
                    hold[n++] = (s_snap_hold_t){o->ns, label};
                }
        pthread_mutex_unlock(&sh->lock);
    }
    char err[KVT_ERR_LEN] = "out of memory taking the snapshot";
    int rc = KVT_ENOMEM;
    if (oom) {
        kvt_journal_unmark(self->journal);
    } else {
        if (n)
            qsort(live, n, sizeof *live, s_by_seq_put);
        rc = kvt_journal_rewrite(self->journal, live, n, err, sizeof err);
    }
    pthread_rwlock_unlock(&self->commit_lock);
    for (size_t i = 0; i < n; i++) {
        s_ns_put(self, hold[i].ns);
        free(hold[i].label);
    }
    free(hold);
    free(live);
    if (rc == 0) {
        s_inc(&self->compactions, 1);
        kvt_log(KVT_LOG_DEBUG, "l1: journal compacted: %llu bytes -> %llu (%zu objects) in %lld us",
                (unsigned long long)bytes, (unsigned long long)kvt_journal_bytes(self->journal), n,
                (long long)(kvt_now_ns() - t0) / 1000);
    } else {
        kvt_log(KVT_LOG_WARN, "l1: cannot compact the journal: %s (it keeps growing)", err);
    }
}

static bool s_evictor(kvt_thread_t *t, void *arg)
{
    kvt_l1_t *self = arg;
    while (!kvt_queue_closed(self->ev_wake)) {
        if (!kvt_thread_beat(t))
            return false;
        if (self->resident)
            kvt_resident_beat(self->resident);
        s_check_arena(self);
        s_maybe_compact(self);
        uint64_t used = kvt_alloc_used(self->alloc);
        if (used > self->high_bytes) {
            uint64_t freed = kvt_l1_evict(self, used - self->low_bytes);
            kvt_log(KVT_LOG_DEBUG, "l1: evicted %llu bytes (used %llu > high watermark %llu)",
                    (unsigned long long)freed, (unsigned long long)used,
                    (unsigned long long)self->high_bytes);
        }
        void *token;
        if (kvt_queue_pop(self->ev_wake, &token, S_EVICT_TICK_MS) == 0)
            kvt_queue_task_done(self->ev_wake, 1);
    }
    return true;
}

/* ---- adoption (l1.adopt) ---- */

/* The summer: the XXH3-64 of each committed object that COMMIT did not sum, into the journal
 * as a SUM record, so that the next daemon can verify it. The object is pinned while queued.
 * SCHED_IDLE; a stop drains the queue (the serving threads are gone by then). */
static bool s_summer(kvt_thread_t *t, void *arg)
{
    kvt_l1_t *self = arg;
    const uint8_t *base = kvt_arena_base(self->arena);
    /* only CPU time nobody else wants: hashing every committed byte must not slow the threads
     * that serve (on a busy node objects then wait longer for their sum, and past the queue's
     * bound are not adoptable: counted in sums_skipped) */
    struct sched_param sp = {0};
    (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp);
    bool idle = true;
    for (;;) {
        if (!kvt_thread_beat(t))
            return false;
        if (idle && !atomic_load(&self->sum_on)) { /* stopping: drain at a normal priority */
            (void)pthread_setschedparam(pthread_self(), SCHED_OTHER, &sp);
            idle = false;
        }
        void *item;
        int rc = kvt_queue_pop(self->sum_q, &item, 500);
        if (rc == KVT_EUNAVAIL)
            break; /* closed and drained: a clean stop leaves every object summed */
        if (rc)
            continue;
        s_obj_t *o = item;
        uint64_t sum = XXH3_64bits(base + kvt_block_offset(o->block), o->length);
        s_shard_t *sh = s_shard(self, o->hash);
        pthread_mutex_lock(&sh->lock);
        if (o->state == S_READY && o->jseq && !atomic_load(&self->journal_lost)) {
            int jrc = kvt_journal_sum(self->journal, o->jseq, sum);
            if (jrc)
                s_journal_lost(self, jrc);
            o->sum = sum; /* has_sum stays false: GET does not check it (l1_checksum) */
            o->jsummed = true;
        }
        pthread_mutex_unlock(&sh->lock);
        s_unpin(self, o);
        kvt_queue_task_done(self->sum_q, 1);
    }
    return true;
}

/* The journal file's bytes, when it is a regular file of ours, mode 0600, of a sane size:
 * NULL with the reason in why otherwise. */
static uint8_t *s_read_journal(const char *path, size_t *len, char *why, size_t whylen)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        snprintf(why, whylen, "%s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    uint8_t *buf = NULL;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
        (st.st_mode & 0777) != 0600)
        snprintf(why, whylen, "%s is not a private file of this user", path);
    else if ((uint64_t)st.st_size > S_JOURNAL_MAX)
        snprintf(why, whylen, "%s is larger than %llu bytes", path,
                 (unsigned long long)S_JOURNAL_MAX);
    else if (!(buf = malloc((size_t)st.st_size + 1)))
        snprintf(why, whylen, "out of memory reading %s", path);
    size_t got = 0;
    while (buf && got < (size_t)st.st_size) {
        ssize_t r = read(fd, buf + got, (size_t)st.st_size - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            snprintf(why, whylen, "cannot read %s: %s", path, r ? strerror(errno) : "short");
            free(buf);
            buf = NULL;
            break;
        }
        got += (size_t)r;
    }
    close(fd);
    *len = got;
    return buf;
}

typedef struct {
    kvt_journal_put_t p;
    kvt_block_t *block; /* claimed; NULL once given up */
    s_obj_t *obj;       /* in the index; NULL once given up */
} s_adopted_t;

/* Checks one adopted object against its journaled checksum (pinned by the caller, so its
 * block stays): the bytes are hashed outside the shard lock; a mismatch removes it. */
static void s_verify_one(kvt_l1_t *self, s_obj_t *o)
{
    s_shard_t *sh = s_shard(self, o->hash);
    pthread_mutex_lock(&sh->lock);
    bool need = o->state == S_READY && o->unverified;
    pthread_mutex_unlock(&sh->lock);
    if (!need)
        return;
    bool ok = XXH3_64bits((const uint8_t *)kvt_arena_base(self->arena) + kvt_block_offset(o->block),
                          o->length) == o->sum;
    pthread_mutex_lock(&sh->lock);
    bool bad = o->state == S_READY && o->unverified && !ok;
    if (ok && o->state == S_READY && o->unverified)
        s_resident(self, o, true); /* the map shows adopted objects once they are checked */
    if (ok)
        o->unverified = false;
    pthread_mutex_unlock(&sh->lock);
    if (bad) {
        s_inc(&self->vdamaged, 1);
        s_inc(&self->vdamaged_bytes, o->length);
        s_damaged(self, o, "served after the restart");
    }
}

static void *s_verifier(void *arg)
{
    kvt_l1_t *self = arg;
    for (size_t i;
         !atomic_load(&self->vstop) && (i = atomic_fetch_add(&self->vnext, 1)) < self->vn;) {
        s_verify_one(self, self->vlist[i]);
        s_unpin(self, self->vlist[i]);
        if (atomic_fetch_sub(&self->vpending, 1) == 1) {
            uint64_t ms = (uint64_t)(kvt_now_ns() - self->vt0) / 1000000;
            atomic_store(&self->vdone_ms, ms ? ms : 1);
            kvt_log(KVT_LOG_INFO,
                    "l1: every adopted object checked, %llu ms after the start of the adoption; "
                    "%llu damaged (removed)",
                    (unsigned long long)ms, (unsigned long long)s_get(&self->vdamaged));
        }
    }
    return NULL;
}

/* Starts the check of the adopted objects on up to one thread per online CPU (at most 16):
 * XXH3 runs at memory speed per core, and the pages are faulted in on the way. */
static void s_verify_start(kvt_l1_t *self)
{
    if (!self->vn)
        return;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    size_t nt = cpus < 2 ? 1 : (size_t)(cpus > 16 ? 16 : cpus);
    for (; self->nvthreads < nt; self->nvthreads++)
        if (pthread_create(&self->vthreads[self->nvthreads], NULL, s_verifier, self) != 0)
            break;
    if (!self->nvthreads) /* no thread: checked here, before serving */
        s_verifier(self);
}

/* Stops the check: what is left stays unverified (and unserved; the next daemon checks it
 * again), each object unpinned. */
static void s_verify_stop(kvt_l1_t *self)
{
    atomic_store(&self->vstop, true);
    for (size_t i = 0; i < self->nvthreads; i++)
        pthread_join(self->vthreads[i], NULL);
    self->nvthreads = 0;
    size_t from = atomic_load(&self->vnext);
    for (size_t i = from < self->vn ? from : self->vn; i < self->vn; i++)
        s_unpin(self, self->vlist[i]);
    free(self->vlist);
    self->vlist = NULL;
    self->vn = 0;
}

/* Puts the journal's objects (ascending offsets) back into the index, each verified against
 * its checksum; into kept[0..*nkept) what was adopted (for the new journal). */
static void s_adopt_objects(kvt_l1_t *self, const kvt_journal_put_t *live, size_t n,
                            kvt_journal_put_t *kept, size_t *nkept)
{
    s_adopted_t *a = malloc((n ? n : 1) * sizeof *a);
    kvt_assert(a);
    size_t na = 0;
    for (size_t i = 0; i < n; i++) { /* ascending offsets: each claim is O(1) */
        const kvt_journal_put_t *p = &live[i];
        kvt_block_t *b = NULL;
        if (!p->has_sum)
            self->adopt.unverified++;
        else if (p->length > self->capacity || p->offset > self->capacity - p->length)
            self->adopt.rejected++;
        else if (!(b = kvt_alloc_claim(self->alloc, p->offset, p->length)))
            self->adopt.rejected++;
        if (b)
            a[na++] = (s_adopted_t){*p, b, NULL};
    }
    /* into the index and the LRU oldest first, so the most recent ends up at the head */
    qsort(a, na, sizeof *a, s_by_seq_put); /* p is s_adopted_t's first member */
    for (size_t i = 0; i < na; i++) {
        s_obj_t *o = calloc(1, sizeof *o);
        kvt_assert(o);
        o->key = a[i].p.key;
        o->ns = s_ns_get(self, &a[i].p.ns, true);
        o->hash = s_hash(o->ns, &o->key);
        o->length = a[i].p.length;
        o->block = a[i].block;
        /* the journal is ours, but what goes out as text is checked text */
        if (kvt_utf8_valid(a[i].p.label.ptr, a[i].p.label.len))
            o->label = s_label_new(&a[i].p.label);
        o->jseq = a[i].p.seq;
        o->owed_l2 = a[i].p.l2_pending;
        o->sum = a[i].p.sum;
        o->has_sum = self->cfg->l1_checksum;
        o->jsummed = true;
        o->state = S_READY;
        s_shard_t *sh = s_shard(self, o->hash);
        s_obj_t *dup = s_find(sh, o->ns, &o->key, o->hash);
        if (dup) { /* the same key twice (a DROP record lost): the later one wins */
            s_unlink(sh, dup);
            s_lru_remove(self, dup);
            for (size_t k = 0; k < i; k++)
                if (a[k].block == dup->block)
                    a[k].block = NULL, a[k].obj = NULL;
            self->adopt.rejected++;
            self->adopt.objects--;
            self->adopt.bytes -= dup->length;
            s_dec(&self->objects, 1);
            s_destroy_obj(self, dup);
        }
        o->unverified = true;
        o->pins = 1; /* the check's (s_verifier) */
        a[i].obj = o;
        s_insert(sh, o);
        s_lru_push_head(self, o);
        s_inc(&self->objects, 1);
        self->adopt.objects++;
        self->adopt.bytes += o->length;
    }
    /* checked most recent first: the objects most likely to be asked for soon */
    self->vlist = malloc((na ? na : 1) * sizeof *self->vlist);
    kvt_assert(self->vlist);
    for (size_t i = na; i-- > 0;)
        if (a[i].obj)
            self->vlist[self->vn++] = a[i].obj;
    atomic_store(&self->vpending, self->vn);
    if (!self->vn)
        atomic_store(&self->vdone_ms, 1);
    *nkept = 0;
    for (size_t i = 0; i < na; i++)
        if (a[i].block)
            kept[(*nkept)++] = a[i].p;
    free(a);
}

/* At start: adopt what the previous daemon left (kvt_arena_reused), or start empty saying why;
 * then open a new journal holding what was adopted. */
static void s_adopt(kvt_l1_t *self)
{
    const kvt_config_t *cfg = self->cfg;
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s", cfg->run_dir, S_JOURNAL);
    if (!cfg->l1_adopt) {
        (void)unlink(path); /* a journal of an earlier run with l1.adopt: stale from now on */
        snprintf(self->adopt.why, sizeof self->adopt.why, "l1.adopt is off");
        kvt_log(KVT_LOG_INFO, "l1: starting empty: %s", self->adopt.why);
        return;
    }
    int64_t t0 = kvt_now_ns();
    self->vt0 = t0;
    uint64_t dev, ino;
    kvt_arena_ident(self->arena, &dev, &ino);
    kvt_journal_header_t h = {0};
    uint8_t *buf = NULL;
    size_t len = 0, n = 0, nkept = 0, valid = 0;
    kvt_journal_put_t *live = NULL, *kept = NULL;
    char *why = self->adopt.why;
    size_t whylen = sizeof self->adopt.why;
    if (!kvt_arena_reused(self->arena)) {
        snprintf(why, whylen, "%s", kvt_arena_why_new(self->arena));
    } else if ((buf = s_read_journal(path, &len, why, whylen)) != NULL) {
        char err[200];
        uint64_t rejected = 0;
        if (kvt_journal_live(buf, len, &h, &live, &n, &rejected, &valid, err, sizeof err) != 0)
            snprintf(why, whylen, "the journal %s: %s", path, err);
        else if (strcmp(h.path, kvt_arena_path(self->arena)) != 0 ||
                 h.arena_size != kvt_arena_size(self->arena) || h.arena_dev != dev ||
                 h.arena_ino != ino)
            snprintf(why, whylen, "the journal %s describes another arena (%.300s)", path, h.path);
        else if (h.page_size != kvt_arena_page_size(self->arena))
            snprintf(why, whylen, "the arena's pages changed (%llu, now %llu bytes)",
                     (unsigned long long)h.page_size,
                     (unsigned long long)kvt_arena_page_size(self->arena));
        else {
            self->adopt.rejected = rejected;
            kept = n ? malloc(n * sizeof *kept) : NULL;
            kvt_assert(kept || !n);
            s_adopt_objects(self, live, n, kept, &nkept);
            self->adopt.adopted = true;
            why[0] = '\0';
        }
    }
    if (!self->adopt.adopted)
        kvt_arena_forget(self->arena);
    /* the objects not adopted: their blocks were never claimed, so the space is free */
    h = (kvt_journal_header_t){.arena_size = kvt_arena_size(self->arena),
                               .page_size = kvt_arena_page_size(self->arena),
                               .arena_dev = dev,
                               .arena_ino = ino,
                               .created = (uint64_t)time(NULL) * 1000000000ull};
    snprintf(h.path, sizeof h.path, "%s", kvt_arena_path(self->arena));
    char err[KVT_ERR_LEN];
    self->journal = kvt_journal_create(path, &h, kept, nkept, err, sizeof err);
    free(kept);
    free(live);
    free(buf);
    self->adopt.ms = (uint64_t)(kvt_now_ns() - t0) / 1000000;
    if (!self->journal) {
        kvt_log(KVT_LOG_ERROR, "l1: %s: the next daemon will start with an empty L1", err);
        kvt_arena_keep(self->arena, false); /* nothing could be adopted from it */
    }
    if (self->adopt.adopted)
        kvt_log(KVT_LOG_INFO,
                "l1: adopted %llu objects (%llu bytes) from the arena the previous daemon left, "
                "in %llu ms, each checked against its checksum from now on, before it is "
                "served; left out: %llu without a checksum, %llu damaged, %llu impossible",
                (unsigned long long)self->adopt.objects, (unsigned long long)self->adopt.bytes,
                (unsigned long long)self->adopt.ms, (unsigned long long)self->adopt.unverified,
                (unsigned long long)self->adopt.damaged, (unsigned long long)self->adopt.rejected);
    else
        kvt_log(KVT_LOG_INFO, "l1: starting empty: %s", why);
}

/* Adopted objects still owed to L2: owed again, and the listener (write-behind) told. */
static void s_requeue_owed(kvt_l1_t *self)
{
    s_batches_t bs = {0};
    for (uint32_t s = 0; s < S_SHARDS; s++) {
        s_shard_t *sh = &self->shards[s];
        pthread_mutex_lock(&sh->lock);
        for (uint32_t b = 0; b < sh->nbuckets; b++)
            for (s_obj_t *o = sh->buckets[b]; o; o = o->hnext) {
                if (o->state != S_READY || !o->owed_l2)
                    continue;
                o->owed_l2 = false;
                if (!self->l2_writes || o->l2_pending)
                    continue;
                s_pending_set(self, o, self->l2_writes);
                s_batches_add(self, &bs, o);
            }
        pthread_mutex_unlock(&sh->lock);
    }
    s_batches_emit(self, &bs, KVT_L1_STORED);
}

int kvt_l1_start(kvt_l1_t *self, kvt_sup_t *sup)
{
    self->evictor = kvt_thread_start(sup, "evictor", 2000, s_evictor, self);
    if (!self->evictor)
        return KVT_EINTERNAL;
    self->started = true;
    if (self->journal) {
        char err[KVT_ERR_LEN];
        self->sum_q = kvt_queue_new(S_SUM_QUEUE, 0, err, sizeof err); /* no eventfd: cannot fail */
        self->summer = kvt_thread_start(sup, "summer", 2000, s_summer, self);
        if (!self->summer)
            return KVT_EINTERNAL;
        atomic_store(&self->sum_on, true);
    }
    s_requeue_owed(self);
    s_verify_start(self);
    kvt_arena_background_start(self->arena);
    return 0;
}

/* ---- life cycle ---- */

void kvt_l1_stop(kvt_l1_t *self)
{
    if (!self->started)
        return;
    s_verify_stop(self);
    atomic_store(&self->sum_on, false);
    if (self->sum_q) /* the summer drains what is queued: a clean stop leaves all summed */
        kvt_queue_close(self->sum_q);
    kvt_thread_join(&self->summer);
    kvt_queue_close(self->ev_wake);
    kvt_thread_join(&self->evictor);
    if (self->resident) /* nothing beats it from now on: clients stop believing it at once */
        kvt_resident_close(self->resident);
    self->started = false;
}

kvt_l1_t *kvt_l1_new(const kvt_config_t *cfg, char *err, size_t errlen)
{
    kvt_arena_t *arena = kvt_arena_new(cfg, err, errlen);
    if (!arena)
        return NULL;
    kvt_l1_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->cfg = cfg;
    self->arena = arena;
    self->capacity = kvt_arena_size(arena) / KVT_PAGE * KVT_PAGE;
    self->alloc = kvt_alloc_new(self->capacity);
    self->leases = kvt_leases_new();
    kvt_assert(self->alloc);
    self->high_bytes = (uint64_t)(cfg->high_watermark * (double)self->capacity);
    self->low_bytes = (uint64_t)(cfg->low_watermark * (double)self->capacity);
    self->backlog_bytes = cfg->l2_backlog_max >= 1.0
                              ? UINT64_MAX
                              : (uint64_t)(cfg->l2_backlog_max * (double)self->capacity);
    for (uint32_t s = 0; s < S_SHARDS; s++) {
        pthread_mutex_init(&self->shards[s].lock, NULL);
        self->shards[s].nbuckets = S_BUCKETS0;
        self->shards[s].buckets = calloc(S_BUCKETS0, sizeof(s_obj_t *));
        kvt_assert(self->shards[s].buckets);
    }
    pthread_mutex_init(&self->lru_lock, NULL);
    pthread_mutex_init(&self->ns_lock, NULL);
    pthread_rwlockattr_t rwa;
    pthread_rwlockattr_init(&rwa);
    /* compaction must not wait for a pause in commits that never comes */
    pthread_rwlockattr_setkind_np(&rwa, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&self->commit_lock, &rwa);
    pthread_rwlockattr_destroy(&rwa);
    self->ev_wake = kvt_queue_new(1, 0, err, errlen); /* no eventfd: cannot fail */
    /* two slots per 64 KiB of L1: KV pages and chunks are rarely smaller, and a small map
     * stays in the caches and the TLB of the clients that probe it */
    uint64_t slots = cfg->resident_slots ? cfg->resident_slots : 2 * (self->capacity >> 16);
    if (slots > (1u << 24) && !cfg->resident_slots)
        slots = 1u << 24;
    char rerr[160];
    if (cfg->resident_map &&
        !(self->resident = kvt_resident_new((uint32_t)slots, rerr, sizeof rerr)))
        kvt_log(KVT_LOG_WARN, "l1: no residency map (%s): fast-path clients ask the daemon", rerr);
    if (!s_seed && getrandom(&s_seed, sizeof s_seed, 0) != sizeof s_seed)
        s_seed = kvt_now_ns() ^ (uint64_t)getpid();
    self->ns_table = zhashx_new();
    kvt_assert(self->ns_table);
    zhashx_set_key_hasher(self->ns_table, s_nskey_hash);
    zhashx_set_key_comparator(self->ns_table, s_nskey_cmp);
    zhashx_set_key_duplicator(self->ns_table, NULL);
    zhashx_set_key_destructor(self->ns_table, NULL);
    s_adopt(self);
    return self;
}

void kvt_l1_destroy(kvt_l1_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_l1_t *self = *self_p;
    kvt_l1_stop(self);
    s_verify_stop(self); /* never started: the pins of the check go */
    void *left;
    while (self->sum_q && kvt_queue_pop(self->sum_q, &left, 0) == 0)
        s_unpin(self, left); /* the summer never ran (a test that did not start L1) */
    kvt_queue_destroy(&self->sum_q);
    kvt_leases_destroy(&self->leases, s_drop_lease, self);
    for (uint32_t s = 0; s < S_SHARDS; s++) {
        s_shard_t *sh = &self->shards[s];
        for (uint32_t b = 0; b < sh->nbuckets; b++)
            for (s_obj_t *o = sh->buckets[b], *next; o; o = next) {
                next = o->hnext;
                s_destroy_obj(self, o);
            }
        free(sh->buckets);
        pthread_mutex_destroy(&sh->lock);
    }
    zhashx_destroy(&self->ns_table);
    kvt_journal_destroy(&self->journal); /* the file stays: the next daemon's to read */
    kvt_resident_destroy(&self->resident);
    kvt_alloc_destroy(&self->alloc);
    kvt_arena_destroy(&self->arena);
    pthread_mutex_destroy(&self->lru_lock);
    pthread_mutex_destroy(&self->ns_lock);
    pthread_rwlock_destroy(&self->commit_lock);
    kvt_queue_destroy(&self->ev_wake); /* a token left in it is not memory */
    free(self);
    *self_p = NULL;
}

void kvt_l1_set_listener(kvt_l1_t *self, kvt_l1_listener_fn fn, void *ctx)
{
    self->listener = fn;
    self->listener_ctx = ctx;
}

kvt_resident_t *kvt_l1_resident(const kvt_l1_t *self)
{
    return self->resident;
}

const char *kvt_l1_shm_path(const kvt_l1_t *self)
{
    return kvt_arena_path(self->arena);
}

uint64_t kvt_l1_page_size(const kvt_l1_t *self)
{
    return kvt_arena_page_size(self->arena);
}

uint64_t kvt_l1_map_size(const kvt_l1_t *self)
{
    return kvt_arena_size(self->arena);
}

uint64_t kvt_l1_capacity(const kvt_l1_t *self)
{
    return self->capacity;
}

void *kvt_l1_base(const kvt_l1_t *self)
{
    return kvt_arena_base(self->arena);
}

void kvt_l1_counts(kvt_l1_t *self, kvt_l1_counts_t *out)
{
    out->capacity = self->capacity;
    out->used = kvt_alloc_used(self->alloc);
    out->objects = s_get(&self->objects);
    out->reserved = s_get(&self->reserved);
    out->evictions = s_get(&self->evictions);
    out->leases_active = kvt_leases_active(self->leases);
    out->leases_expired = kvt_leases_expired_total(self->leases);
}

void kvt_l1_metrics_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    kvt_l1_t *self = ctx;
    kvt_alloc_stats_t st;
    kvt_alloc_stats(self->alloc, &st);
    kvt_l1_counts_t c;
    kvt_l1_counts(self, &c);
    const struct {
        const char *name, *help;
        kvt_metric_kind_t kind;
        double v;
    } rows[] = {
        {"l1_capacity_bytes", "Size of the L1 shared-memory arena.", KVT_METRIC_GAUGE,
         (double)st.capacity},
        {"l1_used_bytes", "Bytes of L1 allocated to objects (stored or reserved).",
         KVT_METRIC_GAUGE, (double)st.used},
        {"l1_free_bytes", "Bytes of L1 not allocated.", KVT_METRIC_GAUGE, (double)st.free},
        {"l1_largest_free_bytes", "Largest contiguous free range of L1.", KVT_METRIC_GAUGE,
         (double)st.largest_free},
        {"l1_fragmentation_ratio", "1 - largest free range / free bytes.", KVT_METRIC_GAUGE,
         st.fragmentation},
        {"l1_objects", "Objects stored in L1 and readable.", KVT_METRIC_GAUGE, (double)c.objects},
        {"l1_reserved_objects", "Objects reserved in L1 and not committed yet.", KVT_METRIC_GAUGE,
         (double)c.reserved},
        {"l1_evictions_total", "Objects evicted from L1.", KVT_METRIC_COUNTER, (double)c.evictions},
        {"l1_evicted_bytes_total", "Bytes evicted from L1.", KVT_METRIC_COUNTER,
         (double)s_get(&self->evicted_bytes)},
        {"l1_l2_pending_objects",
         "Objects not yet written to every L2 adapter (not evictable until they are).",
         KVT_METRIC_GAUGE, (double)s_get(&self->l2_pending_objects)},
        {"l1_l2_pending_bytes", "L1 bytes of the objects not yet written to every L2 adapter.",
         KVT_METRIC_GAUGE, (double)s_get(&self->l2_pending_bytes)},
        {"l1_l2_skipped_total",
         "Objects evicted before their L2 write because those waiting passed l2_backlog_max.",
         KVT_METRIC_COUNTER, (double)s_get(&self->l2_skipped)},
        {"l1_l2_skipped_bytes_total", "Bytes of the objects in l1_l2_skipped_total.",
         KVT_METRIC_COUNTER, (double)s_get(&self->l2_skipped_bytes)},
        {"l1_pinned", "1 when the L1 arena is locked in memory.", KVT_METRIC_GAUGE,
         kvt_arena_pinned(self->arena) ? 1.0 : 0.0},
        {"l1_page_size_bytes",
         "Page size the kernel maps the L1 arena with: 2097152 on huge pages, else 4096.",
         KVT_METRIC_GAUGE, (double)kvt_arena_page_size(self->arena)},
        {"l1_corrupt_total",
         "Objects whose bytes no longer matched their COMMIT checksum (l1_checksum): removed.",
         KVT_METRIC_COUNTER, (double)s_get(&self->corrupt)},
        {"l1_arena_truncated_total",
         "Times another process truncated the arena file: its size was restored and the objects "
         "past the cut dropped.",
         KVT_METRIC_COUNTER, (double)s_get(&self->truncations)},
        {"l1_adopted_objects",
         "Objects the daemon adopted at start from the arena its predecessor left (l1.adopt).",
         KVT_METRIC_GAUGE, (double)(self->adopt.objects - s_get(&self->vdamaged))},
        {"l1_adopt_verify_pending_objects",
         "Adopted objects not yet checked against their checksum (each is checked before it is "
         "served).",
         KVT_METRIC_GAUGE, (double)s_get(&self->vpending)},
        {"l1_adopt_left_out_objects",
         "Objects the journal named at start that were not adopted: no checksum yet, bytes that "
         "no longer matched it, or an impossible extent.",
         KVT_METRIC_GAUGE,
         (double)(self->adopt.unverified + self->adopt.damaged + s_get(&self->vdamaged) +
                  self->adopt.rejected)},
        {"l1_adopt_damaged_objects",
         "Adopted objects removed because their bytes did not match their checksum.",
         KVT_METRIC_GAUGE, (double)(self->adopt.damaged + s_get(&self->vdamaged))},
        {"l1_journal_ok",
         "1 while the L1 journal is written (the next daemon can adopt this L1), else 0.",
         KVT_METRIC_GAUGE, self->journal && !atomic_load(&self->journal_lost) ? 1.0 : 0.0},
        {"leases_active", "Leases held by clients.", KVT_METRIC_GAUGE, (double)c.leases_active},
        {"leases_expired_total", "Leases lost because their instance went silent.",
         KVT_METRIC_COUNTER, (double)c.leases_expired},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        kvt_sample_t s = {.name = rows[i].name, .help = rows[i].help, .kind = rows[i].kind,
                          .value = rows[i].v};
        emit(emit_ctx, &s);
    }
    if (self->resident) {
        kvt_resident_stats_t rs;
        kvt_resident_stats(self->resident, &rs);
        kvt_sample_t e = {.name = "resident_map_entries",
                          .help = "Keys the residency map clients read holds (READY in L1).",
                          .kind = KVT_METRIC_GAUGE, .value = (double)rs.entries};
        kvt_sample_t f = {.name = "resident_map_full_total",
                          .help = "Keys left out of the residency map: no free slot in their "
                                  "window (raise resident_slots when it grows).",
                          .kind = KVT_METRIC_COUNTER, .value = (double)rs.full};
        emit(emit_ctx, &e);
        emit(emit_ctx, &f);
    }
}

/* /status l1.adopt: what the start adopted, or why it started empty; the journal's state. */
static json_t *s_adopt_json(kvt_l1_t *self)
{
    kvt_queue_stats_t q = {0};
    if (self->sum_q)
        kvt_queue_stats(self->sum_q, &q);
    bool journal = self->journal && !atomic_load(&self->journal_lost);
    return json_pack(
        "{s:b,s:b,s:I,s:I,s:{s:I,s:I,s:I},s:I,s:I,s:I,s:s?,s:s?,s:I,s:I,s:I,s:I}", "enabled",
        self->cfg->l1_adopt, "adopted", self->adopt.adopted, "objects",
        (json_int_t)(self->adopt.objects - s_get(&self->vdamaged)), "bytes",
        (json_int_t)(self->adopt.bytes - s_get(&self->vdamaged_bytes)), "left_out", "unverified",
        (json_int_t)self->adopt.unverified, "damaged",
        (json_int_t)(self->adopt.damaged + s_get(&self->vdamaged)), "impossible",
        (json_int_t)self->adopt.rejected, "ms", (json_int_t)self->adopt.ms, "verify_pending",
        (json_int_t)s_get(&self->vpending), "verified_ms", (json_int_t)s_get(&self->vdone_ms),
        "cold_reason", self->adopt.adopted ? NULL : self->adopt.why, "journal",
        journal ? kvt_journal_path(self->journal) : NULL, "sums_pending",
        (json_int_t)(q.len + q.active), "sums_skipped", (json_int_t)s_get(&self->sums_skipped),
        "journal_bytes", (json_int_t)(self->journal ? kvt_journal_bytes(self->journal) : 0),
        "compactions", (json_int_t)s_get(&self->compactions));
}

json_t *kvt_l1_status_json(kvt_l1_t *self)
{
    kvt_alloc_stats_t st;
    kvt_alloc_stats(self->alloc, &st);
    kvt_l1_counts_t c;
    kvt_l1_counts(self, &c);
    json_t *st_json = json_pack(
        "{s:s,s:I,s:I,s:I,s:I,s:f,s:I,s:I,s:I,s:I,s:I,s:b,s:b,s:b,s:I,s:I,s:I,s:I}", "shm_path",
        kvt_arena_path(self->arena), "capacity", (json_int_t)st.capacity, "used",
        (json_int_t)st.used, "free", (json_int_t)st.free, "largest_free",
        (json_int_t)st.largest_free, "fragmentation", st.fragmentation, "objects",
        (json_int_t)c.objects, "reserved", (json_int_t)c.reserved, "evictions",
        (json_int_t)c.evictions, "leases_active", (json_int_t)c.leases_active, "leases_expired",
        (json_int_t)c.leases_expired, "pinned", kvt_arena_pinned(self->arena), "warm",
        kvt_arena_warm(self->arena), "huge_pages",
        kvt_arena_huge(self->arena), "page_size", (json_int_t)kvt_arena_page_size(self->arena),
        "high_watermark_bytes", (json_int_t)self->high_bytes, "low_watermark_bytes",
        (json_int_t)self->low_bytes, "corrupt", (json_int_t)s_get(&self->corrupt));
    if (st_json) {
        json_object_set_new(st_json, "adopt", s_adopt_json(self));
        json_t *backlog = json_pack(
            "{s:I,s:I,s:I,s:I,s:I}", "objects", (json_int_t)s_get(&self->l2_pending_objects),
            "bytes", (json_int_t)s_get(&self->l2_pending_bytes), "max_bytes",
            (json_int_t)(self->backlog_bytes == UINT64_MAX ? -1 : (int64_t)self->backlog_bytes),
            "skipped", (json_int_t)s_get(&self->l2_skipped), "skipped_bytes",
            (json_int_t)s_get(&self->l2_skipped_bytes));
        json_object_set_new(st_json, "l2_backlog", backlog);
    }
    if (st_json && self->resident) {
        kvt_resident_stats_t rs;
        kvt_resident_stats(self->resident, &rs);
        json_object_set_new(st_json, "resident_map",
                            json_pack("{s:I,s:I,s:I,s:I}", "slots", (json_int_t)rs.slots,
                                      "bytes", (json_int_t)kvt_resident_size(self->resident),
                                      "entries", (json_int_t)rs.entries, "full",
                                      (json_int_t)rs.full));
    }
    return st_json;
}
