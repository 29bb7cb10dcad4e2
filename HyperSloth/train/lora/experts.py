"""An MoE layer's expert adapters as two small grouped GEMMs per projection, instead of PEFT's expert stack.

PEFT adapts a fused expert tensor (`target_parameters`, peft 0.21 `ParamWrapper`) by a parametrization: on every
forward it forms W + s·lhs·rhs for the whole stack (`torch.baddbmm`, every expert, routed or not), and the
experts then run on that. So each step builds a second copy of every expert weight, and the backward computes
the gradient of that full copy before it reaches the adapter. For Qwen3-30B-A3B's shape that is 1.2 GB per
layer and a GEMM the size of the base weight's own, for adapters of rank 16.

Here the adapter runs beside the base weight, as LoRA on a linear layer does: for the rows routed to expert e,
y = x·Wₑᵀ + s·(x·rhsₑᵀ)·lhsₑᵀ (W stored (experts, out, in); for a layout stored (experts, in, out), gpt-oss's,
y = x·Wₑ + s·(x·lhsₑ)·rhsₑ), each product a grouped GEMM over the rows sorted by expert, with the offsets that
transformers' own `grouped_mm` experts use (`histc` and `cumsum` on the device: nothing read on the host, which
transformers keeps for CUDA graphs). lhs, rhs and s are PEFT's own factors (`ParamWrapper.get_delta_factors`),
so the adapter, its initialisation, its saved file and its merge stay PEFT's. Everything else (sorting, the
sentinel rows of expert parallelism, biases, the gate function, the routing weights, the per-token sum) follows
`transformers.integrations.moe.grouped_mm_experts_forward`, whose grouped-linear helpers it calls.

What the backward keeps is cut to what it needs (docs/models.md): the base GEMMs nothing (frozen weights), the
adapter's first product the tokens rather than their top_k gathered copies (`GatheredLowRank`, which gathers again
in the backward), and the gate only its input (`GateThenWeight`: the routing weight is applied before the down
projection, where a row has the expert's width, and the gate is recomputed). At Qwen3-30B-A3B's widths that is
2,593 numbers per routed token where plain autograd of the same pass keeps 7,200.

`install_grouped_expert_lora` puts this forward on the outermost `ParamWrapper` of each experts module (the
instance's `forward`; PEFT's class stays as it is), and leaves a module whose LoRA is not plain to PEFT with a
reason. With the adapter disabled (DPO's and GRPO's reference forward) or merged, PEFT's own forward runs.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

MARK = "_hypersloth_grouped_experts"  # set on an installed wrapper


def wrapper_chain(module: nn.Module) -> list[nn.Module]:
    """The ParamWrappers around an experts module, outermost first (empty when `module` is not one)."""
    from peft.tuners.lora.layer import ParamWrapper

    chain = []
    while isinstance(module, ParamWrapper):
        chain.append(module)
        module = module.base_layer
    return chain


def _active_adapter(wrapper: nn.Module) -> str | None:
    adapters = wrapper.active_adapters
    return adapters[0] if len(adapters) == 1 else None


LAYOUT = ("has_gate", "has_bias", "is_transposed")  # what transformers' `use_experts_implementation` sets


def read_layout(base: nn.Module) -> dict[str, bool] | str:
    """The fused experts module's layout, as transformers' `use_experts_implementation` sets it in `__init__`
    (`has_gate`, `has_bias`, `is_transposed`), or why it cannot be told. A copy of the class made without that
    decorator (Unsloth compiles the modeling file into its own cache: on the H200 its Qwen3MoeExperts had none of
    the three) keeps only the parameters, so the layout is read from their names and shapes: gate_up_proj (or
    up_proj) stored (experts, out, in) gives the projection's input width as its last dimension, equal to
    down_proj's output width, the middle one of (experts, hidden, intermediate); stored (experts, in, out) it is
    the other way round. Without a gate both readings can fit; then the module's hidden width decides."""
    if all(hasattr(base, k) for k in LAYOUT):
        return {k: bool(getattr(base, k)) for k in LAYOUT}
    params = base._parameters
    first = "gate_up_proj" if "gate_up_proj" in params else "up_proj"
    up, down = params.get(first), params.get("down_proj")
    if up is None or down is None or up.dim() != 3 or down.dim() != 3 or not up.is_floating_point():
        return f"{type(base).__name__} has no 3-D floating-point {first} and down_proj"
    width = 2 if first == "gate_up_proj" else 1  # gate and up side by side
    plain = up.shape[2] == down.shape[1] and up.shape[1] == width * down.shape[2]
    transposed = up.shape[1] == down.shape[2] and up.shape[2] == width * down.shape[1]
    hidden = next((v for v in (getattr(base, "hidden_dim", None), getattr(base, "hidden_size", None),
                               getattr(getattr(base, "config", None), "hidden_size", None)) if isinstance(v, int)), None)
    if plain and transposed and hidden is not None:  # without a gate both readings fit; the hidden width decides
        plain, transposed = up.shape[2] == hidden, up.shape[1] == hidden
    if plain == transposed:
        return (f"{type(base).__name__}'s {first} {tuple(up.shape)} and down_proj {tuple(down.shape)} do not say "
                f"which way the experts are stored")
    return {"has_gate": first == "gate_up_proj", "has_bias": f"{first}_bias" in params, "is_transposed": transposed}


def refusal(chain: list[nn.Module]) -> str | None:
    """Why these wrappers' experts cannot run here (None: they can)."""
    from transformers.integrations import moe

    base = chain[-1].get_base_layer()
    if not hasattr(moe, "_grouped_linear"):
        return "this transformers has no grouped experts (transformers.integrations.moe._grouped_linear)"
    if not hasattr(base, "num_experts"):
        return f"{type(base).__name__} is not a fused experts module transformers' grouped_mm runs"
    layout = read_layout(base)
    if isinstance(layout, str):
        return layout
    if not (hasattr(base, "_apply_gate") or hasattr(base, "act_fn")):  # the gate function, or the activation
        return f"{type(base).__name__} has neither a gate function (_apply_gate) nor an activation (act_fn)"
    names = {w.parameter_name for w in chain}
    known = {"gate_up_proj" if layout["has_gate"] else "up_proj", "down_proj"}
    if not names <= known or len(names) != len(chain):
        return f"adapters on {sorted(names)}, not the expert projections {sorted(known)}"
    for wrapper in chain:
        adapter = _active_adapter(wrapper)
        if adapter is None or adapter not in wrapper.lora_A:
            return "not exactly one active adapter"
        if wrapper.use_dora.get(adapter) or wrapper.lora_bias.get(adapter):
            return "a DoRA or bias adapter"
        if not isinstance(wrapper.lora_dropout[adapter], nn.Identity):
            return "LoRA dropout"
    return None


GROUPED_MM_ALIGNMENT = 16  # bytes: torch's grouped GEMM wants every matrix's leading stride a multiple of this


def aligned_rank(lhs: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lhs (experts, d1, r) and rhs (experts, r, d2) with r zero-padded to a multiple of 16 bytes (bf16: 8; torch's
    grouped GEMM refuses r=4 in bf16, "strides should be multiple of 16 bytes"): the same product, and the
    padding's gradient goes nowhere."""
    multiple = max(1, GROUPED_MM_ALIGNMENT // lhs.element_size())
    pad = -lhs.shape[-1] % multiple
    if pad == 0:
        return lhs, rhs
    return nn.functional.pad(lhs, (0, pad)), nn.functional.pad(rhs, (0, 0, 0, pad))


def _project(x: torch.Tensor, base: nn.Module, name: str, offsets: torch.Tensor, expert_ids: torch.Tensor,
             factors: tuple[torch.Tensor, torch.Tensor, float] | None,
             bias_scale: torch.Tensor | None = None, gathered_from: tuple | None = None) -> torch.Tensor:
    """One expert projection of the rows sorted by expert: the base weight's grouped GEMM, plus the adapter's two.
    `bias_scale` (one number per row) multiplies the bias, for rows that come in already scaled by it.
    `gathered_from` = (tokens, token_of_row, sentinel) where `x` is `tokens[token_of_row]` with the sentinel rows
    zeroed: the adapter's first product then keeps `tokens` for its backward, not `x` (GatheredLowRank)."""
    from transformers.integrations.moe import _grouped_linear

    weight = base._parameters[name]  # the stored weight: no parametrization is active on this path
    bias = getattr(base, f"{name}_bias")[expert_ids] if base.has_bias else None
    if bias is not None and bias_scale is not None:
        bias = bias * bias_scale.unsqueeze(-1)
    out = _grouped_linear(x, weight, offsets, bias=bias, is_transposed=base.is_transposed)
    if factors is None:
        return out
    lhs, rhs, scaling = factors  # the delta of expert e is scaling * lhs[e] @ rhs[e], shaped like weight[e]
    lhs, rhs = aligned_rank(lhs, rhs)
    # y = x @ W[e] (stored transposed): x @ lhs[e] @ rhs[e]; y = x @ W[e].T: x @ rhs[e].T @ lhs[e].T
    first, second = (lhs, rhs) if base.is_transposed else (rhs, lhs)
    first, second = first.contiguous(), second.contiguous()
    if gathered_from is None:
        low = _grouped_linear(x, first, offsets, is_transposed=base.is_transposed)
    else:
        low = GatheredLowRank.apply(*gathered_from, first, offsets, base.is_transposed)
    return out + scaling * _grouped_linear(low, second, offsets, is_transposed=base.is_transposed)


def _note_autocast(ctx, like: torch.Tensor) -> None:
    """Remember the forward's autocast state, for a backward that recomputes part of it (as torch's checkpoint does)."""
    device = like.device.type
    ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))


def _autocast_of_forward(ctx):
    device, enabled, dtype = ctx.autocast
    return torch.autocast(device, dtype=dtype, enabled=enabled)


def _gathered_low_rank(tokens, token_of_row, sentinel, factor, offsets, transposed: bool) -> torch.Tensor:
    from transformers.integrations.moe import _grouped_linear

    rows = tokens[token_of_row].masked_fill(sentinel, 0.0)
    return _grouped_linear(rows, factor, offsets, is_transposed=transposed)


class GatheredLowRank(torch.autograd.Function):
    """tokens[token_of_row] through the adapter's first (rank-wide) grouped GEMM, keeping `tokens` (one row per
    token) for the backward instead of the gathered rows (top_k rows per token), and gathering again there. The base
    GEMM beside it keeps nothing (its weight is frozen), so this is what lets the gathered rows go after the
    forward: top_k x hidden numbers per token, the largest thing the pass kept."""

    @staticmethod
    def forward(ctx, tokens, token_of_row, sentinel, factor, offsets, transposed: bool) -> torch.Tensor:
        ctx.transposed = transposed
        _note_autocast(ctx, tokens)
        ctx.save_for_backward(tokens, token_of_row, sentinel, factor, offsets)
        return _gathered_low_rank(tokens, token_of_row, sentinel, factor, offsets, transposed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tokens, token_of_row, sentinel, factor, offsets = ctx.saved_tensors
        need_tokens, need_factor = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
        with torch.enable_grad(), _autocast_of_forward(ctx):
            tokens_ = tokens.detach().requires_grad_(need_tokens)
            factor_ = factor.detach().requires_grad_(need_factor)
            low = _gathered_low_rank(tokens_, token_of_row, sentinel, factor_, offsets, ctx.transposed)
        wanted = [t for t, need in ((tokens_, need_tokens), (factor_, need_factor)) if need]
        grads = iter(torch.autograd.grad(low, wanted, grad) if wanted else ())
        return (next(grads) if need_tokens else None, None, None, next(grads) if need_factor else None, None, None)


class GateThenWeight(torch.autograd.Function):
    """gate(x) · w per row, keeping only x and w for the backward, which recomputes the gate (elementwise, cheap).
    Autograd would keep the gate's input, its activation and the product of the two (three rows of the expert's
    width, or four counting the gated half's view of x); this keeps x (two) and w."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, gate) -> torch.Tensor:
        ctx.gate = gate
        _note_autocast(ctx, x)
        ctx.save_for_backward(x, w)
        return gate(x) * w.unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        with torch.enable_grad(), _autocast_of_forward(ctx):
            x_ = x.detach().requires_grad_(True)
            act = ctx.gate(x_)
        grad_x = torch.autograd.grad(act, x_, grad * w.unsqueeze(-1))[0] if ctx.needs_input_grad[0] else None
        grad_w = (grad * act.detach()).sum(-1).to(w.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The forward installed on the outermost ParamWrapper (`self`): the experts with their adapters split."""
    chain = wrapper_chain(self)
    if any(w.disable_adapters or w.merged or _active_adapter(w) is None for w in chain):
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    base = chain[-1].get_base_layer()
    factors = {w.parameter_name: w.get_delta_factors(_active_adapter(w)) for w in chain}
    device, top_k, tokens = hidden_states.device, top_k_index.size(-1), hidden_states.size(0)
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
    token_of_row = perm // top_k
    rows = hidden_states[token_of_row]
    weights_g = top_k_weights.reshape(-1)[perm]
    # histc, not bincount: sizes stay on the device (transformers: "to avoid cuda graph issues"); CPU wants floats
    counts = torch.histc(expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int(),
                         bins=base.num_experts, min=0, max=base.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    sentinel = (expert_ids_g >= base.num_experts).unsqueeze(-1)  # expert parallelism's ids past the last expert
    expert_ids_g = expert_ids_g.clamp(max=base.num_experts - 1)
    rows = rows.masked_fill(sentinel, 0.0)
    first = "gate_up_proj" if base.has_gate else "up_proj"
    out = _project(rows, base, first, offsets, expert_ids_g, factors.get(first),
                   gathered_from=(hidden_states, token_of_row, sentinel)).masked_fill(sentinel, 0.0)
    # The routing weight goes in before the down projection ((a·W + b)·w = (a·w)·W + b·w), where a row is the
    # expert's width, not the hidden width, and the gate is recomputed in the backward. With GatheredLowRank above,
    # autograd keeps hidden/top_k + 3·width + 2·r + 1 numbers per routed token (Qwen3-30B-A3B: 2,593) where plain
    # autograd of the same pass keeps 2·hidden + 4·width + 2·r (7,200).
    gate = base._apply_gate if base.has_gate else base.act_fn
    weights_g = weights_g.to(out.dtype)
    out = GateThenWeight.apply(out, weights_g, gate)
    weighted = _project(out, base, "down_proj", offsets, expert_ids_g, factors.get("down_proj"),
                        bias_scale=weights_g).masked_fill(sentinel, 0.0)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=device)
    return weighted[inverse].view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def give_layout(base: nn.Module) -> None:
    """Set the layout attributes transformers' decorator would have set, where a copy of the class lacks them (the
    grouped forward and transformers' helpers read them), and the default gate function where the class has none."""
    from transformers.integrations import moe

    for key, value in read_layout(base).items():
        if not hasattr(base, key):
            setattr(base, key, value)
    if base.has_gate and not hasattr(base, "_apply_gate"):
        base._apply_gate = types.MethodType(moe._default_apply_gate, base)


def install_grouped_expert_lora(model: nn.Module) -> tuple[int, str | None]:
    """Put `grouped_experts_forward` on every adapted experts module of `model`: (how many, None), or (0, why
    not) at the first one that cannot take it (then none is changed)."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    inner = {id(w.base_layer) for w in wrappers}
    outermost = [w for w in wrappers if id(w) not in inner]
    if not outermost:
        return 0, "no adapted experts"
    for module in outermost:
        why = refusal(wrapper_chain(module))
        if why is not None:
            return 0, why
    for module in outermost:
        give_layout(wrapper_chain(module)[-1].get_base_layer())
        module.forward = types.MethodType(grouped_experts_forward, module)
        setattr(module, MARK, True)
    return len(outermost), None
