"""Fakes for CPU tests: device arrays that do not exist, and a fake device behind the driver seam.

:class:`FakeDeviceArray` is a ``__cuda_array_interface__`` that is never read: validation happens
before any launch or allocation, so errors can be tested on a machine without a GPU by describing
arrays that do not exist. :class:`FakeDevice` is a ``runtime.device.Driver`` that answers the
runtime's device queries from a table and records every launch; a test puts it in place with
``runtime.device.use(fake)`` (the ``fake_device`` fixture of tests/conftest.py; docs/testing.md).
"""
import ctypes
import hashlib
import math
import threading
from collections import namedtuple

import numpy as np

from runtime import device, kinds, tma


class FakeDeviceArray:
    def __init__(self, shape, dtype="float32", strides=None, ptr=0x7F0000000000):
        dt = np.dtype(dtype)
        self.shape = tuple(shape)
        self.dtype = dt
        self.__cuda_array_interface__ = {
            "shape": self.shape, "typestr": dt.str, "data": (ptr, False),
            "strides": None if strides is None else tuple(s * dt.itemsize for s in strides), "version": 3,
        }


def err(fn, exc, *words):
    """Call ``fn``, expect ``exc``, and check that the message names every one of ``words``."""
    import pytest
    with pytest.raises(exc) as e:
        fn()
    msg = str(e.value)
    for w in words:
        assert w in msg, msg
    return msg


def assert_aligned(fn, values):
    """Every pointer parameter the kernel ``fn`` (an entry-point symbol: what the fakes load) moves in
    words wider than an element is aligned as that access needs, row strides included, as
    runtime/vectors.py declares the kernels' accesses (what a misaligned launch would fault on)."""
    import runtime as sf
    from runtime import plans, vectors
    reg = sf.default_registry()
    entry, group = entry_points(reg).get(fn, (None, None))
    assert entry is not None, f"a launch of {fn!r}, which is no entry point of the manifest"
    abi = reg.abi(entry.launch["abi"][group])
    assert len(values) == len(abi.names), f"{fn}: {len(values)} values for {abi}"
    accesses = plans.LAUNCHERS[entry.launch["kind"]].accesses(entry.sku, entry.launch).get(group, ())
    bad = vectors.problems(accesses, dict(zip(abi.names, values)))
    assert not bad, f"{fn} launched with misaligned vector accesses: {bad}"


_ENTRY_POINTS: dict = {}


def entry_points(reg) -> dict:
    """Every entry-point symbol of the manifest -> (a KernelEntry that launches it, its ABI group): the
    entry points each kernel records (``launch["entries"]``; a shared one under its host's symbol) and
    the moe tile variants."""
    got = _ENTRY_POINTS.get(id(reg))
    if got is not None:
        return got
    out = {}
    for entry in reg.entries.values():
        out.update({p["symbol"]: (entry, p["group"]) for p in entry.launch["entries"].values()})
        out.update({v["symbol"]: (entry, "gemm") for v in (entry.launch.get("variants") or {}).values()})
    _ENTRY_POINTS[id(reg)] = out
    return out


def count_replays(monkeypatch, on_replay):
    """``on_replay(hit)`` after every replay of a call remembered from now on (runtime/replay.py;
    ``hit``: it ran, rather than handing the call to the full path). Clear ``replay.CACHE`` after."""
    from runtime import replay
    real = replay.write_replay

    def compile_counted(e, nargs, result):
        go = real(e, nargs, result)

        def counted(args, vals, static):
            r = go(args, vals, static)
            on_replay(r is not replay.MISS)
            return r
        return counted
    monkeypatch.setattr(replay, "write_replay", compile_counted)


# -- the fake device -------------------------------------------------------------------------------
H200 = {"name": "fake H200", "cc": 90, "sms": 132, "max_threads_per_sm": 2048, "smem_optin": 227 * 1024}
ATTRIBUTES = {device.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: 228 * 1024,
              device.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 227 * 1024,
              device.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: 1}
CTX = {d: 0xC0 + d for d in range(64)}          # each device's primary context
DriverCall = namedtuple("DriverCall", "fn grid block smem stream ctx")


class D(FakeDeviceArray):
    """A fake device array with what the runtime uses of an array it allocated: its pointer, a view
    as another dtype (the fake-quant mask), ``fill`` and item assignment (which write nothing)."""

    def __init__(self, shape, dtype="float32", strides=None, ptr=0x7F0000000000):
        super().__init__(shape, dtype, strides, ptr)
        self.ptr = ptr

    def view(self, dtype):
        return D(self.shape, np.dtype(dtype), ptr=self.ptr)

    def fill(self, value):
        pass

    def __setitem__(self, index, value):
        pass


class FakeFunction(str):
    """A loaded kernel of the fake device: its entry-point symbol (what launches record and tests
    compare), with an address and the device it was loaded on."""

    _next = [0x5000]

    def __new__(cls, symbol: str, dev: int):
        fn = super().__new__(cls, symbol)
        fn.device, fn.ptr = dev, FakeFunction._next[0]
        FakeFunction._next[0] += 16
        return fn


def fake_tensor_map(ptr, spec):
    """128 bytes that name the address and the layout (cuTensorMapEncodeTiled needs a driver)."""
    return hashlib.sha512(repr((ptr, spec)).encode()).digest()[:64] * 2


_TMA_KIND = {v: k for k, v in tma.DATA_TYPE.items()}


class FakeDevice(device.Driver):
    """Devices 0, 1, ... of a fake driver: the runtime's own launch machinery (bound launches, the
    context of each launch, cooperative launches, memsets) over driver calls that are recorded.

    - ``props``: per device, what differs from :data:`H200` (``{0: {"cc": 80}}``); ``attributes``:
      cuDeviceGetAttribute's answers; ``resident``: blocks per SM of any kernel; ``coop(fn, threads,
      device, want)``: the cooperative launch's (blocks, shared memory).
    - loaded kernels are :class:`FakeFunction` (their symbol), one per (symbol, device), in the
      device's primary context ``CTX[d]``; ``functions``: address -> kernel.
    - ``launches``: every launch, as ``(kernel, grid, block, fmt, values)`` (``values`` as given,
      after checking that they pack), and ``("memset", ptr, value, count)``; ``log``: every driver
      call made, a :data:`DriverCall` (kernel or address, grid, block, shared memory, stream, current
      context); ``refuse``: a CUresult every launch returns instead (None: they succeed).
    - contexts: a stack per thread, cuda:0's primary context current in each new thread;
      ``pushes``, ``asked``: how often a context was pushed / the current one read.
    - memory: arrays (:class:`D`) at addresses from one counter (``at(base)``, ``a(shape)`` for an
      input, ``new(shape, kind)`` for an allocation, logged in ``allocs`` (shape, kind) and
      ``alloc_ranges`` (first byte, end byte)); ``work``: the kept work
      memory of graph replays, (bytes, stream); ``device_of(ptr)``: which device an address is on
      (cuda:0 for every one by default); ``streams``: each device's current stream (7 by default).
    - ``graphs``: the graph calls (runtime/graphs.py) or None (replays go launch by launch);
      ``maps``: every tensor map encoded -> (address, MapSpec); ``fills``: foreign arrays filled;
      ``synced``: devices synchronized.
    """

    def __init__(self, props=None, *, attributes=None, resident=4, coop=None, device_of=None, streams=None,
                 graphs=None, check_alignment=True):
        super().__init__()
        self.props = dict(props or {})
        self.attributes = dict(ATTRIBUTES if attributes is None else attributes)
        self.resident = resident
        self.coop = coop or (lambda fn, threads, dev, want: (264, 112 * 1024))
        self.device_of = device_of or (lambda ptr: 0)
        self.streams = dict(streams or {})
        self.graphs = graphs
        self.check_alignment = check_alignment
        self.functions: dict = {}
        self.launches, self.log, self.refuse = [], [], None
        self.pushes = self.asked = 0
        self.next = 0x7E8000000000      # allocations never at address 0 (a null pointer is an error)
        self.allocs, self.alloc_ranges, self.work, self.maps, self.fills, self.synced = [], [], [], {}, [], []
        self.hits = 0                   # replays that ran (tests/fakes.py count_replays)
        self._threads = threading.local()
        self._loaded: dict = {}

    # -- device queries ------------------------------------------------------------------------
    def current_device(self) -> int:
        return 0

    def properties(self, dev: int) -> dict:
        return {**H200, **self.props.get(dev, {})}

    def attribute(self, dev: int, attribute: int) -> int:
        return self.attributes.get(attribute, 0)

    def load_function(self, registry, unit, symbol, dev=None):
        dev = self.current_device() if dev is None else dev
        fn = self._loaded.get((symbol, dev))
        if fn is None:
            fn = self._loaded[(symbol, dev)] = FakeFunction(symbol, dev)
            self.functions[fn.ptr] = fn
            self.note_context(fn.ptr, CTX[dev])
        return fn

    def resident_blocks(self, fn, threads, smem=0) -> int:
        return self.resident

    def cooperative_shape(self, fn, threads, dev, want_smem) -> tuple:
        return self.coop(fn, threads, dev, want_smem)

    # -- contexts ------------------------------------------------------------------------------
    def stack(self) -> list:
        """This thread's context stack (its last entry is current)."""
        s = getattr(self._threads, "stack", None)
        if s is None:
            s = self._threads.stack = [CTX[0]]      # cuda:0 current, as after cudaSetDevice(0)
        return s

    def set_current(self, ctx: int) -> None:
        self.stack()[:] = [ctx] if ctx else []

    def context_current(self) -> int:
        self.asked += 1
        s = self.stack()
        return s[-1] if s else 0

    def context_push(self, ctx: int) -> int:
        self.pushes += 1
        self.stack().append(ctx)
        return 0

    def context_pop(self) -> int:
        self.stack().pop()
        return 0

    # -- launches ------------------------------------------------------------------------------
    def _call(self, f, grid, block, smem, stream) -> int:
        """A launch of the kernel at address ``f``: refused (as the driver does) where its context is
        not the current one; else logged."""
        fn = self.functions.get(f)
        s = self.stack()
        current = s[-1] if s else 0
        if self.refuse is not None:
            return self.refuse
        if fn is not None and current != CTX[fn.device]:
            return 400 if current else 201          # CUDA_ERROR_INVALID_HANDLE / _INVALID_CONTEXT
        self.log.append(DriverCall(f if fn is None else fn, grid, block, smem, stream or 0, current))
        return 0

    def launch_kernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params) -> int:
        return self._call(f, (gx, gy, gz), (bx, by, bz), smem, stream)

    def cooperative_kernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params) -> int:
        return self._call(f, (gx, gy, gz), (bx, by, bz), smem, stream)

    def memset_d32(self, ptr, value, count, stream) -> int:
        s = self.stack()
        self.log.append(DriverCall("memset", None, None, 0, stream or 0, s[-1] if s else 0))
        self.launches.append(("memset", ptr, value, count))
        return 0

    def _recorded(self, fn, grid, block, fmt, values) -> tuple:
        values = tuple(values)
        if self.check_alignment and isinstance(fn, FakeFunction):
            assert_aligned(fn, values)
        return fn, tuple(grid), tuple(block), fmt, values

    def bind_launch(self, fn, grid, block, fmt, shared_mem=0):
        go = super().bind_launch(fn, grid, block, fmt, shared_mem)

        def recorded(stream, values):
            record = self._recorded(fn, grid, block, fmt, values)
            go(stream, values)
            self.launches.append(record)
        return recorded

    def launch_cooperative(self, fn, grid, block, fmt, values, stream, shared_mem):
        record = self._recorded(fn, (grid,), (block,), fmt, values)
        super().launch_cooperative(fn, grid, block, fmt, values, stream, shared_mem)
        self.launches.append(record)

    def graph_calls(self):
        return self.graphs

    def encode_tiled(self, args) -> tuple:
        ptr = args[2]
        spec = tma.MapSpec(_TMA_KIND[args[0]], tuple(args[3]), tuple(args[4]), tuple(args[5]))
        m = fake_tensor_map(ptr, spec)
        self.maps[m] = (ptr, spec)
        return 0, m

    # -- memory, streams, pointers ---------------------------------------------------------------
    def at(self, base: int):
        """Addresses from ``base`` on (for inputs and allocations alike)."""
        self.next = base
        return self

    def ptr(self, nbytes=0, offset=0) -> int:
        p = self.next + offset
        self.next += max(256, -(-nbytes // 256) * 256) + 256
        return p

    def a(self, shape, dtype="float32", offset=0, strides=None) -> D:
        """A new input array (``offset`` bytes past a 256-byte boundary)."""
        n = math.prod(shape) * np.dtype(dtype).itemsize
        return D(shape, dtype, strides, ptr=self.ptr(n, offset))

    def new(self, shape, kind, strides=None) -> D:
        """An allocation of the runtime (bf16 described as float16: a dtype the interface can name);
        ``strides`` in elements (None: C order)."""
        dt = np.dtype("bool" if kind == "bool" else (kinds.kind(kind).numpy if kind != "bf16" else "float16"))
        span = math.prod(shape) if strides is None else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        a = D(shape, dt, strides, ptr=self.ptr(span * dt.itemsize))
        self.allocs.append((tuple(shape), kind) if strides is None else (tuple(shape), kind, tuple(strides)))
        self.alloc_ranges.append((a.ptr, a.ptr + max(1, span) * dt.itemsize))
        return a

    @staticmethod
    def _kind(dtype) -> str:
        return "bool" if np.dtype(dtype) == np.bool_ else kinds.of(dtype)

    def new_array(self, dev, shape, dtype, strides=None) -> tuple:
        a = self.new(shape, self._kind(dtype), strides)
        return a, a.ptr

    def array_maker(self, dev, shape, dtype, strides=None):
        kind = self._kind(dtype)

        def make():
            a = self.new(shape, kind, strides)
            return a, a.ptr
        return make

    def work_memory(self, dev, nbytes):
        def alloc(stream):
            self.work.append((nbytes, stream))
            a = self.new((nbytes,), "u8")
            return a, a.ptr
        return alloc

    def fill_foreign(self, obj, value) -> None:
        self.fills.append((obj, value))

    def mapped_words(self, count) -> tuple:
        words = (ctypes.c_uint32 * count)()
        return words, ctypes.addressof(words)

    def synchronize(self, dev) -> None:
        self.synced.append(dev)

    def stream(self, dev) -> int:
        return self.streams.get(dev, 7)

    def stream_getter(self, dev):
        return lambda: self.stream(dev)

    def device_of_pointer(self, ptr) -> int:
        return self.device_of(ptr)

    def describe(self, obj) -> tuple:
        """The replay signature of an array of this device (a :class:`D`; as a CuPy array's: type,
        shape, strides, dtype, device, alignment) and its pointer; another object, or a :class:`D`
        with elements at a null pointer (which no framework's array is), is foreign: no replay."""
        cai = getattr(obj, "__cuda_array_interface__", None)
        if not isinstance(obj, D) or not isinstance(cai, dict):
            return None, None
        p = cai["data"][0]
        if not p and math.prod(cai["shape"]):
            return None, None
        return (type(obj), cai["shape"], cai["strides"], cai["typestr"], self.device_of(p), p & 15), p
