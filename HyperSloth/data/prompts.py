"""Prompt rows (for GRPO) -> prompt token ids, with every other column kept for the reward functions.

A row has a ``prompt``: text, or chat messages ending with a user turn (TRL's GRPO data). Its tokens are
what TRL's GRPOTrainer (1.15, ``_tokenize_prompts``) generates from: chat messages rendered with the
generation prompt (``apply_chat_template(add_generation_prompt=True)``, the template's own special
tokens), text tokenised with the tokenizer's special tokens (a BOS where it adds one).

Every other column (``answer``, ``solution``, ...) is kept as it was read and handed to the reward
functions by name, as TRL does: ``f(prompts, completions, answer=[...], ...)``. They are stored as one
JSON text per row (``columns_json``), so a column whose values differ in type from row to row survives the
Arrow table; the prompt itself as ``prompt_json`` (text or messages, what the reward functions receive).

A prompt longer than ``max_seq_length`` tokens is dropped (``dropped_prompt_too_long``): a completion must
follow it, and cutting the question would change what the rewards judge. Stored columns: ``COLUMNS``;
``length`` is the prompt's tokens (the run adds ``max_completion_length``, a training setting), and
``num_trainable`` 1: a prompt is one scored unit (its group's rewards; an eval set counts prompts).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import datasets
import numpy as np

from HyperSloth.data import formats, masking, records
from HyperSloth.data.formats import DataInputError, RawRecord, RecordError
from HyperSloth.data.records import SHOW_EXAMPLES, Collected
from HyperSloth.data.summary import length_stats

PROMPT_KIND = "prompt"
COLUMNS: tuple[str, ...] = ("prompt_input_ids", "prompt_length", "length", "num_trainable", "prompt_json",
                            "columns_json")
#: Every reason a prompt row is skipped for, in the order the summary lists them.
PROMPT_SKIP_REASONS: tuple[str, ...] = ("malformed_json", "not_an_object", "missing_fields", "unknown_role",
                                        "non_string_content", "empty_prompt", "prompt_not_user_turn",
                                        "template_error")
#: Columns that make a row a chat or a completion to imitate, not a prompt to answer.
ANSWERED = ("messages", "conversations", "completion", "chosen", "rejected", "response", "output")


def looks_like_prompt(record: Any) -> bool:
    """A record with a ``prompt`` and nothing that answers it (no messages, completion, chosen, ...)."""
    return isinstance(record, dict) and "prompt" in record and not any(k in record for k in ANSWERED)


def detect_prompts(raw: list[RawRecord] | datasets.Dataset, sample: int = 100) -> bool:
    """True when the source holds prompt rows (a table's columns, or most of the first ``sample`` objects)."""
    if isinstance(raw, datasets.Dataset):
        columns = set(raw.column_names)
        return "prompt" in columns and not columns & set(ANSWERED)
    objects = [r for r in records.first_records(raw, sample) if isinstance(r, dict)]
    return bool(objects) and 2 * sum(map(looks_like_prompt, objects)) > len(objects)


def to_prompt(record: Any) -> tuple[tuple[Any, dict[str, Any]], str, bool]:
    """``records.collect``'s normalise: ((prompt, other columns), shape, False); RecordError says why not."""
    if not isinstance(record, dict):
        raise RecordError("not_an_object", f"expected a JSON object, got {type(record).__name__}")
    prompt = record.get("prompt")
    if prompt is None:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise RecordError("missing_fields", f"no 'prompt' field (keys: {keys})")
    columns = {str(k): v for k, v in record.items() if k != "prompt"}
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RecordError("empty_prompt", "the prompt is empty")
        return (prompt, columns), "text", False
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise RecordError("non_string_content", f"'prompt' is {type(prompt).__name__}, not text or chat messages")
    messages = [formats.to_message(turn, i) for i, turn in enumerate(prompt)]
    if messages[-1]["role"] != "user":
        raise RecordError("prompt_not_user_turn", f"the prompt ends with a {messages[-1]['role']} message, not a "
                          "user turn")
    return (messages, columns), "conversational", False


def collect_prompts(raw: list[RawRecord] | datasets.Dataset, *, n: int | None, seed: int, strict: bool) -> Collected:
    """Normalise prompt rows in order (or a seeded sample of ``n``), counting every skipped row by reason."""
    return records.collect(raw, to_prompt, n=n, seed=seed, strict=strict, reasons=PROMPT_SKIP_REASONS,
                           unit=" prompt")


def prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """The prompt's token ids as TRL's GRPOTrainer makes them (module docstring)."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise DataInputError("the prompts are chat messages but the tokenizer has no chat template: pass "
                             "--chat_template FILE.jinja")
    text = masking.render(tokenizer, prompt, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_dataset(collected: Collected, tok: Any, *, max_seq_length: int, strict: bool
                   ) -> tuple[datasets.Dataset, Counter]:
    """Tokenise every prompt; the kept rows (``COLUMNS`` + ``location``) and the rows' status counts."""
    rows: dict[str, list] = {key: [] for key in (*COLUMNS, "location")}
    statuses: Counter = Counter()
    for (prompt, columns), location in zip(collected.items, collected.locations):
        try:
            ids = prompt_ids(tok, prompt)
        except DataInputError:
            raise
        except Exception as err:  # a template raises anything (raise_exception, TypeError, ...)
            collected.skip(location, RecordError("template_error", f"{type(err).__name__}: {err}"), strict)
            statuses["template_error"] += 1
            continue
        if len(ids) > max_seq_length:
            statuses["dropped_prompt_too_long"] += 1
            named = collected.overlength.setdefault("dropped_prompt_too_long", [])
            if len(named) < SHOW_EXAMPLES:
                named.append(f"{location}: prompt {len(ids)} tokens")
            continue
        statuses["ok"] += 1
        values = (ids, len(ids), len(ids), 1, json.dumps(prompt), json.dumps(columns, default=str), location)
        for key, value in zip(rows, values):
            rows[key].append(value)
    return datasets.Dataset.from_dict(rows), statuses


def compute_stats(kept: datasets.Dataset, collected: Collected, statuses: Counter) -> dict[str, Any]:
    """Token statistics of the built prompts and every count the summary reports (``max_tokens``: the
    longest prompt, which the run checks against max_seq_length - max_completion_length)."""
    lengths = np.asarray(kept["prompt_length"][:], dtype=np.int64)
    return {
        "total_tokens": int(lengths.sum()),
        **length_stats(lengths),
        "reward_columns": sorted({k for row in kept["columns_json"][:] for k in json.loads(row)}),
        "dropped_prompt_too_long": statuses["dropped_prompt_too_long"],
        "overlength_examples": {k: v for k, v in collected.overlength.items() if v},
        "skipped": dict(sorted(collected.skipped.items())),
        "records_read": collected.records_read,
        "formats": dict(collected.formats),
    }


def show_prompts(kept: datasets.Dataset, tok: Any, count: int, *, color: bool) -> None:
    """Print the first ``count`` prompts as the model sees them, and the columns the rewards receive."""
    for i in range(min(count, len(kept))):
        row = kept[i]
        print(f"--- prompt {i} from {row['location']}: {row['prompt_length']} tokens; reward columns "
              f"{row['columns_json']} ---")
        print(tok.decode(row["prompt_input_ids"]))


def reward_inputs(rows: dict[str, list]) -> tuple[list[Any], list[dict[str, Any]]]:
    """(prompts, other columns) of built rows (``prompt_json``, ``columns_json``), decoded for the rewards."""
    return [json.loads(p) for p in rows["prompt_json"]], [json.loads(c) for c in rows["columns_json"]]
