"""Every file name of a run directory, every `HYPERSLOTH_*` variable, and the one atomic write.

A run directory (`training_config_model.output_dir`) holds:

    run.json                        the resolved run description (HyperSloth.plan.run); workers read it
    run_resolved.json               what the workers settled at start: the token budget ("auto" measured,
                                    min over ranks, with its inputs) and gradient checkpointing (rank 0)
    hypersloth_config.json          the resolved config (export reads the base model name from it)
    train_summary.json              numbers of the finished run (rank 0)
    report.md, report.png           the run report (HyperSloth.outputs.report)
    adapter_*.safetensors, ...      the trained adapter / model, saved by rank 0 at the end
    best_adapter/                   with an eval set: the adapter of the lowest eval loss (a PEFT folder)
                                    and best_eval.json ({"step", "eval_loss", "eval_tokens"}); rank 0
    checkpoint-N/                   complete checkpoints (HyperSloth.outputs.checkpoints): HF's files plus run.json,
                                    hypersloth_config.json, rng_state_rank{r}.pth (one RNG state per
                                    rank) and manifest.json (every file's size and sha256), written last
    tmp-checkpoint-N/checkpoint-N/  a checkpoint being written; renamed to checkpoint-N once every rank
                                    wrote its part. One left by a crash is never resumed from, and is
                                    removed by the next run in the folder
    logs/rank{r}.log                the worker's own log
    logs/rank{r}.stderr/.stdout     what the launcher captured of rank r
    logs/rank{r}.failure.json       when rank r's exception was raised (names the first failure)
    logs/rank{r}.final.json         hash of rank r's trained weights (all ranks must agree)
    logs/rank{r}.pid/.exitcode      tmux mode only (and logs/rendezvous.port)

Nothing else in HyperSloth spells these names, the environment variable names or `os.replace`
(tests/unit/test_run_files.py checks that).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RUN_FILE = "run.json"
CONFIG_FILE = "hypersloth_config.json"
SUMMARY_FILE = "train_summary.json"
REPORT_MD = "report.md"
REPORT_PNG = "report.png"
LOGS_DIR = "logs"
CHECKPOINT_PREFIX = "checkpoint-"
RANK_RNG_FILE = "rng_state_rank{rank}.pth"
MANIFEST_FILE = "manifest.json"  # inside checkpoint-N: what a complete checkpoint holds (HyperSloth.outputs.checkpoints)
STAGING_PREFIX = "tmp-checkpoint-"  # a checkpoint being written: tmp-checkpoint-N/checkpoint-N
TRAINER_STATE_FILE = "trainer_state.json"  # HF's, inside checkpoint-N: a resume cannot start without it
RESOLVED_FILE = "run_resolved.json"  # what the workers settled at start (measured token budget, checkpointing)
RENDEZVOUS_PORT_FILE = "rendezvous.port"  # tmux mode: in logs/, the port the monitor's store holds
BEST_ADAPTER_DIR = "best_adapter"  # HyperSloth.train.evaluation keeps the lowest eval loss's adapter here
BEST_EVAL_FILE = "best_eval.json"  # inside best_adapter/: {"step", "eval_loss", "eval_tokens"}

# What rank 0's final save writes next to the summary (PEFT adapter or full model, tokenizer, card).
_MODEL_FILES = (
    "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "config.json",
    "generation_config.json", "model.safetensors", "model.safetensors.index.json", "training_args.bin",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
)  # fmt: skip
_MODEL_GLOBS = ("model-*-of-*.safetensors",)
# The results of a finished run: removed when a new run (or a resume) starts in the folder, so a run
# that fails never leaves an earlier run's report or adapter looking like its own.
RESULT_FILES = (SUMMARY_FILE, REPORT_MD, REPORT_PNG, CONFIG_FILE, RESOLVED_FILE, *_MODEL_FILES)
TENSORBOARD_DIR = "runs"

# Environment of a worker started by the HyperSloth launcher (read by dist.DistInfo.from_env).
ENV_PREFIX = "HYPERSLOTH_"
ENV_RANK = "HYPERSLOTH_RANK"
ENV_LOCAL_RANK = "HYPERSLOTH_LOCAL_RANK"
ENV_WORLD_SIZE = "HYPERSLOTH_WORLD_SIZE"
ENV_MASTER_ADDR = "HYPERSLOTH_MASTER_ADDR"
ENV_MASTER_PORT = "HYPERSLOTH_MASTER_PORT"
# The launcher's start-up stamps, handed to every worker (HyperSloth.outputs.startup).
ENV_LAUNCH_STAMPS = "HYPERSLOTH_LAUNCH_STAMPS"
# Where the budget probe caches its measurements (HyperSloth.train.budget.cache); "off" turns the cache off.
ENV_CACHE_DIR = "HYPERSLOTH_CACHE_DIR"
ENV_PAD_LOSS_ROWS = "HYPERSLOTH_PAD_LOSS_ROWS"  # "0": leave Unsloth's fused loss unpatched (train/patches.py)
# "0": recompute attention's forward under checkpointing instead of keeping its outputs (train/attention/recompute.py)
ENV_REUSE_ATTENTION = "HYPERSLOTH_REUSE_ATTENTION"
# N: record the CUDA allocator's history over optimizer steps 1..N, into logs/rank{r}.memory_snapshot.pickle
# (train/profiling.MemorySnapshot).
ENV_MEMORY_SNAPSHOT = "HYPERSLOTH_MEMORY_SNAPSHOT"
# Seconds after which a silent node of a multi-node run counts as lost (HyperSloth.launch.node_watch).
ENV_NODE_TIMEOUT = "HYPERSLOTH_NODE_TIMEOUT_S"

# Variables torchrun / torch.distributed set. HF/accelerate switch to their own DDP mode when they see
# them, so they never reach a launcher-started worker, and a torchrun-started worker removes them
# after reading (HyperSloth owns the process group and syncs gradients itself).
TORCHRUN_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
)  # fmt: skip


def resolved_file(output_dir: str | os.PathLike) -> Path:
    """`{output_dir}/run_resolved.json`."""
    return Path(output_dir) / RESOLVED_FILE


def logs_dir(output_dir: str | os.PathLike) -> Path:
    """`{output_dir}/logs`."""
    return Path(output_dir) / LOGS_DIR


def rank_name(rank: int) -> str:
    """`rank{rank}`: the stem of a rank's files and the name of its tmux window."""
    return f"rank{rank}"


def rank_file_in(logs: str | os.PathLike, rank: int, kind: str) -> Path:
    """`{logs}/rank{rank}.{kind}`, kind one of log, stderr, stdout, failure.json, final.json, pid, exitcode,
    with `training.profile` profile_kernels.txt, profile_trace.json.gz, and with ENV_MEMORY_SNAPSHOT
    memory_snapshot.pickle."""
    return Path(logs) / f"{rank_name(rank)}.{kind}"


def rank_file(output_dir: str | os.PathLike, rank: int, kind: str) -> Path:
    """`{output_dir}/logs/rank{rank}.{kind}` (see `rank_file_in`)."""
    return rank_file_in(logs_dir(output_dir), rank, kind)


def rank_files_in(logs: str | os.PathLike, kind: str) -> list[Path]:
    """Every `{logs}/rank*.{kind}` present, in no particular order."""
    return list(Path(logs).glob(f"rank*.{kind}"))


def rank_files(output_dir: str | os.PathLike, kind: str) -> list[Path]:
    """Every `{output_dir}/logs/rank*.{kind}` present, in no particular order."""
    return rank_files_in(logs_dir(output_dir), kind)


def run_file(output_dir: str | os.PathLike) -> Path:
    """`{output_dir}/run.json`."""
    return Path(output_dir) / RUN_FILE


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """`{output_dir}/checkpoint-{step}` (the name HF's Trainer gives it)."""
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}{step}"


def rank_rng_file(checkpoint: str | os.PathLike, rank: int) -> Path:
    """The RNG state of `rank` inside a checkpoint folder."""
    return Path(checkpoint) / RANK_RNG_FILE.format(rank=rank)


def rank_rng_files(checkpoint: str | os.PathLike) -> dict[int, Path]:
    """Every rank's RNG state present in a checkpoint folder, by rank."""
    head, tail = RANK_RNG_FILE.split("{rank}")
    found = {}
    for path in Path(checkpoint).glob(f"{head}*{tail}"):
        number = path.name[len(head):len(path.name) - len(tail)]
        if number.isdigit():
            found[int(number)] = path
    return found


def manifest_file(checkpoint: str | os.PathLike) -> Path:
    """`{checkpoint}/manifest.json`."""
    return Path(checkpoint) / MANIFEST_FILE


def staging_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """`{output_dir}/tmp-checkpoint-{step}`: HF writes the checkpoint of `step` into its `checkpoint-{step}`
    (HyperSloth.outputs.checkpoints). Not a `checkpoint-*` name, so HF's own checkpoint search never sees it."""
    return Path(output_dir) / f"{STAGING_PREFIX}{step}"


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """N of a folder named `checkpoint-N`, else None."""
    name = Path(path).name
    number = name[len(CHECKPOINT_PREFIX):]
    return int(number) if name.startswith(CHECKPOINT_PREFIX) and number.isdigit() else None


def checkpoint_dirs(output_dir: str | os.PathLike) -> list[Path]:
    """Every `checkpoint-N` folder of `output_dir`, oldest step first (complete or not)."""
    out = Path(output_dir)
    found = [p for p in out.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def staging_dirs(output_dir: str | os.PathLike) -> list[Path]:
    """Every `tmp-checkpoint-*` folder of `output_dir`: saves that never finished."""
    return sorted(p for p in Path(output_dir).glob(f"{STAGING_PREFIX}*") if p.is_dir())


def compile_cache_dir(rank: int) -> str:
    """Unsloth's compile cache of one rank (ranks compiling into one folder race: unsloth-zoo #379)."""
    return f"unsloth_compiled_cache_rank{rank}"


def best_adapter_dir(output_dir: str | os.PathLike) -> Path:
    """`{output_dir}/best_adapter`."""
    return Path(output_dir) / BEST_ADAPTER_DIR


def holds_a_run(output_dir: str | os.PathLike, *, count_logs: bool = True) -> bool:
    """True when `output_dir` holds files of an earlier run (its description, results, checkpoints or,
    with `count_logs`, rank files). Under torchrun the other ranks may already be writing this run's
    logs when rank 0 looks, so it passes count_logs=False."""
    out = Path(output_dir)
    if not out.is_dir():
        return False
    markers = [run_file(out), out / SUMMARY_FILE, out / CONFIG_FILE, out / REPORT_MD]
    return (any(p.exists() for p in markers) or (count_logs and any(logs_dir(out).glob("rank*")))
            or any(out.glob(f"{CHECKPOINT_PREFIX}*")) or bool(staging_dirs(out)))


def holds_nothing_to_keep(output_dir: str | os.PathLike) -> bool:
    """True when `output_dir` holds no checkpoint (complete or unfinished), no adapter or model, no best adapter
    and no summary: what a run stopped before its first save leaves (Ctrl-C in its first seconds, a failed
    start). A new run may replace it without --overwrite: nothing in it can be resumed or used."""
    out = Path(output_dir)
    kept = [out / SUMMARY_FILE, best_adapter_dir(out), *(out / name for name in _MODEL_FILES)]
    return not (any(p.exists() for p in kept) or any(any(out.glob(g)) for g in _MODEL_GLOBS)
                or any(out.glob(f"{CHECKPOINT_PREFIX}*")) or staging_dirs(out))


def _is_model_card(path: Path) -> bool:
    # PEFT writes a README.md model card; a user's own README.md in the folder is left alone.
    try:
        return "library_name: peft" in path.read_text(errors="replace")[:2000]
    except OSError:
        return False


def clear_results(output_dir: str | os.PathLike) -> list[Path]:
    """Remove a finished run's results (summary, report, resolved config, saved model); keep checkpoints.
    Returns what was removed."""
    out = Path(output_dir)
    found = [out / name for name in RESULT_FILES] + [p for g in _MODEL_GLOBS for p in out.glob(g)]
    if _is_model_card(out / "README.md"):
        found.append(out / "README.md")
    removed = [p for p in found if p.is_file()]
    for path in removed:
        path.unlink()
    return removed


def clear_run(output_dir: str | os.PathLike) -> list[Path]:
    """Remove every file an earlier run wrote into `output_dir` (`--overwrite`) except its rank files
    (`clear_rank_files`, which a torchrun rank 0 must not do for its peers); other files stay."""
    out = Path(output_dir)
    removed = clear_results(out)
    folders = [out / TENSORBOARD_DIR, *out.glob(f"{CHECKPOINT_PREFIX}*"), *staging_dirs(out), best_adapter_dir(out)]
    for folder in folders:
        if folder.is_dir():
            shutil.rmtree(folder)
            removed.append(folder)
    if run_file(out).is_file():
        run_file(out).unlink()
        removed.append(run_file(out))
    return removed


def clear_rank_files(output_dir: str | os.PathLike, from_rank: int = 0) -> None:
    """Remove the `logs/rank{r}.*` files of every rank r >= from_rank, so the logs of a new run never mix
    with an earlier run's (e.g. rank2..rank15 of an earlier 16-worker run)."""
    for path in logs_dir(output_dir).glob("rank*.*"):
        number = path.name[len("rank"):].split(".", 1)[0]
        if path.is_file() and number.isdigit() and int(number) >= from_rank:
            path.unlink()


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes (hex), read in 1 MiB blocks (checkpoint manifests, export, the tiny model)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def umask() -> int:
    """The process's umask (read from /proc on Linux; elsewhere set and put back at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def give_umask_modes(path: str | os.PathLike) -> None:
    """Give `path`, and everything under it when it is a folder, the mode a plain open() or mkdir() has under
    the umask: files 0o666 & ~umask (0o777 & ~umask when executable), folders 0o777 & ~umask. tempfile's
    mkstemp / mkdtemp make 0600 / 0700 whatever the umask, and safetensors (0.8) writes 0600, which left
    every output owner-only (an inference server running as another user could not read an export).
    Paths this user cannot change (another user's) are left as they are."""
    mask, root = umask(), Path(path)
    for item in [root, *(root.rglob("*") if root.is_dir() and not root.is_symlink() else ())]:
        try:
            if item.is_symlink():
                continue
            executable = item.is_dir() or item.stat().st_mode & 0o111
            os.chmod(item, (0o777 if executable else 0o666) & ~mask)
        except OSError:
            continue


def give_saved_model_umask_modes(output_dir: str | os.PathLike) -> None:
    """`give_umask_modes` for the adapter / model files rank 0's final save wrote into `output_dir`."""
    out = Path(output_dir)
    for path in [*(out / name for name in _MODEL_FILES), *(p for g in _MODEL_GLOBS for p in out.glob(g))]:
        if path.is_file():
            give_umask_modes(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` so that a reader sees the old file or the whole new one, never half:
    a temp file in the same folder, fsync, then os.replace. Creates the folder. The file gets the umask's
    mode, as open() would give it (mkstemp's is 0600)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def atomic_write_json(path: str | os.PathLike, content: Any) -> Path:
    """`atomic_write_text` of `content` as indented JSON (non-JSON values written with str())."""
    return atomic_write_text(path, json.dumps(content, indent=2, default=str) + "\n")


def replace_path(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename `source` to `target` in one step (os.replace); the one spelling of os.replace besides
    `atomic_write_text` and `replace_dir`."""
    os.replace(source, target)


def replace_dir(staging: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Put the finished folder `staging` at `dest`: an old `dest` (folder or file) is renamed aside
    first and deleted only after the swap, so a failure leaves the old one in place. `staging` and what it
    holds get the umask's modes first (`give_umask_modes`: mkdtemp made it 0700)."""
    staging, dest = Path(staging), Path(dest)
    give_umask_modes(staging)
    if dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()
    if not dest.exists():
        os.replace(staging, dest)
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    os.replace(dest, trash / dest.name)
    try:
        os.replace(staging, dest)
    except BaseException:
        os.replace(trash / dest.name, dest)
        raise
    finally:
        shutil.rmtree(trash, ignore_errors=True)


def memory_snapshot_steps(env: Mapping[str, str]) -> int:
    """The optimizer steps `ENV_MEMORY_SNAPSHOT` asks to record (0 when unset); ValueError, saying
    what to write, for anything but a whole number >= 0."""
    value = env.get(ENV_MEMORY_SNAPSHOT, "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ValueError(f"{ENV_MEMORY_SNAPSHOT}={value!r}: give the number of optimizer steps to record from step "
                         f"1 (e.g. {ENV_MEMORY_SNAPSHOT}=3), or unset it")
    return int(value)
