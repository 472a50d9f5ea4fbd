"""GPU: ``torch.library.opcheck`` for every ``torch.ops.skuforge`` op and overload (schema, autograd
registration, fake tensor vs the real kernels, AOT dispatch static and dynamic), the real results
equal to the functional API's, and the gradients: ``gradcheck`` in float64 where the op's gradient
is a true derivative (dequantize w.r.t. the scale), float64 references for the straight-through
ops (fake_quantize) and grouped matmul (f32 vs float64 within the 1e-5 of docs/numerics.md), and quantize -> dequantize as
the straight-through estimator for every scope, code kind and scale dtype (x.grad == dy * mask)."""
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import runtime as sf  # noqa: E402


def sft():
    import runtime.torch as m
    return m


def _cases():
    sk = torch.ops.skuforge
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape, dtype=torch.float32, grad=False):
        t = torch.randn(*shape, device="cuda", generator=g).to(dtype)
        return t.requires_grad_(grad)

    x = r(16, 64)
    s = (torch.rand(16, device="cuda", generator=g) * 0.05 + 0.01)
    sg = (torch.rand(16, 2, device="cuda", generator=g) * 0.05 + 0.01)
    z = torch.randint(-5, 5, (16,), device="cuda", dtype=torch.int32, generator=g)
    q = torch.randint(-128, 128, (16, 64), device="cuda", dtype=torch.int8, generator=g)
    q4 = torch.randint(0, 256, (16, 32), device="cuda", dtype=torch.uint8, generator=g)
    off = torch.tensor([0, 5, 5, 16], device="cuda", dtype=torch.int32)
    re = torch.randint(0, 4, (16,), device="cuda", dtype=torch.int32, generator=g)
    w = r(3, 32, 64, dtype=torch.bfloat16, grad=True)
    xb = r(16, 64, dtype=torch.bfloat16, grad=True)
    x8, _, _ = sf.dynamic_quantize(r(16, 64), scope="token", out_dtype="fp8_e4m3")
    cases = [
        ("quantize token", sk.quantize.default, (x, s, z, "token"), {}),
        ("quantize fp8 grad", sk.quantize.default, (r(16, 64, grad=True), s, None, "token", None, None, "fp8_e4m3"), {}),
        ("quantize int4", sk.quantize.default, (x, sg, None, "group", None, 32, "int4"), {}),
        ("quantize.out", sk.quantize.out, (x, s, None, "token"), {"out": torch.empty(16, 64, dtype=torch.int8, device="cuda")}),
        ("dequantize scale grad", sk.dequantize.default, (q, s.clone().requires_grad_(True), z, "token", None, None, "float32"), {}),
        ("dequantize int4", sk.dequantize.default, (q4, sg.clone().requires_grad_(True), None, "group", None, 32, "bfloat16", "int4"), {}),
        ("dequantize fp8", sk.dequantize.default, (x8.clone(), s, None, "token", None, None, "bfloat16"), {}),
        ("dequantize.out", sk.dequantize.out, (q, s, z, "token"), {"out": torch.empty(16, 64, device="cuda")}),
        ("dynamic token", sk.dynamic_quantize.default, (x, "token"), {}),
        ("dynamic asym group", sk.dynamic_quantize.default, (x, "group", "asymmetric", None, 16, "uint8"), {}),
        ("dynamic fp8 group", sk.dynamic_quantize.default, (x, "group", "symmetric", None, 32, "fp8_e4m3"), {}),
        ("dynamic mx", sk.dynamic_quantize.default, (x, "group", "symmetric", None, 32, "fp8_e4m3"), {"scale_dtype": "e8m0"}),
        ("dynamic int4", sk.dynamic_quantize.default, (x, "group", "symmetric", None, 32, "int4"), {}),
        ("dynamic.out", sk.dynamic_quantize.out, (x, "token"), {"q": torch.empty(16, 64, dtype=torch.int8, device="cuda"),
                                                               "scale": torch.empty(16, device="cuda")}),
        ("dynamic.out mx", sk.dynamic_quantize.out, (x, "group", "symmetric", None, 32, "fp8_e4m3"),
         {"scale_dtype": "e8m0", "q": torch.empty(16, 64, dtype=torch.uint8, device="cuda"),
          "scale": torch.empty(16, 2, dtype=torch.uint8, device="cuda")}),
        ("quantize_backward", sk.quantize_backward.default, (r(16, 64), x, s, z, "token"), {}),
        ("quantize_backward.out", sk.quantize_backward.out, (r(16, 64), x, s, z, "token"), {"out": torch.empty(16, 64, device="cuda")}),
        ("dequantize_backward", sk.dequantize_backward.default, (r(16, 64), s, "token"), {}),
        ("dequantize_backward.out", sk.dequantize_backward.out, (r(16, 64), s, "token"), {"out": torch.empty(16, 64, device="cuda")}),
        ("fake_quantize", sk.fake_quantize.default, (r(16, 64, grad=True), s, z, "token"), {}),
        ("fake_quantize.out", sk.fake_quantize.out, (x, s, z, "token"), {"out": torch.empty(16, 64, device="cuda")}),
        ("fake_quantize_backward", sk.fake_quantize_backward.default, (r(16, 64), x, s, z, "token"), {}),
        ("fake_quantize_backward.out", sk.fake_quantize_backward.out, (r(16, 64), x, s, z, "token"),
         {"out": torch.empty(16, 64, device="cuda")}),
        ("fake_quantize_learnable", sk.fake_quantize_learnable.default,
         (r(16, 64, grad=True), s.clone().requires_grad_(True), z.float().requires_grad_(True), "token", None, None,
          -128, 127, 0.1), {}),
        ("fake_quantize_learnable_backward", sk.fake_quantize_learnable_backward.default, (r(16, 64), x, s, z, "token"), {}),
        ("fake_quantize_learnable_backward.out", sk.fake_quantize_learnable_backward.out,
         (r(16, 64), x, s, z, "token"), {"out": torch.empty(16, 64, device="cuda")}),
        ("grouped_matmul offsets", sk.grouped_matmul.default, (xb, w, None, off), {}),
        ("grouped_matmul.out", sk.grouped_matmul.out, (xb.detach(), w.detach(), None, off),
         {"out": torch.empty(16, 32, dtype=torch.bfloat16, device="cuda")}),
        ("grouped_matmul_backward.out", sk.grouped_matmul_backward.out,
         (xb.detach(), w.detach(), r(16, 32, dtype=torch.bfloat16), None, off),
         {"dx": torch.empty(16, 64, dtype=torch.bfloat16, device="cuda"),
          "dw": torch.empty(3, 32, 64, device="cuda")}),
        ("grouped_matmul row_experts", sk.grouped_matmul.default, (xb, w, re), {}),
        ("grouped_matmul_backward", sk.grouped_matmul_backward.default, (xb.detach(), w.detach(), r(16, 32, dtype=torch.bfloat16), None, off), {}),
        ("grouped_matmul_backward dw only", sk.grouped_matmul_backward.default,
         (xb.detach(), w.detach(), r(16, 32, dtype=torch.bfloat16), re, None, "auto", False, True, "bfloat16"), {}),
    ]
    return cases


_NARROW = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu") if hasattr(torch, n))


def _widened(out):
    """Outputs as float32 where PyTorch cannot sum them (fp8, e8m0), the rest as they are."""
    outs = out if isinstance(out, tuple) else (out,)
    return tuple(t.view(torch.uint8).float() if t.dtype == getattr(torch, "float8_e8m0fnu", None)
                 else t.float() if t.dtype in _NARROW else t for t in outs)


def _aot_dispatch_check(op, args, kwargs):
    """What opcheck's AOT-dispatch tests check, for ops whose outputs PyTorch cannot sum: the op
    compiled through AOTAutograd (static and dynamic shapes) gives eager's outputs and gradients."""
    def f(*a):
        return _widened(op(*a, **kwargs))

    def run(fn):
        outs = fn(*args)
        diff = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        loss = sum(o.float().sum() for o in outs if o.is_floating_point() and o.requires_grad)
        grads = torch.autograd.grad(loss, diff, allow_unused=True) if diff and torch.is_tensor(loss) else ()
        return outs, grads

    want_out, want_grad = run(f)
    for dynamic in (False, True):
        torch._dynamo.reset()
        got_out, got_grad = run(torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=dynamic))
        for g, w in zip(got_out + tuple(got_grad), want_out + tuple(want_grad)):
            if g is None or w is None:
                assert g is None and w is None
            else:
                torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def _unmutated_check(op, args, kwargs):
    """What opcheck's schema test checks of an op without mutable arguments: its inputs' bytes are
    unchanged by a call (compared as uint8 views, which every dtype has)."""
    assert not op._schema.is_mutable, op
    ins = [a for a in args if isinstance(a, torch.Tensor)]
    before = [a.detach().contiguous().view(torch.uint8).clone() for a in ins]
    with torch.no_grad():
        op(*args, **kwargs)
    for a, b in zip(ins, before):
        assert torch.equal(a.detach().contiguous().view(torch.uint8), b), f"{op}: an input was written"


def test_opcheck_every_op():
    sft()
    failures = []
    for name, op, args, kwargs in _cases():
        try:
            with torch.no_grad():
                outs = op(*args, **kwargs)
            tensors = [t for t in (*args, *kwargs.values(), *(outs if isinstance(outs, tuple) else (outs,)))
                       if isinstance(t, torch.Tensor)]
            if any(t.dtype in _NARROW for t in tensors):
                # opcheck's schema test compares values with ops PyTorch lacks for fp8 / e8m0: the
                # same check (inputs not declared mutable are left unchanged) on their bytes instead
                torch.library.opcheck(op, args, kwargs, test_utils=("test_autograd_registration", "test_faketensor"))
                _unmutated_check(op, args, kwargs)
                _aot_dispatch_check(op, args, kwargs)
            else:
                torch.library.opcheck(op, args, kwargs)
        except Exception as e:  # collect them all: one report
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:600]}")
    assert not failures, "\n".join(failures)


def test_results_equal_the_functional_api():
    m = sft()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    for kw in (dict(scope="token"), dict(scope="group", group_size=128, out_dtype="fp8_e4m3"),
               dict(scope="group", group_size=32, out_dtype="fp8_e4m3", scale_dtype="e8m0"),
               dict(scope="token", mode="asymmetric", out_dtype="uint8"), dict(scope="group", group_size=64, out_dtype="int4")):
        a, b = m.dynamic_quantize(x, **kw), sf.dynamic_quantize(x, **kw)
        for u, v in zip(a, b):
            assert (u is None) == (v is None)
            if u is not None:
                assert torch.equal(u.view(torch.uint8) if u.element_size() == 1 else u,
                                   v.view(torch.uint8) if v.element_size() == 1 else v), kw
    q, s, _ = m.dynamic_quantize(x, scope="token")
    buf = torch.empty_like(q)
    assert m.quantize(x, s, scope="token", out=buf) is buf and torch.equal(buf, q)
    assert torch.equal(m.dequantize(q, s, scope="token", out_dtype="bfloat16"),
                       sf.dequantize(q, s, scope="token", out_dtype="bfloat16"))
    bufs = (torch.empty_like(q), torch.empty_like(s))
    m.dynamic_quantize(x, scope="token", out=bufs)
    assert torch.equal(bufs[0], q) and torch.equal(bufs[1], s)


def test_dequantize_scale_gradcheck_float64():
    m = sft()
    q = torch.randint(-128, 128, (8, 64), device="cuda", dtype=torch.int8)
    q4 = torch.randint(0, 256, (8, 32), device="cuda", dtype=torch.uint8)
    for scope, kw, n in (("tensor", {}, ()), ("channel", {"axis": 1}, (64,)), ("token", {}, (8,)),
                         ("group", {"group_size": 16}, (8, 4))):
        s = (torch.rand(n, device="cuda", dtype=torch.float64) + 0.5).requires_grad_(True)
        assert torch.autograd.gradcheck(lambda s: m.dequantize(q, s, scope=scope, out_dtype="float64", **kw), (s,))
        if scope != "channel":
            assert torch.autograd.gradcheck(
                lambda s: m.dequantize(q4, s, scope=scope, out_dtype="float64", in_dtype="int4", **kw), (s,))


def test_straight_through_gradients_against_float64_references():
    m = sft()
    g = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(16, 128, device="cuda", dtype=torch.float64, generator=g) * 3).requires_grad_(True)
    s = torch.full((16,), 0.02, device="cuda", dtype=torch.float64)
    dy = torch.randn(16, 128, device="cuda", dtype=torch.float64, generator=g)
    (gx,) = torch.autograd.grad(m.fake_quantize(x, s, scope="token", qmin=-128, qmax=127), x, dy)
    v = torch.round(x.detach() / s[:, None])
    assert torch.equal(gx, torch.where((v >= -128) & (v <= 127), dy, torch.zeros_like(dy)))


# -- quantize -> dequantize: the straight-through estimator ---------------------------------------------
STE_SCOPES = [("tensor", None, None), ("channel", 0, None), ("channel", 2, None), ("token", None, None),
              ("group", None, 32)]
STE_CODES = [(k, False) for k in ("int8", "uint8", "int4", "uint4", "fp8_e4m3", "fp8_e5m2")] + \
    [(k, True) for k in ("int8", "uint8", "int4", "uint4")]
QRANGE = {"int8": (-128, 127), "uint8": (0, 255), "int4": (-8, 7), "uint4": (0, 15)}
IMPLIED_ZP = {"uint8": 128, "uint4": 8}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def _param_shape(shape, scope, axis, gs):
    return {"tensor": (), "channel": (shape[axis or 0],), "token": shape[:-1],
            "group": shape[:-1] + (shape[-1] // (gs or 1),)}[scope]


def _broadcast(p, shape, scope, axis, gs):
    """A per-scope parameter (NumPy) broadcast to x's shape."""
    import numpy as np
    if scope == "tensor":
        return p.reshape(())
    if scope == "channel":
        return p.reshape([1] * axis + [shape[axis]] + [1] * (len(shape) - axis - 1))
    if scope == "token":
        return p.reshape(shape[:-1] + (1,))
    return np.repeat(p, gs, axis=-1)


def _ste_reference(x, scale_values, zp, scope, axis, gs, out_dtype):
    """The mask from its definition, in NumPy: ``qmin <= rne(x * inv) + zp <= qmax`` (full range, the
    implied zero point for None), fp8 ``|x * inv| <= fp8_max``; ``inv = 1 / scale`` in the math precision."""
    import numpy as np
    xn = x.detach().cpu().double().numpy() if x.dtype == torch.float64 else x.detach().cpu().float().numpy()
    m = xn.dtype.type
    inv = (m(1) / _broadcast(scale_values.astype(m), xn.shape, scope, axis, gs)).astype(m)
    with np.errstate(all="ignore"):
        t = (xn * inv).astype(m)
        if out_dtype in FP8_MAX:
            return np.abs(t) <= FP8_MAX[out_dtype]
        z = IMPLIED_ZP.get(out_dtype, 0) if zp is None else _broadcast(zp.cpu().numpy(), xn.shape, scope, axis, gs)
        v = np.rint(t) + z
        return (v >= QRANGE[out_dtype][0]) & (v <= QRANGE[out_dtype][1])


@pytest.mark.parametrize("scope,axis,gs", STE_SCOPES, ids=lambda v: str(v))
@pytest.mark.parametrize("out_dtype,zero_point", STE_CODES, ids=lambda v: {False: "sym", True: "zp"}.get(v, v))
@pytest.mark.parametrize("xdt,ydt", [(torch.float32, "float32"), (torch.bfloat16, "float32"),
                                     (torch.float16, "bfloat16"), (torch.float64, "float64")],
                         ids=["f32", "bf16", "f16-to-bf16", "f64"])
def test_quantize_then_dequantize_is_the_straight_through_estimator(scope, axis, gs, out_dtype, zero_point, xdt,
                                                                    ydt):
    """x.grad == dy * mask exactly, in x's dtype, for every scope, code kind and scale dtype (float32;
    float64 for float64 x): the scale cancels and no gradient is rounded to the codes' dtype."""
    import numpy as np
    m = sft()
    g = torch.Generator(device="cuda").manual_seed(5)
    shape = (4, 6, 64)
    sdt = torch.float64 if xdt == torch.float64 else torch.float32
    s = torch.rand(_param_shape(shape, scope, axis, gs), device="cuda", generator=g, dtype=sdt) + 0.5
    span = FP8_MAX.get(out_dtype) or (QRANGE[out_dtype][1] - QRANGE[out_dtype][0]) / 2
    sb = torch.from_numpy(_broadcast(s.cpu().numpy(), shape, scope, axis, gs)).to("cuda")
    x = (torch.randn(shape, device="cuda", generator=g, dtype=torch.float64) * span * 0.6 * sb).to(xdt)
    x.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), float("-inf")], device="cuda").to(xdt)
    x.requires_grad_(True)
    z = None
    if zero_point:
        lo, hi = QRANGE[out_dtype]
        z = torch.randint(lo // 2, hi // 2 + 1, s.shape, device="cuda", dtype=torch.int32, generator=g)
    kw = dict(scope=scope, axis=axis, group_size=gs)
    q = m.quantize(x, s, z, out_dtype=out_dtype, **kw)
    assert not q.requires_grad
    y = m.dequantize(q, s, z, out_dtype=ydt, in_dtype=out_dtype if "4" in out_dtype else None, **kw)
    want_y = sf.dequantize(q, s, z, out_dtype=ydt, in_dtype=out_dtype if "4" in out_dtype else None, **kw)
    assert torch.equal(y.nan_to_num(0.0), want_y.nan_to_num(0.0))      # the forward is dequantize's own
    dy = torch.randn(shape, device="cuda", generator=g).to(y.dtype)
    y.backward(dy)
    mask = _ste_reference(x, s.cpu().numpy(), z, scope, axis, gs, out_dtype)
    assert 0 < mask.sum() < mask.size                                   # some elements clip or saturate
    assert x.grad.dtype == xdt
    assert torch.equal(x.grad, dy.to(xdt) * torch.from_numpy(np.ascontiguousarray(mask)).to("cuda"))


@pytest.mark.parametrize("out_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("codes", ["uint8", "float8_e8m0fnu"])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_straight_through_with_mx_e8m0_scales(out_dtype, codes, xdt):
    """MX block scales (e8m0 codes, group 32): x.grad == dy * mask all the same (it was 0)."""
    m = sft()
    if codes == "float8_e8m0fnu" and not hasattr(torch, codes):
        pytest.skip("this torch has no float8_e8m0fnu")
    g = torch.Generator(device="cuda").manual_seed(7)
    import numpy as np
    c = torch.randint(120, 130, (8, 4), device="cuda", generator=g).to(torch.uint8)
    sv = np.ldexp(1.0, c.cpu().numpy().astype(np.int64) - 127)          # 2^(c - 127), exact
    x = (torch.randn(8, 128, device="cuda", generator=g, dtype=torch.float64) * FP8_MAX[out_dtype] * 0.6
         * torch.from_numpy(sv).to("cuda").repeat_interleave(32, 1)).to(xdt).requires_grad_(True)
    scale = c if codes == "uint8" else c.view(getattr(torch, codes))
    kw = dict(scope="group", group_size=32, scale_dtype="e8m0")
    y = m.dequantize(m.quantize(x, scale, out_dtype=out_dtype, **kw), scale, **kw)
    dy = torch.randn(8, 128, device="cuda", generator=g)
    y.backward(dy)
    mask = _ste_reference(x, sv, None, "group", None, 32, out_dtype)
    assert 0 < mask.sum() < mask.size
    assert torch.equal(x.grad, dy.to(xdt) * torch.from_numpy(mask).to("cuda"))


def test_quantize_alone_and_dequantize_alone():
    """Codes never require a gradient (a gradient through them is an error, not a silent zero);
    dequantize of codes quantize did not link: the scale's gradient only; an fp8 leaf q keeps
    dequantize_backward's dy * scale in its own dtype."""
    m = sft()
    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(8, 64, device="cuda", generator=g).requires_grad_(True)
    s = torch.rand(8, device="cuda", generator=g) + 0.5
    for kind in ("int8", "fp8_e4m3"):
        assert not m.quantize(x, s, scope="token", out_dtype=kind).requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        m.quantize(x, s, scope="token", out_dtype="fp8_e4m3").float().sum().backward()
    with torch.no_grad():
        q = m.quantize(x, s, scope="token")
    assert not m.dequantize(q, s, scope="token").requires_grad          # made without a gradient
    q8 = (torch.randn(8, 64, device="cuda", generator=g) * 10).to(torch.float8_e4m3fn).requires_grad_(True)
    dy = torch.randn(8, 64, device="cuda", generator=g)
    (gq,) = torch.autograd.grad(m.dequantize(q8, s, scope="token"), q8, dy)
    assert gq.dtype == torch.float8_e4m3fn and torch.equal(gq.float(), (dy * s[:, None]).to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("routing", ["offsets", "row_experts"])
def test_grouped_matmul_gradients_vs_float64(routing):
    m = sft()
    g = torch.Generator(device="cuda").manual_seed(3)
    M, N, K, E = 300, 96, 128, 5
    x = torch.randn(M, K, device="cuda", generator=g).requires_grad_(True)
    w = torch.randn(E, N, K, device="cuda", generator=g).requires_grad_(True)
    dy = torch.randn(M, N, device="cuda", generator=g)
    e = torch.randint(0, E, (M,), device="cuda", generator=g)
    if routing == "offsets":
        e = e.sort().values
        counts = torch.bincount(e, minlength=E)
        r = dict(offsets=torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32))
    else:
        r = dict(row_experts=e.to(torch.int32))
    y = m.grouped_matmul(x, w, **r)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    y64 = torch.einsum("mk,mnk->mn", x64, w64[e])
    gx64, gw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    for a, b in ((y, y64), (gx, gx64), (gw, gw64)):
        assert a.dtype == torch.float32
        assert float((a.double() - b).norm() / b.norm()) <= 1e-5
    # bf16 parameters: gradients in bf16 (cast from the float32 dw)
    xb, wb = x.detach().bfloat16().requires_grad_(True), w.detach().bfloat16().requires_grad_(True)
    gxb, gwb = torch.autograd.grad(m.grouped_matmul(xb, wb, **r), (xb, wb), dy.bfloat16())
    assert gxb.dtype == torch.bfloat16 and gwb.dtype == torch.bfloat16
    assert float((gwb.double() - gw64).norm() / gw64.norm()) <= 1e-2
