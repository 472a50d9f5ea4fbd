"""skuforge runtime: what users import.

    import runtime as sf
    q = sf.quantize(x, scale, scope="token", out_dtype="int8")
    y = sf.dequantize(q, scale, scope="token", out_dtype="bfloat16")
    q, s, zp = sf.dynamic_quantize(x, scope="group", group_size=128)
    y = sf.grouped_matmul(x, w, offsets=offsets)

Submodules: ``sku`` (vocabulary), ``registry`` (manifest queries, kernels per device),
``compiler`` (NVRTC + disk cache), ``plans`` (the plan API), ``reference`` (NumPy),
``torch`` (autograd / torch.library front, imported on first use).
"""
from . import families  # noqa: F401  the launcher table (runtime/families.py), installed for the plans
from . import replay
from .config import sync_checks
from .errors import DeviceMismatchError, DeviceRequiredError, InvalidProblemError, SkuforgeError, UnsupportedError
from .moe import grouped_matmul, grouped_matmul_backward
from .plans import Descriptor, Plan, Preference
from .quantization import (dequantize, dequantize_backward, dynamic_quantize, fake_quantize, fake_quantize_backward,
                           fake_quantize_backward_from_mask, fake_quantize_learnable_backward, quantize,
                           quantize_backward)
from .registry import Registry, default_registry
from .sku import KernelSku, Precision
from .status import DeviceValueError, check

__all__ = [
    "quantize", "dequantize", "dynamic_quantize",
    "quantize_backward", "dequantize_backward", "fake_quantize", "fake_quantize_backward",
    "fake_quantize_backward_from_mask", "fake_quantize_learnable_backward",
    "grouped_matmul", "grouped_matmul_backward",
    "KernelSku", "Precision", "Registry", "default_registry", "Plan", "Descriptor", "Preference",
    "UnsupportedError", "InvalidProblemError", "SkuforgeError", "DeviceRequiredError", "DeviceValueError",
    "DeviceMismatchError",
    "check", "sync_checks",
]


def _load_torch():
    # runtime/replay.py, on the first torch tensor it sees: the custom ops (torch.ops.skuforge) and the
    # dispatch of a functional call that torch traces to them (runtime/torch/traced.py)
    from .torch.traced import call
    return call


replay.LOAD_TORCH = _load_torch


def __getattr__(name):
    # ``runtime.torch`` (the PyTorch autograd front, docs/training.md) is imported on first use only,
    # so that ``import runtime`` never imports torch.
    if name == "torch":
        import importlib
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
