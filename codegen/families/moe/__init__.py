"""The MoE family: grouped matmul forward, input gradient and weight gradient (templates/moe/;
launcher: runtime/moe/grouped.py; docs/moe.md)."""
from __future__ import annotations

from ...spec import CALL_SAVES, Family, LocalMemory
from .blocks import BLOCKS
from .launch import LAUNCH_KINDS

LOCAL_MEMORY = (
    LocalMemory("sf_grouped_matmul*_route_offsets_i*", 16, "MoE routing prologue (one block): " + CALL_SAVES),
    LocalMemory("sf_grouped_matmul*_route_count", 16, "MoE routing prologue: " + CALL_SAVES),
    LocalMemory("sf_grouped_matmul_backward_input_*_simt", 16, "simt dgrad (the fallback path): " + CALL_SAVES),
    LocalMemory("sf_grouped_matmul_backward_weight_*_sm80_simt", 8, "simt wgrad (the fallback path) built for sm_90 "
                "by NVRTC 13.0, the oldest supported: 8 B of spills (none with 13.5)"),
)

FAMILY = Family("moe", BLOCKS, LAUNCH_KINDS, LOCAL_MEMORY)
