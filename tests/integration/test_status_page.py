"""GET /: the status page (daemon/kvt_status_page.html), in a real headless Chromium.

The page is loaded from a live daemon under a little load; the numbers it shows (each element
with data-metric carries the raw number in data-value) are checked against /status, the hit rate
against the pattern the load makes, and a screenshot is kept in build/status-page.png. Chromium
runs with a virtual time budget: the page's 1 s polls run as fast as the daemon answers, so
a minute of page time takes a few real seconds. Chromium is a test dependency (`make deps-ui`);
its absence fails these tests instead of skipping them.
"""

import base64
import hashlib
import html.parser
import http.server
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest

from kvtest import PING, Arena, key, wait_until

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(_HERE))
PAGE_SRC = os.path.join(REPO, "daemon", "kvt_status_page.html")
SCREENSHOT = os.path.join(REPO, "build", "status-page.png")
CSP = ("default-src 'none'; script-src 'sha256-%s'; style-src 'unsafe-inline'; "
       "connect-src 'self'; img-src data:; frame-ancestors 'none'; base-uri 'none'; "
       "form-action 'none'")
CHROMIUM_TIMEOUT = 60       # real seconds one Chromium run may take

STORED = 8                  # objects stored before the load
OBJ_BYTES = 96 * 1024
LOAD_RATE = 300             # LOOKUPs/s of the load, at most: a little load, not a core's worth
SKEW = (12, 5000)           # LOOKUPs x keys missed before the page opens: the lifetime hit rate
                            # stays under 25 % whatever the load does, the last minute's is 50 %


def chromium():
    path = os.environ.get("KVT_CHROMIUM") or shutil.which("chromium")
    if not path:
        pytest.fail("chromium is not installed: the status page test needs Debian's chromium "
                    "(`make deps-ui`, or apt-get install chromium; KVT_CHROMIUM=PATH for another)",
                    pytrace=False)
    return path


def load_page(url, tmp_path, budget_ms, screenshot=None):
    """Loads `url` in headless Chromium for `budget_ms` of virtual time and returns the DOM as
    the page left it; with `screenshot`, also saves a PNG of the 1280x1100 window there."""
    cmd = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu",
           "--disable-dev-shm-usage", "--no-first-run", "--disable-extensions",
           "--hide-scrollbars",
           "--user-data-dir=%s" % (tmp_path / "chromium-profile"), "--window-size=1280,1100",
           "--virtual-time-budget=%d" % budget_ms, "--dump-dom"]
    if screenshot:
        cmd.append("--screenshot=%s" % screenshot)
    cmd.append(url)
    # its own process group, killed whatever happens: no Chromium helper outlives the test
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    try:
        try:
            out, err = p.communicate(timeout=CHROMIUM_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError("chromium did not finish within %d s: %s" % (
                CHROMIUM_TIMEOUT, " ".join(cmd)))
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    assert p.returncode == 0 and b"</html>" in out, "chromium failed (exit %s)\n%s" % (
        p.returncode, err.decode(errors="replace")[-3000:])
    return out.decode("utf-8")


class _Metrics(html.parser.HTMLParser):
    """Every element with data-metric -> {(metric, label): (data-value, text)}."""

    def __init__(self):
        super().__init__()
        self.found = {}
        self._open = []      # [tag, record or None]

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        rec = None
        if "data-metric" in a:
            rec = {"value": a.get("data-value"), "text": ""}
            k = (a["data-metric"], a.get("data-label"))
            self.found.setdefault(k, rec)
        if tag not in ("meta", "link", "br", "input", "img"):
            self._open.append([tag, rec])

    def handle_endtag(self, tag):
        while self._open:
            t, _ = self._open.pop()
            if t == tag:
                break

    def handle_data(self, data):
        for _, rec in self._open:
            if rec is not None:
                rec["text"] += data


def page_metrics(dom):
    p = _Metrics()
    p.feed(dom)
    return {k: (v["value"], " ".join(v["text"].split())) for k, v in p.found.items()}


def num(shown, metric, label=None):
    """The raw number the page holds for `metric` (fails when it shows none)."""
    assert (metric, label) in shown, "the page has no %s%s" % (
        metric, "" if label is None else "{%s}" % label)
    v = shown[(metric, label)][0]
    assert v not in (None, ""), "the page shows no value for %s (text %r)" % (
        metric, shown[(metric, label)][1])
    return float(v)


# ----------------------------------------------------------------------------------------


def test_page_served_with_its_headers_and_nothing_external(shared_daemon):
    d = shared_daemon
    with open(PAGE_SRC, "rb") as f:
        src = f.read()
    status, headers, body = d.http("GET", "/")
    assert status == 200, body[:300]
    assert body == src, "GET / is not daemon/kvt_status_page.html as built (stale build?)"
    assert headers.get("content-type") == "text/html; charset=utf-8", headers
    # the CSP allows the one inline script by its hash, as the browser computes it from the
    # bytes it got (the Chromium tests show that the page runs under it)
    scripts = re.findall(rb"(?is)<script\b[^>]*>(.*?)</script>", body)
    assert len(scripts) == 1, "%d script elements" % len(scripts)
    digest = base64.b64encode(hashlib.sha256(scripts[0]).digest()).decode()
    assert headers.get("content-security-policy") == CSP % digest, headers
    assert headers.get("cache-control") == "no-cache", headers
    assert headers.get("x-content-type-options") == "nosniff", headers
    assert d.http("GET", "/index.html")[2] == src

    status, headers, body = d.http("HEAD", "/")
    assert status == 200 and body == b"", (status, body[:100])
    assert headers.get("content-type") == "text/html; charset=utf-8"
    status, headers, _ = d.http("POST", "/")
    assert status == 405 and headers.get("allow") == "GET, HEAD", (status, headers)
    assert d.http("GET", "/index.htm")[0] == 404

    # self-contained: no URL to anywhere but this daemon, no fetched style, font or script
    text = src.decode("utf-8")
    assert not re.search(r"(?i)\b(?:https?|ftp|wss?):", text), "an absolute URL in the page"
    assert not re.search(r"""["'(=\s]//[A-Za-z0-9.-]""", text), "a protocol-relative URL"
    assert not re.search(r"(?i)@import|@font-face|url\(", text), "CSS that loads something"
    for attr, value in re.findall(r"""(?i)\b(src|href|action|srcset)\s*=\s*["']([^"']*)""",
                                  text):
        assert value.startswith("data:"), "%s=%r in the page" % (attr, value)
    fetched = set(re.findall(r"""\bget\("([^"]+)""", text))
    assert fetched == {"/status", "/metrics"}, fetched


def _store(d, sock, arena):
    ks = [key(i, b"page") for i in range(STORED)]
    d.store(sock, arena, "page", ks, [bytes([i]) * OBJ_BYTES for i in range(STORED)])
    return ks


class Load(threading.Thread):
    """LOOKUPs of [a stored key, a missing key] on their own connection: each answers one hit
    of two keys, so every window of the counters holds a 50 % hit rate, whatever its length.
    A PING every tenth. At most LOAD_RATE LOOKUPs a second (the ASan daemon answers the page
    too, and Chromium needs a core), until the test stops it after Chromium returned; `secs`
    (longer than Chromium may take) only bounds a test that never does."""

    def __init__(self, d, instance, stored, secs=CHROMIUM_TIMEOUT + 60):
        super().__init__(daemon=True)
        self.d, self.instance, self.stored, self.secs = d, instance, stored, secs
        self.stop = threading.Event()
        self.lookups = 0
        self.error = None

    def run(self):
        d = self.d
        try:
            s = d.dealer()
            d.hello(s, self.instance)
            t0 = time.monotonic()
            while not self.stop.is_set() and time.monotonic() < t0 + self.secs:
                i = self.lookups
                pair = [self.stored[i % len(self.stored)], key(10 ** 6 + i, b"miss")]
                r = d.lookup(s, "page", pair)
                assert r["hits"] == 1, r
                self.lookups += 1
                if i % 10 == 0:
                    d.ok(s, PING, {})
                ahead = t0 + self.lookups / LOAD_RATE - time.monotonic()
                if ahead > 0:
                    self.stop.wait(ahead)
        except BaseException as e:       # reported by the test, not lost in the thread
            self.error = e

    def finish(self):
        self.stop.set()
        self.join(10)
        assert not self.is_alive(), "the load thread did not stop"
        if self.error:
            raise self.error


def test_page_shows_what_status_says_under_load(daemon_factory, tmp_path):
    # a long lease_ms: page-test holds its lease and says nothing while Chromium runs, which on
    # busy cores can take longer than the default 30 s
    d = daemon_factory("--lease-ms", "600000")
    s = d.dealer()
    h = d.hello(s, "page-test")
    with Arena(h["shm"]) as arena:
        ks = _store(d, s, arena)
        lease = d.acquire(s, "page", ks[:2])["lease"]      # one read lease held throughout
        assert lease
        for j in range(SKEW[0]):
            assert d.hits(s, "page", [key(j * SKEW[1] + i, b"skew") for i in range(SKEW[1])]) == 0
        # the stored objects reach L2 (write-behind) before the page looks: queue depth 0
        wait_until(lambda: all(a["queue_depth"] == 0 and a["objects"] >= STORED
                               for a in d.http_json("GET", "/status")["l2"]),
                   timeout=10, what="L2 write-behind of the stored objects")

        load = Load(d, "page-load", ks)
        load.start()
        try:
            wait_until(lambda: load.lookups >= 50 or load.error, timeout=10,
                       what="the load to start")
            os.makedirs(os.path.dirname(SCREENSHOT), exist_ok=True)
            if os.path.exists(SCREENSHOT):
                os.unlink(SCREENSHOT)
            t0 = time.monotonic()
            dom = load_page("http://%s/" % d.http_addr, tmp_path, 75000, screenshot=SCREENSHOT)
            took = time.monotonic() - t0
        finally:
            ran_through = load.is_alive()
            load.finish()
        assert ran_through, "the load stopped before Chromium returned: the page's last rates " \
            "may be an idle daemon's"
        st = d.http_json("GET", "/status")
        shown = page_metrics(dom)

        # the page polled for its whole virtual minute, through the load
        assert shown[("daemon_state", None)][0] == "ok", shown.get(("daemon_state", None))
        print("chromium: %.1f s, %d LOOKUPs" % (took, load.lookups))
        assert num(shown, "polls") >= 30, "only %s polls in %.1f s" % (
            shown[("polls", None)], took)

        # stable by construction: nothing stored, removed or leased while the page looked
        l1 = st["l1"]
        assert num(shown, "l1_used_bytes") == l1["used"] > 0
        assert num(shown, "l1_capacity_bytes") == l1["capacity"] == 64 << 20
        assert num(shown, "l1_objects") == l1["objects"] == STORED
        assert num(shown, "leases_active") == l1["leases_active"] == 1
        assert num(shown, "clients_connected") == st["metrics"]["clients_connected"] == 2
        assert num(shown, "clients_total") == st["clients_total"] == 2
        assert num(shown, "l1_evictions_total") == l1["evictions"] == 0
        assert num(shown, "ready") == 1 and st["ready"] is True
        assert num(shown, "gpu_registrations") == len(st["gpu"]["registrations"]) == 0
        assert shown[("gpu_runtime", None)][0] == st["gpu"]["runtime"]
        names = {k[1] for k in shown if k[0] == "l2_queue_depth"}
        assert names == {a["adapter"] for a in st["l2"]} and names, names
        for a in st["l2"]:
            assert num(shown, "l2_queue_depth", a["adapter"]) == a["queue_depth"] == 0
            assert num(shown, "l2_healthy", a["adapter"]) == (1 if a["healthy"] else 0)
        assert "MiB" in shown[("l1_capacity_bytes", None)][1], shown[("l1_capacity_bytes", None)]

        # the hit rate is the last minute's (1 hit of 2 keys each), not the lifetime's (~0 %)
        hit = num(shown, "hit_rate")
        assert abs(hit - 0.5) < 0.01, "hit rate %s (%s)" % (hit, shown[("hit_rate", None)])
        assert shown[("hit_rate", None)][1] in ("49.9 %", "50.0 %", "50.1 %"), \
            shown[("hit_rate", None)]
        assert abs(num(shown, "hit_rate_l1") - 0.5) < 0.01
        assert num(shown, "hit_rate_l2") == 0
        assert num(shown, "lookup_keys_1m") >= 2 * 30
        m = st["metrics"]
        lifetime = (m["lookup_hit_keys_total"]["l1"] + m["lookup_hit_keys_total"]["l2"]) \
            / m["lookup_keys_total"]
        assert lifetime < 0.25, "the skew did not skew: %s" % lifetime

        # requests by type from the counters' deltas, latency from /metrics' histogram
        assert num(shown, "requests_per_s", "lookup") > 0
        assert num(shown, "requests_per_s", "ping") > 0
        assert num(shown, "requests_per_s_total") >= num(shown, "requests_per_s", "lookup")
        assert num(shown, "requests_total", "lookup") <= m["requests_total"]["lookup"]
        p50, p99 = num(shown, "latency_p50_seconds", "lookup"), \
            num(shown, "latency_p99_seconds", "lookup")
        assert 0 < p50 <= p99 < 5, (p50, p99)
        assert num(shown, "errors_per_s") == 0
        d.release(s, lease)

    with open(SCREENSHOT, "rb") as f:
        png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "the screenshot is not a PNG"
    assert len(png) > 30000, "the screenshot is suspiciously small (%d bytes)" % len(png)
    w, h = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (w, h) == (1280, 1100), (w, h)


def test_page_says_not_ready_and_why(daemon_factory, tmp_path):
    """A daemon whose supervisor thread died stays not ready: the page says so with /status's
    reason and names the thread at fault."""
    d = daemon_factory("--l2", "none", "--debug-fault-thread", "supervisor",
                       "--debug-fault-mode", "exit", "--debug-fault-after-ms", "100")
    wait_until(lambda: d.http("GET", "/readyz")[0] == 503, timeout=5,
               what="/readyz 503 after the supervisor thread exits")
    dom = load_page("http://%s/" % d.http_addr, tmp_path, 3000)
    shown = page_metrics(dom)
    st = d.http_json("GET", "/status")
    assert st["ready"] is False
    assert num(shown, "ready") == 0
    reason = shown[("not_ready_reason", None)][0]
    assert reason == st["not_ready_reason"] and "supervisor" in reason, (reason, st)
    assert 'class="bad"' in dom and "Not ready" in dom
    assert num(shown, "threads_at_fault") >= 1
    assert "no L2 tier configured" in dom



class _PassThrough(http.server.ThreadingHTTPServer):
    """Forwards GETs to the daemon, and stops the daemon (SIGTERM) when the page asks for
    /status the (stop_after + 1)th time: from then on a request is answered by closing the
    connection, as a refused one looks to the page (fetch fails). The page cannot be
    loaded from one origin and poll another (its CSP says connect-src 'self'), hence the proxy
    rather than stopping the daemon at some real time during Chromium's virtual one."""

    daemon_threads = True

    def __init__(self, d, stop_after):
        self.d, self.stop_after, self.status_polls = d, stop_after, 0
        self.stop_rc = None     # the daemon's exit status, checked by the test
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Forward)


class _Forward(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        srv = self.server
        with srv.lock:
            if self.path == "/status":
                srv.status_polls += 1
                if srv.status_polls > srv.stop_after and srv.d.alive():
                    srv.stop_rc = srv.d.stop(signal.SIGTERM, timeout=10)
        try:
            status, headers, body = srv.d.http("GET", self.path, timeout=3)
        except OSError:
            self.close_connection = True
            return
        self.send_response(status)
        for k in ("content-type", "content-security-policy", "cache-control"):
            if k in headers:
                self.send_header(k, headers[k])
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_page_says_unreachable_when_the_daemon_stops(daemon, tmp_path):
    """The daemon stops while the page is open: the page says "unreachable" with the time of
    its last good poll and greys the numbers out, instead of showing them as current."""
    proxy = _PassThrough(daemon, stop_after=3)
    t = threading.Thread(target=proxy.serve_forever, daemon=True)
    t.start()
    try:
        dom = load_page("http://127.0.0.1:%d/" % proxy.server_address[1], tmp_path, 8000)
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert proxy.stop_rc == 0, "the daemon exited with %r on SIGTERM" % (proxy.stop_rc,)
    assert not daemon.alive() and proxy.status_polls > 4, proxy.status_polls
    shown = page_metrics(dom)
    assert shown[("daemon_state", None)][0] == "unreachable", shown[("daemon_state", None)]
    assert num(shown, "polls") == 3
    clock = shown[("last_good_poll", None)][1]
    assert re.fullmatch(r"\d\d:\d\d:\d\d", clock), clock
    assert "Daemon unreachable" in dom and "last good poll at %s" % clock in dom
    assert "network error" in dom, "the banner does not say why"
    assert '<body class="stale">' in dom
    # what it showed last is still there, marked stale, not blanked or zeroed
    assert num(shown, "l1_capacity_bytes") == 64 << 20


class _Inside(html.parser.HTMLParser):
    """The start tags and the text inside the element with id=`ident`."""

    def __init__(self, ident):
        super().__init__()
        self.ident, self.depth, self.tags, self.text = ident, 0, [], ""

    def handle_starttag(self, tag, attrs):
        if self.depth:
            self.tags.append(tag)
            if tag not in ("meta", "link", "br", "input", "img", "hr", "wbr"):
                self.depth += 1
        elif dict(attrs).get("id") == self.ident:
            self.depth = 1

    def handle_endtag(self, tag):
        if self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.text += data


def test_page_shows_hostile_names_as_text(daemon, tmp_path):
    """A client's instance and client name are whatever it said in HELLO: the clients table
    shows them as text; no markup in them becomes an element or runs."""
    d = daemon
    instance = "<img src=x onerror=document.title='pwn'>"
    name = '"><svg onload=alert(1)>'
    s = d.dealer()
    d.hello(s, instance, client=name)
    st = d.http_json("GET", "/status")
    assert [(c["instance"], c["client"]) for c in st["clients"]] == [(instance, name)], \
        st["clients"]
    dom = load_page("http://%s/" % d.http_addr, tmp_path, 3000)
    shown = page_metrics(dom)
    assert shown[("daemon_state", None)][0] == "ok", shown.get(("daemon_state", None))
    inside = _Inside("t-clients")
    inside.feed(dom)
    assert "table" in inside.tags, inside.tags
    assert instance in inside.text and name in inside.text, inside.text
    assert not {"img", "svg", "script"} & set(inside.tags), inside.tags
    assert not re.search(r"(?i)<(img|svg)\b", dom), "an img or svg element in the page"
    assert re.search(r"<title>kvtier status</title>", dom), re.findall(r"<title>.*?</title>", dom)
