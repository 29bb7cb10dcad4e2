"""Several machines: `hypersloth-train CONFIG --nnodes N --node-rank R --master-addr HOST --master-port PORT`.

One command per node, the same config and output_dir on every node. Underneath is torch's elastic
launcher (`elastic_launch` / `LaunchConfig`, torchrun's agent) with its static rendezvous, torchrun's own
choice for these flags: a c10d TCPStore on node 0 at HOST:PORT, node R's workers get the global ranks
R x L .. R x L + L - 1 (L = len(training.gpus), the node's local GPUs), `max_restarts=0` (no silent
restarts). What HyperSloth adds around the agent, on the same store:

1. node 0's `hypersloth-train` binds the store itself (before the agent, which then shares it in-process:
   multi_tenant), so it can speak before training: it prepares the run (checks, output_dir, run.json) and
   every other node refuses to start (exit 2, naming the difference) when it cannot see that run.json or
   resolves another run (`node_join`); node 0 starts training once every node is ready;
2. each node's watch (`node_watch.NodeWatch`) beats on the store and stops its own agent (SIGTERM to
   itself: the agent then stops its workers) when a peer failed or went silent, so a lost node stops every
   other node within `lost_after_s` + a beat, with a message that names it;
3. the workers are HyperSloth's own (`python -m HyperSloth.train.worker OUTPUT_DIR/run.json`), reading the
   agent's RANK/LOCAL_RANK/LOCAL_WORLD_SIZE (`train.dist.DistInfo`, launched_by "torchrun"); their
   stderr/stdout land in the one log layout of the local launcher, by global rank (`RankLogs`).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from HyperSloth.config import ConfigError
from HyperSloth.launch import node_watch
from HyperSloth.launch.local import (
    STOP_SIGNALS,
    LaunchError,
    RankFailure,
    cpu_count,
    default_worker_argv,
    earliest_failed_rank,
    physical_gpu,
    recorded_error,
    stamped_env,
    stop_process_groups,
)
from HyperSloth.launch.node_join import (
    RENDEZVOUS_TIMEOUT_S,
    NodeLayout,
    NodeRun,
    Stopped,
    connect_store,
    host_store,
    join_store,
    preflight,
)
from HyperSloth.launch.node_watch import NodeBoard, NodeEnd, NodeWatch, Verdict
from HyperSloth.outputs import run_files
from HyperSloth.outputs.run_files import TORCHRUN_VARS
from HyperSloth.outputs.startup import StartupTimeline

RUN_ID = "hypersloth"  # the static rendezvous' key prefix; the store belongs to this one run (its port)


def describe_ranks(ranks: range) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


# ------------------------------------------------------------------ the workers' environment and logs


def node_env(base_env: Mapping[str, str], gpus: tuple[int, ...], cuda: bool) -> dict[str, str]:
    """The agent's environment, which the elastic agent copies into every worker: this node's GPUs in
    CUDA_VISIBLE_DEVICES (each worker narrows it to its LOCAL_RANK's, `train.dist.isolate_process`), none
    of our single-node launcher's variables, and on CPU the cores split between the local workers."""
    env = {k: v for k, v in base_env.items()
           if k not in TORCHRUN_VARS and k not in (run_files.ENV_RANK, run_files.ENV_LOCAL_RANK,
                                                   run_files.ENV_WORLD_SIZE, run_files.ENV_MASTER_ADDR,
                                                   run_files.ENV_MASTER_PORT)}
    if cuda:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(physical_gpu(g, base_env.get("CUDA_VISIBLE_DEVICES")) for g in gpus)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_count() // len(gpus))))
    return env


def rank_logs(logs_dir: Path):
    """The elastic agent's LogsSpecs for HyperSloth's layout (made here: torch is imported only now)."""
    from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs

    class RankLogs(LogsSpecs):
        """Every rank's stderr and stdout in the logs folder (run_files.rank_file_in), named by global rank as
        the local launcher names them, but rank 0's, which goes to this node's terminal as it is (the agent's
        tee would prefix every line and break progress bars); every rank's own log holds its traceback."""

        def __init__(self) -> None:
            super().__init__(log_dir=str(logs_dir))

        @property
        def root_log_dir(self) -> str:
            return str(logs_dir)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            dest = LogsDest(filtered_stdout=os.devnull, filtered_stderr=os.devnull)
            for local_rank, env in envs.items():
                rank = int(env["RANK"])
                for kind, files in (("stderr", dest.stderrs), ("stdout", dest.stdouts)):
                    files[local_rank] = "" if rank == 0 else str(run_files.rank_file_in(logs_dir, rank, kind))
                dest.error_files[local_rank] = os.devnull  # HyperSloth's own failure records name the error
                env["TORCHELASTIC_ERROR_FILE"] = ""
            return dest

    return RankLogs()


def launch_config(layout: NodeLayout, local_world_size: int, logs_dir: Path, grace_s: float):
    """torch's LaunchConfig of this node: static rendezvous on node 0's store, no restarts."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=layout.nnodes, max_nodes=layout.nnodes, nproc_per_node=local_world_size, run_id=RUN_ID,
        rdzv_backend="static", rdzv_endpoint=layout.store_address,
        rdzv_configs={"rank": layout.node_rank, "timeout": RENDEZVOUS_TIMEOUT_S},
        max_restarts=0, monitor_interval=0.1, logs_specs=rank_logs(logs_dir),
        shutdown_timeout=max(1, round(grace_s)),
    )


# ------------------------------------------------------------------ training: the elastic agent, watched


def child_pids(parent: int | None = None) -> list[int]:
    """The live processes whose parent is `parent` (this one): the agent's workers, each its own session."""
    parent = os.getpid() if parent is None else parent
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def stop_workers(grace_s: float) -> None:
    """Stop this node's workers (SIGTERM to each one's process group, SIGKILL after `grace_s`); the agent
    then sees them fail and returns. Called from the watch thread when a peer failed or was lost."""
    pids = child_pids()

    def done(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        return not Path(f"/proc/{pgid}").exists() or _is_zombie(pgid)

    stop_process_groups(pids, grace_s, done)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@contextmanager
def _stop_signals_raise() -> Iterator[None]:
    """Until the agent installs its own handlers (they raise the same SignalException), a stop signal
    raises too, so every way out of this node posts its end for the others."""
    from torch.distributed.elastic.multiprocessing import SignalException

    def handler(signum, _frame):
        raise SignalException(f"got {signal.Signals(signum).name}", sigval=signal.Signals(signum))

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def rank_failure(rank: int, gpus: tuple[int, ...], logs_dir: Path, exit_code: int = 1) -> RankFailure:
    """The report of global rank `rank` from the shared logs: its own error, else its stderr's end."""
    stderr = run_files.rank_file_in(logs_dir, rank, "stderr")
    try:
        tail = stderr.read_text(errors="replace").rstrip("\n").split("\n")[-20:]
    except OSError:
        tail = []
    return RankFailure(rank, gpus[rank % len(gpus)], exit_code, tail, stderr, recorded_error(logs_dir, rank))


def failure_reason(layout: NodeLayout, run: NodeRun, failed: Mapping[int, int]) -> str:
    """One line for the others: the rank that failed first (the earliest failure record in the shared
    logs), with its node, else this node's first failed rank and its exit code."""
    logs_dir = run_files.logs_dir(run.output_dir)
    first = earliest_failed_rank(logs_dir)
    if first is None and failed:
        first = min(failed)
    if first is None:
        return "its workers failed"
    failure = rank_failure(first, run.gpus, logs_dir, failed.get(first, 1))
    return f"{failure.describe()} on node {first // len(run.gpus)}"


def train_node(layout: NodeLayout, run: NodeRun, watch: NodeWatch, grace_s: float,
               timeline: StartupTimeline | None) -> NodeEnd:
    """Run this node's workers under torch's elastic agent until they end; this node's end record."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    me, local = layout.node_rank, len(run.gpus)
    env = node_env(stamped_env(timeline, "rendezvous"), run.gpus, run.cuda)
    for name in set(os.environ) - set(env):
        del os.environ[name]
    os.environ.update(env)  # the agent hands its own environment to the workers
    logs_dir = run_files.logs_dir(run.output_dir)
    logs_dir.mkdir(parents=True, exist_ok=True)
    device = "GPU(s) " + ",".join(map(str, run.gpus)) if run.cuda else "CPU (gloo)"
    _say(f"node {me}: starting {local} worker(s) ({describe_ranks(layout.ranks_of(me, local))} of "
         f"{layout.world_size(local)}) on {device}, store {layout.store_address}; logs in {logs_dir}")
    # Each worker dies with this process, even when it is SIGKILLed (node_worker); then it is the worker.
    argv = [sys.executable, "-m", "HyperSloth.launch.node_worker", str(os.getpid()),
            *default_worker_argv(run.run_path)]
    watch.on_verdict = lambda _verdict: stop_workers(grace_s)
    watch.arm()
    try:
        elastic_launch(launch_config(layout, local, logs_dir, grace_s), argv[0])(*argv[1:])
        return NodeEnd(me, True, 0, "", time.time())
    except ChildFailedError as err:
        if watch.verdict is not None:
            return NodeEnd(me, False, 1, f"stopped: {watch.verdict.describe()}", time.time(), root=False)
        failed = {rank: failure.exitcode for rank, failure in err.failures.items()}
        return NodeEnd(me, False, 1, failure_reason(layout, run, failed), time.time())
    except SignalException as err:
        return NodeEnd(me, False, 128 + int(err.sigval), f"stopped by {err.sigval.name}", time.time())
    finally:
        watch.disarm()


# ------------------------------------------------------------------ what each node says at the end


def explain(layout: NodeLayout, run: NodeRun, end: NodeEnd, verdict: Verdict | None) -> tuple[int, list[str]]:
    """This node's exit code and what it prints: success; a lost or stopped node (named); the rank that failed
    first (from the shared failure records), with its node; a peer's own reason; or this node's stop signal."""
    me, local = layout.node_rank, len(run.gpus)
    stopped = f"stopped node {me}'s {local} worker(s)"
    if end.ok and verdict is None:
        return 0, [f"node {me}: all {local} worker(s) finished; output in {run.output_dir}"]
    if end.ok:  # e.g. rank 0's final save failed after this node's workers were done: the run did not finish
        return 1, [f"node {me}: all {local} worker(s) finished, but {verdict.describe()}"]
    if end.code > 128 and verdict is None:
        return end.code, [f"node {me}: received {signal.Signals(end.code - 128).name}; {stopped}"]
    if verdict is not None and verdict.kind != "failed":
        return 1, [f"{verdict.describe()}; {stopped}."]
    logs_dir = run_files.logs_dir(run.output_dir)
    first = earliest_failed_rank(logs_dir)
    if first is not None:
        failure = rank_failure(first, run.gpus, logs_dir)
        lines = [f"{failure.describe()} on node {first // local}; {stopped}."]
        lines += ["    " + line for line in failure.details()]
        log = run_files.rank_file_in(logs_dir, first, "log")
        return 1, lines + [f"full traceback: {log} (stderr: {failure.stderr_path})"]
    if verdict is not None and (verdict.root or not end.root):
        return verdict.code, [f"{verdict.describe()}; {stopped}."]
    return 1, [f"node {me}: {end.reason}; {stopped}."]


def _say(message: str) -> None:
    try:
        print(f"hypersloth-train: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def node_timeout_s(env: Mapping[str, str] = os.environ) -> float:
    """`lost_after_s` from run_files.ENV_NODE_TIMEOUT (default node_watch.LOST_AFTER_S); LaunchError otherwise."""
    text = env.get(run_files.ENV_NODE_TIMEOUT, "").strip()
    if not text:
        return node_watch.LOST_AFTER_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 3 * node_watch.BEAT_S <= value <= 3600:
        raise LaunchError(f"{run_files.ENV_NODE_TIMEOUT}={text!r}: give the seconds after which a silent node "
                          f"counts as lost, {3 * node_watch.BEAT_S:.0f} to 3600 (default "
                          f"{node_watch.LOST_AFTER_S:.0f}), or unset it")
    return value


def launch_multinode(layout: NodeLayout, prepare: Callable[[], NodeRun], *, grace_s: float = 5.0,
                     timeline: StartupTimeline | None = None,
                     join_timeout_s: float = node_watch.JOIN_TIMEOUT_S) -> int:
    """Run this node of a multi-node run to its end; the exit code for the CLI (0 done, 1 a worker or a node
    failed or was lost, 2 nothing started: this node's or another node's problem, 128+signal stopped).
    `prepare()` resolves the run on this node (on node 0 it also checks and writes run.json); its
    ConfigError/LaunchError is posted for the other nodes and raised."""
    lost_after_s = node_timeout_s()
    store = host_store(layout) if layout.is_master else join_store(layout, join_timeout_s)
    watch = NodeWatch(lambda: connect_store(layout), layout.node_rank, layout.nnodes, lost_after_s=lost_after_s,
                      join_timeout_s=join_timeout_s, store_address=layout.store_address)
    watch.start()
    try:
        with _stop_signals_raise():
            return _run_node(layout, NodeBoard(store), watch, prepare, grace_s, timeline, join_timeout_s)
    finally:
        watch.stop()
        del store  # node 0: the others have ended or were lost (_run_node waited), so the store may go


def _run_node(layout: NodeLayout, board: NodeBoard, watch: NodeWatch, prepare: Callable[[], NodeRun],
              grace_s: float, timeline: StartupTimeline | None, join_timeout_s: float) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException

    me = layout.node_rank
    try:
        run = preflight(layout, board, watch, prepare, join_timeout_s)
        end = train_node(layout, run, watch, grace_s, timeline)
    except Stopped as stop:
        _say(f"{stop.verdict.describe()}; nothing started on node {me}")
        _post_end(layout, board, watch, NodeEnd(me, False, 2, f"stopped before training: {stop.verdict.describe()}",
                                                 time.time(), root=False))
        return 2
    except (ConfigError, LaunchError) as err:
        _post_end(layout, board, watch, NodeEnd(me, False, 2, f"refused the run: {err}", time.time()))
        raise
    except SignalException as err:
        _say(f"node {me}: received {err.sigval.name}; nothing started")
        _post_end(layout, board, watch, NodeEnd(me, False, 128 + int(err.sigval), f"stopped by {err.sigval.name}",
                                                 time.time()))
        return 128 + int(err.sigval)
    _post_end(layout, board, watch, end)
    code, lines = explain(layout, run, end, watch.verdict)
    for line in lines:
        (_say(line) if not line.startswith("    ") else print(line, file=sys.stderr, flush=True))
    return code


def _post_end(layout: NodeLayout, board: NodeBoard, watch: NodeWatch, end: NodeEnd) -> None:
    """Tell the others how this node ended. A failed node then waits to learn why (every peer ended, or one
    is lost), unless a signal stopped it; node 0 also waits for every node's end (its store must outlive
    their last reads), and after a failure lingers two beats, so every watch reads its end record."""
    try:
        board.end(end)
    except node_watch.STORE_ERRORS:
        return  # node 0's store is gone: the watch has or will have its verdict; nobody can be told
    if end.code <= 128 and (not end.ok or layout.is_master):
        watch.wait_settled(watch.lost_after_s + 2 * watch.beat_s)
    if layout.is_master and not end.ok:
        time.sleep(2 * watch.beat_s)
