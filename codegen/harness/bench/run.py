"""One workload measured: its L2-rotated input sets timed against the PyTorch baselines (or the
library reference in turns), a copy of the same bytes, and the result's derived figures and targets."""
from __future__ import annotations

import math
from typing import Optional

from ..records import now
from .baselines import error_text
from .record import finish, target_for
from .timing import pct, rotation_sets, same_size_copy


def run_one(timer, baselines, sku, module, shape, l2: int, copy_gbps: float, sha: str,
            compile_this: bool = True, ceiling: Optional[dict] = None) -> Optional[dict]:
    """The result of ``module``'s workload for ``sku`` at ``shape`` (None when ``make`` declines it):
    ours against the baselines, figures against a copy of the same bytes (its buffers L2-rotated),
    the module's targets, the schedule it ran."""
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
    # same bytes"), so launch ramp and tail count alike on both sides; its buffers rotate over as
    # many pairs as the kernel's input sets do (4 x L2), so neither side reads from L2. The peak
    # (1 GiB) copy stays in the record as `pct_copy_peak`.
    ref_gbps = copy_gbps
    if r.get("bytes"):
        same = same_size_copy(timer, int(r["bytes"]), l2)
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
