"""The daemon's life: command line and configuration, start-up refusals, signals and clean
stop, restart on the same directories, and the supervisor behind /readyz."""

import json
import os
import re
import signal
import threading
import time

import pytest
import zmq

from kvtest import (BYE, HELLO, PING, Daemon, free_port, pack, run_kvtierd, unpack,
                    wait_until)


def one_line(stderr):
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1, "expected exactly one line on stderr, got %d:\n%s" % (len(lines),
                                                                                 stderr)
    return lines[0]


def scratch_args(tmp_path):
    return ["--run-dir", str(tmp_path / "run"), "--data-dir", str(tmp_path / "data")]


# ----------------------------------------------------------------------------------------
# Command line


def test_version(kvt_daemon_bin):
    cp = run_kvtierd(["--version"])
    assert cp.returncode == 0, cp.stderr
    assert any("kvtier" in l for l in cp.stdout.splitlines()), repr(cp.stdout)


def test_help(kvt_daemon_bin):
    cp = run_kvtierd(["--help"])
    assert cp.returncode == 0, cp.stderr
    for flag in ("--l1-size", "--listen", "--http", "--config", "--check-config"):
        assert flag in cp.stdout, "--help does not list %s:\n%s" % (flag, cp.stdout)


def test_bad_size_suffix(kvt_daemon_bin, tmp_path):
    cp = run_kvtierd(scratch_args(tmp_path) + ["--l1-size", "12Q"])
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    assert "l1_size" in one_line(cp.stderr)


@pytest.mark.parametrize("args, field", [
    (["--chunk-tokens", "0"], "chunk_tokens"),
    (["--chunk-tokens", "many"], "chunk_tokens"),
    (["--lease-ms", "abc"], "lease_ms"),
    (["--high-watermark", "2.5"], "high_watermark"),
    (["--log-level", "loud"], "log_level"),
    (["--l1-size", "-5M"], "l1_size"),
    (["--l1-size", ""], "l1_size"),
    (["--low-watermark", "0.95"], "watermark"),
], ids=["chunk-zero", "chunk-word", "lease-word", "high-wm", "log-level", "size-neg",
        "size-empty", "low-above-high"])
def test_bad_values_exit_2(kvt_daemon_bin, tmp_path, args, field):
    cp = run_kvtierd(scratch_args(tmp_path) + args)
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    line = one_line(cp.stderr)
    assert re.search(field.replace("_", "[_-]"), line), \
        "error line does not name %s: %r" % (field, line)


def test_unknown_flag(kvt_daemon_bin, tmp_path):
    cp = run_kvtierd(scratch_args(tmp_path) + ["--no-such-flag"])
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    assert "no-such-flag" in cp.stderr, cp.stderr


def test_missing_flag_value(kvt_daemon_bin, tmp_path):
    cp = run_kvtierd(scratch_args(tmp_path) + ["--l1-size"])
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    assert cp.stderr.strip()


def test_check_config_good(kvt_daemon_bin):
    d = Daemon(binary=kvt_daemon_bin)
    try:
        t0 = time.monotonic()
        cp = run_kvtierd(d.args + ["--check-config"], cwd=d.dir)
        assert cp.returncode == 0, cp.stderr
        assert time.monotonic() - t0 < 10
        assert not os.path.exists(d.ipc_path), "--check-config must not bind endpoints"
    finally:
        d.cleanup()


def test_print_config_round_trip(daemon_factory):
    d = daemon_factory("--chunk-tokens", "128", "--lease-ms", "1234", start=False)
    cp = run_kvtierd(d.args + ["--print-config"], cwd=d.dir)
    assert cp.returncode == 0, cp.stderr
    try:
        doc = json.loads(cp.stdout)
    except ValueError:
        raise AssertionError("--print-config did not print JSON:\n%s" % cp.stdout)
    assert isinstance(doc, dict)
    path = os.path.join(d.dir, "printed.json")
    with open(path, "w") as f:
        f.write(cp.stdout)

    cp = run_kvtierd(["--config", path, "--check-config"], cwd=d.dir)
    assert cp.returncode == 0, cp.stderr

    # The printed file alone reproduces the configuration: same endpoints, same values.
    d.args = ["--config", path]
    d.start()
    body = d.hello(d.dealer(), "inst-printed")
    assert body["chunk_tokens"] == 128
    assert body["lease_ms"] == 1234
    d.ping(d.dealer("tcp"))


def test_config_file_and_flag_precedence(daemon_factory):
    probe = daemon_factory(start=False)
    path = os.path.join(probe.dir, "kvtier.json")
    with open(path, "w") as f:
        json.dump({"chunk_tokens": 128, "lease_ms": 4321}, f)
    d = daemon_factory("--config", path)
    body = d.hello(d.dealer(), "inst-file")
    assert (body["chunk_tokens"], body["lease_ms"]) == (128, 4321)
    d2 = daemon_factory("--config", path, "--chunk-tokens", "64")
    body = d2.hello(d2.dealer(), "inst-flag")
    assert (body["chunk_tokens"], body["lease_ms"]) == (64, 4321)


def test_config_unknown_key(kvt_daemon_bin, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"chunk_tokens": 128, "no_such_key_xyz": 1}))
    cp = run_kvtierd(scratch_args(tmp_path) + ["--config", str(path), "--check-config"])
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    assert "no_such_key_xyz" in one_line(cp.stderr)


@pytest.mark.parametrize("text", ['{"chunk_tokens": 128,', '[1, 2]',
                                  '{"chunk_tokens": 1, "chunk_tokens": 2}',
                                  '{"chunk_tokens": "lots"}'],
                         ids=["truncated", "not-object", "duplicate-key", "wrong-type"])
def test_config_file_invalid(kvt_daemon_bin, tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    cp = run_kvtierd(scratch_args(tmp_path) + ["--config", str(path), "--check-config"])
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    one_line(cp.stderr)


def test_config_file_missing(kvt_daemon_bin, tmp_path):
    cp = run_kvtierd(scratch_args(tmp_path) + ["--config", str(tmp_path / "absent.json")])
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    assert "absent.json" in cp.stderr


def test_env_overrides_flag(daemon_factory):
    d = daemon_factory("--chunk-tokens", "128", env={"KVTIER_CHUNK_TOKENS": "64"})
    assert d.hello(d.dealer(), "inst-env")["chunk_tokens"] == 64


def test_bad_env_value_exit_2(kvt_daemon_bin, tmp_path):
    cp = run_kvtierd(scratch_args(tmp_path) + ["--check-config"],
                     env={"KVTIER_CHUNK_TOKENS": "sixty"})
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    assert re.search(r"(?i)chunk[_-]tokens", one_line(cp.stderr))


def test_insecure_remote_refused(daemon_factory):
    d = daemon_factory(start=False)
    port = free_port()
    args = d.args + ["--listen", "tcp://0.0.0.0:%d" % port]
    cp = run_kvtierd(args + ["--check-config"], cwd=d.dir)
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    cp = run_kvtierd(args, cwd=d.dir, timeout=10)      # a real start is refused too
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    assert cp.stderr.strip()
    cp = run_kvtierd(args + ["--allow-insecure-remote", "--check-config"], cwd=d.dir)
    assert cp.returncode == 0, cp.stderr


def test_insecure_remote_allowed(daemon_factory):
    port = free_port()
    d = daemon_factory("--listen", "tcp://0.0.0.0:%d" % port, "--allow-insecure-remote")
    s = d.dealer("tcp://127.0.0.1:%d" % port)
    d.ping(s)


# ----------------------------------------------------------------------------------------
# Endpoint conflicts and restart


def test_tcp_port_in_use(daemon_factory):
    a = daemon_factory()
    b = daemon_factory(start=False)
    b.args = [a.tcp if x == b.tcp else x for x in b.args]   # the running daemon's endpoint
    b.start(wait=False)
    rc = b.wait(10)
    assert rc is not None, "second daemon on a busy tcp port did not exit"
    assert rc != 0
    assert b.stderr_text().strip()
    a.ping(a.dealer("tcp"))


def test_ipc_path_in_use(daemon_factory):
    a = daemon_factory()
    b = daemon_factory(start=False)
    b.args = [a.ipc if x == b.ipc else x for x in b.args]
    b.start(wait=False)
    rc = b.wait(10)
    assert rc is not None, "second daemon on a live ipc path did not exit"
    assert rc != 0
    assert os.path.exists(a.ipc_path), "the second daemon removed the first one's socket"
    a.ping(a.dealer())


def test_restart_after_sigkill(daemon_factory):
    a = daemon_factory()
    a.ping(a.dealer())
    assert a.stop(signal.SIGKILL) == -signal.SIGKILL
    assert os.path.exists(a.ipc_path)         # a killed daemon leaves its socket file
    b = daemon_factory(start=False)
    b.args = [a.run_dir if x == b.run_dir else a.data_dir if x == b.data_dir else
              a.ipc if x == b.ipc else x for x in b.args]
    b.ipc, b.ipc_path = a.ipc, a.ipc_path
    b.start()
    b.ping(b.dealer())


def test_restart_after_clean_stop(daemon_factory):
    a = daemon_factory()
    a.hello(a.dealer(), "inst-first")
    assert a.stop() == 0
    b = daemon_factory(start=False)
    b.args = [a.run_dir if x == b.run_dir else a.data_dir if x == b.data_dir else
              a.ipc if x == b.ipc else x for x in b.args]
    b.ipc, b.ipc_path = a.ipc, a.ipc_path
    b.start()
    assert b.stats()["clients_connected"] == 0
    b.ping(b.dealer())


# ----------------------------------------------------------------------------------------
# Signals


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_cleanly(daemon, sig):
    d = daemon
    s = d.dealer()
    d.hello(s, "inst-sig")
    d.ping(s)
    assert os.path.exists(d.ipc_path)
    t0 = time.monotonic()
    rc = d.stop(sig, timeout=5)
    assert not d.killed, "kvtierd did not exit within 5 s of %s" % sig.name
    assert rc == 0, "exit status %s after %s\n%s" % (rc, sig.name, d.stderr_tail())
    assert time.monotonic() - t0 < 5
    assert not os.path.exists(d.ipc_path), "ipc socket file left after a clean stop"


def test_sigterm_while_clients_ping(daemon):
    d = daemon
    stop = threading.Event()
    counts = [0] * 4
    errors = []

    def client(i):
        s = d.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 300)
        s.connect(d.ipc)
        try:
            uid = i << 32
            s.send_multipart([pack(uid), pack(HELLO),
                              pack({"version": 1, "client": "pytest", "instance": "load-%d" % i})])
            while not stop.is_set():
                try:
                    frames = s.recv_multipart()
                except zmq.Again:
                    if d.proc.poll() is not None:
                        break
                    continue
                body = unpack(frames[2])
                if not body.get("ok"):
                    errors.append((i, body))
                counts[i] += 1
                uid += 1
                s.send_multipart([pack(uid), pack(PING), pack({})])
        except Exception as e:  # noqa: BLE001 - surface any client failure in the test
            errors.append((i, repr(e)))
        finally:
            s.close(linger=0)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: min(counts) >= 20, timeout=10, what="4 clients to get 20 replies each")
        t0 = time.monotonic()
        rc = d.stop(signal.SIGTERM, timeout=5)
        assert not d.killed, "kvtierd did not exit within 5 s of SIGTERM under load"
        assert rc == 0, "exit status %s\n%s" % (rc, d.stderr_tail())
        assert time.monotonic() - t0 < 5
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
    assert not any(t.is_alive() for t in threads), "client threads hung"
    assert not errors, errors[:5]
    assert not os.path.exists(d.ipc_path)


def test_sigterm_with_pending_requests(daemon):
    """Stop while requests are queued and sessions are open: still a clean exit 0."""
    d = daemon
    socks = [d.dealer() for _ in range(4)]
    for i, s in enumerate(socks):
        d.hello(s, "pending-%d" % i)
    for s in socks:
        for u in range(200):
            d.send(s, u, PING, {})
        d.send(s, 999, BYE, {"instance": "x"})
    rc = d.stop(signal.SIGTERM, timeout=5)
    assert not d.killed and rc == 0, (rc, d.stderr_tail())


# ----------------------------------------------------------------------------------------
# Supervisor and /readyz


def test_supervisor_sees_stalled_server(daemon_factory):
    d = daemon_factory("--debug-fault-thread", "server", "--debug-fault-mode", "stall",
                       "--debug-fault-after-ms", "300", "--debug-fault-for-ms", "4000")
    seen = {}

    def not_ready():
        st, _, body = d.http("GET", "/readyz", timeout=2)
        seen["last"] = (st, body[:300])
        return st == 503 and b"server" in body
    # the stall lasts from ~0.3 s to ~4.3 s after start: it must be seen well inside it
    remaining = max(0.5, 3.5 - (time.monotonic() - d.started_at))
    wait_until(not_ready, timeout=remaining, interval=0.1,
               what="/readyz 503 naming the stalled server thread")
    st, _, _ = d.http("GET", "/healthz", timeout=2)
    assert st == 200, "/healthz must stay 200 while a thread is stuck"

    wait_until(lambda: d.http("GET", "/readyz", timeout=2)[0] == 200, timeout=10, interval=0.2,
               what="/readyz back to 200 after the stall")
    d.ping(d.dealer())


def test_supervisor_exit_is_noticed(daemon_factory):
    d = daemon_factory("--debug-fault-thread", "supervisor", "--debug-fault-mode", "exit",
                       "--debug-fault-after-ms", "300")

    def not_ready():
        st, _, body = d.http("GET", "/readyz", timeout=2)
        return st == 503 and b"supervisor" in body
    wait_until(not_ready, timeout=max(0.5, 3.5 - (time.monotonic() - d.started_at)),
               interval=0.1, what="/readyz 503 naming the supervisor thread")
    # and it stays so: a dead thread does not come back
    for _ in range(8):
        st, _, body = d.http("GET", "/readyz", timeout=2)
        assert st == 503 and b"supervisor" in body, (st, body)
        assert d.http("GET", "/healthz", timeout=2)[0] == 200
        time.sleep(0.2)
    # the death is logged at warning level or worse, naming the thread
    wait_until(lambda: [l for l in d.log_lines(max_level=4) if "supervisor" in l],
               timeout=3, what="a warn/error log line naming the supervisor thread")
    d.ping(d.dealer())


def test_missing_shm_group_is_a_config_error(kvt_daemon_bin, tmp_path):
    """A shm_group that does not exist is refused by --check-config (exit 2, one line naming the
    option) instead of failing later at start."""
    cp = run_kvtierd(scratch_args(tmp_path) + ["--shm-group", "kvt-no-such-group-42",
                                               "--check-config"])
    assert cp.returncode == 2, cp
    lines = [l for l in cp.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "shm_group" in lines[0], cp.stderr


def test_localhost_tcp_listen_is_refused_with_a_hint(kvt_daemon_bin, tmp_path):
    """libzmq cannot bind a host name: tcp://localhost is a config error that says what to use."""
    cp = run_kvtierd(scratch_args(tmp_path) + ["--listen", "tcp://localhost:5555",
                                               "--check-config"])
    assert cp.returncode == 2, cp
    assert "127.0.0.1" in cp.stderr and "listen" in cp.stderr, cp.stderr
