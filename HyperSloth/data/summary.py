"""What a dataset build tells its user: the summary it logs and the samples ``--print_samples`` shows.

Every count the summary prints is also in the registry entry's ``stats`` (see build.compute_stats);
samples are named by their row in the built dataset and their source (``file:line`` or
``record #i``, plus the reply they train when a history rewrite split their conversation).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np
from loguru import logger

from HyperSloth.data import masking
from HyperSloth.data.records import SHOW_EXAMPLES, Collected

if TYPE_CHECKING:
    import datasets


def length_stats(lengths: np.ndarray) -> dict[str, Any]:
    """Mean, median, 95th percentile (nearest rank) and longest of token lengths: what every build's summary reports."""
    return {
        "mean_tokens": round(float(lengths.mean()), 2),
        "p50_tokens": int(np.percentile(lengths, 50, method="nearest")),
        "p95_tokens": int(np.percentile(lengths, 95, method="nearest")),
        "max_tokens": int(lengths.max()),
    }

def origin(row: dict[str, Any]) -> str:
    """Where a sample comes from: its source location, and which reply it trains if not all."""
    if row["kind"] == "split":
        return f"{row['location']}, reply {row['turn']} of {row['turns']}"
    if row["kind"] == "last":
        return f"{row['location']}, final reply (of {row['turns']})"
    return str(row["location"])


def record_samples(collected: Collected, mapped: datasets.Dataset, status_list: list[str], keep: list[int]) -> None:
    """Count conversations a history rewrite split (or cut to the last reply), and name the first
    few over-length samples (a truncated one also by its row ``#i`` in the built dataset)."""
    kinds = mapped["kind"][:]
    locations = mapped["location"][:]
    for kind in ("split", "last"):
        collected.rewritten[kind] = len({loc for loc, k in zip(locations, kinds) if k == kind})
    collected.rewritten["split_samples"] = sum(kinds[i] == "split" for i in keep)
    row_of = {i: row for row, i in enumerate(keep)}
    for status in ("truncated", "dropped_overlength"):
        named = collected.overlength.setdefault(status, [])
        for i in (i for i, s in enumerate(status_list) if s == status):
            if len(named) == SHOW_EXAMPLES:
                break
            where = f"sample #{row_of[i]}, " if i in row_of else ""
            named.append(f"{where}{origin(mapped[i])}: {mapped[i]['full_length']} tokens")


def log_summary(collected: Collected, statuses: Counter, stats: dict, unit: str = "sample") -> None:
    """Log skips, trimmed turns, history rewrites, over-length samples (or pairs: ``unit``) and token
    statistics."""
    for reason in collected.reasons:
        if collected.skipped[reason]:
            logger.warning(f"skipped {collected.skipped[reason]} record(s): {reason}")
            for example in collected.examples.get(reason, []):
                logger.warning(f"    {example}")
    if collected.trimmed:
        logger.warning(
            f"dropped the trailing user turn of {len(collected.trimmed)} conversation(s): no reply follows it, "
            "so nothing in it could be trained"
        )
        for location in collected.trimmed[:SHOW_EXAMPLES]:
            logger.warning(f"    {location}")
    _log_rewrites(collected.rewritten)
    for status in LENGTH_STATUSES:
        if statuses[status]:
            logger.warning(f"{status}: {statuses[status]} {unit}(s){_HINTS.get(status, '')}")
            for example in collected.overlength.get(status, []):
                logger.warning(f"    {example}")
    if stats:
        keys = ("total_tokens", "mean_tokens", "p50_tokens", "p95_tokens", "max_tokens", "fraction_trainable")
        logger.info("tokens: " + ", ".join(f"{k.removesuffix('_tokens')}={stats[k]}" for k in keys if k in stats))


#: Row statuses after the length policy that the summary reports (a pair build never has "no trainable"
#: rows, an SFT build never has identical truncated completions).
LENGTH_STATUSES: tuple[str, ...] = (
    "truncated", "dropped_overlength", "dropped_no_trainable", "dropped_prompt_too_long",
    "dropped_identical_truncated",
)  # fmt: skip
_HINTS = {
    "truncated": " cut to --max_seq_length; their ends, end-of-turn included, are not trained (raise --max_seq_length, "
    "or --overlength drop)",
    "dropped_overlength": " longer than --max_seq_length (--overlength drop)",
    "dropped_prompt_too_long": " whose prompt alone leaves no completion token within --max_seq_length "
    "(truncation never cuts a prompt; raise --max_seq_length)",
    "dropped_identical_truncated": " whose chosen and rejected were the same once cut to --max_seq_length "
    "(raise --max_seq_length)",
}


def _log_rewrites(rewritten: Counter) -> None:
    why = "the chat template renders earlier replies differently once later turns follow (drops their reasoning?)"
    if rewritten["split"]:
        logger.info(
            f"history rewrite: {why}; {rewritten['split']} conversation(s) split into {rewritten['split_samples']} "
            "samples, one per reply, each the conversation up to that reply as the template renders it, "
            "trained on that reply only (--history_rewrite split)"
        )
    if rewritten["last"]:
        logger.info(
            f"history rewrite: {why}; {rewritten['last']} conversation(s) trained on their final reply only "
            "(--history_rewrite last)"
        )


def show_samples(kept: datasets.Dataset, tok: Any, count: int, *, color: bool) -> None:
    """Print the first ``count`` samples with the trained text marked (colour or ``[[...]]``), and
    every sample of the first split conversation when none of those is one."""
    marks = "coloured" if color else "in [[...]]"
    for i in _shown_rows(kept, count):
        row = kept[i]
        _, offsets = masking.tokenize_with_offsets(tok, [row["text"]])[0]
        spans = masking.trained_char_spans(offsets[: row["length"]], row["labels"])
        split = " (split: the template rewrites earlier replies)" if row["kind"] == "split" else ""
        print(f"--- sample {i} from {origin(row)}{split}: {row['length']} tokens, "
              f"{row['num_trainable']} trained ({marks}) ---")  # fmt: skip
        print(masking.highlight(row["text"], spans, color=color))


def _shown_rows(kept: datasets.Dataset, count: int) -> list[int]:
    rows = list(range(min(count, len(kept))))
    kinds = kept["kind"][:]
    if "split" not in kinds or any(kinds[i] == "split" for i in rows):
        return rows
    first = kinds.index("split")
    # A conversation's samples are consecutive rows (fewer than its replies if some were dropped).
    locations = kept["location"][first : first + kept[first]["turns"]]
    return rows + [first + k for k, location in enumerate(locations) if location == locations[0]]
