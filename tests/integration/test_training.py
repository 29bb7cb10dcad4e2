"""Multi-process training is exactly as correct as one process: real runs of the CLI on CPU over gloo.

The runs (tiny random Qwen3, 256 sample chats, 6 optimizer steps of 16 samples) are shared between
the tests through `RunPool`; see training_fixtures.py. Tolerances are relative (1e-5): 1 and 2 workers
add the same numbers in a different order, nothing more.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from training_fixtures import (
    describe_run,
    expected_step_loss,
    first_step_indices,
    needs,
    pool_fixtures,
    FAILURE_MARK,
    MAX_SEQ_LENGTH,
    MAX_STEPS,
    SAVE_STEPS,
    RunResult,
    RunSpec,
    flat_adapter,
    processes_mentioning,
    relative_error,
)

from HyperSloth.outputs.startup import PHASES

pytestmark = pytest.mark.slow

RTOL = 1e-5
HAVE_TMUX = shutil.which("tmux") is not None
SPECS = [
    RunSpec("packed-2w"),
    # Profiled too (no change to the numbers: it only times and traces).
    RunSpec("packed-1w", gpus=1, per_device=8, profile=True),
    # The sorted-pad pair also covers loss_type="all" (test_response_only_... compares the two types).
    RunSpec("sorted-2w", batching="sorted-pad", loss_type="all"),
    RunSpec("sorted-1w", gpus=1, per_device=8, batching="sorted-pad", loss_type="all"),
    RunSpec("failure", inject_failure=True),
    # Dropout draws from each rank's own RNG stream; resuming must restore every rank's stream.
    RunSpec("dropout-2w", lora_dropout=0.1),
    # Killed in its last save, then resumed from "latest" in its folder: must equal dropout-2w.
    RunSpec("killed-in-save", lora_dropout=0.1, kill_in_save=True),
    RunSpec("resume", resume_from="killed-in-save", lora_dropout=0.1, resume_latest=True),
    RunSpec("resume-new-dir", resume_from="dropout-2w", lora_dropout=0.1, resume_into_new_dir=True),
    RunSpec("torchrun", launcher="torchrun"),
    RunSpec("tmux", launcher="tmux"),
]


workdir, model_dir, runs, dataset = pool_fixtures("training", SPECS)


def assert_close_per_step(actual: list[float], expected: list[float], what: str) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} values vs {len(expected)}"
    rel = np.abs(np.subtract(actual, expected)) / np.abs(expected)
    assert rel.max() <= RTOL, f"{what} differ: {actual} vs {expected} (relative {rel.tolist()})"


# ---------------------------------------------------------------- 1. N workers == 1 worker


@pytest.mark.parametrize("pair", [("packed-2w", "packed-1w"), ("sorted-2w", "sorted-1w")],
                         ids=["packed-response_only", "sorted-pad-all"])
@needs("packed-2w", "packed-1w", "sorted-2w", "sorted-1w")
def test_two_workers_match_one_worker_with_the_same_global_batch(runs, pair):
    multi, single = (runs.get(name).check_ok() for name in pair)
    a, b = multi.summary, single.summary
    assert (a["world_size"], b["world_size"]) == (2, 1)
    assert a["global_batch_size"] == b["global_batch_size"] == 16
    assert a["steps"] == b["steps"] == MAX_STEPS
    assert a["tokens_seen"] == b["tokens_seen"] > 0  # the same samples were seen
    assert_close_per_step(a["step_losses"], b["step_losses"], "per-step losses")
    assert_close_per_step(a["grad_norms"], b["grad_norms"], "grad norms (before clipping)")
    assert min(a["grad_norms"]) > 0.01  # max_grad_norm=0.01: every step was clipped, after the sync
    weights_multi, weights_single = multi.adapter(), single.adapter()
    assert sorted(weights_multi) == sorted(weights_single)
    lora_b = [w for name, w in weights_multi.items() if "lora_B" in name]
    assert lora_b and all(np.linalg.norm(w) > 1e-3 for w in lora_b)  # B starts at 0: the weights moved
    error = relative_error(flat_adapter(weights_multi), flat_adapter(weights_single))
    assert error <= RTOL, f"final adapters differ: relative error {error:.3g}"


@needs("packed-2w")
def test_only_all_rank_throughput_is_printed(runs):
    run = runs.get("packed-2w").check_ok()
    # HF's per-process samples/s would be 4x too small here (2 workers x 2 micro-batches): dropped.
    assert "train_samples_per_second" not in run.output and "train_steps_per_second" not in run.output
    assert "train_tokens_per_second_all_ranks" in run.output
    assert "world size 2, micro-batch 4 samples, 8 samples per rank per step" in run.output
    assert "global batch 16 samples per optimizer step" in (run.out / "logs" / "rank0.log").read_text()


# ---------------------------------------------------------------- 2. ranks stay in lockstep


def _digest_of_saved_adapter(weights: dict[str, np.ndarray]) -> str:
    """The worker's weight digest (name + float32 bytes, by parameter name) recomputed from the saved
    adapter; PEFT saves `...lora_A.weight` for the parameter `...lora_A.default.weight`."""
    digest = hashlib.sha256()
    named = {name.replace(".weight", ".default.weight"): w for name, w in weights.items()}
    for name in sorted(named):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(named[name], dtype=np.float32).tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("name", ["packed-2w", "sorted-2w", "resume", "torchrun"])
@needs("packed-2w", "sorted-2w", "resume", "torchrun")
def test_every_rank_ends_with_the_saved_adapter(runs, name):
    run = runs.get(name).check_ok()
    records = run.final_records()
    assert [r["rank"] for r in records] == [0, 1]
    assert records[0]["trainable_params"] == records[1]["trainable_params"] > 0
    assert records[0]["sha256"] == records[1]["sha256"], f"ranks diverged: {records}"
    assert records[0]["sha256"] == _digest_of_saved_adapter(run.adapter())
    card = (run.out / "README.md").read_text()  # the base model is a local folder: named, not linked as None
    assert "huggingface.co/None" not in card and "fine-tuned version of the local model `" in card
    assert 'model="None"' not in card and f'model="{run.out.resolve()}"' in card  # its quick start loads this run


# ---------------------------------------------------------------- 3. response_only


def _direct_count(dataset, indices, loss_type: str) -> int:
    """Targets a causal LM is scored on, from the raw columns: positions >= 1 with a label."""
    if loss_type == "all":
        return int(sum(dataset[int(i)]["length"] - 1 for i in indices))
    return int(sum((np.asarray(dataset[int(i)]["labels"][1:]) != -100).sum() for i in indices))


def test_response_only_labels_cover_exactly_the_assistant_turns(dataset, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for row in dataset:
        ids, labels = np.asarray(row["input_ids"]), np.asarray(row["labels"])
        trained = labels != -100
        assert np.array_equal(labels[trained], ids[trained])
        assert row["num_trainable"] == int(trained[1:].sum()) > 0
        # Every run of trained tokens is one assistant reply plus its <|im_end|>, and nothing else is trained.
        edges = np.flatnonzero(np.diff(np.r_[0, trained.astype(np.int8), 0])).reshape(-1, 2)
        cut = row["length"] == MAX_SEQ_LENGTH  # truncated: the last reply may end mid-way
        for start, end in edges:
            assert tokenizer.decode(ids[:start]).endswith("<|im_start|>assistant\n"), row["text"]
            assert tokenizer.decode(ids[start:end]).endswith("<|im_end|>") or (cut and end == len(ids))
        assert len(edges) == row["text"].count("<|im_start|>assistant\n") or cut


@pytest.mark.parametrize("mode", ["packed", "sorted-pad"])
def test_loss_denominator_counts_the_trained_tokens_of_each_step(dataset, workdir, model_dir, mode):
    """What the trainer feeds every rank, summed over ranks, against a count from the raw labels."""
    from HyperSloth.plan.batching import adaptive_partition_batches, steps_per_epoch
    from HyperSloth.plan.inputs import dataset_lengths, plan_spec_for
    from HyperSloth.train.collate import count_trainable
    from HyperSloth.train.plan_loader import PlanSteps

    counts = {}
    for loss_type in ("response_only", "all"):
        run = describe_run(RunSpec("plan", batching=mode), workdir, model_dir, loss_type)
        lengths, trainable = dataset_lengths(dataset, loss_type, run.max_seq_length)
        spec = plan_spec_for(run)
        plan = adaptive_partition_batches(lengths, trainable, spec)
        per_epoch = steps_per_epoch(len(lengths), spec.samples_per_step)
        rank_steps = [PlanSteps(dataset, partial(adaptive_partition_batches, lengths, trainable, spec), per_epoch,
                                rank=r, mode=mode, loss_type=loss_type, pad_token_id=0) for r in range(2)]
        counts[loss_type] = []
        for step in plan.steps[:MAX_STEPS]:
            indices = [i for rank in step.ranks for mb in rank for i in mb]
            assert len(indices) == spec.samples_per_step == 16
            expected = _direct_count(dataset, indices, loss_type)
            items = [steps[(0, step.index)] for steps in rank_steps]
            assert [item["num_items_in_batch"] for item in items] == [expected, expected]
            assert sum(count_trainable(mb["labels"]) for item in items for mb in item["micro_batches"]) == expected
            counts[loss_type].append(expected)
    assert all(r < a for r, a in zip(counts["response_only"], counts["all"])), counts


@needs("packed-2w", "sorted-2w")
def test_response_only_loss_is_the_mean_over_assistant_tokens(runs, dataset, workdir, model_dir):
    response_only, everything = runs.get("packed-2w").check_ok(), runs.get("sorted-2w").check_ok()
    first_losses = {}
    for run in (response_only, everything):
        indices = first_step_indices(run.spec, workdir, model_dir, dataset)
        first_losses[run.spec.loss_type] = (run.summary["step_losses"][0],
                                            expected_step_loss(model_dir, dataset, indices, run.spec.loss_type))
    for loss_type, (actual, expected) in first_losses.items():
        assert abs(actual - expected) <= RTOL * expected, f"{loss_type}: step 1 loss {actual} != {expected}"
    assert abs(first_losses["response_only"][0] - first_losses["all"][0]) > 0.05, first_losses
    assert all(abs(r - a) > 1e-3 for r, a in zip(response_only.summary["step_losses"],
                                                 everything.summary["step_losses"]))


# ---------------------------------------------------------------- 4. failure propagation


@needs("failure")
def test_a_worker_failing_mid_training_stops_the_run_and_names_its_rank(runs):
    run = runs.get("failure")
    assert run.returncode == 1, run.output[-3000:]
    mark = run.out / FAILURE_MARK
    assert mark.is_file(), f"the failure was never injected:\n{run.output[-3000:]}"
    seconds = run.ended_at - float(mark.read_text())
    assert 0 <= seconds < 30, f"the CLI exited {seconds:.1f} s after rank 1 failed"
    # Named with its own error, in a few lines: the traceback is in rank 1's log, never on the console.
    assert "rank 1 (gpu 1) failed with RuntimeError: injected failure in training step 3" in run.output
    assert "Traceback" in (run.out / "logs" / "rank1.log").read_text() and "Traceback" not in run.output
    assert len(run.output.splitlines()) < 60, run.output
    assert not (run.out / "train_summary.json").exists()
    assert processes_mentioning(str(run.out / "run.json")) == []


# ---------------------------------------------------------------- 5. resume


RESUME_RTOL = 1e-6


@pytest.mark.parametrize("name", ["resume", "resume-new-dir"])
@needs("dropout-2w", "resume", "resume-new-dir")
def test_resume_with_dropout_on_two_workers_equals_the_uninterrupted_run(runs, name):
    full, resumed = runs.get("dropout-2w").check_ok(), runs.get(name).check_ok()
    a, b = full.summary, resumed.summary
    # The summary describes the whole run: the steps before the resume come from the checkpoint.
    assert b["steps"] == MAX_STEPS and b["first_step"] == 1 and len(b["step_losses"]) == MAX_STEPS
    assert b["step_losses"][:SAVE_STEPS] == a["step_losses"][:SAVE_STEPS]
    rel = np.abs(np.subtract(b["step_losses"], a["step_losses"])) / np.abs(a["step_losses"])
    assert rel.max() <= RESUME_RTOL, f"losses after resume differ: {rel.tolist()}"
    assert b["log_steps"] == a["log_steps"] == list(range(1, MAX_STEPS + 1))
    assert len(b["grad_norms"]) == len(b["learning_rates"]) == MAX_STEPS
    assert b["tokens_seen"] == a["tokens_seen"] > b["tokens_this_run"] > 0
    error = relative_error(flat_adapter(full.adapter()), flat_adapter(resumed.adapter()))
    assert error <= RESUME_RTOL, f"final adapters differ: relative error {error:.3g}"


@needs("killed-in-save", "resume")
def test_a_worker_killed_while_saving_leaves_only_complete_checkpoints_and_latest_resumes_from_them(runs):
    from HyperSloth.outputs import checkpoints, run_files

    killed = runs.get("killed-in-save")
    assert killed.returncode == 1 and (killed.out / FAILURE_MARK).is_file(), killed.output[-3000:]
    assert [p.name for p in run_files.checkpoint_dirs(killed.out)] == [f"checkpoint-{SAVE_STEPS}"]
    assert checkpoints.verify(killed.out / f"checkpoint-{SAVE_STEPS}").ok
    unfinished = run_files.staging_dir(killed.out, MAX_STEPS) / f"checkpoint-{MAX_STEPS}"
    # the save was under way (rank 1's half-written RNG state is there) and never finished (no manifest); whether
    # rank 0 had written its own files by then is a race between the ranks, so it is not asserted
    assert (unfinished / "rng_state_rank1.pth").is_file() and not run_files.manifest_file(unfinished).exists()
    resumed = runs.get("resume").check_ok()  # the equality with the uninterrupted run: the test above
    assert (f"resuming from the newest complete checkpoint, {resumed.out / f'checkpoint-{SAVE_STEPS}'} "
            f"(ignored the unfinished save tmp-checkpoint-{MAX_STEPS})") in resumed.output
    assert sorted(p.name for p in resumed.out.glob("*checkpoint-*")) == [f"checkpoint-{SAVE_STEPS}", f"checkpoint-{MAX_STEPS}"]
    assert checkpoints.verify(resumed.out / f"checkpoint-{MAX_STEPS}").ok


def test_a_full_disk_during_a_save_stops_training_and_keeps_the_previous_checkpoint(dataset, workdir, model_dir,
                                                                                    monkeypatch):
    """One worker in this process: HF's own save path writes into the staging folder; a full disk at the
    second save (step 2) ends training with CheckpointError and checkpoint-1 stays complete."""
    import errno
    import gc

    import torch
    from transformers import TrainerCallback

    from HyperSloth.config import load_config
    from HyperSloth.outputs import checkpoints, run_files
    from HyperSloth.plan.run import MachineFacts, resolve_run
    from HyperSloth.train.dist import DistInfo
    from HyperSloth.train.model import load_model
    from HyperSloth.train.sft.trainer import build_trainer
    from training_fixtures import write_config

    spec = RunSpec("disk-full", gpus=1, per_device=2)
    with contextlib.chdir(workdir):
        run = resolve_run(load_config(write_config(spec, workdir, model_dir)), world_size=1,
                          machine=MachineFacts(0, False, 2))
    hyper = run.hyper_config
    trainer, _ = build_trainer(run, load_model(hyper.fast_model_args, hyper.lora_args), dataset, DistInfo())
    trainer.args.max_steps, trainer.args.save_steps = 2, 1  # 4 samples a step, a save after each

    class BestAtFirstSave(TrainerCallback):  # as an eval metric would mark it (HF names the checkpoint then)
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                state.best_global_step = 1

    trainer.add_callback(BestAtFirstSave())
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt") and trainer.state.global_step == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    out = Path(run.output_dir)
    try:
        with pytest.raises(checkpoints.CheckpointError) as info, contextlib.chdir(workdir):  # output_dir is relative
            trainer.train()
    finally:
        gc.unfreeze()  # StepGarbageCollection's on_train_end never ran
        gc.enable()
    message = str(info.value)
    assert message.startswith("could not save checkpoint-2: rank 0 failed to write its part: OSError: "
                              "[Errno 28] No space left on device")
    kept = out / "checkpoint-1"
    assert f"newest complete checkpoint is {kept}" in message
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]
    assert checkpoints.verify(kept).ok and checkpoints.find_latest(out).chosen.path == kept
    assert {"adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state_rank0.pth",
            "run.json", "hypersloth_config.json"} <= set(json.loads((kept / "manifest.json").read_text())["files"])
    state = json.loads((kept / "trainer_state.json").read_text())
    best = str(run_files.checkpoint_dir(trainer.args.output_dir, 1))  # HF's spelling: relative like output_dir
    assert state["best_model_checkpoint"] == trainer.state.best_model_checkpoint == best  # not the staging folder


@needs("dropout-2w", "packed-2w")
def test_each_rank_has_its_own_dropout_stream_saved_in_every_checkpoint(runs):
    import torch

    dropout, plain = runs.get("dropout-2w").check_ok(), runs.get("packed-2w").check_ok()
    # Dropout really acts (else the resume test above would pass trivially).
    assert relative_error(flat_adapter(plain.adapter()), flat_adapter(dropout.adapter())) > 1e-4
    checkpoint = dropout.out / f"checkpoint-{SAVE_STEPS}"
    states = [torch.load(checkpoint / f"rng_state_rank{r}.pth", weights_only=False) for r in range(2)]
    assert not torch.equal(states[0]["cpu"], states[1]["cpu"])
    saved = json.loads((checkpoint / "run.json").read_text())
    assert (saved["global_batch_size"], saved["seed"], saved["world_size"]) == (16, 7, 2)
    config = json.loads((checkpoint / "hypersloth_config.json").read_text())
    assert config["training_config"]["per_device_train_batch_size"] == dropout.spec.per_device


@needs("dropout-2w", "resume")
def test_resume_in_place_replaces_the_earlier_results_and_logs(runs):
    full, resumed = runs.get("dropout-2w").check_ok(), runs.get("resume").check_ok()
    log = (resumed.out / "logs" / "rank0.log").read_text()
    assert log.count("worker 0/2") == 1  # the earlier run's lines are gone, not appended to
    steps_table = (resumed.out / "report.md").read_text().split("## Steps")[1].split("\n## ")[0]
    rows = [line.split(" | ") for line in steps_table.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row[0] for row in rows[1:]] == [f"| {s}" for s in range(1, MAX_STEPS + 1)]  # the whole run
    assert all("—" not in row[2] and "—" not in row[3] for row in rows[1:])  # lr and grad norm shown
    assert resumed.summary["first_step"] == full.summary["first_step"] == 1


@needs("dropout-2w", "resume")
def test_resume_keeps_counting_tokens_seen(runs):
    full, resumed = runs.get("dropout-2w").check_ok(), runs.get("resume").check_ok()

    def logged(run: RunResult) -> list[int]:
        state = json.loads((run.out / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
        return [h["tokens_seen"] for h in state["log_history"] if "loss" in h]

    assert logged(resumed) == logged(full)
    assert resumed.summary["tokens_seen"] == full.summary["tokens_seen"]


# ---------------------------------------------------------------- 6./7. other ways to start the workers


@pytest.mark.skipif(not HAVE_TMUX, reason="the tmux binary is not installed")
@needs("packed-2w", *(["tmux"] if HAVE_TMUX else []))
def test_tmux_run_trains_like_the_launcher(runs):
    launcher, tmux = runs.get("packed-2w").check_ok(), runs.get("tmux").check_ok()
    assert "started 2 rank(s) in tmux session 'hs-train'" in tmux.output
    assert_close_per_step(tmux.summary["step_losses"], launcher.summary["step_losses"], "losses tmux vs launcher")
    records = tmux.final_records()
    assert records[0]["sha256"] == records[1]["sha256"]


@needs("packed-2w", "torchrun")
def test_torchrun_launch_trains_like_the_launcher(runs):
    launcher, torchrun = runs.get("packed-2w").check_ok(), runs.get("torchrun").check_ok()
    assert "worker 0/2 (torchrun)" in (torchrun.out / "logs" / "rank0.log").read_text()
    assert torchrun.summary["world_size"] == 2
    assert_close_per_step(torchrun.summary["step_losses"], launcher.summary["step_losses"],
                          "losses torchrun vs launcher")
    assert_close_per_step(torchrun.summary["grad_norms"], launcher.summary["grad_norms"], "grad norms")
    error = relative_error(flat_adapter(launcher.adapter()), flat_adapter(torchrun.adapter()))
    assert error <= RTOL, f"final adapters differ: relative error {error:.3g}"


@needs("packed-2w")
def test_the_planned_token_budget_is_recorded_with_its_source(runs):
    run = runs.get("packed-2w").check_ok()
    resolved = json.loads((run.out / "run_resolved.json").read_text())
    assert resolved["token_budget"]["tokens"] == 512 and resolved["token_budget"]["source"] == "explicit"
    assert resolved["gradient_checkpointing"] is False
    assert run.summary["token_budget"] == resolved["token_budget"]
    # fast_model_args.attention="auto" on CPU (HyperSloth.train.attention.setting): SDPA, said why, in both records
    assert resolved["attention"] == {"requested": "auto", "kernel": "sdpa", "reason": "no CUDA device"}
    assert run.summary["attention"] == resolved["attention"]


# ---------------------------------------------------------------- 8. the start-up timeline


def assert_start_up_timeline(run: RunResult, phases: list[str]) -> None:
    """train_summary.json's `startup` names `phases` in this order, each ending after the one before, from the
    launch to the end of step 1; every rank's final record has its own; rank 0 printed the breakdown."""
    startup = run.summary["startup"]
    assert list(startup["end_s"]) == phases == list(startup["phase_s"])
    ends = list(startup["end_s"].values())
    assert ends == sorted(ends) and ends[0] >= 0 and all(s >= 0 for s in startup["phase_s"].values())
    assert startup["total_s"] == ends[-1] == pytest.approx(sum(startup["phase_s"].values()), abs=0.01)
    # The step clock's own stamp of step 1's end, and the CLI's exit, come after the timeline's last stamp.
    assert startup["launch_unix"] + startup["total_s"] <= run.summary["first_step_end_unix"] + 1e-3
    assert run.summary["first_step_end_unix"] < run.ended_at
    for record in run.final_records():
        assert list(record["startup"]["end_s"])[-1] == "first_step"
    assert f"start-up {startup['total_s']:.1f} s to the end of step 1" in run.output


LAUNCHED = [p for p in PHASES if p != "unsloth_import"]  # transformers on CPU, workers spawned by the launcher


@needs("packed-2w", "torchrun", *(["tmux"] if HAVE_TMUX else []))
def test_the_start_up_timeline_runs_from_the_launch_to_the_end_of_step_1(runs):
    assert_start_up_timeline(runs.get("packed-2w").check_ok(), LAUNCHED)
    # torchrun started this process as the worker: no spawn of ours, the worker's imports come first.
    in_process = ["launcher_start", "worker_imports", "launcher_checks", *LAUNCHED[LAUNCHED.index("dist_init"):]]
    assert_start_up_timeline(runs.get("torchrun").check_ok(), in_process)
    if HAVE_TMUX:  # the stamps reach the rank windows inline; rank 0's console is its window, not the CLI
        startup = runs.get("tmux").check_ok().summary["startup"]
        assert list(startup["end_s"]) == LAUNCHED and list(startup["end_s"].values()) == sorted(startup["end_s"].values())


@needs("packed-1w")
def test_profile_times_the_phases_and_traces_three_steps_after_the_warm_up(runs):
    run = runs.get("packed-1w").check_ok()
    summary = run.summary
    profile = summary["kernel_profile"]
    assert profile["steps"] == 3 and profile["wall_s_per_step"] > 0
    assert profile["gpu_busy_s_per_step"] is None and profile["gpu_events_per_step"] == 0  # CPU: no device events
    # Steps 4-6 ran under the profiler without phase syncs; step 3 (after the 2 warm-up steps) has phases.
    phases = summary["phase_seconds_per_step"]
    assert set(phases) >= {"data", "forward", "backward", "optimizer"} and phases["forward"] > 0
    table = (run.out / "logs" / "rank0.profile_kernels.txt").read_text()
    assert table.startswith(json.dumps(profile)) and "aten::" in table
    with gzip.open(run.out / "logs" / "rank0.profile_trace.json.gz", "rt") as trace:
        events = json.load(trace)["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
