"""The residency map (docs/protocol.md "Residency map"): the table of keys READY in L1 that the
daemon hands, read-only, to fast-path clients whose HELLO asks for it, so that they find a
batch in L1 without a request.

Through the Python client (Client.resident_prefix): the map follows RESERVE/COMMIT, PUT,
REMOVE, CLEAR, eviction and a daemon restart; namespaces and salts never mix; no request
reaches the daemon for a probe; a stopped daemon's map is not believed after a second, a
killed one's at once. Through the raw protocol: a HELLO without `resident` gets the
ring pair alone (older clients), a HELLO with it gets two descriptors, and the map's is
read-only and sealed against writing; `resident_map false` offers none. The residency map
rides the fast path, so these tests run with it whatever KVT_TRANSPORT says."""

import fcntl
import hashlib
import mmap
import os
import signal
import socket
import time

import pytest

from kvtier import _ring  # noqa: E402
from kvtest import PAGE, metric_value, payload, wait_until  # noqa: E402
from test_fastpath import clients  # noqa: E402,F401 - the fixture

NS = "resident/kv"
KVT_DAEMON_ARGS = ("--l2", "none")
F_GET_SEALS = 1034
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_FUTURE_WRITE = 1, 2, 4, 16


@pytest.fixture(autouse=True)
def _fastpath_on(monkeypatch):
    monkeypatch.delenv("KVTIER_FASTPATH", raising=False)
    monkeypatch.delenv("KVTIER_RESIDENT", raising=False)
    if not _ring.has_resident(_ring.library()):
        pytest.skip("the residency map needs libkvtier's kvtier_resident_prefix: %s"
                    % (_ring.why or "the library predates it"))


def key(i, tag="k"):
    return hashlib.blake2b(tag.encode() + b"/%d" % i, digest_size=16).digest()


def lookups(d):
    return metric_value(d.metrics()[1], "kvtier_requests_total", type="lookup") or 0


def store(c, ns, keys, size=PAGE, salt=None):
    slots, lease = c.reserve(ns, keys, size, salt=salt)
    for s in slots:
        if s is not None:
            s[:] = payload("r", size)
    return c.commit(lease) if lease else 0


def test_the_map_follows_l1_without_requests(daemon, clients):
    c = clients(daemon)
    assert c.fastpath, c.fastpath_why
    assert c.info["fastpath"]["resident"] > 0
    keys = [key(i) for i in range(64)]
    assert c.resident_prefix(NS, keys) == 0
    assert c.resident_prefix(NS, []) == 0
    # reserved, not committed: not there yet
    slots, lease = c.reserve(NS, keys[:8], PAGE)
    assert c.resident_prefix(NS, keys) == 0
    for s in slots:
        s[:] = b"x" * PAGE
    assert c.commit(lease) == 8
    before = lookups(daemon)
    for _ in range(50):
        assert c.resident_prefix(NS, keys) == 8
        assert c.resident_prefix(NS, keys[:8]) == 8
    assert lookups(daemon) == before, "a probe of the map sent a LOOKUP"
    # PUT too; a hole stops the prefix; the other namespace and salts never see them
    c.put(NS, keys[8:16], [b"p" * 100] * 8)
    assert c.resident_prefix(NS, keys) == 16
    assert c.resident_prefix(NS, keys, salt="s") == 0
    assert c.resident_prefix(NS + "x", keys) == 0
    assert c.resident_prefix("resident/k", keys) == 0
    assert store(c, NS, keys[:4], salt="s") == 4
    assert c.resident_prefix(NS, keys, salt="s") == 4
    assert c.resident_prefix(NS, keys, salt=b"s") == 4
    c.remove(NS, [keys[5]])
    assert c.resident_prefix(NS, keys) == 5
    assert c.resident_prefix(NS, keys[6:]) == 10
    # the LOOKUP agrees with the map (and is counted where the probes were not)
    before = lookups(daemon)
    assert c.lookup(NS, keys).l1 == 5
    assert lookups(daemon) == before + 1
    c.clear(NS)
    assert c.resident_prefix(NS, keys[6:]) == 0
    assert c.resident_prefix(NS, keys, salt="s") == 0
    with pytest.raises(ValueError):
        c.resident_prefix(NS, [b"short"])
    st = daemon.http_json("GET", "/status")["l1"]["resident_map"]
    assert st["entries"] == 0 and st["slots"] >= 1024 and st["bytes"] >= 8 * st["slots"]


def test_evicted_keys_leave_the_map(daemon_factory, clients):
    d = daemon_factory("--l1-size", "8M")
    c = clients(d)
    size = 512 * 1024
    keys = [key(i, "ev") for i in range(40)]      # 20 MiB through an 8 MiB L1
    for i in range(0, 40, 4):
        assert store(c, NS, keys[i:i + 4], size) == 4
    assert c.resident_prefix(NS, keys[:4]) == 0
    assert c.resident_prefix(NS, keys[-4:]) == 4
    got = sum(c.resident_prefix(NS, [k]) for k in keys)
    assert got == c.stats()["l1_objects"]
    assert metric_value(d.metrics()[1], "kvtier_resident_map_entries") == got


def test_a_restarted_daemon_hands_a_new_map(daemon_factory, clients):
    d = daemon_factory("--l1-adopt=false")
    c = clients(d)
    keys = [key(i, "rs") for i in range(4)]
    assert store(c, NS, keys) == 4
    assert c.resident_prefix(NS, keys) == 4
    d.restart()
    c.hello()
    assert c.fastpath, c.fastpath_why
    assert c.resident_prefix(NS, keys) == 0        # an empty L1, another map
    assert store(c, NS, keys[:2]) == 2
    assert c.resident_prefix(NS, keys) == 2


def test_off_switches(daemon_factory, clients, monkeypatch):
    d = daemon_factory("--resident-map=false")
    c = clients(d)
    assert c.fastpath and "resident" not in c.info["fastpath"]
    assert c.resident_prefix(NS, [key(0)]) is None
    d2 = daemon_factory()
    monkeypatch.setenv("KVTIER_RESIDENT", "0")
    c2 = clients(d2)
    assert c2.fastpath and "resident" not in c2.info["fastpath"]
    assert c2.resident_prefix(NS, [key(0)]) is None
    c3 = clients(d2, fastpath=False)
    assert c3.resident_prefix(NS, [key(0)]) is None


def _hello(d, sock, instance, **extra):
    body = {"version": 1, "client": "raw", "instance": instance, "fastpath": True}
    body.update(extra)
    return d.ok(sock, 1, body)


def _claim(offer):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(offer["socket"])
    s.sendall(offer["ticket"].encode())
    msg, fds, _, _ = socket.recv_fds(s, 256, 4)
    return s, msg, fds


def test_raw_handoff_one_descriptor_unless_asked_and_the_map_is_read_only(daemon):
    sock = daemon.dealer()
    old = _hello(daemon, sock, "raw-old")
    assert "resident" not in old["fastpath"]
    s, msg, fds = _claim(old["fastpath"])
    try:
        assert msg == b"K" and len(fds) == 1, "a client that did not ask gets the pair alone"
    finally:
        for fd in fds:
            os.close(fd)
        s.close()
    sock2 = daemon.dealer()
    new = _hello(daemon, sock2, "raw-new", resident=True)
    size = new["fastpath"]["resident"]
    s, msg, fds = _claim(new["fastpath"])
    try:
        assert msg == b"K" and len(fds) == 2
        fd = fds[1]
        assert os.fstat(fd).st_size == size
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        seals = fcntl.fcntl(fd, F_GET_SEALS)
        want = F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE
        assert seals & want == want, seals
        with pytest.raises(PermissionError):
            mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.pwrite(fd, b"\0" * 8, 128)
        # the header a reader checks: "KVTRES01", version 1, 128 bytes
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        assert m[:8] == b"KVTRES01"
        assert int.from_bytes(m[8:12], "little") == 1
        assert int.from_bytes(m[12:16], "little") == 128
        m.close()
    finally:
        for fd in fds:
            os.close(fd)
        s.close()


def test_a_forked_writer_cannot_write_the_map(daemon, clients):
    """Even the process holding the descriptor (any client) cannot map it writable or
    mprotect its read-only mapping: checked in a child that tries."""
    c = clients(daemon)
    assert c.fastpath and c._ring.resident
    addr, size = c._ring._resident
    # the mapping is inherited by a fork: the child tries to make it writable
    pid = os.fork()
    if pid == 0:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        rc = libc.mprotect(ctypes.c_void_p(addr), size, mmap.PROT_READ | mmap.PROT_WRITE)
        os._exit(0 if rc != 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "mprotect made the map writable"


def test_a_stopped_or_killed_daemon_is_not_believed(daemon_factory, clients):
    """The map carries the daemon's beat (every 50 ms): stopped (SIGSTOP) for more than a
    second, it is not believed (None: ask the daemon); back (SIGCONT), it is again; killed,
    its handoff connection ends and the map goes with it at once."""
    d = daemon_factory()
    c = clients(d)
    keys = [key(i, "beat") for i in range(3)]
    assert store(c, NS, keys) == 3
    assert c.resident_prefix(NS, keys) == 3
    d.send_signal(signal.SIGSTOP)
    try:
        time.sleep(1.3)
        assert c.resident_prefix(NS, keys) is None
    finally:
        d.send_signal(signal.SIGCONT)
    wait_until(lambda: c.resident_prefix(NS, keys) == 3, 5, what="the map believed again")
    d.stop(signal.SIGKILL)
    wait_until(lambda: c.resident_prefix(NS, keys) is None, 1, interval=0.01,
               what="the map of a killed daemon dropped")
