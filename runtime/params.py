"""Normalize: the argument checks every op family shares, before anything is launched.

Each turns a user argument into what the launchers take (an ``ArrayRef`` of the right kind and
shape, or a validated Python scalar) or raises a typed error naming the argument, the value and
what is supported. Values held in device arrays are checked by the kernels (runtime/status.py);
the synchronous host check of them runs only in the debug mode (``runtime.sync_checks()``).
"""
from __future__ import annotations

import math
import numbers
import sys

from typing import Optional

import numpy as np

from . import config, kinds
from .arrays import ArrayRef, as_array, byte_span, empty, kind_of, overlap, writable
from .errors import DeviceMismatchError, InvalidProblemError, UnsupportedError
from .scopes import param_shape


def same_device(*named) -> None:
    """``same_device(("x", xr), ("scale", s), ...)``: a :class:`DeviceMismatchError` naming every
    array argument and its device unless all live on one device (entries that are not arrays, such
    as Python scalars and None, are skipped)."""
    refs = [(arg, r) for arg, r in named if isinstance(r, ArrayRef)]
    if len({r.device for _, r in refs}) > 1:
        raise DeviceMismatchError({arg: f"cuda:{r.device}" for arg, r in refs})


# The finite normal range (smallest positive normal, largest finite) of each math type: a Python
# number packed into a float kernel parameter of that type must lie in it (a larger one does not fit
# the parameter; a smaller one would be a subnormal, which the kernels may flush to zero).
NORMAL_RANGE = {"f32": (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)),
                "f64": (float(np.finfo(np.float64).tiny), float(np.finfo(np.float64).max))}


def _as_float(value, arg: str, what: str) -> float:
    """``value`` (a real number, not a bool) as a Python float; +-inf where it is too large for one."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise InvalidProblemError(f"{arg}={shown(value)}: {what} is required")
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def shown(value) -> str:
    """``repr(value)``, shortened where it is long (an integer of 400 digits: its first digits and
    how many there are)."""
    text = repr(value)
    if len(text) <= 40:
        return text
    if isinstance(value, numbers.Integral):
        return f"{text[:12]}... ({len(text.lstrip('-'))} digits)"
    return text[:40] + "..."


def _range_text(math_kind: str) -> str:
    lo, hi = NORMAL_RANGE[math_kind]
    name, data = ("float64", "float64 data") if math_kind == "f64" else ("float32", "float16, bfloat16 and float32 data")
    return f"[{lo:.8g}, {hi:.8g}], {name}'s finite positive normal range ({name}: the math type of {data})"


def positive_scalar(value, arg: str, math_kind: str) -> float:
    """A scale or eps given as a Python number, as the float the kernels take: finite, positive and
    within the math type's finite positive normal range, else an InvalidProblemError naming ``arg``,
    the value and the range (``math_kind``: the op's math type, ``f32`` for f16 / bf16 / f32 data,
    ``f64`` for f64 data)."""
    v = _as_float(value, arg, "a positive finite number")
    lo, hi = NORMAL_RANGE[math_kind]
    if not lo <= v <= hi:           # NaN fails too
        raise InvalidProblemError(f"{arg}={shown(value)}: {arg} must be positive and finite, within "
                                  f"{_range_text(math_kind)}")
    return v


def real_scalar(value, arg: str, math_kind: str) -> float:
    """A signed factor given as a Python number (``grad_factor``): zero, or of a magnitude within the
    math type's finite positive normal range; else an InvalidProblemError naming ``arg``."""
    v = _as_float(value, arg, "a finite real number")
    lo, hi = NORMAL_RANGE[math_kind]
    if v != 0 and not lo <= abs(v) <= hi:
        raise InvalidProblemError(f"{arg}={shown(value)}: 0 or a magnitude within {_range_text(math_kind)} is "
                                  "required")
    return v


def scale_arg(scale, x: ArrayRef, scope, axis, group_size, math_kind):
    """A scale as an ArrayRef of the scope shape, or a validated Python float (tensor scope)."""
    want = param_shape(x.shape, scope, axis, group_size)
    np_name = "float64" if math_kind == "f64" else "float32"
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        if scope != "tensor":
            raise InvalidProblemError(f"scale is a scalar ({scale!r}) but scope={scope!r} needs an array of shape {want}")
        return positive_scalar(scale, "scale", math_kind)
    ref = as_array(scale, "scale")
    if ref.kind != math_kind:
        raise InvalidProblemError(f"scale has dtype {ref.kind}; {np_name} is required for {x.kind} data")
    check_param_shape(ref, want, scope, "scale")
    if config.sync_checks_on() and ref.size:
        device_check(ref, "scale", lambda s, m: m.all(m.isfinite(s) & (s > 0)),
                      "scales must be positive and finite")
    return ref


def check_param_shape(ref: ArrayRef, want, scope, arg):
    ok = tuple(ref.shape) == tuple(want) or (scope == "tensor" and ref.size == 1 and ref.ndim <= 1)
    if not ok:
        raise InvalidProblemError(f"{arg} has shape {tuple(ref.shape)}; scope={scope!r} needs {tuple(want)}")
    if ref.size == 0:
        return  # nothing is read
    # flat indexing in the kernel: the parameter must be C-contiguous
    expect = 1
    for n, s in reversed(list(zip(ref.shape, ref.strides))):
        if n != 1 and s != expect:
            raise InvalidProblemError(f"{arg} must be C-contiguous (shape {tuple(ref.shape)}, strides {ref.strides})")
        expect *= n


def zero_point_arg(zero_point, x_shape, scope, axis, group_size, qmin, qmax, device_like):
    want = param_shape(x_shape, scope, axis, group_size)
    if isinstance(zero_point, numbers.Integral) and not isinstance(zero_point, bool):
        if scope != "tensor":
            raise InvalidProblemError(f"zero_point is a scalar ({zero_point!r}) but scope={scope!r} needs an "
                                      f"int32 array of shape {want}")
        if not qmin <= int(zero_point) <= qmax:
            raise InvalidProblemError(f"zero_point={zero_point} is outside [qmin, qmax] = [{qmin}, {qmax}]")
        return int(zero_point)
    ref = as_array(zero_point, "zero_point")
    if ref.kind != "i32":
        raise InvalidProblemError(f"zero_point has dtype {ref.kind}; int32 is required")
    check_param_shape(ref, want, scope, "zero_point")
    if config.sync_checks_on() and ref.size:
        device_check(ref, "zero_point", lambda z, m: m.all((z >= qmin) & (z <= qmax)),
                      f"zero points must lie in [qmin, qmax] = [{qmin}, {qmax}]")
    return ref


def device_check(ref: ArrayRef, arg: str, predicate, what: str):
    """Evaluate ``predicate`` on the device array with its own framework (one sync): the
    synchronous debug mode of the value checks (runtime.config.sync_checks)."""
    if ref.framework == "torch":
        ok = bool(predicate(ref.obj, sys.modules["torch"]))
    else:
        import cupy as cp
        with cp.cuda.Device(ref.device):     # CuPy runs its kernels on the current device
            ok = bool(predicate(ref.obj if ref.framework == "cupy" else cp.asarray(ref.obj), cp))
    if not ok:
        raise InvalidProblemError(f"{arg}: {what} (found a value that is not, by the synchronous "
                                  "checks of runtime.sync_checks)")


def out_arg(out, like: ArrayRef, shape, kind, arg="out"):
    if out is None:
        return as_array(empty(like, shape, kind), arg)
    ref = writable(as_array(out, arg), arg)
    if tuple(ref.shape) != tuple(shape) or ref.kind != kind:
        raise InvalidProblemError(f"{arg} has shape {tuple(ref.shape)} and dtype {ref.kind}; "
                                  f"expected shape {tuple(shape)} and dtype {kind}")
    if (ref.framework == "torch") != (like.framework == "torch"):
        raise InvalidProblemError(f"{arg} is a {ref.framework} array but the input is {like.framework}")
    return ref


def check_apart(rec, refs: dict, written: tuple, in_place: tuple = (), labels: Optional[dict] = None) -> None:
    """No array the call writes shares a byte with another of its arrays, unless it *is* that input.

    ``rec``: the call's runtime.replay.Recording (its op's replay arguments name the arrays).
    ``refs``: ``{argument name: ArrayRef or anything else}``; only non-empty ArrayRefs have a span.
    ``written``: the names of the outputs (given by the caller). ``in_place``: the names of the
    inputs an output may be exactly (the same pointer, shape, strides and dtype: an elementwise op
    whose kernels read each element before they write it in the same thread); any other overlap,
    partial or with another input, a parameter or another output, is an InvalidProblemError naming
    both arguments (``labels``: a name's wording in messages, e.g. ``"out[0] (q)"``). Inputs may
    overlap each other.

    ``rec`` records the spans by their index among the replay's arguments: a replay (same layouts,
    other addresses) makes the same test and takes this full path when it fails."""
    index = {n: i for i, n in enumerate(rec.names)}
    unknown = set(refs) - set(index)
    if unknown:
        raise TypeError(f"{rec.op} has no array argument {sorted(unknown)}; its replay takes {rec.names}")
    by_index = {index[n]: r for n, r in refs.items()}
    spans = tuple((i, *byte_span(r)) for i, r in sorted(by_index.items()) if isinstance(r, ArrayRef) and r.size)
    ptrs = [by_index[i].ptr if isinstance(by_index.get(i), ArrayRef) else 0 for i in range(len(rec.names))]
    out_at = {index[n] for n in written}
    same_at = {index[n] for n in in_place}
    labels = labels or {}
    for mine in (s for s in spans if s[0] in out_at):
        i = mine[0]
        for other in spans:
            j = other[0]
            if j == i or (j in out_at and j < i) or overlap((mine, other), ptrs) is None:
                continue
            if j in same_at and same_array(by_index[i], by_index[j]):
                continue
            a, b = (labels.get(rec.names[k], rec.names[k]) for k in (i, j))
            also = (f" ({a} may be exactly {b}: the same pointer, shape, strides and dtype)"
                    if j in same_at else "")
            raise InvalidProblemError(f"{a} overlaps {b} in memory; {rec.op} writes {a} while it reads or writes "
                                      f"{b}: pass separate arrays{also}")
    rec.require_disjoint(spans, tuple(sorted(out_at)))


def same_array(a: ArrayRef, b: ArrayRef) -> bool:
    """The same elements at the same addresses: pointer, kind, shape and the strides of the axes
    with more than one element."""
    return (a.ptr == b.ptr and a.kind == b.kind and tuple(a.shape) == tuple(b.shape)
            and all(n <= 1 or s == t for n, s, t in zip(a.shape, a.strides, b.strides)))


def channel_params(shape, scope, axis):
    if scope != "channel":
        return 1, 1, False
    if axis == len(shape) - 1:
        return 1, shape[axis], True
    return math.prod(shape[axis + 1:-1]), shape[axis], False


def check_scale_dtype(scale_dtype, data_kind: str) -> str:
    """The scale kind of float data of ``data_kind``: its math precision (float64 for float64 data,
    else float32, docs/numerics.md). ``scale_dtype`` may be None, ``"float32"`` (the default spelling of
    "float scales") or that precision itself; e8m0 block scales are routed before this check."""
    math_kind = kinds.math_kind(data_kind)
    if scale_dtype is None:
        return math_kind
    sk = kind_of(scale_dtype, "scale_dtype")
    if sk == "f32" or sk == math_kind:
        return math_kind
    raise UnsupportedError(f"scale_dtype={scale_dtype!r} for {data_kind} data; scales are in the math precision: "
                           f"{'float64' if math_kind == 'f64' else 'float32'} (or 'e8m0' block scales with fp8 "
                           "outputs)")
