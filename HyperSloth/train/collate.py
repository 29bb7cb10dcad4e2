"""Turn one planned micro-batch (a list of tokenised samples) into model inputs.

Two layouts, matching the planner's two modes:
- sorted-pad: a [B, L] batch right-padded to the micro-batch's own longest sample, with an attention
  mask; padded label positions are -100.
- packed: one [1, sum(len)] row with no padding; `position_ids` restart at 0 for every sample, which
  transformers turns into a block-diagonal causal mask (SDPA/eager) or varlen attention (flash-attention),
  so no sample sees another. The first label of every sample is -100 so the last token of one sample is
  never trained to predict the first token of the next (the same rule as `DataCollatorWithFlattening`).

Bucketing (packed, `pad_to`; rows of up to `LONG_ROW_TOKENS`): a row may be padded up to a fixed length
with padding segments of at most `PAD_SEGMENT_TOKENS` tokens each (their own restarting positions, their
own varlen segments, every label -100). Short segments keep the padding's attention cost small (it is
quadratic per segment) and the attention kernel's `max_seqlen` at the longest sample, which CUDA graphs
fix per run (step_graph.py). Rows of a handful of lengths (`bucket_tokens`) instead of a new length every
micro-batch keep compiled/tuned kernels from seeing new shapes. Padding segments attend only to themselves and have no target, so the loss, its
denominator and the gradients of the real tokens are unchanged; token counts come from the plan, which
never counts padding.

Labels follow the causal-LM convention: the model shifts them, so position 0 of a sample is never a
target. The planner's trainable-token counts use the same rule, which is what makes the loss
denominator exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from HyperSloth.data.masking import IGNORE_INDEX  # the label of a position that is not trained (one definition)

# Rows longer than this are not bucketed. Their bucket step is >= 8,192 tokens, so padding would add ~4k-16k
# tokens to a row that already costs seconds (Qwen3-8B 4-bit: ~60 us per token, 0.25-1 s; a new row shape
# cost 0.05-0.1 s on an H200), and such rows come from long samples, whose shapes rarely repeat.
LONG_ROW_TOKENS = 65536
PAD_SEGMENT_TOKENS = 1024  # the longest padding segment of a bucketed row
LossType = Literal["all", "response_only"]


def sample_labels(input_ids: np.ndarray, labels: np.ndarray, loss_type: LossType) -> np.ndarray:
    """The labels a sample trains on: all tokens, or the dataset's response-only labels."""
    return input_ids.copy() if loss_type == "all" else labels.copy()


def collate_sorted_pad(
    samples: Sequence[tuple[np.ndarray, np.ndarray]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """Right-pad (input_ids, labels) pairs to the longest one."""
    width = max(len(ids) for ids, _ in samples)
    input_ids = np.full((len(samples), width), pad_token_id, dtype=np.int64)
    labels = np.full((len(samples), width), IGNORE_INDEX, dtype=np.int64)
    attention = np.zeros((len(samples), width), dtype=np.int64)
    for row, (ids, lab) in enumerate(samples):
        n = len(ids)
        input_ids[row, :n] = ids
        labels[row, :n] = lab
        attention[row, :n] = 1
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        "labels": torch.from_numpy(labels),
    }


def bucket_tokens(tokens: int, per_octave: int = 8, minimum: int = 64) -> int:
    """The bucket a packed row of `tokens` is padded to: the next multiple of 2^(floor(log2 n)) / per_octave
    (at least `minimum`), so rows take about `per_octave` lengths per doubling and waste at most
    1 / per_octave of their tokens (11,000 -> 11,264; 16,384 -> 16,384)."""
    if tokens <= 0:
        raise ValueError(f"tokens must be positive; got {tokens}")
    step = max(minimum, (1 << (int(tokens).bit_length() - 1)) // per_octave)
    return -(-int(tokens) // step) * step


def padding_segments(tokens: int) -> list[int]:
    """How `tokens` of bucket padding are cut into segments of at most `PAD_SEGMENT_TOKENS` (equal sizes)."""
    if tokens <= 0:
        return []
    count = -(-tokens // PAD_SEGMENT_TOKENS)
    return [tokens // count + (1 if i < tokens % count else 0) for i in range(count)]


def packed_row_tokens(real: int, bucket_limit: int | None = None) -> int:
    """The length of a bucketed packed row holding `real` tokens: `bucket_tokens(real)`, never past
    `bucket_limit` (the token budget the memory was measured for) unless the row already is; rows of more
    than `LONG_ROW_TOKENS` are not bucketed."""
    if real > LONG_ROW_TOKENS:
        return real
    if bucket_limit is None:
        return bucket_tokens(real)
    return min(bucket_tokens(real), max(real, bucket_limit))


def collate_packed(
    samples: Sequence[tuple[np.ndarray, np.ndarray]], *, with_lengths: bool = False, pad_to: int | None = None,
    pad_token_id: int = 0,
) -> dict[str, torch.Tensor]:
    """Concatenate (input_ids, labels) pairs into one row with restarting position ids.

    `with_lengths` adds `packed_seq_lengths` (int32, on the host), the key Unsloth's fast attention
    reads to run varlen attention over the row (its own padding-free collator sets the same key).
    `pad_to` appends padding segments (`pad_token_id`, labels -100) up to that many tokens.
    """
    real = sum(len(ids) for ids, _ in samples)
    if pad_to is not None and pad_to > real:
        fillers = [np.full(n, pad_token_id, dtype=np.int64) for n in padding_segments(pad_to - real)]
        samples = [*samples, *((f, np.full(len(f), IGNORE_INDEX, dtype=np.int64)) for f in fillers)]
    input_ids = np.concatenate([ids for ids, _ in samples]).astype(np.int64)
    labels = np.concatenate([lab for _, lab in samples]).astype(np.int64)
    lengths = np.array([len(ids) for ids, _ in samples], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    labels[starts] = IGNORE_INDEX
    position_ids = np.arange(len(input_ids), dtype=np.int64) - np.repeat(starts, lengths)
    batch = {
        "input_ids": torch.from_numpy(input_ids)[None],
        "position_ids": torch.from_numpy(position_ids)[None],
        "labels": torch.from_numpy(labels)[None],
    }
    if with_lengths:
        batch["packed_seq_lengths"] = torch.from_numpy(lengths.astype(np.int32))
    return batch


def collate(
    samples: Sequence[tuple[np.ndarray, np.ndarray]], mode: str, pad_token_id: int, *, with_lengths: bool = False,
    bucket: bool = False, bucket_limit: int | None = None,
) -> dict[str, torch.Tensor]:
    """Dispatch on the planner mode ("packed" or "sorted-pad"); `bucket` pads packed rows of at most
    `LONG_ROW_TOKENS` to `bucket_tokens`, never past `bucket_limit` (the token budget the memory was
    measured for) unless the row already is."""
    if mode == "packed":
        pad_to = packed_row_tokens(sum(len(ids) for ids, _ in samples), bucket_limit) if bucket else None
        return collate_packed(samples, with_lengths=with_lengths, pad_to=pad_to, pad_token_id=pad_token_id)
    if mode == "sorted-pad":
        return collate_sorted_pad(samples, pad_token_id)
    raise ValueError(f"unknown batching mode {mode!r}; use 'packed' or 'sorted-pad'")


def collate_rows(dataset, indices: Sequence[int], mode: str, loss_type: LossType, pad_token_id: int, *,
                 with_lengths: bool = False, bucket: bool = False, bucket_limit: int | None = None
                 ) -> dict[str, torch.Tensor]:
    """One planned micro-batch as model inputs: rows `indices` of a built dataset (numpy-formatted
    `input_ids` / `labels`), each with the labels its loss trains on (`sample_labels`), collated for the
    planner's mode (`collate`). Training (plan_loader.PlanSteps) and evaluation (evaluation.Evaluator) both."""
    rows = dataset[list(indices)]
    samples = [(np.asarray(ids), sample_labels(np.asarray(ids), np.asarray(lab), loss_type))
               for ids, lab in zip(rows["input_ids"], rows["labels"])]
    return collate(samples, mode, pad_token_id, with_lengths=with_lengths, bucket=bucket, bucket_limit=bucket_limit)


def to_device(prepare: Callable[[dict[str, Any]], dict[str, Any]], micro_batch: dict[str, Any]) -> dict[str, Any]:
    """`prepare(micro_batch)` (the Trainer's `_prepare_inputs`: to the device) for every entry but
    `packed_seq_lengths`, which stays on the host: Unsloth reads the packed lengths there (one pinned copy),
    and on the GPU they would cost a device-to-host sync per micro-batch. Training and evaluation both."""
    lengths = micro_batch.pop("packed_seq_lengths", None)
    prepared = prepare(micro_batch)
    if lengths is not None:
        prepared["packed_seq_lengths"] = lengths
    return prepared


def count_trainable(labels: torch.Tensor) -> int:
    """Targets the model will actually be scored on: label positions >= 1 that are not ignored."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())
