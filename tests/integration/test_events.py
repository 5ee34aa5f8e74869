"""Cache events (kvtierd --events ENDPOINT) through kvtier.Subscriber: stored / removed /
evicted with the right ns, salt, keys, sizes and tier, one message per request per (ns, salt);
the labels objects were stored with (RESERVE/PUT `labels`) on every event of theirs, also
after a restart that adopted them, and bad labels refused with nothing lost; and a subscriber
that never reads does not stall the daemon — its events are dropped and counted."""

import os
import signal
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))

import pytest  # noqa: E402
import zmq  # noqa: E402

import kvtier  # noqa: E402
from kvtest import MiB, free_port, key, wait_until  # noqa: E402

NS = "events/llama-kv-v1"
SYNC_NS = "events/sync"
QUIET_MS = 300            # "no further event" means none within this long
# L1 events alone: an L2 tier would interleave l2_stored / l2_removed (tested in test_l2.py) and
# hold objects in L1 until written
KVT_DAEMON_ARGS = ("--l2", "none")


def start_with_events(daemon_factory, *extra, transport="ipc"):
    """A daemon publishing events; returns (daemon, events endpoint)."""
    d = daemon_factory(*extra, start=False)
    if transport == "ipc":
        ep = "ipc://" + os.path.join(d.run_dir, "events.sock")
    else:
        ep = "tcp://127.0.0.1:%d" % free_port()
    d.args += ["--events", ep]
    d.start()
    return d, ep


@pytest.fixture
def kv(daemon_factory):
    """kv(daemon, events_endpoint, **Subscriber kwargs) -> (Client, Subscriber), with the
    subscription known to be live (a probe event came through) and the probes drained.
    Both closed at teardown."""
    made = []

    def _make(d, ep, **sub_kw):
        c = kvtier.Client(d.ipc, client="events-test", context=d.ctx)
        made.append(c)
        sub = kvtier.Subscriber(ep, context=d.ctx, **sub_kw)
        made.append(sub)
        sync(c, sub)
        return c, sub

    yield _make
    for x in made:
        x.close()


def sync(c, sub, timeout=5.0):
    """ZMQ subscriptions reach the publisher asynchronously: PUT fresh probe keys until one's
    stored event arrives, then CLEAR them and read up to that removed event."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, "no event reached the subscriber within %.0f s" \
            % timeout
        assert c.put(SYNC_NS, [os.urandom(16)], [b"probe"]) == 1
        ev = sub.recv(100)
        if ev is not None:
            break
    assert ev["ns"] == SYNC_NS, ev
    c.clear(SYNC_NS)
    while True:
        ev = sub.recv(2000)
        assert ev is not None, "the CLEAR of the probes published no removed event"
        if ev["event"] == "removed" and ev["ns"] == SYNC_NS:
            return


def check_shape(ev):
    assert isinstance(ev, dict), ev
    assert set(ev) >= {"event", "ns", "salt", "keys", "tier"}, ev
    assert ev["event"] in ("stored", "evicted", "removed", "l2_stored", "l2_removed"), ev
    assert isinstance(ev["ns"], str) and isinstance(ev["salt"], str), ev
    assert isinstance(ev["keys"], list) and ev["keys"], "event without keys: %r" % ev
    assert all(isinstance(k, bytes) and len(k) == 16 for k in ev["keys"]), ev
    assert ev["tier"] == "l1", ev
    sizes = ev.get("sizes")
    assert isinstance(sizes, list) and len(sizes) == len(ev["keys"]), ev
    assert all(isinstance(s, int) and s > 0 for s in sizes), ev
    if "labels" in ev:
        assert len(ev["labels"]) == len(ev["keys"]), ev
        assert any(x is not None for x in ev["labels"]), "labels of none: %r" % ev
    return ev


def expect(sub, event, ns, salt, keys, ordered=True):
    """The next event is `event` for (ns, salt) with exactly `keys`."""
    ev = sub.recv(3000)
    assert ev is not None, "no %s event for %s/%r within 3 s" % (event, ns, salt)
    check_shape(ev)
    got = ev["keys"] if ordered else sorted(ev["keys"])
    want = list(keys) if ordered else sorted(keys)
    assert (ev["event"], ev["ns"], ev["salt"], got) == (event, ns, salt, want), \
        "expected %s %s/%r %d keys, got %r" % (event, ns, salt, len(want), ev)
    return ev


def expect_none(sub, what):
    ev = sub.recv(QUIET_MS)
    assert ev is None, "unexpected event after %s: %r" % (what, ev)


def test_stored_and_removed_events(daemon_factory, kv):
    d, ep = start_with_events(daemon_factory)
    c, sub = kv(d, ep)
    k = [key(i, b"ev") for i in range(6)]
    a = [key(i, b"tenant") for i in range(3)]

    # RESERVE/COMMIT -> stored, the keys in request order, with their sizes, without labels
    assert c.store(NS, k[:3], [b"x" * 5000, b"y" * 7, b"z" * 4096]) == 3
    ev = expect(sub, "stored", NS, "", k[:3])
    assert ev["sizes"] == [5000, 7, 4096] and "labels" not in ev, ev
    # COMMIT with a failed index: only the keys that became readable
    slots, lease = c.reserve(NS, a, 4096, salt="tenant-a")
    for s in slots:
        s[:] = b"t" * 4096
    assert c.commit(lease, failed=[1]) == 2
    expect(sub, "stored", NS, "tenant-a", [a[0], a[2]])
    # a reservation abandoned, reads, lookups: nothing
    slots, lease = c.reserve(NS, [k[5]], 4096)
    c.release(lease)
    c.lookup(NS, k)
    c.fetch(NS, k[:3])
    c.get(NS, k[:3])
    expect_none(sub, "RELEASE of a write lease, LOOKUP, ACQUIRE, GET")
    # PUT -> stored, new objects only; a PUT of nothing new publishes nothing
    assert c.put(NS, [k[2], k[3], k[4]], [b"a", b"b", b"c"]) == 2
    expect(sub, "stored", NS, "", [k[3], k[4]])
    assert c.put(NS, k[:2], [b"a", b"b"]) == 0
    expect_none(sub, "a PUT that stored nothing")
    # REMOVE -> removed, only what was there
    assert c.remove(NS, [k[0], k[5]]) == 1
    expect(sub, "removed", NS, "", [k[0]])
    assert c.remove(NS, [a[0]], salt="tenant-a") == 1
    expect(sub, "removed", NS, "tenant-a", [a[0]])
    assert c.remove(NS, [k[5]]) == 0
    expect_none(sub, "a REMOVE that removed nothing")
    # CLEAR of a namespace -> one removed event per salt
    c.put(NS + "/other", [k[0]], [b"o"])
    expect(sub, "stored", NS + "/other", "", [k[0]])
    assert c.clear(NS) == 5                      # k1..k4 and tenant-a's a2
    evs = [check_shape(sub.recv(3000)) for _ in range(2)]
    got = {(e["event"], e["ns"], e["salt"]): sorted(e["keys"]) for e in evs}
    assert got == {("removed", NS, ""): sorted(k[1:5]),
                   ("removed", NS, "tenant-a"): [a[2]]}, evs
    expect_none(sub, "CLEAR of %s" % NS)
    # CLEAR of everything -> one per (ns, salt)
    c.put("events/a", [k[1]], [b"1"], salt="s1")
    c.put("events/b", k[1:3], [b"1", b"2"])
    expect(sub, "stored", "events/a", "s1", [k[1]])
    expect(sub, "stored", "events/b", "", k[1:3])
    assert c.clear() == 4
    evs = [check_shape(sub.recv(3000)) for _ in range(3)]
    got = {(e["event"], e["ns"], e["salt"]): sorted(e["keys"]) for e in evs}
    assert got == {("removed", NS + "/other", ""): [k[0]],
                   ("removed", "events/a", "s1"): [k[1]],
                   ("removed", "events/b", ""): sorted(k[1:3])}, evs
    expect_none(sub, "CLEAR of everything")
    st = c.stats()
    assert st["events_dropped_total"] == 0 and st["events_published_total"] >= 12, st


def test_labels_on_every_event_of_an_object(daemon_factory, kv):
    """Labels given at RESERVE and PUT come back on the stored event and on the removed event
    of the same objects (None for a key stored without one); the first label of a key stays;
    bad labels are a typed bad_request that stores nothing and loses nothing."""
    d, ep = start_with_events(daemon_factory)
    c, sub = kv(d, ep)
    k = [key(i, b"lab") for i in range(6)]
    mm = ["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
          "image-\u65e5\u672c-\U0001f600", "x" * 255]
    assert c.store(NS, k[:3], [b"a" * 100, b"b" * 200, b"c" * 300],
                   labels=[mm[0], None, mm[2]]) == 3
    ev = expect(sub, "stored", NS, "", k[:3])
    assert ev["labels"] == [mm[0], None, mm[2]] and ev["sizes"] == [100, 200, 300], ev
    # PUT (bytes on the socket) takes them too
    assert c.put(NS, k[3:5], [b"d" * 10, b"e" * 20], labels=[mm[1], None]) == 2
    ev = expect(sub, "stored", NS, "", k[3:5])
    assert ev["labels"] == [mm[1], None] and ev["sizes"] == [10, 20], ev
    # a key stored already keeps its first label (nothing new is stored, nothing published)
    assert c.store(NS, [k[0]], [b"a" * 100], labels=["another"]) == 0
    expect_none(sub, "a store of a present key")
    # bad labels: typed errors naming the field; nothing stored, nothing lost
    bad = [(["y" * 256], "at most 255"), (["a", "b"], "'labels' has 2 entries for 1 keys"),
           ([b"bin"], "labels")]
    for labels, why in bad:
        with pytest.raises(kvtier.BadRequest, match=why):
            c.call(kvtier.RESERVE, {"ns": NS, "keys": [k[5]], "size": 4096,
                                    "labels": labels})
        with pytest.raises(kvtier.BadRequest, match=why):
            c.call(kvtier.PUT, {"ns": NS, "keys": [k[5]], "labels": labels}, [b"f"])
    with pytest.raises(TypeError):
        c.store(NS, [k[5]], [b"f"], labels=[b"bytes"])
    expect_none(sub, "refused labels")
    assert c.lookup(NS, k).hits == 5
    assert c.fetch(NS, [k[0]]) == [b"a" * 100]
    # removed: each object with its own label, also when several go at once
    assert c.remove(NS, [k[4], k[0], k[1]]) == 3
    ev = expect(sub, "removed", NS, "", [k[4], k[0], k[1]])
    assert ev["labels"] == [None, mm[0], None] and ev["sizes"] == [20, 100, 200], ev
    assert c.remove(NS, [k[4]]) == 0
    assert c.put(NS, [k[4]], [b"new"]) == 1          # stored again, now without a label
    ev = expect(sub, "stored", NS, "", [k[4]])
    assert "labels" not in ev, ev


def test_labels_survive_a_restart(daemon_factory, kv):
    """An adopted object (l1.adopt, after a SIGKILL) keeps its label: its removal names it."""
    d, ep = start_with_events(daemon_factory, "--l1-adopt")
    c, sub = kv(d, ep)
    k = [key(i, b"kept") for i in range(2)]
    assert c.store(NS, k, [b"p" * 5000, b"q" * 6000], labels=["mm-kept", None]) == 2
    expect(sub, "stored", NS, "", k)
    wait_until(lambda: d.http_json("GET", "/status")["l1"]["adopt"]["sums_pending"] == 0, 10,
               what="every object summed (journaled)")
    c.close()
    d.restart(signal.SIGKILL)
    wait_until(lambda: d.http_json("GET", "/status")["l1"]["adopt"]["verify_pending"] == 0, 30,
               what="every adopted object checked")
    assert d.http_json("GET", "/status")["l1"]["adopt"]["adopted"]
    c2, sub2 = kv(d, ep)
    assert c2.remove(NS, k) == 2
    ev = expect(sub2, "removed", NS, "", k)
    assert ev["labels"] == ["mm-kept", None] and ev["sizes"] == [5000, 6000], ev


def test_evicted_events(daemon_factory, kv):
    """Filling the 64 MiB arena past the high watermark evicts; every evicted key is announced
    once, under its own (ns, salt), with its size and label, and is really gone."""
    d, ep = start_with_events(daemon_factory, transport="tcp")
    c, sub = kv(d, ep)
    salts = ["", "tenant-e"]
    stored = {}                                   # key -> salt
    labels = {}                                   # key -> label (every third has none)
    for i in range(24):                           # 24 x 4 MiB into 64 MiB
        salt = salts[i % 2]
        k = key(i, b"evict")
        labels[k] = None if i % 3 == 0 else "img-%d" % i
        slots, lease = c.reserve(NS, [k], 4 * MiB, salt=salt, labels=[labels[k]])
        slots[0][:8] = b"evictme!"
        assert c.commit(lease) == 1
        stored[k] = salt

    seen = {"stored": [], "evicted": []}

    def all_evictions_announced():
        while True:
            ev = sub.recv(50)
            if ev is None:
                break
            check_shape(ev)
            assert ev["ns"] == NS, ev
            assert ev["sizes"] == [4 * MiB] * len(ev["keys"]), ev
            got = ev.get("labels") or [None] * len(ev["keys"])
            for kk, label in zip(ev["keys"], got):
                assert stored.get(kk) == ev["salt"], \
                    "event %s for key %s under salt %r, stored under %r" \
                    % (ev["event"], kk.hex(), ev["salt"], stored.get(kk))
                assert label == labels[kk], (ev["event"], kk, label, labels[kk])
            seen.setdefault(ev["event"], []).extend(ev["keys"])
        n = c.stats()["l1_evictions_total"]
        return n > 0 and len(seen["evicted"]) == n and len(seen["stored"]) == len(stored)
    wait_until(all_evictions_announced, timeout=10, interval=0.1,
               what="one evicted key per eviction (kvtier_l1_evictions_total)")
    assert sorted(seen["stored"]) == sorted(stored)
    assert len(set(seen["evicted"])) == len(seen["evicted"]), "a key evicted twice"
    for k, salt in stored.items():
        want = 0 if k in seen["evicted"] else 1
        assert c.lookup(NS, [k], salt=salt).hits == want, (k.hex(), salt, want)
    assert 4 <= len(seen["evicted"]) < len(stored)
    expect_none(sub, "the evictions")
    assert c.stats()["events_dropped_total"] == 0


def test_slow_subscriber_does_not_stall_the_daemon(daemon_factory, kv):
    """One subscriber never reads (RCVHWM 1), another reads everything in a thread. The daemon
    keeps answering fast; once the slow one's queue is full events are dropped and counted;
    the reader gets exactly the events counted as published."""
    d, ep = start_with_events(daemon_factory)
    c, slow = kv(d, ep, rcvhwm=1)                # never read after the sync
    fast_ctx = zmq.Context()
    fast = kvtier.Subscriber(ep, context=fast_ctx)
    received = [0]
    stop = threading.Event()
    t = None
    try:
        sync(c, fast)
        st0 = c.stats()
        assert st0["events_dropped_total"] == 0, st0

        def reader():
            while not stop.is_set():
                if fast.recv(50) is not None:
                    received[0] += 1
        t = threading.Thread(target=reader, daemon=True)
        t.start()

        pings = []
        sent = 0
        window = 256
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            # a window of pipelined PUTs of fresh keys, then of REMOVEs of them: one event
            # each (requests in flight together may complete in any order)
            ks = [os.urandom(16) for _ in range(window // 2)]
            uids = [c.send(kvtier.PUT, {"ns": NS, "keys": [kk]}, [b"e"]) for kk in ks]
            sent += sum(c.recv(u)[0]["stored"] for u in uids)
            uids = [c.send(kvtier.REMOVE, {"ns": NS, "keys": [kk]}) for kk in ks]
            sent += sum(c.recv(u)[0]["removed"] for u in uids)
            assert sent % window == 0
            t0 = time.perf_counter()
            c.ping()
            pings.append((time.perf_counter() - t0) * 1e3)
            if sent % (16 * window) == 0 and c.stats()["events_dropped_total"] > 0:
                break

        def accounted():              # the publisher thread has dealt with every event
            st = c.stats()
            n = (st["events_dropped_total"] - st0["events_dropped_total"],
                 st["events_published_total"] - st0["events_published_total"])
            return n if sum(n) >= sent else None
        dropped, published = wait_until(accounted, timeout=10, interval=0.1,
                                        what="published + dropped to reach %d" % sent)
        print("\n%d events generated: %d published, %d dropped; PING max %.2f ms, "
              "median %.2f ms over %d pings"
              % (sent, published, dropped, max(pings), sorted(pings)[len(pings) // 2],
                 len(pings)))
        assert dropped > 0, "no event dropped after %d events with a subscriber that never " \
            "reads (published %d)" % (sent, published)
        assert published + dropped == sent, (published, dropped, sent)
        assert max(pings) < 100, "PING took %.1f ms while events were dropped" % max(pings)

        # the reader got every published event and nothing else
        wait_until(lambda: received[0] >= published, timeout=20, interval=0.1,
                   what="the reading subscriber to receive every published event "
                        "(%d of %d)" % (received[0], published))
        time.sleep(QUIET_MS / 1000)
        assert received[0] == published, (received[0], published)
    finally:
        stop.set()
        if t is not None:
            t.join(5)
        fast.close()
        fast_ctx.destroy(linger=0)

    # the slow subscriber goes away: nothing is dropped any more
    slow.close()
    time.sleep(0.2)
    st2 = c.stats()
    for i in range(50):
        c.put(NS, [key(i, b"after")], [b"a"])
    st3 = c.stats()
    assert st3["events_dropped_total"] == st2["events_dropped_total"], (st2, st3)
    assert d.alive()


def test_embedding_events_translation():
    """EmbeddingEvents.translate on its own: the namespace read back into model, dtype and
    hidden size; the daemon's kinds mapped to add/evict per tier; names remembered for the
    events without labels, at most max_names of them; other namespaces skipped."""
    from kvtier.events import ec_namespace, parse_ec_namespace
    for ns, want in [
            (ec_namespace("vllm-ec/org/m-7b", "bfloat16", 4096),
             ("vllm-ec/org/m-7b", "org/m-7b", "bfloat16", 4096)),
            (ec_namespace("vllm-ec/m", "float16"), ("vllm-ec/m", "m", "float16", None)),
            (ec_namespace("tenant-x/enc", "bfloat16", 64), ("tenant-x/enc", "tenant-x/enc",
                                                            "bfloat16", 64))]:
        p = parse_ec_namespace(ns)
        assert (p["namespace"], p["model"], p["dtype"], p["hidden"]) == want, (ns, p)
    assert parse_ec_namespace("plain") is None
    ee = kvtier.EmbeddingEvents(None, max_names=2)
    ns = "vllm-ec/m/bfloat16/h8"
    k = [bytes([i]) * 16 for i in range(4)]
    got = ee.translate({"event": "stored", "ns": ns, "salt": "", "tier": "l1", "keys": k[:3],
                        "sizes": [10, 20, 30], "labels": ["a", None, "c"]})
    assert [(e["event"], e["tier"], e["mm_hash"], e["size"], e["model"], e["hidden"])
            for e in got] == [("add", "l1", "a", 10, "m", 8), ("add", "l1", None, 20, "m", 8),
                              ("add", "l1", "c", 30, "m", 8)]
    got = ee.translate({"event": "l2_removed", "ns": ns, "salt": "", "tier": "l2",
                        "keys": [k[2], k[0]]})
    assert [(e["event"], e["tier"], e["mm_hash"], e["size"], e["cause"]) for e in got] == \
        [("evict", "l2", "c", None, "l2_removed"), ("evict", "l2", "a", None, "l2_removed")]
    ee.translate({"event": "stored", "ns": ns, "salt": "", "keys": [k[3]], "sizes": [1],
                  "labels": ["d"]})                 # a third name: the oldest ("a") goes
    got = ee.translate({"event": "evicted", "ns": ns, "salt": "", "keys": [k[0], k[3]],
                        "sizes": [10, 1]})
    assert [e["mm_hash"] for e in got] == [None, "d"]
    assert ee.translate({"event": "stored", "ns": "other/ns", "keys": [k[0]]}) == []
    # the same key in another namespace or salt is another item; short arrays pad with None
    got = ee.translate({"event": "stored", "ns": "vllm-ec/other/float16", "salt": "t",
                        "keys": [k[3], k[1]], "sizes": [5], "labels": ["e"]})
    assert [(e["mm_hash"], e["size"], e["model"], e["hidden"]) for e in got] == \
        [("e", 5, "other", None), (None, None, "other", None)]
    got = ee.translate({"event": "evicted", "ns": ns, "salt": "", "keys": [k[3]]})
    assert got[0]["mm_hash"] == "d"
    with pytest.raises(ValueError, match="translate"):
        ee.recv(0)
    from kvtier.hashing import label_of
    assert label_of("x" * 255) == "x" * 255 and label_of("x" * 256) is None
    assert label_of("\u00e9" * 127) is not None and label_of("\u00e9" * 128) is None
    assert label_of("a\udcff") is None and label_of(bytearray(b"mm")) == "mm"
    assert label_of(b"\xff") is None and label_of(7) is None
