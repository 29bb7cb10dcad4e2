"""IBM Granite 4.0-H (GraniteMoeHybridForCausalLM: Mamba-2 layers and attention layers without RoPE, each followed
by a mixture of experts beside a shared MLP) as llama.cpp's `granitehybrid`.

What llama.cpp's own converter does (conversion/granite.py GraniteHybridModel on conversion/mamba.py Mamba2Model,
llama-cpp-python 0.3.36), written again here on numpy:
- the Mamba-2 mixer: `A_log` stored as A = -exp(A_log) and `A`, `D` as (heads, 1) columns; `dt_bias` named
  `dt_proj.bias`; `conv1d.weight` (channels, 1, kernel) loses its middle axis; the gated norm's weight as
  (groups, inner / groups); `in_proj`, `out_proj` and the conv's bias as they are;
- the experts' fused `block_sparse_moe.input_linear` (experts, 2 * width, hidden) split into the stacked gate (first
  half of the rows, the one through SiLU) and up tensors, `output_linear` as the stacked down tensor; the shared MLP's
  `input_linear` split the same way into the shared expert's gate and up (a dense model's, without experts, into the
  MLP's), `output_linear` its down projection; the router `router.layer` as `ffn_gate_inp`;
- the attention's Q and K rows permuted per head as Llama's (the converter's `undo_permute`): llama.cpp rotates no
  position into them here, so the product of queries and keys is unchanged either way;
- the keys: Granite's four multipliers (embedding, residual, attention as the attention scale, logits_scaling as
  the logit scale the logits are divided by), the Mamba-2 sizes (conv kernel, state size, groups, heads as the time
  step rank, inner width), KV heads per layer with 0 for a Mamba layer (what makes llama.cpp's layer recurrent),
  RoPE off (`rope.scaling.finetuned` false is llama.cpp's switch for it), the shared MLP's width.
Refused, where llama.cpp's graph would compute something else than transformers: RoPE in the attention layers (the
converter writes a hybrid without it), no Mamba layer (the converter writes those as `granite` / `granitemoe`), more
than one group of B/C (llama.cpp normalises the gated norm per group, transformers' torch path over the whole width),
a clamp of the time step (time_step_limit), biases on the Mamba projections, a Mamba conv without bias, an activation
other than SiLU.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from HyperSloth.outputs.export import ExportError

MIXER = ".mamba."  # a Mamba-2 layer's tensors: `model.layers.N.mamba.*`
_RECURRENT, _ATTENTION = ("mamba", "linear_attention"), ("attention", "full_attention")
_EXPERTS_IN, _SHARED_IN = "block_sparse_moe.input_linear.weight", "shared_mlp.input_linear.weight"


def layer_kinds(config: dict[str, Any], where: str = "the model") -> list[bool]:
    """Whether each layer is a Mamba-2 layer: config.json's `layer_types` (transformers 5 saves linear_attention /
    full_attention, the published configs name them mamba / attention, older ones `layers_block_type`)."""
    kinds = config.get("layer_types") or config.get("layers_block_type") or (
        ["mamba"] * config["num_hidden_layers"])  # GraniteMoeHybridConfig's default
    unknown = sorted(set(kinds) - set(_RECURRENT) - set(_ATTENTION))
    if unknown or len(kinds) != config["num_hidden_layers"]:
        raise ExportError(f"--gguf cannot write {where}: its layer_types {kinds} are not one of "
                          f"{_RECURRENT + _ATTENTION} per layer")
    return [kind in _RECURRENT for kind in kinds]


def experts(config: dict[str, Any]) -> int:
    return int(config.get("num_local_experts") or 0)


def check(config: dict[str, Any], where: str) -> None:
    """ExportError for a Granite 4.0-H whose computation llama.cpp's granitehybrid would not reproduce (module
    docstring)."""
    recurrent = layer_kinds(config, where)
    if not any(recurrent):
        raise ExportError(f"--gguf cannot write {where}: it has no Mamba layer; llama.cpp's converter writes such a "
                          "GraniteMoeHybrid as granite / granitemoe, which HyperSloth's GGUF export does not")
    if config.get("position_embedding_type") == "rope":
        raise ExportError(f"--gguf cannot write {where}: its attention layers use RoPE (position_embedding_type "
                          "'rope'); llama.cpp's converter writes a Granite hybrid with RoPE switched off")
    if int(config.get("mamba_n_groups") or 1) != 1:
        raise ExportError(f"--gguf cannot write {where}: its Mamba layers have mamba_n_groups "
                          f"{config['mamba_n_groups']}; llama.cpp normalises the gated norm per group, transformers' "
                          "torch path over the whole width (they agree for one group, as Granite 4.0-H has)")
    low, high = time_step_limit(config)
    if low > 0 or high < math.inf:
        raise ExportError(f"--gguf cannot write {where}: its config clamps the Mamba time step to ({low}, {high}) "
                          "(time_step_limit); llama.cpp's ssm_scan does not clamp it")
    if config.get("mamba_proj_bias") or config.get("mamba_conv_bias") is False:
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's Mamba-2 layer has no bias on in_proj / out_proj "
                          "and needs one on the conv, and its config sets mamba_proj_bias "
                          f"{config.get('mamba_proj_bias')}, mamba_conv_bias {config.get('mamba_conv_bias')}")
    if config.get("hidden_act", "silu") != "silu":
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's granitehybrid takes SiLU, and its config has "
                          f"hidden_act {config['hidden_act']!r}")


def time_step_limit(config: dict[str, Any]) -> tuple[float, float]:
    """time_step_limit as two floats (transformers saves infinity as {"__float__": "Infinity"})."""
    limit = config.get("time_step_limit") or (0.0, math.inf)
    return tuple(float(value["__float__"]) if isinstance(value, dict) else float(value) for value in limit)


def inner_size(config: dict[str, Any]) -> int:
    return int(config.get("mamba_expand", 2)) * config["hidden_size"]


def head_lengths(config: dict[str, Any]) -> tuple[list[int], int, int, int]:
    """(KV heads per layer, 0 for a Mamba layer; key length, value length, rope dims)."""
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    width = config["hidden_size"] // config["num_attention_heads"]
    return [0 if recurrent else kv_heads for recurrent in layer_kinds(config)], width, width, width


def feed_forward_length(config: dict[str, Any]) -> int:
    """The experts' width (`intermediate_size`); without experts the shared MLP is the layer's MLP: its width."""
    return config["intermediate_size"] if experts(config) else config["shared_intermediate_size"]


def add_hyperparameters(writer, config: dict[str, Any]) -> None:
    """conversion/granite.py's GraniteHybridModel keys beyond the common ones."""
    writer.add_attention_scale(float(config.get("attention_multiplier", 1.0)))
    writer.add_embedding_scale(float(config.get("embedding_multiplier", 1.0)))
    writer.add_residual_scale(float(config.get("residual_multiplier", 1.0)))
    writer.add_logit_scale(float(config.get("logits_scaling", 1.0)))
    if experts(config):
        writer.add_expert_count(experts(config))
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_shared_feed_forward_length(config["shared_intermediate_size"])
    writer.add_ssm_conv_kernel(int(config.get("mamba_d_conv", 4)))
    writer.add_ssm_state_size(int(config.get("mamba_d_state", 256)))
    writer.add_ssm_group_count(int(config.get("mamba_n_groups") or 1))
    writer.add_ssm_inner_size(inner_size(config))
    writer.add_ssm_time_step_rank(int(config.get("mamba_n_heads", 128)))
    writer.add_rope_scaling_finetuned(False)  # llama.cpp's granitehybrid: no RoPE


def split_parts(parts: list, config: dict[str, Any]) -> list:
    """The fused gate-and-up tensors as two parts each: the experts' by rows (experts.TensorPart.rows), the shared
    MLP's by name (`transform` takes its half), under the names the gguf package's TensorNameMap knows."""
    from HyperSloth.outputs.gguf.experts import TensorPart

    split = []
    for part in parts:
        name = part.name
        if name.endswith(_EXPERTS_IN):
            count, rows, columns = part.shape
            stem, half = name[: -len(_EXPERTS_IN)], rows // 2
            split += [TensorPart(f"{stem}mlp.experts.{proj}.weight", (count, half, columns), part.sources, rows=rows_)
                      for proj, rows_ in (("gate_proj", slice(0, half)), ("up_proj", slice(half, rows)))]
        elif name.endswith(_SHARED_IN):
            rows, columns = part.shape
            stem, mlp = name[: -len(_SHARED_IN)], "mlp.shared_expert" if experts(config) else "mlp"
            split += [TensorPart(f"{stem}{mlp}.{proj}.weight", (rows // 2, columns), part.sources)
                      for proj in ("gate_proj", "up_proj")]
        elif name.endswith("shared_mlp.output_linear.weight") and not experts(config):
            split.append(TensorPart(name.replace("shared_mlp.output_linear", "mlp.down_proj"), part.shape,
                                    part.sources))
        else:
            split.append(part)
    return split


def lookup_name(name: str) -> str:
    """The Hugging Face name the gguf package's TensorNameMap knows the tensor by."""
    return name[: -len("dt_bias")] + "dt_proj.bias" if name.endswith("mamba.dt_bias") else name


def stored_shape(name: str, shape: tuple[int, ...], config: dict[str, Any]) -> tuple[int, ...]:
    """The tensor's shape in the GGUF (numpy order)."""
    return mamba2_shape(name, shape, int(config.get("mamba_n_groups") or 1)) if MIXER in name else shape


def mamba2_shape(name: str, shape: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """A Mamba-2 mixer's tensor's shape as llama.cpp reads it (conversion/mamba.py): A and D as (heads, 1), the conv
    (channels, kernel), the gated norm (groups, inner / groups); Nemotron-H's mixer too (nemotron_h.py)."""
    if name.endswith((".A_log", ".D")):
        return (*shape, 1)
    if name.endswith("conv1d.weight") and len(shape) == 3:
        return shape[0], shape[2]
    if name.endswith(".norm.weight"):
        return groups, shape[0] // groups
    return shape


def mamba2_transform(name: str, data: np.ndarray, groups: int) -> np.ndarray:
    """A Mamba-2 mixer's tensor as llama.cpp reads it: `mamba2_shape`, and A = -exp(A_log)."""
    data = data.reshape(mamba2_shape(name, data.shape, groups))
    return -np.exp(data) if name.endswith("A_log") else data


def transform(name: str, data: np.ndarray, config: dict[str, Any]) -> np.ndarray | None:
    """A Mamba tensor or a half of the shared MLP as llama.cpp reads it (float32 in and out); None for any other
    tensor (architectures.transform's rules apply)."""
    if name.endswith(("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "mlp.gate_proj.weight",
                      "mlp.up_proj.weight")) and data.shape[0] == 2 * config["shared_intermediate_size"]:
        half = config["shared_intermediate_size"]
        return data[:half] if name.endswith("gate_proj.weight") else data[half:]
    if MIXER not in name:
        return None
    return mamba2_transform(name, data, int(config.get("mamba_n_groups") or 1))
