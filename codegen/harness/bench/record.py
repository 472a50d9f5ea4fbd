"""A GPU's bench record (``RECORDS/bench/<gpu>.json``): the derived figures of a result, a run
folded into the record, the targets a workload module declares for a SKU and their refresh, and the
targets checked on a record (docs/audit.md, "audit/bench/<gpu-slug>.json")."""
from __future__ import annotations

from typing import Optional

from ..families import module_for
from .timing import gbps, geomean, pct, tflops

SCHEMA = 1
# Targets (docs/audit.md, "audit/bench/<gpu-slug>.json"): every single-pass memory-bound op at >= 95 % of
# a copy of the same bytes from 4096 x 7168 up (the workload modules set 75 % for the two-pass scopes); never
# slower than torch.compile on any cell, and >= x1.1 over it in geometric mean per op.
TARGET_PCT: dict = {}                       # per op, where it differs from the default
DEFAULT_TARGET_PCT = 95.0
TARGET_SHAPES = ((4096, 7168), (4096, 14336), (8192, 8192), (65536, 4096), (131072, 4096))
TARGET_SPEEDUP_COMPILE = 1.1                # geomean over the measured shapes vs torch.compile
TARGET_MIN_SPEEDUP_COMPILE = 1.0            # every cell


def shape_key(shape) -> str:
    return "x".join(str(s) for s in shape) if isinstance(shape, (tuple, list)) else str(shape)


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
