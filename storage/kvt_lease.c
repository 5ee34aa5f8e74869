/* DESIGN: leases by id in a uint64 map and by owner in per-owner doubly linked lists (so BYE
 * and expiry take all of an owner's leases without a scan). Expired ids go into a bounded ring
 * (oldest overwritten) + a set so a late COMMIT learns lease_expired. One mutex; callers act on
 * a lease only after taking it out, so no lease is ever acted on twice. Nothing observable
 * depends on the maps' order: the only walk of by_id is destroy's.
 *
 * Byte accounts live in their own map (owner -> account), reference-counted under the mutex:
 * one reference per lease that carries bytes, one per request building a lease. Their byte
 * counters are atomics changed with compare-and-swap, so charging a key needs no lock. */
#include "kvt_lease.h"

#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_u64map.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define S_EXPIRED_KEEP 65536

/* the value of an id in `expired`: the set only needs a non-NULL mark */
static char s_expired_mark;

struct kvt_leases {
    pthread_mutex_t lock;
    uint64_t next_id;
    kvt_u64map_t *by_id;    /* id -> kvt_lease_t */
    kvt_u64map_t *by_owner; /* owner -> first kvt_lease_t of that owner */
    kvt_u64map_t *expired;  /* id -> &s_expired_mark, for the ids in expired_ring */
    uint64_t *expired_ring; /* S_EXPIRED_KEEP ids (allocated at the first expiry) */
    size_t expired_next;    /* the ring's slot the next expired id goes to */
    uint64_t expired_total;
    kvt_u64map_t *accounts; /* owner -> kvt_account_t */
};

struct kvt_account {
    uint64_t owner; /* the accounts key */
    uint32_t refs;  /* under the table lock */
    _Atomic uint64_t bytes;
};

kvt_leases_t *kvt_leases_new(void)
{
    kvt_leases_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    pthread_mutex_init(&self->lock, NULL);
    self->next_id = 1;
    self->by_id = kvt_u64map_new();
    self->by_owner = kvt_u64map_new();
    self->expired = kvt_u64map_new();
    self->accounts = kvt_u64map_new();
    return self;
}

void kvt_leases_destroy(kvt_leases_t **self_p, void (*drop)(kvt_lease_t *, void *), void *ctx)
{
    if (!self_p || !*self_p)
        return;
    kvt_leases_t *self = *self_p;
    for (kvt_lease_t *l = kvt_u64map_first(self->by_id); l; l = kvt_u64map_next(self->by_id)) {
        if (drop)
            drop(l, ctx);
        kvt_leases_settle(self, l);
        kvt_lease_free(l);
    }
    for (kvt_account_t *a = kvt_u64map_first(self->accounts); a;
         a = kvt_u64map_next(self->accounts))
        free(a); /* only accounts of requests still building a lease: none at shutdown */
    kvt_u64map_destroy(&self->accounts);
    kvt_u64map_destroy(&self->by_id);
    kvt_u64map_destroy(&self->by_owner);
    kvt_u64map_destroy(&self->expired);
    free(self->expired_ring);
    pthread_mutex_destroy(&self->lock);
    free(self);
    *self_p = NULL;
}

kvt_lease_t *kvt_lease_new(uint64_t owner, kvt_lease_kind_t kind, void *const *items, uint32_t n)
{
    kvt_lease_t *l = calloc(1, sizeof *l);
    kvt_assert(l);
    l->owner = owner;
    l->kind = kind;
    l->nitems = n;
    if (n) {
        l->items = malloc(n * sizeof *l->items);
        kvt_assert(l->items);
        memcpy(l->items, items, n * sizeof *l->items);
    }
    return l;
}

void kvt_lease_free(kvt_lease_t *l)
{
    if (l) {
        free(l->items);
        free(l);
    }
}

/* Indexes a lease under its id and owner; lock held. */
static void s_link(kvt_leases_t *self, kvt_lease_t *l)
{
    kvt_u64map_set(self->by_id, l->id, l);
    kvt_lease_t *head = kvt_u64map_get(self->by_owner, l->owner);
    l->prev_of_owner = NULL;
    l->next_of_owner = head;
    if (head)
        head->prev_of_owner = l;
    kvt_u64map_set(self->by_owner, l->owner, l);
}

uint64_t kvt_leases_add(kvt_leases_t *self, kvt_lease_t *l)
{
    pthread_mutex_lock(&self->lock);
    /* read the id under the lock: once linked, another thread may take and free the lease */
    uint64_t id = l->id = self->next_id++;
    s_link(self, l);
    pthread_mutex_unlock(&self->lock);
    return id;
}

void kvt_leases_restore(kvt_leases_t *self, kvt_lease_t *l)
{
    pthread_mutex_lock(&self->lock);
    s_link(self, l);
    pthread_mutex_unlock(&self->lock);
}

/* Unlinks from both indexes; lock held. */
static void s_unlink(kvt_leases_t *self, kvt_lease_t *l)
{
    kvt_u64map_remove(self->by_id, l->id);
    if (l->prev_of_owner)
        l->prev_of_owner->next_of_owner = l->next_of_owner;
    else if (l->next_of_owner)
        kvt_u64map_set(self->by_owner, l->owner, l->next_of_owner);
    else
        kvt_u64map_remove(self->by_owner, l->owner);
    if (l->next_of_owner)
        l->next_of_owner->prev_of_owner = l->prev_of_owner;
    l->prev_of_owner = l->next_of_owner = NULL;
}

int kvt_leases_take(kvt_leases_t *self, uint64_t id, uint64_t owner, int kind,
                    kvt_lease_t **out)
{
    int rc = 0;
    pthread_mutex_lock(&self->lock);
    kvt_lease_t *l = kvt_u64map_get(self->by_id, id);
    if (l && l->owner == owner && kind && (int)l->kind != kind)
        rc = KVT_EBADREQ;
    else if (l && l->owner == owner)
        s_unlink(self, l);
    else if (!l && kvt_u64map_get(self->expired, id))
        rc = KVT_ELEXPIRED;
    else
        rc = KVT_EUNKLEASE;
    pthread_mutex_unlock(&self->lock);
    *out = rc ? NULL : l;
    return rc;
}

/* Remembers `id` as expired, forgetting the oldest of the last S_EXPIRED_KEEP; lock held. */
static void s_remember_expired(kvt_leases_t *self, uint64_t id)
{
    if (!self->expired_ring) {
        self->expired_ring = calloc(S_EXPIRED_KEEP, sizeof *self->expired_ring);
        kvt_assert(self->expired_ring);
    }
    uint64_t *slot = &self->expired_ring[self->expired_next];
    if (self->expired_total >= S_EXPIRED_KEEP) /* the ring is full: *slot is the oldest */
        kvt_u64map_remove(self->expired, *slot);
    *slot = id;
    kvt_u64map_set(self->expired, id, &s_expired_mark);
    self->expired_next = (self->expired_next + 1) % S_EXPIRED_KEEP;
    self->expired_total++;
}

kvt_lease_t *kvt_leases_take_owner(kvt_leases_t *self, uint64_t owner, bool expired,
                                   size_t *count)
{
    size_t n = 0;
    kvt_lease_t *list = NULL;
    pthread_mutex_lock(&self->lock);
    kvt_lease_t *l;
    while ((l = kvt_u64map_get(self->by_owner, owner)) != NULL) {
        s_unlink(self, l);
        l->next_of_owner = list;
        list = l;
        n++;
        if (expired)
            s_remember_expired(self, l->id);
    }
    pthread_mutex_unlock(&self->lock);
    if (count)
        *count = n;
    return list;
}

size_t kvt_leases_active(kvt_leases_t *self)
{
    pthread_mutex_lock(&self->lock);
    size_t n = kvt_u64map_size(self->by_id);
    pthread_mutex_unlock(&self->lock);
    return n;
}

uint64_t kvt_leases_expired_total(kvt_leases_t *self)
{
    pthread_mutex_lock(&self->lock);
    uint64_t n = self->expired_total;
    pthread_mutex_unlock(&self->lock);
    return n;
}

kvt_lease_t *kvt_leases_peek(kvt_leases_t *self, uint64_t id, uint64_t owner)
{
    pthread_mutex_lock(&self->lock);
    kvt_lease_t *l = kvt_u64map_get(self->by_id, id);
    if (l && l->owner != owner)
        l = NULL;
    pthread_mutex_unlock(&self->lock);
    return l;
}

kvt_account_t *kvt_leases_account(kvt_leases_t *self, uint64_t owner)
{
    pthread_mutex_lock(&self->lock);
    kvt_account_t *a = kvt_u64map_get(self->accounts, owner);
    if (!a) {
        a = calloc(1, sizeof *a);
        kvt_assert(a);
        a->owner = owner;
        kvt_u64map_set(self->accounts, owner, a);
    }
    a->refs++;
    pthread_mutex_unlock(&self->lock);
    return a;
}

void kvt_leases_account_put(kvt_leases_t *self, kvt_account_t *a)
{
    if (!a)
        return;
    pthread_mutex_lock(&self->lock);
    kvt_assert(a->refs > 0);
    bool last = --a->refs == 0;
    if (last) {
        kvt_assert(atomic_load(&a->bytes) == 0);
        kvt_u64map_remove(self->accounts, a->owner);
    }
    pthread_mutex_unlock(&self->lock);
    if (last)
        free(a);
}

bool kvt_account_charge(kvt_account_t *a, uint64_t bytes, uint64_t limit, uint64_t *held)
{
    uint64_t cur = atomic_load_explicit(&a->bytes, memory_order_relaxed);
    do {
        if (held)
            *held = cur;
        if (limit && (cur + bytes > limit || cur + bytes < cur))
            return false;
    } while (!atomic_compare_exchange_weak_explicit(&a->bytes, &cur, cur + bytes,
                                                    memory_order_relaxed, memory_order_relaxed));
    return true;
}

void kvt_account_uncharge(kvt_account_t *a, uint64_t bytes)
{
    uint64_t was = atomic_fetch_sub_explicit(&a->bytes, bytes, memory_order_relaxed);
    kvt_assert(was >= bytes);
}

void kvt_leases_settle(kvt_leases_t *self, kvt_lease_t *l)
{
    if (!l->account)
        return;
    kvt_account_uncharge(l->account, l->bytes);
    kvt_leases_account_put(self, l->account);
    l->account = NULL;
    l->bytes = 0;
}

uint64_t kvt_leases_owner_bytes(kvt_leases_t *self, uint64_t owner)
{
    pthread_mutex_lock(&self->lock);
    const kvt_account_t *a = kvt_u64map_get(self->accounts, owner);
    uint64_t bytes = a ? atomic_load(&a->bytes) : 0;
    pthread_mutex_unlock(&self->lock);
    return bytes;
}
