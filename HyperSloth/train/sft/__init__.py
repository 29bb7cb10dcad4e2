"""Supervised fine-tuning: the plan-driven SFTTrainer subclass (exact loss scale, sync before clip)."""
