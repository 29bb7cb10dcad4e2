"""The registry: read/register/remove, atomic writes, concurrent writers."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from HyperSloth.data import registry
from HyperSloth.data.formats import DataInputError
from HyperSloth.outputs import run_files


def entry(name: str, **extra) -> dict:
    base = {key: None for key in registry.ENTRY_KEYS}
    return {**base, "name": name, "path": f"built_dataset/{name}", "num_samples": 1, "stats": {}, **extra}


def test_empty_register_replace_remove(tmp_path):
    assert registry.read_registry(tmp_path) == {"version": 1, "datasets": {}}
    registry.register(entry("b"), tmp_path)
    registry.register(entry("a"), tmp_path)
    registry.register(entry("b", num_samples=5), tmp_path)
    content = json.loads((tmp_path / "data_config.json").read_text())
    assert content["version"] == 1 and list(content["datasets"]) == ["a", "b"]
    assert content["datasets"]["b"]["num_samples"] == 5
    assert registry.remove("a", tmp_path) is True
    assert registry.remove("a", tmp_path) is False
    assert list(registry.read_registry(tmp_path)["datasets"]) == ["b"]
    # Only the registry and its lock remain: no temp files are left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data_config.json", "data_config.json.lock"]


def test_entry_without_required_keys_is_refused(tmp_path):
    with pytest.raises(ValueError, match="lacks"):
        registry.register({"name": "x"}, tmp_path)
    assert not (tmp_path / "data_config.json").exists()


def test_corrupt_registry_is_a_user_error(tmp_path):
    (tmp_path / "data_config.json").write_text("{half")
    with pytest.raises(DataInputError, match="not readable JSON"):
        registry.read_registry(tmp_path)
    (tmp_path / "data_config.json").write_text("[]")
    with pytest.raises(DataInputError, match="no 'datasets'"):
        registry.read_registry(tmp_path)


def test_failed_write_leaves_old_file(tmp_path, monkeypatch):
    registry.register(entry("a"), tmp_path)
    before = (tmp_path / "data_config.json").read_text()

    def broken_fsync(*args, **kwargs):
        raise OSError("disk full")

    # The new content is written to a temp file that fails before the rename: the old file stays whole.
    monkeypatch.setattr(run_files.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        registry.register(entry("b"), tmp_path)
    assert (tmp_path / "data_config.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data_config.json", "data_config.json.lock"]


def test_entry_dir_relative_and_absolute(tmp_path):
    assert registry.entry_dir({"path": "built_dataset/x"}, tmp_path) == tmp_path / "built_dataset/x"
    assert registry.entry_dir({"path": str(tmp_path / "y")}, "elsewhere") == tmp_path / "y"


def _register_many(data_dir: str, worker: int, count: int) -> None:
    for i in range(count):
        registry.register(entry(f"w{worker}-{i}"), data_dir)


def test_concurrent_writers_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_register_many, args=(str(tmp_path), w, 15)) for w in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0, 0, 0, 0]
    names = json.loads((tmp_path / "data_config.json").read_text())["datasets"]
    assert sorted(names) == sorted(f"w{w}-{i}" for w in range(4) for i in range(15))
