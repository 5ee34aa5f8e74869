"""Connections against a hostile or unlucky client (issue #13, items 2, 4 and 6).

- Running out of file descriptors: the daemon raises its soft open-files limit to the hard one,
  caps client connections below what it can hold (max_connections), refuses the rest with a
  metric and a log line, and never dies of EMFILE (Debian's libzmq aborts in its ipc listener)
  nor stops answering HTTP.
- Replies nobody reads: GET replies leave straight from the arena and pin it until sent. Past
  max_reply_pinned bytes unsent on one connection GET answers busy; a connection whose replies
  do not move for reply_timeout_ms, or that leaves more than max_reply_backlog bytes of replies
  unread, is disconnected (which frees and unpins what was queued for it). /status shows it.
- Pipelining: every request gets exactly one reply however many are in flight (the ROUTER
  queues without a limit; nothing is dropped with "Resource temporarily unavailable")."""

import struct
import time

import pytest
import zmq

from kvtest import (GET, HASH_TOKENS, HELLO, LOOKUP, PING, MiB, Arena, key, metric_value,
                    pack, pattern, unpack, wait_until)

NS = "connections-test/kv"


def metric(d, name, **labels):
    return metric_value(d.metrics()[1], name, **labels)


def dealers(d, n, endpoint="ipc", **opts):
    """n DEALERs on a context of their own (it is terminated with them)."""
    ctx = zmq.Context()
    socks = []
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 500)
        for opt, value in opts.items():
            s.setsockopt(getattr(zmq, opt), value)
        s.connect(d.endpoint(endpoint))
        socks.append(s)
    return ctx, socks


def close_all(ctx, socks):
    for s in socks:
        s.close(linger=0)
    ctx.term()


def ping_all(socks, timeout_s):
    """Sends a PING on every socket, returns how many were answered within timeout_s."""
    for i, s in enumerate(socks):
        s.send_multipart([pack(i), pack(PING), pack({})])
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    answered, deadline = set(), time.monotonic() + timeout_s
    while len(answered) < len(socks) and time.monotonic() < deadline:
        for s, _ in poller.poll(100):
            s.recv_multipart()
            answered.add(s)
            poller.unregister(s)
    return len(answered)


def healthz_time(d):
    t0 = time.monotonic()
    status, _, _ = d.http("GET", "/healthz", timeout=5.0)
    assert status == 200
    return time.monotonic() - t0


# ----------------------------------------------------------------------------------------
# File descriptors and the connection cap


@pytest.mark.parametrize("endpoint", ["ipc", "tcp"])
def test_more_connections_than_descriptors(daemon_factory, endpoint):
    """300 connections against an open-files limit of 256 (soft = hard): before, libzmq's ipc
    listener aborted the daemon on EMFILE and on tcp HTTP stopped answering."""
    d = daemon_factory(prefix=["prlimit", "--nofile=256:256"])
    cap = metric(d, "kvtier_connections_max")
    assert 8 <= cap < 256 - 64, cap
    ctx, socks = dealers(d, 300, endpoint)
    try:
        answered = ping_all(socks, 5.0)
        assert d.alive(), "kvtierd died:\n" + d.stderr_tail(20)
        assert healthz_time(d) < 1.0
        assert answered == cap, (answered, cap)
        assert metric(d, "kvtier_connections") == cap
        assert metric(d, "kvtier_connections_refused_total", reason="max_connections") > 0
        assert any("connection refused" in l and "max_connections" in l for l in d.log_lines())
    finally:
        close_all(ctx, socks)
    wait_until(lambda: metric(d, "kvtier_connections") == 0, 5,
               what="closed connections to be counted out")
    s = d.dealer(endpoint)
    d.ping(s)
    assert d.alive()


def test_soft_limit_raised_to_hard(daemon_factory):
    d = daemon_factory(prefix=["prlimit", "--nofile=256:4096"])
    assert metric(d, "kvtier_open_files_limit") == 4096
    assert any("open-files limit raised from 256 to 4096" in l for l in d.log_lines())
    ctx, socks = dealers(d, 300)
    try:
        assert ping_all(socks, 10.0) == 300
        assert metric(d, "kvtier_connections_refused_total", reason="max_connections") == 0
    finally:
        close_all(ctx, socks)


def test_max_connections(daemon_factory):
    d = daemon_factory("--max-connections", "10")
    assert metric(d, "kvtier_connections_max") == 10
    ctx, socks = dealers(d, 14)
    try:
        assert ping_all(socks, 3.0) == 10
        assert metric(d, "kvtier_connections_refused_total", reason="max_connections") >= 4
        # room made: the refused ones get in when they reconnect
        answered = [s for s in socks if s.poll(0) or False]
        for s in socks[:4]:
            s.close(linger=0)
        rest = socks[4:]
        wait_until(lambda: metric(d, "kvtier_connections") == 10, 10,
                   what="the refused clients to get in once others left")
        assert ping_all(rest, 5.0) == 10
        del answered
    finally:
        close_all(ctx, [s for s in socks if not s.closed])


# ----------------------------------------------------------------------------------------
# Replies nobody reads


def _store_objects(d, n, size, tag):
    s = d.dealer()
    h = d.hello(s, "store-" + tag.decode())
    arena = Arena(h["shm"])
    keys = [key(i, tag) for i in range(n)]
    try:
        d.store(s, arena, NS, keys, [pattern(k, size) for k in keys])
    finally:
        arena.close()
    return keys


def test_unread_get_replies_pin_a_bounded_amount_then_the_connection_is_cut(daemon_factory):
    """A client sends GETs and never reads the replies (RCVHWM 1, its I/O thread stops). Before,
    every reply pinned its object with no deadline and L1 filled up for everyone."""
    d = daemon_factory("--l2", "none", "--max-reply-pinned", "8M", "--reply-timeout-ms",
                       "1500", "--high-watermark", "1.0", "--low-watermark", "0.99")
    keys = _store_objects(d, 12, 4 * MiB, b"pin")        # 48 of the 64 MiB
    busy0 = metric(d, "kvtier_request_errors_total", code="busy") or 0
    ctx, (hog,) = dealers(d, 1, RCVHWM=1, RCVBUF=4096)
    try:
        for i, k in enumerate(keys):
            hog.send_multipart([pack(i), pack(GET), pack({"ns": NS, "keys": [k]})])
        wait_until(lambda: (metric(d, "kvtier_request_errors_total", code="busy") or 0) > busy0,
                   5, what="a GET past max_reply_pinned to answer busy")
        st = d.http_json("GET", "/status")["connections"]
        assert 0 < st["pinned_bytes"] <= 8 * MiB + 4 * MiB, st
        assert st["with_replies_pending"] and st["with_replies_pending"][0]["pinned_bytes"] > 0
        assert metric(d, "kvtier_reply_pinned_bytes") == st["pinned_bytes"]

        # someone else needs most of L1: the unpinned objects are evicted for it
        other = d.dealer()
        d.hello(other, "needs-room")
        r = d.reserve(other, NS, [key(i, b"room") for i in range(12)], size=4 * MiB)
        assert len(r["slots"]) == 12, "only %d of 12 reserved" % len(r["slots"])
        d.release(other, r["lease"])

        # the hog's replies do not move: it is disconnected, its queue freed and unpinned
        wait_until(lambda: metric(d, "kvtier_connections_cut_total",
                                  reason="replies_stalled") == 1, 10,
                   what="the stalled connection to be cut")
        wait_until(lambda: metric(d, "kvtier_reply_pinned_bytes") == 0, 5,
                   what="the cut connection's replies to be freed")
        assert any("stopped reading its replies" in l for l in d.log_lines())
        assert d.l1_metrics()["kvtier_leases_active"] == 0
    finally:
        close_all(ctx, [hog])


def test_reply_backlog_over_the_limit_cuts_the_connection(daemon_factory):
    """A client floods requests with large replies and reads none: past max_reply_backlog bytes
    held for it the daemon disconnects it instead of growing without bound."""
    d = daemon_factory("--max-reply-backlog", "1M")
    ctx, (flood,) = dealers(d, 1, "tcp", RCVHWM=1, RCVBUF=4096)
    try:
        tokens = struct.pack("<%dI" % 65536, *range(65536))   # 65 536 keys per reply: ~1.2 MB
        for i in range(40):
            flood.send_multipart([pack(i), pack(HASH_TOKENS),
                                  pack({"tokens": tokens, "chunk_tokens": 1})])
        wait_until(lambda: metric(d, "kvtier_connections_cut_total", reason="reply_backlog") == 1,
                   20, what="the flooding connection to be cut")
        wait_until(lambda: metric(d, "kvtier_reply_backlog_bytes") == 0, 5,
                   what="its queued replies to be freed")
        assert any("max_reply_backlog" in l for l in d.log_lines())
    finally:
        close_all(ctx, [flood])
    d.ping(d.dealer("tcp"))


# ----------------------------------------------------------------------------------------
# Pipelining


def test_999_lookups_in_flight_with_l2_every_reply_arrives(daemon):
    """With an L2 tier, LOOKUPs past the L1 prefix are answered from the lookup workers in
    bursts; before, some of 999 kept in flight were dropped with 'Resource temporarily
    unavailable' (libzmq's send queue limit, whose count of messages read lags by up to half
    of it). 20 000 LOOKUPs, 999 in flight at any time, every reply read."""
    d = daemon                                  # default flags: the fs L2
    s = d.dealer()
    d.hello(s, "pipeliner")
    keys = [key(i, b"pipe") for i in range(8)]
    total, window, sent, got = 20000, 999, 0, 0
    seen = set()
    while got < total:
        while sent < total and sent - got < window:
            s.send_multipart([pack(sent), pack(LOOKUP), pack({"ns": NS, "keys": keys})])
            sent += 1
        assert s.poll(5000), "no reply for 5 s: %d of %d answered" % (got, sent)
        frames = s.recv_multipart()
        body = unpack(frames[2])
        assert body["ok"] and body["hits"] == 0, body
        seen.add(unpack(frames[0]))
        got += 1
    assert seen == set(range(total))
    assert metric(d, "kvtier_replies_failed_total") == 0
