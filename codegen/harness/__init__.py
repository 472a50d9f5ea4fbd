"""The verification / benchmark / audit harness (``python -m codegen verify | bench | tune | audit``).

Kept apart from the generator (``codegen.families`` -> ``matrix`` -> ``render`` -> ``manifest``, the build
commands in ``codegen.cli``): it may use the generator and the runtime, nothing in the
generator uses it (import-linter contracts in pyproject.toml).

    families.py        the kernel families, one table: per family its checks module, workloads module, tune SKUs
    records.py         audit/ records shared by the commands: paths, JSON, commit, GPU slug
    checks/base.py     what the checkers share; checks/<family>.py: one family each
    workloads/base.py  what the bench workloads share; workloads/<family>.py: one family each
    verify.py          `verify`: every selected SKU through its family's checker, recorded
    bench/             `bench`: the families' workloads against a device copy and PyTorch, recorded
    tune.py            `tune`: every schedule variant timed per size bucket, the arch's tuning table written
    audit/             `audit`: the coverage table from the manifest and the records
"""
from __future__ import annotations

from . import audit, tune, verify
from .bench import cli as bench

COMMANDS = (audit, verify, bench, tune)


def add_parsers(sub) -> None:
    """Add the harness subcommands (audit, verify, bench, tune) to the CLI's subparsers."""
    for module in COMMANDS:
        module.add_parser(sub)
