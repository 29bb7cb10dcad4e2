"""What a loaded model's transformers config says about its text decoder, read one way everywhere: the text part of a
multimodal config, its attention heads, and the number of routed experts of a mixture-of-experts one. No torch: the
budget's arithmetic (budget/choice.py) reads it too."""

from __future__ import annotations

from typing import Any

# Where MoE configs keep their routed-expert count: Qwen3-MoE / Qwen2-MoE, Mixtral / gpt-oss, DeepSeek / GLM.
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def text_config(config: Any) -> Any:
    """The config of the text model: a multimodal config's text part (`get_text_config`), else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def num_experts(config: Any) -> int:
    """The number of routed experts of an MoE config (its text config included), 0 for a dense model or None."""
    for cfg in (config, getattr(config, "text_config", None)):
        for attr in _EXPERT_COUNTS:
            value = getattr(cfg, attr, None) if cfg is not None else None
            if isinstance(value, int) and value > 1:
                return value
    return 0


def layer_attention_heads(config: Any) -> list[tuple[int, int, int]]:
    """Query heads, key-value heads and head_dim of every decoder layer of a config's text model (key-value heads
    default to the query heads, head_dim to hidden_size / heads). A heterogeneous config (transformers 5's per-layer
    configs: Gemma 4's full-attention layers have heads of 512 where its sliding ones have 256) is read layer by
    layer; reading `head_dim` on it whole raises."""
    text = text_config(config)
    if getattr(text, "is_heterogeneous", False):
        return [_heads(layer) for layer in text.per_layer_config]
    return [_heads(text)] * max(1, int(getattr(text, "num_hidden_layers", 1) or 1))


def attention_heads(config: Any) -> tuple[int, int, int]:
    """Query heads, key-value heads and head_dim of a config's text model; where its layers differ, the widest
    layer's (the largest key-value heads x head_dim)."""
    return max(layer_attention_heads(config), key=lambda heads: (heads[1] * heads[2], heads[2]))


def _heads(text: Any) -> tuple[int, int, int]:
    heads = int(text.num_attention_heads)
    kv_heads, head_dim = getattr(text, "num_key_value_heads", None), getattr(text, "head_dim", None)
    return (heads, int(kv_heads) if isinstance(kv_heads, int) and kv_heads > 0 else heads,
            int(head_dim) if isinstance(head_dim, int) and head_dim > 0 else int(text.hidden_size) // heads)
