"""The embedded default model: a tiny random-weight Qwen3 with a locally trained ChatML tokenizer.

It lets every part of HyperSloth (data build, planner, trainer, launcher, export) run end to end
with no network and no GPU. The tokenizer is a byte-level BPE trained on the repo's sample chat
data, so the sample conversations tokenise into a few hundred tokens at most; the model is a
2-layer, 64-wide Qwen3 in float32, saved as an ordinary Hugging Face folder that
``AutoModelForCausalLM`` / ``AutoTokenizer`` load like any hub checkpoint.

``build_tiny_model`` is idempotent (the demo calls it on every run) and atomic (a crash never
leaves a half-written folder behind).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock
from loguru import logger
from pydantic import BaseModel, ConfigDict, Field

from HyperSloth.data import SAMPLE_CHAT_PATH
from HyperSloth.outputs import run_files

if TYPE_CHECKING:  # heavy imports stay lazy: the CLI and the launcher import this module
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)

#: Qwen-style ChatML: ``<|im_start|>role\ncontent<|im_end|>\n`` per message.
CHATML_TEMPLATE: str = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

DEFAULT_DATA_PATH: Path = SAMPLE_CHAT_PATH  # package data: found by a non-editable install too
ARGS_FILE = "tiny_model_args.json"
# Weight init std. With Qwen3's default 0.02 the random 64-wide model is nearly the identity map
# on its tied embedding, and LoRA on it barely learns: on held-out sample chats, the demo's run
# (r=16, lr 3e-3, 16 samples/step, 30 steps) only goes 5.74 -> 5.59. With 0.1 every task starts
# near uniform (6.31, ln 512 = 6.24) and the loss falls steadily to 4.81 (measured, seed 0).
INITIALIZER_RANGE = 0.1
# Bump when the build recipe changes so old folders are rebuilt rather than silently reused.
RECIPE_VERSION = 2
_REQUIRED_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    ARGS_FILE,
)


class TinyModelArgs(BaseModel):
    """Everything that determines the bytes of a tiny-model folder (stored in ``ARGS_FILE``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recipe_version: int = Field(RECIPE_VERSION, description="build recipe version")
    data_sha256: str = Field(description="sha256 of the JSONL the tokenizer was trained on")
    vocab_size: int = Field(gt=len(SPECIAL_TOKENS) + 256, description="BPE target vocabulary")
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    seed: int
    architecture: str = Field("qwen3", description="transformers architecture (tiny_architectures.ARCHITECTURES)")


def build_tiny_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE on ``texts`` and wrap it as a fast HF tokenizer.

    Special tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos); the ChatML
    ``CHATML_TEMPLATE`` is set as the chat template. Returns a ``PreTrainedTokenizerFast`` (so
    ``return_offsets_mapping=True`` works). Texts should be message contents, not rendered chats:
    the special tokens are added whole and need no merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # trim_offsets=False: offsets then cover the token's leading space too, so consecutive
    # offsets tile the text and a response mask built from them misses no character.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    out_dir: str | Path,
    *,
    data_path: str | Path | None = None,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    force: bool = False,
    architecture: str = "qwen3",
) -> Path:
    """Build (or reuse) a tiny random-weight Qwen3 + ChatML tokenizer in ``out_dir``; return its path.

    The tokenizer is trained on ``data_path`` (default: the repo's ``data/sample_chat.jsonl``).
    If ``out_dir`` already holds a complete tiny model built with the same arguments and data it
    is returned untouched. Any other non-empty ``out_dir`` is refused unless ``force=True``.
    The folder is written beside ``out_dir`` and renamed into place, under a file lock, so
    concurrent callers and crashes never see a half-written model.

    Raises:
        FileNotFoundError: the data file does not exist.
        ValueError: a line of the data file is not an OpenAI-messages record.
        FileExistsError: ``out_dir`` is non-empty, holds something else and ``force`` is False.
    """
    out_dir = Path(out_dir).resolve()
    data_file = _resolve_data_path(data_path)
    args = TinyModelArgs(
        data_sha256=run_files.file_sha256(data_file),
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
        architecture=architecture,
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir) + ".lock"):
        if _is_complete_build(out_dir, args):
            logger.debug(f"tiny model already built at {out_dir}")
            return out_dir
        _check_can_write(out_dir, args, force)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            _write_model(staging, data_file, args)
            _replace_dir(staging, out_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    logger.info(f"built tiny model at {out_dir}")
    return out_dir


def read_messages(data_path: str | Path) -> Iterator[list[dict[str, str]]]:
    """Yield the ``messages`` list of each line of an OpenAI-messages JSONL file."""
    with open(data_path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
            except (ValueError, KeyError, TypeError):
                messages = None
            if not _is_message_list(messages):
                raise ValueError(
                    f"{data_path}:{number} is not a JSON object with a 'messages' list of "
                    "{'role': str, 'content': str}; pass --data_path an OpenAI-messages JSONL file."
                )
            yield messages


def _is_message_list(messages: object) -> bool:
    return isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )


def _tokenizer_texts(data_file: Path) -> Iterator[str]:
    """Message contents plus the ChatML role headers, so role names become single tokens."""
    for messages in read_messages(data_file):
        for message in messages:
            yield message["role"] + "\n"
            yield message["content"]


def _resolve_data_path(data_path: str | Path | None) -> Path:
    path = Path(data_path) if data_path is not None else DEFAULT_DATA_PATH
    if not path.is_file():
        hint = "" if data_path is not None else " (the default sample data is missing from this checkout)"
        raise FileNotFoundError(
            f"tiny-model training data not found: {path}{hint}. "
            "Pass --data_path pointing to an OpenAI-messages JSONL file, "
            "e.g. one written by scripts/make_sample_data.py."
        )
    return path


def _stored_args(out_dir: Path) -> dict | None:
    try:
        stored = json.loads((out_dir / ARGS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(stored, dict):
        stored.setdefault("architecture", "qwen3")  # folders built before architectures were a choice
    return stored


def _is_complete_build(out_dir: Path, args: TinyModelArgs) -> bool:
    if not all((out_dir / name).is_file() for name in _REQUIRED_FILES):
        return False
    return _stored_args(out_dir) == args.model_dump()


def _check_can_write(out_dir: Path, args: TinyModelArgs, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a folder; choose another output folder.")
    if force or not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    stored = _stored_args(out_dir)
    if isinstance(stored, dict):
        changed = sorted(k for k in args.model_dump() if stored.get(k) != getattr(args, k))
        what = (
            f"holds a tiny model built with different {', '.join(changed)}"
            if changed
            else "holds an incomplete tiny model (files are missing)"
        )
    else:
        what = "is not empty and does not hold a tiny model"
    raise FileExistsError(
        f"{out_dir} {what}. Choose an empty or new folder, or pass --force to replace its contents."
    )


def _write_model(folder: Path, data_file: Path, args: TinyModelArgs) -> None:
    """Train the tokenizer, initialise the model and save both into ``folder``."""
    import torch
    from transformers import GenerationConfig

    from HyperSloth.train.tiny_architectures import tiny_causal_lm, tiny_config

    tokenizer = build_tiny_tokenizer(_tokenizer_texts(data_file), vocab_size=args.vocab_size)
    tokenizer.model_max_length = args.max_position_embeddings
    config = tiny_config(
        args.architecture,
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_position_embeddings,
        initializer_range=INITIALIZER_RANGE,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(args.seed)
    model = tiny_causal_lm(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    _use_portable_tokenizer_class(folder / "tokenizer_config.json")
    # Written last: its presence (with the other files) marks the folder as complete.
    (folder / ARGS_FILE).write_text(json.dumps(args.model_dump(), indent=2, sort_keys=True) + "\n")


def _use_portable_tokenizer_class(tokenizer_config: Path) -> None:
    """Name the class ``PreTrainedTokenizerFast`` so transformers 4.x can load the folder too.

    transformers 5 saves ``TokenizersBackend``, a name 4.x does not know; 5.x (checked 5.17)
    resolves ``PreTrainedTokenizerFast`` to the same backend, so this name works for both.
    """
    config = json.loads(tokenizer_config.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Move ``staging`` to ``out_dir``; an old ``out_dir`` is swapped out first, then deleted."""
    run_files.replace_dir(staging, out_dir)
