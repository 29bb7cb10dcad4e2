"""Preference pairs -> packed model inputs -> per-sequence log-probabilities -> the DPO loss.

A pair (prompt, chosen, rejected) becomes two padding-free segments of one packed row, prompt+chosen
then prompt+rejected, each with position ids restarting at 0 (the same block-diagonal layout as SFT's
packed path, `collate.collate_packed`), so no segment sees another. The targets are the completion
tokens (never a prompt token, never a segment's first token); the collator lists them on the host:
`target_index` (the position whose hidden state predicts the target: one before it), `target_ids` and
`target_segment` (2i for the chosen and 2i+1 for the rejected sequence of the micro-batch's i-th pair), so
selecting them on the GPU needs no device-to-host sync (a boolean mask would).

Log-probabilities are taken only at target positions, in chunks of `LOGP_CHUNK_TOKENS` positions whose
[chunk, vocab] logits are recomputed in the backward (activation checkpointing), so a micro-batch never
holds its [tokens, vocab] logits: the same memory idea as TRL's fused LM head, in plain PyTorch so it
runs (and is tested) on CPU as on GPU. A segment's log-probability is the sum of its targets'.

The loss is DPO's sigmoid loss (Rafailov et al. 2023; TRL's `loss_type="sigmoid"`, no label smoothing):

    loss_i = -logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

summed over the micro-batch's pairs and divided by the step's global pair count, so the sum over
micro-batches and ranks is the mean over the step's pairs: what one process computes on the whole
global batch (and what TRL's DPOTrainer computes on one batch of those pairs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from HyperSloth.train.collate import IGNORE_INDEX, collate_packed, packed_row_tokens
from HyperSloth.train.model_config import text_config
REFERENCE_ADAPTER = "reference"  # the frozen copy of the initial adapter (init_adapter_path)
# Target positions per log-prob chunk. The chunk's logits are transient (~2 GB at 151,936 vocab: bf16 logits, their
# fp32 copy and softmax temporaries), outside what the budget probe measures, so well under its safety margin.
LOGP_CHUNK_TOKENS = 1024
# Per-step sums all-reduced with the loss; the step's means divide them by the global pair count.
REWARD_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")

Pair = tuple[np.ndarray, np.ndarray, np.ndarray]  # prompt, chosen, rejected token ids


def pair_segments(prompt: np.ndarray, chosen: np.ndarray, rejected: np.ndarray
                  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The pair's two (input_ids, labels) sequences: prompt+chosen and prompt+rejected, prompt masked."""
    masked = np.full(len(prompt), IGNORE_INDEX, dtype=np.int64)
    return [(np.concatenate([prompt, completion]).astype(np.int64),
             np.concatenate([masked, completion]).astype(np.int64)) for completion in (chosen, rejected)]


def collate_pairs(pairs: Sequence[Pair], *, pad_token_id: int = 0, with_lengths: bool = False,
                  bucket: bool = False, bucket_limit: int | None = None) -> dict[str, torch.Tensor]:
    """One packed row of the pairs' 2n segments and its targets (see the module docstring).

    `bucket` pads the row as the SFT collator does on Unsloth (`collate.packed_row_tokens`: a few row
    lengths, never past `bucket_limit` unless the row already is); the padding segments have no target.
    """
    segments = [seg for pair in pairs for seg in pair_segments(*pair)]
    return collate_segments(segments, pad_token_id=pad_token_id, with_lengths=with_lengths, bucket=bucket,
                            bucket_limit=bucket_limit)


def collate_segments(segments: Sequence[tuple[np.ndarray, np.ndarray]], *, pad_token_id: int = 0,
                     with_lengths: bool = False, bucket: bool = False, bucket_limit: int | None = None
                     ) -> dict[str, torch.Tensor]:
    """(input_ids, labels) segments as one packed row plus its targets on the host (`target_index`,
    `target_ids`, `target_segment`: the module docstring); DPO's pairs and GRPO's completions both."""
    pad_to = packed_row_tokens(sum(len(ids) for ids, _ in segments), bucket_limit) if bucket else None
    batch = collate_packed(segments, with_lengths=with_lengths, pad_to=pad_to, pad_token_id=pad_token_id)
    segment_of = np.repeat(np.arange(len(segments), dtype=np.int64), [len(ids) for ids, _ in segments])
    labels = batch.pop("labels")[0].numpy()  # the collator's: -100 on prompts, segment starts and padding
    targets = np.flatnonzero(labels != IGNORE_INDEX)
    batch["target_index"] = torch.from_numpy(targets - 1)  # causal LM: position t predicts token t + 1
    batch["target_ids"] = torch.from_numpy(labels[targets])
    batch["target_segment"] = torch.from_numpy(segment_of[targets])
    return batch


def _chunk_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float | None,
                 scale: float, temperature: float = 1.0) -> torch.Tensor:
    logits = hidden @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: softmax in fp32
    if scale != 1.0:
        logits = logits * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    if temperature != 1.0:  # GRPO scores completions at the temperature they were sampled with (TRL's order)
        logits = logits / temperature
    return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, softcap: float | None = None,
                scale: float = 1.0, temperature: float = 1.0, chunk: int = LOGP_CHUNK_TOKENS) -> torch.Tensor:
    """log softmax(hidden @ weight.T)[target] per row of `hidden` ([N, H] -> [N], at least float32), in chunks.

    With gradients on, each chunk's logits are recomputed in the backward instead of kept (only [N]
    values survive the forward); without them (the reference forward) the chunks are plain calls.
    """
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        args = (hidden[start:start + chunk], weight, targets[start:start + chunk], softcap, scale, temperature)
        if torch.is_grad_enabled() and hidden.requires_grad:
            parts.append(checkpoint(_chunk_logps, *args, use_reentrant=False))
        else:
            parts.append(_chunk_logps(*args))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def _causal_lm(model):
    """The transformers causal LM under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _head_factors(config) -> tuple[float | None, float]:
    """(final logit soft-cap, logit scale) of the model family (None / 1.0 for most, e.g. Qwen and Llama)."""
    text = text_config(config)
    scale = getattr(text, "logit_scale", None)
    return getattr(text, "final_logit_softcapping", None), 1.0 if scale is None else float(scale)


def target_logps(model, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """The log-probability of every target of the packed row (`batch["target_ids"]`, at least float32).

    The backbone runs on the packed row (`input_ids`, `position_ids`, and `packed_seq_lengths` for
    Unsloth's varlen path); the LM head runs only at target positions (`token_logps`).
    """
    lm = _causal_lm(model)
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "packed_seq_lengths")}
    hidden = lm.base_model(**inputs, use_cache=False).last_hidden_state[0]
    head = lm.get_output_embeddings()
    softcap, scale = _head_factors(lm.config)
    return token_logps(hidden.index_select(0, batch["target_index"]), head.weight, batch["target_ids"],
                       softcap=softcap, scale=scale, temperature=temperature)


def segment_logps(model, batch: dict[str, torch.Tensor], num_segments: int) -> torch.Tensor:
    """Sum of the target tokens' log-probabilities of each of the row's first `num_segments` segments."""
    logps = target_logps(model, batch)
    return logps.new_zeros(num_segments).index_add(0, batch["target_segment"], logps)


@dataclass
class PairLogps:
    """Per-pair log-probabilities of one micro-batch: policy and reference, chosen and rejected."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor


def pair_logps(model, batch: dict[str, torch.Tensor], num_pairs: int, reference) -> PairLogps:
    """Policy log-probs (with gradients) and the reference's (no gradients; `reference` is a
    `ReferenceSwitch`) of the micro-batch's pairs."""
    policy = segment_logps(model, batch, 2 * num_pairs)
    with torch.no_grad(), reference.active(model):
        ref = segment_logps(model, batch, 2 * num_pairs)
    return PairLogps(policy[0::2], policy[1::2], ref[0::2], ref[1::2])


def dpo_loss(logps: PairLogps, beta: float, denominator: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the pairs' sigmoid losses / denominator, detached sums in `REWARD_KEYS` order).

    Rewards are beta x (policy - reference) log-ratios, TRL's definition; accuracy counts chosen > rejected.
    """
    chosen = logps.chosen - logps.ref_chosen
    rejected = logps.rejected - logps.ref_rejected
    losses = -F.logsigmoid(beta * (chosen - rejected))
    chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    sums = torch.stack([chosen_rewards.sum(), rejected_rewards.sum(),
                        (chosen_rewards > rejected_rewards).float().sum(), (chosen_rewards - rejected_rewards).sum()])
    return losses.sum() / denominator, sums


class ReferenceSwitch:
    """Turns the policy model into the reference model for one forward, with no second copy.

    Without an initial adapter the reference is the base model: PEFT's `disable_adapter()`. With
    `init_adapter_path` it is the initial adapter, loaded a second time as the frozen `REFERENCE_ADAPTER`
    and made active for the forward (`set_adapter(..., inference_mode=True)`, then the trained adapter
    again). Dropout is off for the reference (eval mode, only when the model has any), so the reference
    is one fixed function, as TRL's (which disables dropout everywhere by default).
    """

    def __init__(self, model, adapter: str | None = None):
        self.adapter = adapter
        self.has_dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())

    @contextlib.contextmanager
    def active(self, model) -> Iterator[None]:
        was_training = model.training
        if self.has_dropout:
            model.eval()
        try:
            if self.adapter is None:
                with model.disable_adapter():
                    yield
            else:
                trained = model.active_adapter
                model.set_adapter(self.adapter, inference_mode=True)
                try:
                    yield
                finally:
                    model.set_adapter(trained)
        finally:
            if self.has_dropout:
                model.train(was_training)


def add_reference_adapter(model, init_adapter_path: str) -> ReferenceSwitch:
    """Load the initial adapter a second time, frozen, as the reference; the trained adapter stays active."""
    model.load_adapter(init_adapter_path, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
    for name, param in model.named_parameters():
        if f".{REFERENCE_ADAPTER}." in name:
            param.requires_grad_(False)
    return ReferenceSwitch(model, REFERENCE_ADAPTER)
