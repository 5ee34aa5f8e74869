"""kvtier: Python client for the kvtier node-local KV-cache daemon (wire protocol v1).

    import kvtier
    with kvtier.Client("ipc:///run/kvtier/kvtier.sock", client="vllm") as c:
        keys = c.chunk_keys(token_ids)                 # chained XXH3-128 per chunk
        hit = c.lookup("llama-3-8b/kv-v1", keys).hits
        slots, lease = c.reserve("llama-3-8b/kv-v1", keys[hit:], chunk_bytes)
        ...write into the memoryviews..., c.commit(lease)
        with c.acquired("llama-3-8b/kv-v1", keys[:hit]) as views:
            ...read the read-only memoryviews (zero-copy)...

Modules: client (Client, the requests), errors (KvtierError and one subclass per wire code),
hashing (hash_tokens, xxh3_128: keys computed locally), events (Subscriber), heartbeat (the
thread that keeps an idle Client's instance alive).
Not thread-safe: one Client (and one Subscriber) per thread.
"""

from .client import (ACQUIRE, BYE, CLEAR, COMMIT, GET, HASH_TOKENS, HELLO, LOOKUP, PING,
                     PREFETCH_STATUS, PROTO_VERSION, PUT, REGISTER_GPU, RELEASE, REMOVE,
                     RESERVE, RETRIEVE_GPU, STATS, STORE_GPU, UNREGISTER_GPU,
                     Acquired, Client, Lookup, PrefetchStatus, Reservation)
from .errors import (BadRequest, Busy, InstanceDropped, Internal, KvtierError, LeaseExpired,
                     NoSpace, NotFound, ProtocolError, Timeout, TooLarge, Unavailable,
                     UnknownLease, UnknownType, UnsupportedVersion, error_for)
from .events import Subscriber
from .hashing import have_xxhash, hash_tokens, token_bytes, xxh3_128

__version__ = "0.1.0"

__all__ = [
    "Client", "Subscriber", "hash_tokens", "xxh3_128", "token_bytes", "have_xxhash",
    "Lookup", "PrefetchStatus", "Reservation", "Acquired",
    "KvtierError", "BadRequest", "UnknownType", "UnsupportedVersion", "TooLarge", "NoSpace",
    "NotFound", "LeaseExpired", "UnknownLease", "Busy", "Internal", "Unavailable",
    "InstanceDropped", "Timeout", "ProtocolError", "error_for",
    "PROTO_VERSION", "HELLO", "BYE", "PING", "LOOKUP", "PREFETCH_STATUS", "RESERVE", "COMMIT",
    "ACQUIRE", "RELEASE", "PUT", "GET", "REMOVE", "CLEAR", "STATS", "HASH_TOKENS",
    "REGISTER_GPU", "UNREGISTER_GPU", "STORE_GPU", "RETRIEVE_GPU",
]
