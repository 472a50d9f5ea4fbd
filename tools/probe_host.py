"""Host overhead of repeated functional-API calls (target: 10 µs per call that launches one kernel), on a GPU machine.

    PYTHONPATH=. python3 tools/probe_host.py --out probe_host.json

Per call, in µs, the calling thread's own time: batches of the same call on the same (16, 4096)
arrays queued behind a spin kernel, the median batch (codegen/harness/bench/host.py's host-overhead
timing, whose ``api_host_calls`` lists the calls): quantize, dequantize, fake_quantize (channel),
dynamic_quantize (token), with CuPy arrays and torch tensors, default settings; and the floor,
a bare CuPy RawKernel launch.

``components`` splits a quantize call into its parts, to tell what is left to cut: the
prepared launch alone (runtime.device.launch) and the replay's graph launch, the output allocation,
the stream query, the cache key (attribute reads), the status-word read, the call with ``out=``, and
the output addresses of four calls in a row (one address: the replay's graph is launched as it is),
each on the host clock behind a spin kernel. Runs in well under a minute (kernels are compiled in parallel first; the NVRTC disk cache makes reruns faster).

``--graph-ab``: the calls that launch several kernels (MoE, LSQ; ``launches`` > 1), timed with
``graph_replay`` off and on in turns (off, on, off, on: runtime/graphs.py against one launch per
kernel), in ``graph_ab`` of the record.

``--graph-parts``: per multi-launch call, the call against its replay's graph launch alone and
the bare ``cudaGraphLaunch`` of its executable graph.

``--profile dynamic_quantize,quantize+torch``: cProfile of the matching calls (a label matches a
pattern holding each of its ``+``-joined parts; the patterns are comma-separated),
top functions by own and cumulative time, in ``<out>.profile.txt``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path


_SPIN = None


def _host_only(call, synchronize, n_calls: int = 400, repeats: int = 5) -> dict:
    """µs per call on the host clock alone: the calls are queued behind a 40 ms spin kernel, so the
    launch queue neither drains nor fills (what the host pays, apart from the GPU's launch rate)."""
    import statistics

    import cupy as cp
    import numpy as np
    global _SPIN
    if _SPIN is None:
        from codegen.harness.bench.timing import SPIN_SRC
        _SPIN = cp.RawKernel(SPIN_SRC, "sf_bench_spin")
    per = []
    for _ in range(repeats):
        synchronize()
        _SPIN((1,), (1,), (np.uint64(40_000_000),), stream=cp.cuda.get_current_stream())
        t0 = time.perf_counter()
        for _ in range(n_calls):
            call()
        per.append((time.perf_counter() - t0) / n_calls * 1e6)
    synchronize()
    return {"us": statistics.median(per), "min_us": min(per)}


def python_reference_us(n: int = 200_000) -> float:
    """A fixed pure-Python workload (µs per iteration of a small loop with a dict lookup and a
    tuple build): compares this host's Python speed with another machine's."""
    d = {i: i for i in range(64)}
    t0 = time.perf_counter()
    for i in range(n):
        (d.get(i & 63), i, i + 1)
    return (time.perf_counter() - t0) / n * 1e6

def components(synchronize, device: int) -> dict:
    """The parts of a quantize token bf16->s8 call on (16, 4096), per framework."""
    import runtime as sf
    from runtime import replay
    out = {}
    static = ("token", None, None, "int8", None, None, None)
    for fw, make in _frameworks(device).items():
        x, s = make()
        args = (x, s, None, None)
        replay.CACHE.clear()      # the remembered launch then points at x and q0, both alive below
        q0 = sf.quantize(x, s, scope="token", out_dtype="int8")
        key, vals = replay.call_key("quantize", static, args)
        entry = replay.CACHE.get(key)
        if entry is None or not entry.launches:
            out[fw] = {"error": "the call was not remembered (no replay)"}
            continue
        stream = entry.stream()
        res = _replay_parts(entry, stream, args, static, key, vals, synchronize)
        res.update(_graph_launch_parts(entry, stream, synchronize))
        res.update(_launch_parts(entry, stream, synchronize))
        res.update(_allocation_parts(fw, x, synchronize))
        out[fw] = res
        del q0
    return out


def _frameworks(device: int) -> dict:
    """{framework: make()}: a (16, 4096) bf16 input and its per-row scale, with CuPy and (where it
    sees a GPU) torch."""
    import cupy as cp
    import ml_dtypes
    fws = {"cupy": lambda: ((cp.random.standard_normal((16, 4096), dtype=cp.float32)).astype(ml_dtypes.bfloat16),
                            cp.random.random(16, dtype=cp.float32) + 0.5)}
    try:
        import torch
        if torch.cuda.is_available():
            fws["torch"] = lambda: (torch.randn(16, 4096, device=f"cuda:{device}", dtype=torch.bfloat16),
                                    torch.rand(16, device=f"cuda:{device}") + 0.5)
    except ImportError:
        pass
    return fws


def _replay_parts(entry, stream, args, static, key, vals, synchronize) -> dict:
    """The call on ``args`` and what its replay (``entry``) is made of: the prepared launch, the
    allocation, the stream query, the key, the lookup, the status word; the call with ``out=`` and
    the output addresses of four calls in a row (one address: the replay's graph is launched as it is)."""
    import runtime as sf
    from runtime import arrays, replay, status
    x, s = args[:2]
    prep, template, _ = entry.launches[0]
    alloc = entry.allocs[0][0]
    xr = arrays.as_array(x, "x")
    res = {
        "call": _host_only(lambda: sf.quantize(x, s, scope="token", out_dtype="int8"), synchronize),
        "runtime.device.launch of the prepared kernel": _host_only(lambda: prep.launch(stream, template),
                                                                   synchronize),
        "output allocation (replay's allocator)": _host_only(alloc, synchronize),
        "output allocation (runtime.arrays.empty)": _host_only(lambda: arrays.empty(xr, (16, 4096), "s8"),
                                                               synchronize),
        "stream query": _host_only(entry.stream, synchronize),
        "cache key (_key: attribute reads of 4 arguments)": _host_only(
            lambda: replay.call_key("quantize", static, args), synchronize),
        "cache lookup (hash and compare of the key)": _host_only(lambda: replay.CACHE.get(key), synchronize),
        "replay alone (entry.go on the call's key values)": _host_only(lambda: entry.go(args, list(vals), static),
                                                                       synchronize),
        "status word read (runtime.status.raise_pending)": _host_only(
            lambda: status.raise_pending(xr.device), synchronize),
    }
    # the allocating call against its out= form, and whether the output lands at one address
    # (else each replay re-sets the graph node's parameters)
    qo = sf.quantize(x, s, scope="token", out_dtype="int8")
    res["call with out="] = _host_only(lambda: sf.quantize(x, s, scope="token", out_dtype="int8", out=qo),
                                       synchronize)
    ptrs = [arrays.as_array(sf.quantize(x, s, scope="token", out_dtype="int8"), "q").ptr for _ in range(4)]
    res["output addresses of 4 calls in a row"] = [hex(p) for p in ptrs]
    return res


def _graph_launch_parts(entry, stream, synchronize) -> dict:
    """The replay's graph launch with the remembered values, the two runtime calls of every graph
    replay (CuPy's bindings, as runtime/graphs.py) and the graph's lock; none without a graph."""
    from runtime import device as rdev
    template = entry.launches[0][1]
    graph = entry.go.__globals__.get("graph") if entry.go is not None else None
    if graph is None:
        return {}
    res = {"graph launch of the replay (remembered values)": _host_only(
        lambda: graph(stream, tuple(template)), synchronize)}
    fns = rdev.driver().graph_calls()
    exv = graph.graph.execs[stream].handle
    res["cudaStreamIsCapturing (cupy_backends runtime)"] = _host_only(
        lambda: fns["streamIsCapturing"](stream), synchronize)
    res["bare cudaGraphLaunch (cupy_backends runtime)"] = _host_only(
        lambda: fns["graphLaunch"](exv, stream), synchronize)
    lock = graph.graph.lock
    res["threading.Lock acquire + release"] = _host_only(lambda: (lock.acquire(), lock.release()),
                                                         synchronize)
    return res


def _launch_parts(entry, stream, synchronize) -> dict:
    """The bare driver launch of the prepared kernel (parameters packed once), the packing, and the
    context query."""
    from runtime import device as rdev
    prep, template, _ = entry.launches[0]
    drv = rdev.driver()
    fn_ptr, fmt = prep.fn.ptr, prep.abi.fmt
    pb = drv._params(fmt, template)
    gx, gy, gz = (tuple(prep.grid) + (1, 1))[:3]
    bx, by, bz = (tuple(prep.block) + (1, 1))[:3]
    cu = drv.launch_kernel
    return {"bare cuLaunchKernel (ctypes, parameters packed once)": _host_only(
                lambda: cu(fn_ptr, gx, gy, gz, bx, by, bz, 0, stream, pb.ptrs_addr), synchronize),
            "parameter packing (struct.pack_into)": _host_only(lambda: drv._params(fmt, template), synchronize),
            "cuCtxGetCurrent (ctypes)": _host_only(drv.context_current, synchronize)}


def _allocation_parts(fw: str, x, synchronize) -> dict:
    """The framework's own allocations of the output and the key of one array, against the replay's."""
    res = {}
    if fw == "torch":
        import torch
        dt, dev = torch.int8, x.device
        res["torch.empty(shape, dtype=, device=)"] = _host_only(
            lambda: torch.empty((16, 4096), dtype=dt, device=dev), synchronize)
        res["x.new_empty(shape, dtype=)"] = _host_only(lambda: x.new_empty((16, 4096), dtype=dt), synchronize)
        idx = x.get_device()
        res["torch.empty(shape, dtype=, device=<int>)"] = _host_only(
            lambda: torch.empty((16, 4096), dtype=dt, device=idx), synchronize)
        res["torch.empty_strided(shape, strides, dtype=, device=)"] = _host_only(
            lambda: torch.empty_strided((16, 4096), (4096, 1), dtype=dt, device=dev), synchronize)
        res["key of one tensor (data_ptr, shape, stride, dtype, get_device)"] = _host_only(
            lambda: (type(x), x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15), synchronize)
    else:
        import cupy as cp
        res["cupy.empty(shape, dtype)"] = _host_only(lambda: cp.empty((16, 4096), cp.int8), synchronize)
        nd, i8 = cp.ndarray, cp.dtype(cp.int8)
        res["cupy.ndarray(shape, dtype)"] = _host_only(lambda: nd((16, 4096), i8), synchronize)
        res["cupy.cuda.runtime.getDevice"] = _host_only(cp.cuda.runtime.getDevice, synchronize)
        res["key of one array (data.ptr, shape, strides, dtype, device_id)"] = _host_only(
            lambda: (type(x), x.shape, x.strides, x.dtype, x.data.device_id, x.data.ptr & 15), synchronize)
    return res


def _graph_items(items) -> list:
    """The calls the graph probes take: every multi-launch one, then the first allocating quantize."""
    picked = [i for i in items if i.get("launches", 1) > 1]
    return picked + [i for i in items if i["label"].startswith("quantize token") and "out=" not in i["label"]][:1]


def graph_turns(items, synchronize, n_calls: int, repeats: int, busy) -> dict:
    """{label: {"off": [µs, µs], "on": [µs, µs]}}: the multi-launch calls and the first quantize call,
    timed on the host clock behind a spin kernel with ``graph_replay`` off, on, off, on (both turns
    of each setting)."""
    from codegen.harness.bench import host as bench_host
    from runtime import config
    multi = _graph_items(items)
    turns = {}
    for setting in ("off", "on", "off", "on"):
        with config.override(graph_replay=setting):        # forgets the remembered calls
            for r in bench_host.time_host_calls(multi, synchronize, n_calls, repeats, busy=busy):
                turns.setdefault(r["label"], {}).setdefault(setting, []).append(r.get("us"))
    for label, by in turns.items():
        print(f"  graph replay off {by['off']} / on {by['on']} µs: {label}", flush=True)
    return turns


def graph_parts(items, synchronize) -> dict:
    """Per multi-launch call (and the first single-launch one): the whole call, its replay's graph
    launch alone (runtime/graphs.py's ``go`` with the remembered values: no parameter set), and the
    bare ``cudaGraphLaunch`` of its executable graph; µs, host clock, GPU kept busy."""

    from runtime import device, replay
    fns = device.driver().graph_calls()
    out = {}
    for item in _graph_items(items):
        replay.CACHE.clear()
        item["call"]()
        item["call"]()
        entry = next(iter(replay.CACHE.values()), None)
        go = None if entry is None or entry.go is None else entry.go.__globals__.get("graph")
        if go is None:
            out[item["label"]] = {"error": "no graph replay for this call"}
            continue
        stream = entry.stream()
        values = [tuple(t) for _, t, _ in entry.launches]
        ex = go.graph.execs[stream].handle
        n = 100                          # calls per batch: at most 500 kernels queued behind the spin
        res = {"nodes": len(values), "call": _host_only(item["call"], synchronize, n),
               "graph go (remembered values)": _host_only(lambda: go(stream, *values), synchronize, n),
               "cudaGraphLaunch alone": _host_only(lambda: fns["graphLaunch"](ex, stream), synchronize, n)}
        out[item["label"]] = res
        print(f"  graph parts: {item['label']}: " + ", ".join(f"{k} {v if k == 'nodes' else v.get('us')}"
                                                             for k, v in res.items()), flush=True)
    return out


def profile(items, synchronize, n_calls: int, labels) -> dict:
    """cProfile of ``n_calls`` calls of each item whose label contains one of ``labels``: the top
    functions by own time and by cumulative time, as text (where a repeated call spends its µs)."""
    import cProfile
    import io
    import pstats
    out = {}
    for item in items:
        if not any(all(w in item["label"] for w in pattern.split("+")) for pattern in labels):
            continue
        call = item["call"]
        for _ in range(200):
            call()
        synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n_calls):
            call()
        prof.disable()
        synchronize()
        text = io.StringIO()
        st = pstats.Stats(prof, stream=text)
        st.sort_stats("tottime").print_stats(25)
        st.sort_stats("cumulative").print_stats(25)
        out[item["label"]] = text.getvalue()
    return out

def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    t_start = time.perf_counter()
    import cupy as cp
    try:
        import torch
        torch.cuda.set_device(args.device)
        torch.cuda.init()
    except ImportError:
        torch = None

    from codegen.harness.bench import host as bench_host
    from codegen.harness.records import git_info, now
    from codegen.harness.verify import environment

    cp.cuda.Device(args.device).use()
    env = environment(args.device)
    compile_s = _compile_used(env, args.device)
    host, graph_ab, parts, comps, profiles = _measure(args, torch)
    rec = {"schema": 1, "what": "host overhead per repeated functional call", "date": now(), **git_info(),
           **env, "python": platform.python_version(), "calls": args.calls, "repeats": args.repeats,
           "target_us": bench_host.TARGET_HOST_US, "compile_s": round(compile_s, 1),
           "seconds": round(time.perf_counter() - t_start, 1), "host_overhead": host, "graph_ab": graph_ab, "graph_parts": parts, "components": comps,
           "python_reference_us": python_reference_us()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=1, default=str) + "\n")
    _print_report(args, env, rec, comps, profiles)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="probe_host.json", help="JSON record to write")
    ap.add_argument("--calls", type=int, default=2000, help="calls per timed repeat (default 2000)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported (default 5)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--no-components", action="store_true", help="skip the per-part breakdown")
    ap.add_argument("--graph-ab", action="store_true", help="multi-launch calls with graph replay off and on, in turns")
    ap.add_argument("--graph-parts", action="store_true",
                    help="multi-launch calls: the call, its graph launch alone, the bare cudaGraphLaunch")
    ap.add_argument("--profile", default="", help="comma-separated patterns of label parts joined by +: cProfile those calls "
                    "(written next to --out as <out>.profile.txt)")
    return ap


def _compile_used(env: dict, device: int) -> float:
    """Seconds to compile the units of the calls api_host_calls runs (only those), in parallel."""
    from codegen.harness.verify import _precompile
    from codegen.manifest import GENERATED
    from runtime.registry import Registry
    reg = Registry.load(GENERATED)
    used = {("quantize", "bf16", "s8"), ("dequantize", "s8", "bf16"), ("fake_quantize", "bf16", "bf16"),
            ("dynamic_quantize", "bf16", "s8")}           # what api_host_calls runs: compile only those units
    want = [s for s in reg.skus() if (s.op, s.element, s.aux_element) in used]
    t0 = time.perf_counter()
    _precompile(reg, want, int(env["gpu"]["cc"].replace(".", "")), os.cpu_count() or 1)
    return time.perf_counter() - t0


def _measure(args, torch) -> tuple:
    """(host overhead rows, graph replay off / on, graph parts, components, profiles), every call on
    one stream (torch's current one where torch is there: a synchronize covers every launch)."""
    import cupy as cp

    from codegen.harness.bench import host as bench_host
    from codegen.harness.bench.timing import Timer
    if torch is not None:     # one stream for both frameworks: a synchronize covers every launch
        from runtime.arrays import cupy_stream
        stream = cupy_stream(torch.cuda.current_stream().cuda_stream, args.device)
    else:
        stream = cp.cuda.get_current_stream()
    with stream:
        timer = Timer(stream, 1, 0.1)
        from codegen.harness.workloads import training
        items, errors = bench_host.host_items(timer, [training], api=True, device=args.device)
        # host clock, each batch queued behind a spin kernel (as the bench's host table)
        host = errors + bench_host.time_host_calls(items, stream.synchronize, args.calls, args.repeats, busy=timer.spin_ns)
        graph_ab = graph_turns(items, stream.synchronize, args.calls, args.repeats, timer.spin_ns) \
            if args.graph_ab else {}
        parts = graph_parts(items, stream.synchronize) if args.graph_parts else {}
        comps = {} if args.no_components else components(stream.synchronize, args.device)
        profiles = profile(items, stream.synchronize, args.calls, [w for w in args.profile.split(",") if w]) \
            if args.profile else {}
    return host, graph_ab, parts, comps, profiles


def _print_report(args, env: dict, rec: dict, comps: dict, profiles: dict) -> None:
    host = rec["host_overhead"]
    width = max(len(h["label"]) for h in host)
    print(f"{env['gpu']['name']}: µs per call (median of {args.repeats} x {args.calls})")
    for h in host:
        mark = "" if h.get("target_us") is None or h.get("us") is None else (
            "  ok" if h["us"] <= h["target_us"] else "  MISS")
        print(f"  {h['label']:<{width}}  " + (f"{h['us']:7.1f}{mark}" if h.get("us") is not None else h.get("error")))
    for fw, parts in comps.items():
        print(f"components of a quantize call, {fw}:")
        for k, v in (parts.items() if "error" not in parts else [("error", {"error": parts["error"]})]):
            text = str(v) if not isinstance(v, dict) else (f"{v['us']:7.2f}" if v.get("us") is not None
                                                           else str(v.get("error")))
            print(f"  {k:<52} {text}")
    if profiles:
        path = Path(str(args.out) + ".profile.txt")
        path.write_text("".join(f"==== {k}\n{v}\n" for k, v in profiles.items()))
        print(f"wrote {path}")
    print(f"pure-Python reference loop: {rec['python_reference_us']:.3f} µs per iteration")
    print(f"wrote {args.out} in {rec['seconds']} s (compile {rec['compile_s']} s)")


if __name__ == "__main__":
    sys.exit(main())
