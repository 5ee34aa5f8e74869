#!/usr/bin/python3
"""Regenerates tests/fuzz/corpus/decode/ seeds: one byte of request type, then a msgpack body
(protocol v1, protocol/kvt_proto.h). Needs Debian's python3-msgpack: /usr/bin/python3 gen_corpus.py"""
import os
import struct

import msgpack

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus", "decode")
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
    "ping_instance": (3, {"instance": "host-0:1234"}),
    "lookup": (4, {"ns": "llama3-8b", "keys": [K1, K2], "salt": "s", "lock": True,
                   "prefetch": False}),
    "prefetch_status": (5, {"job": 7}),
    "reserve": (6, {"ns": "llama3-8b", "keys": [K1, K2], "sizes": [4096, 8192]}),
    "reserve_size": (6, {"ns": "m", "keys": [K1], "size": 65536, "salt": ""}),
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


if __name__ == "__main__":
    main()
