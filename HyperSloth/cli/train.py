"""`hypersloth-train CONFIG [--overwrite] [--tmux SESSION] [--y] [--dry-run] [--nnodes N --node-rank R
--master-addr HOST --master-port PORT]`: check, resolve, start the workers (of this node).

Everything that can be found wrong before a worker starts (config, dataset, model path, output
folder, GPUs) is reported here with exit code 2 and no traceback.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from HyperSloth.cli.command import Command, Flag, Positional
from HyperSloth.config import ConfigError, LoadedConfig, load_config
from HyperSloth.launch.local import (
    LaunchError,
    TmuxSessionExists,
    cuda_device_count,
    is_torchrun_env,
    launch,
)
from HyperSloth.launch.model_source import hub_problem
from HyperSloth.launch.multinode import NodeLayout, NodeRun, launch_multinode
from HyperSloth.launch.tmux import check_tmux_session, launch_node_tmux, launch_tmux
from HyperSloth.outputs import checkpoints, run_files
from HyperSloth.outputs.startup import StartupTimeline
from HyperSloth.plan.run import MachineFacts, RunDescription, resolve_run, write_run


@dataclass(frozen=True)
class CheckedRun:
    """What the launcher needs from a config that passed every pre-spawn check."""

    run_path: Path  # OUTPUT_DIR/run.json, the only thing the workers read
    gpus: list[int]
    output_dir: Path
    cuda: bool  # GPU workers (else CPU workers over gloo), as resolved: the GPUs are counted once


def _check_output_dir(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as err:
        raise LaunchError(f"output_dir {output_dir} is not writable ({err.strerror}): "
                          "set training_config_model.output_dir to a folder you can write") from None


def model_problems(loaded: LoadedConfig) -> list[str]:
    """The model (and the dataset's tokenizer) cannot be found, or their vocabularies differ."""
    from HyperSloth.data.tokenizer_check import tokenizer_mismatch

    hyper = loaded.hyper
    model_name = hyper.fast_model_args.model_name
    problem = hub_problem(model_name, "model_name")
    if problem:
        return [problem]
    try:
        entry = hyper.data.registry_entry()
    except ConfigError:
        return []  # the resolver reports the dataset
    built_with = str(entry.get("tokenizer") or "")
    if built_with and hub_problem(built_with, "tokenizer") is None:  # an unreachable one cannot be compared
        mismatch = tokenizer_mismatch(entry, model_name, hyper.data.dataset_name)
        if mismatch:
            return [mismatch]
    return []


def output_dir_problem(out: Path, checkpoint: str | None, *, overwrite: bool, peers_running: bool = False,
                       save_steps: int | None = None) -> str | None:
    """Why this run may not start in `out` (another run's files, --overwrite of the checkpoint it resumes
    from), saying what to do that works; None when it may."""
    latest = checkpoint == checkpoints.LATEST  # the newest complete checkpoint of `out` (resolved later)
    resumes_this_dir = latest or (checkpoint is not None and Path(checkpoint).resolve().is_relative_to(out.resolve()))
    if overwrite and resumes_this_dir:
        what = (f"the checkpoints of {out}, which resume_from_checkpoint={checkpoint!r} resumes from" if latest
                else f"{checkpoint}, the checkpoint this run resumes from")
        return (f"--overwrite would delete {what}: drop --overwrite to continue the run in its folder, or set "
                "another output_dir")
    if overwrite or resumes_this_dir or not run_files.holds_a_run(out, count_logs=not peers_running):
        return None
    if run_files.holds_nothing_to_keep(out):  # stopped before its first save: prepare_output_dir replaces it
        return None
    saved = sorted(out.glob(f"{run_files.CHECKPOINT_PREFIX}*"),
                   key=lambda p: int(p.name.rsplit("-", 1)[-1]) if p.name.rsplit("-", 1)[-1].isdigit() else -1)
    if not saved:  # a finished run that saved no checkpoint (every save_steps): nothing to resume from
        every = f" (every {save_steps} steps)" if save_steps else ""
        return (f"output_dir {out} holds an earlier run's adapter or results but no checkpoint{every}, so it "
                "cannot be resumed. Add --overwrite to start again in this folder (its files are removed first), "
                "or choose another output_dir")
    return (f"output_dir {out} holds an earlier run: add --overwrite to start clean (its files are removed first), "
            f"set resume_from_checkpoint={str(saved[-1])!r} (its last checkpoint) to continue it, or choose "
            "another output_dir")


def prepare_output_dir(description: RunDescription, *, overwrite: bool, peers_running: bool = False) -> list[str]:
    """Refuse to mix two runs in one folder; with --overwrite remove the earlier run's files first, and
    without it too when the earlier run left nothing to keep (stopped before its first checkpoint: the one
    line returned says so); on a resume keep the checkpoints but drop the earlier results and logs (a failed
    resume must not leave them looking like its own) and the unfinished saves of a crash. `peers_running`:
    torchrun's rank 0, whose peers may already be writing their logs: their rank files neither count as an
    earlier run nor get removed."""
    out = Path(description.output_dir)
    checkpoint = description.resume_from_checkpoint
    problem = output_dir_problem(out, checkpoint, overwrite=overwrite, peers_running=peers_running,
                                 save_steps=description.training_config.save_steps)
    if problem:
        raise LaunchError(problem)
    notes = []
    if not overwrite and checkpoint is None and run_files.holds_a_run(out, count_logs=not peers_running):
        notes.append(f"output_dir {out} held a run stopped before its first checkpoint (no checkpoint, no "
                     "adapter): its files are replaced by this run's")
    if overwrite or notes:
        run_files.clear_run(out)
    elif checkpoint is not None:
        run_files.clear_results(out)
    run_files.clear_rank_files(out, from_rank=description.world_size if peers_running else 0)
    checkpoints.remove_unfinished(out)  # saves a crash interrupted: never resumed from
    return notes


def machine_notes(description: RunDescription, machine: MachineFacts) -> list[str]:
    """What the launcher will do with `gpus` on this machine, when it is not plain: CPU workers, ids
    beyond the cores."""
    gpus = list(description.gpus)
    if description.device == "cuda":
        return []  # ids beyond the visible GPUs are a config problem (config.runtime_problems)
    notes = []
    if gpus != list(range(len(gpus))):
        notes.append(f"no CUDA: {len(gpus)} CPU worker(s) over gloo, one per entry of gpus={gpus} "
                     "(on CPU the ids only count workers)")
    if len(gpus) > machine.cpu_count:
        notes.append(f"{len(gpus)} CPU workers share {machine.cpu_count} core(s): each gets 1 thread, "
                     f"slower than {machine.cpu_count} worker(s) would be")
    return notes


def resolve_config(config_path: str | os.PathLike, *, world_size: int | None = None,
                   machine: MachineFacts | None = None, nnodes: int = 1) -> tuple[RunDescription, MachineFacts]:
    """Load CONFIG and resolve its run on `world_size` workers (default len(training.gpus) x `nnodes`)."""
    loaded = load_config(config_path)
    machine = machine or MachineFacts.detect(cuda_device_count())
    world = len(loaded.hyper.training.gpus) * nnodes if world_size is None else world_size
    return resolve_run(loaded, world_size=world, machine=machine), machine


def check_run(config_path: str | os.PathLike, *, overwrite: bool = False, nnodes: int = 1) -> CheckedRun:
    """All pre-spawn checks, every problem found listed in one error, then run.json written; raises
    ConfigError or LaunchError with a message that says what to change (and nothing is written or removed).
    `nnodes`: node 0 of a multi-node run, whose world size is len(training.gpus) x nnodes."""
    loaded = load_config(config_path)
    machine = MachineFacts.detect(cuda_device_count())
    targs = loaded.training_args
    checkpoint = targs.resume_from_checkpoint
    if checkpoint not in (None, checkpoints.LATEST):
        checkpoint = str(Path(checkpoint).resolve())
    launcher_problems = [*model_problems(loaded), _environment_problem(),
                         output_dir_problem(Path(targs.output_dir).resolve(), checkpoint, overwrite=overwrite,
                                            save_steps=targs.save_steps)]
    description = resolve_run(loaded, world_size=len(loaded.hyper.training.gpus) * nnodes, machine=machine,
                              problems=[p for p in launcher_problems if p])
    output_dir = Path(description.output_dir)
    _check_output_dir(output_dir)
    notes = prepare_output_dir(description, overwrite=overwrite)
    for note in [*notes, *machine_notes(description, machine), *description.resume_notes]:
        print(f"hypersloth-train: {note}", file=sys.stderr, flush=True)
    print(f"hypersloth-train: {description.batch_line()}", file=sys.stderr, flush=True)
    return CheckedRun(write_run(description), list(description.gpus), output_dir, description.device == "cuda")


def _environment_problem() -> str | None:
    """A HyperSloth variable the workers would refuse, found before anything starts."""
    try:
        run_files.memory_snapshot_steps(os.environ)
    except ValueError as error:
        return str(error)
    return None


def _fail(message: str, code: int = 2) -> None:
    print(f"hypersloth-train: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _run_under_torchrun(config_path: str, overwrite: bool, timeline: StartupTimeline) -> int:
    """torchrun already started this process as one rank: resolve the run (every rank the same way), let
    rank 0 prepare the output folder and write run.json, then be the worker; spawn nothing."""
    from HyperSloth.train import dist, worker

    timeline.mark("worker_imports")
    info = dist.DistInfo.from_env()
    description, _ = resolve_config(config_path, world_size=info.world_size)
    if info.is_main:
        for note in prepare_output_dir(description, overwrite=overwrite, peers_running=True):
            print(f"hypersloth-train: {note}", file=sys.stderr, flush=True)
        write_run(description)
    timeline.mark("launcher_checks")
    # Other ranks never remove shared files: each worker starts its own log afresh (logs.configure),
    # and rank 0 removes only the files of ranks this run does not have.
    worker.main(description, info, timeline)
    return 0


def _dry_run(config_path: str, nnodes: int | None = None) -> int:
    from HyperSloth.cli.plan import format_summary, preview

    if nnodes is None:
        print(format_summary(preview(config_path)))
    else:
        print(format_summary(preview(config_path, num_ranks=len(load_config(config_path).hyper.training.gpus) * nnodes)))
    return 0


def _prepare_node(config_path: str, layout: NodeLayout, overwrite: bool) -> NodeRun:
    """This node's part of a multi-node run before training: node 0 runs every launcher check and writes
    run.json; the other nodes resolve the same config (compared with node 0's run.json by the launcher)."""
    if layout.is_master:
        run = check_run(config_path, overwrite=overwrite, nnodes=layout.nnodes)
        return NodeRun(run.run_path, run.run_path.read_text(), tuple(run.gpus), run.cuda)
    description, _ = resolve_config(config_path, nnodes=layout.nnodes)
    return NodeRun(run_files.run_file(description.output_dir), description.model_dump_json(indent=2),
                   description.gpus, description.device == "cuda")


def _node_layout(nnodes, node_rank, master_addr, master_port) -> NodeLayout | None:
    """The multi-node flags as a layout; None for one machine (no flags, or --nnodes 1 alone)."""
    if nnodes is None or str(nnodes) == "1":
        given = [flag for flag, value in (("--node-rank", node_rank), ("--master-addr", master_addr),
                                          ("--master-port", master_port)) if value is not None]
        if given and nnodes is None:
            raise LaunchError(f"{', '.join(given)} belong to a multi-node run: add --nnodes N (the number of "
                              "machines), or leave them out on one machine")
        return None
    return NodeLayout.from_flags(nnodes, node_rank, master_addr, master_port)


def _tmux_replace(session: str, replace: bool) -> bool:
    """Whether launch_tmux may replace session `session`, settled before anything is written: LaunchError
    when tmux is missing, the name is refused or a taken session is not to be replaced (asked on a tty)."""
    try:
        check_tmux_session(session, replace=replace)
    except TmuxSessionExists as err:
        if not sys.stdin.isatty():
            raise
        if input(f"tmux session '{session}' already exists. Replace it? [y/N] ").strip().lower() not in ("y", "yes"):
            raise LaunchError(f"left tmux session '{session}' as it is; nothing started") from err
        return True
    return replace


def _start_tmux(run: CheckedRun, session: str, replace: bool, timeline: StartupTimeline) -> int:
    attach = launch_tmux(run.run_path, run.gpus, run.output_dir, session, replace=replace, cuda=run.cuda,
                         timeline=timeline)
    print(f"hypersloth-train: started {len(run.gpus)} rank(s) in tmux session '{session}' "
          f"(windows: main, rank0..rank{len(run.gpus) - 1}); logs in {run_files.logs_dir(run.output_dir)}")
    print(f"hypersloth-train: attach with: {attach}")
    return 0


def _start_node_tmux(config_path: str, layout: NodeLayout, overwrite: bool, session: str, replace: bool) -> int:
    """This node of a multi-node run in a tmux session: the node's own command runs in window `main`."""
    loaded = load_config(config_path)
    local = len(loaded.hyper.training.gpus)
    command = [sys.executable, "-m", "HyperSloth.cli.train", str(Path(config_path).resolve()), "--nnodes",
               str(layout.nnodes), "--node-rank", str(layout.node_rank), "--master-addr", layout.master_addr,
               "--master-port", str(layout.master_port), *(["--overwrite"] if overwrite else [])]
    logs_dir = run_files.logs_dir(Path(loaded.training_args.output_dir).resolve())
    ranks = layout.ranks_of(layout.node_rank, local)
    attach = launch_node_tmux(command, session, logs_dir, ranks, replace=replace)
    print(f"hypersloth-train: started node {layout.node_rank} in tmux session '{session}' (windows: main, "
          f"{run_files.rank_name(ranks[0])}..{run_files.rank_name(ranks[-1])}); logs in {logs_dir}")
    print(f"hypersloth-train: attach with: {attach}")
    return 0


def train(config: str, tmux: str | None = None, y: bool = False, dry_run: bool = False,
          overwrite: bool = False, nnodes: int | None = None, node_rank: int | None = None,
          master_addr: str | None = None, master_port: int | None = None) -> None:
    """Train with one worker per GPU of CONFIG's `training.gpus` (see `hypersloth-train --help`); with
    --nnodes, this machine's workers of a multi-node run (HyperSloth.launch.multinode)."""
    timeline = StartupTimeline.starting_now()  # launch = this process's start; every worker gets the stamps
    timeline.mark("launcher_start")
    config_path = str(config)
    if tmux is True or tmux == "":
        _fail("--tmux needs a session name, e.g. --tmux train")
    try:
        if is_torchrun_env(os.environ):
            raise SystemExit(_run_under_torchrun(config_path, bool(overwrite), timeline))
        if dry_run:  # the plan of --nnodes N needs no node flags
            if nnodes is not None and not (isinstance(nnodes, int) and nnodes >= 1):
                raise LaunchError(f"--nnodes {nnodes}: give the number of machines, a whole number")
            raise SystemExit(_dry_run(config_path, nnodes))
        layout = _node_layout(nnodes, node_rank, master_addr, master_port)
        if layout is not None and tmux is None:
            raise SystemExit(launch_multinode(layout, lambda: _prepare_node(config_path, layout, bool(overwrite)),
                                              timeline=timeline))
        # tmux is checked first: a refused command writes nothing (no run.json that would then refuse the retry).
        replace = _tmux_replace(str(tmux), bool(y)) if tmux is not None else False
        if layout is not None:
            raise SystemExit(_start_node_tmux(config_path, layout, bool(overwrite), str(tmux), replace))
        run = check_run(config_path, overwrite=bool(overwrite))
        timeline.mark("launcher_checks")
        if tmux is not None:
            raise SystemExit(_start_tmux(run, str(tmux), replace=replace, timeline=timeline))
        code = launch(run.run_path, run.gpus, run.output_dir, cuda=run.cuda, timeline=timeline)
    except (ConfigError, LaunchError) as err:
        _fail(str(err))
    raise SystemExit(code)


COMMAND = Command(
    prog="hypersloth-train",
    summary="""Fine-tune with one worker process per entry of `training.gpus` in CONFIG (a Python config file,
see `hypersloth-init`). Each worker sees only its GPU (CUDA_VISIBLE_DEVICES); without CUDA the same
number of CPU workers train over gloo. If any worker fails, the others are stopped and the failing
rank's last stderr lines are shown. Logs: OUTPUT_DIR/logs/rankN.log and rankN.stderr (N = rank).""",
    positionals=(Positional("config", "CONFIG", "the config file (defines hyper_config_model and "
                            "training_config_model)"),),
    flags=(
        Flag("tmux", "run each rank in its own window of tmux session SESSION (plus a `main` window that "
             "follows rank 0 and reports when all ranks are done); returns once the session exists. Attach "
             "with `tmux attach -t SESSION`.", value="SESSION"),
        Flag("y", "replace an existing tmux session of that name without asking"),
        Flag("overwrite", "the output_dir holds an earlier run: remove its files first and start clean "
             "(without it such a run is refused; set resume_from_checkpoint to continue it)"),
        Flag("dry_run", "start nothing: load the config and print the batch plan summary", label="--dry-run"),
        Flag("nnodes", "the number of machines of a multi-node run; run the same command on each, with the same "
             "CONFIG (its gpus are that machine's) and a shared output_dir (docs/multinode.md)", value="N"),
        Flag("node_rank", "this machine's node number, 0..N-1; 0 on the machine of --master-addr",
             value="R", label="--node-rank"),
        Flag("master_addr", "node 0's address, reachable from every node", value="HOST", label="--master-addr"),
        Flag("master_port", "a free TCP port on node 0 (the run's store), the same on every node", value="PORT",
             label="--master-port"),
    ),
    examples=(
        "hypersloth-train examples/tiny_cpu_demo.py                 # 2 CPU workers, about a minute",
        "hypersloth-train examples/tiny_cpu_demo.py --dry-run       # the plan only",
        "hypersloth-train my_config.py --tmux train --y             # one tmux window per GPU",
        "# two machines, the config's gpus on each (run on every node with its K = 0, 1):",
        "hypersloth-train my_config.py --nnodes 2 --node-rank K --master-addr HOST0 --master-port 29500",
        "# or under torchrun (each process one worker):",
        "torchrun --nnodes 2 --nproc_per_node N --node_rank K --master_addr HOST0 --master_port 29500 \\",
        "    -m HyperSloth.cli.train my_config.py",
    ),
    notes="""exit codes: 0 success, 1 a worker failed, 2 nothing started (a problem in the config, setup or
command line), 130/143/129 stopped by Ctrl-C / SIGTERM / SIGHUP (every worker stopped too).
Details: docs/launcher.md""",
)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `hypersloth-train` (console script via HyperSloth.cli.console) and
    `python -m HyperSloth.cli.train`: flags checked and help printed by HyperSloth.cli.command."""
    COMMAND.run(train, argv)


if __name__ == "__main__":  # torchrun and multi-node tmux windows start this module
    try:
        main()
    finally:
        gc.freeze()  # exit without the last collection walking the training stack, as cli/console.py does
