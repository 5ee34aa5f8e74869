"""Subscriber: the daemon's cache events (kvtierd --events ENDPOINT), for cache-aware routers.

Each event is one ZeroMQ message of one frame, a msgpack map:

    {"event": "stored" | "evicted" | "removed", "ns": str, "salt": str ("" for none),
     "keys": [16-byte bytes], "tier": "l1"}

one per request per (ns, salt): COMMIT / PUT -> stored (the keys that became readable),
REMOVE / CLEAR -> removed, eviction -> evicted (one per eviction round). The daemon never
waits for a subscriber: when one falls behind by more than the high-water mark, its events
are dropped (counted in kvtier_events_dropped_total). ZeroMQ subscriptions take a moment to
reach the publisher, so events published right after connect() may be missed.

Like Client, a Subscriber is not thread-safe: one per thread.
"""

import msgpack
import zmq

from .errors import ProtocolError

__all__ = ["Subscriber"]


class Subscriber:
    """SUB socket connected to the events endpoint, subscribed to everything.

    rcvhwm   ZMQ_RCVHWM (messages queued in this process before the publisher side fills)
    context  a zmq.Context (default: the process-wide zmq.Context.instance())
    """

    def __init__(self, endpoint, rcvhwm=None, context=None):
        self.endpoint = endpoint
        ctx = context or zmq.Context.instance()
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)

    def recv(self, timeout_ms=None):
        """The next event as a dict, or None when none arrives within timeout_ms (None: wait
        forever; 0: only what is already queued)."""
        if timeout_ms is not None and not self._sock.poll(max(0, int(timeout_ms)), zmq.POLLIN):
            return None
        frames = self._sock.recv_multipart()
        try:
            ev = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        except Exception as e:            # noqa: BLE001
            raise ProtocolError("event does not decode: %s" % e) from None
        if not isinstance(ev, dict) or len(frames) != 1:
            raise ProtocolError("event is not one msgpack map: %r" % (frames[:2],))
        return ev

    def drain(self, timeout_ms=0):
        """Every event that arrives until none comes for timeout_ms -> list."""
        out = []
        while True:
            ev = self.recv(timeout_ms)
            if ev is None:
                return out
            out.append(ev)

    def __iter__(self):
        while True:
            yield self.recv()

    def close(self):
        self._sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
