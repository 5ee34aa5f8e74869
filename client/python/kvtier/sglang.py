"""kvtier.sglang: an SGLang HiCache storage backend on kvtier (docs/integrations.md, "SGLang").

SGLang loads it as a dynamic backend (storage/backend_factory.py calls
`KvtierHiCacheStorage(storage_config, {})`, then `register_mem_pool_host(host_pool)`):

    --enable-hierarchical-cache --page-size 64 --hicache-mem-layout page_first \\
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
    '{"backend_name": "kvtier", "module_path": "kvtier.sglang",
      "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
      "endpoint": "ipc:///run/kvtier/kvtier.sock"}'

Built against SGLang's HiCacheStorage as of v0.5.x (hicache_storage.py, 2025-2026): the five
abstract methods (get, batch_get, set, batch_set, exists), batch_exists, the zero-copy
batch_get_v1 / batch_set_v1 that SGLang calls when the extra config says "interface_v1", and
the hybrid models' register_mem_host_pool_v2 and *_v2 calls (HybridCacheController, SGLang's
default stack): every pool stored in a namespace of its own, with the hit policy asked for;
with tp_lcm_size / should_split_heads (page_head layout) a page is stored as one object per
head group of the lcm's ranks, so servers of different TP sizes share pages.

Objects: one kvtier object per page, holding the page exactly as the host pool's
get_data_page(index, flat=True) lays it out (so the v1 and the tensor paths store the same
bytes); a pool without flat pages (head_dim != v_head_dim: K and V in buffers of their own)
is served through get_page_buffer_meta, its K and V runs back to back. A pool kvtier cannot
reach at all makes the backend a miss-only tier (one warning), never an exception at
registration. Keys: SGLang's page hash string -> BLAKE2b-128 of its UTF-8 bytes. Namespace:
"<namespace>/<ranks>/<page layout>", e.g.
"sglang/Qwen3-8B/tp0of2/mha.page_first.bfloat16.2x64x36x8x128": a TP rank's pages are its own
heads (MLA pages are the same on every TP rank: "mla" instead), and another layout, dtype or
page size is another namespace, so pages of different layouts never mix.

Calls never raise into SGLang (its prefetch and backup threads die on an exception): a page
that is missing, evicted, of another size or could not be moved is a miss (False / None), and
a call waits on the daemon about `timeout_ms` at most (plus a HELLO when it opens a
connection). A request that times out closes its connection and has the background thread
probe the daemon; when the probe's HELLO is not answered either, the backend reports misses
at once and reconnects in the background (a warning when it goes, another when it is back).
Connections: a small pool of kvtier.Client (each not thread-safe; SGLang calls from its
prefetch and backup threads), each with its heartbeat, so idle periods longer than the
daemon's lease_ms cost nothing.

Pages move with one copy each (torch copy_ of the page's contiguous runs between the pool's
page views and one torch view of the arena); pages that follow each other in the pool and in
the arena move in one call; a batch goes in chunks, the next chunk's request in flight while
this one's pages are copied (docs/performance.md, "SGLang backend").
"""

import contextlib
import functools
import hashlib
import logging
import threading
import time
import types

import torch

from ._config import checked as _checked
from .client import RELEASE, Client
from .errors import KvtierError

try:                                            # SGLang's base class when SGLang is installed:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base  # its factory
except ImportError:                             # checks issubclass(cls, HiCacheStorage)
    class _Base:                                # pylint: disable=too-few-public-methods
        """Stand-in for sglang's HiCacheStorage when SGLang is not installed."""

        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host

__all__ = ["KvtierHiCacheStorage", "page_key", "DEFAULTS"]

log = logging.getLogger("kvtier.sglang")

# The keys this backend reads from --hicache-storage-backend-extra-config (every other key is
# SGLang's or another backend's and left alone). docs/integrations.md lists them.
DEFAULTS = {
    "endpoint": None,               # None: $KVTIER_ENDPOINT, else ipc:///run/kvtier/kvtier.sock
    "namespace": None,              # None: "sglang/<model_name>"
    "salt": None,                   # isolates tenants sharing one daemon (LOOKUP's salt)
    "timeout_ms": 2000,             # the longest one backend call waits for the daemon
                                    # (above the daemon's 1 s for the L2 part of a LOOKUP)
    "shared_memory": True,          # False: pages inline in PUT / GET, not through the arena
    "reconnect_interval_ms": 1000,  # how often the background thread tries a daemon that left
    "max_connections": 4,           # Clients in the pool (SGLang calls from 2-3 threads)
    "heartbeat_ms": None,           # kvtier.Client's (None: lease_ms / 3)
}
_INTS = {"timeout_ms": 1, "reconnect_interval_ms": 10, "max_connections": 1}


def page_key(page_hash):
    """kvtier's 16-byte key of one SGLang page hash (a str, normally 64 hex digits of
    SHA-256 chained over the prefix): BLAKE2b-128 of its UTF-8 bytes."""
    if isinstance(page_hash, str):
        page_hash = page_hash.encode("utf-8")
    return hashlib.blake2b(bytes(page_hash), digest_size=16).digest()


_KEYS = {}                                # page hash str -> page_key: SGLang asks for the same
_KEYS_MAX = 1 << 16                       # pages again and again (exists, get, set; shared
                                          # prefixes), and a BLAKE2b call costs ~1 us in Python


def page_keys(hashes):
    """[page_key(h) for h in hashes], remembering the latest _KEYS_MAX string hashes (dict
    reads and writes are atomic under the GIL: any thread)."""
    memo = _KEYS
    try:
        return [memo[h] for h in hashes]  # all seen before: the common case
    except (KeyError, TypeError):
        pass
    out = []
    for h in hashes:
        k = memo.get(h) if isinstance(h, str) else None
        if k is None:
            k = page_key(h)
            if isinstance(h, str):
                if len(memo) >= _KEYS_MAX:
                    memo.clear()
                memo[h] = k
        out.append(k)
    return out


def _settings(storage_config):
    cfg = _checked(getattr(storage_config, "extra_config", None) or {}, DEFAULTS,
                    _INTS, ("endpoint", "namespace", "salt"), ("shared_memory",),
                    "kvtier.sglang", "extra_config")
    if cfg["namespace"] is None:
        model = getattr(storage_config, "model_name", None)
        if not model:
            log.warning("kvtier.sglang: no model_name and no namespace in the extra config: "
                        "pages go to sglang/unnamed-model, shared with any other such server")
        cfg["namespace"] = "sglang/" + str(model or "unnamed-model").strip("/")
    return cfg


def _ranks(storage_config, replicated=None, tp=None):
    """The rank part of the namespace: what makes one rank's pages differ from another's.
    `replicated` (default: an MLA model) says the pages are the same on every TP rank; `tp`
    (rank, size) replaces the server's own TP rank and size (split heads: the lcm's)."""
    def field(name, default):
        v = getattr(storage_config, name, default)
        return default if v is None else int(v)
    parts = []
    if replicated is None:
        replicated = getattr(storage_config, "is_mla_model", False)
    if replicated:
        parts.append("mla")               # latent KV: the same bytes on every TP rank
    else:
        parts.append("tp%dof%d" % (tp or (field("tp_rank", 0), field("tp_size", 1))))
    if field("pp_size", 1) > 1:
        parts.append("pp%dof%d" % (field("pp_rank", 0), field("pp_size", 1)))
    if field("attn_cp_size", 1) > 1:
        parts.append("cp%dof%d" % (field("attn_cp_rank", 0), field("attn_cp_size", 1)))
    return ".".join(parts)


def _guarded(miss):
    """Whatever goes wrong in a call SGLang makes is a miss, never an exception: an exception
    would end SGLang's prefetch or backup thread (it does not restart them). miss(keys) is the
    call's miss value."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:        # noqa: BLE001
                self._count("errors", 1)
                self._warn_once("call:" + type(e).__name__, "%s: %s: %s (counted as a miss)"
                                % (fn.__name__, type(e).__name__, e))
                keys = args[0] if args else next(
                    (kwargs[k] for k in ("keys", "key", "transfers") if k in kwargs), None)
                try:
                    return miss(keys)
                except Exception:         # noqa: BLE001 - keys not even a list
                    return miss([])
        return call
    return wrap


def _pool_name(transfer):
    name = getattr(transfer, "name", None)
    return str(getattr(name, "value", name))


def _transfer_result(kv_hits, pool_hits=None, restorable=None):
    """SGLang's PoolTransferResult(kv_hit_pages, extra_pool_hit_pages[,
    restorable_prefix_pages]); the third field only where SGLang's class has it."""
    try:
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
    except ImportError:                   # (v2 is only called by an SGLang that has it)
        return types.SimpleNamespace(kv_hit_pages=kv_hits,
                                     extra_pool_hit_pages=dict(pool_hits or {}),
                                     restorable_prefix_pages=restorable)
    try:
        return PoolTransferResult(kv_hits, dict(pool_hits or {}),
                                  restorable_prefix_pages=restorable)
    except TypeError:                     # releases before the field
        return PoolTransferResult(kv_hits, dict(pool_hits or {}))


# Pools whose pages are the same on every TP rank of an MLA model (Mooncake's backend keys
# them without the rank too); every other pool's pages are per rank.
_REPLICATED_POOLS = frozenset(("indexer", "draft_indexer", "deepseek_v4_c4",
                               "deepseek_v4_c4_indexer", "deepseek_v4_c128",
                               "deepseek_v4_c4_state", "deepseek_v4_c4_indexer_state",
                               "deepseek_v4_c128_state", "deepseek_v4_c4_indexer_scale"))
_TRAILING_PROBES = 128                    # LOOKUPs one TRAILING_PAGES pool may cost an exists


class _HeadGroup:
    """Head group g of `split` of a page_head host pool (kv_buffer (2, pages, heads, page_size,
    layers, head_dim)), as a pool of its own: page views kv_buffer[:, i:i+1, group] — K's
    run then V's, the bytes SGLang's get_split_heads_page_buffer_meta names for that group."""

    def __init__(self, pool, g, split):
        hg = pool.head_num // split
        self._heads = slice(g * hg, (g + 1) * hg)
        self.kv_buffer, self.page_size, self.size = pool.kv_buffer, pool.page_size, pool.size
        self.layout, self.dtype, self.head_num = pool.layout, pool.dtype, hg
        self.device_pool = getattr(pool, "device_pool", None)

    def get_data_page(self, index, flat=True):
        i = int(index) // self.page_size
        page = self.kv_buffer[:, i:i + 1, self._heads]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index, data_page):
        page = self.get_data_page(index, flat=False)
        page.copy_(data_page.reshape(page.shape))


class _Layout:
    """What moving one pool's pages needs: its namespace and page geometry, under the names
    the backend's own (the KV pool's) have. Other pools' pages and pages of another size move
    as flat pages (get_data_page(flat=True) / set_from_flat_data_page)."""

    def __init__(self, ns, pool, page_size, dtype, nbytes):
        self.ns, self.mem_pool_host, self._page_size = ns, pool, page_size
        self._page_dtype, self.page_bytes = dtype, nbytes
        self._page_shape = (nbytes // torch.empty((), dtype=dtype).element_size(),)
        self._rows, self._direct, self._step, self._regions = 1, False, None, None


def _transfer_misses(transfers):
    out = {}
    for t in transfers:
        name = getattr(t, "name", None)
        if name is not None:
            out[name] = [False] * len(getattr(t, "keys", None) or ())
    return out


def _falses(keys):
    return [False] * len(keys)


def _nones(keys):
    return [None] * len(keys)


class _Conn:
    """One pooled Client and a torch view of its arena (rebuilt when the Client maps another
    arena: a restarted daemon's)."""

    def __init__(self, client, gen):
        self.client = client
        self.gen = gen
        self.deadline = 0.0               # of the backend call using it (monotonic s)
        self._arena = None
        self._tensor = None
        self._typed = {}                  # dtype -> the arena viewed as that dtype
        self._typed_of = None

    def arena(self):
        a = self.client.arena
        if a is None:
            self._arena = self._tensor = self._typed_of = None
            self._typed = {}
            return None
        if a is not self._arena:
            self._tensor = self._typed_of = None      # drop the old exports first
            self._typed = {}
            self._tensor = torch.frombuffer(a, dtype=torch.uint8)
            self._arena = a
        return self._tensor

    def typed(self, dtype):
        """The arena as a 1-D tensor of dtype (call arena() first)."""
        if self._typed_of is not self._tensor:
            self._typed = {}
            self._typed_of = self._tensor
        t = self._typed.get(dtype)
        if t is None:
            t = self._typed[dtype] = self._tensor.view(dtype)
        return t

    def req(self, floor_ms=1):
        """The Client, for one request that waits what is left of the call's deadline (at
        least floor_ms: a COMMIT or RELEASE still gets its chance after a slow copy)."""
        self.client.timeout_ms = max(floor_ms, int((self.deadline - _now()) * 1000))
        return self.client

    def close(self):
        self._tensor = self._arena = self._typed_of = None
        self._typed = {}
        self.client.timeout_ms = 100      # its BYE (the daemon may be gone)
        with contextlib.suppress(Exception):
            self.client.close()


class _Down(Exception):
    """The daemon did not answer (or no connection could be had in time)."""


class _Broken(Exception):
    """A pipelined call failed with replies still due on its connection: it is closed (and
    its leases go with its instance), never handed to the next call."""

    def __init__(self, cause):
        super().__init__(str(cause))
        self.cause = cause


class KvtierHiCacheStorage(_Base):
    """SGLang HiCacheStorage on kvtier (module docstring). Every method may be called from any
    thread; none raises for a missing page or an absent daemon."""

    def __init__(self, storage_config=None, kwargs=None):
        self.storage_config = storage_config
        self.cfg = _settings(storage_config)
        self.rank_part = _ranks(storage_config)
        self.mem_pool_host = None
        self.ns = None                    # set by register_mem_pool_host
        self._regions = None              # a _Regions for pools without page views
        self.page_bytes = 0
        self._page_shape = None
        self._page_dtype = None
        self._page_size = 0
        self._cond = threading.Condition()
        self._idle = []
        self._live = 0                    # Clients made and not closed (idle + in use)
        self._gen = 0                     # bumped when the daemon went away
        self._down = False
        self._closed = False
        self._graveyard = []              # Conns to close off the caller's thread
        self._probe = None                # a request timed out: is the daemon there?
        self._wake = threading.Event()
        self._thread = None
        self._rows = 1
        self._direct = False
        self._step = None                 # elements from one page's view to the next's
        self._warned = set()
        self._kv = [self]                 # the KV pool's layouts: self, or its head groups
        self._pools = {}                  # other pools by name: a _Layout, None if unservable
        self._flat = {}                   # (page bytes, dtype) -> _Layout: draft KV and such
        self._stats_lock = threading.Lock()
        self._stats = dict.fromkeys(("exists_calls", "exists_hits", "exists_local",
                                     "get_pages", "get_hits",
                                     "set_pages", "set_stored", "set_skipped", "errors",
                                     "timeouts", "outages"), 0)
        pool = kwargs if hasattr(kwargs, "get_data_page") else None
        if pool is not None:             # a built-in style (storage_config, mem_pool_host) call
            self.register_mem_pool_host(pool)
        try:                              # say early whether the daemon is there
            self._give_back(self._take(_now() + self.cfg["timeout_ms"] / 1000.0), False)
        except _Down:
            pass

    # -- SGLang's hooks ----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host):
        """The host KV pool the pages move to and from; fixes the namespace (its layout).
        Never raises (SGLang re-raises it and does not start): a pool whose pages kvtier
        cannot reach leaves this backend a miss-only tier, with one warning."""
        self.ns = self._regions = None
        try:
            super().register_mem_pool_host(mem_pool_host)
            self.mem_pool_host = mem_pool_host
            try:
                page = mem_pool_host.get_data_page(0, flat=False)
                why = None
            except Exception as e:        # noqa: BLE001 - e.g. head_dim != v_head_dim
                page, why = None, e
            if isinstance(page, torch.Tensor):
                shape = self._register_views(mem_pool_host, page)
            else:
                shape = self._register_regions(mem_pool_host, why)
            self.ns = self._namespace(mem_pool_host, shape)
            self._kv = self._head_groups(mem_pool_host) or [self]
        except Exception as e:            # noqa: BLE001
            self.ns = self._regions = None
            self._kv = [self]
            self._warn_once("pool", "the host pool %s cannot be served (%s: %s): kvtier is a "
                            "miss-only tier for this server" % (
                                type(mem_pool_host).__name__, type(e).__name__, e))
            return
        log.info("kvtier.sglang: namespace %s, pages of %d bytes, endpoint %s", self.ns,
                 self.page_bytes, self.cfg["endpoint"])
        if self._kv[0] is not self:
            log.info("kvtier.sglang: heads split in %d (tp_lcm_size %s): namespaces %s",
                     len(self._kv), self.storage_config.tp_lcm_size,
                     ", ".join(lay.ns for lay in self._kv))

    def _head_groups(self, pool):
        """SGLang's should_split_heads (tp_lcm_size > tp_size, layout page_head, not MLA): each
        page is stored as tp_lcm_size // tp_size objects, one per head group, each in the
        namespace of the lcm rank whose heads it holds — so servers of different TP sizes of
        one model share one copy (a TP=2 rank's page is TP=4 ranks 2r and 2r+1's pages). None
        when not asked for or not possible (one warning)."""
        sc = self.storage_config
        lcm, tp = getattr(sc, "tp_lcm_size", None), int(getattr(sc, "tp_size", 1) or 1)
        if not getattr(sc, "should_split_heads", False) or not lcm:
            return None
        split, heads = int(lcm) // tp, int(getattr(pool, "head_num", 0) or 0)
        extra = getattr(sc, "extra_config", None) or {}
        why = ("layout %s is not page_head" % getattr(pool, "layout", None)
               if getattr(pool, "layout", None) != "page_head" else
               "%d heads do not split in %d" % (heads, split) if heads % split or split < 2 else
               "interface_v1 is not set (the generic calls move whole pages)"
               if not extra.get("interface_v1") else
               "pages without views" if not self._direct else None)
        if why:
            self._warn_once("split", "should_split_heads asked, but %s: pages stay whole, "
                            "shared only with servers of the same TP size" % why)
            return None
        groups = []
        base = int(getattr(sc, "tp_rank", 0) or 0) * split
        for g in range(split):
            gp = _HeadGroup(pool, g, split)
            lay = _Layout.__new__(_Layout)
            shape = self._register_views(gp, gp.get_data_page(0, flat=False), lay)
            lay.mem_pool_host, lay._regions = gp, None
            lay.ns = self._namespace(pool, shape, _ranks(sc, False, (base + g, int(lcm))),
                                     lay._page_dtype)
            groups.append(lay)
        return groups

    def _register_views(self, pool, page, lay=None):
        """Pools with page views (get_data_page(flat=False)): SGLang's MHA and MLA pools; sets
        `lay`'s page geometry (default: this backend's). Returns the page part of the
        namespace ("2x64x36x8x128")."""
        lay = self if lay is None else lay
        lay._page_size = int(pool.page_size)
        lay._page_shape = tuple(page.shape)
        lay._page_dtype = page.dtype
        lay.page_bytes = page.numel() * page.element_size()
        # Loads write straight into the page views when get_data_page(flat=False) is a view of
        # kv_buffer (SGLang's MHA and MLA pools); else through set_from_flat_data_page.
        lay._rows = _rows_of(page)
        lay._direct = _is_view_of(page, getattr(pool, "kv_buffer", None))
        try:
            page.view(lay._rows, -1)
        except RuntimeError:
            lay._direct = False
        lay._step = _affine_step(pool, page, lay._page_size)
        return "x".join(str(d) for d in page.shape)

    def _register_regions(self, pool, why):
        """Pools without page views (get_data_page raised `why`): their pages as the regions
        get_page_buffer_meta names (K and V of SGLang's asymmetric pool). Returns the page
        part of the namespace ("16x4x2x192+16x4x2x128")."""
        if not callable(getattr(pool, "get_page_buffer_meta", None)):
            raise why or TypeError("no get_data_page and no get_page_buffer_meta")
        self._regions = _Regions(pool)
        self._page_size = self._regions.page_size
        self.page_bytes = self._regions.page_bytes
        self._page_shape = (self.page_bytes,)
        self._page_dtype = torch.uint8
        self._rows, self._direct, self._step = 1, False, None
        return self._regions.shape

    def _namespace(self, pool, shape, rank_part=None, page_dtype=None):
        kind = "mla" if getattr(self.storage_config, "is_mla_model", False) else "mha"
        if page_dtype is None:
            page_dtype = self._page_dtype if self._regions is None else pool.dtype
        dtype = str(page_dtype).replace("torch.", "")
        kv_dtype = getattr(getattr(pool, "device_pool", None), "dtype", None)
        if kv_dtype is not None and kv_dtype != page_dtype:   # fp8 KV is stored as uint8
            dtype += "-" + str(kv_dtype).replace("torch.", "")
        layout = "%s.%s.%s.%s" % (kind, getattr(pool, "layout", "layout"), dtype, shape)
        return self._ns_of(rank_part or self.rank_part, layout)

    def _ns_of(self, rank_part, layout):
        ns = "%s/%s/%s" % (self.cfg["namespace"], rank_part, layout)
        if len(ns.encode("utf-8")) > 256:  # the daemon's limit: keep the tail, hash the rest
            tail = "/%s/%s" % (rank_part, layout)
            if len(tail.encode("utf-8")) > 200:
                raise ValueError("the page layout part of the namespace, %r, is too long"
                                 % tail)
            digest = hashlib.blake2b(ns.encode("utf-8"), digest_size=8).hexdigest()
            room = 256 - len(tail.encode("utf-8")) - len(digest) - 1
            head = self.cfg["namespace"].encode("utf-8")[:max(room, 0)].decode("utf-8", "ignore")
            ns = "%s~%s%s" % (head, digest, tail)
        return ns

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        """Newer SGLang registers every host pool by name (HybridCacheController), the KV
        anchor included. Each other pool (Mamba states, SWA windows, DSA indexer, DeepSeek-V4
        pools, draft KV) gets a namespace of its own, "<namespace>/<ranks>/<pool>.<layout>.
        <dtype>.<page bytes>", its pages moved as get_data_page / set_from_flat_data_page lay
        them out. A pool that offers neither is answered with misses (one warning)."""
        try:
            base = getattr(super(), "register_mem_host_pool_v2", None)
            if base is not None:
                base(host_pool, host_pool_name)
        except Exception as e:            # noqa: BLE001 - never into SGLang's start-up
            self._warn_once("pool-v2", "registering host pool %s: %s: %s" % (
                host_pool_name, type(e).__name__, e))
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name == "kv":
            if host_pool is not self.mem_pool_host:
                self.register_mem_pool_host(host_pool)
            return
        try:
            lay = self._pool_layout(host_pool, name)
        except Exception as e:            # noqa: BLE001
            lay = None
            self._warn_once("pool-" + name, "the %s host pool %s cannot be served (%s: %s): "
                            "its pages are misses, and so are the prefixes that need them" % (
                                name, type(host_pool).__name__, type(e).__name__, e))
        with self._stats_lock:
            self._pools[name] = lay
        if lay is not None:
            log.info("kvtier.sglang: pool %s: namespace %s, pages of %d bytes", name, lay.ns,
                     lay.page_bytes)

    def _pool_layout(self, pool, name):
        page = pool.get_data_page(0, flat=True)
        if not isinstance(page, torch.Tensor) or page.numel() == 0:
            raise TypeError("get_data_page gave %r" % (type(page).__name__,))
        nbytes = page.numel() * page.element_size()
        dtype = str(page.dtype).replace("torch.", "")
        replicated = name in _REPLICATED_POOLS and getattr(self.storage_config,
                                                           "is_mla_model", False)
        layout = "%s.%s.%s.%d" % (name, getattr(pool, "layout", "layout"), dtype, nbytes)
        ns = self._ns_of(_ranks(self.storage_config, replicated), layout)
        return _Layout(ns, pool, int(getattr(pool, "page_size", 1) or 1), page.dtype, nbytes)

    def _flat_layout(self, nbytes, dtype):
        """Pages of another size than the KV pool's through the generic calls (speculative
        decoding's draft KV: batch_set(["<hash>.draft"], ...)): a namespace per size."""
        key = (nbytes, dtype)
        with self._stats_lock:
            lay = self._flat.get(key)
        if lay is None:
            layout = "flat.%s.%d" % (str(dtype).replace("torch.", ""), nbytes)
            lay = _Layout(self._ns_of(self.rank_part, layout), None, 1, dtype, nbytes)
            with self._stats_lock:
                lay = self._flat.setdefault(key, lay)
        return lay

    @_guarded(lambda keys: 0)
    def batch_exists(self, keys, extra_info=None):
        """How many leading pages of `keys` kvtier has, in L1 or L2 (one LOOKUP); the L2 part
        starts loading into L1 at once, for the get to come."""
        self._count("exists_calls", 1)
        if not keys or self.ns is None:
            return 0
        kk = page_keys(keys)
        hits = self._run(lambda conn, left: min(self._exists(conn, kk, lay)
                                                for lay in self._kv), 0)
        self._count("exists_hits", hits)
        return hits

    @_guarded(lambda key: False)
    def exists(self, key):
        return self.batch_exists([key]) == 1

    @_guarded(_falses)
    def batch_get_v1(self, keys, host_indices, extra_info=None):
        """Pages straight from the arena into the host pool (one copy each): a list of bool,
        True for the leading pages found."""
        n = len(keys)
        if not self._fits(n, host_indices, self):
            return [False] * n
        starts = _starts(host_indices, self._page_size)
        regions = self._regions.at(host_indices) if self._regions is not None else None

        def sink_of(lay):
            def sink(base, flats):
                pool = lay.mem_pool_host
                if regions is not None:   # K and V runs of each page (no page views)
                    regions.select(range(base, base + len(flats))).move(flats, False)
                elif lay._direct:         # into the pool's page views, runs of pages at once
                    _Pages(pool, starts[base:base + len(flats)], lay._page_size).move(
                        flats, False, lay._rows, lay._step)
                else:
                    for j in range(len(flats)):
                        pool.set_from_flat_data_page(starts[base + j], flats.one(j))
            return sink

        done = n                          # split heads: a page is there when all its groups are
        for lay in self._kv:
            done = min(done, self._run(lambda conn, left: self._get(conn, keys[:done], left,
                                                                    sink_of(lay), lay), 0))
        return [True] * done + [False] * (n - done)

    @_guarded(_falses)
    def batch_set_v1(self, keys, host_indices, extra_info=None):
        """Pages of the host pool into L1 slots (one copy each; pages kvtier has already are
        skipped): a list of bool, True for each page stored or already there."""
        n = len(keys)
        if not self._fits(n, host_indices, self):
            return [False] * n
        if self._regions is not None:
            return self._run(lambda conn, left: self._set(
                conn, keys, self._regions.at(host_indices), self), [False] * n)
        starts = _starts(host_indices, self._page_size)
        ok = [True] * n
        for lay in self._kv:              # split heads: every group of a page, or not stored
            pages = _Pages(lay.mem_pool_host, starts, lay._page_size)
            got = self._run(lambda conn, left: self._set(conn, keys, pages, lay), [False] * n)
            ok = [a and b for a, b in zip(ok, got)]
        return ok

    @_guarded(lambda key: None)
    def get(self, key, target_location=None, target_sizes=None):
        got = self.batch_get([key], None if target_location is None else [target_location])
        return got[0] if isinstance(got, list) and got else None

    @_guarded(_nones)
    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """The pages as flat tensors (copied into target_locations when given, SGLang's dummy
        flat pages), None for each page past the leading ones found. Targets of another size
        than a KV page (draft KV) are read from that size's namespace."""
        n = len(keys)
        if self.ns is None or n == 0:     # a miss-only tier: nothing of this server's
            return [None] * n
        lay = self
        first = target_locations[0] if target_locations else None
        if isinstance(first, torch.Tensor):
            size = first.numel() * first.element_size()
            if size != self.page_bytes:
                lay = self._flat_layout(size, first.dtype)
        out = [None] * n

        def sink(base, flats):
            for j in range(len(flats)):
                i, src = base + j, flats.one(j)
                dst = target_locations[i] if target_locations is not None else None
                if (dst is None or not dst.is_contiguous()
                        or dst.numel() * dst.element_size() != lay.page_bytes):
                    dst = torch.empty(lay._page_shape, dtype=lay._page_dtype).flatten()
                _bytes_of(dst).copy_(src.view(torch.uint8))
                out[i] = dst

        self._run(lambda conn, left: self._get(conn, keys, left, sink, lay), 0)
        return out

    @_guarded(lambda key: False)
    def set(self, key, value=None, target_location=None, target_sizes=None):
        return self.batch_set([key], None if value is None else [value])

    @_guarded(lambda keys: False)
    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        """Stores flat pages, all of one size: a KV page's, or another's (speculative
        decoding's draft KV, "<hash>.draft") in that size's namespace. True when every page
        is stored or was already there."""
        n = len(keys)
        if values is None or len(values) != n:
            self._warn_once("values", "batch_set without one value per key: nothing stored")
            return False
        if self.ns is None or n == 0 or not isinstance(values[0], torch.Tensor):
            return False                  # (ns None: a miss-only tier)
        size0 = values[0].numel() * values[0].element_size()
        lay = self if size0 == self.page_bytes else self._flat_layout(size0, values[0].dtype)
        good = []
        for v in values:
            size = v.numel() * v.element_size() if isinstance(v, torch.Tensor) else None
            if size != lay.page_bytes:
                self._size_mismatch(size, lay)
                break                     # store the leading pages of the first one's size
            good.append(v.reshape(-1).view(lay._page_dtype))
        if len(good) < n:
            self._count("set_pages", n - len(good))
        done = self._run(lambda conn, left: self._set(conn, keys[:len(good)],
                                                      _Pages(tensors=good), lay), [False])
        return len(good) == n and all(done)

    # Hybrid models (SGLang's HybridCacheController, the default stack since PR #35081): the
    # KV pool and every other registered pool (Mamba states, SWA windows, DSA indexer,
    # DeepSeek-V4 pools, draft KV) move through the *_v2 calls, keyed by the KV pages'
    # hashes, each pool in its own namespace. A pool never registered or not servable is a
    # miss, so the prefixes that need it are misses: never a KV page without its side pools.

    @_guarded(lambda keys: _transfer_result(0, None, []))
    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        """SGLang's PoolTransferResult. restorable_prefix_pages: every prefix length (in pages)
        that the KV pool has and every pool asked for can restore — ALL_PAGES pools every page
        of it, TRAILING_PAGES pools the last len(transfer.keys) pages before its end — so that
        SGLang can intersect the ranks' lists; kv_hit_pages is the longest of them;
        extra_pool_hit_pages each pool's own longest."""
        final = self.batch_exists(keys, extra_info)
        hits = {"kv": final} if final else {}
        ends = set(range(1, final + 1))
        for t in pool_transfers or ():
            name = _pool_name(t)
            if name == "kv":
                continue
            lay = self._pools.get(name)
            if lay is None:
                if name not in self._pools:
                    self._warn_once("unregistered-" + name, "pool %s was never registered "
                                    "(register_mem_host_pool_v2): its prefixes are misses"
                                    % name)
                found = 0
            elif not ends:
                found = 0
            elif getattr(t, "hit_policy", None) is not None and \
                    str(getattr(t.hit_policy, "value", t.hit_policy)) == "trailing_pages":
                legal = self._trailing(lay, keys, max(ends), max(1, len(t.keys or ())))
                found = max(legal, default=0)
                ends &= legal
            else:
                kk = page_keys(keys[:max(ends)])
                found = self._run(lambda conn, left: self._exists(conn, kk, lay), 0)
            hits[name] = found
            ends &= set(range(1, found + 1))
        restorable = sorted(ends)
        return _transfer_result(restorable[-1] if restorable else 0, hits, restorable)

    def _trailing(self, lay, keys, upto, window):
        """The prefix lengths p <= upto whose last `window` pages `lay` has, as a set: probing
        p = upto downwards, and past a missing page straight to the prefix that ends before it
        (at most _TRAILING_PROBES LOOKUPs; shorter prefixes are left out)."""
        kk = page_keys(keys[:upto])

        def probe(conn, left):
            legal, p = set(), upto
            for _ in range(_TRAILING_PROBES):
                if p < 1:
                    break
                lo = max(0, p - window)
                got = conn.req().lookup(lay.ns, kk[lo:p], salt=self.cfg["salt"],
                                        prefetch=True).hits
                if got == p - lo:
                    legal.add(p)
                    p -= 1
                else:                     # every window holding page lo + got fails too
                    p = lo + got
            return legal
        return self._run(probe, set())

    @_guarded(lambda transfers: _transfer_misses(transfers))
    def batch_get_v2(self, transfers, extra_info=None):
        """{pool name: [bool per key]}: each transfer's pages into its pool (the KV pool's as
        batch_get_v1); pages past the leading ones found are False."""
        return self._each_pool(transfers, self.batch_get_v1, self._pool_get, extra_info)

    @_guarded(lambda transfers: _transfer_misses(transfers))
    def batch_set_v2(self, transfers, extra_info=None):
        """{pool name: [bool per key]}: each transfer's pages from its pool (the KV pool's as
        batch_set_v1)."""
        return self._each_pool(transfers, self.batch_set_v1, self._pool_set, extra_info)

    def _each_pool(self, transfers, kv_call, pool_call, extra_info):
        out = {}
        for t in transfers:
            keys, name = list(t.keys or ()), _pool_name(t)
            if name == "kv":
                out[t.name] = kv_call(keys, t.host_indices, extra_info)
            else:
                out[t.name] = pool_call(self._pools.get(name), keys, t.host_indices)
        return out

    def _pool_get(self, lay, keys, host_indices):
        n = len(keys)
        if lay is None or not self._fits(n, host_indices, lay):
            return [False] * n
        starts, pool = _starts(host_indices, lay._page_size), lay.mem_pool_host

        def sink(base, flats):
            for j in range(len(flats)):
                pool.set_from_flat_data_page(starts[base + j], flats.one(j))

        done = self._run(lambda conn, left: self._get(conn, keys, left, sink, lay), 0)
        return [True] * done + [False] * (n - done)

    def _pool_set(self, lay, keys, host_indices):
        n = len(keys)
        if lay is None or not self._fits(n, host_indices, lay):
            return [False] * n
        pages = []
        for s in _starts(host_indices, lay._page_size):
            page = lay.mem_pool_host.get_data_page(s, flat=True)
            if page.numel() * page.element_size() != lay.page_bytes:
                self._size_mismatch(page.numel() * page.element_size(), lay)
                break
            pages.append(page.reshape(-1).view(lay._page_dtype))
        ok = self._run(lambda conn, left: self._set(conn, keys[:len(pages)],
                                                    _Pages(tensors=pages), lay),
                       [False] * len(pages))
        return list(ok) + [False] * (n - len(pages))

    def clear(self):
        """SGLang's cache flush: removes this backend's namespace (every rank sharing it)."""
        if self.ns is None:
            return
        for lay in self._kv:
            self._run(lambda conn, left: conn.req().clear(lay.ns), 0)

    def get_stats(self):
        return None                       # SGLang's storage metrics want its own type

    def stats(self):
        """This backend's counters (pages asked, found, stored; outages)."""
        with self._stats_lock:
            return dict(self._stats, down=self._down, connections=self._live)

    def close(self):
        """Closes every connection (SGLang calls it when the backend is detached)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            dead = self._idle + self._graveyard
            self._live -= len(self._idle)
            self._idle, self._graveyard = [], []
            thread = self._thread
            self._cond.notify_all()
        self._wake.set()
        if thread is not None:
            thread.join(timeout=self.cfg["timeout_ms"] / 1000.0 + 2)
        for c in dead:
            c.close()

    # -- the moves ---------------------------------------------------------------------------

    def _fits(self, n, host_indices, lay):
        if lay.ns is None:
            return False
        if n == 0 or host_indices is None or len(host_indices) != n * lay._page_size:
            if n:
                self._warn_once("indices", "host_indices of %s entries for %d pages of %d "
                                "tokens: nothing moved" % (
                                    None if host_indices is None else len(host_indices), n,
                                    lay._page_size))
            return False
        return True

    def _exists(self, conn, keys, lay):
        """Every page in L1 by the residency map: answered without a request (no daemon to
        wake). Else one LOOKUP with prefetch: the L2 part of the hits starts loading into L1
        now, for the get SGLang makes next."""
        local = conn.client.resident_prefix(lay.ns, keys, salt=self.cfg["salt"])
        if local is not None and local == len(keys):
            self._count("exists_local", 1)
            return local
        return conn.req().lookup(lay.ns, keys, salt=self.cfg["salt"], prefetch=True).hits

    def _get(self, conn, keys, deadline, sink, lay):
        """ACQUIRE the leading pages, sink(first index, [1-D tensor of the page dtype per
        page]) them, RELEASE; when L1
        stops short of what kvtier has, the rest is loaded from L2 (one prefetch, waited for
        until the deadline) and acquired as it arrives. Returns how many leading pages were
        placed."""
        kk = page_keys(keys)
        n = len(kk)
        self._count("get_pages", n)
        done = self._acquire_pipelined(conn, kk, sink, lay)
        job = None
        while done < n and _now() < deadline:
            r = conn.req().lookup(lay.ns, kk[done:], salt=self.cfg["salt"],
                                  prefetch=job is None)
            if job is None:
                job = r.job               # None: no job slot now; asked again next round
            if r.hits == 0:
                break                     # a miss in every tier
            if r.l1 == 0:                 # still loading (or L1 had no room: load again)
                if _now() >= deadline:
                    break
                if job is not None and conn.req().prefetch_status(job).done:
                    job = None            # what it loaded shows in the next LOOKUP
                time.sleep(0.001)
                continue
            got = self._acquire_into(conn, kk[done:], done, sink, lay)
            if got == 0:
                break                     # evicted between LOOKUP and ACQUIRE
            done += got
        self._count("get_hits", done)
        return done

    def _chunk(self, n, lay):
        """Pages per request when a batch is pipelined: at least 8 MiB, at most 4 chunks
        (each request costs the caller's thread some Python as well)."""
        per = max(1, (8 << 20) // max(1, lay.page_bytes))
        return max(per, -(-n // 4))

    def _acquire_into(self, conn, kk, base, sink, lay):
        """One ACQUIRE of kk (pages base, base + 1, ...): sinks the leading pages found."""
        if conn.arena() is None:          # no shared arena (a tcp endpoint): bytes inline
            srcs = []
            for data in conn.req().get(lay.ns, kk, salt=self.cfg["salt"], copy=False):
                if len(data) != lay.page_bytes:
                    self._size_mismatch(len(data), lay)
                    break
                srcs.append(torch.frombuffer(bytearray(data), dtype=torch.uint8)
                            .view(lay._page_dtype))
            if srcs:
                sink(base, _Flats(tensors=srcs))
            return len(srcs)
        slots, lease = conn.req().acquire_offsets(lay.ns, kk, salt=self.cfg["salt"])
        return self._sink_slots(conn, slots, lease, base, sink, lay)

    def _acquire_pipelined(self, conn, kk, sink, lay):
        """_acquire_into in chunks: the next chunk's ACQUIRE travels while this one's pages
        are copied. Stops at the first page not found."""
        n = len(kk)
        per = self._chunk(n, lay)
        if n <= per or conn.arena() is None:
            return self._acquire_into(conn, kk, 0, sink, lay)
        spans = [(lo, min(n, lo + per)) for lo in range(0, n, per)]
        salt = self.cfg["salt"]
        slots, lease = conn.req().acquire_offsets(lay.ns, kk[:per], salt=salt)
        pending = None
        done = 0
        try:
            for j, (lo, hi) in enumerate(spans):
                if j:
                    conn.req(50)          # (sent a copy ago: its reply is likely here)
                    slots, lease = pending()
                    pending = None
                if j + 1 < len(spans):
                    nlo, nhi = spans[j + 1]
                    pending = conn.client.acquire_offsets_begin(lay.ns, kk[nlo:nhi],
                                                                salt=salt)
                got = self._sink_slots(conn, slots, lease, lo, sink, lay)
                done += got
                if got < hi - lo:
                    break
            if pending is not None:       # asked for past a miss: let it go
                conn.req(50)
                _, lease = pending()
                if lease:
                    conn.client.post(RELEASE, {"lease": lease})
        except Exception as e:
            raise _Broken(e) from e       # replies still due: this connection goes
        return done

    def _sink_slots(self, conn, slots, lease, base, sink, lay):
        try:
            conn.arena()                  # follows a re-mapped arena
            arena = conn.typed(lay._page_dtype)
            es = arena.element_size()
            offs = []
            for off, length in slots:
                if length != lay.page_bytes:
                    self._size_mismatch(length, lay)
                    break
                offs.append(off // es)
            if offs:
                sink(base, _Flats(arena, offs, lay.page_bytes // es))
        finally:
            if lease:                     # the reply is not waited for: the bytes are copied
                conn.client.post(RELEASE, {"lease": lease})
        return len(offs)

    def _set(self, conn, keys, pages, lay):
        """RESERVE the pages kvtier lacks, copy each from `pages` (a _Pages), COMMIT.
        -> list of bool per key."""
        n = len(keys)
        self._count("set_pages", n)
        ok = [False] * n
        kk = page_keys(keys[:n])
        salt = self.cfg["salt"]
        if conn.arena() is None:          # no shared arena: the bytes ride PUT
            per = max(1, conn.client.max_message // 2 // lay.page_bytes)
            for lo in range(0, n, per):
                hi = min(n, lo + per)
                datas = [_bytes_of(pages.one(i).contiguous()).numpy() for i in range(lo, hi)]
                self._count("set_stored", conn.req().put(lay.ns, kk[lo:hi], datas, salt=salt))
            # PUT stores what fits and counts only new objects: what is there says it
            hits = conn.req().lookup(lay.ns, kk, salt=salt).hits
            return [True] * hits + ok[hits:]
        # In chunks, pipelined: the next chunk's RESERVE and this one's COMMIT travel while
        # pages are copied; the COMMITs are waited for at the end.
        per = self._chunk(n, lay)
        spans = [(lo, min(n, lo + per)) for lo in range(0, n, per)]
        slots, lease = conn.req().reserve_offsets(lay.ns, kk[:per], lay.page_bytes,
                                                  salt=salt)
        pending, commits = None, []
        try:
            for j, (lo, hi) in enumerate(spans):
                if j:
                    try:
                        conn.req(50)
                        slots, lease = pending()
                    except KvtierError as e:
                        if e.code in ("timeout", "protocol"):
                            raise
                        self._warn_once(e.code, "kvtier answered %s: %s (pages not stored)"
                                        % (e.code, e))
                        slots, lease = [], 0
                    pending = None
                if j + 1 < len(spans):
                    nlo, nhi = spans[j + 1]
                    pending = conn.client.reserve_offsets_begin(lay.ns, kk[nlo:nhi],
                                                                lay.page_bytes, salt=salt)
                todo, failed = self._fill(conn, slots, pages, lo, ok, lay)
                if lease:
                    commits.append((todo, conn.client.commit_begin(lease, failed)))
            for todo, end in commits:
                try:
                    conn.req(50)
                    self._count("set_stored", end())
                except KvtierError as e:
                    if e.code in ("timeout", "protocol"):
                        raise
                    self._warn_once(e.code, "kvtier answered %s to a COMMIT: %s" % (e.code, e))
                    for i in todo:
                        ok[i] = False
        except Exception as e:
            raise _Broken(e) from e       # replies still due, leases held: the connection goes
        return ok

    def _fill(self, conn, slots, pages, lo, ok, lay):
        """Copies page lo + i of `pages` into slot i of a RESERVE (None: stored already). Returns
        (the pages copied, the slot indices whose copy failed, for COMMIT)."""
        todo = []
        for i, rng in enumerate(slots):
            if rng is None:
                ok[lo + i] = True         # stored already (by this or another rank)
                self._count("set_skipped", 1)
            else:
                todo.append(lo + i)
        if not todo:
            return todo, []
        conn.arena()                      # follows a re-mapped arena
        arena = conn.typed(lay._page_dtype)
        es = arena.element_size()
        flats = _Flats(arena, [slots[i - lo][0] // es for i in todo], lay.page_bytes // es)
        try:
            pages.select(todo).move(flats, True, lay._rows, lay._step)
        except (RuntimeError, ValueError, TypeError) as e:
            self._warn_once("copy", "pages could not be copied into kvtier: %s" % e)
            return [], [i - lo for i in todo]
        for i in todo:
            ok[i] = True
        return todo, []

    # -- connections, deadlines, failures ------------------------------------------------------
    #
    # A request that times out closes its connection (its leases go with its instance) and
    # asks the background thread for a probe: a new connection (HELLO). If that fails too the
    # daemon is down: calls answer misses at once until the thread reconnects. A slow answer
    # (an L2 lookup under load) thus costs one connection, not an outage.

    def _run(self, op, miss):
        """op(conn, deadline) on a pooled connection; `miss` when there is none, the daemon
        does not answer in time, or anything else fails."""
        if self._closed:
            return miss
        deadline = _now() + self.cfg["timeout_ms"] / 1000.0
        try:
            conn = self._take(deadline)
        except _Down:
            return miss
        broken = False
        try:
            conn.deadline = deadline
            try:
                return op(conn, deadline)
            except _Broken as b:
                broken = True
                raise b.cause from None
        except KvtierError as e:
            if e.code in ("timeout", "protocol"):
                broken = True
                self._count("timeouts", 1)
                self._suspect(conn.gen, e)
            else:
                self._count("errors", 1)
                self._warn_once(e.code, "kvtier answered %s: %s (counted as a miss)"
                                % (e.code, e))
            return miss
        except Exception as e:            # noqa: BLE001 - never into SGLang's threads
            broken = True
            self._count("errors", 1)
            self._warn_once(type(e).__name__, "%s: %s (counted as a miss)"
                            % (type(e).__name__, e))
            return miss
        finally:
            self._give_back(conn, broken)

    def _take(self, deadline):
        """An idle connection, or a new one while fewer than max_connections are open (its
        HELLO waits up to timeout_ms); _Down when the daemon is down or none frees up in
        time."""
        with self._cond:
            while True:
                if self._down or self._closed:
                    raise _Down()
                if self._idle:
                    return self._idle.pop()
                if self._live < self.cfg["max_connections"]:
                    self._live += 1
                    gen = self._gen
                    break
                left = deadline - _now()
                if left <= 0:
                    self._warn_once("busy", "all %d kvtier connections stayed busy for "
                                    "timeout_ms: a miss" % self.cfg["max_connections"])
                    raise _Down()
                self._cond.wait(left)
        full = self.cfg["timeout_ms"]
        wait_ms = min(full, int((deadline - _now()) * 1000))
        try:
            if wait_ms < min(full, 100):
                raise _Down()             # no time left to open a connection: a miss
            return _Conn(self._new_client(wait_ms), gen)
        except Exception as e:            # noqa: BLE001 - Timeout, zmq errors
            with self._cond:
                self._live -= 1
                self._cond.notify()
            if isinstance(e, _Down):
                raise
            if wait_ms >= full - 5:
                self._mark_down(gen, e)   # a HELLO unanswered for timeout_ms: down
            else:
                self._suspect(gen, e)     # a shorter wait says less: probe
            raise _Down() from None

    def _new_client(self, timeout_ms=None):
        """A Client; its HELLO waits timeout_ms (default the configured), its requests then
        the configured timeout_ms."""
        full = self.cfg["timeout_ms"]
        client = Client(self.cfg["endpoint"], client="sglang",
                        timeout_ms=timeout_ms or full, map_arena=self.cfg["shared_memory"],
                        heartbeat_ms=self.cfg["heartbeat_ms"])
        client.timeout_ms = full
        return client

    def _give_back(self, conn, broken):
        with self._cond:
            if self._closed:
                self._live -= 1
                closing = True
            elif broken or conn.gen != self._gen:
                self._live -= 1
                self._graveyard.append(conn)      # closed by the background thread
                self._start_thread()
                closing = False
            else:
                self._idle.append(conn)
                closing = False
            self._cond.notify()
        if closing:
            conn.close()                  # close() ran meanwhile: BYE, at most 100 ms

    def _suspect(self, gen, exc):
        """A request timed out on a connection of generation gen: probe the daemon."""
        with self._cond:
            if self._down or self._closed or gen != self._gen:
                return
            self._probe = exc
            self._start_thread()

    def _mark_down(self, gen, exc):
        """The daemon did not answer a HELLO: misses at once until it answers again. Only for
        connections of the current generation (a late timeout from before a reconnection
        says nothing about the daemon now)."""
        with self._cond:
            if self._down or self._closed or gen != self._gen:
                return
            self._down = True
            self._probe = None
            self._gen += 1
            self._graveyard.extend(self._idle)
            self._live -= len(self._idle)
            self._idle = []
            self._cond.notify_all()       # waiters for a connection miss at once
            self._start_thread()
        self._count("outages", 1)
        log.warning("kvtier.sglang: the daemon at %s does not answer (%s); reporting misses "
                    "and reconnecting every %d ms", self.cfg["endpoint"], exc,
                    self.cfg["reconnect_interval_ms"])

    def _start_thread(self):
        """With the lock held."""
        self._wake.set()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._background, daemon=True,
                                            name="kvtier-sglang")
            self._thread.start()

    def _background(self):
        """Probes, reconnects, and closes dead connections (their BYE never on SGLang's
        threads). Ends when there is nothing left to do."""
        interval = self.cfg["reconnect_interval_ms"] / 1000.0
        while True:
            self._wake.clear()
            with self._cond:
                if self._closed:
                    dead, self._graveyard = self._graveyard, []
                    self._thread = None
                    break
                gen, down, probe = self._gen, self._down, self._probe
            if down or probe is not None:
                try:
                    client = self._new_client()
                except Exception as e:    # noqa: BLE001 - not answering
                    client, failure = None, e
                stray = None              # a new Client nobody takes: closed here, once
                with self._cond:
                    if client is None:
                        outcome = "failed"
                    elif self._closed:
                        stray, outcome = client, "closed"
                    elif not self._down and self._live >= self.cfg["max_connections"]:
                        self._probe = None        # it answered; the pool is full
                        stray, outcome = client, "answered"
                    else:
                        self._idle.append(_Conn(client, self._gen))
                        self._live += 1
                        self._probe = None
                        outcome = "back" if self._down else "answered"
                        self._down = False
                        if outcome == "back":
                            self._warned.clear()
                        self._cond.notify_all()
                if stray is not None:
                    _Conn(stray, gen).close()
                if outcome == "failed" and not down:
                    self._mark_down(gen, failure)
                elif outcome == "back":
                    log.warning("kvtier.sglang: the daemon at %s answers again",
                                self.cfg["endpoint"])
            with self._cond:
                dead, self._graveyard = self._graveyard, []
            for c in dead:
                c.close()
            with self._cond:
                if self._closed:
                    continue
                if not self._down and self._probe is None and not self._graveyard:
                    self._thread = None
                    return
                down = self._down
            if down:
                self._wake.wait(interval)
        for c in dead:
            c.close()

    def _count(self, name, n):
        with self._stats_lock:
            self._stats[name] += n

    def _size_mismatch(self, got, lay):
        self._warn_once("size", "a page of %s bytes where namespace %s holds pages of %d: "
                        "refused (another page layout?)" % (got, lay.ns, lay.page_bytes))

    def _warn_once(self, what, msg):
        if what not in self._warned:
            self._warned.add(what)
            log.warning("kvtier.sglang: %s", msg)


def _rows_of(t):
    """How many runs a page view is made of (K and V halves, or one per layer and K/V): the
    product of the dims before its longest contiguous tail of dims. page.view(rows, -1) then
    copies as `rows` contiguous runs, at memcpy speed, where torch's copy of the whole strided
    view does not."""
    k, expected = t.dim(), 1
    for d in range(t.dim() - 1, -1, -1):
        if t.size(d) != 1 and t.stride(d) != expected:
            break
        expected *= t.size(d)
        k = d
    rows = 1
    for n in t.shape[:k]:
        rows *= n
    return rows


def _copy_page(page, flat, out, rows):
    """page -> flat (out) or flat -> page; flat is contiguous, 1-D, of the page's dtype and
    element count, in the order of page.flatten()."""
    f = flat.view(rows, -1)
    if out:
        try:
            f.copy_(page.view(rows, -1))
        except RuntimeError:              # not `rows` runs after all: torch walks it
            flat.view(page.shape).copy_(page)
    else:
        page.view(rows, -1).copy_(f)


class _Flats:
    """The arena side of one call, as 1-D tensors of the page dtype: slices of the arena (a
    typed view of it and offsets in elements) or tensors of their own (GET's bytes)."""

    def __init__(self, arena=None, offs=(), elems=0, tensors=None):
        self.arena, self.offs, self.elems, self.tensors = arena, offs, elems, tensors

    def __len__(self):
        return len(self.tensors) if self.tensors is not None else len(self.offs)

    def one(self, j):
        if self.tensors is not None:
            return self.tensors[j]
        return self.arena[self.offs[j]:self.offs[j] + self.elems]

    def follows(self, j):
        """Page j starts where page j - 1 ends (in the arena)."""
        return self.tensors is None and self.offs[j] == self.offs[j - 1] + self.elems

    def run(self, j, m, rows):
        o = self.offs[j]
        return self.arena[o:o + m * self.elems].view(m, rows, -1)


class _Pages:
    """The pool side of one call: pages of the host pool by their first token slot (the v1
    calls: views from get_data_page(flat=False)), or tensors of their own (the generic calls:
    flat pages SGLang handed over)."""

    def __init__(self, pool=None, starts=(), page_size=0, tensors=None):
        self.pool, self.starts, self.page_size, self.tensors = pool, starts, page_size, tensors

    def __len__(self):
        return len(self.tensors) if self.tensors is not None else len(self.starts)

    def one(self, k):
        if self.tensors is not None:
            return self.tensors[k]
        return self.pool.get_data_page(self.starts[k], flat=False)

    def select(self, ks):
        if self.tensors is not None:
            return _Pages(tensors=[self.tensors[k] for k in ks])
        return _Pages(self.pool, [self.starts[k] for k in ks], self.page_size)

    def follows(self, k):
        """Page k is the page after page k - 1 in the pool."""
        return (self.tensors is None
                and self.starts[k] == self.starts[k - 1] + self.page_size)

    def strided(self, k, m, rows, step):
        """Pages k .. k + m - 1 (each following the one before) as one (m, rows, run) view:
        the first page's view, stepped by `step` elements (_affine_step); torch refuses a
        view that leaves the storage of the first."""
        pv = self.one(k).view(rows, -1)
        return torch.as_strided(pv, (m, rows, pv.size(1)), (step, pv.stride(0), 1))

    def move(self, flats, out, rows, step):
        _move(self, flats, out, rows, step)


class _Regions:
    """How a host pool without page views lays its pages out (SGLang's
    AsymmetricMHATokenToKVPoolHost: head_dim != v_head_dim, K and V in buffers of their own):
    get_page_buffer_meta(indices) names R runs of bytes per page (K, then V), each inside one
    of the pool's CPU tensors; kvtier stores a page as its runs back to back. Checked once
    here on page 0, and on every call against the sizes seen here and the buffers' bounds."""

    def __init__(self, pool):
        self.pool = pool
        self.page_size = int(pool.page_size)
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        self.sizes = [int(x) for x in sizes]
        if not self.sizes or len(ptrs) != len(self.sizes) or min(self.sizes) <= 0:
            raise ValueError("get_page_buffer_meta named no usable regions (%r)" % (sizes,))
        self.bufs = _cpu_buffers(pool)
        self.which = [self._find(int(p), n) for p, n in zip(ptrs, self.sizes)]
        self.cum = [sum(self.sizes[:r]) for r in range(len(self.sizes))]
        self.page_bytes = sum(self.sizes)
        self.shape = "+".join(self._shape(r) for r in range(len(self.sizes)))

    def _find(self, ptr, n):
        for i, (base, nbytes, _, _) in enumerate(self.bufs):
            if base <= ptr and ptr + n <= base + nbytes:
                return i
        raise ValueError("a page region (%d bytes at 0x%x) lies in none of the pool's "
                         "contiguous CPU tensors" % (n, ptr))

    def _shape(self, r):
        """Region r as the dims of its buffer: 16x4x2x192 (tokens, layers, heads, dim)."""
        t = self.bufs[self.which[r]][3]
        es, n = t.element_size(), self.sizes[r]
        row = t[0].numel() * es if t.dim() > 1 else 0
        if row and n % row == 0:
            return "x".join(str(d) for d in (n // row,) + tuple(t.shape[1:]))
        return str(n // es)

    def at(self, host_indices):
        """The pages of host_indices (page_size slots each), one get_page_buffer_meta call."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        nr, n = len(self.sizes), len(host_indices) // self.page_size
        if len(ptrs) != n * nr or [int(x) for x in sizes] != self.sizes * n:
            raise ValueError("get_page_buffer_meta gave %d regions of other sizes for %d "
                             "pages" % (len(ptrs), n))
        offs = []
        for j in range(n):
            row = []
            for r in range(nr):
                base, nbytes = self.bufs[self.which[r]][:2]
                o = int(ptrs[j * nr + r]) - base
                if o < 0 or o + self.sizes[r] > nbytes:
                    raise ValueError("a page region outside its buffer")
                row.append(o)
            offs.append(row)
        return _RegionPages(self, offs)

    def run(self, r, off, m):
        """m regions r that follow each other from byte off, as an (m, size) uint8 view."""
        size = self.sizes[r]
        return self.bufs[self.which[r]][2][off:off + m * size].view(m, size)


class _RegionPages:
    """The pool side of one call on a _Regions pool: the byte offsets of each page's regions."""

    def __init__(self, regions, offs):
        self.regions, self.offs = regions, offs

    def __len__(self):
        return len(self.offs)

    def one(self, k):
        """Page k as one tensor (a copy: the paths without a shared arena)."""
        g = self.regions
        return torch.cat([g.run(r, o, 1)[0] for r, o in enumerate(self.offs[k])])

    def select(self, ks):
        return _RegionPages(self.regions, [self.offs[k] for k in ks])

    def follows(self, k):
        return all(o == p + n for o, p, n in zip(self.offs[k], self.offs[k - 1],
                                                 self.regions.sizes))

    def move(self, flats, out, rows=None, step=None):
        """Page k -> flats.one(k) (out) or back; a run of pages that follow each other in the
        pool and in the arena moves as one strided copy per region."""
        g, pb = self.regions, self.regions.page_bytes
        k, n = 0, len(self)
        while k < n:
            m = 1
            while k + m < n and self.follows(k + m) and flats.follows(k + m):
                m += 1
            if flats.tensors is None:
                o = flats.offs[k]
                slab = flats.arena[o:o + m * pb].view(m, pb)
            else:
                slab = flats.one(k).view(torch.uint8).view(1, pb)
            for r, off in enumerate(self.offs[k]):
                pool_side = g.run(r, off, m)
                arena_side = slab[:, g.cum[r]:g.cum[r] + g.sizes[r]]
                if out:
                    arena_side.copy_(pool_side)
                else:
                    pool_side.copy_(arena_side)
            k += m


def _cpu_buffers(pool):
    """(data_ptr, bytes, flat uint8 view, tensor) of each contiguous CPU tensor the pool
    holds as an attribute (alone or in a tuple/list: kv_buffer = (k_buffer, v_buffer))."""
    out, seen = [], set()
    for v in vars(pool).values():
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
                    and t.numel() and t.data_ptr() not in seen):
                seen.add(t.data_ptr())
                out.append((t.data_ptr(), t.numel() * t.element_size(),
                            t.reshape(-1).view(torch.uint8), t))
    return out


def _move(pages, flats, out, rows, step=None):
    """Page k of `pages` -> flats.one(k) (out) or back. With `step` (the pool's pages are
    affine, _affine_step), a run of pages that follow each other in the pool and in the
    arena goes as one strided copy (one torch call, not one per page); a run torch refuses
    goes page by page."""
    k, n = 0, len(pages)
    while k < n:
        m = 1
        while (step and k + m < n and pages.follows(k + m) and flats.follows(k + m)):
            m += 1
        if m > 1:
            try:
                pool_side = pages.strided(k, m, rows, step)
            except RuntimeError:
                pool_side = None
            if pool_side is not None:
                flat_side = flats.run(k, m, rows)
                if out:
                    flat_side.copy_(pool_side)
                else:
                    pool_side.copy_(flat_side)
                k += m
                continue
        for j in range(k, k + m):
            page = pages.one(j)
            _copy_page(page, flats.one(j), out, rows if page.dim() > 1 else 1)
        k += m


def _affine_step(pool, page0, page_size):
    """The distance in elements from one page's view to the next's when the pool's page
    views are affine in their first slot (SGLang's pools slice one kv_buffer), checked on
    pages 0, 1, 2, the middle one and the last; else None (pages then move one by one)."""
    pages = int(getattr(pool, "size", 0) or 0) // page_size
    if pages < 3:
        return None
    try:
        es, p0 = page0.element_size(), page0.data_ptr()
        step = pool.get_data_page(page_size, flat=False).data_ptr() - p0
        if step <= 0 or step % es:
            return None
        for i in (2, pages // 2, pages - 1):
            v = pool.get_data_page(i * page_size, flat=False)
            if (v.data_ptr() != p0 + i * step or v.shape != page0.shape
                    or v.stride() != page0.stride()):
                return None
        return step // es
    except Exception:                     # noqa: BLE001 - any surprise: no runs
        return None


def _starts(host_indices, page_size):
    """The first token slot of each page: host_indices[0], [page_size], ..."""
    firsts = host_indices[::page_size]
    return firsts.tolist() if hasattr(firsts, "tolist") else [int(i) for i in firsts]


def _is_view_of(page, buf):
    if not isinstance(buf, torch.Tensor) or page.device != buf.device:
        return False
    lo = buf.data_ptr()
    return lo <= page.data_ptr() < lo + buf.numel() * buf.element_size()


def _bytes_of(t):
    """A flat uint8 view of a contiguous tensor."""
    return t.reshape(-1).view(torch.uint8)


def _now():
    return time.monotonic()
