"""``python -m codegen``: build, check, list, show, compile, status (and the harness: audit, verify, bench, tune).

No argument builds ``generated/``. Every subcommand has ``--help``. Exit status: 0 on success
(also when the reader of the output goes away: ``| head``), 1 when something failed or a
``--filter`` / ``--arch`` selected nothing, 2 on a typed skuforge error (a bad argument or setting,
printed as ``error: <Type>: <message>``).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from rich.table import Table
from rich.text import Text

from runtime.axes import GENERATOR_VERSION

from . import harness
from .manifest import GENERATED, build, stale
from .terminal import console as new_console

console = new_console(markup=False)   # verbatim: compiler logs and paths are data, not markup


def cmd_build(args) -> int:
    t0 = time.perf_counter()
    out = getattr(args, "out", None)
    rep = build(out)
    c = rep.manifest["counts"]
    console.print(f"skuforge codegen {GENERATOR_VERSION}: {c['generated']} kernels in {c['units']} translation units, "
                  f"{c['excluded']} excluded cells (with reasons) -> {out or GENERATED}")
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
        console.print(Text.assemble(("generated/ is stale", "red"), f" ({len(bad)} files); run `python -m codegen`:"))
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
    if not skus and not excluded:
        print(f"error: no SKU matches --filter {args.filter!r} (`python -m codegen list` lists them all)",
              file=sys.stderr)
        return 1
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
    # memory (a stack frame or spills) fails the unit unless a family's local_memory (codegen/families/) allows it
    # (a few bytes of saved registers, with the reason): local memory is where out-of-bounds reads
    # of a thread's arrays hide. With a 5th element ``keep`` set, the cubin comes back too, to be
    # stored (the compile cache, a prebuilt folder). For --out a kernel that spills (another NVRTC
    # allocates registers otherwise) is still a correct kernel, so it is written and the local
    # memory reported as a warning; the check that fails on it is ``compile`` without --out, the
    # build check CI runs.
    unit, source, arch, options = job[:4]
    keep = len(job) > 4 and job[4]
    from runtime.compiler import compile_with_report, local_memory_use

    from .matrix import local_memory_allowed
    t0 = time.perf_counter()
    try:
        cubin, report = compile_with_report(source, unit, arch, options)
    except Exception as e:  # noqa: BLE001 - reported per unit
        return unit, arch, str(e), time.perf_counter() - t0, None
    local = {sym: what for sym, what in local_memory_use(report).items()
             if not local_memory_allowed(sym, report[sym]["stack"])}
    err = "local memory in " + "; ".join(f"{sym}: {what}" for sym, what in sorted(local.items())) if local else None
    if keep:
        return unit, arch, err, time.perf_counter() - t0, report, cubin
    return unit, arch, err, time.perf_counter() - t0, report


def compile_jobs(reg, archs, pattern="*"):
    """(unit, source, arch, options) for every unit holding a selected SKU whose min arch ≤ arch (a unit
    pinned to an arch-specific target, ``sm_90a``, only for its own arch)."""
    from runtime.compiler import builds_for
    jobs = []
    for unit, meta in sorted(reg.units.items()):
        for arch in archs:
            skus = [s for s in meta["skus"] if fnmatch.fnmatchcase(s, pattern)
                    and int(s.split("/")[6][2:]) <= arch]
            if skus and builds_for(meta["nvrtc_options"], arch):
                jobs.append((unit, reg.unit_source(unit), arch, tuple(meta["nvrtc_options"])))
    return jobs


def parse_archs(text: str) -> list:
    """``sm_80,sm_90`` -> ``[80, 90]``, each an arch the NVRTC in use builds for (checked before any
    compile: a typed error names the ones it does not and the ones it does)."""
    from runtime.compiler import nvrtc_version, supported_archs
    from runtime.errors import InvalidProblemError, UnsupportedError
    out = []
    for a in text.split(","):
        a = a.strip().lower().replace("sm_", "").replace("sm", "")
        if not a.isdigit():
            raise InvalidProblemError(f"--arch {text!r} is not a list like sm_80,sm_90")
        out.append(int(a))
    supported = supported_archs()
    bad = [a for a in out if a not in supported]
    if bad:
        raise UnsupportedError(f"--arch {text!r}: NVRTC {'.'.join(map(str, nvrtc_version()))} does not build for "
                               f"{', '.join(f'sm_{a}' for a in bad)}; it builds for "
                               f"{', '.join(f'sm_{a}' for a in supported)}")
    return out


PROGRESS_EVERY_S = 15.0   # non-terminal output (CI logs): a plain progress line at least this often
PROGRESS_EVERY_N = 10     # ... and every this many units


class _PlainProgress:
    """Progress for logs: ``compile: 12/40 units, 0 failed, 31 s`` every N units or every
    ``PROGRESS_EVERY_S`` seconds (a heartbeat thread prints while a long unit compiles)."""

    def __init__(self, total: int, label: str):
        import threading
        self.total, self.label, self.done, self.failed = total, label, 0, 0
        self.t0 = self.last = time.perf_counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _line(self) -> None:
        self.last = time.perf_counter()
        print(f"{self.label}: {self.done}/{self.total} units, {self.failed} failed, "
              f"{self.last - self.t0:.0f} s", flush=True)

    def _beat(self) -> None:
        while not self.stop.wait(min(1.0, PROGRESS_EVERY_S / 4)):
            with self.lock:
                if time.perf_counter() - self.last >= PROGRESS_EVERY_S:
                    self._line()

    def __enter__(self):
        print(f"{self.label}: {self.total} units to compile", flush=True)
        self.thread.start()
        return self

    def advance(self, failed: bool) -> None:
        with self.lock:
            self.done += 1
            self.failed += bool(failed)
            if self.done % PROGRESS_EVERY_N == 0 or self.done == self.total \
                    or time.perf_counter() - self.last >= PROGRESS_EVERY_S:
                self._line()

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        return False


class _RichProgress:
    def __init__(self, total: int, label: str):
        from rich.progress import Progress
        self.progress = Progress(console=console, transient=True)
        self.total, self.label = total, label

    def __enter__(self):
        self.progress.__enter__()
        self.task = self.progress.add_task(self.label, total=self.total)
        return self

    def advance(self, failed: bool) -> None:
        self.progress.advance(self.task)

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)


def cmd_compile(args) -> int:
    reg = _registry()
    archs = parse_archs(args.arch)
    jobs = compile_jobs(reg, archs, args.filter)
    if not jobs:
        matched = _selected(reg, args.filter)
        why = (f"no SKU matches --filter {args.filter!r}" if not matched else
               f"the {len(matched)} SKUs matching --filter {args.filter!r} need "
               f"{min(s.arch for s in matched)} or newer; --arch {args.arch!r} selects none of them")
        print(f"error: nothing to compile: {why}", file=sys.stderr)
        return 1
    to_cache = not args.no_cache and (not args.out or args.fill_cache)
    if args.out or to_cache:
        jobs = [(*j, True) for j in jobs]
    workers = args.jobs or os.cpu_count() or 1
    t0 = time.perf_counter()
    failures, warnings, done, results = [], [], {a: 0 for a in archs}, []
    kernels = {a: 0 for a in archs}
    built = []
    progress_cls = _RichProgress if console.is_terminal else _PlainProgress
    with progress_cls(len(jobs), f"NVRTC x{workers}") as progress, \
            ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_compile_one, j) for j in jobs]
        reports = []
        for f in as_completed(futures):
            unit, arch, err, dt, report, *cubin = f.result()
            if cubin and cubin[0] is not None and (args.out or not err):
                built.append((unit, arch, cubin[0]))
                if err:                 # local memory only (a compile error has no cubin): a warning for --out
                    warnings.append((unit, arch, err))
                    err = None
            if report and args.resources:
                reports.append((unit, arch, report))
            results.append((unit, arch, err, dt))
            if err:
                failures.append((unit, arch, err))
            else:
                done[arch] += 1
                kernels[arch] += sum(1 for s in reg.units[unit]["skus"]
                                     if fnmatch.fnmatchcase(s, args.filter) and int(s.split("/")[6][2:]) <= arch)
            progress.advance(bool(err))
    dt = time.perf_counter() - t0
    if built:
        _store(reg, built, args.out, to_cache)
    if reports:
        _print_resources(reg, reports, args.filter)
    for a in archs:
        console.print(f"sm_{a}: {done[a]} units, {kernels[a]} kernels compiled")
    for unit, arch, err in warnings:
        console.print(Text.assemble(("written, with ", "yellow"), f"{err} ({unit} sm_{arch}; `compile` without "
                                    "--out fails on it)"))
    for unit, arch, err in failures:
        console.print(Text.assemble(("FAILED", "red"), f" {unit} sm_{arch}:\n{err}"))
    console.print(f"{len(jobs)} compiles in {dt:.1f} s with {workers} workers; {len(failures)} failures")
    if getattr(args, "record", None) is not None:
        from .harness.audit import record_compile
        path = record_compile(reg.manifest, results, args.record or None)
        console.print(f"recorded {len(results)} unit compiles in {path}")
    return 1 if failures else 0


def _store(reg, built, out, to_cache: bool) -> None:
    """Write the compiled (and checked) cubins: a prebuilt folder (``out``) and/or the compile cache. A
    cache that cannot be written is reported, not a failure: the compile check itself passed."""
    from runtime import compiler
    built = sorted(built)
    items = [{"unit": u, "arch": a, "source": reg.unit_source(u), "options": tuple(reg.units[u]["nvrtc_options"]),
              "cubin": c, "skus": reg.units[u]["skus"]} for u, a, c in built]
    if out:
        index = compiler.write_prebuilt(out, items)
        console.print(f"wrote {len(items)} cubins and {index} (load them with SKUFORGE_PREBUILT={out})")
    if to_cache:
        try:
            for it in items:
                compiler.store_entry(it["source"], it["unit"], it["arch"], it["options"], it["cubin"])
        except OSError as e:
            console.print(Text.assemble(("not cached: ", "yellow"), f"the compile cache {compiler.cache_dir()} "
                                        f"cannot be written ({e}); set SKUFORGE_CACHE_DIR or pass --no-cache"))
            return
        size = sum(len(it["cubin"]) for it in items) / 2**20
        console.print(f"stored {len(items)} cubins ({size:.1f} MiB) in the compile cache {compiler.cache_dir()}")


def _print_resources(reg, reports, pattern) -> None:
    """ptxas's report for the selected kernels (every entry point they launch, shared ones
    included): registers per thread, spill bytes, static smem."""
    symbols = {sym for s, e in reg.entries.items() if fnmatch.fnmatchcase(str(s), pattern)
               for sym in (*(p["symbol"] for p in e.launch["entries"].values()),
                           *(v["symbol"] for v in (e.launch.get("variants") or {}).values()))}
    table = Table(title="ptxas resources (per thread / per block)")
    table.add_column("kernel", overflow="fold")
    for col in ("arch", "registers", "stack (B)", "spill st/ld (B)", "smem (B)"):
        table.add_column(col)
    for unit, arch, report in sorted(reports):
        for sym, r in sorted(report.items()):
            if sym in symbols:     # an entry point the manifest records for a selected SKU
                spill = f"{r['spill_stores']}/{r['spill_loads']}"
                stack = Text(str(r["stack"]), "red" if r["stack"] else "")
                table.add_row(sym, f"sm_{arch}", str(r["registers"]), stack,
                              Text(spill, "red" if r["spill_stores"] or r["spill_loads"] else ""), str(r["smem"]))
    console.print(table)


def cmd_status(args) -> int:
    """Where things are: generator, manifest counts, NVRTC, the compile cache (after FlashInfer's
    ``status``). ``--clear-cache`` empties the compile cache: every arch, every NVRTC version, and the
    folders of the previous cache layout."""
    import shutil

    from runtime import compiler, config
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
        table.add_row("NVRTC", Text(f"not available: {e}", "red"))
    s = config.settings()
    root = compiler.cache_dir()
    table.add_row("cache", str(root))
    if root.is_dir():
        for d in sorted(p for p in root.glob(f"{compiler.CACHE_LAYOUT}/sm_*") if p.is_dir()):
            files = [f for f in d.iterdir() if compiler.is_entry(f)]
            size = sum(f.stat().st_size for f in files if f.is_file())  # a dangling link counts as nothing
            orphans = len(list(d.glob(".tmp-*.cubin")))
            table.add_row("", f"{d.relative_to(root)}: {len(files)} cubins, {size / 2**20:.1f} MiB"
                              + (f" ({orphans} temporary files)" if orphans else ""))
        old = [p for p in root.glob("nvrtc-*") if p.is_dir()]
        if old:
            table.add_row("", f"{len(old)} folders of the previous cache layout (nvrtc-*): --clear-cache removes them")
    elif root.exists():
        table.add_row("", Text("not a folder: kernels are cached in memory only", "red"))
    if s.prebuilt_dir is not None:
        table.add_row("prebuilt", str(compiler.prebuilt_status(s.prebuilt_dir)))
    table.add_row("JIT", "disabled (SKUFORGE_DISABLE_JIT)" if s.disable_jit else "enabled")
    console.print(table)
    if args.clear_cache:
        for target in [root / compiler.CACHE_LAYOUT, *root.glob("nvrtc-*")]:
            if target.is_dir():
                shutil.rmtree(target)
                console.print(f"cleared {target}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m codegen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version",
                   version=f"skuforge {_dist_version()} (codegen {GENERATOR_VERSION}, data: {_data_where()})",
                   help="print the version and where the templates / generated sources are, then exit")
    sub = p.add_subparsers(dest="cmd")
    sp = sub.add_parser("build", help="render generated/ (the default); refused in an installed copy without --out")
    sp.add_argument("--out", metavar="DIR", default=None,
                    help="render into DIR instead of the source checkout's generated/ (required when skuforge is "
                         "installed from a wheel: installed files are never rewritten)")
    sub.add_parser("check", help="exit 1 when generated/ or the manifest is stale")
    sp = sub.add_parser("list", help="list generated SKUs")
    sp.add_argument("--filter", default="*", help="glob on the SKU string, e.g. '*quantize/token/*bf16*' "
                                                  "(exit 1 when it matches nothing)")
    sp.add_argument("--json", action="store_true", help="print the manifest entries of the SKUs as JSON")
    sp.add_argument("--excluded", action="store_true", help="also list excluded cells with their reasons")
    sp = sub.add_parser("show", help="print the generated source of one SKU")
    sp.add_argument("sku", help="a SKU string as `list` prints it")
    sp = sub.add_parser("compile", help="compile with NVRTC on the CPU (no GPU needed) into the compile cache")
    sp.add_argument("--arch", default="sm_80,sm_90",
                    help="target archs, e.g. sm_90 or sm_80,sm_90 (default sm_80,sm_90); each must be one the "
                         "installed NVRTC builds for")
    sp.add_argument("--filter", default="*", help="glob on the SKU string: compile the units holding matching SKUs "
                                                  "(exit 1 when nothing matches)")
    sp.add_argument("--jobs", type=int, default=0, help="worker processes (default: one per CPU core)")
    sp.add_argument("--out", metavar="DIR", default=None,
                    help="write a prebuilt folder instead (cubins + DIR/index.json) for SKUFORGE_PREBUILT=DIR")
    where = sp.add_mutually_exclusive_group()
    where.add_argument("--fill-cache", action="store_true", help="with --out: also store the cubins in the cache")
    where.add_argument("--no-cache", action="store_true", help="only check that every unit compiles: store nothing")
    sp.add_argument("--record", nargs="?", const="", default=None, metavar="FILE",
                    help="record per unit and arch ok/failed, for `audit` (default FILE: compiled.json in the "
                         "records folder)")
    sp.add_argument("--resources", action="store_true",
                    help="print ptxas's registers, stack frame, spills and shared memory per selected kernel")
    sp = sub.add_parser("status", help="generator, manifest, NVRTC and compile-cache status")
    sp.add_argument("--clear-cache", action="store_true",
                    help="then empty the compile cache (every arch and NVRTC version)")
    harness.add_parsers(sub)
    return p


def _dist_version() -> str:
    try:
        from importlib.metadata import version
        return version("skuforge")
    except Exception:  # noqa: BLE001 - a source tree without an install
        return GENERATOR_VERSION


def _data_where() -> str:
    from runtime.config import data_root, installed
    return f"{data_root()} ({'installed' if installed() else 'source checkout'})"


def _run(argv) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "func"):
        return args.func(args)
    return {"build": cmd_build, "check": cmd_check, "list": cmd_list, "show": cmd_show,
            "compile": cmd_compile, "status": cmd_status}[args.cmd or "build"](args)


def main(argv=None) -> int:
    from runtime.errors import SkuforgeError
    try:
        try:
            return _run(argv)
        except SkuforgeError as e:      # a bad argument or setting, wherever it is first used
            sys.stdout.flush()
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        finally:
            sys.stdout.flush()          # here, not at exit: a closed pipe raises where it is caught
    except BrokenPipeError:
        # the reader went away (`python -m codegen audit | head -1`): not an error of ours. Point
        # stdout at /dev/null so that the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
