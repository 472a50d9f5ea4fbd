"""GPU: every dynamic_quantize SKU bit-exact against the NumPy reference (random + edge cases,
via codegen.harness.checks.dynamic), the quantize/dequantize invariants, run-to-run determinism,
streams, the plan API, and > 2**31 elements (slow)."""
import numpy as np
import pytest

import runtime as sf
from codegen.harness import verify
from codegen.harness.checks import base as checks

pytestmark = pytest.mark.gpu

REG = sf.default_registry()
DYNAMIC = [s for s in REG.skus() if s.op == "dynamic_quantize"]


@pytest.mark.parametrize("sku", DYNAMIC, ids=str)
def test_dynamic_sku_bit_exact(sku, rng):
    # torch for the half-precision inputs (what LLM inference passes), CuPy for the others
    fw = "torch" if sku.element in ("bf16", "f16") else "cupy"
    if fw == "torch":
        pytest.importorskip("torch")
    res = verify.check(sku, rng, fw)
    assert res.passed, f"{res.detail}: {res.failures[:5]}"


@pytest.mark.parametrize("scope,kw", [("tensor", {}), ("channel", {"axis": 0}), ("channel", {"axis": -1}),
                                      ("token", {}), ("group", {"group_size": 128})])
@pytest.mark.parametrize("mode", ["symmetric", "asymmetric"])
def test_deterministic_run_to_run(scope, kw, mode, rng):
    """The same input gives the same bits on every run (no atomics on data; the per-channel
    kernel folds ranges with integer max, which is exact in any order)."""
    import cupy as cp
    x = cp.asarray((rng.standard_normal((2048, 4096)) * 10 ** rng.uniform(-2, 2, (2048, 1))).astype(np.float32))
    first = sf.dynamic_quantize(x, scope=scope, mode=mode, **kw)
    for _ in range(3):
        again = sf.dynamic_quantize(x, scope=scope, mode=mode, **kw)
        for a, b in zip(first, again):
            if a is not None:
                assert bool(cp.all(a.reshape(-1).view(cp.uint8) == b.reshape(-1).view(cp.uint8)))


@pytest.mark.parametrize("scope,element,mode,shape,out", [
    ("tensor", "bf16", "symmetric", (8192, 8192), "s8"), ("tensor", "f32", "asymmetric", (3, 100003), "s8"),
    ("tensor", "f16", "symmetric", (1, 1001), "s8"), ("tensor", "f64", "asymmetric", (4096, 515), "s8"),
    ("channel", "bf16", "symmetric", (8192, 8192), "s8"), ("channel", "bf16", "asymmetric", (4096, 14336), "u8"),
    ("channel", "f32", "asymmetric", (3, 100000), "s8"), ("channel", "f16", "symmetric", (300, 4096), "s8"),
    ("channel", "f64", "asymmetric", (4096, 516), "u8"), ("channel", "bf16", "asymmetric", (16, 4096), "s8"),
    ("channel", "bf16", "symmetric", (257, 24), "s8")])
def test_one_launch_equals_two_passes(scope, element, mode, shape, out, rng, override_settings):
    """Per tensor and per channel (last axis): the one-launch kernels (shared memory + L2 reuse,
    tails, one or several row parts) and the reduce + static quantize launches give the same bits,
    the reference's; the default takes the one launch. Edge values: NaN, +-inf, -0.0, a column of
    zeros."""
    import cupy as cp
    from runtime.quantization import fused
    from runtime.quantization import reduce as reduce_
    from runtime.arrays import as_array, numpy_dtype
    from runtime.scopes import rows_view
    host = (rng.standard_normal(shape) * 10 ** rng.uniform(-2, 2, (1, shape[1]))).astype(numpy_dtype(element))
    flat = host.reshape(-1)
    flat[rng.integers(0, host.size, 3)] = np.nan
    flat[rng.integers(0, host.size, 2)] = -0.0
    if scope == "channel":
        host[:, 1] = 0
        host[rng.integers(0, shape[0]), 2] = np.inf
        host[rng.integers(0, shape[0]), 3] = -np.inf
    kw = {"axis": -1} if scope == "channel" else {}
    x = cp.asarray(host)
    plan = sf.Plan.select(sf.Descriptor("dynamic_quantize", scope, mode, element, out))
    xr, qr = as_array(x, "x"), as_array(cp.empty(shape, numpy_dtype(out)), "q")
    lo, hi = (-128, 127) if out == "s8" else (0, 255)
    args = fused.DynamicArgs(xr, rows_view(xr, "x"), qr, rows_view(qr, "q"), None, None, scope, mode, lo, hi, 0, 1e-8,
                           axis=1 if scope == "channel" else None)
    cfg = reduce_.DynamicReduceLauncher().config(plan, args)
    assert cfg.coop or cfg.chan                # this GPU takes the one launch
    one = sf.dynamic_quantize(x, scope=scope, mode=mode, out_dtype=out, **kw)
    override_settings(schedule="two-pass")
    two = sf.dynamic_quantize(x, scope=scope, mode=mode, out_dtype=out, **kw)
    for a, b in zip(one, two):
        if a is not None:
            assert bool(cp.all(a.reshape(-1).view(cp.uint8) == b.reshape(-1).view(cp.uint8)))
    q_ref, s_ref, z_ref = sf.reference.dynamic_quantize_ref(host, scope=scope, mode=mode, out_dtype=out, **kw)
    np.testing.assert_array_equal(one[0].get(), q_ref)
    np.testing.assert_array_equal(one[1].get().reshape(-1), np.asarray(s_ref).reshape(-1))
    if z_ref is not None:
        np.testing.assert_array_equal(one[2].get().reshape(-1), np.asarray(z_ref).reshape(-1))


def test_torch_side_stream_and_types(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        big = x * 3          # queued on the side stream: the kernels must run after it
        outs = {s: sf.dynamic_quantize(big, scope=s, mode="asymmetric", **kw)
                for s, kw in (("token", {}), ("group", {"group_size": 64}), ("tensor", {}), ("channel", {"axis": 1}))}
    stream.synchronize()
    host = checks.to_host(big)
    for s, (q, sc, zp) in outs.items():
        assert isinstance(q, torch.Tensor) and q.dtype == torch.int8 and sc.dtype == torch.float32
        assert zp.dtype == torch.int32
        kw = {"group": {"group_size": 64}, "channel": {"axis": 1}}.get(s, {})
        q_ref, s_ref, z_ref = sf.reference.dynamic_quantize_ref(host, scope=s, mode="asymmetric", **kw)
        np.testing.assert_array_equal(q.cpu().numpy(), q_ref)
        np.testing.assert_array_equal(sc.cpu().numpy(), s_ref)
        np.testing.assert_array_equal(zp.cpu().numpy(), z_ref)


def test_plan_api_and_workspace():
    import cupy as cp
    from runtime.arrays import as_array, empty
    from runtime.quantization.dynamic import DynamicArgs
    from runtime.scopes import rows_view
    x = cp.asarray(np.random.default_rng(0).standard_normal((1000, 512)).astype(np.float32))
    xr = as_array(x, "x")
    q, s = as_array(empty(xr, x.shape, "s8"), "q"), as_array(empty(xr, (), "f32"), "scale")
    args = DynamicArgs(xr, rows_view(xr, "x"), q, rows_view(q, "q"), s, None, "tensor", "symmetric", -127, 127, 0, 1e-8)
    plan = sf.Plan.select(sf.Descriptor("dynamic_quantize", "tensor", "symmetric", "f32", "s8"))
    n = plan.workspace_size(args)
    assert n > 0 and "deterministic" in plan.precision_guarantee
    assert not plan.can_implement(args)                # no workspace yet
    args.workspace = as_array(cp.empty(n, cp.uint8), "workspace")
    assert plan.can_implement(args)
    plan.run(args)
    want_q, want_s, _ = sf.reference.dynamic_quantize_ref(x.get(), scope="tensor")
    np.testing.assert_array_equal(q.obj.get(), want_q)
    assert s.obj.get() == want_s
    token = sf.Plan.select(sf.Descriptor("dynamic_quantize", "token", "symmetric", "f32", "s8"))
    assert token.workspace_size(args) == 0


def test_empty_tensors_launch_nothing():
    import cupy as cp
    q, s, z = sf.dynamic_quantize(cp.empty((4, 0), cp.float32), scope="token", mode="asymmetric")
    assert q.shape == (4, 0) and s.shape == (4,) and z.shape == (4,)
    assert (s.get() == np.float32(1e-8)).all() and (z.get() == -128).all()
    q, s, z = sf.dynamic_quantize(cp.empty((0, 16), cp.float32), scope="tensor")
    assert q.shape == (0, 16) and s.shape == () and z is None


@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    """bf16 -> s8 per token (fused) and per tensor (reduce + static quantize) on 2.15e9 elements,
    then 2**31 - 1 rows of one element per token: 64-bit indexing, no grid limit."""
    torch = pytest.importorskip("torch")
    rows, d = 2**17 + 3, 2**14 + 16
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    x[-1, -5:] = torch.tensor([1e3, -2e3, 7.0, float("nan"), 0.5], dtype=torch.bfloat16)
    q, s, _ = sf.dynamic_quantize(x, scope="token")
    for sl in (slice(0, 2), slice(rows - 3, rows)):
        xh = checks.to_host(x[sl])
        q_ref, s_ref, _ = sf.reference.dynamic_quantize_ref(xh, scope="token")
        np.testing.assert_array_equal(q[sl].cpu().numpy(), q_ref)
        np.testing.assert_array_equal(s[sl].cpu().numpy(), s_ref)
    del q, s
    q, s, _ = sf.dynamic_quantize(x, scope="tensor")
    amax = np.float32(x.abs().nan_to_num(0.0).amax().float().item())   # exact; NaN ignored
    assert s.item() == np.float32(max(amax, np.float32(1e-8))) / np.float32(127)
    sh = np.float32(s.item())
    xh = checks.to_host(x[-3:])
    np.testing.assert_array_equal(q[-3:].cpu().numpy(), sf.reference.quantize(xh, sh, scope="tensor"))
    del q, s, x
    torch.cuda.empty_cache()
    n = 2**31 - 1
    x = torch.randn(n, 1, device="cuda", dtype=torch.bfloat16)
    q, s, _ = sf.dynamic_quantize(x, scope="token")
    for sl in (slice(0, 4), slice(n - 4, n)):
        q_ref, s_ref, _ = sf.reference.dynamic_quantize_ref(checks.to_host(x[sl]), scope="token")
        np.testing.assert_array_equal(q[sl].cpu().numpy(), q_ref)
        np.testing.assert_array_equal(s[sl].cpu().numpy(), s_ref)
    assert bool(((q.abs() == 127) | (x.abs() < 1e-8)).all())   # each row is its own amax (unless < eps)
    del q, s, x
    torch.cuda.empty_cache()


@pytest.mark.parametrize("config", ["block", "t16", "t16,ch=8", "t8", "t8,ch=4", "t8,ch=4,fixed=0", "t4", "t4,ch=2",
                                    "t2", "t2,fixed=0", "t2,ch=1", "t2,threads=32", "auto", "auto,fixed=0"])
@pytest.mark.parametrize("element,mode,scope,gs,shape", [
    ("bf16", "symmetric", "token", None, (37, 4096)), ("bf16", "symmetric", "group", 128, (16, 4096)),
    ("f16", "asymmetric", "group", 32, (9, 96)), ("f32", "asymmetric", "token", None, (130, 520)),
    ("bf16", "asymmetric", "group", 64, (33, 512)), ("f32", "symmetric", "group", 128, (20, 1024)),
    ("f16", "symmetric", "group", 256, (12, 2048)), ("f16", "asymmetric", "token", None, (5, 4096))])
def test_every_fused_launch_configuration_is_bit_exact(config, element, mode, scope, gs, shape, rng, monkeypatch,
                                                      override_settings):
    """Each team kernel (t16 ... t2, every chunk split it takes, the fixed-TX entry points and, with
    fixed=0, the run-time-TX ones in their place) and the block kernel give the reference's bits,
    NaN / inf / constant rows included; a configuration that cannot take the problem falls back to
    the block kernel, which is checked the same way."""
    import cupy as cp
    from runtime.arrays import numpy_dtype
    host = (rng.standard_normal(shape) * 10 ** rng.uniform(-2, 2, (shape[0], 1))).astype(numpy_dtype(element))
    host[1, 3], host[2, :], host[3, -1] = np.nan, 0.25, np.inf
    override_settings(dynamic_config=config)
    out = "int8" if mode == "symmetric" else "uint8"
    kw = {"group_size": gs} if gs else {}
    got = sf.dynamic_quantize(cp.asarray(host), scope=scope, mode=mode, out_dtype=out, **kw)
    want = sf.reference.dynamic_quantize_ref(host, scope=scope, mode=mode, group_size=gs,
                                             out_dtype="s8" if mode == "symmetric" else "u8")
    for g, w in zip(got, want):
        if w is not None:
            np.testing.assert_array_equal(g.get().view(np.uint8), np.asarray(w).astype(g.dtype).view(np.uint8))


@pytest.mark.parametrize("out_dtype,scale_dtype,gs", [("int8", "float32", 128), ("uint8", "float32", 24),
                                                      ("fp8_e4m3", "float32", 128), ("fp8_e4m3", "e8m0", 32),
                                                      ("int4", "float32", 64)])
@pytest.mark.parametrize("shape", [(256, 1024), (3, 37, 384), (70001, 128)])
@pytest.mark.parametrize("layout", ["col", "col_aligned"])
def test_scale_layouts_hold_the_row_major_values(shape, out_dtype, scale_dtype, gs, layout, rng):
    """The column layouts hold exactly the row-major scales (and codes), for the team kernels (16-byte
    aligned groups), the block kernel (group 24: the scalar path) and many rows; the padding of
    col_aligned is never written; a strided out= scale is written in its own layout."""
    torch = pytest.importorskip("torch")
    if gs == 24:
        shape = shape[:-1] + (shape[-1] // 128 * 120,)
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to("cuda", torch.bfloat16)
    mode = "asymmetric" if out_dtype == "uint8" else "symmetric"
    kw = dict(scope="group", group_size=gs, mode=mode, out_dtype=out_dtype, scale_dtype=scale_dtype)
    q0, s0, z0 = sf.dynamic_quantize(x, **kw)
    q1, s1, z1 = sf.dynamic_quantize(x, scale_layout=layout, **kw)
    assert s1.shape == s0.shape and s1.stride()[-2] == 1
    assert torch.equal(q1.view(torch.uint8), q0.view(torch.uint8))
    assert torch.equal(s1.contiguous().reshape(-1).view(torch.uint8), s0.reshape(-1).view(torch.uint8))
    if z0 is not None:
        assert z1.stride() == s1.stride() and torch.equal(z1.contiguous(), z0)
    # out=: a column array with its padding set to a marker, which must survive
    if scale_dtype == "float32":
        rows, groups = int(np.prod(shape[:-1])), shape[-1] // gs
        ld = rows + 5
        buf = torch.full((groups * ld,), -7.0, device="cuda")
        s2 = buf.as_strided(s0.shape, tuple(s1.stride()[:-2]) + (1, ld))
        z2 = None if z0 is None else torch.empty_strided(s0.shape, s2.stride(), dtype=torch.int32, device="cuda")
        sf.dynamic_quantize(x, out=(torch.empty_like(q0), s2) + (() if z2 is None else (z2,)), **kw)
        assert torch.equal(s2.contiguous(), s0)
        pad = buf.view(groups, ld)[:, rows:]
        assert bool((pad == -7.0).all())
