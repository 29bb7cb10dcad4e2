"""Every shipped example and init template loads with load_config and validates."""

from pathlib import Path

import pytest

from HyperSloth.config import HyperConfig, TrainingArgsConfig, config_to_dict, load_config
from HyperSloth.plan.run import batch_numbers

ROOT = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted(ROOT.glob("examples/*.py")) + sorted(ROOT.glob("HyperSloth/templates/*.py"))


def test_glob_finds_examples_and_templates():
    assert len(list(ROOT.glob("examples/*.py"))) >= 6
    assert len(list(ROOT.glob("HyperSloth/templates/*.py"))) >= 3


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_file_loads_and_round_trips(path):
    loaded = load_config(path)
    assert isinstance(loaded.hyper, HyperConfig)
    assert isinstance(loaded.training_args, TrainingArgsConfig)
    assert loaded.path == path
    # The saved form must validate back to the same config (it is what a checkpoint records).
    resolved = config_to_dict(loaded)
    assert HyperConfig.model_validate(resolved["hyper_config"]) == loaded.hyper
    assert TrainingArgsConfig.model_validate(resolved["training_config"]) == loaded.training_args


def test_tiny_demo_example_matches_template():
    example = load_config(ROOT / "examples/tiny_cpu_demo.py")
    template = load_config(ROOT / "HyperSloth/templates/tiny_cpu.py")
    assert example.hyper == template.hyper
    differs = {"output_dir": "outputs/tiny-demo"}  # make demo's run and an init-written config's never share a folder
    assert example.training_args == template.training_args.model_copy(update=differs)


def test_tiny_cpu_template_values():
    loaded = load_config(ROOT / "HyperSloth/templates/tiny_cpu.py")
    hyper, args = loaded.hyper, loaded.training_args
    assert hyper.fast_model_args.model_name == "build/tiny-qwen3"
    assert hyper.fast_model_args.dtype == "float32"
    assert (hyper.data.dataset_name, hyper.data.data_dir) == ("sample-chat", "data")
    assert hyper.training.gpus == [0, 1] and hyper.training.batching == "packed"
    assert (hyper.lora_args.r, hyper.lora_args.lora_alpha) == (16, 16)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_steps) == (4, 2, 30)
    assert (args.learning_rate, args.warmup_steps, args.logging_steps, args.save_steps) == (1e-2, 2, 1, 10)
    assert (args.report_to, args.output_dir) == ("none", "outputs/tiny-cpu")
    assert batch_numbers(args.per_device_train_batch_size, args.gradient_accumulation_steps, len(hyper.training.gpus),
                         hyper.training.batching)["global_batch_size"] == 16


def test_full_finetune_example_has_no_adapter():
    loaded = load_config(ROOT / "examples/full_finetune.py")
    assert loaded.hyper.lora_args is None
    assert loaded.hyper.fast_model_args.full_finetuning is True


def test_continue_example_sets_adapter_path():
    loaded = load_config(ROOT / "examples/continue_from_adapter.py")
    assert loaded.hyper.lora_args.init_adapter_path


def test_tiny_cpu_example_is_the_init_template():
    """examples/tiny_cpu_demo.py imports the tiny-cpu template instead of copying it, so `make demo` trains
    exactly what `hypersloth-init` writes and there is one file to edit."""
    source = (ROOT / "examples/tiny_cpu_demo.py").read_text()
    assert "from HyperSloth.templates.tiny_cpu import hyper_config_model, training_config_model" in source
    assert "HyperConfig(" not in source and "TrainingArgsConfig(" not in source
    assert load_config(ROOT / "examples/tiny_cpu_demo.py").training_args.output_dir == "outputs/tiny-demo"
