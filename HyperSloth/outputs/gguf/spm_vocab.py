"""A SentencePiece-style tokenizer in a GGUF: llama.cpp's `llama` (SPM) vocabulary, as Mistral v0.3's and
Gemma 3's tokenizer.json are (BPE with byte_fallback, spaces written as "▁", bytes as `<0xXX>` tokens).

As llama.cpp's convert_hf_to_gguf.py does without a tokenizer.model (`_set_vocab_llama_hf`), the tokens and their
types come from the `gguf` package's LlamaHfVocab (which checks the tokenizer is this kind), and BOS/EOS/UNK and
the chat template from its SpecialVocab. Two things LlamaHfVocab leaves out are added here:
  - scores: llama.cpp's SPM tokenizer merges the adjacent pair whose merged token scores highest, where
    LlamaHfVocab writes -1000 for every token (every pair ties, so llama.cpp would merge left to right). A token
    made by the BPE merge of rank r gets -r, so llama.cpp merges in the tokenizer's own merge order.
  - types: added special tokens LlamaHfVocab does not count as special (Mistral's `[INST]`) are CONTROL, as in
    the byte-level vocabulary, so llama.cpp matches them in text as the Hugging Face tokenizer does.
`tokenizer.ggml.add_space_prefix` is whether the tokenizer puts a "▁" before the text (Metaspace
prepend_scheme, or a Prepend normalizer); a split other than llama.cpp's (none) is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from HyperSloth.outputs.export import ExportError

SPACE = "▁"


def is_sentencepiece_style(spec: dict[str, Any]) -> bool:
    model = spec.get("model", {})
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def add_spm_tokenizer(writer, model_dir: Path, tokenizer, spec: dict[str, Any], vocab_size: int,
                      add_bos_eos: dict[str, bool]) -> None:
    """Write the SentencePiece-style `tokenizer` (its tokenizer.json as loaded: `spec`) into the GGUF;
    `add_bos_eos`: whether encoding adds BOS / EOS."""
    import gguf

    add_space_prefix = space_prefix(spec)
    tokens, types = spm_token_list(model_dir, tokenizer, vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(merge_scores(tokens, spec))
    writer.add_token_types(types)
    writer.add_add_space_prefix(add_space_prefix)
    special = gguf.SpecialVocab(model_dir, load_merges=False, n_vocab=len(tokens))
    special.add_special_token = add_bos_eos
    special.add_to_gguf(writer, quiet=True)


def space_prefix(spec: dict[str, Any]) -> bool:
    """Whether the tokenizer writes "▁" before the text; ExportError for a split llama.cpp does not make."""
    pre, normalizer = spec.get("pre_tokenizer") or {}, spec.get("normalizer") or {}
    if pre.get("type") == "Metaspace" and pre.get("replacement") == SPACE and not pre.get("split", True):
        if normalizer:
            raise ExportError(f"the tokenizer has a Metaspace pre-tokenizer and a {normalizer.get('type')} "
                              "normalizer: llama.cpp's SentencePiece tokenizer would not normalise the text")
        return pre.get("prepend_scheme", "always") != "never"
    steps = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    kinds = [step.get("type") for step in steps]
    replaces_space = (steps and steps[-1].get("type") == "Replace" and steps[-1].get("pattern") == {"String": " "}
                      and steps[-1].get("content") == SPACE)
    prepends = kinds[:-1] == ["Prepend"] and steps[0].get("prepend") == SPACE
    # transformers' GemmaTokenizer also splits on " " after its normalizer has replaced every space: a no-op
    inert = pre == {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
    if (not pre or inert) and replaces_space and (len(steps) == 1 or prepends):
        return prepends
    raise ExportError("this SentencePiece-style tokenizer splits text otherwise than llama.cpp's SentencePiece "
                      f"tokenizer (pre-tokenizer {pre.get('type')}"
                      f"{' with split' if pre.get('split') else ''}, normalizer {kinds or None}): llama.cpp would "
                      "tokenise differently. --gguf writes Metaspace(split=False) or a Replace(' ', '▁') normalizer")


def spm_token_list(model_dir: Path, tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id below `vocab_size`: LlamaHfVocab's token and type, added special tokens CONTROL, `[PAD{i}]` UNUSED."""
    import gguf

    try:
        vocab = gguf.LlamaHfVocab(model_dir)
    except (FileNotFoundError, TypeError) as error:
        raise ExportError(f"{model_dir}/tokenizer.json is not a SentencePiece-style BPE tokenizer llama.cpp reads "
                          f"({error})") from None
    tokens = [text.decode("utf-8") for text, _, _ in vocab.all_tokens()]
    types = [int(kind) for _, _, kind in vocab.all_tokens()]
    by_id = {index: text for text, index in tokenizer.get_vocab().items()}
    if len(tokens) > vocab_size:
        raise ExportError(f"the tokenizer has {len(tokens)} tokens but config.json's vocab_size is {vocab_size}: "
                          "the embedding has no row for them")
    if any(by_id.get(index) != text for index, text in enumerate(tokens)):
        raise ExportError(f"the tokens of {model_dir}/tokenizer.json are not numbered 0..{len(tokens) - 1} in order")
    for index, added in tokenizer.added_tokens_decoder.items():
        types[index] = int(gguf.TokenType.CONTROL if added.special else gguf.TokenType.USER_DEFINED)
    for index in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{index}]")
        types.append(int(gguf.TokenType.UNUSED))
    return tokens, types


def merge_scores(tokens: list[str], spec: dict[str, Any]) -> list[float]:
    """-rank of the BPE merge that makes each token (0.0 for tokens no merge makes)."""
    made_by: dict[str, int] = {}
    for rank, merge in enumerate(spec["model"].get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        made_by.setdefault(left + right, rank)
    return [-float(made_by[token]) if token in made_by else 0.0 for token in tokens]
