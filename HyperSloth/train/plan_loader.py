"""The plan as the trainer's training data: one item per optimizer step.

`PlanSteps` is a map-style dataset whose item `(epoch, step)` is this rank's collated micro-batches of that step
of the plan (`adaptive_partition_batches`) plus the step's global counts; `StepSampler` yields those indices
once per optimizer step; `PlanDataLoader` passes HF's `set_epoch` on to the sampler. The trainer
(`HyperSlothTrainer.get_train_dataloader`) builds the loader from these; the DPO trainer subclasses
`PlanSteps` for its pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset

from HyperSloth.plan.batching import EpochPlan
from HyperSloth.train.collate import LossType, collate_rows


class PlanSteps(Dataset):
    """Item `(epoch, step)`: this rank's collated micro-batches of that step of the plan.

    The epoch travels inside the index, so the item is correct in DataLoader worker processes too.
    Subclasses collate other rows (`columns`, `_collate`: the DPO trainer's pairs).
    """

    columns: tuple[str, ...] = ("input_ids", "labels")

    def __init__(
        self,
        dataset,
        plan_for_epoch: Callable[[int], EpochPlan],
        steps_per_epoch: int,
        *,
        rank: int,
        mode: str,
        loss_type: LossType,
        pad_token_id: int,
        packed_lengths: bool = False,
    ):
        self.dataset = dataset.with_format("numpy", columns=list(self.columns))
        self.plan_for_epoch = plan_for_epoch
        self.steps_per_epoch = steps_per_epoch
        self.rank = rank
        self.mode = mode
        self.loss_type = loss_type
        self.pad_token_id = pad_token_id
        self.packed_lengths = packed_lengths
        self._plan: EpochPlan | None = None

    def __len__(self) -> int:
        return self.steps_per_epoch

    def plan(self, epoch: int) -> EpochPlan:
        if self._plan is None or self._plan.epoch != epoch:
            self._plan = self.plan_for_epoch(epoch)
        return self._plan

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        epoch, index = key
        step = self.plan(epoch).steps[index]
        # Unsloth (GPU): packed rows padded to a few lengths, never past the budget, so kernels meet few
        # shapes (collate.bucket_tokens; a new shape cost ~0.05-0.1 s per micro-batch on an H200).
        micro_batches = [self._collate(mb) for mb in step.ranks[self.rank] if len(mb) > 0]
        return {
            "micro_batches": micro_batches,
            "num_items_in_batch": int(step.num_trainable),
            "real_tokens": int(step.real_tokens),
        }

    def _collate(self, indices) -> dict[str, Any]:
        return collate_rows(self.dataset, indices, self.mode, self.loss_type, self.pad_token_id,
                            with_lengths=self.packed_lengths, bucket=self.packed_lengths,
                            bucket_limit=self._plan.spec.token_budget)


class StepSampler:
    """Batch sampler yielding `[(epoch, step)]` once per optimizer step of the epoch."""

    def __init__(self, steps_per_epoch: int):
        self.steps_per_epoch = steps_per_epoch
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for index in range(self.steps_per_epoch):
            yield [(self.epoch, index)]

    def __len__(self) -> int:
        return self.steps_per_epoch


class PlanDataLoader(DataLoader):
    """A DataLoader whose `set_epoch` reaches the step sampler (HF calls it at each epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)
