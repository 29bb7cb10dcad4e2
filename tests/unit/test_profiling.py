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
