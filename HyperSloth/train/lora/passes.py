"""LoRA projections for Unsloth's Qwen3 blocks (QKV, O, SwiGLU MLP) with fewer full-size memory passes.

Same math as Unsloth's LoRA_QKV / LoRA_W / LoRA_MLP (unsloth/kernels/fast_lora.py, checked against
unsloth 2026.10.9): y = X W^T + s (X A^T) B^T with W frozen, grads for X, A and B. Unsloth computes
`out = X W^T` and then `out.addmm_(X A^T, B^T, alpha=s)`: a memory-bound pass that reads and writes the
whole T x n output again (and the same into dX in the backward, once per projection). On Qwen3-0.6B those
K=r addmm_ passes were ~18% of a CUDA-graphed step's GPU time. Two ways around them, chosen per call:

- epilogue: write the small K=r product first (`out = tail B^T` with tail = s X A^T), then
  `out.addmm_(X, W^T)`, so the read-modify-write rides the epilogue of the compute-bound base GEMM;
  the backward likewise writes dX = U A (K = m*r, one GEMM for all projections) and adds every dY_i W_i.
- concat (projections sharing X: q/k/v, gate/up): X_aug = [X | s X A_1^T | ... | s X A_m^T] once, and
  one GEMM per projection with [W_i | 0 | B_i] (K = d + i*r): no output pass at all, at the price of
  copying X and building the augmented weight. `concat_pays` weighs both (copies at their measured cost) and picks.

The backward of both saves what Unsloth saves (X, or X_aug which contains it; e and g for the MLP) plus
the T x m*r `tail` (which also removes the recomputed X A^T of Unsloth's backward). The base weight comes
through an injected `weight_fn(W, quant_state) -> dense W` (Unsloth's fast_dequantize for 4-bit on GPU,
`dense_weight` on CPU). `lora_install` swaps these in for Unsloth's hooks.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

WeightFn = Callable[[Tensor, Any], Tensor]
MODES = ("auto", "concat", "epilogue")
_fwd = torch.amp.custom_fwd(device_type="cuda")
_bwd = torch.amp.custom_bwd(device_type="cuda")


def dense_weight(W: Tensor, quant_state: Any) -> Tensor:
    """The weight accessor for plain dense base weights (CPU, 16-bit models)."""
    if quant_state is not None:
        raise ValueError("dense_weight got a quantized weight: pass Unsloth's fast_dequantize as weight_fn")
    return W


# What the concat path's copies (X into X_aug, the augmented weight) cost per byte against the GEMMs' own
# streams: they run as strided, unvectorised copy kernels. Fitted to the blocks alone on an H200
# (scripts/lora_bench.py, docs/benchmarks/2026-12-01c-lora-bench.json, 100 reps): with 4 the rule below picks
# the faster path in all 8 measured cases (Qwen3-0.6B and 8B, q/k/v and gate/up, 8,192 and 22,528 tokens);
# counting bytes alone (1) picked concat in 7 of them and was slower in 6 (by up to 27%).
COPY_COST = 4


def concat_pays(tokens: int, d_in: int, n_out: int) -> bool:
    """True when the concat path costs less than the epilogue path for m projections sharing X.

    Per call, in elements (the m-dependent terms are equal on both sides and cancel):
    epilogue: X A^T reads X (T d); per projection the K=r GEMM writes T n_i and the base GEMM reads X,
    reads and writes its T n_i output and reads W: T d (1+m) + 3 T N + N d, N = sum n_i.
    concat: X A^T reads X, X is copied into X_aug (2 T d), each GEMM reads X_aug (T d) and writes T n_i,
    the augmented weight costs a read, a write and the GEMM's read of W: T d (3+m) + T N + 3 N d.
    With the copies (2 T d + 2 N d) weighted by COPY_COST, concat wins iff COPY_COST (T d + N d) < T N,
    i.e. COPY_COST (d/N + d/T) < 1: gate/up from ~12k tokens on Qwen3-0.6B and ~49k on Qwen3-8B; q/k/v
    (d/N >= 1/4 on both) and O or down (N < d) never.
    """
    return COPY_COST * (d_in * tokens + d_in * n_out) < tokens * n_out


def _use_concat(mode: str, tokens: int, d_in: int, n_out: int) -> bool:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode == "concat" or (mode == "auto" and concat_pays(tokens, d_in, n_out))


def _scaled(t: Tensor, s: float, dtype: torch.dtype) -> Tensor:
    """s t in `dtype`, with no kernel where there is nothing to do (s = 1 is the common lora_alpha = r)."""
    t = t.to(dtype)
    return t if s == 1 else t * s


def _cat(ts: Sequence[Tensor], dim: int = 0) -> Tensor:
    """torch.cat without the copy for one tensor (the O projection): fewer launches where steps run eagerly."""
    return ts[0] if len(ts) == 1 else torch.cat(list(ts), dim=dim)


def _scaled_A(As: Sequence[Tensor], ss: Sequence[float], dtype: torch.dtype) -> Tensor:
    """[s_1 A_1; ...; s_m A_m] (m*r x d): X times its transpose is every projection's scaled tail at once."""
    return _cat([_scaled(A, s, dtype) for A, s in zip(As, ss)])


def _epilogue_forward(X2: Tensor, Ws, quants, As, Bs, ss, weight_fn: WeightFn) -> tuple[list[Tensor], Tensor]:
    """Outputs via K=r GEMM first, then the base GEMM with beta=1; returns (outputs, tail = s X A^T)."""
    dtype = X2.dtype
    tail = torch.mm(X2, _scaled_A(As, ss, dtype).t())  # one read of X for every projection's X A^T
    outs, col = [], 0
    for W, quant, A, B in zip(Ws, quants, As, Bs):
        r = A.shape[0]
        out = torch.mm(tail[:, col : col + r], B.to(dtype).t())  # the only full-size write of the LoRA term
        out.addmm_(X2, weight_fn(W, quant).t())  # beta=1: the add rides the compute-bound GEMM's epilogue
        outs.append(out)
        col += r
    return outs, tail


def _concat_forward(X2: Tensor, Ws, quants, As, Bs, ss, weight_fn: WeightFn) -> tuple[list[Tensor], Tensor]:
    """Outputs of one GEMM each over X_aug = [X | tail]; returns (outputs, X_aug)."""
    T, d = X2.shape
    rank = sum(A.shape[0] for A in As)
    X_aug = X2.new_empty(T, d + rank)
    X_aug[:, :d].copy_(X2)
    torch.mm(X2, _scaled_A(As, ss, X2.dtype).t(), out=X_aug[:, d:])
    outs, col = [], d
    for W, quant, A, B in zip(Ws, quants, As, Bs):
        r = A.shape[0]
        W = weight_fn(W, quant)
        # [W | 0 | B]: projection i reads X_aug's first d + (i+1) r columns (a strided operand, no copy).
        W_aug = W.new_empty(W.shape[0], col + r)
        W_aug[:, :d].copy_(W)
        W_aug[:, d:col].zero_()
        W_aug[:, col:].copy_(B)
        outs.append(torch.mm(X_aug[:, : col + r], W_aug.t()))
        col += r
    return outs, X_aug


def _lora_u(dYs, Bs, ss) -> Tensor:
    """U = [s_1 dY_1 B_1 | ... | s_m dY_m B_m] (T x m r): the LoRA part of dX is U [A_1; ...; A_m]."""
    return _cat([torch.mm(dY, _scaled(B, s, dY.dtype)) for dY, B, s in zip(dYs, Bs, ss)], dim=1)


def _lora_grads(X2: Tensor, tail: Tensor, U: Tensor, dYs, As) -> tuple[list[Tensor], list[Tensor]]:
    """(dA_i = U_i^T X, dB_i = dY_i^T tail_i): one read of X for every dA, none for dB (tail was saved)."""
    dA_cat = torch.mm(U.t(), X2)
    return _split_rows(dA_cat, As), _lora_dB(dYs, tail, As)


def _lora_dB(dYs, tail: Tensor, As) -> list[Tensor]:
    """dB_i = dY_i^T (s_i X A_i^T), the saved tail (Unsloth recomputes X A^T here)."""
    dBs, col = [], 0
    for dY, A in zip(dYs, As):
        dBs.append(torch.mm(dY.t(), tail[:, col : col + A.shape[0]]))
        col += A.shape[0]
    return dBs


def _split_rows(M: Tensor, As) -> list[Tensor]:
    return list(torch.split(M, [A.shape[0] for A in As]))


def _input_grad(U: Tensor, dYs, Ws, quants, As, weight_fn: WeightFn, out: Tensor | None) -> Tensor:
    """dX = U [A_1; ...; A_m] (K = m r, the one write) + sum_i dY_i W_i (each added in a GEMM epilogue)."""
    A_cat = _cat([A.to(U.dtype) for A in As])
    dX = torch.mm(U, A_cat, out=out)
    for dY, W, quant in zip(dYs, Ws, quants):
        dX.addmm_(dY, weight_fn(W, quant))
    return dX


def _may_overwrite(X: Tensor) -> bool:
    """Unsloth's rule (fast_lora._may_overwrite_input): dX may go into X unless an RMSNorm saved it. And never
    into a leaf that requires grad: Unsloth's tiled MLP hands each row tile in as one (a view of its saved
    input with `.grad` preset), and autograd refuses a view made under no_grad whose base changed in place."""
    if X.is_leaf and X.requires_grad:
        return False
    base = X._base
    return not (
        getattr(X, "_unsloth_rmsnorm_saved", False)
        or (base is not None and getattr(base, "_unsloth_rmsnorm_saved", False))
    )


def _groups(params: Sequence[Any]) -> tuple[list, list, list, list, list]:
    """Split the flat (W, quant_state, A, B, s) * m argument list of the Functions below."""
    if len(params) % 5:
        raise ValueError("LoRA parameters come in groups of (W, quant_state, A, B, s)")
    return [list(params[i::5]) for i in range(5)]  # type: ignore[return-value]


def _dx_buffer(saved_input: Tensor, T: int, d: int, inplace: bool) -> Tensor | None:
    """Where dX goes: into the saved input's own storage (memory-neutral, as Unsloth's inplace) or new."""
    if not inplace or not saved_input.is_contiguous():
        return None
    return saved_input.view(-1)[: T * d].view(T, d)


class LoRASharedInput(torch.autograd.Function):
    """m LoRA projections of one input (q/k/v, or O alone): apply(X, weight_fn, mode, inplace, *groups)."""

    @staticmethod
    @_fwd
    def forward(ctx, X: Tensor, weight_fn: WeightFn, mode: str, inplace: bool, *params):
        Ws, quants, As, Bs, ss = _groups(params)
        X2 = X.reshape(-1, X.shape[-1])
        T, d = X2.shape
        n_out = sum(B.shape[0] for B in Bs)
        ctx.concat = _use_concat(mode, T, d, n_out) and len(Ws) > 1
        forward = _concat_forward if ctx.concat else _epilogue_forward
        outs, saved = forward(X2, Ws, quants, As, Bs, ss, weight_fn)
        first, last = (saved, []) if ctx.concat else (X, [saved])  # X_aug holds X and the tail
        ctx.save_for_backward(first, *As, *Bs, *last)
        ctx.meta = (X.shape, d, Ws, quants, ss, weight_fn, inplace and (ctx.concat or _may_overwrite(X)))
        return tuple(out.view(*X.shape[:-1], -1) for out in outs)

    @staticmethod
    @_bwd
    def backward(ctx, *dYs):
        shape, d, Ws, quants, ss, weight_fn, inplace = ctx.meta
        m = len(Ws)
        saved = ctx.saved_tensors
        As, Bs = list(saved[1 : 1 + m]), list(saved[1 + m : 1 + 2 * m])
        if ctx.concat:
            X_aug = saved[0]
            X2, tail, storage = X_aug[:, :d], X_aug[:, d:], X_aug
        else:
            X2, tail = saved[0].reshape(-1, d), saved[-1]
            storage = saved[0]
        dYs = [dY.reshape(-1, dY.shape[-1]) for dY in dYs]
        U = _lora_u(dYs, Bs, ss)
        dAs, dBs = _lora_grads(X2, tail, U, dYs, As)
        out = _dx_buffer(storage, X2.shape[0], d, inplace)  # X is no longer read past this point
        dX = _input_grad(U, dYs, Ws, quants, As, weight_fn, out)
        grads: list[Tensor | None] = []
        for dA, dB in zip(dAs, dBs):
            grads += [None, None, dA, dB, None]
        return (dX.view(shape), None, None, None, *grads)


def torch_swiglu_forward(e: Tensor, g: Tensor) -> Tensor:
    """h = silu(e) * g, rounded as Unsloth's swiglu_fg_kernel (silu in fp32, cast, then times g)."""
    e32 = e.float()
    return (e32 * torch.sigmoid(e32)).to(g.dtype) * g


def torch_swiglu_backward(DW: Tensor, e: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(h, df, de) from the down projection's input grad, as Unsloth's swiglu_DWf_DW_dfg_kernel."""
    e32 = e.float()
    se = torch.sigmoid(e32)
    f = (se * e32).to(DW.dtype)
    dg = DW * g
    de = (dg.float() * se * (1.0 + e32 * (1.0 - se))).to(DW.dtype)
    return f * g, DW * f, de


def swiglu_functions(device: torch.device) -> tuple[Callable, Callable]:
    """Unsloth's Triton SwiGLU kernels on CUDA when importable, else the torch formulas above."""
    if device.type == "cuda":
        try:
            from unsloth.kernels.swiglu import swiglu_DWf_DW_dfg_kernel, swiglu_fg_kernel
        except ImportError:
            return torch_swiglu_forward, torch_swiglu_backward
        # swiglu_fg_kernel wants (batch, seq, hidden); the backward kernel takes 2D and works in place.
        def forward(e: Tensor, g: Tensor) -> Tensor:
            return swiglu_fg_kernel(e.unsqueeze(0), g.unsqueeze(0)).squeeze(0)

        return forward, swiglu_DWf_DW_dfg_kernel
    return torch_swiglu_forward, torch_swiglu_backward


class LoRASwiGLU(torch.autograd.Function):
    """down(silu(gate(X)) * up(X)), LoRA on all three: apply(X, weight_fn, mode, inplace, swiglu, *3 groups)."""

    @staticmethod
    @_fwd
    def forward(ctx, X: Tensor, weight_fn: WeightFn, mode: str, inplace: bool, swiglu, *params):
        Ws, quants, As, Bs, ss = _groups(params)
        X2 = X.reshape(-1, X.shape[-1])
        T, d = X2.shape
        ctx.concat = _use_concat(mode, T, d, Bs[0].shape[0] + Bs[1].shape[0])
        forward = _concat_forward if ctx.concat else _epilogue_forward
        (e, g), saved = forward(X2, Ws[:2], quants[:2], As[:2], Bs[:2], ss[:2], weight_fn)
        h = swiglu[0](e, g)
        (out,), tail_down = _epilogue_forward(h, Ws[2:], quants[2:], As[2:], Bs[2:], ss[2:], weight_fn)
        # h is not saved: the backward kernel recomputes it from e and g, as Unsloth's does.
        first, last = (saved, []) if ctx.concat else (X, [saved])
        ctx.save_for_backward(first, e, g, tail_down, *As, *Bs, *last)
        inplace = inplace and (ctx.concat or _may_overwrite(X))
        ctx.meta = (X.shape, d, Ws, quants, ss, weight_fn, swiglu[1], inplace)
        return out.view(*X.shape[:-1], -1)

    @staticmethod
    @_bwd
    def backward(ctx, dY: Tensor):
        shape, d, Ws, quants, ss, weight_fn, swiglu_backward, inplace = ctx.meta
        saved = ctx.saved_tensors
        first, e, g, tail_down = saved[:4]
        As, Bs = list(saved[4:7]), list(saved[7:10])
        dY = dY.reshape(-1, dY.shape[-1])
        # Down projection: DW = U_down A_down, then += dY W_down in the base GEMM's epilogue.
        U_down = _lora_u([dY], Bs[2:], ss[2:])
        (dB_down,) = _lora_dB([dY], tail_down, As[2:])
        DW = _input_grad(U_down, [dY], Ws[2:], quants[2:], As[2:], weight_fn, None)
        h, df, de = swiglu_backward(DW, e, g)
        dA_down = torch.mm(U_down.t(), h)
        if ctx.concat:
            X2, tail, storage = first[:, :d], first[:, d:], first
        else:
            X2, tail, storage = first.reshape(-1, d), saved[-1], first
        U = _lora_u([de, df], Bs[:2], ss[:2])
        dAs, dBs = _lora_grads(X2, tail, U, [de, df], As[:2])
        out = _dx_buffer(storage, X2.shape[0], d, inplace)
        dX = _input_grad(U, [de, df], Ws[:2], quants[:2], As[:2], weight_fn, out)
        grads: list[Tensor | None] = []
        for dA, dB in zip([*dAs, dA_down], [*dBs, dB_down]):
            grads += [None, None, dA, dB, None]
        return (dX.view(shape), None, None, None, None, *grads)


def lora_qkv(
    X: Tensor,
    q: Sequence,
    k: Sequence,
    v: Sequence,
    weight_fn: WeightFn = dense_weight,
    mode: str = "auto",
    inplace: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """(Q, K, V) from X and each projection's (W, quant_state, A, B, s)."""
    return LoRASharedInput.apply(X, weight_fn, mode, inplace, *q, *k, *v)


def lora_linear(X: Tensor, proj: Sequence, weight_fn: WeightFn = dense_weight) -> Tensor:
    """One LoRA projection (O): always the epilogue path (concat needs m > 1 to pay); dX in a new buffer."""
    (out,) = LoRASharedInput.apply(X, weight_fn, "epilogue", False, *proj)
    return out


def lora_swiglu_mlp(
    X: Tensor,
    gate: Sequence,
    up: Sequence,
    down: Sequence,
    weight_fn: WeightFn = dense_weight,
    mode: str = "auto",
    inplace: bool = True,
    swiglu: tuple[Callable, Callable] | None = None,
) -> Tensor:
    """down(silu(gate(X)) * up(X)) from each projection's (W, quant_state, A, B, s)."""
    swiglu = swiglu or swiglu_functions(X.device)
    return LoRASwiGLU.apply(X, weight_fn, mode, inplace, swiglu, *gate, *up, *down)
