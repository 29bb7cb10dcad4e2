"""GRPO's loss on generated completions: packed padding-free rows, per-token log-probs, TRL's clipped objective.

A completion is one segment of a packed row, prompt + completion, position ids restarting at 0 (the
DPO collator, `dpo.preference.collate_segments`): its targets are the completion's tokens, each with its
completion's advantage. The loss is TRL 1.15's (`GRPOTrainer._compute_loss`, loss types dapo / grpo /
dr_grpo, token-level importance sampling):

    ratio_t = exp(logp_t - old_t)                    (old = logp detached when num_iterations = 1)
    loss_t  = -min(ratio_t A, clip(ratio_t, 1 - eps, 1 + eps_high) A) + beta KL_t
    KL_t    = (exp(ref_t - logp_t) - (ref_t - logp_t) - 1) ratio_t     (TRL's use_bias_correction_kl, its default)

summed over the step's targets with a weight and divided by one number for the whole global batch, so
N ranks sum to what one process computes on all of it (`Normaliser`): dapo, every completion token of
the global batch; grpo, each completion's tokens averaged, then over the global batch's completions;
dr_grpo, the global batch's completions x max_completion_length. The log-probabilities use the sampling
temperature, as TRL's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from HyperSloth.config import GrpoArgs
from HyperSloth.train.collate import IGNORE_INDEX
from HyperSloth.train.dpo.preference import collate_segments

# Per-step sums that travel with the loss in the gradient all-reduce (means: / the step's completion tokens).
LOSS_SUM_KEYS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclass(frozen=True)
class Completion:
    """One sampled completion, ready to train on: its prompt's and its own tokens, and its advantage."""

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    advantage: float


def normaliser(grpo: GrpoArgs, completions: int, tokens: int) -> tuple[float, str]:
    """(the step's loss denominator, the per-token weight rule) for the global batch's `completions` and
    completion `tokens` (module docstring)."""
    if grpo.loss_type == "dapo":
        return float(max(tokens, 1)), "one"
    if grpo.loss_type == "grpo":
        return float(max(completions, 1)), "per_completion"
    return float(max(completions, 1) * grpo.max_completion_length), "one"


def pack_completions(completions: Sequence[Completion], token_budget: int) -> list[list[int]]:
    """Completions (by index, in order) into micro-batches of at most `token_budget` tokens; one longer
    than the budget alone."""
    batches: list[list[int]] = []
    used = token_budget + 1
    for k, item in enumerate(completions):
        tokens = len(item.prompt_ids) + len(item.completion_ids)
        if used + tokens > token_budget:
            batches.append([])
            used = 0
        batches[-1].append(k)
        used += tokens
    return batches


def collate_completions(completions: Sequence[Completion], weight_rule: str, *, pad_token_id: int = 0,
                        with_lengths: bool = False, bucket: bool = False, bucket_limit: int | None = None
                        ) -> dict[str, torch.Tensor]:
    """One packed row of the completions and, per target, its advantage and weight."""
    segments = []
    for item in completions:
        prompt = np.asarray(item.prompt_ids, dtype=np.int64)
        completion = np.asarray(item.completion_ids, dtype=np.int64)
        labels = np.concatenate([np.full(len(prompt), IGNORE_INDEX, dtype=np.int64), completion])
        segments.append((np.concatenate([prompt, completion]), labels))
    batch = collate_segments(segments, pad_token_id=pad_token_id, with_lengths=with_lengths, bucket=bucket,
                             bucket_limit=bucket_limit)
    segment = batch["target_segment"].numpy()
    advantages = np.array([c.advantage for c in completions], dtype=np.float32)
    lengths = np.array([len(c.completion_ids) for c in completions], dtype=np.float32)
    weights = 1.0 / lengths if weight_rule == "per_completion" else np.ones_like(lengths)
    batch["target_advantage"] = torch.from_numpy(advantages[segment])
    batch["target_weight"] = torch.from_numpy(weights[segment].astype(np.float32))
    return batch


def grpo_token_loss(logps: torch.Tensor, advantages: torch.Tensor, grpo: GrpoArgs, old: torch.Tensor | None = None,
                    ref: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, detached per-token [kl, low clipped, high clipped, region clipped]) (module docstring)."""
    old = logps.detach() if old is None else old
    ratio = torch.exp(logps - old)
    high = grpo.epsilon_high if grpo.epsilon_high is not None else grpo.epsilon
    clipped = torch.clamp(ratio, 1 - grpo.epsilon, 1 + high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    kl = torch.zeros_like(logps)
    if grpo.beta != 0.0 and ref is not None:
        # TRL's use_bias_correction_kl (default True): the KL times the ratio, whose value is 1 on-policy but whose
        # gradient makes the KL's the unbiased reverse-KL gradient (DeepSeek-V3.2).
        kl = (torch.exp(ref - logps) - (ref - logps) - 1) * ratio
        loss = loss + grpo.beta * kl
    with torch.no_grad():
        low_clip = ((ratio < 1 - grpo.epsilon) & (advantages < 0)).float()
        high_clip = ((ratio > 1 + high) & (advantages > 0)).float()
        stats = torch.stack([kl.detach(), low_clip, high_clip, torch.maximum(low_clip, high_clip)])
    return loss, stats


def micro_batch_loss(logps: torch.Tensor, batch: dict[str, torch.Tensor], grpo: GrpoArgs, denominator: float,
                     old: torch.Tensor | None = None, ref: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the micro-batch's share of the step loss, its sums in `LOSS_SUM_KEYS` order over its targets)."""
    loss, stats = grpo_token_loss(logps, batch["target_advantage"].to(logps.dtype), grpo, old, ref)
    share = (loss * batch["target_weight"].to(loss.dtype)).sum() / denominator
    return share, stats.sum(dim=1)
