"""lora_install on a tiny PEFT Qwen3 whose layers carry stand-ins for Unsloth's hooks (Unsloth is not
installed on CPU): same names as Unsloth's, each computing what Unsloth's own PEFT fallback computes."""

from __future__ import annotations

import types

import peft
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from HyperSloth.train.lora import install as li

TOL = 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def apply_lora_qkv(self, X):
    return self.q_proj(X), self.k_proj(X), self.v_proj(X)


def apply_lora_o(self, X):
    return self.o_proj(X)


def apply_lora_mlp_swiglu(self, X):
    return self.down_proj(self.act_fn(self.gate_proj(X)) * self.up_proj(X))


def tiny_peft_model(unsloth_hooks: bool = True, **lora) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = peft.get_peft_model(Qwen3ForCausalLM(config), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False, **lora))
    if unsloth_hooks:  # what FastLanguageModel.patch_peft_model sets per layer
        for layer in li.decoder_layers(model):
            layer.self_attn.apply_qkv, layer.self_attn.apply_o = apply_lora_qkv, apply_lora_o
            layer.mlp.forward = types.MethodType(apply_lora_mlp_swiglu, layer.mlp)
    return model


def run_layer(layer, X):
    """The three hooks as Unsloth's attention / decoder forward call them, and their LoRA grads."""
    attn, mlp = layer.self_attn, layer.mlp
    Q, K, V = attn.apply_qkv(attn, X.clone())
    O = attn.apply_o(attn, X.repeat(1, 1, 2))  # o_proj maps heads * head_dim (64) to hidden (32)
    M = mlp(X.clone())
    loss = sum((t * torch.linspace(-1, 1, t.numel()).view_as(t)).sum() for t in (Q, K, V, O, M))
    params = [p for n, p in layer.named_parameters() if "lora_" in n]
    return [Q, K, V, O, M], torch.autograd.grad(loss, [X, *params])


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_installed_hooks_give_unsloths_numbers_and_uninstall_restores():
    model = tiny_peft_model()
    layer = li.decoder_layers(model)[1]
    X = torch.randn(1, 23, 32, requires_grad=True)
    before = run_layer(layer, X)
    assert li.install_lora_passes(model, mode="concat") is None
    assert layer.self_attn.apply_qkv.func is li._qkv_hook and layer.mlp.forward.__func__.func is li._mlp_hook
    after = run_layer(layer, X)
    for a, b in zip([*after[0], *after[1]], [*before[0], *before[1]]):
        assert rel_err(a, b) < TOL
    assert li.uninstall_lora_passes(model) == 4  # self_attn and mlp of both layers
    assert layer.self_attn.apply_qkv is apply_lora_qkv and layer.mlp.forward.__func__ is apply_lora_mlp_swiglu


def test_disabled_adapter_goes_back_to_unsloths_function():
    model = tiny_peft_model()
    assert li.install_lora_passes(model) is None
    layer = li.decoder_layers(model)[0]
    X = torch.randn(1, 9, 32)
    with model.disable_adapter():
        Q = layer.self_attn.apply_qkv(layer.self_attn, X)[0]
        M = layer.mlp(X)
        M_unsloth = apply_lora_mlp_swiglu(layer.mlp, X)
    base = layer.self_attn.q_proj.get_base_layer()
    assert torch.equal(Q, base(X))  # Unsloth's path (PEFT with the adapter off): the base layer alone
    assert torch.equal(M, M_unsloth) and rel_err(M, layer.mlp(X)) > 1e-2  # and not the adapter's output


@pytest.mark.parametrize(
    "lora, hooks, reason",
    [
        ({"lora_dropout": 0.05}, True, "layer 0 q_proj: lora_dropout 0.05 > 0"),
        ({"lora_bias": True}, True, "layer 0 q_proj: lora_B has a bias (lora_bias=True)"),
        ({"use_dora": True}, True, "layer 0 q_proj: DoRA or another LoRA variant"),
        ({}, False, "layer 0 attention has no Unsloth apply_lora_qkv / apply_lora_o hook"),
    ],
)
def test_refuses_what_is_not_plain_lora_and_changes_nothing(lora, hooks, reason):
    model = tiny_peft_model(unsloth_hooks=hooks, **lora)
    assert li.install_lora_passes(model) == reason
    for layer in li.decoder_layers(model):
        assert li.PREVIOUS not in layer.self_attn.__dict__ and li.PREVIOUS not in layer.mlp.__dict__


def test_refuses_a_trainable_base_weight_and_a_tiled_mlp_without_unsloths_hook():
    model = tiny_peft_model()
    layers = li.decoder_layers(model)
    layers[1].mlp.down_proj.get_base_layer().weight.requires_grad_(True)
    assert li.install_lora_passes(model) == "layer 1 down_proj: the base weight is trainable"
    layers[0].mlp._unsloth_forward = types.MethodType(type(layers[0].mlp).forward, layers[0].mlp)  # PEFT's own
    assert li.install_lora_passes(model) == "layer 0 mlp has no Unsloth apply_lora_mlp_swiglu _unsloth_forward"
    assert li.install_lora_passes(torch.nn.Linear(2, 2)).startswith("no decoder layers found")


class TiledMLP(torch.autograd.Function):
    """unsloth_zoo.tiled_mlp.TiledMLP (2026.10.9) in miniature, same structure: the forward runs the MLP on
    row tiles under no_grad and saves only the input; the backward reruns each tile with grad, on a view of
    the saved input whose .grad is the tile's slice of dX, and back-propagates the tile's output gradient."""

    @staticmethod
    def forward(ctx, mlp_forward, x, rows):
        ctx.mlp_forward, ctx.rows = mlp_forward, rows
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([mlp_forward(t.unsqueeze(0))[0] for t in torch.split(x.view(-1, x.shape[-1]), rows)])[None]

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        x_gradients = torch.zeros_like(x)
        H, start = x.shape[-1], 0
        for x_split in torch.split(x.view(-1, H), ctx.rows):
            x_split = x_split.unsqueeze(0)
            n = x_split.numel()
            x_split.requires_grad_(True)
            x_split.grad = x_gradients.view(-1).narrow(0, start, n).view_as(x_split)
            with torch.enable_grad():
                out = ctx.mlp_forward(x_split)
            torch.autograd.backward(out, grad_output.reshape(-1).narrow(0, start, n).view_as(x_split))
            start += n
        return None, x_gradients, None


class TiledMLPWithParams(torch.autograd.Function):
    """unsloth/models/_tiled_mlp_ddp.py's `_TiledMLPWithParams` (2026.10.9) in miniature: what Unsloth's loader
    puts in TiledMLP.apply's place when it sees a distributed run (WORLD_SIZE > 1, as HyperSloth's N-GPU
    workers have). The MLP's trainable parameters are inputs, and each tile's backward is
    torch.autograd.grad over (tile, *params), summed and returned, instead of accumulating into .grad."""

    @staticmethod
    def forward(ctx, mlp_forward, x, rows, *params):
        ctx.params = params
        return TiledMLP.forward(ctx, mlp_forward, x, rows)  # as Unsloth's variant reuses TiledMLP.forward

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        H = x.shape[-1]
        x_gradients, param_grads = torch.zeros_like(x), [None] * len(ctx.params)
        splits = zip(torch.split(x.view(-1, H), ctx.rows), torch.split(grad_output.reshape(-1, H), ctx.rows),
                     torch.split(x_gradients.view(-1, H), ctx.rows))
        for x_split, grad_split, x_grad in splits:
            x_split = x_split.unsqueeze(0).requires_grad_(True)
            with torch.enable_grad():
                out = ctx.mlp_forward(x_split)
            grads = torch.autograd.grad(out, (x_split, *ctx.params), grad_split.unsqueeze(0), allow_unused=True)
            x_grad.copy_(grads[0].squeeze(0))
            for i, g in enumerate(grads[1:]):
                if g is not None:
                    param_grads[i] = g if param_grads[i] is None else param_grads[i].add_(g)
        return None, x_gradients, None, *param_grads


def tile_mlps(model, rows: int, distributed: bool = False) -> None:
    """What Unsloth's loader and patch_peft_model leave under UNSLOTH_TILED_MLP: the tiled `forward`, and its
    LoRA hook in `_unsloth_forward` (patch_peft_model sees the attribute and puts the hook there); with
    `distributed`, the tiles run through Unsloth's DDP variant (`TiledMLPWithParams`)."""
    def tiled_forward(self, x):
        hook = self._unsloth_forward.__get__(self, self.__class__)
        if distributed:
            return TiledMLPWithParams.apply(hook, x, rows, *(p for p in self.parameters() if p.requires_grad))
        return TiledMLP.apply(hook, x, rows)

    for layer in li.decoder_layers(model):
        mlp = layer.mlp
        mlp._unsloth_forward = mlp.__dict__.pop("forward")  # MethodType(apply_lora_mlp_swiglu, mlp)
        mlp.forward = types.MethodType(tiled_forward, mlp)


@pytest.mark.parametrize("distributed", [False, True])
@pytest.mark.parametrize("mode", ["concat", "epilogue"])
def test_under_unsloths_tiled_mlp_the_passes_go_in_its_tile_hook_with_the_same_grads(mode, distributed):
    """The tiled MLP calls the hook per row tile, in the forward and again in the backward, where dX may be
    written into the saved input's storage (Unsloth's own in-place rule): our hook in `_unsloth_forward` must
    give the untiled numbers, fall back to Unsloth's hook with the adapter off, and uninstall cleanly. Also
    through Unsloth's variant for distributed runs, which N-GPU workers get (the LoRA grads as outputs of
    torch.autograd.grad over each tile, not accumulated into .grad by the tile's backward)."""
    plain, tiled = tiny_peft_model(), tiny_peft_model()
    tile_mlps(tiled, rows=7, distributed=distributed)  # 23 rows: tiles of 7, 7, 7, 2
    assert li.install_lora_passes(tiled, mode=mode) is None
    mlp = li.decoder_layers(tiled)[0].mlp
    assert mlp._unsloth_forward.__func__.func is li._mlp_hook and mlp.forward.__func__.__name__ == "tiled_forward"

    def grads(model):
        mlp = li.decoder_layers(model)[0].mlp
        X = torch.randn(1, 23, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
        out = mlp(X * 1.0)  # a fresh activation, as the RMSNorm output
        params = [p for n, p in mlp.named_parameters() if "lora_" in n]
        for p in params:
            p.grad = None
        # .backward(), as training runs it: the tiled backward accumulates the LoRA grads itself, outside the
        # graph torch.autograd.grad would walk.
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return [out.detach(), X.grad, *(p.grad for p in params)]

    reference = grads(plain)
    assert all(g.abs().max() > 0 for g in reference)
    for a, b in zip(grads(tiled), reference):
        assert rel_err(a, b) < TOL
    with tiled.disable_adapter():
        X = torch.randn(1, 9, 32)
        assert torch.equal(mlp(X), TiledMLP.apply(lambda t: apply_lora_mlp_swiglu(mlp, t), X, 7))
    assert li.uninstall_lora_passes(tiled) == 4
    assert mlp._unsloth_forward.__func__ is apply_lora_mlp_swiglu and "forward" in mlp.__dict__


@pytest.mark.parametrize("mode", ["concat", "epilogue"])  # epilogue writes dX into the saved input's storage
@pytest.mark.parametrize("reentrant", [False, True])
def test_installed_hooks_under_gradient_checkpointing_give_the_same_grads(reentrant, mode):
    """Long samples switch checkpointing on: the layer's forward runs again inside the backward, and dX may be
    written into the saved input's storage (as Unsloth's in-place backward does). The grads must not change."""
    from torch.utils.checkpoint import checkpoint

    model = tiny_peft_model()
    assert li.install_lora_passes(model, mode=mode) is None
    layer = li.decoder_layers(model)[0]
    attn, mlp = layer.self_attn, layer.mlp
    params = [p for n, p in layer.named_parameters() if "lora_" in n]
    weights = torch.linspace(-1, 1, 23 * 32).view(1, 23, 32)

    def block(hidden):
        normed = hidden * 1.5  # a fresh activation, as the RMSNorm output the hooks see
        Q, K, V = attn.apply_qkv(attn, normed)
        mixed = hidden + attn.apply_o(attn, Q + torch.cat([K, V], dim=-1))  # o_proj reads 64 = 4 heads x 16
        return mixed + mlp(mixed * 0.5)

    def grads(checkpointed: bool):
        X0 = torch.randn(1, 23, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        hidden = X0 * 1.0
        out = checkpoint(block, hidden, use_reentrant=reentrant) if checkpointed else block(hidden)
        for p in params:
            p.grad = None
        (out * weights).sum().backward()  # the reentrant checkpoint supports .backward() only
        return [X0.grad, *(p.grad for p in params)]

    plain, checkpointed = grads(False), grads(True)
    assert all(g is not None and g.abs().max() > 0 for g in plain)  # every LoRA weight and the input get a grad
    for a, b in zip(checkpointed, plain):
        assert rel_err(a, b) < TOL
