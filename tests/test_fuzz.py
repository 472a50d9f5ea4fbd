"""CPU fuzz of every public function: hypothesis draws calls (tests/fuzz_cases.py), valid and broken on
purpose, and runs them through the whole call path (normalize -> plan -> launch, and the replay of
repeated calls) on fake device arrays with a fake launcher (the ``dev`` / ``mdev`` fixtures of
tests/test_fast_path.py and tests/test_moe_replay.py).

The property, for every call: it returns, or it raises one of the project's typed argument errors
(:data:`ALLOWED`); any other exception fails. When it returns:

* every launch has a grid and block the driver takes and every pointer parameter lies inside an
  array of the call (an argument or an allocation) or is the device's status word;
* a call that raised launched nothing (every check comes before any launch);
* a valid problem (no mutation) does not raise InvalidProblemError, and its results have the
  shapes and dtypes the NumPy reference gives (tests/fuzz_cases.py ``expected``, on host values);
* the same call on other arrays of the same layouts (a replay) launches exactly what the slow
  path launches for those arrays.

Deterministic (``derandomize=True``): the same examples on every run. At least 10,000 calls in
all (``test_the_fuzz_made_enough_calls`` prints the counts).
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runtime as sf
from runtime import InvalidProblemError, UnsupportedError, moe, replay, status
from runtime.device import pack_params
from runtime.kinds import SIZE
from tests import fuzz_cases as fc
from tests.test_fast_path import D, dev  # noqa: F401  (dev: a fixture)
from tests.test_moe_replay import fake_tensor_map, mdev  # noqa: F401  (mdev: a fixture)

MAPS: dict = {}      # fake tensor map -> (address, MapSpec): what the wgmma launches can reach

# The errors an argument may raise. The other SkuforgeErrors are about the environment (no device,
# no NVRTC, a compile cache or template fault) and cannot come from arguments on the fake device;
# DeviceValueError (what a kernel found) is an InvalidProblemError.
ALLOWED = (UnsupportedError, InvalidProblemError)

# examples per op: about 15,000 calls of the ten ops (a call that returns is made three times)
EXAMPLES = {"quantize": 1000, "dequantize": 900, "dynamic_quantize": 1000, "quantize_backward": 600,
            "dequantize_backward": 450, "fake_quantize": 600, "fake_quantize_backward": 500,
            "fake_quantize_learnable_backward": 600, "grouped_matmul": 700, "grouped_matmul_backward": 700}
MALFORMED_EXAMPLES = 600
VALID = dataclasses.replace(fc.CPU, mutate=0)

CALLS: Counter = Counter()          # op -> calls made
OUTCOMES: Counter = Counter()       # (op, outcome) -> count
DONE: set = set()                   # the fuzz tests that ran to the end


def _settings(n):
    return settings(max_examples=n, derandomize=True, database=None, deadline=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


class FD(D):
    """A fake device array that takes ``a[...] = 0`` (LSQ's zero gradients of an empty input)."""

    def __setitem__(self, key, value):
        pass


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
        return FD(a.shape, a.dtype, a.strides(), ptr=ptr)


@pytest.fixture
def fz(mdev, monkeypatch):  # noqa: F811
    """``mdev`` plus a record of every allocation's byte range."""
    made = []
    new = mdev.new

    def recorded(shape, kind):
        d = new(shape, kind)
        a = FD(d.shape, d.dtype, ptr=d.ptr)
        made.append((a.ptr, a.ptr + max(1, math.prod(shape)) * a.dtype.itemsize))
        return a
    monkeypatch.setattr(mdev, "new", recorded)
    # CuPy arrays and torch tensors never hold a null pointer when they have elements; a fake one
    # that does (a mutation) is described as what it is, a foreign array (no replay)
    described = replay.describe

    def describe(obj):
        if isinstance(obj, D) and not obj.ptr and math.prod(obj.shape):
            return None, None
        return described(obj)
    monkeypatch.setattr(replay, "describe", describe)
    # dynamic_quantize fills a foreign out= of an empty x through CuPy (a device): recorded here
    from runtime import dynamic
    monkeypatch.setattr(dynamic, "_fill_foreign", lambda obj, value: obj.__cuda_array_interface__)
    mdev.alloc_ranges = made

    def recorded_map(ptr, spec):
        m = fake_tensor_map(ptr, spec)
        MAPS[m] = (ptr, spec)
        return m
    monkeypatch.setattr(moe, "map_encoder", lambda spec: lambda ptr: recorded_map(ptr, spec))
    replay.CACHE.clear()
    return mdev


def _launch_problems(launches, ranges) -> list:
    """What is wrong with these launches: grid / block limits, pointers outside every array."""
    bad = []
    for launch in launches:
        if launch[0] == "memset":
            _, ptr, _, count = launch
            if not any(lo <= ptr and ptr + 4 * count <= hi for lo, hi in ranges):
                bad.append(f"memset at {ptr:#x} outside every array")
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
        raise AssertionError(f"untyped {type(e).__name__}: {e}\n{p!r}") from e
    return "ok", result, list(d.launches), space.buffers + d.alloc_ranges[start:]


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
        assert not launches, f"{type(res).__name__} raised after {len(launches)} launches: {res}\n{p!r}"
        if p.valid:
            assert isinstance(res, UnsupportedError), f"a valid call raised {type(res).__name__}: {res}\n{p!r}"
            OUTCOMES[(p.op, f"unsupported: {str(res)[:70]}")] += 1
        return
    bad = _launch_problems(launches, ranges)
    assert not bad, f"{bad[:3]}\n{p!r}"
    if p.valid and not p.bad_values:
        _check_against_reference(p, res)
    # a replay at other addresses (same layouts) launches what the slow path launches there
    second = _run_once(d, p, 0x7B0000000000, 0x7E9000000000)
    assert second[0] == "ok", f"the repeated call raised {second[1]!r}\n{p!r}"
    replay.CACHE.clear()
    third = _run_once(d, p, 0x7B0000000000, 0x7E9000000000)
    assert third[0] == "ok", f"the slow path raised {third[1]!r} after the replay returned\n{p!r}"
    assert _comparable(second[2]) == _comparable(third[2]), f"the replay launched other parameters\n{p!r}"
    bad = _launch_problems(second[2], second[3])
    assert not bad, f"replay: {bad[:3]}\n{p!r}"


def _check_against_reference(p, res):
    """The NumPy reference on host values: its outputs have the shapes and dtypes of the call's
    results (and tests/fuzz_cases.py's compare accepts them: the GPU half's code, run here)."""
    rng = np.random.default_rng(len(CALLS) + CALLS[p.op])
    want = fc.expected(p, fc.host_values(p, rng))
    fc.compare(p, want, want)
    gots = res if isinstance(res, tuple) else (res,)
    wants = want if isinstance(want, tuple) else (want,)
    assert len(gots) == len(wants), f"{len(gots)} results, the reference has {len(wants)}\n{p!r}"
    for i, (g, w) in enumerate(zip(gots, wants)):
        if w is None:
            assert g is None, f"result {i} is not None\n{p!r}"
            continue
        shape, dt = _shape_dtype(g)
        w = fc._bits(w)
        if p.op.startswith("grouped_matmul"):
            assert shape == w.shape, f"result {i}: shape {shape}, reference {w.shape}\n{p!r}"
            continue
        assert math.prod(shape) == w.size, f"result {i}: shape {shape}, reference {w.shape}\n{p!r}"
        assert dt == w.dtype, f"result {i}: dtype {dt}, reference {w.dtype}\n{p!r}"


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
        raise AssertionError(f"untyped {type(e).__name__}: {e}\n{target.key}: {names}\n{p!r}") from e
    OUTCOMES[("malformed interface", "ok")] += 1
    assert not must, f"a malformed interface ({names}) of {target.key} was accepted\n{p!r}"


def test_fuzz_malformed_interfaces(fz):
    _malformed(fz)
    DONE.add("malformed interface")


# -- the settings (SKUFORGE_* environment variables) -----------------------------------------------------
SETTING_TEXTS = {
    "SKUFORGE_DYNAMIC_CONFIG": ("auto", "block", "t8", "t16,ch=8", "t8,ch=abc", "t4,threads=", "t2,threads=1e3",
                                "t8,grid=sideways", "t99", "", ",,,", "t8,ch=4,threads=256,grid=full", "t8,ch=-4",
                                "t16,threads=64,fixed=0", "t8,index=div", "=", "t8,ch=8=8"),
    "SKUFORGE_DYNAMIC_TENSOR": ("auto", "two_pass", "three_pass", "", "AUTO"),
    "SKUFORGE_COLUMNS_GRID": ("2d", "1d", "3d", "", "2D"),
    "SKUFORGE_MOE_CONFIG": ("", "default", "fwd=default", "bogus", "fwd=,wgrad=", "x=y", "=", "fwd=128x128x32s5",
                            ",", "fwd"),
    "SKUFORGE_LOCK_TIMEOUT": ("", "5", "-1", "abc", "nan", "inf", "1e400"),
    "SKUFORGE_SYNC_CHECKS": ("", "0", "1", "off", "YES", "maybe", "2"),
}


@_settings(300)
@given(env=st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in SETTING_TEXTS.items()}),
       p=fc.problems("dynamic_quantize") | fc.problems("grouped_matmul") | fc.problems("quantize"))
def _settings_fuzz(d, env, p):
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
    p.mutations.append(f"settings {env}")
    with config.override(**{f: getattr(s, f) for f in ("dynamic_config", "dynamic_tensor", "columns_grid",
                                                       "moe_config")}):
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


@_settings(500)
@given(text=_sku_texts(), fields=st.fixed_dictionaries({}, optional={
    k: JUNK_FIELD for k in ("category", "op", "scope", "mode", "element", "aux_element", "arch", "backend")}),
    pattern=st.sampled_from(["*", "moe/*", "[", None, 3, "quantization/quantize/*/f16/*"]),
    ws=st.tuples(st.sampled_from([0, 1, 5, 2 ** 31, 2 ** 31 + 1, -1, 1.5, "8", None, True, 2 ** 70]),
                 st.sampled_from([1, 8, 1024, 1025, 0, -2, 2.0, None, "4"]),
                 st.sampled_from(["row_experts", "offsets", "sorted", None])))
def _plan_api(text, fields, pattern, ws):
    reg = sf.default_registry()
    calls = (lambda: sf.KernelSku.parse(text), lambda: reg.lookup(text), lambda: sf.Plan(text),
             lambda: reg.query(pattern), lambda: sf.moe.grouped_matmul_workspace_size(*ws),
             lambda: reg.select(**{"category": "quantization", "op": "quantize", "element": "f32", **fields}),
             lambda: sf.Plan.select(sf.Descriptor(**{k: v for k, v in fields.items() if k not in ("arch", "backend")}
                                                  | {"op": fields.get("op", "quantize")}),
                                    sf.Preference(**{k: v for k, v in fields.items() if k in ("arch", "backend")})))
    for fn in calls:
        CALLS["plan and registry"] += 1
        try:
            fn()
        except ALLOWED:
            OUTCOMES[("plan and registry", "typed")] += 1
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"untyped {type(e).__name__}: {e} ({text!r}, {fields}, {pattern!r}, {ws})") from e
        else:
            OUTCOMES[("plan and registry", "ok")] += 1


def test_fuzz_plan_and_registry():
    _plan_api()
    DONE.add("plan and registry")


def test_the_fuzz_made_enough_calls():
    """At least 10,000 calls of the ten ops when every fuzz test of this file ran (a selection skips the count)."""
    if DONE != set(EXAMPLES) | {"malformed interface", "settings", "plan and registry"}:
        pytest.skip("counted only when every fuzz test of this file runs")
    total = sum(CALLS.values())
    ops = sum(CALLS[op] for op in EXAMPLES)
    print(f"\nfuzz calls: {total}, of the ten ops {ops} ({', '.join(f'{op} {n}' for op, n in sorted(CALLS.items()))})")
    for (op, outcome), n in sorted(OUTCOMES.items()):
        print(f"  {op:34} {outcome:70.70} {n}")
    assert ops >= 10_000
