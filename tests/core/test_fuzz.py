"""CPU fuzz of every public function: hypothesis draws calls (tests/fuzz_cases.py), valid and broken on
purpose, and runs them through the whole call path (normalize -> plan -> launch, and the replay of
repeated calls) on fake device arrays with a fake launcher (the ``dev`` / ``mdev`` fixtures of
tests/core/test_replay.py and tests/moe/test_moe_replay.py).

The property, for every call: it returns, or it raises one of the project's typed argument errors
(:data:`ALLOWED`); any other exception fails. When it returns:

* every launch has a grid and block the driver takes, and every pointer parameter lies inside an
  array of the call (an argument or an allocation) or is the device's status word, aligned to the
  element size the kernel reads it as (the SKU's launch metadata names each stream's kind) and, where
  the launch takes the vector path (``vec_ok``), to the kernel's vector width;
* a call that raised launched nothing (every check comes before any launch);
* a valid problem (no mutation) does not raise InvalidProblemError, and its results have the
  shapes and dtypes the NumPy reference gives (tests/fuzz_cases.py ``expected``, on host values);
* the same call on other arrays of the same layouts (a replay) launches exactly what the slow
  path launches for those arrays.

Besides the random draws: every bad value of fuzz_cases' tables alone in an otherwise valid call
(the single-mutation sweep), every op without a usable driver (the CUDA runtime answering
``cudaErrorInsufficientDriver``: a DeviceRequiredError, nothing launched), malformed
``__cuda_array_interface__`` objects, the settings, and the plan and registry API with junk arguments.

Two modes (docs/audit.md, "The fuzz"):

* CI (the default): deterministic (``derandomize=True``, the sweep's bases from a fixed seed), at
  least 10,000 calls of the ten ops (``test_the_fuzz_made_enough_calls`` prints the counts);
* long: ``SKUFORGE_FUZZ_CALLS=100000`` (at least that many calls in all) and/or
  ``SKUFORGE_FUZZ_SEED=<int>`` (randomized from that seed; a random seed, printed, where only the
  count is given). The same seed and count replay the same calls.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
from collections import Counter
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import runtime as sf
from runtime import DeviceRequiredError, InvalidProblemError, UnsupportedError, replay, status
from runtime import moe
from runtime.quantization import lowbit
from runtime.device import pack_params
from runtime.kinds import SIZE
from tests import fuzz_cases as fc
from tests.fakes import D
from tests.core.test_replay import dev  # noqa: F401  (dev: a fixture)
from tests.moe.test_moe_replay import mdev  # noqa: F401  (mdev: a fixture)
from tests.quantization.test_validation import without_driver

MAPS: dict = {}      # fake tensor map -> (address, MapSpec): what the wgmma launches can reach

# The errors an argument may raise. The other SkuforgeErrors are about the environment (no device,
# no NVRTC, a compile cache or template fault) and cannot come from arguments on the fake device;
# DeviceValueError (what a kernel found) is an InvalidProblemError.
ALLOWED = (UnsupportedError, InvalidProblemError)


def _env_int(name: str):
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise pytest.UsageError(f"{name}={text!r}: an integer is required") from None


# The mode: CI (deterministic) unless SKUFORGE_FUZZ_CALLS or SKUFORGE_FUZZ_SEED is set.
LONG_CALLS = _env_int("SKUFORGE_FUZZ_CALLS")
SEED = _env_int("SKUFORGE_FUZZ_SEED")
RANDOMIZED = LONG_CALLS is not None or SEED is not None
if RANDOMIZED and SEED is None:
    SEED = random.SystemRandom().randrange(2 ** 32)
REPLAY = (f"replay: SKUFORGE_FUZZ_SEED={SEED}" + (f" SKUFORGE_FUZZ_CALLS={LONG_CALLS}" if LONG_CALLS else "")
          + " python -m pytest tests/core/test_fuzz.py") if RANDOMIZED else "CI mode (deterministic)"

# examples per op: about 15,000 calls of the ten ops (a call that returns is made three times)
EXAMPLES = {"quantize": 850, "dequantize": 750, "dynamic_quantize": 850, "quantize_backward": 500,
            "dequantize_backward": 380, "fake_quantize": 500, "fake_quantize_backward": 420,
            "fake_quantize_learnable_backward": 500, "grouped_matmul": 600, "grouped_matmul_backward": 600}
MALFORMED_EXAMPLES = 600
NO_DRIVER_EXAMPLES = 400
PLAN_API_EXAMPLES = 500
CI_CALLS = 32_000       # about the calls of the CI mode in all: what SKUFORGE_FUZZ_CALLS scales from
SCALE = max(1.0, LONG_CALLS / CI_CALLS) if LONG_CALLS else 1.0
VALID = dataclasses.replace(fc.CPU, mutate=0)

CALLS: Counter = Counter()          # op -> calls made
OUTCOMES: Counter = Counter()       # (op, outcome) -> count
DONE: set = set()                   # the fuzz tests that ran to the end


def _settings(n):
    """``n`` examples (scaled in the long mode): derandomized in CI, from SEED when randomized."""
    options = dict(max_examples=max(1, round(n * SCALE)), database=None, deadline=None, print_blob=True,
                   suppress_health_check=list(HealthCheck))
    if not RANDOMIZED:
        return settings(derandomize=True, **options)

    def deco(test):
        return seed(SEED)(settings(derandomize=False, **options)(test))
    return deco


@pytest.fixture(scope="module", autouse=True)
def _announce_mode(request):
    """Print the mode (and in the long mode the seed that replays it), whatever pytest captures."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"tests/core/test_fuzz.py: {'randomized, ' + REPLAY if RANDOMIZED else REPLAY}")
    yield


class Space:
    """Made-up addresses for a problem's arrays, and the byte ranges every pointer must fall in."""

    def __init__(self, base):
        self.next = base
        self.buffers = []

    def make(self, a: fc.Arr, made):
        item = a.itemsize
        lo, hi = a.span()
        if a.null:
            ptr = 0
        elif a.alias is not None and isinstance(made.get(a.alias[0]), D):
            ptr = made[a.alias[0]].ptr + a.alias[1] + a.offset
        else:
            start = self.next
            ptr = start - lo * item + a.offset
            self.next += -(-min((hi - lo) * item + a.offset + 64, 1 << 36) // 4096) * 4096
        if ptr:                             # an empty array: its pointer, nothing past it
            self.buffers.append((ptr + lo * item, ptr + hi * item))
        return D(a.shape, a.dtype, a.strides(), ptr=ptr)


@pytest.fixture
def fz(mdev):  # noqa: F811
    """``mdev``, its tensor maps recorded in ``MAPS`` (what the launch checks read)."""
    mdev.maps = MAPS
    return mdev


# -- what a launch's pointers must satisfy ------------------------------------------------------------
# The element size each kernel reads a pointer parameter as (codegen/abi.py declares the C types): the
# streams' kinds come from the SKU's launch metadata (``ins`` / ``outs``), the rest from this table,
# a function of the SKU (``math``: its precision's math type). Every pointer parameter of the manifest
# is in one or the other (test_every_pointer_parameter_has_an_element_size).
def _math(sku):
    return SIZE[sku.precision.math]


POINTER_BYTES = {"scale": _math, "partial": _math, "colmax": _math, "ds": _math, "ds_part": _math, "dz_part": _math,
                 "zero_point": 4, "dz": 4, "status": 4, "ws_status": 4, "count": 4, "scale_e8m0": 1,
                 "counter": 8, "counters": 8, "row_start": 8, "tile_start": 8, "perm": 4, "hist": 4, "base": 4,
                 "ids": 4}


@lru_cache(maxsize=None)
def _entries_by_symbol() -> dict:
    return {e.symbol: e for e in sf.default_registry().entries.values()}


@lru_cache(maxsize=None)
def _kernel_params(fn: str, fmt: str):
    """(manifest entry, parameter names) of a launched function (the fakes launch symbols: a SKU's
    symbol, or one with a suffix: ``_rows``, ``_coop``, ``_chan``, ``_finish``, a team or tile variant, a route
    kernel), its entry-point group found by its packing format."""
    table, sym = _entries_by_symbol(), fn
    while sym and sym not in table:
        sym = sym.rpartition("_")[0]
    assert sym, f"{fn}: no SKU's symbol starts it"
    entry, reg = table[sym], sf.default_registry()
    names = {reg.abi(a).names for a in entry.launch["abi"].values() if reg.abi(a).fmt == fmt}
    assert len(names) == 1, f"{fn}: {len(names)} entry-point groups of {entry.sku} have the format {fmt}"
    return entry, names.pop()


def _element_bytes(entry, fn: str, name: str) -> int:
    launch, sku = entry.launch, entry.sku
    streams = {s["name"]: s["kind"] for s in launch["ins"] + launch["outs"]}
    if name in streams:
        return SIZE[streams[name]]
    if launch["kind"] == "moe_gemm" and name in ("x", "w", "dy", "out", "off"):
        if name == "off":
            return 8 if fn.endswith("offsets_i64") else 4
        return SIZE[launch["out"] if name == "out" else sku.element]
    size = POINTER_BYTES[name]
    return size if isinstance(size, int) else size(sku)


def _alignment_problems(fn, fmt, values, ranges) -> list:
    """Pointer parameters not aligned to the element size the kernel reads them as. (Words wider than
    an element -- vectors, cp.async copies, output pairs -- are checked by the fake launcher itself
    against runtime/vectors.py: tests/fakes.py ``assert_aligned``.) A pointer into no array's bytes
    (an empty array's, never read) is exempt."""
    entry, names = _kernel_params(fn, fmt)
    bad = []
    for name, c, v in zip(names, fmt, values):
        if c != "Q" or not v or not (status.is_status_pointer(v) or any(lo <= v < hi for lo, hi in ranges)):
            continue
        need = _element_bytes(entry, fn, name)
        if v % need:
            bad.append(f"{fn}: {name} = {v:#x} is not aligned to {need} bytes")
    return bad


def _launch_problems(launches, ranges) -> list:
    """What is wrong with these launches: grid / block limits, pointers outside every array,
    pointers not aligned as the kernel reads them."""
    bad = []
    for launch in launches:
        if launch[0] == "memset":
            _, ptr, _, count = launch
            if not any(lo <= ptr and ptr + 4 * count <= hi for lo, hi in ranges):
                bad.append(f"memset at {ptr:#x} outside every array")
            if ptr % 4:
                bad.append(f"memset at {ptr:#x}: not 4-byte aligned")
            continue
        fn, grid, block, fmt, values = launch
        if not (1 <= grid[0] < 2 ** 31 and all(1 <= g < 65536 for g in grid[1:])):
            bad.append(f"{fn}: grid {grid}")
        if not (all(b >= 1 for b in block) and math.prod(block) <= 1024 and block[0] <= 1024):
            bad.append(f"{fn}: block {block}")
        for j, (c, v) in enumerate(zip(fmt, values)):
            if c == "Q" and v and not status.is_status_pointer(v) and not any(lo <= v <= hi for lo, hi in ranges):
                bad.append(f"{fn}: parameter {j} = {v:#x} points outside every array of the call")
            if c == "T":    # a tensor map: every element it can address lies in one array of the call
                ptr, spec = MAPS[v]
                end = ptr + spec.dims[0] * SIZE[spec.kind] + sum((n - 1) * st for n, st in zip(spec.dims[1:], spec.strides))
                if not any(lo <= ptr and end <= hi for lo, hi in ranges):
                    bad.append(f"{fn}: tensor map {j} ({spec} at {ptr:#x}) reaches outside every array of the call")
                if ptr % 16:
                    bad.append(f"{fn}: tensor map {j} at {ptr:#x}: not 16-byte aligned")
        bad += _alignment_problems(fn, fmt, values, ranges)
    return bad


def _comparable(launches):
    """Launches with float parameters compared by their bits (NaN equals itself)."""
    out = []
    for launch in launches:
        if launch[0] == "memset":
            out.append(launch)
            continue
        fn, grid, block, fmt, values = launch
        out.append((fn, grid, block, fmt, pack_params(fmt, values)))
    return out


def _run_once(d, p, base, alloc_base):
    """Materialize ``p`` at ``base`` (allocations from ``alloc_base``) and call it:
    (outcome, result or exception, launches, byte ranges of the arrays)."""
    space = Space(base)
    d.at(alloc_base).launches = []
    start = len(d.alloc_ranges)
    args, kw = p.build(space.make)
    CALLS[p.op] += 1
    try:
        result = fc.call(sf, p, args, kw)
    except ALLOWED as e:
        assert str(e), f"{type(e).__name__} without a message"
        return "typed", e, list(d.launches), None
    except Exception as e:  # noqa: BLE001 - the property: anything else is a bug
        raise AssertionError(f"untyped {type(e).__name__}: {e}\n{_why(p)}") from e
    return "ok", result, list(d.launches), space.buffers + d.alloc_ranges[start:]


def _why(p) -> str:
    """A failing problem and how to replay it."""
    return f"{p!r}\n({REPLAY})"


def _shape_dtype(obj):
    if obj is None:
        return None
    cai = obj.__cuda_array_interface__
    return tuple(cai["shape"]), np.dtype(cai["typestr"])


def check_problem(d, p: fc.Problem):
    """The fuzz property for one problem (see the module docstring)."""
    outcome, res, launches, ranges = _run_once(d, p, 0x7A0000000000, 0x7E8000000000)
    OUTCOMES[(p.op, outcome if p.mutations else f"valid {outcome}")] += 1
    if outcome == "typed":
        assert not launches, f"{type(res).__name__} raised after {len(launches)} launches: {res}\n{_why(p)}"
        if p.valid:
            assert isinstance(res, UnsupportedError), f"a valid call raised {type(res).__name__}: {res}\n{_why(p)}"
            OUTCOMES[(p.op, f"unsupported: {str(res)[:70]}")] += 1
        return
    bad = _launch_problems(launches, ranges)
    assert not bad, f"{bad[:3]}\n{_why(p)}"
    if p.valid and not p.bad_values:
        _check_against_reference(p, res)
    # a replay at other addresses (same layouts) launches what the full path launches there
    second = _run_once(d, p, 0x7B0000000000, 0x7E9000000000)
    assert second[0] == "ok", f"the repeated call raised {second[1]!r}\n{_why(p)}"
    replay.CACHE.clear()
    third = _run_once(d, p, 0x7B0000000000, 0x7E9000000000)
    assert third[0] == "ok", f"the full path raised {third[1]!r} after the replay returned\n{_why(p)}"
    assert _comparable(second[2]) == _comparable(third[2]), f"the replay launched other parameters\n{_why(p)}"
    bad = _launch_problems(second[2], second[3])
    assert not bad, f"replay: {bad[:3]}\n{_why(p)}"


def _check_against_reference(p, res):
    """The NumPy reference on host values: its outputs have the shapes and dtypes of the call's
    results (and tests/fuzz_cases.py's compare accepts them: the GPU half's code, run here)."""
    rng = np.random.default_rng(len(CALLS) + CALLS[p.op])
    want = fc.expected(p, fc.host_values(p, rng))
    fc.compare(p, want, want)
    gots = res if isinstance(res, tuple) else (res,)
    wants = want if isinstance(want, tuple) else (want,)
    assert len(gots) == len(wants), f"{len(gots)} results, the reference has {len(wants)}\n{_why(p)}"
    for i, (g, w) in enumerate(zip(gots, wants)):
        if w is None:
            assert g is None, f"result {i} is not None\n{_why(p)}"
            continue
        shape, dt = _shape_dtype(g)
        w = fc._bits(w)
        if p.op.startswith("grouped_matmul"):
            assert shape == w.shape, f"result {i}: shape {shape}, reference {w.shape}\n{_why(p)}"
            continue
        assert math.prod(shape) == w.size, f"result {i}: shape {shape}, reference {w.shape}\n{_why(p)}"
        assert dt == w.dtype, f"result {i}: dtype {dt}, reference {w.dtype}\n{_why(p)}"


def _fuzz(op):
    def test(fz):
        @_settings(EXAMPLES[op])
        @given(p=fc.problems(op))
        def run(p):
            check_problem(fz, p)
        run()
        DONE.add(op)
    test.__name__ = f"test_fuzz_{op}"
    return test


test_fuzz_quantize = _fuzz("quantize")
test_fuzz_dequantize = _fuzz("dequantize")
test_fuzz_dynamic_quantize = _fuzz("dynamic_quantize")
test_fuzz_quantize_backward = _fuzz("quantize_backward")
test_fuzz_dequantize_backward = _fuzz("dequantize_backward")
test_fuzz_fake_quantize = _fuzz("fake_quantize")
test_fuzz_fake_quantize_backward = _fuzz("fake_quantize_backward")
test_fuzz_fake_quantize_learnable_backward = _fuzz("fake_quantize_learnable_backward")
test_fuzz_grouped_matmul = _fuzz("grouped_matmul")
test_fuzz_grouped_matmul_backward = _fuzz("grouped_matmul_backward")


# -- every bad value alone ---------------------------------------------------------------------------
def _sweep(op):
    """Every single mutation of fuzz_cases' tables, each alone in a valid call of ``op`` (on bases
    from a fixed seed in CI, from SEED when randomized: as many rounds as the long mode scales to)."""
    def test(fz):
        for r in range(max(1, round(SCALE))):
            for p in fc.single_mutation_problems(op, (SEED or 0) + r):
                OUTCOMES[("single mutations", op)] += 1
                check_problem(fz, p)
        DONE.add(f"single {op}")
    test.__name__ = f"test_single_mutations_{op}"
    return test


for _op in fc.OPS:
    globals()[f"test_single_mutations_{_op}"] = _sweep(_op)


# -- no usable driver ----------------------------------------------------------------------------------
@pytest.fixture
def nodriver(monkeypatch):
    """Every CUDA runtime call answers cudaErrorInsufficientDriver (a machine whose driver is older
    than the runtime, or none: tests/quantization/test_validation.py ``without_driver``), on the real driver (its
    allocation, device properties, status word and kernel loading), its launches recorded."""
    with without_driver(monkeypatch) as drv:
        yield drv


@_settings(NO_DRIVER_EXAMPLES)
@given(p=st.one_of(*(fc.problems(op) for op in fc.OPS)))
def _no_driver(d, p):
    d.launches = []
    args, kw = p.build(Space(0x7A0000000000).make)
    CALLS["no driver"] += 1
    try:
        fc.call(sf, p, args, kw)
    except DeviceRequiredError as e:
        OUTCOMES[("no driver", "DeviceRequiredError")] += 1
        assert "cudaErrorInsufficientDriver" in str(e), f"the error does not say what happened: {e}"
    except ALLOWED as e:
        OUTCOMES[("no driver", "typed")] += 1
        assert not p.valid or isinstance(e, UnsupportedError), f"a valid call raised {e!r}\n{_why(p)}"
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"untyped {type(e).__name__} without a driver: {e}\n{_why(p)}") from e
    else:
        OUTCOMES[("no driver", "ok")] += 1        # nothing to compute (an empty problem)
    assert not d.launches, f"launched without a driver\n{_why(p)}"


def test_fuzz_no_driver(nodriver):
    _no_driver(nodriver)
    DONE.add("no driver")


# -- malformed __cuda_array_interface__ objects --------------------------------------------------------
class Cai:
    """An object whose ``__cuda_array_interface__`` is whatever the fuzz wrote."""

    def __init__(self, cai):
        self.__cuda_array_interface__ = cai

    def __repr__(self):
        return f"Cai({self.__cuda_array_interface__!r:.300})"


# (name, the field it changes, must the call refuse it?, how it changes the interface dict)
CORRUPTIONS = (
    ("no shape", "shape", True, lambda c, a: c.pop("shape")),
    ("no typestr", "typestr", True, lambda c, a: c.pop("typestr")),
    ("no data", "data", True, lambda c, a: c.pop("data")),
    ("float extent", "shape", True, lambda c, a: c.update(shape=tuple(float(n) for n in c["shape"]) or (1.0,))),
    ("negative extent", "shape", True, lambda c, a: c.update(shape=(-1,) + tuple(c["shape"][1:]))),
    ("bool extent", "shape", True, lambda c, a: c.update(shape=(True,) + tuple(c["shape"][1:]))),
    ("string shape", "shape", True, lambda c, a: c.update(shape="x".join(map(str, c["shape"])) or "1")),
    ("shape None", "shape", True, lambda c, a: c.update(shape=None)),
    ("nested shape", "shape", True, lambda c, a: c.update(shape=(tuple(c["shape"]),))),
    ("huge extent", "shape", True, lambda c, a: c.update(shape=(2 ** 64,) + tuple(c["shape"][1:]))),
    ("numpy extents", "shape", False, lambda c, a: c.update(shape=tuple(np.int64(n) for n in c["shape"]))),
    ("list shape", "shape", False, lambda c, a: c.update(shape=list(c["shape"]))),
    ("typestr junk", "typestr", True, lambda c, a: c.update(typestr="<q9")),
    ("typestr empty", "typestr", True, lambda c, a: c.update(typestr="")),
    ("typestr None", "typestr", True, lambda c, a: c.update(typestr=None)),
    ("typestr int", "typestr", True, lambda c, a: c.update(typestr=4)),
    ("typestr object", "typestr", True, lambda c, a: c.update(typestr="|O")),
    ("typestr void", "typestr", True, lambda c, a: c.update(typestr="|V4")),
    ("big-endian", "typestr", True, lambda c, a: c.update(typestr=">" + c["typestr"][1:]) if c["typestr"][0] == "<" else
     c.update(typestr="|V1")),
    ("typestr descr list", "typestr", True, lambda c, a: c.update(typestr=[("f0", "<f4")])),
    ("data not a tuple", "data", True, lambda c, a: c.update(data=c["data"][0])),
    ("data empty", "data", True, lambda c, a: c.update(data=())),
    ("data pointer string", "data", True, lambda c, a: c.update(data=(hex(c["data"][0]), False))),
    ("data pointer float", "data", True, lambda c, a: c.update(data=(float(c["data"][0]), False))),
    ("data pointer negative", "data", True, lambda c, a: c.update(data=(-16, False))),
    ("data pointer 2**64", "data", True, lambda c, a: c.update(data=(2 ** 64, False))),
    ("data pointer bool", "data", True, lambda c, a: c.update(data=(True, False))),
    ("data pointer None", "data", False, lambda c, a: c.update(data=(None, False))),
    ("data one element", "data", False, lambda c, a: c.update(data=(c["data"][0],))),
    ("strides short", "strides", True,
     lambda c, a: c.update(strides=(a.itemsize,) * max(0, len(a.shape) - 1) or (1, 1))),
    ("strides float", "strides", True,
     lambda c, a: c.update(strides=tuple(float(s) for s in (c["strides"] or (a.itemsize,))))),
    ("strides not bytes", "strides", False,
     lambda c, a: c.update(strides=tuple(s + 1 for s in (c["strides"] or (a.itemsize,))))),
    ("strides string", "strides", True, lambda c, a: c.update(strides="1,2")),
    ("strides huge", "strides", True, lambda c, a: c.update(strides=(2 ** 63,) + tuple((c["strides"] or ())[1:]))),
    ("strides None", "strides", False, lambda c, a: c.update(strides=None)),
    ("masked", "mask", True, lambda c, a: c.update(mask=Cai(dict(c)))),
    ("mask None", "mask", False, lambda c, a: c.update(mask=None)),
    ("version 0", "version", False, lambda c, a: c.update(version=0)),
    ("no version", "version", False, lambda c, a: c.pop("version")),
    ("not a dict", "*", True, lambda c, a: (c.clear(), c.update(_list=True))),
    ("read-only", "data", "output", lambda c, a: c.update(data=(c["data"][0], True))),
    ("extra keys", "extra", False, lambda c, a: c.update(stream=None, descr=[("", c["typestr"])])),
)


def _cai_of(fake: D) -> dict:
    return dict(fake.__cuda_array_interface__)


@_settings(MALFORMED_EXAMPLES)
@given(p=st.one_of(*(fc.problems(op, VALID) for op in ("quantize", "dequantize", "dynamic_quantize",
                                                       "fake_quantize_learnable_backward", "grouped_matmul_backward"))),
       pick=st.integers(0, 10 ** 6), how=st.lists(st.sampled_from(range(len(CORRUPTIONS))), min_size=1, max_size=3))
def _malformed(d, p, pick, how):
    target = p.arrays()[pick % len(p.arrays())]
    last = {CORRUPTIONS[i][1]: i for i in how}            # one change per field (a later one would undo it)
    how = sorted(last.values(), key=lambda i: CORRUPTIONS[i][1] == "*")
    names = [CORRUPTIONS[i][0] for i in how]
    must = any(CORRUPTIONS[i][2] is True or (CORRUPTIONS[i][2] == "output" and target.fill[0] in ("out", "workspace"))
               for i in how)

    space = Space(0x7A0000000000)

    def make(a, made):
        fake = space.make(a, made)
        if a.key != target.key:
            return fake
        cai = _cai_of(fake)
        for i in how:
            try:
                CORRUPTIONS[i][3](cai, a)
            except (KeyError, IndexError, TypeError):
                pass                    # an earlier corruption removed what this one changes
        return Cai(list(cai.items()) if "_list" in cai else cai)
    d.launches = []
    args, kw = p.build(make)
    CALLS["malformed interface"] += 1
    try:
        fc.call(sf, p, args, kw)
    except ALLOWED as e:
        OUTCOMES[("malformed interface", "typed")] += 1
        assert not d.launches, f"launched before raising {e!r}"
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"untyped {type(e).__name__}: {e}\n{target.key}: {names}\n{_why(p)}") from e
    OUTCOMES[("malformed interface", "ok")] += 1
    assert not must, f"a malformed interface ({names}) of {target.key} was accepted\n{_why(p)}"


def test_fuzz_malformed_interfaces(fz):
    _malformed(fz)
    DONE.add("malformed interface")


# -- the settings (SKUFORGE_* environment variables) -----------------------------------------------------
SETTING_TEXTS = {
    "SKUFORGE_DYNAMIC_CONFIG": ("auto", "block", "t8", "t16,ch=8", "t8,ch=abc", "t4,threads=", "t2,threads=1e3",
                                "t8,grid=sideways", "t99", "", ",,,", "t8,ch=4,threads=256,grid=full", "t8,ch=-4",
                                "t16,threads=64,fixed=0", "t8,index=div", "=", "t8,ch=8=8"),
    "SKUFORGE_SCHEDULE": ("", "b128", "b256-1d", "t8", "auto", "block", "two-pass", "one-launch", "bogus"),
    "SKUFORGE_MOE_CONFIG": ("", "default", "fwd=default", "bogus", "fwd=,wgrad=", "x=y", "=", "fwd=128x128x32s5",
                            ",", "fwd"),
    "SKUFORGE_LOCK_TIMEOUT": ("", "5", "-1", "abc", "nan", "inf", "1e400"),
    "SKUFORGE_SYNC_CHECKS": ("", "0", "1", "off", "YES", "maybe", "2"),
}


# what code may set: runtime.moe.use_config's tile configurations, runtime.quantization.lowbit.prefer_arch's arch
IN_CODE = {"use_config": st.sampled_from([None, "default", "fwd=zzz", {"fwd": ["x"]}, {"fwd": 3}, {"*": None},
                                          {"dgrad": "default"}, 3, ["fwd"]]),
           "prefer_arch": st.sampled_from([80, 89, 90, "80", None, 8.9, True, 2 ** 70])}


@_settings(300)
@given(env=st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in SETTING_TEXTS.items()}),
       code=st.fixed_dictionaries({}, optional=IN_CODE),
       p=fc.problems("dynamic_quantize") | fc.problems("grouped_matmul") | fc.problems("quantize"))
def _settings_fuzz(d, env, code, p):
    from runtime import config
    CALLS["settings"] += 1
    try:
        s = config.from_environ(env)
    except ALLOWED as e:
        OUTCOMES[("settings", "typed")] += 1
        assert "SKUFORGE_" in str(e), f"the error does not name the variable: {e}"
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"untyped {type(e).__name__} reading {env}: {e}") from e
    p.mutations.append(f"settings {env} {code}")
    with contextlib.ExitStack() as stack:
        stack.enter_context(config.override(**{f: getattr(s, f) for f in ("dynamic_config", "schedule",
                                                                          "moe_config")}))
        try:
            if "use_config" in code:
                stack.enter_context(moe.use_config(code["use_config"]))
            if "prefer_arch" in code:
                stack.enter_context(lowbit.prefer_arch(code["prefer_arch"]))
        except ALLOWED:
            OUTCOMES[("settings", "typed in code")] += 1
            return
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"untyped {type(e).__name__} entering {code}: {e}") from e
        check_problem(d, p)


def test_fuzz_settings(fz):
    _settings_fuzz(fz)
    DONE.add("settings")

# -- the plan and registry API ------------------------------------------------------------------------
def _sku_texts():
    skus = [str(s) for s in sf.default_registry().skus()[::37]]
    field = st.sampled_from(["quantization", "moe", "quantize", "-", "", "sm90", "sm7", "smXX", "simt", "f32.acc-f32",
                             "f32.acc-f32.det.fast", "x" * 300, "token", "s8", "bf16", "wgmma", "f32", "acc-"])

    @st.composite
    def mutated(draw):
        parts = draw(st.sampled_from(skus)).split("/")
        for _ in range(draw(st.integers(0, 3))):
            how = draw(st.integers(0, 2))
            if how == 0 and parts:
                parts[draw(st.integers(0, len(parts) - 1))] = draw(field)
            elif how == 1 and parts:
                parts.pop(draw(st.integers(0, len(parts) - 1)))
            else:
                parts.insert(draw(st.integers(0, len(parts))), draw(field))
        return "/".join(parts)
    return mutated() | st.text(max_size=40) | st.sampled_from([None, 5, b"quantization", ["a"], 1.5])


JUNK_FIELD = st.sampled_from([None, "", "quantize", "dequantize", "grouped_matmul", "token", "group", "symmetric",
                              "f16", "bf16", "s8", "fp8_e4m3", "moe", "quantization", ["f16"], 3, 80, 90, "90", 1.5,
                              True, "mma", "simt", "wgmma", "e8m0"])


SKU_FIELDS = ("category", "op", "scope", "mode", "element", "aux_element", "arch", "backend")
JUNK_ARG = st.sampled_from([None, 3, -1, 2 ** 70, 1.5, float("nan"), "0", "main", "gemm", "route_scan", "", b"0",
                            [0], (0,), {}, object(), True, np.int64(0), fc.HostDLPack()])


def _plan_calls(reg, text, fields, pattern, ws, junk, query):
    """The calls of one example: every entry point of the plan, SKU and registry API."""
    j0, j1, j2, j3 = junk
    sku_fields = {"category": "quantization", "op": "quantize", "scope": None, "mode": None, "element": "f32",
                  "aux_element": None, **fields}
    return (lambda: sf.KernelSku.parse(text), lambda: reg.lookup(text), lambda: sf.Plan(text),
            lambda: reg.query(pattern), lambda: sf.moe.grouped_matmul_workspace_size(*ws),
            lambda: reg.select(**{"category": "quantization", "op": "quantize", "element": "f32", **fields}),
            lambda: sf.Plan.select(sf.Descriptor(**{k: v for k, v in fields.items() if k not in ("arch", "backend")}
                                                 | {"op": fields.get("op", "quantize")}),
                                   sf.Preference(**{k: v for k, v in fields.items() if k in ("arch", "backend")})),
            lambda: reg.query("*", **query), lambda: reg.kernel(text, device=j0),
            lambda: sf.Plan(text).abi(j1), lambda: sf.Plan(text).abi(), lambda: sf.Plan(text).entry_points,
            lambda: sf.Plan(text).workspace_size(j2), lambda: sf.Plan(text).can_implement(j3),
            lambda: sf.Plan(text).run(j0, stream=j1), lambda: sf.Plan(text, registry=j2),
            lambda: sf.Plan.select(j0, j1), lambda: sf.Plan.select(sf.Descriptor("quantize"), j2),
            lambda: sf.KernelSku(**sku_fields), lambda: sf.KernelSku(j0, j1, j2, j3, j0, j1),
            lambda: sf.KernelSku(**{**sku_fields, "precision": j2}), lambda: sf.Precision(j0, j1, j2, j3),
            lambda: sf.Precision.parse(j0), lambda: sf.KernelSku.parse(text).runs_on(j1),
            lambda: sf.Plan.select(sf.Descriptor(j0, j1, j2, j3), sf.Preference(j0, j1)), lambda: reg.source(text),
            lambda: reg.abi(j0), lambda: reg.unit_source(j1), lambda: sf.check(j2),
            lambda: sf.Registry.load(j3))


@_settings(PLAN_API_EXAMPLES)
@given(text=_sku_texts(), fields=st.fixed_dictionaries({}, optional={k: JUNK_FIELD for k in SKU_FIELDS}),
       pattern=st.sampled_from(["*", "moe/*", "[", None, 3, "quantization/quantize/*/f16/*"]),
       ws=st.tuples(st.sampled_from([0, 1, 5, 2 ** 31, 2 ** 31 + 1, -1, 1.5, "8", None, True, 2 ** 70]),
                    st.sampled_from([1, 8, 1024, 1025, 0, -2, 2.0, None, "4"]),
                    st.sampled_from(["row_experts", "offsets", "sorted", None])),
       junk=st.tuples(JUNK_ARG, JUNK_ARG, JUNK_ARG, JUNK_ARG),
       query=st.dictionaries(st.sampled_from(SKU_FIELDS + ("precision", "bogus", "sku")), JUNK_FIELD, max_size=2))
def _plan_api(text, fields, pattern, ws, junk, query):
    reg = sf.default_registry()
    for fn in _plan_calls(reg, text, fields, pattern, ws, junk, query):
        CALLS["plan and registry"] += 1
        try:
            fn()
        except ALLOWED + (DeviceRequiredError,):
            OUTCOMES[("plan and registry", "typed")] += 1
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"untyped {type(e).__name__}: {e} ({text!r}, {fields}, {pattern!r}, {ws}, {junk}, "
                                 f"{query}; {REPLAY})") from e
        else:
            OUTCOMES[("plan and registry", "ok")] += 1


def test_fuzz_plan_and_registry(nodriver):
    """Under the no-driver fake: ``kernel(sku, device=0)`` of a valid SKU is a DeviceRequiredError
    (nothing compiles), every junk argument a typed error."""
    _plan_api()
    DONE.add("plan and registry")


def test_the_launch_checks_find_misaligned_and_stray_pointers(fz):
    """The property's launch checks are not vacuous: a launch of a real call passes them, and the same
    launch with its x pointer moved by one byte, by four bytes on the vector path (the fake
    launcher's check), with an odd row stride on it, or out of every array fails them."""
    from tests.fakes import assert_aligned
    x = D((8, 64), ptr=0x7A0000000000)
    fz.at(0x7E8000000000).launches = []
    sf.quantize(x, 0.5, scope="tensor")
    ranges = [(x.ptr, x.ptr + 8 * 64 * 4)] + fz.alloc_ranges
    (fn, grid, block, fmt, values), = fz.launches
    names = _kernel_params(fn, fmt)[1]
    assert values[names.index("vec_ok")] == 1 and not _launch_problems(fz.launches, ranges)
    assert_aligned(fn, values)

    def moved(**changed):
        v = list(values)
        for name, value in changed.items():
            v[names.index(name)] = value
        return v
    assert any("x = " in b and "aligned to 4 bytes" in b
               for b in _launch_problems([(fn, grid, block, fmt, moved(x=x.ptr + 1, vec_ok=0))], ranges))
    assert_aligned(fn, moved(x=x.ptr + 4, vec_ok=0))            # the scalar path takes any element address
    for bad in (moved(x=x.ptr + 4), moved(x_rs=65)):
        with pytest.raises(AssertionError, match="misaligned vector accesses"):
            assert_aligned(fn, bad)
    assert any("outside every array" in b
               for b in _launch_problems([(fn, grid, block, fmt, moved(x=0x100000))], ranges))


def test_every_pointer_parameter_has_an_element_size():
    """The alignment check knows the element size of every pointer parameter of the manifest."""
    reg = sf.default_registry()
    for e in reg.entries.values():
        streams = {s["name"] for s in e.launch["ins"] + e.launch["outs"]}
        for group, abi_id in e.launch["abi"].items():
            abi = reg.abi(abi_id)
            for name, c in zip(abi.names, abi.fmt):
                if c == "Q" and name not in streams:
                    assert _element_bytes(e, e.symbol + "_" + group, name) in (1, 2, 4, 8), (e.sku, group, name)


def test_the_fuzz_made_enough_calls():
    """At least 10,000 calls of the ten ops when every fuzz test of this file ran (a selection skips
    the count); in the long mode, at least SKUFORGE_FUZZ_CALLS calls in all."""
    every = set(EXAMPLES) | {f"single {op}" for op in fc.OPS} | {"malformed interface", "settings",
                                                                 "plan and registry", "no driver"}
    if DONE != every:
        pytest.skip("counted only when every fuzz test of this file runs")
    total = sum(CALLS.values())
    ops = sum(CALLS[op] for op in EXAMPLES)
    print(f"\nfuzz ({REPLAY}) calls: {total}, of the ten ops {ops} "
          f"({', '.join(f'{op} {n}' for op, n in sorted(CALLS.items()))})")
    for (op, outcome), n in sorted(OUTCOMES.items()):
        print(f"  {op:34} {outcome:70.70} {n}")
    assert ops >= 10_000
    assert total >= (LONG_CALLS or 0), f"{total} calls; SKUFORGE_FUZZ_CALLS={LONG_CALLS} asked for more"
