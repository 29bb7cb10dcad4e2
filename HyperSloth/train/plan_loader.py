"""The plan as the trainer's training data: one item per optimizer step.

`PlanSteps` is a map-style dataset whose item `(epoch, step)` is this rank's collated micro-batches of that step
of the plan (`adaptive_partition_batches`) plus the step's global counts; `StepSampler` yields those indices
once per optimizer step; `PlanDataLoader` passes HF's `set_epoch` on to the sampler. The trainer
(`HyperSlothTrainer.get_train_dataloader`) builds the loader from these; the DPO trainer subclasses
`PlanSteps` for its pairs.

Transport: the loader's worker process (one on GPUs, `trainer_args.sft_config_for`) sends each step as a
`HostStep`: its tensors as numpy arrays, pickled by value through the worker's pipe. A tensor would
cross as a shared-memory file descriptor, one socket handshake (with its authentication) per tensor: on
the H200 trace of a Qwen3-0.6B step that was ~9 ms of the ~13 ms the GPU sat idle between steps. In the
training process the loader's pin-memory thread turns them back into pinned tensors (`HostStep.pin_memory`),
and without pinning `PlanDataLoader` does (same arrays, no copy), or the trainer's `get_batch_samples` for
the loader HF wraps around it when a resume skips batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
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


# What collation produces (token ids, labels, positions, lengths, indices, masks), each with a numpy twin.
_NUMPY_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


class _Array:
    """A tensor's data in transit (`HostStep`): marks which arrays go back to tensors."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __getstate__(self):
        return self.array

    def __setstate__(self, array):
        self.array = array


def _map_leaves(item: Any, leaf: Callable[[Any], Any]) -> Any:
    """`item` (dicts, lists and tuples of leaves) with `leaf` applied to every leaf."""
    if isinstance(item, dict):
        return {k: _map_leaves(v, leaf) for k, v in item.items()}
    if isinstance(item, (list, tuple)):
        return type(item)(_map_leaves(v, leaf) for v in item)
    return leaf(item)


def _to_host(item: Any) -> Any:
    def array(x: Any) -> Any:
        # Integers and bool (all that collation makes) travel as arrays; any other tensor as itself.
        return _Array(x.numpy()) if isinstance(x, torch.Tensor) and x.dtype in _NUMPY_DTYPES else x

    return _map_leaves(item, array)


def _to_tensors(item: Any, pin: bool) -> Any:
    def tensor(x: Any) -> Any:
        if not isinstance(x, (_Array, torch.Tensor)):
            return x
        t = torch.from_numpy(x.array) if isinstance(x, _Array) else x
        return t.pin_memory() if pin else t

    return _map_leaves(item, tensor)


class HostStep:
    """One step's item on its way out of the loader (see the module docstring): built in the worker by the
    collate function (`host_step`), back to tensors in the training process."""

    __slots__ = ("item",)

    def __init__(self, item: dict[str, Any]):
        self.item = _to_host(item)

    def __getstate__(self):
        return self.item

    def __setstate__(self, item):
        self.item = item

    def tensors(self) -> dict[str, Any]:
        return _to_tensors(self.item, pin=False)

    def pin_memory(self, device=None) -> dict[str, Any]:  # the loader's pin-memory thread calls this
        return _to_tensors(self.item, pin=True)


def as_tensors(item: Any) -> Any:
    """A loader's item as tensors: a `HostStep` that no pin-memory thread turned back yet, or anything else as is."""
    return item.tensors() if isinstance(item, HostStep) else item


def host_step(batch: list[dict[str, Any]]) -> HostStep:
    """The loader's collate function: the batch sampler yields one (epoch, step) per batch."""
    return HostStep(batch[0])


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
    """A DataLoader of `PlanSteps` (collate_fn `host_step`) whose `set_epoch` reaches the step sampler (HF
    calls it at each epoch) and whose items arrive as dicts of tensors."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def __iter__(self):
        return map(as_tensors, super().__iter__())
