"""The quantization family's matrix: its blocks of cells, their exclusions and rendering contexts.

A :class:`~codegen.spec.Block` is a block of the dtype x op x scope matrix that one template renders.
Its cells are the product of its axes; an :class:`~codegen.spec.Exclusion` names cells that are *not*
generated and says why (the manifest and the audit show the reason). Adding a scope is one entry in
runtime/axes.py; adding a dtype is one ``Kind`` in ``runtime/kinds.py`` (the kind vocabulary: C type,
size, ranges, groups) and one entry here; plus, at most, a template branch.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from runtime import kinds
from runtime.axes import MODES, SCOPES
from runtime.sku import KernelSku, Precision

from ...spec import Block, Exclusion, Stream
from .launch import (DYNAMIC_FUSED, DYNAMIC_REDUCE, ELEMENTWISE, LOWBIT_DYNAMIC_FUSED, LOWBIT_ELEMENTWISE, LSQ)

# -- element kinds: the groups of runtime/kinds.py (C types, sizes, ranges: kinds.CTYPE, .SIZE, .QRANGE)
FLOATS = kinds.FLOAT
INTS = kinds.INT8
LOW_BIT = kinds.LOW_BIT          # docs/lowbit.md


# The static elementwise kernels' device code (the skeleton ew::elementwise and the ops' bodies).
ELEMENTWISE_HEADERS = ("quantization/elementwise.cuh",)


def _layouts(cell, ctx) -> dict:
    """``layouts``, {entry point: ew::Layout} of a static elementwise SKU: rows for tensor / token,
    columns for group, both for channel (its symbol: channel on the last axis, columns; ``_rows``:
    another axis, rows). The dequantize ops' group and channel SKUs also have the row-vectors layout
    (``_vrows``), which their schedules ``r256`` / ``r128`` launch."""
    scope = cell.sku.scope
    layouts = {"main": "ROWS" if scope in ("tensor", "token") else "COLUMNS"}
    if scope == "channel":
        layouts["rows"] = "ROWS"
    if scope in ("group", "channel") and cell.sku.op in ROW_VECTOR_OPS:
        layouts["vrows"] = "ROW_VECTORS"
    return {"layouts": layouts}


# The ops whose group and channel SKUs have the row-vectors layout: those without a reciprocal
# (docs/perf-notes.md, "Static quantize and dequantize": the others lose with it at every size).
ROW_VECTOR_OPS = ("dequantize", "dequantize_backward")


STATIC_QUANTIZE = Block(
    name="static-quantize",
    category="quantization",
    ops=("quantize",),
    launch=ELEMENTWISE,
    template="quantization/{op}.cu.j2",
    pairs=tuple(itertools.product(FLOATS, INTS)),          # low-bit kinds: LOWBIT_* below
    scopes=SCOPES,
    modes=MODES,
    ins=(Stream("x", "element"),),
    outs=(Stream("q", "aux"),),
    headers=ELEMENTWISE_HEADERS,
    extra_context=_layouts,
)

STATIC_DEQUANTIZE = Block(
    name="static-dequantize",
    category="quantization",
    ops=("dequantize",),
    launch=ELEMENTWISE,
    template="quantization/{op}.cu.j2",
    pairs=tuple(itertools.product(INTS, FLOATS)),          # low-bit kinds: LOWBIT_* below
    scopes=SCOPES,
    modes=MODES,
    ins=(Stream("q", "element"),),
    outs=(Stream("y", "aux"),),
    headers=ELEMENTWISE_HEADERS,
    extra_context=_layouts,
)


# Team kernels of the fused per-token / per-group pass (dyn::team, templates/quantization/dynamic.cuh): one entry point
# `<symbol>_t<P>` per chunk budget P (16-byte chunks of x per thread, held in registers), each capped
# at the register count (__maxnreg__) ptxas meets without spills on sm_80 and sm_90; the heavier
# element code of asymmetric and of software fp8 (sm80 SKUs) needs more. Not for f64 inputs
# (_has_team).
TEAM_CHUNKS = (16, 8, 4, 2)
TEAM_REGISTERS = {"light": (96, 56, 40, 40), "heavy": (96, 64, 48, 48)}
# Fixed-TX team entry points `<symbol>_t<P>_tx<TX>` (s8 / u8), per scope: (P, CH, TX) triples, each
# compiled with TX threads per row group and CH chunks per thread and row group as compile-time
# constants, for the launches that `auto` makes most (runtime.quantization.fused.team_launch): t8 with two row
# groups per thread (CH = 4) and TX 2 / 4 / 8 for groups of 8, 16 and 32 chunks (64 / 128 / 256
# elements of 16 bits, 32 / 64 / 128 of f32), and for the (16, 4096) latency shape bf16 / f16
# (t2, CH = 2: TX = 8 for group 128, TX = 256 for token). The run-time-TX entry point takes every
# other launch (docs/dynamic.md "Fixed-TX entry points"). Bench on an H200 (with against
# without them): group(128) bf16 at 8192^2 84.0 -> 87.0 % of copy, f16 83.9 -> 86.7; at (16, 4096)
# against torch.compile token x0.96 -> x1.06, group x1.38.
TEAM_FIXED = {"group": ((8, 4, 2), (8, 4, 4), (8, 4, 8), (2, 2, 8)), "token": ((2, 2, 256),)}


# Streamed 16-byte vectors a thread of the cooperative per-tensor kernel loads before it uses any
# (dyn::coop, templates/quantization/dynamic_int8.cuh), (reduce, quantize): the bytes in flight per thread at its 32-register cap;
# the asymmetric quantize (zero point) fits two without spilling.
COOP_BATCH = {"symmetric": (4, 4), "asymmetric": (4, 2)}
# The same for the per-channel kernel (dyn::chan, both passes) at its 64-register cap
# (one 1024-thread block per SM); the asymmetric one holds V zero points and fits two unspilled.
CHAN_BATCH = {"symmetric": 4, "asymmetric": 2}


def _dynamic_shares(sku) -> dict:
    """{ABI group: host SKU} of a dynamic_quantize SKU (Block.shares): token launches its group
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
    kernel ``<symbol>_coop`` (dyn::coop), ``chan``: s8/u8 per-channel SKUs the one-launch
    kernel ``<symbol>_chan`` for channels on the last axis (dyn::chan). ``ch_*``: chunks of a row a thread keeps in registers (64 bytes of x);
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


DYNAMIC_QUANTIZE = Block(
    name="dynamic-quantize",
    category="quantization",
    ops=("dynamic_quantize",),
    template="quantization/{op}.cu.j2",
    pairs=tuple(itertools.product(FLOATS, INTS)),          # low-bit kinds: LOWBIT_* below
    scopes=SCOPES,
    modes=MODES,
    launch=lambda sku: DYNAMIC_FUSED if sku.scope in ("token", "group") else DYNAMIC_REDUCE,
    ins=(Stream("x", "element"),),
    outs=(Stream("q", "aux"),),
    extra_context=_dynamic_context,
    shares=_dynamic_shares,
    # the reductions (min/max) run in the math precision too
    precision=lambda op, scope, mode, el, aux, arch, backend: Precision(kinds.math_kind(el), kinds.math_kind(el)),
    headers=("quantization/dynamic.cuh", "quantization/dynamic_int8.cuh"),
)

# -- training ops: straight-through backward, fake-quant, LSQ (docs/training.md) -----------------
# Gradients and fake-quantized values are in the input dtype: element = aux_element.
TRAINING_PAIRS = tuple((f, f) for f in FLOATS)

TRAINING_STE = Block(
    name="training-ste",
    category="quantization",
    ops=("quantize_backward", "fake_quantize_backward"),
    launch=ELEMENTWISE,
    template="quantization/{op}.cu.j2",
    pairs=TRAINING_PAIRS,
    scopes=SCOPES,
    modes=MODES,
    ins=(Stream("dy", "aux"), Stream("x", "element")),
    outs=(Stream("dx", "aux"),),
    headers=ELEMENTWISE_HEADERS,
    extra_context=_layouts,
)

TRAINING_DEQUANTIZE_BACKWARD = Block(
    name="training-dequantize-backward",
    category="quantization",
    ops=("dequantize_backward",),
    launch=ELEMENTWISE,
    template="quantization/{op}.cu.j2",
    pairs=TRAINING_PAIRS,
    scopes=SCOPES,
    ins=(Stream("dy", "element"),),
    outs=(Stream("dq", "aux"),),
    headers=ELEMENTWISE_HEADERS,
    extra_context=_layouts,
)

def _eight_wide(ctx) -> dict:
    """Vectors of 8 elements, whatever the element size (a mask byte holds the bits of one vector:
    f32 moves two 16-byte words a vector, f64 four), with the unroll cut to keep the bytes a thread
    has in flight (16-bit: 4 vectors, f32: 2, f64: 1)."""
    return {"vec": 8, "unroll": max(1, ctx["unroll"] * ctx["vec"] // 8)}


# The mask is optional (a null pointer skips its stores) and written either one byte an element or
# bit-packed (``bits``: the stream and the int parameter that selects it; docs/numerics.md "Mask bits").
TRAINING_FAKE_QUANTIZE = Block(
    name="training-fake-quantize",
    category="quantization",
    ops=("fake_quantize",),
    launch=ELEMENTWISE,
    template="quantization/{op}.cu.j2",
    pairs=TRAINING_PAIRS,
    scopes=SCOPES,
    modes=MODES,
    ins=(Stream("x", "element"),),
    outs=(Stream("y", "aux"), Stream("mask", "u8")),
    headers=ELEMENTWISE_HEADERS,
    extra_context=lambda cell, ctx: {"bits": {"mask": "mask_bits"}, **_eight_wide(ctx), **_layouts(cell, ctx),
                                     "launch": {"nullable": ["mask"], "bits": {"mask": "mask_bits"}}},
)

# dx = dy * bit, the bits of fake_quantize(..., return_mask="bits"): no scale, no scope, no mode. The
# mask is always bit-packed (``bits``: no parameter selects it).
TRAINING_MASK_BACKWARD = Block(
    name="training-mask-backward",
    category="quantization",
    ops=("fake_quantize_backward_from_mask",),
    launch=ELEMENTWISE,
    template="quantization/{op}.cu.j2",
    pairs=TRAINING_PAIRS,
    ins=(Stream("dy", "element"), Stream("mask", "u8")),
    outs=(Stream("dx", "aux"),),
    headers=("quantization/mask_backward.cuh",),
    extra_context=lambda cell, ctx: {**_eight_wide(ctx), "launch": {"bits": {"mask": None}}},
)

TRAINING_LSQ = Block(
    name="training-lsq",
    category="quantization",
    ops=("fake_quantize_learnable_backward",),
    template="quantization/{op}.cu.j2",
    pairs=TRAINING_PAIRS,
    scopes=SCOPES,
    modes=MODES,
    launch=LSQ,
    ins=(Stream("dy", "aux"), Stream("x", "element")),
    outs=(Stream("dx", "aux"),),
    # sums accumulate in the math precision (float64 for f64 inputs)
    precision=lambda op, scope, mode, el, aux, arch, backend: Precision(kinds.math_kind(el), kinds.math_kind(el)),
    headers=("quantization/lsq.cuh",),
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
class LowBitBlock(Block):
    """Low-bit cells: templates/common/lowbit.cuh and templates/quantization/lowbit_kernels.cuh in
    their units, and the sm89 (hardware conversion) kernels in units of their own (``..._sm89.cu``,
    min_arch sm89), so that an sm_80 build never meets an sm_89 instruction."""

    headers: tuple = ("common/lowbit.cuh", "quantization/lowbit_kernels.cuh")

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


def lowbit_blocks() -> tuple:
    """The three low-bit blocks: quantize, dequantize and dynamic_quantize."""
    ex = LOWBIT_EXCLUSIONS
    quantize = LowBitBlock(
        name="lowbit-quantize", category="quantization", ops=("quantize",),
        template="quantization/lowbit_{op}.cu.j2", pairs=tuple(itertools.product(FLOATS, LOW_BIT)),
        scopes=SCOPES, modes=MODES, arches=LOWBIT_ARCHES, launch=LOWBIT_ELEMENTWISE,
        ins=(Stream("x", "element"),), outs=(Stream("q", "aux"),), exclusions=ex,
        extra_context=_lowbit_static_context)
    dequantize = LowBitBlock(
        name="lowbit-dequantize", category="quantization", ops=("dequantize",),
        template="quantization/lowbit_{op}.cu.j2", pairs=tuple(itertools.product(LOW_BIT, FLOATS)),
        scopes=SCOPES, modes=MODES, arches=LOWBIT_ARCHES, launch=LOWBIT_ELEMENTWISE,
        ins=(Stream("q", "element"),), outs=(Stream("y", "aux"),), exclusions=ex,
        extra_context=_lowbit_static_context)
    dynamic = LowBitBlock(
        name="lowbit-dynamic-quantize", category="quantization", ops=("dynamic_quantize",),
        template="quantization/lowbit_{op}.cu.j2", pairs=tuple(itertools.product(FLOATS, LOW_BIT)),
        scopes=SCOPES, modes=MODES, arches=LOWBIT_ARCHES,
        launch=lambda sku: LOWBIT_DYNAMIC_FUSED if sku.scope in ("token", "group") else DYNAMIC_REDUCE,
        ins=(Stream("x", "element"),), outs=(Stream("q", "aux"),), exclusions=ex,
        extra_context=_lowbit_dynamic_context, shares=_dynamic_shares,
        headers=LowBitBlock.headers + ("quantization/dynamic.cuh", "quantization/lowbit_dynamic.cuh"),
        precision=lambda op, scope, mode, el, aux, arch, backend: Precision(kinds.math_kind(el), kinds.math_kind(el)))
    return quantize, dequantize, dynamic


LOWBIT_QUANTIZE, LOWBIT_DEQUANTIZE, LOWBIT_DYNAMIC_QUANTIZE = lowbit_blocks()


BLOCKS: tuple = (STATIC_QUANTIZE, STATIC_DEQUANTIZE, DYNAMIC_QUANTIZE,
                 TRAINING_STE, TRAINING_DEQUANTIZE_BACKWARD, TRAINING_FAKE_QUANTIZE, TRAINING_MASK_BACKWARD, TRAINING_LSQ,
                 LOWBIT_QUANTIZE, LOWBIT_DEQUANTIZE, LOWBIT_DYNAMIC_QUANTIZE)
