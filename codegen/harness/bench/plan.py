"""What a bench run measures: the SKUs, each with its workload module, at the shapes of the
default subset, ``--all``, ``--quick`` or ``--shapes`` (docs/audit.md, "Default selection")."""
from __future__ import annotations

from ..families import module_for

# The standard shapes (docs/audit.md); the first two are the bandwidth shapes of the targets, the last is latency.
STANDARD_SHAPES = ((8192, 8192), (65536, 4096), (4096, 14336), (16, 4096))
LARGE_SHAPES = ((8192, 8192), (65536, 4096))
DEFAULT_SHAPES = LARGE_SHAPES              # --all: STANDARD_SHAPES
QUICK_SHAPES = ((8192, 8192), (16, 4096))
DEFAULT_KINDS = {"bf16", "f16", "f32", "s8", "-"}
DEFAULT_COMPILE_KINDS = {"bf16"}            # torch.compile baseline by default (--all: every SKU)


def parse_shapes(text: str) -> list:
    """``"8192x8192,16x4096"`` -> [(8192, 8192), (16, 4096)]."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            try:
                out.append(tuple(int(v) for v in part.split("x")))
            except ValueError:
                raise SystemExit(f"--shapes: {part!r} is not like 8192x8192") from None
    return out


def default_subset(sku) -> bool:
    """Per op: scopes x {bf16, f16, f32} with s8 for the quantized side, symmetric mode."""
    kinds = {sku.element, sku.aux_element or "-"}
    return kinds <= DEFAULT_KINDS and sku.mode in (None, "symmetric")


def plan(skus, modules, *, all_skus=False, shapes=None, quick=False) -> list:
    """[(sku, module, shape)] to run: the default subset unless ``all_skus``."""
    out = []
    for sku in skus:
        m = module_for(sku, modules)
        if m is None:
            continue
        chosen = all_skus or (m.default(sku) if hasattr(m, "default") else default_subset(sku))
        if not chosen:
            continue
        if hasattr(m, "SHAPES"):
            sh = getattr(m, "QUICK_SHAPES", m.SHAPES[:1]) if quick else m.SHAPES
        elif shapes or quick or all_skus:
            sh = shapes or (QUICK_SHAPES if quick else STANDARD_SHAPES)
        else:   # default: the two large shapes; every standard shape for the bf16 kernels
            sh = STANDARD_SHAPES if {sku.element, sku.aux_element} & DEFAULT_COMPILE_KINDS else DEFAULT_SHAPES
        out += [(sku, m, tuple(s) if isinstance(s, list) else s) for s in sh]
    return out
