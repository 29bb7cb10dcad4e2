"""hypersloth-build-dataset end to end: local formats, bad input, policies, failures, concurrency."""

from __future__ import annotations

import importlib.resources
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from HyperSloth.cli.build_dataset import main
from HyperSloth.data import build, masking
from HyperSloth.data.build import COLUMNS, build_dataset
from HyperSloth.data.formats import DataInputError

REPO = Path(__file__).resolve().parents[2]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = "cat dog sun moon tree fish bird star rain snow red blue green gold".split()
# The official Qwen3 template, as TRL ships it (it renders past replies without their reasoning).
QWEN3 = (importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")


def conversation(i: int, turns: int = 2) -> list[dict]:
    messages = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
    for t in range(turns):
        words = [WORDS[(i + t + k) % len(WORDS)] for k in range(1 + (i * 7 + t) % 9)]
        messages += [
            {"role": "user", "content": "reverse: " + " ".join(words)},
            {"role": "assistant", "content": " ".join(reversed(words))},
        ]
    return messages


def reasoning_conversation(i: int, turns: int) -> list[dict]:
    """Like ``conversation`` with every reply carrying <think> reasoning (as Qwen3 writes it)."""
    messages = conversation(i, turns)
    for m in messages:
        if m["role"] == "assistant":
            m["content"] = f"<think>\nreverse {len(m['content'].split())} words\n</think>\n\n{m['content']}"
    return messages


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory) -> dict[str, str]:
    """A ChatML tokenizer and the same tokenizer without a chat template, saved to disk."""
    root = tmp_path_factory.mktemp("tok")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    backend.train_from_iterator([" ".join(WORDS), "reverse: be brief system user assistant"] * 3, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    tok.save_pretrained(root / "plain")
    tok.chat_template = CHATML
    tok.save_pretrained(root / "chatml")
    tok.add_tokens(["<think>", "</think>"])  # as in Qwen3's tokenizer: added, not special
    tok.chat_template = QWEN3
    tok.save_pretrained(root / "qwen3")
    return {"chatml": str(root / "chatml"), "plain": str(root / "plain"), "qwen3": str(root / "qwen3")}


def snapshot(data_dir: Path) -> dict:
    """Registry text and every file under built_dataset/ (names and sizes)."""
    reg = data_dir / "data_config.json"
    files = sorted((str(p.relative_to(data_dir)), p.stat().st_size) for p in data_dir.rglob("*") if p.is_file()
                   and "built_dataset" in p.parts)  # fmt: skip
    return {"registry": reg.read_text() if reg.exists() else None, "files": files}


def test_local_formats_build_the_same_dataset(tmp_path, tok_dirs):
    rows = [{"messages": conversation(i)} for i in range(12)]
    sources = {
        "jsonl": write_jsonl(tmp_path / "c.jsonl", rows),
        "json": tmp_path / "c.json",
        "parquet": tmp_path / "c.parquet",
        "saved": tmp_path / "saved",
    }
    sources["json"].write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(sources["parquet"]))
    datasets.Dataset.from_list(rows).save_to_disk(str(sources["saved"]))
    data_dir = tmp_path / "data"
    built = {}
    for name, path in sources.items():
        entry = build_dataset(str(path), name=name, tokenizer=tok_dirs["chatml"], data_dir=str(data_dir), num_proc=1)
        assert entry["num_samples"] == 12 and entry["source"] == str(path.resolve())
        built[name] = datasets.load_from_disk(str(data_dir / entry["path"]))
    assert built["jsonl"].column_names == list(COLUMNS)
    for name in ("json", "parquet", "saved"):
        assert built[name].to_list() == built["jsonl"].to_list()
    registered = json.loads((data_dir / "data_config.json").read_text())["datasets"]
    assert sorted(registered) == sorted(sources)


def test_columns_mask_and_registry_entry(tmp_path, tok_dirs):
    rows = [{"messages": conversation(i, turns=3)} for i in range(6)]
    data_dir = tmp_path / "data"
    entry = build_dataset(str(write_jsonl(tmp_path / "c.jsonl", rows)), name="m", tokenizer=tok_dirs["chatml"],
                          data_dir=str(data_dir), max_seq_length=512, num_proc=1)  # fmt: skip
    ds = datasets.load_from_disk(str(data_dir / "built_dataset/m"))
    tok = AutoTokenizer.from_pretrained(tok_dirs["chatml"])
    for row, source in zip(ds, rows):
        assert row["text"] == tok.apply_chat_template(source["messages"], tokenize=False)
        assert row["input_ids"] == tok(row["text"], add_special_tokens=False)["input_ids"]
        assert row["length"] == len(row["input_ids"]) == len(row["labels"])
        assert row["num_trainable"] == sum(label != -100 for label in row["labels"][1:])
        trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
        replies = [m["content"] for m in source["messages"] if m["role"] == "assistant"]
        assert tok.decode(trained) == "".join(reply + "<|im_end|>" for reply in replies)
    assert set(entry) == {"name", "kind", "path", "source", "split", "num_samples", "tokenizer",
                          "template_fingerprint", "max_seq_length", "created_at", "stats"}  # fmt: skip
    assert entry["kind"] == "sft"
    assert entry["template_fingerprint"] == masking.template_fingerprint(CHATML)
    stats = entry["stats"]
    assert stats["total_tokens"] == sum(ds["length"]) and stats["max_tokens"] == max(ds["length"])
    assert stats["trainable_tokens"] == sum(ds["num_trainable"])
    assert stats["fraction_trainable"] == round(stats["trainable_tokens"] / stats["total_tokens"], 4)
    assert stats["truncated"] == stats["dropped_overlength"] == 0 and stats["skipped"] == {}


def test_bad_input_corpus_is_counted_reported_and_strict_is_fatal(tmp_path, tok_dirs, logs, capsys):
    good = {"messages": conversation(1)}
    lines = [
        json.dumps(good),
        "{broken json",  # line 2
        json.dumps({"text": "no chat"}),
        json.dumps({"messages": []}),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
        json.dumps({"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "y"}]}),
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "cat dog"}]}),
        "[1, 2]",
        "{also: broken}",  # line 10
        json.dumps({"instruction": "reverse: cat dog", "input": "", "output": "dog cat"}),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    data_dir = tmp_path / "data"
    entry = build_dataset(str(path), name="bad", tokenizer=tok_dirs["chatml"], data_dir=str(data_dir), num_proc=1)
    assert entry["num_samples"] == 3
    assert entry["stats"]["formats"] == {"openai": 1, "sharegpt": 1, "alpaca": 1}
    assert entry["stats"]["skipped"] == {
        "malformed_json": 2, "missing_fields": 1, "empty_conversation": 1, "no_assistant_turn": 1,
        "unknown_role": 1, "non_string_content": 1, "not_an_object": 1,
    }  # fmt: skip
    assert entry["stats"]["records_read"] == 11
    text = "\n".join(logs)
    assert "skipped 2 record(s): malformed_json" in text
    # Each malformed line is named once, in the summary (it was warned about while reading as well).
    assert text.count(f"{path}:2: ") == 1 and text.count(f"{path}:10: ") == 1
    assert f"{path}:5: no assistant/gpt message" in text and f"{path}:6: turn 0 has role 'robot'" in text

    before = snapshot(data_dir)
    with pytest.raises(SystemExit) as exit_info:
        main(["--local_path", str(path), "--name", "strict", "--tokenizer", tok_dirs["chatml"],
              "--data_dir", str(data_dir), "--strict"])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hypersloth-build-dataset: error: ") and f"{path}:2: malformed_json" in err
    assert snapshot(data_dir) == before


def test_truncate_and_drop_policies(tmp_path, tok_dirs, logs):
    rows = [{"messages": conversation(i, turns=4)} for i in range(20)]
    src = str(write_jsonl(tmp_path / "c.jsonl", rows))
    data_dir = str(tmp_path / "data")
    full = build_dataset(src, name="full", tokenizer=tok_dirs["chatml"], data_dir=data_dir, num_proc=1)
    full_ds = datasets.load_from_disk(f"{data_dir}/built_dataset/full")
    limit = sorted(full_ds["length"])[10]
    over = sum(length > limit for length in full_ds["length"])
    assert 0 < over < 20 and full["stats"]["max_tokens"] > limit
    cut = build_dataset(src, name="cut", tokenizer=tok_dirs["chatml"], data_dir=data_dir, max_seq_length=limit, num_proc=1)
    drop = build_dataset(src, name="drop", tokenizer=tok_dirs["chatml"], data_dir=data_dir, max_seq_length=limit,
                         overlength="drop", num_proc=1)  # fmt: skip
    assert cut["stats"]["truncated"] == over and cut["num_samples"] == 20 and cut["stats"]["max_tokens"] == limit
    # The truncated samples are named: row, source line and length before the cut.
    long_rows = [i for i, length in enumerate(full_ds["length"]) if length > limit]
    named = [f"sample #{i}, {src}:{i + 1}: {full_ds[i]['length']} tokens" for i in long_rows[:5]]
    assert cut["stats"]["overlength_examples"]["truncated"] == named
    assert drop["stats"]["overlength_examples"]["dropped_overlength"] == [n.split(", ", 1)[1] for n in named]
    text = "\n".join(logs)
    assert f"truncated: {over} sample(s) cut to --max_seq_length" in text and f"    {named[0]}" in text
    built_line = next(line for line in logs if line.startswith("built cut: 20 samples"))
    assert f"({over} of them cut to {limit:,} tokens, without the end of their reply and its end-of-turn" in built_line
    assert "cut to" not in next(line for line in logs if line.startswith("built full: 20 samples"))
    assert drop["stats"]["dropped_overlength"] == over and drop["num_samples"] == 20 - over
    cut_ds = datasets.load_from_disk(f"{data_dir}/built_dataset/cut")
    tok = AutoTokenizer.from_pretrained(tok_dirs["chatml"])
    for long_row, short_row in zip(full_ds, cut_ds):
        n = short_row["length"]
        assert short_row["input_ids"] == long_row["input_ids"][:n] and short_row["labels"] == long_row["labels"][:n]
        assert tok(short_row["text"], add_special_tokens=False)["input_ids"] == short_row["input_ids"]
    assert sorted(datasets.load_from_disk(f"{data_dir}/built_dataset/drop")["length"]) == sorted(
        length for length in full_ds["length"] if length <= limit
    )


def test_two_tokenising_processes_give_the_same_rows(tmp_path, tok_dirs):
    src = str(write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation(i, turns=1)} for i in range(1000)]))
    data_dir = str(tmp_path / "data")
    for name, num_proc in (("p1", 1), ("p2", 2)):
        build_dataset(src, name=name, tokenizer=tok_dirs["chatml"], data_dir=data_dir, num_proc=num_proc)
    one, two = (datasets.load_from_disk(f"{data_dir}/built_dataset/{n}") for n in ("p1", "p2"))
    assert len(two) == 1000 and one["input_ids"][:] == two["input_ids"][:] and one["labels"][:] == two["labels"][:]


def test_seeded_sample_and_overwrite(tmp_path, tok_dirs, capsys):
    rows = [{"messages": conversation(i)} for i in range(40)]
    src = str(write_jsonl(tmp_path / "c.jsonl", rows))
    data_dir = str(tmp_path / "data")

    def texts(name, seed, overwrite=False):
        build_dataset(src, name=name, tokenizer=tok_dirs["chatml"], data_dir=data_dir, n=7, seed=seed,
                      num_proc=1, overwrite=overwrite)  # fmt: skip
        return datasets.load_from_disk(f"{data_dir}/built_dataset/{name}")["text"]

    first, again, other = texts("a", 1), texts("b", 1), texts("c", 2)
    assert len(first) == 7 and first == again and first != other
    with pytest.raises(SystemExit) as exit_info:
        main(["--local_path", src, "--name", "a", "--tokenizer", tok_dirs["chatml"], "--data_dir", data_dir])
    assert exit_info.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert texts("a", 2, overwrite=True) == other


def test_failed_builds_leave_registry_and_folders_unchanged(tmp_path, tok_dirs, monkeypatch):
    rows = [{"messages": conversation(i)} for i in range(30)]
    src = str(write_jsonl(tmp_path / "c.jsonl", rows))
    data_dir = tmp_path / "data"
    build_dataset(src, name="keep", tokenizer=tok_dirs["chatml"], data_dir=str(data_dir), num_proc=1)
    before = snapshot(data_dir)
    real_policy, real_save = build._Encoder.apply_policy, datasets.Dataset.save_to_disk
    seen = []

    def fail_mid_tokenising(self, item):
        seen.append(1)
        if len(seen) == 15:
            raise RuntimeError("injected failure while tokenising")
        return real_policy(self, item)

    def fail_after_writing(self, path, **kwargs):
        real_save(self, path, **kwargs)  # a complete temp folder exists, then the build dies
        raise OSError("injected failure after writing")

    def fail_register(*args, **kwargs):
        raise OSError("injected failure while registering")

    injections = [
        (build._Encoder, "apply_policy", fail_mid_tokenising, "new", False),
        (datasets.Dataset, "save_to_disk", fail_after_writing, "new", False),
        (build.registry, "write_registry_unlocked", fail_register, "new", False),
        (build.registry, "write_registry_unlocked", fail_register, "keep", True),  # old one must come back
    ]
    for owner, attr, broken, name, overwrite in injections:
        with monkeypatch.context() as patch:
            patch.setattr(owner, attr, broken)
            with pytest.raises((RuntimeError, OSError), match="injected"):
                build_dataset(src, name=name, tokenizer=tok_dirs["chatml"], data_dir=str(data_dir), n=20,
                              num_proc=1, overwrite=overwrite)  # fmt: skip
        assert snapshot(data_dir) == before, attr
        assert [p.name for p in (data_dir / "built_dataset").iterdir()] == ["keep"]
    assert len(seen) == 15


def test_tokenizer_and_path_errors_exit_2(tmp_path, tok_dirs, capsys):
    src = str(write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation(0)}]))
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    cases = [
        (["--local_path", src, "--tokenizer", tok_dirs["plain"]], "has no chat template: pass --chat_template"),
        (["--local_path", src, "--tokenizer", str(tmp_path / "missing")], "no such folder"),
        (["--local_path", str(tmp_path / "x.jsonl"), "--tokenizer", tok_dirs["chatml"]], "does not exist"),
        (["--tokenizer", tok_dirs["chatml"]], "exactly one source"),
        (["--local_path", src, "--tokenizer", tok_dirs["chatml"], "--overlength", "cut"], "--overlength"),
        (["--local_path", src, "--tokenizer", tok_dirs["plain"], "--chat_template", "nope.jinja"], "no such file"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--name", "x", "--data_dir", str(tmp_path / "data")])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and message in err and "Traceback" not in err, (argv, err)
    main(["--local_path", src, "--tokenizer", tok_dirs["plain"], "--chat_template", str(template), "--name", "ok",
          "--data_dir", str(tmp_path / "data"), "--print_samples"])  # fmt: skip
    out = capsys.readouterr().out
    assert "[[" in out and "<|im_end|>]]" in out and f"--- sample 0 from {src}:1:" in out
    assert "<|im_start|>user" in out.split("\n", 1)[1].split("[[")[0]  # the prompt is outside the markers
    assert not (tmp_path / "data" / "built_dataset" / "x").exists()
    entry = json.loads((tmp_path / "data" / "data_config.json").read_text())["datasets"]["ok"]
    assert entry["stats"]["chat_template"] == str(template.resolve())  # what a rebuild needs


def test_help_lists_flags_and_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for text in ("--hf_dataset mlabonne/FineTome-100k -n 1000", "--local_path FILE_OR_DIR --name NAME",
                 "--overlength", "--strict", "--print_samples", "--chat_template", "--data_dir", "--num_proc",
                 "--history_rewrite MODE"):  # fmt: skip
        assert text in out


def _cli(*args: str, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "HyperSloth.cli.build_dataset", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


def test_hf_dataset_offline_fails_fast_pointing_to_local_path(tmp_path, tok_dirs):
    start = time.monotonic()
    proc = _cli("--hf_dataset", "mlabonne/FineTome-100k", "-n", "10", "--name", "f", "--tokenizer",
                tok_dirs["chatml"], "--data_dir", str(tmp_path / "data"))  # fmt: skip
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    last = err.strip().splitlines()[-1]
    assert "HF_HUB_OFFLINE" in last and "--local_path" in last and "Traceback" not in err
    assert time.monotonic() - start < 60
    assert not (tmp_path / "data" / "data_config.json").exists()


def _build_in_child(src: str, name: str, tokenizer: str, data_dir: str) -> None:
    build_dataset(src, name=name, tokenizer=tokenizer, data_dir=data_dir, num_proc=1)


def test_unreachable_hub_fails_fast_without_retries(tmp_path, tok_dirs, monkeypatch):
    monkeypatch.setattr(build, "_hub_offline", lambda: False)
    monkeypatch.setattr(build, "hub_reachable", lambda timeout=5.0: False)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("must not try the Hub"))
    with pytest.raises(DataInputError, match=r"not reachable.*HF_HUB_OFFLINE=1.*--local_path"):
        build_dataset("org/name", source_type="hf", name="h", tokenizer=tok_dirs["chatml"], data_dir=str(tmp_path))


def test_two_concurrent_builds_share_one_registry(tmp_path, tok_dirs):
    # Forked children: two real processes building at once, without paying the imports again.
    data_dir, ctx = tmp_path / "data", multiprocessing.get_context("fork")
    procs = []
    for name in ("one", "two"):
        src = write_jsonl(tmp_path / f"{name}.jsonl", [{"messages": conversation(i)} for i in range(25)])
        procs.append(ctx.Process(target=_build_in_child, args=(str(src), name, tok_dirs["chatml"], str(data_dir))))
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    registered = json.loads((data_dir / "data_config.json").read_text())["datasets"]
    assert sorted(registered) == ["one", "two"]
    assert all(registered[n]["num_samples"] == 25 for n in ("one", "two"))
    assert sorted(p.name for p in (data_dir / "built_dataset").iterdir()) == ["one", "two"]


def test_script_wrapper_is_the_same_cli():
    proc = subprocess.run([sys.executable, "scripts/build_dataset.py", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and "--local_path FILE_OR_DIR" in proc.stdout


def test_library_errors_are_data_input_errors(tmp_path, tok_dirs):
    src = str(write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "q"}]}]))
    with pytest.raises(DataInputError, match="no usable conversations"):
        build_dataset(src, name="none", tokenizer=tok_dirs["chatml"], data_dir=str(tmp_path / "data"))
    with pytest.raises(DataInputError, match="--name"):
        build_dataset(src, name="../escape", tokenizer=tok_dirs["chatml"], data_dir=str(tmp_path / "data"))


def test_reasoning_chats_under_qwen3_are_split_per_reply(tmp_path, tok_dirs, logs, capsys):
    rows = [{"messages": conversation(0, turns=2)}]  # plain: one sample, as before
    rows += [{"messages": reasoning_conversation(i, turns=2)} for i in range(1, 5)]
    rows += [{"messages": reasoning_conversation(5, turns=3)}, {"messages": reasoning_conversation(6, turns=1)}]
    rows += [{"messages": [*reasoning_conversation(7, turns=2), {"role": "user", "content": "and then?"}]}]
    src = str(write_jsonl(tmp_path / "r.jsonl", rows))
    data_dir = str(tmp_path / "data")
    argv = ["--local_path", src, "--tokenizer", tok_dirs["qwen3"], "--data_dir", data_dir, "--num_proc", "1"]
    main([*argv, "--name", "split", "--print_samples", "1"])
    entry = json.loads((tmp_path / "data" / "data_config.json").read_text())["datasets"]["split"]
    stats = entry["stats"]
    # Conversations 1-5 and 7 (its trailing question dropped) are split: 2*4 + 3 + 2 samples.
    assert (stats["conversations_split"], stats["samples_from_split"], stats["trailing_turn_dropped"]) == (6, 13, 1)
    assert entry["num_samples"] == 15 and stats["skipped"] == {} and stats["history_rewrite"] == "split"
    ds = datasets.load_from_disk(f"{data_dir}/built_dataset/split")
    tok = AutoTokenizer.from_pretrained(tok_dirs["qwen3"])
    expected = []  # (text, trained text) of every sample, in order
    for row in rows:
        messages = row["messages"][:-1] if row["messages"][-1]["role"] == "user" else row["messages"]
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if "<think>" not in messages[replies[0]]["content"] or len(replies) == 1:
            trained = "".join(messages[i]["content"] + "<|im_end|>" for i in replies)
            expected.append((tok.apply_chat_template(messages, tokenize=False), trained))
            continue
        for i in replies:  # one sample per reply, rendered as the conversation stood at that reply
            reply = messages[i]["content"] + "<|im_end|>"
            expected.append((tok.apply_chat_template(messages[: i + 1], tokenize=False), reply))
    trained = [tok.decode([t for t, label in zip(r["input_ids"], r["labels"]) if label != -100]) for r in ds]
    assert list(zip(ds["text"], trained)) == expected
    text = "\n".join(logs)
    assert "6 conversation(s) split into 13 samples, one per reply" in text
    assert "dropped the trailing user turn of 1 conversation(s)" in text and f"    {src}:8" in text
    out = capsys.readouterr().out
    assert f"--- sample 0 from {src}:1: " in out  # the first sample, then the first split conversation
    assert f"--- sample 1 from {src}:2, reply 1 of 2 (split: the template rewrites earlier replies)" in out
    assert f"--- sample 2 from {src}:2, reply 2 of 2 (split" in out and "--- sample 3 " not in out

    main([*argv, "--name", "last", "--history_rewrite", "last"])
    main([*argv, "--name", "skip", "--history_rewrite", "skip"])
    registered = json.loads((tmp_path / "data" / "data_config.json").read_text())["datasets"]
    assert registered["last"]["num_samples"] == 8 and registered["last"]["stats"]["conversations_last_reply_only"] == 6
    last = datasets.load_from_disk(f"{data_dir}/built_dataset/last")
    assert last["text"][1] == tok.apply_chat_template(rows[1]["messages"], tokenize=False)
    assert registered["skip"]["num_samples"] == 2 and registered["skip"]["stats"]["skipped"] == {"history_rewritten": 6}
    assert "--history_rewrite split keeps such conversations" in "\n".join(logs)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--name", "bad", "--history_rewrite", "all"])
    assert exit_info.value.code == 2 and "--history_rewrite" in capsys.readouterr().err


def test_empty_jsonl_says_it_is_empty(tmp_path, tok_dirs, capsys):
    for content in ("", "\n\n"):
        src = tmp_path / "empty.jsonl"
        src.write_text(content)
        with pytest.raises(SystemExit) as exit_info:
            main(["--local_path", str(src), "--name", "e", "--tokenizer", tok_dirs["chatml"],
                  "--data_dir", str(tmp_path / "data")])  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_info.value.code == 2 and "holds no records (it is empty" in err and "summary" not in err
    assert not (tmp_path / "data" / "data_config.json").exists()
