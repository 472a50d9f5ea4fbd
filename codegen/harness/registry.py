"""Where the per-family checkers and bench workloads register themselves.

The generic commands (``verify``, ``bench``) never import a family module by name: they call
:func:`checkers` / :func:`workloads`, which import every module of the family packages
``codegen.harness.checks`` and ``codegen.harness.workloads`` (all but ``base``), and each
family module registers what it provides when it is imported:

    @checker("dynamic_quantize")                   # the checker of an op
    def check_dynamic(sku, rng, preferred_fw="cupy") -> CheckResult: ...

    @checker("quantize", "dequantize", when=is_lowbit)   # wins over the plain one where ``when(sku)``

    @bench_section("dynamic")                      # this module is the bench section "dynamic"
    def make(sku, shape): ...

A new family is a new file in one of the two packages; nothing else changes. Family modules
import only this module and their package's ``base`` (one direction; enforced by
import-linter, see pyproject.toml).
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

CHECKS_PACKAGE = "codegen.harness.checks"
WORKLOADS_PACKAGE = "codegen.harness.workloads"

_CHECKERS: dict = {}        # op -> checker
_SPECIFIC: list = []        # [(ops, when, checker)]: consulted first, in registration order
_SECTIONS: dict = {}        # section name -> module
_LOADED: dict = {}          # package -> [(module name, error or None)]


def checker(*ops, when=None):
    """Register ``fn(sku, rng, preferred_fw="cupy") -> CheckResult`` for ``ops``; with ``when``,
    only for the SKUs where ``when(sku)`` holds (these win over the plain checker of the op)."""
    def deco(fn):
        if when is None:
            for op in ops:
                _CHECKERS[op] = fn
        else:
            _SPECIFIC.append((frozenset(ops), when, fn))
        return fn
    return deco


def bench_section(name: str):
    """Decorate a workload module's ``make(sku, shape)``: the module becomes bench section ``name``
    (its attributes ``OPS``, ``SHAPES``, ``handles``, ``default``, ``host_calls`` ...: bench.py)."""
    def deco(make):
        _SECTIONS[name] = sys.modules[make.__module__]
        return make
    return deco


def load(package: str, warn=None) -> list:
    """Import every module of ``package`` except ``base`` (once); one that fails to import is
    reported through ``warn`` and skipped. Returns [(module name, error text or None)]."""
    if package not in _LOADED:
        pkg = importlib.import_module(package)
        out = []
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
            if info.name == "base" or info.name.startswith("_"):
                continue
            name = f"{package}.{info.name}"
            try:
                importlib.import_module(name)
                out.append((name, None))
            except Exception as e:  # noqa: BLE001 - one family must not stop the others
                out.append((name, f"{type(e).__name__}: {e}"))
        _LOADED[package] = out
    if warn is not None:
        for name, err in _LOADED[package]:
            if err:
                warn(f"skipping {name}: {err}")
    return _LOADED[package]


def checker_for(sku):
    """The registered checker of ``sku`` (specific ones first), or None."""
    load(CHECKS_PACKAGE)
    for ops, when, fn in _SPECIFIC:
        if sku.op in ops and when(sku):
            return fn
    return _CHECKERS.get(sku.op)


def checkers() -> dict:
    """{op: checker} of the plain checkers (every family loaded)."""
    load(CHECKS_PACKAGE)
    return dict(_CHECKERS)


def sections(warn=None) -> dict:
    """{section name: workload module}, every family loaded (a broken one reported and skipped)."""
    load(WORKLOADS_PACKAGE, warn)
    return dict(sorted(_SECTIONS.items()))
