"""Is a built dataset's tokenisation valid for the model about to be trained?

The dataset stores token ids; they only mean the same thing to a model whose tokenizer has the same
vocabulary. The registry records which tokenizer built the dataset, so the launcher can compare before
any worker starts instead of training silently on garbage ids.
"""

from __future__ import annotations

from pathlib import Path


def _same_source(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


# The files a tokenizer is loaded from (transformers' fast and slow tokenizers, SentencePiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model")
# Those that hold a vocabulary: files compared without one (a cache holding only tokenizer_config.json) say nothing.
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model")


def _tokenizer_files(source: str) -> dict[str, bytes] | None:
    """The tokenizer files of a local folder, or of a Hub id's snapshot in the local Hugging Face cache (the
    revision `main` points to, read without any network call), name -> content; None when there are none."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        paths = {name: folder / name for name in TOKENIZER_FILES}
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            paths = {name: try_to_load_from_cache(source, name) for name in TOKENIZER_FILES}
        except Exception:  # noqa: BLE001 - not a valid repo id, unreadable cache: nothing known from files
            return None
        paths = {name: Path(path) for name, path in paths.items() if isinstance(path, str)}
    return {name: path.read_bytes() for name, path in paths.items() if path.is_file()} or None


def _same_files(a: str, b: str) -> bool:
    """Two local folders or cached Hub snapshots (e.g. `Qwen/Qwen3-8B` and `unsloth/Qwen3-8B`) holding
    byte-identical tokenizer files: the same tokenizer, whatever is in them, known without loading either
    (transformers' import and two tokenizer loads: ~9 s on a 2-core CPU machine)."""
    files_a = _tokenizer_files(a)
    return bool(files_a) and any(name in files_a for name in VOCABULARY_FILES) and files_a == _tokenizer_files(b)


def tokenizer_mismatch(entry: dict, model_name: str, dataset_name: str) -> str | None:
    """None when the dataset's tokenizer is (or has the same vocabulary as) the model's; otherwise a message
    that says what to change. Also None when the two cannot be compared here (e.g. a Hub id offline):
    the check must not block a run it cannot judge."""
    built_with = entry.get("tokenizer")
    if not built_with or _same_source(str(built_with), model_name) or _same_files(str(built_with), model_name):
        return None
    try:
        from transformers import AutoTokenizer

        dataset_vocab = AutoTokenizer.from_pretrained(str(built_with)).get_vocab()
        model_vocab = AutoTokenizer.from_pretrained(model_name).get_vocab()
    except Exception:  # noqa: BLE001 - unreachable hub, gated repo, missing files: cannot judge
        return None
    if dataset_vocab == model_vocab:
        return None
    return (
        f"dataset '{dataset_name}' was tokenised with '{built_with}' ({len(dataset_vocab):,} tokens), whose "
        f"vocabulary differs from the model's '{model_name}' ({len(model_vocab):,} tokens): rebuild it with "
        f"`hypersloth-build-dataset ... --name {dataset_name} --tokenizer {model_name} --overwrite`"
    )
