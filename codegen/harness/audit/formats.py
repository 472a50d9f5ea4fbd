"""The audit's tables (per op: rows = the fields that vary but scope, columns = scope) and its formats:
terminal (rich), Markdown, JSON, a self-contained HTML heat map."""
from __future__ import annotations

import html as _html
import io
import json
from dataclasses import asdict
from typing import Optional

from runtime import kinds
from runtime.axes import ARCHES, BACKENDS, MODES, NONE

from ..records import now
from .model import SCHEMA, Audit, CellStatus

SCOPE_ORDER = ("tensor", "channel", "token", "group", "-")
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

    from ...terminal import console as new_console
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
