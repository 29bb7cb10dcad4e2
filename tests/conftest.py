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
