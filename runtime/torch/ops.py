"""Custom ops (``torch.ops.skuforge.*``), their fake implementations and autograd formulas.

Forward and backward are skuforge kernels launched on PyTorch's current stream:

| op | forward | gradients |
|---|---|---|
| ``fake_quantize`` | ``runtime.fake_quantize`` | x: ``runtime.fake_quantize_backward`` (mask recomputed from x) |
| ``fake_quantize_learnable`` | ``runtime.fake_quantize`` with the zero point rounded | x, scale, zero point: ``runtime.fake_quantize_learnable_backward`` (LSQ, deterministic sums) |
| ``dequantize`` | ``runtime.dequantize`` | scale: ``sum(dy * (q - zp))`` per scale element (PyTorch ops); q is an integer tensor and gets none |

(No ``from __future__ import annotations`` here: ``custom_op`` reads the annotations.)
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

import runtime as sf
from runtime.arrays import kind_of, torch_dtype
from runtime.scopes import implied_zero_point

DEFAULT_QMIN, DEFAULT_QMAX = -128, 127


def _math_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _scale_for(x: Tensor, scale: Tensor) -> Tensor:
    """The scale in x's math precision (float32, float64 for float64 x), contiguous."""
    return scale.to(_math_dtype(x)).contiguous()


def _round_zero_point(zero_point: Optional[Tensor], qmin: int, qmax: int) -> Optional[Tensor]:
    """A learnable (float) zero point as the int32 the kernels use: round half to even, clamp
    (PyTorch's per-channel learnable ops do the same)."""
    if zero_point is None:
        return None
    z = torch.round(zero_point) if zero_point.is_floating_point() else zero_point
    return z.clamp(qmin, qmax).to(torch.int32).contiguous()


def _dense_like(x: Tensor, dtype=None) -> Tensor:
    return torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)


# -- fake_quantize (static scale / zero point) ---------------------------------------------------
@torch.library.custom_op("skuforge::fake_quantize", mutates_args=(), device_types="cuda")
def _fake_quantize(x: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str, axis: Optional[int],
                   group_size: Optional[int], qmin: int, qmax: int) -> Tensor:
    return sf.fake_quantize(x, scale, zero_point, scope=scope, axis=axis, group_size=group_size, qmin=qmin,
                            qmax=qmax)


@_fake_quantize.register_fake
def _(x, scale, zero_point, scope, axis, group_size, qmin, qmax):
    return _dense_like(x)


@torch.library.custom_op("skuforge::fake_quantize_backward", mutates_args=(), device_types="cuda")
def _fake_quantize_backward(dy: Tensor, x: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str,
                            axis: Optional[int], group_size: Optional[int], qmin: int, qmax: int) -> Tensor:
    return sf.fake_quantize_backward(dy, x, scale, zero_point, scope=scope, axis=axis, group_size=group_size,
                                     qmin=qmin, qmax=qmax)


@_fake_quantize_backward.register_fake
def _(dy, x, scale, zero_point, scope, axis, group_size, qmin, qmax):
    return _dense_like(x)


def _fq_setup(ctx, inputs, output):
    x, scale, zero_point, scope, axis, group_size, qmin, qmax = inputs
    ctx.save_for_backward(x, scale, zero_point)
    ctx.cfg = (scope, axis, group_size, qmin, qmax)


def _fq_backward(ctx, grad):
    x, scale, zero_point = ctx.saved_tensors
    dx = _fake_quantize_backward(grad.contiguous(), x, scale, zero_point, *ctx.cfg)
    return dx, None, None, None, None, None, None, None


_fake_quantize.register_autograd(_fq_backward, setup_context=_fq_setup)


# -- fake_quantize_learnable (LSQ) ----------------------------------------------------------------
@torch.library.custom_op("skuforge::fake_quantize_learnable", mutates_args=(), device_types="cuda")
def _fake_quantize_learnable(x: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str,
                             axis: Optional[int], group_size: Optional[int], qmin: int, qmax: int,
                             grad_factor: float) -> Tensor:
    return sf.fake_quantize(x, _scale_for(x, scale), _round_zero_point(zero_point, qmin, qmax), scope=scope,
                            axis=axis, group_size=group_size, qmin=qmin, qmax=qmax)


@_fake_quantize_learnable.register_fake
def _(x, scale, zero_point, scope, axis, group_size, qmin, qmax, grad_factor):
    return _dense_like(x)


@torch.library.custom_op("skuforge::fake_quantize_learnable_backward", mutates_args=(), device_types="cuda")
def _fake_quantize_learnable_backward(dy: Tensor, x: Tensor, scale: Tensor, zero_point: Optional[Tensor],
                                      scope: str, axis: Optional[int], group_size: Optional[int], qmin: int,
                                      qmax: int, grad_factor: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(dx, dscale in the scale's math dtype, dzero_point float32; an empty tensor when symmetric)."""
    dx, ds, dz = sf.fake_quantize_learnable_backward(dy, x, scale, zero_point, scope=scope, axis=axis,
                                                     group_size=group_size, qmin=qmin, qmax=qmax,
                                                     grad_factor=grad_factor)
    if dz is None:
        dz = torch.empty((0,), dtype=torch.float32, device=x.device)
    return dx, ds, dz


@_fake_quantize_learnable_backward.register_fake
def _(dy, x, scale, zero_point, scope, axis, group_size, qmin, qmax, grad_factor):
    dz_shape = (0,) if zero_point is None else zero_point.shape
    return (_dense_like(x), torch.empty(scale.shape, dtype=scale.dtype, device=x.device),
            torch.empty(dz_shape, dtype=torch.float32, device=x.device))


def _lfq_setup(ctx, inputs, output):
    x, scale, zero_point, scope, axis, group_size, qmin, qmax, grad_factor = inputs
    ctx.save_for_backward(x, scale, zero_point)
    ctx.cfg = (scope, axis, group_size, qmin, qmax, grad_factor)


def _lfq_backward(ctx, grad):
    x, scale, zero_point = ctx.saved_tensors
    scope, axis, group_size, qmin, qmax, g = ctx.cfg
    dx, ds, dz = _fake_quantize_learnable_backward(grad.contiguous(), x, _scale_for(x, scale),
                                                   _round_zero_point(zero_point, qmin, qmax), scope, axis,
                                                   group_size, qmin, qmax, g)
    dzp = None
    if zero_point is not None and zero_point.is_floating_point():
        dzp = dz.to(zero_point.dtype)
    return dx, ds.to(scale.dtype), dzp, None, None, None, None, None, None


_fake_quantize_learnable.register_autograd(_lfq_backward, setup_context=_lfq_setup)


# -- dequantize ---------------------------------------------------------------------------------
@torch.library.custom_op("skuforge::dequantize", mutates_args=(), device_types="cuda")
def _dequantize(q: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str, axis: Optional[int],
                group_size: Optional[int], out_dtype: str) -> Tensor:
    return sf.dequantize(q, scale, zero_point, scope=scope, axis=axis, group_size=group_size, out_dtype=out_dtype)


@_dequantize.register_fake
def _(q, scale, zero_point, scope, axis, group_size, out_dtype):
    return torch.empty(q.shape, dtype=getattr(torch, out_dtype), device=q.device)


def _per_element(p: Tensor, shape, scope: str, axis: Optional[int], group_size: Optional[int]) -> Tensor:
    """A per-scope parameter broadcastable against x (group scope: against x viewed as (..., G, gs))."""
    nd = len(shape)
    if scope == "tensor":
        return p.reshape(())
    if scope == "channel":
        a = axis % nd
        return p.reshape([1] * a + [shape[a]] + [1] * (nd - a - 1))
    if scope == "token":
        return p.reshape(tuple(shape[:-1]) + (1,))
    return p.reshape(tuple(shape[:-1]) + (shape[-1] // group_size, 1))


def _sum_per_scale(t: Tensor, scope: str, axis: Optional[int], group_size: Optional[int], out_shape) -> Tensor:
    nd = t.dim() - (1 if scope == "group" else 0)
    if scope == "tensor":
        s = t.sum()
    elif scope == "channel":
        a = axis % nd
        s = t.sum(dim=[i for i in range(nd) if i != a])
    else:
        s = t.sum(dim=-1)
    return s.reshape(out_shape)


def _dq_setup(ctx, inputs, output):
    q, scale, zero_point, scope, axis, group_size, out_dtype = inputs
    ctx.save_for_backward(q, scale, zero_point)
    ctx.cfg = (scope, axis, group_size)


def _dq_backward(ctx, grad):
    q, scale, zero_point = ctx.saved_tensors
    scope, axis, group_size = ctx.cfg
    m = torch.float64 if scale.dtype == torch.float64 else torch.float32
    shape = tuple(q.shape)
    qm = q.to(m)
    gm = grad.to(m)
    if scope == "group":
        qm = qm.reshape(shape[:-1] + (shape[-1] // group_size, group_size))
        gm = gm.reshape(qm.shape)
    if zero_point is None:
        zp = torch.tensor(float(implied_zero_point(kind_of(q.dtype))), dtype=m, device=q.device)
    else:
        zp = _per_element(zero_point.to(m), shape, scope, axis, group_size)
    ds = _sum_per_scale(gm * (qm - zp), scope, axis, group_size, scale.shape)
    return None, ds.to(scale.dtype), None, None, None, None, None


_dequantize.register_autograd(_dq_backward, setup_context=_dq_setup)


# -- the public functions -----------------------------------------------------------------------
def _scale_tensor(scale, x: Tensor) -> Tensor:
    if isinstance(scale, Tensor):
        return scale
    return torch.tensor(float(scale), dtype=_math_dtype(x), device=x.device)


def fake_quantize(x: Tensor, scale, zero_point: Optional[Tensor] = None, *, scope: str, axis: Optional[int] = None,
                  group_size: Optional[int] = None, qmin: int = DEFAULT_QMIN, qmax: int = DEFAULT_QMAX) -> Tensor:
    """Fake quantization with a fixed scale / zero point (int32); gradient to x only (STE with mask)."""
    return _fake_quantize(x, _scale_for(x, _scale_tensor(scale, x)), zero_point, scope, axis, group_size, qmin, qmax)


def lsq_grad_factor(x: Tensor, scale: Tensor, qmax: int) -> float:
    """LSQ's recommended gradient scale ``1 / sqrt(elements per scale element * qmax)``."""
    per = max(1, x.numel() // max(1, scale.numel()))
    return 1.0 / math.sqrt(per * max(1, qmax))


def fake_quantize_learnable(x: Tensor, scale: Tensor, zero_point: Optional[Tensor] = None, *, scope: str,
                            axis: Optional[int] = None, group_size: Optional[int] = None, qmin: int = DEFAULT_QMIN,
                            qmax: int = DEFAULT_QMAX, grad_factor: Optional[float] = None) -> Tensor:
    """LSQ fake quantization: gradients to x, scale and (a floating-point) zero point.

    ``zero_point`` is rounded half to even and clamped to [qmin, qmax] in the forward and the
    backward; ``grad_factor=None`` uses :func:`lsq_grad_factor`. qmin <= 0 <= qmax."""
    g = lsq_grad_factor(x, scale, qmax) if grad_factor is None else float(grad_factor)
    return _fake_quantize_learnable(x, scale, zero_point, scope, axis, group_size, qmin, qmax, g)


def dequantize(q: Tensor, scale: Tensor, zero_point: Optional[Tensor] = None, *, scope: str,
               axis: Optional[int] = None, group_size: Optional[int] = None, out_dtype="float32") -> Tensor:
    """``(q - zp) * scale``; differentiable with respect to ``scale`` (e.g. tuning the scales of a
    quantized model), not q (an integer tensor)."""
    name = str(torch_dtype(kind_of(out_dtype, "out_dtype"))).replace("torch.", "")
    return _dequantize(q, _scale_tensor(scale, q), zero_point, scope, axis, group_size, name)


# -- modules -------------------------------------------------------------------------------------
class FakeQuantize(torch.nn.Module):
    """Fake quantization with fixed (buffer) scale and zero point."""

    def __init__(self, scale: Tensor, zero_point: Optional[Tensor] = None, *, scope: str, axis=None,
                 group_size=None, qmin: int = DEFAULT_QMIN, qmax: int = DEFAULT_QMAX):
        super().__init__()
        self.register_buffer("scale", scale)
        self.register_buffer("zero_point", zero_point)
        self.cfg = dict(scope=scope, axis=axis, group_size=group_size, qmin=qmin, qmax=qmax)

    def forward(self, x: Tensor) -> Tensor:
        return fake_quantize(x, self.scale, self.zero_point, **self.cfg)


class LearnableFakeQuantize(torch.nn.Module):
    """LSQ: learnable scale and (asymmetric) zero point parameters, float32."""

    def __init__(self, scale: Tensor, zero_point: Optional[Tensor] = None, *, scope: str, axis=None,
                 group_size=None, qmin: int = DEFAULT_QMIN, qmax: int = DEFAULT_QMAX, grad_factor=None):
        super().__init__()
        self.scale = torch.nn.Parameter(scale.detach().clone().float())
        self.zero_point = None if zero_point is None else torch.nn.Parameter(zero_point.detach().clone().float())
        self.cfg = dict(scope=scope, axis=axis, group_size=group_size, qmin=qmin, qmax=qmax, grad_factor=grad_factor)

    def forward(self, x: Tensor) -> Tensor:
        return fake_quantize_learnable(x, self.scale, self.zero_point, **self.cfg)
