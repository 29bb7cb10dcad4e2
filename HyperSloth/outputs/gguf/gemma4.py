"""Gemma 4 (31B; 26B-A4B, whose layers add an expert block beside the MLP; E2B, E4B) as llama.cpp's `gemma4`.

What llama.cpp's own converter does (conversion/gemma.py Gemma4Model, llama-cpp-python 0.3.36), written again here:
- the norms as they are: Gemma4RMSNorm scales by its weight (Gemma 3's by 1 + weight); the value norm has no weight,
  and the embeddings' sqrt(hidden) scale and the attention's scale of 1 are llama.cpp's own;
- the heads per layer: the sliding layers' `head_dim` (`key_length_swa`), the full-attention layers' `global_head_dim`
  (`key_length`; transformers 5.17 saves it as `per_layer_config` overrides), and the KV heads per layer where they
  differ (`num_global_key_value_heads` with `attention_k_eq_v`, whose full layers have no `v_proj`: llama.cpp then
  takes the keys before their norm as the values, as transformers does);
- RoPE: the full layers' "proportional" RoPE (frequencies base^(-2i / head) for a share of the head's pairs, the rest
  unrotated) as NeoX RoPE over the whole head with a `rope_freqs` tensor, 1 for the rotated pairs and 1e30 for the
  others (their angle divided away); its `factor` divides the rotated ones, as transformers divides its frequencies;
  the sliding layers' own base and dimension count; the window and which layers slide;
- `layer_scalar` (a buffer multiplying each layer's output) -> `layer_output_scale.weight`; the experts' fused
  `gate_up_proj` (gate rows first, as llama.cpp splits it) and `down_proj` as they are, `.weight` added; the router's
  `scale` -> `ffn_gate_inp.scale`, its `per_expert_scale` -> `ffn_down_exps.scale` (llama.cpp scales each expert's
  output by it, transformers the expert's routing weight: the same product);
- E2B / E4B: the per-layer embeddings under their gemma4 names, the count of layers that reuse an earlier layer's KV
  (they hold no K/V projections) and the double-wide MLPs of those layers (`use_double_wide_mlp`) per layer.
Refused, where transformers would compute what llama.cpp's graph does not: attention biases, bidirectional attention,
per-layer overrides other than the heads, layers of one kind with different head widths, a RoPE other than default /
proportional (full layers) and default (sliding ones), per-layer embeddings over another vocabulary than the model's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from HyperSloth.outputs.export import ExportError

FULL, SLIDING = "full_attention", "sliding_attention"
_HEAD_KEYS = ("head_dim", "num_key_value_heads")  # what a layer's entry in per_layer_config may override
UNROTATED = 1e30  # llama.cpp's converter's rope_freqs entry for a pair proportional RoPE leaves as it is


def layer_types(config: dict[str, Any]) -> list[str]:
    """Each layer's attention, as Gemma4TextConfig resolves `layer_types`: five sliding layers to one full where
    config.json names none, and the last layer full whatever it says."""
    count = config["num_hidden_layers"]
    kinds = list(config.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(count)])
    kinds[-1] = FULL
    return kinds


def layer_heads(config: dict[str, Any], where: str = "the model") -> list[tuple[int, int]]:
    """(KV heads, head width) of each layer, as Gemma4TextConfig resolves them: `per_layer_config` where config.json
    holds it (transformers 5.17 saves the overrides so), else the full layers' `global_head_dim` (default 512) and,
    with `attention_k_eq_v`, their `num_global_key_value_heads` (the published configs)."""
    kinds = layer_types(config)
    overrides = config.get("per_layer_config")
    if overrides is None:
        full = {"head_dim": config.get("global_head_dim", 512)}
        if config.get("attention_k_eq_v") and config.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = config["num_global_key_value_heads"]
        overrides = {index: full for index, kind in enumerate(kinds) if kind == FULL}
    by_layer = {}
    for key, values in overrides.items():
        other = sorted(set(values) - set(_HEAD_KEYS))
        if other:
            raise ExportError(f"--gguf cannot write {where}: its per_layer_config changes {other} for layer {key}; "
                              f"llama.cpp's gemma4 takes per-layer {' and '.join(_HEAD_KEYS)} only")
        by_layer[int(key)] = values
    base = {"head_dim": config.get("head_dim", 256), "num_key_value_heads": config["num_key_value_heads"]}
    layers = [{**base, **by_layer.get(index, {})} for index in range(len(kinds))]
    return [(int(layer["num_key_value_heads"]), int(layer["head_dim"])) for layer in layers]


def head_widths(config: dict[str, Any]) -> tuple[int, int]:
    """(full layers' head width, sliding layers'); the full one where no layer slides."""
    kinds, heads = layer_types(config), layer_heads(config)
    full = heads[kinds.index(FULL)][1]
    return full, heads[kinds.index(SLIDING)][1] if SLIDING in kinds else full


def check(config: dict[str, Any], where: str) -> None:
    """ExportError for a Gemma 4 whose computation llama.cpp's gemma4 would not reproduce (module docstring)."""
    per_layer_vocab = config.get("vocab_size_per_layer_input", 262_144)
    if (config.get("hidden_size_per_layer_input") or 0) and per_layer_vocab != config["vocab_size"]:
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's gemma4 takes one row of per-layer embeddings per "
                          f"token, and its config has vocab_size_per_layer_input {per_layer_vocab} for a vocabulary "
                          f"of {config['vocab_size']}")
    if config.get("attention_bias"):
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's gemma4 has no attention biases, and its config "
                          "sets attention_bias")
    if config.get("use_bidirectional_attention") == "all":
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's gemma4 attends causally, and its config sets "
                          "use_bidirectional_attention 'all'")
    kinds, heads = layer_types(config), layer_heads(config, where)
    for kind in (FULL, SLIDING):
        widths = sorted({width for (_, width), each in zip(heads, kinds) if each == kind})
        if len(widths) > 1:
            raise ExportError(f"--gguf cannot write {where}: llama.cpp's gemma4 takes one head width for all "
                              f"{kind} layers, and its config has {widths}")
    full, sliding = rope_parameters(config)
    if str(full.get("rope_type") or "default") not in ("default", "proportional"):
        raise ExportError(f"--gguf cannot write {where}: its full-attention layers' RoPE is "
                          f"{full.get('rope_type')!r}; llama.cpp's gemma4 takes 'proportional' or 'default'")
    if SLIDING in kinds and str(sliding.get("rope_type") or "default") != "default":
        raise ExportError(f"--gguf cannot write {where}: its sliding layers' RoPE is {sliding.get('rope_type')!r}; "
                          "llama.cpp's gemma4 takes 'default' for them")


def rope_parameters(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full layers', sliding layers') rope_parameters; transformers' defaults where config.json names none."""
    params = config.get("rope_parameters") or {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
    return params.get(FULL) or {}, params.get(SLIDING) or {}


def rope_factors(config: dict[str, Any]) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's full-attention layers divide their frequencies by (one per pair of the
    head): proportional RoPE's `factor` for the rotated pairs, UNROTATED for the others; all 1 for default RoPE."""
    full, _ = rope_parameters(config)
    pairs = head_widths(config)[0] // 2
    if str(full.get("rope_type") or "default") != "proportional":
        return np.ones(pairs, dtype=np.float32)
    rotated = int(full.get("partial_rotary_factor", 1.0) * head_widths(config)[0] // 2)
    return np.asarray([full.get("factor", 1.0)] * rotated + [UNROTATED] * (pairs - rotated), dtype=np.float32)


def head_lengths(config: dict[str, Any]) -> tuple[int | list[int], int, int, int]:
    """(KV heads, per layer where they differ; then the full-attention layers' key length, value length and rope
    dims), as llama.cpp's gemma4 reads the common keys (the sliding layers' lengths in `add_hyperparameters`)."""
    kv_heads = [heads for heads, _ in layer_heads(config)]
    full, _ = head_widths(config)
    return (kv_heads[0] if len(set(kv_heads)) == 1 else kv_heads), full, full, full


def add_hyperparameters(writer, config: dict[str, Any]) -> None:
    """conversion/gemma.py's Gemma4Model keys beyond the common ones."""
    kinds = layer_types(config)
    _, sliding = head_widths(config)
    writer.add_key_length_swa(sliding)
    writer.add_value_length_swa(sliding)
    writer.add_rope_dimension_count_swa(sliding)  # default RoPE rotates the whole sliding head
    writer.add_sliding_window(int(config.get("sliding_window") or 512))  # llama.cpp requires it
    writer.add_sliding_window_pattern([kind == SLIDING for kind in kinds])
    writer.add_shared_kv_layers(int(config.get("num_kv_shared_layers") or 0))
    writer.add_embedding_length_per_layer_input(int(config.get("hidden_size_per_layer_input") or 0))
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    if config.get("enable_moe_block"):
        writer.add_expert_count(int(config["num_experts"]))
        writer.add_expert_used_count(config["top_k_experts"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def feed_forward_length(config: dict[str, Any]) -> int | list[int]:
    """The MLP's width, per layer with `use_double_wide_mlp` (E2B: twice as wide in the layers that share KV)."""
    width, layers = config["intermediate_size"], config["num_hidden_layers"]
    first_shared = layers - int(config.get("num_kv_shared_layers") or 0)
    if not config.get("use_double_wide_mlp") or first_shared == layers:
        return width
    return [width * 2 if index >= first_shared > 0 else width for index in range(layers)]


def lookup_name(name: str) -> str:
    """The Hugging Face name the gguf package's TensorNameMap knows the tensor by (llama.cpp's converter adds
    `.weight` to the layer scalar and the fused experts)."""
    if name.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
        return f"{name}.weight"
    return name


def gguf_name(name: str, names) -> str | None:
    """The tensor's GGUF name (`names`: the gguf package's TensorNameMap for gemma4); the router's two scales are
    `.scale` tensors beside the router's and the experts' down projection's weights."""
    for suffix, beside in (("router.scale", "router.proj.weight"),
                           ("router.per_expert_scale", "experts.down_proj.weight")):
        if name.endswith(suffix):
            weight = names.get_name(name[: -len(suffix)] + beside, try_suffixes=(".weight",))
            return None if weight is None else weight.removesuffix(".weight") + ".scale"
    return names.get_name(lookup_name(name), try_suffixes=(".weight", ".bias"))
