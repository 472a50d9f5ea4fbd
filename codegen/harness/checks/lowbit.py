"""GPU checkers of the low-bit SKUs: fp8 e4m3fn / e5m2, packed s4 / u4, e8m0 (MX) scales.

The checkers of ``quantize``, ``dequantize`` and ``dynamic_quantize`` for the SKUs :func:`handles`, in front
of the s8/u8 checkers (which still handle every other SKU). Each SKU runs *itself*: ``runtime.quantization.lowbit.prefer_arch``
selects the sm80 (software conversion) SKU on an sm_89+ GPU too. Everything is bit-exact against
``runtime.reference`` (fp8 and int4 codes, scales, e8m0 codes, zero points; float outputs bit for
bit with NaN == NaN). Cases: fresh random data around the grid, exact ties (power-of-two scales keep
``x * inv`` exact), ±fp8_max and the next float above it, values far beyond, subnormals, ±0,
NaN and ±inf, every fp8 code and every int4 byte on the dequantize side, odd / higher-rank shapes,
strided rows, empty tensors, torch (fp8 dtypes) and CuPy (uint8 containers), MX group-32 scales.
"""
from __future__ import annotations

import math

import numpy as np

import runtime as sf
from runtime import kinds
from runtime.quantization import lowbit
from runtime import reference as ref
from runtime.arrays import numpy_dtype
from runtime.scopes import param_shape

from .base import CheckResult, check_layout, patterned, record, strided_rows, to_device, to_host

KINDS = set(kinds.LOW_BIT)


def handles(sku) -> bool:
    """The low-bit SKUs: these checkers take them, in front of the s8/u8 checkers of the same ops."""
    return bool({sku.element, sku.aux_element} & KINDS)


# -- device access (module functions, so that tests/quantization/test_lowbit_checks.py can run these checkers
#    on the CPU against a reference "device") ----------------------------------------------------------
def put(a: np.ndarray, fw: str, kind: str = None):
    """Host -> device; ``kind`` (fp8) with torch gives a float8 tensor, else uint8 codes stay uint8."""
    if kind in kinds.FP8 and fw == "torch":
        import torch
        t = torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).cuda()
        return t.view(getattr(torch, kinds.kind(kind).torch))
    return to_device(np.ascontiguousarray(a), fw)


def get(a) -> np.ndarray:
    """Device -> host; fp8 tensors come back as their uint8 codes."""
    if type(a).__module__.startswith("torch") and "float8" in str(a.dtype):
        import torch
        return a.view(torch.uint8).cpu().numpy()
    return to_host(a)


def strided(a, extra: int, fw: str):
    return strided_rows(a, extra, fw)


def runs_this_sku(sku, device: int = 0):
    """None when the functional API, under ``prefer_arch(sku)``, selects ``sku`` on this device;
    else the reason it cannot (an sm89 SKU on an sm_80 GPU)."""
    from runtime.plans import Descriptor, Plan
    cc = lowbit.preference(device).arch
    if cc < sku.arch_number:
        return f"the device is sm_{cc}; {sku.arch} kernels need sm_{sku.arch_number}+"
    with lowbit.prefer_arch(sku.arch_number):
        pref = lowbit.preference(device)
    got = Plan.select(Descriptor(sku.op, sku.scope, sku.mode, sku.element, sku.aux_element), pref).sku
    return None if got == sku else f"the runtime selects {got}"


# -- case generation ------------------------------------------------------------------------------------
def shapes(scope: str, kind: str):
    """(shape, axis, group_size): the s8/u8 shapes, made even where int4 needs it (D, group size)."""
    base = {
        "tensor": [((64, 512), None, None), ((3, 5, 77), None, None), ((1,), None, None),
                   ((2, 1, 3, 1, 2, 1, 2, 3), None, None), ((0, 16), None, None)],
        "token": [((70, 256), None, None), ((4, 9, 33), None, None), ((5, 1), None, None), ((0, 64), None, None),
                  ((3, 8200), None, None)],
        "group": [((48, 512), None, 128), ((7, 96), None, 32), ((3, 4, 60), None, 6), ((9, 48), None, 3),
                  ((5, 64), None, 64), ((0, 32), None, 16), ((6, 256), None, 32)],
        "channel": [((40, 256), 1, None), ((40, 256), 0, None), ((3, 6, 5, 32), 1, None), ((2, 3, 4, 5, 7), -1, None),
                    ((2, 2, 2, 2, 2, 2, 2, 16), 3, None), ((0, 8), 1, None)],
    }[scope]
    if kind not in kinds.INT4:
        return base
    out = []
    for shape, axis, gs in base:
        if gs is not None and gs % 2:
            gs *= 2
        if shape[-1] % 2:
            shape = shape[:-1] + (shape[-1] * 2 if gs else shape[-1] + 1,)
        out.append((shape, axis, gs))
    return out


def fp8_values(n: int, kind: str, rng) -> np.ndarray:
    """float64 values (before scaling) that exercise fp8 rounding: random magnitudes from deep in the
    subnormals to far past the max, every tie between neighbouring codes, ±max, the next double
    above max, ±0, ±inf, NaN."""
    mx = kinds.kind(kind).max
    grid = np.arange(256, dtype=np.uint8).view(ref._fp8_dtype(kind)).astype(np.float64)
    g = np.unique(np.abs(grid[np.isfinite(grid)]))
    ties = (g[:-1] + g[1:]) / 2
    special = np.array([mx, -mx, np.nextafter(mx, np.inf), -np.nextafter(mx, np.inf), mx * 1.0625, mx * 4,
                        0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, g[1], -g[1], g[1] / 2, g[1] / 4, -g[1] / 2])
    pick = rng.random(n)
    v = rng.standard_normal(n) * 10.0 ** rng.uniform(np.log10(g[1]) - 1, np.log10(mx) + 1, n)
    v = np.where(pick < 0.35, rng.choice(ties, n) * rng.choice([-1.0, 1.0], n), v)
    v = np.where(pick > 0.97, rng.choice(g, n) * rng.choice([-1.0, 1.0], n), v)
    if n >= len(special):
        v[rng.choice(n, size=len(special), replace=False)] = special
    return v


def int4_values(n: int, kind: str, rng) -> np.ndarray:
    """float64 values (before scaling) around the int4 grid: ties at .5, saturation, NaN/±inf, ±0."""
    lo, hi = kinds.QRANGE[kind]
    pick = rng.random(n)
    v = rng.uniform(lo - 3, hi + 3, n)
    v = np.where(pick < 0.35, rng.integers(lo - 2, hi + 2, n) + 0.5, v)
    v = np.where(pick > 0.97, rng.standard_normal(n) * 1e4, v)
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0])
    if n >= 16:
        v[rng.choice(n, size=len(special), replace=False)] = special
    return v


def _float_data(shape, kind, float_kind, rng, scale_full):
    n = math.prod(shape)
    v = (fp8_values if kind in kinds.FP8 else int4_values)(n, kind, rng).reshape(shape)
    with np.errstate(all="ignore"):
        return (v * scale_full).astype(numpy_dtype(float_kind))


def _scales(pshape, math_kind, rng, mx: bool, pow2: bool):
    if mx:   # e8m0 codes: around 2^0, plus the extremes 2^-127 and 2^127
        c = rng.integers(117, 138, size=pshape).astype(np.uint8)
        if c.size >= 3:
            c.reshape(-1)[:2] = [0, 254]
        return c
    if pow2:
        return (2.0 ** rng.integers(-6, 3, size=pshape)).astype(numpy_dtype(math_kind))
    return (rng.random(pshape) * 2 + 0.01).astype(numpy_dtype(math_kind))


def _framework(preferred: str, case: int) -> str:
    """Alternate frameworks: CuPy (uint8 containers) and torch (fp8 dtypes) both get exercised."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "cupy"
    return preferred if case % 2 == 0 else ("torch" if preferred == "cupy" else "cupy")


def _finish(res: CheckResult) -> CheckResult:
    res.passed = res.mismatches == 0 and res.cases > 0
    res.detail = f"{res.cases} cases, {res.mismatches} mismatching elements"
    return res


def _device_type_check(res, label, got, like):
    if type(got) is not type(like):
        res.failures.append(f"{label}: result is {type(got).__name__}, input {type(like).__name__}")
        res.mismatches += 1


# -- checkers -----------------------------------------------------------------------------------------
def check_quantize(sku, rng, preferred_fw="cupy") -> CheckResult:
    res = CheckResult(str(sku), False)
    why = runs_this_sku(sku)
    if why:
        res.detail = f"not run: {why}"
        return res
    kind, fl = sku.aux_element, sku.element
    m = "f64" if fl == "f64" else "f32"
    mx_ok = kind in kinds.FP8 and sku.scope == "group"
    cases = [(s, a, g, False) for s, a, g in shapes(sku.scope, kind)]
    if mx_ok:
        cases += [((12, 256), None, 32, True), ((3, 5, 64), None, 32, True), ((0, 32), None, 32, True)]
    with lowbit.prefer_arch(sku.arch_number):
        for i, (shape, axis, gs, mx) in enumerate(cases):
            for strided_ in (False, True):
                if strided_ and len(shape) < 2:
                    continue
                fw = _framework(preferred_fw, i)
                ax = None if axis is None else axis % len(shape)
                pshape = param_shape(shape, sku.scope, ax, gs)
                scale = _scales(pshape, m, rng, mx, pow2=(i % 3 != 2))
                s_vals = ref.e8m0_scale(scale, np.float64) if mx else scale.astype(np.float64)
                x = _float_data(shape, kind, fl, rng, ref.broadcast_param(s_vals, shape, sku.scope, axis, gs))
                zp = None
                qmin = qmax = None
                if kind in kinds.INT4:
                    lo, hi = kinds.QRANGE[kind]
                    qmin, qmax = (lo, hi) if rng.random() < 0.5 else (lo + 1, hi - 2)
                    if sku.mode == "asymmetric":
                        zp = rng.integers(qmin, qmax + 1, size=pshape).astype(np.int32)
                want = ref.quantize_lowbit(x, scale, zp, scope=sku.scope, axis=axis, group_size=gs, out_dtype=kind,
                                           qmin=qmin, qmax=qmax, scale_dtype="e8m0" if mx else None)
                xd = put(x, fw)
                if strided_:
                    xd = strided(xd, 8 + int(rng.integers(0, 8)), fw)
                sd = float(scale) if (not pshape and not mx and rng.random() < 0.5) else put(scale, fw)
                got = sf.quantize(xd, sd, None if zp is None else put(zp, fw), scope=sku.scope, axis=axis,
                                  group_size=gs, out_dtype=kind, qmin=qmin, qmax=qmax,
                                  scale_dtype="e8m0" if mx else None)
                label = f"{shape} axis={axis} gs={gs} mx={mx} strided={strided_} {fw}"
                _device_type_check(res, label, got, xd)
                record(res, label, get(got).view(np.uint8), want)
    return _finish(res)


def _codes(shape, kind, rng):
    """Every code / byte value, shuffled and tiled, as q's container (int4: packed shape)."""
    cshape = lowbit.packed_shape(shape, kind)
    n = math.prod(cshape)
    return rng.permutation(np.resize(np.arange(256, dtype=np.uint8), max(n, 1)))[:n].reshape(cshape)


def check_dequantize(sku, rng, preferred_fw="cupy") -> CheckResult:
    res = CheckResult(str(sku), False)
    why = runs_this_sku(sku)
    if why:
        res.detail = f"not run: {why}"
        return res
    kind, fl = sku.element, sku.aux_element
    m = "f64" if fl == "f64" else "f32"
    cases = [(s, a, g, False) for s, a, g in shapes(sku.scope, kind)]
    if kind in kinds.FP8 and sku.scope == "group":
        cases += [((12, 256), None, 32, True), ((0, 32), None, 32, True)]
    with lowbit.prefer_arch(sku.arch_number):
        for i, (shape, axis, gs, mx) in enumerate(cases):
            for strided_ in (False, True):
                if strided_ and len(shape) < 2:
                    continue
                fw = _framework(preferred_fw, i)
                ax = None if axis is None else axis % len(shape)
                pshape = param_shape(shape, sku.scope, ax, gs)
                scale = _scales(pshape, m, rng, mx, pow2=(i % 2 == 0))
                q = _codes(shape, kind, rng)
                zp = None
                if sku.mode == "asymmetric":
                    lo, hi = kinds.QRANGE[kind]
                    zp = rng.integers(lo, hi + 1, size=pshape).astype(np.int32)
                want = ref.dequantize_lowbit(q, scale, zp, scope=sku.scope, axis=axis, group_size=gs, in_kind=kind,
                                             out_dtype=fl, scale_dtype="e8m0" if mx else None)
                typed = kind in kinds.FP8 and fw == "torch" and i % 4 == 1    # a torch fp8 tensor, no in_dtype
                qd = put(q, fw, kind if typed else None)
                if strided_:
                    qd = strided(qd, 16 + int(rng.integers(0, 8)), fw)
                got = sf.dequantize(qd, put(scale, fw), None if zp is None else put(zp, fw), scope=sku.scope,
                                    axis=axis, group_size=gs, out_dtype=fl, in_dtype=None if typed else kind,
                                    scale_dtype="e8m0" if mx else None)
                label = f"{shape} axis={axis} gs={gs} mx={mx} strided={strided_} {fw}{' fp8-typed' if typed else ''}"
                _device_type_check(res, label, got, qd)
                record(res, label, get(got), want)
    return _finish(res)


DYN_SHAPES = {
    "tensor": [((64, 512), None, None), ((3, 5, 78), None, None), ((2,), None, None), ((70001, 4), None, None),
               ((1, 100004), None, None)],
    "token": [((70, 256), None, None), ((4, 9, 34), None, None), ((5, 2), None, None), ((70001, 8), None, None),
              ((3, 65552), None, None), ((12, 4096), None, None), ((9, 2000), None, None)],
    "group": [((48, 512), None, 128), ((7, 96), None, 32), ((3, 4, 60), None, 6), ((9, 48), None, 16),
              ((70001, 32), None, 16), ((2, 65536), None, 65536), ((4, 256), None, 2), ((8, 1024), None, 128)],
    "channel": [((40, 256), 1, None), ((40, 256), 0, None), ((3, 6, 5, 32), 1, None), ((2, 3, 4, 5, 8), -1, None),
                ((70001, 4), 0, None), ((70001, 24), 1, None)],
}
DYN_EMPTY = {"tensor": [((0, 64), None, None)], "token": [((4, 0), None, None), ((0, 8), None, None)],
             "group": [((4, 0), None, 16)], "channel": [((5, 0), 0, None), ((0, 8), 1, None)]}


def check_dynamic(sku, rng, preferred_fw="cupy") -> CheckResult:
    res = CheckResult(str(sku), False)
    why = runs_this_sku(sku)
    if why:
        res.detail = f"not run: {why}"
        return res
    kind, fl, mode, scope = sku.aux_element, sku.element, sku.mode, sku.scope
    cases = [(s, a, g, False) for s, a, g in DYN_SHAPES[scope]]
    if kind in kinds.FP8 and scope == "group":
        cases += [((12, 256), None, 32, True), ((70001, 32), None, 32, True), ((3, 4, 64), None, 32, True)]
    cases += [(s, a, g, None) for s, a, g in DYN_EMPTY[scope]]
    with lowbit.prefer_arch(sku.arch_number):
        for i, (shape, axis, gs, mx) in enumerate(cases):
            # group scales also column-major: the first case and the first MX one
            cols = scope == "group" and (i == 0 or (mx and not cases[i - 1][3]))
            runs = [(False, lay) for lay in (("row", "col", "col_aligned") if cols else ("row",))] + [(True, "row")]
            for strided_, layout in runs:
                if strided_ and (len(shape) < 2 or math.prod(shape) > 4_000_000 or mx is None):
                    continue
                fw = _framework(preferred_fw, i)
                x = patterned(shape, rng, fl, specials=scope != "tensor")
                if kind in kinds.FP8 and x.size and i % 2:     # a power-of-two amax: exact scales, exact ties
                    with np.errstate(over="ignore"):
                        x.reshape(-1)[0] = kinds.kind(kind).max * 2.0 ** int(rng.integers(-4, 5))
                qmin = qmax = None
                if kind in kinds.INT4 and mode == "asymmetric" and rng.random() < 0.3:
                    lo, hi = kinds.QRANGE[kind]
                    qmin, qmax = lo + 1, hi - 1
                label = f"{shape} axis={axis} gs={gs} mx={bool(mx)} strided={strided_} layout={layout} {fw}"
                _dynamic_case(res, sku, x, fw, rng, axis, gs, bool(mx), strided_, label, qmin, qmax, layout)
    return _finish(res)


def _dynamic_case(res, sku, x, fw, rng, axis, gs, mx, strided_, label, qmin, qmax, layout="row"):
    kind, mode, scope = sku.aux_element, sku.mode, sku.scope
    sdt = "e8m0" if mx else None
    q_ref, s_ref, zp_ref = ref.dynamic_quantize_lowbit_ref(x, scope=scope, mode=mode, axis=axis, group_size=gs,
                                                           out_dtype=kind, qmin=qmin, qmax=qmax, scale_dtype=sdt)
    xd = put(x, fw)
    if strided_:
        xd = strided(xd, 8 + int(rng.integers(0, 9)), fw)
    q, s, zp = sf.dynamic_quantize(xd, scope=scope, mode=mode, axis=axis, group_size=gs, out_dtype=kind, qmin=qmin,
                                   qmax=qmax, scale_dtype=sdt or "float32", scale_layout=layout)
    pshape = param_shape(x.shape, scope, axis, gs)
    check_layout(res, label + " scale", s, pshape, layout)
    check_layout(res, label + " zero_point", zp, pshape, layout)
    if layout != "row":          # quantize / dequantize read C-order parameters
        s, zp = (None if a is None else put(np.ascontiguousarray(get(a)), fw) for a in (s, zp))
    _device_type_check(res, label, q, xd)
    record(res, label + " q", get(q).view(np.uint8), q_ref)
    record(res, label + " scale", np.atleast_1d(get(s)), np.atleast_1d(s_ref))
    if zp_ref is None:
        if zp is not None:
            res.failures.append(f"{label}: symmetric zero_point is {type(zp).__name__}, not None")
            res.mismatches += 1
    else:
        record(res, label + " zero_point", np.atleast_1d(get(zp)), np.atleast_1d(zp_ref))
    if x.size == 0:
        return
    # the invariant q == quantize(x, scale, zp) on the device, and dequantize == the reference
    if kind in kinds.INT4:
        eff_min, eff_max, _ = ref.dynamic_range(kind, mode, qmin, qmax)
    else:
        eff_min = eff_max = None
    finite = bool(np.isfinite(ref.e8m0_scale(s_ref) if mx else s_ref).all())
    # a non-finite scale (an inf in the slice) is legal for dynamic_quantize, by definition, but
    # invalid for quantize / dequantize (their kernels poison and report it): finite scales only
    if finite:
        q2 = sf.quantize(xd, s, zp, scope=scope, axis=axis, group_size=gs, out_dtype=kind, qmin=eff_min, qmax=eff_max,
                         scale_dtype=sdt)
        record(res, label + " q == quantize(x, scale, zp)", get(q2).view(np.uint8), get(q).view(np.uint8))
        mkind = "f64" if sku.element == "f64" else "f32"
        y = sf.dequantize(q, s, zp, scope=scope, axis=axis, group_size=gs, out_dtype=mkind,
                          in_dtype=kind, scale_dtype=sdt)
        record(res, label + " dequantize(q, scale, zp) == reference", get(y),
               ref.dequantize_lowbit(q_ref, s_ref, zp_ref, scope=scope, axis=axis, group_size=gs, in_kind=kind,
                                     out_dtype=mkind, scale_dtype=sdt))


# the checkers of this family, by op, for the SKUs it ``handles`` (codegen.harness.families)
CHECKERS = {"quantize": check_quantize, "dequantize": check_dequantize, "dynamic_quantize": check_dynamic}
