"""``python -m codegen audit``: coverage of the dtype x op x scope matrix, no GPU needed.

The audit reads only records: ``generated/manifest.json`` (what exists, what is excluded and
why), ``audit/compiled.json`` (``python -m codegen compile --record``), ``audit/verified/*.json``
(``python -m codegen verify``) and ``audit/bench/*.json`` (``python -m codegen bench``). It has
no per-family code: a new family appears in it as soon as it is in the manifest.

A record counts only at the *current* source: a verification or a compile whose sha256 differs
from the manifest's shows as stale. Formats: ``term`` (rich), ``md``, ``json``, ``html`` (a
self-contained heat map). ``--update-readme`` rewrites the block of README.md between
``<!-- audit:begin -->`` and ``<!-- audit:end -->``. File formats: docs/audit.md.

One module per job:

    model.py     the records read into a status per cell (``collect``, ``load``), the compile record
    formats.py   the tables per op and the formats: terminal, Markdown, JSON, HTML
    cli.py       the command line and the README block

Their public names are importable from this package.
"""
from __future__ import annotations

from .cli import BEGIN, END, README, add_parser, cmd_audit, update_readme
from .formats import (LEGEND, bench_text, cell_code, op_summary, op_table, print_terminal, row_label, row_order,
                      to_html, to_json, to_markdown)
from .model import (DEFAULT_ARCHS, SCHEMA, Audit, CellStatus, arch_key, collect, load, load_manifest,
                    merge_compile_record, record_compile, records_in)

__all__ = ["BEGIN", "END", "README", "add_parser", "cmd_audit", "update_readme",
           "LEGEND", "bench_text", "cell_code", "op_summary", "op_table", "print_terminal", "row_label", "row_order",
           "to_html", "to_json", "to_markdown",
           "DEFAULT_ARCHS", "SCHEMA", "Audit", "CellStatus", "arch_key", "collect", "load", "load_manifest",
           "merge_compile_record", "record_compile", "records_in"]
