/* kvt_lease: the lease table — who holds which L1 objects, for reading or writing.
 *
 * A lease has an id (never reused), an owner (a client instance's session id), a kind and the
 * objects it covers (opaque pointers owned by the L1 manager). Leases are taken out of the table
 * to be acted on (commit, release, expiry), so an id is acted on at most once. Ids of leases lost
 * to expiry are remembered (the last 65536) so that a late COMMIT/RELEASE is told lease_expired
 * rather than unknown_lease.
 *
 * Byte accounts: what each owner holds under its leases, for max_leased_bytes. An account is
 * charged key by key while a lease is being built (lock-free, so a limit is exact even when
 * requests of one owner run at once), the lease then carries the bytes and a reference to the
 * account, and settling the lease (whoever drops it) gives them back. Thread-safe: one mutex,
 * a leaf in the lock order; account counters are atomic. */
#ifndef KVT_LEASE_H
#define KVT_LEASE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum { KVT_LEASE_READ = 1, KVT_LEASE_WRITE = 2 } kvt_lease_kind_t;

typedef struct kvt_account kvt_account_t;

typedef struct kvt_lease {
    uint64_t id;
    uint64_t owner;
    kvt_lease_kind_t kind;
    uint32_t nitems;
    void **items;
    kvt_account_t *account; /* NULL, or the account `bytes` are charged to (one reference) */
    uint64_t bytes;
    struct kvt_lease *next_of_owner; /* table-internal */
    struct kvt_lease *prev_of_owner;
} kvt_lease_t;

typedef struct kvt_leases kvt_leases_t;

kvt_leases_t *kvt_leases_new(void);

/* Frees the table; leases still in it are handed to `drop` (may be NULL) first. */
void kvt_leases_destroy(kvt_leases_t **self_p, void (*drop)(kvt_lease_t *lease, void *ctx),
                        void *ctx);

/* A new lease holding a copy of items[0..n). Not yet in the table. */
kvt_lease_t *kvt_lease_new(uint64_t owner, kvt_lease_kind_t kind, void *const *items, uint32_t n);
void kvt_lease_free(kvt_lease_t *lease);

/* Puts a lease in the table and gives it a fresh id (returned, never 0). */
uint64_t kvt_leases_add(kvt_leases_t *self, kvt_lease_t *lease);

/* Takes lease `id` out of the table when `owner` holds it and, unless `kind` is 0, it is of that
 * kind. Returns 0, KVT_ELEXPIRED (it expired), KVT_EUNKLEASE (never existed, already released,
 * or held by another owner) or KVT_EBADREQ (another kind; the lease stays). */
int kvt_leases_take(kvt_leases_t *self, uint64_t id, uint64_t owner, int kind,
                    kvt_lease_t **out);

/* Puts a lease that was taken out back in the table under its id (a request that turned out
 * invalid after the take must not cost the client its lease). */
void kvt_leases_restore(kvt_leases_t *self, kvt_lease_t *lease);

/* Takes every lease of `owner` out of the table; returns them as a list linked through
 * next_of_owner. With `expired`, their ids are remembered as expired and counted. */
kvt_lease_t *kvt_leases_take_owner(kvt_leases_t *self, uint64_t owner, bool expired,
                                   size_t *count);

size_t kvt_leases_active(kvt_leases_t *self);
uint64_t kvt_leases_expired_total(kvt_leases_t *self);

/* Lease `id` while `owner` holds it, left in the table: only for the holder, which knows
 * nobody else acts on it meanwhile. NULL when there is no such lease. */
kvt_lease_t *kvt_leases_peek(kvt_leases_t *self, uint64_t id, uint64_t owner);

/* The byte account of `owner` (created at 0 bytes), with one more reference for the caller. */
kvt_account_t *kvt_leases_account(kvt_leases_t *self, uint64_t owner);

/* Drops a reference; the last one frees the account (it must be at 0 bytes then). NULL is
 * fine. */
void kvt_leases_account_put(kvt_leases_t *self, kvt_account_t *account);

/* Adds `bytes` to the account when it stays within `limit` (0: no limit) and returns true;
 * otherwise changes nothing and returns false. *held (may be NULL) gets what it held before. */
bool kvt_account_charge(kvt_account_t *account, uint64_t bytes, uint64_t limit, uint64_t *held);

void kvt_account_uncharge(kvt_account_t *account, uint64_t bytes);

/* Gives a lease's bytes back to its account and drops its reference (the lease is being let
 * go: released, committed or expired). Idempotent. */
void kvt_leases_settle(kvt_leases_t *self, kvt_lease_t *lease);

/* Bytes `owner` holds under leases now (0 when it holds none). */
uint64_t kvt_leases_owner_bytes(kvt_leases_t *self, uint64_t owner);

#endif
