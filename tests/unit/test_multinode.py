"""A node of a multi-node run (HyperSloth.launch.multinode): its flags, the check that every node sees one run,
the workers' environment and logs, and what each node says at the end. The real two-node runs are in
tests/integration/test_multinode_runs.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from HyperSloth.cli.train import _node_layout
from HyperSloth.launch import multinode
from HyperSloth.launch.local import LaunchError
from HyperSloth.launch.multinode import explain
from HyperSloth.launch.node_join import NodeLayout, NodeRun, Stopped, preflight, refuse_reason, sha256_text
from HyperSloth.launch.node_watch import NodeBoard, NodeEnd, Verdict
from HyperSloth.outputs import run_files
from test_multinode_watch import FakeStore  # same folder: pytest puts it on sys.path, as for training_fixtures


def _layout(node: int = 0, nnodes: int = 2) -> NodeLayout:
    return NodeLayout(nnodes, node, "10.0.0.1", 29500)


def _run(tmp_path: Path, description: dict | None = None, gpus=(0, 1)) -> NodeRun:
    text = json.dumps(description or {"world_size": 4, "output_dir": str(tmp_path)}, indent=2) + "\n"
    run_files.run_file(tmp_path).write_text(text)
    return NodeRun(run_files.run_file(tmp_path), text, tuple(gpus), False)


@pytest.mark.parametrize("flags, message", [
    ((2, None, "h", 29500), "--nnodes 2 also needs --node-rank"),
    ((2, 2, "h", 29500), "--node-rank 2 is not a node of --nnodes 2"),
    ((2, 0, "h", 70000), "--master-port 70000 is not a TCP port"),
    ((2, 0, " ", 29500), "--master-addr is empty"),
    ((0, 0, "h", 29500), "--nnodes 0: give the number of machines"),
    (("two", 0, "h", 29500), "must be whole numbers"),
])
def test_the_flags_are_refused_with_what_to_change(flags, message):
    with pytest.raises(LaunchError, match=message):
        NodeLayout.from_flags(*flags)


def test_one_machine_needs_no_node_flags_and_node_flags_need_nnodes():
    assert _node_layout(None, None, None, None) is None and _node_layout(1, None, None, None) is None
    with pytest.raises(LaunchError, match="--node-rank, --master-port belong to a multi-node run: add --nnodes"):
        _node_layout(None, 1, None, 29500)
    layout = _node_layout(3, 2, "node0", "29400")
    assert layout == NodeLayout(3, 2, "node0", 29400) and not layout.is_master
    assert layout.world_size(4) == 12 and layout.ranks_of(2, 4) == range(8, 12)


def test_the_elastic_config_never_restarts_and_ranks_follow_the_node_rank(tmp_path):
    config = multinode.launch_config(_layout(1), 2, tmp_path, grace_s=5.0)
    assert (config.max_restarts, config.rdzv_backend, config.rdzv_endpoint) == (0, "static", "10.0.0.1:29500")
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 2)
    assert config.rdzv_configs["rank"] == 1 and config.shutdown_timeout == 5


def test_worker_logs_are_named_by_global_rank_and_rank_zero_stays_on_the_terminal(tmp_path):
    envs = {0: {"RANK": "0"}, 1: {"RANK": "1"}}
    dest = multinode.rank_logs(tmp_path).reify(envs)
    assert dest.stderrs == {0: "", 1: str(run_files.rank_file_in(tmp_path, 1, "stderr"))}
    assert dest.stdouts == {0: "", 1: str(run_files.rank_file_in(tmp_path, 1, "stdout"))}
    node1 = multinode.rank_logs(tmp_path).reify({0: {"RANK": "2"}, 1: {"RANK": "3"}})
    assert node1.stderrs[1] == str(run_files.rank_file_in(tmp_path, 3, "stderr"))
    assert envs[1]["TORCHELASTIC_ERROR_FILE"] == ""


def test_the_agent_hands_each_worker_this_nodes_gpus_and_no_launcher_variables():
    base = {"PATH": "/bin", "RANK": "3", run_files.ENV_RANK: "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7", "NCCL_X": "1"}
    env = multinode.node_env(base, (1, 3), cuda=True)
    assert env["CUDA_VISIBLE_DEVICES"] == "5,7" and env["NCCL_X"] == "1"
    assert "RANK" not in env and run_files.ENV_RANK not in env
    cpu = multinode.node_env({"PATH": "/bin"}, (0, 1), cuda=False)
    assert cpu["CUDA_VISIBLE_DEVICES"] == "" and int(cpu["OMP_NUM_THREADS"]) >= 1


def test_a_node_that_cannot_see_node_zeros_run_is_refused_naming_the_shared_folder(tmp_path):
    run = _run(tmp_path)
    published = {"sha256": sha256_text(run.run_json), "path": str(run.run_path)}
    assert refuse_reason(1, run, published) is None
    missing = refuse_reason(1, run, {**published, "path": str(tmp_path / "elsewhere" / "run.json")})
    assert missing.startswith("node 1 cannot read") and "shared file system" in missing
    assert "reads another" in refuse_reason(1, run, {**published, "sha256": "0" * 64})
    other = NodeRun(run.run_path, json.dumps({"world_size": 2, "output_dir": str(tmp_path)}), (0,), False)
    assert "they differ in world_size" in refuse_reason(1, other, published)
    elsewhere = json.loads(run.run_json) | {"config_path": "/node1/copy/config.py"}  # each node's own copy
    assert refuse_reason(1, NodeRun(run.run_path, json.dumps(elsewhere), (0,), False), published) is None


def test_preflight_node_zero_publishes_and_a_refusing_node_raises(tmp_path):
    store, watch = FakeStore(), SimpleNamespace(verdict=None)
    run = _run(tmp_path)
    NodeBoard(store).ready(1)  # node 1 is ready before node 0 waits
    assert preflight(_layout(0), NodeBoard(store), watch, lambda: run, 1.0) is run
    assert NodeBoard(store).published_run()["path"] == str(run.run_path)
    other = NodeRun(run.run_path, json.dumps({"world_size": 8}), (0,), False)
    with pytest.raises(LaunchError, match="node 1 resolved another run than node 0"):
        preflight(_layout(1), NodeBoard(store), watch, lambda: other, 1.0)
    with pytest.raises(LaunchError, match="waited 0 s for node 0 to prepare the run"):
        preflight(_layout(1), NodeBoard(FakeStore()), watch, lambda: run, 0.0)


def test_a_verdict_during_preflight_stops_the_wait(tmp_path):
    watch = SimpleNamespace(verdict=Verdict(1, "failed", "refused the run: no dataset", code=2))
    with pytest.raises(Stopped, match="node 1 failed: refused the run"):
        preflight(_layout(0), NodeBoard(FakeStore()), watch, lambda: _run(tmp_path), 5.0)


def _failure_record(logs: Path, rank: int, when: float, error: str) -> None:
    logs.mkdir(exist_ok=True)
    run_files.rank_file_in(logs, rank, "failure.json").write_text(json.dumps({"rank": rank, "time": when,
                                                                               "error": error}))


def test_the_end_names_a_lost_node_before_any_worker_error(tmp_path):
    run, layout = _run(tmp_path, gpus=(0,)), _layout(0)
    _failure_record(run_files.logs_dir(tmp_path), 0, 1.0, "RuntimeError: Connection closed by peer")
    end = NodeEnd(0, False, 1, "rank 0 failed", root=True)
    code, lines = explain(layout, run, end, Verdict(1, "lost", "no heartbeat for 31 s"))
    assert code == 1 and lines == ["node 1 was lost: no heartbeat for 31 s; stopped node 0's 1 worker(s)."]
    code, lines = explain(layout, run, end, Verdict(1, "stopped", "stopped by SIGTERM", code=143))
    assert code == 1 and lines == ["node 1 was stopped by SIGTERM; stopped node 0's 1 worker(s)."]


def test_the_end_names_the_rank_that_failed_first_and_its_node(tmp_path):
    run, layout = _run(tmp_path, gpus=(0, 1)), _layout(0)
    logs = run_files.logs_dir(tmp_path)
    _failure_record(logs, 0, 2.0, "RuntimeError: Connection closed by peer")
    _failure_record(logs, 3, 1.0, "RuntimeError: injected failure\nsecond line")
    verdict = Verdict(1, "failed", "rank 3 (gpu 1) failed with RuntimeError: injected failure on node 1")
    code, lines = explain(layout, run, NodeEnd(0, False, 1, "x", root=False), verdict)
    assert code == 1
    assert lines[0] == ("rank 3 (gpu 1) failed with RuntimeError: injected failure on node 1; "
                        "stopped node 0's 2 worker(s).")
    assert lines[1] == "    second line" and lines[2].startswith("full traceback: ")


def test_the_end_of_a_finished_node_and_of_a_stopped_one(tmp_path):
    run, layout = _run(tmp_path, gpus=(0,)), _layout(1)
    assert explain(layout, run, NodeEnd(1, True, 0), None) == (
        0, [f"node 1: all 1 worker(s) finished; output in {tmp_path}"])
    late = Verdict(0, "failed", "rank 0 (gpu 0) failed with OSError: No space left on device on node 0")
    assert explain(layout, run, NodeEnd(1, True, 0), late) == (  # its final save, after node 1's workers ended
        1, ["node 1: all 1 worker(s) finished, but node 0 failed: rank 0 (gpu 0) failed with OSError: No space left "
            "on device on node 0"])
    assert explain(layout, run, NodeEnd(1, False, 130, "stopped by SIGINT"), None) == (
        130, ["node 1: received SIGINT; stopped node 1's 1 worker(s)"])
    # Without failure records: a peer's root cause is named; this node's own when the peer only followed it.
    peer = Verdict(0, "failed", "rank 0 (gpu 0) failed with exit code 1 on node 0")
    assert explain(layout, run, NodeEnd(1, False, 1, "stopped: ...", root=False), peer)[1][0].startswith(
        "node 0 failed: rank 0 (gpu 0) failed with exit code 1")
    follower = Verdict(0, "failed", "stopped: node 1 failed: ...", root=False)
    assert explain(layout, run, NodeEnd(1, False, 1, "rank 1 (gpu 0) failed with exit code 1 on node 1"),
                   follower)[1] == ["node 1: rank 1 (gpu 0) failed with exit code 1 on node 1; stopped node 1's 1 "
                                    "worker(s)."]


@pytest.mark.parametrize("value, expected", [("", 30.0), ("12", 12.0), (" 90.5 ", 90.5)])
def test_the_node_timeout_comes_from_the_environment(value, expected):
    assert multinode.node_timeout_s({run_files.ENV_NODE_TIMEOUT: value}) == expected


@pytest.mark.parametrize("value", ["abc", "1", "-5", "99999"])
def test_a_bad_node_timeout_says_what_to_write(value):
    with pytest.raises(LaunchError, match=f"{run_files.ENV_NODE_TIMEOUT}=.*give the seconds"):
        multinode.node_timeout_s({run_files.ENV_NODE_TIMEOUT: value})


def test_child_pids_finds_this_process_children():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in multinode.child_pids() and os.getpid() not in multinode.child_pids()
    finally:
        child.kill()
        child.wait()


def test_a_worker_under_the_elastic_agent_knows_its_node_share():
    """The agent's variables (node 1 of 2, 2 workers each): global rank, and the local world size that splits
    the node's host memory in the automatic budget (train.budget.settle's local_ranks)."""
    from HyperSloth.train.dist import DistInfo

    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    info = DistInfo.from_env(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert info.launched_by == "torchrun" and not info.is_main


def test_a_node_worker_dies_with_its_agent_even_when_the_agent_is_sigkilled(tmp_path):
    """node_worker sets the parent-death signal and then execs the worker: an agent killed with SIGKILL (no
    chance to stop anything) still takes its workers with it."""
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "worker.pid"
    worker = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    agent = (f"import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-m', "
             f"'HyperSloth.launch.node_worker', str(os.getpid()), sys.executable, '-c', {worker!r}]); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", agent])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert "-c" in Path(f"/proc/{child}/cmdline").read_text()  # the worker itself, by exec
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and not multinode._is_zombie(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or multinode._is_zombie(child)


def test_a_node_worker_whose_agent_is_already_gone_does_not_start(tmp_path):
    import subprocess
    import sys

    marker = tmp_path / "ran"
    done = subprocess.run([sys.executable, "-m", "HyperSloth.launch.node_worker", "1", sys.executable, "-c",
                           f"open({str(marker)!r}, 'w')"], timeout=60)
    assert done.returncode == -9 and not marker.exists()  # its parent is not pid 1: it killed itself
