"""The numeric rules the launchers and the NumPy reference (runtime/reference.py) share: the effective
code range of dynamic quantization, fake quantization's implied zero point, the fixed reduction order
of the LSQ sums (team sizes, tile rows), the MX block size, and the scale of a slice with no elements.

The runtime imports these from here, never from the reference: the reference is the tests' oracle
(docs/numerics.md defines the rules; the reference and the kernels implement them).
"""
from __future__ import annotations

import numpy as np

from . import kinds
from .scopes import implied_zero_point

MX_GROUP = 32           # elements per e8m0 block scale (OCP MX)
LSQ_MAX_TEAM = 256      # lanes of an LSQ team (a power of two)
LSQ_TILE_ROWS = 32      # rows per tile of the LSQ channel-last tile pass


def dynamic_range(kind: str, mode: str, qmin=None, qmax=None):
    """Effective (qmin, qmax, zp) of dynamic_quantize: symmetric defaults are the symmetric
    range (s8 -127..127, u8 1..255) with the implied zero point; asymmetric the full range."""
    lo, hi = kinds.QRANGE[kind]
    if mode == "symmetric":
        z = implied_zero_point(kind)
        qmin = (2 * z - hi) if qmin is None else qmin
        qmax = hi if qmax is None else qmax
        return qmin, qmax, (qmin + qmax + 1) // 2
    return (lo if qmin is None else qmin), (hi if qmax is None else qmax), None


def fake_quant_zero_point(qmin: int, qmax: int) -> int:
    """Symmetric fake quantization's zero point: the middle of [qmin, qmax] (0 for -128..127)."""
    return (qmin + qmax + 1) // 2


def lsq_team(units: int) -> int:
    """Lanes of a team that sums ``units`` vectors (segment pass) or partials (finish pass)."""
    return min(LSQ_MAX_TEAM, 1 << max(0, (max(1, units) - 1).bit_length()))


def empty_slice_params(kind: str, mode: str, qmin, qmax, eps: float, math: str, e8m0: bool = False) -> tuple:
    """``(scale, zero_point or None)`` that dynamic quantization gives a slice with no elements (it
    reduces to 0, docs/numerics.md), in the math precision ``math`` (``"f32"`` / ``"f64"``): integer
    codes ``max(0, eps) / (qmax - zp)`` (symmetric) or ``eps`` with ``zero_point = qmin`` (asymmetric);
    fp8 ``max(0, eps) / max_finite``; e8m0 block scales the code 0 (2^-127, the scale of amax = 0)."""
    m = np.float64 if math == "f64" else np.float32
    if kind in kinds.FP8:
        if e8m0:
            return 0, None
        return float(m(max(m(0), m(eps))) / m(kinds.kind(kind).max)), None
    qmin, qmax, zp = dynamic_range(kind, mode, qmin, qmax)
    if mode == "symmetric":
        return float(m(max(m(0), m(eps))) / m(qmax - zp)), None
    return float(m(eps)), int(qmin)
