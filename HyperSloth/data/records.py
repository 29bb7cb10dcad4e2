"""Raw records -> normalised items, every bad record counted by reason.

One loop serves both dataset kinds: chat conversations (SFT, ``build``) and preference pairs
(``preference``). Each passes its own ``normalise`` function; a record it cannot use raises
``RecordError`` and is counted under its reason (or stops the build, under ``--strict``).
``Collected`` is also what the build summary reports (``summary.log_summary``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
from loguru import logger
from tqdm.auto import tqdm


from HyperSloth.data.formats import SKIP_REASONS, DataInputError, RawRecord, RecordError

SHOW_EXAMPLES = 5  # per reason, how many named examples the summary prints
#: normalise(record) -> (item, format name, whether trailing turns were cut); RecordError if unusable.
Normalise = Callable[[Any], tuple[Any, str, bool]]


@dataclass
class Collected:
    """Normalised items (conversations or pairs) plus what was skipped on the way.

    ``reasons`` orders the skip reasons in the summary (the kind's list of every reason).
    """

    items: list[Any] = field(default_factory=list)
    locations: list[str] = field(default_factory=list)
    records_read: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    formats: Counter = field(default_factory=Counter)
    trimmed: list[str] = field(default_factory=list)  # locations whose trailing user turn(s) were cut
    rewritten: Counter = field(default_factory=Counter)  # "split"/"last": conversations; "split_samples": rows
    overlength: dict[str, list[str]] = field(default_factory=dict)  # status -> first few samples, named
    reasons: tuple[str, ...] = SKIP_REASONS

    def skip(self, location: str, err: RecordError, strict: bool) -> None:
        """Count a bad record (or stop, under --strict)."""
        if strict:
            raise DataInputError(f"{location}: {err.reason}: {err.detail} (--strict makes bad records fatal)")
        self.skipped[err.reason] += 1
        self.examples.setdefault(err.reason, [])
        if len(self.examples[err.reason]) < SHOW_EXAMPLES:
            self.examples[err.reason].append(f"{location}: {err.detail}")


def collect(
    raw: list[RawRecord] | datasets.Dataset,
    normalise: Normalise,
    *,
    n: int | None,
    seed: int,
    strict: bool,
    reasons: tuple[str, ...] = SKIP_REASONS,
    unit: str = " conv",
) -> Collected:
    """Normalise records in order (or in a seeded random order when ``n`` is set, stopping at ``n``
    usable ones), counting every skipped record by reason."""
    total = len(raw)
    order = np.random.default_rng(seed).permutation(total) if n else np.arange(total)
    collected = Collected(reasons=reasons)
    _report_malformed(raw, collected, strict)
    bar = tqdm(total=min(n or total, total), desc="Normalising", unit=unit)
    for raw_record in _iter_records(raw, order):
        if raw_record.error is not None:
            continue  # already counted and reported by _report_malformed
        collected.records_read += 1
        try:
            item, fmt, cut = normalise(raw_record.record)
        except RecordError as err:
            collected.skip(raw_record.location, err, strict)
            continue
        if cut:
            collected.trimmed.append(raw_record.location)
        collected.items.append(item)
        collected.locations.append(raw_record.location)
        collected.formats[fmt] += 1
        bar.update()
        if n and len(collected.items) >= n:
            break
    bar.close()
    if n and len(collected.items) < n:
        logger.warning(f"-n {n}: only {len(collected.items)} usable records in the source; using all of them")
    return collected


def _report_malformed(raw: Any, collected: Collected, strict: bool) -> None:
    """Count every unparseable JSON line (all of them, not just the sampled); the build summary names the
    first few as ``file:line``, once."""
    if not isinstance(raw, list):
        return
    for record in raw:
        if record.error is not None:
            collected.skip(record.location, record.error, strict)
            collected.records_read += 1


def _iter_records(raw: list[RawRecord] | datasets.Dataset, order: np.ndarray, chunk: int = 1000) -> Iterator[RawRecord]:
    if isinstance(raw, list):
        yield from (raw[i] for i in order)
        return
    for lo in range(0, len(order), chunk):
        indices = order[lo : lo + chunk].tolist()
        for i, row in zip(indices, raw.select(indices).to_list()):
            yield RawRecord(f"record #{i}", row)


def first_records(raw: list[RawRecord], count: int) -> list[Any]:
    """Up to ``count`` parsed records from the start of a JSON source (for detecting what it holds)."""
    return [r.record for r in raw[: count * 2] if r.error is None][:count]
