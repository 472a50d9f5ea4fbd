"""The Markdown page and the chart of a GPU's bench record (``RECORDS/bench/<gpu>.md`` and ``.png``)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .plan import STANDARD_SHAPES
from .record import DEFAULT_TARGET_PCT, shape_key, stand_ins, targets
from .steps import to_markdown as example_steps_markdown

CHART_MIN_BYTES = 64 << 20


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
             "run, its buffers rotated like the kernels' input sets (4 x L2); `pct_copy_peak` in the JSON is "
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
