"""Config models, load_config messages, the dataset registry read and runtime_problems."""

import json
import sys
import textwrap
from pathlib import Path

import pytest

from HyperSloth.config import (
    ConfigError,
    DataConfig,
    FastModelArgs,
    HyperConfig,
    LoraArgs,
    TrainingArgsConfig,
    TrainingConfig,
    runtime_problems,
    config_to_dict,
    load_config,
)

HEADER = "from HyperSloth.config import *\n"
VALID_HYPER = (
    "hyper_config_model = HyperConfig(data=DataConfig(dataset_name='d'), "
    "fast_model_args=FastModelArgs(model_name='m'))\n"
)


def write(tmp_path: Path, body: str, name: str = "cfg.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def load_error(tmp_path: Path, body: str) -> str:
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(str(path.resolve())), message
    return message


def hyper(**overrides) -> HyperConfig:
    fields = {"data": {"dataset_name": "d"}, "fast_model_args": {"model_name": "m"}} | overrides
    return HyperConfig.model_validate(fields)


# ---- load_config: files and names ----------------------------------------------------------------


def test_model_style_file_loads_with_default_training_args(tmp_path):
    loaded = load_config(write(tmp_path, HEADER + VALID_HYPER))
    assert loaded.hyper.data.dataset_name == "d"
    assert loaded.training_args == TrainingArgsConfig()
    assert loaded.hyper.training.gpus == [0]


def test_dict_style_config_accepted(tmp_path):
    body = """
    hyper_config = {
        "data": {"dataset_name": "d"},
        "training": {"gpus": [2, 3]},
        "fast_model_args": {"model_name": "m", "max_seq_length": 1024},
        "lora_args": {"r": 4},
    }
    training_config = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "max_steps": 7}
    """
    loaded = load_config(write(tmp_path, body))
    assert loaded.hyper.training.gpus == [2, 3]
    assert loaded.hyper.lora_args.r == 4 and loaded.hyper.lora_args.lora_alpha == 8
    assert loaded.training_args.max_steps == 7
    assert (loaded.training_args.per_device_train_batch_size, loaded.training_args.gradient_accumulation_steps) == (2, 3)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.py")


def test_file_without_expected_names(tmp_path):
    message = load_error(tmp_path, "x = 1\n")
    assert "hyper_config_model" in message and "hyper_config" in message
    assert "training_config_model" in message


def test_syntax_error_names_line(tmp_path):
    message = load_error(tmp_path, "a = 1\nb = 2\nhyper_config = {\n")
    assert "syntax error at line 3" in message


def test_import_time_exception_names_type_message_and_line(tmp_path):
    message = load_error(tmp_path, "a = 1\nraise RuntimeError('boom here')\n")
    assert "importing the config raised RuntimeError: boom here" in message
    assert "(line 2)" in message


def test_config_error_raised_in_file_keeps_its_message(tmp_path):
    body = HEADER + f"data = DataConfig.from_dataset_name('x', data_dir={str(tmp_path / 'none')!r})\n"
    message = load_error(tmp_path, body)
    assert "(line 2): no dataset registry at" in message and "importing the config raised" not in message


def test_wrong_object_under_expected_name(tmp_path):
    message = load_error(tmp_path, HEADER + "hyper_config_model = TrainingArgsConfig()\n")
    assert "hyper_config_model must be a HyperConfig, got TrainingArgsConfig" in message


def test_config_dir_not_left_on_sys_path_and_module_not_kept(tmp_path):
    (tmp_path / "helper_for_cfg.py").write_text("NAME = 'from-helper'\n")
    body = HEADER + "from helper_for_cfg import NAME\n" + VALID_HYPER.replace("'d'", "NAME")
    loaded = load_config(write(tmp_path, body))
    assert loaded.hyper.data.dataset_name == "from-helper"
    assert str(tmp_path) not in sys.path
    assert not any(name.startswith("_hypersloth_user_config") for name in sys.modules)


def test_two_files_load_independently(tmp_path):
    first = load_config(write(tmp_path, HEADER + VALID_HYPER, "a.py"))
    second = load_config(write(tmp_path, HEADER + VALID_HYPER.replace("'d'", "'e'"), "b.py"))
    assert (first.hyper.data.dataset_name, second.hyper.data.dataset_name) == ("d", "e")


# ---- load_config: validation messages ------------------------------------------------------------


def test_unknown_field_in_dict_config_suggests_closest(tmp_path):
    body = "hyper_config = {'data': {'dataset_name': 'd'}, 'training': {'gpu': [0]}, 'fast_model_args': {'model_name': 'm'}}"
    message = load_error(tmp_path, body)
    assert "unknown field 'training.gpu' — did you mean 'gpus'?" in message


def test_unknown_field_in_model_constructor_names_location_and_line(tmp_path):
    body = HEADER + "t = 1\ntraining = TrainingConfig(gpu=[0, 1])\n"
    message = load_error(tmp_path, body)
    assert "(line 3)" in message
    assert "unknown field 'training.gpu' — did you mean 'gpus'?" in message


def test_unknown_field_in_training_args(tmp_path):
    message = load_error(tmp_path, HEADER + VALID_HYPER + "training_config_model = TrainingArgsConfig(learning_rat=1e-4)\n")
    assert "unknown field 'learning_rat' — did you mean 'learning_rate'?" in message


def test_field_in_wrong_model_says_where_it_belongs(tmp_path):
    body = "hyper_config = {'data': {'dataset_name': 'd'}, 'fast_model_args': {'model_name': 'm'}, 'learning_rate': 1}"
    message = load_error(tmp_path, body)
    assert "unknown field 'learning_rate' — 'learning_rate' belongs in TrainingArgsConfig (training_config_model)" in message


def test_wrong_type_is_one_readable_line(tmp_path):
    body = "hyper_config = {'data': {'dataset_name': 'd'}, 'fast_model_args': {'model_name': 'm', 'max_seq_length': 'long'}}"
    message = load_error(tmp_path, body)
    line = next(line for line in message.splitlines() if "max_seq_length" in line)
    assert line.strip().startswith("fast_model_args.max_seq_length: Input should be a valid integer")
    assert "(got 'long')" in line
    assert "pydantic" not in message and "errors.pydantic.dev" not in message


def test_union_type_errors_merge_into_one_line(tmp_path):
    message = load_error(tmp_path, HEADER + VALID_HYPER + "training_config_model = TrainingArgsConfig(report_to=3)\n")
    lines = [line for line in message.splitlines() if "report_to" in line]
    assert len(lines) == 1 and lines[0].strip().startswith("report_to:") and "(got 3)" in lines[0]


def test_every_problem_reported(tmp_path):
    body = """
    hyper_config = {"data": {"dataset_name": "d"}, "training": {"gpus": [0, 0], "gpu": 1},
                    "fast_model_args": {}, "lora_args": {"r": 0}}
    """
    message = load_error(tmp_path, body)
    assert "training.gpus: GPU ids must be distinct: 0 appears more than once" in message
    assert "unknown field 'training.gpu'" in message
    assert "fast_model_args.model_name: required field is missing" in message
    assert "lora_args.r: Input should be greater than 0 (got 0)" in message


# ---- model validators ----------------------------------------------------------------------------


def validation_message(build) -> str:
    from pydantic import ValidationError

    from HyperSloth.config import format_validation_error

    with pytest.raises(ValidationError) as info:
        build()
    return format_validation_error(info.value)


def test_duplicate_gpu_ids():
    message = validation_message(lambda: TrainingConfig(gpus=[1, 0, 1]))
    assert "training.gpus: GPU ids must be distinct: 1 appears more than once in [1, 0, 1]" in message


def test_negative_gpu_id():
    assert "training.gpus: GPU ids must be >= 0, got [-1]" in validation_message(lambda: TrainingConfig(gpus=[0, -1]))


def test_empty_gpus():
    assert "gpus is empty" in validation_message(lambda: TrainingConfig(gpus=[]))


def test_any_distinct_gpu_ids_accepted():
    assert TrainingConfig(gpus=[2, 3]).gpus == [2, 3]


def test_missing_and_empty_model_name():
    assert "fast_model_args.model_name: required field is missing" in validation_message(lambda: FastModelArgs())
    assert "model_name is empty" in validation_message(lambda: FastModelArgs(model_name="  "))


def test_negative_seed_is_refused_by_validation():
    # numpy's generators refuse it; without this check it failed only after every worker loaded its model.
    with pytest.raises(ValueError, match="seed"):
        TrainingArgsConfig(seed=-1)
    assert TrainingArgsConfig(seed=0).seed == 0


def test_save_total_limit_defaults_to_trl_none():
    import dataclasses

    from trl import SFTConfig

    # The README says these fields work as in TRL's SFTConfig: keep every checkpoint unless told.
    trl_default = {f.name: f.default for f in dataclasses.fields(SFTConfig)}["save_total_limit"]
    assert TrainingArgsConfig().to_sft_kwargs()["save_total_limit"] == trl_default is None


def test_max_steps_and_epochs_both_none():
    message = validation_message(lambda: TrainingArgsConfig(max_steps=None, num_train_epochs=None))
    assert "max_steps and num_train_epochs are both None: set one of them" in message


def test_4bit_and_8bit():
    message = validation_message(lambda: FastModelArgs(model_name="m", load_in_4bit=True, load_in_8bit=True))
    assert "load_in_4bit and load_in_8bit are both True" in message


def test_full_finetuning_with_lora_args_says_what_to_change():
    message = validation_message(
        lambda: hyper(fast_model_args={"model_name": "m", "full_finetuning": True}, lora_args={"r": 4})
    )
    assert "set lora_args=None for full fine-tuning, or full_finetuning=False" in message


def test_lora_none_sets_full_finetuning_without_touching_shared_args():
    shared = FastModelArgs(model_name="m")
    config = HyperConfig(data=DataConfig(dataset_name="d"), fast_model_args=shared, lora_args=None)
    assert config.fast_model_args.full_finetuning is True
    assert shared.full_finetuning is False


def test_full_finetuning_flag_with_default_lora_means_no_adapter():
    config = hyper(fast_model_args={"model_name": "m", "full_finetuning": True})
    assert config.lora_args is None


def test_full_finetuning_of_quantised_weights_rejected():
    message = validation_message(lambda: hyper(fast_model_args={"model_name": "m", "load_in_4bit": True}, lora_args=None))
    assert "cannot train 4-bit/8-bit weights" in message


def test_lora_dropout_range_and_defaults():
    assert "lora_args.lora_dropout" in validation_message(lambda: LoraArgs(lora_dropout=1.0))
    lora = LoraArgs()
    assert (lora.r, lora.lora_alpha, lora.bias, lora.random_state) == (8, 8, "none", 3407)
    assert lora.target_modules is None  # read from the model (HyperSloth.train.lora.targets)


def test_extra_args_may_not_repeat_fields():
    message = validation_message(lambda: TrainingArgsConfig(extra_args={"learning_rate": 1.0}))
    assert "extra_args repeats ['learning_rate']" in message


def test_resolved_backend_and_dtype():
    args = FastModelArgs(model_name="m")
    assert args.resolved_backend(cuda_available=True, unsloth_available=True) == "unsloth"
    assert args.resolved_backend(cuda_available=True, unsloth_available=False) == "transformers"
    assert args.resolved_backend(cuda_available=False, unsloth_available=True) == "transformers"
    assert args.resolved_dtype(cuda_available=True) == "bfloat16"
    assert args.resolved_dtype(cuda_available=False) == "float32"
    assert FastModelArgs(model_name="m", dtype="float16").resolved_dtype(cuda_available=False) == "float16"


# ---- derived values ------------------------------------------------------------------------------


def test_to_sft_kwargs_mapping():
    args = TrainingArgsConfig(
        max_steps=None, num_train_epochs=3, resume_from_checkpoint="ckpt", extra_args={"adam_beta2": 0.95}
    )
    kwargs = args.to_sft_kwargs()
    assert kwargs["max_steps"] == -1 and kwargs["num_train_epochs"] == 3
    assert kwargs["adam_beta2"] == 0.95
    assert "resume_from_checkpoint" not in kwargs and "extra_args" not in kwargs
    # gradient_accumulation_steps sizes HyperSloth's step; TRL keeps its own default (1), never overruled.
    assert kwargs["per_device_train_batch_size"] == 8 and "gradient_accumulation_steps" not in kwargs
    assert kwargs["learning_rate"] == 2e-4 and kwargs["report_to"] == "tensorboard"
    steps_only = TrainingArgsConfig(max_steps=30, num_train_epochs=None).to_sft_kwargs()
    assert (steps_only["max_steps"], steps_only["num_train_epochs"]) == (30, 1)


def test_config_to_dict_is_json_that_validates(tmp_path):
    loaded = load_config(write(tmp_path, HEADER + VALID_HYPER + "training_config_model = TrainingArgsConfig("
                               "extra_args={'odd': object()})\n"))
    saved = json.loads(json.dumps(config_to_dict(loaded)))
    assert saved == config_to_dict(loaded)
    assert saved["source_path"] == str(loaded.path)
    assert saved["training_config"]["extra_args"]["odd"].startswith("<object")
    assert HyperConfig.model_validate(saved["hyper_config"]) == loaded.hyper


# ---- dataset registry ----------------------------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path):
    entry = {"name": "chat", "path": "built_dataset/chat", "num_samples": 3}
    absolute = {"name": "abs", "path": str(tmp_path / "elsewhere" / "abs")}
    registry = {"version": 1, "datasets": {"chat": entry, "abs": absolute}}
    (tmp_path / "data_config.json").write_text(json.dumps(registry))
    return tmp_path


def test_from_dataset_name_found(data_dir):
    config = DataConfig.from_dataset_name("chat", data_dir=str(data_dir))
    assert config.registry_entry()["num_samples"] == 3
    assert config.dataset_path() == data_dir / "built_dataset" / "chat"
    assert DataConfig(dataset_name="abs", data_dir=str(data_dir)).dataset_path() == data_dir / "elsewhere" / "abs"


def test_from_dataset_name_missing_name_lists_registered(data_dir):
    with pytest.raises(ConfigError) as info:
        DataConfig.from_dataset_name("chta", data_dir=str(data_dir))
    message = str(info.value)
    assert "dataset 'chta' is not registered" in message and "(registered: abs, chat)" in message
    assert "did you mean 'chat'?" in message
    assert "hypersloth-build-dataset --local_path FILE_OR_DIR --tokenizer MODEL --name chta" in message


def test_unregistered_name_far_from_every_registered_one_gets_no_suggestion(data_dir):
    with pytest.raises(ConfigError) as info:
        DataConfig.from_dataset_name("wikipedia", data_dir=str(data_dir))
    assert "did you mean" not in str(info.value) and "build it with" in str(info.value)


def test_from_dataset_name_missing_registry(tmp_path):
    with pytest.raises(ConfigError) as info:
        DataConfig.from_dataset_name("chat", data_dir=str(tmp_path / "nowhere"))
    assert "no dataset registry at" in str(info.value) and "--name NAME" in str(info.value)


def test_corrupt_registry(tmp_path):
    (tmp_path / "data_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not readable JSON"):
        DataConfig(dataset_name="x", data_dir=str(tmp_path)).registry_entry()


# ---- runtime_problems ----------------------------------------------------------------------------


def runtime_error(config: HyperConfig, args: TrainingArgsConfig | None = None, **facts) -> str:
    problems = runtime_problems(config, args or TrainingArgsConfig(), **facts)
    assert problems, "expected the machine check to find a problem"
    return "\n".join(f"  - {p}" for p in problems)


def test_runtime_problems_cpu_plain_config_passes():
    config = hyper(training={"gpus": [0, 1, 2]}, fast_model_args={"model_name": "m", "dtype": "bfloat16"})
    assert runtime_problems(config, TrainingArgsConfig(), cuda_device_count=0, unsloth_available=False) == []


def test_runtime_problems_4bit_on_cpu():
    config = hyper(fast_model_args={"model_name": "m", "load_in_4bit": True})
    message = runtime_error(config, cuda_device_count=0, unsloth_available=False)
    assert "load_in_4bit=True needs CUDA and bitsandbytes; set load_in_4bit=False to train on CPU" in message


def test_runtime_problems_gpu_ids_beyond_visible():
    config = hyper(training={"gpus": [0, 2, 3]})
    message = runtime_error(config, cuda_device_count=2, unsloth_available=True)
    assert "gpus [2, 3] not available: 2 GPU(s) visible" in message
    assert runtime_problems(hyper(training={"gpus": [1, 0]}), TrainingArgsConfig(), cuda_device_count=2,
                            unsloth_available=True) == []


def test_runtime_problems_unsloth_backend():
    config = hyper(fast_model_args={"model_name": "m", "backend": "unsloth"})
    message = runtime_error(config, cuda_device_count=0, unsloth_available=False)
    assert "backend='unsloth' needs CUDA" in message and "unsloth is not importable" in message
    gpu_message = runtime_error(config, cuda_device_count=1, unsloth_available=False)
    assert "needs CUDA" not in gpu_message and "unsloth is not importable" in gpu_message
    assert runtime_problems(config, TrainingArgsConfig(), cuda_device_count=1, unsloth_available=True) == []


def test_runtime_problems_tiled_mlp_needs_unsloth():
    config = hyper(fast_model_args={"model_name": "m", "tiled_mlp": True})
    message = runtime_error(config, cuda_device_count=0, unsloth_available=False)
    assert "fast_model_args.tiled_mlp=True needs the Unsloth backend" in message and "uses transformers" in message
    assert runtime_problems(config, TrainingArgsConfig(), cuda_device_count=1, unsloth_available=True) == []
    # "auto" (the default) is never a problem: it settles to off where Unsloth is not
    assert hyper(fast_model_args={"model_name": "m"}).fast_model_args.tiled_mlp == "auto"
    assert runtime_problems(hyper(fast_model_args={"model_name": "m"}), TrainingArgsConfig(), cuda_device_count=0,
                            unsloth_available=False) == []


def test_runtime_problems_lists_every_problem():
    config = hyper(fast_model_args={"model_name": "m", "load_in_8bit": True, "backend": "unsloth"})
    message = runtime_error(config, TrainingArgsConfig(optim="adamw_8bit"), cuda_device_count=0, unsloth_available=True)
    problems = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(problems) == 3
    assert "optim='adamw_8bit' needs CUDA" in message and "load_in_8bit=True needs CUDA" in message


def test_config_module_does_not_import_torch():
    import subprocess

    code = "import sys, HyperSloth.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_router_load_balancing_loss_is_refused_with_what_to_change():
    message = validation_message(lambda: TrainingArgsConfig(extra_args={"router_aux_loss_coef": 0.001}))
    assert "router_aux_loss_coef=0.001" in message and "remove it from extra_args" in message
    assert TrainingArgsConfig(extra_args={"router_aux_loss_coef": 0.0}).extra_args == {"router_aux_loss_coef": 0.0}
