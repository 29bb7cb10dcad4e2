"""The start-up timeline: where the time goes from `hypersloth-train` starting to the end of step 1.

Each process marks the end of each start-up phase with a wall-clock stamp (`time.time()`: the launcher's
and the workers' stamps are compared across processes, so a per-process monotonic clock would not do).
The launcher hands its stamps to every worker in one environment variable (run_files.ENV_LAUNCH_STAMPS);
the worker adds its own, and rank 0 writes the timeline into train_summary.json as `startup`
(`StartupTimeline.record`). Marking costs a clock read and a list append: no device synchronisation
(the first-step stamp comes after the synchronise `StepClock` does anyway).

Phases, in order (`PHASES`; a run marks those that apply: `unsloth_import` only with Unsloth,
`rendezvous` and `worker_start` only when the launcher spawns the workers, `packing_check` only for packed rows):

    launcher_start   interpreter start, CLI imports, command line parsed
    launcher_checks  config loaded, GPUs counted, dataset/model/output folder checked, plan resolved, run.json
    rendezvous       the run's rendezvous store bound (tmux: the monitor window's)
    worker_start     the worker process started (fork/exec, until the interpreter runs)
    worker_imports   the worker's module imports (torch, ...)
    unsloth_import   Unsloth imported (it patches transformers/trl)
    dist_init        process group created (every rank joins)
    train_imports    transformers, datasets
    dataset          the dataset's sample lengths read
    model_load       base model and tokenizer loaded
    adapter          LoRA adapters attached
    packing_check    a packed run's model measured to keep packed samples apart (train/packing/check.py)
    budget_probe     "auto" micro-batch budget measured on the GPU (0 when fixed or on CPU)
    trainer_built    dataset split, plan steps, trainer (and its CUDA graphs installed)
    graph_capture    CUDA graphs captured for the planned row lengths (0 without graphs)
    train_setup      the HF Trainer's set-up before the first step (optimizer, data loader, callbacks)
    first_step       the first optimizer step, up to its end

A phase that happens twice (the model reloaded with gradient checkpointing after a first probe) adds up.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from HyperSloth.outputs.run_files import ENV_LAUNCH_STAMPS

PHASES = (
    "launcher_start", "launcher_checks", "rendezvous", "worker_start", "worker_imports", "unsloth_import",
    "dist_init", "train_imports", "dataset", "model_load", "adapter", "packing_check", "budget_probe", "trainer_built",
    "graph_capture", "train_setup", "first_step",
)  # fmt: skip


def process_start_unix() -> float | None:
    """When this process started (wall clock, 10 ms resolution), from Linux's /proc; None elsewhere.

    It covers what runs before our first line: fork/exec, the interpreter's own start-up and site-packages'
    .pth files. /proc gives the start in clock ticks since boot; CLOCK_BOOTTIME is the same clock now."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # the name may hold spaces and ")"
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime (fields[0] is field 3)
        started = time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return started if started <= time.time() else None


@dataclass
class StartupTimeline:
    """Stamps (unix seconds) at the end of each phase since `launch_unix`, in the order they were marked."""

    launch_unix: float
    marks: list[tuple[str, float]] = field(default_factory=list)

    @classmethod
    def starting_now(cls) -> StartupTimeline:
        """A timeline launched when this process started (now, where the start is unknown)."""
        return cls(process_start_unix() or time.time())

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> StartupTimeline:
        """The launcher's timeline passed in `env`, else one launched when this process started (a worker
        started by hand or by torchrun)."""
        value = env.get(ENV_LAUNCH_STAMPS)
        if not value:
            return cls.starting_now()
        data = json.loads(value)
        return cls(float(data["launch_unix"]), [(str(p), float(t)) for p, t in data["marks"]])

    def to_env(self) -> dict[str, str]:
        """The environment entry that hands this timeline to a worker (one line: tmux passes it inline)."""
        return {ENV_LAUNCH_STAMPS: json.dumps({"launch_unix": self.launch_unix, "marks": self.marks})}

    def mark(self, phase: str, at: float | None = None) -> None:
        """`phase` ended now (or at unix time `at`, a stamp taken elsewhere)."""
        self.marks.append((phase, time.time() if at is None else at))

    def marks_from(self, stamps: Mapping[str, float]) -> None:
        """Add stamps taken elsewhere ({phase: unix time}), in time order."""
        for phase, at in sorted(stamps.items(), key=lambda item: item[1]):
            self.mark(phase, at)

    def record(self) -> dict[str, Any]:
        """train_summary.json's `startup`: `phase_s` (seconds each phase took: its stamp minus the one before),
        `end_s` (seconds from launch to each phase's end, ordered by it) and `total_s` (to the last stamp)."""
        phase_s: dict[str, float] = {}
        end_s: dict[str, float] = {}
        previous = self.launch_unix
        for phase, at in self.marks:
            phase_s[phase] = round(phase_s.get(phase, 0.0) + at - previous, 3)
            end_s.pop(phase, None)  # a phase seen twice ends at its last stamp
            end_s[phase] = round(at - self.launch_unix, 3)
            previous = at
        total = round(previous - self.launch_unix, 3)
        return {"launch_unix": self.launch_unix, "total_s": total, "phase_s": phase_s, "end_s": end_s}

    def line(self) -> str:
        """One log line: the total and each phase's seconds, in order."""
        record = self.record()
        parts = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in record["phase_s"].items())
        return f"start-up {record['total_s']:.1f} s to the end of step 1 (seconds per phase: {parts})"
