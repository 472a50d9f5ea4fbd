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
