"""Client liveness in the Python client (issue #13 item 9; docs/protocol.md "Client liveness").

A daemon drops an instance that is silent for lease_ms, with its leases and GPU registrations.
kvtier.Client keeps its instance alive with a heartbeat thread (its own socket) while open, and
re-establishes a dropped one by itself: HELLO again with its token, the arena re-mapped when
the daemon announces another, the GPU layouts registered again, the request sent once more.
Here: an idle Client keeps its instance and lease; without the heartbeat a dropped instance
comes back on the next call (GPU registration included, with the mock CUDA runtime); a daemon
restart on the same endpoint; close() stops the heartbeat at once. The libkvtier side of the
same scenarios is in test_c_client.py."""

import gc
import os
import threading
import time

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))

import kvtier  # noqa: E402
from kvtest import PAGE, key, mapped_len_ok, wait_until  # noqa: E402
from test_c_client import drop_lines, instance_status, restart_daemon  # noqa: E402
from test_security import curve_args, pki  # noqa: E402,F401 - pki is a fixture

KVT_DAEMON_ARGS = ("--l2", "none")
NS = "liveness/kv"
LEASE_MS = 400


def heartbeat_threads():
    return [t for t in threading.enumerate() if t.name == "kvtier-heartbeat" and t.is_alive()]


@pytest.fixture
def clients():
    """Clients made by the test, closed at teardown (before the daemon stops)."""
    made = []

    def make(d, endpoint=None, **kw):
        kw.setdefault("context", d.ctx)
        c = kvtier.Client(endpoint or d.ipc, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_idle_client_keeps_its_instance(daemon_factory, clients):
    d = daemon_factory("--lease-ms", str(LEASE_MS))
    c = clients(d, instance="py-idle")
    assert c.heartbeat_ms == LEASE_MS // 3
    assert len(heartbeat_threads()) == 1
    token = c.token
    slots, lease = c.reserve(NS, [key(1)], PAGE)
    slots[0][:] = b"i" * PAGE
    wait_until(lambda: (instance_status(d, "py-idle") or {}).get("connections") == 2, 3,
               what="the heartbeat to join the instance (a second connection)")
    time.sleep(3 * LEASE_MS / 1000)                   # not a single call of the Client
    assert c.commit(lease) == 1, "the write lease did not outlive the idle time"
    assert c.store(NS, [key(2)], [b"j" * PAGE]) == 1
    assert c.fetch(NS, [key(1), key(2)]) == [b"i" * PAGE, b"j" * PAGE]
    assert c.token == token, "the instance was re-established: it had been dropped"
    assert c.stats()["clients_connected"] == 1
    assert drop_lines(d, "py-idle") == []


def test_heartbeat_over_curve(daemon_factory, clients, pki):
    """On a CURVE tcp endpoint the heartbeat's own connection uses the Client's keys."""
    d = daemon_factory(*curve_args(pki), "--lease-ms", "300")
    c = clients(d, endpoint=d.tcp, instance="py-curve-idle", curve_serverkey=pki["server"],
                curve_cert=pki["alice"], map_arena=False)
    token = c.token
    wait_until(lambda: (instance_status(d, "py-curve-idle") or {}).get("connections") == 2, 3,
               what="the heartbeat to join over CURVE")
    time.sleep(1.0)
    c.ping()
    assert c.token == token and drop_lines(d, "py-curve-idle") == []


def test_without_heartbeat_a_dropped_instance_comes_back(daemon_factory, clients):
    d = daemon_factory("--lease-ms", str(LEASE_MS))
    c = clients(d, instance="py-quiet", heartbeat_ms=0)
    assert c.heartbeat_ms == 0 and heartbeat_threads() == []
    token = c.token
    slots, lease = c.reserve(NS, [key(1)], PAGE)
    wait_until(lambda: drop_lines(d, "py-quiet"), 5, what="the daemon to drop py-quiet")
    assert instance_status(d, "py-quiet") is None
    # COMMIT is not retried: its lease died with the instance
    with pytest.raises(kvtier.LeaseExpired):
        c.commit(lease)
    # RESERVE answers instance_dropped: HELLO again, then it is sent once more
    assert c.store(NS, [key(2)], [b"q" * PAGE]) == 1
    assert c.token != token and instance_status(d, "py-quiet") is not None
    assert c.fetch(NS, [key(2)]) == [b"q" * PAGE]
    # views handed out before a drop are released when the instance is re-established
    slots, lease = c.reserve(NS, [key(3)], PAGE)
    wait_until(lambda: len(drop_lines(d, "py-quiet")) == 2, 5, what="the second drop")
    c.ping()                                           # PING {instance}: re-established
    with pytest.raises(ValueError):
        slots[0][0] = 1
    # the raw layer does not re-establish: InstanceDropped reaches the caller
    wait_until(lambda: len(drop_lines(d, "py-quiet")) == 3, 5, what="the third drop")
    with pytest.raises(kvtier.InstanceDropped) as e:
        c.recv(c.send(kvtier.RESERVE, {"ns": NS, "keys": [key(4)], "size": PAGE}))
    assert "py-quiet" in e.value.message and e.value.code == "instance_dropped"
    c.hello()
    assert c.store(NS, [key(4)], [b"r" * PAGE]) == 1


MOCK = os.environ.get("KVT_MOCK_CUDART")


@pytest.mark.skipif(not MOCK, reason="no mock libcudart (KVT_MOCK_CUDART; CUDA=0)")
def test_gpu_registration_comes_back(daemon_factory, clients, tmp_path):
    from test_gpu import MockEngine, count, mock_daemon
    d, log = mock_daemon(daemon_factory, tmp_path, "--lease-ms", str(LEASE_MS))
    engine = MockEngine(layers=2, num_blocks=16, block_tokens=4, token_bytes=256, shared=False)
    try:
        c = clients(d, instance="py-gpu", heartbeat_ms=0)
        body = engine.register_body()
        c.register_gpu(0, body["handles"], engine.num_blocks, engine.block_tokens,
                       engine.token_bytes, body["dtype"], offsets=body["offsets"])
        owner = instance_status(d, "py-gpu")["owner"]
        regs = d.http_json("GET", "/status")["gpu"]["registrations"]
        assert [r["owner"] for r in regs] == [owner]
        wait_until(lambda: drop_lines(d, "py-gpu"), 5, what="the daemon to drop py-gpu")
        wait_until(lambda: count(log, "close") == 2, 5, what="its IPC handles closed")
        assert d.http_json("GET", "/status")["gpu"]["registrations"] == []
        c.ping()                                       # re-established, layout and all
        again = instance_status(d, "py-gpu")["owner"]
        regs = d.http_json("GET", "/status")["gpu"]["registrations"]
        assert again != owner and [r["owner"] for r in regs] == [again], regs
        assert count(log, "open") == 4
        assert c.store_gpu(NS, [key(7)], [1, 2]) == 1
        # UNREGISTER_GPU drops the kept copy: the next re-establishment leaves the GPU alone
        c.unregister_gpu(0)
        wait_until(lambda: len(drop_lines(d, "py-gpu")) == 2, 5, what="the second drop")
        c.ping()
        assert d.http_json("GET", "/status")["gpu"]["registrations"] == []
        assert count(log, "open") == 4
    finally:
        engine.close()


def test_daemon_restart_on_the_same_endpoint(daemon_factory, clients):
    d = daemon_factory("--lease-ms", str(LEASE_MS))
    c = clients(d, instance="py-restart")
    assert c.store(NS, [key(1)], [b"a" * PAGE]) == 1
    old = dict(c.info["shm"])
    assert mapped_len_ok(c, 64 << 20)
    d2 = restart_daemon(daemon_factory, d, "--l1-size", "32M", "--lease-ms", str(LEASE_MS))
    try:
        assert c.store(NS, [key(2)], [b"b" * PAGE]) == 1
        assert c.info["shm"]["path"] != old["path"] and mapped_len_ok(c, 32 << 20)
        assert c.fetch(NS, [key(1), key(2)]) == [], "key 1 was the old daemon's"
        assert c.fetch(NS, [key(2)]) == [b"b" * PAGE]
        with open("/proc/self/maps") as f:
            maps = f.read()
        assert old["path"] not in maps and c.info["shm"]["path"] in maps
        wait_until(lambda: (instance_status(d2, "py-restart") or {}).get("connections") == 2,
                   3, what="the heartbeat to join the new instance")
        c.close()
        assert instance_status(d2, "py-restart") is None
    finally:
        d2.stop()                 # before the fixture removes the first daemon's run dir


def test_close_stops_the_heartbeat_at_once(daemon_factory, clients):
    d = daemon_factory("--lease-ms", "300")
    c = clients(d, instance="py-close", timeout_ms=300)
    hb = heartbeat_threads()
    assert len(hb) == 1
    t0 = time.monotonic()
    c.close()                                          # daemon up: BYE, heartbeat joined
    assert time.monotonic() - t0 < 0.25, "close() took %.3f s" % (time.monotonic() - t0)
    assert not hb[0].is_alive() and heartbeat_threads() == []

    c = clients(d, instance="py-close-2", timeout_ms=300)
    wait_until(lambda: (instance_status(d, "py-close-2") or {}).get("connections") == 2, 3,
               what="the heartbeat to join the instance")
    hb = heartbeat_threads()
    d.stop()                                           # no daemon: BYE times out (300 ms)
    t0 = time.monotonic()
    c.close()
    took = time.monotonic() - t0
    assert took < 0.3 + 0.25, "close() took %.3f s without a daemon" % took
    assert not hb[0].is_alive() and heartbeat_threads() == []


def test_unclosed_client_stops_its_heartbeat_when_collected(daemon_factory):
    """A Client dropped without close() must not keep its instance alive for ever."""
    d = daemon_factory("--lease-ms", "300")
    c = kvtier.Client(d.ipc, instance="py-forgotten", context=d.ctx)
    hb = heartbeat_threads()
    assert len(hb) == 1
    del c
    gc.collect()
    wait_until(lambda: not hb[0].is_alive(), 2, what="the heartbeat of a collected Client to end")
    wait_until(lambda: drop_lines(d, "py-forgotten"), 3, what="its instance to be dropped")


def test_heartbeat_interval_settings(daemon_factory, clients, monkeypatch):
    d = daemon_factory("--lease-ms", "90000")
    assert clients(d).heartbeat_ms == 10000                     # lease_ms / 3, at most 10 s
    monkeypatch.setenv("KVTIER_HEARTBEAT_MS", "250")
    assert clients(d).heartbeat_ms == 250
    assert clients(d, heartbeat_ms=5).heartbeat_ms == 10        # the argument wins; >= 10 ms
    monkeypatch.setenv("KVTIER_HEARTBEAT_MS", "0")
    assert clients(d).heartbeat_ms == 0
    d2 = daemon_factory("--lease-ms", "150")
    monkeypatch.delenv("KVTIER_HEARTBEAT_MS")
    assert clients(d2).heartbeat_ms == 100                      # at least 100 ms
    with pytest.raises(ValueError):
        clients(d2, heartbeat_ms=-1)
