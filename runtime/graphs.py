"""A repeated call's kernels, replayed as one CUDA graph launch.

On the H200 machine ``cuLaunchKernel`` costs the calling thread about 5.4 µs and ``cuGraphLaunch`` of
an instantiated graph about 2 µs with one kernel node and 3.2 µs with two or four
(``tools/probe_launch.py``, docs/perf-notes.md): a replay is cheaper as a graph launch even for one
kernel, and a call that launches N kernels (MoE routing then the product, the two passes of a
reduction) no longer pays the launch N times. :func:`bind_graph` turns the prepared launches of a
remembered call into one graph of kernel nodes in a chain (each kernel starts after the previous
one, as on a stream), and its replay is:

- where the stream has an executable graph holding exactly the call's parameter values, nothing to
  set;
- else, for each node of the stream's "floating" executable graph whose values differ from those it
  last launched with, ``cuGraphExecKernelNodeSetParams`` (the driver copies the values; launches
  already queued keep theirs);
- one ``cuGraphLaunch`` on the caller's stream.

Executable graphs are made per stream on first use there: the driver orders every launch of one
executable graph behind the previous launch of that graph, so sharing one between streams would
order the caller's streams behind each other. Besides the floating one, a stream keeps a "fixed"
executable graph per set of values that came back after the floating one had moved on (a call
whose results stay alive, so that its outputs cycle through a few addresses; a loop of layers
calling one op on their own activations): re-setting a node costs the calling thread about 1 µs
more than launching it, and launching one of several executable graphs costs what launching one
does (``tools/probe_launch.py``). A set of values becomes fixed the second time it is seen while
the floating graph holds others; the fixed graphs are bounded per stream (``FIXED``) and per
process (``FIXED_TOTAL``), and past the bounds a replay re-sets the floating graph.

A graph launch cannot be captured into a caller's graph (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
which also invalidates the capture), so on a stream that is being captured
(``cudaStreamIsCapturing``, asked on every replay) the kernels are launched one by one, as the
capture records them. Where the driver refuses a graph (or cannot be reached
through ctypes), ``bind_graph`` returns None and the call replays its launches one by one.

The graph is built through ctypes on libcuda (rarely: once per remembered call and stream), but the
two calls every replay makes, ``cudaStreamIsCapturing`` and ``cudaGraphLaunch``, go through CuPy's
Cython bindings of the runtime API (``cupy_backends.cuda.api.runtime``; CuPy is a dependency
anyway): on the H200 machine they cost the calling thread 0.38 and 3.25 µs against 0.85 and 3.61 µs
through ctypes (``tools/probe_host.py`` components). Runtime and driver handles are the same
objects, and the runtime uses the context the driver has current (a device's primary context); in a
thread with none current, the runtime makes the device's primary context current and leaves it so,
as every runtime call does (docs/errors.md "Devices").

A replay with work arrays (allocations it does not return) is one call too, ``go.with_work``: the
stream's executable graphs keep the work arrays made on its first launch there, and every later
replay on that stream reuses them (only that stream's executable graphs use them, and the stream
orders their launches); on a stream being captured it launches nothing and the replay launches the
kernels (``go.one_by_one``) on new work arrays, which the captured graph owns.
"""
from __future__ import annotations

import ctypes
import functools
import threading

from . import device
from .errors import SkuforgeError

_vp, _u = ctypes.c_void_p, ctypes.c_uint


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h)."""

    _fields_ = [("func", _vp), ("gridDimX", _u), ("gridDimY", _u), ("gridDimZ", _u), ("blockDimX", _u),
                ("blockDimY", _u), ("blockDimZ", _u), ("sharedMemBytes", _u), ("kernelParams", _vp),
                ("extra", _vp), ("kern", _vp), ("ctx", _vp)]


LAUNCHED, CAPTURING, MISALIGNED = 0, 1, 2     # what a replay with work arrays did (``go.with_work``)
FIXED, FIXED_TOTAL, SEEN = 32, 1024, 64      # fixed executables a stream / the process; remembered value sets


class Fixed:
    """The fixed executable graphs made through one driver (bounded by ``FIXED_TOTAL``: a soft bound,
    counted without a lock across graphs)."""

    __slots__ = ("count",)

    def __init__(self):
        self.count = 0


def fixed() -> Fixed:
    """The current driver's count of fixed executable graphs."""
    return device.driver().keep("graphs", Fixed)


class _Execs:
    """A stream's executable graphs: the floating one (``handle``; ``last``: the node values it holds,
    None where unknown), the fixed ones (``fixed``: node values -> handle, never re-set), the value
    sets seen recently (``seen``) and the work arrays the stream's replays share (``work``)."""

    __slots__ = ("floating", "handle", "last", "fixed", "owned", "seen", "work")

    def __init__(self, ex, last):
        self.floating, self.handle, self.last = ex, ex.value, last
        self.fixed, self.owned, self.seen, self.work = {}, [], {}, None


class _Graph:
    """One chain of kernel nodes, its parameter blocks, and executable graphs per stream."""

    def __init__(self, drv, fns, preps, ctx: int):
        self.fns, self.ctx, self.total, self.on_context = fns, ctx, drv.keep("graphs", Fixed), drv.on_context
        self.first = [tuple(p.values) for p in preps]      # the values the nodes were made with
        self.graph = _vp()
        self.nodes, self.blocks, self.params = [], [], []
        self.execs: dict = {}            # stream handle -> _Execs
        self.lock = threading.Lock()
        with self.on_context(ctx):
            self._check(fns["cuGraphCreate"](ctypes.byref(self.graph), _u(0)), "cuGraphCreate")
            prev = None
            for p in preps:
                pb = device.ParamBlock(p.abi.fmt)
                pb.struct.pack_into(pb.buf, 0, *p.values)
                gx, gy, gz = (tuple(p.grid) + (1, 1))[:3]
                bx, by, bz = (tuple(p.block) + (1, 1))[:3]
                kp = KernelNodeParams(func=p.fn.ptr, gridDimX=gx, gridDimY=gy, gridDimZ=gz, blockDimX=bx,
                                      blockDimY=by, blockDimZ=bz, sharedMemBytes=p.shared_mem,
                                      kernelParams=pb.ptrs_addr, extra=None, kern=None, ctx=None)
                node = _vp()
                deps = (_vp * 1)(prev) if prev is not None else None
                self._check(fns["cuGraphAddKernelNode_v2"](ctypes.byref(node), self.graph, deps,
                                                           ctypes.c_size_t(1 if deps else 0), ctypes.byref(kp)),
                            "cuGraphAddKernelNode")
                prev = node.value
                self.nodes.append(_vp(node.value))
                self.blocks.append(pb)
                self.params.append(kp)

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err:
            raise OSError(f"{what}: CUresult {err}")

    def instantiate(self):
        """A new executable graph of the chain (its nodes hold ``first``)."""
        ex = _vp()
        with self.on_context(self.ctx):
            err = self.fns["cuGraphInstantiateWithFlags"](ctypes.byref(ex), self.graph, ctypes.c_ulonglong(0))
        if err:
            raise SkuforgeError(f"cuGraphInstantiateWithFlags failed: CUresult {err}")
        return ex

    def executable(self, stream: int) -> _Execs:
        """``stream``'s executable graphs, the floating one instantiated on first use."""
        st = _Execs(self.instantiate(), tuple(self.first))
        if len(self.execs) >= 64:        # streams made and dropped by a caller: forget the oldest
            self._destroy(self.execs.pop(next(iter(self.execs))))
        self.execs[stream] = st
        return st

    def _destroy(self, st: _Execs) -> None:
        destroy = self.fns["cuGraphExecDestroy"]
        destroy(st.floating)
        for ex in st.owned:
            destroy(ex)
        self.total.count -= len(st.owned)

    def __del__(self):
        try:
            for st in self.execs.values():
                self._destroy(st)
            self.fns["cuGraphDestroy"](self.graph)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone already
            pass


def bind_graph(preps):
    """``go(stream, values_0, values_1, ...)``: the prepared launches ``preps``
    (runtime.launch.PreparedLaunch, one context) as one graph launch on ``stream``, each node's
    parameters re-set only where ``values_i`` changed; on a stream that is being captured, each
    launch on the stream (what the capture records). None where no graph can be made.

    Built here once, in steps; what a replay runs is the closures they return, each bound to what it
    reads (nothing is looked up per call): ``go`` (:func:`_in_graph_context`) > ``run``
    (:func:`_runner`) > ``launch_values`` > ``set_nodes`` (:func:`_value_launcher`)."""
    drv = device.driver()
    fns = drv.graph_calls()
    g = None if fns is None or not preps else _graph_of(drv, fns, preps)
    if g is None:
        return None
    bound = [p.bound() for p in preps]
    is_capturing = fns["streamIsCapturing"]
    launch_values = _value_launcher(g, fns["cuGraphExecKernelNodeSetParams_v2"], fns["graphLaunch"])
    go, in_context = _in_graph_context(drv, g.ctx, _runner(g, bound, is_capturing, launch_values))
    go.graph, go.with_work = g, _work_launcher(g, is_capturing, launch_values, in_context)
    go.one_by_one = _one_by_one(bound)
    return go


def _graph_of(drv, fns, preps):
    """The chain of ``preps`` as a :class:`_Graph`; None where their functions live in more than one
    context, are not loaded functions, or the driver refuses the graph."""
    try:
        ctxs = {drv.context_of(p.fn) for p in preps}
        if len(ctxs) != 1:
            return None
        return _Graph(drv, fns, preps, ctxs.pop())
    except (OSError, AttributeError):     # the driver refused, or not a loaded function
        return None


def _value_launcher(g, setp, launch):
    """``launch_values(stream, st, values)`` of ``g`` (``st``: a stream's :class:`_Execs`; ``values``:
    the node values, a tuple per node): the executable graph that holds them already, a fixed one for
    values that came back, else the floating one with its changed nodes re-set (``setp``:
    cuGraphExecKernelNodeSetParams), launched (``launch``: the runtime's graph launch)."""
    nodes, blocks, params, total = g.nodes, g.blocks, g.params, g.total
    refs = [ctypes.byref(p) for p in params]     # the nodes' parameters, as the driver reads them
    n = len(nodes)

    def set_nodes(ex, values, held):
        """Each node of ``ex`` whose values differ from ``held`` (its values per node) set to ``values``."""
        for i in range(n):
            v = values[i]
            if v != held[i]:
                pb = blocks[i]
                pb.struct.pack_into(pb.buf, 0, *v)
                err = setp(ex, nodes[i], refs[i])
                if err:
                    raise SkuforgeError(f"cuGraphExecKernelNodeSetParams failed: CUresult {err}")

    def launch_values(stream, st, values):
        """Under the lock: an executable graph of ``st`` holding ``values``, launched on ``stream``."""
        if values == st.last:
            h = st.handle
        else:
            try:                         # again: True / False, or None where values cannot be hashed
                h = st.fixed.get(values)
                again = h is None and values in st.seen
            except TypeError:            # (a bytearray, say): the floating graph only
                h, again = None, None
            if h is None:
                if again and len(st.fixed) < FIXED and total.count < FIXED_TOTAL:
                    ex = g.instantiate()         # a set of values that came back: its own graph
                    st.owned.append(ex)
                    total.count += 1
                    set_nodes(ex, values, g.first)
                    h = st.fixed[values] = ex.value
                else:
                    if again is not None:
                        if len(st.seen) >= SEEN:
                            st.seen.clear()
                        st.seen[values] = None
                    last, st.last = st.last, None      # unknown until the driver took them all
                    set_nodes(st.floating, values, last or (None,) * n)
                    st.last, h = values, st.handle
        try:
            launch(h, stream)
        except Exception as e:           # noqa: BLE001 - CuPy's CUDARuntimeError, as the typed error
            raise SkuforgeError(f"cudaGraphLaunch failed: {e}") from None
    return launch_values


def _runner(g, bound, is_capturing, launch_values):
    """``run(stream, values)``: the graph launch of ``values`` on ``stream`` (its executable graphs
    made on first use there); on a stream being captured, each bound launch instead."""
    execs, lock = g.execs, g.lock

    def run(stream, values):
        with lock:                       # the node parameter blocks, the per-stream state
            try:
                cap = is_capturing(stream)
            except Exception:            # noqa: BLE001 - an invalidated capture, or a stream the runtime
                cap = True               # cannot tell about: launch the kernels, which report what is wrong
            if cap:
                # a caller's capture: a graph launch cannot be captured
                # (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED), the kernels can
                for b, v in zip(bound, values):
                    b(stream, v)
                return
            launch_values(stream, execs.get(stream) or g.executable(stream), values)
    return run


def _in_graph_context(drv, ctx, run):
    """(``go(stream, *values)``, ``in_context(fn, *args)``): ``run(stream, values)``, and any ``fn``, in
    the graph's context ``ctx`` (``go`` calls ``run`` itself: a replay pays no call of ``in_context``)."""
    on_context, current = drv.on_context, drv.context_current

    def go(stream, *values):
        # as Driver.bind_launch: the graph's context is made current where another one is
        # (several devices) or where the driver refused for want of one
        if drv.several and ctx and current() != ctx:
            with on_context(ctx):
                return run(stream, values)
        try:
            return run(stream, values)
        except SkuforgeError:
            if not ctx or current() == ctx:
                raise
        with on_context(ctx):
            return run(stream, values)

    def in_context(fn, *args):
        # as Driver.bind_launch: the graph's context is made current where another one is
        # (several devices) or where the driver refused for want of one
        if drv.several and ctx and current() != ctx:
            with on_context(ctx):
                return fn(*args)
        try:
            return fn(*args)
        except SkuforgeError:
            if not ctx or current() == ctx:
                raise
        with on_context(ctx):
            return fn(*args)
    return go, in_context


def _work_launcher(g, is_capturing, launch_values, in_context):
    """``with_work(make, values_of)``: the one-call replay of a call with work arrays (its docstring)."""
    execs, lock = g.execs, g.lock

    def with_work(make, values_of):
        """``launch(stream, vals, news)``, the replay of a call with work arrays in one call: on an
        executable graph of ``stream``, with the work arrays the stream keeps (``make(stream)`` on
        first use: a tuple, or None when one is misaligned), the node values
        ``values_of(vals, news, kept)`` set and launched; returns ``LAUNCHED``, else ``CAPTURING`` (``stream`` is being captured:
        the caller launches the kernels, ``one_by_one``, with new work arrays, which the captured
        graph owns) or ``MISALIGNED`` (nothing launched). Only the stream's executable graphs use
        its work arrays, and the stream orders their launches one behind the other."""
        def kept(stream, vals, news):
            with lock:
                try:
                    cap = is_capturing(stream)
                except Exception:        # noqa: BLE001 - as in run()
                    cap = True
                if cap:
                    return CAPTURING
                st = execs.get(stream) or g.executable(stream)
                work = st.work
                if work is None:
                    work = make(stream)
                    if work is None:
                        return MISALIGNED
                    st.work = work
                launch_values(stream, st, values_of(vals, news, work))
            return LAUNCHED

        return functools.partial(in_context, kept)
    return with_work


def _one_by_one(bound):
    """``one_by_one(stream, *values)``: the bound launches, each with its values."""
    def one_by_one(stream, *values):
        """Each launch on ``stream`` (what a capture records)."""
        for b, v in zip(bound, values):
            b(stream, v)
    return one_by_one
