"""Start-up hardening (issue #13): shared-memory names another local user cannot squat, one
daemon per run_dir (a refused second daemon touches nothing of the first's, N concurrent starts
leave exactly one), SIGHUP re-reads the configuration instead of killing the daemon, prefetch
jobs are capped, and a loopback tcp endpoint without CURVE is called out (or refused with
curve.require)."""

import os
import signal
import subprocess
import time

import pytest
import xxhash
import zmq

from kvtest import (HELLO, LOOKUP, PREFETCH_STATUS, PUT, key, metric_value, run_kvtierd,
                    unpack, wait_until)

SHM = "/dev/shm"
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
LOCK_NAME = "kvtier.lock"


def one_line(text):
    lines = [l for l in text.splitlines() if l.strip()]
    assert len(lines) == 1, "expected exactly one line on stderr, got %d:\n%s" % (len(lines), text)
    return lines[0]


def shm_prefix(run_dir):
    """The arena name prefix of a run dir: kvtier-<XXH3-64 of its real path>- (kvt_arena.c)."""
    real = os.path.realpath(run_dir).encode()
    return "kvtier-%016x-" % xxhash.xxh3_64_intdigest(real)


def can_run_as_nobody():
    if os.geteuid() != 0:
        return False
    try:
        return subprocess.run(NOBODY + ["true"], timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def as_nobody(script):
    cp = subprocess.run(NOBODY + ["sh", "-c", script], capture_output=True, text=True,
                        timeout=30)
    assert cp.returncode == 0, cp.stderr


def dead_pid():
    """A pid that belonged to a process which has exited."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def on_run_dir_of(b, a, keep_tcp=False):
    """Points daemon b (not started) at a's run_dir, data_dir and ipc endpoint; b keeps its own
    HTTP port and, unless keep_tcp, listens on no tcp endpoint."""
    out, i = [], 0
    swap = {b.run_dir: a.run_dir, b.data_dir: a.data_dir, b.ipc: a.ipc}
    while i < len(b.args):
        x = b.args[i]
        if x == "--listen" and b.args[i + 1] == b.tcp and not keep_tcp:
            i += 2
            continue
        out.append(swap.get(x, x))
        i += 1
    b.args = out
    b.run_dir, b.data_dir, b.ipc, b.ipc_path = a.run_dir, a.data_dir, a.ipc, a.ipc_path
    return b


def without_tcp(d):
    i = d.args.index(d.tcp)
    del d.args[i - 1:i + 1]
    return d


def shm_path_of(d):
    s = d.dealer()
    return d.hello(s, "inst-%d" % d.proc.pid)["shm"]["path"]


def healthy(d):
    try:
        return d.http("GET", "/healthz", timeout=0.5)[0] == 200
    except OSError:
        return False


# ----------------------------------------------------------------------------------------
# Item 7: arena names


def test_arena_name_squatted_by_another_user_still_starts(daemon_factory):
    """Names the daemon would have picked, made beforehand (for its own pid by the same user,
    for the next few hundred pids by another user, one of them a symlink to a file of ours):
    the daemon still starts, on a name nobody made, and leaves every squatted file alone."""
    d = daemon_factory("--l2", "none", start=False)
    prefix = shm_prefix(d.run_dir)
    made = []
    # the daemon's own pid: sh makes the name with its $$, then execs the daemon (same pid)
    d.prefix = ["sh", "-c", ': > "%s/%s$$" && exec "$0" "$@"' % (SHM, prefix)]
    other_user = can_run_as_nobody()
    victim = os.path.join(d.dir, "victim")
    with open(victim, "w") as f:
        f.write("precious")
    try:
        if other_user:
            with open("/proc/sys/kernel/ns_last_pid") as f:
                last = int(f.read())
            names = ["%s/%s%d" % (SHM, prefix, p) for p in range(last + 1, last + 400)]
            made += names
            # the first of them a symlink to a file of ours, the rest empty files
            as_nobody('ln -s "%s" "%s" && for p in $(seq %d %d); do : > "%s/%s$p"; done'
                      % (victim, names[0], last + 2, last + 399, SHM, prefix))
        d.start()
        made.append("%s/%s%d" % (SHM, prefix, d.proc.pid))
        path = shm_path_of(d)
        assert os.path.basename(path).startswith(prefix), path
        assert path not in made, "the daemon uses a name made by someone else: %s" % path
        st = os.lstat(path)
        assert st.st_uid == os.geteuid() and (st.st_mode & 0o777) == 0o600, (st.st_uid,
                                                                             oct(st.st_mode))
        # the squatted files are all still there, untouched
        for f in made:
            assert os.path.lexists(f), "the daemon removed %s, which it did not make" % f
        with open(victim) as f:
            assert f.read() == "precious"
        assert d.stop() == 0
        assert not os.path.exists(path), "arena left after a clean stop"
        for f in made:
            assert os.path.lexists(f), "the daemon removed %s at stop" % f
    finally:
        for f in made:
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass


def test_stale_arena_cleanup_removes_only_its_own(daemon_factory):
    """At start the daemon removes arenas of its run dir left by daemons that died, but only
    files of its own user with its own naming: another user's file (even with a dead pid in
    its name), a symlink, and an arena whose process still runs all stay."""
    if not can_run_as_nobody():
        pytest.skip("needs root and setpriv to make files as another user")
    d = daemon_factory("--l2", "none", start=False)
    prefix = os.path.join(SHM, shm_prefix(d.run_dir))
    gone = dead_pid()
    foreign_old = "%s%d" % (prefix, gone)                     # the old naming, a dead pid
    foreign_new = "%s%s-%d" % (prefix, "a1" * 8, gone)          # today's naming, a dead pid
    foreign_link = "%s%s-%d" % (prefix, "b2" * 8, gone)
    own_stale = "%s%s-%d" % (prefix, "c3" * 8, gone)
    own_live = "%s%s-%d" % (prefix, "d4" * 8, os.getpid())
    victim = os.path.join(d.dir, "victim")
    with open(victim, "w") as f:
        f.write("precious")
    made = [foreign_old, foreign_new, foreign_link, own_stale, own_live]
    try:
        as_nobody(': > "%s" && : > "%s" && ln -s "%s" "%s"'
                  % (foreign_old, foreign_new, victim, foreign_link))
        for p in (own_stale, own_live):
            with open(p, "w") as f:
                f.write("x")
        d.start()
        for p in (foreign_old, foreign_new, foreign_link):
            assert os.path.lexists(p), "the daemon removed %s, a file of another user" % p
        assert os.path.exists(own_live), "the daemon removed an arena whose process runs"
        with open(victim) as f:
            assert f.read() == "precious"
        assert not os.path.exists(own_stale), "the stale arena of a dead daemon is still there"
        assert any("removed shared memory %s" % own_stale in l for l in d.log_lines(4)), \
            d.stderr_tail()
    finally:
        for p in made:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


# ----------------------------------------------------------------------------------------
# Item 8: one daemon per run_dir


def _sync_sub(d, sock, sub, ns, timeout=5.0):
    """PUTs fresh keys until `sub` receives an event for ns; returns it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d.ok(sock, PUT, {"ns": ns, "keys": [os.urandom(16)]}, b"probe")
        if sub.poll(100):
            while True:
                ev = unpack(sub.recv())
                if ev["ns"] == ns:
                    return ev
                if not sub.poll(100):
                    break
    raise AssertionError("no event for %s reached the subscriber within %.0f s" % (ns, timeout))


def _with_events(daemon_factory):
    """A started daemon publishing events on an ipc socket in its run_dir; (daemon, endpoint)."""
    a = daemon_factory("--l2", "none", start=False)
    ep = "ipc://" + os.path.join(a.run_dir, "events.sock")
    a.args += ["--events", ep]
    return a.start(), ep


def _subscriber(d, ep):
    sub = d.ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.subscribe(b"")
    sub.connect(ep)
    return sub


def test_refused_second_daemon_leaves_events_to_the_first(daemon_factory):
    a, ep = _with_events(daemon_factory)
    s = a.dealer()
    sub1 = _subscriber(a, ep)
    try:
        _sync_sub(a, s, sub1, "before")

        b = on_run_dir_of(daemon_factory("--l2", "none", "--events", ep, start=False), a)
        b.start(wait=False)
        rc = b.wait(15)
        assert rc is not None, "a second daemon on the same run_dir did not exit"

        # the first daemon's subscribers, old and new, still get its events
        _sync_sub(a, s, sub1, "after-old")
        assert os.path.exists(ep[len("ipc://"):]), "the events socket file is gone"
        sub2 = _subscriber(a, ep)
        try:
            _sync_sub(a, s, sub2, "after-new")
        finally:
            sub2.close()
        a.ping(a.dealer())

        assert rc == 2, "exit status %s\n%s" % (rc, b.stderr_text())
        line = one_line(b.stderr_text())
        assert LOCK_NAME in line and str(a.proc.pid) in line, line
    finally:
        sub1.close()


def test_concurrent_starts_exactly_one_serves(daemon_factory):
    """Ten daemons started at the same moment on one run_dir: one serves, nine exit 2 with one
    line naming the lock and the winner's pid, and the socket file is the winner's."""
    n = 10
    first = without_tcp(daemon_factory("--l2", "none", "--l1-size", "8M", start=False))
    ds = [first] + [on_run_dir_of(daemon_factory("--l2", "none", "--l1-size", "8M",
                                                 start=False), first) for _ in range(n - 1)]
    for d in ds:
        d.start(wait=False)

    def settled():
        return all(d.proc.poll() is not None or healthy(d) for d in ds)
    wait_until(settled, 60, interval=0.1, what="every daemon to exit or serve")
    alive = [d for d in ds if d.alive()]
    assert len(alive) == 1, "%d of %d daemons on one run_dir are running: %r" % (
        len(alive), n, [d.proc.pid for d in alive])
    winner = alive[0]
    for d in ds:
        if d is winner:
            continue
        assert d.wait(5) == 2, "exit status %s\n%s" % (d.returncode, d.stderr_text())
        line = one_line(d.stderr_text())
        assert LOCK_NAME in line and str(winner.proc.pid) in line, line
    winner.ping(winner.dealer())
    with open(os.path.join(first.run_dir, LOCK_NAME)) as f:
        assert f.read().strip() == str(winner.proc.pid)
    assert winner.stop() == 0


def test_ipc_endpoint_of_another_run_dir_refused_before_anything(daemon_factory):
    """A daemon on another run_dir whose events endpoint is the first one's is refused (exit 2,
    one line) before it creates its arena or binds anything."""
    a, ep = _with_events(daemon_factory)
    b = without_tcp(daemon_factory("--l2", "none", "--events", ep, start=False))
    b.start(wait=False)
    assert b.wait(15) == 2, b.stderr_text()
    line = one_line(b.stderr_text())
    assert "another process is already serving " + ep in line, line
    assert not os.path.exists(b.ipc_path)
    assert not [p for p in os.listdir(SHM) if p.startswith(shm_prefix(b.run_dir))]
    assert os.path.exists(ep[len("ipc://"):])


# ----------------------------------------------------------------------------------------
# Item 10a: SIGHUP


def _bad_hello(d, s):
    b = d.call(s, HELLO, {"version": 99, "client": "pytest", "instance": "hup"})
    assert b["ok"] is False


def test_sighup_reloads_the_log_level_and_keeps_serving(daemon_factory):
    d = daemon_factory("--l2", "none", start=False)
    i = d.args.index("--log-level")
    del d.args[i:i + 2]
    cfg = os.path.join(d.dir, "kvtier.json")
    with open(cfg, "w") as f:
        f.write('{"log_level": "info", "lease_ms": 30000}\n')
    d.args += ["--config", cfg]
    d.start()
    s = d.dealer()
    _bad_hello(d, s)
    time.sleep(0.2)
    assert not [l for l in d.stderr_text().splitlines() if l.startswith("<7>")], \
        "debug lines at log_level info"

    with open(cfg, "w") as f:
        f.write('{"log_level": "debug", "lease_ms": 20000}\n')
    d.send_signal(signal.SIGHUP)
    # the reload logs one line per change, the log_level one first: wait for the summary
    # line that ends the reload ("re-read ...: 2 changes"), then look at all of them
    wait_until(lambda: not d.alive() or [l for l in d.log_lines(6)
                                         if "SIGHUP" in l and "re-read" in l],
               5, what="the SIGHUP reload's summary line")
    assert d.alive(), "SIGHUP killed the daemon (exit %s)" % d.proc.poll()
    lines = d.log_lines(6)
    assert any("SIGHUP" in l and "log_level" in l for l in lines), "\n".join(lines[-10:])
    assert any("lease_ms" in l and "restart" in l for l in lines), "\n".join(lines[-10:])
    _bad_hello(d, s)
    wait_until(lambda: [l for l in d.stderr_text().splitlines()
                        if l.startswith("<7>") and "unsupported_version" in l],
               5, what="a debug line once log_level is debug")
    assert d.http_json("GET", "/status")["config"]["log_level"] == "debug"

    # a broken file is reported and changes nothing
    with open(cfg, "w") as f:
        f.write('{"log_level": "warn",')
    d.send_signal(signal.SIGHUP)
    wait_until(lambda: [l for l in d.log_lines(3) if "SIGHUP" in l and "kvtier.json" in l],
               5, what="an error line naming the broken file")
    assert d.alive()
    d.ping(s)
    assert d.http("GET", "/healthz")[0] == 200
    assert d.stop() == 0


def test_sighup_with_a_fifo_at_the_config_path_keeps_serving(daemon_factory):
    """Issue 28 item 11: a FIFO (no writer) put where the config file was used to block the
    server loop in open() at SIGHUP (no PING answered, /readyz "thread server stuck"). It is
    refused as not a regular file, off the server loop, and serving goes on; at start the same
    path is a configuration error (exit 2), not a hang."""
    d = daemon_factory("--l2", "none", start=False)
    cfg = os.path.join(d.dir, "kvtier.json")
    with open(cfg, "w") as f:
        f.write('{"lease_ms": 30000}\n')
    d.args += ["--config", cfg]
    d.start()
    s = d.dealer()
    os.remove(cfg)
    os.mkfifo(cfg)
    d.send_signal(signal.SIGHUP)
    t0 = time.monotonic()
    for _ in range(5):
        d.ping(s)
    assert time.monotonic() - t0 < 2.0
    wait_until(lambda: [l for l in d.log_lines(5) if "SIGHUP" in l and "not a regular file" in l],
               5, what="the reload to refuse the FIFO")
    assert d.http("GET", "/readyz")[0] == 200
    assert d.stop() == 0
    e = daemon_factory("--l2", "none", "--config", cfg, start=False)
    proc = subprocess.run(e.argv, capture_output=True, text=True, timeout=20, env=e.env)
    assert proc.returncode == 2 and "not a regular file" in proc.stderr, (proc.returncode,
                                                                         proc.stderr[-500:])


def test_sighup_without_a_config_file(daemon_factory):
    d = daemon_factory("--l2", "none")
    d.send_signal(signal.SIGHUP)
    wait_until(lambda: not d.alive() or [l for l in d.log_lines(6) if "SIGHUP" in l], 5,
               what="a log line about the SIGHUP")
    assert d.alive(), "SIGHUP killed the daemon (exit %s)" % d.proc.poll()
    d.ping(d.dealer())
    assert d.stop() == 0


# ----------------------------------------------------------------------------------------
# Item 10d: prefetch jobs are capped


def _l2_stored(d):
    _, samples = d.metrics()
    return sum(x.value for x in samples if x.name == "kvtier_l2_stored_total")


def test_prefetch_jobs_beyond_the_cap_answer_without_a_job(daemon_factory):
    """With max_prefetch_jobs 1 and a slow L2, two LOOKUPs with prefetch at once: one starts a
    job, the other answers its lookup result without `job` (counted as refused). Once the job
    is done, a new prefetch gets a job again."""
    d = daemon_factory("--l2", "mock:latency_ms=400", "--max-prefetch-jobs", "1")
    s = d.dealer()
    d.hello(s, "inst-prefetch")
    ns = "prefetch-cap"
    ks = [key(i, b"pf") for i in range(3)]
    for k in ks:
        d.ok(s, PUT, {"ns": ns, "keys": [k]}, b"v" * 4096)
    wait_until(lambda: _l2_stored(d) >= 3, 15, what="the write-behind of 3 objects")
    d.clear(s, ns)                                       # L1 only: L2 keeps them
    assert d.hits(s, ns, [ks[0]]) == 1

    uids = [d.send(s, d.next_uid(), LOOKUP, {"ns": ns, "keys": [k], "prefetch": True})
            for k in ks[:2]]
    replies = [d.recv(s) for _ in uids]
    bodies = [r.body for r in replies]
    assert all(b["ok"] and b["hits"] == 1 and b["l1"] == 0 for b in bodies), bodies
    with_job = [b for b in bodies if "job" in b]
    assert len(with_job) == 1, "expected exactly one job with max_prefetch_jobs 1: %r" % bodies
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_prefetch_refused_total") == 1
    job = with_job[0]["job"]

    def done():
        st = d.ok(s, PREFETCH_STATUS, {"job": job})
        return st if st["done"] else None
    st = wait_until(done, 10, what="the prefetch job to finish")
    assert st["loaded"] == 1
    lk = d.lookup(s, ns, [ks[2]], prefetch=True)
    assert lk.get("job"), "no job after the only one finished: %r" % lk


def test_finished_prefetch_jobs_swept_sooner_under_pressure(daemon_factory):
    """Finished jobs are kept 60 s, but only 1 s once more than half the cap is in use; a
    flood of finished jobs never goes past the cap."""
    cap = 16
    d = daemon_factory("--l2", "none", "--max-prefetch-jobs", str(cap))
    s = d.dealer()
    jobs = [d.lookup(s, "pf-sweep", [key(i)], prefetch=True)["job"] for i in range(100)]
    assert len(set(jobs)) == 100 and all(jobs), jobs[:5]
    assert d.http_json("GET", "/status")["prefetch_jobs"] <= cap
    assert d.ok(s, PREFETCH_STATUS, {"job": jobs[-1]})["done"] is True
    wait_until(lambda: d.http_json("GET", "/status")["prefetch_jobs"] <= cap // 2, 5,
               what="finished jobs swept down to half the cap")
    assert d.ok(s, PREFETCH_STATUS, {"job": jobs[-1]})["done"] is True
    time.sleep(1.5)         # at half the cap or below, finished jobs stay for 60 s
    assert d.http_json("GET", "/status")["prefetch_jobs"] == cap // 2
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_prefetch_refused_total") == 0


# ----------------------------------------------------------------------------------------
# Item 10e: plain tcp on loopback


def test_plain_loopback_tcp_is_warned_about(daemon_factory):
    d = daemon_factory("--l2", "none")
    warn = [l for l in d.log_lines(4) if d.tcp in l]
    assert len(warn) == 1, "no single warning naming %s:\n%s" % (d.tcp, d.stderr_tail())
    assert "CURVE" in warn[0] and "local user" in warn[0], warn[0]
    ipc_only = without_tcp(daemon_factory("--l2", "none", start=False)).start()
    assert not [l for l in ipc_only.log_lines(4) if "CURVE" in l], ipc_only.stderr_tail()


def test_curve_require_refuses_plain_tcp(daemon_factory, kvt_cli_bin, tmp_path):
    d = daemon_factory("--l2", "none", "--curve-require", start=False)
    for extra in (["--check-config"], []):
        cp = run_kvtierd(d.args + extra, cwd=d.dir)
        assert cp.returncode == 2, (cp.returncode, cp.stderr)
        line = one_line(cp.stderr)
        assert d.tcp in line and "curve.require" in line, line
    # the same in the config file
    cfg = tmp_path / "k.json"
    cfg.write_text('{"curve": {"require": true}}')
    cp = run_kvtierd([a for a in d.args if a != "--curve-require"] + ["--config", str(cfg),
                                                                       "--check-config"])
    assert cp.returncode == 2 and "curve.require" in one_line(cp.stderr), cp.stderr
    # ipc only is fine, and so is tcp with CURVE
    ok = without_tcp(daemon_factory("--l2", "none", "--curve-require", start=False)).start()
    ok.ping(ok.dealer())
    clients = tmp_path / "clients"
    clients.mkdir()
    server = str(tmp_path / "server")
    cp = subprocess.run([kvt_cli_bin, "keygen", server], capture_output=True, text=True,
                        timeout=10)
    assert cp.returncode == 0, cp.stderr
    c = daemon_factory("--l2", "none", "--curve-require", "--curve-server-cert", server,
                       "--curve-clients", str(clients))
    c.ping(c.dealer())
    assert not [l for l in c.log_lines(4) if "CURVE" in l and c.tcp in l], c.stderr_tail()


def test_a_short_dev_shm_says_no_space(daemon_factory):
    """Issue 28 item 12: an arena larger than /dev/shm fails at start with "No space left on
    device" and the sizes, not "Bad address" (what MADV_POPULATE_WRITE reports for it). The
    daemon runs in a mount namespace of its own with a 16 MiB /dev/shm."""
    import shutil
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             "mount -t tmpfs none /dev/shm"], capture_output=True, timeout=10).returncode != 0:
        pytest.skip("needs unshare -m and mount (root or CAP_SYS_ADMIN) for a private /dev/shm")
    d = daemon_factory("--l2", "none", start=False,
                       prefix=["unshare", "-m", "--propagation", "private", "sh", "-c",
                               'mount -t tmpfs -o size=16m none /dev/shm && exec "$0" "$@"'])
    proc = subprocess.run(d.argv, capture_output=True, text=True, timeout=60, env=d.env)
    assert proc.returncode != 0
    assert "No space left on device" in proc.stderr and "Bad address" not in proc.stderr, \
        proc.stderr[-800:]
    assert "16777216" in proc.stderr, proc.stderr[-800:]
