"""From a resolved run and a built dataset to the planner's inputs; shared by the trainer and `hypersloth-plan`.

Torch-free, so the plan preview stays fast and GPU-free, and the preview plans exactly what training will.
"""

from __future__ import annotations

import numpy as np

from HyperSloth.plan.batching import PlanSpec, sample_token_counts
from HyperSloth.plan.run import RunDescription


def plan_spec_for(run: RunDescription) -> PlanSpec:
    """The planner's parameters of a resolved run (`HyperSloth.plan.run.resolve_run`)."""
    return PlanSpec(
        num_ranks=run.world_size,
        samples_per_step=run.global_batch_size,
        mode=run.batching,
        micro_batch_size=run.micro_batch_size,
        token_budget=run.token_budget,
        group_by_length=run.group_by_length,
        group_window_steps=run.group_window_steps,
        seed=run.seed,
        **({} if run.attention_coef is None else {"attention_coef": run.attention_coef}),
    )


def dataset_lengths(dataset, loss_type: str, max_seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, trainable-token counts) of a built dataset (`batching.sample_token_counts`); ValueError,
    saying what to change, for an empty dataset or samples longer than max_seq_length."""
    lengths, trainable = sample_token_counts(dataset, loss_type)
    if lengths.size == 0:
        raise ValueError("the dataset is empty: rebuild it from a file with samples")
    longest = int(lengths.max())
    if longest > max_seq_length:
        raise ValueError(
            f"the dataset holds samples of up to {longest} tokens but fast_model_args.max_seq_length is "
            f"{max_seq_length}: raise max_seq_length or rebuild the dataset with --max_seq_length {max_seq_length}"
        )
    return lengths, trainable
