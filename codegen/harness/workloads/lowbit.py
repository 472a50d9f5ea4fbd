"""Bench workloads of the low-bit dynamic quantization (docs/lowbit.md), for ``codegen.harness.bench``.

The targets: dynamic per-group(128) bf16 -> fp8_e4m3 and bf16 -> s4, >= 95 % of a device copy
from 4096 x 7168 up, side by side with ``torch.compile`` of the eager composite; at the latency
shapes, fp8 at or under SGLang's per-token-group kernel on an H100 (``TARGET_US``). Every
low-bit ``dynamic_quantize`` SKU is handled (``--all``); the default subset is those two (both
arches for fp8: sm80 = software conversion, sm89 = ``cvt`` instructions; each SKU runs itself
through ``runtime.quantization.lowbit.prefer_arch``).

Inputs: x ~ 3·N(0, 1) in the input dtype (never zeros). Bytes (docs/audit.md): x read once + q written
once (fp8 one byte, int4 half a byte per element) + scales written once (and zero points).
The composites are docs/numerics.md in eager PyTorch (upcast, per-group amax, eps floor, ``1 / scale``,
fp8: clamp to ±max then the RNE cast; int4: round half to even, clamp, pack two per byte), pure
functions so ``torch.compile`` compiles each once. q comes back as its uint8 bytes on both sides,
so ``codegen.harness.bench`` counts the elements where they differ.
"""
from __future__ import annotations

import math

from runtime import kinds

from .base import random_input

OPS = ("dynamic_quantize",)
GROUP_SIZE = 128
SHAPES = ((65536, 4096), (8192, 8192), (4096, 7168), (128, 7168), (16, 4096))
QUICK_SHAPES = ((65536, 4096), (16, 4096))
FP8_SOFTWARE = "sm80"                   # arch of the fp8 kernels with software conversion (no fp8 cvt before sm_89)


# SGLang's sgl-kernel per_token_group_quant_8bit (v2), group 128, bf16 -> fp8_e4m3, kernel time on an
# H100 80GB HBM3, rebuilt from its sources: the fastest public kernel at the latency shapes
PEER_US = {(16, 4096): 4.77, (128, 7168): 5.95}


def TARGET_US(sku, shape):
    """(µs, source) at the latency shapes for the group-128 fp8 kernel with the conversion instructions."""
    if sku.scope == "group" and sku.aux_element == "fp8_e4m3" and sku.arch != FP8_SOFTWARE and shape in PEER_US:
        return PEER_US[shape], "SGLang per_token_group_quant_8bit v2 on an H100 80GB HBM3"
    return None


def TARGET_PCT(sku):
    """The target, 95% of copy, for the kernels that have one (fp8 with the hardware conversion,
    packed int4); the sm80 software-conversion fp8 kernels are the fallback of GPUs without fp8
    instructions, instruction-bound by design, and carry no target (docs/lowbit.md)."""
    if sku.aux_element in kinds.FP8 or sku.element in kinds.FP8:
        return None if sku.arch == FP8_SOFTWARE else 95.0
    return 95.0


def handles(sku) -> bool:
    """Low-bit dynamic_quantize, and low-bit static quantize / dequantize (no composite: ``--all`` only)."""
    return sku.op in OPS + ("quantize", "dequantize") and bool({sku.element, sku.aux_element} & set(kinds.LOW_BIT))


def default(sku) -> bool:
    return (sku.op == "dynamic_quantize" and sku.element == "bf16" and sku.aux_element in ("fp8_e4m3", "s4") and sku.scope == "group"
            and sku.mode == "symmetric")


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


def fp8_composite(x, group: int, fp8_max: float, eps: float, fp8_dtype):
    """Dynamic fp8 per group (docs/numerics.md): (q bytes, scale)."""
    import torch
    xm = (x if x.dtype == torch.float64 else x.float()).unflatten(-1, (-1, group))
    scale = xm.abs().amax(-1, keepdim=True).clamp(min=eps) / fp8_max
    q = (xm * (1.0 / scale)).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return q.flatten(-2).view(torch.uint8), scale.squeeze(-1)


def int4_composite(x, group: int, qmin: int, qmax: int, zc: int, eps: float):
    """Dynamic symmetric int4 per group (docs/numerics.md), packed two per byte (2i low nibble): (q bytes, scale)."""
    import torch
    xm = (x if x.dtype == torch.float64 else x.float()).unflatten(-1, (-1, group))
    scale = xm.abs().amax(-1, keepdim=True).clamp(min=eps) / (qmax - zc)
    v = (torch.round(torch.nan_to_num(xm * (1.0 / scale))) + zc).clamp(qmin, qmax).to(torch.int32).flatten(-2)
    packed = (v[..., 0::2] & 0xF) | ((v[..., 1::2] & 0xF) << 4)
    return packed.to(torch.uint8), scale.squeeze(-1)


def _params(sku, shape):
    from runtime.scopes import param_shape
    axis = -1 if sku.scope == "channel" else None
    gs = GROUP_SIZE if sku.scope == "group" else None
    return axis, gs, param_shape(shape, sku.scope, None if axis is None else axis % len(shape), gs)


def expected_bytes(sku, shape) -> int:
    """Bytes of one call (docs/audit.md): x (or q) read once, q (or y) written once (int4: half a byte per
    element), scales (and zero points) once."""
    _, _, pshape = _params(sku, shape)
    n = math.prod(shape)
    fkind, qkind = (sku.aux_element, sku.element) if sku.op == "dequantize" else (sku.element, sku.aux_element)
    q_bytes = n // kinds.kind(qkind).pack
    per_param = (8 if fkind == "f64" else 4) + (4 if sku.mode == "asymmetric" else 0)
    return n * kinds.SIZE[fkind] + q_bytes + math.prod(pshape) * per_param


def make(sku, shape):
    """A workload dict for ``codegen.harness.bench`` (``None`` for SKUs this module does not handle)."""
    if not handles(sku):
        return None
    import runtime as sf
    from runtime.quantization import lowbit
    from runtime.reference import dynamic_range
    from runtime.scopes import implied_zero_point

    if sku.op != "dynamic_quantize":
        return _static(sku, shape)
    torch = _torch()
    axis, gs, _ = _params(sku, shape)
    x = random_input(sku.element, shape)
    kw = dict(scope=sku.scope, mode=sku.mode, axis=axis, group_size=gs, out_dtype=sku.aux_element)
    fp8 = sku.aux_element in kinds.FP8

    def call():
        with lowbit.prefer_arch(sku.arch_number):
            q, s, zp = sf.dynamic_quantize(x, **kw)
        if fp8 and torch is not None and isinstance(q, torch.Tensor):
            q = q.view(torch.uint8)        # bytes, as the composite returns them (a view: no copy)
        return q, s

    where = {"tensor": "", "channel": " axis=-1", "token": "", "group": f" g{GROUP_SIZE}"}[sku.scope]
    w = {"call": call, "bytes": expected_bytes(sku, shape),
         "label": f"dyn {sku.element}->{sku.aux_element} {sku.scope}{where} {sku.mode[:4]} {sku.arch}"}
    if torch is not None and sku.scope in ("token", "group") and sku.mode == "symmetric":
        group = gs or shape[-1]
        if fp8:
            from runtime.arrays import torch_dtype
            w["torch_fn"] = fp8_composite
            w["torch_args"] = (x, group, kinds.kind(sku.aux_element).max, 1e-8, torch_dtype(sku.aux_element))
        else:
            qmin, qmax, _ = dynamic_range(sku.aux_element, "symmetric")
            w["torch_fn"] = int4_composite
            w["torch_args"] = (x, group, qmin, qmax, implied_zero_point(sku.aux_element), 1e-8)
    return w


def _static(sku, shape):
    """Low-bit quantize / dequantize on random data with scales in [0.5, 1.5) (no PyTorch composite)."""
    import runtime as sf
    from runtime.quantization import lowbit

    import cupy as cp
    axis, gs, pshape = _params(sku, shape)
    fkind, qkind = (sku.aux_element, sku.element) if sku.op == "dequantize" else (sku.element, sku.aux_element)
    mdt = cp.float64 if fkind == "f64" else cp.float32
    scale = cp.random.random(pshape, dtype=mdt) + 0.5
    zp = None
    if sku.mode == "asymmetric":
        lo, hi = kinds.QRANGE[qkind]
        zp = cp.random.randint(lo, hi + 1, pshape, dtype=cp.int32)
    kw = dict(scope=sku.scope, axis=axis, group_size=gs)
    if sku.op == "quantize":
        x = _float_input(sku.element, shape)

        def call():
            with lowbit.prefer_arch(sku.arch_number):
                return sf.quantize(x, scale, zp, out_dtype=qkind, **kw)
    else:
        cshape = lowbit.packed_shape(shape, qkind)
        q = cp.random.randint(0, 256, cshape, dtype=cp.int32).astype(cp.uint8)
        if qkind in kinds.FP8:
            q[(q & 0x7F) >= (0x7F if qkind == "fp8_e4m3" else 0x7C)] = 0x38   # finite codes only

        def call():
            with lowbit.prefer_arch(sku.arch_number):
                return sf.dequantize(q, scale, zp, in_dtype=qkind, out_dtype=fkind, **kw)
    where = {"tensor": "", "channel": " axis=-1", "token": "", "group": f" g{GROUP_SIZE}"}[sku.scope]
    return {"call": call, "bytes": expected_bytes(sku, shape),
            "label": f"{sku.element}->{sku.aux_element} {sku.scope}{where} {sku.mode[:4]} {sku.arch}"}


def _float_input(kind, shape):
    torch = _torch()
    if torch is not None:
        from runtime.arrays import torch_dtype
        return (torch.randn(shape, device="cuda", dtype=torch.float32) * 3).to(torch_dtype(kind))
    import cupy as cp

    from runtime.arrays import numpy_dtype
    return (cp.random.standard_normal(shape, dtype=cp.float32) * 3).astype(numpy_dtype(kind))
