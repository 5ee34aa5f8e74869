"""The L2 tier against the real daemon: write-behind of every committed object to each adapter,
LOOKUP across tiers, prefetch from L2 into L1, REMOVE in every tier, health (/readyz, /status,
kvtier_l2_* metrics), events, restart, and the adapters themselves — fs (the default), a real
redis-server shared by two daemons, the failure-injecting mock, and the example plugin.

Write-behind runs on the adapters' own threads, so every check of what reached L2 polls (with a
bound) instead of sleeping; and since an object cannot be evicted from L1 before its L2 write,
writers that fill L1 retry partial reservations and `no_space` (backpressure)."""

import os
import signal
import time
import uuid

import pytest
import zmq

from kvtest import (GET, LOOKUP, PREFETCH_STATUS, PUT, MiB, Arena, assert_error, error_code,
                    key, metric_value, pack, payload, run_kvtierd, unpack, wait_until)

NS = "l2-test/kv-v1"
PLUGIN_ENV = "KVT_L2_EXAMPLE_PLUGIN"
TRAILER = 40    # bytes of the integrity trailer stored after each object (test_l2_integrity.py)
L2_FAMILIES = {
    "kvtier_l2_stored_total": "counter", "kvtier_l2_stored_bytes_total": "counter",
    "kvtier_l2_loaded_total": "counter", "kvtier_l2_loaded_bytes_total": "counter",
    "kvtier_l2_removed_total": "counter", "kvtier_l2_errors_total": "counter",
    "kvtier_l2_dropped_total": "counter", "kvtier_l2_corrupt_total": "counter",
    "kvtier_l2_queue_depth": "gauge",
    "kvtier_l2_up": "gauge", "kvtier_l2_bytes": "gauge",
    "kvtier_l2_operation_duration_seconds": "histogram",
    "kvtier_l2_flushes_total": "counter",
    "kvtier_l1_l2_pending_objects": "gauge", "kvtier_l1_l2_pending_bytes": "gauge",
    "kvtier_l1_l2_skipped_total": "counter", "kvtier_l1_l2_skipped_bytes_total": "counter",
}


def keys_of(tag, n, start=0):
    return [key(start + i, tag) for i in range(n)]


def data_of(k, size):
    """The bytes stored under key k: pseudo-random, different for every key."""
    return payload(k, size)


@pytest.fixture
def client():
    """client(daemon, instance) -> (socket that said HELLO, mapped Arena); the arenas are
    unmapped at teardown."""
    arenas = []

    def _connect(d, instance):
        s = d.dealer()
        h = d.hello(s, instance)
        a = Arena(h["shm"])
        arenas.append(a)
        return s, a

    yield _connect
    for a in arenas:
        a.close()


# ----------------------------------------------------------------------------------------
# Helpers


def l2_samples(d, name, adapter=None):
    """Samples of metric `name` (kvtier_l2_*) whose adapter label starts with `adapter`."""
    _, samples = d.metrics()
    return [s for s in samples if s.name == name
            and (adapter is None or s.labels.get("adapter", "").startswith(adapter))]


def l2_value(d, name, adapter=None):
    """The value of kvtier_l2_* `name` for the one adapter whose label starts with `adapter`."""
    found = l2_samples(d, name, adapter)
    assert len(found) == 1, "%d samples of %s for adapter %r: %r" % (len(found), name, adapter,
                                                                     found)
    return found[0].value


def ready_metrics(d):
    """kvtier_ready and {thread: kvtier_thread_up} from one /metrics."""
    _, samples = d.metrics()
    ready = [x.value for x in samples if x.name == "kvtier_ready"]
    assert len(ready) == 1, ready
    return ready[0], {x.labels["thread"]: x.value for x in samples
                      if x.name == "kvtier_thread_up"}


def l2_status(d, adapter=None):
    """The /status "l2" entry of the one adapter whose label starts with `adapter`."""
    entries = d.http_json("GET", "/status")["l2"]
    found = [e for e in entries if adapter is None or e["adapter"].startswith(adapter)]
    assert len(found) == 1, "%d /status l2 entries for %r: %r" % (len(found), adapter, entries)
    return found[0]


def l2_idle(d):
    """True when no write-behind is queued or running: nothing waits in any adapter's queue and
    no L1 object waits for its L2 write."""
    _, samples = d.metrics()
    pending = metric_value(samples, "kvtier_l1_l2_pending_objects")
    depth = sum(s.value for s in samples if s.name == "kvtier_l2_queue_depth")
    return pending == 0 and depth == 0


def wait_l2_idle(d, timeout=30.0):
    wait_until(lambda: l2_idle(d), timeout, interval=0.05, what="write-behind to finish")


def readyz(d):
    status, _, body = d.http("GET", "/readyz")
    return status, body.decode("utf-8", "replace")


def store_all(d, s, arena, ns, keys, datas, batch=8, timeout=60.0):
    """RESERVE / write / COMMIT every key, batch by batch. A partial reservation or no_space is
    backpressure (objects not yet written to L2 cannot be evicted): what was reserved is
    committed and the rest retried after a short sleep, within `timeout`. Returns how many
    retries there were."""
    deadline = time.monotonic() + timeout
    i = retries = 0
    while i < len(keys):
        assert time.monotonic() < deadline, \
            "stored only %d of %d objects within %.0f s" % (i, len(keys), timeout)
        ks, ds = keys[i:i + batch], datas[i:i + batch]
        r = d.reserve(s, ns, ks, sizes=[len(x) for x in ds], check=False)
        if not r["ok"]:
            assert error_code(r) == "no_space", r
            retries += 1
            time.sleep(0.02)
            continue
        slots = r["slots"]
        assert None not in slots, "RESERVE of new keys found some stored: %r" % slots
        for sl, data in zip(slots, ds):
            assert sl["length"] == len(data), (sl, len(data))
            arena.write(sl["offset"], data)
        if slots:
            assert d.commit(s, r["lease"])["stored"] == len(slots)
        if len(slots) < len(ks):
            retries += 1
            time.sleep(0.02)
        i += len(slots)
    return retries


def put_all(d, s, ns, keys, datas, batch=4, timeout=60.0):
    """Inline PUT of every key, batch by batch, retrying the part that did not fit (see
    store_all). Returns how many retries there were."""
    deadline = time.monotonic() + timeout
    i = retries = 0
    while i < len(keys):
        assert time.monotonic() < deadline, \
            "PUT only %d of %d objects within %.0f s" % (i, len(keys), timeout)
        b = d.call(s, PUT, {"ns": ns, "keys": keys[i:i + batch]}, *datas[i:i + batch])
        if not b["ok"]:
            assert error_code(b) in ("no_space", "busy"), b
            retries += 1
            time.sleep(0.02)
            continue
        if b["stored"] < len(keys[i:i + batch]):
            retries += 1
            time.sleep(0.02)
        i += b["stored"]
    return retries


def get(d, s, ns, keys):
    """GET -> the data frames of the leading keys found (as bytes)."""
    rep = d.request(s, d.next_uid(), GET, {"ns": ns, "keys": list(keys)})
    assert rep.body["ok"] is True, rep.body
    assert rep.body["found"] == len(rep.data), rep.body
    return [bytes(f) for f in rep.data]


def prefetch(d, s, ns, keys, timeout=20.0):
    """LOOKUP with prefetch, then PREFETCH_STATUS until done. Returns (lookup, final status)."""
    lk = d.lookup(s, ns, keys, prefetch=True)
    assert lk.get("job"), "LOOKUP with prefetch gave no job: %r" % lk

    def done():
        st = d.ok(s, PREFETCH_STATUS, {"job": lk["job"]})
        return st if st["done"] else None

    st = wait_until(done, timeout, interval=0.02, what="prefetch job %d to finish" % lk["job"])
    assert st["hits"] == lk["hits"], (lk, st)
    return lk, st


def check_served(got, keys, expected, what):
    """Every object served (a leading prefix of keys) holds exactly the bytes stored."""
    assert len(got) <= len(keys)
    for i, data in enumerate(got):
        assert data == expected[keys[i]], \
            "%s: key %d of %d served %d bytes that are not what was stored (%d bytes)" \
            % (what, i, len(keys), len(data), len(expected[keys[i]]))


# ----------------------------------------------------------------------------------------
# Redis: a cache shared by two nodes, and an outage


def test_two_daemons_share_a_prefix_through_redis(redis_factory, daemon_factory, client):
    r = redis_factory()
    spec = "redis:" + r.addr
    a = daemon_factory("--l2", spec)
    b = daemon_factory("--l2", spec)
    sa, arena_a = client(a, "node-a")
    ks = keys_of(b"share", 8)
    datas = [data_of(k, 256 * 1024 + 1000 * i + 7) for i, k in enumerate(ks)]  # odd sizes
    a.store(sa, arena_a, NS, ks, datas)

    wait_until(lambda: l2_value(a, "kvtier_l2_stored_total", spec) == 8, 10,
               what="A's 8 objects written to redis")
    assert l2_value(a, "kvtier_l2_stored_bytes_total", spec) == sum(map(len, datas))
    assert l2_value(a, "kvtier_l2_errors_total", spec) == 0
    assert len(r.keys("kvtier:*")) == 8, r.keys()

    # B never saw these keys: LOOKUP finds them in L2 only
    sb, arena_b = client(b, "node-b")
    lk = b.lookup(sb, NS, ks)
    assert (lk["hits"], lk["l1"]) == (8, 0), lk
    assert b.lookup(sb, NS, ks, salt="other-tenant")["hits"] == 0
    lk, st = prefetch(b, sb, NS, ks)
    assert (lk["hits"], lk["l1"]) == (8, 0), lk
    assert st["loaded"] == 8, st
    assert b.lookup(sb, NS, ks)["l1"] == 8

    assert get(b, sb, NS, ks) == datas
    assert b.fetch(sb, arena_b, NS, ks) == datas
    assert l2_value(b, "kvtier_l2_loaded_total", spec) == 8
    assert l2_value(b, "kvtier_l2_loaded_bytes_total", spec) == sum(map(len, datas))
    # what B loaded is in L2 already: it is not written back
    time.sleep(0.3)
    assert l2_value(b, "kvtier_l2_stored_total", spec) == 0
    st = l2_status(b, spec)
    assert (st["kind"], st["healthy"], st["loaded"], st["stored"]) == ("redis", True, 8, 0), st


def test_redis_outage_l1_keeps_serving_readyz_follows(redis_factory, daemon_factory, client):
    r = redis_factory()
    spec = "redis:" + r.addr
    d = daemon_factory("--l2", spec)
    s, arena = client(d, "outage")
    assert readyz(d)[0] == 200
    assert l2_value(d, "kvtier_l2_up", spec) == 1
    assert ready_metrics(d)[0] == 1

    before = keys_of(b"before", 4)
    expected = {k: data_of(k, 64 * 1024) for k in before}
    d.store(s, arena, NS, before, [expected[k] for k in before])
    wait_until(lambda: l2_value(d, "kvtier_l2_stored_total", spec) == 4, 10,
               what="4 objects written to redis")

    r.kill()
    t0 = time.monotonic()
    # L1 keeps serving: store and read, LOOKUP of what L1 holds
    during = keys_of(b"during", 4)
    expected.update({k: data_of(k, 64 * 1024) for k in during})
    d.store(s, arena, NS, during, [expected[k] for k in during])
    assert d.fetch(s, arena, NS, before + during) == [expected[k] for k in before + during]
    assert get(d, s, NS, before + during) == [expected[k] for k in before + during]
    lk = d.lookup(s, NS, before + during)
    assert (lk["hits"], lk["l1"]) == (8, 8), lk

    status, body = wait_until(lambda: (lambda st: st if st[0] == 503 else None)(readyz(d)),
                              3.5, interval=0.05, what="/readyz 503 after redis died")
    assert "l2 " + spec in body, "/readyz does not name the adapter: %r" % body
    assert time.monotonic() - t0 < 3.5
    assert l2_value(d, "kvtier_l2_up", spec) == 0
    # kvtier_ready says what /readyz says (one check behind both), while every thread is up
    ready, threads = ready_metrics(d)
    assert ready == 0 and readyz(d)[0] == 503, (ready, readyz(d))
    assert threads and all(v == 1 for v in threads.values()), threads
    st = l2_status(d, spec)
    assert st["healthy"] is False and st["last_error"], st
    # the writes it could not do are counted, and nothing waits in L1 for a dead backend
    wait_until(lambda: l2_value(d, "kvtier_l2_errors_total", spec) >= 4, 5,
               what="failed write-behind counted in kvtier_l2_errors_total")
    wait_l2_idle(d, 10)
    assert d.fetch(s, arena, NS, during) == [expected[k] for k in during]

    r.start()                        # same port, empty (no persistence)
    wait_until(lambda: readyz(d)[0] == 200, 10, interval=0.1,
               what="/readyz 200 after redis came back")
    assert l2_value(d, "kvtier_l2_up", spec) == 1
    assert ready_metrics(d)[0] == 1
    assert l2_status(d, spec)["healthy"] is True
    after = keys_of(b"after", 4)
    d.store(s, arena, NS, after, [data_of(k, 64 * 1024) for k in after])
    wait_until(lambda: l2_value(d, "kvtier_l2_stored_total", spec) == 8, 10,
               what="writes reaching redis again")
    # what was written before the outage died with redis; what was stored during it never
    # reached L2; what was stored after it is there
    assert len(r.keys("kvtier:*")) == 4, r.keys()


def test_redis_password_is_masked(redis_factory, daemon_factory, client):
    secret = "s3cret-" + uuid.uuid4().hex[:8]
    r = redis_factory(password=secret)
    spec = "redis:%s,prefix=kvt-pw:,password=%s,timeout_ms=500" % (r.addr, secret)
    shown = "redis:%s,prefix=kvt-pw:,password=***,timeout_ms=500" % r.addr
    d = daemon_factory("--l2", spec)
    s, arena = client(d, "pw")
    ks = keys_of(b"pw", 2)
    d.store(s, arena, NS, ks, [data_of(k, 8192) for k in ks])
    wait_until(lambda: l2_value(d, "kvtier_l2_stored_total", shown) == 2, 10,
               what="2 objects written through AUTH")
    assert len(r.keys("kvt-pw:*")) == 2
    assert l2_status(d, shown)["adapter"] == shown
    _, _, metrics = d.http("GET", "/metrics")
    _, _, status = d.http("GET", "/status")
    for where, text in (("/metrics", metrics.decode()), ("/status", status.decode()),
                        ("stderr", d.stderr_text())):
        assert secret not in text, "the redis password shows in %s" % where
    assert "password=***" in metrics.decode()


# ----------------------------------------------------------------------------------------
# fs: restart, and a working set four times L1


def test_fs_l2_survives_a_restart(daemon_factory, client, tmp_path):
    data_dir = str(tmp_path / "data")           # the default L2 is fs:DATA_DIR/l2
    d = daemon_factory("--data-dir", data_dir)
    s, _ = client(d, "before-restart")
    ks = keys_of(b"restart", 24)
    expected = {k: data_of(k, 100 * 1024 + 777 * i) for i, k in enumerate(ks)}
    assert put_all(d, s, NS, ks, [expected[k] for k in ks], batch=24) == 0
    # no waiting for write-behind: SIGTERM writes what is queued before the daemon exits
    assert d.stop(signal.SIGTERM) == 0
    assert "not done at stop" not in d.stderr_text()

    d2 = daemon_factory("--data-dir", data_dir)
    st = l2_status(d2, "fs:")
    assert (st["objects"], st["bytes"]) == \
        (24, sum(map(len, expected.values())) + 24 * TRAILER), st
    assert l2_value(d2, "kvtier_l2_bytes", "fs:") == st["bytes"]
    s2, arena2 = client(d2, "after-restart")
    lk = d2.lookup(s2, NS, ks)
    assert (lk["hits"], lk["l1"]) == (24, 0), lk
    # the hit-rate counters name the tier that held the keys
    smp = d2.metrics()[1]
    assert metric_value(smp, "kvtier_lookup_keys_total") == 24
    assert metric_value(smp, "kvtier_lookup_hit_keys_total", tier="l2") == 24
    assert metric_value(smp, "kvtier_lookup_hit_keys_total", tier="l1") == 0
    lk, pst = prefetch(d2, s2, NS, ks)
    assert pst["loaded"] == 24, pst
    assert get(d2, s2, NS, ks) == [expected[k] for k in ks]
    assert d2.fetch(s2, arena2, NS, ks[:5]) == [expected[k] for k in ks[:5]]


def test_four_times_l1_stays_reachable_through_fs(daemon_factory, client):
    # --l1-size 64M, default fs L2; every object must reach L2: none may be evicted unwritten
    d = daemon_factory("--l2-backlog-max", "1")
    s, arena = client(d, "flood")
    n = 256
    ks = keys_of(b"flood", n)
    t0 = time.monotonic()
    retries = 0
    for b in range(0, n, 32):     # 32 MiB at a time: the payloads are made as they are needed
        part = ks[b:b + 32]
        retries += store_all(d, s, arena, NS, part, [data_of(k, MiB) for k in part],
                             timeout=max(5.0, 60.0 - (time.monotonic() - t0)))
    wait_l2_idle(d)
    assert l2_value(d, "kvtier_l2_stored_total", "fs:") == n
    assert l2_value(d, "kvtier_l2_errors_total", "fs:") == 0
    assert l2_value(d, "kvtier_l2_dropped_total", "fs:") == 0
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_l1_evictions_total") >= n - 64, \
        "256 MiB went through a 64 MiB L1 with few evictions"
    st = l2_status(d, "fs:")
    assert (st["objects"], st["bytes"]) == (n, n * (MiB + TRAILER)), st
    assert set(st) == {"adapter", "kind", "healthy", "last_error", "last_error_at",
                       "past_error", "queue_depth", "stored", "loaded", "errors", "dropped",
                       "removed", "corrupt", "bytes", "objects", "writers", "flushes"}, st
    assert st["writers"] == 16 and st["flushes"] >= 1, st
    families, samples = d.metrics()
    for name, kind in L2_FAMILIES.items():
        assert families.get(name, {}).get("type") == kind, (name, families.get(name))
        if not name.startswith("kvtier_l1_"):
            fam = [x for x in samples if x.name.startswith(name)]
            assert fam and all(x.labels.get("adapter") == st["adapter"] for x in fam), fam
    assert l2_value(d, "kvtier_l2_operation_duration_seconds_count", "fs:") >= n

    # every key is still found: the oldest only in L2, the newest in L1 too
    lk = d.lookup(s, NS, ks)
    assert (lk["hits"], lk["l1"]) == (n, 0), lk
    assert d.lookup(s, NS, ks[-8:])["l1"] == 8
    for sample in (ks[:8], ks[100:108], ks[-8:]):
        lk, pst = prefetch(d, s, NS, sample)
        assert lk["hits"] == 8 and pst["loaded"] == 8 - lk["l1"], (lk, pst)
        assert get(d, s, NS, sample) == [data_of(k, MiB) for k in sample]
        assert d.fetch(s, arena, NS, sample[:2]) == [data_of(k, MiB) for k in sample[:2]]
    assert l2_value(d, "kvtier_l2_loaded_total", "fs:") >= 16


def test_full_lookup_queue_answers_busy_and_gives_back_the_lease(daemon_factory, client):
    """LOOKUPs past the L1 prefix wait for the cache service's lookup threads (8, and 4096
    queued). With a backend taking 10 ms per lookup, 4600 sent at once overflow it: the
    overflow is answered busy at once and the lease `lock` took on the L1 part goes back with
    it; the others answer ok with their lease. Once those are released, no lease is left."""
    d = daemon_factory("--l2", "mock:latency_ms=10", "--l2-lookup-threads", "8")
    s, _ = client(d, "flood")
    k0 = key(0, b"flood")
    assert d.call(s, PUT, {"ns": NS, "keys": [k0]}, data_of(k0, 4096))["ok"]
    ks = [k0, key(1, b"flood")]                 # the second is nowhere: L2 is asked
    total = 4600
    for i in range(total):
        s.send_multipart([pack(i), pack(LOOKUP), pack({"ns": NS, "keys": ks, "lock": True})])
    leases, busy = [], 0
    for _ in range(total):
        assert s.poll(30000), "no reply for 30 s: %d ok, %d busy" % (len(leases), busy)
        body = unpack(s.recv_multipart()[2])
        if body["ok"]:
            assert (body["hits"], body["l1"]) == (1, 1) and body.get("lease"), body
            leases.append(body["lease"])
        else:
            assert_error(body, "busy", "lookup queue is full")
            busy += 1
    assert busy > 0 and leases, (len(leases), busy)
    assert metric_value(d.metrics()[1], "kvtier_leases_active") == len(leases)
    for lease in leases:
        d.release(s, lease)
    assert metric_value(d.metrics()[1], "kvtier_leases_active") == 0
    assert d.alive()


# ----------------------------------------------------------------------------------------
# mock: a failing backend, and a slow one at stop


def test_failing_backend_never_serves_corrupt_bytes(daemon_factory, client):
    """Half of all mock operations fail (an injected failure reads as `unavailable`, which
    also takes the adapter out until its next health probe). Whatever is served — from L1, or
    loaded back from L2 — is exactly what was stored; keys whose write failed are not found."""
    spec = "mock:latency_ms=1,fail_rate=0.5,seed=7"
    d, ep = start_with_events(daemon_factory, "--l2", spec, "--l1-size", "4M")
    sub = _sub(d, ep)
    s, arena = client(d, "flaky")
    _sync_events(d, s, sub)
    up = lambda: l2_value(d, "kvtier_l2_up", spec) == 1            # noqa: E731

    # 12 MiB of 256 KiB objects through a 4 MiB L1, one PUT each. The first ones wait for the
    # adapter to be up, so that a few writes are tried at all (one failure fails the writes
    # after it at once until the next probe); the rest go as fast as they can.
    ks = keys_of(b"flaky", 48)
    expected = {k: data_of(k, 256 * 1024 - 100 * i) for i, k in enumerate(ks)}
    in_l2, events = set(), []
    t0 = time.monotonic()
    for k in ks:
        if len(in_l2) < 2 and time.monotonic() - t0 < 15:
            wait_until(up, 3, what="the mock adapter up again")
        put_all(d, s, NS, [k], [expected[k]])
        if len(in_l2) < 2:
            wait_l2_idle(d, 5)
            while sub.poll(50, zmq.POLLIN):
                events.append(unpack(sub.recv_multipart()[0]))
            in_l2 = {x for e in events if e["event"] == "l2_stored" and e["ns"] == NS
                     for x in e["keys"]}
    wait_l2_idle(d)
    _drain_into(sub, events)
    in_l2 = {x for e in events if e["event"] == "l2_stored" and e["ns"] == NS for x in e["keys"]}
    errors = l2_value(d, "kvtier_l2_errors_total", spec)
    stored = l2_value(d, "kvtier_l2_stored_total", spec)
    assert errors > 0, "fail_rate=0.5 but no L2 error counted"
    # the counter also holds the few "sync" probes of _sync_events that reached the mock (their
    # events were drained before the test began)
    assert 0 < len(in_l2) <= stored <= len(in_l2) + 5, (len(in_l2), stored)
    assert l2_status(d, "mock:")["objects"] == stored

    # every key, one by one, from L1: exact bytes or not found
    for k in ks:
        check_served(get(d, s, NS, [k]), [k], expected, "GET")
        check_served(d.fetch(s, arena, NS, [k]), [k], expected, "ACQUIRE")

    # prefetches from the failing L2. Alone, a held key loads when both its lookup and its
    # load succeed (1 in 4; a failure takes the adapter out until the next probe, <= 1 s).
    gone = [k for k in ks if d.lookup(s, NS, [k])["l1"] == 0]
    held = [k for k in gone if k in in_l2]
    failed = [k for k in gone if k not in in_l2]
    assert held and failed, "no evicted key both in and missing from L2 (%d, %d)" \
        % (len(held), len(failed))
    loaded = attempt = 0
    deadline = time.monotonic() + 20
    while not loaded and time.monotonic() < deadline:
        wait_until(up, 3, what="the mock adapter up again")
        k = held[attempt % len(held)]
        attempt += 1
        lk, st = prefetch(d, s, NS, [k])
        got = get(d, s, NS, [k])
        check_served(got, [k], expected, "GET after prefetch")
        check_served(d.fetch(s, arena, NS, [k]), [k], expected, "ACQUIRE after prefetch")
        assert len(got) == st["loaded"], (lk, st, len(got))
        loaded += st["loaded"]
    assert loaded > 0, "in 20 s (%d tries) no prefetch loaded anything from the mock" % attempt
    # runs that mix held keys and keys whose write failed: the prefix stops at the first
    # failed key, and nothing past it is served
    for group in ([h for h in held if h != k][:1] + failed[:1] + [k], failed[1:2] + held[:1]):
        wait_until(up, 3, what="the mock adapter up again")
        lk, st = prefetch(d, s, NS, group)
        stop = next(i for i, x in enumerate(group) if x in failed)
        assert lk["hits"] <= stop, "a key whose write failed was found: %r" % lk
        got = get(d, s, NS, group)
        assert len(got) <= stop, "GET served a key whose write failed"
        check_served(got, group, expected, "GET after a mixed prefetch")
        check_served(d.fetch(s, arena, NS, group), group, expected, "ACQUIRE after a mixed "
                     "prefetch")
    assert l2_value(d, "kvtier_l2_loaded_total", spec) >= loaded
    assert d.alive()


def test_sigterm_writes_queued_write_behind(daemon_factory, client):
    """A backend taking 20 ms per object and 100 objects just committed: about 2 s of
    write-behind, which SIGTERM must finish (it has up to 5 s) before the daemon exits."""
    d = daemon_factory("--l2", "mock:latency_ms=20", "--log-level", "info")
    s, _ = client(d, "stopper")
    ks = keys_of(b"stop", 100)
    assert d.call(s, PUT, {"ns": NS, "keys": ks}, *[data_of(k, 16 * 1024) for k in ks])["ok"]
    t0 = time.monotonic()
    assert d.stop(signal.SIGTERM) == 0
    took = time.monotonic() - t0
    log = d.stderr_text()
    lost = [line for line in log.splitlines()
            if "not done at stop" in line or ("l2 mock" in line and "failed" in line)]
    assert not lost, "write-behind abandoned at stop (exit after %.1f s):\n%s" \
        % (took, "\n".join(lost))


# ----------------------------------------------------------------------------------------
# plugin


def test_plugin_adapter(daemon_factory, client):
    so = os.environ.get(PLUGIN_ENV)
    if not so or not os.path.isfile(so):
        pytest.skip("%s is unset or missing (make builds build/kvtier-l2-example.so)"
                    % PLUGIN_ENV)
    spec = "plugin:" + os.path.abspath(so)
    # every object must reach L2: none may be evicted unwritten past l2_backlog_max
    d = daemon_factory("--l2", spec, "--l1-size", "8M", "--l2-backlog-max", "1")
    s, arena = client(d, "plugin")
    ks = keys_of(b"plug", 32)                   # 32 MiB through an 8 MiB L1
    store_all(d, s, arena, NS, ks, [data_of(k, MiB) for k in ks], batch=4)
    wait_l2_idle(d)
    assert l2_value(d, "kvtier_l2_stored_total", spec) == 32
    st = l2_status(d, spec)
    assert (st["kind"], st["healthy"], st["objects"], st["bytes"]) == \
        ("example-mem", True, 32, 32 * (MiB + TRAILER)), st
    lk = d.lookup(s, NS, ks)
    assert (lk["hits"], lk["l1"]) == (32, 0), lk
    lk, pst = prefetch(d, s, NS, ks[:4])
    assert pst["loaded"] == 4, pst
    assert get(d, s, NS, ks[:4]) == [data_of(k, MiB) for k in ks[:4]]
    assert l2_value(d, "kvtier_l2_loaded_total", spec) == 4

    # the example keeps objects in process memory: a restart starts empty
    assert d.stop(signal.SIGTERM) == 0
    d2 = daemon_factory("--l2", spec, "--l1-size", "8M", "--l2-backlog-max", "1")
    s2, _ = client(d2, "plugin-2")
    assert d2.lookup(s2, NS, ks)["hits"] == 0


# ----------------------------------------------------------------------------------------
# REMOVE, CLEAR and events


def _sub(d, ep):
    sub = d.ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ep)
    d._sockets.append(sub)
    return sub


def _recv_events(sub, until, timeout=5.0):
    """Events (dicts) received until until(events) is true; fails after `timeout` s."""
    events = []
    deadline = time.monotonic() + timeout
    while not until(events):
        left = deadline - time.monotonic()
        assert left > 0, "events did not arrive within %.0f s; got %r" % (timeout, events)
        if sub.poll(int(min(left, 0.2) * 1000), zmq.POLLIN):
            frames = sub.recv_multipart()
            events.append(unpack(frames[0]))
    return events


def _drain(sub, quiet_ms=300, limit=1000):
    """Reads and drops events until none arrives for quiet_ms."""
    for _ in range(limit):
        if not sub.poll(quiet_ms, zmq.POLLIN):
            return
        sub.recv_multipart()
    raise AssertionError("events kept coming: more than %d while draining" % limit)


def _drain_into(sub, events, quiet_ms=300, limit=10000):
    """Appends events to `events` until none arrives for quiet_ms."""
    for _ in range(limit):
        if not sub.poll(quiet_ms, zmq.POLLIN):
            return events
        events.append(unpack(sub.recv_multipart()[0]))
    raise AssertionError("events kept coming: more than %d while draining" % limit)


def start_with_events(daemon_factory, *extra):
    """A started daemon publishing events on an ipc endpoint; returns (daemon, endpoint)."""
    d = daemon_factory(*extra, start=False)
    ep = "ipc://" + os.path.join(d.run_dir, "events.sock")
    d.args += ["--events", ep]
    d.start()
    return d, ep


def _sync_events(d, s, sub, timeout=5.0):
    """The subscription reaches the publisher asynchronously: PUT probes (ns "sync") until an
    event arrives, then drop everything received."""
    deadline = time.monotonic() + timeout
    while not sub.poll(100, zmq.POLLIN):
        assert time.monotonic() < deadline, "no event reached the subscriber within 5 s"
        assert d.call(s, PUT, {"ns": "sync", "keys": [os.urandom(16)]}, b"probe")["ok"]
    _drain(sub)


def _has(events, event, tier, keys, ns=NS):
    """True when the events hold `event` in `tier` for every key of `keys` in ns."""
    seen = set()
    for ev in events:
        if ev["event"] == event and ev["tier"] == tier and ev["ns"] == ns:
            seen.update(ev["keys"])
    return set(keys) <= seen


def test_l2_events_remove_and_clear(daemon_factory, client):
    d, ep = start_with_events(daemon_factory)
    sub = _sub(d, ep)
    s, arena = client(d, "events")
    _sync_events(d, s, sub)

    ks = keys_of(b"ev", 3)
    datas = [data_of(k, 20000) for k in ks]
    assert d.call(s, PUT, {"ns": NS, "keys": ks}, *datas)["stored"] == 3
    evs = _recv_events(sub, lambda e: _has(e, "l2_stored", "l2", ks))
    assert _has(evs, "stored", "l1", ks), evs
    for ev in evs:
        assert ev["tier"] == ("l2" if ev["event"].startswith("l2_") else "l1"), ev

    # CLEAR empties L1 only: the objects are still found (in L2) and a prefetch brings them
    # back, announced as stored in L1 and not written to L2 again
    assert d.clear(s, NS)["removed"] == 3
    evs = _recv_events(sub, lambda e: _has(e, "removed", "l1", ks))
    assert not _has(evs, "l2_removed", "l2", ks[:1]), evs
    lk = d.lookup(s, NS, ks)
    assert (lk["hits"], lk["l1"]) == (3, 0), lk
    lk, st = prefetch(d, s, NS, ks)
    assert st["loaded"] == 3, st
    evs = _recv_events(sub, lambda e: _has(e, "stored", "l1", ks))
    assert get(d, s, NS, ks) == datas

    # REMOVE removes from every tier
    assert d.remove(s, NS, ks)["removed"] == 3
    evs = _recv_events(sub, lambda e: _has(e, "removed", "l1", ks) and
                       _has(e, "l2_removed", "l2", ks))
    assert not [e for e in evs if e["event"] == "l2_stored"], evs
    assert d.lookup(s, NS, ks)["hits"] == 0
    assert l2_status(d, "fs:")["removed"] == 3
    assert l2_value(d, "kvtier_l2_removed_total", "fs:") == 3


def test_remove_right_after_store_leaves_no_l2_copy(daemon_factory, client):
    """REMOVE while the object's write-behind is still queued or running: once L2 is idle the
    key must be gone from every tier, not brought back by the write that finished late."""
    d = daemon_factory()
    s, _ = client(d, "remover")
    ks = keys_of(b"rmrace", 20)
    for k in ks:
        assert d.call(s, PUT, {"ns": NS, "keys": [k]}, data_of(k, MiB))["stored"] == 1
        assert d.remove(s, NS, [k])["removed"] == 1
    wait_l2_idle(d)
    time.sleep(0.5)                  # removals have no gauge: give the last ones time
    back = [i for i, k in enumerate(ks) if d.lookup(s, NS, [k])["hits"]]
    st = l2_status(d, "fs:")
    assert not back, "%d of %d keys REMOVEd right after their PUT are still found in L2 " \
        "(l2 status: %r)" % (len(back), len(ks), st)


# ----------------------------------------------------------------------------------------
# Bad specs

BAD_SPECS = [
    ("bogus:x", "bogus"),
    ("fs:", "fs:"),
    ("mock:fail_rate=2", "fail_rate"),
    ("mock:latency_ms=1,colour=blue", "colour"),
    ("redis:nohost", "nohost"),
    ("redis:127.0.0.1:6379,timeout_ms=0", "timeout_ms"),
    ("fs:{tmp}/l2,capacity=lots", "capacity"),
    ("plugin:{tmp}/no-such-plugin.so", "no-such-plugin.so"),
]


def _error_lines(stderr):
    """stderr lines that are not info/debug log lines."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith(("<6>", "<7>"))]


@pytest.mark.parametrize("spec,mention", BAD_SPECS, ids=[s for s, _ in BAD_SPECS])
def test_bad_l2_spec_exits_2_naming_it(kvt_daemon_bin, tmp_path, spec, mention):
    spec = spec.format(tmp=tmp_path)
    cp = run_kvtierd(["--run-dir", str(tmp_path / "run"), "--data-dir", str(tmp_path / "data"),
                      "--http=", "--l1-size", "4M", "--allow-unpinned", "--l2", spec])
    lines = _error_lines(cp.stderr)
    assert cp.returncode == 2 and len(lines) == 1, \
        "--l2 %s: exit %s, stderr:\n%s" % (spec, cp.returncode, cp.stderr)
    assert "l2" in lines[0] and mention in lines[0], lines


@pytest.mark.parametrize("spec,mention", BAD_SPECS, ids=[s for s, _ in BAD_SPECS])
def test_check_config_rejects_bad_l2_spec(kvt_daemon_bin, tmp_path, spec, mention):
    spec = spec.format(tmp=tmp_path)
    cp = run_kvtierd(["--run-dir", str(tmp_path / "run"), "--data-dir", str(tmp_path / "data"),
                      "--l2", spec, "--check-config"])
    assert cp.returncode == 2, "--check-config accepted --l2 %s: %s" % (spec, cp.stderr)
    assert "l2" in cp.stderr and mention in cp.stderr, cp.stderr


# ----------------------------------------------------------------------------------------
# SIGTERM under load, and a full disk


def _drop_page_cache():
    """Drops clean cached pages, dentries and inodes (root only; False where not allowed)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


@pytest.mark.parametrize("how,sync", [("SIGTERM", None), ("SIGKILL", "batch"),
                                      ("SIGKILL", "object"), ("SIGKILL", "none")])
def test_sigterm_under_load_keeps_what_l2_acknowledged(daemon_factory, client, tmp_path, how,
                                                        sync):
    """Eight clients PUT without pause; SIGTERM (or SIGKILL) in the middle of heavy
    write-behind: after a restart on the same directory every object an l2_stored event
    acknowledged is there with its exact bytes (and, after SIGTERM, so is every acknowledged
    PUT the daemon reports as written), in each fs sync mode. After a SIGKILL the page cache is
    dropped before the restart where allowed, so the objects are read back from the disk. What
    this cannot show is a power loss: dropping the cache writes dirty pages first (see
    operations.md, "What survives a crash"). No object is ever served with other bytes."""
    import threading

    data_dir = str(tmp_path / "data")
    l2 = ["--l2", "fs:%s/l2,sync=%s" % (data_dir, sync)] if sync else []
    d = daemon_factory("--data-dir", data_dir, "--l1-size", "256M", *l2, start=False)
    ep = "ipc://" + os.path.join(d.run_dir, "events.sock")
    d.args += ["--events", ep]
    d.start()
    # not d's socket: it must outlive d.stop() to read the events sent while stopping
    sub = d.ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ep)
    s0, _ = client(d, "warm-up")
    _sync_events(d, s0, sub)        # probes go to ns "sync"
    events = []

    acked = {}                      # key -> bytes, PUTs the daemon answered ok
    sent = {}                       # key -> bytes, every PUT sent (each key is sent once)
    lock = threading.Lock()
    stop = threading.Event()
    errors = []

    def writer(w):
        s = d.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 2000)
        s.connect(d.ipc)
        try:
            for i in range(100000):
                if stop.is_set():
                    break
                ks = keys_of(b"load%02d" % w, 4, start=4 * i)
                datas = [data_of(k, 32 * 1024 + 97 * j) for j, k in enumerate(ks)]
                with lock:
                    sent.update(zip(ks, datas))
                s.send_multipart([pack(i), pack(PUT), pack({"ns": NS, "keys": ks})] + datas)
                try:
                    frames = s.recv_multipart()
                except zmq.Again:
                    break           # the daemon is stopping
                body = unpack(frames[2])
                if body.get("ok"):
                    with lock:
                        for k, x in zip(ks[:body["stored"]], datas):
                            acked[k] = x
                elif error_code(body) not in ("no_space", "busy"):
                    errors.append(body)
        except Exception as e:  # noqa: BLE001 - surface any client failure in the test
            errors.append(repr(e))
        finally:
            s.close(linger=0)

    def reader():
        # read as they come: past the subscriber's high-water mark (1000 messages, and the
        # load makes many L1 events) the publisher drops what nobody reads
        while not stop_events.is_set():
            if sub.poll(50, zmq.POLLIN):
                events.append(unpack(sub.recv_multipart()[0]))

    stop_events = threading.Event()
    events_thread = threading.Thread(target=reader, daemon=True)
    events_thread.start()
    threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(8)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(acked) >= 1500, timeout=60, what="1500 acknowledged PUTs")
        wait_until(lambda: l2_value(d, "kvtier_l2_stored_total") >= 150, timeout=60,
                   what="150 objects written to L2")
        if how == "SIGTERM":
            rc = d.stop(signal.SIGTERM, timeout=15)
            assert not d.killed and rc == 0, (rc, d.stderr_tail())
        else:
            # events already sent reach the subscriber; the kill must not wait for them
            time.sleep(0.2)
            assert d.stop(signal.SIGKILL) == -signal.SIGKILL
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "writer threads hung"
    assert not errors, errors[:5]
    stop_events.set()
    events_thread.join(timeout=10)
    assert not events_thread.is_alive(), "event reader hung"
    _drain_into(sub, events)
    sub.close(linger=0)
    l2_acked = {bytes(k) for e in events
                if e["event"] == "l2_stored" and e["ns"] == NS for k in e["keys"]}
    assert len(l2_acked) >= 100, "only %d l2_stored keys under load" % len(l2_acked)
    # a PUT whose reply the kill cut off may still have been stored and written behind
    assert l2_acked <= set(sent), "l2_stored for keys no PUT sent"
    assert len(l2_acked - set(acked)) <= 8 * 4, "more l2_stored keys unanswered than in flight"
    log = d.stderr_text()
    write_behind_complete = (how == "SIGTERM" and "not done at stop" not in log and
                             "queue full" not in log)
    if how == "SIGKILL":
        _drop_page_cache()

    d2 = daemon_factory("--data-dir", data_dir, "--l1-size", "256M", *l2)
    s2, _ = client(d2, "after-restart")
    def found(k):
        return d2.lookup(s2, NS, [k])["hits"] == 1

    missing = [k for k in sorted(l2_acked) if not found(k)]
    assert not missing, "%d of %d objects acknowledged by l2_stored are gone after the " \
        "restart" % (len(missing), len(l2_acked))
    ks = sorted(l2_acked)
    # their bytes are exact: loaded back from L2 through a prefetch
    sample = ks[:: max(1, len(ks) // 48)][:48]
    for k in sample:
        lk, pst = prefetch(d2, s2, NS, [k])
        assert pst["loaded"] + lk["l1"] == 1, (lk, pst)
        assert get(d2, s2, NS, [k]) == [sent[k]]
    # unless the log says write-behind was cut short, SIGTERM wrote every acknowledged PUT
    if write_behind_complete:
        lost = [k for k in sorted(acked) if k not in l2_acked and not found(k)]
        assert not lost, "%d acknowledged PUTs not in L2 after a clean stop" % len(lost)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (a disk that fills up); skipped where mounting is not permitted."""
    import subprocess
    mnt = tmp_path / "full"
    mnt.mkdir()
    cp = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M,mode=0700", "tmpfs", str(mnt)],
                        capture_output=True, text=True)
    if cp.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (%s)" % cp.stderr.strip())
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_fs_disk_full_l1_keeps_serving(daemon_factory, client, small_tmpfs):
    """The fs L2 on a 2 MiB disk gets 5 MiB: the writes that fit are kept, the others fail
    with ENOSPC and are counted; /readyz says why; L1 serves every object with its bytes; the
    daemon stays up, and what L2 did store survives a restart."""
    l2dir = os.path.join(small_tmpfs, "l2")
    spec = "fs:" + l2dir + ",direct=off"
    d, ep = start_with_events(daemon_factory, "--l2", spec)
    sub = _sub(d, ep)
    s, arena = client(d, "filler")
    ks = keys_of(b"full", 20)
    expected = {k: data_of(k, 256 * 1024 + 13 * i) for i, k in enumerate(ks)}
    for k in ks:
        b = d.call(s, PUT, {"ns": NS, "keys": [k]}, expected[k])
        assert b["ok"] and b["stored"] == 1, b
    wait_l2_idle(d)
    errors = l2_value(d, "kvtier_l2_errors_total", "fs:")
    stored = l2_value(d, "kvtier_l2_stored_total", "fs:")
    assert errors >= 1, "no L2 error counted for a full disk"
    assert stored >= 1 and stored + errors == len(ks), (stored, errors)
    assert stored * 256 * 1024 <= 2 * MiB
    st = l2_status(d, "fs:")
    assert "space" in st["last_error"].lower(), st
    # the adapter's health probe (every second) turns /readyz red, naming the adapter
    status, body = wait_until(lambda: readyz(d)[0] == 503 and readyz(d), timeout=5,
                              what="/readyz to report the full fs L2")
    assert "fs:" in body and "space" in body.lower(), body
    # L1 keeps serving: every object, exact bytes, both paths
    assert get(d, s, NS, ks) == [expected[k] for k in ks]
    assert d.fetch(s, arena, NS, ks) == [expected[k] for k in ks]
    d.ping(s)
    events = _drain_into(sub, [])
    on_disk = {bytes(k) for e in events if e["event"] == "l2_stored" for k in e["keys"]}
    assert len(on_disk) == stored, (len(on_disk), stored)
    assert d.stop(signal.SIGTERM) == 0

    # what L2 acknowledged is intact after a restart (L1 starts empty)
    d2 = daemon_factory("--l2", spec)
    s2, _ = client(d2, "after-full")
    assert l2_status(d2, "fs:")["objects"] == len(on_disk)
    for k in sorted(on_disk):
        lk, pst = prefetch(d2, s2, NS, [k])
        assert (lk["hits"], pst["loaded"]) == (1, 1), (lk, pst)
        assert get(d2, s2, NS, [k]) == [expected[k]]
    assert d2.alive()


BURST_S = float(os.environ.get("KVT_BURST_S", "12"))
# the burst's L2: 4 writers (not the default 16, which a mock of 20 ms per object lets write
# 200 MiB/s) of 40 ms per 256 KiB object, 25 MiB/s
BURST_L2_MS, BURST_L2_WRITERS = 40, 4


@pytest.mark.parametrize("backlog", ["0.5", "1"])
def test_store_burst_faster_than_l2(daemon_factory, client, backlog):
    """Clients store several times faster than L2 writes (a mock backend that takes 40 ms per
    object, 4 writers: about 25 MiB/s; two clients ask 200 MiB/s of 256 KiB objects and reach
    80-100 MiB/s under ASan on the 2-vCPU VM) for
    KVT_BURST_S seconds (12 here, 60 in `make check`) into a 64 MiB L1, while a reader keeps
    8 keys hot (GET) and times LOOKUPs of them. With l2_backlog_max 0.5 (the default) the
    LOOKUPs answer at their normal latency, the oldest unwritten objects go, counted in
    kvtier_l1_l2_skipped_total, and every batch keeps being stored in full. With 1 nothing is
    skipped and L1 refuses instead (no_space, or a batch stored only in part) — and since the
    only evictable objects are then those already written, the hot keys are evicted and their
    LOOKUPs go to L2. Either way every object announced as l2_stored is still found
    afterwards."""
    import threading

    d, ep = start_with_events(daemon_factory, "--l1-size", "64M", "--l2",
                              "mock:latency_ms=%d" % BURST_L2_MS, "--l2-write-threads",
                              str(BURST_L2_WRITERS), "--l2-backlog-max", backlog)
    sub = _sub(d, ep)
    s0, _ = client(d, "probe")
    _sync_events(d, s0, sub)
    hot = keys_of(b"hot", 8)
    assert d.call(s0, PUT, {"ns": NS, "keys": hot}, *[data_of(k, 4096) for k in hot])["ok"]

    def lookup_ms(n):
        """LOOKUP latencies; a GET first keeps the keys hot (a LOOKUP does not touch the LRU,
        a read does)."""
        out = []
        for _ in range(n):
            get(d, s0, NS, hot)
            t = time.monotonic()
            assert d.lookup(s0, NS, hot)["hits"] == len(hot)
            out.append((time.monotonic() - t) * 1e3)
            time.sleep(0.005)
        return sorted(out)

    base = lookup_ms(100)

    l2_stored, stop, errors = set(), threading.Event(), []
    stats = {"batches": 0, "full": 0, "refused": 0}
    lock = threading.Lock()

    def events():
        while not stop.is_set() or sub.poll(300, zmq.POLLIN):
            if sub.poll(100, zmq.POLLIN):
                e = unpack(sub.recv_multipart()[0])
                if e["event"] == "l2_stored" and e["ns"] == NS:
                    l2_stored.update(bytes(k) for k in e["keys"])

    def writer(w):
        s = d.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 10000)
        s.connect(d.ipc)
        size, per_s, i = 256 * 1024, 100.0, 0     # 100 batches of 1 MiB per second
        # made before: generating payloads in Python would hold the GIL from the prober
        pool = [os.urandom(size) for _ in range(8)]
        t0 = time.monotonic()
        try:
            while not stop.is_set():
                ks = keys_of(b"burst%d" % w, 4, start=4 * i)
                s.send_multipart([pack(i), pack(PUT), pack({"ns": NS, "keys": ks})] +
                                 [pool[(i + j) % 8] for j in range(4)], copy=False)
                body = unpack(s.recv_multipart()[2])
                with lock:
                    stats["batches"] += 1
                    if body.get("ok") and body["stored"] == 4:
                        stats["full"] += 1
                    elif body.get("ok") or error_code(body) == "no_space":
                        stats["refused"] += 1
                    else:
                        errors.append(body)
                i += 1
                ahead = t0 + i / per_s - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
        except Exception as e:  # noqa: BLE001 - surface any client failure in the test
            errors.append(repr(e))
        finally:
            s.close(linger=0)

    threads = [threading.Thread(target=events, daemon=True)]
    threads += [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(2)]
    for t in threads:
        t.start()
    try:
        # hot keys stay hot: probed all along; judged once the backlog has built up
        warm = min(5.0, BURST_S / 3)
        t_end = time.monotonic() + BURST_S
        probes = []
        while time.monotonic() < t_end:
            probes.append((time.monotonic(), lookup_ms(1)[0]))
        during = sorted(ms for t, ms in probes if t >= t_end - BURST_S + warm)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors, errors[:5]
    assert not any(t.is_alive() for t in threads)

    def pct(v, p):
        return v[min(len(v) - 1, int(len(v) * p))]

    if backlog == "0.5":
        # LOOKUP latency: the median within 3x (+1 ms) of the quiet one, the p99 under 50 ms
        assert pct(during, 0.5) <= 3 * pct(base, 0.5) + 1.0, (pct(base, 0.5), pct(during, 0.5))
        assert pct(during, 0.99) <= 50.0, (pct(base, 0.99), pct(during, 0.99))
    else:
        # with every new object waiting, the objects already written — the hot keys — are
        # the only evictable ones: they go, and their LOOKUPs are answered from L2 (8 keys x
        # the mock's latency). What the default avoids; performance.md shows both.
        assert pct(during, 0.5) >= 8 * BURST_L2_MS * 0.8, (pct(base, 0.5), pct(during, 0.5))

    _, samples = d.metrics()
    skipped = metric_value(samples, "kvtier_l1_l2_skipped_total")
    stored_total = l2_value(d, "kvtier_l2_stored_total", "mock:")
    backlog_now = d.http_json("GET", "/status")["l1"]["l2_backlog"]
    sent = stats["batches"] * 4 * 256 * 1024
    # a burst: at least twice what L2 writes (a sanitizer build does not reach what is asked)
    l2_mibs = BURST_L2_WRITERS * 0.25 / (BURST_L2_MS / 1000.0)
    assert sent >= BURST_S * 2 * l2_mibs * MiB, "the clients stored only %d MiB" % (sent >> 20)
    if backlog == "0.5":
        assert skipped > 0, "nothing skipped while L2 was too slow"
        assert stats["refused"] == 0, stats     # new objects always found room
        assert backlog_now["skipped"] == skipped
        assert backlog_now["max_bytes"] == 32 * MiB
    else:
        assert skipped == 0
        assert stats["refused"] > 0, stats      # L1 said no instead
        assert backlog_now["max_bytes"] == -1
    assert stored_total >= len(l2_stored) > 0
    # every object announced as written is found (L1 or L2), the oldest first
    missing = [k for k in sorted(l2_stored)[:400] if d.lookup(s0, NS, [k])["hits"] != 1]
    assert not missing, "%d objects announced as l2_stored not found" % len(missing)
