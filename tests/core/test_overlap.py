"""out= never overlaps what the call reads or writes, except as exactly the same array (CPU).

Every op with an out= argument: an output may be exactly one of its data inputs (the same
pointer, shape, strides and dtype) where the op is elementwise and keeps the dtype (the
straight-through backward passes, fake quantization, LSQ's dx); any other shared byte, a partial
overlap, an overlap with a scale or zero point, or between two outputs, is an InvalidProblemError
naming both arguments, before anything is launched. A replay (same layouts, other addresses)
makes the same test (runtime/params.py check_apart, runtime/replay.py require_disjoint).
"""
import pytest

import runtime as sf
from runtime import replay
from runtime.arrays import as_array
from runtime.params import same_array
from tests.fakes import D, err
from tests.core.test_replay import dev  # noqa: F401  (dev: a fixture)
from tests.moe.test_moe_replay import mdev  # noqa: F401  (mdev: a fixture)

X0, S0, Z0, O0, G0 = 0x7F0000000000, 0x7F0001000000, 0x7F0002000000, 0x7F0003000000, 0x7F0004000000
SHAPE = (8, 64)


def _static(op, out, x=None, scale=None, zp=None, dy=None, **kw):
    """Call ``op`` on an (8, 64) float32 problem (per-token scales) with ``out``."""
    x = x or D(SHAPE, ptr=X0)
    scale = scale or D((8,), ptr=S0)
    dy = dy or D(SHAPE, ptr=G0)
    if op == "quantize":
        return sf.quantize(x, scale, zp, scope="token", out=out, **kw)
    if op == "dequantize":
        return sf.dequantize(D(SHAPE, "int8", ptr=X0), scale, zp, scope="token", out=out, **kw)
    if op == "dequantize_backward":
        return sf.dequantize_backward(dy, scale, scope="token", out=out, **kw)
    if op == "fake_quantize":
        return sf.fake_quantize(x, scale, zp, scope="token", out=out, **kw)
    fn = {"quantize_backward": sf.quantize_backward, "fake_quantize_backward": sf.fake_quantize_backward,
          "fake_quantize_learnable_backward": sf.fake_quantize_learnable_backward}[op]
    return fn(dy, x, scale, zp, scope="token", out=out, **kw)


OUT_KIND = {"quantize": "int8", "dequantize": "float32", "quantize_backward": "float32",
            "dequantize_backward": "float32", "fake_quantize": "float32", "fake_quantize_backward": "float32",
            "fake_quantize_learnable_backward": "float32"}
# the data inputs an op's out may be exactly (elementwise, same dtype)
IN_PLACE = {"quantize": (), "dequantize": (), "quantize_backward": ("dy", "x"), "dequantize_backward": ("dy",),
            "fake_quantize": ("x",), "fake_quantize_backward": ("dy", "x"),
            "fake_quantize_learnable_backward": ("dy", "x")}
STATIC_OPS = list(OUT_KIND)


def _first(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.parametrize("op", STATIC_OPS)
def test_separate_out_runs(dev, op):
    out = D(SHAPE, OUT_KIND[op], ptr=O0)
    assert _first(_static(op, out)) is out
    assert dev.launches


@pytest.mark.parametrize("op", STATIC_OPS)
def test_out_partly_over_the_data_input_is_an_error(dev, op):
    data = "q" if op == "dequantize" else ("dy" if op == "dequantize_backward" else "x")
    base = G0 if data == "dy" else X0
    err(lambda: _static(op, D(SHAPE, OUT_KIND[op], ptr=base + 256)), sf.InvalidProblemError,
        f"out overlaps {data}", op, "separate arrays")
    assert not dev.launches


@pytest.mark.parametrize("op", STATIC_OPS)
def test_out_over_the_scale_or_zero_point_is_an_error(dev, op):
    # out starts 256 bytes before the per-token scale (8 float32)
    err(lambda: _static(op, D(SHAPE, OUT_KIND[op], ptr=S0 - 256)), sf.InvalidProblemError, "out overlaps scale")
    if op != "dequantize_backward":
        zp = D((8,), "int32", ptr=Z0)
        err(lambda: _static(op, D(SHAPE, OUT_KIND[op], ptr=Z0 - 16), zp=zp), sf.InvalidProblemError,
            "out overlaps zero_point")
    assert not dev.launches


@pytest.mark.parametrize("op", [op for op in STATIC_OPS if IN_PLACE[op]])
def test_out_may_be_exactly_an_input_of_an_elementwise_op(dev, op):
    for name in IN_PLACE[op]:
        base = G0 if name == "dy" else X0
        out = D(SHAPE, ptr=base)
        assert _first(_static(op, out)) is out
    assert len(dev.launches) >= len(IN_PLACE[op])


@pytest.mark.parametrize("op", [op for op in STATIC_OPS if IN_PLACE[op]])
def test_same_pointer_another_layout_is_not_in_place(dev, op):
    name = IN_PLACE[op][0]
    base = G0 if name == "dy" else X0
    # the same first byte, rows 128 elements apart: out covers other bytes than the input
    err(lambda: _static(op, D(SHAPE, strides=(128, 1), ptr=base)), sf.InvalidProblemError,
        f"out overlaps {name}", f"out may be exactly {name}")
    assert not dev.launches


def test_inputs_may_overlap_each_other(dev):
    """Only pairs with an output are tested: x and dy may be one array, the scale inside x."""
    x = D(SHAPE, ptr=X0)
    out = D(SHAPE, ptr=O0)
    assert sf.fake_quantize_backward(x, x, D((8,), ptr=X0 + 64), scope="token", out=out) is out


def test_empty_arrays_overlap_nothing(dev):
    out = D((0, 64), ptr=X0)
    assert sf.fake_quantize(D((0, 64), ptr=X0 + 4), 0.5, scope="tensor", out=out) is out


@pytest.mark.parametrize("op", STATIC_OPS)
def test_a_replay_repeats_the_test(dev, op):
    """A call remembered with a separate out=, then the same layouts with out over the input: the
    replay refuses, the full path raises; exactly in place (where allowed) runs, unremembered."""
    _static(op, D(SHAPE, OUT_KIND[op], ptr=O0))
    _static(op, D(SHAPE, OUT_KIND[op], ptr=O0 + 0x10000))
    hits = dev.hits
    assert hits == 1 and len(replay.CACHE) == 1
    err(lambda: _static(op, D(SHAPE, OUT_KIND[op], ptr=S0 - 256)), sf.InvalidProblemError, "out overlaps scale")
    assert dev.hits == hits
    for name in IN_PLACE[op]:
        out = D(SHAPE, ptr=G0 if name == "dy" else X0)
        assert _first(_static(op, out)) is out
    assert dev.hits == hits and len(replay.CACHE) == 1


def test_lowbit_and_mx_outputs(dev):
    x = D(SHAPE, "float16", ptr=X0)
    # packed int4 codes: (8, 32) bytes; inside x's 1 KiB
    err(lambda: sf.quantize(x, 0.5, scope="tensor", out_dtype="int4", out=D((8, 32), "uint8", ptr=X0 + 512)),
        sf.InvalidProblemError, "out overlaps x")
    e8 = D((8, 2), "uint8", ptr=S0)
    q = D(SHAPE, "uint8", ptr=X0)
    err(lambda: sf.dequantize(q, e8, scope="group", group_size=32, in_dtype="fp8_e4m3", scale_dtype="e8m0",
                              out_dtype="float16", out=D(SHAPE, "float16", ptr=S0 - 2)),
        sf.InvalidProblemError, "out overlaps scale")


def test_dynamic_quantize_outputs_apart(dev):
    x = D((16, 512), "float16", ptr=X0)
    q, s, z = D((16, 512), "uint8", ptr=O0), D((16,), ptr=S0), D((16,), "int32", ptr=Z0)
    kw = dict(scope="token", mode="asymmetric", out_dtype="uint8")
    assert sf.dynamic_quantize(x, **kw, out=(q, s, z)) == (q, s, z)
    err(lambda: sf.dynamic_quantize(x, **kw, out=(q, s, D((16,), "int32", ptr=S0 + 32))), sf.InvalidProblemError,
        "out[1] (scale) overlaps out[2] (zero_point)")
    err(lambda: sf.dynamic_quantize(x, **kw, out=(D((16, 512), "uint8", ptr=X0 + 16384 - 1), s, z)),
        sf.InvalidProblemError, "out[0] (q) overlaps x")
    # codes over the start of x are not "in place": dynamic_quantize reads a whole row before it writes
    err(lambda: sf.dynamic_quantize(D((16, 512), ptr=X0), scope="token", out=(D((16, 512), "int8", ptr=X0), s)),
        sf.InvalidProblemError, "out[0] (q) overlaps x")


def test_moe_outputs_apart(mdev):
    x, w = D((32, 64), "float16", ptr=X0), D((4, 48, 64), "float16", ptr=S0)
    off = D((5,), "int32", ptr=Z0)
    err(lambda: sf.grouped_matmul(x, w, offsets=off, out=D((32, 48), "float16", ptr=S0 + 4096)),
        sf.InvalidProblemError, "out overlaps w")
    dy = D((32, 48), "float16", ptr=G0)
    err(lambda: sf.grouped_matmul_backward(x, w, dy, offsets=off, out=(D((32, 64), "float16", ptr=O0),
                                                                       D((4, 48, 64), "float32", ptr=O0 + 64))),
        sf.InvalidProblemError, "out[0] (dx) overlaps out[1] (dw)")


def test_same_array():
    a = as_array(D((8, 1), ptr=X0), "a")
    b = as_array(D((8, 1), strides=(1, 8), ptr=X0), "b")        # another stride on an axis of one element
    assert same_array(a, b)
    assert not same_array(a, as_array(D((8, 1), ptr=X0 + 4), "c"))
    assert not same_array(a, as_array(D((8, 1), "int32", ptr=X0), "d"))
    assert not same_array(a, as_array(D((1, 8), ptr=X0), "e"))
