"""GPU: the ``torch.ops.skuforge`` ops under ``torch.compile``: ``fullgraph=True`` (a graph break
raises), ``torch._dynamo.explain`` with zero graph breaks, ``dynamic=True`` over the token
dimension, and ``mode="reduce-overhead"`` (CUDA graphs); every result equal to eager mode.

Steps (the functions of examples/): a W8A8 activation step (dynamic_quantize -> torch._int_mm),
FP8 row-wise and 1x128 group steps (dynamic_quantize -> torch._scaled_mm), a QAT linear with
learnable fake-quant (forward + backward), an MoE layer forward + backward (offsets ->
grouped_matmul -> GELU -> grouped_matmul).

The functional API (``runtime.quantize(...)`` ...) on torch tensors: every op, ``out=`` included,
under ``torch.compile(fullgraph=True)`` (default and ``mode="reduce-overhead"``) equal to eager
bit for bit, captured in a CUDA graph (``torch.cuda.graph``) and replayed on new data, and
quantize -> dequantize compiled with the straight-through gradient of eager."""

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from codegen.harness.bench.steps import example_module as _example  # noqa: E402  (the examples as modules)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
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


# -- the functional API on torch tensors ----------------------------------------------------------------
def _functional_cases():
    """name -> (fn, args): every functional op, out= included, on CUDA tensors (out buffers among args)."""
    import runtime as sf
    g = torch.Generator(device="cuda").manual_seed(11)

    def r(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    def pos(*shape):
        return torch.rand(*shape, device="cuda", generator=g) * 0.05 + 0.01

    def e(*shape, dtype):
        return torch.empty(*shape, device="cuda", dtype=dtype)

    f32, i8, u8, i32, bf16 = torch.float32, torch.int8, torch.uint8, torch.int32, torch.bfloat16
    x, xb, dy = r(16, 256, scale=3), r(16, 256, dtype=bf16, scale=3), r(16, 256)
    s, sg, sc = pos(16), pos(16, 8), pos(256)
    z = torch.randint(-5, 5, (16,), device="cuda", dtype=i32, generator=g)
    mx = torch.randint(120, 130, (16, 8), device="cuda", generator=g).to(u8)
    q = torch.randint(-128, 128, (16, 256), device="cuda", dtype=i8, generator=g)
    q4 = torch.randint(0, 256, (16, 128), device="cuda", dtype=u8, generator=g)
    q8, _, _ = sf.dynamic_quantize(x, scope="token", out_dtype="fp8_e4m3")
    M, N, K, E = 48, 32, 64, 4
    gx, gw, gdy = r(M, K, dtype=bf16), r(E, N, K, dtype=bf16, scale=0.1), r(M, N, dtype=bf16)
    off = torch.tensor([0, 10, 10, 30, 48], device="cuda", dtype=i32)
    re = torch.randint(0, E, (M,), device="cuda", dtype=i32, generator=g)
    return {
        "quantize": (lambda x, s, z: sf.quantize(x, s, z, scope="token"), (x, s, z)),
        "quantize out=": (lambda x, s, o: sf.quantize(x, s, scope="token", out=o), (x, s, e(16, 256, dtype=i8))),
        "quantize int4": (lambda x, s: sf.quantize(x, s, scope="group", group_size=32, out_dtype="uint4"), (x, sg)),
        "quantize mx": (lambda x, s: sf.quantize(x, s, scope="group", group_size=32, out_dtype="fp8_e4m3",
                                                 scale_dtype="e8m0"), (xb, mx)),
        "quantize scalar": (lambda x: sf.quantize(x, 0.02, 3, scope="tensor", out_dtype="uint8"), (x,)),
        "dequantize": (lambda q, s, z: sf.dequantize(q, s, z, scope="token", out_dtype="bfloat16"), (q, s, z)),
        "dequantize out=": (lambda q, s, o: sf.dequantize(q, s, scope="token", out=o), (q, s, e(16, 256, dtype=f32))),
        "dequantize fp8": (lambda q, s: sf.dequantize(q, s, scope="token", out_dtype="bfloat16"), (q8, s)),
        "dequantize int4": (lambda q, s: sf.dequantize(q, s, scope="group", group_size=32, in_dtype="int4"), (q4, sg)),
        "dynamic_quantize": (lambda x: sf.dynamic_quantize(x, scope="token"), (xb,)),
        "dynamic_quantize asymmetric": (lambda x: sf.dynamic_quantize(x, scope="group", group_size=64,
                                                                       mode="asymmetric", out_dtype="uint8"), (x,)),
        "dynamic_quantize mx": (lambda x: sf.dynamic_quantize(x, scope="group", group_size=32, out_dtype="fp8_e4m3",
                                                               scale_dtype="e8m0"), (xb,)),
        "dynamic_quantize out=": (lambda x, a, b: sf.dynamic_quantize(x, scope="token", out=(a, b)),
                                  (x, e(16, 256, dtype=i8), e(16, dtype=f32))),
        "quantize_backward": (lambda dy, x, s, z: sf.quantize_backward(dy, x, s, z, scope="token"), (dy, x, s, z)),
        "quantize_backward out=": (lambda dy, x, o: sf.quantize_backward(dy, x, 0.02, scope="tensor", out=o),
                                   (dy, x, e(16, 256, dtype=f32))),
        "dequantize_backward": (lambda dy, s: sf.dequantize_backward(dy, s, scope="group", group_size=32), (dy, sg)),
        "dequantize_backward out=": (lambda dy, s, o: sf.dequantize_backward(dy, s, scope="token", out=o),
                                     (dy, s, e(16, 256, dtype=f32))),
        "fake_quantize": (lambda x, s, z: sf.fake_quantize(x, s, z, scope="token"), (x, s, z)),
        "fake_quantize mask": (lambda x, s: sf.fake_quantize(x, s, scope="channel", axis=1, return_mask=True),
                               (x, sc)),
        "fake_quantize out=": (lambda x, s, o: sf.fake_quantize(x, s, scope="token", out=o, return_mask=True),
                               (x, s, e(16, 256, dtype=f32))),
        "fake_quantize_backward": (lambda dy, x, s, z: sf.fake_quantize_backward(dy, x, s, z, scope="token"),
                                   (dy, x, s, z)),
        "fake_quantize_backward out=": (lambda dy, x, s, o: sf.fake_quantize_backward(dy, x, s, scope="token", out=o),
                                        (dy, x, s, e(16, 256, dtype=f32))),
        "fake_quantize_learnable_backward": (lambda dy, x, s, z: sf.fake_quantize_learnable_backward(
            dy, x, s, z, scope="token"), (dy, x, s, z)),
        "fake_quantize_learnable_backward out=": (lambda dy, x, s, o: sf.fake_quantize_learnable_backward(
            dy, x, s, scope="channel", axis=1, out=o), (dy, x, sc, e(16, 256, dtype=f32))),
        "grouped_matmul": (lambda x, w, o: sf.grouped_matmul(x, w, offsets=o), (gx, gw, off)),
        "grouped_matmul out=": (lambda x, w, r_, o: sf.grouped_matmul(x, w, row_experts=r_, out=o),
                                (gx, gw, re, e(M, N, dtype=bf16))),
        "grouped_matmul_backward": (lambda x, w, dy, o: sf.grouped_matmul_backward(x, w, dy, offsets=o),
                                    (gx, gw, gdy, off)),
        "grouped_matmul_backward dw only": (lambda x, w, dy, r_: sf.grouped_matmul_backward(
            x, w, dy, row_experts=r_, need_input=False, dw_dtype="bfloat16"), (gx, gw, gdy, re)),
        "grouped_matmul_backward out=": (lambda x, w, dy, o, a, b: sf.grouped_matmul_backward(
            x, w, dy, offsets=o, out=(a, b)), (gx, gw, gdy, off, e(M, K, dtype=bf16), e(E, N, K, dtype=f32))),
    }


def _flat(result):
    return [t for t in (result if isinstance(result, (tuple, list)) else (result,))]


def _same(a, b) -> bool:
    """Equal bit for bit (None to None); 1-byte dtypes (fp8, e8m0, codes, bool) compared as bytes."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)) and torch.equal(a.isnan(), b.isnan())


def _fresh(args):
    """The case's arguments with new out buffers (tensors it writes) and the inputs shared."""
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _case_names():
    return ["quantize", "quantize out=", "quantize int4", "quantize mx", "quantize scalar", "dequantize",
            "dequantize out=", "dequantize fp8", "dequantize int4", "dynamic_quantize", "dynamic_quantize asymmetric",
            "dynamic_quantize mx", "dynamic_quantize out=", "quantize_backward", "quantize_backward out=",
            "dequantize_backward", "dequantize_backward out=", "fake_quantize", "fake_quantize mask",
            "fake_quantize out=", "fake_quantize_backward", "fake_quantize_backward out=",
            "fake_quantize_learnable_backward", "fake_quantize_learnable_backward out=", "grouped_matmul",
            "grouped_matmul out=", "grouped_matmul_backward", "grouped_matmul_backward dw only",
            "grouped_matmul_backward out="]


def test_functional_cases_are_every_op_with_out():
    names = _case_names()
    assert sorted(names) == sorted(_functional_cases())
    for op in ("quantize", "dequantize", "dynamic_quantize", "quantize_backward", "dequantize_backward",
               "fake_quantize", "fake_quantize_backward", "fake_quantize_learnable_backward", "grouped_matmul",
               "grouped_matmul_backward"):
        assert op in names and f"{op} out=" in names, op


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("name", _case_names())
def test_functional_api_compiles_fullgraph(name, mode):
    """``runtime.<op>`` on torch tensors inside torch.compile(fullgraph=True): one graph of
    torch.ops.skuforge ops, results (and out= buffers) equal to the eager call's, bit for bit."""
    fn, args = _functional_cases()[name]
    want_args = _fresh(args)
    want = _flat(fn(*want_args))
    ex = torch._dynamo.explain(fn)(*_fresh(args))
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    ops = [str(n.target) for gm in ex.graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert any(t.startswith("skuforge.") for t in ops), ops
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, mode=mode)
    for _ in range(3):                            # warm-up, record, replay (reduce-overhead)
        got_args = _fresh(args)
        got = [None if t is None else t.clone() for t in _flat(compiled(*got_args))]
    assert len(got) == len(want), name
    for a, b in zip(got, want):
        assert _same(a, b), name
    for a, b in zip(got_args, want_args):         # what was written into out=
        if isinstance(a, torch.Tensor):
            assert _same(a, b), name


def test_functional_api_captures_in_a_cuda_graph():
    """Every functional op called on torch tensors while torch.cuda.graph captures: one replay on new
    input data gives what eager calls give on that data."""
    cases = _functional_cases()
    fns = [fn for fn, _ in cases.values()]
    args = [args for _, args in cases.values()]
    for fn, a in zip(fns, args):                  # warm-up outside the capture (module loads, plans)
        fn(*a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = [_flat(fn(*a)) for fn, a in zip(fns, args)]
    g = torch.Generator(device="cuda").manual_seed(12)
    for name, a in zip(cases, args):              # new data into the float inputs (offsets, codes stay valid)
        for t in a:
            if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.bfloat16) and t.numel() > 256:
                t.copy_(torch.randn(t.shape, device="cuda", generator=g).to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    for name, fn, a, outs in zip(cases, fns, args, got):
        want = _flat(fn(*_fresh(a)))
        for x, y in zip(outs, want):
            assert _same(x, y), name


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_straight_through_compiled_equals_eager(mode):
    """runtime.torch quantize -> dequantize compiled: x.grad is eager's, dy * mask (not rounded to int4)."""
    import runtime.torch as sft
    g = torch.Generator(device="cuda").manual_seed(13)
    s = torch.rand(16, 8, device="cuda", generator=g) * 0.05 + 0.01

    def step(x):
        q = sft.quantize(x, s, scope="group", group_size=32, out_dtype="int4")
        return sft.dequantize(q, s, scope="group", group_size=32, in_dtype="int4", out_dtype="bfloat16")

    x = (torch.randn(16, 256, device="cuda", generator=g) * 0.3).requires_grad_(True)
    dy = torch.randn(16, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    step(x).backward(dy)
    want, x.grad = x.grad.clone(), None
    compiled = torch.compile(step, fullgraph=True, mode=mode)
    for _ in range(3):
        compiled(x).backward(dy)
        got, x.grad = x.grad.clone(), None
    assert torch.equal(got, want)
    v = torch.round(x.detach() * torch.reciprocal(s).repeat_interleave(32, 1))
    assert torch.equal(want, dy.float() * ((v >= -8) & (v <= 7))) and not bool(((v >= -8) & (v <= 7)).all())
