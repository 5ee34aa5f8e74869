"""Client: one DEALER connection to kvtierd speaking wire protocol v1 (docs/protocol.md).

Thread-safety: a Client is NOT thread-safe (neither is its ZeroMQ socket). Use one Client per
thread; several Clients may share one process, one instance name, and one zmq Context.

Every request gets a fresh uid; replies are matched by uid, and a reply nobody waits for any
more (its call timed out) is discarded when it turns up. A call waits at most `timeout_ms` for
its reply and then raises kvtier.Timeout.

The payload path: HELLO names the daemon's shared-memory arena, which the Client maps
(MAP_SHARED, read-write). RESERVE hands out writable memoryviews into it, ACQUIRE read-only
ones — zero-copy; the bytes never cross the socket. A view is valid while its lease is:
COMMIT / RELEASE (and close()) release the views, after which touching them raises
ValueError instead of reading memory the daemon may have reused. When the arena file cannot be
opened (a client on another machine, over tcp) `.arena` is None, RESERVE / ACQUIRE raise
Unavailable, and PUT / GET carry the bytes inline instead.

Liveness (docs/protocol.md, "Client liveness"): the daemon drops an instance silent for
`lease_ms`, with its leases and GPU registrations. A Client therefore runs a heartbeat while
open (kvtier.heartbeat: a daemon thread with its own socket, never this one) that joins the
instance and PINGs it every interval — lease_ms / 3 within [100 ms, 10 s], or `heartbeat_ms` /
KVTIER_HEARTBEAT_MS; 0 disables it. A lease is then held until COMMIT/RELEASE or close(), not
lease_ms. If the instance was dropped anyway (heartbeat disabled, the process stopped, the
daemon restarted), call() re-establishes it transparently: when a request answers
instance_dropped, or the heartbeat found the instance gone, it says HELLO again (same name,
its token), maps the new arena if the daemon announced another, releases every view (their
leases died with the instance), registers the GPU layouts again, and sends the request once
more — except COMMIT and RELEASE (their lease is gone: LeaseExpired / UnknownLease) and
UNREGISTER_GPU (the registration is gone too: it returns). send()/recv() are the raw layer:
they never re-establish (InstanceDropped reaches the caller; hello() re-establishes).

The fast path (docs/protocol.md "Fast path"): a Client that maps the arena asks HELLO for a
pair of shared-memory rings inside it (`fastpath: true`) and, when the daemon offers one, sends
its requests there instead of over the socket: the same v1 frames, replies matched by uid. The
rings are libkvtier's (kvtier._ring, through ctypes); without libkvtier.so (KVTIER_LIBRARY, else
the loader's path) there is no fast path and nothing else changes. Stay on ZMQ: HELLO, BYE, PUT
and GET (object bytes), requests that do not fit a ring record, and every request once the
daemon closed the pair (it answers Unavailable to the call awaiting a reply on it, resends it
over ZMQ when that is harmless) until a later HELLO offers a new one. The daemon reads the ring
and the socket independently, so a request post()ed on the ring is confirmed there before the
next one goes over ZMQ; a pair whose arena file is gone (a killed daemon closes nothing) is
dropped. KVTIER_FASTPATH=0 or fastpath=False: never ask. The heartbeat stays on its own ZMQ
socket; a process forked from this one never touches the pair.

Faulting the arena in (KVTIER_MAP_POPULATE, docs/protocol.md): lazily by default (each page
on first touch), all at once when it is mapped ("1": MAP_POPULATE), or by a daemon thread that
walks the mapping in chunks ("background") and is stopped and joined before it is unmapped.
"""

import collections
import contextlib
import errno
import itertools
import mmap
import os
import threading
import time
import weakref

import msgpack
import zmq

from . import _ring
from . import curve as _curve
from . import hashing
from . import heartbeat as _heartbeat
from .errors import BadRequest, InstanceDropped, KvtierError, ProtocolError, Timeout, \
    Unavailable, error_for, LeaseExpired, UnknownLease

__all__ = [
    "Client", "Lookup", "PrefetchStatus", "Reservation", "Acquired", "Slots", "PROTO_VERSION",
    "HELLO", "BYE", "PING", "LOOKUP", "PREFETCH_STATUS", "RESERVE", "COMMIT", "ACQUIRE",
    "RELEASE", "PUT", "GET", "REMOVE", "CLEAR", "STATS", "HASH_TOKENS",
]

PROTO_VERSION = 1

_MAP_POPULATE = 0x8000          # Linux, for Pythons older than 3.10
_MADV_POPULATE_WRITE = 23       # Linux 5.14; older kernels answer EINVAL: pages are read
_PREFAULT_CHUNK = 8 << 20       # madvise holds the GIL: the caller's threads wait this long


def _prefault(arena, stop):
    """Faults the arena mapping in, chunk by chunk, until done or stopped (KVTIER_MAP_POPULATE
    =background). A mapping closed under it ends it (ValueError), never a crash."""
    try:
        for off in range(0, len(arena), _PREFAULT_CHUNK):
            if stop.is_set():
                return
            n = min(_PREFAULT_CHUNK, len(arena) - off)
            try:
                arena.madvise(getattr(mmap, "MADV_POPULATE_WRITE", _MADV_POPULATE_WRITE), off, n)
            except OSError as e:
                if e.errno != errno.EINVAL:   # not an old kernel: touching would be SIGBUS
                    return
            # and a read of every page (one byte each, in C): under a hypervisor that shadows
            # page tables the first access to a page of a new mapping exits to it, populated
            # or not (libkvtier's kvtier_conn.c says more)
            with memoryview(arena) as mv:
                bytes(mv[off:off + n:4096])
    except ValueError:
        return

HELLO = 1
BYE = 2
PING = 3
LOOKUP = 4
PREFETCH_STATUS = 5
RESERVE = 6
COMMIT = 7
ACQUIRE = 8
RELEASE = 9
PUT = 10
GET = 11
REMOVE = 12
CLEAR = 13
STATS = 14
HASH_TOKENS = 15
REGISTER_GPU = 16
UNREGISTER_GPU = 17
STORE_GPU = 18
RETRIEVE_GPU = 19

# hits: leading keys present in any tier; l1: leading keys in L1; lease: read lease pinning the
# hits (LOOKUP lock=True and hits > 0), else 0; job: prefetch job id (prefetch=True), else None.
Lookup = collections.namedtuple("Lookup", "hits l1 lease job")
PrefetchStatus = collections.namedtuple("PrefetchStatus", "done loaded hits")
# slots: one writable memoryview per reserved key (None: already stored, do not write), maybe
# fewer than keys (the longest prefix that fits); lease: the write lease (0 when all None).
Reservation = collections.namedtuple("Reservation", "slots lease")
# views: read-only memoryviews of the leading keys found in L1; lease: 0 when none found.
Acquired = collections.namedtuple("Acquired", "views lease")
# The same as (offset, length) pairs into .arena (None: RESERVE's "already stored"), for callers
# that view the arena themselves (kvtier.sglang: one torch tensor over the whole mapping).
Slots = collections.namedtuple("Slots", "slots lease")

_instance_seq = itertools.count(1)
_MAX_RING_SPIN = 1 << 20


def _env_spin():
    """KVTIER_RING_SPIN as libkvtier reads it: an integer in [0, 2^20], else None (default)."""
    v = os.environ.get("KVTIER_RING_SPIN", "").strip()
    try:
        n = int(v, 10)
    except ValueError:
        return None
    return n if 0 <= n <= _MAX_RING_SPIN else None


# Requests that answered instance_dropped are sent once more after the instance is
# re-established, except these: HELLO and BYE are the session itself, COMMIT and RELEASE name
# a lease that died with the instance, and UNREGISTER_GPU's registration died with it too.
_NOT_RETRIED = frozenset({HELLO, BYE, COMMIT, RELEASE, UNREGISTER_GPU})

# Never on the fast path: the session itself, and the requests that carry object bytes (the
# daemon answers a GET whose reply cannot fit a ring record too_large).
_ZMQ_ONLY = frozenset({HELLO, BYE, PUT, GET})
# Sent again over ZMQ when the fast path closed before their reply came (or the reply was too
# large for the ring): they change nothing and pin nothing, so running twice is harmless.
_RESENDABLE = frozenset({PING, PREFETCH_STATUS, STATS, HASH_TOKENS})
# A reply slot {offset, length} takes at most 33 bytes: RESERVE / ACQUIRE of more keys than
# fit at this rate go over ZMQ, so their reply never outgrows the ring (the daemon would
# answer too_large after having run the request).
_SLOTTED = frozenset({RESERVE, ACQUIRE})
_SLOT_REPLY_BYTES = 33
_REPLY_SLACK = 256
# The daemon closes a pair whose client leaves more than 256 replies unread: before pushing
# while this many ring requests are outstanding, replies already there are taken (kept for
# their recv()), as those of post() and of timed-out calls always are.
_DRAIN_OUTSTANDING = 64
_WAIT_SLICE_MS = 200            # ring waits in slices: Ctrl-C is seen between two
_RING_IDLE_S = 0.05             # a pair idle this long is checked before use (one stat)
_LOST = object()                # _waiting[uid]: sent on a ring pair that has gone


class _RingGone(Exception):
    """The ring pair was dropped while taking a reply (closed by the daemon, malformed)."""


def _resendable(type_, body):
    if type_ == LOOKUP:
        return not (body or {}).get("lock") and not (body or {}).get("prefetch")
    return type_ in _RESENDABLE


_with_rings = weakref.WeakSet()   # Clients holding a ring pair: forgotten in a forked child


def _forget_rings_in_child():
    for c in list(_with_rings):
        c._drop_ring("the process forked: the pair belongs to the parent", close=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_rings_in_child)


def _pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(buf):
    return msgpack.unpackb(buf, raw=False, strict_map_key=False)


def _labels(labels):
    """RESERVE/PUT `labels`: str or None per key (the daemon checks lengths and UTF-8)."""
    out = []
    for label in labels:
        if label is not None and not isinstance(label, str):
            raise TypeError("labels: expected str or None per key, got %s"
                            % type(label).__name__)
        out.append(label)
    return out


def _keys(keys):
    """Keys as the wire wants them: a list whose bytes-likes msgpack packs as bin (bytes,
    bytearray and memoryview alike: no per-key conversion on the hot path). Checking them (16
    bytes each) is the daemon's job: a bad key comes back as BadRequest."""
    return keys if type(keys) is list else list(keys)


class Client:
    """A connection to kvtierd: DEALER connect + HELLO.

    endpoint   "ipc:///run/kvtier/kvtier.sock" or "tcp://127.0.0.1:5555"
    client     a name for the daemon's logs and metrics
    instance   stable per client process; leases belong to it (default "{client}-{pid}-{n}")
    timeout_ms how long any call waits for its reply
    context    a zmq.Context (default: the process-wide zmq.Context.instance())
    map_arena  False: never map the arena (behave as a remote client)
    curve_serverkey, curve_cert
               CURVE for tcp:// endpoints (kvtier.curve): the daemon's public key (Z85 text or
               certificate path) and this client's certificate path; default from
               KVTIER_CURVE_SERVERKEY / KVTIER_CURVE_CERT
    heartbeat_ms the heartbeat's interval (module docstring); None: KVTIER_HEARTBEAT_MS, else
               lease_ms / 3 within [100 ms, 10 s]; 0: no heartbeat
    fastpath   None: ask HELLO for the shared-memory fast path unless KVTIER_FASTPATH=0;
               False: never (ZMQ only); True: ask (when the arena is mapped)
    ring_spin  the most spin iterations a fast-path wait makes before it sleeps (0 to 1048576;
               0: sleep at once, for a client whose cores are always busy); None:
               KVTIER_RING_SPIN (ignored unless an integer in that range), else the ring's
               default (4096). The spin adapts below it and pauses when it loses its CPU.

    Attributes: info (the HELLO reply body), instance, token (the instance's, from HELLO),
    arena (mmap or None; shm.map_size bytes: shm.size rounded to pages),
    chunk_tokens, lease_ms, max_message, heartbeat_ms (0: none), fastpath (True while a ring
    pair is attached), fastpath_why (why not, when it is not).
    """

    def __init__(self, endpoint, client="python", instance=None, timeout_ms=5000,
                 context=None, map_arena=True, curve_serverkey=None, curve_cert=None,
                 heartbeat_ms=None, fastpath=None, ring_spin=None):
        if heartbeat_ms is not None and int(heartbeat_ms) < 0:
            raise ValueError("heartbeat_ms must be 0 (no heartbeat) or positive")
        if ring_spin is None:
            ring_spin = _env_spin()
        elif (isinstance(ring_spin, bool) or not isinstance(ring_spin, int)
              or not 0 <= ring_spin <= _MAX_RING_SPIN):
            raise ValueError("ring_spin must be an integer from 0 to %d, not %r"
                             % (_MAX_RING_SPIN, ring_spin))
        self.ring_spin = ring_spin
        self.endpoint = endpoint
        self.client = client
        self.instance = instance or "%s-%d-%d" % (client, os.getpid(), next(_instance_seq))
        self.timeout_ms = int(timeout_ms)
        self.info = None
        self.token = None
        self.arena = None
        self.heartbeat_ms = 0
        self._arena_view = None
        self._arena_at = None       # (shm.path, shm.size, shm.map_size) HELLO announced last
        self._arena_size = 0        # shm.size: the L1 objects' part of the mapping
        if fastpath is None:
            fastpath = os.environ.get("KVTIER_FASTPATH", "").strip() != "0"
        self._want_fastpath = bool(fastpath) and bool(map_arena)
        self._ring = None           # the _ring.Pair while the fast path is attached
        self._ring_uids = set()     # outstanding requests sent on it (their reply comes there)
        self._ring_posted = 0       # the last uid post()ed on it while unconfirmed, else 0
        self._ring_seen = 0.0       # time.monotonic() of its last reply (or its attaching)
        self._arena_ident = (None, 0, 0)  # (shm.path, st_dev, st_ino) of the mapped arena
        self._asked = False         # the last HELLO asked for a ring pair
        self.fastpath_why = ("not asked (KVTIER_FASTPATH=0 or fastpath=False)" if not fastpath
                             else "not asked (map_arena=False)" if not map_arena
                             else "not offered yet")
        self._prefault = None       # (thread, stop event) faulting the arena in, or None
        self._want_arena = map_arena
        self._uids = itertools.count(1)
        self._waiting = {}          # uid -> reply frames (or None while still outstanding)
        self._views = {}            # lease -> memoryviews handed out under it
        self._gpu = {}              # device -> [REGISTER_GPU body, live], said again on re-HELLO
        self._hb = None
        self._pid = os.getpid()
        self._closed = False
        ctx = context or zmq.Context.instance()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        try:
            _curve.apply(self._sock, endpoint, curve_serverkey, curve_cert)
            self._sock.connect(endpoint)
            self.hello()
            interval, self._hb_fixed = _heartbeat.interval_ms(heartbeat_ms, self.lease_ms)
            if interval:
                self._hb = _heartbeat.Heartbeat(ctx, endpoint, client, self.instance, self.token,
                                                interval, self.timeout_ms, curve_serverkey,
                                                curve_cert)
                self.heartbeat_ms = interval
                # a Client collected without close() must not keep its instance alive for ever
                weakref.finalize(self, self._hb.request_stop)
        except BaseException:
            self._drop_ring("the Client could not be made")
            self._unmap_arena()
            self._sock.close(linger=0)
            self._closed = True
            raise

    # -- session ------------------------------------------------------------------------

    def hello(self):
        """Says HELLO (again) under `instance`, presenting its token: the constructor does it,
        and call() re-establishes a dropped instance with it (call it yourself after
        InstanceDropped from send()/recv()). When the instance is new (it had been dropped, or
        the daemon restarted), every view is released (the leases died), the arena is
        re-mapped if the daemon announced another, and the GPU layouts are registered again.
        Returns the HELLO reply (also .info). A fast-path ring pair is closed first; the new
        HELLO asks for another."""
        # closing a pair the daemon closed already is harmless: a reused slot has a new epoch
        self._drop_ring("closed for a new HELLO")
        before = self.token
        hb = self._hb if self._hb is not None and self._hb.mine() else None
        presented = hb.token() if hb is not None else self.token
        try:
            info = self._say_hello(presented)
        except BadRequest:                  # the heartbeat may be making it anew right now
            newer = hb.newer_token(presented, self.timeout_ms / 1000.0) if hb else None
            if newer is None:
                raise
            info = self._say_hello(newer)
        self.info = info
        self.token = info.get("token")
        new = not self.token or self.token != before
        if new:
            self._drop_all_views()
        if self._want_arena:
            self._follow_arena(info.get("shm"))
        self._attach_ring(info.get("fastpath"))
        if hb is not None:
            hb.publish(self.token, None if self._hb_fixed
                       else _heartbeat.interval_ms(None, self.lease_ms)[0])
        if new and before is not None:
            for entry in self._gpu.values():
                self._register_again(entry)
        return info

    def _say_hello(self, token):
        body = {"version": PROTO_VERSION, "client": self.client, "instance": self.instance}
        if token:
            body["token"] = token
        self._asked = self._ask_fastpath()
        if self._asked:
            body["fastpath"] = True
            if _ring.has_resident(_ring.library()) and \
                    os.environ.get("KVTIER_RESIDENT", "").strip() != "0":
                body["resident"] = True
        return self._call_once(HELLO, body)[0]

    def _ask_fastpath(self):
        """Whether HELLO asks for a ring pair: wanted, libkvtier loads, and the arena is mapped
        (or not tried yet: the first HELLO is what names it)."""
        if not self._want_fastpath:
            return False
        if self.arena is None and self._arena_at is not None:
            self.fastpath_why = "not asked: the arena is not mapped"
            return False
        if _ring.library() is None:
            self.fastpath_why = "not asked: %s" % _ring.why
            return False
        return True

    def _attach_ring(self, offer):
        """After a HELLO: attaches the pair it offered; else (or when that fails) stays on ZMQ."""
        if not getattr(self, "_asked", False):
            return
        if not isinstance(offer, dict):
            self.fastpath_why = "declined by the daemon"
            return
        if self.arena is None:
            self.fastpath_why = "offered, but the arena is not mapped"
            return
        try:
            self._ring = _ring.Pair(_ring.library(), offer, self.timeout_ms / 1000.0,
                                    self.ring_spin)
        except Exception as e:               # noqa: BLE001 - any bad offer: stay on ZMQ
            self.fastpath_why = "offered, but not attached: %s" % e
            return
        self.fastpath_why = ""
        self._ring_seen = time.monotonic()
        _with_rings.add(self)

    @property
    def fastpath(self):
        """True while requests go over the shared-memory ring pair."""
        return self._ring is not None

    def resident_prefix(self, ns, keys, salt=None):
        """How many leading keys of `keys` are in L1, read from the residency map the daemon
        shares with fast-path clients: no request, no wake-up of the daemon (a few µs for 64
        keys). Advisory: they were READY a moment ago (a later acquire may still miss one, as
        after any lookup); fewer than len(keys) says nothing about the rest, which may be in
        L2 (lookup() knows). None without a map (no fast path, KVTIER_RESIDENT=0, a daemon
        with resident_map off or older than the map) or when it is not to be believed (the
        daemon died, stopped beating it for a second, or closed it)."""
        ring = self._ring
        if ring is None or not ring.resident:
            return None
        if not keys:
            return 0
        nsb = ns.encode("utf-8") if isinstance(ns, str) else bytes(ns)
        saltb = b"" if not salt else salt.encode("utf-8") if isinstance(salt, str) \
            else bytes(salt)
        joined = b"".join(keys)
        n = len(keys)
        if len(joined) != 16 * n:
            raise ValueError("keys must be 16 bytes each")
        return ring.resident_prefix(nsb, saltb, joined, n)

    def fastpath_stats(self):
        """What this client's ring waits did, while the fast path is attached: {"request":
        {records, bytes, spin_hits, cooled, sleeps, wakes, spin}, "reply": {...}} (the
        request ring's waits are for room, the reply ring's for replies); None without it."""
        ring = self._ring
        return ring.stats() if ring is not None else None

    def _drop_ring(self, why, close=True):
        """Forgets the ring pair, closing this client's sides first (the daemon then reclaims
        its own; close=False: a forked child, whose parent the pair is). Requests awaiting a
        reply on it fail with Unavailable."""
        ring, self._ring = self._ring, None
        if ring is None:
            return
        ring.drop(close)
        for u in self._ring_uids:
            if self._waiting.get(u, 0) is None:
                self._waiting[u] = _LOST
        self._ring_uids.clear()
        self._ring_posted = 0
        self.fastpath_why = why
        _with_rings.discard(self)

    def _revive(self):
        """Before a call: the heartbeat found the instance gone. A daemon that does not answer
        fails the call; an error answer to the HELLO leaves the flag up and the call goes."""
        try:
            self.hello()
        except Timeout:
            raise
        except KvtierError:
            pass

    @property
    def chunk_tokens(self):
        return self.info["chunk_tokens"]

    @property
    def lease_ms(self):
        return self.info["lease_ms"]

    @property
    def max_message(self):
        return self.info["max_message"]

    def _follow_arena(self, shm):
        """Keeps the mapping while HELLO announces the same arena; another one (a restarted
        daemon) is mapped instead of the old."""
        at = ((shm.get("path"), shm.get("size"), shm.get("map_size"))
              if isinstance(shm, dict) else None)
        if at == self._arena_at:
            return
        self._unmap_arena()
        self._arena_at = at
        self._map_arena(shm)

    def _unmap_arena(self):
        """Releases every view and the arena. If the caller still holds views derived from it
        (slices of a released view, numpy arrays), the mapping stays until those are gone."""
        self._drop_ring("the arena was unmapped")
        self._drop_all_views()
        if self._prefault is not None:
            thread, stop = self._prefault
            self._prefault = None
            stop.set()
            if thread.ident is not None and self._pid == os.getpid():
                thread.join()
        if self._arena_view is not None:
            with contextlib.suppress(BufferError):
                self._arena_view.release()
            self._arena_view = None
        if self.arena is not None:
            try:
                self.arena.close()
            except BufferError:             # caller still holds exports of the mapping
                pass
            self.arena = None
        self._arena_size = 0

    def _map_arena(self, shm):
        if not isinstance(shm, dict) or not shm.get("path") or not shm.get("size"):
            return
        size = shm["size"]
        length = size
        # daemons before issue 28 kept the fast path's rings past the objects: map_size
        # covered them (older ones send none)
        map_size = shm.get("map_size")
        if self._want_fastpath and isinstance(map_size, int) and map_size > size:
            length = map_size
        try:
            with open(shm["path"], "r+b") as f:      # mmap keeps its own dup of the fd
                st = os.fstat(f.fileno())
                st_size = st.st_size
                if st_size < size:
                    return                             # not the daemon's arena (another host)
                if st_size < length:
                    length = size
                mode = os.environ.get("KVTIER_MAP_POPULATE", "0")
                flags = mmap.MAP_SHARED
                if mode in ("1", "true"):
                    flags |= getattr(mmap, "MAP_POPULATE", _MAP_POPULATE)
                self.arena = mmap.mmap(f.fileno(), length, flags=flags)
        except OSError:
            self.arena = None
            return
        self._arena_size = size
        self._arena_ident = (shm["path"], st.st_dev, st.st_ino)
        self._arena_view = memoryview(self.arena)
        if mode == "background":
            stop = threading.Event()
            thread = threading.Thread(target=_prefault, args=(self.arena, stop),
                                      name="kvtier-prefault", daemon=True)
            thread.start()
            self._prefault = (thread, stop)

    def bye(self):
        """Says BYE: the daemon releases every lease of this instance at once. Returns how
        many it released. Views handed out are released too, and the fast path is closed
        (a later call says HELLO again and asks for a new pair)."""
        self._drop_ring("closed by BYE")
        released = self.call(BYE, {"instance": self.instance})[0].get("released", 0)
        self._drop_all_views()
        return released

    def close(self):
        """Stops the heartbeat (at once, daemon or no daemon), says BYE (best effort, at most
        1 s), releases every view, unmaps the arena, closes the socket. Idempotent. If the
        caller still holds views derived from the arena (slices of a released view, numpy
        arrays), the mapping stays until those are gone. In a child forked after the Client
        was made, the parent's instance is left alone (no BYE)."""
        if self._closed:
            return
        timeout = self.timeout_ms
        try:
            if self._hb is not None:
                self._hb.stop()
            if self._pid == os.getpid():
                self.timeout_ms = min(self.timeout_ms, 1000)
                self.bye()
        except (KvtierError, zmq.ZMQError):
            pass
        finally:
            self.timeout_ms = timeout
            self._unmap_arena()
            self._sock.close(linger=0)
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return "<kvtier.Client %s instance=%s%s%s>" % (
            self.endpoint, self.instance, " closed" if self._closed else
            (" arena=%d" % len(self.arena) if self.arena is not None else " remote"),
            " fastpath" if self._ring is not None else "")

    # -- raw requests ---------------------------------------------------------------------

    def send(self, type_, body=None, data=(), reply=True):
        """Sends one request [uid, type, body, *data] without waiting; returns its uid for
        recv(). body is a dict (packed with bin types) or None for {}; data are bytes-like
        (sent zero-copy: do not modify them until the reply arrived). reply=False: nobody
        will recv() it, its reply is discarded when it turns up (post()). Goes over the fast
        path's ring when one is attached and the request may and does fit (module docstring)."""
        return self._send(type_, body, data, reply, True)

    def _send(self, type_, body, data, reply, ring_ok):
        if self._closed:
            raise ValueError("kvtier.Client is closed")
        uid = next(self._uids)
        frames = [_pack(uid), _pack(type_), _pack({} if body is None else body)]
        if self._ring is not None and ring_ok and not data and type_ not in _ZMQ_ONLY:
            if not reply or self._ring_posted or len(self._ring_uids) >= _DRAIN_OUTSTANDING:
                self._ring_drain()
            ring = self._ring
            if ring is not None and ring.fits(frames) and \
                    (type_ not in _SLOTTED or self._reply_fits(body, ring)):
                if self._ring_push(ring, frames, type_):
                    if reply:
                        self._waiting[uid] = None
                        self._ring_uids.add(uid)
                    else:
                        self._ring_posted = uid
                    return uid
        if self._ring_posted:
            self._ring_settle()
        frames.extend(data)
        try:
            self._sock.send_multipart(frames, copy=False)
        except zmq.Again:
            raise Timeout("request type %d not sent within %d ms (is the daemon up?)"
                          % (type_, self.timeout_ms), type_) from None
        if reply:
            self._waiting[uid] = None
        return uid

    @staticmethod
    def _reply_fits(body, ring):
        """RESERVE / ACQUIRE of n keys may be answered with n slots: over ZMQ when those
        could outgrow a ring record."""
        keys = body.get("keys") if isinstance(body, dict) else None
        if not isinstance(keys, list):
            return True
        return len(keys) * _SLOT_REPLY_BYTES + _REPLY_SLACK <= ring.max_payload

    # -- the fast path's ring pair (module docstring) -------------------------------------

    def _ring_push(self, ring, frames, type_):
        """Pushes a request on the ring, waiting (at most timeout_ms) while it is full. True
        once pushed; False when it must go over ZMQ instead (the pair closed, broken or its
        daemon gone: it is dropped). Timeout when the ring stayed full (sending it over ZMQ
        instead could overtake what is queued)."""
        if time.monotonic() - self._ring_seen > _RING_IDLE_S:
            self._ring_check_owner()          # idle a while: its daemon may have died
            if self._ring is None:
                return False
        rc = ring.push(frames)
        if rc == _ring.EBUSY:
            need = _ring.msg_size(frames)
            deadline = _now_ms() + self.timeout_ms
            while rc == _ring.EBUSY:
                self._ring_drain()            # a daemon stuck on a full reply ring reads none
                if self._ring is None:
                    return False
                left = deadline - _now_ms()
                if left <= 0:
                    self._ring_check_owner()
                    raise Timeout("request type %d not sent within %d ms: the fast path's "
                                  "request ring stayed full" % (type_, self.timeout_ms), type_)
                rc = ring.wait_room(need, min(left, _WAIT_SLICE_MS) * 1e6)
                if rc == 0:
                    rc = ring.push(frames)
                elif rc == _ring.ETIMEDOUT:
                    rc = _ring.EBUSY
        if rc == 0:
            return True
        if rc in (_ring.EUNAVAIL, _ring.EBADREQ):
            self._drop_ring(self._ring_why(rc, "request"))
        return False                          # ETOOBIG, EINVAL: this one over ZMQ

    @staticmethod
    def _ring_why(rc, which):
        return ("closed by the daemon" if rc == _ring.EUNAVAIL
                else "the %s ring was found malformed" % which if rc == _ring.EBADREQ
                else "the %s ring failed (%d)" % (which, rc))

    def _ring_check_owner(self):
        """A daemon that died closed nothing, but its arena file goes (the next daemon removes
        it as stale): then the ring is never served again, and the pair is dropped (calls go
        over ZMQ, where a restarted daemon answers and a new HELLO brings a new pair)."""
        if self._ring is not None and self._ring.daemon_gone():
            self._drop_ring("the daemon let the ring pair go (or died)")
            return
        path, dev, ino = self._arena_ident
        try:
            st = os.stat(path)
            if (st.st_dev, st.st_ino) == (dev, ino):
                return
        except (OSError, TypeError, ValueError):
            pass
        self._drop_ring("the daemon's arena file is gone (the daemon died?)")

    def _ring_next(self, deadline):
        """The next reply on the ring as (uid, frames) (uid 0: unreadable), waiting until
        `deadline` (_now_ms; None: only what is there); None when none came. The pair gone
        (closed by the daemon, malformed): it is dropped and _RingGone raised."""
        ring = self._ring
        while True:
            rc, payload = ring.pop()
            if rc == 0:
                try:
                    frames = _ring.parse(payload)
                except ValueError as e:
                    self._drop_ring("the reply ring held a record that is not a message: %s" % e)
                    raise _RingGone(self.fastpath_why) from None
                try:
                    ruid = _unpack(frames[0].buffer) if frames else 0
                except Exception:            # noqa: BLE001 - garbage cannot be matched
                    ruid = 0
                if not isinstance(ruid, int) or isinstance(ruid, bool):
                    ruid = 0
                if self._ring_posted and ruid >= self._ring_posted:
                    self._ring_posted = 0     # the daemon reads its ring in order
                self._ring_seen = time.monotonic()
                return ruid, frames
            if rc == _ring.EBUSY:
                left = 0 if deadline is None else deadline - _now_ms()
                if left <= 0:
                    return None
                rc = ring.wait_reply(min(left, _WAIT_SLICE_MS) * 1e6)
                if rc in (0, _ring.ETIMEDOUT):
                    continue
            self._drop_ring(self._ring_why(rc, "reply"))
            raise _RingGone(self.fastpath_why)

    def _ring_keep(self, ruid, frames, uid):
        """A reply taken off the ring: its frames when it answers `uid`; else kept for its own
        recv() (another outstanding request) or discarded (stale: posted or timed out)."""
        if ruid == uid:
            self._ring_uids.discard(uid)
            return frames
        if ruid in self._ring_uids and self._waiting.get(ruid, 0) is None:
            self._waiting[ruid] = frames
            self._ring_uids.discard(ruid)
        return None

    def _ring_drain(self):
        """Takes the replies waiting on the ring without waiting: a ring left full (posted
        calls, timed-out calls, many sent and none received yet) makes the daemon drop it."""
        try:
            while self._ring is not None:
                got = self._ring_next(None)
                if got is None:
                    return
                self._ring_keep(got[0], got[1], None)
        except _RingGone:
            pass

    def _ring_settle(self):
        """Before a request goes over ZMQ while one posted on the ring is unconfirmed: waits
        (at most timeout_ms) for the ring's reply to it or to a later request. The daemon reads
        the two transports independently, and a post()ed RELEASE must be done before the next
        call. Best effort: if none comes the request goes anyway."""
        deadline = _now_ms() + self.timeout_ms
        try:
            while self._ring_posted and self._ring is not None:
                got = self._ring_next(deadline)
                if got is None:
                    break
                self._ring_keep(got[0], got[1], None)
        except _RingGone:
            pass
        self._ring_posted = 0

    def _ring_lost(self, uid, why):
        e = Unavailable("the daemon closed the fast path before the reply to request %d came "
                        "(%s); the request may or may not have run" % (uid, why))
        e.fastpath_closed = True
        return e

    def _ring_recv(self, uid, deadline, timeout_ms):
        """recv() of a request sent on the ring: its reply frames."""
        while True:
            try:
                got = self._ring_next(deadline)
            except _RingGone as e:
                del self._waiting[uid]
                raise self._ring_lost(uid, str(e)) from None
            if got is None:
                del self._waiting[uid]           # its reply, if it ever comes, is stale
                self._ring_uids.discard(uid)
                self._ring_check_owner()
                raise Timeout("no reply to request %d within %d ms" % (uid, timeout_ms))
            frames = self._ring_keep(got[0], got[1], uid)
            if frames is not None:
                return frames

    def post(self, type_, body=None):
        """Sends a request without waiting for its reply, which is discarded (its errors are
        not seen): a RELEASE once the bytes are read, say, costs no round trip."""
        self.send(type_, body, reply=False)

    def recv(self, uid, timeout_ms=None, check=True, copy=True):
        """Waits for the reply to request `uid` (from send()). Returns (body, data): body the
        decoded reply map, data its raw data frames (bytes, or zero-copy memoryviews with
        copy=False). Raises the KvtierError of a failed reply (unless check=False), Timeout
        after timeout_ms (default: the client's). Replies to other outstanding requests are
        kept for their own recv(); replies nobody waits for are discarded."""
        if uid not in self._waiting:
            raise ValueError("no outstanding request with uid %r" % (uid,))
        timeout_ms = self.timeout_ms if timeout_ms is None else timeout_ms
        deadline = _now_ms() + timeout_ms
        frames = self._waiting[uid]
        if frames is _LOST:
            del self._waiting[uid]
            raise self._ring_lost(uid, self.fastpath_why)
        if frames is None and uid in self._ring_uids:
            frames = self._ring_recv(uid, deadline, timeout_ms)
        while frames is None:
            left = deadline - _now_ms()
            if left <= 0 or not self._sock.poll(max(0, int(left)), zmq.POLLIN):
                del self._waiting[uid]       # its reply, if it ever comes, is stale
                raise Timeout("no reply to request %d within %d ms" % (uid, timeout_ms))
            got = self._sock.recv_multipart(copy=False)
            try:
                ruid = _unpack(got[0].bytes)
            except Exception:                # noqa: BLE001 - garbage cannot be matched
                continue
            if ruid == uid:
                frames = got
            elif self._waiting.get(ruid, 0) is None:
                self._waiting[ruid] = got
            # else: stale (its call timed out) - dropped
        del self._waiting[uid]
        return self._decode(frames, check, copy)

    def call(self, type_, body=None, data=(), check=True, copy=True, timeout_ms=None):
        """send() + recv(): one request, its (body, data) — re-establishing a dropped
        instance on the way (module docstring): a request that answers instance_dropped is
        sent once more after hello(), unless it is HELLO, BYE, COMMIT, RELEASE or
        UNREGISTER_GPU."""
        if self._hb is not None and self._hb.dropped and type_ not in (HELLO, BYE):
            self._revive()
        reply = self._call_once(type_, body, data, False, copy, timeout_ms)
        if _error(reply[0])[0] == InstanceDropped.code and type_ not in (HELLO, BYE):
            self.hello()
            if type_ not in _NOT_RETRIED:
                reply = self._call_once(type_, body, data, False, copy, timeout_ms)
        if check and not reply[0]["ok"]:
            raise error_for(*_error(reply[0]), type_)
        return reply

    def _call_once(self, type_, body=None, data=(), check=True, copy=True, timeout_ms=None):
        uid = self._send(type_, body, data, True, True)
        if uid not in self._ring_uids:
            return self.recv(uid, timeout_ms=timeout_ms, check=check, copy=copy)
        # on the fast path: a request that changes nothing goes again over ZMQ when the pair
        # closed under it, or when its reply was too large for the ring
        try:
            reply = self.recv(uid, timeout_ms=timeout_ms, check=False, copy=copy)
        except Unavailable as e:
            if not (getattr(e, "fastpath_closed", False) and _resendable(type_, body)):
                raise
            reply = None
        if reply is None or (_error(reply[0])[0] == "too_large" and _resendable(type_, body)):
            reply = self.recv(self._send(type_, body, data, True, False), timeout_ms=timeout_ms,
                              check=False, copy=copy)
        if check and not reply[0]["ok"]:
            raise error_for(*_error(reply[0]), type_)
        return reply

    @staticmethod
    def _decode(frames, check, copy):
        if len(frames) < 3:
            raise ProtocolError("reply of %d frames (need uid, type, body)" % len(frames))
        try:
            rtype = _unpack(frames[1].bytes)
            body = _unpack(frames[2].bytes)
        except Exception as e:               # noqa: BLE001
            raise ProtocolError("reply does not decode: %s" % e) from None
        if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
            raise ProtocolError("reply body is not a map with 'ok': %r" % (body,))
        if check and not body["ok"]:
            raise error_for(*_error(body), rtype)
        data = [f.bytes if copy else f.buffer for f in frames[3:]]
        return body, data

    # -- helpers ------------------------------------------------------------------------

    @staticmethod
    def _keyed(ns, keys, salt, labels=None):
        body = {"ns": ns, "keys": _keys(keys)}
        if salt:
            body["salt"] = salt
        if labels is not None:
            body["labels"] = _labels(labels)
        return body

    def _need_arena(self, what):
        if self.arena is None:
            raise Unavailable("%s needs the shared-memory arena, which this client could not "
                              "map (remote client?); use put()/get()" % what)

    def _range(self, slot):
        try:
            off, length = int(slot["offset"]), int(slot["length"])
        except (TypeError, KeyError, ValueError):
            raise ProtocolError("bad slot %r" % (slot,)) from None
        if off < 0 or length < 0 or off + length > self._arena_size:
            raise ProtocolError("slot [%d, +%d) outside the arena of %d bytes"
                                % (off, length, self._arena_size))
        return off, length

    def _view(self, rng, writable):
        off, length = rng
        v = self._arena_view[off:off + length]
        if writable:
            return v
        ro = v.toreadonly()
        v.release()
        return ro

    def _views_for(self, body, writable):
        slots, lease = self._ranges_for(body)
        views = [None if r is None else self._view(r, writable) for r in slots]
        if lease:
            self._views.setdefault(lease, []).extend(v for v in views if v is not None)
        return views, lease

    def _ranges_for(self, body):
        slots = body.get("slots")
        lease = body.get("lease", 0) or 0
        try:
            if not isinstance(slots, list):
                raise ProtocolError("reply without slots: %r" % (body,))
            return Slots([None if s is None else self._range(s) for s in slots], lease)
        except ProtocolError:
            if lease:
                with contextlib.suppress(KvtierError):
                    self.call(RELEASE, {"lease": lease})
            raise

    def _drop_views(self, lease):
        for v in self._views.pop(lease, ()):
            with contextlib.suppress(BufferError):
                v.release()

    def _drop_all_views(self):
        for lease in list(self._views):
            self._drop_views(lease)

    # -- the requests -----------------------------------------------------------------------

    def ping(self):
        """PING {instance}: a round trip that also renews this instance's leases; if the
        instance was dropped, it is re-established first (call())."""
        self.call(PING, {"instance": self.instance})

    def stats(self):
        """STATS -> dict of the daemon's counters and gauges (docs/protocol.md)."""
        body = self.call(STATS, {})[0]
        body.pop("ok", None)
        return body

    def lookup(self, ns, keys, salt=None, lock=False, prefetch=False):
        """LOOKUP -> Lookup(hits, l1, lease, job). lock=True pins the hits under `lease`
        (release it with release()); prefetch=True starts an L2 -> L1 load (`job`)."""
        body = self._keyed(ns, keys, salt)
        if lock:
            body["lock"] = True
        if prefetch:
            body["prefetch"] = True
        r = self.call(LOOKUP, body)[0]
        return Lookup(r.get("hits", 0), r.get("l1", 0), r.get("lease", 0) or 0, r.get("job"))

    def prefetch_status(self, job):
        """PREFETCH_STATUS -> PrefetchStatus(done, loaded, hits); NotFound for an unknown job."""
        r = self.call(PREFETCH_STATUS, {"job": job})[0]
        return PrefetchStatus(r.get("done"), r.get("loaded"), r.get("hits"))

    def reserve(self, ns, keys, sizes, salt=None, labels=None):
        """RESERVE -> Reservation(slots, lease). `sizes` is one int for every key or one per
        key. Each slot is a writable memoryview of exactly the size asked for, or None (already
        stored: do not write); there may be fewer slots than keys (the longest prefix that
        fits). Write the bytes, then commit(lease). NoSpace when not even the first fits.
        `labels`: one str (at most 255 UTF-8 bytes) or None per key, kept with each new object
        and carried by its events (an embedding's mm_hash, say)."""
        body = self._reserve_body(ns, keys, sizes, salt, labels)
        views, lease = self._views_for(self.call(RESERVE, body)[0], True)
        return Reservation(views, lease)

    def _reserve_body(self, ns, keys, sizes, salt, labels=None):
        self._need_arena("RESERVE")
        body = self._keyed(ns, keys, salt, labels)
        if isinstance(sizes, int):
            body["size"] = sizes
        else:
            body["sizes"] = list(sizes)
        return body

    def reserve_offsets(self, ns, keys, sizes, salt=None, labels=None):
        """reserve() answering Slots: (offset, length) into .arena per slot instead of views
        (None: already stored). Nothing is tracked: write through your own view of .arena
        (re-read .arena after every call: a restarted daemon's arena replaces it), then
        commit(lease)."""
        return self._ranges_for(self.call(RESERVE, self._reserve_body(ns, keys, sizes,
                                                                     salt, labels))[0])

    # The same requests in two halves, to overlap the daemon's work (and the round trip) with
    # the caller's copies: each sends its request and returns a function that waits for the
    # reply (at most timeout_ms) and answers as the one-call form does. The raw layer:
    # nothing is re-established on the way (InstanceDropped reaches the caller), and each
    # returned function must be called once, else its reply is kept until close().

    def reserve_offsets_begin(self, ns, keys, sizes, salt=None, labels=None):
        uid = self.send(RESERVE, self._reserve_body(ns, keys, sizes, salt, labels))
        return lambda: self._ranges_for(self.recv(uid)[0])

    def acquire_offsets_begin(self, ns, keys, salt=None):
        self._need_arena("ACQUIRE")
        uid = self.send(ACQUIRE, self._keyed(ns, keys, salt))
        return lambda: self._ranges_for(self.recv(uid)[0])

    def commit_begin(self, lease, failed=()):
        body = {"lease": lease}
        if failed:
            body["failed"] = list(failed)
        uid = self.send(COMMIT, body)

        def end():
            try:
                return self.recv(uid)[0].get("stored", 0)
            finally:
                self._drop_views(lease)
        return end

    def commit(self, lease, failed=()):
        """COMMIT -> stored (objects that became readable). `failed`: indices (into the
        RESERVE's keys) whose bytes could not be written; they are discarded. The write views
        of the lease are released."""
        body = {"lease": lease}
        if failed:
            body["failed"] = list(failed)
        try:
            r = self.call(COMMIT, body)[0]
        except (LeaseExpired, UnknownLease):
            self._drop_views(lease)
            raise
        self._drop_views(lease)
        return r.get("stored", 0)

    def acquire(self, ns, keys, salt=None):
        """ACQUIRE -> Acquired(views, lease): read-only memoryviews into the arena (zero-copy)
        for the leading keys found in L1, pinned until release(lease). lease is 0 when none
        was found."""
        self._need_arena("ACQUIRE")
        views, lease = self._views_for(self.call(ACQUIRE, self._keyed(ns, keys, salt))[0],
                                       False)
        return Acquired(views, lease)

    def acquire_offsets(self, ns, keys, salt=None):
        """acquire() answering Slots: (offset, length) into .arena of the leading keys found in
        L1, pinned until release(lease). Read them through your own view of .arena and do not
        write: other readers share the bytes."""
        self._need_arena("ACQUIRE")
        return self._ranges_for(self.call(ACQUIRE, self._keyed(ns, keys, salt))[0])

    def release(self, lease):
        """RELEASE: ends a read lease (ACQUIRE, LOOKUP lock) or abandons a write lease
        (RESERVE). Releases its views. A lease of 0 (nothing was pinned) is a no-op."""
        if not lease:
            return
        try:
            self.call(RELEASE, {"lease": lease})
        except (LeaseExpired, UnknownLease):
            self._drop_views(lease)
            raise
        self._drop_views(lease)

    @contextlib.contextmanager
    def acquired(self, ns, keys, salt=None):
        """with client.acquired(ns, keys) as views: ... — ACQUIRE, then RELEASE on exit."""
        views, lease = self.acquire(ns, keys, salt)
        try:
            yield views
        except BaseException:
            with contextlib.suppress(KvtierError):
                self.release(lease)
            raise
        self.release(lease)

    @contextlib.contextmanager
    def reserved(self, ns, keys, sizes, salt=None, labels=None):
        """with client.reserved(ns, keys, sizes) as slots: write into the non-None slots.
        COMMIT on a normal exit; on an exception the reservation is abandoned (RELEASE)."""
        slots, lease = self.reserve(ns, keys, sizes, salt, labels)
        try:
            yield slots
        except BaseException:
            with contextlib.suppress(KvtierError):
                self.release(lease)
            raise
        if lease:
            self.commit(lease)

    def store(self, ns, keys, datas, salt=None, labels=None):
        """RESERVE + copy into the arena + COMMIT: stores the objects that are not stored yet
        (up to what fits). Returns how many became readable."""
        datas = list(datas)
        slots, lease = self.reserve(ns, keys, [len(d) for d in datas], salt, labels)
        if not lease:
            return 0
        for slot, d in zip(slots, datas):
            if slot is not None:
                slot[:] = d
        return self.commit(lease)

    def fetch(self, ns, keys, salt=None):
        """ACQUIRE + copy out + RELEASE -> list of bytes of the leading keys found in L1."""
        with self.acquired(ns, keys, salt) as views:
            return [bytes(v) for v in views]

    def put(self, ns, keys, datas, salt=None, labels=None):
        """PUT: the bytes ride the socket (one raw frame per key) — for clients without the
        arena, or small objects. Returns `stored` (new objects only). `labels` as for
        reserve()."""
        return self.call(PUT, self._keyed(ns, keys, salt, labels),
                         list(datas))[0].get("stored", 0)

    def get(self, ns, keys, salt=None, copy=True):
        """GET -> the bytes of the leading keys found, in key order (a list of bytes; of
        zero-copy memoryviews with copy=False). The daemon may stop early to keep the reply
        under max_message: ask again for the rest when the list is short."""
        body, data = self.call(GET, self._keyed(ns, keys, salt), copy=copy)
        found = body.get("found", len(data))
        if found != len(data):
            raise ProtocolError("GET reply says found %r but carries %d data frames"
                                % (found, len(data)))
        return data

    def remove(self, ns, keys, salt=None):
        """REMOVE -> removed."""
        return self.call(REMOVE, self._keyed(ns, keys, salt))[0].get("removed", 0)

    def clear(self, ns=None):
        """CLEAR (one namespace, or everything when ns is None) -> removed."""
        return self.call(CLEAR, {} if ns is None else {"ns": ns})[0].get("removed", 0)

    def hash_tokens(self, tokens, chunk_tokens=None, salt=None):
        """HASH_TOKENS, computed by the daemon -> list of 16-byte keys of the full chunks.
        chunk_tokens defaults to the daemon's (HELLO's chunk_tokens)."""
        body = {"tokens": hashing.token_bytes(tokens, check=False)}
        if chunk_tokens is not None:
            body["chunk_tokens"] = chunk_tokens
        if salt:
            body["salt"] = salt
        return self.call(HASH_TOKENS, body)[0].get("keys", [])

    # -- GPU KV cache (CUDA IPC; docs/protocol.md) ----------------------------------------

    def register_gpu(self, device, handles, num_blocks, block_tokens, token_bytes, dtype,
                     offsets=None):
        """REGISTER_GPU: one 64-byte cudaIpcMemHandle_t (bytes) per layer buffer, with its byte
        offset in that allocation (offsets, default 0). Raises Unavailable without a GPU."""
        body = {"device": device, "layers": len(handles), "num_blocks": num_blocks,
                "block_tokens": block_tokens, "token_bytes": token_bytes, "dtype": dtype,
                "handles": [bytes(h) for h in handles]}
        if offsets is not None:
            body["offsets"] = list(offsets)
        reply = self.call(REGISTER_GPU, body)[0]
        self._gpu[device] = [body, True]      # said again if the instance is re-established
        return reply

    def unregister_gpu(self, device):
        """UNREGISTER_GPU; raises NotFound when this instance has no registration there
        (returns when the instance had been dropped: the registration went with it)."""
        self._gpu.pop(device, None)
        try:
            self.call(UNREGISTER_GPU, {"device": device})
        except InstanceDropped:
            pass                               # re-established without it: gone, as asked

    def _register_again(self, entry):
        try:
            self._call_once(REGISTER_GPU, entry[0])
            entry[1] = True
        except KvtierError as e:
            entry[1] = False
            return e
        return None

    def _gpu_ready(self, type_, device):
        """Before STORE_GPU / RETRIEVE_GPU: a registration that could not be said again when
        the instance was re-established is tried once more; failing, the call fails saying
        why (rather than the daemon's bare "send REGISTER_GPU first")."""
        if self._hb is not None and self._hb.dropped:
            self._revive()
        entry = self._gpu.get(device)
        if entry is None or entry[1]:
            return
        e = self._register_again(entry)
        if e is not None:
            raise error_for(e.code, "the GPU registration of device %d was lost with the "
                            "instance, and registering it again failed: %s"
                            % (device, e.message), type_) from e

    def _gpu_copy(self, ns, keys, block_ids, device, salt, event):
        body = self._keyed(ns, keys, salt)
        body["device"] = device
        body["block_ids"] = list(block_ids)
        if event is not None:
            body["event"] = bytes(event)
        return body

    def store_gpu(self, ns, keys, block_ids, device=0, salt=None, event=None):
        """STORE_GPU: chunk i of keys is blocks block_ids[i*per:(i+1)*per] (per =
        len(block_ids) // len(keys)); event: a 64-byte cudaIpcEventHandle_t to wait for.
        -> stored."""
        body = self._gpu_copy(ns, keys, block_ids, device, salt, event)
        self._gpu_ready(STORE_GPU, device)
        return self.call(STORE_GPU, body)[0].get("stored", 0)

    def retrieve_gpu(self, ns, keys, block_ids, device=0, salt=None, event=None):
        """RETRIEVE_GPU: the leading chunks found in L1 written into their blocks -> found."""
        body = self._gpu_copy(ns, keys, block_ids, device, salt, event)
        self._gpu_ready(RETRIEVE_GPU, device)
        return self.call(RETRIEVE_GPU, body)[0].get("found", 0)

    def chunk_keys(self, tokens, chunk_tokens=None, salt=None):
        """The chunk keys of `tokens`: computed locally when xxhash is installed, else asked
        of the daemon. chunk_tokens defaults to the daemon's."""
        if chunk_tokens is None:
            chunk_tokens = self.chunk_tokens
        if hashing.have_xxhash():
            return hashing.hash_tokens(tokens, chunk_tokens, salt)
        return self.hash_tokens(tokens, chunk_tokens, salt)


def _now_ms():
    return time.monotonic() * 1000.0


def _error(body):
    """(code, message) of a failed reply body; (None, "") when it is ok."""
    if body.get("ok"):
        return None, ""
    err = body.get("error") or {}
    return err.get("code", "internal"), err.get("message", "")
