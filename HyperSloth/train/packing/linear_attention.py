"""Linear attention run one sample at a time inside a packed row, where the model's own kernels would carry state
across the samples.

Qwen3.5's gated-delta-rule layers keep a running state over the sequence, and a short causal convolution before it
looks back `linear_conv_kernel_dim - 1` tokens. transformers 5.17 hands the kernels the packed row's boundaries
(`cu_seqlens`), but its PyTorch fallbacks (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`: what runs without the
fla / causal-conv1d kernels, so on every CPU) ignore them: the second sample of a row starts from the first one's
state (train/packing/check.py measured 0.10-1.13 of a full leak). Run per sample, each starts from zero state and
zero padding, as it does alone.

`per_sample_linear_attention(model)` records each packed training row's sample spans (from the restarting position
ids) in a forward pre-hook on the decoder, and has every linear-attention module (`MIXER`) run its forward once per
span of a row that holds more than one sample; anything else (a cache, a batch of several rows, no position ids)
runs as before. Returns the function that undoes it, or None where the model has no such module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from HyperSloth.train.lora.install import decoder_layers
from HyperSloth.train.packing.exactness import decoder_and_head

MIXER = "linear_attn"  # Qwen3.5's (and Qwen3-Next's) gated-delta-rule token mixer, beside self_attn


def sample_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each sample of a one-row packed batch: a sample starts where its position is 0."""
    starts = torch.nonzero(position_ids[0] == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return list(zip(starts, [*starts[1:], position_ids.shape[1]]))


def per_sample_linear_attention(model) -> Callable[[], None] | None:
    mixers = [getattr(layer, MIXER) for layer in decoder_layers(model) or []
              if isinstance(getattr(layer, MIXER, None), torch.nn.Module)]
    if not mixers:
        return None
    spans: list[list[tuple[int, int]] | None] = [None]

    def record(_module, args, kwargs):
        positions = kwargs.get("position_ids")
        packed = (positions is not None and not args and kwargs.get("past_key_values") is None
                  and positions.dim() == 2 and positions.shape[0] == 1)
        found = sample_spans(positions) if packed else None
        spans[0] = found if found and len(found) > 1 else None

    # The spans stay until the decoder's next call: gradient checkpointing recomputes a layer inside the backward,
    # after the decoder's forward returned, and the recompute must split the row as the forward did.
    def per_sample(original):
        def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
            if (spans[0] is None or cache_params is not None or hidden_states.shape[0] != 1
                    or spans[0][-1][1] != hidden_states.shape[1]):
                return original(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
            kwargs = {k: v for k, v in kwargs.items() if not k.startswith(("cu_seq_lens", "max_length"))}
            return torch.cat([original(hidden_states[:, a:b], cache_params=None,
                                       attention_mask=None if attention_mask is None else attention_mask[:, a:b],
                                       **kwargs)
                              for a, b in spans[0]], dim=1)
        return forward

    decoder = decoder_and_head(model)[0]
    handles = [decoder.register_forward_pre_hook(record, with_kwargs=True)]
    own = [mixer.__dict__.get("forward") for mixer in mixers]  # a forward set on the instance (a patch) stays
    for mixer in mixers:
        mixer.forward = per_sample(mixer.forward)

    def remove() -> None:
        for handle in handles:
            handle.remove()
        for mixer, forward in zip(mixers, own):
            if forward is None:
                del mixer.forward  # the class's forward again
            else:
                mixer.forward = forward

    return remove
