"""scripts/bench_dpo.py + the benchmark's dpo-0.6b workload (bench_workloads.py, bench_systems.py, benchmark.py):
the parts that need no GPU."""

import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
from datasets import load_from_disk

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_dpo  # noqa: E402
import bench_systems  # noqa: E402
import bench_workloads  # noqa: E402
import benchmark  # noqa: E402

from HyperSloth.cli.plan import format_summary, preview  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench-dpo")
    return work, bench_workloads.build_data(work, bench_workloads.WORKLOADS["dpo-0.6b"], steps=2)


def test_both_systems_get_the_same_pairs_in_the_same_steps(built):
    work, data = built
    pairs, stock = load_from_disk(str(work / "data" / "built_dataset" / "bench")), load_from_disk(str(work / "stock_data"))
    assert len(pairs) == len(stock) == 64 and sorted(data["order"]) == list(range(64))
    for k, i in enumerate(data["order"]):  # the stock copy is HyperSloth's plan order, step by step
        assert stock[k]["prompt_ids"] == pairs[i]["prompt_input_ids"]
        assert stock[k]["rejected_ids"] == pairs[i]["rejected_input_ids"]
    lengths = np.asarray(pairs["length"])
    assert data["lengths"] == lengths.tolist() and sum(data["step_tokens"]) == int(lengths.sum())
    assert [len(s) for s in data["step_sequences"]] == [64, 64]  # prompt+chosen and prompt+rejected per pair
    assert sum(map(sum, data["step_sequences"])) == int(lengths.sum())
    prompt = np.asarray(pairs["prompt_length"])
    assert 150 < np.median(prompt) < 400 and prompt.max() <= bench_dpo.PROMPT.high
    assert data["max_sequence"] <= bench_workloads.WORKLOADS["dpo-0.6b"].max_len


def test_hypersloth_trains_the_workload_as_dpo(built, tmp_path):
    work, _ = built
    (tmp_path / "ckpt_0.6b").mkdir()
    run = Namespace(ckpt_dir=str(tmp_path), work=str(work), token_budget="auto", warmup=0, steps=5, long_tokens=131072,
                    exactness=False)  # the system's process, started and parsed as the benchmark does it
    args = benchmark.parser().parse_args(benchmark.system_argv("hypersloth-1", "dpo-0.6b", run, work, "0.6b")[2:])
    config = bench_systems.hypersloth_config(args, tmp_path / "out_hypersloth-1")
    summary = preview(str(config))
    assert (summary.unit, summary.spec.samples_per_step, summary.num_samples) == ("pairs", 32, 64)
    assert "global batch 32 pairs per optimizer step" in format_summary(summary)


def test_dpo_systems_and_workloads_are_paired():
    benchmark.check_pairing(["dpo-0.6b"], [["hypersloth-1", "trl-dpo-32x1"], ["trl-dpo-8x4"]])
    with pytest.raises(SystemExit, match=r"systems \['unsloth-best'\] cannot run the preference-pair"):
        benchmark.check_pairing(["dpo-0.6b"], [["unsloth-best", "hypersloth-1"]])
    with pytest.raises(SystemExit, match=r"systems \['trl-dpo-16x2'\] cannot run the SFT workload short-0.6b"):
        benchmark.check_pairing(["short-0.6b"], [["trl-dpo-16x2"]])
    assert {bench_systems.SYSTEMS[f"trl-dpo-{s}"]["micro"] * bench_systems.SYSTEMS[f"trl-dpo-{s}"]["accum"]
            for s in ("32x1", "16x2", "8x4", "4x8")} == {bench_workloads.GLOBAL_BATCH}


def test_dpo_flops_add_the_reference_forward():
    sft = bench_workloads.flops_per_step("0.6b", [1000])
    dpo = bench_workloads.flops_per_step("0.6b", [1000], dpo=True)
    assert 1.45 < dpo / sft < 1.5  # 6 N L vs 4 N L, plus the attention terms
