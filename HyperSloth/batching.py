"""The planner's import path from before the package was grouped by stage, kept for user code:
`from HyperSloth.batching import adaptive_partition_batches` still works. The planner lives in
HyperSloth/plan/batching.py; this module only re-exports its public names (same objects)."""

from HyperSloth.plan.batching import (
    EpochPlan,
    PlanSpec,
    PlanStats,
    StepPlan,
    adaptive_partition_batches,
    sample_token_counts,
    steps_per_epoch,
)

__all__ = ["EpochPlan", "PlanSpec", "PlanStats", "StepPlan", "adaptive_partition_batches", "sample_token_counts",
           "steps_per_epoch"]
