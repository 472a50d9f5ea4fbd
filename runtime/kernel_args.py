"""A kernel's parameters as cuLaunchKernel takes them, packed on the host without CuPy.

CuPy's Function.__call__ converts every scalar argument to a NumPy scalar (about 1 µs each on
a server CPU); a kernel with 20 parameters then costs more to launch than to run at small
sizes. Instead the parameters are packed with a precompiled ``struct`` format into a
per-thread buffer whose field addresses form the ``void**`` array cuLaunchKernel takes.
Native ``@`` alignment matches the CUDA parameter layout of the same C types.
One character per parameter. "T": a 128-byte CUDA tensor map (``const __grid_constant__ CUtensorMap``,
64-byte aligned in the kernel's parameter space), packed from a 128-byte ``bytes`` value.

:class:`CtypesLaunch` is cuLaunchKernel of libcuda through ctypes; a bound launch
(:meth:`runtime.driver_base.Driver.bind_launch`) calls its ``raw`` function with ctypes values made
once, and :func:`ints_launch` gives a launcher taking ints (cuda-python's, a fake device's) that
calling convention.
"""
from __future__ import annotations

import ctypes
import struct

_CTYPE_FMT = {"ptr": "Q", "i64": "q", "i32": "i", "u32": "I", "f32": "f", "f64": "d", "tmap": "T"}
_WIDE = {"T": ("128s", 128, 64)}   # format character -> (struct code, size, alignment)


class ParamBlock:
    """The packed values of one parameter list and the ``void**`` array of their addresses. The
    driver copies each parameter from its address, so the host-side padding only keeps every field
    at its natural alignment (explicit pad bytes, one struct)."""

    def __init__(self, fmt: str):
        codes, offsets, off = [], [], 0
        for ch in fmt:
            code, size, align = _WIDE.get(ch) or (ch, struct.calcsize("@" + ch), struct.calcsize("@" + ch))
            pad = -off % align
            if pad:
                codes.append(f"{pad}x")
            off += pad
            offsets.append(off)
            codes.append(code)
            off += size
        self.struct = struct.Struct("=" + "".join(codes))
        assert self.struct.size == off
        self.buf = ctypes.create_string_buffer(max(self.struct.size, 1))
        base = ctypes.addressof(self.buf)
        self.ptrs = (ctypes.c_void_p * max(len(fmt), 1))(*(base + o for o in offsets))
        self.ptrs_addr = ctypes.addressof(self.ptrs)
        self.ptrs_value = ctypes.c_void_p(self.ptrs_addr)


def pack_params(fmt: str, values) -> bytes:
    """The parameter values packed as a launch packs them (a struct.error where they do not fit)."""
    return ParamBlock(fmt).struct.pack(*values)


def param_format(types) -> str:
    """``("ptr", "i64", "f32", ...)`` → one format character per parameter (:class:`ParamBlock`)."""
    return "".join(_CTYPE_FMT[t] for t in types)


class CtypesLaunch:
    """cuLaunchKernel of libcuda through ctypes, called as ``(f, gx, gy, gz, bx, by, bz, smem, stream,
    params)`` with Python ints. ``raw`` is the bare function (no ``argtypes``): a bound launch
    (:meth:`Driver.bind_launch`) passes it ctypes values made once, which skips ctypes' conversion of
    eleven arguments per call (about 0.7 µs)."""

    __slots__ = ("raw",)

    def __init__(self, raw):
        self.raw = raw

    def __call__(self, f, gx, gy, gz, bx, by, bz, smem, stream, params):
        u = ctypes.c_uint
        return self.raw(ctypes.c_void_p(f), u(gx), u(gy), u(gz), u(bx), u(by), u(bz), u(smem),
                        ctypes.c_void_p(stream or None), ctypes.c_void_p(params), None)


def ints_launch(cu):
    """``cu`` (called with Python ints, as :class:`CtypesLaunch` is) behind the ctypes-value
    convention of ``CtypesLaunch.raw`` that a bound launch uses."""
    def raw(*values):
        return cu(*((v.value or 0) for v in values[:10]))
    return raw
