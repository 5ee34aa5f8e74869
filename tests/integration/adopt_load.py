"""The mixed load of test_adopt.py's kill loop, in a process of its own (it outlives each
daemon it loads): python3 adopt_load.py ENDPOINT DIR SEED SECONDS.

One kvtier.Client (heartbeat on, so it carries on across restarts by itself) loops until
SECONDS passed or DIR/stop exists:
  * stores a batch of 1-6 objects of 4-96 KiB (RESERVE, fill, COMMIT); once COMMIT said every
    one is stored, appends "KEYHEX SIZE" per object to DIR/acked (flushed at once);
  * now and then reserves a batch, writes half of it and never commits it: those keys go to
    DIR/abandoned first (they must never be served);
  * reads back a random acknowledged object that L1 has (ACQUIRE) and checks every byte; a
    wrong byte ends the run with "BAD ..." in DIR/errors and exit status 3.
Every object's bytes are kvtest.payload(KEYHEX, SIZE), so a reader can check any hit without
the writer. Errors of a daemon that is away (killed, restarting) are waited out. Writes
DIR/progress (the count of stored batches) so the driver knows the load is running."""

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvtier  # noqa: E402
from kvtest import payload  # noqa: E402

NS = "adopt/load"


def main():
    endpoint, out, seed, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    rng = random.Random(seed)
    acked_f = open(os.path.join(out, "acked"), "a")
    abandoned_f = open(os.path.join(out, "abandoned"), "a")
    acked = []
    c = kvtier.Client(endpoint, instance="adopt-load-%d" % seed, timeout_ms=1500,
                      heartbeat_ms=100)
    n = batches = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not os.path.exists(os.path.join(out, "stop")):
        try:
            r = rng.random()
            if r < 0.25 and acked:
                k, size = rng.choice(acked)
                views, lease = c.acquire(NS, [bytes.fromhex(k)])
                try:
                    if views and bytes(views[0]) != payload(k, size):
                        with open(os.path.join(out, "errors"), "a") as f:
                            f.write("BAD %s %d: other bytes served\n" % (k, size))
                        return 3
                finally:
                    if lease:
                        c.release(lease)
                continue
            m = rng.randint(1, 6)
            keys = ["%08x%016x%08x" % (seed, n + i, rng.getrandbits(32)) for i in range(m)]
            n += m
            sizes = [rng.randint(1, 24) * 4096 - rng.randint(0, 4000) for _ in keys]
            abandon = r > 0.92
            if abandon:     # recorded before a byte of them is written
                abandoned_f.write("".join("%s %d\n" % ks for ks in zip(keys, sizes)))
                abandoned_f.flush()
            slots, lease = c.reserve(NS, [bytes.fromhex(k) for k in keys], sizes)
            if not lease:
                continue
            for i, (s, k, size) in enumerate(zip(slots, keys, sizes)):
                if s is not None and not (abandon and i >= len(keys) // 2):
                    s[:] = payload(k, size)
            if abandon:
                continue    # the lease is left to expire (or to die with the daemon)
            if c.commit(lease) == m:
                acked_f.write("".join("%s %d\n" % ks for ks in zip(keys, sizes)))
                acked_f.flush()
                acked.extend(zip(keys, sizes))
                batches += 1
                with open(os.path.join(out, "progress.new"), "w") as f:
                    f.write("%d\n" % batches)
                os.replace(os.path.join(out, "progress.new"), os.path.join(out, "progress"))
        except (kvtier.KvtierError, ValueError):
            time.sleep(0.02)    # the daemon is away (killed or restarting): wait it out
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
