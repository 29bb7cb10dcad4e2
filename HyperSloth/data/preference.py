"""Preference pairs -> prompt / chosen / rejected token ids, the length policy, and the build's stats.

Tokens are what TRL's DPOTrainer (1.15, ``_prepare_dataset``) computes from the same rows, so a DPO
loss can be checked against TRL's:

- conversational: ``P = render(prompt, add_generation_prompt=True)`` and ``F = render(prompt +
  completion)``, tokenised without added special tokens (as ``apply_chat_template`` does). The
  completion's ids are ``ids(F)`` after ``ids(P)``: its content, the end-of-turn token and anything the
  template writes after it (ChatML's newline). The render goes through
  ``masking.conversation_samples`` (history rewrite ``last``), which also checks that the completion's
  reply is in the render; a template that drops earlier replies' reasoning (Qwen3) drops it from
  ``P`` and ``F`` alike.
- text: ``ids(prompt)`` and ``ids(prompt + completion + eos)`` with the tokenizer's own special tokens
  (a BOS where it adds one); the eos text is not added twice.

``ids(P)`` must be a prefix of ``ids(F)`` for both completions; where it is not (tokens merging across
the boundary, a template rendering the prompt differently when a reply follows) the row is skipped as
``prompt_not_prefix``, never silently shifted (TRL shifts the split to the common prefix and warns).

Length: ``max_seq_length`` bounds each sequence, prompt + chosen and prompt + rejected. ``truncate``
cuts the longer completion(s) to fit and never cuts a prompt: a pair whose prompt leaves no completion
token is dropped (``dropped_prompt_too_long``), as is one whose completions become identical once cut
(``dropped_identical_truncated``). ``drop`` drops every pair over the limit.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np

from HyperSloth.data import masking
from HyperSloth.data.formats import RecordError
from HyperSloth.data.pairs import PAIR_SKIP_REASONS, Pair
from HyperSloth.data.records import SHOW_EXAMPLES, Collected
from HyperSloth.data.summary import length_stats

#: The stored columns (docs/dpo.md): `length` is the pair's packed tokens, prompt counted twice.
COLUMNS: tuple[str, ...] = (
    "prompt_input_ids", "chosen_input_ids", "rejected_input_ids", "length",
    "prompt_length", "chosen_length", "rejected_length", "num_trainable",
)  # fmt: skip
KEPT = ("ok", "truncated")
_IDS = datasets.List(datasets.Value("int64"))
_INT = datasets.Value("int64")
_FEATURES = datasets.Features(
    {
        "prompt_input_ids": _IDS, "chosen_input_ids": _IDS, "rejected_input_ids": _IDS, "length": _INT,
        "prompt_length": _INT, "chosen_length": _INT, "rejected_length": _INT, "num_trainable": _INT,
        "full_lengths": _IDS,  # prompt, chosen, rejected tokens before the length policy (for the summary)
        "status": datasets.Value("string"), "error": datasets.Value("string"), "location": datasets.Value("string"),
    }
)  # fmt: skip


@dataclass(frozen=True)
class EncodedPair:
    """One pair's token ids before the length policy."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def encode_pairs(tokenizer: Any, pairs: list[Pair], specials: list[str]) -> list[EncodedPair | RecordError]:
    """Render and tokenise each pair (one batched tokenizer call per form); a RecordError per bad pair."""
    rendered: list[tuple[str, str, str] | RecordError] = []
    for pair in pairs:
        try:
            rendered.append(_render(tokenizer, pair, specials) if pair.conversational else _text(tokenizer, pair))
        except RecordError as err:
            rendered.append(err)
    ids: dict[int, list[list[int]]] = {}
    for text_form in (False, True):  # chat renders hold their own special tokens; text gets the tokenizer's
        rows = [i for i, (pair, item) in enumerate(zip(pairs, rendered))
                if not isinstance(item, RecordError) and pair.conversational != text_form]  # fmt: skip
        texts = [text for i in rows for text in rendered[i]]
        encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=text_form) if texts else []
        for k, i in enumerate(rows):
            ids[i] = [enc.ids for enc in encodings[3 * k : 3 * k + 3]]
    return [item if isinstance(item, RecordError) else _split(*ids[i]) for i, item in enumerate(rendered)]


def _render(tokenizer: Any, pair: Pair, specials: list[str]) -> tuple[str, str, str]:
    """``P``, ``F(chosen)``, ``F(rejected)`` of a conversational pair (module doc)."""
    try:
        prompt = masking.render(tokenizer, pair.prompt, add_generation_prompt=True)
    except Exception as err:  # a template raises anything (raise_exception, TypeError, ...)
        raise RecordError("template_error", f"{type(err).__name__}: {err}") from None
    fulls = []
    for name, completion in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        full = masking.conversation_samples(tokenizer, [*pair.prompt, *completion], specials, "last")[-1].text
        if not full.startswith(prompt):
            at = next((k for k, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
            raise RecordError("prompt_not_prefix", f"the template renders the prompt differently when {name} "
                              f"follows it (from character {at}: {prompt[at:at + 30]!r} vs {full[at:at + 30]!r})")
        fulls.append(full)
    return prompt, fulls[0], fulls[1]


def _text(tokenizer: Any, pair: Pair) -> tuple[str, str, str]:
    """The text form, as TRL's ``add_eos``: each completion ends with the eos text (added once)."""
    eos = tokenizer.eos_token or ""
    return pair.prompt, *(pair.prompt + c + ("" if c.endswith(eos) else eos) for c in (pair.chosen, pair.rejected))


def _split(prompt: list[int], chosen_full: list[int], rejected_full: list[int]) -> EncodedPair | RecordError:
    """The completions' ids: each full sequence after the prompt's ids, which must be its prefix."""
    n = len(prompt)
    if n == 0:
        return RecordError("empty_prompt", "the prompt has no tokens")
    for name, full in (("chosen", chosen_full), ("rejected", rejected_full)):
        if full[:n] != prompt:
            at = next((k for k, (a, b) in enumerate(zip(prompt, full)) if a != b), min(n, len(full)))
            return RecordError("prompt_not_prefix", f"the prompt's tokens are not a prefix of prompt + {name}'s "
                               f"(they differ at token {at} of {n}: text merging across the boundary?)")
    if chosen_full[n:] == rejected_full[n:]:
        return RecordError("identical_chosen_rejected", "chosen and rejected have the same tokens")
    return EncodedPair(prompt, chosen_full[n:], rejected_full[n:])


class PairEncoder:
    """The ``datasets.map`` function: pairs -> rows after the length policy (a class, so it pickles)."""

    def __init__(self, tokenizer: Any, max_seq_length: int, overlength: str) -> None:
        self.tokenizer = tokenizer
        self.specials = masking.special_token_strings(tokenizer)
        self.max_seq_length = max_seq_length
        self.overlength = overlength

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        encoded = encode_pairs(self.tokenizer, [Pair.from_json(text) for text in batch["pair"]], self.specials)
        out: dict[str, list] = {key: [] for key in _FEATURES}
        for location, item in zip(batch["location"], encoded):
            for key, value in {**self.apply_policy(item), "location": location}.items():
                out[key].append(value)
        return out

    def apply_policy(self, item: EncodedPair | RecordError) -> dict[str, Any]:
        """One output row: the pair after the over-length policy (module doc), with its status."""
        row: dict[str, Any] = {"prompt_input_ids": [], "chosen_input_ids": [], "rejected_input_ids": [], "length": 0,
                               "prompt_length": 0, "chosen_length": 0, "rejected_length": 0, "num_trainable": 0,
                               "full_lengths": [], "status": "ok", "error": ""}  # fmt: skip
        if isinstance(item, RecordError):
            return {**row, "status": item.reason, "error": item.detail}
        prompt, chosen, rejected = item.prompt, item.chosen, item.rejected
        row["full_lengths"] = [len(prompt), len(chosen), len(rejected)]
        room = self.max_seq_length - len(prompt)
        if max(len(chosen), len(rejected)) > room:
            if self.overlength == "drop":
                return {**row, "status": "dropped_overlength"}
            if room < 1:
                return {**row, "status": "dropped_prompt_too_long"}
            chosen, rejected = chosen[:room], rejected[:room]
            if chosen == rejected:
                return {**row, "status": "dropped_identical_truncated"}
            row["status"] = "truncated"
        lengths = {"prompt_length": len(prompt), "chosen_length": len(chosen), "rejected_length": len(rejected)}
        return {**row, **lengths, "prompt_input_ids": prompt, "chosen_input_ids": chosen,
                "rejected_input_ids": rejected, "length": 2 * len(prompt) + len(chosen) + len(rejected),
                "num_trainable": len(chosen) + len(rejected)}  # fmt: skip


def encode_dataset(
    collected: Collected, tok: Any, *, max_seq_length: int, overlength: str, num_proc: int | None, strict: bool
) -> tuple[datasets.Dataset, Counter]:
    """Tokenise every pair (batched, ``num_proc`` processes); return the kept rows (``COLUMNS`` plus
    ``location``) and the rows' status counts. Bad pairs and over-length ones are recorded in ``collected``."""
    pairs = [pair.to_json() for pair in collected.items]
    table = datasets.Dataset.from_dict({"pair": pairs, "location": collected.locations})
    mapped = table.map(
        PairEncoder(tok, max_seq_length, overlength),
        batched=True,
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        remove_columns=["pair", "location"],
        features=_FEATURES,
        new_fingerprint=uuid.uuid4().hex,  # hashing a large tokenizer is slow and caching is unwanted
        desc="Tokenising pairs",
    )
    status_list = mapped["status"][:]
    for i, status in enumerate(status_list):
        if status in PAIR_SKIP_REASONS:
            collected.skip(mapped[i]["location"], RecordError(status, mapped[i]["error"]), strict)
    keep = [i for i, status in enumerate(status_list) if status in KEPT]
    _name_overlength(collected, mapped, status_list, keep)
    kept = mapped.select(keep) if len(keep) < len(mapped) else mapped
    return kept.select_columns([*COLUMNS, "location"]), Counter(status_list)


def _name_overlength(collected: Collected, mapped: datasets.Dataset, status_list: list[str], keep: list[int]) -> None:
    """Name the first few pairs of each length status (a kept one also by its row ``#i``)."""
    row_of = {i: row for row, i in enumerate(keep)}
    for status in ("truncated", "dropped_overlength", "dropped_prompt_too_long", "dropped_identical_truncated"):
        named = collected.overlength.setdefault(status, [])
        for i in (i for i, s in enumerate(status_list) if s == status):
            if len(named) == SHOW_EXAMPLES:
                break
            prompt, chosen, rejected = mapped[i]["full_lengths"]
            where = f"pair #{row_of[i]}, " if i in row_of else ""
            named.append(f"{where}{mapped[i]['location']}: prompt {prompt} + chosen {chosen} / rejected {rejected} "
                         "tokens")


def compute_stats(kept: datasets.Dataset, collected: Collected, statuses: Counter) -> dict[str, Any]:
    """Token statistics of the built pairs and every count the summary reports.

    ``max_tokens``/``mean``/``p50``/``p95`` are over sequences (prompt + chosen, prompt + rejected), the unit
    ``max_seq_length`` bounds, as for SFT samples; ``total_tokens`` is the sum of ``length`` (the pairs'
    packed tokens, which is also the sum over sequences); ``*_pair_tokens`` describe ``length``.
    """
    prompt, chosen, rejected = (np.asarray(kept[c][:], dtype=np.int64) for c in
                                ("prompt_length", "chosen_length", "rejected_length"))  # fmt: skip
    sequences = np.concatenate([prompt + chosen, prompt + rejected])
    pair = 2 * prompt + chosen + rejected
    trainable = int((chosen + rejected).sum())
    return {
        "total_tokens": int(pair.sum()),
        **length_stats(sequences),
        "mean_pair_tokens": round(float(pair.mean()), 2),
        "max_pair_tokens": int(pair.max()),
        "mean_prompt_tokens": round(float(prompt.mean()), 2),
        "mean_chosen_tokens": round(float(chosen.mean()), 2),
        "mean_rejected_tokens": round(float(rejected.mean()), 2),
        "trainable_tokens": trainable,
        "fraction_trainable": round(trainable / float(pair.sum()), 4),
        **{status: statuses[status] for status in ("truncated", "dropped_overlength", "dropped_prompt_too_long",
                                                   "dropped_identical_truncated")},  # fmt: skip
        "overlength_examples": {k: v for k, v in collected.overlength.items() if v},
        "skipped": dict(sorted(collected.skipped.items())),
        "records_read": collected.records_read,
        "formats": dict(collected.formats),
    }


def show_pairs(kept: datasets.Dataset, tok: Any, count: int, *, color: bool) -> None:
    """Print the first ``count`` pairs: the prompt, then each completion marked (colour or ``[[...]]``)."""
    marks = "coloured" if color else "in [[...]]"
    for i in range(min(count, len(kept))):
        row = kept[i]
        print(f"--- pair {i} from {row['location']}: prompt {row['prompt_length']} tokens, chosen "
              f"{row['chosen_length']}, rejected {row['rejected_length']} (trained {marks}) ---")  # fmt: skip
        print(tok.decode(row["prompt_input_ids"]), end="")
        for name in ("chosen", "rejected"):
            text = tok.decode(row[f"{name}_input_ids"])
            print(f"\n[{name}] " + masking.highlight(text, [(0, len(text))], color=color))

