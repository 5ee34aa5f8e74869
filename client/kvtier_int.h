/* kvtier_int: libkvtier's insides, shared by its files and by nothing else (kvtier.h is the API;
 * none of these names is exported: libkvtier.map exports kvtier_* only).
 *
 *   kvtier_wire.c  the process's zmq context; the envelope over a DEALER (send, receive,
 *                  replies decoded); the fast path's client side (requests and replies over
 *                  the ring pair); one call's round trip, with the revival of a dropped
 *                  instance around it
 *   kvtier_conn.c  a handle's connection: HELLO/BYE, the arena mapped (and faulted in by a
 *                  thread of its own), the ring pair attached, GPU registrations kept and said
 *                  again, re-establishment, connect and close
 *   kvtier_hb.c    the heartbeat: a thread and a DEALER of its own per handle
 *   kvtier.c       the API: request bodies and argument checks, the cache, GPU and hashing
 *                  calls, the ring wrappers for other languages
 *
 * All run on the caller's thread, except the heartbeat and prefault threads (see each file). */
#ifndef KVTIER_INT_H
#define KVTIER_INT_H

#include "kvtier.h"
#include "kvtier_curve.h"

#include "kvt_key.h"
#include "kvt_proto.h"
#include "kvt_ring.h"

#include <msgpack.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <zmq.h>

typedef struct kvc_hb kvc_hb_t;
typedef struct kvc_prefault kvc_prefault_t;

/* A REGISTER_GPU the caller made, kept to be said again when the instance is re-established. */
typedef struct {
    uint32_t device;
    bool live;  /* registered with the current instance */
    void *body; /* the request body as sent */
    size_t len;
} kvc_gpu_reg_t;

struct kvtier {
    void *ctx;
    void *sock;
    uint64_t next_uid;
    int timeout_ms;
    pid_t pid; /* the process that connected: a forked child does not speak for it */
    char client[KVT_MAX_NAME + 1];
    char instance[KVT_MAX_NAME + 1];
    char token[KVT_MAX_TOKEN + 1]; /* from the last HELLO; "" when the daemon gave none */
    kvtier_info_t info;
    void *arena; /* MAP_SHARED mapping of HELLO's shm.path; NULL when it could not be mapped */
    size_t arena_size;
    size_t arena_map_len;         /* bytes mapped: shm.map_size or arena_size */
    char *arena_path;             /* the shm.path HELLO announced last (NULL: none) ... */
    uint64_t arena_announced;     /* ... and its shm.size: a restarted daemon announces another */
    uint64_t arena_map_announced; /* ... and the length mapped for it */
    dev_t arena_dev;              /* the mapped file: a daemon's arena file goes with it */
    ino_t arena_ino;
    char arena_why[384]; /* why arena is NULL: the message of a local KVT_EUNAVAIL */
    kvc_prefault_t *prefault; /* the background fault-in of the arena, NULL when none runs */
    char error[256];
    uint64_t spin_ns; /* busy-poll for a reply this long before sleeping (0: never) */
    kvc_hb_t *hb;       /* NULL when disabled (KVTIER_HEARTBEAT_MS=0) */
    kvc_gpu_reg_t *gpu; /* the caller's GPU registrations, one per device */
    uint32_t ngpu, gpu_cap;
    /* the fast path: both NULL, or the pair the last HELLO offered (see DESIGN) */
    bool fastpath_on;      /* KVTIER_FASTPATH is not "0": HELLO asks for a pair */
    kvt_ring_t *req_ring;  /* producer of the request ring */
    kvt_ring_t *rep_ring;  /* consumer of the reply ring */
    uint8_t *ring_map;     /* the pair's memory (the daemon's memfd), ring_map_len bytes */
    size_t ring_map_len;
    const uint8_t *res_map; /* the residency map that came with the pair (read-only), or NULL */
    size_t res_map_len;
    uint64_t res_checked_ns; /* when the handoff connection was last found open */
    int ring_sock;         /* the handoff connection, open while the pair is (-1: none) */
    unsigned ring_gen;     /* kvc_fork_gen when attached */
    uint64_t ring_posted;  /* uid of the last request posted on the ring not yet confirmed */
    uint64_t ring_seen_ns; /* when the pair last answered (or was attached) */
    uint8_t *ring_buf;     /* one reply record (kvt_ring_max_payload bytes), kept across calls */
    size_t ring_buf_cap;
};


/* What a call keeps of a reply's data frames: nothing, copies, or the frames themselves. */
typedef enum { KVC_DATA_NONE, KVC_DATA_COPY, KVC_DATA_KEEP } kvc_data_mode_t;

/* Data frames kept as received (kvtier_get_frames): the caller's views point into them. */
struct kvtier_frames {
    uint32_t n, cap;
    zmq_msg_t *msgs;
};

/* A reply: body copied out of its frame (msgpack objects point into it) and, when the caller
 * asked for them, copies of the data frames or the frames themselves. kvc_reply_free releases
 * whatever is still owned. */
typedef struct {
    void *buf;
    size_t len;
    msgpack_unpacked up;
    kvtier_buf_t *data;
    uint32_t ndata, cap;
    kvtier_frames_t *frames;
} kvc_reply_t;

/* Bumped in a child at each fork (kvtier_wire.c): a ring pair belongs to the process that
 * attached it. */
extern _Atomic unsigned kvc_fork_gen;

/* Whether the heartbeat found the instance dropped (one atomic load). */
bool kvc_hb_dropped(const kvc_hb_t *hb);

int kvc_fail(kvtier_t *self, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

int kvc_env_int(const char *name, int def, int lo, int hi);

void *kvc_ctx_acquire(void);

void kvc_ctx_release(void *ctx);

void kvc_reply_init(kvc_reply_t *r);

void kvc_reply_free(kvc_reply_t *r);

int kvc_send_on(void *sock, int flags, uint64_t uid, uint32_t type, const void *body,
                     size_t len, const void *const *data, const size_t *lens, uint32_t ndata);

uint64_t kvc_mono_ns(void);

int kvc_recv_on(void *sock, uint64_t spin_ns, uint64_t uid, kvc_data_mode_t mode, kvc_reply_t *r,
                     const char **why);

bool kvc_pair_mine(const kvtier_t *self);

void kvc_pair_drop(kvtier_t *self);

int kvc_exchange(kvtier_t *self, uint32_t type, const void *body, size_t len,
                      const void *const *data, const size_t *lens, uint32_t ndata,
                      kvc_data_mode_t mode, kvc_reply_t *r);

int kvc_post(kvtier_t *self, uint32_t type, const void *body, size_t len);

const msgpack_object *kvc_get(const msgpack_object *map, const char *name);

int kvc_bad_reply(kvtier_t *self, uint32_t type, const char *field, const char *want);

int kvc_decode(kvc_reply_t *r, const char **msg, size_t *msg_len, bool *undecodable);

int kvc_call_once(kvtier_t *self, uint32_t type, const void *body, size_t len,
                       const void *const *data, const size_t *lens, uint32_t ndata,
                       kvc_data_mode_t mode, kvc_reply_t *r);

int kvc_revive(kvtier_t *self, uint32_t type);

int kvc_call_data(kvtier_t *self, uint32_t type, msgpack_sbuffer *body,
                       const void *const *data, const size_t *lens, uint32_t ndata,
                       kvc_data_mode_t mode, kvc_reply_t *r);

int kvc_call(kvtier_t *self, uint32_t type, msgpack_sbuffer *body, kvc_reply_t *r);

int kvc_need_uint(kvtier_t *self, uint32_t type, const msgpack_object *body,
                       const char *name, uint64_t *out);

int kvc_opt_uint(kvtier_t *self, uint32_t type, const msgpack_object *body,
                      const char *name, uint64_t *out);

int kvc_need_count(kvtier_t *self, uint32_t type, const msgpack_object *body,
                        const char *name, uint64_t max, uint64_t *out);

void kvc_hello_body(msgpack_sbuffer *sb, const char *client, const char *instance,
                         const char *token, bool fastpath);

void kvc_instance_body(msgpack_sbuffer *sb, const char *instance);

int kvc_gpu_room(kvtier_t *self);

void kvc_gpu_keep(kvtier_t *self, uint32_t device, void *body, size_t len);

void kvc_gpu_forget(kvtier_t *self, uint32_t device);

int kvc_gpu_ensure(kvtier_t *self, uint32_t type, uint32_t device);

int kvc_reestablish(kvtier_t *self);

int kvc_hb_start(kvtier_t *self, const char *endpoint, const kvtier_curve_t *curve, char *err,
                      size_t errlen);

void kvc_hb_stop(kvc_hb_t **hb_p);

void kvc_hb_token(const kvtier_t *self, char out[KVT_MAX_TOKEN + 1]);

bool kvc_hb_newer_token(const kvtier_t *self, char presented[KVT_MAX_TOKEN + 1]);

void kvc_hb_publish(kvtier_t *self);

void kvc_body_begin(msgpack_sbuffer *sb, msgpack_packer *pk, uint32_t n);

#endif
