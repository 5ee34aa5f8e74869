/* kvt_l2: the L2 adapter interface — what every second-tier store implements (fs, redis,
 * mock, and plugins loaded with dlopen).
 *
 * An adapter is a table of synchronous operations on opaque object names. The daemon never
 * calls them from the server loop: each configured adapter gets its own threads and queues in
 * kvt_l2mgr, which turns these calls into asynchronous submissions with deadlines and
 * completion callbacks. That split keeps adapters (and third-party plugins) simple — plain
 * blocking code — while the daemon keeps the promise that a slow backend never blocks a request.
 * An adapter's state may be used by several of its threads at once: an adapter that cannot
 * allow that sets `max_threads` to 1.
 *
 * Objects are opaque bytes to an adapter. What the daemon stores is the payload followed by a
 * 40-byte integrity trailer (l2/kvt_l2_trailer.h) that it writes and verifies itself, so every
 * adapter, plugins included, gets the same protection against corrupt bytes without doing
 * anything: an adapter stores and returns bytes, the daemon judges them.
 *
 * ABI 2 adds the vectored storev/loadv, which the daemon uses whenever a table has them: the
 * payload goes from and to the L1 arena in place and the trailer rides as its own vector, so
 * nothing is copied to glue the two together. ABI 1 tables (store/load only) still load; the
 * daemon then joins payload and trailer in a bounce buffer on store (one extra copy) and, on
 * load, reads in place when the L1 block has room for the trailer, else through a bounce buffer.
 *
 * ABI 3 adds flush: adapters whose stores are not durable one by one (fs with sync=batch)
 * make everything stored so far durable in one call, and the daemon reports an object as
 * written to L2 (the l2_stored event) only after the flush that follows its store. ABI 1 and 2
 * tables have no flush: each store is as durable as it will be when it returns.
 *
 * Names are 65 printable ASCII bytes + NUL: 32 hex digits of the namespace hash, '-', 32 hex
 * digits of the key (kvt_l2_name.h). Adapters treat them as opaque. */
#ifndef KVT_L2_H
#define KVT_L2_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define KVT_L2_NAME_LEN 66 /* 65 characters + NUL */
#define KVT_L2_ABI 3       /* what this header describes */
#define KVT_L2_ABI_MIN 1   /* the oldest ABI the daemon still loads */
#define KVT_L2_IOV_MAX 4   /* the most vectors the daemon passes to storev / loadv */

typedef struct kvt_l2_ops {
    uint32_t abi;         /* KVT_L2_ABI */
    const char *kind;     /* "fs", "redis", "mock", or the plugin's own */
    uint32_t max_threads; /* threads that may call into one state at once (>= 1) */

    /* Opens an adapter from the part of the spec after "kind:" ("DIR,capacity=10G"). Returns 0
     * and *state, or a negative KVT_E* code with one line in err. */
    int (*open)(const char *args, void **state, char *err, size_t errlen);
    void (*close)(void *state);

    /* Stores `len` bytes under `name`, replacing any previous object. Atomic: a crash leaves
     * either the old object, the new one, or none — never a torn one. */
    int (*store)(void *state, const char *name, const void *data, size_t len);

    /* 0 and the object's size when present; KVT_ENOTFOUND when absent. */
    int (*lookup)(void *state, const char *name, size_t *len);

    /* Reads the object into buf (cap bytes, 4 KiB aligned, cap a multiple of 4 KiB); *len is
     * its size. KVT_ENOTFOUND when absent, KVT_ENOSPC when it is larger than cap. */
    int (*load)(void *state, const char *name, void *buf, size_t cap, size_t *len);

    /* Removes the object; KVT_ENOTFOUND when absent. */
    int (*remove)(void *state, const char *name);

    /* 0 when the backend answers; otherwise a negative code and a sentence (for /readyz). */
    int (*health)(void *state, char *why, size_t whylen);

    /* Adapter-specific gauges for /status and /metrics (may be NULL): bytes and objects held. */
    void (*usage)(void *state, uint64_t *bytes, uint64_t *objects);

    /* ---- ABI 2: required from ABI 2 on; store and load above are then optional (the daemon
     * calls these instead). An ABI 1 table ends before them and they are never read. ---- */

    /* Stores the concatenation of iov[0..iovcnt) (1 <= iovcnt <= KVT_L2_IOV_MAX) under `name`,
     * atomically, as store does. The vectors' memory is only read. The daemon passes the
     * payload in the L1 arena (4 KiB aligned) then the trailer; adapters must not depend on it. */
    int (*storev)(void *state, const char *name, const struct iovec *iov, int iovcnt);

    /* Reads the object into iov[0..iovcnt) in order, as if they were one buffer. 0 and *len =
     * the object's size when it is at most their total (the first *len bytes are filled);
     * KVT_ENOSPC with *len when it is larger; KVT_ENOTFOUND when absent. */
    int (*loadv)(void *state, const char *name, const struct iovec *iov, int iovcnt, size_t *len);

    /* ---- ABI 3 (may be NULL): never read from an older table. ---- */

    /* Makes every store that returned 0 before this call as durable as the adapter's settings
     * promise. 0, or a negative KVT_E* code: the daemon then does not report those objects as
     * written. May be called by several threads at once. */
    int (*flush)(void *state);
} kvt_l2_ops_t;

/* A plugin shared object exports this function (plugin:PATH.so), whatever its ABI: the table's
 * `abi` says which layout it has. */
typedef const kvt_l2_ops_t *(*kvt_l2_plugin_fn)(void);
#define KVT_L2_PLUGIN_SYMBOL "kvt_l2_plugin_v1"

/* The built-in adapters. */
const kvt_l2_ops_t *kvt_l2_fs_ops(void);
const kvt_l2_ops_t *kvt_l2_redis_ops(void);
const kvt_l2_ops_t *kvt_l2_mock_ops(void);

#endif
