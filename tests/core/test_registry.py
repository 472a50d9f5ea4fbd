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


# -- typed errors of the plan and registry API ---------------------------------------------------------
from runtime import InvalidProblemError  # noqa: E402
from tests.fakes import err  # noqa: E402


def test_query_names_unknown_fields():
    err(lambda: reg().query("*", bogus=1), InvalidProblemError, "bogus", "element")
    assert reg().query("*", element=["f16"]) == []                 # a value no field has: nothing matches


@pytest.mark.parametrize("device", ["0", 2 ** 70, [0], -1, 1.0, True, None])
def test_kernel_device_must_be_an_ordinal(device, fake_device):
    sku = reg().skus()[0]
    if device is None:                                              # None: the current device
        fn = reg().kernel(sku, device=device)
        assert fn == reg().lookup(sku).entry_point() and fn.device == 0
        return
    err(lambda: reg().kernel(sku, device=device), InvalidProblemError, "device=", "ordinal")
    assert not fake_device.functions


def test_moe_plans_give_their_entry_points():
    moe_skus = reg().query("moe/*")
    assert len(moe_skus) == 27
    for sku in moe_skus:
        plan = Plan(sku)
        assert plan.entry_points == ("gemm", "route_count", "route_offsets_i32", "route_offsets_i64", "route_scan",
                                     "route_scatter")
        assert plan.abi() is plan.abi("gemm") and {"x", "w", "out", "counter"} <= set(plan.abi().names)
        assert "hist" in plan.abi("route_count").names
        err(lambda plan=plan: plan.abi("main"), InvalidProblemError, "no entry-point group 'main'", "gemm")
    plan = Plan(reg().query("quantization/quantize/token/symmetric/bf16/s8/*")[0])
    assert plan.entry_points == ("main",) and plan.abi() is plan.abi("main")
    err(lambda: plan.abi(3), InvalidProblemError, "entry-point group 3", "main")


@pytest.mark.parametrize("pattern", ["quantization/quantize/token/symmetric/bf16/s8/*", "moe/grouped_matmul/*",
                                     "quantization/dynamic_quantize/tensor/*", "*learnable*"])
@pytest.mark.parametrize("bad", [3, None, "x", object()])
def test_plan_methods_take_their_arguments_class(pattern, bad):
    plan = Plan(reg().query(pattern)[0])
    want = plan.launcher.args_type.__name__
    err(lambda: plan.can_implement(bad), InvalidProblemError, "Plan.can_implement", want)
    err(lambda: plan.run(bad), InvalidProblemError, "Plan.run", want)
    if bad is not None:
        err(lambda: plan.workspace_size(bad), InvalidProblemError, "Plan.workspace_size", want)
    err(lambda: plan.run(bad, stream="s"), InvalidProblemError, "stream=")
    err(lambda: plan.run(bad, stream=2 ** 70), InvalidProblemError, "stream=")


def test_workspace_size_without_arguments():
    assert Plan(reg().query("quantization/quantize/token/*")[0]).workspace_size() == 0     # never any
    for pattern in ("moe/*", "quantization/dynamic_quantize/tensor/*", "*learnable*/tensor/*"):
        err(lambda p=pattern: Plan(reg().query(p)[0]).workspace_size(), InvalidProblemError, "args")


def test_plan_construction_arguments():
    sku = reg().skus()[0]
    assert Plan(str(sku)).sku == sku                                # a SKU string is looked up
    err(lambda: Plan(sku, registry=3), InvalidProblemError, "registry=3")
    err(lambda: Plan.select(3), InvalidProblemError, "Descriptor")
    err(lambda: Plan.select(Descriptor("quantize"), "sm90"), InvalidProblemError, "Preference")
    err(lambda: Plan.select(Descriptor("quantize", scope=["token"])), InvalidProblemError, "Descriptor.scope")
    err(lambda: Plan.select(Descriptor(None)), InvalidProblemError, "Descriptor.op")
    err(lambda: Plan.select(Descriptor("quantize"), Preference(arch="90")), InvalidProblemError, "Preference.arch")
    err(lambda: Plan.select(Descriptor("quantize"), Preference(backend=1)), InvalidProblemError, "Preference.backend")
    from runtime.plans import cached_plan                           # the remembered plans: the same errors
    err(lambda: cached_plan(Descriptor("quantize", scope=["token"])), InvalidProblemError, "Descriptor.scope")
    err(lambda: cached_plan(Descriptor("quantize", scope=3)), InvalidProblemError, "Descriptor.scope")


def test_registry_lookups_of_junk(tmp_path):
    err(lambda: reg().abi("nope"), InvalidProblemError, "abi_id='nope'")
    err(lambda: reg().abi(["x"]), InvalidProblemError, "abi_id")
    err(lambda: reg().unit_source("../etc/passwd"), InvalidProblemError, "unit=")
    err(lambda: sf.Registry.load(3), InvalidProblemError, "root=3")
    (tmp_path / "manifest.json").write_text("{not json")
    err(lambda: sf.Registry.load(tmp_path), UnsupportedError, "cannot be read", "python -m codegen")
    err(lambda: sf.Registry.load(str(tmp_path / "none")), UnsupportedError, "no manifest")


def test_check_takes_a_device_ordinal():
    for bad in ("0", 2 ** 70, [0], 1.5):
        err(lambda bad=bad: sf.check(bad), InvalidProblemError, "device=")
