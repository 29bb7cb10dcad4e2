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
  this varlen path natively; with it Unsloth's lean flash path, GQA without K/V copies, as in HyperSloth). `unsloth-best-gc`: the same with Unsloth's gradient checkpointing.
  `unsloth-best-16x2`: 16 x 2 without checkpointing, for models where 32 x 1 does not fit (8B).
- `unsloth-stock`: Unsloth's defaults (8 x 4, its checkpointing, no varlen shim): a secondary row.
- `unsloth-ddp`: Unsloth's own multi-GPU path: torchrun, one process per GPU, each
  `FastLanguageModel.from_pretrained(device_map={"": local_rank})` + stock SFTTrainer (DDP), 16 x 1 per
  GPU (the whole per-GPU share in one micro-batch), the same shim, checkpointing off.
- `reference` (long-context workloads only): the exact step-1 loss and the attention floor, against which
  every system's step 1 is judged (scripts/bench_longctx.py).
- `hypersloth-N`: HyperSloth on N GPUs at product defaults (tokens_per_micro_batch="auto", no
  checkpointing); `hypersloth-1-gc`, `hypersloth-2-gc`: with Unsloth's checkpointing; `hypersloth-1-eager`: HyperSloth-1 with
  `cuda_graphs=False` (what the graphs are worth); `hypersloth-1-unsloth-lora`: HyperSloth-1 with Unsloth's own
  LoRA projections (`lora_passes=False`, what HyperSloth's passes are worth); `hypersloth-1-fa4`,
  `hypersloth-1-flash`: HyperSloth-1 with `fast_model_args.attention` set to FlashAttention-4 / torch's bundled
  flash by name (every record's `attention` says what ran and why; for the stock rows, Unsloth's own rule,
  which the same installed wheels let choose); `hypersloth-1-grouped-experts`: an MoE model's expert adapters as
  grouped GEMMs (`training.expert_lora="grouped"`) in place of Unsloth's MoE LoRA path; `hypersloth-N-profile` and
  `unsloth-best-profile`: the per-phase timer on (synchronises between phases: for the breakdown, not the
  headline) and torch.profiler over steps 4-6 (`logs/rank0.profile_kernels.txt` and `.profile_trace.json.gz` in the
  system's output folder).

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

GRPO workload (`grpo-0.6b`, issue 34 item 8; scripts/bench_grpo.py): Qwen3-0.6B shapes, synthetic text prompts
(median ~110 tokens), 8 prompts x 8 completions of 256 tokens per step (64 completions, TRL's global batch),
temperature 1, beta 0, TRL's default loss, one length reward. `hypersloth-N` trains it with
training.method="grpo"; the stock rows are `trl-grpo-PxA`: FastLanguageModel + get_peft_model + TRL's
GRPOTrainer with HF generate (no vLLM), P completions per device x A accumulation steps (64x1, 32x2, 16x4, 8x8).
Records add `generation_s` per step (HyperSloth: rank 0's sampling seconds; TRL: its model's generate calls,
bench_grpo.GenerateTimer) beside the step's total, and `rewards`; MFU counts the training pass only. E.g. on one GPU:

    python scripts/benchmark.py --workloads grpo-0.6b --num-gpus 1 --warmup 2 --steps 8 \
        --slots hypersloth-1,trl-grpo-64x1,trl-grpo-32x2,trl-grpo-16x4 --tag grpo

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
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import bench_longctx  # scripts/ is on sys.path when this file runs
from bench_systems import (SYSTEMS, hypersloth_out, hypersloth_result, run_hypersloth, run_reference, run_trl_grpo,
                           run_stock_unsloth, run_trl_dpo)
from bench_workloads import (
    GLOBAL_BATCH,
    LONG_TOKENS,
    PEAK_FLOPS,
    WORKLOADS,
    build_checkpoint,
    build_data,
    flops_per_step,
    workload_of,
)

ROOT = Path(__file__).resolve().parents[1]


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
            "--graphs", str(system.get("graphs", True)), "--lora-passes", str(system.get("lora_passes", True)),
            "--attention", system.get("attention", "auto"), "--expert-lora", system.get("expert_lora", "auto"),
            "--long-tokens", str(a.long_tokens), "--exactness", str(a.exactness),
            "--result", str(work / f"result_{name}.json")]
    if system["runner"] == "unsloth" and system["gpus"] > 1:
        port = 29600 + (os.getpid() % 200)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(system["gpus"]),
                "--master_port", str(port), *argv[1:]]
    return argv


def step_stats(seconds: list[float], warmup: int) -> dict:
    """Mean, median, p90 of the timed steps (after `warmup`), and the cold first step."""
    timed = np.asarray(seconds[warmup:], dtype=np.float64)
    if timed.size == 0:
        raise ValueError(f"no timed steps: {len(seconds)} steps ran, {warmup} are warm-up")
    return {"s_per_step": float(timed.mean()), "s_median": float(np.median(timed)),
            "s_p90": float(np.percentile(timed, 90)), "first_step_s": float(seconds[0]),
            "timed_steps": int(timed.size)}


def loss_problem(losses: list[float]) -> str | None:
    """Why a system's timings are not a result: a loss that is not finite (a wrong kernel trains fast and on NaN;
    this session's first FA4 runs did, from step 2), or None."""
    bad = next((k for k, x in enumerate(losses) if not np.isfinite(x)), None)
    return None if bad is None else f"loss not finite from step {bad + 1} ({losses[bad]})"


def record_for(name: str, workload: str, raw: dict, data: dict, a, launched: float, wall_s: float) -> dict:
    system, w = SYSTEMS[name], workload_of(workload, a.long_tokens)
    stats = step_stats(raw["step_seconds"], a.warmup)
    timed = raw["step_seconds"][a.warmup:]
    steps = range(a.warmup, a.warmup + len(timed))
    tokens = sum(data["step_tokens"][k] for k in steps)
    batch = GLOBAL_BATCH
    sequences = [data["step_sequences"][k] if w.pairs or w.prompts else [data["lengths"][i] for i in data["order"][k * batch:(k + 1) * batch]]
                 for k in steps]
    flops = sum(flops_per_step(w.model, lengths, dpo=w.pairs) for lengths in sequences)
    seconds = sum(timed)
    # Steadiness per token: the steps carry 0.8-1.6x the median step's tokens, so a GPU-bound step's seconds
    # follow its tokens; its microseconds per token show spikes that the data does not explain.
    per_token = np.asarray(timed) / np.asarray([data["step_tokens"][k] for k in steps]) * 1e6
    budget = raw.get("token_budget")
    return {
        "workload": workload, "system": name, "model": w.model_label, "gpus": system["gpus"],
        "micro_batch": system.get("micro"), "grad_accum": system.get("accum"),
        "gradient_checkpointing": raw.get("gradient_checkpointing") or system["gc"],
        **stats,
        "tokens_per_s": tokens / seconds, "tokens_per_s_per_gpu": tokens / seconds / system["gpus"],
        "mean_tokens_per_step": tokens / len(timed),
        "step_tokens": data["step_tokens"][: len(raw["step_seconds"])],
        "us_per_token_median": float(np.median(per_token)),
        "us_per_token_max_over_median": float(per_token.max() / np.median(per_token)),
        "mfu_pct": 100 * flops / seconds / (PEAK_FLOPS * system["gpus"]),
        "peak_gb": max(raw["peak_gb"]), "peak_gb_per_rank": raw["peak_gb"],
        "token_budget": budget, "losses": raw["losses"], "step_seconds": raw["step_seconds"],
        "phases": raw.get("phases"), "rank_phases": raw.get("rank_phases"),
        "kernel_profile": raw.get("kernel_profile"),  # the -profile systems: steps 4-6 under torch.profiler
        "varlen_shim": raw.get("varlen_shim"), "padding_pct": raw.get("padding_pct", 0.0), "wall_s": wall_s,
        "longest_sample_tokens": raw.get("longest_sample_tokens"),
        # launch (this parent starting the system's process) to the end of its first optimizer step
        "cuda_graphs": raw.get("cuda_graphs"), "startup_phases": (raw.get("startup") or {}).get("phase_s"),
        "startup_s": raw["first_step_end_unix"] - launched if raw.get("first_step_end_unix") else None,
        "probe_s": (budget or {}).get("probe_seconds") if isinstance(budget, dict) else None,
        "rewards_margins": raw.get("rewards_margins"), "tiled_mlp": raw.get("tiled_mlp"),
        # GRPO: generation seconds per step (HyperSloth: rank 0's timing/generation_s; TRL: the seconds in its
        # model's generate, bench_grpo.GenerateTimer), apart from the step's total; the mean reward per step
        "generation_s": raw.get("generation_s"), "rewards": raw.get("rewards"),
        "attention": raw.get("attention"),  # {requested, kernel, reason}: HyperSloth's setting or Unsloth's own rule
        "attention_reuse": raw.get("attention_reuse"),  # checkpointed SFT on Unsloth: kept, reused, recomputed
        # HyperSloth: the packed-row check (train/packing/check.py) and the batching it trained with
        "packing": raw.get("packing"), "batching": raw.get("batching"),
        "salvaged_after_timeout": raw.get("salvaged_after_timeout", False),
    }


def salvage_timed_out(name: str, work: Path, launched: float) -> dict | None:
    """The raw result of a HyperSloth system stopped for time after its training had ended (its summary and
    final records written during this launch, the process still tearing down: freeing tens of GiB of pinned
    host memory takes seconds), or None. Callers record it as the run; anything less is a failure."""
    if SYSTEMS[name]["runner"] != "hypersloth":
        return None
    out = hypersloth_out(work, name)
    summary = out / "train_summary.json"
    if not summary.exists() or summary.stat().st_mtime < launched:
        return None
    try:
        return {**hypersloth_result(out, SYSTEMS[name]["gpus"]), "salvaged_after_timeout": True}
    except (FileNotFoundError, ValueError, KeyError):
        return None


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
        salvaged = salvage_timed_out(name, work, started) if rc == "timeout" else None
        if salvaged is not None:
            result.write_text(json.dumps(salvaged))
            print(f"[{workload} {name}] out of time after its training ended (its summary was written); "
                  "recorded from its output folder", flush=True)
        elif rc != 0 or not result.exists():
            text = log.read_text(errors="replace")
            said = "\n".join(line for line in text.splitlines() if line.startswith("hypersloth-train:"))
            print(f"[{workload} {name}] FAILED ({rc}) after {wall:.0f}s\n{said}\ntail:\n{text[-4000:]}", flush=True)
            records.append({"workload": workload, "system": name, "error": f"exit {rc}", "wall_s": wall})
            continue
        raw = json.loads(result.read_text())
        if SYSTEMS[name]["runner"] == "reference":
            records.append({"workload": workload, "system": name, "wall_s": wall, **raw})
            print(f"[{workload} {name}] {json.dumps(raw)}", flush=True)
            continue
        record = record_for(name, workload, raw, data, a, started, wall)
        problem = loss_problem(record["losses"])
        if problem is not None:  # its timings stay in the record, marked; its line says it is no result
            record["error"] = problem
            print(f"[{workload} {name}] NO RESULT: {problem}; its {record['s_median']:.3f} s median step is not a speed",
                  flush=True)
            records.append(record)
            continue
        print(f"[{workload} {name}] mean {record['s_per_step']:.3f} median {record['s_median']:.3f} "
              f"p90 {record['s_p90']:.3f} first {record['first_step_s']:.2f} s/step, {record['tokens_per_s']:,.0f} tok/s, "
              f"slowest step per token {record['us_per_token_max_over_median']:.2f}x the median, "
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


def check_slot_gpus(slots: list[list[str]], num_gpus: int) -> None:
    """The systems of a slot ("a+b") run side by side, each on GPUs of its own: SystemExit when a slot needs more
    GPUs than --num-gpus (on one GPU, "a+b" gave b no GPU and it failed with 'needs CUDA'; write "a,b")."""
    for slot in slots:
        need = sum(SYSTEMS[name]["gpus"] for name in slot)
        if need > num_gpus:
            raise SystemExit(f"slot {'+'.join(slot)} runs its systems side by side on {need} GPUs, but --num-gpus is "
                             f"{num_gpus}: write them as separate slots ({','.join(slot)}) to run one after another")


def check_pairing(workloads: list[str], slots: list[list[str]]) -> None:
    """DPO systems (trl-dpo-*) run only the pair workloads (dpo-*), GRPO systems (trl-grpo-*) only the prompt
    workloads (grpo-*), SFT stock systems only the others; hypersloth-N runs all. SystemExit naming the mismatch,
    before anything is built."""
    for workload in workloads:
        w = WORKLOADS[workload]
        stock = "trl-dpo" if w.pairs else "trl-grpo" if w.prompts else None
        allowed = {"hypersloth", stock} if stock else {"hypersloth", "unsloth", "reference"}
        wrong = sorted({s for slot in slots for s in slot if SYSTEMS[s]["runner"] not in allowed})
        if wrong:
            kind = "preference-pair (DPO)" if w.pairs else "prompt (GRPO)" if w.prompts else "SFT"
            raise SystemExit(f"systems {wrong} cannot run the {kind} workload {workload}: use hypersloth-N and "
                             f"{stock + '-*' if stock else 'unsloth-*'} systems with it")


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


def parser() -> argparse.ArgumentParser:
    """The command line: the benchmark's own options, and the internal ones a system's process is started with
    (`system_argv`), whose defaults are the systems' defaults."""
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
    p.add_argument("--exactness", type=lambda s: {"True": True, "False": False}.get(s, s), default=False,
                   choices=[False, True, "controls"],
                   help="longctx-*: True: the reference system also checks the long sample packed vs alone with "
                   "gradients; controls: instead the two rows that difference is judged between (the sample first "
                   "in the row: rounding only; the row as one causal sequence: a leak)")
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
    p.add_argument("--lora-passes", type=lambda s: s == "True", default=True)
    p.add_argument("--attention", choices=["auto", "fa4", "flash", "sdpa"], default="auto")
    p.add_argument("--expert-lora", choices=["auto", "grouped", "library"], default="auto")
    return p


def main() -> None:
    a = parser().parse_args()
    if a.render:
        render(Path(a.render), Path(a.out))
        return
    if a.as_system == "build":
        build_checkpoint(a.model, Path(a.checkpoint))
        return
    if a.as_system:
        runners = {"unsloth": run_stock_unsloth, "hypersloth": run_hypersloth, "reference": run_reference,
                   "trl-dpo": run_trl_dpo, "trl-grpo": run_trl_grpo}
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
    check_slot_gpus(slots, a.num_gpus)
    check_pairing(workloads, slots)
    build_checkpoints(sorted({WORKLOADS[w].model for w in workloads}), a)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for workload in workloads:
        work = Path(a.work) / workload
        work.mkdir(parents=True, exist_ok=True)
        data = build_data(work, workload_of(workload, a.long_tokens), a.warmup + a.steps,
                          Path(a.ckpt_dir or a.work) / f"ckpt_{WORKLOADS[workload].model}")
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
