"""Hybrid models through the LMCache door, as LMCache's newest worker drives them: the
registration carries object groups (object_group_layout_shapes / _dtype_strs, num_chunks_in_sw,
transfer_metadata_wire with its kernel groups), and the prepare replies answer
context.object_groups — per group its chunk_indices and, per chunk, one slot per kernel group,
the tensors of one object laid out one after the other. Stored byte for byte and read back; a
sliding-window group's retrieve covers only its window; all or nothing; the scheduler's lookup
counts a chunk only when every group of every worker has it; abort, re-registration and bad
registrations."""

import math
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import pytest  # noqa: E402

import kvtier  # noqa: E402
from lmc_client import (DTYPE_SIZES, PAGE, HybridLayout, ipc_key,  # noqa: E402
                        new_instance_id, tokens_of)
from test_lmcache import (C, KVT_DAEMON_ARGS, MODEL, door, hits, ns_of,  # noqa: E402,F401
                          rid)

# full attention (K/V, 2 layers, a whole chunk), sliding-window attention (K/V, 1 layer, 8 of
# the chunk's 16 slots) and a recurrent state (1 slot, no K/V axis) in a window group of 1 chunk
HY = HybridLayout(C, [(2, 2, C, 32, "float16"), (2, 1, 8, 32, "bfloat16"),
                      (1, 1, 1, 64, "float32")],
                  [([0], -1), ([1, 2], 1)])


def pattern(tag, worker, group, chunk, kernel, n):
    seed = ("%s/%d/%d/%d/%d" % (tag, worker, group, chunk, kernel)).encode()
    return (seed * (n // len(seed) + 1))[:n]


class HybridWorker:
    def __init__(self, door, layout=HY, world_size=1, rank=0, model=MODEL):
        self.door, self.layout, self.world_size, self.rank = door, layout, world_size, rank
        self.model = model
        self.c = door.client()
        self.iid = new_instance_id()
        self.reg = self.c.register(layout.payload(self.iid, model, world_size))
        assert self.reg["error"] is None, self.reg
        self.shm = door.shm(self.reg)

    def key(self, toks, start, end, request_id="req"):
        return ipc_key(self.model, self.world_size, self.rank, toks, start, end, request_id)

    def check_groups(self, ctx, n_chunks):
        """context.object_groups: every group in id order, slots shaped as registered, each
        chunk's tensors back to back in one object, nothing overlapping. -> groups"""
        assert list(ctx) == ["object_groups"], ctx
        groups = ctx["object_groups"]
        assert [g["object_group_id"] for g in groups] == list(range(len(self.layout.shapes)))
        spans = []
        for g in groups:
            gid = g["object_group_id"]
            assert list(g) == ["object_group_id", "chunk_indices", "slots"], g
            assert len(g["slots"]) == len(g["chunk_indices"]), g
            assert all(0 <= i < n_chunks for i in g["chunk_indices"]), g
            for per_chunk in g["slots"]:
                assert len(per_chunk) == len(self.layout.shapes[gid]), per_chunk
                assert per_chunk[0]["offset"] % PAGE == 0, per_chunk
                for k, sl in enumerate(per_chunk):
                    assert list(sl) == ["offset", "length", "shape", "dtype"], sl
                    assert sl["shape"] == self.layout.shapes[gid][k], sl
                    assert sl["dtype"] == self.layout.dtypes[gid][k], sl
                    assert sl["length"] == math.prod(sl["shape"]) * DTYPE_SIZES[sl["dtype"]]
                    if k:
                        prev = per_chunk[k - 1]
                        assert sl["offset"] == prev["offset"] + prev["length"], per_chunk
                spans.append((per_chunk[0]["offset"],
                              per_chunk[-1]["offset"] + per_chunk[-1]["length"]))
        spans.sort()
        for a, b in zip(spans, spans[1:]):
            assert a[1] <= b[0], (a, b)
        return groups

    def store(self, toks, start, end, tag):
        """prepare_store + write every slot + commit_store -> {group: chunk_indices}."""
        k = self.key(toks, start, end)
        r = self.c.prepare_store(k, self.iid)
        assert list(r) == ["context"], r
        groups = self.check_groups(r["context"], (end - start) // C)
        for g in groups:
            for i, per_chunk in zip(g["chunk_indices"], g["slots"]):
                for kk, sl in enumerate(per_chunk):
                    self.shm.write(sl["offset"], pattern(tag, self.rank, g["object_group_id"],
                                                         start // C + i, kk, sl["length"]))
        done = {g["object_group_id"]: g["chunk_indices"] for g in groups}
        if any(done.values()):
            assert self.c.commit_store(k, self.iid, b"") is True
        return done

    def retrieve(self, toks, start, end, tag=None, request_id="req"):
        """prepare_retrieve (+ commit_retrieve) -> {group: chunk_indices}, None on a miss;
        with tag, every tensor's bytes are checked."""
        k = self.key(toks, start, end, request_id)
        r = self.c.prepare_retrieve(k, self.iid)
        assert list(r) == ["success", "data", "context"] and r["data"] == b"", r
        if not r["success"]:
            assert r["context"] == {}, r
            self.c.commit_retrieve(k, self.iid)
            return None
        groups = self.check_groups(r["context"], (end - start) // C)
        for g in groups:
            for i, per_chunk in zip(g["chunk_indices"], g["slots"]):
                for kk, sl in enumerate(per_chunk):
                    if tag is not None:
                        assert self.shm.read(sl["offset"], sl["length"]) == pattern(
                            tag, self.rank, g["object_group_id"], start // C + i, kk,
                            sl["length"]), (g["object_group_id"], i, kk)
        assert self.c.commit_retrieve(k, self.iid) is True
        return {g["object_group_id"]: g["chunk_indices"] for g in groups}


def test_hybrid_chunks_round_trip_by_object_group(door):
    door.start()
    w = HybridWorker(door)
    toks = tokens_of("hy", 4 * C)
    assert w.store(toks, 0, 4 * C, "hy") == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    # every group's objects, the window group's back only for its last chunk
    assert w.retrieve(toks, 0, 4 * C, "hy") == {0: [0, 1, 2, 3], 1: [3]}
    assert w.retrieve(toks, 0, 2 * C, "hy") == {0: [0, 1], 1: [1]}
    sched = door.client()
    assert hits(sched, MODEL, 1, toks) == 4
    # stored already: every group's list is empty, nothing to commit
    assert w.store(toks, 0, 4 * C, "again") == {0: [], 1: []}
    assert w.retrieve(toks, 0, 4 * C, "hy") == {0: [0, 1, 2, 3], 1: [3]}
    # each group in its own namespace, as v1 objects of the group's object size
    v1 = door.v1()
    keys = kvtier.hash_tokens(toks, C)
    sizes = [sum(b) for b in HY.nbytes]
    for g in (0, 1):
        ns = ns_of(MODEL, 1, 0) + ".g%d" % g
        assert v1.lookup(ns, keys).hits == 4
        got = v1.get(ns, keys[3:])[0]
        assert len(got) == sizes[g]
        assert got[:HY.nbytes[g][0]] == pattern("hy", 0, g, 3, 0, HY.nbytes[g][0])
    st = door.d.http_json("GET", "/status")["lmcache"]["contexts"][0]
    assert st["object_group_bytes"] == sizes and st["chunk_bytes"] == sum(sizes), st


def test_a_group_missing_is_a_miss_for_the_whole_chunk(door):
    door.start()
    w = HybridWorker(door)
    toks = tokens_of("miss", 3 * C)
    w.store(toks, 0, 3 * C, "m")
    v1 = door.v1()
    keys = kvtier.hash_tokens(toks, C)
    # the window group only needs the last chunk: losing its chunk 0 leaves retrieves whole
    assert v1.remove(ns_of(MODEL, 1, 0) + ".g1", keys[:1]) == 1
    assert w.retrieve(toks, 0, 3 * C, "m") == {0: [0, 1, 2], 1: [2]}
    # but the scheduler counts a chunk only when every group has it (never a hit that cannot
    # be loaded; here it is conservative for the window group)
    sched = door.client()
    assert hits(sched, MODEL, 1, toks) == 0
    # the full-attention group losing chunk 1: [0, 3C) is a miss, with an empty context
    assert v1.remove(ns_of(MODEL, 1, 0) + ".g0", keys[1:2]) == 1
    assert w.retrieve(toks, 0, 3 * C) is None
    assert w.retrieve(toks, 0, C) is None   # [0, C) needs g1's chunk 0, which is gone
    # the window group losing its last chunk: a miss, and nothing stays locked
    assert v1.remove(ns_of(MODEL, 1, 0) + ".g1", keys[2:3]) == 1
    toks2 = tokens_of("miss2", 2 * C)
    w.store(toks2, 0, 2 * C, "m2")
    keys2 = kvtier.hash_tokens(toks2, C)
    assert v1.remove(ns_of(MODEL, 1, 0) + ".g1", keys2[1:2]) == 1
    assert w.retrieve(toks2, 0, 2 * C) is None
    assert door.d.http_json("GET", "/status")["lmcache"]["contexts"][0]["leased_bytes"] == 0
    # storing again fills only what each group lacks
    assert w.store(toks2, 0, 2 * C, "m2") == {0: [], 1: [1]}
    assert w.retrieve(toks2, 0, 2 * C, "m2") == {0: [0, 1], 1: [1]}


def test_two_tp_workers_and_the_lookup_lock(door):
    door.start()
    w0 = HybridWorker(door, world_size=2, rank=0)
    w1 = HybridWorker(door, world_size=2, rank=1)
    toks = tokens_of("tp", 3 * C)
    sched = door.client()
    w0.store(toks, 0, 3 * C, "tp")
    assert hits(sched, MODEL, 2, toks) == 0          # worker 1 has nothing yet
    w1.store(toks, 0, 3 * C, "tp")
    r = rid("hy")
    sched.lookup(ipc_key(MODEL, 2, None, toks, 0, 3 * C, r), 2)
    assert sched.query_prefetch_status(r) == 3
    # the lookup's read locks cover every group's objects: 2 workers x 2 groups x 3 chunks
    st = door.d.http_json("GET", "/status")["lmcache"]
    assert st["lookup_locks"] == 4, st
    # each worker's read of the request releases its groups' locks
    assert w0.retrieve(toks, 0, 3 * C, "tp", request_id=r) == {0: [0, 1, 2], 1: [2]}
    assert door.d.http_json("GET", "/status")["lmcache"]["lookup_locks"] == 2
    assert w1.retrieve(toks, 0, 3 * C, "tp", request_id=r) == {0: [0, 1, 2], 1: [2]}
    assert door.d.http_json("GET", "/status")["lmcache"]["lookup_locks"] == 0
    sched.end_session(r)


def test_abort_and_an_uncommitted_store_leave_nothing(door):
    door.start()
    w = HybridWorker(door)
    toks = tokens_of("ab", 2 * C)
    k = w.key(toks, 0, 2 * C)
    r = w.c.prepare_store(k, w.iid)
    assert [g["chunk_indices"] for g in r["context"]["object_groups"]] == [[0, 1], [0, 1]]
    assert w.c.call("abort_store", k, w.iid) is True
    assert w.retrieve(toks, 0, 2 * C) is None
    assert w.store(toks, 0, 2 * C, "ab") == {0: [0, 1], 1: [0, 1]}
    assert w.retrieve(toks, 0, 2 * C, "ab") == {0: [0, 1], 1: [1]}


@pytest.mark.parametrize("change,mention", [
    ({"transfer_metadata_wire": None}, "transfer_metadata_wire"),
    ({"transfer_metadata_wire": HY.metadata(tokens_per_chunk=2 * C)}, "--chunk-tokens"),
    ({"object_group_layout_dtype_strs": [["float16"], ["bfloat16", "complex32"]]}, "complex32"),
    ({"object_group_layout_dtype_strs": [["float16"]]}, "object_group_layout_dtype_strs"),
    ({"object_group_layout_shapes": [[[2, 2, C, 32]], [[2, 1, 8, 32]]],
      "object_group_layout_dtype_strs": [["float16"], ["bfloat16"]]}, "kernel groups"),
    ({"num_chunks_in_sw": [-1, 1, 1]}, "num_chunks_in_sw"),
    ({"object_group_layout_shapes": [[[2, 2, C, 32]]] * 9,
      "object_group_layout_dtype_strs": [["float16"]] * 9}, "object_group_layout_shapes"),
    ({"object_group_layout_shapes": [[[2, 2, C, 1 << 30]], [[2, 1, 8, 32], [1, 1, 64]]]},
     "arena"),
    ({"object_group_layout_shapes": [[[2, 0, C, 32]], [[2, 1, 8, 32], [1, 1, 64]]]},
     "object_group_layout_shapes[0][0]"),
    ({"object_group_layout_shapes": [[[2**32 - 1] * 4], [[2, 1, 8, 32], [1, 1, 64]]],
      "object_group_layout_dtype_strs": [["float64"], ["bfloat16", "float32"]]}, "arena"),
], ids=["no-metadata", "tokens-per-chunk", "dtype", "dtype-count", "kernel-count", "windows",
        "too-many-groups", "too-big", "zero-dim", "product-past-2^64"])
def test_bad_hybrid_registrations_are_refused(door, change, mention):
    door.start()
    c = door.client()
    p = HY.payload(new_instance_id(), MODEL, 1)
    p.update(change)
    reg = c.register(p)
    assert isinstance(reg.get("error"), str) and mention in reg["error"], reg
    assert door.d.http_json("GET", "/status")["lmcache"]["contexts"] == []
    # and a good one still registers
    HybridWorker(door)


def test_a_hybrid_worker_cannot_change_its_groups(door):
    door.start()
    w = HybridWorker(door)
    other = HybridLayout(C, [(2, 2, C, 32, "float16")], [([0], -1)])
    reg = w.c.register(other.payload(w.iid, MODEL, 1))
    assert "another layout" in (reg["error"] or ""), reg
    assert w.c.register(HY.payload(w.iid, MODEL, 1))["error"] is None   # the same: fine


def test_engine_groups_without_object_groups_are_refused(door):
    door.start()
    c = door.client()
    p = HY.payload(new_instance_id(), MODEL, 1)
    for f in ("object_group_layout_shapes", "object_group_layout_dtype_strs",
              "num_chunks_in_sw", "transfer_metadata_wire"):
        del p[f]
    reg = c.register(p)
    assert "--disable-hybrid-kv-cache-manager" in (reg["error"] or ""), reg
