"""The quantization family's torch ops (``torch.ops.skuforge.*``), their autograd formulas and the
public functions of ``runtime.torch``.

The ops, their schemas, fake implementations and ``.out`` overloads come from the family's
signatures (runtime/quantization/signatures.py) through runtime/torch/library.py; what is here is
particular to an op: a result the schema spells as an empty tensor, the ``.out`` overloads that
write several outputs, the autograd formulas. Every function written against a signature names
its parameters as the signature does (checked when the op is defined). See docs/torch.md.

| op | autograd |
|---|---|
| ``quantize`` | none: the codes are non-differentiable; :func:`quantize` -> :func:`dequantize` is the straight-through estimator to x |
| ``dequantize`` | scale: ``sum(dy * (q - zp))`` per scale element; q: an fp8 leaf only (``dequantize_backward``) |
| ``fake_quantize`` | x: ``fake_quantize_backward`` (mask recomputed from x: the op saves x) |
| ``fake_quantize_with_mask`` | x: ``fake_quantize_backward_from_mask`` of the bits it returns (``dy * mask`` for a bool mask): the op saves only its mask; :func:`fake_quantize` takes this op when x needs a gradient |
| ``fake_quantize_learnable`` | x, scale, zero point: ``fake_quantize_learnable_backward`` (LSQ) |
"""
import math
from typing import Optional

import torch
from torch import Tensor

from runtime import quantization as sf
from runtime import kinds
from runtime.arrays import kind_of, torch_dtype
from runtime.errors import InvalidProblemError
from runtime.quantization import lowbit
from runtime.quantization.signatures import (DEFAULT_QMAX, DEFAULT_QMIN, DEQUANTIZE, DEQUANTIZE_BACKWARD,
                                             DYNAMIC_QUANTIZE, FAKE_QUANTIZE, FAKE_QUANTIZE_BACKWARD,
                                             FAKE_QUANTIZE_BACKWARD_FROM_MASK, FAKE_QUANTIZE_LEARNABLE,
                                             FAKE_QUANTIZE_LEARNABLE_BACKWARD, FAKE_QUANTIZE_WITH_MASK, QUANTIZE,
                                             QUANTIZE_BACKWARD)

from . import meta
from .gradients import dq_facts, dq_scale_grad, expand, mask_facts, scale_values
from .library import TorchOp, call, call_out, define, dtype_name, grad_on, grads, named, new, public
from .meta import E8M0_DTYPE

_compiling = torch.compiler.is_compiling


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


# -- quantize, dequantize ---------------------------------------------------------------------------
_quantize = define(TorchOp(QUANTIZE, sf.quantize))
_dequantize = define(TorchOp(DEQUANTIZE, sf.dequantize))


def _q_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output)


def _q_backward(ctx, grad):
    return grads(QUANTIZE)


# Codes carry no gradient (integer tensors cannot, and an fp8 one would round it to fp8): q is marked
# non-differentiable. quantize's gradient reaches x through dequantize (:func:`quantize`, :func:`dequantize`).
_quantize.register_autograd(_q_backward, setup_context=_q_setup)



def _dq_setup(ctx, inputs, output):
    a = named(DEQUANTIZE, inputs)
    ctx.save_for_backward(a["q"], a["scale"], a["zero_point"])
    ctx.cfg = (a["scope"], a["axis"], a["group_size"], a["in_dtype"], a["scale_dtype"])


def _dq_backward(ctx, grad):
    """scale (float): :func:`_dq_scale_grad`; fp8 q: ``dequantize_backward`` in q's dtype (a q that
    requires a gradient is an fp8 leaf: what runtime.torch.quantize returns does not); e8m0 codes
    are integers and take none."""
    q, scale, zero_point = ctx.saved_tensors
    scope, axis, group_size, in_dtype, scale_dtype = ctx.cfg
    kind, e8m0, implied_zp = dq_facts(q.dtype, in_dtype, scale_dtype, scale.dtype)
    if e8m0:
        return grads(DEQUANTIZE)
    dq = ds = None
    if ctx.needs_input_grad[1]:
        ds = dq_scale_grad(grad, q, scale, zero_point, scope, axis, group_size, kind, implied_zp)
    if ctx.needs_input_grad[0] and kind in kinds.FP8 and q.is_floating_point():
        dq = call(_dequantize_backward, grad.contiguous(), scale, scope, axis, group_size).to(q.dtype)
    return grads(DEQUANTIZE, q=dq, scale=ds)


_dequantize.register_autograd(_dq_backward, setup_context=_dq_setup)


# -- quantize -> dequantize: the straight-through estimator ------------------------------------------
# The gradient of x through quantize and then dequantize is ``dy * mask`` in x's dtype, never rounded
# to a code's dtype on the way. Codes cannot carry it (an integer tensor takes no gradient, an fp8 one
# would round it to fp8), so the link goes around them: when x needs a gradient, runtime.torch's
# quantize attaches to the codes it returns a *surrogate* -- a float tensor of x's shape and dtype
# (a broadcast zero, no memory) whose backward is quantize's, ``dx = g * mask`` (_QuantizeSTE) --
# and runtime.torch's dequantize, given those codes, computes y as usual in a node whose backward
# passes dy to the surrogate unchanged (cast to x's dtype) and the scale gradient to the scale as
# dequantize always does (_DequantizeSTE). The composition is exactly dy * mask (docs/training.md).
_STE = "_skuforge_ste"      # the codes' attribute: (surrogate, the codes' version counter when made)


def _ste_dx(g: Tensor, x: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str, axis: Optional[int],
            group_size: Optional[int], out_dtype: str, qmin: Optional[int], qmax: Optional[int]) -> Tensor:
    """quantize's straight-through gradient ``dx = g * mask`` in x's dtype (a product, as
    quantize_backward's): integer codes ``qmin <= rne(x * inv) + zp <= qmax`` (the quantize_backward
    kernel), fp8 ``|x * inv| <= fp8_max`` (not saturated), ``inv = 1 / scale`` in the math precision."""
    dy = g.to(x.dtype).contiguous()
    fp8_max, kernel_dtype, qmin, qmax, implied_zp = mask_facts(out_dtype, qmin, qmax)
    if fp8_max is not None:
        m = _math_dtype(x)
        inv = expand(torch.reciprocal(scale_values(scale, m)), x.shape, scope, axis, group_size)
        return dy * ((x.to(m) * inv).abs() <= fp8_max)
    if zero_point is None and implied_zp:
        zero_point = torch.full(tuple(scale.shape), implied_zp, dtype=torch.int32, device=x.device)
    return call(_quantize_backward, dy, x, scale, zero_point, scope, axis, group_size, kernel_dtype, qmin, qmax)


class _QuantizeSTE(torch.autograd.Function):
    """quantize's surrogate: a broadcast zero of x's shape and dtype; its gradient g gives
    ``dx = g * mask`` (:func:`_ste_dx`)."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, cfg):
        ctx.save_for_backward(x, scale, zero_point)
        ctx.cfg = cfg
        return x.new_zeros(()).expand(x.shape)

    @staticmethod
    def backward(ctx, g):
        x, scale, zero_point = ctx.saved_tensors
        return _ste_dx(g, x, scale, zero_point, *ctx.cfg), None, None, None


class _DequantizeSTE(torch.autograd.Function):
    """dequantize of codes that carry a surrogate: y as the op computes it; dy passes to the
    surrogate unchanged (in its dtype, x's) and to a float scale as ``_dq_scale_grad``."""

    @staticmethod
    def forward(ctx, surrogate, q, scale, zero_point, cfg):
        ctx.save_for_backward(q, scale, zero_point)
        ctx.cfg, ctx.dtype = cfg, surrogate.dtype
        return call(_dequantize, q, scale, zero_point, *cfg)

    @staticmethod
    def backward(ctx, g):
        q, scale, zero_point = ctx.saved_tensors
        scope, axis, group_size, _out_dtype, in_dtype, scale_dtype = ctx.cfg
        kind, e8m0, implied_zp = dq_facts(q.dtype, in_dtype, scale_dtype, scale.dtype)
        ds = None
        if ctx.needs_input_grad[2] and not e8m0:
            ds = dq_scale_grad(g, q, scale, zero_point, scope, axis, group_size, kind, implied_zp)
        return g.to(ctx.dtype), None, ds, None, None


def _link(q: Tensor, surrogate: Tensor) -> None:
    """Attach ``surrogate`` to the codes ``q`` with their version counter (not under torch.compile,
    where it is not a Python number)."""
    setattr(q, _STE, (surrogate, None if _compiling() else q._version))


def _surrogate(q: Tensor) -> Optional[Tensor]:
    """The surrogate that quantize attached to codes ``q``, unless q was written in place since
    (by a PyTorch op or a ``.out`` overload: they bump its version counter)."""
    link = getattr(q, _STE, None)
    if link is None or (link[1] is not None and link[1] != q._version):
        return None
    return link[0]


# -- dynamic_quantize ---------------------------------------------------------------------------
def _dynamic_quantize_direct(x, scope, range_mode, axis, group_size, out_dtype, qmin, qmax, eps, scale_dtype):
    """``(q, scale, zero_point or None)``; e8m0 scales a ``torch.float8_e8m0fnu`` tensor (uint8
    where torch has no such dtype)."""
    q, s, z = sf.dynamic_quantize(x, scope=scope, mode=range_mode, axis=axis, group_size=group_size,
                                  out_dtype=out_dtype, qmin=qmin, qmax=qmax, eps=eps, scale_dtype=scale_dtype)
    if s.dtype != E8M0_DTYPE and lowbit.is_e8m0(scale_dtype):
        s = s.view(E8M0_DTYPE)
    return q, s, z


def _dynamic_quantize_out(x, scope, range_mode, axis, group_size, out_dtype, qmin, qmax, eps, scale_dtype, *, q, scale,
                          zero_point=None):
    if scale.dtype == E8M0_DTYPE != torch.uint8:
        scale = scale.view(torch.uint8)         # the functional API writes e8m0 codes into uint8
    outs = (q, scale) if zero_point is None else (q, scale, zero_point)
    sf.dynamic_quantize(x, scope=scope, mode=range_mode, axis=axis, group_size=group_size, out_dtype=out_dtype,
                        qmin=qmin, qmax=qmax, eps=eps, scale_dtype=scale_dtype, out=outs)


def _dynamic_quantize_out_fake(x, scope, range_mode, axis, group_size, out_dtype, qmin, qmax, eps, scale_dtype, *, q,
                               scale, zero_point=None):
    if range_mode == "asymmetric" and zero_point is None:
        raise InvalidProblemError("out: asymmetric mode returns a zero point; pass out=(q, scale, zero_point)")
    if range_mode != "asymmetric" and zero_point is not None:
        raise InvalidProblemError(f"out: mode={range_mode!r} has no zero-point output; pass out=(q, scale)")
    qs, ss, zs = meta.dynamic_quantize_spec(x, scope, range_mode, axis, group_size, out_dtype, qmin, qmax, eps,
                                            scale_dtype)
    meta.same_device(x=x, q=q, scale=scale, zero_point=zero_point)
    meta.check_out(q, qs, "out[0] (q)")
    meta.check_dense_out(scale, ss, "out[1] (scale)")            # the kernels write parameters in C order
    if zero_point is not None:
        meta.check_dense_out(zero_point, zs, "out[2] (zero_point)")


_dynamic_quantize = define(TorchOp(DYNAMIC_QUANTIZE, direct=_dynamic_quantize_direct, empties=(None, None, torch.int32),
                                   out_impl=_dynamic_quantize_out, out_fake=_dynamic_quantize_out_fake))

# -- straight-through backward ops -----------------------------------------------------------------
_quantize_backward = define(TorchOp(QUANTIZE_BACKWARD, sf.quantize_backward))
_dequantize_backward = define(TorchOp(DEQUANTIZE_BACKWARD, sf.dequantize_backward))


# -- fake_quantize (static scale / zero point) ---------------------------------------------------
_fake_quantize = define(TorchOp(FAKE_QUANTIZE, sf.fake_quantize))
_fake_quantize_backward = define(TorchOp(FAKE_QUANTIZE_BACKWARD, sf.fake_quantize_backward))


def _fq_setup(ctx, inputs, output):
    a = named(FAKE_QUANTIZE, inputs)
    ctx.save_for_backward(a["x"], a["scale"], a["zero_point"])
    ctx.cfg = (a["scope"], a["axis"], a["group_size"], a["qmin"], a["qmax"])


def _fq_backward(ctx, grad):
    x, scale, zero_point = ctx.saved_tensors
    return grads(FAKE_QUANTIZE, x=call(_fake_quantize_backward, grad.contiguous(), x, scale, zero_point, *ctx.cfg))


_fake_quantize.register_autograd(_fq_backward, setup_context=_fq_setup)


# -- fake_quantize with its mask: the training forward --------------------------------------------
def _fqm_direct(x, scale, zero_point, scope, axis, group_size, qmin, qmax, mask, *, out=None):
    """``(y, mask)``: the bool mask (``mask="bool"``, x's shape) or its bits (``"bits"``, uint8
    ``x.shape[:-1] + (ceil(D / 8),)``), written with y by one kernel."""
    return sf.fake_quantize(x, scale, zero_point, scope=scope, axis=axis, group_size=group_size, qmin=qmin,
                            qmax=qmax, return_mask=meta.return_mask_of(mask), out=out)


def _fqm_out(x, scale, zero_point, scope, axis, group_size, qmin, qmax, mask, *, out):
    """y into ``out``; returns the mask (a new tensor)."""
    return _fqm_direct(x, scale, zero_point, scope, axis, group_size, qmin, qmax, mask, out=out)[1]


def _fqm_out_fake(x, scale, zero_point, scope, axis, group_size, qmin, qmax, mask, *, out):
    ys, ms = meta.fake_quantize_with_mask_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax, mask)
    meta.same_device(x=x, out=out)
    meta.check_out(out, ys, "out")
    return new(ms, x.device)


_fake_quantize_with_mask = define(TorchOp(FAKE_QUANTIZE_WITH_MASK, direct=_fqm_direct, out_impl=_fqm_out,
                                          out_fake=_fqm_out_fake))


def _fqm_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1])            # the mask only: 1/8 byte an element as bits, not x
    ctx.bits = named(FAKE_QUANTIZE_WITH_MASK, inputs)["mask"] == "bits"


def _fqm_backward(ctx, grad, _grad_mask):
    mask, = ctx.saved_tensors
    if ctx.bits:
        dx = call(_fake_quantize_backward_from_mask, grad.contiguous(), mask)
    else:
        dx = grad * mask                        # a product, as the kernel's: -0 and NaN where masked
    return grads(FAKE_QUANTIZE_WITH_MASK, x=dx)


_fake_quantize_with_mask.register_autograd(_fqm_backward, setup_context=_fqm_setup)
_fake_quantize_backward_from_mask = define(TorchOp(FAKE_QUANTIZE_BACKWARD_FROM_MASK,
                                                   sf.fake_quantize_backward_from_mask))


# -- fake_quantize_learnable (LSQ) ----------------------------------------------------------------
def _lfq_direct(x, scale, zero_point, scope, axis, group_size, qmin, qmax, grad_factor):
    return sf.fake_quantize(x, _scale_for(x, scale), _round_zero_point(zero_point, qmin, qmax), scope=scope,
                            axis=axis, group_size=group_size, qmin=qmin, qmax=qmax)


_fake_quantize_learnable = define(TorchOp(FAKE_QUANTIZE_LEARNABLE, direct=_lfq_direct))


def _lfq_backward_out(dy, x, scale, zero_point, scope, axis, group_size, qmin, qmax, grad_factor, *, out):
    """dx into ``out``; returns (dscale, dzero_point; an empty tensor when symmetric)."""
    _, ds, dz = sf.fake_quantize_learnable_backward(dy, x, scale, zero_point, scope=scope, axis=axis,
                                                    group_size=group_size, qmin=qmin, qmax=qmax,
                                                    grad_factor=grad_factor, out=out)
    return ds, (torch.empty((0,), dtype=torch.float32, device=x.device) if dz is None else dz)


def _lfq_backward_out_fake(dy, x, scale, zero_point, scope, axis, group_size, qmin, qmax, grad_factor, *, out):
    dx, ds, dz = meta.fake_quantize_learnable_backward_spec(dy, x, scale, zero_point, scope, axis, group_size, qmin,
                                                            qmax, grad_factor)
    meta.same_device(x=x, out=out)
    meta.check_out(out, dx, "out")
    return new(ds, x.device), new(dz, x.device)


_fake_quantize_learnable_backward = define(TorchOp(
    FAKE_QUANTIZE_LEARNABLE_BACKWARD, sf.fake_quantize_learnable_backward, empties=(None, None, torch.float32),
    out_impl=_lfq_backward_out, out_fake=_lfq_backward_out_fake))


def _lfq_setup(ctx, inputs, output):
    a = named(FAKE_QUANTIZE_LEARNABLE, inputs)
    ctx.save_for_backward(a["x"], a["scale"], a["zero_point"])
    ctx.cfg = (a["scope"], a["axis"], a["group_size"], a["qmin"], a["qmax"], a["grad_factor"])


def _lfq_backward(ctx, grad):
    x, scale, zero_point = ctx.saved_tensors
    scope, axis, group_size, qmin, qmax, g = ctx.cfg
    dx, ds, dz = call(_fake_quantize_learnable_backward, grad.contiguous(), x, _scale_for(x, scale),
                      _round_zero_point(zero_point, qmin, qmax), scope, axis, group_size, qmin, qmax, g)
    dzp = None
    if zero_point is not None and zero_point.is_floating_point():
        dzp = dz.to(zero_point.dtype)
    return grads(FAKE_QUANTIZE_LEARNABLE, x=dx, scale=ds.to(scale.dtype), zero_point=dzp)


_fake_quantize_learnable.register_autograd(_lfq_backward, setup_context=_lfq_setup)


# -- the public functions -----------------------------------------------------------------------
def _scale_tensor(scale, like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A Python scale (tensor scope) as a 0-d tensor on like's device (a fill kernel, no host copy)
    of ``dtype`` (None: like's math dtype)."""
    if isinstance(scale, Tensor):
        return scale
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise InvalidProblemError(f"scale has type {type(scale).__name__}; a tensor or (scope='tensor') a number "
                                  "is needed")
    s = float(scale)
    if not (math.isfinite(s) and s > 0):
        raise InvalidProblemError(f"scale={scale!r}; scales must be positive and finite")
    return torch.full((), s, dtype=_math_dtype(like) if dtype is None else dtype, device=like.device)


def _zp_tensor(zero_point, like: Tensor) -> Optional[Tensor]:
    if zero_point is None or isinstance(zero_point, Tensor):
        return zero_point
    if not isinstance(zero_point, int) or isinstance(zero_point, bool):
        raise InvalidProblemError(f"zero_point has type {type(zero_point).__name__}; an int32 tensor or "
                                  "(scope='tensor') an integer is needed")
    return torch.full((), zero_point, dtype=torch.int32, device=like.device)


def _float_scale_dtype(kind_name: str) -> torch.dtype:
    return torch.float64 if kind_of(kind_name, "dtype") == "f64" else torch.float32


_FLOAT_OUTS: dict = {}      # a dequantize out_dtype argument -> (the schema's dtype name, a Python scale's dtype)


@torch.compiler.assume_constant_result
def _float_out(out_dtype) -> tuple:
    """dequantize's ``out_dtype`` (a name or a torch dtype) as the torch dtype name its schema
    carries, and the dtype of a Python scale for it."""
    try:
        return _FLOAT_OUTS[out_dtype]
    except (KeyError, TypeError):
        pass
    name = str(torch_dtype(kind_of(dtype_name(out_dtype), "out_dtype"))).replace("torch.", "")
    got = _FLOAT_OUTS[out_dtype] = (name, _float_scale_dtype(name))   # a valid argument: hashable
    return got


def _quantize_public(x, scale, zero_point, scope, axis, group_size, out_dtype, qmin, qmax, scale_dtype, out):
    """``torch.ops.skuforge.quantize`` (``.out`` with ``out=``): runtime.quantize on torch tensors;
    fp8 outputs are torch fp8 tensors, int4 packed uint8 (..., D/2). The codes carry no gradient;
    when x needs one, :func:`dequantize` of these codes is the straight-through estimator,
    ``x.grad = dy * mask`` (the codes hold its surrogate; docs/training.md)."""
    s = _scale_tensor(scale, x)
    z = _zp_tensor(zero_point, x)
    args = (x, s, z, scope, axis, group_size, dtype_name(out_dtype), qmin, qmax, dtype_name(scale_dtype))
    if out is None:
        q = call(_quantize, *args)
    else:
        call_out("quantize", args, out=out)
        q = out
    if grad_on() and x.requires_grad:
        _link(q, _QuantizeSTE.apply(x, s, z, (scope, axis, group_size, args[6], qmin, qmax)))
    return q


quantize = public(QUANTIZE, _quantize_public)


def _dequantize_public(q, scale, zero_point, scope, axis, group_size, out_dtype, in_dtype, scale_dtype, out):
    """``(q - zp) * scale``; differentiable with respect to a float ``scale`` (e.g. tuning the scales of
    a quantized model) and, for an fp8 leaf q, to q (``dequantize_backward``); integer q gets none.
    Codes from :func:`quantize` of an x that needs a gradient: the straight-through estimator,
    ``x.grad = dy * mask`` in x's dtype (docs/training.md)."""
    name, scale_dt = _float_out(out_dtype)
    s = _scale_tensor(scale, q, scale_dt)
    args = (q, s, _zp_tensor(zero_point, q), scope, axis, group_size, name, dtype_name(in_dtype),
            dtype_name(scale_dtype))
    if out is None:
        surrogate = _surrogate(q) if grad_on() else None
        if surrogate is not None:
            return _DequantizeSTE.apply(surrogate, q, s, args[2], args[3:])
        return call(_dequantize, *args)
    call_out("dequantize", args, out=out)
    return out


dequantize = public(DEQUANTIZE, _dequantize_public)


def _dynamic_quantize_public(x, scope, mode, axis, group_size, out_dtype, qmin, qmax, eps, scale_dtype, out):
    """``(q, scale, zero_point)`` as runtime.dynamic_quantize (zero_point None when symmetric; e8m0
    scales as ``torch.float8_e8m0fnu``). ``out=(q, scale[, zero_point])``: s8/u8 with float scales."""
    args = (x, scope, mode, axis, group_size, dtype_name(out_dtype), qmin, qmax, float(eps),
            dtype_name(scale_dtype))
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
            raise InvalidProblemError(f"out={type(out).__name__}: expected a tuple (q, scale) or (q, scale, "
                                      "zero_point)")
        zp = out[2] if len(out) == 3 else None
        call_out("dynamic_quantize", args, q=out[0], scale=out[1], zero_point=zp)
        return out[0], out[1], zp
    q, s, z = call(_dynamic_quantize, *args)
    return q, s, (z if mode == "asymmetric" else None)


dynamic_quantize = public(DYNAMIC_QUANTIZE, _dynamic_quantize_public)


def _quantize_backward_public(dy, x, scale, zero_point, scope, axis, group_size, out_dtype, qmin, qmax, out):
    """``dx = dy * (qmin <= rne(x / scale) + zp <= qmax)`` (runtime.quantize_backward)."""
    args = (dy, x, _scale_tensor(scale, x), _zp_tensor(zero_point, x), scope, axis, group_size,
            dtype_name(out_dtype), qmin, qmax)
    if out is None:
        return call(_quantize_backward, *args)
    call_out("quantize_backward", args, out=out)
    return out


quantize_backward = public(QUANTIZE_BACKWARD, _quantize_backward_public)


def _dequantize_backward_public(dy, scale, scope, axis, group_size, out):
    """``dq = dy * scale`` (runtime.dequantize_backward)."""
    args = (dy, _scale_tensor(scale, dy), scope, axis, group_size)
    if out is None:
        return call(_dequantize_backward, *args)
    call_out("dequantize_backward", args, out=out)
    return out


dequantize_backward = public(DEQUANTIZE_BACKWARD, _dequantize_backward_public)


def _fake_quantize_public(x, scale, zero_point, scope, axis, group_size, qmin, qmax, out):
    """Fake quantization with a fixed scale / zero point (int32); gradient to x only (STE with mask).
    When x needs a gradient the forward also writes the mask's bits (``fake_quantize_with_mask``),
    the one thing autograd keeps for the backward (``fake_quantize_backward_from_mask``); ``out=``
    (the ``.out`` overload) records no gradient."""
    args = (x, _scale_for(x, _scale_tensor(scale, x)), _zp_tensor(zero_point, x), scope, axis,
            group_size, qmin, qmax)
    if out is not None:
        call_out("fake_quantize", args, out=out)
        return out
    if grad_on() and x.requires_grad:
        return call(_fake_quantize_with_mask, *args, "bits")[0]
    return call(_fake_quantize, *args)


fake_quantize = public(FAKE_QUANTIZE, _fake_quantize_public, omit=('return_mask',))


def _fake_quantize_backward_from_mask_public(dy, mask, out):
    """``dx = dy * bit`` with the bits of ``runtime.fake_quantize(..., return_mask="bits")``
    (runtime.fake_quantize_backward_from_mask)."""
    if out is None:
        return call(_fake_quantize_backward_from_mask, dy, mask)
    call_out("fake_quantize_backward_from_mask", (dy, mask), out=out)
    return out


fake_quantize_backward_from_mask = public(FAKE_QUANTIZE_BACKWARD_FROM_MASK, _fake_quantize_backward_from_mask_public)


def _fake_quantize_backward_public(dy, x, scale, zero_point, scope, axis, group_size, qmin, qmax, out):
    """``dx = dy * mask`` (runtime.fake_quantize_backward)."""
    args = (dy, x, _scale_tensor(scale, x), _zp_tensor(zero_point, x), scope, axis, group_size,
            qmin, qmax)
    if out is None:
        return call(_fake_quantize_backward, *args)
    call_out("fake_quantize_backward", args, out=out)
    return out


fake_quantize_backward = public(FAKE_QUANTIZE_BACKWARD, _fake_quantize_backward_public)


def lsq_grad_factor(x: Tensor, scale: Tensor, qmax: int) -> float:
    """LSQ's recommended gradient scale ``1 / sqrt(elements per scale element * qmax)``."""
    per = max(1, x.numel() // max(1, scale.numel()))
    return 1.0 / math.sqrt(per * max(1, qmax))


def _fake_quantize_learnable_public(x, scale, zero_point, scope, axis, group_size, qmin, qmax, grad_factor):
    """LSQ fake quantization: gradients to x, scale and (a floating-point) zero point.

    ``zero_point`` is rounded half to even and clamped to [qmin, qmax] in the forward and the
    backward; ``grad_factor=None`` uses :func:`lsq_grad_factor`. qmin <= 0 <= qmax."""
    g = lsq_grad_factor(x, scale, qmax) if grad_factor is None else float(grad_factor)
    return call(_fake_quantize_learnable, x, scale, zero_point, scope, axis, group_size, qmin, qmax, g)


fake_quantize_learnable = public(FAKE_QUANTIZE_LEARNABLE, _fake_quantize_learnable_public, defaults={"grad_factor": None})


def _fake_quantize_learnable_backward_public(dy, x, scale, zero_point, scope, axis, group_size, qmin, qmax, grad_factor, out):
    """``(dx, dscale, dzero_point)`` (runtime.fake_quantize_learnable_backward; dzero_point None when
    symmetric); ``out=``: dx written into it (the ``.out`` overload) and returned."""
    args = (dy, x, _scale_tensor(scale, x), _zp_tensor(zero_point, x), scope, axis, group_size, qmin, qmax,
            float(grad_factor))
    if out is None:
        dx, ds, dz = call(_fake_quantize_learnable_backward, *args)
    else:
        dx, (ds, dz) = out, call_out("fake_quantize_learnable_backward", args, out=out)
    return dx, ds, (None if zero_point is None else dz)


fake_quantize_learnable_backward = public(FAKE_QUANTIZE_LEARNABLE_BACKWARD, _fake_quantize_learnable_backward_public, omit=('_max_blocks',))


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


