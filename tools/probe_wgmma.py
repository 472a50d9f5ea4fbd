"""One-call GPU probe of the wgmma backend of the MoE grouped matmul (docs/moe.md), on an H100 / H200.

    PYTHONPATH=. python3 tools/probe_wgmma.py --out probe_wgmma.json [--stages check,time] [--reps 10]
        [--shapes E8,E128] [--passes fwd,dgrad,wgrad]

Stages, each in a child process with a hard time limit (a kernel that never finishes costs that
limit, not the whole call):
1. ``compile``: the wgmma units (sm_90a) into the disk cache, in parallel processes.
2. ``check``: every pass (forward, input gradient, weight gradient with dw float32 and bf16) on every
   tile configuration of the bf16 SKUs (and the f16 default), into NaN-poisoned outputs, against a
   float32 per-expert torch loop (rel. Frobenius <= 1e-2): an expert without rows, trailing padding
   rows (trusted offsets), strided rows, K / N tails, many small experts, one tile; the exact zeros,
   identical bits on a second run. The one-tile case's inputs and outputs go to ``<out>_<pass>.npz``.
3. ``time``: the benchmark shapes (balanced and skewed offsets routing; codegen/harness/workloads/moe.py's data),
   every pass on every configuration and on the rule's choice, against torch._grouped_mm and the
   dense bf16 product (8192^3) measured in the same process; CUDA events, median of --reps.
Prints one line per result and writes everything to --out (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import numpy as np

from runtime.axes import PASSES

LIMITS = {"compile": 120, "check": 120, "time": 220}
TOL = 1e-2
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def run_pass(op, out, x, w, dy, **kw):
    import runtime as sf
    if op == "grouped_matmul":
        return sf.grouped_matmul(x, w, out=out, **kw)
    if op == "grouped_matmul_backward_input":
        return sf.grouped_matmul_backward(x, w, dy, need_weight=False, out=(out, None), **kw)[0]
    return sf.grouped_matmul_backward(x, w, dy, need_input=False, dw_dtype=out.dtype, out=(None, out), **kw)[1]


# -- compile ---------------------------------------------------------------------------------------
def _compile(job):
    from runtime.compiler import compile_cached
    unit, source, arch, options = job
    t = time.time()
    compile_cached(source, unit, arch, options)
    return unit, time.time() - t


def stage_compile(args):
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from runtime.registry import default_registry
    reg = default_registry()
    jobs = [(u, reg.unit_source(u), 90, tuple(m["nvrtc_options"])) for u, m in sorted(reg.units.items())
            if u.endswith("_sm90a.cu")]
    with ProcessPoolExecutor(max_workers=min(16, len(jobs)), mp_context=get_context("spawn")) as pool:
        for unit, dt in pool.map(_compile, jobs):
            log(f"compiled {unit} in {dt:.1f} s")
    return {"units": [j[0] for j in jobs]}


# -- check -----------------------------------------------------------------------------------------
def _problem(torch, rng, E, M, N, K, dt, kind, strided):
    """x, w, dy, ids (per row, -1 padding; rows sorted by expert), offsets, trusted."""
    if kind == "one tile":
        counts = np.array([M] * E)[:E]
    elif kind == "skewed":
        p = 1.0 / (np.arange(E) + 1.0) ** 2
        counts = rng.multinomial(M, p / p.sum())
    else:
        counts = rng.multinomial(M - (M // 7 if kind == "padding" else 0), np.ones(E) / E)
        if E > 2:
            counts[1] += counts[2]
            counts[2] = 0                                # expert 2: no rows
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    ids = np.full(M, -1, np.int64)
    ids[:offs[-1]] = np.repeat(np.arange(E), counts)

    def mat(r, c, scale=1.0):
        a = torch.randn(r, c, device="cuda", dtype=torch.float32) * scale
        if strided:
            big = torch.empty(r, c + 8, device="cuda", dtype=dt)
            big[:, :c] = a.to(dt)
            return big[:, :c]
        return a.to(dt)
    x, dy = mat(M, K), mat(M, N)
    w = (torch.randn(E, N, K, device="cuda") / K ** 0.5).to(dt)
    return x, w, dy, ids, torch.tensor(offs, device="cuda"), offs[-1] != M


def _reference(torch, op, x, w, dy, ids, E):
    M, K = x.shape
    N = w.shape[1]
    idt = torch.tensor(ids, device="cuda")
    out = torch.zeros({"grouped_matmul": (M, N), "grouped_matmul_backward_input": (M, K),
                       "grouped_matmul_backward_weight": (E, N, K)}[op], device="cuda", dtype=torch.float64)
    for e in range(E):
        r = idt == e
        if op == "grouped_matmul":
            out[r] = x[r].double() @ w[e].double().t()
        elif op == "grouped_matmul_backward_input":
            out[r] = dy[r].double() @ w[e].double()
        else:
            out[e] = dy[r].double().t() @ x[r].double()
    return out


CHECK_CASES = [  # (label, E, M, N, K, routing, strided)
    ("empty expert", 6, 700, 264, 392, "balanced", False),
    ("padding rows (trusted offsets)", 5, 777, 136, 520, "padding", False),
    ("skewed, strided rows", 3, 1000, 200, 136, "skewed", True),
    ("many small experts", 128, 4096, 128, 256, "balanced", False),
    ("one tile", 1, 128, 256, 64, "one tile", False),
]


def stage_check(args):
    import torch

    import runtime as sf
    reg = sf.default_registry()
    rng = np.random.default_rng(args.seed)
    results = []
    torch.manual_seed(args.seed)
    skus = [s for s in reg.skus() if s.backend == "wgmma" and s.element == "bf16"]
    skus += [s for s in reg.skus() if s.backend == "wgmma" and s.element == "f16" and s.aux_element in (None, "f32")]
    for sku in skus:
        op = sku.op
        e = reg.lookup(sku)
        names = list(e.launch["variants"]) if sku.element == "bf16" else [e.launch["default_variant"]]
        dt = torch.bfloat16 if sku.element == "bf16" else torch.float16
        out_dt = torch.float32 if sku.aux_element == "f32" else dt
        for name in names:
            for label, E, M, N, K, routing, strided in CHECK_CASES:
                x, w, dy, ids, offs, trusted = _problem(torch, rng, E, M, N, K, dt, routing, strided)
                want = _reference(torch, op, x, w, dy, ids, E)
                shape = tuple(want.shape)
                outs, bad = [], []
                t = time.time()
                try:
                    with sf.moe.use_config(**{PASSES[op]: name}):
                        for _ in range(2):
                            o = torch.full(shape, float("nan"), device="cuda", dtype=out_dt)
                            run_pass(op, o, x, w, dy, offsets=offs, strategy="wgmma", trusted_offsets=bool(trusted))
                            outs.append(o)
                    torch.cuda.synchronize()
                    err = ((outs[0].double() - want).norm() / want.norm().clamp_min(1e-30)).item()
                    if not torch.isfinite(outs[0]).all():
                        bad.append(f"{int((~torch.isfinite(outs[0])).sum())} non-finite")
                    if not torch.equal(outs[0], outs[1]):
                        bad.append("second run differs")
                    if op != "grouped_matmul_backward_weight":
                        pad = torch.tensor(ids < 0, device="cuda")
                        if pad.any() and not bool((outs[0][pad] == 0).all()):
                            bad.append("padding rows not 0")
                    elif E > 2 and routing != "skewed" and not bool((outs[0][2] == 0).all()):
                        bad.append("empty expert not 0")
                    if err > TOL:
                        diff = (outs[0].double() - want).abs()
                        where = torch.nonzero(diff > 0.05 * want.abs().max()).cpu().numpy()
                        bad.append(f"rel err {err:.3g}; {len(where)} bad elements, first {where[:4].tolist()}")
                except Exception as ex:  # noqa: BLE001 - reported per case
                    err, bad = float("nan"), [f"{type(ex).__name__}: {ex}"]
                    traceback.print_exc()
                ok = not bad
                r = {"sku": str(sku), "variant": name, "case": label, "rel_err": err, "ok": ok, "problems": bad,
                     "s": round(time.time() - t, 3)}
                results.append(r)
                log(f"{'ok ' if ok else 'BAD'} {op:32s} {sku.element}->{sku.aux_element or sku.element} {name:12s} "
                    f"{label:32s} err {err:.2e} {'; '.join(bad)}")
                if label == "one tile" and sku.element == "bf16" and name == e.launch["default_variant"] and outs:
                    np.savez(f"{args.out[:-5]}_{PASSES[op]}{'_f32' if sku.aux_element else ''}.npz",
                             x=x.float().cpu().numpy(), w=w.float().cpu().numpy(), dy=dy.float().cpu().numpy(),
                             out=outs[0].float().cpu().numpy(), want=want.cpu().numpy())
    return {"results": results, "failed": sum(not r["ok"] for r in results)}


# -- time ------------------------------------------------------------------------------------------
def stage_time(args):
    import torch

    import runtime as sf
    from codegen.harness.workloads import moe as wl
    from codegen.harness.workloads.moe import _time, time_interleaved
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    dense = 2 * 8192 ** 3 / _time(lambda: a @ b, args.reps, 3) / 1e9
    a = b = None
    log(f"dense bf16 8192^3: {dense:.0f} TFLOP/s")
    out = {"dense_tflops": dense, "rows": []}
    shapes = [tuple(s) for s in wl.PASS_SHAPES]
    reg = sf.default_registry()
    for shape in shapes:
        if args.shapes and f"E{shape[0]}" not in args.shapes.split(","):
            continue
        data = wl.inputs(shape, "bf16")
        E, M, N, K, routing = shape
        flops = 2.0 * M * N * K
        for op, pass_ in PASSES.items():
            if args.passes and pass_ not in args.passes.split(","):
                continue
            ours_fn, ref_fn = wl.calls(op, data, "wgmma", "float32")
            sku = reg.select(category="moe", op=op, element="bf16", aux_element="f32" if pass_ == "wgrad" else None,
                             arch=90, backend="wgmma")
            rule = sf.moe.default_variant(sf.moe.select_plan(op, data["x"], data["w"], data["dy"],
                                                             offsets=data["offsets"], strategy="wgmma"),
                                          M / E, N if pass_ == "fwd" else K)
            names = list(reg.lookup(sku).launch["variants"])

            def with_config(name, fn=ours_fn, pass_=pass_):
                def call():
                    with sf.moe.use_config(**{pass_: name}):
                        return fn()
                return call
            # torch and every configuration in turns, call by call: one clock state for all
            theirs, *ms_of = time_interleaved([ref_fn] + [with_config(n) for n in names], args.reps, 3)
            row = {"shape": list(shape), "pass": pass_, "torch_ms": theirs, "torch_tflops": flops / theirs / 1e9,
                   "rule": rule, "variants": {}}
            for name, ms in zip(names, ms_of):
                row["variants"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "pct_torch": 100 * theirs / ms}
            out["rows"].append(row)
            best = max(row["variants"], key=lambda n: row["variants"][n]["tflops"])
            log(f"E{E} M{M} N{N} K{K} {routing:8s} {pass_:5s} torch {row['torch_tflops']:6.1f} | " + " ".join(
                f"{n} {v['tflops']:6.1f} ({v['pct_torch']:5.1f}%)" for n, v in row["variants"].items())
                + f" | rule {rule} best {best}")
        del data
        torch.cuda.empty_cache()
    return out


# -- driver ----------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/probe_wgmma.json")
    ap.add_argument("--stages", default="compile,check,time")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shapes", default="", help="e.g. E8,E128 (default: all)")
    ap.add_argument("--passes", default="", help="stage time: e.g. wgrad or fwd,dgrad (default: all)")
    args = ap.parse_args(argv)
    if args.stage:          # a child: one stage, its result as JSON on the last line
        res = {"compile": stage_compile, "check": stage_check, "time": stage_time}[args.stage](args)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    report = {}
    for st in args.stages.split(","):
        log(f"== {st}")
        cmd = [sys.executable, __file__, "--stage", st, "--out", args.out, "--reps", str(args.reps),
               "--seed", str(args.seed), "--shapes", args.shapes, "--passes", args.passes]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMITS[st], env=os.environ)
            text = p.stdout + p.stderr
            res = next((json.loads(line[7:]) for line in reversed(p.stdout.splitlines()) if line.startswith("RESULT ")),
                       None)
            report[st] = res if res is not None else {"error": f"exit {p.returncode}", "tail": text[-3000:]}
        except subprocess.TimeoutExpired as ex:
            text = (ex.stdout or b"").decode() if isinstance(ex.stdout, bytes) else (ex.stdout or "")
            report[st] = {"error": f"killed after {LIMITS[st]} s (hang?)", "tail": text[-3000:]}
        print("\n".join(line for line in text.splitlines() if not line.startswith("RESULT ")), flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
