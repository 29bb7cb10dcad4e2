"""Liquid AI's LFM2 (Lfm2ForCausalLM: short-convolution layers and attention layers with Q/K norms, each followed by
a SwiGLU MLP) as llama.cpp's `lfm2`, and LFM2-MoE (Lfm2MoeForCausalLM: the first `num_dense_layers` with that MLP,
the others with sigmoid-routed experts and an expert bias) as `lfm2moe`.

What llama.cpp's own converter does (conversion/lfm2.py LFM2Model, LFM2MoeModel), written again here on numpy:
- the short convolution's depthwise `conv.conv.weight` (hidden, 1, L) loses its middle axis (llama.cpp's ssm_conv
  takes (channels, taps)); its in_proj (B, C, x) and out_proj as they are; the attention, its Q/K layernorms, the
  MLP's w1 (gate) / w3 (up) / w2 (down), `operator_norm`, `ffn_norm` and `embedding_norm` (the final norm, despite
  its name: llama.cpp's `token_embd_norm`) under the gguf package's names, no change;
- the experts, one tensor per expert on disk (`feed_forward.experts.E.w1/w2/w3`, what transformers 5.17 saves) or
  fused as transformers holds them (`gate_up_proj`, gate rows first; `down_proj`), stacked as llama.cpp's
  `ffn_{gate,up,down}_exps`; the router `feed_forward.gate` as `ffn_gate_inp`, the `expert_bias` as
  `exp_probs_b.bias`;
- the keys: KV heads per layer with 0 for a convolution layer (what makes llama.cpp's layer recurrent), the
  convolution's taps (`shortconv.l_cache`), the RMS eps (`norm_eps`), the MLP's width as transformers computes it
  (`block_auto_adjust_ff_dim`); for the MoE the experts' count and width, the dense layers in front and sigmoid
  gating.
A config.json as published (`block_ff_dim`, `tie_embedding`, `full_attn_idxs`, `norm_eps`) is read as
transformers reads it (`normalised`). Refused, where llama.cpp's graph would compute something else than
transformers: biases on the convolution (`conv_bias`), and for the MoE routing weights not renormalised, a routed
scaling factor other than 1, no expert bias, or an output projection of its own (lfm2moe reads the embeddings').
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from HyperSloth.outputs.export import ExportError

HF_NAMES = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")
CONV, ATTENTION = "conv", "full_attention"
CONV_WEIGHT = "conv.conv.weight"
_PER_EXPERT = re.compile(r"(?P<stem>.+\.feed_forward\.experts)\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3)\.weight")
_FUSED = re.compile(r"(?P<stem>.+\.feed_forward\.experts)\.(?P<proj>gate_up_proj|down_proj)")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def normalised(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with the keys transformers 5.17 saves (and the writer reads): a published config's
    `block_ff_dim`, `tie_embedding`, `full_attn_idxs` as transformers' Lfm2Config reads them, `norm_eps` as
    `rms_norm_eps`."""
    config = dict(config)
    if "block_ff_dim" in config:
        config.setdefault("intermediate_size", config["block_ff_dim"])
    if "tie_embedding" in config:
        config.setdefault("tie_word_embeddings", config["tie_embedding"])
    if not config.get("layer_types"):
        attention = config.get("full_attn_idxs")
        attention = range(config["num_hidden_layers"]) if attention is None else attention
        config["layer_types"] = [ATTENTION if i in attention else CONV for i in range(config["num_hidden_layers"])]
    config.setdefault("rms_norm_eps", config.get("norm_eps", 1e-5))
    config.setdefault("tie_word_embeddings", True)  # both Lfm2Config's and Lfm2MoeConfig's default
    return config


def is_moe(config: dict[str, Any]) -> bool:
    return "Lfm2MoeForCausalLM" in (config.get("architectures") or [])


def check(config: dict[str, Any], where: str) -> None:
    """ExportError for an LFM2 whose computation llama.cpp would not reproduce (module docstring)."""
    kinds = sorted(set(config["layer_types"]) - {CONV, ATTENTION})
    if kinds:
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's lfm2 has convolution and full-attention layers "
                          f"only, and its config has {kinds}")
    if config.get("conv_bias"):
        raise ExportError(f"--gguf cannot write {where}: its short convolutions have biases (conv_bias), which "
                          "llama.cpp's lfm2 does not read")
    if not is_moe(config):
        return
    if not config.get("norm_topk_prob", True):
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's lfm2moe renormalises the top-k routing weights, "
                          "and its config has norm_topk_prob false")
    if float(config.get("routed_scaling_factor", 1.0)) != 1.0:
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's lfm2moe does not scale the routing weights, and "
                          f"its config has routed_scaling_factor {config['routed_scaling_factor']}")
    if not config.get("use_expert_bias", True):
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's lfm2moe reads an expert bias, and its config "
                          "has use_expert_bias false")
    if not config.get("tie_word_embeddings", True):
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's lfm2moe takes the output projection from the "
                          "embeddings, and its config has tie_word_embeddings false")


def head_lengths(config: dict[str, Any]) -> tuple[list[int], int, int, int]:
    """(KV heads per layer, 0 for a convolution layer; key length, value length, rope dims)."""
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    width = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return [kv_heads if kind == ATTENTION else 0 for kind in config["layer_types"]], width, width, width


def feed_forward_length(config: dict[str, Any]) -> int:
    """The dense MLP's width as transformers computes it: Lfm2MLP adjusts `intermediate_size` (2/3, times the
    multiplier, up to a multiple of `block_multiple_of`) where `block_auto_adjust_ff_dim`; Lfm2MoeMLP takes it as
    it is."""
    width = int(config["intermediate_size"])
    if is_moe(config) or not config.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    if config.get("block_ffn_dim_multiplier", 1.0) is not None:
        width = int(config.get("block_ffn_dim_multiplier", 1.0) * width)
        multiple = int(config.get("block_multiple_of", 256))
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def add_hyperparameters(writer, config: dict[str, Any]) -> None:
    """conversion/lfm2.py's keys beyond the common ones."""
    import gguf

    writer.add_shortconv_l_cache(int(config.get("conv_L_cache", 3)))
    if is_moe(config):
        writer.add_expert_count(int(config["num_experts"]))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        writer.add_leading_dense_block_count(int(config.get("num_dense_layers", 2)))
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def split_parts(parts: list, config: dict[str, Any]) -> list:
    """The experts stacked per layer and projection, under the names the gguf package's TensorNameMap knows
    (`...feed_forward.experts.{gate,up,down}_proj.weight`): one tensor per expert (as saved) or fused (as held)."""
    from HyperSloth.outputs.gguf.experts import fused_parts, stack_experts

    out, per_expert = [], {}
    for part in parts:
        if match := _PER_EXPERT.fullmatch(part.name):
            per_expert.setdefault((match["stem"], _PROJ[match["proj"]]), {})[int(match["expert"])] = part
        elif _FUSED.fullmatch(part.name):  # (experts, 2 * width, hidden): the gate's rows, then the up projection's
            out += fused_parts(part.name, part.shape)
        else:
            out.append(part)
    return out + stack_experts(per_expert, int(config.get("num_experts") or 0),
                               lambda stem, proj: f"{stem}.{proj}.weight")


def lookup_name(name: str) -> str:
    """The Hugging Face name the gguf package's TensorNameMap knows the tensor by (the expert bias as a `.bias`)."""
    return name + ".bias" if name.endswith("feed_forward.expert_bias") else name


def stored_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The convolution as (channels, taps); any other tensor as it is."""
    return (shape[0], shape[-1]) if name.endswith(CONV_WEIGHT) and len(shape) == 3 else shape


def transform(name: str, data: np.ndarray) -> np.ndarray | None:
    """The convolution as llama.cpp reads it; None for any other tensor (architectures.transform's rules apply)."""
    return data.reshape(stored_shape(name, data.shape)) if name.endswith(CONV_WEIGHT) else None
