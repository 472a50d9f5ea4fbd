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
    stream, shared_mem)`` (what the repeated-call tests compare); every launch is checked by
    :func:`assert_aligned` first."""
    launch = aligned(launch)

    def bind_launch(fn, grid, block, fmt, shared_mem=0):
        return lambda stream, values: launch(fn, grid, block, fmt, list(values), stream, shared_mem)
    return bind_launch


def aligned(launch):
    """``launch(fn, grid, block, fmt, values, ...)`` (a recording stand-in of a driver launch), after
    :func:`assert_aligned` on its kernel and parameters."""
    def checked(fn, grid, block, fmt, values, *rest):
        assert_aligned(fn, values)
        return launch(fn, grid, block, fmt, values, *rest)
    return checked


def assert_aligned(fn, values):
    """Every pointer parameter the kernel ``fn`` (an entry-point symbol: what the fakes load) moves in
    words wider than an element is aligned as that access needs, row strides included, as
    runtime/vectors.py declares the kernels' accesses (what a misaligned launch would fault on)."""
    import runtime as sf
    from runtime import vectors
    reg = sf.default_registry()
    entry, group = entry_points(reg).get(fn, (None, None))
    assert entry is not None, f"a launch of {fn!r}, which is no entry point of the manifest"
    abi = reg.abi(entry.launch["abi"][group])
    assert len(values) == len(abi.names), f"{fn}: {len(values)} values for {abi}"
    bad = vectors.problems(vectors.accesses(entry.sku, entry.launch, group), dict(zip(abi.names, values)))
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
