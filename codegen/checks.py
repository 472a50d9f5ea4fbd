"""GPU correctness checks: every SKU against the NumPy reference, random + edge cases.

Used by ``python -m codegen verify`` (which records the results) and by the GPU tests.
A checker is registered per op; it runs a list of cases for one SKU and returns a
:class:`CheckResult`. Cases use fresh random inputs (never all zeros) and the edge cases
of SPEC §6: .5 ties, saturation, NaN/±inf, empty and odd shapes, strided rows.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import numpy as np

import runtime as sf
from runtime import reference as ref
from runtime.arrays import numpy_dtype
from runtime.launch import grid_cap
from runtime.scopes import QRANGE

CHECKERS: dict = {}


def checker(*ops):
    def deco(fn):
        for op in ops:
            CHECKERS[op] = fn
        return fn
    return deco


@dataclass
class CheckResult:
    sku: str
    passed: bool
    cases: int = 0
    mismatches: int = 0
    max_error: float = 0.0
    detail: str = ""
    failures: list = field(default_factory=list)


# -- device transfer in either framework ---------------------------------------------------
def to_device(a: np.ndarray, fw: str):
    if fw == "torch":
        import torch
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).cuda()
        return torch.from_numpy(np.ascontiguousarray(a)).cuda()
    import cupy as cp
    return cp.asarray(a)


def to_host(a) -> np.ndarray:
    mod = type(a).__module__
    if mod.startswith("torch"):
        import torch
        if a.dtype == torch.bfloat16:
            import ml_dtypes
            return a.view(torch.uint16).cpu().numpy().view(ml_dtypes.bfloat16) if hasattr(torch, "uint16") \
                else a.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
        return a.cpu().numpy()
    return a.get()


def framework_for(kind: str, preferred: str = "cupy") -> str:
    return preferred


def strided_rows(a_dev, extra: int, fw: str):
    """The same values as ``a_dev`` but every row padded by ``extra`` elements (a sliced view)."""
    rows_shape = a_dev.shape[:-1]
    d = a_dev.shape[-1]
    if fw == "torch":
        import torch
        big = torch.empty(*rows_shape, d + extra, dtype=a_dev.dtype, device=a_dev.device)
        big[..., :d] = a_dev
        return big[..., :d]
    import cupy as cp
    big = cp.empty(rows_shape + (d + extra,), dtype=a_dev.dtype)
    big[..., :d] = a_dev
    return big[..., :d]


# -- case generation -------------------------------------------------------------------------
def _shapes(scope: str, rng):
    """(shape, axis, group_size) triples covering aligned, odd and higher-rank shapes."""
    out = []
    if scope == "tensor":
        out = [((64, 512), None, None), ((3, 5, 77), None, None), ((1,), None, None), ((2, 1, 3, 1, 2, 1, 2, 3), None, None),
               ((0, 16), None, None)]
    elif scope == "token":
        out = [((70, 256), None, None), ((4, 9, 33), None, None), ((5, 1), None, None), ((0, 64), None, None)]
    elif scope == "group":
        out = [((48, 512), None, 128), ((7, 96), None, 32), ((3, 4, 60), None, 6), ((9, 48), None, 3), ((5, 64), None, 64),
               ((0, 32), None, 16), ((21, 8192), None, 128)]
    elif scope == "channel":
        out = [((40, 256), 1, None), ((40, 256), 0, None), ((3, 6, 5, 32), 1, None), ((2, 3, 4, 5, 7), -1, None),
               ((2, 2, 2, 2, 2, 2, 2, 16), 3, None), ((0, 8), 1, None), ((21, 8192), 1, None)]
    return out


def _random_floats(shape, scale_full, rng, kind):
    """Values around the quantization grid: normal noise, exact .5 ties, saturation, specials."""
    n = math.prod(shape)
    base = rng.standard_normal(n).astype(np.float64) * 40.0
    ties = (rng.integers(-140, 140, n) + 0.5)          # exact ties on a power-of-two scale
    pick = rng.random(n)
    v = np.where(pick < 0.3, ties, base)
    v = np.where(pick > 0.97, rng.standard_normal(n) * 1e4, v)  # saturation
    out = (v.reshape(shape) * scale_full).astype(np.float64)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0])
    if n >= 16:
        idx = rng.choice(n, size=5, replace=False)
        out.reshape(-1)[idx] = specials
    return out.astype(numpy_dtype(kind))


def _pow2_scales(shape, rng, kind):
    # powers of two keep x * inv exact, so .5 ties really are ties after the multiply
    return (2.0 ** rng.integers(-6, 3, size=shape)).astype(numpy_dtype(kind))


def _compare(got: np.ndarray, want: np.ndarray):
    """(mismatches, max abs error) with NaN == NaN and -0 == +0 treated as equal only when bits agree."""
    g = got.astype(np.float64) if got.dtype.kind == "f" or got.dtype.name == "bfloat16" else got.astype(np.int64)
    w = want.astype(np.float64) if want.dtype.kind == "f" or want.dtype.name == "bfloat16" else want.astype(np.int64)
    gb = got.view(np.uint8).reshape(got.shape + (-1,)) if got.size else got
    wb = want.view(np.uint8).reshape(want.shape + (-1,)) if want.size else want
    bad = np.any(gb != wb, axis=-1) if got.size else np.zeros(0, bool)
    with np.errstate(invalid="ignore"):
        err = np.abs(g - w)
    err = np.where(np.isnan(err), 0, err)
    return int(bad.sum()), float(err.max()) if err.size else 0.0


def _record(res: CheckResult, label: str, got, want):
    res.cases += 1
    if got.shape != want.shape:
        res.failures.append(f"{label}: shape {got.shape} != {want.shape}")
        res.mismatches += 1
        return
    n, e = _compare(got, want)
    res.mismatches += n
    res.max_error = max(res.max_error, e)
    if n:
        res.failures.append(f"{label}: {n} of {got.size} elements differ (max |err| {e:g})")


@checker("quantize", "dequantize")
def check_static(sku, rng, preferred_fw="cupy") -> CheckResult:
    res = CheckResult(str(sku), False)
    float_kind = sku.element if sku.op == "quantize" else sku.aux_element
    qkind = sku.aux_element if sku.op == "quantize" else sku.element
    math_kind = "f64" if float_kind == "f64" else "f32"
    fw = framework_for(float_kind, preferred_fw)
    lo, hi = QRANGE[qkind]
    for shape, axis, gs in _shapes(sku.scope, rng):
        for strided in (False, True):
            if strided and len(shape) < 2:
                continue
            pshape = sf.quantization.param_shape(shape, sku.scope, None if axis is None else axis % len(shape), gs)
            scale = _pow2_scales(pshape, rng, math_kind)
            qmin, qmax = (lo, hi) if rng.random() < 0.5 else (lo + 3, hi - 5)
            zp = rng.integers(qmin, qmax + 1, size=pshape).astype(np.int32) if sku.mode == "asymmetric" else None
            label = f"{shape} axis={axis} gs={gs} strided={strided}"
            # strided cases also run on a 2-block grid: every row loop of the kernel strides
            with grid_cap(2) if strided else contextlib.nullcontext():
                _static_case(sku, res, label, shape, axis, gs, strided, scale, zp, qmin, qmax, qkind, float_kind,
                             pshape, fw, rng)
    res.passed = res.mismatches == 0 and res.cases > 0
    res.detail = f"{res.cases} cases, {res.mismatches} mismatching elements"
    return res


def _static_case(sku, res, label, shape, axis, gs, strided, scale, zp, qmin, qmax, qkind, float_kind, pshape, fw,
                 rng):
    """One quantize / dequantize case against the reference."""
    lo, hi = QRANGE[qkind]
    if sku.op == "quantize":
        x = _random_floats(shape, ref.broadcast_param(scale.astype(np.float64), shape, sku.scope, axis, gs),
                           rng, float_kind)
        want = ref.quantize(x, scale, zp, scope=sku.scope, axis=axis, group_size=gs, out_dtype=qkind,
                            qmin=qmin, qmax=qmax)
        xd = to_device(x, fw)
        if strided:
            xd = strided_rows(xd, 8 + int(rng.integers(0, 8)), fw)
        got = sf.quantize(xd, to_device(scale, fw) if pshape or rng.random() < 0.5 else float(scale),
                          None if zp is None else to_device(zp, fw), scope=sku.scope, axis=axis,
                          group_size=gs, out_dtype=qkind, qmin=qmin, qmax=qmax)
    else:
        q = rng.integers(lo, hi + 1, size=shape).astype(numpy_dtype(qkind))
        want = ref.dequantize(q, scale, zp, scope=sku.scope, axis=axis, group_size=gs, in_kind=qkind,
                              out_dtype=float_kind)
        qd = to_device(q, fw)
        if strided:
            qd = strided_rows(qd, 16 + int(rng.integers(0, 8)), fw)
        got = sf.dequantize(qd, to_device(scale, fw), None if zp is None else to_device(zp, fw),
                            scope=sku.scope, axis=axis, group_size=gs, out_dtype=float_kind)
    _record(res, label, to_host(got), want)


def check(sku, rng=None, preferred_fw="cupy") -> CheckResult:
    rng = rng or np.random.default_rng()
    fn = CHECKERS.get(sku.op)
    if fn is None:
        return CheckResult(str(sku), False, detail=f"no checker for op {sku.op}")
    try:
        return fn(sku, rng, preferred_fw)
    except Exception as e:  # noqa: BLE001 - a crash is a failed verification, recorded
        return CheckResult(str(sku), False, detail=f"{type(e).__name__}: {e}")
from . import checks_moe  # noqa: E402,F401
from . import checks_dynamic  # noqa: E402,F401
from . import checks_training  # noqa: E402,F401
from . import checks_lowbit  # noqa: E402,F401
