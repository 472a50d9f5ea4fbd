"""The arithmetic of the quantization ops' gradients in PyTorch: per-scale sums and broadcasts,
int4 unpacking, e8m0 scale values, and the facts parsed from dtype names that torch.compile
evaluates once while tracing (``assume_constant_result``) instead of tracing the parsing. Used by
the autograd formulas of runtime/torch/quantization.py."""
from typing import Optional

import torch
from torch import Tensor

from runtime import kinds
from runtime.arrays import kind_of
from runtime.quantization import lowbit
from runtime.scopes import check_range, implied_zero_point

from .meta import E8M0_DTYPE


def scale_values(scale: Tensor, m: torch.dtype) -> Tensor:
    """Scale values in the math dtype: float scales as they are, e8m0 codes c as 2^(c - 127), built
    from their float32 bits (exact; 2^-127 is the subnormal 0x00400000, code 255 NaN)."""
    if scale.dtype not in (torch.uint8, E8M0_DTYPE):
        return scale.to(m)
    c = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(c == 0, 0x00400000, torch.where(c == 255, 0x7FC00000, c << 23))
    return bits.view(torch.float32).to(m)


def expand(p: Tensor, shape, scope: str, axis: Optional[int], group_size: Optional[int]) -> Tensor:
    """A per-scope parameter broadcast to ``shape`` (x's logical shape)."""
    shape = tuple(shape)
    nd = len(shape)
    if scope == "tensor":
        return p.reshape(()).expand(shape)
    if scope == "channel":
        a = axis % nd
        return p.reshape([1] * a + [shape[a]] + [1] * (nd - a - 1)).expand(shape)
    if scope == "token":
        return p.reshape(shape[:-1] + (1,)).expand(shape)
    g = shape[-1] // group_size
    return p.reshape(shape[:-1] + (g, 1)).expand(shape[:-1] + (g, group_size)).reshape(shape)


def sum_per_scale(t: Tensor, scope: str, axis: Optional[int], group_size: Optional[int], out_shape) -> Tensor:
    """Sums of ``t`` (x's logical shape) per scale element, in the scale's shape."""
    shape = tuple(t.shape)
    nd = len(shape)
    if scope == "tensor":
        s = t.sum()
    elif scope == "channel":
        a = axis % nd
        s = t.sum(dim=[i for i in range(nd) if i != a])
    elif scope == "token":
        s = t.sum(dim=-1)
    else:
        s = t.reshape(shape[:-1] + (shape[-1] // group_size, group_size)).sum(dim=-1)
    return s.reshape(out_shape)


def unpack_int4(q: Tensor, signed: bool) -> Tensor:
    """A packed int4 container (uint8, element 2i in the low nibble) as int16 values (..., 2 * D/2)."""
    b = q.to(torch.int16)
    lo, hi = b & 15, (b >> 4) & 15
    if signed:
        lo, hi = lo - ((lo & 8) << 1), hi - ((hi & 8) << 1)
    return torch.stack([lo, hi], dim=-1).reshape(tuple(q.shape[:-1]) + (2 * q.shape[-1],))


# Facts parsed from dtype names: constants of constant arguments, which torch.compile evaluates once
# while tracing (assume_constant_result) instead of tracing the parsing.
@torch.compiler.assume_constant_result
def names_e8m0(scale_dtype) -> bool:
    """Whether ``scale_dtype`` names e8m0 scale codes."""
    return lowbit.is_e8m0(scale_dtype)


@torch.compiler.assume_constant_result
def dq_facts(q_dtype: torch.dtype, in_dtype, scale_dtype, s_dtype: torch.dtype) -> tuple:
    """dequantize's (code kind, whether the scales are e8m0 codes, the implied zero point)."""
    kind = kind_of(in_dtype, "in_dtype") if in_dtype is not None else kind_of(q_dtype, "q")
    e8m0 = lowbit.is_e8m0(scale_dtype) or s_dtype in (E8M0_DTYPE, torch.uint8)
    return kind, e8m0, 0 if kind in kinds.FP8 else implied_zero_point(kind)


@torch.compiler.assume_constant_result
def mask_facts(out_dtype, qmin, qmax) -> tuple:
    """quantize's clip mask for output kind ``out_dtype``: (fp8 max, None, None, None, 0) for fp8 codes;
    else (None, the quantize_backward ``out_dtype``, qmin, qmax, the zero point of ``zero_point=None``
    to pass explicitly, 0 where the kernel implies it): int4 through the int8 / uint8 kernel with
    int4's range and zero point."""
    qk = kind_of(out_dtype, "out_dtype")
    k = kinds.kind(qk)
    if k.max is not None:
        return k.max, None, None, None, 0
    if qk in kinds.INT4:
        qmin, qmax = check_range(qk, qmin, qmax)
        return None, "int8" if qk == "s4" else "uint8", qmin, qmax, implied_zero_point(qk)
    return None, out_dtype, qmin, qmax, 0


def dq_scale_grad(grad: Tensor, q: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str,
                   axis: Optional[int], group_size: Optional[int], kind: str, implied_zp: int) -> Tensor:
    """``sum(dy * (q - zp))`` per scale element, in the scale's dtype (int4 codes unpacked)."""
    m = scale.dtype
    qm = (unpack_int4(q, kind == "s4") if kind in kinds.INT4 else q).to(m)
    if zero_point is None:
        zp = torch.full((), float(implied_zp), dtype=m, device=q.device)
    else:
        zp = expand(zero_point.to(m), qm.shape, scope, axis, group_size)
    return sum_per_scale(grad.to(m) * (qm - zp), scope, axis, group_size, scale.shape).to(m)
