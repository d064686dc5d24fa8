"""Tensor (and sequence) parallel: the per-family plans and their application; GPT-2's fused q/k/v split."""
