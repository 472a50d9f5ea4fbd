"""The kernel ABI, declared once: every entry point's parameters, by launch kind.

Each launch kind declares its groups of entry points (``main``, ``team``, ``coop``, ...) and the
parameters of each group as data: a name and its C declaration type. Rendering writes the C
signatures from these lists (``{{ k.abi.main }}`` in a template: the parenthesised parameter
list); the manifest records each list once (``manifest["abi"]``, with the packing kind of every
parameter: ``ptr``, ``i64``, ``i32``, ``u32``, ``f32``, ``f64``) and each kernel names the lists
of its groups (``launch["abi"]``); the runtime's launchers fill parameters by name
(``runtime.device.Abi``). No positional layout is written anywhere else.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from runtime.axes import LAUNCH_KINDS

TENSOR_MAP = "const __grid_constant__ CUtensorMap"   # a TMA descriptor passed by value (runtime/tma.py)
PACKING = {"i64_t": "i64", "int": "i32", "i32_t": "i32", "u32_t": "u32", "float": "f32", "double": "f64",
           TENSOR_MAP: "tmap"}


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str              # the C declaration type, e.g. "const bf16_t* __restrict__", "i64_t"

    @property
    def packing(self) -> str:
        return "ptr" if "*" in self.ctype else PACKING[self.ctype]

    def c(self) -> str:
        return f"{self.ctype} {self.name}"


class Signature:
    """One group's parameter list; ``str()`` is the C parameter list in parentheses."""

    def __init__(self, params):
        self.params = tuple(params)
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate parameter names in {names}")

    def __str__(self) -> str:
        lines, line = [], "    "
        for i, p in enumerate(self.params):
            piece = p.c() + ("," if i + 1 < len(self.params) else "")
            if len(line) + len(piece) > 100 and line.strip():
                lines.append(line.rstrip())
                line = "    "
            line += piece + " "
        lines.append(line.rstrip())
        return "(\n" + "\n".join(lines) + ")"

    def record(self) -> list:
        """[[name, packing], ...]: what the manifest stores."""
        return [[p.name, p.packing] for p in self.params]

    def key(self, kind: str, group: str) -> str:
        """A readable, content-derived id of this list in the manifest."""
        digest = hashlib.sha256(repr(self.record()).encode()).hexdigest()[:10]
        return f"{kind}.{group}.{digest}"


def _ptr(name, ctype, const=False):
    return Param(name, f"{'const ' if const else ''}{ctype}* __restrict__")


def _i64(*names):
    return [Param(n, "i64_t") for n in names]


def _int(*names):
    return [Param(n, "int") for n in names]


STATUS = Param("status", "u32_t* __restrict__")   # the device's status word (runtime/status.py), or null


def _streams(k) -> list:
    out = []
    for s in k["ins"]:
        out += [_ptr(s["name"], s["ctype"], const=True), Param(s["name"] + "_rs", "i64_t")]
    for s in k["outs"]:
        out += [_ptr(s["name"], s["ctype"]), Param(s["name"] + "_rs", "i64_t")]
    return out


def elementwise(k) -> dict:
    """Static quantize / dequantize and the straight-through / fake-quant ops
    (templates/quantization/_elementwise.cu.j2): both entry points (channel ``_rows``) share it.
    ``<stream>_bits``: the int parameter of each output the kernel may write bit-packed (context
    ``bits``). An op without a scope (fake_quantize_backward_from_mask) takes no quantization
    parameters: its streams, the shape and ``vec_ok``."""
    if k["scope"] is None:
        return {"main": _streams(k) + [*_i64("rows", "cols"), *_int("vec_ok")]}
    M = k["M"]
    bits = [p for p in k.get("bits", {}).values() if p]
    return {"main": _streams(k) + [
        _ptr("scale", M, const=True), Param("scale_value", M), _ptr("zero_point", "i32_t", const=True),
        Param("zp_value", "int"), *_i64("rows", "cols", "group_size", "chan_inner", "chan_count"),
        *_int("chan_last", "qmin", "qmax", "vec_ok", *bits), STATUS]}


def lowbit_elementwise(k) -> dict:
    """Low-bit quantize / dequantize (templates/quantization/lowbit_*.cu.j2): one float stream and
    one byte stream (fp8 codes or packed int4), e8m0 block scales beside the float ones."""
    M, F = k["M"], k["float_ctype"]
    if k["op"] == "quantize":
        streams = [_ptr("x", F, const=True), Param("x_rs", "i64_t"), _ptr("q", "u8_t"), Param("q_rs", "i64_t")]
    else:
        streams = [_ptr("q", "u8_t", const=True), Param("q_rs", "i64_t"), _ptr("y", F), Param("y_rs", "i64_t")]
    return {"main": streams + [
        _ptr("scale", M, const=True), Param("scale_value", M), _ptr("scale_e8m0", "u8_t", const=True),
        _ptr("zero_point", "i32_t", const=True), Param("zp_value", "int"),
        *_i64("rows", "cols", "group_size", "chan_inner", "chan_count"),
        *_int("chan_last", "qmin", "qmax", "vec_ok"), STATUS]}


def _fused_head(k, q_ctype, e8m0: bool) -> list:
    M = k["M"]
    return [_ptr("x", k["ins"][0]["ctype"], const=True), Param("x_rs", "i64_t"), _ptr("q", q_ctype),
            Param("q_rs", "i64_t"), _ptr("scale", M)] + ([_ptr("scale_e8m0", "u8_t")] if e8m0 else []) + \
           [_ptr("zero_point", "i32_t"), *_i64("rows", "cols", "group_size"), Param("eps", M),
            *_int("qmin", "qmax", "zp_value")]


def dynamic_fused(k) -> dict:
    """Per-token / per-group dynamic quantization in one pass (dynamic_fused.cu.j2): the block
    kernel (``main``) and the team kernels ``<symbol>_t<P>[_tx<TX>]`` (``team``)."""
    head = _fused_head(k, k["out_ctype"], False)
    return {"main": head + _int("vec_ok"),
            "team": head + _int("tx", "ch", "dense") + _i64("ngroups")}


def lowbit_dynamic_fused(k) -> dict:
    """The low-bit fused pass (lowbit_dynamic_fused.cu.j2): codes are bytes, MX scales a byte array."""
    head = _fused_head(k, "u8_t", True)
    return {"main": head + _int("vec_ok"),
            "team": head + _int("tx", "ch", "dense") + _i64("ngroups")}


def dynamic_reduce(k) -> dict:
    """Per-tensor / per-channel ranges, two phases (dynamic_reduce.cu.j2); ``coop``: the per-tensor
    cooperative kernel ``<symbol>_coop`` (dynamic_tensor.cu.j2), ``chan``: the one-launch per-channel
    kernel ``<symbol>_chan`` (dynamic_channel.cu.j2), where the SKU has them."""
    M, T = k["M"], k["ins"][0]["ctype"]
    out = {"main": [
        _ptr("x", T, const=True), Param("x_rs", "i64_t"), _ptr("partial", M), _ptr("scale", M),
        _ptr("zero_point", "i32_t"), *_i64("rows", "cols", "chan_inner", "chan_count"), *_int("chan_last"),
        *_i64("row_parts", "col_chunk"), *_int("tx_width"), Param("eps", M),
        *_int("qmin", "qmax", "zp_value", "vec_ok", "flat", "phase")]}
    if k.get("coop"):
        out["coop"] = [
            _ptr("x", T, const=True), _ptr("q", k["out_ctype"]), _ptr("partial", M), _ptr("count", "u32_t"),
            _ptr("scale", M), _ptr("zero_point", "i32_t"), *_i64("n"), *_int("keep_tiles", "width"),
            Param("eps", M), *_int("qmin", "qmax", "zp_value")]
    if k.get("chan"):
        out["chan"] = [
            _ptr("x", T, const=True), _ptr("q", k["out_ctype"]), _ptr("colmax", "u64_t" if M == "double" else "u32_t"),
            _ptr("count", "u32_t"), _ptr("scale", M), _ptr("zero_point", "i32_t"), *_i64("rows", "cols"),
            *_int("tx_width", "col_tiles", "row_parts", "keep_tiles"), Param("eps", M),
            *_int("qmin", "qmax", "zp_value")]
    return out


def lsq(k) -> dict:
    """fake_quantize_learnable_backward (fake_quantize_learnable_backward.cu.j2): the element pass
    (``main``) and the per-scale-element finish pass ``<symbol>_finish`` (``finish``)."""
    M, T = k["M"], k["out_ctype"]
    return {
        "main": [_ptr("dy", T, const=True), Param("dy_rs", "i64_t"), _ptr("x", T, const=True), Param("x_rs", "i64_t"),
                 _ptr("dx", T), Param("dx_rs", "i64_t"), _ptr("scale", M, const=True), Param("scale_value", M),
                 _ptr("zero_point", "i32_t", const=True), Param("zp_value", "int"), _ptr("ds", M),
                 _ptr("dz", "float"), _ptr("ds_part", M), _ptr("dz_part", M),
                 *_i64("rows", "cols", "seg_len", "chan_inner", "chan_count"), *_int("chan_last", "team"),
                 *_i64("tile_rows"), *_int("qmin", "qmax"), Param("grad_factor", M), *_int("vec_ok"), STATUS],
        "finish": [_ptr("ds_part", M, const=True), _ptr("dz_part", M, const=True), _ptr("ds", M),
                   _ptr("dz", "float"), *_i64("count", "inner", "n_items"), *_int("team")],
    }


def moe_gemm(k) -> dict:
    """Grouped matmul (templates/moe/grouped_matmul.cu.j2): the persistent kernel of every tile
    variant (``gemm``) and the routing prologue ``<symbol>_route_*``. ``ws_status``: the
    workspace's offsets verdict; ``status``: the device's status word. The wgmma kernels also take
    the tensor maps of their two operands and of the output (``tmap_a``, ``tmap_b``, ``tmap_c``:
    runtime/tma.py)."""
    T = k["T"]
    maps = [Param(m, TENSOR_MAP) for m in ("tmap_a", "tmap_b", "tmap_c")] if k["backend"] == "wgmma" else []

    def offsets(ctype):
        return [Param("off", f"const {ctype}*"), *_int("E"), *_i64("M"), *_int("bm", "trusted"),
                Param("ws_status", "i32_t*"), Param("row_start", "i64_t*"), Param("tile_start", "i64_t*"),
                Param("counters", "u64_t*"), Param("status", "u32_t*")]
    return {
        "gemm": [_ptr("x", T, const=True), Param("ldx", "i64_t"), _ptr("w", T, const=True),
                 *_i64("w_se", "w_sn"), _ptr("dy", T, const=True), Param("lddy", "i64_t"), _ptr("out", k["OUT"]),
                 *_i64("M", "N", "K"), *_int("E"), _ptr("perm", "i32_t", const=True),
                 _ptr("row_start", "i64_t", const=True), _ptr("tile_start", "i64_t", const=True),
                 _ptr("ws_status", "i32_t", const=True), Param("counter", "u64_t*"), *maps],
        "route_offsets_i32": offsets("i32_t"),
        "route_offsets_i64": offsets("i64_t"),
        "route_count": [Param("ids", "const u32_t*"), *_i64("M"), *_int("E"), *_i64("chunk_rows", "chunks"),
                        Param("hist", "i32_t*")],
        "route_scan": [Param("hist", "const i32_t*"), *_int("E"), *_i64("M", "chunks"), *_int("bm"),
                       Param("base", "u32_t*"), Param("row_start", "i64_t*"), Param("tile_start", "i64_t*"),
                       Param("ws_status", "i32_t*"), Param("counters", "u64_t*")],
        "route_scatter": [Param("ids", "const u32_t*"), *_i64("M"), *_int("E"), *_i64("chunk_rows", "chunks"),
                          Param("base", "const u32_t*"), Param("perm", "i32_t*")],
    }


# launch kind -> its declaration (kernel context -> {group: [Param, ...]})
DECLARATIONS = {
    "elementwise": elementwise,
    "lowbit_elementwise": lowbit_elementwise,
    "dynamic_fused": dynamic_fused,
    "lowbit_dynamic_fused": lowbit_dynamic_fused,
    "dynamic_reduce": dynamic_reduce,
    "lsq": lsq,
    "moe_gemm": moe_gemm,
}
if set(DECLARATIONS) != set(LAUNCH_KINDS):
    raise ImportError(f"codegen/abi.py declares {tuple(DECLARATIONS)}; runtime/axes.py's launch kinds are {LAUNCH_KINDS}")


def signatures(kind: str, ctx) -> dict:
    """{group: Signature} of a kernel of launch kind ``kind`` (its rendering context ``ctx``)."""
    return {group: Signature(params) for group, params in DECLARATIONS[kind](ctx).items()}
