"""Schedule variants and the tuning rule (docs/tuning.md), on the CPU."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from codegen import manifest
from codegen.families import KINDS
from codegen.harness import tune
from runtime import tuning
from runtime.errors import InvalidProblemError
from runtime.registry import default_registry
from runtime.sku import KernelSku

SKU = KernelSku.parse("quantization/quantize/group/symmetric/bf16/s8/sm80/simt/f32.acc-f32.det.stable")
F16 = KernelSku.parse("quantization/quantize/group/symmetric/f16/s8/sm80/simt/f32.acc-f32.det.stable")


class FakePlan:
    """What runtime.tuning reads of a plan (hashable by identity, as a plan is)."""

    def __init__(self, sku, launch, registry):
        self.sku, self.launch, self.registry = sku, launch, registry


def fake_plan(sku, choices, arch="sm90"):
    launch = {"kind": "elementwise", **KINDS["elementwise"].launch_schedules({})}
    entry = SimpleNamespace(launch=launch)
    other = SimpleNamespace(launch=KINDS["dynamic_fused"].launch_schedules({}))     # a kernel of another kind
    reg = SimpleNamespace(tuning={arch: {sku.category: {"choices": choices}}}, entries={sku: entry, "other": other})
    return FakePlan(sku, launch, reg)


@pytest.fixture(autouse=True)
def _forget():
    tuning.forget()
    yield
    tuning.forget()


def test_buckets_cover_the_benchmark_shapes():
    assert [tuning.bucket(r * c) for r, c in ((16, 4096), (128, 7168), (4096, 7168), (8192, 8192),
                                              (131072, 4096))] == ["le128k", "le2m", "le32m", "gt32m", "gt32m"]
    assert tuning.bucket(0) == "le128k" and tuning.bucket((1 << 17) + 1) == "le2m"
    assert list(tune.BUCKET_SHAPES) == [name for _, name in tuning.BUCKETS]
    for name, shape in tune.BUCKET_SHAPES.items():
        assert tuning.bucket(shape[0] * shape[1]) == name


def test_rule_exact_key_then_sized_key_then_default(override_settings):
    plan = fake_plan(SKU, {"quantize/group/bf16/s8": {"gt32m": "b128"},
                           "elementwise:quantize/group/2B/1B": {"gt32m": "b64", "le2m": "b256-full"}})
    assert tuning.choose(plan, 8192 * 8192, 90) == ("b128", {"threads": 128, "grid": "persistent", "columns": "2d"})
    assert tuning.choose(plan, 128 * 7168, 90)[0] == "b256-full"          # the sized key
    assert tuning.choose(plan, 16 * 4096, 90)[0] == "b256"                # no entry: the default
    assert tuning.choose(plan, 8192 * 8192, 80)[0] == "b256"              # no table for sm80: the default
    f16 = fake_plan(F16, plan.registry.tuning["sm90"]["quantization"]["choices"])
    assert tuning.choose(f16, 8192 * 8192, 90)[0] == "b64"                # f16 takes bf16's sized entry


def test_a_name_the_sku_lacks_falls_back_and_a_forced_one_wins(override_settings):
    plan = fake_plan(SKU, {"quantize/group/bf16/s8": {"gt32m": "t8"}})  # a dynamic schedule: not this kind's
    assert tuning.choose(plan, 8192 * 8192, 90)[0] == "b256"
    override_settings(schedule="b64")
    assert tuning.choose(plan, 8192 * 8192, 90)[0] == "b64"
    override_settings(schedule="t8")            # another kind's name: this kind keeps its rule
    assert tuning.choose(plan, 8192 * 8192, 90)[0] == "b256"
    override_settings(schedule="b999")
    with pytest.raises(InvalidProblemError, match="SKUFORGE_SCHEDULE='b999'"):
        tuning.choose(plan, 8192 * 8192, 90)


def test_kinds_without_schedules_choose_nothing():
    plan = FakePlan(SKU, {"kind": "moe_gemm"}, None)
    assert tuning.choose(plan, 1, 90) == (None, {})


def test_every_sku_of_a_scheduled_kind_carries_its_schedules_default_first():
    reg = default_registry()
    seen = set()
    for sku in reg.skus():
        launch = reg.lookup(sku).launch
        want = KINDS[launch["kind"]].schedules
        if launch["kind"] == "dynamic_reduce" and not (launch.get("coop") or launch.get("chan")):
            want = ()                          # no one-launch kernel: one way to launch
        # a schedule that launches an entry point of its own: on the SKUs that have it
        want = [s for s in want if s.as_dict().get("entry", "main") in launch["entries"]]
        if not want:
            assert "schedules" not in launch
            continue
        seen.add(launch["kind"])
        assert sorted(launch["schedules"]) == sorted(s.name for s in want)      # (the manifest sorts keys)
        assert launch["default_schedule"] == want[0].name
    assert seen == {name for name, kind in KINDS.items() if kind.schedules}


def test_schedule_names_are_unique_per_kind_and_threads_fit_the_launch_bounds():
    for kind, sched in ((name, k.schedules) for name, k in KINDS.items() if k.schedules):
        assert len({s.name for s in sched}) == len(sched), kind
        for s in sched:
            assert s.as_dict().get("threads", 256) in (64, 128, 256), s


def test_tables_fold_into_the_manifest(tmp_path):
    (tmp_path / "quantization").mkdir()
    (tmp_path / "quantization" / "sm90.json").write_text(json.dumps({
        "arch": "sm90", "gpu": "GPU", "commit": "abc", "entries": {
            "quantize/group/bf16/s8": {"gt32m": {"schedule": "b128", "us": {"b256": 2.0, "b128": 1.0}}}}}))
    assert manifest.tuning_tables(folder=lambda name: tmp_path / name) == {
        "sm90": {"quantization": {"gpu": "GPU", "commit": "abc",
                                  "choices": {"quantize/group/bf16/s8": {"gt32m": "b128"}}}}}
    assert json.loads(manifest.expected_files()[manifest.MANIFEST])["tuning"] == manifest.tuning_tables()
    # each family keeps its tables in its own folder
    assert manifest.tuning_folder("quantization") == manifest.FAMILY_DIR / "quantization" / "tuning"
    assert (manifest.tuning_folder("quantization") / "sm90.json").is_file()


def test_tune_keeps_the_default_within_the_margin():
    assert tune.choose({"b256": 100.0, "b128": 99.5}, "b256") == "b256"
    assert tune.choose({"b256": 100.0, "b128": 98.0}, "b256") == "b128"
    assert tune.choose({"b256": 100.0, "b128": 101.0}, "b256") == "b256"


def test_tune_one_times_each_schedule_under_its_own_name():
    """tune_one: every schedule of the SKU is a contender whose calls run with that schedule forced,
    timed in one measure_turns; the result is {schedule: median µs}."""
    from runtime.config import settings
    sku = SKU
    reg = default_registry()
    names = sorted(reg.lookup(sku).launch["schedules"])
    seen = []

    def make(s, shape):
        return {"call": lambda: seen.append(settings().schedule), "bytes": 3 << 20}

    class FakeTimer:
        def measure_turns(self, contenders):
            out = []
            for calls in contenders:
                before = len(seen)
                calls[0]()
                out.append({"ms": 0.001 * (1 + len(seen[before])), "samples": 1})
            return out
    times = tune.tune_one(FakeTimer(), reg, sku, SimpleNamespace(make=make), (16, 4096), 60 << 20)
    assert sorted(times) == names and sorted(seen) == names
    assert all(times[n] == pytest.approx(1 + len(n)) for n in names)     # µs, from each contender's own run
    assert settings().schedule == ""                                      # the override ends with the call
    assert tune.tune_one(FakeTimer(), reg, sku, SimpleNamespace(make=lambda s, sh: None), (16, 4096), 1) == {}


def test_tune_selects_one_arch_per_sku_and_the_most_called_ops_first():
    reg = default_registry()
    picked = tune.selected(reg, tune.DEFAULT_FILTERS, 90)
    assert picked and all(reg.lookup(s).launch.get("schedules") for s in picked)
    keys = [(s.op, s.scope, s.mode, s.element, s.aux_element, s.backend) for s in picked]
    assert len(set(keys)) == len(keys)
    fp8 = [s for s in picked if s.aux_element == "fp8_e4m3"]
    assert fp8 and all(s.arch == "sm89" for s in fp8)                      # what an sm_90 device runs
    assert [s.arch for s in tune.selected(reg, tune.DEFAULT_FILTERS, 80) if s.aux_element == "fp8_e4m3"] \
        == ["sm80"] * len(fp8)
    order = [tune.OP_ORDER.index(s.op) for s in picked]
    assert order == sorted(order)

