"""Step timing and the optional per-phase breakdown (data, forward, backward, all-reduce, clip, optimizer).

`StepClock` always runs: one CUDA synchronise per optimizer step (HF's per-step loss logging syncs
anyway), giving wall seconds per step for the run summary and the benchmark. It also closes the
start-up timeline (HyperSloth.outputs.startup): graph capture, the Trainer's set-up and step 1. `PhaseTimer` runs only
with `training.profile=True`: it synchronises between phases, which costs a little speed, so it is
meant for finding the next bottleneck, not for the headline numbers.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from loguru import logger
from transformers import TrainerCallback

from HyperSloth.outputs.startup import StartupTimeline

PHASES = ("data", "forward", "backward", "allreduce", "clip", "optimizer")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseTimer:
    """Accumulates seconds per phase; `mark(name)` closes the phase running since the last mark."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.per_step: list[dict[str, float]] = []
        self.steps = 0
        self._last = time.perf_counter()

    def restart(self) -> None:
        if self.enabled:
            _sync()
            self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if not self.enabled:
            return
        _sync()
        now = time.perf_counter()
        if len(self.per_step) <= self.steps:
            self.per_step.append(defaultdict(float))
        self.per_step[self.steps][phase] += now - self._last
        self._last = now

    @contextmanager
    def phase(self, name: str):
        self.restart()
        yield
        self.mark(name)

    def mean_per_step(self, skip: int = 2) -> dict[str, float]:
        """Mean seconds per optimizer step for each phase, leaving out the first `skip` steps (compilation
        and warm-up) when there are more; empty when disabled."""
        steps = self.per_step[skip:] if len(self.per_step) > skip else self.per_step
        if not self.enabled or not steps:
            return {}
        return {p: sum(s.get(p, 0.0) for s in steps) / len(steps) for p in PHASES}


class StepClock(TrainerCallback):
    """Wall time of every optimizer step, plus the phase marks around the optimizer."""

    def __init__(self, timer: PhaseTimer, startup: StartupTimeline | None = None):
        self.timer = timer
        self.stamps: list[float] = []
        self.first_step_end_unix: float | None = None  # wall clock: start-up = this - the launch time
        self.startup = startup  # the worker's start-up timeline, closed at the end of step 1 (None: not kept)

    def mark_startup(self, phase: str) -> None:
        """A start-up phase ended now (nothing once step 1 has ended, or without a timeline)."""
        if self.startup is not None and self.first_step_end_unix is None:
            self.startup.mark(phase)

    def on_train_begin(self, args, state, control, **kwargs):
        _sync()
        self.stamps = [time.perf_counter()]
        self.mark_startup("train_setup")
        self.timer.restart()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.timer.mark("clip")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.timer.mark("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        self.stamps.append(time.perf_counter())
        if self.first_step_end_unix is None:
            self.mark_startup("first_step")
            self.first_step_end_unix = time.time()
            if self.startup is not None:  # every rank in its own log; rank 0's also on the console
                logger.info(self.startup.line())
        self.timer.steps += 1
        self.timer.restart()  # what follows until the next forward is data loading

    def on_train_end(self, args, state, control, **kwargs):
        # Every rank logs its own breakdown (rank 0's summary alone cannot show which rank waits).
        if self.timer.enabled:
            logger.info("PHASES " + json.dumps([dict(step) for step in self.timer.per_step]))

    def step_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]
