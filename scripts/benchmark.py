"""Benchmark HyperSloth against stock Unsloth (1 GPU) and stock TRL + PEFT DDP (2 GPUs).

One command runs the same workload through every system, each in its own process (clean GPU memory):

    python scripts/benchmark.py --models 0.6b,8b --out docs/benchmarks

Workload (the speed issue's): random-weight Qwen3-shaped checkpoints built here (no hub), synthetic
samples with token lengths clip(exp(N(6.2, 0.8)), 32, 4096), loss on all tokens, global batch 32,
LoRA r=16 alpha=16 on all seven projections, constant LR 2e-4, AdamW (torch), bf16. Every system
sees the same global batches: the stock trainers read the data sequentially in the order of
HyperSloth's plan, so per-step losses are comparable.

MFU: FLOP per step = sum over samples of (4 * N * L + 6 * n_layers * d_attn * L^2), N = parameters
touched per token (all linear layers incl. lm_head; LoRA training needs the forward, 2N, and the
input-gradient backward, 2N, but no base-weight gradients), the second term causal attention
(QK^T and AV, forward + 2x backward, half of the L x L scores). Peak: 989 TFLOP/s (H200 dense bf16).
Gradient-checkpoint recomputation is not counted (it is overhead, not useful work).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # hidden, layers, heads, kv heads, intermediate, tied embeddings (Qwen3 public configs)
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=3072, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=6144, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=12288, tie_word_embeddings=False),
}
FOUR_BIT = {"0.6b": False, "1.7b": False, "8b": True}  # default precision per shape; "0.6b:4bit" overrides
VOCAB, HEAD_DIM, PEAK_FLOPS = 151936, 128, 989e12
LR, SEED = 2e-4, 3407
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ------------------------------------------------------------------ workload


def shape_of(model: str) -> str:
    return model.split(":")[0]


def four_bit(model: str) -> bool:
    """"8b" is 4-bit QLoRA by default, the others bf16 LoRA; a ":4bit" / ":bf16" suffix overrides."""
    suffix = model.split(":")[1] if ":" in model else None
    return FOUR_BIT[shape_of(model)] if suffix is None else suffix == "4bit"


def build_checkpoint(model: str, folder: Path) -> None:
    """Random-weight Qwen3 of the given shape (bf16, built on the GPU) and a locally trained tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from HyperSloth.tiny_model import build_tiny_tokenizer

    if (folder / "config.json").exists():
        return
    config = Qwen3Config(vocab_size=VOCAB, head_dim=HEAD_DIM, max_position_embeddings=40960, rope_theta=1e6,
                         rms_norm_eps=1e-6, **SHAPES[shape_of(model)])
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = Qwen3ForCausalLM(config).to(torch.bfloat16)
    net.save_pretrained(folder)
    texts = [f"sample {i} text for the tokenizer" for i in range(200)]
    build_tiny_tokenizer(texts, vocab_size=512).save_pretrained(folder)


def build_data(work: Path, steps: int, global_batch: int) -> dict:
    """Synthetic samples, registered for HyperSloth and ordered by its plan for the stock trainers."""
    from datasets import Dataset

    from HyperSloth.batching import PlanSpec, adaptive_partition_batches

    rng = np.random.default_rng(SEED)
    n = global_batch * steps
    lengths = np.clip(np.exp(rng.normal(6.2, 0.8, n)), 32, 4096).astype(np.int64)
    ids = [rng.integers(100, VOCAB - 100, size=int(L)).tolist() for L in lengths]
    ds = Dataset.from_dict({"input_ids": ids, "labels": ids, "length": lengths.tolist(),
                            "num_trainable": (lengths - 1).tolist(), "text": [""] * n})
    ds.save_to_disk(str(work / "data" / "built_dataset" / "bench"))
    (work / "data" / "data_config.json").write_text(json.dumps(
        {"version": 1, "datasets": {"bench": {"name": "bench", "path": "built_dataset/bench"}}}))
    # HyperSloth's step sets do not depend on the rank count: order the stock data step by step.
    spec = PlanSpec(num_ranks=1, samples_per_step=global_batch, mode="packed", token_budget=1 << 20, seed=SEED)
    plan = adaptive_partition_batches(lengths, lengths - 1, spec, epoch=0)
    order = [i for step in plan.steps for mb in step.ranks[0] for i in sorted(mb)]
    Dataset.from_dict({"input_ids": [ids[i] for i in order]}).save_to_disk(str(work / "stock_data"))
    step_tokens = [int(sum(lengths[i] for mb in s.ranks[0] for i in mb)) for s in plan.steps]
    return {"order": order, "lengths": lengths.tolist(), "step_tokens": step_tokens}


def flops_per_step(model: str, step_lengths: list[int]) -> float:
    s = SHAPES[shape_of(model)]
    d, layers, ff = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"]
    attn = s["num_attention_heads"] * HEAD_DIM
    kv = s["num_key_value_heads"] * HEAD_DIM
    per_layer = d * (attn + 2 * kv) + attn * d + 3 * d * ff
    n = layers * per_layer + d * VOCAB
    return float(sum(4 * n * L + 6 * layers * attn * L * L for L in step_lengths))


# ------------------------------------------------------------------ systems (each runs in its own process)


def _clock():
    """HyperSloth's own step clock (a synchronised stamp at every optimizer step end), for the stock runs."""
    from HyperSloth.profiling import PhaseTimer, StepClock

    return StepClock(PhaseTimer(enabled=False))


def _stock_args(out: Path, micro: int, accum: int, steps: int, **extra):
    from trl import SFTConfig

    return SFTConfig(output_dir=str(out), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                     max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                     optim="adamw_torch", logging_steps=1, report_to="none", save_strategy="no", bf16=True,
                     max_length=4096, train_sampling_strategy="sequential", seed=SEED, **extra)


def run_stock_unsloth(a) -> dict:
    import unsloth  # noqa: F401  (first, it patches transformers/trl)
    import torch
    from datasets import load_from_disk
    from trl import SFTTrainer
    from unsloth import FastLanguageModel

    model, tok = FastLanguageModel.from_pretrained(a.checkpoint, max_seq_length=4096, dtype=torch.bfloat16,
                                                   load_in_4bit=four_bit(a.model))
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0, bias="none",
                                             target_modules=PROJECTIONS, random_state=SEED,
                                             use_gradient_checkpointing=a.gc)
    clock = _clock()
    trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=load_from_disk(a.work + "/stock_data"),
                         args=_stock_args(Path(a.work) / "out_unsloth", a.micro, a.accum, a.steps),
                         callbacks=[clock])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    steps = clock.step_seconds()
    return {"s_per_step_all": steps, "losses": losses, "peak_gb": [torch.cuda.max_memory_allocated() / 2**30]}


def run_stock_trl_ddp(a) -> dict | None:
    import torch
    from datasets import load_from_disk
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import SFTTrainer

    local = int(os.environ["LOCAL_RANK"])
    kwargs = {"dtype": torch.bfloat16, "device_map": {"": local}, "attn_implementation": "sdpa"}
    if four_bit(a.model):
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(a.checkpoint, **kwargs)
    peft = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=PROJECTIONS, task_type="CAUSAL_LM")
    clock = _clock()
    args = _stock_args(Path(a.work) / "out_trl", a.micro, a.accum, a.steps, gradient_checkpointing=True,
                       ddp_find_unused_parameters=False)
    trainer = SFTTrainer(model=model, processing_class=AutoTokenizer.from_pretrained(a.checkpoint),
                         train_dataset=load_from_disk(a.work + "/stock_data"), args=args, peft_config=peft,
                         callbacks=[clock])
    trainer.train()
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    gathered = [torch.zeros_like(peak) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, peak)
    if torch.distributed.get_rank() != 0:
        return None
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    steps = clock.step_seconds()
    return {"s_per_step_all": steps, "losses": losses, "peak_gb": [float(g) for g in gathered]}


def hypersloth_config(a, gpus: list[int], out: Path) -> Path:
    per_device = a.global_batch // len(gpus)
    text = f'''
from HyperSloth.config import *
hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="bench", data_dir="{a.work}/data"),
    training=TrainingConfig(gpus={gpus}, loss_type="all", batching="packed",
                            tokens_per_micro_batch={a.token_budget}, profile={a.profile}),
    fast_model_args=FastModelArgs(model_name="{a.checkpoint}", max_seq_length=4096, dtype="bfloat16",
                                  load_in_4bit={four_bit(a.model)}, backend="unsloth",
                                  use_gradient_checkpointing={a.gc!r}),
    lora_args=LoraArgs(r=16, lora_alpha=16, lora_dropout=0.0, random_state={SEED}),
)
training_config_model = TrainingArgsConfig(
    output_dir="{out}", per_device_train_batch_size={per_device}, gradient_accumulation_steps=1,
    learning_rate={LR}, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", max_steps={a.steps},
    logging_steps=1, save_steps=100000, report_to="none", seed={SEED}, num_train_epochs=None,
    dataloader_num_workers={a.loader_workers}, extra_args={{"save_strategy": "no"}},
)
'''
    path = out.with_suffix(".py")
    path.write_text(text)
    return path


def run_hypersloth(a) -> dict:
    gpus = list(range(a.gpus))
    out = Path(a.work) / f"out_hs{a.gpus}"
    cfg = hypersloth_config(a, gpus, out)
    subprocess.run([sys.executable, "-m", "HyperSloth.cli.train", str(cfg)], check=True)
    summary = json.loads((out / "train_summary.json").read_text())
    peaks = [json.loads((out / "logs" / f"rank{r}.final.json").read_text())["peak_gpu_gb"] for r in gpus]
    return {"s_per_step_all": summary["step_seconds"], "losses": summary["step_losses"], "peak_gb": peaks,
            "phases": summary.get("phase_seconds_per_step"), "padding_pct": summary["padding_pct"]}


SYSTEMS = {
    "unsloth-8x4": dict(runner="unsloth", gpus=1, micro=8, accum=4, gc="unsloth"),
    "unsloth-32x1": dict(runner="unsloth", gpus=1, micro=32, accum=1, gc="unsloth"),
    "unsloth-32x1-nogc": dict(runner="unsloth", gpus=1, micro=32, accum=1, gc=False),
    "trl-ddp-4x4": dict(runner="trl", gpus=2, micro=4, accum=4, gc=True),
    "hypersloth-1": dict(runner="hypersloth", gpus=1, micro=32, accum=1, gc=False),
    "hypersloth-2": dict(runner="hypersloth", gpus=2, micro=16, accum=1, gc=False),
    "hypersloth-2-gc": dict(runner="hypersloth", gpus=2, micro=16, accum=1, gc="unsloth"),
    "hypersloth-2-profile": dict(runner="hypersloth", gpus=2, micro=16, accum=1, gc=False, profile=True),
}


# ------------------------------------------------------------------ orchestration


def _padding_pct(system: dict, data: dict) -> float:
    """Padding of the stock runs: padding-free Unsloth has none; padded TRL pads each micro-batch to its max."""
    if system["runner"] == "unsloth":
        return 0.0
    lengths = [data["lengths"][i] for i in data["order"]]
    micro = system["micro"]
    real = computed = 0
    for k in range(0, len(lengths), micro):
        chunk = lengths[k:k + micro]
        real += sum(chunk)
        computed += max(chunk) * len(chunk)
    return 100.0 * (1 - real / computed)


def system_for(name: str, global_batch: int) -> dict:
    """A named system, or `hypersloth-N` for any N GPUs (micro-batch = global batch / N, one step each)."""
    if name in SYSTEMS:
        return SYSTEMS[name]
    gpus = int(name.removeprefix("hypersloth-"))
    return dict(runner="hypersloth", gpus=gpus, micro=global_batch // gpus, accum=1, gc=False)


def run_system(name: str, model: str, a, data: dict) -> dict:
    system = system_for(name, a.global_batch)
    argv = [sys.executable, __file__, "--as-system", system["runner"], "--model", model, "--work", a.work,
            "--checkpoint", f"{a.work}/ckpt_{shape_of(model)}", "--steps", str(a.warmup + a.steps), "--micro",
            str(system["micro"]), "--accum", str(system["accum"]), "--gc", str(system["gc"]),
            "--gpus", str(system["gpus"]), "--token-budget", str(a.token_budget), "--profile", str(system.get("profile", a.profile)),
            "--loader-workers", str(a.loader_workers), "--result", f"{a.work}/result.json",
            "--global-batch", str(a.global_batch)]
    if system["runner"] == "trl":
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *argv[1:]]
    started = time.time()
    proc = subprocess.run(argv, timeout=a.timeout, capture_output=True, text=True)
    log = Path(a.work) / "logs" / f"{model.replace(':', '-')}-{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(f"[{model} {name}] FAILED rc={proc.returncode}; tail:\n" + (proc.stdout + proc.stderr)[-3000:])
        return {"system": name, "model": model, "error": f"exit {proc.returncode}"}
    raw = json.loads(Path(a.work, "result.json").read_text())
    timed = raw["s_per_step_all"][a.warmup:]
    tokens = sum(data["step_tokens"][a.warmup:a.warmup + len(timed)])
    seconds = sum(timed)
    batch = a.global_batch
    flops = sum(flops_per_step(model, [data["lengths"][i] for i in data["order"][k * batch:(k + 1) * batch]])
                for k in range(a.warmup, a.warmup + len(timed)))
    record = {
        "system": name, "model": shape_of(model) + (" 4-bit" if four_bit(model) else " bf16"), "gpus": system["gpus"],
        "micro_batch": system["micro"], "grad_accum": system["accum"], "gradient_checkpointing": system["gc"],
        "s_per_step": seconds / len(timed), "tokens_per_s": tokens / seconds,
        "tokens_per_s_per_gpu": tokens / seconds / system["gpus"],
        "mfu_pct": 100 * flops / seconds / (PEAK_FLOPS * system["gpus"]),
        "peak_gb": max(raw["peak_gb"]), "peak_gb_per_rank": raw["peak_gb"],
        "padding_pct": raw.get("padding_pct", _padding_pct(system, data)),
        "losses": raw["losses"], "timed_steps": len(timed), "wall_s": time.time() - started,
        "token_budget": a.token_budget if system["runner"] == "hypersloth" else None,
        "phases": raw.get("phases"),
    }
    print(f"[{model} {name}] {record['s_per_step']:.3f} s/step, {record['tokens_per_s']:.0f} tok/s, "
          f"peak {record['peak_gb']:.1f} GB, losses {[round(x, 4) for x in record['losses']]}", flush=True)
    return record


def render(records_path: Path, out_dir: Path) -> None:
    """Markdown table (printed) and a bar chart PNG of s/step per system and model from a records file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in json.loads(records_path.read_text()) if "error" not in r]
    print("| system | model | GPUs | micro x accum | grad ckpt | s/step | tokens/s | tokens/s/GPU | MFU % "
          "| peak GB/GPU | padding % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['system']} | {r['model']} | {r['gpus']} | {r['micro_batch']} x {r['grad_accum']} | "
              f"{r['gradient_checkpointing']} | {r['s_per_step']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{r['tokens_per_s_per_gpu']:,.0f} | {r['mfu_pct']:.1f} | {r['peak_gb']:.1f} | {r['padding_pct']:.1f} |")
    models = sorted({r["model"] for r in records})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4))
    for ax, model in zip(np.atleast_1d(axes), models):
        rows = [r for r in records if r["model"] == model]
        ax.barh([r["system"] for r in rows], [r["s_per_step"] for r in rows],
                color=["tab:green" if r["system"].startswith("hypersloth") else "tab:gray" for r in rows])
        ax.set_title(f"Qwen3-{model}, global batch 32")
        ax.set_xlabel("s / step (lower is better)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out_dir / "benchmarks.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="0.6b,8b")
    p.add_argument("--systems", default="unsloth-8x4,unsloth-32x1,trl-ddp-4x4,hypersloth-1,hypersloth-2")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=32,
                   help="samples per optimizer step (the stock systems' micro x accum assume 32)")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps after warm-up")
    p.add_argument("--token-budget", type=int, default=16384, help="HyperSloth packed micro-batch tokens")
    p.add_argument("--loader-workers", type=int, default=1, help="HyperSloth collation processes per rank")
    p.add_argument("--profile", type=lambda s: s == "True", default=False)
    p.add_argument("--work", default="/tmp/hs_bench")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    p.add_argument("--timeout", type=int, default=400)
    p.add_argument("--render", help="print the markdown table and write benchmarks.png for a records JSON file")
    # internal: run one system in this process
    p.add_argument("--as-system"), p.add_argument("--model"), p.add_argument("--checkpoint"), p.add_argument("--result")
    p.add_argument("--micro", type=int), p.add_argument("--accum", type=int), p.add_argument("--gpus", type=int)
    p.add_argument("--gc", type=lambda s: {"True": True, "False": False}.get(s, s), default=False)
    a = p.parse_args()
    if a.render:
        render(Path(a.render), Path(a.out))
        return
    if a.as_system:
        result = {"unsloth": run_stock_unsloth, "trl": run_stock_trl_ddp, "hypersloth": run_hypersloth}[a.as_system](a)
        if result is not None:
            Path(a.result).write_text(json.dumps(result))
        return
    Path(a.work).mkdir(parents=True, exist_ok=True)
    data = build_data(Path(a.work), a.warmup + a.steps, a.global_batch)
    records = []
    for model in a.models.split(","):
        build_checkpoint(model, Path(a.work) / f"ckpt_{shape_of(model)}")
        for name in a.systems.split(","):
            records.append(run_system(name, model, a, data))
            Path(a.out).mkdir(parents=True, exist_ok=True)
            Path(a.out, f"records-{model.replace(':', '-')}.json").write_text(json.dumps(
                [r for r in records if r["model"].startswith(shape_of(model))], indent=2))
    print("BENCHMARK " + json.dumps([{k: r.get(k) for k in ("system", "model", "s_per_step", "tokens_per_s",
                                                                "peak_gb", "padding_pct", "mfu_pct")}
                                     for r in records]))


if __name__ == "__main__":
    main()
