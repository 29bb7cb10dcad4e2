"""GRPO's rollouts on one rank: sample each prompt's completions, score them, turn rewards into advantages.

Sampling: the model switched to sampling for the call (`sampling_mode`: eval mode on transformers; on Unsloth what
Unsloth's own GRPO does, its fused one-token decode replayed as CUDA graphs), then one HF `generate` call (KV
cache) per rank and step over all its prompts, each repeated `num_generations` times and left-padded
(`sample_groups`; TRL's layout), split into calls over consecutive whole prompts when their KV cache would not fit
the GPU's free memory (`sample_chunks`, generation_memory.py), or with `GrpoArgs.generation_batch="prompt"` one
call per prompt (no padding). Tokens are drawn by `SeededSampler`, a logits processor that does the sampling itself
(temperature, top-k, top-p, then Gumbel-max: exactly a draw from the filtered softmax) with noise from a generator
per prompt seeded by (seed, step, prompt row) (`prompt_seed`), so a prompt's completions do not depend on which
rank holds it or what else is in the batch: 1 and N GPUs sample the same completions (per prompt: bit for bit;
batched: up to the rounding that a different padding and batch shape can bring to the logits, which can flip a
token on a GPU in bf16, rarely), and the ranks' own streams (dropout) are untouched. A completion ends after its
first end-of-sequence token (kept, as TRL keeps it) or at max_completion_length ("clipped").

Scoring: every reward function gets TRL's arguments, `f(prompts=..., completions=..., completion_ids=...,
trainer_state=..., **columns)` with one entry per completion (prompts and the dataset's other columns
repeated per completion; completions as text, or as `[{"role": "assistant", "content": text}]` for chat
prompts); None becomes NaN. A function that raises or returns the wrong number of rewards is reported as
`RewardFailure` (one line naming it), never a traceback.

Advantages: TRL 1.15's "sum_then_normalize": weighted sum over functions (nansum), minus the group mean,
divided by the group's (or the global batch's) std + 1e-4, NaN -> 0.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from loguru import logger
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from trl.trainer.utils import nanstd

from HyperSloth.config import ConfigError, GrpoArgs, reward_name


class RewardFailure(ConfigError):
    """A reward function that raised or returned the wrong number of rewards: a ConfigError, so the worker says
    it in one line, without a traceback, and stops (the user's code, like the config, is the user's to fix)."""


def prompt_seed(seed: int, step: int, row: int) -> int:
    """The sampling seed of one prompt at one optimizer step (independent of ranks)."""
    return int(np.random.SeedSequence([seed % 2**32, step, row]).generate_state(1)[0])


def generation_config(grpo: GrpoArgs, pad_token_id: int, eos_token_ids: list[int]) -> GenerationConfig:
    """HF `generate` settings: greedy over `SeededSampler`'s output (which holds the sampling: TRL's defaults,
    no repetition penalty, no min_p), with the KV cache."""
    return GenerationConfig(do_sample=False, max_new_tokens=grpo.max_completion_length, pad_token_id=pad_token_id,
                            eos_token_id=list(eos_token_ids), use_cache=True, disable_compile=True,
                            temperature=None, top_p=None, top_k=None)


class SeededSampler(LogitsProcessor):
    """Sampling inside a logits processor: the scores / temperature, top-k and top-p filtered (HF's rules), plus
    Gumbel noise drawn from each prompt's own generator (rows come in groups of `group_size`, one per prompt);
    returns 0 at the argmax and -inf elsewhere, so HF's greedy step takes that token. argmax(scores + Gumbel) is
    a draw from softmax(scores)."""

    def __init__(self, generators: Sequence[torch.Generator], group_size: int, grpo: GrpoArgs):
        self.generators = list(generators)
        self.group_size = group_size
        self.temperature, self.top_k, self.top_p = grpo.temperature, grpo.top_k, grpo.top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.float() / self.temperature
        if self.top_k and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=False)
            drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - self.top_p
            drop[:, -1] = False  # the most likely token always stays
            scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        noise = torch.cat([torch.rand((self.group_size, scores.shape[-1]), generator=g, device=scores.device)
                           for g in self.generators])
        choice = (scores - torch.log(-torch.log(noise.clamp_min(1e-12)))).argmax(dim=-1)
        return torch.full_like(scores, float("-inf")).scatter_(1, choice[:, None], 0.0)


def eos_ids(model, tokenizer) -> list[int]:
    """Every token that ends a completion: the tokenizer's eos and the model's declared ones (TRL's rule)."""
    declared = model.generation_config.eos_token_id
    ids = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def cut_at_eos(tokens: np.ndarray, eos_token_ids: Sequence[int]) -> np.ndarray:
    """The completion up to and including its first end-of-sequence token (all of it when there is none)."""
    ends = np.flatnonzero(np.isin(tokens, list(eos_token_ids)))
    return tokens[: ends[0] + 1] if ends.size else tokens


@contextmanager
def deferred_stop_check(device: torch.device) -> Iterator[None]:
    """On a GPU, HF `generate` reads its stop decision one token step late, so the host queues the next step while
    the GPU runs this one. Its loop otherwise syncs on `unfinished_sequences.max() == 0` after every token step;
    transformers 5.17 has the deferred check (`DeferredStopCheck`) but turns it on for MPS only. Measured on one
    H200 (docs/grpo.md, 2026-12-05): Unsloth's decode 21.8 -> 20.1 ms per token step, the same completions. The check
    is deferred only where `generate` returns no cache (the one extra step it runs after the last sequence ended is
    then undone by dropping its tokens). On the CPU (no device events to wait on) nothing changes."""
    from transformers.generation import utils

    check = getattr(utils, "DeferredStopCheck", None)
    if device.type != "cuda" or check is None:
        yield
        return
    original = check.__dict__["is_supported"]
    check.is_supported = staticmethod(
        lambda device, cache, cache_is_returned, is_assistant: not cache_is_returned and not is_assistant)
    try:
        yield
    finally:
        check.is_supported = original


@torch.no_grad()
def sample_groups(model, prompts: Sequence[Sequence[int]], seeds: Sequence[int], grpo: GrpoArgs,
                  config: GenerationConfig, width_multiple: int = 1, defer_stop: bool = True) -> list[list[np.ndarray]]:
    """`num_generations` completions of each prompt in one `generate` call (left-padded, to a multiple of
    `width_multiple` tokens: a static KV cache then keeps few shapes), each prompt's drawn with the generator
    seeded by its seed (`SeededSampler`); on a GPU with the stop check a token step late (`deferred_stop_check`,
    unless `defer_stop` is False)."""
    if not prompts:
        return []
    device = next(model.parameters()).device
    g = grpo.num_generations
    width = -(-max(len(p) for p in prompts) // width_multiple) * width_multiple
    rows = [list(p) for p in prompts for _ in range(g)]
    ids = torch.full((len(rows), width), config.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for k, row in enumerate(rows):
        ids[k, width - len(row):] = torch.tensor(row)
        mask[k, width - len(row):] = 1
    generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    sampler = SeededSampler(generators, g, grpo)
    with deferred_stop_check(device) if defer_stop else nullcontext():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                             logits_processor=LogitsProcessorList([sampler]))
    tokens = out[:, width:].cpu().numpy()
    return [[cut_at_eos(tokens[k * g + j], config.eos_token_id) for j in range(g)] for k in range(len(prompts))]


def sample_chunks(model, prompts: Sequence[Sequence[int]], seeds: Sequence[int], grpo: GrpoArgs,
                  config: GenerationConfig, chunks: Sequence[range]) -> list[list[np.ndarray]]:
    """`sample_groups` once per chunk of whole prompts (`generation_memory.split_prompts`), the groups in prompt
    order: every prompt keeps its own generator, so the completions are those of one call over all prompts (bit for
    bit when the prompts are as long as each other; otherwise up to what a different padding does to the logits)."""
    return [group for chunk in chunks
            for group in sample_groups(model, prompts[chunk.start:chunk.stop], seeds[chunk.start:chunk.stop], grpo,
                                       config)]


_REPORTED: weakref.WeakSet = weakref.WeakSet()  # models whose first sampling has logged decode_graph_line


def decode_graph_line(stats: list[dict[str, Any]]) -> str:
    """One line on Unsloth's CUDA-graph decode in a sampling (its `_decode_graphs.stats` of each model that ran
    it): how many token steps replayed graphs and how many ran eagerly (the first after each prefill does), or
    the reason it turned itself off."""
    if not stats:
        return "sampling: Unsloth's CUDA-graph decode did not run (its decode path was not taken)"
    replays = sum(st.get("replays", 0) for st in stats)
    eager = sum(st.get("eager_steps", 0) for st in stats)
    off = sorted({str(st["disabled"]) for st in stats if st.get("disabled")})
    line = (f"sampling: {replays:,} of {replays + eager:,} token steps replayed from Unsloth's CUDA-graph decode "
            f"(graph captures: {sum(st.get('captures', 0) for st in stats):,})")
    return line + (f"; graph decode off: {', '.join(off)}" if off else "")


@contextmanager
def sampling_mode(model, backend: str) -> Iterator[None]:
    """The model set up to sample inside the block, and back to how it trained after it.

    transformers: eval mode (no dropout; `generate` keeps the KV cache). Unsloth: what Unsloth's own GRPO does
    around every rollout (`unsloth/models/rl.py`, `unsloth_unwrap_model_for_generation`, 2026.10.9):
    `FastLanguageModel.for_inference` (eval mode and `_flag_for_generation`, which sends a step with a KV cache
    through Unsloth's fused one-token decode instead of the training forward), its CUDA-graph decode
    (`_decode_graphs.rl_generation`; skipped where this Unsloth lacks it), then the decode buffers freed for the
    backward (`release_for_training`) and `FastLanguageModel.for_training`. Measured on one H200 (docs/grpo.md):
    eval mode alone left the Unsloth backend decoding on the training forward, ~45 ms per token for 64 rows of
    Qwen3-0.6B. `for_training` decides gradient checkpointing by its own rule, so every module's flag is put back
    as it was before sampling (the automatic budget chose it). The first sampling of a run logs how many token
    steps replayed Unsloth's decode graphs, or why they were off (`decode_graph_line`)."""
    was_training = model.training
    if backend != "unsloth":
        model.eval()
        try:
            yield
        finally:
            model.train(was_training)
        return
    from unsloth import FastLanguageModel
    try:
        from unsloth.models import _decode_graphs
    except ImportError:  # an Unsloth without CUDA-graph decode: its fused decode path alone
        _decode_graphs = None
    flags = {m: m.__dict__["gradient_checkpointing"] for m in model.modules() if "gradient_checkpointing" in m.__dict__}
    FastLanguageModel.for_inference(model)
    try:
        with _decode_graphs.rl_generation() if _decode_graphs is not None else nullcontext():
            yield
    finally:
        if _decode_graphs is not None:
            if model not in _REPORTED:
                _REPORTED.add(model)
                logger.info(decode_graph_line([_decode_graphs.stats(m) for m in model.modules()
                                               if "_unsloth_decode_graphs" in m.__dict__]))
            _decode_graphs.release_for_training(model)
        FastLanguageModel.for_training(model, use_gradient_checkpointing=next((v for v in flags.values() if v), False))
        for module in model.modules():
            if module in flags:
                module.gradient_checkpointing = flags[module]
            elif "gradient_checkpointing" in module.__dict__:
                del module.gradient_checkpointing  # the class's own default, as before
        model.train(was_training)


def completion_texts(tokenizer, completions: Sequence[np.ndarray], conversational: bool) -> list[Any]:
    """Decoded completions as TRL hands them to reward functions (text, or one assistant message)."""
    texts = tokenizer.batch_decode([c.tolist() for c in completions], skip_special_tokens=True)
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts


@dataclass
class Scored:
    """This rank's completions with their rewards: `per_func` [completions, functions] (NaN where None)."""

    per_func: np.ndarray
    weighted: np.ndarray  # [completions]: weighted sum over functions (NaN where every function gave None)


def score(funcs: Sequence[Callable[..., Any]], weights: Sequence[float] | None, *, prompts: list[Any],
          completions: list[Any], completion_ids: list[list[int]], columns: list[dict[str, Any]], step: int,
          trainer_state: Any = None) -> Scored:
    """Every reward function on this rank's completions (module docstring); RewardFailure naming the one
    that raised or returned the wrong count, and the step."""
    keys = sorted({k for row in columns for k in row})
    kwargs = {k: [row.get(k) for row in columns] for k in keys}
    per_func = np.full((len(completions), len(funcs)), np.nan, dtype=np.float32)
    for j, func in enumerate(funcs):
        name = reward_name(func)
        try:
            values = func(prompts=prompts, completions=completions, completion_ids=completion_ids,
                          trainer_state=trainer_state, **kwargs)
            values = [np.nan if v is None else float(v) for v in values]
        except Exception as err:  # user code: any error, one line
            raise RewardFailure(f"reward function {name!r} raised {type(err).__name__} at step {step}: "
                                f"{str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")) from None
        if len(values) != len(completions):
            raise RewardFailure(f"reward function {name!r} returned {len(values)} rewards for {len(completions)} "
                                f"completions at step {step}: return one reward per completion")
        per_func[:, j] = values
    w = np.ones(len(funcs), dtype=np.float32) if weights is None else np.asarray(weights, dtype=np.float32)
    weighted = np.nansum(per_func * w[None, :], axis=1).astype(np.float32)
    weighted[np.isnan(per_func).all(axis=1)] = np.nan
    return Scored(per_func, weighted)


def advantages(rewards: np.ndarray, num_generations: int, scale: str, batch_std: float | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, per-group 'std is zero' flags) of rewards grouped by prompt, in TRL's float32 arithmetic
    ('batch': `batch_std`, the global batch's std, computed over all ranks by the caller)."""
    groups = torch.from_numpy(rewards.astype(np.float32)).view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1, keepdim=True)
    std = nanstd(groups, dim=1).unsqueeze(1)
    if scale == "batch":
        std = torch.full_like(std, float(batch_std or 0.0))
    centred = groups - mean
    if scale != "none":
        centred = centred / (std + 1e-4)
    zero = torch.isclose(std, torch.zeros_like(std)).squeeze(1)
    return torch.nan_to_num(centred, nan=0.0).view(-1).numpy(), zero.numpy()

