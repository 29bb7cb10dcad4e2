"""NVIDIA Nemotron-H (NemotronHForCausalLM: a stack of single-mixer blocks, each a Mamba-2 mixer, attention without
RoPE, a ReLU² MLP or a mixture of ReLU² experts) as llama.cpp's `nemotron_h`, and with experts as `nemotron_h_moe`.

What llama.cpp's own converter does (conversion/nemotron.py NemotronHModel, on conversion/granite.py's
GraniteHybridModel, llama-cpp-python 0.3.36), written again here on numpy:
- the Mamba-2 mixers as Granite 4.0-H's (granite.mamba2_transform: A = -exp(A_log) and A, D as (heads, 1), the conv
  without its middle axis, the gated norm as (groups, inner / groups)); `dt_bias` named `dt.bias`;
- the experts, one tensor per expert on disk (fused in memory), stacked as llama.cpp's `ffn_up_exps` /
  `ffn_down_exps` (no gate: ReLU² of the up projection); the router's `e_score_correction_bias` as `exp_probs_b.bias`;
  the shared expert's up and down projections; the attention's Q and K permuted per head as Llama's (no RoPE: no
  effect on the product);
- the keys: KV heads per layer (0 but in the attention layers) and the feed-forward width per layer (0 but in the MLP
  or MoE layers), which together tell llama.cpp each layer's kind; the Mamba-2 sizes; RoPE off; the experts' count,
  widths, the shared expert's count, top-k renormalisation and routed scaling factor.
The layer kinds are read from `layers_block_type` (transformers 5.17 saves linear_attention / full_attention / mlp /
moe) or the published `hybrid_override_pattern` (M, *, -, E). The choice of `nemotron_h_moe` is by the layers: a
config.json saved by transformers 5.17 names `num_experts_per_tok` whatever the model (llama.cpp's converter looks
for that key). Refused, where llama.cpp's graph would compute something else than transformers: MLP and MoE layers
in one model, experts through a latent projection (`moe_latent_size`), grouped routing (`n_group` > 1), a sliding
window, a clamped time step, biases on the Mamba projections or none on its conv, MLP biases, activations other than
ReLU² (MLP) and SiLU (Mamba).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from HyperSloth.outputs.export import ExportError
from HyperSloth.outputs.gguf import granite

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
_KINDS = {"mamba": MAMBA, "M": MAMBA, MAMBA: MAMBA, "attention": ATTENTION, "*": ATTENTION, ATTENTION: ATTENTION,
          "-": MLP, MLP: MLP, "E": MOE, MOE: MOE}
_PER_EXPERT = re.compile(r"(?P<stem>.+)\.mixer\.experts\.(?P<expert>\d+)\.(?P<proj>up_proj|down_proj)\.weight")
_FUSED = re.compile(r"(?P<stem>.+)\.mixer\.experts\.(?P<proj>up_proj|down_proj)")


def layer_kinds(config: dict[str, Any], where: str = "the model") -> list[str]:
    """Each block's mixer (MAMBA, ATTENTION, MLP, MOE), from `layers_block_type` or `hybrid_override_pattern`."""
    named = config.get("layers_block_type") or config.get("layer_types") or config.get("hybrid_override_pattern")
    if not named:
        raise ExportError(f"--gguf cannot write {where}: its config names no layers_block_type")
    unknown = sorted({str(kind) for kind in named} - set(_KINDS))
    if unknown:
        raise ExportError(f"--gguf cannot write {where}: its layers_block_type holds {unknown}; llama.cpp's "
                          "nemotron_h takes Mamba, attention, MLP and MoE blocks")
    return [_KINDS[kind] for kind in named]


def normalised(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with `num_hidden_layers` (transformers 5.17 saves none: the count of `layers_block_type`)."""
    return {**config, "num_hidden_layers": len(layer_kinds(config))}


def is_moe(config: dict[str, Any]) -> bool:
    return MOE in layer_kinds(config)


def check(config: dict[str, Any], where: str) -> None:
    """ExportError for a Nemotron-H whose computation llama.cpp would not reproduce (module docstring)."""
    kinds = layer_kinds(config, where)
    if MLP in kinds and MOE in kinds:
        raise ExportError(f"--gguf cannot write {where}: it has both MLP and MoE blocks; llama.cpp's nemotron_h_moe "
                          "takes every feed-forward block as a mixture of experts")
    if MOE in kinds and config.get("moe_latent_size") is not None:
        raise ExportError(f"--gguf cannot write {where}: its experts work in a latent space (moe_latent_size "
                          f"{config['moe_latent_size']}), which HyperSloth's GGUF export does not write")
    if MOE in kinds and int(config.get("n_group") or 1) != 1:
        raise ExportError(f"--gguf cannot write {where}: its router picks experts within groups (n_group "
                          f"{config['n_group']}); llama.cpp's nemotron_h_moe routes over all experts")
    if config.get("sliding_window"):
        raise ExportError(f"--gguf cannot write {where}: its attention has a sliding window "
                          f"({config['sliding_window']}), which llama.cpp's nemotron_h does not")
    low, high = granite.time_step_limit(config)
    if low > 0 or high < math.inf:
        raise ExportError(f"--gguf cannot write {where}: its config clamps the Mamba time step to ({low}, {high}) "
                          "(time_step_limit); llama.cpp's ssm_scan does not clamp it")
    if config.get("mamba_proj_bias") or config.get("use_conv_bias") is False or config.get("mlp_bias"):
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's nemotron_h has no bias on the Mamba and MLP "
                          "projections and needs one on the conv, and its config sets mamba_proj_bias "
                          f"{config.get('mamba_proj_bias')}, use_conv_bias {config.get('use_conv_bias')}, mlp_bias "
                          f"{config.get('mlp_bias')}")
    acts = (config.get("mlp_hidden_act", "relu2"), config.get("mamba_hidden_act", "silu"))
    if acts != ("relu2", "silu"):
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's nemotron_h takes ReLU² MLPs and SiLU in the "
                          f"Mamba mixer, and its config has mlp_hidden_act {acts[0]!r}, mamba_hidden_act {acts[1]!r}")


def groups(config: dict[str, Any]) -> int:
    return int(config.get("n_groups") or 1)


def head_lengths(config: dict[str, Any]) -> tuple[list[int], int, int, int]:
    """(KV heads per layer, 0 but in the attention layers; key length, value length, rope dims)."""
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    width = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return [kv_heads if kind == ATTENTION else 0 for kind in layer_kinds(config)], width, width, width


def feed_forward_length(config: dict[str, Any]) -> list[int]:
    """The feed-forward width per layer, 0 but in the MLP (MoE) layers: the MLP's (the experts') width."""
    width = config["moe_intermediate_size"] if is_moe(config) else config["intermediate_size"]
    return [width if kind in (MLP, MOE) else 0 for kind in layer_kinds(config)]


def add_hyperparameters(writer, config: dict[str, Any]) -> None:
    """conversion/nemotron.py's NemotronHModel keys beyond the common ones."""
    writer.add_layer_norm_eps(float(config["layer_norm_epsilon"]))  # what llama.cpp's nemotron_h reads its RMS eps as
    writer.add_ssm_conv_kernel(int(config.get("conv_kernel", 4)))
    writer.add_ssm_state_size(int(config.get("ssm_state_size", 128)))
    writer.add_ssm_group_count(groups(config))
    writer.add_ssm_inner_size(int(config["mamba_num_heads"]) * int(config["mamba_head_dim"]))
    writer.add_ssm_time_step_rank(int(config["mamba_num_heads"]))
    writer.add_rope_scaling_finetuned(False)  # no RoPE (llama.cpp's Granite-hybrid switch, kept by the converter)
    if is_moe(config):
        writer.add_expert_count(int(config["n_routed_experts"]))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        writer.add_expert_shared_feed_forward_length(int(config["moe_shared_expert_intermediate_size"]))
        writer.add_expert_shared_count(int(config.get("n_shared_experts", 1)))
        writer.add_expert_weights_norm(bool(config.get("norm_topk_prob", True)))
        writer.add_expert_weights_scale(float(config.get("routed_scaling_factor", 1.0)))
        writer.add_expert_group_count(int(config.get("n_group") or 1))


def split_parts(parts: list, config: dict[str, Any]) -> list:
    """The experts stacked per layer and projection, under the names the gguf package's TensorNameMap knows
    (`model.layers.N.mlp.experts.{up,down}_proj.weight`): one tensor per expert (as saved) or fused (as held)."""
    from HyperSloth.outputs.gguf.experts import TensorPart, stack_experts

    out, per_expert = [], {}
    for part in parts:
        if match := _PER_EXPERT.fullmatch(part.name):
            per_expert.setdefault((match["stem"], match["proj"]), {})[int(match["expert"])] = part
        elif match := _FUSED.fullmatch(part.name):
            out.append(TensorPart(_stacked_name(match["stem"], match["proj"]), part.shape, part.sources))
        else:
            out.append(part)
    return out + stack_experts(per_expert, int(config.get("n_routed_experts") or 0), _stacked_name)


def _stacked_name(stem: str, proj: str) -> str:
    return f"model.layers.{stem.rsplit('.', 1)[-1]}.mlp.experts.{proj}.weight"


def lookup_name(name: str) -> str:
    """The Hugging Face name the gguf package's TensorNameMap knows the tensor by: the checkpoint's `backbone.`
    for the mixers (transformers holds them as `model.layers...`, and saves them so with save_original_format=False,
    as llama.cpp's converter maps a PEFT adapter's)."""
    if name.startswith("model.layers.") and ".mixer." in name:
        name = "backbone." + name.removeprefix("model.")
    for saved, known in (("mixer.dt_bias", "mixer.dt.bias"),
                         ("gate.e_score_correction_bias", "gate.e_score_correction.bias")):
        if name.endswith(saved):
            return name[: -len(saved)] + known
    return name


def is_mamba(name: str) -> bool:
    return name.endswith(("mixer.A_log", "mixer.D", "mixer.conv1d.weight", "mixer.norm.weight"))


def stored_shape(name: str, shape: tuple[int, ...], config: dict[str, Any]) -> tuple[int, ...]:
    return granite.mamba2_shape(name, shape, groups(config)) if is_mamba(name) else shape


def transform(name: str, data: np.ndarray, config: dict[str, Any]) -> np.ndarray | None:
    """A Mamba-2 tensor as llama.cpp reads it; None for any other (architectures.transform's rules apply)."""
    return granite.mamba2_transform(name, data, groups(config)) if is_mamba(name) else None
