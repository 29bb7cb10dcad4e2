"""The per-GPU main: DistInfo -> process group -> model -> plan -> trainer -> train.

Started by the launcher as `python -m HyperSloth.worker CONFIG` (one per GPU), or in-process by
`hypersloth-train` under torchrun. Knows nothing about how it was started beyond `DistInfo`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from loguru import logger

from HyperSloth import dist, logs, report
from HyperSloth.config import ConfigError, LoadedConfig, config_to_dict, load_config

SUMMARY_FILE = "train_summary.json"


def main_from_cli(config_path: str) -> None:
    """Entry point of one worker; exits non-zero (with the error in its log) on failure."""
    info = dist.DistInfo.from_env()
    try:
        run(config_path, info)
    except ConfigError as err:
        print(f"[rank {info.rank}] {err}", file=sys.stderr)
        sys.exit(2)
    except Exception:
        logger.exception("worker failed")
        raise


def run(config_path: str, info: dist.DistInfo) -> dict[str, Any] | None:
    """Train on this rank's share of every step; returns the run summary on rank 0."""
    loaded = load_config(config_path)
    dist.isolate_process(info)
    out_dir = Path(loaded.training_args.output_dir)
    logs.configure(info.rank, out_dir)
    logger.info(f"worker {info.rank}/{info.world_size} ({info.launched_by}) config={config_path}")

    from HyperSloth import model as model_lib

    if model_lib.resolve_backend(loaded.hyper.fast_model_args) == "unsloth":
        _prepare_unsloth(info.rank)  # before transformers/trl are imported below
    dist.setup(info, timeout_s=loaded.hyper.training.nccl_timeout_s)
    try:
        return _train(loaded, info, out_dir)
    except BaseException as err:
        _record_failure(out_dir, info.rank, err)
        raise
    finally:
        dist.teardown()


def _prepare_unsloth(rank: int) -> None:
    """Import Unsloth first (it patches transformers/trl), with a compile cache of this rank's own."""
    from HyperSloth import model as model_lib
    from HyperSloth.patches import enable_unsloth_torch_varlen

    # One compile cache per rank: ranks compiling into one folder race (unsloth-zoo #379).
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", f"unsloth_compiled_cache_rank{rank}")
    os.environ.setdefault("UNSLOTH_DISABLE_AUTO_PADDING_FREE", "1")  # HyperSloth plans the batches
    model_lib.import_backend("unsloth")
    if enable_unsloth_torch_varlen():
        logger.info("packed rows use torch's varlen flash kernel (GQA shim for torch 2.11, see patches.py)")


def _record_failure(out_dir: Path, rank: int, err: BaseException) -> None:
    """Stamp when this rank's exception was raised, before the process group goes down: the peers'
    errors that follow come later, so the launcher can name the rank that failed first."""
    path = logs.log_path(out_dir, rank).with_suffix(".failure.json")
    path.write_text(json.dumps({"rank": rank, "time": time.time(), "error": f"{type(err).__name__}: {err}"}))


def _train(loaded: LoadedConfig, info: dist.DistInfo, out_dir: Path) -> dict[str, Any] | None:
    import transformers
    from datasets import load_from_disk

    from HyperSloth import model as model_lib
    from HyperSloth.trainer import CONFIG_FILE, build_trainer

    hyper, targs = loaded.hyper, loaded.training_args
    transformers.set_seed(targs.seed)
    started = time.perf_counter()
    loaded_model = model_lib.load_model(hyper.fast_model_args, hyper.lora_args)
    logger.info(f"model {hyper.fast_model_args.model_name} loaded with {loaded_model.backend} ({loaded_model.dtype})")
    dataset = load_from_disk(str(hyper.data.dataset_path()))
    trainer, setup = build_trainer(loaded, loaded_model, dataset, info)
    resume = targs.resume_from_checkpoint
    result = trainer.train(resume_from_checkpoint=resume if resume not in (None, "") else None)
    _write_weight_digest(trainer.model, out_dir, info.rank)
    if not info.is_main:
        return None
    trainer.save_model(str(out_dir))
    summary = _summary(trainer, setup, result, time.perf_counter() - started, info)
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    (out_dir / CONFIG_FILE).write_text(json.dumps(config_to_dict(loaded), indent=2, default=str))
    _print_summary(summary, out_dir)
    logger.info(f"{report.format_console(summary)}\nreport: {report.write_report(out_dir)}")
    return summary


def _write_weight_digest(model, out_dir: Path, rank: int) -> None:
    """A hash of this rank's trainable weights: all ranks must end with identical adapters."""
    digest = hashlib.sha256()
    count = 0
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if param.requires_grad:
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
            count += param.numel()
    path = logs.log_path(out_dir, rank).with_suffix(".final.json")
    record = {"rank": rank, "sha256": digest.hexdigest(), "trainable_params": count, "peak_gpu_gb": _peak_gpu_gb()}
    path.write_text(json.dumps(record))


def _summary(trainer, setup, result, wall_s: float, info: dist.DistInfo) -> dict[str, Any]:
    history = [h for h in trainer.state.log_history if "loss" in h and "step" in h]
    runtime = result.metrics.get("train_runtime", wall_s)
    stats = setup.first_epoch_stats
    return {
        "world_size": info.world_size,
        "backend": setup.backend,
        "batching": setup.mode,
        "global_batch_size": setup.samples_per_step,
        "steps": trainer.state.global_step,
        "step_losses": list(trainer.step_losses),
        "grad_norms": [h.get("grad_norm") for h in history],
        "learning_rates": [h.get("learning_rate") for h in history],
        "first_loss": trainer.step_losses[0] if trainer.step_losses else None,
        "last_loss": trainer.step_losses[-1] if trainer.step_losses else None,
        "tokens_seen": trainer.tokens_seen,
        "train_runtime_s": runtime,
        "tokens_per_s": trainer.tokens_this_run / runtime if runtime else None,
        "padding_pct": stats["padding_pct"],
        "random_padding_pct": stats["random_padding_pct"],
        "imbalance": stats["imbalance"],
        "wall_s": wall_s,
        "step_seconds": trainer.clock.step_seconds(),
        "phase_seconds_per_step": trainer.timer.mean_per_step(),
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
        print("usage: python -m HyperSloth.worker CONFIG.py (normally started by hypersloth-train)", file=sys.stderr)
        sys.exit(2)
    main_from_cli(sys.argv[1])
