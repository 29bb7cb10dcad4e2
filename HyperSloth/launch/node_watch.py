"""Which nodes of a multi-node run are alive: heartbeats and end records on the run's store, and the verdict.

torch's elastic agent watches the workers of its own node only: with `max_restarts=0` and the static
rendezvous, nothing tells node 0 that node 1's machine went away, and node 0's workers would wait in their
next collective until `training.nccl_timeout_s` (30 minutes by default). So every node's `hypersloth-train`
runs a `NodeWatch` thread on the store that node 0 hosts (the same TCPStore the agents rendezvous on):

    hypersloth-nodes/beat/{n}    a counter node n adds 1 to every `beat_s`
    hypersloth-nodes/ended/{n}   node n's end: {"ok", "code", "reason", "time"} (JSON), set once
    hypersloth-nodes/run         node 0's run.json: its sha256 and path, once node 0 has prepared the run
    hypersloth-nodes/ready/{n}   node n resolved the same run from the shared run folder

Counters, not clocks: each watcher notes on its own monotonic clock when a peer's counter last moved, so
clock skew between hosts does not matter. A peer whose counter has not moved for `lost_after_s` (and that
has not ended) is lost; node 0 is lost for the others when its store stops answering for as long. A peer
that ended with ok=False failed. `judge` is pure (tested with a fake clock); `NodeWatch` runs it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

PREFIX = "hypersloth-nodes"
BEAT_S = 2.0
LOST_AFTER_S = 30.0  # a peer silent this long is lost: with the 2 s beat, a stop within ~35 s of a loss
JOIN_TIMEOUT_S = 600.0  # how long a node waits for the others to start (torchrun's default is 900)
STORE_ERRORS = (RuntimeError, OSError, TimeoutError, ValueError)  # torch's DistError is a RuntimeError


class Store(Protocol):
    """What the board needs of a torch.distributed.Store (a dict-backed fake in the tests)."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...


@dataclass(frozen=True)
class NodeEnd:
    """How node `node` ended: ok, its exit code, and a one-line reason (empty when ok)."""

    node: int
    ok: bool
    code: int
    reason: str = ""
    time: float = 0.0  # time.time() on that node: only compared with other nodes' failure stamps
    root: bool = True  # False: it stopped because another node failed or was lost (its reason says which)

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "code": self.code, "reason": self.reason, "time": self.time,
                           "root": self.root})

    @classmethod
    def from_json(cls, node: int, text: str | bytes) -> NodeEnd:
        record = json.loads(text)
        return cls(node, bool(record["ok"]), int(record["code"]), str(record.get("reason", "")),
                   float(record.get("time", 0.0)), bool(record.get("root", True)))


@dataclass(frozen=True)
class Verdict:
    """Why this node must stop: node `node` failed (it said why) or was lost (it went silent)."""

    node: int
    kind: str  # "failed", "stopped" (by a signal: Ctrl-C, SIGTERM from a scheduler), "lost", "never joined"
    detail: str
    code: int = 1  # the exit code to give: a peer that refused the run before training (2) passes it on
    root: bool = True  # False: that node itself stopped because of another one

    def describe(self) -> str:
        if self.kind == "failed":
            return f"node {self.node} failed: {self.detail}"
        if self.kind == "stopped":
            return f"node {self.node} was {self.detail}"
        if self.kind == "never joined":
            return f"node {self.node} did not join the run: {self.detail}"
        return f"node {self.node} was lost: {self.detail}"


class NodeBoard:
    """The run's keys on the store (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    @staticmethod
    def key(*parts: object) -> str:
        return "/".join([PREFIX, *map(str, parts)])

    def beat(self, node: int) -> None:
        self.store.add(self.key("beat", node), 1)

    def beats(self, nodes: range) -> dict[int, int]:
        """Every node's counter (0 before its first beat); add(key, 0) reads without waiting for the key."""
        return {n: int(self.store.add(self.key("beat", n), 0)) for n in nodes}

    def end(self, record: NodeEnd) -> None:
        self.store.set(self.key("ended", record.node), record.to_json())

    def ended(self, nodes: range) -> dict[int, NodeEnd]:
        found = {}
        for n in nodes:
            key = self.key("ended", n)
            if self.store.check([key]):
                found[n] = NodeEnd.from_json(n, self.store.get(key))
        return found

    def publish_run(self, sha256: str, path: str) -> None:
        self.store.set(self.key("run"), json.dumps({"sha256": sha256, "path": path}))

    def published_run(self) -> dict[str, str] | None:
        key = self.key("run")
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def ready(self, node: int) -> None:
        self.store.set(self.key("ready", node), "1")

    def all_ready(self, nodes: range) -> bool:
        return self.store.check([self.key("ready", n) for n in nodes])


@dataclass
class PeerClock:
    """What one watcher has seen of its peers, on its own monotonic clock."""

    started: float
    store_ok_at: float
    counts: dict[int, int]
    moved_at: dict[int, float]  # when each peer's counter last changed (absent: never beat yet)

    @classmethod
    def starting(cls, now: float) -> PeerClock:
        return cls(started=now, store_ok_at=now, counts={}, moved_at={})

    def saw(self, counts: Mapping[int, int], now: float) -> None:
        self.store_ok_at = now
        for node, count in counts.items():
            if count > 0 and count != self.counts.get(node):
                self.moved_at[node] = now
            self.counts[node] = count


def judge(me: int, nnodes: int, clock: PeerClock, ended: Mapping[int, NodeEnd], now: float, *,
          lost_after_s: float = LOST_AFTER_S, join_timeout_s: float = JOIN_TIMEOUT_S,
          store_address: str = "") -> Verdict | None:
    """Why node `me` must stop now, or None: a peer that ended with a failure (the earliest root cause
    first, then the earliest of those that stopped because of another node), a peer silent
    for `lost_after_s` (`join_timeout_s` before its first beat), or, for nodes other than 0, node 0's store
    unreachable for `lost_after_s`."""
    failed = sorted((not end.root, end.time, n) for n, end in ended.items() if n != me and not end.ok)
    if failed:
        end = ended[failed[0][2]]
        kind = "stopped" if end.root and end.code > 128 else "failed"
        return Verdict(end.node, kind, end.reason or f"exit code {end.code}", code=end.code, root=end.root)
    silent = now - clock.store_ok_at
    if me != 0 and silent >= lost_after_s:
        where = f" at {store_address}" if store_address else ""
        return Verdict(0, "lost", f"its store{where} has not answered for {silent:.0f} s (the machine, its "
                       "network or its hypersloth-train process is gone)")
    for node in range(nnodes):
        if node == me or node in ended:
            continue
        if node not in clock.moved_at:
            if now - clock.started >= join_timeout_s:
                return Verdict(node, "never joined", f"no heartbeat within {join_timeout_s:.0f} s: start "
                               f"`hypersloth-train ... --node-rank {node}` on that machine")
            continue
        quiet = now - clock.moved_at[node]
        if quiet >= lost_after_s:
            return Verdict(node, "lost", f"no heartbeat for {quiet:.0f} s (the machine, its network or its "
                           "hypersloth-train process is gone)")
    return None


def settled(me: int, nnodes: int, ended: Mapping[int, NodeEnd], verdict: Verdict | None) -> bool:
    """Every peer has ended, or one was lost: nothing more will be learnt by waiting."""
    if verdict is not None and verdict.kind != "failed":
        return True
    return all(node in ended for node in range(nnodes) if node != me)


class NodeWatch(threading.Thread):
    """Beat for node `me` and judge its peers every `beat_s`, on a store connection of its own (`connect`).

    The first verdict is kept (`verdict`); while `armed`, `on_verdict` is called once with it (the CLI
    stops its agent by signalling itself: the agent's workers are shut down in the main thread).
    """

    def __init__(self, connect: Callable[[], Store], me: int, nnodes: int, *, beat_s: float = BEAT_S,
                 lost_after_s: float = LOST_AFTER_S, join_timeout_s: float = JOIN_TIMEOUT_S,
                 store_address: str = "", on_verdict: Callable[[Verdict], Any] | None = None) -> None:
        super().__init__(daemon=True, name=f"hypersloth-node{me}-watch")
        self._connect, self.me, self.nnodes = connect, me, nnodes
        self.beat_s, self.lost_after_s, self.join_timeout_s = beat_s, lost_after_s, join_timeout_s
        self.store_address, self.on_verdict = store_address, on_verdict
        self.clock = PeerClock.starting(time.monotonic())
        self.ended: dict[int, NodeEnd] = {}
        self.verdict: Verdict | None = None
        self.armed = False
        self._board: NodeBoard | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._called = False

    def run(self) -> None:
        while not self._halt.is_set():
            self.poll(time.monotonic())
            self._halt.wait(self.beat_s)

    def poll(self, now: float) -> Verdict | None:
        """One round: beat, read the peers, judge; returns the verdict so far."""
        try:
            board = self._board or NodeBoard(self._connect())
            self._board = board
            board.beat(self.me)
            counts = board.beats(range(self.nnodes))
            ended = board.ended(range(self.nnodes))
            with self._lock:
                self.clock.saw({n: c for n, c in counts.items() if n != self.me}, now)
                self.ended.update(ended)
        except STORE_ERRORS:
            self._board = None  # connect again next round: the store may be back (a brief network fault)
        with self._lock:
            if self.verdict is None:
                self.verdict = judge(self.me, self.nnodes, self.clock, self.ended, now,
                                     lost_after_s=self.lost_after_s, join_timeout_s=self.join_timeout_s,
                                     store_address=self.store_address)
            verdict, call = self.verdict, self.verdict is not None and self.armed and not self._called
            self._called = self._called or call
        if call and self.on_verdict is not None:
            self.on_verdict(verdict)
        return verdict

    def arm(self) -> None:
        """From now on a verdict calls `on_verdict` (at once when one is already there)."""
        with self._lock:
            self.armed = True
            pending = self.verdict is not None and not self._called
            self._called = self._called or pending
        if pending and self.on_verdict is not None:
            self.on_verdict(self.verdict)

    def disarm(self) -> None:
        with self._lock:
            self.armed = False

    def is_settled(self) -> bool:
        with self._lock:
            return settled(self.me, self.nnodes, self.ended, self.verdict)

    def wait_settled(self, timeout_s: float) -> bool:
        """Wait until every peer ended or one is judged lost (or `timeout_s`); whether it settled."""
        deadline = time.monotonic() + timeout_s
        while not self.is_settled() and time.monotonic() < deadline and self.is_alive():
            time.sleep(min(0.2, self.beat_s))
        return self.is_settled()

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=self.beat_s + 10)
