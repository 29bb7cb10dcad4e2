"""Step timing and the optional per-phase breakdown (data, forward, backward, all-reduce, clip, optimizer).

`StepClock` always runs: one CUDA synchronise per optimizer step (HF's per-step loss logging syncs
anyway), giving wall seconds per step for the run summary and the benchmark. It also closes the
start-up timeline (HyperSloth.outputs.startup): graph capture, the Trainer's set-up and step 1. `PhaseTimer` runs only
with `training.profile=True`: it synchronises between phases, which costs a little speed, so it is
meant for finding the next bottleneck, not for the headline numbers. With it, `KernelProfile` runs
torch.profiler over a few steps after the warm-up (phase syncs paused there, so the trace shows the real
overlap of host and GPU): how long the GPU was busy against the wall, kernels per step, the top operators,
and a Chrome trace. `MemorySnapshot` (run_files.ENV_MEMORY_SNAPSHOT=N) records the CUDA caching allocator's
history over steps 1..N and writes it for https://pytorch.org/memory_viz: which tensors, allocated where,
make each step's peak.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from transformers import TrainerCallback

from HyperSloth.outputs.startup import StartupTimeline

PHASES = ("data", "forward", "backward", "allreduce", "clip", "optimizer")
PROFILE_TABLE, PROFILE_TRACE = "profile_kernels.txt", "profile_trace.json.gz"  # rank file kinds (KernelProfile)
MEMORY_SNAPSHOT = "memory_snapshot.pickle"  # rank file kind (MemorySnapshot)


def cuda_event_ms(fn: Callable[[], Any], reps: int) -> list[float]:
    """`fn`'s milliseconds on the GPU, `reps` times, each between two CUDA events (the attention benchmarks, the
    FA4 check at start)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def captured(step: Callable[..., Any], inputs: tuple) -> tuple[Callable[[], None], Any]:
    """`step(*inputs)` captured in a CUDA graph after a warm-up on a side stream (as train/step_graph.py does):
    (its replay, its outputs), for timing a kernel the way a graphed decoder runs it (the FA4 check at start, the
    attention benchmarks)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        outputs = step(*inputs)
    return graph.replay, outputs


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseTimer:
    """Accumulates seconds per phase; `mark(name)` closes the phase running since the last mark."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.paused = False  # steps under KernelProfile: no phase syncs (they would hide the host/GPU overlap)
        self.per_step: list[dict[str, float]] = []
        self.steps = 0
        self._last = time.perf_counter()

    def restart(self) -> None:
        if self.enabled and not self.paused:
            _sync()
            self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if not self.enabled or self.paused:
            return
        _sync()
        now = time.perf_counter()
        if len(self.per_step) <= self.steps:
            self.per_step.append(defaultdict(float))
        self.per_step[self.steps][phase] += now - self._last
        self._last = now

    def skip_step(self) -> None:
        """This step had no phase marks (paused): keep the per-step list aligned with the step count."""
        if self.enabled and len(self.per_step) <= self.steps:
            self.per_step.append(defaultdict(float))

    @contextmanager
    def phase(self, name: str):
        self.restart()
        yield
        self.mark(name)

    def mean_per_step(self, skip: int = 2) -> dict[str, float]:
        """Mean seconds per optimizer step for each phase, leaving out the first `skip` steps (compilation
        and warm-up) when there are more; empty when disabled."""
        steps = [s for s in (self.per_step[skip:] if len(self.per_step) > skip else self.per_step) if s]
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
        if self.timer.paused:
            self.timer.skip_step()
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


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (the time at least one of them was running)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


class KernelProfile(TrainerCallback):
    """torch.profiler over optimizer steps `first` .. `first + count - 1` (1-based; after graph capture and the
    warm-up of new row lengths), with the phase syncs paused. Writes `table` (the operators and kernels by
    device time, then by host time) and `trace` (a gzipped Chrome trace with Python stacks, for Perfetto or
    chrome://tracing; in a run each rank writes its own, as the rank files PROFILE_TABLE and PROFILE_TRACE in
    the logs folder), and keeps a summary for train_summary.json: wall seconds per step, the seconds the GPU was busy
    (union of kernels, copies and sets), kernels per step."""

    def __init__(self, timer: PhaseTimer, clock: StepClock, table: str | Path, trace: str | Path, first: int = 4,
                 count: int = 3):
        self.timer, self.clock = timer, clock
        self.table, self.trace = Path(table), Path(trace)
        self.first, self.count = first, count
        self.summary: dict[str, Any] | None = None
        self._profiler = None
        self._first_stamp = 0

    def on_step_begin(self, args, state, control, **kwargs):
        if self._profiler is None and self.summary is None and state.global_step + 1 == self.first:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            _sync()
            self.timer.paused = True
            self._first_stamp = len(self.clock.stamps) - 1
            # with_stack: the Python functions too, so host time between kernels has names in the trace.
            self._profiler = profile(activities=activities, record_shapes=False, with_stack=True)
            self._profiler.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self._profiler is not None and state.global_step >= self.first + self.count - 1:
            self._finish()

    def on_train_end(self, args, state, control, **kwargs):
        if self._profiler is not None:  # the run ended inside the profiled steps
            self._finish()

    def _finish(self) -> None:
        _sync()
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        self.timer.paused = False
        self.timer.restart()  # the next step's phases start now, not when the clock's restart was skipped
        # The clock comes before this callback, so the stamp of the step just ended exists: the profiled steps
        # span the clock's stamps from the one taken when the profiler started.
        stamps = self.clock.stamps[self._first_stamp:]
        steps = max(len(stamps) - 1, 1)
        wall = (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
        from torch.autograd import DeviceType

        device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        busy = busy_seconds([(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in device])
        self.summary = {"steps": steps, "wall_s_per_step": round(wall / steps, 5),
                        "gpu_busy_s_per_step": round(busy / steps, 5) if device else None,
                        "gpu_events_per_step": round(len(device) / steps, 1)}
        self.table.parent.mkdir(parents=True, exist_ok=True)
        averages = prof.key_averages()
        by_device = averages.table(sort_by="self_device_time_total", row_limit=40) if device else ""
        by_host = averages.table(sort_by="self_cpu_time_total", row_limit=40)
        self.table.write_text(
            f"{json.dumps(self.summary)}\n\nby device time\n{by_device}\n\nby host time\n{by_host}\n")
        prof.export_chrome_trace(str(self.trace))
        logger.info("KERNEL_PROFILE " + json.dumps(self.summary))


class MemorySnapshot(TrainerCallback):
    """The CUDA caching allocator's history (every allocation and free, with its Python and C++ stack) over
    optimizer steps 1..`steps`, dumped to `path` at the end of step `steps`, or at the end of training if it
    ends first. Open the file at https://pytorch.org/memory_viz, or summarise it with scripts/memory_peak.py.
    Recording costs host time on every allocation: for finding where memory goes, not for timed runs.
    Without CUDA there is no allocator to record: one warning, and nothing is written."""

    def __init__(self, path: str | Path, steps: int, max_entries: int = 1_000_000):
        if steps < 1:
            raise ValueError(f"steps must be >= 1; got {steps}")
        self.path, self.steps, self.max_entries = Path(path), steps, max_entries
        self.recording = False
        self.written: Path | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not torch.cuda.is_available():
            logger.warning("memory snapshot: no CUDA device, so no allocator history to record; nothing written")
            return
        torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
        self.recording = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.recording and state.global_step >= self.steps:
            self._finish(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.recording:
            self._finish(state.global_step)

    def _finish(self, step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            torch.cuda.memory._dump_snapshot(str(self.path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False
        self.written = self.path
        logger.info(f"memory snapshot of steps 1-{step} (peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB "
                    f"allocated): {self.path}; open it at https://pytorch.org/memory_viz or summarise it with "
                    f"scripts/memory_peak.py")
