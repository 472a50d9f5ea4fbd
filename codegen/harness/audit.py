"""``python -m codegen audit``: coverage of the dtype x op x scope matrix, no GPU needed.

The audit reads only records: ``generated/manifest.json`` (what exists, what is excluded and
why), ``audit/compiled.json`` (``python -m codegen compile --record``), ``audit/verified/*.json``
(``python -m codegen verify``) and ``audit/bench/*.json`` (``python -m codegen bench``). It has
no per-family code: a new family appears in it as soon as it is in the manifest.

A record counts only at the *current* source: a verification or a compile whose sha256 differs
from the manifest's shows as stale. Formats: ``term`` (rich), ``md``, ``json``, ``html`` (a
self-contained heat map). ``--update-readme`` rewrites the block of README.md between
``<!-- audit:begin -->`` and ``<!-- audit:end -->``. File formats: docs/audit.md.
"""
from __future__ import annotations

import argparse
import fnmatch
import html as _html
import io
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from runtime import kinds
from runtime.axes import ARCHES, BACKENDS, MODES, NONE

from .records import ROOT, add_records_argument, audit_dir, now, read_json, write_json

README = ROOT / "README.md"
BEGIN, END = "<!-- audit:begin -->", "<!-- audit:end -->"
SCHEMA = 1
DEFAULT_ARCHS = ("sm_80", "sm_90")
SCOPE_ORDER = ("tensor", "channel", "token", "group", "-")


def load_manifest(root: Optional[Path] = None) -> dict:
    from ..manifest import GENERATED, MANIFEST
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


# -- tables: per op, rows = varying fields except scope, columns = scope ---------------------------
ROW_FIELDS = ("element", "aux_element", "mode", "arch", "backend", "precision")


def op_table(audit: Audit, category: str, op: str):
    """(row field names, scope columns, {row key: {scope: cell}}) for one op."""
    cells = [c for c in audit.cells if c.category == category and c.op == op]
    varying = ["element"] + (["aux_element"] if any(c.aux_element != "-" for c in cells) else [])
    for f in ROW_FIELDS[2:]:
        # a field joins the row label only when it is not implied by the fields already there
        groups: dict = {}
        for c in cells:
            groups.setdefault((tuple(getattr(c, g) for g in varying), c.scope), set()).add(getattr(c, f))
        if any(len(v) > 1 for v in groups.values()):
            varying.append(f)
    scopes = sorted({c.scope for c in cells}, key=lambda s: SCOPE_ORDER.index(s) if s in SCOPE_ORDER else 99)
    rows: dict = {}
    for c in cells:
        key = tuple(getattr(c, f) for f in varying)
        rows.setdefault(key, {})[c.scope] = c
    return varying, scopes, rows


_VOCAB = kinds.ELEMENTS + MODES + ARCHES + BACKENDS + (NONE,)


def row_order(key) -> tuple:
    """Sort rows in vocabulary order (f16, bf16, f32, f64, s8, ...), unknown values last."""
    return tuple((_VOCAB.index(v), "") if v in _VOCAB else (len(_VOCAB), v) for v in key)


def _scope_title(scope: str) -> str:
    return "(no scope)" if scope == "-" else scope


def row_label(fields, key) -> str:
    d = dict(zip(fields, key))
    parts = []
    el, aux = d.pop("element", None), d.pop("aux_element", None)
    if el is not None:
        parts.append(el + (f" → {aux}" if aux not in (None, "-") else ""))
    parts += [v for v in d.values() if v != "-"]
    return " · ".join(parts)


def bench_text(b: Optional[dict]) -> str:
    if not b:
        return ""
    if b.get("pct_copy") is not None:
        return f"{b['pct_copy']:.0f}%"
    if b.get("speedup_ref") is not None:
        return f"{b['speedup_ref']:.2f}×ref"
    return ""


def cell_code(c: CellStatus, audit: Audit) -> str:
    """Short status: ``—1`` excluded (reason 1) · ``G`` generated · ``C`` compiled on every target
    arch (``C!`` a compile failed, ``C~`` stale, ``c`` some archs) · ``V`` verified at the current
    source (``V!`` failed, ``V~`` stale) · best bandwidth in % of copy."""
    if not c.generated:
        return f"—{audit.reasons.index(c.reason) + 1}"
    parts = []
    vals = [v for v in c.compiled.values() if v != "n/a"]
    if c.compile_failed:
        parts.append("C!")
    elif c.compiled_ok:
        parts.append("C")
    elif any(v == "ok" for v in vals):
        parts.append("c")
    elif any(v == "stale" for v in vals):
        parts.append("C~")
    parts.append({"passed": "V", "failed": "V!", "stale": "V~"}.get(c.verified, ""))
    bt = bench_text(c.bench)
    if bt:
        parts.append(bt)
    text = " ".join(p for p in parts if p)
    return text or "G"


LEGEND = ("`V` verified on a GPU at the current source sha256 (`V!` failed, `V~` only stale records) · "
          "`C` compiles with NVRTC on every target arch (`C!` failed, `C~` stale record, `c` some archs) · "
          "`G` generated, no record yet · `—n` excluded, reason n below · `NN%` best measured bandwidth "
          "in % of device-to-device copy (`×ref` for compute kernels: speed-up over the PyTorch reference)")


def _cell_tooltip(c: CellStatus) -> str:
    if not c.generated:
        return f"{c.sku}\nexcluded: {c.reason}"
    lines = [c.sku, "compiled: " + ", ".join(f"{a} {v}" for a, v in c.compiled.items())]
    lines.append(f"verified: {c.verified}" + (f" on {', '.join(c.gpus)}" if c.gpus else "")
                 + (f" ({c.verify_detail})" if c.verify_detail else ""))
    if c.bench:
        b = c.bench
        lines.append(f"best: {bench_text(b)} {b.get('gbps') and round(b['gbps']) or ''} GB/s on "
                     f"{b.get('shape')} ({b.get('gpu')})" + (f", schedule {b['schedule']}" if b.get("schedule") else ""))
    elif c.bench_stale:
        lines.append("benchmark: stale")
    return "\n".join(lines)


# -- formats ----------------------------------------------------------------------------------------
def to_json(audit: Audit) -> str:
    cells = []
    for c in audit.cells:
        d = asdict(c)
        d["compiled_ok"] = c.compiled_ok
        d["code"] = cell_code(c, audit)
        cells.append(d)
    return json.dumps({"schema": SCHEMA, "summary": audit.summary(), "archs": list(audit.archs),
                       "gpus": audit.gpus, "reasons": audit.reasons, "cells": cells}, indent=1) + "\n"


def op_summary(audit: Audit) -> list:
    """Per op: (op, generated, compiled, verified, stale, failed, excluded, best bench result or None)."""
    out = []
    for category, op in audit.ops():
        cells = [c for c in audit.cells if c.op == op and c.category == category]
        gen = [c for c in cells if c.generated]
        benched = [c.bench for c in gen if c.bench]
        best = max(benched, key=lambda b: b["score"]) if benched else None
        out.append((f"{category}/{op}", len(gen), sum(c.compiled_ok for c in gen),
                    sum(c.verified == "passed" for c in gen), sum(c.verified == "stale" for c in gen),
                    sum(c.verified == "failed" for c in gen), len(cells) - len(gen), best))
    return out


def to_markdown(audit: Audit, heading_level: int = 3) -> str:
    """Summary per op, then per op a table of the rows that have a generated cell; rows where
    every cell is excluded are listed in one line per reason under their table."""
    h = "#" * heading_level
    out = io.StringIO()
    out.write(f"**{audit.summary_line()}** (compile targets: {', '.join(audit.archs)}; "
              f"GPUs with records: {', '.join(audit.gpus) or 'none'})\n\n")
    out.write("| op | generated | compiled | verified | stale | failed | excluded | best |\n"
              "|---|---|---|---|---|---|---|---|\n")
    for op, n, comp, ver, stale, failed, exc, best in op_summary(audit):
        out.write(f"| {op} | {n} | {comp} | {ver} | {stale} | {failed} | {exc} | {bench_text(best)} |\n")
    out.write("\n" + LEGEND + "\n\n")
    for category, op in audit.ops():
        fields, scopes, rows = op_table(audit, category, op)
        cells = [c for c in audit.cells if c.op == op and c.category == category]
        gen = [c for c in cells if c.generated]
        ver = sum(c.verified == "passed" for c in gen)
        out.write(f"{h} {category}/{op}: {len(gen)} generated, {ver} verified, {len(cells) - len(gen)} excluded\n\n")
        shown = [k for k in sorted(rows, key=row_order) if any(c.generated for c in rows[k].values())]
        hidden: dict = {}
        for k in sorted(rows, key=row_order):
            if k not in shown:
                tag = " ".join(sorted({cell_code(c, audit) for c in rows[k].values()}))
                hidden.setdefault(tag, []).append(row_label(fields, k))
        if shown:
            out.write("| " + " · ".join(f.replace("aux_element", "out").replace("element", "in") for f in fields)
                      + " | " + " | ".join(_scope_title(s) for s in scopes) + " |\n")
            out.write("|---|" + "---|" * len(scopes) + "\n")
            for key in shown:
                out.write(f"| {row_label(fields, key)} | "
                          + " | ".join(cell_code(rows[key][sc], audit) if sc in rows[key] else "" for sc in scopes)
                          + " |\n")
            out.write("\n")
        for tag, labels in hidden.items():
            out.write(f"Not generated ({tag}): " + ", ".join(f"`{lab}`" for lab in labels) + "\n\n")
    if audit.reasons:
        out.write("Excluded cells:\n\n")
        for i, r in enumerate(audit.reasons, 1):
            n = sum(1 for c in audit.cells if c.reason == r)
            out.write(f"{i}. {r} ({n} cells)\n")
        out.write("\n")
    return out.getvalue()


def _color(c: CellStatus) -> str:
    if not c.generated:
        return "#e5e7eb"
    if c.verified == "failed" or c.compile_failed:
        return "#f87171"
    if c.verified == "passed":
        pct = (c.bench or {}).get("pct_copy")
        if pct is None:
            return "#86efac"
        t = max(0.0, min(1.0, pct / 100.0))          # darker green = closer to copy bandwidth
        return f"hsl(142, 65%, {round(88 - 48 * t)}%)"
    if c.verified == "stale":
        return "#fdba74"
    if c.compiled_ok:
        return "#bfdbfe"
    return "#ffffff"


def to_html(audit: Audit) -> str:
    esc = _html.escape
    out = io.StringIO()
    out.write("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
              "<title>skuforge coverage audit</title>\n<style>\n"
              "body{font:14px system-ui,sans-serif;margin:2em;color:#111}"
              "table{border-collapse:collapse;margin:0 0 2em}"
              "th,td{border:1px solid #9ca3af;padding:4px 8px;text-align:center;white-space:nowrap}"
              "th.row{text-align:left;font-weight:normal;font-family:monospace}"
              "td{font-family:monospace;min-width:5em}"
              ".legend span{display:inline-block;padding:2px 8px;margin-right:6px;border:1px solid #9ca3af}"
              "</style></head><body>\n")
    out.write(f"<h1>skuforge coverage audit</h1>\n<p><b>{esc(audit.summary_line())}</b><br>"
              f"compile targets: {esc(', '.join(audit.archs))}; GPUs with records: "
              f"{esc(', '.join(audit.gpus) or 'none')}; generated {esc(now())}</p>\n")
    out.write('<p class="legend">'
              '<span style="background:hsl(142,65%,40%)">verified, ~100% of copy</span>'
              '<span style="background:hsl(142,65%,80%)">verified, slow</span>'
              '<span style="background:#86efac">verified, not benchmarked</span>'
              '<span style="background:#bfdbfe">compiles</span>'
              '<span style="background:#fff">generated</span>'
              '<span style="background:#fdba74">stale record</span>'
              '<span style="background:#f87171">failed</span>'
              '<span style="background:#e5e7eb">excluded</span>'
              " (hover a cell for details)</p>\n")
    out.write(f"<p>{esc(LEGEND).replace('`', '')}</p>\n")
    for category, op in audit.ops():
        fields, scopes, rows = op_table(audit, category, op)
        out.write(f"<h2>{esc(category)}/{esc(op)}</h2>\n<table><tr><th></th>"
                  + "".join(f"<th>{esc(_scope_title(s))}</th>" for s in scopes) + "</tr>\n")
        for key in sorted(rows, key=row_order):
            out.write(f'<tr><th class="row">{esc(row_label(fields, key))}</th>')
            for sc in scopes:
                c = rows[key].get(sc)
                if c is None:
                    out.write("<td></td>")
                else:
                    out.write(f'<td style="background:{_color(c)}" title="{esc(_cell_tooltip(c))}">'
                              f"{esc(cell_code(c, audit))}</td>")
            out.write("</tr>\n")
        out.write("</table>\n")
    if audit.reasons:
        out.write("<h2>Excluded cells</h2><ol>"
                  + "".join(f"<li>{esc(r)}</li>" for r in audit.reasons) + "</ol>\n")
    out.write("</body></html>\n")
    return out.getvalue()


def print_terminal(audit: Audit, console=None) -> None:
    from rich.table import Table

    from ..terminal import console as new_console
    console = console or new_console()
    style = {"V": "green", "V!": "bold red", "V~": "yellow", "C!": "bold red", "C~": "yellow"}
    for category, op in audit.ops():
        fields, scopes, rows = op_table(audit, category, op)
        console.print(f"[bold]{category}/{op}[/bold]")
        t = Table(show_lines=False)
        t.add_column(" · ".join(fields).replace("aux_element", "out").replace("element", "in"))
        for s in scopes:
            t.add_column(_scope_title(s), justify="center")
        hidden: dict = {}
        for key in sorted(rows, key=row_order):
            if not any(c.generated for c in rows[key].values()):
                tag = " ".join(sorted({cell_code(c, audit) for c in rows[key].values()}))
                hidden.setdefault(tag, []).append(row_label(fields, key))
                continue
            vals = []
            for sc in scopes:
                c = rows[key].get(sc)
                if c is None:
                    vals.append("")
                    continue
                code = cell_code(c, audit)
                if not c.generated:
                    vals.append(f"[dim]{code}[/dim]")
                    continue
                vals.append(" ".join(f"[{style[p]}]{p}[/{style[p]}]" if p in style else p for p in code.split()))
            t.add_row(row_label(fields, key), *vals)
        console.print(t)
        for tag, labels in hidden.items():
            console.print(f"[dim]  not generated ({tag}): {', '.join(labels)}[/dim]")
    for i, r in enumerate(audit.reasons, 1):
        console.print(f"[dim]—{i}: {r}[/dim]")
    console.print(LEGEND.replace("`", ""), style="dim")
    console.print(audit.summary_line(), style="bold")


def update_readme(markdown: str, path: Path = README) -> bool:
    """Replace the block between the markers (appended at the end when missing). True if changed."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    block = f"{BEGIN}\n<!-- generated by `python -m codegen audit --update-readme`; do not edit by hand -->\n\n" \
            f"{markdown.rstrip()}\n\n{END}"
    if BEGIN in text and END in text and text.index(BEGIN) < text.index(END):
        new = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        new = text.rstrip("\n") + ("\n\n" if text.strip() else "") + block + "\n"
    if new == text:
        return False
    path.write_text(new)
    return True


# -- CLI --------------------------------------------------------------------------------------------
def cmd_audit(args) -> int:
    archs = [arch_key(a) for a in args.arch.split(",") if a.strip()]
    audit = load(Path(args.records), archs, args.filter, args.generated)
    if not audit.cells:
        print(f"audit: no cell matches --filter {args.filter!r}", file=sys.stderr)
        return 2
    if args.update_readme:
        changed = update_readme(to_markdown(audit), Path(args.readme))
        print(f"{args.readme}: audit block {'updated' if changed else 'already up to date'}", file=sys.stderr)
    fmt = args.format
    if fmt == "term" and args.output:
        fmt = "md"
    if fmt == "term":
        if not args.update_readme:
            print_terminal(audit)
        else:
            print(audit.summary_line())
    else:
        text = {"md": to_markdown, "json": to_json, "html": to_html}[fmt](audit)
        if args.output:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(text)
            print(f"wrote {args.output}; {audit.summary_line()}", file=sys.stderr)
        else:
            sys.stdout.write(text)
    if args.fail_under is not None and audit.summary()["verified_pct"] < args.fail_under:
        print(f"audit: verified coverage {audit.summary()['verified_pct']:.1f}% is under "
              f"--fail-under {args.fail_under:g}%", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    sp = sub.add_parser("audit", help="coverage of the matrix: generated / excluded / compiled / verified / "
                        "bandwidth, per op (no GPU needed)",
                        description="Coverage of the dtype x op x scope matrix from the manifest and the records "
                                    "(generated, excluded, compiled, verified, bandwidth); no GPU needed. "
                                    "docs/audit.md.")
    sp.add_argument("--format", choices=("term", "md", "json", "html"), default="term",
                    help="output format: a terminal table, Markdown, JSON or a standalone HTML page (default term)")
    sp.add_argument("--filter", default="*", help="glob on the SKU string")
    sp.add_argument("--output", "-o", help="write to FILE instead of stdout (term becomes md)")
    sp.add_argument("--fail-under", type=float, metavar="PCT",
                    help="exit 1 when verified coverage (%% of generated SKUs) is below PCT")
    sp.add_argument("--arch", default=",".join(DEFAULT_ARCHS), help="compile targets to show (default sm_80,sm_90)")
    sp.add_argument("--update-readme", action="store_true",
                    help=f"rewrite the block between {BEGIN} and {END} in README.md with the md table")
    sp.add_argument("--readme", default=str(README), help=argparse.SUPPRESS)
    sp.add_argument("--generated", default=None, help=argparse.SUPPRESS)   # tests: another manifest
    add_records_argument(sp)
    sp.set_defaults(func=cmd_audit)
