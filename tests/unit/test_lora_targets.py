"""LoRA targets read from the model (HyperSloth.train.lora.targets) on every tiny architecture, and the MoE experts'
adapters through PEFT's target_parameters: what gets adapters, what is refused, and that each routed expert's
adapter moves after a step while the others stay put."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model

from HyperSloth.config import ConfigError, LoraArgs
from HyperSloth.train.lora.targets import describe, expert_tensors, resolve_targets
from HyperSloth.train.model import _attach_peft
from HyperSloth.train.tiny_architectures import TINY_EXPERTS, tiny_causal_lm, tiny_config

SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8, max_position_embeddings=512, initializer_range=0.1, pad_token_id=0, eos_token_id=1)
DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny(architecture: str, seed: int = 0):
    torch.manual_seed(seed)
    return tiny_causal_lm(tiny_config(architecture, **SHAPE)).float()


@pytest.mark.parametrize("architecture", ["qwen3", "llama", "mistral", "qwen2", "gemma3"])
def test_dense_models_get_all_seven_projections(architecture):
    targets = resolve_targets(tiny(architecture), None)
    assert set(targets.modules) == set(DENSE) and targets.parameters == () and targets.source == "model"


def test_phi3_gets_its_fused_projections():
    targets = resolve_targets(tiny("phi3"), None)
    assert set(targets.modules) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_moe_gets_attention_and_the_fused_experts_never_the_router_or_head():
    model = tiny("qwen3_moe")
    targets = resolve_targets(model, None)
    assert set(targets.modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert targets.parameters == ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=list(targets.modules),
                                            target_parameters=list(targets.parameters)))
    adapted = {name for name, _ in peft.named_parameters() if "lora_A" in name}
    assert not any(".gate." in name or "lm_head" in name or "embed" in name for name in adapted)
    assert sum("experts" in name for name in adapted) == 2 * SHAPE["num_layers"]  # gate_up and down, per layer
    line, record = describe(peft, targets)
    assert record["adapted_modules"] == 4 * SHAPE["num_layers"]
    assert record["adapted_expert_tensors"] == 2 * SHAPE["num_layers"]
    assert "8 modules, 4 expert tensors" in line and 0 < record["trainable_share"] < 0.5


def test_qwen3_5_moe_linear_attention_and_shared_expert_get_adapters_never_the_gates():
    """Qwen3.5-MoE: the linear-attention projections (in_proj_a / in_proj_b have one output per value head, as many
    as the tiny model's experts: not mistaken for a router), the full attention, the shared expert's MLP and the
    fused experts; the router `gate` and the one-output `shared_expert_gate` stay frozen."""
    targets = resolve_targets(tiny("qwen3_5_moe"), None)
    assert set(targets.modules) == {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj",
                                    "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert targets.parameters == ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")


def test_a_mamba_layers_output_projection_gets_no_adapter():
    """Mamba's training kernel takes `out_proj.weight` as an argument (an adapter there would be bypassed), and
    PEFT refuses `out_proj` by name on Nemotron-H: left out, the in_proj adapted; Qwen3.5's linear attention
    (`out_proj` called as a module) keeps its own."""
    import transformers
    from peft import LoraConfig, get_peft_model

    nemotron = transformers.NemotronHConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, layers_block_type=["mamba", "attention", "moe"], mamba_num_heads=4, mamba_head_dim=32,
        ssm_state_size=16, chunk_size=16, n_routed_experts=4, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, use_mamba_kernels=False, n_groups=1, pad_token_id=0, eos_token_id=1,
        bos_token_id=None)
    for model in (transformers.AutoModelForCausalLM.from_config(nemotron), tiny("granite4_h")):
        targets = resolve_targets(model, None)
        assert "in_proj" in targets.modules and "out_proj" not in targets.modules, targets
        peft = get_peft_model(model, LoraConfig(r=2, target_modules=list(targets.modules),
                                                target_parameters=list(targets.parameters)))
        adapted = {name for name, _ in peft.named_modules() if name.endswith("lora_A")}
        assert any(".in_proj." in name for name in adapted) and not any(".out_proj." in name for name in adapted)
    assert "out_proj" in resolve_targets(tiny("qwen3_5"), None).modules


def test_glm_4_7_flash_latent_attention_dense_first_layer_and_experts_get_adapters():
    """GLM-4.7-Flash (glm4_moe_lite): DeepSeek's latent attention projections, the dense first layer's MLP and the
    shared expert (both gate/up/down_proj), the fused experts; the router stays frozen."""
    model = tiny("glm4_moe_lite")
    targets = resolve_targets(model, None)
    assert set(targets.modules) == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"}
    assert targets.parameters == ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")
    assert any(name.endswith("mlp.gate") for name, _ in model.named_modules())  # a router named gate, not adapted
    assert "gate" not in targets.modules


def test_gpt_oss_experts_stored_transposed_with_biases_get_adapters_and_train():
    """gpt-oss keeps its experts as (experts, in, out) with 2-D biases and a router with a bias: the 3-D tensors get
    adapters (PEFT reads the layout from the experts module), the biases and the router stay frozen."""
    model = tiny("gpt_oss")
    targets = resolve_targets(model, None)
    assert set(targets.modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert targets.parameters == ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")
    record: dict = {}
    peft = _attach_peft(model, LoraArgs(r=2), record)
    trainable = [name for name, p in peft.named_parameters() if p.requires_grad]
    assert all("lora_" in name for name in trainable) and not any("router" in name for name in trainable)
    ids = torch.tensor([[5, 9, 13, 200, 31, 7]])
    peft(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for name, p in peft.named_parameters() if "experts" in name and "lora_B" in name]
    assert len(grads) == 2 * SHAPE["num_layers"] and all(g is not None and g.abs().max() > 0 for g in grads)


def test_a_multimodal_gemma3_trains_its_language_model_only():
    """Gemma 3 4B+ loads as Gemma3ForConditionalGeneration: its decoder layers are found inside it (the packed-row
    check and our LoRA passes read them), and the adapters go on the language model's seven projections, not on the
    vision tower's q/k/v of the same names (PEFT's exclude_modules)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from HyperSloth.train.lora.install import decoder_layers

    text = tiny_config("gemma3", **SHAPE).to_dict()
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4))
    assert len(decoder_layers(model)) == 2
    targets = resolve_targets(model, None)
    assert set(targets.modules) == set(DENSE) and len(targets.excluded) == 2 * 3  # 2 vision layers x q, k, v
    assert all(name.startswith("model.vision_tower.") for name in targets.excluded)
    peft = _attach_peft(model, LoraArgs(r=4, lora_alpha=8, lora_dropout=0.0))
    adapted = [name for name, module in peft.named_modules() if hasattr(module, "lora_A")]
    assert len(adapted) == 2 * 7 and not any("vision" in name for name in adapted)
    assert describe(peft, targets)[1]["excluded_modules"] == list(targets.excluded)


def test_an_explicit_list_wins_and_the_mlp_names_select_the_experts():
    model = tiny("qwen3_moe")
    attention_only = resolve_targets(model, ["q_proj", "v_proj"])
    assert attention_only.modules == ("q_proj", "v_proj") and attention_only.parameters == ()
    classic = resolve_targets(model, list(DENSE))  # the old default list, as Unsloth reads it on an MoE model
    assert classic.modules == ("q_proj", "k_proj", "v_proj", "o_proj") and classic.source == "config"
    assert classic.parameters == ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")
    assert resolve_targets(model, ["down_proj"]).parameters == ("mlp.experts.down_proj",)


def test_an_unknown_name_is_refused_with_what_the_model_has():
    with pytest.raises(ConfigError) as err:
        resolve_targets(tiny("qwen3_moe"), ["q_proj", "q_prj"])
    message = str(err.value)
    assert "['q_prj'] match no module" in message
    assert "q_proj, k_proj, v_proj, o_proj" in message and "mlp.experts.gate_up_proj" in message
    with pytest.raises(ConfigError, match=r"\['gate_proj'\] match no module"):
        resolve_targets(tiny("phi3"), ["gate_proj"])


def test_dropout_on_expert_adapters_is_refused_before_peft():
    with pytest.raises(ConfigError, match="lora_dropout=0.1 cannot apply to the experts' adapters"):
        _attach_peft(tiny("qwen3_moe"), LoraArgs(lora_dropout=0.1), {})
    _attach_peft(tiny("qwen3_moe"), LoraArgs(lora_dropout=0.1, target_modules=["q_proj"]), {})  # no experts: fine


def test_each_routed_expert_adapter_moves_and_the_others_stay():
    """One SGD step on a few tokens: the lora_B slice of every expert the step routed to changes (B starts at 0,
    so its gradient is x A^T...), and an expert no token reached keeps exactly its initial adapter."""
    record: dict = {}
    model = _attach_peft(tiny("qwen3_moe", seed=1), LoraArgs(r=2, lora_alpha=4), record)
    assert record["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    routed = _routed_experts(model, torch.tensor([[5, 9, 13, 200, 31]]))
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.tensor([[5, 9, 13, 200, 31]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    checked = 0
    for name, param in model.named_parameters():
        if "experts" not in name or "lora_B" not in name:
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        per_expert = (param.detach() - before[name]).reshape(param.shape[0], -1, TINY_EXPERTS)  # (out, r, experts)
        for expert in range(TINY_EXPERTS):
            moved = per_expert[:, :, expert].abs().max().item()
            assert (moved > 0) == (expert in routed[layer]), (name, expert, moved)
            checked += 1
    assert checked == 2 * SHAPE["num_layers"] * TINY_EXPERTS
    assert any(len(r) < TINY_EXPERTS for r in routed.values())  # the data leaves an expert out somewhere


def _routed_experts(model, ids: torch.Tensor) -> dict[int, set[int]]:
    """Which experts each layer's router picks for the tokens that have a target (all but the last: the last
    position's output reaches no loss, and causal attention keeps it out of the others), by a hook on the router."""
    routed: dict[int, set[int]] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            layer = int(name.split(".layers.")[1].split(".")[0])
            hooks.append(module.register_forward_hook(
                lambda mod, args, out, layer=layer: routed.setdefault(layer, set()).update(out[2][:-1].flatten().tolist())))
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return routed


def test_expert_tensors_are_found_by_shape_not_name():
    names = expert_tensors(tiny("qwen3_moe"))
    assert sorted(set(names.values())) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert expert_tensors(tiny("qwen3")) == {}


def test_4bit_expert_tensors_are_found_by_the_shape_they_had_before_packing():
    """QLoRA of an MoE model through Unsloth: its experts are bitsandbytes 4-bit, stored packed as (n, 1) uint8 with
    the 3-D shape in the quant state and `_original_shape` (unsloth_zoo moe_utils_bnb4bit); one H200 run gave them
    no adapter (only attention trained) before the shape was read from there. Counted at their own size too."""
    from types import SimpleNamespace

    from HyperSloth.train.lora.targets import logical_shape

    model = tiny("qwen3_moe")
    plain_total = sum(p.numel() for p in model.parameters())
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            shape = getattr(experts, name).shape
            packed = torch.nn.Parameter(torch.zeros(shape.numel() // 2, 1, dtype=torch.uint8), requires_grad=False)
            packed.quant_state = SimpleNamespace(shape=shape)
            if name == "gate_up_proj":  # Unsloth sets both; either alone is enough
                packed._original_shape = shape
            setattr(experts, name, packed)
    targets = resolve_targets(model, None)
    assert targets.parameters == ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")
    assert sum(math.prod(logical_shape(p)) for p in model.parameters()) == plain_total
    _, record = describe(model, targets)  # the share of the model as loaded, not of its packed bytes
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert record["trainable_share"] == round(trainable / plain_total, 8)


def test_the_moe_budget_probe_sends_every_token_to_the_same_experts():
    """The probe's worst case for an MoE model: one token repeated, so each layer's router picks the same experts
    for every position (random tokens spread over all of them)."""
    from HyperSloth.train.budget.probe import probe_batch

    model = tiny("qwen3_moe").eval()
    batch = probe_batch(48, [20, 16], vocab_size=SHAPE["vocab_size"], one_route=True)
    assert len(set(batch["input_ids"].flatten().tolist())) == 1
    routed = _routed_experts(model, batch["input_ids"])
    assert all(len(experts) == 2 for experts in routed.values())  # top-2 of 4: the same two for every token
    spread = _routed_experts(model, probe_batch(48, [20, 16], vocab_size=SHAPE["vocab_size"])["input_ids"])
    assert all(len(experts) == TINY_EXPERTS for experts in spread.values())


def test_graphs_step_aside_for_mixture_of_experts():
    from HyperSloth.train.step_graph import graph_unavailable

    why = graph_unavailable(enabled=True, cuda=True, backend="unsloth", mode="packed", lora=True, lora_dropout=0.0,
                            checkpointing=False, experts=128)
    assert why.startswith("mixture of experts (128 experts)")
    assert graph_unavailable(enabled=True, cuda=True, backend="unsloth", mode="packed", lora=True,
                             lora_dropout=0.0, checkpointing=False) is None


def test_our_lora_passes_step_aside_for_an_moe_layer_naming_why():
    from HyperSloth.train.lora.install import install_lora_passes

    model = get_peft_model(tiny("qwen3_moe"), LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    assert install_lora_passes(model) == "layer 0 mlp is a mixture of experts (its adapters run on Unsloth's MoE LoRA path)"


@pytest.mark.parametrize("name, config_class, extra, dense_mlp", [
    ("qwen2_moe", "Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, decoder_sparse_step=1), True),
    ("mixtral", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2), False),
    ("olmoe", "OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2), False),
])
def test_other_moe_families_get_their_experts_and_shared_experts_but_no_gate(name, config_class, extra, dense_mlp):
    """Qwen2-MoE's shared expert is a plain MLP (adapted) beside a one-output shared_expert_gate (not adapted)."""
    import transformers

    config = getattr(transformers, config_class)(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=None, **extra)
    torch.manual_seed(0)
    targets = resolve_targets(transformers.AutoModelForCausalLM.from_config(config), None)
    mlp = {"gate_proj", "up_proj", "down_proj"} if dense_mlp else set()
    assert set(targets.modules) == {"q_proj", "k_proj", "v_proj", "o_proj"} | mlp, name
    assert targets.parameters == ("mlp.experts.down_proj", "mlp.experts.gate_up_proj"), name
    assert "shared_expert_gate" not in targets.modules and "gate" not in targets.modules
