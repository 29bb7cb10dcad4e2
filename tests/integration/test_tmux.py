"""tmux mode against a real tmux server on a private socket (never the user's server)."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from HyperSloth.launch.local import TORCHRUN_VARS, LaunchError, TmuxSessionExists
from HyperSloth.launch.tmux import launch_tmux

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="the tmux binary is not installed")

libtmux = pytest.importorskip("libtmux")

FAKE_WORKER = textwrap.dedent('''
    import json, os, socket, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["HYPERSLOTH_RANK"])
    addr, port = os.environ["HYPERSLOTH_MASTER_ADDR"], int(os.environ["HYPERSLOTH_MASTER_PORT"])
    try:  # the monitor in window `main` must already own the rendezvous port
        socket.socket().bind((addr, port))
        port_owned = False
    except OSError:
        port_owned = True
    with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
        json.dump({"pid": os.getpid(), "env": dict(os.environ), "port_owned": port_owned}, f)
    os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
    print(f"rank {rank} is training", flush=True)
    if mode == "fail" and rank == 1:
        raise RuntimeError("boom from rank 1")
    time.sleep(0.3 if mode == "ok" else 60)
''')


def wait_for(predicate, timeout: float = 60.0) -> None:  # polls: generous costs nothing when it happens
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture
def tmux_run(tmp_path, monkeypatch):
    """A private tmux server (killed at the end) and a helper that starts a fake run in it."""
    socket_name, session = f"hs-test-{uuid.uuid4().hex[:8]}", f"hs-{uuid.uuid4().hex[:8]}"
    script, records = tmp_path / "fake_worker.py", tmp_path / "records"
    script.write_text(FAKE_WORKER)
    records.mkdir()
    # The tmux server starts from this environment; the windows must still not see torchrun's variables.
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("MASTER_PORT", "29501")
    server = libtmux.Server(socket_name=socket_name)

    def start(mode: str, gpus=(0, 1), replace: bool = False) -> str:
        return launch_tmux(tmp_path / "cfg.py", list(gpus), tmp_path / "out", session, replace=replace,
                           worker_argv=[sys.executable, str(script), str(records), mode], cuda=False,
                           socket_name=socket_name, grace_s=3.0)

    def records_of(world: int) -> list[dict]:
        wait_for(lambda: all((records / f"rank{r}.json").exists() for r in range(world)))
        return [json.loads((records / f"rank{r}.json").read_text()) for r in range(world)]

    def pane_text(window: str) -> str:
        return "\n".join(server.sessions.get(session_name=session).windows.get(window_name=window)
                         .active_pane.capture_pane())

    try:
        yield type("Run", (), dict(start=staticmethod(start), records=staticmethod(records_of), server=server,
                                   session=session, socket=socket_name, out=tmp_path / "out",
                                   records_dir=records, pane=staticmethod(pane_text)))
    finally:
        if server.is_alive():
            # the server may exit between is_alive and this query (its last session just ended): no path then
            socket_path = (server.cmd("display-message", "-p", "#{socket_path}").stdout or [None])[0]
            server.kill()
            if socket_path:
                Path(socket_path).unlink(missing_ok=True)  # tmux 3.3 leaves the socket file behind


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def exit_codes(out: Path, world: int) -> dict[int, str]:
    files = {r: out / "logs" / f"rank{r}.exitcode" for r in range(world)}
    return {r: f.read_text().strip() for r, f in files.items() if f.exists()}


def test_session_has_main_and_one_window_per_rank_running_the_workers(tmux_run):
    attach = tmux_run.start("ok")
    assert attach == f"tmux -L {tmux_run.socket} attach -t {tmux_run.session}"
    session = tmux_run.server.sessions.get(session_name=tmux_run.session)
    assert [w.window_name for w in session.windows] == ["main", "rank0", "rank1"]
    records = tmux_run.records(2)
    assert all(record["port_owned"] for record in records)  # bound by the monitor, published here:
    assert (tmux_run.out / "logs" / "rendezvous.port").read_text().strip() == records[0]["env"]["HYPERSLOTH_MASTER_PORT"]
    rank0, rank1 = (record["env"] for record in records)
    assert (rank0["HYPERSLOTH_RANK"], rank1["HYPERSLOTH_RANK"]) == ("0", "1")
    assert rank0["HYPERSLOTH_MASTER_PORT"] == rank1["HYPERSLOTH_MASTER_PORT"]
    assert rank0["CUDA_VISIBLE_DEVICES"] == "" and rank0["HYPERSLOTH_WORLD_SIZE"] == "2"
    assert not set(TORCHRUN_VARS) & set(rank0)
    wait_for(lambda: exit_codes(tmux_run.out, 2) == {0: "0", 1: "0"})
    # The windows stay open after exit showing the code; main reports when all are done.
    wait_for(lambda: "[all ranks finished] rank 0: exit 0, rank 1: exit 0" in tmux_run.pane("main"))
    assert "rank 1 is training" in tmux_run.pane("rank1")
    assert "rank 1 (gpu 1) exited with code 0" in tmux_run.pane("rank1")


def test_existing_session_is_refused_then_replaced_with_y(tmux_run):
    tmux_run.start("sleep", gpus=[0])
    first = tmux_run.records(1)[0]
    with pytest.raises(TmuxSessionExists, match="--y"):
        tmux_run.start("ok", gpus=[0])
    assert alive(first["pid"]), "refusing must leave the running session alone"
    (tmux_run.records_dir / "rank0.json").unlink()
    tmux_run.start("ok", gpus=[0], replace=True)
    session = tmux_run.server.sessions.get(session_name=tmux_run.session)
    assert [w.window_name for w in session.windows] == ["main", "rank0"]
    assert tmux_run.records(1)[0]["pid"] != first["pid"]
    wait_for(lambda: not alive(first["pid"]))  # the replaced session's worker got SIGHUP
    wait_for(lambda: exit_codes(tmux_run.out, 1) == {0: "0"})


def test_failed_rank_makes_main_window_stop_the_others(tmux_run):
    tmux_run.start("fail")
    tmux_run.records(2)
    # rank 1 raises at once; rank 0 would sleep 60 s but is stopped (SIGTERM -> exit 143).
    wait_for(lambda: exit_codes(tmux_run.out, 2) == {0: "143", 1: "1"}, timeout=120)  # 143: stopped, not done
    wait_for(lambda: "rank 1 (gpu 1) failed with exit code 1; stopping the others" in tmux_run.pane("main"))
    assert "RuntimeError: boom from rank 1" in tmux_run.pane("rank1")


def test_a_monitor_that_cannot_start_leaves_no_session(tmux_run, monkeypatch):
    # The monitor holds the rendezvous store; without it no rank window may start, and the
    # half-made session goes away with a message that shows what the monitor printed.
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(LaunchError, match="did not publish the rendezvous port") as err:
        tmux_run.start("ok")
    assert "/nonexistent/python" in str(err.value)
    assert not tmux_run.server.has_session(tmux_run.session)
    assert not (tmux_run.records_dir / "rank0.json").exists()
