"""lora_passes against plain autograd on y = X W^T + s (X A^T) B^T (and the SwiGLU MLP built from it), fp32
on CPU, both paths (concat, epilogue) and the automatic choice; mutants that drop a term must fail the check;
lora_install on a tiny PEFT Qwen3 carrying stand-ins for Unsloth's hooks (Unsloth is not installed here)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from HyperSloth.train.lora import passes as lp

TOL = 1e-5
# (T, d_in, q, kv, intermediate, r): T not a multiple of anything, in != out, r 8 and 16.
SHAPES = [(37, 24, 32, 16, 40, 8), (101, 48, 48, 16, 72, 16), (5, 16, 64, 32, 24, 16)]
MODES = ["concat", "epilogue", "auto"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def projection(n: int, d: int, r: int, s: float, gen: torch.Generator):
    """(W, quant_state, A, B, s) with the LoRA term as large as the base term, so dropping either shows."""
    W = torch.randn(n, d, generator=gen) / d**0.5
    A = (torch.randn(r, d, generator=gen) / d**0.5).requires_grad_()
    B = (torch.randn(n, r, generator=gen) / r**0.5).requires_grad_()
    return W, None, A, B, s


def ref_linear(X, p):
    W, _, A, B, s = p
    return X @ W.t() + s * (X @ A.to(X.dtype).t()) @ B.to(X.dtype).t()


def ref_mlp(X, gate, up, down):
    return ref_linear(F.silu(ref_linear(X, gate)) * ref_linear(X, up), down)


def grads(outs, X, projs, seed: int = 1):
    """d(sum_i <out_i, G_i>)/d(X, A_1, B_1, ...) with fixed random G_i."""
    gen = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
    leaves = [X] + [t for p in projs for t in (p[2], p[3])]
    return torch.autograd.grad(outs, leaves, cot)


def check(ours, ref, names):
    errors = {name: rel_err(a, b) for name, a, b in zip(names, ours, ref)}
    assert max(errors.values()) < TOL, errors


def qkv_case(shape, mode, inplace=True, seed=0):
    T, d, q, kv, _, r = shape
    gen = torch.Generator().manual_seed(seed)
    projs = [projection(n, d, r, s, gen) for n, s in ((q, 2.0), (kv, 0.5), (kv, 1.0))]
    X = torch.randn(1, T, d, generator=gen, requires_grad=True)
    outs = lp.lora_qkv(X.clone(), *projs, mode=mode, inplace=inplace)
    refs = [ref_linear(X, p) for p in projs]
    return outs, refs, X, projs


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_qkv_matches_autograd(shape, mode):
    outs, refs, X, projs = qkv_case(shape, mode)
    check(outs, refs, ["Q", "K", "V"])
    names = ["dX", "dAq", "dBq", "dAk", "dBk", "dAv", "dBv"]
    check(grads(outs, X, projs), grads(refs, X, projs), names)


@pytest.mark.parametrize("inplace", [True, False])
def test_qkv_dx_in_place_or_not_same_numbers(inplace):
    outs, refs, X, projs = qkv_case(SHAPES[0], "concat", inplace=inplace)
    check(grads(outs, X, projs), grads(refs, X, projs), ["dX", "dAq", "dBq", "dAk", "dBk", "dAv", "dBv"])


@pytest.mark.parametrize("shape", SHAPES)
def test_o_projection_matches_autograd(shape):
    T, d, q, _, _, r = shape
    gen = torch.Generator().manual_seed(3)
    proj = projection(d, q, r, 2.0, gen)  # O maps the q width back to hidden: in != out
    X = torch.randn(2, T, q, generator=gen, requires_grad=True)
    out, ref = lp.lora_linear(X, proj), ref_linear(X, proj)
    check([out], [ref], ["O"])
    check(grads([out], X, [proj]), grads([ref], X, [proj]), ["dX", "dA", "dB"])


def mlp_case(shape, mode, seed=0):
    T, d, _, _, inter, r = shape
    gen = torch.Generator().manual_seed(seed)
    gate, up = projection(inter, d, r, 2.0, gen), projection(inter, d, r, 0.5, gen)
    down = projection(d, inter, r, 1.0, gen)
    X = torch.randn(1, T, d, generator=gen, requires_grad=True)
    out = lp.lora_swiglu_mlp(X.clone(), gate, up, down, mode=mode)
    return out, ref_mlp(X, gate, up, down), X, [gate, up, down]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_swiglu_mlp_matches_autograd(shape, mode):
    out, ref, X, projs = mlp_case(shape, mode)
    check([out], [ref], ["out"])
    names = ["dX", "dAg", "dBg", "dAu", "dBu", "dAd", "dBd"]
    check(grads([out], X, projs), grads([ref], X, projs), names)


def test_torch_swiglu_matches_silu_and_its_derivative():
    gen = torch.Generator().manual_seed(5)
    e, g, DW = (torch.randn(7, 13, generator=gen) for _ in range(3))  # fp32: the formulas compute in fp32
    h = lp.torch_swiglu_forward(e, g)
    assert rel_err(h, F.silu(e) * g) < 1e-6
    e_ = e.clone().requires_grad_()
    g_ = g.clone().requires_grad_()
    de, dg = torch.autograd.grad(F.silu(e_) * g_, [e_, g_], DW)
    h2, df, de2 = lp.torch_swiglu_backward(DW, e, g)
    assert rel_err(h2, h) < 1e-6 and rel_err(df, dg) < 1e-6 and rel_err(de2, de) < 1e-6


@pytest.mark.parametrize("mode", ["concat", "epilogue"])
@pytest.mark.parametrize(
    "target, mutant, broken",
    [
        ("_scaled_A", lambda orig: lambda As, ss, dtype: orig(As, ss, dtype) * 0, "out"),  # LoRA term of y
        ("_lora_dB", lambda orig: lambda dYs, tail, As: [t * 0 for t in orig(dYs, tail, As)], "dB"),
        ("_input_grad", lambda orig: lambda U, *a: orig(U * 0, *a), "dX"),  # LoRA term of dX
        ("_input_grad", lambda orig: lambda U, d, W, *a: orig(U, d, [w * 0 for w in W], *a), "dX"),  # base term
    ],
)
def test_a_dropped_term_fails_the_check(monkeypatch, mode, target, mutant, broken):
    monkeypatch.setattr(lp, target, mutant(getattr(lp, target)))
    out, ref, X_mlp, mlp_projs = mlp_case(SHAPES[1], mode)
    for outs, refs, X, projs in (qkv_case(SHAPES[1], mode), ([out], [ref], X_mlp, mlp_projs)):
        ours, ref = grads(outs, X, projs), grads(refs, X, projs)
        errors = {"out": max(rel_err(a, b) for a, b in zip(outs, refs)), "dX": rel_err(ours[0], ref[0]),
                  "dB": max(rel_err(a, b) for a, b in zip(ours[2::2], ref[2::2]))}
        assert errors[broken] > 1e-2, errors


def test_concat_pays_where_the_h200_measured_it_faster():
    # docs/benchmarks/2026-12-01c-lora-bench.json: concat was faster only for Qwen3-0.6B gate/up (1024 -> 6144)
    # at 22,528 tokens; q/k/v (1024 -> 4096) and every 8,192-token and Qwen3-8B case went to the epilogue path.
    assert lp.concat_pays(22528, 1024, 6144)
    assert not lp.concat_pays(22528, 1024, 4096) and not lp.concat_pays(8192, 1024, 6144)
    assert not lp.concat_pays(8192, 1024, 4096)
    assert not lp.concat_pays(22528, 4096, 6144) and not lp.concat_pays(22528, 4096, 24576)
    assert not lp.concat_pays(22528, 2048, 1024)  # O / down (N < d): never
    # Longer rows pay for the copies: 8B gate/up at 64k tokens.
    assert lp.concat_pays(65536, 4096, 24576)


def test_auto_mode_takes_the_path_concat_pays_picks(monkeypatch):
    calls = []
    for name in ("_concat_forward", "_epilogue_forward"):
        orig = getattr(lp, name)
        monkeypatch.setattr(lp, name, functools.partial(lambda o, n, *a: calls.append(n) or o(*a), orig, name))
    qkv_case((200, 16, 64, 32, 0, 8), "auto")  # COPY_COST (d/N + d/T) = 4 (0.125 + 0.08) < 1: concat
    qkv_case((37, 16, 64, 32, 0, 8), "auto")  # 4 (0.125 + 0.43) > 1: epilogue
    assert calls == ["_concat_forward", "_epilogue_forward"]
    with pytest.raises(ValueError, match="mode must be one of"):
        qkv_case(SHAPES[0], "fast")


def test_dense_weight_refuses_a_quant_state():
    with pytest.raises(ValueError, match="fast_dequantize"):
        lp.dense_weight(torch.zeros(2, 2), object())


@pytest.mark.parametrize("mode", ["concat", "epilogue"])
def test_bf16_activations_with_fp32_adapters_stay_at_bf16_error(mode):
    """The GPU dtypes: bf16 X and W, adapters in fp32 or bf16; grads come back in each adapter's dtype."""
    gen = torch.Generator().manual_seed(7)
    T, d, inter, r = 300, 64, 192, 16
    projs = [projection(n, k, r, 2.0, gen) for n, k in ((inter, d), (inter, d), (d, inter))]
    projs[2] = (projs[2][0], None, projs[2][2].detach().bfloat16().requires_grad_(),
                projs[2][3].detach().bfloat16().requires_grad_(), 2.0)  # down's adapter in bf16
    bf16 = [(W.bfloat16(), None, A, B, s) for W, _, A, B, s in projs]
    X = torch.randn(1, T, d, generator=gen).bfloat16()
    Xl = X.clone().requires_grad_()
    out = lp.lora_swiglu_mlp(Xl.clone(), *bf16, mode=mode)
    ours = grads([out], Xl, bf16)
    assert out.dtype == ours[0].dtype == torch.bfloat16
    assert [g.dtype for g in ours[1:]] == [torch.float32] * 4 + [torch.bfloat16] * 2
    ref_projs = [(W.float(), None, A, B, s) for W, _, A, B, s in bf16]
    Xf = X.float().requires_grad_()
    ref = ref_mlp(Xf, *ref_projs)
    ref_grads = grads([ref], Xf, ref_projs)
    errors = [rel_err(out.float(), ref)] + [rel_err(a.float(), b.float()) for a, b in zip(ours, ref_grads)]
    assert max(errors) < 2e-2, errors  # bf16 rounding (2^-8 relative per op), not a dropped term
