"""The MoE family: grouped matmul forward and backward (``grouped``; docs/moe.md), with its public
configuration helpers (tile variants, workspace size, offsets validation)."""
from .grouped import (CONFIG, default_variant, grouped_matmul, grouped_matmul_backward, grouped_matmul_workspace_size,
                      select_plan, use_config, validate_offsets, variant_for, variant_names)

__all__ = ["grouped_matmul", "grouped_matmul_backward", "grouped_matmul_workspace_size", "select_plan", "use_config",
           "variant_for", "variant_names", "default_variant", "validate_offsets", "CONFIG"]
