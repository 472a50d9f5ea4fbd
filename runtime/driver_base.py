"""What every driver of the seam (runtime/device.py) shares: the context each loaded function must be
launched in, the launches built on a driver's calls (a bound launch, a cooperative launch, a memset)
and the state other modules keep per driver."""
from __future__ import annotations

import ctypes
import threading

from .errors import SkuforgeError
from .kernel_args import ParamBlock, ints_launch


class Driver:
    """What every driver shares: the context each loaded function must be launched in, the launches
    built on the driver's calls (a bound launch, a cooperative launch, a memset), and the state other
    modules keep per driver (:meth:`keep`). A subclass supplies the calls of the table in runtime/device.py's
    docstring (:class:`runtime.cuda_driver.CudaDriver`; a fake device in the tests).

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
        # a fake device's) gets them back as ints (ints_launch)
        raw = getattr(cu, "raw", None) or ints_launch(cu)
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
