"""The response mask: exact for ChatML, a template with different markers, and templates that
rewrite history (Qwen3's official template and one written here)."""

from __future__ import annotations

import importlib.resources

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from HyperSloth.data import masking
from HyperSloth.data.formats import RecordError
from HyperSloth.data.masking import IGNORE_INDEX

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Different markers, a BOS rendered by the template, a space before the reply and an EOS after
# the whole conversation (which must not be trained: it is not the end-of-turn marker).
BOT = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}[USR] {{ m['content'] }} [/USR]\n"
    "{% elif m['role'] == 'system' %}[SYS]{{ m['content'] }}[/SYS]"
    "{% else %}[BOT] {{ m['content'] }}[/BOT]\n\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}[BOT] {% else %}{{ eos_token }}{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "[USR]", "[/USR]", "[SYS]", "[/SYS]", "[BOT]", "[/BOT]"]
CORPUS = ["hello there, how are you?", "I am fine. The sky is blue.", "say assistant", "reverse: a b c", "c b a"]


def make_tokenizer(template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few strings, with every marker of both templates special."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[3:]})
    tok.chat_template = template
    return tok


def encode(tok, messages) -> masking.Encoded:
    (result,) = masking.encode_conversations(tok, [messages], masking.special_token_strings(tok))
    assert not isinstance(result, RecordError), result
    (sample,) = result
    return sample


def runs(tok, enc: masking.Encoded, trained: bool) -> list[str]:
    """Decoded text of each maximal run of trained (or untrained) tokens."""
    out, current = [], []
    for token, label in zip(enc.input_ids, enc.labels):
        if (label != IGNORE_INDEX) == trained:
            current.append(token)
        elif current:
            out.append(tok.decode(current)); current = []  # fmt: skip
    if current:
        out.append(tok.decode(current))
    return out


MULTI = [
    {"role": "system", "content": "I am fine."},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "how are you?"},
    {"role": "user", "content": "reverse: a b c"},
    {"role": "assistant", "content": "c b a"},
]


def test_chatml_multi_turn_mask_is_exact():
    tok = make_tokenizer(CHATML)
    enc = encode(tok, MULTI)
    assert enc.text == tok.apply_chat_template(MULTI, tokenize=False)
    assert tok.decode(enc.input_ids) == enc.text  # no BOS or anything else added
    assert runs(tok, enc, trained=True) == ["how are you?<|im_end|>", "c b a<|im_end|>"]
    assert runs(tok, enc, trained=False) == [
        "<|im_start|>system\nI am fine.<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\nreverse: a b c<|im_end|>\n<|im_start|>assistant\n",
        "\n",
    ]
    # Trained ids equal input ids where trained; the two end-of-turn tokens are among them.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    trained = [t for t, lab in zip(enc.input_ids, enc.labels) if lab != IGNORE_INDEX]
    assert trained == [lab for lab in enc.labels if lab != IGNORE_INDEX]
    assert trained.count(im_end) == 2 and enc.input_ids.count(im_end) == 5


def test_other_template_markers_bos_and_final_eos():
    tok = make_tokenizer(BOT)
    enc = encode(tok, MULTI)
    assert enc.text.startswith("<s>[SYS]") and enc.text.endswith("[/BOT]\n\n</s>")
    # Byte-level BPE glues the template's space to the first word (" how", " c"): that token
    # shares characters with the content, so it is trained (the model must produce it).
    assert runs(tok, enc, trained=True) == [" how are you?[/BOT]", " c b a[/BOT]"]
    assert enc.labels[-1] == IGNORE_INDEX  # the conversation-final EOS is not an end-of-turn marker
    assert enc.labels[0] == IGNORE_INDEX


def test_assistant_content_repeated_in_prompt_and_header_is_found_in_its_turn():
    tok = make_tokenizer(CHATML)
    messages = [
        {"role": "user", "content": "say assistant"},
        {"role": "assistant", "content": "assistant"},
        {"role": "user", "content": "assistant"},
        {"role": "assistant", "content": "assistant"},
    ]
    text, spans = masking.response_spans(tok, messages, masking.special_token_strings(tok))
    starts = [i for i in range(len(text)) if text.startswith("<|im_start|>assistant\nassistant", i)]
    header = len("<|im_start|>assistant\n")
    assert [lo for lo, _ in spans] == [s + header for s in starts]
    assert [text[lo:hi] for lo, hi in spans] == ["assistant<|im_end|>"] * 2


def test_template_that_trims_content_and_mismatched_generation_prompt():
    # The generation prompt ("<|im_start|>assistant\n\n") differs from how replies are rendered, so
    # the prefix rule cannot apply and the forward search takes over; content is trimmed.
    template = CHATML.replace("{{ m['content'] }}", "{{ m['content'] | trim }}").replace(
        "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n\n{% endif %}"
    )
    tok = make_tokenizer(template)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "  c b a \n"}]
    enc = encode(tok, messages)
    assert runs(tok, enc, trained=True) == ["c b a<|im_end|>"]


def test_template_errors_and_rewritten_content_are_record_errors():
    raising = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}{{ m['content'] }}<|im_end|>{% endfor %}"
    rewriting = "{% for m in messages %}{{ m['content'] | upper }}<|im_end|>{% endfor %}"
    specials = masking.special_token_strings(make_tokenizer())
    with pytest.raises(RecordError) as err:
        masking.response_spans(make_tokenizer(raising), MULTI, specials)
    assert err.value.reason == "template_error" and "no system" in err.value.detail
    with pytest.raises(RecordError) as err:
        masking.response_spans(make_tokenizer(rewriting), MULTI, specials)
    assert err.value.reason == "content_not_in_render"


@pytest.mark.parametrize(
    ("closing", "specials", "marker"),
    [
        ("<|im_end|>\n", ["<|im_end|>"], "<|im_end|>"),
        ("<|im_end|>\n</s>", ["</s>", "<|im_end|>"], "<|im_end|>"),  # the first special wins
        (" </s>", ["</s>"], " </s>"),
        ("</answer>\n\n", [], "</answer>"),  # no special token: the text without trailing space
        ("\n\n", ["</s>"], ""),
        ("", ["</s>"], ""),
    ],
)
def test_end_of_turn_marker(closing, specials, marker):
    assert masking.end_of_turn_marker(closing, specials) == marker


def test_token_mask_trains_tokens_that_overlap_a_span():
    offsets = [(0, 3), (3, 5), (5, 9), (9, 9), (9, 12)]
    mask = masking.token_mask(offsets, [(4, 9)])
    assert mask.tolist() == [False, True, True, False, False]  # (3,5) overlaps; (9,9) is zero-width
    assert masking.token_mask([], [(0, 1)]).shape == (0,)
    assert not masking.token_mask(offsets, [(2, 2)]).any()


def test_trained_char_spans_and_highlight():
    offsets = [(0, 2), (2, 4), (4, 6), (6, 8)]
    labels = [IGNORE_INDEX, 5, 6, IGNORE_INDEX]
    spans = masking.trained_char_spans(offsets, labels)
    assert spans == [(2, 6)]
    assert masking.highlight("aabbccdd", spans, color=False) == "aa[[bbcc]]dd"
    assert masking.highlight("aabbccdd", spans, color=True) == "aa\x1b[42;30mbbcc\x1b[0mdd"


def test_fingerprint_depends_on_template_only():
    assert masking.template_fingerprint(CHATML) == masking.template_fingerprint(str(CHATML))
    assert masking.template_fingerprint(CHATML) != masking.template_fingerprint(BOT)
    assert len(masking.template_fingerprint(BOT)) == 64


def test_labels_equal_ids_exactly_where_trained():
    tok = make_tokenizer(BOT)
    enc = encode(tok, MULTI)
    ids, labels = np.asarray(enc.input_ids), np.asarray(enc.labels)
    trained = labels != IGNORE_INDEX
    assert (labels[trained] == ids[trained]).all()
    assert len(enc.offsets) == len(enc.input_ids)


# ---------------------------------------------------------------------------------------------
# Templates that rewrite history
# ---------------------------------------------------------------------------------------------
def qwen3_template() -> str:
    """The official Qwen3 chat template, as TRL ships it for identity checks (trl is pinned)."""
    return (importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")


# Written here: ChatML that, like Qwen3, renders replies before the last user turn without their
# <think>...</think> part (and adds nothing to the last turn).
DROPS_PAST_REASONING = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user %}{{ m['content'].split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REASONING = [
    {"role": "system", "content": "I am fine."},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "<think>\nsay how\n</think>\n\nhow are you?"},
    {"role": "user", "content": "reverse: a b c"},
    {"role": "assistant", "content": "<think>\nc then b then a\n</think>\n\nc b a"},
    {"role": "user", "content": "say assistant"},
    {"role": "assistant", "content": "<think>\nthe sky is blue\n</think>\n\nassistant"},
]


def reasoning_tokenizer(template: str) -> PreTrainedTokenizerFast:
    tok = make_tokenizer(template)
    tok.add_tokens(["<think>", "</think>"])  # as in Qwen3's tokenizer: added, not special
    return tok


def samples(tok, messages, mode="split") -> list[masking.Encoded]:
    (result,) = masking.encode_conversations(tok, [messages], masking.special_token_strings(tok), mode)
    assert not isinstance(result, RecordError), result
    return result


@pytest.mark.parametrize("template", [qwen3_template(), DROPS_PAST_REASONING], ids=["qwen3", "written-here"])
def test_split_gives_one_exactly_masked_sample_per_reply(template):
    tok = reasoning_tokenizer(template)
    replies = [i for i, m in enumerate(REASONING) if m["role"] == "assistant"]
    out = samples(tok, REASONING)
    assert [(s.kind, s.turn, s.turns) for s in out] == [("split", 1, 3), ("split", 2, 3), ("split", 3, 3)]
    for sample, i in zip(out, replies):
        # The conversation up to this reply, exactly as the template renders it at that point ...
        assert sample.text == tok.apply_chat_template(REASONING[: i + 1], tokenize=False)
        assert tok.decode(sample.input_ids) == sample.text
        # ... where only this reply keeps its reasoning, and only this reply is trained:
        assert sample.text.count("<think>") == 1 and sample.text.count("</think>") == 1
        assert runs(tok, sample, trained=True) == [REASONING[i]["content"] + "<|im_end|>"]
        prompt = tok.apply_chat_template(REASONING[:i], tokenize=False, add_generation_prompt=True)
        assert runs(tok, sample, trained=False) == [prompt, "\n"]
        for earlier in REASONING[:i]:
            if earlier["role"] == "assistant":
                assert earlier["content"].split("\n\n")[-1] in prompt and earlier["content"] not in prompt


def test_last_trains_the_final_reply_and_skip_skips():
    tok = reasoning_tokenizer(qwen3_template())
    (last,) = samples(tok, REASONING, "last")
    assert (last.kind, last.turn, last.turns) == ("last", 3, 3)
    assert last.text == tok.apply_chat_template(REASONING, tokenize=False)
    assert runs(tok, last, trained=True) == ["<think>\nthe sky is blue\n</think>\n\nassistant<|im_end|>"]
    (skipped,) = masking.encode_conversations(tok, [REASONING], masking.special_token_strings(tok), "skip")
    assert isinstance(skipped, RecordError) and skipped.reason == "history_rewritten"
    assert "--history_rewrite split" in skipped.detail


def test_qwen3_plain_multi_turn_stays_one_sample_and_the_empty_think_block_is_not_trained():
    tok = reasoning_tokenizer(qwen3_template())
    plain = [{"role": m["role"], "content": m["content"].split("\n\n")[-1]} for m in REASONING]
    (one,) = samples(tok, plain)
    assert (one.kind, one.turn, one.turns) == ("whole", 0, 3)
    assert one.text == tok.apply_chat_template(plain, tokenize=False)
    assert one.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nassistant<|im_end|>\n")
    assert runs(tok, one, trained=True) == ["how are you?<|im_end|>", "c b a<|im_end|>", "assistant<|im_end|>"]
    assert runs(tok, one, trained=False)[-2:] == ["\n<|im_start|>user\nsay assistant<|im_end|>\n"
                                                  "<|im_start|>assistant\n<think>\n\n</think>\n\n", "\n"]  # fmt: skip
    # Reasoning on the final reply only: nothing is rewritten, still one sample training it all.
    final_reasoning = plain[:-1] + REASONING[-1:]
    (one,) = samples(tok, final_reasoning)
    assert one.kind == "whole" and runs(tok, one, trained=True)[-1] == REASONING[-1]["content"] + "<|im_end|>"


def test_content_changed_even_as_the_last_turn_is_not_a_history_rewrite():
    rewriting = "{% for m in messages %}{{ m['content'] | upper }}<|im_end|>{% endfor %}"
    tok = make_tokenizer(rewriting)
    for mode in masking.HISTORY_REWRITE:
        (err,) = masking.encode_conversations(tok, [MULTI], masking.special_token_strings(tok), mode)
        assert isinstance(err, RecordError) and err.reason == "content_not_in_render"
