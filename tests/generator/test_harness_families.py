"""The harness's family table (codegen/harness/families.py): every family's modules, the look-ups
verify, bench and tune make in it, and a family module that fails to import (CPU)."""
import fnmatch
import sys

import pytest

import runtime as sf
from codegen.harness import families, tune
from codegen.harness.checks import static as checks_static
from codegen.harness.families import FAMILIES, Family
from runtime.sku import KernelSku

S8_TOKEN = "quantization/quantize/token/symmetric/bf16/s8/sm80/simt/f32.acc-f32.det.stable"


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Write modules ``{name: source}`` into a folder on sys.path (names unique per test)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(**sources):
        for name, text in sources.items():
            (tmp_path / f"{name}.py").write_text(text)
            monkeypatch.delitem(sys.modules, name, raising=False)
    return write


def test_every_family_names_modules_that_provide_the_interface():
    for f in FAMILIES:
        checks = families.modules("checks", families=(f,))
        workloads = families.modules("workloads", families=(f,))
        assert [m.__name__ for m in checks] == [f.checks] and [m.__name__ for m in workloads] == [f.workloads]
        assert checks[0].CHECKERS and all(callable(fn) for fn in checks[0].CHECKERS.values())
        assert callable(workloads[0].make) and (hasattr(workloads[0], "OPS") or hasattr(workloads[0], "handles"))
        assert f.workloads.rsplit(".", 1)[-1] == f.name      # the section name: its ceiling's key in a record
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


def test_every_generated_sku_has_a_checker_and_a_workload():
    """A family missing from the table would leave its SKUs without a checker ("no checker" in verify)
    and without a bench workload."""
    workloads = families.workload_modules()
    for s in sf.default_registry().skus():
        assert families.checker_for(s) is not None, s
        assert families.module_for(s, workloads) is not None, s


def test_a_family_module_that_fails_to_import_is_reported_and_skipped(plugins):
    plugins(sf_h1_broken="raise RuntimeError('boom')\n")
    missing = Family("missing", "codegen.harness.checks._none", "codegen.harness.workloads._none")
    broken = Family("broken", "sf_h1_broken", "sf_h1_broken")
    table = (missing, broken) + FAMILIES
    said = []
    mods = families.workload_modules(said.append, families=table)
    assert [m.__name__ for m in mods] == [f.workloads for f in FAMILIES]
    assert said == ["bench: skipping codegen.harness.workloads._none: ModuleNotFoundError: "
                    "No module named 'codegen.harness.workloads._none'",
                    "bench: skipping sf_h1_broken: RuntimeError: boom"]
    sku = KernelSku.parse(S8_TOKEN)
    assert families.checker_for(sku, families=table) is checks_static.CHECKERS["quantize"]
    assert families.checker_for(sku, families=(missing, broken)) is None     # verify: "no checker for op"


def test_checkers_of_a_family_with_handles_come_first(plugins):
    plugins(sf_h1_plain="def q(*a): return 'plain'\nCHECKERS = {'quantize': q, 'dequantize': q}\n",
            sf_h1_special="def q(*a): return 'special'\nCHECKERS = {'quantize': q}\n"
                          "def handles(sku): return sku.element == 'bf16'\n")
    table = (Family("plain", "sf_h1_plain", "-"), Family("special", "sf_h1_special", "-"))
    bf16 = KernelSku.parse(S8_TOKEN)
    f32 = KernelSku.parse(S8_TOKEN.replace("/bf16/", "/f32/"))
    deq = KernelSku.parse("quantization/dequantize/token/symmetric/s8/bf16/sm80/simt/f32.acc-f32.det.stable")
    assert families.checker_for(bf16, families=table)() == "special"     # listed after the plain one, still first
    assert families.checker_for(f32, families=table)() == "plain"
    assert families.checker_for(deq, families=table)() == "plain"        # it handles bf16 but has no dequantize
    fake = KernelSku.parse(S8_TOKEN.replace("/quantize/", "/fake_quantize/").replace("/s8/", "/bf16/"))
    assert families.checker_for(fake, families=table) is None


def test_tune_measures_the_skus_the_families_name():
    assert tune.DEFAULT_FILTERS == families.tune_filters()
    assert len(set(tune.DEFAULT_FILTERS)) == len(tune.DEFAULT_FILTERS) == 13
    skus = [str(s) for s in sf.default_registry().skus()]
    for glob in tune.DEFAULT_FILTERS:
        assert any(fnmatch.fnmatchcase(s, glob) for s in skus), glob
