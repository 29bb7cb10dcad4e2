"""hypersloth-build-dataset's cheap input checks (HyperSloth.data.build), run before any source is read."""

from __future__ import annotations

import pytest

from HyperSloth.data import build
from HyperSloth.data.formats import DataInputError


def test_a_missing_tokenizer_under_a_local_folder_is_no_such_folder_without_asking_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "build" / "tiny-qwen3").mkdir(parents=True)

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was asked about a local path")

    monkeypatch.setattr(build, "hub_reachable", no_hub)
    with pytest.raises(DataInputError, match=r"--tokenizer build/nosuch: no such folder"):
        build.build_dataset("chats.jsonl", name="x", tokenizer="build/nosuch", data_dir=str(tmp_path / "data"))
    # "org/name" whose org is not a folder here is still a Hub id.
    assert not build._looks_local("Qwen/Qwen3-8B") and build._looks_local("build/nosuch")
