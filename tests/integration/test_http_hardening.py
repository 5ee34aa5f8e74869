"""HTTP hardening (issue #13): health probes answer while many slow clients hold connections,
and POST /clear refuses a namespace the wire protocol would refuse."""

import json
import re
import socket
import time
import urllib.parse

from kvtest import PUT, free_port, key, wait_until

SLOW = 200


def timed_get(d, path, limit):
    t0 = time.monotonic()
    try:
        status = d.http("GET", path, timeout=limit + 1.0)[0]
    except OSError as e:
        raise AssertionError("GET %s failed after %.1f s: %r" % (path, time.monotonic() - t0, e))
    took = time.monotonic() - t0
    assert took < limit, "GET %s took %.2f s (limit %.1f s)" % (path, took, limit)
    return status


def test_health_probes_answer_past_many_slow_connections(daemon):
    d = daemon
    conns = []
    try:
        for _ in range(SLOW):
            c = socket.create_connection(("127.0.0.1", d.http_port), timeout=5)
            c.sendall(b"GET /healthz HTTP/1.1\r\nHost: slow\r\n")    # never finished
            conns.append(c)
        time.sleep(0.3)          # the daemon has seen (and accepted, or not) every one of them
        assert timed_get(d, "/healthz", 1.0) == 200
        assert timed_get(d, "/readyz", 1.0) == 200
        assert timed_get(d, "/metrics", 2.0) == 200
        assert d.alive()

        # idle half-requests are closed after http_timeout_s (default 3 s), not held forever
        t0 = time.monotonic()
        for c in conns:
            c.settimeout(max(0.1, 8.0 - (time.monotonic() - t0)))
            try:
                assert c.recv(4096) == b"", "a reply to a request that was never finished"
            except ConnectionResetError:
                pass
            except socket.timeout:
                raise AssertionError("a slow connection was still open %.1f s later"
                                     % (time.monotonic() - t0))
    finally:
        for c in conns:
            c.close()
    assert timed_get(d, "/healthz", 1.0) == 200
    d.ping(d.dealer())


def test_connection_limit_is_bounded_by_the_open_file_limit(daemon_factory):
    d = daemon_factory("--l2", "none", "--http-max-connections", "60000",
                       prefix=["prlimit", "--nofile=512:512"])
    warn = [l for l in d.log_lines(4) if "http_max_connections" in l]
    assert len(warn) == 1, d.stderr_tail()
    m = [int(x) for x in re.findall(r"\b(\d+)\b", warn[0])]
    assert 60000 in m and any(0 < x < 512 for x in m), warn[0]
    assert d.http("GET", "/healthz")[0] == 200


def test_per_address_limit_on_a_non_loopback_address(daemon_factory):
    """On a non-loopback address one client address may hold a quarter of the connections:
    100 slow connections from 127.0.0.1 leave room for a probe from 127.0.0.2."""
    port = free_port()
    d = daemon_factory("--l2", "none", "--http", "0.0.0.0:%d" % port, "--allow-insecure-remote",
                       "--http-max-connections", "16", start=False)
    d.http_port = port
    d.start()
    assert any("at most 16 connections, 4 per client address" in l for l in d.log_lines(6)), \
        d.stderr_tail()
    conns = []
    try:
        for _ in range(100):
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            try:
                c.sendall(b"GET /healthz HTTP/1.1\r\nHost: slow\r\n")
            except OSError:
                pass                    # refused past the per-address limit
            conns.append(c)
        time.sleep(0.3)
        probe = socket.create_connection(("127.0.0.2", port), timeout=2,
                                         source_address=("127.0.0.2", 0))
        with probe:
            t0 = time.monotonic()
            probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
            reply = probe.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200"), reply[:100]
            assert time.monotonic() - t0 < 1.0
    finally:
        for c in conns:
            c.close()


def _clear(d, query):
    status, headers, body = d.http("POST", "/clear" + query)
    assert headers.get("content-type", "").startswith("application/json"), headers
    return status, json.loads(body)


def test_clear_refuses_an_ns_the_wire_refuses(daemon_factory):
    d = daemon_factory("--l2", "none")
    s = d.dealer()
    for ns in ("a", "keep", "é" * 128):
        d.ok(s, PUT, {"ns": ns, "keys": [key(1), key(2)]}, b"x" * 100, b"y" * 100)

    for query in ("?ns=", "?ns", "?ns=" + "b" * 257,
                  "?ns=" + urllib.parse.quote("é" * 128 + "b")):
        status, doc = _clear(d, query)
        assert status == 400, (query[:40], status, doc)
        assert doc["ok"] is False and doc["error"]["code"] == "bad_request", doc
        assert "ns" in doc["error"]["message"], doc
    # a NUL inside is one more byte of the ns, never the end of it
    status, doc = _clear(d, "?ns=a%00b")
    assert status == 200 and doc["removed"] == 0, doc
    for ns in ("a", "keep", "é" * 128):
        assert d.hits(s, ns, [key(1), key(2)]) == 2, "POST /clear removed objects of %r" % ns

    # at the bound: 256 bytes (128 two-byte characters) is a valid ns
    status, doc = _clear(d, "?ns=" + urllib.parse.quote("é" * 128))
    assert status == 200 and doc == {"ok": True, "removed": 2}, doc
    status, doc = _clear(d, "?ns=a")
    assert status == 200 and doc["removed"] == 2, doc
    assert d.hits(s, "keep", [key(1), key(2)]) == 2
    status, doc = _clear(d, "")
    assert status == 200 and doc["removed"] == 2, doc
    wait_until(lambda: d.hits(s, "keep", [key(1)]) == 0, 2, what="CLEAR of everything")


def _raw(d, request):
    """One raw HTTP exchange: (status, body)."""
    c = socket.create_connection(("127.0.0.1", d.http_port), timeout=5)
    try:
        c.sendall(request)
        data = b""
        while True:
            chunk = c.recv(65536)
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data:
                head, _, rest = data.partition(b"\r\n\r\n")
                m = re.search(rb"content-length:\s*(\d+)", head, re.I)
                if m and len(rest) >= int(m.group(1)):
                    break
    finally:
        c.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def test_a_web_page_cannot_clear_the_cache_or_read_status(daemon_factory):
    """Issue 28 item 10: what a page open in a browser on the node could send is refused — a
    cross-origin POST /clear (Origin http://evil, text/plain, no preflight), a form or text
    body, a GET /status under the page's own rebound name — and ambiguous framing (two
    Content-Length headers) is a 400. curl, the CLI and the daemon's own page still work."""
    d = daemon_factory("--l2", "none", "--http-hosts", "kvtier.example,scrape.local")
    s = d.dealer()
    d.ok(s, PUT, {"ns": "web", "keys": [key(1)]}, b"x" * 100)
    port = d.http_port
    evil = [{"Origin": "http://evil", "Content-Type": "text/plain"},
            {"Origin": "http://evil"},
            {"Content-Type": "application/x-www-form-urlencoded"},
            {"Content-Type": "text/plain;charset=UTF-8"},
            {"Origin": "null", "Content-Type": "multipart/form-data; boundary=x"}]
    for headers in evil:
        status, _, body = d.http("POST", "/clear", body=b"x=1", headers=headers)
        assert status == 403, (headers, status, body)
    assert d.hits(s, "web", [key(1)]) == 1, "a refused POST /clear removed objects"
    # DNS rebinding: the page's name for 127.0.0.1
    for host in ("evil.example:%d" % port, "evil.example", "127.0.0.1.evil.example"):
        status, _, body = d.http("GET", "/status", headers={"Host": host})
        assert status == 403 and b"Host" in body, (host, status, body)
    for host in ("127.0.0.1:%d" % port, "localhost:%d" % port, "[::1]:%d" % port,
                 socket.gethostname(), "kvtier.example:%d" % port, "SCRAPE.local"):
        assert d.http("GET", "/status", headers={"Host": host})[0] == 200, host
    # probes answer under any name (kubelet, load balancers)
    assert d.http("GET", "/healthz", headers={"Host": "evil.example"})[0] == 200
    # framing
    status, body = _raw(d, b"POST /clear HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n"
                           b"Content-Length: 5\r\n\r\nhello")
    assert status == 400 and b"Content-Length" in body, (status, body)
    status, body = _raw(d, b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil\r\n\r\n")
    assert status == 400, (status, body)
    assert d.hits(s, "web", [key(1)]) == 1
    # what is allowed: no body (curl -X POST), the daemon's own page (same origin)
    status, _, body = d.http("POST", "/clear?ns=other")
    assert status == 200, body
    status, _, body = d.http("POST", "/clear?ns=web",
                             headers={"Origin": "http://127.0.0.1:%d" % port})
    assert status == 200 and json.loads(body)["removed"] == 1, body
    assert d.alive()
