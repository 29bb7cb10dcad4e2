"""data/tokenizer_check.py on Hub ids: two repos whose cached tokenizer files are byte-identical (a model and its
re-upload, e.g. Qwen/Qwen3-8B and unsloth/Qwen3-8B) are the same tokenizer, known from the local Hugging Face
cache without loading either; anything else is compared by loading both, as before."""

from __future__ import annotations

import json

import pytest

from HyperSloth.data import tokenizer_check

VOCAB = json.dumps({"model": {"vocab": {"a": 0, "b": 1}}})


def cache_snapshot(cache, repo_id: str, files: dict[str, str], commit: str = "0" * 40) -> None:
    """A repo in huggingface_hub's cache layout: refs/main names the commit, snapshots/<commit>/ holds the files."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    for name, text in files.items():
        (repo / "snapshots" / commit / name).write_text(text)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


@pytest.fixture
def loads(monkeypatch):
    """Every tokenizer load, answered with a vocabulary named after the source's last letter."""
    import transformers

    calls = []

    class Loaded:
        def __init__(self, source):
            self.source = source

        def get_vocab(self):
            return {"a": 0, "b": 1} if self.source.endswith("A") else {"a": 0, "c": 1}

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda source, *a, **k: calls.append(str(source)) or Loaded(str(source)))
    return calls


def test_hub_repos_with_identical_cached_files_are_accepted_without_loading(hub_cache, loads):
    files = {"tokenizer.json": VOCAB, "tokenizer_config.json": "{}"}
    cache_snapshot(hub_cache, "org/model", files)
    cache_snapshot(hub_cache, "mirror/model", files, commit="1" * 40)
    assert tokenizer_check.tokenizer_mismatch({"tokenizer": "org/model"}, "mirror/model", "chat") is None
    assert loads == []


@pytest.mark.parametrize("files_a, files_b", [
    ({"tokenizer.json": VOCAB}, {"tokenizer.json": VOCAB.replace('"b"', '"c"')}),  # another vocabulary
    ({"tokenizer_config.json": "{}"}, {"tokenizer_config.json": "{}"}),  # no vocabulary cached: files cannot tell
])
def test_other_or_partial_cached_files_are_compared_by_loading_both(hub_cache, loads, files_a, files_b):
    cache_snapshot(hub_cache, "org/modelA", files_a)
    cache_snapshot(hub_cache, "other/modelB", files_b)
    message = tokenizer_check.tokenizer_mismatch({"tokenizer": "org/modelA"}, "other/modelB", "chat")
    assert loads == ["org/modelA", "other/modelB"]
    assert "vocabulary differs" in message and "--tokenizer other/modelB" in message


def test_an_uncached_hub_id_is_compared_by_loading(hub_cache, loads):
    assert tokenizer_check.tokenizer_mismatch({"tokenizer": "org/modelA"}, "mirror/modelA", "chat") is None
    assert loads == ["org/modelA", "mirror/modelA"]
