"""A Plan applied to a live model: checkpoint wrappers, recompute state, offload."""
