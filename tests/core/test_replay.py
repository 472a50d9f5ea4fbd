"""The replay of repeated calls, on the CPU: fake device arrays, launches recorded instead of run.

A wrong slot launches a kernel on stale pointers (a bug of this kind was caught on the GPU: a
pointer written into the scalar-scale slot). These tests run every functional API twice on
same-layout arrays at new addresses and check that the replayed call (replay) launches
exactly what the full path launches for the same arrays: the same kernels, grids, blocks and
every parameter value, with the same results returned.
"""
import dataclasses

import numpy as np
import pytest

import runtime as sf
from runtime import arrays, config, graphs
from runtime import replay, replay_code
from runtime.abi import Abi
from runtime import launch as launch_mod
from runtime.quantization import lowbit
from runtime.quantization.signatures import QUANTIZE
from runtime import status
from tests.fakes import D, FakeDevice, FakeDeviceArray, FakeFunction, count_replays, err

@pytest.fixture
def dev(fake_device, monkeypatch):
    """The fake device (tests/fakes.py), counting the replays that ran (``dev.hits``)."""
    count_replays(monkeypatch, lambda hit: setattr(fake_device, "hits", fake_device.hits + hit))
    return fake_device


def _ptrs(result):
    if isinstance(result, tuple):
        return tuple(None if r is None else r.ptr for r in result)
    return result.ptr


def _run(dev, call, base, sync=False):
    dev.at(base).launches = []
    with sf.sync_checks(sync):
        result = call(dev)
    return dev.launches, _ptrs(result)


def replay_matches_full_path(dev, call):
    """Run ``call`` (miss), again at new addresses (hit), then without the cache at those same
    addresses (full path): the hit launches exactly what the full path launches."""
    first = _run(dev, call, 0x7F0000000000)
    assert dev.hits == 0 and first[0], "the first call launches through the full path"
    assert len(replay.CACHE) == 1, "the call was remembered"
    fast = _run(dev, call, 0x7F4000000000)
    assert dev.hits == 1, "the repeated call took the replay"
    replay.CACHE.clear()
    slow = _run(dev, call, 0x7F4000000000)
    assert dev.hits == 1
    assert fast == slow
    assert fast != first          # new addresses were launched, not the remembered ones
    return fast


# every functional API, with device and Python-scalar parameters, returned and given outputs
S, Z = "float32", "int32"
CALLS = {
    "quantize token": (lambda d: sf.quantize(d.a((8, 64), "float16"), d.a((8,)), scope="token"), True),
    "quantize token, zero point": (lambda d: sf.quantize(d.a((8, 64)), d.a((8,)), d.a((8,), Z), scope="token",
                                                         out_dtype="uint8", qmin=0, qmax=255), True),
    "quantize tensor, scalars": (lambda d: sf.quantize(d.a((8, 64)), 0.25, 3, scope="tensor"), False),
    "quantize tensor, int scale": (lambda d: sf.quantize(d.a((8, 64)), 2, scope="tensor"), False),
    "quantize channel last, out=": (lambda d: sf.quantize(d.a((8, 64), "float16"), d.a((64,)), scope="channel",
                                                          axis=1, out=d.a((8, 64), "int8")), True),
    "quantize group, strided rows": (lambda d: sf.quantize(d.a((8, 64), strides=(128, 1)), d.a((8, 4)),
                                                           scope="group", group_size=16), True),
    "quantize, misaligned x (scalar path)": (lambda d: sf.quantize(d.a((8, 64), offset=4), d.a((8,)),
                                                                   scope="token"), True),
    "dequantize group": (lambda d: sf.dequantize(d.a((8, 64), "int8"), d.a((8, 4)), d.a((8, 4), Z), scope="group",
                                                 group_size=16, out_dtype="float16"), True),
    "dequantize tensor, scalars": (lambda d: sf.dequantize(d.a((8, 64), "uint8"), 0.5, 100, scope="tensor"), False),
    "quantize_backward channel": (lambda d: sf.quantize_backward(d.a((8, 64)), d.a((8, 64)), d.a((8,)), d.a((8,), Z),
                                                                 scope="channel", axis=0), True),
    "quantize_backward tensor, scalars": (lambda d: sf.quantize_backward(d.a((8, 64)), d.a((8, 64)), 0.1, -2,
                                                                         scope="tensor"), False),
    "dequantize_backward token": (lambda d: sf.dequantize_backward(d.a((8, 64), "float64"), d.a((8,), "float64"),
                                                                   scope="token"), True),
    "dequantize_backward tensor, scalar": (lambda d: sf.dequantize_backward(d.a((8, 64)), 0.5, scope="tensor"),
                                           False),
    "fake_quantize channel": (lambda d: sf.fake_quantize(d.a((8, 64)), d.a((64,)), scope="channel", axis=1), True),
    "fake_quantize channel, mask": (lambda d: sf.fake_quantize(d.a((8, 64)), d.a((64,)), d.a((64,), Z),
                                                               scope="channel", axis=1, return_mask=True), True),
    "fake_quantize tensor, scalars, mask": (lambda d: sf.fake_quantize(d.a((8, 64)), 0.1, 5, scope="tensor",
                                                                       qmin=0, qmax=255, return_mask=True), False),
    "fake_quantize_backward group": (lambda d: sf.fake_quantize_backward(d.a((8, 64)), d.a((8, 64)), d.a((8, 4)),
                                                                         scope="group", group_size=16), True),
    "fake_quantize token, bits": (lambda d: sf.fake_quantize(d.a((8, 61), "float16"), d.a((8,)), scope="token",
                                                             return_mask="bits"), True),
    "fake_quantize group, bits, out=": (lambda d: sf.fake_quantize(d.a((8, 64)), d.a((8, 4)), d.a((8, 4), Z),
                                                                   scope="group", group_size=16, return_mask="bits",
                                                                   out=d.a((8, 64))), True),
    "fake_quantize_backward_from_mask": (lambda d: sf.fake_quantize_backward_from_mask(
        d.a((8, 64), "float16"), d.a((8, 8), "uint8")), False),
    "fake_quantize_backward_from_mask ragged, strided rows, out=": (lambda d: sf.fake_quantize_backward_from_mask(
        d.a((8, 61), "float64", strides=(72, 1)), d.a((8, 8), "uint8", strides=(16, 1)), out=d.a((8, 61), "float64")),
        False),
    "lsq tensor, scalars": (lambda d: sf.fake_quantize_learnable_backward(d.a((70, 33)), d.a((70, 33)), 0.1, 3,
                                                                          scope="tensor"), False),
    "lsq channel": (lambda d: sf.fake_quantize_learnable_backward(d.a((9, 48)), d.a((9, 48)), d.a((48,)),
                                                                  d.a((48,), Z), scope="channel", axis=1), True),
    "lsq token": (lambda d: sf.fake_quantize_learnable_backward(d.a((6, 64), "float64"), d.a((6, 64), "float64"),
                                                                d.a((6,), "float64"), scope="token"), True),
    "lsq group, out=": (lambda d: sf.fake_quantize_learnable_backward(d.a((6, 64)), d.a((6, 64)), d.a((6, 4)),
                                                                      scope="group", group_size=16,
                                                                      out=d.a((6, 64))), True),
    "quantize fp8 token": (lambda d: sf.quantize(d.a((8, 64), "float16"), d.a((8,)), scope="token",
                                                 out_dtype="fp8_e4m3"), True),
    "quantize int4 group, zero point": (lambda d: sf.quantize(d.a((8, 64)), d.a((8, 4)), d.a((8, 4), Z), scope="group",
                                                              group_size=16, out_dtype="uint4"), True),
    "dequantize int4 channel": (lambda d: sf.dequantize(d.a((8, 32), "uint8"), d.a((64,)), scope="channel", axis=1,
                                                        in_dtype="int4", out_dtype="float16"), True),
    "dequantize mx": (lambda d: sf.dequantize(d.a((8, 64), "uint8"), d.a((8, 2), "uint8"), scope="group",
                                              group_size=32, in_dtype="fp8_e4m3", scale_dtype="e8m0"), True),
    "dynamic_quantize fp8 group": (lambda d: sf.dynamic_quantize(d.a((16, 512), "float16"), scope="group",
                                                                 group_size=128, out_dtype="fp8_e4m3"), False),
    "dynamic_quantize mx, out=": (lambda d: sf.dynamic_quantize(d.a((16, 512), "float16"), scope="group", group_size=32,
                                                                out_dtype="fp8_e4m3", scale_dtype="e8m0",
                                                                out=(d.a((16, 512), "uint8"), d.a((16, 16), "uint8"))),
                                  False),
    "dynamic_quantize int4 tensor": (lambda d: sf.dynamic_quantize(d.a((64, 256)), scope="tensor", out_dtype="int4"),
                                     False),
    "dynamic_quantize token": (lambda d: sf.dynamic_quantize(d.a((16, 4096), "float16"), scope="token"), False),
    "dynamic_quantize group asymmetric": (lambda d: sf.dynamic_quantize(d.a((16, 512)), scope="group",
                                                                        group_size=128, mode="asymmetric"), False),
    "dynamic_quantize tensor": (lambda d: sf.dynamic_quantize(d.a((64, 256)), scope="tensor"), False),
    # a strided scale allocation: the replay allocates it with the same strides, launches the same p_rs / p_gs
    "dynamic_quantize group col_aligned asymmetric": (lambda d: sf.dynamic_quantize(
        d.a((10, 512)), scope="group", group_size=128, mode="asymmetric", scale_layout="col_aligned"), False),
    "dynamic_quantize mx col, out=": (lambda d: sf.dynamic_quantize(
        d.a((16, 512), "float16"), scope="group", group_size=32, out_dtype="fp8_e4m3", scale_dtype="e8m0",
        out=(d.a((16, 512), "uint8"), d.a((16, 16), "uint8", strides=(1, 32)))), False),
    "dynamic_quantize channel asymmetric": (lambda d: sf.dynamic_quantize(d.a((64, 256)), scope="channel", axis=1,
                                                                          mode="asymmetric", out_dtype="uint8"),
                                            False),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_replay_launches_what_the_full_path_launches(dev, name):
    call, device_params = CALLS[name]
    replay_matches_full_path(dev, call)


@pytest.mark.parametrize("name", [n for n, (_, device_params) in CALLS.items() if device_params])
def test_device_parameters_replay_by_default_and_not_under_sync_checks(dev, unchecked, name):
    call, _ = CALLS[name]
    _run(dev, call, 0x7F0000000000)                      # remembered: the kernels check device values
    assert len(replay.CACHE) == 1
    _run(dev, call, 0x7F4000000000)
    assert dev.hits == 1
    _run(dev, call, 0x7F4000000000, sync=True)            # the debug mode checks them on the host
    assert dev.hits == 1, "under sync_checks device values are checked again (the full path)"
    assert unchecked, "the synchronous host checks ran"


@pytest.fixture
def unchecked(monkeypatch):
    """The synchronous host checks cannot run on fake arrays: recorded instead (arg names)."""
    seen = []
    from runtime import params
    for mod in (params, lowbit):
        monkeypatch.setattr(mod, "device_check", lambda ref, arg, *a, **k: seen.append(arg))
    return seen


def test_scalar_scale_and_zero_point_are_refilled_into_their_value_slots(dev):
    x, out = D((8, 64)), D((8, 64), "int8", ptr=0x7F0000100000)
    sf.quantize(x, 0.5, 3, scope="tensor", out=out)
    dev.launches = []
    sf.quantize(x, 0.25, -7, scope="tensor", out=out)
    assert dev.hits == 1
    v = dev.launches[-1][4]
    # (x ptr, stride, out ptr, stride, scale ptr, scale value, zp ptr, zp value, ...)
    assert (v[0], v[2], v[4], v[5], v[6], v[7]) == (x.ptr, out.ptr, 0, 0.25, 0, -7)


def test_device_scale_is_refilled_into_its_pointer_slot(dev, unchecked):
    x, s, out = D((8, 64), ptr=0x7F0000000000), D((8,), ptr=0x7F0000100000), D((8, 64), "int8", ptr=0x7F0000200000)
    sf.quantize(x, s, scope="token", out=out)
    x2, s2, out2 = D((8, 64), ptr=0x7F0000300000), D((8,), ptr=0x7F0000400000), D((8, 64), "int8", ptr=0x7F0000500000)
    assert sf.quantize(x2, s2, scope="token", out=out2) is out2
    assert dev.hits == 1
    v = dev.launches[-1][4]
    assert (v[0], v[2], v[4], v[5], v[6]) == (x2.ptr, out2.ptr, s2.ptr, 0.0, 0)


def test_bad_scalars_take_the_full_path_and_its_errors(dev):
    x = D((8, 64))
    sf.quantize(x, 0.5, 3, scope="tensor")
    for scale, zp, words in ((-1.0, 3, ("scale",)), (float("inf"), 3, ("scale",)), (float("nan"), 3, ("scale",)),
                             (0.5, 300, ("zero_point", "300"))):
        err(lambda: sf.quantize(x, scale, zp, scope="tensor"), sf.InvalidProblemError, *words)
    sf.fake_quantize(x, 0.5, 3, scope="tensor", qmin=0, qmax=15)
    err(lambda: sf.fake_quantize(x, 0.5, 16, scope="tensor", qmin=0, qmax=15), sf.InvalidProblemError, "zero_point")
    assert dev.hits == 0


def test_keyword_arguments_of_another_type_are_validated(dev):
    x, s = D((8, 64)), D((8, 4))
    sf.quantize(x, s, scope="group", group_size=16)
    for bad in (16.0, np.int64(16)):
        err(lambda: sf.quantize(x, s, scope="group", group_size=bad), sf.InvalidProblemError, "group_size")
    sf.quantize(x, 0.5, scope="tensor", qmin=-100)
    err(lambda: sf.quantize(x, 0.5, scope="tensor", qmin=-100.0), sf.InvalidProblemError, "qmin")
    err(lambda: sf.quantize(x, s, scope="group", group_size=[16]), sf.InvalidProblemError, "group_size")
    assert dev.hits == 0
    # equal keys, other types: the replay compares the types, and misses; the remembered call replays
    x, s = dev.a((8, 64)), dev.a((8, 4))
    sf.quantize(x, s, scope="group", group_size=16, out_dtype="uint8")
    for bad in (16.0, np.int64(16)):
        err(lambda: sf.quantize(x, s, scope="group", group_size=bad, out_dtype="uint8"), sf.InvalidProblemError,
            "group_size")
    assert dev.hits == 0
    sf.quantize(x, s, scope="group", group_size=16, out_dtype="uint8")
    sf.quantize(x, 0.5, scope="tensor", qmin=-100)
    assert dev.hits == 2


def test_any_difference_in_layout_misses(dev, unchecked):
    x, s = D((8, 64)), D((8,), ptr=0x7F0000100000)
    sf.quantize(x, s, scope="token")
    for other in (D((8, 64), ptr=0x7F0000200004),                    # alignment: the vector path
                  D((8, 64), strides=(128, 1), ptr=0x7F0000200000),  # row stride
                  D((8, 64), "float16", ptr=0x7F0000200000)):
        sf.quantize(other, s, scope="token")
    sf.quantize(x, s, scope="token", out_dtype="uint8")
    sf.dequantize(D((8, 64), "int8"), s, scope="token")
    assert dev.hits == 0


def test_alignment_decides_the_vector_path_of_a_replay(dev, unchecked):
    """A misaligned x is another key: its launch (scalar path) is never replayed for an aligned x."""
    def call(off):
        return lambda d: sf.quantize(d.a((8, 64), offset=off), d.a((8,)), scope="token")
    aligned = replay_matches_full_path(dev, call(0))
    replay.CACHE.clear()
    dev.hits = 0
    misaligned = replay_matches_full_path(dev, call(4))
    assert aligned[0][0][4][-2] != misaligned[0][0][4][-2]          # the vec_ok parameter (before status)


def test_dynamic_launch_configuration_is_part_of_the_key(dev, monkeypatch):
    """A remembered fused dynamic launch (a prepared launch) is not replayed once
    the launch configuration changes (the probes switch it between calls): the new one is chosen."""

    def call(d):
        return sf.dynamic_quantize(d.a((16, 4096), "float16"), scope="token")
    auto = replay_matches_full_path(dev, call)
    # swapped without runtime.config.override (which would also forget the remembered launches):
    # the key alone must tell the configurations apart
    monkeypatch.setattr(config, "_SETTINGS", dataclasses.replace(config.settings(), dynamic_config="block"))
    dev.hits = 0
    block = _run(dev, call, 0x7F8000000000)
    assert dev.hits == 0 and len(replay.CACHE) == 2                        # a miss, then remembered apart
    assert auto[0][0][0] != block[0][0][0]                              # another kernel (t4 / block)


def test_in_place_calls_are_not_replayed_but_run(dev, unchecked):
    x, s = D((8, 64)), D((8,), ptr=0x7F0000100000)
    for _ in range(2):
        assert sf.fake_quantize(x, s, scope="token", out=x) is x
    assert dev.hits == 0 and len(dev.launches) == 2 and not replay.CACHE


def test_empty_inputs_are_not_remembered(dev):
    for _ in range(2):
        sf.quantize(D((0, 64)), 0.5, scope="tensor")
        sf.dynamic_quantize(D((0, 64)), scope="token")
    assert not dev.launches and not replay.CACHE and dev.hits == 0


K = FakeFunction("k", 0)       # a kernel of the fake device (bound by a remembered call, never launched here)
ABI = Abi("test", [("x", "ptr"), ("x_rs", "i64"), ("q", "ptr"), ("q_rs", "i64"), ("scale", "ptr"),
                   ("scale_value", "f32"), ("zero_point", "ptr"), ("zp_value", "i32")])


def test_a_pointer_slot_that_matches_nothing_is_not_remembered(dev):
    """A launch parameter that is neither an argument nor an allocation (here, an offset pointer)
    would be replayed stale: the call is not remembered."""
    call = replay.Recording(QUANTIZE, ("tensor",), (D((8, 64)), 0.5, None, None))
    with call:
        prep = launch_mod.PreparedLaunch(K, (1,), (1,), ABI, [D((8, 64)).ptr + 64, 64, 0, 64, 0, 0.5, 0, 0])
        call.add_launch(prep, arrays.as_array(D((8, 64)), "x"), params=("scale_value", "zp_value"))
        call.remember(None)
    assert not replay.CACHE


def test_a_misnamed_scalar_slot_is_not_remembered(dev):
    x = D((8, 64))
    call = replay.Recording(QUANTIZE, ("tensor",), (x, 0.5, None, None))
    with call:
        out = arrays.empty(arrays.as_array(x, "x"), (8, 64), "s8")
        prep = launch_mod.PreparedLaunch(K, (1,), (1,), ABI, [x.ptr, 64, out.ptr, 64, 0, 0.5, 0, 0])
        call.add_launch(prep, arrays.as_array(x, "x"), params=("scale", "zp_value"))     # the scale *pointer*
        call.remember(out)
    assert not replay.CACHE
    with call:
        out = arrays.empty(arrays.as_array(x, "x"), (8, 64), "s8")
        prep = launch_mod.PreparedLaunch(K, (1,), (1,), ABI, [x.ptr, 64, out.ptr, 64, 0, 0.5, 0, 0])
        call.add_launch(prep, arrays.as_array(x, "x"), params=("scale_value", "zp_value"))
        call.remember(out)
    assert len(replay.CACHE) == 1


def test_unknown_array_types_have_no_replay():
    assert replay.describe(np.zeros(4)) == (None, None)
    assert replay.describe(FakeDeviceArray((4,))) == (None, None)     # __cuda_array_interface__: the full path
    assert replay.describe(True) == (None, None)
    assert replay.Recording(QUANTIZE, ("tensor",), (np.zeros(4), 0.5, None, None)).key is None


def test_sync_checks_nests_and_decorates():
    from runtime import config
    assert not config.sync_checks_on()
    with sf.sync_checks():
        with sf.sync_checks(False):
            assert not config.sync_checks_on()
        assert config.sync_checks_on()
    assert not config.sync_checks_on()

    @sf.sync_checks()
    def f():
        return config.sync_checks_on()
    assert f() is True and not config.sync_checks_on()


def test_launches_pass_the_devices_status_word(dev):
    for call in (lambda d: sf.quantize(d.a((8, 64)), d.a((8,)), scope="token"),
                 lambda d: sf.dequantize(d.a((8, 64), "int8"), 0.5, scope="tensor")):
        launches, _ = _run(dev, call, 0x7F0000000000)
        assert launches[-1][4][-1] == status.pointer(0) and launches[-1][3][-1] == "Q"
    # dynamic_quantize's own scales need no check: its static pass gets a null status pointer
    launches, _ = _run(dev, lambda d: sf.dynamic_quantize(d.a((64, 256)), scope="tensor"), 0x7F1000000000)
    assert all(not status.is_status_pointer(v) for launch in launches if launch[0] != "memset" for v in launch[4])


def test_pointer_counter_is_unique():
    d = FakeDevice().at(0x1000)
    ptrs = [d.a((n,)).ptr for n in (1, 100, 1000)] + [d.new((5,), "f32").ptr]
    assert len(set(ptrs)) == len(ptrs) and all(p % 256 == 0 for p in ptrs)


@pytest.mark.parametrize("name, want", [("b256", ((132, 4), (256, 1))), ("b256-1d", ((528, 1), (256, 1))),
                                        ("b256-full", ((2048, 4), (256, 1))), ("b128", ((66, 8), (128, 1))),
                                        ("b128-full", ((2048, 8), (128, 1)))])
def test_columns_layout_grid(dev, override_settings, name, want):
    """Group scope on (8192, 8192) f16 (VEC 8, U 4) under each elementwise schedule: 256 threads and a
    persistent 2-D grid (default): 8192 / (256 * 8) = 4 column blocks in y and resident / 4 row blocks
    in x (resident: 132 SMs x 4 blocks, the fixture), so a thread owns one column vector; 1d: one block
    covers the row, threads loop over columns; full: a block per step of U rows (8192 / 4)."""
    override_settings(schedule=name)
    dev.at(0x7F0000000000).launches = []
    sf.quantize(dev.a((8192, 8192), "float16"), dev.a((8192, 64)), scope="group", group_size=128)
    (fn, grid, block, fmt, values), = dev.launches
    assert (grid, block) == want


def test_the_schedule_is_chosen_once_per_shape_and_not_on_a_replay(dev, monkeypatch):
    """The tuning table is read when a launch is prepared; a repeated call replays the prepared launch
    and does not choose again."""
    from runtime import tuning
    chosen = []
    real = tuning.choose
    monkeypatch.setattr(tuning, "choose", lambda *a: chosen.append(a[1]) or real(*a))
    x, scale = dev.a((64, 4096), "float16"), dev.a((64, 32))
    for _ in range(3):
        sf.quantize(x, scale, scope="group", group_size=128)
    assert chosen == [64 * 4096]
    sf.quantize(dev.a((16, 4096), "float16"), dev.a((16, 32)), scope="group", group_size=128)
    assert chosen == [64 * 4096, 16 * 4096]


def test_unknown_schedule_is_a_typed_error(dev, override_settings):
    override_settings(schedule="b999")
    with pytest.raises(sf.InvalidProblemError, match="SKUFORGE_SCHEDULE='b999'.*b128"):
        sf.quantize(dev.a((16, 256), "float16"), 1.0, scope="tensor")


@pytest.mark.parametrize("op, arg", [("quantize", "scale"), ("fake_quantize", "zero_point"),
                                     ("grouped_matmul_backward_weight", "offsets")])
def test_a_reported_value_raises_once_at_the_next_call(dev, op, arg):
    """What a kernel wrote to the status word raises at the next call on that device, on the slow
    path and on a replay, names the op and argument, and is cleared."""
    call = CALLS["quantize token"][0]
    _run(dev, call, 0x7F0000000000)
    for base in (0x7F1000000000, 0x7F2000000000):       # a replay, then the full path
        if base == 0x7F2000000000:
            replay.CACHE.clear()
        status.words().words[0] = status.code(op, arg)
        with pytest.raises(status.DeviceValueError) as e:
            _run(dev, call, base)
        assert (e.value.op, e.value.arg, e.value.device) == (op, arg, 0)
        assert op in str(e.value) and arg in str(e.value) and "cuda:0" in str(e.value)
        assert isinstance(e.value, sf.InvalidProblemError)
        assert status.words().words[0] == 0
        _run(dev, call, base)                             # reported once: the next call runs


def test_status_codes_decode():
    seen = set()
    for op in status.OPS:
        for arg in status.ARGS:
            c = status.code(op, arg)
            assert c and c not in seen and status.decode(c) == (op, arg)
            seen.add(c)


def test_numpy_scalar_scale_is_a_scalar(dev):
    """A NumPy scalar scale is a Python-number scale (not an array to inspect for e8m0 codes)."""
    launches, _ = _run(dev, lambda d: sf.quantize(d.a((8, 64)), np.float32(0.5), scope="tensor"), 0x7F0000000000)
    (fn, grid, block, fmt, values), = launches
    assert 0.5 in values


def fake_bind_graph(dev, graphs_used, capturing=()):
    """runtime.graphs.bind_graph over ``dev``: a graph launch launches its kernels on ``dev``, one
    state per stream (``capturing``: streams without one)."""
    def bind(preps):
        states = {}

        def go(stream, *values):
            graphs_used.append(len(values))
            assert len(values) == len(preps)
            for p, v in zip(preps, values):
                dev.launch(p.fn, p.grid, p.block, p.abi.fmt, list(v), stream, p.shared_mem)

        def with_work(make, values_of):
            def launch(stream, vals, news):
                if stream in capturing:
                    return graphs.CAPTURING
                work = states.get(stream)
                if work is None:
                    work = make(stream)
                    if work is None:
                        return graphs.MISALIGNED
                    states[stream] = work
                go(stream, *values_of(vals, news, work))
                return graphs.LAUNCHED
            return launch

        def one_by_one(stream, *values):
            for p, v in zip(preps, values):
                dev.launch(p.fn, p.grid, p.block, p.abi.fmt, list(v), stream, p.shared_mem)
        go.with_work, go.one_by_one = with_work, one_by_one
        return go
    return bind


@pytest.mark.parametrize("name", list(CALLS))
def test_a_replay_of_several_launches_is_one_graph_launch(dev, monkeypatch, name):
    """Where the driver makes graphs (runtime/graphs.py), a replay launches its kernels as one graph
    with each kernel's values re-filled; a replay that re-runs a launcher does not."""
    graphs_used = []
    monkeypatch.setattr(replay_code, "bind_graph", fake_bind_graph(dev, graphs_used))
    call, _ = CALLS[name]
    fast = replay_matches_full_path(dev, call)
    (entry,) = replay.CACHE.values()          # remembered again by the last (slow) call
    prepared = 0 if entry.runner is not None else len(entry.launches)
    if prepared:
        assert graphs_used == [prepared], "the replay went as one graph of all its launches"
        assert len(fast[0]) == prepared
    else:
        assert graphs_used == []


@pytest.mark.parametrize("capturing", [False, True])
def test_a_graph_replays_work_arrays_are_kept_per_stream(dev, monkeypatch, capturing):
    """The allocations a call does not return (LSQ's partial sums, MoE's routing tables) are made once
    per stream for a graph replay and reused by every replay there; on a stream being captured,
    each replay makes new ones (the captured graph owns them). Returned arrays are always new."""
    monkeypatch.setattr(replay_code, "bind_graph", fake_bind_graph(dev, [], capturing=(7,) if capturing else ()))

    def call(d):
        return sf.fake_quantize_learnable_backward(d.a((9, 48)), d.a((9, 48)), d.a((48,)), d.a((48,), Z),
                                                   scope="channel", axis=1)
    replay_matches_full_path(dev, call)           # a hit launches what the full path launches
    (entry,) = replay.CACHE.values()
    assert len(entry.allocs) == 4                 # dx, ds, dz and the partial sums

    def ws_of(launches):
        (prep, template, slots), = [x for x in entry.launches if "ds_part" in x[0].abi.slot][:1]
        return launches[0][4][prep.abi.slot["ds_part"]]
    del dev.work[:]                               # (the entry remembered by the last slow call is new)
    runs = [_run(dev, call, base) for base in (0x7F8000000000, 0x7FC000000000, 0x7D0000000000)]
    ws = [ws_of(launches) for launches, _ in runs]
    outs = [ptrs for _, ptrs in runs]
    assert len(set(outs)) == 3                    # dx, ds, dz: new arrays every call
    if capturing:
        assert len(set(ws)) == 3                  # new partials under capture
        assert dev.work == []                     # from the framework: the captured graph owns them
    else:
        assert ws[1] == ws[2] == ws[0]            # one partials array for the stream
        # made once, for stream 7, outside the framework's allocator (whose blocks PyTorch may
        # hand to a CUDA graph pool that must hold only outputs)
        assert [stream for _, stream in dev.work] == [7]


@pytest.mark.parametrize("shape, kind", [((3, 5), "s8"), ((7,), "f32"), ((2, 0, 4), "bf16")])
def test_the_replay_allocator_makes_what_the_full_path_allocates_torch(shape, kind):
    # a replay's allocation (arrays.allocator) must give the caller exactly what runtime.arrays.empty
    # gives on the full path: dtype, shape, C-order strides, device
    torch = pytest.importorskip("torch")
    x = torch.empty((3, 5), dtype=torch.bfloat16)
    like = arrays.ArrayRef(x, x.data_ptr(), (3, 5), (5, 1), "bf16", 0, "torch")
    a, p = arrays.allocator(like, shape, kind)()
    b = arrays.empty(like, shape, kind)
    assert (a.dtype, a.shape, a.stride(), a.device, a.requires_grad) == \
        (b.dtype, b.shape, b.stride(), b.device, b.requires_grad)
    assert p == a.data_ptr() and type(a) is type(b)


def test_a_replay_allocates_strided_scales_as_the_full_path(dev):
    """The replay's allocator repeats a column-layout allocation (what the replayed launch's p_rs /
    p_gs address), for the scale and the zero point alike."""
    call = CALLS["dynamic_quantize group col_aligned asymmetric"][0]
    results = []
    for base in (0x7F0000000000, 0x7F4000000000):
        dev.at(base)
        results.append(call(dev))
    assert dev.hits == 1
    for q, s, z in results:
        for a in (s, z):
            assert [b // a.dtype.itemsize for b in a.__cuda_array_interface__["strides"]] == [1, 12]
    assert dev.allocs[-2:] == [((10, 4), "f32", (1, 12)), ((10, 4), "i32", (1, 12))]
