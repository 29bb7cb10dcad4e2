"""The start-up timeline (outputs/startup.py): stamps per phase from `hypersloth-train` starting to the end of
step 1, handed from the launcher to the workers, closed by the trainer's StepClock."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from HyperSloth.outputs import run_files
from HyperSloth.outputs.startup import PHASES, StartupTimeline, process_start_unix


def test_the_record_gives_each_phase_its_seconds_and_its_end_since_launch():
    timeline = StartupTimeline(1000.0)
    for phase, at in [("launcher_start", 1000.5), ("launcher_checks", 1001.0), ("model_load", 1004.0),
                      ("first_step", 1006.25)]:
        timeline.mark(phase, at)
    record = timeline.record()
    assert record["phase_s"] == {"launcher_start": 0.5, "launcher_checks": 0.5, "model_load": 3.0, "first_step": 2.25}
    assert record["end_s"] == {"launcher_start": 0.5, "launcher_checks": 1.0, "model_load": 4.0, "first_step": 6.25}
    assert record["total_s"] == 6.25 == sum(record["phase_s"].values()) and record["launch_unix"] == 1000.0
    assert timeline.line() == ("start-up 6.2 s to the end of step 1 (seconds per phase: launcher_start 0.50, "
                               "launcher_checks 0.50, model_load 3.00, first_step 2.25)")


def test_a_phase_seen_twice_adds_up_and_ends_at_its_last_stamp():
    """A model reloaded with checkpointing after a first probe: load, probe, load again, probe again."""
    timeline = StartupTimeline(0.0)
    for phase, at in [("model_load", 2.0), ("budget_probe", 3.0), ("model_load", 5.0), ("budget_probe", 5.5),
                      ("first_step", 6.0)]:
        timeline.mark(phase, at)
    record = timeline.record()
    assert record["phase_s"] == {"model_load": 4.0, "budget_probe": 1.5, "first_step": 0.5}
    assert list(record["end_s"].items()) == [("model_load", 5.0), ("budget_probe", 5.5), ("first_step", 6.0)]


def test_stamps_taken_elsewhere_go_in_by_time():
    timeline = StartupTimeline(0.0, [("dataset", 1.0)])
    timeline.marks_from({"adapter": 3.0, "model_load": 2.0})
    assert [phase for phase, _ in timeline.marks] == ["dataset", "model_load", "adapter"]


def test_the_launcher_hands_its_stamps_to_the_worker_in_one_line():
    launcher = StartupTimeline(1000.0, [("launcher_start", 1000.25), ("launcher_checks", 1001.5)])
    env = launcher.to_env()
    assert list(env) == [run_files.ENV_LAUNCH_STAMPS] and "\n" not in env[run_files.ENV_LAUNCH_STAMPS]  # tmux inlines it
    worker = StartupTimeline.from_env({**env, "OTHER": "x"})
    assert worker == launcher and worker is not launcher


def test_a_worker_started_without_the_launcher_counts_from_its_own_start():
    before = process_start_unix()
    timeline = StartupTimeline.from_env({})
    # This process's start however long ago it was (a pytest worker may be older than any fixed window);
    # without /proc, the moment the timeline was made.
    assert timeline.marks == [] and timeline.launch_unix <= time.time()
    if before is not None:
        assert timeline.launch_unix == pytest.approx(before, abs=0.05)


@pytest.mark.skipif(process_start_unix() is None, reason="no /proc: the process start is unknown")
def test_the_process_start_is_when_the_process_was_started():
    before = time.time()
    code = "import time; from HyperSloth.outputs.startup import process_start_unix as s; print(json.dumps([s(), time.time()]))"
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    started, first_line = json.loads(out.stdout)
    # /proc counts in clock ticks (10 ms); the interpreter's start-up lies between the two.
    assert before - 0.02 <= started <= first_line


def test_the_documented_phases_are_the_ones_the_code_marks():
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "HyperSloth"
    source = "\n".join(p.read_text() for p in package.rglob("*.py") if p.name != "startup.py")  # PHASES' home
    assert [phase for phase in PHASES if f'"{phase}"' not in source] == []  # each one is marked somewhere


class _State:
    global_step = 0


def test_the_step_clock_closes_the_timeline_at_the_end_of_step_1():
    from loguru import logger

    from HyperSloth.train.profiling import PhaseTimer, StepClock

    timeline = StartupTimeline(time.time() - 5.0, [("trainer_built", time.time() - 1.0)])
    clock = StepClock(PhaseTimer(False), startup=timeline)
    lines: list[str] = []
    handler = logger.add(lambda message: lines.append(str(message)), format="{message}")
    try:
        clock.mark_startup("graph_capture")
        clock.on_train_begin(None, _State(), None)
        clock.on_step_end(None, _State(), None)
        clock.mark_startup("graph_capture")  # after step 1: not start-up any more
        clock.on_step_end(None, _State(), None)
    finally:
        logger.remove(handler)
    assert [phase for phase, _ in timeline.marks] == ["trainer_built", "graph_capture", "train_setup", "first_step"]
    assert timeline.marks[-1][1] <= clock.first_step_end_unix
    assert [line for line in lines if line.startswith("start-up ")] == [timeline.line() + "\n"]
