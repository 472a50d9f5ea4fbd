"""What a kernel family declares, as data: the types the families (codegen/families/) fill in.

A :class:`Family` is one unit of the generator a reader finds in one place: its matrix entries
(:class:`Block`: a block of cells rendered by one template, with named :class:`Exclusion`), its launch
kinds (:class:`LaunchKind`: the parameter lists of each group of entry points, the entry points'
names, the schedule variants), and the local memory its kernels are allowed (:class:`LocalMemory`).
The matrix (codegen/matrix.py) crosses the blocks of every family into cells; rendering
(codegen/render.py) spells a cell from its block and its launch kind.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

from runtime import kinds
from runtime.axes import LAUNCH_KINDS
from runtime.sku import KernelSku, Precision

from .abi import Signature


@dataclass(frozen=True)
class Exclusion:
    """Cells matching ``when`` are not generated, for ``reason``."""

    reason: str
    when: Callable[[KernelSku], bool]


@dataclass(frozen=True)
class Stream:
    """One array the kernel reads or writes element by element."""

    name: str
    element: str  # an element kind, or "element" / "aux": the SKU's


@dataclass(frozen=True)
class Schedule:
    """One named way to launch a kernel; ``params`` as (name, value) pairs (hashable)."""

    name: str
    params: tuple

    def as_dict(self) -> dict:
        return dict(self.params)


def schedule(name: str, **params) -> Schedule:
    return Schedule(name, tuple(sorted(params.items())))


@dataclass(frozen=True)
class LaunchKind:
    """How the kernels of one launch kind are launched (``runtime.axes.LAUNCH_KINDS``).

    ``abi``: the kernel's rendering context -> {entry-point group: [Param, ...]}, the parameter lists
    (codegen/abi.py); ``entries``: the context -> {entry point: (its group, the suffix of its symbol
    after the SKU's)}, the names under which the manifest records each entry point's symbol (a group
    the SKU launches from a host SKU, ``Block.shares``, has the host's symbols); ``schedules``: the
    named ways to launch one, default first (empty: one way), carried by the SKUs for which
    ``scheduled(ctx)`` holds (one whose parameter ``entry`` names an entry point: by the SKUs that have it). The runtime launcher of the same name fills the parameters by name,
    loads the entry points by their recorded symbols and reads the schedule parameters
    (docs/tuning.md)."""

    name: str
    abi: Callable[[dict], dict]
    entries: Callable[[dict], dict] = lambda ctx: {"main": ("main", "")}
    schedules: tuple = ()
    scheduled: Callable[[dict], bool] = lambda ctx: True

    def __post_init__(self):
        if self.name not in LAUNCH_KINDS:
            raise ValueError(f"launch kind {self.name!r} is not declared in runtime/axes.py ({', '.join(LAUNCH_KINDS)})")

    def signatures(self, ctx: dict) -> dict:
        """{group: Signature} of a kernel of this kind (its rendering context ``ctx``)."""
        return {group: Signature(params) for group, params in self.abi(ctx).items()}

    def symbols(self, ctx: dict) -> dict:
        """{entry point: {"symbol", "group"}} of a kernel of this kind: its own symbol, or for a group it
        launches from a host SKU (``ctx["shares"]``) the host's, followed by the entry point's suffix; and
        the ABI group whose parameter list it takes."""
        return {name: {"symbol": (ctx["shares"][group]["symbol"] if group in ctx["shares"] else ctx["symbol"]) + suffix,
                       "group": group}
                for name, (group, suffix) in self.entries(ctx).items()}

    def launch_schedules(self, ctx: dict) -> dict:
        """The manifest launch-metadata entries of a kernel's schedules (nothing for a kind without,
        or a SKU with one way to launch)."""
        if not self.schedules or not self.scheduled(ctx):
            return {}
        # a schedule that launches an entry point of its own (its parameter ``entry``) is one of the
        # SKUs that have that entry point
        named = {s.as_dict().get("entry", "main") for s in self.schedules} - {"main"}
        entries = self.entries(ctx) if named else {}
        own = [s for s in self.schedules if s.as_dict().get("entry", "main") in {"main", *entries}]
        return {"schedules": {s.name: s.as_dict() for s in own}, "default_schedule": own[0].name}


@dataclass(frozen=True)
class Block:
    """A block of cells rendered by one template with one launch kind."""

    name: str
    category: str
    ops: tuple
    template: str                       # per-op: "{op}" is substituted
    pairs: tuple                        # (element, aux_element) pairs
    launch: Union[LaunchKind, Callable]  # the kind, or a function of the SKU giving it
    scopes: tuple = (None,)
    modes: tuple = (None,)
    arches: tuple = ("sm80",)
    backends: tuple = ("simt",)
    ins: tuple = ()
    outs: tuple = ()
    nvrtc_options: tuple = ("--fmad=false",)  # exact IEEE products: bit-equal to NumPy
    exclusions: tuple = ()
    # Optional hook: (cell, ctx) -> dict of extra template context; a "launch" key in the
    # returned dict is merged into the kernel's manifest launch metadata (its kind and parameter
    # lists come from ``launch`` alone).
    extra_context: Optional[Callable] = None
    precision: Optional[Callable] = None   # sku fields -> Precision; default: the exact math of docs/numerics.md
    headers: tuple = ()                 # extra shared headers (templates/...) after the prelude in its units
    # Optional hook: SKU -> {ABI group: host SKU}: the entry points of those groups that the SKU
    # launches from another SKU of its unit, which compiles the same device code (NVRTC compiles it
    # once); the SKU's template then renders only the rest (codegen/render.py, docs/dynamic.md).
    shares: Optional[Callable] = None

    def cells(self) -> Iterator[KernelSku]:
        for op, scope, mode, (el, aux), arch, backend in itertools.product(
                self.ops, self.scopes, self.modes, self.pairs, self.arches, self.backends):
            prec = (self.precision(op, scope, mode, el, aux, arch, backend) if self.precision
                    else Precision(kinds.math_kind(el if el in kinds.FLOAT else aux)))
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

    def launch_kind(self, sku: KernelSku) -> LaunchKind:
        return self.launch if isinstance(self.launch, LaunchKind) else self.launch(sku)

    def template_for(self, sku: KernelSku) -> str:
        return self.template.format(op=sku.op)


@dataclass(frozen=True)
class LocalMemory:
    """Kernels (a glob on the symbol) allowed a small stack frame, at most ``max_bytes``, and why.
    ``python -m codegen compile`` fails any other kernel that uses local memory: a thread's data
    belongs in registers, and local memory is where out-of-bounds reads of a thread's arrays hide."""
    pattern: str
    max_bytes: int
    reason: str


# The reason most allowances share: what ptxas saves around the 64-bit division full paths.
CALL_SAVES = ("registers saved around calls to the 64-bit division / reciprocal slow-path routines "
              "(no local arrays)")


@dataclass(frozen=True)
class Family:
    """One kernel family: its blocks of cells, the launch kinds they use, the local memory allowed."""

    name: str
    blocks: tuple
    launch_kinds: tuple
    local_memory: tuple = ()
