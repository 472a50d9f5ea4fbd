"""compute-sanitizer over ``python -m codegen verify``, on a GPU machine.

    PYTHONPATH=. python3 tools/sanitize.py --out OUT                      # memcheck, every SKU
    PYTHONPATH=. python3 tools/sanitize.py --tool racecheck --per-template --out OUT
    PYTHONPATH=. python3 tools/sanitize.py --tool synccheck --per-template --out OUT
    PYTHONPATH=. python3 tools/sanitize.py --filter 'quantization/quantize/*' --jobs 4 --out OUT

Every unit of the selection is compiled first (the NVRTC disk cache, in parallel), then the SKUs
are split by unit into ``--jobs`` shards, each verified by its own sanitized process
(``compute-sanitizer --tool T --report-api-errors no python -m codegen verify --skus FILE``; the
GPU is shared). ``--per-template`` selects one SKU per (op, scope, launch kind, backend, arch) instead of every
SKU: what racecheck and synccheck need (they look at shared memory and barriers, which depend on
the template and the launch, not on the dtype). ``--report-api-errors no``: cuda-bindings probes
driver entry points this driver may lack, and the sanitizer would count those probes as errors.

``--record``: the shards' verify results (real runs, under the sanitizer) are folded into
``audit/verified/<gpu>.json`` as one run each, like ``python -m codegen verify`` would record them.

Writes ``OUT/sanitize-<tool>.json`` (per shard: SKUs, verify's pass / fail counts, the
sanitizer's error summary, the log's tail) and the logs; exits 1 when any shard reports an error,
a failed check or no summary (a cut-off shard).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def select(reg, pattern: str, per_template: bool) -> list:
    skus = [s for s in reg.skus() if fnmatch.fnmatchcase(str(s), pattern)]
    if not per_template:
        return skus
    kernels, seen, out = reg.manifest["kernels"], set(), []
    for s in sorted(skus, key=lambda s: ("bf16" not in str(s), str(s))):    # bf16 first: the common case
        launch = kernels[str(s)].get("launch") or {}
        key = (s.op, s.scope, launch.get("kind"), s.backend, s.arch)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def shards(reg, skus, jobs: int) -> list:
    """SKUs grouped by unit, units dealt round-robin (largest first) into ``jobs`` shards."""
    by_unit: dict = {}
    for s in skus:
        by_unit.setdefault(reg.entries[s].unit, []).append(s)
    parts = [[] for _ in range(max(1, min(jobs, len(by_unit))))]
    for unit in sorted(by_unit, key=lambda u: -len(by_unit[u])):
        min(parts, key=len).extend(by_unit[unit])
    return [p for p in parts if p]


def summary(text: str) -> dict:
    """memcheck / synccheck / initcheck end with ``ERROR SUMMARY: N errors``; racecheck with
    ``RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)`` (warnings count here too)."""
    m = re.search(r"SUMMARY: [^\n]*?(\d+) errors?", text)
    w = re.search(r"SUMMARY: [^\n]*?(\d+) warnings?", text)
    v = re.search(r"(\d+) passed, (\d+) failed of (\d+) selected", text)
    return {"errors": int(m.group(1)) + (int(w.group(1)) if w else 0) if m else None,
            "passed": int(v.group(1)) if v else None, "failed": int(v.group(2)) if v else None}


def record(out: Path, n: int) -> None:
    """Fold each shard's verify record into the committed one (audit/verified/<gpu>.json)."""
    from codegen.harness.records import audit_dir, read_json, write_json
    from codegen.harness.verify import merge
    for i in range(n):
        for path in sorted((out / f"records-{i}" / "verified").glob("*.json")):
            shard = read_json(path)
            env = {k: v for k, v in shard.items() if k not in ("schema", "commit", "dirty", "date", "seed", "runs", "skus")}
            for run in shard.get("runs") or []:
                results = {sku: {k: v for k, v in r.items() if k != "run"}
                           for sku, r in (shard.get("skus") or {}).items() if r.get("run") == run.get("id")}
                target = audit_dir() / "verified" / path.name
                write_json(target, merge(read_json(target), env, {k: v for k, v in run.items() if k != "id"},
                                         results))
                print(f"recorded shard {i}: {len(results)} SKUs into {target}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool", default="memcheck", choices=("memcheck", "racecheck", "synccheck", "initcheck"))
    ap.add_argument("--filter", default="*", help="glob on the SKU string")
    ap.add_argument("--per-template", action="store_true", help="one SKU per (op, scope, launch kind, backend, arch)")
    ap.add_argument("--jobs", type=int, default=4, help="sanitized processes at once (default 4)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit", type=int, default=540, help="seconds per shard before it is cut (default 540)")
    ap.add_argument("--out", required=True, help="folder for the logs and the JSON summary")
    ap.add_argument("--record", action="store_true",
                    help="fold the shards' verify results into audit/verified/<gpu>.json (each shard one run)")
    args = ap.parse_args(argv)

    from codegen.harness.verify import _precompile
    from codegen.manifest import GENERATED
    from runtime.device import compile_arch
    from runtime.registry import Registry
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reg = Registry.load(GENERATED)
    skus = select(reg, args.filter, args.per_template)
    if not skus:
        print(f"sanitize: nothing selected by --filter {args.filter!r}")
        return 1
    t0 = time.perf_counter()
    _precompile(reg, skus, compile_arch(0), os.cpu_count() or 1)
    print(f"sanitize: {len(skus)} SKUs, units compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    extra = os.environ.get("PYTHONPATH")            # packages installed aside stay importable
    env = dict(os.environ, PYTHONPATH=str(ROOT) + (os.pathsep + extra if extra else ""), PYTHONUNBUFFERED="1")
    procs = []
    for i, part in enumerate(shards(reg, skus, args.jobs)):
        lst = out / f"{args.tool}-{i}.skus"
        lst.write_text("\n".join(map(str, part)) + "\n")
        log = open(out / f"{args.tool}-{i}.log", "w")
        cmd = ["timeout", "-s", "INT", str(args.limit), "compute-sanitizer", "--tool", args.tool,
               "--report-api-errors", "no", "--print-limit", "20", sys.executable, "-m", "codegen", "verify",
               "--seed", str(args.seed), "--jobs", "1", "--skus", str(lst), "--records", str(out / f"records-{i}")]
        procs.append((i, part, log, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)))
    results, bad = [], 0
    for i, part, log, p in procs:
        rc = p.wait()
        log.close()
        text = (out / f"{args.tool}-{i}.log").read_text(errors="replace")
        r = {"shard": i, "skus": len(part), "rc": rc, **summary(text), "tail": text[-1500:]}
        ok = rc == 0 and r["errors"] == 0 and r["failed"] == 0 and r["passed"] == len(part)
        bad += not ok
        results.append(r)
        print(f"shard {i}: {len(part)} SKUs, rc {rc}, sanitizer errors {r['errors']}, verify "
              f"{r['passed']} passed / {r['failed']} failed{'' if ok else '  <-- not clean'}", flush=True)
    from codegen.harness.records import git_info
    rec = {"tool": args.tool, "filter": args.filter, "per_template": args.per_template, "seed": args.seed,
           "skus": len(skus), "seconds": round(time.perf_counter() - t0, 1),
           "errors": sum(r["errors"] or 0 for r in results), "clean": bad == 0,
           "commit": git_info()["commit"], "shards": results}
    (out / f"sanitize-{args.tool}.json").write_text(json.dumps(rec, indent=1))
    if args.record:
        record(out, len(results))
    print(f"sanitize {args.tool}: {len(skus)} SKUs in {rec['seconds']} s, {rec['errors']} sanitizer errors, "
          f"{'clean' if bad == 0 else f'{bad} shard(s) not clean'}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
