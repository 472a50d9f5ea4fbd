"""GPU: the training ops (docs/training.md). Every SKU bit-exact against the NumPy reference; PyTorch's own
fake-quant ops bit for bit; LSQ sums independent of the launch configuration; the ``runtime.torch``
custom ops under autograd, ``opcheck`` and ``torch.compile(fullgraph=True)``."""
import math

import numpy as np
import pytest

import runtime as sf
from codegen.harness import verify
from codegen.harness.checks import base as checks
from codegen.harness.checks import training as ct
from runtime import reference as ref
from runtime import replay

pytestmark = pytest.mark.gpu

REG = sf.default_registry()
OPS = ("quantize_backward", "dequantize_backward", "fake_quantize", "fake_quantize_backward",
       "fake_quantize_backward_from_mask", "fake_quantize_learnable_backward")
SKUS = [s for s in REG.skus() if s.op in OPS]


def _has_torch():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


HAS_TORCH = _has_torch()
PARAMS = [pytest.param(s, "torch" if (HAS_TORCH and i % 3 == 1) else "cupy", id=f"{s}-{'torch' if (HAS_TORCH and i % 3 == 1) else 'cupy'}")
          for i, s in enumerate(SKUS)]


@pytest.mark.parametrize("sku,fw", PARAMS)
def test_training_sku_bit_exact(sku, fw, rng):
    res = verify.check(sku, rng, fw)
    assert res.passed, f"{res.detail}: {res.failures[:5]}"


# -- LSQ: deterministic, whatever the launch configuration ------------------------------------------
LSQ_CASES = [("tensor", (4099, 300), None, None), ("token", (700, 3000), None, None),
             ("group", (300, 1024), None, 64), ("channel", (5000, 96), -1, None), ("channel", (48, 7, 512), 1, None)]


@pytest.mark.parametrize("kind", ["f32", "bf16", "f64"])
@pytest.mark.parametrize("case", LSQ_CASES, ids=lambda c: f"{c[0]}{c[1]}")
def test_lsq_bits_do_not_depend_on_the_launch(case, kind, rng):
    import cupy as cp
    scope, shape, axis, gs = case
    sku = REG.select(category="quantization", op="fake_quantize_learnable_backward", scope=scope,
                     mode="asymmetric", element=kind, aux_element=kind)
    x, dy, scale, zp, qmin, qmax, g = ct.lsq_inputs(sku, shape, axis, gs, rng)
    kw = dict(scope=scope, axis=axis, group_size=gs, qmin=qmin, qmax=qmax, grad_factor=g)
    xd, dyd, sd, zd = cp.asarray(x), cp.asarray(dy), cp.asarray(scale), cp.asarray(zp)
    runs = [sf.fake_quantize_learnable_backward(dyd, xd, sd, zd, **kw, _max_blocks=mb)
            for mb in (None, 1, 3, 1000, None)]
    first = [r.get() for r in runs[0]]
    for r in runs[1:]:
        for a, b in zip(first, (t.get() for t in r)):
            assert (checks.same_bits(a, b)).all()
    wdx, wds, wdz = ref.fake_quantize_learnable_backward(dy, x, scale, zp, **kw)
    assert checks.same_bits(first[0], wdx).all()
    assert checks.same_bits(first[1], wds).all()
    assert checks.same_bits(first[2], wdz).all()


# -- PyTorch's own ops, bit for bit --------------------------------------------------------------
def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("zp", [0, 3, -7])
def test_fake_quantize_matches_torch_per_tensor(kind, zp, rng):
    torch = _torch()
    for scale in (2.0 ** -5, float(np.float32(0.0371))):
        t = rng.integers(-200, 200, (512, 1024)) + np.where(rng.random((512, 1024)) < 0.3, 0.5,
                                                              rng.random((512, 1024)))
        x = torch.from_numpy((t * scale).astype(np.float32)).cuda().to(getattr(torch, kind)).requires_grad_(True)
        y_t, m_t = torch.ops.aten.fake_quantize_per_tensor_affine_cachemask(x, scale, zp, -128, 127)
        y, m = sf.fake_quantize(x.detach(), scale, zp, scope="tensor", return_mask=True)
        assert torch.equal(y.view(torch.int16 if kind != "float32" else torch.int32),
                           y_t.view(torch.int16 if kind != "float32" else torch.int32))
        assert torch.equal(m, m_t)
        dy = torch.randn_like(x)
        yy = torch.fake_quantize_per_tensor_affine(x, scale, zp, -128, 127)
        (gx,) = torch.autograd.grad(yy, x, dy)
        dx = sf.fake_quantize_backward(dy, x.detach(), scale, zp, scope="tensor")
        assert torch.equal(dx, gx) and torch.equal(torch.signbit(dx), torch.signbit(gx))


def test_fake_quantize_matches_torch_per_channel(rng):
    """Symmetric (zp = 0, any scales) and even zero points (exact products): bit for bit. Odd zero
    points: PyTorch's per-channel kernel rounds x * inv + zp in one step, so .5 ties round to the
    other even neighbour; every difference must be such a tie (docs/training.md)."""
    torch = _torch()
    rows, cols = 256, 2048
    t = rng.integers(-200, 200, (rows, cols)) + np.where(rng.random((rows, cols)) < 0.3, 0.5, rng.random((rows, cols)))
    for mode in ("symmetric", "even", "odd"):
        pow2 = mode != "symmetric"
        s = (2.0 ** rng.integers(-7, -2, rows) if pow2 else rng.random(rows) * 0.05 + 0.01).astype(np.float32)
        z = {"symmetric": np.zeros(rows), "even": 2 * rng.integers(-30, 30, rows),
             "odd": 2 * rng.integers(-30, 30, rows) + 1}[mode].astype(np.int32)
        x = torch.from_numpy((t * s[:, None]).astype(np.float32)).cuda()
        sd, zd = torch.from_numpy(s).cuda(), torch.from_numpy(z).cuda()
        y_t, m_t = torch.ops.aten.fake_quantize_per_channel_affine_cachemask(x, sd, zd, 0, -128, 127)
        y, m = sf.fake_quantize(x, sd, zd, scope="channel", axis=0, return_mask=True)
        diff = (y.view(torch.int32) != y_t.view(torch.int32)) | (m != m_t)
        if mode != "odd":
            assert not diff.any(), f"{mode}: {int(diff.sum())} differences"
        else:
            xi = (x.double() / sd.double()[:, None])
            tie = (xi - xi.floor()) == 0.5
            assert bool((diff <= tie).all()), "a difference that is not a .5 tie"
            print(f"odd zero points: {int(diff.sum())} of {diff.numel()} elements differ, all at .5 ties")


def test_lsq_matches_torch_learnable(rng):
    _torch()
    for scope in ("tensor", "channel"):
        sku = REG.select(category="quantization", op="fake_quantize_learnable_backward", scope=scope,
                         mode="asymmetric", element="f32", aux_element="f32")
        res = checks.CheckResult(str(sku), False)
        ct.torch_lsq_cases(res, sku, rng)
        assert res.cases and res.mismatches == 0, res.failures


def test_torch_specials_are_recorded():
    """NaN / ±inf: skuforge follows docs/numerics.md; PyTorch's answers are recorded for the docs."""
    import json
    import os
    _torch()
    out = ct.torch_specials()
    print(out)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "torch_specials.json"), "w") as f:
            json.dump(out, f, default=str)
    # x = [nan, inf, -inf, 1], scale 0.5, zp 2, [-8, 7]: NaN stays NaN, ±inf saturate, 1 -> 4 -> 1.0
    assert out["skuforge"][0][1:] == [2.5, -5.0, 1.0] and math.isnan(out["skuforge"][0][0])
    assert out["skuforge"][1] == [False, False, False, True]
    assert out["skuforge learnable dx"] == [0.0, 0.0, 0.0, 1.0]


# -- runtime.torch ----------------------------------------------------------------------------------
def _sft():
    _torch()
    import runtime.torch as sft
    return sft


def _grid(torch, rng, rows, cols, axis_len):
    """x = (k / 4) * s with power-of-two per-row scales: x * inv + zp is exact, so PyTorch's
    per-channel rounding (one step) and skuforge's (two steps) agree for even zero points."""
    s = torch.from_numpy((2.0 ** rng.integers(-8, -3, axis_len)).astype(np.float32)).cuda()
    k = torch.from_numpy(rng.integers(-4 * 180, 4 * 180, (rows, cols)).astype(np.float32)).cuda()
    return k / 4 * s[:, None], s


def test_torch_front_fake_quantize_gradients(rng):
    torch, sft = _torch(), _sft()
    x, s = _grid(torch, rng, 64, 256, 64)
    x.requires_grad_(True)
    z = torch.randint(-10, 10, (64,), device="cuda", dtype=torch.int32) * 2
    y = sft.fake_quantize(x, s, z, scope="channel", axis=0)
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, dy)
    x2 = x.detach().clone().requires_grad_(True)
    y2 = torch.fake_quantize_per_channel_affine(x2, s, z, 0, -128, 127)
    (gx2,) = torch.autograd.grad(y2, x2, dy)
    assert torch.equal(y, y2) and torch.equal(gx, gx2)


@pytest.mark.parametrize("scope", ["tensor", "channel"])
def test_torch_front_learnable_matches_torch(scope, rng):
    torch, sft = _torch(), _sft()
    n = 1 if scope == "tensor" else 128
    x, s0 = _grid(torch, rng, 128, 512, n)
    # per tensor, PyTorch's backward takes trunc(zp + 0.5) (off by one for negative zp): zp >= 0 there
    z0 = (torch.randint(0 if scope == "tensor" else -10, 10, (n,), device="cuda") * 2).float()
    g = 0.01
    ours = [t.clone().requires_grad_(True) for t in (x, s0, z0)]
    theirs = [t.clone().requires_grad_(True) for t in (x, s0, z0)]
    y = sft.fake_quantize_learnable(*ours, scope=scope, axis=0 if scope == "channel" else None, grad_factor=g)
    if scope == "tensor":
        yt = torch._fake_quantize_learnable_per_tensor_affine(*theirs, -128, 127, g)
    else:
        yt = torch._fake_quantize_learnable_per_channel_affine(*theirs, 0, -128, 127, g)
    dy = torch.randn_like(y)
    y.backward(dy)
    yt.backward(dy)
    assert torch.equal(y, yt)
    assert torch.equal(ours[0].grad, theirs[0].grad)
    torch.testing.assert_close(ours[1].grad, theirs[1].grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours[2].grad, theirs[2].grad, rtol=1e-4, atol=1e-4)


def test_torch_front_dequantize_scale_gradient_finite_differences(rng):
    torch, sft = _torch(), _sft()
    q = torch.randint(-128, 128, (16, 96), device="cuda", dtype=torch.int8)
    for scope, kw, n in (("token", {}, (16,)), ("group", {"group_size": 32}, (16, 3)),
                         ("channel", {"axis": 1}, (96,)), ("tensor", {}, ())):
        s = (torch.rand(n, device="cuda", dtype=torch.float64) + 0.5).requires_grad_(True)
        z = torch.randint(-5, 5, n, device="cuda", dtype=torch.int32)
        assert torch.autograd.gradcheck(lambda s: sft.dequantize(q, s, z, scope=scope, out_dtype="float64", **kw),
                                        (s,), eps=1e-6, atol=1e-7)


def test_torch_front_opcheck(rng):
    torch = _torch()
    import runtime.torch  # noqa: F401
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    s = (torch.rand(32, device="cuda") * 0.05 + 0.01).requires_grad_(True)
    zf = torch.randint(-5, 5, (32,), device="cuda").float().requires_grad_(True)
    zi = torch.randint(-5, 5, (32,), device="cuda", dtype=torch.int32)
    q = torch.randint(-128, 128, (32, 64), device="cuda", dtype=torch.int8)
    sk = torch.ops.skuforge
    torch.library.opcheck(sk.fake_quantize.default, (x, s.detach(), zi, "token", None, None, -128, 127))
    torch.library.opcheck(sk.fake_quantize_learnable.default, (x, s, zf, "token", None, None, -128, 127, 0.1))
    torch.library.opcheck(sk.dequantize.default, (q, s, zi, "token", None, None, "float32"))
    torch.library.opcheck(sk.fake_quantize_learnable_backward.default,
                          (torch.randn(32, 64, device="cuda"), x.detach(), s.detach(), zi, "token", None, None,
                           -128, 127, 0.1))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_qat_step(backend, rng):
    """A tiny QAT loop: LSQ weights per channel, static per-tensor activations, compiled with
    fullgraph=True (a graph break raises); loss and gradients equal eager mode's."""
    torch, sft = _torch(), _sft()
    from torch import _dynamo
    _dynamo.reset()
    torch.manual_seed(int(rng.integers(1 << 30)))
    w = torch.nn.Parameter(torch.randn(64, 128, device="cuda") * 0.1)
    ws = torch.nn.Parameter(torch.full((64,), 0.004, device="cuda"))
    wz = torch.nn.Parameter(torch.zeros(64, device="cuda"))
    a_scale = torch.tensor(0.05, device="cuda")
    x, target = torch.randn(32, 128, device="cuda"), torch.randn(32, 64, device="cuda")

    def step(x, target):
        wq = sft.fake_quantize_learnable(w, ws, wz, scope="channel", axis=0, qmin=-128, qmax=127)
        xq = sft.fake_quantize(x, a_scale, None, scope="tensor")
        return torch.nn.functional.mse_loss(xq @ wq.t(), target)

    def grads(fn):
        for p in (w, ws, wz):
            p.grad = None
        loss = fn(x, target)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in (w, ws, wz)]

    le, ge = grads(step)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    lc, gc = grads(compiled)
    torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    opt = torch.optim.SGD([w, ws, wz], lr=0.05)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = compiled(x, target)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    ex = torch._dynamo.explain(step)(x, target)
    assert ex.graph_break_count == 0 and ex.graph_count == 1


# -- 64-bit indexing ------------------------------------------------------------------------------
@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    """One SKU per training family on > 2**31 elements; the first and last rows are checked."""
    torch = _torch()
    rows, d = 2**17 + 3, 2**14 + 16                       # 2.15e9 elements, bf16
    col = ((torch.arange(d, device="cuda") % 301) - 150).to(torch.float32) * 0.0125
    x = torch.empty((rows, d), dtype=torch.bfloat16, device="cuda")
    x[:] = col.to(torch.bfloat16)
    x[-1, -7:] = torch.tensor([1.0, -2.0, 3.0, 9.0, -9.0, 0.5, 0.75], device="cuda").to(torch.bfloat16)
    dy = torch.empty_like(x)
    dy[:] = (col * 3 + 1).to(torch.bfloat16)

    def host(t):
        return checks.to_host(t)

    def rows_of(t):
        return np.concatenate([host(t[:2]), host(t[-3:])])

    xs, dys = rows_of(x), rows_of(dy)
    y, m = sf.fake_quantize(x, 0.025, 3, scope="tensor", return_mask=True)
    wy, wm = ref.fake_quantize(xs, np.float32(0.025), np.int32(3), scope="tensor")
    assert checks.same_bits(rows_of(y), wy).all() and (rows_of(m) == wm).all()
    del y, m
    dx = sf.fake_quantize_backward(dy, x, 0.025, 3, scope="tensor")
    assert checks.same_bits(rows_of(dx), ref.fake_quantize_backward(dys, xs, np.float32(0.025), np.int32(3),
                                                                scope="tensor")).all()
    del dx
    dq = sf.dequantize_backward(dy, 0.5, scope="tensor")
    assert checks.same_bits(rows_of(dq), ref.dequantize_backward(dys, np.float32(0.5), scope="tensor")).all()
    del dq
    s = torch.full((rows,), 0.02, device="cuda")
    z = torch.full((rows,), -4, device="cuda", dtype=torch.int32)
    dx, ds, dz = sf.fake_quantize_learnable_backward(dy, x, s, z, scope="token", grad_factor=0.5)
    wdx, wds, wdz = ref.fake_quantize_learnable_backward(dys, xs, np.full(5, 0.02, np.float32),
                                                         np.full(5, -4, np.int32), scope="token", grad_factor=0.5)
    sel = lambda t: np.concatenate([host(t[:2]), host(t[-3:])])  # noqa: E731
    assert checks.same_bits(rows_of(dx), wdx).all()
    assert checks.same_bits(sel(ds), wds).all() and checks.same_bits(sel(dz), wdz).all()
    del dx, ds, dz, x, dy
    torch.cuda.empty_cache()


# -- device-side value checks (runtime/status.py): no sync, poisoned outputs, the next call raises -----
def _clear_pending():
    """Wait for the device and drop what earlier tests' kernels reported."""
    try:
        sf.check()
    except sf.DeviceValueError:
        pass


# (scope, shape, axis of the call, axis of x along which the scale elements run)
LSQ_BAD_CASES = [("token", (8, 256), None, 0), ("channel", (64, 40), -1, 1), ("channel", (6, 96), 0, 0),
                 ("tensor", (33, 70), None, None)]
LSQ_BAD_VALUES = [("symmetric", "nan", "scale"), ("symmetric", "zero", "scale"), ("asymmetric", "nan", "scale"),
                  ("asymmetric", "zero", "scale"), ("asymmetric", "zp_high", "zero_point"),
                  ("asymmetric", "zp_low", "zero_point")]


@pytest.mark.parametrize("case", LSQ_BAD_CASES, ids=lambda c: f"{c[0]}{c[1]}")
@pytest.mark.parametrize("mode,bad,arg", LSQ_BAD_VALUES, ids=lambda v: str(v))
@pytest.mark.parametrize("then", ["next_call", "check"])
def test_lsq_invalid_scale_element_poisons_and_is_reported(case, mode, bad, arg, then, rng):
    """An invalid scale element (NaN or 0 scale, zero point outside [qmin, qmax]): the call returns
    without raising, that element's dx / ds / dz are NaN and every other element equals the
    reference; the next call (or runtime.check()) raises DeviceValueError naming op and argument;
    the call after that runs normally."""
    import cupy as cp
    scope, shape, axis, along = case
    sku = REG.select(category="quantization", op="fake_quantize_learnable_backward", scope=scope, mode=mode,
                     element="f32", aux_element="f32")
    x, dy, scale, zp, qmin, qmax, g = ct.lsq_inputs(sku, shape, axis, None, rng)
    kw = dict(scope=scope, axis=axis, qmin=qmin, qmax=qmax, grad_factor=g)
    i = 0 if scope == "tensor" else 2
    s_bad, z_bad = np.array(scale, copy=True), (None if zp is None else np.array(zp, copy=True))
    flat_s = s_bad.reshape(-1)
    if bad == "nan":
        flat_s[i] = np.nan
    elif bad == "zero":
        flat_s[i] = 0
    else:
        z_bad.reshape(-1)[i] = qmax + 1 if bad == "zp_high" else qmin - 1
    xd, dyd = cp.asarray(x), cp.asarray(dy)
    sd, zd = cp.asarray(scale), (None if zp is None else cp.asarray(zp))
    sbd, zbd = cp.asarray(s_bad), (None if z_bad is None else cp.asarray(z_bad))
    _clear_pending()

    dx, ds, dz = sf.fake_quantize_learnable_backward(dyd, xd, sbd, zbd, **kw)     # does not raise
    cp.cuda.Device().synchronize()          # the kernel has written the status word
    dx, ds = dx.get(), ds.get()
    dz = None if dz is None else dz.get()
    sel = np.zeros(shape, bool)             # the elements of scale element i
    if along is None:
        sel[...] = True
    else:
        np.moveaxis(sel, along, 0)[i] = True
    wdx, wds, wdz = ref.fake_quantize_learnable_backward(dy, x, scale, zp, **kw)   # valid inputs
    assert np.isnan(dx[sel]).all()
    assert ct.same_bits(dx[~sel], wdx[~sel]).all()
    assert np.isnan(ds.reshape(-1)[i])
    others = np.arange(ds.size) != i
    assert ct.same_bits(ds.reshape(-1)[others], wds.reshape(-1)[others]).all()
    if mode == "asymmetric":
        assert np.isnan(dz.reshape(-1)[i])
        assert ct.same_bits(dz.reshape(-1)[others], wdz.reshape(-1)[others]).all()
    else:
        assert dz is None

    with pytest.raises(sf.DeviceValueError) as ei:
        if then == "check":
            sf.check()
        else:
            sf.fake_quantize_learnable_backward(dyd, xd, sd, zd, **kw)
    assert ei.value.op == "fake_quantize_learnable_backward" and ei.value.arg == arg
    assert "fake_quantize_learnable_backward" in str(ei.value) and arg in str(ei.value)
    got = sf.fake_quantize_learnable_backward(dyd, xd, sd, zd, **kw)   # reported once: runs normally
    for a, b in zip(got, (wdx, wds, wdz)):
        assert (a is None) == (b is None)
        if a is not None:
            assert ct.same_bits(a.get(), b).all()
    sf.check()                              # nothing new reported


@pytest.mark.parametrize("mode", ["symmetric", "asymmetric"])
def test_lsq_default_call_does_not_synchronize(mode, rng):
    """The default path checks values in the kernel: no host sync, on the full path (first call of
    a signature) or the replay, under torch's sync debug mode."""
    torch = pytest.importorskip("torch")
    x = torch.randn(64, 256, device="cuda")
    dy = torch.randn(64, 256, device="cuda")
    s = torch.rand(256, device="cuda") * 0.05 + 0.01
    zp = torch.zeros(256, dtype=torch.int32, device="cuda") if mode == "asymmetric" else None
    kw = dict(scope="channel", axis=-1, qmin=-128, qmax=127)
    sf.fake_quantize_learnable_backward(dy, x, s, zp, **kw)     # warm: compile and module load may sync
    _clear_pending()
    torch.cuda.set_sync_debug_mode("error")
    try:
        replay.CACHE.clear()
        sf.fake_quantize_learnable_backward(dy, x, s, zp, **kw)  # full path
        sf.fake_quantize_learnable_backward(dy, x, s, zp, **kw)  # replay
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sf.check()
