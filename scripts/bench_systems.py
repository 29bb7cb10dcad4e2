"""The systems of scripts/benchmark.py (its docstring says what each is): the table of what each runs with
(`SYSTEMS`: its runner, GPUs, split of the global batch, checkpointing), and the runners, each called in the
system's own process (`benchmark.py --as-system RUNNER`): stock Unsloth + TRL's SFTTrainer (DDP under
torchrun), HyperSloth through its CLI, TRL's DPOTrainer (bench_dpo.py), the long-context reference
(bench_longctx.py). Each returns the raw result that benchmark.py turns into a record.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import bench_dpo  # scripts/ is on sys.path
import bench_grpo
import bench_longctx
from bench_workloads import GLOBAL_BATCH, HEAD_DIM, LR, PROJECTIONS, SEED, SHAPES, workload_of

SYSTEMS = {
    "unsloth-best": dict(runner="unsloth", gpus=1, micro=32, accum=1, gc=False, shim=True),
    "unsloth-best-gc": dict(runner="unsloth", gpus=1, micro=32, accum=1, gc="unsloth", shim=True),
    "unsloth-best-16x2": dict(runner="unsloth", gpus=1, micro=16, accum=2, gc=False, shim=True),
    # The same runs under torch.profiler for steps 4-6 (HyperSloth.train.profiling.KernelProfile): kernel tables
    # and a trace in the system's output folder; left out of the benchmark's comparisons.
    "unsloth-best-profile": dict(runner="unsloth", gpus=1, micro=32, accum=1, gc=False, shim=True, profile=True),
    "unsloth-stock": dict(runner="unsloth", gpus=1, micro=8, accum=4, gc="unsloth", shim=False),
    "unsloth-ddp": dict(runner="unsloth", gpus=2, micro=16, accum=1, gc=False, shim=True),
    "hypersloth-1": dict(runner="hypersloth", gpus=1, gc=False),
    "hypersloth-1-eager": dict(runner="hypersloth", gpus=1, gc=False, graphs=False),
    "hypersloth-1-unsloth-lora": dict(runner="hypersloth", gpus=1, gc=False, lora_passes=False),
    "hypersloth-1-profile": dict(runner="hypersloth", gpus=1, gc=False, profile=True),
    # fast_model_args.attention by name (HyperSloth.train.attention.setting): FlashAttention-4 / torch's bundled flash;
    # hypersloth-N runs the default, "auto", and its record says what auto chose and why.
    "hypersloth-1-fa4": dict(runner="hypersloth", gpus=1, gc=False, attention="fa4"),
    "hypersloth-1-flash": dict(runner="hypersloth", gpus=1, gc=False, attention="flash"),
    # MoE: the expert adapters as grouped GEMMs beside the base experts (training.expert_lora="grouped") in place of
    # Unsloth's MoE LoRA path, which `auto` keeps on the Unsloth backend (faster there on the H200, docs/models.md)
    "hypersloth-1-grouped-experts": dict(runner="hypersloth", gpus=1, gc=False, expert_lora="grouped"),
    "hypersloth-1-gc": dict(runner="hypersloth", gpus=1, gc="unsloth"),
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
    # GRPO workloads: stock Unsloth + TRL's GRPOTrainer, completions per device x accumulation (bench_grpo.py);
    # hypersloth-N runs them with training.method="grpo".
    **{name: dict(runner="trl-grpo", gpus=1, micro=micro, accum=accum, gc=False)
       for name, (micro, accum) in bench_grpo.TRL_SPLITS.items()},
}


# ------------------------------------------------------------------ runners (each in its system's own process)


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
    from bench_stock import stock_lora_model  # scripts/ is on sys.path

    from HyperSloth.train.patches import enable_unsloth_torch_varlen, pad_unsloth_loss_rows

    shim = enable_unsloth_torch_varlen() if a.shim else False
    if a.shim:
        pad_unsloth_loss_rows()  # the same fused-loss patch HyperSloth's workers apply
        # torch 2.11's FA4 entry as HyperSloth fixes it (train/attention/fa4.py): where the fa4 wheels are installed,
        # Unsloth's own rule (its probe included) decides on a working FA4, not on one that fails its first call
        from HyperSloth.train.attention.fa4 import route_torch_fa4_here

        route_torch_fa4_here()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    w = workload_of(a.workload, a.long_tokens)
    model, tok = stock_lora_model(a.checkpoint, max_seq_length=w.max_len, projections=PROJECTIONS, seed=SEED,
                                  gradient_checkpointing=a.gc, load_in_4bit=w.four_bit, device=local)
    clock = _clock()
    out = Path(a.work) / f"out_{a.system}"
    callbacks = [clock]
    if a.profile:  # steps 4-6 under torch.profiler, as HyperSloth's training.profile does
        from HyperSloth.outputs.run_files import rank_file
        from HyperSloth.train.profiling import PROFILE_TABLE, PROFILE_TRACE, KernelProfile

        callbacks.append(KernelProfile(clock.timer, clock, rank_file(out, 0, PROFILE_TABLE),
                                       rank_file(out, 0, PROFILE_TRACE)))
    extra = {"ddp_find_unused_parameters": False} if world > 1 else {}
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=a.micro,
                     gradient_accumulation_steps=a.accum, max_steps=a.steps, learning_rate=LR,
                     lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch_fused", logging_steps=1,
                     report_to="none", save_strategy="no", bf16=True, max_length=w.max_len,
                     train_sampling_strategy="sequential", seed=SEED, **extra)
    trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=load_from_disk(a.work + "/stock_data"),
                         args=args, callbacks=callbacks)
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
            "attention": unsloth_attention(),
            "kernel_profile": callbacks[-1].summary if a.profile else None,
            "first_step_end_unix": clock.first_step_end_unix, "longest_sample_tokens": longest}


def unsloth_attention() -> dict:
    """What stock Unsloth's own rule chose for trainer.train() (unsloth/utils/flash_impl.py, 2026.10.9: FA4 or
    FA3 only where it decides; torch's bundled flash otherwise), in the record's `attention` layout."""
    try:
        from unsloth.utils.flash_impl import FLASH_IMPL_STATE
    except ImportError:
        return {"requested": "unsloth", "kernel": "flash", "reason": "this Unsloth has no flash-impl switch"}
    reason = FLASH_IMPL_STATE.get("reason") or "Unsloth's switch did not run (no padding-free trainer)"
    active = reason.split()[0].lower() if reason.endswith(" active") else "flash"
    return {"requested": f"unsloth {os.environ.get('UNSLOTH_FLASH_ATTENTION_IMPL', 'auto')}", "kernel": active,
            "reason": reason}


def hypersloth_config(a, out: Path) -> Path:
    w = workload_of(a.workload, a.long_tokens)
    per_device = (bench_grpo.GLOBAL_COMPLETIONS if w.prompts else GLOBAL_BATCH) // a.gpus
    rewards, method = bench_grpo.hypersloth_grpo_lines() if w.prompts else ("", 'method="dpo"' if w.pairs else 'loss_type="all"')
    text = rewards + f'''
from HyperSloth.config import *
hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="bench", data_dir="{a.work}/data"),
    training=TrainingConfig(gpus={list(range(a.gpus))}, {method},
                            batching="packed", profile={a.profile}, cuda_graphs={a.graphs},
                            lora_passes={a.lora_passes}, expert_lora={a.expert_lora!r},
                            tokens_per_micro_batch={a.token_budget!r}),
    fast_model_args=FastModelArgs(model_name="{a.checkpoint}", max_seq_length={w.max_len}, dtype="bfloat16",
                                  load_in_4bit={w.four_bit}, backend="unsloth",
                                  use_gradient_checkpointing={a.gc!r}, attention={a.attention!r}),
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


def run_trl_grpo(a) -> dict:
    w = workload_of(a.workload, a.long_tokens)
    return bench_grpo.run_trl_grpo(a, max_len=w.max_len, lr=LR, seed=SEED, projections=PROJECTIONS, clock=_clock())


def run_reference(a) -> dict:
    w = workload_of(a.workload, a.long_tokens)
    return bench_longctx.run_reference(a, w, SHAPES[w.model], HEAD_DIM, SEED, PROJECTIONS)


def run_hypersloth(a) -> dict:
    out = hypersloth_out(a.work, a.system)
    cfg = hypersloth_config(a, out)
    done = subprocess.run([sys.executable, "-m", "HyperSloth.cli.train", str(cfg), "--overwrite"])
    if done.returncode != 0:  # the launcher's own lines are in this system's log; the worker's last words are not
        for stderr in sorted((out / "logs").glob("rank*.stderr")):
            lines = stderr.read_text(errors="replace").splitlines()[-30:]
            print(f"--- last {len(lines)} lines of {stderr}:", *lines, sep="\n", flush=True)
        raise SystemExit(f"hypersloth-train exited with {done.returncode}")
    return hypersloth_result(out, a.gpus)


def hypersloth_out(work: Path, system: str) -> Path:
    """The output folder of HyperSloth system `system` in a workload's work folder."""
    return Path(work) / f"out_{system}"


def hypersloth_result(out: Path, gpus: int) -> dict:
    """A HyperSloth run's raw result, read from its output folder (its summary and every rank's final record);
    FileNotFoundError when the run did not end its training."""
    summary = json.loads((out / "train_summary.json").read_text())
    peaks = [json.loads((out / "logs" / f"rank{r}.final.json").read_text())["peak_gpu_gb"] for r in range(gpus)]
    return {"step_seconds": summary["step_seconds"], "losses": summary["step_losses"], "peak_gb": peaks,
            "phases": summary.get("phase_seconds_per_step"), "rank_phases": rank_phases(out),
            "kernel_profile": summary.get("kernel_profile"),
            "padding_pct": summary.get("padding_pct"), "token_budget": summary.get("token_budget"),
            "gradient_checkpointing": summary.get("gradient_checkpointing"), "tiled_mlp": summary.get("tiled_mlp"),
            "attention": summary.get("attention"),
            "attention_reuse": summary.get("attention_reuse"),  # outputs kept through checkpointing, when switched on
            "packing": summary.get("packing"), "batching": summary.get("batching"),  # the packed-row check, the mode
            "first_step_end_unix": summary.get("first_step_end_unix"), "cuda_graphs": summary.get("cuda_graphs"),
            "startup": summary.get("startup"),  # launch to the end of step 1, phase by phase
            "rewards_margins": (summary.get("step_rewards") or {}).get("rewards/margins"),
            # GRPO: rank 0's sampling seconds per step, and the mean reward (train/grpo/trainer.py)
            "generation_s": (summary.get("step_metrics") or {}).get("timing/generation_s"),
            "rewards": (summary.get("step_metrics") or {}).get("reward"),
            # HyperSloth never cuts a sample: one longer than max_seq_length is refused before training.
            "longest_sample_tokens": (summary.get("token_budget") or {}).get("longest_sample")}
