"""The MoE family's public ops, each declared once (runtime/signatures.py derives the functional
functions, the replay bindings and the torch ops from these).

The docstrings here are the functional functions' (``help(runtime.grouped_matmul)``).
"""
from __future__ import annotations

from ..signatures import OUT, Out, Param, Signature, array, value

_OUT = Param("out", OUT, None)


def _routing():
    return (array("row_experts", "Tensor?", None, keyword=True), array("offsets", "Tensor?", None, keyword=True))


_WORKSPACE = array("workspace", None, None, keyword=True)      # scratch memory: the torch op takes its own

GROUPED_MATMUL = Signature("grouped_matmul", (
    array("x"), array("w"), *_routing(), value("strategy", "str", "auto"), value("trusted_offsets", "bool", False),
    _OUT, _WORKSPACE), doc="""\
``y[m, n] = sum_k x[m, k] * w[e(m), n, k]`` (fp32 accumulation, one rounding); padding rows -> 0.

``out``: a C-contiguous ``(M, N)`` array of x's dtype, framework and device, not overlapping
the inputs, written and returned. ``workspace``: a uint8 array of at least
``grouped_matmul_workspace_size(M, E, routing)`` bytes for the routing tables (else one is
allocated, and a graph replay keeps its own per stream); with both, a repeated call allocates
nothing (docs/moe.md).
""")

GROUPED_MATMUL_BACKWARD = Signature("grouped_matmul_backward", (
    array("x"), array("w"), array("dy"), *_routing(), value("strategy", "str", "auto"),
    value("need_input", "bool", True), value("need_weight", "bool", True), value("dw_dtype", "str", "float32"),
    value("trusted_offsets", "bool", False), _OUT, _WORKSPACE),
    returns="(Tensor, Tensor)", out=Out(parts=("dx_out", "dw_out"), schema="Tensor(a!)? dx=None, Tensor(b!)? dw=None"),
    doc="""\
``(dx, dw)``: ``dx = dy @ w[e(m)]`` (padding rows -> 0), ``dw[e] = dy_e^T @ x_e`` (float32 by
default, exact zeros for experts with no rows). Deterministic. A gradient not asked for is None.

``out=(dx, dw)``: C-contiguous arrays to write into (dx ``(M, K)`` of x's dtype, dw
``(E, N, K)`` of ``dw_dtype``; None exactly for a gradient not asked for), returned as given;
``workspace`` as for :func:`grouped_matmul` (docs/moe.md).
""")

SIGNATURES = {s.name: s for s in (GROUPED_MATMUL, GROUPED_MATMUL_BACKWARD)}
