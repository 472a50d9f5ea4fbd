"""CPU: the steps of ``python -m codegen bench`` (codegen/harness/bench/cli.py) that need no device:
the selection, the loop over the runs (a fake timer), the record written at the end."""
import io
import json
import types

import pytest
from rich.console import Console

from codegen.harness.bench import cli
from codegen.harness.bench import run as bench_run
from codegen.harness.bench.record import finish
from codegen.manifest import GENERATED
from runtime.registry import Registry
from runtime.sku import KernelSku

P = "f32.acc-f32.det.stable"
S_TOK = f"quantization/quantize/token/symmetric/bf16/s8/sm80/simt/{P}"
S_GRP = f"quantization/quantize/group/symmetric/bf16/s8/sm80/simt/{P}"


@pytest.fixture(scope="module")
def reg():
    return Registry.load(GENERATED)


def _console():
    return Console(file=io.StringIO(), width=300, color_system=None)


def _args(**kw):
    base = dict(filter="*", all=False, shapes=None, quick=False, compile_all=False, records="")
    return types.SimpleNamespace(**{**base, **kw})


def test_selection_says_why_nothing_runs(reg):
    console = _console()
    modules, todo = cli._selection(_args(filter="nothing/*"), reg, console)
    assert todo == [] and modules
    text = console.file.getvalue()
    assert "bench: nothing to run for --filter 'nothing/*'" in text and "codegen.harness.workloads.static" in text


def test_selection_plans_the_filtered_skus_with_their_modules(reg):
    modules, todo = cli._selection(_args(filter=S_TOK, shapes="16x4096"), reg, _console())
    assert [(str(s), m.__name__, sh) for s, m, sh in todo] == [(S_TOK, "codegen.harness.workloads.static", (16, 4096))]


@pytest.fixture(autouse=True)
def _same_bytes_copy(monkeypatch):
    """The fake timer runs no copy: the copy of a result's bytes is a fixed figure."""
    monkeypatch.setattr(bench_run, "same_size_copy", lambda timer, nbytes_, l2: {"gbps": 2000.0})


class _FakeTimer:
    def measure(self, calls):
        return {"ms": 0.001, "samples": len(calls)}


def test_run_all_measures_reports_failures_and_frees_between_runs(reg, monkeypatch):
    freed = []
    monkeypatch.setattr(cli, "free_memory", lambda: freed.append(1))

    def make(sku, shape):
        if sku.scope == "group":
            raise RuntimeError("no such kernel here")
        return {"call": lambda: None, "bytes": 3 << 20, "label": "lbl"}
    mod = types.SimpleNamespace(__name__="codegen.harness.workloads.fake", make=make)
    todo = [(KernelSku.parse(S_TOK), mod, (16, 4096)), (KernelSku.parse(S_GRP), mod, (16, 4096))]
    console = _console()
    results, interrupted = cli._run_all(_args(), _FakeTimer(), None, reg, todo, (60 << 20, 4000.0, {}), console)
    assert not interrupted and [r["sku"] for r in results] == [S_TOK] and len(freed) == 2
    assert results[0]["sha256"] == reg.manifest["kernels"][S_TOK]["sha256"]
    text = console.file.getvalue()
    assert f"bench {S_GRP} 16x4096: RuntimeError: no such kernel here" in text
    assert cli._result_line(results[0]) in text


def test_run_all_stops_cleanly_on_ctrl_c(reg, monkeypatch):
    monkeypatch.setattr(cli, "free_memory", lambda: None)

    def make(sku, shape):
        if sku.scope == "group":
            raise KeyboardInterrupt
        return {"call": lambda: None, "bytes": 3 << 20, "label": "lbl"}
    mod = types.SimpleNamespace(__name__="m", make=make)
    todo = [(KernelSku.parse(S_TOK), mod, (16, 4096)), (KernelSku.parse(S_GRP), mod, (16, 4096)),
            (KernelSku.parse(S_TOK), mod, (8192, 8192))]
    results, interrupted = cli._run_all(_args(), _FakeTimer(), None, reg, todo, (60 << 20, 4000.0, {}), _console())
    assert interrupted and [r["shape"] for r in results] == [[16, 4096]]


def test_result_line():
    r = finish({"op": "quantize", "label": "bf16->s8 token", "shape": [8192, 8192], "bytes": 10**9,
                "skuforge": {"ms": 0.25}, "torch_compile": {"ms": 0.5}, "mismatches_vs_eager": 3}, 5000.0)
    line = cli._result_line(r)
    assert line.startswith("quantize     bf16->s8 token")
    assert "4000 GB/s  80.0% copy" in line and "×2.00 compile" in line and "3 elements differ from eager" in line
    t = cli._result_line(finish({"op": "grouped_matmul", "label": "g", "shape": [1], "flops": 2e12,
                                 "skuforge": {"ms": 1.0}}, 5000.0))
    assert "2000.0 TFLOP/s" in t


def test_record_folds_the_run_in_and_prints_the_targets(tmp_path):
    env = {"gpu": {"name": "NVIDIA Test GPU", "cc": "9.0"}, "driver": "13.0"}
    run = {"date": "d", "commit": "c", "dirty": False, "seconds": 1.0, "interrupted": False}
    r = finish({"sku": S_TOK, "op": "quantize", "label": "bf16->s8 token", "shape": [8192, 8192], "scope": "token",
                "element": "bf16", "aux_element": "s8", "bytes": 10**9, "skuforge": {"ms": 0.25}}, 5000.0)
    console = _console()
    ceilings = {"moe": {"name": "dense", "tflops": 700.0}}
    cli._record(_args(records=str(tmp_path)), env, run, ([r], [], {"gbps": 5000.0}, [], ceilings), console)
    rec = json.loads((tmp_path / "bench" / "nvidia-test-gpu.json").read_text())
    assert rec["schema"] == 1 and rec["results"] == [r] and rec["ceilings"] == ceilings and rec["gpu"] == env["gpu"]
    md = (tmp_path / "bench" / "nvidia-test-gpu.md").read_text()
    assert md.startswith("# skuforge bench: NVIDIA Test GPU")
    text = console.file.getvalue()
    assert "recorded 1 results in" in text and "MISS quantize (token): min % of copy" in text     # 80 % < 95 %
