"""GPU: the low-bit SKUs (docs/lowbit.md), bit-exact against the NumPy reference.

- every low-bit SKU through ``codegen.harness.checks.lowbit`` (each SKU itself: sm80 software SKUs run
  under ``runtime.quantization.lowbit.prefer_arch(80)`` on newer GPUs);
- the hardware conversion (sm89 SKUs, ``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32``) equals the
  software conversion (sm80 SKUs) on all 2**32 float32 bit patterns, and both equal the reference
  on a random million of them; decode of all 256 codes both ways;
- fp8 dtypes in and out for torch, uint8 containers for CuPy; the int4 nibble order against torch;
  MX round trip; run-to-run determinism; > 2**31 elements (slow).
"""
import numpy as np
import pytest

import runtime as sf
from codegen.harness import verify
from codegen.harness.checks import base as checks
from codegen.harness.checks import lowbit as checks_lowbit
from runtime import kinds
from runtime.quantization import lowbit
from runtime import reference as ref
from runtime.arrays import kind_of

pytestmark = pytest.mark.gpu

REG = sf.default_registry()
LOWBIT = [s for s in REG.skus() if checks_lowbit.handles(s)]
FP8 = kinds.FP8


def _cc():
    import cupy as cp
    d = cp.cuda.Device()
    return int(d.compute_capability)


@pytest.mark.parametrize("sku", LOWBIT, ids=str)
def test_lowbit_sku_bit_exact(sku, rng):
    if sku.arch_number > _cc():
        pytest.skip(f"{sku.arch} kernel on an sm_{_cc()} device")
    res = verify.check(sku, rng)
    assert res.passed, f"{res.detail}: {res.failures[:5]}"


@pytest.mark.parametrize("kind", FP8)
def test_hardware_conversion_equals_software_on_every_float32(kind, rng):
    import cupy as cp
    if _cc() < 89:
        pytest.skip("no fp8 conversion instructions before sm_89")
    chunk = 1 << 28
    bad = 0
    for start in range(0, 1 << 32, chunk):
        x = cp.arange(start, start + chunk, dtype=cp.uint64).astype(cp.uint32).view(cp.float32).reshape(1 << 14, -1)
        with lowbit.prefer_arch(80):
            sw = sf.quantize(x, 1.0, scope="tensor", out_dtype=kind)
        with lowbit.prefer_arch(89):
            hw = sf.quantize(x, 1.0, scope="tensor", out_dtype=kind)
        bad += int((sw != hw).sum())
        if start == 0 or start == 1 << 31:        # and the reference on a random sample of each half
            idx = cp.asarray(rng.integers(0, chunk, 1 << 20))
            xs = x.reshape(-1)[idx].get()
            np.testing.assert_array_equal(hw.reshape(-1)[idx].get(), ref.fp8_encode(xs * np.float32(1), kind))
        del x, sw, hw
    assert bad == 0


@pytest.mark.parametrize("kind", FP8)
@pytest.mark.parametrize("out", ["float32", "float64", "float16", "bfloat16"])
def test_decode_every_code_both_ways(kind, out):
    import cupy as cp
    codes = np.arange(256, dtype=np.uint8).reshape(4, 64)
    want = ref.dequantize_lowbit(codes, np.float64(1.0) if out == "float64" else np.float32(1.0), scope="tensor",
                                 in_kind=kind, out_dtype=kind_of(out))
    for arch in (80, 89):
        if arch > _cc():
            continue
        with lowbit.prefer_arch(arch):
            y = sf.dequantize(cp.asarray(codes), 1.0, scope="tensor", in_dtype=kind, out_dtype=out)
        got = checks.to_host(y)
        nan = np.isnan(want.astype(np.float64))
        assert (np.isnan(got.astype(np.float64)) == nan).all()
        np.testing.assert_array_equal(got[~nan].view(np.uint8), want[~nan].view(np.uint8))


def test_torch_fp8_dtypes_and_cupy_containers(rng):
    torch = pytest.importorskip("torch")
    import cupy as cp
    x = (rng.standard_normal((64, 256)) * 100).astype(np.float32)
    s = (2.0 ** rng.integers(-2, 3, 64)).astype(np.float32)
    want = ref.quantize_lowbit(x, s, scope="token", out_dtype="fp8_e4m3")
    qt = sf.quantize(torch.from_numpy(x).cuda(), torch.from_numpy(s).cuda(), scope="token", out_dtype="fp8_e4m3")
    assert qt.dtype == torch.float8_e4m3fn and qt.shape == (64, 256)
    np.testing.assert_array_equal(qt.view(torch.uint8).cpu().numpy(), want)
    # torch's own cast of the same products agrees where no saturation happens
    t = torch.from_numpy(x).cuda() * (1 / torch.from_numpy(s).cuda())[:, None]
    inside = t.abs() <= 448
    assert torch.equal(qt.view(torch.uint8)[inside], t.to(torch.float8_e4m3fn).view(torch.uint8)[inside])
    qc = sf.quantize(cp.asarray(x), cp.asarray(s), scope="token", out_dtype="fp8_e4m3")
    assert qc.dtype == np.uint8
    np.testing.assert_array_equal(qc.get(), want)
    # dequantize: the dtype says the kind for torch; in_dtype for the uint8 container
    yt = sf.dequantize(qt, torch.from_numpy(s).cuda(), scope="token")
    yc = sf.dequantize(qc, cp.asarray(s), scope="token", in_dtype="fp8_e4m3")
    np.testing.assert_array_equal(yt.cpu().numpy(), yc.get())


def test_int4_nibble_order_against_torch(rng):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy((rng.standard_normal((32, 128)) * 4).astype(np.float32)).cuda()
    for kind, lo, hi, zp in (("int4", -8, 7, 0), ("uint4", 0, 15, 8)):
        q = sf.quantize(x, 0.5, scope="tensor", out_dtype=kind)
        assert q.dtype == torch.uint8 and q.shape == (32, 64)
        v = torch.stack([(q & 0xF).int(), (q >> 4).int()], -1).reshape(32, 128)
        if kind == "int4":
            v = torch.where(v >= 8, v - 16, v)
        np.testing.assert_array_equal(v.cpu().numpy(), (torch.round(x * 2) + zp).clamp(lo, hi).int().cpu().numpy())


def test_mx_round_trip(rng):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(rng.standard_normal((256, 1024)).astype(np.float32) * 10).cuda().to(torch.bfloat16)
    q, s, zp = sf.dynamic_quantize(x, scope="group", group_size=32, out_dtype="fp8_e4m3", scale_dtype="e8m0")
    assert zp is None and s.dtype == torch.uint8 and s.shape == (256, 32) and q.dtype == torch.float8_e4m3fn
    xh = checks.to_host(x)
    q_ref, s_ref, _ = ref.dynamic_quantize_lowbit_ref(xh, scope="group", group_size=32, out_dtype="fp8_e4m3",
                                                      scale_dtype="e8m0")
    np.testing.assert_array_equal(s.cpu().numpy(), s_ref)
    np.testing.assert_array_equal(q.view(torch.uint8).cpu().numpy(), q_ref)
    y = sf.dequantize(q, s, scope="group", group_size=32, scale_dtype="e8m0", out_dtype="float32")
    np.testing.assert_array_equal(y.cpu().numpy(), ref.dequantize_lowbit(q_ref, s_ref, scope="group", group_size=32,
                                                                         in_kind="fp8_e4m3", scale_dtype="e8m0"))


@pytest.mark.parametrize("kind", ["fp8_e4m3", "s4"])
@pytest.mark.parametrize("scope", ["tensor", "channel", "token", "group"])
def test_dynamic_is_deterministic(kind, scope, rng):
    import cupy as cp
    x = cp.asarray((rng.standard_normal((4096, 512)) * 3).astype(np.float32))
    kw = dict(scope=scope, out_dtype=kind, axis=1 if scope == "channel" else None,
              group_size=128 if scope == "group" else None)
    a = sf.dynamic_quantize(x, **kw)
    b = sf.dynamic_quantize(x, **kw)
    assert all(bool((u == v).all()) for u, v in zip(a[:2], b[:2]))


@pytest.mark.slow
def test_more_than_2_31_elements():
    torch = pytest.importorskip("torch")
    rows, d = (1 << 31) // 4096 + 3, 4096
    x = torch.empty((rows, d), device="cuda", dtype=torch.bfloat16).normal_()
    q, s, _ = sf.dynamic_quantize(x, scope="group", group_size=128, out_dtype="fp8_e4m3")
    qi, si, _ = sf.dynamic_quantize(x, scope="group", group_size=128, out_dtype="int4")
    for r in (0, rows // 2, rows - 1):
        xr = checks.to_host(x[r:r + 1])
        q_ref, s_ref, _ = ref.dynamic_quantize_lowbit_ref(xr, scope="group", group_size=128, out_dtype="fp8_e4m3")
        np.testing.assert_array_equal(q[r:r + 1].view(torch.uint8).cpu().numpy(), q_ref)
        qi_ref, _, _ = ref.dynamic_quantize_lowbit_ref(xr, scope="group", group_size=128, out_dtype="s4")
        np.testing.assert_array_equal(qi[r:r + 1].cpu().numpy(), qi_ref)
