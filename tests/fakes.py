"""A device-array stand-in for CPU tests: a ``__cuda_array_interface__`` that is never read.

Validation happens before any launch or allocation, so errors can be tested on a machine
without a GPU by describing arrays that do not exist.
"""
import numpy as np


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


def launcher_of(launch):
    """A ``runtime.device.bind_launch`` stand-in over a recording ``launch(fn, grid, block, fmt, values,
    stream, shared_mem)`` (what the repeated-call tests compare)."""
    def bind_launch(fn, grid, block, fmt, shared_mem=0):
        return lambda stream, values: launch(fn, grid, block, fmt, list(values), stream, shared_mem)
    return bind_launch


def count_replays(monkeypatch, on_replay):
    """``on_replay(hit)`` after every replay of a call remembered from now on (runtime/replay.py;
    ``hit``: it ran, rather than handing the call to the slow path). Clear ``replay.CACHE`` after."""
    from runtime import replay
    real = replay._compile

    def compile_counted(e, nargs, result):
        go = real(e, nargs, result)

        def counted(args, vals, static):
            r = go(args, vals, static)
            on_replay(r is not replay.MISS)
            return r
        return counted
    monkeypatch.setattr(replay, "_compile", compile_counted)
