"""Dynamic-range quantization: ``q, scale, zero_point = dynamic_quantize(x, ...)``.

Per scope element, the kernels reduce the slice of ``x`` (max |x|, or min/max including 0;
NaN ignored), derive ``scale`` (and ``zero_point``) exactly as docs/numerics.md defines them and quantize, so that
``q == quantize(x, scale, zero_point, qmin=qmin, qmax=qmax)`` bit for bit.

Two launch kinds:

* ``dynamic_fused`` (token, group): one kernel, one launch; a row group (one scale element)
  is reduced and quantized from registers, so ``x`` is read once from DRAM.
* ``dynamic_reduce`` (tensor, channel): the SKU's kernel runs twice (phase 0: per-block
  partial results into a workspace; phase 1: one warp per scale element combines them in a
  fixed order), then the static ``quantize`` kernel of the same scope applies the scales.
  Per-tensor over a contiguous x (s8 / u8 outputs) takes one cooperative launch instead
  (``<symbol>_coop``, ``dyn::coop``): reduce with part of x kept in shared memory, a
  grid-wide barrier, the scale combined identically in every block, then quantize. Per-channel
  on the last axis of a contiguous x (s8 / u8) takes one launch too (``<symbol>_chan``,
  ``dyn::chan``): column tiles x row parts, the parts' ranges folded by integer max on
  the bits of non-negative numbers (exact: any order gives the same bits), a grid barrier where
  there are several parts. The schedule ``two-pass`` (runtime/tuning.py) forces the two passes.
  The same input gives the same bits on every run. The workspace is allocated by the caller's
  framework; ``Plan.workspace_size(args)`` reports it.
"""
from __future__ import annotations

from .. import kinds, replay, status
from ..arrays import ArrayRef, as_array, device_of, empty, kind_of, stream_handle
from ..axes import MODES
from ..config import settings
from ..device import driver
from ..errors import InvalidProblemError, UnsupportedError
from ..numerics import dynamic_range, empty_slice_params
from ..params import check_apart, check_param_shape, check_scale_dtype, out_arg, positive_scalar, same_device
from ..plans import Descriptor, cached_plan
from ..signatures import functional
from ..scopes import check_range, check_scope, implied_zero_point, param_shape, rows_view
from . import lowbit
from .fused import DynamicArgs
from .signatures import DYNAMIC_QUANTIZE
from .static import code_out


# -- the functional API ------------------------------------------------------------------------
def _resolve_range(qk: str, mode: str, qmin, qmax):
    """(qmin, qmax, zp_value) after validation; symmetric zero point = the implied one."""
    if mode == "symmetric":
        dmin, dmax, _ = dynamic_range(qk, mode)
        qmin, qmax = check_range(qk, dmin if qmin is None else qmin, dmax if qmax is None else qmax)
        zp, implied = (qmin + qmax + 1) // 2, implied_zero_point(qk)
        if zp != implied:
            raise InvalidProblemError(
                f"qmin={qmin}, qmax={qmax}: symmetric mode's zero point (qmin + qmax + 1) // 2 = {zp} differs from "
                f"{implied}, the zero point that quantize/dequantize(zero_point=None) imply for {qk}; "
                f"use a range centred on {implied} (default {dmin}..{dmax}) or mode='asymmetric'")
        return qmin, qmax, implied
    qmin, qmax = check_range(qk, qmin, qmax)
    return qmin, qmax, 0


def _fill(like: ArrayRef, shape, kind: str, value):
    """A new array of ``shape`` in the caller's framework, filled with ``value``."""
    a = empty(like, shape, kind)
    _fill_into(a, like.framework, value)
    return a


def _fill_into(obj, framework: str, value) -> None:
    """Sets every element of a caller's array: torch ``fill_``, CuPy ``fill``, or, for another object
    with ``__cuda_array_interface__`` (no ``fill`` of its own), through a zero-copy CuPy view."""
    if framework == "torch":
        obj.fill_(value)
    elif hasattr(obj, "fill"):
        with device_of(obj):
            obj.fill(value)
    else:
        driver().fill_foreign(obj, value)




def _out_tuple(out, mode) -> tuple:
    """``out`` as (q, scale, zero_point or None); three None when absent. Checks its form only."""
    if out is None:
        return None, None, None
    if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
        raise InvalidProblemError(f"out={type(out).__name__}: expected a tuple (q, scale) or (q, scale, zero_point)")
    q, s, z = (*out, None) if len(out) == 2 else tuple(out)
    if q is None or s is None:
        raise InvalidProblemError("out: q and scale are required (out=(q, scale[, zero_point]))")
    if mode == "asymmetric" and z is None:
        raise InvalidProblemError("out: asymmetric mode returns a zero point; pass out=(q, scale, zero_point)")
    if mode != "asymmetric" and z is not None:
        raise InvalidProblemError(f"out: mode={mode!r} has no zero-point output; pass out=(q, scale)")
    return q, s, z


def _code_range(xr, qk: str, mode: str, scope, group_size, qmin, qmax) -> tuple:
    """(qmin, qmax, zp_value) of the codes: fp8 symmetric and saturating at its largest value; int4
    and s8 / u8 the range of docs/numerics.md (int4 packed: its shape checked)."""
    k = kinds.kind(qk)
    if k.max is not None:
        if mode != "symmetric":
            raise InvalidProblemError(f"mode={mode!r}: {qk} has no zero point; fp8 dynamic quantization is "
                                      "symmetric (scale = max(amax, eps) / fp8_max)")
        lowbit.check_fp8_args(qk, None, qmin, qmax)
        return -int(k.max), int(k.max), 0
    if k.pack > 1:
        lowbit.check_int4(xr.shape, scope, group_size, qk, "x")
    return _resolve_range(qk, mode, qmin, qmax)


def _empty(xr, qk: str, mode: str, qmin, qmax, eps, mx: bool, pshape, skind: str, outs) -> tuple:
    """An x with no elements: every slice reduces to 0, so the scale (and zero point) of an all-zero
    slice, filled in (``outs``: the given (q, scale, zero_point) arrays), and no kernel."""
    s_val, z_val = empty_slice_params(qk, mode, qmin, qmax, eps, kinds.math_kind(xr.kind), e8m0=mx)
    if outs:
        qref, sref, zref = outs
        _fill_into(sref.obj, sref.framework, s_val)
        if zref is not None:
            _fill_into(zref.obj, zref.framework, int(z_val))
        return qref.obj, sref.obj, None if zref is None else zref.obj
    q = code_out(None, xr, xr.shape, qk).obj
    return q, _fill(xr, pshape, skind, s_val), None if z_val is None else _fill(xr, pshape, "i32", int(z_val))


def _dynamic_quantize(rec, x, q_out, s_out, z_out, scope, mode, axis, group_size, out_dtype, qmin, qmax, eps,
                      scale_dtype, _config, no_out):
    outs = () if no_out else (q_out, s_out, z_out)
    xr = as_array(x, "x")
    if xr.kind not in kinds.FLOAT:
        raise UnsupportedError(f"x has dtype {xr.kind}; dynamic_quantize takes {', '.join(kinds.FLOAT)}")
    qk = kind_of(out_dtype, "out_dtype")
    mx = lowbit.is_e8m0(scale_dtype)
    if mx and qk in kinds.INT8:
        lowbit.check_mx(qk, scope, group_size)          # e8m0 with an s8/u8 output: UnsupportedError
    if qk not in kinds.CODES:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; dynamic_quantize produces {', '.join(kinds.CODES)}")
    if mode not in MODES:
        raise UnsupportedError(f"mode={mode!r}; supported: {', '.join(MODES)}")
    axis = check_scope(xr.shape, scope, axis, group_size)
    qmin, qmax, zp_value = _code_range(xr, qk, mode, scope, group_size, qmin, qmax)
    m = kinds.math_kind(xr.kind)
    eps = positive_scalar(eps, "eps", m)
    if mx:
        lowbit.check_mx(qk, scope, group_size)
    else:
        check_scale_dtype(scale_dtype, xr.kind)
    xv = rows_view(xr, "x")                     # layout errors before anything is allocated
    pshape = param_shape(xr.shape, scope, axis, group_size)
    skind = "u8" if mx else m                   # e8m0 codes live in uint8 arrays
    status.raise_pending(xr.device)
    if outs:
        qref = code_out(outs[0], xr, xr.shape, qk, "out[0] (q)")
        sref = out_arg(outs[1], xr, pshape, skind, "out[1] (scale)")
        zref = None if outs[2] is None else out_arg(outs[2], xr, pshape, "i32", "out[2] (zero_point)")
        for ref, arg in ((sref, "out[1] (scale)"), (zref, "out[2] (zero_point)")):
            if ref is not None:             # the kernels index parameters flat (C order)
                check_param_shape(ref, pshape, scope, arg)
        qv = rows_view(qref, "out[0] (q)")          # its layout errors name the argument
        same_device(("x", xr), ("out[0] (q)", qref), ("out[1] (scale)", sref),
                    ("out[2] (zero_point)", zref))
        # the kernels read x while they write q, scale (and zero_point): all four apart
        check_apart(rec, {"x": xr, "q_out": qref, "s_out": sref, "z_out": zref}, ("q_out", "s_out", "z_out"),
                    labels={"q_out": "out[0] (q)", "s_out": "out[1] (scale)", "z_out": "out[2] (zero_point)"})
    if xr.size == 0:
        return _empty(xr, qk, mode, qmin, qmax, eps, mx, pshape, skind, (qref, sref, zref) if outs else None)
    if not outs:
        qref = code_out(None, xr, xr.shape, qk)
        sref = as_array(empty(xr, pshape, skind), "scale")
        zref = as_array(empty(xr, pshape, "i32"), "zero_point") if mode == "asymmetric" else None
        qv = rows_view(qref, "q")
        same_device(("x", xr), ("q", qref))
    result = qref.obj, sref.obj, None if zref is None else zref.obj
    if mx:
        sref = lowbit.retag(sref, lowbit.E8M0)
    args = DynamicArgs(xr, xv, qref, qv, sref, zref, scope, mode, qmin, qmax, zp_value, eps,
                       axis=axis, group_size=group_size)
    plan = cached_plan(Descriptor("dynamic_quantize", scope, mode, xr.kind, qk), lowbit.preference(xr.device))
    if plan.launcher.one_launch:         # per token / group: the fused kernel
        # one prepared launch: a repeated call re-allocates and re-fills its pointer slots
        plan.launcher.check(plan, args)
        prep = plan.launcher.prepare(plan, args)
        prep.launch(stream_handle(xr))
        rec.add_launch(prep, xr)
    else:
        nbytes = plan.workspace_size(args)
        if nbytes:
            args.workspace = as_array(empty(xr, (nbytes,), "u8"), "workspace")
        plan.run(args)
        # a repeated call re-allocates and re-runs the launcher on the new arrays, without the checks
        rec.set_runner(replay.launcher_runner(plan, args, ("x", "q", "scale", "zero_point", "workspace")), xr)
    rec.remember(result)
    return result


def _replay_key(out) -> tuple:
    """The replay key's values besides the arguments: the launch configuration (a remembered launch
    is replayed as it was chosen) and whether ``out=`` was given."""
    return settings().dynamic_config, out is None


dynamic_quantize = functional(DYNAMIC_QUANTIZE, _dynamic_quantize, __name__, key=_replay_key, unpack_out=_out_tuple)
