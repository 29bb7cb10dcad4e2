"""The automatic budget's measurements (budget.py's module docstring, steps 1, 4 and 5): the probe row cut
into the dataset's longest samples (`probe_segments`, `probe_batch`), the peak memory of one forward+backward
on this rank's GPU (`peak_of_forward_backward`), the minimum over ranks (`agree_min`), and `measure_on_gpu` /
`measure_auto`, which run budget_choice.measure on these measurements through the probe cache (probe_cache.py).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from HyperSloth.train.budget import cache as probe_cache
from HyperSloth.train.model_config import num_experts
from HyperSloth.train.budget.choice import (
    ROUND_TO,
    SAFETY_FRACTION,
    VERIFY_TOKENS,
    BudgetDecision,
    MemoryFit,
    PeakFn,
    allocation_limit,
    fit_memory,
    measure,
    probe_sizes,
    shape_needs_checkpointing,
    useful_cap,
)


# ---------------------------------------------------------------- measuring (GPU)


def probe_segments(longest: Sequence[int], tokens: int) -> list[int]:
    """The sample lengths of a probe row of `tokens`: the dataset's longest samples (`longest`, longest
    first), the last one cut to fill the row; repeated from the start if they run out."""
    if not len(longest) or min(longest) < 1:
        raise ValueError(f"the probe needs sample lengths >= 1; got {list(longest)[:8]}")
    segments, left, k = [], int(tokens), 0
    while left > 0:
        n = min(int(longest[k % len(longest)]), left)
        segments.append(n)
        left -= n
        k += 1
    return segments


def probe_batch(tokens: int, longest: Sequence[int], vocab_size: int, seed: int = 0,
                with_lengths: bool = True, one_route: bool = False) -> dict[str, Any]:
    """A packed row of `tokens` random tokens cut as `probe_segments`, as the trainer feeds it (restarting
    position ids, `packed_seq_lengths` for Unsloth's varlen path, labels = inputs).

    `one_route` (mixture-of-experts models): every token is the same one. Each position then carries the same
    hidden state through every layer (attention averages identical values), so every token goes to the same
    experts: the most unbalanced routing a row can have, the worst case for kernels that size their work per
    expert (random tokens spread almost evenly). Grouped GEMMs hold tokens x active experts rows either way."""
    from HyperSloth.train.collate import collate_packed

    rng = np.random.default_rng(seed)
    token = int(rng.integers(0, vocab_size)) if one_route else 0
    rows = (np.full(n, token) if one_route else rng.integers(0, vocab_size, size=n)
            for n in probe_segments(longest, tokens))
    samples = [(ids, ids.copy()) for ids in rows]
    return collate_packed(samples, with_lengths=with_lengths)


def forward_backward(model, batch: dict[str, Any], num_items: int) -> None:
    """One training forward+backward of a probe batch, as the trainer runs a micro-batch; gradients
    accumulate in `.grad` (callers drop them with `release_memory`). The forward runs under the autocast the
    Trainer's does (`training_autocast`), the backward outside it, as HF's training_step runs them."""
    from HyperSloth.train.model import training_autocast

    with training_autocast(model):
        loss = model(**batch, num_items_in_batch=num_items, use_cache=False).loss
    loss.backward()


def peak_of_forward_backward(model, longest: Sequence[int], vocab_size: int, with_lengths: bool = True) -> PeakFn:
    """The measuring function for `measure`: one forward+backward of a probe row on the model's device,
    returning the peak allocated bytes; gradients are set back to None and the cache emptied after."""
    import torch

    device = next(model.parameters()).device
    one_route = num_experts(getattr(model, "config", None)) > 0

    def peak(tokens: int) -> int:
        batch = probe_batch(tokens, longest, vocab_size, with_lengths=with_lengths, one_route=one_route)
        batch = {k: v if k == "packed_seq_lengths" else v.to(device) for k, v in batch.items()}
        release_memory(model)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            forward_backward(model, batch, tokens)
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device))
        finally:
            release_memory(model)

    return peak


def release_memory(model, *, checkpointing_buffers: bool = False) -> None:
    """Drop every gradient (the state HF's zero_grad(set_to_none=True) leaves) and return cached blocks;
    with `checkpointing_buffers`, also shrink the Unsloth checkpointing buffers that the probe grew."""
    import torch

    from HyperSloth.train.model import release_checkpointing_buffers

    for p in model.parameters():
        p.grad = None
    if checkpointing_buffers:
        release_checkpointing_buffers()
    gc.collect()
    torch.cuda.empty_cache()

# ---------------------------------------------------------------- agreeing


def agree_min(tokens: int) -> int:
    """The minimum of `tokens` over all ranks of the default process group (itself without one)."""
    import torch
    import torch.distributed as torch_dist

    if not (torch_dist.is_available() and torch_dist.is_initialized()) or torch_dist.get_world_size() == 1:
        return int(tokens)
    device = torch.device("cuda", torch.cuda.current_device()) if torch_dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([int(tokens)], dtype=torch.int64, device=device)
    torch_dist.all_reduce(value, op=torch_dist.ReduceOp.MIN)
    return int(value.item())


# ---------------------------------------------------------------- one rank, then all ranks


def _longest(lengths: Sequence[int] | np.ndarray) -> list[int]:
    """The dataset's 4,096 longest sample lengths, longest first: what probe rows are cut into."""
    return np.sort(np.asarray(lengths, dtype=np.int64))[::-1][:4096].tolist()


def _probe_key(setup, device, gc_mode, with_lengths: bool, longest: Sequence[int], cap: int) -> dict[str, Any]:
    # Every row the probe can run is a prefix of the row at its largest reachable size.
    reach = VERIFY_TOKENS if with_lengths else max(cap, ROUND_TO)
    return setup.key(device, gc_mode, with_lengths, {reach: probe_segments(longest, reach)})


def measure_on_gpu(model, *, lengths: Sequence[int] | np.ndarray, vocab_size: int, cap: int,
                   gradient_checkpointing: bool | str, with_lengths: bool = True, must_fit: int | None = None,
                   can_switch: bool = True, setup: probe_cache.ProbeSetup | None = None,
                   tiled_mlp: bool = False) -> BudgetDecision:
    """Run the probe on this process's GPU and return this rank's decision (before `agree_min`).
    `tiled_mlp`: the model runs Unsloth's tiled MLP (recorded; the cache key comes with `setup`)."""
    import time

    import torch

    started = time.perf_counter()
    device = next(model.parameters()).device
    longest = _longest(lengths)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer_bytes = 3 * 4 * trainable  # AdamW's two fp32 moments + the fp32 gradient-sync buffer
    release_memory(model)
    free, total = torch.cuda.mem_get_info(device)
    limit = allocation_limit(total, free, torch.cuda.memory_reserved(device), optimizer_bytes)
    cache = setup.cache if setup is not None and setup.cache is not None and setup.cache.enabled else None
    key = _probe_key(setup, device, gradient_checkpointing, with_lengths, longest, cap) if cache else None
    peaks = probe_cache.CachedPeaks(peak_of_forward_backward(model, longest, vocab_size, with_lengths),
                                    cache.get(key) if cache else None)
    was_training = model.training
    model.train()
    try:
        peaks.reverify()
        result = measure(peaks, limit_bytes=limit, cap=cap, must_fit=must_fit, can_switch=can_switch,
                         is_oom=lambda e: isinstance(e, torch.cuda.OutOfMemoryError),
                         verify_at_most=VERIFY_TOKENS if with_lengths else None,
                         tiled_mlp=tiled_mlp if with_lengths else None)  # with_lengths: the Unsloth backend
    finally:
        model.train(was_training)
        release_memory(model, checkpointing_buffers=bool(gradient_checkpointing))
        torch.cuda.reset_peak_memory_stats(device)  # the run's peak should be training's, not the probe's
    if cache:
        cache.put(key, peaks.measured)
    fit: MemoryFit = result["fit"]
    return BudgetDecision(
        tokens=result["tokens"], source="auto", local_tokens=result["tokens"], points=result["points"],
        fit=asdict(fit), limit_bytes=limit, total_bytes=int(total), safety_fraction=SAFETY_FRACTION,
        optimizer_bytes=optimizer_bytes, cap_tokens=cap, verified_peak_bytes=result["verified_peak_bytes"],
        verified_tokens=result["verified_tokens"], longest_sample=int(longest[0]),
        gradient_checkpointing=gradient_checkpointing, tiled_mlp=tiled_mlp, probe_seconds=time.perf_counter() - started,
        probe_passes=len(peaks.measured), cache=peaks.status if cache else "off",
    )


def measure_auto(model, *, lengths: Sequence[int] | np.ndarray, samples_per_step: int,
                 gradient_checkpointing: bool | str, with_lengths: bool = True, must_fit: int | None = None,
                 can_switch: bool = True, setup: probe_cache.ProbeSetup | None = None,
                 tiled_mlp: bool = False) -> BudgetDecision:
    """Measure on this rank's GPU and take the minimum over ranks (every rank must call it)."""
    decision = measure_on_gpu(model, lengths=lengths, vocab_size=int(model.config.vocab_size),
                              cap=useful_cap(lengths, samples_per_step), gradient_checkpointing=gradient_checkpointing,
                              with_lengths=with_lengths, must_fit=must_fit, can_switch=can_switch, setup=setup,
                              tiled_mlp=tiled_mlp)
    decision.tokens = agree_min(decision.tokens)
    return decision


def cached_needs_checkpointing(setup: probe_cache.ProbeSetup, lengths: Sequence[int] | np.ndarray,
                               samples_per_step: int) -> bool:
    """True when this GPU's cache entry for the setup without checkpointing says that the longest sample
    cannot fit even if the whole GPU were free: the model can then be loaded with checkpointing at once.
    Wrong only in the safe direction (a checkpointed run that did not need it); agreed over ranks."""
    import torch

    if setup.cache is None or not setup.cache.enabled or not torch.cuda.is_available():
        return False
    cap = useful_cap(lengths, samples_per_step)
    longest = _longest(lengths)
    device = torch.device("cuda", torch.cuda.current_device())
    cached = setup.cache.get(_probe_key(setup, device, False, setup.backend == "unsloth", longest, cap)) or {}
    sizes = probe_sizes(cap)
    whole_gpu = torch.cuda.get_device_properties(device).total_memory * (1 - SAFETY_FRACTION)
    needed = all(t in cached for t in sizes) and fit_memory(
        [(t, cached[t]) for t in sizes]).max_tokens(whole_gpu) < int(longest[0])
    return agree_min(int(needed)) == 1


def shape_says_checkpointing(setup: probe_cache.ProbeSetup, heaviest_tokens: int) -> bool:
    """True when the model's shape alone says the heaviest micro-batch cannot fit this GPU without
    checkpointing (`budget_choice.shape_needs_checkpointing`; its config read from the model's folder or the
    Hub cache); agreed over ranks. False without CUDA, or when the config cannot be read."""
    import torch

    from HyperSloth.train.model import read_checkpoint_config

    if not torch.cuda.is_available():
        return False
    config = read_checkpoint_config(setup.fast["model_name"], bool(setup.fast.get("trust_remote_code")))
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    needed = config is not None and shape_needs_checkpointing(config, heaviest_tokens, total)
    return agree_min(int(needed)) == 1
