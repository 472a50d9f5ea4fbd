"""Array interop: CuPy arrays, PyTorch CUDA tensors and ``__cuda_array_interface__`` objects.

An :class:`ArrayRef` is a zero-copy description of a device array (pointer, shape, strides
in elements, kind, device, framework). Outputs are allocated by the caller's framework, so
results come back as the caller's type on the caller's device, and kernels are launched on
the caller's current stream (PyTorch's for tensors).
"""
from __future__ import annotations

import contextlib
import math
import sys
import threading
from dataclasses import dataclass

import numpy as np

from . import device, kinds
from .device import cupy_stream, raise_no_device  # noqa: F401  (cupy_stream: tools and the harness take it from here)
from .errors import DeviceRequiredError, InvalidProblemError

# Normalise a dtype spelling (``"int8"``, ``"s8"``, ``numpy.int8``, ``torch.int8``) to a kind.
kind_of = kinds.of


@dataclass
class ArrayRef:
    obj: object
    ptr: int
    shape: tuple
    strides: tuple      # in elements
    kind: str
    device: int
    framework: str      # "cupy" | "torch" | "cai"
    readonly: bool = False   # an __cuda_array_interface__ that says so: never an output

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return kinds.SIZE[self.kind]


def _torch():
    return sys.modules.get("torch")


def as_array(obj, arg: str) -> ArrayRef:
    """Describe a device array without copying it; typed errors for anything else."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        if not obj.is_cuda:
            raise InvalidProblemError(f"{arg} is a torch tensor on {obj.device}; skuforge runs on CUDA tensors "
                                      f"(move it with {arg}.cuda())")
        return _checked(ArrayRef(obj, obj.data_ptr(), tuple(obj.shape), obj.stride(), kind_of(obj.dtype, arg),
                                 obj.get_device(), "torch"), arg)
    cp = sys.modules.get("cupy")
    if cp is not None and isinstance(obj, cp.ndarray):
        item = obj.itemsize
        kind = kind_of(obj.dtype, arg)
        return _checked(ArrayRef(obj, obj.data.ptr, obj.shape, tuple(s // item for s in obj.strides), kind,
                                 obj.data.device_id, "cupy"), arg)
    if isinstance(obj, np.ndarray):
        raise InvalidProblemError(f"{arg} is a host array (numpy.ndarray); skuforge runs on CUDA arrays: "
                                  f"pass cupy.asarray({arg}) or a CUDA torch tensor")
    if isinstance(obj, (int, float, bool, np.generic)):
        raise InvalidProblemError(f"{arg} is a scalar ({obj!r}) where an array is needed")
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _checked(_from_cai(obj, cai, arg), arg)
    if hasattr(obj, "__dlpack__"):
        return as_array(_from_dlpack(obj, arg), arg)
    if obj is None:
        raise InvalidProblemError(f"{arg} is None; an array is needed")
    raise InvalidProblemError(f"{arg} has type {type(obj).__name__}; expected a cupy.ndarray, a CUDA torch.Tensor "
                              "or an object with __cuda_array_interface__ / __dlpack__")


# DLPack device types (dlpack.h DLDeviceType) whose memory a CUDA kernel of the current process reads
_DLPACK_CUDA = {2: "kDLCUDA", 3: "kDLCUDAHost", 13: "kDLCUDAManaged"}
_DLPACK_NAMES = {1: "kDLCPU", 4: "kDLOpenCL", 7: "kDLVulkan", 8: "kDLMetal", 9: "kDLVPI", 10: "kDLROCM",
                 11: "kDLROCMHost", 12: "kDLExtDev", 14: "kDLOneAPI", 15: "kDLWebGPU", 16: "kDLHexagon"}


def _from_dlpack(obj, arg: str):
    """A zero-copy CuPy view of a ``__dlpack__`` object (described as CuPy after: results come back
    as CuPy arrays). Its ``__dlpack_device__`` must name CUDA memory; anything CuPy cannot import is
    an InvalidProblemError naming ``arg``, a missing driver a DeviceRequiredError."""
    where = getattr(obj, "__dlpack_device__", None)
    if where is not None:
        dev = where()
        if not (isinstance(dev, tuple) and len(dev) == 2 and all(isinstance(v, (int, np.integer)) for v in dev)):
            raise InvalidProblemError(f"{arg}: __dlpack_device__() returned {dev!r}; a (device type, device id) "
                                      "pair of integers is required")
        if int(dev[0]) not in _DLPACK_CUDA:
            name = _DLPACK_NAMES.get(int(dev[0]), f"device type {int(dev[0])}")
            what = "a CPU array" if int(dev[0]) == 1 else f"an array in {name} memory"
            raise InvalidProblemError(f"{arg}: a CUDA device array is required; got {what} ({type(obj).__name__} "
                                      f"whose __dlpack_device__ is {name}): move it to the GPU first (e.g. "
                                      "cupy.asarray, or .cuda() / .to('cuda'))")
    try:
        import cupy as cp
    except ImportError as e:
        raise DeviceRequiredError(f"{arg}: a __dlpack__ object is imported through CuPy: pip install "
                                  "cupy-cuda13x") from e
    try:
        return cp.from_dlpack(obj)
    except (TypeError, ValueError, BufferError, RuntimeError, AttributeError) as e:
        raise_no_device(e)
        raise InvalidProblemError(f"{arg}: a CUDA device array is required; {type(obj).__name__} could not be "
                                  f"imported through DLPack as one ({type(e).__name__}: {e})") from e


MAX_EXTENT = 1 << 62          # extents and strides the kernels' 64-bit index arithmetic takes


def _ints(value, arg: str, what: str, lo: int) -> tuple:
    """A tuple of Python ints, each >= lo and < MAX_EXTENT in magnitude, else a typed error."""
    if not isinstance(value, (tuple, list)):
        raise InvalidProblemError(f"{arg}: __cuda_array_interface__ {what} is {value!r}; a tuple of integers is "
                                  "required")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= int(v) < MAX_EXTENT \
                or int(v) <= -MAX_EXTENT:
            raise InvalidProblemError(f"{arg}: __cuda_array_interface__ {what} {tuple(value)!r} holds {v!r}; "
                                      f"integers in [{lo}, 2**62) are supported")
        out.append(int(v))
    return tuple(out)


def _from_cai(obj, cai: dict, arg: str) -> ArrayRef:
    """Describe a ``__cuda_array_interface__`` object directly (no CuPy round trip); every field
    is validated (required keys, integer extents and strides, an integer data pointer)."""
    if not isinstance(cai, dict) or any(k not in cai for k in ("shape", "typestr", "data")):
        raise InvalidProblemError(f"{arg}: __cuda_array_interface__ must be a dict with 'shape', 'typestr' and "
                                  f"'data'; got {cai!r:.200}")
    try:
        if not isinstance(cai["typestr"], str):
            raise TypeError                  # np.dtype(None) is float64
        dt = np.dtype(cai["typestr"])
    except (TypeError, ValueError):
        raise InvalidProblemError(f"{arg}: typestr {cai.get('typestr')!r} is not a dtype skuforge knows") from None
    if not dt.isnative:
        raise InvalidProblemError(f"{arg}: typestr {cai['typestr']!r} is not in the device's (little-endian) byte "
                                  "order")
    if cai.get("mask") is not None:
        raise InvalidProblemError(f"{arg}: __cuda_array_interface__ has a mask; masked arrays are not supported "
                                  "(pass the data without one)")
    kind = kind_of(dt, arg)
    shape = _ints(cai["shape"], arg, "shape", 0)
    data = cai["data"]
    if not isinstance(data, (tuple, list)) or not data or isinstance(data[0], bool) \
            or not isinstance(data[0], (int, np.integer, type(None))) or not 0 <= int(data[0] or 0) < 1 << 64:
        raise InvalidProblemError(f"{arg}: __cuda_array_interface__ data is {data!r}; (pointer, read_only) with an "
                                  "integer pointer is required")
    if cai.get("strides") is not None and len(_ints(cai["strides"], arg, "strides", -MAX_EXTENT)) != len(shape):
        raise InvalidProblemError(f"{arg}: __cuda_array_interface__ strides {tuple(cai['strides'])!r} do not match "
                                  f"its shape {shape} (one stride per axis)")
    if cai.get("strides") is None:
        strides = contiguous_strides(shape)
    else:
        item = dt.itemsize
        if any(s % item for s in cai["strides"]):
            raise InvalidProblemError(f"{arg} has strides {cai['strides']} (bytes) that are not multiples "
                                      f"of its item size {item}")
        strides = tuple(s // item for s in cai["strides"])
    ptr = int(data[0] or 0)
    return ArrayRef(obj, ptr, shape, strides, kind, device.driver().device_of_pointer(ptr), "cai",
                    readonly=len(data) > 1 and bool(data[1]))


def writable(ref: ArrayRef, arg: str) -> ArrayRef:
    """``ref`` as an output: an interface that declares its memory read-only is a typed error."""
    if ref.readonly:
        raise InvalidProblemError(f"{arg} is read-only (its __cuda_array_interface__ data flag); an output must be "
                                  "writable")
    return ref


def _checked(ref: ArrayRef, arg: str) -> ArrayRef:
    """Pointer and extent checks every array gets before it reaches a kernel: a non-empty array
    needs a non-null data pointer aligned to its element size (a misaligned or illegal address
    would be a sticky error that poisons the CUDA context), and extents the kernels can index."""
    size = 1
    for n in ref.shape:
        size *= n
    if size:
        if not ref.ptr:
            raise InvalidProblemError(f"{arg} has {size} elements but a null data pointer")
        item = ref.itemsize
        if ref.ptr % item:
            raise InvalidProblemError(f"{arg}: data pointer {ref.ptr:#x} is not aligned to its element size "
                                      f"({item} bytes for {ref.kind}); pass an aligned view (e.g. .contiguous())")
        if size >= MAX_EXTENT or any(abs(s) * max(n - 1, 0) >= MAX_EXTENT for n, s in zip(ref.shape, ref.strides)):
            raise InvalidProblemError(f"{arg} has shape {tuple(ref.shape)} and strides {tuple(ref.strides)}: beyond "
                                      "the 2**62 elements the kernels index")
    return ref


def overlap(spans, vals):
    """The first pair ``(i, j)`` of arguments named in ``spans`` that share bytes, or None.
    ``spans``: (index, first byte, end byte) relative to the pointers ``vals[index]`` (for a
    replay, fixed by the cache key's shapes and strides; see :func:`byte_span`)."""
    for k, (i, lo_i, hi_i) in enumerate(spans):
        a = vals[i]
        for j, lo_j, hi_j in spans[k + 1:]:
            b = vals[j]
            if a + lo_i < b + hi_j and b + lo_j < a + hi_i:
                return i, j
    return None


def byte_span(ref: ArrayRef) -> tuple:
    """(first, end) byte offsets of an array's elements relative to its pointer (strides may be
    negative); (0, 0) when it is empty."""
    if ref.size == 0:
        return 0, 0
    lo = sum((n - 1) * st for n, st in zip(ref.shape, ref.strides) if st < 0)
    hi = sum((n - 1) * st for n, st in zip(ref.shape, ref.strides) if st > 0) + 1
    return lo * ref.itemsize, hi * ref.itemsize


def empty(like: ArrayRef, shape, kind: str, strides=None):
    """A new array in the framework and on the device of ``like`` (``kind="bool"``: a bool mask);
    ``strides`` (in elements, non-negative): that layout, in memory of its span, else C order.

    While a functional call records its allocations (:func:`recording_allocations`, the
    replay of repeated calls), each one is logged with what :func:`allocator` needs to repeat it."""
    strides = None if strides is None else tuple(strides)
    try:
        obj, p = _new(like, shape, kind, strides)
    except Exception as e:
        raise_no_device(e)
        raise
    log = getattr(_alloc_log, "log", None)
    if log is not None:
        log.append((obj, p, like, tuple(shape), kind, strides))
    return obj


def contiguous_strides(shape) -> tuple:
    """C-order strides, in elements, of ``shape``."""
    out, acc = [], 1
    for n in reversed(tuple(shape)):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


# torch.empty_strided with the C-order strides spelled out allocates the same tensor as torch.empty
# in about 1.2 µs less on the GPU machine's CPU (tools/probe_host.py: 2.1 against 3.4 µs).
def _new(like: ArrayRef, shape, kind: str, strides=None) -> tuple:
    """(a new array, its data pointer): PyTorch's for a tensor, else CuPy's (the driver's)."""
    if like.framework == "torch":
        torch = _torch()
        t = torch.empty_strided(shape, strides or contiguous_strides(shape), dtype=torch_dtype(kind),
                                device=like.obj.device)
        return t, t.data_ptr()
    return device.driver().new_array(like.device, shape, numpy_dtype(kind), strides)


_alloc_log = threading.local()


class recording_allocations:
    """``with recording_allocations() as log:`` collects ``(obj, ptr, like, shape, kind, strides)`` for every
    :func:`empty` of this thread inside the block (a nested block collects its own)."""

    __slots__ = ("log", "prev")

    def __enter__(self) -> list:
        self.prev = getattr(_alloc_log, "log", None)
        self.log = _alloc_log.log = []
        return self.log

    def __exit__(self, *exc):
        _alloc_log.log = self.prev
        return False


def allocator(like: ArrayRef, shape, kind: str, strides=None):
    """A zero-argument callable returning ``(obj, data pointer)`` of a new array, exactly as
    ``empty(like, shape, kind, strides)`` would allocate it, with the dtype and device resolved once."""
    shape = tuple(shape)
    if like.framework == "torch":
        torch = _torch()
        new, dt, dev = torch.empty_strided, torch_dtype(kind), like.obj.device
        strides = strides or contiguous_strides(shape)

        def alloc():
            try:
                a = new(shape, strides, dtype=dt, device=dev)
            except Exception as e:
                raise_no_device(e)
                raise
            return a, a.data_ptr()
        return alloc
    return device.driver().array_maker(like.device, shape, numpy_dtype(kind), strides)


def span_elements(shape, strides=None) -> int:
    """Elements of memory an array of ``shape`` and non-negative ``strides`` (None: C order) spans."""
    if strides is None or not all(shape):
        return math.prod(shape)
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def work_allocator(like: ArrayRef, shape, kind: str, strides=None):
    """A callable ``alloc(stream)`` returning ``(obj, data pointer)`` of device memory the size of
    ``empty(like, shape, kind)``, for a work array a graph replay keeps as long as its executable
    graph (runtime/replay.py). It comes from CuPy's memory pool of the array's device, in the
    arena of ``stream`` (the driver's ``work_memory``), never from the framework's allocator: PyTorch
    may hand that allocator's blocks to a private pool it checks (``torch.compile(mode="reduce-overhead")``
    warms up a CUDA graph with every allocation redirected to the graph's pool and then requires
    each live block there to be one of the outputs), and a block kept past the call would fail that
    check. Freed with the graph's state, the memory goes back to ``stream``'s arena, so its next use
    is ordered behind the graph's last launch."""
    return device.driver().work_memory(like.device, max(1, numpy_dtype(kind).itemsize * span_elements(shape, strides)))


def device_of(obj):
    """``with device_of(a):`` makes a CuPy array's device current for CuPy's own kernels (fill,
    assignment), which run on the current device; a no-op for other arrays (PyTorch picks the
    tensor's device itself)."""
    cp = sys.modules.get("cupy")
    dev = getattr(obj, "device", None)
    if cp is not None and isinstance(dev, cp.cuda.Device):
        return dev
    return contextlib.nullcontext()


def stream_getter(ref: ArrayRef):
    """A zero-argument callable returning what ``stream_handle(ref)`` returns at the time of the call."""
    dev = ref.device
    if ref.framework == "torch":
        get = _torch()._C._cuda_getCurrentRawStream
        return lambda: get(dev)
    return device.driver().stream_getter(dev)


def numpy_dtype(kind: str):
    dt = _NUMPY_DTYPES.get(kind)
    if dt is None:
        dt = _NUMPY_DTYPES[kind] = _numpy_dtype(kind)
    return dt


_NUMPY_DTYPES: dict = {"bool": np.dtype(np.bool_)}


def _numpy_dtype(kind: str):
    name = kinds.BY_NAME[kind].numpy if kind in kinds.BY_NAME else None
    if name is None:
        raise InvalidProblemError(f"dtype {kind!r} has no NumPy equivalent")
    if name in ("bfloat16",) or name.startswith("float8"):
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def torch_dtype(kind: str):
    return getattr(_torch(), "bool" if kind == "bool" else kinds.BY_NAME[kind].torch)


def stream_handle(ref: ArrayRef) -> int:
    """The caller's current stream (raw ``cudaStream_t``) for this array's framework."""
    if ref.framework == "torch":
        return _torch()._C._cuda_getCurrentRawStream(ref.device)
    return device.driver().stream(ref.device)
