"""DPO before any worker starts: config checks, the dataset kind, the resolved run and the plan preview."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from datasets import Dataset

from HyperSloth.cli.plan import format_summary, preview
from HyperSloth.config import ConfigError, HyperConfig, load_config
from HyperSloth.plan.pairs import pair_plan_inputs
from HyperSloth.plan.run import MachineFacts, read_run, resolve_run, write_run

CPU = MachineFacts(cuda_device_count=0, unsloth_available=False, cpu_count=2)


def _register(data_dir: Path, name: str, kind: str, rows: int = 40, seed: int = 0) -> None:
    """A preference dataset in the builder's layout, or a chat dataset (kind "sft")."""
    rng = np.random.default_rng(seed)
    ids = lambda low, high: rng.integers(3, 90, size=int(rng.integers(low, high))).tolist()  # noqa: E731
    if kind == "preference":
        pairs = [(ids(3, 20), ids(1, 12), ids(1, 12)) for _ in range(rows)]
        prompt, chosen, rejected = (list(c) for c in zip(*pairs))
        columns = {"prompt_input_ids": prompt, "chosen_input_ids": chosen, "rejected_input_ids": rejected,
                   "length": [2 * len(p) + len(c) + len(r) for p, c, r in pairs],
                   "prompt_length": [len(p) for p in prompt], "chosen_length": [len(c) for c in chosen],
                   "rejected_length": [len(r) for r in rejected],
                   "num_trainable": [len(c) + len(r) for _, c, r in pairs]}
        longest = max(len(p) + max(len(c), len(r)) for p, c, r in pairs)
    else:
        chats = [ids(5, 30) for _ in range(rows)]
        columns = {"input_ids": chats, "labels": chats, "length": [len(c) for c in chats],
                   "num_trainable": [len(c) - 1 for c in chats], "text": [""] * rows}
        longest = max(len(c) for c in chats)
    Dataset.from_dict(columns).save_to_disk(str(data_dir / "built_dataset" / name))
    registry = data_dir / "data_config.json"
    content = json.loads(registry.read_text()) if registry.is_file() else {"version": 1, "datasets": {}}
    content["datasets"][name] = {"name": name, "path": f"built_dataset/{name}", "num_samples": rows, "kind": kind,
                                 "stats": {"max_tokens": longest}}
    registry.write_text(json.dumps(content))


@pytest.fixture
def data(tmp_path):
    _register(tmp_path / "data", "pairs", "preference")
    _register(tmp_path / "data", "chat", "sft")
    return tmp_path / "data"


def _config(tmp_path: Path, dataset: str, training: str = "method='dpo'", data_extra: str = "",
            name: str = "cfg.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(f"""
        from HyperSloth.config import *
        hyper_config_model = HyperConfig(
            data=DataConfig(dataset_name={dataset!r}, data_dir={str(tmp_path / 'data')!r}{data_extra}),
            training=TrainingConfig(gpus=[0, 1], {training}),
            fast_model_args=FastModelArgs(model_name={str(tmp_path / 'model')!r}, max_seq_length=32),
        )
        training_config_model = TrainingArgsConfig(output_dir={str(tmp_path / 'out')!r}, seed=7, max_steps=5,
                                                   per_device_train_batch_size=2, gradient_accumulation_steps=2)
    """))
    return path


def _resolve(path: Path, world_size: int = 2):
    return resolve_run(load_config(path), world_size=world_size, machine=CPU)


def test_a_dpo_run_resolves_with_its_method_and_beta(tmp_path, data):
    run = _resolve(_config(tmp_path, "pairs", "method='dpo', dpo_beta=0.25"))
    assert (run.method, run.dpo_beta, run.dataset.kind, run.global_batch_size) == ("dpo", 0.25, "preference", 8)
    assert run.dataset.built_max_length <= 32  # the longest prompt + completion, not the pair
    assert read_run(write_run(run)) == run
    assert "global batch 8 pairs per optimizer step" in run.batch_line() and "DPO, beta 0.25" in run.batch_line()
    sft = _resolve(_config(tmp_path, "chat", "method='sft', dpo_beta=0.25", name="sft.py"))
    assert (sft.method, sft.dpo_beta) == ("sft", None)
    assert run.planning_key()["method"] == "dpo" != sft.planning_key()["method"]


@pytest.mark.parametrize(("dataset", "training", "message"), [
    ("chat", "method='dpo'", "dataset 'chat' holds chats (kind 'sft') but training.method='dpo' trains on "
                             "preference pairs"),
    ("pairs", "method='sft'", "dataset 'pairs' holds preference pairs (kind 'preference') but training.method is "
                              "'sft': set training.method='dpo'"),
])
def test_the_wrong_dataset_kind_is_refused_in_one_line(tmp_path, data, dataset, training, message):
    with pytest.raises(ConfigError) as err:
        _resolve(_config(tmp_path, dataset, training))
    text = str(err.value)
    assert message in text and len(text.splitlines()) == 1  # the one problem, in one line
    assert not (tmp_path / "out").exists()  # nothing written for a refused run


def test_an_eval_dataset_of_the_other_kind_is_refused(tmp_path, data):
    with pytest.raises(ConfigError, match="eval dataset 'chat' holds chats"):
        _resolve(_config(tmp_path, "pairs", data_extra=", eval_dataset_name='chat'"))


def test_a_pair_holdout_is_fingerprinted_by_its_token_ids(tmp_path, data):
    run = _resolve(_config(tmp_path, "pairs", data_extra=", eval_fraction=0.1"))
    assert (run.eval_set.num_rows, run.eval_set.source) == (4, "holdout")
    assert run.eval_set.describe().startswith("4 pairs held out of 'pairs'")  # the plan counts pairs, not chats
    _register(data, "pairs", "preference", seed=1)  # other token ids, same shape
    other = _resolve(_config(tmp_path, "pairs", data_extra=", eval_fraction=0.1", name="again.py"))
    assert other.eval_set.fingerprint != run.eval_set.fingerprint


@pytest.mark.parametrize(("training", "lora", "message"), [
    ("method='dpo', dpo_beta=0.0", "", "dpo_beta must be a finite number > 0"),
    ("method='dpo', batching='sorted-pad'", "", "set batching='packed'"),
    ("method='dpo', loss_type='all'", "", "leave loss_type at 'response_only'"),
    ("method='dpo'", ", lora_args=None", "method='dpo' needs a LoRA adapter"),
])
def test_dpo_settings_that_cannot_work_are_refused(tmp_path, training, lora, message):
    path = tmp_path / "bad.py"
    path.write_text(textwrap.dedent(f"""
        from HyperSloth.config import *
        hyper_config_model = HyperConfig(data=DataConfig(dataset_name="pairs"), training=TrainingConfig({training}),
                                         fast_model_args=FastModelArgs(model_name="m"){lora})
    """))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(path)
    assert HyperConfig.model_fields  # the models import without torch (config.py imports nothing of ours)


def test_the_plan_preview_deals_whole_pairs(tmp_path, data):
    summary = preview(str(_config(tmp_path, "pairs", "method='dpo', tokens_per_micro_batch=64")))
    text = format_summary(summary)
    assert "40 pairs" in text and "global batch 8 pairs per optimizer step" in text
    assert "a pair is never split" in text
    from datasets import load_from_disk

    lengths, units = pair_plan_inputs(load_from_disk(str(data / "built_dataset" / "pairs")), 32)
    assert units.tolist() == [1] * 40 and summary.stats.real_tokens == int(lengths.sum())
    assert summary.trainable_tokens == sum(load_from_disk(str(data / "built_dataset" / "pairs"))["num_trainable"])
