"""A fake kvtier daemon that offers libkvtier the fast path, for what the real daemon cannot be
made to do on cue: answer late, close the ring pair while a request is on it or while idle,
answer instance_dropped on either transport, offer a pair that does not check out.

It is one Python thread with a ROUTER socket and, when a pair is open, the daemon's sides of
it (consumer of the request ring, producer of the reply ring) through libkvtier's own
kvtier_ring_* (ctypes). The arena is a plain file of 1 MiB of "L1"; the pair is a memfd of its
own handed over as kvtierd does (a ticket in HELLO's offer, the descriptor over a unix socket,
the connection kept open while the pair is), packed as one region (the reply ring right after
the request ring, so its offset is 8- but not 4096-aligned).
Ring replies go out in order, each when due (`delay_next_ring`, RELEASE always 0.3 s late), so
a late reply is still queued when the client's next request comes. What the client did wrong
goes into `problems`; the driver asserts it is empty.
"""

import ctypes
import mmap
import os
import secrets
import socket
import struct
import threading
import time

import msgpack
import zmq

MAGIC = 0x31474E495254564B
HDR = 384
OFF_PROD_CLOSED = 140   # the client's side of the request ring
OFF_CONS_CLOSED = 268   # the client's side of the reply ring
EBUSY, EUNAVAIL = -9, -11
HELLO, BYE, PING, RELEASE, STATS = 1, 2, 3, 9, 14
RELEASE_DELAY_S = 0.3


def _lib(path):
    lib = ctypes.CDLL(path)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.kvtier_ring_attach.restype = vp
    lib.kvtier_ring_attach.argtypes = [vp, sz, ctypes.c_uint32, ctypes.c_int, ctypes.c_char_p, sz]
    lib.kvtier_ring_detach.argtypes = [vp]
    lib.kvtier_ring_push.argtypes = [vp, ctypes.POINTER(vp), ctypes.POINTER(sz), ctypes.c_uint32]
    lib.kvtier_ring_pop.argtypes = [vp, vp, sz, ctypes.POINTER(sz)]
    lib.kvtier_ring_wait.argtypes = [vp, sz, ctypes.c_int64]
    lib.kvtier_ring_close.argtypes = [vp]
    return lib


def _frames(payload):
    (count,) = struct.unpack_from("<I", payload, 0)
    pos, out = 4, []
    for _ in range(count):
        (n,) = struct.unpack_from("<I", payload, pos)
        out.append(payload[pos + 4:pos + 4 + n])
        pos += 4 + n
    assert pos == len(payload), "trailing bytes in a ring record"
    return out


class FakeFastpathDaemon:
    """offer: "ok" (a pair when asked), "bad" (a misaligned pair), "old" (no map_size, no
    pair: a daemon that predates the fast path)."""

    def __init__(self, libpath, tmpdir, offer="ok", capacity=4096, l1=1 << 20):
        self.lib = _lib(libpath)
        self.offer = offer
        self.ipc = "ipc://" + os.path.join(tmpdir, "fake.sock")
        self.arena_path = os.path.join(tmpdir, "arena")
        self.l1, self.cap = l1, capacity
        self.region = HDR + capacity
        self.req_off, self.rep_off = 0, self.region
        self.map_size = l1
        self.pair_size = (2 * self.region + 4095) // 4096 * 4096
        with open(self.arena_path, "wb") as f:
            f.truncate(self.map_size)
        self.pair_fd = os.memfd_create("fake-pair")
        os.ftruncate(self.pair_fd, self.pair_size)
        self.mm = mmap.mmap(self.pair_fd, self.pair_size)
        self.handoff_path = os.path.join(tmpdir, "handoff.sock")
        self.hsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.hsock.bind(self.handoff_path)
        self.hsock.listen(4)
        self.hsock.setblocking(False)
        self.hconn = None   # the client's handoff connection while it holds the pair
        self.ticket = None
        self._view = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._view)
        self.log = []       # (transport, type) of every request
        self.hellos = []    # HELLO bodies
        self.problems = []
        self.pair = None    # (request consumer, reply producer)
        self.pending = []   # [due, frames] of ring replies, sent in order
        # armed by the driver while the scenario is paused
        self.delay_next_ring = 0.0
        self.fail_next_ring = None
        self.close_next_ring = False
        self.fail_next_zmq = None
        self.ring_dead = False  # pops nothing, closes nothing: a daemon that died
        self.close_idle = threading.Event()
        self.closed_idle = threading.Event()
        self._stop = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-kvtierd", daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the fake daemon did not start"

    # -- what the tests look at ----------------------------------------------------------

    def client_closed(self):
        """The client's closed flags: (request ring producer, reply ring consumer)."""
        return (struct.unpack_from("<I", self.mm, self.req_off + OFF_PROD_CLOSED)[0],
                struct.unpack_from("<I", self.mm, self.rep_off + OFF_CONS_CLOSED)[0])

    def stderr_tail(self, n=30):
        return "fake daemon: problems %r\nlast requests %r" % (self.problems, self.log[-n:])

    def stop(self):
        self._stop = True
        self._thread.join(10)
        self._drop_pair()
        del self._view
        self.mm.close()
        os.close(self.pair_fd)
        self.hsock.close()

    # -- the pair ----------------------------------------------------------------------------

    def _format(self, off):
        self.mm[off:off + self.region] = bytes(self.region)
        struct.pack_into("<QIII", self.mm, off, MAGIC, 1, HDR, self.cap)

    def _open_pair(self):
        self._format(self.req_off)
        self._format(self.rep_off)
        err = ctypes.create_string_buffer(160)
        req = self.lib.kvtier_ring_attach(self.base + self.req_off, self.region, self.cap, 0, err,
                                          160)
        rep = self.lib.kvtier_ring_attach(self.base + self.rep_off, self.region, self.cap, 1, err,
                                          160)
        assert req and rep, err.value
        self.pair = (req, rep)

    def _drop_pair(self):
        if self.pair:
            for r in self.pair:
                self.lib.kvtier_ring_close(r)
                self.lib.kvtier_ring_detach(r)
        self.pair = None
        if self.hconn:
            self.hconn.close()
            self.hconn = None
        self.pending = []

    def _push(self, frames):
        if not self.pair:
            return
        n = len(frames)
        bufs = [ctypes.create_string_buffer(f, len(f)) for f in frames]
        ptrs = (ctypes.c_void_p * n)(*[ctypes.addressof(b) for b in bufs])
        lens = (ctypes.c_size_t * n)(*[len(f) for f in frames])
        deadline = time.monotonic() + 2
        while True:
            rc = self.lib.kvtier_ring_push(self.pair[1], ptrs, lens, n)
            if rc != EBUSY or time.monotonic() > deadline:
                break
            self.lib.kvtier_ring_wait(self.pair[1], 64, 10_000_000)
        if rc not in (0, EUNAVAIL):
            self.problems.append("push of a reply failed: %d" % rc)

    def _flush(self):
        now = time.monotonic()
        while self.pending and self.pending[0][0] <= now:
            self._push(self.pending.pop(0)[1])

    # -- requests --------------------------------------------------------------------------

    def _hello(self, body):
        self.hellos.append(body)
        self.ring_dead = False
        if self.pair and self.client_closed() != (1, 1):
            self.problems.append("HELLO while the client's sides of its pair are open: %r"
                                 % (self.client_closed(),))
        self._drop_pair()
        reply = {"ok": True, "version": 1, "server": "fake", "chunk_tokens": 256,
                 "lease_ms": 60000, "max_message": 1 << 20, "token": "f" * 32,
                 "shm": {"path": self.arena_path, "size": self.l1}}
        if self.offer == "old":
            return reply
        reply["shm"]["map_size"] = self.map_size
        if not body.get("fastpath"):
            return reply
        self.ticket = secrets.token_hex(16)
        reply["fastpath"] = {"socket": self.handoff_path, "ticket": self.ticket,
                             "size": self.pair_size, "request": self.req_off,
                             "reply": self.rep_off, "capacity": self.cap}
        if self.offer == "bad":
            reply["fastpath"]["request"] = self.req_off + 4
            return reply
        self._open_pair()
        return reply

    def _handoff(self):
        """A client collecting its pair: the descriptor for the current ticket."""
        try:
            conn, _ = self.hsock.accept()
        except BlockingIOError:
            return
        conn.settimeout(2)
        got = b""
        while len(got) < 32:
            b = conn.recv(32 - len(got))
            if not b:
                break
            got += b
        if self.ticket and got == self.ticket.encode():
            socket.send_fds(conn, [b"K"], [self.pair_fd])
            self.ticket = None
            if self.hconn:
                self.hconn.close()
            self.hconn = conn
        else:
            self.problems.append("a handoff with ticket %r (expected %r)" % (got, self.ticket))
            conn.sendall(b"Eno such ticket")
            conn.close()

    def _handle(self, transport, typ, body):
        """The reply body, or None for no reply."""
        self.log.append((transport, typ))
        if typ == HELLO:
            return self._hello(body)
        if typ == BYE:
            if self.pair and self.client_closed() != (1, 1):
                self.problems.append("BYE while the client's sides of its pair are open")
            self._drop_pair()
            return {"ok": True, "released": 0}
        if transport == "ring" and self.close_next_ring:
            self.close_next_ring = False
            self._drop_pair()
            return None
        fail = self.fail_next_ring if transport == "ring" else self.fail_next_zmq
        if fail:
            self.fail_next_ring = self.fail_next_zmq = None
            return {"ok": False, "error": {"code": fail, "message": "fake: " + fail}}
        unread = (self.pair and not self.ring_dead and
                  self.lib.kvtier_ring_wait(self.pair[0], 0, 0) == 0)
        if transport == "zmq" and (self.pending or unread):
            self.problems.append("type %d over the socket while the ring had %s"
                                 % (typ, "a request unread" if unread else "replies due"))
        return {"ok": True, "transport": transport, "type": typ}

    def _reply_frames(self, uid, typ, reply):
        return [uid, msgpack.packb(typ), msgpack.packb(reply, use_bin_type=True)]

    def _zmq(self, sock, msg):
        rid, uid, typ = msg[0], msg[1], msgpack.unpackb(msg[2])
        reply = self._handle("zmq", typ, msgpack.unpackb(msg[3], raw=False))
        if reply is not None:
            sock.send_multipart([rid] + self._reply_frames(uid, typ, reply))

    def _ring(self, payload):
        fr = _frames(payload)
        uid, typ = fr[0], msgpack.unpackb(fr[1])
        body = msgpack.unpackb(fr[2], raw=False)
        delay, self.delay_next_ring = self.delay_next_ring, 0.0
        if typ == RELEASE:
            delay = RELEASE_DELAY_S
        reply = self._handle("ring", typ, body)
        if reply is not None and self.pair:
            self.pending.append([time.monotonic() + delay, self._reply_frames(uid, typ, reply)])

    def _run(self):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.bind(self.ipc)
        self._ready.set()
        buf = ctypes.create_string_buffer(self.cap)
        n = ctypes.c_size_t()
        try:
            while not self._stop:
                if self.close_idle.is_set():
                    self.close_idle.clear()
                    self._drop_pair()
                    self.closed_idle.set()
                self._flush()
                self._handoff()
                if sock.poll(1):
                    self._zmq(sock, sock.recv_multipart())
                if not self.pair or self.ring_dead:
                    continue
                rc = self.lib.kvtier_ring_wait(self.pair[0], 0, 1_000_000)
                if rc == EUNAVAIL:  # the client closed its side: drop the pair, as kvtierd does
                    self._drop_pair()
                elif rc == 0 and self.lib.kvtier_ring_pop(self.pair[0], buf, self.cap,
                                                          ctypes.byref(n)) == 0:
                    self._ring(buf.raw[:n.value])
        except Exception as e:  # noqa: BLE001 - reported to the driver
            self.problems.append("fake daemon crashed: %r" % e)
        finally:
            sock.close()
            ctx.term()
