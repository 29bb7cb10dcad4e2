"""GRPO's sampling alone, engine against engine (issue 34): seconds per token step of `rollout.sample_groups`, the
call a GRPO step makes, for the benchmark's shape (8 prompts x 8 completions, up to 256 new tokens, LoRA r=16 on
every projection), so the next step on GRPO's speed is chosen from measurement. GRPO on one H200 spends ~95% of its
step sampling (docs/grpo.md: ~22.7 ms per token step on Unsloth's decode, against well under 1 ms of weight reads):

  unsloth      Unsloth backend inside `rollout.sampling_mode`: Unsloth's fused one-token decode, replayed as one
               CUDA graph segment per layer with each layer's attention eager between them (what GRPO runs today)
  hf-dynamic   transformers backend + PEFT in eval mode: HF `generate` with its dynamic KV cache, eager
  hf-static    transformers backend + PEFT: HF `generate` with a static KV cache (cache_implementation="static"),
               which HF compiles for the decode steps (torch.compile, CUDA graphs on a GPU); the prompt batch is
               left-padded to a multiple of --width-step tokens so the cache keeps few shapes between calls

ENGINE-no-lora (e.g. unsloth-no-lora): the engine with the adapter switched off while sampling (PEFT's
`disable_adapter`), the decode without its LoRA GEMMs: what sampling on merged weights could gain at most. The
adapter is freshly initialised (B = 0), so the completions are the engine's own.
ENGINE-merged (e.g. unsloth-merged): the engine sampling on merged weights, as GRPO does at defaults
(train/grpo/merged_sampling.py: each adapted weight W + scale * B A for the call, the adapter off, every weight put
back after; the merge and the putting back are inside the timed call). The adapter is freshly initialised (B = 0),
so the completions are the engine's own; -no-lora is the bound it can approach.
ENGINE-folded (e.g. unsloth-merged-folded): Unsloth's decode attention for the batch with each KV head's query
heads folded into query rows (`patches.unsloth_folded_gqa_decode`), where Unsloth's Qwen3 decode copies K and V to
every query head, every layer and token step (a third of the decode's GPU time on one H200, 2026-12-05); the
completions should be the engine's own up to bf16 rounding (`same_completions_as_...`). Not GRPO's default until
measured. On the transformers engines it changes nothing.
ENGINE-sync (e.g. unsloth-sync, unsloth-no-lora-sync): HF generate's stop decision read on the host after every
token step (`unfinished_sequences.max() == 0`, a sync), as GRPO sampled until 2026-12-05. GRPO now reads it one
token step late on a GPU (`rollout.deferred_stop_check`), so the host queues the next step while the GPU runs this
one: the default engines run that, and -sync says what it gained (measured on one H200, 2026-12-05, as
`unsloth` against `unsloth-deferred`: 21.8 -> 20.1 ms per token step, the same completions). On the CPU the two are
the same (no device events).

Each engine runs in a process of its own (Unsloth patches transformers when imported) on the same seeded prompts:
--calls calls, each over new prompts of random lengths as GRPO's steps are; the first call is reported apart
(compiles, captures). Per engine: the first call's seconds, the median and p90 over the rest of seconds per call
and milliseconds per token step, peak GB, and the share of completions equal to the first engine's (on a GPU in
bf16 some differ by rounding; fp32 on the CPU: all).

    python scripts/sampling_bench.py --model CKPT --out OUT.json [--engines unsloth,hf-dynamic,hf-static]
    python scripts/sampling_bench.py --model TINY --device cpu --engines hf-dynamic,hf-static --max-new 8 --calls 2

With --profile-steps N, one more call per engine runs under torch.profiler for N token steps from --profile-from on
(the sampler's call marks each token step; the same shapes as the timed calls, so nothing recompiles): the wall and
the GPU's busy milliseconds per token step (is the decode host-bound?), kernels per step, and the operator tables by
device and by host time in --profile-dir/ENGINE.txt. A whole GRPO step under the profiler holds 256 token steps of
thousands of events each (docs/grpo.md); this is the view of a few.

Only HyperSloth's own loading (train/model.py), sampling (train/grpo/rollout.py) and transformers are used.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINES = ("unsloth", "hf-dynamic", "hf-static")
NO_LORA = "-no-lora"  # an engine's variant with the adapter switched off while sampling
MERGED = "-merged"  # an engine's variant sampling on merged weights, as GRPO does at defaults (merged_sampling.py)
FOLDED = "-folded"  # Unsloth's decode attention with grouped-query heads folded (patches.unsloth_folded_gqa_decode)
SYNC = "-sync"  # an engine's variant with HF generate's stop check read after every token step (a host sync)
VARIANTS = (NO_LORA, MERGED, FOLDED, SYNC)  # suffixes, combinable in this order (-no-lora and -merged: one of them)


def variants(name: str) -> set[str]:
    """The variant suffixes an engine name ends with."""
    found = set()
    for suffix in reversed(VARIANTS):
        if name.endswith(suffix):
            found.add(suffix)
            name = name.removesuffix(suffix)
    return found


def base_engine(name: str) -> str:
    """The engine an ENGINE[-no-lora|-merged][-folded][-sync] name runs."""
    for suffix in reversed(VARIANTS):
        name = name.removesuffix(suffix)
    return name


PROMPTS, GENERATIONS = 8, 8


def prompts_of_call(call: int, vocab: int, seed: int, median_tokens: int) -> list[list[int]]:
    """PROMPTS prompts of random token ids, lognormal lengths around `median_tokens` (as GRPO's differ per step)."""
    rng = np.random.default_rng([seed, call])
    lengths = np.clip(np.exp(rng.normal(np.log(median_tokens), 0.5, PROMPTS)), 4, 4 * median_tokens).astype(int)
    return [rng.integers(10, vocab - 10, int(n)).tolist() for n in lengths]


def run_engine(a: argparse.Namespace) -> dict:
    """One engine in this process: load, sample --calls times, time each call."""
    import torch

    from HyperSloth.config import FastModelArgs, GrpoArgs, LoraArgs
    from HyperSloth.train import model as model_lib

    engine = base_engine(a.as_engine)
    backend = "unsloth" if engine == "unsloth" else "transformers"
    if backend == "unsloth":
        model_lib.import_backend("unsloth")  # before transformers is imported by what follows
    from HyperSloth.train.grpo.rollout import eos_ids, generation_config, sample_groups, sampling_mode

    fast = FastModelArgs(model_name=a.model, max_seq_length=4096, backend=backend,
                         dtype="float32" if a.device == "cpu" else "bfloat16")
    loaded = model_lib.load_model(fast, LoraArgs(r=16, lora_alpha=16), lora_passes=backend == "unsloth")
    model = loaded.model if a.device == "cpu" else loaded.model.to("cuda")
    grpo = GrpoArgs(num_generations=GENERATIONS, max_completion_length=a.max_new, temperature=1.0)
    config = generation_config(grpo, loaded.tokenizer.pad_token_id, eos_ids(model, loaded.tokenizer))
    config.min_new_tokens = a.max_new  # no completion ends early: every call generates --max-new tokens
    if engine == "hf-static":
        config.cache_implementation, config.disable_compile = "static", False
    vocab = model.get_input_embeddings().weight.shape[0]
    chosen = variants(a.as_engine)
    if NO_LORA in chosen:
        weights = model.disable_adapter
    elif MERGED in chosen:  # per call, as GRPO's sample(): merge, sample, put back (its cost is timed)
        from HyperSloth.train.grpo.generation_memory import measured_limit
        from HyperSloth.train.grpo.merged_sampling import MergedSampling

        merged = MergedSampling(enabled=True)
        weights = lambda: merged.context(model, measured_limit(next(model.parameters()).device))  # noqa: E731
    else:
        weights = nullcontext
    if FOLDED in chosen:
        from HyperSloth.train.patches import unsloth_folded_gqa_decode as attention
    else:
        attention = nullcontext
    defer_stop = SYNC not in chosen

    @contextmanager
    def adapter():
        with weights(), attention():
            yield
    seconds, completions = [], []
    for call in range(a.calls):
        prompts = prompts_of_call(call, vocab, a.seed, a.prompt_tokens)
        seeds = [1000 * call + k for k in range(PROMPTS)]
        if a.device != "cpu":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with adapter(), sampling_mode(model, backend):
            groups = sample_groups(model, prompts, seeds, grpo, config,
                                   width_multiple=a.width_step if engine == "hf-static" else 1, defer_stop=defer_stop)
        if a.device != "cpu":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        completions.append([[c.tolist() for c in group] for group in groups])
    record = {"engine": a.as_engine, "seconds": seconds, "completions": completions,
              "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if a.device != "cpu" else None}
    if a.profile_steps:
        prompts = prompts_of_call(a.calls, vocab, a.seed, a.prompt_tokens)
        seeds = [1000 * a.calls + k for k in range(PROMPTS)]
        with profiled_token_steps(a, a.as_engine) as profiled:
            with adapter(), sampling_mode(model, backend):
                sample_groups(model, prompts, seeds, grpo, config,
                              width_multiple=a.width_step if engine == "hf-static" else 1, defer_stop=defer_stop)
        record["profile"] = profiled
    return record


@contextmanager
def profiled_token_steps(a: argparse.Namespace, engine: str):
    """torch.profiler over token steps --profile-from .. + --profile-steps of the sampling inside: the sampler
    (rollout.SeededSampler, called once per token step) steps the profiler's schedule and stamps the clock. Yields
    the dict it fills: token steps, wall / GPU-busy ms per token step, kernels per token step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    from HyperSloth.train.grpo import rollout
    from HyperSloth.train.profiling import busy_seconds

    cuda = a.device != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, schedule=schedule(wait=a.profile_from, warmup=2, active=a.profile_steps,
                                                            repeat=1), record_shapes=False)
    stamps: list[float] = []
    plain = rollout.SeededSampler.__call__

    def stepping(self, input_ids, scores):  # HF's loop syncs once per token step: stamp to stamp is a step's wall
        stamps.append(time.perf_counter())
        prof.step()
        return plain(self, input_ids, scores)

    result: dict = {}
    rollout.SeededSampler.__call__ = stepping
    prof.__enter__()
    try:
        yield result
    finally:
        prof.__exit__(None, None, None)
        rollout.SeededSampler.__call__ = plain
    first = a.profile_from + 1  # the call whose prof.step() began recording (schedule: wait, 2 warm-up, active)
    window = stamps[first:first + a.profile_steps + 1]
    steps = len(window) - 1
    if steps < 1:
        raise SystemExit(f"--profile-from {a.profile_from} + 2 + --profile-steps {a.profile_steps} is past the "
                         f"{len(stamps)} token steps of a call: lower them or raise --max-new")
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = busy_seconds([(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in device])
    result.update(token_steps=steps, wall_ms_per_token_step=round(1000 * (window[-1] - window[0]) / steps, 3),
                  gpu_busy_ms_per_token_step=round(1000 * busy / steps, 3) if cuda else None,
                  kernels_per_token_step=round(len(device) / steps, 1))
    averages = prof.key_averages()
    tables = [f"{json.dumps(result)}\n"]
    if cuda:
        tables.append("by device time\n" + averages.table(sort_by="self_device_time_total", row_limit=30))
    tables.append("by host time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=30))
    Path(a.profile_dir).mkdir(parents=True, exist_ok=True)
    (Path(a.profile_dir) / f"{engine}.txt").write_text("\n\n".join(tables) + "\n")


def summary(record: dict, max_new: int, reference: dict | None) -> dict:
    later = np.asarray(record["seconds"][1:] or record["seconds"])
    out = {"engine": record["engine"], "first_call_s": round(record["seconds"][0], 3),
           "median_s": round(float(np.median(later)), 3), "p90_s": round(float(np.percentile(later, 90)), 3),
           "ms_per_token_step": round(1000 * float(np.median(later)) / max_new, 2), "peak_gb": record["peak_gb"]}
    if "profile" in record:
        out["profile"] = record["profile"]
    if reference is not None:
        pairs = [(x, y) for a, b in zip(record["completions"], reference["completions"]) for x, y in zip(a, b)]
        out["same_completions_as_" + reference["engine"]] = sum(x == y for x, y in pairs) / len(pairs)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a local checkpoint folder (config, weights, tokenizer)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated, of {', '.join(ENGINES)}, each also as "
                        f"ENGINE[{NO_LORA}|{MERGED}][{FOLDED}][{SYNC}]")
    p.add_argument("--calls", type=int, default=6, help="sampling calls per engine; the first is reported apart")
    p.add_argument("--max-new", type=int, default=256, help="tokens per completion (none ends early)")
    p.add_argument("--prompt-tokens", type=int, default=100, help="median prompt length")
    p.add_argument("--width-step", type=int, default=64, help="hf-static: prompt batches padded to a multiple of it")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the records (with every call's seconds) here as JSON")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="one more call per engine, these many of its token steps under torch.profiler (0: none)")
    p.add_argument("--profile-from", type=int, default=100, help="the token step the profiled ones start after")
    p.add_argument("--profile-dir", default="sampling_profiles", help="where the operator tables go (ENGINE.txt)")
    p.add_argument("--as-engine", help=argparse.SUPPRESS)  # one engine, in a child process
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.as_engine:
        Path(a.result).write_text(json.dumps(run_engine(a)))
        return
    engines = [e for e in a.engines.split(",") if e]
    if a.device == "cpu" and any(SYNC in variants(e) for e in engines):
        raise SystemExit(f"ENGINE{SYNC} compares with the stop check deferred, which runs on a GPU only (the CPU has no "
                         "device events): on the CPU every engine already checks after every token step")
    unknown = sorted(e for e in engines if base_engine(e) not in ENGINES)
    if unknown:
        raise SystemExit(f"unknown engines {unknown}; known: {', '.join(ENGINES)}, each also as "
                         f"ENGINE[{NO_LORA}|{MERGED}][{FOLDED}][{SYNC}]")
    records, out = [], Path(a.out) if a.out else None
    scratch = Path(tempfile.mkdtemp(prefix="sampling_bench_"))  # each engine's child writes its result here
    for engine in engines:
        result = scratch / f"{engine}.json"
        argv = [sys.executable, __file__, "--model", a.model, "--calls", str(a.calls), "--max-new", str(a.max_new),
                "--prompt-tokens", str(a.prompt_tokens), "--width-step", str(a.width_step), "--device", a.device,
                "--seed", str(a.seed), "--profile-steps", str(a.profile_steps), "--profile-from", str(a.profile_from),
                "--profile-dir", a.profile_dir, "--as-engine", engine, "--result", str(result)]
        done = subprocess.run(argv)
        if done.returncode != 0:
            print(json.dumps({"engine": engine, "error": f"exit {done.returncode}"}), flush=True)
            continue
        records.append(json.loads(result.read_text()))
        print(json.dumps(summary(records[-1], a.max_new, records[0] if len(records) > 1 else None)), flush=True)
    if out is not None:
        out.write_text(json.dumps([{**summary(r, a.max_new, records[0] if i else None), "seconds": r["seconds"]}
                                   for i, r in enumerate(records)], indent=1))


if __name__ == "__main__":
    main()
