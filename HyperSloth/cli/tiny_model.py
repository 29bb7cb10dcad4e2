"""``hypersloth-tiny-model``: build the embedded tiny Qwen3 + ChatML tokenizer for offline runs.

Usage::

    hypersloth-tiny-model [OUT_DIR=build/tiny-qwen3] [--data_path FILE.jsonl] [--force]
    python -m HyperSloth.cli.tiny_model build/tiny-qwen3
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

from HyperSloth.cli.command import Command, Flag, Positional
from HyperSloth.train.tiny_architectures import ARCHITECTURES
from HyperSloth.train.tiny_model import build_tiny_model

DEFAULT_OUT_DIR = "build/tiny-qwen3"


def tiny_model(out_dir: str = DEFAULT_OUT_DIR, data_path: str | None = None, force: bool = False,
               architecture: str = "qwen3") -> None:
    """Build (or reuse) the tiny random-weight Qwen3 in OUT_DIR and print what is there.

    Args:
        out_dir: folder to write the Hugging Face model + tokenizer into.
        data_path: OpenAI-messages JSONL to train the tokenizer on (default: data/sample_chat.jsonl).
        force: replace a non-empty OUT_DIR that holds something else.
        architecture: the transformers architecture at the tiny shape (qwen3, qwen3_moe, phi3, ...).
    """
    try:
        path = build_tiny_model(out_dir, data_path=data_path, force=force, architecture=architecture)
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        print(f"hypersloth-tiny-model: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(describe(path))


def describe(path: Path) -> str:
    """What was built: path, parameter count, vocabulary size and shape, read from the saved files."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    config = {**config, **config.get("text_config", {})}  # a multimodal model's language model (gemma3_mm)
    return "\n".join(
        [
            f"tiny model: {path}",
            f"parameters: {count_parameters(path / 'model.safetensors'):,}",
            f"vocab size: {config['vocab_size']}",
            f"layers: {config['num_hidden_layers']}, hidden: {config['hidden_size']}, "
            f"heads: {config['num_attention_heads']}/{config['num_key_value_heads']} (q/kv)",
        ]
    )


def count_parameters(safetensors_file: Path) -> int:
    """Sum the element counts in a safetensors header (a u64 length, then JSON).

    Reading the header directly keeps the idempotent no-op run free of the multi-second torch
    import. The tied lm_head is not stored, so each parameter is counted once.
    """
    with open(safetensors_file, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


COMMAND = Command(
    prog="hypersloth-tiny-model",
    summary="""Build (or reuse, when it is already there) the embedded tiny random-weight Qwen3 and its
ChatML tokenizer in OUT_DIR, for offline runs and tests, and print what is there.""",
    positionals=(Positional("out_dir", "OUT_DIR", f"folder for the model + tokenizer (default {DEFAULT_OUT_DIR})",
                            required=False),),
    flags=(
        Flag("data_path", "OpenAI-messages JSONL to train the tokenizer on (default data/sample_chat.jsonl)",
             value="FILE"),
        Flag("force", "replace a non-empty OUT_DIR that holds something else"),
        Flag("architecture", f"the architecture at the tiny shape: {', '.join(ARCHITECTURES)} (default qwen3; "
             "qwen3_moe has 4 fused experts, 2 active; qwen3_5_moe is Qwen3.5-MoE's linear-attention hybrid, "
             "glm4_moe_lite GLM-4.7-Flash, granite4_h Granite 4.0-H's Mamba-2 hybrid, lfm2 / lfm2_moe LFM2's "
             "short convolutions; gemma3_mm, qwen3_5_moe_mm, "
             "gemma4 and gemma4_moe are multimodal, as Gemma 3 4B+, Qwen3.5-35B-A3B and Gemma 4 are published)",
             value="NAME"),
    ),
    examples=("hypersloth-tiny-model                             # build/tiny-qwen3",
              "hypersloth-tiny-model models/tiny --data_path my_chats.jsonl",
              "hypersloth-tiny-model build/tiny-moe --architecture qwen3_moe"),
    notes="exit codes: 0 built or reused, 2 nothing built (a wrong flag, OUT_DIR holds something else)",
)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `hypersloth-tiny-model` (console script via HyperSloth.cli.command)."""
    COMMAND.run(tiny_model, argv)


if __name__ == "__main__":
    main()
