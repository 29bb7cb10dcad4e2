"""Evaluation during training: the exact held-out loss over all ranks, the best adapter, early stopping.

The eval rows are planned by the training planner (`adaptive_partition_batches`): packed or sorted-pad
as in training, with the training micro-batch budget, token-balanced, and the same number of
micro-batches on every rank. Each rank runs forward only (under `torch.no_grad`, model in eval mode),
summing the token losses of its micro-batches (the training loss with denominator 1, i.e. reduction
"sum") and counting their target tokens; then ONE all-reduce of (loss sum, token count), and

    eval_loss = total token loss / total target tokens,

the token mean that training minimises (loss_type="response_only" scores assistant tokens only). The
result is independent of the number of ranks up to float summation order, and identical on every rank,
so every rank takes the same early-stopping decision. Per-rank means averaged with unequal token
counts (the usual multi-GPU eval bug) cannot happen: nothing is averaged before the all-reduce.

HF's own loop schedules it: `eval_strategy="steps"` with `eval_steps` (or only at the end), and
transformers evaluates once more after the last step. Our `Trainer.evaluate` override calls
`evaluate_in_trainer`, which keeps the lowest eval loss in `TrainerState.best_metric` (saved in every
checkpoint, so it survives a resume). HF's `metric_for_best_model` is left unset on purpose: with it HF
would also pin a "best" checkpoint against `save_total_limit` (and with a limit of 1 delete the last
checkpoint at the end); the best adapter lives in OUTPUT_DIR/best_adapter/ instead.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from loguru import logger
from transformers import EarlyStoppingCallback, TrainerCallback

from HyperSloth.outputs import run_files
from HyperSloth.plan.batching import EpochPlan, PlanSpec, sample_token_counts
from HyperSloth.plan.eval_set import plan_eval
from HyperSloth.train.collate import LossType, collate_rows, count_trainable, to_device

FINAL_ONLY_EVAL_STEPS = 2**31 - 1  # eval_steps=None: HF's loop then evaluates after the last step only


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: mean loss over all ranks, the units it averaged (target tokens; pairs for DPO), wall
    seconds, and an evaluator's extra means over the same units (DPO: the rewards)."""

    loss: float
    tokens: int
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)


def sum_over_ranks(values: torch.Tensor, world_size: int) -> torch.Tensor:
    """Sum a tensor over all ranks (in place; the one collective of an evaluation)."""
    if world_size > 1:
        torch_dist.all_reduce(values, op=torch_dist.ReduceOp.SUM)
    return values


class Evaluator:
    """This rank's share of the eval plan, and the exact distributed token-mean loss over it.

    Subclasses evaluate other rows (`columns`, `_collate`, `count`: the DPO trainer's pairs) and may report
    `extra_keys`: sums the loss function returns after the loss, averaged over the same units.
    """

    columns: tuple[str, ...] = ("input_ids", "labels")
    count_name = "tokens"  # what the loss is averaged over, in the metric name `eval_tokens`
    extra_keys: tuple[str, ...] = ()

    def __init__(self, dataset, plan: EpochPlan, *, rank: int, loss_type: LossType, pad_token_id: int,
                 packed_lengths: bool = False, bucket: bool = False):
        self.dataset = dataset.with_format("numpy", columns=list(self.columns))
        self.plan = plan
        self.rank = rank
        self.world_size = plan.spec.num_ranks
        self.loss_type = loss_type
        self.pad_token_id = pad_token_id
        self.packed_lengths = packed_lengths
        self.bucket = bucket  # pad packed rows to a few lengths (never past the budget), as training does

    @property
    def total_targets(self) -> int:
        """Target tokens of the whole eval set (all ranks), from the plan."""
        return sum(int(step.num_trainable) for step in self.plan.steps)

    def micro_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's collated micro-batches (on the host), empty ones skipped."""
        for step in self.plan.steps:
            for indices in step.ranks[self.rank]:
                if indices:
                    yield self._collate(indices)

    def _collate(self, indices) -> dict[str, torch.Tensor]:
        return collate_rows(self.dataset, indices, self.plan.spec.mode, self.loss_type, self.pad_token_id,
                            with_lengths=self.packed_lengths, bucket=self.bucket,
                            bucket_limit=self.plan.spec.token_budget)

    def count(self, micro_batch: dict[str, torch.Tensor]) -> int:
        """Units the micro-batch's loss sums over: its target tokens (counted on the host: no device sync)."""
        return count_trainable(micro_batch["labels"])

    def local_sums(self, loss_sum: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                   device: torch.device | str) -> torch.Tensor:
        """float64 [sum of losses, units, *extra sums] over this rank's micro-batches.

        `loss_sum(micro_batch)` returns the summed loss of a host micro-batch (it moves it to the device),
        followed by the `extra_keys` sums when the evaluator has any.
        """
        totals = torch.zeros(2 + len(self.extra_keys), dtype=torch.float64, device=device)
        units = 0
        for micro_batch in self.micro_batches():
            units += self.count(micro_batch)
            sums = loss_sum(micro_batch).detach().to(torch.float64).reshape(-1)
            totals[0] += sums[0]
            totals[2:] += sums[1:]
        totals[1] = units
        return totals

    def run(self, loss_sum: Callable[[dict[str, torch.Tensor]], torch.Tensor],
            device: torch.device | str) -> EvalResult:
        """Evaluate on every rank (all must call it): one all-reduce, then total loss / total units."""
        start = time.perf_counter()
        totals = sum_over_ranks(self.local_sums(loss_sum, device), self.world_size).tolist()
        loss, units, extra = totals[0], totals[1], totals[2:]
        if int(units) != self.total_targets:  # identical on every rank: all raise together, none hangs
            raise RuntimeError(f"evaluation scored {int(units)} {self.count_name} but the eval plan holds "
                               f"{self.total_targets}: collation and planner disagree (a HyperSloth bug)")
        denominator = max(units, 1.0)
        return EvalResult(loss=loss / denominator, tokens=int(units), seconds=time.perf_counter() - start,
                          extra={key: value / denominator for key, value in zip(self.extra_keys, extra)})


def build_evaluator(eval_dataset, train_spec: PlanSpec, *, rank: int, loss_type: LossType, pad_token_id: int,
                    packed_lengths: bool = False, bucket: bool = False) -> Evaluator:
    """This rank's evaluator for the eval rows, planned with the training spec the worker resolved."""
    lengths, trainable = sample_token_counts(eval_dataset, loss_type)
    return Evaluator(eval_dataset, plan_eval(lengths, trainable, train_spec), rank=rank, loss_type=loss_type,
                     pad_token_id=pad_token_id, packed_lengths=packed_lengths, bucket=bucket)


def evaluate_in_trainer(trainer, evaluator: Evaluator, metric_key_prefix: str = "eval") -> dict[str, float]:
    """The body of `Trainer.evaluate` for plan-driven eval: forward only, log, `on_evaluate`, metrics.

    `trainer.micro_batch_loss(model, micro_batch, 1)` is the training loss with denominator 1, i.e. the
    sum of token losses, computed exactly as in training (same kernels, same autocast context).
    """
    model = trainer.model

    def loss_sum(micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        micro_batch = to_device(trainer._prepare_inputs, micro_batch)
        with trainer.compute_loss_context_manager():
            loss, sums = trainer.micro_batch_terms(model, micro_batch, 1)
        return loss.reshape(1) if sums is None else torch.cat([loss.reshape(1), sums.to(loss.dtype)])

    was_training = model.training
    model.eval()  # no dropout; gradients are off below, so no activations are kept
    try:
        with torch.no_grad():
            result = evaluator.run(loss_sum, trainer.args.device)
    finally:
        model.train(was_training)
    metrics = {f"{metric_key_prefix}_loss": result.loss, f"{metric_key_prefix}_{evaluator.count_name}": result.tokens,
               **{f"{metric_key_prefix}_{key}": value for key, value in result.extra.items()},
               f"{metric_key_prefix}_runtime": result.seconds}
    what = "target tokens" if evaluator.count_name == "tokens" else evaluator.count_name
    logger.info(f"step {trainer.state.global_step}: eval_loss {result.loss:.6f} over {result.tokens:,} {what} "
                f"({result.seconds:.2f} s)")
    trainer.log(dict(metrics))
    # Callbacks first: they compare with the best of the earlier evaluations (as HF's own order does).
    trainer.control = trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control, metrics)
    best = trainer.state.best_metric
    trainer.state.best_metric = result.loss if best is None else min(best, result.loss)
    return metrics


def eval_sft_kwargs(eval_steps: int | None) -> dict[str, Any]:
    """SFTConfig arguments that make HF's loop call `evaluate` every `eval_steps` and after the last step
    (no `metric_for_best_model`: see the module docstring)."""
    return {"eval_strategy": "steps", "eval_steps": eval_steps or FINAL_ONLY_EVAL_STEPS}


def save_adapter_atomically(model, folder: Path, record: Mapping[str, Any]) -> None:
    """`model.save_pretrained(folder)` plus `record` as best_eval.json, swapped in only when complete
    (a crash mid-save leaves the previous best adapter)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
    try:
        model.save_pretrained(str(staging))
        run_files.atomic_write_json(staging / run_files.BEST_EVAL_FILE, dict(record))
        run_files.replace_dir(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class BestAdapterCallback(TrainerCallback):
    """Keep the adapter of the lowest eval loss in OUTPUT_DIR/best_adapter/ (rank 0 only).

    Runs in `on_evaluate`, before `evaluate_in_trainer` updates `state.best_metric` with this evaluation,
    so `state.best_metric` is still the best of the earlier ones.
    """

    def __init__(self, output_dir: str | Path):
        self.folder = run_files.best_adapter_dir(output_dir)

    def on_evaluate(self, args, state, control, metrics=None, model=None, **kwargs):
        loss = (metrics or {}).get("eval_loss")
        if loss is None or model is None or (state.best_metric is not None and not loss < state.best_metric):
            return control
        record = {"step": state.global_step, "eval_loss": loss, "eval_tokens": int(metrics.get("eval_tokens", 0))}
        save_adapter_atomically(model, self.folder, record)
        logger.info(f"best eval_loss so far ({loss:.6f} at step {state.global_step}): saved {self.folder}")
        return control


class EarlyStopping(EarlyStoppingCallback):
    """HF's early stopping on eval_loss: stop after `patience` evaluations in a row without a new lowest
    value (HF's counter and comparison with `state.best_metric`). A resumed run recounts from the
    evaluations in the checkpoint's `log_history`, so it stops where the uninterrupted run would.

    HF's version reads the metric named by `metric_for_best_model` and warns without
    `load_best_model_at_end`; here the metric is always eval_loss and the best adapter is kept in
    best_adapter/ (BestAdapterCallback), so both hooks are replaced.
    """

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0):
        # HF's argument names: `restore_callback_states_from_checkpoint` rebuilds it from them.
        super().__init__(early_stopping_patience, early_stopping_threshold)
        self._recounted = False

    def on_train_begin(self, args, state, control, **kwargs):
        if args.eval_strategy == "no":
            raise ValueError("early stopping needs an eval set: set data.eval_fraction or data.eval_dataset_name")
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        loss = (metrics or {}).get("eval_loss")
        if loss is None:
            return control
        if not self._recounted:
            # A resumed run's state (log_history) is loaded after on_train_begin: recount at its first
            # evaluation, from the ones before it (the last entry of log_history is this one).
            earlier = [h["eval_loss"] for h in eval_history(state.log_history)][:-1]
            self.early_stopping_patience_counter = evaluations_without_improvement(earlier)
            self._recounted = True
        self.check_metric_value(args, state, control, loss)  # lower is better: greater_is_better is unset
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True
        return control


def eval_callbacks(output_dir: str | Path, *, is_main: bool, save_best_adapter: bool,
                   early_stopping_patience: int | None) -> list[TrainerCallback]:
    """The callbacks of a run with an eval set: best adapter (rank 0), early stopping (every rank, on the
    same all-reduced loss, so all ranks stop at the same step)."""
    callbacks: list[TrainerCallback] = []
    if save_best_adapter and is_main:
        callbacks.append(BestAdapterCallback(output_dir))
    if early_stopping_patience:
        callbacks.append(EarlyStopping(early_stopping_patience))
    return callbacks


def evaluations_without_improvement(losses: Sequence[float]) -> int:
    """How many evaluations in a row, at the end of `losses`, did not lower the lowest loss before them."""
    count, best = 0, None
    for loss in losses:
        count = 0 if best is None or loss < best else count + 1
        best = loss if best is None else min(best, loss)
    return count


def eval_history(log_history: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The run's evaluations from `TrainerState.log_history`: [{"step", "eval_loss", "eval_tokens"}], for
    DPO also "eval_pairs" and the "eval_rewards/*" means, for GRPO "eval_prompts", "eval_reward" and its parts."""
    kept = ("eval_pairs", "eval_prompts", "eval_reward", "eval_reward_std", "eval_frac_reward_zero_std")
    return [{"step": int(h["step"]), "eval_loss": float(h["eval_loss"]), "eval_tokens": int(h.get("eval_tokens", 0)),
             **{k: v for k, v in h.items() if k in kept or k.startswith(("eval_rewards/", "eval_completions/"))}}
            for h in log_history if "eval_loss" in h and "step" in h]


def best_eval(history: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The evaluation with the lowest eval_loss (the earliest on a tie), or None without evaluations."""
    if not history:
        return None
    return dict(min(history, key=lambda h: (h["eval_loss"], h["step"])))


def eval_summary(log_history: Sequence[Mapping[str, Any]], eval_set: Any | None,
                 output_dir: str | Path | None = None) -> dict[str, Any]:
    """The train_summary.json entries of evaluation: "eval" (the issue's format), its wall seconds, the
    best evaluation (with "adapter": its folder, when best_adapter/ holds it) and the resolved eval set
    (an `EvalSet`, or None without one)."""
    history = eval_history(log_history)
    best = best_eval(history)
    if best is not None and output_dir is not None:
        folder = run_files.best_adapter_dir(output_dir)
        try:
            saved = json.loads((folder / run_files.BEST_EVAL_FILE).read_text())
        except (OSError, ValueError):
            saved = {}
        if saved.get("step") == best["step"]:
            best["adapter"] = str(folder)
    return {
        "eval": history,
        "eval_seconds": [float(h["eval_runtime"]) for h in log_history if "eval_runtime" in h],
        "best_eval": best,
        "eval_set": None if eval_set is None else eval_set.to_dict(),
    }
