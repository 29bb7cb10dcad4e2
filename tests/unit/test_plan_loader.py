"""The plan loader's transport: a step's collated tensors leave the worker process as numpy arrays (no
shared-memory file descriptor per tensor) and arrive as the same tensors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from HyperSloth.train.collate import collate_packed
from HyperSloth.train.plan_loader import HostStep, PlanDataLoader, StepSampler, host_step


def step_item(index: int) -> dict:
    rng = np.random.default_rng(index)
    samples = [(rng.integers(0, 100, n), rng.integers(-100, 100, n)) for n in (5, 9, 3)]
    row = collate_packed(samples, with_lengths=True)
    extra = {"target_index": torch.arange(4, dtype=torch.int64), "mask": torch.tensor([True, False])}
    return {"micro_batches": [row, extra], "num_items_in_batch": 14 + index, "real_tokens": 17}


class Steps(Dataset):
    def __len__(self):
        return 3

    def __getitem__(self, key):
        return step_item(key[1])


def assert_same(got, want):
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert got == want


def test_a_step_crosses_a_pickle_as_arrays_and_comes_back_as_the_same_tensors():
    item = step_item(0)
    travelled = pickle.loads(pickle.dumps(HostStep(item)))
    assert_same(travelled.tensors(), item)
    # What crossed holds no tensor (a tensor would travel as a file descriptor).
    assert b"torch" not in pickle.dumps(HostStep(item)).split(b"HostStep")[-1]


@pytest.mark.parametrize("workers", [0, 1])
def test_the_loader_yields_tensors_with_and_without_a_worker_process(workers):
    loader = PlanDataLoader(Steps(), batch_sampler=StepSampler(3), collate_fn=host_step, num_workers=workers)
    got = list(loader)
    assert len(got) == 3
    for index, item in enumerate(got):
        assert_same(item, step_item(index))


def test_a_tensor_without_a_numpy_twin_travels_as_itself():
    item = {"x": torch.ones(2, dtype=torch.bfloat16), "ids": torch.arange(3)}
    step = HostStep(item)
    assert step.item["x"] is item["x"] and not isinstance(step.item["ids"], torch.Tensor)
    assert_same(pickle.loads(pickle.dumps(step)).tensors(), item)
