"""FlashAttention-4 inside torch's flash-impl registry as torch 2.11 needs it, and checked before a run trains on it.

torch's FA4 registration (torch/nn/attention/_fa4.py, 2.11 to 2.13) imports a module exposing `_flash_attn_fwd` and
`_flash_attn_bwd` and calls them. With flash-attn-4 4.0.0b36 and torch 2.11 that went wrong three ways, each found
on the H200 (docs/benchmarks.md, 2026-12-02), each handled here:
1. The betas return more than torch unpacks (`out, lse, p, row_max, o_lo` forward; backward, a sink gradient too
   when a learnable sink is passed):
   "too many values to unpack (expected 2)". `_flash_attn_fwd` / `_flash_attn_bwd` hand torch its two and three.
2. torch 2.11's backward refuses any window that is not None ("windowed attention not supported"), and causal
   packed rows arrive with aten's spelling of plain causal attention, window (-1, 0) (Unsloth's lean varlen path,
   torch's `varlen_attn`): the backward registered here passes that window on as None, None
   (`plain_causal_windows_as_none`); a real sliding window is passed on as it is, and torch still refuses it.
3. torch 2.11's forward passes aten's -1 on as it is, and FA4 reads causal + (-1, 0) as *local* attention
   (outputs 4 off, gradients in the thousands, NaN losses from step 2): `fa4_windows` makes -1 None.
`route_torch_fa4_here` points torch's "FA4" entry (the public `register_flash_attention_impl`) at this module;
activation itself stays torch's (`activate_flash_attention_impl("FA4")`). `agreement_check` then compares FA4 with
bundled flash on one packed row in the model's head layout, forward and backward, and times both, before the
worker lets a run train on it (attention/setting.py).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

FA4_MODULE = "flash_attn.cute.interface"  # the kernels' own module (flash-attn-4)


def _kernels():
    import importlib

    return importlib.import_module(FA4_MODULE)


def fa4_windows(kwargs: dict[str, Any]) -> dict[str, Any]:
    """aten's "no limit" window side (-1) as FA4's (None): FA4 reads causal + (-1, 0) as local attention with a
    left window of -1 (`_resolve_causal_local_window`; the module docstring, 3)."""
    for side in ("window_size_left", "window_size_right"):
        if kwargs.get(side) is not None and kwargs[side] < 0:
            kwargs[side] = None
    return kwargs


def _flash_attn_fwd(*args: Any, **kwargs: Any):
    """FA4's forward: (out, lse), the two values torch unpacks (newer wheels return extra ones after them)."""
    result = _kernels()._flash_attn_fwd(*args, **fa4_windows(kwargs))
    return tuple(result[:2])


def _flash_attn_bwd(*args: Any, **kwargs: Any):
    """FA4's backward: (dq, dk, dv), the three values torch unpacks."""
    result = _kernels()._flash_attn_bwd(*args, **fa4_windows(kwargs))
    return tuple(result[:3])


def plain_causal_windows_as_none(backward):
    """torch's FA4 backward impl, with a window that only spells full or causal attention passed on as None."""

    @functools.wraps(backward)
    def run(*args: Any, **kwargs: Any):
        is_causal = args[11] if len(args) > 11 else kwargs.get("is_causal", False)
        left, right = kwargs.get("window_size_left"), kwargs.get("window_size_right")
        if left is not None and left < 0:
            kwargs["window_size_left"] = left = None
        if right is not None and (right < 0 or (is_causal and right == 0)) and left is None:
            kwargs["window_size_right"] = None
        return backward(*args, **kwargs)

    return run


def _register(module_path: str = __name__):
    """torch's own FA4 registration, its module this one, its backward impl `plain_causal_windows_as_none` of
    torch's (bound at registration; torch's module is left as it was)."""
    from torch.nn.attention import _fa4

    original = _fa4._fa4_flash_attention_backward_impl
    _fa4._fa4_flash_attention_backward_impl = plain_causal_windows_as_none(original)
    try:
        return _fa4.register_flash_attention_fa4(module_path=module_path)
    finally:
        _fa4._fa4_flash_attention_backward_impl = original


def route_torch_fa4_here() -> bool:
    """Point torch's registry entry "FA4" at this module; False where torch has no FA4 registration (< 2.11)."""
    try:
        from torch.nn.attention import _fa4, register_flash_attention_impl
    except ImportError:
        return False
    if not (hasattr(_fa4, "register_flash_attention_fa4") and hasattr(_fa4, "_fa4_flash_attention_backward_impl")):
        return False
    register_flash_attention_impl("FA4", register_fn=_register)
    return True


# The packed row the agreement check attends over: segments of the lengths a chat row holds, one of them past a
# 128-token tile, one of a single token. The timed row repeats them to TIMED_ROW_TOKENS (a packed micro-batch of
# short chats; row lengths of 8k-37k tokens in the benchmark's short workloads), or, for a run whose samples are
# long, is one sample of up to LONG_TIMED_TOKENS (where one sample's attention is most of the step).
CHECK_LENGTHS = (1, 7, 130, 333, 1024)
TIMED_ROW_TOKENS = 8192
LONG_TIMED_TOKENS = 32_768
CHECK_TOLERANCE = 2e-2  # of max(1, the largest value): bf16 rounding, as Unsloth's own FA4 probe allows
# Timed calls per kernel, the median kept, after two warm ones. Five eager calls of the 8k row on the H200 gave FA4
# 0.60, 1.07 and 0.95 ms in three runs (bundled flash 0.71-0.77): host time per launch, not the kernel, so the check
# now times what the run will do (graph replays for a graphed decoder) and more of it.
TIMED_REPS = 15


@dataclass(frozen=True)
class FA4Check:
    """What `agreement_check` found: what disagreed (None: nothing), and each kernel's forward+backward
    milliseconds on the timed row (the median of TIMED_REPS, replayed from a CUDA graph where `graphed`)."""

    error: str | None
    flash_ms: float | None = None
    fa4_ms: float | None = None
    row_tokens: int = 0
    graphed: bool = False
    segments: int = 0

    def timing(self) -> str:
        row = "one sample" if self.segments == 1 else "a packed row"
        return (f"FA4 {self.fa4_ms:.2f} ms against bundled flash {self.flash_ms:.2f} ms per forward+backward of "
                f"{row} of {self.row_tokens:,} tokens, {'graphed' if self.graphed else 'eager'}, measured here")


def timed_row(graphed: bool, longest_sample: int, long_from: int) -> list[int]:
    """The segment lengths the check times, as the run will attend: a long-sample run (a sample past `long_from`
    tokens, the attention rule's threshold, and an eager decoder) one sample of up to LONG_TIMED_TOKENS; otherwise
    a packed row of chats."""
    if not graphed and longest_sample > long_from:
        return [min(longest_sample, LONG_TIMED_TOKENS)]
    return timed_lengths()


def timed_lengths(lengths=CHECK_LENGTHS, tokens: int = TIMED_ROW_TOKENS) -> list[int]:
    """`lengths` repeated until the row holds `tokens` (the last segment cut to fit)."""
    out: list[int] = []
    while sum(out) < tokens:
        out.extend(lengths)
    while sum(out) > tokens:
        over = sum(out) - tokens
        out[-1] -= min(over, out[-1])
        if out[-1] == 0:
            out.pop()
    return out


def aten_flash_attention(q, k, v, grad, cu_seqlens, longest: int, scale: float):
    """Causal packed-row attention forward and backward through aten's flash ops, K/V heads as they are (Unsloth's
    lean varlen path), on whichever flash kernel torch's registry has active: (out, dq, dk, dv)."""
    import torch

    out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, longest, longest, 0.0, True, return_debug_mask=False, scale=scale,
        window_size_left=-1, window_size_right=0)
    return (out, *torch.ops.aten._flash_attention_backward(
        grad, q, k, v, out, lse, cu_seqlens, cu_seqlens, longest, longest, 0.0, True, seed, offset, scale=scale,
        window_size_left=-1, window_size_right=0))


def agreement_check(heads: int, kv_heads: int, head_dim: int, graphed: bool = False, segments: list[int] | None = None,
                    lengths=CHECK_LENGTHS):
    """A check for `attention.apply_attention`: a causal packed row in the model's head layout (bf16, K/V heads as
    they are) forward and backward through aten's flash ops on bundled flash, then with FA4 activated. Returns an
    FA4Check: what differs by more than CHECK_TOLERANCE or is not finite, and both kernels timed the way the run
    will attend (`segments`, from `timed_row`; an 8k row of chats by default; replayed from a CUDA graph where the
    decoder is `graphed`); FA4 is left active. Its compile is the one training needs anyway (the same layout); the
    rest takes about a second. This caught nothing less than a wrong kernel: before `fa4_windows`, FA4 under
    torch 2.11 attended locally and trained on NaN from step 2."""

    def check(registry) -> FA4Check:
        import torch

        from HyperSloth.train.profiling import captured, cuda_event_ms

        generator = torch.Generator(device="cuda").manual_seed(0)

        def row(segments):
            q, k, v, grad = (torch.randn(sum(segments), n, head_dim, device="cuda", dtype=torch.bfloat16,
                                         generator=generator) for n in (heads, kv_heads, kv_heads, heads))
            cu = torch.tensor([0, *itertools.accumulate(segments)], device="cuda", dtype=torch.int32)
            return q, k, v, grad, cu, max(segments)

        def attend(q, k, v, grad, cu, longest):
            return aten_flash_attention(q, k, v, grad, cu, longest, head_dim ** -0.5)

        def milliseconds(inputs) -> float:
            attend(*inputs)  # warm (FA4: its compile for this layout)
            call = captured(attend, inputs)[0] if graphed else (lambda: attend(*inputs))
            call()
            return sorted(cuda_event_ms(call, TIMED_REPS))[TIMED_REPS // 2]

        timed_segments = segments or timed_lengths(lengths)
        small, timed = row(list(lengths)), row(timed_segments)
        if registry.current_flash_attention_impl() is not None:
            registry.restore_flash_attention_impl(_raise_warn=False)
        reference, flash_ms = attend(*small), milliseconds(timed)
        registry.activate_flash_attention_impl("FA4")
        for name, got, want in zip(("output", "dq", "dk", "dv"), attend(*small), reference):
            if not bool(torch.isfinite(got).all()):
                return FA4Check(f"FA4's {name} is not finite")
            error = (got.float() - want.float()).abs().max().item()
            allowed = CHECK_TOLERANCE * max(1.0, want.float().abs().max().item())
            if error > allowed:
                return FA4Check(f"FA4's {name} differs by {error:.3g} (bf16 allows {allowed:.3g})")
        return FA4Check(None, flash_ms, milliseconds(timed), sum(timed_segments), graphed, len(timed_segments))

    return check
