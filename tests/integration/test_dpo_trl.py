"""HyperSloth's DPO equals TRL's DPOTrainer, the reference implementation, step by step.

The same 12 text pairs, tokenised by TRL (its `_prepare_dataset`), the same tiny Qwen3 and adapter
(HyperSloth's own loader builds both models), the same optimizer settings. TRL runs its DPOTrainer in
this process, one batch of all 12 pairs per step; HyperSloth runs `hypersloth-train` (1 CPU worker, its
own process) on the same pairs saved as a preference dataset, packed into micro-batches of <= 160 tokens. The logged
losses and rewards of steps 1-3 agree within 1e-5: step 1 is the start (policy == reference: ln 2),
steps 2 and 3 come after one and two identical optimizer steps. With an initial adapter the reference
is that adapter (TRL: its "ref" copy; HyperSloth: the adapter loaded a second time, frozen).

TRL's per-token log-probability kernel is Triton (GPU only); on CPU the test gives TRL the same
function computed from its definition (trl_cpu_kernel.py). Everything else is TRL's code.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

STEPS, LR, BETA, SEED = 3, 5e-3, 0.1, 11
WORDS = "the cat sat on a mat and then ran away from the dog who was big red blue green small".split()
TRL_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def _text_pairs(count: int = 12) -> dict[str, list[str]]:
    rng = np.random.default_rng(3)

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS, int(rng.integers(low, high))))

    return {"prompt": [text(3, 14) for _ in range(count)], "chosen": [" " + text(2, 10) for _ in range(count)],
            "rejected": [" " + text(2, 10) for _ in range(count)]}


def _fast_args(model_dir: Path):
    from HyperSloth.config import FastModelArgs

    return FastModelArgs(model_name=str(model_dir), max_seq_length=256, dtype="float32", backend="transformers")


def _trl_run(model_dir: Path, lora, out: Path):
    """TRL's DPOTrainer on the pairs; (its log history, its tokenised dataset)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from HyperSloth.train.model import load_model

    loaded = load_model(_fast_args(model_dir), lora)
    pairs = _text_pairs()
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=len(pairs["prompt"]), max_steps=STEPS,
                     learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch_fused",
                     max_grad_norm=1.0, beta=BETA, max_length=None, use_cpu=True, report_to="none",
                     bf16=False,  # TRL's default (None) means bf16 autocast, on CPU too
                     save_strategy="no", logging_steps=1, gradient_checkpointing=False, seed=SEED)
    trainer = DPOTrainer(model=loaded.model, args=args, train_dataset=Dataset.from_dict(pairs),
                         processing_class=loaded.tokenizer)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], trainer.train_dataset


def _save_pairs(tokenised, data_dir: Path) -> None:
    """TRL's token ids as a registered HyperSloth preference dataset (the builder's columns)."""
    from datasets import Dataset

    prompt, chosen, rejected = (tokenised[c] for c in ("prompt_ids", "chosen_ids", "rejected_ids"))
    Dataset.from_dict({
        "prompt_input_ids": prompt, "chosen_input_ids": chosen, "rejected_input_ids": rejected,
        "length": [2 * len(p) + len(c) + len(r) for p, c, r in zip(prompt, chosen, rejected)],
        "prompt_length": [len(p) for p in prompt], "chosen_length": [len(c) for c in chosen],
        "rejected_length": [len(r) for r in rejected], "num_trainable": [len(c) + len(r) for c, r in zip(chosen, rejected)],
    }).save_to_disk(str(data_dir / "built_dataset" / "pairs"))
    (data_dir / "data_config.json").write_text(json.dumps({"version": 1, "datasets": {"pairs": {
        "name": "pairs", "path": "built_dataset/pairs", "num_samples": len(prompt), "kind": "preference"}}}))


def _hypersloth_run(tmp_path: Path, model_dir: Path, lora, count: int) -> dict:
    """`hypersloth-train` on the saved pairs (1 CPU worker, its own process, as users run it); its summary."""
    from training_fixtures import run_env

    config = tmp_path / "dpo.py"
    config.write_text(textwrap.dedent(f"""
        from HyperSloth.config import *
        hyper_config_model = HyperConfig(
            data=DataConfig(dataset_name="pairs", data_dir={str(tmp_path / 'data')!r}),
            training=TrainingConfig(gpus=[0], method="dpo", dpo_beta={BETA}, tokens_per_micro_batch=160),
            fast_model_args=FastModelArgs.model_validate({_fast_args(model_dir).model_dump()!r}),
            lora_args=LoraArgs.model_validate({lora.model_dump()!r}),
        )
        training_config_model = TrainingArgsConfig(
            output_dir={str(tmp_path / 'out')!r}, per_device_train_batch_size={count}, gradient_accumulation_steps=1,
            max_steps={STEPS}, learning_rate={LR}, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
            report_to="none", seed={SEED}, save_steps=1000)
    """))
    done = subprocess.run([sys.executable, "-m", "HyperSloth.cli.train", str(config)], cwd=tmp_path, env=run_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp_path / "out" / "train_summary.json").read_text())


@pytest.mark.parametrize("initial_adapter", [False, True], ids=["new-adapter", "initial-adapter"])
def test_the_logged_dpo_loss_equals_trl_dpotrainer(tmp_path, monkeypatch, initial_adapter, tiny_model_dir):
    import torch
    import trl.trainer.utils as trl_utils
    from trl_cpu_kernel import ReferenceLogProbFunction

    from HyperSloth.config import LoraArgs
    from HyperSloth.train.model import load_model

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", ReferenceLogProbFunction)
    model_dir = tiny_model_dir
    lora = LoraArgs(r=8, lora_alpha=16, lora_dropout=0.0)
    if initial_adapter:  # an "SFT" adapter with B != 0, so the reference is not the base model
        first = load_model(_fast_args(model_dir), lora).model
        with torch.no_grad():
            for name, param in first.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.1, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
        first.save_pretrained(str(tmp_path / "sft-adapter"))
        lora = lora.model_copy(update={"init_adapter_path": str(tmp_path / "sft-adapter")})
    trl_logs, tokenised = _trl_run(model_dir, lora, tmp_path / "trl")
    _save_pairs(tokenised, tmp_path / "data")
    ours = _hypersloth_run(tmp_path, model_dir, lora, len(tokenised))
    assert len(trl_logs) == len(ours["step_losses"]) == STEPS
    assert ours["step_losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    np.testing.assert_allclose(ours["step_losses"], [h["loss"] for h in trl_logs], rtol=1e-5, atol=1e-6)
    for key in TRL_KEYS:
        np.testing.assert_allclose(ours["step_rewards"][key], [h[key] for h in trl_logs], rtol=1e-5, atol=1e-6,
                                   err_msg=key)
    assert trl_logs[-1]["rewards/margins"] > 1e-3  # the steps moved the policy away from the reference
