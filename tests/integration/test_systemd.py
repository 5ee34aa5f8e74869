"""kvtierd under systemd: the sd_notify protocol (READY=1, STATUS=, WATCHDOG=1, STOPPING=1) seen
on a test NOTIFY_SOCKET, and the shipped unit files checked by systemd's own tools.

The notify tests play the service manager: they bind a Unix datagram socket, start the daemon
with NOTIFY_SOCKET (and WATCHDOG_USEC) pointing at it, and read what it sends. The unit tests
run `systemd-analyze verify` and `systemd-analyze security --offline` on a copy of
systemd/kvtier.service whose ExecStart names the daemon under test (verify wants an existing
binary), with the man page on MANPATH (verify checks Documentation=man:...), and skip cleanly
when systemd's tools are missing.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest

from kvtest import wait_until

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
UNIT = os.path.join(REPO, "systemd", "kvtier.service")
GPU_DROPIN = os.path.join(REPO, "systemd", "kvtier-gpu.conf")
SYSUSERS = os.path.join(REPO, "systemd", "kvtier.sysusers")
MAN_PAGE = os.path.join(REPO, "docs", "kvtierd.8")

WATCHDOG_USEC = 500000


# ----------------------------------------------------------------------------------------
# A fake service manager: the notify socket


class NotifySocket:
    """A bound AF_UNIX datagram socket that records every notification with its arrival time
    (monotonic seconds). Datagrams are `KEY=VALUE` lines, as sd_notify(3) sends them. A reader
    thread takes them as they come: timestamps taken only when the test gets round to reading
    would turn a busy moment of the test (an HTTP probe of the daemon) into a false gap between
    keep-alives."""

    def __init__(self):
        # sun_path holds 107 bytes: keep the directory short whatever TMPDIR is
        self.dir = tempfile.mkdtemp(prefix="kvt-ntf-", dir="/tmp")
        self.path = os.path.join(self.dir, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.messages = []  # (time, {key: value}, raw text)
        self._lock = threading.Lock()
        self._stop = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            t = time.monotonic()
            text = data.decode("utf-8", "replace")
            fields = dict(line.split("=", 1) for line in text.split("\n") if "=" in line)
            with self._lock:
                self.messages.append((t, fields, text))

    def poll(self, timeout=0.05):
        """Waits `timeout` s; returns how many datagrams arrived meanwhile."""
        with self._lock:
            n0 = len(self.messages)
        time.sleep(timeout)
        with self._lock:
            return len(self.messages) - n0

    def wait_for(self, pred, timeout, what, after=0.0):
        """Polls until some message that arrived after `after` satisfies pred(fields); returns
        (time, fields)."""
        def find():
            self.poll(0.01)
            with self._lock:
                msgs = list(self.messages)
            for t, f, _ in msgs:
                if t > after and pred(f):
                    return t, f
            return None
        return wait_until(find, timeout, interval=0, what=what)

    def collect(self, seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.poll(min(0.05, max(0.0, end - time.monotonic())))

    def times(self, key, value="1"):
        return [t for t, f, _ in self.messages if f.get(key) == value]

    def statuses(self):
        return [(t, f["STATUS"]) for t, f, _ in self.messages if "STATUS" in f]

    def close(self):
        self._stop = True
        self._reader.join(timeout=2)
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def notify():
    n = NotifySocket()
    yield n
    n.close()


def notify_env(sock, watchdog_usec=WATCHDOG_USEC, watchdog_pid=None):
    env = {"NOTIFY_SOCKET": sock.path}
    if watchdog_usec is not None:
        env["WATCHDOG_USEC"] = str(watchdog_usec)
    if watchdog_pid is not None:
        env["WATCHDOG_PID"] = str(watchdog_pid)
    return env


def _gaps(times):
    return [b - a for a, b in zip(times, times[1:])]


# ----------------------------------------------------------------------------------------
# sd_notify


def test_ready_watchdog_stall_stopping(daemon_factory, notify):
    """READY=1 (with STATUS=) once the sockets are bound; WATCHDOG=1 at least every half
    WATCHDOG_USEC while healthy; no WATCHDOG=1 while the server thread is stuck (and a
    "not ready" STATUS=); keep-alives again after it recovers; STOPPING=1 on SIGTERM."""
    d = daemon_factory("--debug-fault-thread", "server", "--debug-fault-mode", "stall",
                       "--debug-fault-after-ms", "1500", "--debug-fault-for-ms", "3000",
                       env=notify_env(notify), wait=False)
    t_ready, ready = notify.wait_for(lambda f: f.get("READY") == "1", 10, "READY=1")
    # READY=1 means serving: every endpoint is bound by now
    assert os.path.exists(d.ipc_path), "READY=1 sent before the ipc socket was bound"
    status = ready.get("STATUS", "")
    assert "serving on" in status and d.ipc in status, "READY=1 without a serving STATUS=: %r" \
        % status
    assert re.search(r"L1 67108864 bytes pinned", status), status
    d.wait_healthy()
    d.ping(d.dealer())

    # the stall begins 1.5 s after start and the supervisor calls the server stuck 1 s later;
    # it lasts 3 s in all
    t_bad, _ = notify.wait_for(lambda f: f.get("STATUS", "").startswith("not ready: thread server"),
                               10, "STATUS=not ready: thread server stuck")
    t_good, _ = notify.wait_for(lambda f: f.get("STATUS") == status, 10, "STATUS back to serving",
                                after=t_bad)
    notify.collect(1.0)  # keep-alives after the recovery

    d.stop(signal.SIGTERM)
    assert d.returncode == 0, d.stderr_tail()
    notify.poll(0.5)
    stopping = notify.times("STOPPING")
    assert stopping, "no STOPPING=1 on SIGTERM; got %r" % [m[2] for m in notify.messages]

    pings = [t for t in notify.times("WATCHDOG") if t < stopping[0]]
    before = [t for t in pings if t < t_bad]
    after = [t for t in pings if t > t_good]
    during = [t for t in pings if t_bad <= t <= t_good]
    assert len(before) >= 3, "too few WATCHDOG=1 before the stall: %d" % len(before)
    assert len(after) >= 2, "WATCHDOG=1 did not resume after the recovery: %d" % len(after)
    assert not during, "WATCHDOG=1 sent while a thread was stuck (%d times)" % len(during)
    # while healthy, never a gap longer than the watchdog period itself
    limit = WATCHDOG_USEC / 1e6
    for seg in (before, after):
        worst = max(_gaps(seg), default=0)
        assert worst < limit, "WATCHDOG=1 gap of %.3f s while healthy (watchdog %.1f s)" \
            % (worst, limit)
    # the stall left a hole of about 2 s (stuck from 1 s into the 3 s stall)
    hole = max(_gaps(pings))
    assert hole >= 1.2, "largest WATCHDOG=1 gap only %.2f s during a 3 s stall" % hole
    assert before[0] - t_ready < limit, "first WATCHDOG=1 came %.2f s after READY=1" \
        % (before[0] - t_ready)


def test_watchdog_pid_of_another_process(daemon_factory, notify):
    """WATCHDOG_PID naming another process means the keep-alives are not ours to send
    (sd_watchdog_enabled); READY=1 still goes out."""
    d = daemon_factory(env=notify_env(notify, watchdog_pid=1), wait=False)
    notify.wait_for(lambda f: f.get("READY") == "1", 10, "READY=1")
    d.wait_healthy()
    notify.collect(1.0)
    assert not notify.times("WATCHDOG"), "WATCHDOG=1 sent although WATCHDOG_PID is not ours"


def test_no_watchdog_without_watchdog_usec(daemon_factory, notify):
    d = daemon_factory(env=notify_env(notify, watchdog_usec=None), wait=False)
    notify.wait_for(lambda f: f.get("READY") == "1", 10, "READY=1")
    d.wait_healthy()
    notify.collect(0.8)
    assert not notify.times("WATCHDOG")
    d.stop()
    assert d.returncode == 0
    notify.poll(0.5)
    assert notify.times("STOPPING")


def _unlockable_prefix():
    """A command prefix under which mlock of 64 MiB must fail: RLIMIT_MEMLOCK of 1 MiB and, as
    root, no CAP_IPC_LOCK (which would ignore the limit). As in test_l1.py."""
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("prlimit not installed")
    prefix = [prlimit, "--memlock=1048576"]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv not installed (needed to drop CAP_IPC_LOCK as root)")
        prefix = [setpriv, "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"] + prefix
    return prefix


def test_no_ready_when_the_arena_cannot_be_pinned(daemon_factory, notify):
    """A daemon that cannot pin its arena never says READY=1; its last STATUS= says why."""
    d = daemon_factory(env=notify_env(notify), prefix=_unlockable_prefix(), wait=False)
    assert d.wait(15) == 1, "expected exit status 1, got %s\n%s" % (d.returncode,
                                                                    d.stderr_tail())
    notify.poll(0.3)
    assert not notify.times("READY"), "READY=1 from a daemon that could not start"
    failed = [s for _, s in notify.statuses() if s.startswith("failed: ")]
    assert failed and "mlock" in failed[-1], notify.statuses()


# ----------------------------------------------------------------------------------------
# The unit files


def _need(tool):
    path = shutil.which(tool)
    if path is None:
        pytest.skip("%s not installed (Debian package systemd)" % tool)
    return path


@pytest.fixture
def unit_dir(tmp_path, kvt_daemon_bin):
    """tmp/units/kvtier.service (ExecStart -> the daemon under test) with the GPU drop-in in
    kvtier.service.d/, and tmp/man/man8/kvtierd.8. Returns (unit path, env for the tools)."""
    units = tmp_path / "units"
    (units / "kvtier.service.d").mkdir(parents=True)
    text = open(UNIT).read()
    assert "ExecStart=/usr/bin/kvtierd " in text
    (units / "kvtier.service").write_text(
        text.replace("ExecStart=/usr/bin/kvtierd ", "ExecStart=%s " % kvt_daemon_bin))
    man8 = tmp_path / "man" / "man8"
    man8.mkdir(parents=True)
    shutil.copy(MAN_PAGE, man8 / "kvtierd.8")
    env = dict(os.environ, MANPATH=str(tmp_path / "man"), SYSTEMD_LOG_COLOR="0",
               SYSTEMD_PAGER="cat")
    return units, env


def _verify(units, env):
    tool = _need("systemd-analyze")
    cp = subprocess.run([tool, "verify", str(units / "kvtier.service")], env=env,
                        capture_output=True, text=True, timeout=60)
    out = (cp.stdout + cp.stderr).strip()
    # an unknown key or a bad value is only a warning (status 0): any output is a failure
    assert cp.returncode == 0 and not out, "systemd-analyze verify (status %d):\n%s" \
        % (cp.returncode, out)


def test_unit_verifies(unit_dir):
    units, env = unit_dir
    _verify(units, env)


def test_unit_with_gpu_dropin_verifies(unit_dir):
    units, env = unit_dir
    shutil.copy(GPU_DROPIN, units / "kvtier.service.d" / "gpu.conf")
    _verify(units, env)


def _directives(path):
    """{key: [values]} of a unit file (comments and sections ignored)."""
    out = {}
    for line in open(path):
        line = line.strip()
        if not line or line[0] in "#;[" or "=" not in line:
            continue
        k, v = line.split("=", 1)
        out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_unit_contents():
    """What the operations issue asks of the unit, and what would break the arena."""
    u = _directives(UNIT)
    want = {
        "Type": "notify", "LimitMEMLOCK": "infinity", "RuntimeDirectory": "kvtier",
        "StateDirectory": "kvtier", "User": "kvtier", "NoNewPrivileges": "yes",
        "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "SystemCallFilter": "@system-service",
        "ExecStart": "/usr/bin/kvtierd --config /etc/kvtier/kvtier.json",
    }
    for k, v in want.items():
        assert v in u.get(k, []), "%s=%s missing from kvtier.service (has %r)" % (k, v,
                                                                                 u.get(k))
    assert u.get("WatchdogSec"), "no WatchdogSec="
    fams = " ".join(u.get("RestrictAddressFamilies", [])).split()
    # AF_NETLINK: libzmq aborts on any tcp:// bind without it (getifaddrs, ip_resolver.cpp)
    assert {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"} <= set(fams), fams
    # a private /dev would hide the arena from clients (and /dev/nvidia* from the drop-in);
    # PrivateIPC/ProtectSystem=full-style /dev/shm masking would do the same
    for bad in ("PrivateDevices", "PrivateIPC", "InaccessiblePaths", "TemporaryFileSystem"):
        assert u.get(bad, ["no"]) == ["no"], "%s=%r would break the shared arena" \
            % (bad, u.get(bad))
    # the daemon's own state must be reachable from the config it is given
    cfg = open(os.path.join(REPO, "config", "kvtier.json")).read()
    assert '"run_dir": "/run/kvtier"' in cfg and '"data_dir": "/var/lib/kvtier"' in cfg
    gpu = _directives(GPU_DROPIN)
    assert any(v.startswith("char-nvidia") for v in gpu.get("DeviceAllow", [])), gpu


def test_unit_security_exposure(unit_dir):
    """systemd's own hardening score for the base unit stays in its "OK" band (< 4.0)."""
    tool = _need("systemd-analyze")
    units, env = unit_dir
    cp = subprocess.run([tool, "security", "--offline=yes", "--no-pager",
                         str(units / "kvtier.service")], env=env, capture_output=True,
                        text=True, timeout=60)
    if "--offline" in cp.stderr and cp.returncode != 0:
        pytest.skip("systemd-analyze security --offline is not supported here")
    m = re.search(r"Overall exposure level for kvtier\.service: ([0-9.]+)", cp.stdout)
    assert m, "no exposure level in:\n%s\n%s" % (cp.stdout[-2000:], cp.stderr[-2000:])
    assert float(m.group(1)) < 4.0, cp.stdout[-4000:]


def test_sysusers_creates_the_service_user(tmp_path):
    tool = _need("systemd-sysusers")
    cp = subprocess.run([tool, "--dry-run", "--root=%s" % tmp_path, SYSUSERS],
                        capture_output=True, text=True, timeout=60)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, out
    assert re.search(r"Creating user '?kvtier'?", out), out
    assert re.search(r"Creating group '?kvtier'?", out), out
