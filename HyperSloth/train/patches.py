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
    Also replaces: `attention_dispatch._LEAN_VARLEN` (and `_varlen_can_use_cudnn` when missing). Unsloth
    decides at its import, from `_TORCH_VARLEN_ATTN`, whether eager packed calls that torch would send to
    flash anyway skip `varlen_attn`'s custom-op dispatch and go straight to aten's flash kernels through a
    plain autograd.Function (`_LeanFlashVarlen`); on torch 2.11 that global was None then, so the lean
    path stayed off. The aten flash kernel takes fewer key/value heads than query heads (what torch
    2.12's `enable_gqa` passes it), so on the lean path the key/value heads are not expanded either: no
    per-layer copy of K and V forward, no reduction of their gradients backward. We turn it on exactly as
    Unsloth does on torch >= 2.12 (its `UNSLOTH_LEAN_VARLEN=0` still turns it off), flash only (what
    torch 2.11's `varlen_attn` ran for these rows).
    Checked with: unsloth 2026.10.9, torch 2.11.0+cu130 (H200). A no-op when torch already has
    `enable_gqa`, when flash attention is unavailable, or when Unsloth's global is missing or already set.

`unsloth_static_packed_rows` (a context manager, used only while a CUDA graph is captured)
    Replaces: the entries of `unsloth.utils.packing._PACKED_INFO_CACHE` and `_PACKED_HOST_LENGTHS_CACHE`
    for the row's device (module-level dicts Unsloth fills on every packed forward), for the duration of
    the capture, and removes them after.
    Why: Unsloth turns `packed_seq_lengths` into device offsets and reads the lengths back to the host
    (`tolist()`), which no CUDA graph can capture. Both caches are keyed by the identity of the lengths
    tensor, so filling them with the graph's static device tensors (and their host copy) makes every layer
    take its cache-hit branch: attention reads the static `cu_seqlens`, and `max_seqlen` is the graph's
    fixed bound (HyperSloth.train.step_graph).
    Checked with: unsloth 2026.10.9 (`get_packed_info_from_kwargs`, `_cached_host_lengths`,
    `cover_padded_cu_seqlens`), torch 2.11.0+cu130 on an H200: replays gave eager's loss exactly
    (scripts/graph_check.py). Raises if those caches are missing (another Unsloth version): the capture
    then fails and training goes on eagerly, saying why.
"""

from __future__ import annotations

import inspect
import os
from contextlib import contextmanager


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
    enable_unsloth_lean_varlen(attention_dispatch)
    return True


def _flash_only(query, key, value, max_q, window_size, enable_gqa=False) -> bool:
    """Unsloth's `_varlen_can_use_cudnn` for torch 2.11: varlen_attn never took cuDNN for packed rows."""
    return False


def enable_unsloth_lean_varlen(attention_dispatch) -> bool:
    """Turn on Unsloth's lean flash path for packed rows as its import does on torch >= 2.12 (see the
    module docstring); False when this Unsloth has no such path or `UNSLOTH_LEAN_VARLEN` turns it off."""
    if os.environ.get("UNSLOTH_LEAN_VARLEN", "1").lower() in ("0", "false", "no", "off"):
        return False
    if not hasattr(attention_dispatch, "_LeanFlashVarlen") or not hasattr(attention_dispatch, "_LEAN_VARLEN"):
        return False
    if not hasattr(attention_dispatch, "_varlen_can_use_cudnn"):
        # The lean path runs torch's flash kernel; Unsloth skips it where varlen_attn would pick cuDNN. torch
        # 2.11's varlen_attn always ran flash for these rows (an H200 trace shows only flash kernels), but its
        # per-device cuDNN check does not say so: asking it (as Unsloth does on 2.12/2.13) kept the lean path
        # off on the H200. So: never cuDNN, which is the kernel the shim's own varlen_attn calls ran.
        attention_dispatch._varlen_can_use_cudnn = _flash_only
    attention_dispatch._LEAN_VARLEN = True
    return True


@contextmanager
def unsloth_static_packed_rows(lengths, cu_seqlens, host_lengths: tuple[int, ...], max_seqlen: int):
    """Make Unsloth's packed attention read these device tensors for the row's segments (see module docstring)."""
    from unsloth.utils import packing

    info = getattr(packing, "_PACKED_INFO_CACHE", None)
    hosts = getattr(packing, "_PACKED_HOST_LENGTHS_CACHE", None)
    if not isinstance(info, dict) or not isinstance(hosts, dict):
        raise RuntimeError("this Unsloth has no packed-info caches (checked with unsloth 2026.10.9)")
    device = lengths.device
    info[device] = {"seq_lengths": lengths, "result": (lengths, cu_seqlens, int(max_seqlen)), "inference": False}
    hosts[device] = (lengths, cu_seqlens, tuple(host_lengths))
    try:
        yield
    finally:
        info.pop(device, None)
        hosts.pop(device, None)
