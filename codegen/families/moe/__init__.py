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
)

FAMILY = Family("moe", BLOCKS, LAUNCH_KINDS, LOCAL_MEMORY)
