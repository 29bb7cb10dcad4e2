"""The GRPO workload of scripts/benchmark.py (issue 34, item 8): synthetic text prompts, TRL's GRPOTrainer (+
Unsloth) as the stock system. Imported by bench_workloads.py and bench_systems.py (scripts/ is on sys.path there).

Workload `grpo-0.6b`: Qwen3-0.6B shapes (random weights), text prompts of random words (lognormal lengths,
median ~100 tokens of the checkpoint's tokenizer), 8 prompts x `NUM_GENERATIONS` = 8 completions of at most
`MAX_COMPLETION` = 256 tokens per optimizer step (global batch 64 completions, TRL's meaning), temperature 1,
beta 0, TRL 1.15's default loss (dapo), one cheap reward function (completion length). A random-weight model
almost never samples the end-of-sequence token, so every completion runs to 256 tokens on both systems: the
same tokens are generated and trained. Both systems see the same prompts in the same steps: HyperSloth plans
its steps from the registered prompt dataset, and the stock dataset is written in that plan's order and read
unshuffled (`shuffle_dataset=False`). Prompt tokens are the tokenizer's on both sides (TRL tokenises the text
itself; the HyperSloth dataset is built with data/prompts.py's `prompt_ids`, TRL's rule).

Stock system `trl-grpo-PxA`: `FastLanguageModel` + `get_peft_model` (LoRA r=16 on all projections,
checkpointing off) + TRL's `GRPOTrainer` with HF generate (no vLLM: it cannot be installed on the device),
P completions per device x A accumulation steps (= 64 per step; TRL generates the step's 64 in one call
whatever the split), fused AdamW, bf16. Its generation time is the seconds in its model's `generate` per step
(`GenerateTimer`); HyperSloth's is `timing/generation_s` (rank 0). Its `generate` gets HyperSloth's patch of
transformers too (`with_deferred_stop_check`: the stop check read a token step late, `rollout.deferred_stop_check`),
as the SFT rows get HyperSloth's varlen and loss patches: the same library behaviour on both sides. Sampling on
merged weights is HyperSloth's own way of sampling, not a library patch; TRL without vLLM has none.

FLOPs (for MFU) count the training pass over every prompt + completion sequence, as for SFT; generation is
not counted (it is memory-bound decoding), so MFU understates both systems alike.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

NUM_GENERATIONS, MAX_COMPLETION, PROMPTS_PER_STEP = 8, 256, 8
GLOBAL_COMPLETIONS = NUM_GENERATIONS * PROMPTS_PER_STEP
WORDS_MU, WORDS_SIGMA, WORDS_LOW, WORDS_HIGH = 3.2, 0.5, 4, 150  # words per prompt (~4 tokens each)
MAX_PROMPT_TOKENS = 1024
# completions per device x accumulation steps: TRL's splits of the 64-completion step, most memory first
TRL_SPLITS = {"trl-grpo-64x1": (64, 1), "trl-grpo-32x2": (32, 2), "trl-grpo-16x4": (16, 4), "trl-grpo-8x8": (8, 8)}
WORDS = ("the cat sat on a mat and then ran away from the dog who was big red blue green small "
         "alpha beta gamma delta number seven eleven answer question think step first second").split()

REWARD_SOURCE = '''
def length_reward(prompts, completions, **kwargs):
    """A cheap verifiable reward: completion length in characters / 1000."""
    return [len(c if isinstance(c, str) else c[0]["content"]) / 1000.0 for c in completions]
'''


def length_reward(prompts, completions, **kwargs):
    """The workload's reward (the same function the HyperSloth config defines from `REWARD_SOURCE`)."""
    return [len(c if isinstance(c, str) else c[0]["content"]) / 1000.0 for c in completions]


def sample_prompts(n: int, seed: int) -> list[str]:
    """n text prompts of random words, lognormal word counts."""
    rng = np.random.default_rng(seed)
    counts = np.clip(np.exp(rng.normal(WORDS_MU, WORDS_SIGMA, n)), WORDS_LOW, WORDS_HIGH).astype(int)
    return [" ".join(rng.choice(WORDS, int(k))) for k in counts]


def build_prompt_data(work: Path, steps: int, checkpoint: Path, seed: int) -> dict:
    """Register the prompts for HyperSloth (a prompt dataset) and write the stock copy in HyperSloth's step
    order; returns what the records need (per step: real tokens and the trained sequences' lengths)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from HyperSloth.data.prompts import prompt_ids
    from HyperSloth.plan.batching import PlanSpec, adaptive_partition_batches

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    n = PROMPTS_PER_STEP * steps
    texts = sample_prompts(n, seed)
    ids = [prompt_ids(tok, t)[:MAX_PROMPT_TOKENS] for t in texts]
    texts = [tok.decode(i) if len(i) == MAX_PROMPT_TOKENS else t for i, t in zip(ids, texts)]
    p = np.array([len(i) for i in ids], dtype=np.int64)
    Dataset.from_dict({
        "prompt_input_ids": ids, "prompt_length": p.tolist(), "length": p.tolist(), "num_trainable": [1] * n,
        "prompt_json": [json.dumps(t) for t in texts], "columns_json": ["{}"] * n,
    }).save_to_disk(str(work / "data" / "built_dataset" / "bench"))
    (work / "data" / "data_config.json").write_text(json.dumps({"version": 1, "datasets": {"bench": {
        "name": "bench", "path": "built_dataset/bench", "num_samples": n, "kind": "prompt",
        "stats": {"max_tokens": int(p.max())}}}}))
    # HyperSloth's steps do not depend on the rank count: order the stock prompts step by step.
    planned = NUM_GENERATIONS * (p + MAX_COMPLETION)
    spec = PlanSpec(num_ranks=1, samples_per_step=PROMPTS_PER_STEP, mode="packed", token_budget=1 << 22, seed=seed)
    plan = adaptive_partition_batches(planned, np.ones_like(planned), spec, epoch=0)
    order = [i for step in plan.steps for mb in step.ranks[0] for i in sorted(mb)]
    Dataset.from_dict({"prompt": [texts[i] for i in order]}).save_to_disk(str(work / "stock_data"))
    step_prompts = [[i for mb in s.ranks[0] for i in mb] for s in plan.steps]
    sequences = [[int(p[i]) + MAX_COMPLETION for i in idx for _ in range(NUM_GENERATIONS)] for idx in step_prompts]
    return {"order": order, "lengths": p.tolist(), "step_tokens": [sum(s) for s in sequences],
            "step_sequences": sequences, "max_sequence": int(p.max()) + MAX_COMPLETION}


def hypersloth_grpo_lines() -> tuple[str, str]:
    """(the config file's reward functions, the TrainingConfig arguments) of HyperSloth's GRPO run."""
    training = (f'method="grpo", grpo=GrpoArgs(num_generations={NUM_GENERATIONS}, '
                f'max_completion_length={MAX_COMPLETION}, temperature=1.0, beta=0.0)')
    return REWARD_SOURCE + "\nreward_funcs = [length_reward]\n", training


def with_deferred_stop_check(model) -> None:
    """The model's `generate` with HF's stop check a token step late (rollout.deferred_stop_check; on a GPU only),
    as HyperSloth's GRPO samples: given to the stock system so both sides run the same transformers."""
    from HyperSloth.train.grpo.rollout import deferred_stop_check

    original = model.generate

    def deferred(*args, **kwargs):
        with deferred_stop_check(model.device):
            return original(*args, **kwargs)

    model.generate = deferred


class GenerateTimer:
    """Seconds a TRL trainer spends in its model's `generate` per optimizer step. TRL's own
    `profiling/Time taken: ...generate` metric goes only to wandb / mlflow / trackio, never to the log history
    (trl/extras/profiling.py, 1.15), so the 2026-12-02 records have no stock split. The model's `generate` is
    wrapped (TRL calls it on the unwrapped model, the one handed to the trainer; Unsloth's GRPO wraps it again
    for the call and puts this one back), the GPU synchronised before the clock stops, and the calls of one step
    summed at its end (`callback`)."""

    def __init__(self, model, synchronize=None):
        self.per_step: list[float] = []
        self._pending = 0.0
        original = model.generate
        if synchronize is None:
            import torch
            synchronize = torch.cuda.synchronize

        def timed(*args, **kwargs):
            started = time.perf_counter()
            out = original(*args, **kwargs)
            synchronize()
            self._pending += time.perf_counter() - started
            return out

        model.generate = timed

    def step_done(self) -> None:
        """End of an optimizer step: its generate seconds (0.0 when it reused an earlier rollout)."""
        self.per_step.append(self._pending)
        self._pending = 0.0

    def callback(self):
        """A TrainerCallback calling `step_done` at every step's end."""
        from transformers import TrainerCallback

        timer = self

        class _StepEnd(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                timer.step_done()

        return _StepEnd()


def run_trl_grpo(a, *, max_len: int, lr: float, seed: int, projections: list[str], clock) -> dict:
    """Stock Unsloth + TRL GRPOTrainer on one GPU (benchmark.py's `--as-system trl-grpo`)."""
    import unsloth  # noqa: F401  (first, it patches transformers/trl)
    import torch
    from datasets import load_from_disk
    from trl import GRPOConfig, GRPOTrainer
    from bench_stock import stock_lora_model  # scripts/ is on sys.path

    model, tok = stock_lora_model(a.checkpoint, max_seq_length=max_len, projections=projections, seed=seed,
                                  gradient_checkpointing=a.gc)
    args = GRPOConfig(output_dir=str(Path(a.work) / f"out_{a.system}"), per_device_train_batch_size=a.micro,
                      gradient_accumulation_steps=a.accum, max_steps=a.steps, learning_rate=lr,
                      lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch_fused", logging_steps=1,
                      report_to="none", save_strategy="no", bf16=True, num_generations=NUM_GENERATIONS,
                      max_completion_length=MAX_COMPLETION, temperature=1.0, beta=0.0, use_vllm=False,
                      shuffle_dataset=False, gradient_checkpointing=bool(a.gc), seed=seed)
    with_deferred_stop_check(model)
    timer = GenerateTimer(model)
    trainer = GRPOTrainer(model=model, reward_funcs=[length_reward], args=args, processing_class=tok,
                          train_dataset=load_from_disk(a.work + "/stock_data"), callbacks=[clock, timer.callback()])
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return {"step_seconds": clock.step_seconds(), "losses": [h["loss"] for h in logged],
            "rewards": [h.get("reward") for h in logged],
            "completion_lengths": [h.get("completions/mean_length") for h in logged],
            "generation_s": timer.per_step,
            "peak_gb": [torch.cuda.max_memory_allocated() / 2**30],
            "first_step_end_unix": clock.first_step_end_unix}
