"""Security defaults against the real daemon: private files and sockets, the remote-bind rule,
and CURVE (encryption + client authentication by public key) on tcp:// listen endpoints.

Only loopback exists on the test machines, so CURVE is exercised on tcp://127.0.0.1 (the daemon
applies it to every tcp:// listen endpoint once keys are configured) and the remote-bind rule
with tcp://0.0.0.0. A client the daemon does not accept never completes the CURVE handshake: it
gets no reply at all, which the tests check with a bounded wait.
"""

import os
import stat
import subprocess
import sys
import time

import pytest
import zmq

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import kvtier  # noqa: E402
from kvtest import (HELLO, PING, free_port, pack, run_kvtierd, unpack,  # noqa: E402
                    wait_until)

NO_REPLY_WAIT_MS = 1500


def write_zcert(path, public, secret=None):
    """A certificate in czmq's zcert format (what zcert_save writes), from pyzmq keys."""
    def one(p, sec):
        lines = ["#   ZeroMQ CURVE %s Certificate" % ("**Secret**" if sec else "Public"), "",
                 "metadata", "curve", '    public-key = "%s"' % public.decode()]
        if sec:
            lines.append('    secret-key = "%s"' % sec.decode())
        with open(p, "w") as f:
            f.write("\n".join(lines) + "\n")
    one(path, None)
    if secret:
        one(path + "_secret", secret)
        os.chmod(path + "_secret", 0o600)


def keygen(cli, path):
    """`kvtier keygen PATH` (what operators run); returns the public key it printed."""
    cp = subprocess.run([cli, "keygen", path], capture_output=True, text=True, timeout=10)
    assert cp.returncode == 0, cp.stderr
    first = cp.stdout.splitlines()[0]
    assert first.startswith("public key "), cp.stdout
    return first[len("public key "):].encode()


def read_public(path):
    with open(path) as f:
        for line in f:
            if "public-key" in line:
                return line.split('"')[1].encode()
    raise AssertionError("no public-key in %s" % path)


@pytest.fixture
def pki(tmp_path, kvt_cli_bin):
    """server.cert(+_secret), clients/ with alice's public cert (made by `kvtier keygen`), and
    keys for bob (a pyzmq key pair written as zcert files, not in clients/ yet)."""
    clients = tmp_path / "clients"
    clients.mkdir()
    keys = tmp_path / "keys"
    keys.mkdir()
    server = str(keys / "server.cert")
    server_pub = keygen(kvt_cli_bin, server)
    assert read_public(server) == server_pub
    sec_mode = os.stat(server + "_secret").st_mode & 0o777
    assert sec_mode == 0o600, "secret certificate mode %o" % sec_mode
    alice = str(keys / "alice")
    alice_pub = keygen(kvt_cli_bin, alice)
    os.link(alice, str(clients / "alice"))         # only the public half goes to the daemon
    # keygen never overwrites a key pair
    cp = subprocess.run([kvt_cli_bin, "keygen", alice], capture_output=True, text=True,
                        timeout=10)
    assert cp.returncode == 1 and "exists" in cp.stderr, (cp.returncode, cp.stderr)
    assert read_public(alice) == alice_pub
    bob_pub, bob_sec = zmq.curve_keypair()
    bob = str(keys / "bob")
    write_zcert(bob, bob_pub, bob_sec)
    return {"dir": tmp_path, "server": server, "server_pub": server_pub, "clients": str(clients),
            "alice": alice, "alice_pub": alice_pub, "bob": bob, "bob_pub": bob_pub,
            "bob_sec": bob_sec}


def curve_args(pki):
    return ("--curve-server-cert", pki["server"], "--curve-clients", pki["clients"])


def dealer(d, endpoint, server_pub=None, pub=None, sec=None):
    s = d.ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    # a DEALER whose only connection failed its CURVE handshake has no peer left, and a send
    # would block for ever: bounded, it raises zmq.Again (ping_reply: no reply)
    s.setsockopt(zmq.SNDTIMEO, 1000)
    if server_pub is not None:
        s.curve_serverkey = server_pub
        s.curve_publickey = pub
        s.curve_secretkey = sec
    s.connect(endpoint)
    d._sockets.append(s)
    return s


def ping_reply(s, uid, wait_ms=5000):
    """Sends PING; the reply body, or None when nothing came within wait_ms."""
    try:
        s.send_multipart([pack(uid), pack(PING), pack({})])
    except zmq.Again:
        return None  # refused at the handshake: no connection to send on
    if not s.poll(wait_ms, zmq.POLLIN):
        return None
    frames = s.recv_multipart()
    assert unpack(frames[0]) == uid
    return unpack(frames[2])


def secret_of(path):
    with open(path + "_secret") as f:
        for line in f:
            if "secret-key" in line:
                return line.split('"')[1].encode()
    raise AssertionError("no secret-key in %s_secret" % path)


# ----------------------------------------------------------------------------------------
# Private by default


def test_files_and_sockets_are_private_by_default(daemon):
    d = daemon
    s = d.dealer()
    shm = d.hello(s, "inst-private")["shm"]
    for path in (d.ipc_path, shm["path"]):
        mode = os.stat(path).st_mode & 0o777
        assert mode & 0o077 == 0, "%s is mode %o: group/world may use it" % (path, mode)
    # the directories the daemon creates, and what the fs L2 writes, are not world-readable
    for root in (d.run_dir, d.data_dir):
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                st = os.lstat(p)
                if p == d.ipc_path or stat.S_ISLNK(st.st_mode):
                    continue
                assert st.st_mode & 0o007 == 0, "%s is world-accessible (%o)" % (
                    p, st.st_mode & 0o777)
    # HTTP answers on loopback only: the default binds 127.0.0.1
    assert d.http_addr.startswith("127.0.0.1:")


# ----------------------------------------------------------------------------------------
# CURVE


def test_curve_authenticates_clients_on_tcp(daemon_factory, pki, kvt_cli_bin):
    d = daemon_factory(*curve_args(pki))
    assert "(CURVE)" in d.stderr_text() and d.tcp in d.stderr_text()
    sp = pki["server_pub"]

    # alice's key is in curve.clients: served, with the daemon's public key as server key
    alice = dealer(d, d.tcp, sp, pki["alice_pub"], secret_of(pki["alice"]))
    assert ping_reply(alice, 1)["ok"] is True
    alice.send_multipart([pack(2), pack(HELLO), pack({"version": 1, "client": "pytest",
                                                      "instance": "inst-alice"})])
    assert unpack(alice.recv_multipart()[2])["ok"] is True

    # no reply at all: plain client, unknown client key, wrong server key
    plain = dealer(d, d.tcp)
    stranger_pub, stranger_sec = zmq.curve_keypair()
    stranger = dealer(d, d.tcp, sp, stranger_pub, stranger_sec)
    other_server, _ = zmq.curve_keypair()
    wrong = dealer(d, d.tcp, other_server, pki["alice_pub"], secret_of(pki["alice"]))
    bob = dealer(d, d.tcp, sp, pki["bob_pub"], pki["bob_sec"])
    for name, s in (("plain", plain), ("unknown key", stranger), ("wrong server key", wrong),
                    ("bob before his cert is added", bob)):
        assert ping_reply(s, 3, NO_REPLY_WAIT_MS) is None, "%s client got a reply" % name

    # ipc stays plain (file permissions guard it), and the refusals cost the daemon nothing
    assert ping_reply(dealer(d, d.ipc), 4)["ok"] is True
    assert ping_reply(alice, 5)["ok"] is True
    assert d.alive()

    # certificates can be added while the daemon runs: bob's key is accepted from then on
    os.link(pki["bob"], os.path.join(pki["clients"], "bob"))

    def bob_served():
        s = dealer(d, d.tcp, sp, pki["bob_pub"], pki["bob_sec"])
        r = ping_reply(s, 6, 500)
        s.close(linger=0)
        return r is not None and r["ok"]
    wait_until(bob_served, timeout=10, interval=0.2, what="bob's new certificate to be accepted")


def test_curve_clients_libkvtier_cli_and_python(daemon_factory, pki, kvt_cli_bin):
    d = daemon_factory(*curve_args(pki))
    env = dict(os.environ)
    for k in ("KVTIER_CURVE_SERVERKEY", "KVTIER_CURVE_CERT", "KVTIER_ENDPOINT"):
        env.pop(k, None)

    def cli(*args, extra_env=None, timeout_ms=1000):
        e = dict(env, **(extra_env or {}))
        return subprocess.run([kvt_cli_bin, "-e", d.tcp, "-t", str(timeout_ms)] + list(args)
                              + ["ping"], capture_output=True, text=True, env=e, timeout=20)

    # flags: the server key as a certificate path
    cp = cli("--curve-serverkey", pki["server"], "--curve-cert", pki["alice"])
    assert cp.returncode == 0 and "pong" in cp.stdout, cp.stderr
    # environment: the server key as Z85 text
    cp = cli(extra_env={"KVTIER_CURVE_SERVERKEY": pki["server_pub"].decode(),
                        "KVTIER_CURVE_CERT": pki["alice"]})
    assert cp.returncode == 0 and "pong" in cp.stdout, cp.stderr
    # refused: no CURVE, or a key pair the daemon does not know (says what to check)
    cp = cli()
    assert cp.returncode == 1 and "timed out" in cp.stderr, (cp.returncode, cp.stderr)
    cp = cli("--curve-serverkey", pki["server"], "--curve-cert", pki["bob"])
    assert cp.returncode == 1 and "curve.clients" in cp.stderr, (cp.returncode, cp.stderr)
    # a certificate that is not one is a local error, caught before connecting
    junk = str(pki["dir"] / "junk")
    with open(junk, "w") as f:
        f.write("not a certificate\n")
    cp = cli("--curve-serverkey", pki["server"], "--curve-cert", junk)
    assert cp.returncode == 1 and "not a zcert" in cp.stderr, (cp.returncode, cp.stderr)

    # libkvtier's kvtier_connect (no CURVE argument) takes the keys from the environment
    client_test = os.environ.get("KVT_CLIENT_TEST")
    if client_test and os.access(client_test, os.X_OK):
        e = dict(env, KVTIER_CURVE_SERVERKEY=pki["server"], KVTIER_CURVE_CERT=pki["alice"])
        cp = subprocess.run([client_test, d.tcp, "embed"], capture_output=True, text=True,
                            env=e, timeout=60)
        assert cp.returncode == 0, cp.stderr

    # the Python client
    c = kvtier.Client(d.tcp, instance="py-curve", curve_serverkey=pki["server"],
                      curve_cert=pki["alice"], map_arena=False, context=d.ctx)
    try:
        c.ping()
        k = b"\x07" * 16
        assert c.put("curve-ns", [k], [b"secret bytes"]) == 1
        assert c.get("curve-ns", [k]) == [b"secret bytes"]
    finally:
        c.close()
    with pytest.raises(kvtier.KvtierError):
        kvtier.Client(d.tcp, instance="py-curve-bob", curve_serverkey=pki["server"],
                      curve_cert=pki["bob"], map_arena=False, context=d.ctx, timeout_ms=800)


def test_curve_makes_non_loopback_listen_acceptable(daemon_factory, pki):
    port = free_port()
    remote = "tcp://0.0.0.0:%d" % port
    d = daemon_factory(start=False)
    # an ipc endpoint bound after a CURVE one is plain again (options are per bind)
    late_ipc = "ipc://" + os.path.join(d.run_dir, "late.sock")
    d.args += ["--listen", remote, "--listen", late_ipc] + list(curve_args(pki))
    d.start()
    s = dealer(d, "tcp://127.0.0.1:%d" % port, pki["server_pub"], pki["alice_pub"],
               secret_of(pki["alice"]))
    assert ping_reply(s, 1)["ok"] is True
    assert ping_reply(dealer(d, "tcp://127.0.0.1:%d" % port), 2, NO_REPLY_WAIT_MS) is None
    assert ping_reply(dealer(d, late_ipc), 3)["ok"] is True

    # without CURVE (and without allow_insecure_remote) the same endpoint is refused, naming
    # both ways out
    other = daemon_factory(start=False)
    cp = run_kvtierd(other.args + ["--listen", "tcp://0.0.0.0:%d" % free_port()], cwd=other.dir)
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    line = cp.stderr.strip()
    assert "\n" not in line and "not loopback" in line and "curve.server_cert" in line, line
    # CURVE covers the listen endpoints only: a remote events endpoint still needs the flag
    cp = run_kvtierd(other.args + list(curve_args(pki))
                     + ["--events", "tcp://0.0.0.0:%d" % free_port(), "--check-config"],
                     cwd=other.dir)
    assert cp.returncode == 2 and "events" in cp.stderr, (cp.returncode, cp.stderr)


@pytest.mark.parametrize("case", ["missing-cert", "public-only", "not-a-cert", "clients-missing",
                                  "clients-is-file", "cert-without-clients",
                                  "clients-without-cert"])
def test_curve_bad_configuration_exits_2(daemon_factory, pki, case):
    d = daemon_factory(start=False)
    base = pki["dir"]
    pub_only = str(base / "pub-only")
    write_zcert(pub_only, pki["alice_pub"])
    junk = str(base / "junk.cert")
    with open(junk, "w") as f:
        f.write("curve\n    public-key = \"short\"\n")
    args = {
        "missing-cert": ["--curve-server-cert", str(base / "nope"), "--curve-clients",
                         pki["clients"]],
        "public-only": ["--curve-server-cert", pub_only, "--curve-clients", pki["clients"]],
        "not-a-cert": ["--curve-server-cert", junk, "--curve-clients", pki["clients"]],
        "clients-missing": ["--curve-server-cert", pki["server"], "--curve-clients",
                            str(base / "nope")],
        "clients-is-file": ["--curve-server-cert", pki["server"], "--curve-clients", junk],
        "cert-without-clients": ["--curve-server-cert", pki["server"]],
        "clients-without-cert": ["--curve-clients", pki["clients"]],
    }[case]
    want = "curve.clients" if case.startswith("clients-") else "curve.server_cert"
    for extra in (["--check-config"], []):
        cp = run_kvtierd(d.args + args + extra, cwd=d.dir, timeout=10)
        assert cp.returncode == 2, (case, extra, cp.returncode, cp.stderr)
        lines = [l for l in cp.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and want in lines[0], (case, extra, cp.stderr)
    assert not os.path.exists(d.ipc_path)
