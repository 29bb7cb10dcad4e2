"""Recurrent token mixers run one sample at a time inside a packed row, where the model's own kernels would carry
state across the samples.

Two kinds of decoder layer keep a running state over the sequence, each behind a short causal convolution that looks
back a few tokens:
- linear attention: Qwen3.5's and Qwen3-Next's gated delta rule (`linear_attn`; Kimi-Linear's delta attention, under
  `self_attn` in its "linear_attention" layers). transformers 5.17 hands its kernels the packed row's boundaries
  when the batch carries `cu_seq_lens_q` (HyperSloth's packed batches carry position ids), and the PyTorch fallbacks
  (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`: what runs without the fla / causal-conv1d kernels, so on
  every CPU) ignore them anyway;
- Mamba layers of hybrid models (`mamba`: Granite 4.0-H, Bamba, Falcon-H1, Jamba; Nemotron-H's `mixer` where its
  block type says so). Their kernels take a `seq_idx` the packed batch does not carry, and the PyTorch fallbacks
  take none.
And LFM2's short convolutions (`conv`) keep no state, but each token reads the few tokens before it.
Either way the second sample of a row starts from the first one's state, or reads its last tokens
(train/packing/check.py measures it). Run per sample, each starts from zero state and zero padding, as it does
alone.

`per_sample_recurrent_mixers(model)` records each packed training row's sample spans (from the restarting position
ids) in a forward pre-hook on the decoder, and has every recurrent mixer (`recurrent_mixers`) run its forward once
per span of a row that holds more than one sample; anything else (a cache, a batch of several rows, no position ids)
runs as before. Returns the function that undoes it, or None where the model has no such module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from HyperSloth.train.lora.install import decoder_layers
from HyperSloth.train.packing.exactness import decoder_and_head

LINEAR_ATTENTION, MAMBA, SHORT_CONV = "linear_attn", "mamba", "conv"  # recurrent mixers' names in a decoder layer
CACHES = ("cache_params", "past_key_values")  # how a recurrent mixer is handed the generation cache
KINDS = ("linear attention", "Mamba layers", "short convolutions")  # in the log's order


def layer_mixers(layer) -> list[tuple[str, torch.nn.Module]]:
    """(kind, module) of a decoder layer's recurrent mixers: linear attention or a Mamba layer. Some layers say what
    they are in `block_type` and keep any mixer under one name: Nemotron-H's `mixer` (a Mamba block's type is
    "linear_attention"), Kimi-Linear's `self_attn` (its delta-rule layers' type is "linear_attention")."""
    found = [(kind, getattr(layer, name)) for kind, name in zip(KINDS, (LINEAR_ATTENTION, MAMBA, SHORT_CONV))
             if isinstance(getattr(layer, name, None), torch.nn.Module)]
    block = getattr(layer, "block_type", None)  # a layer that says it is recurrent, whatever it calls its mixer
    if block in ("mamba", "linear_attention") and not found:
        for name in ("mixer", "self_attn"):
            if isinstance(getattr(layer, name, None), torch.nn.Module):
                found.append(("Mamba layers" if block == "mamba" or name == "mixer" else "linear attention",
                              getattr(layer, name)))
                break
    return found


def recurrent_mixers(model) -> list[torch.nn.Module]:
    """Every decoder layer's recurrent token mixers."""
    return [module for layer in decoder_layers(model) or [] for _, module in layer_mixers(layer)]


def kind_of(model) -> str:
    """What the model's recurrent mixers are, for the log ("linear attention", "Mamba layers", "short
    convolutions", joined by "and")."""
    kinds = {kind for layer in decoder_layers(model) or [] for kind, _ in layer_mixers(layer)}
    return " and ".join(sorted(kinds, key=KINDS.index))


def sample_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each sample of a one-row packed batch: a sample starts where its position is 0."""
    starts = torch.nonzero(position_ids[0] == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return list(zip(starts, [*starts[1:], position_ids.shape[1]]))


def per_sample_recurrent_mixers(model) -> Callable[[], None] | None:
    """Every recurrent mixer of `model` run once per sample of a packed training row (module docstring); the undo,
    or None where the model has none."""
    mixers = recurrent_mixers(model)
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
        def forward(hidden_states, *args, **kwargs):  # the cache comes as cache_params or past_key_values
            if (spans[0] is None or args or any(kwargs.get(name) is not None for name in CACHES)
                    or hidden_states.shape[0] != 1 or spans[0][-1][1] != hidden_states.shape[1]):
                return original(hidden_states, *args, **kwargs)
            mask = kwargs.pop("attention_mask", None)
            kwargs = {k: v for k, v in kwargs.items() if not k.startswith(("cu_seq_lens", "max_length", "seq_idx"))}
            return torch.cat([original(hidden_states[:, a:b], attention_mask=None if mask is None else mask[:, a:b],
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
