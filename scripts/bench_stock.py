"""The stock baselines' model, loaded one way for every stock runner of the benchmark (SFT, DPO, GRPO) and
scripts/moe_diag.py: Unsloth's FastLanguageModel in bf16 (4-bit where the workload is) on one GPU, then its
get_peft_model with the shared LoRA settings (r=16, alpha=16, no dropout, no bias). Unsloth must be imported
before the caller imports transformers or trl (it patches them), so callers import it first themselves."""

from __future__ import annotations


def stock_lora_model(checkpoint: str, *, max_seq_length: int, projections: list[str], seed: int,
                     gradient_checkpointing, load_in_4bit: bool = False, device: int = 0):
    """(model with LoRA, tokenizer) as stock Unsloth gives them; `projections` are the target_modules (on an MoE
    model Unsloth maps gate/up/down_proj onto the experts itself)."""
    import torch
    from unsloth import FastLanguageModel

    model, tok = FastLanguageModel.from_pretrained(checkpoint, max_seq_length=max_seq_length, dtype=torch.bfloat16,
                                                   load_in_4bit=load_in_4bit, device_map={"": device})
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0, bias="none",
                                             target_modules=projections, random_state=seed,
                                             use_gradient_checkpointing=gradient_checkpointing)
    return model, tok
