"""trainer.sft_config_for: HF runs exactly one plan step per optimizer step, whatever SFTConfig defaults to."""

import dataclasses

import torch
from trl import SFTConfig

from HyperSloth import trainer
from HyperSloth.config import TrainingArgsConfig


@dataclasses.dataclass
class _UnslothLikeSFTConfig(SFTConfig):
    gradient_accumulation_steps: int = 2  # Unsloth's patched SFTConfig default (unsloth 2026.10.9, models/rl.py)


def test_one_plan_step_per_optimizer_step_even_where_the_default_is_two(monkeypatch, tmp_path):
    monkeypatch.setattr(trainer, "SFTConfig", _UnslothLikeSFTConfig)
    targs = TrainingArgsConfig(output_dir=str(tmp_path), gradient_accumulation_steps=4, report_to="none")
    args = trainer.sft_config_for(targs, torch.float32, rank=0)
    assert isinstance(args, _UnslothLikeSFTConfig)
    assert args.gradient_accumulation_steps == 1  # the step's 4 micro-batches run inside training_step
