"""NumPy reference for every op: the definition the kernels are tested against, bit for bit.

Inputs are NumPy arrays (``ml_dtypes`` for bf16 / fp8). Math is float32 after upcasting
f16/bf16 (float64 for f64), exactly as docs/numerics.md defines it and the kernels do it.
"""
from __future__ import annotations

import numpy as np

from . import kinds
from .arrays import numpy_dtype
from .numerics import (LSQ_TILE_ROWS, MX_GROUP, dynamic_range,  # noqa: F401 - the shared rules, also
                       fake_quant_zero_point, lsq_team)         # used through this module by the tests
from .scopes import implied_zero_point, param_shape


def math_dtype(kind_or_dtype) -> np.dtype:
    name = getattr(kind_or_dtype, "name", kind_or_dtype)
    return np.dtype(np.float64) if name in ("f64", "float64") else np.dtype(np.float32)


def broadcast_param(p, shape, scope, axis=None, group_size=None):
    """Expand a per-scope parameter (scale or zero point) to the full shape of x."""
    p = np.asarray(p)
    ndim = len(shape)
    if scope == "tensor":
        return p.reshape(())
    if scope == "channel":
        axis = axis % ndim
        return p.reshape([1] * axis + [shape[axis]] + [1] * (ndim - axis - 1))
    if scope == "token":
        return p.reshape(tuple(shape[:-1]) + (1,))
    if scope == "group":
        return np.repeat(p.reshape(tuple(shape[:-1]) + (shape[-1] // group_size,)), group_size, axis=-1)
    raise ValueError(scope)


def _qparams(x_shape, scale, zero_point, scope, axis, group_size, math, out_kind, qmin, qmax):
    lo, hi = kinds.QRANGE[out_kind]
    qmin = lo if qmin is None else qmin
    qmax = hi if qmax is None else qmax
    s = broadcast_param(np.asarray(scale).astype(math), x_shape, scope, axis, group_size)
    if zero_point is None:
        zp = np.asarray(implied_zero_point(out_kind), dtype=np.int32)
    else:
        zp = broadcast_param(np.asarray(zero_point, dtype=np.int32), x_shape, scope, axis, group_size)
    return s, zp, qmin, qmax


def quantize_values(x, scale, zero_point, *, scope, axis=None, group_size=None, out_kind="s8",
                    qmin=None, qmax=None):
    """Returns (v, q): the unclamped ``rne(x * inv) + zp`` (math precision) and the quantized ints."""
    math = math_dtype(x.dtype)
    s, zp, qmin, qmax = _qparams(x.shape, scale, zero_point, scope, axis, group_size, math, out_kind, qmin, qmax)
    inv = (math.type(1) / s).astype(math)
    with np.errstate(all="ignore"):
        t = (x.astype(math) * inv).astype(math)
        v = (np.rint(t) + zp.astype(math)).astype(math)
        clamped = np.clip(v, math.type(qmin), math.type(qmax))
    nan = np.isnan(t)
    q = np.where(nan, np.broadcast_to(zp, t.shape), clamped).astype(np.int64)
    return v, q, nan


def quantize(x, scale, zero_point=None, *, scope, axis=None, group_size=None, out_dtype="s8",
             qmin=None, qmax=None):
    _, q, _ = quantize_values(x, scale, zero_point, scope=scope, axis=axis, group_size=group_size,
                              out_kind=out_dtype, qmin=qmin, qmax=qmax)
    return q.astype(numpy_dtype(out_dtype))


def dequantize(q, scale, zero_point=None, *, scope, axis=None, group_size=None, in_kind="s8",
               out_dtype="f32"):
    math = math_dtype(out_dtype)
    s = broadcast_param(np.asarray(scale).astype(math), q.shape, scope, axis, group_size)
    if zero_point is None:
        zp = np.int64(implied_zero_point(in_kind))
    else:
        zp = broadcast_param(np.asarray(zero_point, dtype=np.int32), q.shape, scope, axis, group_size)
    with np.errstate(over="ignore"):
        y = ((q.astype(np.int64) - zp).astype(math) * s).astype(math)
        return y.astype(numpy_dtype(out_dtype))


# -- dynamic_quantize ---------------------------------------------------------------------------
def _slice_axes(shape, scope, axis):
    ndim = len(shape)
    if scope == "tensor":
        return tuple(range(ndim))
    if scope == "channel":
        return tuple(a for a in range(ndim) if a != axis % ndim)
    return (ndim - 1,)  # token; group after the reshape below


def dynamic_qparams(x, *, scope, mode="symmetric", axis=None, group_size=None, out_kind="s8",
                    qmin=None, qmax=None, eps=1e-8):
    """(scale, zero_point or None, qmin, qmax) exactly as docs/numerics.md defines them, in the math
    precision: reductions ignore NaN (np.fmax / np.fmin), an empty or all-NaN slice reduces to 0;
    ``clamp`` of the zero point is ``fmax(fmin(z, qmax), qmin)`` (a NaN, from min x = -inf, -> qmax)."""
    x = np.asarray(x)
    math = math_dtype(x.dtype)
    m = math.type
    qmin, qmax, zp_sym = dynamic_range(out_kind, mode, qmin, qmax)
    xm = x.astype(math)
    if scope == "group":
        xm = xm.reshape(tuple(x.shape[:-1]) + (x.shape[-1] // group_size, group_size))
    axes = _slice_axes(xm.shape, scope, axis)
    if scope == "channel":
        pshape = (x.shape[axis % x.ndim],)
    else:
        pshape = tuple(s for i, s in enumerate(xm.shape) if i not in axes)
    with np.errstate(all="ignore"):
        if mode == "symmetric":
            amax = np.fmax.reduce(np.abs(xm), axis=axes, initial=m(0)).astype(math).reshape(pshape)
            scale = (np.fmax(amax, m(eps)) / m(qmax - zp_sym)).astype(math)
            return scale, None, qmin, qmax
        mn = np.fmin.reduce(xm, axis=axes, initial=m(0)).astype(math).reshape(pshape)
        mx = np.fmax.reduce(xm, axis=axes, initial=m(0)).astype(math).reshape(pshape)
        scale = np.fmax(((mx - mn) / m(qmax - qmin)).astype(math), m(eps)).astype(math)
        z = (m(qmin) - np.rint((mn / scale).astype(math))).astype(math)
        z = np.fmax(np.fmin(z, m(qmax)), m(qmin))
        return scale, z.astype(np.int32), qmin, qmax


def dynamic_quantize_ref(x, *, scope, mode="symmetric", axis=None, group_size=None, out_dtype="s8",
                         qmin=None, qmax=None, eps=1e-8):
    """``(q, scale, zero_point)`` of ``runtime.dynamic_quantize`` (zero_point None when symmetric);
    ``q`` is ``quantize(x, scale, zero_point, qmin, qmax)`` by construction."""
    x = np.asarray(x)
    scale, zp, qmin, qmax = dynamic_qparams(x, scope=scope, mode=mode, axis=axis, group_size=group_size,
                                            out_kind=out_dtype, qmin=qmin, qmax=qmax, eps=eps)
    q = quantize(x, scale, zp, scope=scope, axis=axis, group_size=group_size, out_dtype=out_dtype,
                 qmin=qmin, qmax=qmax)
    return q, scale, zp


# -- training ops: straight-through backward, fake-quant, LSQ ---------------------------
# The fixed reduction order of the LSQ sums (team sizes, tile rows): runtime/numerics.py.
def _fq_values(x, scale, zero_point, zp_default, scope, axis, group_size):
    """(xm, s, inv, zp, v): x and the broadcast parameters in the math precision and
    ``v = rne(x * inv) + zp`` (NaN stays NaN)."""
    x = np.asarray(x)
    math = math_dtype(x.dtype)
    s = broadcast_param(np.asarray(scale).astype(math), x.shape, scope, axis, group_size)
    if zero_point is None:
        zp = np.asarray(zp_default, dtype=math)
    else:
        zp = broadcast_param(np.asarray(zero_point, dtype=np.int32), x.shape, scope, axis, group_size).astype(math)
    inv = (math.type(1) / s).astype(math)
    xm = x.astype(math)
    with np.errstate(all="ignore"):
        v = (np.rint((xm * inv).astype(math)) + zp).astype(math)
    return xm, s, inv, zp, v


def _in_range(v, qmin, qmax):
    with np.errstate(invalid="ignore"):
        return (v >= qmin) & (v <= qmax)


def _masked(dy, mask, math):
    """``dy * mask`` as a product (PyTorch's ``dY * mask``): -0 and NaN propagate like the kernels."""
    with np.errstate(all="ignore"):
        return (np.asarray(dy).astype(math) * mask.astype(math)).astype(math).astype(np.asarray(dy).dtype)


def quantize_backward(dy, x, scale, zero_point=None, *, scope, axis=None, group_size=None, out_dtype="s8",
                      qmin=None, qmax=None):
    """``dx = dy * (qmin <= v <= qmax)`` with quantize's ``v`` (docs/numerics.md), in x's dtype."""
    v, _, _ = quantize_values(np.asarray(x), scale, zero_point, scope=scope, axis=axis, group_size=group_size,
                              out_kind=out_dtype, qmin=qmin, qmax=qmax)
    lo, hi = kinds.QRANGE[out_dtype]
    qmin = lo if qmin is None else qmin
    qmax = hi if qmax is None else qmax
    return _masked(dy, _in_range(v, qmin, qmax), math_dtype(np.asarray(x).dtype))


def dequantize_backward(dy, scale, *, scope, axis=None, group_size=None):
    """``dq = dy * scale`` rounded once to dy's dtype."""
    dy = np.asarray(dy)
    math = math_dtype(dy.dtype)
    s = broadcast_param(np.asarray(scale).astype(math), dy.shape, scope, axis, group_size)
    with np.errstate(over="ignore"):
        return (dy.astype(math) * s).astype(math).astype(dy.dtype)


def fake_quantize(x, scale, zero_point=None, *, scope, axis=None, group_size=None, qmin=-128, qmax=127):
    """``(y, mask)``: ``y = (clamp(v, qmin, qmax) - zp) * scale`` in x's dtype, ``mask = qmin <= v <= qmax``.
    ``zero_point=None``: the symmetric zero point ``(qmin + qmax + 1) // 2``. NaN x gives NaN, mask False."""
    x = np.asarray(x)
    math = math_dtype(x.dtype)
    _, s, _, zp, v = _fq_values(x, scale, zero_point, fake_quant_zero_point(qmin, qmax), scope, axis, group_size)
    with np.errstate(all="ignore"):
        y = ((np.clip(v, math.type(qmin), math.type(qmax)) - zp).astype(math) * s).astype(math)
        y = y.astype(x.dtype)                 # rounded once: beyond the dtype's range is +-inf
    return y, _in_range(v, qmin, qmax)


def fake_quantize_backward(dy, x, scale, zero_point=None, *, scope, axis=None, group_size=None,
                           qmin=-128, qmax=127):
    """``dx = dy * mask`` with fake_quantize's mask."""
    x = np.asarray(x)
    _, _, _, _, v = _fq_values(x, scale, zero_point, fake_quant_zero_point(qmin, qmax), scope, axis, group_size)
    return _masked(dy, _in_range(v, qmin, qmax), math_dtype(x.dtype))


def pack_mask_bits(mask) -> np.ndarray:
    """A bool mask (rank >= 1) bit-packed along its last axis: uint8 ``mask.shape[:-1] + (ceil(D / 8),)``,
    bit j of byte b of a row = element ``8 * b + j`` of that row, padding bits 0
    (``fake_quantize(..., return_mask="bits")``, docs/numerics.md "Mask bits")."""
    return np.packbits(np.asarray(mask, dtype=bool), axis=-1, bitorder="little")


def unpack_mask_bits(bits, cols: int) -> np.ndarray:
    """The bool mask of ``cols`` elements a row that :func:`pack_mask_bits` packed into ``bits``."""
    return np.unpackbits(np.asarray(bits, dtype=np.uint8), axis=-1, count=cols, bitorder="little").astype(bool)


def fake_quantize_backward_from_mask(dy, bits):
    """``dx = dy * bit`` (a product, as ``dy * mask``: -0 and NaN propagate) in dy's dtype."""
    dy = np.asarray(dy)
    return _masked(dy, unpack_mask_bits(bits, dy.shape[-1]), math_dtype(dy.dtype))


def lsq_terms(dy, x, scale, zero_point=None, *, scope, axis=None, group_size=None, qmin=-128, qmax=127,
              grad_factor=1.0):
    """Per-element LSQ terms ``(dx, ds, dz)`` (PyTorch's formulas, docs/numerics.md), ds/dz in the math precision."""
    x = np.asarray(x)
    math = math_dtype(x.dtype)
    m = math.type
    xm, s, inv, zp, v = _fq_values(x, scale, zero_point, fake_quant_zero_point(qmin, qmax), scope, axis, group_size)
    g = np.asarray(dy).astype(math)
    gf = m(grad_factor)
    with np.errstate(all="ignore"):
        below, above = v < m(qmin), v > m(qmax)
        out = below | above
        edge = np.where(below, m(qmin), m(qmax)).astype(math)
        ds_out = ((g * (edge - zp).astype(math)).astype(math) * gf).astype(math)
        dz_out = (((-g) * s).astype(math) * gf).astype(math)
        xfq = ((np.clip(v, m(qmin), m(qmax)) - zp).astype(math) * s).astype(math)
        ds_in = ((((g * (xfq - xm).astype(math)).astype(math)) * inv).astype(math) * gf).astype(math)
        ds = np.where(out, ds_out, ds_in).astype(math)
        dz = np.where(out, dz_out, m(0)).astype(math)
    dx = _masked(dy, _in_range(v, qmin, qmax), math)
    return dx, ds, dz


def _halve(a):
    """Halving tree over the last axis (a power of two): ``s[i] + s[i + o]``, o = n/2 .. 1."""
    while a.shape[-1] > 1:
        o = a.shape[-1] // 2
        a = a[..., :o] + a[..., o:]
    return a[..., 0]


def _lane_tree(acc):
    """Combine lane sums (last axis, a power of two) as the kernels do: a halving tree over the
    32 lanes of each warp, then one over the warps."""
    t = acc.shape[-1]
    with np.errstate(all="ignore"):
        if t <= 32:
            return _halve(acc)
        return _halve(_halve(acc.reshape(acc.shape[:-1] + (t // 32, 32))))


def lsq_team_sum(a, vec: int):
    """Sum the last axis of ``a`` in the segment-pass order: ``vec``-element vectors dealt to
    ``lsq_team(ceil(L / vec))`` lanes round-robin, each lane adding its elements in order from +0,
    then the lane tree. Padding with +0 is exact: a sum that starts at +0 is never -0."""
    a = np.asarray(a)
    n = a.shape[-1]
    team = lsq_team(-(-n // vec))
    step = team * vec
    pad = (-n) % step if n else step
    a = np.concatenate([a, np.zeros(a.shape[:-1] + (pad,), a.dtype)], axis=-1)
    a = a.reshape(a.shape[:-1] + (a.shape[-1] // step, team, vec))
    acc = np.zeros(a.shape[:-3] + (team,), a.dtype)
    with np.errstate(all="ignore"):
        for r in range(a.shape[-3]):
            for k in range(vec):
                acc = acc + a[..., r, :, k]
    return _lane_tree(acc)


def lsq_reduce(t, x_shape, scope, axis=None, group_size=None, vec=4):
    """Sum per-element terms ``t`` (x's shape, math precision) per scale element in the kernels' order."""
    t = np.asarray(t)
    if t.size == 0:                     # nothing to sum: the zeros the op returns for an empty x
        return np.zeros(param_shape(x_shape, scope, None if axis is None else axis % len(x_shape), group_size),
                        t.dtype)
    ndim = len(x_shape)
    cols = x_shape[-1]
    rows = int(np.prod(x_shape[:-1], dtype=np.int64))
    r2 = t.reshape(rows, cols)
    if scope == "token":
        return lsq_team_sum(r2, vec).reshape(x_shape[:-1])
    if scope == "group":
        return lsq_team_sum(r2.reshape(rows, cols // group_size, group_size), vec).reshape(
            tuple(x_shape[:-1]) + (cols // group_size,))
    if scope == "channel" and axis % ndim == ndim - 1:
        ntiles = -(-rows // LSQ_TILE_ROWS)
        padded = np.concatenate([r2, np.zeros((ntiles * LSQ_TILE_ROWS - rows, cols), r2.dtype)])
        tiles = padded.reshape(ntiles, LSQ_TILE_ROWS, cols)
        part = np.zeros((ntiles, cols), r2.dtype)
        with np.errstate(all="ignore"):
            for r in range(LSQ_TILE_ROWS):
                part = part + tiles[:, r, :]
        return lsq_team_sum(part.T, 1)                      # items: the tiles of each column
    part = lsq_team_sum(r2, vec)                           # one partial per row
    if scope == "tensor":
        return lsq_team_sum(part, 1).reshape(())
    axis %= ndim
    inner = int(np.prod(x_shape[axis + 1:-1], dtype=np.int64))
    count = x_shape[axis]
    items = part.reshape(-1, count, inner).transpose(1, 0, 2).reshape(count, -1)
    return lsq_team_sum(items, 1)


def fake_quantize_learnable_backward(dy, x, scale, zero_point=None, *, scope, axis=None, group_size=None,
                                     qmin=-128, qmax=127, grad_factor=1.0):
    """``(dx, dscale, dzero_point)`` of LSQ: dx in x's dtype, dscale in the math precision (the scale's
    dtype), dzero_point in float32 (None when zero_point is None), summed in the kernels' fixed order."""
    x = np.asarray(x)
    vec = 16 // x.dtype.itemsize
    dx, ds_t, dz_t = lsq_terms(dy, x, scale, zero_point, scope=scope, axis=axis, group_size=group_size,
                               qmin=qmin, qmax=qmax, grad_factor=grad_factor)
    ds = lsq_reduce(ds_t, x.shape, scope, axis, group_size, vec)
    dz = None if zero_point is None else lsq_reduce(dz_t, x.shape, scope, axis, group_size, vec).astype(np.float32)
    return dx, ds, dz


# -- low-bit formats: fp8 e4m3fn / e5m2, packed int4, e8m0 (MX) block scales ------------
# fp8 formats (max, mantissa bits, emin, emax): runtime/kinds.py
FP8_NAN = 0x7F                                    # the NaN code every conversion writes


def _fp8_dtype(kind: str):
    import ml_dtypes
    return np.dtype(getattr(ml_dtypes, kinds.kind(kind).numpy))


def fp8_encode(t, kind: str) -> np.ndarray:
    """``fp8_rne_satfinite(t)`` as uint8 codes: one round-half-to-even from t's own precision
    (float32 or float64), ``|t| > max`` and ±inf saturate to ±max, NaN -> 0x7F (no sign), and a
    result that rounds to zero keeps its sign. (ml_dtypes' float64 cast rounds through float32,
    twice; so t is first rounded onto the fp8 grid here, exactly, and ml_dtypes encodes the
    grid value, which it represents exactly.)"""
    t = np.asarray(t)
    mx = kinds.kind(kind).max
    with np.errstate(all="ignore"):
        a = np.clip(t.astype(np.float64), -mx, mx)
        _, e = np.frexp(a)                                      # |a| = f * 2**e, 0.5 <= f < 1
        qe = np.maximum(e - 1, kinds.kind(kind).emin) - kinds.kind(kind).mbits   # exponent of the fp8 quantum
        r = np.ldexp(np.rint(np.ldexp(a, -qe)), qe)
        codes = r.astype(_fp8_dtype(kind)).view(np.uint8)
    return np.where(np.isnan(t), np.uint8(FP8_NAN), codes).astype(np.uint8)


def fp8_decode(codes, kind: str, math=np.float32) -> np.ndarray:
    """The exact values of fp8 codes (uint8 or an ml_dtypes float8 array) in ``math``."""
    return np.asarray(codes).view(np.uint8).view(_fp8_dtype(kind)).astype(math)


def e8m0_from_amax(amax, kind: str) -> np.ndarray:
    """MX (docs/numerics.md): ``e = floor(log2(amax)) - emax_elem`` clamped to [-127, 127], stored as ``e + 127``
    (uint8). amax = 0 gives e = -127; amax = inf gives 127."""
    a = np.asarray(amax)
    with np.errstate(all="ignore"):
        _, e = np.frexp(a)
    fl = np.where(a == 0, -(1 << 20), np.where(np.isfinite(a), e.astype(np.int64) - 1, 1 << 20))
    return (np.clip(fl - kinds.kind(kind).emax, -127, 127) + 127).astype(np.uint8)


def e8m0_scale(codes, math=np.float32) -> np.ndarray:
    """The scale ``2**(code - 127)`` of e8m0 codes, exact in float32 (2**-127 is a subnormal); 255 is NaN."""
    c = np.asarray(codes).view(np.uint8).astype(np.int64)
    return np.where(c == 255, np.nan, np.ldexp(1.0, c - 127)).astype(math)


def pack_int4(v) -> np.ndarray:
    """Pack int4 values (last axis even) two per byte: element 2i in the low nibble, 2i + 1 in the high."""
    v = np.asarray(v).astype(np.int64)
    return ((v[..., 0::2] & 0xF) | ((v[..., 1::2] & 0xF) << 4)).astype(np.uint8)


def unpack_int4(b, kind: str) -> np.ndarray:
    """The int4 values of packed bytes: shape ``b.shape[:-1] + (2 * b.shape[-1],)``, int8."""
    b = np.asarray(b).astype(np.int16)
    v = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[:-1] + (2 * b.shape[-1],))
    if kind == "s4":
        v = np.where(v >= 8, v - 16, v)
    return v.astype(np.int8)


def _params_math(scale, scale_dtype, math):
    return e8m0_scale(scale, math) if scale_dtype == "e8m0" else np.asarray(scale).astype(math)


def quantize_lowbit(x, scale, zero_point=None, *, scope, axis=None, group_size=None, out_dtype,
                    qmin=None, qmax=None, scale_dtype=None):
    """Low-bit quantize. fp8: uint8 codes of ``fp8_rne_satfinite(x * inv)`` (x's shape; view them as
    ``ml_dtypes.float8_*``); s4/u4: ``clamp(rne(x * inv) + zp)`` packed, shape ``x.shape[:-1] + (D // 2,)``.
    ``scale_dtype="e8m0"``: ``scale`` holds e8m0 codes."""
    x = np.asarray(x)
    math = math_dtype(x.dtype)
    s = _params_math(scale, scale_dtype, math)
    if out_dtype in kinds.FP8:
        sb = broadcast_param(s, x.shape, scope, axis, group_size)
        inv = (math.type(1) / sb).astype(math)
        with np.errstate(all="ignore"):
            t = (x.astype(math) * inv).astype(math)
        return fp8_encode(t, out_dtype)
    _, q, _ = quantize_values(x, s, zero_point, scope=scope, axis=axis, group_size=group_size,
                              out_kind=out_dtype, qmin=qmin, qmax=qmax)
    return pack_int4(q)


def dequantize_lowbit(q, scale, zero_point=None, *, scope, axis=None, group_size=None, in_kind,
                      out_dtype="f32", scale_dtype=None):
    """``y = (q - zp) * scale`` in the math precision, rounded once to ``out_dtype``. fp8: q are codes
    (zp = 0); s4/u4: q is packed (..., D // 2) and the result has D columns."""
    math = math_dtype(out_dtype)
    q = np.asarray(q)
    s = _params_math(scale, scale_dtype, math)
    if in_kind in kinds.FP8:
        vals = fp8_decode(q, in_kind, math)
        sb = broadcast_param(s, vals.shape, scope, axis, group_size)
        with np.errstate(all="ignore"):
            y = (vals * sb).astype(math)
    else:
        ints = unpack_int4(q, in_kind).astype(np.int64)
        sb = broadcast_param(s, ints.shape, scope, axis, group_size)
        if zero_point is None:
            zp = np.int64(implied_zero_point(in_kind))
        else:
            zp = broadcast_param(np.asarray(zero_point, dtype=np.int32), ints.shape, scope, axis, group_size)
        with np.errstate(all="ignore"):
            y = ((ints - zp).astype(math) * sb).astype(math)
    with np.errstate(over="ignore"):
        return y.astype(numpy_dtype(out_dtype))


def slice_amax(x, *, scope, axis=None, group_size=None) -> np.ndarray:
    """``max |x|`` per scope element in the math precision (NaN ignored; empty or all-NaN -> 0)."""
    x = np.asarray(x)
    math = math_dtype(x.dtype)
    xm = x.astype(math)
    if scope == "group":
        xm = xm.reshape(tuple(x.shape[:-1]) + (x.shape[-1] // group_size, group_size))
    axes = _slice_axes(xm.shape, scope, axis)
    pshape = (x.shape[axis % x.ndim],) if scope == "channel" else \
        tuple(s for i, s in enumerate(xm.shape) if i not in axes)
    with np.errstate(all="ignore"):
        return np.fmax.reduce(np.abs(xm), axis=axes, initial=math.type(0)).astype(math).reshape(pshape)


def dynamic_quantize_lowbit_ref(x, *, scope, mode="symmetric", axis=None, group_size=None, out_dtype,
                                qmin=None, qmax=None, eps=1e-8, scale_dtype=None):
    """``(q, scale, zero_point)`` of ``runtime.dynamic_quantize`` for low-bit outputs (q as
    ``quantize_lowbit`` returns it). fp8: ``scale = max(amax, eps) / fp8_max`` (math precision),
    or with ``scale_dtype="e8m0"`` the MX codes ``e8m0_from_amax`` (uint8, eps unused); s4/u4: the
    integer formulas of ``dynamic_qparams``. ``q == quantize_lowbit(x, scale, zp)`` by construction."""
    x = np.asarray(x)
    if out_dtype in kinds.FP8:
        amax = slice_amax(x, scope=scope, axis=axis, group_size=group_size)
        if scale_dtype == "e8m0":
            scale = e8m0_from_amax(amax, out_dtype)
        else:
            m = math_dtype(x.dtype).type
            with np.errstate(all="ignore"):
                scale = (np.fmax(amax, m(eps)) / m(kinds.kind(out_dtype).max)).astype(math_dtype(x.dtype))
        zp = None
    else:
        scale, zp, qmin, qmax = dynamic_qparams(x, scope=scope, mode=mode, axis=axis, group_size=group_size,
                                                out_kind=out_dtype, qmin=qmin, qmax=qmax, eps=eps)
    q = quantize_lowbit(x, scale, zp, scope=scope, axis=axis, group_size=group_size, out_dtype=out_dtype,
                        qmin=qmin, qmax=qmax, scale_dtype=scale_dtype)
    return q, scale, zp
