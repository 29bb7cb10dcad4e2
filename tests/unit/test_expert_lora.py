"""train/lora/experts.py: an MoE layer's expert adapters as grouped GEMMs beside the base experts compute what
PEFT's parametrization of the whole expert stack computes (fp32, CPU): loss, every gradient, the reference
forward with the adapter off; and a LoRA that is not plain stays PEFT's, with the reason."""

from __future__ import annotations

import copy

import pytest
import torch

from HyperSloth.config import LoraArgs
from HyperSloth.train.lora.experts import MARK, install_grouped_expert_lora, wrapper_chain
from HyperSloth.train.model import _attach_peft
from HyperSloth.train.tiny_architectures import tiny_causal_lm, tiny_config


def adapted(architecture: str, r: int = 8, dtype=torch.float32, intermediate_size: int = 128):
    """A tiny MoE model (4 experts, 2 active) with adapters on attention and experts, lora_B random (PEFT starts
    it at zero, where the adapter's own product would not be tested)."""
    config = tiny_config(architecture, vocab_size=128, hidden_size=64, intermediate_size=intermediate_size, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                         initializer_range=0.02, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = _attach_peft(tiny_causal_lm(config).to(dtype), LoraArgs(r=r, lora_alpha=16))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model


def loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("architecture", ["qwen3_moe", "gpt_oss"])  # (experts, out, in) and (experts, in, out) + biases
def test_grouped_expert_adapters_equal_peft(architecture):
    peft_model = adapted(architecture)
    ours = copy.deepcopy(peft_model)
    assert install_grouped_expert_lora(ours) == (2, None)
    ids = torch.randint(2, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    peft_loss, peft_grads = loss_and_grads(peft_model, ids)
    our_loss, our_grads = loss_and_grads(ours, ids)
    assert our_loss == pytest.approx(peft_loss, rel=1e-6)
    assert peft_grads.keys() == our_grads.keys() and any("experts" in n and "lora_A" in n for n in our_grads)
    for name, grad in peft_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    with ours.disable_adapter(), peft_model.disable_adapter(), torch.no_grad():  # DPO's / GRPO's reference
        torch.testing.assert_close(ours(input_ids=ids).logits, peft_model(input_ids=ids).logits)


def test_only_the_outermost_wrapper_of_each_layer_gets_the_forward():
    model = adapted("qwen3_moe")
    install_grouped_expert_lora(model)
    marked = [name for name, m in model.named_modules() if getattr(m, MARK, False)]
    assert [name.split(".")[-3:] for name in marked] == [["0", "mlp", "experts"], ["1", "mlp", "experts"]]
    assert [w.parameter_name for w in wrapper_chain(model.get_submodule(marked[0]))] == ["down_proj", "gate_up_proj"]


def test_an_adapter_that_is_not_plain_stays_peft_and_says_why():
    model = adapted("qwen3_moe")
    wrapper = model.get_submodule("base_model.model.model.layers.1.mlp.experts")
    wrapper.use_dora["default"] = True
    assert install_grouped_expert_lora(model) == (0, "a DoRA or bias adapter")
    assert not any(getattr(m, MARK, False) for m in model.modules())  # all or nothing
    dense = _attach_peft(tiny_causal_lm(tiny_config(
        "qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=256, initializer_range=0.02, pad_token_id=0, eos_token_id=1)), LoraArgs())
    assert install_grouped_expert_lora(dense) == (0, "no adapted experts")


@pytest.mark.parametrize("r, dtype", [(4, torch.bfloat16), (2, torch.float32)])
def test_ranks_the_grouped_gemm_cannot_take_are_padded(r, dtype):
    """torch's grouped GEMM wants 16-byte strides: rank 4 in bf16, 2 in fp32 would raise; padded with zeros the
    product is the same."""
    peft_model = adapted("qwen3_moe", r=r, dtype=dtype)
    ours = copy.deepcopy(peft_model)
    assert install_grouped_expert_lora(ours) == (2, None)
    ids = torch.randint(2, 128, (1, 32), generator=torch.Generator().manual_seed(2))
    (peft_loss, peft_grads), (our_loss, our_grads) = loss_and_grads(peft_model, ids), loss_and_grads(ours, ids)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert our_loss == pytest.approx(peft_loss, rel=tolerance)
    for name, grad in peft_grads.items():
        scale = grad.float().abs().max().item() or 1.0
        assert (our_grads[name].float() - grad.float()).abs().max().item() <= 5 * tolerance * scale, name


@pytest.mark.parametrize("architecture", ["qwen3_moe", "gpt_oss"])
def test_a_copy_of_the_experts_class_without_transformers_decorator_still_runs_grouped(architecture):
    """Unsloth's compiled modeling files copy the experts class without `use_experts_implementation`, so the
    instance lacks has_gate / has_bias / is_transposed (seen on the H200): the layout is read from the parameters
    and the grouped forward computes what PEFT's does."""
    peft_model = adapted(architecture)
    ours = copy.deepcopy(peft_model)
    experts = [m for m in ours.modules() if type(m).__name__.endswith("Experts")]
    expected = [{k: getattr(m, k) for k in ("has_gate", "has_bias", "is_transposed")} for m in experts]
    for module in experts:
        for key in ("has_gate", "has_bias", "is_transposed"):
            del module.__dict__[key]
    assert install_grouped_expert_lora(ours) == (2, None)
    assert [{k: getattr(m, k) for k in expected[0]} for m in experts] == expected
    ids = torch.randint(2, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    (peft_loss, peft_grads), (our_loss, our_grads) = loss_and_grads(peft_model, ids), loss_and_grads(ours, ids)
    assert our_loss == pytest.approx(peft_loss, rel=1e-6)
    for name, grad in peft_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_experts_whose_shapes_do_not_say_their_layout_stay_peft():
    from HyperSloth.train.lora.experts import read_layout

    module = torch.nn.Module()
    module.up_proj = torch.nn.Parameter(torch.zeros(4, 8, 8))  # no gate, square: either way round
    module.down_proj = torch.nn.Parameter(torch.zeros(4, 8, 8))
    assert "do not say which way" in read_layout(module)
    module.up_proj = torch.nn.Parameter(torch.zeros(4, 6, 8))  # (experts, intermediate 6, hidden 8), or the
    module.down_proj = torch.nn.Parameter(torch.zeros(4, 8, 6))  # other way round with hidden 6
    assert "do not say which way" in read_layout(module)
    module.hidden_dim = 8
    assert read_layout(module) == {"has_gate": False, "has_bias": False, "is_transposed": False}
    module.hidden_dim = 6
    assert read_layout(module) == {"has_gate": False, "has_bias": False, "is_transposed": True}
    module.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 12, 8))  # with a gate the shapes say it
    module.down_proj = torch.nn.Parameter(torch.zeros(4, 8, 6))
    module.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(4, 12))
    del module.hidden_dim
    assert read_layout(module) == {"has_gate": True, "has_bias": True, "is_transposed": False}


def test_the_backward_keeps_the_tokens_not_their_routed_copies():
    """What autograd keeps inside the experts: the tokens themselves (one hidden-width row per token, GatheredLowRank)
    and, per routed token, the gate_up output the gate is recomputed from (2 x expert width), the down projection's
    input (expert width) and the two adapters' rank-wide products. Not the gathered copies of the tokens (top_k per
    token), the down projection's hidden-width output, nor the gate's activation (the routing weight is applied
    before the down projection, GateThenWeight). The base GEMMs keep no input: their weights are frozen."""
    model = adapted("qwen3_moe", r=8, intermediate_size=80)
    install_grouped_expert_lora(model)
    experts = model.get_submodule("base_model.model.model.layers.0.mlp.experts")
    tokens, top_k, hidden = 32, 2, 64
    width = wrapper_chain(experts)[-1].get_base_layer().down_proj.shape[-1]  # (experts, hidden, width)
    kept = {}

    def pack(t):
        kept.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    x = torch.randn(tokens, hidden, requires_grad=True)
    index = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(i))[:top_k] for i in range(tokens)])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = experts(x, index, torch.rand(tokens, top_k, requires_grad=True))
    out.sum().backward()
    routed = tokens * top_k

    def widths(rows):
        return sorted(t.untyped_storage().nbytes() // (rows * t.element_size()) for t in kept.values()
                      if t.dim() == 2 and t.shape[0] == rows and t.is_floating_point())

    assert width != hidden and widths(routed) == sorted([8, 2 * width, width, 8])
    assert widths(tokens) == [hidden] and kept_tokens_are(x, kept.values())


def kept_tokens_are(x, kept) -> bool:
    return any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in kept)
