"""The driver seam: everything of the runtime that touches the CUDA driver or a device, behind one object.

A :class:`Driver` answers what the runtime asks of a device and keeps what it learns per process:

======================  ===================================================================================
what                    methods
======================  ===================================================================================
device queries          ``current_device()``, ``properties(d)`` (name, cc, sms, max_threads_per_sm,
                        smem_optin), ``attribute(d, CU_DEVICE_ATTRIBUTE_...)``
modules                 ``load_function(registry, unit, symbol, d)`` (compiled for the device's arch,
                        loaded once per (registry, unit, device) into its primary context)
occupancy               ``resident_blocks(fn, threads, smem)``, ``cooperative_shape(fn, threads, d, smem)``
contexts                ``context_current()``, ``context_push(ctx)``, ``context_pop()`` (CUresults);
                        ``context_of(fn)``, ``on_context(ctx)``, ``on_context_of(fn)``
launches                ``launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params)`` and
                        ``cooperative_kernel(...)`` (cuLaunchKernel / cuLaunchCooperativeKernel on
                        ints, a CUresult back), ``memset_d32(ptr, value, count, stream)``; built on
                        them: ``bind_launch``, ``launch``, ``launch_cooperative``, ``memset_u32``
graphs, tensor maps     ``graph_calls()`` (runtime/graphs.py), ``encode_tiled(args)`` (runtime/tma.py)
memory the runtime      ``new_array(d, shape, dtype)``, ``array_maker(d, shape, dtype)`` (a replay's
allocates (CuPy)        allocation), ``work_memory(d, nbytes)`` (a graph's kept work arrays),
                        ``fill_foreign(obj, value)``, ``mapped_words(n)`` (the status words, runtime/status.py)
streams, pointers       ``stream(d)`` and ``stream_getter(d)`` (CuPy's current stream of the device),
                        ``synchronize(d)``, ``device_of_pointer(ptr)``, ``describe(obj)`` (the replay
                        key of an array type no framework describes: none for the real driver)
======================  ===================================================================================

:class:`CudaDriver` is the real one: libcuda through ``ctypes`` where it opens by name, else
cuda-python's bindings, and CuPy (loading modules, its runtime calls, its memory pool). PyTorch
tensors are allocated by PyTorch and launched on its current stream (runtime/arrays.py); the
driver serves the memory and streams the runtime manages itself.

Where each part lives: :class:`Driver` (the context of a launch, the launches built on the driver's
calls, per-driver state) in runtime/driver_base.py; :class:`CudaDriver` in runtime/cuda_driver.py,
its libcuda calls in runtime/libcuda.py; the packing of kernel parameters in runtime/kernel_args.py.
This module holds the current driver and imports each of their public names, so that
``runtime.device.<name>`` is the one place callers take them from.

The process has one current driver, :func:`driver`: a :class:`CudaDriver` made on first use
(importing this module calls nothing of CUDA). ``with use(d):`` makes ``d`` the current driver of
every thread for the block (tests inject a fake device this way: tests/fakes.py, docs/testing.md);
what the runtime remembered from a driver (``runtime.config.CACHES``: the remembered calls, fused
launches, tensor maps) is forgotten on entry and on exit. The runtime asks the current driver when
it prepares a launch and binds what a repeated call runs (:meth:`Driver.bind_launch`), so that a
replay pays no lookup of the driver.
"""
from __future__ import annotations

import contextlib
import numbers
import threading
from typing import Optional

from . import config
from .cuda_driver import (CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH,  # noqa: F401  (the seam's names, taken from here)
                          CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                          CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                          CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                          NO_DEVICE_STATUS, CudaDriver, cupy, cupy_stream, no_device, no_device_error,
                          raise_no_device)
from .driver_base import Driver, OnContext  # noqa: F401
from .errors import InvalidProblemError
from .kernel_args import ParamBlock, pack_params, param_format  # noqa: F401


def check_device(device, arg: str = "device") -> int:
    """``device`` as a CUDA device ordinal: a non-negative Python (or NumPy) integer below 2**31, else
    an InvalidProblemError naming ``arg`` (whether such a device exists is the driver's answer)."""
    if isinstance(device, bool) or not isinstance(device, numbers.Integral) or not 0 <= device < 1 << 31:
        raise InvalidProblemError(f"{arg}={device!r}: a CUDA device ordinal (an integer from 0, such as 0 for "
                                  "cuda:0) is required")
    return int(device)


# -- the current driver ------------------------------------------------------------------------
_current: Optional[Driver] = None       # put in place by use()
_cuda: Optional[CudaDriver] = None      # the real one, made on first use
_made = threading.Lock()


def driver() -> Driver:
    """The process's current driver: the :class:`CudaDriver`, unless :func:`use` put another in place."""
    d = _current
    if d is None:
        d = _cuda if _cuda is not None else _real()
    return d


def _real() -> CudaDriver:
    global _cuda
    with _made:
        if _cuda is None:
            _cuda = CudaDriver()
    return _cuda


@contextlib.contextmanager
def use(d: Driver):
    """``with use(d):`` ``d`` is the current driver of every thread inside the block (the previous one
    after it); what the runtime remembered from a driver is forgotten on entry and on exit."""
    global _current
    prev = _current
    _current = d
    config.CACHES.forget()
    try:
        yield d
    finally:
        _current = prev
        config.CACHES.forget()


# -- the current driver's answers, for callers outside the runtime (tools, the harness) -------------
def current_device() -> int:
    return driver().current_device()


def properties(device: int) -> dict:
    return driver().properties(device)


def compile_arch(device: int) -> int:
    return driver().compile_arch(device)


def load_function(registry, unit: str, symbol: str, device: int = None):
    return driver().load_function(registry, unit, symbol, device)


def resident_blocks(fn, threads: int, smem: int = 0) -> int:
    return driver().resident_blocks(fn, threads, smem)


def bind_launch(fn, grid, block, fmt: str, shared_mem: int = 0):
    return driver().bind_launch(fn, grid, block, fmt, shared_mem)


def launch(fn, grid, block, fmt: str, values, stream: int, shared_mem: int = 0) -> None:
    driver().launch(fn, grid, block, fmt, values, stream, shared_mem)
