/* kvt_evlog: the cache service's event log — every L1 and L2 change (stored, evicted, removed,
 * l2_stored, l2_removed), one record per change batch and namespace, numbered 1, 2, 3 ... in the
 * order they happened. It keeps the latest `capacity` records (and at most `max_bytes` of keys);
 * readers follow it with a cursor of their own (the last sequence number they read), so a reader
 * that falls behind loses the oldest records and can tell how many, and no reader slows a
 * writer. Its readers: the events publisher (daemon/kvt_events, --events) and the LMCache door's
 * poll_kv_events.
 *
 * Thread-safe: one leaf mutex. Records are reference-counted, so a reader formats them after
 * the lock is gone. */
#ifndef KVT_EVLOG_H
#define KVT_EVLOG_H

#include "kvt_key.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_evlog kvt_evlog_t;

typedef enum {
    KVT_EV_STORED,     /* in L1: a client stored it, or a load brought it back from L2 */
    KVT_EV_EVICTED,    /* out of L1 by eviction */
    KVT_EV_REMOVED,    /* out of L1 by CLEAR, DELETE or a failed check */
    KVT_EV_L2_STORED,  /* written to an L2 adapter */
    KVT_EV_L2_REMOVED, /* gone from an L2 adapter */
} kvt_ev_kind_t;

/* One record; read-only for readers, valid until they give it back (kvt_evlog_put). */
typedef struct {
    uint64_t seq;
    kvt_ev_kind_t kind;
    kvt_ns_t ns; /* points into the record */
    uint32_t n;
    const kvt_key_t *keys;
    const uint64_t *sizes;     /* each object's bytes; NULL when not known (l2_removed) */
    const kvt_bytes_t *labels; /* RESERVE/PUT `labels`; NULL when none has one */
    size_t bytes;              /* what the record takes */
    uint64_t wall_ms;          /* when it was logged */
    atomic_uint refs;
} kvt_evrec_t;

/* The event names on the events socket: "stored", "evicted", "removed", "l2_stored",
 * "l2_removed"; and the tier, "l1" or "l2". */
const char *kvt_ev_name(kvt_ev_kind_t kind);
const char *kvt_ev_tier(kvt_ev_kind_t kind);

/* capacity >= 1 records; max_bytes: the most key and namespace bytes kept (0: no limit). */
kvt_evlog_t *kvt_evlog_new(uint32_t capacity, size_t max_bytes);
void kvt_evlog_destroy(kvt_evlog_t **self_p);

/* Logs one change (n >= 1 keys; n == 0 logs nothing and returns 0): keys[0..n), and, where
 * not NULL, their sizes and labels (copied). Returns its seq. */
uint64_t kvt_evlog_append(kvt_evlog_t *self, kvt_ev_kind_t kind, const kvt_ns_t *ns,
                          const kvt_key_t *keys, const uint64_t *sizes,
                          const kvt_bytes_t *labels, uint32_t n);

/* Where a reader stands against the log. */
typedef struct {
    uint64_t first; /* the oldest record kept (last + 1 when none is) */
    uint64_t last;  /* the newest record (0: nothing was ever logged) */
} kvt_evlog_span_t;

/* Up to `max` records after `cursor`, oldest first, each with a reference the caller gives back
 * with kvt_evlog_put. Returns how many; *span says what the log held then (records after
 * cursor and before span.first are lost to this reader). */
uint32_t kvt_evlog_read(kvt_evlog_t *self, uint64_t cursor, kvt_evrec_t **out, uint32_t max,
                        kvt_evlog_span_t *span);

/* Gives back references from kvt_evlog_read. */
void kvt_evlog_put(kvt_evrec_t **recs, uint32_t n);

/* Waits up to timeout_ms for a record after `cursor`; true when there is one. False at once
 * once the log is closed. */
bool kvt_evlog_wait(kvt_evlog_t *self, uint64_t cursor, long timeout_ms);

/* Wakes every waiter for good (shutdown); appends still log. */
void kvt_evlog_close(kvt_evlog_t *self);

/* An id of this log, different for each daemon run (the wall clock in ns at its creation), so
 * a reader whose cursor came from another run can tell. */
uint64_t kvt_evlog_incarnation(const kvt_evlog_t *self);

kvt_evlog_span_t kvt_evlog_span(kvt_evlog_t *self);

#endif
