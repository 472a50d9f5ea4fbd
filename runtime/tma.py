"""Tensor maps: the descriptors the Hopper copy engine (TMA, ``cp.async.bulk.tensor``) loads tiles with.

A kernel of the ``wgmma`` backend takes the tensor map of each operand and of its output as a
``const __grid_constant__ CUtensorMap`` parameter (128 bytes, packed as the ``tmap`` kind of
runtime/device.py). A map describes one array: its address, its extents and row strides, the box
(tile) one copy moves and the shared memory layout (128-byte swizzle). It is encoded on the host by
the driver's ``cuTensorMapEncodeTiled`` once per (address, layout) and remembered, so a repeated call
with the same arrays encodes nothing; a replay with new arrays looks each map up by its new address
(:func:`map_encoder`).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import device
from .config import CACHES
from .errors import SkuforgeError
from .kinds import ALL, SIZE
from .vectors import TMA

# CUtensorMapDataType of the kinds tensor maps describe (the kind vocabulary's ``tma``); the swizzle,
# L2 promotion and fill modes used.
DATA_TYPE = {k.name: k.tma for k in ALL if k.tma is not None}
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3                       # 16-byte chunk c of row r at c ^ (r % 8): what wgmma's 128B mode reads
L2_PROMOTION_256B = 3
OOB_FILL_ZEROS = 0                     # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements read as 0
LIMIT = 4096                           # remembered layouts, and addresses per layout (cleared when full)


@dataclass(frozen=True)
class MapSpec:
    """The layout of one tensor map, innermost dimension first (as the driver takes it)."""

    kind: str        # element kind (one of DATA_TYPE: "bf16", "f16", "f32")
    dims: tuple      # extents in elements
    strides: tuple   # byte strides of dims[1:], each a multiple of 16
    box: tuple       # the tile one copy moves, in elements (box[0] * element size <= 128 for the swizzle)

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.kind, self.dims, self.strides, self.box)))

    def __hash__(self) -> int:   # computed once: every replayed wgmma call looks its maps up by (address, spec)
        return self._hash

    def problems(self, ptr: int) -> list:
        """Why the driver would refuse this map at ``ptr`` (empty: it encodes)."""
        out = []
        if ptr % TMA:
            out.append(f"address {ptr:#x} is not {TMA}-byte aligned")
        if not all(0 < d <= 2**32 for d in self.dims):
            out.append(f"extents {self.dims} must lie in 1..2**32")
        if not all(s % TMA == 0 and 0 < s < 2**40 for s in self.strides):
            out.append(f"row strides {self.strides} (bytes) must be multiples of {TMA} below 2**40")
        if not all(0 < b <= 256 for b in self.box) or self.box[0] * SIZE[self.kind] > 128:
            out.append(f"box {self.box} must have sides of 1..256 and an inner side of at most 128 bytes")
        return out


_ENCODERS = CACHES.new()     # MapSpec -> its encoder (map_encoder); per driver


def map_encoder(spec: MapSpec):
    """``encode(ptr)``: the 128 bytes of the tensor map of ``spec`` at address ``ptr``, encoded once per
    address and remembered in a table of this layout's own (a replay's lookup is one dict get by
    address; the layout is not compared again)."""
    enc = _ENCODERS.get(spec)
    if enc is None:
        if len(_ENCODERS) >= LIMIT:
            _ENCODERS.clear()
        maps: dict = {}

        def enc(ptr: int) -> bytes:
            m = maps.get(ptr)
            if m is None:
                if len(maps) >= LIMIT:
                    maps.clear()
                m = maps[ptr] = encode(ptr, spec)
            return m
        _ENCODERS[spec] = enc
    return enc


def encode(ptr: int, spec: MapSpec) -> bytes:
    """``cuTensorMapEncodeTiled`` of ``spec`` at ``ptr`` (128-byte swizzle, zeros out of bounds)."""
    why = spec.problems(ptr)
    if why:
        raise SkuforgeError("cannot encode a tensor map: " + "; ".join(why))
    rank = len(spec.dims)
    err, out = device.driver().encode_tiled((DATA_TYPE[spec.kind], rank, ptr, spec.dims, spec.strides, spec.box,
                                             (1,) * rank, INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_256B,
                                             OOB_FILL_ZEROS))
    if err != 0:
        raise SkuforgeError(f"cuTensorMapEncodeTiled failed: CUresult {err} ({spec} at {ptr:#x})")
    return out
