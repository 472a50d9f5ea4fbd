"""Kernel parameters by name: an entry point's parameter list as the manifest records it.

The generator declares every entry point's parameters once (its family's launch kind, codegen/families/<family>/launch.py) and writes the C
signatures from that declaration; the manifest keeps each list (``manifest["abi"]``) and each
kernel names the lists of its entry-point groups (``launch["abi"]``). A launcher asks its plan for
a group's :class:`Abi` and fills the parameters by name; the packing format and every slot follow
from the list, so no positional layout exists on this side.
"""
from __future__ import annotations

from .device import param_format


class Abi:
    """One parameter list: names in order, the packing format, and each name's slot."""

    __slots__ = ("id", "names", "fmt", "slot")

    def __init__(self, id: str, params):
        self.id = id
        self.names = tuple(name for name, _ in params)
        self.fmt = param_format(tuple(packing for _, packing in params))
        self.slot = {name: i for i, name in enumerate(self.names)}

    def values(self, **named) -> list:
        """The parameter values in order; every name given exactly once (a launcher bug otherwise)."""
        try:
            out = [named[n] for n in self.names]
        except KeyError as e:
            raise TypeError(f"{self.id}: no value for parameter {e.args[0]!r}") from None
        if len(named) != len(out):
            raise TypeError(f"{self.id}: no parameter named {sorted(set(named) - set(self.names))}")
        return out

    def __repr__(self) -> str:
        return f"Abi({self.id}: {', '.join(self.names)})"
