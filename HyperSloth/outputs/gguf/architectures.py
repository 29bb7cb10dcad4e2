"""What the GGUF needs from a Hugging Face model's config.json: the llama.cpp architecture, its hyperparameter
keys, and the few tensor changes llama.cpp's own converter (convert_hf_to_gguf.py) makes per architecture.

The names come from the `gguf` package (MODEL_ARCH, TensorNameMap, the writer's add_* keys); what is ours is
the table below (ARCHITECTURES; each names its `Family`, whose hooks in FAMILIES the writer calls at fixed points,
the family's functions living in its own module), checked against llama.cpp's conversion/{qwen,llama,gemma}.py
(llama-cpp-python 0.3.36):
- Qwen3, Qwen2: no change (llama.cpp uses NeoX RoPE for them, as transformers does);
- Llama, Mistral: Q and K rows permuted per head (transformers rotates halves, llama.cpp's LLAMA rotates
  pairs), the `permute` of conversion/llama.py;
- Gemma 3: every `*norm.weight` + 1 (Gemma3RMSNorm scales by 1 + weight, llama.cpp by weight), the sliding
  window and its per-layer pattern, the local RoPE base;
- Gemma 4 (conversion/gemma.py, Gemma4Model): no norm shift (Gemma4RMSNorm scales by weight); the heads of the
  sliding and the full-attention layers apart (their widths, KV heads per layer), the full layers' proportional
  RoPE as a `rope_freqs` tensor, the window and its pattern, `layer_scalar` as `layer_output_scale`; for the MoE
  (26B-A4B) the fused experts as they are and the router's two scales as `.scale` tensors; for E2B / E4B the
  per-layer embeddings' width and the count of layers sharing KV (gemma4.py);
- Qwen3-MoE (conversion/qwen.py, Qwen3MoeModel): the expert keys; the experts become llama.cpp's three stacked
  tensors per layer (experts.py); every layer must be an MoE layer with its top-k weights renormalised
  (llama.cpp's qwen3moe graph has no dense layer and always renormalises);
- gpt-oss (conversion/gpt_oss.py, GptOssModel): its interleaved, transposed experts and their biases split and
  stacked (experts.py, layout "gpt_oss"), the attention sinks, the expert width from `intermediate_size`, the
  sliding window and its per-layer pattern; output.weight written even when the embeddings are tied (llama.cpp's
  gpt-oss graph reads no other); the experts' clamped SwiGLU is hard-coded on both sides (alpha 1.702, limit 7).
- Phi-3 (conversion/phi.py, Phi3MiniModel): no change to the tensors (llama.cpp's phi3 takes the fused qkv_proj and
  gate_up_proj as they are); the rotary share of the head, the original context, the sliding window (llama.cpp
  reads it and switches it off: `caveats`), and for LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini) the long and
  short factors as two tensors plus the attention factor.
- Qwen3.5-MoE (conversion/qwen.py, Qwen3_5MoeTextModel): its linear-attention layers (linear_attention.py), the
  experts as Qwen3-MoE's, the shared expert and its gate, every norm + 1 but the linear attention's gated one.
  Qwen3.5 dense (Qwen3_5TextModel, llama.cpp's qwen35): the same without experts.
- Qwen3-Next (conversion/qwen.py, Qwen3NextModel): as Qwen3.5-MoE, but its linear attention's fused in_proj_qkvz
  split into attn_qkv and attn_gate, in_proj_ba as it is, the value heads left grouped by key head, no MRoPE
  (qwen3_next.py).
- GLM-4.7-Flash (conversion/glm.py, Glm4MoeLiteModel, a DeepseekV2Model): its latent attention's kv_b_proj split in
  two, the router's score correction, sigmoid gating, the dense first layers (latent_attention.py).
- Granite 4.0-H (conversion/granite.py, GraniteHybridModel on conversion/mamba.py's Mamba2Model): its Mamba-2 layers'
  A as -exp(A_log) and the conv, A, D and gated norm reshaped, the fused experts and shared MLP split into gate and
  up, Q and K permuted as Llama's (no RoPE: no effect), Granite's four multipliers, the Mamba-2 sizes, KV heads 0
  in the Mamba layers, RoPE off (granite.py).
- Nemotron-H (conversion/nemotron.py, NemotronHModel, a GraniteHybridModel): its blocks of one mixer each (Mamba-2
  as Granite's, attention, ReLU² MLP or experts), their kinds told to llama.cpp by KV heads and feed-forward widths
  per layer; `nemotron_h_moe` where it has expert blocks, their per-expert tensors stacked (nemotron_h.py).
- LFM2 (conversion/lfm2.py, LFM2Model) and LFM2-MoE (LFM2MoeModel, llama.cpp's lfm2moe): the short convolution's
  kernel without its middle axis, KV heads 0 in the convolution layers, the convolution's taps; for the MoE its
  experts stacked, the expert bias as `exp_probs_b`, the dense layers in front, sigmoid gating (lfm2.py).
Anything else is refused by name, with the supported list.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from HyperSloth.outputs.export import ExportError
from HyperSloth.outputs.gguf import (gemma4, granite, latent_attention, lfm2, linear_attention, nemotron_h,
                                     qwen3_next)


@dataclass(frozen=True)
class Architecture:
    """How one Hugging Face architecture becomes a llama.cpp one."""

    hf_name: str
    gguf_arch: str  # a gguf.MODEL_ARCH member's name
    permute_qk: bool = False  # Llama-style: rotate pairs instead of halves
    norm_shift: float = 0.0  # added to every norm weight (Gemma: 1 + weight)
    moe: bool = False  # experts (per-expert or fused on disk) become three stacked tensors (experts.py)
    experts_layout: str = "qwen"  # how the experts lie on disk (experts.LAYOUTS)
    output_required: bool = False  # llama.cpp reads output.weight only: written from the embeddings when tied
    family: str = "common"  # what it adds to the common conversion: a FAMILIES key (below)

    @property
    def hooks(self) -> "Family":
        return FAMILIES[self.family]

    @property
    def model_arch(self):
        import gguf

        return getattr(gguf.MODEL_ARCH, self.gguf_arch)

    @property
    def arch_name(self) -> str:
        import gguf

        return gguf.MODEL_ARCH_NAMES[self.model_arch]


ARCHITECTURES: dict[str, Architecture] = {
    arch.hf_name: arch
    for arch in (
        Architecture("Qwen3ForCausalLM", "QWEN3"),
        Architecture("Qwen2ForCausalLM", "QWEN2"),
        Architecture("LlamaForCausalLM", "LLAMA", permute_qk=True),
        Architecture("MistralForCausalLM", "LLAMA", permute_qk=True),
        Architecture("Gemma3ForCausalLM", "GEMMA3", norm_shift=1.0, family="gemma3"),
        Architecture("Gemma4ForCausalLM", "GEMMA4", family="gemma4"),  # dense and MoE alike (gemma4.py)
        Architecture("Qwen3MoeForCausalLM", "QWEN3MOE", moe=True, family="qwen3_moe"),
        Architecture("GptOssForCausalLM", "GPT_OSS", moe=True, experts_layout="gpt_oss", output_required=True,
                     family="gpt_oss"),
        Architecture("Phi3ForCausalLM", "PHI3", family="phi3"),
        Architecture("Qwen3_5ForCausalLM", "QWEN35", norm_shift=1.0, family="linear_attention"),
        Architecture("Qwen3_5MoeForCausalLM", "QWEN35MOE", norm_shift=1.0, moe=True, family="linear_attention"),
        Architecture("Qwen3NextForCausalLM", "QWEN3NEXT", norm_shift=1.0, moe=True, family="qwen3_next"),
        Architecture("Glm4MoeLiteForCausalLM", "DEEPSEEK2", moe=True, family="latent_attention"),
        # not `moe`: granite.py splits its fused experts and shared MLP and writes their keys
        Architecture("GraniteMoeHybridForCausalLM", "GRANITE_HYBRID", permute_qk=True, family="granite"),
        # nemotron_h, or NEMOTRON_H_MOE where it has expert blocks (architecture_of); experts stacked by nemotron_h.py
        Architecture("NemotronHForCausalLM", "NEMOTRON_H", permute_qk=True, family="nemotron_h"),
        # not `moe`: lfm2.py stacks the experts (feed_forward.experts.E.w1/w2/w3) and writes their keys
        Architecture("Lfm2ForCausalLM", "LFM2", family="lfm2"),
        Architecture("Lfm2MoeForCausalLM", "LFM2MOE", family="lfm2"),
    )
}
# A multimodal model whose language model is written (llama.cpp's converter does the same; the vision tower would be
# an mmproj file of its own): its class -> its language model's class.
MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
              "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",  # Gemma 4 and Qwen3.5 are published so,
              "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",  # the latter dense and MoE
              "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config")  # a multimodal config.json's nested models
SUPPORTED = ", ".join([*ARCHITECTURES, *MULTIMODAL])


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal model's config.json as its language model's: `text_config` over the top level's other keys
    (tie_word_embeddings, ...), named by the language model's class. Any other config as it is."""
    names = config.get("architectures") or []
    if "NemotronHForCausalLM" in names:  # its layer count, which transformers 5.17 does not save
        return nemotron_h.normalised(config)
    if any(name in lfm2.HF_NAMES for name in names):  # a published config.json's names as transformers reads them
        return lfm2.normalised(config)
    if "text_config" not in config or not any(name in MULTIMODAL for name in names):
        return config
    top = {key: value for key, value in config.items() if key not in _SUB_CONFIGS}  # quantization_config stays
    return {**top, **config["text_config"], "architectures": [MULTIMODAL.get(name, name) for name in names]}


def architecture_of(config: dict[str, Any], where: str = "the model") -> Architecture:
    """The supported architecture `config` (a config.json) names; ExportError naming it and the list if none."""
    config = text_config(config)
    names = config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            _check_config(ARCHITECTURES[name], config, where)
            if name == "NemotronHForCausalLM" and nemotron_h.is_moe(config):
                return replace(ARCHITECTURES[name], gguf_arch="NEMOTRON_H_MOE")
            return ARCHITECTURES[name]
    named = ", ".join(names) if names else f"none (model_type {config.get('model_type')!r})"
    raise ExportError(f"--gguf cannot write {where}: its architecture is {named}; GGUF export supports {SUPPORTED} "
                      "(for another one, convert OUT/merged with llama.cpp's convert_hf_to_gguf.py)")


def _check_config(arch: Architecture, config: dict[str, Any], where: str) -> None:
    if config.get("quantization_config"):
        raise ExportError(f"--gguf cannot write {where}: its config.json holds a quantization_config; export from "
                          "the merged 16/32-bit weights (--merge writes them)")
    if arch.hooks.check is not None:
        arch.hooks.check(config, where)
    _check_rope(config, arch, where)


def _check_gemma3(config: dict[str, Any], where: str) -> None:
    if config.get("attn_logit_softcapping") is not None:
        raise ExportError(f"--gguf cannot write {where}: Gemma 3 in llama.cpp has no attention logit soft-capping, "
                          f"and its config sets attn_logit_softcapping={config['attn_logit_softcapping']}")
    head_dim = config.get("head_dim", 256)
    hf_scale = config.get("query_pre_attn_scalar", head_dim)
    # llama.cpp scales queries by 1/sqrt(head_dim), except for its 62-layer (27B) shape: 1/sqrt(hidden/heads)
    llama_scale = config["hidden_size"] / config["num_attention_heads"] if config["num_hidden_layers"] == 62 \
        else head_dim
    if not math.isclose(hf_scale, llama_scale):
        raise ExportError(f"--gguf cannot write {where}: its query_pre_attn_scalar ({hf_scale}) differs from the "
                          f"{llama_scale} llama.cpp assumes for this Gemma 3 shape, so its attention would differ")


def _check_moe(config: dict[str, Any], where: str) -> None:
    """What llama.cpp's qwen3moe graph hard-codes: every layer MoE, the top-k routing weights renormalised."""
    dense = sorted(set(config.get("mlp_only_layers") or []))
    if dense or config.get("decoder_sparse_step", 1) != 1:
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's qwen3moe makes every layer a mixture of experts, "
                          f"and its config makes some dense (mlp_only_layers={dense}, "
                          f"decoder_sparse_step={config.get('decoder_sparse_step', 1)})")
    if not config.get("norm_topk_prob", False):  # transformers' Qwen3MoeConfig default is False
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's qwen3moe renormalises the top-k routing "
                          "weights, and its config has norm_topk_prob false, so its experts would be mixed differently")


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _check_gpt_oss(config: dict[str, Any], where: str) -> None:
    """Full and sliding layers only. The experts' clamped SwiGLU (alpha 1.702, limit 7.0) is hard-coded in
    transformers 5.17's GptOssExperts (config.swiglu_limit is not read) and in llama.cpp alike."""
    kinds = sorted(set(config.get("layer_types") or []) - set(_LAYER_TYPES))
    if kinds:
        raise ExportError(f"--gguf cannot write {where}: llama.cpp's gpt-oss has full and sliding-window attention "
                          f"layers only, and its config has {kinds}")


def expert_count(config: dict[str, Any]) -> int:
    """Experts per MoE layer: transformers 5 saves `num_local_experts`, Qwen's published configs `num_experts`,
    DeepSeek's and GLM's `n_routed_experts`."""
    return int(config.get("num_local_experts") or config.get("n_routed_experts") or config["num_experts"])


def rope_parameters(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, sliding) RoPE parameters, from transformers 5's rope_parameters or older rope_theta/rope_scaling."""
    params = config.get("rope_parameters")
    if params is None:
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        local = {"rope_theta": config["rope_local_base_freq"]} if "rope_local_base_freq" in config else {}
        return params, local
    if "full_attention" in params:
        return params["full_attention"], params.get("sliding_attention") or {}
    return params, {}


def rope_kind(config: dict[str, Any]) -> str:
    """The RoPE scaling config.json names ('default' where none; Phi-3's first name 'su' as 'longrope')."""
    params, _ = rope_parameters(config)
    kind = str(params.get("rope_type", params.get("type")) or "default").lower()
    return "longrope" if kind == "su" else kind


def _check_rope(config: dict[str, Any], arch: Architecture, where: str) -> None:
    """ExportError for a RoPE scaling llama.cpp would not reproduce: 'default', 'linear', 'yarn', 'llama3' are
    written; Phi-3 takes 'default' and 'longrope' only; Gemma 4 'default' and 'proportional' (gemma4.check)."""
    kind = rope_kind(config)
    known = ("default", "linear", "yarn", "llama3", *arch.hooks.rope_kinds)
    if kind not in known:
        raise ExportError(f"--gguf cannot write RoPE scaling {kind!r} (rope_parameters of config.json) for this "
                          f"architecture; supported: {', '.join(known)}")
    if arch.hooks.rope_check is not None:
        arch.hooks.rope_check(kind, where)


def _check_phi3_rope(kind: str, where: str) -> None:
    if kind not in ("default", "longrope"):
        raise ExportError(f"--gguf cannot write {where}: Phi-3 in llama.cpp takes no RoPE scaling or LongRoPE, and its "
                          f"config has {kind!r}")


def head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def add_hyperparameters(writer, config: dict[str, Any], arch: Architecture) -> None:
    """The `{arch}.*` keys llama.cpp reads for these architectures: the common ones, then the family's own."""
    hooks, heads = arch.hooks, config["num_attention_heads"]
    if hooks.head_lengths is not None:  # per layer where layers differ (0 KV heads: a Mamba or convolution layer)
        kv_heads, key_length, value_length, rope_dims = hooks.head_lengths(config)
    else:
        kv_heads, key_length, value_length, rope_dims = (
            config.get("num_key_value_heads") or heads, head_dim(config), head_dim(config), rotary_dims(config))
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    if "intermediate_size" in config:  # Qwen3.5-MoE has experts only (their width below)
        writer.add_feed_forward_length(hooks.feed_forward_length(config) if hooks.feed_forward_length is not None
                                       else config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(key_length)
    writer.add_value_length(value_length)
    writer.add_rope_dimension_count(rope_dims)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"] if "rms_norm_eps" in config
                                  else config["layer_norm_epsilon"])  # Nemotron-H's name for it
    writer.add_vocab_size(config["vocab_size"])
    _add_rope(writer, config)
    if arch.moe:
        writer.add_expert_count(expert_count(config))
        writer.add_expert_used_count(config.get("num_experts_per_tok") or config["experts_per_token"])
        # gpt-oss's intermediate_size is its expert width (it has no dense MLP); Qwen's is moe_intermediate_size
        writer.add_expert_feed_forward_length(config["intermediate_size"] if arch.experts_layout == "gpt_oss"
                                              else config["moe_intermediate_size"])
    if hooks.add_hyperparameters is not None:
        hooks.add_hyperparameters(writer, config)


def _add_rope(writer, config: dict[str, Any]) -> None:
    import gguf

    params, local = rope_parameters(config)
    writer.add_rope_freq_base(float(params.get("rope_theta", 10000.0)))
    if "rope_theta" in local:
        writer.add_rope_freq_base_swa(float(local["rope_theta"]))
    kind = rope_kind(config)  # architecture_of refused the kinds llama.cpp would not reproduce
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(params["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(params["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(params["original_max_position_embeddings"]))
        if (attn_factor := params.get("attention_factor")) is not None:
            writer.add_rope_scaling_yarn_attn_factor(float(attn_factor))
        for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if params.get(key) is not None:
                add(float(params[key]))


def rotary_dims(config: dict[str, Any]) -> int:
    """Rotated dimensions of a head: all of them, or Phi-3's `partial_rotary_factor` share (Phi-4-mini: 0.75)."""
    params, _ = rope_parameters(config)
    share = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return int(share * head_dim(config))


def _original_context(config: dict[str, Any]) -> int:
    params, _ = rope_parameters(config)
    return int(params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
               or config["max_position_embeddings"])


def _add_phi3(writer, config: dict[str, Any]) -> None:
    """conversion/phi.py's keys beyond the common ones: the original context, the sliding window (0 for none),
    and for LongRoPE the attention factor (transformers' formula where config.json names none)."""
    if rope_kind(config) != "yarn":  # YaRN wrote it already
        writer.add_rope_scaling_orig_ctx_len(_original_context(config))
    writer.add_sliding_window(int(config.get("sliding_window") or 0))
    if rope_kind(config) == "longrope":
        params, _ = rope_parameters(config)
        factor = config["max_position_embeddings"] / _original_context(config)
        attention = params.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(_original_context(config))) if factor > 1 else 1.0
        writer.add_rope_scaling_attn_factors(float(attention))


def phi3_longrope_factors(config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """LongRoPE's (long, short) per-frequency factors, the `rope_factors_long` / `_short` tensors llama.cpp reads;
    None without LongRoPE."""
    if rope_kind(config) != "longrope":
        return None
    params, _ = rope_parameters(config)  # transformers' Phi3Config checks both hold rotary_dims / 2 factors
    return (np.asarray(params["long_factor"], dtype=np.float32), np.asarray(params["short_factor"], dtype=np.float32))


def caveats(config: dict[str, Any], arch: Architecture) -> list[str]:
    """Where llama.cpp will compute something else than transformers from a file written as its converter writes
    it: said once by the export, not refused (llama.cpp's own converter writes these models the same way)."""
    return arch.hooks.caveats(config) if arch.hooks.caveats is not None else []


def _phi3_caveats(config: dict[str, Any]) -> list[str]:
    said = []
    if config.get("sliding_window"):
        said.append(f"llama.cpp switches Phi-3's sliding window off (src/models/phi3.cpp): beyond "
                    f"{config['sliding_window']} tokens of context it attends to every earlier token, where "
                    "transformers attends to the last sliding_window ones")
    if rope_kind(config) == "longrope":
        said.append(f"llama.cpp picks LongRoPE's long factors by the context it is started with (-c above "
                    f"{_original_context(config)}) for every token; transformers by the length of the sequence")
    return said


def _add_gemma3(writer, config: dict[str, Any]) -> None:
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    _add_sliding_window(writer, config)


def _add_gpt_oss_window(writer, config: dict[str, Any]) -> None:
    """llama.cpp's gpt-oss asserts that some layer slides (its KV cache is built for both kinds). With a sliding
    layer: the window and the pattern (no layer_types: transformers' default, every even layer sliding). All full:
    a window of the whole context at least, so the layers llama.cpp's every-other-layer default makes sliding
    attend to everything, as full layers do."""
    layer_types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(config["num_hidden_layers"])]
    if "sliding_attention" in layer_types:
        _add_sliding_window(writer, {**config, "layer_types": layer_types})
    else:
        writer.add_sliding_window(max(int(config.get("sliding_window") or 0), int(config["max_position_embeddings"])))


def _add_sliding_window(writer, config: dict[str, Any]) -> None:
    """The window and which layers use it (layer_types): llama.cpp's default pattern guesses the second."""
    window, layer_types = config.get("sliding_window"), config.get("layer_types")
    if window and layer_types:
        writer.add_sliding_window(int(window))
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in layer_types])


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray | None:
    """The `rope_freqs` tensor llama.cpp takes for Llama 3.1+'s 'llama3' RoPE (conversion/llama.py's formula)."""
    if rope_kind(config) != "llama3":
        return None
    params, _ = rope_parameters(config)
    dim, base = head_dim(config), params.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor, low, high = params.get("factor", 8.0), params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    old_context = params.get("original_max_position_embeddings", 8192)
    factors = []
    for wavelen in 2 * math.pi / freqs:
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def transform(name: str, data: np.ndarray, config: dict[str, Any], arch: Architecture) -> np.ndarray:
    """The per-architecture change a Hugging Face tensor needs before llama.cpp reads it (float32 in and out): the
    family's own where it changes the tensor, else the common rules (Llama's Q / K rows, Gemma's norm shift)."""
    if arch.hooks.transform is not None and (changed := arch.hooks.transform(name, data, config)) is not None:
        return changed
    if arch.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
        return _permute(data, config["num_attention_heads"])
    if arch.permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
        return _permute(data, config.get("num_key_value_heads") or config["num_attention_heads"])
    if arch.norm_shift and name.endswith("norm.weight"):
        return data + np.float32(arch.norm_shift)
    return data


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from [first halves | second halves] to interleaved pairs (conversion/llama.py)."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


Config = dict[str, Any]
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Family:
    """What one family of architectures adds to the common conversion, as hooks the writer calls at fixed points
    (None: the family does what every architecture does there). Each family's module holds its functions; this
    table only plugs them in."""

    check: Callable[[Config, str], None] | None = None  # ExportError where llama.cpp would compute otherwise
    rope_kinds: tuple[str, ...] = ()  # RoPE scalings it takes beyond the common ones
    rope_check: Callable[[str, str], None] | None = None  # (kind, where): a RoPE scaling it refuses after all
    head_lengths: Callable[[Config], tuple[Any, int, int, int]] | None = None  # KV heads (per layer), K, V, rope dims
    feed_forward_length: Callable[[Config], Any] | None = None  # per layer where layers differ
    add_hyperparameters: Callable[[Any, Config], None] | None = None  # its own keys, after the common ones
    rope_tensors: Callable[[Config], list[tuple[Any, np.ndarray]]] | None = None  # (gguf.MODEL_TENSOR, data)
    split_parts: Callable[[list, Config], list] | None = None  # fused tensors split, per-expert ones stacked
    rename: Callable[[str, Shape, Config], tuple[str, Shape]] | None = None  # (name TensorNameMap knows, shape)
    gguf_name: Callable[[str, Any], str | None] | None = None  # the GGUF name, where the name map alone cannot
    transform: Callable[[str, np.ndarray, Config], np.ndarray | None] | None = None  # None: the common rules
    caveats: Callable[[Config], list[str]] | None = None  # what llama.cpp computes otherwise, said not refused


def _gemma4_rope(config: Config) -> list[tuple[Any, np.ndarray]]:
    import gguf

    return [(gguf.MODEL_TENSOR.ROPE_FREQS, gemma4.rope_factors(config))]  # read by the full-attention layers only


def _phi3_rope(config: Config) -> list[tuple[Any, np.ndarray]]:
    import gguf

    factors = phi3_longrope_factors(config)
    kinds = (gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)
    return [] if factors is None else list(zip(kinds, factors))


def _linear_attention_rename(name: str, shape: Shape, config: Config) -> tuple[str, Shape]:
    return linear_attention.lookup_name(name), linear_attention.stored_shape(name, shape)


def _linear_attention_transform(name: str, data: np.ndarray, config: Config, tiled: bool = True) -> np.ndarray | None:
    """Its layers' tensors, the gated norm included (it takes no shift); None for the others."""
    return linear_attention.transform(name, data, config, tiled=tiled) if linear_attention.MIXER in name else None


def _qwen3_next_transform(name: str, data: np.ndarray, config: Config) -> np.ndarray | None:
    changed = qwen3_next.transform(name, data, config)  # the value heads stay grouped by key head
    return changed if changed is not None else _linear_attention_transform(name, data, config, tiled=False)


def _hybrid_rename(module) -> Callable[[str, Shape, Config], tuple[str, Shape]]:
    """Granite 4.0-H's and Nemotron-H's: their module's lookup name and stored shape (the Mamba-2 tensors)."""
    return lambda name, shape, config: (module.lookup_name(name), module.stored_shape(name, shape, config))


FAMILIES: dict[str, Family] = {
    "common": Family(),
    "gemma3": Family(check=_check_gemma3, add_hyperparameters=_add_gemma3),
    "gemma4": Family(check=gemma4.check, rope_kinds=("proportional",), head_lengths=gemma4.head_lengths,
                     feed_forward_length=gemma4.feed_forward_length, add_hyperparameters=gemma4.add_hyperparameters,
                     rope_tensors=_gemma4_rope, gguf_name=gemma4.gguf_name),
    "qwen3_moe": Family(check=_check_moe),
    "gpt_oss": Family(check=_check_gpt_oss, add_hyperparameters=_add_gpt_oss_window),
    "phi3": Family(rope_kinds=("longrope",), rope_check=_check_phi3_rope, add_hyperparameters=_add_phi3,
                   rope_tensors=_phi3_rope, caveats=_phi3_caveats),
    "linear_attention": Family(check=lambda config, where: linear_attention.check(config, where, rotary_dims(config)),
                               add_hyperparameters=linear_attention.add_hyperparameters,
                               rename=_linear_attention_rename, transform=_linear_attention_transform),
    # Qwen3-Next: Qwen3.5's linear attention with its fused projections split, no MRoPE (so not its check)
    "qwen3_next": Family(check=qwen3_next.check, add_hyperparameters=linear_attention.add_hyperparameters,
                         split_parts=qwen3_next.split_parts, rename=_linear_attention_rename,
                         transform=_qwen3_next_transform),
    "latent_attention": Family(check=latent_attention.check, head_lengths=latent_attention.head_lengths,
                               add_hyperparameters=latent_attention.add_hyperparameters,
                               split_parts=latent_attention.split_parts,
                               rename=lambda name, shape, config: (latent_attention.lookup_name(name), shape),
                               transform=latent_attention.transform),
    "granite": Family(check=granite.check, head_lengths=granite.head_lengths,
                      feed_forward_length=granite.feed_forward_length, add_hyperparameters=granite.add_hyperparameters,
                      split_parts=granite.split_parts, rename=_hybrid_rename(granite), transform=granite.transform),
    "nemotron_h": Family(check=nemotron_h.check, head_lengths=nemotron_h.head_lengths,
                         feed_forward_length=nemotron_h.feed_forward_length,
                         add_hyperparameters=nemotron_h.add_hyperparameters, split_parts=nemotron_h.split_parts,
                         rename=_hybrid_rename(nemotron_h), transform=nemotron_h.transform),
    "lfm2": Family(check=lfm2.check, head_lengths=lfm2.head_lengths, feed_forward_length=lfm2.feed_forward_length,
                   add_hyperparameters=lfm2.add_hyperparameters, split_parts=lfm2.split_parts,
                   rename=lambda name, shape, config: (lfm2.lookup_name(name), lfm2.stored_shape(name, shape)),
                   transform=lambda name, data, config: lfm2.transform(name, data)),
}
