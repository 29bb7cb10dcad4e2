"""checkpoints.py: a save is one unit over all ranks, a resume reads only complete checkpoints.

The save protocol runs here with two ranks as threads that agree through a barrier (what the all-reduce
does between processes). A crash is a BaseException on one rank that breaks the barrier for the other,
as the launcher stops the other workers when one dies.
"""

from __future__ import annotations

import errno
import json
import struct
import threading
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from HyperSloth.outputs import checkpoints, run_files
from HyperSloth.outputs.checkpoints import CheckpointError

WORLD = 2


class Crash(BaseException):
    """The process dies here (SIGKILL, power loss): nothing after it runs on this rank."""


def torch_like_file(path: Path, payload: bytes) -> None:
    """A zip archive, as torch.save writes (with a fixed time stamp: the same content gives the same bytes)."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(zipfile.ZipInfo("data.pkl", date_time=(2026, 1, 1, 0, 0, 0)), payload)


def safetensors_file(path: Path, payload: bytes) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + payload)


def write_part(rank: int, step: int, folder: Path, fault: str | None = None) -> None:
    """What a rank writes into a checkpoint (the real file names, content fixed by step and rank);
    `fault` "before" / "during" / "after" crashes this rank at that point of its write."""
    if fault == "before":
        raise Crash
    rng = run_files.rank_rng_file(folder, rank)
    if fault == "during":
        rng.write_bytes(b"PK\x03\x04 half an RNG state")
        raise Crash
    torch_like_file(rng, f"rng {rank} {step}".encode())
    if rank == 0:
        torch_like_file(folder / "optimizer.pt", bytes(range(256)) * (40 + step))
        safetensors_file(folder / "adapter_model.safetensors", f"weights at step {step}".encode() * 50)
        (folder / run_files.TRAINER_STATE_FILE).write_text(json.dumps({"global_step": step}))
    if fault == "after":
        raise Crash


class Ranks:
    """WORLD ranks as threads; `agree` is an all-reduce of one flag between them."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(WORLD, timeout=20)
        self.flags: list[bool] = [False] * WORLD

    def agree_for(self, rank: int):
        def agree(ok: bool) -> bool:
            self.flags[rank] = ok
            self.barrier.wait()
            result = all(self.flags)
            self.barrier.wait()  # every rank has read before the next round writes
            return result
        return agree

    def run(self, target) -> list[BaseException | None]:
        """`target(rank, agree)` on every rank; what each raised."""
        errors: list[BaseException | None] = [None] * WORLD

        def main(rank: int) -> None:
            try:
                target(rank, self.agree_for(rank))
            except BaseException as err:  # noqa: B036 - a Crash must reach the test too
                errors[rank] = err
                if isinstance(err, Crash):
                    self.barrier.abort()  # the launcher stops the other ranks

        threads = [threading.Thread(target=main, args=(rank,)) for rank in range(WORLD)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        return errors


def save(out: Path, step: int, faults: dict[int, str] | None = None, **kwargs) -> list[BaseException | None]:
    faults = faults or {}

    def target(rank, agree):
        checkpoints.save_atomically(out, step, rank=rank, world_size=WORLD, agree=agree,
                                    write_part=lambda folder: write_part(rank, step, folder, faults.get(rank)),
                                    **kwargs)
    return Ranks().run(target)


def files_of(checkpoint: Path) -> dict:
    return json.loads(run_files.manifest_file(checkpoint).read_text())["files"]


@pytest.fixture
def uninterrupted(tmp_path) -> Path:
    """Checkpoints 1 and 2 of a run without faults."""
    out = tmp_path / "uninterrupted"
    assert save(out, 1) == [None, None] and save(out, 2) == [None, None]
    return out


def test_a_save_without_faults_is_complete_and_leaves_nothing_else(uninterrupted):
    assert sorted(p.name for p in uninterrupted.iterdir()) == ["checkpoint-1", "checkpoint-2"]
    check = checkpoints.verify(uninterrupted / "checkpoint-2")
    assert check.ok and not check.legacy, check.problems
    assert set(files_of(uninterrupted / "checkpoint-2")) == {
        "rng_state_rank0.pth", "rng_state_rank1.pth", "optimizer.pt", "adapter_model.safetensors",
        run_files.TRAINER_STATE_FILE}


FAULTS = [(rank, point) for rank in range(WORLD) for point in ("before", "during", "after")]


@pytest.mark.parametrize("where", [*FAULTS, "before the rename", "after the rename"], ids=str)
def test_a_crash_anywhere_in_a_save_leaves_only_complete_checkpoints(tmp_path, uninterrupted, monkeypatch, where):
    out = tmp_path / "crashed"
    assert save(out, 1) == [None, None]
    faults = {}
    if isinstance(where, tuple):
        faults = {where[0]: where[1]}
    else:
        replace_dir = run_files.replace_dir

        def crash_at_rename(source, target):
            if where == "after the rename":
                replace_dir(source, target)
            raise Crash
        monkeypatch.setattr(run_files, "replace_dir", crash_at_rename)
    errors = save(out, 2, faults)
    assert any(isinstance(e, Crash) for e in errors), errors
    published = where == "after the rename"
    assert [p.name for p in run_files.checkpoint_dirs(out)] == ["checkpoint-1"] + (["checkpoint-2"] if published else [])
    assert all(checkpoints.verify(p).ok for p in run_files.checkpoint_dirs(out))
    latest = checkpoints.find_latest(out)
    # The checkpoint a resume picks holds exactly what the uninterrupted run saved at that step (the
    # end-to-end resume from it equals the uninterrupted run: tests/integration/test_training.py).
    expected = uninterrupted / latest.chosen.path.name
    assert latest.chosen.path.name == ("checkpoint-2" if published else "checkpoint-1")
    assert files_of(latest.chosen.path) == files_of(expected)
    if not published:
        assert latest.unfinished == (run_files.staging_dir(out, 2),)
        assert "ignored the unfinished save tmp-checkpoint-2" in latest.notes()[0]
    # The next run removes the unfinished save; its own save of step 2 equals the uninterrupted one.
    monkeypatch.undo()
    checkpoints.remove_unfinished(out)
    assert save(out, 2) == [None, None]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert files_of(out / "checkpoint-2") == files_of(uninterrupted / "checkpoint-2")


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_full_disk_stops_every_rank_with_a_clear_message_and_keeps_the_previous_checkpoint(tmp_path, failing_rank):
    out = tmp_path / "out"
    assert save(out, 1) == [None, None]

    def target(rank, agree):
        def part(folder):
            if rank == failing_rank:
                raise OSError(errno.ENOSPC, "No space left on device", str(folder / "optimizer.pt"))
            write_part(rank, 2, folder)
        checkpoints.save_atomically(out, 2, rank=rank, world_size=WORLD, agree=agree, write_part=part)

    errors = Ranks().run(target)
    assert all(isinstance(e, CheckpointError) for e in errors), errors
    mine, other = str(errors[failing_rank]), str(errors[1 - failing_rank])
    assert f"could not save checkpoint-2: rank {failing_rank} failed to write its part: OSError" in mine
    assert "No space left on device" in mine and "another rank failed" in other
    for message in (mine, other):
        assert f"newest complete checkpoint is {out / 'checkpoint-1'}" in message and "'latest'" in message
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1"]  # the unfinished folder is gone
    assert checkpoints.find_latest(out).chosen.path == out / "checkpoint-1"


def test_verify_names_the_missing_rng_file_and_the_truncated_one(uninterrupted):
    checkpoint = uninterrupted / "checkpoint-2"
    run_files.rank_rng_file(checkpoint, 1).unlink()
    optimizer = checkpoint / "optimizer.pt"
    size = optimizer.stat().st_size
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    check = checkpoints.verify(checkpoint)
    assert check.problems == (f"optimizer.pt is 100 bytes, the manifest says {size:,} (cut short)",
                              "rng_state_rank1.pth is missing")
    message = checkpoints.resume_problem(check)
    assert message.startswith(f"cannot resume from {checkpoint}: optimizer.pt is 100 bytes")
    assert f"resume from the newest complete checkpoint, {uninterrupted / 'checkpoint-1'}" in message


def test_a_changed_byte_is_found_by_the_hash(uninterrupted):
    state = uninterrupted / "checkpoint-2" / run_files.TRAINER_STATE_FILE
    state.write_text(state.read_text().replace("2", "3"))
    assert checkpoints.verify(state.parent).problems == (
        "trainer_state.json does not match its sha256 in the manifest (corrupt)",)


def test_large_files_are_sampled_at_start_and_hashed_whole_in_the_background(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints, "LARGE_FILE_BYTES", 1000)
    monkeypatch.setattr(checkpoints, "SAMPLE_BYTES", 10)
    out = tmp_path / "out"
    assert save(out, 1) == [None, None]
    checkpoint = out / "checkpoint-1"
    assert checkpoints.large_files(checkpoint) == ["optimizer.pt"]  # 10 kB; the rest are small
    data = bytearray((checkpoint / "optimizer.pt").read_bytes())
    offsets = checkpoints._sample_offsets(len(data))
    unsampled = next(i for i in range(len(data)) if not any(o <= i < o + 10 for o in offsets))
    data[unsampled] ^= 0xFF  # a flipped byte between the samples: same size, same samples
    (checkpoint / "optimizer.pt").write_bytes(bytes(data))
    assert checkpoints.verify(checkpoint).ok
    # Rank 0 hashes them whole while the model loads, and stops before the checkpoint is loaded.
    from HyperSloth.train import worker

    future = worker._check_large_files(SimpleNamespace(resume_from_checkpoint=str(checkpoint)))
    problems = future.result(timeout=10)
    assert problems == ["optimizer.pt does not match its sha256 in the manifest (corrupt)"]
    with pytest.raises(CheckpointError, match=r"cannot resume from .*checkpoint-1: optimizer.pt does not match"):
        worker._refuse_corrupt(str(checkpoint), problems)
    worker._refuse_corrupt(str(checkpoint), [])  # nothing found: the run goes on
    (checkpoint / "optimizer.pt").rename(checkpoint / "moved.pt")  # gone since the launcher's check
    assert checkpoints.verify_large_files(checkpoint, ["optimizer.pt"]) == [
        "optimizer.pt cannot be read (No such file or directory)"]
    (checkpoint / "moved.pt").rename(checkpoint / "optimizer.pt")
    data[0] ^= 0xFF  # in the first sample: found at start
    (checkpoint / "optimizer.pt").write_bytes(bytes(data))
    assert checkpoints.verify(checkpoint).problems == ("optimizer.pt does not match its sha256 in the manifest (corrupt)",)


def test_checkpoints_without_manifest_are_checked_by_their_files(tmp_path):
    legacy = tmp_path / "checkpoint-3"
    legacy.mkdir()
    (legacy / run_files.TRAINER_STATE_FILE).write_text("{}")
    (legacy / run_files.RUN_FILE).write_text(json.dumps({"world_size": 2}))
    for rank in range(2):
        torch_like_file(run_files.rank_rng_file(legacy, rank), b"state")
    safetensors_file(legacy / "adapter_model.safetensors", b"x" * 100)
    check = checkpoints.verify(legacy)
    assert check.ok and check.legacy
    assert "has no manifest.json" in checkpoints.legacy_note(check)
    run_files.rank_rng_file(legacy, 1).unlink()
    weights = legacy / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    rng0 = run_files.rank_rng_file(legacy, 0)
    rng0.write_bytes(rng0.read_bytes()[:-5])
    missing, weights_problem, rng_problem = checkpoints.verify(legacy).problems
    assert missing == "rng_state_rank1.pth (rank 1's RNG state) is missing"
    assert weights_problem.startswith("adapter_model.safetensors is not a complete safetensors file (")
    assert rng_problem == "rng_state_rank0.pth is not a complete torch file (cut short?)"


def test_latest_skips_broken_checkpoints_and_says_so(uninterrupted):
    run_files.rank_rng_file(uninterrupted / "checkpoint-2", 1).unlink()
    latest = checkpoints.find_latest(uninterrupted)
    assert latest.chosen.path == uninterrupted / "checkpoint-1"
    assert latest.notes() == (f"resuming from the newest complete checkpoint, {uninterrupted / 'checkpoint-1'} "
                              "(skipped checkpoint-2 (rng_state_rank1.pth is missing))",)
    run_files.manifest_file(uninterrupted / "checkpoint-1").write_text("{")
    none = checkpoints.find_latest(uninterrupted)
    assert none.chosen is None
    assert none.none_message().startswith(f"resume_from_checkpoint='latest': {uninterrupted} holds no complete "
                                          "checkpoint (skipped checkpoint-2 (")
    assert "checkpoint-1 (manifest.json cannot be read" in none.none_message()


def test_rotation_keeps_the_newest_checkpoints_and_never_the_one_just_written(tmp_path):
    out = tmp_path / "out"
    for step in (1, 2, 4):
        assert save(out, step, save_total_limit=2) == [None, None]
    assert [p.name for p in run_files.checkpoint_dirs(out)] == ["checkpoint-2", "checkpoint-4"]
    # A run resumed from checkpoint-2 writes checkpoint-3: that one stays although 4 is newer by step.
    assert save(out, 3, save_total_limit=1) == [None, None]
    assert [p.name for p in out.iterdir()] == ["checkpoint-3"]
    assert checkpoints.rotate(out, None) == []


def test_a_failed_save_ends_the_worker_with_its_message_and_no_traceback(monkeypatch, capsys):
    from HyperSloth.train import dist, worker

    message = ("could not save checkpoint-2: rank 1 failed to write its part: OSError: [Errno 28] No space left "
               "on device. The newest complete checkpoint is /out/checkpoint-1: ...")

    def failing_run(description, info, timeline):
        raise CheckpointError(message)

    monkeypatch.setattr(worker, "run", failing_run)
    with pytest.raises(SystemExit) as exit_info:
        worker.main(None, dist.DistInfo(rank=1, world_size=2))
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"[rank 1] error: {message}\n" in err and "Traceback" not in err
    assert dist.all_ranks_ok(False) is False and dist.all_ranks_ok(True) is True  # one process: its own flag


def test_the_stop_message_says_how_to_go_on(uninterrupted, tmp_path):
    assert checkpoints.resume_hint(uninterrupted) == (
        f"to continue from {uninterrupted / 'checkpoint-2'}, set resume_from_checkpoint='latest' in the config's "
        "TrainingArgsConfig and run the same command")
    assert checkpoints.resume_hint(tmp_path / "nothing-saved").startswith("no checkpoint was saved yet: run the same "
                                                                          "command again")
