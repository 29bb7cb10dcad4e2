"""Start one worker process per GPU, watch them, and stop them all as soon as one fails.

Three ways to run the workers of `training.gpus`:
- `launch`: child processes of this one (the default). Each child gets its own session/process
  group, so a stop signal reaches the worker and anything it forked (data-loader workers), and a
  parent-death signal (Linux), so it dies with the launcher even when the launcher is SIGKILLed.
- `launch_tmux` (in tmux.py): one tmux window per rank plus a `main` window.
- torchrun: nothing is spawned here; `is_torchrun_env` lets the CLI call the worker in-process.

The worker contract (environment, argv, log paths) lives in `worker_env` / `build_worker_specs`.
The rendezvous port is owned by this process from the moment it is chosen: `launch` binds it itself
(port 0: the kernel picks a free one), serves the run's TCPStore on it and holds it until the workers are
gone, so no other process can take the port between choosing and binding (see `rendezvous`).
This module imports no model code, and torch only once the workers run (for the store): GPUs are counted
without it where that is certain (`devices`), so no worker waits for the launcher's torch import.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from HyperSloth.launch.devices import cuda_device_count  # noqa: F401 - the launcher's GPU count (cli, tmux)
from HyperSloth.launch.node_worker import pdeathsig_setter
from HyperSloth.outputs import checkpoints, run_files
from HyperSloth.outputs.startup import StartupTimeline

# TORCHRUN_VARS: variables of torchrun / torch.distributed that must not reach our workers: HyperSloth
# owns the process group, and Hugging Face must see each worker as a single process.
from HyperSloth.outputs.run_files import TORCHRUN_VARS

MASTER_ADDR = "127.0.0.1"
STDERR_TAIL_LINES = 20
# A rank that recorded its failure (failure.json) but has not exited this long after is stopped and reported: its
# error is known, and what is left (tearing down a process group whose peers are gone, interpreter exit) can hang.
FAILED_EXIT_GRACE_S = 30.0

class LaunchError(Exception):
    """A problem found before any worker starts; the CLI prints it and exits 2."""


class TmuxSessionExists(LaunchError):
    """The tmux session name is taken and replacing it was not confirmed."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start one rank: its command line and complete environment."""

    rank: int
    gpu: int
    argv: tuple[str, ...]
    env: dict[str, str]


ERROR_LINES = 8  # at most this many lines of the failing rank's own error; the traceback stays in its log


@dataclass(frozen=True)
class RankFailure:
    """The rank that failed first: its own error (from its failure record) or, when it left none (it
    died before it could write one), the end of its stderr."""

    rank: int
    gpu: int
    exit_code: int
    stderr_tail: list[str]
    stderr_path: Path
    error: str | None = None  # "Type: message" as the rank recorded it when it raised

    def describe(self) -> str:
        """One line: which rank, which GPU, how it ended. A rank that raised is named with its error even
        when the launcher had to stop it afterwards (SIGTERM while it was still tearing down)."""
        if self.error:
            return f"rank {self.rank} (gpu {self.gpu}) failed with {self.error.splitlines()[0]}"
        killed = self.exit_code < 0
        how = f"was killed by {signal.Signals(-self.exit_code).name}" if killed else f"failed with exit code {self.exit_code}"
        if self.exit_code == -signal.SIGKILL:
            # Not the launcher's: it SIGKILLs only workers it is already stopping after another rank failed.
            how += (" (not by HyperSloth: most often the kernel's out-of-memory killer, when host RAM ran out;"
                    " `dmesg` or the system journal says)")
        return f"rank {self.rank} (gpu {self.gpu}) {how}"

    def details(self) -> list[str]:
        """What to show under `describe`: the rest of the error (up to ERROR_LINES lines) or the stderr tail."""
        if self.error:
            return self.error.splitlines()[1:ERROR_LINES]
        return self.stderr_tail


def failure_record(logs_dir: Path, rank: int) -> dict | None:
    """The failure record rank `rank` wrote when it raised ({"rank", "time", "error"}), or None."""
    try:
        record = json.loads(run_files.rank_file_in(logs_dir, rank, "failure.json").read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def recorded_error(logs_dir: Path, rank: int) -> str | None:
    """The error rank `rank` recorded in its failure record when it raised, or None."""
    record = failure_record(logs_dir, rank)
    return None if record is None or "error" not in record else str(record["error"])


def is_torchrun_env(env: Mapping[str, str] = os.environ) -> bool:
    """True when started by torchrun (RANK, WORLD_SIZE and LOCAL_RANK all set)."""
    return all(env.get(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def die_with_parent_hook(signum: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A Popen `preexec_fn` after which the child gets `signum` when this process dies (None off Linux).

    Without it a worker outlives a SIGKILLed launcher (its own session shields it from the terminal),
    and keeps its GPU until its next write to the launcher's closed pipe, which in a silent phase
    (loading a model, a long step) may be minutes. SIGKILL because a worker stuck in a C call, or one
    whose libraries installed a SIGTERM handler, must still go. Two Linux details:
    - the signal fires when the *thread* that forked exits, so the thread that calls Popen must be
      the one that waits for the child (true of `launch`);
    - the launcher may already be dead when the child sets it: then the child is reparented, and it
      kills itself when its parent is no longer the launcher.
    """
    set_signal = pdeathsig_setter(signum)  # libc resolved here: the child only calls it
    if set_signal is None:
        return None
    launcher = os.getpid()

    def hook() -> None:
        set_signal()
        if os.getppid() != launcher:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def default_worker_argv(config_path: str | os.PathLike) -> list[str]:
    """The command of one worker: `python -m HyperSloth.train.worker CONFIG`."""
    return [sys.executable, "-m", "HyperSloth.train.worker", str(config_path)]


def physical_gpu(gpu: int, parent_visible: str | None) -> str:
    """GPU ids count within the launcher's CUDA_VISIBLE_DEVICES (as torch does), so map through it."""
    if not parent_visible:
        return str(gpu)
    entries = [entry.strip() for entry in parent_visible.split(",")]
    if gpu >= len(entries):
        raise LaunchError(f"gpu {gpu} is not among CUDA_VISIBLE_DEVICES={parent_visible}")
    return entries[gpu]


def cpu_count() -> int:
    """The cores this process may use (local and multi-node launchers split them between CPU workers)."""
    # The affinity mask is what this process may really use (containers, taskset); cpu_count is the host's.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_env(
    base_env: Mapping[str, str], *, rank: int, gpus: Sequence[int], port: int, cuda: bool
) -> dict[str, str]:
    """The environment of rank `rank`: `base_env` (NCCL_*/TORCH_* kept) plus the launcher's variables
    (names in run_files: rank, local rank, world size, rendezvous address and port)."""
    env = {k: v for k, v in base_env.items() if k not in TORCHRUN_VARS}
    env.update({
        run_files.ENV_RANK: str(rank),
        run_files.ENV_WORLD_SIZE: str(len(gpus)),
        run_files.ENV_LOCAL_RANK: str(rank),
        run_files.ENV_MASTER_ADDR: MASTER_ADDR,
        run_files.ENV_MASTER_PORT: str(port),
    })
    if cuda:
        env["CUDA_VISIBLE_DEVICES"] = physical_gpu(gpus[rank], base_env.get("CUDA_VISIBLE_DEVICES"))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        # W CPU workers with one thread per core each would oversubscribe the cores W times.
        env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_count() // len(gpus))))
    return env


def build_worker_specs(
    config_path: str | os.PathLike,
    gpus: Sequence[int],
    output_dir: str | os.PathLike,
    *,
    port: int,
    cuda: bool,
    worker_argv: Sequence[str] | None = None,
    base_env: Mapping[str, str] | None = None,
) -> list[WorkerSpec]:
    """One spec per entry of `gpus`, all joining the rendezvous store that listens on `port`."""
    if len(set(gpus)) != len(gpus) or not gpus:
        raise LaunchError(f"gpus must be a non-empty list of distinct ids, got {list(gpus)}")
    argv = tuple(worker_argv) if worker_argv is not None else tuple(default_worker_argv(config_path))
    env = dict(os.environ if base_env is None else base_env)
    return [
        WorkerSpec(rank, gpu, argv, worker_env(env, rank=rank, gpus=gpus, port=port, cuda=cuda))
        for rank, gpu in enumerate(gpus)
    ]


def stamped_env(timeline: StartupTimeline | None, phase: str) -> dict[str, str]:
    """This process's environment plus `timeline`, after marking `phase` on it (just the environment without)."""
    if timeline is None:
        return dict(os.environ)
    timeline.mark(phase)
    return {**os.environ, **timeline.to_env()}


class _StderrPump(threading.Thread):
    """Copy a child's stderr to a file (and the terminal for rank 0), keeping its last bytes."""

    _KEEP = 64 * 1024

    def __init__(self, stream: IO[bytes], path: Path, tee: IO[bytes] | None) -> None:
        super().__init__(daemon=True)
        self._stream, self._path, self._tee = stream, path, tee
        self._last = bytearray()

    def run(self) -> None:
        with self._path.open("wb") as sink:
            # read1 returns as soon as some bytes arrive, so progress bars (\r) show up live.
            while chunk := self._stream.read1(65536):
                self._last = (self._last + chunk)[-self._KEEP:]
                # Keep draining whatever happens to the copies: a child blocked on a full pipe would hang.
                sink = self._write(sink, chunk)
                self._tee = self._write(self._tee, chunk)

    @staticmethod
    def _write(target: IO[bytes] | None, chunk: bytes) -> IO[bytes] | None:
        """Write and flush; a target that fails (closed terminal, full disk) is dropped (None)."""
        if target is None:
            return None
        try:
            target.write(chunk)
            target.flush()
            return target
        except (OSError, ValueError):
            return None

    def tail(self, lines: int = STDERR_TAIL_LINES) -> list[str]:
        """The last `lines` lines, each shown as it ended after any carriage returns."""
        text = self._last.decode("utf-8", errors="replace")
        return [line.rsplit("\r", 1)[-1] for line in text.rstrip("\n").split("\n")][-lines:]


def stop_process_groups(pgids: Sequence[int], grace_s: float, is_done: Callable[[int], bool]) -> None:
    """SIGTERM each process group, wait up to `grace_s` until `is_done(pgid)`, then SIGKILL the rest."""
    for pgid in pgids:
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    pending = list(pgids)
    while pending and time.monotonic() < deadline:
        pending = [pgid for pgid in pending if not is_done(pgid)]
        time.sleep(0.05)
    for pgid in pending:
        _signal_group(pgid, signal.SIGKILL)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the whole group is already gone


class _Supervisor:
    """The running children of one launch: start, wait for the first failure, stop."""

    def __init__(self, specs: Sequence[WorkerSpec], logs_dir: Path, grace_s: float) -> None:
        self.specs, self.logs_dir, self.grace_s = specs, logs_dir, grace_s
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[_StderrPump] = []
        self.started = time.time()

    def start(self, signals: _SignalRecord) -> None:
        self.started = time.time()
        die_with_launcher = die_with_parent_hook()
        for spec in self.specs:
            if signals.signum is not None:
                return
            stdout = None if spec.rank == 0 else run_files.rank_file_in(self.logs_dir, spec.rank, "stdout").open("wb")
            proc = subprocess.Popen(spec.argv, env=spec.env, stdout=stdout, stderr=subprocess.PIPE,
                                    start_new_session=True, preexec_fn=die_with_launcher)
            if stdout is not None:
                stdout.close()  # the child holds its own copy
            self.procs.append(proc)
            tee = getattr(sys.stderr, "buffer", None) if spec.rank == 0 else None
            pump = _StderrPump(proc.stderr, run_files.rank_file_in(self.logs_dir, spec.rank, "stderr"), tee)
            pump.start()
            self.pumps.append(pump)

    def wait_first_failure(self, signals: _SignalRecord, poll_s: float = 0.1) -> tuple[WorkerSpec, int] | None:
        """Block until every rank exited 0 (None), one exited non-zero (it and its code), one recorded its failure
        and is still running `FAILED_EXIT_GRACE_S` later (it and 1: `stop` ends it), or a signal came."""
        exit_grace_s, polls = FAILED_EXIT_GRACE_S, 0
        while signals.signum is None:
            codes = [proc.poll() for proc in self.procs]
            for spec, code in zip(self.specs, codes):
                if code not in (None, 0):
                    return spec, code
            if all(code == 0 for code in codes):
                return None
            polls += 1
            if polls % 10 == 0:  # about once a second: a few small files
                stuck = self._failed_but_running(codes, exit_grace_s)
                if stuck is not None:
                    _say(f"rank {stuck.rank} recorded its failure {exit_grace_s:.0f} s ago and has not exited; "
                         "stopping it")
                    return stuck, 1
            time.sleep(poll_s)
        return None

    def _failed_but_running(self, codes: Sequence[int | None], exit_grace_s: float) -> WorkerSpec | None:
        """A rank still running whose failure record, written by this launch, is older than `exit_grace_s`."""
        now = time.time()
        for spec, code in zip(self.specs, codes):
            record = failure_record(self.logs_dir, spec.rank) if code is None else None
            stamped = record.get("time") if record else None  # the worker's time.time() (worker._record_failure)
            if isinstance(stamped, (int, float)) and self.started <= stamped <= now - exit_grace_s:
                return spec
        return None

    def failure(self, spec: WorkerSpec, code: int) -> RankFailure:
        """The report of the failed rank that failed first; call after `stop`, when stderr is complete.

        When one rank raises, its peers soon fail too (their collective loses a peer) and may exit first.
        Workers stamp the moment their exception was raised into their `failure.json`, before the
        process group is torn down, so the earliest stamp names the root cause."""
        first = earliest_failed_rank(self.logs_dir)
        if first is not None and first != spec.rank:
            spec = self.specs[first]
            code = self.procs[first].returncode
        tail = self.pumps[spec.rank].tail()
        return RankFailure(spec.rank, spec.gpu, code, tail, run_files.rank_file_in(self.logs_dir, spec.rank, "stderr"),
                           recorded_error(self.logs_dir, spec.rank))

    def stop(self) -> None:
        """Stop every child's process group (also ones whose leader already exited) and reap them."""
        stop_process_groups([p.pid for p in self.procs], self.grace_s, self._group_done)
        for proc in self.procs:
            proc.wait()
        for pump in self.pumps:
            pump.join(timeout=1.0)

    def _group_done(self, pgid: int) -> bool:
        next(p for p in self.procs if p.pid == pgid).poll()  # reap the leader: a zombie still counts
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        return False


# A closed terminal or a dropped ssh sends SIGHUP: the workers must stop then as on Ctrl-C.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class _SignalRecord:
    """The first stop signal received while workers run; checked by the supervisor's loops."""

    signum: int | None = None


@contextmanager
def _signals_recorded() -> Iterator[_SignalRecord]:
    """Record SIGINT/SIGTERM/SIGHUP instead of raising, so no child can be forked and then lost mid-spawn.

    Handlers can only be installed from the main thread (Python's rule); elsewhere nothing changes.
    """
    record = _SignalRecord()
    if threading.current_thread() is not threading.main_thread():
        yield record
        return
    def handler(signum, _frame):
        record.signum = record.signum or signum
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield record
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _say(message: str) -> None:
    try:
        print(f"hypersloth-train: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # the terminal is gone (SIGHUP): stopping the workers matters more than the message


def _report_failure(failure: RankFailure, others: int, logs_dir: Path) -> None:
    _say(f"{failure.describe()}; stopped the other {others} worker(s).")
    if failure.error is None:
        _say(f"last {len(failure.stderr_tail)} lines of {failure.stderr_path}:")
    if failure.details():
        print("\n".join("    " + line for line in failure.details()), file=sys.stderr, flush=True)
    _say(f"full traceback: {run_files.rank_file_in(logs_dir, failure.rank, 'log')} (stderr: {failure.stderr_path})")


def launch(
    config_path: str | os.PathLike,
    gpus: Sequence[int],
    output_dir: str | os.PathLike,
    *,
    worker_argv: Sequence[str] | None = None,
    cuda: bool | None = None,
    grace_s: float = 5.0,
    timeline: StartupTimeline | None = None,
) -> int:
    """Run one worker per entry of `gpus` to completion; return the exit code for the CLI.

    0 when every rank exits 0; 1 when a rank fails (the others are stopped: SIGTERM to each
    process group, SIGKILL after `grace_s`); 128+signal when SIGINT/SIGTERM/SIGHUP stops the
    launcher. No child outlives this call, whatever happens, nor this process (parent-death signal).
    `cuda=None` counts the GPUs (`devices.cuda_device_count`). Call it from the thread that lives longest: the
    workers die when the thread that started them ends. `timeline`: the launcher's start-up stamps, marked
    here once the port is reserved and handed to every worker (HyperSloth.outputs.startup). The store is
    served on that port once the workers have started: its torch import overlaps theirs.
    """
    from HyperSloth.launch.rendezvous import reserve_port

    cuda = cuda_device_count() > 0 if cuda is None else cuda
    listener = reserve_port(MASTER_ADDR)  # the port is ours from here; the store takes the socket over
    try:
        specs = build_worker_specs(config_path, gpus, output_dir, port=listener.getsockname()[1], cuda=cuda,
                                   worker_argv=worker_argv, base_env=stamped_env(timeline, "rendezvous"))
        return _supervise(specs, listener, output_dir, grace_s, cuda)
    finally:
        listener.close()  # a no-op once the store took the socket over


def _supervise(specs: Sequence[WorkerSpec], listener, output_dir: str | os.PathLike, grace_s: float,
               cuda: bool) -> int:
    """`launch` once the port is reserved: start the workers, serve the store on `listener`, wait, stop."""
    from HyperSloth.launch.rendezvous import host_store

    gpus = [spec.gpu for spec in specs]
    logs_dir = run_files.logs_dir(output_dir)
    logs_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_files.rank_files_in(logs_dir, "failure.json"):  # a previous run's stamps must not name a culprit
        stale.unlink()
    device = "GPU(s) " + ",".join(map(str, gpus)) if cuda else "CPU (gloo)"
    _say(f"starting {len(specs)} worker(s) on {device}, port {specs[0].env[run_files.ENV_MASTER_PORT]}; logs in {logs_dir}")
    supervisor = _Supervisor(specs, logs_dir, grace_s)
    # The stop runs while signals are still only recorded, so a second Ctrl-C cannot cut it short.
    with _signals_recorded() as signals:
        failure, store = None, None
        try:
            supervisor.start(signals)
            store = host_store(MASTER_ADDR, listener)  # torch imported while the workers import theirs
            failure = supervisor.wait_first_failure(signals)
        finally:
            stopped_by = signals.signum
            if stopped_by is not None:
                _say(f"received {signal.Signals(stopped_by).name}; stopping {len(specs)} worker(s)")
            supervisor.stop()
            del store  # the workers are gone: free the port
    if stopped_by is not None:
        _say(checkpoints.resume_hint(output_dir))
        return 128 + stopped_by
    if failure is not None:
        _report_failure(supervisor.failure(*failure), len(specs) - 1, logs_dir)
        return 1
    _say(f"all {len(specs)} worker(s) finished; output in {Path(output_dir).resolve()}")
    return 0


def earliest_failed_rank(logs_dir: Path) -> int | None:
    """The rank whose failure record (its failure.json in `logs_dir`) is stamped first: the root cause (also
    across the nodes of a multi-node run, whose ranks share one logs folder)."""
    stamps = []
    for path in run_files.rank_files_in(logs_dir, "failure.json"):
        try:
            record = json.loads(path.read_text())
            stamps.append((float(record["time"]), int(record["rank"])))
        except (OSError, ValueError, KeyError):
            continue
    return min(stamps)[1] if stamps else None
