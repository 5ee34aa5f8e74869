/* kvt_handoff: the daemon's handoff socket, where a client collects what the daemon keeps
 * for it alone (its fast-path ring pair, a sealed memfd) by presenting the single-use ticket
 * that the daemon gave it in a reply on its own connection (common/kvt_fdpass: the exchange).
 *
 * Owns the listening unix socket (RUN_DIR/kvtier-handoff.sock, the ipc endpoint's mode and
 * group), the table of open offers and the `handoff` thread, which accepts, reads tickets
 * (one second each at most), checks them and the claimant's SO_PEERCRED against the process
 * that asked, sends the descriptor, then keeps the connection to tell when the claimant goes.
 * Offers are made and looked at from any thread (the fastpath thread, under the server lock);
 * the table has its own lock, a leaf. */
#ifndef KVT_HANDOFF_H
#define KVT_HANDOFF_H

#include "kvt_config.h"
#include "kvt_supervisor.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define KVT_HANDOFF_SOCK "kvtier-handoff.sock"

typedef struct kvt_handoff kvt_handoff_t;

/* Who may claim an offer: the process that asked (pid > 0: that pid and uid), or anyone who
 * can connect to the socket (pid 0: the request came over TCP, whose peer is not known). */
typedef struct {
    pid_t pid;
    uid_t uid;
} kvt_handoff_peer_t;

typedef enum {
    KVT_HANDOFF_WAITING = 0, /* not claimed yet, within its time */
    KVT_HANDOFF_CLAIMED,     /* the descriptor went; the claimant is still connected */
    KVT_HANDOFF_GONE,        /* claimed, and the claimant closed its connection (it died) */
    KVT_HANDOFF_EXPIRED,     /* not claimed in time, or not an offer (any more) */
} kvt_handoff_state_t;

/* Binds the socket (a stale file from a crash is replaced: run_dir's lock is held) for at most
 * `max_offers` offers at once. NULL with a sentence in err. */
kvt_handoff_t *kvt_handoff_new(const kvt_config_t *cfg, uint32_t max_offers, char *err,
                               size_t errlen);

/* Starts the thread (supervised as "handoff"). 0 or KVT_EINTERNAL. */
int kvt_handoff_start(kvt_handoff_t *self, kvt_sup_t *sup);

/* Stops the thread, closes every connection, removes the socket file. Accepts NULL. */
void kvt_handoff_destroy(kvt_handoff_t **self_p);

const char *kvt_handoff_path(const kvt_handoff_t *self);

/* Offers a duplicate of fd (and of fd2, sent with it, unless fd2 is -1) to `peer` for ttl_ms;
 * writes the ticket (KVT_FDPASS_TICKET_HEX hex digits and a NUL) into ticket. The offer's id
 * (never 0), or 0 when max_offers are open. */
uint64_t kvt_handoff_offer(kvt_handoff_t *self, int fd, int fd2, kvt_handoff_peer_t peer,
                           uint64_t ttl_ms, char *ticket);

kvt_handoff_state_t kvt_handoff_state(kvt_handoff_t *self, uint64_t id);

/* Ends an offer: its descriptor and its claimant's connection are closed (the client sees the
 * daemon let go). Unknown ids are ignored. */
void kvt_handoff_cancel(kvt_handoff_t *self, uint64_t id);

/* {socket, offers, claimed, refused: {reason: n}} for /status. */
json_t *kvt_handoff_json(kvt_handoff_t *self);

#endif
