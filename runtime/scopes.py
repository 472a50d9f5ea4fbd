"""Scopes and quantization ranges: shapes of scales and zero points, validation helpers.

The rows view: ``x`` (rank ≥ 1, last axis contiguous) is seen as ``rows x cols`` with one
row stride; leading axes must collapse into that single stride (any slice of rows of a
larger buffer does), otherwise an ``InvalidProblemError`` names the argument — skuforge
never copies silently.
"""
from __future__ import annotations

import math as _math
from dataclasses import dataclass

from . import kinds
from .axes import SCOPES
from .errors import InvalidProblemError, UnsupportedError


def implied_zero_point(kind: str) -> int:
    """Symmetric mode's zero point: the middle of the kind's range (0 signed, 128 for u8)."""
    lo, hi = kinds.QRANGE[kind]
    return (lo + hi + 1) // 2


@dataclass(frozen=True)
class RowsView:
    rows: int
    cols: int
    row_stride: int  # elements


def rows_view(a, arg: str) -> RowsView:
    """``a`` (an ArrayRef) as rows x cols with one row stride, or a typed error."""
    if a.ndim == 0:
        raise InvalidProblemError(f"{arg} is 0-d; rank 1 to 8 is supported")
    if a.ndim > 8:
        raise InvalidProblemError(f"{arg} has rank {a.ndim}; rank 1 to 8 is supported")
    cols = a.shape[-1]
    rows = _math.prod(a.shape[:-1])
    if cols > 1 and a.strides[-1] != 1 and rows * cols > 0:
        raise InvalidProblemError(f"{arg} has a non-contiguous last axis (stride {a.strides[-1]} elements); "
                                  "the last axis must be contiguous (strided rows are fine)")
    dims = [(n, s) for n, s in zip(a.shape[:-1], a.strides[:-1]) if n != 1]
    if not dims or rows * cols == 0:       # nothing is read or written: any strides will do
        return RowsView(rows, cols, max(cols, 1))
    stride = dims[-1][1]
    expect = stride
    for n, s in reversed(dims):
        if s != expect:
            raise InvalidProblemError(
                f"{arg} has shape {a.shape} and strides {a.strides} (elements): its leading axes do not "
                "collapse into one row stride; pass a tensor whose rows are evenly spaced (e.g. .contiguous())")
        expect = s * n
    if stride < cols and rows > 1:
        raise InvalidProblemError(f"{arg} has overlapping rows (row stride {stride} < {cols} columns)")
    return RowsView(rows, cols, stride)


def param_shape(x_shape, scope, axis=None, group_size=None) -> tuple:
    """The shape scales and zero points must have for this scope (docs/numerics.md)."""
    if scope == "tensor":
        return ()
    if scope == "channel":
        return (x_shape[axis],)
    if scope == "token":
        return tuple(x_shape[:-1])
    if scope == "group":
        return tuple(x_shape[:-1]) + (x_shape[-1] // group_size,)
    raise UnsupportedError(f"scope={scope!r}; supported: {', '.join(SCOPES)}")


# The layouts dynamic_quantize writes group scales (and zero points) in (docs/dynamic.md, "Scale
# layouts"): rows of groups, C order (``row``); columns, "MN-major", scale[g][m] (``col``); columns,
# each starting on 16 bytes (``col_aligned``: what TMA-fed blockwise GEMMs read).
SCALE_LAYOUTS = ("row", "col", "col_aligned")


def check_scale_layout(scale_layout, scope) -> str:
    if scale_layout not in SCALE_LAYOUTS:
        raise UnsupportedError(f"scale_layout={scale_layout!r}; supported: {', '.join(SCALE_LAYOUTS)}")
    if scale_layout != "row" and scope != "group":
        raise InvalidProblemError(f"scale_layout={scale_layout!r} with scope={scope!r}: only group scales have "
                                  "columns; other scopes take scale_layout='row'")
    return scale_layout


def param_strides(pshape, scale_layout: str, itemsize: int):
    """Strides (elements) of a new group parameter array of shape ``pshape`` in ``scale_layout``;
    None for C order. The leading axes stay in C order among themselves (one row index)."""
    if scale_layout == "row":
        return None
    lead = tuple(pshape[:-1])
    rows, align = _math.prod(lead), 1 if scale_layout == "col" else max(1, 16 // itemsize)
    lead_strides, acc = [], 1
    for n in reversed(lead):
        lead_strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(lead_strides)) + (-(-rows // align) * align,)


def param_layout(ref, scope, arg) -> tuple:
    """(row stride, group stride) in elements of a token / group parameter array the dynamic
    kernels write, element (row, group) at ``row * rs + group * gs``: its leading axes collapse
    into one row stride, and its elements are apart as rows of groups (group stride 1, row stride
    at least the groups) or as columns (row stride 1, column stride at least the rows); else an
    InvalidProblemError naming ``arg``."""
    shape, strides = tuple(ref.shape), tuple(ref.strides)
    if scope == "group":
        lead, lead_strides, groups, gs = shape[:-1], strides[:-1], shape[-1], strides[-1]
    else:
        lead, lead_strides, groups, gs = shape, strides, 1, 1
    rows, rs, acc = _math.prod(lead), None, None
    if rows == 0 or groups == 0:
        return max(groups, 1), 1           # nothing is written
    for n, st in reversed(list(zip(lead, lead_strides))):
        if n == 1:
            continue
        if acc is not None and st != acc:
            raise InvalidProblemError(f"{arg} has shape {shape} and strides {strides}: its leading axes do not "
                                      "collapse into one row stride")
        rs = st if rs is None else rs
        acc = st * n
    if groups <= 1:
        gs = 1
    if rs is None:
        rs = groups if gs == 1 else 1
    if (rs < 1 or gs < 1) or not (rows <= 1 or groups <= 1 or (gs == 1 and rs >= groups) or (rs == 1 and gs >= rows)):
        raise InvalidProblemError(f"{arg} has shape {shape} and strides {strides}: supported are rows of groups "
                                  "(group stride 1, row stride >= groups) and columns (row stride 1, column stride "
                                  ">= rows), as scale_layout 'row', 'col' and 'col_aligned' allocate them")
    return rs, gs


def check_scope(x_shape, scope, axis, group_size, arg="x"):
    """Validate scope, axis and group_size against x's shape; returns the normalised axis."""
    if scope not in SCOPES:
        raise UnsupportedError(f"scope={scope!r}; supported: {', '.join(SCOPES)}")
    ndim = len(x_shape)
    if scope == "channel":
        if axis is None:
            raise InvalidProblemError("axis is required for scope='channel'")
        if not isinstance(axis, int) or not -ndim <= axis < ndim:
            raise InvalidProblemError(f"axis={axis!r} is out of range for {arg} of rank {ndim}")
        axis %= ndim
    elif axis is not None:
        raise InvalidProblemError(f"axis={axis!r} is only meaningful for scope='channel' (scope={scope!r})")
    if scope in ("token", "group") and ndim == 0:
        raise InvalidProblemError(f"{arg} is 0-d; scope={scope!r} needs a last (feature) axis: pass an array of "
                                  "rank >= 1, or use scope='tensor'")
    if scope == "group":
        if group_size is None:
            raise InvalidProblemError("group_size is required for scope='group'")
        if not isinstance(group_size, int) or isinstance(group_size, bool) or not 1 <= group_size < 1 << 62:
            raise InvalidProblemError(f"group_size={group_size!r} must be a positive integer below 2**62")
        if x_shape[-1] % group_size:
            raise InvalidProblemError(f"group_size={group_size} does not divide the last axis D={x_shape[-1]} "
                                      f"of {arg}; supported: divisors of D")
    elif group_size is not None:
        raise InvalidProblemError(f"group_size={group_size!r} is only meaningful for scope='group' (scope={scope!r})")
    return axis


def check_range(kind: str, qmin, qmax):
    """Effective (qmin, qmax) for an integer kind, validated."""
    lo, hi = kinds.QRANGE[kind]
    qmin = lo if qmin is None else qmin
    qmax = hi if qmax is None else qmax
    for name, v in (("qmin", qmin), ("qmax", qmax)):
        if not isinstance(v, (int,)) or isinstance(v, bool):
            raise InvalidProblemError(f"{name}={v!r} must be an integer")
        if not lo <= v <= hi:
            raise InvalidProblemError(f"{name}={v} is outside the range of {kind} [{lo}, {hi}]")
    if qmin >= qmax:
        raise InvalidProblemError(f"qmin={qmin} must be < qmax={qmax}")
    return qmin, qmax
