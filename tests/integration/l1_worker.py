"""A kvtier client in its own process, for the L1 tests (driven by kvtest.WorkerProcess).

It reads commands from stdin and answers on stdout, each one a 4-byte big-endian length and a
msgpack array / map. Answers are {ok: true, result} or {ok: false, error: str}. Commands:

  ["connect", endpoint, instance]   DEALER + HELLO; maps the arena HELLO names -> HELLO body
  ["call", type, body]              one request -> the reply body
  ["write", offset, seed, length]   writes kvtest.payload(seed, length) at offset -> its sha256
  ["write_pattern", offset, key, length]   writes kvtest.pattern(key, length) -> its sha256
  ["read", offset, length]          -> sha256 of the arena bytes there
  ["exit"]                          answers, then exits

Every receive has a 5 s timeout; the process exits when stdin closes.
"""

import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zmq  # noqa: E402

import kvtest  # noqa: E402


def read_exact(f, n):
    buf = b""
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def main():
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    ctx = zmq.Context()
    sock = None
    arena = None
    uid = 0
    while True:
        head = read_exact(inp, 4)
        if head is None:
            break
        msg = kvtest.unpack(read_exact(inp, struct.unpack(">I", head)[0]))
        op, args = msg[0], msg[1:]
        try:
            if op == "connect":
                endpoint, instance = args
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVTIMEO, kvtest.RCVTIMEO_MS)
                sock.setsockopt(zmq.SNDTIMEO, kvtest.RCVTIMEO_MS)
                sock.connect(endpoint)
                args = ["call", kvtest.HELLO, {"version": kvtest.PROTO_VERSION,
                                               "client": "l1_worker", "instance": instance}]
                op, args = args[0], args[1:]
            if op == "call":
                type_, body = args
                uid += 1
                sock.send_multipart([kvtest.pack(uid), kvtest.pack(type_), kvtest.pack(body)])
                frames = sock.recv_multipart()
                reply = kvtest.decode_reply(frames)
                assert reply.uid == uid, "reply uid %r, sent %r" % (reply.uid, uid)
                result = reply.body
                if type_ == kvtest.HELLO and result.get("ok") and arena is None:
                    arena = kvtest.Arena(result["shm"])
            elif op == "write":
                offset, seed, length = args
                data = kvtest.payload(seed, length)
                arena.write(offset, data)
                result = kvtest.sha256(data)
            elif op == "write_pattern":
                offset, k, length = args
                data = kvtest.pattern(k, length)
                arena.write(offset, data)
                result = kvtest.sha256(data)
            elif op == "read":
                offset, length = args
                result = kvtest.sha256(arena.read(offset, length))
            elif op == "exit":
                result = None
            else:
                raise ValueError("unknown command %r" % (op,))
            answer = {"ok": True, "result": result}
        except Exception as e:  # noqa: BLE001 - every failure goes back to the test
            answer = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
        data = kvtest.pack(answer)
        out.write(struct.pack(">I", len(data)) + data)
        out.flush()
        if op == "exit":
            break
    if arena is not None:
        arena.close()
    if sock is not None:
        sock.close(linger=0)
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
