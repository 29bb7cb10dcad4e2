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

from benchmark import FOUR_BIT, SEED, VOCAB  # noqa: E402  (the speed benchmark's shapes and seed)

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
    from HyperSloth.batching import PlanSpec, adaptive_partition_batches
    from HyperSloth.eval_set import split_holdout

    train, _ = split_holdout(len(lengths), fraction, SEED)
    spec = PlanSpec(num_ranks=1, samples_per_step=batch, mode="packed", token_budget=1 << 20, seed=SEED)
    plan = adaptive_partition_batches(lengths[train], lengths[train] - 1, spec, epoch=0)
    return [int(s.real_tokens) for s in plan.steps][:steps]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.6b", help="a shape of benchmark.py: 0.6b, 1.7b (bf16) or 8b (4-bit)")
    p.add_argument("--work", default="/tmp/hs_eval_bench")
    p.add_argument("--batch", type=int, default=32, help="samples per optimizer step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fraction", type=float, default=0.2)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--checkpoint", help="an existing model folder instead of building --model's shape (CPU smoke "
                   "test: a tiny model with --backend transformers --dtype float32)")
    p.add_argument("--backend", default="unsloth")
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = Path(a.checkpoint) if a.checkpoint else work / f"ckpt_{a.model}"
    if not a.checkpoint:  # in a child process: a parent that built it on the GPU would keep that memory
        subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = [{str(ROOT / 'scripts')!r}, {str(ROOT)!r}]; "
                        f"from benchmark import build_checkpoint; from pathlib import Path; "
                        f"build_checkpoint({a.model!r}, Path({str(checkpoint)!r}))"], check=True)
    rows = int(np.ceil(a.batch * a.steps / (1 - a.fraction))) + a.batch
    lengths = build_data(work, rows)
    out = work / "out"
    config = work / "bench_eval_config.py"
    config.write_text(CONFIG.format(work=work, fraction=a.fraction, budget=a.token_budget, checkpoint=checkpoint,
                                    four_bit=FOUR_BIT[a.model] and not a.checkpoint, seed=SEED, out=out, batch=a.batch,
                                    steps=a.steps, eval_steps=a.eval_steps, backend=a.backend, dtype=a.dtype))
    subprocess.run([sys.executable, "-m", "HyperSloth.cli.train", str(config), "--overwrite"], check=True)
    summary = json.loads((out / "train_summary.json").read_text())
    report(summary, step_tokens(lengths, a.fraction, a.batch, a.steps), a)


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
        "model": a.model, "token_budget": a.token_budget, "train_steps_timed": len(timed),
        "train_tokens_per_s": 1 / train_s_per_token, "eval_tokens": eval_tokens,
        "eval_seconds": eval_seconds, "eval_tokens_per_s": 1 / eval_s_per_token,
        "eval_cost_vs_train_pct": 100 * eval_s_per_token / train_s_per_token,
        "eval_losses": [e["eval_loss"] for e in summary["eval"]],
    }
    print("EVAL_BENCH " + json.dumps(result))


if __name__ == "__main__":
    main()
