"""kvtier.media: a media cache for front ends — tensors or bytes by hash, written once by one
process and read by many (vLLM's shared-memory IPC cache: a front end that preprocesses an
image once and hands it to every TP worker), on kvtier's arena (docs/integrations.md, "Media
cache").

    # front end (the writer)
    cache = kvtier.media.MediaCache("ipc:///run/kvtier/kvtier.sock", namespace="media/qwen-vl")
    ref = cache.put_pinned(mm_hash, pixel_values)     # stored, and pinned for the readers
    send ref (small, picklable) to each worker ...
    cache.unpin(ref)                                  # once they have read it

    # each worker (a reader)
    cache = kvtier.media.MediaCache("ipc:///run/kvtier/kvtier.sock", namespace="media/qwen-vl")
    t = cache.read(ref)                 # a tensor viewing the arena: no request, no copy
    x = t.to("cuda")                    # the one copy
    # or without a ref, by hash:
    with cache.get(mm_hash) as t: ...   # ACQUIRE: pinned while the block runs

Objects are kvtier.tensorobj's (a 128-byte header with the key, dtype and shape, then the
bytes), keyed by BLAKE2b-128 of the hash string. A reader never gets bytes of another item:
every view is checked against its header first. Pins are leases of the client's instance:
a process that dies holding one (a reader killed inside `with cache.get(...)`, a front end
killed before unpin) pins nothing once its instance is dropped (lease_ms after its last
sign of life). A Client is not thread-safe: one MediaCache per thread.
"""

import contextlib

from . import tensorobj
from ._config import checked as _checked
from .client import Client
from .hashing import label_of, name_key

__all__ = ["MediaCache", "MediaRef", "media_key"]


# The 16-byte key of a hash string (or bytes): BLAKE2b-128 of its UTF-8.
media_key = name_key


class MediaRef(tuple):
    """Where a pinned item is: (hash, arena path, offset, length, lease). Small and picklable:
    what a front end sends its workers instead of the bytes."""

    __slots__ = ()

    def __new__(cls, mm_hash, arena, offset, length, lease):
        return tuple.__new__(cls, (mm_hash, arena, offset, length, lease))

    mm_hash = property(lambda self: self[0])
    arena = property(lambda self: self[1])
    offset = property(lambda self: self[2])
    length = property(lambda self: self[3])
    lease = property(lambda self: self[4])

    def __reduce__(self):
        return (MediaRef, tuple(self))


class MediaCache:
    """Tensors or bytes by hash in kvtier (module docstring). `client`: an existing
    kvtier.Client to use (else one is opened on `endpoint` with `client_kw`)."""

    def __init__(self, endpoint=None, namespace="media", salt=None, client=None,
                 **client_kw):
        if not isinstance(namespace, str) or not namespace:
            raise ValueError("namespace must be a non-empty string, not %r" % (namespace,))
        self.ns = namespace
        self.salt = salt
        if client is None:
            endpoint = _checked({"endpoint": endpoint}, {"endpoint": None}, {},
                                ("endpoint",), where="kvtier.media")["endpoint"]
            client_kw.setdefault("client", "media")
            client = Client(endpoint, **client_kw)
        self.client = client

    def close(self):
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _arena_path(self):
        shm = (self.client.info or {}).get("shm")
        return shm.get("path") if isinstance(shm, dict) else None

    def put(self, mm_hash, value):
        """Stores value (a torch tensor of 1 to 4 dimensions, or bytes-like) under mm_hash.
        True when stored now, False when it was there already (nothing written)."""
        key = media_key(mm_hash)
        got = self.client.reserve_offsets(self.ns, [key], tensorobj.size_of(value),
                                          salt=self.salt, labels=[label_of(mm_hash)])
        if not got.slots or got.slots[0] is None:
            return False
        try:
            tensorobj.write(self.client.arena, got.slots[0][0], key, value)
        except BaseException:
            self.client.commit(got.lease, failed=[0])     # discarded
            raise
        return self.client.commit(got.lease) == 1

    def put_pinned(self, mm_hash, value):
        """put(), then pin the item for readers: -> MediaRef (None when it could not be pinned:
        evicted at once by a full L1). unpin(ref) when the readers are done."""
        self.put(mm_hash, value)
        return self.pin(mm_hash)

    def pin(self, mm_hash):
        """Pins a stored item (ACQUIRE) -> MediaRef, or None when it is not in L1."""
        got = self.client.acquire_offsets(self.ns, [media_key(mm_hash)], salt=self.salt)
        if not got.slots or got.slots[0] is None:
            return None
        off, length = got.slots[0]
        return MediaRef(mm_hash, self._arena_path(), off, length, got.lease)

    def unpin(self, ref):
        """Ends a pin of put_pinned() or pin() (of this cache's client)."""
        if ref is not None:
            self.client.release(ref.lease)

    def read(self, ref):
        """The pinned item `ref` names, as a tensor viewing this process's mapping of the
        arena (no request, no copy; a uint8 tensor for bytes), or None when this process did
        not map that arena or the range does not hold that item. Valid while the pin is:
        copy it before the writer unpins."""
        arena = self.client.arena
        if ref is None or arena is None or ref.arena != self._arena_path():
            return None
        return tensorobj.view(arena, ref.offset, ref.length, media_key(ref.mm_hash))

    @contextlib.contextmanager
    def get(self, mm_hash):
        """with cache.get(h) as t: — the item as a tensor viewing the arena (None when it is
        not in L1), pinned by this process until the block ends."""
        ref = self.pin(mm_hash)
        try:
            yield self.read(ref) if ref is not None else None
        finally:
            if ref is not None:
                self.client.release(ref.lease)

    def get_copy(self, mm_hash):
        """The item as a tensor of its own (one copy), or None."""
        with self.get(mm_hash) as t:
            return None if t is None else t.clone()

    def contains(self, mm_hash):
        """Whether the item is stored (L1, by the residency map without a request when it is
        there; else a LOOKUP, which counts L2 too and starts loading it into L1)."""
        key = media_key(mm_hash)
        if self.client.resident_prefix(self.ns, [key], salt=self.salt) == 1:
            return True
        return self.client.lookup(self.ns, [key], salt=self.salt, prefetch=True).hits == 1

    def remove(self, mm_hash):
        """Removes the item (pinned readers keep their bytes until they let go)."""
        return self.client.remove(self.ns, [media_key(mm_hash)], salt=self.salt) == 1
