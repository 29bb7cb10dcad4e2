"""Any chat dataset -> OpenAI-style ``messages``.

Three input formats are understood, and every record is normalised to
``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` before a chat template sees it:

- ShareGPT: ``conversations`` (or ``conversation``) with ``from``/``value`` and roles
  ``human``/``gpt``/``system``;
- OpenAI messages: ``messages`` with ``role``/``content``;
- Alpaca: ``instruction`` / optional ``input`` / ``output`` (optional ``system``).

Bad records are never fatal here: ``to_messages`` raises ``RecordError`` with a short ``reason``
(one of ``SKIP_REASONS``) so the builder can count, skip and summarise them (or stop, with
``--strict``). Reading local files lives here too, because a malformed JSON line is a format
problem that must be reported as ``file:line``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tqdm.auto import tqdm

Format = Literal["auto", "sharegpt", "openai", "alpaca"]
FORMATS: tuple[str, ...] = ("auto", "sharegpt", "openai", "alpaca")
LOCAL_SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet")

#: Every reason a record can be skipped for, in the order the summary lists them.
SKIP_REASONS: tuple[str, ...] = (
    "malformed_json",
    "not_an_object",
    "missing_fields",
    "empty_conversation",
    "unknown_role",
    "non_string_content",
    "no_assistant_turn",
    "template_error",
    "content_not_in_render",
    "history_rewritten",
)

# ShareGPT speaker names (and their OpenAI spellings, which ShareGPT dumps often mix in).
ROLE_ALIASES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
Message = dict[str, str]


class DataInputError(Exception):
    """A user mistake (bad path, bad flag, unusable tokenizer...): the CLI prints it and exits 2."""


class RecordError(ValueError):
    """One record cannot be used; ``reason`` is one of ``SKIP_REASONS``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class RawRecord:
    """One input record and where it came from (``file:line`` or ``record #i``).

    ``error`` is set instead of ``record`` when the line could not even be parsed.
    """

    location: str
    record: Any = None
    error: RecordError | None = None


def detect_format(record: dict[str, Any]) -> str:
    """The format a record is in, from its keys; RecordError('missing_fields') if none fits."""
    if "messages" in record:
        return "openai"
    if "conversations" in record or "conversation" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    keys = ", ".join(sorted(map(str, record))) or "none"
    raise RecordError(
        "missing_fields",
        f"no 'messages', 'conversations' or 'instruction'+'output' field (keys: {keys})",
    )


def to_messages(record: Any, fmt: str = "auto") -> list[Message]:
    """Normalise one record to validated ``messages``; RecordError says why it cannot be.

    ``fmt='auto'`` detects the format per record, so a file mixing formats still works.
    """
    if not isinstance(record, dict):
        raise RecordError("not_an_object", f"expected a JSON object, got {type(record).__name__}")
    if fmt == "auto":
        fmt = detect_format(record)
    if fmt == "alpaca":
        messages = _alpaca_messages(record)
    elif fmt in ("openai", "sharegpt"):
        messages = [to_message(turn, i) for i, turn in enumerate(_turns(record, fmt))]
    else:
        raise DataInputError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no_assistant_turn", "no assistant/gpt message to train on")
    return messages


def trim_trailing_turns(messages: list[Message]) -> tuple[list[Message], int]:
    """``messages`` up to and including the last assistant message, and how many were cut after it.

    Nothing after the last reply can be trained, and a trailing user turn would make templates that
    rewrite history (Qwen3's) render every reply as past history, without its reasoning.
    """
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages) - 1)
    return messages[: last + 1], len(messages) - last - 1


def _turns(record: dict[str, Any], fmt: str) -> list[Any]:
    keys = ("messages",) if fmt == "openai" else ("conversations", "conversation")
    key = next((k for k in keys if k in record), None)
    if key is None:
        raise RecordError("missing_fields", f"no {' or '.join(map(repr, keys))} field")
    turns = record[key]
    if turns is None or (isinstance(turns, (list, tuple)) and len(turns) == 0):
        raise RecordError("empty_conversation", f"{key!r} is empty")
    if not isinstance(turns, (list, tuple)):
        raise RecordError("missing_fields", f"{key!r} is a {type(turns).__name__}, not a list")
    return list(turns)


def to_message(turn: Any, index: int) -> Message:
    """One turn, in either spelling (role/content or from/value), checked and normalised."""
    if not isinstance(turn, dict):
        raise RecordError("missing_fields", f"turn {index} is a {type(turn).__name__}, not an object")
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if role is None or ("content" not in turn and "value" not in turn):
        raise RecordError("missing_fields", f"turn {index} needs role/content (or from/value)")
    if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
        known = ", ".join(sorted(ROLE_ALIASES))
        raise RecordError("unknown_role", f"turn {index} has role {role!r} (known: {known})")
    if not isinstance(content, str):
        raise RecordError(
            "non_string_content", f"turn {index} content is {type(content).__name__}, not a string"
        )
    return {"role": ROLE_ALIASES[role.lower()], "content": content}


def _alpaca_messages(record: dict[str, Any]) -> list[Message]:
    for key in ("instruction", "output"):
        if key not in record:
            raise RecordError("missing_fields", f"alpaca record without {key!r}")
    fields = {k: record.get(k) for k in ("system", "instruction", "input", "output")}
    for key, value in fields.items():
        if value is not None and not isinstance(value, str):
            raise RecordError("non_string_content", f"{key!r} is {type(value).__name__}, not a string")
    if not fields["instruction"] and not fields["output"]:
        raise RecordError("empty_conversation", "empty 'instruction' and 'output'")
    # The usual Alpaca prompt joins instruction and input with a blank line.
    prompt = "\n\n".join(p for p in (fields["instruction"], fields["input"]) if p)
    messages = [{"role": "system", "content": fields["system"]}] if fields["system"] else []
    return messages + [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": fields["output"]},
    ]


# ---------------------------------------------------------------------------------------------
# Local files
# ---------------------------------------------------------------------------------------------
def read_local(path: str | Path, split: str = "train") -> list[RawRecord] | Any:
    """Read a local ``.jsonl`` / ``.json`` / ``.parquet`` file or a saved HF dataset folder.

    JSON files come back as a list of ``RawRecord`` (each knows its ``file:line``; malformed lines
    carry an error instead of a record). Parquet files and saved folders come back as a
    ``datasets.Dataset``. DataInputError for a missing path or an unsupported file.
    """
    path = Path(path)
    if not path.exists():
        raise DataInputError(f"--local_path {path} does not exist")
    if path.is_dir():
        return _read_saved_folder(path, split)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return list(_read_json_lines(path))
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DataInputError(
        f"--local_path {path}: unsupported file type {suffix!r}; use .jsonl, .json, .parquet "
        "or a folder written by datasets' save_to_disk"
    )


def _read_json_lines(path: Path) -> Iterator[RawRecord]:
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        for lineno, line in enumerate(tqdm(handle, desc=f"Reading {path.name}", unit=" lines"), 1):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) are not records
            location = f"{path}:{lineno}"
            try:
                yield RawRecord(location, json.loads(line))
            except json.JSONDecodeError as err:
                yield RawRecord(location, error=RecordError("malformed_json", err.msg + f" (column {err.colno})"))


def _read_parquet(path: Path) -> Any:
    """A ``.parquet`` file as a ``datasets.Dataset``; one DataInputError line when it is empty or not parquet
    (pyarrow's own error is a 50-line traceback through datasets' builder)."""
    import datasets
    import pyarrow

    if path.stat().st_size == 0:
        raise DataInputError(f"{path} holds no records (it is empty, 0 bytes): nothing to build")
    try:
        return datasets.Dataset.from_parquet(str(path))
    except (pyarrow.ArrowException, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataInputError(f"{path} is not a readable parquet file ({first})") from None


def _read_json(path: Path) -> list[RawRecord]:
    """A ``.json`` file: a list of records, ``{"data"|split: [...]}``, or JSON lines misnamed."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise DataInputError(f"{path} holds no records (it is empty): nothing to build")
    try:
        content = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # one object per line saved as .json: read it as JSON lines
            return list(_read_json_lines(path))
        raise DataInputError(f"{path}:{err.lineno}: malformed JSON ({err.msg}, column {err.colno})") from None
    if isinstance(content, dict):
        lists = [v for k, v in content.items() if isinstance(v, list) and k in ("data", "train", "rows")]
        if len(lists) != 1:
            raise DataInputError(
                f"{path}: expected a JSON list of records (or {{'data': [...]}}), got an object "
                f"with keys {sorted(content)[:8]}"
            )
        content = lists[0]
    if not isinstance(content, list):
        raise DataInputError(f"{path}: expected a JSON list of records, got {type(content).__name__}")
    return [RawRecord(f"{path} record #{i}", record) for i, record in enumerate(content)]


def _read_saved_folder(path: Path, split: str) -> Any:
    import datasets

    if not any((path / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise DataInputError(
            f"--local_path {path} is a folder but not a saved Hugging Face dataset "
            "(no dataset_dict.json/state.json); pass a .jsonl/.json/.parquet file instead"
        )
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataInputError(f"{path} has splits {sorted(loaded)}, not {split!r}: pass --split")
        loaded = loaded[split]
    return loaded
