"""``python -m codegen``: build, check, list, show, compile, status (and the harness: audit, verify, bench).

No argument builds ``generated/``. Every subcommand has ``--help``.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from rich.console import Console
from rich.table import Table

from . import GENERATOR_VERSION, harness
from .manifest import GENERATED, build, stale

console = Console(highlight=False)


def cmd_build(args) -> int:
    t0 = time.perf_counter()
    rep = build()
    c = rep.manifest["counts"]
    console.print(f"skuforge codegen {GENERATOR_VERSION}: {c['generated']} kernels in {c['units']} translation units, "
                  f"{c['excluded']} excluded cells (with reasons) -> {GENERATED}")
    console.print(f"wrote {len(rep.written)} files, removed {len(rep.removed)}, {rep.unchanged} unchanged "
                  f"({time.perf_counter() - t0:.2f} s)")
    for p in rep.written:
        console.print(f"  wrote {p}")
    for p in rep.removed:
        console.print(f"  removed {p}")
    return 0


def cmd_check(args) -> int:
    bad = stale()
    if bad:
        console.print(f"[red]generated/ is stale[/red] ({len(bad)} files); run `python -m codegen`:")
        for p in bad:
            console.print(f"  {p}")
        return 1
    console.print("generated/ and manifest.json are up to date")
    return 0


def _registry():
    from runtime.registry import Registry
    return Registry.load(GENERATED)


def _selected(reg, pattern):
    return [s for s in reg.skus() if fnmatch.fnmatchcase(str(s), pattern)]


def cmd_list(args) -> int:
    reg = _registry()
    skus = _selected(reg, args.filter)
    excluded = sorted((s, r) for s, r in reg.excluded.items() if fnmatch.fnmatchcase(str(s), args.filter)) \
        if args.excluded else []
    if args.json:
        print(json.dumps({"kernels": [{"sku": str(s), **{k: v for k, v in reg.manifest["kernels"][str(s)].items()}}
                                      for s in skus],
                          "excluded": [{"sku": str(s), "reason": r} for s, r in excluded]}, indent=1))
        return 0
    for s in skus:
        print(s)
    for s, r in excluded:
        print(f"{s}  [excluded: {r}]")
    print(f"# {len(skus)} kernels" + (f", {len(excluded)} excluded" if args.excluded else ""), file=sys.stderr)
    return 0


def cmd_show(args) -> int:
    reg = _registry()
    print(reg.source(args.sku), end="")
    return 0


def _compile_one(job):
    # Runs in a worker process: compile one translation unit for one arch, no cache, with ptxas's
    # per-kernel report (registers, stack frame, spills, shared memory). A kernel that uses local
    # memory (a stack frame or spills) fails the unit unless codegen.matrix.LOCAL_MEMORY allows it
    # (a few bytes of saved registers, with the reason): local memory is where out-of-bounds reads
    # of a thread's arrays hide.
    unit, source, arch, options = job
    from runtime.compiler import local_memory_use, resource_report

    from .matrix import local_memory_allowed
    t0 = time.perf_counter()
    try:
        report = resource_report(source, unit, arch, options)
    except Exception as e:  # noqa: BLE001 - reported per unit
        return unit, arch, str(e), time.perf_counter() - t0, None
    local = {sym: what for sym, what in local_memory_use(report).items()
             if not local_memory_allowed(sym, report[sym]["stack"])}
    err = "local memory in " + "; ".join(f"{sym}: {what}" for sym, what in sorted(local.items())) if local else None
    return unit, arch, err, time.perf_counter() - t0, report


def compile_jobs(reg, archs, pattern="*"):
    """(unit, source, arch, options) for every unit holding a selected SKU whose min arch ≤ arch."""
    jobs = []
    for unit, meta in sorted(reg.units.items()):
        for arch in archs:
            skus = [s for s in meta["skus"] if fnmatch.fnmatchcase(s, pattern)
                    and int(s.split("/")[6][2:]) <= arch]
            if skus:
                jobs.append((unit, reg.unit_source(unit), arch, tuple(meta["nvrtc_options"])))
    return jobs


def parse_archs(text: str) -> list:
    out = []
    for a in text.split(","):
        a = a.strip().lower().replace("sm_", "").replace("sm", "")
        if not a.isdigit():
            raise SystemExit(f"--arch: {text!r} is not a list like sm_80,sm_90")
        out.append(int(a))
    return out


def cmd_compile(args) -> int:
    from rich.progress import Progress
    reg = _registry()
    archs = parse_archs(args.arch)
    jobs = compile_jobs(reg, archs, args.filter)
    workers = args.jobs or os.cpu_count() or 1
    t0 = time.perf_counter()
    failures, done, results = [], {a: 0 for a in archs}, []
    kernels = {a: 0 for a in archs}
    with Progress(console=console, transient=not console.is_terminal) as progress, \
            ProcessPoolExecutor(max_workers=workers) as pool:
        task = progress.add_task(f"NVRTC x{workers}", total=len(jobs))
        futures = [pool.submit(_compile_one, j) for j in jobs]
        reports = []
        for f in as_completed(futures):
            unit, arch, err, dt, report = f.result()
            if report and args.resources:
                reports.append((unit, arch, report))
            results.append((unit, arch, err, dt))
            if err:
                failures.append((unit, arch, err))
            else:
                done[arch] += 1
                kernels[arch] += sum(1 for s in reg.units[unit]["skus"]
                                     if fnmatch.fnmatchcase(s, args.filter) and int(s.split("/")[6][2:]) <= arch)
            progress.advance(task)
    dt = time.perf_counter() - t0
    if reports:
        _print_resources(reg, reports, args.filter)
    for a in archs:
        console.print(f"sm_{a}: {done[a]} units, {kernels[a]} kernels compiled")
    for unit, arch, err in failures:
        console.print(f"[red]FAILED[/red] {unit} sm_{arch}:\n{err}")
    console.print(f"{len(jobs)} compiles in {dt:.1f} s with {workers} workers; {len(failures)} failures")
    if getattr(args, "record", None) is not None:
        from .harness.audit import record_compile
        path = record_compile(reg.manifest, results, args.record or None)
        console.print(f"recorded {len(results)} unit compiles in {path}")
    return 1 if failures else 0


def _print_resources(reg, reports, pattern) -> None:
    """ptxas's report for the selected kernels: registers per thread, spill bytes, static smem."""
    symbols = {e.symbol: str(s) for s, e in reg.entries.items() if fnmatch.fnmatchcase(str(s), pattern)}
    table = Table(title="ptxas resources (per thread / per block)")
    table.add_column("kernel", overflow="fold")
    for col in ("arch", "registers", "stack (B)", "spill st/ld (B)", "smem (B)"):
        table.add_column(col)
    for unit, arch, report in sorted(reports):
        for sym, r in sorted(report.items()):
            if sym in symbols:
                spill = f"{r['spill_stores']}/{r['spill_loads']}"
                stack = str(r["stack"])
                table.add_row(sym, f"sm_{arch}", str(r["registers"]), f"[red]{stack}[/red]" if r["stack"] else stack,
                              f"[red]{spill}[/red]" if r["spill_stores"] or r["spill_loads"] else spill, str(r["smem"]))
    console.print(table)


def cmd_status(args) -> int:
    """Where things are: generator, manifest counts, NVRTC, the compile cache (after FlashInfer's
    ``status``). ``--clear-cache`` empties the cache for the current NVRTC version."""
    import shutil

    from runtime import compiler
    reg = _registry()
    c = reg.manifest["counts"]
    table = Table(show_header=False, box=None)
    table.add_row("generator", f"skuforge codegen {GENERATOR_VERSION}")
    table.add_row("manifest", f"{GENERATED / 'manifest.json'}: {c['generated']} kernels, {c['units']} units, "
                              f"{c['excluded']} excluded cells")
    try:
        major, minor = compiler.nvrtc_version()
        archs = ", ".join(f"sm_{a}" for a in compiler.supported_archs())
        table.add_row("NVRTC", f"{major}.{minor} (archs: {archs})")
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        table.add_row("NVRTC", f"[red]not available: {e}[/red]")
        major = minor = None
    root = compiler.cache_dir()
    table.add_row("cache", str(root))
    if root.exists():
        for d in sorted(p for p in root.glob("nvrtc-*/sm_*") if p.is_dir()):
            files = list(d.glob("*.cubin"))
            size = sum(f.stat().st_size for f in files)
            table.add_row("", f"{d.relative_to(root)}: {len(files)} cubins, {size / 2**20:.1f} MiB")
    console.print(table)
    if args.clear_cache and major is not None:
        target = root / f"nvrtc-{major}.{minor}"
        if target.exists():
            shutil.rmtree(target)
        console.print(f"cleared {target}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m codegen", description=__doc__)
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("build", help="render generated/ (the default)")
    sub.add_parser("check", help="exit 1 when generated/ or the manifest is stale")
    sp = sub.add_parser("list", help="list generated SKUs")
    sp.add_argument("--filter", default="*", help="glob on the SKU string, e.g. '*quantize/token/*bf16*'")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--excluded", action="store_true", help="also list excluded cells with their reasons")
    sp = sub.add_parser("show", help="print the generated source of one SKU")
    sp.add_argument("sku")
    sp = sub.add_parser("compile", help="compile with NVRTC on the CPU (no GPU needed)")
    sp.add_argument("--arch", default="sm_80,sm_90")
    sp.add_argument("--filter", default="*")
    sp.add_argument("--jobs", type=int, default=0)
    sp.add_argument("--record", nargs="?", const="", default=None, metavar="FILE",
                    help="record per unit and arch ok/failed with the sha256s, for `audit` "
                         "(default FILE: audit/compiled.json)")
    sp.add_argument("--resources", action="store_true",
                    help="print ptxas's registers, stack frame, spills and shared memory per selected kernel "
                         "(every compile checks that no kernel uses local memory)")
    sp = sub.add_parser("status", help="generator, manifest, NVRTC and compile-cache status")
    sp.add_argument("--clear-cache", action="store_true", help="empty the cache of the current NVRTC version")
    harness.add_parsers(sub)
    return p


def main(argv=None) -> int:
    from runtime.errors import SkuforgeError
    args = build_parser().parse_args(argv)
    cmd = args.cmd or "build"
    try:
        if hasattr(args, "func"):
            return args.func(args)
        return {"build": cmd_build, "check": cmd_check, "list": cmd_list, "show": cmd_show,
                "compile": cmd_compile, "status": cmd_status}[cmd](args)
    except SkuforgeError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
