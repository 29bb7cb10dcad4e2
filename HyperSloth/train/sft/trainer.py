"""The trainer: TRL's SFTTrainer, fed by the plan, with the exact single-process loss scale.

How one optimizer step runs on every rank (HF's own loop drives it; we override public hooks only):

1. `get_train_dataloader` yields one item per optimizer step: this rank's micro-batches of that step
   (from `adaptive_partition_batches`) and the step's *global* trainable-token count. HF therefore runs
   with gradient_accumulation_steps=1; the accumulation happens inside `training_step`.
2. `training_step` runs forward+backward on each micro-batch with
   loss = sum(token losses) / global trainable-token count, so the gradients of all ranks add up to the
   gradient of the whole global batch.
3. At the end of `training_step` the gradients of the trainable parameters (plus the loss) are summed
   over ranks in one flat bucket (`dist.GradientSync`) - before HF clips them, so the norm and the
   clipping see the synced gradients, as a single process would.
4. HF clips, steps the optimizer and scheduler, and logs the returned global loss: identical on every rank.

Only rank 0 saves the model, optimizer and trainer state, reports to TensorBoard/W&B and shows a
progress bar. Every rank draws dropout from its own RNG stream (seeded from (seed, rank)) and saves
that stream into each checkpoint (one file per rank, run_files.rank_rng_file), so a resumed run continues exactly; all
ranks load the same checkpoint when resuming, and the plan position follows from the global step.
A checkpoint is written by all ranks as one unit (HyperSloth.outputs.checkpoints.save_atomically): a crash
or a full disk during a save never leaves a checkpoint-N that looks complete.

The plan as HF's training data (`PlanSteps`) is in plan_loader.py; what the trainers are built with (TRL's
arguments, the shared constructor arguments, the CUDA graphs) in trainer_args.py.
"""

from __future__ import annotations

import gc
import os
import random
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from loguru import logger
from torch.utils.data import DataLoader
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState, ProgressCallback
from trl import SFTTrainer

from HyperSloth.outputs import checkpoints, run_files
from HyperSloth.plan.batching import adaptive_partition_batches, steps_per_epoch
from HyperSloth.plan.inputs import dataset_lengths, plan_spec_for
from HyperSloth.plan.run import RunDescription, write_run
from HyperSloth.train.collate import to_device
from HyperSloth.train.dist import DistInfo, GradientSync, all_ranks_ok
from HyperSloth.train.evaluation import Evaluator, build_evaluator, evaluate_in_trainer
from HyperSloth.train.model import training_autocast
from HyperSloth.train.plan_loader import PlanDataLoader, PlanSteps, StepSampler, as_tensors, host_step
from HyperSloth.train.profiling import (
    MEMORY_SNAPSHOT,
    PROFILE_TABLE,
    PROFILE_TRACE,
    KernelProfile,
    MemorySnapshot,
    PhaseTimer,
    StepClock,
)
from HyperSloth.train.step_graph import DecoderGraphs, synthetic_row
from HyperSloth.train.trainer_args import decoder_graphs, trainer_arguments

# HF's throughput figures count one process's samples and steps (each worker looks single-process to
# it): on 2 workers x 2 micro-batches they are 4x too small. The trainer logs real tokens/s instead.
_PER_PROCESS_SPEED_KEYS = ("train_samples_per_second", "train_steps_per_second", "train_tokens_per_second")


class StepHistory(TrainerCallback, ExportableState):
    """Every optimizer step's values of the whole run (the global loss; DPO adds its rewards), kept in each
    checkpoint's trainer state (HF saves an ExportableState callback's `state()` under `stateful_callbacks`),
    so that after a resume the summary, the console line and the report cover steps 1..N, not only the
    steps run since the resume.

    HF restores callback states only with `restore_callback_states_from_checkpoint`; this one reads its
    record back itself in `on_train_begin`, when HF has already loaded the checkpoint's state."""

    def __init__(self, trainer: HyperSlothTrainer):
        self._trainer = trainer
        self.earlier: dict[str, list[Any]] = {}  # per series, the values of the steps before the resume

    def state(self) -> dict[str, Any]:
        now = self._trainer.step_series_this_run()
        return {"args": {}, "attributes": {"series": {k: self.earlier.get(k, []) + v for k, v in now.items()}}}

    def on_train_begin(self, args, state, control, **kwargs):
        record = (state.stateful_callbacks or {}).get(type(self).__name__)
        series = record.get("attributes", {}).get("series", {}) if isinstance(record, dict) else {}
        # A checkpoint of an older HyperSloth has no record: then only this part's steps are known.
        self.earlier = {k: list(v[:state.global_step]) for k, v in series.items() if len(v) >= state.global_step}


class ProgressOnBarStream(ProgressCallback):
    """HF's progress bar on rank 0, its log lines (`{'loss': ...}`) written to the bar's own stream.

    HF writes them with `tqdm.write`, which goes to stdout. Rank 0's stdout reaches the terminal straight from
    the worker, while the bar (stderr) passes through the launcher's stderr pump: a loss line could arrive before
    the bar's clear and land inside the bar's line. On one stream they arrive in the order written."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        bar = self.training_bar
        if bar is None:
            return
        self.training_bar = _WritesTo(bar)
        try:
            super().on_log(args, state, control, logs=logs, **kwargs)
        finally:
            self.training_bar = bar


class _WritesTo:
    """A tqdm bar as ProgressCallback.on_log uses it (`write` only), writing to the bar's stream."""

    def __init__(self, bar):
        self.bar = bar

    def write(self, text: str) -> None:
        self.bar.write(text, file=getattr(self.bar, "fp", None))  # a disabled bar (TQDM_DISABLE) has no stream


class StepGarbageCollection(TrainerCallback):
    """Python's cyclic garbage collector at fixed steps, the same steps on every rank.

    A launch-bound step spends most of its time in Python; an automatic collection lands on a random
    rank at a random moment and the other ranks wait for it in the all-reduce. So, as torchtitan and
    Megatron-LM do: at the start of training everything built so far (model, data, libraries) is frozen
    out of the collector's reach (`gc.freeze`), automatic collection is switched off, and a collection
    of what training creates runs every `every` optimizer steps - on the same step everywhere, so no
    rank waits for another's. Reference counting still frees everything that is not a cycle at once.
    """

    def __init__(self, every: int = 50):
        self.every = every
        self._was_enabled = True

    def on_train_begin(self, args, state, control, **kwargs):
        self._was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            gc.collect()

    def on_train_end(self, args, state, control, **kwargs):
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()


class HyperSlothTrainer(SFTTrainer):
    """SFTTrainer whose steps come from the plan and whose gradients are summed over ranks."""

    profiled_steps = 3  # optimizer steps under torch.profiler with `training.profile` (from step 4)

    def __init__(self, *args, plan_steps: PlanSteps, grad_sync: GradientSync, rank: int = 0, profile: bool = False,
                 evaluator: Evaluator | None = None, description: RunDescription | None = None,
                 graphs: DecoderGraphs | None = None, graph_rows: list[int] | None = None, graphs_off: str | None = None,
                 **kwargs):
        self.rank = rank
        self.description = description  # saved into every checkpoint (rank 0)
        self._staging_root: Path | None = None  # set while rank 0's part of a checkpoint is written
        self.graphs = graphs  # CUDA graphs of the decoder over packed row lengths (None: eager)
        self.graph_rows = graph_rows or []  # the planned row lengths captured before the first step
        self.graphs_off = graphs_off  # why there are no graphs
        self.graph_capture_s = 0.0
        self.evaluator = evaluator
        self.eval_seconds = 0.0  # this run's evaluations: kept out of the training throughput
        self.plan_steps = plan_steps
        self.grad_sync = grad_sync
        self.timer = PhaseTimer(profile)
        self.clock = StepClock(self.timer)
        # With profile: torch.profiler over steps 4-6 (GRPO: 4) (after the warm-up), after the clock among the callbacks.
        self.kernel_profile = None
        if profile:
            out = kwargs["args"].output_dir
            self.kernel_profile = KernelProfile(self.timer, self.clock, run_files.rank_file(out, rank, PROFILE_TABLE),
                                                run_files.rank_file(out, rank, PROFILE_TRACE), count=self.profiled_steps)
        # With run_files.ENV_MEMORY_SNAPSHOT=N: the allocator's history over steps 1..N, for memory_viz.
        snapshot_steps = run_files.memory_snapshot_steps(os.environ)
        self.memory_snapshot = MemorySnapshot(
            run_files.rank_file(kwargs["args"].output_dir, rank, MEMORY_SNAPSHOT), snapshot_steps,
        ) if snapshot_steps else None
        self.tokens_this_run = 0  # for throughput; the cumulative count lives in the checkpointed state
        self._step_losses: list[torch.Tensor] = []
        self.step_history = StepHistory(self)
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), self.clock, StepGarbageCollection(),
                               self.step_history, *([self.kernel_profile] if self.kernel_profile else []),
                               *([self.memory_snapshot] if self.memory_snapshot else [])]
        self._flop_parameters: int | None = None  # 6 x non-embedding parameters (floating_point_ops)
        super().__init__(*args, **kwargs)
        if self.pop_callback(ProgressCallback) is not None:  # rank 0 shows progress (trainer_args: disable_tqdm)
            self.add_callback(ProgressOnBarStream)

    @property
    def tokens_seen(self) -> int:
        """Real (non-padding) tokens of all steps so far, across ranks; survives a resume."""
        return int(self.state.num_input_tokens_seen)

    @property
    def step_losses_this_run(self) -> list[float]:
        """The global loss of every optimizer step run by this process (identical on all ranks)."""
        return [float(t) for t in self._step_losses]

    @property
    def step_losses(self) -> list[float]:
        """The global loss of every optimizer step of the whole run, from step 1 also after a resume (the
        earlier ones from the checkpoint, `StepHistory`); only this process's steps after resuming from a
        checkpoint that does not hold them."""
        return self.step_history.earlier.get("losses", []) + self.step_losses_this_run

    def step_series_this_run(self) -> dict[str, list[Any]]:
        """Per-step values of this process's steps that `StepHistory` keeps for the whole run."""
        return {"losses": self.step_losses_this_run}

    def get_train_dataloader(self) -> DataLoader:
        workers = self.args.dataloader_num_workers
        return PlanDataLoader(
            self.plan_steps,
            batch_sampler=StepSampler(len(self.plan_steps)),
            collate_fn=host_step,
            num_workers=workers,
            pin_memory=torch.cuda.is_available(),
            prefetch_factor=2 if workers > 0 else None,
            persistent_workers=False,
        )

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        # On a resume HF wraps the loader in accelerate's batch skipper, a plain DataLoader with the same
        # collate function: its items are still `HostStep`s (plan_loader's transport).
        return super().get_batch_samples(map(as_tensors, epoch_iterator), num_batches, device)

    # Scalars all-reduced with the gradients once per step: the loss, then a subclass's per-step sums.
    step_sums_width = 1

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """Forward/backward every micro-batch of this rank's share, then sum gradients over ranks."""
        # HF calls model.train() every step: a walk over every module (~2,000 with LoRA on Qwen3-0.6B), ~5 ms of
        # host time with the GPU idle between steps. Only an evaluation (model.eval()) takes the model out of
        # training mode, and it leaves the top module's flag down with the rest.
        if not model.training:
            model.train()
        # A step with no trainable token (possible only with response_only on odd data) gives loss 0.
        denominator = max(int(inputs["num_items_in_batch"]), 1)
        local = torch.zeros(self.step_sums_width, dtype=torch.float32, device=self.args.device)
        self.timer.mark("data")
        for micro_batch in inputs["micro_batches"]:
            loss, sums = self.micro_batch_forward_backward(model, micro_batch, denominator)
            local[0] += loss
            if sums is not None:
                local[1:] += sums.float()
        step_sums = self.grad_sync.all_reduce(local)
        self.timer.mark("allreduce")
        self.tokens_this_run += int(inputs["real_tokens"])
        self.state.num_input_tokens_seen += int(inputs["real_tokens"])
        self.record_step(step_sums, inputs)
        return step_sums[0].to(self.args.device)

    def micro_batch_terms(self, model, micro_batch: dict[str, Any], denominator: int
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the micro-batch's loss share, its per-step sums or None): SFT has the loss only."""
        return self.micro_batch_loss(model, micro_batch, denominator), None

    def record_step(self, step_sums: torch.Tensor, inputs: dict[str, Any]) -> None:
        """Keep the step's global numbers (identical on every rank); `step_sums[0]` is the loss."""
        self._step_losses.append(step_sums[0].detach())  # kept on device: no host sync per step

    def micro_batch_forward_backward(self, model, micro_batch: dict[str, Any], denominator: int
                                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One micro-batch's forward and backward (gradients added to `param.grad`); returns its loss and its
        per-step sums (`micro_batch_terms`). With CUDA graphs the model's decoder replays its graphs inside
        this same call (step_graph.py)."""
        micro_batch = to_device(self._prepare_inputs, micro_batch)
        with self.compute_loss_context_manager():
            loss, sums = self.micro_batch_terms(model, micro_batch, denominator)
        self.timer.mark("forward")
        self.accelerator.backward(loss)
        self.timer.mark("backward")
        return loss.detach().float(), None if sums is None else sums.detach()

    def train(self, *args, **kwargs):
        self.capture_planned_graphs()
        self.clock.mark_startup("graph_capture")
        return super().train(*args, **kwargs)

    def capture_planned_graphs(self) -> None:
        """Capture the graphs of the planned row lengths before training (their cost is start-up, not a
        step's): each with a synthetic row of that length, whose gradients are then dropped."""
        if self.graphs is None or not self.graph_rows:
            return
        started = time.perf_counter()
        self.model.train()
        for rows in self.graph_rows:
            batch = synthetic_row(rows, self.graphs.layout, self.plan_steps.pad_token_id)
            if batch is not None and self.graphs.disabled is None:
                self.micro_batch_forward_backward(self.model, batch, max(rows - 1, 1))
        self.model.zero_grad(set_to_none=True)
        self.graph_capture_s = time.perf_counter() - started
        logger.info(f"CUDA graphs for {len(self.graphs.graphs)} packed row lengths captured in "
                    f"{self.graph_capture_s:.1f} s" + (f"; {self.graphs.disabled}" if self.graphs.disabled else ""))

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        """The micro-batch forward's autocast (HF's hook; its own is empty, leaving it to accelerate, which wraps
        the model's forward when `train()` prepares it). Said here too for the forwards that run before that:
        the graphs captured ahead of training record the kernels of training's forward, not a plain one's.
        Inside training it nests in accelerate's, the same dtype (no effect)."""
        return training_autocast(self.model)

    def graphs_summary(self) -> dict[str, Any]:
        """What the CUDA graphs did in this run, or why there were none (for train_summary.json)."""
        if self.graphs is None:
            return {"enabled": False, "reason": self.graphs_off}
        return {"enabled": self.graphs.disabled is None, "capture_s": round(self.graph_capture_s, 2),
                **self.graphs.summary()}

    def micro_batch_loss(self, model, micro_batch: dict[str, torch.Tensor], denominator: int) -> torch.Tensor:
        """Sum of token losses over the micro-batch's targets, divided by the step's global count.

        `num_items_in_batch` switches HF's (and Unsloth's fused) cross-entropy to reduction="sum"
        followed by this division, so no logits-sized tensor is built here.
        """
        # use_cache=False matters: with a KV cache transformers skips the packed-sequence mask.
        outputs = model(**micro_batch, num_items_in_batch=denominator, use_cache=False)
        return outputs.loss

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """HF's estimate, 6 x non-embedding parameters x tokens, for every micro-batch of the item.

        HF counts the parameters on every call by walking every module and parameter (4.8 ms per call for
        Qwen3-0.6B + LoRA, 8.8 ms for Qwen3-8B, on a 2-core CPU; once per micro-batch on the step's hot
        path). The count cannot change during training, so it is taken once (with HF's own method).
        """
        if self._flop_parameters is None:
            self._flop_parameters = super().floating_point_ops({"input_ids": torch.empty(1)})
        return sum(self._flop_parameters * mb["input_ids"].numel() for mb in inputs["micro_batches"])

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The exact held-out loss over all ranks (HyperSloth.train.evaluation); HF's loop calls it on every rank."""
        if self.evaluator is None:
            raise ValueError("this run has no eval set: set data.eval_fraction or data.eval_dataset_name")
        metrics = evaluate_in_trainer(self, self.evaluator, metric_key_prefix)
        self.eval_seconds += metrics[f"{metric_key_prefix}_runtime"]
        return metrics

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None) -> None:
        """TRL's card, which links the base model on the Hub: for a local base folder TRL passes None and the
        card read "a fine-tuned version of [None](https://huggingface.co/None)" (trl 1.15), and its quick start
        loaded `model="None"` (the Hub id of a push that never happens). Rank 0 writes it, naming the local base
        folder and loading the saved output folder instead."""
        if self.rank != 0:
            return
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        card = Path(self.args.output_dir) / "README.md"
        text = card.read_text() if card.is_file() else ""
        base = getattr(self.model.config, "_name_or_path", "") or "a local model"
        fixes = {"[None](https://huggingface.co/None)": f"the local model `{base}`",
                 'model="None"': f'model="{Path(self.args.output_dir).resolve()}"'}
        if any(broken in text for broken in fixes):
            for broken, named in fixes.items():
                text = text.replace(broken, named)
            card.write_text(text)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs["tokens_seen"] = self.tokens_seen
        if "train_loss" in logs and self.step_losses:
            # HF divides this process's summed losses by every step of the run: after a resume that mean
            # was below every logged loss. The mean step loss of the whole run instead.
            logs["train_loss"] = sum(self.step_losses) / len(self.step_losses)
        if "train_runtime" in logs:
            for key in _PER_PROCESS_SPEED_KEYS:
                logs.pop(key, None)
            training_s = logs["train_runtime"] - self.eval_seconds  # HF's runtime includes the evaluations
            if training_s > 0:
                logs["train_tokens_per_second_all_ranks"] = round(self.tokens_this_run / training_s, 1)
        super().log(logs, start_time)

    # ---- checkpoints: written atomically by all ranks (HyperSloth.outputs.checkpoints) ----------------
    # Checked against Trainer._save_checkpoint / _get_output_dir / _save_rng_state / _load_rng_state of
    # transformers 5.17. HF writes `{_get_output_dir()}/checkpoint-N` in place, from process 0 only (and
    # every HyperSloth worker is "process 0" to it); here every rank writes its part into a staging folder
    # that rank 0 publishes as checkpoint-N once all parts are there.
    def _save_checkpoint(self, model, trial) -> None:
        output_dir = self._get_output_dir(trial=trial)
        best = self.state.best_model_checkpoint
        checkpoints.save_atomically(
            output_dir, self.state.global_step, rank=self.rank, world_size=self.grad_sync.world_size,
            write_part=partial(self._write_checkpoint_part, model, trial), agree=all_ranks_ok,
            save_total_limit=self.args.save_total_limit, keep=[Path(best)] if best else [])

    def _get_output_dir(self, trial) -> str:
        """HF's run folder, except while rank 0 writes its part: the staging folder, so that HF's
        `_save_checkpoint` writes `tmp-checkpoint-N/checkpoint-N` (and rotates nothing outside it)."""
        if self._staging_root is not None:
            return str(self._staging_root)
        return super()._get_output_dir(trial)

    def _write_checkpoint_part(self, model, trial, folder: Path) -> None:
        """This rank's files of a checkpoint: rank 0 HF's (model, optimizer, scheduler, trainer state, its
        RNG state) plus the run description and config; every other rank its RNG state."""
        if self.rank != 0:
            self._save_rng_state(str(folder))
            return
        self._staging_root = folder.parent
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_root = None
        final = str(run_files.checkpoint_dir(self.args.output_dir, self.state.global_step))
        if self.state.best_model_checkpoint == str(folder):  # HF named the staging path: the final one
            self.state.best_model_checkpoint = final
            self.state.save_to_json(str(folder / run_files.TRAINER_STATE_FILE))
        if self.description is not None:  # a resume compares its own run with this (plan.run.check_resume)
            write_run(self.description, run_files.run_file(folder))
            run_files.atomic_write_json(folder / run_files.CONFIG_FILE, self.description.resolved_config())

    def _save_rng_state(self, output_dir: str) -> None:
        states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
        if torch.cuda.is_available():
            states["cuda"] = torch.cuda.random.get_rng_state()
        path = run_files.rank_rng_file(output_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(states, path)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        path = run_files.rank_rng_file(checkpoint, self.rank) if checkpoint else None
        if path is None or not path.is_file():
            super()._load_rng_state(checkpoint)  # a checkpoint of an older HyperSloth: HF's single file
            return
        from transformers.trainer_pt_utils import safe_globals

        with safe_globals():
            states = torch.load(path, weights_only=True)
        random.setstate(states["python"])
        np.random.set_state(states["numpy"])
        torch.random.set_rng_state(states["cpu"])
        if torch.cuda.is_available() and "cuda" in states:
            torch.cuda.random.set_rng_state(states["cuda"])


@dataclass
class RunSetup:
    """What the worker reports about the run it set up."""

    backend: str
    mode: str
    samples_per_step: int
    steps_per_epoch: int
    first_epoch_stats: dict[str, float]


def build_trainer(description: RunDescription, loaded_model, dataset, info: DistInfo, eval_dataset=None
                  ) -> tuple[HyperSlothTrainer, RunSetup]:
    """Wire plan, data, gradient sync and TRL arguments into a HyperSlothTrainer for this rank; with
    `eval_dataset` (the rows of `description.eval_set`) also the evaluator, best adapter and early stopping."""
    lengths, trainable = dataset_lengths(dataset, description.loss_type, description.max_seq_length)
    spec = plan_spec_for(description)
    per_epoch = steps_per_epoch(len(lengths), spec.samples_per_step)
    steps = PlanSteps(
        dataset,
        partial(adaptive_partition_batches, lengths, trainable, spec),
        per_epoch,
        rank=info.rank,
        mode=spec.mode,
        loss_type=description.loss_type,
        pad_token_id=loaded_model.tokenizer.pad_token_id,
        packed_lengths=loaded_model.backend == "unsloth",
    )
    evaluator = None
    if eval_dataset is not None:  # planned with the training spec as resolved here (budget included)
        evaluator = build_evaluator(eval_dataset, spec, rank=info.rank, loss_type=description.loss_type,
                                    pad_token_id=loaded_model.tokenizer.pad_token_id,
                                    packed_lengths=loaded_model.backend == "unsloth",
                                    bucket=loaded_model.backend == "unsloth")
    trainer = HyperSlothTrainer(
        **trainer_arguments(description, loaded_model, dataset, info, steps, evaluator, eval_dataset),
        **decoder_graphs(description, loaded_model, steps, lengths, info.rank),
    )
    return trainer, run_setup(loaded_model.backend, spec, per_epoch, steps.plan(0).stats)


def run_setup(backend: str, spec, per_epoch: int, stats) -> RunSetup:
    """What the worker reports about a run planned with `spec` (epoch 0's `PlanStats`)."""
    return RunSetup(
        backend=backend,
        mode=spec.mode,
        samples_per_step=spec.samples_per_step,
        steps_per_epoch=per_epoch,
        first_epoch_stats={
            "padding_pct": 100.0 * stats.padding_fraction,
            "random_padding_pct": 100.0 * stats.random_padding_fraction,
            "imbalance": stats.imbalance,
        },
    )
