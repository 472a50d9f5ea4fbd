"""Low-bit formats on the CPU: the NumPy reference by hand, every bad input's typed
error (before any launch), the arguments the functional API hands to the launchers, and the
launchers' configuration."""
import numpy as np
import pytest

import runtime as sf
from runtime import InvalidProblemError, UnsupportedError
from runtime.quantization import dynamic as dyn
from runtime.quantization import fused
from runtime.quantization import lowbit
from runtime.quantization import static as qz
from runtime.abi import Abi
from runtime import reference as ref
from runtime.plans import Preference
from tests.fakes import FakeDeviceArray as D
from tests.fakes import err

ml_dtypes = pytest.importorskip("ml_dtypes")
f32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn


def codes(values, kind="fp8_e4m3"):
    dt = E4M3 if kind == "fp8_e4m3" else ml_dtypes.float8_e5m2
    return np.array(values, np.float64).astype(np.float32).astype(dt).view(np.uint8)


# -- the reference, by hand -----------------------------------------------------------------------
def test_fp8_quantize_by_hand():
    x = np.array([[1.0, -2.0, 1000.0, np.nan, np.inf, -np.inf, 0.0, -0.0, 0.5 * 1.0625, 3e-3]], f32)
    q = ref.quantize_lowbit(x, f32(0.5), scope="tensor", out_dtype="fp8_e4m3")      # t = x * 2
    assert q.dtype == np.uint8 and q.shape == x.shape
    np.testing.assert_array_equal(q[0, :3], codes([2.0, -4.0, 448.0]))             # 2000 saturates to 448
    assert q[0, 3] == 0x7F                                                          # NaN: the canonical code
    assert q[0, 4] == 0x7E and q[0, 5] == 0xFE                                      # ±inf -> ±max (satfinite)
    assert q[0, 6] == 0x00 and q[0, 7] == 0x80                                      # signed zeros
    assert q[0, 8] == codes([1.0])[0]                                               # 1.0625: tie -> even (1.0)
    assert q[0, 9] == 0x03                                                          # 6e-3 = 3.07 * 2^-9: subnormal 3
    q = ref.quantize_lowbit(np.array([6e4, -1e6, 61440.0, 1.25 * 2 ** -16], f32), f32(1), scope="tensor",
                            out_dtype="fp8_e5m2")
    np.testing.assert_array_equal(q, [0x7B, 0xFB, 0x7B, 0x01])                      # max 57344; 2^-16 * 1.25 -> 1


def test_int4_quantize_packs_low_nibble_first():
    x = np.array([[1.0, -1.0, 2.5, 3.5, -8.0, 7.0, 100.0, np.nan]], f32)
    q = ref.quantize_lowbit(x, f32(1), scope="tensor", out_dtype="s4")
    assert q.shape == (1, 4) and q.dtype == np.uint8
    # (1, -1) -> 0xF1; (2.5 -> 2, 3.5 -> 4) -> 0x42; (-8, 7) -> 0x78; (100 -> 7, NaN -> 0) -> 0x07
    np.testing.assert_array_equal(q[0], [0xF1, 0x42, 0x78, 0x07])
    # u4 symmetric: the implied zero point 8; range 0..15
    q = ref.quantize_lowbit(np.array([[0.0, -1.0, 7.0, -9.0]], f32), f32(1), scope="tensor", out_dtype="u4")
    np.testing.assert_array_equal(ref.unpack_int4(q, "u4"), [[8, 7, 15, 0]])
    # asymmetric s4 per group of 2, zero points [1, -2]
    q = ref.quantize_lowbit(np.array([[1.0, 2.0, 1.0, 2.0]], f32), np.array([[1.0, 0.5]], f32),
                            np.array([[1, -2]], np.int32), scope="group", group_size=2, out_dtype="s4")
    np.testing.assert_array_equal(ref.unpack_int4(q, "s4"), [[2, 3, 0, 2]])


def test_dequantize_by_hand():
    q = np.array([[0xF1, 0x42]], np.uint8)                                           # s4 values 1, -1, 2, 4
    y = ref.dequantize_lowbit(q, f32(0.5), scope="tensor", in_kind="s4", out_dtype="f32")
    np.testing.assert_array_equal(y, [[0.5, -0.5, 1.0, 2.0]])
    y = ref.dequantize_lowbit(q, f32(1), np.int32(1), scope="tensor", in_kind="u4", out_dtype="bf16")
    assert y.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(y.astype(f32), [[0, 14, 1, 3]])                   # u4 (1, 15, 2, 4) - 1
    c = codes([448.0, -0.015625, 1.5])
    y = ref.dequantize_lowbit(c[None], np.array([2.0], f32), scope="token", in_kind="fp8_e4m3", out_dtype="f16")
    np.testing.assert_array_equal(y.astype(f32), [[896.0, -0.03125, 3.0]])
    y = ref.dequantize_lowbit(np.array([[0x7F, 0x80]], np.uint8), f32(1), scope="tensor", in_kind="fp8_e4m3")
    assert np.isnan(y[0, 0]) and y[0, 1] == 0 and np.signbit(y[0, 1])


def test_dynamic_fp8_and_mx_by_hand():
    x = np.zeros((2, 64), f32)
    x[0, 3], x[0, 40], x[1, :] = 448.0 * 3, -100.0, np.nan
    q, s, zp = ref.dynamic_quantize_lowbit_ref(x, scope="token", out_dtype="fp8_e4m3")
    assert zp is None and s.dtype == np.float32
    np.testing.assert_array_equal(s, [f32(1344) / f32(448), f32(1e-8) / f32(448)])   # amax 1344 = 448 * 3; all-NaN -> eps
    assert q[0, 3] == 0x7E and (q[1] == 0x7F).all()
    # MX, group 32: e = floor(log2(amax)) - 8; group 0 amax 1344 -> 10 - 8 = 2, group 1 amax 100 -> 6 - 8 = -2
    q, s, _ = ref.dynamic_quantize_lowbit_ref(x, scope="group", group_size=32, out_dtype="fp8_e4m3", scale_dtype="e8m0")
    np.testing.assert_array_equal(s, [[129, 125], [0, 0]])                           # e + 127; all-NaN -> amax 0 -> -127
    assert s.dtype == np.uint8
    assert q[0, 3] == codes([336.0])[0]                                              # 1344 / 4
    assert q[0, 40] == codes([-400.0])[0]                                            # -100 * 4 = -400 -> -384 (RNE)
    # e5m2 MX: emax_elem 15
    _, s, _ = ref.dynamic_quantize_lowbit_ref(x[:1], scope="group", group_size=32, out_dtype="fp8_e5m2",
                                              scale_dtype="e8m0")
    np.testing.assert_array_equal(s, [[127 + 10 - 15, 127 + 6 - 15]])


def test_dynamic_int4_by_hand(rng):
    x = np.array([[7.0, -3.5, 0.5, 1.0], [0.0, 0.0, 0.0, 0.0]], f32)
    q, s, zp = ref.dynamic_quantize_lowbit_ref(x, scope="token", out_dtype="s4")
    np.testing.assert_array_equal(s, [f32(1), f32(1e-8) / f32(7)])
    np.testing.assert_array_equal(ref.unpack_int4(q, "s4"), [[7, -4, 0, 1], [0, 0, 0, 0]])
    q, s, zp = ref.dynamic_quantize_lowbit_ref(x, scope="token", mode="asymmetric", out_dtype="u4")
    assert s[0] == f32(10.5) / f32(15) and zp[0] == 0 - int(np.rint(f32(-3.5) / s[0]))
    # the invariant and the round trip (|y - x| <= scale / 2) on random data
    x = (rng.standard_normal((16, 256)) * 3).astype(f32)
    for kind in ("s4", "u4"):
        for mode in ("symmetric", "asymmetric"):
            q, s, zp = ref.dynamic_quantize_lowbit_ref(x, scope="group", group_size=64, mode=mode, out_dtype=kind)
            y = ref.dequantize_lowbit(q, s, zp, scope="group", group_size=64, in_kind=kind)
            assert (np.abs(y - x) <= np.repeat(s, 64, -1) * 0.5 * (1 + 1e-5)).all()
    for kind, rel in (("fp8_e4m3", 2 ** -4), ("fp8_e5m2", 2 ** -3)):
        q, s, _ = ref.dynamic_quantize_lowbit_ref(x, scope="token", out_dtype=kind)
        y = ref.dequantize_lowbit(q, s, scope="token", in_kind=kind)
        big = np.abs(x) > 0.1 * np.abs(x).max(-1, keepdims=True)
        assert (np.abs(y - x)[big] <= np.abs(x)[big] * rel).all()


def test_f64_inputs_round_once():
    # just above a tie: float64 math rounds up; rounding through float32 would give the even code
    x = np.array([1.0625 + 2.0 ** -40], np.float64)
    assert ref.quantize_lowbit(x, 1.0, scope="tensor", out_dtype="fp8_e4m3")[0] == codes([1.125])[0]
    assert ref.quantize_lowbit(x.astype(f32), f32(1), scope="tensor", out_dtype="fp8_e4m3")[0] == codes([1.0])[0]
    _, s, _ = ref.dynamic_quantize_lowbit_ref(np.full((1, 32), 3.0), scope="group", group_size=32,
                                              out_dtype="fp8_e4m3", scale_dtype="e8m0")
    assert s[0, 0] == 127 + 1 - 8


# -- the shipped manifest ----------------------------------------------------------------------------
X = D((8, 64), "float32")
Q8 = D((8, 32), "uint8")


def test_manifest_has_every_lowbit_kernel():
    """All 368 low-bit kernels are in the manifest."""
    reg = sf.default_registry()
    assert len([s for s in reg.skus() if {s.element, s.aux_element} & set(lowbit.KINDS)]) == 368


# -- validation: typed errors before any launch --------------------------------
def test_fp8_has_no_zero_point():
    err(lambda: sf.quantize(X, 0.5, 3, scope="tensor", out_dtype="fp8_e4m3"), InvalidProblemError,
        "zero_point", "fp8_e4m3 has no zero point")
    err(lambda: sf.quantize(X, 0.5, scope="tensor", out_dtype="fp8_e4m3", qmin=-100), InvalidProblemError,
        "qmin=-100", "±448")
    err(lambda: sf.dequantize(Q8, 0.5, D((), "int32"), scope="tensor", in_dtype="fp8_e5m2"), InvalidProblemError,
        "zero_point")
    err(lambda: sf.dynamic_quantize(X, scope="token", mode="asymmetric", out_dtype="fp8_e5m2"), InvalidProblemError,
        "mode='asymmetric'", "no zero point")
    err(lambda: sf.dynamic_quantize(X, scope="token", out_dtype="fp8_e4m3", qmax=100), InvalidProblemError, "qmax=100")


def test_int4_needs_even_d_and_even_groups():
    x63 = D((8, 63), "float32")
    err(lambda: sf.quantize(x63, 0.5, scope="tensor", out_dtype="int4"), InvalidProblemError, "D=63", "even")
    err(lambda: sf.dynamic_quantize(x63, scope="token", out_dtype="uint4"), InvalidProblemError, "D=63")
    x6 = D((4, 6), "float32")
    err(lambda: sf.quantize(x6, D((4, 2)), scope="group", group_size=3, out_dtype="s4"), InvalidProblemError,
        "group_size=3", "even")
    err(lambda: sf.dynamic_quantize(x6, scope="group", group_size=3, out_dtype="u4"), InvalidProblemError,
        "group_size=3")
    err(lambda: sf.dequantize(D((4, 3), "uint8"), D((4, 2)), scope="group", group_size=3, in_dtype="int4"),
        InvalidProblemError, "group_size=3")
    # fp8 takes odd sizes and any group size dividing D
    err(lambda: sf.quantize(x63, 0.5, scope="group", group_size=2, out_dtype="fp8_e4m3"), InvalidProblemError,
        "does not divide")
    err(lambda: sf.quantize(X, 0.5, scope="tensor", out_dtype="s4", qmin=-9), InvalidProblemError, "qmin=-9", "[-8, 7]")


def test_e8m0_rules():
    s32 = D((8, 2), "uint8")
    err(lambda: sf.dynamic_quantize(X, scope="group", group_size=16, out_dtype="fp8_e4m3", scale_dtype="e8m0"),
        InvalidProblemError, "group_size=32", "group_size=16")
    err(lambda: sf.dynamic_quantize(X, scope="token", out_dtype="fp8_e4m3", scale_dtype="e8m0"), InvalidProblemError,
        "scope='group'")
    err(lambda: sf.dynamic_quantize(X, scope="group", group_size=32, out_dtype="int4", scale_dtype="e8m0"),
        UnsupportedError, "fp8")
    err(lambda: sf.dynamic_quantize(X, scope="group", group_size=32, scale_dtype="e8m0"), UnsupportedError,
        "MX block scales", "fp8", "s8")
    err(lambda: sf.quantize(X, s32, scope="group", group_size=16, out_dtype="fp8_e4m3", scale_dtype="e8m0"),
        InvalidProblemError, "group_size=32")
    err(lambda: sf.quantize(X, 1.0, scope="group", group_size=32, out_dtype="fp8_e4m3", scale_dtype="e8m0"),
        InvalidProblemError, "scalar", "uint8")
    err(lambda: sf.quantize(X, D((8, 2), "float32"), scope="group", group_size=32, out_dtype="fp8_e4m3",
                            scale_dtype="e8m0"), InvalidProblemError, "scale has dtype f32")
    err(lambda: sf.quantize(X, D((8, 3), "uint8"), scope="group", group_size=32, out_dtype="fp8_e4m3",
                            scale_dtype="e8m0"), InvalidProblemError, "scale has shape (8, 3)", "(8, 2)")
    err(lambda: sf.quantize(X, s32, scope="group", group_size=32, scale_dtype="e8m0"), UnsupportedError, "fp8")
    err(lambda: sf.dequantize(Q8, s32, scope="group", group_size=32, in_dtype="int4", scale_dtype="e8m0"),
        UnsupportedError, "fp8")
    err(lambda: sf.dequantize(D((8, 64), "int8"), s32, scope="group", group_size=32, scale_dtype="e8m0"),
        UnsupportedError, "fp8", "s8")


def test_dequantize_kind_and_container():
    err(lambda: sf.dequantize(D((8, 32), "int8"), 0.5, scope="tensor", in_dtype="int4"), InvalidProblemError,
        "q has dtype s8", "uint8 container")
    err(lambda: sf.dequantize(Q8, 0.5, scope="tensor", in_dtype="int8"), InvalidProblemError, "in_dtype='int8'", "u8")
    err(lambda: sf.dequantize(Q8, 0.5, scope="tensor", in_dtype="int3"), InvalidProblemError, "in_dtype")
    err(lambda: sf.dequantize(Q8, 0.5, scope="tensor", in_dtype="fp8_e4m3", out_dtype="int8"), UnsupportedError,
        "out_dtype")
    # the scale shape follows the unpacked q: (8, 64) with group 32 -> (8, 2)
    err(lambda: sf.dequantize(Q8, D((8, 1)), scope="group", group_size=32, in_dtype="uint4"), InvalidProblemError,
        "scale has shape (8, 1)", "(8, 2)")
    err(lambda: sf.quantize(X, 0.5, scope="tensor", out_dtype="int4", out=D((8, 64), "uint8")), InvalidProblemError,
        "out has shape (8, 64)", "(8, 32)")
    err(lambda: sf.quantize(X, 0.5, scope="tensor", out_dtype="fp8_e4m3", out=D((8, 64), "int8")),
        InvalidProblemError, "dtype s8")


def test_bad_eps_and_mode():
    err(lambda: sf.dynamic_quantize(X, scope="token", out_dtype="fp8_e4m3", eps=0.0), InvalidProblemError, "eps")
    err(lambda: sf.dynamic_quantize(X, scope="token", out_dtype="s4", mode="affine"), UnsupportedError, "mode")
    err(lambda: sf.dynamic_quantize(X, scope="token", out_dtype="s4", scale_dtype="float16"), UnsupportedError,
        "scale_dtype")


# -- what the launchers receive (no GPU: allocation and plans are stubbed) ---------------------------
class _Recorder:
    """A cached_plan stand-in: records (descriptor, preference, args) of every launch."""

    def __init__(self):
        self.calls = []

    def __call__(self, descriptor, preference=Preference()):
        rec = self

        class _Prepared:
            abi = Abi("stub", [("scale_value", "f32"), ("zp_value", "i32")])
            fmt, values = abi.fmt, [0.0, 0]

            def launch(self, stream, values=None):
                pass

        class _Launcher:
            one_launch = True       # the fused kernel: one prepared launch

            def check(self, plan, args):
                pass

            def prepare(self, plan, args):
                rec.calls.append((descriptor, preference, args))
                return _Prepared()

            def run(self, plan, args, stream=None):
                rec.calls.append((descriptor, preference, args))

        class _Plan:
            launcher = _Launcher()
            launch = {"kind": "recorded"}

            def workspace_size(self, args):
                return 0

            def run(self, args, stream=None):
                rec.calls.append((descriptor, preference, args))
        return _Plan()


@pytest.fixture
def stubbed(fake_device, monkeypatch):
    """Plan selection recorded (its plans run nothing) on the fake device, whose allocations are
    logged in ``stubbed.alloc`` ((shape, kind))."""
    rec = _Recorder()
    monkeypatch.setattr(qz, "cached_plan", rec)      # static low-bit calls
    monkeypatch.setattr(dyn, "cached_plan", rec)     # the low-bit dynamic path
    rec.alloc = fake_device.allocs
    yield rec


def test_quantize_int4_arguments(stubbed):
    q = sf.quantize(X, D((64,)), D((64,), "int32"), scope="channel", axis=1, out_dtype="uint4", qmin=1, qmax=14)
    desc, pref, args = stubbed.calls[-1]
    assert (desc.op, desc.scope, desc.mode, desc.element, desc.aux_element) == ("quantize", "channel", "asymmetric",
                                                                                  "f32", "u4")
    assert pref.arch == 90 and q.shape == (8, 32) and q.dtype == np.uint8
    (o, ov), = args.outs
    assert o.kind == "u4" and ov.cols == 32 and args.cols == 64 and args.rows == 8
    assert (args.qmin, args.qmax, args.chan_last, args.scale_e8m0) == (1, 14, True, None)
    sf.quantize(X, 0.25, scope="tensor", out_dtype="int4")
    _, _, args = stubbed.calls[-1]
    assert args.zp_value == 0 and args.scale == 0.25 and args.zero_point is None
    sf.quantize(X, 0.25, scope="tensor", out_dtype="uint4")
    assert stubbed.calls[-1][2].zp_value == 8                                         # u4's implied zero point


def test_quantize_fp8_and_mx_arguments(stubbed):
    q = sf.quantize(X, D((8, 2), "uint8"), scope="group", group_size=32, out_dtype="e4m3", scale_dtype="e8m0")
    desc, _, args = stubbed.calls[-1]
    assert desc.aux_element == "fp8_e4m3" and q.shape == (8, 64) and q.dtype == np.uint8   # CuPy-like: uint8 codes
    assert args.scale_e8m0.kind == "e8m0" and args.scale == 0.0 and args.group_size == 32
    assert (args.qmin, args.qmax, args.zp_value) == (-448, 448, 0)
    y = sf.dequantize(q, D((8, 2), "uint8"), scope="group", group_size=32, in_dtype="fp8_e4m3",
                      scale_dtype="e8m0", out_dtype="float16")
    desc, _, args = stubbed.calls[-1]
    assert (desc.op, desc.element, desc.aux_element) == ("dequantize", "fp8_e4m3", "f16") and y.shape == (8, 64)
    assert args.ins[0][0].kind == "fp8_e4m3" and args.scale_e8m0 is not None


def test_dequantize_int4_arguments(stubbed):
    y = sf.dequantize(Q8, D((8, 4), "float64"), D((8, 4), "int32"), scope="group", group_size=16, in_dtype="int4",
                      out_dtype="float64")
    desc, _, args = stubbed.calls[-1]
    assert (desc.mode, desc.element, desc.aux_element) == ("asymmetric", "s4", "f64")
    assert y.shape == (8, 64) and args.cols == 64 and args.ins[0][1].cols == 32
    assert (args.qmin, args.qmax) == (-8, 7)


def test_dynamic_arguments(stubbed):
    q, s, zp = sf.dynamic_quantize(X, scope="group", group_size=32, out_dtype="fp8_e5m2", scale_dtype="e8m0")
    desc, pref, args = stubbed.calls[-1]
    assert (desc.op, desc.scope, desc.aux_element) == ("dynamic_quantize", "group", "fp8_e5m2")
    assert q.shape == (8, 64) and s.shape == (8, 2) and s.dtype == np.uint8 and zp is None
    assert args.scale.kind == "e8m0" and (args.qmin, args.qmax, args.zp_value) == (-57344, 57344, 0)
    q, s, zp = sf.dynamic_quantize(X, scope="token", mode="asymmetric", out_dtype="uint4")
    _, _, args = stubbed.calls[-1]
    assert q.shape == (8, 32) and s.shape == (8,) and s.dtype == np.float32 and zp.shape == (8,)
    assert args.q.kind == "u4" and (args.qmin, args.qmax, args.zp_value) == (0, 15, 0)
    q, s, zp = sf.dynamic_quantize(D((8, 64), "float64"), scope="tensor", out_dtype="int4")
    _, _, args = stubbed.calls[-1]
    assert s.dtype == np.float64 and (args.qmin, args.qmax, args.zp_value) == (-7, 7, 0)


def test_prefer_arch(fake_device):
    assert lowbit.preference(0).arch == 90
    with lowbit.prefer_arch(80):
        assert lowbit.preference(0).arch == 80
        with lowbit.prefer_arch(89):
            assert lowbit.preference(0).arch == 89
        assert lowbit.preference(0).arch == 80
    assert lowbit.preference(0).arch == 90


# -- launcher configuration -------------------------------------------------------------------------
def _plan(vec, pack, **launch):
    from runtime.sku import KernelSku
    p = type("P", (), {})()
    p.launch = dict(vec=vec, pack=pack, block_threads=256, unroll=4, **launch)
    p.sku = KernelSku("quantization", "quantize", "token", "symmetric", "bf16", "s4")
    return p


def test_elementwise_vec_ok_uses_packed_widths():
    from runtime.arrays import as_array
    from runtime.quantization.elementwise import ElementwiseArgs
    from runtime.scopes import rows_view
    L = lowbit.LowBitElementwiseLauncher()

    def args(d, q_ptr_off=0, q_stride=None):
        x = as_array(D((4, d), "float16"), "x")
        q = lowbit.retag(as_array(D((4, d // 2), "uint8", ptr=0x7F0000200000 + q_ptr_off,
                                     strides=None if q_stride is None else (q_stride, 1)), "q"), "s4")
        return ElementwiseArgs(ins=[(x, rows_view(x, "x"))], outs=[(q, rows_view(q, "q"))], scale=1.0, zero_point=None,
                               zp_value=0, rows=4, cols=d)
    p = _plan(8, 2, ins=[{"kind": "f16"}], outs=[{"kind": "s4"}])
    assert L.vec_ok(p, args(64))
    assert L.vec_ok(p, args(64, q_ptr_off=4))            # 8 halves -> 4 bytes of q: 4-byte alignment suffices
    assert not L.vec_ok(p, args(64, q_ptr_off=2))
    assert not L.vec_ok(p, args(60))                     # 60 % 8
    assert L.vec_ok(p, args(64, q_stride=36)) and not L.vec_ok(p, args(64, q_stride=34))
    L.check(p, args(64))
    import dataclasses
    with pytest.raises(InvalidProblemError, match="even"):
        L.check(p, dataclasses.replace(args(64), cols=63))
    bad = args(64)
    bad.outs = [(lowbit.retag(bad.outs[0][0], "u4"), bad.outs[0][1])]
    with pytest.raises(InvalidProblemError, match="takes f16 -> s4"):
        L.check(p, bad)


@pytest.mark.parametrize("shape,gs,kind,vec_want", [((65536, 4096), 128, "fp8_e4m3", True), ((65536, 4096), 128, "s4", True),
                                                    ((16, 4096), 32, "fp8_e4m3", True), ((7, 96), 6, "s4", False),
                                                    ((9, 48), 3, "fp8_e5m2", False), ((5, 70002), None, "u4", False), ((5, 70000), None, "u4", True)])
def test_fused_config(fake_device, shape, gs, kind, vec_want):
    from runtime.arrays import as_array
    from runtime.quantization.dynamic import DynamicArgs
    from runtime.scopes import rows_view
    pack = 2 if kind in ("s4", "u4") else 1
    p = _plan(8, pack, max_threads=512, ch_vec=[1, 2, 4], ch_scalar=[1, 4, 8])
    x = as_array(D(shape, "float16"), "x")
    q = lowbit.retag(as_array(D(lowbit.packed_shape(shape, kind), "uint8"), "q"), kind)
    scope = "group" if gs else "token"
    s = as_array(D(sf.scopes.param_shape(shape, scope, None, gs), "float32"), "scale")
    a = DynamicArgs(x, rows_view(x, "x"), q, rows_view(q, "q"), s, None, scope, "symmetric", -7, 7, 0, 1e-8,
                    group_size=gs)
    vec_ok, tx, ty, grid = fused.LowBitFusedLauncher().config(p, a)
    assert vec_ok == vec_want
    g = gs or shape[-1]
    v = 8 if vec_ok else pack
    assert tx * ty in (256, 512) and (tx & (tx - 1)) == 0
    chs = p.launch["ch_vec"] if vec_ok else p.launch["ch_scalar"]
    if -(-g // v) <= 512 * chs[-1]:
        assert -(-(-(-g // v)) // tx) <= chs[-1]        # the row group stays in registers
    assert 1 <= grid < 2 ** 31


# -- bench workloads ---------------------------------------------------------------------------------
def test_bench_module_selection_and_bytes():
    from codegen import matrix, spec
    from codegen.families.quantization.blocks import lowbit_blocks
    from codegen.harness import families
    from codegen.harness.bench import plan as bench_plan
    from codegen.harness.bench import record as bench_record
    from codegen.harness.workloads import lowbit as bench_lowbit
    mods = families.workload_modules(lambda m: None)
    lowbit_skus = [c.sku for c in matrix.cells((spec.Family("lowbit", lowbit_blocks(), ()),)) if c.generated]
    for s in lowbit_skus:
        assert families.module_for(s, mods) is bench_lowbit
    s8 = [s for s in sf.default_registry().skus() if s.op in ("quantize", "dynamic_quantize")
          and s.aux_element in ("s8", "u8")]
    assert all(families.module_for(s, mods).__name__ != "codegen.harness.workloads.lowbit" for s in s8)
    todo = bench_plan.plan(lowbit_skus, mods)
    chosen = sorted({str(s) for s, _, _ in todo})
    assert len(chosen) == 3 and all("/group/symmetric/bf16/" in c and "dynamic_quantize" in c for c in chosen)
    assert {s.aux_element for s, _, _ in todo} == {"fp8_e4m3", "s4"} and (65536, 4096) in {sh for _, _, sh in todo}
    fp8 = next(s for s, _, _ in todo if s.aux_element == "fp8_e4m3")
    s4 = next(s for s, _, _ in todo if s.aux_element == "s4")
    n = 65536 * 4096
    assert bench_lowbit.expected_bytes(fp8, (65536, 4096)) == n * 2 + n + n // 128 * 4
    assert bench_lowbit.expected_bytes(s4, (65536, 4096)) == n * 2 + n // 2 + n // 128 * 4
    fp8s = {s.arch: s for s, _, _ in todo if s.aux_element == "fp8_e4m3"}
    assert bench_record.target_for(bench_lowbit, fp8s["sm89"])["target_pct"] == 95.0     # hardware cvt: the 95 % target
    assert bench_record.target_for(bench_lowbit, fp8s["sm80"]) == {"no_target": True}     # the software fallback: none
    assert bench_record.target_for(bench_lowbit, s4)["target_pct"] == 95.0


def test_prefer_arch_forgets_remembered_calls():
    """A replay keeps the kernel its full path chose: choosing another arch must not replay it."""
    from runtime import replay
    replay.CACHE["remembered"] = object()
    with lowbit.prefer_arch(80):
        assert not replay.CACHE
        replay.CACHE["remembered"] = object()
    assert not replay.CACHE
