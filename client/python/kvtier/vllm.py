"""kvtier.vllm: a vLLM encoder-cache (EC) connector on kvtier (docs/integrations.md, "vLLM
encoder cache").

vLLM loads it by module path (ECConnectorFactory: a name it has not registered is the class of
that name in ec_connector_module_path), once in the scheduler (role SCHEDULER) and once in
each worker (role WORKER):

    vllm serve Qwen/Qwen2.5-VL-7B-Instruct --ec-transfer-config \\
      '{"ec_connector": "KvtierECConnector", "ec_connector_module_path": "kvtier.vllm",
        "ec_role": "ec_both",
        "ec_connector_extra_config": {"endpoint": "ipc:///run/kvtier/kvtier.sock"}}'

Built against vLLM's ECConnectorBase as it is after v0.16 (is_producer and is_consumer,
ensure_cache_available, request_finished; ec_role ec_producer, ec_consumer or ec_both), and
still answering the first releases' has_caches(request).

Objects: one kvtier object per encoder output (a multimodal item's embedding), keyed by
BLAKE2b-128 of its identifier (vLLM's mm_hash, with the LoRA prefix when there is one) in the
namespace "<namespace>/<dtype>[/h<hidden size>]" ("vllm-ec/<model>" by default), so two models
or dtypes never mix. An object is a 128-byte header (magic, the key, dtype, shape) and the
tensor's bytes; a reader checks the header before it uses a byte.

Scheduler: has_cache_item pins the item in L1 (ACQUIRE) for the workers to read, and answers
True only for a pinned item, so an item cannot be evicted or removed between that answer and
the load (a removal leaves the pinned bytes in place until the pin goes); an item not in L1 is
False (the encoder runs) — unless ensure_cache_available, which vLLM asks for every waiting
request first, found it in L2: it starts the load into L1 and defers the request until it is
there (at most load_timeout_ms). The pins of a request go when it finishes (request_finished),
or after pin_timeout_ms. The metadata the workers get names where each pinned item is in the
arena: every TP worker copies it from there into its own encoder cache, one copy, no request
to the daemon.

Worker: save_caches (producer, ec_producer or ec_both) reserves the object, copies the tensor
into the arena (from the GPU: one copy) and posts the COMMIT, whose answers get_finished
collects (finished_sending); an item that is there already is not written again.
start_load_caches (consumer) copies each item of the metadata into encoder_cache on the
worker's device.

Nothing raises into vLLM: a daemon that is away or slow makes has_cache_item False, lets
ensure_cache_available go on and saves nothing, with a warning (one per kind); the scheduler's
client is reconnected in the background of later calls (every reconnect_interval_ms).
"""

import logging
import os
import threading
import time

import torch

from . import tensorobj
from ._config import checked as _checked
from .client import Client
from .errors import KvtierError
from .events import ec_namespace
from .hashing import label_of, name_key
from .tensorobj import HEADER_BYTES

try:                                           # vLLM's base class when vLLM is installed
    from vllm.distributed.ec_transfer.ec_connector.base import (ECConnectorBase as _Base,
                                                                ECConnectorMetadata as _Meta,
                                                                ECConnectorRole)
except ImportError:
    class _Base:                               # pylint: disable=too-few-public-methods
        """Stand-in for vLLM's ECConnectorBase when vLLM is not installed."""

        def __init__(self, vllm_config, role):
            tc = vllm_config.ec_transfer_config
            self._vllm_config, self._role, self._connector_metadata = vllm_config, role, None
            self._is_producer = tc.ec_role in ("ec_producer", "ec_both")
            self._is_consumer = tc.ec_role in ("ec_consumer", "ec_both")

        is_producer = property(lambda self: self._is_producer)
        is_consumer = property(lambda self: self._is_consumer)
        role = property(lambda self: self._role)

        def bind_connector_metadata(self, connector_metadata):
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def _get_connector_metadata(self):
            return self._connector_metadata

    class _Meta:                               # pylint: disable=too-few-public-methods
        """Stand-in for vLLM's ECConnectorMetadata."""

    ECConnectorRole = None

__all__ = ["KvtierECConnector", "KvtierECMetadata", "ec_key", "DEFAULTS", "HEADER_BYTES"]

log = logging.getLogger("kvtier.vllm")

# The keys read from ec_connector_extra_config (docs/integrations.md lists them).
DEFAULTS = {
    "endpoint": None,               # None: $KVTIER_ENDPOINT, else ipc:///run/kvtier/kvtier.sock
    "namespace": None,              # None: "vllm-ec/<model>"
    "salt": None,                   # isolates tenants sharing one daemon
    "timeout_ms": 2000,             # the longest one call waits for the daemon
    "load_timeout_ms": 5000,        # how long a request waits for its items to come from L2
    "pin_timeout_ms": 600000,       # a pinned item goes after this long even if its request
                                    # never finishes
    "reconnect_interval_ms": 1000,  # how often a daemon that left is tried again
    "heartbeat_ms": None,           # kvtier.Client's (None: lease_ms / 3)
    "device": None,                 # where loaded items go (None: vLLM's current device)
}
_INTS = {"timeout_ms": 1, "load_timeout_ms": 0, "pin_timeout_ms": 1000,
         "reconnect_interval_ms": 10}


# kvtier's 16-byte key of one encoder output: BLAKE2b-128 of its identifier's UTF-8.
ec_key = name_key


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _settings(vllm_config):
    tc = getattr(vllm_config, "ec_transfer_config", None)
    cfg = _checked(getattr(tc, "ec_connector_extra_config", None) or {}, DEFAULTS,
                    _INTS, ("endpoint", "namespace", "salt", "device"), (),
                    "kvtier.vllm", "ec_connector_extra_config")
    mc = getattr(vllm_config, "model_config", None)
    if cfg["namespace"] is None:
        model = getattr(mc, "served_model_name", None) or getattr(mc, "model", None)
        if isinstance(model, (list, tuple)):
            model = model[0] if model else None
        if not model:
            log.warning("kvtier.vllm: no model name and no namespace in the extra config: "
                        "items go to vllm-ec/unnamed-model, shared with any other such engine")
        cfg["namespace"] = "vllm-ec/" + str(model or "unnamed-model").strip("/")
    try:
        hidden = int(mc.get_hidden_size())
    except Exception:                          # noqa: BLE001 - no hidden size: dtype only
        hidden = None
    cfg["ns"] = ec_namespace(cfg["namespace"],
                             _dtype_name(getattr(mc, "dtype", None) or "auto"), hidden)
    return cfg


class KvtierECMetadata(_Meta):
    """What the scheduler's connector tells the workers for one step: the arena it pinned
    the items in (its path) and, per item, (identifier, offset, length, embeddings)."""

    def __init__(self, arena=None, loads=()):
        self.arena = arena
        self.loads = list(loads)

    def __repr__(self):
        return "KvtierECMetadata(arena=%r, loads=%d)" % (self.arena, len(self.loads))


class _Pin:
    __slots__ = ("lease", "offset", "length", "at", "request")

    def __init__(self, lease, offset, length):
        self.lease, self.offset, self.length = lease, offset, length
        self.at, self.request = time.monotonic(), None


class KvtierECConnector(_Base):
    """vLLM's ECConnectorBase on kvtier (module docstring)."""

    def __init__(self, vllm_config, role):
        super().__init__(vllm_config=vllm_config, role=role)
        self.cfg = _settings(vllm_config)
        self.ns = self.cfg["ns"]
        self._salt = self.cfg["salt"]
        self._lock = threading.Lock()
        self._client = None
        self._down_until = 0.0
        self._warned = set()
        self._stats = dict.fromkeys(("has_calls", "has_hits", "loaded", "load_misses",
                                     "saved", "save_skipped", "deferred", "errors",
                                     "outages"), 0)
        # scheduler side
        self._offered = {}         # identifier -> _Pin, answered True this step
        self._loads = []           # (identifier, offset, length, embeds) for this step
        self._held = {}            # request id -> [_Pin]
        self._prefetch = {}        # identifier -> (job, deadline)
        # worker side
        self._saving = {}          # mm_hash -> the COMMIT's end()
        self._loaded = set()
        self._device = None

    # -- the daemon --------------------------------------------------------------------------

    def _warn_once(self, kind, msg):
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("kvtier.vllm: %s", msg)

    def _conn(self):
        """The connection, opened (HELLO) on first use; None while the daemon is away (tried
        again every reconnect_interval_ms)."""
        c = self._client
        if c is not None:
            return c
        now = time.monotonic()
        if now < self._down_until:
            return None
        try:
            c = Client(self.cfg["endpoint"], client="vllm-ec-%s" % self._side(),
                       timeout_ms=self.cfg["timeout_ms"], heartbeat_ms=self.cfg["heartbeat_ms"])
        except Exception as e:                 # noqa: BLE001 - Timeout, zmq errors
            self._down(e)
            return None
        if self._down_until:
            log.warning("kvtier.vllm: kvtier is back at %s", self.cfg["endpoint"])
            self._down_until = 0.0
        self._client = c
        return c

    def _side(self):
        return "scheduler" if getattr(self.role, "name", "") == "SCHEDULER" else \
            "worker-%d" % os.getpid()

    def _down(self, e):
        """A call failed for the connection's sake: it goes, and the daemon is not asked again
        for reconnect_interval_ms; the pins it held go with it (its instance)."""
        first = not self._down_until
        self._down_until = time.monotonic() + self.cfg["reconnect_interval_ms"] / 1000.0
        c, self._client = self._client, None
        self._offered.clear()
        self._held.clear()
        self._prefetch.clear()
        self._saving.clear()
        if c is not None:
            c.timeout_ms = 100
            try:
                c.close()
            except Exception:                  # noqa: BLE001
                pass
        if first:
            self._stats["outages"] += 1
            log.warning("kvtier.vllm: kvtier at %s does not answer (%s): misses until it does",
                        self.cfg["endpoint"], e)

    def _call(self, what, fn, miss):
        """fn(client) on the connection; `miss` when there is none or the call fails."""
        c = self._conn()
        if c is None:
            return miss
        try:
            return fn(c)
        except KvtierError as e:
            if e.code in ("timeout", "protocol", "unavailable"):
                self._down(e)
            else:
                self._stats["errors"] += 1
                self._warn_once(what + e.code, "%s: kvtier answered %s: %s" % (what, e.code, e))
            return miss
        except Exception as e:                 # noqa: BLE001 - never into vLLM
            self._stats["errors"] += 1
            self._warn_once(what + type(e).__name__, "%s: %s: %s" % (what, type(e).__name__, e))
            return miss

    def stats(self):
        """Counters: has_calls/has_hits (scheduler), loaded/load_misses, saved/save_skipped,
        deferred (requests waiting for L2), errors, outages."""
        return dict(self._stats, down=bool(self._down_until), pinned=sum(
            len(v) for v in self._held.values()) + len(self._offered))

    # -- scheduler side ----------------------------------------------------------------------

    def has_cache_item(self, identifier):
        """True when the item is in L1 and now pinned there for the workers' load."""
        try:
            self._stats["has_calls"] += 1
            self._expire_pins()
            if identifier in self._offered:
                return True
            key = ec_key(identifier)
            c = self._conn()
            if c is None:
                return False
            local = c.resident_prefix(self.ns, [key], salt=self._salt)
            if local == 0:
                return False                   # not in L1 (L2: ensure_cache_available)
            got = self._call("has_cache_item", lambda c: c.acquire_offsets(
                self.ns, [key], salt=self._salt), None)
            if got is None or not got.slots or got.slots[0] is None:
                return False
            off, length = got.slots[0]
            self._offered[identifier] = _Pin(got.lease, off, length)
            self._stats["has_hits"] += 1
            return True
        except Exception as e:                 # noqa: BLE001
            self._warn_once("has", "has_cache_item: %s: %s" % (type(e).__name__, e))
            return False

    def has_caches(self, request):
        """vLLM's first releases (v0.11-v0.12): one bool per multimodal item of the request."""
        return [self.has_cache_item(f.identifier) for f in getattr(request, "mm_features", ())]

    def update_state_after_alloc(self, request, index):
        """The item will be loaded, not computed: its pin goes into this step's metadata and
        stays with the request."""
        try:
            f = request.mm_features[index]
            pin = self._offered.pop(f.identifier, None)
            if pin is None:                    # computed locally (or not ours to load)
                return
            pin.request = request.request_id
            self._held.setdefault(request.request_id, []).append(pin)
            embeds = _num_embeds(request, index)
            self._loads.append((f.identifier, pin.offset, pin.length, embeds))
        except Exception as e:                 # noqa: BLE001
            self._warn_once("alloc", "update_state_after_alloc: %s: %s" % (type(e).__name__, e))

    def build_connector_meta(self, scheduler_output):
        """This step's loads, for the workers; pins answered but not allocated go."""
        meta = KvtierECMetadata(self._arena_path(), self._loads)
        self._loads = []
        unclaimed, self._offered = list(self._offered.values()), {}
        self._release(unclaimed)
        return meta

    def ensure_cache_available(self, request, num_computed_tokens):
        """False (defer the request) while items of it that are only in L2 load into L1, for
        at most load_timeout_ms; True otherwise."""
        try:
            if not self.is_consumer:
                return True
            keys, idents = [], []
            for f in getattr(request, "mm_features", None) or ():
                pos = f.mm_position
                if pos.offset + pos.length > num_computed_tokens:
                    keys.append(ec_key(f.identifier))
                    idents.append(f.identifier)
            if not keys:
                return True
            c = self._conn()
            if c is None:
                return True
            waiting = False
            now = time.monotonic()
            todo = []                          # (key, identifier): not in L1, not loading
            done = {}                          # job -> finished (asked once per call)
            for key, ident in zip(keys, idents):
                if c.resident_prefix(self.ns, [key], salt=self._salt) == 1:
                    self._prefetch.pop(ident, None)
                    continue
                job = self._prefetch.get(ident)
                if job is not None:
                    if now >= job[1]:
                        continue               # waited long enough: computed if still away
                    if job[0] not in done:
                        st = self._call("ensure", lambda c: c.prefetch_status(job[0]), None)
                        done[job[0]] = st is None or st.done
                    if not done[job[0]]:
                        waiting = True
                        continue
                todo.append((key, ident))
            # A LOOKUP answers for the leading run of items it finds (in L1, then in L2, whose
            # load it starts as one job) and stops at the first it does not: one LOOKUP per
            # item found nowhere, plus one.
            while todo:
                run = [k for k, _ in todo]
                r = self._call("ensure", lambda c: c.lookup(self.ns, run, salt=self._salt,
                                                            prefetch=True), None)
                if r is None:
                    break
                for j, (_, ident) in enumerate(todo[:r.hits]):
                    old = self._prefetch.pop(ident, None)
                    if j >= r.l1 and r.job is not None:       # loading from L2
                        deadline = old[1] if old else now + self.cfg["load_timeout_ms"] / 1e3
                        self._prefetch[ident] = (r.job, deadline)
                        waiting = waiting or now < deadline
                for _, ident in todo[r.hits:r.hits + 1]:
                    self._prefetch.pop(ident, None)           # nowhere: the encoder runs
                todo = todo[r.hits + 1:]
            if waiting:
                self._stats["deferred"] += 1
            return not waiting
        except Exception as e:                 # noqa: BLE001
            self._warn_once("ensure", "ensure_cache_available: %s: %s" % (type(e).__name__, e))
            return True

    def update_connector_output(self, connector_output):
        return

    def request_finished(self, request):
        """The request's pins go (its items were loaded by then)."""
        try:
            self._release(self._held.pop(getattr(request, "request_id", None), []))
        except Exception as e:                 # noqa: BLE001
            self._warn_once("finished", "request_finished: %s: %s" % (type(e).__name__, e))
        return False, None

    def _release(self, pins):
        c = self._client
        for p in pins:
            if c is None:
                return
            try:
                c.release(p.lease)
            except KvtierError as e:
                if e.code in ("timeout", "protocol", "unavailable"):
                    self._down(e)
                    return
            except Exception:                  # noqa: BLE001
                pass

    def _expire_pins(self):
        limit = time.monotonic() - self.cfg["pin_timeout_ms"] / 1000.0
        for rid in [r for r, pins in self._held.items() if pins and pins[0].at < limit]:
            old = [p for p in self._held[rid] if p.at < limit]
            self._held[rid] = [p for p in self._held[rid] if p.at >= limit]
            if not self._held[rid]:
                del self._held[rid]
            self._release(old)

    def _arena_path(self):
        c = self._client
        shm = (c.info or {}).get("shm") if c is not None else None
        return shm.get("path") if isinstance(shm, dict) else None

    # -- worker side -------------------------------------------------------------------------

    def register_caches(self, ec_caches):
        return

    def start_load_caches(self, encoder_cache, **kwargs):
        """Each item of this step's metadata into encoder_cache, from where the scheduler
        pinned it in the arena (one copy onto the device)."""
        try:
            meta = self._connector_metadata
            if not isinstance(meta, KvtierECMetadata) or not meta.loads:
                return
            c = self._conn()
            arena = c.arena if c is not None else None
            if arena is None or self._arena_path() != meta.arena:
                self._warn_once("arena", "the scheduler's items are in arena %s, which this "
                                "worker has not mapped (%s): they are not loaded"
                                % (meta.arena, self._arena_path()))
                self._stats["load_misses"] += len(meta.loads)
                return
            dev = self._target_device()
            for ident, off, length, _embeds in meta.loads:
                if ident in encoder_cache:
                    continue
                t = self._read(arena, off, length, ident)
                if t is None:
                    self._stats["load_misses"] += 1
                    continue
                encoder_cache[ident] = t.to(dev, copy=True)
                self._loaded.add(ident)
                self._stats["loaded"] += 1
        except Exception as e:                 # noqa: BLE001
            self._warn_once("load", "start_load_caches: %s: %s" % (type(e).__name__, e))

    def _read(self, arena, off, length, ident):
        """A tensor view of the object at arena[off:off+length] when its header says it is
        `ident`'s, else None (never bytes of another item)."""
        t = tensorobj.view(arena, off, length, ec_key(ident))
        if t is None:
            self._warn_once("header", "item %s: the arena does not hold it where the "
                            "scheduler said: not loaded" % ident)
        return t

    def _target_device(self):
        if self._device is None:
            dev = self.cfg["device"]
            if dev is None:
                try:
                    from vllm.platforms import current_platform
                    dev = "%s:%d" % (current_platform.device_type,
                                     current_platform.current_device())
                except Exception:              # noqa: BLE001
                    dev = "cuda:%d" % torch.cuda.current_device() \
                        if torch.cuda.is_available() else "cpu"
            self._device = torch.device(dev)
        return self._device

    def save_caches(self, encoder_cache, mm_hash, **kwargs):
        """Producer: the item's tensor into kvtier (skipped when it is there already); the
        COMMIT is answered in get_finished."""
        try:
            if not self.is_producer or mm_hash in self._saving:
                return
            t = encoder_cache.get(mm_hash)
            if t is None:
                return
            try:
                size = tensorobj.size_of(t)
            except ValueError as e:
                self._warn_once("shape", "item %s cannot be stored: %s" % (mm_hash, e))
                return
            key = ec_key(mm_hash)
            got = self._call("save_caches", lambda c: c.reserve_offsets(
                self.ns, [key], size, salt=self._salt, labels=[label_of(mm_hash)]), None)
            if got is None:
                return
            if not got.slots or got.slots[0] is None:
                self._stats["save_skipped"] += 1      # stored already (by us or another rank)
                return
            failed = ()
            try:
                tensorobj.write(self._client.arena, got.slots[0][0], key, t)
            except Exception as e:             # noqa: BLE001 - the object is discarded
                self._warn_once("copy", "item %s could not be copied: %s" % (mm_hash, e))
                failed = (0,)
            end = self._call("save_caches", lambda c: c.commit_begin(got.lease, failed), None)
            if end is not None and not failed:
                self._saving[mm_hash] = end
        except Exception as e:                 # noqa: BLE001
            self._warn_once("save", "save_caches: %s: %s" % (type(e).__name__, e))

    def get_finished(self, finished_req_ids):
        """(items saved since the last call, items loaded since the last call), None for an
        empty set."""
        saved = set()
        pending, self._saving = self._saving, {}
        for mm_hash, end in pending.items():
            n = self._call("get_finished", lambda c: end(), 0)
            if n:
                saved.add(mm_hash)
                self._stats["saved"] += 1
        loaded, self._loaded = self._loaded, set()
        return saved or None, loaded or None

    def build_connector_worker_meta(self):
        return None

    def shutdown(self):
        c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception:                  # noqa: BLE001
                pass


def _num_embeds(request, index):
    try:
        return int(request.get_num_encoder_embeds(index))
    except Exception:                          # noqa: BLE001 - older Request
        return int(request.mm_features[index].mm_position.length)
