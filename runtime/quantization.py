"""Functional API of the quantization family (SPEC §3): validate, allocate, select, launch.

Every check happens before any launch and raises a typed error that names the argument,
the value and what is supported.
"""
from __future__ import annotations

import math
import numbers
import sys

from . import config
from .arrays import ArrayRef, as_array, empty, kind_of
from .errors import InvalidProblemError, UnsupportedError
from .launch import ElementwiseArgs
from .plans import Descriptor, cached_plan
from .scopes import QRANGE, check_range, check_scope, implied_zero_point, param_shape, rows_view

FLOAT_KINDS = ("f32", "f64", "f16", "bf16")
INT_KINDS = ("s8", "u8")


def _math_kind(float_kind: str) -> str:
    return "f64" if float_kind == "f64" else "f32"


def _same_device(refs):
    devs = {(r.framework, r.device) for r in refs if isinstance(r, ArrayRef)}
    if len({d for _, d in devs}) > 1:
        raise InvalidProblemError("arguments live on different devices: "
                                  + ", ".join(f"{fw}:cuda:{d}" for fw, d in sorted(devs)))


def _scale_arg(scale, x: ArrayRef, scope, axis, group_size, math_kind):
    """A scale as an ArrayRef of the scope shape, or a validated Python float (tensor scope)."""
    want = param_shape(x.shape, scope, axis, group_size)
    np_name = "float64" if math_kind == "f64" else "float32"
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        if scope != "tensor":
            raise InvalidProblemError(f"scale is a scalar ({scale!r}) but scope={scope!r} needs an array of shape {want}")
        s = float(scale)
        if not (math.isfinite(s) and s > 0):
            raise InvalidProblemError(f"scale={scale!r}; scales must be positive and finite")
        return s
    ref = as_array(scale, "scale")
    if ref.kind != math_kind:
        raise InvalidProblemError(f"scale has dtype {ref.kind}; {np_name} is required for {x.kind} data")
    _check_param_shape(ref, want, scope, "scale")
    if config.values_checked() and ref.size:
        _device_check(ref, "scale", lambda s, m: m.all(m.isfinite(s) & (s > 0)),
                      "scales must be positive and finite")
    return ref


def _check_param_shape(ref: ArrayRef, want, scope, arg):
    ok = tuple(ref.shape) == tuple(want) or (scope == "tensor" and ref.size == 1 and ref.ndim <= 1)
    if not ok:
        raise InvalidProblemError(f"{arg} has shape {tuple(ref.shape)}; scope={scope!r} needs {tuple(want)}")
    # flat indexing in the kernel: the parameter must be C-contiguous
    expect = 1
    for n, s in reversed(list(zip(ref.shape, ref.strides))):
        if n != 1 and s != expect:
            raise InvalidProblemError(f"{arg} must be C-contiguous (shape {tuple(ref.shape)}, strides {ref.strides})")
        expect *= n


def _zero_point_arg(zero_point, x_shape, scope, axis, group_size, qmin, qmax, device_like):
    want = param_shape(x_shape, scope, axis, group_size)
    if isinstance(zero_point, numbers.Integral) and not isinstance(zero_point, bool):
        if scope != "tensor":
            raise InvalidProblemError(f"zero_point is a scalar ({zero_point!r}) but scope={scope!r} needs an "
                                      f"int32 array of shape {want}")
        if not qmin <= int(zero_point) <= qmax:
            raise InvalidProblemError(f"zero_point={zero_point} is outside [qmin, qmax] = [{qmin}, {qmax}]")
        return int(zero_point)
    ref = as_array(zero_point, "zero_point")
    if ref.kind != "i32":
        raise InvalidProblemError(f"zero_point has dtype {ref.kind}; int32 is required")
    _check_param_shape(ref, want, scope, "zero_point")
    if config.values_checked() and ref.size:
        _device_check(ref, "zero_point", lambda z, m: m.all((z >= qmin) & (z <= qmax)),
                      f"zero points must lie in [qmin, qmax] = [{qmin}, {qmax}]")
    return ref


def _device_check(ref: ArrayRef, arg: str, predicate, what: str):
    """Evaluate ``predicate`` on the device array with its own framework (one sync)."""
    if ref.framework == "torch":
        ok = bool(predicate(ref.obj, sys.modules["torch"]))
    else:
        import cupy as cp
        ok = bool(predicate(ref.obj if ref.framework == "cupy" else cp.asarray(ref.obj), cp))
    if not ok:
        raise InvalidProblemError(f"{arg}: {what} (found a value that is not); "
                                  "see runtime.config.check_values")


def _out_arg(out, like: ArrayRef, shape, kind, arg="out"):
    if out is None:
        return as_array(empty(like, shape, kind), arg)
    ref = as_array(out, arg)
    if tuple(ref.shape) != tuple(shape) or ref.kind != kind:
        raise InvalidProblemError(f"{arg} has shape {tuple(ref.shape)} and dtype {ref.kind}; "
                                  f"expected shape {tuple(shape)} and dtype {kind}")
    if (ref.framework == "torch") != (like.framework == "torch"):
        raise InvalidProblemError(f"{arg} is a {ref.framework} array but the input is {like.framework}")
    return ref


def _channel_params(shape, scope, axis):
    if scope != "channel":
        return 1, 1, False
    if axis == len(shape) - 1:
        return 1, shape[axis], True
    return math.prod(shape[axis + 1:-1]), shape[axis], False


def _launch_elementwise(op, mode, x: ArrayRef, xv, out_obj, scale, zp, zp_value, scope, axis, group_size,
                       element, aux, qmin, qmax, out_kind):
    """Allocate (or check) the output, then launch. Every input check has already passed."""
    outr = _out_arg(out_obj, x, x.shape, out_kind)
    _same_device([x, outr])
    if x.size == 0:
        return outr
    ov = rows_view(outr, "out")
    inner, count, last = _channel_params(x.shape, scope, axis)
    args = ElementwiseArgs(ins=[(x, xv)], outs=[(outr, ov)], scale=scale, zero_point=zp, zp_value=zp_value,
                           rows=xv.rows, cols=xv.cols, group_size=group_size or 1, chan_inner=inner,
                           chan_count=count, chan_last=last, qmin=qmin, qmax=qmax)
    cached_plan(Descriptor(op, scope, mode, element, aux)).run(args)
    return outr


def quantize(x, scale, zero_point=None, *, scope, axis=None, group_size=None, out_dtype="int8",
             qmin=None, qmax=None, out=None):
    """``q = clamp(rne(x / scale) + zero_point, qmin, qmax)`` per scope (SPEC §5).

    ``zero_point=None`` is symmetric mode: the implied zero point is 0 for signed outputs
    and the middle of the range (128) for u8.
    """
    xr = as_array(x, "x")
    if xr.kind not in FLOAT_KINDS:
        raise UnsupportedError(f"x has dtype {xr.kind}; quantize takes {', '.join(FLOAT_KINDS)}")
    qk = kind_of(out_dtype, "out_dtype")
    if qk not in INT_KINDS:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; quantize produces {', '.join(INT_KINDS)}"
                               + (" (low-bit formats: issue 5)" if qk in ("s4", "u4", "fp8_e4m3", "fp8_e5m2") else ""))
    xv = rows_view(xr, "x")
    axis = check_scope(xr.shape, scope, axis, group_size)
    qmin, qmax = check_range(qk, qmin, qmax)
    s = _scale_arg(scale, xr, scope, axis, group_size, _math_kind(xr.kind))
    mode = "symmetric" if zero_point is None else "asymmetric"
    zp = None if zero_point is None else _zero_point_arg(zero_point, xr.shape, scope, axis, group_size, qmin, qmax, xr)
    _same_device([xr, s, zp])
    zp_value = implied_zero_point(qk) if zp is None else (zp if isinstance(zp, int) else 0)
    outr = _launch_elementwise("quantize", mode, xr, xv, out, s, zp if isinstance(zp, ArrayRef) else None,
                               zp_value, scope, axis, group_size, xr.kind, qk, qmin, qmax, qk)
    return outr.obj


def dequantize(q, scale, zero_point=None, *, scope, axis=None, group_size=None, out_dtype="float32", out=None):
    """``y = (q - zero_point) * scale`` per scope, rounded once to ``out_dtype`` (SPEC §5)."""
    qr = as_array(q, "q")
    if qr.kind not in INT_KINDS:
        raise UnsupportedError(f"q has dtype {qr.kind}; dequantize takes {', '.join(INT_KINDS)}")
    yk = kind_of(out_dtype, "out_dtype")
    if yk not in FLOAT_KINDS:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; dequantize produces {', '.join(FLOAT_KINDS)}")
    qv = rows_view(qr, "q")
    axis = check_scope(qr.shape, scope, axis, group_size, "q")
    lo, hi = QRANGE[qr.kind]
    s = _scale_arg(scale, qr, scope, axis, group_size, _math_kind(yk))
    mode = "symmetric" if zero_point is None else "asymmetric"
    zp = None if zero_point is None else _zero_point_arg(zero_point, qr.shape, scope, axis, group_size, lo, hi, qr)
    _same_device([qr, s, zp])
    zp_value = implied_zero_point(qr.kind) if zp is None else (zp if isinstance(zp, int) else 0)
    outr = _launch_elementwise("dequantize", mode, qr, qv, out, s, zp if isinstance(zp, ArrayRef) else None,
                               zp_value, scope, axis, group_size, qr.kind, yk, lo, hi, yk)
    return outr.obj
