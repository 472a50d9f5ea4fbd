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

import ctypes
from dataclasses import dataclass

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
MAP_BYTES = 128
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


_ENCODERS: dict = {}          # MapSpec -> its encoder (map_encoder)


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
    args = (DATA_TYPE[spec.kind], rank, ptr, spec.dims, spec.strides, spec.box, (1,) * rank,
            INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_ZEROS)
    fn = _libcuda_encode()
    if fn is not None:
        buf = ctypes.create_string_buffer(MAP_BYTES + 64)
        at = -ctypes.addressof(buf) % 64           # the driver wants the map 64-byte aligned
        arrays = ((ctypes.c_uint64 * rank)(*spec.dims), (ctypes.c_uint64 * max(rank - 1, 1))(*spec.strides),
                  (ctypes.c_uint32 * rank)(*spec.box), (ctypes.c_uint32 * rank)(*args[6]))
        err = fn(ctypes.addressof(buf) + at, args[0], rank, ptr, *(ctypes.addressof(a) for a in arrays), *args[7:])
        out = buf.raw[at:at + MAP_BYTES]
    else:
        from cuda.bindings import driver
        u64, u32 = driver.cuuint64_t, driver.cuuint32_t
        err, m = driver.cuTensorMapEncodeTiled(
            driver.CUtensorMapDataType(args[0]), rank, ptr, [u64(v) for v in spec.dims],
            [u64(v) for v in spec.strides], [u32(v) for v in spec.box], [u32(v) for v in args[6]],
            driver.CUtensorMapInterleave(args[7]), driver.CUtensorMapSwizzle(args[8]),
            driver.CUtensorMapL2promotion(args[9]), driver.CUtensorMapFloatOOBfill(args[10]))
        out = b"".join(int(v).to_bytes(8, "little") for v in m.opaque) if int(err) == 0 else b""
    if int(err) != 0:
        raise SkuforgeError(f"cuTensorMapEncodeTiled failed: CUresult {int(err)} ({spec} at {ptr:#x})")
    return out


_FN: list = []


def _libcuda_encode():
    """cuTensorMapEncodeTiled from libcuda through ctypes (about a microsecond a call), or None where
    libcuda cannot be opened by name (then cuda-python's binding is used)."""
    if not _FN:
        from .device import _libcuda
        try:
            fn = _libcuda().cuTensorMapEncodeTiled
        except (OSError, AttributeError):
            fn = None
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, ctypes.c_int]
        _FN.append(fn)
    return _FN[0]
