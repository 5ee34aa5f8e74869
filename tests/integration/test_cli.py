"""The kvtier CLI (build/kvtier, KVT_CLI) against the real daemon: ping and stats, usage
errors, an unreachable daemon. Exit status: 0 ok, 1 error or unreachable, 2 usage."""

import os
import subprocess
import time


def run_cli(cli, *args, env=None, timeout=15):
    e = dict(os.environ)
    e.pop("KVTIER_ENDPOINT", None)
    e.update(env or {})
    t0 = time.monotonic()
    try:
        cp = subprocess.run([cli] + list(args), stdin=subprocess.DEVNULL, capture_output=True,
                            text=True, env=e, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError("kvtier %s did not exit within %d s" % (" ".join(args), timeout))
    return cp, time.monotonic() - t0


def test_cli_ping_and_stats(daemon, kvt_cli_bin):
    for ep in (daemon.ipc, daemon.tcp):
        cp, _ = run_cli(kvt_cli_bin, "-e", ep, "ping")
        assert cp.returncode == 0, (ep, cp.stdout, cp.stderr)
    cp, _ = run_cli(kvt_cli_bin, "-e", daemon.ipc, "stats")
    assert cp.returncode == 0, cp.stderr
    assert "ping" in cp.stdout, cp.stdout


def test_cli_endpoint_from_env(daemon, kvt_cli_bin):
    cp, _ = run_cli(kvt_cli_bin, "ping", env={"KVTIER_ENDPOINT": daemon.ipc})
    assert cp.returncode == 0, cp.stderr


def test_cli_usage(kvt_cli_bin):
    for args in ((), ("frobnicate",), ("-e",)):
        cp, _ = run_cli(kvt_cli_bin, *args)
        assert cp.returncode == 2, (args, cp.returncode, cp.stderr)
        assert cp.stderr.strip()


def test_cli_unreachable(daemon, kvt_cli_bin):
    assert daemon.stop() == 0
    cp, took = run_cli(kvt_cli_bin, "-e", daemon.ipc, "-t", "500", "ping")
    assert cp.returncode == 1, (cp.returncode, cp.stderr)
    assert cp.stderr.strip()
    assert took < 10
