"""Two simulated nodes on one host (loopback, CPU, gloo): `hypersloth-train CONFIG --nnodes 2 --node-rank R
--master-addr 127.0.0.1 --master-port P` started twice, as two machines would start it.

One shared pair of runs checks the exactness (2 nodes x 1 worker train the adapter of 1 node x 2 workers at
the same global batch), and one run checks a lost node: node 1's agent and its worker are SIGKILLed in
step 3, as a machine that loses power; node 0 must stop, exit 1 and name node 1, and leave no worker.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from training_fixtures import (
    MAX_STEPS,
    RUN_TIMEOUT_S,
    RunSpec,
    _free_port,
    _run,
    _script,
    build_inputs,
    flat_adapter,
    processes_mentioning,
    relative_error,
    run_env,
    write_config,
)

from HyperSloth.outputs import run_files

pytestmark = pytest.mark.slow

NODE_TIMEOUT_S = 10  # HYPERSLOTH_NODE_TIMEOUT_S for the lost-node run (default 30): CI time
# Node 1's worker kills its agent and itself inside its 3rd optimizer step: the node is gone at once, as a
# machine that lost power (no end record, no failure record, the store connection dropped).
NODE_DIES = '''
import os as _os, signal as _signal
if _os.environ.get("GROUP_RANK") == "1":
    from HyperSloth.train.sft.trainer import HyperSlothTrainer as _Trainer
    _step, _calls = _Trainer.training_step, []
    def _node_dies(self, *args, **kwargs):
        _calls.append(1)
        if len(_calls) == 3:
            _os.kill(_os.getppid(), _signal.SIGKILL)
            _os.kill(_os.getpid(), _signal.SIGKILL)
        return _step(self, *args, **kwargs)
    _Trainer.training_step = _node_dies
'''


def run_nodes(spec: RunSpec, workdir: Path, model_dir: Path, nnodes: int = 2, **env: str) -> dict:
    """Every node's `hypersloth-train` at once (one thread each), to their ends: {node: (code, output, ended)}."""
    config = write_config(spec, workdir, model_dir)
    port = _free_port()
    argv = [*_script("hypersloth-train"), str(config), "--nnodes", str(nnodes), "--master-addr", "127.0.0.1",
            "--master-port", str(port)]
    with ThreadPoolExecutor(max_workers=nnodes) as pool:
        futures = {node: pool.submit(_run, [*argv, "--node-rank", str(node)], workdir, run_env(**env), RUN_TIMEOUT_S)
                   for node in range(nnodes)}
        return {node: future.result() for node, future in futures.items()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("multinode")


@pytest.fixture(scope="module")
def model_dir(workdir, tiny_model_dir):
    return build_inputs(workdir, tiny_model_dir)


@pytest.fixture(scope="module")
def pair(workdir, model_dir):
    """1 node x 2 workers (the launcher) and 2 nodes x 1 worker, run side by side: same global batch (16)."""
    one = RunSpec("one-node-2w", gpus=2)
    two = RunSpec("two-nodes-1w", gpus=1)
    with ThreadPoolExecutor(max_workers=2) as pool:
        single = pool.submit(_run, [*_script("hypersloth-train"), str(write_config(one, workdir, model_dir))],
                             workdir, run_env(), RUN_TIMEOUT_S)
        nodes = run_nodes(two, workdir, model_dir)
        return single.result(), nodes, workdir / "outputs" / one.name, workdir / "outputs" / two.name


def test_two_nodes_train_the_adapter_of_one_node(pair):
    (code, output, _), nodes, single_out, nodes_out = pair
    assert code == 0, output[-3000:]
    for node, (node_code, node_output, _) in nodes.items():
        assert node_code == 0, f"node {node}:\n{node_output[-3000:]}"
        assert f"node {node}: all 1 worker(s) finished" in node_output
    single, multi = (json.loads((out / run_files.SUMMARY_FILE).read_text()) for out in (single_out, nodes_out))
    assert multi["world_size"] == 2 and multi["global_batch_size"] == single["global_batch_size"] == 16
    assert len(multi["step_losses"]) == MAX_STEPS
    np.testing.assert_allclose(multi["step_losses"], single["step_losses"], rtol=1e-6)
    from safetensors.numpy import load_file

    adapters = [flat_adapter(load_file(str(out / "adapter_model.safetensors"))) for out in (single_out, nodes_out)]
    assert relative_error(*adapters) <= 5e-6
    # One log layout: every rank's files by global rank in the shared folder; rank 1 ran under node 1's agent.
    logs = run_files.logs_dir(nodes_out)
    assert "worker 1/2 (torchrun)" in run_files.rank_file_in(logs, 1, "log").read_text()
    assert run_files.rank_file_in(logs, 1, "stderr").is_file()
    records = [json.loads(run_files.rank_file_in(logs, r, "final.json").read_text()) for r in range(2)]
    assert records[0]["sha256"] == records[1]["sha256"]


def test_a_lost_node_stops_the_other_naming_it_and_leaves_no_worker(workdir, model_dir):
    spec = RunSpec("node-lost", gpus=1)
    inject = workdir / "inject-node-lost"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(NODE_DIES)
    nodes = run_nodes(spec, workdir, model_dir, HYPERSLOTH_NODE_TIMEOUT_S=str(NODE_TIMEOUT_S),
                      PYTHONPATH=os.pathsep.join(filter(None, [str(inject), os.environ.get("PYTHONPATH")])))
    (code0, output0, ended0), (code1, _, ended1) = nodes[0], nodes[1]
    assert code1 == -signal.SIGKILL  # node 1 died in step 3, as a machine that lost power
    assert code0 == 1, output0[-3000:]
    assert "hypersloth-train: node 1 was lost: no heartbeat for" in output0, output0[-3000:]
    assert "stopped node 0's 1 worker(s)" in output0
    assert ended0 - ended1 < 90  # the bound; NODE_TIMEOUT_S + a beat + the stop, here
    out = workdir / "outputs" / spec.name
    assert not (out / run_files.SUMMARY_FILE).exists()
    assert processes_mentioning(str(run_files.run_file(out))) == []


@pytest.mark.skipif(shutil.which("tmux") is None, reason="the tmux binary is not installed")
def test_one_node_in_tmux_runs_its_command_in_main_and_follows_its_ranks_logs(tmp_path, monkeypatch):
    libtmux = pytest.importorskip("libtmux")
    from HyperSloth.launch.tmux import launch_node_tmux

    socket_name, session = f"hs-test-{uuid.uuid4().hex[:8]}", f"hs-{uuid.uuid4().hex[:8]}"
    logs = tmp_path / "logs"
    logs.mkdir()
    run_files.rank_file_in(logs, 2, "log").write_text("rank 2 says hello\n")
    command = [sys.executable, "-c", "import os; print('agent of node 1,', os.environ.get('NCCL_DEBUG'))"]
    monkeypatch.setenv("NCCL_DEBUG", "WARN")  # the window gets the launcher's environment, not the tmux server's
    try:
        attach = launch_node_tmux(command, session, logs, [2, 3], socket_name=socket_name)
        assert attach == f"tmux -L {socket_name} attach -t {session}"
        tmux = libtmux.Server(socket_name=socket_name).sessions.get(session_name=session)
        assert [w.window_name for w in tmux.windows] == ["main", "rank2", "rank3"]
        pane = lambda name: "\n".join(tmux.windows.get(window_name=name).active_pane.capture_pane())  # noqa: E731
        deadline = time.monotonic() + 20
        while ("agent of node 1, WARN" not in pane("main") or "hello" not in pane("rank2")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "agent of node 1, WARN" in pane("main") and "rank 2 says hello" in pane("rank2")
    finally:
        libtmux.Server(socket_name=socket_name).kill()
