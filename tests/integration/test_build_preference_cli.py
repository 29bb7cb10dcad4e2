"""hypersloth-build-dataset on preference pairs, end to end on the tiny model's tokenizer: the shipped
sample tokenised exactly as TRL's DPOTrainer tokenises it, every source, bad pairs, length policies,
--kind, worker processes and tokenizers without a chat template."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
from transformers import AutoTokenizer

from HyperSloth.cli.build_dataset import main
from HyperSloth.data import build, preference
from HyperSloth.train.tiny_model import build_tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "data" / "sample_preference.jsonl"
ROWS = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> str:
    """The tiny model's folder: its ChatML tokenizer is trained on the shipped sample chats."""
    return str(tiny_model_dir)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def registry(data_dir: Path) -> dict:
    return json.loads((data_dir / "data_config.json").read_text())["datasets"]


def trl_tokenised(rows: list[dict], tokenizer) -> datasets.Dataset:
    """TRL's DPOTrainer dataset preparation (prompt extraction, eos, tokenisation) on ``rows``, without a
    model: the reference our ids must equal."""
    from trl import DPOTrainer

    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    stub = SimpleNamespace(_tokenizer=tokenizer)
    return DPOTrainer._prepare_dataset(stub, datasets.Dataset.from_list(rows), tokenizer, args, "train")


def test_sample_pairs_build_as_trl_tokenises_them(tmp_path, tiny, capsys):
    data_dir = tmp_path / "data"
    main(["--local_path", str(SAMPLE), "--name", "pref", "--tokenizer", tiny, "--data_dir", str(data_dir),
          "--print_samples", "1"])  # fmt: skip
    entry = registry(data_dir)["pref"]
    assert entry["kind"] == "preference" and entry["num_samples"] == len(ROWS) == 200
    assert entry["stats"]["skipped"] == {} and entry["stats"]["formats"] == {"conversational": 200}
    ds = datasets.load_from_disk(str(data_dir / entry["path"]))
    assert ds.column_names == list(preference.COLUMNS)
    reference = trl_tokenised(ROWS, AutoTokenizer.from_pretrained(tiny))
    assert ds["prompt_input_ids"][:] == reference["prompt_ids"][:]
    assert ds["chosen_input_ids"][:] == reference["chosen_ids"][:]
    assert ds["rejected_input_ids"][:] == reference["rejected_ids"][:]
    for row in ds:
        p, c, r = (len(row[f"{k}_input_ids"]) for k in ("prompt", "chosen", "rejected"))
        assert (row["prompt_length"], row["chosen_length"], row["rejected_length"]) == (p, c, r)
        assert row["length"] == 2 * p + c + r and row["num_trainable"] == c + r
    stats = entry["stats"]
    assert stats["total_tokens"] == sum(ds["length"]) and stats["trainable_tokens"] == sum(ds["num_trainable"])
    assert stats["max_tokens"] == max(p + max(c, r) for p, c, r in zip(ds["prompt_length"], ds["chosen_length"],
                                                                      ds["rejected_length"]))  # fmt: skip
    out = capsys.readouterr().out
    first = ROWS[0]
    assert f"--- pair 0 from {SAMPLE}:1: prompt {ds[0]['prompt_length']} tokens" in out
    assert f"[chosen] [[{first['chosen'][0]['content']}<|im_end|>" in out
    assert f"[rejected] [[{first['rejected'][0]['content']}<|im_end|>" in out


def test_every_source_gives_the_same_pairs(tmp_path, tiny, monkeypatch):
    rows = ROWS[:30]
    sources = {"jsonl": write_jsonl(tmp_path / "p.jsonl", rows), "json": tmp_path / "p.json",
               "parquet": tmp_path / "p.parquet", "saved": tmp_path / "saved"}  # fmt: skip
    sources["json"].write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(sources["parquet"]))
    datasets.Dataset.from_list(rows).save_to_disk(str(sources["saved"]))
    data_dir = tmp_path / "data"
    for name, path in sources.items():
        main(["--local_path", str(path), "--name", name, "--tokenizer", tiny, "--data_dir", str(data_dir)])
    monkeypatch.setattr(build, "load_hub_dataset", lambda name, split: datasets.Dataset.from_list(rows))
    main(["--hf_dataset", "someone/pairs", "--name", "hub", "--tokenizer", tiny, "--data_dir", str(data_dir)])
    entries = registry(data_dir)
    built = {name: datasets.load_from_disk(str(data_dir / e["path"])).to_list() for name, e in entries.items()}
    assert sorted(built) == ["hub", "json", "jsonl", "parquet", "saved"] and len(built["jsonl"]) == 30
    assert all(rows == built["jsonl"] for rows in built.values())
    assert {e["kind"] for e in entries.values()} == {"preference"} and entries["hub"]["source"] == "someone/pairs"


def test_bad_pairs_are_counted_named_and_strict_is_fatal(tmp_path, tiny, logs, capsys):
    good = ROWS[0]
    user, bot = ({"role": r, "content": "cat dog"} for r in ("user", "assistant"))
    lines = [
        json.dumps(good),
        "{broken",  # line 2
        json.dumps({"prompt": [user], "chosen": [bot]}),
        json.dumps({**good, "rejected": good["chosen"]}),
        json.dumps({**good, "chosen": [{"role": "assistant", "content": ""}]}),
        json.dumps({**good, "prompt": [user, bot]}),  # line 6
        json.dumps({"prompt": "reverse: c", "chosen": "at dog", "rejected": " sun"}),  # text: tokens merge
        json.dumps({"chosen": [user, bot], "rejected": [user, {"role": "assistant", "content": "dog cat"}]}),
        json.dumps({"prompt": "reverse: cat dog", "chosen": " dog cat", "rejected": " cat"}),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    data_dir = tmp_path / "data"
    main(["--local_path", str(path), "--name", "bad", "--tokenizer", tiny, "--data_dir", str(data_dir)])
    entry = registry(data_dir)["bad"]
    assert entry["num_samples"] == 3 and entry["stats"]["records_read"] == 9
    assert entry["stats"]["formats"] == {"conversational": 1, "implicit_prompt": 1, "text": 2}
    assert entry["stats"]["skipped"] == {
        "malformed_json": 1, "missing_fields": 1, "identical_chosen_rejected": 1, "empty_completion": 1,
        "prompt_not_user_turn": 1, "prompt_not_prefix": 1,
    }  # fmt: skip
    text = "\n".join(logs)
    assert "skipped 1 record(s): prompt_not_prefix" in text and f"    {path}:7: the prompt's tokens" in text
    assert f"{path}:6: the prompt ends with a assistant message" in text and "built bad: 3 pairs" in text
    before = (data_dir / "data_config.json").read_text()
    with pytest.raises(SystemExit) as exit_info:
        main(["--local_path", str(path), "--name", "strict", "--tokenizer", tiny, "--data_dir", str(data_dir),
              "--strict"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and f"{path}:2: malformed_json" in err
    assert (data_dir / "data_config.json").read_text() == before and not (data_dir / "built_dataset/strict").exists()


def test_length_policies_cut_completions_only(tmp_path, tiny, logs):
    data_dir = tmp_path / "data"
    argv = ["--local_path", str(SAMPLE), "--tokenizer", tiny, "--data_dir", str(data_dir)]
    main([*argv, "--name", "full"])
    full = datasets.load_from_disk(str(data_dir / "built_dataset/full"))
    prompts, chosen, rejected = full["prompt_length"][:], full["chosen_length"][:], full["rejected_length"][:]
    limit = sorted(p + max(c, r) for p, c, r in zip(prompts, chosen, rejected))[150]
    over = [i for i in range(200) if prompts[i] + max(chosen[i], rejected[i]) > limit]
    no_room = [i for i in over if prompts[i] >= limit]
    room = {i: limit - prompts[i] for i in over}
    same = [i for i in over if i not in no_room and full[i]["chosen_input_ids"][: room[i]] ==
            full[i]["rejected_input_ids"][: room[i]]]  # fmt: skip
    assert len(over) > len(no_room) + len(same) > len(no_room) > 0 and same  # every case is in the sample
    main([*argv, "--name", "cut", "--max_seq_length", str(limit)])
    main([*argv, "--name", "drop", "--max_seq_length", str(limit), "--overlength", "drop"])
    entries = registry(data_dir)
    cut_stats, drop_stats = entries["cut"]["stats"], entries["drop"]["stats"]
    assert (cut_stats["dropped_prompt_too_long"], cut_stats["dropped_identical_truncated"]) == (len(no_room), len(same))
    assert cut_stats["truncated"] == len(over) - len(no_room) - len(same) and cut_stats["max_tokens"] == limit
    assert drop_stats["dropped_overlength"] == len(over) and entries["drop"]["num_samples"] == 200 - len(over)
    cut = datasets.load_from_disk(str(data_dir / "built_dataset/cut"))
    kept = [i for i in range(200) if i not in no_room and i not in same]
    assert len(cut) == len(kept)
    for row, i in zip(cut, kept):
        assert row["prompt_input_ids"] == full[i]["prompt_input_ids"]  # the prompt is never cut
        for side in ("chosen", "rejected"):
            ids = row[f"{side}_input_ids"]
            assert ids == full[i][f"{side}_input_ids"][: len(ids)] and row["prompt_length"] + len(ids) <= limit
    cut_one = next(i for i in over if i in kept)
    named = (f"pair #{kept.index(cut_one)}, {SAMPLE}:{cut_one + 1}: prompt {prompts[cut_one]} + chosen "
             f"{chosen[cut_one]} / rejected {rejected[cut_one]} tokens")
    assert cut_stats["overlength_examples"]["truncated"][0] == named
    assert cut_stats["overlength_examples"]["dropped_prompt_too_long"][0].startswith(f"{SAMPLE}:{no_room[0] + 1}: ")
    text = "\n".join(logs)
    assert f"dropped_prompt_too_long: {len(no_room)} pair(s) whose prompt alone" in text
    assert f"dropped_identical_truncated: {len(same)} pair(s) whose chosen and rejected were the same" in text


def test_kind_flag_overrides_detection(tmp_path, tiny, capsys):
    data_dir = str(tmp_path / "data")
    chats = REPO / "data" / "sample_chat.jsonl"
    for source, kind, message in ((SAMPLE, "sft", "no usable conversations"), (chats, "preference", "no usable pairs")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--local_path", str(source), "--name", "x", "--tokenizer", tiny, "--data_dir", data_dir, "--kind", kind,
                  "-n", "5"])  # fmt: skip
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--local_path", str(SAMPLE), "--name", "x", "--tokenizer", tiny, "--data_dir", data_dir, "--kind", "dpo"])
    assert exit_info.value.code == 2 and "--kind" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--local_path", str(SAMPLE), "--name", "x", "--tokenizer", tiny, "--data_dir", data_dir, "--format",
              "sharegpt"])  # fmt: skip
    assert exit_info.value.code == 2 and "--format sharegpt applies to chats" in capsys.readouterr().err
    assert not (tmp_path / "data" / "data_config.json").exists()


# slow tier (make test-slow; CI runs it): tokenising processes, ~14 s
@pytest.mark.slow
def test_two_tokenising_processes_give_the_same_pairs(tmp_path, tiny):
    import runpy

    generate = runpy.run_path(str(REPO / "scripts" / "make_sample_data.py"), run_name="gen")["generate_preference"]
    src = str(write_jsonl(tmp_path / "p.jsonl", generate(1000, 1)))
    data_dir = tmp_path / "data"
    for name, num_proc in (("p1", "1"), ("p2", "2")):
        main(["--local_path", src, "--name", name, "--tokenizer", tiny, "--data_dir", str(data_dir), "--num_proc", num_proc])
    one, two = (datasets.load_from_disk(str(data_dir / f"built_dataset/{n}")) for n in ("p1", "p2"))
    assert len(two) == 1000 and one.to_list() == two.to_list()


def test_text_pairs_need_no_chat_template_but_chat_pairs_do(tmp_path, capsys):
    plain = build_tiny_tokenizer(["the sky is blue, not green", "cat dog"], vocab_size=300)
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "plain")
    data_dir = tmp_path / "data"
    text = write_jsonl(tmp_path / "t.jsonl", [{"chosen": "the sky is blue", "rejected": "the sky is green"}])
    main(["--local_path", str(text), "--name", "t", "--tokenizer", str(tmp_path / "plain"), "--data_dir", str(data_dir)])
    row = datasets.load_from_disk(str(data_dir / "built_dataset/t"))[0]
    assert plain.decode(row["prompt_input_ids"]) == "the sky is"
    assert plain.decode(row["chosen_input_ids"]) == " blue<|im_end|>" and registry(data_dir)["t"]["stats"]["formats"] == {
        "implicit_text": 1}
    with pytest.raises(SystemExit) as exit_info:
        main(["--local_path", str(SAMPLE), "--name", "c", "--tokenizer", str(tmp_path / "plain"),
              "--data_dir", str(data_dir)])  # fmt: skip
    assert exit_info.value.code == 2 and "no chat template and the pairs are chat messages" in capsys.readouterr().err
