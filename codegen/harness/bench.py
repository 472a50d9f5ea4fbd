"""``python -m codegen bench``: bandwidth of the selected SKUs against a device copy and PyTorch.

The method (device-to-device copy reference, bytes counted, CUDA-event timing behind a spin
kernel, L2 rotation, warm-up, turns, host overhead), the default selection, the interface of the
workload modules (``codegen/harness/workloads/``, registered with ``@bench_section``) and the
record formats are in docs/audit.md, "python -m codegen bench".
"""
from __future__ import annotations

import fnmatch
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from . import registry
from .records import add_records_argument, git_info, now, read_json, slug, write_json
from .steps import to_markdown as example_steps_markdown
from .workloads.base import kept_results

SCHEMA = 1
# The standard shapes (docs/audit.md); the first two are the bandwidth shapes of the targets, the last is latency.
STANDARD_SHAPES = ((8192, 8192), (65536, 4096), (4096, 14336), (16, 4096))
LARGE_SHAPES = ((8192, 8192), (65536, 4096))
DEFAULT_SHAPES = LARGE_SHAPES              # --all: STANDARD_SHAPES
QUICK_SHAPES = ((8192, 8192), (16, 4096))
DEFAULT_KINDS = {"bf16", "f16", "f32", "s8", "-"}
DEFAULT_COMPILE_KINDS = {"bf16"}            # torch.compile baseline by default (--all: every SKU)
# Targets (docs/audit.md "Targets"): every single-pass memory-bound op at >= 95 % of a copy of the same
# bytes from 4096 x 7168 up (the workload modules set 75 % for the two-pass scopes); never slower than
# torch.compile on any cell, and >= x1.1 over it in geometric mean per op.
TARGET_PCT: dict = {}                       # per op, where it differs from the default
DEFAULT_TARGET_PCT = 95.0
TARGET_SHAPES = ((4096, 7168), (4096, 14336), (8192, 8192), (65536, 4096), (131072, 4096))
TARGET_SPEEDUP_COMPILE = 1.1                # geomean over the measured shapes vs torch.compile
TARGET_MIN_SPEEDUP_COMPILE = 1.0            # every cell
TARGET_HOST_US = 10.0      # µs per repeated call that launches one kernel
EXTRA_LAUNCH_US = 3.0      # µs more for each further launch of the call
MAX_SETS = 256
WARMUP_MS = 30.0        # device time of back-to-back calls before timing: the clocks ramp back after
                        # idle stretches (a torch.compile of the previous workload takes seconds)
TURN_MS = 10.0          # device time of one contender's batch when several are timed in turns
CHART_MIN_BYTES = 64 << 20
COPY_BYTES = 1 << 30

SPIN_SRC = r"""
extern "C" __global__ void sf_bench_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


# -- the arithmetic (unit-tested on the CPU) ------------------------------------------------------
def gbps(nbytes_: int, ms: float) -> float:
    return nbytes_ / (ms * 1e-3) / 1e9


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def pct(value: float, ref: float) -> float:
    return 100.0 * value / ref


def geomean(values) -> Optional[float]:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def rotation_sets(footprint: int, l2_bytes: int, cap: int = MAX_SETS) -> int:
    """Input sets to rotate so that the working set is at least 4x the L2 cache."""
    if footprint <= 0:
        return 1
    return max(1, min(cap, math.ceil(4 * l2_bytes / footprint)))


def stats(times_ms) -> dict:
    t = sorted(times_ms)
    q = lambda f: t[min(len(t) - 1, int(f * len(t)))]  # noqa: E731
    return {"ms": statistics.median(t), "p10_ms": q(0.1), "p90_ms": q(0.9), "samples": len(t)}


def shape_key(shape) -> str:
    return "x".join(str(s) for s in shape) if isinstance(shape, (tuple, list)) else str(shape)


def parse_shapes(text: str) -> list:
    """``"8192x8192,16x4096"`` -> [(8192, 8192), (16, 4096)]."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            try:
                out.append(tuple(int(v) for v in part.split("x")))
            except ValueError:
                raise SystemExit(f"--shapes: {part!r} is not like 8192x8192") from None
    return out


def finish(r: dict, copy_gbps: float) -> dict:
    """Derived figures of one result: GB/s (or TFLOP/s), % of copy, speed-ups over each baseline."""
    for name in ("skuforge", "torch_eager", "torch_compile", "torch_ref"):
        m = r.get(name)
        if not m or "ms" not in m:
            continue
        if r.get("bytes"):
            m["gbps"] = gbps(r["bytes"], m["ms"])
            m["pct_copy"] = pct(m["gbps"], copy_gbps)
        if r.get("flops"):
            m["tflops"] = tflops(r["flops"], m["ms"])
    ours = r.get("skuforge") or {}
    for k in ("gbps", "pct_copy", "tflops", "ms"):
        if k in ours:
            r[k] = ours[k]
    for name, key in (("torch_eager", "speedup_eager"), ("torch_compile", "speedup_compile"),
                      ("torch_ref", "speedup_ref")):
        m = r.get(name)
        if m and "ms" in m and "ms" in ours:
            r[key] = m["ms"] / ours["ms"]
    r["copy_gbps"] = copy_gbps
    return r


def target_for(module, sku, shape=None) -> dict:
    """The targets a workload module declares for a SKU: ``TARGETS_BY_SCOPE`` / ``TARGET_PCT``
    (% of copy; a number, a dict by op, or a function of the SKU that returns None for "no target"),
    ``TARGET_SHAPES`` (the shapes its bandwidth target names; default :data:`TARGET_SHAPES`),
    ``TARGET_US`` (a function of (sku, shape) giving (µs, where the figure comes from), or None) and
    ``TARGET_PCT_OF_TORCH`` (compute kernels: a number, or a function of (sku, shape) that returns
    None for "no target")."""
    out = {}
    shapes = getattr(module, "TARGET_SHAPES", None)
    if shapes:
        out["target_shapes"] = [list(s) for s in shapes]
    by_scope = getattr(module, "TARGETS_BY_SCOPE", None)
    t = getattr(module, "TARGET_PCT", None)
    if callable(t):                      # per SKU; None: no bandwidth target (e.g. a fallback kernel)
        t = t(sku)
        if t is None:
            return {"no_target": True}
    if isinstance(by_scope, dict) and sku.scope in by_scope:
        out["target_pct"] = float(by_scope[sku.scope])
    elif isinstance(t, (int, float)):
        out["target_pct"] = float(t)
    elif isinstance(t, dict) and sku.op in t:
        out["target_pct"] = float(t[sku.op])
    us = getattr(module, "TARGET_US", None)
    if callable(us) and shape is not None:
        t = us(sku, tuple(shape))
        if t:
            out["target_us"], out["target_us_note"] = t
    ref = getattr(module, "TARGET_PCT_OF_TORCH", None)
    if callable(ref):
        ref = ref(sku, tuple(shape)) if shape is not None else None
    if isinstance(ref, (int, float)):
        out["target_ref"] = float(ref) / 100.0
    return out


def default_subset(sku) -> bool:
    """Per op: scopes x {bf16, f16, f32} with s8 for the quantized side, symmetric mode."""
    kinds = {sku.element, sku.aux_element or "-"}
    return kinds <= DEFAULT_KINDS and sku.mode in (None, "symmetric")


def merge(old, env: dict, run: dict, results: list, host: list, copy: dict, steps: Optional[list] = None) -> dict:
    """Fold a run into a GPU's bench record: results keyed by (sku, shape) replace older ones."""
    rec = dict(old or {})
    keyed = {(r["sku"], shape_key(r["shape"])): r for r in rec.get("results") or []}
    for r in results:
        keyed[(r["sku"], shape_key(r["shape"]))] = r
    rec.update(env)
    rec.update({"schema": SCHEMA, "date": run["date"], "commit": run["commit"], "dirty": run["dirty"],
                "run": run, "copy": copy, "results": [keyed[k] for k in sorted(keyed)]})
    if host:
        rec["host_overhead"] = host
    if steps:
        rec["example_steps"] = steps
    return rec


def fallback_here(sku_text: str, cc) -> bool:
    """True when, on a device of compute capability ``cc`` (the record's ``"9.0"``), the registry picks
    another SKU for the same problem and backend: a newer arch's kernel (sm89 fp8 conversion in hardware
    over the sm80 kernel's software one). Such a SKU runs on that card only when asked for by name, so
    its cells there are recorded but not held to the targets (docs/audit.md)."""
    if not cc:
        return False
    from runtime.registry import default_registry
    from runtime.sku import KernelSku
    sku = KernelSku.parse(sku_text)
    major, _, minor = str(cc).partition(".")
    try:
        best = default_registry().select(category=sku.category, op=sku.op, scope=sku.scope, mode=sku.mode,
                                         element=sku.element, aux_element=sku.aux_element,
                                         arch=int(major) * 10 + int(minor or 0), backend=sku.backend)
    except Exception:  # noqa: BLE001 - a SKU the current matrix no longer has: judged as recorded
        return False
    return str(best) != str(sku)


def stand_ins(rec: dict) -> list:
    """The record's results whose SKU another one replaces on the record's card (:func:`fallback_here`)."""
    cc = (rec.get("gpu") or {}).get("cc")
    return [r for r in rec.get("results") or [] if r.get("sku") and fallback_here(r["sku"], cc)]


def targets(rec: dict) -> list:
    """The performance targets, checked on a bench record: list of (what, value, target, ok, note).

    Bandwidth: per op, target level and target shapes, the worst % of copy on those shapes (a result's
    own ``target_shapes``, else :data:`TARGET_SHAPES`; bf16/f16/f32 inputs; a result's own
    ``target_pct``, else 95); the geomean speed-up over torch.compile per op (>= 1.1) and its
    minimum (>= 1.0: never slower); a result's ``target_us`` (latency shapes). Compute: per op, the worst ratio to the PyTorch reference
    against ``target_ref``. Host overhead: ``TARGET_HOST_US`` per call plus ``EXTRA_LAUNCH_US`` per further launch.
    """
    out = []
    results = [r for r in rec.get("results") or [] if "f64" not in (r.get("element"), r.get("aux_element"))]
    replaced = {id(r) for r in stand_ins(rec)}
    results = [r for r in results if id(r) not in replaced]
    bw = [r for r in results if r.get("pct_copy") is not None]
    for op in sorted({r["op"] for r in bw}):
        mine = [r for r in bw if r["op"] == op]
        levels: dict = {}
        for r in mine:
            where = tuple(sorted(shape_key(s) for s in (r.get("target_shapes") or TARGET_SHAPES)))
            if shape_key(r["shape"]) in where and not r.get("no_target"):
                want = r.get("target_pct") or TARGET_PCT.get(op, DEFAULT_TARGET_PCT)
                levels.setdefault((want, where), []).append(r)
        for (want, where), rs in sorted(levels.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
            worst = min(rs, key=lambda r: r["pct_copy"])
            scopes = "/".join(sorted({str(r.get("scope")) for r in rs}))
            out.append((f"{op} ({scopes}): min % of copy on {'/'.join(where)}", worst["pct_copy"], want,
                        worst["pct_copy"] >= want, f"worst: {worst['label']} {shape_key(worst['shape'])}"))
        g = geomean(r.get("speedup_compile") for r in mine)
        if g is not None:
            out.append((f"{op}: geomean speed-up vs torch.compile", g, TARGET_SPEEDUP_COMPILE,
                        g >= TARGET_SPEEDUP_COMPILE, f"{sum(r.get('speedup_compile') is not None for r in mine)} results"))
            worst = min((r for r in mine if r.get("speedup_compile")), key=lambda r: r["speedup_compile"])
            out.append((f"{op}: min speed-up vs torch.compile (every cell)", worst["speedup_compile"],
                        TARGET_MIN_SPEEDUP_COMPILE, worst["speedup_compile"] >= TARGET_MIN_SPEEDUP_COMPILE,
                        f"worst: {worst['label']} {shape_key(worst['shape'])}"))
        for r in mine:
            want = r.get("target_us")
            if want and r.get("ms"):
                us = r["ms"] * 1e3
                out.append((f"{op}: µs at {shape_key(r['shape'])}, {r['label']}", us, want, us <= want,
                            r.get("target_us_note", "")))
    comp = [r for r in results if r.get("speedup_ref") is not None and r.get("target_ref")]
    for op, backend in sorted({(r["op"], _backend(r)) for r in comp}):
        mine = [r for r in comp if (r["op"], _backend(r)) == (op, backend)]
        for want in sorted({r["target_ref"] for r in mine}):    # one line per target level
            level = [r for r in mine if r["target_ref"] == want]
            worst = min(level, key=lambda r: r["speedup_ref"])
            what = "grouped_matmul_backward (dx + dw)" if "(dx + dw)" in worst["label"] else op
            out.append((f"{what} [{backend}]: min ratio to the PyTorch reference", worst["speedup_ref"], want,
                        worst["speedup_ref"] >= want, f"worst: {worst['label']} ({len(level)} results)"))
    for h in rec.get("host_overhead") or []:
        if h.get("target_us") and h.get("us") is not None:
            out.append((f"host overhead: {h['label']}", h["us"], h["target_us"], h["us"] <= h["target_us"], "µs per call"))
    return out


def _backend(r: dict) -> str:
    parts = r["sku"].split("/")
    return parts[7] if len(parts) > 7 else "?"


# -- Markdown and chart ---------------------------------------------------------------------------------
def _f(v, fmt="{:.0f}") -> str:
    return "" if v is None else fmt.format(v)


def _agree(n) -> str:
    return "" if n is None else ("✓" if n == 0 else f"✗ {n}")


def to_markdown(rec: dict) -> str:
    gpu = rec.get("gpu", {})
    lines = [f"# skuforge bench: {gpu.get('name', '?')}", "",
             f"Driver {rec.get('driver')}, CUDA {rec.get('cuda_runtime')}, NVRTC {rec.get('nvrtc')}, "
             f"torch {rec.get('torch', 'absent')}; latest run {rec.get('date')} at commit "
             f"{(rec.get('commit') or 'unknown')[:12]}{' (dirty)' if rec.get('dirty') else ''}.", "",
             f"Device-to-device copy: **{_f(rec.get('copy', {}).get('gbps'))} GB/s** "
             f"({rec.get('copy', {}).get('bytes', 0) / 2**30:.0f} GiB read + written). "
             "Bandwidth = bytes (inputs read once + outputs written once, scales included) / median time "
             "(CUDA events). `% copy` is relative to a copy of the same number of bytes measured in the same "
             "run (the peak copy above for shapes that fit in 4 x L2); `pct_copy_peak` in the JSON is "
             "relative to the peak copy.", ""]
    t = targets(rec)
    if t:
        lines += ["## Targets", "", "| target | measured | wanted | | note |", "|---|---|---|---|---|"]
        for what, val, want, ok, note in t:
            lines.append(f"| {what} | {val:.2f} | {want:g} | {'✅' if ok else '❌'} | {note} |")
        lines.append("")
        others = sorted({r["label"] for r in stand_ins(rec)})
        if others:
            lines += ["Not held to the targets (the registry runs another SKU for the same problem on this card; "
                      "recorded below): " + ", ".join(others) + ".", ""]
    host = rec.get("host_overhead") or []
    if host:
        lines += ["## Host overhead of a repeated functional call", "",
                  "µs per call. *host*: the calling thread's time, the GPU kept busy (median of batches, taken in "
                  "rounds over all the calls); "
                  "*throughput*: back-to-back calls and a synchronize (also bound by the GPU's launch rate).", "",
                  "| call | host µs | min | target | throughput µs |", "|---|---|---|---|---|"]
        for h in host:
            if h.get("us") is None:
                lines.append(f"| {h['label']} | error: {h.get('error')} | | | |")
                continue
            target = h.get("target_us")
            mark = "" if target is None else (f"{target:g} ✅" if h["us"] <= target else f"{target:g} ❌")
            thr = h.get("throughput_us")
            lines.append(f"| {h['label']} | {h['us']:.1f} | {h['min_us']:.1f} | {mark} | "
                         f"{'' if thr is None else f'{thr:.1f}'} |")
        lines.append("")
    lines += example_steps_markdown(rec.get("example_steps") or [])
    res = rec.get("results") or []
    bw = [r for r in res if r.get("bytes")]
    fl = [r for r in res if r.get("flops") and not r.get("bytes")]
    if bw:
        lines += ["## Bandwidth kernels", "",
                  "| op | kernel | shape | schedule | µs | GB/s | % copy | eager % | compile % | × eager | × compile | = eager |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(bw, key=lambda r: (r["op"], r["sku"], shape_key(r["shape"]))):
            e, c = r.get("torch_eager") or {}, r.get("torch_compile") or {}
            lines.append(f"| {r['op']} | {r['label']} | {shape_key(r['shape'])} | {r.get('schedule', '')} | "
                         f"{_f(r.get('ms', 0) * 1e3, '{:.1f}')} | "
                         f"{_f(r.get('gbps'))} | {_f(r.get('pct_copy'), '{:.1f}')} | {_f(e.get('pct_copy'), '{:.1f}')} | "
                         f"{_f(c.get('pct_copy'), '{:.1f}')} | {_f(r.get('speedup_eager'), '{:.2f}')} | "
                         f"{_f(r.get('speedup_compile'), '{:.2f}')} | {_agree(r.get('mismatches_vs_eager'))} |")
        lines.append("")
    if fl:
        ceil = rec.get("ceilings") or {}
        lines += ["## Compute kernels", ""]
        lines += [f"Ceiling measured in the run: {c['name']}: **{c['tflops']:.0f} TFLOP/s** ({name})."
                  for name, c in sorted(ceil.items())] + ([""] if ceil else [])
        lines += ["| op | kernel | shape | ms | TFLOP/s | % ceiling | ref TFLOP/s | × ref | wanted |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(fl, key=lambda r: (r["op"], r["sku"], shape_key(r["shape"]))):
            ref = r.get("torch_ref") or {}
            lines.append(f"| {r['op']} | {r['label']} | {shape_key(r['shape'])} | {_f(r.get('ms'), '{:.3f}')} | "
                         f"{_f(r.get('tflops'), '{:.1f}')} | {_f(r.get('pct_ceiling'), '{:.1f}')} | "
                         f"{_f(ref.get('tflops'), '{:.1f}')} | {_f(r.get('speedup_ref'), '{:.2f}')} | "
                         f"{_f(r.get('target_ref'), '≥ {:.2f}')} |")
        lines.append("")
    errs = [(r["label"], shape_key(r["shape"]), n, r[n]["error"]) for r in res
            for n in ("torch_eager", "torch_compile", "torch_ref") if isinstance(r.get(n), dict) and "error" in r[n]]
    if errs:
        lines += ["## Baselines that did not run", ""] + [f"- {a} {s} {n}: {e}" for a, s, n, e in errs] + [""]
    return "\n".join(lines)


def chart(rec: dict, path: Path) -> Optional[Path]:
    """A PNG of % of copy bandwidth per op/scope/dtype (one panel per shape), with the PyTorch baselines."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    res = [r for r in rec.get("results") or [] if r.get("pct_copy") is not None]
    if not res:
        return None
    shapes = []
    for r in res:
        k = shape_key(r["shape"])
        if k not in shapes and (r.get("bytes") or 0) >= CHART_MIN_BYTES:   # latency shapes: see the table
            shapes.append(k)
    if not shapes:
        return None
    shapes = [s for s in (shape_key(x) for x in STANDARD_SHAPES) if s in shapes] + \
             [s for s in shapes if s not in {shape_key(x) for x in STANDARD_SHAPES}]
    labels = sorted({(r["op"], r["label"]) for r in res})
    h = max(3.0, 0.22 * len(labels) + 1.5)
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes) + 3, h), sharey=True, squeeze=False)
    for ax, s in zip(axes[0], shapes):
        by = {(r["op"], r["label"]): r for r in res if shape_key(r["shape"]) == s}
        ys = range(len(labels))
        for off, key, name, color in ((-0.27, None, "skuforge", "#15803d"),
                                      (0.0, "torch_compile", "torch.compile", "#2563eb"),
                                      (0.27, "torch_eager", "PyTorch eager", "#9ca3af")):
            vals = []
            for lab in labels:
                r = by.get(lab)
                v = None if r is None else (r.get("pct_copy") if key is None else (r.get(key) or {}).get("pct_copy"))
                vals.append(v or 0.0)
            ax.barh([y + off for y in ys], vals, height=0.27, color=color, label=name)
        ax.axvline(100, color="black", lw=0.8)
        ax.axvline(DEFAULT_TARGET_PCT, color="#dc2626", lw=0.8, ls="--")
        ax.set_title(f"shape {s}")
        ax.set_xlabel("% of device-to-device copy bandwidth")
        ax.set_xlim(0, 110)
    axes[0][0].set_yticks(list(range(len(labels))))
    axes[0][0].set_yticklabels([f"{op}: {lab}" for op, lab in labels], fontsize=7)
    axes[0][0].invert_yaxis()
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle(f"skuforge on {rec.get('gpu', {}).get('name', '?')}: copy = {rec.get('copy', {}).get('gbps', 0):.0f} GB/s")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- workload discovery ---------------------------------------------------------------------------------
def workload_modules(warn=print) -> list:
    """The registered bench sections' modules, by section name (``codegen.harness.registry``;
    a family module that fails to import is reported and skipped)."""
    return list(registry.sections(warn=lambda text: warn(f"bench: {text}")).values())


def module_for(sku, modules):
    """The module for a SKU: one whose ``handles(sku)`` says so first (specific), then by ``OPS``."""
    for m in modules:
        if hasattr(m, "handles") and m.handles(sku):
            return m
    for m in modules:
        if not hasattr(m, "handles") and sku.op in getattr(m, "OPS", ()):
            return m
    return None


def plan(skus, modules, *, all_skus=False, shapes=None, quick=False) -> list:
    """[(sku, module, shape)] to run: the default subset unless ``all_skus``."""
    out = []
    for sku in skus:
        m = module_for(sku, modules)
        if m is None:
            continue
        chosen = all_skus or (m.default(sku) if hasattr(m, "default") else default_subset(sku))
        if not chosen:
            continue
        if hasattr(m, "SHAPES"):
            sh = getattr(m, "QUICK_SHAPES", m.SHAPES[:1]) if quick else m.SHAPES
        elif shapes or quick or all_skus:
            sh = shapes or (QUICK_SHAPES if quick else STANDARD_SHAPES)
        else:   # default: the two large shapes; every standard shape for the bf16 kernels
            sh = STANDARD_SHAPES if {sku.element, sku.aux_element} & DEFAULT_COMPILE_KINDS else DEFAULT_SHAPES
        out += [(sku, m, tuple(s) if isinstance(s, list) else s) for s in sh]
    return out


# -- GPU side ----------------------------------------------------------------------------------------------
class Timer:
    """CUDA-event timing of zero-arg callables, queued behind a spin kernel (GPU time, not host time),
    after WARMUP_MS of back-to-back calls (without it, results timed after an idle stretch, such as
    the torch.compile of the previous workload, came out 10-20 points low on 50 µs kernels)."""

    def __init__(self, stream, samples: int, max_seconds: float):
        import cupy as cp
        self.cp, self.stream, self.samples, self.max_seconds = cp, stream, samples, max_seconds
        self.spin = cp.RawKernel(SPIN_SRC, "sf_bench_spin")

    def spin_ns(self, ns: int):
        import numpy as np
        self.spin((1,), (1,), (np.uint64(max(0, int(ns))),), stream=self.stream)

    def measure(self, calls) -> dict:
        return self.measure_turns([calls])[0]

    def _warm(self, calls) -> tuple:
        """First calls (loads, compiles, allocator), then WARMUP_MS of back-to-back calls:
        (seconds of the first calls, host seconds per call, device ms per call)."""
        cp, st = self.cp, self.stream
        n = len(calls)
        t0 = time.perf_counter()
        for c in calls:              # every set once: loads, compiles, allocator warm-up
            c()
        for i in range(3):
            calls[i % n]()
        st.synchronize()
        first_s = time.perf_counter() - t0
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(st)
        for i in range(4):
            calls[i % n]()
        e1.record(st)
        e1.synchronize()
        per_ms = max(cp.cuda.get_elapsed_time(e0, e1) / 4, 1e-3)
        for i in range(min(20000, int(WARMUP_MS / per_ms) + 1)):   # WARMUP_MS of device time
            calls[i % n]()
        st.synchronize()
        t0 = time.perf_counter()     # host enqueue time per call (the queue does not fill in 8 calls)
        for i in range(8):
            calls[i % n]()
        host_s = (time.perf_counter() - t0) / 8
        st.synchronize()
        return first_s, host_s, per_ms

    def measure_turns(self, contenders) -> list:
        """One stats dict per contender (a list of zero-arg calls each, cycled over), the contenders
        timed in turns: a batch of one (at most TURN_MS of device time), then one of the next, ...
        until each has ``samples``. A ratio between contenders (skuforge against its PyTorch
        reference) is then taken at one clock and temperature of the GPU, not at two moments of a run
        whose clocks drift by a few percent."""
        cp, st = self.cp, self.stream
        warm = [self._warm(calls) for calls in contenders]
        turn = len(contenders) > 1          # one contender: batches as long as the enqueue allows
        batch = [max(1, min(self.samples, int(0.02 / max(host_s, 1e-6)),
                            int(TURN_MS / per_ms) + 1 if turn else self.samples))
                 for _, host_s, per_ms in warm]
        events = [[(cp.cuda.Event(), cp.cuda.Event()) for _ in range(b)] for b in batch]
        times = [[] for _ in contenders]
        done = [0] * len(contenders)
        start = time.perf_counter()
        while any(len(t) < self.samples for t in times):
            for k, calls in enumerate(contenders):
                b = min(batch[k], self.samples - len(times[k]))
                if b <= 0:
                    continue
                host_s = warm[k][1]
                self.spin_ns(min(5e7, b * host_s * 1.5e9 + 2e4))   # keeps the GPU busy while we enqueue
                for j in range(b):
                    e0, e1 = events[k][j]
                    e0.record(st)
                    calls[done[k] % len(calls)]()
                    e1.record(st)
                    done[k] += 1
                events[k][b - 1][1].synchronize()
                times[k] += [cp.cuda.get_elapsed_time(e0, e1) for e0, e1 in events[k][:b]]
            if time.perf_counter() - start > self.max_seconds and all(len(t) >= 10 for t in times):
                break
        out = []
        for (first_s, host_s, _), t in zip(warm, times):
            r = stats(t)
            r["first_call_s"] = round(first_s, 3)
            r["host_us"] = round(host_s * 1e6, 2)
            out.append(r)
        return out


def copy_bandwidth(timer: "Timer", nbytes_: int = COPY_BYTES) -> dict:
    """cudaMemcpyAsync device to device of ``nbytes_`` (random bytes): GB/s counting read + write."""
    cp = timer.cp
    bufs = {"src": cp.random.randint(1, 255, size=nbytes_, dtype=cp.uint8)}
    bufs["dst"] = cp.empty_like(bufs["src"])
    m = timer.measure([lambda: bufs["dst"].data.copy_from_device_async(bufs["src"].data, nbytes_, timer.stream)])
    bufs.clear()
    cp.get_default_memory_pool().free_all_blocks()
    return {"bytes": nbytes_, "ms": m["ms"], "gbps": gbps(2 * nbytes_, m["ms"]), "samples": m["samples"],
            "method": "cudaMemcpyAsync device-to-device; bytes = read + written"}


class TorchBaselines:
    """Eager and ``torch.compile`` (fullgraph, static shapes) of a workload's composite."""

    def __init__(self, compile_: bool):
        import torch
        self.torch = torch
        self.compile = compile_
        self.compiled, self.failures, self.skipped = {}, {}, {}
        if compile_:
            import torch._dynamo as dynamo
            cfg = dynamo.config
            for name in ("cache_size_limit", "recompile_limit"):
                if hasattr(cfg, name):
                    setattr(cfg, name, 4096)          # one graph per dtype/shape: never fall back to eager
            for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
                if hasattr(cfg, name):
                    setattr(cfg, name, 1 << 16)
            if hasattr(cfg, "fail_on_recompile_limit_hit"):
                cfg.fail_on_recompile_limit_hit = True

    def agreement(self, ours, theirs):
        """Elements where the skuforge result and the eager composite differ (NaN == NaN); None if
        they cannot be compared (not both torch tensors of one shape and dtype)."""
        torch = self.torch
        if isinstance(ours, (tuple, list)) and isinstance(theirs, (tuple, list)) and len(ours) == len(theirs):
            parts = [self.agreement(a, b) for a, b in zip(ours, theirs) if a is not None or b is not None]
            return None if not parts or None in parts else sum(parts)
        if not (isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor)) \
                or ours.shape != theirs.shape or ours.dtype != theirs.dtype:
            return None
        diff = ours != theirs
        if ours.is_floating_point():
            diff &= ~(torch.isnan(ours) & torch.isnan(theirs))
        return int(diff.sum().item())

    def eager_calls(self, sets):
        calls = []
        for w in sets:
            if w.get("torch_fn") is not None:
                calls.append(lambda f=w["torch_fn"], a=tuple(w.get("torch_args", ())): f(*a))
            elif w.get("torch_eager") is not None:
                calls.append(w["torch_eager"])
            else:
                return None
        return calls

    def graphs(self) -> int:
        try:
            from torch._dynamo.utils import counters
            return int(counters["stats"]["unique_graphs"])
        except Exception:  # noqa: BLE001 - an internal counter; without it, assume no recompiles
            return 0

    def recompiles(self, calls) -> bool:
        """True when the second input set makes Dynamo compile again (a composite that takes
        per-set Python numbers is specialised on them); both calls also serve as warm-up."""
        calls[0]()
        before = self.graphs()
        calls[1]()
        return self.graphs() > before

    def compile_failed(self, fn, error: str):
        """After 2 failed compiles of one composite (e.g. an op Dynamo cannot trace, or no C compiler
        for Triton), later results of that composite record why instead of failing again."""
        n = self.failures.get(fn, 0) + 1
        self.failures[fn] = n
        if n >= 2:
            self.skipped[fn] = f"skipped: torch.compile of this composite failed twice; last: {error}"

    def compiled_calls(self, sets):
        if not self.compile:
            return None
        calls = []
        for w in sets:
            fn = w.get("torch_fn") or w.get("torch_eager")
            if fn is None:
                return None
            if fn in self.skipped:
                raise RuntimeError(self.skipped[fn])
            cfn = self.compiled.get(fn)
            if cfn is None:
                cfn = self.compiled[fn] = self.torch.compile(fn, fullgraph=True, dynamic=False)
            args = tuple(w.get("torch_args", ())) if w.get("torch_fn") is not None else ()
            calls.append(lambda f=cfn, a=args: f(*a))
        return calls


def error_text(e: BaseException, limit: int = 600) -> str:
    """One line: the exception type and the last lines of its message (where the cause usually is)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = " | ".join(lines[:1] + lines[-4:] if len(lines) > 5 else lines)
    return f"{type(e).__name__}: {text}"[:limit]


def no_gpu() -> Optional[str]:
    """Why the GPU commands cannot run here (no CuPy, no driver, no device), or None."""
    try:
        import cupy as cp
        if cp.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no CUDA device")
    except Exception as e:  # noqa: BLE001 - any failure to reach a device is the answer
        return f"{type(e).__name__}: {e}"
    return None


def _free():
    import cupy as cp
    cp.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


HOST_SHAPE = (16, 4096)


def api_host_calls(device: int = 0) -> list:
    """Repeated calls of each functional API that has a fast path on (16, 4096) inputs (target: TARGET_HOST_US per call):
    quantize / dequantize / fake_quantize (channel, axis 0) / dynamic_quantize (token), bf16 data
    and float32 scales, quantize and dynamic_quantize also into preallocated outputs (``out=``),
    with CuPy arrays and (when importable) torch tensors, default settings; then the MoE calls
    (:func:`moe_host_calls`). Items as ``host_calls()``."""
    import cupy as cp
    import ml_dtypes

    import runtime as sf
    rows, cols = HOST_SHAPE
    with cp.cuda.Device(device):
        x = (cp.random.standard_normal(HOST_SHAPE, dtype=cp.float32) * 3).astype(ml_dtypes.bfloat16)
        data = {"cupy": dict(x=x, s=cp.random.random(rows, dtype=cp.float32) + 0.5,
                             q=cp.random.randint(-128, 128, HOST_SHAPE).astype(cp.int8),
                             qo=cp.empty(HOST_SHAPE, cp.int8), so=cp.empty(rows, cp.float32))}
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            torch = None
    if torch is not None and torch.cuda.is_available():
        dev = f"cuda:{device}"
        data["torch"] = dict(x=torch.randn(HOST_SHAPE, device=dev, dtype=torch.bfloat16) * 3,
                             s=torch.rand(rows, device=dev) + 0.5,
                             q=torch.randint(-128, 128, HOST_SHAPE, device=dev, dtype=torch.int8),
                             qo=torch.empty(HOST_SHAPE, device=dev, dtype=torch.int8),
                             so=torch.empty(rows, device=dev, dtype=torch.float32))
    shape = f"({rows}, {cols})"
    calls = (("quantize token bf16->s8", lambda d: sf.quantize(d["x"], d["s"], scope="token", out_dtype="int8")),
             ("dequantize token s8->bf16",
              lambda d: sf.dequantize(d["q"], d["s"], scope="token", out_dtype="bfloat16")),
             ("fake_quantize channel bf16", lambda d: sf.fake_quantize(d["x"], d["s"], scope="channel", axis=0)),
             ("dynamic_quantize token bf16->s8", lambda d: sf.dynamic_quantize(d["x"], scope="token")),
             # preallocated outputs: what a call costs without its allocations
             ("quantize token bf16->s8, out=",
              lambda d: sf.quantize(d["x"], d["s"], scope="token", out_dtype="int8", out=d["qo"])),
             ("dynamic_quantize token bf16->s8, out=",
              lambda d: sf.dynamic_quantize(d["x"], scope="token", out=(d["qo"], d["so"]))))
    out = []
    for fw, d in data.items():
        for name, call in calls:
            def default(call=call, d=d):
                return call(d)
            out.append({"label": f"{name} {shape}, {fw}, default settings", "framework": fw, "call": default})
        for name, call in calls:
            if name not in ("quantize token bf16->s8", "dynamic_quantize token bf16->s8"):
                continue
            out.append({"label": f"{name} {shape}, {fw}, default settings, results kept", "framework": fw,
                        "call": kept_results(call, d)})
    if "torch" in data:
        out += custom_op_host_calls(data["torch"], shape)
    return out + moe_host_calls(device, torch)



def custom_op_host_calls(d: dict, shape: str) -> list:
    """The same calls through runtime.torch in eager mode: its public functions, which call the
    op's CUDA implementation directly where the dispatcher would do nothing else (the target
    applies), and, without a target (PyTorch's cost, docs/torch.md), through the dispatcher:
    ``torch.ops.skuforge`` called as such, and the public function on a tensor that requires grad
    (the custom op's autograd wrapper records the gradient)."""
    import torch

    import runtime.torch as sft
    sk = torch.ops.skuforge
    xg = d["x"].detach().clone().requires_grad_(True)
    calls = (("quantize token bf16->s8", lambda: sft.quantize(d["x"], d["s"], scope="token", out_dtype="int8")),
             ("dequantize token s8->bf16",
              lambda: sft.dequantize(d["q"], d["s"], scope="token", out_dtype="bfloat16")),
             ("dynamic_quantize token bf16->s8", lambda: sft.dynamic_quantize(d["x"], scope="token")),
             ("quantize token bf16->s8, out=",
              lambda: sft.quantize(d["x"], d["s"], scope="token", out_dtype="int8", out=d["qo"])))
    dispatched = (("quantize token bf16->s8", lambda: sk.quantize(d["x"], d["s"], None, "token")),
                  ("dynamic_quantize token bf16->s8", lambda: sk.dynamic_quantize(d["x"], "token")),
                  ("fake_quantize channel bf16, x requires grad",
                   lambda: sft.fake_quantize(xg, d["s"], scope="channel", axis=0)))
    return ([{"label": f"{name} {shape}, runtime.torch (eager), default settings", "framework": "runtime.torch",
              "call": call} for name, call in calls]
            + [{"label": f"{name} {shape}, torch.ops.skuforge dispatcher (eager), default settings",
                "framework": "torch.ops", "call": call, "target": False} for name, call in dispatched])


MOE_HOST_SHAPE = (256, 512, 512, 8)     # M, N, K, E


def moe_host_calls(device: int = 0, torch=None) -> list:
    """Repeated grouped_matmul / grouped_matmul_backward calls (M=256, N=K=512, E=8, bf16 for torch,
    f16 for CuPy, unsorted row_experts: three routing launches + one product per pass), with and
    without ``out=`` (``out=`` alone allocates the routing workspace; with ``workspace=`` too, nothing),
    CuPy and (when available) torch; and with offsets routing (one routing launch; on an H100 / H200 the
    wgmma kernels, whose replay looks their tensor maps up by address).
    Target: 10 µs plus 3 µs per launch beyond the first (``target_us``)."""
    import cupy as cp
    import numpy as np

    import runtime as sf
    M, N, K, E = MOE_HOST_SHAPE
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(s).astype(np.float32) for s in ((M, K), (E, N, K), (M, N))]
    ids = rng.integers(0, E, M).astype(np.int32)
    offs = np.searchsorted(np.sort(ids), np.arange(E + 1)).astype(np.int32)
    ws_size = sf.moe.grouped_matmul_workspace_size(M, E, "row_experts")
    data = {}
    with cp.cuda.Device(device):
        x, w, dy = (cp.asarray(h.astype(np.float16)) for h in host)
        data["cupy"] = dict(x=x, w=w, dy=dy, ids=cp.asarray(ids), offs=cp.asarray(offs), y=cp.empty((M, N), cp.float16),
                            dx=cp.empty((M, K), cp.float16), dw=cp.empty((E, N, K), cp.float32),
                            ws=cp.empty(ws_size, cp.uint8))
    if torch is not None and torch.cuda.is_available():
        dev = f"cuda:{device}"
        x, w, dy = (torch.tensor(h, device=dev).to(torch.bfloat16) for h in host)
        data["torch"] = dict(x=x, w=w, dy=dy, ids=torch.tensor(ids, device=dev), offs=torch.tensor(offs, device=dev),
                             y=torch.empty((M, N), device=dev, dtype=torch.bfloat16),
                             dx=torch.empty((M, K), device=dev, dtype=torch.bfloat16),
                             dw=torch.empty((E, N, K), device=dev, dtype=torch.float32),
                             ws=torch.empty(ws_size, device=dev, dtype=torch.uint8))
    calls = (("grouped_matmul", 4, lambda d: sf.grouped_matmul(d["x"], d["w"], row_experts=d["ids"])),
             ("grouped_matmul_backward", 5,
              lambda d: sf.grouped_matmul_backward(d["x"], d["w"], d["dy"], row_experts=d["ids"])),
             ("grouped_matmul, out=", 4,
              lambda d: sf.grouped_matmul(d["x"], d["w"], row_experts=d["ids"], out=d["y"])),
             ("grouped_matmul_backward, out=", 5,
              lambda d: sf.grouped_matmul_backward(d["x"], d["w"], d["dy"], row_experts=d["ids"],
                                                   out=(d["dx"], d["dw"]))),
             ("grouped_matmul, out= workspace=", 4,
              lambda d: sf.grouped_matmul(d["x"], d["w"], row_experts=d["ids"], out=d["y"], workspace=d["ws"])),
             ("grouped_matmul_backward, out= workspace=", 5,
              lambda d: sf.grouped_matmul_backward(d["x"], d["w"], d["dy"], row_experts=d["ids"],
                                                   out=(d["dx"], d["dw"]), workspace=d["ws"])))
    by_offsets = (("grouped_matmul", 2, lambda d: sf.grouped_matmul(d["x"], d["w"], offsets=d["offs"])),
                  ("grouped_matmul_backward", 3,
                   lambda d: sf.grouped_matmul_backward(d["x"], d["w"], d["dy"], offsets=d["offs"])),
                  ("grouped_matmul, out= workspace=", 2,
                   lambda d: sf.grouped_matmul(d["x"], d["w"], offsets=d["offs"], out=d["y"], workspace=d["ws"])))
    out = []
    for fw, d in data.items():
        for routing, items in (("row_experts", calls), ("offsets", by_offsets)):
            for name, launches, call in items:
                def default(call=call, d=d):
                    return call(d)
                out.append({"label": f"{name} {routing} (M={M}, N={N}, K={K}, E={E}), {fw}, default settings",
                            "framework": fw, "call": default, "launches": launches})
        name, launches, call = by_offsets[0]
        out.append({"label": f"{name} offsets (M={M}, N={N}, K={K}, E={E}), {fw}, default settings, results kept",
                    "framework": fw, "call": kept_results(call, d), "launches": launches})
    if "torch" in data:
        import runtime.torch as sft
        d = data["torch"]
        out.append({"label": f"grouped_matmul row_experts (M={M}, N={N}, K={K}, E={E}), runtime.torch (eager), "
                             "default settings", "framework": "runtime.torch", "launches": 4,
                    "call": lambda: sft.grouped_matmul(d["x"], d["w"], row_experts=d["ids"])})
    return out


def host_items(timer: "Timer", modules, api: bool = True, device: int = 0):
    """(items, errors): the bare CuPy launch floor, every module's ``host_calls()`` and (``api``)
    :func:`api_host_calls` not already measured under the same label."""
    errors = []
    items = [dict(label="cupy RawKernel launch (floor)", framework="cupy", call=lambda: timer.spin_ns(0))]
    try:                      # the driver's own launch, as the runtime makes it (runtime.device.bind_launch)
        from runtime.device import bind_launch
        go, stream = bind_launch(timer.spin.kernel, (1,), (1,), "Q"), timer.stream.ptr
        items.append(dict(label="driver launch, runtime.device.bind_launch (floor)", framework="cupy",
                          call=lambda: go(stream, (0,))))
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        errors.append({"label": "driver launch floor", "error": f"{type(e).__name__}: {e}", "us": None, "min_us": None})
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        a = torch.randn(16, 4096, device=f"cuda:{device}", dtype=torch.bfloat16)
        items.append(dict(label="torch eager add (16, 4096) bf16 (reference)", framework="torch",
                          call=lambda: torch.add(a, a), target=False))
    sources = [(f"{m.__name__}.host_calls()", m.host_calls) for m in modules if hasattr(m, "host_calls")]
    if api:
        sources.append(("codegen.harness.bench.api_host_calls()", lambda: api_host_calls(device)))
    for name, get in sources:
        try:
            seen = {i["label"] for i in items}
            items += [i for i in get() if i["label"] not in seen]
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            errors.append({"label": name, "error": f"{type(e).__name__}: {e}", "us": None, "min_us": None})
    return items, errors


HOST_BUSY_NS = 60_000_000       # the spin kernel the host-only calls are queued behind
HOST_QUEUE = 600                # launches queued behind it at most (the driver's queue holds about a thousand)


def time_host_calls(items, synchronize, n_calls: int = 2000, repeats: int = 5, busy=None) -> list:
    """µs per call of each item's ``call``, after 200 warm-up calls.

    ``throughput_us``: ``n_calls`` back-to-back calls and a synchronize, timed together (also
    bounded by the GPU's launch rate and the kernels), the median of ``repeats``. ``us``: with
    ``busy``, the host's own time per call (what a caller's thread pays: Python, allocation, the
    driver's launch), the median of at least 7 batches, each queued behind a ``busy(ns)`` spin
    kernel so that the launch queue neither drains nor fills; the batches are taken in rounds over
    all items (one batch of each item per round), so that a slow spell of the host (its speed
    drifts within a run) weighs on every row alike, the floors included. Without ``busy``,
    ``us`` is ``throughput_us``."""
    out, timed = [], []
    for item in items:
        call = item["call"]
        try:
            for _ in range(200):
                call()
            synchronize()
            per = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(n_calls):
                    call()
                synchronize()
                per.append((time.perf_counter() - t0) / n_calls * 1e6)
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            out.append({"label": item["label"], "error": f"{type(e).__name__}: {e}", "us": None, "min_us": None})
            continue
        r = {"label": item["label"], "framework": item.get("framework"), "throughput_us": statistics.median(per),
             "calls": n_calls, "repeats": repeats}
        if busy is None:
            r.update(us=r["throughput_us"], min_us=min(per), measure="throughput")
        if item.get("target", True) and "floor" not in item["label"]:
            r["target_us"] = TARGET_HOST_US + EXTRA_LAUNCH_US * (item.get("launches", 1) - 1)
        out.append(r)
        timed.append((item, r, []))
    if busy is not None:
        for _ in range(max(repeats, 7)):
            for item, r, host in timed:
                if "error" in r:
                    continue
                call, n_host = item["call"], max(10, HOST_QUEUE // item.get("launches", 1))
                try:
                    busy(HOST_BUSY_NS)
                    t0 = time.perf_counter()
                    for _ in range(n_host):
                        call()
                    host.append((time.perf_counter() - t0) / n_host * 1e6)
                    synchronize()
                except Exception as e:  # noqa: BLE001 - recorded, not fatal
                    r.clear()
                    r.update(label=item["label"], error=f"{type(e).__name__}: {e}", us=None, min_us=None)
                    continue
                r["host_calls"] = n_host
        for _, r, host in timed:
            if "error" not in r:
                r.update(us=statistics.median(host), min_us=min(host), measure="host")
    return out


def measure_host(timer: "Timer", modules, n_calls: int = 2000, repeats: int = 5, api: bool = True,
                 device: int = 0) -> list:
    """µs per call of repeated functional-API calls (host clock; kernels and plans cached)."""
    items, errors = host_items(timer, modules, api, device)
    return errors + time_host_calls(items, timer.stream.synchronize, n_calls, repeats, busy=timer.spin_ns)


def run_one(timer, baselines, sku, module, shape, l2: int, copy_gbps: float, sha: str,
            compile_this: bool = True, ceiling: Optional[dict] = None) -> Optional[dict]:
    w0 = module.make(sku, shape)
    if w0 is None:
        return None
    footprint = w0.get("footprint") or w0.get("bytes") or 0
    n = rotation_sets(footprint, l2) if footprint else 1
    sets = [w0] + [module.make(sku, shape) for _ in range(n - 1)]
    r = {"sku": str(sku), "sha256": sha, "op": sku.op, "scope": sku.scope, "mode": sku.mode,
         "element": sku.element, "aux_element": sku.aux_element, "shape": list(shape) if isinstance(shape, tuple) else shape,
         "label": w0.get("label") or str(sku), "bytes": w0.get("bytes"), "flops": w0.get("flops"), "sets": n,
         "date": now()}
    r.update(target_for(module, sku, shape))
    sched = schedule_of(sku, shape)
    if sched:
        r["schedule"] = sched
    ref = [w["torch_ref"] for w in sets] if baselines is not None and w0.get("torch_ref") is not None else None
    if ref is None:
        r["skuforge"] = timer.measure([w["call"] for w in sets])
    else:                   # a library reference (torch._grouped_mm): timed in turns with ours
        try:
            r["skuforge"], r["torch_ref"] = timer.measure_turns([[w["call"] for w in sets], ref])
        except Exception as e:  # noqa: BLE001 - a reference that fails is recorded, not fatal
            r["skuforge"] = timer.measure([w["call"] for w in sets])
            r["torch_ref"] = {"error": error_text(e)}
    if baselines is not None and w0.get("torch_fn") is not None:
        r["mismatches_vs_eager"] = baselines.agreement(w0["call"](), w0["torch_fn"](*w0.get("torch_args", ())))
    if baselines is not None:
        for name, get in (("torch_eager", baselines.eager_calls), ("torch_compile", baselines.compiled_calls)):
            if name == "torch_compile" and not compile_this:
                continue
            try:
                calls = get(sets)
                if calls is not None and name == "torch_compile" and len(calls) > 1 and baselines.recompiles(calls):
                    calls = calls[:1]    # guards on per-set Python scalars: one graph per set would be timed
                    r["torch_compile_note"] = "the compiled composite recompiles per input set: timed on one set"
                if calls is not None:
                    r[name] = timer.measure(calls)
            except Exception as e:  # noqa: BLE001 - a baseline that fails is recorded, not fatal
                r[name] = {"error": error_text(e)}
                if name == "torch_compile" and not str(e).startswith("skipped:"):
                    baselines.compile_failed(w0.get("torch_fn") or w0.get("torch_eager"), r[name]["error"])
    del sets, w0
    # % of copy is taken against a copy of the same number of bytes ("a device copy of the
    # same bytes"), so launch ramp and tail count alike on both sides; shapes that fit in
    # 4 x L2 use the peak copy. The peak (1 GiB) copy stays in the record as `pct_copy_peak`.
    ref_gbps = copy_gbps
    if r.get("bytes") and r["bytes"] >= 4 * l2:
        same = same_size_copy(timer, int(r["bytes"]))
        r["copy_same"] = same
        ref_gbps = same["gbps"]
    out = finish(r, ref_gbps)
    if out.get("gbps"):
        out["pct_copy_peak"] = pct(out["gbps"], copy_gbps)
    out["copy_peak_gbps"] = copy_gbps
    if ceiling and out.get("tflops"):
        out["pct_ceiling"] = pct(out["tflops"], ceiling["tflops"])
        out["ceiling_tflops"] = ceiling["tflops"]
    return out


def schedule_of(sku, shape) -> Optional[str]:
    """The schedule variant a call of ``sku`` at ``shape`` runs on the current device (runtime/tuning.py),
    or None for a kind with one way to launch."""
    from runtime import tuning
    from runtime.device import current_device, properties
    from runtime.plans import Plan
    from runtime.errors import DeviceRequiredError
    if not isinstance(shape, (tuple, list)):
        return None
    try:
        cc = properties(current_device())["cc"]
    except DeviceRequiredError:         # a run without a device (the harness's own tests): not known
        return None
    return tuning.choose(Plan(sku), math.prod(shape), cc)[0]


_SAME_COPY: dict = {}


def same_size_copy(timer, nbytes_: int) -> dict:
    """A device copy moving ``nbytes_`` in total (half read, half written), measured once per size."""
    if nbytes_ not in _SAME_COPY:
        _SAME_COPY[nbytes_] = copy_bandwidth(timer, max(1, nbytes_ // 2))
    return _SAME_COPY[nbytes_]


def cmd_bench(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from runtime.registry import Registry

    from ..manifest import GENERATED
    from ..terminal import console as new_console
    console = new_console(stderr=True)
    reg = Registry.load(GENERATED)
    skus = [s for s in reg.skus() if fnmatch.fnmatchcase(str(s), args.filter)]
    modules = workload_modules(lambda m: console.print(f"[yellow]{m}[/yellow]"))
    shapes = parse_shapes(args.shapes) if args.shapes else None
    todo = plan(skus, modules, all_skus=args.all, shapes=shapes, quick=args.quick)
    if not todo:
        console.print(f"bench: nothing to run for --filter {args.filter!r} "
                      f"(modules: {', '.join(m.__name__ for m in modules) or 'none'}; try --all)")
        return 2
    missing = no_gpu()
    if missing:
        console.print(f"bench: needs a CUDA GPU ({missing}); nothing recorded")
        return 2
    import cupy as cp
    import os

    from .verify import _precompile, environment
    cp.cuda.Device(args.device).use()
    env = environment(args.device)
    cc = int(env["gpu"]["cc"].replace(".", ""))
    todo = [t for t in todo if t[0].runs_on(cc)]      # arch-specific SKUs (sm_90a) run on their own arch only
    if not todo:
        console.print(f"bench: no selected SKU runs on sm_{cc}")
        return 2
    t0 = time.perf_counter()      # NVRTC for every unit in parallel first (else serially on first calls)
    _precompile(reg, sorted({sku for sku, _, _ in todo}), int(env["gpu"]["cc"].replace(".", "")), os.cpu_count() or 1)
    console.print(f"compiled units in {time.perf_counter() - t0:.1f} s")
    baselines = None
    if not args.no_torch:
        try:
            import torch
            torch.cuda.set_device(args.device)
            torch.cuda.init()
            baselines = TorchBaselines(compile_=not args.no_compile)
            env["torch"] = torch.__version__
        except ImportError:
            console.print("torch is not importable: no PyTorch baselines")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        from runtime.arrays import cupy_stream
        stream = cupy_stream(torch.cuda.current_stream().cuda_stream, args.device)
    else:
        stream = cp.cuda.get_current_stream()
    l2 = int(cp.cuda.Device(args.device).attributes.get("L2CacheSize", 64 << 20))
    env["gpu"]["l2_mib"] = round(l2 / 2**20, 1)
    git = git_info()
    samples = args.samples or (20 if args.quick else 100)
    results, host = [], []
    t_start = time.perf_counter()
    with stream:
        timer = Timer(stream, samples, 0.25)
        copy = copy_bandwidth(timer)
        console.print(f"bench on {env['gpu']['name']}: device copy {copy['gbps']:.0f} GB/s; L2 {l2 / 2**20:.0f} MiB; "
                      f"{len(todo)} runs ({samples} samples each); torch {env.get('torch', 'absent')}"
                      f"{', no torch.compile' if args.no_compile else ''}")
        ceilings = {}
        for m in {id(m): m for _, m, _ in todo}.values():
            if hasattr(m, "ceiling"):
                try:
                    ceilings[m.__name__.rsplit(".", 1)[-1]] = m.ceiling(timer)
                except Exception as e:  # noqa: BLE001 - a ceiling that cannot run is reported, not fatal
                    console.print(f"[red]ceiling of {m.__name__}: {type(e).__name__}: {e}[/red]")
        for name, c in ceilings.items():
            console.print(f"ceiling ({name}): {c['name']}: {c['tflops']:.0f} TFLOP/s")
        if not args.no_host:
            host = measure_host(timer, modules, device=args.device)
            for h in host:
                console.print(f"host overhead {h['label']}: {h['us']:.1f} µs per call (throughput {h['throughput_us']:.1f})" if "error" not in h
                              else f"host overhead {h['label']}: [red]{h['error']}[/red]")
        cols = (TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[what]}"))
        interrupted = False
        with Progress(*cols, console=console) as progress:
            task = progress.add_task("bench", total=len(todo), what="")
            try:
                for sku, module, shape in todo:
                    progress.update(task, what=f"{sku.op} {sku.scope} {sku.element}->{sku.aux_element} {shape_key(shape)}")
                    try:
                        r = run_one(timer, baselines, sku, module, shape, l2, copy["gbps"],
                                    reg.manifest["kernels"][str(sku)]["sha256"],
                                    compile_this=args.all or args.compile_all
                                    or bool({sku.element, sku.aux_element} & DEFAULT_COMPILE_KINDS),
                                    ceiling=ceilings.get(module.__name__.rsplit(".", 1)[-1]))
                    except Exception as e:  # noqa: BLE001 - a kernel that cannot run is reported, not fatal
                        console.print(f"[red]bench {sku} {shape_key(shape)}: {type(e).__name__}: {e}[/red]")
                        r = None
                    finally:
                        _free()
                    if r is not None:
                        results.append(r)
                        progress.console.print(
                            f"{r['op']:<12} {r['label']:<40} {shape_key(r['shape']):>11} "
                            + (f"{r['gbps']:7.0f} GB/s {r['pct_copy']:5.1f}% copy" if r.get("bytes") else
                               f"{r.get('tflops', 0):7.1f} TFLOP/s")
                            + "".join(f"  ×{r[k]:.2f} {n}" for k, n in (("speedup_eager", "eager"),
                                                                       ("speedup_compile", "compile"),
                                                                       ("speedup_ref", "ref")) if r.get(k))
                            + (f"  [red]{r['mismatches_vs_eager']} elements differ from eager[/red]"
                               if r.get("mismatches_vs_eager") else ""))
                    progress.advance(task)
            except KeyboardInterrupt:
                interrupted = True
    run = {"date": now(), **git, "filter": args.filter, "all": bool(args.all), "quick": bool(args.quick),
           "samples": samples, "runs": len(results), "seconds": round(time.perf_counter() - t_start, 1),
           "interrupted": interrupted}
    steps = []
    if args.examples:
        from .steps import measure_example_steps
        steps = measure_example_steps(args.device, log=console.print)
    if not results and not host and not steps:
        console.print("bench: no result; nothing recorded")
        return 1
    folder = Path(args.records) / "bench"
    name = slug(env["gpu"]["name"])
    path = folder / f"{name}.json"
    rec = merge(read_json(path), env, run, results, host, copy, steps)
    if ceilings:
        rec["ceilings"] = {**(rec.get("ceilings") or {}), **ceilings}
    write_json(path, rec)
    (folder / f"{name}.md").write_text(to_markdown(rec))
    png = chart(rec, folder / f"{name}.png")
    console.print(f"recorded {len(results)} results in {path}, {folder / (name + '.md')}"
                  + (f", {png}" if png else " (no matplotlib: no chart)") + f" in {run['seconds']} s")
    for what, val, want, ok, note in targets(rec):
        console.print(f"{'[green]ok[/green]  ' if ok else '[red]MISS[/red]'} {what}: {val:.2f} (want {want:g}) {note}")
    return 130 if interrupted else 0


TARGET_KEYS = ("target_pct", "target_ref", "target_shapes", "no_target", "target_us", "target_us_note")


def refresh_targets(rec: dict, modules) -> int:
    """Re-derive every result's targets from the workload modules as they are now (targets are
    copied into each result when it is measured); returns how many results changed."""
    from runtime.sku import KernelSku
    changed = 0
    for r in rec.get("results") or []:
        try:
            sku = KernelSku.parse(r["sku"])
        except Exception:  # noqa: BLE001 - a record of a SKU that no longer parses keeps its targets
            continue
        m = module_for(sku, modules)
        if m is None:
            continue
        new = target_for(m, sku, r.get("shape"))
        old = {k: r[k] for k in TARGET_KEYS if k in r}
        if old != new:
            for k in TARGET_KEYS:
                r.pop(k, None)
            r.update(new)
            changed += 1
    return changed


def cmd_render(args) -> int:
    """``bench --render``: rewrite every GPU's bench JSON (targets refreshed from the modules),
    Markdown table and chart from the records alone: no GPU, no measurement."""
    folder = Path(args.records) / "bench"
    paths = sorted(folder.glob("*.json"))
    if not paths:
        print(f"bench --render: no record in {folder}")
        return 2
    modules = workload_modules()
    for path in paths:
        rec = read_json(path)
        n = refresh_targets(rec, modules)
        write_json(path, rec)
        path.with_suffix(".md").write_text(to_markdown(rec))
        png = chart(rec, path.with_suffix(".png"))
        print(f"rendered {path.with_suffix('.md')}" + (f", {png}" if png else " (no matplotlib: no chart)")
              + f"; {n} results with refreshed targets")
    return 0


def add_parser(sub) -> None:
    sp = sub.add_parser("bench", help="bandwidth of the selected SKUs vs device copy and PyTorch (needs a GPU)",
                        description="Time the selected SKUs on a GPU against a device-to-device copy and PyTorch "
                                    "(eager, torch.compile); writes RECORDS/bench/<gpu>.json, .md and .png. "
                                    "Method, default selection and workload modules: docs/audit.md.")
    sp.add_argument("--filter", default="*", help="glob on the SKU string")
    sp.add_argument("--all", action="store_true",
                    help="every selected SKU on the four standard shapes with every baseline (default: a subset "
                         "per op, docs/audit.md)")
    sp.add_argument("--shapes", help="elementwise shapes, e.g. 8192x8192,16x4096 (for every selected SKU)")
    sp.add_argument("--quick", action="store_true", help="two shapes, 20 samples: a smoke run")
    sp.add_argument("--samples", type=int, default=0, help="timed calls per measurement (default 100)")
    sp.add_argument("--no-torch", action="store_true", help="skip the PyTorch baselines")
    sp.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    sp.add_argument("--compile-all", action="store_true",
                    help="torch.compile baseline for every SKU (default: bf16 ones only, to bound compile time)")
    sp.add_argument("--no-host", action="store_true", help="skip the host-overhead measurement")
    sp.add_argument("--examples", action="store_true",
                    help="also time the examples' steps (skuforge eager / compiled vs plain PyTorch eager / compiled; "
                         "needs PyTorch with CUDA and the source tree's examples/)")
    sp.add_argument("--device", type=int, default=0, help="CUDA device ordinal to measure on (default 0)")
    add_records_argument(sp)
    sp.add_argument("--render", action="store_true",
                    help="no GPU: rewrite the records' Markdown and chart, with targets refreshed from the modules")
    sp.set_defaults(func=lambda a: cmd_render(a) if a.render else cmd_bench(a))
