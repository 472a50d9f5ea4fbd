"""The kernel families, registered in one table: adding a family is its folder here (its blocks, its
launch kinds, its local-memory allowances), its templates under templates/<family>/, its launcher in
the runtime, and one line below."""
from __future__ import annotations

from runtime.axes import LAUNCH_KINDS

from . import moe, quantization

FAMILIES: tuple = (quantization.FAMILY, moe.FAMILY)

_declared = [k.name for f in FAMILIES for k in f.launch_kinds]
if sorted(_declared) != sorted(LAUNCH_KINDS):
    raise ImportError(f"the families declare the launch kinds {_declared}; runtime/axes.py declares {LAUNCH_KINDS}")

KINDS: dict = {k.name: k for f in FAMILIES for k in f.launch_kinds}    # launch kind name -> its declaration
