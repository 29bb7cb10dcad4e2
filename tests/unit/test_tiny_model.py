"""The embedded tiny Qwen3: loads like a hub checkpoint, renders ChatML, deterministic, idempotent, atomic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jinja2 import Template
from transformers import AutoModelForCausalLM, AutoTokenizer

import HyperSloth.train.tiny_model as tiny
from HyperSloth.cli.tiny_model import count_parameters, tiny_model
from HyperSloth.train.tiny_model import CHATML_TEMPLATE, build_tiny_model, build_tiny_tokenizer

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "reverse: cat dog sun"},
    {"role": "assistant", "content": "sun dog cat"},
    {"role": "user", "content": "sort: 5 2 9"},
]
CHATML = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nreverse: cat dog sun<|im_end|>\n"
    "<|im_start|>assistant\nsun dog cat<|im_end|>\n"
    "<|im_start|>user\nsort: 5 2 9<|im_end|>\n"
)
# 512*64 embedding (tied, stored once) + 2 layers * 37,024 + final norm 64.
EXPECTED_PARAMS = 106_880


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(built: Path):
    return AutoTokenizer.from_pretrained(built)


def test_loads_and_generates_from_chat_prompt(built: Path, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(built)
    assert model.config.model_type == "qwen3" and model.dtype == torch.float32
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(tokenizer) == 512
    assert sum(p.numel() for p in model.parameters()) == EXPECTED_PARAMS
    # initializer_range 0.1 (not Qwen3's 0.02): the std that lets LoRA learn on a random base.
    for weight in (model.model.embed_tokens.weight, model.model.layers[0].mlp.up_proj.weight):
        assert 0.095 < weight.std().item() < 0.105
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids["input_ids"].shape[1] + 4)
    assert torch.equal(out[0, : ids["input_ids"].shape[1]], ids["input_ids"][0])


def test_special_tokens_and_generation_config(built: Path, tokenizer) -> None:
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token) == (0, 2, None)
    generation = json.loads((built / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (2, 0)
    assert tokenizer.model_max_length == 4096


def test_template_renders_chatml_exactly(tokenizer) -> None:
    assert tokenizer.apply_chat_template(CHAT, tokenize=False) == CHATML
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt == CHATML + "<|im_start|>assistant\n"
    # Plain Jinja gives the same text, so code that renders the template itself agrees.
    assert Template(CHATML_TEMPLATE).render(messages=CHAT, add_generation_prompt=True) == prompt


def test_offsets_tile_the_text_and_specials_are_single_tokens(tokenizer) -> None:
    text = CHATML + "<|im_start|>assistant\n2 5 9<|im_end|>\n"
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    offsets = enc["offset_mapping"]
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    assert all(prev[1] == cur[0] for prev, cur in zip(offsets, offsets[1:]))  # no gaps, no overlap
    pieces = [text[start:end] for start, end in offsets]
    assert pieces.count("<|im_start|>") == 5 and pieces.count("<|im_end|>") == 5
    assert tokenizer.decode(enc["input_ids"]) == text
    # The BPE learned the sample vocabulary: role names and common words are one token each.
    assert "assistant" in pieces and " dog" in pieces


def test_tokenizer_training_is_deterministic() -> None:
    texts = ["reverse: cat dog sun", "sun dog cat", "count the words: red blue"] * 20
    first = build_tiny_tokenizer(texts, vocab_size=300)
    second = build_tiny_tokenizer(texts, vocab_size=300)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert first("cat dog").input_ids == second("cat dog").input_ids


def test_same_seed_gives_identical_files(built: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", tiny.ARGS_FILE):
        assert (again / name).read_bytes() == (built / name).read_bytes(), name


def test_second_call_is_a_no_op(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    monkeypatch.setattr(tiny, "_write_model", lambda *a: pytest.fail("rebuilt an up-to-date model"))
    assert build_tiny_model(built) == built
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before
    assert sorted(p.name for p in built.parent.iterdir()) == ["model", "model.lock"]  # no temp dirs left


def test_refuses_foreign_folder_unless_forced(tmp_path: Path, built: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty.*--force"):
        build_tiny_model(foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    path = build_tiny_model(foreign, seed=1, force=True)
    assert not (path / "notes.txt").exists()
    assert (path / "model.safetensors").read_bytes() != (built / "model.safetensors").read_bytes()
    assert (path / "tokenizer.json").read_bytes() == (built / "tokenizer.json").read_bytes()


def test_refuses_model_built_with_other_arguments(built: Path) -> None:
    with pytest.raises(FileExistsError, match="different hidden_size, seed"):
        build_tiny_model(built, seed=3, hidden_size=32)


def test_crash_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(folder: Path, *_: object) -> None:
        (folder / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "_write_model", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        build_tiny_model(tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.lock"]


def test_missing_data_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--data_path"):
        build_tiny_model(tmp_path / "model", data_path=tmp_path / "absent.jsonl")


def test_malformed_data_names_the_line(tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "no messages"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 .*--data_path"):
        build_tiny_model(tmp_path / "model", data_path=data)
    assert not (tmp_path / "model").exists()


def test_tokenizer_config_loads_on_transformers_4_and_5(built: Path, tokenizer) -> None:
    config = json.loads((built / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer.chat_template == CHATML_TEMPLATE


def test_cli_reports_what_it_built(built: Path, capsys: pytest.CaptureFixture) -> None:
    tiny_model(str(built))
    out = capsys.readouterr().out
    assert f"tiny model: {built}" in out and "parameters: 106,880" in out and "vocab size: 512" in out
    assert count_parameters(built / "model.safetensors") == EXPECTED_PARAMS


def test_cli_user_mistake_exits_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        tiny_model(str(tmp_path / "m"), data_path=str(tmp_path / "absent.jsonl"))
    assert exit_info.value.code == 2
    assert "--data_path" in capsys.readouterr().err


def test_the_built_folder_has_the_umasks_modes_not_owner_only(built: Path) -> None:
    from HyperSloth.outputs.run_files import umask

    mask = umask()  # the build ran in this process, under this umask
    assert built.stat().st_mode & 0o777 == 0o777 & ~mask
    modes = {p.name: p.stat().st_mode & 0o777 for p in built.iterdir()}
    assert modes["model.safetensors"] == 0o666 & ~mask and set(modes.values()) == {0o666 & ~mask}, modes
