"""The automatic token budget (`tokens_per_micro_batch="auto"`): settle (load, measure, decide: checkpointing and
Unsloth's tiled MLP when the longest sample needs them), probe (the measurements on this GPU), choice (the
arithmetic, no torch), cache (the measurements kept per model and GPU)."""
