"""GLM-4.7-Flash (DeepSeek's multi-head latent attention, sigmoid-routed experts) as llama.cpp's `deepseek2`.

What llama.cpp's own converter does (conversion/glm.py Glm4MoeLiteModel, conversion/deepseek.py DeepseekV2Model,
llama-cpp-python 0.3.36), written again here:
- `kv_b_proj` (heads x (nope + v), kv_lora_rank) is split per head into `k_b_proj`, transposed to (heads, kv_lora_rank,
  nope), and `v_b_proj` (heads, v, kv_lora_rank): llama.cpp absorbs them into the attention (MLA as MQA);
- the router's `e_score_correction_bias` is llama.cpp's `exp_probs_b.bias`;
- keys: one KV head; key and value lengths of the compressed cache (kv_lora_rank + rope dims, kv_lora_rank) and of
  the heads (nope + rope, v); the LoRA ranks of q and kv; the leading dense layers; the experts, the shared ones,
  the routed scaling factor, whether the top-k weights are renormalised; the rope dims (qk_rope_head_dim); and
  sigmoid gating, which llama.cpp otherwise guesses from GLM-4.7-Flash's layer count and vocabulary.
llama.cpp's deepseek2 rotates interleaved pairs, as transformers does for `rope_interleave: true` (GLM-4.7-Flash's
setting); a config with it false, with expert groups, or with dense layers after MoE ones is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from HyperSloth.outputs.export import ExportError
from HyperSloth.outputs.gguf.experts import TensorPart

KV_B = "self_attn.kv_b_proj.weight"


def check(config: dict[str, Any], where: str) -> None:
    if not config.get("rope_interleave", True):
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's deepseek2 rotates interleaved pairs, and its "
                          "config has rope_interleave false")
    if int(config.get("n_group") or 1) > 1:
        raise ExportError(f"--gguf cannot write {where}: its router picks experts within {config['n_group']} groups "
                          "(n_group), which llama.cpp's deepseek2 does not")
    kinds = layer_kinds(config)
    first_sparse = kinds.index("sparse") if "sparse" in kinds else len(kinds)
    if "dense" in kinds[first_sparse:]:
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's deepseek2 takes dense layers first only, and its "
                          f"mlp_layer_types are {kinds}")


def layer_kinds(config: dict[str, Any]) -> list[str]:
    """Each layer's MLP, "dense" or "sparse" (mlp_layer_types, or DeepSeek's first_k_dense_replace)."""
    kinds = config.get("mlp_layer_types")
    if kinds:
        return list(kinds)
    dense = int(config.get("first_k_dense_replace") or 0)
    return ["dense" if i < dense else "sparse" for i in range(config["num_hidden_layers"])]


def lookup_name(name: str) -> str:
    """The Hugging Face name the gguf package's TensorNameMap knows the tensor by."""
    return name.replace("e_score_correction_bias", "e_score_correction.bias")


def split_parts(parts: list[TensorPart], config: dict[str, Any]) -> list[TensorPart]:
    """Each layer's `kv_b_proj` as the two tensors `k_b_proj` (heads, kv_lora_rank, nope) and `v_b_proj` (heads, v,
    kv_lora_rank), read from it (`transform` makes them)."""
    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    nope, value = config["qk_nope_head_dim"], config["v_head_dim"]
    out = []
    for part in parts:
        if not part.name.endswith(KV_B):
            out.append(part)
            continue
        stem = part.name[: -len(KV_B)]
        out += [TensorPart(f"{stem}self_attn.k_b_proj.weight", (heads, rank, nope), part.sources),
                TensorPart(f"{stem}self_attn.v_b_proj.weight", (heads, value, rank), part.sources)]
    return out


def transform(name: str, data: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    if not name.endswith(("k_b_proj.weight", "v_b_proj.weight")):
        return data
    heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    per_head = data.reshape(heads, nope + config["v_head_dim"], data.shape[-1])
    if name.endswith("k_b_proj.weight"):
        return np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
    return np.ascontiguousarray(per_head[:, nope:])


def add_hyperparameters(writer, config: dict[str, Any]) -> None:
    """conversion/deepseek.py's keys (the common ones, written by architectures.add_hyperparameters, take one KV
    head and the compressed lengths from `head_count_kv` / `key_length` / `value_length` below)."""
    import gguf

    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    writer.add_leading_dense_block_count(layer_kinds(config).count("dense"))
    if config.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    writer.add_key_length_mla(config["qk_nope_head_dim"] + rope)
    writer.add_value_length_mla(config["v_head_dim"])
    writer.add_expert_shared_count(int(config.get("n_shared_experts") or 0))
    if config.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(float(config["routed_scaling_factor"]))
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # transformers' Glm4MoeLiteTopkRouter


def head_lengths(config: dict[str, Any]) -> tuple[int, int, int, int]:
    """(KV heads, key length, value length, rope dims) as llama.cpp's deepseek2 reads them: MLA as MQA over the
    compressed cache."""
    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    return 1, rank + rope, rank, rope
