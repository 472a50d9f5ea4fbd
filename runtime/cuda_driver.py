"""The real driver of the seam (runtime/device.py): :class:`CudaDriver` answers the runtime's device
queries, loads modules and reads occupancy through cuda-python's bindings, makes the driver calls
through libcuda (runtime/libcuda.py), and allocates and streams through CuPy. Also here: what says
that this process has no usable CUDA driver or device (:func:`no_device`), CuPy's view of a raw
stream (:func:`cupy_stream`), and the CUDA attribute numbers the runtime asks for."""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from .compiler import compile_cached
from .driver_base import Driver
from .errors import DeviceRequiredError, SkuforgeError
from .libcuda import LibcudaCalls


def cupy():
    try:
        import cupy as cp  # noqa: F401
        return cp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise DeviceRequiredError("skuforge kernels run through CuPy: pip install cupy-cuda13x") from e


# -- CUDA errors that mean "no usable driver or device" ----------------------------------------------
def no_device_error(e: BaseException) -> DeviceRequiredError:
    """``e`` (an error of the CUDA runtime or driver) as the DeviceRequiredError that names it."""
    return DeviceRequiredError(f"no usable CUDA device ({type(e).__name__}: {e}): skuforge's kernels need an "
                               f"NVIDIA GPU and its driver; compiling (`python -m codegen compile`) does not")


# CUDA status codes (the runtime and the driver API share them) that say there is no usable driver
# or device: not initialized / deinitialized, a stub library, a driver older than the runtime, a
# call that needs a newer driver, devices unavailable (exclusive mode), no device, an invalid
# device ordinal, system not ready, a driver / kernel-module mismatch, no forward compatibility.
NO_DEVICE_STATUS = frozenset((3, 4, 34, 35, 36, 46, 100, 101, 802, 803, 804))
_NO_DEVICE_ERRORS = ("CUDARuntimeError", "CUDADriverError", "DynamicLibNotFoundError")
_NO_DEVICE_TEXTS = ("Found no NVIDIA driver", "No CUDA GPUs are available", "CUDA driver version is insufficient",
                    "Torch not compiled with CUDA enabled", "no CUDA-capable device", "libcuda.so")


def no_device(e: BaseException):
    """``e`` as a :class:`DeviceRequiredError` naming what happened where ``e`` says that this process
    has no usable CUDA driver or device (CuPy's ``CUDARuntimeError: cudaErrorInsufficientDriver``,
    ``cudaErrorNoDevice``, a driver API error of the same kind, a libcuda that cannot be loaded,
    PyTorch's "Found no NVIDIA driver"); None for any other exception."""
    if isinstance(e, DeviceRequiredError):
        return None
    name = type(e).__name__
    if name in _NO_DEVICE_ERRORS and (name == "DynamicLibNotFoundError" or getattr(e, "status", None) in NO_DEVICE_STATUS):
        return no_device_error(e)
    if isinstance(e, (RuntimeError, AssertionError, OSError)) and any(t in str(e) for t in _NO_DEVICE_TEXTS):
        return no_device_error(e)
    return None


def raise_no_device(e: BaseException) -> None:
    """Inside an ``except`` block: raise :func:`no_device`'s error (from ``e``) where ``e`` says there
    is no usable driver or device; return otherwise (the caller re-raises ``e``)."""
    d = no_device(e)
    if d is not None:
        raise d from e


# -- cooperative launches (every block resident: grid-wide barriers are safe) -----------------
# Used by the one-launch per-tensor dynamic quantize (``dyn::coop``, templates/quantization/dynamic_int8.cuh).
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH = 95
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81


class _StreamHandle:
    """A raw ``cudaStream_t`` behind the CUDA stream protocol (what ``cupy.cuda.Stream.from_external`` takes)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def cupy_stream(handle: int, device: int):
    """CuPy's view of the raw stream ``handle`` of ``device`` (``with cupy_stream(h, d):`` makes it
    CuPy's current stream): ``Stream.from_external`` where CuPy has it, else ``ExternalStream``
    (what CuPy before 14 offers)."""
    import cupy as cp
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(handle))
    return cp.cuda.ExternalStream(handle, device)


class CudaDriver(LibcudaCalls, Driver):
    """The CUDA driver of this process: libcuda through ctypes (about 1 µs a call) where it opens by
    name, else cuda-python's bindings (a few µs more; :class:`runtime.libcuda.LibcudaCalls`), and CuPy.
    Nothing is called before it is used."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        self._modules: dict = {}       # (registry root, unit, device) -> (module, {symbol: function}, context)
        self._props: dict = {}         # device -> properties
        self._attrs: dict = {}         # (device, attribute) -> value
        self._primary: dict = {}       # device -> primary context
        self._resident: dict = {}      # (function, threads, shared memory) -> blocks per SM
        self._coop: dict = {}          # (function, threads, shared memory wanted, device) -> (blocks, shared memory)

    # -- device queries ------------------------------------------------------------------------
    def current_device(self) -> int:
        """The current CUDA device; :class:`DeviceRequiredError` where CuPy finds no driver or device
        (cudaErrorInsufficientDriver, cudaErrorNoDevice, ...)."""
        cp = cupy()
        try:
            return cp.cuda.runtime.getDevice()
        except cp.cuda.runtime.CUDARuntimeError as e:
            raise no_device_error(e) from e

    def properties(self, device: int) -> dict:
        p = self._props.get(device)
        if p is None:
            cp = cupy()
            try:
                raw = cp.cuda.runtime.getDeviceProperties(device)
            except cp.cuda.runtime.CUDARuntimeError as e:
                raise no_device_error(e) from e
            p = self._props[device] = {
                "name": raw["name"].decode() if isinstance(raw["name"], bytes) else raw["name"],
                "cc": raw["major"] * 10 + raw["minor"], "sms": raw["multiProcessorCount"],
                "max_threads_per_sm": raw["maxThreadsPerMultiProcessor"],
                "smem_optin": int(raw["sharedMemPerBlockOptin"])}
        return p

    def attribute(self, device: int, attribute: int) -> int:
        """cuDeviceGetAttribute (0 where the driver does not answer)."""
        key = (device, attribute)
        value = self._attrs.get(key)
        if value is None:
            from cuda.bindings import driver
            err, dev = driver.cuDeviceGet(device)
            err2, v = driver.cuDeviceGetAttribute(driver.CUdevice_attribute(attribute), dev)
            value = self._attrs[key] = int(v) if int(err) == 0 and int(err2) == 0 else 0
        return value

    def primary_context(self, device: int) -> int:
        """The device's primary context (the one the CUDA runtime, PyTorch and CuPy use), retained once
        for the process; :class:`DeviceRequiredError` where the driver cannot give it."""
        ctx = self._primary.get(device)
        if ctx is None:
            from cuda.bindings import driver
            err, dev = driver.cuDeviceGet(device)
            if int(err) == 0:
                err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
            if int(err) != 0:
                raise DeviceRequiredError(f"cuda:{device}: no primary context (CUresult {int(err)}); is the device "
                                          "visible to this process (CUDA_VISIBLE_DEVICES)?")
            ctx = self._primary[device] = int(ctx)
        return ctx

    # -- modules -------------------------------------------------------------------------------
    def load_function(self, registry, unit: str, symbol: str, device: int = None):
        """Compile ``unit`` for the device's arch (disk cache) and return ``symbol`` as a CuPy function.
        Modules are loaded once per (registry, unit, device), into the device's primary context (made
        current for the load only: the calling thread may have another device current, or none); each
        function's context is remembered so that a launch runs it there whatever device is current."""
        cp = cupy()
        if device is None:
            device = self.current_device()
        key = (str(registry.root), unit, device)
        mod = self._modules.get(key)
        if mod is None:
            with self._lock:
                mod = self._modules.get(key)
                if mod is None:
                    meta = registry.units[unit]
                    res = compile_cached(registry.unit_source(unit), unit, self.compile_arch(device),
                                         meta["nvrtc_options"], skus=meta.get("skus", ()))
                    ctx = self.primary_context(device)
                    with self.on_context(ctx):
                        mod = cp.cuda.function.Module()
                        mod.load(res.cubin)
                    mod = self._modules[key] = (mod, {}, ctx)
        module, functions, ctx = mod
        fn = functions.get(symbol)
        if fn is None:
            with self.on_context(ctx):
                fn = module.get_function(symbol)
            self.note_context(fn.ptr, ctx)
            functions[symbol] = fn
        return fn

    # -- occupancy -----------------------------------------------------------------------------
    def resident_blocks(self, fn, threads: int, smem: int = 0) -> int:
        """Blocks of ``threads`` threads of kernel ``fn`` resident on one SM with ``smem`` bytes of
        dynamic shared memory each (occupancy API; above 48 KB the function's limit is raised to
        ``smem`` first, as its launch needs)."""
        key = (fn.ptr, threads, smem)
        n = self._resident.get(key)
        if n is None:
            from cuda.bindings import driver
            f = driver.CUfunction(fn.ptr)
            with self.on_context_of(fn):
                if smem > 48 * 1024:
                    (err,) = driver.cuFuncSetAttribute(
                        f, driver.CUfunction_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), smem)
                    if int(err) != 0:
                        raise SkuforgeError(f"cuFuncSetAttribute failed: CUresult {int(err)} ({smem} bytes of "
                                            "dynamic shared memory)")
                err, n = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, threads, smem)
            n = self._resident[key] = max(1, int(n)) if int(err) == 0 else 1
        return n

    def cooperative_shape(self, fn, threads: int, device: int, want_smem: int) -> tuple:
        """(blocks, dynamic shared memory bytes) of a cooperative launch of ``fn``: the shared memory is
        ``want_smem`` capped by the device's per-block opt-in limit less ``fn``'s static shared memory
        (set once as the function's limit), and the blocks are every one that fits on the device at once.
        (0, 0) where the device cannot launch cooperatively."""
        key = (fn.ptr, threads, want_smem, device)
        hit = self._coop.get(key)
        if hit is None:
            if not self.attribute(device, CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH):
                hit = (0, 0)
            else:
                with self.on_context_of(fn):
                    hit = self._cooperative_shape(fn, threads, device, want_smem)
            self._coop[key] = hit
        return hit

    def _cooperative_shape(self, fn, threads: int, device: int, want_smem: int) -> tuple:
        from cuda.bindings import driver
        f = driver.CUfunction(fn.ptr)
        err, static = driver.cuFuncGetAttribute(driver.CUfunction_attribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES), f)
        cap = self.attribute(device, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) - int(static)
        smem = max(0, min(want_smem, cap)) // 16 * 16
        (err,) = driver.cuFuncSetAttribute(
            f, driver.CUfunction_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), smem)
        err2, per_sm = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, threads, smem)
        ok = int(err) == 0 and int(err2) == 0 and int(per_sm) > 0
        return (int(per_sm) * self.properties(device)["sms"], smem) if ok else (0, 0)

    # -- memory, streams, pointers ---------------------------------------------------------------
    def new_array(self, device: int, shape, dtype, strides=None) -> tuple:
        """(a new CuPy array of ``shape`` and NumPy ``dtype`` on ``device``, its data pointer);
        ``strides`` (elements, non-negative): that layout, in memory of its span, else C order."""
        return self.array_maker(device, shape, dtype, strides)()

    def array_maker(self, device: int, shape, dtype, strides=None):
        """A zero-argument callable returning what ``new_array(device, shape, dtype, strides)``
        returns, with everything but the allocation resolved once (a replay's allocation)."""
        cp = cupy()
        nd, current, on_device = cp.ndarray, cp.cuda.runtime.getDevice, cp.cuda.Device
        if strides is None:
            new = lambda: nd(shape, dtype)                                      # noqa: E731
        else:
            item = np.dtype(dtype).itemsize
            nbytes = item * (1 + sum((n - 1) * s for n, s in zip(shape, strides))) if all(shape) else 0
            byte_strides, malloc = tuple(s * item for s in strides), cp.cuda.alloc
            new = lambda: nd(shape, dtype, memptr=malloc(nbytes), strides=byte_strides)   # noqa: E731

        def make():
            try:
                if current() == device:
                    a = new()
                else:
                    with on_device(device):
                        a = new()
            except Exception as e:
                raise_no_device(e)
                raise
            return a, a.data.ptr
        return make

    def work_memory(self, device: int, nbytes: int):
        """``alloc(stream)`` returning ``(memory, its address)``: ``nbytes`` from CuPy's memory pool of
        ``device``, in the arena of ``stream`` (freed, it goes back there: its next use is ordered
        behind the stream's work)."""
        cp = cupy()
        on_device, malloc = cp.cuda.Device, cp.cuda.alloc

        def alloc(stream):
            try:
                with on_device(device), cupy_stream(stream, device):
                    m = malloc(nbytes)
            except Exception as e:
                raise_no_device(e)
                raise
            return m, m.ptr
        return alloc

    def fill_foreign(self, obj, value) -> None:
        """Set every element of a device array that has no ``fill`` of its own (only
        ``__cuda_array_interface__``), through a zero-copy CuPy view."""
        self.current_device()                 # DeviceRequiredError without a usable device
        view = cupy().asarray(obj)
        with view.device:
            view.fill(value)

    def mapped_words(self, count: int) -> tuple:
        """(a ctypes array of ``count`` zeroed 32-bit words of mapped, pinned host memory, their device
        address): portable and mapped, one allocation serves every device; with unified addressing
        the device address is the host address (asked for all the same)."""
        rt = cupy().cuda.runtime
        try:
            ptr = rt.hostAlloc(4 * count, rt.hostAllocPortable | rt.hostAllocMapped)
        except Exception as e:
            raise_no_device(e)          # DeviceRequiredError without a usable driver
            raise
        ctypes.memset(ptr, 0, 4 * count)
        return (ctypes.c_uint32 * count).from_address(ptr), rt.pointerGetAttributes(ptr).devicePointer or ptr

    def synchronize(self, device: int) -> None:
        """Wait for the device's work; DeviceRequiredError where there is no such device (or no driver)."""
        cp = cupy()
        try:
            with cp.cuda.Device(device):
                cp.cuda.runtime.deviceSynchronize()
        except Exception as e:
            raise_no_device(e)
            raise

    def stream(self, device: int) -> int:
        """CuPy's current stream of ``device`` (a raw ``cudaStream_t``)."""
        return cupy().cuda.get_current_stream(device).ptr

    def stream_getter(self, device: int):
        """A zero-argument callable returning what ``stream(device)`` returns at the time of the call."""
        get = cupy().cuda.get_current_stream
        return lambda: get(device).ptr

    def device_of_pointer(self, ptr: int) -> int:
        try:
            import cupy as cp
            return int(cp.cuda.runtime.pointerGetAttributes(ptr).device)
        except Exception:  # no driver (CPU-only validation) or a foreign pointer
            return 0

    @staticmethod
    def describe(obj) -> tuple:
        """(replay signature, pointer) of an array no framework describes: none (no replay)."""
        return None, None
