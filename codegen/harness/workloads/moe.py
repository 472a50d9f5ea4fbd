"""Benchmark workloads of the moe grouped matmul (docs/audit.md), for ``python -m codegen bench`` and
standalone: ``python -m codegen.harness.workloads.moe [--quick]`` prints TFLOP/s against ``torch._grouped_mm``.

Shapes: (E, M, N, K, routing) with routing ``balanced`` (M / E rows each) or ``skewed`` (rows
per expert ~ 1 / (e + 1)^1.2, fixed seed); rows sorted by expert and given as offsets, as
``torch._grouped_mm`` needs them. FLOPs = 2 M N K (padding-free). A sixth field ``"dx+dw"`` names
the whole backward (both gradients, dw float32: 4 M N K FLOPs) against torch's two grouped_mm
calls, measured on the weight-gradient SKU of each backend. The dense bf16 product (8192^3 through
torch) is measured in the same run as the ceiling (``ceiling``): % of it is in each result.
"""
from __future__ import annotations

import statistics
import sys

import numpy as np

from runtime import kinds


OPS = ("grouped_matmul", "grouped_matmul_backward_input", "grouped_matmul_backward_weight")
GEMM_SHAPES = ((8, 16384, 4096, 4096), (64, 32768, 2048, 7168), (128, 16384, 1536, 2048), (128, 4096, 1536, 2048))
PASS_SHAPES = tuple(s + (r,) for s in GEMM_SHAPES for r in ("balanced", "skewed"))
SHAPES = PASS_SHAPES + tuple(s + ("dx+dw",) for s in PASS_SHAPES)
QUICK_SHAPES = (SHAPES[0], SHAPES[5], SHAPES[len(PASS_SHAPES)])
BACKWARD = "dx+dw"
DENSE = 8192      # the ceiling: a dense bf16 DENSE^3 product through torch


def TARGET_PCT_OF_TORCH(sku, shape):
    """% of torch's time-equivalent throughput to reach (bench ``target_ref``), or None. wgmma: forward
    >= 95% on the large-expert shapes and >= 110% on the E128 ones (many small experts); the whole
    backward (dx + dw, dw float32) >= 90%; the single backward passes have no target of their own.
    mma: >= 50% on every pass (its ceiling is mma.sync's)."""
    if sku.backend == "mma":
        return 50.0
    if sku.backend != "wgmma":
        return None
    if len(shape) > 5 and shape[5] == BACKWARD:
        return 90.0
    if sku.op == "grouped_matmul":
        return 110.0 if shape[0] >= 128 else 95.0
    return None


def default(sku) -> bool:
    """The default selection: bf16 on tensor cores (the simt path is the reference-grade one)."""
    return sku.element == "bf16" and sku.backend in ("mma", "wgmma") and sku.aux_element in (None, "f32")


def ceiling(timer) -> dict:
    """The dense bf16 product DENSE^3 through torch (random data), timed like every workload: what
    the chip's tensor cores give a plain GEMM in this run."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(7)
    a = torch.randn(DENSE, DENSE, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(DENSE, DENSE, device="cuda", dtype=torch.bfloat16, generator=g)
    m = timer.measure([lambda: a @ b])
    a = b = None
    return {"name": f"dense bf16 matmul {DENSE}^3 (torch)", "ms": m["ms"], "tflops": 2.0 * DENSE ** 3 / m["ms"] / 1e9}


def counts_for(E: int, M: int, routing: str) -> np.ndarray:
    if routing == "balanced":
        c = np.full(E, M // E, np.int64)
        c[: M % E] += 1
        return c
    p = 1.0 / (np.arange(E) + 1.0) ** 1.2
    c = np.floor(p / p.sum() * M).astype(np.int64)
    c[0] += M - c.sum()
    return c


def inputs(shape, element: str = "bf16", seed: int = 1234) -> dict:
    """The benchmark problem of one shape (torch CUDA tensors): x [M, K], w [E, N, K] (scaled by
    1/sqrt(K)), dy [M, N], the routing as ``offsets`` [E+1] (int32, rows sorted by expert) and
    ``ends`` (= offsets[1:], what ``torch._grouped_mm`` takes), ``counts`` (rows per expert)."""
    import torch
    E, M, N, K, routing = shape
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[element]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", dtype=dt, generator=g)
    w = torch.randn(E, N, K, device="cuda", dtype=dt, generator=g) / K ** 0.5
    dy = torch.randn(M, N, device="cuda", dtype=dt, generator=g)
    counts = counts_for(E, M, routing)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), device="cuda", dtype=torch.int32)
    return {"x": x, "w": w, "dy": dy, "offsets": offsets, "ends": offsets[1:].contiguous(), "counts": counts}


def calls(op: str, data: dict, backend: str = "mma", dw_dtype: str = "float32"):
    """(ours, torch's) zero-argument calls of one pass on ``inputs(...)`` (``op`` BACKWARD: both
    gradients); torch's is None without ``torch._grouped_mm`` (or for float32, which it does not take)."""
    import torch

    import runtime as sf
    x, w, dy, offsets, ends = data["x"], data["w"], data["dy"], data["offsets"], data["ends"]
    gmm = getattr(torch, "_grouped_mm", None)
    if op == "grouped_matmul":
        def ours():
            return sf.grouped_matmul(x, w, offsets=offsets, strategy=backend)
        ref = (lambda: gmm(x, w.transpose(-2, -1), offs=ends)) if gmm else None
    elif op == BACKWARD:
        def ours():
            return sf.grouped_matmul_backward(x, w, dy, offsets=offsets, strategy=backend, dw_dtype=dw_dtype)
        ref = (lambda: (gmm(dy, w, offs=ends), gmm(dy.t(), x, offs=ends))) if gmm else None
    elif op == "grouped_matmul_backward_input":
        def ours():
            return sf.grouped_matmul_backward(x, w, dy, offsets=offsets, strategy=backend, need_weight=False)[0]
        ref = (lambda: gmm(dy, w, offs=ends)) if gmm else None
    else:
        def ours():
            return sf.grouped_matmul_backward(x, w, dy, offsets=offsets, strategy=backend, need_input=False,
                                              dw_dtype=dw_dtype)[1]
        ref = (lambda: gmm(dy.t(), x, offs=ends)) if gmm else None
    if x.dtype == torch.float32:
        ref = None   # torch._grouped_mm takes bf16 only
    return ours, ref


def make(sku, shape):
    """dict(call, flops, torch_ref, label, footprint) for one SKU on one shape, or None."""
    if sku.category != "moe":
        return None
    E, M, N, K, routing = shape[:5]
    whole = len(shape) > 5 and shape[5] == BACKWARD
    if whole and not (sku.op == "grouped_matmul_backward_weight" and sku.aux_element == "f32"):
        return None     # the whole backward: once per backend, on its dw-float32 SKU
    data = inputs(shape[:5], sku.element)
    x, w, dy = data["x"], data["w"], data["dy"]
    dw_dtype = "float32" if sku.aux_element == "f32" else kinds.kind(sku.element).numpy
    op = BACKWARD if whole else sku.op
    call, ref = calls(op, data, sku.backend, dw_dtype)
    dw_bytes = E * N * K * (4 if dw_dtype == "float32" else x.element_size())
    out_bytes = {"grouped_matmul": M * N * x.element_size(), "grouped_matmul_backward_input": M * K * x.element_size(),
                 "grouped_matmul_backward_weight": dw_bytes, BACKWARD: M * K * x.element_size() + dw_bytes}[op]
    footprint = x.numel() * x.element_size() + w.numel() * w.element_size() + dy.numel() * dy.element_size() + out_bytes
    what = "grouped_matmul_backward (dx + dw)" if whole else sku.op
    label = f"{what} {sku.element} {sku.backend} E{E} M{M} N{N} K{K} {routing}"
    return {"call": call, "flops": (4.0 if whole else 2.0) * M * N * K, "torch_ref": ref, "label": label,
            "footprint": footprint}


def _time(fn, reps: int = 30, warmup: int = 5) -> float:
    """Median ms per call by CUDA events (each call timed on its own, after warm-up)."""
    return time_interleaved([fn], reps, warmup)[0]


def time_interleaved(fns, reps: int = 30, warmup: int = 5) -> list:
    """Median ms per call of each of ``fns`` by CUDA events, the calls taken in turns (a b c a b c
    ...), each timed on its own after warm-up: every contender sees the same clocks and temperature,
    so their ratio does not drift with the GPU's state over the run."""
    import torch
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    ev = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
          for _ in range(reps)]
    for row in ev:
        for fn, (a, b) in zip(fns, row):
            a.record()
            fn()
            b.record()
    torch.cuda.synchronize()
    return [statistics.median(row[i][0].elapsed_time(row[i][1]) for row in ev) for i in range(len(fns))]


def _compile_unit(job):
    from runtime.compiler import compile_cached
    unit, source, arch, options = job
    return unit, compile_cached(source, unit, arch, options).cached


def warm(arch: int, pattern: str = "moe/*", workers: int = 16) -> list:
    """Compile the units holding SKUs that match ``pattern`` into the disk cache, in parallel
    processes (a fresh machine otherwise compiles them one by one on first use)."""
    import fnmatch
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from runtime.registry import default_registry
    reg = default_registry()
    from runtime.compiler import builds_for
    jobs = [(u, reg.unit_source(u), arch, tuple(m["nvrtc_options"])) for u, m in sorted(reg.units.items())
            if any(fnmatch.fnmatchcase(s, pattern) for s in m["skus"]) and builds_for(m["nvrtc_options"], arch)]
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(_compile_unit, jobs))


def main(argv=None) -> int:
    """Standalone table: each default SKU on each shape, ours vs torch._grouped_mm."""
    import argparse
    import fnmatch

    import runtime as sf
    ap = argparse.ArgumentParser(prog="python -m codegen.harness.workloads.moe")
    ap.add_argument("--filter", default="moe/*")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warm", type=int, default=0, metavar="ARCH", help="only compile the moe units for sm_ARCH")
    args = ap.parse_args(argv)
    if args.warm:
        for unit, cached in warm(args.warm):
            print(f"{unit}: {'cached' if cached else 'compiled'}")
        return 0
    skus = [s for s in sf.default_registry().skus() if fnmatch.fnmatchcase(str(s), args.filter) and default(s)]
    rows = []
    for sku in skus:
        for shape in (QUICK_SHAPES if args.quick else SHAPES):
            wl = make(sku, shape)
            if wl is None:
                continue
            ours = _time(wl["call"], args.reps)
            theirs = _time(wl["torch_ref"], args.reps) if wl["torch_ref"] else None
            tf = wl["flops"] / ours / 1e9
            tt = wl["flops"] / theirs / 1e9 if theirs else None
            rows.append((wl["label"], ours, tf, theirs, tt))
            print(f"{wl['label']:<80} {ours:8.3f} ms {tf:7.1f} TF/s | torch {theirs or 0:8.3f} ms "
                  f"{tt or 0:7.1f} TF/s | {100 * tf / tt if tt else 0:5.1f}%", flush=True)
            del wl
    return 0


if __name__ == "__main__":
    sys.exit(main())
