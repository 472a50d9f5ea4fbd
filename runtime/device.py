"""Devices: module loading per device through CuPy, device properties, stream handles."""
from __future__ import annotations

import numbers
import threading
from functools import lru_cache

from .arrays import no_device_error
from .compiler import compile_cached
from .errors import DeviceRequiredError, InvalidProblemError

_modules: dict = {}
_lock = threading.Lock()


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


def current_device() -> int:
    """The current CUDA device; :class:`DeviceRequiredError` where CuPy finds no driver or device
    (cudaErrorInsufficientDriver, cudaErrorNoDevice, ...)."""
    cp = cupy()
    try:
        return cp.cuda.runtime.getDevice()
    except cp.cuda.runtime.CUDARuntimeError as e:
        raise no_device_error(e) from e


@lru_cache(maxsize=None)
def properties(device: int) -> dict:
    cp = cupy()
    try:
        p = cp.cuda.runtime.getDeviceProperties(device)
    except cp.cuda.runtime.CUDARuntimeError as e:
        raise no_device_error(e) from e
    return {"name": p["name"].decode() if isinstance(p["name"], bytes) else p["name"],
            "cc": p["major"] * 10 + p["minor"], "sms": p["multiProcessorCount"],
            "max_threads_per_sm": p["maxThreadsPerMultiProcessor"]}


def compile_arch(device: int) -> int:
    return properties(device)["cc"]


def load_function(registry, unit: str, symbol: str, device: int = None):
    """Compile ``unit`` for the device's arch (disk cache) and return ``symbol`` as a CuPy function.
    Modules are loaded once per (registry, unit, device), into the device's primary context (made
    current for the load only: the calling thread may have another device current, or none); each
    function's context is remembered so that :func:`launch` runs it there whatever device is current."""
    cp = cupy()
    if device is None:
        device = current_device()
    key = (str(registry.root), unit, device)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                meta = registry.units[unit]
                res = compile_cached(registry.unit_source(unit), unit, compile_arch(device), meta["nvrtc_options"],
                                     skus=meta.get("skus", ()))
                ctx = primary_context(device)
                with on_context(ctx):
                    mod = cp.cuda.function.Module()
                    mod.load(res.cubin)
                mod = (mod, {}, ctx)
                _modules[key] = mod
    module, functions, ctx = mod
    fn = functions.get(symbol)
    if fn is None:
        with on_context(ctx):
            fn = module.get_function(symbol)
        _note_context(fn.ptr, ctx)
        functions[symbol] = fn
    return fn


@lru_cache(maxsize=None)
def primary_context(device: int) -> int:
    """The device's primary context (the one the CUDA runtime, PyTorch and CuPy use), retained once
    for the process; :class:`DeviceRequiredError` where the driver cannot give it."""
    from cuda.bindings import driver
    err, dev = driver.cuDeviceGet(device)
    if int(err) == 0:
        err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
    if int(err) != 0:
        raise DeviceRequiredError(f"cuda:{device}: no primary context (CUresult {int(err)}); is the device "
                                  "visible to this process (CUDA_VISIBLE_DEVICES)?")
    return int(ctx)


_resident: dict = {}


def resident_blocks(fn, threads: int) -> int:
    """Blocks of ``threads`` threads of kernel ``fn`` resident on one SM (occupancy API)."""
    key = (fn.ptr, threads)
    n = _resident.get(key)
    if n is None:
        from cuda.bindings import driver
        with on_context_of(fn):
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
# One character per parameter. "T": a 128-byte CUDA tensor map (``const __grid_constant__ CUtensorMap``,
# 64-byte aligned in the kernel's parameter space), packed from a 128-byte ``bytes`` value.
_CTYPE_FMT = {"ptr": "Q", "i64": "q", "i32": "i", "u32": "I", "f32": "f", "f64": "d", "tmap": "T"}
_WIDE = {"T": ("128s", 128, 64)}   # format character -> (struct code, size, alignment)


class _ParamBlock:
    """The packed values of one parameter list and the ``void**`` array of their addresses. The
    driver copies each parameter from its address, so the host-side padding only keeps every field
    at its natural alignment (explicit pad bytes, one struct)."""

    def __init__(self, fmt: str):
        codes, offsets, off = [], [], 0
        for ch in fmt:
            code, size, align = _WIDE.get(ch) or (ch, _struct.calcsize("@" + ch), _struct.calcsize("@" + ch))
            pad = -off % align
            if pad:
                codes.append(f"{pad}x")
            off += pad
            offsets.append(off)
            codes.append(code)
            off += size
        self.struct = _struct.Struct("=" + "".join(codes))
        assert self.struct.size == off
        self.buf = _ctypes.create_string_buffer(max(self.struct.size, 1))
        base = _ctypes.addressof(self.buf)
        self.ptrs = (_ctypes.c_void_p * max(len(fmt), 1))(*(base + o for o in offsets))
        self.ptrs_addr = _ctypes.addressof(self.ptrs)
        self.ptrs_value = _ctypes.c_void_p(self.ptrs_addr)


def pack_params(fmt: str, values) -> bytes:
    """The parameter values packed as a launch packs them (a struct.error where they do not fit)."""
    return _ParamBlock(fmt).struct.pack(*values)


def param_format(types) -> str:
    """``("ptr", "i64", "f32", ...)`` → one format character per parameter (:class:`_ParamBlock`)."""
    return "".join(_CTYPE_FMT[t] for t in types)


@lru_cache(maxsize=None)
def _libcuda():
    """The driver library, opened once (OSError where it cannot be opened by name)."""
    return _ctypes.CDLL("libcuda.so.1")


class _CtypesLaunch:
    """cuLaunchKernel of libcuda through ctypes, called as ``(f, gx, gy, gz, bx, by, bz, smem, stream,
    params)`` with Python ints. ``raw`` is the bare function (no ``argtypes``): a bound launch
    (:func:`bind_launch`) passes it ctypes values made once, which skips ctypes' conversion of
    eleven arguments per call (about 0.7 µs)."""

    __slots__ = ("raw",)

    def __init__(self, raw):
        self.raw = raw

    def __call__(self, f, gx, gy, gz, bx, by, bz, smem, stream, params):
        u = _ctypes.c_uint
        return self.raw(_ctypes.c_void_p(f), u(gx), u(gy), u(gz), u(bx), u(by), u(bz), u(smem),
                        _ctypes.c_void_p(stream or None), _ctypes.c_void_p(params), None)


def _driver_launch():
    """cuLaunchKernel called through ctypes on libcuda (about 1 µs per call; :class:`_CtypesLaunch`),
    or through cuda-python's binding (about 9 µs: it converts every argument) where libcuda cannot be
    opened by name."""
    try:
        raw = _ctypes.CDLL("libcuda.so.1").cuLaunchKernel    # its own function object: no argtypes set
        raw.restype = _ctypes.c_int
        return _CtypesLaunch(raw)
    except (OSError, AttributeError):
        from cuda.bindings import driver

        def slow(f, gx, gy, gz, bx, by, bz, smem, stream, params):
            return int(driver.cuLaunchKernel(driver.CUfunction(f), gx, gy, gz, bx, by, bz, smem, stream,
                                             params, 0)[0])
        return slow


def _ints_launch(cu):
    """``cu`` (called with Python ints, as :class:`_CtypesLaunch` is) behind the ctypes-value
    convention of ``_CtypesLaunch.raw`` that a bound launch uses."""
    def raw(*values):
        return cu(*((v.value or 0) for v in values[:10]))
    return raw


_cu_launch = None
_stream_values: dict = {}     # stream handle -> its ctypes value (a bound launch's argument)


def _stream_value(stream: int):
    if len(_stream_values) >= 1024:
        _stream_values.clear()
    v = _stream_values[stream] = _ctypes.c_void_p(stream or None)
    return v


def _thread_block(fmt: str) -> _ParamBlock:
    """This thread's parameter block for ``fmt`` (attribute ``pb_<fmt>`` of the thread-local store),
    made on first use."""
    name = "pb_" + fmt
    pb = getattr(_launch_local, name, None)
    if pb is None:
        pb = _ParamBlock(fmt)
        setattr(_launch_local, name, pb)
    return pb


def _params(fmt: str, values):
    """This thread's parameter block for ``fmt``, packed with ``values`` (the cooperative launch)."""
    pb = _thread_block(fmt)
    pb.struct.pack_into(pb.buf, 0, *values)
    return pb


# -- the context of a launch ------------------------------------------------------------------
# A module lives in the primary context of the device it was loaded on, and its kernels must be
# launched with that context current, on a stream of that device. The caller's current device may
# be another one (arrays on cuda:1 while cuda:0 is current; a thread in which no context is current
# yet; PyTorch, which may only note a device as current without making its context current), so a
# launch whose kernel's context is not current makes it current for the launch only
# (cuCtxPushCurrent / cuCtxPopCurrent): the caller's current device is left as it was. How a launch
# finds out (asking cuCtxGetCurrent first, or only after the driver refused): :func:`bind_launch`.
_fn_ctx: dict = {}          # CUfunction address -> CUcontext of its module


@lru_cache(maxsize=None)
def _context_calls():
    """(current, push, pop) through ctypes on libcuda, or cuda-python's bindings where libcuda
    cannot be opened by name. ``current()`` returns the thread's current CUcontext as an int (0: none)."""
    try:
        lib = _libcuda()
        get, push, pop = (getattr(lib, n) for n in ("cuCtxGetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2"))
        for f in (get, push, pop):
            f.argtypes, f.restype = [_ctypes.c_void_p], _ctypes.c_int
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

    local = _launch_local

    def slot():
        """This thread's two words: the current context as read, a popped context (written by
        the driver while the GIL is released, hence one pair per thread)."""
        buf = (_ctypes.c_void_p * 2)()
        at = _ctypes.addressof(buf)
        local.ctx = s = (buf, at, at + _ctypes.sizeof(_ctypes.c_void_p))
        return s

    def current():
        s = getattr(local, "ctx", None) or slot()
        return (s[0][0] or 0) if get(s[1]) == 0 else 0

    def pop_():
        return pop((getattr(local, "ctx", None) or slot())[2])
    return current, push, pop_


def context_current() -> int:
    """The calling thread's current CUDA context (CUcontext as an int; 0 where none is current)."""
    return _context_calls()[0]()


def _context_push(ctx: int) -> None:
    err = _context_calls()[1](ctx)
    if err != 0:
        from .errors import SkuforgeError
        raise SkuforgeError(f"cuCtxPushCurrent failed: CUresult {err}")


def _context_pop() -> None:
    _context_calls()[2]()


def context_of(fn) -> int:
    """The context ``fn`` (a loaded function) must be launched in; 0 where unknown."""
    return _fn_ctx.get(getattr(fn, "ptr", None), 0)


class on_context:
    """``with on_context(ctx):`` the block runs with ``ctx`` current (pushed only where another is
    current, popped after); ``ctx`` 0 changes nothing."""

    __slots__ = ("ctx", "pushed")

    def __init__(self, ctx: int):
        self.ctx = ctx
        self.pushed = False

    def __enter__(self):
        if self.ctx and context_current() != self.ctx:
            _context_push(self.ctx)
            self.pushed = True
        return self

    def __exit__(self, *exc):
        if self.pushed:
            _context_pop()
            self.pushed = False
        return False


def on_context_of(fn) -> on_context:
    """``with on_context_of(fn):`` the block runs in the context ``fn`` was loaded in (a function of
    unknown context changes nothing)."""
    return on_context(context_of(fn))


# Whether this process has loaded modules in more than one context (several devices): only then
# can a thread's current context be another device's, and every launch compares it first. With
# one context a launch goes straight to the driver; a thread where it is not current (none is, or
# one of the caller's own) gets an error back from the launch, which is then retried with the
# kernel's context pushed (:func:`_relaunch`): no launch runs in a wrong context either way.
_several_contexts = [False]


def _note_context(f: int, ctx: int) -> None:
    _fn_ctx[f] = ctx
    if not _several_contexts[0] and len(set(_fn_ctx.values())) > 1:
        _several_contexts[0] = True


def _relaunch(err: int, ctx: int, f, gx, gy, gz, bx, by, bz, smem, stream, ptrs) -> None:
    """After a failed launch: when ``ctx`` (the kernel's context) was not current, launch again with
    it pushed; raise what the driver said otherwise (or when that fails too)."""
    if ctx and context_current() != ctx:
        _context_push(ctx)
        try:
            err = _cu_launch(f, gx, gy, gz, bx, by, bz, smem, stream, ptrs)
        finally:
            _context_pop()
    if err != 0:
        from .errors import SkuforgeError
        raise SkuforgeError(f"cuLaunchKernel failed: CUresult {err} (grid {(gx, gy, gz)}, block {(bx, by, bz)})")


def bind_launch(fn, grid, block, fmt: str, shared_mem: int = 0):
    """``go(stream, values)``: launches ``fn`` (a loaded CuPy function) on ``grid`` / ``block`` with
    ``values`` packed by ``fmt`` (:func:`param_format`), in the context of the device it was loaded
    on, on ``stream`` (a stream of that device). Everything but the stream and the values is
    resolved here, once: what a repeated call pays is the packing and the driver call."""
    global _cu_launch
    if _cu_launch is None:
        _cu_launch = _driver_launch()
    cu = _cu_launch
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    bx, by, bz = (tuple(block) + (1, 1))[:3]
    f = fn.ptr
    ctx = _fn_ctx.get(f, 0)
    several, current, local = _several_contexts, context_current, _launch_local
    name = "pb_" + fmt                  # this thread's parameter block for the format (_thread_block)

    # ctypes values made once (the stream's cached per handle); a launcher taking ints (cuda-python's,
    # a test's) gets them back as ints (_ints_launch)
    raw = getattr(cu, "raw", None) or _ints_launch(cu)
    u = _ctypes.c_uint
    cf, cgx, cgy, cgz, cbx, cby, cbz, csm = _ctypes.c_void_p(f), u(gx), u(gy), u(gz), u(bx), u(by), u(bz), u(shared_mem)
    streams = _stream_values

    def go(stream, values):
        pb = getattr(local, name, None) or _thread_block(fmt)
        pb.struct.pack_into(pb.buf, 0, *values)
        s = streams.get(stream)
        if s is None:
            s = _stream_value(stream)
        if several[0] and ctx and current() != ctx:
            err = -1                    # not launched: _relaunch pushes the context
        else:
            err = raw(cf, cgx, cgy, cgz, cbx, cby, cbz, csm, s, pb.ptrs_value, None)
        if err:
            _relaunch(err, ctx, f, gx, gy, gz, bx, by, bz, shared_mem, stream, pb.ptrs_addr)
    return go


def launch(fn, grid, block, fmt: str, values, stream: int, shared_mem: int = 0) -> None:
    """Launch a loaded CuPy function once (:func:`bind_launch`, for a launch that is not repeated)."""
    bind_launch(fn, grid, block, fmt, shared_mem)(stream, values)


# -- cooperative launches (every block resident: grid-wide barriers are safe) -----------------
# Used by the one-launch per-tensor dynamic quantize (templates/quantization/dynamic_tensor.cu.j2).
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH = 95
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81


@lru_cache(maxsize=None)
def device_attribute(device: int, attribute: int) -> int:
    from cuda.bindings import driver
    err, dev = driver.cuDeviceGet(device)
    err2, value = driver.cuDeviceGetAttribute(driver.CUdevice_attribute(attribute), dev)
    return int(value) if int(err) == 0 and int(err2) == 0 else 0


_dyn_smem: dict = {}


def cooperative_shape(fn, threads: int, device: int, want_smem: int) -> tuple:
    """(blocks, dynamic shared memory bytes) of a cooperative launch of ``fn``: the shared memory is
    ``want_smem`` capped by the device's per-block opt-in limit less ``fn``'s static shared memory
    (set once as the function's limit), and the blocks are every one that fits on the device at once.
    (0, 0) where the device cannot launch cooperatively."""
    key = (fn.ptr, threads, want_smem, device)
    hit = _dyn_smem.get(key)
    if hit is None:
        from cuda.bindings import driver
        if not device_attribute(device, CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH):
            hit = (0, 0)
        else:
            with on_context_of(fn):
                hit = _cooperative_shape(driver, fn, threads, device, want_smem)
        _dyn_smem[key] = hit
    return hit


def _cooperative_shape(driver, fn, threads: int, device: int, want_smem: int) -> tuple:
    f = driver.CUfunction(fn.ptr)
    err, static = driver.cuFuncGetAttribute(driver.CUfunction_attribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES), f)
    cap = device_attribute(device, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) - int(static)
    smem = max(0, min(want_smem, cap)) // 16 * 16
    (err,) = driver.cuFuncSetAttribute(
        f, driver.CUfunction_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), smem)
    err2, per_sm = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, threads, smem)
    ok = int(err) == 0 and int(err2) == 0 and int(per_sm) > 0
    return (int(per_sm) * properties(device)["sms"], smem) if ok else (0, 0)


@lru_cache(maxsize=None)
def _libcuda_call(name: str):
    """``name`` from libcuda through ctypes (about 1 µs a call), or None where libcuda cannot be
    opened by name (then cuda-python's binding is used: a few µs more)."""
    try:
        lib = _libcuda()
    except OSError:
        return None
    fn = getattr(lib, name, None)
    if fn is not None:
        fn.restype = _ctypes.c_int
        fn.argtypes = {"cuLaunchCooperativeKernel": [_ctypes.c_void_p] + [_ctypes.c_uint] * 7 + [_ctypes.c_void_p] * 2,
                       "cuMemsetD32Async": [_ctypes.c_uint64, _ctypes.c_uint, _ctypes.c_size_t, _ctypes.c_void_p]}[name]
    return fn


def launch_cooperative(fn, grid: int, block: int, fmt: str, values, stream: int, shared_mem: int) -> None:
    """cuLaunchCooperativeKernel with packed parameters (the driver refuses a grid that is not
    resident at once: an error, never a hang)."""
    pb = _params(fmt, values)
    call = _libcuda_call("cuLaunchCooperativeKernel")
    with on_context_of(fn):
        if call is not None:
            err = call(fn.ptr, grid, 1, 1, block, 1, 1, shared_mem, stream or None, pb.ptrs_addr)
        else:
            from cuda.bindings import driver
            (err,) = driver.cuLaunchCooperativeKernel(driver.CUfunction(fn.ptr), grid, 1, 1, block, 1, 1, shared_mem,
                                                       driver.CUstream(stream or 0), pb.ptrs_addr)
    if int(err) != 0:
        from .errors import SkuforgeError
        raise SkuforgeError(f"cuLaunchCooperativeKernel failed: CUresult {int(err)} (grid {grid}, block {block}, "
                            f"{shared_mem} bytes of shared memory)")


def memset_u32(ptr: int, value: int, count: int, stream: int) -> None:
    """cuMemsetD32Async: ``count`` 32-bit words at ``ptr`` set to ``value``, in stream order (in the
    current context: the caller makes the stream's device current, e.g. with :class:`on_context_of`)."""
    call = _libcuda_call("cuMemsetD32Async")
    if call is not None:
        err = call(ptr, value, count, stream or None)
    else:
        from cuda.bindings import driver
        (err,) = driver.cuMemsetD32Async(driver.CUdeviceptr(ptr), value, count, driver.CUstream(stream or 0))
    if int(err) != 0:
        from .errors import SkuforgeError
        raise SkuforgeError(f"cuMemsetD32Async failed: CUresult {int(err)}")


