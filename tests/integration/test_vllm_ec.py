"""kvtier.vllm.KvtierECConnector, loaded the way vLLM's ECConnectorFactory loads a connector by
module path and driven the way vLLM's scheduler and model runner call it (vllm_ec_iface:
Scheduler, Worker), against the real daemon: an encoder (producer) engine saves embeddings,
a prefill (consumer) engine finds them instead of running its encoder, byte for byte, with
every TP worker reading the one copy; L2-only items brought back through
ensure_cache_available; an item removed or pushed out between has_cache_item and the load;
the daemon killed mid-run; two models with the same mm_hash; bad configuration; and the
daemon's events as a coordinator reads them (kvtier.EmbeddingEvents): add and evict per item
with its mm_hash, size, tier and model."""

import signal
import time

import pytest

torch = pytest.importorskip("torch")

import vllm_ec_iface  # noqa: E402
from vllm_ec_iface import Request, Scheduler, Worker, feature, vllm_config  # noqa: E402

vllm_ec_iface.install()                   # before kvtier.vllm binds its base class
import kvtier  # noqa: E402
from kvtier.vllm import HEADER_BYTES, KvtierECConnector, ec_key  # noqa: E402

from kvtest import closing_factory, metric_value, wait_until  # noqa: E402
from test_c_client import restart_daemon  # noqa: E402
from test_events import start_with_events, sync  # noqa: E402

HIDDEN = 64


def embed(f):
    """The 'encoder': a deterministic embedding per item, (length, HIDDEN) bf16."""
    g = torch.Generator().manual_seed(hash(f.identifier) & 0xFFFFFFFF)
    return torch.randn(f.mm_position.length, HIDDEN, generator=g).to(torch.bfloat16)


def request(rid, *items):
    """A request with images (mm_hash, tokens) back to back from offset 10."""
    feats, off = [], 10
    for h, n in items:
        feats.append(feature(h, off, n))
        off += n + 5
    return Request(rid, feats)


class Engine:
    """One vLLM engine: its scheduler and `tp` workers, the connector in each."""

    def __init__(self, d, role, tp=1, model="test/vl-model", extra=None, **sched_kw):
        ex = dict({"endpoint": d.ipc, "timeout_ms": 1000, "reconnect_interval_ms": 100},
                  **(extra or {}))
        self.sched = Scheduler(vllm_config(role, ex, model=model, hidden=HIDDEN), **sched_kw)
        self.workers = [Worker(vllm_config(role, ex, model=model, hidden=HIDDEN, tp_size=tp,
                                           rank=r), embed) for r in range(tp)]

    def step(self, *reqs):
        out, deferred = self.sched.schedule(list(reqs))
        outs = [w.execute(out) for w in self.workers]
        self.sched.update_from_output(out, outs[0])
        return out, deferred, outs

    def finish(self, *reqs):
        for r in reqs:
            self.sched.finish(r)

    def close(self):
        for c in [self.sched.connector] + [w.connector for w in self.workers]:
            c.shutdown()


@pytest.fixture
def engines():
    yield from closing_factory(Engine, Engine.close)


def requests_of(d, type_):
    return metric_value(d.metrics()[1], "kvtier_requests_total", type=type_) or 0


def test_the_connector_is_an_ec_connector_base():
    assert issubclass(KvtierECConnector, vllm_ec_iface.ECConnectorBase)
    for name in ("has_cache_item", "update_state_after_alloc", "build_connector_meta",
                 "start_load_caches", "save_caches"):
        assert name in KvtierECConnector.__dict__, name


def test_producer_saves_consumer_loads_byte_exact(daemon, engines):
    enc = engines(daemon, "ec_producer")
    r = request("r1", ("img-a", 12), ("img-b", 7))
    out, deferred, outs = enc.step(r)
    assert not deferred
    assert enc.workers[0].computed == ["img-a", "img-b"]
    assert outs[0].finished_sending == {"img-a", "img-b"}
    st = enc.workers[0].connector.stats()
    assert st["saved"] == 2 and st["errors"] == 0, st
    # stored as header + tensor, in the model's namespace
    c = kvtier.Client(daemon.ipc)
    ns = enc.workers[0].connector.ns
    assert ns == "vllm-ec/test/vl-model/bfloat16/h%d" % HIDDEN
    assert c.lookup(ns, [ec_key("img-a"), ec_key("img-b")]).l1 == 2
    blob = c.fetch(ns, [ec_key("img-a")])[0]
    assert len(blob) == HEADER_BYTES + 12 * HIDDEN * 2
    # the prefill engine: one image saved, one new
    pre = engines(daemon, "ec_consumer")
    r2 = request("r2", ("img-a", 12), ("img-c", 9))
    out, deferred, outs = pre.step(r2)
    assert [how for _, how in out.scheduled["r2"]] == ["load", "compute"]
    w = pre.workers[0]
    assert w.computed == ["img-c"]                 # the encoder ran for the new image only
    assert torch.equal(w.encoder_cache["img-a"], embed(r2.mm_features[0]))
    assert outs[0].finished_recving == {"img-a"}
    assert pre.sched.connector.stats()["pinned"] == 1
    pre.finish(r2)
    assert pre.sched.connector.stats()["pinned"] == 0
    # a consumer does not save what it computed
    assert c.lookup(ns, [ec_key("img-c")]).hits == 0


def test_two_tp_workers_read_one_copy_without_requests(daemon, engines):
    enc = engines(daemon, "ec_both")
    enc.step(request("p", ("shared", 20)))
    pre = engines(daemon, "ec_consumer", tp=2)
    acq = requests_of(daemon, "acquire")
    out, _, outs = pre.step(request("q", ("shared", 20)))
    assert requests_of(daemon, "acquire") == acq + 1   # the scheduler's pin, nothing more
    a, b = (w.encoder_cache["shared"] for w in pre.workers)
    assert torch.equal(a, b) and torch.equal(a, embed(feature("shared", 10, 20)))
    assert a.data_ptr() != b.data_ptr()           # each worker's own copy on its device
    assert all(o.finished_recving == {"shared"} for o in outs)
    assert all(w.computed == [] for w in pre.workers)


def test_both_role_and_repeated_items(daemon, engines):
    e = engines(daemon, "ec_both")
    r1 = request("a", ("x", 5), ("y", 6))
    e.step(r1)
    assert e.workers[0].computed == ["x", "y"]
    # a second engine asks for x twice in one step (two requests): loaded once, no compute
    e2 = engines(daemon, "ec_both")
    out, _, _ = e2.step(request("b", ("x", 5)), request("c", ("x", 5), ("y", 6)))
    assert e2.workers[0].computed == []
    assert set(e2.workers[0].encoder_cache) == {"x", "y"}


def test_l2_only_items_come_back_through_ensure_cache_available(daemon_factory, engines):
    """The fs L2 (the default) and an L1 of 8 MiB: an item pushed out of L1 defers its
    request while it loads from L2, then is loaded by the workers instead of computed."""
    d = daemon_factory("--l1-size", "8M")
    enc = engines(d, "ec_producer")
    enc.step(request("p", ("old-image", 30)))
    c = kvtier.Client(d.ipc)
    ns = enc.workers[0].connector.ns
    wait_until(lambda: metric_value(d.metrics()[1], "kvtier_l2_stored_total") >= 1, 10,
               what="the item written behind to L2")
    filler = [bytes([i]) * 16 for i in range(24)]
    for i in range(0, 24, 4):                       # 12 MiB of other objects
        c.put("filler", filler[i:i + 4], [b"f" * (512 * 1024)] * 4)
    assert c.lookup(ns, [ec_key("old-image")]).l1 == 0
    assert c.lookup(ns, [ec_key("old-image")]).hits == 1
    pre = engines(d, "ec_consumer")
    r = request("q", ("old-image", 30))
    deadline = time.monotonic() + 10
    while True:
        out, deferred, _ = pre.step(r)
        if not deferred:
            break
        assert time.monotonic() < deadline, "still deferred"
        time.sleep(0.01)
    assert pre.sched.connector.stats()["deferred"] >= 1
    assert [how for _, how in out.scheduled["q"]] == ["load"]
    assert pre.workers[0].computed == []
    assert torch.equal(pre.workers[0].encoder_cache["old-image"],
                       embed(feature("old-image", 10, 30)))

    # three items in L2 only, one nowhere between them: a LOOKUP per item found nowhere plus
    # one (not one per item), one load job, and the request loads all three
    enc.step(request("p2", ("l2-a", 20), ("l2-b", 20), ("l2-c", 20)))
    wait_until(lambda: metric_value(d.metrics()[1], "kvtier_l2_stored_total") >= 4, 10,
               what="the items written behind to L2")
    for i in range(0, 24, 4):
        c.put("filler2", filler[i:i + 4], [b"g" * (512 * 1024)] * 4)
    assert c.lookup(ns, [ec_key(h) for h in ("l2-a", "l2-b", "l2-c")]).l1 == 0
    r = request("q3", ("l2-a", 20), ("l2-b", 20), ("never", 20), ("l2-c", 20))
    before = requests_of(d, "lookup")
    out, deferred, _ = pre.step(r)
    assert deferred and requests_of(d, "lookup") - before == 2
    deadline = time.monotonic() + 10
    while deferred:
        assert time.monotonic() < deadline, "still deferred"
        time.sleep(0.01)
        out, deferred, _ = pre.step(r)
    assert [how for _, how in out.scheduled["q3"]] == ["load", "load", "compute", "load"]


def test_removed_and_evicted_after_has_cache_item_still_load_right(daemon_factory, engines):
    """Between has_cache_item (the pin) and the workers' load, the item is removed and L1 is
    flooded: the pinned bytes stay until the request finishes, and the load is exact."""
    d = daemon_factory("--l1-size", "8M", "--l2", "none")
    enc = engines(d, "ec_producer")
    enc.step(request("p", ("img", 40)))
    pre = engines(d, "ec_consumer")
    r = request("q", ("img", 40))
    out, deferred = pre.sched.schedule([r])
    assert not deferred and [how for _, how in out.scheduled["q"]] == ["load"]
    c = kvtier.Client(d.ipc)
    ns = pre.sched.connector.ns
    assert c.remove(ns, [ec_key("img")]) == 1
    for i in range(24):                             # 12 MiB through 8 MiB: evictions
        c.put("flood", [bytes([i]) * 16], [bytes([i]) * (512 * 1024)])
    pre.workers[0].execute(out)
    assert torch.equal(pre.workers[0].encoder_cache["img"], embed(feature("img", 10, 40)))
    pre.finish(r)
    assert c.lookup(ns, [ec_key("img")]).hits == 0
    # asked again: not there, so computed (never wrong bytes)
    out, _, _ = pre.step(request("q2", ("img", 40)))
    assert [how for _, how in out.scheduled["q2"]] == ["compute"]


def test_daemon_killed_mid_run_means_misses_then_back(daemon_factory, engines):
    d = daemon_factory("--l2", "none")
    e = engines(d, "ec_both", extra={"timeout_ms": 300})
    e.step(request("a", ("k1", 4)))
    d.stop(signal.SIGKILL)
    time.sleep(0.02)
    t0 = time.monotonic()
    out, deferred, outs = e.step(request("b", ("k2", 4), ("k1", 4)))
    assert time.monotonic() - t0 < 1.5               # one timeout per side, then misses
    assert not deferred
    assert e.workers[0].computed[-1] == "k2"       # computed; k1 the engine's own cache has
    st = e.sched.connector.stats()
    assert st["down"] is True and st["outages"] == 1, st
    d2 = restart_daemon(daemon_factory, d)          # same endpoint, another arena
    time.sleep(0.2)                                 # past reconnect_interval_ms
    e.step(request("c", ("k3", 4)))                 # saved to the new daemon
    wait_until(lambda: kvtier.Client(d2.ipc).lookup(e.sched.connector.ns,
                                                    [ec_key("k3")]).hits == 1, 5,
               what="the item saved to the restarted daemon")
    out, _, _ = engines(d2, "ec_consumer").step(request("d", ("k3", 4)))
    assert [how for _, how in out.scheduled["d"]] == ["load"]


def test_coordinator_events_name_item_size_tier_and_model(daemon_factory, engines):
    """Two models save items (one mm_hash in both); L1 is flooded (evicted, still in L2); one
    comes back from L2 for a consumer; one is removed. A coordinator's EmbeddingEvents sees
    every add and evict per item with its mm_hash, size, tier and model — also on the events
    that carry no label (L2 writes, the load from L2), and nothing of other namespaces."""
    d, ep = start_with_events(daemon_factory, "--l1-size", "8M")
    c = kvtier.Client(d.ipc)
    coord = kvtier.EmbeddingEvents(ep, context=d.ctx)
    try:
        sync(c, coord.subscriber)
        a = engines(d, "ec_producer", model="org/model-a")
        a.step(request("p", ("img-1", 12), ("img-2", 20)))
        b = engines(d, "ec_producer", model="org/model-b")
        b.step(request("p", ("img-1", 12)))
        size = {n: HEADER_BYTES + n * HIDDEN * 2 for n in (12, 20)}
        seen = []

        def have(pred, what, since=0):
            def check():
                seen.extend(coord.drain(50))
                return any(pred(e) for e in seen[since:])
            wait_until(check, 10, interval=0.05, what=what)

        for model, h, n in (("org/model-a", "img-1", 12), ("org/model-a", "img-2", 20),
                            ("org/model-b", "img-1", 12)):
            for tier in ("l1", "l2"):
                have(lambda e: (e["event"], e["model"], e["mm_hash"], e["tier"]) ==
                     ("add", model, h, tier) and e["size"] == size[n],
                     "add of %s/%s in %s" % (model, h, tier))
        e = next(e for e in seen if e["mm_hash"] == "img-2")
        assert (e["dtype"], e["hidden"], e["key"]) == ("bfloat16", HIDDEN, ec_key("img-2")), e
        assert e["namespace"] == "vllm-ec/org/model-a", e
        # L1 flooded by other objects: each item evicted from L1, named
        for i in range(0, 24, 4):
            c.put("filler", [bytes([i + j]) * 16 for j in range(4)],
                  [b"f" * (512 * 1024)] * 4)
        for model, h in (("org/model-a", "img-1"), ("org/model-a", "img-2"),
                         ("org/model-b", "img-1")):
            have(lambda e: (e["event"], e["tier"], e["model"], e["mm_hash"], e["cause"]) ==
                 ("evict", "l1", model, h, "evicted"), "eviction of %s/%s" % (model, h))
        # back from L2 for a consumer of model a: an add in L1, named from memory
        n_before = len(seen)
        pre = engines(d, "ec_consumer", model="org/model-a")
        deadline = time.monotonic() + 10
        while pre.step(request("q", ("img-2", 20)))[1]:
            assert time.monotonic() < deadline, "still deferred"
            time.sleep(0.01)
        have(lambda e: (e["event"], e["tier"], e["mm_hash"], e["model"]) ==
             ("add", "l1", "img-2", "org/model-a"), "the load of img-2 from L2", n_before)
        # removed: an evict with its cause
        assert c.remove(pre.sched.connector.ns, [ec_key("img-2")]) == 1
        have(lambda e: (e["event"], e["tier"], e["mm_hash"], e["cause"], e["size"]) ==
             ("evict", "l1", "img-2", "removed", size[20]), "the removal of img-2")
        assert all(e["namespace"].startswith("vllm-ec/") for e in seen), seen
        assert all(e["mm_hash"] in ("img-1", "img-2") for e in seen), seen
    finally:
        coord.close()
        c.close()


def test_two_models_with_one_mm_hash_never_mix(daemon, engines):
    a = engines(daemon, "ec_producer", model="org/model-a")
    a.step(request("p", ("same-hash", 8)))
    b = engines(daemon, "ec_consumer", model="org/model-b")
    out, _, _ = b.step(request("q", ("same-hash", 8)))
    assert [how for _, how in out.scheduled["q"]] == ["compute"]
    a2 = engines(daemon, "ec_consumer", model="org/model-a")
    out, _, _ = a2.step(request("q", ("same-hash", 8)))
    assert [how for _, how in out.scheduled["q"]] == ["load"]


@pytest.mark.parametrize("key,value,why", [
    ("timeout_ms", 0, "timeout_ms must be an integer >= 1"),
    ("timeout_ms", "fast", "timeout_ms must be an integer"),
    ("pin_timeout_ms", 10, "pin_timeout_ms must be an integer >= 1000"),
    ("endpoint", "", "endpoint must be a non-empty string"),
    ("device", 3, "device must be a non-empty string"),
])
def test_bad_config_is_refused_naming_the_key(daemon, key, value, why):
    with pytest.raises(ValueError, match=why):
        KvtierECConnector(vllm_config("ec_both", {"endpoint": daemon.ipc, key: value}),
                          vllm_ec_iface.ECConnectorRole.SCHEDULER)
