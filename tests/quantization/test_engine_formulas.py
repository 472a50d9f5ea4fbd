"""Which serving engines' quantization skuforge reproduces bit for bit today (docs/numerics.md,
"Other engines' rules").

Each engine's formula is transcribed here in NumPy float32, step by step in its own operation order,
from its public source (repository, file and function named beside it), independently of
runtime.reference; skuforge's side is runtime.reference, which its kernels equal bit for bit on the
GPU (python -m codegen verify). fp8 results are compared as codes; the engines' float -> e4m3
conversion (round half to even, saturating, after their clamp to +-448) is ml_dtypes' cast of the
clamped value. Finite inputs only: NaN handling is where several engines differ (their clamp sends
NaN to +448 or -448; skuforge keeps the NaN code 0x7F).
"""
import ml_dtypes
import numpy as np
import pytest

from runtime import reference as ref

f32 = np.float32
E4M3_MAX = f32(448.0)


def _e4m3_codes(v) -> np.ndarray:
    """float32 -> e4m3fn codes, round half to even (the value is already within +-448)."""
    return np.asarray(v, f32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _clamp448(v):
    # fmaxf(-448, fminf(v, 448)) (SGLang's fmaxf(fminf(v, 448), -448) is the same function): the clamp
    # of vLLM's scaled_fp8_conversion and of SGLang's kernels
    return np.maximum(-E4M3_MAX, np.minimum(v, E4M3_MAX))


# the midpoints between adjacent finite e4m3 values: where x * (1/s) and x / s round apart
_E4M3 = np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))
_E4M3 = _E4M3[np.isfinite(_E4M3)]
MIDPOINTS = (_E4M3[:-1] + _E4M3[1:]) / 2


def _near_ties(rng, scale, n) -> np.ndarray:
    """n float32 values x whose x / scale lies on, or one float32 step beside, an e4m3 midpoint."""
    base = (rng.choice(MIDPOINTS, n) * np.float64(scale)).astype(f32)
    nudge = rng.integers(-1, 2, n)
    return np.where(nudge > 0, np.nextafter(base, f32(np.inf)),
                    np.where(nudge < 0, np.nextafter(base, f32(-np.inf)), base)).astype(f32)


def _activations(rng, rows, cols, group=None, bf16=True) -> np.ndarray:
    """Rows of spread magnitudes (and a zero row, a row with one outlier), finite, then as many rows
    again whose groups (``group`` elements; None: the row) hold their max |x| first and values next
    to the e4m3 rounding ties of their scale max|x| / 448 after it."""
    x = (rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))).astype(f32)
    x[0] = 0.0
    x[1, 3] = 3.0e4
    if bf16:
        x = x.astype(ml_dtypes.bfloat16).astype(f32)
    g = group or cols
    ties = np.empty((rows * cols // g, g), f32)
    for t in ties:
        amax = f32(10.0 ** rng.uniform(-3, 3))
        t[1:] = _near_ties(rng, amax / E4M3_MAX, g - 1) * rng.choice([f32(-1), f32(1)], g - 1)
        t[0] = amax
        t[np.abs(t) > amax] = 0.0
    return np.concatenate([x, ties.reshape(rows, cols)])


# -- vLLM: static_scaled_fp8_quant ------------------------------------------------------------------
def vllm_static_fp8(x, scale):
    """vllm-project/vllm csrc/quantization/w8a8/fp8/common.cu, scaled_fp8_quant_kernel_strided:
    ``inv_scale = 1.0f / (*scale)``; scaled_fp8_conversion<true>: ``x * inv_scale``, clamp
    ``fmaxf(-448, fminf(x, 448))``, __nv_cvt_float_to_fp8(SATFINITE, E4M3)."""
    inv = f32(1.0) / f32(scale)
    return _e4m3_codes(_clamp448(np.asarray(x, f32) * inv))


@pytest.mark.parametrize("scale", [0.01, 0.37, 1.0, 3.0e-3, 7.7e2])
def test_vllm_static_fp8_is_quantize_tensor(rng, scale):
    x = np.concatenate([_activations(rng, 64, 512).ravel(), _near_ties(rng, scale, 4096)])
    got = ref.quantize_lowbit(x, f32(scale), scope="tensor", out_dtype="fp8_e4m3")
    assert np.array_equal(got, vllm_static_fp8(x, scale))


# -- SGLang: per_token_quant_fp8, per_tensor_quant_fp8 ------------------------------------------------
def sglang_per_token_fp8(x):
    """sgl-project/sglang python/sglang/jit_kernel/csrc/gemm/per_token_quant_fp8.cuh (and
    sgl-kernel/csrc/gemm/per_token_quant_fp8.cu): ``scale = max|x| / 448`` stored;
    ``scale_inv = scale == 0 ? 0 : 1.0f / scale``; ``fmaxf(fminf(x * scale_inv, 448), -448)``; e4m3."""
    amax = np.max(np.abs(x), axis=-1, keepdims=True).astype(f32)
    scale = (amax / E4M3_MAX).astype(f32)
    with np.errstate(divide="ignore"):
        inv = np.where(scale == 0, f32(0), f32(1.0) / scale).astype(f32)
    return _e4m3_codes(_clamp448(x * inv)), scale[..., 0]


def sglang_per_tensor_fp8(x):
    """sgl-project/sglang python/sglang/jit_kernel/csrc/gemm/per_tensor_quant_fp8.cuh: the scale is
    the atomic max over blocks of ``block_max / 448`` (= ``max|x| / 448``: division is monotone);
    ``scale_val = 1.0f / scale``; ``fmax(fmin(x * scale_val, 448), -448)``; e4m3."""
    scale = f32(np.max(np.abs(x)) / E4M3_MAX)
    return _e4m3_codes(_clamp448(x * (f32(1.0) / scale))), scale


def test_sglang_per_token_fp8_is_dynamic_token(rng):
    """Equal codes on every row; equal scales where max|x| >= eps (an all-zero row: SGLang stores 0,
    skuforge eps / 448; both write zeros)."""
    x = _activations(rng, 96, 1024)
    q, s, _ = ref.dynamic_quantize_lowbit_ref(x, scope="token", out_dtype="fp8_e4m3")
    q_sg, s_sg = sglang_per_token_fp8(x)
    assert np.array_equal(q, q_sg)
    live = np.max(np.abs(x), axis=-1) >= 1e-8
    assert np.array_equal(s[live], s_sg[live]) and not live[0]


def test_sglang_per_tensor_fp8_is_dynamic_tensor(rng):
    x = _activations(rng, 64, 700)
    q, s, _ = ref.dynamic_quantize_lowbit_ref(x, scope="tensor", out_dtype="fp8_e4m3")
    q_sg, s_sg = sglang_per_tensor_fp8(x)
    assert np.array_equal(q, q_sg) and f32(s) == s_sg


# -- DeepGEMM: per_token_cast_to_fp8 (float32 scales) -----------------------------------------------
def deepgemm_per_token_cast(x, gran_k=128):
    """deepseek-ai/DeepGEMM deep_gemm/utils/math.py, per_token_cast_to_fp8(use_ue8m0=False):
    ``x_amax = abs(x).float().amax(dim=2).clamp(1e-4)``; ``sf = x_amax / 448.0``;
    ``(x * (1.0 / sf)).to(torch.float8_e4m3fn)`` (a float32 product; |product| <= 448 (1 + ulp)
    rounds to 448)."""
    m, n = x.shape
    xv = x.reshape(m, n // gran_k, gran_k)
    sf = (np.maximum(np.max(np.abs(xv), axis=2), f32(1e-4)) / E4M3_MAX).astype(f32)
    t = (xv * (f32(1.0) / sf)[..., None]).astype(f32)
    return _e4m3_codes(np.clip(t, -E4M3_MAX, E4M3_MAX)).reshape(m, n), sf


def test_deepgemm_per_token_cast_is_dynamic_group_128_with_eps_1e4(rng):
    x = _activations(rng, 80, 1024, group=128)
    x[2, :128] = 3.0e-6                                   # a group under the clamp
    q, s, _ = ref.dynamic_quantize_lowbit_ref(x, scope="group", group_size=128, out_dtype="fp8_e4m3", eps=1e-4)
    q_dg, s_dg = deepgemm_per_token_cast(x)
    assert np.array_equal(q, q_dg) and np.array_equal(s, s_dg)


# -- torchao MX, ScaleCalculationMode.FLOOR ---------------------------------------------------------
def torchao_mx_floor(x, block=32):
    """pytorch/ao torchao/prototype/mx_formats/mx_tensor.py, to_mx(scaling_mode=FLOOR), e4m3:
    ``extracted_pow2 = ((bits(max_abs) >> 23) & 0xFF) - 127``; ``unbiased = extracted_pow2 - 8``
    (F8E4M3_MAX_POW2), clamped to [-127, 128]; code ``unbiased + 127``; data ``x * 2^(127 - code)``
    (_e8m0_scale_to_reciprocal_fp32), then ``.to(float8_e4m3fn)``, clamped to +-448 first."""
    m, n = x.shape
    xv = x.reshape(m, n // block, block)
    amax = np.max(np.abs(xv), axis=2).astype(f32)
    pow2 = ((amax.view(np.uint32) >> 23) & 0xFF).astype(np.int64) - 127
    code = (np.clip(pow2 - 8, -127, 128) + 127).astype(np.int64)
    rcp = np.where(code == 254, np.uint32(0x00400000),
                   ((254 - code) << 23).astype(np.uint32)).astype(np.uint32).view(f32)
    t = (xv * rcp[..., None]).astype(f32)
    return _e4m3_codes(np.clip(t, -E4M3_MAX, E4M3_MAX)).reshape(m, n), code.astype(np.uint8)


def test_torchao_mx_floor_is_the_mx_scale(rng):
    x = _activations(rng, 40, 512, group=32)
    x[3, 32:64] = 2.0 ** -130                             # a block under float32's normal range
    x[4, :32] = 448.0 * 2.0 ** 5                          # an exact power-of-two amax
    q, s, _ = ref.dynamic_quantize_lowbit_ref(x, scope="group", group_size=32, out_dtype="fp8_e4m3",
                                              scale_dtype="e8m0")
    q_ao, s_ao = torchao_mx_floor(x)
    assert np.array_equal(s, s_ao) and np.array_equal(q, q_ao)


# -- where the rules differ (what a numerics profile has to add): measured, documented ---------------
def vllm_per_token_fp8(x, scale_ub=None):
    """vllm-project/vllm csrc/quantization/w8a8/fp8/common.cu,
    dynamic_per_token_scaled_fp8_quant_kernel_strided: ``token_scale = scale_ub ? fminf(amax, *scale_ub)
    : amax``; ``fmaxf(token_scale / 448, 1 / (448 * 512.0f))``; ``x / token_scale`` (IEEE division),
    clamped, e4m3."""
    amax = np.max(np.abs(x), axis=-1, keepdims=True).astype(f32)
    if scale_ub is not None:
        amax = np.minimum(amax, f32(scale_ub))
    scale = np.maximum(amax / E4M3_MAX, f32(1.0) / (E4M3_MAX * f32(512.0))).astype(f32)
    return _e4m3_codes(_clamp448((x / scale).astype(f32))), scale[..., 0]


def test_vllm_per_token_fp8_divides_where_skuforge_multiplies(rng):
    """The same scales (for rows above vLLM's floor), but vLLM divides by them: codes differ by one
    e4m3 step, on about 0.04 % of random bf16 activations and on values next to a rounding tie
    (docs/numerics.md, "Other engines' rules")."""
    x = _activations(rng, 256, 4096)
    q, s, _ = ref.dynamic_quantize_lowbit_ref(x, scope="token", out_dtype="fp8_e4m3")
    q_v, s_v = vllm_per_token_fp8(x)
    live = np.max(np.abs(x), axis=-1) / 448 >= 1 / (448 * 512)
    assert np.array_equal(s[live], s_v[live])
    random, ties = (q != q_v)[:256][live[:256]], (q != q_v)[256:]
    assert 0 < random.mean() < 2e-3 and ties.mean() > 1e-2
    a, b = (c[live].view(ml_dtypes.float8_e4m3fn).astype(np.float64) for c in (q, q_v))
    assert np.all(np.abs(a - b) <= 2.0 ** -3 * np.maximum(np.abs(b), 2.0 ** -6))     # one step at most
