"""The plan API (after the Rust seed): select a kernel for a problem, then run it.

    plan = Plan.select(Descriptor("quantize", scope="token", mode="symmetric",
                                  element="bf16", aux_element="s8"))
    plan.sku, plan.precision_guarantee, plan.workspace_size(args), plan.can_implement(args)
    plan.run(args, stream=None)

How a plan launches its kernel depends on the kernel's launch kind (manifest
``launch.kind``): each kind registers a :class:`Launcher` with :func:`launcher`.
Plans are cached per (descriptor, preference).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from .errors import InvalidProblemError
from .registry import default_registry
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


class Launcher:
    """Drives one launch kind: argument checks, scratch size, grid and parameters."""

    def check(self, plan: "Plan", args) -> None:
        """Raise InvalidProblemError when ``args`` do not fit ``plan``."""

    def workspace_size(self, plan: "Plan", args) -> int:
        return 0

    def run(self, plan: "Plan", args, stream=None) -> None:
        raise NotImplementedError


LAUNCHERS: dict = {}


def launcher(kind: str):
    """Class decorator: register a Launcher for a manifest launch kind."""
    def deco(cls):
        LAUNCHERS[kind] = cls()
        return cls
    return deco


class Plan:
    def __init__(self, sku: KernelSku, registry=None):
        self.registry = registry or default_registry()
        self.entry = self.registry.lookup(sku)
        self.sku = sku
        self.launch = self.entry.launch
        try:
            self.launcher = LAUNCHERS[self.launch["kind"]]
        except KeyError:
            raise InvalidProblemError(f"{sku}: no launcher for launch kind {self.launch['kind']!r}") from None

    @classmethod
    def select(cls, descriptor: Descriptor, preference: Preference = Preference(), registry=None) -> "Plan":
        reg = registry or default_registry()
        sku = reg.select(category=descriptor.category, op=descriptor.op, scope=descriptor.scope,
                         mode=descriptor.mode, element=descriptor.element, aux_element=descriptor.aux_element,
                         arch=preference.arch, backend=preference.backend)
        return cls(sku, reg)

    def __repr__(self) -> str:
        return f"Plan({self.sku})"

    def abi(self, group: str = "main"):
        """The parameter list of this kernel's ``group`` of entry points (runtime.abi.Abi)."""
        return self.registry.abi(self.launch["abi"][group])

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
        return self.launcher.workspace_size(self, args)

    def can_implement(self, args) -> bool:
        try:
            self.launcher.check(self, args)
            return True
        except InvalidProblemError:
            return False

    def run(self, args, stream=None):
        """Launch on ``stream`` (a CuPy or torch stream, or a raw handle); default: the
        caller's current stream for the arrays' framework."""
        self.launcher.check(self, args)
        self.launcher.run(self, args, stream_handle_of(stream))


def stream_handle_of(stream):
    """A raw ``cudaStream_t`` from a CuPy stream, a torch stream or an int (None stays None)."""
    if stream is None or isinstance(stream, int):
        return stream
    for attr in ("ptr", "cuda_stream"):
        h = getattr(stream, attr, None)
        if h is not None:
            return int(h)
    raise InvalidProblemError(f"stream={stream!r} is not a CuPy stream, a torch stream or a raw handle")


@lru_cache(maxsize=4096)
def cached_plan(descriptor: Descriptor, preference: Preference = Preference()) -> Plan:
    return Plan.select(descriptor, preference)
