"""The console scripts of HyperSloth (see pyproject.toml): a Ctrl-C at any moment, from the first import
of the CLI on, ends with one line on stderr and exit code 130, never a traceback.

The scripts point here and not at the CLI modules because importing those (fire, pydantic, datasets,
torch) takes long enough to be interrupted, and an import that has not finished cannot catch
anything. So this module imports only what Python has already loaded at start-up and imports the
CLI module inside the guard. What stays uncovered is the interpreter's own start-up before this
module runs (about 0.1 s).

A Ctrl-C that lands inside an import (at start-up, or a lazy import later) ends the process at once
instead of raising: an exception raised into a compiled extension's initialisation can make it
panic (pydantic-core's Rust init prints a 20-line "thread panicked" message and exits 1), and an
unfinished import leaves nothing to clean up. Anywhere else the usual KeyboardInterrupt unwinds, so
`finally` blocks and context managers still run.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, as a shell reports a command stopped by Ctrl-C


@contextmanager
def interrupts_end_quietly(prog: str) -> Iterator[None]:
    """Within the block, Ctrl-C ends the program with one line on stderr and exit code 130."""
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: _on_ctrl_c(prog, frame))
    except ValueError:  # not the main thread: handlers cannot be installed there (Python's rule)
        previous = None
    try:
        yield
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C while exiting: no traceback either
        _say_interrupted(prog)
        raise SystemExit(EXIT_INTERRUPTED) from None
    finally:
        if previous is not None and signal.getsignal(signal.SIGINT) is not signal.SIG_DFL:
            signal.signal(signal.SIGINT, previous)


def _on_ctrl_c(prog: str, frame: FrameType | None) -> None:
    if _inside_import(frame):
        _say_interrupted(prog)
        os._exit(EXIT_INTERRUPTED)
    raise KeyboardInterrupt


def _inside_import(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _say_interrupted(prog: str) -> None:
    try:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # no terminal left to tell


def _console(module: str, prog: str) -> None:
    try:
        with interrupts_end_quietly(prog):
            from importlib import import_module  # importlib is frozen into the interpreter: no disk access

            import_module(module).main()
    finally:
        # The interpreter's last collection at exit walks every object still tracked: ~3 s once torch and
        # transformers are loaded (hypersloth-build-dataset, -export, -train under torchrun) on a 2-core CPU
        # machine. Frozen, they are skipped; the exit frees the memory anyway.
        gc.freeze()


def train() -> None:
    """Console script `hypersloth-train`."""
    _console("HyperSloth.cli.train", "hypersloth-train")


def init() -> None:
    """Console script `hypersloth-init`."""
    _console("HyperSloth.cli.init", "hypersloth-init")


def build_dataset() -> None:
    """Console script `hypersloth-build-dataset`."""
    _console("HyperSloth.cli.build_dataset", "hypersloth-build-dataset")


def plan() -> None:
    """Console script `hypersloth-plan`."""
    _console("HyperSloth.cli.plan", "hypersloth-plan")


def export() -> None:
    """Console script `hypersloth-export`."""
    _console("HyperSloth.cli.export", "hypersloth-export")


def tiny_model() -> None:
    """Console script `hypersloth-tiny-model`."""
    _console("HyperSloth.cli.tiny_model", "hypersloth-tiny-model")
