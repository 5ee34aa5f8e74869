/* kvt_queue: the one bounded FIFO that hands work between threads (worker jobs and their
 * results, events to publish, L2 write-behind and prefetch loads, L1 eviction wake-ups, GPU
 * handles to close).
 *
 * Owns a ring of (item, weight) pairs under one mutex; the queue never owns what the items
 * point to. The bound is in weight units (1 per item for most users; keys per job for L2
 * write-behind): a push that does not fit fails at once (or displaces the oldest items, when
 * asked), so a producer never blocks. Poppers wait with a timeout measured on CLOCK_MONOTONIC,
 * so a wall-clock step can neither stretch nor skip a heartbeat. Closing refuses new pushes and
 * wakes every waiter; poppers still get what was queued before it, then KVT_EUNAVAIL. Every
 * function is thread-safe, any thread. */
#ifndef KVT_QUEUE_H
#define KVT_QUEUE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_queue kvt_queue_t;

/* kvt_queue_new flag: the queue keeps an eventfd readable exactly while items wait
 * (kvt_queue_fd), so a poll loop can take them without a thread blocking in pop. */
#define KVT_QUEUE_FD 1u

/* Capacity for a queue whose length its producers bound already (say what bounds it where it is
 * created): pushes then never fail for room. */
#define KVT_QUEUE_BOUNDED_BY_CALLER SIZE_MAX

typedef struct {
    size_t len;        /* items waiting */
    size_t depth;      /* their total weight */
    size_t high_water; /* the largest depth seen */
    size_t active;     /* popped and not yet kvt_queue_task_done */
    uint64_t pushed;   /* accepted */
    uint64_t rejected; /* refused: full or closed */
    uint64_t displaced;
} kvt_queue_stats_t;

/* A queue of at most `capacity` weight units. NULL (with a sentence in err) only when
 * KVT_QUEUE_FD was asked for and no eventfd could be made. */
kvt_queue_t *kvt_queue_new(size_t capacity, unsigned flags, char *err, size_t errlen);

/* Frees the queue, not the items: take what is left first (kvt_queue_pop with timeout 0). No
 * thread may be using it. Accepts NULL. */
void kvt_queue_destroy(kvt_queue_t **self_p);

/* Appends `item` of `weight` units. 0; KVT_EBUSY when depth + weight would pass the capacity;
 * KVT_EUNAVAIL when closed. Never blocks. */
int kvt_queue_push(kvt_queue_t *self, void *item, size_t weight);

/* Appends `item`, first taking out the oldest items until it fits (an item heavier than the
 * whole capacity goes into the queue alone). Each displaced item is handed to drop(ctx, item)
 * on the caller's thread after the lock is released. 0 or KVT_EUNAVAIL when closed. */
int kvt_queue_push_displace(kvt_queue_t *self, void *item, size_t weight,
                            void (*drop)(void *ctx, void *item), void *ctx);

/* Takes the oldest item into *item, waiting at most timeout_ms for one (< 0: no limit; 0: no
 * wait). 0; KVT_ETIMEDOUT (*item = NULL); KVT_EUNAVAIL when closed and empty. */
int kvt_queue_pop(kvt_queue_t *self, void **item, int64_t timeout_ms);

/* As kvt_queue_pop, but takes up to `max` items at once into items[0..*n). */
int kvt_queue_pop_batch(kvt_queue_t *self, void **items, size_t max, size_t *n,
                        int64_t timeout_ms);

/* `n` popped items are finished (kvt_queue_wait_idle and the `active` count rely on every
 * consumer reporting them). */
void kvt_queue_task_done(kvt_queue_t *self, size_t n);

/* Waits at most timeout_ms until nothing is queued and every popped item was reported with
 * kvt_queue_task_done. 0 or KVT_ETIMEDOUT. Only for queues whose consumers report. */
int kvt_queue_wait_idle(kvt_queue_t *self, int64_t timeout_ms);

/* Refuses pushes from now on and wakes every waiting popper. Idempotent. */
void kvt_queue_close(kvt_queue_t *self);

bool kvt_queue_closed(kvt_queue_t *self);

/* Total weight waiting (the number of items when every weight is 1). */
size_t kvt_queue_depth(kvt_queue_t *self);

void kvt_queue_stats(kvt_queue_t *self, kvt_queue_stats_t *out);

/* With KVT_QUEUE_FD: readable while items wait; else -1. */
int kvt_queue_fd(const kvt_queue_t *self);

#endif
