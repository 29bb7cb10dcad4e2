"""Swap Unsloth's fused LoRA hooks on a patched Qwen3-style model for the passes in lora_passes.

Unsloth's FastLanguageModel.patch_peft_model (unsloth/models/llama.py, checked against 2026.10.9) sets,
per decoder layer, `self_attn.apply_qkv = apply_lora_qkv`, `self_attn.apply_o = apply_lora_o` (plain
functions called as `self.apply_qkv(self, X)` by its attention forward) and
`mlp.forward = MethodType(apply_lora_mlp_swiglu, mlp)` (under its tiled MLP, `UNSLOTH_TILED_MLP` /
`unsloth_tiled_mlp=True`, `mlp._unsloth_forward` instead: the tiled `forward` calls it on each row tile, and
again on each tile in its backward, where a distributed run's variant, unsloth/models/_tiled_mlp_ddp.py, takes
the LoRA grads as outputs of torch.autograd.grad; both are CPU-tested in miniature, the single-process one also
on the H200). `install_lora_passes` replaces exactly those three
attributes, keeps Unsloth's function beside ours (`_hypersloth_previous`), and calls it back whenever the
adapter is disabled or merged at call time (DPO's reference forward) or autocast would change the dtype,
which Unsloth's own functions hand to PEFT. It refuses, with a one-line reason and nothing changed, a model
whose LoRA is not plain (dropout > 0, a bias, DoRA or another variant, several adapters, a trainable
or fp8 / packed base weight, QAT): the caller logs the line and stays on Unsloth's path.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

import torch
from torch import nn

from HyperSloth.train.lora.passes import WeightFn, dense_weight, lora_linear, lora_qkv, lora_swiglu_mlp

UNSLOTH_QKV, UNSLOTH_O, UNSLOTH_MLP = "apply_lora_qkv", "apply_lora_o", "apply_lora_mlp_swiglu"
TILED_SLOT = "_unsloth_forward"  # the MLP hook's place under Unsloth's tiled MLP
PREVIOUS = "_hypersloth_previous"
_FLOAT_WEIGHTS = (torch.float16, torch.bfloat16, torch.float32)


def default_weight_fn() -> WeightFn:
    """Unsloth's fast_dequantize when importable (4-bit / 16-bit on GPU), else dense weights only."""
    try:
        from unsloth.kernels.utils import fast_dequantize
    except ImportError:
        return dense_weight
    return lambda W, quant_state: fast_dequantize(W, quant_state)


def _active_adapter(proj: nn.Module) -> str | None:
    adapters = getattr(proj, "_active_adapter", None)
    if isinstance(adapters, str):
        return adapters
    return adapters[0] if isinstance(adapters, (list, tuple)) and len(adapters) == 1 else None


def projection_refusal(proj: nn.Module) -> str | None:
    """Why `proj` is not a plain LoRA projection (the only kind the passes compute), or None."""
    lora_A = proj._modules.get("lora_A")
    if not isinstance(lora_A, nn.ModuleDict):
        return "no LoRA adapter"
    adapter = _active_adapter(proj)
    if adapter is None:
        return "not exactly one active adapter"
    if adapter not in lora_A:
        return f"active adapter {adapter!r} has no lora_A"
    dropout = proj.lora_dropout[adapter]
    if not isinstance(dropout, nn.Identity) and getattr(dropout, "p", 1.0) > 0:
        return f"lora_dropout {getattr(dropout, 'p', '?')} > 0"
    if proj.lora_B[adapter].bias is not None:
        return "lora_B has a bias (lora_bias=True)"
    variants = proj.__dict__.get("lora_variant") or {}
    if adapter in variants or adapter in getattr(proj, "lora_magnitude_vector", {}):
        return "DoRA or another LoRA variant"
    return _base_refusal(proj.get_base_layer()) or _qat_refusal(proj, adapter)


def _base_refusal(base: nn.Module) -> str | None:
    if getattr(base, "bias", None) is not None:
        return "the base layer has a bias"
    W = getattr(base, "weight", None)
    if not isinstance(W, torch.Tensor):
        return "no dense or 4-bit base weight (packed GPTQ/AWQ/MXFP4)"
    if W.requires_grad:
        return "the base weight is trainable"
    if W.dtype not in _FLOAT_WEIGHTS and getattr(W, "quant_state", None) is None:
        return f"{W.dtype} base weight (fp8 or packed)"
    return None


def _qat_refusal(proj: nn.Module, adapter: str) -> str | None:
    for module in (proj.get_base_layer(), proj.lora_A[adapter], proj.lora_B[adapter]):
        quantizer = getattr(module, "weight_fake_quantizer", None)
        if quantizer is not None or "activation_fake_quantizer" in module._modules:
            return "QAT fake quantization"
    return None


def lora_parameters(proj: nn.Module) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor, float]:
    """(W, quant_state, A, B, scaling) of a plain LoRA projection (as Unsloth's get_lora_parameters)."""
    adapter = _active_adapter(proj)
    W = proj.get_base_layer().weight
    A, B = proj.lora_A[adapter].weight, proj.lora_B[adapter].weight
    return W, getattr(W, "quant_state", None), A, B, proj.scaling[adapter]


def _runs_plain(projs: tuple[nn.Module, ...], X: torch.Tensor) -> bool:
    """Call-time check (cheap, instance dicts only): adapter on and unmerged, no autocast dtype change."""
    for proj in projs:
        state = proj.__dict__
        if state.get("_disable_adapters", True) or state.get("merged_adapters"):
            return False
    device = "cuda" if X.is_cuda else X.device.type
    return not (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != X.dtype)


def _qkv_hook(self: nn.Module, X: torch.Tensor, weight_fn: WeightFn, mode: str):
    projs = (self.q_proj, self.k_proj, self.v_proj)
    if not _runs_plain(projs, X):
        return getattr(self, PREVIOUS)["apply_qkv"](self, X)
    return lora_qkv(X, *(lora_parameters(p) for p in projs), weight_fn=weight_fn, mode=mode)


def _o_hook(self: nn.Module, X: torch.Tensor, weight_fn: WeightFn, mode: str):
    if not _runs_plain((self.o_proj,), X):
        return getattr(self, PREVIOUS)["apply_o"](self, X)
    return lora_linear(X, lora_parameters(self.o_proj), weight_fn=weight_fn)


def _mlp_slot(mlp: nn.Module) -> str:
    """Where Unsloth put its MLP hook: `forward`, or `_unsloth_forward` under its tiled MLP
    (unsloth_zoo.tiled_mlp: `forward` runs the MLP in row tiles, each through `_unsloth_forward`)."""
    return TILED_SLOT if TILED_SLOT in mlp.__dict__ else "forward"


def _mlp_hook(self: nn.Module, X: torch.Tensor, weight_fn: WeightFn, mode: str):
    projs = (self.gate_proj, self.up_proj, self.down_proj)
    if not _runs_plain(projs, X):
        return getattr(self, PREVIOUS)[_mlp_slot(self)](X)
    return lora_swiglu_mlp(X, *(lora_parameters(p) for p in projs), weight_fn=weight_fn, mode=mode)


def _mlp_method(weight_fn: WeightFn, mode: str) -> Callable:
    """`_mlp_hook` with its settings, as a plain function (bound with MethodType). Not a functools.partial:
    Unsloth's tiled MLP re-binds the hook per call (`self._unsloth_forward.__get__(self, cls)`), which a bound
    method forwards to its function, and a partial has no `__get__`. `.func` names the hook, as a partial's."""

    def hypersloth_lora_mlp(self: nn.Module, X: torch.Tensor):
        return _mlp_hook(self, X, weight_fn=weight_fn, mode=mode)

    hypersloth_lora_mlp.func = _mlp_hook  # type: ignore[attr-defined]
    return hypersloth_lora_mlp


def _hook_name(fn: Any) -> str | None:
    fn = getattr(fn, "__func__", fn)
    return getattr(getattr(fn, "func", fn), "__name__", None)


def _layer_refusal(layer: nn.Module) -> str | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return "no self_attn / mlp"
    if hasattr(mlp, "experts"):
        return "mlp is a mixture of experts (its adapters run on Unsloth's MoE LoRA path)"
    hooks = (_hook_name(attn.__dict__.get("apply_qkv")), _hook_name(attn.__dict__.get("apply_o")))
    if hooks != (UNSLOTH_QKV, UNSLOTH_O):
        return f"attention has no Unsloth {UNSLOTH_QKV} / {UNSLOTH_O} hook"
    slot = _mlp_slot(mlp)
    if _hook_name(mlp.__dict__.get(slot)) != UNSLOTH_MLP:
        return f"mlp has no Unsloth {UNSLOTH_MLP} {slot}"
    projections = ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj")))
    for owner, names in projections:
        for name in names:
            why = projection_refusal(getattr(owner, name))
            if why:
                return f"{name}: {why}"
    return None


def decoder_layers(model: nn.Module) -> list[nn.Module] | None:
    """The decoder layers of a causal LM, PEFT-wrapped or not (model.base_model.model.model.layers), or of the
    language model inside a multimodal one (Gemma 3 4B+: transformers' `get_decoder`), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, "model", None)
    if getattr(decoder, "layers", None) is None and hasattr(base, "get_decoder"):
        decoder = base.get_decoder()
    layers = getattr(decoder, "layers", None)
    return list(layers) if layers is not None else None


def install_lora_passes(model: nn.Module, weight_fn: WeightFn | None = None, mode: str = "auto") -> str | None:
    """Put our passes in place of Unsloth's QKV / O / MLP hooks on every layer; None when installed.

    All or nothing: the first layer that is not plain LoRA (or not patched by Unsloth) returns its reason,
    e.g. "layer 3 q_proj: lora_dropout 0.05 > 0", and no layer is changed.
    """
    layers = decoder_layers(model)
    if not layers:
        return "no decoder layers found (model.base_model.model.model.layers)"
    for index, layer in enumerate(layers):
        why = _layer_refusal(layer)
        if why:
            return f"layer {index} {why}"
    weight_fn = weight_fn or default_weight_fn()
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.__dict__[PREVIOUS] = {"apply_qkv": attn.apply_qkv, "apply_o": attn.apply_o}
        slot = _mlp_slot(mlp)
        mlp.__dict__[PREVIOUS] = {slot: mlp.__dict__[slot]}
        attn.apply_qkv = functools.partial(_qkv_hook, weight_fn=weight_fn, mode=mode)
        attn.apply_o = functools.partial(_o_hook, weight_fn=weight_fn, mode=mode)
        setattr(mlp, slot, types.MethodType(_mlp_method(weight_fn, mode), mlp))
    return None


def uninstall_lora_passes(model: nn.Module) -> int:
    """Put Unsloth's hooks back; returns how many modules were restored."""
    restored = 0
    for module in model.modules():
        previous: dict[str, Callable] | None = module.__dict__.pop(PREVIOUS, None)
        if previous is not None:
            for name, fn in previous.items():
                setattr(module, name, fn)
            restored += 1
    return restored
