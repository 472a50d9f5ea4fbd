"""Matrix, rendering determinism, manifest and the CLI (CPU)."""
import json
import subprocess
import sys

import pytest

from codegen import manifest, matrix, render, spec
from codegen.families import KINDS
from runtime.errors import TemplateError
from runtime.sku import KernelSku


def test_matrix_covers_static_family_and_names_exclusions():
    cells = matrix.cells()
    gen = [c for c in cells if c.generated]
    static = [c for c in gen if c.sku.op in ("quantize", "dequantize")
              and {c.sku.element, c.sku.aux_element} & {"s8", "u8"}]
    # 2 ops x 4 scopes x 2 modes x 4 floats x 2 ints
    assert len(static) == 128
    for c in cells:
        if not c.generated:
            assert c.reason and len(c.reason) > 10
    fp8_asym = [c for c in cells if c.sku.aux_element == "fp8_e4m3" and c.sku.mode == "asymmetric"]
    assert fp8_asym and all("no zero point" in c.reason for c in fp8_asym)


def test_excluding_by_predicate_and_adding_a_dtype_is_declarative():
    block = spec.Block(name="t", category="quantization", ops=("quantize",), template="quantization/{op}.cu.j2",
                       pairs=(("f32", "s8"), ("f16", "s8")), launch=KINDS["elementwise"], scopes=("token",),
                       modes=("symmetric",), ins=(spec.Stream("x", "element"),), outs=(spec.Stream("q", "aux"),),
                       exclusions=(spec.Exclusion("f16 left out for the test", lambda s: s.element == "f16"),))
    cells = matrix.cells((spec.Family("t", (block,), ()),))
    assert [c.generated for c in cells] == [False, True]
    assert cells[0].reason == "f16 left out for the test"


def test_rendering_is_deterministic_and_check_passes():
    a = manifest.expected_files()
    b = manifest.expected_files()
    assert a == b
    assert manifest.stale() == []


def test_every_kernel_carries_its_sku_and_hash():
    files = manifest.expected_files()
    man = json.loads(files["manifest.json"])
    for sku, entry in man["kernels"].items():
        text = files[entry["unit"]]
        assert f"// SKU: {sku}\n" in text
        shares = entry["launch"].get("shares") or {}      # entry points launched from a host SKU of the unit
        main = KernelSku.parse(shares["main"]).symbol if "main" in shares else entry["symbol"]
        assert f" {main}(" in text
        assert len(entry["sha256"]) == 64
    assert man["counts"]["generated"] == len(man["kernels"])
    assert all(e["reason"] for e in man["excluded"].values())


def test_strict_undefined_fails_loudly():
    import jinja2
    env = render.environment()
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ k.nope }}").render(k={})


def test_check_detects_stale_and_build_repairs(tmp_path):
    root = tmp_path / "generated"
    rep = manifest.build(root)
    assert rep.written and manifest.stale(root) == []
    unit = sorted(p for p in root.rglob("*.cu"))[0]
    unit.write_text(unit.read_text() + "// edited\n")
    (root / "quantization" / "orphan.cu").write_text("//")          # a unit an earlier build wrote
    man = json.loads((root / "manifest.json").read_text())
    man["units"]["quantization/orphan.cu"] = {}
    (root / "manifest.json").write_text(json.dumps(man))
    bad = manifest.stale(root)
    assert any(str(unit.relative_to(root)) in b for b in bad) and any("orphan" in b for b in bad)
    rep = manifest.build(root)
    assert len(rep.written) == 2 and rep.removed == ["quantization/orphan.cu"]
    assert manifest.build(root).written == []


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "codegen", *args], capture_output=True, text=True)


def test_cli_check_list_show():
    assert _cli("check").returncode == 0
    out = _cli("list", "--filter", "quantization/quantize/token/symmetric/bf16/s8*")
    assert out.returncode == 0
    assert out.stdout.split() == ["quantization/quantize/token/symmetric/bf16/s8/sm80/simt/f32.acc-f32.det.stable"]
    js = json.loads(_cli("list", "--json", "--filter", "*dequantize/group/*/s8/*").stdout)
    assert len(js["kernels"]) == 8 and all(k["symbol"].startswith("sf_dequantize_group") for k in js["kernels"])
    show = _cli("show", "quantization/quantize/token/symmetric/bf16/s8/sm80/simt/f32.acc-f32.det.stable")
    assert "sf_quantize_token_symmetric_bf16_s8_sm80_simt(" in show.stdout
    assert "sf_quantize_token_asymmetric" not in show.stdout   # only its own kernel
    assert "__device__ __forceinline__ float  to_f32(bf16_t v)" in show.stdout  # helpers included


def test_cli_show_unknown_sku_is_a_clear_error():
    out = _cli("show", "quantization/quantize/token/asymmetric/bf16/fp8_e4m3/sm80/simt/f32.acc-f32.det.stable")
    assert out.returncode != 0
    assert "no zero point" in out.stderr


def test_cli_compile_one_unit():
    out = _cli("compile", "--arch", "sm_80", "--filter", "quantization/quantize/tensor/symmetric/f32/s8*")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sm_80: 1 units, 1 kernels compiled" in out.stdout


def test_cli_status_reports_cache_and_nvrtc(tmp_path, monkeypatch, override_settings):
    monkeypatch.setenv("SKUFORGE_CACHE_DIR", str(tmp_path / "c"))     # the subprocesses
    override_settings(cache_dir=tmp_path / "c")                       # this process
    from runtime import compiler
    compiler.compile_cached('extern "C" __global__ void k() {}\n', "quantization/x.cu", 80)
    out = subprocess.run([sys.executable, "-m", "codegen", "status"], capture_output=True, text=True,
                         env={**__import__("os").environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "NVRTC" in out.stdout and "sm_80: 1 cubins" in out.stdout
    cleared = subprocess.run([sys.executable, "-m", "codegen", "status", "--clear-cache"], capture_output=True,
                             text=True)
    assert cleared.returncode == 0 and "cleared" in cleared.stdout
    assert not list((tmp_path / "c").rglob("*.cubin"))


def test_every_axis_value_in_use_is_declared_once():
    """The matrix, the manifest and the runtime's launch table use exactly runtime/axes.py's vocabulary."""
    import runtime  # noqa: F401 - imports the launchers
    from runtime import axes
    from runtime.plans import LAUNCHERS
    cells = matrix.cells()
    assert {c.sku.scope for c in cells} - {None} <= set(axes.SCOPES)
    assert {c.sku.mode for c in cells} - {None} <= set(axes.MODES)
    assert {c.sku.op for c in cells} == {op for ops in axes.OPS.values() for op in ops}
    assert set(LAUNCHERS) == set(axes.LAUNCH_KINDS)
    m = json.loads((manifest.GENERATED / "manifest.json").read_text())
    assert {e["launch"]["kind"] for e in m["kernels"].values()} == set(axes.LAUNCH_KINDS)
    assert m["generator"].endswith(axes.GENERATOR_VERSION)


def test_device_headers_are_plain_cuda_named_and_closed(tmp_path, monkeypatch):
    """Every header under templates/ is read verbatim (no Jinja), names itself on its first line and
    closes with the end-of-helpers line the registry cuts a kernel's source at; one that does not is a
    TemplateError naming it."""
    from codegen import render
    headers = sorted(p.relative_to(render.TEMPLATES).as_posix() for p in render.TEMPLATES.rglob("*.cuh"))
    assert len(headers) >= 10
    for name in headers:
        text = render.header(name)
        assert "{{" not in text and "{%" not in text and "{#" not in text, name
    (tmp_path / "x.cuh").write_text("// ---- x (templates/x.cuh) ----\nint a;\n")
    monkeypatch.setattr(render, "TEMPLATES", tmp_path)
    with pytest.raises(TemplateError, match="x.cuh.*end of"):
        render.header("x.cuh")
