"""Attention outputs kept through gradient checkpointing, so that the backward's recompute of a layer does not run
attention's forward again (long samples, issue 33's 262,144-token targets).

With checkpointing each decoder layer's forward runs twice: first without gradients (only its output leaves it;
Unsloth keeps the layer's input, offloaded to the host), then in the backward with gradients, to rebuild what the
layer's backward reads. On one 262,144-token sample attention is most of a layer (Qwen3-0.6B with FA4, one H200:
405 ms forward+backward per layer at 131,072 tokens, four times that at 262,144, the forward about a quarter), so the
recompute's attention forwards are ~11 s of the 75.4 s step (2026-12-03). The recompute's attention is the first
pass's: the same kernel on the same q, k and v (the same GEMMs on the same layer input). So the first pass keeps each
layer's attention output and log-sum-exp (what flash attention's backward reads besides q, k and v: 2 bytes per head
dimension and 4 per head, per token; 1.1 GB a layer of Qwen3-0.6B at 262,144 tokens), and the recompute returns them
instead of running the kernel. The backward is the kernel's own, on the recomputed q, k and v.

- Which calls keep: a forward without gradients inside a training forward of the decoder (`start_forward`, a
  pre-hook on the decoder, arms it with gradients on and the decoder in training mode): the first pass of a
  checkpointed layer. Evaluation and a forward without gradients from the top (DPO's reference) keep nothing.
- Which calls take: those inside a recompute (unsloth_zoo's marker, `in_gradient_checkpoint_recompute`). The backward
  recomputes layers last to first, so the kept outputs are a stack, one entry a layer: every layer makes exactly one
  attention call (required where this is installed). An entry is taken only when the call's shapes and kernel
  arguments are the ones it was kept with (anything else drops the stack) and nothing wrote into the output since
  (its version counter; a model that writes into attention's output in place recomputes); otherwise the call
  recomputes.
- Memory: at most `cap_bytes` are kept; past it a layer keeps nothing and recomputes as before. The cap is the room
  the token budget left above the checkpointed peak (`cap_from_budget`), and the stack is dropped when the next
  micro-batch's forward starts.

`KeptAttention` holds the stack; `reusing` wraps a flash-varlen autograd Function with Unsloth's protocol
(`unsloth.utils.attention_dispatch._LeanFlashVarlen`: `forward(ctx, query, key, value, cu_seqlens, max_seqlen,
is_causal, scale, window_left, window_right)` saving (query, key, value, cu_seqlens, out, lse, philox_seed,
philox_offset)). `install_on_unsloth` puts it in place (patches.enable_unsloth_attention_reuse);
`keep_attention` decides, for the worker.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from loguru import logger

from HyperSloth.outputs import run_files

REUSE_SHARE = 0.75  # of the budget's headroom above the checkpointed peak: the most the kept outputs may take


@dataclass
class _Entry:
    key: tuple
    saved: tuple  # (out, lse, philox_seed, philox_offset), as the kernel's forward saved them
    nbytes: int
    versions: tuple  # out's and lse's version counters when kept: an in-place write since makes them not the kernel's


class KeptAttention:
    """The attention outputs of one micro-batch's checkpointed first pass, for its recompute (module docstring)."""

    def __init__(self, cap_bytes: int):
        self.cap_bytes = max(int(cap_bytes), 0)
        self.stack: list[_Entry | None] = []
        self.kept_bytes = 0
        self.armed = False
        self.kept = self.reused = self.recomputed = self.dropped = 0
        self.peak_bytes = 0

    def attach(self, decoder: torch.nn.Module) -> None:
        """Arm and disarm with the decoder's forward (`start_forward`, `end_forward`)."""
        decoder.register_forward_pre_hook(lambda module, args: self.start_forward(module.training))
        decoder.register_forward_hook(lambda module, args, output: self.end_forward())

    def start_forward(self, training: bool) -> None:
        """A decoder forward begins: drop what an earlier micro-batch left, keep from this one if it trains."""
        self.clear()
        self.armed = bool(training) and torch.is_grad_enabled()

    def end_forward(self) -> None:
        self.armed = False

    def clear(self) -> None:
        self.stack.clear()
        self.kept_bytes = 0

    def keeping(self) -> bool:
        """This call is a checkpointed layer's first pass: inside a training forward, gradients off."""
        return self.armed and not torch.is_grad_enabled()

    def keep(self, key: tuple, saved: tuple) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in saved[:2])
        if self.kept_bytes + nbytes > self.cap_bytes:
            self.stack.append(None)  # this layer recomputes: the stack still has one entry per layer
            return
        self.stack.append(_Entry(key, saved, nbytes, (saved[0]._version, saved[1]._version)))
        self.kept_bytes += nbytes
        self.kept += 1
        self.peak_bytes = max(self.peak_bytes, self.kept_bytes)

    def take(self, key: tuple) -> tuple | None:
        """The kept (out, lse, philox_seed, philox_offset) of the layer being recomputed, or None: recompute."""
        entry = self.stack.pop() if self.stack else None
        if entry is None:
            self.recomputed += 1
            return None
        self.kept_bytes -= entry.nbytes
        if entry.key != key:  # not the layer it was kept for: nothing left can be trusted
            self.dropped += 1 + sum(e is not None for e in self.stack)
            self.clear()
            self.recomputed += 1
            return None
        if (entry.saved[0]._version, entry.saved[1]._version) != entry.versions:  # written in place after the kernel
            self.dropped += 1
            self.recomputed += 1
            return None
        self.reused += 1
        return entry.saved

    def summary(self) -> dict[str, Any]:
        return {"cap_bytes": self.cap_bytes, "peak_kept_bytes": self.peak_bytes, "kept": self.kept,
                "reused": self.reused, "recomputed": self.recomputed, "dropped": self.dropped}


def cap_from_budget(decision, share: float = REUSE_SHARE) -> int:
    """Bytes the kept outputs may take: `share` of the room between the budget's memory limit and the peak it
    predicts (and verified) for its micro-batch with checkpointing. 0 without a measured limit."""
    limit = getattr(decision, "limit_bytes", None)
    if not limit:
        return 0
    peak = int(getattr(decision, "verified_peak_bytes", None) or 0)
    fit = getattr(decision, "fit", None) or {}
    if "base_bytes" in fit and "per_token_bytes" in fit:
        peak = max(peak, int(fit["base_bytes"] + fit["per_token_bytes"] * int(decision.tokens)))
    return max(int(share * (int(limit) - peak)), 0)


class _Recorder:
    """A stand-in autograd ctx: what the kernel's forward saves and sets, for running it outside autograd."""

    def save_for_backward(self, *tensors):
        self.saved = tensors


def _call_key(query, key, value, cu_seqlens, max_seqlen, is_causal, scale, window_left, window_right) -> tuple:
    return (tuple(query.shape), tuple(key.shape), tuple(value.shape), query.dtype, tuple(cu_seqlens.shape),
            max_seqlen if isinstance(max_seqlen, int) else None, bool(is_causal), scale, window_left, window_right)


def reusing(base: type[torch.autograd.Function], kept: KeptAttention, in_recompute: Callable[[], bool]):
    """`base` (the flash-varlen Function, module docstring) with its outputs kept in a checkpointed first pass and
    returned in the recompute; every other call is `base.apply` unchanged."""

    class FromKept(torch.autograd.Function):
        """The kept output in the recompute's graph; its backward is the kernel's (`base.backward`)."""

        @staticmethod
        def forward(ctx, query, key, value, cu_seqlens, max_seqlen, is_causal, scale, window_left, window_right, saved):
            out, lse, philox_seed, philox_offset = saved
            out = out.detach()  # a new tensor object (same storage) that autograd gives this node's history
            ctx.save_for_backward(query, key, value, cu_seqlens, out, lse, philox_seed, philox_offset)
            ctx.max_seqlen, ctx.is_causal, ctx.scale = max_seqlen, is_causal, scale
            ctx.window = (window_left, window_right)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            return (*base.backward(ctx, grad_out), None)

    class KeptFlashVarlen:
        """Called as `base` is (`.apply`), by code that looks the Function up when it calls it."""

        wrapped = base

        @staticmethod
        def apply(query, key, value, cu_seqlens, max_seqlen, is_causal, scale, window_left, window_right):
            args = (query, key, value, cu_seqlens, max_seqlen, is_causal, scale, window_left, window_right)
            if in_recompute():
                saved = kept.take(_call_key(*args))
                if saved is not None:
                    return FromKept.apply(*args, saved)
            elif kept.keeping():
                ctx = _Recorder()
                out = base.forward(ctx, *args)  # what base.apply runs, without gradients to record
                kept.keep(_call_key(*args), tuple(ctx.saved[4:8]))
                return out
            return base.apply(*args)

    return KeptFlashVarlen


def keep_attention(description, loaded_model, decision):
    """The worker's one call: attention's outputs kept through gradient checkpointing (this module), on by default for
    SFT on Unsloth with checkpointing on, in the memory the budget left above its peak; `run_files.ENV_REUSE_ATTENTION`
    = 0 switches it off. The installed `KeptAttention`, or None (one log line says why where it would apply).

    Measured (one H100, 2026-12-05, docs/attention.md): one 262,144-token sample of Qwen3-0.6B with FA4, first step,
    51.9 s kept against 64.2 s plain, the same loss to the last digit; the kept outputs took 32.9 GB of room the
    budget had left unused."""
    if description.method != "sft" or loaded_model.backend != "unsloth" or not description.gradient_checkpointing:
        return None  # no recompute to save (or not on Unsloth's lean varlen path): nothing to say
    if os.environ.get(run_files.ENV_REUSE_ATTENTION) == "0":
        logger.info(f"attention outputs are not kept through checkpointing ({run_files.ENV_REUSE_ATTENTION}=0)")
        return None
    cap = cap_from_budget(decision)
    if cap <= 0:
        why = ("the measured token budget leaves no memory room above its checkpointed peak"
               if getattr(decision, "limit_bytes", None) else "no memory room is known above the checkpointed peak "
               "(the token budget was given; tokens_per_micro_batch='auto' measures it)")
        logger.info(f"attention outputs are not kept through checkpointing: {why}")
        return None
    kept, why = install_on_unsloth(loaded_model.model.get_base_model().model, cap)
    logger.info(f"attention outputs kept through checkpointing (the recompute skips attention's forward), up to "
                f"{cap / 2**30:.1f} GiB" if kept is not None
                else f"attention outputs are not kept through checkpointing: {why}")
    return kept


def install_on_unsloth(decoder: torch.nn.Module, cap_bytes: int) -> tuple[KeptAttention | None, str | None]:
    """(the installed KeptAttention, None) on Unsloth's lean varlen path (patches.enable_unsloth_attention_reuse),
    or (None, why not)."""
    from HyperSloth.train.patches import enable_unsloth_attention_reuse

    kept = KeptAttention(cap_bytes)
    why = enable_unsloth_attention_reuse(decoder, lambda base, in_recompute: reusing(base, kept, in_recompute))
    if why is not None:
        return None, why
    kept.attach(decoder)
    return kept, None
