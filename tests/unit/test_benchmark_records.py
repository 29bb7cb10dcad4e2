"""scripts/benchmark.py's records: steadiness per token (a step with more tokens may take longer; a step that
takes longer per token is a spike)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import benchmark  # noqa: E402


def record(step_seconds, step_tokens, warmup=2):
    a = types.SimpleNamespace(warmup=warmup, long_tokens=131072)
    data = {"step_tokens": step_tokens, "order": list(range(32 * len(step_tokens))),
            "lengths": [10] * (32 * len(step_tokens))}
    raw = {"step_seconds": step_seconds, "losses": [1.0] * len(step_seconds), "peak_gb": [1.0]}
    return benchmark.record_for("hypersloth-1", "short-0.6b", raw, data, a, 0.0, 1.0)


def test_a_step_slower_in_proportion_to_its_tokens_is_steady():
    r = record([9.0, 9.0, 0.2, 0.4, 0.2, 0.3], [1, 1, 1000, 2000, 1000, 1500])
    assert r["us_per_token_median"] == pytest.approx(200.0)
    assert r["us_per_token_max_over_median"] == pytest.approx(1.0)
    assert max(r["step_seconds"][2:]) / r["s_median"] == pytest.approx(0.4 / 0.25)  # by seconds, a "spike"
    assert r["step_tokens"] == [1, 1, 1000, 2000, 1000, 1500]


def test_a_spike_per_token_is_reported():
    r = record([9.0, 9.0, 0.2, 0.2, 0.6, 0.2], [1, 1, 1000, 1000, 1000, 1000])
    assert r["us_per_token_max_over_median"] == pytest.approx(3.0)
