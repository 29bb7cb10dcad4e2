"""Preference rows -> ``Pair`` (prompt, chosen, rejected): the shapes TRL and Hub datasets use.

Accepted shapes, decided per row:

- conversational, explicit prompt: ``prompt`` a list of messages ending with a user turn, ``chosen`` and
  ``rejected`` lists of the assistant message(s) that answer it. A string prompt beside message
  completions is one user message; a string completion beside a message prompt is one assistant message.
- conversational, implicit prompt: ``chosen`` and ``rejected`` are whole conversations (they open with a
  user or system message) sharing their first messages; the shared messages are the prompt, as TRL's
  ``extract_prompt`` does. A ``prompt`` field beside them (HuggingFaceH4/ultrafeedback_binarized has
  one, repeating the user turn) is not used, as in TRL's ``maybe_extract_prompt``.
- text: ``prompt``, ``chosen`` and ``rejected`` strings; without ``prompt``, the longest text prefix the
  two share is the prompt (TRL's rule: a space just before the split goes to the completions).

Bad rows raise ``RecordError`` with one of ``PAIR_SKIP_REASONS``, to be counted and named by the build.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import datasets

from HyperSloth.data import formats, records
from HyperSloth.data.formats import Message, RawRecord, RecordError
from HyperSloth.data.records import Collected

#: Every reason a preference row is skipped for, in the order the summary lists them.
PAIR_SKIP_REASONS: tuple[str, ...] = (
    "malformed_json",
    "not_an_object",
    "missing_fields",
    "unknown_role",
    "non_string_content",
    "mixed_shapes",
    "empty_prompt",
    "prompt_not_user_turn",
    "completion_not_assistant",
    "empty_completion",
    "identical_chosen_rejected",
    "template_error",
    "content_not_in_render",
    "prompt_not_prefix",
)
SHAPES: tuple[str, ...] = ("conversational", "implicit_prompt", "text", "implicit_text")
PROMPT_LIKE: tuple[str, ...] = ("question", "instruction", "input", "query")  # prompt columns by other names
Side = list[Message] | str


@dataclass(frozen=True)
class Pair:
    """One preference pair: chat messages (``conversational``) or plain text, prompt apart."""

    prompt: Side
    chosen: Side
    rejected: Side

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)

    def to_json(self) -> str:
        return json.dumps([self.prompt, self.chosen, self.rejected])

    @classmethod
    def from_json(cls, text: str) -> Pair:
        return cls(*json.loads(text))


def looks_like_pair(record: Any) -> bool:
    """A record with both ``chosen`` and ``rejected`` fields."""
    return isinstance(record, dict) and "chosen" in record and "rejected" in record


def detect_kind(raw: list[RawRecord] | datasets.Dataset, sample: int = 100) -> str:
    """``"preference"`` when the source holds chosen/rejected rows (a table's columns, or most of the
    first ``sample`` JSON objects), else ``"sft"``."""
    if isinstance(raw, datasets.Dataset):
        return "preference" if {"chosen", "rejected"} <= set(raw.column_names) else "sft"
    objects = [r for r in records.first_records(raw, sample) if isinstance(r, dict)]
    pairs = sum(map(looks_like_pair, objects))
    return "preference" if objects and 2 * pairs > len(objects) else "sft"


def collect_pairs(raw: list[RawRecord] | datasets.Dataset, *, n: int | None, seed: int, strict: bool) -> Collected:
    """Normalise preference rows to pairs in order (or a seeded sample of ``n``), counting every skipped
    row by reason; ``formats`` counts the shapes."""
    return records.collect(raw, lambda record: (*to_pair(record), False), n=n, seed=seed, strict=strict,
                           reasons=PAIR_SKIP_REASONS, unit=" pair")  # fmt: skip


def to_pair(record: Any) -> tuple[Pair, str]:
    """The checked pair of one row and its shape (one of ``SHAPES``); RecordError says why not."""
    if not isinstance(record, dict):
        raise RecordError("not_an_object", f"expected a JSON object, got {type(record).__name__}")
    missing = [key for key in ("chosen", "rejected") if record.get(key) is None]
    if missing:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise RecordError("missing_fields", f"no {' or '.join(map(repr, missing))} field (keys: {keys})")
    chosen, rejected = _side(record, "chosen"), _side(record, "rejected")
    whole = [isinstance(side, list) and bool(side) and side[0]["role"] != "assistant" for side in (chosen, rejected)]
    if all(whole):
        pair, shape = _split_conversations(chosen, rejected), "implicit_prompt"
    elif any(whole):
        raise RecordError("mixed_shapes", "one of chosen/rejected is a whole conversation, the other only replies")
    elif record.get("prompt") is not None:
        pair = _explicit(_side(record, "prompt"), chosen, rejected)
        shape = "conversational" if pair.conversational else "text"
    elif isinstance(chosen, str) and isinstance(rejected, str):
        _refuse_prompt_elsewhere(record)
        pair, shape = _split_text(chosen, rejected), "implicit_text"
    else:
        raise RecordError("missing_fields",
                          "no 'prompt' field, and chosen/rejected are replies, not whole conversations")
    _check(pair)
    return pair, shape


def _refuse_prompt_elsewhere(record: dict[str, Any]) -> None:
    """Two answers without a ``prompt``, beside a field that holds one (Intel/orca_dpo_pairs' ``question``):
    their shared text would be taken for the prompt, so say which column to rename instead."""
    elsewhere = [key for key in PROMPT_LIKE if isinstance(record.get(key), str)]
    if elsewhere:
        raise RecordError("missing_fields", f"no 'prompt' field, but a {elsewhere[0]!r} one: rename the column that "
                          "holds the prompt to 'prompt'")  # fmt: skip


def _side(record: dict[str, Any], key: str) -> Side:
    """A field as text or as validated messages."""
    value = record[key]
    if isinstance(value, str):
        return value
    if not isinstance(value, (list, tuple)):
        raise RecordError("non_string_content", f"{key!r} is {type(value).__name__}, not text or a list of messages")
    try:
        return [formats.to_message(turn, i) for i, turn in enumerate(value)]
    except RecordError as err:
        raise RecordError(err.reason, f"{key!r}: {err.detail}") from None


def _explicit(prompt: Side, chosen: Side, rejected: Side) -> Pair:
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        return Pair(prompt, chosen, rejected)
    as_messages = [[{"role": role, "content": side}] if isinstance(side, str) else side
                   for role, side in (("user", prompt), ("assistant", chosen), ("assistant", rejected))]  # fmt: skip
    return Pair(*as_messages)


def _split_conversations(chosen: list[Message], rejected: list[Message]) -> Pair:
    if chosen == rejected:
        raise RecordError("identical_chosen_rejected", "chosen and rejected are the same conversation")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == min(len(chosen), len(rejected)):
        shorter = "chosen" if len(chosen) < len(rejected) else "rejected"
        raise RecordError("empty_completion", f"{shorter} is empty: it is the opening of the other conversation")
    return Pair(chosen[:shared], chosen[shared:], rejected[shared:])


def _split_text(chosen: str, rejected: str) -> Pair:
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared and chosen[shared - 1] == " ":  # TRL's rule: the space starts the completions
        shared -= 1
    return Pair(chosen[:shared], chosen[shared:], rejected[shared:])


def _check(pair: Pair) -> None:
    """The checks every shape shares: a prompt, replies, non-empty and different completions."""
    if pair.conversational:
        if not pair.prompt:
            raise RecordError("empty_prompt", "no prompt messages (chosen and rejected share no opening turn)")
        if pair.prompt[-1]["role"] != "user":
            raise RecordError("prompt_not_user_turn", f"the prompt ends with a {pair.prompt[-1]['role']} message, "
                              "not a user turn")  # fmt: skip
        for name, side in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            others = sorted({m["role"] for m in side} - {"assistant"})
            if others:
                raise RecordError("completion_not_assistant", f"{name} holds {'/'.join(others)} message(s) after "
                                  "the prompt; a completion is assistant replies only")  # fmt: skip
    elif not pair.prompt.strip():
        raise RecordError("empty_prompt", "the prompt is empty")
    for name, side in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        text = "".join(m["content"] for m in side) if isinstance(side, list) else side
        if not text.strip():
            raise RecordError("empty_completion", f"{name} is empty")
    if pair.chosen == pair.rejected:
        raise RecordError("identical_chosen_rejected", "chosen and rejected are the same")
