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
   verified: the worker switches checkpointing on and measures again (`needs_checkpointing`). With
   checkpointing on, one pass at the longest sample decides: its size becomes the budget if it fits, else
   the run stops before training with the length that fits (it would run out of memory at that step).
4. Ranks agree: every rank measures, then all take the minimum (`agree_min`, an all-reduce MIN), so
   the plan is identical everywhere.
5. Cache (`HyperSloth.train.probe_cache`): the measured points are kept per model, quantisation, LoRA settings,
   checkpointing, GPU and library versions. A later start with the same key re-verifies one pass (the
   smallest probe) and reuses the rest; a cached line that says the longest sample cannot fit without
   checkpointing even on the whole GPU lets the worker load the model with checkpointing at once (no
   second load). One log line says "measured" or "cached", the passes run and the seconds.

The probe leaves the model as it found it: no optimizer step, every gradient set back to None, Unsloth's
checkpointing buffers shrunk back (`model.release_checkpointing_buffers`), the caching allocator emptied.
On CPU there is nothing to measure: "auto" is the fixed value per_device_train_batch_size x
max_seq_length (room for a micro-batch of the longest samples; resolved in `HyperSloth.plan.run`, so the CPU
plan is known before any worker starts).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from HyperSloth.train import probe_cache

SAFETY_FRACTION = 0.08  # of the GPU's total memory, left unplanned (fragmentation, allocator slack)
PROBE_TOKENS = (2048, 8192)  # the two probe sizes the line is fitted through
VERIFY_TOKENS = 32768  # the largest pass on the linear path (measured: one 131k-token step on 8B + checkpointing, 85 s)
EXTRAPOLATION_SLACK = 0.10  # extra slope beyond the verified point
ROUND_TO = 256
MIN_BUDGET = 256


@dataclass(frozen=True)
class MemoryFit:
    """Peak allocated bytes of one micro-batch as a line in its token count: base + per_token x tokens."""

    base_bytes: float
    per_token_bytes: float

    def predict(self, tokens: int) -> float:
        return self.base_bytes + self.per_token_bytes * tokens

    def max_tokens(self, limit_bytes: float) -> int:
        """The most tokens whose predicted peak stays within `limit_bytes` (0 if even the base does not)."""
        if self.per_token_bytes <= 0:
            raise ValueError("memory must grow with tokens; the probe measured a flat or falling line")
        return max(0, int((limit_bytes - self.base_bytes) // self.per_token_bytes))


def fit_memory(points: Sequence[tuple[int, int]]) -> MemoryFit:
    """Least-squares line through (tokens, peak bytes) points; needs two distinct token counts and
    memory that grows with tokens (ValueError otherwise, naming what was measured)."""
    tokens = np.asarray([p[0] for p in points], dtype=np.float64)
    peaks = np.asarray([p[1] for p in points], dtype=np.float64)
    if np.unique(tokens).size < 2:
        raise ValueError(f"fitting memory per token needs probes at two sizes at least; got {list(points)}")
    dt = tokens - tokens.mean()
    slope = float((dt * (peaks - peaks.mean())).sum() / (dt * dt).sum())
    intercept = float(peaks.mean() - slope * tokens.mean())
    if slope <= 0:
        raise ValueError(f"probe peaks do not grow with tokens: {list(points)}")
    return MemoryFit(base_bytes=float(intercept), per_token_bytes=float(slope))


def allocation_limit(total_bytes: int, free_bytes: int, reserved_bytes: int, optimizer_bytes: int,
                     safety_fraction: float = SAFETY_FRACTION) -> int:
    """Bytes this process's tensors may peak at: the GPU less the safety fraction, less what lives
    outside torch's allocator (total - free - reserved by torch), less the optimizer state to come."""
    outside = max(0, total_bytes - free_bytes - reserved_bytes)
    return int(total_bytes * (1 - safety_fraction) - outside - optimizer_bytes)


def useful_cap(lengths: Sequence[int] | np.ndarray, samples_per_step: int) -> int:
    """The most tokens one micro-batch can ever hold: the `samples_per_step` longest samples together
    (a whole step on one rank). A budget above this would never be filled."""
    lens = np.sort(np.asarray(lengths, dtype=np.int64))[::-1]
    return int(lens[:samples_per_step].sum())


def choose_tokens(fit: MemoryFit, limit_bytes: int, cap: int) -> int:
    """Largest multiple of `ROUND_TO` that fits `limit_bytes` under `fit`, at most `cap` (rounded up to
    `ROUND_TO`); never below `MIN_BUDGET`."""
    fits = fit.max_tokens(limit_bytes)
    cap = -(-cap // ROUND_TO) * ROUND_TO
    return max(MIN_BUDGET, (min(fits, cap) // ROUND_TO) * ROUND_TO)


def needs_checkpointing(budget_tokens: int, longest_sample: int) -> bool:
    """True when the longest sample alone exceeds what fits in one micro-batch."""
    return longest_sample > budget_tokens


@dataclass
class BudgetDecision:
    """The chosen budget and everything it was chosen from (logged and written with the run's settings)."""

    tokens: int
    source: str  # "auto" (measured), "auto-cpu" (fixed CPU value) or "explicit"
    checkpointing_switched_on: bool = False  # the longest sample did not fit without checkpointing
    local_tokens: int | None = None  # this rank's measurement before the minimum over ranks
    points: list[tuple[int, int]] = field(default_factory=list)
    fit: dict[str, float] | None = None
    limit_bytes: int | None = None
    total_bytes: int | None = None
    safety_fraction: float | None = None
    optimizer_bytes: int | None = None
    cap_tokens: int | None = None
    verified_peak_bytes: int | None = None
    verified_tokens: int | None = None  # the size the verifying pass ran at (below `tokens`: extrapolated)
    longest_sample: int | None = None
    gradient_checkpointing: bool | str | None = None
    probe_seconds: float | None = None  # every probe of this run (both, when checkpointing was switched on)
    probe_passes: int = 0  # forward+backward passes run (cached points are not run again)
    cache: str = "off"  # "measured", "cached" (one pass re-verified), "re-measured" (the cached pass disagreed)
    reload_seconds: float | None = None  # loading the model again with checkpointing

    def as_record(self) -> dict[str, Any]:
        return asdict(self)

    def probe_line(self) -> str:
        """One log line: was the probe measured or cached, what it ran and what it cost."""
        reload = f", reload with checkpointing {self.reload_seconds:.1f} s" if self.reload_seconds else ""
        return (f"budget probe: {self.cache}, {self.probe_passes} forward+backward pass(es), "
                f"{self.probe_seconds or 0.0:.1f} s{reload}")

    def summary(self) -> str:
        """One log line: the value and what it came from."""
        if self.source != "auto":
            return f"tokens_per_micro_batch={self.tokens:,} ({self.source})"
        gib = 2.0**30
        parts = [f"tokens_per_micro_batch=auto -> {self.tokens:,} (min over ranks; this rank {self.local_tokens or 0:,})"]
        if self.fit:
            parts.append(f"peak = {self.fit['base_bytes'] / gib:.2f} GiB + {self.fit['per_token_bytes'] / 2**20:.3f} "
                         f"MiB x tokens from probes {[(t, round(b / gib, 2)) for t, b in self.points]}")
        if self.limit_bytes is not None:
            parts.append(f"limit {self.limit_bytes / gib:.1f} GiB of {self.total_bytes / gib:.1f} GiB "
                         f"({self.safety_fraction:.0%} kept free, optimizer state {self.optimizer_bytes / gib:.2f} GiB)")
        if self.verified_peak_bytes is not None:
            own = self.local_tokens or self.tokens  # this rank's choice (the minimum over ranks may be lower)
            where = ("at the budget" if self.verified_tokens is None or self.verified_tokens >= own
                     else f"at {self.verified_tokens:,} tokens, extrapolated with {EXTRAPOLATION_SLACK:.0%} slack")
            parts.append(f"verified peak {self.verified_peak_bytes / gib:.1f} GiB {where}")
        elif self.points:
            parts.append("not verified: the line leaves no room for the longest sample")
        parts.append(f"cap {self.cap_tokens}, longest sample {self.longest_sample}, "
                     f"gradient checkpointing {self.gradient_checkpointing!r}"
                     + (" (switched on: the longest sample did not fit without)" if self.checkpointing_switched_on else ""))
        return "; ".join(parts)


# ---------------------------------------------------------------- measuring (GPU)


PeakFn = Callable[[int], int]  # tokens -> peak allocated bytes of one forward+backward (may raise OOM)


def probe_sizes(cap: int, probe_tokens: Sequence[int] = PROBE_TOKENS) -> list[int]:
    """The two sizes the line is fitted through, capped at `cap` (two distinct sizes are kept)."""
    return sorted({max(ROUND_TO, min(t, cap)) for t in probe_tokens} | {ROUND_TO})[-2:]


def _round_down(tokens: float) -> int:
    return max(MIN_BUDGET, (int(tokens) // ROUND_TO) * ROUND_TO)


def _verify(peak_of: PeakFn, tokens: int, limit_bytes: int, is_oom: Callable[[BaseException], bool],
            max_checks: int) -> tuple[int, int]:
    """Run `tokens` and shrink until its real peak fits: (tokens, verified peak)."""
    for _ in range(max_checks):
        try:
            verified = int(peak_of(tokens))
        except BaseException as err:  # noqa: BLE001  (only out-of-memory is handled, the rest re-raised)
            if not is_oom(err) or tokens <= MIN_BUDGET:
                raise
            tokens = _round_down(tokens // 2)
            continue
        if verified <= limit_bytes or tokens <= MIN_BUDGET:
            return tokens, verified
        # Shrink by the overshoot measured at this size, as if memory per token were the whole peak.
        tokens = _round_down(int(tokens * limit_bytes / verified) - ROUND_TO)
    raise RuntimeError(f"no micro-batch size verified to fit {limit_bytes / 2**30:.1f} GiB after {max_checks} "
                       "probes: set training.tokens_per_micro_batch to a number of tokens")


def _extrapolate(fit: MemoryFit, last: tuple[int, int], verified: tuple[int, int], limit_bytes: int,
                 cap: int) -> tuple[MemoryFit, int]:
    """The line through the verified point with the steeper of the two measured slopes plus the slack,
    and the budget it allows (at least the verified size)."""
    local = (verified[1] - last[1]) / max(verified[0] - last[0], 1)
    slope = max(fit.per_token_bytes, local) * (1 + EXTRAPOLATION_SLACK)
    bound = MemoryFit(base_bytes=verified[1] - slope * verified[0], per_token_bytes=slope)
    return bound, max(verified[0], choose_tokens(bound, limit_bytes, cap))


def measure(peak_of: PeakFn, *, limit_bytes: int, cap: int, probe_tokens: Sequence[int] = PROBE_TOKENS,
            is_oom: Callable[[BaseException], bool] = lambda e: False, max_checks: int = 8,
            must_fit: int | None = None, can_switch: bool = True, verify_at_most: int | None = None
            ) -> dict[str, Any]:
    """Probe, fit, choose and verify, with the measuring function injected (tests pass a fake).

    Returns the points, the fit the budget was chosen on, the tokens, and the verified size and peak
    (None when unverified). `must_fit` (the longest sample): when the line leaves fewer tokens than this,
    return unverified if the caller `can_switch` (checkpointing on); else run one pass at it, the row the
    run cannot do without, and take it as the budget if it fits (RuntimeError saying what to change if
    not). `verify_at_most`: the largest verifying pass (None: at the budget,
    whatever its size); a larger budget is extrapolated from a pass at this size (module docstring, 3).
    """
    points = [(t, int(peak_of(t))) for t in probe_sizes(cap, probe_tokens)]
    fit = fit_memory(points)
    tokens = choose_tokens(fit, limit_bytes, cap)
    result = {"points": points, "fit": fit, "tokens": tokens, "verified_tokens": None, "verified_peak_bytes": None}
    if must_fit is not None and tokens < must_fit:
        return result if can_switch else {**result, **_prove_longest(peak_of, must_fit, tokens, limit_bytes, is_oom)}
    if verify_at_most is not None and tokens > verify_at_most > points[-1][0]:
        size = _round_down(verify_at_most)
        peak = _peak_or_none(peak_of, size, is_oom)
        if peak is not None and peak <= limit_bytes:
            points.append((size, peak))
            bound, tokens = _extrapolate(fit, points[-2], points[-1], limit_bytes, cap)
            return {**result, "fit": bound, "tokens": tokens, "verified_tokens": size, "verified_peak_bytes": peak}
        # Even the bounded pass did not fit: the budget lies below it; verify there as usual.
        tokens = _round_down(size // 2 if peak is None else size * limit_bytes / peak - ROUND_TO)
    tokens, verified = _verify(peak_of, tokens, limit_bytes, is_oom, max_checks)
    return {**result, "tokens": tokens, "verified_tokens": tokens, "verified_peak_bytes": verified}


def _peak_or_none(peak_of: PeakFn, size: int, is_oom: Callable[[BaseException], bool]) -> int | None:
    """The peak of one pass at `size` tokens, or None when it ran out of memory (other errors propagate)."""
    try:
        return int(peak_of(size))
    except BaseException as err:  # noqa: BLE001
        if not is_oom(err):
            raise
        return None


def _prove_longest(peak_of: PeakFn, longest: int, line_tokens: int, limit_bytes: int,
                   is_oom: Callable[[BaseException], bool]) -> dict[str, Any]:
    """One pass at the longest sample (rounded up to `ROUND_TO`); its size as the budget if it fits."""
    size = -(-longest // ROUND_TO) * ROUND_TO
    peak = _peak_or_none(peak_of, size, is_oom)
    if peak is not None and peak <= limit_bytes:
        return {"tokens": size, "verified_tokens": size, "verified_peak_bytes": peak}
    seen = "ran out of memory" if peak is None else f"peaked at {peak / 2**30:.1f} GiB"
    raise RuntimeError(
        f"the heaviest micro-batch ({longest:,} tokens: the longest sample, or with sorted-pad the per-device batch "
        f"of the longest samples) does not fit on this GPU even with gradient checkpointing: its forward+backward "
        f"{seen}, and {limit_bytes / 2**30:.1f} GiB may be used (the measured line allows about {line_tokens:,} "
        f"tokens). Drop the longer samples (rebuild the dataset with --max_seq_length {line_tokens}), lower "
        "per_device_train_batch_size (sorted-pad), or train on a GPU with more memory")


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
                with_lengths: bool = True) -> dict[str, Any]:
    """A packed row of `tokens` random tokens cut as `probe_segments`, as the trainer feeds it (restarting
    position ids, `packed_seq_lengths` for Unsloth's varlen path, labels = inputs)."""
    from HyperSloth.train.collate import collate_packed

    rng = np.random.default_rng(seed)
    rows = (rng.integers(0, vocab_size, size=n) for n in probe_segments(longest, tokens))
    samples = [(ids, ids.copy()) for ids in rows]
    return collate_packed(samples, with_lengths=with_lengths)


def forward_backward(model, batch: dict[str, Any], num_items: int) -> None:
    """One training forward+backward of a probe batch, as the trainer runs a micro-batch; gradients
    accumulate in `.grad` (callers drop them with `release_memory`)."""
    loss = model(**batch, num_items_in_batch=num_items, use_cache=False).loss
    loss.backward()


def peak_of_forward_backward(model, longest: Sequence[int], vocab_size: int, with_lengths: bool = True) -> PeakFn:
    """The measuring function for `measure`: one forward+backward of a probe row on the model's device,
    returning the peak allocated bytes; gradients are set back to None and the cache emptied after."""
    import torch

    device = next(model.parameters()).device

    def peak(tokens: int) -> int:
        batch = probe_batch(tokens, longest, vocab_size, with_lengths=with_lengths)
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


def _probe_key(setup, device, gc_mode, with_lengths: bool, longest: Sequence[int], cap: int) -> dict[str, Any]:
    # Every row the probe can run is a prefix of the row at its largest reachable size.
    reach = VERIFY_TOKENS if with_lengths else max(cap, ROUND_TO)
    return setup.key(device, gc_mode, with_lengths, {reach: probe_segments(longest, reach)})


def measure_on_gpu(model, *, lengths: Sequence[int] | np.ndarray, vocab_size: int, cap: int,
                   gradient_checkpointing: bool | str, with_lengths: bool = True, must_fit: int | None = None,
                   can_switch: bool = True, setup: probe_cache.ProbeSetup | None = None) -> BudgetDecision:
    """Run the probe on this process's GPU and return this rank's decision (before `agree_min`)."""
    import time

    import torch

    started = time.perf_counter()
    device = next(model.parameters()).device
    longest = np.sort(np.asarray(lengths, dtype=np.int64))[::-1][:4096].tolist()
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
                         verify_at_most=VERIFY_TOKENS if with_lengths else None)
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
        gradient_checkpointing=gradient_checkpointing, probe_seconds=time.perf_counter() - started,
        probe_passes=len(peaks.measured), cache=peaks.status if cache else "off",
    )


def measure_auto(model, *, lengths: Sequence[int] | np.ndarray, samples_per_step: int,
                 gradient_checkpointing: bool | str, with_lengths: bool = True, must_fit: int | None = None,
                 can_switch: bool = True, setup: probe_cache.ProbeSetup | None = None) -> BudgetDecision:
    """Measure on this rank's GPU and take the minimum over ranks (every rank must call it)."""
    decision = measure_on_gpu(model, lengths=lengths, vocab_size=int(model.config.vocab_size),
                              cap=useful_cap(lengths, samples_per_step), gradient_checkpointing=gradient_checkpointing,
                              with_lengths=with_lengths, must_fit=must_fit, can_switch=can_switch, setup=setup)
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
    lengths = np.asarray(lengths, dtype=np.int64)
    cap = useful_cap(lengths, samples_per_step)
    longest = np.sort(lengths)[::-1][:4096].tolist()
    device = torch.device("cuda", torch.cuda.current_device())
    cached = setup.cache.get(_probe_key(setup, device, False, setup.backend == "unsloth", longest, cap)) or {}
    sizes = probe_sizes(cap)
    whole_gpu = torch.cuda.get_device_properties(device).total_memory * (1 - SAFETY_FRACTION)
    needed = all(t in cached for t in sizes) and fit_memory(
        [(t, cached[t]) for t in sizes]).max_tokens(whole_gpu) < int(longest[0])
    return agree_min(int(needed)) == 1


def settle(description, load: Callable[[Any], Any], lengths: Sequence[int] | np.ndarray,
           setup: probe_cache.ProbeSetup | None = None):
    """Load the model and fix the run's micro-batch budget: (description with the budget, loaded model,
    decision). `load(gradient_checkpointing)` loads the model (None = as configured); `setup` names the
    model for the probe cache (None: no cache).

    An explicit budget, or "auto" on CPU, was already fixed by `HyperSloth.plan.run`; "auto" on a GPU is
    measured here and agreed over ranks. If the longest sample does not fit one micro-batch without
    checkpointing, the model is loaded again with gradient checkpointing (at once, when the cache already
    knows), the budget is measured again, and the description records checkpointing on.
    """
    from loguru import logger

    gc_mode, longest = description.gradient_checkpointing, heaviest_micro_batch(description, lengths)
    known = (description.token_budget_auto and not gc_mode and setup is not None
             and cached_needs_checkpointing(setup, lengths, description.global_batch_size))
    if known:
        gc_mode = _checkpointing_mode(setup.backend)
        logger.warning(f"the probe cache says the longest sample ({longest:,} tokens) cannot fit without gradient "
                       f"checkpointing on this GPU: loading with gradient checkpointing ({gc_mode!r})")
    loaded = load(gc_mode if known else None)
    if not description.token_budget_auto:
        return description, loaded, BudgetDecision(tokens=description.token_budget,
                                                   source=description.token_budget_source)

    def measure_model(model_loaded, mode) -> BudgetDecision:
        return measure_auto(model_loaded.model, lengths=lengths, samples_per_step=description.global_batch_size,
                            gradient_checkpointing=mode, with_lengths=model_loaded.backend == "unsloth",
                            setup=setup, must_fit=longest, can_switch=not mode)  # the heaviest micro-batch

    decision = measure_model(loaded, gc_mode)
    decision.checkpointing_switched_on = bool(known)
    if not gc_mode and needs_checkpointing(decision.tokens, longest):
        gc_mode = _checkpointing_mode(loaded.backend)
        logger.warning(f"the heaviest micro-batch ({_heaviest_text(description, longest)}) does not fit without gradient "
                       f"checkpointing (measured budget {decision.tokens:,} tokens): turning on gradient "
                       f"checkpointing ({gc_mode!r}) for this run")
        loaded = None  # drop the first model before loading the second
        loaded, decision = _reload_and_measure(load, gc_mode, measure_model, decision)
    logger.info(decision.summary())
    logger.info(decision.probe_line())
    if loaded.backend == "unsloth":  # Unsloth's pre-train detector sees the probe's backward, resets its compile cache
        logger.info("Unsloth will warn that a forward/backward ran before trainer.train(): that was this probe")
    settled = description.model_copy(update={"token_budget": decision.tokens, "gradient_checkpointing": gc_mode})
    return settled, loaded, decision


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


def _reload_and_measure(load: Callable[[Any], Any], mode: bool | str, measure_model, first: BudgetDecision):
    """Load the model again with checkpointing `mode` and measure; the decision counts both probes."""
    import time

    gc.collect()
    _empty_cuda_cache()
    started = time.perf_counter()
    loaded = load(mode)
    reload_s = time.perf_counter() - started
    decision = measure_model(loaded, mode)
    decision.checkpointing_switched_on, decision.reload_seconds = True, reload_s
    decision.probe_seconds = (decision.probe_seconds or 0.0) + (first.probe_seconds or 0.0)
    decision.probe_passes += first.probe_passes
    return loaded, decision


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
