"""Functional API of the quantization family (docs/api.md): normalize, plan, launch.

Every check happens before any launch and raises a typed error that names the argument,
the value and what is supported.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

from .. import kinds, status
from ..arrays import ArrayRef, as_array, kind_of, stream_handle
from ..errors import UnsupportedError
from ..params import channel_params, check_apart, check_scale_dtype, out_arg, same_device, scale_arg, zero_point_arg
from ..plans import Descriptor, cached_plan
from ..signatures import functional
from ..scopes import check_range, check_scope, implied_zero_point, rows_view
from . import lowbit
from .elementwise import ElementwiseArgs
from .signatures import DEQUANTIZE, QUANTIZE


def launch_elementwise(op, mode, element, aux, ins, outs, scale, zp_array, zp_value, shape, scope, axis,
                       group_size, qmin, qmax, rec=None, scale_e8m0=None, cols=None, bits=()):
    """Plan and launch one static elementwise kernel (templates/quantization/elementwise.cuh, or
    templates/quantization/lowbit_kernels.cuh for fp8 / packed int4 / e8m0 scales: the plan's launch kind decides).

    ``ins`` / ``outs``: ``(ArrayRef, RowsView)`` in the kernel's stream order; every argument check
    has passed. ``cols``: elements per row when the first stream is packed (int4). ``bits``: the
    streams passed bit-packed (``ElementwiseArgs.bits``). An empty shape
    launches nothing. The launch runs on the current stream of the first input's framework;
    ``rec`` (a :class:`runtime.replay.Recording`) records it for replay. The kernel checks the scale
    and zero-point values it reads and reports to the device's status word."""
    if math.prod(shape) == 0:
        return
    rows = ins[0][1].rows
    inner, count, last = channel_params(shape, scope, axis)
    dev = ins[0][0].device
    status.raise_pending(dev)
    args = ElementwiseArgs(ins=ins, outs=outs, scale=scale, zero_point=zp_array, zp_value=zp_value, rows=rows,
                           cols=cols or ins[0][1].cols, group_size=group_size or 1, chan_inner=inner,
                           chan_count=count, chan_last=last, qmin=qmin, qmax=qmax, status=status.pointer(dev),
                           scale_e8m0=scale_e8m0, bits=bits)
    plan = cached_plan(Descriptor(op, scope, mode, element, aux), lowbit.preference(dev))
    plan.launcher.check(plan, args)
    prep = plan.launcher.prepare(plan, args)
    prep.launch(stream_handle(ins[0][0]))
    if rec is not None:
        rec.add_launch(prep, ins[0][0], params=("scale_value", "zp_value"))


def code_range(qk: str, zero_point, qmin, qmax, shape, scope, axis, group_size, like: ArrayRef, arg="x"):
    """(qmin, qmax, zero point (ArrayRef, int or None), implied zero-point value) of code kind ``qk``
    from the kind vocabulary: fp8 has no zero point and saturates at its largest finite value;
    integer codes take a range (default: the kind's) and an optional zero point; packed int4
    needs an even last axis."""
    k = kinds.kind(qk)
    if k.max is not None:
        lowbit.check_fp8_args(qk, zero_point, qmin, qmax)
        return -int(k.max), int(k.max), None, 0
    if k.pack > 1:
        lowbit.check_int4(shape, scope, group_size, qk, arg)
    qmin, qmax = check_range(qk, qmin, qmax)
    zp = None if zero_point is None else zero_point_arg(zero_point, shape, scope, axis, group_size, qmin, qmax, like)
    return qmin, qmax, zp, implied_zero_point(qk) if zp is None else (zp if isinstance(zp, int) else 0)


def scales(scale, scale_dtype, qk: str, like: ArrayRef, scope, axis, group_size, float_kind: str) -> tuple:
    """(scale, e8m0 scale): float scales in the math precision of ``float_kind`` (an array or a
    Python float), or MX e8m0 block scales (fp8 codes, groups of 32)."""
    mx = lowbit.is_e8m0(scale_dtype) or (not isinstance(scale, numbers.Number) and scale is not None
                                         and as_array(scale, "scale").kind == kinds.E8M0)
    if mx:
        lowbit.check_mx(qk, scope, group_size)
        return 0.0, lowbit.e8m0_arg(scale, like.shape, scope, axis, group_size)
    check_scale_dtype(scale_dtype, float_kind)
    return scale_arg(scale, like, scope, axis, group_size, kinds.math_kind(float_kind)), None


def code_out(out, like: ArrayRef, shape, qk: str, arg: str = "out") -> ArrayRef:
    """Codes of kind ``qk`` for a logical ``shape``: ``out`` checked, or allocated; low-bit codes live
    in a uint8 container (or a torch fp8 tensor), int4 packed two per byte along the last axis."""
    if qk in kinds.LOW_BIT:
        return lowbit.lowbit_out(out, like, lowbit.packed_shape(shape, qk), qk, arg)
    return out_arg(out, like, shape, qk, arg)




def _quantize(rec, x, scale, zero_point, out, scope, axis, group_size, out_dtype, qmin, qmax, scale_dtype):
    xr = as_array(x, "x")
    if xr.kind not in kinds.FLOAT:
        raise UnsupportedError(f"x has dtype {xr.kind}; quantize takes {', '.join(kinds.FLOAT)}")
    qk = kind_of(out_dtype, "out_dtype")
    if qk not in kinds.CODES:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; quantize produces {', '.join(kinds.CODES)}")
    xv = rows_view(xr, "x")
    axis = check_scope(xr.shape, scope, axis, group_size)
    qmin, qmax, zp, zp_value = code_range(qk, zero_point, qmin, qmax, xr.shape, scope, axis, group_size, xr)
    s, e8 = scales(scale, scale_dtype, qk, xr, scope, axis, group_size, xr.kind)
    same_device(("x", xr), ("scale", s), ("scale", e8), ("zero_point", zp))
    outr = code_out(out, xr, xr.shape, qk)
    same_device(("x", xr), ("out", outr))
    if out is not None:
        check_apart(rec, {"x": xr, "scale": s if e8 is None else e8, "zero_point": zp, "out": outr}, ("out",))
    mode = "symmetric" if zero_point is None else "asymmetric"
    launch_elementwise("quantize", mode, xr.kind, qk, [(xr, xv)], [(outr, rows_view(outr, "out"))], s,
                       zp if isinstance(zp, ArrayRef) else None, zp_value, xr.shape, scope, axis, group_size,
                       qmin, qmax, rec, e8, xv.cols)
    rec.remember(outr.obj, (qmin, qmax))
    return outr.obj


quantize = functional(QUANTIZE, _quantize, __name__)




def _dequantize(rec, q, scale, zero_point, out, scope, axis, group_size, out_dtype, in_dtype, scale_dtype):
    qr = as_array(q, "q")
    low = lowbit.input_kind(qr, in_dtype)
    qk = low or qr.kind
    if qk not in kinds.CODES:
        raise UnsupportedError(f"q has dtype {qr.kind}; dequantize takes {', '.join(kinds.CODES)} codes "
                               "(low-bit codes in a uint8 container name their kind with in_dtype)")
    yk = kind_of(out_dtype, "out_dtype")
    if yk not in kinds.FLOAT:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; dequantize produces {', '.join(kinds.FLOAT)}")
    qv = rows_view(qr, "q")
    pack = kinds.kind(qk).pack
    shape = tuple(qr.shape[:-1]) + (pack * qr.shape[-1],) if qr.shape else tuple(qr.shape)
    axis = check_scope(shape, scope, axis, group_size, "q")
    qref = lowbit.retag(qr, qk)
    like = dataclasses.replace(qref, shape=shape)
    lo, hi, zp, zp_value = code_range(qk, zero_point, None, None, shape, scope, axis, group_size, like, "q (unpacked)")
    s, e8 = scales(scale, scale_dtype, qk, like, scope, axis, group_size, yk)
    same_device(("q", qr), ("scale", s), ("scale", e8), ("zero_point", zp))
    outr = out_arg(out, qr, shape, yk)
    same_device(("q", qr), ("out", outr))
    if out is not None:
        check_apart(rec, {"q": qr, "scale": s if e8 is None else e8, "zero_point": zp, "out": outr}, ("out",))
    mode = "symmetric" if zero_point is None else "asymmetric"
    launch_elementwise("dequantize", mode, qk, yk, [(qref, qv)], [(outr, rows_view(outr, "out"))], s,
                       zp if isinstance(zp, ArrayRef) else None, zp_value, shape, scope, axis, group_size, lo, hi,
                       rec, e8, shape[-1] if shape else 1)
    rec.remember(outr.obj, (lo, hi))
    return outr.obj


dequantize = functional(DEQUANTIZE, _dequantize, __name__)
