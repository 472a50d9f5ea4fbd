"""Training ops (docs/training.md), CPU: the NumPy reference by hand, the LSQ summation order, the matrix
cells, and every bad input's typed error before any launch."""
import importlib.util
import itertools
import re

import ml_dtypes
import numpy as np
import pytest

import runtime as sf
from runtime import InvalidProblemError, UnsupportedError
from runtime import reference as ref
from tests.fakes import FakeDeviceArray
from tests.fakes import err

_addresses = itertools.count()


def D(shape, dtype="float32", strides=None, ptr=None):
    """A fake device array at its own address (a given out= must not overlap the inputs)."""
    if ptr is None:
        ptr = 0x7E0000000000 + next(_addresses) * 0x1000000
    return FakeDeviceArray(shape, dtype, strides, ptr)


F32 = np.float32
OPS = ("quantize_backward", "dequantize_backward", "fake_quantize", "fake_quantize_backward",
       "fake_quantize_learnable_backward")


# -- reference, by hand ---------------------------------------------------------------------------
def bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def test_fake_quantize_ties_saturation_and_specials():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 300.0, -300.0, np.inf, -np.inf, np.nan, 126.5, 127.5], F32)
    y, m = ref.fake_quantize(x, F32(1.0), None, scope="tensor", qmin=-128, qmax=127)
    want = np.array([0, 2, 2, 0, -2, 127, -128, 127, -128, np.nan, 126, 127], F32)
    np.testing.assert_array_equal(y, want)
    assert bits(y[3]) == 0  # rne(-0.5) = -0, + zp 0 = +0: PyTorch's result too
    np.testing.assert_array_equal(m, [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0])


def test_fake_quantize_asymmetric_and_scale():
    x = np.array([[0.0, 0.25, 1.0, -1.0], [0.125, 10.0, -10.0, 0.375]], F32)
    y, m = ref.fake_quantize(x, np.array([0.25, 0.5], F32), np.array([3, 0], np.int32), scope="token",
                             qmin=0, qmax=15)
    # row 0: v = x / 0.25 + 3 = [3, 4, 7, -1]; row 1: v = rne(x / 0.5) = [0 (0.25 -> 0), 20, -20, 1 (0.75)]
    np.testing.assert_array_equal(y, [[0.0, 0.25, 1.0, -0.75], [0.0, 7.5, 0.0, 0.5]])
    np.testing.assert_array_equal(m, [[1, 1, 1, 0], [1, 0, 0, 1]])


def test_symmetric_zero_points():
    assert ref.fake_quant_zero_point(-128, 127) == 0
    assert ref.fake_quant_zero_point(0, 255) == 128
    assert ref.fake_quant_zero_point(-127, 127) == 0
    # fake quant without a zero point on 0..255 centres on 128
    y, _ = ref.fake_quantize(np.array([0.0, 200.0], F32), F32(1.0), None, scope="tensor", qmin=0, qmax=255)
    np.testing.assert_array_equal(y, [0.0, 127.0])


def test_quantize_backward_uses_quantize_values():
    x = np.array([-129.0, -128.4, 126.6, 127.5, 127.4, np.nan, np.inf], F32)
    dy = np.array([1, -2, 3, -4, 5, 6, 7], F32)
    dx = ref.quantize_backward(dy, x, F32(1.0), None, scope="tensor", out_dtype="s8")
    np.testing.assert_array_equal(dx, [0, -2, 3, -0.0, 5, 0, 0])
    assert bits(dx[3]) == bits(F32(-0.0))      # dy * 0 with dy < 0: -0, like PyTorch's dY * mask
    # uint8, symmetric: implied zero point 128
    dx = ref.quantize_backward(np.ones(3, F32), np.array([-129.0, -128.0, 127.6], F32), F32(1.0), None,
                               scope="tensor", out_dtype="u8")
    np.testing.assert_array_equal(dx, [0, 1, 0])
    # asymmetric + explicit range
    dx = ref.quantize_backward(np.ones(3, F32), np.array([-5.0, -4.0, 4.0], F32), F32(1.0), np.int32(2),
                               scope="tensor", out_dtype="s8", qmin=-2, qmax=5)
    np.testing.assert_array_equal(dx, [0, 1, 0])


def test_fake_quantize_backward_nan_gradient():
    dx = ref.fake_quantize_backward(np.array([np.nan, np.inf, 2.0], F32), np.array([1000.0, 1000.0, 1000.0], F32),
                                    F32(1.0), None, scope="tensor")
    assert np.isnan(dx[0]) and np.isnan(dx[1]) and dx[2] == 0   # a product, not a select


def test_mask_bits_are_numpy_packbits_little_endian():
    """Bit j of byte b of a row is element 8b + j of that row; the last byte of a ragged row is padded with 0."""
    m = np.array([[1, 0, 1, 1, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 0, 1, 0]], bool)
    packed = ref.pack_mask_bits(m)
    assert packed.dtype == np.uint8 and packed.tolist() == [[0b00001101, 1], [0b10000000, 0]]
    assert np.array_equal(ref.unpack_mask_bits(packed, 9), m)
    assert ref.pack_mask_bits(np.ones((3, 2, 16), bool)).tolist() == [[[255, 255]] * 2] * 3
    assert ref.pack_mask_bits(np.zeros((4, 0), bool)).shape == (4, 0)
    assert sf.quantization.training.mask_bits_shape((2, 3, 9)) == (2, 3, 2) and sf.quantization.training.mask_bits_shape((8,)) == (1,)


def test_backward_from_mask_is_the_product_with_the_bit():
    """dx = dy * bit: -0 for a negative dy where the bit is 0, NaN for a non-finite dy there, dy where it is 1;
    the same as fake_quantize_backward with the mask recomputed from x."""
    dy = np.array([[-2.0, 3.0, np.inf, -np.inf, np.nan, -0.0, 1.5, -1.0, 7.0]], F32)
    packed = np.array([[0b01000010, 0]], np.uint8)            # elements 1 and 6 pass
    dx = ref.fake_quantize_backward_from_mask(dy, packed)
    assert dx.dtype == np.float32
    assert bits(dx[0, [0, 5, 7]]).tolist() == [0x80000000] * 3 and dx[0, 8] == 0 and not np.signbit(dx[0, 8])
    assert np.isnan(dx[0, [2, 3, 4]]).all() and dx[0, 1] == 3.0 and dx[0, 6] == 1.5
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 21)) * 300).astype(np.float16)
    g = rng.standard_normal((6, 21)).astype(np.float16)
    _, mask = ref.fake_quantize(x, F32(0.5), None, scope="tensor")
    want = ref.fake_quantize_backward(g, x, F32(0.5), None, scope="tensor")
    assert np.array_equal(bits(ref.fake_quantize_backward_from_mask(g, ref.pack_mask_bits(mask))), bits(want))


def test_dequantize_backward_bf16():
    dy = np.array([[1.0, -3.0], [0.5, 7.0]], ml_dtypes.bfloat16)
    dq = ref.dequantize_backward(dy, np.array([0.1, 3.0], F32), scope="channel", axis=1)
    want = (dy.astype(F32) * np.array([0.1, 3.0], F32)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(dq.view(np.uint16), want.view(np.uint16))
    assert dq.dtype == ml_dtypes.bfloat16


def test_lsq_terms_by_hand():
    # scale 0.5, zp 1, range [-2, 3]: v = rne(2x) + 1
    x = np.array([-10.0, -1.3, 0.3, 0.7, 10.0], F32)
    dy = np.array([1.0, 2.0, 3.0, 4.0, 5.0], F32)
    s, zp, g = F32(0.5), np.int32(1), 0.5
    dx, ds, dz = ref.lsq_terms(dy, x, s, zp, scope="tensor", qmin=-2, qmax=3, grad_factor=g)
    v = np.rint(x * F32(2.0)) + 1                         # [-19, -2, 2, 2, 21]
    np.testing.assert_array_equal(v, [-19, -2, 2, 2, 21])
    np.testing.assert_array_equal(dx, [0, 2, 3, 4, 0])
    xfq = (np.clip(v, -2, 3) - 1) * s                    # [., -1.5, 0.5, 0.5, .]
    want_ds = [1.0 * (-2 - 1) * g,
               ((F32(2.0) * (F32(-1.5) - F32(-1.3))) * F32(2.0)) * F32(g),
               ((F32(3.0) * (F32(0.5) - F32(0.3))) * F32(2.0)) * F32(g),
               ((F32(4.0) * (F32(0.5) - F32(0.7))) * F32(2.0)) * F32(g),
               5.0 * (3 - 1) * g]
    np.testing.assert_array_equal(ds, np.array(want_ds, F32))
    np.testing.assert_array_equal(dz, np.array([-1.0 * 0.5 * g, 0, 0, 0, -5.0 * 0.5 * g], F32))
    assert xfq[1] == -1.5


def test_lsq_team_sum_order():
    # 8 float32 elements, vec 4: team = 2 lanes, lane 0 adds e0..e3, lane 1 e4..e7, then lane0 + lane1
    e = np.array([1e8, 1.0, -1e8, 1.0, 3.0, 1e8, 1.0, -1e8], F32)
    lane0 = ((((F32(0) + e[0]) + e[1]) + e[2]) + e[3])
    lane1 = ((((F32(0) + e[4]) + e[5]) + e[6]) + e[7])
    got = ref.lsq_team_sum(e, 4)
    assert got == lane0 + lane1 and got != np.sum(e, dtype=np.float64)
    assert ref.lsq_team(1) == 1 and ref.lsq_team(5) == 8 and ref.lsq_team(10**6) == 256


def test_lsq_lane_tree_order():
    # 64 lanes: tree over 32 lanes within each warp, then warp 0 + warp 1
    rng = np.random.default_rng(0)
    acc = (rng.standard_normal(64) * 10.0 ** rng.integers(-6, 6, 64)).astype(F32)
    w = []
    for k in range(2):
        s = acc[32 * k:32 * k + 32]
        while s.size > 1:
            s = s[:s.size // 2] + s[s.size // 2:]
        w.append(s[0])
    got = ref.lsq_team_sum(acc, 1)    # team 64, one element per lane
    assert bits(got) == bits(F32(w[0] + w[1]))


@pytest.mark.parametrize("case", [
    ("tensor", (7, 33), None, None), ("token", (4, 5, 37), None, None), ("group", (6, 96), None, 12),
    ("group", (3, 40), None, 5), ("channel", (70, 9), 1, None), ("channel", (3, 6, 5, 7), 1, None),
    ("channel", (40, 17), 0, None), ("channel", (2, 3, 4, 5, 6), -1, None), ("channel", (5,), 0, None)])
def test_lsq_reduce_sums_the_right_elements(case):
    """With small integers every order gives the exact sum: the reduction picks the right elements."""
    scope, shape, axis, gs = case
    t = np.random.default_rng(1).integers(-50, 50, shape).astype(F32)
    got = ref.lsq_reduce(t, shape, scope, axis, gs, vec=4)
    nd = len(shape)
    if scope == "tensor":
        want = t.sum()
    elif scope == "token":
        want = t.sum(-1)
    elif scope == "group":
        want = t.reshape(shape[:-1] + (shape[-1] // gs, gs)).sum(-1)
    else:
        want = t.sum(axis=tuple(i for i in range(nd) if i != axis % nd))
    np.testing.assert_array_equal(got, want)
    assert got.shape == np.shape(want)


def test_lsq_reference_dtypes_and_shapes():
    x = np.linspace(-3, 3, 2 * 3 * 8).reshape(2, 3, 8).astype(np.float64)
    dy = np.ones_like(x)
    dx, ds, dz = ref.fake_quantize_learnable_backward(dy, x, np.full(3, 0.1), np.zeros(3, np.int32),
                                                      scope="channel", axis=1, qmin=-8, qmax=7)
    assert dx.dtype == np.float64 and ds.dtype == np.float64 and dz.dtype == np.float32
    assert ds.shape == (3,) and dz.shape == (3,)
    _, ds, dz = ref.fake_quantize_learnable_backward(dy.astype(F32), x.astype(F32), F32(0.1), None,
                                                     scope="tensor", qmin=-8, qmax=7)
    assert dz is None and ds.shape == () and ds.dtype == F32


def test_lsq_reduce_is_close_to_float64_sum():
    rng = np.random.default_rng(2)
    t = rng.standard_normal((300, 1000)).astype(F32)
    got = ref.lsq_reduce(t, t.shape, "tensor", vec=4)
    assert abs(float(got) - t.astype(np.float64).sum()) < 1e-3


# -- the matrix --------------------------------------------------------------------------------------
def test_every_training_cell_is_generated():
    reg = sf.default_registry()
    for op in OPS:
        skus = reg.query(op=op)
        modes = (None,) if op == "dequantize_backward" else ("symmetric", "asymmetric")
        assert len(skus) == 4 * 4 * len(modes), op
        for s in skus:
            assert s.element == s.aux_element and s.element in ("f32", "f64", "f16", "bf16")
        assert {s.scope for s in skus} == {"tensor", "channel", "token", "group"}
    for s in reg.query(op="fake_quantize_learnable_backward"):
        entry = reg.lookup(s)
        assert entry.launch["kind"] == "lsq"
        assert entry.launch["finish"] == (s.scope in ("tensor", "channel"))
        assert s.precision.accumulator == s.precision.math and s.precision.deterministic
        src = reg.source(s)
        # no atomic operation (an atomic*() call or an inline atom. instruction); the header's
        # comments may name atomics
        assert re.search(r"\batomic\w*\s*\(|\batom\.", src) is None
        assert (s.symbol + "_finish(") in src or not entry.launch["finish"]
    fq = reg.lookup(reg.query(op="fake_quantize")[0])
    assert [o["kind"] for o in fq.launch["outs"]][1] == "u8" and fq.launch["nullable"] == ["mask"]


# -- bad input: typed errors before any launch --------------------------------------------------------
X = D((8, 64), "float32")


def test_gradient_shape_and_dtype():
    for fn in (sf.quantize_backward, sf.fake_quantize_backward, sf.fake_quantize_learnable_backward):
        err(lambda: fn(D((8, 63)), X, 0.1, scope="tensor"), InvalidProblemError, "dy", "(8, 63)", "(8, 64)")
        err(lambda: fn(D((8, 64), "float16"), X, 0.1, scope="tensor"), InvalidProblemError, "dy", "f16", "f32")
        err(lambda: fn(D((8, 64), "int8"), D((8, 64), "int8"), 0.1, scope="tensor"), UnsupportedError, "x", "s8")


def test_input_dtypes():
    err(lambda: sf.fake_quantize(D((8, 64), "int32"), 0.1, scope="tensor"), UnsupportedError, "x", "i32")
    err(lambda: sf.dequantize_backward(D((8, 64), "int8"), 0.1, scope="tensor"), UnsupportedError, "dy", "s8")
    err(lambda: sf.quantize_backward(X, X, 0.1, scope="tensor", out_dtype="int16"), InvalidProblemError,
        "out_dtype")
    err(lambda: sf.quantize_backward(X, X, 0.1, scope="tensor", out_dtype="float32"), UnsupportedError,
        "out_dtype", "s8, u8")


def test_scope_shapes():
    for fn in (lambda s, z=None, **k: sf.fake_quantize(X, s, z, **k),
               lambda s, z=None, **k: sf.fake_quantize_backward(X, X, s, z, **k),
               lambda s, z=None, **k: sf.fake_quantize_learnable_backward(X, X, s, z, **k),
               lambda s, z=None, **k: sf.quantize_backward(X, X, s, z, **k)):
        err(lambda: fn(D((7,)), scope="token"), InvalidProblemError, "scale", "(7,)", "(8,)")
        err(lambda: fn(D((8, 2)), scope="group", group_size=16), InvalidProblemError, "scale", "(8, 4)")
        err(lambda: fn(D((8,)), scope="channel", axis=1), InvalidProblemError, "scale", "(64,)")
        err(lambda: fn(D((8,)), D((8,), "int32"), scope="channel", axis=1), InvalidProblemError, "(64,)")
        err(lambda: fn(D((8,)), D((7,), "int32"), scope="token"), InvalidProblemError, "zero_point", "(7,)")
        err(lambda: fn(D((8,)), D((8,), "int64"), scope="token"), InvalidProblemError, "zero_point", "int32")
        err(lambda: fn(D((8,), "float64"), scope="token"), InvalidProblemError, "scale", "float32")
        err(lambda: fn(D((8,)), scope="group", group_size=10), InvalidProblemError, "group_size=10", "D=64")
        err(lambda: fn(D((8,)), scope="channel"), InvalidProblemError, "axis")
        err(lambda: fn(D((8,)), scope="row"), UnsupportedError, "scope", "tensor")
    err(lambda: sf.dequantize_backward(X, D((7,)), scope="token"), InvalidProblemError, "scale", "(8,)")


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_non_finite_or_non_positive_scale(bad):
    err(lambda: sf.fake_quantize(X, bad, scope="tensor"), InvalidProblemError, "scale")
    err(lambda: sf.fake_quantize_learnable_backward(X, X, bad, scope="tensor"), InvalidProblemError, "scale")
    err(lambda: sf.dequantize_backward(X, bad, scope="tensor"), InvalidProblemError, "scale")
    err(lambda: sf.quantize_backward(X, X, bad, scope="tensor"), InvalidProblemError, "scale")


def test_lsq_range_must_contain_zero():
    err(lambda: sf.fake_quantize_learnable_backward(X, X, 0.1, scope="tensor", qmin=1, qmax=255),
        InvalidProblemError, "qmin=1", "qmin <= 0 <= qmax")
    err(lambda: sf.fake_quantize_learnable_backward(X, X, 0.1, scope="tensor", qmin=-10, qmax=-1),
        InvalidProblemError, "qmax=-1", "qmin <= 0 <= qmax")
    for g in (float("nan"), 10**400, 1e39, -4e38):       # not finite, or beyond float32 (the kernel's parameter)
        err(lambda: sf.fake_quantize_learnable_backward(X, X, 0.1, scope="tensor", grad_factor=g),
            InvalidProblemError, "grad_factor")


def test_fake_quant_ranges_and_zero_points():
    err(lambda: sf.fake_quantize(X, 0.1, scope="tensor", qmin=5, qmax=5), InvalidProblemError, "qmin=5", "< qmax")
    err(lambda: sf.fake_quantize(X, 0.1, scope="tensor", qmin=0.5, qmax=5), InvalidProblemError, "qmin", "integer")
    err(lambda: sf.fake_quantize(X, 0.1, scope="tensor", qmin=-2**30, qmax=5), InvalidProblemError, "2**24")
    err(lambda: sf.fake_quantize(X, 0.1, 300, scope="tensor", qmin=0, qmax=255), InvalidProblemError,
        "zero_point=300", "[0, 255]")
    err(lambda: sf.fake_quantize_backward(X, X, 0.1, -1, scope="tensor", qmin=0, qmax=255), InvalidProblemError,
        "zero_point=-1")
    err(lambda: sf.quantize_backward(X, X, 0.1, scope="tensor", qmin=-200), InvalidProblemError, "qmin=-200")


def test_return_mask_takes_false_true_or_bits():
    for bad in ("bool", "BITS", 1, 0, None, np.bool_(True), b"bits"):
        err(lambda: sf.fake_quantize(X, 0.1, scope="tensor", return_mask=bad), InvalidProblemError,
            f"return_mask={bad!r}", "False", "True", "'bits'")


def test_backward_from_mask_arguments():
    fm = sf.fake_quantize_backward_from_mask
    bits8 = D((8, 8), "uint8")
    err(lambda: fm(D((8, 64), "int8"), bits8), UnsupportedError, "dy", "s8")
    err(lambda: fm(X, D((8, 8), "int8")), InvalidProblemError, "mask has dtype s8", "uint8")
    err(lambda: fm(X, D((8, 64), "uint8")), InvalidProblemError, "mask has shape (8, 64)", "(8, 8)")
    err(lambda: fm(D((8, 61)), D((8, 7), "uint8")), InvalidProblemError, "mask has shape (8, 7)", "(8, 8)")
    err(lambda: fm(D((2, 4, 9)), D((8, 2), "uint8")), InvalidProblemError, "mask has shape (8, 2)", "(2, 4, 2)")
    err(lambda: fm(X, D((8, 8), "uint8", strides=(1, 8))), InvalidProblemError, "mask", "contiguous")
    err(lambda: fm(D((8, 64), strides=(1, 8)), bits8), InvalidProblemError, "dy", "contiguous")
    err(lambda: fm(D(()), D((1,), "uint8")), InvalidProblemError, "dy is 0-d")
    err(lambda: fm(X, bits8, out=D((8, 64), "float16")), InvalidProblemError, "out")
    err(lambda: fm(np.zeros((8, 64), F32), bits8), InvalidProblemError, "dy", "host array")
    err(lambda: fm(X, np.zeros((8, 8), np.uint8)), InvalidProblemError, "mask", "host array")
    err(lambda: fm(X, bits8, out=D((8, 64), ptr=X.__cuda_array_interface__["data"][0] + 4)), InvalidProblemError,
        "out overlaps dy")


def test_output_arguments():
    err(lambda: sf.fake_quantize(X, 0.1, scope="tensor", out=D((8, 64), "float16")), InvalidProblemError, "out")
    err(lambda: sf.dequantize_backward(X, 0.1, scope="tensor", out=D((8, 32))), InvalidProblemError, "out")


def test_host_arrays():
    err(lambda: sf.fake_quantize(np.zeros((2, 2), F32), 0.1, scope="tensor"), InvalidProblemError, "host array")
    err(lambda: sf.fake_quantize_backward(np.zeros((2, 2), F32), D((2, 2)), 0.1, scope="tensor"),
        InvalidProblemError, "dy", "host array")


def test_non_collapsible_rows_are_refused():
    bad = D((4, 6, 8), strides=(100, 8, 1))   # rows of the two leading axes are not evenly spaced
    err(lambda: sf.fake_quantize(bad, 0.1, scope="tensor"), InvalidProblemError, "x")
    err(lambda: sf.fake_quantize(D((8, 64), strides=(1, 8)), 0.1, scope="tensor"), InvalidProblemError,
        "contiguous")


def test_torch_front_needs_torch():
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed: tested on the GPU")
    with pytest.raises(ImportError, match="torch"):
        import runtime.torch  # noqa: F401


def test_lsq_workspace_size_is_reported():
    from runtime.plans import Descriptor, cached_plan
    from runtime.quantization.training import LsqArgs
    plan = cached_plan(Descriptor("fake_quantize_learnable_backward", "tensor", "asymmetric", "f32", "f32"))
    args = LsqArgs(dy=None, x=None, dx=None, scale=1.0, zero_point=None, zp_value=0, ds=None, dz=None,
                   rows=1000, cols=64, seg_len=64)
    assert plan.workspace_size(args) == 1000 * 4 * 2
    args.chan_last = True
    plan = cached_plan(Descriptor("fake_quantize_learnable_backward", "channel", "symmetric", "f64", "f64"))
    assert plan.workspace_size(args) == 32 * 64 * 8            # ceil(1000 / 32) tiles x 64 columns, f64
    assert "deterministic" in plan.precision_guarantee


# -- launches, without a GPU: the packed parameters match each kernel's signature ---------------------
def _kernel_params(sku, symbol_suffix=""):
    """The C parameter list of a kernel in its generated source, as struct format letters."""
    import re
    src = sf.default_registry().source(sku)
    sig = re.search(re.escape(sku.symbol + symbol_suffix) + r"\((.*?)\)\s*\{", src, re.S).group(1)
    out = ""
    for p in sig.split(","):
        p = p.strip()
        if "*" in p:
            out += "Q"
        else:
            out += {"i64_t": "q", "int": "i", "float": "f", "double": "d"}[p.split()[0]]
    return out


@pytest.fixture
def fake_gpu(fake_device):
    """The fake device (tests/fakes.py): every launch packed with its struct format, recorded in
    ``fake_gpu.launches``."""
    return fake_device


@pytest.mark.parametrize("scope,shape,axis,gs", [("tensor", (70, 33), None, None), ("token", (6, 64), None, None),
                                                 ("group", (6, 64), None, 16), ("channel", (9, 48), 1, None),
                                                 ("channel", (9, 5, 48), 0, None)])
@pytest.mark.parametrize("mode", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("kind", ["float32", "float64"])
def test_lsq_launches_match_the_kernels(fake_gpu, scope, shape, axis, gs, mode, kind):
    from runtime.scopes import param_shape
    x = D(shape, kind)
    ps = param_shape(shape, scope, None if axis is None else axis % len(shape), gs)
    s = D(ps, kind)
    z = D(ps, "int32") if mode == "asymmetric" else None
    dx, ds, dz = sf.fake_quantize_learnable_backward(D(shape, kind), x, s, z, scope=scope, axis=axis, group_size=gs,
                                                     out=D(shape, kind))
    sku = sf.default_registry().select(category="quantization", op="fake_quantize_learnable_backward", scope=scope,
                                       mode=mode, element=sf.arrays.kind_of(kind), aux_element=sf.arrays.kind_of(kind))
    calls = fake_gpu.launches
    assert calls[0][0] == sku.symbol and calls[0][3] == _kernel_params(sku)
    if scope in ("tensor", "channel"):
        assert len(calls) == 2 and calls[1][0] == sku.symbol + "_finish"
        assert calls[1][3] == _kernel_params(sku, "_finish")
    else:
        assert len(calls) == 1
    assert (dz is None) == (mode == "symmetric")
    team = calls[0][4][-7]
    from runtime import status
    assert calls[0][4][-1] == status.pointer(0) and status.is_status_pointer(calls[0][4][-1])
    assert team & (team - 1) == 0 and 1 <= team <= 256 and calls[0][2] == (256,)


@pytest.mark.parametrize("op", ["quantize_backward", "dequantize_backward", "fake_quantize", "fake_quantize_backward"])
@pytest.mark.parametrize("scope", ["tensor", "channel", "token", "group"])
def test_elementwise_launches_match_the_kernels(fake_gpu, op, scope):
    shape, gs = (8, 64), (16 if scope == "group" else None)
    axis = 0 if scope == "channel" else None
    from runtime.scopes import param_shape
    ps = param_shape(shape, scope, axis, gs)
    x, s, z = D(shape, "float32"), D(ps, "float32"), D(ps, "int32")
    kw = dict(scope=scope, axis=axis, group_size=gs)
    if op == "dequantize_backward":
        sf.dequantize_backward(x, s, **kw, out=D(shape))
    elif op == "fake_quantize":
        sf.fake_quantize(x, s, z, **kw, out=D(shape))
        sf.fake_quantize(x, s, z, **kw, out=D(shape), return_mask=True)
    else:
        getattr(sf, op)(D(shape), x, s, z, **kw, out=D(shape))
    mode = None if op == "dequantize_backward" else "asymmetric"
    sku = sf.default_registry().select(category="quantization", op=op, scope=scope, mode=mode, element="f32",
                                       aux_element="f32")
    # channel on axis 0 (one parameter per row) launches the SKU's rows-layout entry point
    suffix = "_rows" if scope == "channel" else ""
    for fn, grid, block, fmt, values in fake_gpu.launches:
        assert fn == sku.symbol + suffix and fmt == _kernel_params(sku, suffix)
    if op == "fake_quantize":
        mask_ptr = fake_gpu.launches[0][4][4]
        assert mask_ptr == 0 and fake_gpu.launches[1][4][4] != 0     # no mask: a null pointer


@pytest.mark.parametrize("scope", ["tensor", "channel", "token", "group"])
@pytest.mark.parametrize("kind", ["float32", "float64", "float16"])
def test_fake_quantize_bits_launch_the_same_kernel(fake_gpu, scope, kind):
    """return_mask="bits": the fake_quantize kernel with mask_bits = 1; the mask's row stride (ceil(D / 8)
    bytes, not a multiple of a vector's 8) never keeps the data streams off the vector path."""
    shape, gs = (8, 24), (8 if scope == "group" else None)
    axis = 1 if scope == "channel" else None
    from runtime.scopes import param_shape
    ps = param_shape(shape, scope, axis, gs)
    x, s = D(shape, kind), D(ps, "float64" if kind == "float64" else "float32")
    for return_mask in (False, True, "bits"):
        sf.fake_quantize(x, s, scope=scope, axis=axis, group_size=gs, return_mask=return_mask, out=D(shape, kind))
    sku = sf.default_registry().select(category="quantization", op="fake_quantize", scope=scope, mode="symmetric",
                                       element=sf.arrays.kind_of(kind), aux_element=sf.arrays.kind_of(kind))
    abi = sf.Plan(sku).abi()
    got = [dict(zip(abi.names, values)) for fn, grid, block, fmt, values in fake_gpu.launches]
    assert [fn for fn, *_ in fake_gpu.launches] == [sku.symbol] * 3
    assert [v["mask_bits"] for v in got] == [0, 0, 1] and got[0]["mask"] == 0 and got[2]["mask"] != 0
    assert got[2]["mask_rs"] == 3 and [v["vec_ok"] for v in got] == [1, 1, 1]
    assert fake_gpu.launches[2][3] == _kernel_params(sku)


@pytest.mark.parametrize("kind", ["float32", "float64", "float16"])
@pytest.mark.parametrize("shape,strides,vec_ok", [((8, 64), None, 1), ((3, 5, 40), None, 1), ((8, 61), None, 0),
                                                  ((8, 64), (72, 1), 1), ((8, 64), (65, 1), 0), ((7,), None, 0),
                                                  ((4, 8), None, 1)])
def test_backward_from_mask_launches_match_the_kernel(fake_gpu, kind, shape, strides, vec_ok):
    """One kernel a dtype (no scope, no mode), its parameters as generated; the vector path (8 elements a
    thread, one mask byte) needs D % 8 == 0 and 16-byte aligned dy / dx rows, whatever the mask's rows;
    the scalar path takes 8 elements a thread."""
    dy = D(shape, kind, strides)
    nbytes = sf.quantization.training.mask_bits_shape(shape)
    mask = D(nbytes, "uint8", ptr=0x7D0000000003)           # any address: one byte a vector
    dx = sf.fake_quantize_backward_from_mask(dy, mask, out=D(shape, kind))
    k = sf.arrays.kind_of(kind)
    sku = sf.default_registry().select(category="quantization", op="fake_quantize_backward_from_mask", element=k,
                                       aux_element=k)
    assert str(sku).startswith(f"quantization/fake_quantize_backward_from_mask/-/-/{k}/{k}/")
    (fn, grid, block, fmt, values), = fake_gpu.launches
    assert fn == sku.symbol and fmt == _kernel_params(sku)
    v = dict(zip(sf.Plan(sku).abi().names, values))
    rows = int(np.prod(shape[:-1]))
    assert (v["rows"], v["cols"], v["vec_ok"], v["mask"], v["mask_rs"]) == (rows, shape[-1], vec_ok, 0x7D0000000003,
                                                                           nbytes[-1])
    assert v["dy_rs"] == (strides[0] if strides else shape[-1]) and v["dx"] == dx.__cuda_array_interface__["data"][0]
    per = 8 * sf.Plan(sku).launch["unroll"] if vec_ok else 8     # columns a thread covers in one step
    assert block[0] == min(256, 1 << max(0, (-(-shape[-1] // per) - 1).bit_length()))


def test_backward_from_mask_in_place(fake_gpu):
    """dx may be dy itself (each element is read before it is written, by the same thread); no other overlap."""
    dy = D((8, 64))
    assert sf.fake_quantize_backward_from_mask(dy, D((8, 8), "uint8"), out=dy) is dy
    (fn, grid, block, fmt, values), = fake_gpu.launches
    sku, = sf.default_registry().query(op="fake_quantize_backward_from_mask", element="f32")
    v = dict(zip(sf.Plan(sku).abi().names, values))
    assert v["dy"] == v["dx"]
    mask = D((8, 8), "uint8")
    at_mask = D((8, 64), ptr=mask.__cuda_array_interface__["data"][0])
    err(lambda: sf.fake_quantize_backward_from_mask(dy, mask, out=at_mask), InvalidProblemError, "out overlaps mask")


def test_backward_from_mask_of_an_empty_tensor_launches_nothing(fake_gpu):
    out = D((0, 16))
    assert sf.fake_quantize_backward_from_mask(D((0, 16)), D((0, 2), "uint8"), out=out) is out
    out = D((4, 0), "float16")
    assert sf.fake_quantize_backward_from_mask(D((4, 0), "float16"), D((4, 0), "uint8"), out=out) is out
    assert fake_gpu.launches == []


# -- device-side value checks (runtime/status.py) ---------------------------------------------------------
def test_status_codes_round_trip_and_errors_name_op_and_argument():
    from runtime import status
    seen = set()
    for op in status.OPS:
        for arg in status.ARGS:
            c = status.code(op, arg)
            assert status.decode(c) == (op, arg) and c not in seen and 0 < c < 2**31
            seen.add(c)
            e = sf.DeviceValueError(3, c)
            assert (e.op, e.arg, e.device, e.code) == (op, arg, 3, c)
            assert isinstance(e, InvalidProblemError)
            assert op in str(e) and arg in str(e) and "cuda:3" in str(e)


def test_lsq_sources_check_scale_and_zero_point():
    """Every LSQ kernel takes the status word last and renders its op's codes."""
    from runtime import status
    import re
    reg = sf.default_registry()
    skus = reg.query(op="fake_quantize_learnable_backward")
    assert skus
    for s in skus:
        src = reg.source(s)
        sig = re.search(re.escape(s.symbol) + r"\((.*?)\)\s*\{", src, re.S).group(1)
        assert sig.split(",")[-1].split() == ["u32_t*", "__restrict__", "status"]
        body = src[src.index(s.symbol + "("):]
        code_s = status.code("fake_quantize_learnable_backward", "scale")
        code_z = status.code("fake_quantize_learnable_backward", "zero_point")
        asym = "true" if s.mode == "asymmetric" else "false"
        # the entry point instantiates the element pass with its op's codes and passes the status word
        call = re.search(rf"lsq::backward<Scope::{s.scope}, {asym}, \d+, (\d+), (\d+)>\((.*?)\);", body, re.S)
        assert call and call.groups()[:2] == (str(code_s), str(code_z))
        assert call.group(3).split(",")[-1].strip() == "status"
        # the element pass (templates/quantization/lsq.cuh, in the unit's source) checks each scale
        # element it loads against the status word and poisons what depends on an invalid one
        head = src[:src.index(s.symbol + "(")]
        assert "param_bad<ASYM>(status, s" in head and "poison_nan<" in head


def test_lsq_parameters_end_with_the_status_pointer():
    from runtime.plans import Plan
    for s in sf.default_registry().query("*fake_quantize_learnable_backward/*"):
        abi = Plan(s).abi()
        assert abi.names[-1] == "status" and abi.fmt.endswith("Q")


def test_pending_report_raises_before_any_launch(fake_gpu):
    """A code an earlier kernel wrote raises DeviceValueError at the next LSQ call, before it
    launches anything (full path and replay alike); reported once."""
    from runtime import status
    x = D((8, 64), "float32")
    args = (D((8, 64)), x, D((8,)), D((8,), "int32"))
    kw = dict(scope="token", out=D((8, 64)))
    sf.fake_quantize_learnable_backward(*args, **kw)
    n = len(fake_gpu.launches)
    assert n == 1
    status_word = status.words().words
    for arg in ("scale", "zero_point"):
        status_word[0] = status.code("fake_quantize_learnable_backward", arg)
        with pytest.raises(sf.DeviceValueError) as ei:
            sf.fake_quantize_learnable_backward(*args, **kw)
        assert (ei.value.op, ei.value.arg) == ("fake_quantize_learnable_backward", arg)
        assert status_word[0] == 0 and len(fake_gpu.launches) == n
        sf.fake_quantize_learnable_backward(*args, **kw)
        n += 1
        assert len(fake_gpu.launches) == n


def test_lsq_host_checks_only_under_sync_checks(monkeypatch, fake_gpu):
    """The default path never evaluates device values on the host; sync_checks() does (one
    synchronizing reduction per array)."""
    from runtime import params
    seen = []
    monkeypatch.setattr(params, "device_check", lambda ref, arg, pred, what: seen.append(arg))
    x = D((8, 64), "float32")
    call = lambda: sf.fake_quantize_learnable_backward(D((8, 64)), x, D((8,)), D((8,), "int32"), scope="token",
                                                       out=D((8, 64)))
    call()
    assert seen == []
    with sf.sync_checks():
        call()
    assert seen == ["scale", "zero_point"]
