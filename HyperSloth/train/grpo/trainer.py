"""The GRPO trainer: the SFT trainer's plan-driven steps, gradient sync and clipping, with rollouts and GRPO's loss.

`HyperSlothGRPOTrainer` subclasses `HyperSlothTrainer` (as the DPO trainer does) and replaces only what differs:

- the plan unit is a prompt (`plan.prompts`): every rank gets whole prompts, so all completions of a prompt
  are sampled, scored and trained on one rank and the group's advantages need no exchange;
- a step begins with the rollout (`rollout.py`): sampling each prompt's group with its own seeded
  generator (in as few generate calls as the GPU's free memory allows, `generation_memory.py`), the reward
  functions, one all-reduce of the step's sums (completion tokens and completions for the loss's global
  normaliser, reward and length statistics, and a flag for a reward function that failed on any rank),
  advantages; then this rank's completions are packed padding-free into micro-batches of the
  token budget (`loss.pack_completions`) and the SFT trainer's `training_step` runs them, with GRPO's loss
  per micro-batch (`loss.py`) and its KL and clip sums in the gradient all-reduce;
- with `beta > 0` the reference log-probabilities come from the same model with the adapter switched off
  (the DPO trainer's `ReferenceSwitch`); with `num_iterations > 1` a rollout is trained on that many optimizer
  steps, its log-probabilities at generation kept as the ratio's denominator (TRL's old_per_token_logps).

Everything else (HF's loop, the sync before clipping, checkpoints, per-rank RNG) is the SFT trainer's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import json
import time

import numpy as np
import torch
import torch.distributed as torch_dist
import trl
from loguru import logger

from HyperSloth.config import GrpoArgs, load_reward_funcs, reward_name
from HyperSloth.data.prompts import reward_inputs
from HyperSloth.outputs import run_files
from HyperSloth.plan.batching import adaptive_partition_batches, steps_per_epoch
from HyperSloth.plan.inputs import plan_spec_for
from HyperSloth.plan.prompts import prompt_plan_inputs, prompt_plan_spec
from HyperSloth.plan.run import RunDescription
from HyperSloth.train import dist
from HyperSloth.train.dist import DistInfo
from HyperSloth.train.dpo.preference import ReferenceSwitch, add_reference_adapter, target_logps
from HyperSloth.train.evaluation import sum_over_ranks
from HyperSloth.train.grpo import loss as grpo_loss
from HyperSloth.train.grpo.generation_memory import GenerationMemory
from HyperSloth.train.grpo.merged_sampling import MergedSampling
from HyperSloth.train.grpo.rollout import (
    RewardFailure,
    advantages,
    completion_texts,
    eos_ids,
    generation_config,
    prompt_seed,
    sample_chunks,
    sampling_mode,
    score,
)
from HyperSloth.train.plan_loader import PlanSteps
from HyperSloth.train.sft.trainer import HyperSlothTrainer, RunSetup, run_setup
from HyperSloth.train.trainer_args import trainer_arguments


COMPLETIONS_LOG = "completions.jsonl"  # per rank, in the run's logs folder


class PromptPlanSteps(PlanSteps):
    """`PlanSteps` over prompts: item (epoch, k) is this rank's prompts of plan step k // num_iterations (the
    same rollout trains num_iterations optimizer steps)."""

    columns = ("prompt_input_ids", "prompt_json", "columns_json")

    def __init__(self, *args, num_iterations: int = 1, token_budget: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_iterations = num_iterations
        self.token_budget = token_budget  # the completions' micro-batches, packed after generation

    def __len__(self) -> int:
        return self.steps_per_epoch * self.num_iterations

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        epoch, index = key
        step = self.plan(epoch).steps[index // self.num_iterations]
        rows = [int(i) for mb in step.ranks[self.rank] for i in mb]
        data = self.dataset[rows] if rows else {c: [] for c in self.columns}
        return {
            "prompt_rows": rows,
            "prompt_ids": [np.asarray(ids, dtype=np.int64) for ids in data["prompt_input_ids"]],
            "prompt_json": [str(p) for p in data["prompt_json"]],
            "columns_json": [str(c) for c in data["columns_json"]],
            "plan_step": epoch * self.steps_per_epoch + index // self.num_iterations,
            "num_items_in_batch": int(step.num_trainable),  # the step's prompts (all ranks)
            "real_tokens": 0,  # known after generation: the trainer sets it
        }


class PromptEvaluator:
    """The held-out prompts of this rank (rows rank, rank + N, ...): each evaluation samples every prompt's group
    with a generator seeded by (seed, EVAL_STEP, row), the same at every evaluation and on any number of GPUs, and
    reports the mean reward over all ranks; eval_loss is minus that mean, so the best adapter and early stopping
    (which look for the lowest eval_loss) keep the highest reward."""

    def __init__(self, dataset, *, rank: int, world_size: int):
        rows = list(range(rank, len(dataset), world_size))
        data = dataset.select_columns(list(PromptPlanSteps.columns))[rows] if rows else {c: [] for c in
                                                                                        PromptPlanSteps.columns}
        self.item = {"prompt_rows": rows,
                     "prompt_ids": [np.asarray(ids, dtype=np.int64) for ids in data["prompt_input_ids"]],
                     "prompt_json": list(data["prompt_json"]), "columns_json": list(data["columns_json"]),
                     "plan_step": EVAL_STEP}


EVAL_STEP = 2**32 - 1  # the sampling seeds' step of evaluations (training steps never reach it)


class HyperSlothGRPOTrainer(HyperSlothTrainer):
    """HyperSlothTrainer whose steps sample, score and train on completions (see the module docstring)."""

    # The model card and the model's Hub tags name the method trained, as TRL's GRPOTrainer does (the SFT base named it SFT)
    _tag_names, _name, _paper = trl.GRPOTrainer._tag_names, trl.GRPOTrainer._name, trl.GRPOTrainer._paper
    step_sums_width = 1 + len(grpo_loss.LOSS_SUM_KEYS)
    # One step holds a whole sampling (256 token steps of ~30 launches each, with Python stacks): three of them under
    # torch.profiler did not finish their export within 268 s on an H200 (callR, 2026-12-03), one is enough to read.
    profiled_steps = 1

    def __init__(self, *args, grpo: GrpoArgs, reward_funcs: Sequence[Callable[..., Any]], reference: ReferenceSwitch,
                 world_size: int, seed: int, backend: str, **kwargs):
        self.grpo = grpo
        self.backend = backend  # "unsloth" or "transformers": how sampling switches the model (rollout.sampling_mode)
        self.reward_funcs = tuple(reward_funcs)
        self.reference = reference
        self.world_size = world_size
        self.sampling_seed = seed
        self._rollout: tuple[int, dict[str, Any]] | None = None  # (plan step, its micro-batches and counts)
        self._step_metrics: list[dict[str, float]] = []
        self._unlogged: list[dict[str, float]] = []
        self._timing: dict[str, float] = {}
        self.generation_memory = GenerationMemory(grpo)  # generate calls within the GPU's free memory
        self.merged_sampling = MergedSampling(grpo.sampling_weights == "merged")  # sampling without the adapter GEMMs
        super().__init__(*args, **kwargs)
        tokenizer = self.processing_class
        self.generation = generation_config(grpo, tokenizer.pad_token_id, eos_ids(self.model, tokenizer))

    # ---- one step ------------------------------------------------------------------------------
    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """The rollout (or the cached one, for num_iterations > 1), then the SFT step over its micro-batches."""
        step = int(inputs["plan_step"])
        self._timing = {"timing/generation_s": 0.0, "timing/rollout_s": 0.0}  # this rank's, 0 on a reused rollout
        if self._rollout is None or self._rollout[0] != step:
            started = time.perf_counter()
            self._rollout = (step, self.rollout(model, inputs))
            self._timing["timing/rollout_s"] = time.perf_counter() - started
        rollout = self._rollout[1]
        step_inputs = {"micro_batches": [dict(mb) for mb in rollout["micro_batches"]],
                       "num_items_in_batch": rollout["denominator"], "real_tokens": rollout["real_tokens"]}
        return super().training_step(model, step_inputs)

    def rollout(self, model, inputs: dict[str, Any]) -> dict[str, Any]:
        """Sample, score (every rank agrees that every reward function succeeded), advantages, micro-batches."""
        step = self.state.global_step + 1  # the optimizer step being trained, as logged
        started = time.perf_counter()
        groups = self.sample(model, inputs)  # ends on the host (token ids): no sync needed for the clock
        self._timing["timing/generation_s"] = time.perf_counter() - started
        failure, scored = None, None
        try:
            scored = self.score(inputs, groups, step)
        except RewardFailure as err:
            failure = str(err)
        totals, longest = self.global_sums(inputs["prompt_ids"], groups, scored, failure is not None)
        if totals["failed"] > 0:
            messages = dist.exchange(f"grpo_reward_failure/{step}", failure or "")
            rank, message = next((r, m) for r, m in enumerate(messages) if m)
            raise RewardFailure(message + (f" (on rank {rank})" if self.world_size > 1 else ""))
        self.record_completions(step, inputs["prompt_rows"], groups, scored)
        return self.micro_batches(model, inputs, groups, scored, totals, longest)

    def record_completions(self, step: int, rows: list[int], groups: list[list[np.ndarray]], scored) -> None:
        """Append this rank's completions of the step, their token ids and rewards, to its rank file COMPLETIONS_LOG
        (one line per prompt: what was sampled and how it scored, as TRL's completions table)."""
        g = self.grpo.num_generations
        with run_files.rank_file(self.args.output_dir, self.rank, COMPLETIONS_LOG).open("a") as log:
            for k, (row, group) in enumerate(zip(rows, groups)):
                rewards = scored.weighted[k * g:(k + 1) * g] if scored is not None else []
                log.write(json.dumps({"step": step, "row": row, "completion_ids": [c.tolist() for c in group],
                                      "rewards": [None if np.isnan(r) else float(r) for r in rewards]}) + "\n")

    def sample(self, model, inputs: dict[str, Any]) -> list[list[np.ndarray]]:
        """Each prompt's completions, from its own generator (rollout.prompt_seed); "rank" batches in as few generate
        calls of whole prompts as the GPU's free memory allows (generation_memory.py), one when they fit."""
        seeds = [prompt_seed(self.sampling_seed, int(inputs["plan_step"]), row) for row in inputs["prompt_rows"]]
        prompts = list(inputs["prompt_ids"])
        limit = self.generation_memory.limit(next(model.parameters()).device)
        with sampling_mode(model, self.backend), self.merged_sampling.context(model, limit):
            if self.grpo.generation_batch == "prompt":  # one call per prompt: no padding, bit for bit on N GPUs
                chunks = [range(k, k + 1) for k in range(len(prompts))]
            else:  # inside: the merged weights' copies are not free for the KV cache
                chunks = self.generation_memory.chunks(model, [len(ids) for ids in prompts])
            return sample_chunks(model, prompts, seeds, self.grpo, self.generation, chunks)

    def score(self, inputs: dict[str, Any], groups: list[list[np.ndarray]], step: int):
        """The reward functions on this rank's completions (RewardFailure when one fails)."""
        if not groups:
            return None
        prompts, columns = reward_inputs({"prompt_json": inputs["prompt_json"], "columns_json": inputs["columns_json"]})
        g = self.grpo.num_generations
        flat = [c for group in groups for c in group]
        conversational = isinstance(prompts[0], list)
        return score(self.reward_funcs, self.grpo.reward_weights,
                     prompts=[p for p in prompts for _ in range(g)],
                     completions=completion_texts(self.processing_class, flat, conversational),
                     completion_ids=[c.tolist() for c in flat], columns=[c for c in columns for _ in range(g)],
                     step=step, trainer_state=self.state)

    def global_sums(self, prompt_ids, groups, scored, failed: bool) -> tuple[dict[str, Any], float]:
        """One all-reduce of the step's sums (loss normaliser, statistics, the failure flag), and the longest
        completion of the step over all ranks."""
        funcs = len(self.reward_funcs)
        lengths = np.array([len(c) for group in groups for c in group], dtype=np.float64)
        prompts = np.array([len(ids) for ids, group in zip(prompt_ids, groups) for _ in group], dtype=np.float64)
        values = [lengths.sum(), lengths.size, prompts.sum(), (lengths >= self.grpo.max_completion_length).sum(),
                  float(failed)]
        per_func = np.zeros((3, funcs + 1))
        zero_std = 0.0
        if scored is not None and not failed:
            table = np.concatenate([scored.per_func, scored.weighted[:, None]], axis=1).astype(np.float64)
            per_func = np.stack([np.nansum(table, 0), np.nansum(table ** 2, 0), (~np.isnan(table)).sum(0)])
            zero_std = float(advantages(scored.weighted, self.grpo.num_generations, "group")[1].sum())
        vector = torch.tensor([*values, *per_func.reshape(-1), zero_std, len(groups)], dtype=torch.float64)
        vector = sum_over_ranks(vector.to(self.args.device), self.world_size).cpu().numpy()
        longest = torch.tensor([lengths.max() if lengths.size else 0.0], device=self.args.device)
        if self.world_size > 1:
            torch_dist.all_reduce(longest, op=torch_dist.ReduceOp.MAX)
        keys = ("tokens", "completions", "prompt_tokens", "clipped", "failed")
        totals = dict(zip(keys, vector[:5]))
        totals["per_func"] = vector[5:5 + per_func.size].reshape(3, funcs + 1)
        totals["zero_std"], totals["groups"] = vector[-2], vector[-1]
        return totals, float(longest.item())

    def micro_batches(self, model, inputs, groups, scored, totals, longest) -> dict[str, Any]:
        """This rank's completions with their advantages, packed and collated; the step's loss denominator."""
        g = self.grpo.num_generations
        scale = self.grpo.scale
        batch_std = _std(*totals["per_func"][:, -1]) if scale == "batch" else None
        adv = advantages(scored.weighted, g, scale, batch_std)[0] if scored is not None else np.zeros(0)
        items = [grpo_loss.Completion(ids, c, float(adv[k * g + j]))
                 for k, (ids, group) in enumerate(zip(inputs["prompt_ids"], groups)) for j, c in enumerate(group)]
        denominator, rule = grpo_loss.normaliser(self.grpo, int(totals["completions"]), int(totals["tokens"]))
        unsloth = self.plan_steps.packed_lengths
        batches = [grpo_loss.collate_completions([items[k] for k in idx], rule,
                                                 pad_token_id=self.processing_class.pad_token_id,
                                                 with_lengths=unsloth, bucket=unsloth,
                                                 bucket_limit=self.plan_steps.token_budget)
                   for idx in grpo_loss.pack_completions(items, self.plan_steps.token_budget)]
        self.add_fixed_logps(model, batches)
        return {"micro_batches": batches, "denominator": denominator, "metrics": self.metrics(totals, longest),
                "real_tokens": int(totals["tokens"] + totals["prompt_tokens"]), "completion_tokens": totals["tokens"]}

    def add_fixed_logps(self, model, batches: list[dict[str, Any]]) -> None:
        """The log-probabilities that stay fixed while training on this rollout: the reference's (beta > 0),
        and the policy's at generation (num_iterations > 1), per micro-batch."""
        if self.grpo.beta == 0.0 and self.grpo.num_iterations == 1:
            return
        with torch.no_grad():
            for batch in batches:
                device_batch = dict(batch)
                device_batch = {k: v.to(self.args.device) if k != "packed_seq_lengths" else v
                                for k, v in device_batch.items()}
                if self.grpo.beta != 0.0:
                    with self.reference.active(model), self.compute_loss_context_manager():
                        batch["ref_logps"] = target_logps(model, device_batch, self.grpo.temperature).detach()
                if self.grpo.num_iterations > 1:
                    with self.compute_loss_context_manager():
                        batch["old_logps"] = target_logps(model, device_batch, self.grpo.temperature).detach()

    def micro_batch_terms(self, model, micro_batch: dict[str, Any], denominator: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's GRPO loss share, its KL and clip sums) (loss.py)."""
        old, ref = micro_batch.pop("old_logps", None), micro_batch.pop("ref_logps", None)
        logps = target_logps(model, micro_batch, self.grpo.temperature)
        return grpo_loss.micro_batch_loss(logps, micro_batch, self.grpo, denominator, old, ref)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """HF's estimate for the micro-batches this step trained on (the item holds prompts only)."""
        return super().floating_point_ops({"micro_batches": self._rollout[1]["micro_batches"] if self._rollout else []})

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The mean reward of the held-out prompts' completions over all ranks (`PromptEvaluator`), TRL's names
        prefixed; eval_loss = -eval_reward."""
        if self.evaluator is None:
            raise ValueError("this run has no eval set: set data.eval_fraction or data.eval_dataset_name")
        started = time.perf_counter()
        inputs = self.evaluator.item
        groups = self.sample(self.model, inputs)
        step = self.state.global_step
        failure, scored = None, None
        try:
            scored = self.score(inputs, groups, step)
        except RewardFailure as err:
            failure = f"{err} (evaluating)"
        totals, longest = self.global_sums(inputs["prompt_ids"], groups, scored, failure is not None)
        if totals["failed"] > 0:
            messages = dist.exchange(f"grpo_eval_failure/{step}", failure or "")
            raise RewardFailure(next(m for m in messages if m))
        found = self.metrics(totals, longest)
        metrics = {f"{metric_key_prefix}_loss": -found["reward"],
                   **{f"{metric_key_prefix}_{key}": value for key, value in found.items()},
                   f"{metric_key_prefix}_prompts": int(totals["groups"]),
                   f"{metric_key_prefix}_runtime": time.perf_counter() - started}
        logger.info(f"step {step}: eval_reward {found['reward']:.4f} over {int(totals['groups'])} held-out prompts")
        self.log(dict(metrics))
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        best = self.state.best_metric
        self.state.best_metric = metrics[f"{metric_key_prefix}_loss"] if best is None else min(
            best, metrics[f"{metric_key_prefix}_loss"])
        self.eval_seconds += metrics[f"{metric_key_prefix}_runtime"]
        return metrics

    # ---- what is logged ------------------------------------------------------------------------
    def metrics(self, totals: dict[str, Any], longest: float) -> dict[str, float]:
        """The rollout's TRL-named statistics over the global batch."""
        sums, squares, counts = totals["per_func"]
        out = {}
        for j, func in enumerate(self.reward_funcs):
            out[f"rewards/{reward_name(func)}/mean"] = _mean(sums[j], counts[j])
            out[f"rewards/{reward_name(func)}/std"] = _std(sums[j], squares[j], counts[j])
        out["reward"] = _mean(sums[-1], counts[-1])
        out["reward_std"] = _std(sums[-1], squares[-1], counts[-1])
        out["frac_reward_zero_std"] = _mean(totals["zero_std"], totals["groups"])
        out["completions/mean_length"] = _mean(totals["tokens"], totals["completions"])
        out["completions/max_length"] = longest
        out["completions/clipped_ratio"] = _mean(totals["clipped"], totals["completions"])
        return out

    def record_step(self, step_sums: torch.Tensor, inputs: dict[str, Any]) -> None:
        super().record_step(step_sums, inputs)
        rollout = self._rollout[1]
        tokens = max(float(rollout["completion_tokens"]), 1.0)
        loss_means = (step_sums[1:].detach().double() / tokens).tolist()
        names = [k for k in grpo_loss.LOSS_SUM_KEYS if k != "kl" or self.grpo.beta != 0.0]
        row = {**rollout["metrics"], **{k: v for k, v in zip(grpo_loss.LOSS_SUM_KEYS, loss_means) if k in names},
               **self._timing}
        self._step_metrics.append(row)
        self._unlogged.append(row)

    def step_series_this_run(self) -> dict[str, list[Any]]:
        return {**super().step_series_this_run(), "grpo": list(self._step_metrics)}

    @property
    def step_metrics(self) -> dict[str, list[float]]:
        """Every step's GRPO statistics (rewards, lengths, clip ratios; KL with beta > 0), identical on all
        ranks; the whole run's after a resume (`StepHistory`)."""
        rows = self.step_history.earlier.get("grpo", []) + self._step_metrics
        keys = list(dict.fromkeys(k for row in rows for k in row))
        return {key: [row.get(key) for row in rows] for key in keys}

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._unlogged:  # means over the steps since the last log, as TRL's
            for key in self._unlogged[0]:
                logs[key] = float(np.mean([row[key] for row in self._unlogged]))
            self._unlogged.clear()
        super().log(logs, start_time)


def _mean(total: float, count: float) -> float:
    return float(total / count) if count else float("nan")


def _std(total: float, squares: float, count: float) -> float:
    """The unbiased std of `count` values from their sum and sum of squares (TRL's nanstd over the batch)."""
    if count < 2:
        return float("nan")
    return float(np.sqrt(max(squares - total * total / count, 0.0) / (count - 1)))


def build_grpo_trainer(description: RunDescription, loaded_model, dataset, info: DistInfo, eval_dataset=None
                       ) -> tuple[HyperSlothGRPOTrainer, RunSetup]:
    """The GRPO twin of `sft.trainer.build_trainer`: reward functions from the config file, the plan over
    prompts, the reference switch, the GRPO trainer for this rank."""
    grpo = description.grpo
    funcs = load_reward_funcs(description.config_path, description.reward_funcs)
    lengths, units = prompt_plan_inputs(dataset, grpo, description.max_seq_length)
    spec = prompt_plan_spec(plan_spec_for(description), grpo.num_generations)
    per_epoch = steps_per_epoch(len(lengths), spec.samples_per_step)
    unsloth = loaded_model.backend == "unsloth"
    steps = PromptPlanSteps(dataset, partial(adaptive_partition_batches, lengths, units, spec), per_epoch,
                            rank=info.rank, mode=spec.mode, loss_type=description.loss_type,
                            pad_token_id=loaded_model.tokenizer.pad_token_id, packed_lengths=unsloth,
                            num_iterations=grpo.num_iterations, token_budget=description.token_budget)
    lora = description.hyper_config.lora_args
    init_adapter = lora.init_adapter_path if lora else None
    model = loaded_model.model
    reference = add_reference_adapter(model, init_adapter) if init_adapter and grpo.beta else ReferenceSwitch(model)
    evaluator = None
    if eval_dataset is not None:
        evaluator = PromptEvaluator(eval_dataset, rank=info.rank, world_size=info.world_size)
    trainer = HyperSlothGRPOTrainer(
        **trainer_arguments(description, loaded_model, dataset, info, steps, evaluator, eval_dataset),
        graphs_off="GRPO generates between its training passes (no CUDA graphs)",
        grpo=grpo, reward_funcs=funcs, reference=reference, world_size=info.world_size, seed=description.seed,
        backend=loaded_model.backend,
    )
    return trainer, run_setup(loaded_model.backend, spec, per_epoch, steps.plan(0).stats)
