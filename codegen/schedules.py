"""Schedule variants of the memory-bound launch kinds: how a SKU's work is laid out on the GPU.

A SKU is what a kernel computes; a :class:`Schedule` is how one launch of it is laid out (threads
per block, grid shape, the launch configuration of its team kernels). Each launch kind that has
more than one way to run declares its schedules here, as data, the first being its default; every
SKU of that kind carries them all in its manifest launch metadata (``schedules``,
``default_schedule``), and the runtime picks one per problem from the tuning table
(``codegen/tuning/<arch>.json``, written by ``python -m codegen tune``; rule: docs/tuning.md).
``python -m codegen verify`` runs every SKU under each of its schedules.

Parameters by launch kind (read by the kind's launcher, runtime/launch.py, runtime/lowbit.py,
runtime/dynamic.py):

- ``elementwise`` (static s8 / u8 quantize and dequantize, the straight-through and fake-quantize
  passes): ``threads`` per block (at most the kernels' ``__launch_bounds__``, 256); for the columns
  layout (group scope, channel on the last axis) ``grid``: ``persistent`` (at most the resident
  blocks; a thread walks its rows) or ``full`` (one block per step of rows, nothing walked twice),
  and ``columns``: ``2d`` (column blocks in the grid's y: a thread owns one column vector) or ``1d``
  (a block spans the row and loops).
- ``lowbit_elementwise`` (static fp8 / int4 quantize and dequantize; one block per group of rows):
  ``threads`` per block.
- ``dynamic_fused`` / ``lowbit_dynamic_fused`` (per-token and per-group dynamic quantize):
  ``config``, a launch configuration of the SKU's fused kernels (runtime.dynamic.FusedConfig: the
  team kernel ``t16``/``t8``/``t4``/``t2`` with its threads per block, or the block kernel; ``auto``
  is the size rule of docs/dynamic.md).
- ``dynamic_reduce`` (per-tensor and per-channel dynamic quantize, on the SKUs that have a one-launch
  kernel): ``path``, ``one`` (the one-launch kernel where the layout allows it: per tensor over a
  contiguous x, per channel on the last axis of a contiguous x) or ``two`` (reduce, then the static
  quantize kernel: x read twice).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """One named way to launch a kernel; ``params`` as (name, value) pairs (hashable)."""

    name: str
    params: tuple

    def as_dict(self) -> dict:
        return dict(self.params)


def _sched(name: str, **params) -> Schedule:
    return Schedule(name, tuple(sorted(params.items())))


_ELEMENTWISE = (
    _sched("b256", threads=256, grid="persistent", columns="2d"),   # default
    _sched("b256-full", threads=256, grid="full", columns="2d"),
    _sched("b128", threads=128, grid="persistent", columns="2d"),
    _sched("b128-full", threads=128, grid="full", columns="2d"),
    _sched("b256-1d", threads=256, grid="persistent", columns="1d"),
    _sched("b64", threads=64, grid="full", columns="2d"),
)
# the low-bit static kernels walk rows only (one block per row group: the grid is always full)
_ROWS = (
    _sched("b256", threads=256),                                     # default
    _sched("b128", threads=128),
    _sched("b64", threads=64),
)
_FUSED = (
    _sched("auto", config="auto"),                                   # default: the size rule
    _sched("t16", config="t16"),
    _sched("t8", config="t8"),                                       # team kernels: 128 threads a block
    _sched("t8-b256", config="t8,threads=256"),
    _sched("t4", config="t4"),
    _sched("t2", config="t2"),
    _sched("block", config="block"),
)

_REDUCE = (
    _sched("one-launch", path="one"),                                # default
    _sched("two-pass", path="two"),
)

SCHEDULES: dict = {
    "elementwise": _ELEMENTWISE,
    "lowbit_elementwise": _ROWS,
    "dynamic_fused": _FUSED,
    "lowbit_dynamic_fused": _FUSED,
    "dynamic_reduce": _REDUCE,
}
# kinds whose schedules only some SKUs have: launch kind -> which (from the kernel's context)
ONLY = {"dynamic_reduce": lambda ctx: bool(ctx.get("coop") or ctx.get("chan"))}


def schedules_of(launch_kind: str) -> tuple:
    """The schedules of a launch kind, default first (empty: one way to launch)."""
    return SCHEDULES.get(launch_kind, ())


def launch_schedules(launch_kind: str, ctx: dict = None) -> dict:
    """The manifest launch-metadata entries of a kernel's schedules (its rendering context ``ctx``;
    nothing for a kind without, or a SKU with one way to launch)."""
    sched = schedules_of(launch_kind)
    if not sched or not ONLY.get(launch_kind, lambda c: True)(ctx or {}):
        return {}
    return {"schedules": {s.name: s.as_dict() for s in sched}, "default_schedule": sched[0].name}
