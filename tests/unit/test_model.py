"""Model loading: target modules checked against the model, and Unsloth given the checkpointing setting
on every path (a stand-in `unsloth` module records what HyperSloth passes it; Unsloth needs CUDA)."""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

import pytest
import torch

from HyperSloth.config import ConfigError, FastModelArgs, LoraArgs
from HyperSloth.train import model as model_lib


def fast_args(model_dir: Path, **overrides) -> FastModelArgs:
    return FastModelArgs(model_name=str(model_dir), max_seq_length=256, dtype="float32", backend="transformers",
                         **overrides)


def test_a_target_that_matches_no_module_is_refused_naming_the_linear_layers(tiny_model_dir):
    lora = LoraArgs(target_modules=["q_proj", "nope"])
    with pytest.raises(ConfigError) as info:
        model_lib.load_model(fast_args(tiny_model_dir), lora)
    message = str(info.value)
    assert "['nope']" in message and "q_proj" not in message.split("are")[0]
    listed = message.split("linear layers are", 1)[1].split(";")[0]
    assert listed.strip() == "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"  # the decoder's, no head


def test_targets_that_all_match_train_those_modules(tiny_model_dir):
    loaded = model_lib.load_model(fast_args(tiny_model_dir), LoraArgs(target_modules=["q_proj", "v_proj"]))
    adapted = {name.split(".")[-4] for name, p in loaded.model.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "v_proj"}
    # The start-up timeline's stamps: the base model loaded, then the adapters attached.
    assert list(loaded.stamps) == ["model_load", "adapter"]
    assert loaded.stamps["model_load"] <= loaded.stamps["adapter"] <= time.time()


def test_full_fine_tuning_stamps_no_adapter(tiny_model_dir):
    assert list(model_lib.load_model(fast_args(tiny_model_dir), None).stamps) == ["model_load"]


class FakeUnsloth:
    """`unsloth.FastLanguageModel`: loads with transformers, records every call and its arguments."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def from_pretrained(self, **kwargs):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.calls.append(("from_pretrained", kwargs))
        name = kwargs["model_name"]
        return AutoModelForCausalLM.from_pretrained(name), AutoTokenizer.from_pretrained(name)

    def get_peft_model(self, model, **kwargs):
        from peft import LoraConfig, get_peft_model

        self.calls.append(("get_peft_model", kwargs))
        config = LoraConfig(r=kwargs["r"], target_modules=kwargs["target_modules"], task_type="CAUSAL_LM")
        return get_peft_model(model, config)

    def patch_peft_model(self, model, use_gradient_checkpointing="unsloth"):
        self.calls.append(("patch_peft_model", {"use_gradient_checkpointing": use_gradient_checkpointing,
                                                "model": type(model).__name__}))
        return model


@pytest.fixture
def fake_unsloth(monkeypatch) -> FakeUnsloth:
    fake = FakeUnsloth()
    packing = types.ModuleType("unsloth.utils.packing")
    packing.mark_allow_overlength = lambda model: None
    unsloth = types.ModuleType("unsloth")
    unsloth.FastLanguageModel = fake
    monkeypatch.setitem(sys.modules, "unsloth", unsloth)
    monkeypatch.setitem(sys.modules, "unsloth.utils", types.ModuleType("unsloth.utils"))
    monkeypatch.setitem(sys.modules, "unsloth.utils.packing", packing)
    return fake


@pytest.mark.parametrize("checkpointing", [False, True, "unsloth"])
def test_unsloth_gets_the_checkpointing_setting_when_loading(fake_unsloth, tiny_model_dir, checkpointing):
    fast = fast_args(tiny_model_dir, use_gradient_checkpointing=checkpointing)
    stamps: dict[str, float] = {}
    model_lib._load_unsloth(fast, LoraArgs(), torch.float32, stamps)
    assert list(stamps) == ["model_load", "adapter"] and stamps["model_load"] <= stamps["adapter"]
    # from_pretrained's own default ("unsloth") would patch torch's checkpointing whatever the config says.
    [(_, loaded), (_, peft)] = fake_unsloth.calls
    assert loaded["use_gradient_checkpointing"] == checkpointing == peft["use_gradient_checkpointing"]


@pytest.mark.parametrize("checkpointing", [False, "unsloth"])
def test_unsloth_adapter_to_continue_gets_the_checkpointing_setting(fake_unsloth, tiny_model_dir, tmp_path,
                                                                     checkpointing):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")).save_pretrained(tmp_path)
    fast = fast_args(tiny_model_dir, use_gradient_checkpointing=checkpointing)
    model, _ = model_lib._load_unsloth(fast, LoraArgs(init_adapter_path=str(tmp_path)), torch.float32, {})
    # get_peft_model is skipped for a saved adapter; Unsloth's patch_peft_model applies the setting instead.
    assert [name for name, _ in fake_unsloth.calls] == ["from_pretrained", "patch_peft_model"]
    assert fake_unsloth.calls[1][1] == {"use_gradient_checkpointing": checkpointing, "model": "PeftModelForCausalLM"}
    assert any(p.requires_grad for p in model.parameters())


def test_training_autocast_is_the_trainers_for_the_models_dtype_and_device():
    import warnings

    assert model_lib.mixed_precision(torch.bfloat16, cuda=True) == "bf16"
    assert model_lib.mixed_precision(torch.float16, cuda=True) == "fp16"
    assert model_lib.mixed_precision(torch.float32, cuda=True) is None
    assert model_lib.mixed_precision(torch.bfloat16, cuda=False) is None
    with model_lib.training_autocast(torch.nn.Linear(2, 2).to(torch.bfloat16)):  # on the CPU: none
        assert not torch.is_autocast_enabled("cpu")

    def on_gpu(*dtypes):  # a model seen through its parameters only: the first floating one decides
        params = [types.SimpleNamespace(is_floating_point=lambda d=d: d.is_floating_point, dtype=d,
                                        device=torch.device("cuda")) for d in dtypes]
        return types.SimpleNamespace(parameters=lambda: iter(params))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # this CPU build of torch says autocast on CUDA is disabled
        context = model_lib.training_autocast(on_gpu(torch.uint8, torch.bfloat16, torch.float32))
    assert isinstance(context, torch.autocast) and context.device == "cuda" and context.fast_dtype == torch.bfloat16
    assert not isinstance(model_lib.training_autocast(on_gpu(torch.float32)), torch.autocast)


def test_unsloths_per_layer_compile_is_off_only_where_it_would_compile_mamba_layers_whole():
    """Granite 4.0-H's decoder layers hold its Mamba layers, one class for the whole list: Unsloth compiles them
    whole (its compiled backward failed at a second row length on one H200), so its per-layer compile is turned off
    with its own switch; a model whose Mamba layers sit in `*Block`s (Nemotron-H), or without any, keeps it; a
    user's own setting wins."""
    from gguf_models import SHAPE, granite4_h_config, nemotron_h_config
    from transformers import AutoModelForCausalLM, Qwen3Config

    granite = AutoModelForCausalLM.from_config(granite4_h_config())
    environ: dict[str, str] = {}
    line = model_lib.keep_mamba_layers_out_of_block_compile(granite, environ)
    assert environ == {"UNSLOTH_BLOCK_COMPILE": "0"} and "GraniteMoeHybridDecoderLayer" in line
    assert model_lib.keep_mamba_layers_out_of_block_compile(granite, {"UNSLOTH_BLOCK_COMPILE": "1"}) is None
    for config in (nemotron_h_config(), Qwen3Config(**SHAPE)):
        other = AutoModelForCausalLM.from_config(config)
        environ = {}
        assert model_lib.keep_mamba_layers_out_of_block_compile(other, environ) is None and environ == {}
