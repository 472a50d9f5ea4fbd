"""CPU tests of the moe category: matrix cells, manifest, NVRTC builds, typed errors before any
launch, plan selection (auto -> mma / simt), routing workspace and the float64 reference."""
import json
import re

import numpy as np
import pytest

import runtime as sf
from codegen.families import FAMILIES
from codegen.families.moe.blocks import (MOE_GEMM, MOE_GEMM_WGMMA, MOE_WGRAD, MOE_WGRAD_WGMMA, WGMMA_VARIANTS,
                                         wgmma_smem)
from runtime import InvalidProblemError, KernelSku, UnsupportedError
from runtime import reference_moe as ref
from runtime.arrays import ArrayRef
from runtime.plans import Plan
from runtime.moe.grouped import plan_for
from runtime.moe.problem import MoeArgs, Routing, mma_blockers, route_chunks, wgmma_blockers, workspace_layout
from tests.fakes import FakeDeviceArray as D
from tests.fakes import err

REG = sf.default_registry()
MOE = [s for s in REG.skus() if s.category == "moe"]


# -- matrix, manifest, sources ------------------------------------------------------------------
def test_matrix_cells_and_exclusions():
    moe, = [f for f in FAMILIES if f.name == "moe"]
    assert all(b in moe.blocks for b in (MOE_GEMM, MOE_WGRAD, MOE_GEMM_WGMMA, MOE_WGRAD_WGMMA))
    gen = {str(s) for s in MOE}
    assert len(MOE) == 27
    for op in ("grouped_matmul", "grouped_matmul_backward_input"):
        for el in ("f32", "f16", "bf16"):
            assert f"moe/{op}/-/-/{el}/-/sm80/simt/f32.acc-f32.det" in gen
        for el in ("f16", "bf16"):
            assert f"moe/{op}/-/-/{el}/-/sm80/mma/{el}.acc-f32.det" in gen
    assert "moe/grouped_matmul_backward_weight/-/-/bf16/f32/sm80/mma/bf16.acc-f32.det" in gen
    assert "moe/grouped_matmul_backward_weight/-/-/f16/-/sm80/simt/f32.acc-f32.det" in gen
    for op in ("grouped_matmul", "grouped_matmul_backward_input"):
        for el in ("f16", "bf16"):
            assert f"moe/{op}/-/-/{el}/-/sm90/wgmma/{el}.acc-f32.det" in gen
    for el in ("f16", "bf16"):
        for aux in ("f32", "-"):
            assert f"moe/grouped_matmul_backward_weight/-/-/{el}/{aux}/sm90/wgmma/{el}.acc-f32.det" in gen
    excluded = {str(s): r for s, r in REG.excluded.items() if s.category == "moe"}
    assert "tensor-core" in excluded["moe/grouped_matmul/-/-/f32/-/sm80/mma/f32.acc-f32.det"]
    assert "wgmma" in excluded["moe/grouped_matmul/-/-/f32/-/sm90/wgmma/f32.acc-f32.det"]
    assert "f64" in excluded["moe/grouped_matmul_backward_weight/-/-/f64/-/sm80/simt/f64.acc-f64.det"]
    for s in MOE:
        assert s.precision.accumulator == "f32" and s.precision.deterministic and not s.precision.bit_stable
        assert KernelSku.parse(str(s)) == s


def test_excluded_cells_give_typed_errors():
    with pytest.raises(UnsupportedError, match="f32 runs on simt|no 'mma' kernel"):
        REG.select(category="moe", op="grouped_matmul", element="f32", backend="mma")
    with pytest.raises(UnsupportedError, match="f64"):
        REG.lookup("moe/grouped_matmul/-/-/f64/-/sm80/simt/f64.acc-f64.det")


def test_manifest_launch_metadata_and_sources():
    for s in MOE:
        e = REG.lookup(s)
        assert e.launch["kind"] == "moe_gemm"
        src = REG.source(s)
        assert f"// SKU: {s}" in src
        for point in e.launch["entries"].values():
            assert f" {point['symbol']}(" in src
        assert f" {e.symbol}(" in src
        if s.backend == "mma":
            for ins in ("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned.m8n8.x4", "cp.async.cg.shared.global"):
                assert ins in src
            t = e.launch["tile"]
            assert e.launch["dynamic_smem"] == t["STAGES"] * (t["BM"] + t["BN"]) * t["BK"] * 2 <= 227 * 1024
        if s.backend == "wgmma":
            for ins in ("wgmma.mma_async.sync.aligned.m64n256k16.f32", "cp.async.bulk.tensor.2d", "mbarrier.try_wait",
                        "setmaxnreg.inc", "setmaxnreg.dec", "const __grid_constant__ CUtensorMap tmap_a"):
                assert ins in src
            assert "#include" not in src                     # header-free: inline PTX only
            assert e.unit.endswith("_sm90a.cu") and s.target == "sm_90a"
        assert "atomicAdd(counter" in src     # integer tile counter only: no float atomics
        assert not re.search(r"atomicAdd\((?!counter)", src)
    units = json.loads((REG.root / "manifest.json").read_text())["units"]
    assert units["moe/grouped_matmul_bf16.cu"]["nvrtc_options"] == []   # fmad on
    assert units["moe/grouped_matmul_bf16_sm90a.cu"]["nvrtc_options"] == ["--gpu-architecture=sm_90a"]


@pytest.mark.parametrize("arch", [80, 90])
def test_nvrtc_builds_mma_without_spills(arch):
    """The bf16 forward unit compiles for sm_80 / sm_90; ptxas reports no spills on any tile
    configuration of the mma kernel."""
    from runtime.compiler import resource_report
    unit = "moe/grouped_matmul_bf16.cu"
    rep = resource_report(REG.unit_source(unit), unit, arch, tuple(REG.units[unit]["nvrtc_options"]))
    e = REG.lookup("moe/grouped_matmul/-/-/bf16/-/sm80/mma/bf16.acc-f32.det")
    for name, meta in e.launch["variants"].items():
        r = rep[meta["symbol"]]
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r)
        assert r["registers"] <= 255


# -- typed errors before any launch ------------------------------------------------------------
X = D((32, 64), "float16")
W = D((4, 48, 64), "float16")
DY = D((32, 48), "float16")
IDS = D((32,), "int32")
OFF = D((5,), "int32")


def test_shape_and_dtype_errors():
    gm = sf.grouped_matmul
    err(lambda: gm(D((32, 63), "float16"), W, row_experts=IDS), InvalidProblemError, "mismatched K", "63", "64")
    err(lambda: gm(D((32, 64, 1), "float16"), W, row_experts=IDS), InvalidProblemError, "x must be 2-D")
    err(lambda: gm(X, D((48, 64), "float16"), row_experts=IDS), InvalidProblemError, "w must be 3-D")
    err(lambda: gm(X, D((4, 48, 64), "float32"), row_experts=IDS), InvalidProblemError, "w has dtype float32",
        "float16")
    err(lambda: gm(D((32, 64), "float64"), D((4, 48, 64), "float64"), row_experts=IDS), UnsupportedError,
        "f64", "float32, float16, bfloat16")
    err(lambda: gm(D((32, 64), "int8"), D((4, 48, 64), "int8"), row_experts=IDS), UnsupportedError, "x has dtype")
    err(lambda: gm(X, D((1025, 8, 64), "float16"), row_experts=IDS), UnsupportedError, "1025", "1024")
    err(lambda: gm(X, D((0, 8, 64), "float16"), row_experts=IDS), InvalidProblemError, "E = 0")
    err(lambda: gm(D((32, 0), "float16"), D((4, 8, 0), "float16"), row_experts=IDS), InvalidProblemError, "K >= 1")
    err(lambda: gm(D((32, 64), "float16", strides=(128, 2)), W, row_experts=IDS), InvalidProblemError,
        "contiguous last axis")
    err(lambda: gm(X, W, row_experts=IDS, strategy="cublas"), InvalidProblemError, "strategy", "auto, simt, mma")
    err(lambda: gm(np.zeros((32, 64), np.float16), W, row_experts=IDS), InvalidProblemError, "host array")


def test_routing_argument_errors():
    gm = sf.grouped_matmul
    err(lambda: gm(X, W), InvalidProblemError, "exactly one of row_experts", "neither")
    err(lambda: gm(X, W, row_experts=IDS, offsets=OFF), InvalidProblemError, "exactly one", "both")
    err(lambda: gm(X, W, row_experts=D((31,), "int32")), InvalidProblemError, "row_experts", "(32,)", "(31,)")
    err(lambda: gm(X, W, row_experts=D((32,), "int64")), InvalidProblemError, "row_experts", "i64", "int32")
    err(lambda: gm(X, W, row_experts=D((32,), "uint8")), InvalidProblemError, "row_experts", "u8", "int32")
    err(lambda: gm(X, W, row_experts=D((32, 1), "int32")), InvalidProblemError, "row_experts", "(32,)")
    err(lambda: gm(X, W, offsets=D((4,), "int32")), InvalidProblemError, "offsets", "(5,)", "(4,)")
    err(lambda: gm(X, W, offsets=D((5,), "float32")), InvalidProblemError, "offsets", "int32 or int64")
    err(lambda: gm(X, W, row_experts=D((32,), "int32", strides=(2,))), InvalidProblemError, "contiguous")


def test_backward_errors():
    bw = sf.grouped_matmul_backward
    err(lambda: bw(X, W, D((32, 47), "float16"), row_experts=IDS), InvalidProblemError, "dy must be [M, N]")
    err(lambda: bw(X, W, D((32, 48), "float32"), row_experts=IDS), InvalidProblemError, "dy has dtype float32")
    err(lambda: bw(X, W, None, row_experts=IDS), InvalidProblemError, "dy is None")
    err(lambda: bw(X, W, DY, row_experts=IDS, dw_dtype="int8"), UnsupportedError, "dw_dtype")
    err(lambda: bw(X, W, DY, row_experts=IDS, dw_dtype="bfloat16"), UnsupportedError, "dw_dtype", "float16")


# -- plan selection: auto picks mma when it can, simt otherwise --------------------------------
def _ref(shape, kind, ptr=0x7F0000000000, strides=None):
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    return ArrayRef(None, ptr, tuple(shape), tuple(strides), kind, 0, "cupy")


def _args(op, M, N, K, E, kind, ptr=0x7F0000000000, out_kind=None):
    x, w, dy = _ref((M, K), kind, ptr), _ref((E, N, K), kind), _ref((M, N), kind, ptr)
    shape = {"grouped_matmul": (M, N), "grouped_matmul_backward_input": (M, K),
             "grouped_matmul_backward_weight": (E, N, K)}[op]
    use = {"grouped_matmul": (x, w, None), "grouped_matmul_backward_input": (None, w, dy),
           "grouped_matmul_backward_weight": (x, None, dy)}[op]
    return MoeArgs(op, *use, _ref(shape, out_kind or kind), Routing(E, M, _ref((M,), "i32")), M, N, K, E)


@pytest.mark.parametrize("op", ["grouped_matmul", "grouped_matmul_backward_input", "grouped_matmul_backward_weight"])
def test_auto_strategy(op):
    out = "f32" if op.endswith("weight") else None
    # sm_90: wgmma for offsets routing, mma for row_experts (no row gather in the TMA kernels)
    assert plan_for(_offsets(_args(op, 64, 64, 64, 4, "bf16", out_kind=out)), "auto", 90).sku.backend == "wgmma"
    assert plan_for(_offsets(_args(op, 64, 64, 64, 4, "f16")), "auto", 90).sku.arch == "sm90"
    assert plan_for(_args(op, 64, 64, 64, 4, "bf16", out_kind=out), "auto", 90).sku.backend == "mma"
    for cc in (80, 89, 100):          # sm_90a machine code runs on sm_90 only
        assert plan_for(_offsets(_args(op, 64, 64, 64, 4, "bf16", out_kind=out)), "auto", cc).sku.backend == "mma"
    assert plan_for(_offsets(_args(op, 64, 64, 12, 4, "bf16", out_kind=out)), "auto", 90).sku.backend == "simt"
    assert plan_for(_offsets(_args(op, 0, 64, 64, 4, "bf16", out_kind=out)), "auto", 90).sku.backend == "mma"
    with pytest.raises(InvalidProblemError, match="row_experts.*offsets routing"):
        plan_for(_args(op, 64, 64, 64, 4, "bf16", out_kind=out), "wgmma", 90)
    with pytest.raises(UnsupportedError, match="sm_90a"):
        plan_for(_offsets(_args(op, 64, 64, 64, 4, "bf16", out_kind=out)), "wgmma", 80)
    assert plan_for(_args(op, 64, 64, 64, 4, "f16", out_kind=out), "auto", 80).sku.backend == "mma"
    assert plan_for(_args(op, 64, 64, 64, 4, "f32"), "auto", 90).sku.backend == "simt"
    assert plan_for(_args(op, 64, 7, 64, 4, "bf16", out_kind=out), "auto", 90).sku.backend == "simt"
    assert plan_for(_args(op, 64, 64, 3, 4, "bf16", out_kind=out), "auto", 90).sku.backend == "simt"
    assert plan_for(_args(op, 64, 64, 64, 4, "bf16", ptr=0x7F0000000002, out_kind=out), "auto", 90).sku.backend == "simt"
    with pytest.raises(InvalidProblemError, match="K = 12 is not a multiple of 8"):
        plan_for(_args(op, 64, 64, 12, 4, "bf16", out_kind=out), "mma", 90)
    with pytest.raises(UnsupportedError, match="mma"):
        plan_for(_args(op, 64, 64, 64, 4, "f32"), "mma", 90)
    p = plan_for(_args(op, 64, 64, 64, 4, "f16", out_kind=out), "simt", 90)
    assert p.sku.backend == "simt" and p.sku.op == op


def _offsets(args):
    args.routing = Routing(args.E, args.M, offsets=_ref((args.E + 1,), "i32"))
    return args


def test_wgmma_blockers_name_the_reason():
    a = _offsets(_args("grouped_matmul_backward_weight", 16, 64, 64, 2, "bf16", out_kind="f32"))
    assert wgmma_blockers(a) == []
    assert any("row_experts" in r for r in wgmma_blockers(_args("grouped_matmul", 16, 64, 64, 2, "bf16")))
    a.x = _ref((16, 64), "bf16", strides=(0, 1))                  # a broadcast row: no tensor map
    assert any(r.startswith("x:") and "row strides" in r for r in wgmma_blockers(a))
    a = _offsets(_args("grouped_matmul", 0, 64, 64, 2, "bf16"))
    assert any("extents" in r for r in wgmma_blockers(a))
    a = _offsets(_args("grouped_matmul", 16, 64, 60, 2, "bf16"))
    assert wgmma_blockers(a) == mma_blockers(a) != []


def test_mma_blockers_name_the_reason():
    a = _args("grouped_matmul", 16, 64, 64, 2, "bf16")
    assert mma_blockers(a) == []
    a.x = _ref((16, 64), "bf16", strides=(68, 1))
    assert any("row strides" in r for r in mma_blockers(a))


# -- routing workspace -------------------------------------------------------------------------
@pytest.mark.parametrize("M,E", [(0, 1), (1, 1024), (16384, 8), (100_000, 1024), (2**31, 8), (2**31, 1024)])
def test_route_chunks(M, E):
    chunks, rows = route_chunks(M, E)
    assert rows % 32 == 0 and chunks >= 1
    assert chunks * rows >= M and (chunks - 1) * rows < max(M, 1)
    assert (E + 1) * chunks <= max(65536 + E + 1, 8 * (E + 1))
    lay = workspace_layout(M, E, "row_experts")
    assert all(v % 256 == 0 for v in lay.values())
    assert lay["total"] >= 4 * M + 2 * 4 * (E + 1) * chunks
    assert workspace_layout(M, E, "offsets")["total"] < 256 * 4 + 16 * (E + 2) + 1024


# -- the float64 reference -----------------------------------------------------------------------
def test_reference_routing():
    ids = np.array([0, 3, -1, 2, 7, 1], np.int32)
    np.testing.assert_array_equal(ref.expert_of_rows(6, 4, row_experts=ids), [0, 3, -1, 2, -1, 1])
    u = np.array([0, 2**32 - 1, 2**31, 1], np.uint32)
    np.testing.assert_array_equal(ref.expert_of_rows(4, 2, row_experts=u), [0, -1, -1, 1])
    np.testing.assert_array_equal(ref.expert_of_rows(5, 3, offsets=np.array([0, 2, 2, 5])), [0, 0, 2, 2, 2])
    with pytest.raises(ValueError):
        ref.expert_of_rows(5, 3, offsets=np.array([0, 3, 2, 5]))


def test_reference_matches_a_loop(rng):
    M, N, K, E = 23, 5, 7, 3
    x, w, dy = rng.standard_normal((M, K)), rng.standard_normal((E, N, K)), rng.standard_normal((M, N))
    ids = rng.integers(-1, E + 1, M).astype(np.int32)
    y = ref.grouped_matmul(x, w, row_experts=ids)
    dx, dw = ref.grouped_matmul_backward(x, w, dy, row_experts=ids)
    for m in range(M):
        e = ids[m]
        ok = 0 <= e < E
        np.testing.assert_allclose(y[m], w[e] @ x[m] if ok else 0, atol=1e-12)
        np.testing.assert_allclose(dx[m], dy[m] @ w[e] if ok else 0, atol=1e-12)
    for e in range(E):
        rows = ids == e
        np.testing.assert_allclose(dw[e], np.einsum("mn,mk->nk", dy[rows], x[rows]), atol=1e-12)


def test_rel_error():
    a = np.ones((3, 3))
    assert ref.rel_error(a, a) == 0
    assert ref.rel_error(a * 1.01, a) == pytest.approx(0.01)
    b = a.copy()
    b[1, 1] = np.nan
    assert ref.rel_error(b, a) == float("inf")


# -- tile configurations (variants) ----------------------------------------------------------------
def test_wgmma_smem_fits_or_refuses():
    assert wgmma_smem(128, 256, 2, 8, 2) == 2 * 384 * 128 + 1024 + 2 * 8 * 8192 <= 227 * 1024 - 1024
    for bm, bn, stages, epi in WGMMA_VARIANTS.values():     # the shipped ones use the room the ring leaves
        with pytest.raises(ValueError):
            wgmma_smem(bm, bn, stages, epi + 1, 2)
    with pytest.raises(ValueError, match="staging boxes.*over the"):
        wgmma_smem(128, 256, 4, 3, 2)      # 4 stages leave room for two boxes a warpgroup, not three


def test_variants_in_manifest_and_sources():
    for s in MOE:
        e = REG.lookup(s)
        if s.backend == "simt":
            assert "variants" not in e.launch
            continue
        v = e.launch["variants"]
        if s.backend == "wgmma":
            assert set(v) == set(WGMMA_VARIANTS) == {"wg128x256s4", "wg128x128s6", "wg64x256s5"}
            assert v[e.launch["default_variant"]]["symbol"] == e.symbol
            src = REG.source(s)
            for name, meta in v.items():
                t = meta["tile"]
                assert f" {meta['symbol']}(" in src
                assert t["THREADS"] == 384 and t["BK"] == 64 and t["WN"] == (t["BN"] if t["BM"] == 128 else t["BN"] // 2)
                ring = t["STAGES"] * (t["BM"] + t["BN"]) * 64 * 2 + 1024
                assert meta["dynamic_smem"] == ring + 2 * t["EPI"] * 64 * 128 <= 227 * 1024 - 1024
                assert (t["BM"], t["BN"], t["STAGES"], t["EPI"]) == WGMMA_VARIANTS[name]
                body = src.split(f" {meta['symbol']}(", 1)[1].split("\n}\n", 1)[0]   # the variant's entry point
                assert f"WTile<{e.symbol}_ns::Sku, {t['BM']}, {t['BN']}, {t['STAGES']}, {t['EPI']}>" in body
            for key in ("short_variant", "narrow_variant"):
                assert e.launch.get(key, "wg128x128s6") in v
            continue
        assert "128x128x32s5" in v, "the first measured configuration stays selectable"
        default = e.launch["default_variant"]
        assert v[default]["symbol"] == e.symbol
        assert e.launch["tile"] == v[default]["tile"] and e.launch["dynamic_smem"] == v[default]["dynamic_smem"]
        src = REG.source(s)
        for name, meta in v.items():
            t = meta["tile"]
            assert f" {meta['symbol']}(" in src
            assert meta["symbol"] == e.symbol or meta["symbol"] == f"{e.symbol}__v{name}"
            assert t["THREADS"] == 32 * t["BM"] * t["BN"] // 4096 and t["PIPE"] in (0, 1, 2)
            assert meta["dynamic_smem"] == t["STAGES"] * (t["BM"] + t["BN"]) * t["BK"] * 2 <= 160 * 1024


def test_variant_selection(monkeypatch, override_settings):
    op = "grouped_matmul_backward_input"
    plan = plan_for(_args(op, 64, 64, 64, 4, "bf16"), "mma", 90)
    names = sf.moe.variant_names(plan)
    default = plan.launch["default_variant"]
    other = next(n for n in names if n != default)
    override_settings(moe_config="")
    assert sf.moe.variant_for(plan, op)[0] == default
    override_settings(moe_config=other)
    assert sf.moe.variant_for(plan, op)[0] == other
    override_settings(moe_config=f"fwd={default}, dgrad={other}")
    assert sf.moe.variant_for(plan, op)[0] == other
    override_settings(moe_config=f"wgrad={other}")
    assert sf.moe.variant_for(plan, op)[0] == default
    with sf.moe.use_config(dgrad="128x128x32s5"):     # CONFIG wins over the environment
        assert sf.moe.variant_for(plan, op)[0] == "128x128x32s5"
        assert sf.moe.variant_for(plan, op)[1]["tile"]["BM"] == 128
    assert sf.moe.CONFIG == {}
    override_settings(moe_config="nope")
    err(lambda: sf.moe.variant_for(plan, op), InvalidProblemError, "'nope'", "128x128x32s5")
    override_settings(moe_config="bwd=x")
    err(lambda: sf.moe.variant_for(plan, op), InvalidProblemError, "'bwd'", "fwd, dgrad, wgrad")
    override_settings(moe_config="default")
    assert sf.moe.variant_for(plan, op)[0] == default
    wg = "grouped_matmul_backward_weight"
    wplan = plan_for(_args(wg, 64, 64, 64, 4, "bf16", out_kind="f32"), "mma", 90)
    override_settings(moe_config="")
    assert "short_variant" not in wplan.launch          # the switch is off in the shipped matrix
    monkeypatch.setitem(wplan.launch, "short_variant", "128x128x32s5p")
    monkeypatch.setitem(wplan.launch, "short_rows", 1024)
    short, rows = wplan.launch["short_variant"], wplan.launch["short_rows"]
    assert sf.moe.variant_for(wplan, wg, rows_per_expert=rows - 1)[0] == short
    assert sf.moe.variant_for(wplan, wg, rows_per_expert=rows)[0] == wplan.launch["default_variant"]
    with sf.moe.use_config(wgrad="128x256x32s4"):
        assert sf.moe.variant_for(wplan, wg, rows_per_expert=1)[0] == "128x256x32s4"
    simt = plan_for(_args(op, 64, 64, 64, 4, "f32"), "simt", 90)
    assert sf.moe.variant_names(simt) == ["default"]
    assert sf.moe.variant_for(simt, op)[1]["symbol"] == simt.entry.symbol


def test_variant_fallback_on_small_shared_memory(fake_device, override_settings):
    op = "grouped_matmul"
    plan = plan_for(_args(op, 64, 64, 64, 4, "bf16"), "mma", 90)
    override_settings(moe_config="")
    fake_device.props[7] = {"smem_optin": 100 * 1024}            # e.g. sm_86 / sm_89: 99-100 KB per block
    name, meta = sf.moe.variant_for(plan, op, 7)
    assert meta["dynamic_smem"] <= 96 * 1024
    big = max(plan.launch["variants"], key=lambda n: plan.launch["variants"][n]["dynamic_smem"])
    with sf.moe.use_config(big):
        err(lambda: sf.moe.variant_for(plan, op, 7), InvalidProblemError, big, "shared memory")


def test_out_and_workspace_are_checked(monkeypatch):
    """out= / workspace= errors name the argument, the value and what is expected, before any launch."""
    x, w, dy = D((32, 64), "float16", ptr=0x7F0000000000), D((4, 48, 64), "float16", ptr=0x7F0000100000), \
        D((32, 48), "float16", ptr=0x7F0000200000)
    off = D((5,), "int32", ptr=0x7F0000300000)
    gm, bw = sf.grouped_matmul, sf.grouped_matmul_backward
    y = 0x7F0000400000
    err(lambda: gm(x, w, offsets=off, out=D((32, 47), "float16", ptr=y)), InvalidProblemError, "out", "(32, 47)",
        "(32, 48)")
    err(lambda: gm(x, w, offsets=off, out=D((32, 48), "float32", ptr=y)), InvalidProblemError, "out", "float32",
        "float16")
    err(lambda: gm(x, w, offsets=off, out=D((32, 48), "float16", strides=(96, 1), ptr=y)), InvalidProblemError,
        "out", "C-contiguous", "(96, 1)")
    err(lambda: gm(x, w, offsets=off, out=np.zeros((32, 48), np.float16)), InvalidProblemError, "out", "host array")
    err(lambda: gm(x, w, offsets=off, out=D((32, 48), "float16", ptr=0x7F0000000040)), InvalidProblemError,
        "out overlaps x")
    err(lambda: gm(x, w, offsets=off, out=D((32, 48), "float16", ptr=0x7F0000300000)), InvalidProblemError,
        "out overlaps offsets")
    # the backward: (dx, dw), None exactly for a gradient not asked for
    dx, dw = D((32, 64), "float16", ptr=y), D((4, 48, 64), "float32", ptr=0x7F0000500000)
    err(lambda: bw(x, w, dy, offsets=off, out=dx), InvalidProblemError, "out=", "(dx, dw)")
    err(lambda: bw(x, w, dy, offsets=off, out=(dx, None)), InvalidProblemError, "out[1] (dw) is None",
        "need_weight=True")
    err(lambda: bw(x, w, dy, offsets=off, need_input=False, out=(dx, dw)), InvalidProblemError,
        "out[0] (dx) is given", "need_input=False")
    err(lambda: bw(x, w, dy, offsets=off, out=(dx, D((4, 48, 64), "float16", ptr=0x7F0000500000))),
        InvalidProblemError, "out[1] (dw)", "float16", "float32", "dw_dtype")
    err(lambda: bw(x, w, dy, offsets=off, out=(D((32, 48), "float16", ptr=y), dw)), InvalidProblemError,
        "out[0] (dx)", "(32, 48)", "(32, 64)")
    err(lambda: bw(x, w, dy, offsets=off, out=(dx, D((4, 48, 64), "float32", ptr=y + 1024))), InvalidProblemError,
        "out[0] (dx) overlaps out[1] (dw)")
    err(lambda: bw(x, w, dy, offsets=off, out=(D((32, 64), "float16", ptr=0x7F0000200000), dw)),
        InvalidProblemError, "out[0] (dx) overlaps dy")
    # the workspace
    need = sf.moe.grouped_matmul_workspace_size(32, 4, "offsets")
    assert need == workspace_layout(32, 4, "offsets")["total"]
    assert sf.moe.grouped_matmul_workspace_size(32, 4) == workspace_layout(32, 4, "row_experts")["total"]
    err(lambda: sf.moe.grouped_matmul_workspace_size(32, 4, "sorted"), InvalidProblemError, "routing", "offsets")
    wsp = 0x7F0000600000
    err(lambda: gm(x, w, offsets=off, workspace=D((need - 1,), "uint8", ptr=wsp)), InvalidProblemError,
        "workspace", str(need - 1), str(need), "grouped_matmul_workspace_size")
    err(lambda: gm(x, w, offsets=off, workspace=D((need,), "int32", ptr=wsp)), InvalidProblemError,
        "workspace", "int32", "uint8")
    err(lambda: gm(x, w, offsets=off, workspace=D((need,), "uint8", ptr=wsp + 8)), InvalidProblemError,
        "workspace", "16-byte aligned")
    err(lambda: gm(x, w, offsets=off, workspace=D((need,), "uint8", ptr=0x7F0000100100)), InvalidProblemError,
        "workspace overlaps w")
    err(lambda: bw(x, w, dy, offsets=off, out=(dx, dw), workspace=D((need,), "uint8", ptr=0x7F0000500000)),
        InvalidProblemError, "out[1] (dw) overlaps workspace")
    # framework and device (ArrayRef descriptions: no second framework or device needed)
    from runtime.moe import grouped as moe_mod
    monkeypatch.setattr(moe_mod, "as_array", lambda obj, arg: obj)
    like = _ref((32, 48), "f16")
    torch_out = ArrayRef(None, 0x7F0000400000, (32, 48), (48, 1), "f16", 0, "torch")
    err(lambda: moe_mod._given_out(torch_out, like, (32, 48), "f16", "out"), InvalidProblemError,
        "out is a torch array", "CuPy")
    other = ArrayRef(None, 0x7F0000400000, (32, 48), (48, 1), "f16", 1, "cupy")
    err(lambda: moe_mod._given_out(other, like, (32, 48), "f16", "out"), InvalidProblemError, "out", "cuda:1",
        "cuda:0")
    ws_other = ArrayRef(None, 0x7F0000400000, (need,), (1,), "u8", 1, "cupy")
    err(lambda: moe_mod._given_workspace(ws_other, like, 32, 4, "offsets"), InvalidProblemError, "workspace",
        "cuda:1")


def test_run_into_is_gone():
    assert not hasattr(sf.moe, "run_into")      # out= of grouped_matmul / _backward replaces it


def test_mma_blockers_large_extents():
    a = _args("grouped_matmul", 16, 64, 2**31, 2, "bf16")
    assert any("2**31" in r for r in mma_blockers(a))


# -- device-side report of invalid offsets (runtime/status.py) --------------------------------------
def _c_params(src, symbol):
    """The C parameter list of an extern "C" kernel, as struct format letters."""
    sig = re.search(re.escape(symbol) + r"\((.*?)\)\s*\{", src, re.S).group(1)
    out = ""
    for p in sig.split(","):
        p = p.strip()
        out += "Q" if "*" in p else {"i64_t": "q", "int": "i"}[p.split()[0]]
    return out


def test_offsets_routing_reports_to_the_status_word():
    """The offsets entry points take the status word last and write status.code(op, "offsets")
    for the SKU's own op; the launcher's format matches the signature."""
    from runtime import status
    for s in MOE:
        src = REG.source(s)
        code = status.code(s.op, "offsets")
        for kind in ("i32", "i64"):
            sym = f"{REG.lookup(s).symbol}_route_offsets_{kind}"
            fmt = _c_params(src, sym)
            assert Plan(s).abi(f"route_offsets_{kind}").fmt == fmt
            call = src[src.index(sym + "("):]
            call = call[:call.index("\n}")]
            assert call.split("{", 1)[0].rstrip().endswith("u32_t* status)")
            assert f"{code}u" in call and "trusted, ws_status" in call
        assert "if (bad && !trusted && report) *(volatile u32_t*)report = bad_code;" in src
        assert Plan(s).abi("route_offsets_i32").names[-1] == "status"


def test_route_passes_the_status_word(fake_device):
    """MoeLauncher.route_steps hands args.status to the offsets entry point (and trusted as a flag)."""
    from runtime.moe import grouped as moe
    args = _args("grouped_matmul", 64, 32, 32, 4, "f16")
    args.routing = Routing(4, 64, offsets=_ref((5,), "i64"), trusted=False)
    args.status = 0x7E0000000004
    plan = plan_for(args, "simt", 80)
    ws = _ref((moe.workspace_layout(64, 4, "offsets")["total"],), "u8", 0x7F0000200000)
    (step,) = plan.launcher.route_steps(plan, args, ws, 64)
    prep = step.prep
    abi = plan.abi("route_offsets_i64")
    assert prep.fn.endswith("_route_offsets_i64") and prep.fmt == abi.fmt
    assert prep.values[abi.slot["status"]] == 0x7E0000000004 and prep.values[abi.slot["trusted"]] == 0
    assert {(j, off) for j, _, off in step.refs} == {
        (abi.slot["off"], 0), (abi.slot["ws_status"], 0), (abi.slot["row_start"], moe.workspace_layout(64, 4, "offsets")["row_start"]),
        (abi.slot["tile_start"], moe.workspace_layout(64, 4, "offsets")["tile_start"]),
        (abi.slot["counters"], moe.workspace_layout(64, 4, "offsets")["counters"])}
    import struct
    struct.pack("@" + prep.fmt, *prep.values)


def test_moe_ops_raise_pending_reports_before_launching(fake_device, monkeypatch):
    """grouped_matmul / _backward (with and without out=) read the status word before anything launches."""
    from runtime import status
    from runtime.moe import grouped as moe
    fake_device.props[0] = {"cc": 80}
    words = status.words()
    status.pointer(0)                           # allocated
    ran = []
    monkeypatch.setattr(moe.MoeLauncher, "steps", lambda self, plan, args, ws: ran.append(args.status) or [])
    x, w, dy = D((64, 32), "float16"), D((4, 32, 32), "float16"), D((64, 32), "float16")
    offs = D((5,), "int64")
    calls = [lambda: sf.grouped_matmul(x, w, offsets=offs, strategy="simt"),
             lambda: sf.grouped_matmul_backward(x, w, dy, offsets=offs, strategy="simt"),
             lambda: sf.grouped_matmul(x, w, offsets=offs, strategy="simt",
                                       out=D((64, 32), "float16", ptr=0x7F0000100000))]
    for call in calls:
        words.words[0] = status.code("grouped_matmul", "offsets")
        with pytest.raises(sf.DeviceValueError) as ei:
            call()
        assert (ei.value.op, ei.value.arg) == ("grouped_matmul", "offsets") and not ran
        call()                                  # reported once
        assert ran and set(ran) == {status.pointer(0)}
        ran.clear()


def test_trusted_is_gone_and_trusted_offsets_skips_validation():
    assert not hasattr(sf, "trusted")
    r = sf.moe.grouped._prepare("grouped_matmul", D((8, 16), "float32"), D((2, 4, 16), "float32"), None, None,
                        D((3,), "int32"), True, "simt")[3]
    assert r.trusted and r.mode == "offsets"


# -- the wgmma backend: tile rule, arch-specific build, machine code --------------------------------
def test_wgmma_tile_rule(override_settings):
    """Experts averaging fewer than short_rows rows -> 64-row tiles; narrow outputs -> 128x128; else the
    default; a configuration asked for wins, a name of another backend's configuration leaves wgmma on its
    rule, an unknown name is an error naming the wgmma configurations."""
    override_settings(moe_config="")
    op = "grouped_matmul"
    plan = plan_for(_offsets(_args(op, 64, 64, 64, 4, "bf16")), "wgmma", 90)
    rule = plan.launch
    assert sf.moe.variant_for(plan, op, None, 32.0, 4096)[0] == rule["short_variant"] == "wg64x256s5"
    assert sf.moe.variant_for(plan, op, None, 128.0, 4096)[0] == "wg64x256s5"      # 128 rows: 64-row tiles
    assert sf.moe.variant_for(plan, op, None, 192.0, 4096)[0] == "wg128x256s4"
    assert sf.moe.variant_for(plan, op, None, 2048.0, 4096)[0] == rule["default_variant"] == "wg128x256s4"
    assert sf.moe.variant_for(plan, op, None, 2048.0, 128)[0] == rule["narrow_variant"] == "wg128x128s6"
    with sf.moe.use_config(fwd="wg128x128s6"):
        assert sf.moe.variant_for(plan, op, None, 16.0, 4096)[0] == "wg128x128s6"
    with sf.moe.use_config("128x128x32s5"):            # an mma configuration: wgmma keeps its rule
        assert sf.moe.variant_for(plan, op, None, 16.0, 4096)[0] == "wg64x256s5"
        mma = plan_for(_args(op, 64, 64, 64, 4, "bf16"), "mma", 90)
        assert sf.moe.variant_for(mma, op)[0] == "128x128x32s5"
    override_settings(moe_config="fwd=wg12x34s5")
    err(lambda: sf.moe.variant_for(plan, op), InvalidProblemError, "'wg12x34s5'", "wg128x256s4")
    wplan = plan_for(_offsets(_args("grouped_matmul_backward_weight", 64, 64, 64, 4, "bf16", out_kind="f32")),
                     "wgmma", 90)
    override_settings(moe_config="")
    wg = "grouped_matmul_backward_weight"
    assert sf.moe.variant_for(wplan, wg, None, 8.0, 4096)[0] == "wg128x256s4"   # no short rule for dw
    assert sf.moe.variant_for(wplan, wg, None, 8.0, 96)[0] == "wg128x128s6"


def test_wgmma_units_are_built_for_sm_90a_only():
    """The wgmma units name their target (sm_90a): compiled for sm_90 only, and the registry offers
    their SKUs to compute capability 9.0 only."""
    from codegen.cli import compile_jobs
    from runtime.compiler import builds_for, full_options, pinned_target
    opts = REG.units["moe/grouped_matmul_bf16_sm90a.cu"]["nvrtc_options"]
    assert pinned_target(opts) == "sm_90a" and builds_for(opts, 90) and not builds_for(opts, 100)
    assert full_options(90, opts).count("--gpu-architecture=sm_90a") == 1
    assert not any(o.startswith("--gpu-architecture") for o in full_options(90, ())[1:])
    jobs = compile_jobs(REG, [80, 90, 100], "moe/grouped_matmul/*/bf16/*")
    assert {(u, a) for u, _, a, _ in jobs if u.endswith("_sm90a.cu")} == {("moe/grouped_matmul_bf16_sm90a.cu", 90)}
    assert sum(1 for u, _, a, _ in jobs if u == "moe/grouped_matmul_bf16.cu") == 3
    pick = lambda cc, b=None: REG.select(category="moe", op="grouped_matmul", element="bf16", arch=cc, backend=b)  # noqa: E731
    assert pick(90).backend == "wgmma" and pick(100).backend == "mma" and pick(89).backend == "mma"
    with pytest.raises(UnsupportedError, match="sm_90a"):
        pick(100, "wgmma")


WGMMA_UNITS = ["moe/grouped_matmul_bf16_sm90a.cu", "moe/grouped_matmul_backward_input_f16_sm90a.cu",
               "moe/grouped_matmul_backward_weight_bf16_f32_sm90a.cu", "moe/grouped_matmul_backward_weight_f16_sm90a.cu"]


def _sass_by_function(cubin: bytes) -> dict:
    """{kernel: SASS text} of a cubin (tools/sass_diff.py: the cuobjdump of the nvidia-cuda-cuobjdump wheel)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("sass_diff", Path(__file__).resolve().parents[2] / "tools" /
                                                  "sass_diff.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    try:
        objdump = tool.cuobjdump()
    except SystemExit:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump)")
    return {name: "\n".join(lines) for name, lines in tool.sass(cubin, objdump).items()}


@pytest.mark.parametrize("unit", WGMMA_UNITS)
def test_wgmma_machine_code(unit):
    """Every wgmma kernel compiles for sm_90a without spills or a stack frame, at 168 registers at
    entry (384 threads, one block per SM: what setmaxnreg redistributes as 40 / 232), and its machine
    code holds warpgroup MMAs (HGMMA), tensor-map loads and stores (UTMALDG, UTMASTG), the register
    reallocation and no local-memory access."""
    from runtime.compiler import compile_with_report
    cubin, rep = compile_with_report(REG.unit_source(unit), unit, 90, tuple(REG.units[unit]["nvrtc_options"]))
    sass = _sass_by_function(cubin)
    skus = [s for s in REG.units[unit]["skus"]]
    assert len(skus) == 1
    e = REG.lookup(skus[0])
    tnsp = {"grouped_matmul": "", "grouped_matmul_backward_input": ".tnspB",
            "grouped_matmul_backward_weight": ".tnspA.tnspB"}[e.sku.op]
    for name, meta in e.launch["variants"].items():
        sym = meta["symbol"]
        r = rep[sym]
        assert (r["stack"], r["spill_stores"], r["spill_loads"], r["registers"]) == (0, 0, 0, 168), (name, r)
        code = sass[sym]
        n = meta["tile"]["WN"]
        assert re.search(rf"HGMMA\.64x{n}x16\.F32(\.BF16)? .*gdesc\[UR\d+\]{re.escape(tnsp)},", code), name
        assert "UTMALDG" in code and "UTMASTG" in code and "USETMAXREG" in code and "SYNCS" in code, name
        assert not re.search(r"\b(LDL|STL)\b", code), name
