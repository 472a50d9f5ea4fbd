"""GPU: arrays aligned to their element but not to the words a kernel moves them in.

Each case plants one such array (an output, a workspace, an input) on the device and checks that the
call raises an InvalidProblemError naming the argument, its offset and the alignment (an explicit
tensor-core strategy, a misaligned MoE workspace) or returns the right results (every quantization
op, which then runs its scalar path; ``strategy="simt"``; ``strategy="auto"``, which picks a
backend that takes the array). After every test the CUDA context still works: nothing is pending,
a CuPy kernel runs and the device synchronizes (a misaligned access would have left a sticky error
there), and a small quantize is exact (docs/errors.md, "Alignment").

    python -m pytest -q tests/core/test_gpu_alignment.py
"""
import numpy as np
import pytest

import runtime as sf
import runtime.reference  # noqa: F401  (sf.reference)
from runtime import InvalidProblemError
from runtime import reference_moe as ref_moe

pytestmark = pytest.mark.gpu

M, N, K, E = 64, 64, 64, 4
OFFS = np.array([0, 16, 16, 40, 64], np.int32)      # expert 1 has no rows


def _cp():
    import cupy as cp
    return cp


def _sm90() -> bool:
    return _cp().cuda.Device().compute_capability == "90"


def assert_context_healthy():
    """Nothing reported, a kernel runs and the device synchronizes, a quantize is exact."""
    cp = _cp()
    cp.cuda.Device().synchronize()
    a = cp.arange(1024, dtype=cp.float32)
    assert float((a * 2).sum()) == 1047552.0
    cp.cuda.Device().synchronize()
    x = np.linspace(-3, 3, 4096, dtype=np.float32).reshape(16, 256)
    q = sf.quantize(cp.asarray(x), 0.05, scope="tensor")
    np.testing.assert_array_equal(q.get(), sf.reference.quantize(x, np.float32(0.05), scope="tensor"))
    sf.check()


@pytest.fixture(autouse=True)
def healthy():
    yield
    assert_context_healthy()


def at(shape, dtype, off=0, values=None):
    """A CuPy array of ``shape`` whose data starts ``off`` bytes past a 256-byte boundary (zeros, or
    ``values``)."""
    cp = _cp()
    dt = np.dtype(dtype)
    assert off % dt.itemsize == 0, "element-aligned only: the calls check element alignment themselves"
    nbytes = int(np.prod(shape)) * dt.itemsize
    buf = cp.zeros(nbytes + off + 16, cp.uint8)
    a = cp.ndarray(shape, dt, memptr=cp.cuda.MemoryPointer(buf.data.mem, buf.data.ptr - buf.data.mem.ptr + off))
    assert a.data.ptr % 256 == off
    if values is not None:
        a[...] = cp.asarray(np.asarray(values, dtype=dt))
    return a


def _moe_inputs(rng, x_off=0, w_off=0, dy_off=0):
    xh = (rng.standard_normal((M, K)) / 4).astype(np.float16)
    wh = (rng.standard_normal((E, N, K)) / 8).astype(np.float16)
    dyh = (rng.standard_normal((M, N)) / 4).astype(np.float16)
    return (xh, wh, dyh), (at((M, K), np.float16, x_off, xh), at((E, N, K), np.float16, w_off, wh),
                           at((M, N), np.float16, dy_off, dyh), _cp().asarray(OFFS))


def _close(got, want, kind="f16"):
    assert ref_moe.rel_error(got, want) <= ref_moe.TOLERANCE[kind], ref_moe.rel_error(got, want)


def _skip_wgmma(strategy):
    if strategy == "wgmma" and not _sm90():
        pytest.skip("the wgmma kernels run on sm_90 only")


# -- the reproducer ------------------------------------------------------------------------------------
def test_mma_out_two_bytes_off_is_refused_and_the_context_survives(rng):
    """``out=buf[1:].view(64, 64)`` (f16, 2 bytes off a 4-byte boundary) with strategy="mma": the
    epilogue would store 32-bit pairs there (cudaErrorMisalignedAddress, the context lost). It is an
    InvalidProblemError naming out, the offset and the alignment; the next calls run."""
    cp = _cp()
    (xh, wh, _), (x, w, _, o) = _moe_inputs(rng)
    buf = cp.zeros(64 * 64 + 1, cp.float16)
    out = buf[1:].reshape(64, 64)
    assert out.data.ptr % 4 == 2
    with pytest.raises(InvalidProblemError) as e:
        sf.grouped_matmul(x, w, offsets=o, strategy="mma", out=out)
    msg = str(e.value)
    assert "out at" in msg and "2 bytes past a 4-byte boundary" in msg and "strategy='simt'" in msg, msg
    assert_context_healthy()
    want = ref_moe.grouped_matmul(xh, wh, offsets=OFFS)
    _close(sf.grouped_matmul(x, w, offsets=o, strategy="mma").get(), want)
    assert sf.grouped_matmul(x, w, offsets=o, out=out) is out          # auto: a backend that takes it
    _close(out.get(), want)


def test_the_reproducer_with_torch():
    torch = pytest.importorskip("torch")
    x = torch.randn(M, K, device="cuda", dtype=torch.float16) / 4
    w = torch.randn(E, N, K, device="cuda", dtype=torch.float16) / 8
    o = torch.tensor(OFFS, device="cuda")
    buf = torch.zeros(64 * 64 + 1, dtype=torch.float16, device="cuda")
    out = buf[1:].view(64, 64)
    with pytest.raises(InvalidProblemError, match=r"out at 0x[0-9a-f]+ is 2 bytes past a 4-byte boundary"):
        sf.grouped_matmul(x, w, offsets=o, strategy="mma", out=out)
    torch.cuda.synchronize()
    y = sf.grouped_matmul(x, w, offsets=o, out=out)
    torch.cuda.synchronize()
    _close(y.cpu().numpy(), ref_moe.grouped_matmul(x.cpu().numpy(), w.cpu().numpy(), offsets=OFFS))


# -- MoE: every strategy, outputs, gradients, operands, workspace ----------------------------------------
def _refuses(strategy, off, pair):
    """Whether ``strategy`` must refuse an output ``off`` bytes past 256 whose pairs are ``pair`` bytes."""
    return (strategy == "mma" and off % pair) or (strategy == "wgmma" and off % 16)


@pytest.mark.parametrize("strategy", ["auto", "simt", "mma", "wgmma"])
@pytest.mark.parametrize("off", [0, 2, 4, 6, 8])
def test_forward_out(rng, strategy, off):
    _skip_wgmma(strategy)
    (xh, wh, _), (x, w, _, o) = _moe_inputs(rng)
    out = at((M, N), np.float16, off)
    if _refuses(strategy, off, 4):
        with pytest.raises(InvalidProblemError, match=rf"out at 0x[0-9a-f]+ is {off % (4 if strategy == 'mma' else 16)} "
                                                      r"bytes past a (4|16)-byte boundary"):
            sf.grouped_matmul(x, w, offsets=o, strategy=strategy, out=out)
        return
    assert sf.grouped_matmul(x, w, offsets=o, strategy=strategy, out=out) is out
    _close(out.get(), ref_moe.grouped_matmul(xh, wh, offsets=OFFS))


@pytest.mark.parametrize("strategy", ["auto", "simt", "mma", "wgmma"])
@pytest.mark.parametrize("dx_off, dw_off, dw_dtype", [(2, 0, "float32"), (0, 4, "float32"), (4, 8, "float32"),
                                                      (0, 2, "float16"), (6, 12, "float32"), (8, 16, "float16")])
def test_backward_gradients(rng, strategy, dx_off, dw_off, dw_dtype):
    _skip_wgmma(strategy)
    (xh, wh, dyh), (x, w, dy, o) = _moe_inputs(rng)
    dx = at((M, K), np.float16, dx_off)
    dw = at((E, N, K), dw_dtype, dw_off)
    dw_pair = 2 * np.dtype(dw_dtype).itemsize
    if _refuses(strategy, dx_off, 4) or _refuses(strategy, dw_off, dw_pair):
        arg = "out\\[0\\] \\(dx\\)" if _refuses(strategy, dx_off, 4) else "out\\[1\\] \\(dw\\)"
        with pytest.raises(InvalidProblemError, match=rf"{arg} at 0x[0-9a-f]+ is \d+ bytes past an? \d+-byte boundary"):
            sf.grouped_matmul_backward(x, w, dy, offsets=o, strategy=strategy, dw_dtype=dw_dtype, out=(dx, dw))
        return
    got = sf.grouped_matmul_backward(x, w, dy, offsets=o, strategy=strategy, dw_dtype=dw_dtype, out=(dx, dw))
    assert got[0] is dx and got[1] is dw
    want_dx, want_dw = ref_moe.grouped_matmul_backward(xh, wh, dyh, offsets=OFFS)
    _close(dx.get(), want_dx)
    _close(dw.get(), want_dw, "f32" if dw_dtype == "float32" else "f16")


@pytest.mark.parametrize("strategy", ["auto", "simt", "mma", "wgmma"])
@pytest.mark.parametrize("arg", ["x", "w", "dy"])
def test_operands_eight_bytes_off(rng, strategy, arg):
    """The mma / wgmma kernels copy operands 16 bytes at a time: refused there; simt and auto run."""
    _skip_wgmma(strategy)
    (xh, wh, dyh), (x, w, dy, o) = _moe_inputs(rng, **{f"{arg}_off": 8})
    if strategy in ("mma", "wgmma"):
        with pytest.raises(InvalidProblemError, match=rf"{arg} at 0x[0-9a-f]+ is 8 bytes past a 16-byte boundary"):
            sf.grouped_matmul_backward(x, w, dy, offsets=o, strategy=strategy)
        return
    dx, dw = sf.grouped_matmul_backward(x, w, dy, offsets=o, strategy=strategy)
    want_dx, want_dw = ref_moe.grouped_matmul_backward(xh, wh, dyh, offsets=OFFS)
    _close(dx.get(), want_dx)
    _close(dw.get(), want_dw, "f32")


@pytest.mark.parametrize("strategy", ["auto", "simt", "mma", "wgmma"])
@pytest.mark.parametrize("off", [1, 4, 8])
def test_workspace_off_its_16_bytes(rng, strategy, off):
    _skip_wgmma(strategy)
    _, (x, w, dy, o) = _moe_inputs(rng)
    ws = at((sf.moe.grouped_matmul_workspace_size(M, E, "offsets"),), np.uint8, off)
    with pytest.raises(InvalidProblemError, match=rf"workspace at 0x[0-9a-f]+ is {off} bytes past a 16-byte boundary"):
        sf.grouped_matmul_backward(x, w, dy, offsets=o, strategy=strategy, workspace=ws)


def test_row_experts_routing_with_a_misaligned_out(rng):
    """row_experts routing (mma or simt: the wgmma kernels need offsets) and an out 2 bytes off."""
    cp = _cp()
    (xh, wh, _), (x, w, _, _) = _moe_inputs(rng)
    ids_h = rng.integers(-1, E + 1, M).astype(np.int32)
    ids = cp.asarray(ids_h)
    out = at((M, N), np.float16, 2)
    with pytest.raises(InvalidProblemError, match="2 bytes past a 4-byte boundary"):
        sf.grouped_matmul(x, w, row_experts=ids, strategy="mma", out=out)
    sf.grouped_matmul(x, w, row_experts=ids, out=out)
    _close(out.get(), ref_moe.grouped_matmul(xh, wh, row_experts=ids_h))


def test_a_repeated_call_moved_off_its_alignment_is_decided_again(rng):
    """A remembered (replayed) mma call, then the same layouts with out 2 bytes off: refused, not
    replayed onto the misaligned array; auto then runs it elsewhere."""
    (xh, wh, _), (x, w, _, o) = _moe_inputs(rng)
    want = ref_moe.grouped_matmul(xh, wh, offsets=OFFS)
    for _ in range(3):
        out = at((M, N), np.float16, 0)
        sf.grouped_matmul(x, w, offsets=o, strategy="mma", out=out)
        _close(out.get(), want)
    out = at((M, N), np.float16, 2)
    with pytest.raises(InvalidProblemError, match="2 bytes past a 4-byte boundary"):
        sf.grouped_matmul(x, w, offsets=o, strategy="mma", out=out)
    for _ in range(3):
        out = at((M, N), np.float16, 2)
        sf.grouped_matmul(x, w, offsets=o, out=out)
        _close(out.get(), want)


# -- quantization: a misaligned array runs the scalar path, with the same results -------------------------
def _same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8))  # bits, 0-d too


def _host(r):
    return tuple(None if a is None else a.get() for a in r) if isinstance(r, tuple) else r.get()


QUANT = {}      # name -> (make(rng) -> call(off), byte offsets off the vector's word, element-aligned)


def case(*offs):
    def deco(make):
        QUANT[make.__name__.replace("__", ", ").replace("_", " ")] = (make, offs)
        return make
    return deco


def _data(r, shape, dtype=np.float16):
    return at(shape, dtype, 0, r.standard_normal(shape))


def _scales(r, shape, lo=0.01):
    return at(shape, np.float32, 0, r.random(shape) / 50 + lo)


@case(1, 2, 4, 8)
def quantize_token__q(r):
    x, s = _data(r, (32, 256)), _scales(r, (32,))
    return lambda off: sf.quantize(x, s, scope="token", out=at((32, 256), np.int8, off))


@case(2, 4, 8)
def quantize_token__x(r):
    xh, s = r.standard_normal((32, 256)), _scales(r, (32,))
    return lambda off: sf.quantize(at((32, 256), np.float16, off, xh), s, scope="token")


@case(4, 8, 12)
def dequantize_token__y(r):
    q, s = at((32, 256), np.int8, 0, r.integers(-128, 128, (32, 256))), _scales(r, (32,))
    return lambda off: sf.dequantize(q, s, scope="token", out=at((32, 256), np.float32, off))


@case(4, 8, 12)
def quantize_channel_last__scale(r):
    x, sh = _data(r, (32, 256)), r.random(256) / 50 + 0.01
    return lambda off: sf.quantize(x, at((256,), np.float32, off, sh), scope="channel", axis=1)


@case(2, 4, 8)
def fake_quantize_group__out(r):
    x, s = _data(r, (32, 256)), _scales(r, (32, 8))
    return lambda off: sf.fake_quantize(x, s, scope="group", group_size=32, out=at((32, 256), np.float16, off))


@case(4, 8, 12)
def quantize_backward_token__out(r):
    dy, x, s = _data(r, (32, 256), np.float32), _data(r, (32, 256), np.float32), _scales(r, (32,))
    return lambda off: sf.quantize_backward(dy, x, s, scope="token", out=at((32, 256), np.float32, off))


@case(4, 8, 12)
def fake_quantize_learnable_backward_token__dx(r):
    dy, x, s = _data(r, (32, 256), np.float32), _data(r, (32, 256), np.float32), _scales(r, (32,))
    return lambda off: sf.fake_quantize_learnable_backward(dy, x, s, scope="token", out=at((32, 256), np.float32, off))


@case(1, 4, 8)
def quantize_fp8__q(r):
    x, s = _data(r, (32, 256)), _scales(r, (32,))
    return lambda off: sf.quantize(x, s, scope="token", out_dtype="fp8_e4m3", out=at((32, 256), np.uint8, off))


@case(1, 2, 3)
def quantize_int4__q(r):
    x, s = _data(r, (32, 256)), _scales(r, (32,), 0.1)
    return lambda off: sf.quantize(x, s, scope="token", out_dtype="int4", out=at((32, 128), np.uint8, off))


@case(2, 4, 8)
def dequantize_fp8__y(r):
    q, s = at((32, 256), np.uint8, 0, r.integers(0, 120, (32, 256))), _scales(r, (32,))
    return lambda off: sf.dequantize(q, s, scope="token", in_dtype="fp8_e4m3", out_dtype="float16",
                                     out=at((32, 256), np.float16, off))


@case(1, 4, 8)
def dynamic_quantize_token__q(r):
    x = _data(r, (32, 512))
    return lambda off: sf.dynamic_quantize(x, scope="token", out=(at((32, 512), np.int8, off), at((32,), np.float32)))


@case(2, 8)
def dynamic_quantize_token__x(r):
    xh = r.standard_normal((32, 512))
    return lambda off: sf.dynamic_quantize(at((32, 512), np.float16, off, xh), scope="token")


@case(1, 2, 8)
def dynamic_quantize_group_fp8__q(r):
    x = _data(r, (32, 512))
    return lambda off: sf.dynamic_quantize(x, scope="group", group_size=128, out_dtype="fp8_e4m3",
                                           out=(at((32, 512), np.uint8, off), at((32, 4), np.float32)))


@case(1, 2, 3)
def dynamic_quantize_group_int4__q(r):
    x = _data(r, (32, 512))
    return lambda off: sf.dynamic_quantize(x, scope="group", group_size=64, out_dtype="int4",
                                           out=(at((32, 256), np.uint8, off), at((32, 8), np.float32)))


@case(1, 2, 4, 8)
def dynamic_quantize_tensor__q(r):
    x = _data(r, (64, 256))
    return lambda off: sf.dynamic_quantize(x, scope="tensor", out=(at((64, 256), np.int8, off), at((), np.float32)))


@case(1, 4, 8)
def dynamic_quantize_channel__q(r):
    x = _data(r, (64, 256), np.float32)
    return lambda off: sf.dynamic_quantize(x, scope="channel", axis=1, mode="asymmetric", out_dtype="uint8",
                                           out=(at((64, 256), np.uint8, off), at((256,), np.float32),
                                                at((256,), np.int32)))


@pytest.mark.parametrize("name", list(QUANT))
def test_quantization_misaligned_array_matches_the_aligned_call(rng, name):
    """The scalar path a misaligned array takes gives the bits the vector path gives (which the
    family's GPU tests hold against the reference)."""
    make, offs = QUANT[name]
    call = make(rng)
    want = _host(call(0))
    for off in offs:
        got = _host(call(off))
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            if w is None:
                assert g is None
            elif name.startswith("fake quantize learnable") and g.ndim == 1:
                np.testing.assert_allclose(g, w, rtol=1e-6)      # dscale: sums of the same terms
            else:
                _same(g, w)


def test_quantize_misaligned_out_against_the_reference(rng):
    xh = rng.standard_normal((32, 256)).astype(np.float16)
    sh = (rng.random(32) / 50 + 0.01).astype(np.float32)
    x, s = at((32, 256), np.float16, 0, xh), at((32,), np.float32, 0, sh)
    want = sf.reference.quantize(xh, sh, scope="token")
    for off in (1, 2, 3, 4, 5, 8):
        q = at((32, 256), np.int8, off)
        assert sf.quantize(x, s, scope="token", out=q) is q
        _same(q.get(), want)
