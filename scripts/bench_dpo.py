"""The DPO workload of scripts/benchmark.py: synthetic preference pairs, TRL's DPOTrainer (+ Unsloth) as
the stock system, and DPO's FLOP count. Imported by bench_workloads.py and bench_systems.py (scripts/ is on
sys.path there).

Workload `dpo-0.6b`: Qwen3-0.6B shapes, pairs with lognormal prompt and completion lengths (random token
ids; chosen and rejected drawn independently), global batch 32 pairs. Its FLOP count is bench_workloads.py's
`flops_per_step(..., dpo=True)` over the pairs' sequences. Both systems see the same pairs in
the same optimizer steps: HyperSloth plans its steps from the registered preference dataset, and the stock
dataset is written in that plan's order (step by step), read sequentially.

Stock system `trl-dpo-PxA`: stock `FastLanguageModel` + `get_peft_model` (LoRA r=16 on all projections,
checkpointing off unless the system says so) + TRL's `DPOTrainer`, P pairs per device x A accumulation
steps (= 32 pairs per step), fused AdamW, bf16, beta 0.1, sigmoid loss, no truncation. Unsloth's
`PatchDPOTrainer` is called where the installed Unsloth has it (a no-op in current releases). TRL 1.15
tokenises text rows only (no pre-tokenised path for DPO), so its `_prepare_dataset` is bypassed and it is
given the token ids directly (`prompt_ids`/`chosen_ids`/`rejected_ids`, the columns its own tokeniser
writes). TRL's reference is the "ref" copy of the initial adapter (TRL's rule for a model that arrives
already wrapped by PEFT): B = 0, so the same function as HyperSloth's disabled adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BETA = 0.1
# pairs per device x accumulation steps: TRL's splits of the 32-pair step, most memory first
TRL_SPLITS = {"trl-dpo-32x1": (32, 1), "trl-dpo-16x2": (16, 2), "trl-dpo-8x4": (8, 4), "trl-dpo-4x8": (4, 8)}


@dataclass(frozen=True)
class Lengths:
    """Token lengths clip(exp(N(mu, sigma)), low, high)."""

    mu: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(np.exp(rng.normal(self.mu, self.sigma, n)), self.low, self.high).astype(np.int64)


# dpo-0.6b: prompts ~ 240 tokens (median), completions ~ 150 (each of chosen and rejected); a pair packs
# 2 x prompt + chosen + rejected, ~ 1,000 tokens on average, ~ 32k tokens per 32-pair step.
PROMPT, COMPLETION = Lengths(5.5, 0.8, 16, 2048), Lengths(5.0, 0.8, 8, 1024)


def sample_pairs(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """n pairs of random token ids in [100, vocab - 100) with the workload's lengths."""
    rng = np.random.default_rng(seed)
    sizes = PROMPT.draw(rng, n), COMPLETION.draw(rng, n), COMPLETION.draw(rng, n)
    columns = tuple([rng.integers(100, vocab - 100, size=int(k)).tolist() for k in col] for col in sizes)
    return columns


def build_pair_data(work: Path, steps: int, global_batch: int, vocab: int, seed: int) -> dict:
    """Register the pairs for HyperSloth (a preference dataset) and write the stock copy in HyperSloth's
    step order; returns what the records need (per step: pairs, real tokens, sequence lengths)."""
    from datasets import Dataset

    from HyperSloth.plan.batching import PlanSpec, adaptive_partition_batches

    n = global_batch * steps
    prompt, chosen, rejected = sample_pairs(n, vocab, seed)
    p, c, r = (np.array([len(x) for x in col], dtype=np.int64) for col in (prompt, chosen, rejected))
    lengths = 2 * p + c + r
    Dataset.from_dict({
        "prompt_input_ids": prompt, "chosen_input_ids": chosen, "rejected_input_ids": rejected,
        "length": lengths.tolist(), "prompt_length": p.tolist(), "chosen_length": c.tolist(),
        "rejected_length": r.tolist(), "num_trainable": (c + r).tolist(),
    }).save_to_disk(str(work / "data" / "built_dataset" / "bench"))
    longest = int((p + np.maximum(c, r)).max())
    (work / "data" / "data_config.json").write_text(json.dumps({"version": 1, "datasets": {"bench": {
        "name": "bench", "path": "built_dataset/bench", "num_samples": n, "kind": "preference",
        "stats": {"max_tokens": longest}}}}))
    # HyperSloth's steps do not depend on the rank count: order the stock pairs step by step.
    spec = PlanSpec(num_ranks=1, samples_per_step=global_batch, mode="packed", token_budget=1 << 22, seed=seed)
    plan = adaptive_partition_batches(lengths, np.ones_like(lengths), spec, epoch=0)
    order = [i for step in plan.steps for mb in step.ranks[0] for i in sorted(mb)]
    Dataset.from_dict({"prompt_ids": [prompt[i] for i in order], "chosen_ids": [chosen[i] for i in order],
                       "rejected_ids": [rejected[i] for i in order]}).save_to_disk(str(work / "stock_data"))
    step_pairs = [[i for mb in s.ranks[0] for i in mb] for s in plan.steps]
    return {"order": order, "lengths": lengths.tolist(),
            "step_tokens": [int(lengths[idx].sum()) for idx in step_pairs],
            "step_sequences": [[int(p[i] + c[i]) for i in idx] + [int(p[i] + r[i]) for i in idx] for idx in step_pairs],
            "max_sequence": longest}


def trl_dpo_trainer_class():
    """TRL's DPOTrainer, given pre-tokenised pairs (see the module docstring)."""
    from trl import DPOTrainer

    class PretokenisedDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # already prompt_ids / chosen_ids / rejected_ids, what TRL's tokeniser writes

    return PretokenisedDPOTrainer


def run_trl_dpo(a, *, max_len: int, lr: float, seed: int, projections: list[str], clock) -> dict:
    """Stock Unsloth + TRL DPOTrainer on one GPU (benchmark.py's `--as-system trl-dpo`)."""
    import unsloth  # noqa: F401  (first, it patches transformers/trl)
    import torch
    from datasets import load_from_disk
    from trl import DPOConfig
    from bench_stock import stock_lora_model  # scripts/ is on sys.path

    patch = getattr(unsloth, "PatchDPOTrainer", None)
    if patch is not None:
        patch()
    model, tok = stock_lora_model(a.checkpoint, max_seq_length=max_len, projections=projections, seed=seed,
                                  gradient_checkpointing=a.gc)
    args = DPOConfig(output_dir=str(Path(a.work) / f"out_{a.system}"), per_device_train_batch_size=a.micro,
                     gradient_accumulation_steps=a.accum, max_steps=a.steps, learning_rate=lr,
                     lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch_fused", logging_steps=1,
                     report_to="none", save_strategy="no", bf16=True, beta=BETA, max_length=None,
                     gradient_checkpointing=False, train_sampling_strategy="sequential", seed=seed)
    trainer = trl_dpo_trainer_class()(model=model, args=args, processing_class=tok, callbacks=[clock],
                                      train_dataset=load_from_disk(a.work + "/stock_data"))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return {"step_seconds": clock.step_seconds(), "losses": [h["loss"] for h in logged],
            "rewards_margins": [h.get("rewards/margins") for h in logged],
            "peak_gb": [torch.cuda.max_memory_allocated() / 2**30],
            "first_step_end_unix": clock.first_step_end_unix}
