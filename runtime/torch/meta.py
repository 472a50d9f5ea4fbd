"""Fake (meta) implementations of the ``torch.ops.skuforge`` ops: output shapes, dtypes and strides
from the arguments' shapes and dtypes alone, with the functional API's typed errors.

Each ``*_spec`` function runs the same pure-Python checks as the functional API (runtime.scopes,
runtime.params, runtime.quantization.lowbit, runtime.moe.check_problem, ...) on descriptions of the tensors
(no data pointer is read, nothing is synchronized) and returns what the op returns, as
``(shape, torch.dtype)`` pairs; outputs are dense and C-contiguous, as the functional API allocates
them. The same functions serve the fake implementations (FakeTensor / meta tensors, torch.compile)
and nothing else: the real implementations call the functional API, which checks again.
"""
import functools
from typing import Optional

import torch

from runtime import kinds

from runtime.quantization import lowbit
from runtime.arrays import ArrayRef, kind_of
from runtime.axes import MODES
from runtime.quantization.dynamic import _resolve_range
from runtime.errors import DeviceMismatchError, InvalidProblemError, UnsupportedError
from runtime.moe.grouped import _out_kind
from runtime.moe.problem import STRATEGIES, check_problem
from runtime.params import check_param_shape, check_scale_dtype, positive_scalar, real_scalar
from runtime.scopes import check_range, check_scope, param_shape, rows_view
from runtime.quantization.training import check_mask_bits, fake_quant_range, mask_bits_shape

E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", torch.uint8)   # e8m0 scales: torch >= 2.7 has the dtype


def _concrete(v):
    """A symbolic scalar argument as a Python number. ``torch.compile(dynamic=True)`` makes integer
    arguments (group_size, axis, qmin, ...) symbolic; they select the kernel and the output shapes,
    so the fake impl specializes on them (a guard on the value, as for any Python int)."""
    if isinstance(v, torch.SymInt):
        return int(v)
    if isinstance(v, torch.SymFloat):
        return float(v)
    if isinstance(v, torch.SymBool):
        return bool(v)
    return v


def concrete_scalars(fn):
    """Call ``fn`` with its symbolic scalar arguments specialized (:func:`_concrete`); tensors stay
    symbolic."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*map(_concrete, args), **{k: _concrete(v) for k, v in kwargs.items()})
    return wrapper


def torch_dtype_of(kind: str) -> torch.dtype:
    """The torch dtype of a tensor of ``kind`` (packed int4: its uint8 container; e8m0: E8M0_DTYPE)."""
    if kind == kinds.E8M0:
        return E8M0_DTYPE
    k = kinds.kind(kind)
    name = k.torch or kinds.kind(k.container).torch
    return getattr(torch, name)


DEVICES = ("cuda", "meta")      # where the ops' tensors may live (meta: shapes only)


def describe(t, arg: str) -> ArrayRef:
    """A tensor (real, fake or meta) described as the functional API sees a CUDA tensor, without
    touching its data; a typed error for what the functional API rejects the same way."""
    if not isinstance(t, torch.Tensor):
        if t is None:
            raise InvalidProblemError(f"{arg} is None; an array is needed")
        raise InvalidProblemError(f"{arg} has type {type(t).__name__}; expected a CUDA torch.Tensor")
    if t.device.type not in DEVICES:
        raise InvalidProblemError(f"{arg} is a torch tensor on {t.device}; skuforge runs on CUDA tensors "
                                  f"(move it with {arg}.cuda())")
    return ArrayRef(t, 0, tuple(t.shape), tuple(t.stride()), kind_of(t.dtype, arg), 0, "torch")


def same_device(**tensors) -> None:
    """``same_device(x=x, scale=scale, ...)``: the functional API's :class:`DeviceMismatchError`,
    naming every tensor argument and its device, unless all live on one device (None is skipped)."""
    named = {arg: t.device for arg, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(named.values())) > 1:
        raise DeviceMismatchError({arg: str(d) for arg, d in named.items()})


def _param(t, x_shape, scope, axis, group_size, arg: str, want_kinds: tuple, what: str) -> Optional[ArrayRef]:
    """A scale / zero-point tensor: its dtype (one of ``want_kinds``) and the scope's shape."""
    if t is None:
        return None
    ref = describe(t, arg)
    if ref.kind not in want_kinds:
        raise InvalidProblemError(f"{arg} has dtype {ref.kind}; {what} is required")
    check_param_shape(ref, param_shape(x_shape, scope, axis, group_size), scope, arg)
    return ref


def _float_input(t, arg: str, op: str) -> ArrayRef:
    ref = describe(t, arg)
    if ref.kind not in kinds.FLOAT:
        raise UnsupportedError(f"{arg} has dtype {ref.kind}; {op} takes {', '.join(kinds.FLOAT)}")
    return ref


def _math_name(kind: str) -> str:
    return "float64" if kind == "f64" else "float32"


def _scale(scale, shape, scope, axis, group_size, data_kind: str) -> ArrayRef:
    m = kinds.math_kind(data_kind)
    return _param(scale, shape, scope, axis, group_size, "scale", (m,), f"{_math_name(m)} for {data_kind} data")


def _zero_point(zp, shape, scope, axis, group_size) -> Optional[ArrayRef]:
    return _param(zp, shape, scope, axis, group_size, "zero_point", ("i32",), "int32")


def _e8m0_scale(scale, shape, scope, axis, group_size) -> ArrayRef:
    return _param(scale, shape, scope, axis, group_size, "scale", ("u8", kinds.E8M0),
                  "uint8 codes (e + 127) or float8_e8m0fnu for scale_dtype='e8m0'")


def _is_e8m0(scale_dtype, scale) -> bool:
    return lowbit.is_e8m0(scale_dtype) or (isinstance(scale, torch.Tensor) and scale.dtype == E8M0_DTYPE
                                           and E8M0_DTYPE != torch.uint8)


def _dense(shape, kind: str):
    return tuple(shape), torch_dtype_of(kind)


# -- quantize / dequantize -------------------------------------------------------------------------
@concrete_scalars
def quantize_spec(x, scale, zero_point, scope, axis, group_size, out_dtype, qmin, qmax, scale_dtype):
    xr = _float_input(x, "x", "quantize")
    qk = kind_of(out_dtype, "out_dtype")
    same_device(x=x, scale=scale, zero_point=zero_point)
    mx = _is_e8m0(scale_dtype, scale)
    if qk in lowbit.KINDS or mx:
        if qk not in lowbit.KINDS:
            lowbit.check_mx(qk, scope, group_size)
        rows_view(xr, "x")
        axis = check_scope(xr.shape, scope, axis, group_size)
        if qk in lowbit.FP8:
            lowbit.check_fp8_args(qk, zero_point, qmin, qmax)
        else:
            lowbit.check_int4(xr.shape, scope, group_size, qk, "x")
            check_range(qk, qmin, qmax)
            _zero_point(zero_point, xr.shape, scope, axis, group_size)
        if mx:
            lowbit.check_mx(qk, scope, group_size)
            _e8m0_scale(scale, xr.shape, scope, axis, group_size)
        else:
            _scale(scale, xr.shape, scope, axis, group_size, xr.kind)
        return _dense(lowbit.packed_shape(xr.shape, qk), qk)
    if qk not in kinds.INT8:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; quantize produces {', '.join(kinds.INT8)}")
    check_scale_dtype(scale_dtype, xr.kind)
    rows_view(xr, "x")
    axis = check_scope(xr.shape, scope, axis, group_size)
    check_range(qk, qmin, qmax)
    _scale(scale, xr.shape, scope, axis, group_size, xr.kind)
    _zero_point(zero_point, xr.shape, scope, axis, group_size)
    return _dense(xr.shape, qk)


@concrete_scalars
def dequantize_spec(q, scale, zero_point, scope, axis, group_size, out_dtype, in_dtype, scale_dtype):
    qr = describe(q, "q")
    same_device(q=q, scale=scale, zero_point=zero_point)
    low = lowbit.input_kind(qr, in_dtype)
    mx = _is_e8m0(scale_dtype, scale)
    yk = kind_of(out_dtype, "out_dtype")
    if low is not None or mx:
        kind = low or qr.kind
        if kind not in lowbit.KINDS:
            lowbit.check_mx(kind, scope, group_size)
        if yk not in kinds.FLOAT:
            raise UnsupportedError(f"out_dtype={out_dtype!r}; dequantize produces {', '.join(kinds.FLOAT)}")
        rows_view(qr, "q")
        shape = tuple(qr.shape[:-1]) + (2 * qr.shape[-1],) if kind in lowbit.INT4 else tuple(qr.shape)
        axis = check_scope(shape, scope, axis, group_size, "q")
        if kind in lowbit.FP8:
            lowbit.check_fp8_args(kind, zero_point, None, None)
        else:
            lowbit.check_int4(shape, scope, group_size, kind, "q (unpacked)")
            _zero_point(zero_point, shape, scope, axis, group_size)
        if mx:
            lowbit.check_mx(kind, scope, group_size)
            _e8m0_scale(scale, shape, scope, axis, group_size)
        else:
            _scale(scale, shape, scope, axis, group_size, yk)
        return _dense(shape, yk)
    if qr.kind not in kinds.INT8:
        raise UnsupportedError(f"q has dtype {qr.kind}; dequantize takes {', '.join(kinds.INT8)}")
    if yk not in kinds.FLOAT:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; dequantize produces {', '.join(kinds.FLOAT)}")
    check_scale_dtype(scale_dtype, yk)
    rows_view(qr, "q")
    axis = check_scope(qr.shape, scope, axis, group_size, "q")
    _scale(scale, qr.shape, scope, axis, group_size, yk)
    _zero_point(zero_point, qr.shape, scope, axis, group_size)
    return _dense(qr.shape, yk)


@concrete_scalars
def dynamic_quantize_spec(x, scope, range_mode, axis, group_size, out_dtype, qmin, qmax, eps, scale_dtype):
    """``(q, scale, zero_point)`` specs; zero_point an empty (0,) int32 tensor in symmetric mode."""
    xr = _float_input(x, "x", "dynamic_quantize")
    qk = kind_of(out_dtype, "out_dtype")
    mx = lowbit.is_e8m0(scale_dtype)
    m = kinds.math_kind(xr.kind)
    if qk in lowbit.KINDS or mx:
        if qk not in lowbit.KINDS:
            lowbit.check_mx(qk, scope, group_size)
        if range_mode not in MODES:
            raise UnsupportedError(f"mode={range_mode!r}; supported: {', '.join(MODES)}")
        axis = check_scope(xr.shape, scope, axis, group_size)
        if qk in lowbit.FP8:
            if range_mode != "symmetric":
                raise InvalidProblemError(f"mode={range_mode!r}: {qk} has no zero point; fp8 dynamic quantization is "
                                          "symmetric (scale = max(amax, eps) / fp8_max)")
            lowbit.check_fp8_args(qk, None, qmin, qmax)
        else:
            lowbit.check_int4(xr.shape, scope, group_size, qk, "x")
            _resolve_range(qk, range_mode, qmin, qmax)
        positive_scalar(eps, "eps", m)
        if mx:
            lowbit.check_mx(qk, scope, group_size)
        else:
            check_scale_dtype(scale_dtype, xr.kind)
        rows_view(xr, "x")
        pshape = param_shape(xr.shape, scope, axis, group_size)
        zp = _dense(pshape if range_mode == "asymmetric" else (0,), "i32")
        return _dense(lowbit.packed_shape(xr.shape, qk), qk), _dense(pshape, kinds.E8M0 if mx else m), zp
    if qk not in kinds.INT8:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; dynamic_quantize produces {', '.join(kinds.INT8)}")
    if range_mode not in MODES:
        raise UnsupportedError(f"mode={range_mode!r}; supported: {', '.join(MODES)}")
    axis = check_scope(xr.shape, scope, axis, group_size)
    _resolve_range(qk, range_mode, qmin, qmax)
    positive_scalar(eps, "eps", m)
    check_scale_dtype(scale_dtype, xr.kind)
    rows_view(xr, "x")
    pshape = param_shape(xr.shape, scope, axis, group_size)
    return _dense(xr.shape, qk), _dense(pshape, m), _dense(pshape if range_mode == "asymmetric" else (0,), "i32")


# -- training ops ---------------------------------------------------------------------------------
def _grad(dy, xr: ArrayRef) -> ArrayRef:
    d = describe(dy, "dy")
    if tuple(d.shape) != tuple(xr.shape):
        raise InvalidProblemError(f"dy has shape {tuple(d.shape)} but x has shape {tuple(xr.shape)}; "
                                  "the gradient must have the input's shape")
    if d.kind != xr.kind:
        raise InvalidProblemError(f"dy has dtype {d.kind} but x has dtype {xr.kind}; gradients are in the input dtype")
    rows_view(d, "dy")
    return d


@concrete_scalars
def quantize_backward_spec(dy, x, scale, zero_point, scope, axis, group_size, out_dtype, qmin, qmax):
    xr = _float_input(x, "x", "quantize_backward")
    _grad(dy, xr)
    same_device(dy=dy, x=x, scale=scale, zero_point=zero_point)
    qk = kind_of(out_dtype, "out_dtype")
    if qk not in kinds.INT8:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; quantize_backward follows quantize to "
                               f"{', '.join(kinds.INT8)}")
    axis = check_scope(xr.shape, scope, axis, group_size)
    check_range(qk, qmin, qmax)
    _scale(scale, xr.shape, scope, axis, group_size, xr.kind)
    _zero_point(zero_point, xr.shape, scope, axis, group_size)
    rows_view(xr, "x")
    return _dense(xr.shape, xr.kind)


@concrete_scalars
def dequantize_backward_spec(dy, scale, scope, axis, group_size):
    dr = _float_input(dy, "dy", "dequantize_backward")
    same_device(dy=dy, scale=scale)
    axis = check_scope(dr.shape, scope, axis, group_size)
    _scale(scale, dr.shape, scope, axis, group_size, dr.kind)
    rows_view(dr, "dy")
    return _dense(dr.shape, dr.kind)


@concrete_scalars
def fake_quantize_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax):
    return _fake_quantize(x, scale, zero_point, scope, axis, group_size, qmin, qmax)


@concrete_scalars
def fake_quantize_backward_spec(dy, x, scale, zero_point, scope, axis, group_size, qmin, qmax):
    return _fake_quantize(x, scale, zero_point, scope, axis, group_size, qmin, qmax, dy, "fake_quantize_backward")


def _fake_quantize(x, scale, zero_point, scope, axis, group_size, qmin, qmax, dy=None, op="fake_quantize"):
    xr = _float_input(x, "x", op)
    if dy is not None:
        _grad(dy, xr)
    same_device(dy=dy, x=x, scale=scale, zero_point=zero_point)
    fake_quant_range(qmin, qmax)
    axis = check_scope(xr.shape, scope, axis, group_size)
    _scale(scale, xr.shape, scope, axis, group_size, xr.kind)
    _zero_point(zero_point, xr.shape, scope, axis, group_size)
    rows_view(xr, "x")
    return _dense(xr.shape, xr.kind)


MASKS = {"bool": True, "bits": "bits"}     # fake_quantize_with_mask's ``mask`` -> the functional return_mask


def return_mask_of(mask):
    """fake_quantize_with_mask's ``mask`` (``"bool"`` or ``"bits"``) as the functional API's
    ``return_mask``; anything else an InvalidProblemError naming it and the choices."""
    if not isinstance(mask, str) or mask not in MASKS:
        raise InvalidProblemError(f"mask={mask!r:.60}; supported: 'bool' (a bool mask, one byte an element) or "
                                  "'bits' (bit-packed uint8, x.shape[:-1] + (ceil(D / 8),))")
    return MASKS[mask]


@concrete_scalars
def fake_quantize_with_mask_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax, mask):
    """``(y, mask)``: the bool mask has x's shape, the bits ``x.shape[:-1] + (ceil(D / 8),)`` uint8."""
    bits = return_mask_of(mask) == "bits"
    y = fake_quantize_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax)
    return y, (_dense(mask_bits_shape(y[0]), "u8") if bits else (y[0], torch.bool))


@concrete_scalars
def fake_quantize_backward_from_mask_spec(dy, mask):
    dr = _float_input(dy, "dy", "fake_quantize_backward_from_mask")
    rows_view(dr, "dy")
    check_mask_bits(describe(mask, "mask"), dr.shape)
    same_device(dy=dy, mask=mask)
    return _dense(dr.shape, dr.kind)


@concrete_scalars
def fake_quantize_learnable_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax, grad_factor):
    """The learnable op takes floating-point parameters of any dtype (cast to the math precision)."""
    xr = _float_input(x, "x", "fake_quantize_learnable")
    same_device(x=x, scale=scale, zero_point=zero_point)
    fake_quant_range(qmin, qmax, learnable=True)
    real_scalar(grad_factor, "grad_factor", kinds.math_kind(xr.kind))
    axis = check_scope(xr.shape, scope, axis, group_size)
    _param(scale, xr.shape, scope, axis, group_size, "scale", kinds.FLOAT, "a floating-point dtype")
    _param(zero_point, xr.shape, scope, axis, group_size, "zero_point", kinds.FLOAT + ("i32",),
           "a floating-point dtype or int32")
    rows_view(xr, "x")
    return _dense(xr.shape, xr.kind)


@concrete_scalars
def fake_quantize_learnable_backward_spec(dy, x, scale, zero_point, scope, axis, group_size, qmin, qmax,
                                          grad_factor):
    """``(dx, dscale, dzero_point)``: dzero_point is an empty float32 tensor in symmetric mode."""
    xr = _float_input(x, "x", "fake_quantize_learnable_backward")
    _grad(dy, xr)
    same_device(dy=dy, x=x, scale=scale, zero_point=zero_point)
    fake_quant_range(qmin, qmax, learnable=True)
    axis = check_scope(xr.shape, scope, axis, group_size)
    _scale(scale, xr.shape, scope, axis, group_size, xr.kind)
    _zero_point(zero_point, xr.shape, scope, axis, group_size)
    rows_view(xr, "x")
    z_shape = (0,) if zero_point is None else tuple(zero_point.shape)
    return _dense(xr.shape, xr.kind), _dense(tuple(scale.shape), kinds.math_kind(xr.kind)), _dense(z_shape, "f32")


# -- MoE ------------------------------------------------------------------------------------------
def _moe(x, w, dy, row_experts, offsets, strategy):
    if strategy not in STRATEGIES:
        raise InvalidProblemError(f"strategy={strategy!r}; supported: {', '.join(STRATEGIES)}")
    same_device(x=x, w=w, dy=dy, row_experts=row_experts, offsets=offsets)
    refs = [None if t is None else describe(t, n)
            for t, n in ((x, "x"), (w, "w"), (dy, "dy"), (row_experts, "row_experts"), (offsets, "offsets"))]
    return refs[0], check_problem(*refs)


@concrete_scalars
def grouped_matmul_spec(x, w, row_experts, offsets, strategy, trusted_offsets):
    xr, (M, N, K, E) = _moe(x, w, None, row_experts, offsets, strategy)
    return _dense((M, N), xr.kind)


@concrete_scalars
def grouped_matmul_backward_spec(x, w, dy, row_experts, offsets, strategy, need_input, need_weight, dw_dtype,
                                 trusted_offsets):
    """``(dx, dw)``; a gradient not asked for is an empty (0,) tensor of its dtype."""
    xr, (M, N, K, E) = _moe(x, w, dy, row_experts, offsets, strategy)
    dwk = _out_kind("grouped_matmul_backward_weight", xr.kind, dw_dtype)
    dx = _dense((M, K) if need_input else (0,), xr.kind)
    dw = _dense((E, N, K) if need_weight else (0,), dwk)
    return dx, dw


def check_out(out, spec, arg: str, rows: bool = True) -> None:
    """An ``out=`` tensor of the shape and dtype the op would allocate (fp8 / e8m0 may be uint8)."""
    shape, dtype = spec
    ref = describe(out, arg)
    ok = {dtype}
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2, E8M0_DTYPE):
        ok.add(torch.uint8)
    if tuple(ref.shape) != tuple(shape) or out.dtype not in ok:
        raise InvalidProblemError(f"{arg} has shape {tuple(ref.shape)} and dtype {out.dtype}; expected shape "
                                  f"{tuple(shape)} and dtype {' or '.join(sorted(map(str, ok)))}")
    if rows:
        rows_view(ref, arg)


def check_dense_out(out, spec, arg: str) -> None:
    """An ``out=`` tensor as :func:`check_out`, C-contiguous (the MoE ops' outputs, the parameters
    dynamic_quantize writes)."""
    check_out(out, spec, arg, rows=False)
    if not out.is_contiguous():
        raise InvalidProblemError(f"{arg} must be C-contiguous; got strides {tuple(out.stride())} (elements) for "
                                  f"shape {tuple(out.shape)}")
