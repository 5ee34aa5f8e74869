/* kvt_fastpath: the same-machine fast path (issue 17) — ring pairs offered at HELLO, and the
 * `fastpath` thread that serves them (docs/protocol.md "Fast path").
 *
 * Up to fastpath.rings slots; a slot is a request ring (the client produces, the daemon
 * consumes) and a reply ring (the daemon produces) in a sealed memfd of its own, made at HELLO
 * and handed to the process that said it through kvt_handoff (a ticket in the HELLO reply,
 * the descriptor over the handoff socket): no other process can map a client's rings, so no
 * one can write its requests or read and forge its replies (issue 28). A slot
 * belongs to the connection whose HELLO asked for it and acts for that connection: its
 * requests renew the connection's instances and take leases for them, exactly as if they had
 * come through the socket. The thread pops each request into its own copy and hands it to the
 * server (kvt_fastpath_request_fn), which decodes and runs it like a ZMQ message and answers
 * through kvt_fastpath_reply.
 *
 * Locking: everything that touches the slots runs under the server's lock (`lock`, given at
 * kvt_fastpath_new): the server loop holds it while it works, the fastpath thread while it
 * pops and handles, so session, lease and reply code keeps one thread at a time whichever
 * transport a request came on. The thread sleeps without it (futex_waitv over the request
 * rings' wait words and a doorbell). /status and metrics read atomics only.
 *
 * Reclaim: a slot is closed (both daemon sides, so the client falls back to ZMQ) on BYE or
 * silence of its instance, its connection's close, a new HELLO asking again, a malformed ring,
 * the client closing its side, its process dying (the handoff connection closes), a pair not
 * collected within 5 s, a reply backlog past its bound, and shutdown. A closed slot's memory
 * goes with it; the slot takes a new pair only after a quarantine. */
#ifndef KVT_FASTPATH_H
#define KVT_FASTPATH_H

#include "kvt_config.h"
#include "kvt_fdpass.h"
#include "kvt_handoff.h"
#include "kvt_metrics.h"
#include "kvt_ring.h"
#include "kvt_session.h"
#include "kvt_supervisor.h"

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_fastpath kvt_fastpath_t;

/* Which slot (and which use of it) a request came from; replies name it. */
typedef struct {
    uint32_t slot; /* 1-based; 0: not a fast-path request */
    uint32_t gen;
} kvt_fastpath_ref_t;

/* One request popped from a ring: called on the fastpath thread with the server lock held.
 * `payload` is the thread's copy of the record (valid during the call); `conn` is the slot's
 * connection (borrowed). The callee answers with kvt_fastpath_reply, now or later. */
typedef void (*kvt_fastpath_request_fn)(void *ctx, kvt_fastpath_ref_t ref, kvt_conn_t *conn,
                                        const uint8_t *payload, size_t len);

/* Pairs are handed over through `handoff`. `server_waiting` is non-zero while the server loop
 * waits for `lock` (the thread lets it in first). NULL when the fast path is disabled. */
kvt_fastpath_t *kvt_fastpath_new(const kvt_config_t *cfg, kvt_handoff_t *handoff,
                                 pthread_mutex_t *lock, _Atomic uint32_t *server_waiting,
                                 kvt_sessions_t *sessions, kvt_fastpath_request_fn fn, void *ctx);

/* Starts the fastpath thread (supervised as "fastpath"). 0 or KVT_EINTERNAL. */
int kvt_fastpath_start(kvt_fastpath_t *self, kvt_sup_t *sup);

/* Joins the thread and closes every request ring (clients go to the socket); replies of
 * requests still in the pools reach their rings until kvt_fastpath_destroy closes the slots.
 * Not under the lock. */
void kvt_fastpath_stop(kvt_fastpath_t *self);

void kvt_fastpath_destroy(kvt_fastpath_t **self_p);

/* What HELLO offers: where and with which ticket to collect the pair, the size of its memory
 * and the offsets of the two rings in it, their capacity. */
typedef struct {
    const char *socket; /* the handoff socket (kvt_handoff's, lives as long as it) */
    char ticket[KVT_FDPASS_TICKET_HEX + 1];
    uint64_t size, request, reply;
    uint32_t capacity;
    uint64_t resident; /* bytes of the residency map sent with the pair; 0: none */
} kvt_fastpath_offer_t;

/* Offers the residency map (the L1's memfd of `size` bytes; a read-only descriptor of it is
 * kept) with each pair whose HELLO asks for it. Before kvt_fastpath_start. Accepts NULL. */
void kvt_fastpath_set_resident(kvt_fastpath_t *self, int fd, size_t size);

/* Whether a client on descriptor fd can be on this machine (a unix socket, or tcp from a
 * loopback address): only those are offered a pair, which a client elsewhere could not map
 * and would hold until it leaves. */
bool kvt_fastpath_local(int fd);

/* HELLO with fastpath: true on `conn` acting for `owner` (lock held): closes the connection's
 * previous slot and opens a fresh one, its offer carrying the residency map too when
 * `resident` (and there is one). 0 and *offer; KVT_EBUSY when no slot is free. */
int kvt_fastpath_open(kvt_fastpath_t *self, kvt_conn_t *conn, uint64_t owner, bool resident,
                      kvt_fastpath_offer_t *offer);

/* False when the reply frames can never fit slot `ref`'s ring (answer with a smaller error
 * reply instead); true otherwise, a gone slot included (lock held). */
bool kvt_fastpath_reply_fits(kvt_fastpath_t *self, kvt_fastpath_ref_t ref,
                             const kvt_ring_iov_t *frames, uint32_t nframes);

/* Answers a request of slot `ref` with the reply frames (lock held). 0 (pushed, or held in
 * the slot's bounded backlog); KVT_ETOOBIG when the reply can never fit the ring (answer with
 * a smaller error reply instead); KVT_EUNAVAIL when the slot is gone (the reply is dropped). */
int kvt_fastpath_reply(kvt_fastpath_t *self, kvt_fastpath_ref_t ref, const kvt_ring_iov_t *frames,
                       uint32_t nframes);

/* Closes the slot of a request whose payload is not a message (lock held). */
void kvt_fastpath_reject(kvt_fastpath_t *self, kvt_fastpath_ref_t ref, const char *why);

/* The instance `owner` said BYE or was dropped (lock held): its slots close. */
void kvt_fastpath_owner_gone(kvt_fastpath_t *self, uint64_t owner, bool expired);

/* {enabled, rings_max, rings_open, ring_bytes, requests, declined, quieted (slots left out of
 * the wait for waking the thread for nothing), dropped: {reason: n}}. Any thread; accepts NULL
 * (the fast path disabled). */
json_t *kvt_fastpath_json(kvt_fastpath_t *self);

/* Metrics source: kvtier_fastpath_rings, kvtier_fastpath_requests_total,
 * kvtier_fastpath_declined_total, kvtier_fastpath_dropped_total{reason}. */
void kvt_fastpath_metrics_source(void *self, kvt_sample_fn emit, void *emit_ctx);

#endif
