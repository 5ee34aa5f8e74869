"""lmc_client: an LMCache multiprocess (MP) client for the tests of kvtierd's LMCache door
(test_lmcache.py, test_lmcache_golden.py), putting on the wire exactly what LMCache's own ZMQ
client puts there in engine-driven shared-memory mode (../../../shared/LMCACHE_MP.md):

  * one DEALER per client object, ZMQ_CONNECT_TIMEOUT 5000 and ZMQ_RECONNECT_IVL_MAX 1000;
  * requests [uid, op, arg1 ... argN]: uid a msgpack int counting from 0 per DEALER, op a
    msgpack int from the frozen table (or a method name as a msgpack str), one msgpack frame per
    method parameter, defaults included;
  * structs (IPCCacheServerKey, RegisterEngineDrivenContextPayload) as maps with every field
    present in msgspec declaration order; bytes as bin, floats as float64;
  * replies [uid, op] (a None return), [uid, op, value], or the error form
    [uid, op, b"LMCACHE_RPC_ERROR_V1", {error_type, message}].

Every receive is bounded (a poller, 5 s unless told). `selftest()` checks the encoders against
the example bytes of the spec (§13) without a daemon; `python3 lmc_client.py selftest` runs it.

Run as a script it is also the crash test's worker process:
  python3 lmc_client.py crash-worker JSON   registers, prepare_stores, writes every slot, prints
                                            one JSON line {"ready": true, ...}, then pings its
                                            instance until killed (at most 120 s).
Only the Python standard library, pyzmq and msgpack are used.
"""

import itertools
import json
import math
import mmap
import os
import random
import sys
import time

import msgpack
import zmq

# ----------------------------------------------------------------------------------------
# The frozen op table of LMCache's wire.py (spec §2.1)

OPS = {
    "register_kv_cache": 1, "unregister_kv_cache": 2, "register_q_cache": 3,
    "unregister_q_cache": 4, "store_q": 5, "store": 6, "retrieve": 7, "lookup": 8,
    "query_prefetch_status": 9, "wait_prefetch_status": 10, "query_prefetch_lookup_hits": 11,
    "free_lookup_locks": 12, "end_session": 13, "register_kv_cache_engine_driven_context": 14,
    "unregister_kv_cache_engine_driven_context": 15, "prepare_store": 16, "commit_store": 17,
    "prepare_retrieve": 18, "commit_retrieve": 19, "clear": 20, "get_chunk_size": 21,
    "ping": 22, "report_block_allocation": 23, "noop": 24, "cb_register_rope": 25,
    "cb_unregister_rope": 26, "cb_retrieve_pre_computed": 27, "cb_unified_lookup": 28,
    "p2p_lookup_and_lock": 29, "p2p_query_lookup_results": 30, "p2p_unlock_objects": 31,
    "get_experimental": 32, "cb_protocol_handshake": 33, "poll_kv_events": 34,
}
OP_NAMES = {v: k for k, v in OPS.items()}

ERROR_MARKER = b"LMCACHE_RPC_ERROR_V1"
CONNECT_TIMEOUT_MS = 5000
RECONNECT_IVL_MAX_MS = 1000
RECV_TIMEOUT_S = 5.0
PAGE = 4096

# torch attribute names -> bytes per element (the ones the tests use, and the daemon takes)
DTYPE_SIZES = {
    "bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float64": 8,
    "double": 8, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1, "int16": 2,
    "int32": 4, "int64": 8, "bool": 1,
}


def pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


def unpack(buf):
    return msgpack.unpackb(buf, raw=False)


def op_frame(op):
    """The op frame: an int id packed as msgpack int, a name as msgpack str, bytes as they
    are (for hand-made frames)."""
    if isinstance(op, (bytes, bytearray)):
        return bytes(op)
    if isinstance(op, bool) or not isinstance(op, (int, str)):
        raise TypeError("op must be an int id, a name str or raw bytes, not %r" % (op,))
    return pack(op)


# ----------------------------------------------------------------------------------------
# Structs, as msgspec encodes them: maps with every field, in declaration order


def ipc_key(model_name, world_size, worker_id, token_ids, start, end, request_id,
            cache_salt="", request_configs=None, num_kv_readers=1, null_chunk_mask=None):
    """IPCCacheServerKey (spec §3.1). worker_id None for scheduler lookups."""
    return {
        "model_name": model_name,
        "world_size": world_size,
        "worker_id": worker_id,
        "token_ids": list(token_ids),
        "start": start,
        "end": end,
        "request_id": request_id,
        "cache_salt": cache_salt,
        "request_configs": request_configs,
        "num_kv_readers": num_kv_readers,
        "null_chunk_mask": null_chunk_mask,
    }


KEY_FIELDS = ("model_name", "world_size", "worker_id", "token_ids", "start", "end",
              "request_id", "cache_salt", "request_configs", "num_kv_readers",
              "null_chunk_mask")
PAYLOAD_FIELDS = ("instance_id", "model_name", "world_size", "block_size", "num_layers",
                  "hidden_dim_size", "dtype_str", "use_mla", "num_physical_slots",
                  "engine_group_infos", "group_hidden_dim_sizes", "group_layout_descs",
                  "enable_l1_kvweave_quant")


def register_payload(instance_id, model_name, world_size, num_layers, hidden_dim_size,
                     dtype_str, block_size=16, use_mla=False, num_physical_slots=None,
                     engine_group_infos=(), group_hidden_dim_sizes=None,
                     group_layout_descs=None, enable_l1_kvweave_quant=False):
    """RegisterEngineDrivenContextPayload (spec §3.2)."""
    return {
        "instance_id": instance_id,
        "model_name": model_name,
        "world_size": world_size,
        "block_size": block_size,
        "num_layers": num_layers,
        "hidden_dim_size": hidden_dim_size,
        "dtype_str": dtype_str,
        "use_mla": use_mla,
        "num_physical_slots": num_physical_slots,
        "engine_group_infos": list(engine_group_infos),
        "group_hidden_dim_sizes": group_hidden_dim_sizes,
        "group_layout_descs": group_layout_descs,
        "enable_l1_kvweave_quant": enable_l1_kvweave_quant,
    }


def new_instance_id(rng=random):
    """A random 63-bit instance id, as the adapter makes one (large: packs as uint64)."""
    return rng.getrandbits(62) | (1 << 62)


class Layout:
    """The slot layout of a registration: shape [2, layers, chunk, hidden] ([layers, chunk,
    hidden] with MLA), dtype, and bytes per chunk object."""

    def __init__(self, num_layers, hidden, dtype, chunk_tokens, use_mla=False):
        self.num_layers, self.hidden, self.dtype = num_layers, hidden, dtype
        self.chunk_tokens, self.use_mla = chunk_tokens, use_mla
        self.shape = ([] if use_mla else [2]) + [num_layers, chunk_tokens, hidden]
        self.itemsize = DTYPE_SIZES[dtype]
        self.nbytes = math.prod(self.shape) * self.itemsize

    def payload(self, instance_id, model_name, world_size, **kw):
        kw.setdefault("num_physical_slots", self.chunk_tokens)
        return register_payload(instance_id, model_name, world_size, self.num_layers,
                                self.hidden, self.dtype, use_mla=self.use_mla, **kw)


class HybridLayout:
    """A hybrid model's registration as LMCache's worker builds it (transfer_context/
    worker_transfer.py, transfer_plan.py): kernel groups (one per attention kind's layers),
    object groups of kernel groups with a sliding window in chunks (-1: full attention), each
    kernel group's per-chunk tensor [kv_size, num_layers, slots_per_chunk_in_window, hidden]
    (without the leading 1 when kv_size is 1)."""

    def __init__(self, chunk_tokens, kernel_groups, object_groups):
        """kernel_groups: [(kv_size, num_layers, slots_per_chunk_in_window, hidden, dtype)];
        object_groups: [(kernel_group_ids, sw_size_chunks)]."""
        self.chunk_tokens = chunk_tokens
        self.kernel_groups, self.object_groups = kernel_groups, object_groups
        self.shapes, self.dtypes, self.nbytes = [], [], []
        for kg_ids, _ in object_groups:
            sh = []
            for k in kg_ids:
                kv, layers, slots, hidden, _dt = kernel_groups[k]
                sh.append(([kv] if kv > 1 else []) + [layers, slots, hidden])
            self.shapes.append(sh)
            self.dtypes.append([kernel_groups[k][4] for k in kg_ids])
            self.nbytes.append([math.prod(x) * DTYPE_SIZES[d] for x, d in
                                zip(sh, self.dtypes[-1])])

    def metadata(self, tokens_per_chunk=None):
        """KVTransferMetadataWire, as a map (msgspec Struct)."""
        kgs = [{"kernel_group_id": i, "engine_group_id": i, "layer_indices": list(range(l)),
                "blocks_per_chunk": 1, "blocks_per_window": 1, "slots_per_chunk_in_window": s,
                "kv_size": kv, "num_layers": l, "hidden_dim_size": h, "slots_per_block": s,
                "tokens_per_block": self.chunk_tokens, "dtype_str": d, "engine_kv_format_int": 0}
               for i, (kv, l, s, h, d) in enumerate(self.kernel_groups)]
        ogs = [{"object_group_id": g, "kernel_group_ids": list(ids), "sw_size_chunks": sw}
               for g, (ids, sw) in enumerate(self.object_groups)]
        return {"num_chunks_in_sw": [sw for _, sw in self.object_groups],
                "tokens_per_chunk": tokens_per_chunk or self.chunk_tokens,
                "kernel_groups": kgs, "object_groups": ogs}

    def payload(self, instance_id, model_name, world_size, **kw):
        kv, layers, _, hidden, dtype = self.kernel_groups[0]
        p = register_payload(instance_id, model_name, world_size, layers, hidden, dtype,
                             engine_group_infos=[{"engine_group_id": i,
                                                  "layer_indices": list(range(k[1]))}
                                                 for i, k in enumerate(self.kernel_groups)])
        p.update({"object_group_layout_shapes": self.shapes,
                  "object_group_layout_dtype_strs": self.dtypes,
                  "num_chunks_in_sw": [sw for _, sw in self.object_groups],
                  "transfer_metadata_wire": self.metadata()})
        p.update(kw)
        return p


def check_slots(slots, layout, pool_size):
    """Asserts each slot is {offset, length, shape, dtype} of `layout`, inside the pool,
    page-aligned (every L1 object is), and that no two overlap."""
    ranges = []
    for i, sl in enumerate(slots):
        assert isinstance(sl, dict) and set(sl) >= {"offset", "length", "shape", "dtype"}, \
            "slot %d is not {offset, length, shape, dtype}: %r" % (i, sl)
        off, ln = sl["offset"], sl["length"]
        assert all(isinstance(v, int) and not isinstance(v, bool) for v in (off, ln)), sl
        assert sl["shape"] == layout.shape, "slot %d shape %r, want %r" % (i, sl["shape"],
                                                                           layout.shape)
        assert sl["dtype"] == layout.dtype, "slot %d dtype %r, want %r" % (i, sl["dtype"],
                                                                           layout.dtype)
        assert ln == math.prod(sl["shape"]) * layout.itemsize == layout.nbytes, \
            "slot %d length %d != prod(shape) * itemsize = %d" % (i, ln, layout.nbytes)
        assert 0 <= off and off + ln <= pool_size, \
            "slot %d [%d, %d) outside the pool of %d bytes" % (i, off, off + ln, pool_size)
        assert off % PAGE == 0, "slot %d offset %d is not page-aligned" % (i, off)
        ranges.append((off, off + ln))
    ranges.sort()
    for a, b in zip(ranges, ranges[1:]):
        assert a[1] <= b[0], "slots %r and %r overlap" % (a, b)


# ----------------------------------------------------------------------------------------
# Shared memory, as the client maps it: shm_open("/" + name, O_RDWR) = /dev/shm/<name>


class Shm:
    def __init__(self, shm_name, pool_size):
        assert isinstance(shm_name, str) and shm_name and "/" not in shm_name.lstrip("/"), \
            "shm_name %r is not a POSIX shm name" % (shm_name,)
        self.path = "/dev/shm/" + shm_name.lstrip("/")
        self.size = pool_size
        self._fd = os.open(self.path, os.O_RDWR)
        try:
            st = os.fstat(self._fd)
            assert st.st_size >= pool_size, "%s has %d bytes < pool_size %d" % (
                self.path, st.st_size, pool_size)
            self.mm = mmap.mmap(self._fd, pool_size)
        except BaseException:
            os.close(self._fd)
            raise

    def write(self, offset, data):
        assert 0 <= offset and offset + len(data) <= self.size, (offset, len(data), self.size)
        self.mm[offset:offset + len(data)] = data

    def read(self, offset, length):
        assert 0 <= offset and offset + length <= self.size, (offset, length, self.size)
        return self.mm[offset:offset + length]

    def close(self):
        if self.mm is not None:
            self.mm.close()
            os.close(self._fd)
            self.mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------------------
# The client


class RemoteError(Exception):
    """An error reply [uid, op, LMCACHE_RPC_ERROR_V1, {error_type, message}]."""

    def __init__(self, op, error_type, message):
        super().__init__("%s: %s: %s" % (op, error_type, message))
        self.op, self.error_type, self.message = op, error_type, message


class NoReply(AssertionError):
    pass


class Reply:
    """One reply: frames (raw), value (decoded third frame, None for 2 frames), error
    (RemoteError or None)."""

    def __init__(self, frames):
        self.frames = frames
        self.value = None
        self.error = None
        n = len(frames)
        assert n in (2, 3, 4), "reply has %d frames: %r" % (n, frames[:5])
        if n == 3:
            try:
                self.value = unpack(frames[2])
            except Exception as e:   # noqa: BLE001 - any undecodable value is a failure
                raise AssertionError("reply value frame does not decode (%s): %r"
                                     % (e, frames[2][:200]))
        elif n == 4:
            assert frames[2] == ERROR_MARKER, \
                "4-frame reply whose third frame is not %r: %r" % (ERROR_MARKER, frames[:4])
            err = unpack(frames[3])
            assert isinstance(err, dict), "error reply value is not a map: %r" % (err,)
            assert isinstance(err.get("error_type"), str) and err["error_type"], err
            assert isinstance(err.get("message"), str), err
            assert len(err["message"].encode()) <= 4096, "error message over 4096 bytes"
            self.error = RemoteError(_op_label(frames[1]), err["error_type"], err["message"])

    @property
    def has_value(self):
        return len(self.frames) == 3


def _op_label(frame):
    try:
        v = unpack(frame)
    except Exception:   # noqa: BLE001
        return repr(frame)
    return OP_NAMES.get(v, v) if isinstance(v, int) else v


class LmcClient:
    """One DEALER, as one LMCache client object. call(op, *args) packs each argument as one
    frame and returns the decoded value (None for a 2-frame reply), raising RemoteError for
    an error reply and NoReply when nothing comes within `timeout` s."""

    def __init__(self, endpoint, ctx=None, timeout=RECV_TIMEOUT_S, sockopts=None):
        self.endpoint = endpoint
        self.timeout = timeout
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        self.sock.setsockopt(zmq.LINGER, 0)          # test hygiene; not on the wire
        for opt, value in (sockopts or {}).items():   # a test's (a client that reads slowly)
            self.sock.setsockopt(opt, value)
        self.sock.connect(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self._uids = itertools.count(0)

    # -- raw layer ---------------------------------------------------------------------

    def next_uid(self):
        return pack(next(self._uids))

    def send_frames(self, frames):
        self.sock.send_multipart([bytes(f) for f in frames])

    def send(self, op, *args, raw_args=None):
        """Sends [uid, op, args...] (args packed one per frame, or raw_args as they are);
        returns (uid frame, op frame)."""
        uid = self.next_uid()
        opf = op_frame(op)
        argf = [bytes(a) for a in raw_args] if raw_args is not None else [pack(a) for a in args]
        self.send_frames([uid, opf] + argf)
        return uid, opf

    def recv_frames(self, timeout=None):
        """The next reply's frames, or None when none arrives within `timeout` s."""
        t = self.timeout if timeout is None else timeout
        if not self.poller.poll(int(t * 1000)):
            return None
        return self.sock.recv_multipart()

    def recv(self, uid, opf, timeout=None, what=None):
        """The reply to (uid, opf): asserts uid and op are echoed byte for byte."""
        frames = self.recv_frames(timeout)
        if frames is None:
            raise NoReply("no reply to %s within %.1f s" % (what or _op_label(opf),
                                                            self.timeout if timeout is None
                                                            else timeout))
        assert len(frames) >= 2, "reply with %d frame(s): %r" % (len(frames), frames)
        assert frames[0] == uid, "reply uid frame %r does not echo %r (stray reply?) %r" % (
            frames[0], uid, frames[:4])
        assert frames[1] == opf, "reply op frame %r does not echo %r" % (frames[1], opf)
        return Reply(frames)

    def request(self, op, *args, raw_args=None, timeout=None):
        uid, opf = self.send(op, *args, raw_args=raw_args)
        return self.recv(uid, opf, timeout)

    def call(self, op, *args, raw_args=None, timeout=None):
        r = self.request(op, *args, raw_args=raw_args, timeout=timeout)
        if r.error is not None:
            raise r.error
        return r.value

    def call_ack(self, op, *args):
        """A None method: asserts the 2-frame reply."""
        r = self.request(op, *args)
        if r.error is not None:
            raise r.error
        assert not r.has_value, "%s: expected the 2-frame ack, got value %r" % (
            _op_label(r.frames[1]), r.value)

    def error(self, op, *args, raw_args=None):
        """Sends a request that must fail; returns its RemoteError."""
        r = self.request(op, *args, raw_args=raw_args)
        assert r.error is not None, "%s: expected an error reply, got %r" % (
            _op_label(r.frames[1]), r.frames[2:])
        return r.error

    def expect_silence(self, timeout=0.3):
        """Asserts nothing arrives within `timeout` s."""
        frames = self.recv_frames(timeout)
        assert frames is None, "unexpected reply: %r" % (frames[:4],)

    # -- the RequestClient methods the engine-driven path uses (spec §4) ----------------

    def get_chunk_size(self):
        return self.call(OPS["get_chunk_size"])

    def noop(self):
        return self.call(OPS["noop"])

    def ping(self, instance_id=None):
        return self.call(OPS["ping"], instance_id)

    def get_experimental(self):
        return self.call(OPS["get_experimental"])

    def poll_kv_events(self, model_name, cursor, max_events):
        return self.call(OPS["poll_kv_events"], model_name, cursor, max_events)

    def register(self, payload):
        return self.call(OPS["register_kv_cache_engine_driven_context"], payload)

    def unregister(self, instance_id):
        self.call_ack(OPS["unregister_kv_cache_engine_driven_context"], instance_id)

    def lookup(self, key, tp_size):
        self.call_ack(OPS["lookup"], key, tp_size)

    def query_prefetch_status(self, request_id):
        return self.call(OPS["query_prefetch_status"], request_id)

    def wait_prefetch_status(self, request_id, timeout_s):
        return self.call(OPS["wait_prefetch_status"], request_id, float(timeout_s))

    def query_prefetch_lookup_hits(self, request_id):
        return self.call(OPS["query_prefetch_lookup_hits"], request_id)

    def free_lookup_locks(self, key, tp_size):
        self.call_ack(OPS["free_lookup_locks"], key, tp_size)

    def end_session(self, request_id, *end_info):
        self.call_ack(OPS["end_session"], request_id, *end_info)

    def prepare_store(self, key, instance_id):
        return self.call(OPS["prepare_store"], key, instance_id)

    def commit_store(self, key, instance_id, data=b""):
        return self.call(OPS["commit_store"], key, instance_id, data)

    def prepare_retrieve(self, key, instance_id):
        return self.call(OPS["prepare_retrieve"], key, instance_id)

    def commit_retrieve(self, key, instance_id):
        return self.call(OPS["commit_retrieve"], key, instance_id)

    def clear(self, force=False):
        self.call_ack(OPS["clear"], force)

    def report_block_allocation(self, instance_id, model_name, records):
        self.call_ack(OPS["report_block_allocation"], instance_id, model_name, records)

    def close(self):
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        if self._own_ctx:
            self.ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------------------
# Self-check of the encoders against the spec's example bytes (§13, §2.1, §3.1)


def _fixstr(s):
    b = s.encode()
    assert len(b) < 32
    return bytes([0xa0 | len(b)]) + b


def golden_key_bytes():
    """A scheduler-lookup key written out by hand, byte by byte, per msgpack and spec §3.1:
    model "m", world_size 1, worker_id nil, token_ids [1, 2, 3], start 0, end 0, request_id
    "r", cache_salt "", request_configs nil, num_kv_readers 1, null_chunk_mask nil."""
    return (b"\x8b"
            + _fixstr("model_name") + _fixstr("m")
            + _fixstr("world_size") + b"\x01"
            + _fixstr("worker_id") + b"\xc0"
            + _fixstr("token_ids") + b"\x93\x01\x02\x03"
            + _fixstr("start") + b"\x00"
            + _fixstr("end") + b"\x00"
            + _fixstr("request_id") + _fixstr("r")
            + _fixstr("cache_salt") + b"\xa0"
            + _fixstr("request_configs") + b"\xc0"
            + _fixstr("num_kv_readers") + b"\x01"
            + _fixstr("null_chunk_mask") + b"\xc0")


def selftest():
    """Checks the encoders against bytes written out by hand from the spec. Raises
    AssertionError on the first difference; returns the number of checks."""
    n = 0

    def eq(got, want, what):
        nonlocal n
        assert got == want, "%s: %r != %r" % (what, got, want)
        n += 1

    # §13: uid 0, get_chunk_size (21) and its reply value 256; noop by name and "OK"
    eq(pack(0), b"\x00", "uid 0")
    eq(pack(1), b"\x01", "uid 1")
    eq(op_frame(OPS["get_chunk_size"]), b"\x15", "op get_chunk_size")
    eq(pack(256), b"\xcd\x01\x00", "256")
    eq(op_frame("noop"), b"\xa4noop", "op noop by name")
    eq(pack("OK"), b"\xa2OK", '"OK"')
    eq(op_frame(OPS["lookup"]), b"\x08", "op lookup")
    eq(op_frame(OPS["ping"]), b"\x16", "op ping")
    eq(op_frame(OPS["get_experimental"]), b"\x20", "op get_experimental")
    eq(pack(None), b"\xc0", "nil")
    eq(pack(""), b"\xa0", "empty salt")
    eq(pack(b""), b"\xc4\x00", "commit_store data")
    eq(pack(True), b"\xc3", "true")
    eq(pack(False), b"\xc2", "false")
    eq(pack(1.5), b"\xcb\x3f\xf8" + b"\x00" * 6, "float64")
    eq(pack([]), b"\x90", "[]")
    # §2.1: a 63-bit instance_id packs as uint64 (cf ...)
    iid = 0x25895F0000000001
    eq(pack(iid), b"\xcf" + iid.to_bytes(8, "big"), "instance_id uint64")
    # §3.1: the key map, 11 fields in declaration order, starting 8b aa "model_name"
    k = ipc_key("m", 1, None, [1, 2, 3], 0, 0, "r")
    eq(tuple(k), KEY_FIELDS, "key field order")
    kb = pack(k)
    eq(kb[:12], b"\x8b\xaamodel_name", "key prefix")
    eq(kb, golden_key_bytes(), "key bytes")
    eq(unpack(kb), k, "key round trip")
    # §3.2: the payload's field order
    p = register_payload(iid, "m", 1, 2, 64, "float16")
    eq(tuple(p), PAYLOAD_FIELDS, "payload field order")
    eq(pack(p)[:1], b"\x8d", "payload is a 13-entry map")
    # the slot layout arithmetic of §3.4
    lay = Layout(2, 64, "float16", 16)
    eq(lay.shape, [2, 2, 16, 64], "slot shape")
    eq(lay.nbytes, 2 * 2 * 16 * 64 * 2, "slot bytes")
    mla = Layout(3, 576, "bfloat16", 16, use_mla=True)
    eq(mla.shape, [3, 16, 576], "MLA slot shape")
    eq(mla.nbytes, 3 * 16 * 576 * 2, "MLA slot bytes")
    # the reply parser: 2 frames = None, 3 = value, 4 = the error form
    r = Reply([b"\x00", b"\x08"])
    eq((r.has_value, r.value, r.error), (False, None, None), "2-frame reply")
    r = Reply([b"\x00", b"\x15", b"\xcd\x01\x00"])
    eq((r.has_value, r.value), (True, 256), "3-frame reply")
    r = Reply([b"\x00", b"\x63", ERROR_MARKER,
               pack({"error_type": "unknown_type", "message": "op 99"})])
    eq((r.error.error_type, r.error.message), ("unknown_type", "op 99"), "error reply")
    # the client's uid counter starts at 0 and counts per DEALER
    c = LmcClient.__new__(LmcClient)
    c._uids = itertools.count(0)
    eq([c.next_uid() for _ in range(3)], [b"\x00", b"\x01", b"\x02"], "uids")
    return n


# ----------------------------------------------------------------------------------------
# Tokens and chunk payloads shared by the tests and the worker process


def tokens_of(seed, n):
    """n deterministic token ids (a fake prompt), the same in every process."""
    r = random.Random(seed)
    return [r.randrange(128256) for _ in range(n)]


def chunk_data(tag, worker, index, length):
    """The bytes worker `worker` stores for chunk `index` (deterministic)."""
    return random.Random("%s/%d/%d" % (tag, worker, index)).randbytes(length)


def _crash_worker(args):
    """Registers, reserves (prepare_store) every chunk of the prompt, writes the slots, says
    ready, then keeps its instance alive with ping(instance_id) until it is killed."""
    lay = Layout(args["num_layers"], args["hidden"], args["dtype"], args["chunk"])
    iid = args["instance_id"]
    with LmcClient(args["endpoint"]) as c:
        reg = c.register(lay.payload(iid, args["model"], 1))
        assert reg["error"] is None, reg
        tokens = tokens_of(args["seed"], args["chunks"] * args["chunk"])
        key = ipc_key(args["model"], 1, 0, tokens, 0, len(tokens), "crash-req")
        ctx = c.prepare_store(key, iid)["context"]
        with Shm(reg["shm_name"], reg["pool_size"]) as shm:
            for sl in ctx["slots"]:
                shm.write(sl["offset"], bytes([0x5a]) * sl["length"])
        print(json.dumps({"ready": True, "slots": len(ctx["slots"]),
                          "indices": ctx["chunk_indices"]}), flush=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            c.ping(iid)
            time.sleep(args.get("ping_s", 0.2))


def main(argv):
    if argv[1:2] == ["selftest"]:
        print("lmc_client selftest: %d checks passed" % selftest())
        return 0
    if argv[1:2] == ["crash-worker"] and len(argv) == 3:
        _crash_worker(json.loads(argv[2]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
