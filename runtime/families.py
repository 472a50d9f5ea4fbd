"""The runtime's kernel families, registered in one table: each launch kind's launcher.

A family is one package beside the others on one floor above the shared machinery (no family imports
another): ``runtime/quantization/`` (static, low-bit, dynamic and training quantization) and
``runtime/moe/`` (grouped matmul). Adding a family is its package, its launch kinds in runtime/axes.py
and its launchers in the table below.
"""
from __future__ import annotations

from . import plans
from .moe.grouped import MoeLauncher
from .quantization.fused import DynamicFusedLauncher, LowBitFusedLauncher
from .quantization.elementwise import ElementwiseLauncher
from .quantization.lowbit import LowBitElementwiseLauncher
from .quantization.reduce import DynamicReduceLauncher
from .quantization.training import LsqLauncher

LAUNCHERS = {
    "elementwise": ElementwiseLauncher(),
    "lowbit_elementwise": LowBitElementwiseLauncher(),
    "dynamic_fused": DynamicFusedLauncher(),
    "dynamic_reduce": DynamicReduceLauncher(),
    "lowbit_dynamic_fused": LowBitFusedLauncher(),
    "lsq": LsqLauncher(),
    "moe_gemm": MoeLauncher(),
}
plans.install(LAUNCHERS)
