"""The matrix: every cell skuforge considers, crossed from the blocks of every family
(codegen/families/), generated and excluded alike.

A cell is one SKU with the block that renders it and the family that owns it; an excluded cell
carries the reason its block's :class:`~codegen.spec.Exclusion` gives (the manifest and the audit
show it).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Optional

from runtime.sku import KernelSku

from .families import FAMILIES
from .spec import Block, Family, LocalMemory


@dataclass(frozen=True)
class Cell:
    sku: KernelSku
    block: Block
    family: Family
    reason: Optional[str] = None  # set when the cell is excluded

    @property
    def generated(self) -> bool:
        return self.reason is None


def cells(families=FAMILIES) -> list:
    """Every considered cell of ``families``, sorted by SKU: generated and excluded alike."""
    out = [Cell(sku, block, fam, block.excluded(sku)) for fam in families for block in fam.blocks
           for sku in block.cells()]
    skus = [c.sku for c in out]
    if len(set(skus)) != len(skus):
        raise AssertionError("two blocks declare the same SKU")
    return sorted(out, key=lambda c: c.sku)


def local_memory_allowed(symbol: str, stack_bytes: int, families=FAMILIES) -> Optional[LocalMemory]:
    """The allowance (a family's ``local_memory``) that lets ``symbol`` have a stack frame of
    ``stack_bytes``, if any."""
    for fam in families:
        for entry in fam.local_memory:
            if fnmatch.fnmatchcase(symbol, entry.pattern) and stack_bytes <= entry.max_bytes:
                return entry
    return None
