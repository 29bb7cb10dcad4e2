"""HyperSloth's LoRA projections: the autograd passes (passes) and their installation in place of Unsloth's
per-layer hooks (install)."""
