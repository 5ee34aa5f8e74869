/* kvtier_ring: libkvtier's fast-path ring calls for clients in other languages (kvtier.h,
 * "the fast-path ring"): thin wrappers over common/kvt_ring. Kept apart from the rest of
 * libkvtier because it needs nothing else — no ZeroMQ, no msgpack — so the Python package
 * builds this file with kvt_ring.c and kvt_error.c into a library of its own
 * (client/python/setup.py) and has the fast path without libkvtier installed. Each handle is
 * used by one thread at a time (the caller's). */
#include "kvtier.h"

#include "kvt_error.h"
#include "kvt_ring.h"

#include <stdio.h>
#include <stdlib.h>

struct kvtier_ring {
    kvt_ring_t *ring;
};

kvtier_ring_t *kvtier_ring_attach(void *region, size_t size, uint32_t capacity, int producer,
                                  char *err, size_t errlen)
{
    char why[160] = "";
    kvt_ring_t *r =
        region ? kvt_ring_new(region, size, capacity,
                              producer ? KVT_RING_PRODUCER : KVT_RING_CONSUMER, why, sizeof why)
               : NULL;
    kvtier_ring_t *self = r ? malloc(sizeof *self) : NULL;
    if (!self) {
        if (err && errlen)
            snprintf(err, errlen, "%s", !region ? "no region" : r ? "out of memory" : why);
        kvt_ring_destroy(&r);
        return NULL;
    }
    self->ring = r;
    return self;
}

void kvtier_ring_detach(kvtier_ring_t *self)
{
    if (!self)
        return;
    kvt_ring_destroy(&self->ring);
    free(self);
}

size_t kvtier_ring_max_payload(const kvtier_ring_t *self)
{
    return kvt_ring_max_payload(self->ring);
}

int kvtier_ring_push(kvtier_ring_t *self, const void *const *frames, const size_t *lens, uint32_t n)
{
    kvt_ring_iov_t iov[16];
    if (n > 16 || (n && (!frames || !lens)))
        return KVT_EINVAL;
    for (uint32_t i = 0; i < n; i++)
        iov[i] = (kvt_ring_iov_t){frames[i], lens[i]};
    return kvt_ring_push(self->ring, iov, n);
}

int kvtier_ring_pop(kvtier_ring_t *self, void *buf, size_t cap, size_t *len)
{
    return kvt_ring_pop(self->ring, buf, cap, len);
}

int kvtier_ring_wait(kvtier_ring_t *self, size_t need, int64_t timeout_ns)
{
    return kvt_ring_wait(self->ring, need, timeout_ns);
}

void kvtier_ring_set_spin(kvtier_ring_t *self, uint32_t max_iterations)
{
    kvt_ring_set_spin(self->ring, max_iterations);
}

void kvtier_ring_stats(const kvtier_ring_t *self, kvtier_ring_stats_t *out)
{
    kvt_ring_stats_t st;
    kvt_ring_stats(self->ring, &st);
    *out = (kvtier_ring_stats_t){st.records, st.bytes, st.spin_hits, st.cooled,
                                 st.sleeps,  st.wakes, st.spin};
}

void kvtier_ring_close(kvtier_ring_t *self)
{
    kvt_ring_close(self->ring);
}
