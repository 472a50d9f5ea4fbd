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

__all__ = ["quantize", "dequantize", "KernelSku", "Precision", "Registry", "default_registry", "Plan",
           "Descriptor", "Preference", "UnsupportedError", "InvalidProblemError", "SkuforgeError",
           "DeviceRequiredError", "trusted"]
