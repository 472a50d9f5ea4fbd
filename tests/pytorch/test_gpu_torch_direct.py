"""GPU: the public functions of runtime.torch call an op's CUDA implementation directly where the
dispatcher would do nothing else (plain CUDA tensors, no gradient to record, no tracing, mode or
profiler: runtime/torch/library.py ``plain``), with the dispatcher's results, version counters and
errors; a gradient, a mode, the profiler, a subclass or ``torch.compile`` takes the dispatcher."""
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")


@pytest.fixture
def direct(monkeypatch):
    """{implementation name: calls made directly}: every op's and .out overload's direct entry counted."""
    from runtime.torch import library
    counts = {}

    def counted(fn, name):
        def call(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)
        return call
    for op, fn in list(library.IMPL.items()):      # "_quantize" for skuforge::quantize
        monkeypatch.setitem(library.IMPL, op, counted(fn, "_" + op._qualname.split("::")[1]))
    for name, (overload, impl) in list(library.OUT.items()):
        monkeypatch.setitem(library.OUT, name, (overload, counted(impl, f"{name}.out")))
    return counts


def _data():
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(16, 256, device="cuda", generator=g)
    s = torch.rand(16, device="cuda", generator=g) * 0.05 + 0.01
    z = torch.randint(-5, 5, (16,), device="cuda", dtype=torch.int32, generator=g)
    dy = torch.randn(16, 256, device="cuda", generator=g)
    xb = torch.randn(64, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(4, 96, 128, device="cuda", generator=g).bfloat16()
    off = torch.tensor([0, 10, 10, 40, 64], device="cuda", dtype=torch.int32)
    dyb = torch.randn(64, 96, device="cuda", generator=g).bfloat16()
    return x, s, z, dy, xb, w, off, dyb


def _same(a, b):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert (u is None) == (v is None)
        if u is not None:
            assert u.dtype == v.dtype and u.shape == v.shape and u.stride() == v.stride()
            assert torch.equal(u.view(torch.uint8), v.view(torch.uint8))


def _none_last(results):
    """``results`` less its last element, which must be None."""
    assert results[-1] is None
    return tuple(results[:-1])


def test_plain_eager_calls_go_direct_with_the_dispatchers_results(direct):
    import runtime.torch as sft
    sk = torch.ops.skuforge
    x, s, z, dy, xb, w, off, dyb = _data()
    sp = torch.nn.Parameter(s.clone(), requires_grad=False)      # a frozen parameter is a plain tensor
    cases = [
        ("_quantize", lambda: sft.quantize(x, s, z, scope="token"), lambda: sk.quantize(x, s, z, "token")),
        ("_dequantize", lambda: sft.dequantize(sk.quantize(x, s, z, "token"), s, z, scope="token"),
         lambda: sk.dequantize(sk.quantize(x, s, z, "token"), s, z, "token", None, None, "float32")),
        ("_dynamic_quantize", lambda: sft.dynamic_quantize(x, scope="group", group_size=128, out_dtype="fp8_e4m3")[:2],
         lambda: sk.dynamic_quantize(x, "group", "symmetric", None, 128, "fp8_e4m3")[:2]),
        ("_fake_quantize", lambda: sft.fake_quantize(x, sp, z, scope="token"), lambda: sk.fake_quantize(x, s, z, "token")),
        ("_fake_quantize_backward", lambda: sft.fake_quantize_backward(dy, x, s, z, scope="token"),
         lambda: sk.fake_quantize_backward(dy, x, s, z, "token")),
        ("_quantize_backward", lambda: sft.quantize_backward(dy, x, s, z, scope="token"),
         lambda: sk.quantize_backward(dy, x, s, z, "token")),
        ("_dequantize_backward", lambda: sft.dequantize_backward(dy, s, scope="token"),
         lambda: sk.dequantize_backward(dy, s, "token")),
        ("_fake_quantize_learnable", lambda: sft.fake_quantize_learnable(x, s, z.float(), scope="token", grad_factor=0.5),
         lambda: sk.fake_quantize_learnable(x, s, z.float(), "token", None, None, -128, 127, 0.5)),
        ("_fake_quantize_learnable_backward", lambda: sft.fake_quantize_learnable_backward(dy, x, s, z, scope="token"),
         lambda: sk.fake_quantize_learnable_backward(dy, x, s, z, "token")),
        ("_grouped_matmul", lambda: sft.grouped_matmul(xb, w, offsets=off), lambda: sk.grouped_matmul(xb, w, None, off)),
        ("_grouped_matmul_backward", lambda: sft.grouped_matmul_backward(xb, w, dyb, offsets=off),
         lambda: sk.grouped_matmul_backward(xb, w, dyb, None, off)),
        # results the schema spells as empty tensors are None, allocated by neither route's caller
        ("_dynamic_quantize", lambda: _none_last(sft.dynamic_quantize(x, scope="token")),
         lambda: sk.dynamic_quantize(x, "token")[:2]),
        ("_fake_quantize_learnable_backward", lambda: _none_last(sft.fake_quantize_learnable_backward(
            dy, x, s, scope="token")), lambda: sk.fake_quantize_learnable_backward(dy, x, s, None, "token")[:2]),
        ("_grouped_matmul_backward", lambda: _none_last(sft.grouped_matmul_backward(xb, w, dyb, offsets=off,
                                                                                   need_weight=False)),
         lambda: sk.grouped_matmul_backward(xb, w, dyb, None, off, "auto", True, False)[:1]),
    ]
    for name, ours, dispatched in cases:
        before = direct.get(name, 0)
        got = ours()
        assert direct.get(name, 0) == before + 1, name
        _same(got, dispatched())
    q = torch.empty(16, 256, dtype=torch.int8, device="cuda")
    sft.quantize(x, s, z, scope="token", out=q)
    assert direct["quantize.out"] == 1 and torch.equal(q, sk.quantize(x, s, z, "token"))


def test_gradients_modes_the_profiler_and_subclasses_take_the_dispatcher(direct):
    import runtime.torch as sft
    from torch.utils._python_dispatch import TorchDispatchMode
    x, s, z, dy, *_ = _data()
    xg = x.clone().requires_grad_(True)
    y = sft.fake_quantize(xg, s, z, scope="token")                # a gradient to record: the op with its mask
    assert direct.get("_fake_quantize", 0) == 0 and direct.get("_fake_quantize_with_mask", 0) == 0
    assert y.grad_fn is not None
    y.backward(dy)                                               # its backward formula needs none: direct
    assert direct["_fake_quantize_backward_from_mask"] == 1
    assert torch.equal(xg.grad, sft.fake_quantize_backward(dy, x, s, z, scope="token"))
    with torch.no_grad():                                        # grad mode off: nothing to record
        sft.fake_quantize(xg, s, z, scope="token")
    assert direct["_fake_quantize"] == 1

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))
    with Seen() as mode:
        sft.quantize(x, s, z, scope="token")
    assert "skuforge.quantize.default" in mode.ops and direct.get("_quantize", 0) == 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sft.quantize(x, s, z, scope="token")
    assert any(e.key == "skuforge::quantize" for e in prof.key_averages()) and direct.get("_quantize", 0) == 0

    class Sub(torch.Tensor):
        pass
    sft.quantize(x.as_subclass(Sub), s, z, scope="token")
    assert direct.get("_quantize", 0) == 0
    torch._dynamo.reset()
    f = torch.compile(lambda a: sft.quantize(a, s, z, scope="token"), backend="eager", fullgraph=True)
    assert torch.equal(f(x), torch.ops.skuforge.quantize(x, s, z, "token")) and direct.get("_quantize", 0) == 0


def test_out_overloads_bump_the_version_counter_as_the_dispatcher_does(direct):
    import runtime.torch as sft
    x, s, z, *_ = _data()
    out = torch.empty_like(x)
    v0 = out._version
    torch.ops.skuforge.fake_quantize.out(x, s, z, "token", out=out)
    by_dispatcher = out._version - v0
    v1 = out._version
    sft.fake_quantize(x, s, z, scope="token", out=out)
    assert direct["fake_quantize.out"] == 1 and by_dispatcher == 1 and out._version - v1 == 1
    # autograd sees the write: a tensor saved for backward, then overwritten directly, is refused
    a = torch.randn(16, 256, device="cuda", requires_grad=True)
    e = a.exp()                                                  # exp saves its result
    with torch.no_grad():
        sft.fake_quantize(x, s, z, scope="token", out=e)
    assert direct["fake_quantize.out"] == 2
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        e.sum().backward()
    with torch.inference_mode():                                  # inference tensors have no counter
        t = torch.empty_like(x)
        sft.fake_quantize(x, s, z, scope="token", out=t)
        torch.ops.skuforge.fake_quantize.out(x, s, z, "token", out=t)
    assert direct["fake_quantize.out"] == 3


def test_errors_are_the_dispatchers(direct):
    import runtime.torch as sft
    x, s, z, *_ = _data()
    with pytest.raises(Exception) as ours:
        sft.quantize(x, s, z, scope="row")
    with pytest.raises(Exception) as theirs:
        torch.ops.skuforge.quantize(x, s, z, "row")
    assert direct["_quantize"] == 1
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)
