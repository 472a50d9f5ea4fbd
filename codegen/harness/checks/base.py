"""What the family checkers share: the result, device transfers, case generation, comparison.

A checker (one per op, in a family module beside this one, listed in its ``CHECKERS``; the
families: ``codegen.harness.families``) runs a list of cases for one SKU and returns a
:class:`CheckResult`. Cases use fresh random inputs (never all zeros) and the edge cases of
docs/audit.md: .5 ties, saturation, NaN/±inf, empty and odd shapes, strided rows.
``codegen.harness.verify.check(sku, rng)`` runs the registered checker of a SKU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from runtime.arrays import numpy_dtype
from runtime.scopes import param_strides


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


# -- comparison ------------------------------------------------------------------------------
def same_bits(got, want) -> np.ndarray:
    """Elementwise: identical bits, or both NaN (any payload)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype == np.bool_ or want.dtype == np.bool_:
        return got.astype(bool) == want.astype(bool)
    if got.dtype != want.dtype:
        return np.zeros(got.shape, bool)
    u = np.dtype(f"u{got.dtype.itemsize}")
    eq = got.view(u) == want.view(u)
    gn = np.isnan(got.astype(np.float64))
    wn = np.isnan(want.astype(np.float64))
    return eq | (gn & wn)


def record(res: CheckResult, label: str, got, want):
    """Count one case: shape, dtype and bits (NaN == NaN)."""
    got, want = np.asarray(got), np.asarray(want)
    res.cases += 1
    if got.shape != want.shape or (got.dtype != want.dtype and want.dtype != np.bool_):
        res.mismatches += 1
        res.failures.append(f"{label}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
        return
    bad = ~same_bits(got, want)
    n = int(bad.sum())
    if got.size and got.dtype != np.bool_:
        with np.errstate(all="ignore"):
            err = np.abs(got.astype(np.float64) - want.astype(np.float64))
        err = np.where(np.isnan(err), 0, err)
        res.max_error = max(res.max_error, float(err.max()))
    if n:
        res.mismatches += n
        idx = np.argwhere(bad)[0]
        res.failures.append(f"{label}: {n} of {got.size} elements differ (first at {tuple(idx)}: "
                            f"got {got[tuple(idx)]!r}, want {want[tuple(idx)]!r})")


def record_close(res: CheckResult, label: str, got, want, scale, rtol):
    """Count one case compared with a tolerance: |got - want| <= rtol * scale (NaN == NaN)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    res.cases += 1
    with np.errstate(all="ignore"):
        err = np.abs(got - want)
        bad = ~((err <= rtol * np.asarray(scale, np.float64) + 1e-30) | (np.isnan(got) & np.isnan(want)))
    n = int(bad.sum())
    if n:
        res.mismatches += n
        res.failures.append(f"{label}: {n} of {got.size} sums outside rtol {rtol:g} (max |err| {np.nanmax(err):g})")


# -- shared inputs -----------------------------------------------------------------------------
def _finite_max(kind: str) -> float:
    return {"f16": 6.0e4, "bf16": 3.0e38, "f32": 3.0e38, "f64": 1.0e300}[kind]


def patterned(shape, rng, kind, specials=True):
    """Normal values with a per-row magnitude in 1e-3..1e3, then edge-case rows (of the rows
    view): all zero, constant, one huge outlier, a NaN, all NaN, and with ``specials`` +inf
    and -inf inside a row; a few -0.0 too."""
    n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    d = shape[-1]
    x = rng.standard_normal((n_rows, d)) * 10.0 ** rng.uniform(-3, 3, size=(n_rows, 1))
    big = min(_finite_max(kind) / 2, 1e4 * max(1.0, float(np.abs(x).max(initial=0))))
    patterns = ["zero", "const", "outlier", "nan", "allnan"] + (["inf", "-inf"] if specials else [])
    if n_rows >= len(patterns) and d:
        rows = rng.choice(n_rows, size=len(patterns), replace=False)
        for r, p in zip(rows, patterns):
            j = int(rng.integers(0, d))
            if p == "zero":
                x[r] = 0.0
            elif p == "const":
                x[r] = float(rng.choice([0.75, -3.0, 1e-5]))
            elif p == "outlier":
                x[r, j] = big * float(rng.choice([-1.0, 1.0]))
            elif p == "nan":
                x[r, j] = np.nan
            elif p == "allnan":
                x[r] = np.nan
            elif p == "inf":
                x[r, j] = np.inf
            else:
                x[r, j] = -np.inf
    elif specials and x.size >= 4:
        flat = x.reshape(-1)
        flat[rng.choice(flat.size, size=2, replace=False)] = [np.nan, np.inf]
    if x.size >= 8:
        x.reshape(-1)[rng.choice(x.size, size=3, replace=False)] = -0.0
    return x.reshape(shape).astype(numpy_dtype(kind))


def check_layout(res, label: str, arr, pshape, layout: str) -> None:
    """Records a failure when the parameter array ``arr`` the device returned lacks the strides that
    ``scale_layout=layout`` gives arrays of shape ``pshape``."""
    if layout == "row" or arr is None:
        return
    got = element_strides(arr)
    want = param_strides(tuple(pshape), layout, arr.itemsize if hasattr(arr, "itemsize") else arr.element_size())
    if any(n > 1 and a != b for n, a, b in zip(arr.shape, got, want)):
        res.failures.append(f"{label}: scale_layout={layout!r} gave strides {got}, expected {want}")
        res.mismatches += 1


def element_strides(arr) -> tuple:
    """Strides in elements of a torch tensor, or of a CuPy / NumPy array (whose strides are bytes)."""
    if callable(getattr(arr, "stride", None)):
        return tuple(arr.stride())
    return tuple(s // arr.itemsize for s in arr.strides)


def dense_copy(arr, fw: str):
    """A C-order device copy of a (strided) parameter array, for the ops that read C-order ones."""
    return None if arr is None else to_device(np.ascontiguousarray(to_host(arr)), fw)

