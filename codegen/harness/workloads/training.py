"""Bench workloads of the training ops (docs/training.md), for ``python -m codegen bench``, and a standalone
measurement of their targets (``python -m codegen.harness.workloads.training``).

Inputs are random (never all zeros): x ~ 3·N(0, 1), dy ~ N(0, 1), scales in [0.02, 0.05) so that
a few percent of x saturates, zero points in [-20, 20]. Channel scope is per row (``axis=0``,
PyTorch's QAT weight layout); group size 128. Every skuforge call is a default one (its kernels
check the scale and zero-point values as they load them).

PyTorch baselines (same data, same run): ``fake_quantize`` (forward + the mask's bits, what
runtime.torch's autograd writes) against ``aten.fake_quantize_per_{tensor,channel}_affine_cachemask``
(what PyTorch's autograd runs: a one-byte mask) or, for token / group scopes, the composite of
docs/numerics.md; ``fake_quantize_backward`` (the mask recomputed from x) against the composite of the
same math (the mask recomputed from x, then ``dy * mask``); ``fake_quantize_backward_from_mask``
(the bits) against PyTorch's backward ``dy * mask`` with its cached bool mask; the other ops against
their composites. Bytes = inputs read once + outputs written once; the bits count ceil(D / 8) bytes a row.
"""
from __future__ import annotations

import math

from .base import kept_results, nbytes

OPS = ("quantize_backward", "dequantize_backward", "fake_quantize", "fake_quantize_backward",
       "fake_quantize_backward_from_mask", "fake_quantize_learnable_backward")
def TARGET_PCT(sku):
    """% of device copy: 95 for the single-pass kernels (fake-quant forward + mask, the backward
    passes), 75 for LSQ's tensor / channel scale reductions (two passes)."""
    if sku.op == "fake_quantize_learnable_backward" and sku.scope in ("tensor", "channel"):
        return 75.0
    return 95.0
GROUP_SIZE = 128
CHANNEL_AXIS = 0
QMIN, QMAX = -128, 127


def default(sku) -> bool:
    """The targets: fake-quant forward+mask and backward, tensor / channel, and the backward from the
    mask's bits; f32 / bf16."""
    if sku.element not in ("f32", "bf16"):
        return False
    if sku.op == "fake_quantize_backward_from_mask":
        return True
    return (sku.op in ("fake_quantize", "fake_quantize_backward") and sku.scope in ("tensor", "channel")
            and sku.mode == "asymmetric")


def bits_bytes(shape) -> int:
    """Bytes of the bit-packed mask of an array of ``shape``: ceil(D / 8) a row."""
    return math.prod(shape[:-1]) * -(-shape[-1] // 8)


def _torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def _params(sku, shape):
    from runtime.scopes import param_shape
    axis = CHANNEL_AXIS if sku.scope == "channel" else None
    gs = GROUP_SIZE if sku.scope == "group" else None
    return axis, gs, param_shape(shape, sku.scope, None if axis is None else axis % len(shape), gs)


def _bview(p, scope, shape, axis):
    """A scope parameter broadcastable against x (group: against x.unflatten(-1, (G, gs)))."""
    if p is None or scope == "tensor":
        return p
    if scope == "channel":
        a = axis % len(shape)
        return p.reshape([1] * a + [shape[a]] + [1] * (len(shape) - a - 1))
    return p.unsqueeze(-1)


def fake_quant_composite(x, scale, zp, zp_const: int, qmin: int, qmax: int, group: int):
    """PyTorch composite of fake_quantize + mask (docs/numerics.md); parameters already broadcastable."""
    import torch
    xm = x if x.dtype == torch.float64 else x.float()
    if group:
        xm = xm.unflatten(-1, (-1, group))
    z = zp if zp is not None else zp_const
    v = torch.round(xm * (1.0 / scale)) + z
    y = ((v.clamp(qmin, qmax) - z) * scale).to(x.dtype)
    m = (v >= qmin) & (v <= qmax)
    return (y.flatten(-2), m.flatten(-2)) if group else (y, m)


def ste_composite(dy, x, scale, zp, zp_const: int, qmin: int, qmax: int, group: int):
    """PyTorch composite of the straight-through backward: dy * (qmin <= v <= qmax)."""
    import torch
    xm = x if x.dtype == torch.float64 else x.float()
    if group:
        xm = xm.unflatten(-1, (-1, group))
    v = torch.round(xm * (1.0 / scale)) + (zp if zp is not None else zp_const)
    m = ((v >= qmin) & (v <= qmax))
    return dy * (m.flatten(-2) if group else m)


def dequantize_backward_composite(dy, scale, group: int):
    import torch
    d = dy if dy.dtype == torch.float64 else dy.float()
    if group:
        return (d.unflatten(-1, (-1, group)) * scale).flatten(-2).to(dy.dtype)
    return (d * scale).to(dy.dtype)


def mask_backward(dy, mask):
    """PyTorch's fake-quant backward (FakeQuantPerTensorAffine.cpp): ``dY * mask``."""
    return dy * mask


def _from_mask(sku, shape):
    """fake_quantize_backward_from_mask on the bits of fake_quantize(x, 0.03) (a few percent of x clipped),
    against ``dy * mask`` with the bool mask of the same x (PyTorch's backward)."""
    import runtime as sf
    from runtime import kinds

    torch = _torch()
    kind = sku.element
    if torch is not None:
        from runtime.arrays import torch_dtype
        mdt = torch.float64 if kind == "f64" else torch.float32
        x = (torch.randn(shape, device="cuda", dtype=mdt) * 3).to(torch_dtype(kind))
        dy = torch.randn(shape, device="cuda", dtype=mdt).to(torch_dtype(kind))
    else:
        import cupy as cp
        from runtime.arrays import numpy_dtype
        mdt = cp.float64 if kind == "f64" else cp.float32
        x = (cp.random.standard_normal(shape, dtype=mdt) * 3).astype(numpy_dtype(kind))
        dy = cp.random.standard_normal(shape, dtype=mdt).astype(numpy_dtype(kind))
    _, bits = sf.fake_quantize(x, 0.03, scope="tensor", return_mask="bits")

    def call():
        return sf.fake_quantize_backward_from_mask(dy, bits)
    w = {"call": call, "bytes": 2 * math.prod(shape) * kinds.SIZE[kind] + bits_bytes(shape), "label": f"{kind} bits"}
    if torch is not None:
        _, mask = sf.fake_quantize(x, 0.03, scope="tensor", return_mask=True)
        w.update(torch_fn=mask_backward, torch_args=(dy, mask), label=w["label"] + " vs dy*mask (bool)")
    return w


def make(sku, shape):
    """A workload dict for ``codegen.harness.bench`` (None for SKUs of other families)."""
    if sku.op not in OPS:
        return None
    if sku.op == "fake_quantize_backward_from_mask":
        return _from_mask(sku, shape)
    import runtime as sf
    from runtime import kinds

    torch = _torch()
    axis, gs, pshape = _params(sku, shape)
    kind = sku.element
    n = math.prod(shape)
    asym = sku.mode == "asymmetric"
    x, dy, scale, zp = _inputs(torch, kind, shape, pshape, asym)
    kw = dict(scope=sku.scope, axis=axis, group_size=gs)
    fq = dict(qmin=QMIN, qmax=QMAX)
    item = kinds.SIZE[kind]
    where = {"tensor": "", "channel": f" axis={CHANNEL_AXIS}", "token": "", "group": f" g{GROUP_SIZE}"}[sku.scope]
    label = f"{kind} {sku.scope}{where} {sku.mode[:4] if sku.mode else ''}".rstrip()
    params = nbytes(scale, zp)
    w = {}
    if sku.op == "fake_quantize":
        def call():
            return sf.fake_quantize(x, scale, zp, **kw, **fq, return_mask="bits")
        w = {"call": call, "bytes": 2 * n * item + bits_bytes(shape) + params, "label": label + " +mask bits"}
    elif sku.op in ("fake_quantize_backward", "quantize_backward"):
        fn = sf.fake_quantize_backward if sku.op == "fake_quantize_backward" else sf.quantize_backward

        def call():
            return fn(dy, x, scale, zp, **kw, **fq)
        w = {"call": call, "bytes": 3 * n * item + params, "label": label}
    elif sku.op == "dequantize_backward":
        def call():
            return sf.dequantize_backward(dy, scale, **kw)
        w = {"call": call, "bytes": 2 * n * item + params, "label": label}
    else:
        def call():
            return sf.fake_quantize_learnable_backward(dy, x, scale, zp, **kw, **fq, grad_factor=0.01)
        w = {"call": call, "bytes": 3 * n * item + params + math.prod(pshape) * (kinds.SIZE["f64" if kind == "f64" else "f32"] + (4 if asym else 0)),
             "label": label}
    if torch is not None:
        _torch_baseline(w, torch, sku, shape, (x, dy, scale, zp), (axis, gs, pshape))
    return w


def _inputs(torch, kind: str, shape, pshape, asym: bool) -> tuple:
    """(x, dy, scale, zero point or None): torch tensors when torch is present, else CuPy arrays."""
    if torch is not None:
        from runtime.arrays import torch_dtype
        dt, mdt = torch_dtype(kind), (torch.float64 if kind == "f64" else torch.float32)
        x = (torch.randn(shape, device="cuda", dtype=mdt) * 3).to(dt)
        dy = torch.randn(shape, device="cuda", dtype=mdt).to(dt)
        scale = torch.rand(pshape, device="cuda", dtype=mdt) * 0.03 + 0.02
        zp = torch.randint(-20, 21, pshape, device="cuda", dtype=torch.int32) if asym else None
        return x, dy, scale, zp
    import cupy as cp
    from runtime.arrays import numpy_dtype
    mdt = cp.float64 if kind == "f64" else cp.float32
    x = (cp.random.standard_normal(shape, dtype=mdt) * 3).astype(numpy_dtype(kind))
    dy = cp.random.standard_normal(shape, dtype=mdt).astype(numpy_dtype(kind))
    scale = (cp.random.random(pshape, dtype=mdt) * 0.03 + 0.02).astype(mdt)
    zp = cp.random.randint(-20, 21, pshape, dtype=cp.int32) if asym else None
    return x, dy, scale, zp


def _torch_baseline(w: dict, torch, sku, shape, inputs: tuple, params: tuple) -> None:
    """The PyTorch baseline of the workload ``w`` (``torch_fn``, ``torch_args``; the label says which);
    ``inputs``: (x, dy, scale, zp), ``params``: (axis, group size, parameter shape)."""
    x, dy, scale, zp = inputs
    axis, gs, pshape = params
    kind = sku.element
    sb, zb = _bview(scale, sku.scope, shape, axis), _bview(zp, sku.scope, shape, axis)
    zc = 0
    if sku.op == "fake_quantize":
        if sku.scope == "channel" and kind != "f64":
            zpt = zp if zp is not None else torch.zeros(pshape, dtype=torch.int32, device="cuda")
            w["torch_fn"] = torch.ops.aten.fake_quantize_per_channel_affine_cachemask
            w["torch_args"] = (x, scale.float(), zpt, axis, QMIN, QMAX)
            w["label"] += " vs aten per_channel_cachemask"
        elif sku.scope == "tensor" and kind != "f64":
            w["torch_fn"] = torch.ops.aten.fake_quantize_per_tensor_affine_cachemask
            w["torch_args"] = (x, float(scale), int(zp) if zp is not None else 0, QMIN, QMAX)
            w["label"] += " vs aten per_tensor_cachemask"
        else:
            w["torch_fn"] = fake_quant_composite
            w["torch_args"] = (x, sb, zb, zc, QMIN, QMAX, gs or 0)
    elif sku.op in ("fake_quantize_backward", "quantize_backward"):
        # the same math: the mask recomputed from x, then dy * mask
        w["torch_fn"] = ste_composite
        w["torch_args"] = (dy, x, sb, zb, zc, QMIN, QMAX, gs or 0)
        if sku.op == "fake_quantize_backward":
            w["label"] += " vs recomputed mask"
    elif sku.op == "dequantize_backward":
        w["torch_fn"] = dequantize_backward_composite
        w["torch_args"] = (dy, sb, gs or 0)


# -- standalone: the target numbers in one process ------------------------------------------------
def _time(fn, batches=15, per=10, warm=5):
    """Median GPU time per call: CUDA events around ``per`` back-to-back calls (the host enqueues
    ahead of the GPU unless a call's host overhead exceeds its GPU time: then that is measured)."""
    import torch
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(batches):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(per):
            fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / per)
    ts.sort()
    return ts[len(ts) // 2]


def host_profile(n=2000):
    """Host µs per functional call on (16, 4096) bf16, and where it goes (cProfile, top entries)."""
    import cProfile
    import io
    import pstats
    import time

    import torch

    import runtime as sf
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    s = torch.rand(16, device="cuda") * 0.03 + 0.02
    z = torch.randint(-20, 21, (16,), device="cuda", dtype=torch.int32)

    def call():
        sf.fake_quantize(x, s, z, scope="channel", axis=0, return_mask=True)
    for _ in range(200):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    us = (time.perf_counter() - t0) / n * 1e6
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        call()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
    print(f"host: {us:.1f} us per fake_quantize(+mask) call, torch tensors")
    print(buf.getvalue()[-3500:])
    return us


def _lsq_rows(reg, kinds, copy: float) -> list:
    """fake_quantize_learnable_backward per channel and per tensor at 8192 x 8192 against PyTorch's
    learnable fake-quant backward (information: no target); rows as :func:`main`'s."""
    import torch

    from runtime.arrays import torch_dtype
    rows = []
    for kind in kinds:
        for scope in ("channel", "tensor"):
            shape = (8192, 8192)
            sku = reg.select(category="quantization", op="fake_quantize_learnable_backward", scope=scope,
                             mode="asymmetric", element=kind, aux_element=kind)
            w = make(sku, shape)
            t_ours = _time(w["call"])
            r = {"op": sku.op, "kind": kind, "scope": scope, "shape": shape, "us": t_ours * 1e3,
                 "gbps": w["bytes"] / (t_ours * 1e-3) / 1e9}
            r["pct_copy"] = 100 * r["gbps"] / copy
            try:
                x = torch.randn(shape, device="cuda").to(torch_dtype(kind))
                dy = torch.randn_like(x)
                n = shape[0] if scope == "channel" else 1
                sc = torch.rand(n, device="cuda") * 0.03 + 0.02
                zp = torch.randint(0, 20, (n,), device="cuda").float()
                if scope == "channel":
                    fn = lambda: torch.ops.aten._fake_quantize_learnable_per_channel_affine_backward(  # noqa: E731
                        dy, x, sc, zp, 0, QMIN, QMAX, 0.01)
                else:
                    fn = lambda: torch.ops.aten._fake_quantize_learnable_per_tensor_affine_backward(  # noqa: E731
                        dy, x, sc, zp, QMIN, QMAX, 0.01)
                r["torch_us"] = _time(fn) * 1e3
                r["x_torch"] = r["torch_us"] / r["us"]
            except Exception as e:  # noqa: BLE001 - a baseline that does not run is reported
                r["torch_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(r)
            print(f"{sku.op:24s} {kind:4s} {scope:7s} {str(shape):14s} {r['us']:9.1f} us {r['gbps']:6.0f} GB/s "
                  f"{r['pct_copy']:5.1f}% copy | torch " + (f"{r['torch_us']:9.1f} us x{r['x_torch']:.2f}"
                                                          if "torch_us" in r else r.get("torch_error", "")),
                  flush=True)
            del w
            torch.cuda.empty_cache()
    return rows


def main(shapes=((8192, 8192), (65536, 4096), (4096, 14336), (16, 4096)), kinds=("f32", "bf16")) -> list:
    """Copy bandwidth, skuforge fake_quantize(+mask bits) / fake_quantize_backward per channel (axis 0)
    and per tensor and fake_quantize_backward_from_mask, against PyTorch's cachemask forward, the
    recomputed-mask composite, ``dy * mask`` and the public ``torch.fake_quantize_per_channel_affine``;
    one table."""
    import torch

    from runtime.registry import default_registry
    reg = default_registry()
    rows = []
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(1, 255)
    dst = torch.empty_like(big)
    ms = _time(lambda: dst.copy_(big), batches=10, per=3)
    copy = 2 * big.numel() / (ms * 1e-3) / 1e9
    big = dst = None       # 2 GiB given back before the runs
    print(f"device copy: {copy:.0f} GB/s")
    cells = [(kind, scope, shape, op) for kind in kinds for scope in ("channel", "tensor") for shape in shapes
             for op in ("fake_quantize", "fake_quantize_backward")]
    cells += [(kind, None, shape, "fake_quantize_backward_from_mask") for kind in kinds for shape in shapes]
    for kind, scope, shape, op in cells:
        sku = reg.select(category="quantization", op=op, scope=scope, mode=None if scope is None else "asymmetric",
                         element=kind, aux_element=kind)
        sets = [make(sku, shape) for _ in range(1 if math.prod(shape) > 1 << 22 else 8)]
        k = [0]

        def ours():
            sets[k[0] % len(sets)]["call"]()
            k[0] += 1

        def theirs():
            w = sets[k[0] % len(sets)]
            w["torch_fn"](*w["torch_args"])
            k[0] += 1
        t_ours, t_torch = _time(ours), _time(theirs)
        w = sets[0]
        r = {"op": op, "kind": kind, "scope": scope, "shape": shape, "us": t_ours * 1e3,
             "gbps": w["bytes"] / (t_ours * 1e-3) / 1e9, "torch_us": t_torch * 1e3}
        r["pct_copy"] = 100 * r["gbps"] / copy
        r["x_torch"] = t_torch / t_ours
        if op == "fake_quantize" and scope == "channel":
            x, s, z = w["torch_args"][0], w["torch_args"][1], w["torch_args"][2]
            with torch.no_grad():
                r["public_us"] = _time(lambda: torch.fake_quantize_per_channel_affine(
                    x, s, z, CHANNEL_AXIS, QMIN, QMAX)) * 1e3
            r["x_public"] = r["public_us"] / r["us"]
        rows.append(r)
        print(f"{op:24s} {kind:4s} {scope or '-':7s} {str(shape):14s} {r['us']:9.1f} us {r['gbps']:6.0f} GB/s "
              f"{r['pct_copy']:5.1f}% copy | torch {r['torch_us']:9.1f} us x{r['x_torch']:.2f}"
              + (f" | torch.fake_quantize_per_channel_affine {r['public_us']:.1f} us x{r['x_public']:.2f}"
                 if "public_us" in r else ""), flush=True)
        sets = None
        torch.cuda.empty_cache()
    rows += _lsq_rows(reg, kinds, copy)
    return rows


if __name__ == "__main__":
    import json
    import os
    import sys
    host_profile()
    out = main()
    path = os.environ.get("OUT")
    if path:
        with open(os.path.join(path, "bench_training.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
    sys.exit(0)


def host_calls():
    """Repeated fake_quantize_learnable_backward on (16, 4096) bf16, per channel (axis 0, two
    launches: the segment pass and the finish pass), and the two one-launch backward passes of
    fake_quantize (the mask recomputed from x, and from its bits), default settings, CuPy and torch
    inputs."""
    import cupy as cp
    import ml_dtypes

    import runtime as sf
    rows, cols = 16, 4096
    data = {"cupy": dict(x=(cp.random.standard_normal((rows, cols), dtype=cp.float32) * 3).astype(ml_dtypes.bfloat16),
                         s=cp.random.random(rows, dtype=cp.float32) * 0.03 + 0.02,
                         z=cp.random.randint(-20, 21, rows).astype(cp.int32))}
    data["cupy"]["dy"] = data["cupy"]["x"].copy()
    torch = _torch()
    if torch is not None:
        data["torch"] = dict(x=torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16),
                             dy=torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16),
                             s=torch.rand(rows, device="cuda") * 0.03 + 0.02,
                             z=torch.randint(-20, 21, (rows,), device="cuda", dtype=torch.int32))
    for d in data.values():
        d["bits"] = sf.fake_quantize(d["x"], 0.03, scope="tensor", return_mask="bits")[1]

    def call(d):
        return sf.fake_quantize_learnable_backward(d["dy"], d["x"], d["s"], d["z"], scope="channel", axis=0)

    def recompute(d):
        return sf.fake_quantize_backward(d["dy"], d["x"], d["s"], d["z"], scope="channel", axis=0)

    def from_mask(d):
        return sf.fake_quantize_backward_from_mask(d["dy"], d["bits"])
    label = f"fake_quantize_learnable_backward channel bf16 ({rows}, {cols})"
    # the backward from the mask's bits costs no more host time than the one that recomputes the mask
    one = [(f"fake_quantize_backward channel bf16 ({rows}, {cols})", recompute),
           (f"fake_quantize_backward_from_mask bf16 ({rows}, {cols})", from_mask)]
    return ([{"label": f"{label}, {fw}, default settings", "framework": fw, "launches": 2, "call": lambda d=d: call(d)}
             for fw, d in data.items()]
            + [{"label": f"{label}, {fw}, default settings, results kept", "framework": fw, "launches": 2,
                "call": kept_results(call, d)} for fw, d in data.items()]
            + [{"label": f"{name}, {fw}, default settings", "framework": fw, "launches": 1,
                "call": lambda d=d, fn=fn: fn(d)} for name, fn in one for fw, d in data.items()])
