"""Preference datasets as the planner sees them: one unit per pair, the pair's packed tokens its length.

A built preference dataset (docs/dpo.md, registry kind "preference") stores per pair the prompt's,
chosen and rejected completions' token ids and their lengths; `length` is the pair's packed tokens,
2 x prompt + chosen + rejected (the prompt is packed once before each completion). The planner deals
pairs by that length, so a pair is never split across micro-batches or ranks, and counts one
"trainable" unit per pair, so a step's `num_trainable` is its global pair count: the DPO loss's
denominator. `max_seq_length` bounds each sequence (prompt + one completion), not the pair.

Torch-free: the resolver and `hypersloth-plan` use it without loading torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from HyperSloth.plan.batching import int_column

PREFERENCE_KIND = "preference"  # the registry's `kind` of a preference dataset; chats are "sft" (or unset)
PAIR_COLUMNS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
PAIR_LENGTH_COLUMNS = ("prompt_length", "chosen_length", "rejected_length")
REQUIRED_PAIR_COLUMNS = (*PAIR_COLUMNS, "length", *PAIR_LENGTH_COLUMNS)


def dataset_kind(entry: dict[str, Any]) -> str:
    """The kind a registry entry records: "preference" or "sft" (entries written before kinds existed)."""
    return str(entry.get("kind") or "sft")


def kind_problem(kind: str, method: str, name: str) -> str | None:
    """Why `method` cannot train on a dataset of `kind` (one line saying what to change), or None."""
    if method == "dpo" and kind != PREFERENCE_KIND:
        return (f"dataset '{name}' holds chats (kind '{kind}') but training.method='dpo' trains on preference "
                "pairs: build a preference dataset from prompt/chosen/rejected rows with `hypersloth-build-dataset "
                "--local_path FILE --tokenizer MODEL --name NAME` (docs/dpo.md), or set training.method='sft'")
    if method != "dpo" and kind == PREFERENCE_KIND:
        return (f"dataset '{name}' holds preference pairs (kind 'preference') but training.method is '{method}': "
                "set training.method='dpo' to train on them, or train on a chat dataset")
    return None


def longest_sequence(dataset) -> int:
    """The longest prompt + completion of a preference dataset (the unit max_seq_length bounds)."""
    prompt, chosen, rejected = (int_column(dataset, c) for c in PAIR_LENGTH_COLUMNS)
    return int((prompt + np.maximum(chosen, rejected)).max()) if prompt.size else 0


def pair_plan_inputs(dataset, max_seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(pair lengths, ones) for the planner (see the module docstring); ValueError, saying what to change,
    for an empty dataset or a sequence longer than max_seq_length."""
    lengths = int_column(dataset, "length")
    if lengths.size == 0:
        raise ValueError("the dataset is empty: rebuild it from a file with preference pairs")
    longest = longest_sequence(dataset)
    if longest > max_seq_length:
        raise ValueError(
            f"the dataset holds prompt + completion sequences of up to {longest} tokens but "
            f"fast_model_args.max_seq_length is {max_seq_length}: raise max_seq_length or rebuild the dataset "
            f"with --max_seq_length {max_seq_length}")
    return lengths, np.ones_like(lengths)
