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


def _finished_run(out: Path, peak: float = 30.63) -> None:
    import json

    (out / "logs").mkdir(parents=True)
    (out / "train_summary.json").write_text(json.dumps({
        "step_seconds": [121.7], "step_losses": [12.7512], "gradient_checkpointing": "unsloth", "tiled_mlp": False,
        "token_budget": {"tokens": 152064, "longest_sample": 131072}, "first_step_end_unix": 1000.0}))
    (out / "logs" / "rank0.final.json").write_text(json.dumps({"peak_gpu_gb": peak}))


def test_a_hypersloth_run_stopped_for_time_after_its_training_ended_is_recorded(tmp_path):
    """callU (2026-12-01, sixth session): the untiled 131k run ended its step and wrote its summary, then the
    benchmark's time ran out while the process tore down; its record said only "exit timeout"."""
    import time

    launched = time.time() - 5
    out = tmp_path / "out_hypersloth-1"
    assert benchmark.salvage_timed_out("hypersloth-1", tmp_path, launched) is None  # nothing written: a failure
    _finished_run(out)
    raw = benchmark.salvage_timed_out("hypersloth-1", tmp_path, launched)
    assert raw["peak_gb"] == [30.63] and raw["losses"] == [12.7512] and raw["salvaged_after_timeout"]
    assert raw["longest_sample_tokens"] == 131072 and raw["tiled_mlp"] is False
    # a summary left by an earlier launch is not this run's; other runners are never salvaged
    assert benchmark.salvage_timed_out("hypersloth-1", tmp_path, time.time() + 60) is None
    assert benchmark.salvage_timed_out("unsloth-best", tmp_path, launched) is None
    # a summary without every rank's final record is not a finished run
    (out / "logs" / "rank0.final.json").unlink()
    assert benchmark.salvage_timed_out("hypersloth-1", tmp_path, launched) is None


def test_a_slot_that_needs_more_gpus_than_there_are_is_refused_before_anything_runs():
    """"a+b" runs a and b side by side on GPUs of their own: on one GPU the second got none (2026-12-02, callA)."""
    benchmark.check_slot_gpus(benchmark.parse_slots("hypersloth-1,unsloth-best"), num_gpus=1)
    benchmark.check_slot_gpus(benchmark.parse_slots("unsloth-best+hypersloth-1"), num_gpus=2)
    with pytest.raises(SystemExit, match=r"slot unsloth-best\+hypersloth-1 runs its systems side by side on 2 GPUs, "
                                         r"but --num-gpus is 1: write them as separate slots"):
        benchmark.check_slot_gpus(benchmark.parse_slots("unsloth-best+hypersloth-1"), num_gpus=1)
    with pytest.raises(SystemExit, match="hypersloth-2 runs its systems side by side on 2 GPUs"):
        benchmark.check_slot_gpus(benchmark.parse_slots("hypersloth-2"), num_gpus=1)


def test_every_stock_runner_loads_the_same_lora_model(monkeypatch):
    """bench_stock.stock_lora_model: the one load of the stock baselines (SFT, DPO, GRPO, moe_diag), checked with a
    stand-in for Unsloth's FastLanguageModel (no GPU here)."""
    import bench_stock

    calls = []

    class FakeFastLanguageModel:
        @staticmethod
        def from_pretrained(name, **kwargs):
            calls.append(("from_pretrained", name, kwargs))
            return "model", "tokenizer"

        @staticmethod
        def get_peft_model(model, **kwargs):
            calls.append(("get_peft_model", model, kwargs))
            return "peft model"

    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FakeFastLanguageModel))
    got = bench_stock.stock_lora_model("ckpt", max_seq_length=4096, projections=["q_proj"], seed=7,
                                       gradient_checkpointing="unsloth", load_in_4bit=True, device=1)
    assert got == ("peft model", "tokenizer")
    (_, name, load), (_, base, peft) = calls
    assert (name, base, load["load_in_4bit"], load["device_map"], load["max_seq_length"]) == (
        "ckpt", "model", True, {"": 1}, 4096)
    assert str(load["dtype"]) == "torch.bfloat16"
    assert peft == dict(r=16, lora_alpha=16, lora_dropout=0, bias="none", target_modules=["q_proj"], random_state=7,
                        use_gradient_checkpointing="unsloth")


def test_a_system_whose_loss_is_not_finite_has_no_speed():
    assert benchmark.loss_problem([12.1, 12.2, 12.0]) is None
    assert benchmark.loss_problem([12.1, float("nan"), float("nan")]) == "loss not finite from step 2 (nan)"
    assert benchmark.loss_problem([float("inf")]) == "loss not finite from step 1 (inf)"
