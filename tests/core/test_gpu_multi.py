"""GPU: several devices, and the expert-parallel MoE layer (runtime/torch/ep.py, examples/ep_moe.py).

With two GPUs or more: every public op on cuda:1 tensors (and CuPy arrays) while cuda:0 is current
gives the bits it gives on cuda:0 (full path and replay) and leaves cuda:0 current; arguments on two
devices raise DeviceMismatchError naming them; two threads launching on two devices at once get the
right results; a CUDA graph captured on device 1 replays there equal to eager; examples/ep_moe.py
under torchrun on two GPUs (checks and a short bench). With one GPU: launches follow the current
stream under torch.cuda.device(0) (a capture on a side stream holds every launch), a thread with no
current context launches correctly, and the layer over NCCL with world size 1 equals the
one-process layer bit for bit. CPU tests of the same logic: tests/core/test_multi_device.py,
tests/moe/test_ep.py.
"""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch without CUDA")]

import runtime as sf  # noqa: E402
import runtime.torch as sft  # noqa: E402
from runtime import device as sf_device  # noqa: E402
from runtime import reference, replay  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs; {GPUS} visible")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def inputs(dev):
    """The same data on ``dev`` every time (made on the CPU)."""
    g = torch.Generator().manual_seed(7)

    def r(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)
    E, M, N, K = 4, 300, 136, 264
    ids = torch.randint(-1, E + 1, (M,), generator=g, dtype=torch.int32).to(dev)
    counts = torch.bincount(torch.randint(0, E, (M,), generator=g), minlength=E)
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32).to(dev)
    return {"x": r(64, 512, scale=3), "xh": r(64, 512, dtype=torch.bfloat16, scale=3), "dy": r(64, 512),
            "s": (torch.rand(64, generator=g) * 0.05 + 0.01).to(dev),
            "sg": (torch.rand(64, 4, generator=g) * 0.05 + 0.01).to(dev),
            "sc": (torch.rand(512, generator=g) * 0.05 + 0.01).to(dev),
            "z": torch.randint(-5, 5, (64,), generator=g, dtype=torch.int32).to(dev),
            "zg": torch.randint(100, 156, (64, 4), generator=g, dtype=torch.int32).to(dev),
            "q": torch.randint(-128, 128, (64, 512), generator=g, dtype=torch.int8).to(dev),
            "gx": r(M, K, dtype=torch.bfloat16), "gw": r(E, N, K, dtype=torch.bfloat16, scale=K ** -0.5),
            "gdy": r(M, N, dtype=torch.bfloat16), "fx": r(M, 40), "fw": r(E, 24, 40), "fdy": r(M, 24),
            "ids": ids, "offs": offs}


# every public op (functional API and the torch ops), on one device's tensors
OPS = {
    "quantize token": lambda d: sf.quantize(d["x"], d["s"], scope="token"),
    "quantize group zero point uint8": lambda d: sf.quantize(d["x"], d["sg"], d["zg"], scope="group", group_size=128,
                                                             out_dtype="uint8", qmin=0, qmax=255),
    "quantize fp8 channel": lambda d: sf.quantize(d["xh"], d["sc"], scope="channel", axis=1, out_dtype="fp8_e4m3"),
    "quantize int4 group": lambda d: sf.quantize(d["x"], d["sg"], scope="group", group_size=128, out_dtype="int4"),
    "dequantize token": lambda d: sf.dequantize(d["q"], d["s"], d["z"], scope="token", out_dtype="bfloat16"),
    "dynamic_quantize token": lambda d: sf.dynamic_quantize(d["x"], scope="token"),
    "dynamic_quantize tensor": lambda d: sf.dynamic_quantize(d["x"], scope="tensor"),     # the cooperative kernel
    "dynamic_quantize group asymmetric": lambda d: sf.dynamic_quantize(d["xh"], scope="group", group_size=128,
                                                                       mode="asymmetric", out_dtype="uint8"),
    "quantize_backward": lambda d: sf.quantize_backward(d["dy"], d["x"], d["s"], scope="token"),
    "dequantize_backward": lambda d: sf.dequantize_backward(d["dy"], d["sc"], scope="channel", axis=1),
    "fake_quantize mask": lambda d: sf.fake_quantize(d["x"], d["s"], d["z"], scope="token", return_mask=True),
    "fake_quantize_backward": lambda d: sf.fake_quantize_backward(d["dy"], d["x"], 0.05, 3, scope="tensor"),
    "fake_quantize_learnable_backward": lambda d: sf.fake_quantize_learnable_backward(d["dy"], d["x"], d["s"], d["z"],
                                                                                      scope="token"),
    "grouped_matmul row_experts mma": lambda d: sf.grouped_matmul(d["gx"], d["gw"], row_experts=d["ids"]),
    "grouped_matmul offsets": lambda d: sf.grouped_matmul(d["gx"], d["gw"], offsets=d["offs"]),
    "grouped_matmul f32 simt": lambda d: sf.grouped_matmul(d["fx"], d["fw"], row_experts=d["ids"]),
    "grouped_matmul_backward": lambda d: sf.grouped_matmul_backward(d["gx"], d["gw"], d["gdy"], offsets=d["offs"]),
    "grouped_matmul_backward f32": lambda d: sf.grouped_matmul_backward(d["fx"], d["fw"], d["fdy"],
                                                                        row_experts=d["ids"]),
    "torch op grouped_matmul autograd": lambda d: _gmm_autograd(d),
    "torch op fake_quantize_learnable autograd": lambda d: _lfq_autograd(d),
}


def _gmm_autograd(d):
    x, w = d["gx"].clone().requires_grad_(True), d["gw"].clone().requires_grad_(True)
    y = sft.grouped_matmul(x, w, row_experts=d["ids"])
    y.backward(d["gdy"])
    return y.detach(), x.grad, w.grad


def _lfq_autograd(d):
    x, s = d["x"].clone().requires_grad_(True), d["s"].clone().requires_grad_(True)
    y = sft.fake_quantize_learnable(x, s, scope="token")
    y.backward(d["dy"])
    return y.detach(), x.grad, s.grad


def _flat(r):
    return [t for t in (r if isinstance(r, tuple) else (r,)) if t is not None]


def _same_bits(a, b) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))


@two_gpus
@pytest.mark.parametrize("name", list(OPS))
def test_every_op_on_cuda1_while_cuda0_is_current(name):
    """Full path and two replays on cuda:1 under ``torch.cuda.device(0)``: the results live on cuda:1
    and have the bits of the same call on cuda:0; cuda:0 (device and driver context) stays current."""
    call = OPS[name]
    with torch.cuda.device(0):
        want = _flat(call(inputs("cuda:0")))
        d1 = inputs("cuda:1")
        ctx = sf_device.driver().context_current()
        for _ in range(3):                          # the full path, then replays
            got = _flat(call(d1))
            assert torch.cuda.current_device() == 0 and sf_device.driver().context_current() == ctx
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert g.device == torch.device("cuda", 1)
                assert _same_bits(g, w), name
    sf.check()


@two_gpus
def test_results_on_cuda1_equal_the_references():
    """The cuda:1 results against the NumPy reference (quantize) and float64 (grouped matmul)."""
    with torch.cuda.device(0):
        d = inputs("cuda:1")
        q = sf.quantize(d["x"], d["s"], scope="token")
        want = reference.quantize(d["x"].cpu().numpy(), d["s"].cpu().numpy(), scope="token")
        assert np.array_equal(q.cpu().numpy(), want)
        y = sf.grouped_matmul(d["fx"], d["fw"], row_experts=d["ids"])
        ids = d["ids"].long().cpu()
        ref = torch.zeros(y.shape, dtype=torch.float64)
        for e in range(d["fw"].shape[0]):
            rows = ids == e
            ref[rows] = d["fx"].cpu().double()[rows] @ d["fw"][e].cpu().double().t()
        assert float((y.cpu().double() - ref).norm() / ref.norm()) <= 1e-5


@two_gpus
def test_cupy_arrays_on_device1_while_device0_is_current():
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 512)) * 3).astype(np.float32)
    s = (rng.random(64) * 0.05 + 0.01).astype(np.float32)
    gx = rng.standard_normal((200, 64)).astype(np.float16)
    gw = rng.standard_normal((3, 32, 64)).astype(np.float16)
    ids = rng.integers(0, 3, 200).astype(np.int32)
    calls = [lambda a: sf.quantize(a[0], a[1], scope="token"),
             lambda a: sf.dynamic_quantize(a[0], scope="tensor")[0],
             lambda a: sf.grouped_matmul(a[2], a[3], row_experts=a[4])]
    host = (x, s, gx, gw, ids)
    with cp.cuda.Device(0):
        want = [cp.asnumpy(c([cp.asarray(h) for h in host])) for c in calls]
    with cp.cuda.Device(1):
        on1 = [cp.asarray(h) for h in host]
    with cp.cuda.Device(0):
        for _ in range(2):
            for c, w in zip(calls, want):
                got = c(on1)
                assert got.device.id == 1 and cp.cuda.runtime.getDevice() == 0
                assert np.array_equal(cp.asnumpy(got).view(np.uint8), w.view(np.uint8))


@two_gpus
def test_arguments_on_two_devices_raise_a_typed_error():
    d0, d1 = inputs("cuda:0"), inputs("cuda:1")
    cases = [(lambda: sf.quantize(d0["x"], d1["s"], scope="token"), {"x", "scale"}),
             (lambda: sf.grouped_matmul(d0["gx"], d1["gw"], offsets=d0["offs"]), {"x", "w", "offsets"}),
             (lambda: sf.grouped_matmul_backward(d0["gx"], d0["gw"], d1["gdy"], offsets=d0["offs"]),
              {"x", "w", "dy", "offsets"}),
             (lambda: sf.dequantize(d0["q"], d0["s"], scope="token", out=torch.empty(64, 512, device="cuda:1")),
              {"q", "out"}),
             (lambda: torch.ops.skuforge.quantize(d1["x"], d0["s"], None, "token"), {"x", "scale"})]
    for call, named in cases:
        with pytest.raises(sf.DeviceMismatchError) as e:
            call()
        assert named <= set(e.value.devices), (named, e.value.devices)
        assert set(e.value.devices.values()) == {"cuda:0", "cuda:1"}
        assert "different devices" in str(e.value)


@two_gpus
def test_two_threads_on_two_devices_at_once():
    """Each thread runs a mix of ops on its device many times (its first call a full path, then
    replays), both at once; the thread of cuda:1 never makes it current. Every result equals the
    single-threaded one."""
    names = ["quantize token", "dynamic_quantize tensor", "grouped_matmul row_experts mma",
             "grouped_matmul_backward", "fake_quantize_learnable_backward"]
    replay.CACHE.clear()
    data = {d: inputs(f"cuda:{d}") for d in (0, 1)}
    with torch.cuda.device(0):
        want = {n: [t.cpu() for t in _flat(OPS[n](data[0]))] for n in names}
    replay.CACHE.clear()
    start = threading.Barrier(2)
    got, errors = {0: [], 1: []}, []

    def work(d):
        try:
            if d == 0:
                torch.cuda.set_device(0)
            start.wait()
            for _ in range(40):
                for n in names:
                    got[d].append((n, _flat(OPS[n](data[d]))))
            torch.cuda.synchronize(d)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((d, e))
    threads = [threading.Thread(target=work, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for d in (0, 1):
        assert len(got[d]) == 40 * len(names)
        for n, res in got[d]:
            assert all(r.device == torch.device("cuda", d) for r in res)
            assert all(_same_bits(r, w) for r, w in zip(res, want[n])), (d, n)


@two_gpus
def test_cuda_graph_captured_on_device1_replays_there():
    """A graph of a grouped matmul forward + backward and a dynamic quantize, captured on cuda:1,
    replayed (with cuda:0 current) on new data: equal to eager."""
    d = inputs("cuda:1")
    with torch.cuda.device(1):
        x, w, dy = d["gx"].clone(), d["gw"].clone(), d["gdy"].clone()
        offs, xq = d["offs"], d["x"].clone()

        def body():
            y = sf.grouped_matmul(x, w, offsets=offs)
            dx, dw = sf.grouped_matmul_backward(x, w, dy, offsets=offs)
            q, s, _ = sf.dynamic_quantize(xq, scope="token")
            return y, dx, dw, q, s
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()                                  # warm-up: the full paths, outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = body()
    g = torch.Generator().manual_seed(11)
    with torch.cuda.device(0):
        for _ in range(2):
            x.copy_(torch.randn(x.shape, generator=g).to(x.dtype))
            dy.copy_(torch.randn(dy.shape, generator=g).to(dy.dtype))
            xq.copy_(torch.randn(xq.shape, generator=g))
            graph.replay()
            torch.cuda.synchronize(1)
            eager = body()
            for a, b in zip(outs, eager):
                assert a.device == torch.device("cuda", 1) and _same_bits(a, b)


# -- one GPU: the current device and stream ------------------------------------------------------------
def test_launches_follow_the_current_stream_under_a_device_context():
    """Under ``torch.cuda.device(0)``, a capture on an explicit side stream records every launch of
    the ops (a launch on any other stream would break the capture); the replayed graph equals eager."""
    d = inputs("cuda:0")
    with torch.cuda.device(0):
        names = ["quantize token", "dynamic_quantize tensor", "grouped_matmul row_experts mma",
                 "grouped_matmul_backward", "fake_quantize mask"]
        for n in names:
            OPS[n](d)                                # warm-up on the default stream: remembered there
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):      # replays on the capture stream, the current one
            outs = [_flat(OPS[n](d)) for n in names]
        graph.replay()
        torch.cuda.synchronize()
        for n, o in zip(names, outs):
            assert all(_same_bits(a, b) for a, b in zip(o, _flat(OPS[n](d)))), n


def test_a_thread_without_a_current_context():
    """A new thread whose only CUDA work is a replayed skuforge call into given arrays (nothing to
    allocate): it launches in the arrays' context. The replay's graph launch goes through the CUDA
    runtime, which makes the device's primary context current in a thread that has none, as any
    runtime call (PyTorch's, CuPy's) does: the thread ends with none or with that context, never
    another (docs/errors.md "Devices")."""
    d = inputs("cuda:0")
    M, E, N = d["gx"].shape[0], d["gw"].shape[0], d["gw"].shape[1]
    ws = torch.empty(sf.moe.grouped_matmul_workspace_size(M, E, "row_experts"), dtype=torch.uint8, device="cuda:0")
    want = sf.grouped_matmul(d["gx"], d["gw"], row_experts=d["ids"])
    y = torch.full((M, N), float("nan"), dtype=want.dtype, device="cuda:0")
    sf.grouped_matmul(d["gx"], d["gw"], row_experts=d["ids"], out=torch.empty_like(y), workspace=ws)   # remembered
    torch.cuda.synchronize()
    primary = sf_device.driver().context_current()           # this thread's: device 0's primary context
    out = {}

    def work():
        try:
            before = sf_device.driver().context_current()
            sf.grouped_matmul(d["gx"], d["gw"], row_experts=d["ids"], out=y, workspace=ws)
            out["ctx"] = (before, sf_device.driver().context_current())
        except BaseException as e:  # noqa: BLE001
            out["error"] = e
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in out, out.get("error")
    assert primary and out["ctx"][0] == 0 and out["ctx"][1] in (0, primary), (primary, out["ctx"])
    torch.cuda.synchronize()
    assert _same_bits(y, want)


def test_ep_layer_world_size_1_over_nccl_equals_the_one_process_layer():
    """The layer through NCCL (one process, world size 1: the exchanges are real collectives) gives
    the one-process layer's bits: outputs, dx, dw and the router gradient, float32 and bfloat16."""
    import torch.distributed as dist
    from runtime.torch import ep
    if not dist.is_nccl_available():
        pytest.skip("torch without NCCL")
    for k, v in NO_MULTICAST.items():
        os.environ[k] = v
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        for dtype in (torch.float32, torch.bfloat16):
            p = ep.init_weights(256, 384, 8, seed=3, dtype=dtype)
            g = torch.Generator().manual_seed(4)
            x = torch.randn(300, 256, generator=g).to(dtype).cuda()
            dy = torch.randn(300, 256, generator=g).to(dtype).cuda()
            res = []
            for group in (dist.group.WORLD, None):
                layer = ep.MoE(p["router"], p["w1"], p["w2"], top_k=2, group=group).cuda()
                xi = x.clone().requires_grad_(True)
                y = layer(xi)
                y.backward(dy)
                res.append((y, xi.grad, layer.w1.grad, layer.w2.grad, layer.router.grad))
            for a, b in zip(*res):
                assert _same_bits(a, b), dtype
    finally:
        dist.destroy_process_group()


# -- the example on two GPUs ---------------------------------------------------------------------------
@two_gpus
def test_ep_moe_example_on_two_gpus():
    """``torchrun --nproc-per-node 2 examples/ep_moe.py --bench`` (small bench sizes): the checks pass on
    both ranks (exit 0) and the bench prints its table."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **NO_MULTICAST)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join("examples", "ep_moe.py"), "--bench", "--tokens", "2048", "--dim", "1024", "--hidden", "1024",
           "--steps", "5"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-6000:]}"
    assert "ep_moe: world 2" in r.stdout and "ep_moe bench: 2 x" in r.stdout, r.stdout
    print(r.stdout)
