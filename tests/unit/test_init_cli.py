"""`hypersloth-init` run as a real process: writes templates that load, refuses to overwrite."""

import subprocess
import sys

import pytest

from HyperSloth.cli.init import TEMPLATES
from HyperSloth.config import load_config


def run_init(cwd, *args):
    return subprocess.run(
        [sys.executable, "-m", "HyperSloth.cli.init", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_writes_each_template_and_it_loads(tmp_path, template):
    result = run_init(tmp_path, "cfg/my_config.py", "--template", template)
    assert result.returncode == 0, result.stderr
    written = tmp_path / "cfg" / "my_config.py"
    assert "hypersloth-plan cfg/my_config.py" in result.stdout
    assert "hypersloth-train cfg/my_config.py" in result.stdout
    loaded = load_config(written)
    assert loaded.hyper.training.gpus == [0, 1]
    # The file's own commands name it as written, not hypersloth_config.py.
    text = written.read_text()
    assert "hypersloth-train cfg/my_config.py" in text and "hypersloth_config.py" not in text


def test_tiny_cpu_next_steps_work_from_any_folder(tmp_path):
    from HyperSloth.train.tiny_model import DEFAULT_DATA_PATH

    result = run_init(tmp_path, "my.py")
    assert result.returncode == 0, result.stderr
    # The sample chats by their absolute path: `data/sample_chat.jsonl` exists only in a checkout's root.
    assert f"--local_path {DEFAULT_DATA_PATH} " in result.stdout and DEFAULT_DATA_PATH.is_file()
    assert "data/sample_chat.jsonl " not in result.stdout.replace(str(DEFAULT_DATA_PATH), "")
    assert f"--local_path {DEFAULT_DATA_PATH} " in (tmp_path / "my.py").read_text()


def test_default_is_tiny_cpu_and_underscore_names_work(tmp_path):
    assert run_init(tmp_path).returncode == 0
    default = load_config(tmp_path / "hypersloth_config.py")
    assert default.hyper.fast_model_args.model_name == "build/tiny-qwen3"
    assert run_init(tmp_path, "q.py", "--template", "qlora_2gpu").returncode == 0
    assert load_config(tmp_path / "q.py").hyper.fast_model_args.load_in_4bit is True


def test_refuses_to_overwrite_without_force(tmp_path):
    target = tmp_path / "hypersloth_config.py"
    target.write_text("# mine\n")
    result = run_init(tmp_path)
    assert result.returncode == 2
    assert "already exists; pass --force to overwrite it" in result.stderr
    assert "Traceback" not in result.stderr
    assert target.read_text() == "# mine\n"


def test_force_overwrites(tmp_path):
    target = tmp_path / "hypersloth_config.py"
    target.write_text("# mine\n")
    result = run_init(tmp_path, "--template", "lora-2gpu", "--force")
    assert result.returncode == 0, result.stderr
    assert load_config(target).hyper.fast_model_args.model_name == "unsloth/Qwen3-0.6B"


def test_unknown_template_lists_names(tmp_path):
    result = run_init(tmp_path, "--template", "huge-gpu")
    assert result.returncode == 2
    assert "unknown template 'huge-gpu'; choose one of: tiny-cpu, lora-2gpu, qlora-2gpu" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "hypersloth_config.py").exists()


def test_help_lists_templates(tmp_path):
    result = run_init(tmp_path, "--help")
    assert result.returncode == 0
    shown = result.stdout + result.stderr  # fire prints help to stderr
    for name in TEMPLATES:
        assert name in shown


def test_the_cpu_templates_name_the_shipped_sample_data_and_a_folder_apart_from_the_demo(tmp_path):
    from HyperSloth.data import SAMPLE_CHAT_PATH, SAMPLE_PREFERENCE_PATH

    for template, sample in (("tiny-cpu", SAMPLE_CHAT_PATH), ("tiny-dpo-cpu", SAMPLE_PREFERENCE_PATH)):
        result = run_init(tmp_path, f"{template}.py", "--template", template)
        assert result.returncode == 0, result.stderr
        # Rebuilding the sample data the demo registered works too (--overwrite), from any folder.
        assert f"--local_path {sample} " in result.stdout and sample.is_file() and "--overwrite" in result.stdout
        loaded = load_config(tmp_path / f"{template}.py")
        assert loaded.training_args.output_dir == f"outputs/{template}"  # make demo trains into outputs/tiny-demo
    assert load_config(tmp_path / "tiny-dpo-cpu.py").hyper.training.method == "dpo"
