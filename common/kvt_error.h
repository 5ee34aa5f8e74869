/* kvt_error: the one error vocabulary of kvtier.
 *
 * Every int-returning function answers 0 or a negative KVT_E* code from KVT_ERRNO_MAP. Each
 * code maps to one wire error code of protocol v1 (DESIGN.md), so any internal failure reaches
 * the client as a typed error. The table is append-only: numbers never change meaning.
 * Pure data; safe from any thread. */
#ifndef KVT_ERROR_H
#define KVT_ERROR_H

#include <stddef.h>

/* XX(name, number, wire code, default message) */
#define KVT_ERRNO_MAP(XX)                                                                      \
    XX(BADREQ, -1, "bad_request", "malformed request")                                        \
    XX(UNKTYPE, -2, "unknown_type", "unknown request type")                                   \
    XX(VERSION, -3, "unsupported_version", "unsupported protocol version")                    \
    XX(TOOBIG, -4, "too_large", "request too large")                                          \
    XX(NOSPC, -5, "no_space", "no space in tier")                                             \
    XX(NOTFOUND, -6, "not_found", "not found")                                                \
    XX(LEXPIRED, -7, "lease_expired", "lease expired")                                        \
    XX(UNKLEASE, -8, "unknown_lease", "unknown lease")                                        \
    XX(BUSY, -9, "busy", "busy, retry later")                                                 \
    XX(INTERNAL, -10, "internal", "internal error")                                           \
    XX(UNAVAIL, -11, "unavailable", "unavailable")                                            \
    XX(NOMEM, -12, "internal", "out of memory")                                               \
    XX(IO, -13, "internal", "I/O error")                                                      \
    XX(TIMEDOUT, -14, "unavailable", "timed out")                                             \
    XX(INVAL, -15, "bad_request", "invalid argument")                                      \
    XX(NOINST, -16, "instance_dropped", "no live client instance on this connection")

enum {
    KVT_OK = 0,
#define KVT_XX(name, num, wire, msg) KVT_E##name = (num),
    KVT_ERRNO_MAP(KVT_XX)
#undef KVT_XX
};

/* Number of distinct wire error codes (the wire strings of the rows, each counted once, in
 * order of first appearance); metrics count by these. */
#define KVT_WIRE_ERRORS 12

/* Human sentence for a code ("no space in tier"); never NULL. */
const char *kvt_strerror(int code);

/* Symbolic name ("NOSPC"); never NULL. */
const char *kvt_err_name(int code);

/* Wire error code string of protocol v1 ("no_space"); unknown codes map to "internal". */
const char *kvt_err_wire(int code);

/* The KVT_E* code of a wire error string ("no_space" -> KVT_ENOSPC); KVT_EINTERNAL when
 * unknown. */
int kvt_err_from_wire(const char *wire, size_t len);

/* Index 0..KVT_WIRE_ERRORS-1 of the code's wire error, for per-code counters. */
int kvt_err_wire_index(int code);

/* Wire error string of index i (0..KVT_WIRE_ERRORS-1). */
const char *kvt_err_wire_name(int i);

#endif
