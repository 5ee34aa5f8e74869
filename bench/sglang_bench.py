"""SGLang HiCache backend benchmark (`make bench-sglang`; docs/performance.md, "SGLang backend").

Starts its own daemon (build/kvtierd, no L2, L1 of 256 MiB on a private run dir), loads
kvtier.sglang.KvtierHiCacheStorage the way SGLang's factory does, and times, on a host pool of
bf16 pages of 512 KiB (page_first: 64 tokens x 8 layers x 2 heads x 128 dims, K and V):

  set   batch_set_v1 of 64 new pages (RESERVE, one copy per page into the arena, COMMIT)
  get   batch_get_v1 of those 64 pages into other pages of the pool (ACQUIRE, one copy, RELEASE)
  set/generic, get/generic   the same through batch_set / batch_get (SGLang without interface_v1)
  exists  batch_exists of those 64 pages (the prefetch thread's check before a get): one
          LOOKUP; judged in time (target <= 0.1 ms) and against stat/64, 64 os.stat calls on
          files in a temporary directory (what SGLang's own `file` backend's check costs).
          exists/again: the same call at once after it; ping: one PING on the backend's
          connection after that (the floor of any request: both processes' wake-ups)

against baselines run in the same process, alternating with it, on the same pool pages:

  memcpy/out  the same 32 MiB of the pool (the 64 pages are one run of token slots, so one
              torch copy_ of kv_buffer[:, first:last], K and V) into a 32 MiB region of a
              256 MiB tensor, the next region each round, so that it lands in memory that is
              not in cache, as the arena's slots do (the arena is 256 MiB too). set is judged
              against it (target >= 0.7).
  memcpy/in   the same copy back, from the tensor into the pool: get is judged against it.
  memcpy/bulk one copy_ of 32 MiB between two contiguous tensors, the same two each round
              (cache-warm): a ceiling, for reference.

--page-kib 256 halves the pages (4 layers instead of 8). Medians of --rounds rounds after
warm-up rounds that store four times the arena's size: the client's first write to each page
of its arena mapping is a page fault (the daemon's pages exist, the client's page-table entries
do not yet), which a long-running server pays once; before that, a set copies into the arena
at about half the speed. torch runs on one thread (the backend's copies are single-threaded
too). --quick: a few rounds, for CI (times not judged). Prints a table and, with --json, JSON.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
import sglang_iface  # noqa: E402

sglang_iface.install()
import kvtier  # noqa: E402
import kvtier.sglang  # noqa: E402,F401
from _daemon import start_daemon, stop_daemon  # noqa: E402

PAGES = 64
ARENA = 256 << 20                         # the daemon's L1
PAGE_KW = dict(page_size=64, layers=8, heads=2, head_dim=128, dtype=torch.bfloat16,
               layout="page_first")


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--daemon", default=os.path.join(REPO, "build", "kvtierd"))
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--page-kib", type=int, choices=(256, 512), default=512)
    args = ap.parse_args()
    page_kw = dict(PAGE_KW, layers=8 * args.page_kib // 512)
    rounds, warm = (3, 1) if args.quick else (args.rounds, 10)
    torch.set_num_threads(1)              # the backend's copies are single-threaded too
    workdir = tempfile.mkdtemp(prefix="kvt-bench-sglang-")
    proc, ipc = start_daemon(args.daemon, workdir, "%dM" % (ARENA >> 20))
    try:
        pool = sglang_iface.HostPool(pages=4 * PAGES, **page_kw)
        extra = {"backend_name": "kvtier", "module_path": "kvtier.sglang",
                 "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "endpoint": ipc,
                 "timeout_ms": 10000}
        be = sglang_iface.create_backend("dynamic", sglang_iface.config(extra), pool)
        page_bytes = be.page_bytes
        assert page_bytes == args.page_kib * 1024, page_bytes
        statdir = os.path.join(workdir, "stat")
        os.makedirs(statdir)
        for i in range(PAGES):
            with open(os.path.join(statdir, "p%d" % i), "wb"):
                pass
        total = PAGES * page_bytes
        if not args.quick:                # set and set/generic store 2 * total a round
            warm = max(warm, -(-4 * ARENA // (2 * total)))
        src_idx = pool.alloc(PAGES * pool.page_size)
        dst_idx = pool.alloc(PAGES * pool.page_size)
        gsrc_idx = pool.alloc(PAGES * pool.page_size)
        gdst_idx = pool.alloc(PAGES * pool.page_size)
        pool.fill(src_idx, 1)
        pool.fill(gsrc_idx, 2)
        a = torch.empty(total, dtype=torch.uint8)
        b = torch.empty(total, dtype=torch.uint8)
        a.random_(0, 255)
        b.copy_(a)
        regions = 8                       # 256 MiB, the arena's size
        far = torch.zeros(regions * total // 2, dtype=pool.dtype)
        first, dfirst = int(src_idx[0]), int(dst_idx[0])
        span = PAGES * pool.page_size
        assert src_idx.tolist() == list(range(first, first + span))
        assert dst_idx.tolist() == list(range(dfirst, dfirst + span))
        pool_src = pool.kv_buffer[:, first:first + span].reshape(2, -1)     # views: K, V
        pool_dst = pool.kv_buffer[:, dfirst:dfirst + span].view(2, -1)
        elems = total // 2                # bf16 elements per round

        def memcpy_out(r):
            o = (r % regions) * elems
            far[o:o + elems].view(2, -1).copy_(pool_src)

        def memcpy_in(r):
            o = (r % regions) * elems
            pool_dst.copy_(far[o:o + elems].view(2, -1))

        v1 = sglang_iface.Controller(be, pool, v1=True)
        gen = sglang_iface.Controller(be, pool, v1=False)
        stat_paths = [os.path.join(statdir, "p%d" % i) for i in range(PAGES)]

        def stat64():
            return sum(os.path.exists(p) for p in stat_paths)

        cases = ("memcpy/bulk", "memcpy/out", "set", "memcpy/in", "get", "set/generic",
                 "get/generic", "stat/64", "exists", "exists/again", "ping")
        checks = ("stat/64", "exists", "exists/again", "ping")
        times = {k: [] for k in cases}
        for r in range(warm + rounds):
            keys = ["r%d-p%d" % (r, i) for i in range(PAGES)]
            gkeys = ["g%d-p%d" % (r, i) for i in range(PAGES)]
            t_copy, _ = timed(lambda: b.copy_(a))
            t_out, _ = timed(lambda: memcpy_out(r))
            t_set, ok = timed(lambda: v1.backup(keys, src_idx))
            t_in, _ = timed(lambda: memcpy_in(r + regions // 2))
            t_get, n = timed(lambda: v1.load(keys, dst_idx))
            t_gset, gok = timed(lambda: gen.backup(gkeys, gsrc_idx))
            t_gget, gn = timed(lambda: gen.load(gkeys, gdst_idx))
            t_stat, sn = timed(stat64)
            t_ex, en = timed(lambda: v1.hits(keys))
            t_ex2, en2 = timed(lambda: v1.hits(keys))
            t_ping, _ = timed(lambda: be._run(lambda conn, left: conn.req().ping(), None))
            if not (ok and gok and n == PAGES and gn == PAGES and sn == en == en2 == PAGES):
                raise SystemExit("round %d: set %s/%s, get %d/%d of %d pages (stats %s)"
                                 % (r, ok, gok, n, gn, PAGES, be.stats()))
            if r >= warm:
                for k, t in (("memcpy/bulk", t_copy), ("memcpy/out", t_out), ("set", t_set),
                             ("memcpy/in", t_in), ("get", t_get), ("set/generic", t_gset),
                             ("get/generic", t_gget), ("stat/64", t_stat), ("exists", t_ex),
                             ("exists/again", t_ex2), ("ping", t_ping)):
                    times[k].append(t)
        for a_, b_ in ((src_idx, dst_idx), (gsrc_idx, gdst_idx)):
            if not torch.equal(pool.kv_buffer[:, b_], pool.kv_buffer[:, a_]):
                raise SystemExit("the pages read back differ from the pages stored")
        bstats = be.stats()
        be.close()
    finally:
        stop_daemon(proc)
        shutil.rmtree(workdir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = {"set": "memcpy/out", "get": "memcpy/in", "set/generic": "memcpy/out",
            "get/generic": "memcpy/in"}
    moves = [k for k in cases if k not in checks]
    results = {"pages": PAGES, "page_bytes": page_bytes, "rounds": rounds,
               "median_s": med,
               "gbps": {k: total / med[k] / 1e9 for k in moves},
               "exists_ms": med["exists"] * 1e3,
               "exists_again_ms": med["exists/again"] * 1e3, "ping_ms": med["ping"] * 1e3,
               "exists_vs_stat": med["stat/64"] / med["exists"],
               "exists_local": bstats.get("exists_local", 0),
               "exists_calls": bstats.get("exists_calls", 0),
               "ratio_vs_memcpy": {k: med[b_] / med[k] for k, b_ in base.items()},
               "ratio_vs_bulk": {k: med["memcpy/bulk"] / med[k] for k in base}}
    print("SGLang backend: %d pages of %d KiB (%d MiB), median of %d rounds%s"
          % (PAGES, page_bytes // 1024, total >> 20, rounds, " (quick: not judged)"
             if args.quick else ""))
    print("%-12s %9s %7s %10s %8s" % ("case", "ms", "GB/s", "x memcpy", "x bulk"))
    for k in moves:
        print("%-12s %9.3f %7.2f %10s %8s" % (
            k, med[k] * 1e3, total / med[k] / 1e9,
            "%.2f" % results["ratio_vs_memcpy"][k] if k in base else "",
            "%.2f" % results["ratio_vs_bulk"][k] if k in base else ""))
    print("%-12s %9.3f" % ("stat/64", med["stat/64"] * 1e3))
    for k in ("exists", "exists/again"):
        print("%-12s %9.3f   (%.2fx the time of stat/64; target <= 0.100 ms: %s)" % (
            k, med[k] * 1e3, med[k] / med["stat/64"], "ok" if med[k] <= 1e-4 else "ABOVE"))
    print("%-12s %9.3f   (a PING's round trip: any request's floor)" % ("ping",
                                                                       med["ping"] * 1e3))
    print("exists calls answered from the residency map, without a request: %d of %d"
          % (bstats.get("exists_local", 0), bstats.get("exists_calls", 0)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
