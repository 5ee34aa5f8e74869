"""LMCache's poll_kv_events on the LMCache door, as LMCache's vLLM adapter polls it (model_name,
cursor, max_events; get_experimental lists "kv_events" first): what the door stores comes back
as one stored "CPU" record per run of chained chunks with their token ids and parent hash (the
TP workers' copies as one block), L2 write-behind as "STORAGE", clears and evictions as removed,
loads back from L2 as stored again; other models' and v1 records move the cursor but are not
reported; a cursor the log no longer covers, or one ahead of it, is `lost`; max_events pages;
bad arguments are refused with a typed error; event_log_size 0 turns it off."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import pytest  # noqa: E402

import kvtier  # noqa: E402
from kvtest import metric_value, wait_until  # noqa: E402
from lmc_client import OPS, ipc_key, pack, tokens_of  # noqa: E402
from test_lmcache import (C, KVT_DAEMON_ARGS, MODEL, Worker, assert_remote,  # noqa: E402,F401
                          door, ns_of, rid)

FIELDS = ["seq", "kind", "medium", "model_name", "block_hashes", "parent_block_hash",
          "token_ids", "block_size"]


def keys_of(tokens, salt=None):
    return kvtier.hash_tokens(tokens, C, salt)


def poll(c, cursor, model=MODEL, max_events=1024):
    r = c.poll_kv_events(model, cursor, max_events)
    assert isinstance(r, dict), r
    assert list(r) == ["enabled", "incarnation", "next_cursor", "lost", "events"], r
    assert r["enabled"] is True and isinstance(r["lost"], bool), r
    assert isinstance(r["incarnation"], int) and r["incarnation"] > 0, r
    assert isinstance(r["next_cursor"], int) and r["next_cursor"] >= 0, r
    for e in r["events"]:
        assert list(e) == FIELDS, e
        assert e["kind"] in ("stored", "removed") and e["medium"] in ("CPU", "STORAGE"), e
        assert e["model_name"] == model and e["block_size"] == C, e
        assert all(isinstance(h, bytes) and len(h) == 16 for h in e["block_hashes"]), e
        assert e["seq"] <= r["next_cursor"], (e, r["next_cursor"])
        if e["kind"] == "removed":
            assert e["token_ids"] == [] and e["parent_block_hash"] is None, e
        else:
            assert len(e["token_ids"]) == C * len(e["block_hashes"]), e
    seqs = [e["seq"] for e in r["events"]]
    assert seqs == sorted(seqs), seqs
    return r


def drain(c, cursor, model=MODEL):
    """Polls until a reply brings nothing new: (events, next_cursor, lost seen)."""
    events, lost = [], False
    for _ in range(100):
        r = poll(c, cursor, model)
        lost |= r["lost"]
        events += r["events"]
        if r["next_cursor"] == cursor and not r["events"]:
            return events, cursor, lost
        cursor = r["next_cursor"]
    raise AssertionError("poll_kv_events never caught up")


def test_stores_come_back_as_chained_blocks_once_per_chunk(door):
    door.start()
    c = door.client()
    assert c.get_experimental() == ["kv_events"]
    first = poll(c, 0)
    assert first["events"] == [] and first["lost"] is False
    inc = first["incarnation"]
    w0 = Worker(door, world_size=2, rank=0)
    w1 = Worker(door, world_size=2, rank=1)
    toks = tokens_of("ev", 5 * C + 3)
    keys = keys_of(toks)
    w0.store(toks, 0, 3 * C, "ev")
    w1.store(toks, 0, 3 * C, "ev")
    r = poll(c, first["next_cursor"])
    # both workers' copies, one block run: chunk 0 has no parent
    assert [(e["kind"], e["medium"]) for e in r["events"]] == [("stored", "CPU")], r
    e = r["events"][0]
    assert e["block_hashes"] == keys[:3]
    assert e["parent_block_hash"] is None
    assert e["token_ids"] == toks[:3 * C]
    assert r["incarnation"] == inc and r["lost"] is False
    # the rest of the prompt chains to chunk 2
    assert w0.store(toks, 0, 5 * C, "ev") == [3, 4]
    r2 = poll(c, r["next_cursor"])
    assert len(r2["events"]) == 1, r2
    e = r2["events"][0]
    assert e["block_hashes"] == keys[3:5] and e["parent_block_hash"] == keys[2]
    assert e["token_ids"] == toks[3 * C:5 * C]
    assert e["seq"] > r["next_cursor"]
    # nothing new: the cursor stays
    r3 = poll(c, r2["next_cursor"])
    assert r3["events"] == [] and r3["next_cursor"] == r2["next_cursor"]
    # another model's stores and a v1 client's objects: the cursor moves, nothing is reported
    other = Worker(door, model="other/model")
    other.store(tokens_of("o", 2 * C), 0, 2 * C, "o")
    v1 = door.v1()
    assert v1.put("plain/ns", [os.urandom(16)], [b"x" * 100]) == 1
    r4 = poll(c, r3["next_cursor"])
    assert r4["events"] == [] and r4["next_cursor"] >= r3["next_cursor"] + 2, r4
    assert poll(c, r3["next_cursor"], model="other/model")["events"][0]["block_hashes"] == \
        keys_of(tokens_of("o", 2 * C))
    # a forced clear: removed from L1, every block once
    c.clear(True)
    evs, end, _ = drain(c, r4["next_cursor"])
    assert evs and all((x["kind"], x["medium"]) == ("removed", "CPU") for x in evs), evs
    removed = [h for x in evs for h in x["block_hashes"]]
    assert sorted(removed) == sorted(keys[:5]), removed
    assert poll(c, end)["incarnation"] == inc
    _, samples = door.d.metrics()
    assert metric_value(samples, "kvtier_lmcache_kv_events_total") >= 4
    assert metric_value(samples, "kvtier_lmcache_requests_total",
                        op="poll_kv_events") >= 8


def test_salted_prompts_carry_their_own_hashes(door):
    door.start()
    c = door.client()
    w = Worker(door)
    toks = tokens_of("salted", 2 * C)
    w.store(toks, 0, 2 * C, "s", salt="tenant-a")
    evs, _, _ = drain(c, 0)
    assert len(evs) == 1 and evs[0]["block_hashes"] == keys_of(toks, "tenant-a"), evs
    assert evs[0]["block_hashes"] != keys_of(toks)


def test_l2_writes_loads_and_evictions(door):
    door.start(l2="mock:latency_ms=20")
    c = door.client()
    w = Worker(door)
    toks = tokens_of("l2ev", 3 * C)
    keys = keys_of(toks)
    assert w.store(toks, 0, 3 * C, "l2ev") == [0, 1, 2]
    seen, cursor = [], 0

    def storage_stored():
        nonlocal cursor
        evs, cursor, _ = drain(c, cursor)
        seen.extend(evs)
        return sorted(h for e in seen if (e["kind"], e["medium"]) == ("stored", "STORAGE")
                      for h in e["block_hashes"]) == sorted(keys)
    wait_until(storage_stored, 10, what="STORAGE stored events for the 3 chunks")
    assert [e for e in seen if e["medium"] == "CPU"][0]["block_hashes"] == keys
    storage = [e for e in seen if e["medium"] == "STORAGE"]
    assert all(e["token_ids"] == toks[C * keys.index(e["block_hashes"][0]):][
        :C * len(e["block_hashes"])] for e in storage), storage
    # out of L1 (L2 keeps them), then a lookup loads them back: stored CPU again
    c.clear(True)
    evs, cursor, _ = drain(c, cursor)
    assert sorted(h for e in evs for h in e["block_hashes"]) == sorted(keys)
    assert all((e["kind"], e["medium"]) == ("removed", "CPU") for e in evs), evs
    r = rid("ev")
    c.lookup(ipc_key(MODEL, 1, None, toks, 0, 3 * C, r), 1)
    assert c.wait_prefetch_status(r, 10.0) == 3
    c.end_session(r)
    evs, cursor, _ = drain(c, cursor)
    back = [h for e in evs if (e["kind"], e["medium"]) == ("stored", "CPU")
            for h in e["block_hashes"]]
    assert sorted(back) == sorted(keys), evs


def test_a_small_l1_reports_its_evictions(door):
    door.start("--l1-size", "1M")
    c = door.client()
    w = Worker(door)
    stored = []
    for i in range(40):   # 40 prompts x 4 chunks x 8 KiB: 1.25 MiB through a 1 MiB arena
        toks = tokens_of("evict-%d" % i, 4 * C)
        w.store(toks, 0, 4 * C, "e%d" % i)
        stored += keys_of(toks)
    wait_until(lambda: any(e["kind"] == "removed" for e in drain(c, 0)[0]), 10,
               what="removed events from eviction")
    evs, _, _ = drain(c, 0)
    gone = {h for e in evs if e["kind"] == "removed" for h in e["block_hashes"]}
    assert gone and gone <= set(stored), gone
    # what was evicted is what a lookup no longer finds
    v1 = door.v1()
    for h in list(gone)[:4]:
        assert v1.lookup(ns_of(MODEL, 1, 0), [h]).hits == 0


def test_lost_cursor_and_paging(door):
    door.start("--event-log-size", "4")
    c = door.client()
    w = Worker(door)
    prompts = [tokens_of("lost-%d" % i, C) for i in range(8)]
    for t in prompts:
        w.store(t, 0, C, "l")
    r = poll(c, 0)
    # 8 records, the log keeps 4: the reader hears it lost some, then gets the newest 4
    assert r["lost"] is True
    assert [e["block_hashes"] for e in r["events"]] == [keys_of(t) for t in prompts[4:]]
    last = r["next_cursor"]
    assert last == r["events"][-1]["seq"]
    # a cursor ahead of the log (another daemon's): lost, next_cursor at the newest record
    ahead = poll(c, last + 1000)
    assert ahead["lost"] is True and ahead["events"] == [] and ahead["next_cursor"] == last
    # one event at a time
    p1 = poll(c, last - 2, max_events=1)
    assert len(p1["events"]) == 1 and p1["next_cursor"] == last - 1 and not p1["lost"]
    p2 = poll(c, p1["next_cursor"], max_events=1)
    assert p2["events"][0]["seq"] == last and p2["next_cursor"] == last


def test_a_record_is_answered_whole_or_waits(door):
    """max_events holds: a record whose events would go past it waits for the next poll —
    unless it alone has more, which then comes alone (a poll always moves on)."""
    door.start()
    c = door.client()
    w = Worker(door)
    a = tokens_of("whole-a", C)
    w.store(a, 0, C, "a")                                 # one record, one event
    b = tokens_of("whole-b", 3 * C)
    mask = [[False, True, False]]                         # chunks 0 and 2: two runs
    assert w.store(b, 0, 3 * C, "b", null_chunk_mask=mask) == [0, 2]
    kb = keys_of(b)
    r = poll(c, 0, max_events=2)
    assert [e["block_hashes"] for e in r["events"]] == [keys_of(a)], r
    r2 = poll(c, r["next_cursor"], max_events=2)
    assert [e["block_hashes"] for e in r2["events"]] == [kb[:1], kb[2:]], r2
    assert r2["events"][1]["parent_block_hash"] == kb[1]   # chunk 2's parent, not stored
    assert r2["events"][0]["seq"] == r2["events"][1]["seq"] == r2["next_cursor"]
    # one event asked for: the two-event record still comes, whole, and alone
    r3 = poll(c, r["next_cursor"], max_events=1)
    assert len(r3["events"]) == 2 and r3["next_cursor"] == r2["next_cursor"], r3


def test_stores_with_unknown_tokens_are_left_out(door):
    """A v1 client's PUT into a door namespace has no prompt: nothing to tell a router (the
    worker would drop a stored event without token ids), counted."""
    door.start()
    c = door.client()
    v1 = door.v1()
    toks = tokens_of("v1", 2 * C)
    assert v1.put(ns_of(MODEL, 1, 0), keys_of(toks), [b"a" * 64, b"b" * 64]) == 2
    evs, cursor, _ = drain(c, 0)
    assert evs == [] and cursor >= 1
    _, samples = door.d.metrics()
    assert metric_value(samples, "kvtier_lmcache_kv_events_unbound_total") == 2
    # removal needs no tokens
    c.clear(True)
    evs, _, _ = drain(c, cursor)
    assert sorted(h for e in evs for h in e["block_hashes"]) == sorted(keys_of(toks))


@pytest.mark.parametrize("args,mention", [
    ([pack(MODEL), pack(-1), pack(8)], "cursor"),
    ([pack(MODEL), pack(0), pack(0)], "max_events"),
    ([pack(7), pack(0), pack(8)], "str"),
    ([pack(MODEL), pack("0"), pack(8)], "int"),
    ([pack(MODEL), pack(0)], "poll_kv_events"),
], ids=["negative-cursor", "max-0", "model-int", "cursor-str", "two-args"])
def test_bad_arguments_are_refused(door, args, mention):
    door.start()
    c = door.client()
    assert_remote(c.error(OPS["poll_kv_events"], raw_args=args), "bad_request", mention)
    assert c.error(OPS["poll_kv_events"], raw_args=args) is not None   # again, still answered
    assert poll(c, 0)["enabled"] is True


def test_without_the_log_it_is_off(door):
    door.start("--event-log-size", "0")
    c = door.client()
    assert c.get_experimental() == []
    w = Worker(door)
    w.store(tokens_of("off", C), 0, C, "off")
    r = c.poll_kv_events(MODEL, 0, 1024)
    assert r == {"enabled": False, "incarnation": 0, "next_cursor": 0, "lost": False,
                 "events": []}, r
