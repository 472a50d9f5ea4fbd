"""CPU tests of `python -m codegen audit | verify | bench` logic on small synthetic records."""
import itertools
import json
import math
import subprocess
import sys
import types

import numpy as np
import pytest

from codegen.harness import audit, families, records, verify
from codegen.harness.bench import baselines as bench_baselines
from codegen.harness.bench import cli as bench_cli
from codegen.harness.bench import plan as bench_plan
from codegen.harness.bench import record as bench_record
from codegen.harness.bench import report as bench_report
from codegen.harness.bench import run as bench_run
from codegen.harness.bench import timing as bench_timing
from codegen.harness.records import read_json, write_json
from codegen.harness.workloads import base as workloads_base
from codegen.harness.workloads import static as bench_static
from runtime.sku import KernelSku

P = "f32.acc-f32.det.stable"
S_TOK = f"quantization/quantize/token/symmetric/bf16/s8/sm80/simt/{P}"
S_GRP = f"quantization/quantize/group/symmetric/bf16/s8/sm80/simt/{P}"
S_DEQ = f"quantization/dequantize/token/symmetric/s8/f32/sm80/simt/{P}"
S_90 = f"quantization/dequantize/tensor/symmetric/s8/f32/sm90/simt/{P}"
X_S4 = f"quantization/quantize/token/symmetric/bf16/s4/sm80/simt/{P}"
X_FP8 = f"quantization/quantize/group/symmetric/bf16/fp8_e4m3/sm80/simt/{P}"
REASON_S4 = "not implemented yet: s4 <packed> & \"nibbles\""
REASON_FP8 = "fp8 needs sm89"


def manifest():
    """Two units: quantize (2 SKUs) and dequantize (an sm80 and an sm90 SKU); two excluded cells."""
    k = {S_TOK: ("q.cu", "t" * 64), S_GRP: ("q.cu", "g" * 64), S_DEQ: ("d.cu", "d" * 64), S_90: ("d.cu", "9" * 64)}
    return {
        "kernels": {s: {"unit": u, "sha256": h, "family": "fam", "symbol": "x", "launch": {}} for s, (u, h) in k.items()},
        "excluded": {X_S4: {"family": "fam", "reason": REASON_S4}, X_FP8: {"family": "fam", "reason": REASON_FP8}},
        "units": {"q.cu": {"sha256": "Q" * 64, "skus": [S_GRP, S_TOK], "nvrtc_options": []},
                  "d.cu": {"sha256": "D" * 64, "skus": [S_DEQ, S_90], "nvrtc_options": []}},
    }


def verified_record(gpu, skus):
    return {"gpu": {"name": gpu}, "skus": {s: {"sha256": sha, "passed": ok, "detail": d} for s, sha, ok, d in skus}}


def by_sku(a):
    return {c.sku: c for c in a.cells}


# -- the audit model ------------------------------------------------------------------------------
def test_no_records_everything_generated_nothing_verified():
    a = audit.collect(manifest())
    s = a.summary()
    assert (s["generated"], s["excluded"], s["compiled"], s["verified"], s["stale"]) == (4, 2, 0, 0, 0)
    c = by_sku(a)
    assert c[S_TOK].compiled == {"sm_80": "none", "sm_90": "none"}
    assert c[S_90].compiled == {"sm_80": "n/a", "sm_90": "none"}        # built for sm90 only
    assert audit.cell_code(c[S_TOK], a) == "G"


def test_excluded_cells_keep_their_numbered_reasons():
    a = audit.collect(manifest())
    assert a.reasons == [REASON_FP8, REASON_S4]          # numbered in SKU order (group < token)
    c = by_sku(a)
    assert not c[X_S4].generated and c[X_S4].reason == REASON_S4
    assert audit.cell_code(c[X_S4], a) == f"—{a.reasons.index(REASON_S4) + 1}"


def test_compile_record_counts_only_at_the_current_sha():
    m = manifest()
    rec = audit.merge_compile_record(None, m, [("q.cu", 80, None, 1.0), ("q.cu", 90, None, 1.0),
                                              ("d.cu", 80, None, 1.0), ("d.cu", 90, "error: boom", 1.0)], "13.0", "now")
    assert rec["units"]["q.cu"]["skus"][S_TOK] == "t" * 64
    assert rec["units"]["d.cu"]["archs"]["sm_90"] == {"ok": False, "date": "now", "nvrtc": "13.0", "seconds": 1.0,
                                                       "error": "error: boom"}
    c = by_sku(audit.collect(m, rec))
    assert c[S_TOK].compiled == {"sm_80": "ok", "sm_90": "ok"} and c[S_TOK].compiled_ok
    assert c[S_DEQ].compiled == {"sm_80": "ok", "sm_90": "failed"} and c[S_DEQ].compile_failed
    assert c[S_90].compiled == {"sm_80": "n/a", "sm_90": "failed"}
    # the kernel's source changes: its sha and its unit's sha move -> stale, not compiled
    m2 = manifest()
    m2["kernels"][S_TOK]["sha256"] = "T" * 64
    m2["units"]["q.cu"]["sha256"] = "R" * 64
    a2 = audit.collect(m2, rec)
    c2 = by_sku(a2)
    assert c2[S_TOK].compiled == {"sm_80": "stale", "sm_90": "stale"} and not c2[S_TOK].compiled_ok
    assert audit.cell_code(c2[S_TOK], a2) == "C~"
    assert a2.summary()["compiled"] == 0       # S_GRP: same kernel sha but its unit changed -> stale too
    # a unit sha matching but the recorded per-SKU sha differing is also stale
    rec3 = json.loads(json.dumps(rec))
    rec3["units"]["q.cu"]["skus"][S_GRP] = "x" * 64
    assert by_sku(audit.collect(m, rec3))[S_GRP].compiled["sm_80"] == "stale"


def test_compile_record_merge_resets_changed_units_and_drops_removed_ones():
    m = manifest()
    rec = audit.merge_compile_record(None, m, [("q.cu", 80, None, 1.0), ("q.cu", 90, None, 1.0)], "13.0", "d1")
    rec["units"]["gone.cu"] = {"sha256": "z", "skus": {}, "archs": {}}
    m["units"]["q.cu"]["sha256"] = "N" * 64
    rec2 = audit.merge_compile_record(rec, m, [("q.cu", 80, None, 2.0)], "13.0", "d2")
    assert "gone.cu" not in rec2["units"]
    assert set(rec2["units"]["q.cu"]["archs"]) == {"sm_80"}          # sm_90 result was for the old source
    assert rec2["units"]["q.cu"]["sha256"] == "N" * 64


def test_verified_current_stale_failed_and_failure_wins():
    m = manifest()
    v = {"gpu-a": verified_record("GPU A", [(S_TOK, "t" * 64, True, ""), (S_GRP, "old", True, ""),
                                            (S_DEQ, "d" * 64, True, "")]),
         "gpu-b": verified_record("GPU B", [(S_DEQ, "d" * 64, False, "3 mismatches"), (S_GRP, "older", False, "")])}
    a = audit.collect(m, verified=v)
    c = by_sku(a)
    assert c[S_TOK].verified == "passed" and c[S_TOK].gpus == ["GPU A"]
    assert c[S_GRP].verified == "stale"           # only records at another sha (a stale failure too)
    assert c[S_DEQ].verified == "failed" and "3 mismatches" in c[S_DEQ].verify_detail
    assert c[S_90].verified == "none"
    s = a.summary()
    assert (s["verified"], s["stale"], s["failed"], s["verified_pct"]) == (1, 1, 1, 25.0)
    assert "generated 4, compiled 0, verified 1 (25.0%), stale 1" in a.summary_line()
    assert a.gpus == ["GPU A", "GPU B"]
    assert [audit.cell_code(c[s], a) for s in (S_TOK, S_GRP, S_DEQ)] == ["V", "V~", "V!"]


def test_bench_best_is_current_only():
    m = manifest()
    b = {"g": {"gpu": {"name": "G"}, "results": [
        {"sku": S_TOK, "sha256": "t" * 64, "pct_copy": 91.0, "shape": [8192, 8192]},
        {"sku": S_TOK, "sha256": "t" * 64, "pct_copy": 95.5, "shape": [65536, 4096]},
        {"sku": S_TOK, "sha256": "old", "pct_copy": 99.0, "shape": [16, 4096]},
        {"sku": S_GRP, "sha256": "old", "pct_copy": 50.0, "shape": [16, 4096]}]}}
    a = audit.collect(m, verified={"g": verified_record("G", [(S_TOK, "t" * 64, True, "")])}, bench=b)
    c = by_sku(a)
    assert c[S_TOK].bench["pct_copy"] == 95.5 and c[S_TOK].bench["shape"] == [65536, 4096]
    assert c[S_GRP].bench is None and c[S_GRP].bench_stale
    assert audit.cell_code(c[S_TOK], a) == "V 96%"


def test_filter_and_row_layout():
    a = audit.collect(manifest(), pattern="*quantization/quantize/*")
    assert {c.op for c in a.cells} == {"quantize"}
    fields, scopes, rows = audit.op_table(a, "quantization", "quantize")
    assert fields == ["element", "aux_element"]            # mode/arch/precision do not vary: not in the label
    assert scopes == ["token", "group"]                    # the SKU vocabulary's order, not alphabetical
    assert set(rows) == {("bf16", "s8"), ("bf16", "s4"), ("bf16", "fp8_e4m3")}
    a2 = audit.collect(manifest(), pattern="*dequantize*")
    fields2, _, _ = audit.op_table(a2, "quantization", "dequantize")
    assert fields2 == ["element", "aux_element"]           # arch differs, but per scope: implied


# -- formats ------------------------------------------------------------------------------------------
def _audit():
    m = manifest()
    rec = audit.merge_compile_record(None, m, [("q.cu", 80, None, 1.0), ("q.cu", 90, None, 1.0)], "13.0", "d")
    return audit.collect(m, rec, {"g": verified_record("GPU <A>", [(S_TOK, "t" * 64, True, "")])})


def test_json_format_parses_and_holds_every_cell():
    js = json.loads(audit.to_json(_audit()))
    assert js["summary"]["verified"] == 1 and js["summary"]["generated"] == 4
    cells = {c["sku"]: c for c in js["cells"]}
    assert set(cells) == {S_TOK, S_GRP, S_DEQ, S_90, X_S4, X_FP8}
    assert cells[X_S4]["reason"] == REASON_S4 and not cells[X_S4]["generated"]
    assert cells[S_TOK]["verified"] == "passed" and cells[S_TOK]["code"] == "C V"
    assert REASON_FP8 in js["reasons"]


def test_markdown_format_has_tables_codes_and_reasons():
    md = audit.to_markdown(_audit())
    assert "### quantization/quantize: 2 generated, 1 verified, 2 excluded" in md
    assert "| in · out | token | group |" in md
    assert "| bf16 → s8 | C V | C |" in md
    assert "| quantization/quantize | 2 | 2 | 1 | 0 | 0 | 2 |  |" in md          # the per-op summary
    assert "Not generated (—2): `bf16 → s4`" in md       # a row with no generated cell is one line
    assert "| bf16 → s4 |" not in md
    assert REASON_S4 in md and REASON_FP8 in md
    assert md.startswith("**generated 4, compiled 2, verified 1 (25.0%)")


def test_html_is_self_contained_and_escaped():
    page = audit.to_html(_audit())
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    low = page.lower()
    assert "<style>" in low and "http://" not in low and "https://" not in low
    assert "<script" not in low and "<link" not in low and "src=" not in low
    assert "GPU &lt;A&gt;" in page and "&lt;packed&gt; &amp; &quot;nibbles&quot;" in page
    assert "<b>generated 4, compiled 2, verified 1 (25.0%)" in page
    assert page.count("<table>") == 2


def test_terminal_format_prints_summary():
    from rich.console import Console
    con = Console(file=__import__("io").StringIO(), width=200)
    audit.print_terminal(_audit(), con)
    out = con.file.getvalue()
    assert "quantization/quantize" in out and "generated 4, compiled 2, verified 1 (25.0%)" in out


# -- CLI: formats, --fail-under, README block ------------------------------------------------------------
def _write_records(tmp_path, verified=True):
    gen = tmp_path / "generated"
    gen.mkdir()
    m = manifest()
    (gen / "manifest.json").write_text(json.dumps(m))
    rec = tmp_path / "audit"
    records.write_json(rec / "compiled.json", audit.merge_compile_record(None, m, [("q.cu", 80, None, 1.0)], "13.0", "d"))
    if verified:
        records.write_json(rec / "verified" / "gpu-a.json",
                         verified_record("GPU A", [(S_TOK, "t" * 64, True, ""), (S_GRP, "g" * 64, True, ""),
                                                   (S_DEQ, "d" * 64, True, "")]))
    return gen, rec


def _audit_cli(gen, rec, *extra):
    from codegen.cli import main
    return main(["audit", "--generated", str(gen), "--records", str(rec), *extra])


def test_cli_fail_under_exit_codes(tmp_path, capsys):
    gen, rec = _write_records(tmp_path)              # 3 of 4 verified = 75%
    assert _audit_cli(gen, rec, "--format", "json", "--fail-under", "75") == 0
    assert json.loads(capsys.readouterr().out)["summary"]["verified_pct"] == 75.0
    assert _audit_cli(gen, rec, "--format", "md", "--fail-under", "75.1") == 1
    assert "under --fail-under 75.1%" in capsys.readouterr().err
    assert _audit_cli(gen, rec, "--filter", "*quantization/quantize/*", "--format", "md", "--fail-under", "100") == 0
    assert _audit_cli(gen, rec, "--filter", "*nothing*") == 2


def test_cli_output_file_and_formats(tmp_path, capsys):
    gen, rec = _write_records(tmp_path)
    out = tmp_path / "site" / "audit.html"
    assert _audit_cli(gen, rec, "--format", "html", "--output", str(out)) == 0
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert _audit_cli(gen, rec) == 0                 # terminal
    assert "verified 3 (75.0%)" in capsys.readouterr().out


def test_update_readme_creates_then_replaces_the_block(tmp_path, capsys):
    gen, rec = _write_records(tmp_path, verified=False)
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\nProse by the lead.\n")
    assert _audit_cli(gen, rec, "--format", "md", "--update-readme", "--readme", str(readme)) == 0
    text = readme.read_text()
    assert text.startswith("# Title\n\nProse by the lead.\n\n<!-- audit:begin -->")
    assert text.rstrip().endswith("<!-- audit:end -->") and "verified 0 (0.0%)" in text
    readme.write_text(text + "\n## After\n\nMore prose.\n")
    records.write_json(rec / "verified" / "gpu-a.json", verified_record("GPU A", [(S_TOK, "t" * 64, True, "")]))
    assert _audit_cli(gen, rec, "--format", "md", "--update-readme", "--readme", str(readme)) == 0
    text2 = readme.read_text()
    assert text2.count("<!-- audit:begin -->") == 1 and "verified 1 (25.0%)" in text2 and "verified 0 (0.0%)" not in text2
    assert text2.startswith("# Title\n\nProse by the lead.") and text2.endswith("## After\n\nMore prose.\n")
    assert audit.update_readme(audit.to_markdown(audit.load(rec, manifest_root=gen)), readme) is False  # idempotent


def test_compile_record_end_to_end_with_nvrtc(tmp_path):
    """`compile --record` on one real unit, then the audit sees it compiled on sm_80 only."""
    f = "quantization/quantize/tensor/symmetric/f32/s8/*"
    out = tmp_path / "compiled.json"
    r = subprocess.run([sys.executable, "-m", "codegen", "compile", "--arch", "sm_80", "--filter", f,
                        "--record", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(out.read_text())
    (unit, u), = rec["units"].items()
    assert u["archs"]["sm_80"]["ok"] and "sm_90" not in u["archs"]
    m = audit.load_manifest()
    assert u["sha256"] == m["units"][unit]["sha256"]
    assert u["skus"] == {s: m["kernels"][s]["sha256"] for s in m["units"][unit]["skus"]}
    a = audit.collect(m, rec, pattern=f)
    (c,) = a.cells
    assert c.compiled == {"sm_80": "ok", "sm_90": "none"} and audit.cell_code(c, a) == "c"


def test_every_family_in_the_manifest_appears_in_the_audit():
    m = audit.load_manifest()
    a = audit.collect(m)
    assert len(a.cells) == len(m["kernels"]) + len(m["excluded"])
    assert {c.op for c in a.cells} == {s.split("/")[1] for s in list(m["kernels"]) + list(m["excluded"])}


# -- verify -------------------------------------------------------------------------------------------------
ENV = {"gpu": {"name": "GPU A"}, "driver": "13.0", "cuda_runtime": "13.0", "nvrtc": "13.0"}


def _run(seed, date="d"):
    return {"commit": "abc", "dirty": False, "date": date, "seed": seed}


def test_verify_merge_keeps_unselected_and_replaces_selected():
    r1 = verify.merge(None, ENV, _run(1), {S_TOK: {"passed": False, "sha256": "a"}, S_GRP: {"passed": True, "sha256": "b"}})
    assert r1["runs"][0]["id"] == 1 and r1["skus"][S_TOK]["run"] == 1 and r1["seed"] == 1
    r2 = verify.merge(r1, ENV, _run(7, "d2"), {S_TOK: {"passed": True, "sha256": "a2"}})
    assert r2["skus"][S_TOK] == {"passed": True, "sha256": "a2", "run": 2}
    assert r2["skus"][S_GRP] == {"passed": True, "sha256": "b", "run": 1}       # kept
    assert [r["id"] for r in r2["runs"]] == [1, 2] and r2["seed"] == 7 and r2["date"] == "d2"
    assert r2["gpu"]["name"] == "GPU A" and r2["driver"] == "13.0" and r2["commit"] == "abc"


def test_verify_runs_history_is_bounded():
    rec = None
    for i in range(verify.MAX_RUNS_KEPT + 5):
        rec = verify.merge(rec, ENV, _run(i), {S_TOK: {"passed": True, "sha256": "a"}})
    assert len(rec["runs"]) == verify.MAX_RUNS_KEPT and rec["skus"][S_TOK]["run"] == verify.MAX_RUNS_KEPT + 5


def test_verify_workers_deal_the_skus_round_robin_and_fold_their_records():
    """--workers: every SKU in exactly one shard, the shards within one SKU of each other in size, and
    the workers' records folded into one set of results (run ids and sha256s left to the parent)."""
    skus = [f"s{i}" for i in range(11)]
    parts = verify.shards(skus, 4)
    assert sorted(x for p in parts for x in p) == sorted(skus) and {len(p) for p in parts} == {2, 3}
    assert verify.shards(skus[:2], 8) == [["s0"], ["s1"]] and verify.shards(skus, 1) == [skus]
    recs = [{"skus": {"a": {"passed": True, "cases": 3, "run": 4, "sha256": "x"}}},
            {"skus": {"b": {"passed": False, "cases": 1, "run": 1, "sha256": "y"}}}, None]
    assert verify.worker_results(recs) == {"a": {"passed": True, "cases": 3}, "b": {"passed": False, "cases": 1}}


def test_verify_workers_that_record_nothing_fail_their_skus(tmp_path):
    """A worker that exits without a record (here: no GPU) leaves its SKUs failed, not missing: a
    crash is a failed result."""
    from runtime.registry import Registry

    from codegen.harness.bench.timing import no_gpu
    from codegen.manifest import GENERATED
    from codegen.terminal import console
    if no_gpu() is None:
        pytest.skip("a GPU is here: the workers would verify their SKUs")
    skus = [s for s in Registry.load(GENERATED).skus() if str(s).startswith("quantization/quantize/token/")][:3]
    args = types.SimpleNamespace(workers=2, framework="cupy", device=0)
    results, interrupted = verify.run_workers(args, skus, 1, console(stderr=True))
    assert not interrupted and sorted(results) == sorted(map(str, skus))
    assert all(not r["passed"] and "worker process failed" in r["detail"] for r in results.values())


def test_verify_seed_per_sku_is_independent_of_the_selection():
    a = np.random.default_rng(verify.sku_seed(5, S_TOK)).integers(0, 2**31, 4)
    b = np.random.default_rng(verify.sku_seed(5, S_TOK)).integers(0, 2**31, 4)
    c = np.random.default_rng(verify.sku_seed(5, S_GRP)).integers(0, 2**31, 4)
    assert (a == b).all() and not (a == c).all()


def test_verify_and_bench_without_a_gpu_record_nothing(tmp_path):
    from tests.conftest import HAS_GPU
    if HAS_GPU:
        pytest.skip("this machine has a GPU")
    for cmd in (["verify", "--filter", S_TOK], ["bench", "--filter", S_TOK]):
        r = subprocess.run([sys.executable, "-m", "codegen", *cmd, "--records", str(tmp_path)],
                           capture_output=True, text=True)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "GPU" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_verify_refuses_generated_that_does_not_match_the_manifest(tmp_path):
    import shutil

    from runtime.registry import Registry
    from codegen.manifest import GENERATED
    shutil.copytree(GENERATED, tmp_path / "g")
    reg = Registry.load(tmp_path / "g")
    sku = KernelSku.parse(S_TOK)
    assert verify._unit_mismatches(reg, [sku]) == []
    unit = tmp_path / "g" / reg.entries[sku].unit
    unit.write_text(unit.read_text() + "// hand edit\n")
    assert verify._unit_mismatches(reg, [sku]) == [reg.entries[sku].unit]


def test_gpu_slug():
    assert records.slug("NVIDIA H200") == "nvidia-h200"
    assert records.slug("NVIDIA GeForce RTX 4090 (PCIe)") == "nvidia-geforce-rtx-4090-pcie"


# -- bench arithmetic ------------------------------------------------------------------------------------------
def test_bench_bytes_gbps_pct_geomean():
    assert workloads_base.nbytes(np.zeros((4, 8), np.float32), None, np.zeros(3, np.int8), 2.0) == 4 * 8 * 4 + 3
    assert bench_timing.gbps(4e9, 1.0) == pytest.approx(4000.0)
    assert bench_timing.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert bench_timing.pct(4000.0, 5000.0) == pytest.approx(80.0)
    assert bench_timing.geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert bench_timing.geomean([None, 2.0]) == pytest.approx(2.0) and bench_timing.geomean([]) is None


def test_static_workload_bytes_count_each_stream_once():
    q = KernelSku.parse(f"quantization/quantize/token/symmetric/bf16/s8/sm80/simt/{P}")
    assert bench_static.expected_bytes(q, (8192, 8192)) == 8192 * 8192 * (2 + 1) + 8192 * 4
    qa = KernelSku.parse(f"quantization/quantize/group/asymmetric/f32/u8/sm80/simt/{P}")
    assert bench_static.expected_bytes(qa, (16, 4096)) == 16 * 4096 * 5 + 16 * 32 * (4 + 4)
    d = KernelSku.parse("quantization/dequantize/channel/symmetric/s8/f64/sm80/simt/f64.acc-f64.det.stable")
    assert bench_static.expected_bytes(d, (65536, 4096)) == 65536 * 4096 * 9 + 4096 * 8   # axis=-1, f64 scales
    t = KernelSku.parse(f"quantization/quantize/tensor/symmetric/f16/s8/sm80/simt/{P}")
    assert bench_static.expected_bytes(t, (16, 4096)) == 16 * 4096 * 3 + 4


def test_bench_finish_ratios():
    r = bench_record.finish({"bytes": 10**9, "skuforge": {"ms": 0.25}, "torch_eager": {"ms": 1.0},
                             "torch_compile": {"ms": 0.5}}, copy_gbps=5000.0)
    assert r["gbps"] == pytest.approx(4000.0) and r["pct_copy"] == pytest.approx(80.0)
    assert r["torch_compile"]["pct_copy"] == pytest.approx(40.0)
    assert r["speedup_eager"] == pytest.approx(4.0) and r["speedup_compile"] == pytest.approx(2.0)
    f = bench_record.finish({"flops": 4e12, "skuforge": {"ms": 2.0}, "torch_ref": {"ms": 3.0},
                             "torch_eager": {"error": "x"}}, copy_gbps=5000.0)
    assert f["tflops"] == pytest.approx(2000.0) and f["speedup_ref"] == pytest.approx(1.5)
    assert "pct_copy" not in f and "speedup_eager" not in f


def test_rotation_sets_exceed_l2():
    l2 = 60 << 20
    assert bench_timing.rotation_sets(16 * 4096 * 3, l2) == bench_timing.MAX_SETS     # tiny: capped
    assert bench_timing.rotation_sets(8192 * 8192 * 3, l2) == 2                # 192 MiB < 4 x 60 MiB
    assert bench_timing.rotation_sets(65536 * 4096 * 5, l2) == 1
    n = bench_timing.rotation_sets(10 << 20, l2)
    assert n * (10 << 20) >= 4 * l2


def test_bench_stats_median_and_shapes():
    s = bench_timing.stats([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s["ms"] == 3.0 and s["samples"] == 5 and s["p10_ms"] == 1.0 and s["p90_ms"] == 5.0
    assert bench_plan.parse_shapes("8192x8192, 16x4096") == [(8192, 8192), (16, 4096)]
    with pytest.raises(SystemExit):
        bench_plan.parse_shapes("8192*8192")


def test_bench_merge_keyed_by_sku_and_shape():
    env = {"gpu": {"name": "G"}}
    run = {"date": "d1", "commit": "c", "dirty": False}
    a = {"sku": S_TOK, "shape": [8192, 8192], "pct_copy": 80.0}
    b = {"sku": S_TOK, "shape": [16, 4096], "pct_copy": 10.0}
    r1 = bench_record.merge(None, env, run, [a, b], [{"label": "h", "us": 9.0}], {"gbps": 4000.0})
    a2 = dict(a, pct_copy=90.0)
    r2 = bench_record.merge(r1, env, dict(run, date="d2"), [a2], [], {"gbps": 4100.0})
    assert len(r2["results"]) == 2 and {r["pct_copy"] for r in r2["results"]} == {90.0, 10.0}
    assert r2["host_overhead"] == [{"label": "h", "us": 9.0}] and r2["copy"]["gbps"] == 4100.0


GMM = "moe/grouped_matmul/-/-/bf16/-/sm80/{}/bf16.acc-f32.det"


def test_bench_targets_and_markdown():
    def res(sku, op, label, shape, ms, scope="token", **kw):
        return bench_record.finish({"sku": sku, "op": op, "label": label, "shape": list(shape), "scope": scope,
                                    "element": "bf16", "aux_element": "s8", "bytes": 10**9, "skuforge": {"ms": ms}, **kw},
                                   5000.0)
    rs = [res(S_TOK, "quantize", "bf16->s8 token", (8192, 8192), 0.22, torch_compile={"ms": 0.33},
              torch_eager={"ms": 1.0}, mismatches_vs_eager=0),
          res(S_GRP, "quantize", "bf16->s8 group", (65536, 4096), 0.25, scope="group", torch_compile={"ms": 0.30}),
          res(S_GRP, "quantize", "bf16->s8 group", (16, 4096), 0.25, scope="group"),        # not a large shape
          res("d1", "dynamic_quantize", "dyn token", (8192, 8192), 0.2299),                   # 87% >= 85 (default)
          res("d2", "dynamic_quantize", "dyn tensor", (8192, 8192), 0.4, scope="tensor", target_pct=55.0),
          res("d3", "dynamic_quantize", "dyn group", (16, 4096), 0.0045, scope="group", target_us=4.77),
          {"sku": GMM.format("mma"), "op": "grouped_matmul", "label": "gmm", "shape": [8, 1], "flops": 1e12,
           "speedup_ref": 0.6, "target_ref": 0.5},
          {"sku": GMM.format("wgmma"), "op": "grouped_matmul", "label": "gmm E8", "shape": [8, 1], "flops": 1e12,
           "speedup_ref": 1.0, "target_ref": 0.95, "pct_ceiling": 90.0},
          {"sku": GMM.format("wgmma"), "op": "grouped_matmul", "label": "gmm E128", "shape": [128, 1], "flops": 1e12,
           "speedup_ref": 1.05, "target_ref": 1.1},
          {"sku": GMM.format("wgmma"), "op": "grouped_matmul_backward_weight",
           "label": "grouped_matmul_backward (dx + dw) E8", "shape": [8, 1, "dx+dw"], "flops": 1e12,
           "speedup_ref": 0.92, "target_ref": 0.9}]
    rec = {"gpu": {"name": "G"}, "copy": {"gbps": 5000.0, "bytes": 2**30}, "results": rs,
           "host_overhead": [{"label": "quantize cupy", "us": 12.0, "min_us": 11.0, "target_us": 15.0}]}
    t = {what: (val, want, ok) for what, val, want, ok, _ in bench_record.targets(rec)}
    assert t["quantize (group/token): min % of copy on 131072x4096/4096x14336/4096x7168/65536x4096/8192x8192"] == (pytest.approx(80.0), 95.0, False)
    g = t["quantize: geomean speed-up vs torch.compile"]
    assert g[0] == pytest.approx(math.sqrt(1.5 * 1.2)) and g[2] is True
    assert t["quantize: min speed-up vs torch.compile (every cell)"] == (pytest.approx(1.2), 1.0, True)
    assert t["dynamic_quantize (token): min % of copy on 131072x4096/4096x14336/4096x7168/65536x4096/8192x8192"][1:] == (95.0, False)     # 87 %
    assert t["dynamic_quantize (tensor): min % of copy on 131072x4096/4096x14336/4096x7168/65536x4096/8192x8192"] == (pytest.approx(50.0), 55.0, False)
    assert t["dynamic_quantize: µs at 16x4096, dyn group"] == (pytest.approx(4.5), 4.77, True)
    assert t["grouped_matmul [mma]: min ratio to the PyTorch reference"] == (0.6, 0.5, True)
    assert t["grouped_matmul [wgmma]: min ratio to the PyTorch reference"] in ((1.0, 0.95, True), (1.05, 1.1, False))
    levels = [(v, w, ok) for what, v, w, ok, _ in bench_record.targets(rec) if what.startswith("grouped_matmul [wgmma]")]
    assert sorted(levels) == [(1.0, 0.95, True), (1.05, 1.1, False)]          # one line per target level
    assert t["grouped_matmul_backward (dx + dw) [wgmma]: min ratio to the PyTorch reference"] == (0.92, 0.9, True)
    assert t["host overhead: quantize cupy"][2] is True
    md = bench_report.to_markdown(rec)
    assert "| quantize | bf16->s8 token | 8192x8192 |  | 220.0 | 4545 | 90.9 | 20.0 | 60.6 | 4.55 | 1.50 | ✓ |" in md
    assert "❌" in md and "✅" in md and "| grouped_matmul | gmm |" in md
    assert "| grouped_matmul | gmm E8 | 8x1 |  |  | 90.0 |  | 1.00 | ≥ 0.95 |" in md


def test_bench_targets_declared_by_modules():
    sku = KernelSku.parse(S_TOK)
    assert bench_record.target_for(types.SimpleNamespace(TARGETS_BY_SCOPE={"token": 85.0}), sku) == {"target_pct": 85.0}
    assert bench_record.target_for(types.SimpleNamespace(TARGET_PCT=70), sku) == {"target_pct": 70.0}
    assert bench_record.target_for(types.SimpleNamespace(TARGET_PCT={"quantize": 95}), sku) == {"target_pct": 95.0}
    assert bench_record.target_for(types.SimpleNamespace(TARGET_PCT_OF_TORCH=50.0), sku) == {"target_ref": 0.5}
    by_shape = types.SimpleNamespace(TARGET_PCT_OF_TORCH=lambda s, shape: 110.0 if shape[0] >= 128 else None)
    assert bench_record.target_for(by_shape, sku, [128, 4096]) == {"target_ref": 1.1}
    assert bench_record.target_for(by_shape, sku, (8, 4096)) == {} == bench_record.target_for(by_shape, sku)
    assert bench_record.target_for(types.SimpleNamespace(), sku) == {}
    latency = types.SimpleNamespace(TARGET_US=lambda s, shape: (4.5, "peer") if shape == (16, 4096) else None)
    assert bench_record.target_for(latency, sku, [16, 4096]) == {"target_us": 4.5, "target_us_note": "peer"}
    assert bench_record.target_for(latency, sku, [8192, 8192]) == {}
    per_sku = types.SimpleNamespace(TARGET_PCT=lambda s: None if s.scope == "token" else 80.0)
    assert bench_record.target_for(per_sku, sku) == {"no_target": True}
    assert bench_record.target_for(per_sku, KernelSku.parse(S_GRP)) == {"target_pct": 80.0}


def test_bench_targets_skip_results_without_target():
    base = dict(op="dynamic_quantize", scope="group", element="bf16", aux_element="s8", shape=[8192, 8192])
    rec = {"results": [dict(base, label="fast", pct_copy=95.0, target_pct=85.0),
                       dict(base, label="fallback", pct_copy=20.0, no_target=True)]}
    (what, value, want, ok, note), = [t for t in bench_record.targets(rec) if "min % of copy" in t[0]]
    assert (value, want, ok) == (95.0, 85.0, True) and "fast" in note


def test_bench_targets_leave_out_skus_the_card_replaces():
    """On a 9.0 card the registry runs the sm89 fp8 kernel: the sm80 one (software fp8 conversion) is
    recorded and named under the table, but held to no target; on an 8.0 card it is the one that runs."""
    sku = "quantization/dynamic_quantize/group/symmetric/bf16/fp8_e4m3/{}/simt/f32.acc-f32.det.stable"
    base = dict(op="dynamic_quantize", scope="group", element="bf16", aux_element="fp8_e4m3", shape=[8192, 8192])
    results = [dict(base, sku=sku.format("sm89"), label="sm89", pct_copy=96.0, speedup_compile=1.2),
               dict(base, sku=sku.format("sm80"), label="sm80", pct_copy=30.0, speedup_compile=0.4)]
    rows = {what: value for what, value, *_ in bench_record.targets({"gpu": {"cc": "9.0"}, "results": results})}
    assert rows["dynamic_quantize: min speed-up vs torch.compile (every cell)"] == 1.2
    assert "Not held to the targets" in bench_report.to_markdown({"gpu": {"cc": "9.0"}, "results": results})
    rows = {what: value for what, value, *_ in bench_record.targets({"gpu": {"cc": "8.0"}, "results": results[1:]})}
    assert rows["dynamic_quantize: min speed-up vs torch.compile (every cell)"] == 0.4


def test_bench_target_shapes_split_the_rows():
    """A result's target shapes (a module's TARGET_SHAPES, here 65536x4096 only) make their own row;
    other shapes of those results count for no target."""
    base = dict(op="dynamic_quantize", scope="group", element="bf16")
    lowbit = dict(base, aux_element="s4", target_pct=85.0, target_shapes=[[65536, 4096]])
    rec = {"results": [dict(base, aux_element="s8", label="s8", shape=[8192, 8192], pct_copy=86.0, target_pct=85.0),
                       dict(lowbit, label="s4", shape=[65536, 4096], pct_copy=86.1),
                       dict(lowbit, label="s4", shape=[8192, 8192], pct_copy=76.0)]}
    rows = {what: (value, want, ok) for what, value, want, ok, _ in bench_record.targets(rec)}
    assert rows["dynamic_quantize (group): min % of copy on 131072x4096/4096x14336/4096x7168/65536x4096/8192x8192"] \
        == (86.0, 85.0, True)
    assert rows["dynamic_quantize (group): min % of copy on 65536x4096"] == (86.1, 85.0, True)
    mod = types.SimpleNamespace(TARGET_PCT=85.0, TARGET_SHAPES=((65536, 4096),))
    assert bench_record.target_for(mod, KernelSku.parse(S_GRP)) == {"target_pct": 85.0, "target_shapes": [[65536, 4096]]}


def test_bench_render_refreshes_targets_without_a_gpu(tmp_path, monkeypatch):
    """``bench --render``: targets re-derived from the modules, Markdown rewritten, data untouched."""
    folder = tmp_path / "bench"
    folder.mkdir()
    r = bench_record.finish({"sku": S_TOK, "op": "quantize", "label": "bf16->s8 token", "shape": [8192, 8192],
                             "scope": "token", "element": "bf16", "aux_element": "s8", "bytes": 10**9,
                             "skuforge": {"ms": 0.22}, "target_pct": 50.0}, 5000.0)
    write_json(folder / "g.json", {"gpu": {"name": "G"}, "copy": {"gbps": 5000.0, "bytes": 2**30}, "results": [r]})
    mod = types.SimpleNamespace(__name__="m", OPS=("quantize",), TARGET_PCT={"quantize": 95.0},
                                make=lambda s, sh: None)
    monkeypatch.setattr(families, "workload_modules", lambda warn=print: [mod])
    assert bench_cli.cmd_render(types.SimpleNamespace(records=str(tmp_path))) == 0
    rec = read_json(folder / "g.json")
    assert rec["results"][0]["target_pct"] == 95.0 and rec["results"][0]["ms"] == r["ms"]
    md = (folder / "g.md").read_text()
    assert "| 95 | ❌ |" in md                                          # 90.9 % against the refreshed 95
    assert bench_cli.cmd_render(types.SimpleNamespace(records=str(tmp_path / "none"))) == 2


def test_bench_plan_discovers_modules_and_default_subset():
    mod_a = types.SimpleNamespace(__name__="a", OPS=("quantize",), make=lambda s, sh: None)
    mod_b = types.SimpleNamespace(__name__="b", handles=lambda s: s.op == "dequantize", SHAPES=[("E8",)],
                                  QUICK_SHAPES=[("E1",)], make=lambda s, sh: None, default=lambda s: True)
    skus = [KernelSku.parse(s) for s in (S_TOK, S_GRP, S_DEQ,
                                        f"quantization/quantize/token/asymmetric/bf16/s8/sm80/simt/{P}",
                                        "quantization/quantize/token/symmetric/f64/s8/sm80/simt/f64.acc-f64.det.stable",
                                        f"quantization/dynamic_quantize/token/symmetric/bf16/s8/sm80/simt/{P}")]
    todo = bench_plan.plan(skus, [mod_a, mod_b], shapes=[(16, 4096)])
    assert [(str(s), m.__name__, sh) for s, m, sh in todo] == [
        (S_TOK, "a", (16, 4096)), (S_GRP, "a", (16, 4096)), (S_DEQ, "b", ("E8",))]
    assert len(bench_plan.plan(skus, [mod_a, mod_b], all_skus=True)) == 4 * len(bench_plan.STANDARD_SHAPES) + 1
    default = [(str(s).split("/")[2], sh) for s, m, sh in bench_plan.plan(skus[:2], [mod_a])]
    assert default == [("token", sh) for sh in bench_plan.STANDARD_SHAPES] + [("group", sh) for sh in bench_plan.STANDARD_SHAPES]
    f32 = KernelSku.parse(f"quantization/quantize/token/symmetric/f32/s8/sm80/simt/{P}")
    assert [sh for s, m, sh in bench_plan.plan([f32], [mod_a])] == list(bench_plan.LARGE_SHAPES)     # bf16 only on all four
    assert [sh for s, m, sh in bench_plan.plan(skus, [mod_b], quick=True)] == [("E1",)]


def test_bench_modules_are_discovered():
    mods = families.workload_modules()
    assert "codegen.harness.workloads.static" in [m.__name__ for m in mods]
    sku = KernelSku.parse(S_TOK)
    assert families.module_for(sku, mods) is bench_static


def test_bench_chart_png(tmp_path):
    pytest.importorskip("matplotlib")
    big = [bench_record.finish({"sku": s, "op": "quantize", "label": s.split("/")[2], "shape": list(sh), "bytes": b,
                                "skuforge": {"ms": 0.1}, "torch_compile": {"ms": 0.2}, "torch_eager": {"error": "x"}}, 4000.0)
           for s in (S_TOK, S_GRP) for sh, b in (((8192, 8192), 3 << 26), ((16, 4096), 3 << 16))]
    path = bench_report.chart({"gpu": {"name": "G"}, "copy": {"gbps": 4000.0}, "results": big}, tmp_path / "c.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert bench_report.chart({"results": big[1::2]}, tmp_path / "none.png") is None    # latency shapes only: no chart


def test_bench_run_one_plumbing_with_a_fake_timer(monkeypatch):
    """run_one: rotation sets from make(), targets from the module, figures from the timer's median,
    % of copy against the copy of the same bytes (L2-rotated like the inputs), not the peak copy."""
    made, copies = [], []
    monkeypatch.setattr(bench_run, "same_size_copy",
                        lambda timer, nbytes_, l2: copies.append((nbytes_, l2)) or {"gbps": 2000.0})

    def make(sku, shape):
        made.append(shape)
        return {"call": lambda: None, "bytes": 3 << 20, "label": "lbl"}
    mod = types.SimpleNamespace(make=make, TARGETS_BY_SCOPE={"token": 85.0})

    class FakeTimer:
        def measure(self, calls):
            return {"ms": 0.001, "samples": len(calls)}
    r = bench_run.run_one(FakeTimer(), None, KernelSku.parse(S_TOK), mod, (16, 4096), 60 << 20, 4000.0, "sha")
    assert len(made) == r["sets"] == 80 and r["skuforge"]["samples"] == 80      # 4 x 60 MiB / 3 MiB
    assert r["target_pct"] == 85.0 and r["sha256"] == "sha" and r["shape"] == [16, 4096]
    assert r["gbps"] == pytest.approx((3 << 20) / 1e-6 / 1e9) and r["pct_copy"] == pytest.approx(r["gbps"] / 20.0)
    assert r["pct_copy_peak"] == pytest.approx(r["gbps"] / 40.0) and copies == [(3 << 20, 60 << 20)]
    assert "torch_eager" not in r and "speedup_compile" not in r
    assert bench_run.run_one(FakeTimer(), None, KernelSku.parse(S_TOK), types.SimpleNamespace(make=lambda s, sh: None),
                             (16, 4096), 60 << 20, 4000.0, "sha") is None


class _FakeClock:
    """A stand-in for CuPy's events on one stream: every call a contender makes advances a device
    clock by that contender's duration; an event records the clock when it is recorded, after the
    calls enqueued before it (what ``Timer.measure_turns`` times)."""

    def __init__(self):
        self.now, self.log, self.drains = 0.0, [], 0
        clock = self

        class Event:
            def __init__(self, disable_timing=False):
                pass

            def record(self, stream=None):
                self.t = clock.now

            def synchronize(self):
                pass

            @property
            def done(self):                 # CuPy's Event.done: the spin ended before the batch was enqueued
                clock.drains -= 1
                return clock.drains >= 0

        self.cp = types.SimpleNamespace(cuda=types.SimpleNamespace(
            Event=Event, get_elapsed_time=lambda a, b: b.t - a.t))

    def call(self, name, ms):
        def run():
            self.log.append(name)
            self.now += ms
        return run


def test_a_batch_the_gpu_may_have_waited_in_is_dropped_and_its_spin_doubled():
    """measure_turns: when the spin ended before a batch was enqueued (the GPU may then have timed the
    host's call path), the batch is not counted, the contender's spin is doubled, and the result says
    how many batches were dropped; the samples still come to the number asked for."""
    clock = _FakeClock()
    timer = bench_timing.Timer.__new__(bench_timing.Timer)
    timer.cp, timer.samples, timer.max_seconds = clock.cp, 40, 60.0
    timer.stream = types.SimpleNamespace(synchronize=lambda: None)
    spins = []
    timer.spin_ns = spins.append
    clock.drains = 2                                # the first two batches drain
    got = timer.measure([clock.call("ours", 1.0)])
    assert got["samples"] == 40 and got["dropped_batches"] == 2 and got["ms"] == 1.0
    assert len(spins) == 3 and spins[1] > spins[0] and spins[2] > spins[1]     # one batch of 40, taken the third time


def test_bench_times_contenders_in_turns():
    """measure_turns: each contender its own median from its own calls, the timed calls of the two
    alternating in batches (ours, the reference, ours, ...) rather than one block after the other."""
    clock = _FakeClock()
    timer = bench_timing.Timer.__new__(bench_timing.Timer)
    timer.cp, timer.samples, timer.max_seconds = clock.cp, 40, 60.0
    timer.stream = types.SimpleNamespace(synchronize=lambda: None)
    timer.spin_ns = lambda ns: None
    ours, ref = clock.call("ours", 4.0), clock.call("ref", 5.0)     # 4 ms and 5 ms a call: 3 calls a 10 ms turn
    got = timer.measure_turns([[ours], [ref]])
    assert [g["ms"] for g in got] == [4.0, 5.0] and [g["samples"] for g in got] == [40, 40]
    start = len(clock.log) - 80                     # the warm-ups come first, one contender after the other
    timed = clock.log[start:]
    assert timed.count("ours") == timed.count("ref") == 40
    runs = [len(list(g)) for _, g in itertools.groupby(timed)]
    assert len(runs) > 20 and max(runs) <= 3        # many short turns
    assert timer.measure([ours])["ms"] == 4.0


def test_bench_run_one_times_a_reference_in_turns_and_survives_its_failure():
    def make(sku, shape):
        return {"call": lambda: None, "flops": 2e9, "label": "gmm", "torch_ref": lambda: None}
    mod = types.SimpleNamespace(make=make)
    seen = []
    no_composite = types.SimpleNamespace(eager_calls=lambda sets: None, compiled_calls=lambda sets: None)

    class TurnTimer:
        def measure(self, calls):
            seen.append("alone")
            return {"ms": 1.0, "samples": 10}

        def measure_turns(self, contenders):
            seen.append(len(contenders))
            return [{"ms": 1.0, "samples": 10}, {"ms": 1.25, "samples": 10}]
    r = bench_run.run_one(TurnTimer(), no_composite, KernelSku.parse(S_TOK), mod, (16, 4096), 60 << 20,
                          4000.0, "sha")
    assert seen == [2] and r["speedup_ref"] == pytest.approx(1.25)

    class FailingRef(TurnTimer):
        def measure_turns(self, contenders):
            raise RuntimeError("torch._grouped_mm refused the layout")
    seen.clear()
    r = bench_run.run_one(FailingRef(), no_composite, KernelSku.parse(S_TOK), mod, (16, 4096), 60 << 20,
                          4000.0, "sha")
    assert seen == ["alone"] and r["skuforge"]["ms"] == 1.0 and "refused the layout" in r["torch_ref"]["error"]


def test_bench_error_text_keeps_the_cause():
    e = RuntimeError("backend='inductor' raised:\n" + "\n".join(f"frame {i}" for i in range(20))
                     + "\nCalledProcessError: gcc not found")
    t = bench_baselines.error_text(e)
    assert t.startswith("RuntimeError: backend='inductor' raised:") and "gcc not found" in t and len(t) <= 600


@pytest.mark.parametrize("cmd", ["audit", "verify", "bench"])
def test_cli_help(cmd, capsys):
    from codegen.cli import main
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0 and "--filter" in capsys.readouterr().out


def test_same_bytes_copy_rotates_its_buffers_like_the_inputs():
    """The copy a result is compared with moves the result's bytes through as many distinct
    (source, destination) pairs as make 4 x L2, each pair copied in turn: not one pair served from L2."""
    copied = []

    class Arr:
        def __init__(self):
            self.data = types.SimpleNamespace(copy_from_device_async=lambda src, n, stream: copied.append((src, self, n)))

        def copy(self):
            return Arr()

    cp = types.SimpleNamespace(random=types.SimpleNamespace(randint=lambda lo, hi, size, dtype: Arr()),
                               uint8="u1", empty_like=lambda a: Arr(),
                               get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None))

    class FakeTimer:
        stream = None

        def measure(self, calls):
            for c in calls:
                c()
            return {"ms": 0.01, "samples": len(calls)}
    timer = FakeTimer()
    timer.cp = cp
    bench_timing._SAME_COPY.clear()
    r = bench_timing.same_size_copy(timer, 16 << 20, 50 << 20)     # 16 MiB moved, 50 MiB of L2: 13 pairs
    assert r["sets"] == 13 and r["bytes"] == 8 << 20 and r["gbps"] == pytest.approx(2 * (8 << 20) / 1e-5 / 1e9)
    assert len(copied) == 13 and len({id(s) for s, _, _ in copied}) == len({id(d) for _, d, _ in copied}) == 13
    assert all(n == 8 << 20 for _, _, n in copied)
    bench_timing._SAME_COPY.clear()
