"""GPU: fake_quantize's bit-packed mask and the backward that reads it (docs/numerics.md "Mask bits").

The bits (``return_mask="bits"``) equal ``numpy.packbits(bool mask, axis=-1, bitorder="little")`` and
the byte mask of the same kernel, for every dtype, scope and mode, with NaN / ±inf / .5 ties /
saturation, D not a multiple of 8, strided and misaligned rows (the scalar path) and an invalid scale
element; ``fake_quantize_backward_from_mask`` equals the reference bit for bit; autograd through
``runtime.torch.fake_quantize`` (which keeps only the bits) gives the x.grad of the recomputing
backward; forward + backward capture in a CUDA graph and compile with ``torch.compile(fullgraph=True)``."""
import contextlib

import numpy as np
import pytest

import runtime as sf
from codegen.harness import verify
from codegen.harness.checks import base as checks
from codegen.harness.checks import training as ct
from runtime import reference as ref
from runtime.launch import grid_cap
from runtime.scopes import param_shape

pytestmark = pytest.mark.gpu

REG = sf.default_registry()
KINDS = ("f32", "f64", "f16", "bf16")
# (scope, axis, group_size)
SCOPES = [("tensor", None, None), ("channel", 0, None), ("channel", -1, None), ("token", None, None),
          ("group", None, 8), ("group", None, 12)]
# (shape, layout): D a multiple of 8 (the vector path) or not (the scalar path), strided or misaligned rows
SHAPES = [((33, 64), "contiguous"), ((6, 5, 96), "strided"), ((17, 60), "contiguous"), ((9, 36), "strided"),
          ((12, 48), "offset"), ((3, 24), "contiguous")]


def _fits(shape, scope, gs):
    return scope != "group" or shape[-1] % gs == 0


def _inputs(kind, shape, scope, axis, gs, mode, rng):
    mk = "f64" if kind == "f64" else "f32"
    ax = None if axis is None else axis % len(shape)
    pshape = param_shape(shape, scope, ax, gs)
    scale = ct._scales(pshape, rng, mk, pow2=rng.random() < 0.7)
    qmin, qmax = ct.FQ_RANGES[int(rng.integers(len(ct.FQ_RANGES)))]
    zp = rng.integers(qmin, qmax + 1, size=pshape).astype(np.int32) if mode == "asymmetric" else None
    x = ct.grid_values(shape, scale, zp, ref.fake_quant_zero_point(qmin, qmax), qmin, qmax, scope, axis, gs, rng,
                       kind)
    return x, scale, zp, dict(scope=scope, axis=axis, group_size=gs, qmin=qmin, qmax=qmax)


def _layout(a, layout, rng):
    d = checks.to_device(a, "cupy")
    if layout == "strided":
        return checks.strided_rows(d, 4 + int(rng.integers(0, 12)), "cupy")
    if layout == "offset":
        return ct._offset_columns(d, "cupy")
    return d


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scope,axis,gs", SCOPES, ids=lambda v: str(v))
@pytest.mark.parametrize("mode", ["symmetric", "asymmetric"])
def test_bits_are_packbits_of_the_byte_mask(kind, scope, axis, gs, mode, rng):
    import cupy as cp
    for shape, layout in SHAPES:
        if not _fits(shape, scope, gs):
            continue
        x, scale, zp, kw = _inputs(kind, shape, scope, axis, gs, mode, rng)
        xd = _layout(x, layout, rng)
        sd, zd = cp.asarray(scale), (None if zp is None else cp.asarray(zp))
        with grid_cap(2) if layout == "strided" else contextlib.nullcontext():
            y0 = sf.fake_quantize(xd, sd, zd, **kw)
            y1, mask = sf.fake_quantize(xd, sd, zd, **kw, return_mask=True)
            y2, bits = sf.fake_quantize(xd, sd, zd, **kw, return_mask="bits")
        want_y, want_m = ref.fake_quantize(x, scale, zp, **kw)
        label = f"{kind} {scope} {mode} {shape} {layout}"
        assert bits.dtype == np.uint8 and bits.shape == shape[:-1] + (-(-shape[-1] // 8),), label
        assert (mask.get() == want_m).all(), label
        assert (bits.get() == np.packbits(mask.get(), axis=-1, bitorder="little")).all(), label
        assert (bits.get() == ref.pack_mask_bits(want_m)).all(), label
        for y in (y0, y1, y2):
            assert checks.same_bits(checks.to_host(y), want_y).all(), label
        assert 0 < want_m.sum() < want_m.size, label           # clipped and passing elements both present


@pytest.mark.parametrize("kind", KINDS)
def test_an_invalid_scale_element_clears_its_bits(kind, rng):
    """A NaN scale element: its row's bits are 0 (its y NaN), the others as usual; reported to the status
    word like the byte mask's kernel does."""
    import cupy as cp
    from runtime.arrays import numpy_dtype
    shape = (6, 40)
    mk = np.float64 if kind == "f64" else np.float32
    x = (rng.standard_normal(shape) * 4).astype(numpy_dtype(kind))
    scale = np.full(6, 0.5, mk)
    scale[2] = np.nan
    try:
        sf.check()
    except sf.DeviceValueError:
        pass
    _, bits = sf.fake_quantize(cp.asarray(x), cp.asarray(scale), scope="token", return_mask="bits")
    got = bits.get()
    assert (got[2] == 0).all() and got[np.arange(6) != 2].any()
    with pytest.raises(sf.DeviceValueError) as e:
        sf.check()
    assert (e.value.op, e.value.arg) == ("fake_quantize", "scale")


BACKWARD_SKUS = [s for s in REG.skus() if s.op == "fake_quantize_backward_from_mask"]


@pytest.mark.parametrize("sku", BACKWARD_SKUS, ids=str)
@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_backward_from_mask_bit_exact(sku, fw, rng):
    if fw == "torch":
        pytest.importorskip("torch")
    res = verify.check(sku, rng, fw)
    assert res.passed, f"{res.detail}: {res.failures[:5]}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scope,axis,gs", SCOPES, ids=lambda v: str(v))
def test_backward_from_the_bits_equals_the_recomputing_backward(kind, scope, axis, gs, rng):
    """fake_quantize_backward_from_mask(dy, bits of fake_quantize(x)) == fake_quantize_backward(dy, x), bit
    for bit, on the GPU's own kernels."""
    import cupy as cp
    for shape, layout in SHAPES:
        if not _fits(shape, scope, gs):
            continue
        x, scale, zp, kw = _inputs(kind, shape, scope, axis, gs, "asymmetric", rng)
        dy = ct.mask_gradient(shape, rng, kind)
        xd, dyd = _layout(x, layout, rng), _layout(dy, layout, rng)
        sd, zd = cp.asarray(scale), cp.asarray(zp)
        _, bits = sf.fake_quantize(xd, sd, zd, **kw, return_mask="bits")
        got = sf.fake_quantize_backward_from_mask(dyd, bits)
        want = sf.fake_quantize_backward(dyd, xd, sd, zd, **kw)
        assert checks.same_bits(got.get(), want.get()).all(), f"{kind} {scope} {shape} {layout}"
        assert checks.same_bits(got.get(), ref.fake_quantize_backward(dy, x, scale, zp, **kw)).all()


# -- runtime.torch: autograd keeps the bits ------------------------------------------------------------------
def _torch():
    return pytest.importorskip("torch")


TORCH_DTYPES = ("float32", "bfloat16", "float16", "float64")


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("scope,axis,gs", SCOPES, ids=lambda v: str(v))
def test_autograd_gradient_equals_the_recomputing_backward(dtype, scope, axis, gs, rng):
    """x.grad through runtime.torch.fake_quantize (the forward writes the bits, autograd keeps only them)
    equals fake_quantize_backward's recomputed one, bit for bit; y equals the forward without a mask."""
    torch = _torch()
    import runtime.torch as sft
    dt = getattr(torch, dtype)
    m = torch.float64 if dtype == "float64" else torch.float32
    shape = (24, 6, 40) if scope != "group" or 40 % gs == 0 else (24, 6, 48)
    ax = None if axis is None else axis % len(shape)
    pshape = param_shape(shape, scope, ax, gs)
    x = (torch.randn(shape, device="cuda", dtype=m) * 40).to(dt)
    x.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")], device="cuda", dtype=m).to(dt)
    s = torch.rand(pshape, device="cuda", dtype=m) * 0.2 + 0.1
    z = torch.randint(-20, 21, pshape, device="cuda", dtype=torch.int32)
    dy = torch.randn(shape, device="cuda", dtype=m).to(dt)
    kw = dict(scope=scope, axis=axis, group_size=gs)
    xg = x.clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = sft.fake_quantize(xg, s, z, **kw)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [(shape[:-1] + (-(-shape[-1] // 8),), torch.uint8)]
    y.backward(dy)
    want = sft.fake_quantize_backward(dy, x, s, z, **kw)
    bits = torch.int64 if dtype == "float64" else (torch.int32 if dtype == "float32" else torch.int16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(xg.grad), nan)
    assert torch.equal(xg.grad.view(bits)[~nan], want.view(bits)[~nan])
    y0 = sft.fake_quantize(x, s, z, **kw)
    assert torch.equal(torch.isnan(y), torch.isnan(y0)) and torch.equal(y.view(bits)[~torch.isnan(y)],
                                                                        y0.view(bits)[~torch.isnan(y0)])


def test_forward_and_backward_capture_in_a_cuda_graph(rng):
    torch = _torch()
    import runtime.torch as sft
    s = torch.rand(64, device="cuda") * 0.05 + 0.01
    z = torch.randint(-20, 21, (64,), device="cuda", dtype=torch.int32)
    x = (torch.randn(64, 1000, device="cuda") * 3).requires_grad_(True)
    dy = torch.randn(64, 1000, device="cuda")

    def step():
        y = sft.fake_quantize(x, s, z, scope="channel", axis=0)
        y.backward(dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    for _ in range(3):
        with torch.no_grad():
            x.copy_(torch.randn_like(x) * 3)
            dy.copy_(torch.randn_like(dy))
        graph.replay()
        torch.cuda.synchronize()
        want_y = sft.fake_quantize(x.detach(), s, z, scope="channel", axis=0)
        want_dx = sft.fake_quantize_backward(dy, x.detach(), s, z, scope="channel", axis=0)
        assert torch.equal(y_static, want_y) and torch.equal(x.grad, want_dx)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_forward_and_backward_compile_fullgraph(backend, dynamic, rng):
    torch = _torch()
    import runtime.torch as sft
    from torch import _dynamo
    _dynamo.reset()
    s = torch.rand(61, device="cuda") * 0.05 + 0.01
    w = torch.randn(61, 61, device="cuda") * 0.1

    def step(x):
        return (sft.fake_quantize(x, s, None, scope="channel", axis=-1) @ w).square().sum()

    x = (torch.randn(16, 61, device="cuda") * 3).requires_grad_(True)
    xe = x.detach().clone().requires_grad_(True)
    step(xe).backward()
    compiled = torch.compile(step, fullgraph=True, backend=backend, dynamic=dynamic)
    compiled(x).backward()
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-5, atol=1e-5)
    ex = torch._dynamo.explain(step)(x)
    assert ex.graph_break_count == 0 and ex.graph_count == 1


def test_torch_ops_opcheck(rng):
    torch = _torch()
    import runtime.torch  # noqa: F401
    sk = torch.ops.skuforge
    x = torch.randn(32, 61, device="cuda", requires_grad=True)
    s = torch.rand(32, device="cuda") * 0.05 + 0.01
    z = torch.randint(-5, 5, (32,), device="cuda", dtype=torch.int32)
    torch.library.opcheck(sk.fake_quantize_with_mask.default, (x, s, z, "token"))
    torch.library.opcheck(sk.fake_quantize_with_mask.default, (x, s, None, "token", None, None, -8, 7, "bool"))
    _, bits = sk.fake_quantize_with_mask(x.detach(), s, z, "token")
    torch.library.opcheck(sk.fake_quantize_backward_from_mask.default, (torch.randn(32, 61, device="cuda"), bits))
