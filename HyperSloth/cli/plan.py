"""`hypersloth-plan CONFIG [--gpus N]`: preview the batch plan of a config, no model and no GPU needed.

It reads the registered dataset's `length` and `num_trainable` columns, builds epoch 0's plan for the
configured GPUs (or N of them, for a what-if) exactly as the workers will, and prints a summary that
ends with one machine-readable line:
    plan: steps=S micro_batches_per_rank=M padding_pct=P random_padding_pct=R imbalance=I plan_seconds=T
S = optimizer steps in one epoch, M = micro-batches each rank runs in that epoch (the same on every
rank), P = padding in % of computed tokens, R = the same for random batching of
per_device_train_batch_size samples, I = mean over steps of max rank load / mean rank load.
`hypersloth-train CONFIG --dry-run` prints the same summary.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from HyperSloth.cli.command import Command, Flag, Positional
from HyperSloth.config import ConfigError, load_config
from HyperSloth.plan.batching import EpochPlan, PlanSpec, PlanStats, adaptive_partition_batches, int_column
from HyperSloth.plan.eval_set import describe_eval_plan, eval_row_lengths, plan_eval, training_rows
from HyperSloth.plan.inputs import dataset_lengths, plan_spec_for
from HyperSloth.plan.pairs import pair_plan_inputs
from HyperSloth.plan.prompts import prompt_plan_inputs, prompt_plan_spec
from HyperSloth.plan.run import MachineFacts, resolve_run


@dataclass(frozen=True)
class PlanSummary:
    """What `preview` found: the inputs, the spec it planned with and epoch 0's plan statistics."""

    config_path: str
    dataset_path: str
    num_samples: int
    trainable_tokens: int
    spec: PlanSpec
    steps_per_epoch: int
    run_steps: int  # optimizer steps the run will take: max_steps, else epochs x steps_per_epoch
    stats: PlanStats
    max_micro_batch_tokens: int  # computed tokens of the largest micro-batch (padding included)
    plan_seconds: float
    eval_lines: tuple[str, ...] = ()  # the eval set and one evaluation's plan (none without an eval set)
    unit: str = "samples"  # what the plan deals: "samples", or "pairs" for DPO (one unit = both sequences)


def _dataset_columns(path: Path, loss_type: str, max_seq_length: int, method: str = "sft", grpo=None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lengths, trainable, scored tokens) per row of a built dataset, as the trainer plans it: samples
    (trainable = length - 1 when the loss covers every token), or pairs for DPO (one planning unit each, see
    HyperSloth.plan.pairs; the scored tokens are the completions'); `batching.sample_token_counts` for samples."""
    import datasets  # heavy; only the preview needs it

    try:
        dataset = datasets.load_from_disk(str(path)).with_format("numpy")
    except FileNotFoundError:
        raise ConfigError(f"the built dataset folder {path} is missing or incomplete: rebuild it with "
                          "`hypersloth-build-dataset --local_path FILE_OR_DIR --tokenizer MODEL --name NAME`") from None
    missing = [c for c in ("length", "num_trainable") if c not in dataset.column_names]
    if missing:
        raise ConfigError(f"{path} has no column(s) {missing}: rebuild it with `hypersloth-build-dataset`")
    try:
        if method == "dpo":
            lengths, units = pair_plan_inputs(dataset, max_seq_length)
            return lengths, units, int_column(dataset, "num_trainable")
        if method == "grpo":  # one unit per prompt, its group's worst case as its length (plan/prompts.py)
            lengths, units = prompt_plan_inputs(dataset, grpo, max_seq_length)
            return lengths, units, units
        lengths, trainable = dataset_lengths(dataset, loss_type, max_seq_length)
        return lengths, trainable, trainable
    except ValueError as err:
        raise ConfigError(f"{path}: {err}") from None


def _max_micro_batch_tokens(plan: EpochPlan, lengths: np.ndarray) -> int:
    padded = plan.spec.mode == "sorted-pad"
    # Samples inside a micro-batch are longest first, so mb[0] is its longest.
    return max((len(mb) * int(lengths[mb[0]]) if padded else int(lengths[list(mb)].sum()))
               for step in plan.steps for mbs in step.ranks for mb in mbs if mb)


def preview(config_path: str, *, num_ranks: int | None = None) -> PlanSummary:
    """Plan epoch 0 of CONFIG on its GPUs (or `num_ranks` of them); ConfigError for any user mistake.

    The run is resolved exactly as `hypersloth-train` resolves it (HyperSloth.plan.run.resolve_run, world size
    len(training.gpus) unless `num_ranks`), on the machine the config asks for: its GPUs present."""
    if num_ranks is not None and (isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1):
        raise ConfigError(f"--gpus must be a whole number >= 1, got {num_ranks!r}")
    loaded = load_config(config_path)
    world = len(loaded.hyper.training.gpus) if num_ranks is None else num_ranks
    description = resolve_run(loaded, world_size=world, machine=MachineFacts.assumed_for(loaded.hyper))
    path = Path(description.dataset.path)
    grpo = description.grpo
    lengths, trainable, scored = _dataset_columns(path, description.loss_type, description.max_seq_length,
                                                  description.method, grpo)
    rows = training_rows(description.eval_set, lengths.size)  # a hold-out is never trained on
    lengths, trainable, scored = lengths[rows], trainable[rows], scored[rows]
    start = time.perf_counter()
    try:
        spec = plan_spec_for(description)
        if description.method == "grpo":  # the planner deals prompts: global batch / num_generations per step
            spec = prompt_plan_spec(spec, grpo.num_generations)
        plan = adaptive_partition_batches(lengths, trainable, spec, epoch=0)
        eval_lines = _eval_lines(description, spec)
    except ValueError as err:  # the planner's own checks, e.g. a negative seed
        raise ConfigError(f"{loaded.path}: cannot plan the batches: {err}") from None
    seconds = time.perf_counter() - start
    per_epoch = len(plan.steps)
    targs = loaded.training_args
    run_steps = targs.max_steps or per_epoch * (targs.num_train_epochs or 1)
    return PlanSummary(
        config_path=str(loaded.path), dataset_path=str(path), num_samples=int(lengths.size),
        trainable_tokens=int(scored.sum()), spec=spec, steps_per_epoch=per_epoch, run_steps=run_steps,
        stats=plan.stats, max_micro_batch_tokens=_max_micro_batch_tokens(plan, lengths), plan_seconds=seconds,
        eval_lines=eval_lines, unit={"dpo": "pairs", "grpo": "prompts"}.get(description.method, "samples"),
    )


def _eval_lines(description, spec: PlanSpec) -> tuple[str, ...]:
    """The eval set and the plan of one evaluation, planned as the workers will (HyperSloth.plan.eval_set)."""
    if description.eval_set is None:
        return ()
    lengths, trainable = eval_row_lengths(description.eval_set, description.loss_type)
    if description.method == "dpo":  # the trainer plans one unit per pair (HyperSloth.plan.pairs)
        trainable = np.ones_like(lengths)
    eval_plan = plan_eval(lengths, trainable, spec)
    return tuple(describe_eval_plan(description.eval_set, eval_plan))


def summary_line(summary: PlanSummary) -> str:
    """The machine-readable last line of the summary."""
    st = summary.stats
    return (f"plan: steps={summary.steps_per_epoch} micro_batches_per_rank={st.micro_batches_per_rank} "
            f"padding_pct={100 * st.padding_fraction:.3f} random_padding_pct={100 * st.random_padding_fraction:.3f} "
            f"imbalance={st.imbalance:.4f} plan_seconds={summary.plan_seconds:.3f}")


def _batching_line(spec: PlanSpec) -> str:
    if spec.mode == "packed":
        how = f"packed (padding-free), at most {spec.token_budget:,} tokens per micro-batch"
    else:
        how = f"sorted-pad, {spec.micro_batch_size} samples per micro-batch, each padded to its longest"
    return f"{how}; group_by_length {'on' if spec.group_by_length else 'off'}"


def format_summary(summary: PlanSummary) -> str:
    """A readable multi-line summary ending with `summary_line`."""
    st, spec = summary.stats, summary.spec
    per_step = st.micro_batches_per_rank / max(st.num_steps, 1)
    ranks = "  ".join(f"rank{r} {tokens:,}" for r, tokens in enumerate(st.rank_real_tokens))
    oversized = f"; {st.oversized_samples} sample(s) over the budget run alone" if st.oversized_samples else ""
    lines = [
        f"HyperSloth plan preview: {summary.config_path}",
        f"  dataset        {summary.dataset_path}: {summary.num_samples:,} {summary.unit}, {st.real_tokens:,} tokens"
        f"{' (prompt counted once per completion)' if summary.unit == 'pairs' else ''}, "
        f"{summary.trainable_tokens:,} trainable",
        f"  ranks          {spec.num_ranks}; global batch {spec.samples_per_step} {summary.unit} per optimizer step"
        f"{'; a pair is never split: both sequences share a micro-batch' if summary.unit == 'pairs' else ''}",
        f"  batching       {_batching_line(spec)}",
        f"  steps          {summary.steps_per_epoch} per epoch; the run takes {summary.run_steps}",
        f"  micro-batches  {st.micro_batches_per_rank} per rank per epoch (per step: mean {per_step:.2f}, "
        f"min {st.min_micro_batches_per_step}, max {st.max_micro_batches_per_step}); "
        f"{st.empty_micro_batches} empty{oversized}",
        f"  largest        {summary.max_micro_batch_tokens:,} computed tokens in one micro-batch",
        f"  tokens/rank    {ranks}",
        f"  padding        {100 * st.padding_fraction:.2f}% of {st.computed_tokens:,} computed tokens; random "
        f"batches of {spec.micro_batch_size}: {100 * st.random_padding_fraction:.2f}% "
        f"({st.padding_tokens_saved:,} tokens saved)",
        f"  imbalance      {st.imbalance:.4f} mean max/mean rank load (worst step {st.max_imbalance:.4f}; "
        f"one-sample bound {st.imbalance_bound:.4f})",
        f"                 rank load = tokens + {spec.attention_coef:.3g} x tokens^2 per sequence (attention term)",
        f"  planned in     {summary.plan_seconds:.3f} s",
        *summary.eval_lines,
        summary_line(summary),
    ]
    return "\n".join(lines)


def plan(config: str, gpus: int | None = None) -> None:
    """Print the batch plan summary of CONFIG; --gpus N previews it on N GPUs instead."""
    try:
        print(format_summary(preview(str(config), num_ranks=gpus)))
    except ConfigError as err:
        print(f"hypersloth-plan: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


COMMAND = Command(
    prog="hypersloth-plan",
    summary="""Preview the batch plan of CONFIG: no model and no GPU needed. Reads the registered dataset's
`length` and `num_trainable` columns, builds epoch 0's plan for the configured GPUs (or N of them, for
a what-if) exactly as the workers will, and prints a summary that ends with one machine-readable line:
    plan: steps=S micro_batches_per_rank=M padding_pct=P random_padding_pct=R imbalance=I plan_seconds=T
`hypersloth-train CONFIG --dry-run` prints the same summary.""",
    positionals=(Positional("config", "CONFIG", "the config file (see `hypersloth-init`)"),),
    flags=(Flag("gpus", "plan for N GPUs instead of len(training.gpus)", value="N"),),
    examples=("hypersloth-plan examples/tiny_cpu_demo.py",
              "hypersloth-plan my_config.py --gpus 8          # the same run on 8 GPUs"),
    notes="exit codes: 0 planned, 2 a problem in the config or its dataset (one line)",
)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `hypersloth-plan` (console script via HyperSloth.cli.command)."""
    COMMAND.run(plan, argv)


if __name__ == "__main__":
    main()
