"""Preference pairs: packed layout, per-segment log-probabilities, the DPO loss and the reference switch.

Every number is checked against a plain computation on the pair's sequences run one at a time (full
logits, log_softmax, gather): packing, chunking and the segment sums must change nothing.
"""

import math

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from HyperSloth.train.dpo.preference import (
    REFERENCE_ADAPTER,
    ReferenceSwitch,
    add_reference_adapter,
    collate_pairs,
    dpo_loss,
    pair_logps,
    segment_logps,
    token_logps,
)

VOCAB = 97


def _model(seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         tie_word_embeddings=True)
    base = Qwen3ForCausalLM(config)
    base.config._attn_implementation = "sdpa"
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # B starts at 0 (policy == reference); move it so the two differ
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    return model


def _pairs(seed: int = 0, n: int = 4) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(3, VOCAB, size=int(rng.integers(lo, hi))) for lo, hi in ((2, 9), (1, 7), (1, 7)))
            for _ in range(n)]


def _plain_logp(model, prompt: np.ndarray, completion: np.ndarray) -> float:
    """log p(completion | prompt) from one unpacked forward with full logits."""
    ids = torch.from_numpy(np.concatenate([prompt, completion]))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    logp = logits.log_softmax(-1).gather(1, ids[0, 1:, None]).squeeze(1)
    return float(logp[len(prompt) - 1:].sum())


def test_a_pair_is_two_segments_with_the_prompt_masked():
    prompt, chosen, rejected = np.array([5, 6, 7]), np.array([8, 9]), np.array([10])
    batch = collate_pairs([(prompt, chosen, rejected)])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 5, 6, 7, 10]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    # The targets: chosen 8, 9 (predicted at positions 2, 3) and rejected 10 (at position 7); never the prompt.
    assert batch["target_index"].tolist() == [2, 3, 7] and batch["target_ids"].tolist() == [8, 9, 10]
    assert batch["target_segment"].tolist() == [0, 0, 1] and "labels" not in batch


def test_bucketing_pads_with_a_segment_that_scores_nothing():
    pairs = _pairs(n=3)
    plain, padded = collate_pairs(pairs), collate_pairs(pairs, bucket=True, with_lengths=True)
    real = plain["input_ids"].shape[1]
    assert padded["input_ids"].shape[1] == 64 > real  # bucket_tokens' minimum
    for key in ("target_index", "target_ids", "target_segment"):  # the pad segment has no target
        assert torch.equal(plain[key], padded[key])
    assert padded["packed_seq_lengths"].tolist()[-1] == 64 - real
    model = _model()
    with torch.no_grad():
        assert torch.allclose(segment_logps(model, plain, 6), segment_logps(model, padded, 6), atol=1e-6)


def test_segment_logps_equal_each_sequence_run_alone():
    model, pairs = _model(), _pairs()
    with torch.no_grad():
        packed = segment_logps(model, collate_pairs(pairs), 2 * len(pairs))
    expected = [_plain_logp(model, p, c) for p, chosen, rejected in pairs for c in (chosen, rejected)]
    np.testing.assert_allclose(packed.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_chunked_token_logps_and_gradients_equal_full_logits():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight, targets = torch.randn(VOCAB, 16, dtype=torch.float64), torch.randint(0, VOCAB, (37,))
    chunked = token_logps(hidden, weight, targets, chunk=8)
    full = (hidden @ weight.t()).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(chunked, full)
    (grad_chunked,) = torch.autograd.grad(chunked.square().sum(), hidden)
    (grad_full,) = torch.autograd.grad(full.square().sum(), hidden)
    torch.testing.assert_close(grad_chunked, grad_full)


def test_dpo_loss_is_the_sigmoid_loss_with_trl_rewards():
    model, pairs = _model(), _pairs(n=5)
    logps = pair_logps(model, collate_pairs(pairs), 5, ReferenceSwitch(model))
    loss, sums = dpo_loss(logps, beta=0.3, denominator=8)
    with model.disable_adapter():
        ref = [[_plain_logp(model, p, c) for c in (ch, rj)] for p, ch, rj in pairs]
    policy = [[_plain_logp(model, p, c) for c in (ch, rj)] for p, ch, rj in pairs]
    chosen = np.array([pol[0] - r[0] for pol, r in zip(policy, ref)])
    rejected = np.array([pol[1] - r[1] for pol, r in zip(policy, ref)])
    expected = np.sum(np.log1p(np.exp(-0.3 * (chosen - rejected)))) / 8
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    c, r = 0.3 * chosen, 0.3 * rejected
    np.testing.assert_allclose(sums.numpy(), [c.sum(), r.sum(), (c > r).sum(), (c - r).sum()], rtol=1e-4, atol=1e-5)
    assert 0 < sums[2] < 5  # the random adapter prefers some chosen and some rejected answers


def test_the_reference_forward_gets_no_gradient_and_uses_no_dropout(tmp_path):
    model = _model(dropout=0.5)
    model.save_pretrained(str(tmp_path / "init"))  # an "initial adapter" (SFT before DPO)
    reference = add_reference_adapter(model, str(tmp_path / "init"))
    grad_modes: list[bool] = []
    training_modes: list[bool] = []
    hook = model.get_base_model().model.layers[0].register_forward_pre_hook(
        lambda module, args: grad_modes.append(torch.is_grad_enabled()) or training_modes.append(module.training))
    model.train()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if f".{REFERENCE_ADAPTER}." in n}
    logps = pair_logps(model, collate_pairs(_pairs()), 4, reference)
    hook.remove()
    assert grad_modes == [True, False] and training_modes == [True, False]  # policy, then reference
    assert not logps.ref_chosen.requires_grad and logps.chosen.requires_grad
    dpo_loss(logps, 0.1, 4)[0].backward()
    reference_params = [p for n, p in model.named_parameters() if f".{REFERENCE_ADAPTER}." in n]
    assert frozen and all(not p.requires_grad and p.grad is None for p in reference_params)
    trained = [p for n, p in model.named_parameters() if ".default." in n]
    assert all(p.requires_grad for p in trained) and any(p.grad.abs().sum() > 0 for p in trained)
    assert model.active_adapter == "default" and model.training
    # The reference is the initial adapter, in eval mode: policy == reference before any update.
    model.eval()
    logps = pair_logps(model, collate_pairs(_pairs()), 4, reference)
    assert float(dpo_loss(logps, 0.1, 4)[0].detach()) == pytest.approx(math.log(2), abs=1e-6)


def test_the_reference_without_an_initial_adapter_is_the_base_model():
    model, pairs = _model(), _pairs()
    logps = pair_logps(model, collate_pairs(pairs), 4, ReferenceSwitch(model))
    with model.disable_adapter():
        expected = [_plain_logp(model, p, c) for p, c, _ in pairs]
    np.testing.assert_allclose(logps.ref_chosen.numpy(), expected, rtol=1e-5, atol=1e-5)
