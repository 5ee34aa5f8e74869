/* kvt_ring: a single-producer / single-consumer message ring in a caller-provided region of
 * shared memory (issue 17: the same-machine fast path, protocol v1 over another transport).
 *
 * A region is a 384-byte header (magic, version, capacity; the producer's `head` and the
 * consumer's `tail` on cache lines of their own, each with its side's futex wait word and
 * closed flag) followed by `capacity` bytes (a power of two) of 8-byte-aligned records. A
 * record is {u32 length, u32 kind} and `length` payload bytes; the payload of a message record
 * is the message's frames: u32 count, then per frame u32 length + bytes. Records wrap
 * byte-wise at the end of the data area (the 8-byte record header never does).
 *
 * Trust: the peer may write any byte of the region at any time. A handle keeps its own index
 * and the capacity privately and never reads them back; every value read from the region is
 * checked before use, a record is copied out before it is parsed, and a ring found malformed
 * is reported (KVT_EBADREQ) and refused from then on. No call reads or writes outside the
 * region, and every call returns in bounded time.
 *
 * One handle per side per ring: the producer's handle on its thread, the consumer's on its
 * thread (a handle is not thread-safe; the two sides may be in different processes). */
#ifndef KVT_RING_H
#define KVT_RING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVT_RING_MAGIC 0x31474e495254564bull /* "KVTRING1" as little-endian bytes */
#define KVT_RING_VERSION 1u
#define KVT_RING_HDR_SIZE 384u
#define KVT_RING_MIN_CAPACITY 64u
#define KVT_RING_MAX_CAPACITY (1u << 30)
#define KVT_RING_REC_HDR 8u  /* {u32 length, u32 kind} */
#define KVT_RING_KIND_MSG 1u /* the only kind of protocol v1 */

/* Byte offsets of the header's fields (documented layout; tests and fuzzers write there). */
#define KVT_RING_OFF_MAGIC 0u
#define KVT_RING_OFF_VERSION 8u
#define KVT_RING_OFF_HDR_SIZE 12u
#define KVT_RING_OFF_CAPACITY 16u
#define KVT_RING_OFF_EPOCH 20u        /* u32, bumped by each kvt_ring_format of the region */
#define KVT_RING_OFF_HEAD 128u        /* u64, bytes ever produced; written by the producer */
#define KVT_RING_OFF_PROD_WAIT 136u   /* u32 futex word: the producer sleeps for space */
#define KVT_RING_OFF_PROD_CLOSED 140u /* u32: the producer has gone */
#define KVT_RING_OFF_TAIL 256u        /* u64, bytes ever consumed; written by the consumer */
#define KVT_RING_OFF_CONS_WAIT 264u   /* u32 futex word: the consumer sleeps for data */
#define KVT_RING_OFF_CONS_CLOSED 268u /* u32: the consumer has gone */

typedef struct kvt_ring kvt_ring_t;

typedef enum { KVT_RING_PRODUCER = 1, KVT_RING_CONSUMER = 2 } kvt_ring_role_t;

/* One frame to push (a gather element). */
typedef struct {
    const void *ptr;
    size_t len;
} kvt_ring_iov_t;

/* One frame of a parsed record: points into the caller's copy of it. */
typedef struct {
    const uint8_t *ptr;
    uint32_t len;
} kvt_ring_frame_t;

typedef struct {
    uint64_t records;   /* pushed (producer) or popped (consumer) */
    uint64_t bytes;     /* record bytes, headers and padding included */
    uint64_t spin_hits; /* waits that ended while spinning */
    uint64_t cooled;    /* times spinning lost the CPU: waits then slept at once (kvt_ring_cool) */
    uint64_t sleeps;    /* futex waits entered */
    uint64_t wakes;     /* futex wakes issued to the peer */
    uint32_t spin;      /* the current spin budget (iterations) */
} kvt_ring_stats_t;

/* Bytes of a region holding a ring of `capacity` data bytes. */
size_t kvt_ring_region_size(uint32_t capacity);

/* Formats region[0..size) as an empty ring of `capacity` bytes, of `epoch` (the owner's count,
 * never read back from the region: the daemon hands a region to one client after another, and
 * a handle still attached from an earlier use finds the ring closed once the epoch moved on) (a power of two from
 * KVT_RING_MIN_CAPACITY to KVT_RING_MAX_CAPACITY; size must be kvt_ring_region_size(capacity)
 * or more). The region must be 8-byte aligned (a mapping is). 0 or KVT_EINVAL. Only the
 * region's owner (the daemon) formats, before anyone attaches. */
int kvt_ring_format(void *region, size_t size, uint32_t capacity, uint32_t epoch);

/* Attaches to a formatted region as one side. Validates magic, version, header size and that
 * the ring's capacity is `capacity` (what the owner announced) and fits in `size`; the side's
 * own index is taken from the region once (and checked against the other). NULL with a
 * sentence in err (errlen bytes) when the region is not such a ring. */
kvt_ring_t *kvt_ring_new(void *region, size_t size, uint32_t capacity, kvt_ring_role_t role,
                         char *err, size_t errlen);

/* Detaches (does not close the side: see kvt_ring_close). Accepts NULL; sets *self_p = NULL. */
void kvt_ring_destroy(kvt_ring_t **self_p);

/* Largest payload one record may carry (capacity - 8). */
size_t kvt_ring_max_payload(const kvt_ring_t *self);

/* Producer: the bytes a message of these frames takes as a payload (u32 count + per frame
 * u32 length + bytes), or SIZE_MAX when a frame is longer than a u32 can say. */
size_t kvt_ring_msg_size(const kvt_ring_iov_t *frames, uint32_t nframes);

/* Producer: appends one message record made of `nframes` frames and wakes the consumer when it
 * said it sleeps. 0; KVT_EBUSY when it does not fit now (nothing written); KVT_ETOOBIG when it
 * never can (larger than kvt_ring_max_payload); KVT_EUNAVAIL when the consumer closed its side;
 * KVT_EBADREQ when the ring is malformed (the consumer's tail is impossible): refused from
 * then on. */
int kvt_ring_push(kvt_ring_t *self, const kvt_ring_iov_t *frames, uint32_t nframes);

/* Producer: kvt_ring_push that leaves the consumer's wake to a later kvt_ring_wake (which must
 * follow). A thread answering many rings in one pass publishes every reply first and wakes the
 * sleepers after: a woken consumer then cannot take the CPU from it halfway (issue 29). */
int kvt_ring_push_later(kvt_ring_t *self, const kvt_ring_iov_t *frames, uint32_t nframes);

/* Producer: wakes the consumer if it sleeps (after kvt_ring_push_later; harmless otherwise). */
void kvt_ring_wake(kvt_ring_t *self);

/* Consumer: copies the next record's payload into buf[0..cap) and takes it off the ring,
 * waking the producer when it said it sleeps. 0 with *len set; KVT_EBUSY when the ring is
 * empty; KVT_EUNAVAIL when it is empty and the producer closed its side; KVT_ETOOBIG when the
 * payload is longer than cap (*len says how long; the record stays: a buffer of
 * kvt_ring_max_payload() bytes takes any record); KVT_EBADREQ when the ring is malformed
 * (impossible head, record length or kind): refused from then on. The payload is the caller's
 * copy: parse it with kvt_ring_parse, never the ring. */
int kvt_ring_pop(kvt_ring_t *self, void *buf, size_t cap, size_t *len);

/* Splits a message payload (a copy, never the live ring) into frames[0..*nframes). 0;
 * KVT_EBADREQ when it is not exactly u32 count + count x (u32 length + bytes); KVT_ETOOBIG
 * when count > max. Pure function of bytes. */
int kvt_ring_parse(const uint8_t *buf, size_t len, kvt_ring_frame_t *frames, uint32_t max,
                   uint32_t *nframes);

/* Waits until the ring has a record (consumer) or `need` payload bytes of room (producer;
 * `need` is ignored by the consumer): first an adaptive spin of at most the handle's spin
 * budget, then futex sleeps on this side's wait word, until the deadline of timeout_ns (0: do
 * not wait; < 0: no deadline). The peer wakes a sleeper only when its wait word says so, so
 * neither side makes a system call while the other is not asleep. 0 when ready;
 * KVT_ETIMEDOUT; KVT_EUNAVAIL when the peer closed its side (and, for the consumer, nothing is
 * left); KVT_EBADREQ when the ring is malformed; KVT_ETOOBIG (producer) when `need` can never
 * fit. */
int kvt_ring_wait(kvt_ring_t *self, size_t need, int64_t timeout_ns);

/* For a thread that waits on many rings at once (the daemon's futex_waitv): declares that
 * this side is about to sleep (its wait word := 1, then a full fence) and looks at the ring
 * once more. 1 when the side can go on now (do not sleep; call kvt_ring_disarm); 0 when the
 * caller may sleep on *word while it still holds 1 (the peer clears it and wakes it after
 * making progress); a negative code as kvt_ring_wait. `need` as kvt_ring_wait. */
int kvt_ring_arm(kvt_ring_t *self, size_t need, uint32_t **word);

/* Ends what kvt_ring_arm started (the wait word := 0). */
void kvt_ring_disarm(kvt_ring_t *self);

/* Closes this side: the peer's calls answer KVT_EUNAVAIL (a consumer once it has taken what
 * was pushed before) and a sleeping peer is woken. Idempotent. Does nothing once the region
 * was formatted again (a new epoch): it is no longer this handle's ring. */
void kvt_ring_close(kvt_ring_t *self);

/* True once a call found the ring malformed (every later call answers KVT_EBADREQ). */
bool kvt_ring_broken(const kvt_ring_t *self);

/* Why the ring was found malformed ("" while it is not): for the log. */
const char *kvt_ring_why(const kvt_ring_t *self);

/* The most spin iterations a wait makes before sleeping (default 4096; 0: sleep at once).
 * The budget adapts below it: halved after a wait that had to sleep, doubled after one that
 * the spin served. A spin that lost its CPU (a look at the clock more than
 * KVT_RING_PREEMPTED_NS after the previous one: descheduled) stops, and the waits of a pause
 * (kvt_ring_cool) sleep at once (`cooled`): with the CPUs busy, a spinner only keeps its peer
 * off them. */
void kvt_ring_set_spin(kvt_ring_t *self, uint32_t max_iterations);

/* A look at the clock this long after the previous one, mid-spin: the spinner was descheduled. */
#define KVT_RING_PREEMPTED_NS 200000

/* When a spinner may spin again: the rule the ring's waits and the daemon's fastpath thread
 * share (issue 29). Zeroed: spinning allowed. */
typedef struct {
    int64_t until; /* no spinning before this (CLOCK_MONOTONIC ns) */
    int64_t len;   /* the last pause's length */
} kvt_ring_cool_t;

/* A spin lost its CPU at `now` (CLOCK_MONOTONIC ns): no spinning for a pause. The first pause
 * is 1 ms; the next doubles (up to 50 ms) when the loss came within 100 ms of the previous
 * pause's end, and is halved for each quiet 100 ms before it otherwise (never below 1 ms): a
 * lone interrupt or a slice stolen by the hypervisor now and then costs 1 ms of sleeping
 * waits, CPU-bound neighbours (a loss soon after every pause) keep the spinner asleep for 50 ms
 * at a time. */
void kvt_ring_cool(kvt_ring_cool_t *c, int64_t now);

void kvt_ring_stats(const kvt_ring_t *self, kvt_ring_stats_t *out);

#endif
