"""Heartbeat: keeps an idle Client's instance alive (docs/protocol.md, "Client liveness").

The daemon drops a client instance that sends nothing for lease_ms, with its leases and GPU
registrations. A Heartbeat is a daemon thread ("kvtier-heartbeat") with a DEALER socket of its
own on the Client's zmq context: the Client's socket is never touched here (a zmq socket is not
thread-safe). One interval after it starts (so a short-lived Client never opens its
connection) it joins the instance with HELLO {instance, token}, then sends PING {instance}
every interval. Every wait also watches a pipe, so stop() ends it at once, daemon or no daemon;
ZMQ_IMMEDIATE keeps PINGs from queueing while the daemon is away.

What it learns reaches the Client through `dropped`, which the Client reads before each call:
a PING answered instance_dropped, or its HELLO found the instance gone and made it anew (then
token() is the new instance's). It never re-creates an instance it lost on its own account:
the Client's HELLO does that, re-registers the GPU layouts, and publish()es the new token.
"""

import os
import select
import threading
import time

import msgpack
import zmq

from . import curve as _curve

__all__ = ["Heartbeat", "interval_ms"]

_HELLO = 1
_PING = 3
_PROTO_VERSION = 1


def interval_ms(heartbeat_ms, lease_ms):
    """The interval in ms (0: no heartbeat) and whether it was chosen (not derived from
    lease_ms): heartbeat_ms if given, else KVTIER_HEARTBEAT_MS, else lease_ms / 3 within
    [100 ms, 10 s] (10 s without a lease_ms). A chosen interval is at least 10 ms."""
    if heartbeat_ms is None:
        env = os.environ.get("KVTIER_HEARTBEAT_MS", "").strip()
        if env.isdigit():
            heartbeat_ms = int(env)
    if heartbeat_ms is not None:
        heartbeat_ms = int(heartbeat_ms)
        if heartbeat_ms < 0:
            raise ValueError("heartbeat_ms must be 0 (no heartbeat) or positive")
        return (max(10, heartbeat_ms) if heartbeat_ms else 0), True
    ms = lease_ms // 3 if lease_ms else 10000
    return min(10000, max(100, ms)), False


def _pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


class Heartbeat:
    """The heartbeat thread of one Client. Only the Client's thread calls its methods."""

    def __init__(self, context, endpoint, client, instance, token, interval, timeout_ms,
                 curve_serverkey=None, curve_cert=None):
        self.interval_ms = interval
        self._ctx = context
        self._endpoint = endpoint
        self._client = client
        self._instance = instance
        self._timeout_ms = timeout_ms
        self._curve = (curve_serverkey, curve_cert)
        self._cond = threading.Condition()   # guards _token, _gen, _busy
        self._token = token
        self._gen = 1                         # bumped by the Client after each HELLO it said
        self._busy = False                    # the heartbeat's own HELLO is on the wire
        self.dropped = False                  # set here, cleared by publish()
        self._stop = False
        self._pid = os.getpid()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._thread = threading.Thread(target=self._run, name="kvtier-heartbeat", daemon=True)
        self._thread.start()

    # -- the Client's side ------------------------------------------------------------------

    def mine(self):
        """False in a child forked after the Client connected: the thread is the parent's."""
        return self._pid == os.getpid()

    def token(self):
        with self._cond:
            return self._token

    def newer_token(self, presented, timeout_s):
        """After the Client's HELLO was refused: waits (bounded) for a HELLO of the heartbeat
        in flight (it may be making the instance anew) and returns its token when it differs
        from `presented`, else None."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy, timeout_s)
            return self._token if self._token != presented else None

    def publish(self, token, interval=None):
        """After a HELLO of the Client: the heartbeat joins with `token` now."""
        with self._cond:
            if interval:
                self.interval_ms = interval
            self._token = token
            self._gen += 1
            self.dropped = False
        self._wake()

    def alive(self):
        return self._thread.is_alive()

    def request_stop(self):
        """Tells the thread to stop, without waiting (for a Client collected unclosed)."""
        if self.mine() and self._wfd >= 0:
            self._stop = True
            self._wake()

    def stop(self, timeout_s=5.0):
        """Stops and joins the thread (it wakes at once), then closes the pipe."""
        if self.mine() and self._thread.is_alive():
            self.request_stop()
            self._thread.join(timeout_s)
        if self.mine() and self._thread.is_alive():
            return          # cannot happen: every wait watches the pipe; keep its fds then
        for fd in (self._rfd, self._wfd):
            try:
                os.close(fd)
            except OSError:
                pass
        self._rfd = self._wfd = -1

    def _wake(self):
        try:
            os.write(self._wfd, b"x")
        except (BlockingIOError, OSError):
            pass                       # a full pipe already wakes it

    # -- the thread -------------------------------------------------------------------------

    def _drain(self):
        try:
            while os.read(self._rfd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _sleep(self, ms):
        """Sleeps up to ms unless woken. False when the heartbeat must stop."""
        if select.select([self._rfd], [], [], ms / 1000.0)[0]:
            self._drain()
        return not self._stop

    def _wait(self, sock, event, ms):
        """(ready, woken): waits up to ms for sock to be ready for `event`. A wake ends the
        wait and sets woken: a stop, or a new token to act on at once (a request still
        unanswered then is given up; its late reply is skipped as stale)."""
        poller = zmq.Poller()
        poller.register(sock, event)
        poller.register(self._rfd, zmq.POLLIN)
        deadline = time.monotonic() + ms / 1000.0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False, False
            events = dict(poller.poll(int(left * 1000) + 1))
            if self._rfd in events:
                self._drain()
                return False, True
            if sock in events:
                return True, False

    def _socket(self):
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            _curve.apply(sock, self._endpoint, *self._curve)
            sock.connect(self._endpoint)
        except Exception:             # noqa: BLE001 - tried again next interval
            sock.close(linger=0)
            return None
        return sock

    def _exchange(self, sock, uid, type_, body):
        """(reply body or None, woken): one request and its reply. It waits an interval to
        send (no connection: no beat) and an interval (at most timeout_ms) for the reply: a
        daemon that restarted lost it, and the next beat asks again."""
        ready, woken = self._wait(sock, zmq.POLLOUT, self.interval_ms)
        if not ready:
            return None, woken
        try:
            sock.send_multipart([_pack(uid), _pack(type_), _pack(body)], flags=zmq.DONTWAIT)
        except zmq.Again:
            return None, woken
        deadline = time.monotonic() + min(self.interval_ms, self._timeout_ms) / 1000.0
        while True:
            ready, woken = self._wait(sock, zmq.POLLIN, (deadline - time.monotonic()) * 1000.0)
            if not ready:
                return None, woken
            try:
                frames = sock.recv_multipart(flags=zmq.DONTWAIT)
                if len(frames) < 3 or msgpack.unpackb(frames[0]) != uid:
                    continue                 # a stale reply (its wait timed out)
                reply = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
            except zmq.Again:
                continue
            except Exception:            # noqa: BLE001 - an undecodable reply: no answer
                return None, woken
            return (reply if isinstance(reply, dict) else None), woken

    def _joined(self, gen, presented, reply):
        """After the heartbeat's HELLO: True when it joined. Another token than the one it
        presented means the instance was gone and this HELLO made it anew: the Client must
        join that one and re-register."""
        with self._cond:
            ok = bool(reply and reply.get("ok"))
            token = reply.get("token") if ok else None
            if ok and isinstance(token, str) and token != presented and self._gen == gen:
                self._token = token
                self.dropped = True
            self._busy = False
            self._cond.notify_all()
            return ok

    def _lost(self, gen):
        """PING answered instance_dropped; a HELLO of the Client since has answered it."""
        with self._cond:
            if self._gen == gen:
                self.dropped = True

    def _run(self):
        sock = None
        uid = joined = dead = 0
        woken = False
        try:
            while woken or self._sleep(self.interval_ms):
                woken = False
                if self._stop:
                    break
                if sock is None:
                    sock = self._socket()
                    if sock is None:
                        continue
                with self._cond:
                    gen, token = self._gen, self._token
                    hello = gen != joined and gen != dead
                    self._busy = hello
                if gen == dead:
                    continue               # the Client's next call says HELLO; gen moves on
                uid += 1
                if hello:
                    body = {"version": _PROTO_VERSION, "client": self._client,
                            "instance": self._instance}
                    if token:
                        body["token"] = token
                    reply, woken = self._exchange(sock, uid, _HELLO, body)
                    if self._joined(gen, token, reply):
                        joined = gen
                else:
                    reply, woken = self._exchange(sock, uid, _PING, {"instance": self._instance})
                    code = ((reply or {}).get("error") or {}).get("code")
                    if reply is not None and not reply.get("ok") and code == "instance_dropped":
                        self._lost(gen)
                        dead = gen
        except zmq.ZMQError:
            pass                           # the context was terminated under it
        finally:
            if sock is not None:
                sock.close(linger=0)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
