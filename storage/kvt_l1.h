/* kvt_l1: the L1 tier — the shared-memory arena, its allocator, the object index, object
 * states, leases, LRU and the eviction controller.
 *
 * Objects are keyed by (ns, salt, 16-byte key). An object is RESERVED (under a write lease,
 * invisible to readers) until COMMIT makes it READY; READY objects may carry any number of read
 * pins (ACQUIRE, LOOKUP with lock); eviction takes only READY objects without pins, tail of the
 * LRU first. Within one stored or acquired prefix, later chunks are placed older, so the tail of
 * a prefix goes before its head. Leases belong to an owner (a client instance's session id);
 * kvt_l1_release_owner() drops them all at once (BYE, or the instance went silent).
 *
 * Thread safety: every call may come from any thread. The index is striped (64 shards, one
 * mutex each); the LRU, the allocator and the lease table have a mutex each. Lock order:
 * shard -> LRU; the allocator and lease locks are leaves. The eviction controller walks the LRU
 * holding its lock and only try-locks shards, so it never waits against that order. */
#ifndef KVT_L1_H
#define KVT_L1_H

#include "kvt_config.h"
#include "kvt_key.h"
#include "kvt_metrics.h"
#include "kvt_resident.h"
#include "kvt_supervisor.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_l1 kvt_l1_t;

/* Owner of the daemon's own leases (inline PUT/GET); client owners are session ids from 1 up. */
#define KVT_OWNER_DAEMON UINT64_MAX

/* STORED: committed by a client; LOADED: committed by a prefetch from L2 (already there). */
typedef enum { KVT_L1_STORED, KVT_L1_EVICTED, KVT_L1_REMOVED, KVT_L1_LOADED } kvt_l1_event_t;

/* One change: keys[0..n) of one namespace, each object's length in bytes, and their labels
 * (RESERVE/PUT `labels`; NULL when none of them has one, else len 0 for those without). All
 * views, valid during the listener's call. */
typedef struct {
    kvt_l1_event_t event;
    const kvt_ns_t *ns;
    const kvt_key_t *keys;
    const uint64_t *sizes;
    const kvt_bytes_t *labels;
    uint32_t n;
} kvt_l1_change_t;

/* Told, after the fact and outside every L1 lock, which keys of one namespace became readable,
 * were evicted or were removed; once per request (or eviction round) and namespace. Called from
 * whichever thread did the work. */
typedef void (*kvt_l1_listener_fn)(void *ctx, const kvt_l1_change_t *change);

/* A byte range of the arena. length == 0 means "nil": already stored (RESERVE). */
typedef struct {
    uint64_t offset;
    uint64_t length;
} kvt_slot_t;

/* Creates the arena (see kvt_arena.h) and the empty tier. NULL with a sentence in err. */
kvt_l1_t *kvt_l1_new(const kvt_config_t *cfg, char *err, size_t errlen);

/* Stops the eviction controller, drops every object and lease, unmaps and unlinks the arena. */
void kvt_l1_destroy(kvt_l1_t **self_p);

/* Sets the listener; start-up only, before any request. */
void kvt_l1_set_listener(kvt_l1_t *self, kvt_l1_listener_fn fn, void *ctx);

/* Starts the eviction controller thread, supervised as "evictor". 0 or KVT_EINTERNAL. */
int kvt_l1_start(kvt_l1_t *self, kvt_sup_t *sup);

/* Stops the eviction controller (idempotent; destroy does it too). After it, and once no
 * request runs, nothing in L1 calls the listener any more. */
void kvt_l1_stop(kvt_l1_t *self);

/* The residency map fast-path clients read (NULL with resident_map off, or when it could not
 * be made). */
kvt_resident_t *kvt_l1_resident(const kvt_l1_t *self);

const char *kvt_l1_shm_path(const kvt_l1_t *self);
/* The arena's page size in bytes (4096, or 2097152 on huge pages): HELLO's shm.page_size. */
uint64_t kvt_l1_page_size(const kvt_l1_t *self);
uint64_t kvt_l1_capacity(const kvt_l1_t *self);
/* Bytes of the arena file clients map (the objects' capacity, rounded to the arena's pages;
 * HELLO's shm.map_size). */
uint64_t kvt_l1_map_size(const kvt_l1_t *self);
void *kvt_l1_base(const kvt_l1_t *self);

/* RESERVE: for keys[0..n) in order, a slot of sizes[i] bytes (or `size` each when sizes is NULL)
 * under one write lease of `owner`. A key already present (stored or being stored) gets a nil
 * slot. When the arena is full, READY objects are evicted on demand; when even that cannot make
 * room, the keys reserved so far are returned (*nslots < n: the longest prefix that fits). If not
 * even the first key fits: KVT_ENOSPC. *lease is 0 when every slot is nil. */
int kvt_l1_reserve(kvt_l1_t *self, uint64_t owner, const kvt_ns_t *ns, const kvt_key_t *keys,
                   uint32_t n, const uint64_t *sizes,
                   uint64_t size, kvt_slot_t *slots, uint32_t *nslots, uint64_t *lease,
                   char *err, size_t errlen);

/* RESERVE with a label per key (labels NULL, or n entries; len 0: none; at most KVT_MAX_LABEL
 * bytes kept): the object keeps its label while in L1, and its events carry it. */
int kvt_l1_reserve_labeled(kvt_l1_t *self, uint64_t owner, const kvt_ns_t *ns,
                           const kvt_key_t *keys, const kvt_bytes_t *labels, uint32_t n,
                           const uint64_t *sizes, uint64_t size, kvt_slot_t *slots,
                           uint32_t *nslots, uint64_t *lease, char *err, size_t errlen);

/* COMMIT: the write lease's objects become READY, except the indices in failed[], which are
 * discarded. KVT_EUNKLEASE / KVT_ELEXPIRED / KVT_EBADREQ (a read lease, an index out of range).
 * While L2 write-behind is on (kvt_l1_set_l2_writes), a committed object is not evicted
 * until every adapter has written it (kvt_l1_l2_written) — unless the objects waiting fill more
 * than l2_backlog_max of L1: then eviction takes the oldest of them as well (l2_skipped). */
int kvt_l1_commit(kvt_l1_t *self, uint64_t owner, uint64_t lease, const uint64_t *failed,
                  uint32_t nfailed, uint32_t *stored, char *err, size_t errlen);

/* COMMIT of objects a prefetch loaded from L2: they are in L2 already (evictable at once) and
 * are announced as KVT_L1_LOADED. sums[i] (may be NULL) is the XXH3-64 the load verified of
 * item i, kept as its checksum under l1_checksum instead of hashing the bytes again. */
int kvt_l1_commit_loaded(kvt_l1_t *self, uint64_t owner, uint64_t lease, const uint64_t *failed,
                         uint32_t nfailed, const uint64_t *sums, uint32_t *stored, char *err,
                         size_t errlen);

/* Writes the bytes of the objects kvt_l1_write reserved: slots[i] for i < n, in the arena at
 * `base`; a nil slot (length 0) is a key that is stored already and gets nothing. Returns 0 to
 * commit them — except the indices it appends to failed[] (*nfailed; room for n), which are
 * discarded — or a KVT_E* code with a sentence in err to discard them all. For a load
 * (kvt_l1_write with `loaded`), sums[i] is item i's XXH3-64 as kvt_l1_commit_loaded takes it;
 * otherwise sums is NULL. */
typedef int (*kvt_l1_fill_fn)(void *ctx, uint8_t *base, const kvt_slot_t *slots, uint32_t n,
                              uint64_t *failed, uint32_t *nfailed, uint64_t *sums, char *err,
                              size_t errlen);

/* The daemon's own store into L1 (inline PUT, STORE_GPU, a prefetch load from L2): RESERVE
 * keys[0..n) under a daemon write lease (labels as for kvt_l1_reserve_labeled; sizes and size
 * as for kvt_l1_reserve: the longest prefix that fits), let `fill` write the new objects, then
 * COMMIT them (kvt_l1_commit_loaded when `loaded`) — or, when fill fails, release the lease,
 * which discards them. *stored is what COMMIT counts; *present (may be NULL) the keys of the
 * reserved prefix that were already stored. Returns RESERVE's error (KVT_ENOSPC: not even the
 * first key fits), fill's or COMMIT's; 0 without calling fill when every key is stored
 * already. */
int kvt_l1_write(kvt_l1_t *self, const kvt_ns_t *ns, const kvt_key_t *keys,
                 const kvt_bytes_t *labels, uint32_t n, const uint64_t *sizes, uint64_t size,
                 bool loaded, kvt_l1_fill_fn fill, void *ctx, uint32_t *stored,
                 uint32_t *present, char *err, size_t errlen);

/* Write-behind: every committed object must be written by `n` adapters before it may be
 * evicted (0, the default: no L2). Start-up only. */
void kvt_l1_set_l2_writes(kvt_l1_t *self, uint32_t n);

/* One adapter wrote the object (or gave up on it): one step closer to evictable. A key no
 * longer present is ignored. */
void kvt_l1_l2_written(kvt_l1_t *self, const kvt_ns_t *ns, const kvt_key_t *key);

/* ACQUIRE: pins the leading READY keys under one read lease; slots[0..*nslots). *lease is 0 when
 * nothing was found. For a client owner with max_leased_bytes set, the prefix ends before the
 * first key that would take the owner past it; KVT_ENOSPC when that leaves nothing although the
 * first key is READY (kvt_l1_owner_limit_error says why). */
int kvt_l1_acquire(kvt_l1_t *self, uint64_t owner, const kvt_ns_t *ns, const kvt_key_t *keys,
                   uint32_t n, kvt_slot_t *slots,
                   uint32_t *nslots, uint64_t *lease);

/* LOOKUP: how many leading keys are READY; with `lock`, pins them like ACQUIRE (the same
 * max_leased_bytes rule: *hits is then what was pinned). */
int kvt_l1_lookup(kvt_l1_t *self, uint64_t owner, const kvt_ns_t *ns, const kvt_key_t *keys,
                  uint32_t n, bool lock, uint32_t *hits,
                  uint64_t *lease);

/* RELEASE: drops a read lease (unpins) or a write lease (discards its reservations). */
int kvt_l1_release(kvt_l1_t *self, uint64_t owner, uint64_t lease);

/* REMOVE: removes READY objects (a pinned one disappears from the index at once and frees its
 * space when its last pin goes). */
int kvt_l1_remove(kvt_l1_t *self, const kvt_ns_t *ns, const kvt_key_t *keys, uint32_t n,
                  uint32_t *removed);

/* CLEAR: removes every READY object, or those of namespace `ns` (any salt) when ns != NULL. */
int kvt_l1_clear(kvt_l1_t *self, const uint8_t *ns, uint32_t ns_len, uint64_t *removed);

/* CLEAR of the READY objects whose namespace name starts with `prefix` (a front door's own
 * namespaces); with `keep_pinned`, objects under read pins stay. */
int kvt_l1_clear_prefix(kvt_l1_t *self, const uint8_t *prefix, uint32_t prefix_len,
                        bool keep_pinned, uint64_t *removed);

/* Releases every lease of `owner` (BYE, or silence past lease_ms when `expired`). Returns how
 * many leases were released. */
uint64_t kvt_l1_release_owner(kvt_l1_t *self, uint64_t owner, bool expired);

/* Evicts LRU objects until at least `bytes` are freed or nothing evictable is left; returns the
 * bytes freed. The controller calls it above the high watermark; tests call it directly. */
uint64_t kvt_l1_evict(kvt_l1_t *self, uint64_t bytes);

/* GET under l1_checksum: checks the first n objects of read lease `lease` of `owner` against the
 * checksums taken at their COMMIT and returns how many leading ones match (n without
 * l1_checksum). The first that does not is removed from L1 (counted in kvtier_l1_corrupt_total,
 * logged); the lease still pins it until released. */
uint32_t kvt_l1_verify(kvt_l1_t *self, uint64_t owner, uint64_t lease, uint32_t n);

/* Write-behind under l1_checksum: `sum` is the XXH3-64 the caller just computed of item i of its
 * read lease; 0 when it matches the COMMIT checksum (or none is kept), otherwise KVT_EIO and the
 * object is removed as by kvt_l1_verify (it must not be written to L2). */
int kvt_l1_check_sum(kvt_l1_t *self, uint64_t owner, uint64_t lease, uint32_t i, uint64_t sum);

/* Bytes `owner` holds under leases (the page-rounded sizes of the objects its reservations and
 * read pins cover); 0 for the daemon's own owner. For /status. */
uint64_t kvt_l1_owner_bytes(kvt_l1_t *self, uint64_t owner);

/* The sentence for an ACQUIRE or LOOKUP with lock refused by max_leased_bytes. */
void kvt_l1_owner_limit_error(kvt_l1_t *self, uint64_t owner, char *err, size_t errlen);

/* Metrics source: kvtier_l1_* and kvtier_leases_*. */
void kvt_l1_metrics_source(void *self, kvt_sample_fn emit, void *emit_ctx);

/* {shm_path, capacity, used, objects, pinned, huge_pages, page_size, ...} for /status. */
json_t *kvt_l1_status_json(kvt_l1_t *self);

typedef struct {
    uint64_t capacity, used, objects, reserved, evictions, leases_active, leases_expired;
} kvt_l1_counts_t;

void kvt_l1_counts(kvt_l1_t *self, kvt_l1_counts_t *out);

#endif
