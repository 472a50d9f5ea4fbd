"""The quantization family: static quantize / dequantize (``static``, with the elementwise launcher in
``elementwise``), fp8 / int4 / e8m0 formats (``lowbit``), dynamic quantization (``dynamic``) and the
training ops (``training``); docs/api.md, docs/lowbit.md, docs/dynamic.md, docs/training.md."""
from .dynamic import dynamic_quantize
from .elementwise import ElementwiseLauncher
from .fused import DynamicFusedLauncher, LowBitFusedLauncher
from .lowbit import LowBitElementwiseLauncher
from .reduce import DynamicReduceLauncher
from .static import dequantize, quantize
from .training import (
                       LsqLauncher,
                       dequantize_backward,
                       fake_quantize,
                       fake_quantize_backward,
                       fake_quantize_backward_from_mask,
                       fake_quantize_learnable_backward,
                       quantize_backward,
)

# the family's launch kinds (runtime/axes.py) -> their launchers (the registration: runtime/families.py)
LAUNCHERS = {
    "elementwise": ElementwiseLauncher(),
    "lowbit_elementwise": LowBitElementwiseLauncher(),
    "dynamic_fused": DynamicFusedLauncher(),
    "dynamic_reduce": DynamicReduceLauncher(),
    "lowbit_dynamic_fused": LowBitFusedLauncher(),
    "lsq": LsqLauncher(),
}

__all__ = ["quantize", "dequantize", "dynamic_quantize", "quantize_backward", "dequantize_backward", "fake_quantize",
           "fake_quantize_backward", "fake_quantize_backward_from_mask", "fake_quantize_learnable_backward"]
