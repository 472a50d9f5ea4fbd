"""``python -m codegen tune``: time every schedule variant of the selected SKUs per size bucket on a
GPU and write the arch's tuning table of the SKUs' family (``codegen/families/<family>/tuning/<arch>.json``;
docs/tuning.md).

For each SKU and each size bucket of runtime/tuning.py (one shape per bucket, :data:`BUCKET_SHAPES`)
every schedule the SKU declares is timed in turns with the others (the bench's timer: CUDA events,
L2-rotated input sets, one clock for all), and the fastest is chosen; the default stays unless
another is faster by more than :data:`MARGIN`. The entry records the times, the shape and the SKU,
under the SKU's own key and under its kind-and-sizes key (runtime.tuning.keys). The table names
the GPU and the commit; ``python -m codegen`` then folds its choices into the manifest.
"""
from __future__ import annotations

import fnmatch
import json
import time
from pathlib import Path

from runtime import tuning

from .bench.timing import Timer, free_memory, no_gpu, rotation_sets
from .families import module_for, tune_filters, workload_modules
from .records import git_info, now

# The shape each size bucket is measured at (runtime.tuning.BUCKETS): the benchmark's latency,
# small-prefill, mid and large shapes.
BUCKET_SHAPES = {"le128k": (16, 4096), "le2m": (128, 7168), "le32m": (4096, 7168), "gt32m": (8192, 8192)}
MARGIN = 0.01           # another schedule replaces the default only when faster by more than this
# The SKUs measured by default: each family's (codegen.harness.families): symmetric, bf16 on the float
# side, one code kind per kernel template (s8 for the 8-bit integer kernels, s4 for packed int4, fp8_e4m3
# for fp8); the others of the same launch kind and element sizes take their entries through the
# kind-and-sizes key.
DEFAULT_FILTERS = tune_filters()

# the order SKUs are measured in: the ops users call most first (an interrupted run keeps those)
OP_ORDER = ("dynamic_quantize", "quantize", "dequantize", "fake_quantize", "fake_quantize_backward",
            "quantize_backward", "dequantize_backward")


def selected(reg, filters, cc: int) -> list:
    """SKUs with schedule variants matching a filter that run on ``cc``; of those differing only in
    arch, the one a plan on this device picks (the highest arch it runs)."""
    best = {}
    for sku in reg.skus():
        if not reg.lookup(sku).launch.get("schedules") or not sku.runs_on(cc):
            continue
        if not any(fnmatch.fnmatchcase(str(sku), f) for f in filters):
            continue
        k = (sku.op, sku.scope, sku.mode, sku.element, sku.aux_element, sku.backend)
        if k not in best or best[k].arch < sku.arch:
            best[k] = sku
    order = {op: i for i, op in enumerate(OP_ORDER)}
    return sorted(best.values(), key=lambda s: (order.get(s.op, len(order)), str(s)))


def _under(name: str, call):
    from runtime.config import override

    def run():
        with override(schedule=name):
            return call()
    return run


def tune_one(timer, reg, sku, module, shape, l2: int) -> dict:
    """{schedule: median µs} of one SKU at one shape, every schedule timed in turns."""
    names = list(reg.lookup(sku).launch["schedules"])
    w0 = module.make(sku, shape)
    if w0 is None:
        return {}
    n = rotation_sets(w0.get("footprint") or w0.get("bytes") or 0, l2)
    sets = [w0] + [module.make(sku, shape) for _ in range(n - 1)]
    stats = timer.measure_turns([[_under(name, w["call"]) for w in sets] for name in names])
    return {name: round(s["ms"] * 1e3, 3) for name, s in zip(names, stats)}


def choose(times: dict, default: str) -> str:
    best = min(times, key=times.get)
    return default if times[default] <= times[best] * (1 + MARGIN) else best


def cmd_tune(args) -> int:
    from runtime.registry import Registry

    from ..manifest import GENERATED, tuning_folder
    from ..terminal import console as new_console
    from .verify import _precompile, environment
    console = new_console(stderr=True)
    missing = no_gpu()
    if missing:
        console.print(f"tune: needs a CUDA GPU ({missing}); nothing written")
        return 2
    import cupy as cp
    reg = Registry.load(GENERATED)
    cp.cuda.Device(args.device).use()
    env = environment(args.device)
    cc = int(env["gpu"]["cc"].replace(".", ""))
    skus = selected(reg, [args.filter] if args.filter else DEFAULT_FILTERS, cc)
    modules = workload_modules(lambda m: console.print(m))
    todo = [(s, module_for(s, modules)) for s in skus]
    todo = [(s, m) for s, m in todo if m is not None]
    if not todo:
        console.print("tune: no selected SKU with schedule variants and a workload runs here")
        return 1
    buckets = [b for b in BUCKET_SHAPES if not args.buckets or b in args.buckets.split(",")]
    _precompile(reg, [s for s, _ in todo], cc, 16)
    arch = tuning.arch_name(cc)
    families = sorted({s.category for s, _ in todo})
    if len(families) > 1:
        console.print(f"tune: the selection spans the families {', '.join(families)}; tune one at a time "
                      "(--filter): each family keeps its own table")
        return 2
    path = Path(args.out) if args.out else tuning_folder(families[0]) / f"{arch}.json"
    table = {"arch": arch, "entries": {}}
    if path.is_file():
        table = json.loads(path.read_text())
    table.update({"arch": arch, "gpu": env["gpu"]["name"], "commit": git_info().get("commit") or "unknown",
                  "date": now(), "samples": args.samples, "shapes": {b: list(BUCKET_SHAPES[b]) for b in buckets}})
    l2 = int(cp.cuda.Device(args.device).attributes.get("L2CacheSize", 64 << 20))
    stream = _stream(cp, args.device)
    t0 = time.perf_counter()
    with stream:
        timer = Timer(stream, args.samples, 0.2)
        for i, (sku, module) in enumerate(todo):
            plan_keys = tuning.keys(_plan(reg, sku))
            default = reg.lookup(sku).launch["default_schedule"]
            for b in buckets:
                times = tune_one(timer, reg, sku, module, BUCKET_SHAPES[b], l2)
                if not times:
                    continue
                pick = choose(times, default)
                # each entry names its GPU and commit: a table may hold entries of several runs
                entry = {"schedule": pick, "us": times, "shape": list(BUCKET_SHAPES[b]), "sku": str(sku),
                         "gpu": table["gpu"], "commit": table["commit"]}
                for key in plan_keys:
                    table["entries"].setdefault(key, {})[b] = entry
                console.print(f"[{i + 1}/{len(todo)}] {sku} {b}: {pick} "
                              f"({times[pick]:.2f} µs; default {default} {times[default]:.2f} µs)")
            free_memory()
            table["seconds"] = round(time.perf_counter() - t0, 1)
            _write(path, table)          # after every SKU: an interrupted run keeps what it measured
    console.print(f"wrote {path}: {len(todo)} SKUs x {len(buckets)} buckets in {table['seconds']} s; run "
                  "`python -m codegen` to fold it into the manifest")
    return 0


def _stream(cp, device: int):
    """The stream the workloads' calls run on, as bench times them: torch's current stream where the
    workloads make torch tensors (torch importable), else CuPy's."""
    try:
        import torch
    except ImportError:
        return cp.cuda.get_current_stream()
    from runtime.arrays import cupy_stream
    torch.cuda.set_device(device)
    torch.cuda.init()
    return cupy_stream(torch.cuda.current_stream().cuda_stream, device)


def _write(path: Path, table: dict) -> None:
    """The table, keys sorted, written atomically (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def _plan(reg, sku):
    from runtime.plans import Plan
    return Plan(sku, reg)


def add_parser(sub) -> None:
    sp = sub.add_parser("tune", help="time every schedule variant per size bucket on a GPU and write the arch's "
                                     "tuning table",
                        description="Time the schedule variants of the selected SKUs at one shape per size bucket "
                                    "(CUDA events, in turns) and write their family's table, "
                                    "codegen/families/<family>/tuning/<arch>.json (docs/tuning.md). Needs a GPU; "
                                    "`python -m codegen` then folds the table into the manifest.")
    sp.add_argument("--filter", default="", help="glob on the SKU string (default: bf16 / s8 / s4 / fp8_e4m3 "
                                                 "representatives of every kind with variants)")
    sp.add_argument("--buckets", default="", help=f"comma-separated size buckets (default all: "
                                                  f"{', '.join(BUCKET_SHAPES)})")
    sp.add_argument("--samples", type=int, default=30, help="timed calls per schedule and shape (default 30)")
    sp.add_argument("--out", help="write the table here instead of codegen/families/<family>/tuning/<arch>.json "
                                  "(entries already there are kept unless measured again)")
    sp.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    sp.set_defaults(func=cmd_tune)
