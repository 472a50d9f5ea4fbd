"""The calls the real driver makes of libcuda: through ``ctypes`` where ``libcuda.so.1`` opens by name
(about 1 µs a call), else through cuda-python's bindings (a few µs more): the context calls, the
launches (cuLaunchKernel, cuLaunchCooperativeKernel), cuMemsetD32Async, the graph calls and the
tensor-map encoding. :class:`LibcudaCalls` is the part of :class:`runtime.cuda_driver.CudaDriver`
that makes them (a test of the driver's own logic overrides ``libcuda`` or one of the calls)."""
from __future__ import annotations

import ctypes
import functools

from .kernel_args import CtypesLaunch


class LibcudaCalls:
    """libcuda's functions, looked up once each (a mixin of a :class:`runtime.driver_base.Driver`:
    the context slot is per thread, in the driver's thread-local store)."""

    def __init__(self):
        super().__init__()
        self._lib = None
        self._calls: dict = {}         # libcuda function name -> the ctypes function, or None

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
        """cuLaunchKernel called through ctypes on libcuda (about 1 µs per call; :class:`CtypesLaunch`),
        or through cuda-python's binding (about 9 µs: it converts every argument) where libcuda cannot be
        opened by name."""
        try:
            raw = self.libcuda()["cuLaunchKernel"]      # its own function object: no argtypes set
            raw.restype = ctypes.c_int
            return CtypesLaunch(raw)
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
