"""The automatic budget's arithmetic (budget.py's module docstring, steps 2 and 3): the memory line through the
probe points (`fit_memory`), the allocation limit, the largest budget the line allows, and the whole sequence
probe, fit, choose, verify (`measure`) with the measuring function injected, so every decision runs in tests
on fake peaks. `BudgetDecision` is the record of a decision (logged, written into run_resolved.json). No torch:
the measuring on a GPU is budget_probe.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from HyperSloth.train.model_config import text_config

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


def longest_does_not_fit(budget_tokens: int, longest_sample: int) -> bool:
    """True when the longest sample alone exceeds what fits in one micro-batch: checkpointing goes on, or
    with it on, Unsloth's tiled MLP."""
    return longest_sample > budget_tokens


def _text_shape(config: Any, *names: str) -> tuple[int, ...] | None:
    """The named sizes of the config's text model (a multimodal config's text part), None if one is missing."""
    text = text_config(config)
    shape = tuple(getattr(text, name, None) for name in names)
    return shape if all(isinstance(value, int) and value > 0 for value in shape) else None


def activation_floor_bytes(config: Any, tokens: int, bytes_per_value: int = 2) -> int | None:
    """A lower bound on what the forward of `tokens` tokens keeps for the backward without checkpointing:
    every decoder layer's input and its MLP's gate and up outputs (what Unsloth's and PEFT's SwiGLU MLP save
    at the least), in 16-bit. Attention, norms, logits and the weights come on top, so the real peak is
    higher (Qwen3-8B: 2.06 MB per token here against 4.2 MB measured). None when the config lacks a shape."""
    shape = _text_shape(config, "num_hidden_layers", "hidden_size", "intermediate_size")
    if shape is None:
        return None
    layers, hidden, intermediate = shape
    return int(tokens) * layers * (hidden + 2 * intermediate) * bytes_per_value


def pinned_block_bytes(nbytes: int) -> int:
    """The bytes torch's caching host allocator pins for a request of `nbytes`: it rounds every pinned block up
    to a power of two (aten/src/ATen/core/CachingHostAllocator.h, torch 2.6-2.13)."""
    return 1 << (int(nbytes) - 1).bit_length() if nbytes > 0 else 0


def offload_host_bytes(config: Any, tokens: int) -> int | None:
    """Host bytes Unsloth's offloaded checkpointing holds for a micro-batch of `tokens`: every decoder layer's
    input (hidden_size x 2 bytes per token, bf16/fp16), kept until the backward reads it, each in its own
    pinned block (a power of two: 282,000 tokens of Qwen3-8B take 4 GiB per layer, not 2.15). None when the
    config does not say its shape."""
    shape = _text_shape(config, "num_hidden_layers", "hidden_size")
    if shape is None:
        return None
    layers, hidden = shape
    return layers * pinned_block_bytes(hidden * 2 * int(tokens))


def host_token_cap(config: Any, host_bytes: float) -> int | None:
    """The largest micro-batch (tokens, a multiple of 256) whose offloaded checkpoints (`offload_host_bytes`)
    fit in `host_bytes`; None when the config does not say its shape."""
    shape = _text_shape(config, "num_hidden_layers", "hidden_size")
    if shape is None:
        return None
    layers, hidden = shape
    per_layer = int(host_bytes // layers)
    if per_layer < hidden * 2 * ROUND_TO:
        return 0
    block = 1 << (per_layer.bit_length() - 1)  # the largest power of two a layer's input may take
    return block // (hidden * 2) // ROUND_TO * ROUND_TO


def shape_needs_checkpointing(config: Any, heaviest_tokens: int, total_bytes: int,
                              safety_fraction: float = SAFETY_FRACTION) -> bool:
    """True when the heaviest micro-batch's activations alone exceed the whole GPU (less the safety share),
    so no probe is needed to know that checkpointing must be on (and no second load of the model)."""
    floor = activation_floor_bytes(config, heaviest_tokens)
    return floor is not None and floor > total_bytes * (1 - safety_fraction)


@dataclass
class BudgetDecision:
    """The chosen budget and everything it was chosen from (logged and written with the run's settings)."""

    tokens: int
    source: str  # "auto" (measured), "auto-cpu" (fixed CPU value) or "explicit"
    checkpointing_switched_on: bool = False  # the longest sample did not fit without checkpointing
    tiled_mlp: bool = False  # measured with Unsloth's tiled MLP
    tiled_mlp_switched_on: bool = False  # the longest sample did not fit with checkpointing alone
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
    host_cap_tokens: int | None = None  # the budget lowered to this so offloaded checkpoints fit host memory

    def as_record(self) -> dict[str, Any]:
        return asdict(self)

    def probe_line(self) -> str:
        """One log line: was the probe measured or cached, what it ran and what it cost."""
        reload = f", model reloaded in {self.reload_seconds:.1f} s" if self.reload_seconds else ""
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
        if self.host_cap_tokens is not None:
            parts.append(f"lowered to {self.host_cap_tokens:,} so that Unsloth's offloaded checkpoints fit host memory")
        parts.append(f"cap {self.cap_tokens}, longest sample {self.longest_sample}, "
                     f"gradient checkpointing {self.gradient_checkpointing!r}"
                     + (" (switched on: the longest sample did not fit without)" if self.checkpointing_switched_on else "")
                     + (", tiled MLP" + (" (switched on: the longest sample did not fit with checkpointing alone)"
                                         if self.tiled_mlp_switched_on else "") if self.tiled_mlp else ""))
        return "; ".join(parts)


# ---------------------------------------------------------------- probe, fit, choose, verify (measuring injected)


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
            must_fit: int | None = None, can_switch: bool = True, verify_at_most: int | None = None,
            tiled_mlp: bool | None = None) -> dict[str, Any]:
    """Probe, fit, choose and verify, with the measuring function injected (tests pass a fake).

    Returns the points, the fit the budget was chosen on, the tokens, and the verified size and peak
    (None when unverified). `must_fit` (the longest sample): when the line leaves fewer tokens than this,
    return unverified if the caller `can_switch` (checkpointing on); else run one pass at it, the row the
    run cannot do without, and take it as the budget if it fits (RuntimeError saying what to change if
    not; `tiled_mlp`: whether the model ran Unsloth's tiled MLP, None where there is none, for that message).
    `verify_at_most`: the largest verifying pass (None: at the budget,
    whatever its size); a larger budget is extrapolated from a pass at this size (module docstring, 3).
    """
    points = [(t, int(peak_of(t))) for t in probe_sizes(cap, probe_tokens)]
    fit = fit_memory(points)
    tokens = choose_tokens(fit, limit_bytes, cap)
    result = {"points": points, "fit": fit, "tokens": tokens, "verified_tokens": None, "verified_peak_bytes": None}
    if must_fit is not None and tokens < must_fit:
        return result if can_switch else {**result, **_prove_longest(peak_of, must_fit, tokens, limit_bytes, is_oom,
                                                                     tiled_mlp)}
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
                   is_oom: Callable[[BaseException], bool], tiled_mlp: bool | None = None) -> dict[str, Any]:
    """One pass at the longest sample (rounded up to `ROUND_TO`); its size as the budget if it fits."""
    size = -(-longest // ROUND_TO) * ROUND_TO
    peak = _peak_or_none(peak_of, size, is_oom)
    if peak is not None and peak <= limit_bytes:
        return {"tokens": size, "verified_tokens": size, "verified_peak_bytes": peak}
    seen = "ran out of memory" if peak is None else f"peaked at {peak / 2**30:.1f} GiB"
    savers = "gradient checkpointing and Unsloth's tiled MLP" if tiled_mlp else "gradient checkpointing"
    raise RuntimeError(
        f"the heaviest micro-batch ({longest:,} tokens: the longest sample, or with sorted-pad the per-device batch "
        f"of the longest samples) does not fit on this GPU even with {savers}: its forward+backward "
        f"{seen}, and {limit_bytes / 2**30:.1f} GiB may be used (the measured line allows about {line_tokens:,} "
        f"tokens). Drop the longer samples (rebuild the dataset with --max_seq_length {line_tokens}), lower "
        "per_device_train_batch_size (sorted-pad), "
        + ("set fast_model_args.tiled_mlp='auto' (the default: Unsloth's tiled MLP, less memory per token), "
           if tiled_mlp is False else "")
        + "or train on a GPU with more memory")
