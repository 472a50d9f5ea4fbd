"""Vector accesses: the pointer parameters a kernel moves in words wider than one element.

A word needs its address aligned to its size, and a row-strided access needs every row start
aligned too; a misaligned one is a sticky CUDA error that ends the process's context. The kernels
make such accesses in four ways:

* ``load_vec`` / ``store_vec`` (templates/common/prelude.cuh): N elements as 16-byte words, or one
  8- or 4-byte word, else element by element (:func:`word`). The quantization kernels take this
  vector path only when their ``vec_ok`` parameter says so; their launchers set it from
  :func:`fits`, so any alignment runs, on the scalar path where the vector path cannot.
* ``cp.async`` 16-byte copies: the mma kernels' operands, the cooperative per-tensor reduction.
* accumulator pairs stored as one word (32 bits for 16-bit outputs, ``float2`` for float32): the
  mma and wgmma epilogues (``store2``).
* tensor maps (wgmma): 16-byte aligned addresses and row strides (runtime/tma.py checks the maps).

:class:`Access` is one such access. Each launcher declares its launch kind's accesses per entry-point
group (``Launcher.accesses``, beside the launcher in its family), by the parameter names of the
kernel ABI (codegen/families/<family>/launch.py), with the widths derived from the kernel's launch
metadata (``vec``, ``rvec``, ``pack``, stream kinds, backend, output kind). The MoE launcher names
what a tensor-core backend cannot take from it (:func:`problems`); the CPU tests' fake launcher
checks every launch against it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import kinds
from .errors import InvalidProblemError

CP_ASYNC = 16        # bytes of one cp.async copy (the mma operands, the cooperative reduction's x)
TMA = 16             # tensor-map addresses and row strides are multiples of this (wgmma)


@dataclass(frozen=True)
class Access:
    """One pointer parameter moved in ``nbytes``-byte words: its address, and each of its row
    strides (parameters ``strides``, in elements of ``item`` bytes), must be multiples of
    ``nbytes``. ``when``: int parameters that must all be nonzero for the kernel to make this
    access (``vec_ok``: the vector path); empty: always. ``unless``: int parameters any of which,
    nonzero, stops it (``mask_bits``: the mask written bit-packed). A null pointer is never accessed."""

    param: str
    nbytes: int
    item: int
    how: str
    strides: tuple = ()
    when: tuple = ()
    unless: tuple = ()


def word(item: int, n: int) -> int:
    """Bytes of the widest word ``load_vec`` / ``store_vec`` move ``n`` elements of ``item`` bytes
    in (prelude.cuh): 16 when the vector is a multiple of 16 bytes, 8 or 4 when it is exactly that
    long, else ``item`` (element by element)."""
    b = item * n
    if b % 16 == 0:
        return 16
    return b if b in (4, 8) else item


def stream_word(kind: str, vec: int) -> int:
    """The word of one vector of ``vec`` elements of a stream of ``kind`` (packed kinds: ``vec /
    pack`` bytes of their container)."""
    k = kinds.kind(kind)
    return word(k.size, vec // k.pack)


def fits(ref, row_stride: int, nbytes: int) -> bool:
    """``ref``'s address and row stride (elements) are multiples of ``nbytes``; a None ``ref``
    fits."""
    return ref is None or (ref.ptr % nbytes == 0 and row_stride * ref.itemsize % nbytes == 0)


def misaligned(arg: str, ptr: int, nbytes: int, how: str) -> Optional[str]:
    """Why ``arg`` at ``ptr`` cannot be moved in ``nbytes``-byte words (``how``: by what), or None."""
    off = ptr % nbytes
    if not off:
        return None
    a = "an" if nbytes == 8 else "a"
    return f"{arg} at {ptr:#x} is {off} bytes past {a} {nbytes}-byte boundary; {how} need {nbytes}-byte alignment"


def require_aligned(arg: str, ref, nbytes: int, how: str) -> None:
    """An InvalidProblemError naming ``arg``, its address offset and the alignment unless ``ref``
    is ``nbytes``-byte aligned."""
    why = misaligned(arg, ref.ptr, nbytes, how)
    if why:
        raise InvalidProblemError(f"{why}: pass a {nbytes}-byte aligned array")


def problems(access, values: dict, names: Optional[dict] = None) -> list:
    """What in ``values`` (a launch's parameters by name) breaks ``access``: one message per
    misaligned address or row stride, naming the argument (``names``: parameter -> argument
    name), the offset and the alignment needed."""
    names = names or {}
    out = []
    for a in access:
        ptr = values.get(a.param)
        if not ptr or not all(values.get(f) for f in a.when) or any(values.get(f) for f in a.unless):
            continue
        arg = names.get(a.param, a.param)
        why = misaligned(arg, ptr, a.nbytes, a.how)
        if why:
            out.append(why)
        for s in a.strides:
            step = values[s] * a.item
            if step % a.nbytes:
                out.append(f"{arg} has a stride of {values[s]} elements ({step} bytes); {a.how} need row "
                           f"strides that are multiples of {a.nbytes} bytes")
    return out


# -- helpers of the launchers' declarations -------------------------------------------------------
def streams(launch, vec: int, when=("vec_ok",)) -> list:
    """The data streams (``ins`` / ``outs`` of the launch), one vector of ``vec`` elements per
    access, rows strided by ``<name>_rs``. A bit-packed stream (launch ``bits``) moves one byte a
    vector, which any address takes: none where it is always bit-packed, none while its parameter
    selects the bits."""
    bits = launch.get("bits") or {}
    return [Access(s["name"], stream_word(s["kind"], vec), kinds.kind(s["kind"]).size,
                   f"{vec}-element vector accesses", (s["name"] + "_rs",), when,
                   (bits[s["name"]],) if s["name"] in bits else ())
            for s in launch["ins"] + launch["outs"] if not (s["name"] in bits and bits[s["name"]] is None)]
