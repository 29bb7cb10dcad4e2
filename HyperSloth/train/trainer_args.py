"""What a HyperSloth trainer (SFT or DPO) is built with: TRL's arguments for plan-driven steps
(`sft_config_for`), the constructor arguments both trainers share (`trainer_arguments`: data, plan, gradient
sync, evaluator and its callbacks), and the CUDA-graph arguments of the SFT trainer (`decoder_graphs`).
The trainers themselves, and the factories that call these, are in trainer.py and dpo_trainer.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from loguru import logger
from trl import SFTConfig

from HyperSloth.config import TrainingArgsConfig
from HyperSloth.plan.run import RunDescription, rank_seed
from HyperSloth.train.collate import packed_row_tokens
from HyperSloth.train.dist import DistInfo, GradientSync
from HyperSloth.train.evaluation import Evaluator, eval_callbacks, eval_sft_kwargs
from HyperSloth.train.model import mixed_precision, trainable_parameters
from HyperSloth.train.plan_loader import PlanSteps
from HyperSloth.train.step_graph import (DecoderGraphs, graph_layout, rows_to_capture,
                                         run_graph_refusal)


def sft_config_for(targs: TrainingArgsConfig, dtype: torch.dtype, rank: int,
                   evaluation: dict[str, Any] | None = None, backend: str = "transformers") -> SFTConfig:
    """TRL arguments: the user's, plus what plan-driven steps need (HF sees one batch per step, and
    leaves gradient_accumulation_steps at 1: the accumulation happens inside training_step), plus the
    evaluation schedule (`evaluation.eval_sft_kwargs`) when the run has an eval set.

    Gradient checkpointing belongs to the model loader (`FastModelArgs.use_gradient_checkpointing`). TRL's
    SFTConfig defaults `gradient_checkpointing` to True, and HF's `train()` then checkpoints every layer:
    on the transformers backend that happened whatever the config said. Unsloth's trainer restores the
    mode the model was loaded with (unsloth/models/_gc_config_default.py), so the Unsloth backend keeps
    TRL's default: on the H200 its training peaks matched the probe's no-checkpointing line.
    """
    kwargs = targs.to_sft_kwargs()
    cuda = torch.cuda.is_available()
    precision = mixed_precision(dtype, cuda)  # the probe and the packed-row check forward under the same autocast
    kwargs.update(
        seed=rank_seed(targs.seed, rank),  # HF seeds torch with it: this rank's dropout stream
        # One plan step per optimizer step. Said explicitly: Unsloth's patched SFTConfig defaults to 2, which
        # made HF run two plan steps (two global batches) per optimizer step (seen on the H200, 2026-11-30).
        gradient_accumulation_steps=1,
        dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,
        packing=False,
        padding_free=False,
        use_cpu=not cuda,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
    )
    # An MoE model's load-balancing loss: TRL 1.15 turns it on with the architecture's coefficient (0.001 on
    # Qwen3-MoE) unless told 0. transformers computes it per forward, over that micro-batch's tokens only: the
    # step's sum would depend on how its tokens were cut into micro-batches and GPUs, so N GPUs would not train
    # what one does. The router is frozen, so it would only steer the adapters below it. Off (a non-zero
    # coefficient in extra_args is refused by the config; docs/models.md).
    if "router_aux_loss_coef" in getattr(SFTConfig, "__dataclass_fields__", {}):  # trl >= 1.x
        kwargs["router_aux_loss_coef"] = 0.0
    if backend != "unsloth":  # the loader already applied the configured checkpointing (model.py)
        kwargs.setdefault("gradient_checkpointing", False)  # extra_args may still set it
    if kwargs.get("dataloader_num_workers") is None:  # collate ahead in a worker process when on GPUs
        kwargs["dataloader_num_workers"] = 1 if cuda else 0
    kwargs.update(evaluation or {})
    if rank != 0:  # one writer: rank 0 saves, reports and shows progress (others save their RNG only)
        kwargs.update(report_to="none", disable_tqdm=True)
    return SFTConfig(**kwargs)


# Row lengths of the first this-many steps are captured before training; later new lengths on first sight.
GRAPH_PLAN_STEPS = 256


def decoder_graphs(description: RunDescription, loaded_model, steps: PlanSteps, lengths: np.ndarray, rank: int
                   ) -> dict[str, Any]:
    """The trainer's CUDA-graph arguments: the installed `DecoderGraphs` and the planned row lengths to
    capture, or why the decoder runs eagerly (one log line)."""
    spec = steps.plan(0).spec  # its mode is description.batching (plan.inputs.plan_spec_for)
    reason = run_graph_refusal(description, loaded_model.backend, getattr(loaded_model.model, "config", None))
    if reason is not None:
        logger.info(f"eager decoder forward+backward: {reason}")
        return {"graphs_off": reason}
    from HyperSloth.train.patches import unsloth_static_packed_rows

    targs = description.training_config
    total = targs.max_steps or (targs.num_train_epochs or 1) * steps.steps_per_epoch
    # the token budget bounds each planned row, and the graph pool and any eager row beside it share it
    counts, longest_row = planned_rows(steps, lengths, rank, total, description.token_budget)
    layout = graph_layout(spec.samples_per_step, int(lengths.max()), description.token_budget, longest_row)
    if layout.max_rows < MIN_GRAPH_ROWS:
        reason = (f"the longest planned row ({longest_row:,} tokens) runs eagerly and leaves room for graphs of "
                  f"only {layout.max_rows:,} tokens within the token budget ({description.token_budget:,}) beside it")
        logger.info(f"eager decoder forward+backward: {reason}")
        return {"graphs_off": reason}
    params = trainable_parameters(loaded_model.model)
    graphs = DecoderGraphs(params, layout, static_packed_info=unsloth_static_packed_rows)
    graphs.install(loaded_model.model.get_base_model().model)
    return {"graphs": graphs, "graph_rows": rows_to_capture(counts, layout, graphs.max_graphs)}


MIN_GRAPH_ROWS = 2048  # below this a graph saves too little to be worth its capture


ROW_SCAN_STEPS = 20_000  # the longest row is looked for in this many steps at most (planning every epoch costs)


def planned_rows(steps: PlanSteps, lengths: np.ndarray, rank: int, total_steps: int, token_budget: int
                 ) -> tuple[dict[int, int], int]:
    """This rank's packed row lengths: how often each occurs in the first `GRAPH_PLAN_STEPS` steps (the rows
    worth capturing before step 1), and the longest row of the run (what must fit beside the graphs). A run
    of more than `ROW_SCAN_STEPS` steps is scanned that far: its rows come from the same samples and budget,
    so the maximum of 20,000 steps is the run's, up to what the budget's 8% safety share absorbs."""
    counts: dict[int, int] = {}
    longest = 0
    later: dict[int, Any] = {}  # the one later epoch being scanned, planned outside the loader's cache

    def plan(epoch: int):
        # Epoch 0 through the loader's one-plan cache, where step 1 reads it; later epochs beside it, so a
        # small dataset whose scan spans several epochs does not plan epoch 0 again for step 1.
        if epoch == 0:
            return steps.plan(0)
        if epoch not in later:
            later.clear()
            later[epoch] = steps.plan_for_epoch(epoch)
        return later[epoch]

    for index in range(min(total_steps, ROW_SCAN_STEPS)):
        step = plan(index // steps.steps_per_epoch).steps[index % steps.steps_per_epoch]
        for micro in step.ranks[rank]:
            if len(micro) > 0:
                rows = packed_row_tokens(int(lengths[list(micro)].sum()), token_budget)
                longest = max(longest, rows)
                if index < GRAPH_PLAN_STEPS:
                    counts[rows] = counts.get(rows, 0) + 1
    return counts, longest


def trainer_arguments(description: RunDescription, loaded_model, dataset, info: DistInfo, steps: PlanSteps,
                      evaluator: Evaluator | None, eval_dataset=None) -> dict[str, Any]:
    """What every HyperSloth trainer (SFT, DPO) is built with: TRL's arguments, the data, the plan, the gradient
    sync, and the evaluator with its callbacks (best adapter, early stopping)."""
    callbacks = []
    if evaluator is not None:
        callbacks += eval_callbacks(description.output_dir, is_main=info.is_main,
                                    save_best_adapter=description.save_best_adapter,
                                    early_stopping_patience=description.early_stopping_patience)
    return dict(
        model=loaded_model.model,
        args=sft_config_for(description.training_config, loaded_model.dtype, info.rank,
                            evaluation=eval_sft_kwargs(description.eval_steps) if evaluator else None,
                            backend=loaded_model.backend),
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        evaluator=evaluator,
        processing_class=loaded_model.tokenizer,
        callbacks=callbacks,
        plan_steps=steps,
        grad_sync=GradientSync(trainable_parameters(loaded_model.model), info.world_size),
        rank=info.rank,
        profile=description.profile,
        description=description,
    )
