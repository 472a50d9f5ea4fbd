"""The matrix: every cell skuforge considers, in one declarative place.

A :class:`Family` is a block of the dtype x op x scope matrix that one template renders.
Its cells are the product of its axes; an :class:`Exclusion` names cells that are *not*
generated and says why (the manifest and the audit show the reason). Adding a scope is a
one-line change to a tuple below; adding a dtype is one ``Kind`` in ``runtime/kinds.py`` (the
kind vocabulary: C type, size, ranges, groups) and one entry here; plus, at most, a template branch.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

from runtime import kinds
from runtime.axes import MODES, PASSES, SCOPES
from runtime.sku import KernelSku, Precision

# -- element kinds: the groups of runtime/kinds.py (C types, sizes, ranges: kinds.CTYPE, .SIZE, .QRANGE)
FLOATS = kinds.FLOAT
INTS = kinds.INT8
LOW_BIT = kinds.LOW_BIT          # docs/lowbit.md

@dataclass(frozen=True)
class Exclusion:
    """Cells matching ``when`` are not generated, for ``reason``."""

    reason: str
    when: Callable[[KernelSku], bool]


@dataclass(frozen=True)
class Stream:
    """One array the kernel reads or writes element by element."""

    name: str
    element: str  # an element kind, or "math" / "input" resolved per SKU


@dataclass(frozen=True)
class Family:
    """A block of cells rendered by one template with one launch convention."""

    name: str
    category: str
    ops: tuple
    template: str                       # per-op: "{op}" is substituted
    pairs: tuple                        # (element, aux_element) pairs
    scopes: tuple = (None,)
    modes: tuple = (None,)
    arches: tuple = ("sm80",)
    backends: tuple = ("simt",)
    # the runtime launcher that drives these kernels (its kind also names the kernels' parameter
    # lists, codegen/abi.py): one kind, or a function of the SKU
    launch: Union[str, Callable] = "elementwise"
    ins: tuple = ()
    outs: tuple = ()
    nvrtc_options: tuple = ("--fmad=false",)  # exact IEEE products: bit-equal to NumPy
    exclusions: tuple = ()
    # Optional hook: (cell, ctx) -> dict of extra template context; a "launch" key in the
    # returned dict is merged into the kernel's manifest launch metadata (its kind and parameter
    # lists come from ``launch`` and codegen/abi.py alone).
    extra_context: Optional[Callable] = None
    precision: Optional[Callable] = None   # sku fields -> Precision; default: the exact math of docs/numerics.md
    headers: tuple = ()                 # extra shared headers (templates/...) after the prelude in its units
    # Optional hook: SKU -> {ABI group: host SKU}: the entry points of those groups that the SKU
    # launches from another SKU of its unit, which compiles the same device code (NVRTC compiles it
    # once); the SKU's template then renders only the rest (codegen/render.py, docs/dynamic.md).
    shares: Optional[Callable] = None

    def cells(self) -> Iterator[KernelSku]:
        for op, scope, mode, (el, aux), arch, backend in itertools.product(
                self.ops, self.scopes, self.modes, self.pairs, self.arches, self.backends):
            prec = (self.precision(op, scope, mode, el, aux, arch, backend) if self.precision
                     else Precision(kinds.math_kind(el if el in FLOATS else aux)))
            yield KernelSku(self.category, op, scope, mode, el, aux, arch, backend, prec)

    def excluded(self, sku: KernelSku) -> Optional[str]:
        for ex in self.exclusions:
            if ex.when(sku):
                return ex.reason
        return None

    def unit(self, sku: KernelSku) -> str:
        """Translation unit (one NVRTC compile) that holds the kernel: by op and dtypes."""
        parts = [sku.op, sku.element] + ([sku.aux_element] if sku.aux_element else [])
        return f"{self.category}/{'_'.join(parts)}.cu"

    def launch_kind(self, sku: KernelSku) -> str:
        return self.launch(sku) if callable(self.launch) else self.launch

    def template_for(self, sku: KernelSku) -> str:
        return self.template.format(op=sku.op)


STATIC_QUANTIZE = Family(
    name="static-quantize",
    category="quantization",
    ops=("quantize",),
    template="quantization/{op}.cu.j2",
    pairs=tuple(itertools.product(FLOATS, INTS)),          # low-bit kinds: LOWBIT_* below
    scopes=SCOPES,
    modes=MODES,
    ins=(Stream("x", "element"),),
    outs=(Stream("q", "aux"),),
)

STATIC_DEQUANTIZE = Family(
    name="static-dequantize",
    category="quantization",
    ops=("dequantize",),
    template="quantization/{op}.cu.j2",
    pairs=tuple(itertools.product(INTS, FLOATS)),          # low-bit kinds: LOWBIT_* below
    scopes=SCOPES,
    modes=MODES,
    ins=(Stream("q", "element"),),
    outs=(Stream("y", "aux"),),
)


# Team kernels of the fused per-token / per-group pass (dynamic_common.cu.j2 `team`): one entry point
# `<symbol>_t<P>` per chunk budget P (16-byte chunks of x per thread, held in registers), each capped
# at the register count (__maxnreg__) ptxas meets without spills on sm_80 and sm_90; the heavier
# element code of asymmetric and of software fp8 (sm80 SKUs) needs more. Not for f64 inputs
# (_has_team).
TEAM_CHUNKS = (16, 8, 4, 2)
TEAM_REGISTERS = {"light": (96, 56, 40, 40), "heavy": (96, 64, 48, 48)}
# Fixed-TX team entry points `<symbol>_t<P>_tx<TX>` (s8 / u8), per scope: (P, CH, TX) triples, each
# compiled with TX threads per row group and CH chunks per thread and row group as compile-time
# constants, for the launches that `auto` makes most (runtime.dynamic.team_launch): t8 with two row
# groups per thread (CH = 4) and TX 2 / 4 / 8 for groups of 8, 16 and 32 chunks (64 / 128 / 256
# elements of 16 bits, 32 / 64 / 128 of f32), and for the (16, 4096) latency shape bf16 / f16
# (t2, CH = 2: TX = 8 for group 128, TX = 256 for token). The run-time-TX entry point takes every
# other launch (docs/dynamic.md "Fixed-TX entry points"). Bench on an H200 (with against
# without them): group(128) bf16 at 8192^2 84.0 -> 87.0 % of copy, f16 83.9 -> 86.7; at (16, 4096)
# against torch.compile token x0.96 -> x1.06, group x1.38.
TEAM_FIXED = {"group": ((8, 4, 2), (8, 4, 4), (8, 4, 8), (2, 2, 8)), "token": ((2, 2, 256),)}


# Streamed 16-byte vectors a thread of the cooperative per-tensor kernel loads before it uses any
# (dynamic_tensor.cu.j2), (reduce, quantize): the bytes in flight per thread at its 32-register cap;
# the asymmetric quantize (zero point) fits two without spilling.
COOP_BATCH = {"symmetric": (4, 4), "asymmetric": (4, 2)}
# The same for the per-channel kernel (dynamic_channel.cu.j2, both passes) at its 64-register cap
# (one 1024-thread block per SM); the asymmetric one holds V zero points and fits two unspilled.
CHAN_BATCH = {"symmetric": 4, "asymmetric": 2}


def _dynamic_shares(sku) -> dict:
    """{ABI group: host SKU} of a dynamic_quantize SKU (Family.shares): token launches its group
    SKU's fused kernels (block and team: a token is the row group of group_size = cols, and the two
    render the same device code but for names), tensor its channel SKU's two-phase reduction
    (tensor is one channel; its one-launch kernel ``_coop`` stays its own). fp8 token SKUs keep
    their own fused kernels: the group ones also write MX e8m0 scales."""
    if sku.scope == "token" and sku.aux_element not in kinds.FP8:
        group = dataclasses.replace(sku, scope="group")
        return {"main": group, **({"team": group} if _has_team(sku) else {})}
    if sku.scope == "tensor":
        return {"main": dataclasses.replace(sku, scope="channel")}
    return {}


def _guests(sku, group: str) -> list:
    """The SKUs of ``sku``'s unit that launch its entry points of ABI group ``group``."""
    return [g for g in (dataclasses.replace(sku, scope=s) for s in SCOPES if s != sku.scope)
            if _dynamic_shares(g).get(group) == sku]


def _has_team(sku) -> bool:
    """Whether a fused SKU has team kernels: not for f64 inputs (math in double does not fit their
    register caps), which take the block kernel."""
    return sku.element != "f64"


def _team_context(sku, fixed: bool = False) -> dict:
    """``team_fixed``: the fixed-TX entry points the SKU's launcher picks (its scope's TEAM_FIXED);
    ``team_compiled``: those its template compiles, its own and those of the SKUs that launch its
    team kernels (a group SKU compiles the token's ``t2_tx256`` too)."""
    if not _has_team(sku):
        return {"team_chunks": [], "team_registers": [], "team_fixed": [], "team_compiled": []}
    heavy = sku.mode == "asymmetric" or (sku.aux_element in kinds.FP8 and sku.arch == "sm80")

    def fixed_of(s) -> list:
        return [list(f) for f in TEAM_FIXED.get(s.scope, ())] if fixed else []
    own = fixed_of(sku)
    compiled = own + [f for g in _guests(sku, "team") for f in fixed_of(g) if f not in own]
    return {"team_chunks": list(TEAM_CHUNKS), "team_registers": list(TEAM_REGISTERS["heavy" if heavy else "light"]),
            "team_fixed": own, "team_compiled": compiled}


def _dynamic_context(cell, ctx):
    """dynamic_quantize: token/group are one fused pass (launch kind ``dynamic_fused``),
    tensor/channel a two-phase deterministic reduction + the static quantize kernel
    (``dynamic_reduce``); ``coop``: s8/u8 per-tensor SKUs also carry the one-launch cooperative
    kernel ``<symbol>_coop`` (dynamic_tensor.cu.j2), ``chan``: s8/u8 per-channel SKUs the one-launch
    kernel ``<symbol>_chan`` for channels on the last axis (dynamic_channel.cu.j2). ``ch_*``: chunks of a row a thread keeps in registers (64 bytes of x);
    ``min_blocks``: 2 (64 registers, 4 resident 256-thread blocks) where ptxas fits it unspilled."""
    el = cell.sku.element
    if cell.sku.scope in ("token", "group"):
        ch_max = max(1, 64 // (ctx["vec"] * kinds.SIZE[el]))
        ch_vec = [c for c in (1, 2, 4, 8) if c <= ch_max]
        ch_scalar = [c for c in (1, 4, 8) if c * kinds.SIZE[el] <= 64]
        min_blocks = 2 if cell.sku.mode == "symmetric" and kinds.SIZE[el] <= 4 else 1
        team = _team_context(cell.sku, fixed=True)
        return {"ch_vec": ch_vec, "ch_scalar": ch_scalar, "min_blocks": min_blocks, **team,
                "launch": {"max_threads": 512, "ch_vec": ch_vec, "ch_scalar": ch_scalar,
                           "team_chunks": team["team_chunks"], "team_fixed": team["team_fixed"]}}
    coop = cell.sku.scope == "tensor" and cell.sku.aux_element in kinds.INT8
    chan = cell.sku.scope == "channel" and cell.sku.aux_element in kinds.INT8
    return {"rvec": 16 // kinds.SIZE[el], "coop": coop, "coop_batch": COOP_BATCH[cell.sku.mode],
            "chan": chan, "chan_batch": CHAN_BATCH[cell.sku.mode],
            "launch": {"rvec": 16 // kinds.SIZE[el], "coop": coop, "chan": chan}}


DYNAMIC_QUANTIZE = Family(
    name="dynamic-quantize",
    category="quantization",
    ops=("dynamic_quantize",),
    template="quantization/{op}.cu.j2",
    pairs=tuple(itertools.product(FLOATS, INTS)),          # low-bit kinds: LOWBIT_* below
    scopes=SCOPES,
    modes=MODES,
    launch=lambda sku: "dynamic_fused" if sku.scope in ("token", "group") else "dynamic_reduce",
    ins=(Stream("x", "element"),),
    outs=(Stream("q", "aux"),),
    extra_context=_dynamic_context,
    shares=_dynamic_shares,
    # the reductions (min/max) run in the math precision too
    precision=lambda op, scope, mode, el, aux, arch, backend: Precision(kinds.math_kind(el), kinds.math_kind(el)),
)

# -- MoE grouped matmul (docs/moe.md) --------------------------------------------------------
MOE_FLOATS = ("f32", "f16", "bf16", "f64")
# Tile shape of each backend: the templates static_assert the shapes their fragment maps assume.
MOE_TILES = {
    "simt": {"BM": 64, "BN": 64, "BK": 16, "STAGES": 1, "THREADS": 256, "MIN_BLOCKS": 0},
    "mma": {"BM": 128, "BN": 128, "BK": 32, "STAGES": 5, "THREADS": 128, "MIN_BLOCKS": 0},
}

# wgmma tile configurations (templates/moe/_wgmma.cu.j2), name: (BM, BN, STAGES, EPI); BK = 64 (one
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
# The documented choice (runtime/moe.py variant_for; docs/moe.md): experts averaging fewer than
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
MOE_ROUTE = ("offsets_i32", "offsets_i64", "count", "scan", "scatter")


def _moe_context(cell, ctx):
    """Tile shape, storage types, the routing entry points (``<symbol>_route_*``) and, for mma,
    the tile configurations compiled into the SKU's text (``launch["variants"]``): the default
    is the SKU's symbol, the others ``<symbol>__v<name>``, chosen at launch (runtime/moe.py,
    ``SKUFORGE_MOE_CONFIG``) without recompiling."""
    sku = cell.sku
    # name: (BM, BN, BK, STAGES, PIPE). Warps of 64 x 64 outputs: THREADS = 32 * BM * BN / 4096.
    # PIPE (templates/moe/_mma.cu.j2 mainloop): 0 copies of the next slice before the mma,
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
              "out": out_kind, "route_threads": 1024,
              "route": {r: f"{sku.symbol}_route_{r}" for r in MOE_ROUTE}}
    if sku.backend in ("mma", "wgmma"):
        launch["default_variant"] = variants[0]["name"]
        launch["variants"] = {v["name"]: {k: v[k] for k in ("symbol", "tile", "dynamic_smem", "static_smem")}
                              for v in variants}
        launch.update(rules)
    return {
        "ns": sku.symbol + "_ns", "T": kinds.CTYPE[sku.element], "OUT": kinds.CTYPE[out_kind], "out_kind": out_kind,
        "opkind": opkind, "tile": tile, "variants": variants, "route_threads": 1024, "launch": launch,
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
class ArchSpecificFamily(Family):
    """Cells built for an arch-specific target (``sm_90a``: wgmma, setmaxnreg): units of their own
    (``..._sm90a.cu``) whose NVRTC options name the target, so that they are compiled for it and for
    no other arch (runtime.compiler.pinned_target), and the Hopper helpers in their units."""

    target: str = "sm_90a"
    headers: tuple = ("common/hopper.cuh",)

    def unit(self, sku: KernelSku) -> str:
        return f"{super().unit(sku)[:-3]}_{self.target.replace('_', '')}.cu"

MOE_GEMM = Family(
    name="moe-grouped-matmul",
    category="moe",
    ops=("grouped_matmul", "grouped_matmul_backward_input"),
    template="moe/grouped_matmul.cu.j2",
    pairs=tuple((el, None) for el in MOE_FLOATS),
    backends=("simt", "mma"),
    launch="moe_gemm",
    nvrtc_options=(),            # fmad on: grouped matmul is not bit-exact with NumPy (tolerances: docs/numerics.md)
    exclusions=_MOE_EXCLUSIONS,
    extra_context=_moe_context,
    precision=_moe_precision,
)

# dw is float32 by default (aux f32 for f16/bf16 inputs), or the input dtype on request (aux None).
MOE_WGRAD = Family(
    name="moe-grouped-matmul-wgrad",
    category="moe",
    ops=("grouped_matmul_backward_weight",),
    template="moe/grouped_matmul.cu.j2",
    pairs=(("f32", None), ("f16", "f32"), ("f16", None), ("bf16", "f32"), ("bf16", None), ("f64", None)),
    backends=("simt", "mma"),
    launch="moe_gemm",
    nvrtc_options=(),
    exclusions=_MOE_EXCLUSIONS,
    extra_context=_moe_context,
    precision=_moe_precision,
)

# The Hopper backend (docs/moe.md): warp-specialised wgmma + TMA kernels, built for sm_90a only.
MOE_GEMM_WGMMA, MOE_WGRAD_WGMMA = (
    ArchSpecificFamily(name=f"{fam.name}-wgmma", category="moe", ops=fam.ops, template=fam.template,
                       pairs=tuple(p for p in fam.pairs if p[0] != "f64"), arches=("sm90",), backends=("wgmma",),
                       launch="moe_gemm", nvrtc_options=("--gpu-architecture=sm_90a",), exclusions=_MOE_EXCLUSIONS,
                       extra_context=_moe_context, precision=_moe_precision)
    for fam in (MOE_GEMM, MOE_WGRAD))



# -- training ops: straight-through backward, fake-quant, LSQ (docs/training.md) -----------------
# Gradients and fake-quantized values are in the input dtype: element = aux_element.
TRAINING_PAIRS = tuple((f, f) for f in FLOATS)

TRAINING_STE = Family(
    name="training-ste",
    category="quantization",
    ops=("quantize_backward", "fake_quantize_backward"),
    template="quantization/{op}.cu.j2",
    pairs=TRAINING_PAIRS,
    scopes=SCOPES,
    modes=MODES,
    ins=(Stream("dy", "aux"), Stream("x", "element")),
    outs=(Stream("dx", "aux"),),
)

TRAINING_DEQUANTIZE_BACKWARD = Family(
    name="training-dequantize-backward",
    category="quantization",
    ops=("dequantize_backward",),
    template="quantization/{op}.cu.j2",
    pairs=TRAINING_PAIRS,
    scopes=SCOPES,
    ins=(Stream("dy", "element"),),
    outs=(Stream("dq", "aux"),),
)

def _eight_wide(ctx) -> dict:
    """Vectors of 8 elements, whatever the element size (a mask byte holds the bits of one vector:
    f32 moves two 16-byte words a vector, f64 four), with the unroll cut to keep the bytes a thread
    has in flight (16-bit: 4 vectors, f32: 2, f64: 1)."""
    return {"vec": 8, "unroll": max(1, ctx["unroll"] * ctx["vec"] // 8)}


# The mask is optional (a null pointer skips its stores) and written either one byte an element or
# bit-packed (``bits``: the stream and the int parameter that selects it; docs/numerics.md "Mask bits").
TRAINING_FAKE_QUANTIZE = Family(
    name="training-fake-quantize",
    category="quantization",
    ops=("fake_quantize",),
    template="quantization/{op}.cu.j2",
    pairs=TRAINING_PAIRS,
    scopes=SCOPES,
    modes=MODES,
    ins=(Stream("x", "element"),),
    outs=(Stream("y", "aux"), Stream("mask", "u8")),
    extra_context=lambda cell, ctx: {"nullable": ("mask",), "bits": {"mask": "mask_bits"}, **_eight_wide(ctx),
                                     "launch": {"nullable": ["mask"], "bits": {"mask": "mask_bits"}}},
)

# dx = dy * bit, the bits of fake_quantize(..., return_mask="bits"): no scale, no scope, no mode. The
# mask is always bit-packed (``bits``: no parameter selects it).
TRAINING_MASK_BACKWARD = Family(
    name="training-mask-backward",
    category="quantization",
    ops=("fake_quantize_backward_from_mask",),
    template="quantization/{op}.cu.j2",
    pairs=TRAINING_PAIRS,
    ins=(Stream("dy", "element"), Stream("mask", "u8")),
    outs=(Stream("dx", "aux"),),
    extra_context=lambda cell, ctx: {**_eight_wide(ctx), "launch": {"bits": {"mask": None}}},
)

TRAINING_LSQ = Family(
    name="training-lsq",
    category="quantization",
    ops=("fake_quantize_learnable_backward",),
    template="quantization/{op}.cu.j2",
    pairs=TRAINING_PAIRS,
    scopes=SCOPES,
    modes=MODES,
    launch="lsq",
    ins=(Stream("dy", "aux"), Stream("x", "element")),
    outs=(Stream("dx", "aux"),),
    # sums accumulate in the math precision (float64 for f64 inputs)
    precision=lambda op, scope, mode, el, aux, arch, backend: Precision(kinds.math_kind(el), kinds.math_kind(el)),
    extra_context=lambda cell, ctx: {"launch": {"finish": cell.sku.scope in ("tensor", "channel")}},
)

# -- low-bit formats: fp8 e4m3fn / e5m2, packed s4 / u4, e8m0 (MX) block scales (docs/lowbit.md) --
FP8 = kinds.FP8
INT4 = kinds.INT4
FP8_FORMAT = {"fp8_e4m3": "Fp8E4M3", "fp8_e5m2": "Fp8E5M2"}   # templates/common/lowbit.cuh
# Low-bit streams are byte containers (kinds.CTYPE "u8_t", kinds.SIZE 1): one fp8 code, or two int4
# values (2i low nibble, 2i + 1 high; kinds.kind(k).pack == 2).
LOWBIT_ARCHES = ("sm80", "sm89")   # sm80: software conversion; sm89: the cvt e4m3x2 / e5m2x2 instructions


@dataclass(frozen=True)
class LowBitFamily(Family):
    """Low-bit cells: templates/common/lowbit.cuh in their units, and the sm89 (hardware conversion)
    kernels in units of their own (``..._sm89.cu``, min_arch sm89), so that an sm_80 build never
    meets an sm_89 instruction."""

    headers: tuple = ("common/lowbit.cuh",)

    def unit(self, sku: KernelSku) -> str:
        base = super().unit(sku)
        return base if sku.arch == "sm80" else f"{base[:-3]}_{sku.arch}.cu"


def _lowbit_kind(sku: KernelSku) -> str:
    return sku.element if sku.element in LOW_BIT else sku.aux_element


# Why some low-bit cells are not generated (the cell a kernel of another arch serves, or none).
LOWBIT_EXCLUSIONS = (
    Exclusion("fp8 has no zero point: fp8 quantization is symmetric only (docs/lowbit.md)",
              lambda s: s.mode == "asymmetric" and _lowbit_kind(s) in FP8),
    Exclusion("int4 has no conversion instruction: the sm80 kernel (integer rounding) serves every arch",
              lambda s: s.arch != "sm80" and _lowbit_kind(s) in INT4),
    Exclusion("no f64 -> fp8 conversion instruction: the sm80 kernel (software, one rounding from f64) "
              "serves sm89+", lambda s: s.arch != "sm80" and s.element == "f64"),
)


def _lowbit_common(sku: KernelSku) -> dict:
    q = _lowbit_kind(sku)
    fl = sku.aux_element if q == sku.element else sku.element
    return {"qkind": q, "fmt": FP8_FORMAT.get(q), "pack": kinds.kind(q).pack, "hw": sku.arch != "sm80",
            "float_ctype": kinds.CTYPE[fl], "M_kind": sku.precision.math}


def _lowbit_static_context(cell, ctx):
    """Low-bit quantize / dequantize (launch kind ``lowbit_elementwise``). ``e8m0``: fp8 group-scope
    kernels also accept e8m0 block scales (a byte pointer; the launcher passes it for group 32)."""
    out = _lowbit_common(cell.sku)
    out["e8m0"] = out["fmt"] is not None and cell.sku.scope == "group"
    out["launch"] = {"pack": out["pack"], "e8m0": out["e8m0"]}
    return out


def _lowbit_dynamic_context(cell, ctx):
    """tensor / channel: the s8/u8 reduction (``dynamic_reduce``), then the low-bit static kernel;
    token / group: the fused low-bit kernel (``lowbit_dynamic_fused``); fp8 group kernels also write
    MX e8m0 scales (``mx``). Register chunks as for s8/u8: at most 64 bytes of x per thread."""
    sku = cell.sku
    out = _lowbit_common(sku)
    out["mx"] = out["fmt"] is not None and sku.scope == "group"
    if sku.scope in ("tensor", "channel"):
        out.update(_dynamic_context(cell, ctx))
        return out
    el, pack = sku.element, out["pack"]
    ch_max = max(1, 64 // (ctx["vec"] * kinds.SIZE[el]))
    ch_vec = [c for c in (1, 2, 4, 8) if c <= ch_max]
    ch_scalar = [c for c in (1, 4, 8) if c * pack * kinds.SIZE[el] <= 64]
    # the fixed-TX entry points for the fp8 kernels with the conversion instructions (sm89: what
    # Hopper runs; the software-conversion and int4 kernels keep the run-time-TX ones only)
    team = _team_context(sku, fixed=out["hw"] and out["fmt"] is not None)
    out.update({"ch_vec": ch_vec, "ch_scalar": ch_scalar,
                "min_blocks": 2 if sku.mode == "symmetric" and kinds.SIZE[el] <= 4 else 1, **team,
                "launch": {"max_threads": 512, "ch_vec": ch_vec, "ch_scalar": ch_scalar, "pack": pack,
                           "mx": out["mx"], "team_chunks": team["team_chunks"], "team_fixed": team["team_fixed"]}})
    return out


def lowbit_families() -> tuple:
    """The three low-bit families: quantize, dequantize and dynamic_quantize."""
    ex = LOWBIT_EXCLUSIONS
    quantize = LowBitFamily(
        name="lowbit-quantize", category="quantization", ops=("quantize",),
        template="quantization/lowbit_{op}.cu.j2", pairs=tuple(itertools.product(FLOATS, LOW_BIT)),
        scopes=SCOPES, modes=MODES, arches=LOWBIT_ARCHES, launch="lowbit_elementwise",
        ins=(Stream("x", "element"),), outs=(Stream("q", "aux"),), exclusions=ex,
        extra_context=_lowbit_static_context)
    dequantize = LowBitFamily(
        name="lowbit-dequantize", category="quantization", ops=("dequantize",),
        template="quantization/lowbit_{op}.cu.j2", pairs=tuple(itertools.product(LOW_BIT, FLOATS)),
        scopes=SCOPES, modes=MODES, arches=LOWBIT_ARCHES, launch="lowbit_elementwise",
        ins=(Stream("q", "element"),), outs=(Stream("y", "aux"),), exclusions=ex,
        extra_context=_lowbit_static_context)
    dynamic = LowBitFamily(
        name="lowbit-dynamic-quantize", category="quantization", ops=("dynamic_quantize",),
        template="quantization/lowbit_{op}.cu.j2", pairs=tuple(itertools.product(FLOATS, LOW_BIT)),
        scopes=SCOPES, modes=MODES, arches=LOWBIT_ARCHES,
        launch=lambda sku: "lowbit_dynamic_fused" if sku.scope in ("token", "group") else "dynamic_reduce",
        ins=(Stream("x", "element"),), outs=(Stream("q", "aux"),), exclusions=ex,
        extra_context=_lowbit_dynamic_context, shares=_dynamic_shares,
        precision=lambda op, scope, mode, el, aux, arch, backend: Precision(kinds.math_kind(el), kinds.math_kind(el)))
    return quantize, dequantize, dynamic


LOWBIT_QUANTIZE, LOWBIT_DEQUANTIZE, LOWBIT_DYNAMIC_QUANTIZE = lowbit_families()

@dataclass(frozen=True)
class LocalMemory:
    """Kernels (a glob on the symbol) allowed a small stack frame, at most ``max_bytes``, and why.
    ``python -m codegen compile`` fails any other kernel that uses local memory: a thread's data
    belongs in registers, and local memory is where out-of-bounds reads of a thread's arrays hide."""
    pattern: str
    max_bytes: int
    reason: str


_CALL_SAVES = ("registers saved around calls to the 64-bit division / reciprocal slow-path routines "
               "(no local arrays)")
LOCAL_MEMORY = (
    LocalMemory("sf_grouped_matmul*_route_offsets_i*", 16, "MoE routing prologue (one block): " + _CALL_SAVES),
    LocalMemory("sf_grouped_matmul*_route_count", 16, "MoE routing prologue: " + _CALL_SAVES),
    LocalMemory("sf_grouped_matmul_backward_input_*_simt", 16, "simt dgrad (the fallback path): " + _CALL_SAVES),
    LocalMemory("sf_fake_quantize_learnable_backward_*", 16, "LSQ element pass: " + _CALL_SAVES),
    # register pressure (spills of a few values), measured with ptxas; correct, slower than it could be
    LocalMemory("sf_dynamic_quantize_*_asymmetric_f64_*", 8, "f64 asymmetric range reduction: 4 B of spills"),
    LocalMemory("sf_fake_quantize_*_f64_f64_*", 16, "f64 fake_quantize: 8 B of spills in the per-channel (last axis) "
                "kernel, which holds 8 columns' parameters beside its vector"),
    LocalMemory("sf_quantize_backward_group_*", 8, "straight-through group pass on sm_80: 4 B of spills"),
    LocalMemory("sf_fake_quantize_backward_group_*", 8, "straight-through group pass on sm_80: 4 B of spills"),
    LocalMemory("sf_dequantize_group_symmetric_fp8_*", 8, "fp8 dequantize, group scope: 8-16 B of spills with the "
                "per-element scale check"),
    LocalMemory("sf_quantize_group_symmetric_f64_fp8_*", 16, "f64 -> fp8 software conversion, group scope: 12-24 B of "
                "spills"),
    LocalMemory("sf_dequantize_*_fp8_e?m?_f32_sm80_simt", 24, "fp8 -> f32 dequantize (software conversion) with a "
                "step's scale elements held beside its data: 24-44 B of spills"),
    LocalMemory("sf_dynamic_quantize_channel_*_bf16_fp8_e?m?_sm89_simt", 24, "bf16 -> fp8 range reduction (the "
                "per-channel and per-tensor two-pass kernel) built for sm_89: ptxas spills 20 B in its slice loop "
                "there (none on sm_90; a 2-step unroll instead of 4 would avoid it)"),
    LocalMemory("sf_dequantize_*_[su]4_*_sm80_simt", 8, "int4 dequantize with a step's scale elements (and zero "
                "points) held beside its data: 4-16 B of spills on some scopes"),
)


def local_memory_allowed(symbol: str, stack_bytes: int) -> Optional[LocalMemory]:
    """The LOCAL_MEMORY entry that allows ``symbol`` a stack frame of ``stack_bytes``, if any."""
    import fnmatch
    for entry in LOCAL_MEMORY:
        if fnmatch.fnmatchcase(symbol, entry.pattern) and stack_bytes <= entry.max_bytes:
            return entry
    return None


FAMILIES: tuple = (STATIC_QUANTIZE, STATIC_DEQUANTIZE, DYNAMIC_QUANTIZE, MOE_GEMM, MOE_WGRAD, MOE_GEMM_WGMMA,
                  MOE_WGRAD_WGMMA,
                  TRAINING_STE, TRAINING_DEQUANTIZE_BACKWARD, TRAINING_FAKE_QUANTIZE, TRAINING_MASK_BACKWARD,
                  TRAINING_LSQ,
                  LOWBIT_QUANTIZE, LOWBIT_DEQUANTIZE, LOWBIT_DYNAMIC_QUANTIZE)


@dataclass(frozen=True)
class Cell:
    sku: KernelSku
    family: Family
    reason: Optional[str] = None  # set when the cell is excluded

    @property
    def generated(self) -> bool:
        return self.reason is None


def cells(families=FAMILIES) -> list:
    """Every considered cell, sorted by SKU: generated and excluded alike."""
    out = [Cell(sku, fam, fam.excluded(sku)) for fam in families for sku in fam.cells()]
    skus = [c.sku for c in out]
    if len(set(skus)) != len(skus):
        raise AssertionError("two families declare the same SKU")
    return sorted(out, key=lambda c: c.sku)
