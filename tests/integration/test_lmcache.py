"""kvtierd's LMCache door (--lmcache-listen) against an unmodified LMCache MP client's wire, as
vLLM's LMCacheMPConnector drives it in engine-driven shared-memory mode
(../../../shared/LMCACHE_MP.md): the small ops, registration and the shared pool, the
prepare/commit store and retrieve cycle through the mapped pool, lookups and prefetch status,
prefixes across workers, salts, both doors seeing the same objects, end_session / free locks /
clear / unregister, refusals (error replies, silence for stream-control and short messages), a
worker SIGKILLed with its reservations, /metrics and /status, and the v1 door serving at the
same time.

lmc_client.py speaks the wire (and is the crashing worker process). Every receive is bounded
(5 s poller); state changes are polled with bounds.
"""

import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import pytest  # noqa: E402
import zmq  # noqa: E402

import kvtier  # noqa: E402
from kvtest import free_port, metric_value, wait_until  # noqa: E402
from lmc_client import (OPS, Layout, LmcClient, RemoteError, Shm,  # noqa: E402
                        check_slots, chunk_data, ipc_key,
                        new_instance_id, pack, selftest, tokens_of, unpack)

C = 16                                   # --chunk-tokens of every daemon here
MODEL = "meta-llama/Llama-3.1-8B"        # a '/' in the model name, as Hugging Face ids have
LAY = Layout(2, 64, "float16", C)        # 8 KiB per chunk object
# L1 alone: no L2 (a lookup is complete at once, CLEAR leaves no L2 copies behind)
KVT_DAEMON_ARGS = ("--l2", "none", "--chunk-tokens", str(C))


REQ_METRIC = "kvtier_lmcache_requests_total"


def ns_of(model, world_size, worker):
    """The v1 namespace of worker `worker`'s objects (the door's mapping)."""
    return "lmcache/%s/%d/%d" % (model, world_size, worker)


_rids = itertools.count()


def rid(tag="req"):
    return "%s-%d" % (tag, next(_rids))


# ----------------------------------------------------------------------------------------
# Fixtures and helpers


class Door:
    """A daemon with the LMCache door, and the clients, pools and v1 clients a test opens
    (all closed at teardown, before the daemon stops)."""

    def __init__(self, factory):
        self._factory = factory
        self.ctx = zmq.Context()
        self._clients, self._shms, self._v1 = [], [], []
        self.d = self.endpoint = None

    def start(self, *extra, transport="ipc", l2=None):
        d = self._factory(start=False)
        if l2:   # instead of the module's --l2 none
            i = d.args.index("none")
            d.args[i] = l2
        if transport == "ipc":
            ep = "ipc://" + os.path.join(d.run_dir, "lmcache.sock")
        else:
            ep = "tcp://127.0.0.1:%d" % free_port()
        d.args += ["--lmcache-listen", ep] + list(extra)
        d.start()
        self.d, self.endpoint = d, ep
        assert self.client().noop() == "OK"     # the door answers (the connect is retried)
        return self

    def client(self):
        c = LmcClient(self.endpoint, ctx=self.ctx)
        self._clients.append(c)
        return c

    def shm(self, reg):
        s = Shm(reg["shm_name"], reg["pool_size"])
        self._shms.append(s)
        return s

    def v1(self, name="lmc-v1"):
        c = kvtier.Client(self.d.ipc, client=name, instance="%s-%d" % (name, len(self._v1)))
        self._v1.append(c)
        return c

    def close(self):
        for s in self._shms:
            s.close()
        for c in self._v1:
            c.close()
        for c in self._clients:
            c.close()
        self.ctx.term()


@pytest.fixture
def door(daemon_factory):
    dr = Door(daemon_factory)
    yield dr
    dr.close()


def check_register(reg, pool_size=None):
    """Asserts a successful RegisterEngineDrivenContextResponse and that its pool exists."""
    assert isinstance(reg, dict), "register reply is not a map: %r" % (reg,)
    assert set(reg) >= {"shm_name", "pool_size", "scratch_offset", "scratch_size", "error"}, reg
    assert reg["error"] is None, "registration refused: %r" % (reg,)
    name, size = reg["shm_name"], reg["pool_size"]
    assert isinstance(name, str) and name and not name.startswith("/dev/shm"), reg
    assert "/" not in name.lstrip("/"), reg
    assert isinstance(size, int) and not isinstance(size, bool) and size > 0, reg
    assert reg["scratch_offset"] == 0 and reg["scratch_size"] == 0, reg
    path = "/dev/shm/" + name.lstrip("/")
    assert os.path.exists(path), "%s does not exist" % path
    assert os.stat(path).st_size >= size, (path, os.stat(path).st_size, size)
    if pool_size is not None:
        assert size == pool_size, reg


class Worker:
    """One vLLM worker: its own DEALER, a registered instance, the mapped pool."""

    def __init__(self, door, model=MODEL, world_size=1, rank=0, layout=LAY, instance_id=None):
        self.door, self.model, self.world_size, self.rank = door, model, world_size, rank
        self.layout = layout
        self.c = door.client()
        self.iid = instance_id if instance_id is not None else new_instance_id()
        self.reg = self.c.register(layout.payload(self.iid, model, world_size))
        check_register(self.reg)
        self.shm = door.shm(self.reg)

    def key(self, tokens, start, end, salt="", request_id="req", **kw):
        return ipc_key(self.model, self.world_size, self.rank, tokens, start, end, request_id,
                       salt, **kw)

    def prepare(self, tokens, start, end, salt="", **kw):
        """prepare_store -> (slots, chunk_indices), both checked."""
        r = self.c.prepare_store(self.key(tokens, start, end, salt, **kw), self.iid)
        assert isinstance(r, dict) and isinstance(r.get("context"), dict), r
        ctx = r["context"]
        assert isinstance(ctx.get("slots"), list), "context without a slots list: %r" % (ctx,)
        assert isinstance(ctx.get("chunk_indices"), list), ctx
        slots, idx = ctx["slots"], ctx["chunk_indices"]
        assert len(slots) == len(idx), ctx
        n = (end - start) // C
        assert all(isinstance(i, int) and 0 <= i < n for i in idx), idx
        assert len(set(idx)) == len(idx), idx
        check_slots(slots, self.layout, self.reg["pool_size"])
        return slots, idx

    def write(self, slots, idx, start, tag):
        for sl, i in zip(slots, idx):
            self.shm.write(sl["offset"], chunk_data(tag, self.rank, start // C + i,
                                                    self.layout.nbytes))

    def commit(self, tokens, start, end, salt="", **kw):
        return self.c.commit_store(self.key(tokens, start, end, salt, **kw), self.iid, b"")

    def store(self, tokens, start, end, tag, salt="", **kw):
        """prepare_store + write the chunks it hands out + commit_store (True). Returns the
        chunk_indices."""
        slots, idx = self.prepare(tokens, start, end, salt, **kw)
        if slots:
            self.write(slots, idx, start, tag)
            assert self.commit(tokens, start, end, salt, **kw) is True
        return idx

    def retrieve(self, tokens, start, end, salt=""):
        """prepare_retrieve -> the bytes of every chunk (None on a miss), then commit_retrieve."""
        k = self.key(tokens, start, end, salt)
        r = self.c.prepare_retrieve(k, self.iid)
        assert isinstance(r, dict) and isinstance(r.get("success"), bool), r
        assert isinstance(r.get("data"), bytes) and r["data"] == b"", \
            "prepare_retrieve data must be an empty bin: %r" % (r.get("data"),)
        ctx = r.get("context")
        assert isinstance(ctx, dict) and isinstance(ctx.get("slots"), list), r
        if not r["success"]:
            assert ctx["slots"] == [], "a miss with slots: %r" % (r,)
            return None
        assert len(ctx["slots"]) == (end - start) // C, r
        check_slots(ctx["slots"], self.layout, self.reg["pool_size"])
        out = [self.shm.read(sl["offset"], sl["length"]) for sl in ctx["slots"]]
        assert self.c.commit_retrieve(k, self.iid) is True
        return out

    def expected(self, tag, first, last):
        return [chunk_data(tag, self.rank, i, self.layout.nbytes) for i in range(first, last)]


def hits(c, model, world_size, tokens, salt="", end=None, tp_size=None):
    """A scheduler lookup + query_prefetch_status + end_session -> hit chunks."""
    r = rid("probe")
    end = len(tokens) // C * C if end is None else end
    c.lookup(ipc_key(model, world_size, None, tokens, 0, end, r, salt), tp_size or world_size)
    n = c.query_prefetch_status(r)
    assert isinstance(n, int) and not isinstance(n, bool), "query_prefetch_status -> %r" % (n,)
    c.end_session(r)
    return n


def assert_remote(exc_info_or_err, error_type, *mentions):
    err = exc_info_or_err
    assert isinstance(err, RemoteError), err
    assert err.error_type == error_type, "expected %s, got %s: %s" % (error_type,
                                                                     err.error_type,
                                                                     err.message)
    for m in mentions:
        assert str(m).lower() in err.message.lower(), \
            "error message %r does not mention %r" % (err.message, m)


# ----------------------------------------------------------------------------------------
# The helper itself (no daemon needed beyond the suite's own rule)


def test_helper_encoders_match_spec_bytes():
    assert selftest() > 20


# ----------------------------------------------------------------------------------------
# Small ops, both transports


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_small_ops(door, transport):
    door.start(transport=transport)
    c = door.client()
    r = c.request(OPS["get_chunk_size"])
    assert r.frames[0] == b"\x00", "the first uid of a DEALER is 0"
    assert r.value == C and type(r.value) is int
    assert c.noop() == "OK"
    r = c.request("noop")                       # by name: the op frame comes back as sent
    assert r.frames[1] == pack("noop") and r.value == "OK"
    assert c.ping(None) is True                 # the scheduler's probe
    iid = new_instance_id()                     # unknown: false once, then true (see
    assert c.ping(iid) is False                 # test_a_reaped_worker_registers_again)
    assert c.ping(iid) is True
    assert c.get_experimental() == ["kv_events"]   # the event log is on by default
    w = Worker(door)
    assert c.ping(w.iid) is True
    c.report_block_allocation(w.iid, MODEL, [
        {"req_id": "r0", "new_block_ids": [1, 2, 3], "new_token_ids": [5, 6, 7]}])
    c.report_block_allocation(w.iid, MODEL, [])
    c.end_session(rid("never-looked-up"))
    assert c.query_prefetch_status(rid("unknown")) == 0


def test_pipelined_requests_matched_by_uid(door):
    """The client sends without waiting and matches replies by uid (they may come in any
    order); each op frame is echoed."""
    door.start()
    c = door.client()
    sent = {}
    for i in range(30):
        op = [OPS["noop"], OPS["get_chunk_size"], "noop", OPS["get_experimental"],
              OPS["ping"]][i % 5]
        args = (None,) if op == OPS["ping"] else ()
        uid, opf = c.send(op, *args)
        sent[uid] = (opf, {OPS["noop"]: "OK", "noop": "OK", OPS["get_chunk_size"]: C,
                           OPS["get_experimental"]: ["kv_events"], OPS["ping"]: True}[op])
    for _ in range(len(sent)):
        frames = c.recv_frames()
        assert frames is not None, "missing replies: %d left" % len(sent)
        assert frames[0] in sent, "reply with an unknown uid %r" % (frames[0],)
        opf, want = sent.pop(frames[0])
        assert frames[1] == opf and len(frames) == 3
        assert unpack(frames[2]) == want
    c.expect_silence(0.2)


# ----------------------------------------------------------------------------------------
# Registration and the pool


def test_register_pool_and_idempotence(door):
    door.start()
    c = door.client()
    iid = new_instance_id()
    payload = LAY.payload(iid, MODEL, 1)
    reg = c.register(payload)
    check_register(reg)
    assert c.register(payload) == reg                 # again from its connection: the same
    # a payload with a field from a later version: ignored
    later = dict(payload, transfer_metadata_wire=None, kernel_groups=[])
    assert c.register(later) == reg
    # issue 28: another DEALER cannot take a live worker's id, nor anyone change its layout
    other = door.client().register(payload)
    assert "another connection" in (other["error"] or ""), other
    changed = c.register(Layout(3, 64, "float16", C).payload(iid, MODEL, 1))
    assert "another layout" in (changed["error"] or ""), changed
    # the worker after a reconnect: its old DEALER gone, a new one takes the registration over
    c.close()
    new = door.client()
    wait_until(lambda: new.register(payload) == reg, 5,
               what="the registration to pass to the worker's new connection")
    new.close()
    # it maps read-write, and two mappings see each other's writes
    with Shm(reg["shm_name"], reg["pool_size"]) as a, Shm(reg["shm_name"], reg["pool_size"]) as b:
        w = wait_until(lambda: _worker_when_free(door, iid), 5, what="a Worker for the id")
        slots, idx = w.prepare(tokens_of("reg", 2 * C), 0, 2 * C)
        assert idx == [0, 1]
        a.write(slots[1]["offset"], b"kvtier-lmcache" * 10)
        assert b.read(slots[1]["offset"], 140) == b"kvtier-lmcache" * 10
        w.c.unregister(iid)


def _worker_when_free(door, iid, **kw):
    """A Worker registering `iid`, or None while another open connection holds it."""
    try:
        return Worker(door, instance_id=iid, **kw)
    except AssertionError:
        return None


@pytest.mark.parametrize("layout", [
    Layout(2, 64, "float16", C), Layout(3, 128, "bfloat16", C), Layout(1, 32, "float32", C),
    Layout(4, 96, "bfloat16", C, use_mla=True)], ids=["fp16", "bf16", "fp32", "mla"])
def test_slot_layout(door, layout):
    """Slot shape [2, layers, chunk, hidden] ([layers, chunk, hidden] with MLA), the registered
    dtype, length = prod(shape) * itemsize; the bytes round-trip."""
    door.start()
    w = Worker(door, model="layout/" + layout.dtype, layout=layout)
    toks = tokens_of("layout", 3 * C)
    assert w.store(toks, 0, 3 * C, "layout") == [0, 1, 2]
    assert w.retrieve(toks, 0, 3 * C) == w.expected("layout", 0, 3)


@pytest.mark.parametrize("bad", [{"dtype_str": "complex128"}, {"num_layers": 0},
                                 {"world_size": 0}], ids=["dtype", "layers", "world"])
def test_register_rejects_bad_payload(door, bad):
    door.start()
    c = door.client()
    iid = new_instance_id()
    reg = c.register(dict(LAY.payload(iid, MODEL, 1), **bad))
    assert isinstance(reg, dict) and isinstance(reg.get("error"), str) and reg["error"], \
        "a bad registration must come back with an error string: %r" % (reg,)
    # nothing was registered
    key = ipc_key(MODEL, 1, 0, tokens_of("bad", C), 0, C, "r")
    assert c.prepare_store(key, iid) == NO_SLOTS
    assert c.noop() == "OK"


NO_SLOTS = {"context": {"slots": [], "chunk_indices": []}}


# ----------------------------------------------------------------------------------------
# Store and retrieve


def test_store_lookup_retrieve_round_trip(door):
    """The engine-driven cycle: lookup misses; prepare_store hands out slots that stay
    invisible until commit_store; then lookup hits, and another worker process (another
    instance, another DEALER) reads the bytes back through its own mapping."""
    door.start()
    w = Worker(door)
    sched = door.client()
    toks = tokens_of("rt", 4 * C + 5)              # a trailing partial chunk
    assert hits(sched, MODEL, 1, toks) == 0
    slots, idx = w.prepare(toks, 0, 4 * C, request_id="rt")
    assert idx == [0, 1, 2, 3], idx
    w.write(slots, idx, 0, "rt")
    assert hits(sched, MODEL, 1, toks) == 0, "chunks visible before commit_store"
    other = Worker(door)
    assert other.retrieve(toks, 0, 4 * C) is None, "prepare_retrieve saw uncommitted chunks"
    assert w.commit(toks, 0, 4 * C, request_id="rt") is True

    r = rid("rt")
    sched.lookup(ipc_key(MODEL, 1, None, toks, 0, 4 * C, r), 1)
    assert sched.query_prefetch_status(r) == 4
    got = other.retrieve(toks, 0, 4 * C)
    assert got == w.expected("rt", 0, 4), "bytes read back differ from those written"
    assert other.retrieve(toks, C, 3 * C) == w.expected("rt", 1, 3)
    sched.end_session(r)


def test_prepare_store_skips_stored_chunks(door):
    """Ranges advance over steps; chunk_indices are relative to start; stored chunks are left
    out; an all-cached prepare gives no slots and its commit_store is False."""
    door.start()
    w = Worker(door)
    toks = tokens_of("adv", 6 * C)
    assert w.store(toks, 0, 2 * C, "adv") == [0, 1]
    assert w.store(toks, 2 * C, 4 * C, "adv") == [0, 1]            # relative to start
    slots, idx = w.prepare(toks, 0, 6 * C)                          # 0..3 stored: 4, 5 left
    assert idx == [4, 5], idx
    w.write(slots, idx, 0, "adv")
    assert w.commit(toks, 0, 6 * C) is True
    slots, idx = w.prepare(toks, 0, 6 * C)
    assert slots == [] and idx == [], "all cached: nothing to write"
    assert w.commit(toks, 0, 6 * C) is False, "commit_store after an all-cached prepare"
    assert w.retrieve(toks, 0, 6 * C) == w.expected("adv", 0, 6)
    assert w.retrieve(toks, 4 * C, 6 * C) == w.expected("adv", 4, 6)
    assert w.retrieve(tokens_of("adv", 7 * C), 0, 7 * C) is None    # chunk 6 missing: a miss


def test_commit_store_refusals(door):
    door.start()
    w = Worker(door)
    toks = tokens_of("cs", 2 * C)
    assert w.commit(toks, 0, 2 * C) is False, "commit_store without a prepare"
    slots, idx = w.prepare(toks, 0, 2 * C)
    w.write(slots, idx, 0, "cs")
    # the pickle path: refused in-band (false), and the reservation is discarded
    assert w.c.commit_store(w.key(toks, 0, 2 * C), w.iid, b"\x80\x04pickled") is False
    assert w.c.noop() == "OK"
    assert hits(door.client(), MODEL, 1, toks) == 0
    assert w.store(toks, 0, 2 * C, "cs") == [0, 1]


def test_null_chunk_mask(door):
    """Chunks whose null_chunk_mask[0][i] is true are not stored (prefix stops there)."""
    door.start()
    w = Worker(door)
    sched = door.client()
    toks = tokens_of("null", 4 * C)
    mask = [[False, True, False, False]]
    slots, idx = w.prepare(toks, 0, 4 * C, null_chunk_mask=mask)
    assert idx == [0, 2, 3], idx
    w.write(slots, idx, 0, "null")
    assert w.commit(toks, 0, 4 * C, null_chunk_mask=mask) is True
    assert hits(sched, MODEL, 1, toks) == 1
    assert w.retrieve(toks, 0, 4 * C) is None
    assert w.retrieve(toks, 0, C) == w.expected("null", 0, 1)
    assert w.retrieve(toks, 2 * C, 4 * C) == w.expected("null", 2, 4)


def test_unknown_instance_is_answered_in_band(door):
    """A transfer from an instance that is not registered is answered in its own reply type
    (no slots, a miss, false) rather than with an error reply, which the newest LMCache client
    cannot read and would wait out its mq_timeout on; the daemon logs it."""
    door.start()
    w = Worker(door)                               # a context for the model exists
    c = door.client()
    iid = new_instance_id()
    toks = tokens_of("ui", C)
    w.store(toks, 0, C, "ui")
    k = ipc_key(MODEL, 1, 0, toks, 0, C, "r")
    assert c.prepare_store(k, iid) == NO_SLOTS
    assert c.commit_store(k, iid, b"") is False
    assert c.prepare_retrieve(k, iid) == {"success": False, "data": b"",
                                          "context": {"slots": []}}
    assert c.commit_retrieve(k, iid) is False
    assert c.noop() == "OK"
    assert "which is not registered" in door.d.stderr_text()


# ----------------------------------------------------------------------------------------
# Lookup and prefetch status


def test_prefetch_status_semantics(door):
    door.start()
    w = Worker(door)
    c = door.client()
    toks = tokens_of("pf", 3 * C + 7)
    w.store(toks, 0, 3 * C, "pf")
    r = rid("pf")
    c.lookup(ipc_key(MODEL, 1, None, toks, 0, len(toks), r), 1)    # end not aligned: aligned down
    assert c.query_prefetch_lookup_hits(r) == 3
    assert c.query_prefetch_lookup_hits(r) == 3                    # does not consume
    assert c.query_prefetch_status(r) == 3
    assert c.query_prefetch_status(r) == 0                         # exactly once
    assert c.query_prefetch_lookup_hits(r) == 0
    c.end_session(r)
    r = rid("pf")
    c.lookup(ipc_key(MODEL, 1, None, toks, 0, 3 * C, r), 1)
    n = c.wait_prefetch_status(r, 2.0)
    assert n == 3 and type(n) is int
    assert c.wait_prefetch_status(r, 0.5) == 0
    assert c.wait_prefetch_status(rid("unknown"), 0.5) == 0
    assert c.query_prefetch_lookup_hits(rid("unknown")) == 0
    assert c.query_prefetch_status(rid("unknown")) == 0
    c.free_lookup_locks(ipc_key(MODEL, 1, None, toks, 0, 3 * C, r), 1)
    c.end_session(r)


def test_partial_prefixes_and_world_size(door):
    door.start()
    sched = door.client()
    # one worker: chunks 0..3 of 6 -> 4 hits; a lookup only looks at token_ids[0:end]
    w = Worker(door, model="m-tp1")
    toks = tokens_of("pp", 6 * C)
    w.store(toks, 0, 4 * C, "pp")
    assert hits(sched, "m-tp1", 1, toks) == 4
    assert hits(sched, "m-tp1", 1, toks, end=2 * C) == 2
    assert hits(sched, "m-tp1", 1, toks[:3 * C] + tokens_of("other", 3 * C)) == 3
    assert hits(sched, "m-tp1", 1, tokens_of("other", 6 * C)) == 0
    # a chunk is a hit only when every worker of the world has stored its piece
    w0 = Worker(door, model="m-tp2", world_size=2, rank=0)
    w1 = Worker(door, model="m-tp2", world_size=2, rank=1)
    w0.store(toks, 0, 4 * C, "tp2")
    assert hits(sched, "m-tp2", 2, toks) == 0
    assert w1.retrieve(toks, 0, C) is None
    w1.store(toks, 0, 4 * C, "tp2")
    assert hits(sched, "m-tp2", 2, toks) == 4
    w0.store(toks, 4 * C, 6 * C, "tp2")
    assert hits(sched, "m-tp2", 2, toks) == 4
    w1.store(toks, 4 * C, 6 * C, "tp2")
    assert hits(sched, "m-tp2", 2, toks) == 6
    # each worker reads its own piece back
    assert w0.retrieve(toks, 0, 6 * C) == w0.expected("tp2", 0, 6)
    assert w1.retrieve(toks, 0, 6 * C) == w1.expected("tp2", 0, 6)
    assert w0.expected("tp2", 0, 1) != w1.expected("tp2", 0, 1)
    # the same tokens under world_size 1 of the same model name are other objects
    assert hits(sched, "m-tp2", 1, toks) == 0


def test_cache_salt_isolation(door):
    door.start()
    w = Worker(door)
    sched = door.client()
    toks = tokens_of("salt", 4 * C)
    w.store(toks, 0, 4 * C, "salt-a", salt="a")
    assert [hits(sched, MODEL, 1, toks, salt=s) for s in ("a", "b", "")] == [4, 0, 0]
    assert w.retrieve(toks, 0, 4 * C, salt="b") is None
    assert w.retrieve(toks, 0, 4 * C, salt="") is None
    slots, idx = w.prepare(toks, 0, 4 * C, salt="")              # nothing stored without salt
    assert idx == [0, 1, 2, 3]
    w.write(slots, idx, 0, "salt-none")
    assert w.commit(toks, 0, 4 * C, salt="") is True
    assert [hits(sched, MODEL, 1, toks, salt=s) for s in ("a", "b", "")] == [4, 0, 4]
    assert w.retrieve(toks, 0, 4 * C, salt="a") == w.expected("salt-a", 0, 4)
    assert w.retrieve(toks, 0, 4 * C, salt="") == w.expected("salt-none", 0, 4)


# ----------------------------------------------------------------------------------------
# Both doors, the same objects


@pytest.mark.parametrize("salt", ["tenant-x", ""], ids=["salt", "nosalt"])
def test_lmcache_store_seen_by_v1(door, salt):
    """What LMCache worker w stores for (M, W, S) is the v1 object in ns lmcache/M/W/w, salt S,
    under HASH_TOKENS' keys."""
    door.start()
    w0 = Worker(door, world_size=2, rank=0)
    w1 = Worker(door, world_size=2, rank=1)
    toks = tokens_of("x1", 3 * C + 3)
    w0.store(toks, 0, 3 * C, "x1", salt=salt)
    w1.store(toks, 0, 3 * C, "x1", salt=salt)
    v1 = door.v1()
    keys = v1.hash_tokens(toks, salt=salt or None)
    assert len(keys) == 3
    for w in (w0, w1):
        ns = ns_of(MODEL, 2, w.rank)
        assert v1.lookup(ns, keys, salt=salt or None).hits == 3
        assert v1.get(ns, keys, salt=salt or None) == w.expected("x1", 0, 3)
    assert v1.lookup(ns_of(MODEL, 2, 0), keys, salt="other").hits == 0
    assert v1.lookup(ns_of(MODEL, 1, 0), keys, salt=salt or None).hits == 0


@pytest.mark.parametrize("salt", ["tenant-y", ""], ids=["salt", "nosalt"])
def test_v1_put_seen_by_lmcache(door, salt):
    door.start()
    w = Worker(door)
    sched = door.client()
    v1 = door.v1()
    toks = tokens_of("x2", 4 * C)
    keys = v1.hash_tokens(toks, salt=salt or None)
    datas = w.expected("x2", 0, 4)
    assert v1.put(ns_of(MODEL, 1, 0), keys[:3], datas[:3], salt=salt or None) == 3
    assert hits(sched, MODEL, 1, toks, salt=salt) == 3
    assert hits(sched, MODEL, 1, toks, salt="zzz" if salt else "tenant-y") == 0
    assert w.retrieve(toks, 0, 3 * C, salt=salt) == datas[:3]
    assert w.retrieve(toks, 0, 4 * C, salt=salt) is None
    # and the LMCache door does not store again what v1 put
    slots, idx = w.prepare(toks, 0, 4 * C, salt=salt)
    assert idx == [3], idx
    w.write(slots, idx, 0, "x2")
    assert w.commit(toks, 0, 4 * C, salt=salt) is True
    assert v1.get(ns_of(MODEL, 1, 0), keys, salt=salt or None) == datas


def test_doors_serve_together(door):
    """v1 lookups keep being answered while LMCache stores go on, and each v1 lookup sees an
    LMCache chunk only after its commit_store."""
    door.start()
    w = Worker(door)
    v1 = door.v1("lmc-v1-main")
    toks = tokens_of("both", 8 * C)
    ns = ns_of(MODEL, 1, 0)
    keys = v1.hash_tokens(toks)
    stop = threading.Event()
    seen, errors = [], []

    def background():
        try:
            with kvtier.Client(door.d.tcp, client="lmc-v1-bg") as bg:
                while not stop.is_set():
                    seen.append(bg.lookup(ns, keys).hits)
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=background, daemon=True)
    t.start()
    try:
        for i in range(8):
            slots, idx = w.prepare(toks, i * C, (i + 1) * C)
            assert idx == [0]
            assert v1.lookup(ns, keys).hits == i, "visible before commit_store"
            w.write(slots, idx, i * C, "both")
            assert v1.lookup(ns, keys).hits == i
            assert w.commit(toks, i * C, (i + 1) * C) is True
            assert v1.lookup(ns, keys).hits == i + 1
        wait_until(lambda: len(seen) >= 5, timeout=5.0, what="background v1 lookups")
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    assert not errors, errors
    assert seen == sorted(seen) and max(seen) <= 8, seen
    assert v1.get(ns, keys) == w.expected("both", 0, 8)


# ----------------------------------------------------------------------------------------
# Sessions, locks, clear, unregister


def test_end_session_free_locks_and_clear(door):
    door.start()
    w = Worker(door)
    c = door.client()
    v1 = door.v1()
    other = v1.put("not-lmcache/ns", [b"k" * 16], [b"survives"])
    assert other == 1
    toks = tokens_of("clr", 4 * C)
    w.store(toks, 0, 4 * C, "clr")
    r = rid("clr")
    k = ipc_key(MODEL, 1, None, toks, 0, 4 * C, r)
    c.lookup(k, 1)
    assert c.query_prefetch_status(r) == 4
    c.free_lookup_locks(k, 1)                      # vLLM will not load them
    c.end_session(r)
    c.end_session(r, {"finish_reason": "stop", "stop_token_id": 2})   # 2 frames: also an ack
    c.end_session(rid("x"), {})
    c.clear(False)
    assert hits(c, MODEL, 1, toks) == 0, "clear(False) left unlocked objects"
    assert w.retrieve(toks, 0, 4 * C) is None
    assert v1.get("not-lmcache/ns", [b"k" * 16]) == [b"survives"], \
        "clear on the LMCache door removed an object outside its namespaces"
    w.store(toks, 0, 4 * C, "clr2")
    assert hits(c, MODEL, 1, toks) == 4
    c.clear(True)
    assert hits(c, MODEL, 1, toks) == 0
    assert c.noop() == "OK"


def test_unregister(door):
    door.start()
    w = Worker(door)
    reader = Worker(door)
    sched = door.client()
    toks = tokens_of("unreg", 4 * C)
    w.store(toks, 0, 2 * C, "unreg")                             # committed: stays
    slots, idx = w.prepare(toks, 0, 4 * C)                       # uncommitted: discarded
    assert idx == [2, 3]
    w.write(slots, idx, 0, "unreg")
    w.c.unregister(w.iid)
    assert w.c.commit_store(w.key(toks, 0, 4 * C), w.iid, b"") is False
    assert w.c.prepare_store(w.key(toks, 0, 4 * C), w.iid) == NO_SLOTS
    assert hits(sched, MODEL, 1, toks) == 2
    assert reader.retrieve(toks, 0, 4 * C) is None
    assert reader.retrieve(toks, 0, 2 * C) == w.expected("unreg", 0, 2)
    sched.unregister(new_instance_id())                          # unknown: an ack too
    sched.unregister(w.iid)                                      # again: an ack
    # the same worker registers again and stores the rest
    w2 = Worker(door, instance_id=w.iid)
    assert w2.store(toks, 0, 4 * C, "unreg") == [2, 3]
    assert hits(sched, MODEL, 1, toks) == 4


# ----------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize("op,nargs,mention", [
    (1, 1, "register_kv_cache"), (6, 3, "store"), (7, 3, "retrieve"),
    (29, 0, "p2p_lookup_and_lock"), (33, 0, "cb_protocol_handshake"), (99, 0, "99"),
    ("frobnicate", 1, "frobnicate")])
def test_unsupported_and_unknown_ops(door, op, nargs, mention):
    door.start()
    c = door.client()
    args = [{"model_name": MODEL}, new_instance_id(), b""][:nargs]
    assert_remote(c.error(op, *args), "unknown_type", mention)
    assert c.noop() == "OK"


MAL_IID = (1 << 62) | 0x1234            # the instance registered by test_malformed_requests


def _malformed_cases():
    iid = pack(MAL_IID)
    toks = tokens_of("mal", 2 * C)
    k = ipc_key(MODEL, 1, 0, toks, 0, 2 * C, "r")
    kb = pack(k)
    bad_start = dict(k, start="0")
    no_model = {f: v for f, v in k.items() if f != "model_name"}
    return [
        ("get_chunk_size+arg", OPS["get_chunk_size"], [pack(1)]),
        ("noop+arg", OPS["noop"], [pack(None)]),
        ("lookup-1arg", OPS["lookup"], [kb]),
        ("prepare_store-3args", OPS["prepare_store"], [kb, iid, pack(2)]),
        ("commit_store-2args", OPS["commit_store"], [kb, iid]),
        ("end_session-3args", OPS["end_session"], [pack("r"), pack({}), pack({})]),
        ("end_session-0args", OPS["end_session"], []),
        ("register-0args", OPS["register_kv_cache_engine_driven_context"], []),
        ("instance_id-str", OPS["prepare_store"], [kb, pack("123")]),
        ("tp_size-str", OPS["lookup"], [kb, pack("1")]),
        ("request_id-int", OPS["query_prefetch_status"], [pack(5)]),
        ("ping-str", OPS["ping"], [pack("abc")]),
        ("key-start-str", OPS["prepare_store"], [pack(bad_start), iid]),
        ("key-not-map", OPS["prepare_store"], [pack([1, 2]), iid]),
        ("key-no-model_name", OPS["prepare_retrieve"], [pack(no_model), iid]),
        ("key-truncated", OPS["prepare_store"], [kb[:len(kb) // 2], iid]),
        ("data-str", OPS["commit_store"], [kb, iid, pack("")]),
        ("payload-truncated", OPS["register_kv_cache_engine_driven_context"],
         [pack(LAY.payload(1, MODEL, 1))[:-3]]),
        ("int-truncated", OPS["unregister_kv_cache_engine_driven_context"], [b"\xcf\x00\x01"]),
        ("trailing-bytes", OPS["query_prefetch_status"], [pack("r") + b"\x00"]),
        ("empty-arg-frame", OPS["query_prefetch_status"], [b""]),
    ]


@pytest.mark.parametrize("name,op,frames", _malformed_cases(), ids=[c[0] for c in
                                                                    _malformed_cases()])
def test_malformed_requests(door, name, op, frames):
    door.start()
    Worker(door, instance_id=MAL_IID)
    c = door.client()
    if op == OPS["register_kv_cache_engine_driven_context"] and len(frames) == 1:
        # a registration is refused in its own response (`error`), which every client reads
        reg = c.call(op, raw_args=frames)
        assert isinstance(reg, dict) and "payload" in (reg.get("error") or ""), reg
    else:
        assert_remote(c.error(op, raw_args=frames), "bad_request")
    assert c.noop() == "OK", "the door stopped serving after %s" % name


def test_stream_control_and_short_messages_get_no_reply(door):
    door.start()
    c = door.client()
    for rest in ([b"", b"ack"], [b"", b"cancel"], [b"", pack(OPS["noop"])], []):
        c.send_frames([c.next_uid()] + rest)          # uids 0..3; the noop below gets 4
        c.expect_silence(0.3)
    c.send_frames([b""])
    c.expect_silence(0.3)
    assert c.noop() == "OK"          # its reply (uid 4) is the next one: nothing stray
    c.expect_silence(0.2)
    assert door.d.alive()


# ----------------------------------------------------------------------------------------
# A worker killed with its reservations


def test_killed_worker_reservations_come_back(door):
    lease_ms = 1000
    door.start("--lease-ms", str(lease_ms))
    big = Layout(2, 1024, "float16", C)                      # 128 KiB per chunk
    probe = door.client()
    reg = probe.register(big.payload(new_instance_id(), "crash", 1))
    check_register(reg)
    n = int(reg["pool_size"] * 0.75) // big.nbytes            # 3/4 of the pool: two do not fit
    assert n >= 8 and 2 * n * big.nbytes > reg["pool_size"]
    args = {"endpoint": door.endpoint, "instance_id": new_instance_id(), "model": "crash",
            "num_layers": 2, "hidden": 1024, "dtype": "float16", "chunk": C, "chunks": n,
            "seed": "crashed", "ping_s": lease_ms / 5000.0}
    proc = subprocess.Popen([sys.executable, os.path.join(_HERE, "lmc_client.py"),
                             "crash-worker", json.dumps(args)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        line = proc.stdout.readline() if ready else b""
        assert line, "the worker did not get ready (%s): %s" % (
            proc.poll(), proc.stderr.read().decode() if proc.poll() is not None else "")
        info = json.loads(line)
        assert info["slots"] == n and info["indices"] == list(range(n)), info

        def try_store(seed):
            """A fresh instance prepare_stores n chunks; all n -> committed, True. Fewer (or
            a refusal) -> its reservation is dropped with unregister, False."""
            w = Worker(door, model="crash", layout=big)
            toks = tokens_of(seed, n * C)
            try:
                slots = w.prepare(toks, 0, n * C)[0]
            except RemoteError:
                slots = []
            if len(slots) < n:
                w.c.unregister(w.iid)
                w.shm.close()
                w.c.close()
                return False
            fill = bytes([0xa5]) * big.nbytes                  # cheap: well inside lease_ms
            for sl in slots:
                w.shm.write(sl["offset"], fill)
            assert w.commit(toks, 0, n * C) is True
            return True

        # while the worker lives (and pings), its reservations hold the space
        assert not try_store("while-alive"), "a second 3/4 of the pool fit beside the first"
        assert proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        deadline = t0 + lease_ms / 1000.0 + 4.0
        ok = False
        while not ok and time.monotonic() < deadline:
            ok = try_store("after-kill")
            if not ok:
                time.sleep(0.1)
        assert ok, "the killed worker's reservations did not come back within %.1f s" % (
            deadline - t0)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
    w = Worker(door, model="crash", layout=big)      # a live context for (crash, 1)
    assert hits(probe, "crash", 1, tokens_of("after-kill", n * C)) == n
    assert hits(probe, "crash", 1, tokens_of("crashed", n * C)) == 0, \
        "a killed worker's uncommitted chunks became visible"
    assert w.retrieve(tokens_of("crashed", n * C), 0, C) is None
    assert door.d.alive()


# ----------------------------------------------------------------------------------------
# Operations: /metrics and /status


def test_metrics_count_requests_by_op(door):
    door.start()
    d = door.d
    c = door.client()

    def counts():
        fams, samples = d.metrics()
        assert fams.get(REQ_METRIC, {}).get("type") in (None, "counter"), fams.get(REQ_METRIC)
        return {op: metric_value(samples, REQ_METRIC, op=op) or 0
                for op in ("noop", "get_chunk_size", "ping",
                           "register_kv_cache_engine_driven_context")}

    before = counts()
    for _ in range(3):
        c.noop()
    c.call("noop")                                             # by name: the same op
    c.get_chunk_size()
    c.get_chunk_size()
    c.ping(None)
    Worker(door)
    want = dict(before)
    want["noop"] += 4
    want["get_chunk_size"] += 2
    want["ping"] += 1
    want["register_kv_cache_engine_driven_context"] += 1
    wait_until(lambda: counts() == want, timeout=3.0,
               what="%s by op to reach %r" % (REQ_METRIC, want))
    fams, _ = d.metrics()
    assert fams[REQ_METRIC]["type"] == "counter"


def test_status_lists_contexts(door):
    door.start()
    d = door.d
    w = Worker(door, world_size=2, rank=1)

    def entry():
        lm = d.http_json("GET", "/status").get("lmcache")
        assert isinstance(lm, dict), "/status has no lmcache object"
        assert lm.get("endpoint") == door.endpoint, lm
        assert isinstance(lm.get("contexts"), list), lm
        # issue 28: the id, the only credential of LMCache's wire, is not published
        assert all("instance_id" not in x for x in lm["contexts"]), lm["contexts"]
        assert str(w.iid) not in json.dumps(lm), lm
        found = [x for x in lm["contexts"] if x.get("model_name") == MODEL]
        assert len(found) <= 1, lm["contexts"]
        if found:
            assert isinstance(found[0]["worker"], str) and len(found[0]["worker"]) == 12
        return found[0] if found else None

    e = entry()
    assert e is not None, d.http_json("GET", "/status")["lmcache"]
    assert e["model_name"] == MODEL and e["world_size"] == 2, e
    w.c.unregister(w.iid)
    wait_until(lambda: entry() is None, timeout=3.0, what="the context to leave /status")


def test_lookup_loads_what_only_l2_has(door):
    """Chunks written behind to L2 and then dropped from L1: the scheduler's lookup loads them
    back (query_prefetch_status is None while the loads run), then counts and locks them, and
    the worker's prepare_retrieve reads the bytes it stored."""
    door.start(l2="mock:latency_ms=100")
    w = Worker(door)
    sched = door.client()
    toks = tokens_of("l2", 3 * C)
    assert w.store(toks, 0, 3 * C, "l2") == [0, 1, 2]

    def l2_stored():
        _, samples = door.d.metrics()
        return sum(x.value for x in samples if x.name == "kvtier_l2_stored_total")
    wait_until(lambda: l2_stored() >= 3, 10, what="write-behind of the 3 chunks to L2")
    sched.clear(True)                                   # L1 only: L2 keeps its copies
    assert w.retrieve(toks, 0, 3 * C) is None           # not in L1 any more
    r = rid("l2")
    sched.lookup(ipc_key(MODEL, 1, None, toks, 0, 3 * C, r), 1)
    assert sched.query_prefetch_lookup_hits(r) is None  # 3 loads of 100 ms each are running
    assert sched.query_prefetch_status(r) is None
    assert sched.wait_prefetch_status(r, 10.0) == 3
    assert w.retrieve(toks, 0, 3 * C) == w.expected("l2", 0, 3)
    sched.end_session(r)
    assert door.d.http_json("GET", "/status")["lmcache"]["lookups_loading"] == 0


def test_same_prompt_in_two_requests_commits_only_its_own(door):
    """Two requests with the same prompt prepare the same chunks: the one that got the slots
    publishes them at its commit, never at the other's (which had nothing to write)."""
    door.start()
    w = Worker(door)
    sched = door.client()
    toks = tokens_of("twin", 4 * C)
    slots, idx = w.prepare(toks, 0, 4 * C, request_id="twin-a")
    assert idx == [0, 1, 2, 3]
    assert w.prepare(toks, 0, 4 * C, request_id="twin-b") == ([], [])   # being stored by a
    assert w.commit(toks, 0, 4 * C, request_id="twin-b") is False       # nothing of b's
    assert hits(sched, MODEL, 1, toks) == 0                              # a's not published
    w.write(slots, idx, 0, "twin")
    assert w.commit(toks, 0, 4 * C, request_id="twin-a") is True
    assert hits(sched, MODEL, 1, toks) == 4
    assert w.retrieve(toks, 0, 4 * C) == w.expected("twin", 0, 4)


def test_lookup_of_an_unregistered_deployment_finds_nothing(door):
    """Like LMCache's server, a lookup for a (model, world_size) no worker registered answers
    0 hits and locks nothing, even when v1 stored the chunks; once a worker registers, they
    are found."""
    door.start()
    sched = door.client()
    v1 = door.v1()
    toks = tokens_of("unreg-dep", 2 * C)
    keys = v1.hash_tokens(toks)
    datas = [chunk_data("unreg-dep", 0, i, LAY.nbytes) for i in range(2)]
    assert v1.put(ns_of(MODEL, 1, 0), keys, datas) == 2
    assert hits(sched, MODEL, 1, toks) == 0
    assert hits(sched, MODEL, 1024, toks) == 0          # a huge world_size costs nothing either
    Worker(door)
    assert hits(sched, MODEL, 1, toks) == 2


# ----------------------------------------------------------------------------------------
# One cache service under both doors


def _l2_stored(door):
    _, samples = door.d.metrics()
    return sum(x.value for x in samples if x.name == "kvtier_l2_stored_total")


def test_lookups_on_a_slow_l2_overlap_and_never_block_the_door(door):
    """Eight deployments, their chunks only in an L2 that takes 400 ms per call: the eight
    lookups sent at once are acknowledged at once and the door answers a noop meanwhile (its
    thread never waits on L2: the cache service's lookup threads probe, and each lookup comes
    back to the door's queue), v1 LOOKUPs keep their p99 meanwhile, and all eight have their
    chunk loaded after about one probe and one load (~0.8 s), not eight probes in a row
    (>= 3.2 s, as when the door probed L2 on its own thread)."""
    door.start("--l2-lookup-threads", "8", "--l2-prefetch-threads", "8",
               l2="mock:latency_ms=400")
    workers = [Worker(door, model="slow/m%d" % i) for i in range(8)]
    toks = tokens_of("slow", C)
    for w in workers:
        assert w.store(toks, 0, C, "slow") == [0]
    wait_until(lambda: _l2_stored(door) >= 8, 30, what="write-behind of the 8 chunks")
    probe = door.client()
    probe.clear(True)                                   # L1 only: L2 keeps its copies
    v1 = door.v1("slow-v1")                             # a v1 client with its keys in L1
    v1_keys = [bytes([i]) * 16 for i in range(8)]
    assert v1.put("slow-v1", v1_keys, [b"v" * 4096] * 8) == 8
    scheds = [door.client() for _ in workers]
    rids = [rid("slow") for _ in workers]
    t0 = time.monotonic()
    sent = [s.send(OPS["lookup"], ipc_key(w.model, 1, None, toks, 0, C, r), 1)
            for s, w, r in zip(scheds, workers, rids)]
    for s, (uid, opf) in zip(scheds, sent):
        s.recv(uid, opf)
    acked = time.monotonic() - t0
    t1 = time.monotonic()
    assert probe.noop() == "OK"
    noop_s = time.monotonic() - t1
    v1_ms = []                                          # v1 LOOKUPs while the L2 work runs
    for _ in range(100):
        t = time.monotonic()
        assert v1.lookup("slow-v1", v1_keys).hits == 8
        v1_ms.append((time.monotonic() - t) * 1000)
    v1_p99 = sorted(v1_ms)[98]
    waits = [s.send(OPS["wait_prefetch_status"], r, 10.0) for s, r in zip(scheds, rids)]
    hits = [s.recv(uid, opf, timeout=15).value for s, (uid, opf) in zip(scheds, waits)]
    total = time.monotonic() - t0
    assert hits == [1] * 8, hits
    assert acked < 0.4 and noop_s < 0.3, (acked, noop_s)
    assert v1_p99 < 50, "v1 LOOKUP p99 %.1f ms while the door's lookups waited on L2" % v1_p99
    assert total < 2.4, "8 lookups on a 400 ms L2 took %.2f s: they queued" % total
    for w in workers:
        assert w.retrieve(toks, 0, C) == w.expected("slow", 0, 1)
    _, samples = door.d.metrics()
    assert metric_value(samples, "kvtier_lookup_l2_total") >= 8


def test_max_instances_counts_both_doors(door):
    """--max-instances 3: two v1 instances and one LMCache worker fill it; the next of either
    door is refused (HELLO busy, the registration's `error`). A worker's prepared store is a
    lease of its owner: unregistering releases it and makes room for a v1 instance."""
    door.start("--max-instances", "3")
    door.v1("cap")
    door.v1("cap")
    w = Worker(door, model="cap/m")
    c = door.client()
    reg = c.register(LAY.payload(new_instance_id(), "cap/m2", 1))
    assert reg["error"] and "max_instances (3)" in reg["error"], reg
    with pytest.raises(kvtier.KvtierError) as e:
        door.v1("cap")
    assert e.value.code == "busy" and "max_instances (3)" in str(e.value), e.value
    _, samples = door.d.metrics()
    owners = {s.labels.get("kind"): s.value for s in samples if s.name == "kvtier_owners"}
    assert owners == {"v1": 2, "lmcache": 1, "lmcache_client": 0}, owners
    toks = tokens_of("cap", 2 * C)
    slots, idx = w.prepare(toks, 0, 2 * C)
    assert idx == [0, 1]
    assert metric_value(door.d.metrics()[1], "kvtier_leases_active") == 1
    w.c.unregister(w.iid)
    assert metric_value(door.d.metrics()[1], "kvtier_leases_active") == 0
    door.v1("cap")                                     # the worker's place is free again


def test_one_liveness_rule_for_both_doors(door):
    """The cache service's rule, applied by each door to its owners: silent past lease_ms an
    owner's leases are void; silent past its kind's keep-alive (v1: lease_ms; an LMCache worker:
    lmcache.reap_timeout_s) it is closed. A pinging worker keeps everything; a silent one first
    loses its prepared transfer, then its registration; a v1 instance with its heartbeat off
    goes at lease_ms."""
    lease_ms = 600
    door.start("--lease-ms", str(lease_ms), "--lmcache-reap-timeout-s", "2")
    live, silent = Worker(door, model="live/m"), Worker(door, model="silent/m")
    os.environ["KVTIER_HEARTBEAT_MS"] = "0"
    try:
        v1 = door.v1("quiet")
        v1.ping()
    finally:
        del os.environ["KVTIER_HEARTBEAT_MS"]

    def owners():
        return {s.labels.get("kind"): s.value for s in door.d.metrics()[1]
                if s.name == "kvtier_owners"}

    assert owners() == {"v1": 1, "lmcache": 2, "lmcache_client": 0}
    toks = tokens_of("alive", 2 * C)
    assert silent.prepare(toks, 0, 2 * C)[1] == [0, 1]
    t0 = time.monotonic()
    leases = metric_value(door.d.metrics()[1], "kvtier_leases_active")
    assert leases == 1
    # lease_ms of silence: the v1 instance is gone, the silent worker's transfer is void, its
    # registration stays
    while time.monotonic() - t0 < 1.5:
        live.c.ping(live.iid)
        if (owners().get("v1", 0) == 0 and
                metric_value(door.d.metrics()[1], "kvtier_leases_active") == 0):
            break
        time.sleep(0.1)
    assert owners() == {"v1": 0, "lmcache": 2, "lmcache_client": 0}, owners()
    assert metric_value(door.d.metrics()[1], "kvtier_leases_active") == 0
    assert time.monotonic() - t0 >= lease_ms / 1000.0 - 0.05
    # past reap_timeout_s the silent worker is closed; the pinging one is not
    while time.monotonic() - t0 < 4.5 and owners().get("lmcache") != 1:
        live.c.ping(live.iid)
        time.sleep(0.1)
    assert owners() == {"v1": 0, "lmcache": 1, "lmcache_client": 0}, owners()
    assert time.monotonic() - t0 >= 1.9
    assert silent.c.prepare_store(silent.key(toks, 0, C), silent.iid) == NO_SLOTS
    assert "silent past lmcache.reap_timeout_s" in door.d.stderr_text()
    assert live.store(toks, 0, 2 * C, "alive") == [0, 1]



# ----------------------------------------------------------------------------------------
# Issue 28: no door client acts for another


def test_a_worker_belongs_to_the_connection_that_registered_it(door):
    """Another DEALER that knows a live worker's instance_id can neither unregister it, nor
    store or read as it, nor renew it, nor re-register the id with another layout; the worker
    never notices. Nothing in /status gives the id away."""
    door.start()
    w = Worker(door)
    toks = tokens_of("owned", 2 * C)
    assert w.store(toks, 0, C, "owned") == [0]
    hostile = door.client()
    hostile.unregister(w.iid)                          # an ack, and nothing happens
    assert hostile.prepare_store(w.key(toks, C, 2 * C), w.iid) == NO_SLOTS
    assert hostile.commit_store(w.key(toks, 0, C), w.iid, b"") is False
    got = hostile.prepare_retrieve(w.key(toks, 0, C), w.iid)
    assert got["success"] is False and got["context"]["slots"] == [], got
    assert hostile.commit_retrieve(w.key(toks, 0, C), w.iid) is False
    assert hostile.ping(w.iid) is True                 # always true, as LMCache requires
    bad = hostile.register(Layout(3, 64, "float16", C).payload(w.iid, MODEL, 1))
    assert bad["error"], bad
    # the worker carries on with its registration, layout and data
    assert w.store(toks, C, 2 * C, "owned") == [0]    # chunk 1, index 0 of the range
    assert w.retrieve(toks, 0, 2 * C) == w.expected("owned", 0, 2)
    assert "registered by another connection" in door.d.stderr_text() or \
        "other than the one that registered it" in door.d.stderr_text()
    assert str(w.iid) not in json.dumps(door.d.http_json("GET", "/status"))


def test_registrations_per_connection_are_capped(door):
    """One DEALER cannot register thousands of workers and lock real ones out: it gets
    max_instances_per_connection, as a v1 connection gets that many instances."""
    door.start("--max-instances-per-connection", "3")
    c = door.client()
    for i in range(3):
        check_register(c.register(LAY.payload(new_instance_id(), "cap/%d" % i, 1)))
    reg = c.register(LAY.payload(new_instance_id(), "cap/3", 1))
    assert "max_instances_per_connection" in (reg["error"] or ""), reg
    Worker(door, model="cap/other")                    # another connection still registers
    _, samples = door.d.metrics()
    owners = {s.labels.get("kind"): s.value for s in samples if s.name == "kvtier_owners"}
    assert owners["lmcache"] == 4, owners


def test_a_door_client_that_stops_reading_is_cut(door):
    """A worker that sends and never reads its replies is disconnected once they hold more
    than max_reply_backlog bytes of daemon memory (or stop moving for reply_timeout_ms), as on
    protocol v1, instead of piling them up in the daemon (1,000 unread replies of 1.1 MiB grew
    its RSS by a GiB before). Here: prepare_retrieve of 2,048 stored chunks, ~100 KB a reply."""
    door.start("--max-reply-backlog", "1M", transport="tcp")
    small = Layout(1, 8, "float16", C)
    n = 2048
    w = Worker(door, model="flood", layout=small)
    toks = tokens_of("flood", n * C)
    assert len(w.store(toks, 0, n * C, "flood")) == n
    c = LmcClient(door.endpoint, ctx=door.ctx,
                  sockopts={zmq.RCVHWM: 1, zmq.RCVBUF: 4096, zmq.SNDHWM: 0})
    door._clients.append(c)
    iid = new_instance_id()
    check_register(c.register(small.payload(iid, "flood", 1)))
    key = ipc_key("flood", 1, 0, toks, 0, n * C, "flood-req")
    for _ in range(200):                                 # ~20 MB of replies, none read
        c.send(OPS["prepare_retrieve"], key, iid)
    wait_until(lambda: "more reply bytes unread than max_reply_backlog" in door.d.stderr_text()
               or "stopped reading its replies" in door.d.stderr_text(),
               20, what="the connection that does not read to be cut")
    assert door.client().noop() == "OK"
    assert w.retrieve(toks, 0, C) == w.expected("flood", 0, 1)
    assert door.d.alive()


def test_lookup_locks_are_charged_to_the_asking_connection(door):
    """Read locks a lookup takes are leases of the asking connection's own owner: held to
    max_leased_bytes like a v1 client's (one DEALER pinned 12 MiB past a 1 MiB limit before),
    and released when that connection closes."""
    big = Layout(2, 1024, "float16", C)                 # 128 KiB per chunk
    door.start("--max-leased-bytes", "1M")
    w = Worker(door, model="locks", layout=big)
    toks = tokens_of("locks", 4 * C)
    assert w.store(toks, 0, 4 * C, "locks") == [0, 1, 2, 3]     # 512 KiB per lookup
    sched = door.client()
    got = [hits(sched, "locks", 1, toks) for _ in range(1)]
    # the session ends (end_session) in hits(): look up without ending, to keep the locks
    rids = []
    for i in range(5):
        r = rid("hold")
        sched.lookup(ipc_key("locks", 1, None, toks, 0, 4 * C, r), 1)
        rids.append((r, sched.query_prefetch_status(r)))
    counts = [n for _, n in rids]
    assert counts[:2] == [4, 4] and all(n < 4 for n in counts[2:]), counts
    assert got == [4]
    _, samples = door.d.metrics()
    owners = {s.labels.get("kind"): s.value for s in samples if s.name == "kvtier_owners"}
    assert owners["lmcache_client"] >= 1, owners
    sched.close()                                       # its locks go with it
    other = door.client()
    wait_until(lambda: hits(other, "locks", 1, toks) == 4, 5,
               what="the closed connection's locks to be released")


# ----------------------------------------------------------------------------------------
# Issue 30: a restart keeps the workers' registrations; an unknown worker registers again


class AdapterHeartbeat:
    """What LMCache's worker adapter does with its heartbeat (lmcache/integration/vllm/
    vllm_multi_process_adapter.py, HeartbeatThread, read at LMCache 64bcdd47): every interval
    ping(instance_id); a False reply or a timeout clears the health flag (degraded mode: store
    requests are not sent, loads are failed); a healthy ping after an unhealthy one registers
    the KV caches again under the same instance_id before the flag is set."""

    def __init__(self, worker):
        self.w, self.healthy, self.registrations = worker, True, 0

    def beat(self):
        try:
            ok = self.w.c.ping(self.w.iid) is True
        except AssertionError:          # no reply within the client's timeout
            ok = False
        if ok and not self.healthy:
            reg = self.w.c.register(self.w.layout.payload(self.w.iid, self.w.model,
                                                          self.w.world_size))
            check_register(reg)
            self.registrations += 1
        self.healthy = ok
        return ok

    def store(self, tokens, start, end, tag):
        """submit_store_request: nothing is sent while degraded (None)."""
        return self.w.store(tokens, start, end, tag) if self.healthy else None


def unknown_worker_requests(door):
    return metric_value(door.d.metrics()[1], "kvtier_lmcache_unknown_worker_requests_total")


def test_a_reaped_worker_registers_again(door):
    """A worker reaped while it stays reachable: its next heartbeat is answered false (the
    adapter stops sending stores instead of being told "all cached"), the one after true, and
    the adapter registers again and stores for real. Each such request is counted."""
    door.start("--lmcache-reap-timeout-s", "1", "--lease-ms", "400")
    w = Worker(door)
    hb = AdapterHeartbeat(w)
    toks = tokens_of("reap", 3 * C)
    assert hb.store(toks, 0, C, "reap") == [0]
    wait_until(lambda: "silent past lmcache.reap_timeout_s" in door.d.stderr_text(), 10,
               what="the worker to be reaped")
    before = unknown_worker_requests(door)
    assert hb.beat() is False and not hb.healthy
    assert hb.store(toks, C, 2 * C, "reap") is None          # degraded: nothing sent
    assert hb.beat() is True and hb.registrations == 1
    assert hb.store(toks, C, 3 * C, "reap") == [0, 1]
    assert w.retrieve(toks, 0, 3 * C) == w.expected("reap", 0, 3)
    assert unknown_worker_requests(door) == before + 2           # both pings
    st = door.d.http_json("GET", "/status")["lmcache"]
    assert st["registry"]["unknown_worker_requests"] == before + 2
    assert st["contexts_total"] == 1 and st["contexts"][0]["restored"] is False


def test_abort_store_drops_the_reservation_at_once(door):
    """abort_store (by method name; the newest worker sends it when its copy into prepared
    slots failed): the reservation goes at once, nothing of it is readable, the chunks can be
    prepared again, the commit that would follow is refused; no reservation: false."""
    door.start()
    w = Worker(door)
    sched = door.client()
    toks = tokens_of("abort", 2 * C)
    slots, idx = w.prepare(toks, 0, 2 * C)
    assert idx == [0, 1]
    w.shm.write(slots[0]["offset"], b"\xee" * 100)             # a copy that failed halfway
    leases = metric_value(door.d.metrics()[1], "kvtier_leases_active")
    assert w.c.call("abort_store", w.key(toks, 0, 2 * C), w.iid) is True
    assert metric_value(door.d.metrics()[1], "kvtier_leases_active") == leases - 1
    assert w.commit(toks, 0, 2 * C) is False, "commit_store after abort_store"
    assert hits(sched, MODEL, 1, toks) == 0
    assert w.retrieve(toks, 0, C) is None
    assert w.c.call("abort_store", w.key(toks, 0, 2 * C), w.iid) is False
    assert w.c.call("abort_store", w.key(toks, 0, 2 * C), new_instance_id()) is False
    assert w.store(toks, 0, 2 * C, "abort") == [0, 1]          # prepared again, stored
    assert w.retrieve(toks, 0, 2 * C) == w.expected("abort", 0, 2)
    err = w.c.error(35, w.key(toks, 0, C), w.iid)              # never by a number
    assert_remote(err, "unknown_type", "#35")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_carry_on_across_a_restart(door, sig):
    """l1.adopt: the daemon restarts on the same run dir; the worker (its DEALER reconnects by
    itself, as LMCache's does) neither registers again nor maps anything new: its chunks from
    before are read back byte-exact through the mapping it had, new stores land, no request is
    answered as from an unknown worker."""
    door.start("--l1-adopt")
    w = Worker(door)
    other = Worker(door, model="other/m", world_size=2, rank=1)
    toks = tokens_of("rs", 3 * C)
    assert w.store(toks, 0, 2 * C, "rs") == [0, 1]
    assert other.store(toks, 0, C, "rs") == [0]
    # Without l1_checksum a SIGKILL leaves out objects the checksum thread has not summed yet
    # (documented); this test is about the registrations, so the kill comes after the sums.
    wait_until(lambda: door.d.http_json("GET", "/status")["l1"]["adopt"]["sums_pending"] == 0, 10,
               what="every chunk summed")
    door.d.restart(sig)
    wait_until(lambda: door.d.http_json("GET", "/status")["lmcache"]["registry"]["restored"]
               == 2, 10, what="both registrations restored")
    st = door.d.http_json("GET", "/status")["lmcache"]
    assert all(c["restored"] for c in st["contexts"]), st
    assert "2 of the previous daemon's 2 worker registrations restored" in door.d.stderr_text()
    hb = AdapterHeartbeat(w)
    assert hb.beat() is True and hb.registrations == 0
    assert w.retrieve(toks, 0, 2 * C) == w.expected("rs", 0, 2)
    assert w.store(toks, 0, 3 * C, "rs") == [2]
    assert w.retrieve(toks, 0, 3 * C) == w.expected("rs", 0, 3)
    assert other.retrieve(toks, 0, C) == other.expected("rs", 0, 1)
    sched = door.client()
    assert hits(sched, MODEL, 1, toks) == 3
    assert unknown_worker_requests(door) == 0
    st = door.d.http_json("GET", "/status")["lmcache"]
    assert {c["model_name"]: c["restored"] for c in st["contexts"]} == \
        {MODEL: True, "other/m": True}
    # an unregistered worker is not brought back by the next restart
    other.c.unregister(other.iid)
    door.d.restart(signal.SIGTERM)
    st = door.d.http_json("GET", "/status")["lmcache"]
    assert [c["model_name"] for c in st["contexts"]] == [MODEL], st


def test_registrations_are_not_restored_for_a_new_arena(door):
    """Without l1.adopt the next daemon serves another arena file: the workers' mappings are
    of the old one, so their registrations are not restored (the log says why) and the worker
    goes through the unknown-worker path: ping false, then true, and it registers again, now
    mapping the new arena."""
    door.start()
    w = Worker(door)
    toks = tokens_of("na", C)
    assert w.store(toks, 0, C, "na") == [0]
    door.d.restart(signal.SIGTERM)
    wait_until(lambda: "registrations are not restored" in door.d.stderr_text(), 10,
               what="the log line")
    assert "another arena file" in door.d.stderr_text()
    st = door.d.http_json("GET", "/status")["lmcache"]
    assert st["contexts_total"] == 0 and st["registry"]["restored"] == 0
    hb = AdapterHeartbeat(w)
    assert hb.beat() is False
    assert hb.beat() is True and hb.registrations == 1
    new = door.d.http_json("GET", "/status")["lmcache"]["shm_name"]
    assert new != w.reg["shm_name"]


def test_a_damaged_registry_is_not_used(door):
    """A registry file that does not validate (here: one byte changed) restores nothing and
    says so; the daemon starts and the worker registers again through its heartbeat."""
    door.start("--l1-adopt")
    w = Worker(door)
    door.d.stop(signal.SIGTERM)
    path = os.path.join(door.d.run_dir, "kvtier-lmcache.workers")
    assert os.stat(path).st_mode & 0o777 == 0o600
    with open(path, "r+b") as f:
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 1]))
    door.d.restart(signal.SIGTERM)
    assert "its checksum does not match" in door.d.stderr_text()
    assert door.d.http_json("GET", "/status")["lmcache"]["contexts_total"] == 0
    hb = AdapterHeartbeat(w)
    assert hb.beat() is False and hb.beat() is True and hb.registrations == 1
