"""``runtime.torch``: every skuforge op as a PyTorch custom op (imported only when asked for).

    import runtime.torch as sft
    q, s, _ = sft.dynamic_quantize(x, scope="token")                     # torch.ops.skuforge.dynamic_quantize
    y = sft.grouped_matmul(x, w, offsets=offsets)                         # differentiable in x and w
    y = sft.fake_quantize_learnable(w, scale_param, zp_param, scope="channel", axis=0)   # LSQ
    torch.ops.skuforge.quantize.out(x, scale, None, "token", out=q_buf)  # the .out overloads

Importing it registers ``torch.ops.skuforge.<op>`` for every functional op (``quantize``,
``dequantize``, ``dynamic_quantize``, ``quantize_backward``, ``dequantize_backward``,
``fake_quantize(_backward)``, ``fake_quantize_with_mask``, ``fake_quantize_backward_from_mask``,
``fake_quantize_learnable(_backward)``, ``grouped_matmul(_backward)``),
each a ``torch.library`` custom op with a fake implementation (exact shapes, dtypes, strides and the
functional API's typed errors), ``.out`` overloads where the functional API takes ``out=``, and
autograd where a user differentiates (fake-quant, quantize / dequantize straight-through, grouped
matmul). They run in eager mode, under ``torch.compile(fullgraph=True)`` (dynamic shapes too) and
in CUDA graphs (``mode="reduce-overhead"``). The functions here are thin wrappers over the ops with
the functional API's signatures; ``quantize`` then ``dequantize`` is the straight-through estimator
(docs/training.md). The functional API itself (``runtime.quantize(...)``) on torch tensors becomes
these ops while torch traces it (runtime/torch/traced.py). See docs/torch.md.
"""
try:
    import torch as _torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("runtime.torch needs PyTorch (pip install torch); the functional API "
                      "(runtime.fake_quantize, ...) works without it") from e

from runtime.config import settings as _settings  # noqa: E402
from runtime.moe.signatures import SIGNATURES as _MOE  # noqa: E402
from runtime.quantization.signatures import SIGNATURES as _QUANTIZATION  # noqa: E402

from . import library  # noqa: E402,F401
from .moe import grouped_matmul, grouped_matmul_backward  # noqa: E402
from .quantization import (FakeQuantize, LearnableFakeQuantize, dequantize, dequantize_backward,  # noqa: E402
                           dynamic_quantize, fake_quantize, fake_quantize_backward, fake_quantize_backward_from_mask,
                           fake_quantize_learnable, fake_quantize_learnable_backward, lsq_grad_factor, quantize,
                           quantize_backward)

# the settings are read now (if no call has read them yet): a first read under torch.compile, which
# traces what the functional API reads, would make Dynamo trace the environment's parsing
_settings()

OPS = tuple(_QUANTIZATION) + tuple(_MOE)                        # torch.ops.skuforge.<op>
OUT_OPS = tuple(n for n, s in {**_QUANTIZATION, **_MOE}.items() if s.out is not None)     # with a .out overload

__all__ = ["quantize", "dequantize", "dynamic_quantize", "quantize_backward", "dequantize_backward",
           "fake_quantize", "fake_quantize_backward", "fake_quantize_backward_from_mask", "fake_quantize_learnable",
           "fake_quantize_learnable_backward",
           "grouped_matmul", "grouped_matmul_backward", "FakeQuantize", "LearnableFakeQuantize", "lsq_grad_factor",
           "OPS", "OUT_OPS"]
