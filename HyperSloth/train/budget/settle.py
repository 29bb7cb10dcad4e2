"""The automatic micro-batch token budget (`tokens_per_micro_batch="auto"`): measured, never tabled.

How "auto" is decided on a GPU, once per run, after the model is loaded and before the plan is built:

1. Probe: one forward+backward of a packed row of random tokens at two sizes (`PROBE_TOKENS`), each
   after `torch.cuda.reset_peak_memory_stats`, gives two points (tokens, peak allocated bytes). A probe
   row is cut into the dataset's longest samples, longest first (`probe_segments`): the heaviest
   micro-batch the plan can form, so no probe pass costs more than the heaviest real one.
   Packed rows use varlen flash attention and a chunked loss, so memory grows linearly with tokens:
   peak = a + b x tokens (`fit_memory`).
2. Limit: what this process may allocate = total x (1 - `SAFETY_FRACTION`) - memory outside torch's
   allocator (CUDA context, NCCL buffers, other processes) - optimizer state still to come (AdamW's two
   fp32 moments and the gradient-sync buffer, 3 x trainable bytes). The safety fraction (8% of the
   GPU) covers allocator fragmentation between differently shaped micro-batches.
3. Budget = the largest token count whose predicted peak fits the limit, capped at the most tokens one
   rank can ever receive in a step (`useful_cap`: more would never be used), rounded down to a multiple
   of 256. Then it is checked, at a cost bounded by `VERIFY_TOKENS` on the linear (varlen) path:
   - a budget of at most `VERIFY_TOKENS`: one pass at the budget itself; if its real peak exceeds the
     limit the budget shrinks by the overshoot (and halves on an out-of-memory error) until it fits;
   - a larger one: one pass at `VERIFY_TOKENS` instead, and the budget is re-chosen on the line through
     that verified point with the steeper of the two slopes measured, plus `EXTRAPOLATION_SLACK`. So no
     pass at a whole long-context budget (131k tokens on 8B: 85 s) is run to protect a step that costs
     the same (measured on the H200: the two-point line predicted training's peaks within 0.8 GiB on 0.6B
     up to 71 GiB, and within 2.5-5 GiB on 8B, inside the 11 GiB safety margin; docs/benchmarks.md);
   - the transformers backend (SDPA with a packed mask: memory not linear in tokens) always verifies at
     the budget.
   "The longest sample" below stands for the heaviest micro-batch the plan can form (`heaviest_micro_batch`):
   with sorted-pad batching, the per-device batch of the longest samples, each padded to the longest.
   When the line already says the longest sample cannot fit and checkpointing is still off, nothing is
   verified: the worker switches checkpointing on and measures again (`needs_checkpointing`). Before any
   probe, when the model's shape alone says so (every layer's input and its MLP's gate and up outputs for
   the heaviest micro-batch exceed the whole GPU: `budget_choice.shape_needs_checkpointing`; Qwen3-8B at
   131k tokens needs 270 GB of those), the model is loaded with checkpointing at once: no probe without it
   and no second load (the 262k-token 8B start spent 9.6 s reloading and two passes finding this out). With
   checkpointing on, one pass at the longest sample decides: its size becomes the budget if it fits, else
   the run stops before training with the length that fits (it would run out of memory at that step).
   Except on the Unsloth backend with `fast_model_args.tiled_mlp="auto"`: there, when the checkpointed line
   leaves no room for the longest sample, the model is loaded a third time with Unsloth's tiled MLP (each
   MLP run in row tiles under no_grad and recomputed tile by tile in the backward, so no layer keeps the
   whole row's gate and up outputs) and measured again; then the pass at the longest sample decides.
   Measured on the H200 (Qwen3-8B 4-bit, a 151,809-token row, checkpointing on): peak 30.6 -> 25.1 GiB
   (~177 -> ~138 KiB per token), step 121.7 vs 119.9 s, the step-1 loss 1.7e-4 from the sample alone
   (docs/benchmarks.md). It goes on only when needed: its cost on short checkpointed rows is unmeasured.
4. Ranks agree: every rank measures, then all take the minimum (`agree_min`, an all-reduce MIN), so
   the plan is identical everywhere.
5. Cache (`HyperSloth.train.budget.cache`): the measured points are kept per model, quantisation, LoRA settings,
   checkpointing, GPU and library versions. A later start with the same key re-verifies one pass (the
   smallest probe) and reuses the rest; a cached line that says the longest sample cannot fit without
   checkpointing even on the whole GPU lets the worker load the model with checkpointing at once (no
   second load). One log line says "measured" or "cached", the passes run and the seconds.

The probe leaves the model as it found it: no optimizer step, every gradient set back to None, Unsloth's
checkpointing buffers shrunk back (`model.release_checkpointing_buffers`), the caching allocator emptied.
On CPU there is nothing to measure: "auto" is the fixed value per_device_train_batch_size x
max_seq_length (room for a micro-batch of the longest samples; resolved in `HyperSloth.plan.run`, so the CPU
plan is known before any worker starts).

Where each part lives: this module settles the run (`settle`: load, measure, switch checkpointing on and load
again); budget_probe.py measures on the GPU and agrees over ranks (steps 1, 4, 5); budget_choice.py holds the
arithmetic and the probe-fit-choose-verify sequence (steps 2, 3; no torch).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from HyperSloth.train.budget import cache as probe_cache
from HyperSloth.train.budget.choice import BudgetDecision, host_token_cap, longest_does_not_fit, offload_host_bytes
from HyperSloth.train.budget.probe import agree_min, cached_needs_checkpointing, measure_auto, shape_says_checkpointing


def settle(description, load: Callable[..., Any], lengths: Sequence[int] | np.ndarray,
           setup: probe_cache.ProbeSetup | None = None, local_ranks: int = 1):
    """Load the model and fix the run's micro-batch budget: (description with the budget, loaded model,
    decision). `load(gradient_checkpointing, tiled_mlp=...)` loads the model (checkpointing None = as
    configured); `setup` names the model for the probe cache (None: no cache); `local_ranks` share this
    host's memory.

    An explicit budget, or "auto" on CPU, was already fixed by `HyperSloth.plan.run`; "auto" on a GPU is
    measured here and agreed over ranks. If the longest sample does not fit one micro-batch, the memory
    savers go on one at a time, each with a new load and a new measurement, and the description records
    them: gradient checkpointing (at once, when the cache or the model's shape already knows), then, with
    the Unsloth backend and `tiled_mlp="auto"`, Unsloth's tiled MLP (module docstring, 3).
    """
    from loguru import logger

    gc_mode, longest = description.gradient_checkpointing, heaviest_micro_batch(description, lengths)
    tiled = description.tiled_mlp is True
    may_switch = description.token_budget_auto and not gc_mode and setup is not None
    known = may_switch and (("the probe cache" if cached_needs_checkpointing(_probe_setup(setup, tiled), lengths,
                                                                             description.global_batch_size)
                             else None) or ("the model's shape" if shape_says_checkpointing(setup, longest) else None))
    if known:
        gc_mode = _checkpointing_mode(setup.backend)
        logger.warning(f"{known} says the heaviest micro-batch ({_heaviest_text(description, longest)}) cannot fit "
                       f"without gradient checkpointing on this GPU: loading with gradient checkpointing ({gc_mode!r})")
    loaded = load(gc_mode if known else None, tiled_mlp=tiled)
    if not description.token_budget_auto:
        if gc_mode == "unsloth":
            _warn_if_budget_exceeds_host(getattr(loaded.model, "config", None), description.token_budget, longest,
                                         local_ranks)
        return (description.model_copy(update={"tiled_mlp": tiled}), loaded,
                BudgetDecision(tokens=description.token_budget, source=description.token_budget_source, tiled_mlp=tiled))

    def may_tile(model_loaded, mode, tiled_now: bool) -> bool:  # the last saver left, with checkpointing on
        return bool(mode) and not tiled_now and description.tiled_mlp == "auto" and model_loaded.backend == "unsloth"

    def measure_model(model_loaded, mode, tiled_now: bool) -> BudgetDecision:
        # can_switch: a longest sample that does not fit returns unverified while a saver is left to switch on
        return measure_auto(model_loaded.model, lengths=lengths, samples_per_step=description.global_batch_size,
                            gradient_checkpointing=mode, with_lengths=model_loaded.backend == "unsloth",
                            setup=_probe_setup(setup, tiled_now), must_fit=longest, tiled_mlp=tiled_now,
                            can_switch=not mode or may_tile(model_loaded, mode, tiled_now))  # the heaviest micro-batch

    decision = measure_model(loaded, gc_mode, tiled)
    decision.checkpointing_switched_on = bool(known)
    if not gc_mode and longest_does_not_fit(decision.tokens, longest):
        gc_mode = _checkpointing_mode(loaded.backend)
        logger.warning(f"the heaviest micro-batch ({_heaviest_text(description, longest)}) does not fit without gradient "
                       f"checkpointing (measured budget {decision.tokens:,} tokens): turning on gradient "
                       f"checkpointing ({gc_mode!r}) for this run")
        loaded = None  # drop the first model before loading the second
        loaded, decision = _reload_and_measure(lambda: load(gc_mode, tiled_mlp=tiled),
                                               lambda again: measure_model(again, gc_mode, tiled), decision)
        decision.checkpointing_switched_on = True
    if may_tile(loaded, gc_mode, tiled) and longest_does_not_fit(decision.tokens, longest):
        logger.warning(f"the heaviest micro-batch ({_heaviest_text(description, longest)}) does not fit even with "
                       f"gradient checkpointing (measured budget {decision.tokens:,} tokens): turning on Unsloth's "
                       "tiled MLP (each MLP run in row tiles, recomputed per tile in the backward) for this run")
        tiled, loaded = True, None
        switched = decision.checkpointing_switched_on
        loaded, decision = _reload_and_measure(lambda: load(gc_mode, tiled_mlp=True),
                                               lambda again: measure_model(again, gc_mode, True), decision)
        decision.checkpointing_switched_on, decision.tiled_mlp_switched_on = switched, True
    if gc_mode == "unsloth":
        _fit_host_memory(decision, getattr(loaded.model, "config", None), longest, local_ranks)
    logger.info(decision.summary())
    logger.info(decision.probe_line())
    if loaded.backend == "unsloth":  # Unsloth's pre-train detector sees the probe's backward, resets its compile cache
        logger.info("Unsloth will warn that a forward/backward ran before trainer.train(): that was this probe")
    settled = description.model_copy(update={"token_budget": decision.tokens, "gradient_checkpointing": gc_mode,
                                             "tiled_mlp": tiled})
    return settled, loaded, decision


def _probe_setup(setup: probe_cache.ProbeSetup | None, tiled: bool) -> probe_cache.ProbeSetup | None:
    """The probe cache's name for the model as loaded: "auto" settled to whether the MLP is tiled."""
    if setup is None:
        return None
    return dataclasses.replace(setup, fast={**setup.fast, "tiled_mlp": tiled})


def host_memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


HOST_MEMORY_HEADROOM = 0.8  # the share of the host memory available now that offloaded checkpoints may take


def _host_cap(config: Any, local_ranks: int) -> tuple[float | None, int | None]:
    """(the bytes of host memory one rank's offloaded checkpoints may take, the largest micro-batch whose
    checkpoints fit them: `host_token_cap`); None where the memory or the model's shape cannot be read."""
    available = host_memory_available()
    share = None if available is None else HOST_MEMORY_HEADROOM * available / max(local_ranks, 1)
    return share, None if share is None or config is None else host_token_cap(config, share)


def _fit_host_memory(decision: BudgetDecision, config: Any, longest: int, local_ranks: int) -> None:
    """Lower the budget so that Unsloth's offloaded checkpoints of the biggest micro-batch fit this host's
    memory (shared by its local ranks; agreed over all ranks), or warn once when even the longest sample alone
    cannot fit. Without it the kernel's out-of-memory killer ends the worker inside its first step, with
    SIGKILL and no Python error (Qwen3-8B, 282,000 tokens packed on one H200: 36 pinned 4 GiB blocks against
    124 GiB of host memory). `decision` is changed in place."""
    share, cap = _host_cap(config, local_ranks)
    cap = agree_min(decision.tokens if cap is None else cap)  # every rank calls it, so every rank plans alike
    if cap >= decision.tokens:
        return
    if cap >= longest:
        decision.tokens = decision.host_cap_tokens = cap
        return
    _warn_longest_exceeds_host(config, longest, share)


def _warn_if_budget_exceeds_host(config: Any, budget_tokens: int, longest: int, local_ranks: int) -> None:
    """An explicit budget is kept as set; say so when its offloaded checkpoints would not fit host memory."""
    from loguru import logger

    share, cap = _host_cap(config, local_ranks)
    heaviest = max(budget_tokens, longest)  # a row holds up to the budget, or one longer sample alone
    if cap is None or cap >= heaviest:
        return
    if cap < longest:
        _warn_longest_exceeds_host(config, longest, share)
        return
    logger.warning(f"tokens_per_micro_batch={budget_tokens:,}: Unsloth's gradient checkpointing keeps every layer's "
                   f"input of a micro-batch in pinned host memory, about {offload_host_bytes(config, heaviest) / 2**30:.0f} "
                   f"GiB at that size (one power-of-two block per layer), more than this rank's share of what is "
                   f"available now ({share / 2**30:.0f} GiB). Set tokens_per_micro_batch to {cap:,} or less, or to "
                   f"\"auto\" (it lowers itself to fit); otherwise the kernel's out-of-memory killer may end step 1")


def _warn_longest_exceeds_host(config: Any, longest: int, share: float) -> None:
    from loguru import logger

    need = offload_host_bytes(config, longest)
    logger.warning(f"Unsloth's gradient checkpointing keeps every layer's input in pinned host memory: the longest "
                   f"sample ({longest:,} tokens) needs about {need / 2**30:.0f} GiB of it (one power-of-two block per "
                   f"layer), and this rank's share of what is available now is {share / 2**30:.0f} GiB. If the first "
                   f"step is killed (SIGKILL: the out-of-memory killer), free host memory, train shorter samples "
                   f"(lower max_seq_length), or cap the pinned part with UNSLOTH_GC_PINNED_MAX_GB (the rest then "
                   f"stays pageable, at its exact size)")


def heaviest_micro_batch(description, lengths: Sequence[int] | np.ndarray) -> int:
    """Tokens of the heaviest micro-batch the plan can form, which "auto" must fit: packed, the longest sample
    (a row never holds more than the budget, except a sample longer than it); sorted-pad, the per-device batch
    of the longest samples, each padded to the longest. The probe row of that many tokens is cut into the
    dataset's longest samples (`probe_segments`), so it computes what that padded micro-batch computes."""
    longest = int(np.max(lengths))
    if getattr(description, "batching", "packed") != "sorted-pad":
        return longest
    return min(int(description.micro_batch_size), len(lengths)) * longest


def _heaviest_text(description, tokens: int) -> str:
    if getattr(description, "batching", "packed") == "sorted-pad":
        return f"{tokens:,} tokens: sorted-pad's per-device batch of the longest samples, padded"
    return f"the longest sample, {tokens:,} tokens"


def _checkpointing_mode(backend: str) -> bool | str:
    return "unsloth" if backend == "unsloth" else True


def _reload_and_measure(load: Callable[[], Any], measure_model: Callable[[Any], BudgetDecision],
                        first: BudgetDecision):
    """Load the model again and measure; the decision counts every probe and reload so far."""
    import time

    gc.collect()
    _empty_cuda_cache()
    started = time.perf_counter()
    loaded = load()
    reload_s = time.perf_counter() - started
    decision = measure_model(loaded)
    decision.reload_seconds = reload_s + (first.reload_seconds or 0.0)
    decision.probe_seconds = (decision.probe_seconds or 0.0) + (first.probe_seconds or 0.0)
    decision.probe_passes += first.probe_passes
    return loaded, decision


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
