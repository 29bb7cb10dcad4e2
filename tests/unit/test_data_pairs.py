"""Preference rows -> pairs: every accepted shape (checked against TRL's own prompt extraction), every
bad-row reason, and telling a preference source from a chat source."""

from __future__ import annotations

import datasets
import pytest
from trl.data_utils import extract_prompt

from HyperSloth.data.formats import RawRecord, RecordError
from HyperSloth.data.pairs import PAIR_SKIP_REASONS, Pair, collect_pairs, detect_kind, to_pair


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def bot(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "be brief"}


def test_explicit_conversational_pair_is_taken_as_given():
    row = {"prompt": [SYSTEM, user("reverse: a b")], "chosen": [bot("b a")], "rejected": [bot("a b")]}
    pair, shape = to_pair(row)
    assert shape == "conversational" and pair.conversational
    assert pair == Pair([SYSTEM, user("reverse: a b")], [bot("b a")], [bot("a b")])


def test_sharegpt_spelling_and_string_sides_become_messages():
    row = {"prompt": "reverse: a b", "chosen": [{"from": "gpt", "value": "b a"}], "rejected": "a b"}
    pair, shape = to_pair(row)
    assert shape == "conversational"
    assert pair == Pair([user("reverse: a b")], [bot("b a")], [bot("a b")])
    pair, _ = to_pair({"prompt": [user("q")], "chosen": "yes", "rejected": "no"})
    assert pair == Pair([user("q")], [bot("yes")], [bot("no")])


@pytest.mark.parametrize(
    "chosen, rejected",
    [
        ([user("q"), bot("yes")], [user("q"), bot("no")]),
        ([SYSTEM, user("q1"), bot("a1"), user("q2"), bot("yes")], [SYSTEM, user("q1"), bot("a1"), user("q2"), bot("no")]),
        ([user("q"), bot("yes"), bot("and more")], [user("q"), bot("no")]),
    ],
)
def test_implicit_prompt_is_the_shared_opening_as_trl_extracts_it(chosen, rejected):
    pair, shape = to_pair({"chosen": chosen, "rejected": rejected})
    expected = extract_prompt({"chosen": chosen, "rejected": rejected})
    assert shape == "implicit_prompt"
    assert (pair.prompt, pair.chosen, pair.rejected) == (expected["prompt"], expected["chosen"], expected["rejected"])


def test_a_string_prompt_beside_whole_conversations_is_not_used():
    # HuggingFaceH4/ultrafeedback_binarized: the prompt repeats the first user turn of chosen and rejected.
    row = {"prompt": "q", "chosen": [user("q"), bot("yes")], "rejected": [user("q"), bot("no")]}
    assert to_pair(row) == (Pair([user("q")], [bot("yes")], [bot("no")]), "implicit_prompt")


def test_text_pairs_explicit_and_implicit_as_trl():
    assert to_pair({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}) == (
        Pair("The sky is", " blue.", " green."), "text")
    row = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    pair, shape = to_pair(row)
    assert shape == "implicit_text" and (pair.prompt, pair.chosen, pair.rejected) == tuple(extract_prompt(row).values())
    assert pair == Pair("The sky is", " blue.", " green.")  # the space goes to the completions


@pytest.mark.parametrize(
    "row, reason, detail",
    [
        ([1, 2], "not_an_object", "got list"),
        ({"prompt": "q", "chosen": "a"}, "missing_fields", "'rejected'"),
        ({"prompt": "q", "chosen": None, "rejected": "b"}, "missing_fields", "'chosen'"),
        ({"chosen": [bot("a")], "rejected": [bot("b")]}, "missing_fields", "no 'prompt'"),
        ({"question": "q", "chosen": "The sky is blue.", "rejected": "The sea."}, "missing_fields",
         "but a 'question' one: rename"),
        ({"prompt": "q", "chosen": {"text": "a"}, "rejected": "b"}, "non_string_content", "'chosen' is dict"),
        ({"prompt": "q", "chosen": [bot("a")], "rejected": [{"role": "robot", "content": "b"}]}, "unknown_role",
         "'rejected': turn 0 has role 'robot'"),
        ({"prompt": [user("q")], "chosen": [{"role": "assistant", "content": 3}], "rejected": "b"},
         "non_string_content", "'chosen': turn 0"),
        ({"prompt": "q", "chosen": [user("q"), bot("a")], "rejected": [bot("b")]}, "mixed_shapes", "whole conversation"),
        ({"prompt": "  ", "chosen": "a", "rejected": "b"}, "empty_prompt", "empty"),
        ({"prompt": [], "chosen": [bot("a")], "rejected": [bot("b")]}, "empty_prompt", "no prompt messages"),
        ({"prompt": [user("q"), bot("a")], "chosen": [bot("b")], "rejected": [bot("c")]}, "prompt_not_user_turn",
         "ends with a assistant message"),
        ({"chosen": [user("q"), bot("a"), user("more")], "rejected": [user("q"), bot("b"), user("more")]},
         "completion_not_assistant", "chosen holds user message(s)"),
        ({"prompt": [user("q")], "chosen": [bot(" ")], "rejected": [bot("b")]}, "empty_completion", "chosen is empty"),
        ({"prompt": "q", "chosen": "a", "rejected": ""}, "empty_completion", "rejected is empty"),
        ({"chosen": [user("q"), bot("a")], "rejected": [user("q"), bot("a"), bot("more")]}, "empty_completion",
         "chosen is empty"),
        ({"prompt": "q", "chosen": "same", "rejected": "same"}, "identical_chosen_rejected", "the same"),
        ({"chosen": [user("q"), bot("a")], "rejected": [user("q"), bot("a")]}, "identical_chosen_rejected",
         "same conversation"),
    ],
)
def test_bad_rows_name_their_reason(row, reason, detail):
    with pytest.raises(RecordError) as info:
        to_pair(row)
    assert info.value.reason == reason and reason in PAIR_SKIP_REASONS
    assert detail in info.value.detail


def test_pair_survives_the_json_round_trip_of_the_tokenising_table():
    for pair in (Pair([user("q")], [bot("a")], [bot("b")]), Pair("q", " a", " b")):
        assert Pair.from_json(pair.to_json()) == pair


def test_detect_kind_from_records_and_tables():
    pair = {"prompt": "q", "chosen": "a", "rejected": "b"}
    chat = {"messages": [user("q"), bot("a")]}
    as_records = lambda rows: [RawRecord(f"f:{i}", row) for i, row in enumerate(rows)]  # noqa: E731
    assert detect_kind(as_records([pair] * 3 + [chat])) == "preference"
    assert detect_kind(as_records([chat] * 3 + [pair])) == "sft"
    assert detect_kind([RawRecord("f:0", error=RecordError("malformed_json", "x"))]) == "sft"
    assert detect_kind(datasets.Dataset.from_list([pair, pair])) == "preference"
    assert detect_kind(datasets.Dataset.from_list([chat])) == "sft"


def test_collect_counts_shapes_and_reasons_in_order():
    rows = [
        {"prompt": "q", "chosen": "a", "rejected": "b"},
        {"prompt": [user("q")], "chosen": [bot("a")], "rejected": [bot("b")]},
        {"prompt": "q", "chosen": "a", "rejected": "a"},
        "not a pair",
    ]
    records = [RawRecord(f"f.jsonl:{i + 1}", row) for i, row in enumerate(rows)]
    records.append(RawRecord("f.jsonl:5", error=RecordError("malformed_json", "Expecting value")))
    collected = collect_pairs(records, n=None, seed=0, strict=False)
    assert collected.formats == {"text": 1, "conversational": 1} and collected.records_read == 5
    assert collected.skipped == {"identical_chosen_rejected": 1, "not_an_object": 1, "malformed_json": 1}
    assert collected.examples["identical_chosen_rejected"] == ["f.jsonl:3: chosen and rejected are the same"]
    assert collected.reasons == PAIR_SKIP_REASONS and collected.locations == ["f.jsonl:1", "f.jsonl:2"]
