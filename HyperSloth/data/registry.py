"""The dataset registry ``{data_dir}/data_config.json``: read, register, remove.

Format (docs/architecture.md)::

    {"version": 1, "datasets": {"NAME": {"name": ..., "path": "built_dataset/NAME", ...}}}

Every writer holds ``{data_dir}/data_config.json.lock`` (``filelock.FileLock``) for its whole
read-modify-write, and replaces the file atomically (temp file in the same folder, fsync,
``os.replace``), so concurrent builds never lose an entry and a reader never sees half a file.
This module imports nothing heavy: the trainer and planners read the registry cheaply.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock

from HyperSloth.data.formats import DataInputError

REGISTRY_FILE = "data_config.json"
REGISTRY_VERSION = 1
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

    DataInputError if the file exists but is not a valid registry.
    """
    path = registry_path(data_dir)
    if not path.exists():
        return {"version": REGISTRY_VERSION, "datasets": {}}
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise DataInputError(f"{path} is not readable JSON ({err}); fix or delete it") from None
    if not isinstance(content, dict) or not isinstance(content.get("datasets"), dict):
        raise DataInputError(f"{path} has no 'datasets' mapping; fix or delete it")
    return content


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
    path = registry_path(data_dir)
    registry = {"version": REGISTRY_VERSION, "datasets": dict(sorted(registry["datasets"].items()))}
    fd, tmp = tempfile.mkstemp(prefix=f".{REGISTRY_FILE}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(registry, handle, indent=2, sort_keys=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def entry_dir(entry: dict[str, Any], data_dir: str | os.PathLike) -> Path:
    """The built folder of an entry (``path`` is relative to ``data_dir`` unless absolute)."""
    path = Path(entry["path"])
    return path if path.is_absolute() else Path(data_dir) / path
