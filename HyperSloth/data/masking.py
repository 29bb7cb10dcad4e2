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

History rewrites. Some templates render an earlier reply differently once later turns follow:
Qwen3's drops the reasoning (``<think>...</think>``) of every reply before the last user turn.
This is detected from the template's own renders, per conversation: when a reply's content is
not in the full render ``F`` but every reply is found in ``T_i = render(messages[:i + 1])``,
where it is the last turn, the template rewrites history. Such a conversation cannot be one
sample (the full render has no reasoning left to train on), so by default it becomes one
sample per reply, ``T_i`` with only reply ``i`` trained: the conversation as the model sees it
when it writes that reply at inference. ``history_rewrite="last"`` keeps only the final reply's
sample, ``"skip"`` skips the conversation. A template that only *adds* text to the last turn
(Qwen3's empty ``<think>\n\n</think>\n\n`` before a reply without reasoning) leaves every
content in ``F``, so those conversations stay one sample, the added text untrained.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from HyperSloth.data.formats import Message, RecordError

IGNORE_INDEX = -100
#: ``--history_rewrite`` values: one sample per reply, the final reply only, or skip the conversation.
HISTORY_REWRITE: tuple[str, ...] = ("split", "last", "skip")
Span = tuple[int, int]
_GREEN_BG, _RESET = "\x1b[42;30m", "\x1b[0m"


@dataclass
class Sample:
    """One training sample of a conversation: rendered text and its trained character spans.

    ``kind``: ``whole`` (every reply trained), ``split`` (one reply of a conversation whose template
    rewrites history) or ``last`` (only the final reply); ``turn`` is the 1-based number of the
    trained reply (0 for ``whole``), ``turns`` the number of replies in the conversation.
    """

    text: str
    spans: list[Span]
    kind: str = "whole"
    turn: int = 0
    turns: int = 0


@dataclass
class Encoded:
    """One sample rendered, tokenised and masked (before any length policy); fields as ``Sample``."""

    text: str
    input_ids: list[int]
    labels: list[int]
    offsets: list[Span]
    kind: str = "whole"
    turn: int = 0
    turns: int = 0


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


class _Renders:
    """One conversation's render and its prefixes' renders, each computed at most once."""

    def __init__(self, tokenizer: Any, messages: Sequence[Message]) -> None:
        self.tokenizer, self.messages = tokenizer, messages
        try:
            self.full = render(tokenizer, messages)
        except Exception as err:  # a template raises anything (raise_exception, TypeError, ...)
            raise RecordError("template_error", f"{type(err).__name__}: {err}") from None
        self._cache: dict[tuple[int, bool], str | None] = {(len(messages), False): self.full}

    def upto(self, k: int, generation_prompt: bool = False) -> str | None:
        """``render(messages[:k])``; None when the template refuses that prefix (e.g. system-only)."""
        key = (k, generation_prompt)
        if key not in self._cache:
            try:
                self._cache[key] = render(self.tokenizer, self.messages[:k], add_generation_prompt=generation_prompt)
            except Exception:
                self._cache[key] = None
        return self._cache[key]


def response_spans(tokenizer: Any, messages: Sequence[Message], specials: Sequence[str]) -> tuple[str, list[Span]]:
    """Render ``messages``; return the text and the trained character spans of every reply (module doc).

    RecordError('template_error') if the template rejects the conversation,
    RecordError('content_not_in_render') if an assistant message's content is not in the render.
    """
    renders = _Renders(tokenizer, messages)
    return renders.full, _whole_spans(renders, specials)


def conversation_samples(
    tokenizer: Any, messages: Sequence[Message], specials: Sequence[str], history_rewrite: str = "split"
) -> list[Sample]:
    """The training samples of one conversation (see "History rewrites" in the module doc).

    One sample training every reply when the full render holds every reply; otherwise, if each
    reply is intact where it is the conversation's last turn, the template rewrites history and
    ``history_rewrite`` decides: ``split`` (one sample per reply), ``last`` (the final reply
    only) or ``skip`` (RecordError('history_rewritten')). RecordError('content_not_in_render')
    when a reply is changed even as the last turn.
    """
    renders = _Renders(tokenizer, messages)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    try:
        return [Sample(renders.full, _whole_spans(renders, specials), "whole", 0, len(replies))]
    except RecordError as err:
        not_in_full = err
    wanted = replies[-1:] if history_rewrite == "last" else replies
    try:
        own = [_last_turn_span(renders, i, specials) for i in wanted]
    except RecordError:
        raise not_in_full from None  # changed even as the last turn: not a history rewrite
    if history_rewrite == "skip":
        raise RecordError(
            "history_rewritten",
            "the template renders an earlier reply differently once later turns follow (drops its reasoning?); "
            "--history_rewrite split keeps such conversations",
        )
    kind = "last" if history_rewrite == "last" else "split"
    return [
        Sample(text, [span], kind, replies.index(i) + 1, len(replies)) for i, (text, span) in zip(wanted, own)
    ]


def _whole_spans(renders: _Renders, specials: Sequence[str]) -> list[Span]:
    """Every reply's span in the full render (rules 2-3 of the module doc)."""
    spans: list[Span] = []
    cursor = 0
    for i, message in enumerate(renders.messages):
        if message["role"] != "assistant":
            continue
        start, end = _locate_content(renders, i, renders.full, cursor)
        marker = _marker_after(renders, i, renders.full, end, specials)
        spans.append((start, end + len(marker)))
        cursor = end + len(marker)
    return spans


def _last_turn_span(renders: _Renders, i: int, specials: Sequence[str]) -> tuple[str, Span]:
    """The render of ``messages[:i + 1]`` and reply ``i``'s span in it (its content + marker)."""
    text = renders.upto(i + 1)
    if text is None:
        raise RecordError("template_error", f"the template refuses the conversation cut after turn {i}")
    start, end = _locate_content(renders, i, text, 0, last=True)
    return text, (start, end + len(_marker_after(renders, i, text, end, specials)))


def _locate_content(renders: _Renders, i: int, text: str, cursor: int, *, last: bool = False) -> Span:
    """Where reply ``i``'s content is in ``text``: after its generation prompt when ``text`` starts
    with it, else forward from ``cursor`` (or, for the last turn of ``text``, its last occurrence)."""
    prefix = renders.upto(i, generation_prompt=True)
    exact = prefix is not None and text.startswith(prefix)
    lo = max(cursor, len(prefix)) if exact else cursor
    content = renders.messages[i]["content"]
    for needle in (content, content.strip()):
        if not needle:
            return lo, lo
        at = text.rfind(needle, lo) if last and not exact else text.find(needle, lo)
        if at >= 0:
            return at, at + len(needle)
    raise RecordError(
        "content_not_in_render", f"assistant turn {i} content is not in the rendered text (template rewrites it?)"
    )


def _marker_after(renders: _Renders, i: int, text: str, end: int, specials: Sequence[str]) -> str:
    """The end-of-turn marker the template writes after reply ``i`` (rule 3), if ``text`` has it."""
    truncated = renders.upto(i + 1)
    if truncated is None:
        return ""
    content = renders.messages[i]["content"]
    if truncated[:end] == text[:end]:
        closing = truncated[end:]
    else:  # the template renders a final message differently: find the content from the end
        needle = content if content in truncated else content.strip()
        at = truncated.rfind(needle)
        closing = truncated[at + len(needle) :] if at >= 0 and needle else ""
    marker = end_of_turn_marker(closing, specials)
    return marker if text.startswith(marker, end) else ""


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
    tokenizer: Any, conversations: Sequence[Sequence[Message]], specials: Sequence[str], history_rewrite: str = "split"
) -> list[list[Encoded] | RecordError]:
    """Render, tokenise (one batched call, with offsets) and mask each conversation's samples."""
    rendered: list[list[Sample] | RecordError] = []
    for messages in conversations:
        try:
            rendered.append(conversation_samples(tokenizer, messages, specials, history_rewrite))
        except RecordError as err:
            rendered.append(err)
    texts = [sample.text for item in rendered if not isinstance(item, RecordError) for sample in item]
    encodings = iter(tokenize_with_offsets(tokenizer, texts))
    out: list[list[Encoded] | RecordError] = []
    for item in rendered:
        out.append(item if isinstance(item, RecordError) else [_encode(sample, *next(encodings)) for sample in item])
    return out


def _encode(sample: Sample, ids: list[int], offsets: list[Span]) -> Encoded:
    labels = np.where(token_mask(offsets, sample.spans), np.asarray(ids, dtype=np.int64), IGNORE_INDEX)
    return Encoded(sample.text, ids, labels.tolist(), offsets, sample.kind, sample.turn, sample.turns)


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
