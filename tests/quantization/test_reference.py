"""The NumPy reference against hand-computed cases (ties, saturation, NaN/±inf)."""
import ml_dtypes
import numpy as np

from runtime import reference as ref


def test_ties_round_half_to_even():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997], np.float32)
    q = ref.quantize(x, np.float32(1.0), scope="tensor")
    assert q.tolist() == [0, 2, 2, 0, -2, -2, 0]


def test_saturation_nan_inf_signed():
    x = np.array([1000, -1000, np.nan, np.inf, -np.inf, 127.4, -128.6], np.float32)
    q = ref.quantize(x, np.float32(1.0), scope="tensor")
    assert q.dtype == np.int8
    assert q.tolist() == [127, -128, 0, 127, -128, 127, -128]


def test_unsigned_symmetric_implied_zero_point_and_nan():
    x = np.array([0.0, -1.0, 1.0, np.nan, 1e9], np.float32)
    q = ref.quantize(x, np.float32(0.5), scope="tensor", out_dtype="u8")
    assert q.tolist() == [128, 126, 130, 128, 255]


def test_asymmetric_zero_point_and_qrange():
    x = np.array([[0.0, 0.25, 10.0], [-3.0, 0.75, 1.0]], np.float32)
    scale = np.array([0.5, 0.25], np.float32)
    zp = np.array([10, -3], np.int32)
    q = ref.quantize(x, scale, zp, scope="token", qmin=-5, qmax=20)
    # row 0: rne(0)=0 -> 10; rne(0.5)=0 -> 10; rne(20)+10=30 -> 20
    # row 1: rne(-12)-3=-15 -> -5; rne(3)-3=0; rne(4)-3=1
    assert q.tolist() == [[10, 10, 20], [-5, 0, 1]]


def test_group_and_channel_broadcast():
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    g = ref.quantize(x, np.array([[1, 2], [4, 8]], np.float32), scope="group", group_size=3)
    assert g.tolist() == [[0, 1, 2, 2, 2, 2], [2, 2, 2, 1, 1, 1]]
    c = ref.quantize(x, np.array([1, 2], np.float32), scope="channel", axis=0)
    assert c.tolist() == [[0, 1, 2, 3, 4, 5], [3, 4, 4, 4, 5, 6]]


def test_inverse_is_rounded_once_then_multiplied():
    # 1/3 in float32 times 3 is 1 - 2^-25... products are float32, as the kernel computes them
    s = np.float32(3.0)
    inv = np.float32(1) / s
    x = np.array([1.5 * 3], np.float32)
    assert ref.quantize(x, s, scope="tensor").tolist() == [int(np.rint(np.float32(x[0] * inv)))]


def test_bf16_input_upcasts_exactly():
    x = np.array([1.5, 2.5, 3.5], ml_dtypes.bfloat16)
    assert ref.quantize(x, np.float32(1), scope="tensor").tolist() == [2, 2, 4]


def test_dequantize_rounds_once_to_output():
    q = np.array([[-128, 0, 127]], np.int8)
    y = ref.dequantize(q, np.float32(0.1), scope="tensor", out_dtype="f16")
    assert y.dtype == np.float16
    assert y[0].tolist() == [float(np.float16(np.float32(-128) * np.float32(0.1))), 0.0,
                          float(np.float16(np.float32(127) * np.float32(0.1)))]
    yu = ref.dequantize(np.array([0, 128, 255], np.uint8), np.float32(1), scope="tensor", in_kind="u8")
    assert yu.tolist() == [-128.0, 0.0, 127.0]


def test_f64_math_stays_f64():
    x = np.array([2.5000000000000004], np.float64)
    assert ref.quantize(x, np.float64(1.0), scope="tensor").tolist() == [3]
    assert ref.dequantize(np.array([3], np.int8), np.float64(0.1), scope="tensor", out_dtype="f64").dtype == np.float64


def test_empty_slice_params_equal_the_reference_of_an_all_zero_slice():
    """What dynamic_quantize gives an input with no elements (runtime/numerics.py, no kernel launched)
    is the reference's scale and zero point of a slice of zeros, for every code kind, mode, range and
    math precision."""
    import itertools

    from runtime import kinds
    from runtime.numerics import empty_slice_params
    for kind, mode, x_kind, eps, rng, e8m0 in itertools.product(
            ("s8", "u8", "s4", "u4", "fp8_e4m3", "fp8_e5m2"), ("symmetric", "asymmetric"), ("bf16", "f32", "f64"),
            (1e-8, 0.5, 3.0), ((None, None), (-100, 90), (3, 12)), (False, True)):
        if (kind in kinds.FP8 and (mode == "asymmetric" or rng != (None, None))) or (e8m0 and kind not in kinds.FP8):
            continue
        if kind in kinds.INT4 and rng == (-100, 90):
            continue
        lo, hi = rng
        if kind in ("u8", "u4") and lo is not None and lo < 0:
            continue
        zeros = np.zeros((2,), {"bf16": ml_dtypes.bfloat16, "f32": np.float32, "f64": np.float64}[x_kind])
        if kind in kinds.INT8:
            s, z, _, _ = ref.dynamic_qparams(zeros, scope="tensor", mode=mode, out_kind=kind, qmin=lo, qmax=hi, eps=eps)
        else:
            _, s, z = ref.dynamic_quantize_lowbit_ref(zeros, scope="tensor", mode=mode, out_dtype=kind, qmin=lo,
                                                      qmax=hi, eps=eps, scale_dtype="e8m0" if e8m0 else None)
        got_s, got_z = empty_slice_params(kind, mode, lo, hi, eps, kinds.math_kind(x_kind), e8m0=e8m0)
        case = (kind, mode, x_kind, eps, rng, e8m0)
        assert got_s == (int(s) if e8m0 else float(s)), case
        assert got_z == (None if z is None else int(z)), case
