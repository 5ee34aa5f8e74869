"""Subscriber: the daemon's cache events (kvtierd --events ENDPOINT), for cache-aware routers;
EmbeddingEvents: the same events as a multimodal-embedding coordinator wants them.

Each event is one ZeroMQ message of one frame, a msgpack map (docs/protocol.md, "Events"):

    {"event": "stored" | "evicted" | "removed" | "l2_stored" | "l2_removed",
     "ns": str, "salt": str ("" for none), "keys": [16-byte bytes], "tier": "l1" | "l2",
     "sizes": [int]          each object's bytes (every event but l2_removed),
     "labels": [str | None]  the labels the objects were stored with (RESERVE/PUT `labels`;
                             only when one of them has one)}

one per request per (ns, salt): COMMIT / PUT -> stored (the keys that became readable),
REMOVE / CLEAR -> removed, eviction -> evicted (one per eviction round), an L2 write batch ->
l2_stored, an L2 removal -> l2_removed. The daemon never waits for a subscriber: when one
falls behind by more than the high-water mark, its events are dropped (counted in
kvtier_events_dropped_total). ZeroMQ subscriptions take a moment to reach the publisher, so
events published right after connect() may be missed.

Like Client, a Subscriber is not thread-safe: one per thread.
"""

import collections
import re

import msgpack
import zmq

from .errors import ProtocolError

__all__ = ["Subscriber", "EmbeddingEvents", "ec_namespace", "parse_ec_namespace"]

EC_PREFIX = "vllm-ec/"
_HIDDEN = re.compile(r"h([0-9]+)\Z")


def ec_namespace(namespace, dtype, hidden=None):
    """The namespace kvtier.vllm stores an engine's embeddings in:
    "<namespace>/<dtype>[/h<hidden size>]", namespace being "vllm-ec/<model>" unless the
    connector's config names one."""
    ns = "%s/%s" % (namespace, dtype)
    return ns if hidden is None else "%s/h%d" % (ns, int(hidden))


def parse_ec_namespace(ns):
    """ec_namespace's inverse: {"namespace", "model", "dtype", "hidden"} (model: what follows
    "vllm-ec/", or the whole namespace when the connector was given another; hidden: None when
    the engine had none), or None for a namespace that is not one."""
    parts = ns.split("/")
    hidden = None
    m = _HIDDEN.match(parts[-1]) if len(parts) >= 3 else None
    if m:
        hidden = int(m.group(1))
        parts.pop()
    if len(parts) < 2 or not parts[-1] or not parts[0]:
        return None
    namespace, dtype = "/".join(parts[:-1]), parts[-1]
    model = namespace[len(EC_PREFIX):] if namespace.startswith(EC_PREFIX) else namespace
    return {"namespace": namespace, "model": model, "dtype": dtype, "hidden": hidden}


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


# daemon event -> (coordinator event, tier)
_EMBED_KIND = {"stored": ("add", "l1"), "l2_stored": ("add", "l2"),
               "evicted": ("evict", "l1"), "removed": ("evict", "l1"),
               "l2_removed": ("evict", "l2")}


class EmbeddingEvents:
    """The daemon's events on the embeddings of vLLM engines (kvtier.vllm's namespaces) as a
    coordinator or router tracks them, one dict per item:

        {"event": "add" | "evict", "mm_hash": str | None, "model": str, "tier": "l1" | "l2",
         "size": int | None, "key": 16 bytes, "dtype": str, "hidden": int | None,
         "namespace": str, "salt": str, "cause": the daemon's event name}

    "evict" is every way out of a tier: eviction, REMOVE or CLEAR ("cause" says which). The
    mm_hash is the label the connector stored the item with; events that carry no label (L2
    events, and an item brought back from L2) get the name an earlier event of the same key
    gave, remembered for the last `max_names` keys; None when there was none (the coordinator
    can still match kvtier.hashing.name_key(mm_hash) against "key"). Other namespaces are
    skipped unless `prefix` is "" (then every namespace is parsed as ec_namespace's shape,
    and those that are not have model None).

    events = EmbeddingEvents("ipc:///run/kvtier/events.sock")
    for e in events:                   # or events.recv(timeout_ms) -> list, None on timeout
        table[e["model"], e["mm_hash"]][e["tier"]] = e["event"] == "add"
    """

    def __init__(self, endpoint, prefix=EC_PREFIX, max_names=1 << 20, rcvhwm=None,
                 context=None):
        self.prefix = prefix
        self.max_names = max_names
        self._names = collections.OrderedDict()   # (ns, salt, key) -> mm_hash
        # endpoint None: no socket, for a caller that feeds translate() its own events
        self.subscriber = None if endpoint is None else \
            Subscriber(endpoint, rcvhwm=rcvhwm, context=context)

    def translate(self, ev):
        """One daemon event (Subscriber.recv's dict) -> a list of item dicts (empty for
        another namespace or kind)."""
        kind = _EMBED_KIND.get(ev.get("event"))
        ns = ev.get("ns")
        if kind is None or not isinstance(ns, str) or not ns.startswith(self.prefix):
            return []
        where = parse_ec_namespace(ns) or {"namespace": ns, "model": None, "dtype": None,
                                           "hidden": None}
        keys = ev.get("keys") or []
        sizes = ev.get("sizes") or ()
        labels = ev.get("labels") or ()
        salt = ev.get("salt", "")
        out = []
        for i, key in enumerate(keys):
            key = bytes(key)
            size = sizes[i] if i < len(sizes) else None
            label = labels[i] if i < len(labels) else None
            if label is not None:
                self._remember((ns, salt, key), label)
            else:
                label = self._names.get((ns, salt, key))
            out.append({"event": kind[0], "mm_hash": label, "model": where["model"],
                        "tier": kind[1], "size": size, "key": key, "dtype": where["dtype"],
                        "hidden": where["hidden"], "namespace": where["namespace"],
                        "salt": salt, "cause": ev["event"]})
        return out

    def _remember(self, key, name):
        names = self._names
        names[key] = name
        names.move_to_end(key)
        while len(names) > self.max_names:
            names.popitem(last=False)

    def recv(self, timeout_ms=None):
        """The items of the next daemon event (a list, maybe empty), or None when no event
        arrives within timeout_ms (None: wait forever)."""
        if self.subscriber is None:
            raise ValueError("EmbeddingEvents(None) has no socket: call translate(event)")
        ev = self.subscriber.recv(timeout_ms)
        return None if ev is None else self.translate(ev)

    def drain(self, timeout_ms=0):
        """Every item of the events that arrive until none comes for timeout_ms -> list."""
        out = []
        while True:
            items = self.recv(timeout_ms)
            if items is None:
                return out
            out.extend(items)

    def __iter__(self):
        while True:
            yield from self.recv()

    def close(self):
        if self.subscriber is not None:
            self.subscriber.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
