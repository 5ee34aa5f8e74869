"""The daemon the Python benchmarks run against: started on a work directory of their own (no
L2, no HTTP, nothing left in /dev/shm), answered once it says PONG, stopped with SIGTERM."""

import os
import signal
import subprocess
import time

import kvtier


def start_daemon(binary, workdir, l1):
    """kvtierd `binary` with an L1 of `l1` ("256M") in `workdir` -> (process, ipc endpoint)."""
    run = os.path.join(workdir, "run")
    os.makedirs(run)
    ipc = "ipc://" + os.path.join(run, "kvtier.sock")
    log = os.path.join(workdir, "log")
    with open(log, "w") as err:
        proc = subprocess.Popen([binary, "--run-dir", run,
                                 "--data-dir", os.path.join(workdir, "d"),
                                 "--listen", ipc, "--http", "", "--l2", "none",
                                 "--l1-size", l1, "--log-level", "warn",
                                 # nothing kept in /dev/shm after the run
                                 "--l1-adopt=false"],
                                stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with kvtier.Client(ipc, timeout_ms=500) as c:
                c.ping()
            return proc, ipc
        except kvtier.KvtierError:
            if proc.poll() is not None:
                with open(log) as f:
                    raise SystemExit("kvtierd exited: %s" % f.read())
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("kvtierd did not answer within 20 s")


def stop_daemon(proc):
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=20)
