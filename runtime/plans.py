"""The plan API (after the Rust seed): select a kernel for a problem, then run it.

    plan = Plan.select(Descriptor("quantize", scope="token", mode="symmetric",
                                  element="bf16", aux_element="s8"))
    plan.sku, plan.precision_guarantee, plan.workspace_size(args), plan.can_implement(args)
    plan.run(args, stream=None)

``args`` is an :class:`ElementwiseArgs` (built and validated by the functional API in
:mod:`runtime.quantization`). Plans are cached per (descriptor, preference, device).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Union

import numpy as np

from .arrays import ArrayRef, stream_of
from .errors import InvalidProblemError
from .registry import default_registry
from .scopes import RowsView
from .sku import KernelSku


@dataclass(frozen=True)
class Descriptor:
    """What problem: op, scope, mode, element kinds (input, output)."""

    op: str
    scope: Optional[str] = None
    mode: Optional[str] = None
    element: str = "f32"
    aux_element: Optional[str] = None
    category: str = "quantization"


@dataclass(frozen=True)
class Preference:
    """How to solve it: a backend (``simt``/``mma``) and the device arch to target."""

    backend: Optional[str] = None
    arch: Optional[int] = None


@dataclass
class ElementwiseArgs:
    """Launch arguments of a static elementwise kernel: the rows view of every stream."""

    ins: list                   # [(ArrayRef, RowsView)]
    outs: list                  # [(ArrayRef, RowsView)]
    scale: Union[ArrayRef, float]
    zero_point: Union[ArrayRef, int, None]
    zp_value: int
    rows: int
    cols: int
    group_size: int = 1
    chan_inner: int = 1
    chan_count: int = 1
    chan_last: bool = False
    qmin: int = 0
    qmax: int = 0


def _ptr(a) -> int:
    return a.ptr if isinstance(a, ArrayRef) else 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Plan:
    def __init__(self, sku: KernelSku, registry=None):
        self.registry = registry or default_registry()
        self.entry = self.registry.lookup(sku)
        self.sku = sku
        self.launch = self.entry.launch

    @classmethod
    def select(cls, descriptor: Descriptor, preference: Preference = Preference(), registry=None) -> "Plan":
        reg = registry or default_registry()
        sku = reg.select(category=descriptor.category, op=descriptor.op, scope=descriptor.scope,
                         mode=descriptor.mode, element=descriptor.element, aux_element=descriptor.aux_element,
                         arch=preference.arch, backend=preference.backend)
        return cls(sku, reg)

    @property
    def precision_guarantee(self) -> str:
        p = self.sku.precision
        s = f"math in {p.math}, accumulate in {p.accumulator}"
        if p.bit_stable:
            s += "; bit-exact with runtime.reference"
        if p.deterministic:
            s += "; deterministic (same bits every run)"
        return s

    def workspace_size(self, args=None) -> int:
        return 0  # static elementwise kernels need no scratch memory

    def can_implement(self, args: ElementwiseArgs) -> bool:
        try:
            self._check(args)
            return True
        except InvalidProblemError:
            return False

    def _check(self, args: ElementwiseArgs):
        want_in = [s["kind"] for s in self.launch["ins"]]
        want_out = [s["kind"] for s in self.launch["outs"]]
        got_in = [a.kind for a, _ in args.ins]
        got_out = [a.kind for a, _ in args.outs]
        if got_in != want_in or got_out != want_out:
            raise InvalidProblemError(f"{self.sku} takes {want_in} -> {want_out}, got {got_in} -> {got_out}")

    def _vec_ok(self, args: ElementwiseArgs) -> bool:
        vec = self.launch["vec"]
        if args.cols % vec:
            return False
        for a, view in args.ins + args.outs:
            align = min(16, vec * a.itemsize)
            if a.ptr % align or (view.row_stride * a.itemsize) % align:
                return False
        return True

    def run(self, args: ElementwiseArgs, stream=None):
        self._check(args)
        if args.rows == 0 or args.cols == 0:
            return
        first = args.ins[0][0]
        from .device import properties
        fn = self.registry.kernel(self.sku, first.device)
        vec_ok = self._vec_ok(args)
        units = -(-args.cols // self.launch["vec"]) if vec_ok else args.cols
        threads = self.launch["block_threads"]
        tx = min(threads, _next_pow2(units))
        ty = threads // tx
        props = properties(first.device)
        blocks_per_sm = props["max_threads_per_sm"] // threads
        grid = max(1, min(-(-args.rows // ty), props["sms"] * blocks_per_sm))
        math = np.float64 if self.sku.precision.math == "f64" else np.float32
        params = []
        for a, view in args.ins + args.outs:
            params += [np.uint64(a.ptr), np.int64(view.row_stride)]
        scale_value = args.scale if not isinstance(args.scale, ArrayRef) else 0.0
        zp_arr = args.zero_point if isinstance(args.zero_point, ArrayRef) else None
        params += [np.uint64(_ptr(args.scale)), math(scale_value), np.uint64(_ptr(zp_arr)),
                   np.int32(args.zp_value), np.int64(args.rows), np.int64(args.cols),
                   np.int64(args.group_size), np.int64(args.chan_inner), np.int64(args.chan_count),
                   np.int32(args.chan_last), np.int32(args.qmin), np.int32(args.qmax), np.int32(vec_ok)]
        fn((grid,), (tx, ty), tuple(params), stream=stream if stream is not None else stream_of(first))


@lru_cache(maxsize=4096)
def cached_plan(descriptor: Descriptor, preference: Preference = Preference()) -> Plan:
    return Plan.select(descriptor, preference)
