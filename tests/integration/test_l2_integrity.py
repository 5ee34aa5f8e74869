"""Integrity of what the daemon serves (issue #13): L2 objects carry an integrity trailer that
is verified on every load, so corrupt L2 bytes (a flipped byte, a truncated file, a value
changed in Redis, an object of the previous format) are a counted miss and are removed, never
served; the Redis adapter's /status `last_error` is cleared once it is healthy again; the
per-instance limit on leased bytes (`max_leased_bytes`); and the optional L1 checksum
(`l1_checksum`) that keeps damage done to an object in the arena after its COMMIT from being
served by GET or written behind to L2."""

import glob
import json
import os
import signal
import time

import pytest

from kvtest import (PUT, MiB, error_code, key, metric_value, payload, run_kvtierd,
                    wait_until)
from test_l2 import client, get, l2_status, l2_value, prefetch, wait_l2_idle  # noqa: F401

NS = "integrity/kv-v1"
TRAILER = 40            # bytes of the integrity trailer after each L2 object's payload


def keys_of(tag, n):
    return [key(i, tag) for i in range(n)]


def fs_object(data_dir, k):
    """Path of the fs L2 file of key k (default fs:DATA_DIR/l2; the name ends in hex(key))."""
    found = glob.glob(os.path.join(data_dir, "l2", "??", "*-" + k.hex()))
    assert len(found) == 1, "%d fs L2 files for key %s: %r" % (len(found), k.hex(), found)
    return found[0]


def seg_payload(data_dir, data):
    """(segment file, offset) of the fs L2 record whose payload is `data` (layout=segments:
    payloads start on a page of a file under DATA_DIR/l2/seg)."""
    found = []
    for path in glob.glob(os.path.join(data_dir, "l2", "seg", "*")):
        with open(path, "rb") as f:
            blob = f.read()
        at = blob.find(data)
        while at >= 0:
            if at % 4096 == 0:
                found.append((path, at))
            at = blob.find(data, at + 1)
    assert len(found) == 1, "%d segment records hold the payload: %r" % (len(found), found)
    return found[0]


FILES = ("--l2", "fs:{data}/l2,layout=files")


def fs_daemon(daemon_factory, data_dir, layout):
    """A daemon on DATA_DIR whose fs L2 has the given layout (segments: the default)."""
    args = ["--data-dir", data_dir]
    if layout == "files":
        args += [FILES[0], FILES[1].format(data=data_dir)]
    return daemon_factory(*args)


def corrupt_total(d, adapter):
    return l2_value(d, "kvtier_l2_corrupt_total", adapter)


def warnings_naming(d, what):
    return [ln for ln in d.log_lines(max_level=4) if what in ln]


def put_and_spill(d, s, ks, datas, adapter):
    """PUT every key, wait until all are written behind, then CLEAR L1: they are in L2 only."""
    assert d.call(s, PUT, {"ns": NS, "keys": ks}, *datas)["stored"] == len(ks)
    wait_l2_idle(d)
    assert l2_value(d, "kvtier_l2_stored_total", adapter) == len(ks)
    assert d.clear(s, NS)["removed"] == len(ks)
    lk = d.lookup(s, NS, ks)
    assert (lk["hits"], lk["l1"]) == (len(ks), 0), lk


# ----------------------------------------------------------------------------------------
# Corrupt L2 bytes are a counted miss, never served


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_fs_flipped_byte_is_a_counted_miss_and_removed(daemon_factory, client, tmp_path, layout):
    data_dir = str(tmp_path / "data")
    d = fs_daemon(daemon_factory, data_dir, layout)
    s, _ = client(d, "flip")
    ks = keys_of(b"flip", 4)
    datas = [payload(k, 300 * 1024 + 17 * i) for i, k in enumerate(ks)]
    put_and_spill(d, s, ks, datas, "fs:")
    if layout == "files":
        path, at = fs_object(data_dir, ks[2]), 0
    else:
        path, at = seg_payload(data_dir, datas[2])
    with open(path, "r+b") as f:              # one bit, in the middle of the payload
        f.seek(at + 150 * 1024)
        b = f.read(1)
        f.seek(at + 150 * 1024)
        f.write(bytes([b[0] ^ 0x10]))

    lk, st = prefetch(d, s, NS, ks)
    # LOOKUP counted all four (it asks for sizes only); the load of the third failed its check:
    # the prefetch loads fewer keys and the prefix served stops before the bad one
    assert lk["hits"] == 4 and st["loaded"] == 3, (lk, st)
    got = get(d, s, NS, ks)
    assert got == datas[:2], "GET served %d objects, or wrong bytes" % len(got)
    assert corrupt_total(d, "fs:") == 1
    assert l2_status(d, "fs:")["corrupt"] == 1
    if layout == "files":
        assert not os.path.exists(path), "the corrupt copy was not removed"
    name = ks[2].hex()                        # the object's name ends in its key
    assert len(warnings_naming(d, name)) == 1, d.log_lines(max_level=4)
    assert any("fs:" in ln for ln in warnings_naming(d, name))
    # the bad key is a miss from now on; the others are intact
    assert d.lookup(s, NS, ks)["hits"] == 2
    assert get(d, s, NS, ks[3:]) == datas[3:]
    assert l2_value(d, "kvtier_l2_loaded_total", "fs:") == 3
    if layout == "segments":                  # removed for good: a restart does not bring it back
        assert d.stop(signal.SIGTERM) == 0
        d2 = fs_daemon(daemon_factory, data_dir, layout)
        s2, _ = client(d2, "flip-2")
        assert d2.lookup(s2, NS, ks)["hits"] == 2    # the prefix stops at the removed key
        assert corrupt_total(d2, "fs:") == 0


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_fs_truncated_file_is_a_counted_miss_even_after_a_restart(daemon_factory, client,
                                                                 tmp_path, layout):
    """files: an object file cut short; segments: a record whose last payload page never made
    it to the disk (zeros) while its footer did — what a crash can leave of a torn write."""
    data_dir = str(tmp_path / "data")
    d = fs_daemon(daemon_factory, data_dir, layout)
    s, _ = client(d, "trunc")
    ks = keys_of(b"trunc", 2)
    datas = [payload(k, 200 * 1024 + 5) for k in ks]
    put_and_spill(d, s, ks, datas, "fs:")
    assert d.stop(signal.SIGTERM) == 0
    if layout == "files":
        path = fs_object(data_dir, ks[0])
        size = os.path.getsize(path)
        os.truncate(path, size - 4096)         # cut behind the daemon's back, then restart:
    else:
        path, at = seg_payload(data_dir, datas[0])
        with open(path, "r+b") as f:
            f.seek(at + 49 * 4096)
            f.write(bytes(4096))
    d2 = fs_daemon(daemon_factory, data_dir, layout)   # the index is rebuilt from the disk
    s2, _ = client(d2, "trunc-2")
    lk, st = prefetch(d2, s2, NS, ks)
    assert lk["hits"] == 2 and st["loaded"] == 1, (lk, st)
    assert get(d2, s2, NS, ks) == [], "a truncated object was served"
    assert get(d2, s2, NS, ks[1:]) == datas[1:]
    assert corrupt_total(d2, "fs:") == 1
    if layout == "files":
        assert not os.path.exists(path)
    assert d2.lookup(s2, NS, ks)["hits"] == 0
    assert d2.stop(signal.SIGTERM) == 0        # and it stays removed
    d3 = fs_daemon(daemon_factory, data_dir, layout)
    s3, _ = client(d3, "trunc-3")
    assert d3.lookup(s3, NS, ks)["hits"] == 0


def test_fs_object_of_the_previous_format_is_removed(daemon_factory, client, tmp_path):
    """An object written before the trailer existed is its bare payload: it is not served,
    it is counted once and removed, and the key can be stored again."""
    data_dir = str(tmp_path / "data")
    d = fs_daemon(daemon_factory, data_dir, "files")   # the files layout had that format
    s, _ = client(d, "legacy")
    ks = keys_of(b"legacy", 3)
    datas = [payload(k, 64 * 1024 + 3 * i) for i, k in enumerate(ks)]
    put_and_spill(d, s, ks, datas, "fs:")
    assert d.stop(signal.SIGTERM) == 0
    for k, data in zip(ks, datas):             # as the previous version wrote them
        path = fs_object(data_dir, k)
        assert os.path.getsize(path) == len(data) + TRAILER
        with open(path, "r+b") as f:
            assert f.read(len(data)) == data, "the payload is not stored first"
            f.truncate(len(data))
    d2 = daemon_factory("--data-dir", data_dir)      # layout=auto finds the files layout
    s2, _ = client(d2, "legacy-2")
    lk, st = prefetch(d2, s2, NS, ks)
    assert st["loaded"] == 0, (lk, st)
    assert get(d2, s2, NS, ks) == []
    assert corrupt_total(d2, "fs:") == 3      # the prefetch tries every key of its job
    assert d2.lookup(s2, NS, ks)["hits"] == 0
    assert any("no kvtier trailer" in ln for ln in d2.log_lines(max_level=4)), d2.stderr_tail()
    # stored again, it is written in the new format and served
    assert d2.call(s2, PUT, {"ns": NS, "keys": ks[:1]}, datas[0])["stored"] == 1
    wait_l2_idle(d2)
    assert d2.clear(s2, NS)["removed"] == 1
    lk, st = prefetch(d2, s2, NS, ks[:1])
    assert st["loaded"] == 1 and get(d2, s2, NS, ks[:1]) == datas[:1]


def test_redis_changed_value_is_a_counted_miss_and_deleted(redis_factory, daemon_factory,
                                                           client):
    r = redis_factory()
    spec = "redis:" + r.addr
    d = daemon_factory("--l2", spec)
    s, _ = client(d, "redis-flip")
    ks = keys_of(b"rflip", 3)
    datas = [payload(k, 100 * 1024 + i) for i, k in enumerate(ks)]
    put_and_spill(d, s, ks, datas, spec)
    rkeys = [x.decode() if isinstance(x, bytes) else x for x in r.keys("kvtier:*")]
    rkeys = [x for x in rkeys if x.endswith(ks[0].hex())]
    assert len(rkeys) == 1, r.keys()
    assert r.command("SETRANGE", rkeys[0], 1000, b"\xff\x00") > 0

    lk, st = prefetch(d, s, NS, ks)
    assert lk["hits"] == 3 and st["loaded"] == 2, (lk, st)
    assert get(d, s, NS, ks) == []
    assert get(d, s, NS, ks[1:]) == datas[1:]
    assert corrupt_total(d, spec) == 1
    assert l2_status(d, spec)["corrupt"] == 1
    assert r.command("EXISTS", rkeys[0]) == 0, "the corrupt value is still in redis"
    assert len(warnings_naming(d, rkeys[0][len("kvtier:"):])) == 1


def test_mock_corruption_on_every_load(daemon_factory, client):
    """An in-memory adapter (the mock, as a plugin would be) that returns damaged bytes."""
    spec = "mock:corrupt_rate=1"
    d = daemon_factory("--l2", spec)
    s, _ = client(d, "mock-flip")
    ks = keys_of(b"mflip", 2)
    datas = [payload(k, 50 * 1024) for k in ks]
    put_and_spill(d, s, ks, datas, spec)
    assert l2_status(d, spec)["objects"] == 2
    lk, st = prefetch(d, s, NS, ks)
    assert st["loaded"] == 0, (lk, st)
    assert get(d, s, NS, ks) == []
    assert corrupt_total(d, spec) == 2
    assert l2_status(d, spec)["objects"] == 0, "the corrupt copies were not removed"


def test_abi1_plugin_gets_trailers_through_the_compatibility_path(daemon_factory, client):
    """A plugin built against ABI 1 (store/load only) still works: the daemon joins payload and
    trailer for it, and loads in place (room for the trailer in the L1 block) or through a
    bounce buffer (a payload of whole pages); what comes back is checked like any load."""
    so = os.environ.get("KVT_L2_EXAMPLE_PLUGIN_ABI1")
    if not so or not os.path.isfile(so):
        pytest.skip("KVT_L2_EXAMPLE_PLUGIN_ABI1 is unset or missing (make builds "
                    "build/kvtier-l2-example-abi1.so)")
    spec = "plugin:" + os.path.abspath(so)
    d = daemon_factory("--l2", spec)
    s, _ = client(d, "abi1")
    ks = keys_of(b"abi1", 2)
    datas = [payload(ks[0], 64 * 1024), payload(ks[1], 64 * 1024 + 999)]
    put_and_spill(d, s, ks, datas, spec)
    st = l2_status(d, spec)
    assert (st["objects"], st["bytes"]) == (2, sum(map(len, datas)) + 2 * TRAILER), st
    lk, pst = prefetch(d, s, NS, ks)
    assert pst["loaded"] == 2, (lk, pst)
    assert get(d, s, NS, ks) == datas
    assert corrupt_total(d, spec) == 0


# ----------------------------------------------------------------------------------------
# Redis: last_error is not left standing once the adapter is healthy again


def test_redis_last_error_cleared_after_recovery(redis_factory, daemon_factory, client):
    r = redis_factory()
    spec = "redis:" + r.addr
    d = daemon_factory("--l2", spec)
    assert l2_status(d, spec)["last_error"] == ""
    r.kill()
    st = wait_until(lambda: (lambda x: x if not x["healthy"] and x["last_error"] else None)(
        l2_status(d, spec)), 5, what="redis adapter unhealthy with a last_error")
    outage_error = st["last_error"]
    r.start()
    st = wait_until(lambda: (lambda x: x if x["healthy"] else None)(l2_status(d, spec)), 10,
                    interval=0.1, what="redis adapter healthy again")
    assert st["last_error"] == "", "last_error still set after recovery: %r" % st
    assert st["last_error_at"] == 0, st
    past = st["past_error"]
    assert past["error"] == outage_error, st
    assert past["at"] <= past["recovered_at"] <= time.time() + 1, st
    assert past["recovered_at"] >= time.time() - 30, st
    # and it works: a write goes through
    s, arena = client(d, "after")
    ks = keys_of(b"recover", 1)
    d.store(s, arena, NS, ks, [payload(ks[0], 4096)])
    wait_until(lambda: l2_value(d, "kvtier_l2_stored_total", spec) == 1, 10,
               what="a write after the recovery")
    assert l2_status(d, spec)["last_error"] == ""


# ----------------------------------------------------------------------------------------
# max_leased_bytes: one instance cannot hold all of L1 under leases

K300 = 300 * 1024       # a multiple of 4 KiB: what a lease holds is the size itself


def test_max_leased_bytes_reserve_gets_the_prefix_that_fits(daemon_factory, client):
    d = daemon_factory("--l2", "none", "--max-leased-bytes", "1M")
    a, arena = client(d, "greedy")
    b, _ = client(d, "other")
    ks = keys_of(b"lim", 8)
    r = d.reserve(a, NS, ks[:4], size=K300)
    assert len(r["slots"]) == 3, r              # 3 x 300 KiB fit under 1 MiB, 4 do not
    r2 = d.reserve(a, NS, ks[4:5], size=K300, check=False)
    assert error_code(r2) == "no_space", r2
    msg = r2["error"]["message"]
    assert "max_leased_bytes" in msg and "921600" in msg, msg
    # another instance is not affected
    rb = d.reserve(b, NS, ks[5:8], size=K300)
    assert len(rb["slots"]) == 3
    # keys already stored cost nothing (nil slots)
    d.commit(b, rb["lease"])
    r3 = d.reserve(a, NS, ks[5:8], size=K300)
    assert r3["slots"] == [None, None, None] and r3["lease"] == 0, r3
    # COMMIT gives the bytes back
    for sl in r["slots"]:
        arena.write(sl["offset"], b"x" * 16)
    assert d.commit(a, r["lease"])["stored"] == 3
    assert len(d.reserve(a, NS, ks[3:5], size=K300)["slots"]) == 2


def test_max_leased_bytes_acquire_and_lookup_lock(daemon_factory, client):
    d = daemon_factory("--l2", "none", "--max-leased-bytes", "1M")
    a, arena = client(d, "reader")
    ks = keys_of(b"limr", 4)
    for part in (ks[:2], ks[2:]):               # 4 x 300 KiB would not fit one reservation
        d.store(a, arena, NS, part, [payload(k, K300) for k in part])
    r = d.acquire(a, NS, ks)
    assert len(r["slots"]) == 3, r               # pins the prefix that fits
    r2 = d.acquire(a, NS, ks, check=False)
    assert error_code(r2) == "no_space" and "max_leased_bytes" in r2["error"]["message"], r2
    lk = d.lookup(a, NS, ks, lock=True, check=False)
    assert error_code(lk) == "no_space", lk
    d.release(a, r["lease"])
    lk = d.lookup(a, NS, ks, lock=True)
    assert (lk["hits"], lk["l1"]) == (3, 3) and lk["lease"], lk
    d.release(a, lk["lease"])
    # a plain LOOKUP pins nothing and is not limited
    assert d.lookup(a, NS, ks)["hits"] == 4


def test_max_leased_bytes_freed_by_bye_and_expiry(daemon_factory, client):
    d = daemon_factory("--l2", "none", "--max-leased-bytes", "1M", "--lease-ms", "500")
    a, _ = client(d, "leaver")
    ks = keys_of(b"limx", 8)
    assert len(d.reserve(a, NS, ks[:4], size=K300)["slots"]) == 3
    d.ok(a, 2, {"instance": "leaver"})           # BYE drops every lease of the instance
    d.hello(a, "leaver")
    assert len(d.reserve(a, NS, ks[:4], size=K300)["slots"]) == 3
    time.sleep(1.2)                               # silent past lease_ms: the leases expire
    d.hello(a, "leaver")
    assert len(d.reserve(a, NS, ks[4:8], size=K300)["slots"]) == 3


def test_leased_bytes_unlimited_by_default(daemon_factory, client):
    d = daemon_factory("--l2", "none", "--l1-size", "8M")
    a, _ = client(d, "default")
    r = d.reserve(a, NS, keys_of(b"nolim", 6), size=MiB)
    assert len(r["slots"]) == 6, r


# ----------------------------------------------------------------------------------------
# l1_checksum: damage done in the arena after COMMIT is not served by GET nor written behind


def test_l1_checksum_get_never_serves_damaged_objects(daemon_factory, client):
    d = daemon_factory("--l2", "none", "--l1-checksum")
    s, arena = client(d, "late-writer")
    ks = keys_of(b"l1sum", 3)
    datas = [payload(k, 128 * 1024 + i) for i, k in enumerate(ks)]
    slots = d.store(s, arena, NS, ks[:2], datas[:2])                  # RESERVE + COMMIT
    assert d.call(s, PUT, {"ns": NS, "keys": ks[2:]}, datas[2])["stored"] == 1   # PUT
    assert get(d, s, NS, ks) == datas
    # a writer whose lease is gone writes into its old range
    arena.write(slots[1]["offset"] + 5000, b"stale")
    assert get(d, s, NS, ks) == datas[:1], "a damaged object was served"
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_l1_corrupt_total") == 1
    assert d.lookup(s, NS, ks)["hits"] == 1, "the damaged object is still in L1"
    assert any("checksum" in ln for ln in d.log_lines(max_level=4)), d.stderr_tail()
    # the PUT object is checked too
    put_slot = d.acquire(s, NS, ks[2:])
    d.release(s, put_slot["lease"])
    arena.write(put_slot["slots"][0]["offset"], b"\0")
    assert get(d, s, NS, ks[2:]) == []
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_l1_corrupt_total") == 2


def test_without_l1_checksum_damage_is_served(daemon_factory, client):
    """The documented default: no checksum, so GET serves whatever the arena holds."""
    d = daemon_factory("--l2", "none")
    s, arena = client(d, "no-sum")
    ks = keys_of(b"nosum", 1)
    slots = d.store(s, arena, NS, ks, [payload(ks[0], 8192)])
    arena.write(slots[0]["offset"], b"stale")
    assert get(d, s, NS, ks)[0][:5] == b"stale"
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_l1_corrupt_total") == 0


def test_l1_checksum_damaged_object_is_not_written_behind(daemon_factory, client):
    spec = "mock:latency_ms=400"
    # one writer: the second object waits behind the first one's 400 ms write
    d = daemon_factory("--l2", spec, "--l1-checksum", "--l2-write-threads", "1")
    s, arena = client(d, "wb")
    ks = keys_of(b"wbsum", 2)
    datas = [payload(k, 64 * 1024) for k in ks]
    for k, data in zip(ks, datas):            # two write-behind jobs, one after the other
        assert d.call(s, PUT, {"ns": NS, "keys": [k]}, data)["stored"] == 1
    r = d.acquire(s, NS, ks[1:])
    d.release(s, r["lease"])
    arena.write(r["slots"][0]["offset"] + 100, b"late")   # while the first write sleeps
    wait_l2_idle(d)
    assert l2_value(d, "kvtier_l2_stored_total", spec) == 1
    assert l2_status(d, spec)["objects"] == 1
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_l1_corrupt_total") == 1
    assert d.lookup(s, NS, ks)["hits"] == 1
    assert get(d, s, NS, ks[:1]) == datas[:1]


def test_l1_checksum_prefetched_objects_are_checked(daemon_factory, client):
    d = daemon_factory("--l1-checksum")          # default fs L2
    s, arena = client(d, "pf")
    ks = keys_of(b"pfsum", 2)
    datas = [payload(k, 32 * 1024) for k in ks]
    put_and_spill(d, s, ks, datas, "fs:")
    lk, st = prefetch(d, s, NS, ks)
    assert st["loaded"] == 2
    r = d.acquire(s, NS, ks)
    d.release(s, r["lease"])
    arena.write(r["slots"][0]["offset"], b"\1\2\3")
    assert get(d, s, NS, ks) == []
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_l1_corrupt_total") == 1
    # the L2 copy was fine all along: it is loaded again (the second key is still in L1)
    lk, st = prefetch(d, s, NS, ks)
    assert lk["l1"] == 0 and st["loaded"] == 2, (lk, st)
    assert l2_value(d, "kvtier_l2_loaded_total", "fs:") == 3
    assert get(d, s, NS, ks) == datas


def test_l1_checksum_retrieve_gpu_skips_damaged_objects(daemon_factory, tmp_path):
    """RETRIEVE_GPU copies out of L1 on the daemon's side, like GET: it is checked too (against
    the stand-in CUDA runtime of test_gpu.py)."""
    import test_gpu
    if not test_gpu.MOCK:
        pytest.skip("no mock libcudart (KVT_MOCK_CUDART; CUDA=0)")
    from kvtest import REGISTER_GPU, RETRIEVE_GPU, STORE_GPU, Arena
    engine = test_gpu.MockEngine()
    try:
        d, _ = test_gpu.mock_daemon(daemon_factory, tmp_path, "--l2", "none", "--l1-checksum")
        s = d.dealer()
        arena = Arena(d.hello(s, "gpu-sum")["shm"])
        d.ok(s, REGISTER_GPU, engine.register_body())
        ks = keys_of(b"gpusum", 2)
        ids = list(range(8))
        assert d.ok(s, STORE_GPU, {"ns": NS, "keys": ks, "device": 0,
                                   "block_ids": ids})["stored"] == 2
        body = {"ns": NS, "keys": ks, "device": 0, "block_ids": list(range(8, 16))}
        assert d.ok(s, RETRIEVE_GPU, body)["found"] == 2
        r = d.acquire(s, NS, ks)
        d.release(s, r["lease"])
        arena.write(r["slots"][1]["offset"] + 7, b"\xee")     # the second object, after COMMIT
        assert d.ok(s, RETRIEVE_GPU, body)["found"] == 1
        _, samples = d.metrics()
        assert metric_value(samples, "kvtier_l1_corrupt_total") == 1
        arena.close()
    finally:
        engine.close()


@pytest.mark.parametrize("args,env,want", [
    ([], {}, {"l1_checksum": False, "max_leased_bytes": 0}),
    (["--l1-checksum", "--max-leased-bytes", "512M"], {},
     {"l1_checksum": True, "max_leased_bytes": 512 * MiB}),
    ([], {"KVTIER_L1_CHECKSUM": "true", "KVTIER_MAX_LEASED_BYTES": "64M"},
     {"l1_checksum": True, "max_leased_bytes": 64 * MiB}),
], ids=["defaults", "flags", "environment"])
def test_new_options_defaults_flags_and_environment(kvt_daemon_bin, tmp_path, args, env, want):
    cp = run_kvtierd(["--run-dir", str(tmp_path), "--l2", "none", "--print-config"] + args,
                     env=env)
    assert cp.returncode == 0, cp.stderr
    cfg = json.loads(cp.stdout)
    assert {k: cfg.get(k) for k in want} == want, cp.stdout


def test_max_leased_bytes_bad_value_exits_2(kvt_daemon_bin, tmp_path):
    cp = run_kvtierd(["--run-dir", str(tmp_path), "--max-leased-bytes", "lots",
                      "--check-config"])
    assert cp.returncode == 2 and "max_leased_bytes" in cp.stderr, cp.stderr
