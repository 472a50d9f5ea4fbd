"""What a launch costs the host on this machine, and whether a CUDA graph is cheaper for calls that
launch several kernels (the one-call-path host target: 10 µs a call, 3 µs per further launch).

    PYTHONPATH=. python3 tools/probe_launch.py --out $OUT/probe_launch.json

Every timed call goes through ctypes on libcuda with its arguments made once (as
``runtime.device.bind_launch`` does), queued behind a 40 ms spin kernel so that the launch queue
neither drains nor fills; µs per call, median of ``--repeats`` batches of ``--calls``:

- ``cuLaunchKernel`` of a one-thread kernel, 1, 2 and 4 times a call (the per-launch driver cost);
- ``cuGraphLaunch`` of an instantiated graph of 1, 2 and 4 such kernels;
- ``cuGraphExecKernelNodeSetParams`` on every node, then ``cuGraphLaunch``: what a replay that
  re-points each kernel at the call's arrays would pay;
- ``cuMemsetD32Async`` of one word.

Checks, each printed ``ok`` / ``FAILED``: every timed launch ran (a device counter that each kernel
increments equals the number of kernels issued, also after the parameters were re-pointed at a
second counter), and a graph launch can itself be captured into a caller's CUDA graph (stream
capture around ``cuGraphLaunch``, then the outer graph replayed).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

KERNEL = r"""
extern "C" __global__ void sf_probe_count(unsigned long long* c) {
    if (threadIdx.x == 0 && blockIdx.x == 0) *c += 1ull;
}
"""
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

    import cupy as cp

    from codegen.harness.bench import SPIN_SRC
    from runtime.graphs import KernelNodeParams
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
    out = {"checks": {}, "us": {}}
    issued = [0, 0]

    def timed(label, call, kernels=0, which=0):
        per = []
        for _ in range(args.repeats):
            stream.synchronize()
            spin((1,), (1,), (cp.uint64(NS),), stream=stream)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            per.append((time.perf_counter() - t0) / args.calls * 1e6)
            issued[which] += kernels * args.calls
        stream.synchronize()
        out["us"][label] = {"us": statistics.median(per), "min_us": min(per)}
        print(f"{label:62s} {statistics.median(per):7.2f} µs", flush=True)

    def one():
        return launch(*cargs, pa, nul)
    for n in (1, 2, 4):
        if n == 1:
            timed("cuLaunchKernel x1", one, 1)
        else:
            timed(f"cuLaunchKernel x{n}", lambda n=n: [one() for _ in range(n)], n)

    # graphs of n kernels, made by capturing n launches on the stream
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

    # a replay re-pointing every node at the call's arrays, then launching the graph
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

    memset = lib.cuMemsetD32Async
    dst = ctypes.c_uint64(counters.data.ptr)       # overwritten below: the counters are checked first
    stream.synchronize()
    got = [int(v) for v in counters.get()]
    ok = got == issued
    out["checks"]["every launch ran"] = {"ok": ok, "counted": got, "issued": issued}
    print(f"{'ok' if ok else 'FAILED'} every launch ran: counted {got}, issued {issued}", flush=True)
    timed("cuMemsetD32Async, one word", lambda: memset(dst, u(0), ctypes.c_size_t(1), vp(s)))

    # can a caller capture a call that launches a graph?
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
        ok = got == [0, 6]
        out["checks"]["graph launch captured into a caller's graph"] = {"ok": ok, "counted": got}
        print(f"{'ok' if ok else 'FAILED'} graph launch captured into a caller's graph: counted {got} (want [0, 6])")
    except Exception as e:  # noqa: BLE001 - recorded
        out["checks"]["graph launch captured into a caller's graph"] = {"ok": False, "error": str(e)}
        print(f"FAILED graph launch captured into a caller's graph: {e}")
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    return 0 if all(isinstance(c, dict) and c.get("ok") for c in out["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
