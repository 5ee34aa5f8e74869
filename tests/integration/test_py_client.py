"""The Python client package (client/python/kvtier) against the real daemon: two data-parallel
ranks sharing a prefix through the arena, salt and namespace isolation, multimodal embeddings
through RESERVE/COMMIT and PUT/GET, HASH_TOKENS (daemon == local == test vector), every refusal
raised as the right typed error, and a LOOKUP answering fast while 256 MiB of GET replies are
in flight.

The ranks and the GET load run in separate processes: this file doubles as their script
(`python3 test_py_client.py ROLE JSON-ARGS`, one JSON line on stdout)."""

import hashlib
import json
import os
import select
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import pytest  # noqa: E402
import zmq  # noqa: E402

import kvtier  # noqa: E402
from kvtest import MiB, key, mapped_len_ok, payload, wait_until  # noqa: E402

NS = "py-client/llama-kv-v1"
CAP = 64 * MiB            # the Daemon helper's default --l1-size

VECTOR_TOKENS = list(range(8))
VECTOR = ["361d40d624bc45847cb55c04878d9596", "390d55d1f642cbe361c5f27bacda5d77"]
VECTOR_SALTED = ["d94d032fdacc9824ff9e899c1d74acfc", "dafdfb4cdf651f440368d67cab9efb68"]
# L1 alone: with an L2 tier write-behind holds daemon leases for a moment (leases_active) and
# LOOKUP would also see the L2 copies of removed or cleared objects
KVT_DAEMON_ARGS = ("--l2", "none")


def sha(b):
    return hashlib.sha256(b).hexdigest()


def tokens_of(seed, n):
    """n deterministic token ids (a fake prompt)."""
    r = payload(seed, 4 * n)
    return [int.from_bytes(r[4 * i:4 * i + 4], "little") % 128256 for i in range(n)]


# ----------------------------------------------------------------------------------------
# Processes (this file run as a script)


def _rank_a(a):
    """Rank A computes a prompt's prefix: hashes its tokens locally, finds nothing cached,
    reserves every chunk, writes its (fake) KV bytes into the arena, commits."""
    with kvtier.Client(a["endpoint"], client="rank-a", instance=a["instance"]) as c:
        keys = kvtier.hash_tokens(a["tokens"], c.chunk_tokens, salt=a["salt"])
        before = c.lookup(a["ns"], keys, salt=a["salt"]).hits
        slots, lease = c.reserve(a["ns"], keys, a["chunk_bytes"], salt=a["salt"])
        shas = []
        for i, slot in enumerate(slots):
            data = payload(a["seed"] + i, a["chunk_bytes"])
            slot[:] = data
            shas.append(sha(data))
        stored = c.commit(lease)
        return {"keys": [k.hex() for k in keys], "hits_before": before, "slots": len(slots),
                "stored": stored, "shas": shas, "instance": c.instance}


def _rank_b(a):
    """Rank B (another instance) serves a prompt that extends A's: same prefix, its own tail.
    It finds A's chunks, reads them zero-copy, and stores only its own tail."""
    with kvtier.Client(a["endpoint"], client="rank-b", instance=a["instance"]) as c:
        keys = kvtier.hash_tokens(a["tokens"], c.chunk_tokens, salt=a["salt"])
        look = c.lookup(a["ns"], keys, salt=a["salt"])
        views, lease = c.acquire(a["ns"], keys[:look.hits], salt=a["salt"])
        zero_copy = all(isinstance(v, memoryview) and v.readonly and v.obj is c.arena
                        for v in views)
        try:
            views[0][0] = 0
            writable = True
        except TypeError:
            writable = False
        shas = [sha(v) for v in views]               # hashlib reads the view in place
        lengths = [len(v) for v in views]
        c.release(lease)
        try:
            views[0][0]
            usable_after_release = True
        except ValueError:
            usable_after_release = False
        # the whole prompt: the shared chunks come back as None, only the tail is written
        slots, wlease = c.reserve(a["ns"], keys, a["chunk_bytes"], salt=a["salt"])
        nones = [s is None for s in slots]
        for i, slot in enumerate(slots):
            if slot is not None:
                slot[:] = payload(a["seed"] + i, a["chunk_bytes"])
        stored = c.commit(wlease) if wlease else 0
        return {"keys": [k.hex() for k in keys], "hits": look.hits, "l1": look.l1,
                "read_lease": lease, "zero_copy": zero_copy, "writable": writable,
                "usable_after_release": usable_after_release, "shas": shas,
                "lengths": lengths, "nones": nones, "stored": stored}


def _getter(a):
    """One DEALER sends every GET without waiting ("sent" on stdout), receives the replies
    zero-copy ("received"), then hashes them."""
    with kvtier.Client(a["endpoint"], client="getter", timeout_ms=60000) as c:
        uids = [c.send(kvtier.GET, {"ns": a["ns"], "keys": [bytes.fromhex(k) for k in ks]})
                for ks in a["batches"]]
        t0 = time.perf_counter()
        print("sent", flush=True)
        replies = [c.recv(u, copy=False) for u in uids]
        t1 = time.perf_counter()
        print("received", flush=True)
        return {"found": [b["found"] for b, _ in replies],
                "shas": [[sha(d) for d in data] for _, data in replies],
                "bytes": sum(len(d) for _, data in replies for d in data),
                "transfer_ms": (t1 - t0) * 1e3}


def _run_role(role, args, timeout=60):
    """Runs this file as `role` in a fresh process; returns its JSON result."""
    cp = subprocess.run([sys.executable, os.path.abspath(__file__), role, json.dumps(args)],
                        capture_output=True, text=True, timeout=timeout)
    assert cp.returncode == 0, "%s exited %s:\n%s" % (role, cp.returncode, cp.stderr[-3000:])
    return json.loads(cp.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture
def connect(daemon_factory):
    """connect(daemon, endpoint="ipc", **Client kwargs) -> kvtier.Client; closed (BYE) at
    teardown, before the daemon stops."""
    made = []

    def _connect(d, endpoint="ipc", **kw):
        kw.setdefault("context", d.ctx)
        c = kvtier.Client(d.endpoint(endpoint), **kw)
        made.append(c)
        return c

    yield _connect
    for c in made:
        c.close()


def raises(cls, fn, *args, **kw):
    """Calls fn, asserts it raises `cls` (a KvtierError subclass) with cls.code; returns it."""
    try:
        fn(*args, **kw)
    except kvtier.KvtierError as e:
        assert isinstance(e, cls) and e.code == cls.code, \
            "expected %s (%s), got %r" % (cls.__name__, cls.code, e)
        assert e.message, "error without a message: %r" % e
        return e
    raise AssertionError("expected %s (%s), nothing raised" % (cls.__name__, cls.code))


# ----------------------------------------------------------------------------------------
# Session, arena, raw calls


def test_client_session_and_arena(daemon_factory, connect):
    d = daemon_factory("--chunk-tokens", "64", "--lease-ms", "4000")
    c = connect(d, client="pytest-py")
    assert c.info["ok"] is True and c.info["version"] == kvtier.PROTO_VERSION
    assert (c.chunk_tokens, c.lease_ms, c.max_message) == (64, 4000, c.info["max_message"])
    assert c.instance.startswith("pytest-py-%d-" % os.getpid())
    assert mapped_len_ok(c, CAP)
    other = connect(d, client="pytest-py")
    assert other.instance != c.instance, "default instance names must differ per Client"
    c.ping()
    st = c.stats()
    assert "ok" not in st and st["clients_connected"] == 2 and st["l1_capacity_bytes"] == CAP
    with connect(d, instance="inst-bye") as tmp:
        r, _ = tmp.acquire(NS, [key(1)])
        assert r == [] and _ == 0
    assert c.stats()["clients_connected"] == 2, "close() says BYE"
    tmp.close()                                       # idempotent

    # pipelined requests, replies taken out of order, each matched by uid
    k = [key(i, b"pipe") for i in range(3)]
    c.store(NS, k, [b"x" * 100] * 3)
    u1 = c.send(kvtier.LOOKUP, {"ns": NS, "keys": k[:1]})
    u2 = c.send(kvtier.LOOKUP, {"ns": NS, "keys": k})
    u3 = c.send(kvtier.PING, {})
    assert c.recv(u2)[0]["hits"] == 3
    assert c.recv(u3)[0]["ok"] is True
    assert c.recv(u1)[0]["hits"] == 1

    # a reply that comes after its call timed out is discarded, never taken for another's
    for _ in range(20):
        try:
            c.call(kvtier.LOOKUP, {"ns": NS, "keys": k}, timeout_ms=0)
        except kvtier.Timeout as e:
            assert e.code == "timeout"
            break
    else:
        pytest.skip("every reply beat a 0 ms timeout")
    assert c.lookup(NS, k[:2]).hits == 2
    assert c.lookup(NS, k[:1]).hits == 1

    # a remote client (no arena): RESERVE/ACQUIRE refused locally, PUT/GET work over tcp
    r = connect(d, "tcp", map_arena=False)
    assert r.arena is None
    raises(kvtier.Unavailable, r.reserve, NS, [key(9)], 4096)
    raises(kvtier.Unavailable, r.acquire, NS, k)
    assert r.get(NS, k) == [b"x" * 100] * 3
    assert r.put(NS, [key(9)], [b"remote"]) == 1
    assert c.fetch(NS, [key(9)]) == [b"remote"]


def test_offsets_begin_and_post(daemon_factory, connect):
    """reserve_offsets / acquire_offsets answer arena ranges (the bytes written through them
    are the object's); the *_begin halves overlap requests; post() sends a RELEASE whose
    reply nobody waits for, and the lease is gone."""
    d = daemon_factory()
    c = connect(d)
    k = [key(i, b"off") for i in range(4)]
    slots, lease = c.reserve_offsets(NS, k[:2], 1000)
    assert lease and len(slots) == 2 and all(length == 1000 for _, length in slots)
    for i, (off, length) in enumerate(slots):
        c.arena[off:off + length] = bytes([i + 1]) * length
    assert c.commit(lease) == 2
    assert c.reserve_offsets(NS, k[:2], 1000) == ([None, None], 0)   # stored already
    assert c.fetch(NS, k[:2]) == [b"\x01" * 1000, b"\x02" * 1000]

    first = c.reserve_offsets_begin(NS, k[2:3], 10)
    second = c.acquire_offsets_begin(NS, k)                     # both on the wire
    r1 = first()
    (off, _), = r1.slots
    slots, rlease = second()
    assert len(slots) == 2 and c.arena[slots[1][0]:slots[1][0] + 1] == b"\x02"
    assert c.stats()["leases_active"] == 2
    c.post(kvtier.RELEASE, {"lease": rlease})
    c.arena[off:off + 10] = b"z" * 10
    assert c.stats()["leases_active"] == 1                   # (the RELEASE went first)
    pending = c.commit_begin(r1.lease)
    assert pending() == 1
    assert c.fetch(NS, k[:3])[2] == b"z" * 10
    c.post(kvtier.RELEASE, {"lease": 424242})                # its error is never seen
    c.ping()
    raises(kvtier.UnknownLease, c.release, 424242)


def test_no_daemon_times_out(tmp_path):
    ctx = zmq.Context()
    try:
        t0 = time.monotonic()
        e = raises(kvtier.Timeout, kvtier.Client, "ipc://%s/none.sock" % tmp_path,
                   timeout_ms=300, context=ctx)
        assert 0.25 <= time.monotonic() - t0 < 3, e
    finally:
        ctx.destroy(linger=0)


# ----------------------------------------------------------------------------------------
# Data-parallel ranks sharing one prefix


def test_two_ranks_share_a_prefix(daemon_factory, connect):
    d = daemon_factory()
    chunk_tokens, chunk_bytes, n_shared, n_tail = 256, 256 * 1024, 8, 4
    prefix = tokens_of(1, n_shared * chunk_tokens)
    prompt_b = prefix + tokens_of(2, n_tail * chunk_tokens + 100)     # + a partial chunk
    salt = "tenant-a"
    a = _run_role("rank_a", {"endpoint": d.ipc, "instance": "rank-a-0", "tokens": prefix,
                             "salt": salt, "ns": NS, "chunk_bytes": chunk_bytes, "seed": 1000})
    assert a["hits_before"] == 0 and a["slots"] == n_shared and a["stored"] == n_shared, a
    b = _run_role("rank_b", {"endpoint": d.tcp, "instance": "rank-b-1", "tokens": prompt_b,
                             "salt": salt, "ns": NS, "chunk_bytes": chunk_bytes, "seed": 1000})
    # equal prefixes hash to equal keys in both processes
    assert len(b["keys"]) == n_shared + n_tail
    assert b["keys"][:n_shared] == a["keys"]
    assert b["hits"] == b["l1"] == n_shared, b
    assert b["read_lease"] > 0 and b["zero_copy"], b
    assert not b["writable"], "ACQUIRE views must be read-only"
    assert not b["usable_after_release"], "a view must be unusable after RELEASE"
    assert b["lengths"] == [chunk_bytes] * n_shared
    assert b["shas"] == a["shas"], "rank B did not read rank A's exact bytes"
    assert b["nones"] == [True] * n_shared + [False] * n_tail, b["nones"]
    assert b["stored"] == n_tail

    c = connect(d)
    keys = [bytes.fromhex(k) for k in b["keys"]]
    assert c.lookup(NS, keys, salt=salt).hits == n_shared + n_tail
    got = c.fetch(NS, keys, salt=salt)
    assert [sha(x) for x in got[:n_shared]] == a["shas"]
    assert got[n_shared:] == [payload(1000 + i, chunk_bytes)
                              for i in range(n_shared, n_shared + n_tail)]
    st = c.stats()
    assert st["leases_active"] == 0 and st["l1_objects"] == n_shared + n_tail, st

    # salt isolation: same tokens, another tenant -> other keys, no hits
    other = c.chunk_keys(prompt_b, salt="tenant-b")
    assert not set(other) & set(keys)
    assert c.lookup(NS, other, salt="tenant-b").hits == 0
    # the same key bytes under another salt, no salt, or another ns are other objects
    assert c.lookup(NS, keys, salt="tenant-b").hits == 0
    assert c.lookup(NS, keys).hits == 0
    assert c.lookup(NS + "-other", keys, salt=salt).hits == 0
    assert c.get(NS + "-other", keys, salt=salt) == []
    views, lease = c.acquire(NS, keys, salt="tenant-b")
    assert views == [] and lease == 0
    # unsalted hashing differs from salted
    assert c.chunk_keys(prompt_b)[0] != keys[0]


# ----------------------------------------------------------------------------------------
# Multimodal embeddings


def test_multimodal_embeddings(daemon_factory, connect):
    d = daemon_factory()
    c = connect(d)
    ns = "embeddings/clip"
    sizes = [1000, 4096, 5000, 12345, 777, 65536, 100, 300000]
    media = [payload(500 + i, 20000 + 313 * i) for i in range(2 * len(sizes))]   # fake images
    keys = [kvtier.xxh3_128(m) for m in media]
    assert all(len(k) == 16 for k in keys) and len(set(keys)) == len(keys)
    emb = [payload(900 + i, sizes[i % len(sizes)]) for i in range(len(keys))]
    via_arena, via_socket = slice(0, len(sizes)), slice(len(sizes), None)

    # through the arena: RESERVE / write / COMMIT, then ACQUIRE zero-copy
    with c.reserved(ns, keys[via_arena], [len(e) for e in emb[via_arena]]) as slots:
        assert [len(s) for s in slots] == sizes
        for s, e in zip(slots, emb[via_arena]):
            s[:] = e
    for k, e in zip(keys[via_arena], emb[via_arena]):
        assert c.lookup(ns, [k]).hits == 1
        with c.acquired(ns, [k]) as views:
            assert len(views) == 1 and views[0] == e

    # through the socket: PUT / GET (new objects only)
    assert c.put(ns, keys[via_socket], emb[via_socket]) == len(sizes)
    assert c.put(ns, keys[via_socket], emb[via_socket]) == 0
    assert c.get(ns, keys[via_socket]) == emb[via_socket]
    zc = c.get(ns, keys[via_socket], copy=False)
    assert [bytes(v) for v in zc] == emb[via_socket]

    # both paths see each other's objects
    assert c.get(ns, keys[via_arena]) == emb[via_arena]
    assert c.fetch(ns, keys[via_socket]) == emb[via_socket]
    assert c.lookup(ns, keys).hits == len(keys)
    # GET answers the leading keys found
    missing = kvtier.xxh3_128(b"never stored")
    assert c.get(ns, [keys[0], missing, keys[1]]) == [emb[0]]
    assert c.get(ns, [missing] + keys) == []
    # a remote encoder worker reads them over tcp
    with kvtier.Client(d.tcp, client="encoder", map_arena=False, context=d.ctx) as r:
        assert r.get(ns, keys[:3]) == emb[:3]
    # a reservation abandoned by an exception leaves nothing behind
    with pytest.raises(RuntimeError):
        with c.reserved(ns, [missing], 4096) as slots:
            slots[0][:5] = b"half-"
            raise RuntimeError("encoder crashed")
    assert c.lookup(ns, [missing]).hits == 0
    assert c.stats()["leases_active"] == 0
    assert c.remove(ns, keys[:2]) == 2
    assert c.lookup(ns, keys).hits == 0 and c.lookup(ns, keys[2:]).hits == len(keys) - 2
    assert c.clear(ns) == len(keys) - 2
    assert c.clear() == 0


# ----------------------------------------------------------------------------------------
# HASH_TOKENS


def test_hash_tokens_daemon_local_vector(daemon_factory, connect, monkeypatch):
    d = daemon_factory("--chunk-tokens", "4")
    c = connect(d)
    le = b"".join(t.to_bytes(4, "little") for t in VECTOR_TOKENS)
    for tokens in (VECTOR_TOKENS, le, VECTOR_TOKENS + [8, 9, 10]):       # + a partial chunk
        assert [k.hex() for k in kvtier.hash_tokens(tokens, 4)] == VECTOR
        assert [k.hex() for k in c.hash_tokens(tokens)] == VECTOR       # HELLO's chunk_tokens
        assert [k.hex() for k in c.hash_tokens(tokens, 4)] == VECTOR
        assert [k.hex() for k in c.chunk_keys(tokens)] == VECTOR
        assert [k.hex() for k in kvtier.hash_tokens(tokens, 4, salt="tenant-a")] == VECTOR_SALTED
        assert [k.hex() for k in c.hash_tokens(tokens, salt="tenant-a")] == VECTOR_SALTED
    assert c.hash_tokens([]) == [] == kvtier.hash_tokens([], 4)
    assert c.hash_tokens([1, 2, 3]) == []                               # no full chunk
    # longer sequences, other chunk sizes, salts
    for n, ct, salt in ((5000, 256, None), (5000, 256, "t"), (1000, 1, "x" * 128),
                        (4096, 4096, None)):
        toks = tokens_of(n + ct, n)
        local = kvtier.hash_tokens(toks, ct, salt=salt)
        assert len(local) == n // ct
        assert c.hash_tokens(toks, ct, salt=salt) == local, (n, ct, salt)
    # without the xxhash module the client asks the daemon
    monkeypatch.setattr(kvtier.hashing, "_xxh3_128", None)
    assert not kvtier.have_xxhash()
    raises(kvtier.Unavailable, kvtier.hash_tokens, VECTOR_TOKENS, 4)
    assert [k.hex() for k in c.chunk_keys(VECTOR_TOKENS, salt="tenant-a")] == VECTOR_SALTED


# ----------------------------------------------------------------------------------------
# Refusals, each raised as its typed error


def test_bad_input_raises_typed_errors(daemon_factory, connect):
    d = daemon_factory("--max-message", "65536", "--max-keys", "64", "--chunk-tokens", "4")
    c = connect(d)
    k = [key(i, b"err") for i in range(3)]

    e = raises(kvtier.BadRequest, c.lookup, NS, [b"short"])
    assert e.type == kvtier.LOOKUP
    raises(kvtier.BadRequest, c.put, NS, [b"x" * 17], [b"data"])
    raises(kvtier.BadRequest, c.get, NS, [k[0], b""])
    raises(kvtier.BadRequest, c.remove, NS, [12345])
    raises(kvtier.BadRequest, c.lookup, "", k)                       # ns 1-256 bytes
    raises(kvtier.BadRequest, c.lookup, NS, k, salt="s" * 129)       # salt <= 128 bytes
    raises(kvtier.BadRequest, c.reserve, NS, k, 0)                   # sizes positive
    raises(kvtier.BadRequest, c.reserve, NS, k, [4096, 4096])        # sizes per key
    raises(kvtier.BadRequest, c.call, kvtier.PING, {}, [b"stray data frame"])
    raises(kvtier.UnknownType, c.call, 99, {})

    # PUT: one non-empty data frame per key
    raises(kvtier.BadRequest, c.put, NS, k[:2], [b"only one"])
    raises(kvtier.BadRequest, c.put, NS, k[:1], [b"one", b"two"])
    raises(kvtier.BadRequest, c.put, NS, k[:1], [b""])
    raises(kvtier.BadRequest, c.put, NS, k[:2], [b"ok", b""])
    assert c.lookup(NS, k).hits == 0, "a refused PUT stored something"

    # leases this instance does not hold
    raises(kvtier.UnknownLease, c.release, 987654321)
    raises(kvtier.UnknownLease, c.commit, 987654321)
    slots, lease = c.reserve(NS, k[:1], 4096)
    other = connect(d, instance="inst-other")
    raises(kvtier.UnknownLease, other.commit, lease)                 # another owner's lease
    assert c.commit(lease) == 1
    raises(kvtier.UnknownLease, c.commit, lease)                     # already committed
    raises(kvtier.UnknownLease, c.release, lease)
    _, rl = c.acquire(NS, k[:1])
    raises(kvtier.BadRequest, c.commit, rl)                          # COMMIT of a read lease
    c.release(rl)
    slots, lease = c.reserve(NS, k[1:2], 4096)
    raises(kvtier.BadRequest, c.commit, lease, failed=[5])           # index past the keys
    assert c.commit(lease, failed=[0]) == 0                          # lease was left intact
    assert c.lookup(NS, k[1:2]).hits == 0

    # too_large: max_message (65536) and max_keys (64)
    raises(kvtier.TooLarge, c.put, NS, [k[2]], [b"x" * 70000])
    raises(kvtier.TooLarge, c.put, NS, k[:2], [b"a" * 40000, b"b" * 40000])
    raises(kvtier.TooLarge, c.lookup, NS, [key(i) for i in range(65)])
    assert c.lookup(NS, [key(i) for i in range(64)]).hits == 0
    raises(kvtier.TooLarge, c.hash_tokens, list(range(65 * 4)))      # 65 chunks > max_keys
    assert len(c.hash_tokens(list(range(64 * 4)))) == 64
    raises(kvtier.BadRequest, c.hash_tokens, b"abc")                 # not a multiple of 4
    raises(kvtier.BadRequest, c.hash_tokens, [1, 2, 3, 4], 0)        # chunk_tokens positive
    # GET stops early to keep its reply under max_message; asking again gets the rest
    big = [key(i, b"big") for i in range(2)]
    assert c.store(NS, big, [b"a" * 40000, b"b" * 40000]) == 2
    assert c.get(NS, big) == [b"a" * 40000]
    assert c.get(NS, big[1:]) == [b"b" * 40000]

    # no_space: not even the first key fits
    raises(kvtier.NoSpace, c.reserve, NS, [k[2]], CAP + 1)
    # prefetch jobs: done at once for now; an unknown job is not_found
    look = c.lookup(NS, k, prefetch=True)
    assert look.hits == 1 and look.job is not None, look
    st = c.prefetch_status(look.job)
    assert st.done is True and st.loaded == 0 and st.hits == 1, st
    raises(kvtier.NotFound, c.prefetch_status, 424242)
    # lock pins the hits; the lease releases like any other
    look = c.lookup(NS, k, lock=True)
    assert look.hits == 1 and look.lease > 0
    c.release(look.lease)
    assert c.lookup(NS, k[1:], lock=True).lease == 0                # no hits, no lease
    assert c.stats()["leases_active"] == 0
    assert d.alive()


def test_lease_expired(daemon_factory, connect):
    d = daemon_factory("--lease-ms", "500")
    c = connect(d, instance="inst-silent", heartbeat_ms=0)    # silent: no heartbeat either
    observer = connect(d, instance="inst-observer")
    k = key(1, b"exp")
    slots, lease = c.reserve(NS, [k], 8192)
    slots[0][:4] = b"half"
    t0 = time.monotonic()
    wait_until(lambda: observer.stats()["leases_active"] == 0, timeout=3.0, interval=0.1,
               what="the silent instance's write lease to expire")
    assert time.monotonic() - t0 >= 0.3
    e = raises(kvtier.LeaseExpired, c.commit, lease)
    assert e.type == kvtier.COMMIT
    with pytest.raises(ValueError):
        slots[0][0]                   # the view went with the lease
    # the instance is gone: a fresh HELLO and it works again
    c.hello()
    assert c.store(NS, [k], [b"y" * 8192]) == 1
    assert observer.get(NS, [k]) == [b"y" * 8192]


# ----------------------------------------------------------------------------------------
# LOOKUP under a 256 MiB GET load


def test_lookup_fast_while_256mib_of_get_in_flight(daemon_factory, connect):
    d = daemon_factory("--l1-size", "512M")
    c = connect(d)
    assert mapped_len_ok(c, 512 * MiB)
    n, size = 64, 4 * MiB
    keys = [key(i, b"load") for i in range(n)]
    shas = []
    slots, lease = c.reserve(NS, keys, size)
    assert len(slots) == n and None not in slots
    for i, s in enumerate(slots):
        data = payload(7000 + i, size)
        s[:] = data
        shas.append(sha(data))
    assert c.commit(lease) == n

    # the timing client has its own zmq context (its own I/O thread), as another engine has
    ctx = zmq.Context()
    timer = kvtier.Client(d.ipc, client="router", context=ctx)
    try:
        assert timer.lookup(NS, keys).hits == n                    # warm
        batches = [[k.hex() for k in keys[j:j + 16]] for j in range(0, n, 16)]
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "getter",
                                 json.dumps({"endpoint": d.ipc, "ns": NS,
                                             "batches": batches})],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        fd = proc.stdout.fileno()
        out = b""
        try:
            deadline = time.monotonic() + 30
            while b"sent\n" not in out:                  # the getter starts, sends its GETs
                assert time.monotonic() < deadline and proc.poll() is None, \
                    "getter did not send: %r %r" % (out, proc.stderr.read()[-3000:])
                if select.select([fd], [], [], 0.1)[0]:
                    out += os.read(fd, 65536)
            lat = []
            while b"received\n" not in out and time.monotonic() < deadline:
                t0 = time.perf_counter()
                look = timer.lookup(NS, keys)
                lat.append((time.perf_counter() - t0) * 1e3)
                assert look.hits == n
                if select.select([fd], [], [], 0)[0]:
                    out += os.read(fd, 65536)
            rest, err = proc.communicate(timeout=60)
            out += rest
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, err.decode("utf-8", "replace")[-3000:]
        res = json.loads(out.decode().strip().splitlines()[-1])
    finally:
        timer.close()
        ctx.destroy(linger=0)

    srt = sorted(lat)
    print("\nLOOKUP(64 keys) while 4 GETs x 16 x 4 MiB were in flight: %d lookups, "
          "first %.2f ms, median %.2f ms, p99 %.2f ms, max %.2f ms; the GET replies took "
          "%.0f ms" % (len(lat), lat[0], statistics.median(lat), srt[int(0.99 * (len(srt) - 1))],
                       srt[-1], res["transfer_ms"]))
    assert res["found"] == [16] * 4
    assert res["bytes"] == n * size
    assert [h for batch in res["shas"] for h in batch] == shas, "GET bytes differ"
    # a LOOKUP queued behind the GETs would wait for at least one 64 MiB reply (a quarter of
    # the transfer): the first must come well before that. Not a fixed 50 ms: a single LOOKUP
    # on a busy 2-vCPU VM can lose the CPU for that long, queued or not (clean-clone CI saw
    # 50.7 ms once, the transfer taking over 1 s; twelve runs here: first 0.6-17 ms, max 28-53)
    first_bound = max(50.0, res["transfer_ms"] / 10)
    assert lat[0] < first_bound, "first LOOKUP took %.2f ms under the GET load (bound %.0f ms)" \
        % (lat[0], first_bound)
    # LOOKUPs queued behind the GETs would all wait for the transfer: p99, not the maximum (one
    # LOOKUP in hundreds can lose the CPU for 100 ms on a busy 2-core VM, queued or not)
    p99 = srt[int(0.99 * (len(srt) - 1))]
    assert p99 < 50, "LOOKUP p99 %.2f ms under the GET load: %r" % (p99, lat)


if __name__ == "__main__":
    role, arg = sys.argv[1], json.loads(sys.argv[2])
    result = {"rank_a": _rank_a, "rank_b": _rank_b, "getter": _getter}[role](arg)
    print(json.dumps(result), flush=True)
