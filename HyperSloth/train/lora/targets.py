"""Which parts of a model get LoRA adapters: read from the model itself, not from a list of names.

With `lora_args.target_modules` unset, every linear projection of the decoder gets an adapter (fused ones too:
Phi-3's `qkv_proj` / `gate_up_proj`) and so do the experts of a mixture-of-experts layer; never the LM head, the
embeddings or a router. transformers 5 stores an MoE layer's experts as fused 3-D parameters
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj` on Qwen3-MoE, Mixtral, Qwen2-MoE, gpt-oss), which no
module name matches: they go to PEFT's `target_parameters` (PEFT >= 0.17), which Unsloth's `get_peft_model`
takes too (its MoE LoRA path then runs the experts as grouped GEMMs without building the per-expert delta).

A Mamba layer's `out_proj` (Granite 4.0-H, Nemotron-H, Falcon-H1, Bamba, Jamba) gets none: its training kernel
takes the projection's weight as an argument (`mamba_split_conv1d_scan_combined`, outproj_weight=...), which
bypasses an adapter there, and PEFT refuses it by name on Falcon-H1, Nemotron-H and Mamba models.

An explicit list wins and is checked: each entry must name a module or an expert tensor of the model. As in
Unsloth (`get_moe_target_parameters`, unsloth 2026.10.9), the MLP names `gate_proj` / `up_proj` / `down_proj`
also select an MoE layer's fused expert tensors, so the classic seven-name list adapts the experts too.

Knows nothing of backends or ranks: model.py passes the result to PEFT or Unsloth.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from HyperSloth.config import ConfigError
from HyperSloth.train.model_config import num_experts

# A decoder layer's path: "...layers.3." (Llama family, Qwen, Gemma, Phi-3, MoE), "...h.3." (GPT-2 style).
_LAYER = re.compile(r"(^|\.)(layers|h|blocks)\.\d+\.")
# Parts of a multimodal model that are not the text decoder.
_NOT_TEXT = ("vision", "visual", "audio", "multi_modal_projector", "mm_projector")
# The MLP names that select an MoE layer's fused expert tensors (as Unsloth maps them).
_EXPERT_ALIASES = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "gate_up_proj": "gate_up_proj",
                   "down_proj": "down_proj"}


@dataclass(frozen=True)
class LoraTargets:
    """What gets adapters: PEFT's `target_modules` (leaf names of linear layers) and `target_parameters`
    (expert tensors, as suffixes such as "mlp.experts.gate_up_proj"); `source` is "model" or "config"."""

    modules: tuple[str, ...]
    parameters: tuple[str, ...]
    source: str
    # Modules with a target's leaf name outside the text decoder (a multimodal model's vision tower, as Gemma 3
    # 4B+ has), or a Mamba layer's out_proj where another module shares the name: PEFT's `exclude_modules`, so
    # the adapters stay on the language model's projections that take them
    excluded: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        return {"source": self.source, "target_modules": list(self.modules),
                "target_parameters": list(self.parameters), "excluded_modules": list(self.excluded)}


def resolve_targets(model: nn.Module, requested: list[str] | None) -> LoraTargets:
    """The adapters `model` gets: from the model when `requested` is None, else the checked list (ConfigError
    naming the entries that match nothing, with what the model has)."""
    mamba_out = _mamba_out_projections(model)
    linear = decoder_linears(model, mamba_out)
    experts = expert_tensors(model)
    if requested is None:
        modules = _leaf_names(linear)
        if not modules and not experts:
            raise ConfigError("found no linear projection in this model's decoder layers to adapt: set "
                              "lora_args.target_modules to the names of the layers to train")
        fused = tuple(name for name in mamba_out if name.rsplit(".", 1)[-1] in modules)
        return LoraTargets(modules=modules, parameters=tuple(sorted(set(experts.values()))), source="model",
                           excluded=_outside_with_names(model, modules) + fused)
    all_names = [name for name, _ in model.named_modules() if name]
    matched_modules, matched_params, unmatched = [], set(), []
    for entry in requested:
        hits_module = any(n == entry or n.endswith("." + entry) for n in all_names)
        params = _experts_named(entry, experts)
        if hits_module:
            matched_modules.append(entry)
        matched_params |= params
        if not hits_module and not params:
            unmatched.append(entry)
    if unmatched:
        raise ConfigError(_unmatched_message(unmatched, linear, experts))
    return LoraTargets(modules=tuple(matched_modules), parameters=tuple(sorted(matched_params)), source="config")


def decoder_linears(model: nn.Module, fused: Collection[str] = ()) -> list[str]:
    """Full names of the linear layers inside the text decoder's layers, routers, gates and `fused` (the Mamba
    layers' output projections) excluded."""
    experts = num_experts(getattr(model, "config", None))
    fused = set(fused)
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not _LAYER.search(name) or _outside_text(name):
            continue
        if "lora_" in name or name.endswith(".base_layer"):
            continue  # an adapter's own layers (an already wrapped model)
        if _is_router(name, module, experts) or name in fused:
            continue
        names.append(name)
    return names


def _mamba_out_projections(model: nn.Module) -> list[str]:
    """Full names of the Mamba layers' `out_proj`: a module with `in_proj`, `conv1d`, `A_log` and `D` (Mamba-2's
    parameters; Qwen3.5's gated delta rule has no `in_proj` or `D`)."""
    return [f"{name}.out_proj" for name, module in model.named_modules()
            if all(hasattr(module, part) for part in ("in_proj", "conv1d", "A_log", "D", "out_proj"))]


def expert_tensors(model: nn.Module) -> dict[str, str]:
    """Every fused expert tensor of the decoder: full parameter name -> its suffix for `target_parameters`
    (the path below the layer index, e.g. "mlp.experts.gate_up_proj"). 3-D parameters with one slice per
    expert; their biases (2-D) and the router stay frozen."""
    experts = num_experts(getattr(model, "config", None))
    if not experts:
        return {}
    found = {}
    for name, param in model.named_parameters():
        shape = logical_shape(param)
        if len(shape) != 3 or shape[0] != experts or _outside_text(name) or "lora_" in name:
            continue
        match = list(_LAYER.finditer(name))
        if match:
            suffix = name[match[-1].end():].replace(".base_layer", "").replace(".parametrizations", "")
            found[name] = suffix.removesuffix(".original")
    return found


def logical_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape a parameter has to the model: a bitsandbytes 4-bit parameter is stored packed (n, 1) and keeps its
    own in its quant state (Unsloth quantizes transformers 5's fused 3-D expert tensors so, for QLoRA of an MoE
    model, and records `_original_shape` for PEFT's `target_parameters`)."""
    original = getattr(param, "_original_shape", None)
    if original is None and getattr(param, "quant_state", None) is not None:
        original = getattr(param.quant_state, "shape", None)
    return tuple(original if original is not None else param.shape)


def _is_router(name: str, module: nn.Linear, experts: int) -> bool:
    """A router or gate (not a gated projection such as gate_proj): Mixtral-style `gate`, `router`,
    Qwen2-MoE's `shared_expert_gate`, or any linear layer of the MLP block with one output per expert (not one in
    the attention: Qwen3.5's linear attention has `in_proj_a` / `in_proj_b` with one output per head, and a tiny
    model may have as many heads as experts)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("gate", "router") or leaf.endswith("_gate") or leaf.endswith("router"):
        return True
    in_attention = any(f".{mixer}." in f".{name}." for mixer in ("self_attn", "linear_attn", "attention"))
    return bool(experts) and module.out_features == experts and not in_attention


def _outside_text(name: str) -> bool:
    return any(part in name for part in _NOT_TEXT)


def _outside_with_names(model: nn.Module, leaf_names: tuple[str, ...]) -> tuple[str, ...]:
    """Full names of the modules outside the text decoder that PEFT would match by these leaf names."""
    return tuple(name for name, _ in model.named_modules()
                 if name.rsplit(".", 1)[-1] in leaf_names and _outside_text(name))


def _leaf_names(full_names: list[str]) -> tuple[str, ...]:
    """Leaf names in first-seen order (PEFT matches a leaf name against every module's name suffix)."""
    return tuple(dict.fromkeys(name.rsplit(".", 1)[-1] for name in full_names))


def _experts_named(entry: str, experts: dict[str, str]) -> set[str]:
    """The expert suffixes an explicit entry selects: a suffix itself ("mlp.experts.down_proj") or an MLP name."""
    wanted = _EXPERT_ALIASES.get(entry)
    picked = set()
    for suffix in experts.values():
        leaf = suffix.rsplit(".", 1)[-1]
        if suffix == entry or suffix.endswith("." + entry) or leaf == wanted:
            picked.add(suffix)
        elif wanted == "gate_up_proj" and leaf == entry:  # unfused 3-D gate_proj / up_proj stacks
            picked.add(suffix)
    return picked


def _unmatched_message(unmatched: list[str], linear: list[str], experts: dict[str, str]) -> str:
    names = ", ".join(_leaf_names(linear)) or "none"
    expert_part = f"; its expert tensors are {', '.join(sorted(set(experts.values())))}" if experts else ""
    return (f"lora_args.target_modules {unmatched} match no module of this model: its decoder's linear layers are "
            f"{names}{expert_part}; drop or correct {'them' if len(unmatched) > 1 else 'it'}, or leave "
            "target_modules unset to adapt every projection (and the experts) the model has")


def check_expert_settings(targets: LoraTargets, lora_dropout: float) -> None:
    """PEFT adapts a 3-D expert tensor through a parametrization of the whole weight, where dropout on the
    input cannot be applied (peft 0.21 `ParamWrapper` raises): say what to change before PEFT does."""
    if targets.parameters and lora_dropout > 0:
        raise ConfigError(
            f"lora_dropout={lora_dropout} cannot apply to the experts' adapters ({', '.join(targets.parameters)}: "
            "PEFT's target_parameters have no input dropout): set lora_args.lora_dropout=0, or list "
            "lora_args.target_modules without the expert projections")


def describe(model: nn.Module, targets: LoraTargets) -> tuple[str, dict[str, Any]]:
    """One log line and its record: how many modules and expert tensors got adapters, the trainable share."""
    # PEFT's ParamWrapper (an expert tensor's adapter) names its parameter; a module's adapter does not.
    on_tensor = [hasattr(m, "parameter_name") for _, m in model.named_modules() if hasattr(m, "lora_A")]
    modules, tensors = on_tensor.count(False), on_tensor.count(True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(_numel(p) for p in model.parameters())
    share = trainable / total if total else 0.0
    what = "from the model" if targets.source == "model" else "from lora_args.target_modules"
    experts = (f" + experts {', '.join(targets.parameters)}" if targets.parameters else "")
    outside = sum(_outside_text(name) for name in targets.excluded)
    kept_out = f" ({outside} outside the language model left out)" if outside else ""
    line = (f"LoRA targets ({what}): {', '.join(targets.modules) or 'no linear layer'}{experts} -> "
            f"{modules} modules{kept_out}, {tensors} expert tensors; trainable {trainable:,} of {total:,} "
            f"parameters ({100 * share:.3g}%)")
    record = {**targets.record(), "adapted_modules": modules, "adapted_expert_tensors": tensors,
              "trainable_parameters": trainable, "trainable_share": round(share, 8)}
    return line, record


def _numel(param: torch.Tensor) -> int:
    """Elements of the weight as loaded: a bitsandbytes 4-bit weight packs two values per byte."""
    return math.prod(logical_shape(param))
