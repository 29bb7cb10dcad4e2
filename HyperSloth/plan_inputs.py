"""From a resolved run and a built dataset to the planner's inputs; shared by the trainer and `hypersloth-plan`.

Torch-free, so the plan preview stays fast and GPU-free, and the preview plans exactly what training will.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from HyperSloth.batching import PlanSpec

if TYPE_CHECKING:  # run.py imports this module (attention_coef)
    from HyperSloth.run import RunDescription


def attention_coef(model_name: str) -> float | None:
    """The planner's cost-model coefficient c (load = L + c L^2 per sequence) for a local model folder.

    Per token and layer the linear layers cost 2 x P FLOP (P = weights of q, k, v, o and the gated MLP)
    and causal attention 2 x d_attn x L, so c = d_attn / P: about 1.3e-4 for Qwen3-0.6B, 2.1e-5 for
    Qwen3-8B. None (the planner's default) when the model is not a local folder with a config.json:
    the preview and the trainer read the same file, so they always plan the same dealing.
    """
    path = Path(model_name).expanduser() / "config.json"
    try:
        cfg = json.loads(path.read_text())
        d, ff = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        head_dim = int(cfg.get("head_dim") or d // int(cfg["num_attention_heads"]))
        attn = int(cfg["num_attention_heads"]) * head_dim
        kv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) * head_dim
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return attn / (d * (attn + 2 * kv) + attn * d + 3 * d * ff)


def plan_spec_for(run: RunDescription) -> PlanSpec:
    """The planner's parameters of a resolved run (`HyperSloth.run.resolve_run`)."""
    training = run.hyper_config["training"]
    return PlanSpec(
        num_ranks=run.world_size,
        samples_per_step=run.global_batch_size,
        mode=run.batching,
        micro_batch_size=run.micro_batch_size,
        token_budget=run.token_budget,
        group_by_length=training["group_by_length"],
        group_window_steps=training["group_window_steps"],
        seed=run.seed,
        **({} if run.attention_coef is None else {"attention_coef": run.attention_coef}),
    )


def dataset_lengths(dataset, loss_type: str, max_seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, trainable-token counts) of a built dataset; trainable = length - 1 when the loss covers
    every token (position 0 is never a target). ValueError, saying what to change, for an empty dataset
    or samples longer than max_seq_length."""
    lengths = np.asarray(dataset["length"], dtype=np.int64)
    if lengths.size == 0:
        raise ValueError("the dataset is empty: rebuild it from a file with samples")
    longest = int(lengths.max())
    if longest > max_seq_length:
        raise ValueError(
            f"the dataset holds samples of up to {longest} tokens but fast_model_args.max_seq_length is "
            f"{max_seq_length}: raise max_seq_length or rebuild the dataset with --max_seq_length {max_seq_length}"
        )
    if loss_type == "all":
        return lengths, np.maximum(lengths - 1, 0)
    return lengths, np.asarray(dataset["num_trainable"], dtype=np.int64)
