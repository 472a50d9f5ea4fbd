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
import ctypes
import functools
import numbers
import struct
import threading
from typing import Optional

from . import config
from .compiler import compile_cached
from .errors import DeviceRequiredError, InvalidProblemError, SkuforgeError


def cupy():
    try:
        import cupy as cp  # noqa: F401
        return cp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise DeviceRequiredError("skuforge kernels run through CuPy: pip install cupy-cuda13x") from e


def check_device(device, arg: str = "device") -> int:
    """``device`` as a CUDA device ordinal: a non-negative Python (or NumPy) integer below 2**31, else
    an InvalidProblemError naming ``arg`` (whether such a device exists is the driver's answer)."""
    if isinstance(device, bool) or not isinstance(device, numbers.Integral) or not 0 <= device < 1 << 31:
        raise InvalidProblemError(f"{arg}={device!r}: a CUDA device ordinal (an integer from 0, such as 0 for "
                                  "cuda:0) is required")
    return int(device)


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


# -- kernel parameters ---------------------------------------------------------------------------
# CuPy's Function.__call__ converts every scalar argument to a NumPy scalar (about 1 µs each on
# a server CPU); a kernel with 20 parameters then costs more to launch than to run at small
# sizes. Instead the parameters are packed with a precompiled ``struct`` format into a
# per-thread buffer whose field addresses form the ``void**`` array cuLaunchKernel takes.
# Native ``@`` alignment matches the CUDA parameter layout of the same C types.
# One character per parameter. "T": a 128-byte CUDA tensor map (``const __grid_constant__ CUtensorMap``,
# 64-byte aligned in the kernel's parameter space), packed from a 128-byte ``bytes`` value.
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


class _CtypesLaunch:
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


def _ints_launch(cu):
    """``cu`` (called with Python ints, as :class:`_CtypesLaunch` is) behind the ctypes-value
    convention of ``_CtypesLaunch.raw`` that a bound launch uses."""
    def raw(*values):
        return cu(*((v.value or 0) for v in values[:10]))
    return raw


# -- cooperative launches (every block resident: grid-wide barriers are safe) -----------------
# Used by the one-launch per-tensor dynamic quantize (templates/quantization/dynamic_tensor.cu.j2).
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH = 95
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81


class Driver:
    """What every driver shares: the context each loaded function must be launched in, the launches
    built on the driver's calls (a bound launch, a cooperative launch, a memset), and the state other
    modules keep per driver (:meth:`keep`). A subclass supplies the calls of the table in the module
    docstring (:class:`CudaDriver`; a fake device in the tests).

    The context of a launch: a module lives in the primary context of the device it was loaded on,
    and its kernels must be launched with that context current, on a stream of that device. The
    caller's current device may be another one (arrays on cuda:1 while cuda:0 is current; a thread
    in which no context is current yet; PyTorch, which may only note a device as current without
    making its context current), so a launch whose kernel's context is not current makes it current
    for the launch only (push / pop): the caller's current device is left as it was. While this
    driver has loaded modules in one context only (``several`` False), a launch goes straight to the
    driver; a thread where it is not current gets an error back, and the launch is made again with
    the kernel's context pushed. Once modules of a second context are loaded, every launch compares
    the current context first. No launch runs in a wrong context either way."""

    def __init__(self):
        self.several = False           # modules loaded in more than one context
        self._fn_ctx: dict = {}        # CUfunction address -> CUcontext of its module
        self._kept: dict = {}
        self._local = threading.local()    # this thread's parameter blocks (and context slot)
        self._stream_values: dict = {}     # stream handle -> its ctypes value (a bound launch's argument)

    def keep(self, key, make):
        """The object kept under ``key`` for another module's per-driver state (the status words,
        the graph counts), made by ``make()`` on first use."""
        got = self._kept.get(key)
        if got is None:
            got = self._kept.setdefault(key, make())
        return got

    def compile_arch(self, device: int) -> int:
        return self.properties(device)["cc"]

    # -- contexts ------------------------------------------------------------------------------
    def context_of(self, fn) -> int:
        """The context ``fn`` (a loaded function) must be launched in; 0 where unknown."""
        return self._fn_ctx.get(getattr(fn, "ptr", None), 0)

    def note_context(self, f: int, ctx: int) -> None:
        """Function address ``f`` was loaded in context ``ctx``."""
        self._fn_ctx[f] = ctx
        if not self.several and len(set(self._fn_ctx.values())) > 1:
            self.several = True

    def on_context(self, ctx: int) -> "OnContext":
        """``with drv.on_context(ctx):`` the block runs with ``ctx`` current (pushed only where another
        is current, popped after); ``ctx`` 0 changes nothing."""
        return OnContext(self, ctx)

    def on_context_of(self, fn) -> "OnContext":
        """``with drv.on_context_of(fn):`` the block runs in the context ``fn`` was loaded in (a
        function of unknown context changes nothing)."""
        return OnContext(self, self.context_of(fn))

    def push(self, ctx: int) -> None:
        err = self.context_push(ctx)
        if err != 0:
            raise SkuforgeError(f"cuCtxPushCurrent failed: CUresult {err}")

    # -- launches ------------------------------------------------------------------------------
    def _thread_block(self, fmt: str) -> ParamBlock:
        """This thread's parameter block for ``fmt`` (attribute ``pb_<fmt>`` of the thread-local
        store), made on first use. Per thread: the driver reads the block while ctypes has released
        the GIL, so another thread must not repack it."""
        name = "pb_" + fmt
        pb = getattr(self._local, name, None)
        if pb is None:
            pb = ParamBlock(fmt)
            setattr(self._local, name, pb)
        return pb

    def _params(self, fmt: str, values) -> ParamBlock:
        """This thread's parameter block for ``fmt``, packed with ``values``."""
        pb = self._thread_block(fmt)
        pb.struct.pack_into(pb.buf, 0, *values)
        return pb

    def _stream_value(self, stream: int):
        if len(self._stream_values) >= 1024:
            self._stream_values.clear()
        v = self._stream_values[stream] = ctypes.c_void_p(stream or None)
        return v

    def _relaunch(self, err: int, ctx: int, f, gx, gy, gz, bx, by, bz, smem, stream, ptrs) -> None:
        """After a failed launch: when ``ctx`` (the kernel's context) was not current, launch again with
        it pushed; raise what the driver said otherwise (or when that fails too)."""
        if ctx and self.context_current() != ctx:
            self.push(ctx)
            try:
                err = self.launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, ptrs)
            finally:
                self.context_pop()
        if err != 0:
            raise SkuforgeError(f"cuLaunchKernel failed: CUresult {err} (grid {(gx, gy, gz)}, block {(bx, by, bz)})")

    def bind_launch(self, fn, grid, block, fmt: str, shared_mem: int = 0):
        """``go(stream, values)``: launches ``fn`` (a loaded function) on ``grid`` / ``block`` with
        ``values`` packed by ``fmt`` (:func:`param_format`), in the context of the device it was loaded
        on, on ``stream`` (a stream of that device). Everything but the stream and the values is
        resolved here, once: what a repeated call pays is the packing and the driver call."""
        cu = self.launch_kernel
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        f = fn.ptr
        ctx = self._fn_ctx.get(f, 0)
        drv, current, local, streams = self, self.context_current, self._local, self._stream_values
        name = "pb_" + fmt                  # this thread's parameter block for the format (_thread_block)

        # ctypes values made once (the stream's cached per handle); a launcher taking ints (cuda-python's,
        # a fake device's) gets them back as ints (_ints_launch)
        raw = getattr(cu, "raw", None) or _ints_launch(cu)
        u = ctypes.c_uint
        cf, cgx, cgy, cgz, cbx, cby, cbz, csm = ctypes.c_void_p(f), u(gx), u(gy), u(gz), u(bx), u(by), u(bz), u(shared_mem)

        def go(stream, values):
            pb = getattr(local, name, None) or drv._thread_block(fmt)
            pb.struct.pack_into(pb.buf, 0, *values)
            s = streams.get(stream)
            if s is None:
                s = drv._stream_value(stream)
            if drv.several and ctx and current() != ctx:
                err = -1                    # not launched: _relaunch pushes the context
            else:
                err = raw(cf, cgx, cgy, cgz, cbx, cby, cbz, csm, s, pb.ptrs_value, None)
            if err:
                drv._relaunch(err, ctx, f, gx, gy, gz, bx, by, bz, shared_mem, stream, pb.ptrs_addr)
        return go

    def launch(self, fn, grid, block, fmt: str, values, stream: int, shared_mem: int = 0) -> None:
        """Launch a loaded function once (:meth:`bind_launch`, for a launch that is not repeated)."""
        self.bind_launch(fn, grid, block, fmt, shared_mem)(stream, values)

    def launch_cooperative(self, fn, grid: int, block: int, fmt: str, values, stream: int, shared_mem: int) -> None:
        """cuLaunchCooperativeKernel with packed parameters (the driver refuses a grid that is not
        resident at once: an error, never a hang)."""
        pb = self._params(fmt, values)
        with self.on_context_of(fn):
            err = self.cooperative_kernel(fn.ptr, grid, 1, 1, block, 1, 1, shared_mem, stream, pb.ptrs_addr)
        if int(err) != 0:
            raise SkuforgeError(f"cuLaunchCooperativeKernel failed: CUresult {int(err)} (grid {grid}, block {block}, "
                                f"{shared_mem} bytes of shared memory)")

    def memset_u32(self, ptr: int, value: int, count: int, stream: int) -> None:
        """cuMemsetD32Async: ``count`` 32-bit words at ``ptr`` set to ``value``, in stream order (in the
        current context: the caller makes the stream's device current, e.g. with :meth:`on_context_of`)."""
        err = self.memset_d32(ptr, value, count, stream)
        if int(err) != 0:
            raise SkuforgeError(f"cuMemsetD32Async failed: CUresult {int(err)}")


class OnContext:
    """``with OnContext(drv, ctx):`` (:meth:`Driver.on_context`)."""

    __slots__ = ("drv", "ctx", "pushed")

    def __init__(self, drv: Driver, ctx: int):
        self.drv, self.ctx, self.pushed = drv, ctx, False

    def __enter__(self):
        if self.ctx and self.drv.context_current() != self.ctx:
            self.drv.push(self.ctx)
            self.pushed = True
        return self

    def __exit__(self, *exc):
        if self.pushed:
            self.drv.context_pop()
            self.pushed = False
        return False


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


class CudaDriver(Driver):
    """The CUDA driver of this process: libcuda through ctypes (about 1 µs a call) where it opens by
    name, else cuda-python's bindings (a few µs more), and CuPy. Nothing is called before it is used."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        self._modules: dict = {}       # (registry root, unit, device) -> (module, {symbol: function}, context)
        self._props: dict = {}         # device -> properties
        self._attrs: dict = {}         # (device, attribute) -> value
        self._primary: dict = {}       # device -> primary context
        self._resident: dict = {}      # (function, threads, shared memory) -> blocks per SM
        self._coop: dict = {}          # (function, threads, shared memory wanted, device) -> (blocks, shared memory)
        self._lib = None
        self._calls: dict = {}         # libcuda function name -> the ctypes function, or None

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

    # -- libcuda -------------------------------------------------------------------------------
    def libcuda(self):
        """The driver library, opened once (OSError where it cannot be opened by name)."""
        if self._lib is None:
            self._lib = ctypes.CDLL("libcuda.so.1")
        return self._lib

    _ARGTYPES = {"cuLaunchCooperativeKernel": [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 2,
                 "cuMemsetD32Async": [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]}

    def _libcuda_call(self, name: str):
        """``name`` from libcuda through ctypes, or None where libcuda cannot be opened by name (then
        cuda-python's binding is used)."""
        if name not in self._calls:
            try:
                fn = getattr(self.libcuda(), name, None)
            except OSError:
                fn = None
            if fn is not None:
                fn.restype, fn.argtypes = ctypes.c_int, self._ARGTYPES[name]
            self._calls[name] = fn
        return self._calls[name]

    # -- contexts ------------------------------------------------------------------------------
    @functools.cached_property
    def _context_calls(self):
        """(current, push, pop) through ctypes on libcuda, or cuda-python's bindings where libcuda
        cannot be opened by name. ``current()`` returns the thread's current CUcontext as an int (0: none)."""
        try:
            lib = self.libcuda()
            get, push, pop = (getattr(lib, n) for n in ("cuCtxGetCurrent", "cuCtxPushCurrent_v2",
                                                        "cuCtxPopCurrent_v2"))
            for f in (get, push, pop):
                f.argtypes, f.restype = [ctypes.c_void_p], ctypes.c_int
        except (OSError, AttributeError):
            from cuda.bindings import driver

            def current():
                err, ctx = driver.cuCtxGetCurrent()
                return int(ctx) if int(err) == 0 and ctx is not None else 0

            def push_(ctx):
                return int(driver.cuCtxPushCurrent(driver.CUcontext(ctx))[0])

            def pop_():
                return int(driver.cuCtxPopCurrent()[0])
            return current, push_, pop_

        local = self._local

        def slot():
            """This thread's two words: the current context as read, a popped context (written by
            the driver while the GIL is released, hence one pair per thread)."""
            buf = (ctypes.c_void_p * 2)()
            at = ctypes.addressof(buf)
            local.ctx = s = (buf, at, at + ctypes.sizeof(ctypes.c_void_p))
            return s

        def current():
            s = getattr(local, "ctx", None) or slot()
            return (s[0][0] or 0) if get(s[1]) == 0 else 0

        def pop_():
            return pop((getattr(local, "ctx", None) or slot())[2])
        return current, push, pop_

    def context_current(self) -> int:
        """The calling thread's current CUDA context (CUcontext as an int; 0 where none is current)."""
        return self._context_calls[0]()

    def context_push(self, ctx: int) -> int:
        return self._context_calls[1](ctx)

    def context_pop(self) -> int:
        return self._context_calls[2]()

    # -- launches ------------------------------------------------------------------------------
    @functools.cached_property
    def launch_kernel(self):
        """cuLaunchKernel called through ctypes on libcuda (about 1 µs per call; :class:`_CtypesLaunch`),
        or through cuda-python's binding (about 9 µs: it converts every argument) where libcuda cannot be
        opened by name."""
        try:
            raw = self.libcuda()["cuLaunchKernel"]      # its own function object: no argtypes set
            raw.restype = ctypes.c_int
            return _CtypesLaunch(raw)
        except (OSError, AttributeError):
            from cuda.bindings import driver

            def slow(f, gx, gy, gz, bx, by, bz, smem, stream, params):
                return int(driver.cuLaunchKernel(driver.CUfunction(f), gx, gy, gz, bx, by, bz, smem, stream,
                                                 params, 0)[0])
            return slow

    def cooperative_kernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params) -> int:
        call = self._libcuda_call("cuLaunchCooperativeKernel")
        if call is not None:
            return call(f, gx, gy, gz, bx, by, bz, smem, stream or None, params)
        from cuda.bindings import driver
        return int(driver.cuLaunchCooperativeKernel(driver.CUfunction(f), gx, gy, gz, bx, by, bz, smem,
                                                    driver.CUstream(stream or 0), params)[0])

    def memset_d32(self, ptr: int, value: int, count: int, stream: int) -> int:
        call = self._libcuda_call("cuMemsetD32Async")
        if call is not None:
            return call(ptr, value, count, stream or None)
        from cuda.bindings import driver
        return int(driver.cuMemsetD32Async(driver.CUdeviceptr(ptr), value, count, driver.CUstream(stream or 0))[0])

    _GRAPH_CALLS = ("cuGraphCreate", "cuGraphAddKernelNode_v2", "cuGraphInstantiateWithFlags",
                    "cuGraphExecKernelNodeSetParams_v2", "cuGraphExecDestroy", "cuGraphDestroy")

    def graph_calls(self):
        """{name: function} of the graph calls runtime/graphs.py makes, or None where libcuda cannot be
        opened by name: the ctypes functions of ``_GRAPH_CALLS`` (returning a CUresult), and the
        replay's two calls from CuPy's runtime bindings, which take handles as ints and raise on an
        error: ``streamIsCapturing(stream)`` (whether the stream is being captured) and
        ``graphLaunch(exec, stream)``."""
        return self._graph_calls

    @functools.cached_property
    def _graph_calls(self):
        try:
            lib = self.libcuda()
            fns = {n: getattr(lib, n) for n in self._GRAPH_CALLS}
            for f in fns.values():
                f.restype = ctypes.c_int
            from cupy_backends.cuda.api import runtime
            fns.update(streamIsCapturing=runtime.streamIsCapturing, graphLaunch=runtime.graphLaunch)
        except (OSError, AttributeError, ImportError):
            return None
        return fns

    @functools.cached_property
    def _encode(self):
        """cuTensorMapEncodeTiled from libcuda through ctypes, or None where libcuda cannot be opened by
        name (then cuda-python's binding is used)."""
        try:
            fn = self.libcuda().cuTensorMapEncodeTiled
        except (OSError, AttributeError):
            return None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int]
        return fn

    def encode_tiled(self, args: tuple) -> tuple:
        """(CUresult, the 128 bytes) of ``cuTensorMapEncodeTiled(data type, rank, address, dims, strides,
        box, element strides, interleave, swizzle, L2 promotion, out-of-bounds fill)`` (``args``, in
        that order)."""
        rank, ptr = args[1], args[2]
        fn = self._encode
        if fn is not None:
            buf = ctypes.create_string_buffer(128 + 64)
            at = -ctypes.addressof(buf) % 64           # the driver wants the map 64-byte aligned
            arrays = ((ctypes.c_uint64 * rank)(*args[3]), (ctypes.c_uint64 * max(rank - 1, 1))(*args[4]),
                      (ctypes.c_uint32 * rank)(*args[5]), (ctypes.c_uint32 * rank)(*args[6]))
            err = fn(ctypes.addressof(buf) + at, args[0], rank, ptr, *(ctypes.addressof(a) for a in arrays), *args[7:])
            return int(err), buf.raw[at:at + 128]
        from cuda.bindings import driver
        u64, u32 = driver.cuuint64_t, driver.cuuint32_t
        err, m = driver.cuTensorMapEncodeTiled(
            driver.CUtensorMapDataType(args[0]), rank, ptr, [u64(v) for v in args[3]],
            [u64(v) for v in args[4]], [u32(v) for v in args[5]], [u32(v) for v in args[6]],
            driver.CUtensorMapInterleave(args[7]), driver.CUtensorMapSwizzle(args[8]),
            driver.CUtensorMapL2promotion(args[9]), driver.CUtensorMapFloatOOBfill(args[10]))
        return int(err), (b"".join(int(v).to_bytes(8, "little") for v in m.opaque) if int(err) == 0 else b"")

    # -- memory, streams, pointers ---------------------------------------------------------------
    def new_array(self, device: int, shape, dtype) -> tuple:
        """(a new CuPy array of ``shape`` and NumPy ``dtype`` on ``device``, its data pointer)."""
        cp = cupy()
        with cp.cuda.Device(device):
            a = cp.empty(shape, dtype=dtype)
        return a, a.data.ptr

    def array_maker(self, device: int, shape, dtype):
        """A zero-argument callable returning what ``new_array(device, shape, dtype)`` returns, with
        everything but the allocation resolved once (a replay's allocation)."""
        cp = cupy()
        nd, current, on_device = cp.ndarray, cp.cuda.runtime.getDevice, cp.cuda.Device

        def make():
            try:
                if current() == device:
                    a = nd(shape, dtype)
                else:
                    with on_device(device):
                        a = nd(shape, dtype)
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
        """(replay signature, pointer) of an array no framework describes: none (no fast path)."""
        return None, None


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
