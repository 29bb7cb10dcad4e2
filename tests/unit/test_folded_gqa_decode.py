"""patches.unsloth_folded_gqa_decode: Unsloth's decode attention for a batch of left-padded rows, with a KV head's
query heads folded into query rows instead of K and V copied to every query head. Against an expanded reference
(the repeat_kv form Unsloth runs for Qwen3), fp32 on the CPU: the same output; the original is called where the fold
does not apply, and the block puts the original back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from HyperSloth.train.patches import folded_gqa_decode_attention, unsloth_folded_gqa_decode

B, H, H_KV, D, L_MAX = 5, 8, 2, 16, 40


def _layer(kv_len: int, sliding_window=None):
    torch.manual_seed(0)
    layer = SimpleNamespace(config=SimpleNamespace(sliding_window=sliding_window), num_key_value_groups=H // H_KV,
                            paged_attention_K=torch.randn(L_MAX, B, H_KV, D),
                            paged_attention_V=torch.randn(L_MAX, B, H_KV, D))
    layer.paged_attention_K[kv_len:] = float("nan")  # rows past the length must never be read
    layer.paged_attention_V[kv_len:] = float("nan")
    return layer


def _expanded(layer, q, kv_len, keep):
    """softmax(Q K^T / sqrt(D)) V with K and V repeated to every query head, in float64."""
    k = layer.paged_attention_K[:kv_len].permute(1, 2, 0, 3).double().repeat_interleave(H // H_KV, dim=1)
    v = layer.paged_attention_V[:kv_len].permute(1, 2, 0, 3).double().repeat_interleave(H // H_KV, dim=1)
    scores = q.double() @ k.transpose(-1, -2) / D ** 0.5
    scores = scores.masked_fill(~keep[:, None, None, :kv_len], float("-inf"))
    return (scores.softmax(-1) @ v).float()


@pytest.mark.parametrize("mask_form", ["2d", "bool", "additive", "none"])
def test_the_folded_attention_is_the_expanded_one(mask_form):
    kv_len = 23
    layer = _layer(kv_len)
    q = torch.randn(B, H, 1, D)
    keep = torch.ones(B, kv_len, dtype=torch.bool)
    if mask_form != "none":
        for row, pad in enumerate([0, 3, 7, 0, 12]):  # left padding per row, as GRPO's prompts
            keep[row, :pad] = False
    mask = {"2d": keep.long(), "bool": keep[:, None, None, :],
            "additive": torch.zeros(B, 1, 1, kv_len).masked_fill(~keep[:, None, None, :], float("-inf")),
            "none": None}[mask_form]
    got, k, v = folded_gqa_decode_attention(layer, q, kv_len, mask)
    torch.testing.assert_close(got, _expanded(layer, q, kv_len, keep), atol=1e-5, rtol=1e-5)
    assert k.shape == (B, H_KV, kv_len, D) and torch.equal(v, layer.paged_attention_V[:kv_len].permute(1, 2, 0, 3))


def test_a_sliding_window_reads_its_last_keys():
    kv_len, window = 30, 11
    layer = _layer(kv_len, sliding_window=window)
    q, keep = torch.randn(B, H, 1, D), torch.ones(B, kv_len, dtype=torch.bool)
    got, _, _ = folded_gqa_decode_attention(layer, q, kv_len, keep.long())
    windowed = keep.clone()
    windowed[:, : kv_len - window] = False
    torch.testing.assert_close(got, _expanded(layer, q, kv_len, windowed), atol=1e-5, rtol=1e-5)


def test_the_patch_folds_batched_decode_only_and_puts_the_original_back():
    calls = []

    def original(self, Qn, kv_seq_len, attention_mask, bsz, sdpa_gqa_with_batch_mask):
        calls.append(bsz)
        return "original"

    module = SimpleNamespace(_decode_attention_core=original)
    layer = _layer(9)
    with unsloth_folded_gqa_decode([module]) as applied:
        assert applied
        core = module._decode_attention_core
        with unsloth_folded_gqa_decode([module]) as again:  # already folded: left alone
            assert not again and module._decode_attention_core is core
        a, _, _ = core(layer, torch.randn(B, H, 1, D), 9, torch.ones(B, 9, dtype=torch.long), B, False)
        assert a.shape == (B, H, 1, D) and calls == []
        assert core(layer, torch.randn(1, H, 1, D), 9, None, 1, False) == "original"  # one row: Unsloth's own path
        assert core(layer, torch.randn(B, H, 3, D), 9, None, B, False) == "original"  # a prefill, not one token
        layer.__dict__["_unsloth_tp_heads"] = H  # tensor-parallel shards
        assert core(layer, torch.randn(B, H, 1, D), 9, None, B, False) == "original"
    assert module._decode_attention_core is original and calls == [1, B, B]
    with unsloth_folded_gqa_decode([SimpleNamespace()]) as applied:  # an Unsloth without the function
        assert not applied
