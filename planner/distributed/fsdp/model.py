"""FSDP2 on a live model (``estimators.tracing.sharded_model``): the units ``fully_shard`` was
called on, and the class names it hides.

    fsdp_units_of(model)           # ['GPT', 'GPT.blocks.0', ...]: the units to plan for
    original_class_name(model)     # 'GPT' for FSDP2's swapped-in 'FSDPGPT'
"""

from estimators.tracing.sharded_model import fsdp_units_of, original_class_name

__all__ = ["fsdp_units_of", "original_class_name"]
