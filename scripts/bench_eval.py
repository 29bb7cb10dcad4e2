"""What evaluating costs against training, per token, on the GPU (issue 13, item 4: must be <= 40%).

    python scripts/bench_eval.py --model 0.6b --work /tmp/hs_eval_bench

One real HyperSloth run (`python -m HyperSloth.cli.train`, 1 GPU, Unsloth, bf16 LoRA r=16 on all seven
projections, loss on all tokens, packed micro-batches of --token-budget tokens) on benchmark.py's
synthetic workload (random-weight Qwen3-shaped checkpoint, sample lengths clip(exp(N(6.2, 0.8)), 32, 4096)),
with `eval_fraction` held out and an evaluation every --eval-steps optimizer steps (and after the last).

    ratio = (eval seconds / eval tokens) / (training seconds / training tokens)

Eval seconds: each evaluation's wall time (`eval_seconds` in train_summary.json: forward of every
held-out row plus the one all-reduce). Training: the steps after --warmup whose wall time holds no
evaluation (HF evaluates after a step's end stamp, so the step after an evaluation would include it),
with each step's real tokens from the planner. The first evaluation is reported but not averaged
(kernels compile for new shapes).

    python scripts/bench_eval.py --direct --model 0.6b --steps 6

`--direct` measures the same ratio in one process in under a minute (for a short device budget): the
Qwen3-shaped model with a PEFT LoRA (transformers backend, SDPA, bf16), the benchmark's sample lengths,
HyperSloth's planner and collation; training = forward + backward of every packed micro-batch of
--steps optimizer steps plus an AdamW step per optimizer step; evaluation = HyperSloth's `Evaluator`
over the same rows (forward only, no grad, eval mode). Each is run once to warm up, then timed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from statistics import median

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_workloads import FOUR_BIT, SEED, VOCAB  # noqa: E402  (the speed benchmark's shapes and seed)

CONFIG = '''
from HyperSloth.config import *
hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="bench_eval", data_dir="{work}/data", eval_fraction={fraction}),
    training=TrainingConfig(gpus=[0], loss_type="all", batching="packed", tokens_per_micro_batch={budget}),
    fast_model_args=FastModelArgs(model_name="{checkpoint}", max_seq_length=4096, dtype="{dtype}",
                                  load_in_4bit={four_bit}, backend="{backend}", use_gradient_checkpointing=False),
    lora_args=LoraArgs(r=16, lora_alpha=16, lora_dropout=0.0, random_state={seed}),
)
training_config_model = TrainingArgsConfig(
    output_dir="{out}", per_device_train_batch_size={batch}, gradient_accumulation_steps=1, learning_rate=2e-4,
    lr_scheduler_type="constant", warmup_steps=0, max_steps={steps}, logging_steps=1, save_steps=100000,
    report_to="none", seed={seed}, num_train_epochs=None, eval_steps={eval_steps}, save_best_adapter=False,
    extra_args={{"save_strategy": "no"}},
)
'''


def build_data(work: Path, rows: int) -> np.ndarray:
    """benchmark.py's synthetic samples, registered as `bench_eval`; returns their lengths."""
    from datasets import Dataset

    rng = np.random.default_rng(SEED)
    lengths = np.clip(np.exp(rng.normal(6.2, 0.8, rows)), 32, 4096).astype(np.int64)
    ids = [rng.integers(100, VOCAB - 100, size=int(n)).tolist() for n in lengths]
    Dataset.from_dict({"input_ids": ids, "labels": ids, "length": lengths.tolist(),
                       "num_trainable": (lengths - 1).tolist(), "text": [""] * rows}).save_to_disk(
        str(work / "data" / "built_dataset" / "bench_eval"))
    entry = {"name": "bench_eval", "path": "built_dataset/bench_eval", "num_samples": rows,
             "stats": {"max_tokens": int(lengths.max())}}
    (work / "data" / "data_config.json").write_text(json.dumps({"version": 1, "datasets": {"bench_eval": entry}}))
    return lengths


def step_tokens(lengths: np.ndarray, fraction: float, batch: int, steps: int) -> list[int]:
    """Real tokens of each optimizer step of the run (the planner's step sets; epoch 0)."""
    from HyperSloth.plan.batching import PlanSpec, adaptive_partition_batches
    from HyperSloth.plan.eval_set import split_holdout

    train, _ = split_holdout(len(lengths), fraction, SEED)
    spec = PlanSpec(num_ranks=1, samples_per_step=batch, mode="packed", token_budget=1 << 20, seed=SEED)
    plan = adaptive_partition_batches(lengths[train], lengths[train] - 1, spec, epoch=0)
    return [int(s.real_tokens) for s in plan.steps][:steps]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.6b", help="a shape of bench_workloads.py: 0.6b, 1.7b (bf16) or 8b (4-bit); "
                   "--direct also takes 'tiny' (a CPU smoke test)")
    p.add_argument("--work", default="/tmp/hs_eval_bench")
    p.add_argument("--batch", type=int, default=32, help="samples per optimizer step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fraction", type=float, default=0.2)
    p.add_argument("--token-budget", type=lambda v: v if v == "auto" else int(v), default="auto",
                   help="tokens_per_micro_batch of the run (the product default, auto); --direct takes 16384 for auto")
    p.add_argument("--checkpoint", help="an existing model folder instead of building --model's shape (CPU smoke "
                   "test: a tiny model with --backend transformers --dtype float32)")
    p.add_argument("--backend", default="unsloth")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--direct", action="store_true", help="one process, no launcher: see the docstring")
    a = p.parse_args()
    if a.direct:
        direct(a)
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = Path(a.checkpoint) if a.checkpoint else work / f"ckpt_{a.model}"
    if not a.checkpoint:  # in a child process: a parent that built it on the GPU would keep that memory
        subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = [{str(ROOT / 'scripts')!r}, {str(ROOT)!r}]; "
                        f"from bench_workloads import build_checkpoint; from pathlib import Path; "
                        f"build_checkpoint({a.model!r}, Path({str(checkpoint)!r}))"], check=True)
    rows = int(np.ceil(a.batch * a.steps / (1 - a.fraction))) + a.batch
    lengths = build_data(work, rows)
    out = work / "out"
    config = work / "bench_eval_config.py"
    config.write_text(CONFIG.format(work=work, fraction=a.fraction, budget=repr(a.token_budget), checkpoint=checkpoint,
                                    four_bit=FOUR_BIT[a.model] and not a.checkpoint, seed=SEED, out=out, batch=a.batch,
                                    steps=a.steps, eval_steps=a.eval_steps, backend=a.backend, dtype=a.dtype))
    subprocess.run([sys.executable, "-m", "HyperSloth.cli.train", str(config), "--overwrite"], check=True)
    summary = json.loads((out / "train_summary.json").read_text())
    report(summary, step_tokens(lengths, a.fraction, a.batch, a.steps), a)


def direct(a) -> None:
    """The eval/train cost ratio in this process (see the module docstring)."""
    import time

    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bench_workloads import HEAD_DIM, PROJECTIONS, SHAPES
    from HyperSloth.plan.batching import PlanSpec, adaptive_partition_batches
    from HyperSloth.plan.eval_set import plan_eval
    from HyperSloth.train.collate import collate
    from HyperSloth.train.evaluation import Evaluator

    torch.manual_seed(SEED)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab, head_dim, shape = VOCAB, HEAD_DIM, SHAPES.get(a.model)
    if shape is None:  # "tiny": a CPU smoke test of this function
        vocab, head_dim, shape = 1000, 16, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=2, intermediate_size=128)
    config = Qwen3Config(vocab_size=vocab, head_dim=head_dim, max_position_embeddings=8192, rope_theta=1e6, **shape)
    with torch.device(device):
        base = Qwen3ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=16, target_modules=PROJECTIONS, task_type="CAUSAL_LM"))
    rng = np.random.default_rng(SEED)
    lengths = np.clip(np.exp(rng.normal(6.2, 0.8, a.batch * a.steps)), 32, 4096).astype(np.int64)
    ids = [rng.integers(3, vocab - 3, size=int(n)) for n in lengths]
    rows = Dataset.from_dict({"input_ids": [x.tolist() for x in ids], "labels": [x.tolist() for x in ids]})
    a.token_budget = 16384 if a.token_budget == "auto" else a.token_budget  # no probe in this mode
    spec = PlanSpec(num_ranks=1, samples_per_step=a.batch, mode="packed", token_budget=a.token_budget, seed=SEED)
    train_plan = adaptive_partition_batches(lengths, lengths - 1, spec)
    evaluator = Evaluator(rows, plan_eval(lengths, lengths - 1, spec), rank=0, loss_type="all", pad_token_id=0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    cuda = lambda batch: {k: v.to(device) for k, v in batch.items()}  # noqa: E731

    def train() -> None:
        model.train()
        for step in train_plan.steps:
            for mb in step.ranks[0]:
                batch = cuda(collate([(ids[i], ids[i]) for i in mb], "packed", 0))
                model(**batch, num_items_in_batch=step.num_trainable, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def evaluate() -> None:
        model.eval()
        with torch.no_grad():
            evaluator.run(lambda b: model(**cuda(b), num_items_in_batch=1, use_cache=False).loss, device)

    def seconds(fn) -> float:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    warm = (seconds(train), seconds(evaluate))
    train_s, eval_s = seconds(train), seconds(evaluate)
    tokens = int(lengths.sum())
    print("EVAL_BENCH " + json.dumps({
        "mode": "direct", "model": a.model, "backend": "transformers+peft sdpa bf16", "token_budget": a.token_budget,
        "tokens": tokens, "train_s": train_s, "eval_s": eval_s, "warmup_s": warm,
        "train_tokens_per_s": tokens / train_s, "eval_tokens_per_s": tokens / eval_s,
        "eval_cost_vs_train_pct": 100 * eval_s / train_s,
        "micro_batches": {"train": train_plan.stats.micro_batches_per_rank,
                          "eval": evaluator.plan.stats.micro_batches_per_rank},
        "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}))


def report(summary: dict, tokens: list[int], a) -> None:
    seconds = summary["step_seconds"]
    # Step k (1-based) runs after the evaluation of step k-1 when k-1 is a multiple of eval_steps.
    timed = [k for k in range(a.warmup + 1, len(seconds) + 1) if (k - 1) % a.eval_steps != 0]
    train_s_per_token = sum(seconds[k - 1] for k in timed) / sum(tokens[k - 1] for k in timed)
    eval_tokens = summary["eval_set"]["tokens"]
    eval_seconds = summary["eval_seconds"]
    later = eval_seconds[1:] or eval_seconds
    eval_s_per_token = median(later) / eval_tokens
    result = {
        "model": a.model, "token_budget": summary.get("token_budget", a.token_budget), "train_steps_timed": len(timed),
        "train_tokens_per_s": 1 / train_s_per_token, "eval_tokens": eval_tokens,
        "eval_seconds": eval_seconds, "eval_tokens_per_s": 1 / eval_s_per_token,
        "eval_cost_vs_train_pct": 100 * eval_s_per_token / train_s_per_token,
        "eval_losses": [e["eval_loss"] for e in summary["eval"]],
    }
    print("EVAL_BENCH " + json.dumps(result))


if __name__ == "__main__":
    main()
