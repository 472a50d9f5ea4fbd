"""Probe of the fused per-token / per-group dynamic quantization under each launch configuration.

On the GPU machine (torch, cupy, numpy; about a minute, kernel compiles included):

    PYTHONPATH=. python3 tools/probe_dynamic.py --out probe_dynamic.json

Cases: bf16 / f16 / f32 -> s8, token and group(128), symmetric and asymmetric; bf16 -> fp8_e4m3 and
bf16 -> s4, group(128), symmetric; on (65536, 4096) and (8192, 8192). Variants: launch
configurations of runtime.quantization.fused.FusedConfig (runtime.config's ``dynamic_config``, set with ``config.override``), all among
kernels compiled into the same SKUs. Per case the ``block`` variant (the previous kernel) is the
reference: its q / scale / zero point are checked against the NumPy reference (runtime.reference)
on the first and last 64 rows (the first rows hold NaN, +-inf, a zero row, a constant row and an
outlier), and every other variant must equal it bit for bit on the whole tensor. Times: CUDA
events, median of >= 50 launches after warm-up (codegen.harness.bench.timing.Timer), two input sets rotated so
that L2 is not what is measured; "% copy" is against a device-to-device copy of the same bytes
(x read once + q written once + scales and zero points) measured in the same run.

``--scale-layout col_aligned`` (or ``col``): the group cases write their scales (and zero points)
column-major, as ``dynamic_quantize(scale_layout=...)`` does; a run with and one without give the
layout's cost.

``--ptxas`` (on any machine, no GPU): ptxas's registers and spills of the kernels instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SHAPES = ((65536, 4096), (8192, 8192))
SMALL = (16, 4096)     # latency (bf16 symmetric s8 only; fits in L2, so "% copy" means little there)
GROUP = 128
# in order of importance (a run cut short by the time limit loses the last ones)
CASES = ([("bf16", "s8", "token", "symmetric"), ("bf16", "s8", "group", "symmetric"),
          ("bf16", "fp8_e4m3", "group", "symmetric"), ("bf16", "s4", "group", "symmetric")]
         + [(el, "s8", scope, "symmetric") for el in ("f16", "f32") for scope in ("token", "group")]
         + [(el, "s8", scope, "asymmetric") for el in ("bf16", "f16", "f32") for scope in ("token", "group")])
# Hypotheses (docs/dynamic.md "Probe"): (a) team kernels t16/t8/t4 (no block barrier, more bytes per
# thread), (b) index=div (row-group offsets by division), (c) grid=full (not persistent),
# (d) register caps through the kernel choice, block sizes through threads=.
VARIANTS = {
    "token": ("block", "block,grid=full", "auto", "t16,grid=full", "t16,threads=64", "t16,threads=256",
              "t16,index=div", "t16,ch=8", "t8", "t8,grid=full", "t4"),
    "group": ("block", "block,grid=full", "auto", "t8,ch=8", "t8,grid=full", "t8,threads=256", "t8,index=div",
              "t16", "t4", "t4,ch=4", "t4,grid=full", "t8,threads=512", "t16,grid=full", "t8,ch=8,grid=full", "t2"),
    "small": ("block", "auto", "t16", "t8", "t4", "t2", "t2,ch=1", "t2,threads=32"),
}
BAND = 64              # rows checked against NumPy at each end
TIME_LIMIT_S = 130.0   # no new case after this (a run has 150 s, compiles included)


def registries():
    """The registries of the s8 and the low-bit cases: both the shipped one."""
    from runtime.registry import default_registry
    reg = default_registry()
    return reg, reg


def plan_for(case, arch: int, regs):
    from runtime.plans import Descriptor, Plan, Preference
    el, qk, scope, mode = case
    reg = regs[0] if qk == "s8" else regs[1]
    return Plan.select(Descriptor("dynamic_quantize", scope, mode, el, qk), Preference(arch=arch), reg)


def _compile(job):
    from runtime.compiler import compile_cached
    source, unit, arch, options = job
    t0 = time.perf_counter()
    compile_cached(source, unit, arch, options)
    return unit, time.perf_counter() - t0


def precompile(plans, arch: int) -> dict:
    """NVRTC for every unit the plans need, in parallel (the disk cache serves the loads after)."""
    jobs = {}
    for p in plans:
        u = p.entry.unit
        jobs[(str(p.registry.root), u)] = (p.registry.unit_source(u), u, arch, tuple(p.registry.units[u]["nvrtc_options"]))
    with ProcessPoolExecutor(max_workers=len(jobs)) as pool:
        return dict(pool.map(_compile, jobs.values()))


def ptxas_report(arch: int) -> int:
    """Registers and spills of the fused kernels of every case's unit (CPU only)."""
    from runtime.compiler import resource_report
    regs = registries()
    units = {}
    for case in CASES:
        p = plan_for(case, arch, regs)
        units[(p.registry.root, p.entry.unit)] = (p.registry, p.entry.unit)
    bad = 0
    for reg, unit in units.values():
        rep = resource_report(reg.unit_source(unit), unit, arch, tuple(reg.units[unit]["nvrtc_options"]))
        for sym, r in sorted(rep.items()):
            if "_token_" in sym or "_group_" in sym:
                bad += r["spill_stores"] > 0
                print(f"sm_{arch} {sym:72s} {r['registers']:4d} regs  spill {r['spill_stores']}/{r['spill_loads']} B")
    return 1 if bad else 0


# -- one case on the GPU ---------------------------------------------------------------------------
def make_args(case, shape, x, torch, scale_layout="row"):
    """DynamicArgs for x with fresh outputs, as runtime.dynamic_quantize builds them (group scales and
    zero points in ``scale_layout``)."""
    from runtime.arrays import as_array
    from runtime.quantization.fused import DynamicArgs
    from runtime.quantization.lowbit import packed_shape
    from runtime import kinds
    from runtime.reference import dynamic_range
    from runtime.scopes import param_layout, param_shape, param_strides, rows_view
    el, qk, scope, mode = case
    gs = GROUP if scope == "group" else None
    pshape = param_shape(shape, scope, None, gs)
    dev = x.device
    qdtype = torch.int8 if qk == "s8" else torch.uint8
    q = torch.empty(packed_shape(shape, qk), dtype=qdtype, device=dev)
    strides = param_strides(pshape, scale_layout if scope == "group" else "row", 4)
    scale = torch.empty_strided(pshape, strides or dense_strides(pshape), dtype=torch.float32, device=dev)
    zp = (torch.empty_strided(pshape, strides or dense_strides(pshape), dtype=torch.int32, device=dev)
          if mode == "asymmetric" else None)
    if qk in kinds.FP8:
        qmin, qmax, zpv = -int(kinds.kind(qk).max), int(kinds.kind(qk).max), 0
    else:
        qmin, qmax, zpv = dynamic_range(qk, mode)
        zpv = zpv or 0
    xr, qr = as_array(x, "x"), dataclasses.replace(as_array(q, "q"), kind=qk)
    sr = as_array(scale, "scale")
    p_rs, p_gs = param_layout(sr, scope, "scale")
    args = DynamicArgs(xr, rows_view(xr, "x"), qr, rows_view(qr, "q"), sr,
                       None if zp is None else as_array(zp, "zero_point"), scope, mode, qmin, qmax, zpv, 1e-8,
                       group_size=gs, p_rs=p_rs, p_gs=p_gs)
    return args, (q, scale, zp)


def dense_strides(shape) -> tuple:
    from runtime.arrays import contiguous_strides
    return contiguous_strides(shape)


def random_x(el, shape, torch, specials: bool):
    from runtime.arrays import torch_dtype
    x = (torch.randn(shape, device="cuda", dtype=torch.float32) * 3)
    if specials:                 # rows 1..6: NaN, constant, outlier, zeros, +inf, -inf
        x[1, 5] = float("nan")
        x[2, :] = 0.7
        x[3, 17] = 1e4
        x[4, :] = 0.0
        x[5, 100] = float("inf")
        x[6, 7] = float("-inf")
    return x.to(torch_dtype(el))


def reference_mismatches(case, x, outs) -> int:
    """Elements of q / scale / zero point that differ from runtime.reference on the row bands."""
    import numpy as np

    from codegen.harness.checks.base import to_host
    from runtime import reference as ref
    el, qk, scope, mode = case
    gs = GROUP if scope == "group" else None
    rows = x.shape[0]
    bad = 0
    for lo, hi in sorted({(0, min(BAND, rows)), (max(0, rows - BAND), rows)}):
        xb = to_host(x[lo:hi])
        if qk == "s8":
            q, s, z = ref.dynamic_quantize_ref(xb, scope=scope, mode=mode, group_size=gs, out_dtype=qk)
        else:
            q, s, z = ref.dynamic_quantize_lowbit_ref(xb, scope=scope, mode=mode, group_size=gs, out_dtype=qk)
        got = [to_host(o[lo:hi]) for o in outs if o is not None]
        want = [q, s] + ([z] if z is not None else [])
        for g, w in zip(got, want):
            g, w = np.ascontiguousarray(g), np.ascontiguousarray(np.asarray(w).astype(g.dtype))
            bad += int((g.view(np.uint8) != w.view(np.uint8)).sum())
    return bad


def bits_equal(a, b, torch) -> bool:
    if a is None or b is None:
        return a is None and b is None
    as_int = {1: torch.uint8, 4: torch.int32}[a.element_size()]
    return bool(torch.equal(a.view(as_int), b.view(as_int)))


def poison(outs, torch):
    for o in outs:
        if o is not None:
            o.reshape(-1).view(torch.uint8).fill_(0xA5)


def describe(plan, args, launcher, pack: int) -> dict:
    """The resolved launch: kernel symbol, geometry, registers and resident blocks per SM."""
    from cuda.bindings import driver

    from runtime.device import load_function, properties, resident_blocks
    from runtime.quantization.fused import fused_config, fused_grid, team_launch
    cfg = fused_config()
    vec_ok, tx, ty, grid = launcher.config(plan, args)
    team = team_launch(plan, args, cfg, vec_ok, pack)
    work = args.xv.rows * (args.xv.cols // (args.group_size or args.xv.cols))
    if team is not None:
        sym = f"{plan.entry.symbol_for('team')}_t{team.chunks}"
        fn = load_function(plan.registry, plan.entry.unit, sym, args.x.device)
        threads = team.threads
        out = {"kernel": f"t{team.chunks}", "tx": team.tx, "ch": team.ch, "rg": team.rg, "threads": threads,
               "dense": team.dense,
               "grid": fused_grid(fn, work, team.per_block, threads, args.x.device, cfg.persistent)}
    else:
        fn = plan.registry.kernel(plan.sku, args.x.device)
        threads = tx * ty
        out = {"kernel": "block", "tx": tx, "ty": ty, "threads": threads,
               "grid": fused_grid(fn, work, ty, threads, args.x.device, cfg.persistent)}
    h = driver.CUfunction(fn.ptr)
    attr = driver.CUfunction_attribute
    out["registers"] = int(driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, h)[1])
    out["local_bytes"] = int(driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, h)[1])
    out["blocks_per_sm"] = resident_blocks(fn, threads)
    out["warps_per_sm"] = out["blocks_per_sm"] * threads // 32
    out["persistent"] = cfg.persistent
    out["sms"] = properties(args.x.device)["sms"]
    return out


def expected_bytes(case, shape) -> int:
    el, qk, scope, mode = case
    from runtime import kinds
    n = math.prod(shape)
    isz = kinds.SIZE[el]
    groups = n // (GROUP if scope == "group" else shape[-1])
    return n * isz + n // kinds.kind(qk).pack + groups * (8 if mode == "asymmetric" else 4)


def run_case(case, shape, plan, timer, variants, torch, scale_layout="row"):
    """Every variant on one case: the first (``block`` by default) checked against NumPy on the row
    bands, every one against the first bit for bit on the whole tensor, then timed."""
    from codegen.harness.bench.timing import gbps, same_size_copy
    from runtime import config, kinds
    el, qk, scope, mode = case
    pack = kinds.kind(qk).pack
    xs = [random_x(el, shape, torch, specials=(i == 0)) for i in range(2)]
    sets = [make_args(case, shape, x, torch, scale_layout) for x in xs]
    nbytes = expected_bytes(case, shape)
    copy = same_size_copy(timer, nbytes)
    ref_outs, ref_bad = None, None
    for v in variants:
        r = {"case": "/".join(case), "shape": list(shape), "variant": v, "scale_layout": scale_layout, "bytes": nbytes,
             "copy_gbps": copy["gbps"]}
        with config.override(dynamic_config=v):
            try:
                r["launch"] = describe(plan, sets[0][0], plan.launcher, pack)
                poison(sets[0][1], torch)
                plan.run(sets[0][0])
                torch.cuda.synchronize()
                if ref_outs is None:
                    ref_outs = [None if o is None else o.clone() for o in sets[0][1]]
                    ref_bad = reference_mismatches(case, xs[0], ref_outs)
                r["numpy_mismatches"] = ref_bad
                r["exact"] = ref_bad == 0 and all(bits_equal(o, w, torch) for o, w in zip(sets[0][1], ref_outs))
                m = timer.measure([lambda s=s: plan.run(s[0]) for s in sets])
                r.update(m)
                r["gbps"] = gbps(nbytes, m["ms"])
                r["pct_copy"] = 100.0 * r["gbps"] / copy["gbps"]
            except Exception as e:  # noqa: BLE001 - one variant's failure is recorded, not fatal
                r["error"] = f"{type(e).__name__}: {e}"[:400]
        yield r
    del xs, sets, ref_outs
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="probe_dynamic.json")
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--variants", help="semicolon-separated FusedConfig texts, the first the reference "
                                       "(default: VARIANTS per scope)")
    ap.add_argument("--cases", type=int, default=len(CASES), help="only the first N cases (CASES order)")
    ap.add_argument("--ptxas", action="store_true", help="print registers / spills (CPU, NVRTC) and exit")
    ap.add_argument("--arch", type=int, default=90, help="--ptxas: target arch")
    ap.add_argument("--scale-layout", default="row", choices=("row", "col", "col_aligned"),
                    help="the group cases' scales (and zero points) in this layout (docs/dynamic.md)")
    a = ap.parse_args()
    if a.ptxas:
        return ptxas_report(a.arch)
    t_start = time.perf_counter()

    from codegen.harness.bench.timing import Timer, copy_bandwidth
    from codegen.harness.verify import environment
    dev = 0
    env = environment(dev)
    arch = int(env["gpu"]["cc"].replace(".", ""))
    regs = registries()
    cases = CASES[:a.cases]
    plans = {case: plan_for(case, arch, regs) for case in cases}
    t0 = time.perf_counter()
    compile_s = precompile(plans.values(), arch)     # worker processes: before torch starts its threads
    each = ", ".join("%s %.0f s" % (u.split("/")[-1], s) for u, s in compile_s.items())
    print(f"compiled {len(compile_s)} units in {time.perf_counter() - t0:.1f} s ({each})", flush=True)
    import torch
    torch.cuda.set_device(dev)
    env["torch"] = torch.__version__
    from runtime.arrays import cupy_stream
    stream = cupy_stream(torch.cuda.current_stream().cuda_stream, dev)
    results = []
    rec = {"env": env, "compile_s": compile_s, "samples": a.samples, "results": results}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with stream:
        timer = Timer(stream, a.samples, 5.0)
        rec["copy_peak"] = copy_bandwidth(timer)
        print(f"{env['gpu']['name']}: device copy {rec['copy_peak']['gbps']:.0f} GB/s", flush=True)
        truncated = False
        for case, shape in ((c, sh) for c in cases for sh in SHAPES + ((SMALL,) if c in CASES[:2] else ())):
            if time.perf_counter() - t_start > TIME_LIMIT_S:
                truncated = True
                break
            variants = a.variants.split(";") if a.variants else VARIANTS["small" if shape == SMALL else case[2]]
            for r in run_case(case, shape, plans[case], timer, variants, torch, a.scale_layout):
                results.append(r)
                print(_row(r), flush=True)
            rec["seconds"] = round(time.perf_counter() - t_start, 1)
            out.write_text(json.dumps(rec, indent=1))
    rec["truncated"] = truncated
    rec["seconds"] = round(time.perf_counter() - t_start, 1)
    out.write_text(json.dumps(rec, indent=1))
    print(f"\n{len(results)} results in {rec['seconds']} s{' (TRUNCATED: time limit)' if truncated else ''}; "
          f"{out}")
    _summary(results)
    return 0


def _row(r) -> str:
    l = r.get("launch") or {}
    geo = (f"{l.get('kernel')} tx{l.get('tx')} ch{l.get('ch', '-')} th{l.get('threads')} r{l.get('registers')} "
           f"w{l.get('warps_per_sm')}") if l else ""
    head = f"{r['case']:<30} {'x'.join(map(str, r['shape'])):>10} {r['variant']:<18} {geo:<34}"
    if "error" in r:
        return head + f" ERROR {r['error']}"
    return head + (f" {r['ms'] * 1e3:7.1f} us {r['gbps']:6.0f} GB/s {r['pct_copy']:5.1f}% "
                   f"exact={'yes' if r['exact'] else 'NO'}")


def _summary(results) -> None:
    """Best variant per case and shape (exact ones only), then each variant's mean % of copy."""
    best: dict = {}
    by_variant: dict = {}
    for r in results:
        if "pct_copy" not in r or not r.get("exact"):
            continue
        key = (r["case"], "x".join(map(str, r["shape"])))
        if key not in best or r["pct_copy"] > best[key]["pct_copy"]:
            best[key] = r
        by_variant.setdefault(r["variant"], []).append(r["pct_copy"])
    print("\nbest per case:")
    for (case, shape), r in sorted(best.items()):
        block = next((x for x in results if x["case"] == case and "x".join(map(str, x["shape"])) == shape
                      and x["variant"] == "block" and "pct_copy" in x), None)
        print(f"  {case:<30} {shape:>10} {r['variant']:<18} {r['pct_copy']:5.1f}%"
              + (f"  (block {block['pct_copy']:5.1f}%)" if block else ""))
    print("mean % of copy per variant:")
    for v, xs in sorted(by_variant.items(), key=lambda kv: -sum(kv[1]) / len(kv[1])):
        print(f"  {v:<18} {sum(xs) / len(xs):5.1f}%  ({len(xs)} results)")


if __name__ == "__main__":
    sys.exit(main())
