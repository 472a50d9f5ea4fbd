"""The MoE family's matrix: grouped matmul forward and backward blocks (simt, mma, wgmma), their tile
configurations and rendering contexts (docs/moe.md)."""
from __future__ import annotations

from dataclasses import dataclass

from runtime import kinds
from runtime.axes import PASSES
from runtime.sku import KernelSku, Precision

from ...spec import Block, Exclusion
from .launch import MOE_GEMM as MOE_GEMM_LAUNCH
from .launch import ROUTE_THREADS, ROUTE_WARPS

# -- MoE grouped matmul (docs/moe.md) --------------------------------------------------------
MOE_FLOATS = ("f32", "f16", "bf16", "f64")
# Tile shape of each backend: the templates static_assert the shapes their fragment maps assume.
MOE_TILES = {
    "simt": {"BM": 64, "BN": 64, "BK": 16, "STAGES": 1, "THREADS": 256, "MIN_BLOCKS": 0},
    "mma": {"BM": 128, "BN": 128, "BK": 32, "STAGES": 5, "THREADS": 128, "MIN_BLOCKS": 0},
}

# wgmma tile configurations (templates/moe/wgmma.cuh), name: (BM, BN, STAGES, EPI); BK = 64 (one
# 128-byte swizzle row of 16-bit elements). One producer warpgroup (TMA) and two consumer warpgroups:
# with BM = 128 each consumer takes 64 rows and all BN columns, with BM = 64 each takes the 64 rows
# and half of the columns. Shared memory: the ring, STAGES * (BM + BN) * 64 * 2 bytes, + WGMMA_ALIGN
# to place it on a 1024-byte boundary (the 128-byte swizzle needs it), then EPI output staging boxes
# of 64 rows x 128 bytes per consumer warpgroup (two where the ring leaves room; more do not pay:
# docs/perf-notes.md).
WGMMA_VARIANTS = {
    "wg128x256s4": (128, 256, 4, 2),
    "wg128x128s6": (128, 128, 6, 2),
    "wg64x256s5": (64, 256, 5, 1),
}
WGMMA_DEFAULT = "wg128x256s4"
WGMMA_ALIGN = 1024
WGMMA_OUT_BOX = 64 * 128            # one staged output box (bytes)
WGMMA_CONSUMERS = 2                 # consumer warpgroups, each with its own staging boxes
WGMMA_STATIC_SMEM = 1024            # the static shared memory of a wgmma kernel (ptxas: the barriers, aligned)
MMA_STATIC_SMEM = 4096              # at most, of an mma / simt kernel (row table and tile slot)
WGMMA_SMEM_LIMIT = 227 * 1024 - WGMMA_STATIC_SMEM   # dynamic shared memory of a block on sm_90


def wgmma_smem(bm: int, bn: int, stages: int, epi: int, size: int) -> int:
    """Dynamic shared memory bytes of a wgmma tile: the ring, its alignment, the staging boxes."""
    smem = stages * (bm + bn) * 64 * size + WGMMA_ALIGN + WGMMA_CONSUMERS * epi * WGMMA_OUT_BOX
    if smem > WGMMA_SMEM_LIMIT:
        raise ValueError(f"wgmma tile {bm}x{bn}, {stages} stages, {epi} staging boxes: {smem} bytes of shared "
                         f"memory, over the {WGMMA_SMEM_LIMIT} a block may have")
    return smem
# The documented choice (runtime/moe/grouped.py variant_for; docs/moe.md): experts averaging fewer than
# ``short_rows`` rows take ``short_variant`` (64-row tiles waste less on partial m-tiles; measured on
# an H200: best at 32 rows per expert, and at 128 balanced rows 2-3 % ahead of 128-row tiles, 5 %
# behind them at 128 rows skewed, where both stay above 1.2x torch: docs/moe.md); an output
# ``narrow_cols`` columns wide or less (N for the forward, K for the input gradient and the weight
# gradient) takes ``narrow_variant``; otherwise the default.
WGMMA_RULE = {
    "fwd": {"short_variant": "wg64x256s5", "short_rows": 160, "narrow_variant": "wg128x128s6", "narrow_cols": 128},
    "dgrad": {"short_variant": "wg64x256s5", "short_rows": 160, "narrow_variant": "wg128x128s6", "narrow_cols": 128},
    "wgrad": {"narrow_variant": "wg128x128s6", "narrow_cols": 128},
}


def _moe_context(cell, ctx):
    """Tile shape, storage types, the routing entry points (``<symbol>_route_*``) and, for mma,
    the tile configurations compiled into the SKU's text (``launch["variants"]``): the default
    is the SKU's symbol, the others ``<symbol>__v<name>``, chosen at launch (runtime/moe/grouped.py,
    ``SKUFORGE_MOE_CONFIG``) without recompiling."""
    sku = cell.sku
    # name: (BM, BN, BK, STAGES, PIPE). Warps of 64 x 64 outputs: THREADS = 32 * BM * BN / 4096.
    # PIPE (templates/moe/mma.cuh mainloop): 0 copies of the next slice before the mma,
    # 1 ("i") interleaved with the mma, 2 ("p") interleaved and fragments double-buffered.
    mma_variants = {
        "128x128x32s5": (128, 128, 32, 5, 0),    # the first configuration measured
        "128x128x32s5i": (128, 128, 32, 5, 1),
        "128x128x32s5p": (128, 128, 32, 5, 2),
        "128x256x32s4": (128, 256, 32, 4, 0),
        "128x256x32s4i": (128, 256, 32, 4, 1),
        "128x256x32s4p": (128, 256, 32, 4, 2),
        "128x256x32s6p": (128, 256, 32, 6, 2),
        "128x256x64s3p": (128, 256, 64, 3, 2),
        "256x128x32s4p": (256, 128, 32, 4, 2),
    }
    # Defaults: the best minimum over the six benchmark shapes of tools/probe_moe.py on an H200
    # (docs/moe.md): fwd and dgrad 128x256x64s3p (57.8% / 55.0% of torch._grouped_mm),
    # wgrad 128x128x32s5 (51.0%).
    mma_default = {"fwd": "128x256x64s3p", "dgrad": "128x256x64s3p", "wgrad": "128x128x32s5"}
    opkind = PASSES[sku.op]
    out_kind = sku.aux_element or sku.element
    size = kinds.SIZE[sku.element]
    rules = {}
    if sku.backend == "wgmma":
        variants = []
        for name, (bm, bn, stages, epi) in WGMMA_VARIANTS.items():
            smem = wgmma_smem(bm, bn, stages, epi, size)
            tile = {"BM": bm, "BN": bn, "BK": 64, "STAGES": stages, "THREADS": 384, "MIN_BLOCKS": 1,
                    "WN": bn if bm == 128 else bn // 2, "EPI": epi}
            variants.append({"name": name, "symbol": sku.symbol if name == WGMMA_DEFAULT else f"{sku.symbol}__v{name}",
                             "tile": tile, "dynamic_smem": smem, "static_smem": WGMMA_STATIC_SMEM})
        variants.sort(key=lambda v: v["name"] != WGMMA_DEFAULT)
        rules = dict(WGMMA_RULE[opkind])
    elif sku.backend == "mma":
        default = mma_default[opkind]
        variants = []
        for name in [default] + [n for n in mma_variants if n != default]:
            bm, bn, bk, stages, pipe = mma_variants[name]
            tile = {"BM": bm, "BN": bn, "BK": bk, "STAGES": stages, "THREADS": 32 * bm * bn // 4096,
                    "MIN_BLOCKS": 0, "PIPE": pipe}
            variants.append({"name": name, "symbol": sku.symbol if name == default else f"{sku.symbol}__v{name}",
                             "tile": tile, "dynamic_smem": stages * (bm + bn) * bk * size,
                             "static_smem": MMA_STATIC_SMEM})
    else:
        tile = dict(MOE_TILES[sku.backend])
        variants = [{"name": "default", "symbol": sku.symbol, "tile": tile, "dynamic_smem": 0,
                     "static_smem": MMA_STATIC_SMEM}]
    tile, smem = variants[0]["tile"], variants[0]["dynamic_smem"]
    launch = {"block_threads": tile["THREADS"], "tile": tile, "dynamic_smem": smem,
              "static_smem": variants[0]["static_smem"],
              "out": out_kind, "route_threads": ROUTE_THREADS, "route_warps": ROUTE_WARPS}
    if sku.backend in ("mma", "wgmma"):
        launch["default_variant"] = variants[0]["name"]
        launch["variants"] = {v["name"]: {k: v[k] for k in ("symbol", "tile", "dynamic_smem", "static_smem")}
                              for v in variants}
        launch.update(rules)
    return {
        "ns": sku.symbol + "_ns", "T": kinds.CTYPE[sku.element], "OUT": kinds.CTYPE[out_kind], "out_kind": out_kind,
        "opkind": opkind, "tile": tile, "variants": variants, "route_threads": ROUTE_THREADS,
        "route_warps": ROUTE_WARPS, "launch": launch,
        "wgmma_n": sorted({v["tile"]["WN"] for v in variants}) if sku.backend == "wgmma" else [],
    }


def _moe_precision(op, scope, mode, el, aux, arch, backend):
    # mma / wgmma multiply the f16/bf16 inputs as they are (exact products) into fp32 accumulators.
    math = el if backend in ("mma", "wgmma") and el in kinds.HALF else kinds.math_kind(el)
    return Precision(math, "f64" if el == "f64" else "f32", deterministic=True, bit_stable=False)


_MOE_EXCLUSIONS = (
    Exclusion("f64 grouped matmul is not offered: grouped matmul takes f32, f16 and bf16 (docs/numerics.md)",
              lambda s: s.element == "f64"),
    Exclusion("the tensor-core (mma) path takes f16/bf16 inputs with fp32 accumulation; f32 runs on simt",
              lambda s: s.backend == "mma" and s.element == "f32"),
    Exclusion("the Hopper tensor-core (wgmma) path takes f16/bf16 inputs with fp32 accumulation; f32 runs on simt",
              lambda s: s.backend == "wgmma" and s.element == "f32"),
)


@dataclass(frozen=True)
class ArchSpecificBlock(Block):
    """Cells built for an arch-specific target (``sm_90a``: wgmma, setmaxnreg): units of their own
    (``..._sm90a.cu``) whose NVRTC options name the target, so that they are compiled for it and for
    no other arch (runtime.compiler.pinned_target), and the Hopper helpers in their units."""

    target: str = "sm_90a"
    headers: tuple = ("common/hopper.cuh",)

    def unit(self, sku: KernelSku) -> str:
        return f"{super().unit(sku)[:-3]}_{self.target.replace('_', '')}.cu"

# The device code (templates/moe/*.cuh): the problem and the routing prologue of every SKU, then the
# backends' bodies; the wgmma body (sm_90a units only) goes with the Hopper helpers.
MOE_SHARED_HEADERS = ("moe/problem.cuh", "moe/routing.cuh")
MOE_HEADERS = (*MOE_SHARED_HEADERS, "moe/simt.cuh", "moe/mma.cuh")

MOE_GEMM = Block(
    name="moe-grouped-matmul",
    category="moe",
    ops=("grouped_matmul", "grouped_matmul_backward_input"),
    template="moe/grouped_matmul.cu.j2",
    headers=MOE_HEADERS,
    pairs=tuple((el, None) for el in MOE_FLOATS),
    backends=("simt", "mma"),
    launch=MOE_GEMM_LAUNCH,
    nvrtc_options=(),            # fmad on: grouped matmul is not bit-exact with NumPy (tolerances: docs/numerics.md)
    exclusions=_MOE_EXCLUSIONS,
    extra_context=_moe_context,
    precision=_moe_precision,
)

# dw is float32 by default (aux f32 for f16/bf16 inputs), or the input dtype on request (aux None).
MOE_WGRAD = Block(
    name="moe-grouped-matmul-wgrad",
    category="moe",
    ops=("grouped_matmul_backward_weight",),
    template="moe/grouped_matmul.cu.j2",
    headers=MOE_HEADERS,
    pairs=(("f32", None), ("f16", "f32"), ("f16", None), ("bf16", "f32"), ("bf16", None), ("f64", None)),
    backends=("simt", "mma"),
    launch=MOE_GEMM_LAUNCH,
    nvrtc_options=(),
    exclusions=_MOE_EXCLUSIONS,
    extra_context=_moe_context,
    precision=_moe_precision,
)

# The Hopper backend (docs/moe.md): warp-specialised wgmma + TMA kernels, built for sm_90a only.
MOE_GEMM_WGMMA, MOE_WGRAD_WGMMA = (
    ArchSpecificBlock(name=f"{fam.name}-wgmma", category="moe", ops=fam.ops, template=fam.template,
                       headers=("common/hopper.cuh", *MOE_SHARED_HEADERS, "moe/wgmma.cuh"),
                       pairs=tuple(p for p in fam.pairs if p[0] != "f64"), arches=("sm90",), backends=("wgmma",),
                       launch=MOE_GEMM_LAUNCH, nvrtc_options=("--gpu-architecture=sm_90a",), exclusions=_MOE_EXCLUSIONS,
                       extra_context=_moe_context, precision=_moe_precision)
    for fam in (MOE_GEMM, MOE_WGRAD))


BLOCKS: tuple = (MOE_GEMM, MOE_WGRAD, MOE_GEMM_WGMMA, MOE_WGRAD_WGMMA)
