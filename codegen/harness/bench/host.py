"""Host overhead of a repeated functional call: the calls measured (the launch floors, every workload
module's ``host_calls()``, the functional API on CuPy arrays and torch tensors, runtime.torch, the MoE
calls) and their timing on the host clock, the GPU kept busy (docs/audit.md, "Host overhead")."""
from __future__ import annotations

import statistics
import sys
import time

from ..workloads.base import kept_results
from .timing import Timer

TARGET_HOST_US = 10.0      # µs per repeated call that launches one kernel
EXTRA_LAUNCH_US = 3.0      # µs more for each further launch of the call

HOST_SHAPE = (16, 4096)


def api_host_calls(device: int = 0) -> list:
    """Repeated calls of each functional API that is replayed on (16, 4096) inputs (target: TARGET_HOST_US per call):
    quantize / dequantize / fake_quantize (channel, axis 0) / dynamic_quantize (token), bf16 data
    and float32 scales, quantize and dynamic_quantize also into preallocated outputs (``out=``),
    with CuPy arrays and (when importable) torch tensors, default settings; then the MoE calls
    (:func:`moe_host_calls`). Items as ``host_calls()``."""
    import cupy as cp
    import ml_dtypes

    import runtime as sf
    rows, cols = HOST_SHAPE
    with cp.cuda.Device(device):
        x = (cp.random.standard_normal(HOST_SHAPE, dtype=cp.float32) * 3).astype(ml_dtypes.bfloat16)
        data = {"cupy": dict(x=x, s=cp.random.random(rows, dtype=cp.float32) + 0.5,
                             q=cp.random.randint(-128, 128, HOST_SHAPE).astype(cp.int8),
                             qo=cp.empty(HOST_SHAPE, cp.int8), so=cp.empty(rows, cp.float32))}
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            torch = None
    if torch is not None and torch.cuda.is_available():
        dev = f"cuda:{device}"
        data["torch"] = dict(x=torch.randn(HOST_SHAPE, device=dev, dtype=torch.bfloat16) * 3,
                             s=torch.rand(rows, device=dev) + 0.5,
                             q=torch.randint(-128, 128, HOST_SHAPE, device=dev, dtype=torch.int8),
                             qo=torch.empty(HOST_SHAPE, device=dev, dtype=torch.int8),
                             so=torch.empty(rows, device=dev, dtype=torch.float32))
    shape = f"({rows}, {cols})"
    calls = (("quantize token bf16->s8", lambda d: sf.quantize(d["x"], d["s"], scope="token", out_dtype="int8")),
             ("dequantize token s8->bf16",
              lambda d: sf.dequantize(d["q"], d["s"], scope="token", out_dtype="bfloat16")),
             ("fake_quantize channel bf16", lambda d: sf.fake_quantize(d["x"], d["s"], scope="channel", axis=0)),
             ("dynamic_quantize token bf16->s8", lambda d: sf.dynamic_quantize(d["x"], scope="token")),
             # preallocated outputs: what a call costs without its allocations
             ("quantize token bf16->s8, out=",
              lambda d: sf.quantize(d["x"], d["s"], scope="token", out_dtype="int8", out=d["qo"])),
             ("dynamic_quantize token bf16->s8, out=",
              lambda d: sf.dynamic_quantize(d["x"], scope="token", out=(d["qo"], d["so"]))))
    out = []
    for fw, d in data.items():
        for name, call in calls:
            def default(call=call, d=d):
                return call(d)
            out.append({"label": f"{name} {shape}, {fw}, default settings", "framework": fw, "call": default})
        for name, call in calls:
            if name not in ("quantize token bf16->s8", "dynamic_quantize token bf16->s8"):
                continue
            out.append({"label": f"{name} {shape}, {fw}, default settings, results kept", "framework": fw,
                        "call": kept_results(call, d)})
    if "torch" in data:
        out += custom_op_host_calls(data["torch"], shape)
    return out + moe_host_calls(device, torch)


def custom_op_host_calls(d: dict, shape: str) -> list:
    """The same calls through runtime.torch in eager mode: its public functions, which call the
    op's CUDA implementation directly where the dispatcher would do nothing else (the target
    applies), and, without a target (PyTorch's cost, docs/torch.md), through the dispatcher:
    ``torch.ops.skuforge`` called as such, and the public function on a tensor that requires grad
    (the custom op's autograd wrapper records the gradient)."""
    import torch

    import runtime.torch as sft
    sk = torch.ops.skuforge
    xg = d["x"].detach().clone().requires_grad_(True)
    calls = (("quantize token bf16->s8", lambda: sft.quantize(d["x"], d["s"], scope="token", out_dtype="int8")),
             ("dequantize token s8->bf16",
              lambda: sft.dequantize(d["q"], d["s"], scope="token", out_dtype="bfloat16")),
             ("dynamic_quantize token bf16->s8", lambda: sft.dynamic_quantize(d["x"], scope="token")),
             ("quantize token bf16->s8, out=",
              lambda: sft.quantize(d["x"], d["s"], scope="token", out_dtype="int8", out=d["qo"])))
    dispatched = (("quantize token bf16->s8", lambda: sk.quantize(d["x"], d["s"], None, "token")),
                  ("dynamic_quantize token bf16->s8", lambda: sk.dynamic_quantize(d["x"], "token")),
                  ("fake_quantize channel bf16, x requires grad",
                   lambda: sft.fake_quantize(xg, d["s"], scope="channel", axis=0)))
    return ([{"label": f"{name} {shape}, runtime.torch (eager), default settings", "framework": "runtime.torch",
              "call": call} for name, call in calls]
            + [{"label": f"{name} {shape}, torch.ops.skuforge dispatcher (eager), default settings",
                "framework": "torch.ops", "call": call, "target": False} for name, call in dispatched])


MOE_HOST_SHAPE = (256, 512, 512, 8)     # M, N, K, E


def moe_host_calls(device: int = 0, torch=None) -> list:
    """Repeated grouped_matmul / grouped_matmul_backward calls (M=256, N=K=512, E=8, bf16 for torch,
    f16 for CuPy, unsorted row_experts: three routing launches + one product per pass), with and
    without ``out=`` (``out=`` alone allocates the routing workspace; with ``workspace=`` too, nothing),
    CuPy and (when available) torch; and with offsets routing (one routing launch; on an H100 / H200 the
    wgmma kernels, whose replay looks their tensor maps up by address).
    Target: 10 µs plus 3 µs per launch beyond the first (``target_us``)."""
    import cupy as cp
    import numpy as np

    import runtime as sf
    M, N, K, E = MOE_HOST_SHAPE
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(s).astype(np.float32) for s in ((M, K), (E, N, K), (M, N))]
    ids = rng.integers(0, E, M).astype(np.int32)
    offs = np.searchsorted(np.sort(ids), np.arange(E + 1)).astype(np.int32)
    ws_size = sf.moe.grouped_matmul_workspace_size(M, E, "row_experts")
    data = {}
    with cp.cuda.Device(device):
        x, w, dy = (cp.asarray(h.astype(np.float16)) for h in host)
        data["cupy"] = dict(x=x, w=w, dy=dy, ids=cp.asarray(ids), offs=cp.asarray(offs), y=cp.empty((M, N), cp.float16),
                            dx=cp.empty((M, K), cp.float16), dw=cp.empty((E, N, K), cp.float32),
                            ws=cp.empty(ws_size, cp.uint8))
    if torch is not None and torch.cuda.is_available():
        dev = f"cuda:{device}"
        x, w, dy = (torch.tensor(h, device=dev).to(torch.bfloat16) for h in host)
        data["torch"] = dict(x=x, w=w, dy=dy, ids=torch.tensor(ids, device=dev), offs=torch.tensor(offs, device=dev),
                             y=torch.empty((M, N), device=dev, dtype=torch.bfloat16),
                             dx=torch.empty((M, K), device=dev, dtype=torch.bfloat16),
                             dw=torch.empty((E, N, K), device=dev, dtype=torch.float32),
                             ws=torch.empty(ws_size, device=dev, dtype=torch.uint8))
    calls = (("grouped_matmul", 4, lambda d: sf.grouped_matmul(d["x"], d["w"], row_experts=d["ids"])),
             ("grouped_matmul_backward", 5,
              lambda d: sf.grouped_matmul_backward(d["x"], d["w"], d["dy"], row_experts=d["ids"])),
             ("grouped_matmul, out=", 4,
              lambda d: sf.grouped_matmul(d["x"], d["w"], row_experts=d["ids"], out=d["y"])),
             ("grouped_matmul_backward, out=", 5,
              lambda d: sf.grouped_matmul_backward(d["x"], d["w"], d["dy"], row_experts=d["ids"],
                                                   out=(d["dx"], d["dw"]))),
             ("grouped_matmul, out= workspace=", 4,
              lambda d: sf.grouped_matmul(d["x"], d["w"], row_experts=d["ids"], out=d["y"], workspace=d["ws"])),
             ("grouped_matmul_backward, out= workspace=", 5,
              lambda d: sf.grouped_matmul_backward(d["x"], d["w"], d["dy"], row_experts=d["ids"],
                                                   out=(d["dx"], d["dw"]), workspace=d["ws"])))
    by_offsets = (("grouped_matmul", 2, lambda d: sf.grouped_matmul(d["x"], d["w"], offsets=d["offs"])),
                  ("grouped_matmul_backward", 3,
                   lambda d: sf.grouped_matmul_backward(d["x"], d["w"], d["dy"], offsets=d["offs"])),
                  ("grouped_matmul, out= workspace=", 2,
                   lambda d: sf.grouped_matmul(d["x"], d["w"], offsets=d["offs"], out=d["y"], workspace=d["ws"])))
    out = []
    for fw, d in data.items():
        for routing, items in (("row_experts", calls), ("offsets", by_offsets)):
            for name, launches, call in items:
                def default(call=call, d=d):
                    return call(d)
                out.append({"label": f"{name} {routing} (M={M}, N={N}, K={K}, E={E}), {fw}, default settings",
                            "framework": fw, "call": default, "launches": launches})
        name, launches, call = by_offsets[0]
        out.append({"label": f"{name} offsets (M={M}, N={N}, K={K}, E={E}), {fw}, default settings, results kept",
                    "framework": fw, "call": kept_results(call, d), "launches": launches})
    if "torch" in data:
        import runtime.torch as sft
        d = data["torch"]
        out.append({"label": f"grouped_matmul row_experts (M={M}, N={N}, K={K}, E={E}), runtime.torch (eager), "
                             "default settings", "framework": "runtime.torch", "launches": 4,
                    "call": lambda: sft.grouped_matmul(d["x"], d["w"], row_experts=d["ids"])})
    return out


def host_items(timer: "Timer", modules, api: bool = True, device: int = 0):
    """(items, errors): the bare CuPy launch floor, every module's ``host_calls()`` and (``api``)
    :func:`api_host_calls` not already measured under the same label."""
    errors = []
    items = [dict(label="cupy RawKernel launch (floor)", framework="cupy", call=lambda: timer.spin_ns(0))]
    try:                      # the driver's own launch, as the runtime makes it (runtime.device.bind_launch)
        from runtime.device import bind_launch
        go, stream = bind_launch(timer.spin.kernel, (1,), (1,), "Q"), timer.stream.ptr
        items.append(dict(label="driver launch, runtime.device.bind_launch (floor)", framework="cupy",
                          call=lambda: go(stream, (0,))))
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        errors.append({"label": "driver launch floor", "error": f"{type(e).__name__}: {e}", "us": None, "min_us": None})
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        a = torch.randn(16, 4096, device=f"cuda:{device}", dtype=torch.bfloat16)
        items.append(dict(label="torch eager add (16, 4096) bf16 (reference)", framework="torch",
                          call=lambda: torch.add(a, a), target=False))
    sources = [(f"{m.__name__}.host_calls()", m.host_calls) for m in modules if hasattr(m, "host_calls")]
    if api:
        sources.append(("codegen.harness.bench.host.api_host_calls()", lambda: api_host_calls(device)))
    for name, get in sources:
        try:
            seen = {i["label"] for i in items}
            items += [i for i in get() if i["label"] not in seen]
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            errors.append({"label": name, "error": f"{type(e).__name__}: {e}", "us": None, "min_us": None})
    return items, errors


HOST_BUSY_NS = 60_000_000       # the spin kernel the host-only calls are queued behind
HOST_QUEUE = 600                # launches queued behind it at most (the driver's queue holds about a thousand)


def time_host_calls(items, synchronize, n_calls: int = 2000, repeats: int = 5, busy=None) -> list:
    """µs per call of each item's ``call``, after 200 warm-up calls.

    ``throughput_us``: ``n_calls`` back-to-back calls and a synchronize, timed together (also
    bounded by the GPU's launch rate and the kernels), the median of ``repeats``. ``us``: with
    ``busy``, the host's own time per call (what a caller's thread pays: Python, allocation, the
    driver's launch), the median of at least 7 batches, each queued behind a ``busy(ns)`` spin
    kernel so that the launch queue neither drains nor fills; the batches are taken in rounds over
    all items (one batch of each item per round), so that a slow spell of the host (its speed
    drifts within a run) weighs on every row alike, the floors included. Without ``busy``,
    ``us`` is ``throughput_us``."""
    out, timed = [], []
    for item in items:
        call = item["call"]
        try:
            for _ in range(200):
                call()
            synchronize()
            per = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(n_calls):
                    call()
                synchronize()
                per.append((time.perf_counter() - t0) / n_calls * 1e6)
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            out.append({"label": item["label"], "error": f"{type(e).__name__}: {e}", "us": None, "min_us": None})
            continue
        r = {"label": item["label"], "framework": item.get("framework"), "throughput_us": statistics.median(per),
             "calls": n_calls, "repeats": repeats}
        if busy is None:
            r.update(us=r["throughput_us"], min_us=min(per), measure="throughput")
        if item.get("target", True) and "floor" not in item["label"]:
            r["target_us"] = TARGET_HOST_US + EXTRA_LAUNCH_US * (item.get("launches", 1) - 1)
        out.append(r)
        timed.append((item, r, []))
    if busy is not None:
        for _ in range(max(repeats, 7)):
            for item, r, host in timed:
                if "error" in r:
                    continue
                call, n_host = item["call"], max(10, HOST_QUEUE // item.get("launches", 1))
                try:
                    busy(HOST_BUSY_NS)
                    t0 = time.perf_counter()
                    for _ in range(n_host):
                        call()
                    host.append((time.perf_counter() - t0) / n_host * 1e6)
                    synchronize()
                except Exception as e:  # noqa: BLE001 - recorded, not fatal
                    r.clear()
                    r.update(label=item["label"], error=f"{type(e).__name__}: {e}", us=None, min_us=None)
                    continue
                r["host_calls"] = n_host
        for _, r, host in timed:
            if "error" not in r:
                r.update(us=statistics.median(host), min_us=min(host), measure="host")
    return out


def measure_host(timer: "Timer", modules, n_calls: int = 2000, repeats: int = 5, api: bool = True,
                 device: int = 0) -> list:
    """µs per call of repeated functional-API calls (host clock; kernels and plans cached)."""
    items, errors = host_items(timer, modules, api, device)
    return errors + time_host_calls(items, timer.stream.synchronize, n_calls, repeats, busy=timer.spin_ns)
