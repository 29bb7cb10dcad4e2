"""Chat-template rendering and the response-only mask, for any template.

The rule (it holds for ChatML and for any template that renders a message's content verbatim):

1. Render the whole conversation: ``F = render(messages)``.
2. For each assistant message ``i``, in order, find where its content starts. Render the prefix
   ``P = render(messages[:i], add_generation_prompt=True)``; when ``F`` starts with ``P`` the
   content is searched from ``len(P)`` (the exact end of the assistant header, so a user message
   or a header that happens to contain the same words is never matched). Otherwise (templates that
   render history differently, e.g. Qwen3's thinking blocks) it is searched forward from the end
   of the previous assistant span. A template that trims content is handled by also searching
   for the stripped content.
3. The end-of-turn marker is taken from ``T = render(messages[:i + 1])``, the conversation
   truncated after that assistant message: ``closing`` is the text ``T`` renders after the
   content. The marker is ``closing`` up to and including its first special token (e.g.
   ``<|im_end|>`` of ``<|im_end|>\\n``, ``<|eot_id|>``, ``</s>``); if ``closing`` has no special
   token, its text without trailing whitespace (``""`` for templates that close turns with
   whitespace only). The marker is trained only if ``F`` has it right after the content.
4. Trained character spans ``[content start, content end + len(marker))`` are mapped to tokens
   with the tokenizer's offset mapping: a token is trained iff it shares at least one character
   with a trained span (a token that merges template text with the first content characters must
   be produced to produce the content, so it is trained). Zero-width tokens are never trained.

No sentinel strings are inserted and no token-id patterns are searched, so the rule needs nothing
template-specific. Every label that is not trained is -100.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from HyperSloth.data.formats import Message, RecordError

IGNORE_INDEX = -100
Span = tuple[int, int]
_GREEN_BG, _RESET = "\x1b[42;30m", "\x1b[0m"


@dataclass
class Encoded:
    """One conversation rendered, tokenised and masked (before any length policy)."""

    text: str
    input_ids: list[int]
    labels: list[int]
    offsets: list[Span]


def template_fingerprint(chat_template: str) -> str:
    """sha256 (hex) of the chat template text: two builds with the same template share it."""
    return hashlib.sha256(chat_template.encode("utf-8")).hexdigest()


def special_token_strings(tokenizer: Any) -> list[str]:
    """Every special token's text (declared specials plus added tokens flagged special)."""
    specials = set(tokenizer.all_special_tokens)
    specials |= {tok.content for tok in tokenizer.added_tokens_decoder.values() if tok.special}
    return sorted((s for s in specials if s), key=len, reverse=True)


def render(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
    """The chat template applied to ``messages`` as text (nothing added beyond the template)."""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )


def end_of_turn_marker(closing: str, specials: Iterable[str]) -> str:
    """The trained end-of-turn text from ``closing`` (what the template renders after content).

    ``closing`` up to and including its first special token; without one, ``closing`` minus
    trailing whitespace.
    """
    first_end = None
    for special in specials:
        at = closing.find(special)
        if at >= 0 and (first_end is None or at < first_end[0]):
            first_end = (at, at + len(special))
    if first_end is not None:
        return closing[: first_end[1]]
    return closing.rstrip()


def response_spans(tokenizer: Any, messages: Sequence[Message], specials: Sequence[str]) -> tuple[str, list[Span]]:
    """Render ``messages``; return the text and the trained character spans (see module doc).

    RecordError('template_error') if the template rejects the conversation,
    RecordError('content_not_in_render') if an assistant message's content is not in the render.
    """
    try:
        full = render(tokenizer, messages)
    except Exception as err:  # a template raises anything (raise_exception, TypeError, ...)
        raise RecordError("template_error", f"{type(err).__name__}: {err}") from None
    spans: list[Span] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = _locate_content(tokenizer, messages, i, full, cursor)
        marker = _marker_after(tokenizer, messages, i, full, end, specials)
        spans.append((start, end + len(marker)))
        cursor = end + len(marker)
    return full, spans


def _locate_content(tokenizer: Any, messages: Sequence[Message], i: int, full: str, cursor: int) -> Span:
    lo = cursor
    try:
        prefix = render(tokenizer, messages[:i], add_generation_prompt=True)
        if full.startswith(prefix):
            lo = max(lo, len(prefix))
    except Exception:  # e.g. a template that refuses an empty or system-only prefix
        pass
    content = messages[i]["content"]
    for needle in (content, content.strip()):
        if not needle:
            return lo, lo
        at = full.find(needle, lo)
        if at >= 0:
            return at, at + len(needle)
    raise RecordError(
        "content_not_in_render", f"assistant turn {i} content is not in the rendered text (template rewrites it?)"
    )


def _marker_after(
    tokenizer: Any, messages: Sequence[Message], i: int, full: str, end: int, specials: Sequence[str]
) -> str:
    if i == len(messages) - 1:
        truncated = full
    else:
        try:
            truncated = render(tokenizer, messages[: i + 1])
        except Exception:
            return ""
    content = messages[i]["content"]
    if truncated[:end] == full[:end]:
        closing = truncated[end:]
    else:  # the template renders a final message differently: find the content from the end
        needle = content if content in truncated else content.strip()
        at = truncated.rfind(needle)
        closing = truncated[at + len(needle) :] if at >= 0 and needle else ""
    marker = end_of_turn_marker(closing, specials)
    return marker if full.startswith(marker, end) else ""


def token_mask(offsets: Sequence[Span], spans: Sequence[Span]) -> np.ndarray:
    """Boolean per token: True iff the token shares a character with any span."""
    if len(offsets) == 0:
        return np.zeros(0, dtype=bool)
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = bounds[:, 0], bounds[:, 1]
    mask = np.zeros(len(bounds), dtype=bool)
    for lo, hi in spans:
        if hi > lo:
            mask |= (starts < hi) & (ends > lo) & (ends > starts)
    return mask


def encode_conversations(
    tokenizer: Any, conversations: Sequence[Sequence[Message]], specials: Sequence[str]
) -> list[Encoded | RecordError]:
    """Render, tokenise (one batched call, with offsets) and mask each conversation."""
    rendered: list[tuple[str, list[Span]] | RecordError] = []
    for messages in conversations:
        try:
            rendered.append(response_spans(tokenizer, messages, specials))
        except RecordError as err:
            rendered.append(err)
    encodings = iter(tokenize_with_offsets(tokenizer, [r[0] for r in rendered if not isinstance(r, RecordError)]))
    out: list[Encoded | RecordError] = []
    for item in rendered:
        if isinstance(item, RecordError):
            out.append(item)
            continue
        text, spans = item
        ids, offsets = next(encodings)
        labels = np.where(token_mask(offsets, spans), np.asarray(ids, dtype=np.int64), IGNORE_INDEX)
        out.append(Encoded(text=text, input_ids=ids, labels=labels.tolist(), offsets=offsets))
    return out


def tokenize_with_offsets(tokenizer: Any, texts: Sequence[str]) -> list[tuple[list[int], list[Span]]]:
    """Token ids and character offsets of each text, no special tokens added (the template
    already renders any BOS it wants). Calls the fast tokenizer's backend directly: same ids,
    without transformers' per-encoding conversion cost."""
    if not texts:
        return []
    encodings = tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [(enc.ids, enc.offsets) for enc in encodings]


def trained_char_spans(offsets: Sequence[Span], labels: Sequence[int]) -> list[Span]:
    """Merge the character ranges of trained tokens into maximal spans (for display)."""
    spans: list[Span] = []
    for (lo, hi), label in zip(offsets, labels):
        if label == IGNORE_INDEX or hi <= lo:
            continue
        if spans and lo <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
        else:
            spans.append((lo, hi))
    return spans


def highlight(text: str, spans: Sequence[Span], *, color: bool) -> str:
    """``text`` with each span marked: ANSI green background if ``color``, else ``[[...]]``."""
    open_mark, close_mark = (_GREEN_BG, _RESET) if color else ("[[", "]]")
    parts, pos = [], 0
    for lo, hi in spans:
        parts += [text[pos:lo], open_mark, text[lo:hi], close_mark]
        pos = hi
    parts.append(text[pos:])
    return "".join(parts)
