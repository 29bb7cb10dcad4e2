"""The dataset registry ``{data_dir}/data_config.json``: read, register, remove.

Format (docs/architecture.md)::

    {"version": 1, "datasets": {"NAME": {"name": ..., "path": "built_dataset/NAME", ...}}}

Every writer holds ``{data_dir}/data_config.json.lock`` (``filelock.FileLock``) for its whole
read-modify-write, and replaces the file atomically (``run_files.atomic_write_text``: temp file in
the same folder, fsync, rename), so concurrent builds never lose an entry and a reader never sees half a file.
This module imports nothing heavy: the trainer and planners read the registry cheaply.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock

from HyperSloth import config
from HyperSloth.config import REGISTRY_FILE, REGISTRY_VERSION
from HyperSloth.data.formats import DataInputError
from HyperSloth.outputs import run_files

BUILT_DIR = "built_dataset"
#: The keys every entry has (docs/architecture.md); readers in other modules rely on them.
ENTRY_KEYS: tuple[str, ...] = (
    "name", "path", "source", "split", "num_samples", "tokenizer",
    "template_fingerprint", "max_seq_length", "created_at", "stats",
)  # fmt: skip


def registry_path(data_dir: str | os.PathLike) -> Path:
    """``{data_dir}/data_config.json``."""
    return Path(data_dir) / REGISTRY_FILE


@contextmanager
def registry_lock(data_dir: str | os.PathLike, timeout: float = 600.0) -> Iterator[None]:
    """Hold the registry's file lock (creating ``data_dir`` if needed)."""
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(registry_path(data_dir)) + ".lock", timeout=timeout)
    with lock:
        yield


def read_registry(data_dir: str | os.PathLike) -> dict[str, Any]:
    """The whole registry (``{"version": 1, "datasets": {...}}``); an empty one if there is no file.

    DataInputError if the file exists but is not a valid registry. (The reading itself is
    ``HyperSloth.config.read_registry``, shared with the trainer's side.)
    """
    try:
        return config.read_registry(data_dir)
    except config.ConfigError as err:
        raise DataInputError(str(err)) from None


def register(entry: dict[str, Any], data_dir: str | os.PathLike) -> None:
    """Add or replace ``entry`` (keyed by ``entry['name']``) under the lock."""
    missing = [k for k in ENTRY_KEYS if k not in entry]
    if missing:
        raise ValueError(f"registry entry lacks {missing}")
    with registry_lock(data_dir):
        registry = read_registry(data_dir)
        registry["datasets"][entry["name"]] = entry
        write_registry_unlocked(registry, data_dir)


def remove(name: str, data_dir: str | os.PathLike) -> bool:
    """Drop ``name`` from the registry (the built folder is left alone); True if it was there."""
    with registry_lock(data_dir):
        registry = read_registry(data_dir)
        if registry["datasets"].pop(name, None) is None:
            return False
        write_registry_unlocked(registry, data_dir)
        return True


def write_registry_unlocked(registry: dict[str, Any], data_dir: str | os.PathLike) -> None:
    """Atomically replace the registry file. The caller must hold ``registry_lock``."""
    registry = {"version": REGISTRY_VERSION, "datasets": dict(sorted(registry["datasets"].items()))}
    # json.dumps first: a value that cannot be written fails before the file is touched.
    run_files.atomic_write_text(registry_path(data_dir), json.dumps(registry, indent=2) + "\n")


def entry_dir(entry: dict[str, Any], data_dir: str | os.PathLike) -> Path:
    """The built folder of an entry (``path`` is relative to ``data_dir`` unless absolute)."""
    path = Path(entry["path"])
    return path if path.is_absolute() else Path(data_dir) / path
