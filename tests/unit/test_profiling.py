"""The profile's arithmetic: GPU busy time is the union of the device events, and paused phase timing keeps
one (empty) entry per step so the breakdown stays aligned with the step count."""

from __future__ import annotations

import pytest

from HyperSloth.train.profiling import PhaseTimer, busy_seconds


def test_busy_time_counts_overlapping_events_once():
    assert busy_seconds([]) == 0
    assert busy_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert busy_seconds([(3.0, 4.0), (0.0, 5.0), (1.0, 2.0)]) == pytest.approx(5.0)  # nested, unsorted
    assert busy_seconds([(0.0, 1.0), (1.0, 2.0)]) == pytest.approx(2.0)  # touching


def test_paused_steps_keep_the_breakdown_aligned_and_out_of_the_mean():
    timer = PhaseTimer(enabled=True)
    for step in range(5):
        timer.paused = step in (2, 3)
        timer.restart()
        timer.mark("forward")
        if timer.paused:
            timer.skip_step()
        timer.steps += 1
    assert len(timer.per_step) == 5
    assert [bool(s) for s in timer.per_step] == [True, True, False, False, True]
    mean = timer.mean_per_step(skip=2)  # steps 3-5, of which only step 5 has marks
    assert mean["forward"] == pytest.approx(timer.per_step[4]["forward"])


def _state(step: int):
    from transformers import TrainerState

    state = TrainerState()
    state.global_step = step
    return state


def test_memory_snapshot_steps_come_from_the_environment():
    from HyperSloth.outputs.run_files import ENV_MEMORY_SNAPSHOT
    from HyperSloth.outputs.run_files import memory_snapshot_steps

    assert memory_snapshot_steps({}) == 0
    assert memory_snapshot_steps({ENV_MEMORY_SNAPSHOT: " 3 "}) == 3
    for bad in ("-1", "2.5", "yes"):
        with pytest.raises(ValueError, match="number of optimizer steps"):
            memory_snapshot_steps({ENV_MEMORY_SNAPSHOT: bad})


def test_memory_snapshot_records_steps_one_to_n_then_stops(tmp_path, monkeypatch):
    """Recording starts with training and the snapshot is dumped, and recording stopped, at the end of step N;
    later steps and the end of training write nothing more."""
    import torch

    from HyperSloth.train.profiling import MemorySnapshot

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: calls.append(("record", enabled, kw.get("max_entries"))))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: (calls.append(("dump", path)),
                                                                            open(path, "wb").close()))
    path = tmp_path / "logs" / "rank0.memory_snapshot.pickle"
    snapshot = MemorySnapshot(path, steps=2)
    snapshot.on_train_begin(None, _state(0), None)
    assert calls == [("record", "all", 1_000_000)] and snapshot.recording
    snapshot.on_step_end(None, _state(1), None)
    assert len(calls) == 1 and not path.exists()
    snapshot.on_step_end(None, _state(2), None)
    assert calls[1:] == [("dump", str(path)), ("record", None, None)]
    assert path.exists() and snapshot.written == path and not snapshot.recording
    snapshot.on_step_end(None, _state(3), None)
    snapshot.on_train_end(None, _state(3), None)
    assert len(calls) == 3


def test_memory_snapshot_of_a_run_shorter_than_n_is_written_at_its_end(tmp_path, monkeypatch):
    import torch

    from HyperSloth.train.profiling import MemorySnapshot

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 0)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda enabled="all", **kw: None)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: open(path, "wb").close())
    snapshot = MemorySnapshot(tmp_path / "snap.pickle", steps=10)
    snapshot.on_train_begin(None, _state(0), None)
    snapshot.on_step_end(None, _state(1), None)
    assert snapshot.written is None
    snapshot.on_train_end(None, _state(1), None)
    assert snapshot.written == tmp_path / "snap.pickle" and snapshot.written.exists()


def test_memory_snapshot_without_cuda_warns_and_writes_nothing(tmp_path, monkeypatch):
    import torch
    from loguru import logger

    from HyperSloth.train.profiling import MemorySnapshot

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    messages = []
    sink = logger.add(lambda m: messages.append(str(m)), level="WARNING")
    try:
        snapshot = MemorySnapshot(tmp_path / "snap.pickle", steps=1)
        snapshot.on_train_begin(None, _state(0), None)
        snapshot.on_step_end(None, _state(1), None)
        snapshot.on_train_end(None, _state(1), None)
    finally:
        logger.remove(sink)
    assert not snapshot.recording and snapshot.written is None and not (tmp_path / "snap.pickle").exists()
    assert any("no CUDA device" in m for m in messages)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        MemorySnapshot(tmp_path / "x", steps=0)
