"""GPU half of the fuzz: hypothesis draws calls (tests/fuzz_cases.py) and runs them on real CuPy / torch
arrays of small shapes. Every call returns the NumPy reference's result (bit for bit for the
quantization ops, the tolerance of docs/numerics.md for grouped matmul) or raises a typed error; a call with bad
values in a device array reports a DeviceValueError at ``sf.check()``; a valid call repeated on new
arrays of the same layouts (a replay) returns the reference again. After the run the CUDA context
still works. At least 2,000 calls (``test_gpu_fuzz_made_enough_calls`` prints the counts). Then valid calls
with one array moved off its alignment (``test_gpu_fuzz_misaligned_*``): at least 5,000 calls, each
returning the reference's result or refused with a typed error about alignment, the context healthy after.

    python -m codegen compile --arch sm_90 --fill-cache      # once per machine: no NVRTC in the timing
    python -m pytest -q -s tests/core/test_gpu_fuzz.py

The arrays of one call live in one device buffer (an arena) laid out as on the CPU (tests/core/test_fuzz.py
Space): an overlapping or adjacent out= stays inside memory the test owns, whatever the runtime
decides. ``test_gpu_fuzz_harness_on_the_cpu`` runs this file's arena, views, values and reference
comparison with NumPy arrays standing in for device arrays, so the harness is exercised without a GPU.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runtime as sf
from runtime import DeviceValueError, InvalidProblemError, UnsupportedError
from tests import fuzz_cases as fc
from tests.core.test_alignment import may_refuse, misaligned_problems
from tests.core.test_gpu_alignment import assert_context_healthy

ALLOWED = (UnsupportedError, InvalidProblemError)


def _has_torch() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def _env(torch_ok: bool) -> fc.Env:
    """What the GPU half draws: small shapes, no null pointers or huge extents (nothing to allocate
    them in), a quarter of the calls broken on purpose (the CPU half has the rest), and f16 / f32 (bf16
    and torch fp8 containers with torch): the units ``codegen compile`` fills the cache with."""
    half = ("float16", "bfloat16") if torch_ok else ("float16",)
    return fc.Env(floats=half + ("float32",), torch=torch_ok, null=False, huge=False, mutate=25,
                  moe_floats=half + ("float32",), bad_values=10)


EXAMPLES = {"quantize": 260, "dequantize": 200, "dynamic_quantize": 260, "quantize_backward": 115,
            "dequantize_backward": 90, "fake_quantize": 115, "fake_quantize_backward": 105,
            "fake_quantize_learnable_backward": 140, "grouped_matmul": 150, "grouped_matmul_backward": 150}
CALLS: Counter = Counter()
OUTCOMES: Counter = Counter()
DONE: set = set()


def _settings(n):
    return settings(max_examples=n, derandomize=True, database=None, deadline=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


# -- backends: where a problem's arrays live ----------------------------------------------------------
class Unmaterializable(Exception):
    """This backend cannot make the described array (e.g. torch and a byte offset that is not a
    multiple of the element size, or negative strides): the problem is skipped."""


class NumpyBackend:
    """Host arrays standing in for device arrays (the CPU rehearsal of the harness)."""

    name = "numpy"

    def arena(self, nbytes):
        buf = np.zeros(nbytes, np.uint8)
        return buf, buf.ctypes.data

    def view(self, arena, byte_off, a: fc.Arr):
        dt = fc._np_dtype(a.dtype)
        if a.size == 0:
            return np.zeros(a.shape, dt)
        return np.ndarray(a.shape, dt, buffer=arena, offset=byte_off, strides=[s * dt.itemsize for s in a.strides()])

    def write(self, view, values):
        view[...] = values

    def host(self, obj):
        return np.array(obj, copy=True)


class CupyBackend:
    name = "cupy"

    def __init__(self):
        import cupy as cp
        self.cp = cp

    def arena(self, nbytes):
        buf = self.cp.zeros(nbytes, self.cp.uint8)
        self._arena = buf
        return buf, buf.data.ptr

    def view(self, arena, byte_off, a: fc.Arr):
        cp = self.cp
        dt = fc._np_dtype(a.dtype)
        if a.dtype in fc._TORCH_ONLY:
            raise Unmaterializable(a.dtype)
        mem = cp.cuda.MemoryPointer(arena.data.mem, arena.data.ptr - arena.data.mem.ptr + byte_off)
        return cp.ndarray(a.shape, dt, memptr=mem, strides=[s * dt.itemsize for s in a.strides()])

    def write(self, view, values):
        cp = self.cp
        if view.data.ptr % max(1, view.itemsize) == 0:
            view[...] = cp.asarray(values)
            return
        # A view misaligned for its dtype (an argument of a call that must be refused): a typed store
        # there would be a misaligned access in CuPy's own copy kernel, a sticky error that ends the
        # context, so its bytes are scattered into the arena one by one instead.
        values = np.ascontiguousarray(np.asarray(values, dtype=view.dtype)).reshape(-1)
        base = view.data.ptr - self._arena.data.ptr
        if view.ndim:
            idx = np.indices(view.shape).reshape(view.ndim, -1).astype(np.int64)
            starts = base + (np.asarray(view.strides, dtype=np.int64)[:, None] * idx).sum(0)
        else:
            starts = np.array([base], dtype=np.int64)
        pos = (starts[:, None] + np.arange(view.itemsize)).reshape(-1)
        self._arena[cp.asarray(pos)] = cp.asarray(values.view(np.uint8))

    def host(self, obj):
        return obj.get()


class TorchBackend:
    name = "torch"

    def __init__(self, device="cuda"):
        import torch
        self.torch = torch
        self.device = device                  # "cpu": the rehearsal of the views, writes and reads

    def arena(self, nbytes):
        buf = self.torch.zeros(-(-nbytes // 16) * 16, dtype=self.torch.uint8, device=self.device)
        return buf, buf.data_ptr()

    def view(self, arena, byte_off, a: fc.Arr):
        torch = self.torch
        item = a.itemsize
        st_ = a.strides()
        if byte_off % item or any(s < 0 for s in st_):
            raise Unmaterializable(f"torch: offset {byte_off} / strides {st_} of {a.dtype}")
        td = getattr(torch, a.dtype, None)
        if not isinstance(td, torch.dtype) or a.dtype.startswith(("datetime", "complex")):
            raise Unmaterializable(a.dtype)
        typed = arena.view(td)
        return torch.as_strided(typed, a.shape, st_, byte_off // item)

    def write(self, view, values):
        torch = self.torch
        if values.dtype.itemsize == 2 and values.dtype.kind not in "iuf":      # bf16
            t = torch.from_numpy(np.ascontiguousarray(values).view(np.int16)).view(torch.bfloat16)
        elif values.dtype.itemsize == 1 and values.dtype.kind not in "biu":    # fp8
            t = torch.from_numpy(np.ascontiguousarray(values).view(np.uint8)).view(view.dtype)
        else:
            t = torch.from_numpy(np.ascontiguousarray(values))
        view.copy_(t.to(view.device))

    def host(self, obj):
        torch = self.torch
        if obj.dtype == torch.bfloat16:
            import ml_dtypes
            return obj.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
        if obj.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return obj.view(torch.uint8).cpu().numpy()
        return obj.cpu().numpy()


def materialize(p: fc.Problem, host: dict, backend):
    """(args, kw, arena) of ``p`` on ``backend``: every array placed in one arena as tests/core/test_fuzz.py's
    Space places them (aliases relative to their target), inputs holding ``host``, outputs zeros."""
    arrs = p.arrays()
    place, nxt, margin = {}, 0, 0
    for a in sorted(arrs, key=lambda a: a.alias is not None):
        lo, hi = a.span()
        item = a.itemsize
        margin = max(margin, (hi - lo) * item + 64)
        if a.alias is not None and a.alias[0] in place:
            place[a.key] = place[a.alias[0]] + a.alias[1] + a.offset
        else:
            place[a.key] = nxt - lo * item + a.offset
            nxt += -(-((hi - lo) * item + a.offset + 64) // 256) * 256
    # room before the first array (aliases may reach back), a multiple of 256: every array keeps the
    # alignment its problem gave it
    shift = -(-(margin + 256) // 256) * 256
    arena, _ = backend.arena(nxt + 2 * shift)
    views = {}

    def make(a, made):
        off = place[a.key] + shift
        lo, hi = a.span()
        if off + lo * a.itemsize < 0 or off + hi * a.itemsize > nxt + 2 * shift:
            raise Unmaterializable(f"{a.key} outside the arena")
        try:
            views[a.key] = backend.view(arena, off, a)
        except Unmaterializable:
            raise
        except Exception as e:  # noqa: BLE001 - a dtype or layout the framework has no array for
            raise Unmaterializable(f"{backend.name}: {a!r}: {e}") from e
        return views[a.key]
    args, kw = p.build(make)
    # outputs first: an input that an out= aliases keeps its values
    for a in sorted(arrs, key=lambda a: a.fill[0] not in ("out", "workspace")):
        if a.key in host and a.size:
            try:
                backend.write(views[a.key], host[a.key])
            except Exception as e:  # noqa: BLE001 - e.g. values for a dtype the framework cannot hold
                raise Unmaterializable(f"{backend.name}: writing {a!r}: {e}") from e
    return args, kw, arena, views


def _to_host(backend, res):
    if isinstance(res, tuple):
        return tuple(None if r is None else backend.host(r) for r in res)
    return backend.host(res)


def _backend_for(p, backends, pick):
    torch_only = any(a.dtype in fc._TORCH_ONLY for a in p.arrays())
    if torch_only or ("torch" in backends and pick % 10 < 3):
        if "torch" not in backends:
            raise Unmaterializable("needs torch")
        return backends["torch"]
    return backends["cupy"]


def run_gpu_problem(p: fc.Problem, backend, seed: int, sync: bool = False):
    """One problem on the device: the call, the reference, a replay; returns the outcome."""
    host = fc.host_values(p, np.random.default_rng(seed))
    try:
        args, kw, arena, _ = materialize(p, host, backend)
    except Unmaterializable:
        return "skipped"
    CALLS[p.op] += 1
    try:
        with sf.sync_checks(sync):
            res = fc.call(sf, p, args, kw)
    except DeviceValueError as e:
        if not (sync and p.bad_values):
            raise AssertionError(f"a DeviceValueError from an earlier call leaked: {e}\n{p!r}") from e
        return "typed"
    except ALLOWED as e:
        if p.valid and not p.bad_values:
            assert isinstance(e, UnsupportedError), f"a valid call raised {type(e).__name__}: {e}\n{p!r}"
        return "typed"
    except Exception as e:  # noqa: BLE001 - the property
        raise AssertionError(f"untyped {type(e).__name__}: {e}\n{p!r}") from e
    if p.bad_values:
        try:
            sf.check()
        except DeviceValueError:
            return "reported"
        return "ok"
    try:
        sf.check()                                # nothing reported by a call without bad values
    except DeviceValueError as e:
        raise AssertionError(f"a call without bad values reported {e}\n{p!r}") from e
    if not p.valid:
        return "ok"
    want = fc.expected(p, host)
    fc.compare(p, _to_host(backend, res), want)
    # the same call on new arrays of the same layouts: a replay, the same bits
    args2, kw2, arena2, _ = materialize(p, host, backend)
    CALLS[p.op] += 1
    fc.compare(p, _to_host(backend, fc.call(sf, p, args2, kw2)), want)
    return "ok, equal to the reference"


def _backends():
    out = {"cupy": CupyBackend()}
    if _has_torch():
        out["torch"] = TorchBackend()
    return out


def _fuzz(op):
    @pytest.mark.gpu
    def test():
        backends = _backends()
        env = _env("torch" in backends)

        @_settings(EXAMPLES[op])
        @given(p=fc.problems(op, env), pick=st.integers(0, 99), seed=st.integers(0, 2 ** 32 - 1))
        def run(p, pick, seed):
            try:
                backend = _backend_for(p, backends, pick)
            except Unmaterializable:
                OUTCOMES[(op, "skipped")] += 1
                return
            sync = pick % 10 == 9 and p.bad_values
            OUTCOMES[(op, run_gpu_problem(p, backend, seed, sync))] += 1
        run()
        DONE.add(op)
    test.__name__ = f"test_gpu_fuzz_{op}"
    return test


for _op in EXAMPLES:
    globals()[f"test_gpu_fuzz_{_op}"] = _fuzz(_op)


@pytest.mark.gpu
def test_gpu_fuzz_made_enough_calls():
    """At least 2,000 calls, and the context still works: nothing pending, a CuPy kernel and a
    quantize call give the right answers."""
    import cupy as cp
    sf.check()
    a = cp.arange(1000, dtype=cp.float32)
    assert float((a * 2).sum()) == 999000.0
    x = np.linspace(-3, 3, 4096, dtype=np.float32).reshape(16, 256)
    q = sf.quantize(cp.asarray(x), 0.05, scope="tensor")
    np.testing.assert_array_equal(q.get(), sf.reference.quantize(x, np.float32(0.05), scope="tensor"))
    sf.check()
    if DONE != set(EXAMPLES):
        pytest.skip("counted only when every GPU fuzz test of this file runs")
    total = sum(CALLS.values())
    print(f"\ngpu fuzz calls: {total} ({', '.join(f'{op} {n}' for op, n in sorted(CALLS.items()))})")
    for (op, outcome), n in sorted(OUTCOMES.items()):
        print(f"  {op:34} {outcome:30} {n}")
    assert total >= 2000


# -- misaligned arrays -----------------------------------------------------------------------------------
# Valid calls with one array (an output or workspace two times in three) moved a whole number of elements
# off its 16-byte boundary (tests/core/test_alignment.py misaligned_problems): each returns the reference's
# result (quantization: the scalar path; MoE: simt, or the backend auto picks) or, where a tensor-core
# strategy was asked for or the MoE workspace moved, raises an InvalidProblemError about alignment before
# anything runs. A call that returns is made twice again on new arrays (replays). At least 5,000 calls;
# the context still works after.
MISALIGNED_EXAMPLES = {"quantize": 360, "dequantize": 290, "dynamic_quantize": 360, "quantize_backward": 170,
                       "fake_quantize": 170, "fake_quantize_learnable_backward": 190, "grouped_matmul": 430,
                       "grouped_matmul_backward": 430}
MISALIGNED_CALLS: Counter = Counter()
MISALIGNED_OUTCOMES: Counter = Counter()
MISALIGNED_DONE: set = set()


def run_misaligned(p: fc.Problem, key: str, backend, seed: int) -> str:
    host = fc.host_values(p, np.random.default_rng(seed))
    try:
        args, kw, _, _ = materialize(p, host, backend)
    except Unmaterializable:
        return "skipped"
    MISALIGNED_CALLS[p.op] += 1
    try:
        res = fc.call(sf, p, args, kw)
    except DeviceValueError as e:
        raise AssertionError(f"a valid call reported {e}\n{p!r}") from e
    except UnsupportedError:
        return "unsupported"
    except InvalidProblemError as e:
        assert may_refuse(p, key), f"refused: {e}\n{p!r}"
        assert "byte boundary" in str(e), f"{e}\n{p!r}"
        return "refused"
    except Exception as e:  # noqa: BLE001 - the property
        raise AssertionError(f"untyped {type(e).__name__}: {e}\n{p!r}") from e
    sf.check()
    want = fc.expected(p, host)
    fc.compare(p, _to_host(backend, res), want)
    for _ in range(2):                  # replays on new arrays of the same layouts and alignment
        args2, kw2, _, _ = materialize(p, host, backend)
        MISALIGNED_CALLS[p.op] += 1
        fc.compare(p, _to_host(backend, fc.call(sf, p, args2, kw2)), want)
    return "ran, equal to the reference"


def _misaligned_env(torch_ok: bool) -> fc.Env:
    return dataclasses.replace(_env(torch_ok), mutate=0, bad_values=0)


def _fuzz_misaligned(op):
    @pytest.mark.gpu
    def test():
        backends = _backends()
        env = _misaligned_env("torch" in backends)

        @_settings(MISALIGNED_EXAMPLES[op])
        @given(pk=misaligned_problems(op, env), pick=st.integers(0, 99), seed=st.integers(0, 2 ** 32 - 1))
        def run(pk, pick, seed):
            p, key = pk
            try:
                backend = _backend_for(p, backends, pick)
            except Unmaterializable:
                backend = None
            outcome = "skipped" if key is None or backend is None else run_misaligned(p, key, backend, seed)
            MISALIGNED_OUTCOMES[(op, outcome)] += 1
        run()
        MISALIGNED_DONE.add(op)
    test.__name__ = f"test_gpu_fuzz_misaligned_{op}"
    return test


for _op in MISALIGNED_EXAMPLES:
    globals()[f"test_gpu_fuzz_misaligned_{_op}"] = _fuzz_misaligned(_op)


@pytest.mark.gpu
def test_gpu_fuzz_misaligned_made_enough_calls():
    """At least 5,000 calls with misaligned arrays, some refused and most run, and the context still
    works (tests/core/test_gpu_alignment.py assert_context_healthy)."""
    assert_context_healthy()
    if MISALIGNED_DONE != set(MISALIGNED_EXAMPLES):
        pytest.skip("counted only when every misaligned GPU fuzz test of this file runs")
    total = sum(MISALIGNED_CALLS.values())
    print(f"\nmisaligned gpu fuzz calls: {total}")
    for (op, outcome), n in sorted(MISALIGNED_OUTCOMES.items()):
        print(f"  {op:34} {outcome:30} {n}")
    outcomes = {o for _, o in MISALIGNED_OUTCOMES}
    assert "refused" in outcomes and "ran, equal to the reference" in outcomes
    assert total >= 5000


# -- the harness, rehearsed on the CPU ------------------------------------------------------------------
def _rehearse(p: fc.Problem, seed: int, backend):
    """materialize on ``backend`` (NumPy, or torch on the CPU), read every input back (the values as
    laid out: strided rows, offsets, an out= that is exactly an input), then the reference and the
    comparison as the GPU half makes them."""
    host = fc.host_values(p, np.random.default_rng(seed))
    try:
        args, kw, arena, views = materialize(p, host, backend)
    except Unmaterializable:
        return "skipped"
    if not p.valid or p.bad_values:
        return "not compared"
    for a in p.arrays():
        if a.key in host and a.fill[0] not in ("out", "workspace"):
            assert _same(backend.host(views[a.key]), host[a.key]), f"{a!r} does not hold its values\n{p!r}"
        if a.alias is not None and a.size and backend.name == "numpy":
            assert np.shares_memory(views[a.key], views[a.alias[0]]), f"{a!r} is not a view of {a.alias[0]}"
    want = fc.expected(p, host)
    got = tuple(None if w is None else np.array(w) for w in want) if isinstance(want, tuple) else np.array(want)
    fc.compare(p, got, want)
    return "compared"


def _same(a, b):
    a, b = fc._bits(np.asarray(a)), fc._bits(np.asarray(b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind in "biu":
        return bool((a == b).all())
    u = np.dtype(f"u{a.dtype.itemsize}")
    return bool(((a.view(u) == b.view(u)) | (np.isnan(a.astype(np.float64)) & np.isnan(b.astype(np.float64)))).all())


REHEARSAL = Counter()
try:
    _torch_cpu = TorchBackend("cpu")
except ImportError:
    _torch_cpu = None


@_settings(400)
@given(op=st.sampled_from(sorted(EXAMPLES)), data=st.data(), seed=st.integers(0, 2 ** 32 - 1))
def test_gpu_fuzz_harness_on_the_cpu(op, data, seed):
    env = _env(True)                      # NumPy views hold bf16 and fp8 (ml_dtypes) too
    p = data.draw(fc.problems(op, env))
    backend = NumpyBackend()
    if _torch_cpu is not None and seed % 3 == 0:
        backend = _torch_cpu
    REHEARSAL[(backend.name, _rehearse(p, seed, backend))] += 1


@_settings(300)
@given(op=st.sampled_from(sorted(MISALIGNED_EXAMPLES)), data=st.data(), seed=st.integers(0, 2 ** 32 - 1))
def test_gpu_fuzz_misaligned_harness_on_the_cpu(op, data, seed):
    """The misaligned fuzz's arena places the moved array where its problem says: its address is off
    the arena's 256-byte grid by exactly the planted offset (an element multiple, not 16)."""
    p, key = data.draw(misaligned_problems(op, _misaligned_env(True)))
    if key is None:
        return
    host = fc.host_values(p, np.random.default_rng(seed))
    try:
        _, _, arena, views = materialize(p, host, NumpyBackend())
    except Unmaterializable:
        return
    a = next(a for a in p.arrays() if a.key == key)
    lo, _ = a.span()
    start = views[a.key].ctypes.data + lo * a.itemsize - arena.ctypes.data
    assert start % 256 == a.offset % 256 and a.offset % 16 and a.offset % a.itemsize == 0, (a, start)
