"""CPU: ``torch.ops.skuforge`` without a GPU (the CPU build of PyTorch in CI).

The schemas, the fake implementations (FakeTensorMode fakes CUDA tensors on a CPU-only build:
shapes, dtypes, strides, typed errors), ``torch.library.opcheck``'s schema and fake-tensor tests,
and the autograd wiring on meta tensors (backward formulas reach the backward ops' fake impls).
The real kernels: tests/test_gpu_torch_ops.py."""
import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import runtime.torch as sft  # noqa: E402
from runtime.errors import InvalidProblemError, UnsupportedError  # noqa: E402
from runtime.scopes import param_shape  # noqa: E402
from runtime.torch.meta import E8M0_DTYPE  # noqa: E402

sk = torch.ops.skuforge
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCOPES = [("tensor", None, None), ("channel", 1, None), ("channel", -1, None), ("token", None, None),
          ("group", None, 32)]


@pytest.fixture
def fake():
    with FakeTensorMode(allow_non_fake_inputs=False) as m:
        yield m


def cuda(shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="cuda")


def dense_strides(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def assert_dense(t, shape, dtype):
    assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, (t.shape, t.dtype, shape, dtype)
    assert t.stride() == dense_strides(shape) and t.device.type == "cuda"


def scale_for(x_shape, scope, axis, gs, dtype=torch.float32):
    return cuda(param_shape(x_shape, scope, None if axis is None else axis % len(x_shape), gs), dtype)


# -- schemas ------------------------------------------------------------------------------------------
def test_every_op_is_registered_with_its_out_overload():
    for name in sft.OPS:
        op = getattr(sk, name).default
        assert not op._schema.is_mutable, name
        assert torch.Tag.pt2_compliant_tag in op.tags, name
    for name in sft.OUT_OPS:
        op = getattr(sk, name).out
        assert op._schema.is_mutable and len(op._schema.returns) == 0, name
        mutated = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert mutated and all(a.kwarg_only for a in op._schema.arguments if a.name in mutated), (name, mutated)
    assert not hasattr(sk.grouped_matmul, "out")      # the functional API has no out= there (yet)


# -- fake implementations: shapes, dtypes, strides ---------------------------------------------------------
@pytest.mark.parametrize("scope,axis,gs", SCOPES)
@pytest.mark.parametrize("out_dtype", ["int8", "uint8", "int4", "uint4", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16, torch.float64])
def test_quantize_dequantize_fakes(fake, scope, axis, gs, out_dtype, xdt):
    shape = (3, 5, 64)
    x = cuda(shape, xdt)
    m = torch.float64 if xdt == torch.float64 else torch.float32
    s = scale_for(shape, scope, axis, gs, m)
    q = sk.quantize(x, s, None, scope, axis, gs, out_dtype)
    if out_dtype in FP8:
        qdt, qshape, in_dtype = FP8[out_dtype], shape, None
    elif "4" in out_dtype:
        qdt, qshape, in_dtype = torch.uint8, shape[:-1] + (32,), out_dtype
    else:
        qdt, qshape, in_dtype = getattr(torch, out_dtype), shape, None
    assert_dense(q, qshape, qdt)
    y = sk.dequantize(q, s, None, scope, axis, gs, str(xdt)[6:], in_dtype)
    assert_dense(y, shape, xdt)
    sk.quantize.out(x, s, None, scope, axis, gs, out_dtype, out=torch.empty_like(q))
    sk.dequantize.out(q, s, None, scope, axis, gs, str(xdt)[6:], in_dtype, out=torch.empty_like(y))


@pytest.mark.parametrize("scope,axis,gs", SCOPES)
@pytest.mark.parametrize("mode", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("out_dtype", ["int8", "uint8", "int4", "uint4"])
def test_dynamic_quantize_integer_fakes(fake, scope, axis, gs, mode, out_dtype):
    shape = (4, 2, 64)
    x = cuda(shape, torch.float16)
    q, s, z = sft.dynamic_quantize(x, scope=scope, mode=mode, axis=axis, group_size=gs, out_dtype=out_dtype)
    pshape = param_shape(shape, scope, None if axis is None else axis % 3, gs)
    packed = "4" in out_dtype
    assert_dense(q, shape[:-1] + (32,) if packed else shape, torch.uint8 if packed else getattr(torch, out_dtype))
    assert_dense(s, pshape, torch.float32)
    if mode == "symmetric":
        assert z is None
    else:
        assert_dense(z, pshape, torch.int32)
    if not packed:
        sft.dynamic_quantize(x, scope=scope, mode=mode, axis=axis, group_size=gs, out_dtype=out_dtype,
                             out=(torch.empty_like(q), torch.empty_like(s)) + ((torch.empty_like(z),) if z is not None
                                                                             else ()))


@pytest.mark.parametrize("out_dtype", list(FP8))
@pytest.mark.parametrize("scope,gs,scale_dtype", [("token", None, "float32"), ("group", 128, "float32"),
                                                  ("tensor", None, "float32"), ("group", 32, "e8m0")])
def test_dynamic_quantize_fp8_and_mx_fakes(fake, out_dtype, scope, gs, scale_dtype):
    x = cuda((7, 256), torch.bfloat16)
    q, s, z = sft.dynamic_quantize(x, scope=scope, group_size=gs, out_dtype=out_dtype, scale_dtype=scale_dtype)
    assert_dense(q, (7, 256), FP8[out_dtype])
    assert_dense(s, param_shape((7, 256), scope, None, gs), E8M0_DTYPE if scale_dtype == "e8m0" else torch.float32)
    assert z is None
    y = sft.dequantize(q, s, scope=scope, group_size=gs, out_dtype="bfloat16",
                       scale_dtype="e8m0" if scale_dtype == "e8m0" else None)
    assert_dense(y, (7, 256), torch.bfloat16)


@pytest.mark.parametrize("scope,axis,gs", SCOPES)
@pytest.mark.parametrize("xdt", [torch.float32, torch.float16, torch.float64])
def test_training_op_fakes(fake, scope, axis, gs, xdt):
    shape = (2, 6, 96)
    gs = 48 if gs else None
    x, dy = cuda(shape, xdt), cuda(shape, xdt)
    m = torch.float64 if xdt == torch.float64 else torch.float32
    s = scale_for(shape, scope, axis, gs, m)
    z = scale_for(shape, scope, axis, gs, torch.int32)
    for out in (sk.quantize_backward(dy, x, s, z, scope, axis, gs),
                sk.dequantize_backward(dy, s, scope, axis, gs),
                sk.fake_quantize(x, s, z, scope, axis, gs),
                sk.fake_quantize_backward(dy, x, s, None, scope, axis, gs),
                sk.fake_quantize_learnable(x, s, z.float(), scope, axis, gs, -128, 127, 0.1)):
        assert_dense(out, shape, xdt)
    dx, ds, dz = sk.fake_quantize_learnable_backward(dy, x, s, z, scope, axis, gs)
    assert_dense(dx, shape, xdt)
    assert_dense(ds, s.shape, m)
    assert_dense(dz, z.shape, torch.float32)
    _, _, dz0 = sk.fake_quantize_learnable_backward(dy, x, s, None, scope, axis, gs)
    assert_dense(dz0, (0,), torch.float32)
    for name, args in [("quantize_backward", (dy, x, s, z, scope, axis, gs)),
                       ("dequantize_backward", (dy, s, scope, axis, gs)),
                       ("fake_quantize", (x, s, z, scope, axis, gs)),
                       ("fake_quantize_backward", (dy, x, s, z, scope, axis, gs))]:
        getattr(sk, name).out(*args, out=torch.empty_like(x))


@pytest.mark.parametrize("dt", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("routing", ["offsets", "row_experts"])
def test_grouped_matmul_fakes(fake, dt, routing):
    M, N, K, E = 37, 48, 64, 5
    x, w, dy = cuda((M, K), dt), cuda((E, N, K), dt), cuda((M, N), dt)
    r = dict(offsets=cuda((E + 1,), torch.int64)) if routing == "offsets" else dict(row_experts=cuda((M,), torch.int32))
    assert_dense(sft.grouped_matmul(x, w, **r), (M, N), dt)
    dx, dw = sft.grouped_matmul_backward(x, w, dy, **r)
    assert_dense(dx, (M, K), dt)
    assert_dense(dw, (E, N, K), torch.float32)
    dx, dw = sft.grouped_matmul_backward(x, w, dy, need_input=False, dw_dtype=dt, **r)
    assert dx is None
    assert_dense(dw, (E, N, K), dt)
    dx0, dw0 = sk.grouped_matmul_backward(x, w, dy, r.get("row_experts"), r.get("offsets"), "auto", False, False)
    assert_dense(dx0, (0,), dt)
    assert_dense(dw0, (0,), torch.float32)


def test_strided_rows_are_accepted(fake):
    """A slice of rows of a larger buffer (last axis contiguous): accepted, dense outputs."""
    x = torch.empty_strided((8, 256), (512, 1), dtype=torch.bfloat16, device="cuda")   # big[:, :256]
    q, s, _ = sft.dynamic_quantize(x, scope="token")
    assert_dense(q, (8, 256), torch.int8)
    assert_dense(s, (8,), torch.float32)


# -- fake implementations: typed errors ------------------------------------------------------------------
ERRORS = [
    ("scope", UnsupportedError, "scope='row'",
     lambda: sk.quantize(cuda((4, 64)), cuda((4,)), None, "row")),
    ("group divides", InvalidProblemError, "does not divide",
     lambda: sk.quantize(cuda((4, 64)), cuda((4, 2)), None, "group", None, 48)),
    ("scale shape", InvalidProblemError, "scale has shape",
     lambda: sk.quantize(cuda((4, 64)), cuda((5,)), None, "token")),
    ("scale dtype", InvalidProblemError, "scale has dtype",
     lambda: sk.quantize(cuda((4, 64), torch.float16), cuda((4,), torch.float16), None, "token")),
    ("zero point dtype", InvalidProblemError, "zero_point has dtype",
     lambda: sk.quantize(cuda((4, 64)), cuda((4,)), cuda((4,), torch.int64), "token")),
    ("x dtype", UnsupportedError, "x has dtype",
     lambda: sk.quantize(cuda((4, 64), torch.int32), cuda((4,)), None, "token")),
    ("qmin", InvalidProblemError, "qmin=-300",
     lambda: sk.quantize(cuda((4, 64)), cuda((4,)), None, "token", None, None, "int8", -300)),
    ("fp8 zero point", InvalidProblemError, "no zero point",
     lambda: sk.quantize(cuda((4, 64)), cuda((4,)), cuda((4,), torch.int32), "token", None, None, "fp8_e4m3")),
    ("odd int4", InvalidProblemError, "even D",
     lambda: sk.quantize(cuda((4, 63)), cuda((4,)), None, "token", None, None, "int4")),
    ("mx group", InvalidProblemError, "group_size=32",
     lambda: sft.dynamic_quantize(cuda((4, 64)), scope="group", group_size=64, out_dtype="fp8_e4m3",
                                  scale_dtype="e8m0")),
    ("mx int8", UnsupportedError, "fp8 data",
     lambda: sft.dynamic_quantize(cuda((4, 64)), scope="group", group_size=32, scale_dtype="e8m0")),
    ("fp8 asym", InvalidProblemError, "no zero point",
     lambda: sft.dynamic_quantize(cuda((4, 64)), scope="token", mode="asymmetric", out_dtype="fp8_e4m3")),
    ("eps", InvalidProblemError, "eps=",
     lambda: sft.dynamic_quantize(cuda((4, 64)), scope="token", eps=-1.0)),
    ("sym range", InvalidProblemError, "symmetric mode's zero point",
     lambda: sft.dynamic_quantize(cuda((4, 64)), scope="token", out_dtype="uint8", qmin=0, qmax=100)),
    ("dq kind", UnsupportedError, "q has dtype",
     lambda: sk.dequantize(cuda((4, 64), torch.int32), cuda((4,)), None, "token")),
    ("dq out dtype", UnsupportedError, "out_dtype='int8'",
     lambda: sk.dequantize(cuda((4, 64), torch.int8), cuda((4,)), None, "token", None, None, "int8")),
    ("in_dtype", InvalidProblemError, "in_dtype",
     lambda: sk.dequantize(cuda((4, 64), torch.int8), cuda((4,)), None, "token", None, None, "float32", "int4")),
    ("dy shape", InvalidProblemError, "dy has shape",
     lambda: sk.fake_quantize_backward(cuda((4, 32)), cuda((4, 64)), cuda((4,)), None, "token")),
    ("dy dtype", InvalidProblemError, "dy has dtype",
     lambda: sk.quantize_backward(cuda((4, 64), torch.float16), cuda((4, 64)), cuda((4,)), None, "token")),
    ("lsq range", InvalidProblemError, "qmin <= 0 <= qmax",
     lambda: sk.fake_quantize_learnable(cuda((4, 64)), cuda((4,)), None, "token", None, None, 1, 127, 1.0)),
    ("channel axis", InvalidProblemError, "axis is required",
     lambda: sk.fake_quantize(cuda((4, 64)), cuda((4,)), None, "channel")),
    ("last axis", InvalidProblemError, "non-contiguous last axis",
     lambda: sk.fake_quantize(torch.empty_strided((4, 64), (1, 4), device="cuda"), cuda((4,)), None, "token")),
    ("gmm K", InvalidProblemError, "mismatched K",
     lambda: sk.grouped_matmul(cuda((8, 64)), cuda((2, 16, 32)), None, cuda((3,), torch.int32))),
    ("gmm routing", InvalidProblemError, "exactly one of",
     lambda: sk.grouped_matmul(cuda((8, 64)), cuda((2, 16, 64)))),
    ("gmm offsets", InvalidProblemError, "offsets must have shape",
     lambda: sk.grouped_matmul(cuda((8, 64)), cuda((2, 16, 64)), None, cuda((2,), torch.int32))),
    ("gmm dtype", UnsupportedError, "x has dtype",
     lambda: sk.grouped_matmul(cuda((8, 64), torch.float64), cuda((2, 16, 64), torch.float64), None,
                               cuda((3,), torch.int32))),
    ("gmm strategy", InvalidProblemError, "strategy=",
     lambda: sk.grouped_matmul(cuda((8, 64)), cuda((2, 16, 64)), None, cuda((3,), torch.int32), "cublas")),
    ("gmm dw dtype", UnsupportedError, "dw_dtype",
     lambda: sk.grouped_matmul_backward(cuda((8, 64), torch.float16), cuda((2, 16, 64), torch.float16),
                                        cuda((8, 16), torch.float16), None, cuda((3,), torch.int32), "auto", True,
                                        True, "bfloat16")),
    ("out shape", InvalidProblemError, "out has shape",
     lambda: sk.quantize.out(cuda((4, 64)), cuda((4,)), None, "token", out=cuda((4, 32), torch.int8))),
    ("out dtype", InvalidProblemError, "out has shape",
     lambda: sk.fake_quantize.out(cuda((4, 64)), cuda((4,)), None, "token", out=cuda((4, 64), torch.float16))),
    ("dynamic out low-bit", UnsupportedError, "out=",
     lambda: sk.dynamic_quantize.out(cuda((4, 64)), "token", out_dtype="fp8_e4m3", q=cuda((4, 64), torch.uint8),
                                     scale=cuda((4,)))),
    ("dynamic out zp", InvalidProblemError, "zero point",
     lambda: sk.dynamic_quantize.out(cuda((4, 64)), "token", "asymmetric", q=cuda((4, 64), torch.int8),
                                     scale=cuda((4,)))),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_fake_errors_are_typed(fake, case):
    _, err, match, call = case
    with pytest.raises(err, match=match):
        call()


def test_mixed_devices_are_rejected():
    with pytest.raises(InvalidProblemError, match="different devices"):
        torch.ops.skuforge.quantize(torch.empty(2, 4, device="meta"), torch.empty(2), None, "token")


# -- opcheck: schema and fake tensor ----------------------------------------------------------------------
def _opcheck_cases():
    x = cuda((8, 64))
    s = cuda((8,))
    z = cuda((8,), torch.int32)
    q = cuda((8, 64), torch.int8)
    w, off = cuda((3, 16, 64)), cuda((4,), torch.int32)
    return [
        (sk.quantize.default, (x, s, z, "token"), {}),
        (sk.quantize.default, (x, cuda((8, 2)), None, "group", None, 32, "fp8_e4m3"), {}),
        (sk.quantize.out, (x, s, None, "token"), {"out": cuda((8, 64), torch.int8)}),
        (sk.dequantize.default, (q, s, z, "token", None, None, "bfloat16"), {}),
        (sk.dequantize.out, (q, s, None, "token"), {"out": cuda((8, 64))}),
        (sk.dynamic_quantize.default, (x, "group", "asymmetric", None, 16, "uint4"), {}),
        (sk.dynamic_quantize.default, (x, "group", "symmetric", None, 32, "fp8_e4m3"), {"scale_dtype": "e8m0"}),
        (sk.dynamic_quantize.out, (x, "token"), {"q": cuda((8, 64), torch.int8), "scale": cuda((8,))}),
        (sk.quantize_backward.default, (cuda((8, 64)), x, s, None, "token"), {}),
        (sk.dequantize_backward.default, (cuda((8, 64)), s, "token"), {}),
        (sk.fake_quantize.default, (x, s, z, "token"), {}),
        (sk.fake_quantize_backward.default, (cuda((8, 64)), x, s, z, "token"), {}),
        (sk.fake_quantize_learnable.default, (x, s, z.float(), "token", None, None, -128, 127, 0.1), {}),
        (sk.fake_quantize_learnable_backward.default, (cuda((8, 64)), x, s, z, "token"), {}),
        (sk.grouped_matmul.default, (x, w, None, off), {}),
        (sk.grouped_matmul_backward.default, (x, w, cuda((8, 16)), None, off), {}),
    ]


def test_opcheck_schema_and_fake_tensor():
    with FakeTensorMode():
        cases = _opcheck_cases()
    for op, args, kwargs in cases:
        torch.library.opcheck(op, args, kwargs, test_utils=("test_schema", "test_faketensor"))


# -- autograd wiring on meta tensors ---------------------------------------------------------------------
def test_autograd_reaches_the_backward_ops_on_meta_tensors():
    """Forward and backward of every differentiable op on meta tensors: the formulas run and the
    backward ops' fake impls give gradients of the parameters' shapes and dtypes."""
    M, N, K, E = 12, 16, 32, 3
    x = torch.empty(M, K, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(E, N, K, device="meta", dtype=torch.bfloat16, requires_grad=True)
    off = torch.empty(E + 1, device="meta", dtype=torch.int32)
    y = sft.grouped_matmul(x, w, offsets=off)
    gx, gw = torch.autograd.grad(y, (x, w), torch.empty_like(y))
    assert gx.shape == x.shape and gx.dtype == x.dtype and gw.shape == w.shape and gw.dtype == w.dtype
    (gw_only,) = torch.autograd.grad(sft.grouped_matmul(x.detach(), w, offsets=off), (w,), torch.empty_like(y))
    assert gw_only.dtype == torch.bfloat16

    xf = torch.empty(4, 64, device="meta", requires_grad=True)
    s = torch.empty(4, device="meta", requires_grad=True)
    zf = torch.empty(4, device="meta", requires_grad=True)
    yl = sft.fake_quantize_learnable(xf, s, zf, scope="token")
    grads = torch.autograd.grad(yl, (xf, s, zf), torch.empty_like(yl))
    assert [tuple(g.shape) for g in grads] == [(4, 64), (4,), (4,)]

    q8 = sft.quantize(xf, s.detach(), scope="token", out_dtype="fp8_e4m3")
    assert q8.requires_grad and q8.dtype == torch.float8_e4m3fn
    (gq,) = torch.autograd.grad(q8.float().sum(), xf)
    assert gq.shape == xf.shape

    qi = torch.empty(4, 64, device="meta", dtype=torch.int8)
    sd = torch.empty(4, 2, device="meta", dtype=torch.float64, requires_grad=True)
    yd = sft.dequantize(qi, sd, scope="group", group_size=32, out_dtype="float64")
    (gs,) = torch.autograd.grad(yd, sd, torch.empty_like(yd))
    assert gs.shape == sd.shape and gs.dtype == torch.float64
    q4 = torch.empty(4, 32, device="meta", dtype=torch.uint8)
    y4 = sft.dequantize(q4, sd.float(), scope="group", group_size=32, in_dtype="int4")
    assert y4.shape == (4, 64)
    (g4,) = torch.autograd.grad(y4, sd, torch.empty_like(y4))
    assert g4.shape == sd.shape


def test_make_fx_symbolic_token_dimension():
    """The fake impls trace with a symbolic token dimension (what torch.compile(dynamic=True) does)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, w, off):
        q, s, _ = sft.dynamic_quantize(x, scope="token")
        y = sft.grouped_matmul(sft.dequantize(q, s, scope="token", out_dtype="bfloat16"), w, offsets=off)
        return y

    x = torch.empty(24, 64, device="meta", dtype=torch.bfloat16)
    w = torch.empty(3, 16, 64, device="meta", dtype=torch.bfloat16)
    off = torch.empty(4, device="meta", dtype=torch.int32)
    gm = make_fx(step, tracing_mode="symbolic")(x, w, off)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert any("skuforge.grouped_matmul" in t for t in targets)
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    val = out[0].meta["val"] if isinstance(out, (list, tuple)) else out.meta["val"]
    assert isinstance(val.shape[0], torch.SymInt)


def test_symbolic_integer_arguments_specialize():
    """torch.compile(dynamic=True) makes integer arguments symbolic (a group size computed from a
    shape, here): the fake impls specialize on them instead of refusing them as non-integers."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x):
        q, s, _ = sft.dynamic_quantize(x, scope="group", group_size=x.shape[-1] // 2, out_dtype="fp8_e4m3")
        return sft.dequantize(q, s, scope="group", group_size=x.shape[-1] // 2, out_dtype="bfloat16")

    x = torch.empty(24, 64, device="meta", dtype=torch.bfloat16)
    gm = make_fx(step, tracing_mode="symbolic")(x)
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    val = out[0].meta["val"] if isinstance(out, (list, tuple)) else out.meta["val"]
    assert tuple(val.shape)[1] == 64 or isinstance(val.shape[1], torch.SymInt)
