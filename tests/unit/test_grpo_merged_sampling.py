"""GRPO's sampling on merged weights (train/grpo/merged_sampling.py): inside, the adapter-free model computes what
the adapted one does (fp32, CPU) and samples the same completions; after, every weight is its own again bit for bit
and the adapter is on, also when sampling raises; where a merge cannot hold (4-bit, DoRA, too little memory), the
reason, and sampling keeps the adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from HyperSloth.config import GrpoArgs
from HyperSloth.train.grpo import merged_sampling
from HyperSloth.train.grpo.merged_sampling import MergedSampling, merged_weights, why_not
from HyperSloth.train.grpo.rollout import generation_config, sample_groups
from HyperSloth.train.tiny_architectures import tiny_config, tiny_causal_lm

VOCAB = 96


def _adapted(use_dora: bool = False):
    from peft import LoraConfig, get_peft_model

    config = tiny_config("qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.3,
                         pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = get_peft_model(tiny_causal_lm(config), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"], use_dora=use_dora, task_type="CAUSAL_LM"))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # a trained adapter: B is not zero
            torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_inside_the_adapter_free_model_computes_the_adapted_one_and_after_every_weight_is_its_own():
    model = _adapted()
    ids = torch.randint(2, VOCAB, (3, 12))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert (adapted - base).abs().max() > 0.1  # the adapter matters
    before = _weights(model)
    with torch.no_grad(), merged_weights(model):
        layers = merged_sampling.lora_projections(model)
        assert layers and all(layer.disable_adapters for layer in layers)
        merged = model(input_ids=ids).logits
    torch.testing.assert_close(merged, adapted, atol=2e-5, rtol=1e-5)
    after = _weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not any(layer.disable_adapters for layer in merged_sampling.lora_projections(model))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, adapted, atol=0, rtol=0)


def test_a_failed_sampling_puts_every_weight_back():
    model = _adapted()
    before = _weights(model)
    with pytest.raises(RuntimeError, match="reward"), merged_weights(model):
        raise RuntimeError("reward function failed")
    after = _weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not any(layer.disable_adapters for layer in merged_sampling.lora_projections(model))


def test_merged_sampling_draws_the_adapted_models_completions():
    model = _adapted()
    grpo = GrpoArgs(num_generations=4, max_completion_length=16, temperature=1.0)
    config = generation_config(grpo, pad_token_id=0, eos_token_ids=[1])
    prompts, seeds = [[5, 6, 7, 8, 9], [10, 11, 12]], [11, 12]
    adapted = sample_groups(model, prompts, seeds, grpo, config)
    sampling = MergedSampling(enabled=True)
    with sampling.context(model, limit_bytes=None):
        merged = sample_groups(model, prompts, seeds, grpo, config)
    with model.disable_adapter():
        base = sample_groups(model, prompts, seeds, grpo, config)
    same = lambda x, y: all(np.array_equal(a, b) for gx, gy in zip(x, y) for a, b in zip(gx, gy))  # noqa: E731
    assert same(merged, adapted) and not same(base, adapted)


def test_where_a_merge_cannot_hold_the_reason_is_given_and_the_adapter_samples(monkeypatch):
    model = _adapted()
    assert why_not(model, limit_bytes=None) is None
    copies = sum(layer.get_base_layer().weight.numel() * 4 for layer in merged_sampling.lora_projections(model))
    assert why_not(model, limit_bytes=int(copies / merged_sampling.MAX_COPY_SHARE) + 1) is None
    assert "would take more than 25%" in why_not(model, limit_bytes=copies)
    assert "DoRA" in why_not(_adapted(use_dora=True), limit_bytes=None)
    biased = _adapted()
    layer = merged_sampling.lora_projections(biased)[0]
    layer.lora_B["default"].bias = torch.nn.Parameter(torch.zeros(layer.lora_B["default"].out_features))
    assert "lora_bias=True" in why_not(biased, limit_bytes=None)
    with monkeypatch.context() as patch:  # Unsloth's packed MXFP4 linear (gpt-oss): its weight is not the one it runs
        patch.setattr(torch.nn.Linear, "_unsloth_mxfp4_packed_linear", True, raising=False)
        assert "base weights stored as" in why_not(model, limit_bytes=None)
    assert why_not(model, limit_bytes=None) is None
    weight = merged_sampling.lora_projections(model)[0].get_base_layer().weight
    monkeypatch.setattr(weight, "quant_state", object(), raising=False)  # what bitsandbytes' 4-bit weights carry
    assert "quantized: they cannot hold a merge" in why_not(model, limit_bytes=None)
    sampling, lines = MergedSampling(enabled=True), []
    monkeypatch.setattr(merged_sampling.logger, "info", lines.append)
    before = _weights(model)
    for _ in range(2):
        with sampling.context(model, limit_bytes=None):
            assert not any(layer.disable_adapters for layer in merged_sampling.lora_projections(model))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert len(lines) == 1 and "samples with the adapter: base weights stored as" in lines[0], lines
    with MergedSampling(enabled=False).context(_adapted(), limit_bytes=None):
        pass
    assert "grpo.sampling_weights='adapter'" in lines[-1]
