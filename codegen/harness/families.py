"""The kernel families the harness knows, in one table, and the look-ups verify, bench and tune make in it.

Per family (:class:`Family`): the module of its GPU checkers (``checks``), the module of its bench
workloads (``workloads``) and the SKUs ``tune`` measures by default (``tune``). A command imports a
family's module by the name written here when it first needs it; one that fails to import is
skipped (``bench`` and ``tune`` say so; ``verify`` records its SKUs as "no checker"), the other
families still run.

A checks module provides ``CHECKERS = {op: fn(sku, rng, preferred_fw="cupy") -> CheckResult}`` and
may provide ``handles(sku)``: then its checkers take only the SKUs where it holds, in front of the
plain checkers of the same ops. A workloads module provides ``make(sku, shape)`` and either ``OPS``
or ``handles(sku)``, plus the optional attributes docs/audit.md lists ("Workload modules").
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Family:
    name: str           # the bench section (and the key of its ceiling in a bench record)
    checks: str         # module: CHECKERS, optional handles(sku)
    workloads: str      # module: make(sku, shape), OPS or handles(sku), ...
    tune: tuple = ()    # SKU globs `tune` measures by default (one code kind per kernel template)


def _tune(op: str, *pairs: str, mode: str = "symmetric") -> tuple:
    return tuple(f"quantization/{op}/*/{mode}/{pair}/*" for pair in pairs)


# The order is the order of the look-ups (modules with ``handles`` first, then by op) and of the
# host-overhead rows a bench run records.
FAMILIES = (
    Family("dynamic", "codegen.harness.checks.dynamic", "codegen.harness.workloads.dynamic",
           tune=_tune("dynamic_quantize", "bf16/s8")),
    Family("lowbit", "codegen.harness.checks.lowbit", "codegen.harness.workloads.lowbit",
           tune=_tune("quantize", "bf16/s4", "bf16/fp8_e4m3") + _tune("dequantize", "s4/bf16", "fp8_e4m3/bf16")
           + _tune("dynamic_quantize", "bf16/s4", "bf16/fp8_e4m3")),
    Family("moe", "codegen.harness.checks.moe", "codegen.harness.workloads.moe"),
    Family("static", "codegen.harness.checks.static", "codegen.harness.workloads.static",
           tune=_tune("quantize", "bf16/s8") + _tune("dequantize", "s8/bf16")),
    Family("training", "codegen.harness.checks.training", "codegen.harness.workloads.training",
           tune=tuple(g for op in ("fake_quantize", "fake_quantize_backward", "quantize_backward")
                      for g in _tune(op, "bf16/bf16")) + _tune("dequantize_backward", "bf16/bf16", mode="-")),
)


@functools.cache
def _import(name: str) -> tuple:
    """(module, None), or (None, "Type: message") when it fails to import (tried once)."""
    try:
        return importlib.import_module(name), None
    except Exception as e:  # noqa: BLE001 - one family must not stop the others
        return None, f"{type(e).__name__}: {e}"


def modules(part: str, warn=None, families=FAMILIES) -> list:
    """The families' ``part`` modules ("checks" or "workloads"), in table order; one that fails to
    import is reported through ``warn`` ("skipping <module>: <error>") and left out."""
    out = []
    for family in families:
        name = getattr(family, part)
        module, error = _import(name)
        if module is not None:
            out.append(module)
        elif warn is not None:
            warn(f"skipping {name}: {error}")
    return out


def workload_modules(warn=print, families=FAMILIES) -> list:
    """The bench workload modules (a family module that fails to import is reported and skipped)."""
    return modules("workloads", lambda text: warn(f"bench: {text}"), families)


def module_for(sku, workloads):
    """The workload module of a SKU: one whose ``handles(sku)`` says so first (specific), then by ``OPS``."""
    for m in workloads:
        if hasattr(m, "handles") and m.handles(sku):
            return m
    for m in workloads:
        if not hasattr(m, "handles") and sku.op in getattr(m, "OPS", ()):
            return m
    return None


def checker_for(sku, families=FAMILIES) -> Optional[object]:
    """The checker of ``sku``: a checks module's whose ``handles(sku)`` holds first, then the plain
    one of its op; None when no family checks it."""
    checks = modules("checks", families=families)
    for m in checks:
        if hasattr(m, "handles") and sku.op in m.CHECKERS and m.handles(sku):
            return m.CHECKERS[sku.op]
    for m in checks:
        if not hasattr(m, "handles") and sku.op in m.CHECKERS:
            return m.CHECKERS[sku.op]
    return None


def tune_filters(families=FAMILIES) -> tuple:
    """The SKU globs ``tune`` measures when given no ``--filter``."""
    return tuple(glob for family in families for glob in family.tune)
