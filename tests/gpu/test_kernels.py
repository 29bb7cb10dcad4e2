"""Kernels on one GPU that the CPU suite cannot run: the grouped expert adapters through torch's CUDA grouped GEMM
(bf16), and FlashAttention-4 through torch's registry as HyperSloth hooks it up. Skipped without CUDA (and FA4
without flash-attn-4). On the lent GPU machine: `source scripts/gpu_env.sh && python3 -m pytest -q tests/gpu`."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_grouped_expert_adapters_equal_peft_on_the_gpu():
    from HyperSloth.config import LoraArgs
    from HyperSloth.train.lora.experts import install_grouped_expert_lora
    from HyperSloth.train.model import _attach_peft
    from HyperSloth.train.tiny_architectures import tiny_causal_lm, tiny_config

    config = tiny_config("qwen3_moe", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512,
                         initializer_range=0.02, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    peft_model = _attach_peft(tiny_causal_lm(config).to("cuda", torch.bfloat16), LoraArgs(r=8, lora_alpha=16))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    ours = copy.deepcopy(peft_model)
    assert install_grouped_expert_lora(ours) == (2, None)
    ids = torch.randint(2, 256, (1, 384), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    results = []
    for model in (peft_model, ours):
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}))
    (peft_loss, peft_grads), (our_loss, our_grads) = results
    assert our_loss == pytest.approx(peft_loss, rel=2e-3)  # bf16: the two sum the adapter in different orders
    for name, grad in peft_grads.items():
        scale = grad.abs().max().item() or 1.0
        assert (our_grads[name] - grad).abs().max().item() <= 0.05 * scale, name


def test_fa4_agrees_with_bundled_flash_through_hypersloths_hookup():
    from HyperSloth.train.attention.fa4 import agreement_check, route_torch_fa4_here
    from HyperSloth.train.attention.setting import fa4_installed, torch_registry

    if not fa4_installed() or torch_registry() is None:
        pytest.skip("needs flash-attn-4 and torch >= 2.11")
    registry = torch_registry()
    assert route_torch_fa4_here()
    try:
        found = agreement_check(16, 8, 128, graphed=True)(registry)  # Qwen3-0.6B's heads, as a graphed run
        assert found.error is None, found.error
        assert found.fa4_ms > 0 and found.flash_ms > 0 and found.row_tokens == 8192 and found.graphed
        assert registry.current_flash_attention_impl() == "FA4"
    finally:
        registry.restore_flash_attention_impl(_raise_warn=False)
