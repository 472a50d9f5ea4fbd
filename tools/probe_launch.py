"""What a launch costs the host on this machine, and whether a CUDA graph is cheaper for calls that
launch several kernels (the one-call-path host target: 10 µs a call, 3 µs per further launch).

    PYTHONPATH=. python3 tools/probe_launch.py --out probe_launch.json

Every timed call goes through ctypes on libcuda with its arguments made once (as
``runtime.device.bind_launch`` does), queued behind a 40 ms spin kernel so that the launch queue
neither drains nor fills; µs per call, median of ``--repeats`` batches of ``--calls``:

- ``cuLaunchKernel`` of a one-thread kernel, 1, 2 and 4 times a call (the per-launch driver cost);
- ``cuGraphLaunch`` of an instantiated graph of 1, 2 and 4 such kernels;
- ``cuGraphExecKernelNodeSetParams`` on every node, then ``cuGraphLaunch``: what a replay that
  re-points each kernel at the call's arrays would pay;
- the same two for a kernel of 24 pointer and 8 integer parameters (the size of an LSQ or MoE
  launch's), and ``cuLaunchKernel`` of it: whether the driver's cost grows with the parameters;
- ``cuGraphLaunch`` of 4 instantiated copies of a one-kernel graph in turn, with fixed parameters:
  what a replay pays that keeps an executable graph per recurring set of addresses instead of
  re-setting one;
- ``cuLaunchKernel`` through CuPy's Cython binding (``cupy_backends.cuda.api.driver.launchKernel``)
  against ctypes;
- one graph launch and the capture query (what every replay makes) through CuPy's runtime binding,
  ctypes and ``cuda.bindings``, on the non-blocking stream and on the legacy default stream (a torch
  caller's default current stream);
- ``cuMemsetD32Async`` of one word;
- the 32 parameters of the wide kernel as one struct parameter (``__grid_constant__``, the same 224
  bytes): ``cuLaunchKernel``, the graph launch, and re-setting the node's parameters before it.

Check, printed ``ok`` / ``FAILED`` (the exit status): every timed launch ran (a device counter that
each kernel increments equals the number of kernels issued, also after the parameters were
re-pointed at a second counter). Fact, printed and recorded, not a check: whether the driver
captures a graph launch into a caller's CUDA graph (stream capture around ``cuGraphLaunch``, then
the outer graph replayed). runtime/graphs.py assumes it does not (a CUDA 13
driver answers CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, 900) and launches the kernels one by one
under a capture.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from types import SimpleNamespace

KERNEL = r"""
extern "C" __global__ void sf_probe_count(unsigned long long* c) {
    if (threadIdx.x == 0 && blockIdx.x == 0) *c += 1ull;
}
""" + """
extern "C" __global__ void sf_probe_wide(unsigned long long* c, %s) {
    if (threadIdx.x == 0 && blockIdx.x == 0) *c += 1ull + (unsigned long long)(%s);
}
""" % (", ".join([f"const float* p{i}" for i in range(23)] + [f"int n{i}" for i in range(8)]),
       " + ".join(f"(p{i} != 0)" for i in range(23)) + " + " + " + ".join(f"n{i}" for i in range(8)))
KERNEL += """
struct sf_probe_args { unsigned long long* c; const float* p[23]; int n[8]; };
extern "C" __global__ void sf_probe_struct(const __grid_constant__ sf_probe_args a) {
    if (threadIdx.x == 0 && blockIdx.x == 0) *a.c += 1ull + (unsigned long long)(a.p[22] != 0) + a.n[7];
}
"""
WIDE = "Q" * 24 + "i" * 8          # its parameters: the counter, 23 pointers, 8 ints (all zero)
NS = 40_000_000          # the spin kernel the timed calls queue behind


def check(err, what):
    if err != 0:
        raise RuntimeError(f"{what}: CUresult {err}")

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="probe_launch.json")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    p = _setup(args)
    one = _launches(p)
    graphs = _graphs_of_launches(p, one)
    repoint_and_launch = _repointed(p, graphs)
    _wide_kernels(p, repoint_and_launch)
    _executables_in_turn(p, graphs)
    _bindings(p, graphs)
    _check_and_memset(p)
    _capture_fact(p, graphs)
    with open(args.out, "w") as fh:
        json.dump(p.out, fh, indent=1)
    return 0 if all(isinstance(c, dict) and c.get("ok") for c in p.out["checks"].values()) else 1


def _setup(args) -> SimpleNamespace:
    """What the steps share: libcuda, the counting kernel ``f`` and its launch arguments made once
    (``cargs``, ``pa``: the first counter's parameters; ``params_b``: the second's), the non-blocking
    stream (``s``: its handle), the counters, the record ``out``, the kernels ``issued`` per counter
    and ``timed``."""
    import cupy as cp

    from codegen.harness.bench.timing import SPIN_SRC
    lib = ctypes.CDLL("libcuda.so.1")
    vp, u = ctypes.c_void_p, ctypes.c_uint
    spin = cp.RawKernel(SPIN_SRC, "sf_bench_spin")
    fn = cp.RawKernel(KERNEL, "sf_probe_count")
    fn.compile()
    f = fn.kernel.ptr
    stream = cp.cuda.Stream(non_blocking=True)
    s = stream.ptr
    counters = cp.zeros(2, dtype=cp.uint64)
    ptr_a = ctypes.c_uint64(counters.data.ptr)
    ptr_b = ctypes.c_uint64(counters.data.ptr + 8)
    params_a = (vp * 1)(ctypes.addressof(ptr_a))
    params_b = (vp * 1)(ctypes.addressof(ptr_b))
    launch = lib.cuLaunchKernel
    launch.restype = ctypes.c_int
    cargs = (vp(f), u(1), u(1), u(1), u(32), u(1), u(1), u(0), vp(s))
    pa, nul = vp(ctypes.addressof(params_a)), vp(None)
    out = {"checks": {}, "facts": {}, "us": {}}
    issued = [0, 0]
    # kept: what the launches point at (the kernel's module, the parameter blocks) lives as long as the probe
    return SimpleNamespace(cp=cp, lib=lib, f=f, stream=stream, s=s, counters=counters, params_a=params_a,
                           params_b=params_b, launch=launch, cargs=cargs, pa=pa, nul=nul, out=out, issued=issued,
                           timed=_timer(args, cp, spin, stream, out, issued), kept=[fn, ptr_a, ptr_b])


def _timer(args, cp, spin, stream, out, issued):
    """``timed(label, call, kernels=0, which=0, on=None)``: µs per ``call()``, the median of
    ``--repeats`` batches of ``--calls``, each queued behind the spin kernel on ``on`` (default: the
    probe's stream); ``kernels`` a call, counted on counter ``which``."""
    def timed(label, call, kernels=0, which=0, on=None):
        on = stream if on is None else on      # the stream the calls queue on, behind the spin kernel
        per = []
        for _ in range(args.repeats):
            on.synchronize()
            spin((1,), (1,), (cp.uint64(NS),), stream=on)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            per.append((time.perf_counter() - t0) / args.calls * 1e6)
            issued[which] += kernels * args.calls
        on.synchronize()
        out["us"][label] = {"us": statistics.median(per), "min_us": min(per)}
        print(f"{label:62s} {statistics.median(per):7.2f} µs", flush=True)
    return timed


def _launches(p):
    """cuLaunchKernel of the counting kernel 1, 2 and 4 times a call; returns ``one()`` (one launch)."""
    launch, cargs, pa, nul, timed = p.launch, p.cargs, p.pa, p.nul, p.timed

    def one():
        return launch(*cargs, pa, nul)
    for n in (1, 2, 4):
        if n == 1:
            timed("cuLaunchKernel x1", one, 1)
        else:
            timed(f"cuLaunchKernel x{n}", lambda n=n: [one() for _ in range(n)], n)
    return one


def _graphs_of_launches(p, one) -> dict:
    """{n: (graph, exec, nodes)}: graphs of n kernels, made by capturing n launches (``one``) on the
    stream; each timed."""
    lib, s, timed = p.lib, p.s, p.timed
    vp, u = ctypes.c_void_p, ctypes.c_uint
    for name, restype in (("cuStreamBeginCapture_v2", ctypes.c_int), ("cuStreamEndCapture", ctypes.c_int),
                          ("cuGraphInstantiateWithFlags", ctypes.c_int), ("cuGraphLaunch", ctypes.c_int),
                          ("cuGraphGetNodes", ctypes.c_int), ("cuGraphExecKernelNodeSetParams_v2", ctypes.c_int),
                          ("cuMemsetD32Async", ctypes.c_int)):
        getattr(lib, name).restype = restype
    graphs = {}
    for n in (1, 2, 4):
        check(lib.cuStreamBeginCapture_v2(vp(s), u(2)), "cuStreamBeginCapture")      # relaxed
        for _ in range(n):
            check(one(), "cuLaunchKernel in capture")
        g, ex = vp(), vp()
        check(lib.cuStreamEndCapture(vp(s), ctypes.byref(g)), "cuStreamEndCapture")
        check(lib.cuGraphInstantiateWithFlags(ctypes.byref(ex), g, ctypes.c_ulonglong(0)), "instantiate")
        count = ctypes.c_size_t(0)
        check(lib.cuGraphGetNodes(g, None, ctypes.byref(count)), "cuGraphGetNodes")
        nodes = (vp * count.value)()
        check(lib.cuGraphGetNodes(g, nodes, ctypes.byref(count)), "cuGraphGetNodes")
        graphs[n] = (g, ex, list(nodes))
        timed(f"cuGraphLaunch, graph of {n}", lambda ex=ex: lib.cuGraphLaunch(ex, vp(s)), n)
    return graphs


def _repointed(p, graphs):
    """A replay re-pointing every node at the call's arrays (the second counter), then launching the
    graph, timed for each graph; returns ``repoint_and_launch(ex, nodes, kp)``."""
    from runtime.graphs import KernelNodeParams
    lib, s, f, params_b, out, timed = p.lib, p.s, p.f, p.params_b, p.out, p.timed
    vp = ctypes.c_void_p

    def repoint_and_launch(ex, nodes, kp):
        for node in nodes:
            lib.cuGraphExecKernelNodeSetParams_v2(ex, vp(node), ctypes.byref(kp))
        return lib.cuGraphLaunch(ex, vp(s))
    for n, (g, ex, nodes) in graphs.items():
        kp = KernelNodeParams(func=f, gridDimX=1, gridDimY=1, gridDimZ=1, blockDimX=32, blockDimY=1, blockDimZ=1,
                              sharedMemBytes=0, kernelParams=ctypes.addressof(params_b), extra=None, kern=None,
                              ctx=None)
        err = lib.cuGraphExecKernelNodeSetParams_v2(ex, vp(nodes[0]), ctypes.byref(kp))
        if err:
            out["checks"]["cuGraphExecKernelNodeSetParams"] = f"CUresult {err}"
            break
        timed(f"set params of {n} node(s) + cuGraphLaunch", lambda ex=ex, nodes=nodes, kp=kp:
              repoint_and_launch(ex, nodes, kp), n, which=1)
    return repoint_and_launch


def _wide_kernels(p, repoint_and_launch) -> None:
    """A kernel of 32 parameters packed once (the counter first, then null pointers, zeros) and the
    same 224 bytes as one struct parameter: each launched, as a one-node graph, and re-set."""
    import struct

    from runtime.graphs import KernelNodeParams
    cp, lib, s, counters, launch, nul, timed = p.cp, p.lib, p.s, p.counters, p.launch, p.nul, p.timed
    vp, u = ctypes.c_void_p, ctypes.c_uint
    wide = cp.RawKernel(KERNEL, "sf_probe_wide")
    wide.compile()
    fw = wide.kernel.ptr
    wbuf = ctypes.create_string_buffer(struct.calcsize("=" + WIDE))
    struct.pack_into("=" + WIDE, wbuf, 0, counters.data.ptr, *([0] * 23), *([0] * 8))
    offs, at = [], 0
    for c in WIDE:
        offs.append(at)
        at += struct.calcsize("=" + c)
    wparams = (vp * len(WIDE))(*[ctypes.addressof(wbuf) + o for o in offs])
    # the same 224 bytes as one parameter (a struct by value): what the driver copies per parameter
    sk = cp.RawKernel(KERNEL, "sf_probe_struct")
    sk.compile()
    sparams = (vp * 1)(ctypes.addressof(wbuf))

    def one_kernel_graph(fn, params, what):
        """cuLaunchKernel of ``fn`` timed, then a one-node graph of it: its launch, and its launch
        after re-setting the node's parameters; returns (exec, node, node parameters)."""
        largs = (vp(fn), u(1), u(1), u(1), u(32), u(1), u(1), u(0), vp(s), vp(ctypes.addressof(params)), nul)
        timed(f"cuLaunchKernel x1, {what}", lambda: launch(*largs), 1)
        check(lib.cuStreamBeginCapture_v2(vp(s), u(2)), "cuStreamBeginCapture")
        check(launch(*largs), "cuLaunchKernel in capture")
        g, ex = vp(), vp()
        check(lib.cuStreamEndCapture(vp(s), ctypes.byref(g)), "cuStreamEndCapture")
        check(lib.cuGraphInstantiateWithFlags(ctypes.byref(ex), g, ctypes.c_ulonglong(0)), "instantiate")
        node = (vp * 1)()
        check(lib.cuGraphGetNodes(g, node, ctypes.byref(ctypes.c_size_t(1))), "cuGraphGetNodes")
        timed(f"cuGraphLaunch, graph of 1, {what}", lambda: lib.cuGraphLaunch(ex, vp(s)), 1)
        kp = KernelNodeParams(func=fn, gridDimX=1, gridDimY=1, gridDimZ=1, blockDimX=32, blockDimY=1, blockDimZ=1,
                              sharedMemBytes=0, kernelParams=ctypes.addressof(params), extra=None, kern=None,
                              ctx=None)
        timed(f"set params of 1 node + cuGraphLaunch, {what}", lambda: repoint_and_launch(ex, [node[0]], kp), 1)
        return ex, node, kp
    wex, wnode, wkp = one_kernel_graph(fw, wparams, "32 parameters")
    one_kernel_graph(sk.kernel.ptr, sparams, "the 32 as one struct parameter")
    p.kept += [wide, sk, wbuf, wparams, sparams]
    # the first form once more, after the second: a difference between the two that is only the
    # order of the measurements shows here
    timed("set params of 1 node + cuGraphLaunch, 32 parameters (again)",
          lambda: repoint_and_launch(wex, [wnode[0]], wkp), 1)


def _executables_in_turn(p, graphs) -> None:
    """4 executable graphs of one kernel, launched in turn, nothing set."""
    lib, s, timed = p.lib, p.s, p.timed
    vp = ctypes.c_void_p
    g1 = graphs[1][0]
    execs = []
    for _ in range(4):
        ex = vp()
        check(lib.cuGraphInstantiateWithFlags(ctypes.byref(ex), g1, ctypes.c_ulonglong(0)), "instantiate")
        execs.append(ex)
    turn = [0]

    def in_turn():
        turn[0] = (turn[0] + 1) & 3
        return lib.cuGraphLaunch(execs[turn[0]], vp(s))
    timed("cuGraphLaunch of 4 executable graphs in turn (graph of 1)", in_turn, 1)


def _bindings(p, graphs) -> None:
    """cuLaunchKernel through CuPy's Cython binding; one graph launch and the capture query through
    each binding a replay could use."""
    cp, lib, f, s, stream, out, timed = p.cp, p.lib, p.f, p.s, p.stream, p.out, p.timed
    params_a, vp = p.params_a, ctypes.c_void_p
    try:                    # CuPy's Cython binding of cuLaunchKernel (ints; raises on an error)
        from cupy_backends.cuda.api import driver as cyd
        cy, pa_int = cyd.launchKernel, ctypes.addressof(params_a)
        timed("cuLaunchKernel x1 through CuPy's Cython binding", lambda: cy(f, 1, 1, 1, 32, 1, 1, 0, s, pa_int, 0), 1)
    except (ImportError, AttributeError) as e:
        out["us"]["cuLaunchKernel x1 through CuPy's Cython binding"] = {"error": str(e)}

    # one graph launch through each binding a replay could use (runtime/graphs.py uses CuPy's
    # runtime binding), on this non-blocking stream and on the legacy default stream (handle 0: a
    # torch caller's default current stream), and the capture query each replay makes
    from cupy_backends.cuda.api import runtime as cyr

    from runtime.arrays import cupy_stream
    ex1 = graphs[1][1].value
    legacy = cupy_stream(0, cp.cuda.runtime.getDevice())
    for name, st in (("non-blocking stream", stream), ("legacy default stream", legacy)):
        sp = st.ptr
        # (the graph of 1 was re-pointed at the second counter above: which=1)
        timed(f"cudaGraphLaunch (CuPy runtime binding), {name}", lambda sp=sp: cyr.graphLaunch(ex1, sp), 1, 1, st)
        timed(f"cuGraphLaunch (ctypes), {name}", lambda sp=sp: lib.cuGraphLaunch(vp(ex1), vp(sp)), 1, 1, st)
        timed(f"cudaStreamIsCapturing (CuPy runtime binding), {name}", lambda sp=sp: cyr.streamIsCapturing(sp),
              on=st)
        try:
            from cuda.bindings import driver as cbd
            cex, cst = cbd.CUgraphExec(ex1), cbd.CUstream(sp)
            timed(f"cuGraphLaunch (cuda.bindings, handles made once), {name}",
                  lambda cex=cex, cst=cst: cbd.cuGraphLaunch(cex, cst), 1, 1, st)
            timed(f"cuStreamIsCapturing (cuda.bindings), {name}", lambda cst=cst: cbd.cuStreamIsCapturing(cst), on=st)
        except (ImportError, AttributeError, TypeError) as e:
            out["us"][f"cuda.bindings, {name}"] = {"error": str(e)}


def _check_and_memset(p) -> None:
    """The check: every timed launch ran (the counters against the kernels issued); then
    cuMemsetD32Async of one word, timed (it overwrites the counters)."""
    lib, s, stream, counters, issued, out, timed = p.lib, p.s, p.stream, p.counters, p.issued, p.out, p.timed
    vp, u = ctypes.c_void_p, ctypes.c_uint
    memset = lib.cuMemsetD32Async
    dst = ctypes.c_uint64(counters.data.ptr)       # overwritten below: the counters are checked first
    stream.synchronize()
    got = [int(v) for v in counters.get()]
    ok = got == issued
    out["checks"]["every launch ran"] = {"ok": ok, "counted": got, "issued": issued}
    print(f"{'ok' if ok else 'FAILED'} every launch ran: counted {got}, issued {issued}", flush=True)
    timed("cuMemsetD32Async, one word", lambda: memset(dst, u(0), ctypes.c_size_t(1), vp(s)))


def _capture_fact(p, graphs) -> None:
    """Whether a caller can capture a call that launches a graph (a fact, recorded)."""
    lib, s, stream, counters, out = p.lib, p.s, p.stream, p.counters, p.out
    vp, u = ctypes.c_void_p, ctypes.c_uint
    try:
        counters[...] = 0
        stream.synchronize()
        g1, ex1, _ = graphs[2]
        outer, outer_ex = vp(), vp()
        check(lib.cuStreamBeginCapture_v2(vp(s), u(0)), "cuStreamBeginCapture (global)")
        err = lib.cuGraphLaunch(ex1, vp(s))
        err_end = lib.cuStreamEndCapture(vp(s), ctypes.byref(outer))
        if err or err_end:
            raise RuntimeError(f"cuGraphLaunch under capture: CUresult {err}, end capture {err_end}")
        check(lib.cuGraphInstantiateWithFlags(ctypes.byref(outer_ex), outer, ctypes.c_ulonglong(0)),
              "instantiate the outer graph")
        for _ in range(3):
            check(lib.cuGraphLaunch(outer_ex, vp(s)), "launch the outer graph")
        stream.synchronize()
        got = [int(v) for v in counters.get()]
        # the graph of 2 was re-pointed at the second counter above: 3 replays x 2 kernels, all on
        # the second counter (a captured graph launch runs the executable graph's current parameters)
        ran = got == [0, 6]
        out["facts"]["graph launch captured into a caller's graph"] = {"captured": True, "ran": ran, "counted": got}
        print(f"fact: the driver captures a graph launch into a caller's graph; its replays counted {got}"
              f" (want [0, 6]{'' if ran else ': they did not run as launched'})")
    except Exception as e:  # noqa: BLE001 - recorded
        out["facts"]["graph launch captured into a caller's graph"] = {"captured": False, "error": str(e)}
        print(f"fact: the driver does not capture a graph launch into a caller's graph ({e})")


if __name__ == "__main__":
    sys.exit(main())
