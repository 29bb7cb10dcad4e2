"""GRPO: a sibling of sft/ and dpo/ sharing the planner, the gradient sync and the trainer (docs/grpo.md)."""
