"""`hypersloth-train CONFIG [--tmux SESSION] [--y] [--dry-run]`: check the config, then start the workers.

Everything that can be found wrong before a worker starts (config, dataset, model path, output
folder, GPUs) is reported here with exit code 2 and no traceback.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import fire

from HyperSloth.config import ConfigError, check_runtime, load_config
from HyperSloth.launch import (
    LaunchError,
    TmuxSessionExists,
    cuda_device_count,
    is_torchrun_env,
    launch,
)
from HyperSloth.launch_tmux import launch_tmux

USAGE = """\
usage: hypersloth-train CONFIG [--tmux SESSION] [--y] [--dry-run]

Fine-tune with one worker process per entry of `training.gpus` in CONFIG (a Python config file,
see `hypersloth-init`). Each worker sees only its GPU (CUDA_VISIBLE_DEVICES); without CUDA the same
number of CPU workers train over gloo. If any worker fails, the others are stopped and the failing
rank's last stderr lines are shown. Logs: OUTPUT_DIR/logs/rank{r}.log and rank{r}.stderr.

arguments:
  CONFIG            the config file (defines hyper_config_model and training_config_model)

options:
  --tmux SESSION    run each rank in its own window of tmux session SESSION (plus a `main`
                    window that follows rank 0 and reports when all ranks are done); returns
                    once the session exists. Attach with `tmux attach -t SESSION`.
  --y               replace an existing tmux session of that name without asking
  --dry-run         start nothing: load the config and print the batch plan summary
  -h, --help        show this help

examples:
  hypersloth-train examples/tiny_cpu_demo.py                 # 2 CPU workers, about a minute
  hypersloth-train examples/tiny_cpu_demo.py --dry-run       # the plan only
  hypersloth-train my_config.py --tmux train --y             # one tmux window per GPU
  # two machines, N GPUs each (run on every node with its K = 0, 1):
  torchrun --nnodes 2 --nproc_per_node N --node_rank K --rdzv_backend c10d \\
      --rdzv_endpoint HOST0:29400 -m HyperSloth.cli.train my_config.py

exit codes: 0 success, 1 a worker failed, 2 nothing started (a problem in the config or setup),
130/143 stopped by Ctrl-C / SIGTERM (every worker stopped too). Details: docs/launcher.md
"""

# "org/name" as on the Hugging Face Hub; anything else with a path separator is a local folder.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


@dataclass(frozen=True)
class CheckedRun:
    """What the launcher needs from a config that passed every pre-spawn check."""

    config_path: Path
    gpus: list[int]
    output_dir: Path


def looks_like_local_path(model_name: str) -> bool:
    """True when `model_name` names a local folder rather than a Hub id.

    Absolute, ./ ../ ~/ paths and paths with a separator that are not "org/name" are local; an
    "org/name" whose `org` is an existing local folder (e.g. build/tiny-qwen3) is local too.
    """
    if os.path.isabs(model_name) or model_name.startswith(("./", "../", "~", f".{os.sep}", f"..{os.sep}")):
        return True
    if _HUB_ID.match(model_name):
        return Path(model_name.split("/")[0]).is_dir()
    return os.sep in model_name or "/" in model_name


def _check_output_dir(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as err:
        raise LaunchError(f"output_dir {output_dir} is not writable ({err.strerror}): "
                          "set training_config_model.output_dir to a folder you can write") from None


def _check_inputs(loaded) -> None:
    dataset = loaded.hyper.data.dataset_path()
    if not dataset.is_dir():
        name = loaded.hyper.data.dataset_name
        raise LaunchError(f"dataset '{name}' is registered but its folder {dataset} is missing: rebuild it with "
                          f"`hypersloth-build-dataset --local_path FILE_OR_DIR --tokenizer MODEL --name {name}`")
    model_name = loaded.hyper.fast_model_args.model_name
    if looks_like_local_path(model_name) and not Path(model_name).expanduser().exists():
        raise LaunchError(f"model_name '{model_name}' looks like a local folder but {Path(model_name).expanduser()} "
                          "does not exist: fix the path, or use a Hub id such as 'unsloth/Qwen3-0.6B'")
    from HyperSloth.data.tokenizer_check import tokenizer_mismatch

    mismatch = tokenizer_mismatch(loaded.hyper.data.registry_entry(), model_name, loaded.hyper.data.dataset_name)
    if mismatch:
        raise LaunchError(mismatch)


def check_run(config_path: str | os.PathLike) -> CheckedRun:
    """All pre-spawn checks; raises ConfigError or LaunchError with a message that says what to change."""
    loaded = load_config(config_path)
    check_runtime(loaded.hyper, loaded.training_args, cuda_device_count=cuda_device_count(),
                  unsloth_available=importlib.util.find_spec("unsloth") is not None)
    _check_inputs(loaded)
    output_dir = Path(loaded.training_args.output_dir)
    _check_output_dir(output_dir)
    return CheckedRun(loaded.path, list(loaded.hyper.training.gpus), output_dir)


def _fail(message: str, code: int = 2) -> None:
    print(f"hypersloth-train: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _run_under_torchrun(config_path: str) -> int:
    """torchrun already started this process as one rank: be the worker, spawn nothing."""
    from HyperSloth.worker import main_from_cli

    result = main_from_cli(config_path)
    return result if isinstance(result, int) else 0


def _dry_run(config_path: str) -> int:
    from HyperSloth.cli.plan import format_summary, preview

    print(format_summary(preview(config_path)))
    return 0


def _start_tmux(run: CheckedRun, session: str, replace: bool) -> int:
    try:
        attach = launch_tmux(run.config_path, run.gpus, run.output_dir, session, replace=replace)
    except TmuxSessionExists as err:
        if replace or not sys.stdin.isatty():
            raise
        if input(f"tmux session '{session}' already exists. Replace it? [y/N] ").strip().lower() not in ("y", "yes"):
            raise LaunchError(f"left tmux session '{session}' as it is; nothing started") from err
        attach = launch_tmux(run.config_path, run.gpus, run.output_dir, session, replace=True)
    print(f"hypersloth-train: started {len(run.gpus)} rank(s) in tmux session '{session}' "
          f"(windows: main, rank0..rank{len(run.gpus) - 1}); logs in {run.output_dir / 'logs'}")
    print(f"hypersloth-train: attach with: {attach}")
    return 0


def train(config: str, tmux: str | None = None, y: bool = False, dry_run: bool = False) -> None:
    """Train with one worker per GPU of CONFIG's `training.gpus` (see `hypersloth-train --help`)."""
    config_path = str(config)
    if tmux is True or tmux == "":
        _fail("--tmux needs a session name, e.g. --tmux train")
    try:
        if is_torchrun_env(os.environ):
            raise SystemExit(_run_under_torchrun(config_path))
        if dry_run:
            raise SystemExit(_dry_run(config_path))
        run = check_run(config_path)
        if tmux is not None:
            raise SystemExit(_start_tmux(run, str(tmux), replace=bool(y)))
        code = launch(run.config_path, run.gpus, run.output_dir)
    except (ConfigError, LaunchError) as err:
        _fail(str(err))
    raise SystemExit(code)


_FLAGS = {"config", "tmux", "y", "noy", "dry_run", "nodry_run"}


def _check_flags(argv: list[str]) -> None:
    """Reject unknown flags up front: fire only complains *after* calling train, i.e. after training."""
    for arg in argv:
        if arg.startswith("-") and arg.lstrip("-").split("=")[0].replace("-", "_") not in _FLAGS:
            _fail(f"unknown option {arg}; see `hypersloth-train --help`")


def main(argv: list[str] | None = None) -> None:
    """Entry point of `hypersloth-train` and `python -m HyperSloth.cli.train`."""
    argv = sys.argv[1:] if argv is None else argv
    # Our own help instead of fire's: fire pages it and lists no examples.
    if not argv or any(arg in ("-h", "--help") for arg in argv):
        print(USAGE, end="")
        raise SystemExit(0 if argv else 2)
    _check_flags(argv)
    fire.Fire(train, command=argv, name="hypersloth-train")


if __name__ == "__main__":
    main()
