"""Which node failed or was lost (HyperSloth.launch.node_watch): the verdict on a fake clock and a fake store."""

from __future__ import annotations

import pytest

from HyperSloth.launch.node_watch import NodeBoard, NodeEnd, NodeWatch, PeerClock, judge, settled


class FakeStore:
    """The four calls the board makes, on a dict; `down` makes every call fail as a dead TCPStore's does."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.down = False

    def _up(self) -> None:
        if self.down:
            raise RuntimeError("Connection reset by peer")

    def set(self, key: str, value: str) -> None:
        self._up()
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        self._up()
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        self._up()
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        self._up()
        return all(key in self.data for key in keys)


def _clock(moved: dict[int, float], started: float = 0.0, store_ok_at: float = 0.0) -> PeerClock:
    return PeerClock(started=started, store_ok_at=store_ok_at, counts={n: 1 for n in moved}, moved_at=dict(moved))


def test_a_silent_peer_is_lost_after_the_timeout_and_named():
    clock = _clock({1: 10.0, 2: 40.0}, store_ok_at=45.0)
    assert judge(0, 3, clock, {}, now=39.0, lost_after_s=30) is None
    verdict = judge(0, 3, clock, {}, now=41.0, lost_after_s=30)
    assert (verdict.node, verdict.kind, verdict.code) == (1, "lost", 1)
    assert verdict.describe().startswith("node 1 was lost: no heartbeat for 31 s")


def test_a_peer_that_ended_is_not_lost_and_one_that_failed_is_named_root_cause_first():
    clock = _clock({1: 0.0, 2: 0.0}, store_ok_at=100.0)
    ok = {1: NodeEnd(1, True, 0), 2: NodeEnd(2, True, 0)}
    assert judge(0, 3, clock, ok, now=100.0, lost_after_s=30) is None
    ended = {1: NodeEnd(1, False, 1, "stopped: node 2 failed: ...", time=5.0, root=False),
             2: NodeEnd(2, False, 1, "rank 5 (gpu 1) failed with RuntimeError: boom on node 2", time=7.0)}
    verdict = judge(0, 3, clock, ended, now=1.0)
    assert (verdict.node, verdict.kind, verdict.root) == (2, "failed", True)
    assert verdict.describe() == "node 2 failed: rank 5 (gpu 1) failed with RuntimeError: boom on node 2"
    stopped = judge(0, 2, clock, {1: NodeEnd(1, False, 130, "stopped by SIGINT")}, now=1.0)
    assert stopped.describe() == "node 1 was stopped by SIGINT"  # named as it is, not as a failure
    refused = judge(1, 2, clock, {0: NodeEnd(0, False, 2, "refused the run: no dataset")}, now=1.0)
    assert (refused.node, refused.code) == (0, 2)  # a refusal before training passes its exit code 2 on


def test_node_zero_is_lost_when_its_store_stops_answering_and_a_node_that_never_beat_did_not_join():
    clock = _clock({0: 0.0}, store_ok_at=10.0)
    verdict = judge(1, 2, clock, {}, now=41.0, lost_after_s=30, store_address="10.0.0.1:29500")
    assert verdict.node == 0 and "its store at 10.0.0.1:29500 has not answered for 31 s" in verdict.describe()
    assert judge(0, 2, clock, {}, now=41.0, lost_after_s=30) is None  # node 0's own store: node 1 never beat yet
    never = judge(0, 2, _clock({}, store_ok_at=700.0), {}, now=600.0, join_timeout_s=600)
    assert (never.node, never.kind) == (1, "never joined") and "--node-rank 1" in never.describe()


def test_settled_once_every_peer_ended_or_one_is_lost():
    lost = judge(0, 3, _clock({1: 0.0, 2: 0.0}, store_ok_at=99.0), {}, now=99.0, lost_after_s=30)
    assert settled(0, 3, {}, lost)
    assert not settled(0, 3, {1: NodeEnd(1, False, 1)}, None)
    assert settled(0, 3, {1: NodeEnd(1, False, 1), 2: NodeEnd(2, True, 0)}, None)


def test_the_watch_beats_reads_the_peers_and_calls_back_once_armed():
    store = FakeStore()
    calls = []
    watch = NodeWatch(lambda: store, 0, 2, lost_after_s=10, join_timeout_s=100, on_verdict=calls.append)
    watch.clock = PeerClock.starting(0.0)
    peer = NodeBoard(store)
    peer.beat(1)
    assert watch.poll(1.0) is None and store.data["hypersloth-nodes/beat/0"] == b"1"
    assert watch.poll(10.5) is None  # the peer's counter moved at 1.0, so it has 10 s from there
    verdict = watch.poll(11.2)
    assert verdict is not None and verdict.node == 1 and calls == []  # not armed: kept, not acted on
    watch.arm()
    watch.poll(20.0)
    assert calls == [verdict]  # once


def test_the_watch_survives_a_dead_store_and_names_node_zero():
    store = FakeStore()
    watch = NodeWatch(lambda: store, 1, 2, lost_after_s=10, join_timeout_s=100)
    watch.clock = PeerClock.starting(0.0)
    NodeBoard(store).beat(0)
    assert watch.poll(1.0) is None
    store.down = True
    assert watch.poll(5.0) is None
    verdict = watch.poll(11.5)
    assert verdict.node == 0 and verdict.kind == "lost"


def test_the_board_round_trips_ends_and_the_published_run():
    board = NodeBoard(FakeStore())
    assert board.published_run() is None and board.ended(range(2)) == {}
    board.publish_run("abc", "/shared/out/run.json")
    board.end(NodeEnd(1, False, 2, "refused the run: x", 3.5, root=True))
    assert board.published_run() == {"sha256": "abc", "path": "/shared/out/run.json"}
    assert board.ended(range(2)) == {1: NodeEnd(1, False, 2, "refused the run: x", 3.5, True)}
    assert not board.all_ready(range(2))
    board.ready(0), board.ready(1)
    assert board.all_ready(range(2))


@pytest.mark.parametrize("kind", ["failed", "lost", "never joined"])
def test_every_verdict_names_its_node(kind):
    from HyperSloth.launch.node_watch import Verdict

    assert Verdict(3, kind, "why").describe().startswith("node 3 ")
