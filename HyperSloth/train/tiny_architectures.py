"""The tiny model's architectures: the same tiny shape as a Qwen3, Qwen3-MoE, gpt-oss, Qwen3.5 (dense, MoE, and the
MoE as published, multimodal), GLM-4.7-Flash, Phi-3, Llama, Mistral, Qwen2, Gemma 3 (text or multimodal), Gemma 4
(dense or MoE, multimodal as published), Granite 4.0-H or LFM2 (dense or MoE) config, so every architecture HyperSloth claims to train is
trained in the tests (and by anyone, with `hypersloth-tiny-model --architecture NAME`) without the Hub.

The MoE shape keeps transformers 5's fused experts (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) with
few experts and two active per token, so a short step routes tokens to every expert. Qwen3.5 is the hybrid of
Qwen3.5-35B-A3B and its dense siblings: linear-attention (gated delta rule) layers, the last layer full attention
(the MoE with a shared expert everywhere); on the transformers backend its linear attention runs one sample at a
time inside packed rows (train/packing/recurrent.py). GLM-4.7-Flash (`glm4_moe_lite`) has DeepSeek's multi-head
latent attention (low-rank q and kv projections, a separate RoPE part) and a dense first layer before MoE ones with
a shared expert. Gemma 4's full-attention layer has heads twice as wide as its sliding ones (a per-layer config).
Granite 4.0-H (`granite4_h`) has Mamba-2 layers, the last attention without RoPE, and MoE beside a shared MLP.
LFM2 (`lfm2`, `lfm2_moe`: Liquid AI's) has short-convolution layers, the last attention; its MoE a dense first layer.
"""

from __future__ import annotations

from typing import Any

ARCHITECTURES = ("qwen3", "qwen3_moe", "gpt_oss", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_mm", "glm4_moe_lite", "phi3",
                 "llama", "mistral", "qwen2", "gemma3", "gemma3_mm", "gemma4", "gemma4_moe", "granite4_h", "lfm2",
                 "lfm2_moe")
# Experts of the tiny MoE and how many are active per token.
TINY_EXPERTS, TINY_ACTIVE_EXPERTS = 4, 2


def _mrope_sections(frequencies: int) -> list[int]:
    """Qwen3.5's [11, 11, 10] scaled to `frequencies` rotated pairs (the first sections take the remainder)."""
    sections = [11 * frequencies // 32, 11 * frequencies // 32, 10 * frequencies // 32]
    for k in range(frequencies - sum(sections)):
        sections[k % 3] += 1
    return sections


def tiny_config(architecture: str, *, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int,
                num_heads: int, num_kv_heads: int, head_dim: int, max_position_embeddings: int,
                initializer_range: float, pad_token_id: int, eos_token_id: int):
    """The transformers config of `architecture` at this shape (float32, tied embeddings, no BOS)."""
    import transformers

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown tiny-model architecture {architecture!r}: choose one of {', '.join(ARCHITECTURES)}")
    if architecture == "gemma3_mm":  # Gemma 3 4B+: a SigLIP tower and a projector around the tiny Gemma 3
        text = tiny_config("gemma3", vocab_size=vocab_size, hidden_size=hidden_size,
                           intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                           initializer_range=initializer_range, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=32, patch_size=8)
        # the image tokens lie past the vocabulary: text never holds them
        return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                         image_token_index=vocab_size, boi_token_index=vocab_size + 1,
                                         eoi_token_index=vocab_size + 2, tie_word_embeddings=True,
                                         pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=None,
                                         initializer_range=initializer_range, dtype="float32")
    if architecture == "qwen3_5_moe_mm":  # Qwen3.5-MoE as published (35B-A3B): a vision tower around the text model
        text = tiny_config("qwen3_5_moe", vocab_size=vocab_size, hidden_size=hidden_size,
                           intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                           initializer_range=initializer_range, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
        vision = transformers.Qwen3_5MoeVisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                     patch_size=8, out_hidden_size=hidden_size,
                                                     num_position_embeddings=16, initializer_range=initializer_range)
        # the image and video tokens lie past the vocabulary: text never holds them
        return transformers.Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                             image_token_id=vocab_size, video_token_id=vocab_size + 1,
                                             vision_start_token_id=vocab_size + 2, vision_end_token_id=vocab_size + 3,
                                             tie_word_embeddings=True, pad_token_id=pad_token_id,
                                             eos_token_id=eos_token_id, bos_token_id=None, dtype="float32")
    if architecture in ("gemma4", "gemma4_moe"):  # Gemma 4 as published: a vision tower around the text model
        return _gemma4(architecture == "gemma4_moe", vocab_size=vocab_size, hidden_size=hidden_size,
                       intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                       initializer_range=initializer_range, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
        initializer_range=initializer_range, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
        bos_token_id=None, dtype="float32")
    if architecture != "phi3":  # Phi-3 derives head_dim = hidden_size / heads
        common["head_dim"] = head_dim
    extra: dict[str, Any] = {}
    if architecture == "qwen3_moe":
        extra = dict(num_experts=TINY_EXPERTS, num_experts_per_tok=TINY_ACTIVE_EXPERTS,
                     moe_intermediate_size=intermediate_size // 2, decoder_sparse_step=1, mlp_only_layers=[],
                     norm_topk_prob=True, output_router_logits=False)
    elif architecture == "gpt_oss":  # experts stored (experts, in, out), with biases; a router with a bias
        extra = dict(num_local_experts=TINY_EXPERTS, num_experts_per_tok=TINY_ACTIVE_EXPERTS,
                     sliding_window=max_position_embeddings, layer_types=["full_attention"] * num_layers,
                     rope_parameters={"rope_type": "yarn", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": max_position_embeddings,
                                      "rope_theta": 150000.0},
                     output_router_logits=False)
        common["intermediate_size"] = intermediate_size // 2  # gpt-oss's intermediate_size is the expert width
    elif architecture in ("qwen3_5", "qwen3_5_moe"):  # Qwen3.5's text model: linear-attention layers, the last full
        width = intermediate_size // 2  # the experts' and the shared expert's
        experts = dict(num_experts=TINY_EXPERTS, num_experts_per_tok=TINY_ACTIVE_EXPERTS, moe_intermediate_size=width,
                       shared_expert_intermediate_size=width, output_router_logits=False)
        extra = dict(**(experts if architecture == "qwen3_5_moe" else {}),
                     layer_types=["linear_attention"] * (num_layers - 1) + ["full_attention"],
                     linear_num_key_heads=num_kv_heads, linear_num_value_heads=num_heads, linear_key_head_dim=head_dim,
                     linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
                     # Qwen3.5's MRoPE sections [11, 11, 10] are the 32 frequencies of its rotated 64 dims (0.25 of
                     # 256); scaled to this head's, so llama.cpp (which asserts they fit) runs its GGUF too
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                      "mrope_interleaved": True,
                                      "mrope_section": _mrope_sections(int(head_dim * 0.25) // 2)})
    elif architecture == "granite4_h":  # Granite 4.0-H: Mamba-2 layers, the last attention (no RoPE), MoE + shared MLP
        width = intermediate_size // 2
        extra = dict(num_local_experts=TINY_EXPERTS, num_experts_per_tok=TINY_ACTIVE_EXPERTS,
                     shared_intermediate_size=width, position_embedding_type="nope",
                     layer_types=["mamba"] * (num_layers - 1) + ["attention"], mamba_n_heads=num_heads,
                     mamba_d_head=2 * hidden_size // num_heads, mamba_d_state=head_dim, mamba_chunk_size=head_dim,
                     output_router_logits=False)
        common.pop("head_dim", None)
        common["intermediate_size"] = width  # the experts' width
    elif architecture in ("lfm2", "lfm2_moe"):  # LFM2: short-convolution layers, the last attention; the MoE's
        extra = dict(layer_types=["conv"] * (num_layers - 1) + ["full_attention"],  # first layer dense
                     block_auto_adjust_ff_dim=False, conv_bias=False)
        if architecture == "lfm2_moe":
            extra.update(num_dense_layers=1, num_experts=TINY_EXPERTS, num_experts_per_tok=TINY_ACTIVE_EXPERTS,
                         moe_intermediate_size=intermediate_size // 2)
    elif architecture == "glm4_moe_lite":  # MLA: heads of nope + rope dims for q/k, v of head_dim; layer 0 dense
        extra = dict(n_routed_experts=TINY_EXPERTS, num_experts_per_tok=TINY_ACTIVE_EXPERTS, n_shared_experts=1,
                     moe_intermediate_size=intermediate_size // 2, kv_lora_rank=2 * head_dim, q_lora_rank=2 * head_dim,
                     qk_rope_head_dim=head_dim // 2, qk_nope_head_dim=head_dim // 2, v_head_dim=head_dim,
                     n_group=1, topk_group=1, mlp_layer_types=["dense"] + ["sparse"] * (num_layers - 1))
        common.pop("head_dim", None)
        common["num_key_value_heads"] = num_heads  # MLA: one latent kv, every head its own
    elif architecture == "gemma3":
        extra = dict(query_pre_attn_scalar=head_dim, sliding_window=max_position_embeddings,
                     hidden_activation="gelu_pytorch_tanh")
    classes = {"qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "phi3": "Phi3Config", "gpt_oss": "GptOssConfig",
               "qwen3_5": "Qwen3_5TextConfig", "qwen3_5_moe": "Qwen3_5MoeTextConfig",
               "glm4_moe_lite": "Glm4MoeLiteConfig", "granite4_h": "GraniteMoeHybridConfig", "lfm2": "Lfm2Config",
               "lfm2_moe": "Lfm2MoeConfig", "llama": "LlamaConfig",
               "mistral": "MistralConfig", "qwen2": "Qwen2Config", "gemma3": "Gemma3TextConfig"}
    return getattr(transformers, classes[architecture])(**common, **extra)


def _gemma4(moe: bool, *, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
            num_kv_heads: int, head_dim: int, max_position_embeddings: int, initializer_range: float,
            pad_token_id: int, eos_token_id: int):
    """Gemma 4 (31B; 26B-A4B with `moe`: an expert block beside each layer's MLP) at this shape: sliding layers
    of `head_dim`, the last layer full attention with heads twice as wide (a heterogeneous config, as Gemma 4's
    256 / 512), a SigLIP-like tower of one layer; no per-layer embeddings (the E2B / E4B models' own)."""
    import transformers

    experts = dict(enable_moe_block=True, num_experts=TINY_EXPERTS, top_k_experts=TINY_ACTIVE_EXPERTS,
                   moe_intermediate_size=intermediate_size // 2) if moe else {}
    text = transformers.Gemma4TextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, global_head_dim=2 * head_dim, sliding_window=max_position_embeddings // 8,
        layer_types=["sliding_attention"] * (num_layers - 1) + ["full_attention"], hidden_size_per_layer_input=0,
        max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
        pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=None, tie_word_embeddings=True, **experts)
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16, patch_size=8,
                                             position_embedding_size=16,
                                             initializer_range=initializer_range)
    # the image and video tokens lie past the vocabulary: text never holds them
    return transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                                     image_token_id=vocab_size, boi_token_id=vocab_size + 1,
                                     eoi_token_id=vocab_size + 2, video_token_id=vocab_size + 3,
                                     tie_word_embeddings=True, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                                     bos_token_id=None, initializer_range=initializer_range)


def tiny_causal_lm(config):
    """A random-weight model of `config` (the caller seeds torch): a multimodal config's whole model, as such
    checkpoints are published (AutoModelForCausalLM would build Qwen3.5-MoE's text model alone)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if getattr(config, "vision_config", None) is not None:
        return AutoModelForImageTextToText.from_config(config)
    return AutoModelForCausalLM.from_config(config)
