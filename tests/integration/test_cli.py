"""Every console script as a user runs it: help, flags checked before anything runs, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# Set by a surrounding torchrun they would turn hypersloth-train into a worker.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
BIN = Path(sys.executable).parent
SCRIPTS = ["hypersloth-train", "hypersloth-init", "hypersloth-build-dataset", "hypersloth-plan",
           "hypersloth-export", "hypersloth-tiny-model"]


def run(argv: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=env, **kwargs)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_plain_text_with_usage_and_examples(script, tmp_path):
    result = run([script, "--help"], tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    out = result.stdout
    assert out.startswith(f"usage: {script}") and "\noptions:\n" in out and "\nexamples:\n" in out
    assert "-h, --help" in out
    for fire_noise in ("Type:", "Optional[", "SYNOPSIS", "POSITIONAL ARGUMENTS", "FLAGS"):
        assert fire_noise not in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_unknown_flag_exits_2_names_the_closest_and_writes_nothing(script, tmp_path):
    result = run([script, "x.py", "--forcee"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f"{script}: error: unknown option --forcee")
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_init_with_a_misspelt_template_flag_does_not_write_the_file(tmp_path):
    result = run(["hypersloth-init", "x.py", "--templat", "lora-2gpu"], tmp_path)
    assert result.returncode == 2 and "did you mean --template?" in result.stderr
    assert not (tmp_path / "x.py").exists()
    # the corrected command then works without --force
    assert run(["hypersloth-init", "x.py", "--template", "lora-2gpu"], tmp_path).returncode == 0
    assert "unsloth/Qwen3-0.6B" in (tmp_path / "x.py").read_text()


def test_export_with_a_misspelt_merge_flag_exports_nothing(tmp_path):
    (tmp_path / "run").mkdir()
    result = run(["hypersloth-export", "run", "--merg"], tmp_path)
    assert result.returncode == 2 and "did you mean --merge?" in result.stderr
    assert [p.name for p in tmp_path.rglob("*")] == ["run"]


# ------------------------------------------------------------------------------------------ Ctrl-C

SLOW_CONFIG = textwrap.dedent('''
    import pathlib, time
    pathlib.Path(__file__).with_name("loading").write_text("")
    time.sleep(60)  # a config that takes long to load: Ctrl-C comes while it runs
''')


def interrupt(argv: list[str], cwd: Path, when, pid: list[int] | None = None) -> subprocess.CompletedProcess:
    """Start a console script, wait until `when()` (polled), send SIGINT, collect; `pid` gets its pid."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    proc = subprocess.Popen([str(BIN / argv[0]), *argv[1:]], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    if pid is not None:
        pid.append(proc.pid)
    try:
        deadline = time.monotonic() + 60
        while not when():
            assert time.monotonic() < deadline and proc.poll() is None, "never reached the moment to interrupt"
            time.sleep(0.001)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_while_the_config_loads_prints_one_line(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_CONFIG)
    result = interrupt(["hypersloth-train", "slow.py"], tmp_path, lambda: (tmp_path / "loading").exists())
    assert result.returncode == 130
    assert result.stderr == "hypersloth-train: interrupted\n"


def loaded(proc_pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{proc_pid}/maps").read_text()
    except OSError:
        return False


def test_ctrl_c_while_the_cli_imports_prints_one_line(tmp_path):
    # pydantic's compiled core is loaded while the CLI module imports HyperSloth.config: the moment
    # a Ctrl-C used to end in a 75-line traceback.
    (tmp_path / "slow.py").write_text(SLOW_CONFIG)
    pid = []
    result = interrupt(["hypersloth-train", "slow.py"], tmp_path, lambda: loaded(pid[0], "pydantic_core"), pid)
    assert result.returncode == 130
    assert result.stderr == "hypersloth-train: interrupted\n"
