"""The fast path per architecture (issue 32 item 4): for each tiny architecture (HyperSloth.train.tiny_architectures),
`hypersloth-train` at defaults on the GPU (Unsloth backend, lora_args.target_modules unset), once with CUDA graphs
(the default) and once eager (training.cuda_graphs=False), 6 steps each; what the logs say about HyperSloth's LoRA
passes and the graphs, what the packed-row check measured (train/packing/check.py), and how far the graphed losses
are from eager's. One JSON record per architecture.

    python scripts/arch_check.py --out $OUT/arch [--architectures qwen3,phi3,...] [--parallel 4] [--modes graphs,eager] [--batching sorted-pad] [--load-in-4bit] [--launch-blocking]

Runs where Unsloth and a GPU are; the tiny models are built here on the CPU (random weights, bf16 at load).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from HyperSloth.train.tiny_architectures import ARCHITECTURES  # noqa: E402

SHAPE = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512)
TRACEBACK_LINES = 40  # of a failed run's rank 0 log, into its record
LINES = ("LoRA projections:", "LoRA targets", "packed rows", "eager decoder", "CUDA graphs for", "budget:", "Unsloth")


def config_text(work: Path, arch: str, graphs: bool, out: Path, batching: str | None = None,
                four_bit: bool = False) -> str:
    batching_arg = f", batching={batching!r}" if batching else ""
    four_bit_arg = ", load_in_4bit=True" if four_bit else ""
    return f'''
from HyperSloth.config import *
hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="chat", data_dir="{work}/data"),
    training=TrainingConfig(gpus=[0], loss_type="all", cuda_graphs={graphs}, tokens_per_micro_batch=16384{batching_arg}),
    fast_model_args=FastModelArgs(model_name="{work}/models/{arch}", max_seq_length=2048, backend="unsloth"{four_bit_arg}),
    lora_args=LoraArgs(r=16, lora_alpha=16),
)
training_config_model = TrainingArgsConfig(
    output_dir="{out}", per_device_train_batch_size=32, gradient_accumulation_steps=1, learning_rate=2e-4,
    max_steps=6, logging_steps=1, save_steps=100000, report_to="none", seed=3407, num_train_epochs=None,
    extra_args={{"save_strategy": "no"}},
)
'''


def prepare(work: Path, archs: list[str]) -> None:
    from HyperSloth.data.build import build_dataset
    from HyperSloth.train.tiny_model import build_tiny_model

    for arch in archs:
        build_tiny_model(work / "models" / arch, architecture=arch, **SHAPE)
    if not (work / "data" / "data_config.json").exists():
        build_dataset(str(ROOT / "data" / "sample_chat.jsonl"), name="chat", tokenizer=str(work / "models" / archs[0]),
                      data_dir=str(work / "data"), max_seq_length=2048, num_proc=1)


def run_one(work: Path, out_dir: Path, arch: str, graphs: bool, launch_blocking: bool = False,
            batching: str | None = None, four_bit: bool = False) -> dict:
    name = f"{arch}{'-4bit' if four_bit else ''}-{'graphs' if graphs else 'eager'}"
    out = work / "runs" / name
    cfg = work / "configs" / f"{name}.py"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(config_text(work, arch, graphs, out, batching, four_bit))
    started = time.time()
    env = {**os.environ, **({"CUDA_LAUNCH_BLOCKING": "1"} if launch_blocking else {})}
    done = subprocess.run([sys.executable, "-m", "HyperSloth.cli.train", str(cfg), "--overwrite"],
                          capture_output=True, text=True, timeout=420, env=env)
    (out_dir / f"{name}.log").write_text(done.stdout[-20000:] + "\n--- stderr\n" + done.stderr[-20000:])
    record = {"run": name, "exit": done.returncode, "seconds": round(time.time() - started, 1)}
    log = out / "logs" / "rank0.log"
    if log.is_file():
        record["lines"] = [re.sub(r"^.*? \| ", "", ln)[:300] for ln in log.read_text().splitlines()
                           if any(key in ln for key in LINES)][:14]
        if done.returncode != 0:  # the traceback lives only in the rank's log (the launcher shows one line)
            record["traceback"] = [ln[:300] for ln in log.read_text().splitlines()[-TRACEBACK_LINES:]]
            shutil.copy(log, out_dir / f"{name}.rank0.log")
    summary = out / "train_summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        record.update(losses=s.get("step_losses"), cuda_graphs=s.get("cuda_graphs"), step_seconds=s.get("step_seconds"),
                      lora_targets=s.get("lora_targets"), packing=s.get("packing"))
    # each run's record as soon as it ends: a call that runs out of time keeps the runs that finished
    (out_dir / f"{name}.json").write_text(json.dumps(record, indent=1))
    return record


def compare(graphed: dict, eager: dict) -> dict:
    a, b = graphed.get("losses"), eager.get("losses")
    if not a or not b or len(a) != len(b):
        return {"max_rel_loss_diff": None}
    return {"max_rel_loss_diff": max(abs(x - y) / abs(y) for x, y in zip(a, b))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/hs_arch")
    p.add_argument("--architectures", default=",".join(ARCHITECTURES))
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--launch-blocking", action="store_true",
                   help="CUDA_LAUNCH_BLOCKING=1: a CUDA error's traceback names the kernel that raised it (slower)")
    p.add_argument("--modes", default="graphs,eager", help="which runs per architecture: graphs, eager or both")
    p.add_argument("--batching", choices=["packed", "sorted-pad"], default=None,
                   help="training.batching for every run (default: unset, packed if the packed-row check passes); "
                        "sorted-pad skips the check")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="QLoRA: fast_model_args.load_in_4bit=True (bitsandbytes NF4; MoE experts as Unsloth loads them)")
    a = p.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - {"graphs", "eager"}:
        p.error(f"--modes takes graphs and/or eager, not {a.modes!r}")
    archs = [x for x in a.architectures.split(",") if x]
    work, out_dir = Path(a.work), Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    prepare(work, archs)
    jobs = [(arch, graphs) for arch in archs for graphs in (True, False) if ("graphs" if graphs else "eager") in modes]
    with ThreadPoolExecutor(a.parallel) as pool:
        results = dict(zip(jobs, pool.map(lambda job: run_one(work, out_dir, *job, a.launch_blocking, a.batching,
                                                                         a.load_in_4bit), jobs)))
    records = []
    for arch in archs:
        graphed, eager = results.get((arch, True), {}), results.get((arch, False), {})
        records.append({"architecture": arch, "graphed": graphed, "eager": eager, **compare(graphed, eager)})
        print(json.dumps(records[-1])[:1500], flush=True)
    (out_dir / "arch_check.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
