#!/usr/bin/python3
"""Regenerates the msgpack seeds of tests/fuzz/corpus/: decode/ (one byte of request type, then a
protocol v1 body, protocol/kvt_proto.h), lmc/ (one selector byte of fuzz_lmc.c, then an
LMCache MP frame as msgspec encodes it: structs as maps with every field, in declaration order)
ring/ (fuzz_ring.c: a selector byte, a shared-memory ring's region, then a program of
operations; the layout is common/kvt_ring.h's) and seglog/ (fuzz_seglog.c: a program of
appends and removes, then one damage to the files).
Needs Debian's python3-msgpack: /usr/bin/python3 gen_corpus.py"""
import os
import struct

import msgpack

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus", "decode")
LMC_OUT = os.path.join(HERE, "corpus", "lmc")
RING_OUT = os.path.join(HERE, "corpus", "ring")
SEGLOG_OUT = os.path.join(HERE, "corpus", "seglog")
K1 = bytes(range(16))
K2 = bytes(range(16, 32))
H1 = bytes(range(64))
H2 = bytes(range(64, 128))

SEEDS = {
    "hello": (1, {"version": 1, "client": "vllm", "instance": "host-0:1234"}),
    "bye": (2, {"instance": "host-0:1234"}),
    "ping": (3, {}),
    "hello_token": (1, {"version": 1, "client": "vllm", "instance": "host-0:1234",
                        "token": "0123456789abcdef0123456789abcdef"}),
    "hello_fastpath": (1, {"version": 1, "client": "sglang", "instance": "host-0:99",
                           "fastpath": True, "resident": True}),
    "ping_instance": (3, {"instance": "host-0:1234"}),
    "lookup": (4, {"ns": "llama3-8b", "keys": [K1, K2], "salt": "s", "lock": True,
                   "prefetch": False}),
    "prefetch_status": (5, {"job": 7}),
    "reserve": (6, {"ns": "llama3-8b", "keys": [K1, K2], "sizes": [4096, 8192]}),
    "reserve_size": (6, {"ns": "m", "keys": [K1], "size": 65536, "salt": ""}),
    "reserve_labels": (6, {"ns": "vllm-ec/m/bfloat16/h64", "keys": [K1, K2], "size": 4096,
                           "labels": ["mm-9f86d081", None]}),
    "put_labels": (10, {"ns": "media", "keys": [K1], "labels": ["caf\u00e9-\U0001f600"]}),
    "commit": (7, {"lease": 42, "failed": [1]}),
    "commit_plain": (7, {"lease": 42}),
    "acquire": (8, {"ns": "m", "keys": [K1]}),
    "release": (9, {"lease": 42}),
    "put": (10, {"ns": "llama3-8b", "keys": [K1, K2], "salt": "x"}),
    "get": (11, {"ns": "m", "keys": [K2]}),
    "remove": (12, {"ns": "m", "keys": [K1]}),
    "clear": (13, {"ns": "m"}),
    "stats": (14, {}),
    "hash_tokens": (15, {"tokens": struct.pack("<8I", *range(8)), "chunk_tokens": 4,
                         "salt": "s"}),
    "hash_tokens_big_limit": (15 | 0x80, {"tokens": struct.pack("<4I", 1, 2, 3, 4)}),
    "register_gpu": (16, {"device": 0, "layers": 2, "num_blocks": 64, "block_tokens": 16,
                          "token_bytes": 4096, "dtype": "bfloat16",
                          "handles": [H1, H2], "offsets": [0, 4096]}),
    "unregister_gpu": (17, {"device": 0}),
    "store_gpu": (18, {"ns": "m", "keys": [K1, K2], "device": 0,
                       "block_ids": [0, 1, 2, 3], "event": H1}),
    "retrieve_gpu": (19, {"ns": "m", "keys": [K1], "device": 0, "block_ids": [7, 9],
                          "salt": "s"}),
    "unknown_20": (20, {"version": 1}),
    "hello_nil_field": (1, {"version": 1, "client": "c", "instance": "i", "salt": None}),
}


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, (t, body) in SEEDS.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(bytes([t]) + msgpack.packb(body, use_bin_type=True))
    # a bare uint frame (for kvt_msg_read_uint) and a truncated body
    with open(os.path.join(OUT, "uint_frame"), "wb") as f:
        f.write(bytes([3]) + msgpack.packb(123456789))
    with open(os.path.join(OUT, "truncated_lookup"), "wb") as f:
        f.write(bytes([4]) + msgpack.packb(SEEDS["lookup"][1], use_bin_type=True)[:-5])


# fuzz_lmc.c's selectors (low nibble); | 0x80 = small limits
T_OP, T_KEY, T_CTX, T_INT_NIL, T_INT, T_UINT, T_BOOL, T_DOUBLE, T_STR, T_BIN, T_RECORDS, \
    T_PACK_ERROR = range(12)
SMALL = 0x80


def lmc_key(worker_id=1, tokens=tuple(range(1, 513)), start=0, end=512, salt="", mask=None):
    """IPCCacheServerKey: msgpack-python keeps dict order and picks the smallest encodings,
    as msgspec does."""
    return {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "world_size": 2,
            "worker_id": worker_id, "token_ids": list(tokens), "start": start, "end": end,
            "request_id": "cmpl-5f1c-0", "cache_salt": salt, "request_configs": None,
            "num_kv_readers": 1, "null_chunk_mask": mask}


LMC_CTX = {"instance_id": 0x25895F0102030405, "model_name": "meta-llama/Llama-3.1-8B-Instruct",
           "world_size": 2, "block_size": 16, "num_layers": 32, "hidden_dim_size": 1024,
           "dtype_str": "bfloat16", "use_mla": False, "num_physical_slots": 256,
           "engine_group_infos": [], "group_hidden_dim_sizes": None,
           "group_layout_descs": None, "enable_l1_kvweave_quant": False}

LMC_SEEDS = {
    "op_get_chunk_size": (T_OP, 21),
    "op_noop_name": (T_OP, "noop"),
    "op_register_name": (T_OP | 0x30, "register_kv_cache_engine_driven_context"),
    "op_unknown_name": (T_OP, "subscribe_kv_events"),
    "op_unknown_int": (T_OP, 99),
    "key_lookup": (T_KEY, lmc_key(worker_id=None)),
    "key_store": (T_KEY, lmc_key(start=256, salt="tenant-a", mask=[[False, True], [False]])),
    "key_small_limits": (T_KEY | SMALL, lmc_key(tokens=range(8), end=8)),
    "key_tokens_u32": (T_KEY, lmc_key(tokens=[0, 127, 128, 255, 65535, 65536, 2**32 - 1],
                                      end=0)),
    "ctx": (T_CTX, LMC_CTX),
    "ctx_groups": (T_CTX, dict(LMC_CTX, instance_id=-7, use_mla=True, num_physical_slots=None,
                               engine_group_infos=[{"engine_group_id": 0,
                                                    "layer_indices": [0, 1],
                                                    "tokens_per_block": 16}],
                               kernel_groups=[[1, 2]])),
    "ctx_object_groups": (T_CTX, dict(
        LMC_CTX, engine_group_infos=[{"engine_group_id": 0}, {"engine_group_id": 1}],
        object_group_layout_shapes=[[[2, 2, 16, 32]], [[2, 1, 8, 32], [1, 1, 64]]],
        object_group_layout_dtype_strs=[["float16"], ["bfloat16", "float32"]],
        num_chunks_in_sw=[-1, 1],
        transfer_metadata_wire={"num_chunks_in_sw": [-1, 1], "tokens_per_chunk": 16,
                                "kernel_groups": [],
                                "object_groups": [
                                    {"object_group_id": 0, "kernel_group_ids": [0],
                                     "sw_size_chunks": -1},
                                    {"object_group_id": 1, "kernel_group_ids": [1, 2],
                                     "sw_size_chunks": 1}]})),
    "int_instance": (T_INT, 0x25895F0102030405),
    "int_nil": (T_INT_NIL, None),
    "int_negative": (T_INT_NIL, -2),
    "uint_tp": (T_UINT, 2),
    "bool_false": (T_BOOL, False),
    "bool_int": (T_BOOL, 1),
    "double_timeout": (T_DOUBLE, 1.5),
    "str_request_id": (T_STR, "cmpl-5f1c-0"),
    "bin_empty": (T_BIN, b""),
    "records": (T_RECORDS, [{"req_id": "cmpl-5f1c-0", "new_block_ids": [3, 4],
                             "new_token_ids": [1, 2, 3]}]),
    "records_empty": (T_RECORDS | SMALL, []),
}


def lmc():
    os.makedirs(LMC_OUT, exist_ok=True)
    for name, (sel, value) in LMC_SEEDS.items():
        with open(os.path.join(LMC_OUT, name), "wb") as f:
            f.write(bytes([sel]) + msgpack.packb(value, use_bin_type=True))
    # the error reply encoder takes raw text: a cut UTF-8 sequence at 4096 bytes
    with open(os.path.join(LMC_OUT, "pack_error_utf8"), "wb") as f:
        f.write(bytes([T_PACK_ERROR]) + b"a" + "\u00e9".encode() * 2100)
    with open(os.path.join(LMC_OUT, "truncated_key"), "wb") as f:
        f.write(bytes([T_KEY]) + msgpack.packb(lmc_key(), use_bin_type=True)[:-7])


# ---- ring (common/kvt_ring.h) ----
RING_MAGIC = 0x31474E495254564B  # "KVTRING1"
RING_HDR = 384
OFF_HEAD, OFF_PROD_WAIT, OFF_PROD_CLOSED = 128, 136, 140
OFF_TAIL, OFF_CONS_WAIT, OFF_CONS_CLOSED = 256, 264, 268
# fuzz_ring.c's operations (low 3 bits) and poke fields
OP_POP, OP_POP_SMALL, OP_WAIT0, OP_POKE, OP_PUSH, OP_PWAIT, OP_CLOSE, OP_WAIT1US = range(8)
F_HEAD, F_TAIL, F_PROD_WAIT, F_CONS_WAIT, F_PROD_CLOSED, F_CONS_CLOSED, F_MAGIC, F_CAP = range(8)
F_NEAR, F_DATA = 0x40, 0x80


def ring_payload(frames):
    """A message payload: u32 count, then per frame u32 length + bytes."""
    return struct.pack("<I", len(frames)) + b"".join(
        struct.pack("<I", len(f)) + f for f in frames)


def ring_image(cap, records=(), tail=0, kinds=None, lens=None, closed=(0, 0)):
    """A region whose consumer is at `tail` with `records` (payloads) waiting after it;
    kinds/lens override a record's header fields (hostile seeds)."""
    data = bytearray(cap)
    pos = tail
    for i, rec in enumerate(records):
        kind = kinds[i] if kinds else 1
        ln = lens[i] if lens else len(rec)
        raw = struct.pack("<II", ln, kind) + rec + b"\0" * (-len(rec) % 8)
        for j, b in enumerate(raw):
            data[(pos + j) % cap] = b
        pos += len(raw)
    hdr = bytearray(RING_HDR)
    struct.pack_into("<QIII", hdr, 0, RING_MAGIC, 1, RING_HDR, cap)
    struct.pack_into("<Q", hdr, OFF_HEAD, pos)
    struct.pack_into("<Q", hdr, OFF_TAIL, tail)
    struct.pack_into("<I", hdr, OFF_PROD_CLOSED, closed[0])
    struct.pack_into("<I", hdr, OFF_CONS_CLOSED, closed[1])
    return bytes(hdr) + bytes(data)


def sel(cap, raw=False):
    return bytes([{64: 0, 128: 1, 256: 2, 512: 3}[cap] | (4 if raw else 0)])


def poke(field, value):
    return bytes([OP_POKE, field]) + struct.pack("<Q", value % 2**64)


def push(*lens):
    return bytes([OP_PUSH, len(lens)] + list(lens))


LOOKUP_REQ = [msgpack.packb(7), msgpack.packb(4),
              msgpack.packb({"ns": "m", "keys": [K1, K2]}, use_bin_type=True)]
REPLY = [msgpack.packb(7), msgpack.packb(4),
         msgpack.packb({"ok": True, "hits": 2, "l1": 2})]

RING_SEEDS = {
    "empty": (256, ring_image(256), bytes([OP_POP, OP_WAIT0]) + push(8, 1, 40) + bytes([OP_POP])),
    "two_requests": (256, ring_image(256, [ring_payload(LOOKUP_REQ), ring_payload(REPLY)]),
                     bytes([OP_POP, OP_POP, OP_POP, OP_WAIT1US])),
    "wrapped": (64, ring_image(64, [ring_payload([b"x" * 20])], tail=64 * 5 + 48),
                bytes([OP_POP_SMALL, 10, OP_POP, OP_POP])),
    "hostile_head": (128, ring_image(128, [ring_payload(REPLY)]),
                     poke(F_HEAD | F_NEAR, 8) + bytes([OP_POP, OP_POP])),
    "hostile_tail": (128, ring_image(128, [ring_payload(REPLY)]),
                     push(30) + poke(F_TAIL, 2**64 - 8) + push(1) + bytes([OP_PWAIT, 4])),
    "record_kind": (256, ring_image(256, [ring_payload(REPLY)], kinds=[2]), bytes([OP_POP])),
    "record_len": (256, ring_image(256, [ring_payload(REPLY)], lens=[1000]), bytes([OP_POP])),
    "closed": (256, ring_image(256, [ring_payload(REPLY)], closed=(1, 0)),
               bytes([OP_POP, OP_POP, OP_WAIT1US, OP_CLOSE, 1]) + push(3)),
    "cycle": (512, ring_image(512), (push(200, 100) + bytes([OP_POP]) + poke(F_CONS_WAIT, 1)
                                     + poke(F_PROD_WAIT, 7)) * 6
              + poke(F_DATA, 2**40) + bytes([5]) + bytes([OP_POP])),
    "raw": (64, b"KVTRING1" + bytes(range(200)), bytes([OP_POP, OP_POP])),
}


def ring():
    os.makedirs(RING_OUT, exist_ok=True)
    for name, (cap, image, prog) in RING_SEEDS.items():
        with open(os.path.join(RING_OUT, name), "wb") as f:
            f.write(sel(cap, raw=(name == "raw")) + image[:RING_HDR + cap] + prog)


def seg_append(name_id, length):
    return bytes([name_id & 0x0f]) + struct.pack("<H", length)


def seg_remove(name_id):
    return bytes([0x80 | name_id])


SEGLOG_PROGS = {
    "small_objects": b"".join(seg_append(i, 100 + 37 * i) for i in range(16)),
    "large_objects": b"".join(seg_append(i, 19000 - i) for i in range(8)),
    "replace_remove": (seg_append(1, 5000) + seg_append(1, 7000) + seg_remove(1)
                       + seg_append(2, 4096) + seg_remove(2) + seg_append(2, 4095)
                       + seg_append(3, 0)),
    "many_segments": b"".join(seg_append(i % 16, 12000 + i) for i in range(40)),
}
# damage: kind (1 cut, 2 flip, 3 delete an .idx, 4 replace an .idx), file pick (bit 7: an .idx),
# then an offset (3 bytes) and for a flip the bit
SEGLOG_DAMAGES = {
    "none": b"",
    "cut": bytes([1, 0]) + struct.pack("<I", 70000)[:3],
    "flip": bytes([2, 1]) + struct.pack("<I", 4100)[:3] + b"\x03",
    "flip_idx": bytes([2, 0x81]) + struct.pack("<I", 40)[:3] + b"\x05",
    "no_idx": bytes([3, 0]),
    "junk_idx": bytes([4, 0, 0, 0, 0]) + bytes(32) + b"n1",
}


def seglog():
    os.makedirs(SEGLOG_OUT, exist_ok=True)
    for pname, prog in SEGLOG_PROGS.items():
        ops, i = 0, 0
        while i < len(prog):
            ops, i = ops + 1, i + (1 if prog[i] & 0x80 else 3)
        prog += seg_remove(15) * (128 - ops)   # 128 ops: what follows is the damage
        for dname, dmg in SEGLOG_DAMAGES.items():
            with open(os.path.join(SEGLOG_OUT, pname + "_" + dname), "wb") as f:
                f.write(prog + dmg)


if __name__ == "__main__":
    main()
    lmc()
    ring()
    seglog()
