"""GPU: every static quantize/dequantize SKU, bit-exact against the NumPy reference."""
import numpy as np
import pytest

import runtime as sf
import runtime.reference  # noqa: F401  (sf.reference)
from codegen.harness import verify
from codegen.harness.checks import base as checks

pytestmark = pytest.mark.gpu

REG = sf.default_registry()
STATIC = [s for s in REG.skus() if s.op in ("quantize", "dequantize")]


@pytest.mark.parametrize("sku", STATIC, ids=str)
def test_static_sku_bit_exact(sku, rng):
    res = verify.check(sku, rng)
    assert res.passed, f"{res.detail}: {res.failures[:5]}"


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_frameworks_return_their_own_type(fw, rng):
    pytest.importorskip("torch")
    x = rng.standard_normal((33, 64)).astype(np.float32)
    xd = checks.to_device(x, fw)
    q = sf.quantize(xd, 0.05, scope="tensor")
    assert type(q) is type(xd)
    np.testing.assert_array_equal(checks.to_host(q), sf.reference.quantize(x, np.float32(0.05), scope="tensor"))


def test_torch_non_default_stream(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    s = torch.rand(4096, device="cuda") + 0.01
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        big = x * 2  # queued on the side stream: the kernel must be ordered after it
        q = sf.quantize(big, s, scope="token")
    stream.synchronize()
    want = sf.reference.quantize(checks.to_host(big), s.cpu().numpy(), scope="token")
    np.testing.assert_array_equal(q.cpu().numpy(), want)


def test_cupy_non_default_stream(rng):
    import cupy as cp
    x = cp.asarray(rng.standard_normal((512, 256)).astype(np.float32))
    s = cp.asarray((rng.random(512) + 0.01).astype(np.float32))
    with cp.cuda.Stream(non_blocking=True) as st:
        y = x * 3
        q = sf.quantize(y, s, scope="token", out_dtype="uint8")
    st.synchronize()
    np.testing.assert_array_equal(q.get(), sf.reference.quantize(y.get(), s.get(), scope="token", out_dtype="u8"))


@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    """One SKU per family on > 2**31 elements: 64-bit indexing end to end."""
    import cupy as cp
    rows, d = 2**17 + 3, 2**14 + 16    # 2.15e9 elements, s8 in / f16 out
    q = cp.empty((rows, d), dtype=cp.int8)
    q[:] = cp.arange(d, dtype=cp.int32).astype(cp.int8)[None, :]
    q[-1, -7:] = cp.asarray(np.array([1, 2, 3, -4, -5, 6, 7], dtype=np.int8))
    scale = cp.asarray((np.arange(rows) % 7 + 1).astype(np.float32) * 0.25)
    y = sf.dequantize(q, scale, scope="token", out_dtype="float16")
    tail = y[-3:].get()
    want = sf.reference.dequantize(q[-3:].get(), scale[-3:].get(), scope="token", in_kind="s8", out_dtype="f16")
    np.testing.assert_array_equal(tail, want)
    head = y[:2].get()
    np.testing.assert_array_equal(head, sf.reference.dequantize(q[:2].get(), scale[:2].get(), scope="token",
                                                                in_kind="s8", out_dtype="f16"))
    del y, q
    cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_repeated_calls_take_the_replay_correctly(fw, rng):
    """Same-shaped repeated calls reuse a prepared launch: new data, new pointers, new scalar
    scales and misaligned views must all still give the reference bits; bad scalars still raise."""
    if fw == "torch":
        pytest.importorskip("torch")
    shape = (64, 512)
    for trial in range(4):
        x = rng.standard_normal(shape).astype(np.float32) * 10
        s = np.float32(rng.random() + 0.05)
        xd = checks.to_device(x, fw)
        got = sf.quantize(xd, float(s), scope="tensor")
        np.testing.assert_array_equal(checks.to_host(got), sf.reference.quantize(x, s, scope="tensor"))
        sv = (rng.random(64) + 0.05).astype(np.float32)
        out = checks.to_device(np.zeros(shape, np.int8), fw)
        res = sf.quantize(xd, checks.to_device(sv, fw), scope="token", out=out)
        assert res is out
        np.testing.assert_array_equal(checks.to_host(out), sf.reference.quantize(x, sv, scope="token"))
        # a view starting 4 bytes in: different alignment, must take the scalar path
        xs = xd.reshape(-1)[1:1 + 63 * 512].reshape(63, 512)
        np.testing.assert_array_equal(checks.to_host(sf.quantize(xs, float(s), scope="tensor")),
                                      sf.reference.quantize(x.reshape(-1)[1:1 + 63 * 512].reshape(63, 512), s,
                                                            scope="tensor"))
    with pytest.raises(sf.InvalidProblemError, match="positive"):
        sf.quantize(xd, -1.0, scope="tensor")
    with pytest.raises(sf.InvalidProblemError, match="zero_point"):
        sf.quantize(xd, 0.5, 300, scope="tensor")


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_sync_checks_raise_before_launch(fw, rng):
    """Under runtime.sync_checks() scales and zero points held on the device are value-checked on
    the host (one sync) and raise at the call that passed them; nothing is launched."""
    if fw == "torch":
        pytest.importorskip("torch")
    x = checks.to_device(rng.standard_normal((8, 64)).astype(np.float32), fw)
    with sf.sync_checks():
        _bad_values_raise(x, fw)
    sf.check()                        # nothing was launched: nothing pending


def _bad_values_raise(x, fw):
    for bad in (0.0, -1.0, np.inf, np.nan):
        s = np.full(8, 0.5, np.float32)
        s[3] = bad
        with pytest.raises(sf.InvalidProblemError, match="positive and finite"):
            sf.quantize(x, checks.to_device(s, fw), scope="token")
    zp = np.zeros(8, np.int32)
    zp[5] = 200
    with pytest.raises(sf.InvalidProblemError, match=r"\[-128, 127\]"):
        sf.quantize(x, checks.to_device(np.full(8, 0.5, np.float32), fw), checks.to_device(zp, fw), scope="token")
    q = checks.to_device(np.zeros((8, 64), np.int8), fw)
    with pytest.raises(sf.InvalidProblemError, match="positive and finite"):
        sf.dequantize(q, checks.to_device(np.full(8, -0.5, np.float32), fw), scope="token")
