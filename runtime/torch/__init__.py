"""``runtime.torch``: the PyTorch front of the training ops (imported only when asked for).

    import runtime.torch as sft
    y = sft.fake_quantize(x, scale, zero_point, scope="channel", axis=0, qmin=-128, qmax=127)
    y = sft.fake_quantize_learnable(w, scale_param, zp_param, scope="channel", axis=0)   # LSQ
    x = sft.dequantize(q, scale_param, scope="token", out_dtype="bfloat16")

Each is a ``torch.library.custom_op`` (namespace ``skuforge``) with a fake (meta) implementation
and a registered autograd formula whose backward is another custom op, so the ops work in eager
mode, under ``torch.autograd`` and under ``torch.compile(fullgraph=True)`` without graph breaks.
See docs/training.md.
"""
try:
    import torch as _torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("runtime.torch needs PyTorch (pip install torch); the functional API "
                      "(runtime.fake_quantize, ...) works without it") from e

from .ops import (FakeQuantize, LearnableFakeQuantize, dequantize, fake_quantize,  # noqa: E402
                  fake_quantize_learnable, lsq_grad_factor)

__all__ = ["fake_quantize", "fake_quantize_learnable", "dequantize", "FakeQuantize", "LearnableFakeQuantize",
           "lsq_grad_factor"]
