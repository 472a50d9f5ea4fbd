import pytest

import runtime as sf
from runtime import Descriptor, Plan, Preference, UnsupportedError


def reg():
    return sf.default_registry()


def test_query_by_glob_and_fields():
    r = reg()
    token = r.query("*quantize/token/*", element="bf16")
    assert token and all(s.scope == "token" and s.element == "bf16" for s in token)
    assert r.query("nothing*") == []


def test_select_picks_matching_cell():
    sku = reg().select(category="quantization", op="quantize", scope="group", mode="asymmetric",
                       element="f16", aux_element="u8", arch=90)
    assert (sku.op, sku.scope, sku.mode, sku.element, sku.aux_element) == ("quantize", "group", "asymmetric", "f16", "u8")
    assert sku.arch_number <= 90


def test_select_errors_name_reasons():
    with pytest.raises(UnsupportedError, match="no zero point"):
        reg().select(category="quantization", op="quantize", scope="token", mode="asymmetric",
                     element="bf16", aux_element="fp8_e4m3")
    with pytest.raises(UnsupportedError, match="mma"):
        reg().select(category="quantization", op="quantize", scope="token", mode="symmetric",
                     element="bf16", aux_element="s8", backend="mma")
    with pytest.raises(UnsupportedError, match="sm70"):
        reg().select(category="quantization", op="quantize", scope="token", mode="symmetric",
                     element="bf16", aux_element="s8", arch=70)


def test_lookup_excluded_and_unknown():
    with pytest.raises(UnsupportedError, match="not generated"):
        reg().lookup("quantization/quantize/token/asymmetric/bf16/fp8_e4m3/sm80/simt/f32.acc-f32.det.stable")
    with pytest.raises(UnsupportedError, match="not in the matrix"):
        reg().lookup("quantization/quantize/token/symmetric/bf16/s8/sm90/simt/f32.acc-f32.det.stable")


def test_plan_api_surface():
    plan = Plan.select(Descriptor("quantize", "token", "symmetric", "bf16", "s8"), Preference(arch=90))
    assert str(plan.sku).startswith("quantization/quantize/token/symmetric/bf16/s8/")
    assert "bit-exact" in plan.precision_guarantee and "deterministic" in plan.precision_guarantee
    assert plan.workspace_size() == 0


def test_source_of_one_kernel():
    sku = reg().query("*quantize/channel/asymmetric/f64/u8*")[0]
    src = reg().source(sku)
    assert src.count("// SKU: ") == 1 and sku.symbol in src
