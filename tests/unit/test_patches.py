"""patches.py: the GQA wrapper Unsloth gets for torch 2.11's varlen_attn must equal grouped-query attention."""

import torch
import torch.nn.functional as F

from HyperSloth.train import patches


def _varlen_without_gqa(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """A CPU stand-in for torch 2.11's varlen_attn: (T, H, D) inputs, no GQA, causal when window=(-1, 0)."""
    assert key.shape[1] == query.shape[1], "torch 2.11's varlen_attn has no enable_gqa"
    out = []
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
        out.append(F.scaled_dot_product_attention(q, k, v, is_causal=window_size == (-1, 0), scale=scale).transpose(0, 1))
    return torch.cat(out)


def test_gqa_wrapper_equals_grouped_query_attention():
    torch.manual_seed(0)
    lengths = [5, 9, 3]
    total, heads, kv_heads, dim = sum(lengths), 8, 2, 16
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    cu = torch.tensor([0, 5, 14, 17])
    wrapped = patches._gqa_wrapper(_varlen_without_gqa)
    got = wrapped(q, k, v, cu, cu, 9, 9, scale=0.25, window_size=(-1, 0), enable_gqa=True)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = F.scaled_dot_product_attention(
            *(x[start:end].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=0.25, enable_gqa=True
        ).transpose(0, 1)
        torch.testing.assert_close(got[start:end], ref)


def test_gqa_wrapper_passes_equal_heads_through_unchanged():
    q = k = v = torch.randn(6, 4, 8)
    cu = torch.tensor([0, 6])
    calls = []

    def spy(*args, **kwargs):
        calls.append((args[1].shape, kwargs))
        return args[0]

    patches._gqa_wrapper(spy)(q, k, v, cu, cu, 6, 6, window_size=(-1, 0), enable_gqa=False)
    assert calls == [((6, 4, 8), {"window_size": (-1, 0)})]  # enable_gqa is not forwarded to torch 2.11


def test_patch_is_a_no_op_without_cuda_or_unsloth():
    assert patches.enable_unsloth_torch_varlen() is False


def test_lean_flash_path_is_switched_on_as_unsloth_does_on_newer_torch(monkeypatch):
    import types

    dispatch = types.SimpleNamespace(_LeanFlashVarlen=object, _LEAN_VARLEN=False)
    assert patches.enable_unsloth_lean_varlen(dispatch) is True
    assert dispatch._LEAN_VARLEN is True
    q = torch.zeros(4, 2, 8)  # CPU tensors: never cuDNN
    assert dispatch._varlen_can_use_cudnn(q, q, q, 4, [-1, 0], True) is False
    # Unsloth's own switch still turns it off, and an Unsloth without the lean path is left alone.
    monkeypatch.setenv("UNSLOTH_LEAN_VARLEN", "0")
    off = types.SimpleNamespace(_LeanFlashVarlen=object, _LEAN_VARLEN=False)
    assert patches.enable_unsloth_lean_varlen(off) is False and off._LEAN_VARLEN is False
    monkeypatch.delenv("UNSLOTH_LEAN_VARLEN")
    older = types.SimpleNamespace(_LEAN_VARLEN=False)
    assert patches.enable_unsloth_lean_varlen(older) is False and older._LEAN_VARLEN is False
