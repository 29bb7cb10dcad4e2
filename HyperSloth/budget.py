"""The automatic micro-batch token budget (`tokens_per_micro_batch="auto"`): measured, never tabled.

How "auto" is decided on a GPU, once per run, after the model is loaded and before the plan is built:

1. Probe: one forward+backward of a packed row of random tokens at two sizes (`PROBE_TOKENS`), each
   after `torch.cuda.reset_peak_memory_stats`, gives two points (tokens, peak allocated bytes).
   Packed rows use varlen flash attention and a chunked loss, so memory grows linearly with tokens:
   peak = a + b x tokens (`fit_memory`).
2. Limit: what this process may allocate = total x (1 - `SAFETY_FRACTION`) - memory outside torch's
   allocator (CUDA context, NCCL buffers, other processes) - optimizer state still to come (AdamW's two
   fp32 moments and the gradient-sync buffer, 3 x trainable bytes). The safety fraction (8% of the
   GPU) covers allocator fragmentation between differently shaped micro-batches.
3. Budget = the largest token count whose predicted peak fits the limit, capped at the most tokens one
   rank can ever receive in a step (`useful_cap`: more would never be used), rounded down to a multiple
   of 256. A third probe at that size checks the prediction; if its real peak exceeds the limit, the
   budget shrinks by the overshoot (and halves on an out-of-memory error) until it fits.
4. Ranks agree: every rank measures, then all take the minimum (`agree_min`, an all-reduce MIN), so
   the plan is identical everywhere.
5. Checkpointing: if the longest sample of the dataset exceeds the budget, one sample alone would not
   fit: the worker turns on Unsloth's gradient checkpointing and measures again (`needs_checkpointing`).

The probe leaves the model as it found it: no optimizer step, every gradient set back to None, Unsloth's
checkpointing buffers shrunk back (`model.release_checkpointing_buffers`), the caching allocator emptied.
On CPU there is nothing to measure: "auto" is the fixed value per_device_train_batch_size x
max_seq_length (room for a micro-batch of the longest samples; resolved in `HyperSloth.run`, so the CPU
plan is known before any worker starts).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SAFETY_FRACTION = 0.08  # of the GPU's total memory, left unplanned (fragmentation, allocator slack)
PROBE_TOKENS = (2048, 8192)  # the two probe sizes the line is fitted through
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
    longest_sample: int | None = None
    gradient_checkpointing: bool | str | None = None
    probe_seconds: float | None = None

    def as_record(self) -> dict[str, Any]:
        return asdict(self)

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
            parts.append(f"verified peak {self.verified_peak_bytes / gib:.1f} GiB, probe {self.probe_seconds:.1f} s")
        parts.append(f"cap {self.cap_tokens}, longest sample {self.longest_sample}, "
                     f"gradient checkpointing {self.gradient_checkpointing!r}"
                     + (" (switched on: the longest sample did not fit without)" if self.checkpointing_switched_on else ""))
        return "; ".join(parts)


# ---------------------------------------------------------------- measuring (GPU)


PeakFn = Callable[[int], int]  # tokens -> peak allocated bytes of one forward+backward (may raise OOM)


def measure(peak_of: PeakFn, *, limit_bytes: int, cap: int, probe_tokens: Sequence[int] = PROBE_TOKENS,
            is_oom: Callable[[BaseException], bool] = lambda e: False, max_checks: int = 8) -> dict[str, Any]:
    """Probe, fit, choose and verify, with the measuring function injected (tests pass a fake).

    Returns the points, the fit, the chosen tokens and the verified peak. The probe sizes are capped at
    `cap` (two distinct sizes are kept). On an out-of-memory error during verification the budget halves.
    """
    sizes = sorted({max(ROUND_TO, min(t, cap)) for t in probe_tokens} | {ROUND_TO})[-2:]
    points = [(t, int(peak_of(t))) for t in sizes]
    fit = fit_memory(points)
    tokens = choose_tokens(fit, limit_bytes, cap)
    for _ in range(max_checks):
        try:
            verified = int(peak_of(tokens))
        except BaseException as err:  # noqa: BLE001  (only out-of-memory is handled, the rest re-raised)
            if not is_oom(err) or tokens <= MIN_BUDGET:
                raise
            tokens = max(MIN_BUDGET, (tokens // 2 // ROUND_TO) * ROUND_TO)
            continue
        if verified <= limit_bytes or tokens <= MIN_BUDGET:
            break
        # Shrink by the overshoot measured at this size, as if memory per token were the whole peak.
        tokens = max(MIN_BUDGET, ((int(tokens * limit_bytes / verified) - ROUND_TO) // ROUND_TO) * ROUND_TO)
    else:
        raise RuntimeError(f"no micro-batch size verified to fit {limit_bytes / 2**30:.1f} GiB after {max_checks} "
                           "probes: set training.tokens_per_micro_batch to a number of tokens")
    return {"points": points, "fit": fit, "tokens": tokens, "verified_peak_bytes": verified}


def probe_batch(tokens: int, seq_len: int, vocab_size: int, seed: int = 0, with_lengths: bool = True) -> dict[str, Any]:
    """A packed row of `tokens` random tokens cut into samples of at most `seq_len`, as the trainer feeds
    (restarting position ids, `packed_seq_lengths` for Unsloth's varlen path, labels = inputs)."""
    from HyperSloth.collate import collate_packed

    rng = np.random.default_rng(seed)
    sizes = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    samples = [(ids, ids.copy()) for ids in (rng.integers(0, vocab_size, size=n) for n in sizes)]
    return collate_packed(samples, with_lengths=with_lengths)


def forward_backward(model, batch: dict[str, Any], num_items: int) -> None:
    """One training forward+backward of a probe batch, as the trainer runs a micro-batch; gradients
    accumulate in `.grad` (callers drop them with `release_memory`)."""
    loss = model(**batch, num_items_in_batch=num_items, use_cache=False).loss
    loss.backward()


def peak_of_forward_backward(model, seq_len: int, vocab_size: int, with_lengths: bool = True) -> PeakFn:
    """The measuring function for `measure`: one forward+backward of a probe row on the model's device,
    returning the peak allocated bytes; gradients are set back to None and the cache emptied after."""
    import torch

    device = next(model.parameters()).device

    def peak(tokens: int) -> int:
        batch = probe_batch(tokens, seq_len, vocab_size, with_lengths=with_lengths)
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

    from HyperSloth.model import release_checkpointing_buffers

    for p in model.parameters():
        p.grad = None
    if checkpointing_buffers:
        release_checkpointing_buffers()
    gc.collect()
    torch.cuda.empty_cache()


def measure_on_gpu(model, *, seq_len: int, vocab_size: int, cap: int, longest_sample: int,
                   gradient_checkpointing: bool | str, with_lengths: bool = True) -> BudgetDecision:
    """Run the probe on this process's GPU and return this rank's decision (before `agree_min`)."""
    import time

    import torch

    started = time.perf_counter()
    device = next(model.parameters()).device
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer_bytes = 3 * 4 * trainable  # AdamW's two fp32 moments + the fp32 gradient-sync buffer
    release_memory(model)
    free, total = torch.cuda.mem_get_info(device)
    limit = allocation_limit(total, free, torch.cuda.memory_reserved(device), optimizer_bytes)
    was_training = model.training
    model.train()
    try:
        result = measure(peak_of_forward_backward(model, seq_len, vocab_size, with_lengths), limit_bytes=limit, cap=cap,
                         is_oom=lambda e: isinstance(e, torch.cuda.OutOfMemoryError))
    finally:
        model.train(was_training)
        release_memory(model, checkpointing_buffers=bool(gradient_checkpointing))
        torch.cuda.reset_peak_memory_stats(device)  # the run's peak should be training's, not the probe's
    fit: MemoryFit = result["fit"]
    return BudgetDecision(
        tokens=result["tokens"], source="auto", local_tokens=result["tokens"], points=result["points"],
        fit=asdict(fit), limit_bytes=limit, total_bytes=int(total), safety_fraction=SAFETY_FRACTION,
        optimizer_bytes=optimizer_bytes, cap_tokens=cap, verified_peak_bytes=result["verified_peak_bytes"],
        longest_sample=longest_sample, gradient_checkpointing=gradient_checkpointing,
        probe_seconds=time.perf_counter() - started,
    )


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


def measure_auto(model, *, lengths: Sequence[int] | np.ndarray, samples_per_step: int,
                 gradient_checkpointing: bool | str, with_lengths: bool = True) -> BudgetDecision:
    """Measure on this rank's GPU and take the minimum over ranks (every rank must call it)."""
    longest = int(np.max(lengths))
    decision = measure_on_gpu(model, seq_len=longest, vocab_size=int(model.config.vocab_size),
                              cap=useful_cap(lengths, samples_per_step), longest_sample=longest,
                              gradient_checkpointing=gradient_checkpointing, with_lengths=with_lengths)
    decision.tokens = agree_min(decision.tokens)
    return decision


def settle(description, load: Callable[[Any], Any], lengths: Sequence[int] | np.ndarray):
    """Load the model and fix the run's micro-batch budget: (description with the budget, loaded model,
    decision). `load(gradient_checkpointing)` loads the model (None = as configured).

    An explicit budget, or "auto" on CPU, was already fixed by `HyperSloth.run`; "auto" on a GPU is
    measured here and agreed over ranks. If the longest sample does not fit one micro-batch without
    checkpointing, the model is loaded again with Unsloth's gradient checkpointing, the budget is
    measured again, and the description records checkpointing on.
    """
    from loguru import logger

    loaded = load(None)
    if not description.token_budget_auto:
        auto = description.hyper_config["training"]["tokens_per_micro_batch"] == "auto"
        return description, loaded, BudgetDecision(tokens=description.token_budget,
                                                   source="auto-cpu" if auto else "explicit")
    fast = description.hyper_config["fast_model_args"]
    unsloth = loaded.backend == "unsloth"

    def measure_model(model_loaded, gc_mode) -> BudgetDecision:
        return measure_auto(model_loaded.model, lengths=lengths, samples_per_step=description.global_batch_size,
                            gradient_checkpointing=gc_mode, with_lengths=unsloth)

    gc_mode = fast["use_gradient_checkpointing"]
    decision = measure_model(loaded, gc_mode)
    if not gc_mode and needs_checkpointing(decision.tokens, decision.longest_sample):
        gc_mode = "unsloth" if unsloth else True
        logger.warning(f"the longest sample ({decision.longest_sample:,} tokens) does not fit one micro-batch "
                       f"without gradient checkpointing (measured budget {decision.tokens:,} tokens): turning on "
                       f"gradient checkpointing ({gc_mode!r}) for this run")
        loaded = None  # drop the first model before loading the second
        gc.collect()
        _empty_cuda_cache()
        loaded = load(gc_mode)
        decision = measure_model(loaded, gc_mode)
        decision.checkpointing_switched_on = True
    hyper_config = {**description.hyper_config, "fast_model_args": {**fast, "use_gradient_checkpointing": gc_mode}}
    logger.info(decision.summary())
    if unsloth:  # Unsloth's pre-train detector sees the probe's backward and resets its compile cache (safe)
        logger.info("Unsloth will warn that a forward/backward ran before trainer.train(): that was this probe")
    settled = description.model_copy(update={"token_budget": decision.tokens, "hyper_config": hyper_config})
    return settled, loaded, decision


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
