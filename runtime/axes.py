"""The axes of the kernel matrix other than the element kinds (runtime/kinds.py), each declared once.

Everything that names an op, a scope, a mode, an arch, a backend, a MoE pass or a launch kind, in the
generator, the runtime, the harness and the docs' tables, reads it from here. The values are the SKU
string's vocabulary (runtime/sku.py) and the manifest's, so they are part of the on-disk contract:
an addition is backward compatible, a rename is not.
"""
from __future__ import annotations

# The generator's version: part of every compile-cache key and of the prebuilt index
# (runtime/compiler.py), written into the manifest (codegen/manifest.py).
GENERATOR_VERSION = "0.1.0"

NONE = "-"      # the SKU field that does not apply

CATEGORIES = ("quantization", "moe")
OPS = {
    "quantization": (
        "quantize", "dequantize", "dynamic_quantize", "quantize_backward",
        "dequantize_backward", "fake_quantize", "fake_quantize_backward",
        "fake_quantize_backward_from_mask", "fake_quantize_learnable_backward",
    ),
    "moe": ("grouped_matmul", "grouped_matmul_backward_input", "grouped_matmul_backward_weight"),
}
# The pass of each MoE op: the key of its tile-configuration tables and of SKUFORGE_MOE_CONFIG.
PASSES = {"grouped_matmul": "fwd", "grouped_matmul_backward_input": "dgrad", "grouped_matmul_backward_weight": "wgrad"}

SCOPES = ("tensor", "channel", "token", "group")
MODES = ("symmetric", "asymmetric")
ARCHES = ("sm80", "sm89", "sm90")
# In the order the registry prefers them on a device that runs several (last: preferred).
BACKENDS = ("simt", "mma", "wgmma")
# Backends built for an arch-specific target (NVRTC ``sm_90a``): their machine code runs on devices of
# exactly that compute capability (sm_90a instructions such as wgmma and setmaxnreg are not carried
# forward to later architectures).
ARCH_SPECIFIC = {"wgmma": "sm_90a"}

# How a compiled kernel is launched: the manifest's ``launch.kind``; each names one parameter list
# (declared by a family, codegen/families/) and one launcher (runtime launch table).
LAUNCH_KINDS = ("elementwise", "lowbit_elementwise", "dynamic_fused", "dynamic_reduce", "lowbit_dynamic_fused",
                "lsq", "moe_gemm")
