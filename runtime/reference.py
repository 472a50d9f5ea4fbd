"""NumPy reference for every op: the definition the kernels are tested against, bit for bit.

Inputs are NumPy arrays (``ml_dtypes`` for bf16 / fp8). Math is float32 after upcasting
f16/bf16 (float64 for f64), exactly as SPEC §5 and the kernels do it.
"""
from __future__ import annotations

import numpy as np

from .arrays import numpy_dtype
from .scopes import QRANGE, implied_zero_point


def math_dtype(kind_or_dtype) -> np.dtype:
    name = getattr(kind_or_dtype, "name", kind_or_dtype)
    return np.dtype(np.float64) if name in ("f64", "float64") else np.dtype(np.float32)


def broadcast_param(p, shape, scope, axis=None, group_size=None):
    """Expand a per-scope parameter (scale or zero point) to the full shape of x."""
    p = np.asarray(p)
    ndim = len(shape)
    if scope == "tensor":
        return p.reshape(())
    if scope == "channel":
        axis = axis % ndim
        return p.reshape([1] * axis + [shape[axis]] + [1] * (ndim - axis - 1))
    if scope == "token":
        return p.reshape(tuple(shape[:-1]) + (1,))
    if scope == "group":
        return np.repeat(p.reshape(tuple(shape[:-1]) + (-1,)), group_size, axis=-1)
    raise ValueError(scope)


def _qparams(x_shape, scale, zero_point, scope, axis, group_size, math, out_kind, qmin, qmax):
    lo, hi = QRANGE[out_kind]
    qmin = lo if qmin is None else qmin
    qmax = hi if qmax is None else qmax
    s = broadcast_param(np.asarray(scale).astype(math), x_shape, scope, axis, group_size)
    if zero_point is None:
        zp = np.asarray(implied_zero_point(out_kind), dtype=np.int32)
    else:
        zp = broadcast_param(np.asarray(zero_point, dtype=np.int32), x_shape, scope, axis, group_size)
    return s, zp, qmin, qmax


def quantize_values(x, scale, zero_point, *, scope, axis=None, group_size=None, out_kind="s8",
                    qmin=None, qmax=None):
    """Returns (v, q): the unclamped ``rne(x * inv) + zp`` (math precision) and the quantized ints."""
    math = math_dtype(x.dtype)
    s, zp, qmin, qmax = _qparams(x.shape, scale, zero_point, scope, axis, group_size, math, out_kind, qmin, qmax)
    inv = (math.type(1) / s).astype(math)
    with np.errstate(all="ignore"):
        t = (x.astype(math) * inv).astype(math)
        v = (np.rint(t) + zp.astype(math)).astype(math)
        clamped = np.clip(v, math.type(qmin), math.type(qmax))
    nan = np.isnan(t)
    q = np.where(nan, np.broadcast_to(zp, t.shape), clamped).astype(np.int64)
    return v, q, nan


def quantize(x, scale, zero_point=None, *, scope, axis=None, group_size=None, out_dtype="s8",
             qmin=None, qmax=None):
    _, q, _ = quantize_values(x, scale, zero_point, scope=scope, axis=axis, group_size=group_size,
                              out_kind=out_dtype, qmin=qmin, qmax=qmax)
    return q.astype(numpy_dtype(out_dtype))


def dequantize(q, scale, zero_point=None, *, scope, axis=None, group_size=None, in_kind="s8",
               out_dtype="f32"):
    math = math_dtype(out_dtype)
    s = broadcast_param(np.asarray(scale).astype(math), q.shape, scope, axis, group_size)
    if zero_point is None:
        zp = np.int64(implied_zero_point(in_kind))
    else:
        zp = broadcast_param(np.asarray(zero_point, dtype=np.int32), q.shape, scope, axis, group_size)
    y = ((q.astype(np.int64) - zp).astype(math) * s).astype(math)
    return y.astype(numpy_dtype(out_dtype))
