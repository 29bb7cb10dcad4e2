"""Qwen3-Next (Qwen3NextForCausalLM: gated-delta-rule layers and gated attention layers, each followed by experts
beside a gated shared expert) as llama.cpp's `qwen3next`.

What llama.cpp's own converter does (conversion/qwen.py Qwen3NextModel, on Qwen2MoeModel), written again here on
numpy; the rest is Qwen3.5-MoE's (linear_attention.py: A = -exp(A_log), `dt_bias` as `dt_proj.bias`, the conv
without its middle axis, every norm + 1 but the linear attention's gated one; experts.py: the experts stacked):
- the linear attention's fused `in_proj_qkvz`, whose rows come per key head ([q, k, v, z] of key head 0, then of
  key head 1, ...), as two tensors: `attn_qkv` (every key head's q, then every k, then every v, the order the conv
  and the delta rule take them in) and `attn_gate` (every z); `in_proj_ba` as `ssm_ba`, as it is;
- the attention's `q_proj` (queries and their output gate, interleaved per head) as it is;
- the shared expert's gate `shared_expert_gate` as `ffn_gate_inp_shexp`;
- the keys: the linear attention's sizes, the full-attention interval, the rotated share of a head
  (`partial_rotary_factor`, 0.25 by default), the experts' and the shared expert's widths.
Refused, where llama.cpp's graph would compute something else than transformers: dense layers (`mlp_only_layers`,
`decoder_sparse_step` > 1), top-k weights not renormalised, key and value heads of different widths.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from HyperSloth.outputs.export import ExportError
from HyperSloth.outputs.gguf import linear_attention

QKVZ, QKV, Z = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"


def check(config: dict[str, Any], where: str) -> None:
    """ExportError for a Qwen3-Next whose computation llama.cpp would not reproduce (module docstring)."""
    dense = sorted(set(config.get("mlp_only_layers") or []))
    if dense or config.get("decoder_sparse_step", 1) != 1 or not config.get("num_experts"):
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's qwen3next makes every layer a mixture of "
                          f"experts, and its config makes some dense (mlp_only_layers={dense}, decoder_sparse_step="
                          f"{config.get('decoder_sparse_step', 1)}, num_experts={config.get('num_experts')})")
    if not config.get("norm_topk_prob", True):
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's qwen3next renormalises the top-k routing weights, "
                          "and its config has norm_topk_prob false")
    linear_attention.check_heads(config, where, "qwen3next")


def _widths(config: dict[str, Any]) -> tuple[int, int, int]:
    """(key heads, a key head's width, the value width per key head)."""
    key_heads = config["linear_num_key_heads"]
    per_key = config["linear_num_value_heads"] // key_heads * config["linear_value_head_dim"]
    return key_heads, config["linear_key_head_dim"], per_key


def split_parts(parts: list, config: dict[str, Any]) -> list:
    """`in_proj_qkvz` as two parts named as Qwen3.5's `in_proj_qkv` and `in_proj_z` (the gguf package's TensorNameMap
    knows them as attn_qkv and attn_gate), each read from the fused tensor (`transform` takes its rows)."""
    from HyperSloth.outputs.gguf.experts import TensorPart

    key_heads, key_width, per_key = _widths(config)
    out = []
    for part in parts:
        if part.name.endswith(QKVZ):
            stem, columns = part.name[: -len(QKVZ)], part.shape[1]
            out += [TensorPart(stem + QKV, (key_heads * (2 * key_width + per_key), columns), part.sources),
                    TensorPart(stem + Z, (key_heads * per_key, columns), part.sources)]
        else:
            out.append(part)
    return out


def transform(name: str, data: np.ndarray, config: dict[str, Any]) -> np.ndarray | None:
    """The fused `in_proj_qkvz` (as read for either part) as the part's rows in llama.cpp's order; None for any other
    tensor (linear_attention.transform and architectures.transform's rules apply)."""
    key_heads, key_width, per_key = _widths(config)
    if not name.endswith((QKV, Z)) or data.shape[0] != key_heads * 2 * (key_width + per_key):
        return None
    grouped = data.reshape(key_heads, 2 * (key_width + per_key), data.shape[1])
    q, k = grouped[:, :key_width], grouped[:, key_width: 2 * key_width]
    v, z = grouped[:, 2 * key_width: 2 * key_width + per_key], grouped[:, 2 * key_width + per_key:]
    if name.endswith(Z):
        return z.reshape(-1, data.shape[1])
    return np.concatenate([part.reshape(-1, data.shape[1]) for part in (q, k, v)])
