"""Checkpoints that survive a crash: written atomically, verified before a resume, "latest" finds a complete one.

Writing (`save_atomically`, called on every rank by HyperSlothTrainer._save_checkpoint):
  1. rank 0 empties `tmp-checkpoint-N/` (an earlier attempt at the same step may have crashed there);
  2. every rank writes its part into `tmp-checkpoint-N/checkpoint-N/` (rank 0: HF's model, optimizer,
     scheduler and trainer state, run.json, the config, its RNG state; every other rank: its RNG state);
  3. rank 0 writes manifest.json (every file with its size and sha256), renames the folder to
     `OUTPUT_DIR/checkpoint-N` and removes the checkpoints `save_total_limit` no longer keeps.
After each step the ranks agree (one all-reduce of a flag): when a rank's write failed (a full disk),
every rank raises CheckpointError and rank 0 removes the unfinished folder. A crash at any moment leaves
either a complete `checkpoint-N` (its manifest is written before the rename) or a `tmp-checkpoint-N`,
which no resume reads and the next run in the folder removes.

Reading (`verify`, `find_latest`, `resume_problem`; no torch): the launcher checks a checkpoint before any
worker starts: every file of the manifest present with its size, the files up to LARGE_FILE_BYTES hashed
whole, larger ones by SAMPLE_CHUNKS samples (full hashes of those: `verify_large_files`, run by rank 0
while the model loads), an RNG file for every rank of the checkpoint's run, and the structure of
torch/safetensors files (a truncated zip or safetensors file is refused by size even without a manifest).
Checkpoints written before manifests existed are checked for those files alone, with one warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import zipfile
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from HyperSloth.outputs import run_files

LATEST = "latest"  # resume_from_checkpoint="latest": the newest complete checkpoint of output_dir
MANIFEST_VERSION = 1
# Files above this are hashed whole only in the background of the model load (sha256 ran at ~1 GB/s on
# a 2-core CPU, 2026-12-01): a LoRA checkpoint's adapter and optimizer are hashed by the launcher, the
# GBs of a full fine-tune are not.
LARGE_FILE_BYTES = 64 * 2**20
SAMPLE_CHUNKS, SAMPLE_BYTES = 16, 2**20
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes zip archives


class CheckpointError(Exception):
    """A checkpoint that could not be written, or cannot be resumed from; the message says what to do."""


# ---------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------
def _sample_offsets(size: int) -> list[int]:
    last = max(size - SAMPLE_BYTES, 0)
    return sorted({last * i // (SAMPLE_CHUNKS - 1) for i in range(SAMPLE_CHUNKS)})


def _sampled_sha256(path: Path) -> str:
    """sha256 of SAMPLE_CHUNKS chunks spread over the file, first and last included: constant time."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for offset in _sample_offsets(path.stat().st_size):
            handle.seek(offset)
            digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _entry(path: Path) -> dict[str, Any]:
    entry: dict[str, Any] = {"size": path.stat().st_size, "sha256": run_files.file_sha256(path)}
    if entry["size"] > LARGE_FILE_BYTES:
        entry["sampled_sha256"] = _sampled_sha256(path)
    return entry


def _hash_pool() -> ThreadPoolExecutor:
    # hashlib releases the GIL on large buffers: the files of a checkpoint hash in parallel.
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))


def write_manifest(folder: str | os.PathLike, *, step: int, world_size: int) -> Path:
    """Record every file of `folder` (size, sha256) in its manifest.json; returns the manifest's path."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != run_files.MANIFEST_FILE)
    with _hash_pool() as pool:
        entries = list(pool.map(_entry, files))
    manifest = {"version": MANIFEST_VERSION, "step": step, "world_size": world_size,
                "files": {p.relative_to(folder).as_posix(): e for p, e in zip(files, entries)}}
    return run_files.atomic_write_json(run_files.manifest_file(folder), manifest)


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest, None when there is none; CheckpointError when it cannot be read."""
    path = run_files.manifest_file(folder)
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        files, world_size = manifest["files"], int(manifest["world_size"])
        if not isinstance(files, dict) or world_size < 1:
            raise ValueError("no file list")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{run_files.MANIFEST_FILE} cannot be read ({err})") from None
    return manifest


# ---------------------------------------------------------------------------------------------
# Verifying
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    """What `verify` found in one checkpoint folder."""

    path: Path
    problems: tuple[str, ...]  # empty: the checkpoint can be resumed from
    legacy: bool = False  # no manifest: written by a HyperSloth before manifests

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        """`checkpoint-N (what is wrong)`."""
        return f"{self.path.name} ({'; '.join(self.problems)})"


def structure_problem(path: Path, name: str) -> str | None:
    """What is wrong with a torch (zip) or safetensors file judged by its own structure, e.g. cut short."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            head = handle.read(8)
            if head[:4] == _ZIP_MAGIC:
                return None if zipfile.is_zipfile(path) else f"{name} is not a complete torch file (cut short?)"
            if not name.endswith(".safetensors"):
                return None
            if len(head) < 8:
                return f"{name} is not a complete safetensors file ({size} bytes)"
            header_len = struct.unpack("<Q", head)[0]
            if header_len > size - 8:
                return f"{name} is not a complete safetensors file (cut short?)"
            header = json.loads(handle.read(header_len))
    except OSError as err:
        return f"{name} cannot be read ({err.strerror})"
    except ValueError:
        return f"{name} is not a complete safetensors file (unreadable header)"
    ends = [t["data_offsets"][1] for key, t in header.items() if key != "__metadata__"]
    if 8 + header_len + max(ends, default=0) != size:
        return f"{name} is not a complete safetensors file ({size:,} bytes, its header needs {8 + header_len + max(ends, default=0):,})"
    return None


def _file_problem(folder: Path, name: str, entry: dict[str, Any]) -> str | None:
    """What is wrong with one file of the manifest (large files: hashed by samples only)."""
    path = folder / name
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != entry.get("size"):
        how = "cut short" if size < entry.get("size", 0) else "changed"
        return f"{name} is {size:,} bytes, the manifest says {entry.get('size', 0):,} ({how})"
    large = "sampled_sha256" in entry
    digest = _sampled_sha256(path) if large else run_files.file_sha256(path)
    if digest != entry.get("sampled_sha256" if large else "sha256"):
        return f"{name} does not match its sha256 in the manifest (corrupt)"
    return structure_problem(path, name)


def _rng_problems(folder: Path, world_size: int, listed: Iterable[str] | None = None) -> list[str]:
    names = [run_files.rank_rng_file(folder, rank).name for rank in range(world_size)]
    present = set(listed) if listed is not None else {n for n in names if (folder / n).is_file()}
    return [f"{name} (rank {rank}'s RNG state) is missing" for rank, name in enumerate(names) if name not in present]


def _verify_manifest(folder: Path, manifest: dict[str, Any]) -> Check:
    files: dict[str, dict[str, Any]] = manifest["files"]
    with _hash_pool() as pool:
        problems = [p for p in pool.map(lambda item: _file_problem(folder, *item), sorted(files.items())) if p]
    problems += _rng_problems(folder, int(manifest["world_size"]), files)
    return Check(folder, tuple(problems))


def _legacy_world_size(folder: Path) -> int | None:
    """Ranks whose RNG files a checkpoint without manifest must hold: its run.json's world size; None
    for a checkpoint of a HyperSloth before run.json with no rank file (HF's single rng_state.pth)."""
    try:
        return int(json.loads(run_files.run_file(folder).read_text())["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        ranks = run_files.rank_rng_files(folder)
        return max(ranks) + 1 if ranks else None


def _verify_legacy(folder: Path) -> Check:
    problems = []
    if not (folder / run_files.TRAINER_STATE_FILE).is_file():
        problems.append(f"{run_files.TRAINER_STATE_FILE} is missing")
    world_size = _legacy_world_size(folder)
    if world_size:
        problems += _rng_problems(folder, world_size)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        problems.append(structure_problem(path, path.relative_to(folder).as_posix()))
    return Check(folder, tuple(p for p in problems if p), legacy=True)


def verify(folder: str | os.PathLike) -> Check:
    """Check a checkpoint folder against its manifest (or, without one, its files' own structure)."""
    folder = Path(folder)
    if not folder.is_dir():
        return Check(folder, ("not a folder",))
    try:
        manifest = _read_manifest(folder)
    except CheckpointError as err:
        return Check(folder, (str(err),))
    return _verify_legacy(folder) if manifest is None else _verify_manifest(folder, manifest)


def verify_large_files(folder: str | os.PathLike, names: Iterable[str]) -> list[str]:
    """Hash the `names` of a verified checkpoint whole against its manifest; what does not match."""
    folder = Path(folder)
    files = (_read_manifest(folder) or {"files": {}})["files"]
    def problem(name: str) -> str | None:
        try:
            digest = run_files.file_sha256(folder / name)
        except OSError as err:
            return f"{name} cannot be read ({err.strerror})"
        return None if digest == files.get(name, {}).get("sha256") else \
            f"{name} does not match its sha256 in the manifest (corrupt)"

    with _hash_pool() as pool:
        return [p for p in pool.map(problem, list(names)) if p]


def large_files(folder: str | os.PathLike) -> list[str]:
    """The files of a checkpoint's manifest that `verify` hashed only by samples."""
    try:
        manifest = _read_manifest(Path(folder))
    except CheckpointError:
        return []
    return sorted(name for name, entry in (manifest or {"files": {}})["files"].items() if "sampled_sha256" in entry)


def verify_large_files_in_background(folder: str | os.PathLike, names: Iterable[str]) -> Future:
    """`verify_large_files` in a thread (the Future's result: the problems); the worker joins it before
    the checkpoint is loaded, so the hashing overlaps the model load."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hash")
    future = pool.submit(verify_large_files, folder, list(names))
    pool.shutdown(wait=False)
    return future


def legacy_note(check: Check) -> str:
    return (f"warning: {check.path} has no {run_files.MANIFEST_FILE} (written by an earlier HyperSloth): "
            "resuming with its files checked for presence and completeness only")


# ---------------------------------------------------------------------------------------------
# Choosing
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Latest:
    """The newest complete checkpoint of a folder, with the newer ones that are not."""

    output_dir: Path
    chosen: Check | None
    skipped: tuple[Check, ...]
    unfinished: tuple[Path, ...]  # tmp-checkpoint-N folders: saves that never finished

    def _left_out(self) -> str:
        parts = [f"skipped {c.describe()}" for c in self.skipped]
        parts += [f"ignored the unfinished save {p.name}" for p in self.unfinished]
        return f" ({'; '.join(parts)})" if parts else ""

    def notes(self) -> tuple[str, ...]:
        """The log lines of a resume from `chosen`: which one, what was left out, a legacy warning."""
        notes = [f"resuming from the newest complete checkpoint, {self.chosen.path}{self._left_out()}"]
        return tuple(notes + ([legacy_note(self.chosen)] if self.chosen.legacy else []))

    def none_message(self) -> str:
        return (f"resume_from_checkpoint={LATEST!r}: {self.output_dir} holds no complete checkpoint"
                f"{self._left_out()}: remove resume_from_checkpoint to start a new run there (with --overwrite "
                "when the folder holds an earlier run's files)")


def find_latest(output_dir: str | os.PathLike, *, exclude: Path | None = None) -> Latest:
    """The newest `checkpoint-N` of `output_dir` that passes `verify` (by step; `exclude` not considered)."""
    output_dir = Path(output_dir)
    skipped = []
    for folder in reversed(run_files.checkpoint_dirs(output_dir)):
        if exclude is not None and folder.resolve() == exclude.resolve():
            continue
        check = verify(folder)
        if check.ok:
            return Latest(output_dir, check, tuple(skipped), tuple(run_files.staging_dirs(output_dir)))
        skipped.append(check)
    return Latest(output_dir, None, tuple(skipped), tuple(run_files.staging_dirs(output_dir)))


def resume_hint(output_dir: str | os.PathLike) -> str:
    """What to run after a stopped run (one line, no hashing): continue from its newest checkpoint with a
    manifest, or, with none, the same command again (nothing of the stopped run needs --overwrite)."""
    complete = [p for p in run_files.checkpoint_dirs(output_dir) if run_files.manifest_file(p).is_file()]
    if complete:
        return (f"to continue from {complete[-1]}, set resume_from_checkpoint={LATEST!r} in the config's "
                "TrainingArgsConfig and run the same command")
    return "no checkpoint was saved yet: run the same command again to start over (no --overwrite needed)"


def resume_problem(check: Check) -> str:
    """The refusal of a broken checkpoint: what is wrong, and the newest complete one to use instead."""
    latest = find_latest(check.path.parent, exclude=check.path)
    instead = (f"resume from the newest complete checkpoint, {latest.chosen.path} "
               f"(set resume_from_checkpoint to it or to {LATEST!r})" if latest.chosen else
               f"{check.path.parent} holds no complete checkpoint: start a new run without resume_from_checkpoint")
    return f"cannot resume from {check.path}: {'; '.join(check.problems)}.\n  {instead}"


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def _newest_complete_name(output_dir: Path) -> str:
    """The newest checkpoint with a manifest, by name only (no hashing: said in an error message)."""
    complete = [p for p in run_files.checkpoint_dirs(output_dir) if run_files.manifest_file(p).is_file()]
    return str(complete[-1]) if complete else "none"


def _together(step_name: str, action: Callable[[], None] | None, agree: Callable[[bool], bool], *,
              rank: int, staging: Path, step: int) -> None:
    """Run this rank's `action` (None: nothing to do), then agree with every rank that all succeeded;
    otherwise every rank raises CheckpointError, and rank 0 first removes the unfinished folder."""
    error = None
    if action is not None:
        try:
            action()
        except Exception as err:  # torch.save reports a full disk as RuntimeError, open() as OSError
            error = err
    if agree(error is None):
        return
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # the space a full disk needs back
    where = (f"rank {rank} failed to {step_name}: {type(error).__name__}: {error}" if error is not None
             else "another rank failed to write its part (its log names the error)")
    raise CheckpointError(
        f"could not save checkpoint-{step}: {where}. The newest complete checkpoint is "
        f"{_newest_complete_name(staging.parent)}: free disk space (or fix the error) and resume with "
        f"resume_from_checkpoint={LATEST!r}") from error


def _fresh_folder(folder: Path) -> None:
    shutil.rmtree(folder.parent, ignore_errors=True)  # an earlier attempt at this step that crashed
    folder.mkdir(parents=True)


def save_atomically(output_dir: str | os.PathLike, step: int, *, rank: int, world_size: int,
                    write_part: Callable[[Path], None], agree: Callable[[bool], bool],
                    save_total_limit: int | None = None, keep: Iterable[Path] = ()) -> Path:
    """Write checkpoint-`step` of `output_dir` as one unit (see the module docstring); call on every rank.

    `write_part(folder)` writes this rank's files into the folder; `agree(ok)` is True when `ok` is True on
    every rank (an all-reduce). Returns the checkpoint's path.
    """
    output_dir = Path(output_dir).resolve()  # messages name absolute paths (HF's output_dir may be relative)
    staging = run_files.staging_dir(output_dir, step)
    folder = staging / run_files.checkpoint_dir(output_dir, step).name
    target = run_files.checkpoint_dir(output_dir, step)
    together = dict(agree=agree, rank=rank, staging=staging, step=step)

    def publish() -> None:
        write_manifest(folder, step=step, world_size=world_size)
        run_files.replace_dir(folder, target)  # an older checkpoint-N (of an earlier try) is swapped out
        shutil.rmtree(staging, ignore_errors=True)
        rotate(output_dir, save_total_limit, keep=[target, *keep])

    _together("prepare the folder", (lambda: _fresh_folder(folder)) if rank == 0 else None, **together)
    _together("write its part", lambda: write_part(folder), **together)
    _together("publish the checkpoint", publish if rank == 0 else None, **together)
    return target


def rotate(output_dir: str | os.PathLike, save_total_limit: int | None, keep: Iterable[Path] = ()) -> list[Path]:
    """Remove the oldest `checkpoint-N` folders (by step) beyond `save_total_limit`, never one of `keep`
    (the checkpoint just written, the best one). Each is renamed away before it is deleted, so a crash
    while deleting never leaves a half-deleted checkpoint-N. Returns what was removed."""
    if not save_total_limit:
        return []
    folders = run_files.checkpoint_dirs(output_dir)
    protected = {Path(p).resolve() for p in keep}
    removable = [p for p in folders if p.resolve() not in protected]
    removed = removable[:max(0, len(folders) - save_total_limit)]
    for folder in removed:
        trash = run_files.staging_dir(output_dir, run_files.checkpoint_step(folder)).with_suffix(".removing")
        shutil.rmtree(trash, ignore_errors=True)
        try:
            run_files.replace_path(folder, trash)
        except OSError:
            continue  # left for the next rotation: a checkpoint kept too many never harms a resume
        shutil.rmtree(trash, ignore_errors=True)
    return removed


def remove_unfinished(output_dir: str | os.PathLike) -> list[Path]:
    """Remove the `tmp-checkpoint-*` folders that crashed saves left; returns them."""
    found = run_files.staging_dirs(output_dir)
    for folder in found:
        shutil.rmtree(folder, ignore_errors=True)
    return found
