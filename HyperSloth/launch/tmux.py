"""tmux mode of the launcher: one window per rank plus a `main` window that follows rank 0, stops every
rank when one fails and summarises the exit codes. Same worker contract as `launch.launch`.

`hypersloth-train --tmux` returns once the session exists, so it cannot hold the rendezvous port:
the `main` window's monitor does. It binds the run's port (port 0, `rendezvous.reserve_port`), writes it
to `logs/rendezvous.port`, serves the TCPStore on it and holds the store until every rank has exited; the
launcher waits for that file before it creates the rank windows, so a port is never chosen and bound apart,
and the monitor's torch import overlaps the ranks' own.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from HyperSloth.launch.local import (
    ERROR_LINES,
    MASTER_ADDR,
    STDERR_TAIL_LINES,
    LaunchError,
    TmuxSessionExists,
    WorkerSpec,
    build_worker_specs,
    cuda_device_count,
    recorded_error,
    stamped_env,
    stop_process_groups,
)
from HyperSloth.outputs import run_files
from HyperSloth.outputs.startup import StartupTimeline

from HyperSloth.outputs.run_files import RENDEZVOUS_PORT_FILE, TORCHRUN_VARS, rank_file_in

PORT_WAIT_S = 120.0  # the monitor's Python start and imports (no torch) before it binds the port

# A tmux window inherits the tmux *server's* environment, not ours; these launcher variables are
# passed inline so a run started from a virtualenv with NCCL settings behaves as without tmux.
_TMUX_FORWARD_NAMES = ("PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "LD_LIBRARY_PATH")
_TMUX_FORWARD_PREFIXES = (
    "NCCL_", "TORCH_", "PYTORCH_", "CUDA_", "GLOO_", "HF_", "TRANSFORMERS_", "UNSLOTH_", "OMP_", "MKL_",
    "TOKENIZERS_", "WANDB_", run_files.ENV_PREFIX,
)


# ---------------------------------------------------------------- tmux: one window per rank


def _inline_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of `env` a tmux window must get explicitly (it inherits the tmux server's env, not ours)."""
    keep = {
        name: value for name, value in env.items()
        if (name in _TMUX_FORWARD_NAMES or name.startswith(_TMUX_FORWARD_PREFIXES)) and "\n" not in value
    }
    return dict(sorted(keep.items()))


def _env_command(env: Mapping[str, str], argv: Sequence[str]) -> str:
    """`env -u RANK ... VAR=value ... argv`: the same environment as a spawned worker, set inline."""
    unset = " ".join(f"-u {name}" for name in TORCHRUN_VARS)
    assigns = " ".join(shlex.quote(f"{name}={value}") for name, value in _inline_env(env).items())
    return f"env {unset} {assigns} {shlex.join(argv)}"


def _rank_script(spec: WorkerSpec, logs_dir: Path) -> str:
    """Shell script of a rank window: record the pane's pid, run the worker, record its exit code, stay open.

    The trap keeps the shell alive when the monitor (or Ctrl-C) stops the worker, so the exit code
    is still written and the window keeps showing the worker's last output.
    """
    pid_file = shlex.quote(str(rank_file_in(logs_dir, spec.rank, "pid")))
    code_file = rank_file_in(logs_dir, spec.rank, "exitcode")
    done = f"rank {spec.rank} (gpu {spec.gpu}) exited with code $code; press Enter to close this window"
    return "\n".join([
        f"trap 'echo \"[rank {spec.rank}: stop signal received]\"' INT TERM",
        f"echo $$ > {pid_file}",
        _env_command(spec.env, spec.argv),
        "code=$?",
        f"echo $code > {shlex.quote(str(code_file))}.tmp && mv {shlex.quote(str(code_file))}.tmp {shlex.quote(str(code_file))}",
        f'echo "[{done}]"',
        "read _",
    ])


def _main_script(logs_dir: Path, gpus: Sequence[int], grace_s: float) -> str:
    monitor = [sys.executable, "-m", "HyperSloth.launch.tmux", "monitor", str(logs_dir), ",".join(map(str, gpus)),
               str(grace_s), str(logs_dir / RENDEZVOUS_PORT_FILE)]
    return _env_command(os.environ, monitor) + '\necho "[press Enter to close this window]"\nread _'


def _window_command(script: str) -> str:
    # Whatever the user's default-shell is (fish, zsh), the script runs under /bin/sh.
    return "exec /bin/sh -c " + shlex.quote(script)


def _tmux_server(socket_name: str | None):
    if shutil.which("tmux") is None:
        raise LaunchError("--tmux needs the tmux program, which is not on PATH: install it "
                          "(e.g. `apt-get install tmux`) or run without --tmux")
    import libtmux

    return libtmux.Server(socket_name=socket_name)


def check_tmux_session(session: str, *, replace: bool = False, socket_name: str | None = None):
    """The tmux server, once tmux is found, `session` is a name tmux takes and it is free (or `replace`);
    LaunchError / TmuxSessionExists otherwise. Changes nothing: the launcher calls it before it writes."""
    if not session or any(c in session for c in ".:"):
        raise LaunchError(f"tmux session name {session!r} is not allowed: use letters, digits, '-' or '_'")
    server = _tmux_server(socket_name)
    if server.has_session(session) and not replace:
        raise TmuxSessionExists(f"tmux session '{session}' already exists: pass --y to replace it, "
                                "or choose another name")
    return server


def launch_tmux(
    config_path: str | os.PathLike,
    gpus: Sequence[int],
    output_dir: str | os.PathLike,
    session: str,
    *,
    replace: bool = False,
    worker_argv: Sequence[str] | None = None,
    cuda: bool | None = None,
    socket_name: str | None = None,
    grace_s: float = 5.0,
    timeline: StartupTimeline | None = None,
) -> str:
    """Create tmux session `session`: window `main` (monitor) and one window per GPU (`rank0`, ...).

    Returns as soon as the session exists, with the command to attach to it. An existing session
    raises TmuxSessionExists unless `replace`. `socket_name` picks a private tmux server (`tmux -L`);
    `timeline`: the launcher's start-up stamps, handed to the rank windows.
    """
    server = check_tmux_session(session, replace=replace, socket_name=socket_name)
    if server.has_session(session):
        server.kill_session(session)
    cuda = cuda_device_count() > 0 if cuda is None else cuda
    logs_dir = run_files.logs_dir(output_dir).resolve()
    logs_dir.mkdir(parents=True, exist_ok=True)
    port_file = logs_dir / RENDEZVOUS_PORT_FILE
    for stale in [*run_files.rank_files_in(logs_dir, "exitcode"), *run_files.rank_files_in(logs_dir, "pid"), port_file]:
        stale.unlink(missing_ok=True)  # a previous run's exit codes would make the monitor finish at once
    main = _window_command(_main_script(logs_dir, gpus, grace_s))
    tmux_session = server.new_session(
        session_name=session, window_name="main", start_directory=os.getcwd(), window_command=main, attach=False
    )
    try:  # a half-made session (Ctrl-C, a monitor that never binds) must not stay behind
        port = _wait_for_port(port_file, tmux_session)
        specs = build_worker_specs(config_path, gpus, output_dir, port=port, cuda=cuda, worker_argv=worker_argv,
                                   base_env=stamped_env(timeline, "rendezvous"))
        for spec in specs:
            tmux_session.new_window(window_name=run_files.rank_name(spec.rank), start_directory=os.getcwd(),
                                    window_shell=_window_command(_rank_script(spec, logs_dir)), attach=False)
    except BaseException:
        tmux_session.kill()
        raise
    socket = f"-L {shlex.quote(socket_name)} " if socket_name else ""
    return f"tmux {socket}attach -t {shlex.quote(session)}"


def launch_node_tmux(command: Sequence[str], session: str, logs_dir: str | os.PathLike, ranks: Sequence[int], *,
                     replace: bool = False, socket_name: str | None = None) -> str:
    """One machine of a multi-node run in tmux session `session` (HyperSloth.launch.multinode): window `main`
    runs `command` (this node's `hypersloth-train ... --nnodes ...`, the elastic agent: it stops this node's
    workers when a peer fails, and shows rank 0's output on node 0), and one window per global rank of
    `ranks` follows that rank's log (`tail -F`). Returns the `tmux attach` command once the session exists."""
    server = check_tmux_session(session, replace=replace, socket_name=socket_name)
    if server.has_session(session):
        server.kill_session(session)
    main = _env_command(os.environ, command) + '\necho "[press Enter to close this window]"\nread _'
    tmux_session = server.new_session(session_name=session, window_name="main", start_directory=os.getcwd(),
                                      window_command=_window_command(main), attach=False)
    for rank in ranks:
        log = shlex.quote(str(rank_file_in(Path(logs_dir).resolve(), rank, "log")))
        tmux_session.new_window(window_name=run_files.rank_name(rank), start_directory=os.getcwd(),
                                window_shell=_window_command(f"exec tail -n +1 -F {log} 2>/dev/null"), attach=False)
    socket = f"-L {shlex.quote(socket_name)} " if socket_name else ""
    return f"tmux {socket}attach -t {shlex.quote(session)}"


def _wait_for_port(port_file: Path, tmux_session, timeout_s: float = PORT_WAIT_S) -> int:
    """The port the `main` window's monitor bound; LaunchError with its window's text if it never comes."""
    def main_pane() -> list[str]:
        return tmux_session.windows.get(window_name="main").active_pane.capture_pane()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.is_file() and (text := port_file.read_text().strip()):
            return int(text)
        if "press Enter to close this window" in "\n".join(main_pane()):  # the monitor ended
            break
        time.sleep(0.1)
    output = "\n".join("    " + line for line in main_pane() if line.strip())
    raise LaunchError("the monitor in tmux window `main` did not publish the rendezvous port (it ended, or "
                      f"{timeout_s:.0f} s passed); nothing started. The window showed:\n{output}")


def _hold_rendezvous(port_file: Path):
    """Reserve the run's port, publish it (atomically: the launcher polls the file), then serve the store on
    it: the launcher starts the rank windows while this process imports torch for the store."""
    from HyperSloth.launch.rendezvous import host_store, reserve_port

    listener = reserve_port(MASTER_ADDR)
    try:
        run_files.atomic_write_text(port_file, f"{listener.getsockname()[1]}\n")
        return host_store(MASTER_ADDR, listener)
    finally:
        listener.close()  # a no-op once the store took the socket over


def _read_exit_codes(logs_dir: Path, world_size: int) -> dict[int, int]:
    codes = {}
    for rank in range(world_size):
        path = rank_file_in(logs_dir, rank, "exitcode")
        if path.is_file():
            codes[rank] = int(path.read_text().strip() or 1)
    return codes


def _stop_tmux_ranks(logs_dir: Path, ranks: Sequence[int], grace_s: float) -> dict[int, int]:
    """Stop the given ranks' panes (process groups); ranks not done after the grace are SIGKILLed (-9)."""
    pid_files = {rank: rank_file_in(logs_dir, rank, "pid") for rank in ranks}
    pgid_rank = {int(path.read_text()): rank for rank, path in pid_files.items() if path.is_file()}
    def done(pgid: int) -> bool:
        return rank_file_in(logs_dir, pgid_rank[pgid], "exitcode").is_file()
    stop_process_groups(list(pgid_rank), grace_s, done)
    codes = _read_exit_codes(logs_dir, max(ranks, default=-1) + 1)
    return {rank: codes.get(rank, -signal.SIGKILL) for rank in pgid_rank.values()}


class _LogFollower:
    """`tail -F` of one file into stdout, one `pump()` at a time."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def pump(self) -> None:
        if not self.path.is_file():
            return
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read()
        self.offset += len(chunk)
        sys.stdout.write(chunk.decode("utf-8", errors="replace"))
        sys.stdout.flush()


def _log_tail(path: Path, lines: int = STDERR_TAIL_LINES) -> list[str]:
    if not path.is_file():
        return [f"({path} does not exist)"]
    return path.read_text(errors="replace").rstrip("\n").split("\n")[-lines:]


def monitor_tmux_run(logs_dir: str | os.PathLike, gpus: Sequence[int], grace_s: float = 5.0, poll_s: float = 0.5,
                     port_file: str | os.PathLike | None = None) -> int:
    """The `main` window of a tmux run: follow rank 0's log, stop every rank when one fails, summarise.

    With `port_file`, first bind the run's rendezvous store, write its port there, and hold it until
    every rank has exited. Returns 0 when every rank exited 0, else 1.
    """
    store = _hold_rendezvous(Path(port_file)) if port_file is not None else None
    try:
        return _follow_ranks(Path(logs_dir), gpus, grace_s, poll_s)
    finally:
        del store


def _follow_ranks(logs: Path, gpus: Sequence[int], grace_s: float, poll_s: float) -> int:
    world = len(gpus)
    print(f"HyperSloth: {world} rank(s) on gpus {list(gpus)}; windows {run_files.rank_name(0)}..{run_files.rank_name(world - 1)} "
          f"(Ctrl-b n: next window). Following {rank_file_in(logs, 0, 'log')}\n", flush=True)
    follower, codes, failed = _LogFollower(rank_file_in(logs, 0, "log")), {}, None
    while len(codes) < world:
        follower.pump()
        codes.update(_read_exit_codes(logs, world))
        if failed is None and (failed := next((r for r, c in sorted(codes.items()) if c != 0), None)) is not None:
            print(f"\n[rank {failed} (gpu {gpus[failed]}) failed with exit code {codes[failed]}; stopping the others]")
            error = recorded_error(logs, failed)  # its own error; the traceback stays in its log
            shown = error.splitlines()[:ERROR_LINES] if error else _log_tail(rank_file_in(logs, failed, "log"))
            print("\n".join("    " + line for line in shown), flush=True)
        if failed is not None:  # again each round: a rank whose window had not started yet has no pid before
            codes.update(_stop_tmux_ranks(logs, [r for r in range(world) if r not in codes], grace_s))
        time.sleep(poll_s)
    follower.pump()
    print("\n[all ranks finished] " + ", ".join(f"rank {r}: exit {codes[r]}" for r in sorted(codes)), flush=True)
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    # Internal entry of the tmux `main` window:
    # python -m HyperSloth.launch.tmux monitor LOGS_DIR GPUS GRACE_S PORT_FILE
    if len(sys.argv) != 6 or sys.argv[1] != "monitor":
        sys.exit("usage: python -m HyperSloth.launch.tmux monitor LOGS_DIR GPU,GPU,... GRACE_S PORT_FILE")
    sys.exit(monitor_tmux_run(sys.argv[2], [int(g) for g in sys.argv[3].split(",")], float(sys.argv[4]),
                              port_file=sys.argv[5]))
