"""The embedded sample chat data: reproducible bytes, valid conversations, correct answers, spread lengths."""

from __future__ import annotations

import json
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_sample_data.py"
COMMITTED = REPO / "data" / "sample_chat.jsonl"


@pytest.fixture(scope="module")
def gen() -> dict:
    """The script's globals (generate, to_jsonl, ...) without running its main."""
    return runpy.run_path(str(SCRIPT), run_name="make_sample_data")


@pytest.fixture(scope="module")
def conversations() -> list[list[dict[str, str]]]:
    return [json.loads(line)["messages"] for line in COMMITTED.read_text(encoding="utf-8").splitlines()]


def test_generation_is_byte_identical_across_calls(gen: dict) -> None:
    first = gen["to_jsonl"](gen["generate"](300, 7))
    second = gen["to_jsonl"](gen["generate"](300, 7))
    assert first == second
    assert gen["to_jsonl"](gen["generate"](300, 8)) != first


def test_committed_file_equals_documented_command(tmp_path: Path) -> None:
    out = tmp_path / "sample_chat.jsonl"
    # The documented command (data/README.md) with only the output redirected.
    subprocess.run(
        [sys.executable, str(SCRIPT), "--n", "2000", "--seed", "0", "--out", str(out)],
        check=True,
        capture_output=True,
    )
    assert out.read_bytes() == COMMITTED.read_bytes(), "regenerate data/sample_chat.jsonl with the script"


def test_file_format_and_size() -> None:
    raw = COMMITTED.read_bytes()
    assert len(raw) < 1_500_000
    assert b"\r" not in raw and raw.endswith(b"\n")
    lines = raw.decode("utf-8").split("\n")[:-1]
    assert len(lines) == 2000
    for line in lines:
        record = json.loads(line)
        assert list(record) == ["messages"]
        assert json.dumps(record, ensure_ascii=False, sort_keys=True) == line


def test_roles_alternate_after_optional_system(conversations: list) -> None:
    turn_counts = set()
    with_system = 0
    for messages in conversations:
        assert all(set(m) == {"role", "content"} and m["content"] for m in messages)
        if messages[0]["role"] == "system":
            with_system += 1
            messages = messages[1:]
        roles = [m["role"] for m in messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) % 2 == 0
        turn_counts.add(len(roles) // 2)
    assert turn_counts == {1, 2, 3, 4}
    assert 0.2 < with_system / len(conversations) < 0.4


def _expected_answer(prompt: str) -> str:
    """An independent oracle for every task phrasing."""
    task, _, rest = prompt.partition(": ")
    items = rest.split()
    if task == "reverse":
        return " ".join(items[::-1])
    if task == "sort":
        return " ".join(sorted(items))
    if task == "count the words":
        return str(len(items))
    if task == "uppercase":
        return rest.upper()
    if task.startswith("repeat "):
        return " ".join([rest] * int(task.split()[1]))
    if prompt.startswith("next "):
        _, count, _, _, letter = prompt.rstrip(":").split()
        start = ord(letter) + 1
        return " ".join(chr(code) for code in range(start, start + int(count)))
    raise AssertionError(f"unknown task phrasing: {prompt!r}")


def test_every_answer_is_correct(conversations: list) -> None:
    seen_tasks = set()
    for messages in conversations:
        pairs = [m for m in messages if m["role"] != "system"]
        for user, assistant in zip(pairs[::2], pairs[1::2]):
            assert assistant["content"] == _expected_answer(user["content"]), user["content"]
            seen_tasks.add(user["content"].split()[0].rstrip(":"))
    assert seen_tasks == {"reverse", "sort", "count", "uppercase", "repeat", "next"}


def test_lengths_are_skewed_and_widely_spread(conversations: list) -> None:
    chars = sorted(sum(len(m["content"]) for m in messages) for messages in conversations)
    p5, p95 = chars[len(chars) // 20], chars[len(chars) * 19 // 20]
    assert p95 / p5 > 15  # measured 23.4 (48 -> 1122 characters of content)
    assert statistics.mean(chars) > statistics.median(chars) * 1.15  # long right tail
    assert chars[0] < 20 and chars[-1] > 3000


def test_cli_rejects_bad_n(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--n", "0", "--out", str(tmp_path / "x.jsonl")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "--n must be at least 1" in result.stderr
    assert not (tmp_path / "x.jsonl").exists()


PREFERENCE = REPO / "data" / "sample_preference.jsonl"


def test_committed_preference_file_equals_documented_command(tmp_path: Path) -> None:
    out = tmp_path / "sample_preference.jsonl"
    # The documented command (data/README.md) with only the output redirected.
    subprocess.run([sys.executable, str(SCRIPT), "--preference", "--n", "200", "--seed", "0", "--out", str(out)],
                   check=True, capture_output=True)  # fmt: skip
    assert out.read_bytes() == PREFERENCE.read_bytes(), "regenerate data/sample_preference.jsonl with the script"


def test_preference_pairs_answer_right_and_reject_a_near_miss() -> None:
    rows = [json.loads(line) for line in PREFERENCE.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 200 and all(list(row) == ["chosen", "prompt", "rejected"] for row in rows)
    history = set()
    for row in rows:
        prompt = [m for m in row["prompt"] if m["role"] != "system"]
        roles = [m["role"] for m in prompt]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        history.add(len(roles) // 2)
        for question, answer in zip(prompt[::2], prompt[1::2]):
            assert answer["content"] == _expected_answer(question["content"])
        [chosen], [rejected] = row["chosen"], row["rejected"]
        assert chosen["role"] == rejected["role"] == "assistant"
        assert chosen["content"] == _expected_answer(prompt[-1]["content"]) != rejected["content"]
    assert history == {0, 1, 2}
    chars = sorted(sum(len(m["content"]) for m in row["prompt"] + row["chosen"]) for row in rows)
    assert chars[-1] / chars[len(chars) // 2] > 5 and chars[0] < 30  # measured: 8 -> 166 (median) -> 1409


def test_cli_rejects_reasoning_pairs(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--preference", "--reasoning", "--out",
                             str(tmp_path / "x.jsonl")], capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and "--reasoning applies to chats only" in result.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_the_sample_data_is_package_data_equal_to_the_checkouts() -> None:
    """A non-editable install (pip install .) has no data/ folder: the package ships copies, and the defaults
    (hypersloth-tiny-model's tokenizer data, hypersloth-init's commands) name them."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from HyperSloth.data import SAMPLE_CHAT_PATH, SAMPLE_PREFERENCE_PATH
    from HyperSloth.train.tiny_model import DEFAULT_DATA_PATH

    package = REPO / "HyperSloth"
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["HyperSloth"]
    for shipped, original in ((SAMPLE_CHAT_PATH, COMMITTED), (SAMPLE_PREFERENCE_PATH, REPO / "data" / "sample_preference.jsonl")):
        inside = shipped.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(inside, glob) for glob in globs), f"{inside} is not package data"
        assert shipped.read_bytes() == original.read_bytes(), f"cp {original.relative_to(REPO)} {shipped.relative_to(REPO)}"
    assert DEFAULT_DATA_PATH == SAMPLE_CHAT_PATH
