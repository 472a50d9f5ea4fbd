"""Functional API of the quantization family (SPEC §3): validate, allocate, select, launch.

Every check happens before any launch and raises a typed error that names the argument,
the value and what is supported.
"""
from __future__ import annotations

import copy
import math
import numbers
import operator
import sys

from . import config, kinds, status
from .arrays import (ArrayRef, allocator, as_array, empty, kind_of, recording_allocations, stream_getter,
                     stream_handle)
from .errors import InvalidProblemError, UnsupportedError
from .launch import ElementwiseArgs
from .plans import Descriptor, cached_plan
from .scopes import check_range, check_scope, implied_zero_point, param_shape, rows_view

def _same_device(refs):
    devs = {(r.framework, r.device) for r in refs if isinstance(r, ArrayRef)}
    if len({d for _, d in devs}) > 1:
        raise InvalidProblemError("arguments live on different devices: "
                                  + ", ".join(f"{fw}:cuda:{d}" for fw, d in sorted(devs)))


def _scale_arg(scale, x: ArrayRef, scope, axis, group_size, math_kind):
    """A scale as an ArrayRef of the scope shape, or a validated Python float (tensor scope)."""
    want = param_shape(x.shape, scope, axis, group_size)
    np_name = "float64" if math_kind == "f64" else "float32"
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        if scope != "tensor":
            raise InvalidProblemError(f"scale is a scalar ({scale!r}) but scope={scope!r} needs an array of shape {want}")
        s = float(scale)
        if not (math.isfinite(s) and s > 0):
            raise InvalidProblemError(f"scale={scale!r}; scales must be positive and finite")
        return s
    ref = as_array(scale, "scale")
    if ref.kind != math_kind:
        raise InvalidProblemError(f"scale has dtype {ref.kind}; {np_name} is required for {x.kind} data")
    _check_param_shape(ref, want, scope, "scale")
    if config.sync_checks_on() and ref.size:
        _device_check(ref, "scale", lambda s, m: m.all(m.isfinite(s) & (s > 0)),
                      "scales must be positive and finite")
    return ref


def _check_param_shape(ref: ArrayRef, want, scope, arg):
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


def _zero_point_arg(zero_point, x_shape, scope, axis, group_size, qmin, qmax, device_like):
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
    _check_param_shape(ref, want, scope, "zero_point")
    if config.sync_checks_on() and ref.size:
        _device_check(ref, "zero_point", lambda z, m: m.all((z >= qmin) & (z <= qmax)),
                      f"zero points must lie in [qmin, qmax] = [{qmin}, {qmax}]")
    return ref


def _device_check(ref: ArrayRef, arg: str, predicate, what: str):
    """Evaluate ``predicate`` on the device array with its own framework (one sync): the
    synchronous debug mode of the value checks (runtime.config.sync_checks)."""
    if ref.framework == "torch":
        ok = bool(predicate(ref.obj, sys.modules["torch"]))
    else:
        import cupy as cp
        ok = bool(predicate(ref.obj if ref.framework == "cupy" else cp.asarray(ref.obj), cp))
    if not ok:
        raise InvalidProblemError(f"{arg}: {what} (found a value that is not, by the synchronous "
                                  "checks of runtime.sync_checks)")


def _out_arg(out, like: ArrayRef, shape, kind, arg="out"):
    if out is None:
        return as_array(empty(like, shape, kind), arg)
    ref = as_array(out, arg)
    if tuple(ref.shape) != tuple(shape) or ref.kind != kind:
        raise InvalidProblemError(f"{arg} has shape {tuple(ref.shape)} and dtype {ref.kind}; "
                                  f"expected shape {tuple(shape)} and dtype {kind}")
    if (ref.framework == "torch") != (like.framework == "torch"):
        raise InvalidProblemError(f"{arg} is a {ref.framework} array but the input is {like.framework}")
    return ref


def _channel_params(shape, scope, axis):
    if scope != "channel":
        return 1, 1, False
    if axis == len(shape) - 1:
        return 1, shape[axis], True
    return math.prod(shape[axis + 1:-1]), shape[axis], False


def launch_elementwise(op, mode, element, aux, ins, outs, scale, zp_array, zp_value, shape, scope, axis,
                       group_size, qmin, qmax, fast=None):
    """Check and launch one static elementwise kernel (templates/quantization/_elementwise.cu.j2).

    ``ins`` / ``outs``: ``(ArrayRef, RowsView)`` in the kernel's stream order; every argument check
    has passed. An empty shape launches nothing. The launch runs on the current stream of the
    first input's framework; ``fast`` (a :class:`_FastCall`) records it for replay. The kernel checks
    the scale and zero-point values it reads and reports to the device's status word."""
    rows, cols = ins[0][1].rows, ins[0][1].cols
    if math.prod(shape) == 0:
        return
    inner, count, last = _channel_params(shape, scope, axis)
    dev = ins[0][0].device
    status.raise_pending(dev)
    args = ElementwiseArgs(ins=ins, outs=outs, scale=scale, zero_point=zp_array, zp_value=zp_value, rows=rows,
                           cols=cols, group_size=group_size or 1, chan_inner=inner, chan_count=count,
                           chan_last=last, qmin=qmin, qmax=qmax, status=status.pointer(dev))
    plan = cached_plan(Descriptor(op, scope, mode, element, aux))
    plan.launcher.check(plan, args)
    prep = plan.launcher.prepare(plan, args)
    prep.launch(stream_handle(ins[0][0]))
    if fast is not None:
        fast.add_launch(prep, ins[0][0], params=("scale_value", "zp_value"))


# -- repeated-call fast path -------------------------------------------------------------------
# A call whose arguments have the same types, shapes, strides, dtypes, devices and 16-byte
# alignment (and the same keyword arguments, types included) as an earlier, fully validated call
# replays that call: the same allocations, then its prepared launches with every pointer slot
# refilled (and a Python scalar scale / zero point re-checked and refilled). Device-array
# *values* are checked by the kernels (runtime/status.py), so a replay checks nothing on the host;
# under the synchronous debug mode (``runtime.sync_checks()``) a call with a device scale or zero
# point takes the slow path, which checks them.
#
# Which slot takes which pointer is found when the call is remembered, by matching every nonzero
# pointer slot ("Q" in the struct format) against the pointers of the array arguments and of
# the allocations the slow path made (the status word's pointer is a constant of the device): a pointer that matches nothing, or two sources that share
# a pointer (in-place calls), leave the call without a fast path rather than guess. Scalar slots
# are named by the launching code (``add_launch(params=...)``) and verified against the values.
_FAST: dict = {}
_FAST_LIMIT = 2048
_NONE = ("none",)
_MISS = object()
_FRAMEWORK: dict = {}        # exact type -> 1 torch tensor, 2 cupy array, 0 anything else


def _framework_of(t) -> int:
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(t, torch.Tensor):
        return 1
    cp = sys.modules.get("cupy")
    if cp is not None and issubclass(t, cp.ndarray):
        return 2
    return 0


def _describe(obj):
    """(hashable signature, pointer or scalar value) of one argument; (None, None) = no fast path.

    Arrays: type, shape, strides, dtype, device and pointer alignment, in as few attribute reads
    as the framework allows; Python scalars: their type (the value is refilled on a hit)."""
    t = type(obj)
    if t is float or t is int:
        return t, obj
    if obj is None:
        return _NONE, 0
    fw = _FRAMEWORK.get(t)
    if fw is None:
        fw = _FRAMEWORK[t] = _framework_of(t)
    if fw == 1:
        p = obj.data_ptr()
        return (t, obj.shape, obj.stride(), obj.dtype, obj.get_device(), obj.is_cuda, p & 15), p
    if fw == 2:
        d = obj.data
        p = d.ptr
        return (t, obj.shape, obj.strides, obj.dtype, d.device_id, p & 15), p
    return None, None


class _Entry:
    """A remembered call: what to check, allocate and launch, and where the results are."""

    __slots__ = ("checked", "check", "allocs", "stream", "launches", "runner", "result", "disjoint", "device")

    def run(self, args, vals):
        """Replay on ``args`` (``vals``: their pointers / scalar values, a fresh list); ``_MISS``:
        run the slow path instead (it raises the typed error, or takes over)."""
        if self.checked and config.sync_checks_on():
            return _MISS
        status.raise_pending(self.device)
        check = self.check
        if check is not None and not check(vals):
            return _MISS
        if self.disjoint is not None and _overlap(self.disjoint, vals) is not None:
            return _MISS               # the slow path raises the typed error
        if self.allocs:
            new = []
            for alloc, align in self.allocs:
                a, p = alloc()
                if p & 15 != align:    # never with the frameworks' allocators; the vector path depends on it
                    return _MISS
                new.append(a)
                vals.append(p)
            args = (*args, *new, None)
        else:
            args = (*args, None)       # a None result (index -1)
        stream = self.stream()
        if self.runner is None:
            for prep, template, slots in self.launches:
                values = template.copy()
                for j, i in slots:
                    values[j] = vals[i]
                prep.launch(stream, values)
        else:
            self.runner(args, vals, stream)
        return self.result(args)


def _overlap(spans, vals):
    """The first pair ``(i, j)`` of arguments named in ``spans`` that share bytes, or None.
    ``spans``: (index, first byte, end byte) relative to the pointers ``vals[index]`` (for a
    replay, fixed by the cache key's shapes and strides; see :func:`byte_span`)."""
    for k, (i, lo_i, hi_i) in enumerate(spans):
        a = vals[i]
        for j, lo_j, hi_j in spans[k + 1:]:
            b = vals[j]
            if a + lo_i < b + hi_j and b + lo_j < a + hi_i:
                return i, j
    return None


def byte_span(ref: ArrayRef) -> tuple:
    """(first, end) byte offsets of an array's elements relative to its pointer (strides may be
    negative); (0, 0) when it is empty."""
    if ref.size == 0:
        return 0, 0
    lo = sum((n - 1) * st for n, st in zip(ref.shape, ref.strides) if st < 0)
    hi = sum((n - 1) * st for n, st in zip(ref.shape, ref.strides) if st > 0) + 1
    return lo * ref.itemsize, hi * ref.itemsize


def _scalar_check(scale_at, zp_check):
    """The hit-time check of Python scalar parameters (what _scale_arg / _zero_point_arg accept)."""
    inf = math.inf
    if zp_check is None:
        return lambda vals: 0.0 < vals[scale_at] < inf
    z, lo, hi = zp_check
    if scale_at is None:
        return lambda vals: lo <= vals[z] <= hi
    return lambda vals: 0.0 < vals[scale_at] < inf and lo <= vals[z] <= hi


def _key(op, static, args):
    """(cache key, pointers and scalar values of ``args``), or (None, None): no fast path."""
    key = [op, static]
    key += map(type, static)       # 1, 1.0, True and numpy.int64(1) are equal keys, not equally valid
    vals = []
    try:
        for a in args:
            t = type(a)
            if t is float or t is int:
                sig, v = t, a
            elif a is None:
                sig, v = _NONE, 0
            else:
                sig, v = _describe(a)
                if sig is None:
                    return None, None
            key.append(sig)
            vals.append(v)
    except Exception:              # noqa: BLE001 - an odd argument: the slow path raises the typed error
        return None, None
    return tuple(key), vals


def _replay(op, static, args):
    """The result of replaying a remembered call of ``op`` on these arguments, or ``_MISS``."""
    key, vals = _key(op, static, args)
    if key is None:
        return _MISS
    try:
        entry = _FAST.get(key)
    except TypeError:              # an unhashable keyword argument: the slow path validates it
        return _MISS
    if entry is None:
        return _MISS
    return entry.run(args, vals)


class _FastCall:
    """Records a functional call's slow path so that it can be replayed.

        r = _replay(op, static, args)
        if r is not _MISS:
            return r
        with _FastCall(op, static, args, scale_at=...) as fast:   # records the allocations
            ...validate, allocate...; launch_elementwise(..., fast=fast)  # or add_launch / set_runner
            fast.remember(result, zp_range)
            return result

    ``static``: the keyword arguments (hashable; their types are part of the key). ``args``: the
    array / scalar / None arguments; ``args[scale_at]`` and ``args[scale_at + 1]`` are the scale and
    zero point, if any.
    """

    __slots__ = ("key", "args", "vals", "scale_at", "launches", "runner", "log", "_rec", "disjoint")

    def __init__(self, op, static, args, scale_at=None):
        self.args = args
        self.scale_at = scale_at
        self.disjoint = None
        self.key, self.vals = _key(op, static, args)
        if self.key is not None:
            try:
                if self.key in _FAST:      # remembered already: a call that had to check device values
                    self.key = None
            except TypeError:              # an unhashable keyword argument
                self.key = None

    # -- recording (slow path) ------------------------------------------------------------------
    def __enter__(self):
        if self.key is not None:
            self.launches, self.runner = [], None
            self._rec = recording_allocations()
            self.log = self._rec.__enter__()
        return self

    def __exit__(self, *exc):
        if self.key is not None:
            self._rec.__exit__()
        return False

    def add_launch(self, prep, stream_ref: ArrayRef, params=None):
        """A prepared launch of the slow path (``prep.launch(stream_handle(stream_ref))``) to replay.
        ``params``: the names of the parameters that take a Python scalar scale and zero point, or
        None when the kernel reads neither."""
        if self.key is not None:
            self.launches.append((prep, stream_ref, params))

    def set_runner(self, bind, stream_ref: ArrayRef):
        """Replay by calling code instead of prepared launches: ``bind(index_of)`` is called when the
        call is remembered (``index_of(ptr)``: the source index of a pointer, None if unknown) and
        returns ``run(objs, ptrs, stream)`` (or None: no fast path); ``objs`` / ``ptrs``: the
        arguments then the allocations and their pointers, in the slow path's order."""
        if self.key is not None:
            self.runner = (bind, stream_ref)

    def require_disjoint(self, spans):
        """A replay must find these arguments apart in memory, as the slow path checked: ``spans``
        is ``((argument index, first byte, end byte), ...)`` (:func:`byte_span`; fixed by the key)."""
        if self.key is not None:
            self.disjoint = tuple(spans)

    def remember(self, result, zp_range=None):
        """Store this (successful) call for replay, unless some slot cannot be accounted for."""
        if self.key is None or not (self.launches or self.runner):
            return
        args, vals, log = self.args, self.vals, self.log
        srcs = {}                  # pointer -> source index (arguments, then allocations)
        for i, a in enumerate(args):
            t = type(a)
            if a is None or t is float or t is int:
                continue
            p = vals[i]
            if not p or p in srcs:
                return
            srcs[p] = i
        allocs = []
        for k, (obj, p, like, shape, kind) in enumerate(log):
            if not p or p in srcs:
                return
            srcs[p] = len(args) + k
            allocs.append((allocator(like, shape, kind), p & 15))
        pool = list(args) + [entry[0] for entry in log]

        def where(obj):
            for i, o in enumerate(pool):
                if o is obj and type(o) not in (float, int):
                    return i
            return None
        if isinstance(result, tuple):
            spec = tuple(None if r is None else where(r) for r in result)
            if any(i is None for i, r in zip(spec, result) if r is not None):
                return
        else:
            spec = where(result)
            if spec is None:
                return
        e = _Entry()
        e.checked, e.check, e.runner, e.disjoint = False, None, None, self.disjoint
        scalars, scale_at, zp_check = {}, None, None
        sa = self.scale_at
        if sa is not None:
            s, z = args[sa], args[sa + 1]
            if type(s) in (float, int):
                scale_at = scalars[0] = sa
            elif s is not None:
                e.checked = True
            if type(z) is int:
                if zp_range is None:
                    return
                zp_check = (sa + 1, *zp_range)
                scalars[1] = sa + 1
            elif z is not None:
                e.checked = True
        if scalars:
            e.check = _scalar_check(scale_at, zp_check)
        launches, streams = [], []
        for prep, ref, params in self.launches:
            template, fmt = prep.values, prep.fmt
            if len(fmt) != len(template):
                return
            slots = []
            for j, (c, v) in enumerate(zip(fmt, template)):
                if c == "Q" and v and not status.is_status_pointer(v):
                    i = srcs.get(v)
                    if i is None:
                        return         # a pointer that is neither an argument nor an allocation
                    slots.append((j, i))
            for which, i in scalars.items():
                if params is not None:
                    j = prep.abi.slot[params[which]]
                    if template[j] != args[i] or fmt[j] == "Q":
                        return         # the named slot does not hold the scalar
                    slots.append((j, i))
            launches.append((prep, list(template), tuple(slots)))
            streams.append(ref)
        if self.runner is not None:
            bind, ref = self.runner
            e.runner = bind(srcs.get)
            if e.runner is None:
                return
            streams.append(ref)
        if any((r.framework, r.device) != (streams[0].framework, streams[0].device) for r in streams):
            return
        e.launches, e.allocs = tuple(launches), tuple(allocs)
        if isinstance(spec, tuple):
            idx = tuple(-1 if i is None else i for i in spec)
            e.result = operator.itemgetter(*idx) if len(idx) > 1 else (lambda pool, i=idx[0]: (pool[i],))
        else:
            e.result = operator.itemgetter(spec)
        e.stream = stream_getter(streams[0])
        e.device = streams[0].device
        try:
            if len(_FAST) >= _FAST_LIMIT:
                _FAST.clear()
            _FAST[self.key] = e
        except TypeError:          # an unhashable keyword argument
            pass


def launcher_runner(plan, args, fields):
    """A ``_FastCall.set_runner`` binder for a launcher without prepared launches: on a hit,
    ``plan.launcher.run`` on a copy of ``args`` (a launch-arguments dataclass, validated by the
    slow path) whose ArrayRef ``fields`` are this call's arrays. The cache keeps no array alive."""
    refs = [(f, getattr(args, f)) for f in fields if getattr(args, f) is not None]
    base = copy.copy(args)
    for f, _ in refs:
        setattr(base, f, None)
    state = getattr(base, "__dict__", None)
    cls, run_launcher = type(args), plan.launcher.run

    def bind(index_of):
        spec = []
        for f, r in refs:
            i = index_of(r.ptr)
            if i is None:
                return None
            spec.append((f, i, r.shape, r.strides, r.kind, r.device, r.framework))

        def run(objs, ptrs, stream):
            if state is not None:
                a = cls.__new__(cls)
                a.__dict__.update(state)
            else:
                a = copy.copy(base)
            for f, i, shape, strides, kind, dev, fw in spec:
                setattr(a, f, ArrayRef(objs[i], ptrs[i], shape, strides, kind, dev, fw))
            run_launcher(plan, a, stream)
        return run
    return bind


def _check_scale_dtype(scale_dtype, math_kind: str, data_kind: str) -> None:
    """``scale_dtype`` for s8/u8 data may only name the scale kind the data implies (or e8m0, routed
    to runtime.lowbit before this check)."""
    if scale_dtype is not None and kind_of(scale_dtype, "scale_dtype") != math_kind:
        raise InvalidProblemError(f"scale_dtype={scale_dtype!r}; {data_kind} data takes "
                                  f"{'float64' if math_kind == 'f64' else 'float32'} scales "
                                  "(or 'e8m0' block scales with fp8 outputs)")


def quantize(x, scale, zero_point=None, *, scope, axis=None, group_size=None, out_dtype="int8",
             qmin=None, qmax=None, out=None, scale_dtype=None):
    """``q = clamp(rne(x / scale) + zero_point, qmin, qmax)`` per scope (SPEC §5).

    ``zero_point=None`` is symmetric mode: the implied zero point is 0 for signed outputs
    and the middle of the range (128) for u8. Low-bit outputs (fp8, packed int4) and
    ``scale_dtype="e8m0"`` (MX block scales): runtime.lowbit, docs/lowbit.md.
    """
    static, args = (scope, axis, group_size, out_dtype, qmin, qmax, scale_dtype), (x, scale, zero_point, out)
    r = _replay("quantize", static, args)
    if r is not _MISS:
        return r
    with _FastCall("quantize", static, args, scale_at=1) as fast:
        return _quantize(fast, x, scale, zero_point, scope, axis, group_size, out_dtype, qmin, qmax, out, scale_dtype)


def _quantize(fast, x, scale, zero_point, scope, axis, group_size, out_dtype, qmin, qmax, out, scale_dtype):
    xr = as_array(x, "x")
    if xr.kind not in kinds.FLOAT:
        raise UnsupportedError(f"x has dtype {xr.kind}; quantize takes {', '.join(kinds.FLOAT)}")
    qk = kind_of(out_dtype, "out_dtype")
    from . import lowbit   # fp8 / packed int4, MX e8m0 scales
    if qk in lowbit.KINDS or lowbit.is_e8m0(scale_dtype):
        return lowbit.quantize(xr, scale, zero_point, scope=scope, axis=axis, group_size=group_size, kind=qk,
                               qmin=qmin, qmax=qmax, out=out, scale_dtype=scale_dtype)
    if qk not in kinds.INT8:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; quantize produces {', '.join(kinds.INT8)}"
                               + (" (low-bit formats: docs/lowbit.md)" if qk in kinds.LOW_BIT else ""))
    _check_scale_dtype(scale_dtype, kinds.math_kind(xr.kind), xr.kind)
    xv = rows_view(xr, "x")
    axis = check_scope(xr.shape, scope, axis, group_size)
    qmin, qmax = check_range(qk, qmin, qmax)
    s = _scale_arg(scale, xr, scope, axis, group_size, kinds.math_kind(xr.kind))
    mode = "symmetric" if zero_point is None else "asymmetric"
    zp = None if zero_point is None else _zero_point_arg(zero_point, xr.shape, scope, axis, group_size, qmin, qmax, xr)
    _same_device([xr, s, zp])
    zp_value = implied_zero_point(qk) if zp is None else (zp if isinstance(zp, int) else 0)
    return _static(fast, "quantize", mode, xr, xv, out, s, zp, zp_value, scope, axis, group_size, xr.kind, qk,
                   qmin, qmax, qk)


def _static(fast, op, mode, x: ArrayRef, xv, out, scale, zp, zp_value, scope, axis, group_size, element, aux,
            qmin, qmax, out_kind):
    """quantize / dequantize after their checks: allocate (or check) the output, launch, remember."""
    outr = _out_arg(out, x, x.shape, out_kind)
    _same_device([x, outr])
    if x.size == 0:
        return outr.obj
    launch_elementwise(op, mode, element, aux, [(x, xv)], [(outr, rows_view(outr, "out"))], scale,
                       zp if isinstance(zp, ArrayRef) else None, zp_value, x.shape, scope, axis, group_size,
                       qmin, qmax, fast)
    fast.remember(outr.obj, (qmin, qmax))
    return outr.obj


def dequantize(q, scale, zero_point=None, *, scope, axis=None, group_size=None, out_dtype="float32", out=None,
               in_dtype=None, scale_dtype=None):
    """``y = (q - zero_point) * scale`` per scope, rounded once to ``out_dtype`` (SPEC §5).

    Low-bit inputs (runtime.lowbit, docs/lowbit.md): a torch fp8 tensor, or a uint8 container with
    ``in_dtype`` = ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"int4"`` (s4) or ``"uint4"`` (u4, packed two
    per byte); ``scale_dtype="e8m0"`` for MX block scales.
    """
    static, args = (scope, axis, group_size, out_dtype, in_dtype, scale_dtype), (q, scale, zero_point, out)
    r = _replay("dequantize", static, args)
    if r is not _MISS:
        return r
    with _FastCall("dequantize", static, args, scale_at=1) as fast:
        return _dequantize(fast, q, scale, zero_point, scope, axis, group_size, out_dtype, out, in_dtype, scale_dtype)


def _dequantize(fast, q, scale, zero_point, scope, axis, group_size, out_dtype, out, in_dtype, scale_dtype):
    qr = as_array(q, "q")
    from . import lowbit   # fp8 / packed int4, MX e8m0 scales
    low = lowbit.input_kind(qr, in_dtype)
    if low is not None or lowbit.is_e8m0(scale_dtype):
        return lowbit.dequantize(qr, scale, zero_point, scope=scope, axis=axis, group_size=group_size,
                                 kind=low or qr.kind, out_dtype=out_dtype, out=out, scale_dtype=scale_dtype)
    if qr.kind not in kinds.INT8:
        raise UnsupportedError(f"q has dtype {qr.kind}; dequantize takes {', '.join(kinds.INT8)}")
    yk = kind_of(out_dtype, "out_dtype")
    if yk not in kinds.FLOAT:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; dequantize produces {', '.join(kinds.FLOAT)}")
    _check_scale_dtype(scale_dtype, kinds.math_kind(yk), yk)
    qv = rows_view(qr, "q")
    axis = check_scope(qr.shape, scope, axis, group_size, "q")
    lo, hi = kinds.QRANGE[qr.kind]
    s = _scale_arg(scale, qr, scope, axis, group_size, kinds.math_kind(yk))
    mode = "symmetric" if zero_point is None else "asymmetric"
    zp = None if zero_point is None else _zero_point_arg(zero_point, qr.shape, scope, axis, group_size, lo, hi, qr)
    _same_device([qr, s, zp])
    zp_value = implied_zero_point(qr.kind) if zp is None else (zp if isinstance(zp, int) else 0)
    return _static(fast, "dequantize", mode, qr, qv, out, s, zp, zp_value, scope, axis, group_size, qr.kind, yk,
                   lo, hi, yk)
