"""The low-bit kernels (docs/lowbit.md), rendered and compiled on the CPU.

The low-bit cells of the matrix (counts and exclusion reasons), the low-bit units (helpers, sm89
units, manifest metadata, ``Registry.source``), and NVRTC compiles of the low-bit units for sm_80,
sm_89 and sm_90: a subset covering every template branch by default, every unit on every arch
with ``SKUFORGE_FULL_COMPILE=1`` (184 compiles, about 2-3 minutes on 2 cores).
"""
import json
import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

from codegen import manifest, matrix, render, spec
from codegen.families.quantization.blocks import LOW_BIT, lowbit_blocks
from runtime.registry import Registry
from runtime.sku import KernelSku
from tests import knobs

LOW = set(LOW_BIT)
LOWBIT_FAMILIES = (spec.Family("lowbit", lowbit_blocks(), ()),)


def _is_low(sku) -> bool:
    return bool({sku.element, sku.aux_element} & LOW)


def _section(text: str, sku: str) -> str:
    """One SKU's text in its unit: from its ``// SKU:`` line to the next."""
    start = text.index(f"// SKU: {sku}\n")
    nxt = text.find("// SKU: ", start + 1)
    return text[start: nxt if nxt >= 0 else len(text)].rstrip("\n") + "\n"


@pytest.fixture(scope="module")
def shipped_files():
    return manifest.expected_files()


def test_lowbit_cells_and_counts():
    cells = matrix.cells(LOWBIT_FAMILIES)
    gen = [c for c in cells if c.generated]
    count = {op: sum(c.sku.op == op for c in gen) for op in ("quantize", "dequantize", "dynamic_quantize")}
    # quantize / dynamic: fp8 4 floats x 2 formats x 4 scopes x (sm80 + sm89 except f64) + int4 4 x 2 x 4 x 2 modes
    assert count == {"quantize": 56 + 64, "dequantize": 64 + 64, "dynamic_quantize": 56 + 64}
    for c in cells:
        s = c.sku
        fp8 = {s.element, s.aux_element} & {"fp8_e4m3", "fp8_e5m2"}
        if fp8 and s.mode == "asymmetric":
            assert not c.generated and "no zero point" in c.reason
        elif s.arch == "sm89" and not fp8:
            assert not c.generated and "int4" in c.reason
        elif s.arch == "sm89" and s.element == "f64":
            assert not c.generated and "f64" in c.reason
        else:
            assert c.generated, s


def test_lowbit_units(shipped_files):
    man = json.loads(shipped_files[manifest.MANIFEST])
    pre = render.prelude()
    header = render.header("common/lowbit.cuh")
    block_headers = {b.name: render.headers(b) for b in lowbit_blocks()}   # lowbit.cuh first, then the kernels'
    low_units = {u: m for u, m in man["units"].items() if m["block"].startswith("lowbit-")}
    assert len(low_units) == 68
    for unit, meta in low_units.items():
        text = shipped_files[unit]
        assert text.count("// ---- skuforge low-bit helpers") == 1
        assert text.index(pre) < text.index(header) < text.index("// SKU: ")
        archs = {KernelSku.parse(s).arch for s in meta["skus"]}
        assert archs == ({"sm89"} if unit.endswith("_sm89.cu") else {"sm80"}) and meta["min_arch"] == archs.pop()
        assert meta["nvrtc_options"] == ["--fmad=false"]
        # the instructions are used (instantiated) by sm89 kernels only: their fp8 codes are
        # lowbit::Fp8<format, true> (hardware conversion), the sm80 kernels' lowbit::Fp8<format, false>
        hw = re.findall(r"lowbit::Fp8<Fp8E[45]M[23], (true|false)>", text[text.index("// SKU: "):])
        sm89 = unit.endswith("_sm89.cu")
        assert ("true" in hw) == sm89 and set(hw) <= ({"true"} if sm89 else {"false"}), unit
    for sku, e in man["kernels"].items():
        if not _is_low(KernelSku.parse(sku)):
            continue
        text = shipped_files[e["unit"]]
        shares = e["launch"].get("shares") or {}              # the host SKUs whose entry points it launches
        own, *hosts = (_section(text, s) for s in (sku, *dict.fromkeys(shares.values())))
        assert render.sha256(pre + block_headers[man["units"][e["unit"]]["block"]] + own + "".join(hosts)) == e["sha256"]   # what it runs
        main = KernelSku.parse(shares["main"]).symbol if "main" in shares else e["symbol"]
        assert f" {main}(" in (hosts[0] if "main" in shares else own)
        kind = e["launch"]["kind"]
        s = KernelSku.parse(sku)
        if s.op == "dynamic_quantize":
            assert kind == ("lowbit_dynamic_fused" if s.scope in ("token", "group") else "dynamic_reduce")
        else:
            assert kind == "lowbit_elementwise" and e["launch"]["pack"] == (2 if {s.element, s.aux_element} & {"s4", "u4"} else 1)


def test_registry_source_includes_the_lowbit_helpers(shipped_registry):
    reg = shipped_registry
    sku = "quantization/quantize/group/symmetric/bf16/fp8_e4m3/sm89/simt/f32.acc-f32.det.stable"
    src = reg.source(sku)
    assert "// ---- end of low-bit helpers" in src and "// ---- end of helpers" in src
    assert src.count("// SKU: ") == 1 and "sf_quantize_group_symmetric_bf16_fp8_e4m3_sm89_simt(" in src
    s8 = "quantization/quantize/token/symmetric/bf16/s8/sm80/simt/f32.acc-f32.det.stable"
    assert "low-bit helpers" not in reg.source(s8)
    # Registry.select prefers the newest arch <= the device's: sm89 (hardware) on sm_90, sm80 on sm_80
    pick = dict(category="quantization", op="quantize", scope="token", mode="symmetric", element="bf16",
                aux_element="fp8_e5m2")
    assert reg.select(**pick, arch=90).arch == "sm89"
    assert reg.select(**pick, arch=80).arch == "sm80"
    assert reg.select(**dict(pick, aux_element="s4"), arch=90).arch == "sm80"


# -- NVRTC ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped_registry():
    """generated/ loaded as the runtime loads it (``python -m codegen check`` keeps it current)."""
    return Registry.load(manifest.GENERATED)


def _units():
    pre = render.prelude()
    return [(u.path, u.text(pre), min(int(k.cell.sku.arch[2:]) for k in u.kernels), u.block.nvrtc_options)
            for u in render.render(matrix.cells(LOWBIT_FAMILIES))]


# Every template branch at least once: each op x each kind (bf16), hardware and software units, the
# f64 software paths, the other floats; spread over sm_80 / sm_89 / sm_90.
SUBSET = {
    "quantization/quantize_bf16_fp8_e4m3.cu": 80, "quantization/quantize_bf16_fp8_e5m2_sm89.cu": 89,
    "quantization/quantize_f16_s4.cu": 90, "quantization/quantize_f64_u4.cu": 80,
    "quantization/quantize_f64_fp8_e5m2.cu": 90,
    "quantization/dequantize_fp8_e4m3_f64_sm89.cu": 90, "quantization/dequantize_fp8_e5m2_f32.cu": 80,
    "quantization/dequantize_s4_bf16.cu": 89, "quantization/dequantize_u4_f16.cu": 80,
    "quantization/dynamic_quantize_bf16_fp8_e4m3_sm89.cu": 89, "quantization/dynamic_quantize_f32_fp8_e5m2.cu": 90,
    "quantization/dynamic_quantize_bf16_s4.cu": 80, "quantization/dynamic_quantize_f64_u4.cu": 90,
}


def _compile(job):
    path, text, arch, options = job
    from runtime.compiler import nvrtc_compile
    try:
        cubin = nvrtc_compile(text, path, arch, options)
        return path, arch, None if cubin[:4] == b"\x7fELF" else "not an ELF cubin"
    except Exception as e:  # noqa: BLE001 - reported below
        return path, arch, str(e)[:3000]


def test_nvrtc_compiles_the_lowbit_kernels(shipped_registry):
    """The jobs ``python -m codegen compile --arch sm_80,sm_89,sm_90`` would run (a unit is built
    for every arch >= its kernels'), restricted to the low-bit units."""
    from codegen.cli import compile_jobs
    full = knobs.full_compile()
    reg = shipped_registry
    low = {u for u, m in reg.units.items() if m["block"].startswith("lowbit-")}
    assert set(SUBSET) <= low
    jobs = [j for j in compile_jobs(reg, [80, 89, 90]) if j[0] in low]
    assert len(jobs) == 184
    if not full:
        jobs = [j for j in jobs if SUBSET.get(j[0]) == j[2]]
        assert len(jobs) == len(SUBSET)
    with ProcessPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        failures = [(p, a, e) for p, a, e in pool.map(_compile, jobs) if e]
    assert not failures, "\n".join(f"{p} sm_{a}: {e}" for p, a, e in failures)


def test_sm89_units_do_not_build_for_sm80():
    # the reason they are units of their own: sm_80 has no fp8 conversion instructions
    from runtime.compiler import CompileError, nvrtc_compile
    path, text, _, options = next(u for u in _units() if u[0] == "quantization/quantize_bf16_fp8_e4m3_sm89.cu")
    with pytest.raises(CompileError):
        nvrtc_compile(text, path, 80, options)
