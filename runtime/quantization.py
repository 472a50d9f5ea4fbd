"""Functional API of the quantization family (SPEC §3): normalize, plan, launch.

Every check happens before any launch and raises a typed error that names the argument,
the value and what is supported.
"""
from __future__ import annotations

import math

from . import kinds, replay, status
from .arrays import ArrayRef, as_array, kind_of, stream_handle
from .errors import UnsupportedError
from .launch import ElementwiseArgs
from .params import channel_params, check_scale_dtype, out_arg, same_device, scale_arg, zero_point_arg
from .plans import Descriptor, cached_plan
from .scopes import check_range, check_scope, implied_zero_point, rows_view


def launch_elementwise(op, mode, element, aux, ins, outs, scale, zp_array, zp_value, shape, scope, axis,
                       group_size, qmin, qmax, fast=None):
    """Check and launch one static elementwise kernel (templates/quantization/_elementwise.cu.j2).

    ``ins`` / ``outs``: ``(ArrayRef, RowsView)`` in the kernel's stream order; every argument check
    has passed. An empty shape launches nothing. The launch runs on the current stream of the
    first input's framework; ``fast`` (a :class:`runtime.replay.FastCall`) records it for replay. The kernel checks
    the scale and zero-point values it reads and reports to the device's status word."""
    rows, cols = ins[0][1].rows, ins[0][1].cols
    if math.prod(shape) == 0:
        return
    inner, count, last = channel_params(shape, scope, axis)
    dev = ins[0][0].device
    status.raise_pending(dev)
    args = ElementwiseArgs(ins=ins, outs=outs, scale=scale, zero_point=zp_array, zp_value=zp_value, rows=rows,
                           cols=cols, group_size=group_size or 1, chan_inner=inner, chan_count=count,
                           chan_last=last, qmin=qmin, qmax=qmax, status=status.pointer(dev))
    plan = cached_plan(Descriptor(op, scope, mode, element, aux))
    plan.launcher.check(plan, args)
    prep = plan.launcher.prepare(plan, args)
    prep.launch(stream_handle(ins[0][0]))
    if fast is not None:
        fast.add_launch(prep, ins[0][0], params=("scale_value", "zp_value"))


def quantize(x, scale, zero_point=None, *, scope, axis=None, group_size=None, out_dtype="int8",
             qmin=None, qmax=None, out=None, scale_dtype=None):
    """``q = clamp(rne(x / scale) + zero_point, qmin, qmax)`` per scope (SPEC §5).

    ``zero_point=None`` is symmetric mode: the implied zero point is 0 for signed outputs
    and the middle of the range (128) for u8. Low-bit outputs (fp8, packed int4) and
    ``scale_dtype="e8m0"`` (MX block scales): runtime.lowbit, docs/lowbit.md.
    """
    return replay.call("quantize", (scope, axis, group_size, out_dtype, qmin, qmax, scale_dtype), (x, scale, zero_point, out),
                       lambda fast: _quantize(fast, x, scale, zero_point, scope, axis, group_size, out_dtype, qmin,
                                              qmax, out, scale_dtype), scale_at=1)


def _quantize(fast, x, scale, zero_point, scope, axis, group_size, out_dtype, qmin, qmax, out, scale_dtype):
    xr = as_array(x, "x")
    if xr.kind not in kinds.FLOAT:
        raise UnsupportedError(f"x has dtype {xr.kind}; quantize takes {', '.join(kinds.FLOAT)}")
    qk = kind_of(out_dtype, "out_dtype")
    from . import lowbit   # fp8 / packed int4, MX e8m0 scales
    if qk in lowbit.KINDS or lowbit.is_e8m0(scale_dtype):
        return lowbit.quantize(xr, scale, zero_point, scope=scope, axis=axis, group_size=group_size, kind=qk,
                               qmin=qmin, qmax=qmax, out=out, scale_dtype=scale_dtype)
    if qk not in kinds.INT8:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; quantize produces {', '.join(kinds.INT8)}"
                               + (" (low-bit formats: docs/lowbit.md)" if qk in kinds.LOW_BIT else ""))
    check_scale_dtype(scale_dtype, xr.kind)
    xv = rows_view(xr, "x")
    axis = check_scope(xr.shape, scope, axis, group_size)
    qmin, qmax = check_range(qk, qmin, qmax)
    s = scale_arg(scale, xr, scope, axis, group_size, kinds.math_kind(xr.kind))
    mode = "symmetric" if zero_point is None else "asymmetric"
    zp = None if zero_point is None else zero_point_arg(zero_point, xr.shape, scope, axis, group_size, qmin, qmax, xr)
    same_device([xr, s, zp])
    zp_value = implied_zero_point(qk) if zp is None else (zp if isinstance(zp, int) else 0)
    return _static(fast, "quantize", mode, xr, xv, out, s, zp, zp_value, scope, axis, group_size, xr.kind, qk,
                   qmin, qmax, qk)


def _static(fast, op, mode, x: ArrayRef, xv, out, scale, zp, zp_value, scope, axis, group_size, element, aux,
            qmin, qmax, out_kind):
    """quantize / dequantize after their checks: allocate (or check) the output, launch, remember."""
    outr = out_arg(out, x, x.shape, out_kind)
    same_device([x, outr])
    if x.size == 0:
        return outr.obj
    launch_elementwise(op, mode, element, aux, [(x, xv)], [(outr, rows_view(outr, "out"))], scale,
                       zp if isinstance(zp, ArrayRef) else None, zp_value, x.shape, scope, axis, group_size,
                       qmin, qmax, fast)
    fast.remember(outr.obj, (qmin, qmax))
    return outr.obj


def dequantize(q, scale, zero_point=None, *, scope, axis=None, group_size=None, out_dtype="float32", out=None,
               in_dtype=None, scale_dtype=None):
    """``y = (q - zero_point) * scale`` per scope, rounded once to ``out_dtype`` (SPEC §5).

    Low-bit inputs (runtime.lowbit, docs/lowbit.md): a torch fp8 tensor, or a uint8 container with
    ``in_dtype`` = ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"int4"`` (s4) or ``"uint4"`` (u4, packed two
    per byte); ``scale_dtype="e8m0"`` for MX block scales.
    """
    return replay.call("dequantize", (scope, axis, group_size, out_dtype, in_dtype, scale_dtype), (q, scale, zero_point, out),
                       lambda fast: _dequantize(fast, q, scale, zero_point, scope, axis, group_size, out_dtype, out,
                                                in_dtype, scale_dtype), scale_at=1)


def _dequantize(fast, q, scale, zero_point, scope, axis, group_size, out_dtype, out, in_dtype, scale_dtype):
    qr = as_array(q, "q")
    from . import lowbit   # fp8 / packed int4, MX e8m0 scales
    low = lowbit.input_kind(qr, in_dtype)
    if low is not None or lowbit.is_e8m0(scale_dtype):
        return lowbit.dequantize(qr, scale, zero_point, scope=scope, axis=axis, group_size=group_size,
                                 kind=low or qr.kind, out_dtype=out_dtype, out=out, scale_dtype=scale_dtype)
    if qr.kind not in kinds.INT8:
        raise UnsupportedError(f"q has dtype {qr.kind}; dequantize takes {', '.join(kinds.INT8)}")
    yk = kind_of(out_dtype, "out_dtype")
    if yk not in kinds.FLOAT:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; dequantize produces {', '.join(kinds.FLOAT)}")
    check_scale_dtype(scale_dtype, yk)
    qv = rows_view(qr, "q")
    axis = check_scope(qr.shape, scope, axis, group_size, "q")
    lo, hi = kinds.QRANGE[qr.kind]
    s = scale_arg(scale, qr, scope, axis, group_size, kinds.math_kind(yk))
    mode = "symmetric" if zero_point is None else "asymmetric"
    zp = None if zero_point is None else zero_point_arg(zero_point, qr.shape, scope, axis, group_size, lo, hi, qr)
    same_device([qr, s, zp])
    zp_value = implied_zero_point(qr.kind) if zp is None else (zp if isinstance(zp, int) else 0)
    return _static(fast, "dequantize", mode, qr, qv, out, s, zp, zp_value, scope, axis, group_size, qr.kind, yk,
                   lo, hi, yk)
