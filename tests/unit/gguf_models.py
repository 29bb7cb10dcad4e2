"""Tiny random-weight models of each architecture the GGUF writer supports, with the tiny model's tokenizer,
for tests/unit/test_gguf*.py (a helper module, not a test file)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# Shapes: rows of 64 and 128 (multiples of every quant block), GQA (4 query heads over 2 KV heads).
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
             tie_word_embeddings=False)
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's 12 + 30? Answer in   three words, then say 'done'.\n\tThanks!"},
        {"role": "assistant", "content": "It is 42 -- done."}]


def tiny_config(architecture: str, **changes):
    """A transformers config of `architecture` at the tiny shape (Gemma 3 with one sliding-window layer; Qwen3-MoE
    with the tiny MoE's 4 experts, 2 active, each 96 wide; gpt-oss likewise, its first layer sliding; Phi-3 with its
    fused projections; Gemma 4 with `changes` to its config: `gemma4_config`)."""
    from transformers import (Gemma3TextConfig, GptOssConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config, Qwen3MoeConfig)

    from HyperSloth.train.tiny_architectures import TINY_ACTIVE_EXPERTS, TINY_EXPERTS

    if architecture == "Gemma3ForCausalLM":
        return Gemma3TextConfig(**SHAPE, query_pre_attn_scalar=16, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"])
    if architecture == "Gemma4ForCausalLM":
        return gemma4_config(**changes)
    if architecture == "Qwen3MoeForCausalLM":  # expert rows of 96: unlike the hidden 64, and whole 32-blocks
        return Qwen3MoeConfig(**SHAPE, num_experts=TINY_EXPERTS, num_experts_per_tok=TINY_ACTIVE_EXPERTS,
                              moe_intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if architecture == "GptOssForCausalLM":  # intermediate_size is its expert width (96); a sliding layer first
        return GptOssConfig(**{**SHAPE, "intermediate_size": 96}, num_local_experts=TINY_EXPERTS,
                            num_experts_per_tok=TINY_ACTIVE_EXPERTS, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"],
                            rope_parameters={"rope_type": "yarn", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False, "original_max_position_embeddings": 256,
                                             "rope_theta": 150000.0})
    if architecture == "Phi3ForCausalLM":  # fused qkv_proj and gate_up_proj
        return Phi3Config(**SHAPE)
    if architecture in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"):  # gated-delta-rule layers, then a full one;
        from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig  # 2 key heads, 4 value heads

        linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                      linear_conv_kernel_dim=4, layer_types=["linear_attention", "linear_attention", "full_attention"],
                      # half of each head rotated, its 4 frequencies in MRoPE sections of 2, 1, 1 (llama.cpp asserts
                      # the sections fit the head; Qwen3.5's own [11, 11, 10] are the 32 frequencies of its 256-wide
                      # heads' 0.25)
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                       "mrope_section": [2, 1, 1], "mrope_interleaved": True})
        if architecture == "Qwen3_5ForCausalLM":  # the dense Qwen3.5 (0.8B to 27B)
            return Qwen3_5TextConfig(**{**SHAPE, "num_hidden_layers": 3}, **linear)
        return Qwen3_5MoeTextConfig(**{**SHAPE, "num_hidden_layers": 3}, num_experts=TINY_EXPERTS,
                                    num_experts_per_tok=TINY_ACTIVE_EXPERTS, moe_intermediate_size=96,
                                    shared_expert_intermediate_size=96, **linear)
    if architecture == "Glm4MoeLiteForCausalLM":  # latent attention (kv rank 32, q rank 32); a dense layer first
        from transformers import Glm4MoeLiteConfig

        shape = {k: v for k, v in SHAPE.items() if k != "head_dim"}  # Glm4MoeLiteConfig reads it as the rope dims
        return Glm4MoeLiteConfig(**{**shape, "num_hidden_layers": 3, "num_key_value_heads": 4},
                                 n_routed_experts=TINY_EXPERTS, num_experts_per_tok=TINY_ACTIVE_EXPERTS,
                                 n_shared_experts=1, moe_intermediate_size=96, kv_lora_rank=32, q_lora_rank=32,
                                 qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=1.8,
                                 norm_topk_prob=True, mlp_layer_types=["dense", "sparse", "sparse"])
    if architecture == GRANITE4_H:
        return granite4_h_config(**changes)
    if architecture == NEMOTRON_H:
        return nemotron_h_config(**changes)
    if architecture == QWEN3_NEXT:
        return qwen3_next_config(**changes)
    if architecture in (LFM2, LFM2_MOE):
        return lfm2_config(moe=architecture == LFM2_MOE, **changes)
    classes = {"Qwen3ForCausalLM": Qwen3Config, "Qwen2ForCausalLM": Qwen2Config, "LlamaForCausalLM": LlamaConfig,
               "MistralForCausalLM": MistralConfig}
    return classes[architecture](**SHAPE)


def gemma4_config(moe: bool = False, **changes):
    """A tiny Gemma 4 text model (Gemma4TextConfig, as 31B's; with `moe`, 26B-A4B's expert block beside each
    layer's MLP: 4 experts of 96, 2 active): a sliding layer of heads 16 wide and window 8, then a full-attention
    layer of heads 32 wide (Gemma 4's 256 / 512) with proportional RoPE on a quarter of it; final logits soft-capped
    at 30; no per-layer embeddings. `changes`: other Gemma4TextConfig arguments (attention_k_eq_v, ...)."""
    from transformers import Gemma4TextConfig

    from HyperSloth.train.tiny_architectures import TINY_ACTIVE_EXPERTS, TINY_EXPERTS

    experts = dict(enable_moe_block=True, num_experts=TINY_EXPERTS, top_k_experts=TINY_ACTIVE_EXPERTS,
                   moe_intermediate_size=96) if moe else {}
    return Gemma4TextConfig(**{**SHAPE, "global_head_dim": 32, "sliding_window": 8,
                               "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 30.0,
                               "hidden_size_per_layer_input": 0, **experts, **changes})


# The tiny Gemma 4 as transformers builds it by default (dense, a KV projection in every layer), with
# attention_k_eq_v (the full layer's keys are its values, over num_global_key_value_heads 1), as 26B-A4B (the same,
# with the expert block), and as E2B / E4B (4 layers: per-layer embeddings 8 wide, the last 2 layers reusing the KV
# of the first 2, their MLPs twice as wide): build_arch_model(GEMMA4, ..., **GEMMA4_VARIANTS[name]). k_eq_v at
# seed 1: at seed 0 one of the chat's positions is a near tie (top-2 margin 0.02% of the range) llama.cpp flips.
GEMMA4 = "Gemma4ForCausalLM"
GEMMA4_VARIANTS = {"dense": {}, "k_eq_v": {"attention_k_eq_v": True, "num_global_key_value_heads": 1, "seed": 1},
                   "moe": {"moe": True, "attention_k_eq_v": True, "num_global_key_value_heads": 1},
                   "e2b": {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                           "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 512,
                           "num_kv_shared_layers": 2, "use_double_wide_mlp": True}}


GRANITE4_H = "GraniteMoeHybridForCausalLM"


def granite4_h_config(**changes):
    """A tiny Granite 4.0-H (GraniteMoeHybridConfig): a Mamba-2 layer, an attention layer without RoPE, a Mamba-2
    layer; 8 Mamba heads 16 wide (inner 128) over a state of 16; each layer's 4 experts of 96, 2 active, beside a
    shared MLP of 64; Granite's multipliers away from 1 (the published 1B's embedding 12, residual 0.22, attention
    1/128, logits 6 as it has them, scaled to this shape). `changes`: other GraniteMoeHybridConfig arguments."""
    from transformers import GraniteMoeHybridConfig

    from HyperSloth.train.tiny_architectures import TINY_ACTIVE_EXPERTS, TINY_EXPERTS

    shape = {key: value for key, value in SHAPE.items() if key != "head_dim"}  # hidden / heads (16) for Granite
    return GraniteMoeHybridConfig(**{**shape, "num_hidden_layers": 3, "intermediate_size": 96,
                                     "num_local_experts": TINY_EXPERTS, "num_experts_per_tok": TINY_ACTIVE_EXPERTS,
                                     "shared_intermediate_size": 64, "position_embedding_type": "nope",
                                     "layer_types": ["mamba", "attention", "mamba"], "mamba_n_heads": 8,
                                     "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16,
                                     "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                     "attention_multiplier": 1 / 16, "logits_scaling": 6.0, **changes})


NEMOTRON_H = "NemotronHForCausalLM"


def nemotron_h_config(moe: bool = False, **changes):
    """A tiny Nemotron-H (NemotronHConfig): blocks of one mixer each, Mamba-2, MLP, attention without RoPE, MLP
    (`moe`: the MLPs as 4 ReLU² experts of 96, 2 active, sigmoid-routed with a score correction, beside a shared
    expert of 64); 8 Mamba heads of 16 in 2 groups over a state of 16. `changes`: other NemotronHConfig arguments."""
    from transformers import NemotronHConfig

    from HyperSloth.train.tiny_architectures import TINY_ACTIVE_EXPERTS, TINY_EXPERTS

    shape = {key: value for key, value in SHAPE.items() if key not in ("num_hidden_layers", "rms_norm_eps")}
    feed_forward = "moe" if moe else "mlp"
    experts = dict(n_routed_experts=TINY_EXPERTS, num_experts_per_tok=TINY_ACTIVE_EXPERTS, moe_intermediate_size=96,
                   moe_shared_expert_intermediate_size=64, n_shared_experts=1, routed_scaling_factor=2.5) if moe else {}
    return NemotronHConfig(**{**shape, "layers_block_type": ["mamba", feed_forward, "attention", feed_forward],
                              "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
                              "chunk_size": 16, "layer_norm_epsilon": 1e-6, **experts, **changes})


QWEN3_NEXT = "Qwen3NextForCausalLM"


def qwen3_next_config(**changes):
    """A tiny Qwen3-Next (Qwen3NextConfig): 2 gated-delta-rule layers with 2 key and 4 value heads of 16, then a gated
    attention layer with a quarter of each head rotated; every layer's 4 experts of 96, 2 active, beside a gated shared
    expert of 96. `changes`: other Qwen3NextConfig arguments."""
    from transformers import Qwen3NextConfig

    from HyperSloth.train.tiny_architectures import TINY_ACTIVE_EXPERTS, TINY_EXPERTS

    return Qwen3NextConfig(**{**SHAPE, "num_hidden_layers": 3, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                              "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                              "layer_types": ["linear_attention", "linear_attention", "full_attention"],
                              "num_experts": TINY_EXPERTS, "num_experts_per_tok": TINY_ACTIVE_EXPERTS,
                              "moe_intermediate_size": 96, "shared_expert_intermediate_size": 96, **changes})


LFM2, LFM2_MOE = "Lfm2ForCausalLM", "Lfm2MoeForCausalLM"


def lfm2_config(moe: bool = False, **changes):
    """A tiny LFM2 (Lfm2Config): a short-convolution layer (3 taps), an attention layer, a convolution layer; the
    MLP's width adjusted as the published models' (block_auto_adjust_ff_dim: 2/3 of 144, times 1.5, up to a multiple
    of 32: 160). `moe`: LFM2-MoE (Lfm2MoeConfig), its first layer dense (128 wide), the others 4 experts of 96, 2
    active, sigmoid-routed with an expert bias. `changes`: other config arguments."""
    from transformers import Lfm2Config, Lfm2MoeConfig

    from HyperSloth.train.tiny_architectures import TINY_ACTIVE_EXPERTS, TINY_EXPERTS

    shape = {key: value for key, value in SHAPE.items() if key not in ("rms_norm_eps", "tie_word_embeddings")}
    common = dict(shape, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], norm_eps=1e-6,
                  conv_L_cache=3, conv_bias=False, tie_word_embeddings=moe)
    if moe:  # lfm2moe reads the output projection from the embeddings: tied
        return Lfm2MoeConfig(**{**common, "num_dense_layers": 1, "num_experts": TINY_EXPERTS,
                                "num_experts_per_tok": TINY_ACTIVE_EXPERTS, "moe_intermediate_size": 96, **changes})
    return Lfm2Config(**{**common, "intermediate_size": 144, "block_auto_adjust_ff_dim": True,
                         "block_ffn_dim_multiplier": 1.5, "block_multiple_of": 32, **changes})


def build_arch_model(architecture: str, out: Path, tokenizer_dir: Path, seed: int = 0,
                     special_ids: tuple[int | None, int, int | None] = (None, 2, 0), **changes) -> Path:
    """Save a random `architecture` model (std 0.1, biases and norms random too) + the tokenizer to `out`;
    `special_ids`: the tokenizer's BOS, EOS, PAD (the tiny tokenizer's by default); `changes`: tiny_config's."""
    torch.manual_seed(seed)
    config = tiny_config(architecture, **changes)
    config.architectures = [architecture]
    config.bos_token_id, config.eos_token_id, config.pad_token_id = special_ids
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # norms around 1 (Gemma 3's around 0: it scales by 1 + weight), so a wrong shift shows in the logits
    return save_random(model, out, tokenizer_dir, norms_at=0.0 if architecture.startswith("Gemma3") else 1.0)


def saved_fused(model: Path, out: Path) -> Path:
    """`model` loaded and saved again as transformers 5 holds it (its experts fused, save_original_format=False)."""
    AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).save_pretrained(
        str(out), save_original_format=False)
    AutoTokenizer.from_pretrained(str(model)).save_pretrained(str(out))
    return out


def save_random(model, out: Path, tokenizer_dir: Path, norms_at: float = 1.0, gated_norms_at: float | None = None
                ) -> Path:
    """`model` with every weight drawn around 0 (std 0.1), its norms around `norms_at` (Qwen3.5's gated norm inside
    its linear attention around `gated_norms_at`, where given), Gemma 4's router scales around 1, GLM's routing
    correction, LFM2-MoE's expert bias and Gemma 4's layer scalars (buffers: zeros and ones until trained) random
    too; saved with the tokenizer of `tokenizer_dir` to `out`. The caller seeds torch."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            gated = gated_norms_at is not None and "linear_attn.norm" in name
            scale = name.endswith(("router.scale", "router.per_expert_scale"))
            param.normal_(gated_norms_at if gated else norms_at if "norm" in name else 1.0 if scale else 0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                buffer.normal_(0.0, 0.1)
            if name.endswith("layer_scalar"):
                buffer.normal_(1.0, 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))
    return out


SPM_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]")
SPM_IDS = (1, 2, None)  # BOS, EOS, PAD of the SentencePiece-style tokenizer
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
                    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def build_spm_tokenizer(out: Path, vocab_size: int = 512) -> Path:
    """A SentencePiece-style tokenizer as Mistral v0.3's tokenizer.json is (BPE with byte_fallback, a Metaspace
    "▁" pre-tokenizer prepended to the first word, `<0xXX>` byte tokens after the specials, `<s>` added in front,
    the `[INST]` chat template), trained on data/sample_chat.jsonl's messages; saved to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from HyperSloth.train.tiny_model import DEFAULT_DATA_PATH, read_messages

    def configured(model) -> Tokenizer:
        backend = Tokenizer(model)
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
        return backend

    texts = [message["content"] for messages in read_messages(DEFAULT_DATA_PATH) for message in messages]
    trained = configured(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    trained.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size - 256, show_progress=False,
                                                           special_tokens=list(SPM_SPECIALS)))
    merges = [tuple(merge) for merge in json.loads(trained.to_str())["model"]["merges"]]  # [left, right] pairs
    learned = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    pieces = [text for text, _ in learned if text not in SPM_SPECIALS]
    vocab = {text: index for index, text in enumerate([*SPM_SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *pieces])}
    backend = configured(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.add_special_tokens(list(SPM_SPECIALS))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B:1",
                                                           special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            chat_template=MISTRAL_TEMPLATE, clean_up_tokenization_spaces=False).save_pretrained(out)
    return out


def gemma_style(tokenizer_dir: Path) -> Path:
    """The tokenizer of `tokenizer_dir` (build_spm_tokenizer's) rewritten as transformers' GemmaTokenizer builds
    Gemma 3's: spaces replaced by "▁" in a normalizer, none prepended, a split on " " (a no-op after it)."""
    path = tokenizer_dir / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    spec["pre_tokenizer"] = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                             "invert": False}
    spec["decoder"]["decoders"] = [step for step in spec["decoder"]["decoders"] if step["type"] != "Strip"]
    path.write_text(json.dumps(spec))
    return tokenizer_dir


def build_qwen35_from_multimodal(out: Path, tokenizer_dir: Path) -> Path:
    """A tiny Qwen3.5-MoE as a fine-tune of the published checkpoint leaves it: the multimodal
    Qwen3_5MoeForConditionalGeneration (as Qwen3.5-35B-A3B is published) loaded with AutoModelForCausalLM (the text
    model) and saved, which transformers 5 does under the checkpoint's names, `model.language_model.layers...`.
    Heads of 128 with Qwen3.5's rotated quarter, so its default MRoPE sections [11, 11, 10] fit."""
    from transformers import Qwen3_5MoeConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

    from HyperSloth.train.tiny_architectures import TINY_ACTIVE_EXPERTS, TINY_EXPERTS

    text = dict(vocab_size=SHAPE["vocab_size"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=128, num_experts=TINY_EXPERTS, num_experts_per_tok=TINY_ACTIVE_EXPERTS,
                moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                layer_types=["linear_attention", "full_attention"], eos_token_id=2, pad_token_id=0, bos_token_id=None)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision)).save_pretrained(
        str(out / "multimodal"))
    model = AutoModelForCausalLM.from_pretrained(str(out / "multimodal"), dtype=torch.float32)
    return save_random(model, out / "text", tokenizer_dir, norms_at=1.0, gated_norms_at=0.0)


def build_gemma3_multimodal(out: Path, tokenizer_dir: Path) -> Path:
    """A tiny Gemma3ForConditionalGeneration (as Gemma 3 4B and larger are published: a SigLIP tower, a projector
    and the language model, saved under `language_model.model...`), its text part at the tiny Gemma 3's shape with
    the sliding layer, random weights (norms around 0: Gemma scales by 1 + weight)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = tiny_config("Gemma3ForCausalLM").to_dict()
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=5,
                          boi_token_index=6, eoi_token_index=7, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    return save_random(Gemma3ForConditionalGeneration(config), out, tokenizer_dir, norms_at=0.0)
