"""skuforge runtime: what users import.

    import runtime as sf
    q = sf.quantize(x, scale, scope="token", out_dtype="int8")
    y = sf.dequantize(q, scale, scope="token", out_dtype="bfloat16")

Submodules: ``sku`` (vocabulary), ``registry`` (manifest queries, kernels per device),
``compiler`` (NVRTC + disk cache), ``plans`` (the plan API), ``reference`` (NumPy).
"""
from . import launch  # noqa: F401  (registers the launchers)
from .config import trusted
from .errors import DeviceRequiredError, InvalidProblemError, SkuforgeError, UnsupportedError
from .plans import Descriptor, Plan, Preference
from .quantization import dequantize, quantize
from .registry import Registry, default_registry
from .sku import KernelSku, Precision
from . import moe  # noqa: E402,F401  (issue 6: registers the "moe_gemm" launcher)
from .moe import grouped_matmul, grouped_matmul_backward  # noqa: E402

__all__ = ["quantize", "dequantize", "KernelSku", "Precision", "Registry", "default_registry", "Plan",
           "Descriptor", "Preference", "UnsupportedError", "InvalidProblemError", "SkuforgeError",
           "DeviceRequiredError", "trusted"]
__all__ += ["grouped_matmul", "grouped_matmul_backward"]
from . import training  # noqa: E402,F401  (issue 4: registers the "lsq" launcher)
from .training import (dequantize_backward, fake_quantize, fake_quantize_backward,  # noqa: E402
                       fake_quantize_learnable_backward, quantize_backward)

__all__ += ["quantize_backward", "dequantize_backward", "fake_quantize", "fake_quantize_backward",
            "fake_quantize_learnable_backward"]

from . import dynamic  # noqa: E402,F401  (issue 3: registers the "dynamic_fused"/"dynamic_reduce" launchers)
from .dynamic import dynamic_quantize  # noqa: E402
from . import lowbit  # noqa: E402,F401  (issue 5: registers the "lowbit_*" launchers; staged, docs/lowbit.md)

__all__ += ["dynamic_quantize"]


def __getattr__(name):
    # ``runtime.torch`` (the PyTorch autograd front, issue 4) is imported on first use only,
    # so that ``import runtime`` never imports torch.
    if name == "torch":
        import importlib
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
