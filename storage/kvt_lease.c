/* DESIGN: leases by id in a czmq hash (key: the id in hex) and by owner in per-owner doubly
 * linked lists (so BYE and expiry take all of an owner's leases without a scan). Expired ids go
 * into a bounded FIFO + hash so a late COMMIT learns lease_expired. One mutex; callers act on
 * a lease only after taking it out, so no lease is ever acted on twice.
 *
 * Byte accounts live in their own hash (hex owner -> account), reference-counted under the
 * mutex: one reference per lease that carries bytes, one per request building a lease. Their
 * byte counters are atomics changed with compare-and-swap, so charging a key needs no lock. */
#include "kvt_lease.h"

#include "kvt_error.h"
#include "kvt_log.h"

#include <czmq.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define S_EXPIRED_KEEP 65536

struct kvt_leases {
    pthread_mutex_t lock;
    uint64_t next_id;
    zhashx_t *by_id;    /* hex id -> kvt_lease_t */
    zhashx_t *by_owner; /* hex owner -> first kvt_lease_t of that owner */
    zhashx_t *expired;  /* hex id -> (void *)1 */
    zlistx_t *expired_fifo; /* hex ids, oldest first */
    uint64_t expired_total;
    zhashx_t *accounts; /* hex owner -> kvt_account_t */
};

struct kvt_account {
    char key[17];  /* the owner in hex: the accounts key */
    uint32_t refs; /* under the table lock */
    _Atomic uint64_t bytes;
};

static void s_hex(uint64_t v, char out[17])
{
    snprintf(out, 17, "%016" PRIx64, v);
}

kvt_leases_t *kvt_leases_new(void)
{
    kvt_leases_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    pthread_mutex_init(&self->lock, NULL);
    self->next_id = 1;
    self->by_id = zhashx_new();
    self->by_owner = zhashx_new();
    self->expired = zhashx_new();
    self->expired_fifo = zlistx_new();
    self->accounts = zhashx_new();
    kvt_assert(self->by_id && self->by_owner && self->expired && self->expired_fifo &&
               self->accounts);
    zlistx_set_destructor(self->expired_fifo, (zlistx_destructor_fn *)zstr_free);
    return self;
}

void kvt_leases_destroy(kvt_leases_t **self_p, void (*drop)(kvt_lease_t *, void *), void *ctx)
{
    if (!self_p || !*self_p)
        return;
    kvt_leases_t *self = *self_p;
    for (kvt_lease_t *l = zhashx_first(self->by_id); l; l = zhashx_next(self->by_id)) {
        if (drop)
            drop(l, ctx);
        kvt_leases_settle(self, l);
        kvt_lease_free(l);
    }
    for (kvt_account_t *a = zhashx_first(self->accounts); a; a = zhashx_next(self->accounts))
        free(a); /* only accounts of requests still building a lease: none at shutdown */
    zhashx_destroy(&self->accounts);
    zhashx_destroy(&self->by_id);
    zhashx_destroy(&self->by_owner);
    zhashx_destroy(&self->expired);
    zlistx_destroy(&self->expired_fifo);
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
    char id[17], owner[17];
    s_hex(l->id, id);
    s_hex(l->owner, owner);
    zhashx_insert(self->by_id, id, l);
    kvt_lease_t *head = zhashx_lookup(self->by_owner, owner);
    l->prev_of_owner = NULL;
    l->next_of_owner = head;
    if (head)
        head->prev_of_owner = l;
    zhashx_update(self->by_owner, owner, l);
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
    char id[17], owner[17];
    s_hex(l->id, id);
    s_hex(l->owner, owner);
    zhashx_delete(self->by_id, id);
    if (l->prev_of_owner)
        l->prev_of_owner->next_of_owner = l->next_of_owner;
    else if (l->next_of_owner)
        zhashx_update(self->by_owner, owner, l->next_of_owner);
    else
        zhashx_delete(self->by_owner, owner);
    if (l->next_of_owner)
        l->next_of_owner->prev_of_owner = l->prev_of_owner;
    l->prev_of_owner = l->next_of_owner = NULL;
}

int kvt_leases_take(kvt_leases_t *self, uint64_t id, uint64_t owner, int kind,
                    kvt_lease_t **out)
{
    char key[17];
    s_hex(id, key);
    int rc = 0;
    pthread_mutex_lock(&self->lock);
    kvt_lease_t *l = zhashx_lookup(self->by_id, key);
    if (l && l->owner == owner && kind && (int)l->kind != kind)
        rc = KVT_EBADREQ;
    else if (l && l->owner == owner)
        s_unlink(self, l);
    else if (!l && zhashx_lookup(self->expired, key))
        rc = KVT_ELEXPIRED;
    else
        rc = KVT_EUNKLEASE;
    pthread_mutex_unlock(&self->lock);
    *out = rc ? NULL : l;
    return rc;
}

kvt_lease_t *kvt_leases_take_owner(kvt_leases_t *self, uint64_t owner, bool expired,
                                   size_t *count)
{
    char key[17];
    s_hex(owner, key);
    size_t n = 0;
    kvt_lease_t *list = NULL;
    pthread_mutex_lock(&self->lock);
    kvt_lease_t *l;
    while ((l = zhashx_lookup(self->by_owner, key)) != NULL) {
        s_unlink(self, l);
        l->next_of_owner = list;
        list = l;
        n++;
        if (!expired)
            continue;
        char id[17];
        s_hex(l->id, id);
        zhashx_insert(self->expired, id, (void *)1);
        zlistx_add_end(self->expired_fifo, strdup(id));
        self->expired_total++;
        if (zlistx_size(self->expired_fifo) > S_EXPIRED_KEEP) {
            char *old = zlistx_detach(self->expired_fifo, NULL);
            zhashx_delete(self->expired, old);
            free(old);
        }
    }
    pthread_mutex_unlock(&self->lock);
    if (count)
        *count = n;
    return list;
}

size_t kvt_leases_active(kvt_leases_t *self)
{
    pthread_mutex_lock(&self->lock);
    size_t n = zhashx_size(self->by_id);
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
    char key[17];
    s_hex(id, key);
    pthread_mutex_lock(&self->lock);
    kvt_lease_t *l = zhashx_lookup(self->by_id, key);
    if (l && l->owner != owner)
        l = NULL;
    pthread_mutex_unlock(&self->lock);
    return l;
}

kvt_account_t *kvt_leases_account(kvt_leases_t *self, uint64_t owner)
{
    char key[17];
    s_hex(owner, key);
    pthread_mutex_lock(&self->lock);
    kvt_account_t *a = zhashx_lookup(self->accounts, key);
    if (!a) {
        a = calloc(1, sizeof *a);
        kvt_assert(a);
        memcpy(a->key, key, sizeof key);
        zhashx_insert(self->accounts, a->key, a);
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
        zhashx_delete(self->accounts, a->key);
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
    char key[17];
    s_hex(owner, key);
    pthread_mutex_lock(&self->lock);
    const kvt_account_t *a = zhashx_lookup(self->accounts, key);
    uint64_t bytes = a ? atomic_load(&a->bytes) : 0;
    pthread_mutex_unlock(&self->lock);
    return bytes;
}
