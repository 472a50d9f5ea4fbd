"""The passes the moe probe (tools/probe_moe.py) runs and checks: the edge cases of
codegen/harness/checks/moe.py on every tile configuration, and the benchmark shapes against a float32
per-expert torch.mm loop and torch._grouped_mm; with the probe's clock (``elapsed``, ``log``)."""
from __future__ import annotations

import statistics
import sys
import time
import traceback
from types import SimpleNamespace

import numpy as np

T0 = time.time()
PASSES = {"fwd": "grouped_matmul", "dgrad": "grouped_matmul_backward_input", "wgrad": "grouped_matmul_backward_weight"}
TOL = 1e-2   # bf16 tolerance, docs/numerics.md


def run_pass(op, out, x, w, dy=None, **kw):
    """One pass of ``op`` into ``out`` through the functional API's ``out=`` (the backward with the
    other gradient off); returns the plan that ran it."""
    import runtime as sf
    if op == "grouped_matmul":
        sf.grouped_matmul(x, w, out=out, **kw)
    elif op == "grouped_matmul_backward_input":
        sf.grouped_matmul_backward(x, w, dy, need_weight=False, out=(out, None), **kw)
    else:
        sf.grouped_matmul_backward(x, w, dy, need_input=False, dw_dtype=out.dtype, out=(None, out), **kw)
    return sf.moe.select_plan(op, x, w, dy, dw_dtype=out.dtype, **kw)


def elapsed() -> float:
    return time.time() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


# -- helpers -----------------------------------------------------------------------------------------
def rel_err(got, ref) -> float:
    """||got - ref||_F / ||ref||_F on the GPU (float64 sums); inf if got has NaN/inf."""
    import torch
    g = got.double() if got.numel() < 2**28 else got.float()
    r = ref.double() if ref.numel() < 2**28 else ref.float()
    if not torch.isfinite(g).all():
        return float("inf")
    den = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(g - r).item()
    return num / den if den else num


def same_bits(a, b) -> bool:
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return bool(torch.equal(a.view(view), b.view(view)))


def poisoned(shape, dtype):
    import torch
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def time_ms(fn, reps: int, warmup: int = 3) -> dict:
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return {"median": statistics.median(t), "min": t[0], "max": t[-1]}


# -- 2. edge cases ------------------------------------------------------------------------------------
def edge_cases(variants, passes, budget, emit=None, skip=()):
    """The checker's cases on every (pass, configuration) but those in ``skip``. ``emit(dict)``
    (the subprocess mode) gets a "start" line before each run and every result: a run that kills
    the CUDA context (illegal address: a sticky error) is then known by its start line."""
    from codegen.harness.checks import moe as cm
    rng = np.random.default_rng(2026)
    results = []
    for key in passes:
        for case in cm.CASES:
            if elapsed() > budget:
                results.append({"pass": key, "case": case[0], "skipped": "time budget"})
                continue
            p = _edge_problem(key, case, rng)
            first = None
            for name in variants[key]:
                if (key, name) in skip:
                    continue
                row = {"pass": key, "case": p.label, "variant": name}
                if emit:
                    emit({"start": [key, name, row["case"]]})
                first = _edge_run(row, key, name, p, first)
                results.append(row)
                if emit:
                    emit(row)
                if row.get("fault"):
                    if emit:
                        sys.exit(3)
                    return results
    return results


def _edge_problem(key, case, rng) -> SimpleNamespace:
    """One edge case of pass ``key``: its inputs on the device (torch), the float64 NumPy reference
    of the pass, the output's shape and dtype, each row's expert."""
    import torch

    from codegen.harness.checks import moe as cm
    from runtime import reference_moe as ref
    label, E, M, N, K, routing, strided = case
    x, w, dy = cm.random_problem(E, M, N, K, "bf16", rng)
    row_experts, offsets = cm.make_routing(routing, E, M, rng)
    experts = ref.expert_of_rows(M, E, row_experts, offsets)
    xd, wd, dyd = cm._dev(x, "torch", strided, rng), cm.to_device(w, "torch"), cm._dev(dy, "torch", strided, rng)
    rd = None if row_experts is None else cm.to_device(row_experts, "torch")
    od = None if offsets is None else cm.to_device(offsets, "torch")
    op = PASSES[key]
    if op == "grouped_matmul":
        want = ref.grouped_matmul(x, w, row_experts=row_experts, offsets=offsets)
        shape, dtype = (M, N), torch.bfloat16
    else:
        dx, dw = ref.grouped_matmul_backward(x, w, dy, row_experts=row_experts, offsets=offsets)
        want = dx if key == "dgrad" else dw
        shape, dtype = ((M, K), torch.bfloat16) if key == "dgrad" else ((E, N, K), torch.float32)
    return SimpleNamespace(label=f"{label} E={E} M={M} N={N} K={K} {routing}", op=op, E=E, x=xd, w=wd, dy=dyd,
                           rows=rd, offsets=od, want=want, shape=shape, dtype=dtype, experts=experts)


def _edge_run(row, key, name, p, first):
    """Configuration ``name`` of pass ``key`` on the edge case ``p`` into NaN-poisoned outputs (the
    backward twice), checked; the results in ``row``. Returns ``first``: (configuration, output) of
    the first configuration that ran, whose bits the others must have."""
    import torch

    import runtime as sf
    from codegen.harness.checks.base import to_host
    from runtime import reference_moe as ref
    try:
        outs = []
        with sf.moe.use_config(**{key: name}):
            for _ in range(2 if key != "fwd" else 1):
                o = poisoned(p.shape, p.dtype)
                run_pass(p.op, o, p.x, p.w, p.dy if key != "fwd" else None, row_experts=p.rows,
                         offsets=p.offsets, strategy="mma")
                outs.append(o)
        torch.cuda.synchronize()
        got = to_host(outs[0])
        row["err"] = float(ref.rel_error(got, p.want))
        bad = _edge_faults(key, got, outs, p)
        # every configuration sums the same k16 steps in the same order: the same bits
        if first is None:
            first = (name, outs[0])
        else:
            row["same_bits_as"] = [first[0], same_bits(outs[0], first[1])]
        row["bad"] = bad
        row["ok"] = row["err"] <= TOL and not bad
    except Exception as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        try:
            torch.cuda.synchronize()
        except Exception:       # sticky: the context is gone, nothing after this can run
            row["fault"] = True
    return first


def _edge_faults(key, got, outs, p) -> list:
    """What is wrong with an edge case's output ``got`` (``outs``: its runs on the device) besides its
    error: unwritten outputs, padding rows or experts without rows not exactly 0, two runs with
    different bits, the dtype."""
    from runtime.arrays import numpy_dtype
    bad = []
    if not np.all(np.isfinite(got.astype(np.float64))):
        bad.append("non-finite (unwritten) outputs")
    if key != "wgrad" and np.any(got[p.experts < 0].astype(np.float64) != 0):
        bad.append("padding rows not exactly 0")
    if key == "wgrad":
        empty = np.setdiff1d(np.arange(p.E), p.experts[p.experts >= 0])
        if empty.size and np.any(got[empty].astype(np.float64) != 0):
            bad.append("experts without rows not exactly 0")
    if len(outs) > 1 and not same_bits(outs[0], outs[1]):
        bad.append("two runs gave different bits")
    if got.dtype != numpy_dtype("f32" if key == "wgrad" else "bf16"):
        bad.append(f"dtype {got.dtype}")
    return bad


# -- 3. benchmark shapes --------------------------------------------------------------------------------
def f32_reference(key, data):
    """Per-expert torch.mm loop in float32 (no TF32)."""
    import torch
    x, w, dy, counts = data["x"], data["w"], data["dy"], data["counts"]
    starts = np.concatenate([[0], np.cumsum(counts)])
    E = w.shape[0]
    if key == "fwd":
        out = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32, device="cuda")
    elif key == "dgrad":
        out = torch.empty(x.shape[0], w.shape[2], dtype=torch.float32, device="cuda")
    else:
        out = torch.zeros(E, w.shape[1], w.shape[2], dtype=torch.float32, device="cuda")
    for e in range(E):
        s, t = int(starts[e]), int(starts[e + 1])
        if t == s:
            continue
        we = w[e].float()
        if key == "fwd":
            out[s:t] = x[s:t].float() @ we.t()
        elif key == "dgrad":
            out[s:t] = dy[s:t].float() @ we
        else:
            out[e] = dy[s:t].float().t() @ x[s:t].float()
    return out


def bench_shapes(shapes, variants, passes, reps, budget, dw_bf16, rows):
    import torch

    import runtime as sf
    from codegen.harness.workloads import moe as bench_moe
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for shape in shapes:
        E, M, N, K, routing = shape
        label = f"E{E} M{M} N{N} K{K} {routing}"
        if elapsed() > budget:
            rows.append({"shape": label, "skipped": "time budget"})
            log(f"skip {label}: time budget")
            continue
        data = bench_moe.inputs(shape, "bf16")
        flops = 2.0 * M * N * K
        for key in passes:
            op = PASSES[key]
            if elapsed() > budget:
                rows.append({"shape": label, "pass": key, "skipped": "time budget"})
                continue
            ref = f32_reference(key, data)
            dw_dtype = "bfloat16" if dw_bf16 else "float32"
            _, theirs = bench_moe.calls(op, data, "mma", dw_dtype)
            t_torch = [time_ms(theirs, reps)] if theirs else []
            torch_err = rel_err(theirs(), ref) if theirs else None
            first = None   # (name, output) of the first configuration: the others should match its bits
            for name in variants[key]:
                if elapsed() > budget:
                    rows.append({"shape": label, "pass": key, "variant": name, "skipped": "time budget"})
                    continue
                row = {"shape": label, "E": E, "M": M, "N": N, "K": K, "routing": routing, "pass": key,
                       "variant": name, "flops": flops}
                try:
                    with sf.moe.use_config(**{key: name}):
                        outs = []
                        for _ in range(2 if key != "fwd" else 1):
                            shp = {"fwd": (M, N), "dgrad": (M, K), "wgrad": (E, N, K)}[key]
                            dt = torch.float32 if key == "wgrad" and not dw_bf16 else torch.bfloat16
                            o = poisoned(shp, dt)
                            plan = run_pass(op, o, data["x"], data["w"], data["dy"] if key != "fwd" else None,
                                            offsets=data["offsets"], strategy="mma")
                            outs.append(o)
                        torch.cuda.synchronize()
                        row["sku"] = str(plan.sku)
                        row["err"] = rel_err(outs[0], ref)
                        row["deterministic"] = same_bits(outs[0], outs[1]) if len(outs) > 1 else None
                        if first is None:
                            first = (name, outs[0])
                        else:
                            row["same_bits_as"] = [first[0], same_bits(outs[0], first[1])]
                        del outs
                        ours, _ = bench_moe.calls(op, data, "mma", dw_dtype)
                        row["ours_ms"] = time_ms(ours, reps)
                    row["ok"] = row["err"] <= TOL and row["deterministic"] is not False
                except Exception as exc:
                    row.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
                rows.append(row)
            if theirs:
                t_torch.append(time_ms(theirs, reps))
            tt = statistics.mean(t["median"] for t in t_torch) if t_torch else None
            for row in rows:
                if row.get("shape") == label and row.get("pass") == key and "variant" in row and "torch_ms" not in row:
                    row["torch_ms"] = t_torch
                    row["torch_err"] = torch_err
                    if "ours_ms" in row:
                        row["tflops"] = flops / row["ours_ms"]["median"] / 1e9
                        row["torch_tflops"] = flops / tt / 1e9 if tt else None
                        row["pct_torch"] = 100.0 * tt / row["ours_ms"]["median"] if tt else None
                    log(fmt_row(row))
            del ref, first
        del data
        torch.cuda.empty_cache()
    return rows


def fmt_row(r) -> str:
    if "error" in r:
        return f"{r['pass']:5s} {r['shape']:<34s} {r['variant']:<15s} ERROR {r['error'][:120]}"
    if "ours_ms" not in r:
        return f"{r.get('pass', ''):5s} {r['shape']:<34s} {r.get('variant', ''):<15s} skipped"
    pct = f"{r['pct_torch']:5.1f}%" if r.get("pct_torch") else "  n/a"
    tt = f"{r['torch_tflops']:6.1f}" if r.get("torch_tflops") else "   n/a"
    det = {True: "det", False: "NONDET", None: "-"}[r["deterministic"]]
    if "same_bits_as" in r:
        det += " =bits" if r["same_bits_as"][1] else f" bits!={r['same_bits_as'][0]}"
    return (f"{r['pass']:5s} {r['shape']:<34s} {r['variant']:<15s} {r['ours_ms']['median']:8.3f} ms "
            f"{r['tflops']:6.1f} TF/s  torch {tt} TF/s  {pct}  err {r['err']:.2e} {det} "
            f"{'ok' if r['ok'] else 'FAIL'}")
