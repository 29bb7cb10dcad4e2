"""The one place where HyperSloth changes a library's behaviour from outside. Each patch names what it
replaces and the versions it was checked against, and returns whether it applied.

`enable_unsloth_torch_varlen`
    Replaces: `unsloth.utils.attention_dispatch._TORCH_VARLEN_ATTN` (a module global, None when unset).
    Why: Unsloth runs packed (padding-free) rows through torch's flash varlen kernel only when
    `torch.nn.attention.varlen.varlen_attn` takes `enable_gqa` (torch >= 2.12). On torch 2.11 it falls
    back to one SDPA call per run of equal sample lengths, per layer, which for Qwen3's grouped-query
    attention turns a packed step into hundreds of small launches. torch 2.11's `varlen_attn` has the
    same kernel, just no GQA flag: we give Unsloth a wrapper that expands the key/value heads (what
    `enable_gqa` does inside the kernel) and otherwise calls torch's function unchanged.
    Checked with: unsloth 2026.10.9, torch 2.11.0+cu130 (H200). A no-op when torch already has
    `enable_gqa`, when flash attention is unavailable, or when Unsloth's global is missing or already set.
"""

from __future__ import annotations

import inspect


def _gqa_wrapper(varlen_attn):
    def varlen_attn_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, enable_gqa=False, **kwargs):
        if enable_gqa and key.shape[-2] != query.shape[-2]:
            groups = query.shape[-2] // key.shape[-2]
            # (T, H_kv, D) -> (T, H, D): query head h reads kv head h // groups, as enable_gqa does.
            key = key.repeat_interleave(groups, dim=-2)
            value = value.repeat_interleave(groups, dim=-2)
        return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)

    return varlen_attn_gqa


def enable_unsloth_torch_varlen() -> bool:
    """Let Unsloth use torch's varlen flash kernel for packed rows on torch 2.11 (see module docstring)."""
    import torch

    try:
        from torch.nn.attention.varlen import varlen_attn
        from unsloth.utils import attention_dispatch
    except ImportError:
        return False
    params = inspect.signature(varlen_attn).parameters
    if "enable_gqa" in params or "window_size" not in params:
        return False
    if not torch.cuda.is_available() or not torch.backends.cuda.is_flash_attention_available():
        return False
    if getattr(attention_dispatch, "_TORCH_VARLEN_ATTN", "missing") is not None:
        return False
    attention_dispatch._TORCH_VARLEN_ATTN = _gqa_wrapper(varlen_attn)
    return True
