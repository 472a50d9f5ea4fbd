"""Bench workloads of dynamic_quantize (docs/dynamic.md), for ``codegen.harness.bench``.

Inputs: x ~ 3·N(0, 1) in the input dtype (never zeros), on the current torch device (CuPy
when torch is missing). Scope parameters: group size 128; channel per column (``axis=-1``).
Bytes (docs/audit.md): x read once + q written once + scales (and zero points) written once; the
per-tensor / per-channel paths read x twice by design (reduce, then quantize), which shows up
as a lower % of copy, not as more counted bytes.

The PyTorch composite is docs/numerics.md's rule written with eager ops (upcast, amax or amin/amax including
0, eps floor, ``1 / scale``, round half to even, NaN -> zero point, clamp, cast) as a pure
function, so ``torch.compile`` compiles it once per dtype and shape. (Torch's amax propagates
NaN where skuforge ignores it; on the bench's finite data both agree.)
"""
from __future__ import annotations

import math

from .base import random_input

OPS = ("dynamic_quantize",)
GROUP_SIZE = 128
CHANNEL_AXIS = -1
# % of copy: single-pass token / group 95, the two-pass scopes (a reduction, then the quantize) 75
TARGETS_BY_SCOPE = {"token": 95.0, "group": 95.0, "tensor": 75.0, "channel": 75.0}


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


def dynamic_composite(x, scope: str, group: int, symmetric: bool, qmin: int, qmax: int, zc: int, eps: float,
                      out_dtype):
    """PyTorch composite of dynamic_quantize (docs/numerics.md); returns (q, scale, zero_point or None)."""
    import torch
    xm = x if x.dtype == torch.float64 else x.float()
    if group:
        xm = xm.unflatten(-1, (-1, group))
    if scope in ("token", "group"):
        dims = (-1,)
    elif scope == "channel":                      # axis = -1: reduce over every other axis
        dims = tuple(range(xm.ndim - 1))
    else:
        dims = tuple(range(xm.ndim))
    # Divide by 0-d tensors, not Python numbers: eager CUDA division by a Python scalar multiplies
    # by its reciprocal (one rounding more), which is not the rounding of docs/numerics.md and moves scales by an ulp.
    span = torch.tensor(float(qmax - zc), dtype=xm.dtype, device=xm.device)
    if symmetric:
        amax = xm.abs().amax(dim=dims, keepdim=True)
        scale = amax.clamp(min=eps) / span
        zp = None
        zpv = zc
    else:
        mn = xm.amin(dim=dims, keepdim=True).clamp(max=0)
        mx = xm.amax(dim=dims, keepdim=True).clamp(min=0)
        scale = ((mx - mn) / torch.tensor(float(qmax - qmin), dtype=xm.dtype, device=xm.device)).clamp(min=eps)
        zpv = (qmin - torch.round(mn / scale)).clamp(qmin, qmax)
        zp = zpv.to(torch.int32)
    inv = 1.0 / scale
    v = torch.round(torch.nan_to_num(xm * inv, nan=0.0)) + zpv
    q = v.clamp(qmin, qmax).to(out_dtype)
    if group:
        q = q.flatten(-2)
    return q, scale.squeeze(dims), None if zp is None else zp.squeeze(dims)


def _params(sku, shape):
    from runtime.scopes import param_shape
    axis = CHANNEL_AXIS if sku.scope == "channel" else None
    gs = GROUP_SIZE if sku.scope == "group" else None
    return axis, gs, param_shape(shape, sku.scope, None if axis is None else axis % len(shape), gs)


def expected_bytes(sku, shape) -> int:
    """Bytes of one call (docs/audit.md): x read once, q written once, scales (and zero points) written once."""
    from runtime import kinds
    _, _, pshape = _params(sku, shape)
    per_param = (8 if sku.element == "f64" else 4) + (4 if sku.mode == "asymmetric" else 0)
    return math.prod(shape) * (kinds.SIZE[sku.element] + kinds.SIZE[sku.aux_element]) + math.prod(pshape) * per_param


def make(sku, shape):
    """A workload dict for ``codegen.harness.bench`` (``None`` for other ops): call, bytes, label, the
    torch composite (``torch_fn`` + ``torch_args``) and ``torch_eager`` / ``torch_inputs``."""
    if sku.op not in OPS:
        return None
    import runtime as sf
    from runtime.reference import dynamic_range
    from runtime.scopes import implied_zero_point

    torch = _torch()
    axis, gs, _ = _params(sku, shape)
    x = random_input(sku.element, shape)
    kw = dict(scope=sku.scope, mode=sku.mode, axis=axis, group_size=gs, out_dtype=sku.aux_element)

    def call():
        return sf.dynamic_quantize(x, **kw)

    where = {"tensor": "", "channel": " axis=-1", "token": "", "group": f" g{GROUP_SIZE}"}[sku.scope]
    w = {"call": call, "bytes": expected_bytes(sku, shape),
         "label": f"dyn {sku.element}->{sku.aux_element} {sku.scope}{where} {sku.mode[:4]}",
         "torch_eager": None, "torch_inputs": None}
    if torch is not None:
        from runtime.arrays import torch_dtype
        qmin, qmax, _ = dynamic_range(sku.aux_element, sku.mode)
        zc = implied_zero_point(sku.aux_element) if sku.mode == "symmetric" else 0
        args = (x, sku.scope, gs or 0, sku.mode == "symmetric", qmin, qmax, zc, 1e-8, torch_dtype(sku.aux_element))
        w["torch_fn"] = dynamic_composite
        w["torch_args"] = args
        w["torch_inputs"] = args
        w["torch_eager"] = lambda a=args: dynamic_composite(*a)
    return w


def host_calls():
    """Repeated functional calls on (16, 4096) bf16, default settings, CuPy and torch inputs:
    per token -> s8, fp8 group(128), MX (fp8 with e8m0 scales, group 32)."""
    import cupy as cp
    import ml_dtypes

    import runtime as sf
    xs = {"cupy": (cp.random.standard_normal((16, 4096), dtype=cp.float32) * 3).astype(ml_dtypes.bfloat16)}
    torch = _torch()
    if torch is not None:
        xs["torch"] = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16) * 3
    calls = (("dynamic_quantize token bf16->s8", dict(scope="token")),
             ("dynamic_quantize group(128) bf16->fp8_e4m3", dict(scope="group", group_size=128, out_dtype="fp8_e4m3")),
             ("dynamic_quantize MX bf16->fp8_e4m3 + e8m0", dict(scope="group", group_size=32, out_dtype="fp8_e4m3",
                                                                scale_dtype="e8m0")))
    out = []
    for fw, x in xs.items():
        for name, kw in calls:
            out.append({"label": f"{name} (16, 4096), {fw}, default settings", "framework": fw,
                        "call": lambda x=x, kw=kw: sf.dynamic_quantize(x, **kw)})
    return out
