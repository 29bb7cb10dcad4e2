"""DPO on N workers is exactly DPO in one process: real CLI runs on CPU over gloo (tiny Qwen3, fp32).

96 synthetic preference pairs (lognormal prompt and completion lengths), 6 optimizer steps of 16 pairs,
10% of the pairs held out and evaluated at steps 3 and 6. The runs share `RunPool` with the SFT tests'
machinery (training_fixtures.py); three runs: 2 workers, 1 worker, and a resume of the 2-worker run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from training_fixtures import (MAX_STEPS, SAVE_STEPS, RunSpec, flat_adapter, needs, pool_fixtures,
                               relative_error)

pytestmark = pytest.mark.slow

PAIRS = "pairs"
NUM_PAIRS = 96
RTOL = 1e-5
# A reward is beta x (policy - reference) log-probability of a completion: the difference of two sums of
# ~-90 in float32, resolved to ~1e-5 absolute whatever the rank count (measured: 2e-6 with beta 0.5).
REWARD_ATOL = 1e-5
REWARD_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def write_pairs(data_dir: Path, name: str, count: int, vocab: int, seed: int = 0) -> None:
    """A registered preference dataset in the builder's layout (docs/dpo.md): random token ids, lognormal
    prompt and completion lengths, every completion ending with the end-of-turn id 2."""
    from datasets import Dataset

    rng = np.random.default_rng(seed)

    def ids(mu: float, low: int, high: int) -> list[int]:
        n = int(np.clip(np.exp(rng.normal(mu, 0.6)), low, high))
        return [*rng.integers(10, vocab, size=n - 1).tolist(), 2]

    rows = [(ids(3.0, 3, 60), ids(2.5, 2, 40), ids(2.5, 2, 40)) for _ in range(count)]
    prompt, chosen, rejected = (list(column) for column in zip(*rows))
    lengths = {f"{k}_length": [len(r) for r in col] for k, col in zip(("prompt", "chosen", "rejected"), (prompt, chosen, rejected))}
    Dataset.from_dict({
        "prompt_input_ids": prompt, "chosen_input_ids": chosen, "rejected_input_ids": rejected,
        "length": [2 * len(p) + len(c) + len(r) for p, c, r in rows], **lengths,
        "num_trainable": [len(c) + len(r) for _, c, r in rows],
    }).save_to_disk(str(data_dir / "built_dataset" / name))
    registry = data_dir / "data_config.json"
    content = json.loads(registry.read_text()) if registry.is_file() else {"version": 1, "datasets": {}}
    longest = max(len(p) + max(len(c), len(r)) for p, c, r in rows)
    content["datasets"][name] = {"name": name, "path": f"built_dataset/{name}", "num_samples": count,
                                 "kind": "preference", "stats": {"max_tokens": longest}}
    registry.write_text(json.dumps(content))


@dataclass(frozen=True)
class DPORunSpec(RunSpec):
    """A DPO run of the pool: the pairs dataset, method='dpo', a 10% hold-out evaluated every 3 steps."""

    def hyper_config(self, model_dir: Path) -> dict[str, Any]:
        config = super().hyper_config(model_dir)
        config["data"] = {"dataset_name": PAIRS, "data_dir": "data", "eval_fraction": 0.1}
        config["training"].update(method="dpo", dpo_beta=0.5)
        return config

    def training_config(self) -> dict[str, Any]:
        # Adam divides each gradient entry by its own magnitude (plus eps): with the default eps 1e-8, entries
        # near zero turn float-order noise (1e-7 relative) into 1e-6-relative adapter noise. eps 1e-6 keeps
        # the comparison about the gradients, which must agree.
        return {**super().training_config(), "eval_steps": SAVE_STEPS, "max_grad_norm": 1.0,
                "extra_args": {"adam_epsilon": 1e-6}}


SPECS = [
    DPORunSpec("dpo-2w"),
    DPORunSpec("dpo-1w", gpus=1, per_device=8),
    DPORunSpec("dpo-resume", resume_from="dpo-2w"),
]


def _pairs_inputs(workdir: Path, tiny_model_dir: Path) -> Path:
    write_pairs(workdir / "data", PAIRS, NUM_PAIRS, vocab=512)
    return tiny_model_dir


workdir, model_dir, runs, _ = pool_fixtures("dpo", SPECS, build=_pairs_inputs)


def _close(actual, expected, what: str, rtol: float = RTOL, atol: float = 0.0) -> None:
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


@needs("dpo-2w", "dpo-1w")
def test_two_workers_train_the_adapter_one_worker_trains(runs):
    multi, single = runs.get("dpo-2w").check_ok(), runs.get("dpo-1w").check_ok()
    a, b = multi.summary, single.summary
    assert (a["world_size"], b["world_size"], a["global_batch_size"], a["steps"]) == (2, 1, 16, MAX_STEPS)
    _close(a["step_losses"], b["step_losses"], "per-step losses")
    for key in REWARD_KEYS:  # the metrics are global means over each step's pairs, on any rank count
        _close(a["step_rewards"][key], b["step_rewards"][key], key, atol=REWARD_ATOL)
    _close(a["grad_norms"], b["grad_norms"], "grad norms")
    assert [e["eval_loss"] for e in a["eval"]] == pytest.approx([e["eval_loss"] for e in b["eval"]], rel=RTOL)
    weights = multi.adapter()
    assert relative_error(flat_adapter(single.adapter()), flat_adapter(weights)) <= 1e-6  # measured 5e-7
    # The adapter moved (B starts at 0), and so did the policy away from the reference.
    assert all(np.linalg.norm(w) > 1e-3 for name, w in weights.items() if "lora_B" in name)
    assert min(abs(m) for m in a["step_rewards"]["rewards/margins"][2:]) > 1e-3


@needs("dpo-2w")
def test_the_first_step_is_ln2_and_every_metric_is_logged(runs):
    run = runs.get("dpo-2w").check_ok()
    summary = run.summary
    assert summary["method"] == "dpo" and summary["dpo_beta"] == 0.5
    # Policy == reference at step 1, and at step 2 too: the warm-up's first learning rate is 0.
    assert summary["step_losses"][:2] == pytest.approx([math.log(2)] * 2, abs=1e-6)
    assert [summary["step_rewards"][key][0] for key in REWARD_KEYS] == [0.0, 0.0, 0.0, 0.0]
    margins = np.subtract(summary["step_rewards"]["rewards/chosen"], summary["step_rewards"]["rewards/rejected"])
    _close(summary["step_rewards"]["rewards/margins"], margins, "margins = chosen - rejected", atol=1e-6)
    assert [e["step"] for e in summary["eval"]] == [3, 6]
    assert all(e["eval_pairs"] == 10 and f"eval_{REWARD_KEYS[3]}" in e for e in summary["eval"])
    state = json.loads((run.out / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "loss" in h]
    assert all(key in h for h in logged for key in REWARD_KEYS)
    evaluated = [h for h in state["log_history"] if "eval_loss" in h]
    assert all(h["eval_pairs"] == 10 and f"eval_{REWARD_KEYS[3]}" in h for h in evaluated)
    assert "rewards/margins" in (run.out / "report.md").read_text()
    assert "global batch 16 pairs per optimizer step" in (run.out / "logs" / "rank0.log").read_text()
    card = (run.out / "README.md").read_text()  # named after the method trained, not the SFT base class
    assert "- dpo" in card and "- sft" not in card and "DPO" in card


@needs("dpo-2w", "dpo-resume")
def test_a_resumed_dpo_run_equals_the_uninterrupted_one(runs):
    full, resumed = runs.get("dpo-2w").check_ok(), runs.get("dpo-resume").check_ok()
    a, b = full.summary, resumed.summary
    # The whole run: the steps before the resume come from the checkpoint (trainer.StepHistory).
    assert b["first_step"] == 1 and b["steps"] == MAX_STEPS
    _close(b["step_losses"], a["step_losses"], "losses of the resumed run", rtol=1e-6)
    for key in REWARD_KEYS:
        _close(b["step_rewards"][key], a["step_rewards"][key], key, rtol=1e-6, atol=REWARD_ATOL)
    assert relative_error(flat_adapter(full.adapter()), flat_adapter(resumed.adapter())) <= 1e-6
