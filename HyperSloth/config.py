"""HyperSloth configuration: pydantic models, the Python config-file loader and pre-launch checks.

A config file is plain Python that defines `hyper_config_model` (HyperConfig) and optionally
`training_config_model` (TrainingArgsConfig), or the dicts `hyper_config` / `training_config`.
Every user mistake surfaces as one `ConfigError` whose message says what to change.

This module imports nothing else from HyperSloth and never imports torch: the launcher and the
CLIs validate a config before any heavy library is loaded.
"""

from __future__ import annotations

import difflib
import importlib.util
import itertools
import json
import math
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

REGISTRY_FILE = "data_config.json"
REGISTRY_VERSION = 1
_MODULE_COUNTER = itertools.count()


class ConfigError(Exception):
    """The single error type users see for a bad or unrunnable config."""


class FastModelArgs(BaseModel):
    """How to load the base model (Unsloth `FastLanguageModel` or transformers)."""

    # protected_namespaces=(): 'model_name' is a field here, not pydantic's model_* API.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_name: str = Field(description="Hub id or local folder of the base model, e.g. 'unsloth/Qwen3-0.6B'.")
    max_seq_length: int = Field(2048, gt=0, description="Longest sequence in tokens; longer samples are cut.")
    load_in_4bit: bool = Field(False, description="Load weights in 4-bit (QLoRA; needs CUDA + bitsandbytes).")
    load_in_8bit: bool = Field(False, description="Load weights in 8-bit (needs CUDA + bitsandbytes).")
    full_finetuning: bool = Field(
        False, description="Train every weight. Set by HyperConfig when lora_args=None; prefer that spelling."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Compute dtype; 'auto' = bfloat16 on CUDA, float32 on CPU."
    )
    backend: Literal["auto", "unsloth", "transformers"] = Field(
        "auto", description="'auto' = unsloth when CUDA is present and unsloth imports, else transformers+PEFT."
    )
    attn_implementation: str | None = Field(
        None, description="Attention kernel for the transformers backend only; None = transformers' choice: 'sdpa' "
        "where the model supports it, else 'eager' (gpt-oss)."
    )
    trust_remote_code: bool = Field(
        False, description="Run Python code that comes with the model on the Hub (custom architectures). Only "
        "for models whose code you trust: it runs with your rights.",
    )
    use_gradient_checkpointing: bool | Literal["unsloth"] = Field(
        False, description="Recompute activations in backward to save memory; 'unsloth' = Unsloth's offloaded variant. "
        "SFT on Unsloth keeps each layer's attention output for the recompute in the memory the measured token budget "
        "leaves (one 262,144-token sample of Qwen3-0.6B: 51.9 s against 64.2 s; docs/attention.md says how to "
        "recompute it instead)."
    )
    tiled_mlp: bool | Literal["auto"] = Field(
        "auto", description="Run each MLP in row tiles (Unsloth's tiled MLP; Unsloth backend only): less activation "
        "memory per token of a long row (Qwen3-8B 4-bit, 151,809 tokens with checkpointing: peak 30.6 -> 25.1 GiB, "
        "same step time). 'auto' = on only when tokens_per_micro_batch is 'auto' and the longest sample does not "
        "fit with gradient checkpointing alone (measured at start).",
    )
    attention: Literal["auto", "fa4", "flash", "sdpa"] = Field(
        "auto", description="The attention kernel of packed rows: 'fa4' = FlashAttention-4 (pip install -e .[fa4]; "
        "SM90/SM100 GPUs, compiled at first use) through torch's flash ops; 'flash' = torch's bundled flash kernels; "
        "'sdpa' = torch's SDPA dispatch as is. 'auto' = FA4 where it runs (installed, GPU, head dims) and the "
        "decoder replays CUDA graphs or samples are long, and each worker's check at start finds it agreeing with "
        "bundled flash on the model's heads and >= 5% faster on this GPU, else 'flash'; 'sdpa' without CUDA or on "
        "the transformers backend. The worker logs which and why (HyperSloth.train.attention.setting).",
    )

    @field_validator("model_name")
    @classmethod
    def _model_name_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("model_name is empty: give a Hub id (e.g. 'unsloth/Qwen3-0.6B') or a local folder")
        return value

    @model_validator(mode="after")
    def _one_quantisation(self) -> FastModelArgs:
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit are both True: choose one (or neither)")
        return self

    def resolved_backend(self, *, cuda_available: bool, unsloth_available: bool) -> str:
        """The backend 'auto' stands for on a machine with these facts."""
        if self.backend != "auto":
            return self.backend
        return "unsloth" if cuda_available and unsloth_available else "transformers"

    def resolved_dtype(self, *, cuda_available: bool) -> str:
        """The dtype 'auto' stands for: bfloat16 on CUDA, float32 on CPU."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if cuda_available else "float32"


class LoraArgs(BaseModel):
    """LoRA adapter settings (PEFT `LoraConfig` / Unsloth `get_peft_model`)."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(8, gt=0, description="Adapter rank: more = more trainable parameters.")
    lora_alpha: int = Field(8, gt=0, description="Scale numerator: the update is multiplied by lora_alpha / r.")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input, in [0, 1).")
    target_modules: list[str] | None = Field(
        None, min_length=1,
        description="Names of the layers that get adapters. Unset (the default): read from the model, every linear "
        "projection of the decoder (fused ones such as Phi-3's qkv_proj too) and the experts of a mixture-of-experts "
        "layer, never the LM head, the embeddings or the router. A list is checked against the model; on an MoE "
        "model gate_proj / up_proj / down_proj also select the experts' fused tensors, as in Unsloth.",
    )
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases to train.")
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA: scale by lora_alpha / sqrt(r).")
    random_state: int = Field(3407, description="Seed for the adapter's initial weights.")
    init_adapter_path: str | None = Field(
        None, description="Folder of a saved LoRA adapter to continue training from (its r/targets win)."
    )


def read_registry(data_dir: str | os.PathLike) -> dict[str, Any]:
    """The whole registry `{data_dir}/data_config.json` (`{"version": 1, "datasets": {...}}`), or an empty
    one when there is no file; ConfigError when the file is not a registry. The one reader: the data
    package's `registry.read_registry` wraps it."""
    path = Path(data_dir) / REGISTRY_FILE
    if not path.exists():
        return {"version": REGISTRY_VERSION, "datasets": {}}
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not readable JSON ({err}); fix or delete it") from None
    if not isinstance(content, dict) or not isinstance(content.get("datasets"), dict):
        raise ConfigError(f"{path} has no 'datasets' mapping; fix or delete it")
    return content


class DataConfig(BaseModel):
    """Which built dataset to train on, by its registered name."""

    model_config = ConfigDict(extra="forbid")

    dataset_name: str = Field(description="Name given to `hypersloth-build-dataset --name`.")
    data_dir: str = Field(
        "data", description="Folder holding data_config.json and built_dataset/; relative to the working directory."
    )
    eval_dataset_name: str | None = Field(
        None, description="Evaluate on this other registered dataset (built with the model's tokenizer)."
    )
    eval_fraction: float = Field(
        0.0, description="Hold out this share of the conversations, in [0, 0.5], for evaluation (seeded by "
        "TrainingArgsConfig.seed; never trained on). 0 = no hold-out.",
    )

    @field_validator("dataset_name")
    @classmethod
    def _name_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("dataset_name is empty: give the name used with `hypersloth-build-dataset --name`")
        return value

    @field_validator("eval_fraction")
    @classmethod
    def _eval_fraction_in_range(cls, value: float) -> float:
        # [0, 0.5]: beyond half, the "hold-out" would be larger than what is trained on.
        if not 0.0 <= value <= 0.5:
            raise ValueError(f"eval_fraction must be in [0, 0.5] (the share of conversations held out for "
                             f"evaluation), got {value}: e.g. eval_fraction=0.05, or 0 for no hold-out")
        return value

    @model_validator(mode="after")
    def _one_eval_set(self) -> DataConfig:
        if self.eval_dataset_name is not None and self.eval_fraction > 0:
            raise ValueError("eval_dataset_name and eval_fraction are both set: evaluate on the other dataset "
                             "(eval_fraction=0) or on a hold-out of this one (eval_dataset_name=None)")
        return self

    @classmethod
    def from_dataset_name(cls, name: str, data_dir: str = "data") -> DataConfig:
        """Build a DataConfig after checking that `name` is registered in `data_dir`."""
        config = cls(dataset_name=name, data_dir=data_dir)
        config.registry_entry()
        return config

    def registry_entry(self) -> dict[str, Any]:
        """The registry record of this dataset; ConfigError listing the known names if absent."""
        registry = Path(self.data_dir) / REGISTRY_FILE
        if not registry.is_file():
            raise ConfigError(
                f"no dataset registry at {registry}: build a dataset first with `hypersloth-build-dataset "
                "--local_path FILE_OR_DIR --tokenizer MODEL --name NAME`, or set data_dir to the folder that holds "
                "data_config.json"
            )
        datasets = read_registry(self.data_dir)["datasets"]
        if self.dataset_name not in datasets:
            known = ", ".join(sorted(datasets)) or "(none)"
            close = difflib.get_close_matches(self.dataset_name, list(datasets), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'? If not, " if close else ""
            raise ConfigError(
                f"dataset '{self.dataset_name}' is not registered in {Path(self.data_dir) / REGISTRY_FILE} "
                f"(registered: {known}); {hint}build it with `hypersloth-build-dataset --local_path FILE_OR_DIR --tokenizer MODEL --name {self.dataset_name}`"
            )
        return datasets[self.dataset_name]

    def dataset_path(self) -> Path:
        """Folder of the built dataset: the entry's path, resolved against data_dir unless absolute."""
        path = Path(self.registry_entry()["path"])
        return path if path.is_absolute() else Path(self.data_dir) / path


class GrpoArgs(BaseModel):
    """GRPO's settings (method='grpo'), with TRL's `GRPOConfig` names, meanings and defaults (docs/grpo.md).

    The global batch is TRL's: per_device_train_batch_size x gradient_accumulation_steps x len(gpus) counts
    completions, so an optimizer step trains on that many / num_generations prompts, each with num_generations
    completions (all on one rank)."""

    model_config = ConfigDict(extra="forbid")

    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (its group), >= 2: the "
                                 "advantage of a completion is its reward against its group's.")
    max_completion_length: int = Field(512, gt=0, description="Longest completion in tokens (longer ones are cut: "
                                       "'clipped'). prompt + completion must fit fast_model_args.max_seq_length.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; the loss's log-probabilities use the "
                               "same (as TRL's).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: keep the smallest set of tokens of this "
                         "cumulative probability; 1 = all.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens when sampling; 0 = all.")
    beta: float = Field(0.0, ge=0, description="KL coefficient against the reference (the model with the adapter "
                        "switched off, or the initial adapter); 0 (TRL's default) computes no reference.")
    epsilon: float = Field(0.2, gt=0, description="Clipping of the probability ratio: [1 - epsilon, 1 + epsilon_high].")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clip; None = epsilon (DAPO recommends 0.28).")
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = Field(
        "dapo", description="How token losses are summed into the step's loss (TRL's names; 'dapo', TRL 1.15's "
        "default: over every completion token of the global batch; 'grpo': per completion, then over completions; "
        "'dr_grpo': over the global batch's completions x max_completion_length).",
    )
    scale_rewards: Literal["group", "batch", "none"] | bool = Field(
        "group", description="Divide advantages by the std of the group's rewards ('group', True), of the global "
        "batch's ('batch'), or not at all ('none', False).",
    )
    num_iterations: int = Field(1, ge=1, description="Optimizer steps per generated batch (TRL's mu); > 1 keeps "
                                "the generation's log-probabilities as the ratio's denominator.")
    reward_weights: list[float] | None = Field(None, description="One weight per reward function (reward_funcs in "
                                               "the config file); None = 1.0 each.")
    generation_batch: Literal["rank", "prompt"] = Field(
        "rank", description="HyperSloth's: 'rank' samples all of a GPU's prompts in one generate call (fast; 1 and N "
        "GPUs sample the same completions up to the rounding a different batch brings, which can flip a rare token "
        "in bf16); 'prompt' one call per prompt (slower; bit for bit the same on any number of GPUs).")
    sampling_weights: Literal["merged", "adapter"] = Field(
        "merged", description="HyperSloth's: 'merged' samples on W + scale * B A (each adapted weight merged for the "
        "sampling call, the adapter off, every weight put back bit for bit after: the decode without the adapter's "
        "GEMMs), where the base weights are 16/32-bit and the copies fit, else with the adapter (one log line says "
        "why); 'adapter' always samples through the adapter. The policy is the same up to the merged weight's "
        "rounding (docs/grpo.md).")

    @property
    def scale(self) -> str:
        """scale_rewards as TRL normalises it: True -> 'group', False -> 'none'."""
        return {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)  # type: ignore[arg-type]


class TrainingConfig(BaseModel):
    """How HyperSloth spreads the work: processes, loss masking and batching."""

    model_config = ConfigDict(extra="forbid")

    gpus: list[int] = Field(
        default_factory=lambda: [0],
        description="GPU ids, one process each (any ids, e.g. [2, 3]); on CPU the length = number of worker processes.",
    )
    loss_type: Literal["all", "response_only"] = Field(
        "response_only", description="'response_only' trains on assistant tokens only; 'all' on every token."
    )
    batching: Literal["packed", "sorted-pad"] = Field(
        "packed", description="'packed' concatenates samples per row (no padding); 'sorted-pad' pads length-sorted "
        "rows. Left unset, an SFT run whose model cannot keep packed samples apart (checked at start) trains "
        "sorted-pad; set, such a run is refused."
    )
    tokens_per_micro_batch: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description="Packed mode: most tokens in one micro-batch. 'auto' = on a GPU, the largest that fits this "
        "GPU's free memory, measured at start for this model and settings (HyperSloth.train.budget.settle); on CPU, "
        "per_device_train_batch_size * max_seq_length. A number overrides it.",
    )
    group_by_length: bool = Field(False, description="Group similar lengths into the same optimizer steps.")
    group_window_steps: int = Field(64, gt=0, description="How many steps one length-grouping window spans.")
    nccl_timeout_s: int = Field(1800, gt=0, description="Seconds a collective may wait before the run aborts.")
    profile: bool = Field(
        False,
        description="Time data, forward, backward, all-reduce, clip and optimizer per step (adds a CUDA sync "
        "between phases; for finding bottlenecks), and run torch.profiler over steps 4-6 (GRPO: step 4, whose sampling "
        "alone is tens of thousands of launches; no phase syncs there): "
        "the breakdown and the GPU's busy time against the wall land in train_summary.json, the operator tables "
        "and a Chrome/Perfetto trace with Python stacks in each rank's files in the run's logs folder "
        "(profile_kernels.txt, profile_trace.json.gz).",
    )
    cuda_graphs: bool = Field(
        True,
        description="Replay the decoder's forward and backward of packed rows from CUDA graphs, one per row "
        "length (Unsloth backend on a GPU, LoRA without dropout, no checkpointing; otherwise eager, with one "
        "log line saying why). Same loss and gradients; fewer kernel launches (HyperSloth.train.step_graph).",
    )
    lora_passes: bool = Field(
        True,
        description="Compute Unsloth's LoRA projections (QKV, O, SwiGLU MLP) without the separate pass that adds "
        "the low-rank product onto each full-size output (HyperSloth.train.lora.passes; Unsloth backend, plain "
        "LoRA; otherwise Unsloth's own, with one log line saying why). Same math, fewer memory passes.",
    )
    expert_lora: Literal["auto", "grouped", "library"] = Field(
        "auto",
        description="How an MoE layer's expert adapters run. 'grouped': beside the base experts, two small grouped "
        "GEMMs per projection (HyperSloth.train.lora.experts; on the CPU 4x faster than PEFT's and a quarter of "
        "its extra memory at Qwen3-30B-A3B's expert widths); 'library': PEFT's parametrization, or Unsloth's MoE "
        "LoRA path on the Unsloth backend; 'auto': grouped on the transformers backend, Unsloth's path on the "
        "Unsloth backend (measured on one H200, Qwen3-30B-A3B's shape: Unsloth's path 0.33 s/step and 66.7 GB, "
        "grouped 0.53 s and 92.3 GB, the same losses).",
    )

    method: Literal["sft", "dpo", "grpo"] = Field(
        "sft",
        description="'sft' trains on conversations (a dataset built from chats); 'dpo' on preference pairs (a "
        "dataset built from prompt/chosen/rejected rows) with DPO's sigmoid loss against the reference model: "
        "the base model with the LoRA adapter disabled, or the initial adapter with lora_args.init_adapter_path "
        "(docs/dpo.md); 'grpo' on prompts (a dataset built with --kind prompt), sampling completions and scoring "
        "them with the config file's reward_funcs (docs/grpo.md).",
    )
    grpo: GrpoArgs = Field(default_factory=GrpoArgs, description="method='grpo': GRPO's settings (GrpoArgs).")
    dpo_beta: float = Field(
        0.1,
        description="method='dpo': beta of the DPO loss, > 0; larger keeps the policy closer to the reference "
        "(TRL's default 0.1). Ignored by 'sft'.",
    )

    @field_validator("gpus")
    @classmethod
    def _valid_gpu_ids(cls, gpus: list[int]) -> list[int]:
        if not gpus:
            raise ValueError("gpus is empty: list at least one GPU id, e.g. [0]")
        negative = [g for g in gpus if g < 0]
        if negative:
            raise ValueError(f"GPU ids must be >= 0, got {negative}")
        duplicates = sorted({g for g in gpus if gpus.count(g) > 1})
        if duplicates:
            listed = ", ".join(map(str, duplicates))
            verb = "appears" if len(duplicates) == 1 else "appear"
            raise ValueError(f"GPU ids must be distinct: {listed} {verb} more than once in {gpus}")
        return gpus

    @field_validator("dpo_beta")
    @classmethod
    def _positive_beta(cls, beta: float) -> float:
        if not (math.isfinite(beta) and beta > 0):
            raise ValueError(f"dpo_beta must be a finite number > 0 (DPO's beta, e.g. 0.1), got {beta}")
        return beta

    @model_validator(mode="after")
    def _dpo_settings(self) -> TrainingConfig:
        if self.method == "dpo" and self.batching != "packed":
            raise ValueError("method='dpo' packs each pair's two sequences padding-free: set batching='packed'")
        if self.method == "dpo" and self.loss_type == "all":
            raise ValueError("method='dpo' scores the completions only (the prompt is context): leave loss_type "
                             "at 'response_only'")
        return self

    @model_validator(mode="after")
    def _grpo_settings(self) -> TrainingConfig:
        # Against the defaults, not model_fields_set: a run.json's config holds every field, grpo included.
        if self.method != "grpo" and self.grpo != GrpoArgs():
            raise ValueError(f"grpo settings are given but method is '{self.method}': set method='grpo' to train "
                             "with them, or remove grpo=")
        if self.method == "grpo" and self.batching != "packed":
            raise ValueError("method='grpo' packs each prompt's completions padding-free: set batching='packed'")
        if self.method == "grpo" and self.loss_type == "all":
            raise ValueError("method='grpo' trains on the completions only (the prompt is context): leave loss_type "
                             "at 'response_only'")
        return self


class TrainingArgsConfig(BaseModel):
    """Optimiser, schedule, logging and checkpoint settings, passed to TRL's `SFTConfig`."""

    model_config = ConfigDict(extra="forbid")

    output_dir: str = Field("outputs/hypersloth", description="Checkpoints, logs and the resolved config go here.")
    per_device_train_batch_size: int = Field(8, gt=0, description="Samples per micro-batch on each process.")
    gradient_accumulation_steps: int = Field(
        16, gt=0,
        description="Sets the step size: samples per optimizer step = per_device_train_batch_size x this x "
        "len(gpus). sorted-pad runs this many micro-batches per process and step; packed packs the same samples "
        "into as many micro-batches of tokens_per_micro_batch tokens as they need.",
    )
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    num_train_epochs: int | None = Field(1, gt=0, description="Passes over the data (ignored when max_steps is set).")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps to run; overrides num_train_epochs.")
    lr_scheduler_type: str = Field("linear", description="transformers scheduler name: linear, cosine, constant, ...")
    warmup_steps: int = Field(5, ge=0, description="Steps of linear warm-up from 0 to learning_rate.")
    optim: str = Field(
        "adamw_torch_fused",
        description="transformers optimizer name (the default is transformers' own: AdamW in one fused kernel per "
        "step); '*8bit' ones need CUDA.",
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 disables clipping.")
    # >= 0: numpy's generators (the planner's shuffle) refuse a negative seed, which would otherwise surface
    # only after every worker has loaded its model.
    seed: int = Field(42, ge=0, description="Seed for data order and dropout (>= 0).")
    logging_steps: int = Field(1, gt=0, description="Log every this many optimizer steps.")
    save_steps: int = Field(100, gt=0, description="Save a checkpoint every this many optimizer steps.")
    save_total_limit: int | None = Field(
        None, gt=0, description="Keep at most this many checkpoints; None (TRL's default) keeps all.")
    report_to: str | list[str] = Field("tensorboard", description="'tensorboard', 'wandb', 'none' or a list.")
    resume_from_checkpoint: str | None = Field(
        None, description="Checkpoint folder to resume from, or 'latest': the newest complete checkpoint of "
        "output_dir. Checked before any worker starts (HyperSloth.outputs.checkpoints); given to trainer.train."
    )
    dataloader_num_workers: int | None = Field(
        None, ge=0, description="Worker processes that collate the next steps while this one trains; None = 1 "
        "when training on GPUs, 0 (in the training process) on CPU.",
    )
    eval_steps: int | None = Field(
        None, gt=0, description="Evaluate every this many optimizer steps (needs an eval set: data.eval_fraction "
        "or data.eval_dataset_name); with an eval set there is always one evaluation after the last step.",
    )
    early_stopping_patience: int | None = Field(
        None, gt=0, description="Stop after this many evaluations in a row without a lower eval loss; None = never.",
    )
    save_best_adapter: bool = Field(
        True, description="Keep the adapter of the lowest eval loss in OUTPUT_DIR/best_adapter/ (with an eval set).",
    )
    extra_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other trl.SFTConfig arguments, passed through verbatim, e.g. {'adam_beta2': 0.95}.",
    )

    @model_validator(mode="after")
    def _length_and_extras(self) -> TrainingArgsConfig:
        if self.max_steps is None and self.num_train_epochs is None:
            raise ValueError("max_steps and num_train_epochs are both None: set one of them")
        clashes = sorted(set(self.extra_args) & set(type(self).model_fields))
        if clashes:
            raise ValueError(f"extra_args repeats {clashes}: set them as fields of TrainingArgsConfig instead")
        if self.extra_args.get("router_aux_loss_coef"):
            raise ValueError(
                f"extra_args router_aux_loss_coef={self.extra_args['router_aux_loss_coef']}: HyperSloth trains MoE "
                "models without the router's load-balancing loss (the router is frozen, and transformers computes that "
                "loss per micro-batch, so N GPUs would differ from one; docs/models.md): remove it from extra_args")
        return self

    def to_sft_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `trl.SFTConfig` (resume_from_checkpoint goes to `train()` instead)."""
        # gradient_accumulation_steps only sizes the step (HyperSloth accumulates inside its own
        # training_step), so TRL keeps its default of 1 instead of being told and overruled.
        # The eval fields are HyperSloth's own (HyperSloth.train.evaluation turns them into SFTConfig's eval_* arguments).
        kwargs = self.model_dump(exclude={"extra_args", "resume_from_checkpoint", "gradient_accumulation_steps",
                                          "eval_steps", "early_stopping_patience", "save_best_adapter"})
        kwargs["max_steps"] = -1 if self.max_steps is None else self.max_steps
        kwargs["num_train_epochs"] = 1 if self.num_train_epochs is None else self.num_train_epochs
        kwargs.update(self.extra_args)
        return kwargs


class HyperConfig(BaseModel):
    """Everything about the run except optimiser settings: data, processes, model and adapter."""

    model_config = ConfigDict(extra="forbid")

    data: DataConfig = Field(description="The built dataset to train on.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Processes and batching.")
    fast_model_args: FastModelArgs = Field(description="Base model loading.")
    lora_args: LoraArgs | None = Field(
        default_factory=LoraArgs, description="LoRA settings; None = full fine-tuning of every weight."
    )

    @model_validator(mode="after")
    def _full_finetuning_matches_lora(self) -> HyperConfig:
        model = self.fast_model_args
        if model.full_finetuning and self.lora_args is not None:
            if "lora_args" in self.model_fields_set:
                raise ValueError(
                    "fast_model_args.full_finetuning=True but lora_args is given: set lora_args=None for full "
                    "fine-tuning, or full_finetuning=False to train a LoRA adapter"
                )
            self.lora_args = None  # full_finetuning=True with lora_args left at its default means "no LoRA"
        if self.lora_args is None and self.training.method == "grpo":
            raise ValueError("method='grpo' needs a LoRA adapter (the reference for beta > 0 is the same weights with "
                             "the adapter switched off): give lora_args")
        if self.lora_args is None and self.training.method == "dpo":
            raise ValueError("method='dpo' needs a LoRA adapter (the reference model is the same weights with the "
                             "adapter disabled, no second copy): give lora_args, or use method='sft' for full "
                             "fine-tuning")
        if self.lora_args is None:
            if model.load_in_4bit or model.load_in_8bit:
                raise ValueError(
                    "full fine-tuning (lora_args=None) cannot train 4-bit/8-bit weights: set load_in_4bit=False "
                    "and load_in_8bit=False, or give lora_args for QLoRA"
                )
            # A copy, so that a FastModelArgs object the user shares between configs is not changed.
            self.fast_model_args = model.model_copy(update={"full_finetuning": True})
        return self


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config file."""

    hyper: HyperConfig
    training_args: TrainingArgsConfig
    path: Path
    # method='grpo': the file's module-level `reward_funcs`, each f(prompts, completions, **columns) -> list[float]
    reward_funcs: tuple[Callable[..., Any], ...] = ()


# Where each model sits in a config file, so that errors name e.g. 'training.gpu' even when the user
# built TrainingConfig(...) directly and pydantic only knows the class.
_MODEL_PREFIX: dict[str, tuple[str, ...]] = {
    "HyperConfig": (),
    "DataConfig": ("data",),
    "TrainingConfig": ("training",),
    "FastModelArgs": ("fast_model_args",),
    "LoraArgs": ("lora_args",),
    "GrpoArgs": ("training", "grpo"),
    "TrainingArgsConfig": (),
}
_MODELS: dict[str, type[BaseModel]] = {
    cls.__name__: cls
    for cls in (HyperConfig, DataConfig, TrainingConfig, FastModelArgs, LoraArgs, GrpoArgs, TrainingArgsConfig)
}
_FILE_NAMES = {"HyperConfig": "hyper_config_model", "TrainingArgsConfig": "training_config_model"}
_HYPER_CHILDREN = {"data": DataConfig, "training": TrainingConfig, "fast_model_args": FastModelArgs, "lora_args": LoraArgs}


def _field_path(root: str, loc: tuple[str, ...]) -> tuple[tuple[str, ...], type[BaseModel]]:
    """Keep the field names of `loc` (drop union tags such as 'list[str]') and the model owning the last."""
    model, path = _MODELS[root], []
    for part in loc:
        if part not in model.model_fields:
            break
        path.append(part)
        if model is HyperConfig and part in _HYPER_CHILDREN and len(path) < len(loc):
            model = _HYPER_CHILDREN[part]
    return tuple(path), model


def _unknown_field_message(root: str, loc: tuple[str, ...], where: str) -> str:
    name = loc[-1]
    _, owner = _field_path(root, loc[:-1] + ("",))
    valid = list(owner.model_fields)
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    message = f"unknown field '{where}'"
    if close:
        return f"{message} — did you mean '{close[0]}'?"
    homes = [cls_name for cls_name, cls in _MODELS.items() if name in cls.model_fields]
    if homes:
        home = ".".join(_MODEL_PREFIX[homes[0]]) or _FILE_NAMES[homes[0]]
        return f"{message} — '{name}' belongs in {homes[0]} ({home})"
    return f"{message}; valid fields: {', '.join(valid)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def format_validation_error(error: ValidationError) -> str:
    """One line per problem, `location: problem`, with a suggestion for misspelt field names."""
    root = error.title if error.title in _MODELS else "HyperConfig"
    prefix = _MODEL_PREFIX.get(root, ())
    problems: dict[str, list[str]] = {}  # location -> messages; union members merge into one line
    inputs: dict[str, str] = {}
    for item in error.errors():
        loc = tuple(str(part) for part in item["loc"] if not isinstance(part, int))
        if item["type"] == "extra_forbidden":
            problems.setdefault(_unknown_field_message(root, loc, ".".join(prefix + loc)), [])
            continue
        where = ".".join(prefix + _field_path(root, loc)[0]) or root
        if item["type"] == "missing":
            problems.setdefault(where, []).append("required field is missing")
            continue
        problems.setdefault(where, []).append(item["msg"].removeprefix("Value error, "))
        if item["type"] != "value_error":
            inputs[where] = f" (got {_short(item.get('input'))})"
    lines = [
        f"{where}: {' or '.join(dict.fromkeys(msgs))}{inputs.get(where, '')}" if msgs else where
        for where, msgs in problems.items()
    ]
    return "\n".join(f"  {line}" for line in lines)


def _user_line(exc: BaseException, path: Path) -> str:
    """' (line N)' of the deepest traceback frame inside the user's config file, or ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
    return f" (line {frames[-1].lineno})" if frames else ""


def _execute(path: Path) -> dict[str, Any]:
    """Run the config file as a fresh module and return its globals."""
    name = f"_hypersloth_user_config_{next(_MODULE_COUNTER)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: not a Python file (config files end in .py)")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.parent)
    sys.path.insert(0, folder)  # lets a config import a helper next to it; removed below
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        raise ConfigError(f"{path}: syntax error at line {err.lineno}: {err.msg}") from None
    except ValidationError as err:
        raise ConfigError(f"{path}{_user_line(err, path)}: invalid config:\n{format_validation_error(err)}") from None
    except ConfigError as err:  # e.g. DataConfig.from_dataset_name(...) in the file: already readable
        raise ConfigError(f"{path}{_user_line(err, path)}: {err}") from None
    except Exception as err:  # any exception in user code becomes one readable line
        raise ConfigError(
            f"{path}{_user_line(err, path)}: importing the config raised {type(err).__name__}: {err}"
        ) from None
    finally:
        sys.modules.pop(name, None)
        if folder in sys.path:
            sys.path.remove(folder)
    return vars(module)


def _validate(path: Path, names: tuple[str, str], namespace: dict[str, Any], model: type[BaseModel]) -> Any:
    model_name, dict_name = names
    value = namespace.get(model_name, namespace.get(dict_name))
    if value is None:
        return None
    if isinstance(value, BaseModel) and not isinstance(value, model):
        raise ConfigError(f"{path}: {model_name} must be a {model.__name__}, got {type(value).__name__}")
    try:
        return model.model_validate(value)
    except ValidationError as err:
        raise ConfigError(f"{path}: invalid {model.__name__}:\n{format_validation_error(err)}") from None


def load_config(path: str | os.PathLike) -> LoadedConfig:
    """Import a Python config file and validate it; every problem raises ConfigError naming the file.

    The file is executed: it runs with the caller's rights, like any script (load only configs you trust).
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found (create one with `hypersloth-init {path.name}`)")
    namespace = _execute(path)
    hyper = _validate(path, ("hyper_config_model", "hyper_config"), namespace, HyperConfig)
    if hyper is None:
        raise ConfigError(
            f"{path}: defines neither `hyper_config_model` (a HyperConfig) nor `hyper_config` (a dict); "
            "also define `training_config_model` (a TrainingArgsConfig) or `training_config`, or leave it out "
            "for the defaults"
        )
    training_args = _validate(path, ("training_config_model", "training_config"), namespace, TrainingArgsConfig)
    rewards = _reward_funcs(path, namespace.get(REWARD_FUNCS), hyper.training)
    return LoadedConfig(hyper=hyper, training_args=training_args or TrainingArgsConfig(), path=path,
                        reward_funcs=rewards)


REWARD_FUNCS = "reward_funcs"  # the module-level name of a GRPO config's reward functions


def reward_name(func: Callable[..., Any]) -> str:
    """A reward function's name as TRL logs it (`rewards/NAME/mean`): its __name__ (a partial's function's)."""
    inner = getattr(func, "func", func)
    return str(getattr(inner, "__name__", type(inner).__name__))


def _reward_funcs(path: Path, value: Any, training: TrainingConfig) -> tuple[Callable[..., Any], ...]:
    """The file's `reward_funcs`, checked against the method and GrpoArgs.reward_weights (ConfigError otherwise)."""
    if value is None:
        if training.method == "grpo":
            raise ConfigError(f"{path}: method='grpo' but the file defines no `reward_funcs`: add a module-level list "
                              "of functions f(prompts, completions, **columns) -> list[float], e.g. "
                              "`reward_funcs = [format_reward, answer_reward]` (docs/grpo.md)")
        return ()
    if training.method != "grpo":
        raise ConfigError(f"{path}: the file defines `reward_funcs` but training.method is '{training.method}': "
                          "set method='grpo' to train against them, or remove reward_funcs")
    funcs = list(value) if isinstance(value, (list, tuple)) else [value]
    bad = [repr(f)[:40] for f in funcs if not callable(f)]
    if bad or not funcs:
        raise ConfigError(f"{path}: reward_funcs must be a non-empty list of functions f(prompts, completions, "
                          f"**columns) -> list[float]; not callable: {', '.join(bad) or '(the list is empty)'}")
    names = [reward_name(f) for f in funcs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{path}: reward_funcs has two functions named {twice[0]!r}: their logs (rewards/NAME/mean) "
                          "would mix; give each its own name")
    weights = training.grpo.reward_weights
    if weights is not None and len(weights) != len(funcs):
        raise ConfigError(f"{path}: training.grpo.reward_weights has {len(weights)} weight(s) for {len(funcs)} reward "
                          "function(s): give one weight per function, in the order of reward_funcs, or None")
    return tuple(funcs)


def load_reward_funcs(path: str | os.PathLike, names: tuple[str, ...]) -> tuple[Callable[..., Any], ...]:
    """The reward functions of a GRPO config, for a worker: the file executed again (its functions cannot
    travel in run.json, and one defined in the file has no importable module), checked to be the ones the
    launcher resolved (`names`, from run.json); ConfigError naming what changed."""
    loaded = load_config(path)
    found = tuple(reward_name(f) for f in loaded.reward_funcs)
    if found != tuple(names):
        raise ConfigError(f"{path}: reward_funcs are now {list(found)}, but the run was started with {list(names)} "
                          "(the file changed after launch): start the run again")
    return loaded.reward_funcs


def config_to_dict(loaded: LoadedConfig) -> dict[str, Any]:
    """JSON-safe resolved config; its two parts load back as `hyper_config` / `training_config` dicts."""
    resolved = {
        "source_path": str(loaded.path),
        "hyper_config": loaded.hyper.model_dump(),
        "training_config": loaded.training_args.model_dump(),
    }
    # extra_args may hold anything; str() keeps the record readable instead of failing the save.
    return json.loads(json.dumps(resolved, default=str))


def runtime_problems(
    hyper: HyperConfig, training_args: TrainingArgsConfig, *, cuda_device_count: int, unsloth_available: bool
) -> list[str]:
    """What stops this config from running on a machine with these facts (empty when nothing does)."""
    model, cuda = hyper.fast_model_args, cuda_device_count > 0
    problems = []
    for flag in ("load_in_4bit", "load_in_8bit"):
        if getattr(model, flag) and not cuda:
            problems.append(f"{flag}=True needs CUDA and bitsandbytes; set {flag}=False to train on CPU")
    missing = [g for g in hyper.training.gpus if g >= cuda_device_count]
    if cuda and missing:
        problems.append(
            f"gpus {missing} not available: {cuda_device_count} GPU(s) visible (ids 0..{cuda_device_count - 1}); "
            "ids count within CUDA_VISIBLE_DEVICES"
        )
    if model.backend == "unsloth" and not cuda:
        problems.append("backend='unsloth' needs CUDA; set backend='auto' or 'transformers' to train on CPU")
    if model.backend == "unsloth" and not unsloth_available:
        problems.append("backend='unsloth' but unsloth is not importable: pip install 'HyperSloth[gpu]' "
                        "or set backend='transformers'")
    backend = model.resolved_backend(cuda_available=cuda, unsloth_available=unsloth_available)
    if model.tiled_mlp is True and backend != "unsloth":
        problems.append(f"fast_model_args.tiled_mlp=True needs the Unsloth backend (its tiled MLP), and this run uses "
                        f"{backend}: set tiled_mlp='auto' (on only where Unsloth is) or False")
    if model.attention in ("fa4", "flash") and not cuda:
        problems.append(f"fast_model_args.attention='{model.attention}' needs CUDA (a flash kernel); set "
                        "attention='auto' (SDPA on CPU)")
    if "8bit" in training_args.optim and not cuda:
        problems.append(f"optim='{training_args.optim}' needs CUDA (bitsandbytes); leave optim at its default "
                        "('adamw_torch_fused') on CPU")
    return problems
