"""CPU: ``torch.ops.skuforge`` without a GPU (the CPU build of PyTorch in CI).

The schemas, the fake implementations (FakeTensorMode fakes CUDA tensors on a CPU-only build:
shapes, dtypes, strides, typed errors), ``torch.library.opcheck``'s schema and fake-tensor tests,
the autograd wiring on meta tensors (backward formulas reach the backward ops' fake impls), the
functional API traced into the custom ops (meta and fake tensors, ``torch.compile(fullgraph=True)``),
and the straight-through estimator of quantize -> dequantize with CPU kernels computed by
runtime.reference (the definition the CUDA kernels match bit for bit).
The real kernels: tests/pytorch/test_gpu_torch_ops.py, tests/pytorch/test_gpu_torch_compile.py."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import runtime as sf  # noqa: E402
import runtime.torch as sft  # noqa: E402
from runtime import kinds, reference  # noqa: E402
from runtime.arrays import kind_of  # noqa: E402
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
        assert op._schema.is_mutable, name
        # nothing returned aliases an input (LSQ's .out returns its new dscale, dzero_point; fake_quantize_with_mask's
        # its mask)
        assert all(r.alias_info is None for r in op._schema.returns), name
        assert len(op._schema.returns) == {"fake_quantize_learnable_backward": 2, "fake_quantize_with_mask": 1}.get(
            name, 0), name
        mutated = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert mutated and all(a.kwarg_only for a in op._schema.arguments if a.name in mutated), (name, mutated)


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
    # the mask: bool of x's shape, or its bits (2, 6, ceil(96 / 8)) uint8, which the from-mask backward reads
    y, m = sk.fake_quantize_with_mask(x, s, z, scope, axis, gs, -128, 127, "bool")
    assert_dense(y, shape, xdt)
    assert_dense(m, shape, torch.bool)
    y, bits = sk.fake_quantize_with_mask(x, s, None, scope, axis, gs)
    assert_dense(y, shape, xdt)
    assert_dense(bits, (2, 6, 12), torch.uint8)
    assert_dense(sk.fake_quantize_with_mask.out(x, s, z, scope, axis, gs, out=torch.empty_like(x)), (2, 6, 12),
                 torch.uint8)
    assert_dense(sk.fake_quantize_backward_from_mask(dy, bits), shape, xdt)
    sk.fake_quantize_backward_from_mask.out(dy, bits, out=torch.empty_like(dy))


@pytest.mark.parametrize("cols,nbytes", [(1, 1), (7, 1), (8, 1), (9, 2), (100, 13)])
def test_mask_bits_shape_is_ceil_d_over_8(fake, cols, nbytes):
    x = cuda((3, cols))
    _, bits = sk.fake_quantize_with_mask(x, cuda(()), None, "tensor")
    assert_dense(bits, (3, nbytes), torch.uint8)
    assert_dense(sft.fake_quantize_backward_from_mask(x, bits), (3, cols), torch.float32)


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
    ("mask format", InvalidProblemError, "mask='bytes'; supported: 'bool'",
     lambda: sk.fake_quantize_with_mask(cuda((4, 64)), cuda((4,)), None, "token", None, None, -128, 127, "bytes")),
    ("mask dtype", InvalidProblemError, "mask has dtype s8; fake_quantize_backward_from_mask reads uint8 bits",
     lambda: sk.fake_quantize_backward_from_mask(cuda((4, 64)), cuda((4, 8), torch.int8))),
    ("bool mask", InvalidProblemError, "mask=torch.bool",
     lambda: sk.fake_quantize_backward_from_mask(cuda((4, 64)), cuda((4, 64), torch.bool))),
    ("mask shape", InvalidProblemError, "needs bits of shape \\(4, 8\\)",
     lambda: sk.fake_quantize_backward_from_mask(cuda((4, 63)), cuda((4, 7), torch.uint8))),
    ("mask dy dtype", UnsupportedError, "dy has dtype i32",
     lambda: sk.fake_quantize_backward_from_mask(cuda((4, 64), torch.int32), cuda((4, 8), torch.uint8))),
    ("mask out", InvalidProblemError, "out has shape",
     lambda: sk.fake_quantize_backward_from_mask.out(cuda((4, 64)), cuda((4, 8), torch.uint8),
                                                     out=cuda((4, 64), torch.float16))),
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
    ("dynamic out low-bit", InvalidProblemError, "out\\[0\\] \\(q\\) has shape",
     lambda: sk.dynamic_quantize.out(cuda((4, 64)), "token", out_dtype="fp8_e4m3", q=cuda((4, 64), torch.int8),
                                     scale=cuda((4,)))),
    ("gmm out contiguous", InvalidProblemError, "C-contiguous",
     lambda: sk.grouped_matmul.out(cuda((8, 64)), cuda((2, 16, 64)), None, cuda((3,), torch.int32),
                                   out=cuda((16, 8)).t())),
    ("gmm backward out", InvalidProblemError, "need_weight=False",
     lambda: sk.grouped_matmul_backward.out(cuda((8, 64)), cuda((2, 16, 64)), cuda((8, 16)), None,
                                            cuda((3,), torch.int32), "auto", True, False, dx=cuda((8, 64)),
                                            dw=cuda((2, 16, 64)))),
    ("dynamic out strided scale", InvalidProblemError, "out\\[1\\] \\(scale\\) must be C-contiguous",
     lambda: sk.dynamic_quantize.out(cuda((4, 64)), "group", group_size=16, q=cuda((4, 64), torch.int8),
                                     scale=torch.empty_strided((4, 4), (1, 4), device="cuda"))),
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
        (sk.fake_quantize_with_mask.default, (x, s, z, "token"), {}),
        (sk.fake_quantize_with_mask.default, (x, s, None, "token", None, None, -8, 7, "bool"), {}),
        (sk.fake_quantize_with_mask.out, (x, s, z, "token"), {"out": cuda((8, 64))}),
        (sk.fake_quantize_backward_from_mask.default, (cuda((8, 64)), cuda((8, 8), torch.uint8)), {}),
        (sk.fake_quantize_backward_from_mask.out, (cuda((8, 64)), cuda((8, 8), torch.uint8)), {"out": cuda((8, 64))}),
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

    yq = sft.fake_quantize(xf, s.detach(), scope="token")                  # the forward writes the bits
    (gf,) = torch.autograd.grad(yq, xf, torch.empty_like(yq))
    assert gf.shape == xf.shape and gf.dtype == xf.dtype
    y2, bits = sk.fake_quantize_with_mask(xf, s.detach(), None, "token")   # the schema's default mask: bits
    assert bits.shape == (4, 8) and bits.dtype == torch.uint8 and not bits.requires_grad
    (g2,) = torch.autograd.grad(y2, xf, torch.empty_like(y2))
    assert g2.shape == xf.shape

    q8 = sft.quantize(xf, s.detach(), scope="token", out_dtype="fp8_e4m3")
    assert not q8.requires_grad and q8.dtype == torch.float8_e4m3fn       # codes carry no gradient
    y8 = sft.dequantize(q8, s.detach(), scope="token", out_dtype="bfloat16")
    (gq,) = torch.autograd.grad(y8, xf, torch.empty_like(y8))               # quantize -> dequantize: STE
    assert gq.shape == xf.shape and gq.dtype == xf.dtype

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


# -- the functional API traced into the custom ops ----------------------------------------------------------
def _functional_cases(t):
    """(name, call, expected) for every functional op, ``out=`` included: ``call()`` runs the functional API
    on tensors made by ``t(shape, dtype)``; expected: (shape, dtype) per result (None: a None result)."""
    f32, i8, u8, i32 = torch.float32, torch.int8, torch.uint8, torch.int32
    x, s, z, dy = t((8, 64)), t((8,)), t((8,), i32), t((8, 64))
    sg, sm = t((8, 2)), t((8, 2), u8)                       # group 32: float and e8m0 scales
    q, q8, q4 = t((8, 64), i8), t((8, 64), torch.float8_e4m3fn), t((8, 32), u8)
    xb, w, off, re = t((8, 64), torch.bfloat16), t((3, 16, 64), torch.bfloat16), t((4,), i32), t((8,), i32)
    dyb = t((8, 16), torch.bfloat16)
    xs, qs, fp8 = (8, 64), (8, 64), torch.float8_e4m3fn
    return [
        ("quantize", lambda: sf.quantize(x, s, z, scope="token"), [(xs, i8)]),
        ("quantize out=", lambda: sf.quantize(x, s, scope="token", out=t(xs, i8)), [(xs, i8)]),
        ("quantize int4", lambda: sf.quantize(x, sg, scope="group", group_size=32, out_dtype="uint4"),
         [((8, 32), u8)]),
        ("quantize mx", lambda: sf.quantize(x, sm, scope="group", group_size=32, out_dtype="fp8_e4m3",
                                            scale_dtype="e8m0"), [(xs, fp8)]),
        ("quantize scalar scale", lambda: sf.quantize(x, 0.25, 3, scope="tensor", out_dtype="uint8"), [(xs, u8)]),
        ("dequantize", lambda: sf.dequantize(q, s, z, scope="token", out_dtype="bfloat16"), [(qs, torch.bfloat16)]),
        ("dequantize out=", lambda: sf.dequantize(q, s, scope="token", out=t(qs, f32)), [(qs, f32)]),
        ("dequantize fp8 mx", lambda: sf.dequantize(q8, sm, scope="group", group_size=32, scale_dtype="e8m0"),
         [(qs, f32)]),
        ("dequantize int4", lambda: sf.dequantize(q4, sg, scope="group", group_size=32, in_dtype="int4"), [(xs, f32)]),
        ("dynamic_quantize", lambda: sf.dynamic_quantize(x, scope="token"), [(xs, i8), ((8,), f32), None]),
        ("dynamic_quantize asymmetric", lambda: sf.dynamic_quantize(x, scope="group", group_size=16, mode="asymmetric",
                                                                     out_dtype="uint8"),
         [(xs, u8), ((8, 4), f32), ((8, 4), i32)]),
        ("dynamic_quantize mx", lambda: sf.dynamic_quantize(x, scope="group", group_size=32, out_dtype="fp8_e4m3",
                                                             scale_dtype="e8m0"), [(xs, fp8), ((8, 2), u8), None]),
        ("dynamic_quantize out=", lambda: sf.dynamic_quantize(x, scope="token", mode="asymmetric",
                                                               out=(t(xs, i8), t((8,)), t((8,), i32))),
         [(xs, i8), ((8,), f32), ((8,), i32)]),
        ("dynamic_quantize mx out=", lambda: sf.dynamic_quantize(x, scope="group", group_size=32, out_dtype="fp8_e4m3",
                                                                  scale_dtype="e8m0", out=(t(xs, u8), t((8, 2), u8))),
         [(xs, u8), ((8, 2), u8), None]),
        ("quantize_backward", lambda: sf.quantize_backward(dy, x, s, z, scope="token"), [(xs, f32)]),
        ("quantize_backward out=", lambda: sf.quantize_backward(dy, x, 0.5, scope="tensor", out=t(xs)), [(xs, f32)]),
        ("dequantize_backward", lambda: sf.dequantize_backward(dy, sg, scope="group", group_size=32), [(xs, f32)]),
        ("dequantize_backward out=", lambda: sf.dequantize_backward(dy, s, scope="token", out=t(xs)), [(xs, f32)]),
        ("fake_quantize", lambda: sf.fake_quantize(x, s, z, scope="token"), [(xs, f32)]),
        ("fake_quantize out=", lambda: sf.fake_quantize(x, t((64,)), scope="channel", axis=1, out=t(xs)), [(xs, f32)]),
        ("fake_quantize_with_mask bool", lambda: sf.fake_quantize(x, s, scope="token", return_mask=True),
         [(xs, f32), (xs, torch.bool)]),
        ("fake_quantize_with_mask bits", lambda: sf.fake_quantize(x, s, z, scope="token", return_mask="bits"),
         [(xs, f32), ((8, 8), u8)]),
        ("fake_quantize_with_mask out=", lambda: sf.fake_quantize(x, t((64,)), scope="channel", axis=1, out=t(xs),
                                                                  return_mask="bits"), [(xs, f32), ((8, 8), u8)]),
        ("fake_quantize_with_mask bool out=", lambda: sf.fake_quantize(x, s, scope="token", out=t(xs), return_mask=True),
         [(xs, f32), (xs, torch.bool)]),
        ("fake_quantize_backward_from_mask", lambda: sf.fake_quantize_backward_from_mask(dy, t((8, 8), u8)),
         [(xs, f32)]),
        ("fake_quantize_backward_from_mask out=", lambda: sf.fake_quantize_backward_from_mask(
            dy, t((8, 8), u8), out=t(xs)), [(xs, f32)]),
        ("fake_quantize_backward", lambda: sf.fake_quantize_backward(dy, x, s, z, scope="token"), [(xs, f32)]),
        ("fake_quantize_backward out=", lambda: sf.fake_quantize_backward(dy, x, s, scope="token", out=t(xs)),
         [(xs, f32)]),
        ("fake_quantize_learnable_backward", lambda: sf.fake_quantize_learnable_backward(dy, x, s, z, scope="token"),
         [(xs, f32), ((8,), f32), ((8,), f32)]),
        ("fake_quantize_learnable_backward out=", lambda: sf.fake_quantize_learnable_backward(
            dy, x, 0.1, scope="tensor", out=t(xs)), [(xs, f32), ((), f32), None]),
        ("grouped_matmul", lambda: sf.grouped_matmul(xb, w, offsets=off), [((8, 16), torch.bfloat16)]),
        ("grouped_matmul out=", lambda: sf.grouped_matmul(xb, w, row_experts=re, out=t((8, 16), torch.bfloat16)),
         [((8, 16), torch.bfloat16)]),
        ("grouped_matmul_backward", lambda: sf.grouped_matmul_backward(xb, w, dyb, offsets=off),
         [((8, 64), torch.bfloat16), ((3, 16, 64), f32)]),
        ("grouped_matmul_backward dw only", lambda: sf.grouped_matmul_backward(xb, w, dyb, row_experts=re,
                                                                               need_input=False, dw_dtype="bfloat16"),
         [None, ((3, 16, 64), torch.bfloat16)]),
        ("grouped_matmul_backward out=", lambda: sf.grouped_matmul_backward(
            xb, w, dyb, offsets=off, out=(t((8, 64), torch.bfloat16), t((3, 16, 64)))),
         [((8, 64), torch.bfloat16), ((3, 16, 64), f32)]),
    ]


FUNCTIONAL_OPS = ("quantize", "dequantize", "dynamic_quantize", "quantize_backward", "dequantize_backward",
                  "fake_quantize", "fake_quantize_backward", "fake_quantize_backward_from_mask",
                  "fake_quantize_learnable_backward", "grouped_matmul", "grouped_matmul_backward")


def _check_results(result, expected, device):
    results = result if isinstance(result, tuple) else (result,)
    assert len(results) == len(expected), (results, expected)
    for r, e in zip(results, expected):
        if e is None:
            assert r is None
        else:
            assert tuple(r.shape) == e[0] and r.dtype == e[1] and r.device.type == device, (r, e)


def test_functional_cases_cover_every_op_and_out():
    names = [c[0] for c in _functional_cases(lambda shape, dtype=torch.float32: None)]
    for op in FUNCTIONAL_OPS:
        assert op in names and f"{op} out=" in names, op


def _meta(shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("i", range(len(_functional_cases(_meta))), ids=[c[0] for c in _functional_cases(_meta)])
def test_functional_api_on_meta_and_fake_tensors(i):
    """Meta and FakeTensor arguments have no memory to launch on: the functional call is the op's custom op
    (its fake implementation gives the results' shapes and dtypes), out= tensors are returned as given."""
    name, call, expected = _functional_cases(_meta)[i]
    _check_results(call(), expected, "meta")
    with FakeTensorMode():
        name, call, expected = _functional_cases(cuda)[i]
        _check_results(call(), expected, "cuda")


def test_functional_api_out_is_returned_as_given():
    out = _meta((8, 64), torch.int8)
    assert sf.quantize(_meta((8, 64)), _meta((8,)), scope="token", out=out) is out
    outs = (_meta((8, 64), torch.int8), _meta((8,)))
    q, s, z = sf.dynamic_quantize(_meta((8, 64)), scope="token", out=outs)
    assert q is outs[0] and s is outs[1] and z is None


def test_functional_api_records_no_autograd_when_traced():
    """As in eager (the functional API launches kernels that autograd does not see): no gradient."""
    x = torch.zeros(8, 64, device="meta", requires_grad=True)
    s = torch.zeros(8, device="meta", requires_grad=True)
    assert not sf.fake_quantize(x, s, scope="token").requires_grad
    q = sf.quantize(x, s, scope="token", out_dtype="fp8_e4m3")
    assert not sf.dequantize(q, s, scope="token").requires_grad


def test_functional_api_typed_errors_when_traced():
    with pytest.raises(InvalidProblemError, match="scale has shape"):
        sf.quantize(_meta((8, 64)), _meta((5,)), scope="token")
    with pytest.raises(UnsupportedError, match="scope='row'"):
        sf.fake_quantize(_meta((8, 64)), _meta((8,)), scope="row")


def _graph_targets(fn):
    """The call targets of the one graph ``torch.compile(fn, fullgraph=True)`` traces, and fn's result."""
    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return gm
    torch._dynamo.reset()
    result = torch.compile(fn, backend=capture, fullgraph=True)()
    assert len(graphs) == 1
    return [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"], result


@pytest.mark.parametrize("i", range(len(_functional_cases(_meta))), ids=[c[0] for c in _functional_cases(_meta)])
def test_functional_api_compiles_fullgraph_into_the_custom_ops(i):
    name, call, expected = _functional_cases(_meta)[i]
    targets, result = _graph_targets(call)
    op = name.split(" ")[0]
    assert f"skuforge.{op}.{'out' if 'out=' in name else 'default'}" in targets, targets
    _check_results(result, expected, "meta")


def test_functional_api_compiles_on_first_sight_of_a_torch_tensor(monkeypatch):
    """The first torch tensor the functional API ever sees may be one Dynamo traces: still one graph."""
    from runtime import replay
    for t in [t for t in replay._FRAMEWORK if issubclass(t, torch.Tensor)]:
        monkeypatch.delitem(replay._FRAMEWORK, t)
    monkeypatch.setattr(replay, "TRACING", replay._never)
    monkeypatch.setattr(replay, "traced", None)
    monkeypatch.setattr(replay, "TENSOR", None)
    x, s = _meta((8, 64)), _meta((8,))
    targets, q = _graph_targets(lambda: sf.quantize(x, s, scope="token"))
    assert "skuforge.quantize.default" in targets and q.dtype == torch.int8
    assert replay.TRACING is torch.compiler.is_dynamo_compiling and replay.traced is not None


# -- quantize -> dequantize is the straight-through estimator ------------------------------------------------
def _np(t):
    return t.detach().numpy()


def _np_scale(scale):
    """(NumPy scale, reference scale_dtype): e8m0 codes as uint8."""
    if scale.dtype in (torch.uint8, E8M0_DTYPE):
        return _np(scale.view(torch.uint8)), "e8m0"
    return _np(scale), None


def _np_zp(zero_point):
    return None if zero_point is None else _np(zero_point)


def _as_specified(t, spec):
    """A reference result, checked against the op's fake implementation's (shape, dtype)."""
    assert (tuple(t.shape), t.dtype) == spec, ((tuple(t.shape), t.dtype), spec)
    return t


def _ref_quantize(x, scale, zero_point, scope, axis=None, group_size=None, out_dtype="int8", qmin=None, qmax=None,
                  scale_dtype=None):
    spec = sft.meta.quantize_spec(x, scale, zero_point, scope, axis, group_size, out_dtype, qmin, qmax, scale_dtype)
    qk = kind_of(out_dtype)
    s, sdt = _np_scale(scale)
    kw = dict(scope=scope, axis=axis, group_size=group_size, qmin=qmin, qmax=qmax)
    if qk in kinds.LOW_BIT:
        codes = torch.from_numpy(reference.quantize_lowbit(_np(x), s, _np_zp(zero_point), out_dtype=qk,
                                                           scale_dtype=sdt, **kw))
        return _as_specified(codes.view(FP8[qk]) if qk in FP8 else codes, spec)
    return _as_specified(torch.from_numpy(reference.quantize(_np(x), s, _np_zp(zero_point), out_dtype=qk, **kw)), spec)


def _ref_dequantize(q, scale, zero_point, scope, axis=None, group_size=None, out_dtype="float32", in_dtype=None,
                    scale_dtype=None):
    spec = sft.meta.dequantize_spec(q, scale, zero_point, scope, axis, group_size, out_dtype, in_dtype, scale_dtype)
    qk = kind_of(in_dtype if in_dtype is not None else q.dtype)
    yk = kind_of(out_dtype)
    s, sdt = _np_scale(scale)
    kw = dict(scope=scope, axis=axis, group_size=group_size)
    if qk in kinds.LOW_BIT:
        y = reference.dequantize_lowbit(_np(q.view(torch.uint8)), s, _np_zp(zero_point), in_kind=qk, out_dtype=yk,
                                        scale_dtype=sdt, **kw)
    else:
        y = reference.dequantize(_np(q), s, _np_zp(zero_point), in_kind=qk, out_dtype=yk, **kw)
    return _as_specified(torch.from_numpy(np.ascontiguousarray(y)), spec)


def _ref_quantize_backward(dy, x, scale, zero_point, scope, axis=None, group_size=None, out_dtype="int8", qmin=None,
                           qmax=None):
    spec = sft.meta.quantize_backward_spec(dy, x, scale, zero_point, scope, axis, group_size, out_dtype, qmin, qmax)
    return _as_specified(torch.from_numpy(reference.quantize_backward(
        _np(dy), _np(x), _np(scale), _np_zp(zero_point), scope=scope, axis=axis, group_size=group_size,
        out_dtype=kind_of(out_dtype), qmin=qmin, qmax=qmax)), spec)


def _ref_fake_quantize(x, scale, zero_point, scope, axis=None, group_size=None, qmin=-128, qmax=127):
    spec = sft.meta.fake_quantize_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax)
    y, _ = reference.fake_quantize(_np(x), _np(scale), _np_zp(zero_point), scope=scope, axis=axis,
                                   group_size=group_size, qmin=qmin, qmax=qmax)
    CPU_CALLS.append("fake_quantize")
    return _as_specified(torch.from_numpy(y), spec)


def _ref_fake_quantize_with_mask(x, scale, zero_point, scope, axis=None, group_size=None, qmin=-128, qmax=127,
                                 mask="bits"):
    ys, ms = sft.meta.fake_quantize_with_mask_spec(x, scale, zero_point, scope, axis, group_size, qmin, qmax, mask)
    y, m = reference.fake_quantize(_np(x), _np(scale), _np_zp(zero_point), scope=scope, axis=axis,
                                   group_size=group_size, qmin=qmin, qmax=qmax)
    CPU_CALLS.append("fake_quantize_with_mask " + mask)
    m = reference.pack_mask_bits(m) if mask == "bits" else m
    return _as_specified(torch.from_numpy(y), ys), _as_specified(torch.from_numpy(m), ms)


def _ref_from_mask(dy, mask):
    spec = sft.meta.fake_quantize_backward_from_mask_spec(dy, mask)
    CPU_CALLS.append("fake_quantize_backward_from_mask")
    return _as_specified(torch.from_numpy(reference.fake_quantize_backward_from_mask(_np(dy), _np(mask))), spec)


CPU_CALLS: list = []        # the fake-quant CPU kernels called, in order


def _ref_quantize_out(*args, out):
    out.copy_(_ref_quantize(*args))
    torch._C._increment_version(out)            # as the CUDA implementation of every .out overload does


@pytest.fixture
def cpu_kernels():
    """CPU kernels of quantize (and quantize.out), dequantize, quantize_backward and the fake-quant forward
    (with and without its mask) and from-mask backward from runtime.reference, so that autograd (and
    torch.compile: the fake impls take CPU tensors too) run end to end on the CPU; removed again after the
    test."""
    mp = pytest.MonkeyPatch()
    mp.setattr(sft.meta, "DEVICES", ("cuda", "meta", "cpu"))
    CPU_CALLS.clear()
    ops = {sft.quantization._quantize: _ref_quantize, sft.quantization._dequantize: _ref_dequantize,
           sft.quantization._quantize_backward: _ref_quantize_backward, sft.quantization._fake_quantize: _ref_fake_quantize,
           sft.quantization._fake_quantize_with_mask: _ref_fake_quantize_with_mask,
           sft.quantization._fake_quantize_backward_from_mask: _ref_from_mask}
    for op, fn in ops.items():
        op.register_kernel("cpu", fn)
        op.set_kernel_enabled("cpu", True)
    lib = torch.library.Library("skuforge", "IMPL")
    lib.impl("quantize.out", _ref_quantize_out, "CPU")
    yield
    mp.undo()
    lib._destroy()
    for op in ops:
        op.set_kernel_enabled("cpu", False)


STE_KINDS = ["int8", "uint8", "int4", "uint4", "fp8_e4m3", "fp8_e5m2"]
STE_SCOPES = [("tensor", None, None), ("channel", 0, None), ("channel", 2, None), ("token", None, None),
              ("group", None, 32)]


def _ste_inputs(rng, shape, scope, axis, gs, out_dtype, xdt, scale_kind, zero_point):
    """x (values across the code range, some clipped or saturated, NaN and ±inf), its scale and zero point."""
    qk = kind_of(out_dtype)
    k = kinds.kind(qk)
    span = k.max if k.max is not None else (k.qrange[1] - k.qrange[0]) / 2
    pshape = param_shape(shape, scope, axis, gs)
    if scale_kind == "e8m0":
        codes = rng.integers(120, 130, size=pshape).astype(np.uint8)
        scale = torch.from_numpy(codes)
        sval = reference.e8m0_scale(codes)
    else:
        sval = rng.uniform(0.5, 2.0, size=pshape).astype(np.float64 if scale_kind == "f64" else np.float32)
        scale = torch.from_numpy(sval)
    x = rng.standard_normal(shape) * span * 0.6 * reference.broadcast_param(sval, shape, scope, axis, gs)
    flat = x.reshape(-1)
    flat[:3] = [np.nan, np.inf, -np.inf]
    x = torch.from_numpy(x).to(xdt).requires_grad_(True)
    zp = None
    if zero_point and k.max is None:
        lo, hi = k.qrange
        zp = torch.from_numpy(rng.integers(lo // 2, hi // 2 + 1, size=pshape).astype(np.int32))
    return x, scale, zp


def _ste_mask(x, scale, zp, scope, axis, gs, out_dtype):
    """The straight-through mask, from its definition: ``qmin <= rne(x * inv) + zp <= qmax`` (integer codes,
    the kind's full range, the implied zero point for None), ``|x * inv| <= fp8_max`` (fp8)."""
    qk = kind_of(out_dtype)
    k = kinds.kind(qk)
    xn = _np(x)
    m = np.float64 if xn.dtype == np.float64 else np.float32
    sv = reference.e8m0_scale(_np(scale.view(torch.uint8)), m) if scale.dtype in (torch.uint8, E8M0_DTYPE) \
        else _np(scale).astype(m)
    inv = (m(1) / reference.broadcast_param(sv, xn.shape, scope, axis, gs)).astype(m)
    with np.errstate(all="ignore"):
        t = (xn.astype(m) * inv).astype(m)
        if k.max is not None:
            return np.abs(t) <= k.max
        z = {"u8": 128, "u4": 8}.get(qk, 0) if zp is None else reference.broadcast_param(_np(zp), xn.shape, scope,
                                                                                         axis, gs)
        v = np.rint(t) + z
        return (v >= k.qrange[0]) & (v <= k.qrange[1])


STE_CODES = [(k, False) for k in STE_KINDS] + [(k, True) for k in STE_KINDS if not k.startswith("fp8")]


@pytest.mark.parametrize("scope,axis,gs", STE_SCOPES, ids=lambda v: str(v))
@pytest.mark.parametrize("out_dtype,zero_point", STE_CODES, ids=lambda v: {False: "sym", True: "zp"}.get(v, v))
@pytest.mark.parametrize("xdt,scale_kind,ydt", [(torch.float32, "f32", "float32"), (torch.float16, "f32", "float32"),
                                                (torch.float64, "f64", "float64")], ids=["f32", "f16", "f64"])
def test_quantize_then_dequantize_is_the_straight_through_estimator(cpu_kernels, rng, scope, axis, gs, out_dtype,
                                                                    zero_point, xdt, scale_kind, ydt):
    """x.grad = dy * mask exactly, in x's dtype: the scale cancels and nothing is rounded to the codes' dtype."""
    shape = (2, 3, 64)
    x, scale, zp = _ste_inputs(rng, shape, scope, axis, gs, out_dtype, xdt, scale_kind, zero_point)
    kw = dict(scope=scope, axis=axis, group_size=gs)
    q = sft.quantize(x, scale, zp, out_dtype=out_dtype, **kw)
    assert not q.requires_grad                                      # codes carry no gradient themselves
    y = sft.dequantize(q, scale, zp, out_dtype=ydt, in_dtype=out_dtype if "4" in out_dtype else None, **kw)
    want = _ref_dequantize(q, scale, zp, out_dtype=ydt, in_dtype=out_dtype if "4" in out_dtype else None, **kw)
    torch.testing.assert_close(y, want, rtol=0, atol=0, equal_nan=True)     # the forward is dequantize's own
    dy = torch.from_numpy(rng.standard_normal(shape)).to(y.dtype)
    y.backward(dy)
    mask = _ste_mask(x, scale, zp, scope, axis, gs, out_dtype)
    assert x.grad.dtype == x.dtype
    assert torch.equal(x.grad, dy.to(x.dtype) * torch.from_numpy(mask))
    assert 0 < mask.sum() < mask.size                               # some elements clip, most pass


@pytest.mark.parametrize("out_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("as_e8m0_dtype", [False, True], ids=["uint8 codes", "float8_e8m0fnu"])
def test_straight_through_with_mx_e8m0_scales(cpu_kernels, rng, out_dtype, as_e8m0_dtype):
    """e8m0 block scales (integer codes, no gradient of their own): x.grad = dy * mask all the same."""
    x, scale, _ = _ste_inputs(rng, (4, 128), "group", None, 32, out_dtype, torch.float32, "e8m0", False)
    if as_e8m0_dtype and E8M0_DTYPE != torch.uint8:
        scale = scale.view(E8M0_DTYPE)
    kw = dict(scope="group", group_size=32, scale_dtype="e8m0")
    y = sft.dequantize(sft.quantize(x, scale, out_dtype=out_dtype, **kw), scale, **kw)
    dy = torch.from_numpy(rng.standard_normal((4, 128)).astype(np.float32))
    y.backward(dy)
    mask = _ste_mask(x, scale, None, "group", None, 32, out_dtype)
    assert torch.equal(x.grad, dy * torch.from_numpy(mask)) and not mask.all() and mask.any()


def test_straight_through_and_the_scale_gradient_together(cpu_kernels, rng):
    """A scale that requires a gradient gets dequantize's, sum(dy * (q - zp)) per scale element; x still
    gets dy * mask (quantize passes nothing to the scale)."""
    x, scale, zp = _ste_inputs(rng, (4, 64), "token", None, None, "uint8", torch.float32, "f32", True)
    scale.requires_grad_(True)
    q = sft.quantize(x, scale, zp, scope="token", out_dtype="uint8")
    y = sft.dequantize(q, scale, zp, scope="token")
    dy = torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32))
    y.backward(dy)
    mask = _ste_mask(x, scale, zp, "token", None, None, "uint8")
    assert torch.equal(x.grad, dy * torch.from_numpy(mask))
    terms = dy.double() * (q.double() - zp.double()[:, None])
    # a float32 sum of 64 terms: within 64 roundings of the exact sum
    assert bool(((scale.grad.double() - terms.sum(-1)).abs() <= 64 * 2.0 ** -24 * terms.abs().sum(-1)).all())


def test_dequantize_alone_and_quantize_alone(cpu_kernels, rng):
    """dequantize of codes that quantize did not make (or made without a gradient): the scale's gradient
    only; an fp8 leaf q: dequantize_backward's dy * scale in q's dtype. quantize's codes never require a
    gradient; a gradient through them is an error, not a silent zero."""
    q = torch.from_numpy(rng.integers(-128, 128, size=(4, 64)).astype(np.int8))
    s = torch.from_numpy(rng.uniform(0.5, 2, size=4).astype(np.float32)).requires_grad_(True)
    y = sft.dequantize(q, s, scope="token")
    dy = torch.ones_like(y)
    (gs,) = torch.autograd.grad(y, s, dy)
    torch.testing.assert_close(gs, q.float().sum(-1))
    x = torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32)).requires_grad_(True)
    with torch.no_grad():
        q8 = sft.quantize(x, s.detach(), scope="token", out_dtype="fp8_e4m3")
    assert not sft.dequantize(q8, s.detach(), scope="token").requires_grad     # made without a gradient
    q8 = sft.quantize(x, s.detach(), scope="token", out_dtype="fp8_e4m3")
    with pytest.raises(RuntimeError, match="does not require grad"):
        q8.float().sum().backward()


def test_a_code_tensor_written_in_place_loses_its_link(cpu_kernels, rng):
    x, scale, _ = _ste_inputs(rng, (4, 64), "token", None, None, "int8", torch.float32, "f32", False)
    q = sft.quantize(x, scale, scope="token")
    q.zero_()                                                       # no longer quantize(x)
    assert not sft.dequantize(q, scale, scope="token").requires_grad
    x2 = x.detach().clone().requires_grad_(True)
    sft.quantize(x2, scale, scope="token", out=q)                   # the .out overload links to x2
    sft.dequantize(q, scale, scope="token").sum().backward()
    assert x.grad is None and x2.grad is not None


def test_straight_through_under_torch_compile(cpu_kernels, rng):
    """torch.compile(fullgraph=True) of quantize -> dequantize: the gradient equals eager's, dy * mask."""
    x, scale, _ = _ste_inputs(rng, (4, 64), "group", None, 32, "int4", torch.float32, "f32", False)
    kw = dict(scope="group", group_size=32)

    def step(x):
        return sft.dequantize(sft.quantize(x, scale, out_dtype="int4", **kw), scale, in_dtype="int4", **kw)

    dy = torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32))
    torch._dynamo.reset()
    y = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    y.backward(dy)
    mask = _ste_mask(x, scale, None, "group", None, 32, "int4")
    assert torch.equal(x.grad, dy * torch.from_numpy(mask)) and not mask.all()


def test_functional_api_compiled_on_cpu_kernels(cpu_kernels, rng):
    """torch.compile of the functional API runs the custom ops: the reference's codes and values."""
    x = torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32))
    s = torch.from_numpy(rng.uniform(0.01, 0.05, size=4).astype(np.float32))

    def step(x, s):
        q = sf.quantize(x, s, scope="token")
        return q, sf.dequantize(q, s, scope="token")

    torch._dynamo.reset()
    q, y = torch.compile(step, backend="aot_eager", fullgraph=True)(x, s)
    assert torch.equal(q, _ref_quantize(x, s, None, "token"))
    assert torch.equal(y, _ref_dequantize(q, s, None, "token"))


def test_a_plain_tensor_subclass_is_launched_on_not_traced():
    """A subclass without __torch_dispatch__ has memory of its own: the functional API launches on it as on
    a tensor (a custom op's implementation receives such tensors), here refusing it for living on the CPU."""
    class Sub(torch.Tensor):
        pass
    with pytest.raises(InvalidProblemError, match="torch tensor on cpu"):
        sf.quantize(torch.zeros(8, 64).as_subclass(Sub), torch.ones(8), scope="token")


# -- fake_quantize's autograd: the forward writes the mask's bits, the backward reads them ---------------------
def _fq_inputs(rng, shape, scope, axis, gs, xdt, asym):
    """x across [qmin, qmax] (some clipped, .5 ties, NaN and ±inf), its scale and zero point, and dy
    (negative values, NaN and ±inf: the product's -0 and NaN where the mask is 0)."""
    m = np.float64 if xdt == torch.float64 else np.float32
    pshape = param_shape(shape, scope, None if axis is None else axis % len(shape), gs)
    scale = rng.choice([0.25, 0.5, 1.0], size=pshape).astype(m)
    zp = rng.integers(-20, 21, size=pshape).astype(np.int32) if asym else None
    t = np.rint(rng.standard_normal(shape) * 120) + rng.choice([0.0, 0.5], size=shape)
    x = t * reference.broadcast_param(scale, shape, scope, axis, gs)
    dy = rng.standard_normal(shape)
    x.reshape(-1)[:3] = [np.nan, np.inf, -np.inf]
    dy.reshape(-1)[3:6] = [np.nan, np.inf, -np.inf]
    to = (lambda a: torch.from_numpy(a).to(xdt))
    return (to(x).requires_grad_(True), torch.from_numpy(scale), None if zp is None else torch.from_numpy(zp),
            to(dy))


@pytest.mark.parametrize("scope,axis,gs", [("tensor", None, None), ("channel", 0, None), ("channel", 2, None),
                                           ("token", None, None), ("group", None, 12)], ids=lambda v: str(v))
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("xdt", [torch.float32, torch.float16, torch.float64], ids=["f32", "f16", "f64"])
def test_fake_quantize_autograd_saves_only_the_bits(cpu_kernels, rng, scope, axis, gs, asym, xdt):
    """x.grad is fake_quantize_backward's dy * mask (the mask recomputed from x), bit for bit; what autograd
    keeps is the bits alone, (..., ceil(D / 8)) uint8 -- not x -- written by the forward (one kernel with y)."""
    shape = (2, 3, 60)                                  # D = 60: ragged (60 % 8 == 4)
    x, scale, zp, dy = _fq_inputs(rng, shape, scope, axis, gs, xdt, asym)
    kw = dict(scope=scope, axis=axis, group_size=gs)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = sft.fake_quantize(x, scale, zp, **kw)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [((2, 3, 8), torch.uint8)]
    assert CPU_CALLS == ["fake_quantize_with_mask bits"]
    y.backward(dy)
    assert CPU_CALLS[1:] == ["fake_quantize_backward_from_mask"]
    want = reference.fake_quantize_backward(_np(dy), _np(x), _np(scale), _np_zp(zp), **kw)
    got = _np(x.grad)
    assert x.grad.dtype == xdt
    nan = np.isnan(got)
    assert np.array_equal(nan, np.isnan(want))          # NaN equal to NaN whatever its payload; the rest bit for bit
    u = f"u{got.itemsize}"
    assert np.array_equal(np.where(nan, 0, got).view(u), np.where(nan, 0, want).view(u))
    assert np.isnan(want).any() and (np.signbit(want) & (want == 0)).any()      # NaN and -0 were exercised
    torch.testing.assert_close(y, _ref_fake_quantize(x, scale, zp, **kw), rtol=0, atol=0, equal_nan=True)


def test_fake_quantize_without_a_gradient_writes_no_mask(cpu_kernels, rng):
    x, scale, zp, _ = _fq_inputs(rng, (4, 64), "token", None, None, torch.float32, True)
    with torch.no_grad():
        sft.fake_quantize(x, scale, zp, scope="token")
    sft.fake_quantize(x.detach(), scale, zp, scope="token")
    assert CPU_CALLS == ["fake_quantize", "fake_quantize"]


def test_fake_quantize_autograd_under_torch_compile(cpu_kernels, rng):
    """torch.compile(fullgraph=True) of a QAT forward: the same gradient as eager, through the bits."""
    x, scale, zp, dy = _fq_inputs(rng, (4, 2, 40), "channel", 1, None, torch.float32, True)
    xe = x.detach().clone().requires_grad_(True)
    sft.fake_quantize(xe, scale, zp, scope="channel", axis=1).backward(dy)
    torch._dynamo.reset()
    step = torch.compile(lambda x: sft.fake_quantize(x, scale, zp, scope="channel", axis=1) * 2.0,
                         backend="aot_eager", fullgraph=True)
    step(x).backward(dy)
    torch.testing.assert_close(x.grad, 2.0 * xe.grad, rtol=0, atol=0, equal_nan=True)
    assert "fake_quantize_backward_from_mask" in CPU_CALLS


def test_fake_quantize_with_a_bool_mask_differentiates_too(cpu_kernels, rng):
    """The op's bool variant (what the traced functional API returns for return_mask=True): dy * mask."""
    x, scale, zp, dy = _fq_inputs(rng, (4, 64), "token", None, None, torch.float32, False)
    y, m = sk.fake_quantize_with_mask(x, scale, None, "token", None, None, -128, 127, "bool")
    assert m.dtype == torch.bool and not m.requires_grad
    y.backward(dy)
    torch.testing.assert_close(x.grad, dy * m, rtol=0, atol=0, equal_nan=True)
