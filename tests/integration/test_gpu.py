"""The GPU path (REGISTER_GPU, UNREGISTER_GPU, STORE_GPU, RETRIEVE_GPU) as far as it runs
without a GPU: request decoding and layout validation answer bad_request with the reason, a
valid request is refused `unavailable` with "no CUDA device: ..." (the CUDA runtime's own
words, or "built without the CUDA toolkit"), the daemon keeps serving, and start-up plus a
non-GPU workload never map a CUDA library. With a CUDA device present these tests skip the
refusal checks (make test-gpu covers that machine)."""

import os

import pytest

from kvtest import (assert_error, PING, REGISTER_GPU, RETRIEVE_GPU, STORE_GPU, UNREGISTER_GPU, key,
                    metric_value)

KVT_DAEMON_ARGS = ("--l2", "none")

NS = "gpu-model/kv-v1"
HANDLE = bytes(range(1, 65))  # 64 bytes, not all zeros


def layout(**over):
    body = {"device": 0, "layers": 2, "num_blocks": 64, "block_tokens": 16,
            "token_bytes": 1024, "dtype": "bfloat16", "handles": [HANDLE, HANDLE[::-1]]}
    body.update(over)
    return {k: v for k, v in body.items() if v is not None}


def copy_body(**over):
    body = {"ns": NS, "keys": [key(1), key(2)], "device": 0, "block_ids": [0, 1, 2, 3]}
    body.update(over)
    return {k: v for k, v in body.items() if v is not None}


def have_cuda_device():
    """True when this machine has an NVIDIA device node (then `unavailable` is not expected)."""
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")


def cuda_maps(pid):
    with open("/proc/%d/maps" % pid) as f:
        return sorted({line.split()[-1] for line in f
                       if "libcuda" in line or "libcudart" in line or "nvidia" in line})


BAD_REGISTER = [
    (layout(handles=None), "needs field 'handles'"),
    (layout(layers=None), "needs field 'layers'"),
    (layout(dtype=None), "needs field 'dtype'"),
    (layout(handles=[HANDLE]), "'handles' has 1 entries"),
    (layout(handles=[HANDLE, b"x" * 63]), "64-byte bin"),
    (layout(handles=[HANDLE, "s" * 64]), "64-byte bin"),
    (layout(layers=0, handles=[]), "'layers' is 0"),
    (layout(num_blocks=0), "'num_blocks' is 0"),
    (layout(block_tokens=0), "'block_tokens' is 0"),
    (layout(block_tokens=70000), "'block_tokens' is 70000"),
    (layout(token_bytes=0), "'token_bytes' is 0"),
    (layout(token_bytes=1023), "not a multiple"),
    (layout(dtype="float12"), "'dtype' float12 is not one of"),
    (layout(dtype=""), "dtype"),
    (layout(device=64), "'device' is 64"),
    (layout(device=-1), "expected uint"),
    (layout(handles=[HANDLE, bytes(64)]), "all zeros"),
    (layout(offsets=[0]), "'offsets' has 1 entries"),
    (layout(offsets=[0, 2**64 - 1]), "overflows"),
    (layout(num_blocks=2**32, token_bytes=2**24, block_tokens=2**16), "overflow"),
]


@pytest.mark.parametrize("body, mention", BAD_REGISTER,
                         ids=["reg-%d" % i for i in range(len(BAD_REGISTER))])
def test_register_gpu_layout_refused(shared_daemon, body, mention):
    d = shared_daemon
    s = d.dealer()
    d.hello(s, "inst-gpu-bad")
    assert_error(d.call(s, REGISTER_GPU, body), "bad_request", mention)
    d.ping(s)


BAD_COPY = [
    (copy_body(block_ids=None), "needs field 'block_ids'"),
    (copy_body(device=None), "needs field 'device'"),
    (copy_body(block_ids=[0, 1, 2]), "positive multiple"),
    (copy_body(block_ids=[]), "positive multiple"),
    (copy_body(block_ids=["x"]), "array of uint"),
    (copy_body(event=b"e" * 10), "64-byte bin"),
    (copy_body(keys=[b"short"]), "16-byte bin"),
]


@pytest.mark.parametrize("type_", [STORE_GPU, RETRIEVE_GPU])
@pytest.mark.parametrize("body, mention", BAD_COPY,
                         ids=["copy-%d" % i for i in range(len(BAD_COPY))])
def test_copy_requests_refused(shared_daemon, type_, body, mention):
    d = shared_daemon
    s = d.dealer()
    d.hello(s, "inst-gpu-bad-copy")
    assert_error(d.call(s, type_, body), "bad_request", mention)
    d.ping(s)


@pytest.mark.parametrize("type_, body", [(REGISTER_GPU, layout()),
                                         (UNREGISTER_GPU, {"device": 0}),
                                         (STORE_GPU, copy_body()),
                                         (RETRIEVE_GPU, copy_body())])
def test_gpu_requests_need_hello(shared_daemon, type_, body):
    d = shared_daemon
    s = d.dealer()
    assert_error(d.call(s, type_, body), "instance_dropped", "HELLO")


@pytest.mark.skipif(have_cuda_device(), reason="a CUDA device is present: make test-gpu")
def test_no_gpu_unavailable_and_no_cuda_at_startup(daemon):
    d = daemon
    pid = d.proc.pid
    assert cuda_maps(pid) == [], "start-up mapped CUDA: %r" % cuda_maps(pid)
    s = d.dealer()
    d.hello(s, "inst-gpu-none")
    # a non-GPU workload loads nothing either
    lease = d.reserve(s, NS, [key(9)], size=4096)["lease"]
    d.commit(s, lease)
    assert d.acquire(s, NS, [key(9)])["slots"]
    assert cuda_maps(pid) == [], "a non-GPU workload mapped CUDA: %r" % cuda_maps(pid)
    gpu = d.http_json("GET", "/status")["gpu"]
    assert gpu == {"runtime": "not loaded", "error": "", "arena_registered": False,
                   "registrations": []}, gpu
    # every GPU request: unavailable, saying why in CUDA's words, and the daemon lives on
    for type_, body in [(REGISTER_GPU, layout()), (STORE_GPU, copy_body()),
                        (RETRIEVE_GPU, copy_body(event=HANDLE))]:
        for _ in range(2):  # the second answer comes from the remembered failure
            b = d.call(s, type_, body)
            assert_error(b, "unavailable", "no CUDA device: ")
            assert len(b["error"]["message"]) > len("no CUDA device: ") + 3, b
    assert_error(d.call(s, UNREGISTER_GPU, {"device": 0}), "not_found", "no GPU registration")
    d.ping(s)
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_gpu_runtime_loaded") == 0
    assert metric_value(samples, "kvtier_gpu_registrations") == 0
    assert d.stats()["ok"] is True
    gpu = d.http_json("GET", "/status")["gpu"]
    assert gpu["runtime"] == "unavailable" and gpu["error"].startswith("no CUDA device: "), gpu
    assert gpu["registrations"] == [] and gpu["arena_registered"] is False, gpu
    # the CUDA runtime may be loaded now (it said there is no device); never the driver's
    # device nodes
    assert not [m for m in cuda_maps(pid) if "nvidia" in m and m.startswith("/dev/")]


@pytest.mark.skipif(have_cuda_device(), reason="a CUDA device is present: make test-gpu")
def test_no_gpu_register_then_bye_and_silence(daemon_factory):
    """Sessions that touched the GPU path end cleanly (BYE and lease expiry) without a GPU."""
    d = daemon_factory("--lease-ms", "300")
    s = d.dealer()
    d.hello(s, "inst-gpu-bye")
    assert_error(d.call(s, REGISTER_GPU, layout()), "unavailable", "no CUDA device")
    assert d.call(s, 2, {"instance": "inst-gpu-bye"})["ok"] is True
    s2 = d.dealer()
    d.hello(s2, "inst-gpu-silent")
    assert_error(d.call(s2, REGISTER_GPU, layout()), "unavailable")
    import time
    time.sleep(0.8)  # past lease_ms: the session (and any registration) is dropped
    assert_error(d.call(s2, STORE_GPU, copy_body()), "instance_dropped", "HELLO")
    d.call(d.dealer(), PING, {})


@pytest.mark.skipif(have_cuda_device(), reason="a CUDA device is present: make test-gpu")
def test_python_client_gpu_calls_without_gpu(daemon):
    """The Python client's GPU calls reach the daemon and raise the typed errors."""
    import kvtier
    with kvtier.Client(daemon.endpoint(), instance="py-gpu") as c:
        with pytest.raises(kvtier.Unavailable, match="no CUDA device"):
            c.register_gpu(0, [HANDLE, HANDLE], num_blocks=8, block_tokens=16,
                           token_bytes=256, dtype="float16", offsets=[0, 4096])
        with pytest.raises(kvtier.BadRequest, match="dtype"):
            c.register_gpu(0, [HANDLE], num_blocks=8, block_tokens=16, token_bytes=256,
                           dtype="float13")
        with pytest.raises(kvtier.Unavailable):
            c.store_gpu(NS, [key(1)], [0, 1], event=HANDLE)
        with pytest.raises(kvtier.Unavailable):
            c.retrieve_gpu(NS, [key(1)], [0, 1])
        with pytest.raises(kvtier.NotFound):
            c.unregister_gpu(0)
        c.ping()


# ----------------------------------------------------------------------------------------
# The whole GPU path against the stand-in CUDA runtime (tests/gpu/mock_cudart.c): device
# memory is a file under /dev/shm, an IPC handle is "KVTMOCK\0" + its path, copies are memcpy.
# The daemon finds the mock by soname through LD_LIBRARY_PATH, exactly as it finds libcudart.

MOCK = os.environ.get("KVT_MOCK_CUDART")
needs_mock = pytest.mark.skipif(not MOCK, reason="no mock libcudart (KVT_MOCK_CUDART; CUDA=0)")

import collections  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from kvtest import BYE, GET, metric_value, wait_until  # noqa: E402


class MockEngine:
    """An engine's paged KV cache in files: `layers` buffers of num_blocks blocks; with
    `shared`, the last two layers live in one allocation (one handle, two offsets)."""

    def __init__(self, layers=3, num_blocks=32, block_tokens=4, token_bytes=256, shared=True,
                 seed=1):
        self.dir = tempfile.mkdtemp(prefix="kvm", dir="/dev/shm")
        self.layers, self.num_blocks = layers, num_blocks
        self.block_tokens, self.token_bytes = block_tokens, token_bytes
        self.block_bytes = block_tokens * token_bytes
        self.layer_bytes = num_blocks * self.block_bytes
        rnd = random.Random(seed)
        self.where = []  # per layer: (path, offset)
        for l in range(layers):
            if shared and layers >= 2 and l == layers - 1:
                path, off = self.where[-1][0], self.layer_bytes + 4096
            else:
                path, off = os.path.join(self.dir, "l%d" % l), 0
                size = self.layer_bytes * (2 if shared and l == layers - 2 else 1) + 4096
                with open(path, "wb") as f:
                    f.write(bytes(size))
            self.where.append((path, off))
            self.write_layer(l, rnd.randbytes(self.layer_bytes))
        self.orig = [self.read_layer(l) for l in range(layers)]

    def handle(self, l):
        path = self.where[l][0].encode()
        assert len(path) <= 56
        return b"KVTMOCK\0" + path.ljust(56, b"\0")

    def read_layer(self, l):
        path, off = self.where[l]
        with open(path, "rb") as f:
            f.seek(off)
            return f.read(self.layer_bytes)

    def write_layer(self, l, data):
        path, off = self.where[l]
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(data)

    def block(self, data, b):
        return data[b * self.block_bytes:(b + 1) * self.block_bytes]

    def clear(self):
        for l in range(self.layers):
            self.write_layer(l, bytes(self.layer_bytes))

    def register_body(self, device=0, **over):
        body = {"device": device, "layers": self.layers, "num_blocks": self.num_blocks,
                "block_tokens": self.block_tokens, "token_bytes": self.token_bytes,
                "dtype": "float16", "handles": [self.handle(l) for l in range(self.layers)],
                "offsets": [self.where[l][1] for l in range(self.layers)]}
        body.update(over)
        return body

    def object_bytes(self, ids):
        """What STORE_GPU must write for a chunk in blocks `ids`: layer-major."""
        return b"".join(self.block(self.orig[l], b) for l in range(self.layers) for b in ids)

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def engine():
    e = MockEngine()
    yield e
    e.close()


def mock_daemon(daemon_factory, tmp_path, *args, **env):
    log = str(tmp_path / "cuda.log")
    extra = {"LD_LIBRARY_PATH": os.path.dirname(MOCK), "KVT_MOCK_CUDA_LOG": log}
    extra.update({k: str(v) for k, v in env.items()})
    d = daemon_factory(*args, env=extra)
    return d, log


def mock_log(log):
    try:
        with open(log) as f:
            return [line.split() for line in f]
    except FileNotFoundError:
        return []


def count(log, word):
    return sum(1 for w in mock_log(log) if w and w[0] == word)


@needs_mock
def test_mock_gpu_store_clear_retrieve(daemon_factory, tmp_path, engine):
    d, log = mock_daemon(daemon_factory, tmp_path)
    s = d.dealer()
    d.hello(s, "inst-mock-engine")
    b = d.ok(s, REGISTER_GPU, engine.register_body())
    assert (b["device"], b["layers"], b["block_bytes"]) == (0, 3, engine.block_bytes)
    assert count(log, "hostregister") == 1
    assert count(log, "open") == 2, mock_log(log)  # layers 1 and 2 share one handle
    assert_error(d.call(s, REGISTER_GPU, engine.register_body()), "bad_request",
                 "already registered")
    gpu = d.http_json("GET", "/status")["gpu"]
    owner = [c["owner"] for c in d.http_json("GET", "/status")["clients"]
             if c.get("instance") == "inst-mock-engine"]
    assert gpu["runtime"] == "loaded" and gpu["arena_registered"] is True, gpu
    assert len(gpu["registrations"]) == 1, gpu
    r = gpu["registrations"][0]
    assert [r["owner"]] == owner and r["ready"] is True, (r, owner)
    assert (r["device"], r["layers"], r["block_bytes"]) == (0, 3, engine.block_bytes), r
    per = 4
    ids = list(range(engine.num_blocks))
    random.Random(5).shuffle(ids)
    ids = ids[:3 * per]
    ids[0:3] = [20, 21, 22]  # one run of consecutive blocks among shuffled ones
    keys = [key(i, b"gpu") for i in range(3)]
    b = d.ok(s, STORE_GPU, {"ns": NS, "keys": keys, "device": 0, "block_ids": ids,
                            "event": HANDLE})
    assert b["stored"] == 3
    assert count(log, "event") >= 1 and count(log, "batch") >= 1
    # the L1 objects are layer-major copies of the chunks' blocks, readable by any client
    _, _, body, frames = d.request(s, d.next_uid(), GET, {"ns": NS, "keys": keys})
    assert body["found"] == 3
    for i in range(3):
        want = engine.object_bytes(ids[i * per:(i + 1) * per])
        assert len(frames[i]) == 3 * per * engine.block_bytes
        assert frames[i] == want, "object %d differs from its blocks" % i
    assert d.ok(s, STORE_GPU, {"ns": NS, "keys": keys, "device": 0,
                               "block_ids": ids})["stored"] == 0
    chunk = engine.layers * per * engine.block_bytes
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_gpu_copied_bytes_total", direction="to_l1") == 3 * chunk
    assert metric_value(samples, "kvtier_gpu_registrations") == 1
    assert metric_value(samples, "kvtier_gpu_runtime_loaded") == 1
    assert metric_value(samples, "kvtier_gpu_arena_registered") == 1
    # clear the "GPU", retrieve into other blocks, compare every block
    engine.clear()
    others = [b for b in range(engine.num_blocks) if b not in ids][:3 * per]
    b = d.ok(s, RETRIEVE_GPU, {"ns": NS, "keys": keys, "device": 0, "block_ids": others,
                               "event": HANDLE})
    assert b["found"] == 3
    for l in range(engine.layers):
        got = engine.read_layer(l)
        for j, blk in enumerate(others):
            assert engine.block(got, blk) == engine.block(engine.orig[l], ids[j]), (l, j)
        untouched = set(range(engine.num_blocks)) - set(others)
        assert all(engine.block(got, blk) == bytes(engine.block_bytes) for blk in untouched)
    # a prefix: the second key is unknown
    b = d.ok(s, RETRIEVE_GPU, {"ns": NS, "keys": [keys[0], key(99)], "device": 0,
                               "block_ids": others[:2 * per]})
    assert b["found"] == 1
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_gpu_copied_bytes_total", direction="to_gpu") == 4 * chunk
    assert metric_value(samples, "kvtier_gpu_copy_errors_total") == 0
    # block ids out of range, a wrong device
    assert_error(d.call(s, STORE_GPU, copy_body(block_ids=[0, engine.num_blocks])),
                 "bad_request", "fewer blocks")
    assert_error(d.call(s, STORE_GPU, copy_body(device=1)), "not_found", "REGISTER_GPU first")
    # UNREGISTER closes both handles at once; BYE closes a new registration's
    d.ok(s, UNREGISTER_GPU, {"device": 0})
    assert count(log, "close") == 2
    assert_error(d.call(s, UNREGISTER_GPU, {"device": 0}), "not_found")
    assert_error(d.call(s, RETRIEVE_GPU, {"ns": NS, "keys": keys, "device": 0,
                                          "block_ids": ids}), "not_found")
    d.ok(s, REGISTER_GPU, engine.register_body())
    assert count(log, "hostregister") == 1  # the arena is registered once
    d.ok(s, BYE, {"instance": "inst-mock-engine"})
    wait_until(lambda: count(log, "close") == 4, 5, what="handles closed after BYE")
    d.ping(s)
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_gpu_registrations") == 0


@needs_mock
def test_mock_gpu_silent_instance_handles_closed(daemon_factory, tmp_path, engine):
    d, log = mock_daemon(daemon_factory, tmp_path, "--lease-ms", "300")
    s = d.dealer()
    d.hello(s, "inst-mock-silent")
    d.ok(s, REGISTER_GPU, engine.register_body())
    assert count(log, "open") == 2
    wait_until(lambda: count(log, "close") == 2, 5, what="handles closed after silence")
    wait_until(lambda: any("closing the handles" in l for l in d.log_lines()), 5,
               what="the daemon's log line")
    assert_error(d.call(s, STORE_GPU, copy_body()), "instance_dropped", "HELLO")


@needs_mock
def test_mock_gpu_plain_copies_when_batch_refused(daemon_factory, tmp_path, engine):
    d, log = mock_daemon(daemon_factory, tmp_path, KVT_MOCK_CUDA_NO_BATCH=1)
    s = d.dealer()
    d.hello(s, "inst-mock-nobatch")
    d.ok(s, REGISTER_GPU, engine.register_body())
    ids = [3, 4, 5, 9, 1, 2, 30, 31]
    keys = [key(1, b"nb"), key(2, b"nb")]
    assert d.ok(s, STORE_GPU, {"ns": NS, "keys": keys, "device": 0,
                               "block_ids": ids})["stored"] == 2
    # runs: [3,4,5] [9] | [1,2] [30,31] -> 4 copies per layer
    assert count(log, "memcpy") == 4 * engine.layers, mock_log(log)
    assert any("cudaMemcpyBatchAsync refused" in l for l in d.log_lines())
    _, _, body, frames = d.request(s, d.next_uid(), GET, {"ns": NS, "keys": keys})
    assert frames == [engine.object_bytes(ids[:4]), engine.object_bytes(ids[4:])]


@needs_mock
def test_mock_gpu_host_register_failure_is_an_error(daemon_factory, tmp_path, engine):
    d, log = mock_daemon(daemon_factory, tmp_path, KVT_MOCK_CUDA_FAIL_HOST_REGISTER=1)
    s = d.dealer()
    d.hello(s, "inst-mock-pin")
    assert_error(d.call(s, REGISTER_GPU, engine.register_body()), "unavailable",
                 "cudaHostRegister of the L1 arena", "no fallback to pageable copies")
    assert count(log, "open") == 0
    assert_error(d.call(s, STORE_GPU, copy_body()), "not_found")
    d.ping(s)


@needs_mock
def test_mock_gpu_devices_and_bad_handles(daemon_factory, tmp_path, engine):
    d, log = mock_daemon(daemon_factory, tmp_path)
    s = d.dealer()
    d.hello(s, "inst-mock-dev")
    assert_error(d.call(s, REGISTER_GPU, engine.register_body(device=1)), "bad_request",
                 "1 CUDA device")
    bad = engine.register_body(handles=[b"NOTMOCK\0" + bytes(56)] * engine.layers)
    assert_error(d.call(s, REGISTER_GPU, bad), "bad_request", "cudaIpcOpenMemHandle of layer 0")
    # the failed registration left nothing behind: a good one goes through
    d.ok(s, REGISTER_GPU, engine.register_body())
    d2, _ = mock_daemon(daemon_factory, tmp_path, KVT_MOCK_CUDA_DEVICES=0)
    s2 = d2.dealer()
    d2.hello(s2, "inst-mock-nodev")
    assert_error(d2.call(s2, REGISTER_GPU, engine.register_body()), "unavailable",
                 "no CUDA device: no CUDA-capable device is detected (mock)")


@needs_mock
def test_mock_gpu_bye_while_copies_run(daemon_factory, tmp_path, engine):
    """Copies in flight on several workers when the instance says BYE: every copy finishes or
    is refused cleanly, and the handles are closed exactly once, after the last copy."""
    d, log = mock_daemon(daemon_factory, tmp_path, "--workers", "4")
    socks = [d.dealer() for _ in range(4)]
    for s in socks:
        d.hello(s, "inst-mock-race")
    d.ok(socks[0], REGISTER_GPU, engine.register_body())
    per = 2
    sent = []
    for r in range(40):
        s = socks[r % 4]
        keys = [key(r * 8 + i, b"race") for i in range(4)]
        body = {"ns": NS, "keys": keys, "device": 0,
                "block_ids": [(r * 8 + j) % engine.num_blocks for j in range(4 * per)]}
        t = STORE_GPU if r % 2 == 0 else RETRIEVE_GPU
        sent.append((s, d.send(s, d.next_uid(), t, body)))
    bye = d.dealer()
    d.hello(bye, "inst-mock-race")
    d.ok(bye, BYE, {"instance": "inst-mock-race"})
    codes = collections.Counter()
    for s in socks:  # replies of worker requests may come out of order: collect by socket
        for _ in range(sum(1 for x, _ in sent if x is s)):
            b = d.recv(s).body
            codes["ok" if b["ok"] else b["error"]["code"]] += 1
    assert sum(codes.values()) == len(sent)
    # a copy that reaches the daemon after the BYE (it came on another connection, so nothing
    # orders the two) finds its instance gone: instance_dropped, as for any request after BYE
    assert set(codes) <= {"ok", "not_found", "bad_request", "instance_dropped"}, codes
    wait_until(lambda: count(log, "close") == count(log, "open") == 2, 5,
               what="both handles closed once")
    time.sleep(0.2)
    assert count(log, "close") == 2
    d.ping(bye)


@needs_mock
def test_mock_gpu_odd_block_sizes(daemon_factory, tmp_path):
    """Blocks of 18 bytes (3 tokens x 6 bytes): objects and copies are not page multiples."""
    e = MockEngine(layers=2, num_blocks=10, block_tokens=3, token_bytes=6, shared=False, seed=9)
    try:
        d, log = mock_daemon(daemon_factory, tmp_path)
        s = d.dealer()
        d.hello(s, "inst-mock-odd")
        body = e.register_body()
        del body["offsets"]  # optional: every buffer starts its allocation
        d.ok(s, REGISTER_GPU, body)
        keys = [key(1, b"odd"), key(2, b"odd")]
        ids = [7, 2, 3, 9, 8, 0]
        assert d.ok(s, STORE_GPU, {"ns": NS, "keys": keys, "device": 0,
                                   "block_ids": ids})["stored"] == 2
        _, _, body, frames = d.request(s, d.next_uid(), GET, {"ns": NS, "keys": keys})
        assert [len(f) for f in frames] == [2 * 3 * 18] * 2
        assert frames == [e.object_bytes(ids[:3]), e.object_bytes(ids[3:])]
        e.clear()
        assert d.ok(s, RETRIEVE_GPU, {"ns": NS, "keys": keys, "device": 0,
                                      "block_ids": ids})["found"] == 2
        for l in range(2):
            want = b"".join(e.block(e.orig[l], b) if b in ids else bytes(18) for b in range(10))
            assert e.read_layer(l) == want, "layer %d" % l
    finally:
        e.close()


# ----------------------------------------------------------------------------------------
# Staged copies (the kernel of storage/kvt_gpu_kernels.cu, run on the CPU by the mock with
# KVT_MOCK_CUDA_KERNELS=1): a slice of whole layers of a chunk is gathered into a staging buffer
# laid out as the L1 object, then moved by one copy; RETRIEVE copies, then scatters.

def staged_round_trip(d, e, inst, ids, others, tag=b"st"):
    """STORE_GPU from `ids`, check the objects, clear, RETRIEVE_GPU into `others`, check every
    block of every layer. Returns the keys."""
    s = d.dealer()
    d.hello(s, inst)
    d.ok(s, REGISTER_GPU, e.register_body())
    per = len(ids) // 3
    keys = [key(i, tag) for i in range(3)]
    assert d.ok(s, STORE_GPU, {"ns": NS, "keys": keys, "device": 0, "block_ids": ids,
                               "event": HANDLE})["stored"] == 3
    _, _, body, frames = d.request(s, d.next_uid(), GET, {"ns": NS, "keys": keys})
    assert frames == [e.object_bytes(ids[i * per:(i + 1) * per]) for i in range(3)]
    e.clear()
    assert d.ok(s, RETRIEVE_GPU, {"ns": NS, "keys": keys, "device": 0, "block_ids": others,
                                  "event": HANDLE})["found"] == 3
    for l in range(e.layers):
        got = e.read_layer(l)
        for j, blk in enumerate(others):
            assert e.block(got, blk) == e.block(e.orig[l], ids[j]), (l, j)
        assert all(e.block(got, b) == bytes(e.block_bytes)
                   for b in set(range(e.num_blocks)) - set(others)), l
    return keys


def kernel_lines(log):
    return [(int(w[1]), int(w[2]), w[3]) for w in mock_log(log) if w[0] == "kernel"]


def shuffled(n, seed, count):
    ids = list(range(n))
    random.Random(seed).shuffle(ids)
    return ids[:count]


@needs_mock
def test_mock_gpu_staged_copies(daemon_factory, tmp_path, engine):
    """Shuffled blocks of 1 KiB: auto takes the staged copies. One gather and one copy per
    chunk into L1, one copy and one scatter per chunk back; every byte where it belongs."""
    d, log = mock_daemon(daemon_factory, tmp_path, KVT_MOCK_CUDA_KERNELS=1)
    per = 4
    ids = shuffled(engine.num_blocks, 11, 3 * per)
    others = [b for b in range(engine.num_blocks) if b not in ids][:3 * per][::-1]
    staged_round_trip(d, engine, "inst-staged", ids, others)
    chunk = engine.layers * per * engine.block_bytes
    assert kernel_lines(log) == [(3 * per, 0, "gather")] * 3 + [(3 * per, 0, "scatter")] * 3
    # per request: the layer pointers and block ids up, then one copy per chunk
    assert count(log, "memcpy") == 2 * (1 + 3) and count(log, "batch") == 0, mock_log(log)
    assert [int(w[1]) for w in mock_log(log) if w[0] == "malloc"][0] == 32 << 20
    assert any("staged and direct copies" in l for l in d.log_lines())
    _, samples = d.metrics()
    assert metric_value(samples, "kvtier_gpu_copied_bytes_total", direction="to_l1") == 3 * chunk
    assert metric_value(samples, "kvtier_gpu_copied_bytes_total", direction="to_gpu") == 3 * chunk


@needs_mock
def test_mock_gpu_staged_slices(daemon_factory, tmp_path):
    """A staging buffer of two layers of a chunk: a 5-layer chunk goes in slices of 2, 2, 1
    layers (kernel from layers 0, 2, 4), with the shared allocation at an offset."""
    e = MockEngine(layers=5, num_blocks=24, block_tokens=2, token_bytes=64, seed=4)
    try:
        per = 3
        d, log = mock_daemon(daemon_factory, tmp_path, KVT_MOCK_CUDA_KERNELS=1,
                             KVT_GPU_STAGING_BYTES=2 * per * e.block_bytes + 7)
        ids = shuffled(e.num_blocks, 3, 3 * per)
        others = [b for b in range(e.num_blocks) if b not in ids][:3 * per]
        staged_round_trip(d, e, "inst-slices", ids, others)
        slices = [(2 * per, 0), (2 * per, 2), (per, 4)]
        assert kernel_lines(log) == ([g + ("gather",) for g in slices] * 3 +
                                     [g + ("scatter",) for g in slices] * 3)
    finally:
        e.close()


@needs_mock
@pytest.mark.parametrize("env, why", [
    ({"KVT_GPU_COPY": "direct"}, "forced"),
    ({"KVT_GPU_STAGING_BYTES": "1000"}, "one layer of a chunk does not fit"),
    ({"KVT_MOCK_CUDA_NO_MALLOC": "1"}, "no device memory"),
    ({}, "contiguous runs: auto"),
], ids=["forced", "stage-too-small", "no-device-memory", "auto-long-runs"])
def test_mock_gpu_staged_falls_back_to_direct(daemon_factory, tmp_path, env, why):
    """Where the staged copies cannot or should not run, the copies are direct and right."""
    e = MockEngine(layers=3, num_blocks=128, block_tokens=64, token_bytes=1024, seed=6)
    try:
        d, log = mock_daemon(daemon_factory, tmp_path, KVT_MOCK_CUDA_KERNELS=1, **env)
        per = 16  # auto: 16 x 64 KiB = 1 MiB per contiguous copy, under the 2 MiB rule
        if why.startswith("contiguous"):
            # 2 MiB runs: 32 blocks x 64 KiB, one run per layer and chunk
            per = 32
            e.close()
            e = MockEngine(layers=2, num_blocks=96, block_tokens=64, token_bytes=1024, seed=6)
            ids, others = list(range(3 * per)), list(range(3 * per))
        else:
            ids = shuffled(e.num_blocks, 8, 3 * per)
            others = [b for b in range(e.num_blocks) if b not in ids][:3 * per]
        staged_round_trip(d, e, "inst-direct", ids, others)
        assert kernel_lines(log) == [], why
        assert count(log, "batch") == 2, mock_log(log)  # one batch per request
        warned = any("no memory for the 33554432-byte staging buffer" in l
                     for l in d.log_lines())
        assert warned == (why == "no device memory")
    finally:
        e.close()


@needs_mock
def test_mock_gpu_staged_odd_block_sizes(daemon_factory, tmp_path):
    """Blocks of 18 bytes, forced staged: objects and slices are not 16-byte multiples."""
    e = MockEngine(layers=2, num_blocks=10, block_tokens=3, token_bytes=6, shared=False, seed=9)
    try:
        d, log = mock_daemon(daemon_factory, tmp_path, KVT_MOCK_CUDA_KERNELS=1,
                             KVT_GPU_COPY="staged")
        staged_round_trip(d, e, "inst-odd-staged", [7, 2, 9, 8, 0, 5], [1, 3, 4, 6, 2, 9])
        assert len(kernel_lines(log)) == 6
    finally:
        e.close()


@needs_mock
@pytest.mark.parametrize("env, flags, warns", [
    ({"KVT_GPU_SYNC": "blocking"}, ["4"], []),  # cudaDeviceScheduleBlockingSync
    ({"KVT_GPU_SYNC": "spin"}, [], []),
    ({"KVT_GPU_SYNC": "sleepy", "KVT_GPU_COPY": "fast"}, [],
     ["KVT_GPU_SYNC=sleepy is not poll, spin or blocking", "KVT_GPU_COPY=fast is not auto"]),
], ids=["blocking", "spin", "unknown-values"])
def test_mock_gpu_wait_settings(daemon_factory, tmp_path, engine, env, flags, warns):
    """KVT_GPU_SYNC=blocking sets the device's blocking-sync flag before its first CUDA work;
    unknown values are logged and the defaults (poll, auto) copy as before."""
    d, log = mock_daemon(daemon_factory, tmp_path, KVT_MOCK_CUDA_KERNELS=1, **env)
    ids = shuffled(engine.num_blocks, 21, 12)
    others = [b for b in range(engine.num_blocks) if b not in ids][:12]
    staged_round_trip(d, engine, "inst-wait", ids, others)
    assert [w[1] for w in mock_log(log) if w[0] == "deviceflags"] == flags
    assert len(kernel_lines(log)) == 6  # staged: auto, whatever the wait
    for w in warns:
        assert any(w in l for l in d.log_lines()), w
