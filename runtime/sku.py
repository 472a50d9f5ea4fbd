"""The SKU vocabulary: what a generated kernel *is* (docs/api.md).

A :class:`KernelSku` is a frozen, hashable, orderable value. Its canonical string has
nine ``/``-separated fields, ``-`` for a field that does not apply::

    quantization/quantize/token/symmetric/bf16/s8/sm80/simt/f32.acc-f32.det.stable

``KernelSku.parse(str(sku)) == sku`` always holds; the string is what ``--filter`` globs
match and what the manifest is keyed by.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from . import kinds
from .axes import ARCH_SPECIFIC, ARCHES, BACKENDS, CATEGORIES, MODES, NONE, OPS, SCOPES
from .errors import InvalidProblemError



@dataclass(frozen=True, order=True)
class Precision:
    """Math precision, accumulator kind and the two reproducibility promises."""

    math: str = "f32"
    accumulator: str = "f32"
    deterministic: bool = True
    bit_stable: bool = True  # bit-identical to the NumPy reference

    def __post_init__(self):
        for name in ("math", "accumulator"):
            _check(f"Precision.{name}", getattr(self, name), kinds.MATH, required=True)
        for name in ("deterministic", "bit_stable"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidProblemError(f"Precision.{name}={getattr(self, name)!r:.60}; True or False is required")

    def __str__(self) -> str:
        s = f"{self.math}.acc-{self.accumulator}"
        if self.deterministic:
            s += ".det"
        if self.bit_stable:
            s += ".stable"
        return s

    @classmethod
    def parse(cls, text: str) -> "Precision":
        if not isinstance(text, str):
            raise InvalidProblemError(f"precision {text!r:.60}: a string MATH.acc-ACC[.det][.stable] is required")
        parts = text.split(".")
        if len(parts) < 2 or not parts[1].startswith("acc-"):
            raise InvalidProblemError(f"precision {text!r} is not of the form MATH.acc-ACC[.det][.stable]")
        flags = set(parts[2:])
        unknown = flags - {"det", "stable"}
        if unknown:
            raise InvalidProblemError(f"precision {text!r}: unknown flags {sorted(unknown)}; supported: det, stable")
        return cls(parts[0], parts[1][4:], "det" in flags, "stable" in flags)


def _check(name: str, value: Optional[str], allowed, required: bool = False) -> None:
    """``value`` is one of ``allowed`` (strings), or None where the field is optional."""
    if value is None and not required:
        return
    if not isinstance(value, str) or value not in allowed:
        raise InvalidProblemError(f"{name}={value!r:.60}; supported: {', '.join(allowed)}"
                                  + ("" if required else " (or None where it does not apply)"))


@dataclass(frozen=True)
class KernelSku:
    """One cell of the matrix, as a value. Field order is the listing order."""

    category: str
    op: str
    scope: Optional[str]
    mode: Optional[str]
    element: str
    aux_element: Optional[str]
    arch: str = "sm80"
    backend: str = "simt"
    precision: Precision = field(default_factory=Precision)

    def __post_init__(self):
        _check("KernelSku.category", self.category, CATEGORIES, required=True)
        _check("KernelSku.op", self.op, OPS[self.category], required=True)
        _check("KernelSku.scope", self.scope, SCOPES)
        _check("KernelSku.mode", self.mode, MODES)
        _check("KernelSku.element", self.element, kinds.ELEMENTS, required=True)
        _check("KernelSku.aux_element", self.aux_element, kinds.ELEMENTS)
        _check("KernelSku.arch", self.arch, ARCHES, required=True)
        _check("KernelSku.backend", self.backend, BACKENDS, required=True)
        if not isinstance(self.precision, Precision):
            raise InvalidProblemError(f"KernelSku.precision={self.precision!r:.60}; a runtime.sku.Precision is "
                                      "required (Precision.parse('f32.acc-f32.det.stable'))")

    def __str__(self) -> str:
        fields = (self.category, self.op, self.scope, self.mode, self.element, self.aux_element,
                  self.arch, self.backend, str(self.precision))
        return "/".join(NONE if f is None else f for f in fields)

    # Ordering: field by field, a field that does not apply (None) before any value; so SKUs
    # with and without an aux_element (moe: dw f32 vs input dtype) sort together.
    def _order_key(self) -> tuple:
        return tuple("" if f is None else f for f in (
            self.category, self.op, self.scope, self.mode, self.element, self.aux_element,
            self.arch, self.backend)) + (self.precision,)

    def __lt__(self, other):
        return self._order_key() < other._order_key() if isinstance(other, KernelSku) else NotImplemented

    def __le__(self, other):
        return self._order_key() <= other._order_key() if isinstance(other, KernelSku) else NotImplemented

    def __gt__(self, other):
        return self._order_key() > other._order_key() if isinstance(other, KernelSku) else NotImplemented

    def __ge__(self, other):
        return self._order_key() >= other._order_key() if isinstance(other, KernelSku) else NotImplemented

    @classmethod
    def parse(cls, text: str) -> "KernelSku":
        if not isinstance(text, str):
            raise InvalidProblemError(f"SKU {text!r}: a string category/op/scope/mode/element/aux_element/arch/"
                                      "backend/precision is required")
        parts = text.strip().split("/")
        if len(parts) != 9:
            raise InvalidProblemError(
                f"SKU {text!r} has {len(parts)} fields; expected 9: "
                "category/op/scope/mode/element/aux_element/arch/backend/precision")
        vals = [None if p == NONE else p for p in parts]
        if vals[4] is None or vals[0] is None or vals[1] is None:
            raise InvalidProblemError(f"SKU {text!r}: category, op and element are required")
        return cls(vals[0], vals[1], vals[2], vals[3], vals[4], vals[5], vals[6], vals[7],
                   Precision.parse(parts[8]))

    @property
    def arch_number(self) -> int:
        """``sm90`` → 90: the minimum compute capability as an integer."""
        return int(self.arch[2:])

    @property
    def target(self) -> str:
        """The NVRTC ``--gpu-architecture`` a device of the SKU's arch builds it for: ``sm_90a`` for the
        arch-specific backends, else ``sm_<cc>`` of the device (any cc at or above ``arch``)."""
        return ARCH_SPECIFIC.get(self.backend, f"sm_{self.arch_number}")

    def runs_on(self, cc: int) -> bool:
        """Whether the kernel runs on a device of compute capability ``cc`` (90 for sm_90): built for
        an arch at or below it, and an arch-specific SKU only on its own arch."""
        if isinstance(cc, bool) or not isinstance(cc, int):
            raise InvalidProblemError(f"cc={cc!r:.60}: a compute capability such as 90 is required")
        if self.backend in ARCH_SPECIFIC:
            return cc == self.arch_number
        return self.arch_number <= cc

    @property
    def symbol(self) -> str:
        """The C symbol of the kernel: procedural, readable, unique per SKU."""
        parts = [self.op, self.scope, self.mode, self.element, self.aux_element, self.arch, self.backend]
        return "sf_" + "_".join(p for p in parts if p)
