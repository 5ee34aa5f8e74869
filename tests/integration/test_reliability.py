"""Reliability under concurrency and injected failure, against the real daemon: 32 clients
storing and reading at once get exactly their bytes back, and L1 allocations that fail (the
debug.fail_alloc_every hook) turn into no_space replies, never a crash or a lost object.

Related suites: hostile input and the RSS bound (test_protocol.py), killed clients and their
leases (test_l1.py), SIGTERM under load and a full disk (test_l2.py), CURVE and private
defaults (test_security.py); docs/operations.md maps every promise to its test."""

import random
import threading
import time

import zmq

from kvtest import (GET, HELLO, PUT, RESERVE, Arena, error_code, key, metric_value, pack,
                    payload, unpack, wait_until)

NS = "reliability/kv-v1"
CLIENTS = 32
ROUNDS = 40


def test_32_clients_x_40_put_get_exact_bytes(daemon_factory):
    """32 client threads, each its own DEALER and instance, 40 rounds of PUT then GET of a
    fresh object (1 B - 24 KiB, random bytes); then each reads every object of its neighbour.
    Every reply is ok and every byte is the one written. The total stays below the high
    watermark of the 64 MiB L1, so nothing may be evicted and every GET must find its object."""
    d = daemon_factory()
    errors = []
    stored = [dict() for _ in range(CLIENTS)]
    barrier = threading.Barrier(CLIENTS, timeout=60)

    def client(c):
        rng = random.Random(1000 + c)
        s = d.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 20000)
        s.connect(d.ipc)
        uid = [c << 32]

        def call(type_, body, *data):
            uid[0] += 1
            s.send_multipart([pack(uid[0]), pack(type_), pack(body)] + list(data))
            frames = s.recv_multipart()
            assert unpack(frames[0]) == uid[0], "reply to another request"
            return unpack(frames[2]), frames[3:]

        try:
            body, _ = call(HELLO, {"version": 1, "client": "pytest", "instance": "c%02d" % c})
            assert body["ok"], body
            for r in range(ROUNDS):
                k = key(r, b"c%02d" % c)
                data = rng.randbytes(rng.randint(1, 24 * 1024))
                body, _ = call(PUT, {"ns": NS, "keys": [k]}, data)
                assert body["ok"] and body["stored"] == 1, (c, r, body)
                stored[c][k] = data
                body, frames = call(GET, {"ns": NS, "keys": [k]})
                assert body["ok"] and body["found"] == 1, (c, r, body)
                assert frames[0] == data, "client %d round %d read other bytes" % (c, r)
            barrier.wait()
            other = stored[(c + 1) % CLIENTS]
            ks = list(other)
            for b in range(0, len(ks), 8):
                body, frames = call(GET, {"ns": NS, "keys": ks[b:b + 8]})
                assert body["ok"] and body["found"] == len(ks[b:b + 8]), body
                assert [bytes(f) for f in frames] == [other[k] for k in ks[b:b + 8]]
        except Exception as e:  # noqa: BLE001 - every failure is reported by the test
            errors.append((c, repr(e)))
            barrier.abort()
        finally:
            s.close(linger=0)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, 120 - (time.monotonic() - t0)))
    assert not any(t.is_alive() for t in threads), "clients still running after 120 s"
    assert not errors, errors[:3]
    assert sum(len(x) for x in stored) == CLIENTS * ROUNDS
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_l1_objects") == CLIENTS * ROUNDS
    assert metric_value(samples, "kvtier_l1_evictions_total") == 0
    assert d.alive()


def test_injected_allocation_failures_answer_no_space(daemon_factory):
    """debug.fail_alloc_every=3: every third L1 allocation fails. A PUT or RESERVE whose first
    key hits it answers no_space; a batch is cut to the prefix before it; everything stored
    before and after is intact; the daemon stays up."""
    d = daemon_factory("--l2", "none", "--debug-fail-alloc-every", "3")
    s = d.dealer()
    d.hello(s, "inst-inject")
    expected = {}
    outcomes = []
    for i in range(30):                         # allocations 1..30: 3, 6, ... 30 fail
        k = key(i, b"inj")
        data = payload(k, 1000 + 37 * i)
        body = d.call(s, PUT, {"ns": NS, "keys": [k]}, data)
        outcomes.append(body["ok"])
        if body["ok"]:
            assert body["stored"] == 1, body
            expected[k] = data
        else:
            assert error_code(body) == "no_space", body
    assert outcomes == [(i + 1) % 3 != 0 for i in range(30)], outcomes
    # a batch of three: allocations 31, 32 succeed, 33 fails -> the prefix of two is stored
    ks = [key(100 + i, b"inj") for i in range(3)]
    datas = [payload(k, 5000) for k in ks]
    body = d.call(s, PUT, {"ns": NS, "keys": ks}, *datas)
    assert body["ok"] and body["stored"] == 2, body
    expected.update(zip(ks[:2], datas[:2]))
    # the shared-memory path: RESERVE (34 ok, 35 ok, 36 fails)
    arena = Arena(d.hello(s, "inst-inject")["shm"])
    try:
        results = []
        for i in range(3):
            k = key(200 + i, b"inj")
            r = d.call(s, RESERVE, {"ns": NS, "keys": [k], "size": 8192})
            results.append(r["ok"])
            if r["ok"]:
                data = payload(k, 8192)
                arena.write(r["slots"][0]["offset"], data)
                assert d.commit(s, r["lease"])["stored"] == 1
                expected[k] = data
            else:
                assert error_code(r) == "no_space", r
        assert results == [True, True, False], results
        assert d.fetch(s, arena, NS, [key(200, b"inj")]) == [expected[key(200, b"inj")]]
    finally:
        arena.close()
    # nothing stored was harmed: every object reads back exactly
    for k, data in expected.items():
        rep = d.request(s, d.next_uid(), GET, {"ns": NS, "keys": [k]})
        assert rep.body["found"] == 1 and rep.data == [data], rep.body
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_request_errors_total", code="no_space") == 11
    assert metric_value(samples, "kvtier_l1_objects") == len(expected) == 20 + 2 + 2
    assert metric_value(samples, "kvtier_l1_reserved_objects") == 0
    wait_until(d.alive, 1.0, what="the daemon to be alive")
