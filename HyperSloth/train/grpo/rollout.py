"""GRPO's rollouts on one rank: sample each prompt's completions, score them, turn rewards into advantages.

Sampling: each prompt's `num_generations` completions are one `generate` call (HF's, with its KV cache) on
a batch of that one prompt repeated, so no padding; the random stream is a generator seeded by (seed,
step, prompt row) (`prompt_seed`), so the same step samples the same completions on 1 or N GPUs, whichever
rank holds the prompt, and the ranks' own streams (dropout) are left where they were. A completion ends
after its first end-of-sequence token (kept, as TRL keeps it) or at max_completion_length ("clipped").

Scoring: every reward function gets TRL's arguments, `f(prompts=..., completions=..., completion_ids=...,
trainer_state=..., **columns)` with one entry per completion (prompts and the dataset's other columns
repeated per completion; completions as text, or as `[{"role": "assistant", "content": text}]` for chat
prompts); None becomes NaN. A function that raises or returns the wrong number of rewards is reported as
`RewardFailure` (one line naming it), never a traceback.

Advantages: TRL 1.15's "sum_then_normalize": weighted sum over functions (nansum), minus the group mean,
divided by the group's (or the global batch's) std + 1e-4, NaN -> 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import GenerationConfig
from trl.trainer.utils import nanstd

from HyperSloth.config import ConfigError, GrpoArgs, reward_name


class RewardFailure(ConfigError):
    """A reward function that raised or returned the wrong number of rewards: a ConfigError, so the worker says
    it in one line, without a traceback, and stops (the user's code, like the config, is the user's to fix)."""


def prompt_seed(seed: int, step: int, row: int) -> int:
    """The sampling seed of one prompt at one optimizer step (independent of ranks)."""
    return int(np.random.SeedSequence([seed % 2**32, step, row]).generate_state(1)[0])


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's CPU (and this GPU's) random streams set to `seed` inside, restored after."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def generation_config(grpo: GrpoArgs, pad_token_id: int, eos_token_ids: list[int]) -> GenerationConfig:
    """HF `generate` settings of TRL's GRPO sampling (its defaults: no repetition penalty, no min_p), with
    the KV cache."""
    return GenerationConfig(do_sample=True, max_new_tokens=grpo.max_completion_length, temperature=grpo.temperature,
                            top_p=grpo.top_p, top_k=grpo.top_k, pad_token_id=pad_token_id,
                            eos_token_id=list(eos_token_ids), use_cache=True, disable_compile=True)


def eos_ids(model, tokenizer) -> list[int]:
    """Every token that ends a completion: the tokenizer's eos and the model's declared ones (TRL's rule)."""
    declared = model.generation_config.eos_token_id
    ids = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def cut_at_eos(tokens: np.ndarray, eos_token_ids: Sequence[int]) -> np.ndarray:
    """The completion up to and including its first end-of-sequence token (all of it when there is none)."""
    ends = np.flatnonzero(np.isin(tokens, list(eos_token_ids)))
    return tokens[: ends[0] + 1] if ends.size else tokens


@torch.no_grad()
def sample_group(model, prompt_ids: Sequence[int], num_generations: int, seed: int, config: GenerationConfig
                 ) -> list[np.ndarray]:
    """`num_generations` completions of one prompt, sampled with the generator seeded by `seed`."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)] * num_generations, dtype=torch.long, device=device)
    with seeded(seed):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out[:, ids.shape[1]:].cpu().numpy()
    return [cut_at_eos(row, config.eos_token_id) for row in tokens]


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

