"""Benchmark HyperSloth against Unsloth at its best (1 GPU), Unsloth's own DDP path (2 GPUs), and TRL's
DPOTrainer with Unsloth (DPO, 1 GPU).

One command runs named workloads through named systems, each system in its own process(es):

    python scripts/benchmark.py --workloads short-0.6b,long-0.6b,short-8b \
        --slots "unsloth-best+hypersloth-1,unsloth-ddp,hypersloth-2" --out docs/benchmarks

A slot is one or more systems joined by "+": 1-GPU systems of one slot run at the same time, one per GPU
(each alone on its GPU; this halves the device time of the 1-GPU rows). Slots run one after another.

Systems (every one sees the same global batches, in the same order, so per-step losses agree):
- `unsloth-best`: stock FastLanguageModel + TRL SFTTrainer on 1 GPU, 32 x 1 (its best split of the global
  batch, measured 2026-11-30: 32 x 1 beat 16 x 2 and 8 x 4), gradient checkpointing off, with
  `HyperSloth.train.patches.enable_unsloth_torch_varlen()` applied in its process (torch >= 2.12 gives Unsloth
  this varlen path natively). `unsloth-best-gc`: the same with Unsloth's gradient checkpointing.
  `unsloth-best-16x2`: 16 x 2 without checkpointing, for models where 32 x 1 does not fit (8B).
- `unsloth-stock`: Unsloth's defaults (8 x 4, its checkpointing, no varlen shim): a secondary row.
- `unsloth-ddp`: Unsloth's own multi-GPU path: torchrun, one process per GPU, each
  `FastLanguageModel.from_pretrained(device_map={"": local_rank})` + stock SFTTrainer (DDP), 16 x 1 per
  GPU (the whole per-GPU share in one micro-batch), the same shim, checkpointing off.
- `reference` (long-context workloads only): the exact step-1 loss and the attention floor, against which
  every system's step 1 is judged (scripts/bench_longctx.py).
- `hypersloth-N`: HyperSloth on N GPUs at product defaults (tokens_per_micro_batch="auto", no
  checkpointing); `hypersloth-2-gc`: with Unsloth's checkpointing; `hypersloth-1-eager`: HyperSloth-1 with
  `cuda_graphs=False` (what the graphs are worth); `hypersloth-2-profile`: the per-phase
  timer on (synchronises between phases: for the breakdown, not the headline).

Workloads: random-weight Qwen3-shaped checkpoints (built here, in a child process, so this process never
holds GPU memory); synthetic samples with lognormal token lengths, loss on all tokens, global batch 32,
LoRA r=16 alpha=16 on all seven projections, constant LR 2e-4, fused AdamW (`adamw_torch_fused`:
HyperSloth's default and transformers', given to the stock rows too), bf16.

Long-context workloads (`longctx-0.6b`, `longctx-8b`): step 1 holds one chat of `--long-tokens` tokens among
31 short ones; every system gets max_seq_length = that length, and its record says whether it trained the
chat whole (`longest_sample_tokens`, `ref_loss_diff`, `attention_floor_s`, `trained_whole`, `truncated`),
besides `startup_s` (launch to the end of step 1) and `probe_s` (HyperSloth's budget probe). E.g.

    python scripts/benchmark.py --workloads longctx-0.6b --long-tokens 131072 --warmup 0 --steps 1 \
        --slots reference,hypersloth-1,unsloth-best-gc,unsloth-best --num-gpus 1

Preference-pair workload (`dpo-0.6b`, DPO; scripts/bench_dpo.py): Qwen3-0.6B shapes, synthetic pairs with
lognormal prompt (median ~245) and completion (median ~150, chosen and rejected each) lengths, global batch
32 pairs, beta 0.1. `hypersloth-N` trains it with training.method="dpo" at product defaults; the stock rows
are `trl-dpo-PxA`: FastLanguageModel + get_peft_model + TRL's DPOTrainer, P pairs per device x A
accumulation steps (32x1, 16x2, 8x4, 4x8: run them all, the fastest that fits is TRL's best), checkpointing
off, fused AdamW. Tokens/s counts each pair's packed tokens (2 x prompt + chosen + rejected), for every
system; `rewards_margins` is logged per step beside the losses. E.g. on one GPU:

    python scripts/benchmark.py --workloads dpo-0.6b --num-gpus 1 \
        --slots hypersloth-1,trl-dpo-32x1,trl-dpo-16x2,trl-dpo-8x4 --tag dpo

Per system: every optimizer step's wall time (a CUDA synchronise at each step end); the first step is the
cold one (compilation); the first `--warmup` steps are left out of mean, median and p90.

MFU: FLOP per step = sum over samples of (4 * N * L + 6 * n_layers * d_attn * L^2), N = parameters
touched per token (all linear layers incl. lm_head; LoRA training needs the forward, 2N, and the
input-gradient backward, 2N, but no base-weight gradients), the second term causal attention
(QK^T and AV, forward + 2x backward, half of the L x L scores). Peak: 989 TFLOP/s (H200 dense bf16) per
GPU. Gradient-checkpoint recomputation is not counted (it is overhead, not useful work). DPO: sum over the
pairs' sequences (prompt + chosen, prompt + rejected) of (6 * N * L + 8 * n_layers * d_attn * L^2): the
policy's pass as above plus the reference model's forward (2N, and the forward attention term).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

import bench_dpo  # scripts/ is on sys.path when this file runs
import bench_longctx

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # hidden, layers, heads, kv heads, intermediate, tied embeddings (Qwen3 public configs)
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=3072, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=6144, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=12288, tie_word_embeddings=False),
}
FOUR_BIT = {"0.6b": False, "1.7b": False, "8b": True}
VOCAB, HEAD_DIM, PEAK_FLOPS = 151936, 128, 989e12
LR, SEED, GLOBAL_BATCH = 2e-4, 3407, 32
MAX_POSITIONS = 131072  # room for the longest-sample measurement; compute does not depend on it
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Workload:
    model: str  # a SHAPES key
    mu: float  # token lengths: clip(exp(N(mu, sigma)), low, high)
    sigma: float
    low: int
    high: int
    long_sample: int = 0  # > 0: the first sample of step 1 is this long (the long-context workloads)
    pairs: bool = False  # preference pairs for DPO (scripts/bench_dpo.py); mu..high are the completions'

    @property
    def max_len(self) -> int:
        """The longest sample: every system is given it as max_seq_length (no system should cut it)."""
        if self.pairs:  # a prompt + one completion
            return bench_dpo.PROMPT.high + bench_dpo.COMPLETION.high
        return max(self.high, self.long_sample)

    @property
    def four_bit(self) -> bool:
        return FOUR_BIT[self.model]

    @property
    def model_label(self) -> str:
        return f"Qwen3-{self.model} " + ("4-bit" if self.four_bit else "bf16")


LONG_TOKENS = 131072  # the long-context workloads' long sample; --long-tokens overrides (32k, 131k, 262k)
SHORT, LONG = (6.2, 0.8, 32, 4096), (7.0, 0.6, 128, 8192)  # mean ~675 and ~1,310 tokens
WORKLOADS = {
    "short-0.6b": Workload("0.6b", *SHORT),
    "short-8b": Workload("8b", *SHORT),
    "long-0.6b": Workload("0.6b", *LONG),
    "long-8b": Workload("8b", *LONG),
    # One very long chat among 31 short ones in step 1 (its length: --long-tokens).
    "longctx-0.6b": Workload("0.6b", *SHORT, long_sample=LONG_TOKENS),
    "longctx-8b": Workload("8b", *SHORT, long_sample=LONG_TOKENS),
    # Preference pairs, global batch 32 pairs: HyperSloth's DPO against TRL's DPOTrainer (scripts/bench_dpo.py).
    "dpo-0.6b": Workload("0.6b", *vars(bench_dpo.COMPLETION).values(), pairs=True),
}

SYSTEMS = {
    "unsloth-best": dict(runner="unsloth", gpus=1, micro=32, accum=1, gc=False, shim=True),
    "unsloth-best-gc": dict(runner="unsloth", gpus=1, micro=32, accum=1, gc="unsloth", shim=True),
    "unsloth-best-16x2": dict(runner="unsloth", gpus=1, micro=16, accum=2, gc=False, shim=True),
    "unsloth-stock": dict(runner="unsloth", gpus=1, micro=8, accum=4, gc="unsloth", shim=False),
    "unsloth-ddp": dict(runner="unsloth", gpus=2, micro=16, accum=1, gc=False, shim=True),
    "hypersloth-1": dict(runner="hypersloth", gpus=1, gc=False),
    "hypersloth-1-eager": dict(runner="hypersloth", gpus=1, gc=False, graphs=False),
    "hypersloth-2": dict(runner="hypersloth", gpus=2, gc=False),
    "hypersloth-2-gc": dict(runner="hypersloth", gpus=2, gc="unsloth"),
    "hypersloth-2-profile": dict(runner="hypersloth", gpus=2, gc=False, profile=True),
    # Long-context workloads: the exact step-1 loss (every sample alone, unpacked), the attention floor, and
    # with --exactness the packed-vs-alone gradient check of the long sample (scripts/bench_longctx.py).
    "reference": dict(runner="reference", gpus=1, gc=False),
    # DPO workloads: stock Unsloth + TRL's DPOTrainer, pairs per device x accumulation (scripts/bench_dpo.py);
    # hypersloth-N runs the same workloads with training.method="dpo".
    **{name: dict(runner="trl-dpo", gpus=1, micro=micro, accum=accum, gc=False)
       for name, (micro, accum) in bench_dpo.TRL_SPLITS.items()},
}


# ------------------------------------------------------------------ workload


def workload_of(name: str, long_tokens: int | None = None) -> Workload:
    """The named workload; a long-context one with its long sample set to `long_tokens` when given."""
    w = WORKLOADS[name]
    return replace(w, long_sample=long_tokens) if w.long_sample and long_tokens else w


def sample_lengths(w: Workload, n: int) -> np.ndarray:
    rng = np.random.default_rng(SEED)
    return np.clip(np.exp(rng.normal(w.mu, w.sigma, n)), w.low, w.high).astype(np.int64)


def build_checkpoint(model: str, folder: Path) -> None:
    """Random-weight Qwen3 of the given shape (bf16, built on the GPU) and a locally trained tokenizer.
    Runs in a child process (`--as-system build`), so the benchmark's parent never holds GPU memory."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from HyperSloth.train.tiny_model import build_tiny_tokenizer

    if (folder / "config.json").exists():
        return
    config = Qwen3Config(vocab_size=VOCAB, head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITIONS,
                         rope_theta=1e6, rms_norm_eps=1e-6, **SHAPES[model])
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = Qwen3ForCausalLM(config).to(torch.bfloat16)
    net.save_pretrained(folder)
    texts = [f"sample {i} text for the tokenizer" for i in range(200)]
    build_tiny_tokenizer(texts, vocab_size=512).save_pretrained(folder)


def build_data(work: Path, w: Workload, steps: int) -> dict:
    """Synthetic samples, registered for HyperSloth and ordered by its plan for the stock trainers."""
    if w.pairs:
        return bench_dpo.build_pair_data(work, steps, GLOBAL_BATCH, VOCAB, SEED)
    from datasets import Dataset

    from HyperSloth.plan.batching import PlanSpec, adaptive_partition_batches

    n = GLOBAL_BATCH * steps
    lengths = bench_longctx.with_long_sample(sample_lengths(w, n), w.long_sample, GLOBAL_BATCH, SEED)
    rng = np.random.default_rng(SEED + 1)
    ids = [rng.integers(100, VOCAB - 100, size=int(L)).tolist() for L in lengths]
    ds = Dataset.from_dict({"input_ids": ids, "labels": ids, "length": lengths.tolist(),
                            "num_trainable": (lengths - 1).tolist(), "text": [""] * n})
    ds.save_to_disk(str(work / "data" / "built_dataset" / "bench"))
    (work / "data" / "data_config.json").write_text(json.dumps(
        {"version": 1, "datasets": {"bench": {"name": "bench", "path": "built_dataset/bench"}}}))
    # HyperSloth's step sets do not depend on the rank count: order the stock data step by step.
    spec = PlanSpec(num_ranks=1, samples_per_step=GLOBAL_BATCH, mode="packed", token_budget=1 << 22, seed=SEED)
    plan = adaptive_partition_batches(lengths, lengths - 1, spec, epoch=0)
    order = [i for step in plan.steps for mb in step.ranks[0] for i in sorted(mb)]
    Dataset.from_dict({"input_ids": [ids[i] for i in order]}).save_to_disk(str(work / "stock_data"))
    step_tokens = [int(sum(lengths[i] for mb in s.ranks[0] for i in mb)) for s in plan.steps]
    return {"order": order, "lengths": lengths.tolist(), "step_tokens": step_tokens}


def flops_per_step(model: str, step_lengths: list[int], dpo: bool = False) -> float:
    """Useful FLOPs of one step over its sequences (module docstring); `dpo` adds the reference model's
    forward to every sequence: 6 N L + 8 layers d_attn L^2."""
    s = SHAPES[model]
    d, layers, ff = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"]
    attn = s["num_attention_heads"] * HEAD_DIM
    kv = s["num_key_value_heads"] * HEAD_DIM
    per_layer = d * (attn + 2 * kv) + attn * d + 3 * d * ff
    n = layers * per_layer + d * VOCAB
    if dpo:
        return float(sum(6 * n * L + 8 * layers * attn * L * L for L in step_lengths))
    return float(sum(4 * n * L + 6 * layers * attn * L * L for L in step_lengths))


def step_stats(seconds: list[float], warmup: int) -> dict:
    """Mean, median, p90 of the timed steps (after `warmup`), and the cold first step."""
    timed = np.asarray(seconds[warmup:], dtype=np.float64)
    if timed.size == 0:
        raise ValueError(f"no timed steps: {len(seconds)} steps ran, {warmup} are warm-up")
    return {"s_per_step": float(timed.mean()), "s_median": float(np.median(timed)),
            "s_p90": float(np.percentile(timed, 90)), "first_step_s": float(seconds[0]),
            "timed_steps": int(timed.size)}


# ------------------------------------------------------------------ systems (each runs in its own process)


def _clock():
    """HyperSloth's own step clock (a synchronised stamp at every optimizer step end), for the stock runs."""
    from HyperSloth.train.profiling import PhaseTimer, StepClock

    return StepClock(PhaseTimer(enabled=False))


def run_stock_unsloth(a) -> dict | None:
    """Stock Unsloth + TRL SFTTrainer; under torchrun (WORLD_SIZE > 1) TRL's own DDP path."""
    import unsloth  # noqa: F401  (first, it patches transformers/trl)
    import torch
    from datasets import load_from_disk
    from trl import SFTConfig, SFTTrainer
    from unsloth import FastLanguageModel

    from HyperSloth.train.patches import enable_unsloth_torch_varlen

    shim = enable_unsloth_torch_varlen() if a.shim else False
    local = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    w = workload_of(a.workload, a.long_tokens)
    model, tok = FastLanguageModel.from_pretrained(a.checkpoint, max_seq_length=w.max_len, dtype=torch.bfloat16,
                                                   load_in_4bit=w.four_bit, device_map={"": local})
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0, bias="none",
                                             target_modules=PROJECTIONS, random_state=SEED,
                                             use_gradient_checkpointing=a.gc)
    clock = _clock()
    extra = {"ddp_find_unused_parameters": False} if world > 1 else {}
    args = SFTConfig(output_dir=str(Path(a.work) / f"out_{a.system}"), per_device_train_batch_size=a.micro,
                     gradient_accumulation_steps=a.accum, max_steps=a.steps, learning_rate=LR,
                     lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch_fused", logging_steps=1,
                     report_to="none", save_strategy="no", bf16=True, max_length=w.max_len,
                     train_sampling_strategy="sequential", seed=SEED, **extra)
    trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=load_from_disk(a.work + "/stock_data"),
                         args=args, callbacks=[clock])
    # What the stock trainer will feed: TRL cuts samples at max_length while preparing the dataset.
    longest = max(len(ids) for ids in trainer.train_dataset["input_ids"])
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30
    peaks = [peak]
    if world > 1:
        mine = torch.tensor([peak], device="cuda")
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        torch.distributed.all_gather(gathered, mine)
        peaks = [float(g) for g in gathered]
        if torch.distributed.get_rank() != 0:
            return None
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"step_seconds": clock.step_seconds(), "losses": losses, "peak_gb": peaks, "varlen_shim": shim,
            "first_step_end_unix": clock.first_step_end_unix, "longest_sample_tokens": longest}


def hypersloth_config(a, out: Path) -> Path:
    w = workload_of(a.workload, a.long_tokens)
    per_device = GLOBAL_BATCH // a.gpus
    text = f'''
from HyperSloth.config import *
hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="bench", data_dir="{a.work}/data"),
    training=TrainingConfig(gpus={list(range(a.gpus))}, {'method="dpo"' if w.pairs else 'loss_type="all"'},
                            batching="packed", profile={a.profile}, cuda_graphs={a.graphs},
                            tokens_per_micro_batch={a.token_budget!r}),
    fast_model_args=FastModelArgs(model_name="{a.checkpoint}", max_seq_length={w.max_len}, dtype="bfloat16",
                                  load_in_4bit={w.four_bit}, backend="unsloth",
                                  use_gradient_checkpointing={a.gc!r}),
    lora_args=LoraArgs(r=16, lora_alpha=16, lora_dropout=0.0, random_state={SEED}),
)
training_config_model = TrainingArgsConfig(
    output_dir="{out}", per_device_train_batch_size={per_device}, gradient_accumulation_steps=1,
    learning_rate={LR}, lr_scheduler_type="constant", warmup_steps=0, max_steps={a.steps},
    logging_steps=1, save_steps=100000, report_to="none", seed={SEED}, num_train_epochs=None,
    extra_args={{"save_strategy": "no"}},
)
'''
    path = out.with_suffix(".py")
    path.write_text(text)
    return path


def rank_phases(out: Path) -> dict[int, list[dict]]:
    """Per-rank per-step phase seconds, from the `PHASES` line every rank logs with profile=True."""
    phases = {}
    for log in sorted((out / "logs").glob("rank*.log")):
        match = re.search(r"rank(\d+)", log.name)
        for line in log.read_text().splitlines():
            if "PHASES " in line and match:
                phases[int(match.group(1))] = json.loads(line.split("PHASES ", 1)[1])
    return phases


def run_trl_dpo(a) -> dict:
    w = workload_of(a.workload, a.long_tokens)
    return bench_dpo.run_trl_dpo(a, max_len=w.max_len, lr=LR, seed=SEED, projections=PROJECTIONS, clock=_clock())


def run_reference(a) -> dict:
    w = workload_of(a.workload, a.long_tokens)
    return bench_longctx.run_reference(a, w, SHAPES[w.model], HEAD_DIM, SEED, PROJECTIONS)


def run_hypersloth(a) -> dict:
    out = Path(a.work) / f"out_{a.system}"
    cfg = hypersloth_config(a, out)
    subprocess.run([sys.executable, "-m", "HyperSloth.cli.train", str(cfg), "--overwrite"], check=True)
    summary = json.loads((out / "train_summary.json").read_text())
    peaks = [json.loads((out / "logs" / f"rank{r}.final.json").read_text())["peak_gpu_gb"] for r in range(a.gpus)]
    return {"step_seconds": summary["step_seconds"], "losses": summary["step_losses"], "peak_gb": peaks,
            "phases": summary.get("phase_seconds_per_step"), "rank_phases": rank_phases(out),
            "padding_pct": summary.get("padding_pct"), "token_budget": summary.get("token_budget"),
            "gradient_checkpointing": summary.get("gradient_checkpointing"),
            "first_step_end_unix": summary.get("first_step_end_unix"), "cuda_graphs": summary.get("cuda_graphs"),
            "rewards_margins": (summary.get("step_rewards") or {}).get("rewards/margins"),
            # HyperSloth never cuts a sample: one longer than max_seq_length is refused before training.
            "longest_sample_tokens": (summary.get("token_budget") or {}).get("longest_sample")}


# ------------------------------------------------------------------ orchestration


def child_env(gpu_ids: list[int]) -> dict[str, str]:
    """A child's environment: its GPUs, and NVLink multicast off (the lent machines require it)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, gpu_ids)), NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    return env


def system_argv(name: str, workload: str, a, work: Path, model: str) -> list[str]:
    system = SYSTEMS[name]
    argv = [sys.executable, __file__, "--as-system", system["runner"], "--system", name, "--workload", workload,
            "--work", str(work), "--checkpoint", str(Path(a.ckpt_dir or a.work) / f"ckpt_{model}"),
            "--token-budget", str(a.token_budget),
            "--steps", str(a.warmup + a.steps), "--micro", str(system.get("micro", 0)),
            "--accum", str(system.get("accum", 1)), "--gc", str(system["gc"]), "--gpus", str(system["gpus"]),
            "--shim", str(system.get("shim", False)), "--profile", str(system.get("profile", False)),
            "--graphs", str(system.get("graphs", True)),
            "--long-tokens", str(a.long_tokens), "--exactness", str(a.exactness),
            "--result", str(work / f"result_{name}.json")]
    if system["runner"] == "unsloth" and system["gpus"] > 1:
        port = 29600 + (os.getpid() % 200)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(system["gpus"]),
                "--master_port", str(port), *argv[1:]]
    return argv


def record_for(name: str, workload: str, raw: dict, data: dict, a, launched: float, wall_s: float) -> dict:
    system, w = SYSTEMS[name], workload_of(workload, a.long_tokens)
    stats = step_stats(raw["step_seconds"], a.warmup)
    timed = raw["step_seconds"][a.warmup:]
    steps = range(a.warmup, a.warmup + len(timed))
    tokens = sum(data["step_tokens"][k] for k in steps)
    batch = GLOBAL_BATCH
    sequences = [data["step_sequences"][k] if w.pairs else [data["lengths"][i] for i in data["order"][k * batch:(k + 1) * batch]]
                 for k in steps]
    flops = sum(flops_per_step(w.model, lengths, dpo=w.pairs) for lengths in sequences)
    seconds = sum(timed)
    budget = raw.get("token_budget")
    return {
        "workload": workload, "system": name, "model": w.model_label, "gpus": system["gpus"],
        "micro_batch": system.get("micro"), "grad_accum": system.get("accum"),
        "gradient_checkpointing": raw.get("gradient_checkpointing") or system["gc"],
        **stats,
        "tokens_per_s": tokens / seconds, "tokens_per_s_per_gpu": tokens / seconds / system["gpus"],
        "mean_tokens_per_step": tokens / len(timed),
        "mfu_pct": 100 * flops / seconds / (PEAK_FLOPS * system["gpus"]),
        "peak_gb": max(raw["peak_gb"]), "peak_gb_per_rank": raw["peak_gb"],
        "token_budget": budget, "losses": raw["losses"], "step_seconds": raw["step_seconds"],
        "phases": raw.get("phases"), "rank_phases": raw.get("rank_phases"),
        "varlen_shim": raw.get("varlen_shim"), "padding_pct": raw.get("padding_pct", 0.0), "wall_s": wall_s,
        "longest_sample_tokens": raw.get("longest_sample_tokens"),
        # launch (this parent starting the system's process) to the end of its first optimizer step
        "cuda_graphs": raw.get("cuda_graphs"),
        "startup_s": raw["first_step_end_unix"] - launched if raw.get("first_step_end_unix") else None,
        "probe_s": (budget or {}).get("probe_seconds") if isinstance(budget, dict) else None,
        "rewards_margins": raw.get("rewards_margins"),
    }


def run_slot(slot: list[str], workload: str, a, data: dict) -> list[dict]:
    """Start the slot's systems at once (each on GPUs of its own), wait, and collect their records."""
    model = WORKLOADS[workload].model
    work = Path(a.work) / workload
    next_gpu, procs = 0, []
    for name in slot:
        gpus = list(range(a.first_gpu + next_gpu, a.first_gpu + next_gpu + SYSTEMS[name]["gpus"]))
        next_gpu += len(gpus)
        log = (work / "logs" / f"{name}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        handle = log.open("w")
        proc = subprocess.Popen(system_argv(name, workload, a, work, model), stdout=handle, stderr=subprocess.STDOUT,
                                env=child_env(gpus), start_new_session=True)
        procs.append((name, proc, log, time.time()))
    records = []
    for name, proc, log, started in procs:
        try:
            rc = proc.wait(timeout=max(1.0, a.deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = "timeout"
        wall = time.time() - started
        result = work / f"result_{name}.json"
        if rc != 0 or not result.exists():
            tail = log.read_text()[-2500:]
            print(f"[{workload} {name}] FAILED ({rc}) after {wall:.0f}s; tail:\n{tail}", flush=True)
            records.append({"workload": workload, "system": name, "error": f"exit {rc}", "wall_s": wall})
            continue
        raw = json.loads(result.read_text())
        if SYSTEMS[name]["runner"] == "reference":
            records.append({"workload": workload, "system": name, "wall_s": wall, **raw})
            print(f"[{workload} {name}] {json.dumps(raw)}", flush=True)
            continue
        record = record_for(name, workload, raw, data, a, started, wall)
        print(f"[{workload} {name}] mean {record['s_per_step']:.3f} median {record['s_median']:.3f} "
              f"p90 {record['s_p90']:.3f} first {record['first_step_s']:.2f} s/step, {record['tokens_per_s']:,.0f} tok/s, "
              f"MFU {record['mfu_pct']:.1f}%, peak {record['peak_gb']:.1f} GB, budget {record['token_budget']}, "
              f"wall {wall:.0f}s, losses {[round(x, 4) for x in record['losses'][:6]]}", flush=True)
        records.append(record)
    return records


def build_checkpoints(models: list[str], a) -> None:
    """Build the missing checkpoints in child processes, one per GPU at a time."""
    folder = Path(a.ckpt_dir or a.work)
    todo = [m for m in models if not (folder / f"ckpt_{m}" / "config.json").exists()]
    procs = [subprocess.Popen([sys.executable, __file__, "--as-system", "build", "--model", m,
                               "--checkpoint", str(folder / f"ckpt_{m}")], env=child_env([k % a.num_gpus]))
             for k, m in enumerate(todo)]
    for m, p in zip(todo, procs):
        if p.wait() != 0:
            raise SystemExit(f"building the {m} checkpoint failed")


def parse_slots(text: str) -> list[list[str]]:
    slots = [[s for s in slot.split("+") if s] for slot in text.split(",") if slot.strip()]
    unknown = sorted({s for slot in slots for s in slot} - SYSTEMS.keys())
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; known: {sorted(SYSTEMS)}")
    return slots


def check_pairing(workloads: list[str], slots: list[list[str]]) -> None:
    """DPO systems (trl-dpo-*) run only the pair workloads (dpo-*), SFT stock systems only the others;
    hypersloth-N runs both. SystemExit naming the mismatch, before anything is built."""
    for workload in workloads:
        pairs = WORKLOADS[workload].pairs
        wrong = sorted({s for slot in slots for s in slot
                        if SYSTEMS[s]["runner"] in (("unsloth", "reference") if pairs else ("trl-dpo",))})
        if wrong:
            kind = "preference-pair (DPO)" if pairs else "SFT"
            raise SystemExit(f"systems {wrong} cannot run the {kind} workload {workload}: use hypersloth-N and "
                             f"{'trl-dpo-*' if pairs else 'unsloth-*'} systems with it")


def render(records_path: Path, out_dir: Path) -> None:
    """Markdown table (printed) and a bar chart PNG of s/step per system and workload from a records file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in json.loads(records_path.read_text()) if "error" not in r]
    print("| workload | system | GPUs | grad ckpt | token budget | s/step mean | median | p90 | first step s "
          "| tokens/s | MFU %/GPU | peak GB/GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        budget = r.get("token_budget")
        if isinstance(budget, dict):
            budget = f"{budget.get('tokens'):,} ({budget.get('source')})"
        elif budget is None:
            budget = f"{r['micro_batch']} x {r['grad_accum']} samples"
        print(f"| {r['workload']} | {r['system']} | {r['gpus']} | {r['gradient_checkpointing']} | {budget} | "
              f"{r['s_per_step']:.3f} | {r['s_median']:.3f} | {r['s_p90']:.3f} | {r['first_step_s']:.1f} | "
              f"{r['tokens_per_s']:,.0f} | {r['mfu_pct']:.1f} | {r['peak_gb']:.1f} |")
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4))
    for ax, workload in zip(np.atleast_1d(axes), workloads):
        first: dict[str, dict] = {}  # a system measured twice: its first row
        for r in records:
            if r["workload"] == workload and not r["system"].endswith("-profile"):
                first.setdefault(r["system"], r)
        rows = list(first.values())
        ax.barh([r["system"] for r in rows], [r["s_median"] for r in rows],
                color=["tab:green" if r["system"].startswith("hypersloth") else "tab:gray" for r in rows])
        ax.set_title(f"{workload}, global batch 32")
        ax.set_xlabel("median s / step (lower is better)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out_dir / "benchmarks.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="short-0.6b,long-0.6b,short-8b")
    p.add_argument("--slots", default="unsloth-best+hypersloth-1,unsloth-ddp,hypersloth-2")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps after warm-up")
    p.add_argument("--work", default="/tmp/hs_bench")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"), help="records file: records-TAG-WORKLOAD.json")
    p.add_argument("--budget-s", type=float, default=3600, help="stop starting slots after this many seconds")
    p.add_argument("--num-gpus", type=int, default=2)
    p.add_argument("--first-gpu", type=int, default=0, help="slots use GPUs from this one on")
    p.add_argument("--ckpt-dir", help="where the random checkpoints are (default: --work)")
    p.add_argument("--token-budget", type=lambda s: s if s == "auto" else int(s), default="auto",
                   help="HyperSloth's tokens_per_micro_batch (the product default is auto)")
    p.add_argument("--long-tokens", type=int, default=LONG_TOKENS,
                   help="the long sample of the longctx-* workloads (e.g. 32768, 131072, 262144)")
    p.add_argument("--exactness", type=lambda s: s == "True", default=False,
                   help="longctx-*: the reference system also checks the long sample packed vs alone with gradients")
    p.add_argument("--reference-from", help="longctx-*: take the reference record from this records file (a "
                   "reference system run earlier on the same workload and --long-tokens) instead of running it")
    p.add_argument("--render", help="print the markdown table and write benchmarks.png for a records JSON file")
    # internal: run one system in this process
    p.add_argument("--as-system"), p.add_argument("--system"), p.add_argument("--workload")
    p.add_argument("--model"), p.add_argument("--checkpoint"), p.add_argument("--result")
    p.add_argument("--micro", type=int), p.add_argument("--accum", type=int), p.add_argument("--gpus", type=int)
    p.add_argument("--gc", type=lambda s: {"True": True, "False": False}.get(s, s), default=False)
    p.add_argument("--shim", type=lambda s: s == "True", default=False)
    p.add_argument("--profile", type=lambda s: s == "True", default=False)
    p.add_argument("--graphs", type=lambda s: s == "True", default=True)
    a = p.parse_args()
    if a.render:
        render(Path(a.render), Path(a.out))
        return
    if a.as_system == "build":
        build_checkpoint(a.model, Path(a.checkpoint))
        return
    if a.as_system:
        runners = {"unsloth": run_stock_unsloth, "hypersloth": run_hypersloth, "reference": run_reference,
                   "trl-dpo": run_trl_dpo}
        result = runners[a.as_system](a)
        if result is not None:
            Path(a.result).write_text(json.dumps(result))
        return
    a.deadline = time.time() + a.budget_s
    workloads = [w for w in a.workloads.split(",") if w]
    unknown = sorted(set(workloads) - WORKLOADS.keys())
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; known: {sorted(WORKLOADS)}")
    slots = parse_slots(a.slots)
    check_pairing(workloads, slots)
    build_checkpoints(sorted({WORKLOADS[w].model for w in workloads}), a)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for workload in workloads:
        work = Path(a.work) / workload
        work.mkdir(parents=True, exist_ok=True)
        data = build_data(work, workload_of(workload, a.long_tokens), a.warmup + a.steps)
        records = bench_longctx.earlier_reference(a.reference_from, workload, a.long_tokens)
        for slot in slots:
            if time.time() > a.deadline - 30:
                print(f"[{workload}] out of time: slot {slot} not run", flush=True)
                continue
            records.extend(run_slot(slot, workload, a, data))
            if WORKLOADS[workload].long_sample:
                records = bench_longctx.annotate(records, a.long_tokens)
            Path(a.out, f"records-{a.tag}-{workload}.json").write_text(json.dumps(records, indent=2))
        for r in records if WORKLOADS[workload].long_sample else []:
            if "losses" in r:
                print(bench_longctx.verdict_line(r), flush=True)


if __name__ == "__main__":
    main()
