"""libkvtier (the C client, client/kvtier.h) and the kvtier CLI against the real daemon.

The C side is build/kvtier-client-test (tests/integration/c_client_test.c, KVT_CLIENT_TEST):
each scenario runs in its own process, so the store of a prefix (rank-store) and its load
(rank-load) happen in different processes, as they do for two data-parallel ranks of one
engine. The CLI tests (KVT_CLI) cover put/get/lookup/clear/hash. Without KVT_CLIENT_TEST the
scenario tests are skipped; without KVT_CLI the CLI tests are.
"""

import os
import random
import select
import shutil
import signal
import subprocess
import time

import pytest

import kvtier
from kvtest import MiB, wait_until
from test_events import start_with_events, sync
from test_security import curve_args, pki  # noqa: F401 - pki is a fixture

VECTOR = ["361d40d624bc45847cb55c04878d9596", "390d55d1f642cbe361c5f27bacda5d77"]
VECTOR_SALTED = ["d94d032fdacc9824ff9e899c1d74acfc", "dafdfb4cdf651f440368d67cab9efb68"]

SCENARIO_TIMEOUT_S = 60
# L1 alone: after CLEAR an L2 tier would still answer LOOKUP (CLEAR empties L1 only)
KVT_DAEMON_ARGS = ("--l2", "none")


def _client_test_bin():
    p = os.environ.get("KVT_CLIENT_TEST")
    if not p or not os.path.isfile(p) or not os.access(p, os.X_OK):
        return None
    return os.path.abspath(p)


needs_client_test = pytest.mark.skipif(
    _client_test_bin() is None,
    reason="KVT_CLIENT_TEST is unset or not executable (make build/kvtier-client-test and set "
           "KVT_CLIENT_TEST=/abs/build/kvtier-client-test)")


def _env():
    e = dict(os.environ)
    e.pop("KVTIER_ENDPOINT", None)
    return e


def _start_scenario(endpoint, name):
    return subprocess.Popen([_client_test_bin(), endpoint, name], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())


def _finish(proc, name, daemon):
    try:
        out, err = proc.communicate(timeout=SCENARIO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError("scenario %s did not finish within %d s\n%s%s"
                             % (name, SCENARIO_TIMEOUT_S, out, err))
    assert proc.returncode == 0, ("scenario %s failed (exit %s)\n--- stdout ---\n%s"
                                  "--- stderr ---\n%s--- kvtierd stderr tail ---\n%s"
                                  % (name, proc.returncode, out, err, daemon.stderr_tail(30)))
    return out


def run_scenario(daemon, name, endpoint=None):
    """Runs one scenario of kvtier-client-test in its own process; returns its stdout."""
    return _finish(_start_scenario(endpoint or daemon.ipc, name), name, daemon)


class Scenario:
    """A scenario that pauses ("pause: WHAT" on stdout, then a line on stdin) so that the test
    can look at or change the daemon in between."""

    def __init__(self, endpoint, name, env=None):
        e = _env()
        e.update(env or {})
        self.name = name
        self.proc = subprocess.Popen([_client_test_bin(), endpoint, name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e)
        self.out = b""

    def wait_pause(self, what, timeout=20):
        want = ("pause: %s\n" % what).encode()
        deadline = time.monotonic() + timeout
        while want not in self.out:
            left = deadline - time.monotonic()
            assert left > 0, "scenario %s did not pause at %r: %r" % (self.name, what, self.out)
            if select.select([self.proc.stdout], [], [], left)[0]:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    self.proc.wait(10)
                    raise AssertionError("scenario %s exited %s before %r\n%s%s"
                                         % (self.name, self.proc.returncode, what,
                                            self.out.decode(), self.proc.stderr.read().decode()))
                self.out += chunk

    def resume(self):
        self.proc.stdin.write(b"\n")
        self.proc.stdin.flush()

    def finish(self, daemon):
        self.proc.stdin.close()
        self.proc.stdin = None
        try:
            out, err = self.proc.communicate(timeout=SCENARIO_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        out = (self.out + out).decode()
        assert self.proc.returncode == 0, ("scenario %s failed (exit %s)\n--- stdout ---\n%s"
                                           "--- stderr ---\n%s--- kvtierd stderr tail ---\n%s"
                                           % (self.name, self.proc.returncode, out,
                                              err.decode(), daemon.stderr_tail(30)))
        return out

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# ----------------------------------------------------------------------------------------
# libkvtier scenarios


@needs_client_test
def test_rank_store_then_rank_load(daemon):
    """Rank 0 stores a 4-chunk prefix through the arena; other processes find and read it."""
    out = run_scenario(daemon, "rank-store")
    assert "stored 4 chunks" in out, out
    out = run_scenario(daemon, "rank-load")
    assert "4 chunks verified" in out, out
    # two more ranks at once, one over tcp (same host: it maps the arena too)
    procs = [(_start_scenario(ep, "rank-load"), ep) for ep in (daemon.ipc, daemon.tcp)]
    for p, ep in procs:
        assert "4 chunks verified" in _finish(p, "rank-load (%s)" % ep, daemon)
    # every lease was released: nothing stays pinned after the ranks said BYE
    assert daemon.stats()["leases_active"] == 0


@needs_client_test
def test_rank_load_without_store_fails(daemon):
    p = _start_scenario(daemon.ipc, "rank-load")
    out, err = p.communicate(timeout=SCENARIO_TIMEOUT_S)
    assert p.returncode == 1, (out, err)
    assert "hits 0" in err, err


@needs_client_test
def test_salt_isolation(daemon):
    assert "isolated" in run_scenario(daemon, "salt")


@needs_client_test
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_embedding_put_get(daemon, transport):
    out = run_scenario(daemon, "embed", daemon.endpoint(transport))
    assert "3145728 bytes round-tripped" in out, out


@needs_client_test
def test_hash_local_equals_daemon(daemon):
    assert "documented vectors" in run_scenario(daemon, "hash")


@needs_client_test
def test_error_paths(daemon):
    assert "errors: ok" in run_scenario(daemon, "errors")


@needs_client_test
@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="a CUDA device: make test-gpu")
def test_gpu_calls_without_gpu(daemon):
    assert "gpu-none: ok" in run_scenario(daemon, "gpu-none")


@needs_client_test
def test_prefetch(daemon):
    assert "prefetch:" in run_scenario(daemon, "prefetch")


def _subscribed(daemon_factory):
    """A daemon publishing events, a client and a live subscription to them."""
    d, ep = start_with_events(daemon_factory)
    c = kvtier.Client(d.ipc, client="labels-test", context=d.ctx)
    sub = kvtier.Subscriber(ep, context=d.ctx)
    sync(c, sub)
    return d, c, sub


def _next_stored(sub, ns):
    while True:
        ev = sub.recv(3000)
        assert ev is not None, "no stored event for %s within 3 s" % ns
        if ev["event"] == "stored" and ev["ns"] == ns:
            return ev


@needs_client_test
def test_labels_from_libkvtier(daemon_factory):
    """kvtier_put_labeled and kvtier_reserve_labeled send each object's label: the stored
    events carry them (None for the key given none); bad labels are KVTIER_EINVAL before
    anything is sent, so nothing else is stored."""
    d, c, sub = _subscribed(daemon_factory)
    try:
        assert "labels: ok" in run_scenario(d, "labels")
        ns = "c-client-test-labels"
        ev = _next_stored(sub, ns)
        assert ev["keys"] == [bytes([0x51]) + bytes(15), bytes([0x52]) + bytes(15)], ev
        assert ev["labels"] == ["image-\u65e5\u672c", None] and ev["sizes"] == [11, 11], ev
        ev = _next_stored(sub, ns)
        assert ev["keys"] == [bytes([0x53]) + bytes(15)], ev
        assert ev["labels"] == ["x" * 255] and ev["sizes"] == [4096], ev
        assert sub.recv(300) is None
        assert c.lookup(ns, [bytes([k]) + bytes(15) for k in (0x51, 0x52, 0x53)]).hits == 3
    finally:
        sub.close()
        c.close()


# ----------------------------------------------------------------------------------------
# Liveness: the heartbeat keeps an idle handle's instance; a dropped one comes back by itself

LEASE_MS = 400


def instance_status(d, instance):
    """The daemon's /status entry of `instance`, or None."""
    for c in d.http_json("GET", "/status")["clients"]:
        if c.get("instance") == instance:
            return c
    return None


def drop_lines(d, instance):
    """The daemon's log lines saying it dropped `instance` for silence."""
    return [line for line in d.log_lines() if "client instance %s silent" % instance in line]


@needs_client_test
@pytest.mark.parametrize("transport", ["ipc", "tcp-curve"])
def test_idle_handle_keeps_its_instance(daemon_factory, transport, request):
    """An engine idle for 3 x lease_ms: the heartbeat (its own thread and connection, with
    the handle's CURVE keys on tcp) keeps the instance and its write lease; the daemon never
    drops it."""
    env = {"KVT_TEST_INSTANCE": "c-idle"}
    if transport == "ipc":
        d = daemon_factory("--lease-ms", str(LEASE_MS))
    else:
        keys = request.getfixturevalue("pki")
        d = daemon_factory(*curve_args(keys), "--lease-ms", str(LEASE_MS))
        env.update(KVTIER_CURVE_SERVERKEY=keys["server"], KVTIER_CURVE_CERT=keys["alice"])
    sc = Scenario(d.ipc if transport == "ipc" else d.tcp, "idle", env)
    try:
        wait_until(lambda: (instance_status(d, "c-idle") or {}).get("connections") == 2, 5,
                   what="the heartbeat to join the instance (a second connection)")
        out = sc.finish(d)
    finally:
        sc.kill()
    assert "instance and lease kept" in out, out
    assert drop_lines(d, "c-idle") == [], drop_lines(d, "c-idle")


def _reestablish(daemon_factory, tmp_path, with_gpu):
    if with_gpu:
        from test_gpu import MockEngine, count, mock_daemon
        d, log = mock_daemon(daemon_factory, tmp_path, "--lease-ms", str(LEASE_MS))
        engine = MockEngine(layers=1, num_blocks=16, block_tokens=4, token_bytes=256,
                            shared=False)
    else:
        d, log, engine = daemon_factory("--lease-ms", str(LEASE_MS)), None, None
    env = {"KVTIER_HEARTBEAT_MS": "0", "KVT_TEST_INSTANCE": "c-quiet"}
    if engine:
        env["KVT_TEST_GPU_FILE"] = engine.where[0][0]
    sc = Scenario(d.ipc, "no-heartbeat", env)
    try:
        sc.wait_pause("dropped")
        owner = instance_status(d, "c-quiet")["owner"]
        assert instance_status(d, "c-quiet")["connections"] == 1     # no heartbeat
        if engine:
            regs = d.http_json("GET", "/status")["gpu"]["registrations"]
            assert [r["owner"] for r in regs] == [owner], regs
        wait_until(lambda: drop_lines(d, "c-quiet"), 5, what="the daemon to drop c-quiet")
        if engine:
            wait_until(lambda: count(log, "close") == 1, 5, what="its IPC handle closed")
        sc.resume()
        if engine:
            sc.wait_pause("reregistered")
            again = instance_status(d, "c-quiet")
            assert again is not None and again["owner"] != owner, again
            regs = d.http_json("GET", "/status")["gpu"]["registrations"]
            assert [r["owner"] for r in regs] == [again["owner"]], regs
            assert count(log, "open") == 2, log
            sc.resume()
        out = sc.finish(d)
    finally:
        sc.kill()
        if engine:
            engine.close()
    assert "re-established" in out, out
    assert d.stats()["leases_active"] == 0


@needs_client_test
def test_dropped_instance_comes_back_by_itself(daemon_factory, tmp_path):
    """KVTIER_HEARTBEAT_MS=0 and idle past lease_ms: the daemon drops the instance; COMMIT of
    the old lease fails (not retried), the next RESERVE says HELLO again and is retried."""
    _reestablish(daemon_factory, tmp_path, with_gpu=False)


@needs_client_test
@pytest.mark.skipif(not os.environ.get("KVT_MOCK_CUDART"),
                    reason="no mock libcudart (KVT_MOCK_CUDART; CUDA=0)")
def test_dropped_instance_gets_its_gpu_layout_back(daemon_factory, tmp_path):
    """The same with a GPU registration (the mock CUDA runtime): registered again with the
    new instance (/status gpu.registrations, the mock's handle opens), STORE_GPU works."""
    _reestablish(daemon_factory, tmp_path, with_gpu=True)


def restart_daemon(daemon_factory, d, *extra):
    """Stops d and starts another daemon on its run dir and ipc endpoint (another process,
    so another arena), with its own HTTP port and `extra` flags."""
    d.stop()
    d2 = daemon_factory(start=False)
    d2.args = ["--run-dir", d.run_dir, "--data-dir", d2.data_dir, "--listen", d.ipc,
               "--http", d2.http_addr, "--log-level", "debug", "--l2", "none"] + list(extra)
    d2.ipc, d2.ipc_path = d.ipc, d.ipc_path
    return d2.start()


@needs_client_test
@pytest.mark.parametrize("heartbeat", ["on", "off"])
def test_daemon_restart(daemon_factory, heartbeat):
    """The daemon restarts on the same endpoint: the handle's next call works, in the new
    daemon's arena (the old one unmapped)."""
    d = daemon_factory("--lease-ms", str(LEASE_MS))
    env = {"KVT_TEST_INSTANCE": "c-restart"}
    if heartbeat == "off":
        env["KVTIER_HEARTBEAT_MS"] = "0"
    sc = Scenario(d.ipc, "restart", env)
    try:
        sc.wait_pause("restart")
        old_shm = d.hello(d.dealer(), "probe-old")["shm"]["path"]
        d2 = restart_daemon(daemon_factory, d, "--l1-size", "32M", "--lease-ms", str(LEASE_MS))
        sc.resume()
        sc.wait_pause("after")
        new_shm = d2.hello(d2.dealer(), "probe-new")["shm"]["path"]
        with open("/proc/%d/maps" % sc.proc.pid) as f:
            maps = f.read()
        assert new_shm in maps and old_shm not in maps, (old_shm, new_shm, maps)
        st = instance_status(d2, "c-restart")
        assert st is not None, d2.http_json("GET", "/status")["clients"]
        if heartbeat == "on":    # the heartbeat joined the new instance too
            wait_until(lambda: instance_status(d2, "c-restart")["connections"] == 2, 5,
                       what="the heartbeat to join the new instance")
        sc.resume()
        out = sc.finish(d2)
        d2.stop()           # before the fixture removes the first daemon's run dir
    finally:
        sc.kill()
    assert "then 33554432 bytes" in out, out


@needs_client_test
def test_fastpath_daemon_crash_and_restart(daemon_factory):
    """The daemon is killed (it closes no ring) and another starts on the endpoint, while the
    handle (no heartbeat) is idle with a pair: the next call does not push into the dead ring
    (the old arena file is gone) but goes over the socket, re-establishes the instance, maps the
    new arena and gets a pair there."""
    d = daemon_factory("--lease-ms", str(LEASE_MS))
    sc = Scenario(d.ipc, "restart", {"KVT_TEST_INSTANCE": "c-crash", "KVTIER_HEARTBEAT_MS": "0"})
    try:
        sc.wait_pause("restart")
        assert fastpath_status(d)["rings_open"] == 1
        d.stop(signal.SIGKILL)
        d2 = restart_daemon(daemon_factory, d, "--l1-size", "32M", "--lease-ms", str(LEASE_MS))
        sc.resume()
        sc.wait_pause("after")
        assert fastpath_status(d2)["rings_open"] == 1 and fastpath_status(d2)["requests"] > 0
        sc.resume()
        out = sc.finish(d2)
        d2.stop()
    finally:
        sc.kill()
    assert "then 33554432 bytes" in out, out


@needs_client_test
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_adopted_arena_keeps_the_mapping(daemon_factory, sig):
    """l1.adopt: the daemon restarts (SIGTERM or SIGKILL) with the arena it left; the handle,
    with no reconnect code of its own, reads the object stored before byte-exact through the
    mapping it had (HELLO names the same file: nothing is mapped again) and stores anew."""
    d = daemon_factory("--l1-adopt", "--lease-ms", str(LEASE_MS))
    sc = Scenario(d.ipc, "adopt", {"KVT_TEST_INSTANCE": "c-adopt"})
    try:
        sc.wait_pause("restart")
        path = d.hello(d.dealer(), "probe-old")["shm"]["path"]
        wait_until(lambda: d.http_json("GET", "/status")["l1"]["adopt"]["sums_pending"] == 0, 10,
                   what="the object summed")
        d.restart(sig)
        assert d.http_json("GET", "/status")["l1"]["adopt"]["adopted"] is True
        sc.resume()
        sc.wait_pause("after")
        with open("/proc/%d/maps" % sc.proc.pid) as f:
            maps = [ln for ln in f.read().splitlines() if ln.endswith(path)]
        assert len(maps) == 1, maps      # one mapping of the arena, the first one
        sc.resume()
        out = sc.finish(d)
    finally:
        sc.kill()
    assert "adopt: the object of before read back" in out, out


@needs_client_test
def test_close_stops_the_heartbeat_without_a_daemon(daemon_factory):
    """kvtier_close with the daemon gone: the heartbeat stops at once (its waits watch an
    eventfd), BYE waits no longer than the handle's timeout, no thread is left."""
    d = daemon_factory("--lease-ms", "300")
    sc = Scenario(d.ipc, "close", {"KVT_TEST_INSTANCE": "c-close"})
    try:
        sc.wait_pause("joined")
        wait_until(lambda: (instance_status(d, "c-close") or {}).get("connections") == 2, 5,
                   what="the heartbeat to join the instance")
        d.stop(signal.SIGKILL)
        sc.resume()
        out = sc.finish(d)
    finally:
        sc.kill()
    assert "no thread left" in out, out


@needs_client_test
def test_fork_child_leaves_the_parents_instance(daemon):
    out = run_scenario(daemon, "fork")
    assert "lease is intact" in out, out


def _can_unshare():
    if shutil.which("unshare") is None:
        return False
    try:
        cp = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                             "mount -t tmpfs none /dev/shm"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return cp.returncode == 0


@needs_client_test
def test_client_without_the_arena(daemon_factory):
    """A client that cannot open HELLO's shm.path (as on another host) still connects;
    RESERVE/ACQUIRE refuse locally with unavailable, PUT/GET work. The daemon runs in its own
    mount namespace with a private /dev/shm, so its arena file is invisible to the client."""
    if not _can_unshare():
        pytest.skip("needs unshare -m and mount (root or CAP_SYS_ADMIN) for a private /dev/shm")
    d = daemon_factory(prefix=["unshare", "-m", "--propagation", "private", "sh", "-c",
                               'mount -t tmpfs none /dev/shm && exec "$0" "$@"'])
    assert "put/get work" in run_scenario(d, "remote")


# ----------------------------------------------------------------------------------------
# The fast path (issue 17): the ring pair HELLO offers. Every test here has "fastpath" in its
# name: `pytest -k fastpath` runs them.


def fastpath_status(d):
    return d.http_json("GET", "/status")["fastpath"]


@needs_client_test
@pytest.mark.parametrize("how", ["on", "env-off", "daemon-off"])
def test_fastpath_calls(daemon_factory, how):
    """With the pair (the default), with KVTIER_FASTPATH=0, and with a daemon that offers
    none (fastpath.enabled false): kvtier_fastpath_active says which, and the same calls
    work with the same bytes. With the pair, requests went over it, and the pair is closed
    with the handle."""
    d = daemon_factory("--fastpath-enabled=false") if how == "daemon-off" else daemon_factory()
    env = {"KVT_TEST_FASTPATH": "1" if how == "on" else "0"}
    if how == "env-off":
        env["KVTIER_FASTPATH"] = "0"
    sc = Scenario(d.ipc, "fastpath", env)
    try:
        out = sc.finish(d)
    finally:
        sc.kill()
    assert "fastpath: active %d" % (how == "on") in out, out
    st = fastpath_status(d)
    assert st["enabled"] == (how != "daemon-off"), st
    if how == "on":
        assert st["requests"] > 0, st
        wait_until(lambda: fastpath_status(d)["rings_open"] == 0, 5,
                   what="the daemon to close the pair after BYE")
    else:
        assert st["requests"] == 0 and st["rings_open"] == 0, st


@needs_client_test
def test_fastpath_after_the_instance_was_dropped(daemon_factory):
    """KVTIER_HEARTBEAT_MS=0, idle past lease_ms: the daemon drops the instance and closes its
    pair; the next call falls back to the socket, says HELLO again (asking again) and gets a
    new pair, on which the calls go on."""
    d = daemon_factory("--lease-ms", str(LEASE_MS))
    sc = Scenario(d.ipc, "fastpath-redo", {"KVTIER_HEARTBEAT_MS": "0",
                                          "KVT_TEST_INSTANCE": "c-fp-redo"})
    try:
        sc.wait_pause("idle")
        wait_until(lambda: drop_lines(d, "c-fp-redo"), 5, what="the daemon to drop c-fp-redo")
        wait_until(lambda: fastpath_status(d)["rings_open"] == 0, 5,
                   what="the daemon to close the dropped instance's pair")
        sc.resume()
        out = sc.finish(d)
    finally:
        sc.kill()
    assert "a new pair after the drop" in out, out


@needs_client_test
@pytest.mark.parametrize("offer", ["ok", "bad", "old", "env-off"])
def test_fastpath_against_a_fake_daemon(tmp_path, offer):
    """libkvtier's side of the fast path against tests/integration/fastpath_fake.py: a
    RELEASE posted on the ring is answered before a request goes over the socket, a forked
    child leaves the pair alone, a late reply times the call out and is skipped by the next,
    instance_dropped on either transport brings a new pair (the old one closed before the
    HELLO), the daemon closing the pair in flight fails that call and idle sends the next over
    the socket, a daemon gone without a word (its arena file gone) costs one timeout, BYE comes
    after our sides are closed. A pair that does not check out (a
    misaligned ring), a daemon that predates the fast path, or KVTIER_FASTPATH=0 leave
    everything on the socket."""
    from fastpath_fake import HELLO, PING, RELEASE, STATS, FakeFastpathDaemon
    lib = os.path.join(os.path.dirname(_client_test_bin()), "libkvtier.so")
    if not os.path.isfile(lib):
        pytest.skip("no %s next to KVT_CLIENT_TEST" % lib)
    fake = FakeFastpathDaemon(lib, str(tmp_path), offer="bad" if offer == "bad" else
                              "old" if offer == "old" else "ok")
    env = {"KVTIER_HEARTBEAT_MS": "0", "KVT_TEST_FASTPATH": "1" if offer == "ok" else "0"}
    if offer == "env-off":
        env["KVTIER_FASTPATH"] = "0"
    sc = Scenario(fake.ipc, "fastpath-fake", env)
    try:
        if offer == "ok":
            sc.wait_pause("fork")
            assert fake.client_closed() == (0, 0), "the forked child closed the parent's pair"
            sc.resume()
            sc.wait_pause("slow")
            fake.delay_next_ring = 1.2    # the call's timeout is 0.7 s
            sc.resume()
            sc.wait_pause("redo-ring")
            fake.fail_next_ring = "instance_dropped"
            sc.resume()
            sc.wait_pause("drop-in-flight")
            fake.close_next_ring = True
            sc.resume()
            sc.wait_pause("redo-socket")
            fake.fail_next_zmq = "instance_dropped"
            sc.resume()
            sc.wait_pause("closed-idle")
            fake.close_idle.set()
            assert fake.closed_idle.wait(5)
            sc.resume()
            sc.wait_pause("redo-gone")
            fake.fail_next_zmq = "instance_dropped"
            sc.resume()
            sc.wait_pause("gone")
            fake.ring_dead = True
            os.rename(fake.arena_path, fake.arena_path + ".gone")
            sc.resume()
            sc.wait_pause("redo-bye")
            os.rename(fake.arena_path + ".gone", fake.arena_path)
            fake.fail_next_zmq = "instance_dropped"
            sc.resume()
        out = sc.finish(fake)
    finally:
        sc.kill()
        fake.stop()
    assert fake.problems == [], fake.problems
    asked = [bool(h.get("fastpath")) for h in fake.hellos]
    ring = [t for tr, t in fake.log if tr == "ring"]
    if offer == "ok":
        assert "ring, fork, timeout" in out, out
        assert asked == [True] * 5, fake.hellos    # connect and four re-HELLOs
        assert ring.count(PING) >= 7 and STATS in ring and RELEASE in ring, fake.log
        assert ("zmq", STATS) in fake.log, fake.log    # the big body went over the socket
        assert ("zmq", RELEASE) in fake.log, fake.log  # posted while there was no pair
    else:
        assert "socket only" in out, out
        assert ring == [], fake.log
        assert asked == {"bad": [True], "old": [True], "env-off": [False]}[offer], fake.hellos
        assert [t for _, t in fake.log].count(HELLO) == len(asked)


# ----------------------------------------------------------------------------------------
# The CLI


def cli(kvt_cli_bin, *args, endpoint=None, timeout=30, text=True):
    argv = [kvt_cli_bin] + (["-e", endpoint] if endpoint else []) + [str(a) for a in args]
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=text,
                              env=_env(), timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError("kvtier %s did not exit within %d s" % (" ".join(args), timeout))


def test_cli_put_get_lookup_clear(daemon, kvt_cli_bin, tmp_path):
    data = random.Random(1).randbytes(MiB + 4097)
    src = tmp_path / "embedding.bin"
    src.write_bytes(data)
    cp = cli(kvt_cli_bin, "put", src, endpoint=daemon.ipc)
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.split()
    assert len(lines) == 3 and lines[1:] == ["stored", "1"], cp.stdout
    key = lines[0]
    assert len(key) == 32 and int(key, 16) >= 0, key
    try:
        import xxhash
    except ImportError:
        xxhash = None
    if xxhash is not None:  # the default key is XXH3-128 of the bytes, canonical big-endian
        assert key == xxhash.xxh3_128_hexdigest(data), key
    # the same bytes again: same key, nothing new stored
    cp = cli(kvt_cli_bin, "put", src, endpoint=daemon.ipc)
    assert cp.returncode == 0 and cp.stdout.split() == [key, "stored", "0"], cp

    out = tmp_path / "back.bin"
    cp = cli(kvt_cli_bin, "get", "-o", out, key, endpoint=daemon.tcp)
    assert cp.returncode == 0, cp.stderr
    assert out.read_bytes() == data
    cp = cli(kvt_cli_bin, "get", key, endpoint=daemon.ipc, text=False)
    assert cp.returncode == 0 and cp.stdout == data, cp.stderr

    cp = cli(kvt_cli_bin, "lookup", key, endpoint=daemon.ipc)
    assert cp.returncode == 0 and cp.stdout.strip() == "hits 1 l1 1", (cp.stdout, cp.stderr)
    cp = cli(kvt_cli_bin, "lookup", key, "00" * 16, key, endpoint=daemon.ipc)
    assert cp.returncode == 0 and cp.stdout.strip() == "hits 1 l1 1", cp.stdout
    # another namespace or salt does not see it
    for extra in (("--ns", "other"), ("--salt", "tenant-a")):
        cp = cli(kvt_cli_bin, "lookup", *extra, key, endpoint=daemon.ipc)
        assert cp.returncode == 0 and cp.stdout.strip() == "hits 0 l1 0", (extra, cp.stdout)
        cp = cli(kvt_cli_bin, "get", *extra, key, endpoint=daemon.ipc)
        assert cp.returncode == 1 and "not found" in cp.stderr, (extra, cp)

    cp = cli(kvt_cli_bin, "clear", endpoint=daemon.ipc)
    assert cp.returncode == 0, cp.stderr
    removed = cp.stdout.split()
    assert removed[0] == "removed" and int(removed[1]) >= 1, cp.stdout
    cp = cli(kvt_cli_bin, "get", "-o", tmp_path / "gone.bin", key, endpoint=daemon.ipc)
    assert cp.returncode == 1 and "not found" in cp.stderr, cp
    assert not (tmp_path / "gone.bin").exists()
    cp = cli(kvt_cli_bin, "lookup", key, endpoint=daemon.ipc)
    assert cp.stdout.strip() == "hits 0 l1 0", cp.stdout


def test_cli_put_with_key_salt_and_ns(daemon, kvt_cli_bin, tmp_path):
    src = tmp_path / "one.bin"
    src.write_bytes(b"\x01")
    key = "0123456789abcdef0123456789ABCDEF"
    base = ("--ns", "cli-test", "--salt", "tenant-a")
    cp = cli(kvt_cli_bin, "put", *base, "--key", key, src, endpoint=daemon.ipc)
    assert cp.returncode == 0 and cp.stdout.split() == [key.lower(), "stored", "1"], cp
    cp = cli(kvt_cli_bin, "get", *base, key, endpoint=daemon.ipc, text=False)
    assert cp.returncode == 0 and cp.stdout == b"\x01", cp
    # clear of the default namespace leaves cli-test alone; clear --ns cli-test removes it
    cp = cli(kvt_cli_bin, "clear", endpoint=daemon.ipc)
    assert cp.returncode == 0 and cp.stdout.strip() == "removed 0", cp.stdout
    cp = cli(kvt_cli_bin, "clear", "--ns", "cli-test", endpoint=daemon.ipc)
    assert cp.returncode == 0 and cp.stdout.strip() == "removed 1", cp.stdout
    cp = cli(kvt_cli_bin, "put", "--key", key, src, endpoint=daemon.ipc)
    assert cp.returncode == 0, cp.stderr
    cp = cli(kvt_cli_bin, "clear", "--all", endpoint=daemon.ipc)
    assert cp.returncode == 0 and cp.stdout.strip() == "removed 1", cp.stdout


def test_cli_hash(kvt_cli_bin):
    """Local hashing: no daemon, no endpoint needed; the documented vectors."""
    toks = [str(t) for t in range(8)]
    cp = cli(kvt_cli_bin, "hash", "--chunk-tokens", "4", *toks, endpoint="ipc:///nonexistent")
    assert cp.returncode == 0 and cp.stdout.split() == VECTOR, (cp.stdout, cp.stderr)
    cp = cli(kvt_cli_bin, "hash", "--chunk-tokens", "4", "--salt", "tenant-a", *toks, "8")
    assert cp.returncode == 0 and cp.stdout.split() == VECTOR_SALTED, (cp.stdout, cp.stderr)
    cp = cli(kvt_cli_bin, "hash", *toks)  # default 256 tokens a chunk: no full chunk
    assert cp.returncode == 0 and cp.stdout == "", cp.stdout


def test_cli_put_label(daemon_factory, kvt_cli_bin, tmp_path):
    """kvtier put --label: the stored event names the object."""
    d, c, sub = _subscribed(daemon_factory)
    try:
        src = tmp_path / "photo.jpg"
        src.write_bytes(b"\xff\xd8" + bytes(1000))
        cp = cli(kvt_cli_bin, "put", "--ns", "cli-labels", "--label", "photo-\u00e9t\u00e9.jpg", src,
                 endpoint=d.ipc)
        assert cp.returncode == 0 and cp.stdout.split()[1:] == ["stored", "1"], cp
        ev = _next_stored(sub, "cli-labels")
        assert ev["keys"] == [bytes.fromhex(cp.stdout.split()[0])], ev
        assert ev["labels"] == ["photo-\u00e9t\u00e9.jpg"] and ev["sizes"] == [1002], ev
    finally:
        sub.close()
        c.close()


@pytest.mark.parametrize("args", [
    ("put",), ("put", "a", "b"), ("get",), ("get", "xyz"), ("get", "00" * 15),
    ("lookup",), ("lookup", "g" * 32), ("clear", "--ns"), ("clear", "--ns", "x", "--all"),
    ("hash",), ("hash", "-1"), ("hash", "4294967296"), ("hash", "--chunk-tokens", "0", "1"),
    ("put", "--bogus", "f"), ("ping", "extra"), ("-t", "abc", "ping"),
    ("put", "--label"), ("put", "--label", "y" * 256, "f"), ("put", "--label", "\udcff", "f"),
    ("put", "--label", "\udce6\udc97", "f"), ("get", "--label", "x", "00" * 16),
])
def test_cli_usage_errors(kvt_cli_bin, args):
    cp = cli(kvt_cli_bin, *args, endpoint="ipc:///nonexistent/kvtier.sock")
    assert cp.returncode == 2, (args, cp.returncode, cp.stdout, cp.stderr)
    assert cp.stderr.strip()


def test_cli_errors(daemon, kvt_cli_bin, tmp_path):
    cp = cli(kvt_cli_bin, "put", tmp_path / "missing.bin", endpoint=daemon.ipc)
    assert cp.returncode == 1 and "missing.bin" in cp.stderr, cp
    cp = cli(kvt_cli_bin, "-t", "300", "get", "00" * 16, endpoint="ipc:///nonexistent/k.sock")
    assert cp.returncode == 1 and cp.stderr.strip(), cp


def test_cli_pays_no_heartbeat(daemon, kvt_cli_bin):
    """A CLI command is over before the heartbeat's first interval: one HELLO, one connection
    (the heartbeat never connects)."""
    before = daemon.stats()["requests_total"]["hello"]
    cp = cli(kvt_cli_bin, "ping", endpoint=daemon.ipc)
    assert cp.returncode == 0 and cp.stdout.startswith("pong"), cp
    assert daemon.stats()["requests_total"]["hello"] == before + 1
