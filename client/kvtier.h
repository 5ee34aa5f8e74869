/* libkvtier: the C client of the kvtier daemon (wire protocol v1).
 *
 * A kvtier_t is one DEALER connection that has said HELLO under a stable instance name. It is
 * NOT thread-safe: use one kvtier_t per thread (several per process is fine; give each its own
 * instance name: an instance belongs to the connection that created it, and another connection
 * joins it only with the token its HELLO returned). Calls are synchronous with a per-call
 * timeout; a reply that arrives after its call timed out is discarded by uid. Every call returns
 * 0 or a negative KVTIER_E* code (below); kvtier_last_error() has the server's message.
 * Output pointers for counts (stored, removed, l1, loaded, lease, job) may be NULL.
 *
 * Liveness (docs/protocol.md, "Client liveness"): the daemon drops an instance that sends
 * nothing for lease_ms (kvtier_info), with its leases and GPU registrations. So each kvtier_t
 * has a heartbeat while connected: a thread of its own with a connection of its own, which
 * joins the instance (HELLO with its token) one interval after connect and then sends
 * PING {instance} every interval, so an idle kvtier_t keeps its instance, leases and GPU
 * registrations. Interval: KVTIER_HEARTBEAT_MS (read at connect; at least 10), else lease_ms / 3
 * within [100 ms, 10 s]; KVTIER_HEARTBEAT_MS=0 runs without one. The calls themselves take no
 * lock and make no system call for it (one atomic load). The heartbeat holds the instance as
 * long as the process lives and the handle is open: a lease the caller forgets is held until
 * kvtier_close, not lease_ms.
 *
 * The arena HELLO names is mapped at connect (and again after a daemon restart) lazily: each
 * page faults in on first touch. KVTIER_MAP_POPULATE=1 maps it with MAP_POPULATE;
 * KVTIER_MAP_POPULATE=background faults it in from a thread of the handle's own, joined before
 * the arena is unmapped (docs/protocol.md, "The shared-memory data path").
 *
 * If the instance was dropped anyway (heartbeat disabled, the process stopped, the daemon
 * restarted), libkvtier re-establishes it transparently — when a call answers instance_dropped
 * (KVTIER_ENOINST), or before the next call when the heartbeat found it gone: it says HELLO
 * again (same instance name, its token); if that made the instance anew, it maps the new arena
 * if the daemon announced another one (a restarted daemon: the old mapping is unmapped) and
 * registers again every GPU layout registered with kvtier_register_gpu (and not unregistered);
 * then the call that answered instance_dropped is sent once more. Not sent again: kvtier_commit,
 * kvtier_release and
 * kvtier_release_async (the lease they name died with the instance: they answer lease_expired
 * or unknown_lease), and kvtier_unregister_gpu (the registration died too: it returns 0). What a
 * caller may observe: slots and leases handed out before the drop are gone — their bytes may be
 * reused at any time, and after a daemon restart their pointers point into an unmapped range
 * (do not touch them); a commit of such a lease fails; STORE_GPU/RETRIEVE_GPU fail with the
 * reason if registering a layout again failed. A HELLO that fails again (no daemon) is the
 * call's error; the next call tries again.
 *
 * Fast path (docs/protocol.md, "Fast path"): HELLO asks the daemon for a pair of rings in the
 * arena (KVTIER_FASTPATH=0, read at connect, never asks). With a pair, every request without
 * data (all but PUT and GET) whose message fits in a ring record goes through shared memory
 * instead of the socket, with the same replies and errors; kvtier_release_async too. The pair
 * is given up, and the calls go over the socket again, when the daemon declines or closes it
 * (a call in flight on it then fails with KVTIER_EUNAVAIL: it may or may not have run); a
 * later HELLO (re-establishment) asks again. A child forked after connect never uses it. */
#ifndef KVTIER_H
#define KVTIER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvtier kvtier_t;

/* Error codes (the daemon's own numbers; the wire code each maps to is in quotes). */
#define KVTIER_EBADREQ (-1)   /* "bad_request" */
#define KVTIER_EUNKTYPE (-2)  /* "unknown_type" */
#define KVTIER_EVERSION (-3)  /* "unsupported_version" */
#define KVTIER_ETOOBIG (-4)   /* "too_large" */
#define KVTIER_ENOSPC (-5)    /* "no_space" */
#define KVTIER_ENOTFOUND (-6) /* "not_found" */
#define KVTIER_ELEXPIRED (-7) /* "lease_expired" */
#define KVTIER_EUNKLEASE (-8) /* "unknown_lease" */
#define KVTIER_EBUSY (-9)     /* "busy" */
#define KVTIER_EINTERNAL (-10)
#define KVTIER_EUNAVAIL (-11) /* "unavailable": also no arena mapped, daemon unreachable */
#define KVTIER_ENOMEM (-12)
#define KVTIER_EIO (-13)
#define KVTIER_ETIMEDOUT (-14) /* no reply within the call's timeout */
#define KVTIER_EINVAL (-15)    /* invalid arguments, caught before sending */
/* "instance_dropped": this connection acts for no instance (it was dropped, or the daemon
 * restarted). libkvtier says HELLO again and retries by itself (Liveness, above): a caller sees
 * it only from a call that is not retried, or when the retried call answered it again. */
#define KVTIER_ENOINST (-16)

/* A sentence for an error code ("no space in tier"); never NULL. */
const char *kvtier_strerror(int code);

/* The wire error code string ("no_space"); never NULL. */
const char *kvtier_error_code(int code);

/* What HELLO answered. */
typedef struct {
    uint32_t version;
    char server[64];
    uint32_t chunk_tokens;
    uint32_t lease_ms;
    uint64_t max_message;
} kvtier_info_t;

/* Connects to `endpoint` ("ipc:///run/kvtier/kvtier.sock", "tcp://127.0.0.1:5555"), says HELLO
 * as `client` with instance `instance` (NULL: "<client>-<pid>-<n>"; names are at most 256
 * bytes) and starts the heartbeat (above). NULL on failure with a sentence in err. `timeout_ms`
 * bounds every later call (0: 5000). tcp:// endpoints use CURVE when KVTIER_CURVE_SERVERKEY is
 * set (see kvtier_connect_curve); the heartbeat's connection uses the same keys.
 *
 * Every connection of a process shares one zmq context with KVTIER_IO_THREADS I/O threads
 * (environment, read at the first connect; default 2). KVTIER_SPIN_US (read at each connect;
 * default 0) makes the calls of this connection busy-poll for their reply up to that many
 * microseconds before sleeping: lower latency for a thread that waits on the daemon, paid for
 * with a busy core — for engines with cores to spare, not for many threads on a few cores. */
kvtier_t *kvtier_connect(const char *endpoint, const char *client, const char *instance,
                         int timeout_ms, char *err, size_t errlen);

/* CURVE for tcp:// endpoints of a daemon configured with curve.server_cert (ipc:// endpoints
 * ignore it). server_key: the daemon's public key, as 40 Z85 characters or the path of its
 * public certificate. client_cert: this client's certificate as `kvtier keygen PATH` wrote it
 * (PATH, with the secret half in PATH_secret); its public half must be in the daemon's
 * curve.clients directory. NULL client_cert: a throw-away key pair, which only a daemon that
 * accepts any key answers. A daemon that does not accept the keys does not answer at all, so
 * connect then fails with a timeout. */
typedef struct {
    const char *server_key;
    const char *client_cert;
} kvtier_curve_t;

/* kvtier_connect with CURVE. curve NULL: from the environment, as kvtier_connect does —
 * KVTIER_CURVE_SERVERKEY (key or certificate path) and KVTIER_CURVE_CERT (client_cert), used
 * for tcp:// endpoints when KVTIER_CURVE_SERVERKEY is set. */
kvtier_t *kvtier_connect_curve(const char *endpoint, const char *client, const char *instance,
                               int timeout_ms, const kvtier_curve_t *curve, char *err,
                               size_t errlen);

/* Writes a new CURVE key pair as certificates in czmq's zcert format: `path` (public, 0644) and
 * `path`_secret (0600); neither may exist yet. public_key (41 bytes, may be NULL) receives the
 * public key as Z85 text. 0 or KVTIER_EINVAL with a sentence in err. */
int kvtier_curve_keygen(const char *path, char *public_key, char *err, size_t errlen);

/* Stops the heartbeat (at once, whether or not the daemon answers), says BYE (releasing every
 * lease of the instance; waits at most the handle's timeout), closes and frees. Accepts NULL.
 * In a child forked after connect it frees the child's copy and leaves the parent's instance
 * alone (no BYE). */
void kvtier_close(kvtier_t **self_p);

const kvtier_info_t *kvtier_info(const kvtier_t *self);

/* PING {instance}: a round trip that also tells whether the instance is alive — if it was
 * dropped, it is re-established (above) and kvtier_ping returns 0. */
int kvtier_ping(kvtier_t *self);

/* STATS as a JSON text (caller frees with free()). */
int kvtier_stats(kvtier_t *self, char **json_out);

/* ---- the cache ----
 * ns names the model and KV layout; salt (NULL or "" for none) isolates tenants. Keys are
 * 16-byte chunk hashes (kvtier_hash_tokens). All calls are prefix calls: they stop at the first
 * key that is missing. */

#define KVTIER_KEY_LEN 16
#define KVTIER_LOCK 1u     /* LOOKUP: pin the hits under a read lease */
#define KVTIER_PREFETCH 2u /* LOOKUP: load the L2 part of the prefix into L1 */

/* A place in the shared-memory arena. ptr points into this client's own mapping of it;
 * ptr == NULL (length 0) is a nil slot: the key is already stored, nothing to write. */
typedef struct {
    void *ptr;
    uint64_t offset;
    uint64_t length;
} kvtier_slot_t;

/* A copy of an object's bytes from kvtier_get (free data with free()). */
typedef struct {
    void *data;
    size_t len;
} kvtier_buf_t;

/* The arena as this client mapped it at connect (read-write, MAP_SHARED); *size is the L1
 * capacity. */
void *kvtier_arena(const kvtier_t *self, size_t *size);

/* 1 when this handle's requests go over the fast path's ring pair (see "Fast path" above), 0
 * when over the socket (declined, KVTIER_FASTPATH=0, no arena mapped, closed by the daemon, or
 * a forked child's copy of the handle). */
int kvtier_fastpath_active(const kvtier_t *self);

/* LOOKUP: *hits = leading keys present (any tier), *l1 = leading keys in L1. With KVTIER_LOCK,
 * *lease pins them (0 when none); with KVTIER_PREFETCH, *job is a job id for
 * kvtier_prefetch_status. lease, job and l1 may be NULL. */
int kvtier_lookup(kvtier_t *self, const char *ns, const char *salt,
                  const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, unsigned flags,
                  uint32_t *hits, uint32_t *l1, uint64_t *lease, uint64_t *job);

/* The residency map (docs/protocol.md "Residency map"), which comes with the fast path's pair:
 * *l1 = how many leading keys are READY in L1 now (or were a moment ago), without a request.
 * Fewer than n says nothing about the rest (L2, or a key the map left out): kvtier_lookup
 * knows. KVTIER_EUNAVAIL when the map cannot answer: no pair or no map with it (an older
 * daemon, resident_map off), the daemon gone (its handoff connection, looked at every
 * KVTIER_RESIDENT_PEER_CHECK_MS at most) or not beating it for a second, a forked child's copy
 * of the handle. */
#define KVTIER_RESIDENT_PEER_CHECK_MS 10 /* a poll of the connection costs more than a probe */
int kvtier_resident(kvtier_t *self, const char *ns, const char *salt,
                    const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, uint32_t *l1);

/* PREFETCH_STATUS of a job from kvtier_lookup. */
int kvtier_prefetch_status(kvtier_t *self, uint64_t job, int *done, uint32_t *loaded,
                           uint32_t *hits);

/* RESERVE: slots[0..*nslots) for keys of sizes[i] bytes (sizes NULL: `size` each). *nslots < n
 * when only a prefix fits. Write each non-nil slot through slot.ptr, then kvtier_commit. */
int kvtier_reserve(kvtier_t *self, const char *ns, const char *salt,
                   const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, const uint64_t *sizes,
                   uint64_t size, kvtier_slot_t *slots, uint32_t *nslots, uint64_t *lease);

/* An object's label: UTF-8 of at most this many bytes. */
#define KVTIER_MAX_LABEL 255

/* kvtier_reserve with a label per key: labels[i] (NULL or "": none) names the object in the
 * daemon's events (its `labels` field) from its store to its eviction or removal, the next
 * daemon's too when it adopts L1; a key already stored keeps its first label. labels NULL is
 * kvtier_reserve. A label that is not UTF-8 or is longer than KVTIER_MAX_LABEL is EINVAL. */
int kvtier_reserve_labeled(kvtier_t *self, const char *ns, const char *salt,
                           const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n,
                           const char *const *labels, const uint64_t *sizes, uint64_t size,
                           kvtier_slot_t *slots, uint32_t *nslots, uint64_t *lease);

/* COMMIT: the reserved objects become readable, except indices failed[0..nfailed). */
int kvtier_commit(kvtier_t *self, uint64_t lease, const uint32_t *failed, uint32_t nfailed,
                  uint32_t *stored);

/* ACQUIRE: slots of the leading keys in L1, pinned under *lease until kvtier_release. */
int kvtier_acquire(kvtier_t *self, const char *ns, const char *salt,
                   const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, kvtier_slot_t *slots,
                   uint32_t *nslots, uint64_t *lease);

int kvtier_release(kvtier_t *self, uint64_t lease);

/* RELEASE without waiting for the answer: returns once the request is queued (a round trip
 * less per read). The daemon handles a connection's requests in order, so the next call on this
 * connection already sees the lease released; its answer is read and dropped by a later call.
 * A failure on the daemon's side (an unknown lease) is not reported. */
int kvtier_release_async(kvtier_t *self, uint64_t lease);

/* PUT: stores data[i] (lens[i] bytes) under keys[i], bytes carried in the message (for remote
 * clients and small objects). *stored counts newly stored objects. */
int kvtier_put(kvtier_t *self, const char *ns, const char *salt,
               const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, const void *const *data,
               const size_t *lens, uint32_t *stored);

/* kvtier_put with a label per key, as kvtier_reserve_labeled. */
int kvtier_put_labeled(kvtier_t *self, const char *ns, const char *salt,
                       const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n,
                       const char *const *labels, const void *const *data, const size_t *lens,
                       uint32_t *stored);

/* GET: copies of the leading objects found in L1: out[0..*found), each freed by the caller.
 * The daemon may return fewer than are present, to keep its reply under max_message. */
int kvtier_get(kvtier_t *self, const char *ns, const char *salt,
               const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, kvtier_buf_t *out,
               uint32_t *found);

/* GET without a copy: out[0..*found) point into the reply's frames as libzmq received them,
 * valid until kvtier_frames_free(frames) (never free() out[i].data). The fast way for a process
 * that only reads the bytes once: it saves a copy and the page faults of a fresh buffer. */
typedef struct kvtier_frames kvtier_frames_t;
int kvtier_get_frames(kvtier_t *self, const char *ns, const char *salt,
                      const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, kvtier_buf_t *out,
                      uint32_t *found, kvtier_frames_t **frames);
void kvtier_frames_free(kvtier_frames_t **frames);

int kvtier_remove(kvtier_t *self, const char *ns, const char *salt,
                  const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n, uint32_t *removed);

/* CLEAR: every object, or those of `ns` (any salt) when ns is not NULL. */
int kvtier_clear(kvtier_t *self, const char *ns, uint64_t *removed);

/* HASH_TOKENS computed by the daemon: keys of the full chunks of tokens[0..ntokens).
 * chunk_tokens 0: the daemon's. keys must hold ntokens / chunk_tokens entries; *nkeys is set. */
int kvtier_hash_tokens(kvtier_t *self, const uint32_t *tokens, size_t ntokens,
                       uint32_t chunk_tokens, const char *salt, uint8_t (*keys)[KVTIER_KEY_LEN],
                       uint32_t *nkeys);

/* The same keys computed locally, without a round trip (no connection needed). chunk_tokens
 * must be given (0 yields no keys: there is no daemon default without a connection). */
uint32_t kvtier_hash_tokens_local(const uint32_t *tokens, size_t ntokens, uint32_t chunk_tokens,
                                  const char *salt, uint8_t (*keys)[KVTIER_KEY_LEN]);

/* ---- GPU KV cache (CUDA IPC) ----
 * An engine whose KV cache lives on the GPU registers it once per device: one buffer per
 * layer (a KV tensor, or K and V as two "layers"), each given as the 64-byte
 * cudaIpcMemHandle_t of its allocation (cudaIpcGetMemHandle) plus the buffer's byte offset in
 * that allocation. Block b of a layer is block_tokens x token_bytes bytes at offset
 * b x block_tokens x token_bytes. The daemon then copies between the blocks and L1 objects on
 * its own CUDA streams; a call returns when the copy is complete. The registration ends with
 * kvtier_unregister_gpu or kvtier_close (a dropped instance loses it, and libkvtier registers
 * it again: see Liveness above). A daemon without a GPU (or built without CUDA) answers
 * KVTIER_EUNAVAIL. */

#define KVTIER_IPC_HANDLE_LEN 64

typedef struct {
    uint32_t device;       /* CUDA device index, as the daemon numbers them */
    uint32_t layers;       /* entries of handles (and offsets) */
    uint64_t num_blocks;   /* blocks per layer */
    uint32_t block_tokens; /* tokens per block */
    uint32_t token_bytes;  /* bytes of one token in one layer */
    const char *dtype;     /* "float16", "bfloat16", "float32", "float8_e4m3fn", ... */
    const uint8_t (*handles)[KVTIER_IPC_HANDLE_LEN];
    const uint64_t *offsets; /* NULL: every buffer starts its allocation */
} kvtier_gpu_layout_t;

/* REGISTER_GPU: once per device per instance (a second is KVTIER_EBADREQ). libkvtier keeps a
 * copy of the request (the handles, not the memory) to register it again when the instance is
 * re-established; kvtier_unregister_gpu drops it. */
int kvtier_register_gpu(kvtier_t *self, const kvtier_gpu_layout_t *layout);

/* UNREGISTER_GPU: KVTIER_ENOTFOUND when this instance has no registration on the device; 0
 * when the instance had been dropped (the registration went with it). */
int kvtier_unregister_gpu(kvtier_t *self, uint32_t device);

/* STORE_GPU: chunk i of keys[0..n) is in blocks block_ids[i*per .. (i+1)*per) of every layer
 * (per = nblock_ids / n, the same for every chunk). event: NULL, or a 64-byte
 * cudaIpcEventHandle_t (cudaEventInterprocess) the daemon waits for before copying. *stored:
 * newly stored objects (a key already stored is skipped; a full L1 stores a prefix). */
int kvtier_store_gpu(kvtier_t *self, const char *ns, const char *salt, uint32_t device,
                     const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n,
                     const uint64_t *block_ids, uint32_t nblock_ids, const void *event,
                     uint32_t *stored);

/* RETRIEVE_GPU: writes the leading chunks found in L1 into their blocks; *found of them. */
int kvtier_retrieve_gpu(kvtier_t *self, const char *ns, const char *salt, uint32_t device,
                        const uint8_t (*keys)[KVTIER_KEY_LEN], uint32_t n,
                        const uint64_t *block_ids, uint32_t nblock_ids, const void *event,
                        uint32_t *found);

/* Sends a raw request (body: one msgpack map) and waits for its reply; *reply_body is a
 * malloc'd copy of the reply body (caller frees), ok or not. For request types this header has
 * no call for. An answer instance_dropped is re-established and retried like the calls above
 * (by `type`); a REGISTER_GPU sent this way is not kept for re-registration. */
int kvtier_call(kvtier_t *self, uint32_t type, const void *body, size_t len, void **reply_body,
                size_t *reply_len);

/* ---- the fast-path ring, for clients in other languages ----
 * libkvtier speaks the fast path itself (docs/protocol.md "Fast path"); these calls give a
 * client written in another language (the Python client, through ctypes) the same ring code.
 * A kvtier_ring_t is one side of one ring in a region of the mapped arena that HELLO's
 * `fastpath` reply names; codes are KVTIER_E*. One thread per handle. */
typedef struct kvtier_ring kvtier_ring_t;

/* Attaches as the producer (producer != 0: the request ring) or the consumer (the reply ring)
 * of the ring of `capacity` data bytes at region[0..size). NULL with a sentence in err. */
kvtier_ring_t *kvtier_ring_attach(void *region, size_t size, uint32_t capacity, int producer,
                                  char *err, size_t errlen);

/* Detaches (does not close; see kvtier_ring_close). Accepts NULL. */
void kvtier_ring_detach(kvtier_ring_t *ring);

/* Largest message payload one record may carry. */
size_t kvtier_ring_max_payload(const kvtier_ring_t *ring);

/* Producer: pushes one message of n frames. 0; KVTIER_EBUSY (no room now); KVTIER_ETOOBIG
 * (never fits); KVTIER_EUNAVAIL (the daemon closed the ring); KVTIER_EBADREQ (malformed). */
int kvtier_ring_push(kvtier_ring_t *ring, const void *const *frames, const size_t *lens,
                     uint32_t n);

/* Consumer: copies the next message payload into buf[0..cap); 0 with *len set;
 * KVTIER_EBUSY (empty); KVTIER_EUNAVAIL (empty and closed); KVTIER_ETOOBIG (*len says how
 * long); KVTIER_EBADREQ. The payload is u32 count, then per frame u32 length + bytes. */
int kvtier_ring_pop(kvtier_ring_t *ring, void *buf, size_t cap, size_t *len);

/* Waits (spin, then futex) until a record can be popped (consumer) or `need` payload bytes
 * fit (producer), for at most timeout_ns (< 0: no limit). 0; KVTIER_ETIMEDOUT;
 * KVTIER_EUNAVAIL; KVTIER_EBADREQ; KVTIER_ETOOBIG. */
int kvtier_ring_wait(kvtier_ring_t *ring, size_t need, int64_t timeout_ns);

/* Closes this side (the daemon's calls on its side then answer that the client has gone). */
void kvtier_ring_close(kvtier_ring_t *ring);

/* The most spin iterations a wait makes before it sleeps on the futex (default 4096; 0: sleep
 * at once). The budget adapts below it, and a spin that lost its CPU pauses spinning
 * (docs/operations.md "Fast path"). libkvtier's own rings take KVTIER_RING_SPIN. */
void kvtier_ring_set_spin(kvtier_ring_t *ring, uint32_t max_iterations);

/* What one side's waits did (kvt_ring's counters, for a client's diagnostics and tests). */
typedef struct {
    uint64_t records;   /* pushed (producer) or popped (consumer) */
    uint64_t bytes;     /* record bytes, headers and padding included */
    uint64_t spin_hits; /* waits that ended while spinning */
    uint64_t cooled;    /* spins that lost their CPU (spinning paused) */
    uint64_t sleeps;    /* futex waits entered */
    uint64_t wakes;     /* futex wakes issued to the daemon */
    uint32_t spin;      /* the current spin budget (iterations) */
} kvtier_ring_stats_t;

void kvtier_ring_stats(const kvtier_ring_t *ring, kvtier_ring_stats_t *out);

/* The residency map (docs/protocol.md "Residency map"): a read-only mapping of `size` bytes
 * that the daemon handed over with the ring pair (HELLO with `resident: true`). Answers how
 * many of keys[0..n) (16 bytes each, back to back) lead the batch in L1 of namespace
 * ns (ns_len bytes) with salt (salt_len bytes, 0 for none): every one of them is READY in L1
 * now, or was a moment ago. Fewer than n says nothing about the rest: ask the daemon (LOOKUP).
 * KVTIER_EINVAL when the region is not (an 8-byte aligned mapping of) a residency map; KVTIER_EUNAVAIL when the daemon no
 * longer keeps it (it has not beaten for a second: killed, stopped or wedged; or it closed
 * it at stop): ask the daemon, and HELLO again for a new map. Any thread. */
int64_t kvtier_resident_prefix(const void *region, size_t size, const void *ns, size_t ns_len,
                               const void *salt, size_t salt_len, const void *keys, uint32_t n);

/* The server's message (or a local one) for the last failed call; "" after a success. */
const char *kvtier_last_error(const kvtier_t *self);

#ifdef __cplusplus
}
#endif

#endif
