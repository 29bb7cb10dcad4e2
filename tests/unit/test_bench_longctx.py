"""scripts/bench_longctx.py + bench_workloads.py's long-context workloads: the pure parts (no GPU)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_longctx  # noqa: E402
import bench_workloads  # noqa: E402

from HyperSloth.plan.batching import PlanSpec, adaptive_partition_batches  # noqa: E402


def test_the_long_sample_lands_in_step_one_of_the_plan():
    w = bench_workloads.workload_of("longctx-8b", 262144)
    assert w.long_sample == 262144 and w.max_len == 262144 and w.four_bit
    assert bench_workloads.workload_of("short-8b", 262144).long_sample == 0  # only long-context workloads change
    lengths = bench_longctx.with_long_sample(bench_workloads.sample_lengths(w, 32 * 3), w.long_sample, 32,
                                             bench_workloads.SEED)
    assert (lengths == 262144).sum() == 1 and lengths.max() == 262144
    spec = PlanSpec(num_ranks=1, samples_per_step=32, mode="packed", token_budget=1 << 22, seed=bench_workloads.SEED)
    step1 = [i for mb in adaptive_partition_batches(lengths, lengths - 1, spec).steps[0].ranks[0] for i in mb]
    assert int(np.argmax(lengths)) in step1 and step1[0] == int(np.argmax(lengths))  # first of the stock order
    assert bench_longctx.with_long_sample(lengths, 0, 32, 0) is lengths


def _record(system, loss, first_step, longest):
    return {"workload": "longctx-8b", "system": system, "losses": [loss, 1.0], "first_step_s": first_step,
            "longest_sample_tokens": longest}


def test_annotate_flags_a_cut_sample_a_wrong_loss_and_a_step_below_the_attention_floor():
    reference = {"workload": "longctx-8b", "system": "reference", "reference_loss": 12.71,
                 "attention_floor_s": 54.0}
    records = [reference, _record("hypersloth-1", 12.712, 85.0, 131072), _record("cut", 12.73, 7.9, 131072),
               _record("short", 12.71, 60.0, 32768), _record("fast", 12.71, 20.0, 131072),
               {"workload": "longctx-8b", "system": "oom", "error": "exit 1"},
               {**_record("nan", 12.711, 85.0, 131072), "error": "loss not finite from step 2 (nan)"}]
    out = {r["system"]: r for r in bench_longctx.annotate(records, long_tokens=131072)}
    assert out["hypersloth-1"]["trained_whole"] and not out["hypersloth-1"]["truncated"]
    assert out["hypersloth-1"]["ref_loss_diff"] == pytest.approx(0.002)
    assert out["cut"]["trained_whole"] is False and out["cut"]["ref_loss_diff"] == pytest.approx(0.02)
    assert out["short"]["truncated"] and out["short"]["trained_whole"] is False
    assert out["fast"]["trained_whole"] is False  # right loss, but faster than the sample's attention alone
    assert "trained_whole" not in out["oom"] and "trained_whole" not in out["reference"]
    assert "DID NOT TRAIN" in bench_longctx.verdict_line(out["cut"])
    assert "DID NOT TRAIN" not in bench_longctx.verdict_line(out["hypersloth-1"])
    assert out["nan"]["trained_whole"] is False  # step 1 right, then NaN: no whole training
    assert "loss not finite from step 2" in bench_longctx.verdict_line(out["nan"])


def test_without_a_reference_only_truncation_is_judged():
    out = bench_longctx.annotate([_record("short", 12.7, 60.0, 1000)], long_tokens=131072)[0]
    assert out["truncated"] and "trained_whole" not in out


def test_an_earlier_reference_must_match_workload_and_length(tmp_path):
    import json

    path = tmp_path / "records.json"
    path.write_text(json.dumps([{"workload": "longctx-8b", "system": "reference", "long_tokens": 262144,
                                 "reference_loss": 12.7, "attention_floor_s": 216.0},
                                {"workload": "longctx-8b", "system": "hypersloth-1", "losses": [12.7]}]))
    assert bench_longctx.earlier_reference(None, "longctx-8b", 262144) == []
    (found,) = bench_longctx.earlier_reference(str(path), "longctx-8b", 262144)
    assert found["reference_loss"] == 12.7
    with pytest.raises(SystemExit, match="no reference record of longctx-8b at 131,072 tokens"):
        bench_longctx.earlier_reference(str(path), "longctx-8b", 131072)
