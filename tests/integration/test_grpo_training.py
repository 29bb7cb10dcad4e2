"""GRPO on 2 workers is GRPO in one process: real `hypersloth-train` runs on CPU over gloo (tiny Qwen3, fp32).

Eight chat prompts with an `answer` column (built by `hypersloth-build-dataset`'s library entry, auto-detected
as prompts), two of them held out and evaluated after the last step, 3 optimizer steps of 2 prompts x 4
completions of at most 8 tokens, two reward functions defined
in the config file, completions packed into micro-batches of <= 40 tokens. Three runs, two at a time:
1 worker, 2 workers (same global batch), 2 workers whose reward function raises at step 2, and 2 workers
resuming the second run from its checkpoint-2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from training_fixtures import flat_adapter, relative_error, run_env

pytestmark = pytest.mark.slow

STEPS, G = 3, 4
QUESTIONS = [("What is two plus three?", "5"), ("Name a colour", "red"), ("Count to four", "4"),
             ("Say yes", "yes"), ("What is one plus one?", "2"), ("Spell cat", "cat"),
             ("Name a fruit please, any fruit", "apple"), ("Say no", "no")]
REWARDS = """
def length_reward(prompts, completions, **kwargs):
    return [len(c[0]["content"]) / 10.0 for c in completions]

def answer_reward(prompts, completions, answer, trainer_state=None, **kwargs):
    if FAIL and trainer_state.global_step >= 1:
        raise ValueError("cannot judge this one")
    return [float(a in c[0]["content"]) for c, a in zip(completions, answer)]

reward_funcs = [length_reward, answer_reward]
"""


def _config(workdir: Path, model_dir: Path, name: str, gpus: int, fail: bool = False, resume: str | None = None
            ) -> Path:
    per_device, accumulation = (4, 2) if gpus == 1 else (4, 1)  # 8 completions (2 prompts) per step either way
    config = workdir / f"{name}.py"
    config.write_text(f"FAIL = {fail}\n" + REWARDS + textwrap.dedent(f"""
        from HyperSloth.config import *
        hyper_config_model = HyperConfig(
            data=DataConfig(dataset_name="prompts", data_dir={str(workdir / 'data')!r}, eval_fraction=0.25),
            training=TrainingConfig(gpus={list(range(gpus))}, method="grpo", tokens_per_micro_batch=40,
                                    grpo=GrpoArgs(num_generations={G}, max_completion_length=8, temperature=1.2)),
            fast_model_args=FastModelArgs(model_name={str(model_dir)!r}, max_seq_length=64, dtype="float32",
                                          backend="transformers"),
            lora_args=LoraArgs(r=4, lora_alpha=16),
        )
        training_config_model = TrainingArgsConfig(
            output_dir={str(workdir / name)!r}, per_device_train_batch_size={per_device},
            gradient_accumulation_steps={accumulation}, max_steps={STEPS}, learning_rate=0.05, warmup_steps=0,
            lr_scheduler_type="constant", report_to="none", seed=7, save_steps=1, eval_steps={STEPS},
            resume_from_checkpoint={resume!r})
    """))
    return config


def _start(config: Path, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "HyperSloth.cli.train", str(config)], cwd=cwd, env=run_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> dict[str, tuple[int, str, Path]]:
    """(exit code, stderr, output folder) of each run: '1w', '2w', 'fail' (2 workers, raising reward) and
    'resumed' (2 workers from 2w's checkpoint-2, into a folder of its own)."""
    from HyperSloth.data.build import build_dataset

    workdir = tmp_path_factory.mktemp("grpo")
    source = workdir / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}], "answer": a}) + "\n"
                              for q, a in QUESTIONS))
    build_dataset(str(source), name="prompts", tokenizer=str(tiny_model_dir), data_dir=str(workdir / "data"),
                  max_seq_length=64, num_proc=1)
    results = {}
    resume = str(workdir / "2w" / "checkpoint-2")
    batches = ((("1w", 1, False, None), ("2w", 2, False, None)),
               (("fail", 2, True, None), ("resumed", 2, False, resume)))  # two runs at a time
    for batch in batches:
        procs = {name: _start(_config(workdir, tiny_model_dir, name, gpus, fail, resume), workdir)
                 for name, gpus, fail, resume in batch}
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=900)
            results[name] = (proc.returncode, err, workdir / name)
    return results


def _completions(out: Path) -> dict[tuple[int, int], list[list[int]]]:
    """Every step's completions by (step, prompt row), from all ranks' logs/rank*.completions.jsonl."""
    found = {}
    for path in sorted((out / "logs").glob("rank*.completions.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            found[(record["step"], record["row"])] = record["completion_ids"]
    return found


def _adapter(out: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    return flat_adapter(load_file(str(out / "adapter_model.safetensors")))


def test_two_workers_sample_the_same_completions_and_train_the_same_adapter(runs):
    (code1, err1, one), (code2, err2, two) = runs["1w"], runs["2w"]
    assert code1 == 0, err1[-3000:]
    assert code2 == 0, err2[-3000:]
    completions = _completions(one)
    assert len(completions) == STEPS * 2 and {s for s, _ in completions} == {1, 2, 3}
    assert completions == _completions(two)
    assert len(list((two / "logs").glob("rank*.completions.jsonl"))) == 2  # both ranks sampled
    s1, s2 = (json.loads((out / "train_summary.json").read_text()) for out in (one, two))
    assert s1["method"] == s2["method"] == "grpo" and s1["reward_funcs"] == ["length_reward", "answer_reward"]
    card = (two / "README.md").read_text()  # named after the method trained, not the SFT base class
    assert "- grpo" in card and "- sft" not in card and "GRPO" in card
    np.testing.assert_allclose(s2["step_losses"], s1["step_losses"], rtol=1e-5, atol=1e-6)
    for key in ("reward", "rewards/length_reward/mean", "completions/mean_length", "completions/max_length",
                "completions/clipped_ratio"):
        np.testing.assert_allclose(s2["step_metrics"][key], s1["step_metrics"][key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)
    assert max(s1["step_metrics"]["reward_std"]) > 0  # the completions of a step were scored differently
    # The 2 held-out prompts, evaluated after the last step: the same mean reward (eval_loss = -eval_reward).
    e1, e2 = (s["eval"][-1] for s in (s1, s2))
    assert e1["step"] == e2["step"] == STEPS and e1["eval_prompts"] == e2["eval_prompts"] == 2
    assert e1["eval_loss"] == pytest.approx(-e1["eval_reward"])
    assert e2["eval_reward"] == pytest.approx(e1["eval_reward"])
    a1, a2 = _adapter(one), _adapter(two)
    assert np.abs(a1).max() > 0.01  # the adapter moved
    assert relative_error(a1, a2) < 1e-5


def test_a_raising_reward_function_stops_every_rank_with_one_line_naming_it_and_the_step(runs):
    code, err, out = runs["fail"]
    assert code != 0
    assert "reward function 'answer_reward' raised ValueError at step 2: cannot judge this one" in err
    assert "Traceback" not in err
    assert (out / "checkpoint-1").is_dir() and not (out / "checkpoint-2").exists()
    assert not (out / "tmp-checkpoint-2").exists()


def test_a_resumed_run_samples_and_trains_what_the_uninterrupted_one_did(runs):
    (code, err, resumed), (_, _, whole) = runs["resumed"], runs["2w"]
    assert code == 0, err[-3000:]
    later = {key: value for key, value in _completions(whole).items() if key[0] == STEPS}
    assert _completions(resumed) == later  # step 3 only, the same completions
    s_whole, s_resumed = (json.loads((out / "train_summary.json").read_text()) for out in (whole, resumed))
    np.testing.assert_allclose(s_resumed["step_losses"], s_whole["step_losses"], rtol=1e-6, atol=1e-7)
    assert s_resumed["step_metrics"]["reward"] == pytest.approx(s_whole["step_metrics"]["reward"], rel=1e-6)
    assert relative_error(_adapter(whole), _adapter(resumed)) < 1e-6
