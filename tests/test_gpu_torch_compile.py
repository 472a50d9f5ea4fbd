"""GPU: the ``torch.ops.skuforge`` ops under ``torch.compile``: ``fullgraph=True`` (a graph break
raises), ``torch._dynamo.explain`` with zero graph breaks, ``dynamic=True`` over the token
dimension, and ``mode="reduce-overhead"`` (CUDA graphs); every result equal to eager mode.

Steps (the functions of examples/): a W8A8 activation step (dynamic_quantize -> torch._int_mm),
FP8 row-wise and 1x128 group steps (dynamic_quantize -> torch._scaled_mm), a QAT linear with
learnable fake-quant (forward + backward), an MoE layer forward + backward (offsets ->
grouped_matmul -> GELU -> grouped_matmul)."""

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from codegen.harness.steps import example_module as _example  # noqa: E402  (the examples as modules)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    import torch._dynamo as dynamo
    dynamo.reset()
    yield
    dynamo.reset()


def _w8a8(M):
    ex = _example("w8a8_linear")
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    wq, ws = ex.quantize_weight(torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, generator=g) / 22)
    return ex.w8a8_linear, (x, wq, ws)


def _fp8(kind):
    ex = _example("fp8_linear")

    def make(M):
        g = torch.Generator(device="cuda").manual_seed(M)
        x = torch.randn(M, 512, device="cuda", dtype=torch.bfloat16, generator=g)
        wq, ws = ex.quantize_weight(torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, generator=g) / 22)
        return (ex.fp8_rowwise if kind == "rowwise" else ex.fp8_group128), (x, wq, ws)
    return make


def _fp8_supported():
    return torch.cuda.get_device_capability() >= (8, 9)


def _check_step(fn, make_args, sizes=(64, 96, 160)):
    """explain: no graph break; fullgraph + dynamic over M; reduce-overhead; equal to eager."""
    args0 = make_args(sizes[0])[1]
    ex = torch._dynamo.explain(fn)(*args0)
    assert ex.graph_break_count == 0, ex.break_reasons
    dyn = torch.compile(fn, fullgraph=True, dynamic=True)
    cg = torch.compile(fn, fullgraph=True, mode="reduce-overhead", dynamic=True)
    for M in sizes:
        _, args = make_args(M)
        want = fn(*args)
        torch.testing.assert_close(dyn(*args), want)
        for _ in range(3):                       # warm-up, record, replay
            got = cg(*args).clone()
        torch.testing.assert_close(got, want)


def test_w8a8_step():
    fn, _ = _w8a8(64)
    _check_step(fn, _w8a8)


@pytest.mark.parametrize("kind", ["rowwise", "group128"])
def test_fp8_step(kind):
    if not _fp8_supported():
        pytest.skip("torch._scaled_mm needs sm_89+")
    make = _fp8(kind)
    fn, _ = make(64)
    _check_step(fn, make)


def _qat_setup():
    import runtime.torch as sft
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.nn.Parameter(torch.randn(128, 256, device="cuda", generator=g) * 0.05)
    s = torch.nn.Parameter(w.detach().abs().amax(1) / 127)
    z = torch.nn.Parameter(torch.zeros(128, device="cuda"))

    def step(x, target):
        wq = sft.fake_quantize_learnable(w, s, z, scope="channel", axis=0)
        xq = sft.fake_quantize(x, 0.05, scope="tensor")
        return torch.nn.functional.mse_loss(xq @ wq.t(), target)

    def make(M):
        gg = torch.Generator(device="cuda").manual_seed(M)
        return step, (torch.randn(M, 256, device="cuda", generator=gg), torch.randn(M, 128, device="cuda", generator=gg))
    return (w, s, z), step, make


def _grads_of(params):
    out = [None if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_qat_linear_forward_backward(mode):
    params, step, make = _qat_setup()
    _, args = make(64)
    ex = torch._dynamo.explain(step)(*args)
    assert ex.graph_break_count == 0, ex.break_reasons
    _grads_of(params)
    compiled = torch.compile(step, fullgraph=True, dynamic=True, mode=mode)
    for M in (64, 96):
        _, args = make(M)
        want = step(*args)
        want.backward()
        gw = _grads_of(params)
        for _ in range(3):                       # warm-up, record, replay
            loss = compiled(*args)
            loss.backward()
            got = loss.detach().clone()
            gc = _grads_of(params)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        for a, b in zip(gc, gw):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_moe_layer_forward_backward(mode, dtype):
    ex = _example("moe_layer")
    params = {k: torch.nn.Parameter(v) for k, v in ex.init("cuda", dtype=dtype).items()}

    def step(x):
        return ex.moe(params, x)

    def make(M):
        g = torch.Generator(device="cuda").manual_seed(M)
        return (torch.randn(M, 128, device="cuda", generator=g).to(dtype),
                torch.randn(M, 128, device="cuda", generator=g).to(dtype))

    ps = list(params.values())
    ex_ = torch._dynamo.explain(step)(make(64)[0])
    assert ex_.graph_break_count == 0, ex_.break_reasons
    _grads_of(ps)
    compiled = torch.compile(step, fullgraph=True, dynamic=True, mode=mode)
    for M in (64, 200):
        x, dy = make(M)
        want = step(x)
        want.backward(dy)
        want = want.detach()
        gw = _grads_of(ps)
        for _ in range(3):                       # warm-up, record, replay
            y = compiled(x)
            y.backward(dy)
            got = y.detach().clone()
            gc = _grads_of(ps)
        # Inductor fuses the router's softmax, the GELU and the gate product differently from eager
        # PyTorch (a few elements differ by float rounding): compared by relative Frobenius error
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for a, b in zip([got] + gc, [want] + gw):
            err = float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))
            assert err <= tol, (err, tol)
