"""Which rows a run evaluates on: a seeded hold-out of the training dataset, or another built dataset.

Resolved once, before any worker starts (`resolve_eval_set`), into a frozen `EvalSet` that the run's
resolved settings record; the workers rebuild exactly those rows from it (`split_for_run`) and refuse
to train if the dataset on disk no longer holds them.

The hold-out is a function of (number of rows, fraction, seed) only: a seeded permutation of the row
indices whose first round(n x fraction) entries are held out. Held-out rows are removed from the
training set, so they are never trained on. The fingerprint is a SHA-256 over the evaluated rows'
indices and token ids, so two runs with the same fingerprint evaluated on the same tokens.

Torch-free: the launcher and `hypersloth-plan` use it without loading torch.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from HyperSloth.config import ConfigError
from HyperSloth.plan.batching import EpochPlan, PlanSpec, adaptive_partition_batches, int_column, sample_token_counts
from HyperSloth.plan.pairs import PAIR_COLUMNS, PREFERENCE_KIND, dataset_kind, kind_problem, longest_sequence
from HyperSloth.plan.prompts import prompt_kind_problem

MAX_EVAL_FRACTION = 0.5  # beyond this the "hold-out" would be larger than what is trained on
EVAL_ROWS_PER_RANK_PER_CHUNK = 256  # eval "steps" hold this many rows per rank: bounds the planner's work
EvalSource = Literal["holdout", "dataset"]


class EvalSet(BaseModel):
    """The evaluation rows of a run, as recorded in its resolved settings (run.json).

    `source="holdout"`: `num_rows` rows of the training dataset `dataset_name` (at `dataset_path`) held
    out with `fraction` and `seed`; `source="dataset"`: every row of the registered dataset `dataset_name`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: EvalSource
    dataset_name: str
    dataset_path: str
    num_rows: int = Field(gt=0, description="Conversations evaluated.")
    tokens: int = Field(description="Tokens of those conversations.")
    target_tokens: int = Field(gt=0, description="Tokens the eval loss averages over (under the run's loss_type).")
    fingerprint: str = Field(description="SHA-256 over the evaluated rows' indices and token ids.")
    fraction: float | None = Field(None, description="eval_fraction of a hold-out.")
    seed: int | None = Field(None, description="Seed of the hold-out permutation.")
    unit: Literal["conversations", "pairs", "prompts"] = Field(
        "conversations", description="What a row is: a conversation (SFT), a preference pair (DPO) or a prompt (GRPO).")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        return self.model_dump()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalSet:
        """Inverse of `to_dict`."""
        return cls.model_validate(data)

    def describe(self) -> str:
        """One line for logs and the plan preview."""
        rows = self.unit
        if self.source == "holdout":
            where = (f"{self.num_rows:,} {rows} held out of '{self.dataset_name}' "
                     f"(eval_fraction {self.fraction}, seed {self.seed})")
        else:
            where = f"dataset '{self.dataset_name}', {self.num_rows:,} {rows}"
        return f"{where}; {self.tokens:,} tokens, {self.target_tokens:,} scored; fingerprint {self.fingerprint[:12]}"


def check_eval_fraction(fraction: float) -> None:
    """ValueError, saying what to change, unless 0 <= fraction <= MAX_EVAL_FRACTION."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
        math.isfinite(fraction) and 0.0 <= fraction <= MAX_EVAL_FRACTION
    ):
        raise ValueError(
            f"eval_fraction must be in [0, {MAX_EVAL_FRACTION}] (the share of conversations held out for "
            f"evaluation; 0 = no hold-out); got {fraction!r}: e.g. eval_fraction=0.05"
        )


def holdout_size(num_rows: int, fraction: float) -> int:
    """How many rows `fraction` holds out of `num_rows`: round(num_rows x fraction), halves rounded up."""
    check_eval_fraction(fraction)
    return int(math.floor(num_rows * fraction + 0.5))


def split_holdout(num_rows: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices), both sorted: a seeded permutation, its first rows held out.

    Depends on nothing but its arguments, so every worker and every later inspection finds the same rows.
    """
    count = holdout_size(num_rows, fraction)
    order = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0x5E7A1D]).permutation(num_rows)
    return np.sort(order[count:]), np.sort(order[:count])


def rows_fingerprint(dataset, indices: np.ndarray) -> str:
    """SHA-256 over the given rows' indices, lengths and token ids (an HF `Dataset` with `input_ids`, or a
    preference dataset: its prompt, chosen and rejected ids, in that order)."""
    import pyarrow.compute as pc

    indices = np.asarray(indices, dtype=np.int64)
    if getattr(dataset, "_indices", None) is not None:  # a select()ed view: hash the rows it shows
        dataset = dataset.flatten_indices()
    # chats: input_ids; pairs: prompt, chosen and rejected ids; prompts (GRPO): prompt ids
    names = ["input_ids"] if "input_ids" in dataset.column_names else [c for c in PAIR_COLUMNS
                                                                        if c in dataset.column_names]
    digest = hashlib.sha256()
    digest.update(indices.tobytes())
    for name in names:
        taken = pc.take(dataset.data.column(name), indices).combine_chunks() if len(indices) else None
        if taken is not None:
            offsets = taken.offsets.to_numpy().astype(np.int64)
            digest.update(np.diff(offsets).tobytes())
            values = taken.values.to_numpy(zero_copy_only=False).astype(np.int64)
            digest.update(values[offsets[0]:offsets[-1]].tobytes())
    return digest.hexdigest()


def _load(path: Path, name: str):
    from datasets import load_from_disk

    try:
        return load_from_disk(str(path))
    except (FileNotFoundError, IndexError):  # IndexError: datasets cannot load a folder of 0 shards
        raise ConfigError(f"the built dataset folder {path} of '{name}' is missing, empty or incomplete: rebuild it with "
                          f"`hypersloth-build-dataset --local_path FILE_OR_DIR --tokenizer MODEL --name {name}`") from None


def _token_counts(dataset, indices: np.ndarray, loss_type: str) -> tuple[int, int]:
    """(tokens, scored target tokens) of the rows; position 0 of a row is never a target."""
    lengths, targets = sample_token_counts(dataset, loss_type, indices)
    return int(lengths.sum()), int(targets.sum())


def resolve_holdout(dataset_name: str, dataset_path: Path, *, fraction: float, seed: int, loss_type: str) -> EvalSet:
    """The hold-out of a training dataset; ConfigError when it would be empty or hold nothing to score."""
    try:
        check_eval_fraction(fraction)
    except ValueError as err:
        raise ConfigError(f"data.{err}") from None
    dataset = _load(dataset_path, dataset_name)
    train, held = split_holdout(len(dataset), fraction, seed)
    if held.size == 0:
        need = 1 / max(len(dataset), 1)
        raise ConfigError(
            f"data.eval_fraction={fraction} holds out no conversation of '{dataset_name}' ({len(dataset)} rows): "
            f"raise eval_fraction to at least {min(need, MAX_EVAL_FRACTION):.3g}, or set "
            "data.eval_dataset_name to a separately built eval dataset"
        )
    if train.size == 0:
        raise ConfigError(f"data.eval_fraction={fraction} leaves no conversation of '{dataset_name}' to train "
                          "on: lower eval_fraction or build a larger dataset")
    tokens, targets = _token_counts(dataset, held, loss_type)
    _check_targets(targets, f"the {held.size} held-out conversations", loss_type)
    return EvalSet(source="holdout", dataset_name=dataset_name, dataset_path=str(dataset_path),
                   num_rows=int(held.size), tokens=tokens, target_tokens=targets,
                   fingerprint=rows_fingerprint(dataset, held), fraction=float(fraction), seed=int(seed),
                   unit=_unit(dataset.column_names))


def resolve_eval_dataset(name: str, path: Path, registry_entry: dict[str, Any], *, model_name: str,
                         loss_type: str, max_seq_length: int | None = None, method: str = "sft") -> EvalSet:
    """A separately built eval dataset; ConfigError when it was tokenised for another model, holds the other
    kind of rows than `method` trains on, or is empty."""
    from HyperSloth.data.tokenizer_check import tokenizer_mismatch

    mismatch = tokenizer_mismatch(registry_entry, model_name, name)
    if mismatch:
        raise ConfigError(f"eval dataset: {mismatch} (or set data.eval_dataset_name to a dataset built with the "
                          "model's tokenizer)")
    kind = dataset_kind(registry_entry)
    wrong_kind = prompt_kind_problem(kind, method, name) or kind_problem(kind, method, name)
    if wrong_kind:
        raise ConfigError(f"eval {wrong_kind}")
    dataset = _load(path, name)
    if len(dataset) == 0:
        raise ConfigError(f"eval dataset '{name}' is empty: rebuild it from a file with conversations, or use "
                          "data.eval_fraction to hold out part of the training dataset")
    rows = np.arange(len(dataset), dtype=np.int64)
    longest = longest_sequence(dataset) if kind == PREFERENCE_KIND else int(np.max(int_column(dataset, "length")))
    if max_seq_length is not None and longest > max_seq_length:
        raise ConfigError(f"eval dataset '{name}' holds samples of up to {longest} tokens but "
                          f"fast_model_args.max_seq_length is {max_seq_length}: raise max_seq_length or rebuild it "
                          f"with `hypersloth-build-dataset ... --name {name} --max_seq_length {max_seq_length} --overwrite`")
    tokens, targets = _token_counts(dataset, rows, loss_type)
    _check_targets(targets, f"eval dataset '{name}'", loss_type)
    return EvalSet(source="dataset", dataset_name=name, dataset_path=str(path), num_rows=len(dataset),
                   tokens=tokens, target_tokens=targets, fingerprint=rows_fingerprint(dataset, rows),
                   unit=_unit(dataset.column_names))


def _unit(columns) -> str:
    """What a row of a built dataset with these columns is, as EvalSet.unit says it."""
    if set(PAIR_COLUMNS) <= set(columns):
        return "pairs"
    return "prompts" if "prompt_input_ids" in columns else "conversations"


def resolve_eval_set(hyper, *, seed: int, train_path: Path) -> EvalSet | None:
    """The eval set a config asks for (`data.eval_dataset_name` or `data.eval_fraction`), None without one.

    `hyper` is a HyperConfig; `seed` the run's data seed (it seeds the hold-out); `train_path` the training
    dataset's folder. ConfigError, saying what to change, when it cannot be evaluated.
    """
    data, loss_type = hyper.data, hyper.training.loss_type
    if data.eval_dataset_name:
        eval_data = data.model_copy(update={"dataset_name": data.eval_dataset_name})
        return resolve_eval_dataset(data.eval_dataset_name, eval_data.dataset_path().resolve(),
                                    eval_data.registry_entry(), model_name=hyper.fast_model_args.model_name,
                                    loss_type=loss_type, max_seq_length=hyper.fast_model_args.max_seq_length,
                                    method=hyper.training.method)
    if data.eval_fraction > 0:
        return resolve_holdout(data.dataset_name, Path(train_path), fraction=data.eval_fraction, seed=seed,
                               loss_type=loss_type)
    return None


def _check_targets(targets: int, what: str, loss_type: str) -> None:
    if targets == 0:
        raise ConfigError(f"{what} hold no token to score under loss_type='{loss_type}' (no assistant reply): "
                          "use conversations with assistant turns, or loss_type='all'")


def split_for_run(train_dataset, eval_set: EvalSet | None):
    """(training rows, eval rows or None) for a worker, from the resolved `EvalSet`.

    ConfigError when the dataset on disk no longer holds the rows that were resolved before launch.
    """
    if eval_set is None:
        return train_dataset, None
    if eval_set.source == "holdout":
        train, held = split_holdout(len(train_dataset), eval_set.fraction, eval_set.seed)
        evaluated, indices = train_dataset, held
    else:
        evaluated = _load(Path(eval_set.dataset_path), eval_set.dataset_name)
        train, indices = None, np.arange(len(evaluated), dtype=np.int64)
    if rows_fingerprint(evaluated, indices) != eval_set.fingerprint:
        raise ConfigError(f"dataset '{eval_set.dataset_name}' changed after the run was resolved (the evaluated "
                          "rows differ): start the run again")
    eval_rows = evaluated.select(indices) if eval_set.source == "holdout" else evaluated
    return (train_dataset if train is None else train_dataset.select(train)), eval_rows


def eval_plan_spec(train_spec: PlanSpec, num_rows: int) -> PlanSpec:
    """The training spec (mode, micro-batch budget, ranks, cost model) with eval-sized "steps".

    A step is only a unit of balancing here (the loss is a sum over all of them), so it holds many rows:
    fuller packed micro-batches, better balance. `train_spec` must be the one the workers resolved
    (e.g. after an "auto" token budget), so eval micro-batches never exceed what training fits.
    """
    per_chunk = max(train_spec.samples_per_step, EVAL_ROWS_PER_RANK_PER_CHUNK * train_spec.num_ranks)
    return replace(train_spec, samples_per_step=max(1, min(num_rows, per_chunk)), group_by_length=False)


def plan_eval(lengths: np.ndarray, trainable: np.ndarray, train_spec: PlanSpec) -> EpochPlan:
    """The eval plan: every eval row once, dealt to ranks like a training epoch (equal micro-batch counts)."""
    return adaptive_partition_batches(lengths, trainable, eval_plan_spec(train_spec, len(lengths)), epoch=0)


def training_rows(eval_set: EvalSet | None, num_rows: int) -> np.ndarray:
    """Indices of the training dataset's rows that are trained on: all but a hold-out's (sorted)."""
    if eval_set is None or eval_set.source != "holdout":
        return np.arange(num_rows, dtype=np.int64)
    return split_holdout(num_rows, eval_set.fraction, eval_set.seed)[0]


def eval_row_lengths(eval_set: EvalSet, loss_type: str) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, scored tokens) of the evaluated rows, in the order `split_for_run` gives them."""
    dataset = _load(Path(eval_set.dataset_path), eval_set.dataset_name)
    if eval_set.source == "holdout":
        rows = split_holdout(len(dataset), eval_set.fraction, eval_set.seed)[1]
    else:
        rows = np.arange(len(dataset), dtype=np.int64)
    return sample_token_counts(dataset, loss_type, rows)


def describe_eval_plan(eval_set: EvalSet, plan: EpochPlan) -> list[str]:
    """Lines for `hypersloth-plan`: the eval rows, and how one evaluation is dealt to the ranks."""
    st = plan.stats
    ranks = "  ".join(f"rank{r} {tokens:,}" for r, tokens in enumerate(st.rank_real_tokens))
    return [
        f"  eval set       {eval_set.describe()}",
        f"  eval plan      {st.micro_batches_per_rank} micro-batches per rank per evaluation (forward only, "
        f"the training budget); {st.empty_micro_batches} empty; tokens/rank {ranks}",
    ]
