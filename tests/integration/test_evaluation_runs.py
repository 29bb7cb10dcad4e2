"""Evaluation during real training runs (the CLI, tiny model, CPU workers over gloo).

The eval runs hold out 10% of the 256 chats (26 conversations), evaluate before training
(`eval_on_start`), every 2 optimizer steps and after the last one (6 steps). The eval loss must be the
token-mean cross-entropy of the adapter on the held-out rows, the same on 1 and 2 workers, computed
here independently from the saved adapters.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from training_fixtures import (
    needs,
    pool_fixtures,
    MAX_STEPS,
    RunSpec,
    _script,
    run_env,
    write_config,
)

pytestmark = pytest.mark.slow

EVAL_FRACTION = 0.1
SEED = 7  # training_config's seed: it also seeds the hold-out
IGNORE = -100


@dataclass(frozen=True)
class EvalRunSpec(RunSpec):
    """A RunSpec with an eval set (a hold-out of the training dataset)."""

    eval_fraction: float = EVAL_FRACTION
    eval_dataset_name: str | None = None
    eval_steps: int | None = 2
    patience: int | None = None
    learning_rate: float | None = None
    report_to: str = "none"

    def hyper_config(self, model_dir: Path) -> dict[str, Any]:
        config = super().hyper_config(model_dir)
        config["data"].update(eval_fraction=self.eval_fraction, eval_dataset_name=self.eval_dataset_name)
        return config

    def training_config(self) -> dict[str, Any]:
        config = super().training_config()
        config.update(eval_steps=self.eval_steps, early_stopping_patience=self.patience, report_to=self.report_to,
                      extra_args={"eval_on_start": True})
        if self.learning_rate is not None:  # at full strength from the first step
            config.update(learning_rate=self.learning_rate, warmup_steps=0)
        return config


SPECS = [
    EvalRunSpec("eval-2w", report_to="tensorboard"),
    EvalRunSpec("eval-1w", gpus=1, per_device=8),
    # eval-2w's folder, resumed in place from its checkpoint-3.
    EvalRunSpec("eval-resume", resume_from="eval-2w"),
    # A learning rate far too high: the eval loss soon stops improving, so patience 2 stops the run.
    EvalRunSpec("eval-stop", eval_steps=1, patience=2, learning_rate=0.5),
]


workdir, model_dir, runs, dataset = pool_fixtures("evaluation", SPECS)


@pytest.fixture(scope="module")
def held_out(dataset):
    from HyperSloth.plan.eval_set import split_holdout

    return split_holdout(len(dataset), EVAL_FRACTION, SEED)[1]


def independent_eval_loss(model_dir: Path, adapter: Path, dataset, rows) -> tuple[float, int]:
    """Token-mean cross-entropy over the assistant tokens of `rows`, one unpadded row at a time, with the
    adapter loaded by stock PEFT: nothing of HyperSloth's batching, collation or loss code."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in rows:
            row = dataset[int(i)]
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1].double()
            targets = torch.tensor(row["labels"][1:])
            keep = targets != IGNORE
            total += float(F.cross_entropy(logits[keep], targets[keep], reduction="sum"))
            count += int(keep.sum())
    return total / count, count


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@needs("eval-1w", "eval-2w")
def test_one_and_two_workers_give_the_same_eval_loss(runs):
    one, two = runs.get("eval-1w").check_ok().summary, runs.get("eval-2w").check_ok().summary
    assert [e["step"] for e in one["eval"]] == [e["step"] for e in two["eval"]] == [0, 2, 4, 6]
    assert {e["eval_tokens"] for e in one["eval"] + two["eval"]} == {one["eval_set"]["target_tokens"]}
    for a, b in zip(one["eval"], two["eval"]):
        assert rel(b["eval_loss"], a["eval_loss"]) <= 1e-6, (a, b)
    assert one["eval"][0]["eval_loss"] > one["eval"][-1]["eval_loss"]  # training lowered it


@needs("eval-2w")
def test_final_eval_loss_is_the_cross_entropy_of_the_saved_adapter(runs, model_dir, dataset, held_out):
    run = runs.get("eval-2w").check_ok()
    loss, tokens = independent_eval_loss(model_dir, run.out, dataset, held_out)
    final = run.summary["eval"][-1]
    assert final["step"] == MAX_STEPS and final["eval_tokens"] == tokens
    assert rel(final["eval_loss"], loss) <= 1e-6


@needs("eval-2w")
def test_held_out_rows_are_recorded_and_never_trained_on(runs, dataset, held_out):
    from HyperSloth.plan.batching import PlanSpec, adaptive_partition_batches
    from HyperSloth.plan.eval_set import rows_fingerprint

    run = runs.get("eval-2w").check_ok()
    eval_set = run.summary["eval_set"]
    assert (eval_set["source"], eval_set["num_rows"]) == ("holdout", len(held_out) == 26 and 26)
    assert eval_set["fingerprint"] == rows_fingerprint(dataset, held_out)
    # The tokens trained on are those of the plan over the remaining rows (which rows form a step
    # depends only on the rows, the global batch and the seed), not over all rows.
    lengths = np.asarray(dataset["length"])
    keep = np.setdiff1d(np.arange(len(dataset)), held_out)

    def planned_tokens(rows: np.ndarray) -> int:
        spec = PlanSpec(num_ranks=1, samples_per_step=16, mode="packed", token_budget=10**6, seed=SEED)
        plan = adaptive_partition_batches(lengths[rows], lengths[rows] - 1, spec)
        return sum(step.real_tokens for step in plan.steps[:MAX_STEPS])

    assert run.summary["tokens_seen"] == planned_tokens(keep) != planned_tokens(np.arange(len(dataset)))


@needs("eval-2w")
def test_best_adapter_holds_the_lowest_eval_loss_and_loads_with_peft(runs, model_dir, dataset, held_out):
    run = runs.get("eval-2w").check_ok()
    history = run.summary["eval"]
    best = min(history, key=lambda e: e["eval_loss"])
    record = json.loads((run.out / "best_adapter" / "best_eval.json").read_text())
    assert record["step"] == best["step"] and record["eval_loss"] == best["eval_loss"]
    assert run.summary["best_eval"]["step"] == best["step"]
    loss, _ = independent_eval_loss(model_dir, run.out / "best_adapter", dataset, held_out)
    assert rel(record["eval_loss"], loss) <= 1e-6


@needs("eval-2w")
def test_report_and_tensorboard_show_the_eval_curve(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = runs.get("eval-2w").check_ok()
    best = run.summary["best_eval"]
    report = (run.out / "report.md").read_text()
    assert f"best eval_loss {best['eval_loss']:.4f} at step {best['step']}" in report
    assert (run.out / "report.png").is_file()
    events = sorted(run.out.rglob("events.out.tfevents.*"))
    assert events, "rank 0 writes TensorBoard events"
    scalars = EventAccumulator(str(events[0].parent)).Reload().Scalars("eval/loss")
    assert [s.step for s in scalars] == [e["step"] for e in run.summary["eval"]]
    assert np.allclose([s.value for s in scalars], [e["eval_loss"] for e in run.summary["eval"]], rtol=1e-6)


@needs("eval-stop")
def test_early_stopping_stops_after_patience_evaluations_without_improvement(runs):
    run = runs.get("eval-stop").check_ok()
    losses = [e["eval_loss"] for e in run.summary["eval"]]
    without_improvement, best, streaks = 0, None, []
    for loss in losses:  # evaluations in a row without a new lowest loss, after each evaluation
        without_improvement = 0 if best is None or loss < best else without_improvement + 1
        best = loss if best is None else min(best, loss)
        streaks.append(without_improvement)
    assert streaks[-1] == 2 and max(streaks[:-1]) < 2, losses  # stopped at the first streak of `patience`
    assert run.summary["steps"] == run.summary["eval"][-1]["step"] < MAX_STEPS


@needs("eval-2w", "eval-resume")
def test_a_resumed_run_evaluates_like_the_uninterrupted_one(runs):
    full, resumed = runs.get("eval-2w").check_ok().summary, runs.get("eval-resume").check_ok().summary
    by_step = {e["step"]: e["eval_loss"] for e in full["eval"]}
    # The checkpoint's evaluations are kept; eval_on_start evaluates again at the resume step (3).
    assert [e["step"] for e in resumed["eval"]] == [0, 2, 3, 4, 6]
    for entry in resumed["eval"]:
        if entry["step"] in by_step:
            assert rel(entry["eval_loss"], by_step[entry["step"]]) <= 1e-6, entry
    assert resumed["best_eval"]["step"] == full["best_eval"]["step"] and resumed["best_eval"].get("adapter")
    assert resumed["eval_set"] == full["eval_set"]


def _refused(workdir: Path, model_dir: Path, spec: EvalRunSpec) -> str:
    config = write_config(spec, workdir, model_dir)
    proc = subprocess.run([*_script("hypersloth-train"), str(config)], cwd=workdir, env=run_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert not (workdir / "outputs" / spec.name / "logs").exists()  # no worker started
    return proc.stderr


def test_eval_fraction_outside_range_is_refused_before_any_worker(workdir, model_dir):
    err = _refused(workdir, model_dir, EvalRunSpec("bad-fraction", eval_fraction=0.6))
    assert "eval_fraction" in err and "[0, 0.5]" in err


def test_empty_holdout_is_refused_before_any_worker(workdir, model_dir):
    err = _refused(workdir, model_dir, EvalRunSpec("empty-holdout", eval_fraction=0.001))
    assert "holds out no conversation" in err and "raise eval_fraction" in err


def test_eval_dataset_of_another_tokenizer_is_refused_before_any_worker(workdir, model_dir):
    from HyperSloth.train.tiny_model import build_tiny_tokenizer

    registry_path = workdir / "data" / "data_config.json"
    registry = json.loads(registry_path.read_text())
    other = workdir / "other-tokenizer"
    build_tiny_tokenizer([f"other words {i}" for i in range(40)], vocab_size=280).save_pretrained(other)
    registry["datasets"]["chat-other"] = dict(registry["datasets"]["chat"], name="chat-other", tokenizer=str(other))
    registry_path.write_text(json.dumps(registry))
    try:
        err = _refused(workdir, model_dir, EvalRunSpec("other-tokenizer", eval_fraction=0.0,
                                                       eval_dataset_name="chat-other"))
    finally:
        del registry["datasets"]["chat-other"]
        registry_path.write_text(json.dumps(registry))
    assert "eval dataset" in err and "was tokenised with" in err and "--tokenizer" in err
