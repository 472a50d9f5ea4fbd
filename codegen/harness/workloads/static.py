"""Bench workloads of the static quantize / dequantize family (see ``codegen.harness.bench``).

Inputs are random (never all zeros): x ~ 3·N(0, 1) in the input dtype, scales in
[0.5, 1.5), zero points in [-20, 20] (s8) / [100, 150] (u8). Scope parameters: channel is
per column (``axis=-1``: every element needs its own scale, the harder access pattern),
group size 128. The PyTorch composite is the same math as docs/numerics.md (upcast, multiply by
``1 / scale``, round half to even, add the zero point, NaN → zero point, clamp, cast), as a
pure function so that ``torch.compile`` compiles it once per dtype and shape. The skuforge
call is the default one: its kernels check the scale and zero-point values as they load them.
"""
from __future__ import annotations

import math

from .base import nbytes

OPS = ("quantize", "dequantize")
GROUP_SIZE = 128
CHANNEL_AXIS = -1


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


def quantize_composite(x, scale, zp, zp_const: int, qmin: int, qmax: int, group: int, out_dtype):
    """PyTorch composite of quantize (docs/numerics.md); ``scale``/``zp`` already broadcastable (group: per group)."""
    import torch
    xm = x if x.dtype == torch.float64 else x.float()
    inv = 1.0 / scale                               # once per scale element
    if group:
        xm = xm.unflatten(-1, (-1, group))
        inv = inv.unsqueeze(-1)
        zp = None if zp is None else zp.unsqueeze(-1)
    v = torch.round(torch.nan_to_num(xm * inv, nan=0.0))   # NaN -> zero point after the add
    v = v + (zp if zp is not None else zp_const)
    q = v.clamp(qmin, qmax).to(out_dtype)
    return q.flatten(-2) if group else q


def dequantize_composite(q, scale, zp, zp_const: int, group: int, out_dtype):
    """PyTorch composite of dequantize (docs/numerics.md): ``(q - zp) * scale`` in the math precision, one rounding."""
    import torch
    qm = q.to(torch.float64 if out_dtype == torch.float64 else torch.float32)
    if group:
        qm = qm.unflatten(-1, (-1, group))
        scale = scale.unsqueeze(-1)
        zp = None if zp is None else zp.unsqueeze(-1)
    qm = qm - (zp if zp is not None else zp_const)
    y = (qm * scale).to(out_dtype)
    return y.flatten(-2) if group else y


def _params(sku, shape):
    scope = sku.scope
    axis = CHANNEL_AXIS if scope == "channel" else None
    gs = GROUP_SIZE if scope == "group" else None
    from runtime.scopes import param_shape
    pshape = param_shape(shape, scope, None if axis is None else axis % len(shape), gs)
    return axis, gs, pshape


def _bview(p, scope, shape):
    """A scope parameter viewed for broadcasting against x (group: against x.unflatten(-1, (G, gs)))."""
    if p is None or scope in ("tensor", "group"):
        return p
    if scope == "token":
        return p.unsqueeze(-1)
    return p  # channel, axis=-1: (cols,) broadcasts as is


def expected_bytes(sku, shape) -> int:
    """Bytes of one call (docs/audit.md): x read once, the output written once, scales (and zero points) read once."""
    from runtime import kinds
    n = math.prod(shape)
    _, _, pshape = _params(sku, shape)
    fkind = sku.element if sku.op == "quantize" else sku.aux_element
    per_param = kinds.SIZE["f64" if fkind == "f64" else "f32"] + (4 if sku.mode == "asymmetric" else 0)
    return n * (kinds.SIZE[sku.element] + kinds.SIZE[sku.aux_element]) + math.prod(pshape) * per_param


def make(sku, shape):
    """A workload dict for ``codegen.harness.bench`` (``None`` for SKUs that are not static quantize/dequantize)."""
    if sku.op not in OPS or sku.scope is None:
        return None
    import runtime as sf
    from runtime.scopes import implied_zero_point

    from runtime import kinds

    torch = _torch()
    axis, gs, pshape = _params(sku, shape)
    fkind = sku.element if sku.op == "quantize" else sku.aux_element
    qkind = sku.aux_element if sku.op == "quantize" else sku.element
    lo, hi = kinds.QRANGE[qkind]
    zlo, zhi = (-20, 20) if lo < 0 else (100, 150)
    if torch is not None:
        from runtime.arrays import torch_dtype
        dev = torch.device("cuda", torch.cuda.current_device())
        mdt = torch.float64 if fkind == "f64" else torch.float32
        scale = torch.rand(pshape, device=dev, dtype=mdt) + 0.5
        zp = torch.randint(zlo, zhi + 1, pshape, device=dev, dtype=torch.int32) if sku.mode == "asymmetric" else None
        if sku.op == "quantize":
            x = (torch.randn(shape, device=dev, dtype=mdt) * 3).to(torch_dtype(fkind))
        else:
            x = torch.randint(lo, hi + 1, shape, device=dev, dtype=torch.int32).to(torch_dtype(qkind))
    else:
        import cupy as cp
        from runtime.arrays import numpy_dtype
        mdt = cp.float64 if fkind == "f64" else cp.float32
        scale = (cp.random.random(pshape, dtype=mdt) + 0.5).astype(mdt)
        zp = cp.random.randint(zlo, zhi + 1, pshape, dtype=cp.int32) if sku.mode == "asymmetric" else None
        if sku.op == "quantize":
            x = (cp.random.standard_normal(shape, dtype=cp.float32) * 3).astype(numpy_dtype(fkind))
        else:
            x = cp.random.randint(lo, hi + 1, shape, dtype=cp.int32).astype(numpy_dtype(qkind))
    out_bytes = math.prod(shape) * kinds.SIZE[sku.aux_element]      # the output, written once
    kw = dict(scope=sku.scope, axis=axis, group_size=gs)
    if sku.op == "quantize":
        def call():
            return sf.quantize(x, scale, zp, out_dtype=qkind, **kw)
    else:
        def call():
            return sf.dequantize(x, scale, zp, out_dtype=fkind, **kw)
    where = {"tensor": "", "channel": " axis=-1", "token": "", "group": f" g{GROUP_SIZE}"}[sku.scope]
    w = {"call": call, "bytes": nbytes(x, scale, zp) + out_bytes,
         "label": f"{sku.element}->{sku.aux_element} {sku.scope}{where} {sku.mode[:4]}"}
    if torch is not None:
        from runtime.arrays import torch_dtype
        zc = 0 if zp is not None else implied_zero_point(qkind)
        sb, zb = _bview(scale, sku.scope, shape), _bview(zp, sku.scope, shape)
        if sku.op == "quantize":
            w["torch_fn"] = quantize_composite
            w["torch_args"] = (x, sb, zb, zc, lo, hi, gs or 0, torch_dtype(qkind))
        else:
            w["torch_fn"] = dequantize_composite
            w["torch_args"] = (x, sb, zb, zc, gs or 0, torch_dtype(fkind))
    return w


def host_calls():
    """Repeated functional calls on (16, 4096) bf16 -> s8, per token, CuPy and torch inputs,
    with default settings (the kernels check the device values: no sync)."""
    import cupy as cp
    import ml_dtypes

    import runtime as sf
    out = []
    xs = {"cupy": (cp.random.standard_normal((16, 4096), dtype=cp.float32) * 3).astype(ml_dtypes.bfloat16)}
    ss = {"cupy": cp.random.random(16, dtype=cp.float32) + 0.5}
    torch = _torch()
    if torch is not None:
        xs["torch"] = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16) * 3
        ss["torch"] = torch.rand(16, device="cuda") + 0.5
    for fw in xs:
        x, s = xs[fw], ss[fw]

        def call(x=x, s=s):
            return sf.quantize(x, s, scope="token", out_dtype="int8")
        out.append({"label": f"quantize token bf16->s8 (16, 4096), {fw}, default settings",
                    "framework": fw, "call": call})
    return out
