"""outputs/run_files.py: the one owner of run-directory names, HYPERSLOTH_* variables and the atomic writes."""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

import pytest

from HyperSloth.outputs import run_files

PACKAGE = Path(__file__).resolve().parents[2] / "HyperSloth"
OWNER = PACKAGE / "outputs" / "run_files.py"
# A rank's file name spelled by hand (`rank{r}.log`), a glob over them, an environment variable of the
# launcher, a rename: each belongs to run_files.py alone.
OWNED_SPELLINGS = {
    "rank file name": re.compile(r"rank\{[^}]*\}\.|[\"']rank\*"),
    "HYPERSLOTH_ variable": re.compile(r"HYPERSLOTH_"),
    "os.replace": re.compile(r"os\.replace"),
}


@pytest.mark.parametrize("what", sorted(OWNED_SPELLINGS))
def test_no_module_but_run_files_spells_run_names(what):
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == OWNER:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if OWNED_SPELLINGS[what].search(line):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert offenders == [], f"{what} spelled outside run_files.py:\n" + "\n".join(offenders)


def test_the_owner_exists_and_the_scan_sees_every_stage():
    assert OWNER.is_file()
    scanned = {path.parent.name for path in PACKAGE.rglob("*.py")}
    assert {"plan", "launch", "train", "outputs", "data", "cli"} <= scanned


def test_the_pattern_finds_what_it_forbids():
    assert OWNED_SPELLINGS["rank file name"].search('logs / f"rank{rank}.log"')
    assert OWNED_SPELLINGS["rank file name"].search('glob("rank*.failure.json")')
    assert not OWNED_SPELLINGS["rank file name"].search('f"rank{r} {tokens:,}"')  # a label, not a file
    assert OWNED_SPELLINGS["os.replace"].search("    os.replace(tmp, path)")


def test_rank_file_names(tmp_path):
    assert run_files.rank_file(tmp_path, 3, "log") == tmp_path / "logs" / "rank3.log"
    assert run_files.rank_file(tmp_path, 0, "failure.json") == tmp_path / "logs" / "rank0.failure.json"
    assert run_files.rank_file_in(tmp_path / "x", 2, "pid") == tmp_path / "x" / "rank2.pid"
    assert run_files.run_file(tmp_path) == tmp_path / "run.json"
    assert run_files.checkpoint_dir(tmp_path, 30) == tmp_path / "checkpoint-30"
    assert run_files.rank_rng_file(tmp_path / "checkpoint-3", 1) == tmp_path / "checkpoint-3" / "rng_state_rank1.pth"
    assert set(run_files.TORCHRUN_VARS) >= {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}


def test_atomic_write_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "f.json"
    run_files.atomic_write_json(target, {"a": 1})
    assert target.read_text() == '{\n  "a": 1\n}\n'

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(run_files.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        run_files.atomic_write_text(target, "new")
    assert target.read_text() == '{\n  "a": 1\n}\n'
    assert [p.name for p in target.parent.iterdir()] == ["f.json"]  # no temp file left


def test_replace_dir_swaps_a_folder_in(tmp_path):
    dest, staging = tmp_path / "out", tmp_path / "staging"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    staging.mkdir()
    (staging / "new.txt").write_text("new")
    run_files.replace_dir(staging, dest)
    assert [p.name for p in dest.iterdir()] == ["new.txt"] and not staging.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old copy is gone too


def _earlier_run(out: Path, ranks: int = 16) -> None:
    (out / "logs").mkdir(parents=True)
    for r in range(ranks):
        for kind in ("log", "stderr", "failure.json", "final.json"):
            run_files.rank_file(out, r, kind).write_text("old")
    for name in ("run.json", "train_summary.json", "report.md", "report.png", "hypersloth_config.json",
                 "adapter_model.safetensors", "adapter_config.json", "tokenizer.json"):
        (out / name).write_text("old")
    (out / "README.md").write_text("---\nlibrary_name: peft\n---\n")
    (out / "checkpoint-3").mkdir()
    (out / "runs").mkdir()
    (out / "notes.txt").write_text("the user's")


def test_holds_a_run(tmp_path):
    assert not run_files.holds_a_run(tmp_path / "nope") and not run_files.holds_a_run(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    assert not run_files.holds_a_run(tmp_path)
    (tmp_path / "checkpoint-5").mkdir()
    assert run_files.holds_a_run(tmp_path)


def test_clear_run_removes_the_runs_files_and_keeps_the_users(tmp_path):
    _earlier_run(tmp_path)
    run_files.clear_run(tmp_path)
    run_files.clear_rank_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "notes.txt"]
    assert list((tmp_path / "logs").iterdir()) == []


def test_clear_results_keeps_checkpoints_and_a_users_readme(tmp_path):
    _earlier_run(tmp_path)
    (tmp_path / "README.md").write_text("my notes")
    run_files.clear_results(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "checkpoint-3", "logs", "notes.txt", "run.json",
                                                          "runs"]


def test_clear_rank_files_from_a_rank_on(tmp_path):
    _earlier_run(tmp_path)
    run_files.clear_rank_files(tmp_path, from_rank=2)
    assert sorted({p.name.split(".")[0] for p in (tmp_path / "logs").iterdir()}) == ["rank0", "rank1"]


def test_a_folder_with_nothing_to_keep_is_what_a_run_stopped_before_its_first_save_leaves(tmp_path):
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    for name in ("run.json", "run_resolved.json", "hypersloth_config.json", "logs/rank0.log"):
        (out / name).write_text("{}")
    assert run_files.holds_a_run(out) and run_files.holds_nothing_to_keep(out)
    for kept in ("checkpoint-2", "tmp-checkpoint-1", "best_adapter", "adapter_model.safetensors", "train_summary.json",
                 "model-00001-of-00002.safetensors"):
        path = out / kept
        path.mkdir() if "." not in kept else path.write_text("x")
        assert not run_files.holds_nothing_to_keep(out), kept
        path.rmdir() if path.is_dir() else path.unlink()


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_outputs_get_the_umasks_modes_not_tempfiles_owner_only_ones(tmp_path, mask):
    previous = os.umask(mask)
    try:
        written = run_files.atomic_write_text(tmp_path / "out" / "report.md", "x")
        staging = Path(tempfile.mkdtemp(dir=tmp_path))  # 0700, as export and the tiny model stage
        (staging / "sub").mkdir()
        fd, weights = tempfile.mkstemp(dir=staging / "sub")  # 0600, as safetensors writes
        os.close(fd)
        run_files.replace_dir(staging, tmp_path / "export")
        (tmp_path / "out" / "adapter_model.safetensors").write_bytes(b"w")
        os.chmod(tmp_path / "out" / "adapter_model.safetensors", 0o600)
        run_files.give_saved_model_umask_modes(tmp_path / "out")
        assert run_files.umask() == mask
    finally:
        os.umask(previous)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(written) == 0o666 & ~mask
    export = tmp_path / "export"
    assert mode(export) == mode(export / "sub") == 0o777 & ~mask
    assert mode(export / "sub" / Path(weights).name) == 0o666 & ~mask
    assert mode(tmp_path / "out" / "adapter_model.safetensors") == 0o666 & ~mask
