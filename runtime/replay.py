"""Replay of repeated calls: the replay of repeated calls, applied once at the API boundary.

Every op goes through :func:`call`: a call whose arguments have the same types, shapes, strides,
dtypes, devices and 16-byte alignment (and the same keyword arguments, types included) as an
earlier, fully validated call replays that call (its allocations, then its prepared launches with
every pointer slot re-filled, as one CUDA graph launch: runtime/graphs.py; the work arrays it does
not return are kept per stream with the graph); any other call runs the
op's full path (normalize → plan → launch) under a :class:`Recording` that records it. The status word of the device is read on every call
(runtime/status.py), on both paths. A call that torch traces becomes the op's custom op instead
(:func:`call`, runtime/torch/traced.py).
"""
from __future__ import annotations

import copy
import math
import sys

from . import config, device, status
from .arrays import ArrayRef, allocator, recording_allocations, stream_getter, work_allocator
from .replay_code import MISS, Entry, write_replay


def call(sig, static: tuple, args: tuple, first):
    """The op of signature ``sig`` (runtime/signatures.py) on ``args`` (arrays, scalars, None: the
    signature's ``arrays``) with keyword values ``static``: a replay when one is remembered, else
    ``first(rec, *args, *static)`` (the op's normalize → plan → launch) under a :class:`Recording`
    ``rec``. The functional functions make this call as their signature declares it; ``first`` is
    a module-level function, not a closure: a closure over the call's arguments would cost every
    call its cells, replays included. A call that torch traces is the op's ``torch.ops.skuforge``
    custom op (see ``TRACING``)."""
    op = sig.name
    if TRACING() and any(isinstance(a, TENSOR) for a in args):
        return traced(op, static, args)
    key, vals = call_key(op, static, args)
    if key is not None:
        try:
            entry = CACHE.get(key)
        except TypeError:          # an unhashable keyword value: the first-call path validates it
            entry = None
        if entry is not None:
            r = entry.go(args, vals, static)
            if r is not MISS:
                return r
    if torch_traces(args):
        return traced(op, static, args)
    with Recording(sig, static, args) as rec:
        return first(rec, *args, *static)


# -- calls that torch traces ------------------------------------------------------------------------
# A functional call on torch tensors that torch traces -- torch.compile or torch.export (Dynamo), or
# tensors with no memory to launch on (FakeTensor, functional tensors and other subclasses, meta
# tensors) -- is the op's torch.ops.skuforge custom op, called by runtime.torch (runtime/torch/traced.py),
# not a launch. Once a torch tensor has been seen, ``TRACING`` is ``torch.compiler.is_dynamo_compiling``:
# a function that returns False, which Dynamo folds to True. It is the one check a repeated call pays;
# the other cases (tensors that cannot be replayed) are found on the full path (:func:`torch_traces`).
def _never() -> bool:
    return False


TRACING = _never
TENSOR = None           # torch.Tensor, with TRACING
traced = None           # runtime.torch's dispatch ``(op, static, args) -> result``, with TRACING
LOAD_TORCH = None       # set by runtime/__init__.py: imports runtime.torch and returns that dispatch


def _watch_torch(torch) -> None:
    """A torch tensor is seen for the first time: load runtime.torch (the custom ops and their
    dispatch) and check for Dynamo from now on."""
    global TRACING, TENSOR, traced
    if traced is None:
        traced = LOAD_TORCH()
        TENSOR = torch.Tensor
        TRACING = torch.compiler.is_dynamo_compiling


def _dispatches(torch, t) -> bool:
    """Whether tensor type ``t`` is a ``__torch_dispatch__`` subclass (FakeTensor, FunctionalTensor, ...):
    its ops go to its dispatch, not to memory of its own. (A subclass without one has its memory: it is
    launched on like a tensor, and a custom op's implementation receives it as such.)"""
    return t.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def torch_traces(args) -> bool:
    """Whether torch traces this call on torch tensors (full path only): Dynamo, or a tensor argument
    of a ``__torch_dispatch__`` subclass or on the meta device."""
    torch = sys.modules.get("torch")
    if torch is None or traced is None:
        return False
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and (torch.compiler.is_dynamo_compiling()
                              or any(t.is_meta or _dispatches(torch, type(t)) for t in tensors))


# -- how a call is remembered ---------------------------------------------------------------------
# A call whose arguments have the same types, shapes, strides, dtypes, devices and 16-byte
# alignment (and the same keyword arguments, types included) as an earlier, fully validated call
# replays that call. The key holds the keyword values; their types are compared by the replay
# itself, and only where equal values may differ in type (1, 1.0, True and numpy.int64(1) are
# equal keys, not equally valid; a str or None equals only a str or None): that costs a repeated
# call less than a key with a type per keyword. A replay with other types misses and runs the
# full path, which validates them. The replay: the same allocations, then its prepared launches
# with every pointer slot refilled (and a Python scalar scale / zero point re-checked and
# refilled). Device-array *values* are checked by the kernels (runtime/status.py), so a replay
# checks nothing on the host; under the synchronous debug mode (``runtime.sync_checks()``) a call
# with a device scale or zero point takes the full path, which checks them.
#
# Which slot takes which pointer is found when the call is remembered, by matching every nonzero
# pointer slot ("Q" in the struct format) against the pointers of the array arguments and of
# the allocations the full path made (the status word's pointer is a constant of the device): a
# pointer that matches nothing, or two sources that share a pointer (in-place calls), leave the
# call without a replay rather than guess. The launching code names the rest: scalar slots
# (``add_launch(params=...)``, verified against the values), pointers into an array at an offset
# (``refs``: workspace regions) and parameters encoded from an array's address (``maps``: tensor
# maps), each re-derived from the new array on a hit.
CACHE = config.CACHES.new()
LIMIT = 2048
_NONE = ("none",)
# exact type -> 1 torch tensor, 2 cupy array, 3 Python float / int, 4 None, 0 anything else
_FRAMEWORK: dict = {float: 3, int: 3, type(None): 4}


def _framework_of(t):
    """The framework code of type ``t``; None for a torch tensor type that Dynamo is tracing (not
    remembered). A ``__torch_dispatch__`` subclass (FakeTensor, functional tensors, ...) is not
    replayed: the full path hands its calls to the custom ops (:func:`torch_traces`)."""
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(t, torch.Tensor):
        _watch_torch(torch)
        if torch.compiler.is_dynamo_compiling():
            return None
        return 0 if _dispatches(torch, t) else 1
    cp = sys.modules.get("cupy")
    if cp is not None and issubclass(t, cp.ndarray):
        return 2
    return 0


def describe(obj):
    """(hashable signature, pointer or scalar value) of one argument; (None, None) = no replay.

    Arrays: type, shape, strides, dtype, device and pointer alignment, in as few attribute reads
    as the framework allows; Python scalars: their type (the value is refilled on a hit); another
    array: the driver's description (none for the real driver: no replay)."""
    t = type(obj)
    if t is float or t is int:
        return t, obj
    if obj is None:
        return _NONE, 0
    fw = _FRAMEWORK.get(t)
    if fw is None:
        fw = _framework_of(t)
        if fw is None:
            return None, None
        _FRAMEWORK[t] = fw
    if fw == 1:                    # get_device(): -1 for a tensor off the GPU
        p = obj.data_ptr()
        return (t, obj.shape, obj.stride(), obj.dtype, obj.get_device(), p & 15), p
    if fw == 2:
        d = obj.data
        p = d.ptr
        return (t, obj.shape, obj.strides, obj.dtype, d.device_id, p & 15), p
    return device.driver().describe(obj)


def _scalar_check(scale_at, zp_check):
    """The hit-time check of Python scalar parameters (what _scale_arg / _zero_point_arg accept)."""
    inf = math.inf
    if zp_check is None:
        return lambda vals: 0.0 < vals[scale_at] < inf
    z, lo, hi = zp_check
    if scale_at is None:
        return lambda vals: lo <= vals[z] <= hi
    return lambda vals: 0.0 < vals[scale_at] < inf and lo <= vals[z] <= hi


def call_key(op, static, args):
    """(cache key, pointers and scalar values of ``args``), or (None, None): no replay."""
    k = [op, static]             # the types of static: checked by the replay (Entry.typed)
    vals = []
    fws = _FRAMEWORK
    try:
        for a in args:             # describe(), inlined for the common types: this runs on every call
            t = type(a)
            fw = fws.get(t)
            if fw == 1:
                v = a.data_ptr()
                sig = (t, a.shape, a.stride(), a.dtype, a.get_device(), v & 15)
            elif fw == 2:
                d = a.data
                v = d.ptr
                sig = (t, a.shape, a.strides, a.dtype, d.device_id, v & 15)
            elif fw == 3:
                sig, v = t, a
            elif fw == 4:
                sig, v = _NONE, 0
            else:
                sig, v = describe(a)
                if sig is None:
                    return None, None
            k.append(sig)
            vals.append(v)
    except Exception:              # noqa: BLE001 - an odd argument: the full path raises the typed error
        return None, None
    return tuple(k), vals


class Recording:
    """Records a functional call's full path so that it can be replayed (:func:`call` uses it thus):

        with Recording(sig, static, args) as rec:   # records the allocations
            ...validate, allocate...; launch_elementwise(..., rec=rec)  # or add_launch / set_runner
            rec.remember(result, zp_range)
            return result

    ``sig``: the op's signature (``names``: its replay arguments' names, ``scalars``: the indices of
    the scale and zero point, if any). ``static``: the keyword values (hashable; their types are part
    of the key). ``args``: the array / scalar / None arguments.
    """

    __slots__ = ("key", "static", "args", "vals", "op", "names", "scalars", "launches", "runner", "log", "_rec",
                 "disjoint", "device_values")

    def __init__(self, sig, static, args):
        self.static, self.args = static, args
        self.op, self.names, self.scalars = sig.name, sig.arrays, sig.scalars
        self.disjoint = None
        self.device_values = False
        self.key, self.vals = call_key(self.op, static, args)
        if self.key is not None:
            try:
                if self.key in CACHE:      # remembered already: a call that had to check device values,
                    # or whose keyword values differ in type from the remembered call's
                    self.key = None
            except TypeError:              # an unhashable keyword argument
                self.key = None

    # -- recording (full path) ------------------------------------------------------------------
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

    def add_launch(self, prep, stream_ref: ArrayRef, params=None, refs=(), maps=()):
        """A prepared launch of the full path (``prep.launch(stream_handle(stream_ref))``) to replay.
        ``params``: the names of the parameters that take a Python scalar scale and zero point, or
        None when the kernel reads neither. ``refs``: ``((slot, ArrayRef, byte offset), ...)``,
        pointer slots that point into an array (workspace regions); ``maps``: ``((slot, ArrayRef,
        encode), ...)``, parameters derived from an array's address (``encode(ptr)``: a tensor map).
        Every other nonzero pointer slot must hold an argument's or an allocation's address."""
        if self.key is not None:
            self.launches.append((prep, stream_ref, params, tuple(refs), tuple(maps)))

    def set_runner(self, bind, stream_ref: ArrayRef):
        """Replay by calling code instead of prepared launches: ``bind(index_of)`` is called when the
        call is remembered (``index_of(ptr)``: the source index of a pointer, None if unknown) and
        returns ``run(objs, ptrs, stream)`` (or None: no replay); ``objs`` / ``ptrs``: the
        arguments then the allocations and their pointers, in the full path's order."""
        if self.key is not None:
            self.runner = (bind, stream_ref)

    def require_disjoint(self, spans, written=None):
        """A replay must find these arguments apart in memory, as the full path checked: ``spans``
        is ``((argument index, first byte, end byte), ...)`` (:func:`runtime.arrays.byte_span`; fixed by the key).
        ``written``: the argument indices the call writes; only pairs with one of them are tested
        (inputs may overlap each other). None: every pair."""
        if self.key is not None:
            spans = tuple(spans)
            self.disjoint = tuple((*a, *b) for k, a in enumerate(spans) for b in spans[k + 1:]
                                  if written is None or a[0] in written or b[0] in written)

    def checks_device_values(self):
        """This call reads device-array values that the synchronous debug mode checks on the host
        (``runtime.sync_checks()``; e.g. MoE offsets): under that mode a replay takes the full path."""
        self.device_values = True

    def remember(self, result, zp_range=None):
        """Store this (successful) call for replay, unless some slot cannot be accounted for. The
        steps: where each pointer comes from (:func:`_pointer_sources`), what the call returns
        (:func:`_result_spec`), the Python scalars a replay re-checks (:meth:`_scalar_sources`),
        each launch's re-filled slots (:func:`_slots`), then the replay written
        (:func:`runtime.replay_code.write_replay`)."""
        if self.key is None or not (self.launches or self.runner):
            return
        args, log = self.args, self.log
        found = _pointer_sources(args, self.vals, log)
        if found is None:
            return
        srcs, allocs = found
        spec = _result_spec(result, list(args) + [entry[0] for entry in log])
        if spec is None:
            return
        e = Entry()
        e.checked, e.check, e.runner, e.disjoint = self.device_values, None, None, self.disjoint
        e.typed = tuple((i, type(v)) for i, v in enumerate(self.static) if v is not None and type(v) is not str)
        scalars = self._scalar_sources(e, zp_range)
        if scalars is None:
            return
        launches, streams = [], []
        for prep, ref, params, refs, maps in self.launches:
            slots = _slots(prep, params, refs, maps, srcs, scalars, args)
            if slots is None:
                return
            launches.append((prep, list(prep.values), slots))
            streams.append(ref)
        if self.runner is not None:
            bind, ref = self.runner
            e.runner = bind(srcs.get)
            if e.runner is None:
                return
            streams.append(ref)
        if any((r.framework, r.device) != (streams[0].framework, streams[0].device) for r in streams):
            return
        e.launches, e.allocs, e.result = tuple(launches), tuple(allocs), spec
        e.stream = stream_getter(streams[0])
        e.device = streams[0].device
        e.go = write_replay(e, len(args), spec)
        try:
            if len(CACHE) >= LIMIT:
                CACHE.clear()
            CACHE[self.key] = e
        except TypeError:          # an unhashable keyword argument
            pass

    def _scalar_sources(self, e: Entry, zp_range):
        """{0: source index of a Python scalar scale, 1: of a Python int zero point} that a replay
        re-fills, their hit-time check put in ``e.check`` (a device scale or zero point marks ``e``
        checked); None where an int zero point comes without its range (no replay)."""
        scalars, scale_at, zp_check = {}, None, None
        if self.scalars is not None:
            sa, za = self.scalars
            s = self.args[sa]
            if type(s) in (float, int):
                scale_at = scalars[0] = sa
            elif s is not None:
                e.checked = True
            z = None if za is None else self.args[za]
            if type(z) is int:
                if zp_range is None:
                    return None
                zp_check = (za, *zp_range)
                scalars[1] = za
            elif z is not None:
                e.checked = True
        if scalars:
            e.check = _scalar_check(scale_at, zp_check)
        return scalars


def _pointer_sources(args, vals, log):
    """({pointer: source index}: the arguments, then the allocations the full path made; the
    replay's allocators) of a recorded call; None where a pointer is null or comes from two sources
    (an in-place call)."""
    srcs = {}
    for i, a in enumerate(args):
        t = type(a)
        if a is None or t is float or t is int:
            continue
        p = vals[i]
        if not p or p in srcs:
            return None
        srcs[p] = i
    allocs = []
    for k, (obj, p, like, shape, kind, strides) in enumerate(log):
        if not p or p in srcs:
            return None
        srcs[p] = len(args) + k
        allocs.append((allocator(like, shape, kind, strides), p & 15, work_allocator(like, shape, kind, strides)))
    return srcs, allocs


def _result_spec(result, pool):
    """The source index in ``pool`` (the arguments, then the allocations) of what the call returns (a
    tuple of them, None for a None, for a tuple result); None where one is not in the pool."""
    def where(obj):
        for i, o in enumerate(pool):
            if o is obj and type(o) not in (float, int):
                return i
        return None
    if isinstance(result, tuple):
        spec = tuple(None if r is None else where(r) for r in result)
        if any(i is None for i, r in zip(spec, result) if r is not None):
            return None
        return spec
    return where(result)


def _slots(prep, params, refs, maps, srcs, scalars, args):
    """{slot: (source index, byte offset, encode or None)} of one recorded launch: the slots a replay
    re-fills (``refs``, ``maps``, every other nonzero pointer, the named scalar slots); None where
    one cannot be accounted for."""
    template, fmt = prep.values, prep.fmt
    if len(fmt) != len(template):
        return None
    slots = {}
    for j, r, off in refs:
        i = srcs.get(r.ptr)
        if i is None or template[j] != r.ptr + off:
            return None            # not an argument or allocation, or not the value launched
        slots[j] = (i, off, None)
    for j, r, encode in maps:
        i = srcs.get(r.ptr)
        if i is None:
            return None
        slots[j] = (i, 0, encode)
    for j, (c, v) in enumerate(zip(fmt, template)):
        if c == "Q" and v and j not in slots and not status.is_status_pointer(v):
            i = srcs.get(v)
            if i is None:
                return None        # a pointer that is neither an argument nor an allocation
            slots[j] = (i, 0, None)
    for which, i in scalars.items():
        if params is not None:
            j = prep.abi.slot[params[which]]
            if template[j] != args[i] or fmt[j] == "Q":
                return None        # the named slot does not hold the scalar
            slots[j] = (i, 0, None)
    return slots


def launcher_runner(plan, args, fields):
    """A ``Recording.set_runner`` binder for a launcher without prepared launches: on a hit,
    ``plan.launcher.run`` on a copy of ``args`` (a launch-arguments dataclass, validated by the
    full path) whose ArrayRef ``fields`` are this call's arrays. The cache keeps no array alive."""
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
