"""The MoE family: grouped matmul forward and backward (docs/moe.md): ``problem`` (routing, arguments,
workspace layout, the checks that need no device), ``variants`` (the tile configurations and the
choice among them), ``grouped`` (the launcher, plan selection and the functional API), with the
public configuration helpers here."""
from .grouped import MoeLauncher, grouped_matmul, grouped_matmul_backward, grouped_matmul_workspace_size, select_plan, validate_offsets
from .variants import CONFIG, default_variant, use_config, variant_for, variant_names

# the family's launch kinds (runtime/axes.py) -> their launchers (the registration: runtime/families.py)
LAUNCHERS = {"moe_gemm": MoeLauncher()}

__all__ = ["grouped_matmul", "grouped_matmul_backward", "grouped_matmul_workspace_size", "select_plan", "use_config",
           "variant_for", "variant_names", "default_variant", "validate_offsets", "CONFIG"]
