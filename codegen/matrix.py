"""The matrix: every cell skuforge considers, in one declarative place.

A :class:`Family` is a block of the dtype x op x scope matrix that one template renders.
Its cells are the product of its axes; an :class:`Exclusion` names cells that are *not*
generated and says why (the manifest and the audit show the reason). Adding a dtype or a
scope is a one-line change to a tuple below plus, at most, a template branch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from runtime.sku import KernelSku, Precision

# -- element kinds -------------------------------------------------------------------------
FLOATS = ("f32", "f64", "f16", "bf16")
INTS = ("s8", "u8")
LOW_BIT = ("s4", "u4", "fp8_e4m3", "fp8_e5m2")          # issue 5
QUANT_SCOPES = ("tensor", "channel", "token", "group")
QUANT_MODES = ("symmetric", "asymmetric")

# C storage type and byte size of each element kind, as the templates spell them.
CTYPE = {"f32": "float", "f64": "double", "f16": "f16_t", "bf16": "bf16_t",
         "s8": "s8_t", "u8": "u8_t", "i32": "i32_t", "u32": "u32_t"}
SIZE = {"f32": 4, "f64": 8, "f16": 2, "bf16": 2, "s8": 1, "u8": 1, "i32": 4, "u32": 4}
# Full range of each integer kind (the default qmin/qmax of the static ops).
QRANGE = {"s8": (-128, 127), "u8": (0, 255), "s4": (-8, 7), "u4": (0, 15)}


def math_of(element: str) -> str:
    """All math in float32 after upcasting f16/bf16 (float64 for f64): SPEC §5."""
    return "f64" if element == "f64" else "f32"


@dataclass(frozen=True)
class Exclusion:
    """Cells matching ``when`` are not generated, for ``reason``."""

    reason: str
    when: Callable[[KernelSku], bool]


@dataclass(frozen=True)
class Stream:
    """One array the kernel reads or writes element by element."""

    name: str
    element: str  # an element kind, or "math" / "input" resolved per SKU


@dataclass(frozen=True)
class Family:
    """A block of cells rendered by one template with one launch convention."""

    name: str
    category: str
    ops: tuple
    template: str                       # per-op: "{op}" is substituted
    pairs: tuple                        # (element, aux_element) pairs
    scopes: tuple = (None,)
    modes: tuple = (None,)
    arches: tuple = ("sm80",)
    backends: tuple = ("simt",)
    launch: str = "elementwise"         # the runtime launcher that drives these kernels
    ins: tuple = ()
    outs: tuple = ()
    nvrtc_options: tuple = ("--fmad=false",)  # exact IEEE products: bit-equal to NumPy
    exclusions: tuple = ()
    # Optional hook: (cell, ctx) -> dict of extra template context; a "launch" key in the
    # returned dict is merged into the kernel's manifest launch metadata.
    extra_context: Optional[Callable] = None
    precision: Optional[Callable] = None   # sku fields -> Precision; default: exact math of SPEC §5

    def cells(self) -> Iterator[KernelSku]:
        for op, scope, mode, (el, aux), arch, backend in itertools.product(
                self.ops, self.scopes, self.modes, self.pairs, self.arches, self.backends):
            prec = (self.precision(op, scope, mode, el, aux, arch, backend) if self.precision
                     else Precision(math_of(el if el in FLOATS else aux)))
            yield KernelSku(self.category, op, scope, mode, el, aux, arch, backend, prec)

    def excluded(self, sku: KernelSku) -> Optional[str]:
        for ex in self.exclusions:
            if ex.when(sku):
                return ex.reason
        return None

    def unit(self, sku: KernelSku) -> str:
        """Translation unit (one NVRTC compile) that holds the kernel: by op and dtypes."""
        parts = [sku.op, sku.element] + ([sku.aux_element] if sku.aux_element else [])
        return f"{self.category}/{'_'.join(parts)}.cu"

    def template_for(self, sku: KernelSku) -> str:
        return self.template.format(op=sku.op)


def _not_yet(kinds, issue):
    return Exclusion(f"not implemented yet: low-bit formats are planned in issue {issue}",
                     lambda s, kinds=kinds: s.element in kinds or s.aux_element in kinds)


STATIC_QUANTIZE = Family(
    name="static-quantize",
    category="quantization",
    ops=("quantize",),
    template="quantization/{op}.cu.j2",
    pairs=tuple(itertools.product(FLOATS, INTS + LOW_BIT)),
    scopes=QUANT_SCOPES,
    modes=QUANT_MODES,
    ins=(Stream("x", "element"),),
    outs=(Stream("q", "aux"),),
    exclusions=(_not_yet(LOW_BIT, 5),),
)

STATIC_DEQUANTIZE = Family(
    name="static-dequantize",
    category="quantization",
    ops=("dequantize",),
    template="quantization/{op}.cu.j2",
    pairs=tuple(itertools.product(INTS + LOW_BIT, FLOATS)),
    scopes=QUANT_SCOPES,
    modes=QUANT_MODES,
    ins=(Stream("q", "element"),),
    outs=(Stream("y", "aux"),),
    exclusions=(_not_yet(LOW_BIT, 5),),
)

FAMILIES: tuple = (STATIC_QUANTIZE, STATIC_DEQUANTIZE)


@dataclass(frozen=True)
class Cell:
    sku: KernelSku
    family: Family
    reason: Optional[str] = None  # set when the cell is excluded

    @property
    def generated(self) -> bool:
        return self.reason is None


def cells(families=FAMILIES) -> list:
    """Every considered cell, sorted by SKU: generated and excluded alike."""
    out = [Cell(sku, fam, fam.excluded(sku)) for fam in families for sku in fam.cells()]
    skus = [c.sku for c in out]
    if len(set(skus)) != len(skus):
        raise AssertionError("two families declare the same SKU")
    return sorted(out, key=lambda c: c.sku)
