#!/usr/bin/env python
"""Write the embedded sample chat dataset ``data/sample_chat.jsonl`` (or, with ``--preference``, the
sample preference pairs ``data/sample_preference.jsonl``).

Each line is one conversation in OpenAI messages form::

    {"messages": [{"content": "...", "role": "system"}, {"content": "reverse: a b", "role": "user"},
                  {"content": "b a", "role": "assistant"}, ...]}

The tasks use fixed phrasing over a tiny vocabulary (reverse, sort, count, uppercase, repeat,
next letters) so a 2-layer, 64-wide model visibly lowers its loss within a few dozen steps.
List lengths are skewed (many short, a few long) so padding and the batching planner matter.

The output is byte-for-byte reproducible: only ``random.Random(seed)`` integer draws are used
(no float maths whose last bit could differ between libm builds), JSON is written with sorted
keys and ``\\n`` line ends. ``--reasoning`` writes every reply as ``<think>\\n...\\n</think>\\n\\nANSWER``
(the reasoning derived from the prompt, no extra random draws: the same conversations otherwise),
for builds under templates that drop past reasoning, such as Qwen3's.

``--preference`` writes DPO pairs in TRL's conversational form instead, one per line::

    {"chosen": [{"content": "b a", "role": "assistant"}], "prompt": [..., {"content": "reverse: a b",
     "role": "user"}], "rejected": [{"content": "a b", "role": "assistant"}]}

the prompt being an optional system message, 0-2 earlier turns and the task; chosen the right
answer; rejected a near miss (an item dropped, items rotated, a count off by one, a doubled item)
or, one time in ten, a refusal. Usage::

    python scripts/make_sample_data.py [--n 2000] [--seed 0] [--out data/sample_chat.jsonl] [--reasoning]
    python scripts/make_sample_data.py --preference --n 200 --seed 0 --out data/sample_preference.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path
from typing import Callable

Message = dict[str, str]

WORDS: tuple[str, ...] = (
    "cat", "dog", "sun", "moon", "tree", "fish", "bird", "star", "rain", "snow",
    "red", "blue", "green", "gold", "milk", "bread", "apple", "stone", "river", "cloud",
)  # fmt: skip
DIGITS: tuple[str, ...] = tuple(string.digits)
LETTERS: str = string.ascii_lowercase
SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You are a precise text tool. Answer with the result only.",
    "Follow the instruction exactly.",
)
# Octaves of list length with integer weights: a discrete log-scale draw (many short lists, a
# few long ones) that needs no floating point, so every platform draws the same numbers.
LENGTH_OCTAVES: tuple[tuple[int, int, int], ...] = (
    (1, 3, 12),
    (4, 7, 22),
    (8, 15, 27),
    (16, 31, 22),
    (32, 63, 11),
    (64, 127, 5),
    (128, 240, 1),
)
TURN_WEIGHTS: tuple[tuple[int, int], ...] = ((1, 20), (2, 30), (3, 27), (4, 23))
SYSTEM_PERCENT = 30
HISTORY_WEIGHTS: tuple[tuple[int, int], ...] = ((0, 50), (1, 30), (2, 20))  # earlier turns in a pair's prompt
REFUSALS: tuple[str, ...] = (
    "I am not sure.",
    "Sorry, I cannot help with that request.",
    "That is not something I can answer with the result only; please rephrase the instruction.",
)


def weighted_choice(rng: random.Random, options: tuple[tuple, ...]) -> tuple:
    """Pick one option; the last element of each option is its integer weight."""
    ticket = rng.randrange(sum(option[-1] for option in options))
    for option in options:
        ticket -= option[-1]
        if ticket < 0:
            return option
    raise AssertionError("unreachable: ticket always falls inside the total weight")


def list_length(rng: random.Random) -> int:
    """Draw a skewed list length in [1, 240]: pick an octave by weight, then uniform inside."""
    low, high, _ = weighted_choice(rng, LENGTH_OCTAVES)
    return rng.randint(low, high)


def _words(rng: random.Random) -> list[str]:
    return [rng.choice(WORDS) for _ in range(list_length(rng))]


def task_reverse(rng: random.Random) -> tuple[str, str]:
    """Reverse a word list: ``reverse: a b c`` -> ``c b a``."""
    items = _words(rng)
    return "reverse: " + " ".join(items), " ".join(reversed(items))


def task_sort(rng: random.Random) -> tuple[str, str]:
    """Sort digits: ``sort: 5 2 9`` -> ``2 5 9``."""
    items = [rng.choice(DIGITS) for _ in range(list_length(rng))]
    return "sort: " + " ".join(items), " ".join(sorted(items))


def task_count(rng: random.Random) -> tuple[str, str]:
    """Count words: ``count the words: cat dog sun`` -> ``3``."""
    items = _words(rng)
    return "count the words: " + " ".join(items), str(len(items))


def task_uppercase(rng: random.Random) -> tuple[str, str]:
    """Upper-case words: ``uppercase: cat dog`` -> ``CAT DOG``."""
    items = _words(rng)
    text = " ".join(items)
    return "uppercase: " + text, text.upper()


def task_repeat(rng: random.Random) -> tuple[str, str]:
    """Repeat a word: ``repeat 3 times: cat`` -> ``cat cat cat``."""
    times = list_length(rng)
    word = rng.choice(WORDS)
    return f"repeat {times} times: {word}", " ".join([word] * times)


def task_next_letters(rng: random.Random) -> tuple[str, str]:
    """Continue the alphabet: ``next 3 letters after d:`` -> ``e f g`` (never past z)."""
    start = rng.randrange(len(LETTERS) - 1)
    count = rng.randint(1, min(8, len(LETTERS) - 1 - start))
    letters = LETTERS[start + 1 : start + 1 + count]
    return f"next {count} letters after {LETTERS[start]}:", " ".join(letters)


TASKS: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    task_reverse, task_sort, task_count, task_uppercase, task_repeat, task_next_letters,
)  # fmt: skip


def make_conversation(rng: random.Random) -> list[Message]:
    """One conversation: an optional system message, then 1-4 user/assistant turns."""
    messages: list[Message] = []
    if rng.randrange(100) < SYSTEM_PERCENT:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    (num_turns, _) = weighted_choice(rng, TURN_WEIGHTS)
    for _ in range(num_turns):
        prompt, answer = rng.choice(TASKS)(rng)
        messages.append({"role": "user", "content": prompt})
        messages.append({"role": "assistant", "content": answer})
    return messages


def with_reasoning(messages: list[Message]) -> list[Message]:
    """Each reply preceded by a ``<think>`` block restating its prompt (deterministic, no draws)."""
    out: list[Message] = []
    for message in messages:
        if message["role"] == "assistant":
            task, _, items = out[-1]["content"].partition(":")
            count = f" over {len(items.split())} item(s)" if items.strip() else ""
            thought = f"The task is {task.strip()!r}{count}; answer with the result only."
            message = {"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{message['content']}"}
        out.append(message)
    return out


def generate(n: int = 2000, seed: int = 0, reasoning: bool = False) -> list[dict[str, list[Message]]]:
    """Return ``n`` conversations as ``{"messages": [...]}`` records, fully determined by ``seed``."""
    rng = random.Random(seed)
    conversations = [make_conversation(rng) for _ in range(n)]
    return [{"messages": with_reasoning(c) if reasoning else c} for c in conversations]


def rejected_answer(rng: random.Random, answer: str) -> str:
    """A wrong reply close to ``answer`` (never equal to it): see the module doc."""
    draw = rng.randrange(10)
    if draw == 0:
        return rng.choice(REFUSALS)
    if answer.isdigit():
        return str(int(answer) + rng.choice((-1, 1, 2)))
    items = answer.split()
    if len(items) > 1 and draw < 6:
        del items[rng.randrange(len(items))]
    elif len(items) > 1 and items[1:] + items[:1] != items:
        items = items[1:] + items[:1]
    elif len(items) > 1:  # every item the same (repeat): rotating changes nothing
        items.pop()
    else:
        items = [items[0] + items[0]]
    return " ".join(items)


def make_pair(rng: random.Random) -> dict[str, list[Message]]:
    """One preference pair: a prompt (optional system, 0-2 earlier turns, the task) and two replies."""
    prompt: list[Message] = []
    if rng.randrange(100) < SYSTEM_PERCENT:
        prompt.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    (history, _) = weighted_choice(rng, HISTORY_WEIGHTS)
    for _ in range(history + 1):
        question, answer = rng.choice(TASKS)(rng)
        prompt += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    answer = prompt.pop()["content"]  # the last task's answer is the chosen reply, not history
    return {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": answer}],
        "rejected": [{"role": "assistant", "content": rejected_answer(rng, answer)}],
    }


def generate_preference(n: int = 200, seed: int = 0) -> list[dict[str, list[Message]]]:
    """Return ``n`` preference pairs, fully determined by ``seed``."""
    rng = random.Random(seed)
    return [make_pair(rng) for _ in range(n)]


def to_jsonl(records: list[dict[str, list[Message]]]) -> bytes:
    """Serialise records as UTF-8 JSONL with sorted keys and "\\n" line ends (stable bytes)."""
    lines = (json.dumps(record, ensure_ascii=False, sort_keys=True) for record in records)
    return "".join(line + "\n" for line in lines).encode("utf-8")


def main(argv: list[str] | None = None) -> Path:
    """Parse arguments, write the JSONL file and print a one-line summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="number of conversations")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--out", type=Path, default=None,
                        help="output file (default data/sample_chat.jsonl, or data/sample_preference.jsonl)")
    parser.add_argument("--reasoning", action="store_true", help="every reply starts with a <think> block")
    parser.add_argument("--preference", action="store_true", help="write DPO preference pairs instead")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("--n must be at least 1")
    if args.preference and args.reasoning:
        parser.error("--reasoning applies to chats only, not to --preference pairs")
    if args.preference:
        payload, what = to_jsonl(generate_preference(args.n, args.seed)), "preference pairs"
    else:
        payload, what = to_jsonl(generate(args.n, args.seed, args.reasoning)), "conversations"
    args.out = args.out or Path("data/sample_preference.jsonl" if args.preference else "data/sample_chat.jsonl")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(payload)
    print(f"wrote {args.n} {what} ({len(payload)} bytes) to {args.out}")
    return args.out


if __name__ == "__main__":
    main()
