"""pytest fixtures for the kvtier integration tests.

Every test here runs against the real daemon named by KVT_DAEMON (the ASan+UBSan build under
`make integration`); without it the whole directory is skipped with a message. A daemon is
spawned per test (`daemon`, `daemon_factory`) or shared by the tests of one module
(`shared_daemon`, for stateless protocol/HTTP checks where start-up cost adds up). Either way
its stderr is scanned for sanitizer reports, and any report fails the test (STYLE.md 15d),
as does a daemon that dies under a shared fixture or needs SIGKILL to stop.

Fixtures:
  daemon_factory(*extra_args, env=None, args=None, start=True, wait=True, prefix=()) -> Daemon
  daemon          a started Daemon with the default flags
  shared_daemon   a started Daemon shared by the module (flags: module-level KVT_SHARED_ARGS)
  kvt_daemon_bin  absolute path of the daemon (KVT_DAEMON)
  kvt_cli_bin     absolute path of the kvtier CLI (KVT_CLI); skips the test when unset
  redis_factory(port=None, password=None) -> a started RedisServer (a private redis-server on
                  127.0.0.1); skips the test when redis-server is not installed

Transport of the Python clients (kvtier.Client) and libkvtier: by default what the clients
do by default (the shared-memory fast path when the daemon offers it); `--kvt-transport zmq`
or KVT_TRANSPORT=zmq sets KVTIER_FASTPATH=0 for the whole run (clients in worker processes
inherit it), `--kvt-transport fastpath` / KVT_TRANSPORT=fastpath insists on the fast path
(the run stops at once when the Python client cannot load libkvtier). Tests about the fast
path itself (marker `fastpath`, given to every test named test_fastpath* and to
test_fastpath.py) run without KVTIER_FASTPATH whatever the transport. KVTIER_LIBRARY, which
the Python client loads the ring code from, defaults to the build's libkvtier.so (next to
KVT_DAEMON, or build/libkvtier.so of this checkout).

A module attribute KVT_DAEMON_ARGS (a tuple of flags) goes before the extra arguments of every
daemon that daemon_factory, daemon and shared_daemon start for that module: the L1-only suites
set ("--l2", "none"), since the default fs L2 changes what LOOKUP, CLEAR and eviction show.
"""

import os
import shutil
import signal
import tempfile

import pytest

from kvtest import Daemon, RedisServer, cli_path, daemon_path, redis_server_path, sanitizer_report

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
TRANSPORTS = ("fastpath", "zmq")


def _libkvtier_path():
    """The build's libkvtier.so: beside KVT_DAEMON (build/, or build/ above build/asan/), else
    build/libkvtier.so of this checkout; None when there is none."""
    dirs = []
    daemon = daemon_path()
    if daemon:
        dirs += [os.path.dirname(daemon), os.path.dirname(os.path.dirname(daemon))]
    dirs.append(os.path.join(_REPO, "build"))
    for d in dirs:
        p = os.path.join(d, "libkvtier.so")
        if os.path.isfile(p):
            return p
    return None


def pytest_addoption(parser):
    parser.addoption("--kvt-transport", choices=TRANSPORTS,
                     default=os.environ.get("KVT_TRANSPORT") or None,
                     help="the clients' transport: fastpath (the shared-memory rings) or zmq "
                          "(KVTIER_FASTPATH=0); default: KVT_TRANSPORT, else the clients' "
                          "default")


def pytest_configure(config):
    config.addinivalue_line("markers", "fastpath: a test of the fast path itself: runs without "
                            "KVTIER_FASTPATH whatever --kvt-transport / KVT_TRANSPORT say")
    if not os.environ.get("KVTIER_LIBRARY"):
        lib = _libkvtier_path()
        if lib:
            os.environ["KVTIER_LIBRARY"] = lib
    transport = config.getoption("--kvt-transport")
    if transport not in (None,) + TRANSPORTS:
        raise pytest.UsageError("KVT_TRANSPORT=%s: use one of %s" % (transport,
                                                                     ", ".join(TRANSPORTS)))
    if transport == "zmq":
        os.environ["KVTIER_FASTPATH"] = "0"
    elif transport == "fastpath":
        os.environ.pop("KVTIER_FASTPATH", None)
        try:
            from kvtier import _ring
        except ImportError as e:
            raise pytest.UsageError("--kvt-transport fastpath: kvtier does not import: %s" % e)
        if _ring.library() is None:
            raise pytest.UsageError("--kvt-transport fastpath: %s (set KVTIER_LIBRARY)"
                                    % _ring.why)


def pytest_report_header(config):
    return "kvtier transport: %s (KVTIER_FASTPATH=%s, KVTIER_LIBRARY=%s)" % (
        config.getoption("--kvt-transport") or "default",
        os.environ.get("KVTIER_FASTPATH", ""), os.environ.get("KVTIER_LIBRARY", ""))


def _skip_reason():
    p = os.environ.get("KVT_DAEMON")
    if not p:
        return ("KVT_DAEMON is unset: build the daemon (make asan) and run with "
                "KVT_DAEMON=/abs/build/asan/kvtierd")
    return "KVT_DAEMON=%s is missing or not executable" % p


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.name.startswith("test_fastpath") or \
                os.path.basename(str(item.fspath)) == "test_fastpath.py":
            item.add_marker(pytest.mark.fastpath)
    if daemon_path() is not None:
        return
    skip = pytest.mark.skip(reason=_skip_reason())
    for item in items:
        if str(item.fspath).startswith(_HERE + os.sep):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "kvt_rep_" + rep.when, rep)
    # A failing test shows the tail of each of its daemons' stderr in the report.
    if rep.failed and rep.when == "call":
        for d in getattr(item, "_kvt_daemons", ()):
            rep.sections.append(("kvtierd stderr tail (%s)" % d.dir, d.stderr_tail(80)))


def _test_failed(node):
    return any(getattr(node, "kvt_rep_" + w, None) is not None
               and getattr(node, "kvt_rep_" + w).failed for w in ("setup", "call"))


def _finish_daemon(d):
    """Stops `d` if it still runs (SIGTERM, SIGKILL after 10 s) and returns a list of
    problems: a sanitizer report, or a daemon that did not stop on SIGTERM."""
    problems = []
    if d.proc is not None:
        if d.alive():
            d.stop(signal.SIGTERM, timeout=10)
            if d.killed:
                problems.append("kvtierd (%s) did not exit within 10 s of SIGTERM and was "
                                "killed\n--- stderr tail ---\n%s" % (d.dir, d.stderr_tail(40)))
        rep = d.sanitizer_report()
        if rep:
            problems.append("sanitizer report in kvtierd stderr (%s, exit status %s):\n%s"
                            % (d.dir, d.returncode, rep))
    return problems


@pytest.fixture(autouse=True)
def _kvt_fastpath_tests(request, monkeypatch):
    """Tests of the fast path itself ignore KVT_TRANSPORT=zmq (they set what they test)."""
    if request.node.get_closest_marker("fastpath") is not None:
        monkeypatch.delenv("KVTIER_FASTPATH", raising=False)


@pytest.fixture(scope="session")
def kvt_daemon_bin():
    p = daemon_path()
    if p is None:
        pytest.skip(_skip_reason())
    return p


@pytest.fixture(scope="session")
def kvt_cli_bin():
    p = cli_path()
    if p is None:
        pytest.skip("KVT_CLI is unset or not executable (set KVT_CLI=/abs/build/kvtier)")
    return p


@pytest.fixture
def daemon_factory(request, kvt_daemon_bin):
    """spawn(*extra_args, env=None, args=None, start=True, wait=True, prefix=()) -> Daemon.

    extra_args are appended to the default command line; `args` replaces it (argv[1:]); env
    adds variables; `prefix` is a command the daemon is exec'd by (setpriv, prlimit). Every
    daemon spawned is stopped at teardown and its stderr checked."""
    daemons = []
    request.node._kvt_daemons = daemons
    module_args = tuple(getattr(request.module, "KVT_DAEMON_ARGS", ()))

    def spawn(*extra_args, env=None, args=None, start=True, wait=True, prefix=()):
        d = Daemon(binary=kvt_daemon_bin, extra_args=module_args + tuple(extra_args), env=env,
                   args=args, prefix=prefix)
        daemons.append(d)
        if start:
            d.start(wait=wait)
        return d

    yield spawn

    problems = []
    for d in daemons:
        try:
            problems += _finish_daemon(d)
        finally:
            d.cleanup(keep_dir=bool(problems) or _test_failed(request.node))
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


@pytest.fixture
def daemon(daemon_factory):
    """A started daemon with the default flags, private to the test."""
    return daemon_factory()


class _SharedHolder:
    """One daemon for the tests of a module; replaced when a test leaves it dead."""

    def __init__(self, binary, extra_args):
        self.binary = binary
        self.extra_args = tuple(extra_args)
        self.daemon = None

    def get(self):
        if self.daemon is None:
            self.daemon = Daemon(binary=self.binary, extra_args=self.extra_args)
            try:
                self.daemon.start()
            except BaseException:
                d, self.daemon = self.daemon, None
                d.cleanup(keep_dir=True)
                raise
        return self.daemon

    def retire(self, keep_dir):
        d, self.daemon = self.daemon, None
        if d is None:
            return []
        try:
            return _finish_daemon(d)
        finally:
            d.cleanup(keep_dir=keep_dir)


@pytest.fixture(scope="module")
def _kvt_shared_holder(request, kvt_daemon_bin):
    holder = _SharedHolder(kvt_daemon_bin,
                           tuple(getattr(request.module, "KVT_DAEMON_ARGS", ()))
                           + tuple(getattr(request.module, "KVT_SHARED_ARGS", ())))
    yield holder
    problems = holder.retire(keep_dir=False)
    if problems:
        pytest.fail("shared daemon of %s:\n%s" % (request.module.__name__,
                                                  "\n\n".join(problems)), pytrace=False)


@pytest.fixture
def shared_daemon(request, _kvt_shared_holder):
    """A started daemon shared by the module's tests (module attribute KVT_SHARED_ARGS adds
    flags). Use it only for tests that do not depend on or change daemon-wide state
    (sessions, counters compared exactly). After each test: its sockets are closed, and the
    test fails if the daemon died or wrote a sanitizer report during it."""
    d = _kvt_shared_holder.get()
    request.node._kvt_daemons = [d]
    offset = len(d.stderr_text())
    yield d
    d.close_sockets()
    problems = []
    if not d.alive():
        problems.append("kvtierd died during this test (exit status %s)\n--- stderr tail ---\n%s"
                        % (d.proc.poll(), d.stderr_tail(60)))
    rep = sanitizer_report(d.stderr_text()[offset:])
    if rep:
        problems.append("sanitizer report in kvtierd stderr during this test:\n%s" % rep)
    if problems:
        problems += _kvt_shared_holder.retire(keep_dir=True)
        pytest.fail("\n\n".join(problems), pytrace=False)


@pytest.fixture
def redis_factory(request):
    """spawn(port=None, password=None) -> a started RedisServer (127.0.0.1, no persistence,
    files in a temp dir). Every server is killed at teardown. Skips the test when
    redis-server is missing."""
    binary = redis_server_path()
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server, or set "
                    "KVT_REDIS_SERVER)")
    servers = []
    root = tempfile.mkdtemp(prefix="kvt-redis-", dir=os.environ.get("KVT_TMPDIR", "/tmp"))

    def spawn(port=None, password=None):
        r = RedisServer(binary, os.path.join(root, str(len(servers))), port=port,
                        password=password)
        servers.append(r)
        return r.start()

    yield spawn
    for r in servers:
        r.kill()
    if not os.environ.get("KVT_KEEP_TMP") and not _test_failed(request.node):
        shutil.rmtree(root, ignore_errors=True)
