"""Training ops (docs/api.md, docs/numerics.md): straight-through backward passes, fake quantization and LSQ.

    dx         = quantize_backward(dy, x, scale, zero_point=None, *, scope, ...)
    dq         = dequantize_backward(dy, scale, *, scope, ...)
    y          = fake_quantize(x, scale, zero_point=None, *, scope, ..., qmin=-128, qmax=127)
    y, mask    = fake_quantize(..., return_mask=True)         # bool, one byte an element
    y, bits    = fake_quantize(..., return_mask="bits")       # uint8 (..., ceil(D / 8)), one bit an element
    dx         = fake_quantize_backward(dy, x, scale, zero_point=None, *, scope, ...)
    dx         = fake_quantize_backward_from_mask(dy, bits)
    dx, ds, dz = fake_quantize_learnable_backward(dy, x, scale, zero_point=None, *, scope, ...,
                                                  grad_factor=1.0)

Gradients and fake-quantized values come back in the input dtype; ``ds`` in the scale's dtype
(float32, float64 for float64 inputs); ``dz`` in float32, as PyTorch's learnable zero point
(``None`` in symmetric mode). ``zero_point=None`` is symmetric mode: quantize_backward implies
quantize's zero point (0 for int8, 128 for uint8); the fake-quant ops imply ``(qmin + qmax + 1) // 2``.
Every check happens before any launch; errors are typed and name the argument. See docs/training.md.
Values held in device arrays (scales, zero points) are checked by the kernels as they read them,
without a host sync: an invalid scale element poisons its outputs (NaN) and is reported as a
:class:`runtime.DeviceValueError` by the next call on the device or by ``runtime.check()``
(runtime/status.py); ``runtime.sync_checks()`` checks them on the host before the launch instead.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import sys
from dataclasses import dataclass
from typing import Optional, Union

from .. import kinds, status
from ..arrays import ArrayRef, as_array, device_of, empty, kind_of, stream_handle
from ..device import driver
from ..errors import InvalidProblemError, UnsupportedError
from ..launch import PreparedLaunch
from ..numerics import LSQ_TILE_ROWS, fake_quant_zero_point, lsq_team
from ..params import channel_params, check_apart, out_arg, real_scalar, same_device, scale_arg, zero_point_arg
from ..plans import Descriptor, Launcher, cached_plan
from ..signatures import functional
from ..scopes import RowsView, check_range, check_scope, implied_zero_point, param_shape, rows_view
from ..vectors import fits, streams, stream_word
from .signatures import (DEFAULT_QMAX, DEFAULT_QMIN, DEQUANTIZE_BACKWARD, FAKE_QUANTIZE, FAKE_QUANTIZE_BACKWARD,
                         FAKE_QUANTIZE_BACKWARD_FROM_MASK, FAKE_QUANTIZE_LEARNABLE_BACKWARD, QUANTIZE_BACKWARD)
from .static import launch_elementwise

QLIMIT = 2 ** 24                         # |qmin|, |qmax| bound: integers float32 holds exactly


# -- validation ---------------------------------------------------------------------------------
def _float_array(a, arg: str, op: str) -> ArrayRef:
    ref = as_array(a, arg)
    if ref.kind not in kinds.FLOAT:
        raise UnsupportedError(f"{arg} has dtype {ref.kind}; {op} takes {', '.join(kinds.FLOAT)}")
    return ref


def _grad_array(dy, x: ArrayRef) -> ArrayRef:
    """dy: the same shape and dtype as x (gradients are in the input dtype)."""
    d = as_array(dy, "dy")
    if tuple(d.shape) != tuple(x.shape):
        raise InvalidProblemError(f"dy has shape {tuple(d.shape)} but x has shape {tuple(x.shape)}; "
                                  "the gradient must have the input's shape")
    if d.kind != x.kind:
        raise InvalidProblemError(f"dy has dtype {d.kind} but x has dtype {x.kind}; "
                                  "gradients are in the input dtype")
    return d


def fake_quant_range(qmin, qmax, learnable: bool = False):
    """Validated (qmin, qmax) of the fake-quant ops: integers, qmin < qmax, |q| <= 2**24;
    LSQ also needs qmin <= 0 <= qmax (as PyTorch)."""
    for name, v in (("qmin", qmin), ("qmax", qmax)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool):
            raise InvalidProblemError(f"{name}={v!r} must be an integer")
        if not -QLIMIT <= v <= QLIMIT:
            raise InvalidProblemError(f"{name}={v} is outside [-2**24, 2**24] (integers float32 holds exactly)")
    qmin, qmax = int(qmin), int(qmax)
    if qmin >= qmax:
        raise InvalidProblemError(f"qmin={qmin} must be < qmax={qmax}")
    if learnable and not qmin <= 0 <= qmax:
        raise InvalidProblemError(f"qmin={qmin}, qmax={qmax}: fake_quantize_learnable_backward needs "
                                  "qmin <= 0 <= qmax (as PyTorch's learnable fake quantization)")
    return qmin, qmax


@dataclass
class _Params:
    axis: Optional[int]
    scale: Union[ArrayRef, float]
    mode: str
    zp: Union[ArrayRef, int, None]      # as given (validated)
    zp_array: Optional[ArrayRef]        # the array the kernel reads, or None
    zp_value: int                       # the scalar zero point otherwise


def _empty_param(p, x: ArrayRef, scope, axis, group_size, arg: str, kind: str):
    """A parameter array with no elements (x is empty): shape and dtype only (nothing is read)."""
    if p is None or isinstance(p, numbers.Number):
        return None
    ref = as_array(p, arg)
    if ref.size:
        return None
    want = param_shape(x.shape, scope, axis, group_size)
    if tuple(ref.shape) != tuple(want):
        raise InvalidProblemError(f"{arg} has shape {tuple(ref.shape)}; scope={scope!r} needs {tuple(want)}")
    if ref.kind != kind:
        raise InvalidProblemError(f"{arg} has dtype {ref.kind}; {kind} is required for {x.kind} data")
    return ref


def _params(x: ArrayRef, scale, zero_point, scope, axis, group_size, qmin, qmax, zp_symmetric) -> _Params:
    axis = check_scope(x.shape, scope, axis, group_size)
    mk = kinds.math_kind(x.kind)
    s = _empty_param(scale, x, scope, axis, group_size, "scale", mk) if x.size == 0 else None
    s = s or scale_arg(scale, x, scope, axis, group_size, mk)
    if zero_point is None:
        return _Params(axis, s, "symmetric", None, None, zp_symmetric)
    zp = _empty_param(zero_point, x, scope, axis, group_size, "zero_point", "i32") if x.size == 0 else None
    zp = zp or zero_point_arg(zero_point, x.shape, scope, axis, group_size, qmin, qmax, x)
    if isinstance(zp, ArrayRef):
        return _Params(axis, s, "asymmetric", zp, zp, 0)
    return _Params(axis, s, "asymmetric", zp, None, zp)


def _null_stream(like: ArrayRef, kind: str):
    """A null output stream (the kernel skips its stores): fake_quantize without a mask."""
    cols = like.shape[-1] if like.ndim else 1
    rows = math.prod(like.shape[:-1]) if like.ndim else 1
    return ArrayRef(None, 0, tuple(like.shape), (), kind, like.device, like.framework), RowsView(rows, cols, max(cols, 1))


def _elementwise(rec, op, p: _Params, ins, outs, shape, scope, group_size, element, qmin, qmax, bits=()):
    """ins / outs: (ArrayRef, RowsView) in the kernel's stream order; every check has passed;
    ``bits``: the streams passed bit-packed."""
    mode = None if op == "dequantize_backward" else p.mode
    launch_elementwise(op, mode, element, element, ins, outs, p.scale, p.zp_array, p.zp_value, shape, scope, p.axis,
                       group_size, qmin, qmax, rec, bits=bits)


def _straight_through(rec, op, dyr, xr, p, out, scope, group_size, qmin, qmax):
    """Launch a straight-through backward (dy, x -> dx) and remember the call for replay."""
    ins = [(dyr, rows_view(dyr, "dy")), (xr, rows_view(xr, "x"))]
    same_device(("dy", dyr), ("x", xr), ("scale", p.scale), ("zero_point", p.zp))
    outr = out_arg(out, xr, xr.shape, xr.kind)
    same_device(("x", xr), ("out", outr))
    if out is not None:
        check_apart(rec, {"dy": dyr, "x": xr, "scale": p.scale, "zero_point": p.zp, "out": outr}, ("out",),
                    in_place=("dy", "x"))
    _elementwise(rec, op, p, ins, [(outr, rows_view(outr, "out"))], xr.shape, scope, group_size, xr.kind,
                 qmin, qmax)
    rec.remember(outr.obj, (qmin, qmax))
    return outr.obj


# -- straight-through backward passes ------------------------------------------------------------


def _quantize_backward(rec, dy, x, scale, zero_point, out, scope, axis, group_size, out_dtype, qmin, qmax):
    xr = _float_array(x, "x", "quantize_backward")
    dyr = _grad_array(dy, xr)
    qk = kind_of(out_dtype, "out_dtype")
    if qk not in kinds.INT8:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; quantize_backward follows quantize to "
                               f"{', '.join(kinds.INT8)}")
    check_scope(xr.shape, scope, axis, group_size)
    qmin, qmax = check_range(qk, qmin, qmax)
    p = _params(xr, scale, zero_point, scope, axis, group_size, qmin, qmax, implied_zero_point(qk))
    return _straight_through(rec, "quantize_backward", dyr, xr, p, out, scope, group_size, qmin, qmax)


quantize_backward = functional(QUANTIZE_BACKWARD, _quantize_backward, __name__)




def _dequantize_backward(rec, dy, scale, out, scope, axis, group_size):
    dyr = _float_array(dy, "dy", "dequantize_backward")
    p = _params(dyr, scale, None, scope, axis, group_size, 0, 0, 0)
    ins = [(dyr, rows_view(dyr, "dy"))]
    same_device(("dy", dyr), ("scale", p.scale))
    outr = out_arg(out, dyr, dyr.shape, dyr.kind)
    same_device(("dy", dyr), ("out", outr))
    if out is not None:
        check_apart(rec, {"dy": dyr, "scale": p.scale, "out": outr}, ("out",), in_place=("dy",))
    _elementwise(rec, "dequantize_backward", p, ins, [(outr, rows_view(outr, "out"))], dyr.shape, scope,
                 group_size, dyr.kind, 0, 0)
    rec.remember(outr.obj)
    return outr.obj


dequantize_backward = functional(DEQUANTIZE_BACKWARD, _dequantize_backward, __name__)


# -- fake quantization ---------------------------------------------------------------------------
def _bool_mask(like: ArrayRef, shape):
    """A bool array in the caller's framework and its uint8 view (what the kernel writes)."""
    m = empty(like, shape, "bool")
    if like.framework == "torch":
        return m, as_array(m.view(sys.modules["torch"].uint8), "mask")
    import cupy as cp
    return m, as_array(m.view(cp.uint8), "mask")


def mask_format(return_mask) -> str:
    """``return_mask`` (False, True or ``"bits"``) as ``"none"``, ``"bool"`` or ``"bits"``; anything
    else an InvalidProblemError naming it and the choices."""
    if return_mask is False or return_mask is True:
        return "bool" if return_mask else "none"
    if isinstance(return_mask, str) and return_mask == "bits":
        return "bits"
    raise InvalidProblemError(f"return_mask={return_mask!r:.60}; supported: False (no mask), True (a bool mask, "
                              "one byte an element) or 'bits' (bit-packed uint8, x.shape[:-1] + (ceil(D / 8),))")


def mask_bits_shape(shape) -> tuple:
    """The shape of a bit-packed mask of an array of ``shape`` (rank >= 1): ``shape[:-1] + (ceil(D / 8),)``,
    bit j of byte b of a row holding element ``8 * b + j`` of that row (docs/numerics.md "Mask bits")."""
    return tuple(shape[:-1]) + (-(-shape[-1] // 8),)


def check_mask_bits(mr: ArrayRef, shape) -> RowsView:
    """The rows view of ``mr`` as the bits of an array of ``shape`` (what fake_quantize_backward_from_mask
    reads): uint8 of :func:`mask_bits_shape`; else an InvalidProblemError naming ``mask``."""
    if mr.kind != "u8":
        raise InvalidProblemError(f"mask has dtype {mr.kind}; fake_quantize_backward_from_mask reads uint8 bits "
                                  "(fake_quantize(..., return_mask='bits'))")
    want = mask_bits_shape(shape)
    if tuple(mr.shape) != want:
        raise InvalidProblemError(f"mask has shape {tuple(mr.shape)}; dy of shape {tuple(shape)} needs bits of shape "
                                  f"{want} (dy.shape[:-1] + (ceil(D / 8),))")
    return rows_view(mr, "mask")




def _mask_stream(xr: ArrayRef, fmt: str):
    """(the mask returned, its stream for the kernel): a bool array (its uint8 view), the bits, or
    None and a null stream."""
    if fmt == "bool":
        mask, mref = _bool_mask(xr, tuple(xr.shape))
    elif fmt == "bits":
        mask = empty(xr, mask_bits_shape(xr.shape), "u8")
        mref = as_array(mask, "mask")
    else:
        return None, _null_stream(xr, "u8")
    return mask, (mref, rows_view(mref, "mask"))


def _fake_quantize(rec, x, scale, zero_point, out, scope, axis, group_size, qmin, qmax, return_mask):
    xr = _float_array(x, "x", "fake_quantize")
    fmt = mask_format(return_mask)
    qmin, qmax = fake_quant_range(qmin, qmax)
    p = _params(xr, scale, zero_point, scope, axis, group_size, qmin, qmax, fake_quant_zero_point(qmin, qmax))
    ins = [(xr, rows_view(xr, "x"))]
    same_device(("x", xr), ("scale", p.scale), ("zero_point", p.zp))
    outr = out_arg(out, xr, xr.shape, xr.kind)
    same_device(("x", xr), ("out", outr))
    if out is not None:
        check_apart(rec, {"x": xr, "scale": p.scale, "zero_point": p.zp, "out": outr}, ("out",), in_place=("x",))
    mask, mstream = _mask_stream(xr, fmt)
    _elementwise(rec, "fake_quantize", p, ins, [(outr, rows_view(outr, "out")), mstream], xr.shape, scope,
                 group_size, xr.kind, qmin, qmax, bits=("mask",) if fmt == "bits" else ())
    result = outr.obj if fmt == "none" else (outr.obj, mask)
    rec.remember(result, (qmin, qmax))
    return result


fake_quantize = functional(FAKE_QUANTIZE, _fake_quantize, __name__)




def _fake_quantize_backward(rec, dy, x, scale, zero_point, out, scope, axis, group_size, qmin, qmax):
    xr = _float_array(x, "x", "fake_quantize_backward")
    dyr = _grad_array(dy, xr)
    qmin, qmax = fake_quant_range(qmin, qmax)
    p = _params(xr, scale, zero_point, scope, axis, group_size, qmin, qmax, fake_quant_zero_point(qmin, qmax))
    return _straight_through(rec, "fake_quantize_backward", dyr, xr, p, out, scope, group_size, qmin, qmax)


fake_quantize_backward = functional(FAKE_QUANTIZE_BACKWARD, _fake_quantize_backward, __name__)




def _from_mask(rec, dy, mask, out):
    op = "fake_quantize_backward_from_mask"
    dyr = _float_array(dy, "dy", op)
    dyv = rows_view(dyr, "dy")
    mr = as_array(mask, "mask")
    mv = check_mask_bits(mr, dyr.shape)
    same_device(("dy", dyr), ("mask", mr))
    outr = out_arg(out, dyr, dyr.shape, dyr.kind)
    same_device(("dy", dyr), ("out", outr))
    if out is not None:
        check_apart(rec, {"dy": dyr, "mask": mr, "out": outr}, ("out",), in_place=("dy",))
    launch_elementwise(op, None, dyr.kind, dyr.kind, [(dyr, dyv), (mr, mv)], [(outr, rows_view(outr, "out"))],
                       0.0, None, 0, dyr.shape, None, None, None, 0, 0, rec, bits=("mask",))
    rec.remember(outr.obj)
    return outr.obj


fake_quantize_backward_from_mask = functional(FAKE_QUANTIZE_BACKWARD_FROM_MASK, _from_mask, __name__)


# -- LSQ -----------------------------------------------------------------------------------------
@dataclass
class LsqArgs:
    """Launch arguments of a fake_quantize_learnable_backward kernel (launch kind ``lsq``)."""

    dy: tuple                   # (ArrayRef, RowsView)
    x: tuple
    dx: tuple
    scale: Union[ArrayRef, float]
    zero_point: Optional[ArrayRef]
    zp_value: int
    ds: ArrayRef                # per scale element, math precision
    dz: Optional[ArrayRef]      # per scale element, float32 (asymmetric mode)
    rows: int
    cols: int
    seg_len: int                # group: group_size; otherwise cols
    chan_inner: int = 1
    chan_count: int = 1
    chan_last: bool = False
    qmin: int = DEFAULT_QMIN
    qmax: int = DEFAULT_QMAX
    grad_factor: float = 1.0
    ds_part: Optional[ArrayRef] = None   # workspace (tensor, channel): partial sums
    dz_part: Optional[ArrayRef] = None
    max_blocks: Optional[int] = None     # caps the grid; the results do not depend on it
    status: int = 0                      # the device's status word (runtime/status.py), or 0: no value checks


def lsq_partials(rows: int, cols: int, scope: str, chan_last: bool) -> int:
    """Elements of each workspace array (ds, dz partials): one per row, or per (tile, column)."""
    if scope in ("token", "group"):
        return 0
    if chan_last:
        return -(-rows // LSQ_TILE_ROWS) * cols
    return rows


def _ptr(a) -> int:
    return a.ptr if isinstance(a, ArrayRef) else 0


class LsqLauncher(Launcher):
    """A segment (or tile) pass that writes dx and per-segment sums, then for tensor and channel
    scopes a finish pass (``<symbol>_finish``) that sums the partials per scale element."""

    args_type = LsqArgs

    def check(self, plan, args: LsqArgs):
        want = [s["kind"] for s in plan.launch["ins"] + plan.launch["outs"]]
        got = [args.dy[0].kind, args.x[0].kind, args.dx[0].kind]
        if got != want:
            raise InvalidProblemError(f"{plan.sku} takes dy, x, dx of {want}, got {got}")
        math_kind = plan.sku.precision.math
        if args.ds.kind != math_kind:
            raise InvalidProblemError(f"ds has dtype {args.ds.kind}; {plan.sku} writes {math_kind}")
        if plan.sku.mode == "asymmetric" and (args.dz is None or args.dz.kind != "f32"):
            raise InvalidProblemError(f"{plan.sku} needs a float32 dz output")
        if plan.sku.scope != "group" and args.seg_len != args.cols:
            raise InvalidProblemError(f"seg_len={args.seg_len}: {plan.sku} takes one segment per row "
                                      f"(seg_len == cols == {args.cols})")
        need = lsq_partials(args.rows, args.cols, plan.sku.scope, args.chan_last)
        for name in ("ds_part", "dz_part") if plan.sku.mode == "asymmetric" else ("ds_part",):
            a = getattr(args, name)
            if need and (a is None or a.size < need or a.kind != math_kind):
                raise InvalidProblemError(f"{name}: the workspace needs {need} elements of {math_kind}")

    def workspace_size(self, plan, args: LsqArgs) -> int:
        n = lsq_partials(args.rows, args.cols, plan.sku.scope, args.chan_last)
        per = 8 if plan.sku.precision.math == "f64" else 4
        return n * per * (2 if plan.sku.mode == "asymmetric" else 1)

    @staticmethod
    def vec_ok(plan, args: LsqArgs) -> bool:
        vec = plan.launch["vec"]
        if (args.cols if args.chan_last else args.seg_len) % vec:
            return False
        return all(fits(a, view.row_stride, stream_word(a.kind, vec)) for a, view in (args.dy, args.x, args.dx))

    def prepare(self, plan, args: LsqArgs) -> list:
        """The launches, as :class:`PreparedLaunch`: the segment (or tile) pass, then for tensor and
        channel scopes the finish pass. ``run`` launches them in order on one stream."""
        dy = args.dy[0]
        dev = dy.device
        props = driver().properties(dev)
        threads = plan.launch["block_threads"]
        cap = args.max_blocks or props["sms"] * max(1, props["max_threads_per_sm"] // threads)
        vec = plan.launch["vec"]
        if args.chan_last:
            work = -(-args.rows // LSQ_TILE_ROWS) * -(-args.cols // vec)   # tiles x column vectors
            team, grid = 1, min(-(-work // threads), cap)
        else:
            team = lsq_team(-(-args.seg_len // vec))
            items = args.rows * (args.cols // args.seg_len)
            grid = min(-(-items // (threads // team)), cap)
        abi = plan.abi()
        values = abi.values(
            dy=args.dy[0].ptr, dy_rs=args.dy[1].row_stride, x=args.x[0].ptr, x_rs=args.x[1].row_stride,
            dx=args.dx[0].ptr, dx_rs=args.dx[1].row_stride, scale=_ptr(args.scale),
            scale_value=0.0 if isinstance(args.scale, ArrayRef) else args.scale, zero_point=_ptr(args.zero_point),
            zp_value=args.zp_value, ds=_ptr(args.ds), dz=_ptr(args.dz), ds_part=_ptr(args.ds_part),
            dz_part=_ptr(args.dz_part), rows=args.rows, cols=args.cols, seg_len=args.seg_len,
            chan_inner=args.chan_inner, chan_count=args.chan_count, chan_last=int(args.chan_last), team=team,
            tile_rows=LSQ_TILE_ROWS, qmin=args.qmin, qmax=args.qmax, grad_factor=args.grad_factor,
            vec_ok=int(self.vec_ok(plan, args)), status=args.status)
        fn = plan.registry.kernel(plan.sku, dev)
        out = [PreparedLaunch(fn, (max(1, grid),), (threads,), abi, values)]
        if not plan.launch.get("finish"):
            return out
        if args.chan_last:
            count, inner, n_items = args.cols, 1, -(-args.rows // LSQ_TILE_ROWS)
        elif plan.sku.scope == "tensor":
            count, inner, n_items = 1, args.rows, args.rows
        else:
            count, inner, n_items = args.chan_count, args.chan_inner, args.rows // args.chan_count
        team2 = lsq_team(n_items)
        grid2 = min(-(-count // (threads // team2)), cap)
        fin = driver().load_function(plan.registry, plan.entry.unit, plan.entry.entry_point("finish"), dev)
        finish = plan.abi("finish")
        out.append(PreparedLaunch(fin, (max(1, grid2),), (threads,), finish,
                                  finish.values(ds_part=_ptr(args.ds_part), dz_part=_ptr(args.dz_part),
                                                ds=_ptr(args.ds), dz=_ptr(args.dz), count=count, inner=inner,
                                                n_items=n_items, team=team2)))
        return out

    def run(self, plan, args: LsqArgs, stream=None):
        if args.rows == 0 or args.cols == 0:
            return
        stream = stream if stream is not None else stream_handle(args.dy[0])
        for prep in self.prepare(plan, args):
            prep.launch(stream)

    def accesses(self, sku, launch: dict) -> dict:
        """The data streams as vectors; the parameters are read element by element."""
        return {"main": tuple(streams(launch, launch["vec"]))}


def _zeros(like: ArrayRef, shape, kind: str):
    arr = empty(like, shape, kind)
    with device_of(arr):
        arr[...] = 0
    return arr




def _lsq(rec, dy, x, scale, zero_point, out, scope, axis, group_size, qmin, qmax, grad_factor, _max_blocks):
    xr = _float_array(x, "x", "fake_quantize_learnable_backward")
    dyr = _grad_array(dy, xr)
    qmin, qmax = fake_quant_range(qmin, qmax, learnable=True)
    g = real_scalar(grad_factor, "grad_factor", kinds.math_kind(xr.kind))
    p = _params(xr, scale, zero_point, scope, axis, group_size, qmin, qmax, fake_quant_zero_point(qmin, qmax))
    mk = kinds.math_kind(xr.kind)
    pshape = param_shape(xr.shape, scope, p.axis, group_size)
    xv, dyv = rows_view(xr, "x"), rows_view(dyr, "dy")
    same_device(("dy", dyr), ("x", xr), ("scale", p.scale), ("zero_point", p.zp))
    outr = out_arg(out, xr, xr.shape, xr.kind)
    same_device(("x", xr), ("out", outr))
    ds_shape = tuple(p.scale.shape) if isinstance(p.scale, ArrayRef) else pshape
    dz_shape = tuple(p.zp.shape) if isinstance(p.zp, ArrayRef) else pshape
    if out is not None:
        check_apart(rec, {"dy": dyr, "x": xr, "scale": p.scale, "zero_point": p.zp, "out": outr}, ("out",),
                    in_place=("dy", "x"))
    if xr.size == 0:
        ds = _zeros(xr, ds_shape, mk)
        dz = None if zero_point is None else _zeros(xr, dz_shape, "f32")
        return outr.obj, ds, dz
    dev = xr.device
    status.raise_pending(dev)       # what an earlier call's kernels found (no sync)
    ds = as_array(empty(xr, ds_shape, mk), "dscale")
    dz = None if zero_point is None else as_array(empty(xr, dz_shape, "f32"), "dzero_point")
    ov = rows_view(outr, "out")
    inner, count, last = channel_params(xr.shape, scope, p.axis)
    n = lsq_partials(xv.rows, xv.cols, scope, last)
    ds_part = dz_part = None
    refs = ()
    if n:       # one workspace: the ds partials, then (asymmetric) the dz partials
        ws = as_array(empty(xr, (2 * n if dz is not None else n,), mk), "workspace")
        ds_part = dataclasses.replace(ws, shape=(n,))
        if dz is not None:
            dz_part = dataclasses.replace(ws, shape=(n,), ptr=ws.ptr + n * ws.itemsize)
            refs = (("dz_part", ws, n * ws.itemsize),)
    args = LsqArgs(dy=(dyr, dyv), x=(xr, xv), dx=(outr, ov), scale=p.scale, zero_point=p.zp_array,
                   zp_value=p.zp_value, ds=ds, dz=dz, rows=xv.rows, cols=xv.cols,
                   seg_len=group_size if scope == "group" else xv.cols, chan_inner=inner, chan_count=count,
                   chan_last=last, qmin=qmin, qmax=qmax, grad_factor=g, ds_part=ds_part, dz_part=dz_part,
                   max_blocks=_max_blocks, status=status.pointer(dev))
    plan = cached_plan(Descriptor("fake_quantize_learnable_backward", scope, p.mode, xr.kind, xr.kind))
    plan.launcher.check(plan, args)
    stream = stream_handle(dyr)
    for k, prep in enumerate(plan.launcher.prepare(plan, args)):
        prep.launch(stream)
        rec.add_launch(prep, dyr, params=("scale_value", "zp_value") if k == 0 else None,
                        refs=tuple((prep.abi.slot[name], ref, off) for name, ref, off in refs))
    result = (outr.obj, ds.obj, None if dz is None else dz.obj)
    rec.remember(result, (qmin, qmax))
    return result


fake_quantize_learnable_backward = functional(FAKE_QUANTIZE_LEARNABLE_BACKWARD, _lsq, __name__)
