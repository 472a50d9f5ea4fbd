"""GPU checker of op ``dynamic_quantize`` (the dynamic family of :mod:`codegen.harness.families`).

Per SKU: random data over a spread of magnitudes plus the edge cases (all-zero
rows, constant rows, one huge outlier, NaN and ±inf inside a row, all-NaN rows, rows of
length 1, 70,000+ rows, long rows past the register path, strided rows, empty tensors).
Each case checks, bit for bit against ``runtime.reference.dynamic_quantize_ref``: q, scale
and zero point; then on the device ``q == quantize(x, scale, zp, qmin=qmin, qmax=qmax)``
(and with quantize's default range when the caller gave none and the scales are normal);
then ``|dequantize(q, scale, zp) - x| <= scale / 2`` for the in-range values. Group SKUs also write
their scales (and zero points) column-major on two shapes (``scale_layout`` ``col`` and
``col_aligned``): the same values, at the layout's strides.
"""
from __future__ import annotations


import numpy as np

import runtime as sf
from runtime import kinds
from runtime import reference as ref
from runtime.arrays import numpy_dtype
from runtime.reference import dynamic_quantize_ref, dynamic_range
from runtime.scopes import param_shape

from .base import CheckResult, _record, check_layout, dense_copy, patterned, strided_rows, to_device, to_host

# (shape, axis, group_size, specials): specials puts +-inf rows in (they make a whole tensor's
# scale infinite, so tensor scope gets them only in a small case of its own)
SHAPES = {
    "tensor": [((64, 512), None, None, False), ((3, 5, 77), None, None, False), ((1,), None, None, False),
               ((2, 1, 3, 1, 2, 1, 2, 3), None, None, False), ((1, 100003), None, None, False),
               ((70001, 3), None, None, False), ((9, 40), None, None, True), ((300, 1024), None, None, False)],
    "token": [((70, 256), None, None, True), ((4, 9, 33), None, None, True), ((5, 1), None, None, True),
              ((70001, 8), None, None, True), ((3, 65552), None, None, True), ((2, 70001), None, None, True),
              ((12, 4096), None, None, True), ((9, 2000), None, None, True)],
    "group": [((48, 512), None, 128, True), ((7, 96), None, 32, True), ((3, 4, 60), None, 6, True),
              ((9, 48), None, 3, True), ((5, 64), None, 64, True), ((70001, 32), None, 16, True),
              ((2, 65536), None, 65536, True), ((4, 256), None, 1, True), ((8, 1024), None, 128, True)],
    "channel": [((40, 256), 1, None, True), ((40, 256), 0, None, True), ((3, 6, 5, 32), 1, None, True),
                ((2, 3, 4, 5, 7), -1, None, True), ((2, 2, 2, 2, 2, 2, 2, 16), 3, None, True),
                ((70001, 3), 0, None, True), ((70001, 24), 1, None, True), ((5, 100000), 0, None, True),
                ((600, 4096), 1, None, True), ((17, 1000), 1, None, True), ((257, 40), -1, None, True)],
}
EMPTY = {"tensor": [((0, 64), None, None)], "token": [((4, 0), None, None), ((0, 8), None, None)],
         "group": [((4, 0), None, 16)], "channel": [((5, 0), 0, None), ((0, 7), 1, None)]}


def _ranges(qkind, mode, rng):
    """None (the defaults) most of the time; sometimes a caller range valid for the mode."""
    if rng.random() < 0.7:
        return None, None
    if mode == "symmetric":
        return kinds.QRANGE[qkind]
    lo, hi = dynamic_range(qkind, "asymmetric")[:2]
    return lo + int(rng.integers(0, 20)), hi - int(rng.integers(0, 20))


def _dequant_bad(x, y, s, zp, qmin, qmax, sku, axis, gs):
    """In-range finite values of x whose dequantized value y lies farther than scale/2 away."""
    m = np.float64 if sku.element == "f64" else np.float32
    v, _, nan = ref.quantize_values(x, s, zp, scope=sku.scope, axis=axis, group_size=gs, out_kind=sku.aux_element,
                                    qmin=qmin, qmax=qmax)
    s_full = ref.broadcast_param(np.asarray(s, m), x.shape, sku.scope, axis, gs).astype(np.float64)
    with np.errstate(all="ignore"):
        xm = x.astype(m)
        inside = np.isfinite(xm) & np.isfinite(s_full) & ~nan & (v >= qmin) & (v <= qmax)
        err = np.abs(y.astype(np.float64) - xm.astype(np.float64))
        bad = inside & ~(err <= s_full * (0.5 + 1e-4))
    return int(bad.sum())


def run_case(res, sku, x, fw, rng, axis, gs, strided, label, qmin=None, qmax=None, layout="row"):
    """One case: dynamic_quantize on the device vs the reference, the quantize invariant, dequantize."""
    qk, mode, scope = sku.aux_element, sku.mode, sku.scope
    q_ref, s_ref, zp_ref = dynamic_quantize_ref(x, scope=scope, mode=mode, axis=axis, group_size=gs, out_dtype=qk,
                                                qmin=qmin, qmax=qmax)
    xd = to_device(x, fw)
    if strided and x.ndim >= 2 and x.size:
        xd = strided_rows(xd, 8 + int(rng.integers(0, 9)), fw)
    q, s, zp = sf.dynamic_quantize(xd, scope=scope, mode=mode, axis=axis, group_size=gs, out_dtype=qk,
                                   qmin=qmin, qmax=qmax, scale_layout=layout)
    pshape = param_shape(x.shape, scope, axis, gs)
    check_layout(res, label + " scale", s, pshape, layout)
    check_layout(res, label + " zero_point", zp, pshape, layout)
    if layout != "row":          # quantize / dequantize read C-order parameters
        s, zp = dense_copy(s, fw), dense_copy(zp, fw)
    if type(q) is not type(xd) or type(s) is not type(xd):
        res.failures.append(f"{label}: results are {type(q).__name__}, input {type(xd).__name__}")
        res.mismatches += 1
    _record(res, label + " q", to_host(q), q_ref)
    got = {"scale": (to_host(s), s_ref)}
    if mode == "symmetric":
        if zp is not None:
            res.failures.append(f"{label}: symmetric zero_point is {type(zp).__name__}, not None")
            res.mismatches += 1
    else:
        got["zero_point"] = (to_host(zp), zp_ref)
    for name, (g, w) in got.items():
        if g.shape != w.shape or g.dtype != w.dtype:
            res.failures.append(f"{label}: {name} is {g.dtype}{g.shape}, expected {w.dtype}{w.shape}")
            res.mismatches += 1
        else:   # (0-d scales of scope tensor compared as 1-element arrays)
            _record(res, f"{label} {name}", np.atleast_1d(g), np.atleast_1d(w))
    if x.size == 0:
        return
    eff_min, eff_max, _ = dynamic_range(qk, mode, qmin, qmax)
    finite = bool(np.isfinite(s_ref).all())
    # an infinite scale (an inf in the slice) is legal here, by definition, but invalid for
    # quantize() (its kernel poisons and reports it): the invariant is checked for finite scales
    if finite:
        q2 = sf.quantize(xd, s, zp, scope=scope, axis=axis, group_size=gs, out_dtype=qk, qmin=eff_min, qmax=eff_max)
        _record(res, label + " q == quantize(x, scale, zp, qmin, qmax)", to_host(q2), to_host(q))
        normal = finite and bool((np.abs(s_ref) >= np.finfo(s_ref.dtype).tiny).all())
        if qmin is None and qmax is None and normal:
            q3 = sf.quantize(xd, s, zp, scope=scope, axis=axis, group_size=gs, out_dtype=qk)
            _record(res, label + " q == quantize(x, scale, zp)", to_host(q3), to_host(q))
    mkind = "f64" if sku.element == "f64" else "f32"
    y = ref.dequantize(q_ref, s_ref, zp_ref, scope=scope, axis=axis, group_size=gs, in_kind=qk, out_dtype=mkind)
    if finite:   # the device's dequantize of the device's q, s, zp: the reference's bits
        y_dev = sf.dequantize(q, s, zp, scope=scope, axis=axis, group_size=gs, out_dtype=mkind)
        _record(res, label + " runtime.dequantize(q, scale, zp) == reference", to_host(y_dev), y)
    res.cases += 1
    bad = _dequant_bad(x, y, s_ref, zp_ref, eff_min, eff_max, sku, axis, gs)
    if bad:
        res.mismatches += bad
        res.failures.append(f"{label}: {bad} in-range values dequantize farther than scale/2")


def check_dynamic(sku, rng, preferred_fw="cupy") -> CheckResult:
    res = CheckResult(str(sku), False)
    fw = preferred_fw
    for i, (shape, axis, gs, specials) in enumerate(SHAPES[sku.scope]):
        layouts = ("row", "col", "col_aligned") if sku.scope == "group" and i < 2 else ("row",)
        for strided, layout in [(False, lay) for lay in layouts] + [(True, "row")]:
            if strided and (len(shape) < 2 or np.prod(shape) > 4_000_000):
                continue
            x = patterned(shape, rng, sku.element, specials)
            qmin, qmax = _ranges(sku.aux_element, sku.mode, rng)
            label = f"{shape} axis={axis} gs={gs} strided={strided} layout={layout} qmin={qmin} qmax={qmax}"
            run_case(res, sku, x, fw, rng, axis, gs, strided, label, qmin, qmax, layout)
    for shape, axis, gs in EMPTY[sku.scope]:
        run_case(res, sku, np.zeros(shape, numpy_dtype(sku.element)), fw, rng, axis, gs, False, f"empty {shape}")
    res.passed = res.mismatches == 0 and res.cases > 0
    res.detail = f"{res.cases} cases, {res.mismatches} mismatching elements"
    return res


# the checkers of this family, by op (codegen.harness.families)
CHECKERS = {"dynamic_quantize": check_dynamic}
