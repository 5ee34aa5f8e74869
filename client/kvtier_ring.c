/* kvtier_ring: libkvtier's fast-path ring calls for clients in other languages (kvtier.h,
 * "the fast-path ring"): thin wrappers over common/kvt_ring. Kept apart from the rest of
 * libkvtier because it needs nothing else — no ZeroMQ, no msgpack — so the Python package
 * builds this file with kvt_ring.c, kvt_resident.c and kvt_error.c into a library of its own
 * (client/python/setup.py) and has the fast path without libkvtier installed (without the
 * residency map where xxhash.h is missing: KVT_NO_RESIDENT). Each handle is
 * used by one thread at a time (the caller's). */
#include "kvtier.h"

#include "kvt_error.h"
#include "kvt_ring.h"
#ifndef KVT_NO_RESIDENT
#include "kvt_resident.h"
#endif

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

#ifndef KVT_NO_RESIDENT
int64_t kvtier_resident_prefix(const void *region, size_t size, const void *ns, size_t ns_len,
                               const void *salt, size_t salt_len, const void *keys, uint32_t n)
{
    kvt_resident_view_t v;
    char why[120];
    if (!ns || ns_len == 0 || ns_len > KVT_MAX_NS || salt_len > KVT_MAX_SALT ||
        (uintptr_t)region % 8 || /* the slots are loaded as aligned 64-bit atomics */
        (salt_len && !salt) || (n && !keys) ||
        kvt_resident_view(region, size, &v, why, sizeof why) != 0)
        return KVT_EINVAL;
    if (!kvt_resident_fresh(&v))
        return KVT_EUNAVAIL;
    kvt_ns_t nsv = {ns, (uint32_t)ns_len, salt, (uint32_t)salt_len};
    return kvt_resident_prefix(&v, &nsv, keys, n);
}
#endif
