"""GRPO before any worker starts: the config and its reward functions, the prompt dataset kind, the resolved run."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from datasets import Dataset

from HyperSloth.config import ConfigError, GrpoArgs, TrainingConfig, load_config, load_reward_funcs
from HyperSloth.plan.prompts import grpo_problems, prompt_plan_inputs, prompt_plan_spec
from HyperSloth.plan.run import MachineFacts, read_run, resolve_run, write_run

CPU = MachineFacts(cuda_device_count=0, unsloth_available=False, cpu_count=2)
REWARDS = """
def fmt(prompts, completions, **kwargs):
    return [1.0 for _ in completions]

def answer(prompts, completions, answer, **kwargs):
    return [0.0 for _ in completions]
"""


def _register(data_dir: Path, name: str, kind: str, rows: int = 12) -> None:
    """A prompt dataset in the builder's layout (data/prompts.py), or a chat dataset (kind "sft")."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, 90, size=int(rng.integers(3, 20))).tolist() for _ in range(rows)]
    if kind == "prompt":
        columns = {"prompt_input_ids": ids, "prompt_length": [len(i) for i in ids], "length": [len(i) for i in ids],
                   "num_trainable": [1] * rows, "prompt_json": [json.dumps("q")] * rows,
                   "columns_json": [json.dumps({"answer": "a"})] * rows}
    else:
        columns = {"input_ids": ids, "labels": ids, "length": [len(i) for i in ids],
                   "num_trainable": [len(i) - 1 for i in ids], "text": [""] * rows}
    Dataset.from_dict(columns).save_to_disk(str(data_dir / "built_dataset" / name))
    registry = data_dir / "data_config.json"
    content = json.loads(registry.read_text()) if registry.is_file() else {"version": 1, "datasets": {}}
    content["datasets"][name] = {"name": name, "path": f"built_dataset/{name}", "num_samples": rows, "kind": kind,
                                 "stats": {"max_tokens": max(len(i) for i in ids)}}
    registry.write_text(json.dumps(content))


@pytest.fixture
def data(tmp_path):
    _register(tmp_path / "data", "prompts", "prompt")
    _register(tmp_path / "data", "chat", "sft")
    return tmp_path / "data"


def _config(tmp_path: Path, dataset: str = "prompts", training: str = "method='grpo'", rewards: str = REWARDS,
            tail: str = "reward_funcs = [fmt, answer]", per_device: int = 4, lora: str = "LoraArgs()") -> Path:
    path = tmp_path / "cfg.py"
    path.write_text(rewards + textwrap.dedent(f"""
        from HyperSloth.config import *
        hyper_config_model = HyperConfig(
            data=DataConfig(dataset_name={dataset!r}, data_dir={str(tmp_path / 'data')!r}),
            training=TrainingConfig({training}),
            fast_model_args=FastModelArgs(model_name="some/model", max_seq_length=64),
            lora_args={lora},
        )
        training_config_model = TrainingArgsConfig(output_dir={str(tmp_path / 'out')!r}, max_steps=2,
                                                   per_device_train_batch_size={per_device},
                                                   gradient_accumulation_steps=2)
    """) + tail + "\n")
    return path


def test_a_grpo_config_loads_its_reward_functions_and_resolves(tmp_path, data):
    path = _config(tmp_path, training="method='grpo', grpo=GrpoArgs(num_generations=4, max_completion_length=16)")
    loaded = load_config(path)
    assert [f.__name__ for f in loaded.reward_funcs] == ["fmt", "answer"]
    run = resolve_run(loaded, world_size=2, machine=CPU)
    assert run.method == "grpo" and run.reward_funcs == ("fmt", "answer") and run.global_batch_size == 16
    assert run.grpo == GrpoArgs(num_generations=4, max_completion_length=16)  # what the workers act on, typed
    assert "GRPO, 4 prompts x 4 generations, rewards fmt, answer" in run.batch_line()
    assert read_run(write_run(run, tmp_path / "run.json")) == run  # run.json round-trips with the grpo settings
    # A worker loads them from the file again, checked against run.json's names.
    assert [f.__name__ for f in load_reward_funcs(path, run.reward_funcs)] == ["fmt", "answer"]
    with pytest.raises(ConfigError, match=r"reward_funcs are now \['fmt', 'answer'\], but the run was started"):
        load_reward_funcs(path, ("fmt",))


@pytest.mark.parametrize(("training", "tail", "lora", "message"), [
    ("method='grpo'", "", "LoraArgs()", "method='grpo' but the file defines no `reward_funcs`"),
    ("method='sft'", "reward_funcs = [fmt]", "LoraArgs()", "defines `reward_funcs` but training.method is 'sft'"),
    ("method='grpo'", "reward_funcs = [fmt, 3]", "LoraArgs()", "not callable: 3"),
    ("method='grpo'", "reward_funcs = [fmt, fmt]", "LoraArgs()", "two functions named 'fmt'"),
    ("method='grpo', grpo=GrpoArgs(reward_weights=[1.0])", "reward_funcs = [fmt, answer]", "LoraArgs()",
     "reward_weights has 1 weight\\(s\\) for 2 reward function\\(s\\)"),
    ("method='sft', grpo=GrpoArgs(beta=0.1)", "", "LoraArgs()", "grpo settings are given but method is 'sft'"),
    ("method='grpo', batching='sorted-pad'", "reward_funcs = [fmt]", "LoraArgs()", "set batching='packed'"),
    ("method='grpo'", "reward_funcs = [fmt]", "None", "method='grpo' needs a LoRA adapter"),
])
def test_configs_that_cannot_train_grpo_are_refused_before_launch(tmp_path, data, training, tail, lora, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_config(tmp_path, training=training, tail=tail, lora=lora))


def test_the_dataset_kind_and_the_batch_are_checked_against_grpo(tmp_path, data):
    with pytest.raises(ConfigError, match="holds chats .* but training.method='grpo' trains on prompts"):
        resolve_run(load_config(_config(tmp_path, dataset="chat")), world_size=1, machine=CPU)
    with pytest.raises(ConfigError, match="holds prompts .* training.method is 'sft'"):
        resolve_run(load_config(_config(tmp_path, training="method='sft'", tail="")), world_size=1, machine=CPU)
    odd = _config(tmp_path, per_device=3)  # 3 x 2 = 6 completions per step, groups of 8
    with pytest.raises(ConfigError, match="global batch is 6 completions .* multiple of num_generations"):
        resolve_run(load_config(odd), world_size=1, machine=CPU)


def test_grpo_problems_and_the_prompt_plan():
    grpo = GrpoArgs(num_generations=4, max_completion_length=10)
    assert grpo_problems(grpo, 16, 20, 30) == []
    assert "raise max_seq_length to 31" in grpo_problems(grpo, 16, 21, 30)[0]
    assert "multiple of num_generations" in grpo_problems(grpo, 10, None, 30)[0]
    columns = {"prompt_length": np.array([3, 5, 7])}
    lengths, units = prompt_plan_inputs(columns, grpo, 30)
    assert lengths.tolist() == [4 * 13, 4 * 15, 4 * 17] and units.tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="max_completion_length"):
        prompt_plan_inputs(columns, grpo, 16)
    from HyperSloth.plan.batching import PlanSpec

    spec = PlanSpec(num_ranks=2, samples_per_step=16, mode="packed", micro_batch_size=4, token_budget=100)
    assert prompt_plan_spec(spec, 4).samples_per_step == 4


def test_grpo_args_defaults_are_trls():
    from trl import GRPOConfig

    ours, trl = GrpoArgs(), GRPOConfig(output_dir="unused", use_cpu=True, bf16=False)
    for name in ("temperature", "top_p", "top_k", "beta", "epsilon", "loss_type", "num_iterations", "num_generations",
                 "max_completion_length"):
        assert getattr(ours, name) == getattr(trl, name), name
    assert ours.scale == trl.scale_rewards == "group"
    assert GrpoArgs(scale_rewards=False).scale == "none"
    assert TrainingConfig(method="grpo").grpo == GrpoArgs()


def test_the_plan_preview_deals_prompts(tmp_path, data):
    from HyperSloth.cli.plan import preview

    summary = preview(str(_config(tmp_path, training="method='grpo', grpo=GrpoArgs(num_generations=4, "
                                                     "max_completion_length=16)")))
    assert summary.unit == "prompts" and summary.spec.samples_per_step == 2  # 4 x 2 completions = 2 prompts x 4
    assert summary.steps_per_epoch == 6 and summary.num_samples == 12
