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
hashing (hash_tokens, xxh3_128: keys computed locally; name_key), events (Subscriber, and
EmbeddingEvents: the events as a coordinator of multimodal embeddings reads them), heartbeat (the
thread that keeps an idle Client's instance alive), sglang (KvtierHiCacheStorage, SGLang's
HiCache storage backend), vllm (KvtierECConnector, vLLM's encoder-cache connector), media
(MediaCache: tensors or bytes by hash, one writer and many zero-copy readers) and tensorobj
(their object format); those four are imported on demand and need torch.
Not thread-safe: one Client (and one Subscriber) per thread.
"""

from .client import (ACQUIRE, BYE, CLEAR, COMMIT, GET, HASH_TOKENS, HELLO, LOOKUP, PING,
                     PREFETCH_STATUS, PROTO_VERSION, PUT, REGISTER_GPU, RELEASE, REMOVE,
                     RESERVE, RETRIEVE_GPU, STATS, STORE_GPU, UNREGISTER_GPU,
                     Acquired, Client, Lookup, PrefetchStatus, Reservation, Slots)
from .errors import (BadRequest, Busy, InstanceDropped, Internal, KvtierError, LeaseExpired,
                     NoSpace, NotFound, ProtocolError, Timeout, TooLarge, Unavailable,
                     UnknownLease, UnknownType, UnsupportedVersion, error_for)
from .events import EmbeddingEvents, Subscriber
from .hashing import have_xxhash, hash_tokens, token_bytes, xxh3_128

try:
    from ._version import __version__       # written at build time from the repository's VERSION
except ImportError:                         # a source checkout put on sys.path by hand
    def _repo_version():
        import os
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                            "VERSION")
        try:
            with open(path, encoding="ascii") as f:
                return f.read().strip()
        except OSError:
            return "0+unknown"
    __version__ = _repo_version()
    del _repo_version

__all__ = [
    "Client", "Subscriber", "EmbeddingEvents", "hash_tokens", "xxh3_128", "token_bytes", "have_xxhash",
    "Lookup", "PrefetchStatus", "Reservation", "Acquired", "Slots",
    "KvtierError", "BadRequest", "UnknownType", "UnsupportedVersion", "TooLarge", "NoSpace",
    "NotFound", "LeaseExpired", "UnknownLease", "Busy", "Internal", "Unavailable",
    "InstanceDropped", "Timeout", "ProtocolError", "error_for",
    "PROTO_VERSION", "HELLO", "BYE", "PING", "LOOKUP", "PREFETCH_STATUS", "RESERVE", "COMMIT",
    "ACQUIRE", "RELEASE", "PUT", "GET", "REMOVE", "CLEAR", "STATS", "HASH_TOKENS",
    "REGISTER_GPU", "UNREGISTER_GPU", "STORE_GPU", "RETRIEVE_GPU",
]
