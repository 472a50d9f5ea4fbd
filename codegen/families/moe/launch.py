"""The MoE family's launch kind: the grouped-matmul kernels' entry points and their parameter lists."""
from __future__ import annotations

from ...abi import TENSOR_MAP, Param, i64s, ints, ptr
from ...spec import LaunchKind


def _moe_gemm_abi(k) -> dict:
    """Grouped matmul (templates/moe/grouped_matmul.cu.j2): the persistent kernel of every tile
    variant (``gemm``) and the routing prologue ``<symbol>_route_*``. ``ws_status``: the
    workspace's offsets verdict; ``status``: the device's status word. The wgmma kernels also take
    the tensor maps of their two operands and of the output (``tmap_a``, ``tmap_b``, ``tmap_c``:
    runtime/tma.py)."""
    T = k["T"]
    maps = [Param(m, TENSOR_MAP) for m in ("tmap_a", "tmap_b", "tmap_c")] if k["backend"] == "wgmma" else []

    def offsets(ctype):
        return [Param("off", f"const {ctype}*"), *ints("E"), *i64s("M"), *ints("bm", "trusted"),
                Param("ws_status", "i32_t*"), Param("row_start", "i64_t*"), Param("tile_start", "i64_t*"),
                Param("counters", "u64_t*"), Param("status", "u32_t*")]
    return {
        "gemm": [ptr("x", T, const=True), Param("ldx", "i64_t"), ptr("w", T, const=True),
                 *i64s("w_se", "w_sn"), ptr("dy", T, const=True), Param("lddy", "i64_t"), ptr("out", k["OUT"]),
                 *i64s("M", "N", "K"), *ints("E"), ptr("perm", "i32_t", const=True),
                 ptr("row_start", "i64_t", const=True), ptr("tile_start", "i64_t", const=True),
                 ptr("ws_status", "i32_t", const=True), Param("counter", "u64_t*"), *maps],
        "route_offsets_i32": offsets("i32_t"),
        "route_offsets_i64": offsets("i64_t"),
        "route_count": [Param("ids", "const u32_t*"), *i64s("M"), *ints("E"), *i64s("chunk_rows", "chunks"),
                        Param("hist", "i32_t*")],
        "route_scan": [Param("hist", "const i32_t*"), *ints("E"), *i64s("M", "chunks"), *ints("bm"),
                       Param("base", "u32_t*"), Param("row_start", "i64_t*"), Param("tile_start", "i64_t*"),
                       Param("ws_status", "i32_t*"), Param("counters", "u64_t*")],
        "route_scatter": [Param("ids", "const u32_t*"), *i64s("M"), *ints("E"), *i64s("chunk_rows", "chunks"),
                          Param("base", "const u32_t*"), Param("perm", "i32_t*")],
    }


# The routing prologue: one block of ROUTE_THREADS for the offsets and scan kernels, blocks of
# ROUTE_WARPS warps (one chunk of rows each) for the count and scatter kernels.
MOE_ROUTE = ("offsets_i32", "offsets_i64", "count", "scan", "scatter")
ROUTE_THREADS = 1024
ROUTE_WARPS = 8


def _moe_entries(k) -> dict:
    """The default tile variant's persistent kernel (``main``, of ABI group ``gemm``; the other variants'
    symbols are recorded with their tiles, ``launch["variants"]``) and the routing prologue's kernels
    (``route_*``)."""
    return {"main": ("gemm", ""), **{f"route_{r}": (f"route_{r}", f"_route_{r}") for r in MOE_ROUTE}}


MOE_GEMM = LaunchKind("moe_gemm", _moe_gemm_abi, _moe_entries)
LAUNCH_KINDS = (MOE_GEMM,)
