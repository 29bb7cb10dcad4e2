"""The DPO trainer: the SFT trainer's plan-driven steps, gradient sync and clipping, with a pair loss.

`HyperSlothDPOTrainer` subclasses `HyperSlothTrainer` and replaces only what differs for preference pairs:

- the plan unit is a pair (its `length` is both packed sequences, 2 x prompt + chosen + rejected), so
  the planner never splits a pair across micro-batches or ranks, and its "trainable" count is 1 per
  pair: the step's `num_items_in_batch` is the step's global pair count, the loss denominator;
- a micro-batch's loss is the sum of its pairs' DPO losses / global pairs (`preference.dpo_loss`), and
  the four reward sums travel in the same all-reduce as the loss, so the step's `rewards/*` are exact
  means over the step's pairs on every rank (TRL's names and definitions);
- evaluation is the SFT evaluator's exact one-all-reduce scheme over held-out pairs (`PairEvaluator`):
  eval_loss = mean DPO loss over all eval pairs, plus eval_rewards/*.

Everything else (HF's loop, the sync before clipping, logging, checkpoints, per-rank RNG, best adapter,
early stopping) is the SFT trainer's, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
import trl

from HyperSloth.plan.batching import adaptive_partition_batches, steps_per_epoch
from HyperSloth.plan.eval_set import plan_eval
from HyperSloth.plan.inputs import plan_spec_for
from HyperSloth.plan.pairs import PAIR_COLUMNS, pair_plan_inputs
from HyperSloth.plan.run import RunDescription
from HyperSloth.train.dist import DistInfo
from HyperSloth.train.evaluation import Evaluator
from HyperSloth.train.dpo.preference import (
    REWARD_KEYS,
    ReferenceSwitch,
    add_reference_adapter,
    collate_pairs,
    dpo_loss,
    pair_logps,
)
from HyperSloth.train.plan_loader import PlanSteps
from HyperSloth.train.sft.trainer import HyperSlothTrainer, RunSetup, run_setup
from HyperSloth.train.trainer_args import trainer_arguments


def collate_pair_rows(dataset, indices: Sequence[int], *, pad_token_id: int, with_lengths: bool, bucket: bool,
                      bucket_limit: int | None) -> dict[str, Any]:
    """The pairs `indices` of a numpy-formatted preference dataset as one packed micro-batch (+ `num_pairs`)."""
    rows = dataset[list(indices)]
    pairs = [tuple(np.asarray(rows[c][k]) for c in PAIR_COLUMNS) for k in range(len(indices))]
    batch = collate_pairs(pairs, pad_token_id=pad_token_id, with_lengths=with_lengths, bucket=bucket,
                          bucket_limit=bucket_limit)
    batch["num_pairs"] = len(pairs)  # an int: HF's _prepare_inputs leaves it on the host
    return batch


class PairPlanSteps(PlanSteps):
    """`PlanSteps` over preference pairs: each micro-batch of the plan is one packed row of pairs."""

    columns = PAIR_COLUMNS

    def _collate(self, indices: Sequence[int]) -> dict[str, Any]:
        return collate_pair_rows(self.dataset, indices, pad_token_id=self.pad_token_id,
                                 with_lengths=self.packed_lengths, bucket=self.packed_lengths,
                                 bucket_limit=self._plan.spec.token_budget)


class PairEvaluator(Evaluator):
    """The exact distributed eval over held-out pairs: mean DPO loss and rewards over all of them."""

    columns = PAIR_COLUMNS
    count_name = "pairs"
    extra_keys = REWARD_KEYS

    def _collate(self, indices: Sequence[int]) -> dict[str, Any]:
        return collate_pair_rows(self.dataset, indices, pad_token_id=self.pad_token_id,
                                 with_lengths=self.packed_lengths, bucket=self.bucket,
                                 bucket_limit=self.plan.spec.token_budget)

    def count(self, micro_batch: dict[str, Any]) -> int:
        return int(micro_batch["num_pairs"])


class HyperSlothDPOTrainer(HyperSlothTrainer):
    """HyperSlothTrainer whose micro-batch loss is DPO's over packed pairs (see the module docstring)."""

    # The model card and the model's Hub tags name the method trained, as TRL's DPOTrainer does (the SFT base named it SFT)
    _tag_names, _name, _paper = trl.DPOTrainer._tag_names, trl.DPOTrainer._name, trl.DPOTrainer._paper
    step_sums_width = 1 + len(REWARD_KEYS)

    def __init__(self, *args, beta: float, reference: ReferenceSwitch, **kwargs):
        self.beta = beta
        self.reference = reference
        self._step_rewards: list[torch.Tensor] = []  # per step: REWARD_KEYS means over the step's pairs
        self._unlogged_rewards: list[torch.Tensor] = []  # steps since the last log line
        super().__init__(*args, **kwargs)

    def micro_batch_terms(self, model, micro_batch: dict[str, Any], denominator: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the pairs' DPO losses / denominator, reward sums): policy forward with gradients, reference
        forward without (`preference.pair_logps`)."""
        num_pairs = int(micro_batch.pop("num_pairs"))
        return dpo_loss(pair_logps(model, micro_batch, num_pairs, self.reference), self.beta, denominator)

    def record_step(self, step_sums: torch.Tensor, inputs: dict[str, Any]) -> None:
        super().record_step(step_sums, inputs)
        means = step_sums[1:].detach() / max(int(inputs["num_items_in_batch"]), 1)
        self._step_rewards.append(means)
        self._unlogged_rewards.append(means)

    def step_series_this_run(self) -> dict[str, list[Any]]:
        rows = torch.stack(self._step_rewards).tolist() if self._step_rewards else []
        return {**super().step_series_this_run(), "rewards": rows}

    @property
    def step_rewards(self) -> dict[str, list[float]]:
        """Every step's `rewards/*` (means over the step's global pairs), identical on all ranks; the whole run's
        after a resume, as the losses (`StepHistory`)."""
        rows = self.step_history.earlier.get("rewards", []) + self.step_series_this_run()["rewards"]
        return {key: [row[k] for row in rows] for k, key in enumerate(REWARD_KEYS)}

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._unlogged_rewards:  # means over the steps since the last log, as TRL's
            means = torch.stack(self._unlogged_rewards).mean(dim=0).tolist()
            logs.update(zip(REWARD_KEYS, means))
            self._unlogged_rewards.clear()
        super().log(logs, start_time)


def build_dpo_trainer(description: RunDescription, loaded_model, dataset, info: DistInfo, eval_dataset=None
                      ) -> tuple[HyperSlothDPOTrainer, RunSetup]:
    """The DPO twin of `trainer.build_trainer`: plan over pairs, reference switch, DPO trainer for this rank."""
    lengths, units = pair_plan_inputs(dataset, description.max_seq_length)
    spec = plan_spec_for(description)
    per_epoch = steps_per_epoch(len(lengths), spec.samples_per_step)
    unsloth = loaded_model.backend == "unsloth"
    pad = loaded_model.tokenizer.pad_token_id
    steps = PairPlanSteps(dataset, partial(adaptive_partition_batches, lengths, units, spec), per_epoch,
                          rank=info.rank, mode=spec.mode, loss_type=description.loss_type, pad_token_id=pad,
                          packed_lengths=unsloth)
    model = loaded_model.model
    lora = description.hyper_config.lora_args  # the model's own settings: the initial adapter is the reference
    init_adapter = lora.init_adapter_path if lora else None
    reference = add_reference_adapter(model, init_adapter) if init_adapter else ReferenceSwitch(model)
    evaluator = None
    if eval_dataset is not None:
        eval_lengths, eval_units = pair_plan_inputs(eval_dataset, description.max_seq_length)
        evaluator = PairEvaluator(eval_dataset, plan_eval(eval_lengths, eval_units, spec), rank=info.rank,
                                  loss_type=description.loss_type, pad_token_id=pad, packed_lengths=unsloth,
                                  bucket=unsloth)
    trainer = HyperSlothDPOTrainer(
        **trainer_arguments(description, loaded_model, dataset, info, steps, evaluator, eval_dataset),
        # The graphs replay SFT's one decoder pass per micro-batch; a DPO micro-batch runs two (policy and
        # reference, with and without gradients), eagerly.
        graphs_off="DPO runs the policy and reference forwards eagerly (no CUDA graphs)",
        beta=description.dpo_beta,
        reference=reference,
    )
    return trainer, run_setup(loaded_model.backend, spec, per_epoch, steps.plan(0).stats)
