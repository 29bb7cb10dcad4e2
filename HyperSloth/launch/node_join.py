"""How the nodes of a multi-node run join one run: the layout of `hypersloth-train`'s node flags, node 0's
store, and the check, before anything trains, that every node sees the run node 0 prepared.

Node 0 binds --master-port itself (the elastic agent's static rendezvous then shares that TCPStore in the same
process: multi_tenant), prepares the run (every launcher check, run.json) and publishes run.json's hash; every
other node connects, waits for it, resolves the run from its own copy of the config and refuses to start when
it cannot read that run.json, reads another one, or resolves another run. Node 0 starts once all are ready.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from HyperSloth.launch import node_watch
from HyperSloth.launch.local import LaunchError
from HyperSloth.launch.node_watch import NodeBoard, NodeWatch, Verdict

RENDEZVOUS_TIMEOUT_S = 300  # the agents' own store waits; every node is already up when they start
STORE_CONNECT_S = 5.0  # one connection attempt to node 0's store (repeated until the join timeout)
SHARED_FILE_WAIT_S = 10.0  # a shared file system may show node 0's new run.json to another node a little later


@dataclass(frozen=True)
class NodeLayout:
    """Where this node sits in the run: validated on creation, so every size below comes from one place."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    def __post_init__(self) -> None:
        problems = []
        if self.nnodes < 2:
            problems.append(f"--nnodes {self.nnodes}: give the number of machines, 2 or more (one machine "
                            "needs no --nnodes)")
        if not 0 <= self.node_rank < max(self.nnodes, 1):
            problems.append(f"--node-rank {self.node_rank} is not a node of --nnodes {self.nnodes}: give 0 on "
                            f"the machine of --master-addr and 1..{self.nnodes - 1} on the others")
        if not 0 < self.master_port < 65536:
            problems.append(f"--master-port {self.master_port} is not a TCP port: give a free port of node 0, "
                            "e.g. 29500")
        if not self.master_addr.strip():
            problems.append("--master-addr is empty: give node 0's address, reachable from every node")
        if problems:
            raise LaunchError("; ".join(problems))

    @classmethod
    def from_flags(cls, nnodes: Any, node_rank: Any, master_addr: Any, master_port: Any) -> NodeLayout:
        """The layout of `hypersloth-train`'s flags; LaunchError naming what is missing or wrong."""
        missing = [flag for flag, value in (("--node-rank", node_rank), ("--master-addr", master_addr),
                                            ("--master-port", master_port)) if value is None]
        if missing:
            raise LaunchError(f"--nnodes {nnodes} also needs {', '.join(missing)} (the same --master-addr and "
                              "--master-port on every node, --node-rank 0 on node 0's machine)")
        try:
            return cls(int(nnodes), int(node_rank), str(master_addr), int(master_port))
        except (TypeError, ValueError):
            raise LaunchError(f"--nnodes {nnodes}, --node-rank {node_rank} and --master-port {master_port} must "
                              "be whole numbers") from None

    @property
    def is_master(self) -> bool:
        return self.node_rank == 0

    @property
    def store_address(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def world_size(self, local_world_size: int) -> int:
        return self.nnodes * local_world_size

    def ranks_of(self, node: int, local_world_size: int) -> range:
        """The global ranks of node `node` (the static rendezvous orders them by node rank)."""
        return range(node * local_world_size, (node + 1) * local_world_size)


@dataclass(frozen=True)
class NodeRun:
    """What this node resolved: node 0's was checked and written to `run_path`; the others' is compared."""

    run_path: Path  # OUTPUT_DIR/run.json: what every worker reads
    run_json: str  # the run description as this node resolved it
    gpus: tuple[int, ...]  # this node's GPUs (the config's training.gpus)
    cuda: bool

    @property
    def output_dir(self) -> Path:
        return self.run_path.parent


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()



# ------------------------------------------------------------------ node 0's store


def host_store(layout: NodeLayout):
    """Node 0: the run's TCPStore on --master-port, multi-tenant so the agent's static rendezvous (same
    process, same port) shares it; LaunchError when the port is taken."""
    import torch.distributed as torch_dist

    try:
        return torch_dist.TCPStore("0.0.0.0", layout.master_port, is_master=True, multi_tenant=True,
                                   wait_for_workers=False, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    except (RuntimeError, OSError) as err:
        raise LaunchError(f"cannot listen on --master-port {layout.master_port} on this machine (node 0): "
                          f"{str(err).splitlines()[0]}; choose another port, the same on every node") from None


def connect_store(layout: NodeLayout, timeout_s: float = STORE_CONNECT_S):
    """A client of node 0's store (one attempt of up to `timeout_s`)."""
    import torch.distributed as torch_dist

    return torch_dist.TCPStore(layout.master_addr, layout.master_port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=timeout_s))


def join_store(layout: NodeLayout, join_timeout_s: float):
    """Nodes 1..N-1: connect to node 0's store, retrying until `join_timeout_s` (node 0 may start later)."""
    deadline = time.monotonic() + join_timeout_s
    while True:
        try:
            return connect_store(layout)
        except node_watch.STORE_ERRORS as err:
            if time.monotonic() >= deadline:
                raise LaunchError(f"node 0's store at {layout.store_address} did not answer within "
                                  f"{join_timeout_s:.0f} s ({type(err).__name__}): start `hypersloth-train ... "
                                  "--node-rank 0` on that machine, and check that this machine reaches that "
                                  "address and port (firewall)") from None
            time.sleep(1.0)


# ------------------------------------------------------------------ before training: every node sees one run


def refuse_reason(me: int, run: NodeRun, published: Mapping[str, str]) -> str | None:
    """Why node `me` (not 0) may not join the run node 0 published (its run.json's sha256 and path)."""
    path = Path(published["path"])
    shared = ("output_dir must be one folder that every node sees at the same path (a shared file system: "
              "NFS, Lustre, ...)")
    try:
        seen = path.read_text()
    except OSError as err:
        return f"node {me} cannot read {path}, which node 0 wrote ({err.strerror}): {shared}"
    if sha256_text(seen) != published["sha256"]:
        return f"node {me} reads another {path} than the one node 0 wrote: {shared}"
    ours, theirs = json.loads(run.run_json), json.loads(seen)
    # Where each node keeps its copy of the config does not matter; what it resolves to does.
    differ = sorted(key for key in (set(ours) | set(theirs)) - {"config_path"} if ours.get(key) != theirs.get(key))
    if differ:
        return (f"node {me} resolved another run than node 0 (they differ in {', '.join(differ)}): run every node "
                "with the same config file, the same number of gpus, dataset and output_dir")
    return None


def _wait_for(what: Callable[[], Any], watch: NodeWatch, timeout_s: float, waiting_for: str):
    """Poll `what()` until it gives something (returned), the watch has a verdict (LaunchError) or the time
    is up (LaunchError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = what()
        if found:
            return found
        if watch.verdict is not None:
            raise Stopped(watch.verdict)
        if time.monotonic() >= deadline:
            raise LaunchError(f"waited {timeout_s:.0f} s for {waiting_for}; nothing started")
        time.sleep(0.2)


class Stopped(Exception):
    """A peer failed or was lost before training started."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.describe())
        self.verdict = verdict


def preflight(layout: NodeLayout, board: NodeBoard, watch: NodeWatch, prepare: Callable[[], NodeRun],
              join_timeout_s: float) -> NodeRun:
    """Node 0 prepares and publishes the run, waits for every node to be ready; the others wait for it,
    check it and say they are ready. Raises ConfigError/LaunchError (this node's problem, posted for the
    others) or Stopped (another node's)."""
    me = layout.node_rank
    if layout.is_master:
        run = prepare()
        board.publish_run(sha256_text(run.run_path.read_text()), str(run.run_path))
        board.ready(me)
        _wait_for(lambda: board.all_ready(range(layout.nnodes)), watch, join_timeout_s,
                  f"every node to join ({layout.nnodes} nodes)")
        return run
    published = _wait_for(board.published_run, watch, join_timeout_s, "node 0 to prepare the run")
    run = prepare()
    deadline = time.monotonic() + SHARED_FILE_WAIT_S
    while (reason := refuse_reason(me, run, published)) and reason.startswith(f"node {me} cannot read") \
            and time.monotonic() < deadline:
        time.sleep(0.5)  # NFS may show a file another machine just wrote a moment later
    if reason:
        raise LaunchError(reason)
    board.ready(me)
    return run
