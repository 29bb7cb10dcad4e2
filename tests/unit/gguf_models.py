"""Tiny random-weight models of each architecture the GGUF writer supports, with the tiny model's tokenizer,
for tests/unit/test_gguf*.py (a helper module, not a test file)."""

from __future__ import annotations

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


def tiny_config(architecture: str):
    """A transformers config of `architecture` at the tiny shape (Gemma 3 with one sliding-window layer; Qwen3-MoE
    with the tiny MoE's 4 experts, 2 active, each 96 wide)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    from HyperSloth.train.tiny_architectures import TINY_ACTIVE_EXPERTS, TINY_EXPERTS

    if architecture == "Gemma3ForCausalLM":
        return Gemma3TextConfig(**SHAPE, query_pre_attn_scalar=16, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"])
    if architecture == "Qwen3MoeForCausalLM":  # expert rows of 96: unlike the hidden 64, and whole 32-blocks
        return Qwen3MoeConfig(**SHAPE, num_experts=TINY_EXPERTS, num_experts_per_tok=TINY_ACTIVE_EXPERTS,
                              moe_intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    classes = {"Qwen3ForCausalLM": Qwen3Config, "Qwen2ForCausalLM": Qwen2Config, "LlamaForCausalLM": LlamaConfig,
               "MistralForCausalLM": MistralConfig}
    return classes[architecture](**SHAPE)


def build_arch_model(architecture: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a random `architecture` model (std 0.1, biases and norms random too) + the tokenizer to `out`."""
    torch.manual_seed(seed)
    config = tiny_config(architecture)
    config.architectures = [architecture]
    config.bos_token_id, config.eos_token_id, config.pad_token_id = None, 2, 0  # the tiny tokenizer's
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # norms around 1 (Gemma's around 0: it scales by 1 + weight), so a wrong shift shows in the logits
            centre = 0.0 if "norm" not in name or architecture.startswith("Gemma") else 1.0
            param.normal_(centre, 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))
    return out
