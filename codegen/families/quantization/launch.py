"""The quantization family's launch kinds: each one's entry points and their parameter lists, and its
schedule variants (how one launch is laid out on the GPU).

A SKU is what a kernel computes; a schedule is how one launch of it is laid out (threads per block,
grid shape, the launch configuration of its team kernels). Each launch kind that has more than one
way to run declares its schedules here, as data, the first being its default; every SKU of that kind
carries them all in its manifest launch metadata (``schedules``, ``default_schedule``), and the
runtime picks one per problem from the tuning table (``codegen/families/quantization/tuning/<arch>.json``, written by
``python -m codegen tune``; rule: docs/tuning.md). ``python -m codegen verify`` runs every SKU under
each of its schedules.

Schedule parameters by launch kind (read by the kind's launcher in runtime/quantization/:
elementwise.py, lowbit.py, fused.py, reduce.py):

- ``elementwise`` (static s8 / u8 quantize and dequantize, the straight-through and fake-quantize
  passes): ``threads`` per block (at most the kernels' ``__launch_bounds__``, 256); for the columns
  layout (group scope, channel on the last axis) ``grid``: ``persistent`` (at most the resident
  blocks; a thread walks its rows) or ``full`` (one block per step of rows, nothing walked twice),
  and ``columns``: ``2d`` (column blocks in the grid's y: a thread owns one column vector) or ``1d``
  (a block spans the row and loops).
- ``lowbit_elementwise`` (static fp8 / int4 quantize and dequantize; one block per group of rows):
  ``threads`` per block.
- ``dynamic_fused`` / ``lowbit_dynamic_fused`` (per-token and per-group dynamic quantize):
  ``config``, a launch configuration of the SKU's fused kernels (runtime.quantization.fused.FusedConfig: the
  team kernel ``t16``/``t8``/``t4``/``t2`` with its threads per block, or the block kernel; ``auto``
  is the size rule of docs/dynamic.md).
- ``dynamic_reduce`` (per-tensor and per-channel dynamic quantize, on the SKUs that have a one-launch
  kernel): ``path``, ``one`` (the one-launch kernel where the layout allows it: per tensor over a
  contiguous x, per channel on the last axis of a contiguous x) or ``two`` (reduce, then the static
  quantize kernel: x read twice).
"""
from __future__ import annotations

from ...abi import STATUS, Param, i64s, ints, ptr, streams
from ...spec import LaunchKind, schedule


def _elementwise_abi(k) -> dict:
    """Static quantize / dequantize and the straight-through / fake-quant ops
    (templates/quantization/elementwise.cuh): both entry points (channel ``_rows``) share it.
    ``<stream>_bits``: the int parameter of each output the kernel may write bit-packed (context
    ``bits``). An op without a scope (fake_quantize_backward_from_mask) takes no quantization
    parameters: its streams, the shape and ``vec_ok``."""
    if k["scope"] is None:
        return {"main": streams(k) + [*i64s("rows", "cols"), *ints("vec_ok")]}
    M = k["M"]
    bits = [p for p in k.get("bits", {}).values() if p]
    return {"main": streams(k) + [
        ptr("scale", M, const=True), Param("scale_value", M), ptr("zero_point", "i32_t", const=True),
        Param("zp_value", "int"), *i64s("rows", "cols", "group_size", "chan_inner", "chan_count"),
        *ints("chan_last", "qmin", "qmax", "vec_ok", *bits), STATUS]}


def _lowbit_elementwise_abi(k) -> dict:
    """Low-bit quantize / dequantize (templates/quantization/lowbit_*.cu.j2): one float stream and
    one byte stream (fp8 codes or packed int4), e8m0 block scales beside the float ones."""
    M, F = k["M"], k["float_ctype"]
    if k["op"] == "quantize":
        streams = [ptr("x", F, const=True), Param("x_rs", "i64_t"), ptr("q", "u8_t"), Param("q_rs", "i64_t")]
    else:
        streams = [ptr("q", "u8_t", const=True), Param("q_rs", "i64_t"), ptr("y", F), Param("y_rs", "i64_t")]
    return {"main": streams + [
        ptr("scale", M, const=True), Param("scale_value", M), ptr("scale_e8m0", "u8_t", const=True),
        ptr("zero_point", "i32_t", const=True), Param("zp_value", "int"),
        *i64s("rows", "cols", "group_size", "chan_inner", "chan_count"),
        *ints("chan_last", "qmin", "qmax", "vec_ok"), STATUS]}


def _fused_head(k, q_ctype, e8m0: bool) -> list:
    M = k["M"]
    return [ptr("x", k["ins"][0]["ctype"], const=True), Param("x_rs", "i64_t"), ptr("q", q_ctype),
            Param("q_rs", "i64_t"), ptr("scale", M)] + ([ptr("scale_e8m0", "u8_t")] if e8m0 else []) + \
           [ptr("zero_point", "i32_t"), *i64s("p_rs", "p_gs", "rows", "cols", "group_size"), Param("eps", M),
            *ints("qmin", "qmax", "zp_value")]


def _dynamic_fused_abi(k) -> dict:
    """Per-token / per-group dynamic quantization in one pass (dyn::fused and dyn::team): the block
    kernel (``main``) and the team kernels ``<symbol>_t<P>[_tx<TX>]`` (``team``)."""
    head = _fused_head(k, k["out_ctype"], False)
    return {"main": head + ints("vec_ok"),
            "team": head + ints("tx", "ch", "dense") + i64s("ngroups")}


def _lowbit_dynamic_fused_abi(k) -> dict:
    """The low-bit fused pass (lowbit::fused and dyn::team): codes are bytes, MX scales a byte array."""
    head = _fused_head(k, "u8_t", True)
    return {"main": head + ints("vec_ok"),
            "team": head + ints("tx", "ch", "dense") + i64s("ngroups")}


def _dynamic_reduce_abi(k) -> dict:
    """Per-tensor / per-channel ranges, two phases (dyn::reduce); ``coop``: the per-tensor
    cooperative kernel ``<symbol>_coop`` (dyn::coop), ``chan``: the one-launch per-channel
    kernel ``<symbol>_chan`` (dyn::chan), where the SKU has them."""
    M, T = k["M"], k["ins"][0]["ctype"]
    out = {"main": [
        ptr("x", T, const=True), Param("x_rs", "i64_t"), ptr("partial", M), ptr("scale", M),
        ptr("zero_point", "i32_t"), *i64s("rows", "cols", "chan_inner", "chan_count"), *ints("chan_last"),
        *i64s("row_parts", "col_chunk"), *ints("tx_width"), Param("eps", M),
        *ints("qmin", "qmax", "zp_value", "vec_ok", "flat", "phase")]}
    if k.get("coop"):
        out["coop"] = [
            ptr("x", T, const=True), ptr("q", k["out_ctype"]), ptr("partial", M), ptr("count", "u32_t"),
            ptr("scale", M), ptr("zero_point", "i32_t"), *i64s("n"), *ints("keep_tiles", "width"),
            Param("eps", M), *ints("qmin", "qmax", "zp_value")]
    if k.get("chan"):
        out["chan"] = [
            ptr("x", T, const=True), ptr("q", k["out_ctype"]), ptr("colmax", "u64_t" if M == "double" else "u32_t"),
            ptr("count", "u32_t"), ptr("scale", M), ptr("zero_point", "i32_t"), *i64s("rows", "cols"),
            *ints("tx_width", "col_tiles", "row_parts", "keep_tiles"), Param("eps", M),
            *ints("qmin", "qmax", "zp_value")]
    return out


def _lsq_abi(k) -> dict:
    """fake_quantize_learnable_backward (templates/quantization/lsq.cuh): the element pass
    (``main``) and the per-scale-element finish pass ``<symbol>_finish`` (``finish``)."""
    M, T = k["M"], k["out_ctype"]
    return {
        "main": [ptr("dy", T, const=True), Param("dy_rs", "i64_t"), ptr("x", T, const=True), Param("x_rs", "i64_t"),
                 ptr("dx", T), Param("dx_rs", "i64_t"), ptr("scale", M, const=True), Param("scale_value", M),
                 ptr("zero_point", "i32_t", const=True), Param("zp_value", "int"), ptr("ds", M),
                 ptr("dz", "float"), ptr("ds_part", M), ptr("dz_part", M),
                 *i64s("rows", "cols", "seg_len", "chan_inner", "chan_count"), *ints("chan_last", "team"),
                 *i64s("tile_rows"), *ints("qmin", "qmax"), Param("grad_factor", M), *ints("vec_ok"), STATUS],
        "finish": [ptr("ds_part", M, const=True), ptr("dz_part", M, const=True), ptr("ds", M),
                   ptr("dz", "float"), *i64s("count", "inner", "n_items"), *ints("team")],
    }


# -- schedules ------------------------------------------------------------------------------------
_ELEMENTWISE = (
    schedule("b256", threads=256, grid="persistent", columns="2d"),   # default
    schedule("b256-full", threads=256, grid="full", columns="2d"),
    schedule("b128", threads=128, grid="persistent", columns="2d"),
    schedule("b128-full", threads=128, grid="full", columns="2d"),
    schedule("b256-1d", threads=256, grid="persistent", columns="1d"),
    schedule("b64", threads=64, grid="full", columns="2d"),
    schedule("r256", threads=256, entry="vrows"),                     # the row-vectors layout, where
    schedule("r128", threads=128, entry="vrows"),                     # the SKU has it
)
# the low-bit static kernels walk rows only (one block per row group: the grid is always full)
_ROWS = (
    schedule("b256", threads=256),                                     # default
    schedule("b128", threads=128),
    schedule("b64", threads=64),
)
_FUSED = (
    schedule("auto", config="auto"),                                   # default: the size rule
    schedule("t16", config="t16"),
    schedule("t8", config="t8"),                                       # team kernels: 128 threads a block
    schedule("t8-b256", config="t8,threads=256"),
    schedule("t4", config="t4"),
    schedule("t2", config="t2"),
    schedule("block", config="block"),
)
_REDUCE = (
    schedule("one-launch", path="one"),                                # default
    schedule("two-pass", path="two"),
)

# -- entry points: {name: (ABI group, symbol suffix)} -------------------------------------------------
def _elementwise_entries(k) -> dict:
    """One entry point per layout of one parameter list (``layouts``, codegen/families/quantization/
    blocks.py): ``main`` (the SKU's layout; channel: axis = last, the columns layout), ``rows`` (channel,
    another axis: the rows layout) and ``vrows`` (the row-vectors layout), each with the registers its
    own layout needs."""
    return {name: ("main", "" if name == "main" else f"_{name}") for name in k.get("layouts", ("main",))}


def _fused_entries(k) -> dict:
    """The block kernel (``main``) and the team kernels: ``t<P>`` per chunk budget P (run-time threads
    per row group) and ``t<P>_tx<TX>`` for the fixed-TX ones its unit compiles (``team_compiled``: those
    of its scope, and of the SKUs that launch its team kernels)."""
    team = {f"t{p}": ("team", f"_t{p}") for p in k["team_chunks"]}
    team.update({f"t{p}_tx{tx}": ("team", f"_t{p}_tx{tx}") for p, _, tx in k["team_compiled"]})
    return {"main": ("main", ""), **team}


def _reduce_entries(k) -> dict:
    """The two-phase reduction (``main``), and where the SKU has them the one-launch per-tensor
    (``coop``) and per-channel (``chan``) kernels."""
    return {"main": ("main", ""), **{g: (g, f"_{g}") for g in ("coop", "chan") if k.get(g)}}


def _lsq_entries(k) -> dict:
    """The element pass (``main``) and, for the scopes whose partial sums need one, the finish pass."""
    return {"main": ("main", ""), **({"finish": ("finish", "_finish")} if k["scope"] in ("tensor", "channel") else {})}


ELEMENTWISE = LaunchKind("elementwise", _elementwise_abi, _elementwise_entries, _ELEMENTWISE)
LOWBIT_ELEMENTWISE = LaunchKind("lowbit_elementwise", _lowbit_elementwise_abi, schedules=_ROWS)
DYNAMIC_FUSED = LaunchKind("dynamic_fused", _dynamic_fused_abi, _fused_entries, _FUSED)
LOWBIT_DYNAMIC_FUSED = LaunchKind("lowbit_dynamic_fused", _lowbit_dynamic_fused_abi, _fused_entries, _FUSED)
# only the SKUs that have a one-launch kernel choose between one launch and two passes
DYNAMIC_REDUCE = LaunchKind("dynamic_reduce", _dynamic_reduce_abi, _reduce_entries, _REDUCE,
                            scheduled=lambda ctx: bool(ctx.get("coop") or ctx.get("chan")))
LSQ = LaunchKind("lsq", _lsq_abi, _lsq_entries)
LAUNCH_KINDS = (ELEMENTWISE, LOWBIT_ELEMENTWISE, DYNAMIC_FUSED, LOWBIT_DYNAMIC_FUSED, DYNAMIC_REDUCE, LSQ)
