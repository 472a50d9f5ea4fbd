"""``python -m codegen verify``: run every selected SKU against the NumPy reference on a GPU.

Each SKU goes through :func:`check` ``(sku, rng)``: the checker of its family
(``codegen.harness.families``; random inputs plus the edge cases of docs/audit.md; bit-exact for
quantization ops). The results are merged into
``audit/verified/<gpu-slug>.json``: records of SKUs not selected this time are kept, a
selected SKU's record is replaced. Every SKU gets its own generator seeded from
``(--seed, crc32(sku))``, so ``--filter SKU --seed N`` reproduces one result. Exit 1 when a
selected SKU failed, 2 when nothing could run (no GPU, nothing selected, generated/ not
matching its manifest). Nothing is written unless checks really ran on a GPU.
"""
from __future__ import annotations

import fnmatch
import sys
import time
import zlib
from pathlib import Path

from .families import checker_for
from .records import add_records_argument, git_info, now, read_json, slug, write_json

SCHEMA = 1
MAX_RUNS_KEPT = 50


def check(sku, rng=None, preferred_fw="cupy"):
    """Run the checker of ``sku`` (its family's) -> ``CheckResult`` (checks/base.py), once under each of
    its schedule variants (its launch kind's, codegen/families/) when it has several; a crash is a failed result,
    with its message."""
    import numpy as np

    from runtime.config import override
    from runtime.registry import default_registry

    from .checks.base import CheckResult
    rng = rng or np.random.default_rng()
    fn = checker_for(sku)
    if fn is None:
        return CheckResult(str(sku), False, detail=f"no checker for op {sku.op}")
    def run():
        try:
            return fn(sku, rng, preferred_fw)
        except Exception as e:  # noqa: BLE001 - a crash is a failed verification, recorded
            return CheckResult(str(sku), False, detail=f"{type(e).__name__}: {e}")

    names = sorted(default_registry().lookup(sku).launch.get("schedules") or ())
    if len(names) < 2:
        return run()
    total = CheckResult(str(sku), True)
    for name in names:
        with override(schedule=name):
            res = run()
        total.passed = total.passed and res.passed
        total.cases += res.cases
        total.mismatches += res.mismatches
        total.max_error = max(total.max_error, res.max_error)
        total.failures += [f"[{name}] {f}" for f in res.failures] or ([f"[{name}] {res.detail}"] if not res.passed else [])
    total.passed = total.passed and total.cases > 0
    total.detail = (f"{total.cases} cases over {len(names)} schedules ({', '.join(names)}), "
                    f"{total.mismatches} mismatching")
    return total


def sku_seed(seed: int, sku: str) -> list:
    """The per-SKU seed: independent of which other SKUs were selected."""
    return [int(seed), zlib.crc32(sku.encode())]


def environment(device: int = 0) -> dict:
    """GPU name, compute capability, driver / CUDA runtime / NVRTC / CuPy / torch versions."""
    import cupy as cp
    from runtime.compiler import nvrtc_version

    def ver(v: int) -> str:
        return f"{v // 1000}.{(v % 1000) // 10}"

    props = cp.cuda.runtime.getDeviceProperties(device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    env = {"gpu": {"name": name, "cc": f"{props['major']}.{props['minor']}",
                   "sms": props["multiProcessorCount"], "memory_gib": round(props["totalGlobalMem"] / 2**30, 1)},
           "driver": ver(cp.cuda.runtime.driverGetVersion()),
           "cuda_runtime": ver(cp.cuda.runtime.runtimeGetVersion()),
           "nvrtc": "%d.%d" % nvrtc_version(),
           "cupy": cp.__version__}
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # noqa: F401
        except ImportError:
            torch = None
    if torch is not None:
        env["torch"] = torch.__version__
    return env


def merge(old, env: dict, run: dict, results: dict) -> dict:
    """Fold one run's per-SKU ``results`` into a GPU's record; other SKUs' records are kept.

    The top level describes the latest run (commit, dirty, date, seed, versions); ``runs``
    keeps the history, and every SKU record names the run (``run`` = its id) it came from.
    """
    rec = dict(old or {})
    runs = list(rec.get("runs") or [])
    run = dict(run, id=(max((r.get("id", 0) for r in runs), default=0) + 1))
    runs = (runs + [run])[-MAX_RUNS_KEPT:]
    skus = dict(rec.get("skus") or {})
    for sku, r in results.items():
        skus[sku] = dict(r, run=run["id"])
    rec.update(env)
    rec.update({"schema": SCHEMA, "commit": run["commit"], "dirty": run["dirty"], "date": run["date"],
                "seed": run["seed"], "runs": runs, "skus": dict(sorted(skus.items()))})
    return rec


def _unit_mismatches(reg, skus) -> list:
    """Units of the selected SKUs whose file on disk does not match the manifest's sha256."""
    from ..render import sha256
    bad = []
    for unit in sorted({reg.entries[s].unit for s in skus}):
        if sha256(reg.unit_source(unit)) != reg.units[unit]["sha256"]:
            bad.append(unit)
    return bad


def _precompile(reg, skus, arch: int, jobs: int) -> None:
    """Fill the NVRTC disk cache for the selected units in parallel (CPU work, before the GPU loop)."""
    from concurrent.futures import ProcessPoolExecutor

    from runtime.compiler import compile_cached
    units = sorted({reg.entries[s].unit for s in skus})
    if len(units) < 2 or jobs < 2:
        return
    with ProcessPoolExecutor(max_workers=min(jobs, len(units))) as pool:
        futs = [pool.submit(compile_cached, reg.unit_source(u), u, arch, tuple(reg.units[u]["nvrtc_options"]))
                for u in units]
        for f in futs:
            try:
                f.result()
            except Exception:  # noqa: BLE001 - the check of that SKU reports the compile error
                pass


def run_checks(skus, seed: int, framework: str, progress_console=None):
    """{sku: result dict} for ``skus``, with a rich progress bar; stops cleanly on Ctrl-C."""
    import numpy as np
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results, interrupted = {}, False
    cols = (TextColumn("verify"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[failed]} failed  {task.fields[sku]}"))
    with Progress(*cols, console=progress_console, transient=False) as progress:
        task = progress.add_task("verify", total=len(skus), failed=0, sku="")
        failed = 0
        try:
            for sku in skus:
                progress.update(task, sku=str(sku))
                t0 = time.perf_counter()
                res = check(sku, np.random.default_rng(sku_seed(seed, str(sku))), framework)
                results[str(sku)] = {"passed": bool(res.passed), "cases": int(res.cases),
                                     "mismatches": int(res.mismatches), "max_error": float(res.max_error),
                                     "detail": res.detail + ("; " + "; ".join(res.failures[:3]) if res.failures else ""),
                                     "seconds": round(time.perf_counter() - t0, 3)}
                failed += not res.passed
                progress.update(task, advance=1, failed=failed)
        except KeyboardInterrupt:
            interrupted = True
    return results, interrupted


def shards(skus, n: int) -> list:
    """``skus`` dealt round-robin into at most ``n`` non-empty shards (neighbouring SKUs, which
    share units and sizes, land in different shards: the shards take about as long)."""
    n = max(1, min(n, len(skus)))
    return [skus[i::n] for i in range(n)]


def worker_results(records: list) -> dict:
    """The per-SKU results of the workers' records (each a verified/<gpu>.json of one run), without
    the run ids and sha256s the parent's own record assigns again."""
    out = {}
    for rec in records:
        for sku, r in (rec or {}).get("skus", {}).items():
            out[sku] = {k: v for k, v in r.items() if k not in ("run", "sha256")}
    return out


def run_workers(args, skus, seed: int, console):
    """``run_checks`` in ``args.workers`` processes sharing the GPU, each on one shard with the same
    seed (a SKU's generator depends on the seed and its name only, so the results are those of one
    process); each writes its own record in a scratch folder and its log beside it, and the parent
    folds their results into one run. Progress: a line per finished worker. Ctrl-C stops them all;
    what finished is kept."""
    import signal
    import subprocess
    import tempfile
    parts = shards([str(s) for s in skus], args.workers)
    console.print(f"verify: {len(skus)} SKUs in {len(parts)} worker processes")
    with tempfile.TemporaryDirectory(prefix="skuforge-verify-") as tmp:
        procs = []
        for i, part in enumerate(parts):
            (Path(tmp) / f"shard{i}.txt").write_text("\n".join(part) + "\n")
            cmd = [sys.executable, "-m", "codegen", "verify", "--skus", str(Path(tmp) / f"shard{i}.txt"),
                   "--seed", str(seed), "--framework", args.framework, "--device", str(args.device),
                   "--jobs", "1", "--workers", "1", "--records", str(Path(tmp) / f"rec{i}")]
            log = open(Path(tmp) / f"worker{i}.log", "w")
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log, len(part)))
        interrupted, done = False, set()
        try:
            while len(done) < len(procs):
                for i, (p, log, n) in enumerate(procs):
                    if i not in done and p.poll() is not None:
                        done.add(i)
                        log.close()
                        tail = (Path(tmp) / f"worker{i}.log").read_text().strip().splitlines()[-1:] or [""]
                        console.print(f"verify: worker {i + 1}/{len(procs)} ({n} SKUs) exited {p.returncode}: {tail[0]}")
                time.sleep(0.5)
        except KeyboardInterrupt:
            interrupted = True
            for p, _, _ in procs:
                p.send_signal(signal.SIGINT)
            for p, log, _ in procs:
                p.wait()
                log.close()
        records = [read_json(f) for f in sorted(Path(tmp).glob("rec*/verified/*.json"))]
        results = worker_results(records)
        missing = [s for s in map(str, skus) if s not in results]
        if missing and not interrupted:
            console.print(f"verify: {len(missing)} SKUs have no result (a worker failed before recording): "
                          f"{', '.join(missing[:5])}")
            for s in missing:
                results[s] = {"passed": False, "cases": 0, "mismatches": 0, "max_error": 0.0,
                              "detail": "no result: its worker process failed", "seconds": 0.0}
    return results, interrupted


def cmd_verify(args) -> int:
    import numpy as np

    from runtime.registry import Registry

    from ..terminal import console as new_console
    console = new_console(stderr=True)
    from ..manifest import GENERATED
    reg = Registry.load(GENERATED)
    skus = [s for s in reg.skus() if fnmatch.fnmatchcase(str(s), args.filter)]
    if args.skus:
        wanted = {line.strip() for line in Path(args.skus).read_text().splitlines() if line.strip()}
        unknown = wanted - {str(s) for s in reg.skus()}
        if unknown:
            console.print(f"verify: --skus {args.skus} names SKUs that are not generated: {', '.join(sorted(unknown)[:5])}")
            return 2
        skus = [s for s in skus if str(s) in wanted]
    if not skus:
        console.print(f"verify: no generated SKU matches --filter {args.filter!r}"
                      + (f" and --skus {args.skus}" if args.skus else ""))
        return 2
    bad = _unit_mismatches(reg, skus)
    if bad:
        console.print("verify: generated/ does not match manifest.json for " + ", ".join(bad)
                      + "; run `python -m codegen` (nothing recorded)")
        return 2
    try:
        import cupy as cp
        ndev = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no CuPy or no driver: a clear message, no record
        console.print(f"verify: needs a CUDA GPU ({type(e).__name__}: {e}); nothing recorded")
        return 2
    if ndev == 0:
        console.print("verify: no CUDA device; nothing recorded")
        return 2
    cp.cuda.Device(args.device).use()
    env = environment(args.device)
    cc = int(env["gpu"]["cc"].replace(".", ""))
    elsewhere = [s for s in skus if not s.runs_on(cc)]
    if elsewhere:      # arch-specific machine code (sm_90a) runs on its own arch only
        console.print(f"verify: {len(elsewhere)} selected SKUs do not run on sm_{cc} (built for "
                      f"{', '.join(sorted({s.target for s in elsewhere}))}): not checked here")
        skus = [s for s in skus if s.runs_on(cc)]
        if not skus:
            return 2
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    git = git_info()
    console.print(f"verify: {len(skus)} SKUs on {env['gpu']['name']} (sm_{env['gpu']['cc'].replace('.', '')}, "
                  f"driver {env['driver']}, CUDA {env['cuda_runtime']}, NVRTC {env['nvrtc']}), seed {seed}, "
                  f"{args.framework} inputs")
    if args.jobs != 1:
        t0 = time.perf_counter()
        import os
        _precompile(reg, skus, int(env["gpu"]["cc"].replace(".", "")), args.jobs or os.cpu_count() or 1)
        console.print(f"compiled units in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    if args.workers > 1 and len(skus) > 1:
        results, interrupted = run_workers(args, skus, seed, console)
    else:
        results, interrupted = run_checks(skus, seed, args.framework, console)
    run = {"commit": git["commit"], "dirty": git["dirty"], "date": now(), "seed": seed, "filter": args.filter,
           "framework": args.framework, "selected": len(skus), "ran": len(results),
           "passed": sum(r["passed"] for r in results.values()),
           "failed": sum(not r["passed"] for r in results.values()),
           "seconds": round(time.perf_counter() - t0, 1), "interrupted": interrupted,
           "driver": env["driver"], "cuda_runtime": env["cuda_runtime"], "nvrtc": env["nvrtc"]}
    if results:
        man = reg.manifest["kernels"]
        for sku, r in results.items():
            r["sha256"] = man[sku]["sha256"]
        path = Path(args.records) / "verified" / f"{slug(env['gpu']['name'])}.json"
        write_json(path, merge(read_json(path), env, run, results))
        console.print(f"recorded {len(results)} results in {path}")
    failed = {s: r for s, r in results.items() if not r["passed"]}
    for s, r in sorted(failed.items()):
        console.print(f"[red]FAILED[/red] {s}: {r['detail']}")
    console.print(f"{run['passed']} passed, {run['failed']} failed of {len(skus)} selected"
                  f"{' (interrupted)' if interrupted else ''} in {run['seconds']} s; seed {seed}"
                  + (f"; reproduce one: python -m codegen verify --seed {seed} --filter 'SKU'" if failed else ""))
    if interrupted:
        return 130
    return 1 if failed else 0


def add_parser(sub) -> None:
    sp = sub.add_parser("verify", help="run the selected SKUs against the NumPy reference on a GPU and record it",
                        description="Check the selected SKUs against the NumPy reference on a GPU; merges the "
                                    "results into RECORDS/verified/<gpu>.json. Exit 1 when a SKU failed, 2 when "
                                    "nothing could run (no GPU, empty selection, stale generated/). docs/audit.md.")
    sp.add_argument("--filter", default="*", help="glob on the SKU string, e.g. '*quantize/token/*bf16*'")
    sp.add_argument("--skus", help="a file listing SKUs, one per line: verify those (and --filter's) only")
    sp.add_argument("--seed", type=int, default=None, help="base seed (default: fresh, printed and recorded)")
    sp.add_argument("--framework", choices=("cupy", "torch"), default="cupy",
                    help="array type the checks pass to the API (default cupy)")
    sp.add_argument("--device", type=int, default=0, help="CUDA device ordinal to verify on (default 0)")
    sp.add_argument("--jobs", type=int, default=0, help="NVRTC processes to pre-compile units (1: none)")
    sp.add_argument("--workers", type=int, default=1,
                    help="verify in N processes sharing the GPU, one shard of the SKUs each, recorded as one run "
                         "(default 1)")
    add_records_argument(sp)
    sp.set_defaults(func=cmd_verify)
