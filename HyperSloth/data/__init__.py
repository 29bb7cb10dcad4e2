"""Data: any chat format -> messages (formats), template render + response mask (masking),
preference rows -> pairs (pairs) -> prompt/chosen/rejected ids (preference), the normalising loop and
skip counts (records), tokenise + length policy + save (build), the build summary and --print_samples
(summary), the dataset registry (registry).

``build_dataset`` is imported lazily: it pulls in ``datasets`` and ``transformers``, which a
process that only reads the registry should not pay for.
"""

from pathlib import Path
from typing import Any

from HyperSloth.data.formats import DataInputError, RecordError, detect_format, to_messages
from HyperSloth.data.registry import read_registry, register, remove

__all__ = [
    "DataInputError",
    "RecordError",
    "build_dataset",
    "detect_format",
    "read_registry",
    "register",
    "remove",
    "to_messages",
]

#: The shipped sample data, as package data (pyproject.toml), so an install without the checkout has it too:
#: byte copies of the checkout's data/sample_chat.jsonl, data/sample_preference.jsonl and data/sample_prompts.jsonl
#: (tests/unit/test_sample_data.py).
SAMPLES_DIR = Path(__file__).resolve().parent / "samples"
SAMPLE_CHAT_PATH = SAMPLES_DIR / "sample_chat.jsonl"
SAMPLE_PREFERENCE_PATH = SAMPLES_DIR / "sample_preference.jsonl"
SAMPLE_PROMPTS_PATH = SAMPLES_DIR / "sample_prompts.jsonl"  # GRPO: arithmetic prompts with an `answer` column


def __getattr__(name: str) -> Any:
    if name == "build_dataset":
        from HyperSloth.data.build import build_dataset

        return build_dataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
