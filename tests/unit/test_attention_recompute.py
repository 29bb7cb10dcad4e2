"""Attention outputs kept through gradient checkpointing (HyperSloth.train.attention.recompute), on the CPU: a stand-in
for Unsloth's flash-varlen Function (same protocol: it saves out and the log-sum-exp, and its backward reads them, as
flash attention's does) inside a stand-in of Unsloth's checkpointer (first pass without gradients, the recompute
under its marker). Kept outputs must give the recompute's gradients exactly, with one attention forward per layer."""

import types
from contextlib import contextmanager

import pytest
import torch

from HyperSloth.train.attention.recompute import KeptAttention, cap_from_budget, reusing

FORWARDS = [0]  # attention kernel forwards run
RECOMPUTING = [False]  # unsloth_zoo's in_gradient_checkpoint_recompute, stood in for


def _attend(q, k, v, cu, scale):
    """Causal attention per segment of a packed row: out [T, H, D] and lse [H, T] (fp32)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out, lse = torch.zeros_like(q), q.new_zeros(q.shape[1], q.shape[0])
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        s = torch.einsum("thd,shd->hts", q[a:b], k[a:b]) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        lse[:, a:b] = torch.logsumexp(s, dim=-1)
        out[a:b] = torch.einsum("hts,shd->thd", torch.exp(s - lse[:, a:b, None]), v[a:b])
    return out, lse


class _FlashLike(torch.autograd.Function):
    """Unsloth's `_LeanFlashVarlen` protocol on the CPU; the backward uses the saved out and lse as flash's does."""

    @staticmethod
    def forward(ctx, query, key, value, cu_seqlens, max_seqlen, is_causal, scale, window_left, window_right):
        FORWARDS[0] += 1
        out, lse = _attend(query, key, value, cu_seqlens, scale)
        seed, offset = torch.zeros(()), torch.zeros(())
        ctx.save_for_backward(query, key, value, cu_seqlens, out, lse, seed, offset)
        ctx.max_seqlen, ctx.is_causal, ctx.scale = max_seqlen, is_causal, scale
        ctx.window = (window_left, window_right)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, cu, out, lse, _, _ = ctx.saved_tensors
        groups = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(ke), torch.zeros_like(ve)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            s = torch.einsum("thd,shd->hts", q[a:b], ke[a:b]) * ctx.scale
            s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
            p = torch.exp(s - lse[:, a:b, None])
            do = grad_out[a:b]
            dv[a:b] = torch.einsum("hts,thd->shd", p, do)
            dp = torch.einsum("thd,shd->hts", do, ve[a:b])
            ds = p * (dp - (do * out[a:b]).sum(-1).transpose(0, 1)[:, :, None])
            dq[a:b] = torch.einsum("hts,shd->thd", ds, ke[a:b]) * ctx.scale
            dk[a:b] = torch.einsum("hts,thd->shd", ds, q[a:b]) * ctx.scale
        fold = lambda t: t.view(t.shape[0], k.shape[1], groups, -1).sum(2)  # noqa: E731
        return dq, fold(dk), fold(dv), None, None, None, None, None, None


DISPATCH = types.SimpleNamespace(Function=_FlashLike)  # where the layers look the Function up, as Unsloth's code does


@contextmanager
def _marker():
    RECOMPUTING[0] = True
    try:
        yield
    finally:
        RECOMPUTING[0] = False


class _Checkpointed(torch.autograd.Function):
    """Unsloth's checkpointer: the layer without gradients, its input kept; in the backward, the layer again with
    gradients under the recompute marker, its backward run there."""

    @staticmethod
    def forward(ctx, layer, hidden, cu_seqlens):
        with torch.no_grad():
            output = layer(hidden, cu_seqlens)
        ctx.save_for_backward(hidden)
        ctx.layer, ctx.cu_seqlens = layer, cu_seqlens
        return output

    @staticmethod
    def backward(ctx, grad):
        (hidden,) = ctx.saved_tensors
        hidden = hidden.detach().requires_grad_(True)
        with torch.enable_grad(), _marker():
            output = ctx.layer(hidden, ctx.cu_seqlens)
        torch.autograd.backward(output, grad)
        return None, hidden.grad, None


class _Layer(torch.nn.Module):
    def __init__(self, width=16, heads=4, kv_heads=2, in_place=False):
        super().__init__()
        self.in_place = in_place  # writes into attention's output (a model doing so must not get a stale copy)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.q = torch.nn.Linear(width, width)
        self.kv = torch.nn.Linear(width, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(width, width)

    def forward(self, hidden, cu_seqlens):
        t = hidden.shape[0]
        q = self.q(hidden).view(t, self.heads, self.head_dim)
        k, v = self.kv(hidden).view(t, 2, self.kv_heads, self.head_dim).unbind(1)
        a = DISPATCH.Function.apply(q, k, v, cu_seqlens, 8, True, self.head_dim ** -0.5, -1, 0)
        if self.in_place and not torch.is_grad_enabled():
            a.mul_(2)
        elif self.in_place:
            a = a * 2
        return hidden + self.o(torch.tanh(a.reshape(t, -1)))


class _Decoder(torch.nn.Module):
    def __init__(self, layers=3, checkpointed=True, in_place=False):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(_Layer(in_place=in_place) for _ in range(layers))
        self.checkpointed = checkpointed

    def forward(self, hidden, cu_seqlens):
        for layer in self.layers:
            hidden = _Checkpointed.apply(layer, hidden, cu_seqlens) if self.checkpointed else layer(hidden, cu_seqlens)
        return hidden


@pytest.fixture
def installed(monkeypatch):
    """A function installing kept attention with a cap on a decoder, as `install_on_unsloth` does on Unsloth's module
    (the Function looked up at call time replaced; the decoder's forward arms and disarms it)."""
    def install(decoder, cap_bytes=2**30):
        kept = KeptAttention(cap_bytes)
        monkeypatch.setattr(DISPATCH, "Function", reusing(_FlashLike, kept, lambda: RECOMPUTING[0]))
        kept.attach(decoder)
        return kept
    return install


def _row(seed=1):
    """A packed row of three samples; its hidden states require gradients, as a reentrant checkpointer needs (Unsloth
    calls enable_input_require_grads)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(13, 16, generator=g).requires_grad_(True), torch.tensor([0, 5, 8, 13], dtype=torch.int32)


def _grads(decoder, hidden, cu):
    decoder.zero_grad(set_to_none=True)
    FORWARDS[0] = 0
    (decoder(hidden, cu) ** 2).sum().backward()
    return FORWARDS[0], [p.grad.clone() for p in decoder.parameters()]


def _against_the_plain_recompute(installed, cap_bytes=2**30, **decoder):
    """(attention forwards run, the KeptAttention) of one micro-batch with outputs kept, after checking its gradients
    equal those of the same decoder without (every layer's attention recomputed), exactly."""
    hidden, cu = _row()
    _, reference = _grads(_Decoder(**decoder), hidden, cu)
    model = _Decoder(**decoder)
    kept = installed(model, cap_bytes)
    forwards, grads = _grads(model, hidden, cu)
    assert all(torch.equal(g, r) for g, r in zip(grads, reference))
    return forwards, kept


def test_the_stand_in_kernels_backward_is_attentions_gradient():
    q, k, v = (torch.randn(13, h, 4, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 8, 13], dtype=torch.int32)
    torch.autograd.gradcheck(lambda q, k, v: _FlashLike.apply(q, k, v, cu, 8, True, 0.5, -1, 0), (q, k, v))


def test_kept_outputs_give_the_recomputes_gradients_with_one_attention_forward_per_layer(installed):
    assert _grads(_Decoder(), *_row())[0] == 6  # each layer's attention twice: the first pass and the recompute
    forwards, kept = _against_the_plain_recompute(installed)
    assert forwards == 3
    assert (kept.kept, kept.reused, kept.recomputed, kept.stack, kept.kept_bytes) == (3, 3, 0, [], 0)
    assert kept.peak_bytes == 3 * (13 * 4 * 4 * 4 + 4 * 13 * 4)  # out [T, H, D] and lse [H, T], fp32


def test_past_the_cap_layers_recompute_and_the_gradients_stay_the_same(installed):
    forwards, kept = _against_the_plain_recompute(installed, cap_bytes=13 * 4 * 4 * 4 + 4 * 13 * 4)  # one layer's
    assert forwards == 3 + 2 and (kept.kept, kept.reused, kept.recomputed) == (1, 1, 2)


def test_micro_batches_start_afresh_and_forwards_without_training_gradients_keep_nothing(installed):
    decoder = _Decoder()
    kept = installed(decoder)
    for seed in (1, 2):  # two micro-batches, each forward then backward
        _grads(decoder, *_row(seed))
    assert (kept.kept, kept.reused, kept.stack) == (6, 6, [])
    with torch.no_grad():  # a reference forward (DPO) or an evaluation: not a training forward
        decoder(*_row(3))
    decoder.eval()
    decoder(*_row(3))
    assert (kept.kept, kept.stack) == (6, [])
    decoder.train()
    decoder(*_row(4))  # a forward whose backward never runs: dropped when the next one starts
    assert len(kept.stack) == 3
    _grads(decoder, *_row(5))
    assert kept.stack == [] and kept.kept_bytes == 0


def test_without_checkpointing_every_call_is_the_kernels_own(installed):
    forwards, kept = _against_the_plain_recompute(installed, checkpointed=False)
    assert forwards == 3 and (kept.kept, kept.reused) == (0, 0)


def test_an_output_written_in_place_after_the_kernel_is_not_reused(installed):
    forwards, kept = _against_the_plain_recompute(installed, in_place=True)
    assert forwards == 6 and (kept.kept, kept.reused, kept.dropped) == (3, 0, 3)


def test_an_entry_kept_for_other_shapes_is_not_used_and_drops_the_stack():
    kept = KeptAttention(2**20)
    kept.armed = True
    with torch.no_grad():
        for n in (2, 3):
            kept.keep(("layer", n), (torch.zeros(n), torch.zeros(n), torch.zeros(()), torch.zeros(())))
    assert kept.take(("layer", 2)) is None  # the top is the layer-3 entry: not this call's
    assert (kept.stack, kept.kept_bytes, kept.dropped, kept.recomputed) == ([], 0, 2, 1)


def test_the_cap_is_a_share_of_the_budgets_headroom_above_the_checkpointed_peak():
    decision = types.SimpleNamespace(limit_bytes=100 * 2**30, verified_peak_bytes=20 * 2**30, tokens=262_144,
                                     fit={"base_bytes": 2 * 2**30, "per_token_bytes": 65_536})
    assert cap_from_budget(decision) == int(0.75 * 80 * 2**30)  # the fit predicts 18 GiB: the verified 20 decides
    decision.verified_peak_bytes = None
    assert cap_from_budget(decision) == int(0.75 * (100 - 18) * 2**30)
    decision.limit_bytes = None  # the CPU's fixed budget: nothing measured, nothing kept
    assert cap_from_budget(decision) == 0


def test_attention_outputs_are_kept_by_default_for_checkpointed_sft_on_unsloth_within_the_budgets_room(
        monkeypatch, logs):
    from HyperSloth.outputs import run_files
    from HyperSloth.train.attention import recompute

    installed = []
    monkeypatch.setattr(recompute, "install_on_unsloth",
                        lambda decoder, cap: installed.append((decoder, cap)) or ("kept", None))
    decoder = object()
    loaded = types.SimpleNamespace(backend="unsloth", model=types.SimpleNamespace(
        get_base_model=lambda: types.SimpleNamespace(model=decoder)))
    sft = types.SimpleNamespace(method="sft", gradient_checkpointing="unsloth")
    decision = types.SimpleNamespace(limit_bytes=10 * 2**30, verified_peak_bytes=2 * 2**30, tokens=1, fit=None)
    monkeypatch.delenv(run_files.ENV_REUSE_ATTENTION, raising=False)
    logged = len(logs)
    for description, backend in ((types.SimpleNamespace(method="dpo", gradient_checkpointing="unsloth"), "unsloth"),
                                 (types.SimpleNamespace(method="sft", gradient_checkpointing=False), "unsloth"),
                                 (sft, "transformers")):
        other = types.SimpleNamespace(backend=backend, model=loaded.model)
        assert recompute.keep_attention(description, other, decision) is None
    assert installed == [] and len(logs) == logged  # nothing to save there: no line
    assert recompute.keep_attention(sft, loaded, decision) == "kept"  # the default
    assert installed == [(decoder, int(0.75 * 8 * 2**30))] and "up to 6.0 GiB" in logs[-1]
    monkeypatch.setenv(run_files.ENV_REUSE_ATTENTION, "0")
    assert recompute.keep_attention(sft, loaded, decision) is None and len(installed) == 1
    assert "HYPERSLOTH_REUSE_ATTENTION=0" in logs[-1]
    monkeypatch.delenv(run_files.ENV_REUSE_ATTENTION)
    decision.limit_bytes = None  # nothing measured (a given budget): no room known, nothing kept
    assert recompute.keep_attention(sft, loaded, decision) is None and len(installed) == 1
    assert "no memory room is known" in logs[-1] and "tokens_per_micro_batch='auto'" in logs[-1]
    decision.limit_bytes = 2 * 2**30  # measured, and the peak fills it
    assert recompute.keep_attention(sft, loaded, decision) is None and len(installed) == 1
    assert "leaves no memory room" in logs[-1]
