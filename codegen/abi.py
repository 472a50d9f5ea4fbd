"""The kernel ABI's vocabulary: a parameter, a parameter list, and the helpers that spell them.

Each launch kind (codegen/spec.py ``LaunchKind``, declared by its family under codegen/families/)
declares its groups of entry points (``main``, ``team``, ``coop``, ...) and the parameters of each
group as data: a name and its C declaration type. Rendering writes the C signatures from these lists
(``{{ k.abi.main }}`` in a template: the parenthesised parameter list); the manifest records each
list once (``manifest["abi"]``, with the packing kind of every parameter: ``ptr``, ``i64``, ``i32``,
``u32``, ``f32``, ``f64``) and each kernel names the lists of its groups (``launch["abi"]``); the
runtime's launchers fill parameters by name (``runtime.abi.Abi``). No positional layout is written
anywhere else.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

TENSOR_MAP = "const __grid_constant__ CUtensorMap"   # a TMA descriptor passed by value (runtime/tma.py)
PACKING = {"i64_t": "i64", "int": "i32", "i32_t": "i32", "u32_t": "u32", "float": "f32", "double": "f64",
           TENSOR_MAP: "tmap"}


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str              # the C declaration type, e.g. "const bf16_t* __restrict__", "i64_t"

    @property
    def packing(self) -> str:
        return "ptr" if "*" in self.ctype else PACKING[self.ctype]

    def c(self) -> str:
        return f"{self.ctype} {self.name}"


class Signature:
    """One group's parameter list; ``str()`` is the C parameter list in parentheses."""

    def __init__(self, params):
        self.params = tuple(params)
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate parameter names in {names}")

    def __str__(self) -> str:
        lines, line = [], "    "
        for i, p in enumerate(self.params):
            piece = p.c() + ("," if i + 1 < len(self.params) else "")
            if len(line) + len(piece) > 100 and line.strip():
                lines.append(line.rstrip())
                line = "    "
            line += piece + " "
        lines.append(line.rstrip())
        return "(\n" + "\n".join(lines) + ")"

    def record(self) -> list:
        """[[name, packing], ...]: what the manifest stores."""
        return [[p.name, p.packing] for p in self.params]

    def key(self, kind: str, group: str) -> str:
        """A readable, content-derived id of this list in the manifest."""
        digest = hashlib.sha256(repr(self.record()).encode()).hexdigest()[:10]
        return f"{kind}.{group}.{digest}"


def ptr(name, ctype, const=False):
    return Param(name, f"{'const ' if const else ''}{ctype}* __restrict__")


def i64s(*names):
    return [Param(n, "i64_t") for n in names]


def ints(*names):
    return [Param(n, "int") for n in names]


STATUS = Param("status", "u32_t* __restrict__")   # the device's status word (runtime/status.py), or null


def streams(k) -> list:
    out = []
    for s in k["ins"]:
        out += [ptr(s["name"], s["ctype"], const=True), Param(s["name"] + "_rs", "i64_t")]
    for s in k["outs"]:
        out += [ptr(s["name"], s["ctype"]), Param(s["name"] + "_rs", "i64_t")]
    return out
