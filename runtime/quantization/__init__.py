"""The quantization family: static quantize / dequantize (``static``, with the elementwise launcher in
``elementwise``), fp8 / int4 / e8m0 formats (``lowbit``), dynamic quantization (``dynamic``) and the
training ops (``training``); docs/api.md, docs/lowbit.md, docs/dynamic.md, docs/training.md."""
from .dynamic import dynamic_quantize
from .static import dequantize, quantize
from .training import (
                       dequantize_backward,
                       fake_quantize,
                       fake_quantize_backward,
                       fake_quantize_backward_from_mask,
                       fake_quantize_learnable_backward,
                       quantize_backward,
)

__all__ = ["quantize", "dequantize", "dynamic_quantize", "quantize_backward", "dequantize_backward", "fake_quantize",
           "fake_quantize_backward", "fake_quantize_backward_from_mask", "fake_quantize_learnable_backward"]
