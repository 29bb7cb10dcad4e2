"""The run directory through the real CLI: one run per folder, --overwrite, resume checks, the notes and
the one-line Hub error the launcher prints before any worker starts (workers faked: nothing trains)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import types
import zipfile
from pathlib import Path

import pytest

import HyperSloth.cli.train as train_cli
from HyperSloth.config import load_config
from HyperSloth.outputs import checkpoints, run_files
from HyperSloth.outputs.run_files import TORCHRUN_VARS
from HyperSloth.plan.run import MachineFacts, RunDescription, resolve_run, write_run


def write_config(tmp_path: Path, *, gpus: str = "[0, 1]", model: str | None = None, extra_targs: str = "",
                 per_device: int = 4, name: str = "config.py") -> Path:
    """A config whose registered dataset (metadata only) and model folder exist."""
    data_dir = tmp_path / "data"
    folder = data_dir / "built_dataset" / "chat"
    folder.mkdir(parents=True, exist_ok=True)
    features = {c: {} for c in ("input_ids", "labels", "length", "num_trainable", "text")}
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))
    (folder / "state.json").write_text(json.dumps({"_fingerprint": "f"}))
    entry = {"name": "chat", "path": "built_dataset/chat", "num_samples": 3, "stats": {"max_tokens": 100}}
    (data_dir / "data_config.json").write_text(json.dumps({"version": 1, "datasets": {"chat": entry}}))
    (tmp_path / "model").mkdir(exist_ok=True)
    model = model or str(tmp_path / "model")
    path = tmp_path / name
    path.write_text(textwrap.dedent(f'''
        from HyperSloth.config import *
        hyper_config_model = HyperConfig(
            data=DataConfig(dataset_name="chat", data_dir={str(data_dir)!r}),
            training=TrainingConfig(gpus={gpus}),
            fast_model_args=FastModelArgs(model_name={model!r}, backend="transformers", dtype="float32"),
        )
        training_config_model = TrainingArgsConfig(output_dir={str(tmp_path / "out")!r},
                                                   per_device_train_batch_size={per_device},
                                                   gradient_accumulation_steps=2{extra_targs})
    '''))
    return path


def complete_checkpoint(folder: Path, description: RunDescription, step: int = 3) -> Path:
    """A checkpoint as a save leaves it (files faked): run.json, trainer state, optimizer, an RNG state per
    rank, manifest."""
    write_run(description, run_files.run_file(folder))
    (folder / run_files.TRAINER_STATE_FILE).write_text(json.dumps({"global_step": step}))
    with zipfile.ZipFile(folder / "optimizer.pt", "w") as archive:  # torch.save writes a zip archive
        archive.writestr("data.pkl", bytes(5000))
    for rank in range(description.world_size):
        run_files.rank_rng_file(folder, rank).write_bytes(b"rng")
    checkpoints.write_manifest(folder, step=step, world_size=description.world_size)
    return folder


@pytest.fixture
def cli(monkeypatch):
    """The CLI in-process on a CPU machine; `launch` recorded instead of run."""
    calls = []
    monkeypatch.setattr(train_cli, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(train_cli, "launch", lambda *a, **k: calls.append(a) or 0)
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)

    def run(argv: list[str]) -> int:
        with pytest.raises(SystemExit) as exit_info:
            train_cli.main(argv)
        return exit_info.value.code

    return types.SimpleNamespace(run=run, calls=calls)


def earlier_run_files(out: Path) -> list[Path]:
    """What a finished 16-worker run leaves behind."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    files = [out / "logs" / f"rank{r}.{kind}" for r in range(16) for kind in ("log", "stderr", "final.json")]
    files += [out / n for n in ("report.md", "train_summary.json", "adapter_model.safetensors", "adapter_config.json")]
    for path in files:
        path.write_text("earlier run")
    (out / "checkpoint-3").mkdir(exist_ok=True)
    return files


def test_second_run_into_the_same_output_dir_is_refused(cli, tmp_path, capsys):
    config = write_config(tmp_path)
    assert cli.run([str(config)]) == 0 and len(cli.calls) == 1
    run_json = (tmp_path / "out" / "run.json").read_text()
    earlier_run_files(tmp_path / "out")
    assert cli.run([str(config)]) == 2
    err = capsys.readouterr().err
    assert "holds an earlier run" in err and "--overwrite" in err
    assert f"resume_from_checkpoint={str(tmp_path / 'out' / 'checkpoint-3')!r} (its last checkpoint)" in err
    assert "Traceback" not in err and len(cli.calls) == 1  # no worker started
    assert (tmp_path / "out" / "run.json").read_text() == run_json  # nothing touched
    assert (tmp_path / "out" / "logs" / "rank15.log").read_text() == "earlier run"


def test_a_run_stopped_before_its_first_checkpoint_is_replaced_without_overwrite(cli, tmp_path, capsys):
    config = write_config(tmp_path)
    out = tmp_path / "out"
    assert cli.run([str(config)]) == 0
    (out / "logs").mkdir()
    (out / "logs" / "rank0.log").write_text("interrupted at step 2")  # no checkpoint-N saved, no adapter
    (out / "run_resolved.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert cli.run([str(config)]) == 0 and len(cli.calls) == 2
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "stopped before its first checkpoint" in line]
    assert len(notes) == 1 and "(no checkpoint, no adapter): its files are replaced" in notes[0]
    assert not (out / "logs" / "rank0.log").exists() and not (out / "run_resolved.json").exists()
    assert (out / "notes.txt").read_text() == "mine" and (out / "run.json").is_file()
    # A finished run that saved no checkpoint (its adapter is there) is still refused: nothing to resume.
    (out / "adapter_model.safetensors").write_text("trained")
    assert cli.run([str(config)]) == 2
    err = capsys.readouterr().err
    assert "adapter or results but no checkpoint (every 100 steps)" in err and "cannot be resumed" in err
    assert "resume_from_checkpoint" not in err and len(cli.calls) == 2


def test_overwrite_removes_the_earlier_run_and_keeps_other_files(cli, tmp_path):
    out = tmp_path / "out"
    stale = earlier_run_files(out)
    (out / "notes.txt").write_text("mine")
    assert cli.run([str(write_config(tmp_path)), "--overwrite"]) == 0 and len(cli.calls) == 1
    assert not any(p.exists() for p in stale) and not (out / "checkpoint-3").exists()
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["logs", "notes.txt", "run.json"]


def test_resume_keeps_checkpoints_but_not_the_earlier_results_or_logs(cli, tmp_path):
    out = tmp_path / "out"
    stale = earlier_run_files(out)
    first = resolve_run(load_config(write_config(tmp_path, name="first.py")), world_size=2,
                        machine=MachineFacts(0, False, 2))
    complete_checkpoint(out / "checkpoint-3", first)
    config = write_config(tmp_path, extra_targs=f", resume_from_checkpoint={str(out / 'checkpoint-3')!r}")
    assert cli.run([str(config)]) == 0 and len(cli.calls) == 1
    assert not any(p.exists() for p in stale)  # a failed resume cannot pass the old report off as its own
    assert (out / "checkpoint-3" / "run.json").is_file()


def test_resume_with_another_step_size_is_refused_before_any_worker(cli, tmp_path, capsys):
    out = tmp_path / "out"
    first = resolve_run(load_config(write_config(tmp_path, name="first.py")), world_size=2,
                        machine=MachineFacts(0, False, 2))
    complete_checkpoint(out / "checkpoint-3", first)
    # One worker instead of two: 4 x 2 x 1 = 8 samples per step instead of 16.
    config = write_config(tmp_path, gpus="[0]", extra_targs=f", resume_from_checkpoint={str(out / 'checkpoint-3')!r}")
    assert cli.run([str(config)]) == 2
    err = capsys.readouterr().err
    assert "cannot resume from" in err and "samples per step 16 -> 8" in err and cli.calls == []


def test_gpu_ids_on_cpu_are_explained(cli, tmp_path, capsys):
    assert cli.run([str(write_config(tmp_path, gpus="[5]"))]) == 0
    err = capsys.readouterr().err
    assert "no CUDA: 1 CPU worker(s) over gloo, one per entry of gpus=[5] (on CPU the ids only count workers)" in err
    cores = len(os.sched_getaffinity(0))
    many = list(range(cores + 1))
    assert cli.run([str(write_config(tmp_path, gpus=repr(many))), "--overwrite"]) == 0
    assert f"{cores + 1} CPU workers share {cores} core(s)" in capsys.readouterr().err


def test_the_start_line_states_the_derived_batch(cli, tmp_path, capsys):
    assert cli.run([str(write_config(tmp_path, gpus="[0, 1, 2]", per_device=2))]) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if "global batch" in x)
    assert "world size 3" in line and "4 samples per rank per step" in line and "global batch 12 samples" in line


def _cli_subprocess(config: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    environ = {k: v for k, v in os.environ.items() if k not in (*TORCHRUN_VARS, "HF_HUB_OFFLINE")}
    environ.update(CUDA_VISIBLE_DEVICES="", **env)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "HyperSloth.cli.train", str(config)], capture_output=True,
                            text=True, timeout=120, env=environ)
    return result, time.monotonic() - start


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "cannot reach the Hugging Face Hub at http://127.0.0.1:9"),
        ({"HF_HUB_OFFLINE": "1"}, "is not in the local Hugging Face cache and HF_HUB_OFFLINE=1"),
    ],
    ids=["unreachable-endpoint", "offline"],
)
def test_unreachable_hub_model_is_one_line_before_any_worker(tmp_path, env, expected):
    config = write_config(tmp_path, model="hypersloth-test/not-cached-anywhere")
    result, seconds = _cli_subprocess(config, HF_HOME=str(tmp_path / "hf"), **env)
    print(f"hub check answered in {seconds:.1f} s")  # measured; not asserted (no timed tests)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("hypersloth-train: error:")]
    assert len(errors) == 1 and expected in errors[0] and "hypersloth-test/not-cached-anywhere" in errors[0]
    assert "Traceback" not in result.stderr and not (tmp_path / "out" / "run.json").exists()


def test_the_rebuild_command_for_a_deleted_dataset_works(tmp_path, monkeypatch):
    import re
    import shlex
    import shutil

    from HyperSloth.cli import build_dataset as build_cli
    from HyperSloth.config import ConfigError
    from HyperSloth.data.build import build_dataset
    from HyperSloth.train.tiny_model import build_tiny_tokenizer

    chats = [{"messages": [{"role": "user", "content": f"say {i} please"},
                           {"role": "assistant", "content": f"number {i} it is"}]} for i in range(8)]
    tokenizer_dir = tmp_path / "tok"
    build_tiny_tokenizer([c["messages"][0]["content"] + c["messages"][1]["content"] for c in chats],
                         vocab_size=300).save_pretrained(tokenizer_dir)
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in chats))
    data_dir = tmp_path / "data"
    build_dataset(str(source), name="chat", tokenizer=str(tokenizer_dir), data_dir=str(data_dir), num_proc=1,
                  max_seq_length=64, n=6, seed=3, overlength="drop")
    config = tmp_path / "config.py"
    config.write_text(textwrap.dedent(f'''
        from HyperSloth.config import *
        hyper_config_model = HyperConfig(data=DataConfig(dataset_name="chat", data_dir={str(data_dir)!r}),
                                         fast_model_args=FastModelArgs(model_name={str(tokenizer_dir)!r}))
    '''))
    before = json.loads((data_dir / "data_config.json").read_text())["datasets"]["chat"]
    shutil.rmtree(data_dir / "built_dataset" / "chat")
    with pytest.raises(ConfigError) as info:
        resolve_run(load_config(config), world_size=1, machine=MachineFacts(0, False, 2))
    command = re.search(r"rebuild it with `([^`]+)`", str(info.value)).group(1)
    assert command.endswith("--overwrite") and "-n 6 --seed 3" in command and "--max_seq_length 64" in command
    assert "--overlength drop" in command
    argv = shlex.split(command)
    assert argv[0] == "hypersloth-build-dataset"
    build_cli.main(argv[1:])  # the suggested command, as typed
    after = json.loads((data_dir / "data_config.json").read_text())["datasets"]["chat"]
    assert after["num_samples"] == before["num_samples"] == 6 and after["stats"]["n"] == 6
    run = resolve_run(load_config(config), world_size=1, machine=MachineFacts(0, False, 2))
    assert run.dataset.num_samples == 6


def test_resume_into_a_folder_of_another_run_is_refused_and_overwrite_cannot_delete_the_checkpoint(cli, tmp_path,
                                                                                                    capsys):
    out = tmp_path / "out"
    first = resolve_run(load_config(write_config(tmp_path, name="first.py")), world_size=2,
                        machine=MachineFacts(0, False, 2))
    elsewhere = complete_checkpoint(tmp_path / "earlier" / "checkpoint-3", first)
    earlier_run_files(out)  # an unrelated run lives in output_dir
    resume = f", resume_from_checkpoint={str(elsewhere)!r}"
    assert cli.run([str(write_config(tmp_path, extra_targs=resume))]) == 2
    assert "holds an earlier run" in capsys.readouterr().err and (out / "report.md").is_file()
    own = complete_checkpoint(out / "checkpoint-3", first)
    config = write_config(tmp_path, extra_targs=f", resume_from_checkpoint={str(own)!r}")
    assert cli.run([str(config), "--overwrite"]) == 2
    assert "would delete" in capsys.readouterr().err and (own / "run.json").is_file() and cli.calls == []


def test_torchrun_rank0_ignores_its_peers_fresh_logs(tmp_path):
    from HyperSloth.launch.local import LaunchError

    description = resolve_run(load_config(write_config(tmp_path)), world_size=2, machine=MachineFacts(0, False, 2))
    logs = tmp_path / "out" / "logs"
    logs.mkdir(parents=True)
    (logs / "rank1.log").write_text("this run's rank 1, already started")
    (logs / "rank7.log").write_text("an earlier 8-worker run")
    train_cli.prepare_output_dir(description, overwrite=False, peers_running=True)
    assert sorted(p.name for p in logs.iterdir()) == ["rank1.log"]  # the peer's log stays, rank 7's goes
    (tmp_path / "out" / "adapter_model.safetensors").write_text("an earlier run's adapter")
    with pytest.raises(LaunchError, match="holds an earlier run"):  # the launcher: nothing of this run runs yet
        train_cli.prepare_output_dir(description, overwrite=False)


# ---------------------------------------------------------------- checkpoints checked before any worker


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def _earlier_run_with_checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    """An earlier 2-worker run in `out` with complete checkpoints 3 and 6; returns (out, checkpoint-6)."""
    out = tmp_path / "out"
    earlier_run_files(out)
    first = resolve_run(load_config(write_config(tmp_path, name="first.py")), world_size=2,
                        machine=MachineFacts(0, False, 2))
    complete_checkpoint(out / "checkpoint-3", first, step=3)
    return out, complete_checkpoint(out / "checkpoint-6", first, step=6)


@pytest.mark.parametrize("damage", ["rng file missing", "optimizer cut short"])
def test_a_broken_checkpoint_is_refused_before_any_worker_naming_the_file(cli, tmp_path, capsys, damage):
    out, broken = _earlier_run_with_checkpoints(tmp_path)
    if damage == "rng file missing":
        run_files.rank_rng_file(broken, 1).unlink()
        expected = "rng_state_rank1.pth is missing"
    else:
        optimizer = broken / "optimizer.pt"
        optimizer.write_bytes(optimizer.read_bytes()[:1000])
        expected = "optimizer.pt is 1,000 bytes, the manifest says"
    before = _snapshot(out)
    assert cli.run([str(write_config(tmp_path, extra_targs=f", resume_from_checkpoint={str(broken)!r}"))]) == 2
    err = capsys.readouterr().err
    assert f"cannot resume from {broken}: {expected}" in err and "Traceback" not in err
    assert f"resume from the newest complete checkpoint, {out / 'checkpoint-3'}" in err
    assert len(err.strip().splitlines()) == 2 and cli.calls == []  # no worker (no model) started
    assert _snapshot(out) == before  # nothing written or removed


def test_latest_resumes_the_newest_complete_checkpoint_into_its_own_folder(cli, tmp_path, capsys):
    out, broken = _earlier_run_with_checkpoints(tmp_path)
    run_files.rank_rng_file(broken, 1).unlink()
    unfinished = run_files.staging_dir(out, 9) / "checkpoint-9"  # a save that a crash interrupted
    unfinished.mkdir(parents=True)
    (unfinished / run_files.TRAINER_STATE_FILE).write_text("{}")
    config = write_config(tmp_path, extra_targs=", resume_from_checkpoint='latest'")
    before = _snapshot(out)
    assert cli.run([str(config), "--overwrite"]) == 2 and cli.calls == [] and _snapshot(out) == before
    assert f"--overwrite would delete the checkpoints of {out}, which resume_from_checkpoint='latest'" in \
        capsys.readouterr().err
    assert cli.run([str(config)]) == 0
    err = capsys.readouterr().err
    assert len(cli.calls) == 1 and "holds an earlier run" not in err
    assert (f"hypersloth-train: resuming from the newest complete checkpoint, {out / 'checkpoint-3'} (skipped "
            "checkpoint-6 (rng_state_rank1.pth is missing); ignored the unfinished save tmp-checkpoint-9)\n") in err
    assert json.loads((out / "run.json").read_text())["resume_from_checkpoint"] == str(out / "checkpoint-3")
    assert not run_files.staging_dir(out, 9).exists()  # cleaned once the run was accepted
    assert not (out / "report.md").exists() and (out / "checkpoint-6").is_dir()


def test_latest_without_a_complete_checkpoint_is_one_clear_error(cli, tmp_path, capsys):
    out, broken = _earlier_run_with_checkpoints(tmp_path)
    run_files.rank_rng_file(broken, 1).unlink()
    run_files.manifest_file(out / "checkpoint-3").write_text("not json")
    assert cli.run([str(write_config(tmp_path, extra_targs=", resume_from_checkpoint='latest'"))]) == 2
    err = capsys.readouterr().err
    assert f"resume_from_checkpoint='latest': {out} holds no complete checkpoint (skipped checkpoint-6" in err
    assert "remove resume_from_checkpoint to start a new run there (with --overwrite" in err and cli.calls == []


def test_a_checkpoint_without_manifest_resumes_with_one_warning(cli, tmp_path, capsys):
    out, checkpoint = _earlier_run_with_checkpoints(tmp_path)
    run_files.manifest_file(checkpoint).unlink()  # as HyperSloth wrote checkpoints before manifests
    assert cli.run([str(write_config(tmp_path, extra_targs=f", resume_from_checkpoint={str(checkpoint)!r}"))]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"hypersloth-train: warning: {checkpoint} has no manifest.json (written by an earlier "
                        "HyperSloth): resuming with its files checked for presence and completeness only"]
    assert len(cli.calls) == 1
