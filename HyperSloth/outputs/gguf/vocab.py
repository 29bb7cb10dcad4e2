"""The tokenizer in a GGUF, whole: the byte-level BPE vocabulary and merges, each token's type, BOS/EOS/PAD,
whether BOS/EOS are added, the chat template, and `tokenizer.ggml.pre`, the name of the pre-tokenizer regex
llama.cpp must split text with (src/llama-vocab.cpp).

The token list follows convert_hf_to_gguf.py's `get_vocab_base` (added special tokens CONTROL, other added
tokens USER_DEFINED, ids the tokenizer lacks up to config.vocab_size `[PAD{i}]` UNUSED); merges, special ids
and the chat template come from the `gguf` package's SpecialVocab. llama.cpp's converter names the pre-tokenizer
by hashing the tokens of a probe text against known models, which fails for a tokenizer trained locally (our
tiny model's); here it is named from the loaded tokenizer's own regex, one of the four below, else refused.
A SentencePiece-style tokenizer (BPE with byte_fallback: Mistral v0.3, Gemma 3) is written by spm_vocab.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from HyperSloth.outputs.export import ExportError
from HyperSloth.outputs.gguf.spm_vocab import add_spm_tokenizer, is_sentencepiece_style

# The regexes as tokenizer.json spells them (the "original regex" comments of llama-vocab.cpp) -> llama.cpp's name.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (GPT-4o's, gpt-oss's o200k_harmony): llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O
GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
               r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
               r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, str] = {GPT2_REGEX: "gpt-2", QWEN2_REGEX: "qwen2", LLAMA3_REGEX: "llama-bpe",
                                  GPT4O_REGEX: "gpt-4o"}


def add_tokenizer(writer, model_dir: Path, vocab_size: int) -> None:
    """Write the tokenizer of `model_dir` (tokenizer.json + tokenizer_config.json) into the GGUF."""
    import gguf
    from transformers import AutoTokenizer

    _require_tokenizer_json(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # The tokenizer as loaded, not tokenizer.json as saved: transformers 5 picks the class from config.json's
    # model_type, and Qwen2Tokenizer replaces a saved ByteLevel pre-tokenizer with Qwen's regex (measured).
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if is_sentencepiece_style(spec):
        add_spm_tokenizer(writer, model_dir, tokenizer, spec, vocab_size, added_special_tokens(tokenizer))
        return
    pre = pre_tokenizer_name(spec)
    tokens, types = token_list(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens))
    if not special.merges or len(special.merges) != len(spec["model"].get("merges", [])):
        raise ExportError(f"{model_dir}/tokenizer.json holds {len(special.merges)} BPE merges, the loaded tokenizer "
                          f"{len(spec['model'].get('merges', []))}: save the tokenizer again (save_pretrained)")
    special.add_special_token = added_special_tokens(tokenizer)  # what the tokenizer really does on encode
    special.add_to_gguf(writer, quiet=True)


def pre_tokenizer_name(spec: dict[str, Any]) -> str:
    """llama.cpp's name for the regex a byte-level BPE tokenizer.json splits text with; ExportError otherwise."""
    model = spec.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback") or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise ExportError("--gguf writes byte-level BPE tokenizers (GPT-2 style: Qwen, Llama 3, the tiny model) and "
                          "SentencePiece-style BPE with byte_fallback (Mistral v0.3, Gemma 3); this one is a "
                          f"{model.get('type')} model: convert OUT/merged with llama.cpp's convert_hf_to_gguf.py "
                          "instead")
    regex = _split_regex(spec.get("pre_tokenizer") or {})
    if regex not in PRE_TOKENIZERS:
        raise ExportError(f"the tokenizer's pre-tokenizer regex {regex!r} is none of those llama.cpp knows by name here "
                          f"({', '.join(PRE_TOKENIZERS.values())}): llama.cpp would split text otherwise than the "
                          "Hugging Face tokenizer")
    return PRE_TOKENIZERS[regex]


def _split_regex(pre: dict[str, Any]) -> str | None:
    """The regex of ByteLevel(use_regex=True) alone (GPT-2's), or of Split(regex) + ByteLevel(use_regex=False)."""
    if pre.get("type") == "ByteLevel":
        return GPT2_REGEX if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if (len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex", True) and not steps[1].get("add_prefix_space")
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")):
        return steps[0].get("pattern", {}).get("Regex")
    return None


def token_list(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id below `vocab_size`: its token text and gguf.TokenType (convert_hf_to_gguf.py's get_vocab_base)."""
    import gguf

    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ExportError(f"the tokenizer has ids up to {max(vocab.values())} but config.json's vocab_size is "
                          f"{vocab_size}: the embedding has no row for them")
    by_id = {index: text for text, index in vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
    return tokens, [int(kind) for kind in types]


def added_special_tokens(tokenizer) -> dict[str, bool]:
    """Whether encoding adds BOS / EOS, read from what the tokenizer does (llama.cpp's add_bos/add_eos keys)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return {"bos": bos is not None and len(full) > len(plain) and full[0] == bos,
            "eos": eos is not None and len(full) > len(plain) and full[-1] == eos}


def _require_tokenizer_json(model_dir: Path) -> None:
    if not (model_dir / "tokenizer.json").is_file():
        raise ExportError(f"{model_dir} has no tokenizer.json (a fast tokenizer): --gguf needs it for the vocabulary "
                          "and merges")
