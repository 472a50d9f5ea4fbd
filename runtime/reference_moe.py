"""float64 NumPy reference of the MoE grouped matmul and its error measure (docs/numerics.md).

Inputs are NumPy arrays (``ml_dtypes.bfloat16`` for bf16); they are upcast exactly to float64.
"""
from __future__ import annotations

import numpy as np

# docs/numerics.md: relative Frobenius error vs the float64 reference.
TOLERANCE = {"f32": 1e-5, "f16": 1e-2, "bf16": 1e-2}


def expert_of_rows(M: int, E: int, row_experts=None, offsets=None) -> np.ndarray:
    """Expert of every row (int64), -1 for padding rows (ids outside [0, E))."""
    if (row_experts is None) == (offsets is None):
        raise ValueError("pass exactly one of row_experts / offsets")
    if row_experts is not None:
        ids = np.asarray(row_experts).astype(np.int64)   # uint32 ids >= 2**31 stay large: padding
        if ids.shape != (M,):
            raise ValueError(f"row_experts must have shape ({M},)")
        return np.where((ids >= 0) & (ids < E), ids, -1)
    off = np.asarray(offsets).astype(np.int64)
    if off.shape != (E + 1,) or off[0] != 0 or off[-1] != M or np.any(np.diff(off) < 0):
        raise ValueError("offsets must be E+1 non-decreasing prefix sums from 0 to M")
    return np.repeat(np.arange(E, dtype=np.int64), np.diff(off))


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def grouped_matmul(x, w, *, row_experts=None, offsets=None) -> np.ndarray:
    """``y[m] = w[e(m)] @ x[m]`` in float64; padding rows are 0."""
    x64, w64 = _f64(x), _f64(w)
    M, E = x64.shape[0], w64.shape[0]
    e = expert_of_rows(M, E, row_experts, offsets)
    y = np.zeros((M, w64.shape[1]), np.float64)
    for ex in range(E):
        rows = np.nonzero(e == ex)[0]
        if rows.size:
            y[rows] = x64[rows] @ w64[ex].T
    return y


def grouped_matmul_backward(x, w, dy, *, row_experts=None, offsets=None):
    """``(dx, dw)`` in float64: ``dx[m] = dy[m] @ w[e(m)]`` (padding rows 0),
    ``dw[e] = dy_e^T @ x_e`` (0 for experts without rows)."""
    x64, w64, dy64 = _f64(x), _f64(w), _f64(dy)
    M, E = x64.shape[0], w64.shape[0]
    e = expert_of_rows(M, E, row_experts, offsets)
    dx = np.zeros_like(x64)
    dw = np.zeros_like(w64)
    for ex in range(E):
        rows = np.nonzero(e == ex)[0]
        if rows.size:
            dx[rows] = dy64[rows] @ w64[ex]
            dw[ex] = dy64[rows].T @ x64[rows]
    return dx, dw


def rel_error(got, want) -> float:
    """``||got - want||_F / ||want||_F`` (the absolute norm when ``want`` is 0); NaN/inf -> inf."""
    g, w = _f64(got), _f64(want)
    if g.shape != w.shape:
        raise ValueError(f"shape {g.shape} != {w.shape}")
    if not np.all(np.isfinite(g)):
        return float("inf")
    num = float(np.linalg.norm((g - w).ravel()))
    den = float(np.linalg.norm(w.ravel()))
    return num / den if den > 0 else num
