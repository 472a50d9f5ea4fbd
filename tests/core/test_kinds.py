"""runtime/kinds.py: the one table of element kinds is consistent with itself, NumPy / ml_dtypes,
torch (where installed), the SKU vocabulary and the generated manifest."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from runtime import kinds
from runtime.errors import InvalidProblemError
from runtime.sku import KernelSku

ROOT = Path(__file__).resolve().parents[2]
SKU_KINDS = "f16 bf16 f32 f64 s8 u8 s4 u4 fp8_e4m3 fp8_e5m2 e8m0 i32 u32".split()    # the SKU element kinds (docs/api.md)


def _np_dtype(name):
    if hasattr(np, name) and name != "float":
        return np.dtype(name)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if not hasattr(ml_dtypes, name):
        pytest.skip(f"ml_dtypes {ml_dtypes.__version__} has no {name}")
    return np.dtype(getattr(ml_dtypes, name))


def test_sku_elements_are_spec_kinds_in_order():
    assert kinds.ELEMENTS == tuple(SKU_KINDS)
    assert all(kinds.kind(k).sku for k in SKU_KINDS)
    assert [k.name for k in kinds.ALL if not k.sku] == ["i64"]


@pytest.mark.parametrize("k", kinds.ALL, ids=lambda k: k.name)
def test_size_matches_numpy_itemsize(k):
    name = k.storage_numpy
    assert name is not None, f"{k.name}: neither a NumPy dtype nor a container"
    assert _np_dtype(name).itemsize == k.size
    if k.numpy is not None:
        dt = _np_dtype(k.numpy)
        assert dt.itemsize == k.size
        assert (dt.kind == "f" or k.numpy == "bfloat16" or k.numpy.startswith("float8")) == k.is_float


@pytest.mark.parametrize("k", kinds.ALL, ids=lambda k: k.name)
def test_container_and_pack(k):
    if k.container is not None:
        c = kinds.kind(k.container)
        assert c.container is None and c.size == k.size and c.ctype == k.ctype
    assert k.pack in (1, 2)
    assert (k.pack == 2) == (k.name in kinds.INT4)
    assert (8 * k.size) % k.pack == 0


@pytest.mark.parametrize("k", kinds.ALL, ids=lambda k: k.name)
def test_qrange_matches_bits_and_signedness(k):
    if k.qrange is None:
        assert not k.has_zero_point
        return
    assert not k.is_float and k.has_zero_point
    bits = 8 * k.size // k.pack
    lo, hi = k.qrange
    if k.name.startswith("s"):
        assert (lo, hi) == (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    else:
        assert k.name.startswith("u") and (lo, hi) == (0, (1 << bits) - 1)
    assert kinds.QRANGE[k.name] == k.qrange


def test_integer_codes_numpy_ranges():
    for name in kinds.INT8:
        info = np.iinfo(kinds.kind(name).numpy)
        assert kinds.QRANGE[name] == (info.min, info.max)


@pytest.mark.parametrize("name", kinds.FP8)
def test_fp8_facts_match_ml_dtypes(name):
    k = kinds.kind(name)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    info = ml_dtypes.finfo(getattr(ml_dtypes, k.numpy))
    assert float(info.max) == k.max
    assert info.nmant == k.mbits
    assert info.minexp == k.emin
    assert info.maxexp - 1 == k.emax
    assert k.is_float and not k.has_zero_point and k.qrange is None


def test_fp8_facts_only_on_fp8():
    for k in kinds.ALL:
        facts = (k.max, k.mbits, k.emin, k.emax)
        assert all(f is not None for f in facts) == (k.name in kinds.FP8)
        assert all(f is None for f in facts) == (k.name not in kinds.FP8)


def test_spellings_map_back():
    for k in kinds.ALL:
        for s in (k.name,) + k.spellings:
            assert s == s.lower()
            assert kinds.SPELLINGS[s] == k.name
            assert kinds.of(s) == k.name
            assert kinds.of(s.upper()) == k.name
        if k.numpy is not None:
            assert k.numpy in k.spellings or k.numpy == k.name
            if k.numpy == "bfloat16" or k.numpy.startswith("float8"):
                ml_dtypes = pytest.importorskip("ml_dtypes")
                if hasattr(ml_dtypes, k.numpy):
                    assert kinds.of(np.dtype(getattr(ml_dtypes, k.numpy))) == k.name
            else:
                assert kinds.of(np.dtype(k.numpy)) == k.name
        if k.torch is not None:
            assert k.torch in k.spellings


def test_no_two_kinds_share_a_spelling():
    seen = {}
    for k in kinds.ALL:
        for s in (k.name,) + k.spellings:
            assert s not in seen, f"{s!r} spells both {seen[s]} and {k.name}"
            seen[s] = k.name
    assert len(seen) == len(kinds.SPELLINGS)


def test_user_spellings_accepted_today():
    # the aliases skuforge has always accepted
    want = {"float": "f32", "half": "f16", "double": "f64", "int": "i32", "s32": "i32", "fp32": "f32",
            "fp16": "f16", "fp64": "f64", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2", "float8_e4m3": "fp8_e4m3",
            "int4": "s4", "uint4": "u4", "int8": "s8", "uint8": "u8", "bfloat16": "bf16",
            "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "float8_e8m0fnu": "e8m0", "e8m0": "e8m0"}
    assert {s: kinds.of(s) for s in want} == want


def test_unknown_spelling_is_a_typed_error():
    with pytest.raises(InvalidProblemError, match=r"out_dtype='complex64' is not a dtype skuforge knows; known: "
                                                  r"bfloat16, float16, float32, float64, float8_e4m3fn"):
        kinds.of("complex64", "out_dtype")
    with pytest.raises(InvalidProblemError):
        kinds.of(np.dtype("complex64"))
    with pytest.raises(KeyError):
        kinds.kind("int8")          # kind() takes SKU names only


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_names_exist():
    import torch
    for k in kinds.ALL:
        if k.torch is None:
            continue
        if not hasattr(torch, k.torch):
            assert k.name in kinds.FP8 + (kinds.E8M0,), f"torch has no {k.torch}"   # older torch: no fp8
            continue
        dt = getattr(torch, k.torch)
        assert dt.itemsize == k.size
        assert kinds.of(dt) == k.name


def test_groups():
    assert kinds.FLOAT == ("f32", "f64", "f16", "bf16")
    assert set(kinds.MATH) == set(kinds.FLOAT) and kinds.HALF == ("f16", "bf16")
    assert kinds.INT8 == ("s8", "u8") and kinds.INT4 == ("s4", "u4") and kinds.FP8 == ("fp8_e4m3", "fp8_e5m2")
    assert kinds.LOW_BIT == kinds.INT4 + kinds.FP8 and kinds.CODES == kinds.INT8 + kinds.INT4 + kinds.FP8
    for group in (kinds.ELEMENTS, kinds.MATH, kinds.FLOAT, kinds.HALF, kinds.CODES):
        assert len(set(group)) == len(group) and set(group) <= set(kinds.BY_NAME)
    assert set(kinds.QRANGE) == set(kinds.INT8 + kinds.INT4)
    assert kinds.E8M0 in kinds.BY_NAME
    assert all(kinds.math_kind(k) == ("f64" if k == "f64" else "f32") for k in kinds.FLOAT)


def test_tables_are_read_only():
    with pytest.raises(TypeError):
        kinds.SIZE["f32"] = 8
    with pytest.raises(Exception):
        kinds.kind("f32").size = 8


def test_every_manifest_element_is_a_kind():
    man = json.loads((ROOT / "generated" / "manifest.json").read_text())
    seen = set()
    for key in list(man["kernels"]) + list(man["excluded"]):
        sku = KernelSku.parse(key)
        for el in (sku.element, sku.aux_element):
            if el is not None:
                assert el in kinds.ELEMENTS, key
                seen.add(el)
        assert sku.precision.math in kinds.MATH and sku.precision.accumulator in kinds.MATH
    assert set(kinds.FLOAT + kinds.CODES) <= seen


def test_ctype_matches_prelude():
    prelude = (ROOT / "templates" / "common" / "prelude.cuh").read_text()
    builtin = {"float", "double"}
    for k in kinds.ALL:
        assert k.ctype in builtin or f" {k.ctype};" in prelude or f" {k.ctype} " in prelude, k.ctype


def test_import_is_light():
    """kinds.py imports the standard library and runtime.errors only (codegen imports it too)."""
    import ast
    tree = ast.parse((ROOT / "runtime" / "kinds.py").read_text())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mods.add("." * node.level + (node.module or ""))
    assert mods <= {"__future__", "dataclasses", "types", "typing", ".errors"}, mods
