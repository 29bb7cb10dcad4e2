"""The per-GPU main: DistInfo -> process group -> model -> plan -> trainer -> train.

Started by the launcher as `python -m HyperSloth.train.worker OUTPUT_DIR/run.json` (one per GPU), or in-process
by `hypersloth-train` under torchrun. It reads the resolved run description (HyperSloth.plan.run), never
the config file, and knows nothing about how it was started beyond `DistInfo`.
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loguru import logger

from HyperSloth.config import ConfigError
from HyperSloth.outputs import checkpoints, logs, report, run_files
from HyperSloth.outputs.checkpoints import CheckpointError
from HyperSloth.outputs.startup import StartupTimeline, process_start_unix
from HyperSloth.plan.batching import int_column
from HyperSloth.plan.run import RunDescription, read_run
from HyperSloth.train import dist
from HyperSloth.train.attention.recompute import keep_attention
from HyperSloth.train.attention.setting import settle_attention
from HyperSloth.train.budget import settle as budget
from HyperSloth.train.budget import cache as probe_cache


def main_from_cli(run_path: str) -> None:
    """Entry point of one worker started with a run.json; exits non-zero (with the error in its log) on failure."""
    timeline = StartupTimeline.from_env(os.environ)  # the launcher's stamps
    started = process_start_unix()
    if started is not None and timeline.marks:  # spawned by the launcher: the gap is fork/exec + interpreter
        # /proc's stamp is truncated to 10 ms: never before the launcher's last stamp, taken before the spawn
        timeline.mark("worker_start", max(started, timeline.marks[-1][1]))
    timeline.mark("worker_imports")
    info = dist.DistInfo.from_env()
    try:
        description = read_run(run_path)
    except ConfigError as err:
        print(f"[rank {info.rank}] {err}", file=sys.stderr)
        sys.exit(2)
    main(description, info, timeline)


def main(description: RunDescription, info: dist.DistInfo, timeline: StartupTimeline | None = None) -> None:
    """Train `description` as rank `info.rank`. On failure: the traceback goes to this rank's log file only,
    one line naming the error to stderr (the launcher shows it), and exit 2 (a config problem) or 1.
    `timeline`: the start-up stamps so far (default: launched when this process started)."""
    try:
        run(description, info, timeline or StartupTimeline.starting_now())
    except ConfigError as err:
        print(f"[rank {info.rank}] {err}", file=sys.stderr)
        sys.exit(2)
    except CheckpointError as err:  # a save that failed (full disk) or a corrupt large file: no traceback
        logger.error(str(err))
        print(f"[rank {info.rank}] error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as err:
        log = logs.log_path(description.output_dir, info.rank)
        # Not re-raised: Python would print the traceback again on stderr (and torch once more, each line
        # prefixed "[rank0]:"), ~150 lines for one error. The log file holds it once.
        logger.bind(**{logs.FILE_ONLY: True}).opt(exception=err).error("worker failed")
        print(f"[rank {info.rank}] {describe_error(err)}\n[rank {info.rank}] traceback in {log}",
              file=sys.stderr, flush=True)
        sys.exit(1)


# torch's text under a CUDA kernel error (an illegal memory access, a device-side assert), replaced by what to do
_CUDA_BOILERPLATE = ("Search for `cuda", "CUDA kernel errors might be", "For debugging consider passing",
                     "Compile with `TORCH_USE_CUDA_DSA`", "Device-side assertions")
CUDA_ERROR_HINT = ("a CUDA kernel failed; the traceback shows where the failure was noticed, not the kernel: run "
                   "again with CUDA_LAUNCH_BLOCKING=1 to name it, or with fast_model_args.backend='transformers' to "
                   "train without Unsloth's kernels")


# raised inside code torch.compile generated (Unsloth compiles a model's layers), where torch's own advice is for the
# author of a custom op
COMPILED_ERROR_HINT = ("it failed inside code torch.compile generated (Unsloth compiles the model's layers): run again "
                       "with UNSLOTH_COMPILE_DISABLE=1 in the environment to train without Unsloth's compiled layers, "
                       "or with fast_model_args.backend='transformers'")
_COMPILED_CODE = ("/torch/_inductor/", "/torch/_dynamo/", "/torchinductor_")


def describe_error(err: BaseException) -> str:
    """"Type: message"; for a CUDA kernel error, its first line and CUDA_ERROR_HINT instead of torch's advice; for
    an error raised in torch.compile'd code (Granite 4.0-H on Unsloth, one H200, 2026-12-05: inductor's stride
    assertion and three lines on custom ops), its first line and COMPILED_ERROR_HINT."""
    text = f"{type(err).__name__}: {err}"
    lines = text.splitlines()
    if "CUDA error: " in lines[0]:
        kept = [line for line in lines if line.strip() and not line.lstrip().startswith(_CUDA_BOILERPLATE)]
        return "\n".join([*kept, CUDA_ERROR_HINT])
    frames = traceback.extract_tb(err.__traceback__)
    if "out of memory" not in lines[0] and any(  # an OOM's lines on memory stay
            part in frame.filename.replace("\\", "/") for frame in frames for part in _COMPILED_CODE):
        return "\n".join([lines[0], COMPILED_ERROR_HINT])
    return text


def run(description: RunDescription, info: dist.DistInfo, timeline: StartupTimeline) -> dict[str, Any] | None:
    """Train on this rank's share of every step, marking start-up phases on `timeline`; returns the run
    summary on rank 0."""
    if info.world_size != description.world_size:
        raise ConfigError(f"this worker is one of {info.world_size} but the run was resolved for "
                          f"{description.world_size}: start it with `hypersloth-train CONFIG`")
    out_dir = Path(description.output_dir)
    try:
        dist.isolate_process(info)
        logs.configure(info.rank, out_dir)
        logger.info(f"worker {info.rank}/{info.world_size} ({info.launched_by}) config={description.config_path}")
        if info.is_main:
            logger.info(description.batch_line())
            for note in description.resume_notes:
                logger.info(note)
        if description.backend == "unsloth":  # before transformers/trl are imported below
            with _imports_without_gc(collect=True):  # it initialises CUDA: no GPU tensor kept by a frozen cycle
                _prepare_unsloth(info.rank, varlen=description.hyper_config.fast_model_args.attention != "sdpa")
            timeline.mark("unsloth_import")
        dist.setup(info, timeout_s=description.nccl_timeout_s)
        timeline.mark("dist_init")
        return _train(description, info, out_dir, timeline)
    except BaseException as err:
        _record_failure(out_dir, info.rank, err)  # before the process group goes down
        raise
    finally:
        dist.teardown()


def _prepare_unsloth(rank: int, varlen: bool = True) -> None:
    """Import Unsloth first (it patches transformers/trl), with a compile cache of this rank's own; `varlen`:
    packed rows through torch's varlen flash kernel (off for fast_model_args.attention='sdpa')."""
    from HyperSloth.train import model as model_lib
    from HyperSloth.train.patches import unsloth_training_patches

    # One compile cache per rank: ranks compiling into one folder race (unsloth-zoo #379).
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", run_files.compile_cache_dir(rank))
    os.environ.setdefault("UNSLOTH_DISABLE_AUTO_PADDING_FREE", "1")  # HyperSloth plans the batches
    model_lib.import_backend("unsloth")
    applied = unsloth_training_patches(varlen)
    if applied["torch_varlen"]:
        logger.info("packed rows use torch's varlen flash kernel (GQA shim for torch 2.11, see patches.py)")
    if applied["hf_packed_attention"]:
        logger.info("packed rows on transformers' attention path use Unsloth's varlen kernel (see patches.py)")
    if applied["loss_rows"]:
        logger.info("the fused loss's last row chunk is rounded to 256 rows for cuBLAS (see patches.py)")


@contextmanager
def _imports_without_gc(collect: bool = False) -> Iterator[None]:
    """Import the training stack with Python's cyclic garbage collector off, then freeze what it built.

    transformers, TRL, PEFT and datasets (Unsloth too) are ~3,000 modules and a few hundred thousand long-lived
    objects. With the collector on, each full collection during the import walks them all again, and so would
    every later one: 2.3 s of a 9.3 s import on a 2-core CPU machine. `gc.freeze()` moves them to the permanent
    generation, which collections skip. The cycles the imports left as garbage are frozen too, never freed: 15,605
    objects after the CPU stack, with no measurable memory (the resident size did not move when they were
    collected). `collect`: collect them first (0.8 s there), for imports that may leave device memory in them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collect:
            gc.collect()
        gc.freeze()
        if enabled:
            gc.enable()


def _record_failure(out_dir: Path, rank: int, err: BaseException) -> None:
    """Stamp when this rank's exception was raised, before the process group goes down: the peers'
    errors that follow come later, so the launcher can name the rank that failed first."""
    record = {"rank": rank, "time": time.time(), "error": describe_error(err)}
    run_files.atomic_write_json(run_files.rank_file(out_dir, rank, "failure.json"), record)


def _train(description: RunDescription, info: dist.DistInfo, out_dir: Path, timeline: StartupTimeline
           ) -> dict[str, Any] | None:
    with _imports_without_gc():
        import transformers
        from datasets import load_from_disk

        from HyperSloth.plan.eval_set import split_for_run
        from HyperSloth.train.evaluation import eval_summary

    transformers.set_seed(description.seed)
    timeline.mark("train_imports")
    started = time.perf_counter()
    large_files_check = _check_large_files(description) if info.is_main else None
    # Loading and the micro-batch budget go together: "auto" is measured on the loaded model (every rank,
    # then the minimum), and a longest sample that fits only with checkpointing reloads the model with it.
    full_dataset = load_from_disk(description.dataset.path)  # memory-mapped: read once, split below
    lengths = int_column(full_dataset, "length")
    if description.grpo is not None:  # a prompt's longest sequence: the prompt and the longest completion
        lengths = lengths + description.grpo.max_completion_length
    timeline.mark("dataset")
    lora = description.hyper_config.lora_args
    setup = probe_cache.ProbeSetup(fast=description.hyper_config.fast_model_args.model_dump(mode="json"),
                                   lora=lora.model_dump(mode="json") if lora else None,
                                   backend=description.backend,
                                   cache=probe_cache.ProbeCache(probe_cache.cache_dir()))
    description, loaded_model, budget_decision = _settle(description, timeline, lengths, setup, info)
    timeline.mark("budget_probe")
    logger.info(f"model {description.hyper_config.fast_model_args.model_name} loaded with {loaded_model.backend} ({loaded_model.dtype})")
    # After the budget (checkpointing and tiling settled: whether the decoder is graphed), before any graph capture.
    attention = settle_attention(description, loaded_model, int(lengths.max()) if len(lengths) else 0)
    kept_attention = keep_attention(description, loaded_model, budget_decision)
    if info.is_main:
        run_files.atomic_write_json(run_files.resolved_file(out_dir), {
            "token_budget": budget_decision.as_record(),
            "gradient_checkpointing": description.gradient_checkpointing, "tiled_mlp": description.tiled_mlp,
            "attention": attention.as_record(), "lora_targets": loaded_model.lora_targets,
            "packing": loaded_model.packing})
    # A hold-out leaves the training rows; the eval rows are checked against the resolved fingerprint.
    dataset, eval_dataset = split_for_run(full_dataset, description.eval_set)
    trainer, setup = _builder(description.method)(description, loaded_model, dataset, info, eval_dataset=eval_dataset)
    timeline.mark("trainer_built")
    trainer.clock.startup = timeline  # it marks graph_capture, train_setup and first_step
    if large_files_check is not None:
        _refuse_corrupt(description.resume_from_checkpoint, large_files_check.result())
    result = trainer.train(resume_from_checkpoint=description.resume_from_checkpoint)
    # Every rank's record is written before the collective, which waits for all: rank 0's report sees them all.
    # A mismatch fails the run on every rank before anything is saved (the adapter could be any rank's).
    digests = dist.exchange("weights_sha256", _write_weight_digest(trainer.model, out_dir, info.rank, timeline))
    if len(set(digests)) > 1:
        raise RuntimeError(weights_mismatch(digests))
    if not info.is_main:
        return None
    trainer.save_model(str(out_dir))
    run_files.give_saved_model_umask_modes(out_dir)  # safetensors writes 0600: readable as the umask allows
    summary = _summary(trainer, setup, result, time.perf_counter() - started, info)
    if description.method == "dpo":  # TRL's names, one value per step (a mean over the step's global pairs)
        summary.update(method="dpo", dpo_beta=description.dpo_beta, step_rewards=trainer.step_rewards)
    if description.method == "grpo":  # TRL's names, one value per step (over the step's global batch)
        summary.update(method="grpo", reward_funcs=list(description.reward_funcs), step_metrics=trainer.step_metrics,
                       global_batch_size=description.global_batch_size, prompts_per_step=setup.samples_per_step)
    summary["token_budget"] = budget_decision.as_record()  # the budget planned with, and what it came from
    summary["cuda_graphs"] = trainer.graphs_summary()
    summary["gradient_checkpointing"] = description.gradient_checkpointing
    summary["tiled_mlp"] = description.tiled_mlp
    summary["lora_targets"] = loaded_model.lora_targets
    summary["packing"] = loaded_model.packing  # packed rows measured to keep samples apart (train/packing/check.py)
    summary["attention"] = attention.as_record()  # the kernel packed rows ran on, what was asked and why
    if kept_attention is not None:  # attention outputs kept through checkpointing (train/attention/recompute.py)
        summary["attention_reuse"] = kept_attention.summary()
    summary["startup"] = timeline.record()  # launch to the end of step 1, phase by phase (outputs/startup.py)
    summary.update(eval_summary(trainer.state.log_history, description.eval_set, out_dir))
    run_files.atomic_write_json(out_dir / run_files.SUMMARY_FILE, summary)
    run_files.atomic_write_json(out_dir / run_files.CONFIG_FILE, description.resolved_config())
    _print_summary(summary, out_dir)
    logger.info(f"{report.format_console(summary)}\nreport: {report.write_report(out_dir)}")
    return summary


def _settle(description: RunDescription, timeline: StartupTimeline, lengths, setup, info: dist.DistInfo):
    """budget.settle: the model loaded (its packed rows checked) and the micro-batch budget fixed. An SFT run whose
    config left training.batching unset, on a model whose packed rows leak (`packing.check`), trains sorted-pad
    instead (one warning; the model already loaded is kept); any other leaking run is refused."""
    from HyperSloth.train.packing.check import PackedRowsLeak

    try:
        return budget.settle(description, _loader(description, timeline), lengths, setup,
                             local_ranks=info.local_world_size)
    except PackedRowsLeak as leak:
        if description.method != "sft" or description.batching_from_config:
            raise
        what, kept = leak.what, [leak.loaded]
        kept[0].packing = {**leak.check.as_record(), "switched_to": "sorted-pad"}
        leak.loaded = None
    # Outside the except clause: its traceback (and the loader's frame holding the model) is gone, so a reload
    # below would not keep two models in memory.
    logger.warning(f"packed rows: {what}; training.batching is not set, so this run trains sorted-pad (padded rows, "
                   "one sample each: the same samples per step, with padding)")
    sorted_pad = description.with_batching("sorted-pad")
    return budget.settle(sorted_pad, _reusing(kept, _loader(sorted_pad, timeline)), lengths, setup,
                         local_ranks=info.local_world_size)


def _reusing(kept: list, load):
    """`load`, except that its first call returns the model in `kept` (the one the packed attempt loaded) when it
    asks for the same load (the run's checkpointing, no tiled MLP); any other call drops it first."""

    def reuse(checkpointing, tiled_mlp: bool = False):
        if kept and checkpointing is None and not tiled_mlp:
            return kept.pop()
        kept.clear()
        return load(checkpointing, tiled_mlp=tiled_mlp)

    return reuse


def _check_large_files(description: RunDescription):
    """The launcher hashed the checkpoint's small files; its large ones are hashed here, in a thread,
    while the model loads (a Future of the problems found), None without a resume."""
    if description.resume_from_checkpoint is None:
        return None
    names = checkpoints.large_files(description.resume_from_checkpoint)
    if not names:
        return None
    logger.info(f"hashing {len(names)} large checkpoint file(s) while the model loads")
    return checkpoints.verify_large_files_in_background(description.resume_from_checkpoint, names)


def _refuse_corrupt(checkpoint: str, problems: list[str]) -> None:
    if problems:
        raise CheckpointError(checkpoints.resume_problem(checkpoints.Check(Path(checkpoint), tuple(problems))))


def _builder(method: str):
    """The trainer factory of a training method: SFT (`sft.trainer`), DPO (`dpo.trainer`) or GRPO (`grpo.trainer`)."""
    if method == "grpo":
        from HyperSloth.train.grpo.trainer import build_grpo_trainer

        return build_grpo_trainer
    if method == "dpo":
        from HyperSloth.train.dpo.trainer import build_dpo_trainer

        return build_dpo_trainer
    from HyperSloth.train.sft.trainer import build_trainer

    return build_trainer


def _loader(description: RunDescription, timeline: StartupTimeline):
    """`load(gradient_checkpointing, tiled_mlp=False)` for budget.settle: the run's model, with the run's
    checkpointing (None) or the one given, and Unsloth's tiled MLP when `tiled_mlp` (settle decides "auto");
    each load's stamps go on `timeline` (a second load follows a first budget probe). A packed run's model is
    checked to keep the samples of a packed row apart (`packing.check`; every rank's result agreed), else a
    PackedRowsLeak carrying the loaded model (`_settle` decides)."""
    from HyperSloth.train import model as model_lib
    from HyperSloth.train.packing import check as packing_check
    loads = [0]

    def load(checkpointing, tiled_mlp: bool = False):
        if any(phase == "model_load" for phase, _ in timeline.marks):
            timeline.mark("budget_probe")  # the probe that asked for this reload
        mode = description.gradient_checkpointing if checkpointing is None else checkpointing
        fast = description.hyper_config.fast_model_args.model_copy(
            update={"use_gradient_checkpointing": mode, "tiled_mlp": bool(tiled_mlp)})
        loaded = model_lib.load_model(fast, description.hyper_config.lora_args, lora_passes=description.lora_passes,
                                      expert_lora=description.expert_lora)
        timeline.marks_from(loaded.stamps)
        if description.batching == "packed":  # before the budget probe measures packed rows on it
            check = packing_check.settle_packing(loaded.model, loaded.backend)
            loaded.packing = check.as_record()
            timeline.mark("packing_check")
            loads[0] += 1  # every rank must agree: the ranks would otherwise plan differently
            if not all(flag == "1" for flag in dist.exchange(f"packing_exact/{loads[0]}", "1" if check.exact else "0")):
                raise packing_check.PackedRowsLeak.on(loaded.model, loaded.backend, description.method, check, loaded)
        return loaded

    return load


def weights_mismatch(digests: list[str]) -> str:
    """What to say when the ranks' trained weights differ: the ranks whose digest differs from the most
    common one (rank 0's on a tie)."""
    counts = {d: digests.count(d) for d in digests}
    reference = max(dict.fromkeys(digests), key=lambda d: counts[d])  # first-seen order: rank 0's wins a tie
    differ = [rank for rank, digest in enumerate(digests) if digest != reference]
    agree = [rank for rank, digest in enumerate(digests) if digest == reference]
    return (f"rank(s) {differ} ended with trained weights that differ from rank(s) {agree} (sha256 of the "
            "trainable parameters, logs/rank*.final.json): the ranks did not stay in sync, so the adapter is not "
            "saved; this is a HyperSloth bug, please report it")


def _write_weight_digest(model, out_dir: Path, rank: int, timeline: StartupTimeline) -> str:
    """A hash of this rank's trainable weights (returned and written to its final record, with the rank's
    start-up timeline): all ranks must end with identical adapters."""
    digest = hashlib.sha256()
    count = 0
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if param.requires_grad:
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
            count += param.numel()
    record = {"rank": rank, "sha256": digest.hexdigest(), "trainable_params": count, "peak_gpu_gb": _peak_gpu_gb(),
              "startup": timeline.record()}
    run_files.atomic_write_json(run_files.rank_file(out_dir, rank, "final.json"), record)
    return record["sha256"]


def _summary(trainer, setup, result, wall_s: float, info: dist.DistInfo) -> dict[str, Any]:
    history = [h for h in trainer.state.log_history if "loss" in h and "step" in h]
    # HF's train_runtime includes the evaluations; training time and throughput leave them out.
    runtime = result.metrics.get("train_runtime", wall_s) - trainer.eval_seconds
    stats = setup.first_epoch_stats
    return {
        "world_size": info.world_size,
        "backend": setup.backend,
        "batching": setup.mode,
        "global_batch_size": setup.samples_per_step,
        "steps": trainer.state.global_step,
        # After a resume this run's losses start past step 1; every curve is numbered by global step.
        "first_step": trainer.state.global_step - len(trainer.step_losses) + 1,
        "step_losses": list(trainer.step_losses),
        "log_steps": [h["step"] for h in history],
        "grad_norms": [h.get("grad_norm") for h in history],
        "learning_rates": [h.get("learning_rate") for h in history],
        "first_loss": trainer.step_losses[0] if trainer.step_losses else None,
        "last_loss": trainer.step_losses[-1] if trainer.step_losses else None,
        "tokens_seen": trainer.tokens_seen,  # the whole run's, also after a resume
        "tokens_this_run": trainer.tokens_this_run,  # this process's: what train_runtime_s and tokens_per_s cover
        "train_runtime_s": runtime,
        "tokens_per_s": trainer.tokens_this_run / runtime if runtime else None,
        "padding_pct": stats["padding_pct"],
        "random_padding_pct": stats["random_padding_pct"],
        "imbalance": stats["imbalance"],
        "wall_s": wall_s,
        "step_seconds": trainer.clock.step_seconds(),
        "first_step_end_unix": trainer.clock.first_step_end_unix,  # start-up = this - the launch time
        "phase_seconds_per_step": trainer.timer.mean_per_step(),
        "kernel_profile": trainer.kernel_profile.summary if trainer.kernel_profile else None,
        "peak_gpu_gb": _peak_gpu_gb(),
    }


def _peak_gpu_gb() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def _print_summary(summary: dict[str, Any], out_dir: Path) -> None:
    first, last = summary["first_loss"], summary["last_loss"]
    logger.info(
        f"done: {summary['steps']} steps on {summary['world_size']} worker(s), loss {first:.4f} -> {last:.4f}, "
        f"{summary['tokens_per_s']:.0f} tokens/s, padding {summary['padding_pct']:.1f}% "
        f"(random batching {summary['random_padding_pct']:.1f}%), output in {out_dir}"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m HyperSloth.train.worker OUTPUT_DIR/run.json (started by hypersloth-train)", file=sys.stderr)
        sys.exit(2)
    try:
        main_from_cli(sys.argv[1])
    finally:
        # The interpreter's last collection at exit would walk every object left (~3 s with the training
        # stack loaded, on a 2-core CPU machine); nothing is left to collect that the exit does not free anyway.
        gc.freeze()
