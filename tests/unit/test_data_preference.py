"""Preference pairs -> token ids: the prompt is a token prefix of each full render, completions hold the
reply and its end-of-turn token, Qwen3's reasoning history, the text form, every bad-pair reason the
tokeniser finds, and the length policy."""

from __future__ import annotations

import importlib.resources
from collections import Counter

import datasets
import pytest
from tokenizers import processors

from HyperSloth.data import masking, preference
from HyperSloth.data.formats import RecordError
from HyperSloth.data.pairs import Pair
from HyperSloth.data.preference import EncodedPair, PairEncoder, encode_pairs
from HyperSloth.data.records import Collected
from HyperSloth.train.tiny_model import build_tiny_tokenizer

QWEN3 = (importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
CORPUS = ["reverse: cat dog sun moon", "hello there, how are you?", "the sky is blue, not green", "be brief"]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def bot(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(CORPUS, vocab_size=300)


def chat_ids(tok, messages, generation_prompt=False) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                   return_dict=True)["input_ids"]  # fmt: skip


def encode(tok, *pairs: Pair) -> list[EncodedPair | RecordError]:
    return encode_pairs(tok, list(pairs), masking.special_token_strings(tok))


@pytest.mark.parametrize(
    "pair",
    [
        Pair([user("reverse: cat dog")], [bot("dog cat")], [bot("cat")]),
        Pair([{"role": "system", "content": "be brief"}, user("hello"), bot("hi"), user("sky?")], [bot("blue")],
             [bot("green, not blue")]),
        Pair([user("hello")], [bot("hi"), bot("how are you?")], [bot("go away")]),
    ],
)
def test_chat_pair_is_each_full_render_split_after_the_prompt(tok, pair):
    [encoded] = encode(tok, pair)
    prompt = chat_ids(tok, pair.prompt, generation_prompt=True)
    assert encoded.prompt == prompt
    for completion, ids in ((pair.chosen, encoded.chosen), (pair.rejected, encoded.rejected)):
        assert prompt + ids == chat_ids(tok, [*pair.prompt, *completion])
        # Only the completion: each reply, its end-of-turn token and the template's newline after it.
        assert tok.decode(ids) == "".join(f"<|im_start|>assistant\n{m['content']}<|im_end|>\n"
                                          for m in completion).removeprefix("<|im_start|>assistant\n")  # fmt: skip


def test_qwen3_drops_history_reasoning_from_prompt_and_keeps_the_completions(tok):
    qwen = build_tiny_tokenizer(CORPUS, vocab_size=300)
    qwen.add_tokens(["<think>", "</think>"])
    qwen.chat_template = QWEN3
    pair = Pair([user("q1"), bot("<think>\nr1\n</think>\n\na1"), user("q2")], [bot("<think>\nr2\n</think>\n\nyes")],
                [bot("no")])
    [encoded] = encode(qwen, pair)
    assert qwen.decode(encoded.prompt).endswith("<|im_start|>assistant\na1<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n"
                                                "<|im_start|>assistant\n")  # fmt: skip
    assert "r1" not in qwen.decode(encoded.prompt)  # the template drops past reasoning, in both renders
    assert qwen.decode(encoded.chosen) == "<think>\nr2\n</think>\n\nyes<|im_end|>\n"
    assert qwen.decode(encoded.rejected) == "<think>\n\n</think>\n\nno<|im_end|>\n"  # the template's empty block
    assert encoded.prompt + encoded.chosen == chat_ids(qwen, [*pair.prompt, *pair.chosen])


def test_text_pairs_are_tokenised_as_trl_with_one_eos_and_the_tokenizers_bos():
    tok = build_tiny_tokenizer(CORPUS, vocab_size=300)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")  # stands in for a BOS the tokenizer adds itself
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    [encoded] = encode(tok, Pair("the sky is", " blue", " green<|im_end|>"))
    assert encoded.prompt == tok("the sky is")["input_ids"] and encoded.prompt[0] == bos
    assert encoded.prompt + encoded.chosen == tok("the sky is blue<|im_end|>")["input_ids"]
    assert encoded.prompt + encoded.rejected == tok("the sky is green<|im_end|>")["input_ids"]  # eos not doubled
    assert tok.decode(encoded.rejected) == " green<|im_end|>" and bos not in encoded.chosen


def test_a_prompt_whose_tokens_merge_with_the_completion_is_skipped(tok):
    prompt, completion = "reverse: c", "at dog"
    assert tok(prompt + completion)["input_ids"][: len(tok(prompt)["input_ids"])] != tok(prompt)["input_ids"]
    [err] = encode(tok, Pair(prompt, completion, " sun"))
    assert isinstance(err, RecordError) and err.reason == "prompt_not_prefix"
    assert "not a prefix of prompt + chosen's" in err.detail


def test_template_problems_are_named(tok):
    def with_template(template: str):
        other = build_tiny_tokenizer(CORPUS, vocab_size=300)
        other.chat_template = template
        return other

    loop = "{% for m in messages %}"
    # The generation prompt has a space the rendered reply header does not: the prompt is no prefix.
    spaced = with_template(loop + "[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
                           "{% if add_generation_prompt %}[assistant] {% endif %}")  # fmt: skip
    trimming = with_template(loop + "[{{ m['role'] }}]{{ m['content'] | trim }}<|im_end|>{% endfor %}"
                             "{% if add_generation_prompt %}[assistant]{% endif %}")  # fmt: skip
    refusing = with_template(loop + "{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
                             "{{ m['content'] }}{% endfor %}")  # fmt: skip
    hiding = with_template(loop + "[{{ m['role'] }}]{% if m['role'] == 'assistant' %}hidden{% else %}"
                           "{{ m['content'] }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    cases = [
        (spaced, Pair([user("hi")], [bot("cat")], [bot("dog")]), "prompt_not_prefix", "renders the prompt differently"),
        (trimming, Pair([user("hi")], [bot("cat ")], [bot("cat")]), "identical_chosen_rejected", "same tokens"),
        (refusing, Pair([{"role": "system", "content": "x"}, user("hi")], [bot("a")], [bot("b")]), "template_error",
         "no system"),
        (hiding, Pair([user("hi")], [bot("cat")], [bot("dog")]), "content_not_in_render", "assistant turn 1"),
    ]
    for tokenizer, pair, reason, detail in cases:
        [err] = encode(tokenizer, pair)
        assert isinstance(err, RecordError) and (err.reason, detail in err.detail) == (reason, True), err


def test_good_and_bad_pairs_in_one_batch_keep_their_order(tok):
    good = Pair([user("hello")], [bot("hi")], [bot("bye")])
    text = Pair("the sky is", " blue", " green")
    bad = Pair("reverse: c", "at dog", " sun")
    out = encode(tok, good, bad, text, good)
    assert [type(item).__name__ for item in out] == ["EncodedPair", "RecordError", "EncodedPair", "EncodedPair"]
    assert out[0] == out[3] and out[2] == encode(tok, text)[0]


@pytest.mark.parametrize(
    "max_len, policy, status, lengths",
    [
        (20, "truncate", "ok", (8, 5, 7)),
        (12, "truncate", "truncated", (8, 4, 4)),  # both cut to 12 - 8 = 4 tokens; the prompt is whole
        (14, "truncate", "truncated", (8, 5, 6)),  # only the longer completion is cut
        (12, "drop", "dropped_overlength", None),
        (8, "truncate", "dropped_prompt_too_long", None),
        (10, "truncate", "dropped_identical_truncated", None),  # the first 2 tokens are the same
    ],
)
def test_length_policy_bounds_each_sequence_and_never_cuts_the_prompt(tok, max_len, policy, status, lengths):
    pair = EncodedPair(list(range(8)), [50, 51, 52, 53, 54], [50, 51, 60, 61, 62, 63, 64])
    row = PairEncoder(tok, max_len, policy).apply_policy(pair)
    assert row["status"] == status and row["full_lengths"] == [8, 5, 7]
    if lengths is None:
        assert row["length"] == row["num_trainable"] == 0 and row["prompt_input_ids"] == []
        return
    prompt, chosen, rejected = lengths
    assert (row["prompt_length"], row["chosen_length"], row["rejected_length"]) == lengths
    assert row["prompt_input_ids"] == pair.prompt and row["chosen_input_ids"] == pair.chosen[:chosen]
    assert row["rejected_input_ids"] == pair.rejected[:rejected]
    assert row["length"] == 2 * prompt + chosen + rejected and row["num_trainable"] == chosen + rejected
    assert max(prompt + chosen, prompt + rejected) <= max_len


def test_stats_count_sequences_and_pairs():
    kept = datasets.Dataset.from_dict({"prompt_length": [10, 2], "chosen_length": [3, 5], "rejected_length": [1, 9]})
    statuses = {"ok": 1, "truncated": 1, "dropped_prompt_too_long": 2}
    stats = preference.compute_stats(kept, Collected(records_read=5), Counter(statuses))
    # Sequences: 13, 11, 7, 11; pairs (prompt twice): 24, 18.
    assert stats["total_tokens"] == 42 == 13 + 11 + 7 + 11
    assert (stats["max_tokens"], stats["mean_tokens"], stats["max_pair_tokens"], stats["mean_pair_tokens"]) == (
        13, 10.5, 24, 21.0)
    assert stats["trainable_tokens"] == 18 and stats["fraction_trainable"] == round(18 / 42, 4)
    assert (stats["truncated"], stats["dropped_prompt_too_long"], stats["dropped_overlength"]) == (1, 2, 0)
