"""Checker of the static quantize / dequantize SKUs (s8 / u8; the low-bit ones: lowbit.py)."""
from __future__ import annotations

import contextlib
import math

import numpy as np

import runtime as sf
from runtime import kinds
from runtime import reference as ref
from runtime.arrays import numpy_dtype
from runtime.launch import grid_cap
from runtime.scopes import param_shape

from .base import CheckResult, _pow2_scales, _random_floats, _record, _shapes, framework_for, strided_rows, to_device, \
    to_host

POISON_NAN16 = 0x7FFF      # a poisoned bfloat16 / float16 output: the canonical NaN of a conversion to 16 bits


def check_static(sku, rng, preferred_fw="cupy") -> CheckResult:
    res = CheckResult(str(sku), False)
    float_kind = sku.element if sku.op == "quantize" else sku.aux_element
    qkind = sku.aux_element if sku.op == "quantize" else sku.element
    math_kind = "f64" if float_kind == "f64" else "f32"
    fw = framework_for(float_kind, preferred_fw)
    lo, hi = kinds.QRANGE[qkind]
    for shape, axis, gs in _shapes(sku.scope, rng):
        for strided in (False, True):
            if strided and len(shape) < 2:
                continue
            pshape = param_shape(shape, sku.scope, None if axis is None else axis % len(shape), gs)
            scale = _pow2_scales(pshape, rng, math_kind)
            qmin, qmax = (lo, hi) if rng.random() < 0.5 else (lo + 3, hi - 5)
            zp = rng.integers(qmin, qmax + 1, size=pshape).astype(np.int32) if sku.mode == "asymmetric" else None
            label = f"{shape} axis={axis} gs={gs} strided={strided}"
            # strided cases also run on a 2-block grid: every row loop of the kernel strides
            with grid_cap(2) if strided else contextlib.nullcontext():
                _static_case(sku, res, label, shape, axis, gs, strided, scale, zp, qmin, qmax, qkind, float_kind,
                             pshape, fw, rng)
                if not strided and math.prod(shape) and math.prod(pshape):   # something to poison
                    _static_case(sku, res, label, shape, axis, gs, strided, scale, zp, qmin, qmax, qkind,
                                 float_kind, pshape, fw, rng, plant=True)
    res.passed = res.mismatches == 0 and res.cases > 0
    res.detail = f"{res.cases} cases, {res.mismatches} mismatching elements"
    return res


def _static_case(sku, res, label, shape, axis, gs, strided, scale, zp, qmin, qmax, qkind, float_kind, pshape, fw,
                 rng, plant=False):
    """One quantize / dequantize case against the reference. ``plant``: one scale element made NaN or 0
    (asymmetric: or one zero point outside [qmin, qmax], for dequantize outside the code range): the
    outputs that depend on it are the op's poison (quantize: qmin; dequantize: NaN), every other output
    is the reference's, and the next check point raises DeviceValueError naming the argument."""
    from runtime.status import DeviceValueError
    lo, hi = kinds.QRANGE[qkind]
    s_arg, z_arg, where, arg = scale, zp, None, None
    if plant:
        bad = np.zeros(pshape, bool)
        at = tuple(int(rng.integers(0, n)) for n in pshape)
        bad[at] = True
        s_arg, z_arg = np.array(scale), None if zp is None else np.array(zp)     # (0-d arrays for tensor scope)
        if z_arg is not None and rng.random() < 0.5:
            z_arg[at], arg = (qmax + 1 if sku.op == "quantize" else hi + 1), "zero_point"
        else:
            s_arg[at], arg = (np.nan if rng.random() < 0.5 else 0.0), "scale"
        where = np.broadcast_to(ref.broadcast_param(bad, shape, sku.scope, axis, gs), shape)
        label = f"{label} planted {arg} at {at}"
    zd = None if z_arg is None else to_device(z_arg, fw)
    if sku.op == "quantize":
        x = _random_floats(shape, ref.broadcast_param(scale.astype(np.float64), shape, sku.scope, axis, gs),
                           rng, float_kind)
        want = ref.quantize(x, scale, zp, scope=sku.scope, axis=axis, group_size=gs, out_dtype=qkind,
                            qmin=qmin, qmax=qmax)
        xd = to_device(x, fw)
        if strided:
            xd = strided_rows(xd, 8 + int(rng.integers(0, 8)), fw)
        sd = to_device(s_arg, fw) if pshape or plant or rng.random() < 0.5 else float(s_arg)
        got = sf.quantize(xd, sd, zd, scope=sku.scope, axis=axis, group_size=gs, out_dtype=qkind, qmin=qmin,
                          qmax=qmax)
    else:
        q = rng.integers(lo, hi + 1, size=shape).astype(numpy_dtype(qkind))
        want = ref.dequantize(q, scale, zp, scope=sku.scope, axis=axis, group_size=gs, in_kind=qkind,
                              out_dtype=float_kind)
        qd = to_device(q, fw)
        if strided:
            qd = strided_rows(qd, 16 + int(rng.integers(0, 8)), fw)
        got = sf.dequantize(qd, to_device(s_arg, fw), zd, scope=sku.scope, axis=axis, group_size=gs,
                            out_dtype=float_kind)
    if plant:
        if sku.op == "quantize":
            want[where] = qmin
        else:
            want[where] = np.nan
            if want.dtype.itemsize == 2:        # the poison's bits in a 16-bit float (docs/errors.md)
                want.view(np.uint16)[where] = POISON_NAN16
    _record(res, label, to_host(got), want)
    if not plant:
        return
    try:
        sf.check()
    except DeviceValueError as e:
        if (e.op, e.arg) != (sku.op, arg):
            res.mismatches += 1
            res.failures.append(f"{label}: DeviceValueError names {e.op} / {e.arg}")
    else:
        res.mismatches += 1
        res.failures.append(f"{label}: no DeviceValueError at the check point")


# the checkers of this family, by op (codegen.harness.families)
CHECKERS = {"quantize": check_static, "dequantize": check_static}
