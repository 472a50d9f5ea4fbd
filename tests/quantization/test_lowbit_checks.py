"""The low-bit GPU checkers (codegen/harness/checks/lowbit.py), dry-run on the CPU.

The checkers reach the device through ``put`` / ``get`` / ``strided`` and the functional API; here
those are replaced by a "device" that runs the NumPy reference, so every case the checkers
run on the GPU is generated, executed and compared here: a correct implementation passes and
a wrong one (a NaN code with its sign, swapped nibbles, double rounding from f64, a stale e8m0
rule) fails. It also checks that these checkers take the low-bit SKUs in front of the s8/u8 checkers.
"""
import numpy as np
import pytest

import runtime as sf
from codegen import matrix, spec
from codegen.families.quantization.blocks import lowbit_blocks
from codegen.harness import families, verify
from codegen.harness.checks import dynamic as checks_dynamic
from codegen.harness.checks import lowbit as checks_lowbit
from codegen.harness.checks import static as checks_static
from runtime import kinds
from runtime.scopes import param_strides
from runtime import reference as ref
from runtime.arrays import kind_of

LOWBIT = [c.sku for c in matrix.cells((spec.Family("lowbit", lowbit_blocks(), ()),)) if c.generated]


def _sample():
    """Per op, scope, mode and low-bit kind: one SKU, its float kind and arch rotating (deterministic)."""
    groups = {}
    for s in LOWBIT:
        low = s.element if s.op == "dequantize" else s.aux_element
        groups.setdefault((s.op, s.scope, s.mode, low), []).append(s)
    out = []
    for i, (key, skus) in enumerate(sorted(groups.items())):
        arches = sorted({s.arch for s in skus})
        arch = arches[(i // 2) % len(arches)]
        of_arch = [s for s in skus if s.arch == arch]
        out.append(of_arch[i % len(of_arch)])
    return out


SAMPLE = _sample()


class ReferenceDevice:
    """The functional API on host arrays, computed by runtime.reference (optionally with a bug)."""

    def __init__(self, bug=None):
        self.bug = bug

    def quantize(self, x, scale, zero_point=None, *, scope, axis=None, group_size=None, out_dtype, qmin=None,
                 qmax=None, scale_dtype=None, out=None):
        k = kind_of(out_dtype)
        xm = np.asarray(x)
        if self.bug == "f64-through-f32" and xm.dtype == np.float64:
            xm = xm.astype(np.float32)
            scale = np.asarray(scale).astype(np.float32) if scale_dtype is None else scale
        q = ref.quantize_lowbit(xm, scale, zero_point, scope=scope, axis=axis, group_size=group_size, out_dtype=k,
                                qmin=qmin, qmax=qmax, scale_dtype=scale_dtype)
        if self.bug == "signed-nan" and k in kinds.FP8:
            q = np.where(np.isnan(xm) & np.signbit(xm), np.uint8(0xFF), q)
        if self.bug == "nibbles" and k in kinds.INT4:
            q = ((q >> 4) | (q << 4)).astype(np.uint8)
        return q

    def dequantize(self, q, scale, zero_point=None, *, scope, axis=None, group_size=None, out_dtype="float32",
                   in_dtype=None, scale_dtype=None, out=None):
        k = kind_of(in_dtype)
        y = ref.dequantize_lowbit(q, scale, zero_point, scope=scope, axis=axis, group_size=group_size, in_kind=k,
                                  out_dtype=kind_of(out_dtype), scale_dtype=scale_dtype)
        if self.bug == "subnormal-flush" and k in kinds.FP8:
            codes = np.asarray(q).view(np.uint8)
            y = np.where(((codes & 0x7F) >> (3 if k == "fp8_e4m3" else 2)) == 0, y.dtype.type(0), y)
        return y

    def dynamic_quantize(self, x, *, scope, mode="symmetric", axis=None, group_size=None, out_dtype, qmin=None,
                         qmax=None, eps=1e-8, scale_dtype="float32", scale_layout="row"):
        sdt = "e8m0" if scale_dtype == "e8m0" else None
        q, s, zp = ref.dynamic_quantize_lowbit_ref(x, scope=scope, mode=mode, axis=axis, group_size=group_size,
                                                   out_dtype=kind_of(out_dtype), qmin=qmin, qmax=qmax, eps=eps,
                                                   scale_dtype=sdt)
        if self.bug == "mx-ceil" and sdt:
            s = np.where(s < 254, s + 1, s).astype(np.uint8)
            q = ref.quantize_lowbit(x, s, None, scope=scope, group_size=group_size, out_dtype=kind_of(out_dtype),
                                    scale_dtype="e8m0")
        if self.bug == "layout" and scale_layout != "row":
            scale_layout = "row"                   # a device that ignores the layout
        return q, _laid_out(s, scale_layout), _laid_out(zp, scale_layout)


def _laid_out(a, scale_layout):
    """``a`` (host) in the strides ``scale_layout`` gives it, as the device returns it."""
    strides = None if a is None else param_strides(a.shape, scale_layout, a.itemsize)
    if strides is None:
        return a
    buf = np.zeros(1 + sum((n - 1) * st for n, st in zip(a.shape, strides)), a.dtype)
    view = np.lib.stride_tricks.as_strided(buf, a.shape, tuple(st * a.itemsize for st in strides))
    view[...] = a
    return view


@pytest.fixture
def device(monkeypatch):
    def install(bug=None):
        dev = ReferenceDevice(bug)
        monkeypatch.setattr(checks_lowbit, "put", lambda a, fw, kind=None: np.array(a, copy=True))
        monkeypatch.setattr(checks_lowbit, "get", lambda a: np.asarray(a))
        monkeypatch.setattr(checks_lowbit, "strided", lambda a, extra, fw: a)
        monkeypatch.setattr(checks_lowbit, "runs_this_sku", lambda sku: None)
        # NumPy stands in for the device arrays: the CuPy-like path (uint8 containers), also where torch
        # is installed (its fp8-typed cases need real torch tensors)
        monkeypatch.setattr(checks_lowbit, "_framework", lambda preferred, case: "cupy")
        for name in ("quantize", "dequantize", "dynamic_quantize"):
            monkeypatch.setattr(sf, name, getattr(dev, name))
        return dev
    return install


def test_lowbit_checkers_keep_the_s8_u8_checkers():
    skus = sf.default_registry().skus()
    plain = {**checks_static.CHECKERS, **checks_dynamic.CHECKERS}
    for op in checks_lowbit.CHECKERS:
        s8 = next(s for s in skus if s.op == op and "s8" in (s.element, s.aux_element))
        assert not checks_lowbit.handles(s8)
        assert families.checker_for(s8) is plain[op] is not checks_lowbit.CHECKERS[op]
    assert all(checks_lowbit.handles(s) for s in LOWBIT)
    assert all(families.checker_for(s) is checks_lowbit.CHECKERS[s.op] for s in LOWBIT)


def test_sample_covers_the_matrix():
    ops = {(s.op, s.aux_element if s.op != "dequantize" else s.element, s.arch) for s in SAMPLE}
    assert len(SAMPLE) == 3 * 4 * (2 + 2 + 1 + 1) and len(ops) == 3 * (4 + 2)   # int4: 2 modes, sm80; fp8: sm80/sm89
    assert {s.aux_element if s.op == "dequantize" else s.element for s in SAMPLE} == {"f32", "f64", "f16", "bf16"}


@pytest.mark.parametrize("sku", SAMPLE, ids=str)
def test_checker_passes_a_correct_device(device, sku, rng):
    device()
    res = verify.check(sku, rng)
    assert res.passed, f"{res.detail}: {res.failures[:3]}"
    assert res.cases >= 8


@pytest.mark.parametrize("bug,pick", [
    ("signed-nan", lambda s: s.op == "quantize" and s.aux_element == "fp8_e4m3" and s.scope == "token"),
    ("nibbles", lambda s: s.op == "quantize" and s.aux_element == "u4" and s.scope == "group"),
    ("f64-through-f32", lambda s: s.op == "quantize" and s.element == "f64" and s.aux_element == "fp8_e5m2"),
    ("subnormal-flush", lambda s: s.op == "dequantize" and s.element == "fp8_e4m3" and s.scope == "channel"),
    ("mx-ceil", lambda s: s.op == "dynamic_quantize" and s.aux_element == "fp8_e4m3" and s.scope == "group"),
    ("layout", lambda s: s.op == "dynamic_quantize" and s.aux_element == "fp8_e4m3" and s.scope == "group"),
])
def test_checker_catches_a_wrong_device(device, bug, pick, rng):
    device(bug)
    sku = next(s for s in LOWBIT if pick(s))
    res = verify.check(sku, rng)
    assert not res.passed and res.mismatches > 0, (bug, res.detail)


def test_runs_this_sku_pins_the_software_conversion_skus(fake_device):
    """On an sm_90 GPU the sm80 (software conversion) fp8 SKUs run themselves under prefer_arch,
    not the sm89 ones the runtime picks by default (this was a verify bug: 80 SKUs 'not run')."""
    for arch in ("sm80", "sm89"):
        sku = next(s for s in sf.default_registry().skus() if s.aux_element == "fp8_e4m3" and s.op == "quantize"
                   and s.arch == arch)
        assert checks_lowbit.runs_this_sku(sku) is None
    fake_device.props[0] = {"cc": 80}
    assert "need sm_89" in checks_lowbit.runs_this_sku(sku)
