"""Chat formats -> messages, per-reason record errors, and reading local files."""

from __future__ import annotations

import json

import datasets
import pytest

from HyperSloth.data import formats
from HyperSloth.data.formats import DataInputError, RecordError, detect_format, to_messages

EXPECTED = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
]


def test_sharegpt_openai_and_alpaca_normalise_to_the_same_messages():
    sharegpt = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                                  {"from": "gpt", "value": "hello"}]}  # fmt: skip
    singular = {"conversation": sharegpt["conversations"]}
    openai = {"messages": EXPECTED, "id": 7}
    alpaca = {"system": "be brief", "instruction": "hi", "input": "", "output": "hello"}
    for record, fmt in ((sharegpt, "sharegpt"), (singular, "sharegpt"), (openai, "openai"), (alpaca, "alpaca")):
        assert detect_format(record) == fmt
        assert to_messages(record) == EXPECTED
        assert to_messages(record, fmt) == EXPECTED


def test_alpaca_joins_instruction_and_input():
    record = {"instruction": "translate", "input": "bonjour", "output": "hello"}
    assert to_messages(record) == [
        {"role": "user", "content": "translate\n\nbonjour"},
        {"role": "assistant", "content": "hello"},
    ]


def test_role_case_and_mixed_spellings_are_accepted():
    record = {"messages": [{"from": "Human", "value": "hi"}, {"role": "GPT", "content": "yo"}]}
    assert to_messages(record) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ([1, 2], "not_an_object"),
        ({"text": "no chat here"}, "missing_fields"),
        ({"messages": [{"role": "user"}]}, "missing_fields"),
        ({"messages": ["hi"]}, "missing_fields"),
        ({"messages": "hi"}, "missing_fields"),
        ({"instruction": "x"}, "missing_fields"),
        ({"messages": []}, "empty_conversation"),
        ({"conversations": None}, "empty_conversation"),
        ({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}, "non_string_content"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]}, "non_string_content"),
        ({"instruction": "x", "output": ["y"]}, "non_string_content"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no_assistant_turn"),
        ({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "x"}]}, "no_assistant_turn"),
    ],
)
def test_bad_records_raise_with_their_reason(record, reason):
    with pytest.raises(RecordError) as err:
        to_messages(record)
    assert err.value.reason == reason
    assert reason in formats.SKIP_REASONS


def test_trailing_turns_after_the_last_reply_are_cut_and_counted():
    question = {"role": "user", "content": "and then?"}
    assert formats.trim_trailing_turns(EXPECTED) == (EXPECTED, 0)
    assert formats.trim_trailing_turns([*EXPECTED, question]) == (EXPECTED, 1)
    assert formats.trim_trailing_turns([*EXPECTED, question, {"role": "system", "content": "x"}]) == (EXPECTED, 2)


def test_forced_format_that_does_not_fit_is_missing_fields():
    with pytest.raises(RecordError) as err:
        to_messages({"messages": EXPECTED}, "sharegpt")
    assert err.value.reason == "missing_fields"
    with pytest.raises(DataInputError):
        to_messages({"messages": EXPECTED}, "xml")


def test_jsonl_malformed_lines_carry_file_and_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": EXPECTED}) + "\n\n{not json\n" + json.dumps({"a": 1}) + "\n")
    records = formats.read_local(path)
    assert [r.location for r in records] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert records[0].record == {"messages": EXPECTED} and records[0].error is None
    assert records[1].error.reason == "malformed_json" and records[1].record is None


def test_json_list_object_and_misnamed_jsonl(tmp_path):
    rows = [{"messages": EXPECTED}, {"instruction": "a", "output": "b"}]
    as_list, as_obj, as_lines = tmp_path / "l.json", tmp_path / "o.json", tmp_path / "j.json"
    as_list.write_text(json.dumps(rows))
    as_obj.write_text(json.dumps({"data": rows}))
    as_lines.write_text("\n".join(map(json.dumps, rows)))
    for path in (as_list, as_obj, as_lines):
        assert [r.record for r in formats.read_local(path)] == rows
    bad = tmp_path / "bad.json"
    bad.write_text('[{"messages": ]')
    with pytest.raises(DataInputError, match=r"bad\.json:1: malformed JSON"):
        formats.read_local(bad)


def test_parquet_and_saved_folder(tmp_path):
    ds = datasets.Dataset.from_list([{"messages": EXPECTED}] * 3)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert formats.read_local(tmp_path / "d.parquet").to_list() == [{"messages": EXPECTED}] * 3
    assert len(formats.read_local(tmp_path / "saved")) == 3
    assert len(formats.read_local(tmp_path / "dict", split="test")) == 1
    with pytest.raises(DataInputError, match="splits"):
        formats.read_local(tmp_path / "dict", split="validation")


def test_missing_and_unsupported_paths_are_user_errors(tmp_path):
    with pytest.raises(DataInputError, match="does not exist"):
        formats.read_local(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataInputError, match="unsupported file type"):
        formats.read_local(tmp_path / "d.csv")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataInputError, match="not a saved Hugging Face dataset"):
        formats.read_local(tmp_path / "folder")


def test_garbage_or_empty_parquet_is_one_line(tmp_path):
    garbage, empty = tmp_path / "bin.parquet", tmp_path / "empty.parquet"
    garbage.write_bytes(bytes(range(256)) * 8)
    empty.write_bytes(b"")
    with pytest.raises(DataInputError, match=r"bin\.parquet is not a readable parquet file \(.*magic bytes"):
        formats.read_local(garbage)
    with pytest.raises(DataInputError, match=r"empty\.parquet holds no records \(it is empty"):
        formats.read_local(empty)


def test_an_empty_json_file_says_empty_as_an_empty_list_does(tmp_path):
    for text in ("", "  \n"):
        (tmp_path / "e.json").write_text(text)
        with pytest.raises(DataInputError, match=r"e\.json holds no records \(it is empty\)"):
            formats.read_local(tmp_path / "e.json")
