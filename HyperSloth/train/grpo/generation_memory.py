"""How many of a rank's prompts one HF `generate` call may sample: its KV cache and logits, bounded by free memory.

With `generation_batch="rank"` a rank samples all its prompts x num_generations rows at once. That memory is not
training's (the automatic budget measures a forward+backward only) and it grows with the rank's batch: Qwen3-8B,
32 prompts x 8 generations x 512 tokens hold a 19 GB KV cache. So before each sampling the prompts are cut into
consecutive chunks of WHOLE prompts (a prompt's generations share its seeded generator and its group, so they
stay in one call; the completions are those of one call, up to padding: `rollout.sample_chunks`), each chunk
within the memory the GPU has at that moment. One call when everything fits, as before.

What a generated row costs (`RowCost`, from the model's text config and dtype; an estimate from above):
- the KV cache: 2 (key, value) x the sum over layers of kv heads x head_dim x dtype bytes per token, over the
  chunk's longest prompt (rows are left-padded to it) + max_completion_length tokens, at the end of the call;
- the prefill, at the start: the prompt's KV cache, plus one layer's MLP at work (gate, up and their product,
  3 x intermediate_size, and two hidden-size copies) per prompt token. A row costs the larger of the two;
- the logits of a step: `LOGIT_COPIES` fp32 vectors of the vocabulary (generate's fp32 copy, then
  SeededSampler's scaled, sorted, filtered and noise tensors, counted by reading them), held with either peak.

The limit (`generation_limit`): what torch can allocate now, the GPU's free memory (`torch.cuda.mem_get_info`)
plus what torch's caching allocator holds unused (reserved - allocated: training's freed activations, reused at
once), less the budget's safety fraction of the GPU (budget/choice.py, 8%: allocator fragmentation, as the cache
grows one token per step, and what the estimate leaves out, such as attention's workspace). Measured at every
sampling, so it follows what training leaves resident. On CPU there is no limit unless one is given: the tiny CPU
runs never need one and host memory is the system's to manage.

A prompt whose rows alone exceed the limit is sampled alone anyway, with a warning saying what to change: the
margin is wide, so refusing would stop runs that fit; if it does not fit, CUDA's out-of-memory error follows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from loguru import logger

from HyperSloth.config import GrpoArgs
from HyperSloth.train.budget.choice import SAFETY_FRACTION
from HyperSloth.train.model_config import layer_attention_heads, text_config

LOGIT_COPIES = 10  # fp32 vocabulary vectors live per row at a sampling step (module docstring)
GIB = 2**30


@dataclass(frozen=True)
class RowCost:
    """Bytes one generated row holds, by part (module docstring)."""

    kv_per_token: int
    prefill_per_token: int  # on top of the KV cache, per prompt token, while the prompt goes through a layer
    logits: int

    def row_bytes(self, width: int, max_completion_length: int) -> int:
        """The peak of one row left-padded to `width` prompt tokens: the larger of the prefill and the full cache."""
        end = self.kv_per_token * (width + max_completion_length)
        prefill = (self.kv_per_token + self.prefill_per_token) * width
        return max(end, prefill) + self.logits


def row_cost(config: Any, dtype_bytes: int) -> RowCost | None:
    """The cost of a row of this model (its text config) in a dtype of `dtype_bytes`; None when the config does not
    say its layers, attention heads and hidden size."""
    text = text_config(config)
    layers, heads, hidden = (getattr(text, k, None) for k in ("num_hidden_layers", "num_attention_heads",
                                                              "hidden_size"))
    if not all(isinstance(v, int) and v > 0 for v in (layers, heads, hidden)):
        return None
    kv_width = sum(kv_heads * head_dim for _, kv_heads, head_dim in layer_attention_heads(config))
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    return RowCost(kv_per_token=2 * kv_width * dtype_bytes,
                   prefill_per_token=(3 * intermediate + 2 * hidden) * dtype_bytes,
                   logits=LOGIT_COPIES * 4 * int(getattr(text, "vocab_size", 0) or 0))


def generation_limit(free: int, total: int, reserved: int, allocated: int,
                     safety_fraction: float = SAFETY_FRACTION) -> int:
    """Bytes a generate call may take: free on the GPU + held idle by torch's cache - the safety fraction of the GPU."""
    return int(free + max(0, reserved - allocated) - safety_fraction * total)


def measured_limit(device: torch.device) -> int | None:
    """`generation_limit` of this process's GPU now; None (no limit) off CUDA."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return generation_limit(free, total, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))


@dataclass(frozen=True)
class GenerationSplit:
    """Consecutive chunks of whole prompts (`chunks`, ranges of prompt indices), one generate call each."""

    chunks: list[range]
    prompts: int
    total_bytes: int  # of one call over every prompt
    limit_bytes: int | None
    over_limit: list[int] = field(default_factory=list)  # prompts whose rows alone exceed the limit (sampled alone)


def split_prompts(lengths: Sequence[int], num_generations: int, max_completion_length: int, cost: RowCost,
                  limit_bytes: int | None) -> GenerationSplit:
    """Greedy, in order: a chunk takes the next prompt while all its rows, padded to its longest prompt, fit
    `limit_bytes`; a prompt that cannot fit even alone gets a chunk of its own. No limit: one chunk."""
    def chunk_bytes(count: int, width: int) -> int:
        return count * num_generations * cost.row_bytes(width, max_completion_length)

    n = len(lengths)
    total = chunk_bytes(n, max(lengths, default=0))
    if limit_bytes is None or n == 0 or total <= limit_bytes:
        return GenerationSplit([range(n)] if n else [], n, total, limit_bytes)
    chunks, start, width = [], 0, 0
    for k, length in enumerate(lengths):
        if k > start and chunk_bytes(k + 1 - start, max(width, length)) > limit_bytes:
            chunks.append(range(start, k))
            start, width = k, 0
        width = max(width, length)
    chunks.append(range(start, n))
    over = [c.start for c in chunks if len(c) == 1 and chunk_bytes(1, lengths[c.start]) > limit_bytes]
    return GenerationSplit(chunks, n, total, limit_bytes, over)


def split_message(split: GenerationSplit, num_generations: int) -> str:
    """The log line of a split: how many calls and why."""
    largest = max(len(c) for c in split.chunks)
    return (f"generation split into {len(split.chunks)} generate calls of at most {largest} whole prompts: "
            f"{split.prompts} prompts x {num_generations} generations need ~{split.total_bytes / GIB:.1f} GiB of KV "
            f"cache and logits in one call, {split.limit_bytes / GIB:.1f} GiB are free for it (GPU free memory + "
            f"torch's idle cache - {SAFETY_FRACTION:.0%} of the GPU); said again only if a step needs more calls")


def over_limit_message(split: GenerationSplit, lengths: Sequence[int], grpo: GrpoArgs, cost: RowCost) -> str:
    """The warning for prompts too large to generate within the limit even alone."""
    k = split.over_limit[0]
    need = grpo.num_generations * cost.row_bytes(lengths[k], grpo.max_completion_length)
    return (f"{len(split.over_limit)} prompt(s) need more generation memory than is free even alone (a "
            f"{lengths[k]}-token prompt x {grpo.num_generations} generations: ~{need / GIB:.1f} GiB, "
            f"{split.limit_bytes / GIB:.1f} GiB free); sampled alone anyway, this may run out of GPU memory: lower "
            f"grpo.max_completion_length or grpo.num_generations, or use shorter prompts")


class GenerationMemory:
    """One trainer's bound on generation: the row cost (read from the model at the first sampling), the chunks of
    each sampling, and its log lines (a split when a step needs more calls than any before, a prompt over the
    limit once per run). `limit` reads the bytes available on a device (`measured_limit`; tests give a number)."""

    def __init__(self, grpo: GrpoArgs, limit: Callable[[torch.device], int | None] = measured_limit):
        self.grpo = grpo
        self.limit = limit
        self._cost: RowCost | None = None
        self._most_calls = 1
        self._warned = False

    def cost(self, model) -> RowCost | None:
        if self._cost is None:
            dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
            self._cost = row_cost(model.config, dtype.itemsize)
        return self._cost

    def chunks(self, model, lengths: Sequence[int]) -> list[range]:
        """Consecutive ranges of the prompts (by index), one generate call each."""
        cost = self.cost(model)
        limit = self.limit(next(model.parameters()).device) if cost is not None else None
        if cost is None or limit is None:
            return [range(len(lengths))] if lengths else []
        split = split_prompts(lengths, self.grpo.num_generations, self.grpo.max_completion_length, cost, limit)
        if len(split.chunks) > self._most_calls:
            self._most_calls = len(split.chunks)
            logger.info(split_message(split, self.grpo.num_generations))
        if split.over_limit and not self._warned:
            self._warned = True
            logger.warning(over_limit_message(split, lengths, self.grpo, cost))
        return split.chunks
