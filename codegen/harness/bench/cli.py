"""``python -m codegen bench`` and ``bench --render``: the command line and its steps.

The method (device-to-device copy reference, bytes counted, CUDA-event timing behind a spin
kernel, L2 rotation, warm-up, turns, host overhead), the default selection, the interface of the
workload modules (the family table ``codegen.harness.families``) and the record formats are in
docs/audit.md, "python -m codegen bench".
"""
from __future__ import annotations

import fnmatch
import os
import sys
import time
from pathlib import Path

from .. import families
from ..records import add_records_argument, git_info, now, read_json, slug, write_json
from .baselines import TorchBaselines
from .host import measure_host
from .plan import DEFAULT_COMPILE_KINDS, parse_shapes, plan
from .record import merge, refresh_targets, shape_key, targets
from .report import chart, to_markdown
from .run import run_one
from .timing import Timer, copy_bandwidth, free_memory, no_gpu


def cmd_bench(args) -> int:
    """``bench``: select, open the device, measure, record (each step below)."""
    from runtime.registry import Registry

    from ...manifest import GENERATED
    from ...terminal import console as new_console
    console = new_console(stderr=True)
    reg = Registry.load(GENERATED)
    modules, todo = _selection(args, reg, console)
    if not todo:
        return 2
    env, todo = _open_device(args, reg, todo, console)
    if not todo:
        return 2
    baselines = _torch_baselines(args, env, console)
    results, host, copy, ceilings, run = _measure(args, reg, env, modules, todo, baselines, console)
    steps = []
    if args.examples:
        from .steps import measure_example_steps
        steps = measure_example_steps(args.device, log=console.print)
    if not results and not host and not steps:
        console.print("bench: no result; nothing recorded")
        return 1
    _record(args, env, run, (results, host, copy, steps, ceilings), console)
    return 130 if run["interrupted"] else 0


def _selection(args, reg, console) -> tuple:
    """(workload modules, [(sku, module, shape)] to run); says why when there is nothing to run."""
    skus = [s for s in reg.skus() if fnmatch.fnmatchcase(str(s), args.filter)]
    modules = families.workload_modules(lambda m: console.print(f"[yellow]{m}[/yellow]"))
    shapes = parse_shapes(args.shapes) if args.shapes else None
    todo = plan(skus, modules, all_skus=args.all, shapes=shapes, quick=args.quick)
    if not todo:
        console.print(f"bench: nothing to run for --filter {args.filter!r} "
                      f"(modules: {', '.join(m.__name__ for m in modules) or 'none'}; try --all)")
    return modules, todo


def _open_device(args, reg, todo, console) -> tuple:
    """(environment, the runs whose SKU runs on this device) with their units compiled; (None, [])
    when there is no GPU or nothing runs on it."""
    missing = no_gpu()
    if missing:
        console.print(f"bench: needs a CUDA GPU ({missing}); nothing recorded")
        return None, []
    import cupy as cp

    from ..verify import _precompile, environment
    cp.cuda.Device(args.device).use()
    env = environment(args.device)
    cc = int(env["gpu"]["cc"].replace(".", ""))
    todo = [t for t in todo if t[0].runs_on(cc)]      # arch-specific SKUs (sm_90a) run on their own arch only
    if not todo:
        console.print(f"bench: no selected SKU runs on sm_{cc}")
        return env, []
    t0 = time.perf_counter()      # NVRTC for every unit in parallel first (else serially on first calls)
    _precompile(reg, sorted({sku for sku, _, _ in todo}), cc, os.cpu_count() or 1)
    console.print(f"compiled units in {time.perf_counter() - t0:.1f} s")
    return env, todo


def _torch_baselines(args, env, console):
    """The PyTorch baselines on the device (None with --no-torch or without torch)."""
    if args.no_torch:
        return None
    try:
        import torch
        torch.cuda.set_device(args.device)
        torch.cuda.init()
        baselines = TorchBaselines(compile_=not args.no_compile)
        env["torch"] = torch.__version__
        return baselines
    except ImportError:
        console.print("torch is not importable: no PyTorch baselines")
        return None


def _stream(device: int):
    """torch's current stream where torch runs on the device (its tensors' calls go there), else CuPy's."""
    import cupy as cp
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        from runtime.arrays import cupy_stream
        return cupy_stream(torch.cuda.current_stream().cuda_stream, device)
    return cp.cuda.get_current_stream()


def _measure(args, reg, env, modules, todo, baselines, console) -> tuple:
    """(results, host overhead, copy, ceilings, run description) of the selected runs."""
    import cupy as cp
    stream = _stream(args.device)
    l2 = int(cp.cuda.Device(args.device).attributes.get("L2CacheSize", 64 << 20))
    env["gpu"]["l2_mib"] = round(l2 / 2**20, 1)
    git = git_info()
    samples = args.samples or (20 if args.quick else 100)
    host = []
    t_start = time.perf_counter()
    with stream:
        timer = Timer(stream, samples, 0.25)
        copy = copy_bandwidth(timer)
        console.print(f"bench on {env['gpu']['name']}: device copy {copy['gbps']:.0f} GB/s; L2 {l2 / 2**20:.0f} MiB; "
                      f"{len(todo)} runs ({samples} samples each); torch {env.get('torch', 'absent')}"
                      f"{', no torch.compile' if args.no_compile else ''}")
        ceilings = _ceilings(timer, todo, console)
        if not args.no_host:
            host = _host_overhead(timer, modules, args.device, console)
        results, interrupted = _run_all(args, timer, baselines, reg, todo, (l2, copy["gbps"], ceilings), console)
    run = {"date": now(), **git, "filter": args.filter, "all": bool(args.all), "quick": bool(args.quick),
           "samples": samples, "runs": len(results), "seconds": round(time.perf_counter() - t_start, 1),
           "interrupted": interrupted}
    return results, host, copy, ceilings, run


def _section(module) -> str:
    """A workload module's section name: the key of its ceiling in the record."""
    return module.__name__.rsplit(".", 1)[-1]


def _ceilings(timer, todo, console) -> dict:
    """{section: ceiling} of the selected workload modules that measure one (compute kernels)."""
    ceilings = {}
    for m in {id(m): m for _, m, _ in todo}.values():
        if hasattr(m, "ceiling"):
            try:
                ceilings[_section(m)] = m.ceiling(timer)
            except Exception as e:  # noqa: BLE001 - a ceiling that cannot run is reported, not fatal
                console.print(f"[red]ceiling of {m.__name__}: {type(e).__name__}: {e}[/red]")
    for name, c in ceilings.items():
        console.print(f"ceiling ({name}): {c['name']}: {c['tflops']:.0f} TFLOP/s")
    return ceilings


def _host_overhead(timer, modules, device: int, console) -> list:
    host = measure_host(timer, modules, device=device)
    for h in host:
        console.print(f"host overhead {h['label']}: {h['us']:.1f} µs per call (throughput {h['throughput_us']:.1f})"
                      if "error" not in h else f"host overhead {h['label']}: [red]{h['error']}[/red]")
    return host


def _run_all(args, timer, baselines, reg, todo, device: tuple, console) -> tuple:
    """(results, interrupted): every selected run through :func:`run_one`, with a progress bar; one that
    fails is reported and skipped; Ctrl-C stops cleanly. ``device``: (L2 bytes, copy GB/s, ceilings)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    l2, copy_gbps, ceilings = device
    results = []
    cols = (TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[what]}"))
    with Progress(*cols, console=console) as progress:
        task = progress.add_task("bench", total=len(todo), what="")
        try:
            for sku, module, shape in todo:
                progress.update(task, what=f"{sku.op} {sku.scope} {sku.element}->{sku.aux_element} {shape_key(shape)}")
                try:
                    r = run_one(timer, baselines, sku, module, shape, l2, copy_gbps,
                                reg.manifest["kernels"][str(sku)]["sha256"],
                                compile_this=args.all or args.compile_all
                                or bool({sku.element, sku.aux_element} & DEFAULT_COMPILE_KINDS),
                                ceiling=ceilings.get(_section(module)))
                except Exception as e:  # noqa: BLE001 - a kernel that cannot run is reported, not fatal
                    console.print(f"[red]bench {sku} {shape_key(shape)}: {type(e).__name__}: {e}[/red]")
                    r = None
                finally:
                    free_memory()
                if r is not None:
                    results.append(r)
                    progress.console.print(_result_line(r))
                progress.advance(task)
        except KeyboardInterrupt:
            return results, True
    return results, False


def _result_line(r: dict) -> str:
    """One result as the progress log prints it."""
    return (f"{r['op']:<12} {r['label']:<40} {shape_key(r['shape']):>11} "
            + (f"{r['gbps']:7.0f} GB/s {r['pct_copy']:5.1f}% copy" if r.get("bytes") else
               f"{r.get('tflops', 0):7.1f} TFLOP/s")
            + "".join(f"  ×{r[k]:.2f} {n}" for k, n in (("speedup_eager", "eager"),
                                                       ("speedup_compile", "compile"),
                                                       ("speedup_ref", "ref")) if r.get(k))
            + (f"  [red]{r['mismatches_vs_eager']} elements differ from eager[/red]"
               if r.get("mismatches_vs_eager") else ""))


def _record(args, env, run, measured: tuple, console) -> None:
    """Fold the run into RECORDS/bench/<gpu>.json, write its Markdown and chart, print the targets.
    ``measured``: (results, host overhead, copy, example steps, ceilings)."""
    results, host, copy, steps, ceilings = measured
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


def cmd_render(args) -> int:
    """``bench --render``: rewrite every GPU's bench JSON (targets refreshed from the modules),
    Markdown table and chart from the records alone: no GPU, no measurement."""
    folder = Path(args.records) / "bench"
    paths = sorted(folder.glob("*.json"))
    if not paths:
        print(f"bench --render: no record in {folder}")
        return 2
    modules = families.workload_modules()
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
