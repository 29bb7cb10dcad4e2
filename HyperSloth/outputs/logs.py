"""Per-rank logging: rank 0 to the console, every rank to its own file, library noise shown once.

Each worker calls `configure(rank, output_dir)` once at start-up. Messages carry a `[rank N]` prefix so
interleaved files and tmux windows stay readable.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

from loguru import logger

from HyperSloth.outputs import run_files

FORMAT = "<green>{time:HH:mm:ss}</green> <cyan>[rank {extra[rank]}]</cyan> <level>{level: <7}</level> {message}"
# A record bound with this extra key goes to the rank's log file only (a worker's traceback: the console
# gets one line naming the error).
FILE_ONLY = "file_only"


def _console(record) -> bool:
    return not record["extra"].get(FILE_ONLY)


def _above_progress_bars(message) -> None:
    """The console sink: a log line written through tqdm, which clears the progress bar in progress and draws
    it again below the line, so a line never lands after a bar's last state on the same terminal line."""
    from tqdm.auto import tqdm

    tqdm.write(str(message), file=sys.stderr, end="")


def log_path(output_dir: str | Path, rank: int) -> Path:
    return run_files.rank_file(output_dir, rank, "log")


class _OwnProcessGroupFilter(logging.Filter):
    """Drop transformers' hint to launch with torch.distributed: HyperSloth creates the process group
    itself and deliberately keeps the Trainer in single-process mode (see dist.py)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "parallel_mode != ParallelMode.DISTRIBUTED" not in record.getMessage()


def configure(rank: int, output_dir: str | Path, *, console_all_ranks: bool = False) -> Path:
    """Send loguru output to its rank's log file (run_files.rank_file; a fresh file), and to stderr on rank 0.

    On ranks other than 0, warnings and transformers' info/warning messages are silenced: they repeat
    the rank-0 ones word for word (errors still show).
    """
    path = log_path(output_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    for kind in ("failure.json", "final.json"):  # an earlier run's records must not pass for this run's
        run_files.rank_file(output_dir, rank, kind).unlink(missing_ok=True)
    logger.remove()
    logger.configure(extra={"rank": rank})
    # mode="w": a log holds one run, never an earlier run's lines before it.
    # diagnose=False: a traceback without loguru's dumps of every variable (tensors, whole configs).
    logger.add(path, format=FORMAT, level="DEBUG", enqueue=False, colorize=False, mode="w", diagnose=False)
    logging.getLogger("transformers.training_args").addFilter(_OwnProcessGroupFilter())
    if rank == 0 or console_all_ranks:
        logger.add(_above_progress_bars, format=FORMAT, level="INFO", colorize=sys.stderr.isatty(), filter=_console,
                   diagnose=False)
    else:
        logger.add(sys.stderr, format=FORMAT, level="ERROR", colorize=False, filter=_console, diagnose=False)
        warnings.filterwarnings("ignore")
        # Through the environment, not `transformers.logging`: importing transformers here would come
        # before Unsloth's import, which must be first (worker.py). transformers reads it on import.
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        logging.getLogger("datasets").setLevel(logging.ERROR)
    return path
