"""kvtest: helpers for the kvtier integration tests (real daemon, real sockets).

Reusable by every suite under tests/integration (protocol, HTTP, lifecycle, and later L1,
clients, L2): the `Daemon` class spawns the real daemon on a fresh temp dir with its own
ports, speaks wire protocol v1 over a DEALER, probes HTTP, and scans the daemon's stderr for
sanitizer reports. The pytest fixtures that own daemons live in conftest.py.

Only the Python standard library, pyzmq and msgpack (Debian packages) are used. Every wait is
bounded: replies have a receive timeout, HTTP calls have a socket timeout, and state changes
are polled with `wait_until` rather than slept for.
"""

import collections
import http.client
import hashlib
import json
import mmap
import os
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import msgpack
import zmq

# ----------------------------------------------------------------------------------------
# Wire protocol v1 constants (DESIGN.md, binding)

PROTO_VERSION = 1
KEY_LEN = 16

HELLO = 1
BYE = 2
PING = 3
LOOKUP = 4
PREFETCH_STATUS = 5
RESERVE = 6
COMMIT = 7
ACQUIRE = 8
RELEASE = 9
PUT = 10
GET = 11
REMOVE = 12
CLEAR = 13
STATS = 14
HASH_TOKENS = 15
REGISTER_GPU = 16
UNREGISTER_GPU = 17
STORE_GPU = 18
RETRIEVE_GPU = 19

TYPE_NAMES = {
    HELLO: "hello",
    BYE: "bye",
    PING: "ping",
    LOOKUP: "lookup",
    PREFETCH_STATUS: "prefetch_status",
    RESERVE: "reserve",
    COMMIT: "commit",
    ACQUIRE: "acquire",
    RELEASE: "release",
    PUT: "put",
    GET: "get",
    REMOVE: "remove",
    CLEAR: "clear",
    STATS: "stats",
    HASH_TOKENS: "hash_tokens",
    REGISTER_GPU: "register_gpu",
    UNREGISTER_GPU: "unregister_gpu",
    STORE_GPU: "store_gpu",
    RETRIEVE_GPU: "retrieve_gpu",
}

ERROR_CODES = frozenset({
    "bad_request", "unknown_type", "unsupported_version", "too_large", "no_space",
    "not_found", "lease_expired", "unknown_lease", "busy", "internal", "unavailable",
    "instance_dropped",
})

DEFAULT_CHUNK_TOKENS = 256
DEFAULT_LEASE_MS = 30000
DEFAULT_MAX_MESSAGE = 268435456

# What in the daemon's stderr means a sanitizer found something. Any of these fails the test.
SANITIZER_PATTERNS = (
    "ERROR: AddressSanitizer",
    "ERROR: LeakSanitizer",
    "LeakSanitizer has encountered a fatal error",
    "SUMMARY: AddressSanitizer",
    "SUMMARY: UndefinedBehaviorSanitizer",
    "SUMMARY: LeakSanitizer",
    "runtime error:",
    "ERROR: ThreadSanitizer",
    "WARNING: ThreadSanitizer",
    "SUMMARY: ThreadSanitizer",
)

SANITIZER_ENV_DEFAULTS = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:halt_on_error=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
}

RCVTIMEO_MS = 5000
HEALTHY_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


def daemon_path():
    """Absolute path of the daemon under test (KVT_DAEMON), or None when unset/missing."""
    p = os.environ.get("KVT_DAEMON")
    if not p or not os.path.isfile(p) or not os.access(p, os.X_OK):
        return None
    return os.path.abspath(p)


def cli_path():
    """Absolute path of the kvtier CLI (KVT_CLI), or None when unset/missing."""
    p = os.environ.get("KVT_CLI")
    if not p or not os.path.isfile(p) or not os.access(p, os.X_OK):
        return None
    return os.path.abspath(p)


# ----------------------------------------------------------------------------------------
# Small utilities


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, then close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closing_factory(build, close):
    """The body of a fixture that makes objects on demand and closes them at teardown, last
    made first: `yield from closing_factory(build, close)` yields make(*a, **kw) -> build(...)."""
    made = []

    def make(*args, **kwargs):
        obj = build(*args, **kwargs)
        made.append(obj)
        return obj

    yield make
    for obj in reversed(made):
        close(obj)


def install_module(name, attrs):
    """Registers a module `name` (and the packages above it, empty) in sys.modules holding
    `attrs` (a dict): an engine's interface written in a test module (sglang_iface,
    vllm_ec_iface) under the engine's own module name, so that the code under test imports it
    as it would the engine's. Idempotent: an existing module is returned as it is."""
    import types
    if name in sys.modules:
        return sys.modules[name]
    parts = name.split(".")
    for i in range(1, len(parts)):
        pkg_name = ".".join(parts[:i])
        if pkg_name not in sys.modules:
            pkg = types.ModuleType(pkg_name)
            pkg.__path__ = []
            sys.modules[pkg_name] = pkg
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    return mod


def wait_until(pred, timeout, interval=0.05, what="condition"):
    """Polls pred() until it returns a truthy value, which is returned. Raises AssertionError
    naming `what` (and the last value seen) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = pred()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError("timed out after %.1f s waiting for %s (last: %r)"
                                 % (timeout, what, last))
        time.sleep(interval)


def pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


def unpack(buf):
    return msgpack.unpackb(buf, raw=False, strict_map_key=False)


def frame(value):
    """A uid/type frame: ints are msgpack-packed, bytes go on the wire as they are."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("uid/type must be int or bytes, not %r" % (value,))
    return pack(value)


def body_frame(body):
    """A body frame: None is an empty map, bytes go as they are, anything else is packed."""
    if body is None:
        return pack({})
    if isinstance(body, (bytes, bytearray, memoryview)):
        return bytes(body)
    return pack(body)


def is_msgpack_uint_frame(buf):
    """True when buf holds exactly one msgpack non-negative integer in an unsigned (or
    positive fixint) encoding — the daemon's notion of a uid/type frame."""
    if not buf or (buf[0] >= 0x80 and buf[0] not in (0xcc, 0xcd, 0xce, 0xcf)):
        return False
    try:
        v = unpack(buf)
    except Exception:
        return False
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def key(i, tag=b"k"):
    """A deterministic 16-byte key."""
    raw = tag + i.to_bytes(8, "big")
    return (raw + b"\0" * KEY_LEN)[:KEY_LEN]


def parse_size(v):
    """64M / 4G / 1024 / 64k -> bytes (binary multiples), ints pass through."""
    if isinstance(v, int):
        return v
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)[iI]?[bB]?\s*", str(v))
    if not m:
        raise ValueError("not a size: %r" % (v,))
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(m.group(1)) * mult


def sanitizer_report(text, max_lines=200):
    """The part of `text` from the first sanitizer pattern on (bounded), or None."""
    first = None
    for p in SANITIZER_PATTERNS:
        i = text.find(p)
        if i >= 0 and (first is None or i < first):
            first = i
    if first is None:
        return None
    start = text.rfind("\n", 0, max(0, first - 2000))  # a little context before the report
    start = 0 if start < 0 else start + 1
    lines = text[start:].splitlines()
    if len(lines) > max_lines:
        lines = lines[:max_lines] + ["... (%d more lines)" % (len(lines) - max_lines)]
    return "\n".join(lines)


def sanitizer_env(extra=None, base=None):
    """The environment for a daemon: `base` (default os.environ) without KVTIER_* variables
    (tests must be hermetic), sanitizer options defaulted, then `extra` on top."""
    env = dict(os.environ if base is None else base)
    for k in list(env):
        if k.startswith("KVTIER_") or k in ("JOURNAL_STREAM", "NOTIFY_SOCKET", "WATCHDOG_USEC",
                                             "WATCHDOG_PID"):
            del env[k]
    for k, v in SANITIZER_ENV_DEFAULTS.items():
        env.setdefault(k, v)
    if extra:
        env.update(extra)
    return env


Reply = collections.namedtuple("Reply", "uid type body data")


def check_reply_shape(body):
    """Asserts the invariant every reply body satisfies: `ok` (bool); when false, `error`
    {code: known str, message: non-empty str}."""
    assert isinstance(body, dict), "reply body is not a map: %r" % (body,)
    assert "ok" in body, "reply body has no 'ok': %r" % (body,)
    assert isinstance(body["ok"], bool), "'ok' is not a bool: %r" % (body,)
    if not body["ok"]:
        err = body.get("error")
        assert isinstance(err, dict), "failed reply without an error map: %r" % (body,)
        assert isinstance(err.get("code"), str), "error code is not a str: %r" % (body,)
        assert err["code"] in ERROR_CODES, "unknown error code %r" % (err["code"],)
        assert isinstance(err.get("message"), str) and err["message"], \
            "error message missing or empty: %r" % (body,)


def assert_error(body, code, *mentions):
    """Asserts a failed reply with wire error `code` whose message mentions each of `mentions`
    (case-insensitive)."""
    assert body["ok"] is False, "expected error %s, got %r" % (code, body)
    assert body["error"]["code"] == code, "expected error %s, got %r" % (code, body["error"])
    for m in mentions:
        assert m.lower() in body["error"]["message"].lower(), \
            "error message %r does not mention %r" % (body["error"]["message"], m)


def error_code(body):
    """The error code of a failed reply body, or None when ok."""
    if body.get("ok"):
        return None
    return body["error"]["code"]


def decode_reply(frames):
    """[uid, type, body, data...] -> Reply with uid/type decoded as ints and body as a dict;
    asserts the envelope and the body shape."""
    assert len(frames) >= 3, "reply has %d frames, need >= 3: %r" % (len(frames), frames[:4])
    assert is_msgpack_uint_frame(frames[1]), "reply type frame is not a uint: %r" % frames[1]
    try:
        body = unpack(frames[2])
    except Exception as e:  # noqa: BLE001 - report any decode failure as a test failure
        raise AssertionError("reply body does not decode (%s): %r" % (e, frames[2][:200]))
    check_reply_shape(body)
    uid = unpack(frames[0]) if is_msgpack_uint_frame(frames[0]) else frames[0]
    return Reply(uid, unpack(frames[1]), body, list(frames[3:]))


# ----------------------------------------------------------------------------------------
# Prometheus text format 0.0.4


Sample = collections.namedtuple("Sample", "name labels value")

_SAMPLE_RE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)'
    r'(?:\{(?P<labels>[^}]*)\})?'
    r'\s+(?P<value>\S+)(?:\s+(?P<ts>-?\d+))?\s*$')
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')


def _parse_labels(text, line):
    labels = {}
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _LABEL_RE.match(text, pos)
        assert m, "bad label set in metrics line: %r" % line
        name, value = m.group(1), m.group(2)
        assert name not in labels, "duplicate label %r in %r" % (name, line)
        labels[name] = value.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        pos = m.end()
    return labels


def parse_metrics(text):
    """Parses Prometheus text exposition (0.0.4) strictly. Returns (families, samples):
    families maps name -> {"help": str, "type": str}; samples is a list of Sample. Asserts
    that every sample line parses with a float value and that its family has HELP and TYPE
    lines before it."""
    families = {}
    samples = []
    for line in text.split("\n"):
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                fam = families.setdefault(parts[2], {})
                kind = parts[1].lower()
                assert kind not in fam, "second %s line for %s" % (parts[1], parts[2])
                fam[kind] = parts[3] if len(parts) > 3 else ""
                if kind == "type":
                    assert fam[kind] in ("counter", "gauge", "histogram", "summary",
                                         "untyped"), "bad TYPE line: %r" % line
            continue
        m = _SAMPLE_RE.match(line)
        assert m, "metrics line is not `name{labels} value`: %r" % line
        try:
            value = float(m.group("value"))
        except ValueError:
            raise AssertionError("metrics value is not a float: %r" % line)
        name = m.group("name")
        labels = _parse_labels(m.group("labels") or "", line)
        fam = family_of(name, families)
        assert fam is not None, "sample %r has no HELP/TYPE lines before it" % line
        assert "help" in families[fam] and "type" in families[fam], \
            "family %s lacks HELP or TYPE before its first sample" % fam
        samples.append(Sample(name, labels, value))
    return families, samples


def family_of(name, families):
    if name in families:
        return name
    for suffix in ("_bucket", "_count", "_sum"):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            if families.get(base, {}).get("type") in ("histogram", "summary"):
                return base
    return None


def metric_value(samples, name, **labels):
    """The value of the one sample named `name` whose labels include `labels`, or None."""
    found = [s.value for s in samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, "%d samples match %s%r" % (len(found), name, labels)
    return found[0] if found else None


# ----------------------------------------------------------------------------------------
# The daemon


class Daemon:
    """One kvtierd process on its own temp dir, ports and zmq context.

    Default command line: --run-dir TMP/run --data-dir TMP/data --listen ipc://TMP/run/kvtier.sock
    --listen tcp://127.0.0.1:PORT --http 127.0.0.1:PORT2 --l1-size 64M --log-level debug
    --l1-hugepages off (the arena in /dev/shm whatever hugetlbfs the machine has mounted;
    test_hugepages.py asks for huge pages), then `extra_args`. Pass `args` to replace the whole command line (argv[1:]) instead. Unless
    the command line names --l1-adopt, --l1-adopt=false is added: the daemon's default keeps its
    arena in /dev/shm after it stops (for the next daemon of the run dir), which hundreds of
    test daemons would fill; test_adopt.py asks for it, and cleanup() removes a kept arena. `prefix`
    is a command the daemon runs under (e.g. ["prlimit", "--memlock=1048576"]); it must exec the
    daemon in the same process. stdout and stderr go to TMP/stdout.log and TMP/stderr.log.
    """

    def __init__(self, binary=None, extra_args=(), env=None, args=None, workdir=None,
                 prefix=()):
        self.prefix = list(prefix)
        self.binary = binary or daemon_path()
        if self.binary is None:
            raise RuntimeError("KVT_DAEMON is unset or not an executable file")
        self.own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="kvt-", dir=os.environ.get("KVT_TMPDIR",
                                                                                "/tmp"))
        self.run_dir = os.path.join(self.dir, "run")
        self.data_dir = os.path.join(self.dir, "data")
        os.makedirs(self.run_dir, exist_ok=True)
        os.makedirs(self.data_dir, exist_ok=True)
        self.ipc_path = os.path.join(self.run_dir, "kvtier.sock")
        self.ipc = "ipc://" + self.ipc_path
        self.tcp_port = free_port()
        self.tcp = "tcp://127.0.0.1:%d" % self.tcp_port
        self.http_port = free_port()
        while self.http_port == self.tcp_port:  # the kernel may hand out a closed port again
            self.http_port = free_port()
        self.http_addr = "127.0.0.1:%d" % self.http_port
        self.stdout_path = os.path.join(self.dir, "stdout.log")
        self.stderr_path = os.path.join(self.dir, "stderr.log")
        self.args = list(args) if args is not None else self.default_args() + list(extra_args)
        if not any(str(a).startswith("--l1-adopt") for a in self.args):
            self.args.append("--l1-adopt=false")
        self.env = sanitizer_env(env)
        self.proc = None
        self.started_at = None
        self.returncode = None
        self.tokens = {}  # instance -> token from its HELLO (see hello())
        self._arenas = set()  # private arena files its processes mapped (see _note_arena)
        self.killed = False
        self._ctx = None
        self._sockets = []
        self._uid = 1000

    # -- process ------------------------------------------------------------------------

    def default_args(self):
        return ["--run-dir", self.run_dir, "--data-dir", self.data_dir,
                "--listen", self.ipc, "--listen", self.tcp,
                "--http", self.http_addr, "--l1-size", "64M", "--log-level", "debug",
                "--l1-hugepages", "off"]

    @property
    def argv(self):
        return self.prefix + [self.binary] + self.args

    def start(self, wait=True, timeout=HEALTHY_TIMEOUT_S):
        """Spawns the daemon; with `wait`, blocks until GET /healthz answers 200 (and the ipc
        socket exists when ipc is among the endpoints), failing with the stderr tail."""
        assert self.proc is None, "daemon already started"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=err, env=self.env, cwd=self.dir,
                                         start_new_session=True)
        self.started_at = time.monotonic()
        if wait:
            self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout=HEALTHY_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.returncode = rc
                raise AssertionError("kvtierd exited with status %s before it was healthy\n"
                                     "argv: %s\n--- stderr tail ---\n%s"
                                     % (rc, " ".join(self.argv), self.stderr_tail()))
            try:
                status, _, body = self.http("GET", "/healthz", timeout=1.0)
                ipc_ok = self.ipc not in self.args or os.path.exists(self.ipc_path)
                if status == 200 and ipc_ok:
                    self._note_arena()
                    return
                last = "status %s, ipc socket %s" % (status, "present" if ipc_ok else "absent")
            except (OSError, http.client.HTTPException) as e:
                last = repr(e)
            if time.monotonic() >= deadline:
                raise AssertionError("kvtierd not healthy within %.0f s (%s)\nargv: %s\n"
                                     "--- stderr tail ---\n%s"
                                     % (timeout, last, " ".join(self.argv), self.stderr_tail()))
            time.sleep(0.05)

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def _note_arena(self):
        """Records the arena this process mapped (/proc/PID/maps): a private one (not l1.adopt's
        kept name) that a SIGKILL leaves behind is removed at cleanup, when no daemon of this
        run dir comes after it to do so."""
        try:
            with open("/proc/%d/maps" % self.proc.pid) as f:
                for line in f:
                    path = line.rstrip("\n").split(None, 5)[-1].replace(" (deleted)", "")
                    if path.startswith("/dev/shm/kvtier-") and not path.endswith("-l1"):
                        self._arenas.add(path)
        except (OSError, IndexError):
            pass

    def send_signal(self, sig):
        assert self.alive(), "daemon is not running"
        self.proc.send_signal(sig)

    def wait(self, timeout):
        """Waits for the process to exit; returns its status or None on timeout."""
        try:
            self.returncode = self.proc.wait(timeout=timeout)
            return self.returncode
        except subprocess.TimeoutExpired:
            return None

    def stop(self, sig=signal.SIGTERM, timeout=STOP_TIMEOUT_S):
        """Sends `sig` and waits up to `timeout` s; then SIGKILL. Returns the exit status
        (negative for a signal, as subprocess reports it). Closes this helper's sockets."""
        self.close_sockets()
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass
            rc = self.wait(timeout)
            if rc is None:
                self.killed = True
                self.proc.kill()
                rc = self.wait(10)
        self.returncode = self.proc.returncode
        return self.returncode

    def restart(self, sig=signal.SIGTERM, *extra):
        """Stops the daemon with `sig` and starts it again: the same run dir, endpoints and
        arguments, plus `extra`. The first run's stderr must hold no sanitizer report; it is
        kept beside the new one."""
        self.stop(sig)
        text = self.stderr_text()
        assert "Sanitizer" not in text and "runtime error" not in text, text[-3000:]
        os.replace(self.stderr_path, self.stderr_path + ".%d" % time.monotonic_ns())
        self.proc, self.returncode, self.killed = None, None, False
        self.args = list(self.args) + list(extra)
        self.start()
        return self

    # -- logs ---------------------------------------------------------------------------

    def _read(self, path):
        try:
            with open(path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def stderr_text(self):
        return self._read(self.stderr_path)

    def stdout_text(self):
        return self._read(self.stdout_path)

    def stderr_tail(self, lines=60):
        return "\n".join(self.stderr_text().splitlines()[-lines:])

    def sanitizer_report(self):
        return sanitizer_report(self.stderr_text())

    def log_lines(self, max_level=7):
        """stderr lines whose syslog prefix <N> is at most max_level (3 error, 4 warn, ...)."""
        out = []
        for line in self.stderr_text().splitlines():
            m = re.match(r"<(\d)>", line)
            if m and int(m.group(1)) <= max_level:
                out.append(line)
        return out

    # -- zmq ----------------------------------------------------------------------------

    @property
    def ctx(self):
        if self._ctx is None:
            self._ctx = zmq.Context()
        return self._ctx

    def endpoint(self, which="ipc"):
        return {"ipc": self.ipc, "tcp": self.tcp}.get(which, which)

    def dealer(self, endpoint="ipc", rcvtimeo=RCVTIMEO_MS, identity=None, track=True):
        """A DEALER connected to the daemon (endpoint "ipc", "tcp" or a full endpoint string),
        RCVTIMEO 5000 and LINGER 0. Closed by stop()/close_sockets() unless track=False."""
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, rcvtimeo)
        s.setsockopt(zmq.SNDTIMEO, rcvtimeo)
        if identity is not None:
            s.setsockopt(zmq.IDENTITY, identity)
        s.connect(self.endpoint(endpoint))
        if track:
            self._sockets.append(s)
        return s

    def close_sockets(self):
        for s in self._sockets:
            try:
                s.close(linger=0)
            except zmq.ZMQError:
                pass
        self._sockets = []

    def next_uid(self):
        self._uid += 1
        return self._uid

    def send(self, sock, uid, type_, body=None, *data):
        """Sends [uid, type, body, data...]; returns the uid frame bytes."""
        frames = [frame(uid), frame(type_), body_frame(body)] + [bytes(d) for d in data]
        sock.send_multipart(frames)
        return frames[0]

    def send_frames(self, sock, frames):
        sock.send_multipart([bytes(f) for f in frames])

    def recv_frames(self, sock, what="a reply"):
        try:
            return sock.recv_multipart()
        except zmq.Again:
            raise AssertionError("no reply from kvtierd within the receive timeout (%s); "
                                 "daemon %s\n--- stderr tail ---\n%s"
                                 % (what, "alive" if self.alive() else
                                    "EXITED with %s" % self.proc.poll(), self.stderr_tail()))

    def recv(self, sock, expect_uid=None, what="a reply"):
        """Receives and decodes one reply; with expect_uid (bytes frame or int), asserts the
        uid frame echoes it byte for byte."""
        frames = self.recv_frames(sock, what)
        if expect_uid is not None:
            want = frame(expect_uid)
            assert frames[0] == want, ("reply uid frame %r does not echo the request's %r "
                                       "(a stray or reordered reply?) body=%r"
                                       % (frames[0], want, frames[2:3]))
        return decode_reply(frames)

    def request(self, sock, uid, type_, body=None, *data):
        """Sends [msgpack(uid), msgpack(type), body, data...] and returns the decoded reply
        (uid, type, body_dict, data_frames). uid/type may be raw bytes frames; body may be a
        dict (packed with use_bin_type=True) or raw bytes. Asserts the uid is echoed."""
        uid_frame = self.send(sock, uid, type_, body, *data)
        return self.recv(sock, expect_uid=uid_frame, what="type %r" % (type_,))

    def call(self, sock, type_, body=None, *data):
        """request() with a fresh uid; returns the reply body (dict)."""
        return self.request(sock, self.next_uid(), type_, body, *data).body

    def ok(self, sock, type_, body=None, *data):
        """call() that asserts ok true; returns the body."""
        b = self.call(sock, type_, body, *data)
        assert b["ok"] is True, "type %s failed: %r" % (type_, b)
        return b

    def hello(self, sock, instance, client="pytest", version=PROTO_VERSION, token=None):
        """HELLO as `instance`. A second connection joins an instance only with its token:
        like a client process, the Daemon remembers the token of every instance it created
        and presents it (token=False: present none)."""
        body = {"version": version, "client": client, "instance": instance}
        if token is None:
            token = self.tokens.get(instance)
        if token:
            body["token"] = token
        reply = self.ok(sock, HELLO, body)
        if "token" in reply:
            self.tokens[instance] = reply["token"]
        return reply

    def heartbeat(self, instance, interval=0.1):
        """A background heartbeat for `instance` (which this Daemon said HELLO as), as the
        clients keep one: a thread with its own DEALER joins the instance with its token and
        sends PING {instance} every `interval` s. Use as a context manager."""
        return _Heartbeat(self, instance, self.tokens[instance], interval)

    def ping(self, sock):
        return self.ok(sock, PING, {})

    def stats(self, sock=None):
        own = sock is None
        if own:
            sock = self.dealer(track=False)
        try:
            return self.ok(sock, STATS, {})
        finally:
            if own:
                sock.close(linger=0)

    # -- L1 requests ----------------------------------------------------------------------
    # Each sends one request on `sock` and returns the reply body. With check=True (the
    # default) the reply must be ok; pass check=False to look at a refusal.

    def _l1(self, sock, type_, body, check):
        b = self.call(sock, type_, body)
        if check:
            assert b["ok"] is True, "%s %r failed: %r" % (TYPE_NAMES[type_], _brief(body), b)
        return b

    def reserve(self, sock, ns, keys, sizes=None, size=None, salt=None, check=True):
        body = {"ns": ns, "keys": list(keys)}
        if sizes is not None:
            body["sizes"] = list(sizes)
        if size is not None:
            body["size"] = size
        if salt is not None:
            body["salt"] = salt
        return self._l1(sock, RESERVE, body, check)

    def commit(self, sock, lease, failed=None, check=True):
        body = {"lease": lease}
        if failed is not None:
            body["failed"] = list(failed)
        return self._l1(sock, COMMIT, body, check)

    def acquire(self, sock, ns, keys, salt=None, check=True):
        body = {"ns": ns, "keys": list(keys)}
        if salt is not None:
            body["salt"] = salt
        return self._l1(sock, ACQUIRE, body, check)

    def release(self, sock, lease, check=True):
        return self._l1(sock, RELEASE, {"lease": lease}, check)

    def lookup(self, sock, ns, keys, salt=None, lock=None, prefetch=None, check=True):
        body = {"ns": ns, "keys": list(keys)}
        if salt is not None:
            body["salt"] = salt
        if lock is not None:
            body["lock"] = lock
        if prefetch is not None:
            body["prefetch"] = prefetch
        return self._l1(sock, LOOKUP, body, check)

    def remove(self, sock, ns, keys, salt=None, check=True):
        body = {"ns": ns, "keys": list(keys)}
        if salt is not None:
            body["salt"] = salt
        return self._l1(sock, REMOVE, body, check)

    def clear(self, sock, ns=None, check=True):
        return self._l1(sock, CLEAR, {} if ns is None else {"ns": ns}, check)

    def hits(self, sock, ns, keys, salt=None):
        """LOOKUP (no lock) -> the number of leading READY keys."""
        return self.lookup(sock, ns, keys, salt=salt)["hits"]

    def present(self, sock, ns, keys, salt=None):
        """One LOOKUP per key -> [bool]: which keys are READY, each on its own."""
        return [self.hits(sock, ns, [k], salt=salt) == 1 for k in keys]

    def store(self, sock, arena, ns, keys, payloads, salt=None):
        """RESERVE len(payload) bytes per key, write each payload at its slot, COMMIT. Every
        key must get a slot (none may be stored already). Returns the slots."""
        r = self.reserve(sock, ns, keys, sizes=[len(p) for p in payloads], salt=salt)
        slots = r["slots"]
        assert len(slots) == len(keys) and None not in slots, \
            "RESERVE of %d new keys gave %r" % (len(keys), slots)
        check_slots(slots, [len(p) for p in payloads], arena.size)
        for sl, p in zip(slots, payloads):
            arena.write(sl["offset"], p)
        c = self.commit(sock, r["lease"])
        assert c["stored"] == len(keys), "COMMIT stored %r of %d" % (c, len(keys))
        return slots

    def fetch(self, sock, arena, ns, keys, salt=None):
        """ACQUIRE, copy the bytes of every slot out of the arena, RELEASE. Returns the list of
        byte strings of the leading keys found."""
        r = self.acquire(sock, ns, keys, salt=salt)
        out = [arena.read(sl["offset"], sl["length"]) for sl in r["slots"]]
        if r["lease"]:
            self.release(sock, r["lease"])
        else:
            assert not r["slots"], "ACQUIRE found %d keys but gave lease 0" % len(r["slots"])
        return out

    def l1_metrics(self):
        """GET /metrics -> {name: value} for the L1 and lease gauges/counters (None when
        missing)."""
        _, samples = self.metrics()
        return {n: metric_value(samples, n) for n in L1_METRIC_NAMES}

    # -- http ---------------------------------------------------------------------------

    def http(self, method, path, body=None, headers=None, timeout=5.0):
        """One HTTP request to the daemon; returns (status, headers with lower-case names,
        body bytes)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
        finally:
            conn.close()

    def http_json(self, method, path, expect=200):
        status, headers, body = self.http(method, path)
        assert status == expect, "%s %s -> %s %r" % (method, path, status, body[:500])
        try:
            return json.loads(body)
        except ValueError:
            raise AssertionError("%s %s did not return JSON: %r" % (method, path, body[:500]))

    def metrics(self):
        """GET /metrics parsed strictly: (families, samples)."""
        status, headers, body = self.http("GET", "/metrics")
        assert status == 200, "GET /metrics -> %s %r" % (status, body[:300])
        return parse_metrics(body.decode("utf-8"))

    # -- cleanup ------------------------------------------------------------------------

    def cleanup(self, keep_dir=False):
        """Stops the process if needed, destroys the zmq context, and removes the temp dir
        unless keep_dir (or KVT_KEEP_TMP is set)."""
        if self.alive():
            self.stop()
        self.remove_kept_arena()
        for path in self._arenas:   # a private name is unique to its (now stopped) process
            try:
                os.unlink(path)
            except OSError:
                pass
        self.close_sockets()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        if self.own_dir and not keep_dir and not os.environ.get("KVT_KEEP_TMP"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def kept_arena(self):
        """The arena path the L1 journal of this run dir names (storage/kvt_journal.h: the
        header record's payload, after 56 bytes of numbers), or None."""
        try:
            with open(os.path.join(self.run_dir, "kvtier-l1.journal"), "rb") as f:
                head = f.read(8 + 56 + 1024)
        except OSError:
            return None
        if len(head) < 8 + 56:
            return None
        n = struct.unpack_from("<I", head, 0)[0]
        path = head[8 + 56:8 + n].decode("utf-8", "replace")
        return path if os.path.basename(path).startswith("kvtier-") else None

    def remove_kept_arena(self):
        """Unlinks the arena an l1.adopt daemon left for its successor (not a test's to keep)."""
        path = self.kept_arena()
        if path and path.endswith("-l1") and not self.alive():
            try:
                os.unlink(path)
            except OSError:
                pass

    def __repr__(self):
        return "<Daemon pid=%s dir=%s>" % (self.proc.pid if self.proc else None, self.dir)


class _Heartbeat:
    """See Daemon.heartbeat. Any failed beat is kept in .error and re-raised on exit."""

    def __init__(self, daemon, instance, token, interval):
        self._d, self._instance, self._token, self._interval = daemon, instance, token, interval
        self._stop = threading.Event()
        self.error = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _call(self, sock, uid, type_, body):
        sock.send_multipart([pack(uid), pack(type_), pack(body)])
        frames = sock.recv_multipart()
        reply = unpack(frames[2])
        if not reply.get("ok"):
            raise AssertionError("heartbeat of %s: %r" % (self._instance, reply))

    def _run(self):
        sock = self._d.ctx.socket(zmq.DEALER)   # created and used by this thread only
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, RCVTIMEO_MS)
        try:
            sock.connect(self._d.ipc)
            self._call(sock, 1, HELLO, {"version": PROTO_VERSION, "client": "heartbeat",
                                        "instance": self._instance, "token": self._token})
            uid = 1
            while not self._stop.wait(self._interval):
                uid += 1
                self._call(sock, uid, PING, {"instance": self._instance})
        except Exception as e:   # noqa: BLE001 - reported by __exit__
            self.error = e
        finally:
            sock.close(linger=0)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)
        if self.error is not None and exc[0] is None:
            raise self.error


def run_kvtierd(args, env=None, timeout=10.0, cwd=None, binary=None):
    """Runs the daemon binary to completion (for --version, --check-config, bad flags ...).
    Returns the CompletedProcess (text stdout/stderr); fails if it does not exit in time or
    its stderr holds a sanitizer report."""
    binary = binary or daemon_path()
    args = list(args)
    if not any(str(a).startswith("--l1-adopt") for a in args) and args[:1] not in (
            ["--version"], ["--help"], ["-h"]):
        args.append("--l1-adopt=false")  # as Daemon: nothing kept in /dev/shm after a test
    own = cwd is None
    if own:
        cwd = tempfile.mkdtemp(prefix="kvt-run-", dir=os.environ.get("KVT_TMPDIR", "/tmp"))
    try:
        try:
            cp = subprocess.run([binary] + list(args), stdin=subprocess.DEVNULL,
                                capture_output=True, env=sanitizer_env(env), cwd=cwd,
                                timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError("kvtierd %s did not exit within %.0f s; stderr:\n%s"
                                 % (" ".join(args), timeout,
                                    (e.stderr or b"").decode("utf-8", "replace")[-3000:]))
        cp = subprocess.CompletedProcess(cp.args, cp.returncode,
                                         cp.stdout.decode("utf-8", "replace"),
                                         cp.stderr.decode("utf-8", "replace"))
        rep = sanitizer_report(cp.stderr)
        assert rep is None, "sanitizer report from kvtierd %s:\n%s" % (" ".join(args), rep)
        return cp
    finally:
        if own and not os.environ.get("KVT_KEEP_TMP"):
            shutil.rmtree(cwd, ignore_errors=True)


# ----------------------------------------------------------------------------------------
# L1: the shared-memory arena, payloads, slots, and client processes

PAGE = 4096
MiB = 1 << 20

L1_METRIC_NAMES = (
    "kvtier_l1_capacity_bytes", "kvtier_l1_used_bytes", "kvtier_l1_free_bytes",
    "kvtier_l1_largest_free_bytes", "kvtier_l1_fragmentation_ratio", "kvtier_l1_objects",
    "kvtier_l1_reserved_objects", "kvtier_l1_evictions_total", "kvtier_leases_active",
    "kvtier_leases_expired_total", "kvtier_l1_pinned",
)


def _brief(body):
    """A request body for an assertion message, without pages of keys."""
    if isinstance(body, dict) and isinstance(body.get("keys"), list) and len(body["keys"]) > 4:
        body = dict(body, keys="<%d keys>" % len(body["keys"]))
    if isinstance(body, dict) and isinstance(body.get("sizes"), list) and len(body["sizes"]) > 4:
        body = dict(body, sizes="<%d sizes>" % len(body["sizes"]))
    return body


class Arena:
    """The daemon's L1 arena mapped into this process, as a client maps it: open(path, "r+b")
    and mmap(fileno, size) (MAP_SHARED, read-write)."""

    def __init__(self, shm):
        assert isinstance(shm, dict), "HELLO shm is not a map: %r" % (shm,)
        self.path = shm["path"]
        self.size = shm["size"]
        self._f = open(self.path, "r+b")
        self.mm = mmap.mmap(self._f.fileno(), self.size)

    def write(self, offset, data):
        assert 0 <= offset and offset + len(data) <= self.size, (offset, len(data), self.size)
        self.mm[offset:offset + len(data)] = data

    def read(self, offset, length):
        assert 0 <= offset and offset + length <= self.size, (offset, length, self.size)
        return self.mm[offset:offset + length]

    def close(self):
        if self.mm is not None:
            self.mm.close()
            self._f.close()
            self.mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def mapped_len_ok(client, size):
    """Whether a kvtier.Client mapped the arena of `size` L1 bytes: exactly that, or up to
    HELLO's shm.map_size when the Client maps the fast path's rings too."""
    shm = client.info["shm"]
    return client.arena is not None and shm["size"] == size and \
        len(client.arena) in (size, shm.get("map_size", size))


def payload(seed, length):
    """length pseudo-random bytes, the same for the same seed in every process."""
    return random.Random(seed).randbytes(length)


def pattern(k, length):
    """A recognizable payload: the 16-byte key repeated (cut to length)."""
    return (k * (length // len(k) + 1))[:length]


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def slot_range(sl):
    return (sl["offset"], sl["offset"] + sl["length"])


def ranges_overlap(a, b):
    return a[0] < b[1] and b[0] < a[1]


def check_slots(slots, sizes, capacity, others=()):
    """Asserts that every non-nil slot is {offset, length} with length == its size, a 4 KiB
    aligned offset, inside the arena, and that no two slots (nor a slot and a range in
    `others`) overlap."""
    ranges = []
    for i, sl in enumerate(slots):
        if sl is None:
            continue
        assert isinstance(sl, dict) and set(sl) >= {"offset", "length"}, "slot %d: %r" % (i, sl)
        off, ln = sl["offset"], sl["length"]
        assert isinstance(off, int) and isinstance(ln, int), "slot %d: %r" % (i, sl)
        assert ln == sizes[i], "slot %d has length %d, asked for %d" % (i, ln, sizes[i])
        assert off % PAGE == 0, "slot %d offset %d is not a multiple of 4096" % (i, off)
        assert 0 <= off and off + ln <= capacity, \
            "slot %d [%d, %d) outside the arena of %d bytes" % (i, off, off + ln, capacity)
        ranges.append((i, (off, off + ln)))
    for x in range(len(ranges)):
        for y in range(x + 1, len(ranges)):
            assert not ranges_overlap(ranges[x][1], ranges[y][1]), \
                "slots %d %r and %d %r overlap" % (ranges[x][0], ranges[x][1], ranges[y][0],
                                                    ranges[y][1])
        for o in others:
            assert not ranges_overlap(ranges[x][1], o), \
                "slot %d %r overlaps a live object at %r" % (ranges[x][0], ranges[x][1], o)


_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "l1_worker.py")


class WorkerProcess:
    """A separate client process (l1_worker.py) driven over its stdin/stdout with
    length-prefixed msgpack commands; see l1_worker.py for the commands. Every command waits
    at most `timeout` seconds for its answer."""

    def __init__(self, timeout=15.0):
        self.timeout = timeout
        self.proc = subprocess.Popen([sys.executable, _WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     bufsize=0)

    def _read_exact(self, n, deadline):
        fd = self.proc.stdout.fileno()
        buf = b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("client process did not answer within %.0f s"
                                     % self.timeout)
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                continue
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                self.proc.wait(5)
                raise AssertionError("client process exited (%s); stderr:\n%s"
                                     % (self.proc.returncode, self.stderr_text()))
            buf += chunk
        return buf

    def cmd(self, *args, timeout=None):
        """Runs one command in the process; returns its result or raises AssertionError with
        the process's exception text."""
        data = pack(list(args))
        self.proc.stdin.write(struct.pack(">I", len(data)) + data)
        self.proc.stdin.flush()
        deadline = time.monotonic() + (timeout or self.timeout)
        n = struct.unpack(">I", self._read_exact(4, deadline))[0]
        reply = unpack(self._read_exact(n, deadline))
        if not reply["ok"]:
            raise AssertionError("client process command %r failed: %s" % (args[0],
                                                                            reply["error"]))
        return reply["result"]

    def stderr_text(self):
        if self.proc.poll() is None:
            return ""
        return self.proc.stderr.read().decode("utf-8", "replace")[-3000:]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.cmd("exit", timeout=5)
            except (AssertionError, OSError):
                pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------------------
# L2: a private redis-server for the redis adapter tests


def redis_server_path():
    """Absolute path of redis-server (KVT_REDIS_SERVER, else $PATH, else /usr/bin), or None."""
    for p in (os.environ.get("KVT_REDIS_SERVER"), shutil.which("redis-server"),
              "/usr/bin/redis-server"):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return os.path.abspath(p)
    return None


def _resp_encode(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def _resp_read(f):
    line = f.readline()
    if not line.endswith(b"\r\n"):
        raise OSError("redis: connection closed mid-reply")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        raise RuntimeError("redis error: " + rest.decode("utf-8", "replace"))
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)
        if len(data) != n + 2:
            raise OSError("redis: connection closed mid-reply")
        return data[:-2]
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [_resp_read(f) for _ in range(n)]
    raise OSError("redis: bad reply line %r" % line)


class RedisServer:
    """One redis-server on 127.0.0.1 with no persistence (--save '' --appendonly no), its
    files in `workdir`. start() waits (bounded) until it answers PING; kill()/stop() end it;
    start() again reuses the same port (a restart, as an outage would end). With `password`
    the server requires it (--requirepass) and command() authenticates."""

    def __init__(self, binary, workdir, port=None, password=None):
        self.binary = binary
        self.password = password
        self.dir = workdir
        os.makedirs(self.dir, exist_ok=True)
        self.port = port or free_port()
        self.fixed_port = port is not None
        self.log_path = os.path.join(self.dir, "redis.log")
        self.proc = None

    @property
    def addr(self):
        return "127.0.0.1:%d" % self.port

    def start(self, timeout=10.0):
        assert not self.alive(), "redis-server already running"
        for attempt in range(3):
            argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                    "--save", "", "--appendonly", "no", "--dir", self.dir,
                    "--daemonize", "no", "--logfile", self.log_path, "--loglevel", "warning"]
            if self.password:
                argv += ["--requirepass", self.password]
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    if self.command("PING", timeout=0.5) == "PONG":
                        self.fixed_port = True      # a restart comes back on this port
                        return self
                except (OSError, RuntimeError):
                    pass
                time.sleep(0.05)
            if self.proc.poll() is None:
                self.kill()
                raise AssertionError("redis-server on port %d did not answer PING within "
                                     "%.0f s\n%s" % (self.port, timeout, self.log_tail()))
            # exited: most likely the port was taken between free_port() and the bind
            if self.fixed_port or attempt == 2:
                raise AssertionError("redis-server on port %d exited with %s\n%s"
                                     % (self.port, self.proc.returncode, self.log_tail()))
            self.port = free_port()
        return self

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self):
        """SIGKILL: an outage, nothing flushed."""
        if self.alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self):
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def command(self, *args, timeout=2.0):
        """One command over a fresh connection (after AUTH when the server has a password);
        the decoded reply."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            with s.makefile("rb") as f:
                if self.password is not None:
                    s.sendall(_resp_encode(("AUTH", self.password)))
                    _resp_read(f)
                s.sendall(_resp_encode(args))
                return _resp_read(f)

    def keys(self, pattern_="*"):
        return sorted(self.command("KEYS", pattern_) or [])

    def log_tail(self, lines=20):
        try:
            with open(self.log_path, "rb") as f:
                text = f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return "(no redis log)"
        return "\n".join(text.splitlines()[-lines:])
