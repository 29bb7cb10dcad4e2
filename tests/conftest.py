"""Fixtures shared by every test module.

`tiny_model_dir` is the embedded tiny Qwen3, built once per test run: with pytest-xdist every worker
process asks for it, the first builds it in the run's shared temp folder, the others reuse the folder
(build_tiny_model builds under a file lock and is idempotent: a finished folder is only checked).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from loguru import logger

# One share of the cores per test process, set before torch is imported, and inherited by every process a test
# starts: pytest-xdist runs one worker per core, and torch's default of one thread per core in each of them
# oversubscribes the machine; the tiny models' small ops then wait on each other's threads (on the loaded 2-core
# machine one test of test_evaluation.py took 27 s with 2 threads, 0.16 s with 1). Unset, or set, is kept.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temp folder of this whole test run: the same for every xdist worker (their own is one below)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model folder (HyperSloth.train.tiny_model), one build per test run."""
    from HyperSloth.train.tiny_model import build_tiny_model

    return build_tiny_model(shared_tmp(tmp_path_factory) / "tiny-qwen3")


@pytest.fixture()
def logs():
    """The messages HyperSloth logs (loguru) while the test runs."""
    lines: list[str] = []
    handle = logger.add(lines.append, format="{message}")
    yield lines
    logger.remove(handle)
