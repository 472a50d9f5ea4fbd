"""GPU checks of the training ops: every SKU bit-exact against the NumPy reference.

The training family of :mod:`codegen.harness.families` (``python -m codegen verify``). Each checker runs the
scope's shapes of :func:`codegen.harness.checks.base._shapes` (aligned, odd, rank up to 8), contiguous and
strided rows, power-of-two scales (exact .5 ties) and arbitrary ones, several quantization ranges,
NaN/±inf, an empty tensor, and, where PyTorch is installed, bit-exactness with PyTorch's own
fake-quant ops (float32). NaN compares equal to NaN whatever its payload (the GPU writes the
canonical NaN, NumPy propagates the input's); every other element must match bit for bit.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

import runtime as sf
from runtime import kinds
from runtime import reference as ref
from runtime.arrays import numpy_dtype
from runtime.launch import grid_cap
from runtime.scopes import param_shape

from .base import (CheckResult, _pow2_scales, _random_floats, _shapes, record, record_close, same_bits, strided_rows,
                   to_device, to_host)

FQ_RANGES = ((-128, 127), (0, 255), (-8, 7), (-127, 127), (0, 15), (-1000, 3000))
LSQ_RANGES = ((-128, 127), (0, 255), (-8, 7), (-127, 127), (0, 15))


# -- inputs ------------------------------------------------------------------------------------
def _math(kind: str) -> str:
    return "f64" if kind == "f64" else "f32"


def _scales(pshape, rng, math_kind, pow2: bool):
    if pow2:
        return np.asarray(_pow2_scales(pshape, rng, math_kind))
    return np.asarray((rng.random(pshape) * 0.2 + 0.003).astype(numpy_dtype(math_kind)))


def _gradient(shape, rng, kind, specials: bool):
    """dy: normal values (half of them negative: -0 products), optionally NaN/±inf."""
    g = rng.standard_normal(shape) * 3.0
    if specials and g.size >= 8:
        flat = g.reshape(-1)
        idx = rng.choice(flat.size, size=3, replace=False)
        flat[idx] = [np.nan, np.inf, -np.inf]
    return g.astype(numpy_dtype(kind))


def grid_values(shape, scale, zp, zp_sym, qmin, qmax, scope, axis, gs, rng, kind, nan=True):
    """x such that ``x / scale`` is centred on the range: normal noise, exact .5 ties, both
    saturations, 0 / -0, ±inf and (with ``nan``) NaN; exact in float64 for power-of-two scales."""
    if math.prod(shape) == 0:
        return np.zeros(shape, numpy_dtype(kind))
    t = _random_floats(shape, np.float64(1.0), rng, "f64")      # grid units, ties at k + 0.5
    z = np.asarray(zp_sym if zp is None else zp).astype(np.float64)
    off = (qmin + qmax) // 2 - ref.broadcast_param(z, shape, scope, axis, gs) if z.ndim else (qmin + qmax) // 2 - z
    x = (t + off) * ref.broadcast_param(np.asarray(scale, np.float64), shape, scope, axis, gs)
    if not nan:
        x = np.where(np.isnan(x), 0.375, x)
    with np.errstate(over="ignore"):
        return x.astype(numpy_dtype(kind))          # saturating values may become ±inf in f16


def _cases(sku, rng):
    """(label, shape, axis, group_size, strided) for the SKU's scope, plus an empty tensor."""
    out = []
    for shape, axis, gs in _shapes(sku.scope, rng):
        for strided in (False, True):
            if strided and len(shape) < 2:
                continue
            out.append((f"{shape} axis={axis} gs={gs} strided={strided}", shape, axis, gs, strided))
    empty = {"tensor": ((0, 16), None, None), "token": ((0, 16), None, None), "group": ((0, 16), None, 8),
             "channel": ((0, 16), 1, None)}[sku.scope]
    out.append((f"empty {empty[0]}", *empty, False))
    return out


def _dev(a, fw, strided, rng):
    d = to_device(a, fw)
    if strided:
        d = strided_rows(d, 4 + int(rng.integers(0, 12)), fw)
    return d


def _param(p, fw, pshape, rng, as_scalar_ok=True):
    """A parameter on the device, or (tensor scope, sometimes) a Python scalar."""
    if p is None:
        return None
    if as_scalar_ok and pshape == () and rng.random() < 0.4:
        return p.item()
    return to_device(np.ascontiguousarray(p), fw)


# -- elementwise ops ---------------------------------------------------------------------------
def check_training_elementwise(sku, rng, preferred_fw="cupy") -> CheckResult:
    res = CheckResult(str(sku), False)
    kind, mk, fw = sku.element, _math(sku.element), preferred_fw
    for i, (label, shape, axis, gs, strided) in enumerate(_cases(sku, rng)):
        # strided cases also run on a 2-block grid: every row loop of the kernel strides
        with grid_cap(2) if strided else contextlib.nullcontext():
            ax = None if axis is None else axis % len(shape)
            pshape = param_shape(shape, sku.scope, ax, gs)
            scale = _scales(pshape, rng, mk, pow2=rng.random() < 0.7)
            kw = dict(scope=sku.scope, axis=axis, group_size=gs)
            empty = math.prod(shape) == 0
            if sku.op == "dequantize_backward":
                dy = _gradient(shape, rng, kind, specials=True)
                want = dy.copy() if empty else ref.dequantize_backward(dy, scale, **kw)
                got = sf.dequantize_backward(_dev(dy, fw, strided, rng), _param(scale, fw, pshape, rng), **kw)
                record(res, label, to_host(got), want)
                continue
            if sku.op == "quantize_backward":
                qk = "s8" if rng.random() < 0.5 else "u8"
                lo, hi = kinds.QRANGE[qk]
                qmin, qmax = (lo, hi) if rng.random() < 0.5 else (lo + 3, hi - 5)
                rkw = dict(out_dtype=qk, qmin=qmin, qmax=qmax)
                center = ref.implied_zero_point(qk)
            else:
                qmin, qmax = FQ_RANGES[int(rng.integers(len(FQ_RANGES)))]
                rkw = dict(qmin=qmin, qmax=qmax)
                center = ref.fake_quant_zero_point(qmin, qmax)
            zp = rng.integers(qmin, qmax + 1, size=pshape).astype(np.int32) if sku.mode == "asymmetric" else None
            x = grid_values(shape, scale, zp, center, qmin, qmax, sku.scope, axis, gs, rng, kind)
            xd = _dev(x, fw, strided, rng)
            s_arg = _param(scale, fw, pshape, rng)
            z_arg = _param(zp, fw, pshape, rng)
            if sku.op == "fake_quantize":       # in turn: no mask, the bool mask, its bits
                want_y, want_m = ((x.copy(), np.zeros(shape, bool)) if empty
                                  else ref.fake_quantize(x, scale, zp, **kw, **rkw))
                return_mask = (False, True, "bits")[i % 3]
                got = sf.fake_quantize(xd, s_arg, z_arg, **kw, **rkw, return_mask=return_mask)
                if return_mask is False:
                    got = (got,)
                elif return_mask is True:
                    record(res, label + " mask", to_host(got[1]), want_m)
                else:
                    record(res, label + " mask bits", to_host(got[1]), ref.pack_mask_bits(want_m))
                record(res, label, to_host(got[0]), want_y)
                continue
            dy = _gradient(shape, rng, kind, specials=rng.random() < 0.5)
            dyd = _dev(dy, fw, strided and rng.random() < 0.5, rng)
            fn, rfn = ((sf.quantize_backward, ref.quantize_backward) if sku.op == "quantize_backward"
                       else (sf.fake_quantize_backward, ref.fake_quantize_backward))
            want = dy.copy() if empty else rfn(dy, x, scale, zp, **kw, **rkw)
            got = fn(dyd, xd, s_arg, z_arg, **kw, **rkw)
            record(res, label, to_host(got), want)
    if sku.element == "f32" and sku.scope in ("tensor", "channel") and sku.op in ("fake_quantize",
                                                                                  "fake_quantize_backward"):
        torch_fake_quantize_cases(res, sku, rng)
    res.passed = res.mismatches == 0 and res.cases > 0
    res.detail = f"{res.cases} cases, {res.mismatches} mismatching elements"
    return res


# -- the backward from the mask's bits ---------------------------------------------------------------
FROM_MASK_SHAPES = ((64, 512), (70, 256), (3, 8), (4, 9, 33), (3, 5, 77), (7,), (1,), (5, 1),
                    (2, 1, 3, 1, 2, 1, 2, 24), (21, 8192), (5, 40000), (0, 16), (4, 0))


def _offset_columns(a_dev, fw: str):
    """The same values as ``a_dev`` one element past the start of each row of a wider buffer: every
    row start misaligned for 16-byte accesses (the scalar path)."""
    if fw == "torch":
        import torch
        big = torch.empty(*a_dev.shape[:-1], a_dev.shape[-1] + 1, dtype=a_dev.dtype, device=a_dev.device)
    else:
        import cupy as cp
        big = cp.empty(a_dev.shape[:-1] + (a_dev.shape[-1] + 1,), dtype=a_dev.dtype)
    big[..., 1:] = a_dev
    return big[..., 1:]


def mask_gradient(shape, rng, kind):
    """dy for the from-mask backward: normal values (half negative: -0 where masked), NaN, ±inf and ±0."""
    g = rng.standard_normal(shape) * 3.0
    flat = g.reshape(-1)
    if flat.size >= 16:
        idx = rng.choice(flat.size, size=5, replace=False)
        flat[idx] = [np.nan, np.inf, -np.inf, 0.0, -0.0]
    return g.astype(numpy_dtype(kind))


def random_mask(shape, rng):
    """A bool mask, mostly true, with whole bytes of 0 and of 1 bits among the rows."""
    m = rng.random(shape) < 0.7
    if len(shape) and shape[-1] >= 16 and math.prod(shape):
        m.reshape(-1, shape[-1])[0, :8] = False
        m.reshape(-1, shape[-1])[-1, 8:16] = True
    return m


def check_from_mask(sku, rng, preferred_fw="cupy") -> CheckResult:
    """dx = dy * bit against the reference, bit for bit: D a multiple of 8 (the vector path) and ragged,
    rank 1 to 8, strided rows of dy, dx and the mask (on a 2-block grid), misaligned rows (the scalar
    path), in place (out=dy), NaN / ±inf / ±0 gradients, empty tensors."""
    res = CheckResult(str(sku), False)
    kind, fw = sku.element, preferred_fw
    for shape in FROM_MASK_SHAPES:
        for layout in ("contiguous", "strided", "offset", "in place"):
            if layout in ("strided", "offset") and len(shape) < 2:
                continue
            with grid_cap(2) if layout == "strided" else contextlib.nullcontext():
                dy = mask_gradient(shape, rng, kind)
                packed = ref.pack_mask_bits(random_mask(shape, rng))
                want = ref.fake_quantize_backward_from_mask(dy, packed)
                dyd, md = _dev(dy, fw, layout == "strided", rng), _dev(packed, fw, layout == "strided", rng)
                if layout == "offset" and math.prod(shape):
                    dyd = _offset_columns(dyd, fw)
                out = dyd if layout == "in place" else None
                got = sf.fake_quantize_backward_from_mask(dyd, md, out=out)
                record(res, f"{shape} {layout}", to_host(got), want)
    res.passed = res.mismatches == 0 and res.cases > 0
    res.detail = f"{res.cases} cases, {res.mismatches} mismatching elements"
    return res


# -- LSQ -----------------------------------------------------------------------------------------
def lsq_inputs(sku, shape, axis, gs, rng, specials=False):
    """(x, dy, scale, zp, qmin, qmax, grad_factor) for one LSQ case (NaN only with ``specials``)."""
    mk = _math(sku.element)
    ax = None if axis is None else axis % len(shape)
    pshape = param_shape(shape, sku.scope, ax, gs)
    scale = _scales(pshape, rng, mk, pow2=rng.random() < 0.5)
    qmin, qmax = LSQ_RANGES[int(rng.integers(len(LSQ_RANGES)))]
    zp = rng.integers(qmin, qmax + 1, size=pshape).astype(np.int32) if sku.mode == "asymmetric" else None
    x = grid_values(shape, scale, zp, ref.fake_quant_zero_point(qmin, qmax), qmin, qmax, sku.scope, axis, gs, rng,
                    sku.element, nan=specials)
    dy = _gradient(shape, rng, sku.element, specials=False)
    n = max(1, math.prod(shape) // max(1, math.prod(pshape)))
    g = 1.0 if rng.random() < 0.4 else 1.0 / math.sqrt(n * qmax if qmax > 0 else n)
    return x, dy, scale, zp, qmin, qmax, g


def check_lsq(sku, rng, preferred_fw="cupy") -> CheckResult:
    res = CheckResult(str(sku), False)
    fw = preferred_fw
    cases = _cases(sku, rng)
    cases.append(("tall " + str((3000, 24)), (3000, 24), 1 if sku.scope == "channel" else None,
                  8 if sku.scope == "group" else None, False))
    cases.append(("long rows (5, 40000)", (5, 40000), 0 if sku.scope == "channel" else None,
                  800 if sku.scope == "group" else None, False))
    for i, (label, shape, axis, gs, strided) in enumerate(cases):
        x, dy, scale, zp, qmin, qmax, g = lsq_inputs(sku, shape, axis, gs, rng, specials=(i == 1))
        kw = dict(scope=sku.scope, axis=axis, group_size=gs, qmin=qmin, qmax=qmax, grad_factor=g)
        ax = None if axis is None else axis % len(shape)
        pshape = param_shape(shape, sku.scope, ax, gs)
        if math.prod(shape) == 0:      # nothing to sum: zeros
            wdx, wds = dy.copy(), np.zeros(pshape, scale.dtype)
            wdz = None if zp is None else np.zeros(pshape, np.float32)
        else:
            wdx, wds, wdz = ref.fake_quantize_learnable_backward(dy, x, scale, zp, **kw)
        s_arg, z_arg = _param(scale, fw, pshape, rng), _param(zp, fw, pshape, rng)
        gdx, gds, gdz = sf.fake_quantize_learnable_backward(_dev(dy, fw, strided, rng), _dev(x, fw, strided, rng),
                                                            s_arg, z_arg, **kw)
        record(res, label + " dx", to_host(gdx), wdx)
        record(res, label + " dscale", to_host(gds), np.asarray(wds).reshape(np.shape(to_host(gds))))
        if zp is None:
            if gdz is not None:
                res.mismatches += 1
                res.failures.append(f"{label}: dzero_point should be None in symmetric mode")
        else:
            record(res, label + " dzero_point", to_host(gdz), np.asarray(wdz).reshape(np.shape(to_host(gdz))))
    if sku.element == "f32" and sku.scope in ("tensor", "channel"):
        torch_lsq_cases(res, sku, rng)
    res.passed = res.mismatches == 0 and res.cases > 0
    res.detail = f"{res.cases} cases, {res.mismatches} mismatching elements"
    return res


# -- PyTorch's own ops (float32) ------------------------------------------------------------------
def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def torch_fake_quantize_cases(res: CheckResult, sku, rng):
    """fake_quantize / its backward against torch.fake_quantize_per_{tensor,channel}_affine, bit for bit.

    Per channel, PyTorch rounds ``x * inv + zp`` in one step where skuforge (docs/numerics.md) and
    PyTorch's per-tensor op round ``x * inv`` then add zp: the two agree for zp = 0 and for even zero points with exact
    products, which is what is compared (docs/training.md)."""
    torch = _torch()
    if torch is None:
        return
    for shape, axis in (((64, 512), 1), ((3, 40, 33), 1), ((96, 40), 0)):
        ax = axis if sku.scope == "channel" else None
        pshape = param_shape(shape, sku.scope, ax, None)
        asym = sku.mode == "asymmetric"
        pow2 = asym or rng.random() < 0.5
        scale = _scales(pshape, rng, "f32", pow2=pow2)
        qmin, qmax = FQ_RANGES[int(rng.integers(3))]
        if asym:
            zp = rng.integers(qmin, qmax + 1, size=pshape).astype(np.int32)
            if sku.scope == "channel":   # even zero points: the per-channel rounding agrees
                zp = np.clip(zp - zp % 2, qmin + (qmin % 2), qmax).astype(np.int32)
        else:
            zp = None
        zpv = np.zeros(pshape, np.int32) + np.int32(ref.fake_quant_zero_point(qmin, qmax)) if zp is None else zp
        x = grid_values(shape, scale, zp, ref.fake_quant_zero_point(qmin, qmax), qmin, qmax, sku.scope, ax, None,
                        rng, "f32", nan=False)
        x = np.where(np.isinf(x), np.sign(x) * 1e6, x).astype(np.float32)   # finite: see torch_specials
        dy = _gradient(shape, rng, "f32", specials=False)
        xt = torch.from_numpy(x).cuda().requires_grad_(True)
        if sku.scope == "tensor":
            yt = torch.fake_quantize_per_tensor_affine(xt, float(scale), int(zpv), qmin, qmax)
        else:
            yt = torch.fake_quantize_per_channel_affine(xt, torch.from_numpy(scale).cuda(),
                                                        torch.from_numpy(zpv).cuda(), ax, qmin, qmax)
        yt.backward(torch.from_numpy(dy).cuda())
        kw = dict(scope=sku.scope, axis=ax, qmin=qmin, qmax=qmax)
        xd = torch.from_numpy(x).cuda()
        s_arg = torch.from_numpy(scale).cuda()
        z_arg = None if zp is None else torch.from_numpy(zp).cuda()
        label = f"torch {shape} axis={ax} [{qmin}, {qmax}]"
        if sku.op == "fake_quantize":
            got = sf.fake_quantize(xd, s_arg, z_arg, **kw)
            g, w = got.cpu().numpy(), yt.detach().cpu().numpy()
            bad = np.argwhere(~same_bits(g, w))
            record(res, label + " vs fake_quantize_per_" + sku.scope
                   + (f" (x={x[tuple(bad[0])]!r} there)" if len(bad) else ""), g, w)
        else:
            got = sf.fake_quantize_backward(torch.from_numpy(dy).cuda(), xd, s_arg, z_arg, **kw)
            record(res, label + " vs autograd of fake_quantize_per_" + sku.scope, got.cpu().numpy(),
                   xt.grad.cpu().numpy())


def torch_lsq_cases(res: CheckResult, sku, rng):
    """LSQ against torch._fake_quantize_learnable_per_{tensor,channel}_affine: dx bit for bit, the sums
    within 1e-4 of the sum of |terms| (PyTorch sums in its own order)."""
    torch = _torch()
    if torch is None:
        return
    for shape, axis in (((64, 512), 1), ((96, 40), 0)):
        ax = axis if sku.scope == "channel" else None
        x, dy, scale, zp, qmin, qmax, g = lsq_inputs(sku, shape, ax, None, rng)
        pshape = param_shape(shape, sku.scope, ax, None)
        if zp is not None and sku.scope == "tensor":
            # PyTorch's per-tensor learnable backward takes the zero point as trunc(zp + 0.5): one
            # more than the forward's for negative zero points; compare where the two agree
            zp = np.asarray(np.abs(zp) if qmax >= np.abs(zp) else 0 * zp, dtype=np.int32)
        zpv = (np.zeros(pshape, np.int32) + np.int32(ref.fake_quant_zero_point(qmin, qmax))) if zp is None else zp
        xt = torch.from_numpy(x).cuda().requires_grad_(True)
        st = torch.from_numpy(np.asarray(scale, np.float32).reshape(-1)).cuda().requires_grad_(True)
        zt = torch.from_numpy(zpv.astype(np.float32).reshape(-1)).cuda().requires_grad_(True)
        if sku.scope == "tensor":
            yt = torch._fake_quantize_learnable_per_tensor_affine(xt, st, zt, qmin, qmax, g)
        else:
            yt = torch._fake_quantize_learnable_per_channel_affine(xt, st, zt, ax, qmin, qmax, g)
        yt.backward(torch.from_numpy(dy).cuda())
        kw = dict(scope=sku.scope, axis=ax, qmin=qmin, qmax=qmax, grad_factor=g)
        s_arg = torch.from_numpy(np.ascontiguousarray(scale)).cuda()
        z_arg = None if zp is None else torch.from_numpy(zp).cuda()
        dx, ds, dz = sf.fake_quantize_learnable_backward(torch.from_numpy(dy).cuda(), torch.from_numpy(x).cuda(),
                                                         s_arg, z_arg, **kw)
        _, ts, tz = ref.lsq_terms(dy, x, scale, zpv, **{k: v for k, v in kw.items()})
        red_axes = tuple(i for i in range(len(shape)) if i != ax) if sku.scope == "channel" else None
        label = f"torch {shape} axis={ax} [{qmin}, {qmax}]"
        record(res, label + " dx vs learnable_per_" + sku.scope, dx.cpu().numpy(), xt.grad.cpu().numpy())
        record_close(res, label + " dscale", ds.cpu().numpy().reshape(-1), st.grad.cpu().numpy(),
                     np.abs(ts).sum(axis=red_axes).reshape(-1), 1e-4)
        if dz is not None:
            record_close(res, label + " dzero_point", dz.cpu().numpy().reshape(-1), zt.grad.cpu().numpy(),
                         np.abs(tz).sum(axis=red_axes).reshape(-1), 1e-4)


# -- GPU runs: compile the training units in parallel first ---------------------------------------
def _compile_unit(job):
    from runtime.compiler import compile_cached
    unit, source, arch, options = job
    compile_cached(source, unit, arch, options)
    return unit


def precompile(ops=("quantize_backward", "dequantize_backward", "fake_quantize", "fake_quantize_backward",
                    "fake_quantize_backward_from_mask", "fake_quantize_learnable_backward"), workers: int = 16) -> int:
    """Fill the NVRTC disk cache for the units holding ``ops`` (this device's arch), in parallel."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from runtime.device import compile_arch
    reg = sf.default_registry()
    units = sorted({reg.lookup(s).unit for s in reg.skus() if s.op in ops})
    arch = compile_arch(0)
    jobs = [(u, reg.unit_source(u), arch, tuple(reg.units[u]["nvrtc_options"])) for u in units]
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        return len(list(ex.map(_compile_unit, jobs)))


if __name__ == "__main__":
    print(f"precompiled {precompile()} units")


def torch_specials() -> dict:
    """What PyTorch's fake-quant ops give for NaN / ±inf (float32) next to skuforge's: recorded
    for docs/training.md, not compared (PyTorch's results come from float -> int casts)."""
    torch = _torch()
    if torch is None:
        return {}
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0]] * 2, device="cuda")
    s, z = torch.tensor([0.5, 0.5], device="cuda"), torch.tensor([2, 2], device="cuda", dtype=torch.int32)
    out = {}
    yt, mt = torch.ops.aten.fake_quantize_per_tensor_affine_cachemask(x, 0.5, 2, -8, 7)
    out["torch per_tensor"] = (yt.tolist()[0], mt.tolist()[0])
    yc, mc = torch.ops.aten.fake_quantize_per_channel_affine_cachemask(x, s, z, 0, -8, 7)
    out["torch per_channel"] = (yc.tolist()[0], mc.tolist()[0])
    y, m = sf.fake_quantize(x, 0.5, 2, scope="tensor", qmin=-8, qmax=7, return_mask=True)
    out["skuforge"] = (y.tolist()[0], m.tolist()[0])
    xl = x.clone().requires_grad_(True)
    st = torch.tensor([0.5], device="cuda", requires_grad=True)
    zt = torch.tensor([2.0], device="cuda", requires_grad=True)
    torch._fake_quantize_learnable_per_tensor_affine(xl, st, zt, -8, 7, 1.0).sum().backward()
    out["torch learnable per_tensor dx"] = xl.grad.tolist()[0]
    dx, _, _ = sf.fake_quantize_learnable_backward(torch.ones_like(x), x, 0.5, 2, scope="tensor", qmin=-8, qmax=7)
    out["skuforge learnable dx"] = dx.tolist()[0]
    return out


# the checkers of this family, by op (codegen.harness.families)
CHECKERS = {**dict.fromkeys(("quantize_backward", "dequantize_backward", "fake_quantize", "fake_quantize_backward"),
                             check_training_elementwise),
            "fake_quantize_backward_from_mask": check_from_mask,
            "fake_quantize_learnable_backward": check_lsq}
