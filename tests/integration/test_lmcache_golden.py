"""The LMCache door byte for byte: request frames written out by hand from the spec
(../../../shared/LMCACHE_MP.md §13, §2, §3) and the exact reply frames kvtierd must send, each
exchange on a fresh DEALER (so the first uid is 00). The daemon runs with the spec's default
chunk size, 256 tokens. Also: lmc_client's encoders produce those same bytes."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import time  # noqa: E402

import pytest  # noqa: E402
import zmq  # noqa: E402

import kvtier  # noqa: E402

from lmc_client import (ERROR_MARKER, Layout,  # noqa: E402
                        golden_key_bytes, ipc_key, pack, selftest, unpack)

KVT_DAEMON_ARGS = ("--l2", "none", "--chunk-tokens", "256")


IID = bytes.fromhex("cf25895f0000000001")      # instance_id 0x25895f0000000001 as uint64
IID_VALUE = 0x25895f0000000001


def s(text):
    """A msgpack fixstr."""
    b = text.encode()
    return bytes([0xa0 | len(b)]) + b


# (name, [(request frames, reply frames), ...]) — one DEALER per exchange list
EXCHANGES = [
    ("get_chunk_size", [([b"\x00", b"\x15"], [b"\x00", b"\x15", b"\xcd\x01\x00"])]),
    ("noop_by_name", [([b"\x00", b"\xa4noop"], [b"\x00", b"\xa4noop", b"\xa2OK"])]),
    ("noop_by_id", [([b"\x00", b"\x18"], [b"\x00", b"\x18", b"\xa2OK"])]),
    ("lookup_ack_then_status", [
        ([b"\x00", b"\x08", golden_key_bytes(), b"\x01"], [b"\x00", b"\x08"]),
        ([b"\x01", b"\x09", s("r")], [b"\x01", b"\x09", b"\x00"]),
        ([b"\x02", b"\x0d", s("r")], [b"\x02", b"\x0d"])]),
    ("ping_nil", [([b"\x00", b"\x16", b"\xc0"], [b"\x00", b"\x16", b"\xc3"])]),
    # an instance that is not registered: false, then true (the adapter registers again)
    ("ping_instance", [([b"\x00", b"\x16", IID], [b"\x00", b"\x16", b"\xc2"]),
                       ([b"\x01", b"\x16", IID], [b"\x01", b"\x16", b"\xc3"])]),
    # the event log is on (event_log_size 32768 by default): poll_kv_events is offered
    ("get_experimental", [([b"\x00", b"\x20"], [b"\x00", b"\x20", b"\x91\xa9kv_events"])]),
    ("clear", [([b"\x00", b"\x14", b"\xc2"], [b"\x00", b"\x14"])]),
    ("end_session_two_frames", [([b"\x00", b"\x0d", s("r"), b"\x80"], [b"\x00", b"\x0d"])]),
    ("unregister_unknown", [([b"\x00", b"\x0f", IID], [b"\x00", b"\x0f"])]),
    ("query_unknown", [([b"\x00", b"\x09", s("nope")], [b"\x00", b"\x09", b"\x00"])]),
    ("wait_unknown", [([b"\x00", b"\x0a", s("nope"), b"\xcb\x3f\xe0" + b"\x00" * 6],
                       [b"\x00", b"\x0a", b"\x00"])]),
    # uid and op are echoed as received, not re-encoded
    ("noncanonical_uid_and_op", [([b"\xcd\x00\x07", b"\xcc\x15"],
                                  [b"\xcd\x00\x07", b"\xcc\x15", b"\xcd\x01\x00"])]),
    ("uint64_uid", [([b"\xcf" + (42).to_bytes(8, "big"), b"\x18"],
                     [b"\xcf" + (42).to_bytes(8, "big"), b"\x18", b"\xa2OK"])]),
    ("by_name_get_chunk_size", [([b"\x00", s("get_chunk_size")],
                                 [b"\x00", s("get_chunk_size"), b"\xcd\x01\x00"])]),
    # abort_store(key, instance_id), by name only: nothing prepared (worker_id 0) -> false
    ("abort_store_nothing_prepared", [
        ([b"\x00", s("abort_store"), golden_key_bytes().replace(
            s("worker_id") + b"\xc0", s("worker_id") + b"\x00"), IID],
         [b"\x00", s("abort_store"), b"\xc2"])]),
]


def test_encoders_match_spec_bytes():
    """lmc_client writes the bytes above (no daemon involved)."""
    assert selftest() > 20
    assert pack(ipc_key("m", 1, None, [1, 2, 3], 0, 0, "r")) == golden_key_bytes()
    assert golden_key_bytes().startswith(b"\x8b\xaamodel_name")
    assert pack(IID_VALUE) == IID
    assert pack(0.5) == b"\xcb\x3f\xe0" + b"\x00" * 6
    assert pack({}) == b"\x80"
    for name, exchanges in EXCHANGES:
        for req, rep in exchanges:
            assert rep[:2] == req[:2], "%s: a reply echoes uid and op" % name
            for f in req + rep:
                unpack(f)                         # every hand-written frame is one msgpack value


@pytest.fixture
def lmc_endpoint(daemon_factory):
    d = daemon_factory(start=False)
    ep = "ipc://" + os.path.join(d.run_dir, "lmcache.sock")
    d.args += ["--lmcache-listen", ep]
    d.start()
    ctx = zmq.Context()
    socks = []

    def dealer():
        sk = ctx.socket(zmq.DEALER)
        sk.setsockopt(zmq.CONNECT_TIMEOUT, 5000)
        sk.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sk.setsockopt(zmq.LINGER, 0)
        sk.connect(ep)
        socks.append(sk)
        return sk

    yield dealer
    for sk in socks:
        sk.close(linger=0)
    ctx.term()


def recv(sock, timeout_ms=5000):
    p = zmq.Poller()
    p.register(sock, zmq.POLLIN)
    assert p.poll(timeout_ms), "no reply within %d ms" % timeout_ms
    return sock.recv_multipart()


@pytest.mark.parametrize("name,exchanges", EXCHANGES, ids=[e[0] for e in EXCHANGES])
def test_golden_exchange(lmc_endpoint, name, exchanges):
    sock = lmc_endpoint()
    for req, rep in exchanges:
        sock.send_multipart(req)
        got = recv(sock)
        assert got == rep, "%s: sent %r\n got %r\nwant %r" % (name, req, got, rep)


@pytest.mark.parametrize("op_frame,mention", [(b"\x63", "99"), (s("frobnicate"), "frobnicate"),
                                              (b"\x06", "store")], ids=["99", "name", "store"])
def test_golden_error_reply(lmc_endpoint, op_frame, mention):
    sock = lmc_endpoint()
    sock.send_multipart([b"\x00", op_frame])
    got = recv(sock)
    assert len(got) == 4 and got[:3] == [b"\x00", op_frame, ERROR_MARKER], got
    err = unpack(got[3])
    assert isinstance(err, dict) and err.get("error_type") == "unknown_type", err
    assert mention in err["message"], err


def test_golden_struct_replies(lmc_endpoint):
    """register, prepare_store and prepare_retrieve replies: maps with the fields in the
    declared order, in msgpack's shortest forms (the frame equals its own re-encoding)."""
    sock = lmc_endpoint()
    lay = Layout(2, 8, "float16", 256)
    sock.send_multipart([b"\x00", b"\x0e", pack(lay.payload(IID_VALUE, "m", 1))])
    got = recv(sock)
    assert len(got) == 3 and got[:2] == [b"\x00", b"\x0e"], got
    reg = unpack(got[2])
    assert list(reg) == ["shm_name", "pool_size", "scratch_offset", "scratch_size", "error"]
    assert got[2] == pack(reg) and got[2][:1] == b"\x85" and reg["error"] is None, got[2][:80]

    key = pack(ipc_key("m", 1, 0, list(range(512)), 0, 512, "r"))
    sock.send_multipart([b"\x01", b"\x10", key, IID])
    got = recv(sock)
    assert len(got) == 3 and got[:2] == [b"\x01", b"\x10"], got
    ps = unpack(got[2])
    assert list(ps) == ["context"] and list(ps["context"]) == ["slots", "chunk_indices"], ps
    assert ps["context"]["chunk_indices"] == [0, 1] and got[2] == pack(ps), ps
    sock.send_multipart([b"\x02", b"\x11", key, IID, b"\xc4\x00"])
    assert recv(sock) == [b"\x02", b"\x11", b"\xc3"]

    sock.send_multipart([b"\x03", b"\x12", key, IID])
    got = recv(sock)
    assert len(got) == 3 and got[:2] == [b"\x03", b"\x12"], got
    pr = unpack(got[2])
    assert list(pr) == ["success", "data", "context"] and pr["success"] is True, pr
    assert got[2].startswith(b"\x83\xa7success\xc3\xa4data\xc4\x00\xa7context"), got[2][:40]
    assert [sl["offset"] for sl in pr["context"]["slots"]] == \
        [sl["offset"] for sl in ps["context"]["slots"]]
    assert got[2] == pack(pr)
    sock.send_multipart([b"\x04", b"\x13", key, IID])
    assert recv(sock) == [b"\x04", b"\x13", b"\xc3"]

    # poll_kv_events("m", 0, 1024): the one L1 record so far (seq 1), the two chunks as one
    # stored CPU run with their tokens, written out field by field
    sock.send_multipart([b"\x05", b"\x22", s("m"), b"\x00", b"\xcd\x04\x00"])
    got = recv(sock)
    assert len(got) == 3 and got[:2] == [b"\x05", b"\x22"], got
    k0, k1 = kvtier.hash_tokens(list(range(512)), 256)
    head = b"\x85" + s("enabled") + b"\xc3" + s("incarnation") + b"\xcf"
    inc = int.from_bytes(got[2][len(head):len(head) + 8], "big")
    assert got[2].startswith(head) and abs(inc / 1e9 - time.time()) < 86400, got[2][:40]
    event = (b"\x88" + s("seq") + b"\x01" + s("kind") + s("stored") + s("medium") + s("CPU")
             + s("model_name") + s("m") + s("block_hashes") + b"\x92\xc4\x10" + k0
             + b"\xc4\x10" + k1 + s("parent_block_hash") + b"\xc0" + s("token_ids")
             + b"\xdc\x02\x00" + bytes(range(128)) + b"".join(b"\xcc" + bytes([t])
                                                           for t in range(128, 256))
             + b"".join(b"\xcd" + t.to_bytes(2, "big") for t in range(256, 512))
             + s("block_size") + b"\xcd\x01\x00")
    assert got[2][len(head) + 8:] == (s("next_cursor") + b"\x01" + s("lost") + b"\xc2"
                                      + s("events") + b"\x91" + event), got[2][len(head) + 8:]
