"""Qwen3.5-MoE's linear-attention (gated delta rule) layers as llama.cpp's `qwen35moe` reads them.

What llama.cpp's own converter does to them (conversion/qwen.py: Qwen3NextModel and _LinearAttentionVReorderBase,
llama-cpp-python 0.3.36), written again here on numpy:
- `A_log` is stored as A = -exp(A_log); `dt_bias` is named `dt_proj.bias`; `conv1d.weight` (channels, 1, kernel)
  loses its middle axis; every RMSNorm weight but the gated one inside the linear attention (`linear_attn.norm`)
  gets + 1 (Qwen3.5's RMSNorm scales by 1 + weight);
- where there are fewer key heads than value heads, the value heads are reordered from grouped by key head
  ([k0: v0 v1 | k1: v0 v1]) to tiled ([k0 v0, k1 v0 | k0 v1, k1 v1]), the order ggml's broadcast repeats the key
  heads in: the value rows of `in_proj_qkv`, the rows of `in_proj_z`, `in_proj_a`, `in_proj_b`, the entries of
  `A_log` and `dt_bias`, the value channels of `conv1d`, and the columns of `out_proj`;
- the keys: the conv kernel, the state size (the key head width), the key heads (groups), the value heads (time
  step rank), the value width (inner size), which layers are recurrent, and the rotated share of a full-attention
  head with its MRoPE sections (a text model's positions are the same in every section).
llama.cpp's graph takes one head width for keys and values, so a config whose differ is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from HyperSloth.outputs.export import ExportError

MROPE_SECTIONS = [11, 11, 10, 0]  # llama.cpp's converter's default where rope_parameters names none
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"
MIXER = "linear_attn."  # the linear-attention layer's tensors: `model.layers.N.linear_attn.*`


def sections(config: dict[str, Any]) -> list[int]:
    """The four MRoPE sections (frequencies per position stream) llama.cpp reads."""
    named = (config.get("rope_parameters") or {}).get("mrope_section") or MROPE_SECTIONS
    return (list(named) + [0] * 4)[:4]


def check(config: dict[str, Any], where: str, rotary_dims: int) -> None:
    """ExportError for what llama.cpp's qwen35moe cannot run: key and value heads of different widths, value heads
    not a multiple of the key heads, MRoPE sections beyond the rotated dimensions (ggml asserts they fit)."""
    if sum(sections(config)) > rotary_dims:
        raise ExportError(f"--gguf cannot write {where}: its MRoPE sections {sections(config)} hold "
                          f"{sum(sections(config))} frequencies, more than llama.cpp's rope takes for {rotary_dims} "
                          "rotated dimensions (it asserts they fit); rope_parameters.mrope_section of config.json "
                          "sets them")
    check_heads(config, where, "qwen35moe")


def check_heads(config: dict[str, Any], where: str, gguf_arch: str) -> None:
    """ExportError where llama.cpp's `gguf_arch` (qwen35moe, qwen3next) cannot run the linear attention's heads: key
    and value heads of different widths, value heads not a multiple of the key heads."""
    key, value = config["linear_key_head_dim"], config["linear_value_head_dim"]
    if key != value:
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's {gguf_arch} takes one head width for the linear "
                          f"attention's keys and values, and its config has {key} and {value}")
    if config["linear_num_value_heads"] % config["linear_num_key_heads"]:
        raise ExportError(f"--gguf cannot write {where}: its linear attention's value heads "
                          f"({config['linear_num_value_heads']}) are not a multiple of its key heads "
                          f"({config['linear_num_key_heads']})")


def lookup_name(name: str) -> str:
    """The Hugging Face name the gguf package's TensorNameMap knows the tensor by."""
    return name[: -len("dt_bias")] + "dt_proj.bias" if name.endswith("linear_attn.dt_bias") else name


def stored_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], shape[2]) if name.endswith("linear_attn.conv1d.weight") and len(shape) == 3 else shape


def _tiled(data: np.ndarray, axis: int, key_heads: int, per_key: int, width: int) -> np.ndarray:
    """Value heads along `axis` from grouped by key head to tiled (`_reorder_v_heads`)."""
    moved = np.moveaxis(data, axis, 0)
    rest = moved.shape[1:]
    tiled = moved.reshape(key_heads, per_key, width, *rest).swapaxes(0, 1).reshape(moved.shape)
    return np.moveaxis(tiled, 0, axis)


def transform(name: str, data: np.ndarray, config: dict[str, Any], tiled: bool = True) -> np.ndarray:
    """A tensor of a Qwen3.5-MoE linear-attention layer (`MIXER` in its name) as llama.cpp's qwen35moe reads it
    (float32 in and out). Its gated norm keeps its weight; the model's other norms get architectures.py's + 1.
    `tiled` False: the value heads as they are (Qwen3-Next's qwen3next takes them grouped by key head)."""
    if name.endswith("conv1d.weight"):
        data = data.reshape(stored_shape(name, data.shape))
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if tiled and value_heads != key_heads:
        per_key, width, key_dim = value_heads // key_heads, config["linear_value_head_dim"], (
            config["linear_key_head_dim"] * key_heads)
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # q and k rows (channels) first, then v
            data = np.concatenate([data[: 2 * key_dim], _tiled(data[2 * key_dim:], 0, key_heads, per_key, width)])
        elif name.endswith("in_proj_z.weight"):
            data = _tiled(data, 0, key_heads, per_key, width)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            data = _tiled(data, 0, key_heads, per_key, 1)
        elif name.endswith("out_proj.weight"):
            data = _tiled(data, 1, key_heads, per_key, width)
    return -np.exp(data) if name.endswith("A_log") else data


def add_hyperparameters(writer, config: dict[str, Any]) -> None:
    """conversion/qwen.py's Qwen3NextModel / Qwen3.5 keys."""
    layer_types = config.get("layer_types") or []
    interval = int(config.get("full_attention_interval", 4))
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    if layer_types:  # the key of llama.cpp's loader (llama-arch.cpp), newer than the gguf package's writer
        recurrent = [kind == "linear_attention" for kind in layer_types]
        writer.add_array(RECURRENT_LAYERS.format(arch=writer.arch), recurrent)
    writer.add_full_attention_interval(interval)
    writer.add_rope_dimension_sections(sections(config))
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
