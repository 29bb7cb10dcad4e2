"""The response mask: exact for ChatML and for a template with different markers."""

from __future__ import annotations

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
    return result


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
