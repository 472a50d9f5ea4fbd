"""The audit's model: the manifest and the records (compile, verify, bench) read into one
:class:`CellStatus` per cell of the matrix (:func:`collect`, :func:`load`), and the compile record
that ``python -m codegen compile --record`` writes."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..records import audit_dir, now, read_json, write_json

SCHEMA = 1
DEFAULT_ARCHS = ("sm_80", "sm_90")


def load_manifest(root: Optional[Path] = None) -> dict:
    from ...manifest import GENERATED, MANIFEST
    path = Path(root or GENERATED) / MANIFEST
    m = read_json(path)
    if m is None:
        raise SystemExit(f"no manifest at {path}: run `python -m codegen` first")
    return m


def records_in(folder: Path) -> dict:
    """``{slug: record}`` for every ``*.json`` in ``folder`` (missing folder: empty)."""
    out = {}
    if Path(folder).is_dir():
        for p in sorted(Path(folder).glob("*.json")):
            rec = read_json(p)
            if isinstance(rec, dict):
                out[p.stem] = rec
    return out


# -- compile records (written by `python -m codegen compile --record`) ---------------------------
def arch_key(arch) -> str:
    """``80`` / ``"sm80"`` / ``"sm_80"`` -> ``"sm_80"``."""
    text = str(arch).lower().replace("sm_", "").replace("sm", "")
    return f"sm_{int(text)}"


def merge_compile_record(old: Optional[dict], manifest: dict, results, nvrtc: str, date: str) -> dict:
    """Fold ``results`` = [(unit, arch_int, error_or_None, seconds)] into a compile record.

    Per unit: its sha256, the sha256 of each SKU in it, and per arch ok/failed. A unit whose
    source changed loses its old per-arch results; units no longer in the manifest are dropped.
    """
    rec = dict(old or {})
    units = {u: dict(v) for u, v in (rec.get("units") or {}).items() if u in manifest["units"]}
    for unit, arch, err, seconds in results:
        meta = manifest["units"][unit]
        cur = units.get(unit)
        if cur is None or cur.get("sha256") != meta["sha256"]:
            cur = {"sha256": meta["sha256"], "archs": {}}
        cur["skus"] = {s: manifest["kernels"][s]["sha256"] for s in meta["skus"]}
        archs = dict(cur.get("archs") or {})
        archs[arch_key(arch)] = {"ok": err is None, "date": date, "nvrtc": nvrtc, "seconds": round(seconds, 3),
                                 **({"error": err[:2000]} if err else {})}
        cur["archs"] = archs
        units[unit] = cur
    rec.update({"schema": SCHEMA, "updated": date, "nvrtc": nvrtc, "units": dict(sorted(units.items()))})
    return rec


def record_compile(manifest: dict, results, path: Optional[Path] = None) -> Path:
    from runtime.compiler import nvrtc_version
    path = Path(path or audit_dir() / "compiled.json")
    rec = merge_compile_record(read_json(path), manifest, results, "%d.%d" % nvrtc_version(), now())
    write_json(path, rec)
    return path


# -- the audit model ------------------------------------------------------------------------------
@dataclass
class CellStatus:
    sku: str
    category: str
    op: str
    scope: str
    mode: str
    element: str
    aux_element: str
    arch: str
    backend: str
    precision: str
    family: str
    generated: bool
    reason: Optional[str] = None
    compiled: dict = field(default_factory=dict)   # arch -> ok | failed | stale | none | n/a
    verified: str = "none"                         # passed | failed | stale | none
    gpus: list = field(default_factory=list)       # GPUs with a passing record at the current source
    verify_detail: str = ""
    bench: Optional[dict] = None                   # best result at the current source
    bench_stale: bool = False

    @property
    def compiled_ok(self) -> bool:
        vals = [v for v in self.compiled.values() if v != "n/a"]
        return bool(vals) and all(v == "ok" for v in vals)

    @property
    def compile_failed(self) -> bool:
        return any(v == "failed" for v in self.compiled.values())


def _fields(sku: str) -> dict:
    parts = sku.split("/")
    names = ("category", "op", "scope", "mode", "element", "aux_element", "arch", "backend", "precision")
    if len(parts) != len(names):
        raise ValueError(f"SKU {sku!r} does not have {len(names)} fields")
    return dict(zip(names, parts))


def _compile_status(sku: str, sha: str, unit: str, manifest: dict, compiled: dict, archs) -> dict:
    unit_meta = manifest["units"].get(unit, {})
    rec = (compiled.get("units") or {}).get(unit)
    out = {}
    min_arch = int(_fields(sku)["arch"][2:])
    for a in archs:
        if int(a[3:]) < min_arch:
            out[a] = "n/a"
            continue
        r = (rec or {}).get("archs", {}).get(a)
        if r is None:
            out[a] = "none"
        elif rec.get("sha256") != unit_meta.get("sha256") or (rec.get("skus") or {}).get(sku) != sha:
            out[a] = "stale"
        else:
            out[a] = "ok" if r.get("ok") else "failed"
    return out


def _verify_status(sku: str, sha: str, verified: dict):
    """(status, gpus passing, detail) over every GPU's record: a current failure wins."""
    passed, failed, stale, detail = [], [], False, ""
    for gpu, rec in sorted(verified.items()):
        r = (rec.get("skus") or {}).get(sku)
        if r is None:
            continue
        if r.get("sha256") != sha:
            stale = True
            continue
        name = (rec.get("gpu") or {}).get("name", gpu)
        if r.get("passed"):
            passed.append(name)
        else:
            failed.append(name)
            detail = f"{name}: {r.get('detail', '')}"
    if failed:
        return "failed", passed, detail
    if passed:
        return "passed", passed, ""
    return ("stale" if stale else "none"), [], ""


def _bench_best(sku: str, sha: str, bench: dict):
    """The best current result over GPUs and shapes: highest % of copy (or ratio to the reference)."""
    best, stale = None, False
    for gpu, rec in sorted(bench.items()):
        for r in rec.get("results") or []:
            if r.get("sku") != sku:
                continue
            if r.get("sha256") != sha:
                stale = True
                continue
            score = r.get("pct_copy")
            if score is None:
                score = 100.0 * (r.get("speedup_ref") or 0.0)
            if best is None or score > best["score"]:
                best = {"score": score, "pct_copy": r.get("pct_copy"), "speedup_ref": r.get("speedup_ref"),
                        "gbps": r.get("gbps"), "tflops": r.get("tflops"), "shape": r.get("shape"),
                        "gpu": (rec.get("gpu") or {}).get("name", gpu),
                        "speedup_compile": r.get("speedup_compile"), "schedule": r.get("schedule")}
    return best, (stale and best is None)


@dataclass
class Audit:
    cells: list
    archs: tuple
    gpus: list
    reasons: list            # distinct exclusion reasons, numbered from 1 in this order

    def summary(self) -> dict:
        gen = [c for c in self.cells if c.generated]
        n = len(gen)
        verified = sum(c.verified == "passed" for c in gen)
        return {
            "cells": len(self.cells),
            "generated": n,
            "excluded": len(self.cells) - n,
            "compiled": sum(c.compiled_ok for c in gen),
            "compile_failed": sum(c.compile_failed for c in gen),
            "verified": verified,
            "verified_pct": round(100.0 * verified / n, 1) if n else 0.0,
            "failed": sum(c.verified == "failed" for c in gen),
            "stale": sum(c.verified == "stale" for c in gen),
            "benchmarked": sum(c.bench is not None for c in gen),
        }

    def summary_line(self) -> str:
        s = self.summary()
        return (f"generated {s['generated']}, compiled {s['compiled']}, verified {s['verified']} "
                f"({s['verified_pct']:.1f}%), stale {s['stale']}, failed {s['failed']}, "
                f"excluded {s['excluded']}, benchmarked {s['benchmarked']}")

    def ops(self) -> list:
        seen = []
        for c in self.cells:
            key = (c.category, c.op)
            if key not in seen:
                seen.append(key)
        return seen


def collect(manifest: dict, compiled: Optional[dict] = None, verified: Optional[dict] = None,
            bench: Optional[dict] = None, archs=DEFAULT_ARCHS, pattern: str = "*") -> Audit:
    """The audit of ``manifest`` against the records. ``verified`` / ``bench``: ``{gpu: record}``."""
    compiled = compiled or {}
    verified = verified or {}
    bench = bench or {}
    archs = tuple(arch_key(a) for a in archs)
    cells, reasons = [], []
    for sku, e in manifest["kernels"].items():
        if not fnmatch.fnmatchcase(sku, pattern):
            continue
        f = _fields(sku)
        status, gpus, detail = _verify_status(sku, e["sha256"], verified)
        best, bstale = _bench_best(sku, e["sha256"], bench)
        cells.append(CellStatus(sku=sku, family=e.get("family", ""), generated=True,
                                compiled=_compile_status(sku, e["sha256"], e["unit"], manifest, compiled, archs),
                                verified=status, gpus=gpus, verify_detail=detail, bench=best, bench_stale=bstale, **f))
    for sku, e in manifest.get("excluded", {}).items():
        if not fnmatch.fnmatchcase(sku, pattern):
            continue
        reason = e.get("reason") or "excluded (no reason given)"
        cells.append(CellStatus(sku=sku, family=e.get("family", ""), generated=False, reason=reason, **_fields(sku)))
    cells.sort(key=lambda c: c.sku)
    for c in cells:                      # reasons numbered in SKU order: stable across runs
        if c.reason is not None and c.reason not in reasons:
            reasons.append(c.reason)
    gpus = sorted({(rec.get("gpu") or {}).get("name", g) for g, rec in verified.items()}
                  | {(rec.get("gpu") or {}).get("name", g) for g, rec in bench.items()})
    return Audit(cells, archs, gpus, reasons)


def load(records: Path = None, archs=DEFAULT_ARCHS, pattern="*", manifest_root=None) -> Audit:
    records = Path(records or audit_dir())
    return collect(load_manifest(manifest_root), read_json(records / "compiled.json", {}),
                   records_in(records / "verified"), records_in(records / "bench"), archs, pattern)
