"""kvtier.sglang.KvtierHiCacheStorage, loaded the way SGLang's factory loads a dynamic backend
(module path + class name, issubclass(HiCacheStorage), cls(storage_config, {}), then
register_mem_pool_host), driven the way HiCacheController drives it (sglang_iface.Controller:
the zero-copy v1 calls and the generic tensor calls), over CPU torch host pools, against the
real daemon. Also: the installed package itself (make test runs these tests on a venv where
`pip install ./client/python` put it)."""

import importlib.metadata
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")

import sglang_iface  # noqa: E402
from sglang_iface import Controller, HostPool, config, create_backend  # noqa: E402

sglang_iface.install()                    # before kvtier.sglang binds its base class
import kvtier  # noqa: E402
import kvtier.sglang  # noqa: E402
from kvtier.sglang import KvtierHiCacheStorage, page_key  # noqa: E402

from kvtest import wait_until  # noqa: E402
from test_c_client import restart_daemon  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXTRA = {"backend_name": "kvtier", "module_path": "kvtier.sglang",
         "class_name": "KvtierHiCacheStorage", "interface_v1": 1}


def hashes(n, tag="p"):
    """Page hashes as SGLang makes them: 64 hex digits each (chained SHA-256)."""
    import hashlib
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + ("%s%d" % (tag, i)).encode()).digest()
        out.append(prev.hex())
    return out


@pytest.fixture
def backends():
    made = []

    def make(endpoint, pool, v1=True, **kw):
        extra = dict(EXTRA, endpoint=endpoint, **kw.pop("extra", {}))
        if not v1:
            extra.pop("interface_v1")
        b = create_backend("dynamic", config(extra, **kw), pool)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def roundtrip(backends, d, v1, n=6, **pool_kw):
    """Backs n pages up from one pool and loads them into another (another rank's backend)."""
    src = HostPool(pages=16, **pool_kw)
    dst = HostPool(pages=16, **pool_kw)
    a = Controller(backends(d.ipc, src, v1=v1, mla=pool_kw.get("mla", False)), src, v1)
    b = Controller(backends(d.ipc, dst, v1=v1, mla=pool_kw.get("mla", False)), dst, v1)
    keys = hashes(n)
    si, di = src.alloc(n * src.page_size), dst.alloc(n * dst.page_size)
    src.fill(si, seed=7)
    assert a.backup(keys, si)
    assert b.hits(keys) == n
    assert b.load(keys, di) == n
    for x, y in zip(src.pages(si), dst.pages(di)):
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.bfloat16 else x,
                           y.view(torch.uint8) if y.dtype == torch.bfloat16 else y)
    return a, b, keys


def l2_stored(d):
    return sum(s.value for s in d.metrics()[1] if s.name == "kvtier_l2_stored_total")


# -- the package -------------------------------------------------------------------------------

def test_the_installed_package_is_imported_with_the_daemons_version():
    """make test installs client/python into a venv: these tests import that copy."""
    src = os.path.join(REPO, "client", "python") + os.sep
    assert not os.path.abspath(kvtier.__file__).startswith(src), kvtier.__file__
    with open(os.path.join(REPO, "VERSION")) as f:
        version = f.read().strip()
    assert kvtier.__version__ == version
    assert importlib.metadata.version("kvtier") == version


def test_backend_is_a_hicache_storage_with_every_abstract_method(daemon, backends):
    b = backends(daemon.ipc, HostPool(pages=4))
    assert isinstance(b, sglang_iface.HiCacheStorage)
    assert type(b).__abstractmethods__ == frozenset()
    assert b.ns.startswith("sglang/test/model/tp0of1/mha.page_first.bfloat16.2x16x4x2x64")


def test_without_sglang_the_module_imports_and_works(daemon):
    """SGLang absent (a plain venv): the backend still imports and moves pages."""
    code = r"""
import sys, torch
import kvtier.sglang as ks
assert "sglang.srt.mem_cache.hicache_storage" not in sys.modules
sys.path.insert(0, %r)
from sglang_iface import HostPool, HiCacheStorageConfig
cfg = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, True, "m",
                           extra_config={"endpoint": %r})
pool = HostPool(pages=4)
b = ks.KvtierHiCacheStorage(cfg, {})
b.register_mem_pool_host(pool)
idx = pool.alloc(2 * pool.page_size)
pool.fill(idx, 1)
assert b.batch_set_v1(["a", "b"], idx) == [True, True]
assert b.batch_exists(["a", "b", "c"]) == 2
b.close()
print("ok")
""" % (os.path.dirname(os.path.abspath(__file__)), daemon.ipc)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_bad_config_is_refused_naming_the_key(daemon):
    for bad in ({"timeout_ms": 0}, {"timeout_ms": "fast"}, {"max_connections": 0},
                {"endpoint": ""}, {"heartbeat_ms": -1}, {"namespace": 5},
                {"shared_memory": "yes"}):
        key = next(iter(bad))
        with pytest.raises(ValueError, match=key):
            KvtierHiCacheStorage(config(dict(EXTRA, **dict({"endpoint": daemon.ipc}, **bad))), {})


def test_page_key_is_blake2b_128_of_the_hash_string():
    import hashlib
    h = hashes(1)[0]
    assert page_key(h) == hashlib.blake2b(h.encode(), digest_size=16).digest()
    assert len(page_key("x")) == 16 and page_key("x") != page_key("y")


def test_page_keys_remembers_without_changing_a_key(monkeypatch):
    """page_keys: the same keys as page_key, hashed once per string (SGLang asks for the same
    pages again and again), bytes hashes too; a full memo starts over, still right."""
    from kvtier import sglang as ks
    monkeypatch.setattr(ks, "_KEYS", {})
    monkeypatch.setattr(ks, "_KEYS_MAX", 8)
    calls = []
    real = ks.page_key
    monkeypatch.setattr(ks, "page_key", lambda h: calls.append(h) or real(h))
    hs = hashes(6, "memo") + [b"raw-bytes"]
    want = [real(h) for h in hs]
    assert ks.page_keys(hs) == want and len(calls) == 7
    assert ks.page_keys(hs) == want and len(calls) == 8      # only the bytes hash again
    more = hashes(5, "more")
    assert ks.page_keys(more + hs) == [real(h) for h in more + hs]
    assert len(ks._KEYS) <= 8


# -- pages in and out -------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct",
                                    "page_head"])
@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
def test_set_exists_get_byte_exact(daemon, backends, layout, v1):
    roundtrip(backends, daemon, v1, layout=layout)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mla_pages_byte_exact(daemon, backends, layout):
    roundtrip(backends, daemon, True, mla=True, layout=layout, dtype=torch.float16)


def test_v1_and_generic_paths_store_the_same_bytes(daemon, backends):
    """A page stored through batch_set_v1 reads back through batch_get, and the other way."""
    pool, other = HostPool(pages=8), HostPool(pages=8)
    v1 = Controller(backends(daemon.ipc, pool, v1=True), pool, True)
    gen = Controller(backends(daemon.ipc, other, v1=False), other, False)
    k1, k2 = hashes(3, "v1"), hashes(3, "gen")
    i1, i2 = pool.alloc(3 * 16), other.alloc(3 * 16)
    pool.fill(i1, 1)
    other.fill(i2, 2)
    assert v1.backup(k1, i1) and gen.backup(k2, i2)
    j1, j2 = other.alloc(3 * 16), pool.alloc(3 * 16)
    assert gen.load(k1, j1) == 3 and v1.load(k2, j2) == 3
    assert all(torch.equal(a, b) for a, b in zip(pool.pages(i1), other.pages(j1)))
    assert all(torch.equal(a, b) for a, b in zip(other.pages(i2), pool.pages(j2)))


def test_single_page_calls(daemon, backends):
    """get / set / exists, by position and by keyword (SGLang's base class names them)."""
    pool = HostPool(pages=4)
    b = backends(daemon.ipc, pool, v1=False)
    idx = pool.alloc(16)
    pool.fill(idx, 3)
    page = pool.get_data_page(0)
    assert not b.exists("one") and b.get("one") is None
    assert b.set("one", page) is True
    assert b.exists("one")
    got = b.get("one", pool.get_dummy_flat_data_page())
    assert torch.equal(got, page)
    assert torch.equal(b.get("one"), page)          # no target: a new tensor
    assert b.set(key="kw", value=page) is True
    assert b.exists(key="kw") is True
    assert torch.equal(b.get(key="kw", target_location=pool.get_dummy_flat_data_page()), page)
    assert b.batch_exists(keys=["kw", "nope"]) == 1
    assert b.batch_set_v1(keys=["kw"], host_indices=idx) == [True]
    assert b.stats()["errors"] == 0


def test_two_ranks_share_one_copy(daemon, backends):
    """Two data-parallel ranks (two backends, same TP rank): the second finds the first's
    pages, and setting them again stores nothing new."""
    a, b, keys = roundtrip(backends, daemon, True, n=5)
    before = kvtier.Client(daemon.ipc).stats()
    pool = b.pool
    idx = pool.alloc(5 * 16)
    pool.fill(idx, 99)                              # other bytes, same hashes
    assert b.backup(keys, idx)                      # already stored: skipped, reported True
    after = kvtier.Client(daemon.ipc).stats()
    assert after["l1_objects"] == before["l1_objects"]
    assert b.backend.stats()["set_skipped"] == 5
    assert b.backend.ns == a.backend.ns


def test_partial_hits_count_the_leading_pages(daemon, backends):
    pool = HostPool(pages=16)
    c = Controller(backends(daemon.ipc, pool), pool)
    keys = hashes(8)
    idx = pool.alloc(8 * 16)
    pool.fill(idx, 5)
    assert c.backup(keys[:3], idx[:3 * 16])
    assert c.backup(keys[4:6], idx[4 * 16:6 * 16])  # a hole at page 3
    assert c.hits(keys) == 3
    dst = pool.alloc(8 * 16)
    assert c.backend.batch_get_v1(keys, dst) == [True] * 3 + [False] * 5
    assert c.hits(keys[4:]) == 2


def test_exists_of_pages_in_l1_sends_no_request(daemon, backends, monkeypatch):
    """batch_exists of pages all in L1 is answered from the residency map (no LOOKUP, no
    daemon to wake); a batch running past L1 still asks the daemon, which counts L2 too."""
    from kvtest import metric_value
    monkeypatch.delenv("KVTIER_FASTPATH", raising=False)
    if not kvtier._ring.has_resident(kvtier._ring.library()):
        pytest.skip("no kvtier_resident_prefix in the ring library: %s" % kvtier._ring.why)

    def lookups():
        return metric_value(daemon.metrics()[1], "kvtier_requests_total", type="lookup") or 0

    pool = HostPool(pages=16)
    c = Controller(backends(daemon.ipc, pool), pool)
    keys = hashes(8, "rm")
    idx = pool.alloc(8 * 16)
    pool.fill(idx, 3)
    assert c.backup(keys[:6], idx[:6 * 16])
    before = lookups()
    for _ in range(5):
        assert c.hits(keys[:6]) == 6
    assert lookups() == before
    assert c.backend.stats()["exists_local"] == 5
    assert c.hits(keys) == 6                      # past L1: one LOOKUP
    assert lookups() == before + 1
    assert c.backend.stats()["exists_local"] == 5
    kvtier.Client(daemon.ipc).remove(c.backend.ns, [kvtier.sglang.page_key(keys[2])])
    assert c.hits(keys[:6]) == 2                  # the map saw the REMOVE: LOOKUP again
    assert lookups() == before + 2


def test_eviction_turns_into_misses(daemon_factory, backends):
    """No L2 and an L1 of 8 MiB: pages pushed out by newer ones are misses, not errors."""
    d = daemon_factory("--l2", "none", "--l1-size", "8M")
    pool = HostPool(pages=64, layers=8, heads=4, head_dim=128, page_size=16)   # 256 KiB pages
    c = Controller(backends(d.ipc, pool), pool)
    assert c.backend.page_bytes == 256 * 1024
    keys = hashes(64)
    idx = pool.alloc(64 * 16)
    pool.fill(idx, 11)
    for i in range(0, 64, 8):
        c.backup(keys[i:i + 8], idx[i * 16:(i + 8) * 16])
    assert c.hits(keys[:8]) == 0
    assert c.backend.batch_get_v1(keys[:8], idx[:8 * 16]) == [False] * 8
    assert c.hits(keys[-8:]) == 8


def test_pages_only_in_l2_are_loaded_back(daemon_factory, backends):
    """With the fs L2 (the default): pages evicted from L1 still count in batch_exists and
    come back byte-exact through batch_get_v1 (a prefetch)."""
    d = daemon_factory("--l1-size", "8M", "--l2-backlog-max", "1")  # all pages reach L2
    pool = HostPool(pages=64, layers=8, heads=4, head_dim=128, page_size=16)
    c = Controller(backends(d.ipc, pool, extra={"timeout_ms": 5000}), pool)
    keys = hashes(48)
    idx = pool.alloc(48 * 16)
    pool.fill(idx, 13)
    want = pool.pages(idx[:8 * 16])
    for i in range(0, 48, 8):
        c.backup(keys[i:i + 8], idx[i * 16:(i + 8) * 16])
        wait_until(lambda: l2_stored(d) >= i + 8, 10, what="pages written behind to L2")
    wait_until(lambda: kvtier.Client(d.ipc).lookup(c.backend.ns, [page_key(k) for k in
                                                                  keys[:8]]).l1 == 0, 10,
               what="first pages out of L1")
    assert c.hits(keys[:8]) == 8
    dst = pool.alloc(8 * 16)
    assert c.load(keys[:8], dst) == 8
    assert all(torch.equal(a, b) for a, b in zip(want, pool.pages(dst)))


# -- isolation ------------------------------------------------------------------------------------

def test_layouts_never_mix(daemon, backends):
    """Another layout, dtype or page size is another namespace: no hits across them; a page of
    the wrong size handed to batch_set is refused, and nothing is stored."""
    base = HostPool(pages=8)
    c = Controller(backends(daemon.ipc, base), base)
    keys = hashes(4)
    idx = base.alloc(4 * 16)
    base.fill(idx, 1)
    assert c.backup(keys, idx)
    for kw in ({"layout": "layer_first"}, {"dtype": torch.float16}, {"page_size": 32},
               {"heads": 4, "head_dim": 32}):
        other = HostPool(pages=8, **kw)
        o = Controller(backends(daemon.ipc, other), other)
        assert o.backend.ns != c.backend.ns
        assert o.hits(keys) == 0
        assert o.load(keys, other.alloc(4 * other.page_size)) == 0
    # pages of another size through the generic calls (draft KV) go to a namespace of that
    # size: stored, never seen as KV pages; a batch that mixes sizes stores its leading run
    gen = backends(daemon.ipc, base, v1=False)
    objects = kvtier.Client(daemon.ipc).stats()["l1_objects"]
    assert gen.batch_set(hashes(2, "w"), [torch.zeros(100), torch.zeros(100)]) is True
    assert kvtier.Client(daemon.ipc).stats()["l1_objects"] == objects + 2
    assert gen.batch_exists(hashes(2, "w")) == 0
    assert gen.batch_set(hashes(2, "x"), [torch.zeros(100), torch.zeros(99)]) is False
    assert kvtier.Client(daemon.ipc).stats()["l1_objects"] == objects + 3


def test_tp_ranks_isolated_mla_shared(daemon, backends):
    pool = HostPool(pages=8)
    r0 = Controller(backends(daemon.ipc, pool, tp_rank=0, tp_size=2), pool)
    r1 = Controller(backends(daemon.ipc, HostPool(pages=8), tp_rank=1, tp_size=2), pool)
    keys = hashes(2)
    idx = pool.alloc(2 * 16)
    pool.fill(idx, 4)
    assert r0.backup(keys, idx)
    assert r1.hits(keys) == 0                       # rank 1 holds other heads
    mpool = HostPool(pages=8, mla=True)
    m0 = Controller(backends(daemon.ipc, mpool, tp_rank=0, tp_size=2, mla=True), mpool)
    m1 = Controller(backends(daemon.ipc, HostPool(pages=8, mla=True), tp_rank=1, tp_size=2,
                             mla=True), mpool)
    midx = mpool.alloc(2 * 16)
    mpool.fill(midx, 4)
    assert m0.backup(keys, midx)
    assert m1.hits(keys) == 2                       # latent KV: the same on every rank


def test_clear_removes_only_its_namespace(daemon_factory, backends):
    """clear() is CLEAR of the backend's namespace (L1; an L2 keeps its copies)."""
    daemon = daemon_factory("--l2", "none")
    p1, p2 = HostPool(pages=4), HostPool(pages=4, layout="layer_first")
    a, b = Controller(backends(daemon.ipc, p1), p1), Controller(backends(daemon.ipc, p2), p2)
    keys = hashes(2)
    i1, i2 = p1.alloc(32), p2.alloc(32)
    assert a.backup(keys, i1) and b.backup(keys, i2)
    a.backend.clear()
    assert a.hits(keys) == 0 and b.hits(keys) == 2


# -- the daemon goes away, comes back, or is just idle ------------------------------------------

def test_daemon_killed_and_restarted(daemon_factory, backends):
    """Killed mid-run: calls report misses within the deadline (no exception), the backend
    reconnects in the background, and pages are stored and found again in the new daemon."""
    d = daemon_factory("--l2", "none")
    pool = HostPool(pages=32)
    c = Controller(backends(d.ipc, pool, extra={"timeout_ms": 500,
                                                "reconnect_interval_ms": 100}), pool)
    keys = hashes(12)
    idx = pool.alloc(12 * 16)
    pool.fill(idx, 21)
    assert c.backup(keys[:4], idx[:4 * 16]) and c.hits(keys[:4]) == 4
    d.stop(signal.SIGKILL)
    time.sleep(0.02)      # the residency map's reader looks at the daemon every 10 ms at most
    t0 = time.monotonic()
    assert c.hits(keys[:4]) == 0
    assert c.backup(keys[4:8], idx[4 * 16:8 * 16]) is False
    assert c.load(keys[:4], pool.alloc(4 * 16)) == 0
    assert time.monotonic() - t0 < 2.0              # one timeout, then misses at once
    assert c.backend.stats()["down"] is True
    d2 = restart_daemon(daemon_factory, d)         # (without L2)
    wait_until(lambda: not c.backend.stats()["down"], 10, what="reconnected")
    assert c.hits(keys[:4]) == 0                    # the new daemon has an empty L1
    assert c.backup(keys[4:8], idx[4 * 16:8 * 16])
    assert c.hits(keys[4:8]) == 4
    dst = pool.alloc(4 * 16)
    assert c.load(keys[4:8], dst) == 4
    assert all(torch.equal(a, b) for a, b in zip(pool.pages(idx[4 * 16:8 * 16]),
                                                  pool.pages(dst)))
    assert c.backend.stats()["outages"] == 1
    d2.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_restart_with_the_adopted_arena(daemon_factory, backends, sig):
    """l1.adopt: the daemon restarts on its run dir and adopts its arena; SGLang's controller
    goes on without an exception: the pages backed up before are hits and load byte-exact
    (through the same mapping), new backups land."""
    d = daemon_factory("--l2", "none", "--l1-adopt")
    pool = HostPool(pages=32)
    c = Controller(backends(d.ipc, pool, extra={"timeout_ms": 1000,
                                                "reconnect_interval_ms": 100}), pool)
    keys = hashes(12, tag="adopt")
    idx = pool.alloc(12 * 16)
    pool.fill(idx, 33)
    assert c.backup(keys[:8], idx[:8 * 16]) and c.hits(keys[:8]) == 8
    wait_until(lambda: d.http_json("GET", "/status")["l1"]["adopt"]["sums_pending"] == 0, 10,
               what="every page summed")
    d.restart(sig)
    assert d.http_json("GET", "/status")["l1"]["adopt"]["objects"] == 8
    wait_until(lambda: c.hits(keys[:8]) == 8, 10, what="the adopted pages found")
    dst = pool.alloc(8 * 16)
    assert c.load(keys[:8], dst) == 8
    assert all(torch.equal(a, b) for a, b in zip(pool.pages(idx[:8 * 16]), pool.pages(dst)))
    assert c.backup(keys[8:], idx[8 * 16:]) and c.hits(keys) == 12


def test_daemon_down_at_start(tmp_path, daemon_factory, backends):
    """SGLang starts before kvtier: the backend loads, reports misses, and picks the daemon
    up when it appears on its endpoint."""
    d = daemon_factory(start=False)
    pool = HostPool(pages=8)
    t0 = time.monotonic()
    c = Controller(backends(d.ipc, pool, extra={"timeout_ms": 300,
                                                "reconnect_interval_ms": 100}), pool)
    assert time.monotonic() - t0 < 2.0
    keys = hashes(2)
    idx = pool.alloc(32)
    assert c.hits(keys) == 0 and c.backup(keys, idx) is False
    d.start()
    wait_until(lambda: not c.backend.stats()["down"], 10, what="connected")
    assert c.backup(keys, idx) and c.hits(keys) == 2


def test_idle_longer_than_lease_ms(daemon_factory, backends):
    """The pool's Clients keep their instances alive: after an idle period of several lease_ms
    every call works, with no outage and no error."""
    d = daemon_factory("--lease-ms", "300")
    pool = HostPool(pages=8)
    c = Controller(backends(d.ipc, pool), pool)
    keys = hashes(4)
    idx = pool.alloc(4 * 16)
    pool.fill(idx, 8)
    assert c.backup(keys[:2], idx[:32])
    clients = [conn.client for conn in c.backend._idle]
    tokens = [cl.token for cl in clients]
    assert clients and all(cl.heartbeat_ms == 100 for cl in clients)
    time.sleep(1.2)
    assert [cl.token for cl in clients] == tokens   # never dropped: the same instances
    assert c.hits(keys) == 2
    assert c.backup(keys[2:], idx[32:])
    assert c.load(keys, pool.alloc(4 * 16)) == 4
    assert [cl.token for cl in clients] == tokens
    st = c.backend.stats()
    assert st["outages"] == 0 and st["errors"] == 0 and st["timeouts"] == 0


def test_threads_share_the_backend(daemon, backends):
    """SGLang's prefetch and backup threads call one backend at once."""
    pool = HostPool(pages=96)
    b = backends(daemon.ipc, pool, extra={"max_connections": 2})
    errors = []
    places = [(pool.alloc(8 * 16), pool.alloc(8 * 16)) for _ in range(4)]   # (HostPool is not
    for t, (idx, _) in enumerate(places):                                     # thread-safe)
        pool.fill(idx, t)

    def worker(t):
        try:
            c = Controller(b, pool)
            keys = hashes(8, "t%d" % t)
            idx, dst = places[t]
            for _ in range(5):
                assert c.backup(keys, idx)
                assert c.hits(keys) == 8
                assert c.load(keys, dst) == 8
                assert all(torch.equal(x, y) for x, y in zip(pool.pages(idx),
                                                             pool.pages(dst)))
        except Exception as e:                      # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert b.stats()["connections"] <= 2


def test_bad_host_indices_are_a_miss(daemon, backends):
    pool = HostPool(pages=4)
    b = backends(daemon.ipc, pool)
    idx = pool.alloc(32)
    assert b.batch_set_v1(hashes(2), idx[:20]) == [False, False]
    assert b.batch_get_v1(hashes(2), idx[:20]) == [False, False]
    assert b.batch_exists([]) == 0


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_scattered_and_reversed_host_pages(daemon, backends, layout):
    """Host pages in no order (SGLang's allocator hands out whatever is free): each page still
    lands in its own slot, byte-exact, through the page-by-page path."""
    pool = HostPool(pages=32, layout=layout)
    c = Controller(backends(daemon.ipc, pool), pool)
    everything = pool.alloc(32 * 16)
    pages = list(range(32))
    order = pages[::-1][:8] + pages[3:20:3]             # reversed, then every third page
    idx = torch.cat([everything[p * 16:(p + 1) * 16] for p in order])
    pool.fill(idx, 17)
    want = pool.pages(idx)
    keys = hashes(len(order), "scatter")
    assert c.backup(keys, idx)
    pool.kv_buffer.zero_()
    back = list(reversed(order))                        # read into other places
    dst = torch.cat([everything[p * 16:(p + 1) * 16] for p in back])
    assert c.load(keys, dst) == len(order)
    assert all(torch.equal(a, b) for a, b in zip(want, pool.pages(dst)))


def test_large_batches_go_pipelined(daemon_factory, backends):
    """32 pages of 1 MiB: chunks of 8 MiB, the next RESERVE / ACQUIRE in flight while pages
    are copied. Pages stored already in the middle of a chunk are skipped; a page missing in
    the third chunk ends the leading hits there; no lease is left behind."""
    d = daemon_factory("--l2", "none", "--l1-size", "128M")
    kw = dict(layers=16, heads=4, head_dim=128, page_size=32)   # 2*16*32*4*128*2 = 1 MiB
    pool = HostPool(pages=96, **kw)
    c = Controller(backends(d.ipc, pool), pool)
    assert c.backend.page_bytes == 1 << 20 and c.backend._chunk(32, c.backend) == 8
    keys = hashes(32, "big")
    idx = pool.alloc(32 * 32)
    pool.fill(idx, 23)
    want = pool.pages(idx)
    assert c.backup([keys[3], keys[12]], torch.cat([idx[3 * 32:4 * 32], idx[12 * 32:13 * 32]]))
    assert c.backend.batch_set_v1(keys, idx) == [True] * 32
    assert c.backend.stats()["set_skipped"] == 2
    dst = pool.alloc(32 * 32)
    assert c.load(keys, dst) == 32
    assert all(torch.equal(a, b) for a, b in zip(want, pool.pages(dst)))
    kvtier.Client(d.ipc).remove(c.backend.ns, [page_key(keys[19])])
    assert c.hits(keys) == 19
    assert c.backend.batch_get_v1(keys, dst) == [True] * 19 + [False] * 13
    wait_until(lambda: kvtier.Client(d.ipc).stats()["leases_active"] == 0, 5,
               what="every lease released")


def test_without_shared_memory_pages_ride_put_and_get(daemon_factory, backends):
    """"shared_memory": false (a container without the daemon's /dev/shm): PUT and GET carry
    the pages; batch_set reports only the pages the daemon has (here L1 takes 32 of 64)."""
    d = daemon_factory("--l2", "none", "--l1-size", "8M")
    pool = HostPool(pages=128, layers=8, heads=4, head_dim=128)        # 256 KiB pages
    c = Controller(backends(d.ipc, pool, extra={"shared_memory": False}), pool)
    keys = hashes(64, "put")
    idx = pool.alloc(64 * 16)
    pool.fill(idx, 41)
    ok = c.backend.batch_set_v1(keys, idx)
    stored = kvtier.Client(d.ipc).lookup(c.backend.ns, [page_key(k) for k in keys]).hits
    assert 0 < stored < 64 and ok == [True] * stored + [False] * (64 - stored)
    dst = pool.alloc(stored * 16)
    assert c.load(keys[:stored], dst) == stored
    assert all(torch.equal(a, b) for a, b in zip(pool.pages(idx[:stored * 16]),
                                                  pool.pages(dst)))
    assert all(conn.client.arena is None for conn in c.backend._idle)


def test_slow_l2_is_not_an_outage(daemon_factory, backends):
    """Pages only a slow L2 holds (mock, 5 ms a lookup): batch_exists counts them and
    batch_get_v1 loads them, without a timeout, an outage or a miss."""
    d = daemon_factory("--l1-size", "16M", "--l2", "mock:latency_ms=5",
                       "--l2-backlog-max", "1")                    # all pages reach L2
    pool = HostPool(pages=200, layers=8, heads=4, head_dim=128)        # 256 KiB pages
    c = Controller(backends(d.ipc, pool), pool)
    keys = hashes(96, "slow")
    idx = pool.alloc(96 * 16)
    pool.fill(idx, 43)
    for i in range(0, 96, 16):
        assert c.backup(keys[i:i + 16], idx[i * 16:(i + 16) * 16])
        time.sleep(0.15)                                # written behind before pushed out
    probe = kvtier.Client(d.ipc, timeout_ms=10000)
    first = [page_key(k) for k in keys[:32]]
    wait_until(lambda: probe.lookup(c.backend.ns, first).l1 == 0, 10, what="pages out of L1")
    assert c.hits(keys[:32]) == 32
    dst = pool.alloc(32 * 16)
    assert c.load(keys[:32], dst) == 32
    assert all(torch.equal(a, b) for a, b in zip(pool.pages(idx[:32 * 16]), pool.pages(dst)))
    st = c.backend.stats()
    assert st["timeouts"] == 0 and st["outages"] == 0 and not st["down"]
    probe.close()


def test_stalled_daemon_then_back(daemon_factory, backends):
    """The daemon stops answering (SIGSTOP) while two threads call: each call ends within
    about timeout_ms, the probe finds it silent (an outage: misses at once), and after SIGCONT
    the backend is back, and stays back (a late timeout from before does not count again).
    The calls come once the residency map went stale (its beat is a second old): until then
    batch_exists of pages in L1 is answered from it without asking the daemon."""
    d = daemon_factory("--l2", "none")
    pool = HostPool(pages=16)
    b = backends(d.ipc, pool, extra={"timeout_ms": 300, "reconnect_interval_ms": 100})
    c = Controller(b, pool)
    keys = hashes(2, "stall")
    idx = pool.alloc(32)
    assert c.backup(keys, idx)
    d.send_signal(signal.SIGSTOP)
    try:
        time.sleep(1.2)                   # past the map's KVT_RES_STALE_NS
        took = []

        def call():
            t0 = time.monotonic()
            b.batch_exists(keys)
            took.append(time.monotonic() - t0)

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(took) == 2 and max(took) < 1.5, took
        wait_until(lambda: b.stats()["down"], 5, what="the probe to give up")
        t0 = time.monotonic()
        assert c.hits(keys) == 0 and time.monotonic() - t0 < 0.05      # down: at once
    finally:
        d.send_signal(signal.SIGCONT)
    wait_until(lambda: not b.stats()["down"], 10, what="back")
    time.sleep(0.5)
    st = b.stats()
    assert not st["down"] and st["outages"] == 1, st
    assert c.hits(keys) == 2


def test_fp8_variants_are_other_namespaces(daemon, backends):
    """SGLang keeps fp8 KV as uint8 in the host pool: the KV dtype (device_pool.dtype) is part
    of the namespace, so e4m3 and e5m2 pages never mix."""
    class Device:
        def __init__(self, dtype):
            self.dtype = dtype

    a, b = HostPool(pages=4, dtype=torch.uint8), HostPool(pages=4, dtype=torch.uint8)
    a.device_pool, b.device_pool = Device("e4m3"), Device("e5m2")
    ba, bb = backends(daemon.ipc, a), backends(daemon.ipc, b)
    assert ba.ns != bb.ns and ".uint8-e4m3." in ba.ns and ".uint8-e5m2." in bb.ns
    idx = a.alloc(16)
    assert ba.batch_set_v1(["fp8"], idx) == [True]
    assert bb.batch_exists(["fp8"]) == 0


def test_pages_of_a_non_affine_pool_move_one_by_one(daemon, backends):
    """A pool whose page views are not evenly spaced (pages permuted): no strided runs, each
    page to and from its own place."""
    class Permuted(HostPool):
        def _page(self, index):
            i = index // self.page_size
            j = (i * 5) % self.page_num                 # a permutation (page_num 8)
            return super()._page(j * self.page_size)

    pool = Permuted(pages=8)
    b = backends(daemon.ipc, pool)
    assert b._step is None
    c = Controller(b, pool)
    keys = hashes(4, "perm")
    idx = pool.alloc(4 * 16)
    pool.fill(idx, 47)
    want = pool.pages(idx)
    assert c.backup(keys, idx)
    dst = pool.alloc(4 * 16)
    assert c.load(keys, dst) == 4
    assert all(torch.equal(x, y) for x, y in zip(want, pool.pages(dst)))


def test_hybrid_v2_calls_serve_kv_and_never_raise(daemon, backends):
    """Newer SGLang's *_v2 calls: a KV transfer is served like v1; a pool that was never
    registered (Mamba here) is not stored, so nothing that needs it is a hit, and nothing
    raises (the base class's NotImplementedError would end SGLang's prefetch thread)."""
    from sglang_iface import PoolName, PoolHitPolicy, PoolTransfer, PoolTransferResult
    pool = HostPool(pages=8)
    b = backends(daemon.ipc, pool)
    b.register_mem_host_pool_v2(pool, PoolName.KV)
    keys = hashes(3, "v2")
    idx = pool.alloc(3 * 16)
    pool.fill(idx, 53)
    mamba = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([0]), keys=[keys[-1]],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)
    kv = PoolTransfer(PoolName.KV, host_indices=idx, keys=keys)
    assert b.batch_set_v2([kv, mamba]) == {PoolName.KV: [True] * 3, PoolName.MAMBA: [False]}
    r = b.batch_exists_v2(keys, [kv])
    assert isinstance(r, PoolTransferResult) and r.kv_hit_pages == 3
    r = b.batch_exists_v2(keys, [kv, mamba])             # Mamba never registered: no hit
    assert r.kv_hit_pages == 0 and r.extra_pool_hit_pages == {"kv": 3, "mamba": 0}
    dst = pool.alloc(3 * 16)
    got = b.batch_get_v2([PoolTransfer(PoolName.KV, host_indices=dst, keys=keys), mamba])
    assert got == {PoolName.KV: [True] * 3, PoolName.MAMBA: [False]}
    assert all(torch.equal(x, y) for x, y in zip(pool.pages(idx), pool.pages(dst)))
    assert b.batch_get_v2([None]) == {}                  # garbage: a miss, not an exception
    assert b.stats()["errors"] == 1


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_asymmetric_pool_registers_and_moves_k_and_v_byte_exact(daemon, backends, layout):
    """head_dim != v_head_dim (SGLang's AsymmetricMHATokenToKVPoolHost, e.g. MiMo-V2): the pool
    has no flat pages (get_data_page raises), so registration must not call it into SGLang's
    start-up; pages go through get_page_buffer_meta's K and V regions, byte for byte, into
    another rank's pool, in scattered and reversed order, and only the leading hits load."""
    from sglang_iface import AsymmetricHostPool
    src = AsymmetricHostPool(pages=16, layout=layout)
    dst = AsymmetricHostPool(pages=16, layout=layout)
    a = Controller(backends(daemon.ipc, src), src)
    b = Controller(backends(daemon.ipc, dst), dst)
    assert a.backend.ns.endswith("/tp0of1/mha.%s.bfloat16.%s" % (layout, {
        "page_first": "16x4x2x96+16x4x2x64",
        "page_first_direct": "1x4x16x2x96+1x4x16x2x64"}[layout]))
    assert a.backend.page_bytes == 16 * 4 * 2 * (96 + 64) * 2
    keys = hashes(7, "asym" + layout)
    si = src.alloc(7 * 16)
    src.fill(si, 17)
    assert a.backup(keys, si)
    assert b.hits(keys) == 7
    di = torch.cat([dst.alloc(16) for _ in range(7)][::-1])   # scattered, last page first
    assert b.load(keys, di) == 7
    assert all(torch.equal(x, y) for x, y in zip(src.pages(si), dst.pages(di)))
    more = hashes(2, "asym-miss" + layout)
    assert b.backend.batch_get_v1(keys[:2] + more, dst.alloc(4 * 16)) == [True] * 2 + [False] * 2
    assert a.backend.stats()["errors"] == 0 and b.backend.stats()["errors"] == 0


def test_a_pool_kvtier_cannot_reach_is_a_miss_only_tier(daemon, backends, caplog):
    """A host pool that refuses every storage call (SGLang's int2 pool): SGLang still starts
    (registration does not raise), one warning says why, and every call is a miss."""
    from sglang_iface import NoStoragePool
    pool = NoStoragePool(pages=4)
    with caplog.at_level("WARNING", logger="kvtier.sglang"):
        b = backends(daemon.ipc, pool)
        b.register_mem_pool_host(pool)                 # again: still one warning
        idx = pool.alloc(2 * 16)
        assert b.batch_set_v1(hashes(2, "int2"), idx) == [False, False]
        assert b.batch_exists(hashes(2, "int2")) == 0
        assert b.batch_get_v1(hashes(2, "int2"), idx) == [False, False]
        assert b.batch_set(hashes(1, "int2"), [torch.zeros(8)]) is False
    assert b.ns is None
    warned = [r.getMessage() for r in caplog.records if "cannot be served" in r.getMessage()]
    assert len(warned) == 1 and "NoStoragePool" in warned[0] and "int2" in warned[0], warned
    assert kvtier.Client(daemon.ipc).stats()["l1_objects"] == 0


def test_asymmetric_pool_without_shared_memory(daemon, backends):
    """The same pool with shared_memory off: K and V ride PUT and GET inline."""
    from sglang_iface import AsymmetricHostPool
    src, dst = AsymmetricHostPool(pages=4), AsymmetricHostPool(pages=4)
    a = Controller(backends(daemon.ipc, src, extra={"shared_memory": False}), src)
    b = Controller(backends(daemon.ipc, dst, extra={"shared_memory": False}), dst)
    keys = hashes(3, "asym-inline")
    si = src.alloc(3 * 16)
    src.fill(si, 23)
    assert a.backup(keys, si)
    di = dst.alloc(3 * 16)
    assert b.load(keys, di) == 3
    assert all(torch.equal(x, y) for x, y in zip(src.pages(si), dst.pages(di)))


def _hybrid(daemon, backends, draft=False):
    """A hybrid model's pools as SGLang builds them: KV (16-token pages), Mamba states (one
    slot per node, window 1), SWA KV (window of 2 pages), a KV-derived indexer pool."""
    from sglang_iface import HybridController, MambaHostPool, PoolName
    kv = HostPool(pages=16)
    pools = {PoolName.MAMBA: (MambaHostPool(8), 1),
             PoolName.SWA: (HostPool(pages=16, heads=1, head_dim=32), 2),
             PoolName.INDEXER: (HostPool(pages=16, layers=2, heads=1, head_dim=16,
                                         dtype=torch.uint8), None)}
    if draft:
        pools[PoolName.DRAFT] = (HostPool(pages=16, layers=1), None)
    b = backends(daemon.ipc, kv)
    return b, kv, pools, HybridController(b, kv, pools)


def _save_node(ctl, kv, pools, keys, seed):
    """One tree node's backup: KV pages, the KV-derived pools at the KV indices, each
    trailing pool's window from indices of its own. -> what was saved, for comparing."""
    idx = kv.alloc(len(keys) * kv.page_size)
    kv.fill(idx, seed)
    own, saved = {}, {"kv": kv.pages(idx)}
    for name, (pool, window) in pools.items():
        if window is None:
            pool.fill(idx, seed + 1)
            saved[name] = pool.pages(idx)
        else:
            own[name] = pool.alloc(window * pool.page_size)
            pool.fill(own[name], seed + 2)
            saved[name] = pool.pages(own[name])
    side, ok = ctl.backup(keys, idx, own)
    return side, ok, saved


def _load_node(ctl, kv, pools, keys, hit):
    dst = kv.alloc(len(keys) * kv.page_size)
    own = {n: p.alloc(w * p.page_size) for n, (p, w) in pools.items() if w is not None}
    n, hits = ctl.load(keys, hit, dst, own)
    got = {"kv": kv.pages(dst[:n * kv.page_size])}
    for name, (pool, window) in pools.items():
        got[name] = pool.pages(dst[:n * kv.page_size] if window is None else
                               own[name][:min(window, hit) * pool.page_size])
    return n, hits, got


def test_hybrid_pools_are_stored_and_loaded_byte_exact(daemon, backends):
    """SGLang's default stack for hybrid models (HybridCacheController): every pool it hands
    over is stored in a namespace of its own and comes back byte for byte — Mamba states
    (TRAILING_PAGES, one slot), an SWA window (TRAILING_PAGES, 2 pages), a KV-derived indexer
    (ALL_PAGES) and draft KV (ALL_PAGES, another page size)."""
    from sglang_iface import PoolName
    b, kv, pools, ctl = _hybrid(daemon, backends, draft=True)
    keys = hashes(4, "hy")
    side, ok, saved = _save_node(ctl, kv, pools, keys, 71)
    assert ok and side == {PoolName.MAMBA: 1, PoolName.SWA: 2, PoolName.INDEXER: 4,
                           PoolName.DRAFT: 4}
    r = ctl.hits(keys)
    assert r.kv_hit_pages == 4
    assert r.extra_pool_hit_pages == {"kv": 4, "mamba": 4, "swa": 4, "indexer": 4, "draft": 4}
    n, hits, got = _load_node(ctl, kv, pools, keys, r.kv_hit_pages)
    assert n == 4 and hits == {PoolName.INDEXER: 4, PoolName.DRAFT: 4, PoolName.MAMBA: 1,
                               PoolName.SWA: 2}
    for name in saved:
        assert len(got[name]) == len(saved[name]) > 0, name
        assert all(torch.equal(x, y) for x, y in zip(saved[name], got[name])), name
    # each pool is its own namespace: the KV namespace holds KV pages only
    nss = {b.ns} | {lay.ns for lay in b._pools.values()}
    assert len(nss) == 5
    client = kvtier.Client(daemon.ipc)
    try:
        assert client.lookup(b.ns, [page_key(k) for k in keys], salt=b.cfg["salt"]).hits == 4
    finally:
        client.close()


def test_restorable_prefix_pages_intersect_the_pools(daemon_factory, backends):
    """PoolTransferResult.restorable_prefix_pages (SGLang's fix for sparse TRAILING_PAGES
    windows): every prefix length each pool can restore, intersected — not the smallest of
    the pools' longest, which can be a length one pool cannot restore."""
    from sglang_iface import PoolName
    # L1 alone: with write-behind, an L2 copy written after the REMOVE below would bring the
    # removed page back through the lookup's prefetch
    daemon = daemon_factory("--l2", "none")
    b, kv, pools, ctl = _hybrid(daemon, backends)
    keys = hashes(5, "rest")
    _save_node(ctl, kv, pools, keys[:3], 91)          # states after pages 3 and 5
    _save_node(ctl, kv, pools, keys, 92)
    r = ctl.hits(keys)
    # Mamba (window 1): pages 2 and 4 -> {3, 5}; SWA (window 2): pages 1-4 -> {3, 4, 5}
    assert r.restorable_prefix_pages == [3, 5] and r.kv_hit_pages == 5
    # SWA loses its page 4: SWA {3, 4}, Mamba {3, 5}; the longest of both (4) is no answer
    client = kvtier.Client(daemon.ipc)
    try:
        swa = b._pools["swa"]
        assert client.remove(swa.ns, [page_key(keys[4])], salt=b.cfg["salt"]) == 1
    finally:
        client.close()
    r = ctl.hits(keys)
    assert r.extra_pool_hit_pages["mamba"] == 5 and r.extra_pool_hit_pages["swa"] == 4
    assert r.restorable_prefix_pages == [3] and r.kv_hit_pages == 3
    n, hits, got = _load_node(ctl, kv, pools, keys, r.kv_hit_pages)
    assert n == 3 and hits[PoolName.MAMBA] == 1 and hits[PoolName.SWA] == 2
    # KV alone: every prefix it has
    assert b.batch_exists_v2(keys, []).restorable_prefix_pages == [1, 2, 3, 4, 5]


def test_hybrid_hit_policies_shrink_the_prefix(daemon, backends):
    """TRAILING_PAGES: a prefix is usable up to the last node boundary whose state was saved
    (a state saved after page 3 of 5: 3 pages). ALL_PAGES: the first page the pool lacks ends
    it. A pool that was never registered, or that kvtier cannot serve, is no hit at all."""
    from sglang_iface import PoolName, PoolTransfer, PoolHitPolicy
    b, kv, pools, ctl = _hybrid(daemon, backends)
    keys = hashes(5, "pol")
    _save_node(ctl, kv, pools, keys[:3], 81)          # node 1: pages 0-2 with their states
    idx = kv.alloc(2 * kv.page_size)                  # node 2: KV pages 3-4 only
    kv.fill(idx, 82)
    assert all(b.batch_set_v1(keys[3:], idx))
    assert b.batch_exists(keys) == 5
    r = ctl.hits(keys)
    assert r.kv_hit_pages == 3 and r.extra_pool_hit_pages["mamba"] == 3
    n, hits, got = _load_node(ctl, kv, pools, keys, r.kv_hit_pages)
    assert n == 3 and hits[PoolName.MAMBA] == 1 and hits[PoolName.SWA] == 2
    # ALL_PAGES: the indexer lacks pages 3-4 -> 3, whatever the trailing pools say
    only = b.batch_exists_v2(keys, [PoolTransfer(PoolName.INDEXER)])
    assert only.kv_hit_pages == 3 and only.extra_pool_hit_pages == {"kv": 5, "indexer": 3}
    # a pool nobody registered: no prefix is usable
    r = b.batch_exists_v2(keys, [PoolTransfer(PoolName.DEEPSEEK_V4_C4)])
    assert r.kv_hit_pages == 0
    # a pool kvtier cannot serve (every page call raises): registered with a warning, misses
    from sglang_iface import NoStoragePool
    b.register_mem_host_pool_v2(NoStoragePool(pages=4), PoolName.DRAFT_SWA)
    t = PoolTransfer(PoolName.DRAFT_SWA, keys=["__placeholder__"],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert b.batch_exists_v2(keys, [t]).kv_hit_pages == 0
    got = b.batch_set_v2([PoolTransfer(PoolName.DRAFT_SWA, host_indices=torch.tensor(
        list(range(16))), keys=keys[:1])])
    assert got == {PoolName.DRAFT_SWA: [False]}


def test_draft_kv_through_the_generic_calls(daemon, backends):
    """Speculative decoding's draft KV, older path: batch_set(["<hash>.draft"], pages of the
    draft pool) with another page size than the target's; batch_get with the draft pool's
    dummy pages reads them back byte for byte (a namespace per page size)."""
    pool = HostPool(pages=8)
    draft = HostPool(pages=8, layers=1, heads=2, head_dim=32)
    b = backends(daemon.ipc, pool)
    keys = ["%s.draft" % h for h in hashes(3, "dr")]
    idx = draft.alloc(3 * 16)
    draft.fill(idx, 91)
    pages = [draft.get_data_page(int(idx[i * 16])) for i in range(3)]
    assert pages[0].numel() * pages[0].element_size() != b.page_bytes
    assert b.batch_set(keys, pages) is True
    got = b.batch_get(keys, [draft.get_dummy_flat_data_page() for _ in keys])
    assert all(g is not None and torch.equal(g, p) for g, p in zip(got, pages))
    # the target's own pages are unaffected, and a key of one namespace is not in the other
    assert b.batch_exists(keys) == 0
    assert b.stats()["errors"] == 0


def _tp_server(backends, d, tp_size, tp_rank, lcm=4, heads_total=8, **kw):
    """One TP rank of a page_head server of a model with heads_total KV heads."""
    pool = HostPool(pages=8, heads=heads_total // tp_size, layout="page_head", **kw)
    extra = {"tp_lcm_size": lcm} if lcm else {}
    b = backends(d.ipc, pool, tp_size=tp_size, tp_rank=tp_rank, layout="page_head",
                 extra=extra)
    return pool, b, Controller(b, pool)


def _heads(pool, idx, lo, hi):
    """Heads [lo, hi) of the pages of idx: K then V."""
    out = []
    for s in idx[::pool.page_size].tolist():
        page = pool.kv_buffer[:, s // pool.page_size, lo:hi]
        out.append(page.clone())
    return out


def test_tp_lcm_split_heads_share_pages_across_tp_sizes(daemon, backends):
    """HiCacheStorageConfig.tp_lcm_size / should_split_heads (SGLang, page_head layout): a TP=2
    server's rank stores each page as two head groups, TP=4 ranks 2r and 2r+1's pages, so a TP=4
    server of the same model reads them (and the other way round): one copy, byte for byte."""
    keys = hashes(3, "lcm")
    p2, b2, c2 = _tp_server(backends, daemon, 2, 1)
    assert [lay.ns.split("/")[-2] for lay in b2._kv] == ["tp2of4", "tp3of4"]
    idx = p2.alloc(3 * 16)
    p2.fill(idx, 101)
    assert c2.backup(keys, idx)
    for r, lo in ((2, 0), (3, 2)):                       # TP=4 ranks 2 and 3: 2 heads each
        p4, b4, c4 = _tp_server(backends, daemon, 4, r)
        assert b4._kv == [b4] and b4.ns == b2._kv[r - 2].ns
        assert c4.hits(keys) == 3
        dst = p4.alloc(3 * 16)
        assert c4.load(keys, dst) == 3
        assert all(torch.equal(a, b)
                   for a, b in zip(_heads(p4, dst, 0, 2), _heads(p2, idx, lo, lo + 2)))
    # the other way: TP=4 ranks 0 and 1 store, the TP=2 rank 0 reads all 4 heads
    more = hashes(2, "lcm-back")
    src = []
    for r in (0, 1):
        p4, b4, c4 = _tp_server(backends, daemon, 4, r)
        i4 = p4.alloc(2 * 16)
        p4.fill(i4, 200 + r)
        assert c4.backup(more, i4)
        src.append(_heads(p4, i4, 0, 2))
    q2, bq, cq = _tp_server(backends, daemon, 2, 0)
    assert cq.hits(more) == 2
    dst = q2.alloc(2 * 16)
    assert cq.load(more, dst) == 2
    for g in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(_heads(q2, dst, 2 * g, 2 * g + 2), src[g]))
    # a page is a hit only with all its groups: TP=4 rank 1 alone stored this one
    p4, b4, c4 = _tp_server(backends, daemon, 4, 1)
    half = hashes(1, "lcm-half")
    i4 = p4.alloc(16)
    p4.fill(i4, 300)
    assert c4.backup(half, i4)
    assert cq.hits(half) == 0 and cq.load(half, q2.alloc(16)) == 0


def test_tp_lcm_without_page_head_stays_whole(daemon, backends, caplog):
    """should_split_heads needs page_head (SGLang only sets it then) and interface_v1: a server
    asked to split without them keeps whole pages per rank, says so once, and works."""
    pool = HostPool(pages=8, heads=4, layout="page_head")
    cfg = config(dict(EXTRA, endpoint=daemon.ipc, tp_lcm_size=4), tp_size=2,
                 layout="page_head")
    cfg.extra_config.pop("interface_v1")
    with caplog.at_level("WARNING", logger="kvtier.sglang"):
        b = create_backend("dynamic", cfg, pool)
    try:
        assert b._kv == [b] and "tp0of2" in b.ns
        assert "interface_v1" in caplog.text
        c = Controller(b, pool, v1=False)
        keys = hashes(2, "whole")
        idx = pool.alloc(2 * 16)
        pool.fill(idx, 7)
        assert c.backup(keys, idx) and c.hits(keys) == 2
    finally:
        b.close()
