"""kvtier.media.MediaCache: tensors and bytes by hash, written once by a front end and read by
many worker processes zero-copy (the readers send no request: the writer's pin and a MediaRef
name the bytes), checked against their header (a ref to the wrong range reads nothing), and
never pinned by a reader that died."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from kvtier.media import MediaCache, MediaRef  # noqa: E402
from kvtest import closing_factory, metric_value, wait_until  # noqa: E402

NS = "media/test"


@pytest.fixture
def caches():
    def build(d, **kw):
        kw.setdefault("namespace", NS)
        return MediaCache(d.ipc, **kw)
    yield from closing_factory(build, MediaCache.close)


def requests_of(d, type_):
    return metric_value(d.metrics()[1], "kvtier_requests_total", type=type_) or 0


def test_put_get_tensors_and_bytes(daemon, caches):
    c = caches(daemon)
    img = torch.arange(3 * 224 * 224, dtype=torch.float16).view(3, 224, 224)
    assert c.put("img-1", img) is True
    assert c.put("img-1", img) is False            # there already: nothing written
    assert c.contains("img-1") and not c.contains("img-2")
    with c.get("img-1") as t:
        assert t.dtype == torch.float16 and t.shape == (3, 224, 224)
        assert torch.equal(t, img)
    assert torch.equal(c.get_copy("img-1"), img)
    raw = os.urandom(100_000)
    assert c.put("blob", raw)
    got = c.get_copy("blob")
    assert got.dtype == torch.uint8 and bytes(got.numpy()) == raw
    with c.get("img-2") as t:
        assert t is None
    assert c.get_copy("img-2") is None
    # other namespaces do not see it
    other = caches(daemon, namespace="media/other")
    assert other.get_copy("img-1") is None
    assert c.remove("img-1") and c.get_copy("img-1") is None
    with pytest.raises(ValueError):
        c.put("scalar", torch.tensor(1.0))
    with pytest.raises(ValueError):
        MediaCache(daemon.ipc, namespace="")


READER = r"""
import hashlib, json, sys, kvtier.media as m
ipc, refs = sys.argv[1], json.loads(sys.argv[2])
c = m.MediaCache(ipc, namespace=%r, heartbeat_ms=0)
out = []
for r in refs:
    t = c.read(m.MediaRef(*r))
    out.append(None if t is None else hashlib.sha256(t.contiguous().view(-1).view(
        __import__("torch").uint8).numpy().tobytes()).hexdigest())
print(json.dumps(out))
c.close()
""" % NS


def test_one_writer_four_readers_without_requests(daemon, caches):
    w = caches(daemon)
    x = torch.randn(2304, 2048).to(torch.bfloat16)     # 9 MiB: an image's embedding
    ref = w.put_pinned("emb", x)
    assert isinstance(ref, MediaRef) and ref.length == 128 + x.numel() * 2
    want = __import__("hashlib").sha256(x.view(-1).view(torch.uint8).numpy().tobytes())
    acq = requests_of(daemon, "acquire")
    procs = [subprocess.Popen([sys.executable, "-c", READER, daemon.ipc, json.dumps([list(ref)])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-2000:]
        assert json.loads(out.strip().splitlines()[-1]) == [want.hexdigest()]
    assert requests_of(daemon, "acquire") == acq      # the readers asked nothing
    # a ref to the wrong range, or of another arena, reads nothing
    bad = MediaRef("emb", ref.arena, ref.offset + 4096, ref.length, ref.lease)
    assert w.read(bad) is None
    assert w.read(MediaRef("other", ref.arena, ref.offset, ref.length, ref.lease)) is None
    assert w.read(MediaRef("emb", "/dev/shm/elsewhere", ref.offset, ref.length, 0)) is None
    # the pin holds through a removal; unpinned, the bytes go
    w.remove("emb")
    assert torch.equal(w.read(ref), x)
    w.unpin(ref)
    assert w.get_copy("emb") is None


HOLDER = r"""
import sys, time, kvtier.media as m
c = m.MediaCache(sys.argv[1], namespace=%r, heartbeat_ms=100)
with c.get("held") as t:
    print("holding", t is not None, flush=True)
    time.sleep(60)
""" % NS


def test_a_reader_killed_while_holding_pins_nothing(daemon_factory, caches):
    d = daemon_factory("--lease-ms", "500", "--l2", "none")   # no write-behind pin either
    w = caches(d)
    assert w.put("held", torch.ones(1024, dtype=torch.float32))
    base = metric_value(d.metrics()[1], "kvtier_leases_active")
    p = subprocess.Popen([sys.executable, "-c", HOLDER, d.ipc], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "holding True"
        assert metric_value(d.metrics()[1], "kvtier_leases_active") == base + 1
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        t0 = time.monotonic()
        wait_until(lambda: metric_value(d.metrics()[1], "kvtier_leases_active") == base, 5,
                   what="the dead reader's pin to go")
        assert time.monotonic() - t0 < 3
    finally:
        if p.poll() is None:
            p.kill()
    assert w.remove("held")                        # and nothing keeps its bytes now
