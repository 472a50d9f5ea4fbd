"""Custom ops (``torch.ops.skuforge.*``), their fake implementations and autograd formulas.

Every functional op is a ``torch.library`` custom op; each launches the skuforge kernels of the
functional API (runtime/__init__.py) on PyTorch's current stream, allocates its outputs with
torch (the caching allocator: CUDA-graph safe) and never synchronizes the host. Fake
implementations (runtime/torch/meta.py) give exact shapes, dtypes and strides and raise the
functional API's typed errors for invalid arguments. See docs/torch.md for the table.
The public functions call an op's CUDA implementation directly where the dispatcher would do
nothing else: plain CUDA tensors, no gradient to record, nothing tracing (``_plain``; docs/torch.md
"The direct eager call").

| op | autograd |
|---|---|
| ``quantize`` | none: the codes are non-differentiable; :func:`quantize` -> :func:`dequantize` is the straight-through estimator to x |
| ``dequantize`` | scale: ``sum(dy * (q - zp))`` per scale element; q: an fp8 leaf only (``dequantize_backward``) |
| ``fake_quantize`` | x: ``fake_quantize_backward`` (mask recomputed from x: the op saves x) |
| ``fake_quantize_with_mask`` | x: ``fake_quantize_backward_from_mask`` of the bits it returns (``dy * mask`` for a bool mask): the op saves only its mask; :func:`fake_quantize` takes this op when x needs a gradient |
| ``fake_quantize_learnable`` | x, scale, zero point: ``fake_quantize_learnable_backward`` (LSQ) |
| ``grouped_matmul`` | x, w: ``grouped_matmul_backward`` (dw float32, cast to w's dtype) |

``.out`` overloads (``torch.ops.skuforge.quantize.out(..., out=t)``) exist where the functional API
takes ``out=``; they declare ``out`` mutated (``Tensor(a!)``), which is what ``torch.compile``
functionalizes, and return nothing (LSQ's backward: its new dscale, dzero_point).
runtime/torch/traced.py calls these ops for the functional API while torch traces it.

(No ``from __future__ import annotations`` here: ``custom_op`` reads the annotations.)
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

import runtime as sf
from runtime import kinds
from runtime.quantization import lowbit
from runtime.arrays import kind_of, torch_dtype
from runtime.errors import InvalidProblemError
from runtime.moe.grouped import _out_pair
from runtime.scopes import check_range, implied_zero_point

from . import meta
from .meta import E8M0_DTYPE

DEFAULT_QMIN, DEFAULT_QMAX = -128, 127
NAMESPACE = "skuforge"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")     # the .out overloads
_PT2 = (torch.Tag.pt2_compliant_tag,)


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


def _new(spec, device) -> Tensor:
    shape, dtype = spec
    return torch.empty(shape, dtype=dtype, device=device)


def _none_or_empty(t: Optional[Tensor], dtype, device) -> Tensor:
    """Schemas return Tensors, not Optional ones: an absent result is an empty (0,) tensor."""
    return torch.empty((0,), dtype=dtype, device=device) if t is None else t


def _define_out(name: str, outs: str, impl, fake, returns: str = "()") -> None:
    """``skuforge::<name>.out``: the functional schema of ``name`` plus kwarg-only mutated outputs
    ``outs`` (e.g. ``"Tensor(a!) out"``), returning nothing (or ``returns``: new tensors)."""
    schema = str(getattr(torch.ops.skuforge, name).default._schema)
    args = schema[schema.index("("):schema.rindex(") ->")]
    sep = ", *, " if "*" not in args else ", "
    _LIB.define(f"{name}.out{args}{sep}{outs}) -> {returns}", tags=_PT2)

    def cuda(*args, **outs):
        # the dispatcher bumps no version counter for an op defined this way: the implementation
        # does, so that autograd refuses a saved tensor that was overwritten (inference tensors
        # have no counter)
        result = impl(*args, **outs)
        _bump([t for t in outs.values() if t is not None and not t.is_inference()])
        return result
    _LIB.impl(f"{name}.out", cuda, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{name}.out", fake, lib=_LIB)
    _OUT[name] = (getattr(torch.ops.skuforge, name).out, cuda)


# -- the direct eager call ------------------------------------------------------------------------
# Through the dispatcher a custom op costs about 14-20 µs of Python per eager call on the H200
# machine (the autograd wrapper, the redispatch, the boxing of every argument) on top of the
# functional API's 8-11 µs (docs/torch.md). Where the dispatcher would do nothing but call the CUDA
# implementation -- plain CUDA tensors, no gradient to record, no tracing, mode, transform or
# profiler -- the public functions below call that implementation themselves: the same function,
# the same arguments, the same results and errors. Anything else goes through the dispatcher.
_IMPL: dict = {}        # custom op -> its CUDA implementation
_OUT: dict = {}         # op name -> (its .out overload, the overload's CUDA implementation)
_PLAIN_TYPES = (Tensor, torch.nn.Parameter)
_SCALARS = frozenset((str, int, float, bool, type(None)))
_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_transforms = torch._C._are_functorch_transforms_active
_profiling = torch._C._autograd._profiler_enabled
_grad_on = torch._C.is_grad_enabled
_bump = torch._C._increment_version


def _op(name: str, direct=None):
    """``torch.library.custom_op("skuforge::<name>")`` of the decorated CUDA implementation, which
    :func:`_call` may also call directly -- or call ``direct`` instead: the same computation
    returning None for a result the schema has to spell as an empty tensor (no allocation)."""
    def define(fn):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=(), device_types="cuda")
        _IMPL[op] = direct or fn
        return op
    return define


def _plain(args) -> bool:
    """Whether the dispatcher would only call the CUDA implementation on ``args``: no
    ``torch.compile`` / export tracing, no TorchDispatchMode or TorchFunctionMode, no functorch
    transform, no profiler, and every tensor a plain CUDA tensor (or Parameter) that needs no
    gradient (or grad mode off). Subclasses (FakeTensor, functional and traced tensors) say no."""
    if _compiling() or _dispatch_modes() or _function_modes() or _transforms() or _profiling():
        return False
    grad = _grad_on()
    for a in args:
        t = type(a)
        if t in _SCALARS:       # (isinstance against Tensor's metaclass costs ~0.4 µs an argument)
            continue
        if t in _PLAIN_TYPES:
            if not a.is_cuda or (grad and a.requires_grad):
                return False
        elif isinstance(a, Tensor):
            return False
    return True


def _call(op, *args):
    """``op(*args)``, or its CUDA implementation called directly where :func:`_plain` allows."""
    if _plain(args):
        return _IMPL[op](*args)
    return op(*args)


def _call_out(name: str, args: tuple, **outs):
    """``torch.ops.skuforge.<name>.out(*args, **outs)``, or its CUDA implementation (which bumps
    the written tensors' version counters) called directly where :func:`_plain` allows."""
    overload, impl = _OUT[name]
    if _plain((*args, *outs.values())):
        return impl(*args, **outs)
    return overload(*args, **outs)


# -- quantize -----------------------------------------------------------------------------------
@_op("quantize")
def _quantize(x: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str, axis: Optional[int] = None,
              group_size: Optional[int] = None, out_dtype: str = "int8", qmin: Optional[int] = None,
              qmax: Optional[int] = None, scale_dtype: Optional[str] = None) -> Tensor:
    return sf.quantize(x, scale, zero_point, scope=scope, axis=axis, group_size=group_size, out_dtype=out_dtype,
                       qmin=qmin, qmax=qmax, scale_dtype=scale_dtype)


@_quantize.register_fake
def _(x, scale, zero_point, scope, axis=None, group_size=None, out_dtype="int8", qmin=None, qmax=None,
      scale_dtype=None):
    return _new(meta.quantize_spec(x, scale, zero_point, scope, axis, group_size, out_dtype, qmin, qmax,
                                   scale_dtype), x.device)


def _quantize_out(x, scale, zero_point, scope, axis=None, group_size=None, out_dtype="int8", qmin=None, qmax=None,
                  scale_dtype=None, *, out):
    sf.quantize(x, scale, zero_point, scope=scope, axis=axis, group_size=group_size, out_dtype=out_dtype,
                qmin=qmin, qmax=qmax, scale_dtype=scale_dtype, out=out)


def _quantize_out_fake(x, scale, zero_point, scope, axis=None, group_size=None, out_dtype="int8", qmin=None,
                       qmax=None, scale_dtype=None, *, out):
    spec = meta.quantize_spec(x, scale, zero_point, scope, axis, group_size, out_dtype, qmin, qmax, scale_dtype)
    meta.same_device(x=x, out=out)
    meta.check_out(out, spec, "out")


_define_out("quantize", "Tensor(a!) out", _quantize_out, _quantize_out_fake)


def _scale_values(scale: Tensor, m: torch.dtype) -> Tensor:
    """Scale values in the math dtype: float scales as they are, e8m0 codes c as 2^(c - 127), built
    from their float32 bits (exact; 2^-127 is the subnormal 0x00400000, code 255 NaN)."""
    if scale.dtype not in (torch.uint8, E8M0_DTYPE):
        return scale.to(m)
    c = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(c == 0, 0x00400000, torch.where(c == 255, 0x7FC00000, c << 23))
    return bits.view(torch.float32).to(m)


def _expand(p: Tensor, shape, scope: str, axis: Optional[int], group_size: Optional[int]) -> Tensor:
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


def _q_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output)


def _q_backward(ctx, grad):
    return (None,) * 10


# Codes carry no gradient (integer tensors cannot, and an fp8 one would round it to fp8): q is marked
# non-differentiable. quantize's gradient reaches x through dequantize (:func:`quantize`, :func:`dequantize`).
_quantize.register_autograd(_q_backward, setup_context=_q_setup)


# -- dequantize ---------------------------------------------------------------------------------
@_op("dequantize")
def _dequantize(q: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str, axis: Optional[int] = None,
                group_size: Optional[int] = None, out_dtype: str = "float32", in_dtype: Optional[str] = None,
                scale_dtype: Optional[str] = None) -> Tensor:
    return sf.dequantize(q, scale, zero_point, scope=scope, axis=axis, group_size=group_size, out_dtype=out_dtype,
                         in_dtype=in_dtype, scale_dtype=scale_dtype)


@_dequantize.register_fake
def _(q, scale, zero_point, scope, axis=None, group_size=None, out_dtype="float32", in_dtype=None, scale_dtype=None):
    return _new(meta.dequantize_spec(q, scale, zero_point, scope, axis, group_size, out_dtype, in_dtype,
                                     scale_dtype), q.device)


def _dequantize_out(q, scale, zero_point, scope, axis=None, group_size=None, out_dtype="float32", in_dtype=None,
                    scale_dtype=None, *, out):
    sf.dequantize(q, scale, zero_point, scope=scope, axis=axis, group_size=group_size, out_dtype=out_dtype,
                  in_dtype=in_dtype, scale_dtype=scale_dtype, out=out)


def _dequantize_out_fake(q, scale, zero_point, scope, axis=None, group_size=None, out_dtype="float32", in_dtype=None,
                         scale_dtype=None, *, out):
    spec = meta.dequantize_spec(q, scale, zero_point, scope, axis, group_size, out_dtype, in_dtype, scale_dtype)
    meta.same_device(q=q, out=out)
    meta.check_out(out, spec, "out")


_define_out("dequantize", "Tensor(a!) out", _dequantize_out, _dequantize_out_fake)


def _sum_per_scale(t: Tensor, scope: str, axis: Optional[int], group_size: Optional[int], out_shape) -> Tensor:
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


def _unpack_int4(q: Tensor, signed: bool) -> Tensor:
    """A packed int4 container (uint8, element 2i in the low nibble) as int16 values (..., 2 * D/2)."""
    b = q.to(torch.int16)
    lo, hi = b & 15, (b >> 4) & 15
    if signed:
        lo, hi = lo - ((lo & 8) << 1), hi - ((hi & 8) << 1)
    return torch.stack([lo, hi], dim=-1).reshape(tuple(q.shape[:-1]) + (2 * q.shape[-1],))


# Facts parsed from dtype names: constants of constant arguments, which torch.compile evaluates once
# while tracing (assume_constant_result) instead of tracing the parsing.
@torch.compiler.assume_constant_result
def _e8m0(scale_dtype) -> bool:
    """Whether ``scale_dtype`` names e8m0 scale codes."""
    return lowbit.is_e8m0(scale_dtype)


@torch.compiler.assume_constant_result
def _dq_facts(q_dtype: torch.dtype, in_dtype, scale_dtype, s_dtype: torch.dtype) -> tuple:
    """dequantize's (code kind, whether the scales are e8m0 codes, the implied zero point)."""
    kind = kind_of(in_dtype, "in_dtype") if in_dtype is not None else kind_of(q_dtype, "q")
    e8m0 = lowbit.is_e8m0(scale_dtype) or s_dtype in (E8M0_DTYPE, torch.uint8)
    return kind, e8m0, 0 if kind in kinds.FP8 else implied_zero_point(kind)


@torch.compiler.assume_constant_result
def _mask_facts(out_dtype, qmin, qmax) -> tuple:
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


def _dq_setup(ctx, inputs, output):
    q, scale, zero_point, scope, axis, group_size, out_dtype, in_dtype, scale_dtype = inputs
    ctx.save_for_backward(q, scale, zero_point)
    ctx.cfg = (scope, axis, group_size, in_dtype, scale_dtype)


def _dq_scale_grad(grad: Tensor, q: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str,
                   axis: Optional[int], group_size: Optional[int], kind: str, implied_zp: int) -> Tensor:
    """``sum(dy * (q - zp))`` per scale element, in the scale's dtype (int4 codes unpacked)."""
    m = scale.dtype
    qm = (_unpack_int4(q, kind == "s4") if kind in kinds.INT4 else q).to(m)
    if zero_point is None:
        zp = torch.full((), float(implied_zp), dtype=m, device=q.device)
    else:
        zp = _expand(zero_point.to(m), qm.shape, scope, axis, group_size)
    return _sum_per_scale(grad.to(m) * (qm - zp), scope, axis, group_size, scale.shape).to(m)


def _dq_backward(ctx, grad):
    """scale (float): :func:`_dq_scale_grad`; fp8 q: ``dequantize_backward`` in q's dtype (a q that
    requires a gradient is an fp8 leaf: what runtime.torch.quantize returns does not); e8m0 codes
    are integers and take none."""
    q, scale, zero_point = ctx.saved_tensors
    scope, axis, group_size, in_dtype, scale_dtype = ctx.cfg
    kind, e8m0, implied_zp = _dq_facts(q.dtype, in_dtype, scale_dtype, scale.dtype)
    if e8m0:
        return (None,) * 9
    dq = ds = None
    if ctx.needs_input_grad[1]:
        ds = _dq_scale_grad(grad, q, scale, zero_point, scope, axis, group_size, kind, implied_zp)
    if ctx.needs_input_grad[0] and kind in kinds.FP8 and q.is_floating_point():
        dq = _call(_dequantize_backward, grad.contiguous(), scale, scope, axis, group_size).to(q.dtype)
    return dq, ds, None, None, None, None, None, None, None


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
    fp8_max, kernel_dtype, qmin, qmax, implied_zp = _mask_facts(out_dtype, qmin, qmax)
    if fp8_max is not None:
        m = _math_dtype(x)
        inv = _expand(torch.reciprocal(_scale_values(scale, m)), x.shape, scope, axis, group_size)
        return dy * ((x.to(m) * inv).abs() <= fp8_max)
    if zero_point is None and implied_zp:
        zero_point = torch.full(tuple(scale.shape), implied_zp, dtype=torch.int32, device=x.device)
    return _call(_quantize_backward, dy, x, scale, zero_point, scope, axis, group_size, kernel_dtype, qmin, qmax)


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
        return _call(_dequantize, q, scale, zero_point, *cfg)

    @staticmethod
    def backward(ctx, g):
        q, scale, zero_point = ctx.saved_tensors
        scope, axis, group_size, _out_dtype, in_dtype, scale_dtype = ctx.cfg
        kind, e8m0, implied_zp = _dq_facts(q.dtype, in_dtype, scale_dtype, scale.dtype)
        ds = None
        if ctx.needs_input_grad[2] and not e8m0:
            ds = _dq_scale_grad(g, q, scale, zero_point, scope, axis, group_size, kind, implied_zp)
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
def _dynamic_quantize_direct(x, scope, range_mode="symmetric", axis=None, group_size=None, out_dtype="int8",
                             qmin=None, qmax=None, eps=1e-8, scale_dtype="float32"):
    """``(q, scale, zero_point or None)``; e8m0 scales a ``torch.float8_e8m0fnu`` tensor (uint8
    where torch has no such dtype)."""
    q, s, z = sf.dynamic_quantize(x, scope=scope, mode=range_mode, axis=axis, group_size=group_size,
                                  out_dtype=out_dtype, qmin=qmin, qmax=qmax, eps=eps, scale_dtype=scale_dtype)
    if s.dtype != E8M0_DTYPE and lowbit.is_e8m0(scale_dtype):
        s = s.view(E8M0_DTYPE)
    return q, s, z


@_op("dynamic_quantize", direct=_dynamic_quantize_direct)
def _dynamic_quantize(x: Tensor, scope: str, range_mode: str = "symmetric", axis: Optional[int] = None,
                      group_size: Optional[int] = None, out_dtype: str = "int8", qmin: Optional[int] = None,
                      qmax: Optional[int] = None, eps: float = 1e-8,
                      scale_dtype: str = "float32") -> Tuple[Tensor, Tensor, Tensor]:
    """``(q, scale, zero_point)``; zero_point is an empty int32 tensor in symmetric mode."""
    q, s, z = _dynamic_quantize_direct(x, scope, range_mode, axis, group_size, out_dtype, qmin, qmax, eps,
                                       scale_dtype)
    return q, s, _none_or_empty(z, torch.int32, x.device)


@_dynamic_quantize.register_fake
def _(x, scope, range_mode="symmetric", axis=None, group_size=None, out_dtype="int8", qmin=None, qmax=None,
      eps=1e-8, scale_dtype="float32"):
    qs, ss, zs = meta.dynamic_quantize_spec(x, scope, range_mode, axis, group_size, out_dtype, qmin, qmax, eps,
                                            scale_dtype)
    return _new(qs, x.device), _new(ss, x.device), _new(zs or ((0,), torch.int32), x.device)


def _dynamic_quantize_out(x, scope, range_mode="symmetric", axis=None, group_size=None, out_dtype="int8", qmin=None,
                          qmax=None, eps=1e-8, scale_dtype="float32", *, q, scale, zero_point=None):
    if scale.dtype == E8M0_DTYPE != torch.uint8:
        scale = scale.view(torch.uint8)         # the functional API writes e8m0 codes into uint8
    outs = (q, scale) if zero_point is None else (q, scale, zero_point)
    sf.dynamic_quantize(x, scope=scope, mode=range_mode, axis=axis, group_size=group_size, out_dtype=out_dtype,
                        qmin=qmin, qmax=qmax, eps=eps, scale_dtype=scale_dtype, out=outs)


def _dynamic_quantize_out_fake(x, scope, range_mode="symmetric", axis=None, group_size=None, out_dtype="int8",
                               qmin=None, qmax=None, eps=1e-8, scale_dtype="float32", *, q, scale, zero_point=None):
    if range_mode == "asymmetric" and zero_point is None:
        raise InvalidProblemError("out: asymmetric mode returns a zero point; pass out=(q, scale, zero_point)")
    if range_mode != "asymmetric" and zero_point is not None:
        raise InvalidProblemError(f"out: mode={range_mode!r} has no zero-point output; pass out=(q, scale)")
    qs, ss, zs = meta.dynamic_quantize_spec(x, scope, range_mode, axis, group_size, out_dtype, qmin, qmax, eps,
                                            scale_dtype)
    meta.same_device(x=x, q=q, scale=scale, zero_point=zero_point)
    meta.check_out(q, qs, "out[0] (q)")
    meta.check_out(scale, ss, "out[1] (scale)", rows=False)
    if zero_point is not None:
        meta.check_out(zero_point, zs, "out[2] (zero_point)", rows=False)


_define_out("dynamic_quantize", "Tensor(a!) q, Tensor(b!) scale, Tensor(c!)? zero_point=None",
            _dynamic_quantize_out, _dynamic_quantize_out_fake)


# -- straight-through backward ops -----------------------------------------------------------------
@_op("quantize_backward")
def _quantize_backward(dy: Tensor, x: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str,
                       axis: Optional[int] = None, group_size: Optional[int] = None, out_dtype: str = "int8",
                       qmin: Optional[int] = None, qmax: Optional[int] = None) -> Tensor:
    return sf.quantize_backward(dy, x, scale, zero_point, scope=scope, axis=axis, group_size=group_size,
                                out_dtype=out_dtype, qmin=qmin, qmax=qmax)


@_quantize_backward.register_fake
def _(dy, x, scale, zero_point, scope, axis=None, group_size=None, out_dtype="int8", qmin=None, qmax=None):
    return _new(meta.quantize_backward_spec(dy, x, scale, zero_point, scope, axis, group_size, out_dtype, qmin, qmax),
                x.device)


def _quantize_backward_out(dy, x, scale, zero_point, scope, axis=None, group_size=None, out_dtype="int8", qmin=None,
                           qmax=None, *, out):
    sf.quantize_backward(dy, x, scale, zero_point, scope=scope, axis=axis, group_size=group_size, out_dtype=out_dtype,
                         qmin=qmin, qmax=qmax, out=out)


def _quantize_backward_out_fake(dy, x, scale, zero_point, scope, axis=None, group_size=None, out_dtype="int8",
                                qmin=None, qmax=None, *, out):
    spec = meta.quantize_backward_spec(dy, x, scale, zero_point, scope, axis, group_size, out_dtype, qmin, qmax)
    meta.same_device(x=x, out=out)
    meta.check_out(out, spec, "out")


_define_out("quantize_backward", "Tensor(a!) out", _quantize_backward_out, _quantize_backward_out_fake)


@_op("dequantize_backward")
def _dequantize_backward(dy: Tensor, scale: Tensor, scope: str, axis: Optional[int] = None,
                         group_size: Optional[int] = None) -> Tensor:
    return sf.dequantize_backward(dy, scale, scope=scope, axis=axis, group_size=group_size)


@_dequantize_backward.register_fake
def _(dy, scale, scope, axis=None, group_size=None):
    return _new(meta.dequantize_backward_spec(dy, scale, scope, axis, group_size), dy.device)


def _dequantize_backward_out(dy, scale, scope, axis=None, group_size=None, *, out):
    sf.dequantize_backward(dy, scale, scope=scope, axis=axis, group_size=group_size, out=out)


def _dequantize_backward_out_fake(dy, scale, scope, axis=None, group_size=None, *, out):
    spec = meta.dequantize_backward_spec(dy, scale, scope, axis, group_size)
    meta.same_device(dy=dy, out=out)
    meta.check_out(out, spec, "out")


_define_out("dequantize_backward", "Tensor(a!) out", _dequantize_backward_out, _dequantize_backward_out_fake)


# -- fake_quantize (static scale / zero point) ---------------------------------------------------
@_op("fake_quantize")
def _fake_quantize(x: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str, axis: Optional[int] = None,
                   group_size: Optional[int] = None, qmin: int = DEFAULT_QMIN, qmax: int = DEFAULT_QMAX) -> Tensor:
    return sf.fake_quantize(x, scale, zero_point, scope=scope, axis=axis, group_size=group_size, qmin=qmin,
                            qmax=qmax)


@_fake_quantize.register_fake
def _(x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN, qmax=DEFAULT_QMAX):
    return _new(meta.fake_quantize_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax), x.device)


def _fake_quantize_out(x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN,
                       qmax=DEFAULT_QMAX, *, out):
    sf.fake_quantize(x, scale, zero_point, scope=scope, axis=axis, group_size=group_size, qmin=qmin, qmax=qmax,
                     out=out)


def _fake_quantize_out_fake(x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN,
                            qmax=DEFAULT_QMAX, *, out):
    spec = meta.fake_quantize_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax)
    meta.same_device(x=x, out=out)
    meta.check_out(out, spec, "out")


_define_out("fake_quantize", "Tensor(a!) out", _fake_quantize_out, _fake_quantize_out_fake)


@_op("fake_quantize_backward")
def _fake_quantize_backward(dy: Tensor, x: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str,
                            axis: Optional[int] = None, group_size: Optional[int] = None, qmin: int = DEFAULT_QMIN,
                            qmax: int = DEFAULT_QMAX) -> Tensor:
    return sf.fake_quantize_backward(dy, x, scale, zero_point, scope=scope, axis=axis, group_size=group_size,
                                     qmin=qmin, qmax=qmax)


@_fake_quantize_backward.register_fake
def _(dy, x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN, qmax=DEFAULT_QMAX):
    return _new(meta.fake_quantize_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax, dy=dy,
                                        op="fake_quantize_backward"), x.device)


def _fake_quantize_backward_out(dy, x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN,
                                qmax=DEFAULT_QMAX, *, out):
    sf.fake_quantize_backward(dy, x, scale, zero_point, scope=scope, axis=axis, group_size=group_size, qmin=qmin,
                              qmax=qmax, out=out)


def _fake_quantize_backward_out_fake(dy, x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN,
                                     qmax=DEFAULT_QMAX, *, out):
    spec = meta.fake_quantize_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax, dy=dy,
                                   op="fake_quantize_backward")
    meta.same_device(x=x, out=out)
    meta.check_out(out, spec, "out")


_define_out("fake_quantize_backward", "Tensor(a!) out", _fake_quantize_backward_out, _fake_quantize_backward_out_fake)


def _fq_setup(ctx, inputs, output):
    x, scale, zero_point, scope, axis, group_size, qmin, qmax = inputs
    ctx.save_for_backward(x, scale, zero_point)
    ctx.cfg = (scope, axis, group_size, qmin, qmax)


def _fq_backward(ctx, grad):
    x, scale, zero_point = ctx.saved_tensors
    dx = _call(_fake_quantize_backward, grad.contiguous(), x, scale, zero_point, *ctx.cfg)
    return dx, None, None, None, None, None, None, None


_fake_quantize.register_autograd(_fq_backward, setup_context=_fq_setup)


# -- fake_quantize with its mask: the training forward --------------------------------------------
def _fqm_direct(x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN, qmax=DEFAULT_QMAX,
                mask="bits", out=None):
    """``(y, mask)``: the bool mask or its bits (``mask``), written with y by one kernel."""
    return sf.fake_quantize(x, scale, zero_point, scope=scope, axis=axis, group_size=group_size, qmin=qmin,
                            qmax=qmax, return_mask=meta.return_mask_of(mask), out=out)


@_op("fake_quantize_with_mask", direct=_fqm_direct)
def _fake_quantize_with_mask(x: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str,
                             axis: Optional[int] = None, group_size: Optional[int] = None, qmin: int = DEFAULT_QMIN,
                             qmax: int = DEFAULT_QMAX, mask: str = "bits") -> Tuple[Tensor, Tensor]:
    """``(y, mask)``: mask ``"bits"`` (uint8 ``x.shape[:-1] + (ceil(D / 8),)``) or ``"bool"`` (x's shape)."""
    return _fqm_direct(x, scale, zero_point, scope, axis, group_size, qmin, qmax, mask)


@_fake_quantize_with_mask.register_fake
def _(x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN, qmax=DEFAULT_QMAX, mask="bits"):
    ys, ms = meta.fake_quantize_with_mask_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax, mask)
    return _new(ys, x.device), _new(ms, x.device)


def _fqm_out(x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN, qmax=DEFAULT_QMAX,
             mask="bits", *, out):
    """y into ``out``; returns the mask (a new tensor)."""
    return _fqm_direct(x, scale, zero_point, scope, axis, group_size, qmin, qmax, mask, out)[1]


def _fqm_out_fake(x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN, qmax=DEFAULT_QMAX,
                  mask="bits", *, out):
    ys, ms = meta.fake_quantize_with_mask_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax, mask)
    meta.same_device(x=x, out=out)
    meta.check_out(out, ys, "out")
    return _new(ms, x.device)


_define_out("fake_quantize_with_mask", "Tensor(a!) out", _fqm_out, _fqm_out_fake, returns="Tensor")


def _fqm_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1])            # the mask only: 1/8 byte an element as bits, not x
    ctx.bits = inputs[8] == "bits"


def _fqm_backward(ctx, grad, _grad_mask):
    mask, = ctx.saved_tensors
    if ctx.bits:
        dx = _call(_fake_quantize_backward_from_mask, grad.contiguous(), mask)
    else:
        dx = grad * mask                        # a product, as the kernel's: -0 and NaN where masked
    return dx, None, None, None, None, None, None, None, None


_fake_quantize_with_mask.register_autograd(_fqm_backward, setup_context=_fqm_setup)


@_op("fake_quantize_backward_from_mask")
def _fake_quantize_backward_from_mask(dy: Tensor, mask: Tensor) -> Tensor:
    return sf.fake_quantize_backward_from_mask(dy, mask)


@_fake_quantize_backward_from_mask.register_fake
def _(dy, mask):
    return _new(meta.fake_quantize_backward_from_mask_spec(dy, mask), dy.device)


def _from_mask_out(dy, mask, *, out):
    sf.fake_quantize_backward_from_mask(dy, mask, out=out)


def _from_mask_out_fake(dy, mask, *, out):
    spec = meta.fake_quantize_backward_from_mask_spec(dy, mask)
    meta.same_device(dy=dy, out=out)
    meta.check_out(out, spec, "out")


_define_out("fake_quantize_backward_from_mask", "Tensor(a!) out", _from_mask_out, _from_mask_out_fake)


# -- fake_quantize_learnable (LSQ) ----------------------------------------------------------------
@_op("fake_quantize_learnable")
def _fake_quantize_learnable(x: Tensor, scale: Tensor, zero_point: Optional[Tensor], scope: str,
                             axis: Optional[int] = None, group_size: Optional[int] = None, qmin: int = DEFAULT_QMIN,
                             qmax: int = DEFAULT_QMAX, grad_factor: float = 1.0) -> Tensor:
    return sf.fake_quantize(x, _scale_for(x, scale), _round_zero_point(zero_point, qmin, qmax), scope=scope,
                            axis=axis, group_size=group_size, qmin=qmin, qmax=qmax)


@_fake_quantize_learnable.register_fake
def _(x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN, qmax=DEFAULT_QMAX, grad_factor=1.0):
    return _new(meta.fake_quantize_learnable_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax,
                                                  grad_factor), x.device)


def _lfq_backward_direct(dy, x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN,
                         qmax=DEFAULT_QMAX, grad_factor=1.0, out=None):
    """(dx, dscale in the scale's math dtype, dzero_point float32 or None when symmetric)."""
    return sf.fake_quantize_learnable_backward(dy, x, scale, zero_point, scope=scope, axis=axis,
                                               group_size=group_size, qmin=qmin, qmax=qmax, grad_factor=grad_factor,
                                               out=out)


@_op("fake_quantize_learnable_backward", direct=_lfq_backward_direct)
def _fake_quantize_learnable_backward(dy: Tensor, x: Tensor, scale: Tensor, zero_point: Optional[Tensor],
                                      scope: str, axis: Optional[int] = None, group_size: Optional[int] = None,
                                      qmin: int = DEFAULT_QMIN, qmax: int = DEFAULT_QMAX,
                                      grad_factor: float = 1.0) -> Tuple[Tensor, Tensor, Tensor]:
    """(dx, dscale, dzero_point; an empty tensor when symmetric)."""
    dx, ds, dz = _lfq_backward_direct(dy, x, scale, zero_point, scope, axis, group_size, qmin, qmax, grad_factor)
    return dx, ds, _none_or_empty(dz, torch.float32, x.device)


@_fake_quantize_learnable_backward.register_fake
def _(dy, x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN, qmax=DEFAULT_QMAX,
      grad_factor=1.0):
    specs = meta.fake_quantize_learnable_backward_spec(dy, x, scale, zero_point, scope, axis, group_size, qmin, qmax,
                                                       grad_factor)
    return tuple(_new(s, x.device) for s in specs)


def _lfq_backward_out(dy, x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN,
                      qmax=DEFAULT_QMAX, grad_factor=1.0, *, out):
    """dx into ``out``; returns (dscale, dzero_point; an empty tensor when symmetric)."""
    _, ds, dz = _lfq_backward_direct(dy, x, scale, zero_point, scope, axis, group_size, qmin, qmax, grad_factor, out)
    return ds, _none_or_empty(dz, torch.float32, x.device)


def _lfq_backward_out_fake(dy, x, scale, zero_point, scope, axis=None, group_size=None, qmin=DEFAULT_QMIN,
                           qmax=DEFAULT_QMAX, grad_factor=1.0, *, out):
    dx, ds, dz = meta.fake_quantize_learnable_backward_spec(dy, x, scale, zero_point, scope, axis, group_size, qmin,
                                                            qmax, grad_factor)
    meta.same_device(x=x, out=out)
    meta.check_out(out, dx, "out")
    return _new(ds, x.device), _new(dz, x.device)


_define_out("fake_quantize_learnable_backward", "Tensor(a!) out", _lfq_backward_out, _lfq_backward_out_fake,
            "(Tensor, Tensor)")


def _lfq_setup(ctx, inputs, output):
    x, scale, zero_point, scope, axis, group_size, qmin, qmax, grad_factor = inputs
    ctx.save_for_backward(x, scale, zero_point)
    ctx.cfg = (scope, axis, group_size, qmin, qmax, grad_factor)


def _lfq_backward(ctx, grad):
    x, scale, zero_point = ctx.saved_tensors
    scope, axis, group_size, qmin, qmax, g = ctx.cfg
    dx, ds, dz = _call(_fake_quantize_learnable_backward, grad.contiguous(), x, _scale_for(x, scale),
                       _round_zero_point(zero_point, qmin, qmax), scope, axis, group_size, qmin, qmax, g)
    dzp = None
    if zero_point is not None and zero_point.is_floating_point():
        dzp = dz.to(zero_point.dtype)
    return dx, ds.to(scale.dtype), dzp, None, None, None, None, None, None


_fake_quantize_learnable.register_autograd(_lfq_backward, setup_context=_lfq_setup)


# -- MoE grouped matmul -----------------------------------------------------------------------------
@_op("grouped_matmul")
def _grouped_matmul(x: Tensor, w: Tensor, row_experts: Optional[Tensor] = None, offsets: Optional[Tensor] = None,
                    strategy: str = "auto", trusted_offsets: bool = False) -> Tensor:
    return sf.grouped_matmul(x, w, row_experts=row_experts, offsets=offsets, strategy=strategy,
                             trusted_offsets=trusted_offsets)


@_grouped_matmul.register_fake
def _(x, w, row_experts=None, offsets=None, strategy="auto", trusted_offsets=False):
    return _new(meta.grouped_matmul_spec(x, w, row_experts, offsets, strategy), x.device)


def _grouped_matmul_out(x, w, row_experts=None, offsets=None, strategy="auto", trusted_offsets=False, *, out):
    sf.grouped_matmul(x, w, row_experts=row_experts, offsets=offsets, strategy=strategy,
                      trusted_offsets=trusted_offsets, out=out)


def _grouped_matmul_out_fake(x, w, row_experts=None, offsets=None, strategy="auto", trusted_offsets=False, *, out):
    spec = meta.grouped_matmul_spec(x, w, row_experts, offsets, strategy)
    meta.same_device(x=x, out=out)
    meta.check_dense_out(out, spec, "out")


_define_out("grouped_matmul", "Tensor(a!) out", _grouped_matmul_out, _grouped_matmul_out_fake)


def _gmm_backward_direct(x, w, dy, row_experts=None, offsets=None, strategy="auto", need_input=True,
                         need_weight=True, dw_dtype="float32", trusted_offsets=False):
    """``(dx, dw)``; a gradient not asked for is None."""
    return sf.grouped_matmul_backward(x, w, dy, row_experts=row_experts, offsets=offsets, strategy=strategy,
                                      need_input=need_input, need_weight=need_weight, dw_dtype=dw_dtype,
                                      trusted_offsets=trusted_offsets)


@_op("grouped_matmul_backward", direct=_gmm_backward_direct)
def _grouped_matmul_backward(x: Tensor, w: Tensor, dy: Tensor, row_experts: Optional[Tensor] = None,
                             offsets: Optional[Tensor] = None, strategy: str = "auto", need_input: bool = True,
                             need_weight: bool = True, dw_dtype: str = "float32",
                             trusted_offsets: bool = False) -> Tuple[Tensor, Tensor]:
    """``(dx, dw)``; a gradient not asked for is an empty (0,) tensor."""
    dx, dw = _gmm_backward_direct(x, w, dy, row_experts, offsets, strategy, need_input, need_weight, dw_dtype,
                                  trusted_offsets)
    return (_none_or_empty(dx, x.dtype, x.device),
            _none_or_empty(dw, torch_dtype(kind_of(dw_dtype, "dw_dtype")), x.device))


@_grouped_matmul_backward.register_fake
def _(x, w, dy, row_experts=None, offsets=None, strategy="auto", need_input=True, need_weight=True,
      dw_dtype="float32", trusted_offsets=False):
    dx, dw = meta.grouped_matmul_backward_spec(x, w, dy, row_experts, offsets, strategy, need_input, need_weight,
                                               dw_dtype)
    return _new(dx, x.device), _new(dw, x.device)


def _grouped_matmul_backward_out(x, w, dy, row_experts=None, offsets=None, strategy="auto", need_input=True,
                                 need_weight=True, dw_dtype="float32", trusted_offsets=False, *, dx=None, dw=None):
    sf.grouped_matmul_backward(x, w, dy, row_experts=row_experts, offsets=offsets, strategy=strategy,
                               need_input=need_input, need_weight=need_weight, dw_dtype=dw_dtype,
                               trusted_offsets=trusted_offsets, out=(dx, dw))


def _grouped_matmul_backward_out_fake(x, w, dy, row_experts=None, offsets=None, strategy="auto", need_input=True,
                                      need_weight=True, dw_dtype="float32", trusted_offsets=False, *, dx=None,
                                      dw=None):
    specs = meta.grouped_matmul_backward_spec(x, w, dy, row_experts, offsets, strategy, need_input, need_weight,
                                              dw_dtype)
    meta.same_device(x=x, dx=dx, dw=dw)
    for arg, t, need, flag, spec in (("out[0] (dx)", dx, need_input, "need_input", specs[0]),
                                     ("out[1] (dw)", dw, need_weight, "need_weight", specs[1])):
        if need != (t is not None):
            raise InvalidProblemError(f"{arg} is {'None' if t is None else 'given'} but {flag}={bool(need)}; pass "
                                      + (f"an array of shape {tuple(spec[0])} (or {flag}=False)" if need else "None"))
        if t is not None:
            meta.check_dense_out(t, spec, arg)


_define_out("grouped_matmul_backward", "Tensor(a!)? dx=None, Tensor(b!)? dw=None", _grouped_matmul_backward_out,
            _grouped_matmul_backward_out_fake)


def _gmm_setup(ctx, inputs, output):
    x, w, row_experts, offsets, strategy, trusted_offsets = inputs
    ctx.save_for_backward(x, w, row_experts, offsets)
    ctx.cfg = (strategy, trusted_offsets)


def _gmm_backward(ctx, grad):
    """dx = dy @ w[e(m)] in x's dtype; dw accumulated and returned in float32 by the kernel, then
    cast to w's dtype (the parameter's gradient dtype)."""
    x, w, row_experts, offsets = ctx.saved_tensors
    strategy, trusted = ctx.cfg
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_x or need_w):
        return None, None, None, None, None, None
    dx, dw = _call(_grouped_matmul_backward, x, w, grad.contiguous(), row_experts, offsets, strategy, need_x,
                   need_w, "float32", trusted)
    return (dx if need_x else None), (dw.to(w.dtype) if need_w else None), None, None, None, None


_grouped_matmul.register_autograd(_gmm_backward, setup_context=_gmm_setup)


# -- the public functions -----------------------------------------------------------------------
def _dtype_name(d) -> Optional[str]:
    """A dtype argument as the string the schemas carry (torch dtypes accepted)."""
    if d is None or isinstance(d, str):
        return d
    return str(d).replace("torch.", "")


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
    name = str(torch_dtype(kind_of(_dtype_name(out_dtype), "out_dtype"))).replace("torch.", "")
    got = _FLOAT_OUTS[out_dtype] = (name, _float_scale_dtype(name))   # a valid argument: hashable
    return got


def quantize(x: Tensor, scale, zero_point=None, *, scope: str, axis: Optional[int] = None,
             group_size: Optional[int] = None, out_dtype="int8", qmin: Optional[int] = None,
             qmax: Optional[int] = None, scale_dtype=None, out: Optional[Tensor] = None) -> Tensor:
    """``torch.ops.skuforge.quantize`` (``.out`` with ``out=``): runtime.quantize on torch tensors;
    fp8 outputs are torch fp8 tensors, int4 packed uint8 (..., D/2). The codes carry no gradient;
    when x needs one, :func:`dequantize` of these codes is the straight-through estimator,
    ``x.grad = dy * mask`` (the codes hold its surrogate; docs/training.md)."""
    s = _scale_tensor(scale, x)
    z = _zp_tensor(zero_point, x)
    args = (x, s, z, scope, axis, group_size, _dtype_name(out_dtype), qmin, qmax, _dtype_name(scale_dtype))
    if out is None:
        q = _call(_quantize, *args)
    else:
        _call_out("quantize", args, out=out)
        q = out
    if _grad_on() and x.requires_grad:
        _link(q, _QuantizeSTE.apply(x, s, z, (scope, axis, group_size, args[6], qmin, qmax)))
    return q


def dequantize(q: Tensor, scale, zero_point=None, *, scope: str, axis: Optional[int] = None,
               group_size: Optional[int] = None, out_dtype="float32", in_dtype=None, scale_dtype=None,
               out: Optional[Tensor] = None) -> Tensor:
    """``(q - zp) * scale``; differentiable with respect to a float ``scale`` (e.g. tuning the scales of
    a quantized model) and, for an fp8 leaf q, to q (``dequantize_backward``); integer q gets none.
    Codes from :func:`quantize` of an x that needs a gradient: the straight-through estimator,
    ``x.grad = dy * mask`` in x's dtype (docs/training.md)."""
    name, scale_dt = _float_out(out_dtype)
    s = _scale_tensor(scale, q, scale_dt)
    args = (q, s, _zp_tensor(zero_point, q), scope, axis, group_size, name, _dtype_name(in_dtype),
            _dtype_name(scale_dtype))
    if out is None:
        surrogate = _surrogate(q) if _grad_on() else None
        if surrogate is not None:
            return _DequantizeSTE.apply(surrogate, q, s, args[2], args[3:])
        return _call(_dequantize, *args)
    _call_out("dequantize", args, out=out)
    return out


def dynamic_quantize(x: Tensor, *, scope: str, mode: str = "symmetric", axis: Optional[int] = None,
                     group_size: Optional[int] = None, out_dtype="int8", qmin: Optional[int] = None,
                     qmax: Optional[int] = None, eps: float = 1e-8, scale_dtype="float32", out=None):
    """``(q, scale, zero_point)`` as runtime.dynamic_quantize (zero_point None when symmetric; e8m0
    scales as ``torch.float8_e8m0fnu``). ``out=(q, scale[, zero_point])``: s8/u8 with float scales."""
    args = (x, scope, mode, axis, group_size, _dtype_name(out_dtype), qmin, qmax, float(eps),
            _dtype_name(scale_dtype))
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
            raise InvalidProblemError(f"out={type(out).__name__}: expected a tuple (q, scale) or (q, scale, "
                                      "zero_point)")
        zp = out[2] if len(out) == 3 else None
        _call_out("dynamic_quantize", args, q=out[0], scale=out[1], zero_point=zp)
        return out[0], out[1], zp
    q, s, z = _call(_dynamic_quantize, *args)
    return q, s, (z if mode == "asymmetric" else None)


def quantize_backward(dy: Tensor, x: Tensor, scale, zero_point=None, *, scope: str, axis: Optional[int] = None,
                      group_size: Optional[int] = None, out_dtype="int8", qmin: Optional[int] = None,
                      qmax: Optional[int] = None, out: Optional[Tensor] = None) -> Tensor:
    """``dx = dy * (qmin <= rne(x / scale) + zp <= qmax)`` (runtime.quantize_backward)."""
    args = (dy, x, _scale_tensor(scale, x), _zp_tensor(zero_point, x), scope, axis, group_size,
            _dtype_name(out_dtype), qmin, qmax)
    if out is None:
        return _call(_quantize_backward, *args)
    _call_out("quantize_backward", args, out=out)
    return out


def dequantize_backward(dy: Tensor, scale, *, scope: str, axis: Optional[int] = None,
                        group_size: Optional[int] = None, out: Optional[Tensor] = None) -> Tensor:
    """``dq = dy * scale`` (runtime.dequantize_backward)."""
    args = (dy, _scale_tensor(scale, dy), scope, axis, group_size)
    if out is None:
        return _call(_dequantize_backward, *args)
    _call_out("dequantize_backward", args, out=out)
    return out


def fake_quantize(x: Tensor, scale, zero_point=None, *, scope: str, axis: Optional[int] = None,
                  group_size: Optional[int] = None, qmin: int = DEFAULT_QMIN, qmax: int = DEFAULT_QMAX,
                  out: Optional[Tensor] = None) -> Tensor:
    """Fake quantization with a fixed scale / zero point (int32); gradient to x only (STE with mask).
    When x needs a gradient the forward also writes the mask's bits (``fake_quantize_with_mask``),
    the one thing autograd keeps for the backward (``fake_quantize_backward_from_mask``); ``out=``
    (the ``.out`` overload) records no gradient."""
    args = (x, _scale_for(x, _scale_tensor(scale, x)), _zp_tensor(zero_point, x), scope, axis,
            group_size, qmin, qmax)
    if out is not None:
        _call_out("fake_quantize", args, out=out)
        return out
    if _grad_on() and x.requires_grad:
        return _call(_fake_quantize_with_mask, *args, "bits")[0]
    return _call(_fake_quantize, *args)


def fake_quantize_backward_from_mask(dy: Tensor, mask: Tensor, *, out: Optional[Tensor] = None) -> Tensor:
    """``dx = dy * bit`` with the bits of ``runtime.fake_quantize(..., return_mask="bits")``
    (runtime.fake_quantize_backward_from_mask)."""
    if out is None:
        return _call(_fake_quantize_backward_from_mask, dy, mask)
    _call_out("fake_quantize_backward_from_mask", (dy, mask), out=out)
    return out


def fake_quantize_backward(dy: Tensor, x: Tensor, scale, zero_point=None, *, scope: str, axis: Optional[int] = None,
                           group_size: Optional[int] = None, qmin: int = DEFAULT_QMIN, qmax: int = DEFAULT_QMAX,
                           out: Optional[Tensor] = None) -> Tensor:
    """``dx = dy * mask`` (runtime.fake_quantize_backward)."""
    args = (dy, x, _scale_tensor(scale, x), _zp_tensor(zero_point, x), scope, axis, group_size,
            qmin, qmax)
    if out is None:
        return _call(_fake_quantize_backward, *args)
    _call_out("fake_quantize_backward", args, out=out)
    return out


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
    return _call(_fake_quantize_learnable, x, scale, zero_point, scope, axis, group_size, qmin, qmax, g)


def fake_quantize_learnable_backward(dy: Tensor, x: Tensor, scale, zero_point=None, *, scope: str,
                                     axis: Optional[int] = None, group_size: Optional[int] = None,
                                     qmin: int = DEFAULT_QMIN, qmax: int = DEFAULT_QMAX, grad_factor: float = 1.0,
                                     out: Optional[Tensor] = None):
    """``(dx, dscale, dzero_point)`` (runtime.fake_quantize_learnable_backward; dzero_point None when
    symmetric); ``out=``: dx written into it (the ``.out`` overload) and returned."""
    args = (dy, x, _scale_tensor(scale, x), _zp_tensor(zero_point, x), scope, axis, group_size, qmin, qmax,
            float(grad_factor))
    if out is None:
        dx, ds, dz = _call(_fake_quantize_learnable_backward, *args)
    else:
        dx, (ds, dz) = out, _call_out("fake_quantize_learnable_backward", args, out=out)
    return dx, ds, (None if zero_point is None else dz)


def grouped_matmul(x: Tensor, w: Tensor, *, row_experts: Optional[Tensor] = None, offsets: Optional[Tensor] = None,
                   strategy: str = "auto", trusted_offsets: bool = False, out: Optional[Tensor] = None) -> Tensor:
    """``y[m] = w[e(m)] @ x[m]`` (runtime.grouped_matmul); differentiable in x and w (not with ``out=``)."""
    args = (x, w, row_experts, offsets, strategy, trusted_offsets)
    if out is None:
        return _call(_grouped_matmul, *args)
    _call_out("grouped_matmul", args, out=out)
    return out


def grouped_matmul_backward(x: Tensor, w: Tensor, dy: Tensor, *, row_experts: Optional[Tensor] = None,
                            offsets: Optional[Tensor] = None, strategy: str = "auto", need_input: bool = True,
                            need_weight: bool = True, dw_dtype="float32", trusted_offsets: bool = False, out=None):
    """``(dx, dw)`` (runtime.grouped_matmul_backward); a gradient not asked for is None.
    ``out=(dx, dw)``: written and returned (None exactly for a gradient not asked for)."""
    args = (x, w, dy, row_experts, offsets, strategy, need_input, need_weight, _dtype_name(dw_dtype), trusted_offsets)
    if out is not None:
        dxo, dwo = _out_pair(out)
        _call_out("grouped_matmul_backward", args, dx=dxo, dw=dwo)
        return dxo, dwo
    dx, dw = _call(_grouped_matmul_backward, *args)
    return (dx if need_input else None), (dw if need_weight else None)


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


OPS = ("quantize", "dequantize", "dynamic_quantize", "quantize_backward", "dequantize_backward", "fake_quantize",
       "fake_quantize_with_mask", "fake_quantize_backward", "fake_quantize_backward_from_mask",
       "fake_quantize_learnable", "fake_quantize_learnable_backward", "grouped_matmul", "grouped_matmul_backward")
OUT_OPS = ("quantize", "dequantize", "dynamic_quantize", "quantize_backward", "dequantize_backward", "fake_quantize",
           "fake_quantize_with_mask", "fake_quantize_backward", "fake_quantize_backward_from_mask",
           "fake_quantize_learnable_backward", "grouped_matmul", "grouped_matmul_backward")
