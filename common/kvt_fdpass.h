/* kvt_fdpass: hands a descriptor from the daemon to one client process over a unix stream
 * socket (SCM_RIGHTS), in exchange for a single-use ticket. The fast path gives each client
 * its ring pair this way, in memory no other process can map (docs/protocol.md "Fast path").
 *
 * The exchange, on a fresh connection to the daemon's handoff socket: the client writes the
 * ticket (KVT_FDPASS_TICKET_HEX ASCII hex digits); the daemon answers one message, either
 * "K" carrying the descriptor, or "E" and a sentence, and the connection stays open while
 * the daemon serves what it handed over (its end closing says the daemon is gone; the
 * client's, that the client is). Both sides are plain functions over a socket: the daemon's
 * kvt_handoff thread sends, libkvtier fetches; any thread. */
#ifndef KVT_FDPASS_H
#define KVT_FDPASS_H

#include <stddef.h>

#define KVT_FDPASS_TICKET_HEX 32 /* 128 random bits */
#define KVT_FDPASS_MAX_FDS 2     /* the ring pair, and the residency map when asked for */

/* Answers a claim with fds[0..nfds) ("K" + SCM_RIGHTS; 1 to KVT_FDPASS_MAX_FDS). 0 or -errno. */
int kvt_fdpass_send(int sock, const int *fds, int nfds);

/* Answers a claim with a refusal ("E" + why, at most 200 bytes). 0 or -errno. */
int kvt_fdpass_refuse(int sock, const char *why);

/* Connects to the unix socket `path`, presents `ticket` and waits at most timeout_ms for the
 * answer. 0 with fds[0..*nfds) (1 to maxfds descriptors, close-on-exec; the rest of fds -1)
 * and *sock (the open connection: keep it while using what came, close it to let go);
 * KVT_EUNAVAIL with a sentence in err when the socket cannot be reached, the daemon refused
 * (its sentence) or answered something else (more than maxfds descriptors included). */
int kvt_fdpass_fetch(const char *path, const char *ticket, int timeout_ms, int *fds, int maxfds,
                     int *nfds, int *sock, char *err, size_t errlen);

/* Whether the other end of a connection from kvt_fdpass_fetch has gone (closed, or sent
 * anything: it never does while serving). Never blocks. */
int kvt_fdpass_peer_gone(int sock);

#endif
