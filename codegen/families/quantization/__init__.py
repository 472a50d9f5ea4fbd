"""The quantization family: static, dynamic, low-bit and training quantization kernels
(templates/quantization/; their launchers: runtime/quantization/ elementwise.py, lowbit.py, fused.py,
reduce.py, training.py; docs/api.md, docs/dynamic.md, docs/lowbit.md, docs/training.md)."""
from __future__ import annotations

from ...spec import CALL_SAVES, Family, LocalMemory
from .blocks import BLOCKS
from .launch import LAUNCH_KINDS

LOCAL_MEMORY = (
    LocalMemory("sf_fake_quantize_learnable_backward_*", 16, "LSQ element pass: " + CALL_SAVES),
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
    # spills of the oldest supported NVRTC (13.0; none with 13.5): the build must pass with every NVRTC it accepts
    LocalMemory("sf_dequantize_channel_symmetric_s8_f32_sm80_simt", 8, "s8 -> f32 per-channel dequantize built for "
                "sm_80 by NVRTC 13.0: 12 B of spills"),
    LocalMemory("sf_dynamic_quantize_group_symmetric_f16_fp8_e?m?_sm80_simt_t16", 8, "f16 -> fp8 group team kernel "
                "(software conversion) built for sm_90 by NVRTC 13.0: 4 B of spills"),
)

FAMILY = Family("quantization", BLOCKS, LAUNCH_KINDS, LOCAL_MEMORY)
