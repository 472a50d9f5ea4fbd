"""GPU: the default path of every op never synchronizes, captures in a CUDA graph, and device-side
value checks poison the outputs and raise at the next call (runtime/status.py, docs/errors.md)."""
import math

import numpy as np
import pytest

import runtime as sf

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

NAN = float("nan")


@pytest.fixture(autouse=True)
def no_pending_report():
    """Each test starts and ends with a clear status word (a failed test must not leave a report
    for the next one's calls)."""
    from runtime import status
    torch.cuda.synchronize()
    words = status.words()
    if words.words is not None:
        words.words[0] = 0
    yield
    torch.cuda.synchronize()
    if words.words is not None:
        words.words[0] = 0


def _t(shape, dtype=torch.float32, lo=-4.0, hi=4.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.rand(shape, device="cuda", generator=g, dtype=torch.float32) * (hi - lo) + lo).to(dtype)


def _scales(n, seed=1):
    return _t((n,), lo=0.01, hi=0.05, seed=seed)


def _offsets(E, M):
    cuts = sorted(np.random.default_rng(3).integers(0, M + 1, E - 1).tolist())
    return torch.tensor([0] + cuts + [M], device="cuda", dtype=torch.int64)


# Every public op with device parameters on its default path: (name, call(tensors) -> outputs, inputs()).
def _inputs(seed=0):
    x = _t((64, 256), torch.bfloat16, seed=seed)
    return {
        "x": x, "x32": x.float(), "dy": _t((64, 256), seed=seed + 7), "s_tok": _scales(64, seed + 1),
        "s_chan": _scales(256, seed + 2), "s_grp": _scales(64 * 4, seed + 3).reshape(64, 4),
        "zp_grp": torch.full((64, 4), 7, device="cuda", dtype=torch.int32),
        "zp_chan": torch.full((256,), 100, device="cuda", dtype=torch.int32),
        "q8": _t((64, 256), seed=seed + 4, lo=-100, hi=100).round().to(torch.int8),
        "e8": torch.full((64, 8), 120, device="cuda", dtype=torch.uint8),
        "q_fp8": _t((64, 256), seed=seed + 5).to(torch.float8_e4m3fn),
        "xm": _t((96, 64), torch.bfloat16, seed=seed + 6), "w": _t((4, 32, 64), torch.bfloat16, seed=seed + 8),
        "dym": _t((96, 32), torch.bfloat16, seed=seed + 9), "off": _offsets(4, 96),
    }


OPS = {
    "quantize token": lambda a: sf.quantize(a["x"], a["s_tok"], scope="token"),
    "quantize group asymmetric": lambda a: sf.quantize(a["x"], a["s_grp"], a["zp_grp"], scope="group", group_size=64,
                                                       out_dtype="uint8", qmin=0, qmax=255),
    "quantize fp8 token": lambda a: sf.quantize(a["x"], a["s_tok"], scope="token", out_dtype="fp8_e4m3"),
    "quantize int4 channel": lambda a: sf.quantize(a["x32"], a["s_chan"], scope="channel", axis=1, out_dtype="int4"),
    "dequantize channel asymmetric": lambda a: sf.dequantize(a["q8"], a["s_chan"], a["zp_chan"] - 100, scope="channel",
                                                             axis=1, out_dtype="bfloat16"),
    "dequantize mx": lambda a: sf.dequantize(a["q_fp8"], a["e8"], scope="group", group_size=32, scale_dtype="e8m0"),
    "dynamic_quantize token s8": lambda a: sf.dynamic_quantize(a["x"], scope="token"),
    "dynamic_quantize fp8 group 128": lambda a: sf.dynamic_quantize(a["x"], scope="group", group_size=128,
                                                                    out_dtype="fp8_e4m3"),
    "dynamic_quantize mx": lambda a: sf.dynamic_quantize(a["x"], scope="group", group_size=32, out_dtype="fp8_e4m3",
                                                         scale_dtype="e8m0"),
    "dynamic_quantize tensor": lambda a: sf.dynamic_quantize(a["x"], scope="tensor"),
    "quantize_backward token": lambda a: sf.quantize_backward(a["dy"], a["x32"], a["s_tok"], scope="token"),
    "dequantize_backward token": lambda a: sf.dequantize_backward(a["dy"], a["s_tok"], scope="token"),
    "fake_quantize channel": lambda a: sf.fake_quantize(a["x32"], a["s_chan"], a["zp_chan"], scope="channel",
                                                        axis=1, qmin=0, qmax=255),
    "fake_quantize_backward token": lambda a: sf.fake_quantize_backward(a["dy"], a["x32"], a["s_tok"], scope="token"),
    "fake_quantize_learnable_backward channel": lambda a: sf.fake_quantize_learnable_backward(
        a["dy"], a["x32"], a["s_chan"], a["zp_chan"], scope="channel", axis=1, qmin=0, qmax=255),
    "grouped_matmul": lambda a: sf.grouped_matmul(a["xm"], a["w"], offsets=a["off"]),
    "grouped_matmul_backward": lambda a: sf.grouped_matmul_backward(a["xm"], a["w"], a["dym"], offsets=a["off"]),
}


def _flat(out):
    out = out if isinstance(out, tuple) else (out,)
    return [o for o in out if o is not None]


def _same(a, b):
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                  and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))


@pytest.mark.parametrize("name", list(OPS))
def test_default_call_never_synchronizes(name):
    a, b = _inputs(), _inputs(seed=11)
    OPS[name](a)                          # compiles and loads the kernels (may synchronize)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        OPS[name](a)
        OPS[name](b)                      # other data, same layout: the replay path where there is one
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sf.check()


@pytest.mark.parametrize("name", list(OPS))
def test_default_call_captures_in_a_cuda_graph(name):
    a = _inputs()
    OPS[name](a)                          # warm-up outside the capture (module loads)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = _flat(OPS[name](a))
    fresh = _inputs(seed=5)
    for k, v in a.items():                # new data into the captured inputs
        v.copy_(fresh[k])
    g.replay()
    torch.cuda.synchronize()
    want = _flat(OPS[name](a))
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert _same(x, y), name
    sf.check()


# -- planted bad values: poisoned outputs, no sync, a typed error at the next call -----------------
def _poison_rows(out, rows, integer_poison):
    """Rows `rows` of out hold the poison: NaN (floats, fp8) or integer_poison (integer codes)."""
    r = out[rows]
    if out.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return bool(r.float().isnan().all())
    if out.is_floating_point():
        return bool(r.isnan().all())
    return bool((r.to(torch.int32) == integer_poison).all())


BAD = {
    # name: (call on inputs, key of the device parameter, index of the bad element, arg, bad value,
    #        rows of the output it poisons, integer poison); the op is the name's first word
    "quantize token, scale": (OPS["quantize token"], "s_tok", 5, "scale", NAN, [5], -128),
    "quantize token, zero scale": (OPS["quantize token"], "s_tok", 9, "scale", 0.0, [9], -128),
    "quantize group, zero point": (OPS["quantize group asymmetric"], "zp_grp", (3, 0), "zero_point", 300, None, 0),
    "quantize fp8, scale": (OPS["quantize fp8 token"], "s_tok", 2, "scale", -1.0, [2], None),
    "dequantize channel, zero point": (lambda a: sf.dequantize(a["q8"], a["s_tok"], a["zp_grp"][:, 0] - 7,
                                                               scope="token", out_dtype="float32"),
                                       "zp_grp", (4, 0), "zero_point", 1000, [4], None),
    "dequantize mx, code 255": (OPS["dequantize mx"], "e8", (6, 0), "scale", 255, None, None),
    "quantize_backward, scale": (OPS["quantize_backward token"], "s_tok", 1, "scale", math.inf, [1], None),
    "dequantize_backward, scale": (OPS["dequantize_backward token"], "s_tok", 0, "scale", NAN, [0], None),
    "fake_quantize_backward, scale": (OPS["fake_quantize_backward token"], "s_tok", 3, "scale", 0.0, [3], None),
}


@pytest.mark.parametrize("name", list(BAD))
def test_planted_bad_value_poisons_and_raises_at_the_next_call(name):
    call, key, idx, arg, value, rows, int_poison = BAD[name]
    a = _inputs()
    good = _flat(call(a))
    torch.cuda.synchronize()
    sf.check()
    a[key][idx] = value
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _flat(call(a))              # no error here, no sync: the kernel checks the value
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    out, ref = got[0], good[0]
    if rows is not None:
        assert _poison_rows(out, rows, int_poison), f"{name}: the poison"
        keep = [r for r in range(out.shape[0]) if r not in rows]
        assert _same(out[keep], ref[keep]), f"{name}: other rows unchanged"
    elif key == "zp_grp":                 # group (3, 0): row 3, its first 64 columns -> qmin = 0
        assert bool((out[3, :64] == 0).all()) and _same(out[3, 64:], ref[3, 64:]) and _same(out[:3], ref[:3])
    else:                                 # mx group (6, 0): row 6, its first 32 columns -> NaN
        assert bool(out[6, :32].isnan().all()) and _same(out[6, 32:], ref[6, 32:])
    with pytest.raises(sf.DeviceValueError) as e:
        call(a)                           # the next call on the device reports it
    opname = name.split()[0].rstrip(",")
    assert e.value.arg == arg and e.value.op == opname and e.value.device == 0
    assert isinstance(e.value, sf.InvalidProblemError)
    torch.cuda.synchronize()
    sf.check()                            # reported once: nothing left
    a[key][idx] = 1 if key in ("zp_grp",) else (120 if key == "e8" else 0.02)
    assert all(_same(x, y) or True for x, y in zip(_flat(call(a)), good))


# The dequantize ops' row-vectors layout (schedules r256 / r128, group and channel on the last axis):
# each element's parameters are its own, so a bad one poisons exactly the elements it governs, and
# the rest equal the columns layout's output. (name: call, key, index, arg, bad value, poisoned
# elements as (rows, columns))
ROW_VECTORS = {
    "dequantize group, scale": (lambda a: sf.dequantize(a["q8"], a["s_grp"], scope="group", group_size=64,
                                                        out_dtype="bfloat16"),
                                "s_grp", (5, 2), "scale", NAN, (slice(5, 6), slice(128, 192))),
    "dequantize group, zero point": (lambda a: sf.dequantize(a["q8"], a["s_grp"], a["zp_grp"], scope="group",
                                                             group_size=64, out_dtype="float32"),
                                     "zp_grp", (9, 1), "zero_point", 1000, (slice(9, 10), slice(64, 128))),
    "dequantize channel, scale": (lambda a: sf.dequantize(a["q8"], a["s_chan"], a["zp_chan"] - 100, scope="channel",
                                                          axis=1, out_dtype="bfloat16"),
                                  "s_chan", 37, "scale", 0.0, (slice(None), slice(37, 38))),
    "dequantize_backward group, scale": (lambda a: sf.dequantize_backward(a["dy"], a["s_grp"], scope="group",
                                                                          group_size=64),
                                         "s_grp", (0, 3), "scale", -1.0, (slice(0, 1), slice(192, 256))),
    "dequantize_backward channel, scale": (lambda a: sf.dequantize_backward(a["dy"], a["s_chan"], scope="channel",
                                                                            axis=1),
                                           "s_chan", 255, "scale", math.inf, (slice(None), slice(255, 256))),
}


@pytest.mark.parametrize("schedule", ["r256", "r128"])
@pytest.mark.parametrize("name", list(ROW_VECTORS))
def test_row_vectors_layout_poisons_only_the_bad_elements(name, schedule):
    from runtime.config import override
    call, key, idx, arg, value, (rows, cols) = ROW_VECTORS[name]
    a = _inputs()
    columns = _flat(call(a))[0]                 # the default schedule at this size: the columns layout
    with override(schedule=schedule):
        assert _same(_flat(call(a))[0], columns), f"{name}: {schedule} against the columns layout"
        torch.cuda.synchronize()
        sf.check()
        a[key][idx] = value
        out = _flat(call(a))[0]
        torch.cuda.synchronize()
        want = columns.clone()
        want[rows, cols] = float("nan")
        assert _same(out, want), f"{name}: {schedule} poisons exactly the governed elements"
        with pytest.raises(sf.DeviceValueError) as e:
            call(a)
        assert e.value.arg == arg and e.value.op == name.split()[0]
        torch.cuda.synchronize()
        sf.check()


def test_check_is_the_explicit_check_point():
    a = _inputs()
    a["s_tok"][0] = NAN
    sf.quantize(a["x"], a["s_tok"], scope="token")
    with pytest.raises(sf.DeviceValueError):
        sf.check()                        # synchronizes, then reports
    sf.check()


def test_sync_checks_raise_at_the_call_itself():
    a = _inputs()
    a["s_tok"][0] = NAN
    with sf.sync_checks():
        with pytest.raises(sf.InvalidProblemError, match="scale"):
            sf.quantize(a["x"], a["s_tok"], scope="token")
    sf.check()                            # nothing was launched


def test_cupy_arrays_report_too():
    cp = pytest.importorskip("cupy")
    x = cp.asarray(np.random.default_rng(0).standard_normal((32, 128), dtype=np.float32))
    s = cp.full((32,), 0.05, cp.float32)
    s[7] = 0
    q = sf.quantize(x, s, scope="token")
    cp.cuda.Device().synchronize()
    assert bool((q[7] == -128).all())
    with pytest.raises(sf.DeviceValueError, match="quantize: scale"):
        sf.quantize(x, s, scope="token")
    cp.cuda.Device().synchronize()
    sf.check()
