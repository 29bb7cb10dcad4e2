"""Check that N workers reproduce 1 worker: same per-step losses, grad norms and final adapter.

    python scripts/check_equivalence.py --workers 1,2,4,8 [--steps 4] [--global-batch 32] [--mode packed]

Builds the tiny model and the sample dataset in a temporary folder, trains the same global batch with
each worker count (CPU processes over gloo without a GPU; GPUs when present and enough ids are given),
and prints the largest relative differences against the first worker count. Runs through the real
`hypersloth-train` CLI, so it checks the launcher, the planner and the gradient sync together.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIG = '''
from HyperSloth.config import *
hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="sample-chat", data_dir="{work}/data"),
    training=TrainingConfig(gpus={gpus}, loss_type="response_only", batching="{mode}", tokens_per_micro_batch=1024),
    fast_model_args=FastModelArgs(model_name="{work}/tiny", max_seq_length=1024, dtype="float32",
                                  backend="transformers"),
    lora_args=LoraArgs(r=16, lora_alpha=16),
)
training_config_model = TrainingArgsConfig(
    output_dir="{out}", per_device_train_batch_size={per_device}, gradient_accumulation_steps=1,
    learning_rate=1e-2, max_steps={steps}, warmup_steps=0, logging_steps=1, save_steps=100000,
    report_to="none", max_grad_norm=0.01,
)
'''


def prepare(work: Path) -> None:
    from HyperSloth.data.build import build_dataset
    from HyperSloth.train.tiny_model import build_tiny_model

    build_tiny_model(work / "tiny")
    build_dataset(str(ROOT / "data" / "sample_chat.jsonl"), name="sample-chat", tokenizer=str(work / "tiny"),
                  data_dir=str(work / "data"), max_seq_length=1024, num_proc=1)


def train(work: Path, workers: int, a) -> dict:
    out = work / f"out{workers}"
    cfg = work / f"cfg{workers}.py"
    cfg.write_text(CONFIG.format(work=work, gpus=list(range(workers)), mode=a.mode, out=out,
                                 per_device=a.global_batch // workers, steps=a.steps))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.time()
    subprocess.run([sys.executable, "-m", "HyperSloth.cli.train", str(cfg), "--overwrite"], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    summary = json.loads((out / "train_summary.json").read_text())
    summary["elapsed_s"] = time.time() - started
    summary["hashes"] = {json.loads(p.read_text())["sha256"] for p in (out / "logs").glob("rank*.final.json")}
    return summary


def adapter_error(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    num = sum(float(((x[k] - y[k]) ** 2).sum()) for k in x)
    den = sum(float((x[k] ** 2).sum()) for k in x)
    return (num / den) ** 0.5


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--mode", default="packed", choices=["packed", "sorted-pad"])
    a = p.parse_args()
    counts = [int(w) for w in a.workers.split(",")]
    if any(a.global_batch % w for w in counts):
        p.error("--global-batch must be divisible by every worker count")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare(work)
        runs = {w: train(work, w, a) for w in counts}
        base = counts[0]
        print(f"| workers | loss rel diff vs {base} | grad-norm rel diff | adapter rel err | ranks identical | wall s |")
        print("|---|---|---|---|---|---|")
        for w in counts:
            r = runs[w]
            print(f"| {w} | {rel(runs[base]['step_losses'], r['step_losses']):.1e} | "
                  f"{rel(runs[base]['grad_norms'], r['grad_norms']):.1e} | "
                  f"{adapter_error(work / f'out{base}', work / f'out{w}'):.1e} | {len(r['hashes']) == 1} | "
                  f"{r['elapsed_s']:.0f} |")
        print("losses (first run):", [round(x, 5) for x in runs[base]["step_losses"]])


if __name__ == "__main__":
    main()
