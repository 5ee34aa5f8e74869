"""The HTTP endpoints of the real daemon: /healthz, /readyz, /metrics, /status, /clear."""

import json
import os
import socket
import subprocess
import sys
import threading

from kvtest import HELLO, STATS, Arena, key, metric_value, parse_size, wait_until

REQ = "kvtier_requests_total"
ERR = "kvtier_request_errors_total"
DUR = "kvtier_request_duration_seconds"


def test_healthz(shared_daemon):
    status, _, _ = shared_daemon.http("GET", "/healthz")
    assert status == 200


def test_readyz_when_healthy(shared_daemon):
    status, _, body = shared_daemon.http("GET", "/readyz")
    assert status == 200, body


def test_unknown_path_404(shared_daemon):
    for path in ("/nope", "/metrics/extra", "/healthzz", "/index", "//"):
        status, _, _ = shared_daemon.http("GET", path)
        assert status == 404, path


def test_clear(shared_daemon):
    d = shared_daemon
    status, headers, body = d.http("POST", "/clear")
    assert status == 200, body
    assert headers.get("content-type", "").startswith("application/json"), headers
    doc = json.loads(body)
    assert isinstance(doc["removed"], int) and not isinstance(doc["removed"], bool)
    assert doc["removed"] >= 0
    status, headers, _ = d.http("GET", "/clear")
    assert status == 405 and headers.get("allow") == "POST", (status, headers)
    for path in ("/healthz", "/readyz", "/metrics", "/status"):
        status, headers, _ = d.http("POST", path)
        assert status == 405 and headers.get("allow") == "GET, HEAD", (path, status, headers)


def test_metrics_format(shared_daemon):
    d = shared_daemon
    s = d.dealer()
    d.ping(s)
    assert d.call(s, HELLO, {"version": 1, "client": "pytest"})["ok"] is False  # bad_request
    status, headers, body = d.http("GET", "/metrics")
    assert status == 200
    ctype = headers.get("content-type", "")
    assert ctype.startswith("text/plain") and "version=0.0.4" in ctype, ctype
    text = body.decode("utf-8")
    assert "# HELP kvtier_requests_total" in text
    assert "# TYPE kvtier_requests_total counter" in text
    families, samples = d.metrics()   # strict parse: every sample has HELP and TYPE before it
    for name in families:
        assert name.startswith("kvtier_"), "metric family without kvtier_ prefix: %s" % name
        assert "help" in families[name] and "type" in families[name], name
    assert families[REQ]["type"] == "counter"
    assert families[ERR]["type"] == "counter"
    assert families[DUR]["type"] == "histogram"
    assert families["kvtier_clients_connected"]["type"] == "gauge"
    assert metric_value(samples, REQ, type="ping") >= 1
    assert metric_value(samples, ERR, code="bad_request") >= 1
    assert metric_value(samples, "kvtier_clients_connected") is not None
    assert metric_value(samples, DUR + "_bucket", type="ping", le="+Inf") >= 1
    assert metric_value(samples, DUR + "_count", type="ping") >= 1
    assert metric_value(samples, DUR + "_sum", type="ping") >= 0
    for smp in samples:
        assert smp.value >= 0 or smp.value != smp.value, smp   # no negative counters/gauges


def test_metrics_histogram_consistent(shared_daemon):
    d = shared_daemon
    s = d.dealer()
    for _ in range(5):
        d.ping(s)
    _, samples = d.metrics()
    buckets = [(float(x.labels["le"]), x.value) for x in samples
               if x.name == DUR + "_bucket" and x.labels.get("type") == "ping"]
    assert len(buckets) >= 2, "ping histogram needs finite buckets and +Inf"
    les = [le for le, _ in buckets]
    assert les == sorted(les) and les[-1] == float("inf"), les
    counts = [c for _, c in buckets]
    assert counts == sorted(counts), "bucket counts are not cumulative: %r" % buckets
    assert counts[-1] == metric_value(samples, DUR + "_count", type="ping")


def test_a_request_is_counted_before_its_reply(daemon):
    """A client that holds its reply finds its request in /metrics (the count and the duration
    histogram), through the socket and through a fast-path ring: the daemon counts it before
    the reply leaves, so nothing has to wait for the counters to catch up."""
    import kvtier
    d = daemon
    s = d.dealer()
    # no heartbeat: its PINGs would be counted too
    c = kvtier.Client(d.ipc, client="count-test", context=d.ctx, heartbeat_ms=0)
    # busy CPUs, so that the daemon's thread is often preempted between a reply and its count
    # (where a daemon that counted after replying was caught)
    hogs = []
    try:
        for _ in range(min(2 * len(os.sched_getaffinity(0)), 16)):
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        for type_, call in (("ping", lambda: d.ping(s)),
                            ("lookup", lambda: c.lookup("count", [key(1)]))):
            _, samples = d.metrics()
            n = metric_value(samples, REQ, type=type_) or 0
            for i in range(1, 301):
                call()
                _, samples = d.metrics()
                assert (metric_value(samples, REQ, type=type_),
                        metric_value(samples, DUR + "_count", type=type_)) == (n + i, n + i), \
                    "%s %d: not counted by the time its reply arrived" % (type_, i)
        if c.fastpath:                     # the LOOKUPs above went through the ring
            assert d.http_json("GET", "/status")["fastpath"]["requests"] >= 300
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        c.close()


def test_metrics_requests_total_increases(shared_daemon):
    d = shared_daemon
    s = d.dealer()
    d.ping(s)
    _, samples = d.metrics()
    before = metric_value(samples, REQ, type="ping")
    count_before = metric_value(samples, DUR + "_count", type="ping")
    for _ in range(7):
        d.ping(s)

    def grown():
        _, smp = d.metrics()
        return (metric_value(smp, REQ, type="ping") >= before + 7
                and metric_value(smp, DUR + "_count", type="ping") >= count_before + 7)
    wait_until(grown, timeout=2.0, what="kvtier_requests_total{type=\"ping\"} to grow by 7")


def test_metrics_match_stats(daemon):
    d = daemon
    s = d.dealer()
    for _ in range(9):
        d.ping(s)
    stats = d.ok(s, STATS, {})
    _, samples = d.metrics()
    assert metric_value(samples, REQ, type="ping") == stats["requests_total"]["ping"] == 9
    assert metric_value(samples, "kvtier_clients_connected") == stats["clients_connected"] == 0


def test_metrics_lookup_hit_keys(daemon):
    """The hit-rate counters: keys asked in LOOKUPs, and the cached prefix of them by tier; a
    miss after the prefix does not count the keys behind it, and /status shows the same."""
    d = daemon
    s = d.dealer()
    h = d.hello(s, "inst-hits")
    ks = [key(i, b"hit") for i in range(5)]
    with Arena(h["shm"]) as arena:
        d.store(s, arena, "hits", ks[:3], [b"x" * 100] * 3)
        assert d.lookup(s, "hits", ks)["hits"] == 3            # 5 asked, 3 hit
        assert d.lookup(s, "hits", [ks[4], ks[0]])["hits"] == 0  # a miss first: no prefix
        _, smp = d.metrics()
        assert metric_value(smp, "kvtier_lookup_keys_total") == 7
        assert metric_value(smp, "kvtier_lookup_hit_keys_total", tier="l1") == 3
        assert metric_value(smp, "kvtier_lookup_hit_keys_total", tier="l2") == 0
        m = d.http_json("GET", "/status")["metrics"]
        assert m["lookup_keys_total"] == 7
        assert m["lookup_hit_keys_total"] == {"l1": 3, "l2": 0}


def test_metrics_clients_connected(daemon):
    d = daemon
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_clients_connected") == 0
    d.hello(d.dealer(), "inst-metrics")
    wait_until(lambda: metric_value(d.metrics()[1], "kvtier_clients_connected") == 1,
               timeout=2.0, what="kvtier_clients_connected == 1")


def test_status(shared_daemon):
    d = shared_daemon
    status, headers, body = d.http("GET", "/status")
    assert status == 200
    assert headers.get("content-type", "").startswith("application/json"), headers
    doc = json.loads(body)
    assert isinstance(doc, dict)
    for k in ("version", "uptime_seconds", "ready", "threads", "clients", "config"):
        assert k in doc, "/status lacks %r: %s" % (k, sorted(doc))
    assert isinstance(doc["version"], str) and doc["version"]
    assert isinstance(doc["uptime_seconds"], (int, float)) and doc["uptime_seconds"] >= 0
    assert doc["ready"] is True
    assert isinstance(doc["clients"], list)
    assert isinstance(doc["threads"], list)
    names = set()
    for t in doc["threads"]:
        assert isinstance(t, dict) and isinstance(t.get("name"), str), t
        assert isinstance(t.get("alive"), bool), t
        names.add(t["name"])
        assert t["alive"] is True, "thread %s not alive in a healthy daemon: %r" % (t["name"], t)
    assert {"server", "http", "supervisor"} <= names, names
    cfg = doc["config"]
    assert isinstance(cfg, dict)
    assert "l1_size" in cfg, sorted(cfg)
    assert parse_size(cfg["l1_size"]) == 64 << 20


def test_status_lists_clients(daemon):
    d = daemon
    assert d.http_json("GET", "/status")["clients"] == []
    d.hello(d.dealer(), "inst-XYZ")
    doc = d.http_json("GET", "/status")
    assert len(doc["clients"]) == 1, doc["clients"]
    assert "inst-XYZ" in json.dumps(doc["clients"])


def test_parallel_http(shared_daemon):
    d = shared_daemon
    results = []
    lock = threading.Lock()

    def worker():
        for path in ("/metrics", "/status", "/healthz", "/readyz"):
            st = d.http("GET", path)[0]
            with lock:
                results.append((path, st))

    threads = [threading.Thread(target=worker) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "HTTP requests hung"
    assert len(results) == 48 and all(st == 200 for _, st in results), results


def test_garbage_http_request(shared_daemon):
    """Junk and half-sent requests on open connections neither crash the daemon nor block
    other HTTP clients."""
    d = shared_daemon
    junk = (b"GARBAGE\r\n\r\n", b"GET /" + b"a" * 100000 + b" HTTP/1.1\r\n\r\n",
            b"\x00\xff" * 1000, b"POST /clear HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\n")
    conns = []
    try:
        for j in junk:
            c = socket.create_connection(("127.0.0.1", d.http_port), timeout=2)
            conns.append(c)
            try:
                c.sendall(j)
            except OSError:
                pass            # a reset is a fine answer to junk
        for _ in range(3):
            assert d.http("GET", "/healthz", timeout=2)[0] == 200
    finally:
        for c in conns:
            c.close()
    assert d.http("GET", "/healthz")[0] == 200
    d.ping(d.dealer())
    assert d.alive()
