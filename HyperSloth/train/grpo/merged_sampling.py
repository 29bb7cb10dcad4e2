"""GRPO samples on merged weights: each adapted projection's W + scale * B A for the length of a sampling call.

Why: sampling is most of a GRPO step (docs/grpo.md: 5.95 of 6.16 s on one H200 for Qwen3-0.6B), and the adapter's
two small GEMMs per projection and token step are much of the decode. Measured on one H200 (2026-12-05,
`scripts/sampling_bench.py`, 64 rows of 256 tokens, LoRA r=16 on every projection): Unsloth's decode took 21.8 ms
per token step with the adapter, 13.7 ms without it (423 of its 1,205 kernels per token step are the adapter's).
On merged weights the decode runs the adapter-free path while sampling the adapted model: 13.18 ms per token step
against 19.77 through the adapter and 12.62 without one (one H200, 2026-12-05, fifth session; a GRPO step 3.98 s,
1.72x TRL's GRPOTrainer + Unsloth; docs/grpo.md).

How: for every LoRA projection, a copy of its base weight is kept, the weight becomes W + scale * B A (computed in
float32, rounded once to the weight's dtype, written in place, so CUDA graphs captured over it read the merged
values), and the adapter is switched off (PEFT's `disable_adapter`) for the call; afterwards every weight is put
back from its copy, bit for bit, and the adapter switched on again, also when sampling raises. The policy sampled
is the adapted model up to the rounding of the merged weight (bf16 on a GPU: what samplers on merged weights, vLLM
in TRL, do); the loss's log-probabilities come from the training forward as before, and every rank merges the same
weights, so 1 and N GPUs still sample the same completions.

Where it does not apply, sampling keeps the adapter, with one log line saying why (`why_not`): base weights that
are not plain float tensors (4-bit QLoRA), adapters PEFT does not merge as B A alone (DoRA, a bias on B, MoE expert
parameters),
or a copy that would take more than `MAX_COPY_SHARE` of the memory sampling may use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from loguru import logger

MAX_COPY_SHARE = 0.25  # of the memory sampling may use (generation_memory.measured_limit) that the copies may take
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def lora_projections(model) -> list[torch.nn.Module]:
    """The model's LoRA layers (PEFT's `LoraLayer`s) with an active adapter."""
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer) and m.active_adapters]


def why_not(model, limit_bytes: int | None) -> str | None:
    """Why sampling cannot run on merged weights (None: it can). `limit_bytes`: what sampling may allocate (None: no
    limit, the CPU)."""
    from peft.tuners.lora import Linear as LoraLinear

    layers = lora_projections(model)
    if not layers or not hasattr(model, "disable_adapter"):
        return "the model has no LoRA projections PEFT can switch off"
    copy_bytes = 0
    for layer in layers:
        name = type(layer).__name__
        if not isinstance(layer, LoraLinear):
            return f"{name} adapters (not a LoRA linear projection: PEFT merges them otherwise)"
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A or adapter not in layer.lora_B:
                return f"{name} has no LoRA weights for adapter {adapter!r}"
            if layer.use_dora.get(adapter, False):
                return "DoRA adapters (their merged weight is not W + scale * B A)"
            if getattr(layer.lora_B[adapter], "bias", None) is not None:
                return "LoRA with a bias on B (lora_bias=True: it adds to the output, not to W)"
        base = layer.get_base_layer()
        weight = getattr(base, "weight", None)
        if (not isinstance(weight, torch.Tensor) or weight.dtype not in FLOAT_DTYPES or hasattr(weight, "quant_state")
                or getattr(type(base), "_unsloth_mxfp4_packed_linear", False)):  # Unsloth's packed MXFP4 (gpt-oss)
            stored = f"{type(weight).__name__} {weight.dtype}" if isinstance(weight, torch.Tensor) else type(base).__name__
            return f"base weights stored as {stored} (quantized: they cannot hold a merge)"
        copy_bytes += weight.numel() * weight.element_size()
    if limit_bytes is not None and copy_bytes > MAX_COPY_SHARE * limit_bytes:
        return (f"the copies of the base weights ({copy_bytes / 2**30:.1f} GiB) would take more than "
                f"{MAX_COPY_SHARE:.0%} of the {limit_bytes / 2**30:.1f} GiB sampling may use")
    return None


def _delta(layer, adapter: str) -> torch.Tensor:
    """scale * B A of one adapter in float32, shaped as the base weight (PEFT's fan_in_fan_out transposes it)."""
    a, b = layer.lora_A[adapter].weight.float(), layer.lora_B[adapter].weight.float()
    delta = (b @ a) * layer.scaling[adapter]
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


@contextmanager
def merged_weights(model) -> Iterator[None]:
    """Inside the block every LoRA projection's base weight is W + scale * B A and the adapter is off; after it,
    every weight is its own again (from a copy, bit for bit) and the adapter on. Call `why_not` first."""
    layers = lora_projections(model)
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for layer in layers:
                weight = layer.get_base_layer().weight
                merged = weight.float()
                for adapter in layer.active_adapters:
                    merged = merged + _delta(layer, adapter)
                saved.append((weight, weight.detach().clone()))
                weight.copy_(merged)  # in place: graphs captured over the weight read the merged values
        with model.disable_adapter():
            yield
    finally:
        with torch.no_grad():
            for weight, copy in saved:
                weight.copy_(copy)


class MergedSampling:
    """Per run: whether each GRPO sampling call runs on merged weights (`why_not`, decided per call: the memory
    left for sampling can change), said in the log at the first call and whenever the answer changes."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._said: object = ()  # the last reason logged (None: merged); () before the first call

    def context(self, model, limit_bytes: int | None):
        """`merged_weights(model)` where it applies, else a block that samples with the adapter."""
        reason = "grpo.sampling_weights='adapter'" if not self.enabled else why_not(model, limit_bytes)
        if reason != self._said:
            self._said = reason
            logger.info("GRPO samples on merged weights (W + scale * B A while sampling, the adapter off; put back "
                        "bit for bit after)" if reason is None else f"GRPO samples with the adapter: {reason}")
        return merged_weights(model) if reason is None else nullcontext()
