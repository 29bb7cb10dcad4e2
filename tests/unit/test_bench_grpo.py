"""scripts/bench_grpo.py + the benchmark's grpo-0.6b workload (bench_workloads.py, bench_systems.py, benchmark.py):
the parts that need no GPU (the device runs are the lead's)."""

import json
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
from datasets import load_from_disk

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_grpo  # noqa: E402
import bench_systems  # noqa: E402
import bench_workloads  # noqa: E402
import benchmark  # noqa: E402

from HyperSloth.cli.plan import preview  # noqa: E402
from HyperSloth.config import load_config  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("bench-grpo")
    return work, bench_workloads.build_data(work, bench_workloads.WORKLOADS["grpo-0.6b"], steps=2,
                                            checkpoint=tiny_model_dir)


def test_both_systems_get_the_same_prompts_in_the_same_steps(built, tiny_model_dir):
    from transformers import AutoTokenizer

    work, data = built
    prompts = load_from_disk(str(work / "data" / "built_dataset" / "bench"))
    stock = load_from_disk(str(work / "stock_data"))
    assert len(prompts) == len(stock) == 16 and sorted(data["order"]) == list(range(16))
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for k, i in enumerate(data["order"]):  # the stock copy is HyperSloth's plan order; TRL's tokens are ours
        assert json.loads(prompts[i]["prompt_json"]) == stock[k]["prompt"]
        assert tok(stock[k]["prompt"])["input_ids"] == prompts[i]["prompt_input_ids"]
    assert [len(s) for s in data["step_sequences"]] == [64, 64]  # 8 prompts x 8 completions per step
    assert min(map(min, data["step_sequences"])) > bench_grpo.MAX_COMPLETION
    assert data["max_sequence"] <= bench_workloads.WORKLOADS["grpo-0.6b"].max_len


def test_hypersloth_trains_the_workload_as_grpo(built, tmp_path):
    work, _ = built
    (tmp_path / "ckpt_0.6b").mkdir()
    run = Namespace(ckpt_dir=str(tmp_path), work=str(work), token_budget="auto", warmup=0, steps=5, long_tokens=131072,
                    exactness=False)  # the system's process, started and parsed as the benchmark does it
    args = benchmark.parser().parse_args(benchmark.system_argv("hypersloth-1", "grpo-0.6b", run, work, "0.6b")[2:])
    config = bench_systems.hypersloth_config(args, tmp_path / "out_hypersloth-1")
    loaded = load_config(config)
    assert [f.__name__ for f in loaded.reward_funcs] == ["length_reward"]
    assert loaded.hyper.training.grpo.num_generations == bench_grpo.NUM_GENERATIONS
    summary = preview(str(config))
    assert (summary.unit, summary.spec.samples_per_step, summary.num_samples) == ("prompts", 8, 16)
    assert loaded.reward_funcs[0](None, ["abcd", [{"content": "ab"}]]) == bench_grpo.length_reward(None, ["abcd", "ab"])


def test_grpo_systems_and_workloads_are_paired():
    benchmark.check_pairing(["grpo-0.6b"], [["hypersloth-1", "trl-grpo-64x1"], ["trl-grpo-16x4"]])
    with pytest.raises(SystemExit, match=r"systems \['trl-dpo-8x4', 'unsloth-best'\] cannot run the prompt \(GRPO\)"):
        benchmark.check_pairing(["grpo-0.6b"], [["unsloth-best", "trl-dpo-8x4"]])
    with pytest.raises(SystemExit, match=r"systems \['trl-grpo-8x8'\] cannot run the SFT workload"):
        benchmark.check_pairing(["short-0.6b"], [["trl-grpo-8x8"]])
    splits = {bench_systems.SYSTEMS[name]["micro"] * bench_systems.SYSTEMS[name]["accum"]
              for name in bench_grpo.TRL_SPLITS}
    assert splits == {bench_grpo.GLOBAL_COMPLETIONS}


def test_trl_generation_seconds_are_the_generate_calls_of_each_step(monkeypatch):
    from types import SimpleNamespace

    clock = {"now": 0.0}
    synced = []
    model = SimpleNamespace(generate=lambda n: clock.__setitem__("now", clock["now"] + n) or f"{n} s")
    monkeypatch.setattr(bench_grpo, "time", SimpleNamespace(perf_counter=lambda: clock["now"]))
    timer = bench_grpo.GenerateTimer(model, synchronize=lambda: synced.append(True))
    assert model.generate(2.5) == "2.5 s"  # step 1: two calls (TRL's 16 x 4 generates once; a chunked call twice)
    model.generate(0.5)
    timer.callback().on_step_end(None, None, None)
    timer.step_done()  # step 2 reused its rollout (num_iterations > 1): no generate
    model.generate(1.0)
    timer.step_done()
    assert timer.per_step == [3.0, 0.0, 1.0] and len(synced) == 3
    assert np.isfinite(bench_workloads.flops_per_step("0.6b", [300] * 64))


def test_the_stock_generate_gets_the_same_deferred_stop_check():
    from types import SimpleNamespace

    import torch
    from transformers.generation.utils import DeferredStopCheck

    cuda = torch.device("cuda")
    seen = []
    model = SimpleNamespace(device=cuda, generate=lambda: seen.append(
        DeferredStopCheck.is_supported(cuda, None, cache_is_returned=False, is_assistant=False)) or "out")
    bench_grpo.with_deferred_stop_check(model)
    assert model.generate() == "out" and seen == [True]
    assert not DeferredStopCheck.is_supported(cuda, None, cache_is_returned=False, is_assistant=False)
