"""The fast path's ring pair (docs/protocol.md "Fast path"), through libkvtier's kvtier_ring_*.

The rings are C (common/kvt_ring): they need real atomics, fences and futexes, so this module
never touches a ring's bytes itself; it loads libkvtier.so with ctypes and calls its thin
wrappers. Where the library is not found (or predates the wrappers) the fast path is simply
unavailable: library() answers None and `why` says why; nothing raises.

The library: KVTIER_LIBRARY (a path) when set; else the package's own copy of the ring calls
(kvtier/_kvtring*.so, which `pip install` builds from libkvtier's ring sources: setup.py), so
that installing the package alone gives the fast path; else "libkvtier.so.0" from the dynamic
loader's path, else whatever ctypes.util.find_library("kvtier") finds. `path` says which one
was loaded.

A Pair is one client's two rings in the pair's own memory, a memfd the daemon hands to this
process alone (fetch(): the ticket from HELLO, over the daemon's handoff socket): the request
ring (this client is its producer) and the reply ring (its consumer). The Pair owns that
mapping and the handoff connection (whose end says the daemon let the pair go, or died). It
holds ctypes views of both regions, exports of the mmap, released by drop() before the mapping
is closed. Only the Client's thread uses a Pair (a ring handle is single-threaded).
"""

import ctypes
import ctypes.util
import glob
import mmap
import os
import select
import socket
import struct
import threading
import time

__all__ = ["library", "why", "Pair", "has_resident", "RingError", "EBADREQ", "ETOOBIG", "EBUSY", "EUNAVAIL",
           "ETIMEDOUT", "EINVAL", "HDR_SIZE"]

# KVTIER_E* (client/kvtier.h)
EBADREQ = -1
ETOOBIG = -4
EBUSY = -9
EUNAVAIL = -11
ETIMEDOUT = -14
EINVAL = -15

HDR_SIZE = 384                  # KVT_RING_HDR_SIZE: a region is the header + capacity bytes
PEER_CHECK_S = 0.010            # kvtier.h KVTIER_RESIDENT_PEER_CHECK_MS
_MAX_FRAMES = 16                # kvtier_ring_push takes at most this many frames
_NAMES = {EBADREQ: "malformed ring", ETOOBIG: "too large", EBUSY: "busy",
          EUNAVAIL: "closed by the daemon", ETIMEDOUT: "timed out", EINVAL: "invalid argument"}

_lock = threading.Lock()
_lib = None
_tried = False
why = "not loaded yet"          # why the fast path is unavailable ("" once loaded)
path = ""                       # the library loaded (KVTIER_LIBRARY, the package's own, ...)


class RingError(Exception):
    """A kvtier_ring_* call failed: .rc is the KVTIER_E* code."""

    def __init__(self, rc, what):
        super().__init__("%s: %s (%d)" % (what, _NAMES.get(rc, "error"), rc))
        self.rc = rc


class RingStats(ctypes.Structure):
    """kvtier_ring_stats_t (kvtier.h)."""
    _fields_ = [("records", ctypes.c_uint64), ("bytes", ctypes.c_uint64),
                ("spin_hits", ctypes.c_uint64), ("cooled", ctypes.c_uint64),
                ("sleeps", ctypes.c_uint64), ("wakes", ctypes.c_uint64),
                ("spin", ctypes.c_uint32)]


def _bind(lib):
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.kvtier_ring_attach.argtypes = [vp, sz, ctypes.c_uint32, ctypes.c_int, ctypes.c_char_p,
                                       sz]
    lib.kvtier_ring_attach.restype = vp
    lib.kvtier_ring_detach.argtypes = [vp]
    lib.kvtier_ring_detach.restype = None
    lib.kvtier_ring_max_payload.argtypes = [vp]
    lib.kvtier_ring_max_payload.restype = sz
    lib.kvtier_ring_push.argtypes = [vp, ctypes.POINTER(ctypes.c_char_p),
                                     ctypes.POINTER(sz), ctypes.c_uint32]
    lib.kvtier_ring_push.restype = ctypes.c_int
    lib.kvtier_ring_pop.argtypes = [vp, vp, sz, ctypes.POINTER(sz)]
    lib.kvtier_ring_pop.restype = ctypes.c_int
    lib.kvtier_ring_wait.argtypes = [vp, sz, ctypes.c_int64]
    lib.kvtier_ring_wait.restype = ctypes.c_int
    lib.kvtier_ring_close.argtypes = [vp]
    lib.kvtier_ring_close.restype = None
    if hasattr(lib, "kvtier_ring_set_spin"):     # an older libkvtier lacks both
        lib.kvtier_ring_set_spin.argtypes = [vp, ctypes.c_uint32]
        lib.kvtier_ring_set_spin.restype = None
        lib.kvtier_ring_stats.argtypes = [vp, ctypes.POINTER(RingStats)]
        lib.kvtier_ring_stats.restype = None
    if hasattr(lib, "kvtier_resident_prefix"):   # older builds, or built without xxhash.h
        lib.kvtier_resident_prefix.argtypes = [vp, sz, ctypes.c_char_p, sz, ctypes.c_char_p, sz,
                                               ctypes.c_char_p, ctypes.c_uint32]
        lib.kvtier_resident_prefix.restype = ctypes.c_int64
    return lib


def has_resident(lib):
    """Whether this library reads the residency map (kvtier_resident_prefix)."""
    return lib is not None and hasattr(lib, "kvtier_resident_prefix")


_libc = None


def _libc_map():
    """libc's mmap and munmap: the residency map is mapped read-only, which Python's mmap
    cannot hand to ctypes as an address."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.mmap.restype = ctypes.c_void_p
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap.restype = ctypes.c_int
        _libc = libc
    return _libc


def _load():
    path = os.environ.get("KVTIER_LIBRARY")
    if path:
        names = [path]                       # asked for this one: no other
    else:
        here = os.path.dirname(os.path.abspath(__file__))
        names = sorted(glob.glob(os.path.join(here, "_kvtring*.so")))
        names.append("libkvtier.so.0")
        found = ctypes.util.find_library("kvtier")
        if found and found not in names:
            names.append(found)
    errors = []
    for name in names:
        try:
            lib = ctypes.CDLL(name)          # CDLL: the GIL is released during each call
        except OSError as e:
            errors.append("%s: %s" % (name, e))
            continue
        try:
            return _bind(lib), name
        except AttributeError as e:          # an older libkvtier without the ring calls
            errors.append("%s: %s" % (name, e))
    return None, "libkvtier not usable (%s)" % "; ".join(errors)


def library():
    """libkvtier (a ctypes.CDLL with the ring calls bound), loaded once per process; None
    when it cannot be found or lacks the ring calls (then `why` says why)."""
    global _lib, _tried, why, path
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            _lib, got = _load()
            why, path = ("", got) if _lib is not None else (got, "")
            _tried = True
    return _lib


def msg_size(frames):
    """The payload bytes a message of these frames takes (kvt_ring_msg_size)."""
    return 4 + 4 * len(frames) + sum(len(f) for f in frames)


class Frame:
    """One frame of a reply popped from the ring, shaped like the zmq.Frame the ZMQ path gives
    Client._decode: .bytes (a bytes copy) and .buffer (a zero-copy memoryview of that copy)."""

    __slots__ = ("buffer",)

    def __init__(self, buffer):
        self.buffer = buffer

    @property
    def bytes(self):
        return self.buffer.tobytes()


def parse(payload):
    """A popped payload (bytes: u32 count, then per frame u32 length + bytes, little-endian)
    -> list of Frame over it. ValueError when it is not exactly that."""
    n = len(payload)
    if n < 4:
        raise ValueError("ring payload of %d bytes" % n)
    count = struct.unpack_from("<I", payload, 0)[0]
    if count > (n - 4) // 4:
        raise ValueError("ring payload says %d frames in %d bytes" % (count, n))
    mv = memoryview(payload)
    frames = []
    pos = 4
    for _ in range(count):
        if pos + 4 > n:
            raise ValueError("ring payload truncated at frame %d" % len(frames))
        length = struct.unpack_from("<I", payload, pos)[0]
        pos += 4
        if length > n - pos:
            raise ValueError("ring frame of %d bytes past the payload's end" % length)
        frames.append(Frame(mv[pos:pos + length]))
        pos += length
    if pos != n:
        raise ValueError("%d trailing bytes after the ring payload's frames" % (n - pos))
    return frames


TICKET_HEX = 32                 # KVT_FDPASS_TICKET_HEX


def fetch(offer, timeout_s):
    """Collects the pair's memory that a HELLO offered (`fastpath: {socket, ticket, size, ...}`)
    from the daemon's handoff socket: (mmap of `size` bytes, the open handoff connection,
    (address, bytes) of a read-only mapping of the residency map when the offer names one
    (`resident`), else None). Raises OSError / ValueError (the Client then stays on ZMQ)."""
    path, ticket, size = offer.get("socket"), offer.get("ticket"), offer.get("size")
    rsize = offer.get("resident")
    if rsize is not None and (not isinstance(rsize, int) or rsize <= 0):
        raise ValueError("the fastpath offer's residency map size %r is not a size" % (rsize,))
    if not isinstance(path, str) or not isinstance(ticket, str) or len(ticket) != TICKET_HEX \
            or not isinstance(size, int) or size <= 0:
        raise ValueError("the fastpath offer names no handoff socket, ticket and size")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.sendall(ticket.encode("ascii"))
        msg, fds, _flags, _addr = socket.recv_fds(sock, 256, 4)
        resident = None
        try:
            if msg[:1] == b"E":
                raise ValueError("the daemon refused the ring pair: %s"
                                 % msg[1:].decode("utf-8", "replace"))
            if msg != b"K" or len(fds) != (1 if rsize is None else 2):
                raise ValueError("the handoff socket answered no ring pair")
            if os.fstat(fds[0]).st_size != size:
                raise ValueError("the ring pair's memory is not the %d bytes offered" % size)
            if rsize is not None:
                resident = _map_resident(fds[1], rsize)
            mm = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if resident is not None:
                _libc_map().munmap(resident[0], resident[1])
            raise
        finally:
            for fd in fds:
                os.close(fd)                  # the mapping keeps the memory
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return mm, sock, resident


def _map_resident(fd, size):
    """(address, size) of a read-only shared mapping of the residency map's descriptor."""
    if os.fstat(fd).st_size < size:
        raise ValueError("the residency map's memory is smaller than the %d bytes offered" % size)
    libc = _libc_map()
    # populated now: a probe lands on any page of the map, and a first touch of each would
    # otherwise be a page fault on the hot path
    addr = libc.mmap(None, size, mmap.PROT_READ,
                     mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0x8000), fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        e = ctypes.get_errno()
        raise OSError(e, "mapping the residency map: %s" % os.strerror(e))
    return addr, size


def peer_gone(sock):
    """Whether the daemon's end of a handoff connection has gone (it never sends while it
    serves the pair). Never blocks."""
    try:
        p = select.poll()                     # not select(): descriptors past 1023
        p.register(sock, select.POLLIN | select.POLLPRI)
        return bool(p.poll(0))
    except (OSError, ValueError):
        return True


class Pair:
    """The request ring (producer) and the reply ring (consumer) of one HELLO's `fastpath`
    offer, in the pair's memory collected with fetch() (the Pair owns the mapping and the
    handoff connection from then on). Raises RingError / ValueError when the offer does not
    describe rings inside the mapping (the Client then stays on ZMQ)."""

    def __init__(self, lib, offer, timeout_s, spin=None):
        self._lib = lib
        self._req = self._rep = None
        self._views = []
        self._resident = None
        self._poller = None
        self._gone_at = 0.0                   # when daemon_gone() last said no
        self._mm, self._sock, self._resident = fetch(offer, timeout_s)
        try:
            self._setup(offer.get("request"), offer.get("reply"), offer.get("capacity"))
        except BaseException:
            self.drop(close=False)
            raise
        if spin is not None and hasattr(lib, "kvtier_ring_set_spin"):
            lib.kvtier_ring_set_spin(self._req, spin)
            lib.kvtier_ring_set_spin(self._rep, spin)
        self.spin = spin

    def _setup(self, request, reply, capacity):
        lib, arena = self._lib, self._mm
        capacity = int(capacity)
        region = HDR_SIZE + capacity
        for off in (request, reply):
            if not isinstance(off, int) or off < 0 or off % 8 or off + region > len(arena):
                raise ValueError("fastpath ring at %r (+%d) is not inside the %d-byte mapping"
                                 % (off, region, len(arena)))
        if abs(request - reply) < region:
            raise ValueError("fastpath rings at %d and %d overlap" % (request, reply))
        # exports of the mmap: it cannot be closed under the rings (drop() releases them)
        self._views = [(ctypes.c_char * region).from_buffer(arena, off)
                       for off in (request, reply)]
        self._req = self._attach(self._views[0], region, capacity, 1)
        self._rep = self._attach(self._views[1], region, capacity, 0)
        self.capacity = capacity
        self.request_offset = request
        self.reply_offset = reply
        self.max_payload = min(lib.kvtier_ring_max_payload(self._req),
                               lib.kvtier_ring_max_payload(self._rep))
        self._buf = ctypes.create_string_buffer(max(8, self.max_payload))
        self._len = ctypes.c_size_t(0)
        self._ptrs = (ctypes.c_char_p * _MAX_FRAMES)()
        self._lens = (ctypes.c_size_t * _MAX_FRAMES)()

    def _attach(self, view, size, capacity, producer):
        err = ctypes.create_string_buffer(200)
        h = self._lib.kvtier_ring_attach(ctypes.addressof(view), size, capacity, producer, err,
                                         len(err))
        if not h:
            raise ValueError("attaching the %s ring: %s"
                             % ("request" if producer else "reply",
                                err.value.decode("utf-8", "replace") or "failed"))
        return h

    def stats(self):
        """{"request": {...}, "reply": {...}}: each side's kvtier_ring_stats_t as a dict
        (empty dicts with a libkvtier that lacks kvtier_ring_stats)."""
        out = {}
        for name, h in (("request", self._req), ("reply", self._rep)):
            st = RingStats()
            if h and hasattr(self._lib, "kvtier_ring_stats"):
                self._lib.kvtier_ring_stats(h, ctypes.byref(st))
                out[name] = {f: getattr(st, f) for f, _ in RingStats._fields_}
            else:
                out[name] = {}
        return out

    def fits(self, frames):
        return len(frames) <= _MAX_FRAMES and msg_size(frames) <= self.max_payload

    def push(self, frames):
        """Pushes one message (a list of bytes); 0 or a KVTIER_E* code (EBUSY: full now)."""
        n = len(frames)
        ptrs, lens = self._ptrs, self._lens
        for i, f in enumerate(frames):
            ptrs[i] = f                       # a pointer to the bytes' own buffer: no copy
            lens[i] = len(f)
        try:
            return self._lib.kvtier_ring_push(self._req, ptrs, lens, n)
        finally:
            for i in range(n):
                ptrs[i] = None                # let the frames go

    def wait_room(self, need, timeout_ns):
        """Producer: waits until `need` payload bytes fit; 0 or a KVTIER_E* code."""
        return self._lib.kvtier_ring_wait(self._req, need, int(timeout_ns))

    def wait_reply(self, timeout_ns):
        """Consumer: waits until a reply can be popped; 0 or a KVTIER_E* code."""
        return self._lib.kvtier_ring_wait(self._rep, 0, int(timeout_ns))

    def pop(self):
        """(rc, payload): the next reply's payload as bytes (a copy) when rc is 0; rc EBUSY
        when there is none now, another KVTIER_E* code when the ring is closed or broken."""
        rc = self._lib.kvtier_ring_pop(self._rep, self._buf, len(self._buf),
                                       ctypes.byref(self._len))
        if rc:
            return rc, None
        n = self._len.value
        if n > len(self._buf):
            return EBADREQ, None
        return 0, ctypes.string_at(self._buf, n)

    @property
    def attached(self):
        return self._req is not None

    @property
    def resident(self):
        """Whether the residency map came with the pair."""
        return self._resident is not None and has_resident(self._lib)

    def resident_prefix(self, ns, salt, keys, n):
        """How many of n keys (16 bytes each, joined in `keys`) of namespace ns (bytes) with
        salt (bytes) lead the batch in L1 by the residency map; None without one, or once the
        daemon is gone (its handoff connection, looked at every PEER_CHECK_S at most: a poll
        costs more than the probe; its beat, in the map, every time)."""
        r = self._resident
        if r is None or not has_resident(self._lib):
            return None
        now = time.monotonic()
        if now - self._gone_at > PEER_CHECK_S:
            if self.daemon_gone():
                return None
            self._gone_at = now
        got = self._lib.kvtier_resident_prefix(r[0], r[1], ns, len(ns), salt, len(salt), keys, n)
        return got if got >= 0 else None

    def daemon_gone(self):
        """True once the daemon let the pair go or died (its handoff connection ended)."""
        sock = self._sock
        if sock is None:
            return True
        p = self._poller
        if p is None:                         # one poll object for the pair's life: each
            p = self._poller = select.poll()  # resident_prefix asks
            p.register(sock, select.POLLIN | select.POLLPRI)
        try:
            return bool(p.poll(0))
        except (OSError, ValueError):
            return True

    def drop(self, close):
        """Ends the pair: close=True first closes both of this client's sides (the daemon
        then drops the pair); close=False only detaches (the daemon closed it, or it is broken:
        its region may already be someone else's). Releases the exports of the mapping.
        Idempotent."""
        lib = self._lib
        for h in (self._req, self._rep):
            if h:
                if close:
                    lib.kvtier_ring_close(h)
                lib.kvtier_ring_detach(h)
        self._req = self._rep = None
        views, self._views = self._views, []
        del views                             # the last references: the mmap is free again
        self._poller = None
        sock, self._sock = getattr(self, "_sock", None), None
        if sock is not None:
            sock.close()                      # the daemon sees this client let go
        res, self._resident = getattr(self, "_resident", None), None
        if res is not None:
            _libc_map().munmap(res[0], res[1])
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:               # a view still held (a traceback's): the GC's
                pass

    def __del__(self):
        # a Client collected without close(): free the handles (detaching never touches the
        # region; the daemon closes the pair with the connection or the instance)
        try:
            self.drop(close=False)
        except Exception:                     # noqa: BLE001 - interpreter shutdown
            pass
