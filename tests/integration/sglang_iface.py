"""SGLang's HiCache storage interface, for tests that cannot install SGLang: written here from
SGLang's own definitions (python/sglang/srt/mem_cache/hicache_storage.py,
storage/backend_factory.py, managers/cache_controller.py and the host pools of
mem_cache/memory_pool_host.py, as of the 0.5.x releases), reduced to what a storage backend
meets. install() puts the interface module under its real name in sys.modules, so that
kvtier.sglang subclasses it as it would SGLang's; call it before importing kvtier.sglang.

    HiCacheStorage      the abstract base (get/batch_get/set/batch_set/exists abstract;
                        batch_exists, register_mem_pool_host, the v1 methods and the hybrid
                        pools' v2 methods as SGLang's; PoolName, PoolTransfer, ...)
    create_backend()    the factory's "dynamic" path: backend_name, module_path, class_name
                        required; import; issubclass check; cls(storage_config, {}); then the
                        controller's register_mem_pool_host(host_pool)
    HostPool            an MHA or MLA host KV pool over a CPU tensor in one of SGLang's layouts
    AsymmetricHostPool  the pool of models whose head_dim != v_head_dim (K and V buffers of
                        their own; no flat pages, get_page_buffer_meta only)
    NoStoragePool       a pool that refuses every storage call (SGLang's int2 host pool)
    MambaHostPool       SGLang's MambaPoolHost: one slot per state (page_size 1), a flat page
                        the temporal then conv states' bytes (uint8)
    HybridController    HybridCacheController's storage calls for hybrid models: every pool
                        registered with register_mem_host_pool_v2, batch_set_v2 then the KV
                        write, batch_exists_v2 with placeholder keys for TRAILING_PAGES pools,
                        KV-derived pools loaded beside the KV pages, the others at the end
                        with their keys re-synced to the hit prefix
    Controller          the controller's two ways of moving pages: zero-copy (interface_v1:
                        batch_exists, batch_get_v1, batch_set_v1) and generic (batch_get into
                        dummy flat pages, batch_set of get_data_page copies)
"""

import abc
import dataclasses
import enum
import importlib
from typing import Any, List, Optional

import torch


@dataclasses.dataclass
class HiCacheStorageConfig:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    is_page_first_layout: bool
    model_name: Optional[str]
    dp_rank: int = 0
    dp_size: int = 1
    tp_lcm_size: Optional[int] = None
    should_split_heads: bool = False
    extra_config: Optional[dict] = None


@dataclasses.dataclass
class HiCacheStorageExtraInfo:
    prefix_keys: Optional[List[str]] = None
    extra_info: Optional[dict] = None


class PoolName(str, enum.Enum):
    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"
    INDEXER = "indexer"
    DEEPSEEK_V4_C4 = "deepseek_v4_c4"
    DEEPSEEK_V4_C4_INDEXER = "deepseek_v4_c4_indexer"
    DEEPSEEK_V4_C128 = "deepseek_v4_c128"
    DEEPSEEK_V4_C4_STATE = "deepseek_v4_c4_state"
    DEEPSEEK_V4_C4_INDEXER_STATE = "deepseek_v4_c4_indexer_state"
    DEEPSEEK_V4_C128_STATE = "deepseek_v4_c128_state"
    DRAFT = "draft"
    DRAFT_INDEXER = "draft_indexer"
    DRAFT_SWA = "draft_swa"

    def __str__(self):
        return self.value


class PoolHitPolicy(str, enum.Enum):
    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


@dataclasses.dataclass
class PoolTransfer:
    name: PoolName
    host_indices: Optional[torch.Tensor] = None
    device_indices: Optional[torch.Tensor] = None
    keys: Optional[List[str]] = None
    hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    nodes_to_load: Optional[List[Any]] = None
    indices_from_pool: Optional[PoolName] = None


@dataclasses.dataclass
class PoolTransferResult:
    kv_hit_pages: int
    extra_pool_hit_pages: dict
    # TRAILING_PAGES pools make some prefix lengths restorable and shorter ones not; each
    # rank's list of every restorable length, which the caller intersects across ranks
    restorable_prefix_pages: Optional[List[int]] = None


def count_pool_hits(results):
    """SGLang's: a pool's hits are the leading run of True."""
    return {name: (rs.index(False) if False in rs else len(rs)) for name, rs in results.items()}


class HiCacheStorage(abc.ABC):
    def register_mem_pool_host(self, mem_pool_host):
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        if not hasattr(self, "registered_pools"):
            self.registered_pools = {}
        self.registered_pools[host_pool_name] = host_pool

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        raise NotImplementedError

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        raise NotImplementedError

    @abc.abstractmethod
    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None):
        ...

    @abc.abstractmethod
    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None):
        ...

    @abc.abstractmethod
    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        ...

    @abc.abstractmethod
    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        ...

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        ...

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        for i in range(len(keys)):
            if not self.exists(keys[i]):
                return i
        return len(keys)

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        raise NotImplementedError()

    def batch_get_v2(self, transfers, extra_info=None):
        raise NotImplementedError()

    def batch_set_v2(self, transfers, extra_info=None):
        raise NotImplementedError()

    def clear(self) -> None:
        pass

    def get_stats(self):
        return None


MODULE = "sglang.srt.mem_cache.hicache_storage"


def install():
    """Registers this interface as sglang.srt.mem_cache.hicache_storage (idempotent)."""
    from kvtest import install_module
    return install_module(MODULE, {n: globals()[n] for n in (
        "HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "PoolName",
        "PoolHitPolicy", "PoolTransfer", "PoolTransferResult", "count_pool_hits")})


def config(extra, model="test/model", tp_rank=0, tp_size=1, mla=False, page_first=True,
           pp_rank=0, pp_size=1, layout=None):
    """As _generate_storage_config builds it; with "tp_lcm_size" in `extra` (popped, as SGLang
    does) should_split_heads is SGLang's rule: not MLA, layout page_head, lcm > tp_size."""
    extra = dict(extra)
    lcm = extra.pop("tp_lcm_size", None)
    if lcm:
        assert lcm % tp_size == 0, "tp_lcm_size must be divisible by tp_size."
    split = bool(lcm) and not mla and layout == "page_head" and lcm > tp_size
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                                pp_size=pp_size, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=page_first, model_name=model,
                                tp_lcm_size=lcm, should_split_heads=split,
                                extra_config=extra)


def create_backend(backend_name, storage_config, mem_pool_host):
    """The factory's dynamic path, then the controller's registration of the host pool."""
    assert backend_name == "dynamic" and storage_config.extra_config is not None
    cfg = storage_config.extra_config
    for field in ("backend_name", "module_path", "class_name"):
        if field not in cfg:
            raise ValueError("Missing required field '%s' in backend config for 'dynamic' "
                             "backend" % field)
    module = importlib.import_module(cfg["module_path"])
    cls = getattr(module, cfg["class_name"])
    if not issubclass(cls, HiCacheStorage):
        raise TypeError("Backend class %s must inherit from HiCacheStorage" % cls)
    backend = cls(storage_config, {})
    backend.register_mem_pool_host(mem_pool_host)
    return backend


class HostPool:
    """A host KV pool as SGLang's MHATokenToKVPoolHost / MLATokenToKVPoolHost lay it out:
    `size` token slots in pages of `page_size`, kv_buffer in `layout`. Pages are addressed by
    the token index of their first slot (host_indices[i * page_size])."""

    def __init__(self, pages, page_size=16, layers=4, heads=2, head_dim=64,
                 dtype=torch.bfloat16, layout="page_first", mla=False, kv_dim=96):
        self.page_size, self.layout, self.dtype, self.mla = page_size, layout, dtype, mla
        self.layer_num, self.head_num, self.head_dim = layers, heads, head_dim
        self.size = pages * page_size
        self.page_num = pages
        L, S, P, H, D = layers, self.size, page_size, heads, head_dim
        itemsize = torch.tensor([], dtype=dtype).element_size()
        if mla:
            self.kv_cache_dim = kv_dim
            shape = {"layer_first": (L, S, 1, kv_dim), "page_first": (S, L, 1, kv_dim),
                     "page_first_direct": (pages, L, P, 1, kv_dim)}[layout]
            self.size_per_token = kv_dim * itemsize * L
        else:
            shape = {"layer_first": (2, L, S, H, D), "page_first": (2, S, L, H, D),
                     "page_first_direct": (2, pages, L, P, H, D),
                     "page_head": (2, pages, H, P, L, D)}[layout]
            self.size_per_token = H * D * L * itemsize * 2
        self.kv_buffer = torch.zeros(shape, dtype=dtype)
        self._free = list(range(0, self.size, page_size))

    def alloc(self, need_size):
        assert need_size % self.page_size == 0
        n = need_size // self.page_size
        if n > len(self._free):
            return None
        starts, self._free = self._free[:n], self._free[n:]
        return torch.tensor([s + j for s in starts for j in range(self.page_size)],
                            dtype=torch.int64)

    def free(self, indices):
        self._free.extend(int(i) for i in indices[::self.page_size])

    def _page(self, index):
        P = self.page_size
        if self.layout in ("page_first_direct", "page_head"):
            i = index // P
            return self.kv_buffer[i:i + 1] if self.mla else self.kv_buffer[:, i:i + 1]
        if self.mla:
            return (self.kv_buffer[:, index:index + P] if self.layout == "layer_first"
                    else self.kv_buffer[index:index + P])
        return (self.kv_buffer[:, :, index:index + P] if self.layout == "layer_first"
                else self.kv_buffer[:, index:index + P])

    def get_data_page(self, index, flat=True):
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros(self._page(0).shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        page = self._page(index)
        page.copy_(data_page.reshape(page.shape))

    def fill(self, indices, seed):
        """Random bytes into the pages of `indices` (a test's KV)."""
        g = torch.Generator().manual_seed(seed)
        for s in indices[::self.page_size].tolist():
            page = self._page(s)
            page.copy_(torch.randn(page.shape, generator=g).to(self.dtype))

    def pages(self, indices):
        return [self.get_data_page(s).clone() for s in indices[::self.page_size].tolist()]


class AsymmetricHostPool:
    """SGLang's AsymmetricMHATokenToKVPoolHost (head_dim != v_head_dim, e.g. MiMo-V2): K and V
    in two buffers of their own, page_first (size, L, H, D) or page_first_direct
    (pages, L, P, H, D); any other layout is refused at construction, as SGLang does. The
    flat-page calls raise NotImplementedError (SGLang's own message: such a pool has no flat
    page); get_page_buffer_meta(indices) -> ([k_ptr, v_ptr] per page, [k_bytes, v_bytes] per
    page) as SGLang computes it (the route its Mooncake backend takes)."""

    def __init__(self, pages, page_size=16, layers=4, heads=2, head_dim=96, v_head_dim=64,
                 dtype=torch.bfloat16, layout="page_first"):
        if layout not in ("page_first", "page_first_direct"):
            raise ValueError("Unsupported layout for models with head_dim != v_head_dim: %s"
                             % layout)
        self.page_size, self.layout, self.dtype = page_size, layout, dtype
        self.layer_num, self.head_num = layers, heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        self.size, self.page_num = pages * page_size, pages
        if layout == "page_first":
            k = (self.size, layers, heads, head_dim)
            v = (self.size, layers, heads, v_head_dim)
        else:
            k = (pages, layers, page_size, heads, head_dim)
            v = (pages, layers, page_size, heads, v_head_dim)
        self.k_buffer = torch.zeros(k, dtype=dtype)
        self.v_buffer = torch.zeros(v, dtype=dtype)
        self.kv_buffer = (self.k_buffer, self.v_buffer)
        self._free = list(range(0, self.size, page_size))

    alloc = HostPool.alloc
    free = HostPool.free

    def _flat_page_unsupported(self):
        return NotImplementedError(
            "Models with head_dim != v_head_dim do not support the flat-page interface used "
            "by HiCache L3 storage backends {hf3fs, eic, nixl}. Use a backend that does not "
            "use this interface (e.g. mooncake, simm).")

    def get_data_page(self, index, flat=True):
        raise self._flat_page_unsupported()

    def get_dummy_flat_data_page(self):
        raise self._flat_page_unsupported()

    def set_from_flat_data_page(self, index, data_page):
        raise self._flat_page_unsupported()

    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        indices = indices.tolist()
        item = self.k_buffer.element_size()
        L, P, H = self.layer_num, self.page_size, self.head_num
        k_size, v_size = L * item * P * H * self.head_dim, L * item * P * H * self.v_head_dim
        if self.layout == "page_first_direct":
            k_stride, v_stride = L * P * H * self.head_dim, L * P * H * self.v_head_dim
        else:
            k_stride, v_stride = L * H * self.head_dim, L * H * self.v_head_dim
        ptrs, sizes = [], []
        for i in range(0, len(indices), P):
            b = indices[i] // P if self.layout == "page_first_direct" else indices[i]
            ptrs += [self.k_buffer.data_ptr() + b * k_stride * item,
                     self.v_buffer.data_ptr() + b * v_stride * item]
            sizes += [k_size, v_size]
        return ptrs, sizes

    def _halves(self, index):
        P = self.page_size
        if self.layout == "page_first_direct":
            return self.k_buffer[index // P], self.v_buffer[index // P]
        return self.k_buffer[index:index + P], self.v_buffer[index:index + P]

    def fill(self, indices, seed):
        g = torch.Generator().manual_seed(seed)
        for s in indices[::self.page_size].tolist():
            for half in self._halves(s):
                half.copy_(torch.randn(half.shape, generator=g).to(self.dtype))

    def pages(self, indices):
        """Each page's K and V bytes (a test compares them)."""
        return [torch.cat([h.reshape(-1).view(torch.uint8) for h in self._halves(s)])
                for s in indices[::self.page_size].tolist()]


class NoStoragePool(HostPool):
    """A host pool that offers no way to storage backends at all: every page call raises, as
    SGLang's int2-quantized host pool does (its flat page would miss the scales and zeros)."""

    def _l3_unsupported(self):
        return NotImplementedError("int2 HiCache does not support L3 storage backends yet: "
                                   "the flat data page carries only the packed codes, not "
                                   "the scales/zeros.")

    def get_data_page(self, index, flat=True):
        raise self._l3_unsupported()

    def get_dummy_flat_data_page(self):
        raise self._l3_unsupported()

    def set_from_flat_data_page(self, index, data_page):
        raise self._l3_unsupported()

    def get_page_buffer_meta(self, indices):
        raise self._l3_unsupported()


class Controller:
    """How HiCacheController drives a storage backend (cache_controller.py): page hashes in,
    host indices of len(keys) * page_size."""

    def __init__(self, backend, pool, v1=True):
        self.backend, self.pool, self.v1 = backend, pool, v1

    def backup(self, keys, indices):
        if self.v1:
            return all(self.backend.batch_set_v1(keys, indices, HiCacheStorageExtraInfo()))
        P = self.pool.page_size
        values = [self.pool.get_data_page(int(indices[i * P])) for i in range(len(keys))]
        return self.backend.batch_set(keys, values)

    def hits(self, keys):
        return self.backend.batch_exists(keys, HiCacheStorageExtraInfo())

    def load(self, keys, indices):
        """Pages loaded: the leading run of successes, as the controller counts them."""
        P = self.pool.page_size
        if self.v1:
            results = self.backend.batch_get_v1(keys, indices, HiCacheStorageExtraInfo())
            n = 0
            for ok in results:
                if not ok:
                    break
                n += 1
            return n
        dummies = [self.pool.get_dummy_flat_data_page() for _ in keys]
        data = self.backend.batch_get(keys, dummies)
        if data is None:
            return 0
        n = 0
        for i, page in enumerate(data):
            if page is None:
                break
            self.pool.set_from_flat_data_page(int(indices[i * P]), page)
            n += 1
        return n


class MambaHostPool:
    """SGLang's MambaPoolHost (pool_host/mamba.py): `slots` states, page_size 1, page_first;
    temporal_buffer (size, layers, 1, *temporal) and conv_buffer[i] (size, layers, 1, *conv);
    get_data_page concatenates a slot's temporal and conv bytes as uint8."""

    def __init__(self, slots, layers=2, temporal=(4, 8), conv=((3, 8), (2, 5)),
                 dtype=torch.float32):
        self.page_size, self.layout, self.size, self.dtype = 1, "page_first", slots, dtype
        self.temporal_buffer = torch.zeros((slots, layers, 1) + tuple(temporal), dtype=dtype)
        self.conv_buffer = [torch.zeros((slots, layers, 1) + tuple(c), dtype=dtype)
                            for c in conv]
        self._free = list(range(slots))

    def alloc(self, n):
        if n > len(self._free):
            return None
        got, self._free = self._free[:n], self._free[n:]
        return torch.tensor(got, dtype=torch.int64)

    def _parts(self, index):
        return [self.temporal_buffer[index]] + [c[index] for c in self.conv_buffer]

    def get_data_page(self, index, flat=True):
        return torch.cat([p.reshape(-1).view(torch.uint8) for p in self._parts(int(index))])

    def get_dummy_flat_data_page(self):
        return torch.zeros_like(self.get_data_page(0))

    def set_from_flat_data_page(self, index, data_page):
        data, o = data_page.reshape(-1).view(torch.uint8), 0
        for p in self._parts(int(index)):
            n = p.numel() * p.element_size()
            p.reshape(-1).view(torch.uint8).copy_(data[o:o + n])
            o += n

    def fill(self, indices, seed):
        g = torch.Generator().manual_seed(seed)
        for i in indices.tolist():
            for p in self._parts(i):
                p.copy_(torch.randn(p.shape, generator=g).to(self.dtype))

    def pages(self, indices):
        return [self.get_data_page(i).clone() for i in indices.tolist()]


class HybridController:
    """HybridCacheController's storage calls (hybrid_cache_controller.py and the mamba / swa
    components). `pools`: {PoolName: (host pool, trailing window in pages or None)}; None is a
    KV-derived pool (ALL_PAGES, indexed by the KV pool's host indices, e.g. the DSA indexer or
    draft KV), a window a TRAILING_PAGES pool of its own indices (Mamba: 1, SWA: the sliding
    window's pages)."""

    def __init__(self, backend, kv_pool, pools):
        self.backend, self.kv_pool, self.pools = backend, kv_pool, pools
        backend.register_mem_pool_host(kv_pool)                 # attach_storage_backend
        backend.register_mem_host_pool_v2(kv_pool, PoolName.KV)  # every entry, KV included
        for name, (pool, _) in pools.items():
            backend.register_mem_host_pool_v2(pool, name)

    def _transfers(self, keys, kv_indices, own):
        out = []
        for name, (pool, window) in self.pools.items():
            if window is None:
                out.append(PoolTransfer(name, host_indices=kv_indices, keys=list(keys)))
            else:
                out.append(PoolTransfer(name, host_indices=own.get(name), keys=keys,
                                        hit_policy=PoolHitPolicy.TRAILING_PAGES))
        return out

    def backup(self, keys, kv_indices, own):
        """_page_backup: the side pools (trailing ones: the last `window` keys and their own
        indices in `own`), then the KV pages. -> (side pool hits, KV all stored)."""
        ts = []
        for t in self._transfers(keys, kv_indices, own):
            window = self.pools[t.name][1]
            if window is not None:
                t.keys = list(keys[-window:])
            ts.append(t)
        side = count_pool_hits(self.backend.batch_set_v2(ts))
        kv = all(self.backend.batch_set_v1(keys, kv_indices, HiCacheStorageExtraInfo()))
        return side, kv

    def hits(self, keys):
        """The prefetch's existence check: trailing pools with placeholder keys (their count
        is what matters), KV-derived ones bare."""
        ts = []
        for name, (pool, window) in self.pools.items():
            if window is None:
                ts.append(PoolTransfer(name))
            else:
                ts.append(PoolTransfer(name, keys=["__placeholder__"] * window,
                                       hit_policy=PoolHitPolicy.TRAILING_PAGES))
        return self.backend.batch_exists_v2(keys, ts, HiCacheStorageExtraInfo())

    def load(self, keys, hit, kv_dst, own_dst):
        """_page_transfer: KV pages and KV-derived pools per batch (min of their leading
        hits), then — all KV pages loaded — each trailing pool's window ending at the hit
        (_sync_trailing_keys), host indices cut to len(keys) * page_size. -> (KV pages
        loaded, {pool: hits})."""
        P = self.kv_pool.page_size
        keys, kv_dst = list(keys[:hit]), kv_dst[:hit * P]
        rs = self.backend.batch_get_v1(keys, kv_dst, HiCacheStorageExtraInfo())
        kv = rs.index(False) if False in rs else len(rs)
        derived = [PoolTransfer(n, host_indices=kv_dst, keys=keys)
                   for n, (p, w) in self.pools.items() if w is None]
        pool_hits = {}
        if derived:
            side = count_pool_hits(self.backend.batch_get_v2(derived))
            kv = min([kv] + list(side.values()))
            pool_hits.update(side)
        if kv == len(keys):
            ts = []
            for name, (pool, window) in self.pools.items():
                if window is None:
                    continue
                tk = keys[max(0, hit - window):hit]
                ts.append(PoolTransfer(name, host_indices=own_dst[name][:len(tk) * pool.page_size],
                                       keys=tk, hit_policy=PoolHitPolicy.TRAILING_PAGES))
            if ts:
                pool_hits.update(count_pool_hits(self.backend.batch_get_v2(ts)))
        return kv, pool_hits
