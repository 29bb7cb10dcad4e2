"""Where a model comes from: a name that may be a relative folder gets a local hint when the Hub fails."""

from __future__ import annotations

import os

from HyperSloth.launch import model_source


def test_a_relative_folder_missing_here_gets_a_local_hint_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)  # no build/ folder here: "build/tiny-qwen3" reads like a Hub id
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(model_source, "_cached", lambda name: False)
    problem = model_source.hub_problem("build/tiny-qwen3", "model_name")
    assert "HF_HUB_OFFLINE=1" in problem
    assert f"if 'build/tiny-qwen3' is a local folder: {tmp_path / 'build' / 'tiny-qwen3'} does not exist" in problem
    os.makedirs(tmp_path / "build" / "tiny-qwen3")
    assert model_source.hub_problem("build/tiny-qwen3", "model_name") is None  # run from its folder: found


def test_a_name_that_cannot_be_a_hub_id_gets_only_the_local_message(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    problem = model_source.hub_problem("./models/mine", "model_name")
    assert "looks like a local folder" in problem and "Hub" not in problem.split(":")[0]
