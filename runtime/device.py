"""Devices: module loading per device through CuPy, device properties, stream handles."""
from __future__ import annotations

import threading
from functools import lru_cache

from .compiler import compile_cached
from .errors import DeviceRequiredError

_modules: dict = {}
_lock = threading.Lock()


def cupy():
    try:
        import cupy as cp  # noqa: F401
        return cp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise DeviceRequiredError("skuforge kernels run through CuPy: pip install cupy-cuda13x") from e


@lru_cache(maxsize=None)
def properties(device: int) -> dict:
    cp = cupy()
    p = cp.cuda.runtime.getDeviceProperties(device)
    return {"name": p["name"].decode() if isinstance(p["name"], bytes) else p["name"],
            "cc": p["major"] * 10 + p["minor"], "sms": p["multiProcessorCount"],
            "max_threads_per_sm": p["maxThreadsPerMultiProcessor"]}


def compile_arch(device: int) -> int:
    return properties(device)["cc"]


def load_function(registry, unit: str, symbol: str, device: int = None):
    """Compile ``unit`` for the device's arch (disk cache) and return ``symbol`` as a CuPy function."""
    cp = cupy()
    if device is None:
        device = cp.cuda.runtime.getDevice()
    key = (str(registry.root), unit, device)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                options = registry.units[unit]["nvrtc_options"]
                res = compile_cached(registry.unit_source(unit), unit, compile_arch(device), options)
                with cp.cuda.Device(device):
                    mod = cp.cuda.function.Module()
                    mod.load(res.cubin)
                mod = (mod, {})
                _modules[key] = mod
    module, functions = mod
    fn = functions.get(symbol)
    if fn is None:
        fn = functions[symbol] = module.get_function(symbol)
    return fn


_resident: dict = {}


def resident_blocks(fn, threads: int) -> int:
    """Blocks of ``threads`` threads of kernel ``fn`` resident on one SM (occupancy API)."""
    key = (fn.ptr, threads)
    n = _resident.get(key)
    if n is None:
        from cuda.bindings import driver
        err, n = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(driver.CUfunction(fn.ptr), threads, 0)
        n = _resident[key] = max(1, int(n)) if int(err) == 0 else 1
    return n


# -- fast launches ---------------------------------------------------------------------------
# CuPy's Function.__call__ converts every scalar argument to a NumPy scalar (about 1 µs each on
# a server CPU); a kernel with 20 parameters then costs more to launch than to run at small
# sizes. Instead the parameters are packed with a precompiled ``struct`` format into a
# per-thread buffer whose field addresses form the ``void**`` array cuLaunchKernel takes.
# Native ``@`` alignment matches the CUDA parameter layout of the same C types.
import ctypes as _ctypes
import struct as _struct

_launch_local = threading.local()
_CTYPE_FMT = {"ptr": "Q", "i64": "q", "i32": "i", "u32": "I", "f32": "f", "f64": "d"}


class _ParamBlock:
    def __init__(self, fmt: str):
        self.struct = _struct.Struct("@" + fmt)
        self.buf = _ctypes.create_string_buffer(max(self.struct.size, 1))
        base = _ctypes.addressof(self.buf)
        offsets, off = [], 0
        for ch in fmt:
            size = _struct.calcsize("@" + ch)
            off = (off + size - 1) // size * size
            offsets.append(base + off)
            off += size
        assert _struct.calcsize("@" + fmt) >= off
        self.ptrs = (_ctypes.c_void_p * max(len(fmt), 1))(*offsets)
        self.ptrs_addr = _ctypes.addressof(self.ptrs)


def param_format(types) -> str:
    """``("ptr", "i64", "f32", ...)`` → a struct format string."""
    return "".join(_CTYPE_FMT[t] for t in types)


def _driver_launch():
    """cuLaunchKernel called through ctypes on libcuda (about 1 µs per call), or through
    cuda-python's binding (about 9 µs: it converts every argument) where libcuda cannot be
    opened by name."""
    try:
        lib = _ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernel
        fn.argtypes = [_ctypes.c_void_p] + [_ctypes.c_uint] * 7 + [_ctypes.c_void_p] * 3
        fn.restype = _ctypes.c_int
        return lambda f, gx, gy, gz, bx, by, bz, smem, stream, params: fn(f, gx, gy, gz, bx, by, bz, smem,
                                                                           stream or None, params, None)
    except (OSError, AttributeError):
        from cuda.bindings import driver

        def slow(f, gx, gy, gz, bx, by, bz, smem, stream, params):
            return int(driver.cuLaunchKernel(driver.CUfunction(f), gx, gy, gz, bx, by, bz, smem, stream,
                                             params, 0)[0])
        return slow


_cu_launch = None


def launch(fn, grid, block, fmt: str, values, stream: int, shared_mem: int = 0) -> None:
    """Launch a loaded CuPy function through the driver API with packed parameters."""
    global _cu_launch
    if _cu_launch is None:
        _cu_launch = _driver_launch()
    blocks = getattr(_launch_local, "blocks", None)
    if blocks is None:
        blocks = _launch_local.blocks = {}
    pb = blocks.get(fmt)
    if pb is None:
        pb = blocks[fmt] = _ParamBlock(fmt)
    pb.struct.pack_into(pb.buf, 0, *values)
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    bx, by, bz = (tuple(block) + (1, 1))[:3]
    err = _cu_launch(fn.ptr, gx, gy, gz, bx, by, bz, shared_mem, stream, pb.ptrs_addr)
    if err != 0:
        from .errors import SkuforgeError
        raise SkuforgeError(f"cuLaunchKernel failed: CUresult {err} (grid {grid}, block {block})")


