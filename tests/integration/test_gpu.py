"""The GPU path (REGISTER_GPU, UNREGISTER_GPU, STORE_GPU, RETRIEVE_GPU) as far as it runs
without a GPU: request decoding and layout validation answer bad_request with the reason, a
valid request is refused `unavailable` with "no CUDA device: ..." (the CUDA runtime's own
words, or "built without the CUDA toolkit"), the daemon keeps serving, and start-up plus a
non-GPU workload never map a CUDA library. With a CUDA device present these tests skip the
refusal checks (make test-gpu covers that machine)."""

import os

import pytest

from kvtest import (PING, REGISTER_GPU, RETRIEVE_GPU, STORE_GPU, UNREGISTER_GPU, key)

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


def assert_error(body, code, *mentions):
    assert body["ok"] is False, "expected %s, got %r" % (code, body)
    assert body["error"]["code"] == code, body
    for m in mentions:
        assert m in body["error"]["message"], (m, body["error"]["message"])


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
    assert_error(d.call(s, type_, body), "bad_request", "HELLO")


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
    # every GPU request: unavailable, saying why in CUDA's words, and the daemon lives on
    for type_, body in [(REGISTER_GPU, layout()), (STORE_GPU, copy_body()),
                        (RETRIEVE_GPU, copy_body(event=HANDLE))]:
        for _ in range(2):  # the second answer comes from the remembered failure
            b = d.call(s, type_, body)
            assert_error(b, "unavailable", "no CUDA device: ")
            assert len(b["error"]["message"]) > len("no CUDA device: ") + 3, b
    assert_error(d.call(s, UNREGISTER_GPU, {"device": 0}), "not_found", "no GPU registration")
    d.ping(s)
    assert d.stats()["ok"] is True
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
    assert_error(d.call(s2, STORE_GPU, copy_body()), "bad_request", "HELLO")
    d.call(d.dealer(), PING, {})


@pytest.mark.skipif(have_cuda_device(), reason="a CUDA device is present: make test-gpu")
def test_python_client_gpu_calls_without_gpu(daemon):
    """The Python client's GPU calls reach the daemon and raise the typed errors."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "client", "python"))
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
