"""One-call GPU probe of the moe grouped-matmul tile configurations (docs/moe.md).

    PYTHONPATH=. python3 tools/probe_moe.py --out probe_moe.json [--quick] [--variants a,b]

For each mma tile configuration compiled into the bf16 SKUs (runtime.moe variants), it
1. compiles the three bf16 units (forward, backward-input, backward-weight with dw float32) for
   the device's arch in parallel processes (an empty NVRTC cache: compile time counts) and reads
   ptxas's registers / spills of every kernel (runtime.compiler.resource_report);
2. runs the edge cases of codegen/harness/checks/moe.py (padding rows, row_experts with uint32 ids,
   K tails, empty experts, strided rows, E = 1024, partial tiles) on every configuration into
   NaN-poisoned outputs, against the float64 NumPy reference (docs/numerics.md: rel. Frobenius <= 1e-2),
   with exact zeros where required and, for the backward, identical bits on a second run;
3. on the benchmark shapes (E8 M16384 N4096 K4096, E64 M32768 N2048 K7168, E128 M16384 N1536
   K2048; balanced and skewed offsets routing; codegen/harness/workloads/moe.py's data), checks each pass
   against a float32 per-expert torch.mm loop (poisoned outputs, rel. Frobenius <= 1e-2; the
   backward twice, bit-identical), times the public call (routing + output allocation included,
   as codegen/harness/workloads/moe.py) by CUDA events (warm-up, median of --reps) and torch._grouped_mm on
   the same pass in the same process (before and after our configurations);
4. prints one line per measurement, then a compact table (% of torch per shape, min over shapes,
   all checks ok) per pass and configuration, and writes everything to --out as JSON.
Runs within --budget seconds (default 230): stages left when the budget is spent are skipped
and reported as such.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from moe_runs import PASSES, bench_shapes, edge_cases, elapsed, log  # noqa: E402


def sku_of(op: str, dw_bf16: bool = False) -> str:
    if op == "grouped_matmul_backward_weight":
        return f"moe/{op}/-/-/bf16/{'-' if dw_bf16 else 'f32'}/sm80/mma/bf16.acc-f32.det"
    return f"moe/{op}/-/-/bf16/-/sm80/mma/bf16.acc-f32.det"


# -- 1. compile ------------------------------------------------------------------------------------
def _compile_job(job):
    """("compile", ...): NVRTC into the disk cache; ("report", ...): ptxas -v (uncached compile)."""
    from runtime.compiler import compile_cached, resource_report
    kind, unit, source, arch, options = job
    t = time.time()
    if kind == "compile":
        return kind, unit, compile_cached(source, unit, arch, options).cached, time.time() - t
    try:
        report = resource_report(source, unit, arch, options)
    except Exception as exc:   # the report is informative only
        report = {"error": repr(exc)}
    return kind, unit, report, time.time() - t


def compile_units(reg, units, arch):
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context
    jobs = [(kind, u, reg.unit_source(u), arch, tuple(reg.units[u]["nvrtc_options"]))
            for kind in ("compile", "report") for u in units]
    out = {u: {} for u in units}
    with ProcessPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1)),
                             mp_context=get_context("spawn")) as pool:
        for kind, unit, res, dt in pool.map(_compile_job, jobs):
            if kind == "compile":
                out[unit].update(cached=res, compile_s=round(dt, 2))
                log(f"compiled {unit} for sm_{arch} in {dt:.1f} s ({'cached' if res else 'fresh'})")
            else:
                out[unit].update(report_s=round(dt, 2), kernels={k: v for k, v in res.items() if "route" not in k})
    return out


# -- 2. edge cases (tools/moe_runs.py), in a child process -------------------------------------------
def edge_cases_isolated(variants, passes, budget):
    """edge_cases in a child process (this script with --edge-only): a configuration that kills
    the CUDA context there is recorded as faulted, the child restarts without it, and the parent
    (whose context is intact) leaves it out of the benchmark. Returns (results, faulted pairs)."""
    import subprocess
    import tempfile
    results, faulted = [], set()
    for _ in range(4):
        if elapsed() > budget:
            break
        with tempfile.NamedTemporaryFile("w+", suffix=".jsonl", delete=False) as f:
            path = f.name
        skip = sorted(faulted)
        cmd = [sys.executable, os.path.abspath(__file__), "--edge-only", path, "--budget", str(budget - elapsed()),
               "--passes", ",".join(passes), "--variants", ",".join(sorted({n for v in variants.values() for n in v})),
               "--skip", ";".join(f"{k}={n}" for k, n in skip)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        last = None
        with open(path) as f:
            for line in f:
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                if "start" in d:
                    last = tuple(d["start"][:2])
                else:
                    results.append(d)
                    last = None
        os.unlink(path)
        if proc.returncode == 0:
            break
        culprit = last or next(((r["pass"], r["variant"]) for r in reversed(results) if r.get("fault")
                                and (r["pass"], r["variant"]) not in faulted), None)
        log(f"edge-case child exited {proc.returncode}; culprit {culprit}; output tail: {proc.stdout[-1500:]}")
        if culprit is None:
            break
        faulted.add(culprit)
        results.append({"pass": culprit[0], "variant": culprit[1], "case": "(child process died)", "ok": False,
                        "fault": True, "error": f"exit {proc.returncode}"})
        # the next child runs every case again without the faulted configurations (cheap: small cases)
        results = [r for r in results if (r.get("pass"), r.get("variant")) in faulted]
    return results, faulted

def default_name(entry, M, E) -> str:
    """The configuration runtime.moe's launcher picks for this problem when none is asked for."""
    from types import SimpleNamespace

    import runtime as sf
    saved = dict(sf.moe.CONFIG)
    sf.moe.CONFIG.clear()
    try:
        return sf.moe.variant_for(SimpleNamespace(launch=entry.launch, entry=entry), entry.sku.op, None, M / E)[0]
    finally:
        sf.moe.CONFIG.update(saved)


def summary(rows, edge, variants, passes, shapes, skus) -> list:
    labels = [f"E{s[0]} M{s[1]} N{s[2]} K{s[3]} {s[4]}" for s in shapes]
    short = [f"E{s[0]}{s[4][0]}" for s in shapes]
    lines = ["", "% of torch._grouped_mm per shape (b = balanced, s = skewed); min over shapes; ok = every "
             "check passed (shapes and edge cases)",
             "bits = shapes and edge cases whose output has the bits of the first configuration of its pass "
             "(the same k16 steps in the same order: expected everywhere)",
             f"{'pass':5s} {'variant':<15s} " + " ".join(f"{h:>6s}" for h in short) + "    min  edge   bits  ok"]
    best = {}
    for key in passes:
        for name in variants[key]:
            pcts, ok = [], True
            for lab in labels:
                r = next((r for r in rows if r.get("shape") == lab and r.get("pass") == key
                          and r.get("variant") == name), None)
                if r is None or "ours_ms" not in r:
                    pcts.append(None)
                    ok = ok and (r is None or "skipped" in r)
                    if r is not None and "error" in r:
                        ok = False
                    continue
                pcts.append(r.get("pct_torch"))
                ok = ok and r["ok"]
            e_rows = [e for e in edge if e.get("pass") == key and e.get("variant") == name]
            e_ok = all(e.get("ok") for e in e_rows)
            e_txt = f"{sum(bool(e.get('ok')) for e in e_rows)}/{len(e_rows)}" if e_rows else "-"
            have = [p for p in pcts if p is not None]
            mn = min(have) if have else None
            lines.append(f"{key:5s} {name:<15s} " + " ".join(f"{p:6.1f}" if p is not None else "     -" for p in pcts)
                         + f" {mn:6.1f}" if mn is not None else f"{key:5s} {name:<15s} (no measurements)")
            sb = [r["same_bits_as"][1] for r in rows + edge if r.get("pass") == key and r.get("variant") == name
                  and "same_bits_as" in r]
            b_txt = f"{sum(sb)}/{len(sb)}" if sb else "first"
            lines[-1] += f" {e_txt:>5s} {b_txt:>6s}  {'ok' if ok and e_ok else 'FAIL'}"
            if ok and e_ok and mn is not None and (key not in best or mn > best[key][1]):
                best[key] = (name, mn)
    lines.append("")
    for key in passes:   # what the launcher runs without SKUFORGE_MOE_CONFIG
        parts = []
        for shp, lab, sh in zip(shapes, labels, short):
            name = default_name(skus[key], shp[1], shp[0])
            r = next((r for r in rows if r.get("shape") == lab and r.get("pass") == key and r.get("variant") == name),
                     None)
            pct = r.get("pct_torch") if r else None
            parts.append(f"{sh} {name} " + (f"{pct:.1f}%" if pct is not None else "-"))
        lines.append(f"default {key}: " + ", ".join(parts))
    for key in passes:   # the best checked configuration of each shape (what a per-shape rule could reach)
        parts = []
        for lab, sh in zip(labels, short):
            cand = [r for r in rows if r.get("shape") == lab and r.get("pass") == key and r.get("ok")
                    and r.get("pct_torch") is not None]
            if cand:
                r = max(cand, key=lambda r: r["pct_torch"])
                parts.append(f"{sh} {r['variant']} {r['pct_torch']:.1f}%")
        lines.append(f"per-shape best {key}: " + ", ".join(parts))
    for key in passes:
        if key in best:
            lines.append(f"best {key}: {best[key][0]} (min {best[key][1]:.1f}% of torch over the measured shapes)")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/probe_moe.py")
    ap.add_argument("--out", default="probe_moe.json")
    ap.add_argument("--quick", action="store_true", help="two shapes (E8 balanced, E128 skewed)")
    ap.add_argument("--variants", default="", help="comma-separated names (default: every configuration)")
    ap.add_argument("--passes", default="fwd,dgrad,wgrad")
    ap.add_argument("--shapes", default="", help="indices into the six benchmark shapes, e.g. 0,2,5")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget", type=float, default=230.0, help="seconds; later stages are skipped past it")
    ap.add_argument("--no-edge", action="store_true", help="skip the edge cases")
    ap.add_argument("--dw-bf16", action="store_true", help="backward-weight with dw in bf16 (as torch) instead of f32")
    ap.add_argument("--in-process", action="store_true", help="edge cases in this process (no fault isolation)")
    ap.add_argument("--edge-only", metavar="JSONL", help=argparse.SUPPRESS)   # the child of edge_cases_isolated
    ap.add_argument("--skip", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.edge_only:
        return edge_child(args)
    out = {"argv": sys.argv, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        return probe(args, out)
    except BaseException as exc:   # keep what was measured: write the JSON anyway
        out["fatal"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-4000:]}"
        print(out["fatal"], flush=True)
        write(args.out, out)
        return 1


def edge_child(args) -> int:
    import torch
    torch.cuda.init()   # the CUDA context before the runtime loads modules

    import runtime as sf
    reg = sf.default_registry()
    passes = [p for p in args.passes.split(",") if p]
    want = [v for v in args.variants.split(",") if v]
    variants = {}
    for k in passes:
        e = reg.lookup(sku_of(PASSES[k]))
        variants[k] = [n for n in e.launch["variants"] if not want or n in want]
    skip = {tuple(x.split("=", 1)) for x in args.skip.split(";") if x}
    with open(args.edge_only, "a") as f:
        def emit(d):
            f.write(json.dumps(d, default=str) + "\n")
            f.flush()
        edge_cases(variants, passes, elapsed() + args.budget, emit, skip)
    return 0


def write(path: str, out: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)


def probe(args, out: dict) -> int:
    import torch

    from runtime import config
    from runtime.compiler import nvrtc_version
    from runtime.device import compile_arch, properties
    dev = torch.cuda.current_device()
    arch = compile_arch(dev)
    out["env"] = {"device": properties(dev), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "nvrtc": "%d.%d" % nvrtc_version(), "python": platform.python_version(),
                  "grouped_mm": hasattr(torch, "_grouped_mm"), "arch": arch, "SKUFORGE_MOE_CONFIG":
                  config.settings().moe_config or None}
    try:
        import cupy
        out["env"]["cupy"] = cupy.__version__
    except Exception:
        pass
    log(f"device {out['env']['device']['name']} sm_{arch}, torch {torch.__version__}, NVRTC {out['env']['nvrtc']}")
    with config.override(moe_config=""):   # the probe chooses the configurations itself
        return _probe(args, out, arch)


def _probe(args, out: dict, arch: int) -> int:
    import runtime as sf
    from codegen.harness.workloads import moe as bench_moe
    reg = sf.default_registry()
    passes = [p for p in args.passes.split(",") if p]
    skus = {k: reg.lookup(sku_of(PASSES[k], args.dw_bf16)) for k in passes}
    want = [v for v in args.variants.split(",") if v]
    variants = {}
    for k, entry in skus.items():
        names = [entry.launch["default_variant"]] + sorted(n for n in entry.launch["variants"]
                                                           if n != entry.launch["default_variant"])
        variants[k] = [n for n in names if not want or n in want]
    out["variants"] = {k: {n: skus[k].launch["variants"][n]["tile"] for n in v} for k, v in variants.items()}
    out["defaults"] = {k: skus[k].launch["default_variant"] for k in passes}
    log("configurations: " + "; ".join(f"{k}: {', '.join(v)} (default {out['defaults'][k]})"
                                       for k, v in variants.items()))

    # 1. compile (parallel processes), registers / spills
    units = sorted({skus[k].unit for k in passes})
    t = time.time()
    out["compile"] = compile_units(reg, units, arch)
    out["compile_wall_s"] = round(time.time() - t, 2)
    regs = {}
    for k in passes:
        kern = out["compile"][skus[k].unit]["kernels"]
        for n in variants[k]:
            sym = skus[k].launch["variants"][n]["symbol"]
            if isinstance(kern, dict) and sym in kern:
                regs.setdefault(k, {})[n] = kern[sym]
    out["registers"] = regs
    for k, v in regs.items():
        log(f"ptxas sm_{arch} {k}: " + ", ".join(f"{n} {r['registers']}r/{r['spill_stores']}sp" for n, r in v.items()))

    shapes = list(bench_moe.SHAPES)
    if args.quick:
        shapes = list(bench_moe.QUICK_SHAPES)
    if args.shapes:
        shapes = [bench_moe.SHAPES[int(i)] for i in args.shapes.split(",")]

    # 2. edge cases (small): leave most of the budget to the benchmark shapes
    edge, faulted = [], set()
    if not args.no_edge:
        edge_budget = min(args.budget, elapsed() + 0.35 * max(0.0, args.budget - elapsed()))
        if args.in_process:
            edge = edge_cases(variants, passes, edge_budget)
        else:
            edge, faulted = edge_cases_isolated(variants, passes, edge_budget)   # dw float32 there
        if faulted:
            log("configurations that killed the CUDA context (left out of the benchmark): " + ", ".join(
                f"{k} {n}" for k, n in sorted(faulted)))
            for k, n in faulted:
                variants[k] = [v for v in variants[k] if v != n]
        out["faulted"] = sorted(faulted)
        bad = [e for e in edge if not e.get("ok") and "skipped" not in e]
        log(f"edge cases: {sum(bool(e.get('ok')) for e in edge)}/{len(edge)} ok"
            + ("; failing: " + "; ".join(f"{e['pass']} {e['variant']} {e['case']}: "
                                          f"{e.get('error') or e.get('bad') or e.get('err')}" for e in bad[:12])
               if bad else ""))
    out["edge"] = edge

    write(args.out, out)

    # 3. benchmark shapes (rows are kept in out as they come: a crash keeps what was measured)
    rows = out["rows"] = []
    bench_shapes(shapes, variants, passes, args.reps, args.budget, args.dw_bf16, rows)
    out["wall_s"] = round(elapsed(), 1)
    lines = summary(rows, edge, variants, passes, shapes, skus)
    if faulted:
        lines.append("faulted (killed the CUDA context in the edge cases, not benchmarked): "
                     + ", ".join(f"{k} {n}" for k, n in sorted(faulted)))
    out["summary"] = lines
    write(args.out, out)
    print("\n".join(lines))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
