"""`hypersloth-plan`: preview a config's plan from a tiny registered dataset, no model, no GPU."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
from datasets import Dataset

from HyperSloth.cli.plan import format_summary, plan, preview
from HyperSloth.config import ConfigError
from HyperSloth.plan.batching import PlanSpec, adaptive_partition_batches

LINE = re.compile(
    r"^plan: steps=(\d+) micro_batches_per_rank=(\d+) padding_pct=([\d.]+) random_padding_pct=([\d.]+) "
    r"imbalance=([\d.]+) plan_seconds=([\d.]+)$"
)


def make_dataset(data_dir: Path, lengths: np.ndarray, name: str = "tiny") -> None:
    trainable = lengths // 3
    columns = {
        "input_ids": [list(range(n)) for n in lengths],
        "labels": [[-100] * n for n in lengths],  # not read by the planner
        "length": lengths.tolist(),
        "num_trainable": trainable.tolist(),
        "text": ["x"] * len(lengths),
    }
    Dataset.from_dict(columns).save_to_disk(str(data_dir / "built_dataset" / name))
    entry = {"name": name, "path": f"built_dataset/{name}", "num_samples": len(lengths), "max_seq_length": 512}
    (data_dir / "data_config.json").write_text(json.dumps({"version": 1, "datasets": {name: entry}}))


def write_config(tmp_path: Path, data_dir: Path, **training) -> Path:
    options = {"gpus": [0, 1], "batching": "packed", "loss_type": "response_only"} | training
    path = tmp_path / "config.py"
    path.write_text(textwrap.dedent(f"""
        from HyperSloth.config import *
        hyper_config_model = HyperConfig(
            data=DataConfig(dataset_name="tiny", data_dir={str(data_dir)!r}),
            training=TrainingConfig(**{options!r}),
            fast_model_args=FastModelArgs(model_name="m", max_seq_length=512),
        )
        training_config_model = TrainingArgsConfig(
            per_device_train_batch_size=4, gradient_accumulation_steps=2, seed=7, num_train_epochs=3)
    """))
    return path


@pytest.fixture
def lengths(tmp_path) -> np.ndarray:
    values = np.clip(np.exp(np.random.default_rng(3).normal(5.0, 0.7, 203)), 8, 512).astype(np.int64)
    make_dataset(tmp_path / "data", values)
    return values


def parse(text: str) -> tuple[float, ...]:
    match = LINE.match(text.splitlines()[-1])
    assert match, text.splitlines()[-1]
    return tuple(float(g) for g in match.groups())


@pytest.mark.parametrize("batching", ["packed", "sorted-pad"])
def test_summary_line_matches_the_plan(tmp_path, lengths, batching):
    config = write_config(tmp_path, tmp_path / "data", batching=batching)
    summary = preview(str(config))
    steps, mbs, pad, random_pad, imbalance, seconds = parse(format_summary(summary))
    # Global batch 4 x 2 x 2 = 16 samples: 203 samples -> 12 full steps and a partial one.
    assert steps == summary.steps_per_epoch == 13
    assert summary.run_steps == 39  # 3 epochs
    spec = PlanSpec(2, 16, mode=batching, micro_batch_size=4, token_budget=4 * 512, seed=7)
    expected = adaptive_partition_batches(lengths, lengths // 3, spec).stats
    assert summary.stats == expected
    assert mbs == expected.micro_batches_per_rank
    assert pad == pytest.approx(100 * expected.padding_fraction, abs=1e-3)
    assert random_pad == pytest.approx(100 * expected.random_padding_fraction, abs=1e-3)
    assert imbalance == pytest.approx(expected.imbalance, abs=1e-4)
    assert 0 <= seconds < 5
    assert summary.trainable_tokens == int((lengths // 3).sum())
    if batching == "packed":
        assert pad == 0 and summary.max_micro_batch_tokens <= 4 * 512
    else:
        assert mbs == 13 * 2 and 0 < pad < random_pad


def test_gpus_override_and_loss_type_all(tmp_path, lengths):
    config = write_config(tmp_path, tmp_path / "data", loss_type="all", tokens_per_micro_batch=1000)
    summary = preview(str(config), num_ranks=8)
    assert summary.spec.num_ranks == 8 and summary.spec.samples_per_step == 4 * 2 * 8
    assert summary.spec.token_budget == 1000
    assert summary.steps_per_epoch == 4  # ceil(203 / 64)
    assert summary.trainable_tokens == int((lengths - 1).sum())
    assert len(summary.stats.rank_real_tokens) == 8
    assert sum(summary.stats.rank_real_tokens) == int(lengths.sum())


def test_cli_prints_summary_and_errors_cleanly(tmp_path, lengths, capsys):
    config = write_config(tmp_path, tmp_path / "data")
    plan(str(config), gpus=3)
    out = capsys.readouterr().out
    assert "ranks          3;" in out
    assert parse(out)[0] == 9  # ceil(203 / 24)
    with pytest.raises(SystemExit) as exit_info:
        plan(str(config), gpus=0)
    assert exit_info.value.code == 2
    assert "--gpus must be a whole number >= 1" in capsys.readouterr().err


def test_missing_dataset_folder_and_too_long_samples(tmp_path):
    data_dir = tmp_path / "data"
    make_dataset(data_dir, np.array([10, 600, 20]))
    config = write_config(tmp_path, data_dir)
    with pytest.raises(ConfigError, match="samples of up to 600 tokens.*set max_seq_length >= 600"):
        preview(str(config))
    import shutil

    shutil.rmtree(data_dir / "built_dataset")
    with pytest.raises(ConfigError, match="missing or incomplete"):
        preview(str(config))
