"""Device-side value checks: how a kernel reports an invalid value it read, without a host sync.

Values held in device arrays (scales, zero points, e8m0 scale codes, MoE offsets) are checked by
the kernels as they load them. An invalid one poisons the outputs that depend on it
(docs/errors.md: NaN for floating outputs, ``qmin`` for integer codes) and the kernel writes a
code to its device's **status word**: 32 bits of mapped, pinned host memory, which the host reads
like any other memory, without synchronizing. Every op reads the word of its device before it
launches (a few tens of nanoseconds) and raises :class:`DeviceValueError` naming the op and the
argument that an earlier call found invalid; :func:`check` is the explicit check point.

A code is ``1 + OPS.index(op) * 16 + ARGS.index(arg)``: the generator renders each kernel's codes
from these tables (``codegen/render.py``), the runtime decodes them here.
"""
from __future__ import annotations

import threading

from .device import check_device, driver
from .errors import InvalidProblemError, UnsupportedError

OPS = ("quantize", "dequantize", "quantize_backward", "dequantize_backward", "fake_quantize",
       "fake_quantize_backward", "fake_quantize_learnable_backward", "dynamic_quantize",
       "grouped_matmul", "grouped_matmul_backward_input", "grouped_matmul_backward_weight",
       "fake_quantize_backward_from_mask")     # new ops at the end: the codes of the others stay
ARGS = ("scale", "zero_point", "offsets")
WHAT = {
    "scale": "a scale that is not positive and finite (an e8m0 code of 255 is NaN)",
    "zero_point": "a zero point outside [qmin, qmax]",
    "offsets": "offsets that do not rise from 0 to M without decreasing",
}
MAX_DEVICES = 64


class DeviceValueError(InvalidProblemError):
    """A kernel found an invalid value in a device array of an earlier call (its outputs were
    poisoned: docs/errors.md); raised by the next call on that device or by :func:`check`."""

    def __init__(self, device: int, code: int):
        self.device, self.code = device, code
        self.op, self.arg = decode(code)
        super().__init__(f"{self.op}: {self.arg} held {WHAT.get(self.arg, 'an invalid value')}; a kernel of an "
                         f"earlier {self.op} call on cuda:{device} found it and poisoned its outputs "
                         "(NaN, or qmin for integer codes; docs/errors.md)")


def code(op: str, arg: str) -> int:
    """The status code a kernel of ``op`` writes for an invalid ``arg``."""
    return 1 + OPS.index(op) * 16 + ARGS.index(arg)


def decode(value: int) -> tuple:
    i = value - 1
    op = OPS[i // 16] if 0 <= i // 16 < len(OPS) else f"op#{i // 16}"
    arg = ARGS[i % 16] if i % 16 < len(ARGS) else f"argument#{i % 16}"
    return op, arg


class Words:
    """One driver's status words (runtime.device.Driver.keep: a fake device has its own): ``words``, a
    ctypes array over mapped host memory with one word per device (None until a launch needs one);
    ``base``, its device address (with unified addressing, also its host address); ``used``, the
    devices whose word a launch was given (what :func:`check` visits)."""

    __slots__ = ("words", "base", "used", "lock")

    def __init__(self):
        self.words, self.base, self.used, self.lock = None, 0, set(), threading.Lock()


def words() -> Words:
    """The current driver's status words."""
    return driver().keep("status", Words)


def _alloc(w: Words) -> None:
    with w.lock:
        if w.words is None:
            arr, w.base = driver().mapped_words(MAX_DEVICES)
            w.words = arr


def pointer(dev: int) -> int:
    """The device address of ``dev``'s status word (the ``status`` kernel parameter)."""
    if not 0 <= dev < MAX_DEVICES:
        raise UnsupportedError(f"cuda:{dev}: skuforge keeps status words for devices 0 to {MAX_DEVICES - 1} "
                               "of a process (CUDA_VISIBLE_DEVICES selects which)")
    w = words()
    if w.words is None:
        _alloc(w)
    w.used.add(dev)
    return w.base + 4 * dev


def is_status_pointer(p: int) -> bool:
    """Whether ``p`` is the address of a status word (a constant launch parameter)."""
    w = words()
    return w.words is not None and w.base <= p < w.base + 4 * MAX_DEVICES


def raise_pending(dev: int) -> None:
    """Raise (once) what a kernel reported on ``dev``; no synchronization. Every op calls this
    before it launches."""
    w = words().words
    if w is not None:
        value = w[dev] if dev < MAX_DEVICES else 0     # (pointer() refuses such a device)
        if value:
            w[dev] = 0
            raise DeviceValueError(dev, value)


def check(device=None, synchronize: bool = True) -> None:
    """The explicit check point: wait for the device's work (``synchronize``), then raise what its
    kernels reported. ``device=None``: every device this process has launched checking kernels on
    (no other device is touched: synchronizing one would create its context)."""
    devices = None if device is None else (check_device(device),)
    w = words()
    if w.words is None:
        return
    for d in (sorted(w.used) if devices is None else devices):
        if synchronize:
            driver().synchronize(d)
        raise_pending(d)
