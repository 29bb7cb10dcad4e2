"""gpt-oss's attention with sinks over packed rows on the Unsloth backend: the samples of a row kept apart.

Unsloth 2026.10.9 trains gpt-oss's attention through `unsloth_zoo.flex_attention.flex_attention_with_sink`, which
builds its own causal (or sliding-window) BlockMask over the whole row and takes no attention mask: in a packed row
the second sample attends to the first (measured on an H200: 1.32 of a deliberate leak's 1.30, docs/models.md), so
gpt-oss trained sorted-pad there and its DPO and GRPO were refused.

Here the same computation takes a document mask: each token attends causally (and within the sliding window, as
Unsloth's mask does) to the tokens of its own sample only, the sample read from the restarting position ids. Then
the sink scaling of Unsloth's function, sigmoid(logsumexp - sink) on each head's output. `packed_sink_attention`
wraps Unsloth's function (patches.py installs the wrapper before the model loads, when Unsloth's gpt-oss patch binds
it); the wrapper does nothing until `document_masks_for_sink_attention(model)` (a fix of the packed-row check,
train/packing/check.py) records each packed training row's documents in a pre-hook on the decoder, and the check
keeps that fix only where it measures packing exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from HyperSloth.train.lora.install import decoder_layers
from HyperSloth.train.packing.exactness import decoder_and_head


class _Documents:
    """The current packed row's document ids ([1, tokens]) and the block masks built from them, per window; kept
    until the decoder's next call (gradient checkpointing recomputes attention inside the backward)."""

    ids: torch.Tensor | None = None
    masks: dict[Any, Any] = {}

    @classmethod
    def set(cls, ids: torch.Tensor | None) -> None:
        cls.ids, cls.masks = ids, {}


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per token, the index of its sample in the row: a sample starts where its position is 0."""
    return (position_ids == 0).cumsum(dim=-1)


def document_mask_mod(documents: torch.Tensor, sliding_window: int | None) -> Callable[..., torch.Tensor]:
    """flex_attention's mask_mod: causal, within the sample, and within `sliding_window` tokens where set (Unsloth's
    rule: q - kv < window)."""
    def same_document(batch, head, q, kv):
        allowed = (q >= kv) & (documents[batch, q] == documents[batch, kv])
        return allowed & (q - kv < sliding_window) if sliding_window else allowed
    return same_document


def sink_attention(self_attn, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask,
                   flex: Callable[..., Any], lse_kwargs: dict[str, Any], output_and_lse: Callable[[Any], tuple],
                   kernel_options: dict[str, Any] | None = None) -> torch.Tensor:
    """Unsloth's `flex_attention_with_sink` after its mask: flex attention under `block_mask`, each head's output
    scaled by sigmoid(logsumexp - sink) (the sink's share of the softmax taken out); [batch, tokens, heads, dim]."""
    scale = getattr(self_attn, "scaling", None) or getattr(self_attn, "scale", None)
    enable_gqa = getattr(self_attn, "num_key_value_groups", 1) != 1
    out, lse = output_and_lse(flex(query, key, value, block_mask=block_mask, score_mod=None, enable_gqa=enable_gqa,
                                   scale=scale, kernel_options=kernel_options, **lse_kwargs))
    out = out * torch.sigmoid(lse - self_attn.sinks.unsqueeze(1)).unsqueeze(-1).to(out.dtype)
    return out.transpose(1, 2).contiguous()


def packed_sink_attention(original: Callable[..., torch.Tensor], flex: Callable[..., Any],
                          create_block_mask: Callable[..., Any], lse_kwargs: dict[str, Any],
                          output_and_lse: Callable[[Any], tuple], kernel_options: dict[str, Any] | None = None
                          ) -> Callable[..., torch.Tensor]:
    """`original` (Unsloth's flex_attention_with_sink), except for a training call on the packed row whose documents
    the decoder's pre-hook recorded: then the document mask (`sink_attention`)."""
    def attention(self_attn, query, key, value, attention_mask=None, scale=None, sliding_window=None, compile=True,
                  has_static_cache=True):
        ids = _Documents.ids
        if (ids is None or not self_attn.training or query.shape[0] != 1 or query.shape[-2] != ids.shape[-1]
                or key.shape[-2] != ids.shape[-1]):
            return original(self_attn, query, key, value, attention_mask=attention_mask, scale=scale,
                            sliding_window=sliding_window, compile=compile, has_static_cache=has_static_cache)
        window = sliding_window or getattr(self_attn, "sliding_window", None)
        window = window if isinstance(window, int) and window > 0 else None
        if window not in _Documents.masks:
            tokens = ids.shape[-1]
            _Documents.masks[window] = create_block_mask(document_mask_mod(ids, window), 1, None, tokens, tokens,
                                                         device=query.device)
        return sink_attention(self_attn, query, key, value, _Documents.masks[window], flex, lse_kwargs,
                              output_and_lse, kernel_options)

    attention.hypersloth_packed = True  # type: ignore[attr-defined]
    return attention


def document_masks_for_sink_attention(model) -> Callable[[], None] | None:
    """Record each packed one-row training batch's documents for the wrapped sink attention (module docstring);
    None where the model has no attention with sinks or Unsloth's function is not wrapped."""
    try:
        import unsloth_zoo.flex_attention as zoo_flex
    except Exception:  # noqa: BLE001 - no Unsloth (the transformers backend), or one failing here: nothing wrapped
        return None
    if not getattr(zoo_flex.flex_attention_with_sink, "hypersloth_packed", False):
        return None
    if not any(getattr(getattr(layer, "self_attn", None), "sinks", None) is not None
               for layer in decoder_layers(model) or []):
        return None

    def record(_module, args, kwargs):
        positions = kwargs.get("position_ids")
        packed = (positions is not None and not args and kwargs.get("past_key_values") is None
                  and positions.dim() == 2 and positions.shape[0] == 1 and int((positions == 0).sum()) > 1)
        _Documents.set(document_ids(positions) if packed else None)

    handle = decoder_and_head(model)[0].register_forward_pre_hook(record, with_kwargs=True)

    def remove() -> None:
        handle.remove()
        _Documents.set(None)

    return remove
