"""Resolve a run once: (loaded config, registry entry, world size, machine facts) -> RunDescription.

The launcher resolves the run before any worker starts and writes it to `OUTPUT_DIR/run.json`; each
worker reads that file instead of executing the config again (`python -m HyperSloth.train.worker
OUTPUT_DIR/run.json`). Under torchrun every rank resolves the same description in-process
(deterministic: same file, same registry, same world size) and only rank 0 writes it. `hypersloth-plan`
and `--dry-run` use the same resolver, so the preview plans exactly what the workers will.

Every derived number (global batch, micro-batches per step, token budget) is computed here and only
here, and every problem found is collected and reported at once, saying what to change.
Torch-free: the caller counts the GPUs (`launch.devices.cuda_device_count`) and passes the number in.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from HyperSloth.config import (
    ConfigError,
    GrpoArgs,
    HyperConfig,
    LoadedConfig,
    TrainingArgsConfig,
    TrainingConfig,
    reward_name,
    runtime_problems,
)
from HyperSloth.outputs import checkpoints, run_files
from HyperSloth.plan.batching import int_column
from HyperSloth.plan.eval_set import EvalSet, resolve_eval_set
from HyperSloth.plan.pairs import PREFERENCE_KIND, REQUIRED_PAIR_COLUMNS, dataset_kind, kind_problem, longest_sequence
from HyperSloth.plan.prompts import PROMPT_KIND, REQUIRED_PROMPT_COLUMNS, grpo_problems, prompt_kind_problem
from HyperSloth.plan.trl_args import extra_args_problems, report_to_problems

REQUIRED_COLUMNS = ("input_ids", "labels", "length", "num_trainable")


def rebuild_command(entry: dict[str, Any], name: str, data_dir: str, max_seq_length: int | None = None) -> str:
    """The `hypersloth-build-dataset` command that builds `name` again from what its registry entry
    recorded (source, tokenizer, split, sample), replacing the registered one (--overwrite)."""
    source, tokenizer = entry.get("source"), entry.get("tokenizer")
    stats = entry.get("stats") if isinstance(entry.get("stats"), dict) else {}
    if source:
        flag = "--local_path" if Path(str(source)).exists() else "--hf_dataset"
        parts = [flag, shlex.quote(str(source))]
    else:
        parts = ["--local_path", "FILE_OR_DIR"]
    parts += ["--tokenizer", shlex.quote(str(tokenizer)) if tokenizer else "MODEL", "--name", shlex.quote(name),
              "--data_dir", shlex.quote(str(data_dir))]
    if entry.get("split") not in (None, "train"):
        parts += ["--split", shlex.quote(str(entry["split"]))]
    if stats.get("n"):
        parts += ["-n", str(stats["n"]), "--seed", str(stats.get("seed", 42))]
    for flag, default in (("overlength", "truncate"), ("history_rewrite", "split"), ("chat_template", None)):
        if stats.get(flag) not in (None, default):
            parts += [f"--{flag}", shlex.quote(str(stats[flag]))]
    length = max_seq_length or entry.get("max_seq_length")
    if length:
        parts += ["--max_seq_length", str(length)]
    return "hypersloth-build-dataset " + " ".join(parts) + " --overwrite"


def attention_coef(model_name: str) -> float | None:
    """The planner's cost-model coefficient c (load = L + c L^2 per sequence) for a local model folder.

    Per token and layer the linear layers cost 2 x P FLOP (P = weights of q, k, v, o and the gated MLP)
    and causal attention 2 x d_attn x L, so c = d_attn / P: about 1.3e-4 for Qwen3-0.6B, 2.1e-5 for
    Qwen3-8B. A multimodal model's config.json is read for its language model (`text_config`). None (the
    planner's default) when the model is not a local folder with a config.json: the preview and the trainer read
    the same file, so they always plan the same dealing.
    """
    path = Path(model_name).expanduser() / "config.json"
    try:
        cfg = json.loads(path.read_text())
        cfg = {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg
        d, ff = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        head_dim = int(cfg.get("head_dim") or d // int(cfg["num_attention_heads"]))
        attn = int(cfg["num_attention_heads"]) * head_dim
        kv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) * head_dim
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return attn / (d * (attn + 2 * kv) + attn * d + 3 * d * ff)


@dataclass(frozen=True)
class MachineFacts:
    """What the machine offers; `detect(n)` fills in the rest for n GPUs, tests pass numbers."""

    cuda_device_count: int
    unsloth_available: bool
    cpu_count: int

    @classmethod
    def detect(cls, cuda_device_count: int) -> MachineFacts:
        """This machine with `cuda_device_count` GPUs (counted by the launcher: this module imports no torch)."""
        # The affinity mask is what this process may use (containers, taskset); cpu_count is the host's.
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return cls(cuda_device_count, importlib.util.find_spec("unsloth") is not None, cpus)

    @classmethod
    def assumed_for(cls, hyper: HyperConfig) -> MachineFacts:
        """The machine a config asks for (its GPUs present, Unsloth installed): what a plan preview on a
        laptop resolves against, without importing torch."""
        return cls(max(hyper.training.gpus) + 1, True, os.cpu_count() or 1)


class DatasetFacts(BaseModel):
    """The built dataset a run trains on, as found on disk before any worker starts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    path: str = Field(description="Absolute path of the save_to_disk folder.")
    columns: tuple[str, ...]
    num_samples: int
    built_max_length: int = Field(description="Longest sample in tokens (the registry's stats.max_tokens); "
                                  "preference pairs: the longest prompt + completion.")
    kind: Literal["sft", "preference", "prompt"] = Field(
        "sft", description="Chats, preference pairs (docs/dpo.md) or prompts (docs/grpo.md).")
    fingerprint: str = Field(description="Identifies the built data: a resume must train on the same.")


class RunDescription(BaseModel):
    """Everything a worker needs to train, resolved and validated once (written as run.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[2] = 2
    config_path: str
    world_size: int = Field(gt=0, description="Worker processes (launcher: len(gpus); torchrun: WORLD_SIZE).")
    gpus: tuple[int, ...]
    device: Literal["cuda", "cpu"]
    backend: Literal["unsloth", "transformers"]
    dtype: Literal["bfloat16", "float16", "float32"]
    batching: Literal["packed", "sorted-pad"]
    batching_from_config: bool = Field(
        False, description="training.batching was set in the config (not the default): a packed SFT run whose model "
        "lets packed samples see each other is then refused rather than switched to sorted-pad (worker.py).")
    loss_type: Literal["all", "response_only"]
    method: Literal["sft", "dpo", "grpo"] = Field("sft", description="training.method: the loss and the dataset kind.")
    dpo_beta: float | None = Field(None, description="training.dpo_beta of a DPO run; None for SFT.")
    grpo: GrpoArgs | None = Field(None, description="training.grpo of a GRPO run (what its workers sample and "
                                  "train with); None for SFT and DPO.")
    reward_funcs: tuple[str, ...] = Field(
        (), description="GRPO: the names of the config file's reward_funcs, which each worker loads from it again "
        "(config.load_reward_funcs) and checks against these.")
    micro_batch_size: int = Field(gt=0, description="per_device_train_batch_size.")
    samples_per_rank_per_step: int = Field(gt=0, description="per_device_train_batch_size x gradient_accumulation_steps.")
    global_batch_size: int = Field(gt=0, description="Samples per optimizer step over all workers.")
    micro_batches_per_step: int | None = Field(
        description="Micro-batches per rank per step: sorted-pad = gradient_accumulation_steps; packed = None "
        "(as many as the token budget needs)."
    )
    token_budget: int = Field(gt=0, description="Packed mode: most tokens in one micro-batch.")
    token_budget_source: Literal["explicit", "auto-cpu", "auto"] = Field(
        description="Where token_budget comes from: tokens_per_micro_batch as given; 'auto' on CPU "
        "(per_device_train_batch_size x max_seq_length); 'auto' on a GPU: that product is only the preview's "
        "stand-in until each worker measures its GPU and all plan with the minimum over ranks "
        "(HyperSloth.train.budget.settle.settle replaces it).")
    gradient_checkpointing: bool | Literal["unsloth"] = Field(
        description="The checkpointing training runs with: fast_model_args.use_gradient_checkpointing, switched "
        "on by HyperSloth.train.budget.settle.settle when the longest sample fits a micro-batch only with it.")
    tiled_mlp: bool | Literal["auto"] = Field(
        False, description="Unsloth's tiled MLP: fast_model_args.tiled_mlp; 'auto' is settled by "
        "HyperSloth.train.budget.settle.settle (True when the longest sample fits only with it).")
    group_by_length: bool
    group_window_steps: int
    nccl_timeout_s: int = Field(gt=0, description="Seconds a collective may wait before the run aborts.")
    profile: bool = Field(description="Per-phase step timing (a CUDA sync between phases).")
    cuda_graphs: bool = Field(description="Replay packed rows' decoder passes from CUDA graphs where possible.")
    lora_passes: bool = Field(True, description="HyperSloth's LoRA projections in place of Unsloth's where possible.")
    expert_lora: Literal["auto", "grouped", "library"] = Field(
        "auto", description="How MoE expert adapters run (training.expert_lora).")
    eval_steps: int | None = Field(description="Evaluate every N steps (and after the last); None = at the end only.")
    early_stopping_patience: int | None
    save_best_adapter: bool
    max_seq_length: int
    attention_coef: float | None = Field(description="Planner cost-model coefficient (None = planner default).")
    seed: int
    dataset: DatasetFacts
    eval_set: EvalSet | None = Field(None, description="The evaluated rows (a hold-out or another dataset); None = no eval.")
    output_dir: str = Field(description="Absolute output folder.")
    resume_from_checkpoint: str | None = Field(
        description="The verified checkpoint folder to resume from ('latest' resolved to one), None = a new run.")
    resume_notes: tuple[str, ...] = Field(
        (), description="What the launcher said about the resume: which checkpoint 'latest' chose and the broken "
        "ones skipped; a warning for a checkpoint without manifest. Rank 0 logs them too.")
    # The validated config, for the record (hypersloth_config.json), for loading the model (fast_model_args,
    # lora_args) and as TRL's pass-through arguments; every value HyperSloth itself acts on is a field above.
    hyper_config: HyperConfig
    training_config: TrainingArgsConfig

    @property
    def samples_per_step(self) -> int:
        return self.global_batch_size

    def with_batching(self, batching: str) -> "RunDescription":
        """The same run with `batching` ("packed" or "sorted-pad"): the same samples per step, cut otherwise."""
        accumulation = self.samples_per_rank_per_step // self.micro_batch_size
        return self.model_copy(update={"batching": batching, **batch_numbers(
            self.micro_batch_size, accumulation, self.world_size, batching)})

    @property
    def token_budget_auto(self) -> bool:
        """token_budget is a stand-in that the workers replace by the budget they measure."""
        return self.token_budget_source == "auto"

    def resolved_config(self) -> dict[str, Any]:
        """The config part, in the layout of hypersloth_config.json (export reads it)."""
        config = json.loads(self.model_dump_json(include={"hyper_config", "training_config"}))
        return {"source_path": self.config_path, **config}

    def batch_line(self) -> str:
        """The derived batch numbers in one line, like torchtitan's start-up log."""
        budget = "an automatic budget (measured at start)" if self.token_budget_auto else f"{self.token_budget:,} tokens"
        per_step = (f"packed into micro-batches of <= {budget}"
                    if self.micro_batches_per_step is None else
                    f"{self.micro_batches_per_step} micro-batch{'es' if self.micro_batches_per_step != 1 else ''}")
        unit = {"dpo": "pairs", "grpo": "completions"}.get(self.method, "samples")
        method = f"; DPO, beta {self.dpo_beta}" if self.method == "dpo" else ""
        if self.grpo is not None:
            grpo = self.grpo
            method = (f"; GRPO, {self.global_batch_size // grpo.num_generations} prompts x {grpo.num_generations} "
                      f"generations, rewards {', '.join(self.reward_funcs)}")
        batching = f"{self.batching} batching"
        if self.batching == "packed" and self.method == "sft" and not self.batching_from_config:
            batching += " (sorted-pad if the model's packed rows leak: checked at load)"
        return (f"world size {self.world_size}, micro-batch {self.micro_batch_size} {unit}, "
                f"{self.samples_per_rank_per_step} {unit} per rank per step ({per_step}), "
                f"global batch {self.global_batch_size} {unit} per optimizer step; {batching}, "
                f"{self.backend} {self.dtype} on {self.device}{method}")

    def planning_key(self) -> dict[str, Any]:
        """What decides which samples form each optimizer step: a resume must match it exactly."""
        return {
            "method": self.method,
            "samples per step": self.global_batch_size,
            "seed": self.seed,
            "planning mode": f"{self.batching}, group_by_length={self.group_by_length}, "
                             f"group_window_steps={self.group_window_steps}",
            "dataset fingerprint": self.dataset.fingerprint,
            # A hold-out removes rows from training: another hold-out plans other steps.
            "held-out rows": self.eval_set.fingerprint if self.eval_set and self.eval_set.source == "holdout" else None,
        }


# ---------------------------------------------------------------------------------------------
# Resolving
# ---------------------------------------------------------------------------------------------
def token_budget(training: TrainingConfig, per_device: int, max_seq_length: int, cuda: bool) -> dict[str, Any]:
    """The one place tokens_per_micro_batch is resolved: a number stays; "auto" is per_device x max_seq_length
    on CPU, and on a GPU the same product as a stand-in that the workers replace by what they measure."""
    if training.tokens_per_micro_batch != "auto":
        return {"token_budget": training.tokens_per_micro_batch, "token_budget_source": "explicit"}
    return {"token_budget": per_device * max_seq_length, "token_budget_source": "auto" if cuda else "auto-cpu"}


def batch_numbers(per_device: int, accumulation: int, world_size: int, batching: str) -> dict[str, Any]:
    """The one place the batch sizes are derived from the config and the world size."""
    per_rank = per_device * accumulation
    return {
        "micro_batch_size": per_device,
        "samples_per_rank_per_step": per_rank,
        "global_batch_size": per_rank * world_size,
        "micro_batches_per_step": accumulation if batching == "sorted-pad" else None,
    }


def _read_json(path: Path) -> dict[str, Any]:
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def dataset_fingerprint(folder: Path) -> str:
    """A short hash of the save_to_disk folder's own fingerprint, its file names and sizes."""
    state = _read_json(folder / "state.json")
    files = sorted((p.name, p.stat().st_size) for p in folder.glob("*.arrow"))
    text = json.dumps({"fingerprint": state.get("_fingerprint"), "files": files})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _built_max_length(folder: Path, entry: dict[str, Any]) -> int:
    """The longest sequence: the registry's stats.max_tokens (over sequences, also for preference pairs)."""
    stats = entry.get("stats") if isinstance(entry.get("stats"), dict) else {}
    if isinstance(stats.get("max_tokens"), int):
        return int(stats["max_tokens"])
    import datasets  # a registry written without stats: read the columns (slower)

    dataset = datasets.load_from_disk(str(folder))
    if dataset_kind(entry) == PREFERENCE_KIND:
        return longest_sequence(dataset)  # a pair's `length` holds two sequences
    return int(np.max(int_column(dataset, "length")))


def dataset_facts(hyper: HyperConfig, problems: list[str]) -> DatasetFacts | None:
    """Find the registered dataset and describe it; appends what is wrong to `problems`."""
    data, name = hyper.data, hyper.data.dataset_name
    try:
        entry = data.registry_entry()
    except ConfigError as err:
        problems.append(str(err))
        return None
    folder = data.dataset_path().resolve()
    info = _read_json(folder / "dataset_info.json")
    rebuild = rebuild_command(entry, name, data.data_dir)
    if not folder.is_dir() or not info:
        problems.append(f"dataset '{name}' is registered but its folder {folder} is missing or incomplete: "
                        f"rebuild it with `{rebuild}`")
        return None
    kind = dataset_kind(entry)
    problem = prompt_kind_problem(kind, hyper.training.method, name) or kind_problem(kind, hyper.training.method, name)
    if problem:
        problems.append(problem)
        return None
    columns = tuple((info.get("features") or {}).keys())
    required = {PREFERENCE_KIND: REQUIRED_PAIR_COLUMNS, PROMPT_KIND: REQUIRED_PROMPT_COLUMNS}.get(kind, REQUIRED_COLUMNS)
    missing = [c for c in required if c not in columns]
    if missing:
        problems.append(f"dataset '{name}' ({folder}) has no column(s) {missing}: rebuild it with `{rebuild}`")
        return None
    facts = DatasetFacts(name=name, path=str(folder), columns=columns, num_samples=int(entry.get("num_samples", 0)),
                         built_max_length=_built_max_length(folder, entry), kind=kind,
                         fingerprint=dataset_fingerprint(folder))
    if facts.built_max_length > hyper.fast_model_args.max_seq_length:
        length = hyper.fast_model_args.max_seq_length
        problems.append(
            f"dataset '{name}' holds samples of up to {facts.built_max_length} tokens but "
            f"fast_model_args.max_seq_length is {length}: set max_seq_length >= {facts.built_max_length}, "
            f"or rebuild the dataset with `{rebuild_command(entry, name, data.data_dir, length)}`")
    return facts


def _json_problem(training_args: TrainingArgsConfig) -> str | None:
    try:
        json.dumps(training_args.extra_args)
    except (TypeError, ValueError) as err:
        return f"extra_args must hold JSON values (numbers, strings, lists, dicts): {err}"
    return None


def _eval_set(hyper: HyperConfig, targs: TrainingArgsConfig, facts: DatasetFacts | None,
              problems: list[str]) -> EvalSet | None:
    """The eval set the config asks for (None without one: HyperSloth.plan.eval_set); appends what is wrong."""
    data = hyper.data
    if data.eval_fraction == 0 and data.eval_dataset_name is None:
        if targs.eval_steps or targs.early_stopping_patience:
            problems.append("eval_steps / early_stopping_patience need an eval set: set data.eval_fraction "
                            "(e.g. 0.05) or data.eval_dataset_name, or remove them")
        return None
    if targs.early_stopping_patience and not targs.eval_steps:
        problems.append("early_stopping_patience needs evaluations during training: set eval_steps (e.g. 50)")
    try:
        return None if facts is None else resolve_eval_set(hyper, seed=targs.seed, train_path=Path(facts.path))
    except ConfigError as err:
        problems.append(str(err))
        return None


def resolve_run(loaded: LoadedConfig, *, world_size: int, machine: MachineFacts,
                problems: Sequence[str] = ()) -> RunDescription:
    """The run description of `loaded` on `world_size` workers of `machine`; one ConfigError listing every
    problem (config vs machine, dataset, lengths, resume, and the caller's own `problems`, e.g. the
    launcher's model and output-folder checks) otherwise."""
    hyper, targs = loaded.hyper, loaded.training_args
    fast, training = hyper.fast_model_args, hyper.training
    cuda = machine.cuda_device_count > 0
    problems = [*problems, *runtime_problems(hyper, targs, cuda_device_count=machine.cuda_device_count,
                                             unsloth_available=machine.unsloth_available)]
    problems += [*extra_args_problems(targs.extra_args), *report_to_problems(targs.report_to)]
    facts = dataset_facts(hyper, problems)
    problems.append(_json_problem(targs))
    eval_set = _eval_set(hyper, targs, facts, problems)
    if training.method == "grpo":
        global_batch = batch_numbers(targs.per_device_train_batch_size, targs.gradient_accumulation_steps, world_size,
                                     training.batching)["global_batch_size"]
        problems += grpo_problems(training.grpo, global_batch, facts.built_max_length if facts else None,
                                  fast.max_seq_length)
    problems = [p for p in problems if p]
    if problems:
        listed = f" {problems[0]}" if len(problems) == 1 else "".join(f"\n  - {p}" for p in problems)
        raise ConfigError(f"{loaded.path}: cannot run this config:{listed}")
    try:
        resume, resume_notes = resolve_resume(targs.resume_from_checkpoint, Path(targs.output_dir).resolve())
    except ConfigError as err:
        raise ConfigError(f"{loaded.path}: {err}") from None
    description = RunDescription(
        config_path=str(loaded.path),
        world_size=world_size,
        gpus=tuple(training.gpus),
        device="cuda" if cuda else "cpu",
        backend=fast.resolved_backend(cuda_available=cuda, unsloth_available=machine.unsloth_available),
        dtype=fast.resolved_dtype(cuda_available=cuda),
        batching=training.batching,
        batching_from_config="batching" in training.model_fields_set,
        loss_type=training.loss_type,
        method=training.method,
        dpo_beta=training.dpo_beta if training.method == "dpo" else None,
        grpo=training.grpo if training.method == "grpo" else None,
        reward_funcs=tuple(reward_name(f) for f in loaded.reward_funcs),
        **batch_numbers(targs.per_device_train_batch_size, targs.gradient_accumulation_steps, world_size,
                        training.batching),
        **token_budget(training, targs.per_device_train_batch_size, fast.max_seq_length, cuda),
        gradient_checkpointing=fast.use_gradient_checkpointing,
        tiled_mlp=fast.tiled_mlp,
        group_by_length=training.group_by_length,
        group_window_steps=training.group_window_steps,
        nccl_timeout_s=training.nccl_timeout_s,
        profile=training.profile,
        cuda_graphs=training.cuda_graphs,
        lora_passes=training.lora_passes,
        expert_lora=training.expert_lora,
        eval_steps=targs.eval_steps,
        early_stopping_patience=targs.early_stopping_patience,
        save_best_adapter=targs.save_best_adapter,
        max_seq_length=fast.max_seq_length,
        attention_coef=attention_coef(fast.model_name),
        seed=targs.seed,
        dataset=facts,
        eval_set=eval_set,
        output_dir=str(Path(targs.output_dir).resolve()),
        resume_from_checkpoint=resume,
        resume_notes=resume_notes,
        hyper_config=hyper,
        training_config=targs,
    )
    resume_problem = check_resume(description)
    if resume_problem:
        raise ConfigError(f"{loaded.path}: {resume_problem}")
    return description


# ---------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------
def _not_a_folder(checkpoint: str) -> str:
    return (f"resume_from_checkpoint={checkpoint!r} is not a folder: give a checkpoint-N folder of an earlier "
            f"run, {checkpoints.LATEST!r} (the newest complete one of output_dir), or None (a new run)")


def resolve_resume(requested: str | None, output_dir: Path) -> tuple[str | None, tuple[str, ...]]:
    """The verified checkpoint folder a run resumes from (`requested`, or for "latest" the newest complete
    checkpoint of `output_dir`) and the notes to show about it; ConfigError naming what is broken and the
    checkpoint to use instead. Reads only: a refused resume writes nothing."""
    if requested is None:
        return None, ()
    if requested == checkpoints.LATEST:
        latest = checkpoints.find_latest(output_dir)
        if latest.chosen is None:
            raise ConfigError(latest.none_message())
        return str(latest.chosen.path.resolve()), latest.notes()
    folder = Path(requested).resolve()
    if not folder.is_dir():
        raise ConfigError(_not_a_folder(requested))
    check = checkpoints.verify(folder)
    if not check.ok:
        raise ConfigError(checkpoints.resume_problem(check))
    return str(folder), (checkpoints.legacy_note(check),) if check.legacy else ()


def check_resume(description: RunDescription) -> str | None:
    """None when there is nothing to resume or the checkpoint was planned like this run; otherwise what
    differs and what to change. A checkpoint without run.json (older HyperSloth) is not checked."""
    checkpoint = description.resume_from_checkpoint
    if checkpoint is None:
        return None
    folder = Path(checkpoint)
    if not folder.is_dir():
        return _not_a_folder(checkpoint)
    saved_file = run_files.run_file(folder)
    if not saved_file.is_file():
        return None
    try:
        saved = read_run(saved_file)
    except ConfigError as err:
        return f"cannot check the checkpoint to resume: {err}"
    if not (saved.batching_from_config or description.batching_from_config):
        # Both left batching unset: the checkpoint's workers may have trained sorted-pad on a model whose packed rows
        # leak (train/worker.py), and this run's workers, on the same model, will do the same.
        saved = saved.with_batching(description.batching)
    ours, theirs = description.planning_key(), saved.planning_key()
    diffs = [f"{key} {theirs[key]} -> {ours[key]}" for key in ours if ours[key] != theirs[key]]
    if not diffs:
        return None
    return (f"cannot resume from {checkpoint}: this run would plan different steps than the checkpoint's run "
            f"({'; '.join(diffs)}), so samples would be repeated or skipped. Resume with the checkpoint's "
            "settings (samples per step = per_device_train_batch_size x gradient_accumulation_steps x GPUs, "
            "seed, batching, data), or start a new run without resume_from_checkpoint")


# ---------------------------------------------------------------------------------------------
# run.json
# ---------------------------------------------------------------------------------------------
def write_run(description: RunDescription, path: str | os.PathLike | None = None) -> Path:
    """Write the description atomically (default OUTPUT_DIR/run.json); returns the path."""
    target = Path(path) if path is not None else run_files.run_file(description.output_dir)
    return run_files.atomic_write_text(target, description.model_dump_json(indent=2) + "\n")


def read_run(path: str | os.PathLike) -> RunDescription:
    """Load a run.json; ConfigError saying what is wrong."""
    path = Path(path)
    try:
        return RunDescription.model_validate_json(path.read_text())
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the run description ({err.strerror}); start runs with "
                          "`hypersloth-train CONFIG`") from None
    except ValidationError as err:
        raise ConfigError(f"{path}: not a run description of this HyperSloth version ({err.error_count()} "
                          "problem(s)); start the run again with `hypersloth-train CONFIG`") from None


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s RNG stream (dropout): rank 0 keeps `seed` (a 1-worker run is a plain HF
    run); other ranks get independent streams derived from (seed, rank), so same-shaped micro-batches
    on different ranks do not share dropout masks."""
    if rank == 0:
        return seed
    return int(np.random.SeedSequence([seed % 2**32, rank]).generate_state(1)[0])
