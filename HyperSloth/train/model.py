"""Load the base model and attach LoRA adapters, through Unsloth or transformers + PEFT.

Knows nothing about ranks or processes: the worker decides the backend, makes sure Unsloth is imported
before transformers/trl when it is used, and hands the model to the trainer.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from loguru import logger

from HyperSloth.config import FastModelArgs, LoraArgs
from HyperSloth.train.lora.targets import LoraTargets, check_expert_settings, resolve_targets
from HyperSloth.train.lora.targets import describe as describe_targets

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    backend: str  # "unsloth" or "transformers"
    dtype: torch.dtype
    # When the base model (with its tokenizer) was loaded and the adapters attached (time.time(); no "adapter"
    # for full fine-tuning): the worker's start-up timeline (HyperSloth.outputs.startup).
    stamps: dict[str, float] = field(default_factory=dict)
    # What got adapters and the trainable share (HyperSloth.train.lora.targets.describe; run_resolved.json).
    lora_targets: dict[str, Any] | None = None
    # Packed rows measured on this model (HyperSloth.train.packing.check; packed runs only; run_resolved.json).
    packing: dict[str, Any] | None = None


def resolve_backend(args: FastModelArgs) -> str:
    """The backend to use here: "unsloth" or "transformers" (see `FastModelArgs.backend`)."""
    return args.resolved_backend(
        cuda_available=torch.cuda.is_available(),
        unsloth_available=importlib.util.find_spec("unsloth") is not None,
    )


def resolve_dtype(args: FastModelArgs) -> torch.dtype:
    return _DTYPES[args.resolved_dtype(cuda_available=torch.cuda.is_available())]


def mixed_precision(dtype: torch.dtype, cuda: bool) -> str | None:
    """The Trainer's mixed precision for a model loaded in `dtype`: "bf16" or "fp16" on CUDA (sft_config_for
    sets it; accelerate then runs every forward of the prepared model under torch.autocast in that dtype),
    None otherwise (CPU runs train in fp32 without autocast)."""
    if not cuda:
        return None
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)


def training_autocast(model):
    """The autocast context the Trainer's forward runs under, for forwards that run before the Trainer has
    wrapped the model: the budget probe and the packed-row check measure training's forward, not a plain one.
    A plain forward can differ: Granite 4.0-H's Mamba mixer through Unsloth raised "expected mat1 and mat2 to
    have the same dtype" outside autocast (one H200, 2026-12-05), and autocast runs norms and losses in fp32.
    The model's dtype is its input embeddings' (a 4-bit model's too: the compute dtype), else its first floating
    parameter's."""
    import contextlib

    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    parameter = getattr(embeddings, "weight", None)
    if parameter is None:
        parameter = next((p for p in model.parameters() if p.is_floating_point()), None)
    if parameter is None:
        return contextlib.nullcontext()
    precision = mixed_precision(parameter.dtype, parameter.device.type == "cuda")
    if precision is None:
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def import_backend(backend: str) -> None:
    """Import Unsloth first when it is the backend: it patches transformers/trl on import."""
    if backend == "unsloth":
        importlib.import_module("unsloth")


def load_model(fast: FastModelArgs, lora: LoraArgs | None, lora_passes: bool = False,
               expert_lora: str = "auto") -> LoadedModel:
    """Load the base model (4-bit, 8-bit or 16/32-bit) and attach LoRA, or leave it whole for full FT.
    `lora_passes`: put HyperSloth's LoRA projections (`lora_passes`) in place of Unsloth's (Unsloth backend).
    `expert_lora`: training.expert_lora, how an MoE layer's expert adapters run (`_install_expert_lora`)."""
    backend = resolve_backend(fast)
    dtype = resolve_dtype(fast)
    native = _checkpoint_config(fast)
    stamps: dict[str, float] = {}
    record: dict[str, Any] = {}
    if backend == "unsloth":
        model, tokenizer = _load_unsloth(fast, lora, dtype, stamps, record)
        if lora is not None and lora_passes:
            _install_lora_passes(model)
            stamps["adapter"] = time.time()  # the adapters are attached once their passes are in place
    else:
        model, tokenizer = _load_transformers(fast, lora, dtype, stamps, native, record)
    if lora is not None and (expert_lora == "grouped" or (expert_lora == "auto" and backend != "unsloth")):
        _install_expert_lora(model, expert_lora)
    _no_router_loss(model)
    line = describe_rope(native, model.config, fast.max_seq_length, backend) if native is not None else None
    if line:
        logger.warning(line)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model=model, tokenizer=tokenizer, backend=backend, dtype=dtype, stamps=stamps,
                       lora_targets=record or None)


def _load_unsloth(fast: FastModelArgs, lora: LoraArgs | None, dtype: torch.dtype, stamps: dict[str, float],
                  record: dict[str, Any] | None = None):
    from unsloth import FastLanguageModel

    # use_gradient_checkpointing goes to from_pretrained too: its default ("unsloth") patches torch's
    # checkpointing globally at load time, whatever the config says, until get_peft_model undoes it.
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=fast.model_name,
        max_seq_length=fast.max_seq_length,
        dtype=dtype,
        load_in_4bit=fast.load_in_4bit,
        load_in_8bit=fast.load_in_8bit,
        full_finetuning=fast.full_finetuning,
        trust_remote_code=fast.trust_remote_code,
        use_gradient_checkpointing=fast.use_gradient_checkpointing,
        # Applied in from_pretrained, before the adapters: Unsloth's LoRA MLP hook (and ours, lora_install) then
        # goes into the tile hook. "auto" is settled before any load (budget.settle): False until it says so.
        unsloth_tiled_mlp=fast.tiled_mlp is True,
    )
    stamps["model_load"] = time.time()
    line = keep_mamba_layers_out_of_block_compile(model, os.environ)
    if line:
        logger.info(line)
    if lora is not None and lora.init_adapter_path:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, lora.init_adapter_path, is_trainable=True)
        # What Unsloth's own loader does after loading an adapter (FastLlamaModel.from_pretrained with an
        # adapter folder, unsloth 2026.8-2026.10): its LoRA kernels and the checkpointing setting, which
        # get_peft_model would otherwise have applied.
        model = FastLanguageModel.patch_peft_model(model, fast.use_gradient_checkpointing)
    elif lora is not None:
        targets = _targets(model, lora)
        model = _unsloth_lora(FastLanguageModel, model, fast, lora, targets)
        _log_targets(model, targets, record)
    _allow_packed_rows(model)
    if lora is not None:
        stamps["adapter"] = time.time()
    return model, tokenizer


def mamba_decoder_layer_compiled_whole(model) -> str | None:
    """The decoder-layer class Unsloth would compile as one region with a Mamba layer inside it, or None.

    Unsloth 2026.10.9 compiles each decoder layer as one torch.compile region in training
    (`unsloth/models/_block_compile.py`) and leaves SSM layers out, by its own test (a module with `ssm_state_size`),
    except in a "legacy" layer list: one class whose name ends in `DecoderLayer`, compiled whole (Granite 4.0-H's
    `GraniteMoeHybridDecoderLayer`, Bamba's, Falcon-H1's). Lists of several classes (Jamba) or of `*Block`s
    (Nemotron-H) already keep their Mamba layers out."""
    from HyperSloth.train.lora.install import decoder_layers

    layers = decoder_layers(model) or []
    names = {type(layer).__name__ for layer in layers}
    if len(names) != 1 or not next(iter(names)).endswith("DecoderLayer"):
        return None
    if any(hasattr(inner, "ssm_state_size") for layer in layers for inner in layer.modules()):
        return names.pop()
    return None


def keep_mamba_layers_out_of_block_compile(model, environ: MutableMapping[str, str]) -> str | None:
    """Turn Unsloth's per-layer compile off (`UNSLOTH_BLOCK_COMPILE=0`, Unsloth's own switch, read at every forward)
    for a model whose Mamba layers it would compile whole; returns the line that says so (None: nothing changed).

    Why: on one H200 (2026-12-05, fifth session, `arch_check.py` callR) the tiny Granite 4.0-H through Unsloth at
    defaults (sorted-pad) compiled for 115 s in step 1, then failed in step 2, at a new padded length, inside the
    compiled backward: inductor's stride check on the Mamba convolution's input (`assert_size_stride(permute_1,
    (s47, 640, s16), (784160, 1, 1160))`: a stride fixed at step 1's length). Unsloth keeps SSM layers out of its
    compiled regions everywhere else ("traced, transformers swaps Mamba CUDA scan kernels for a torch scan"). A user
    who set `UNSLOTH_BLOCK_COMPILE` keeps their setting."""
    layer = mamba_decoder_layer_compiled_whole(model)
    if layer is None or "UNSLOTH_BLOCK_COMPILE" in environ:
        return None
    environ["UNSLOTH_BLOCK_COMPILE"] = "0"
    return (f"Unsloth's per-layer compile is off (UNSLOTH_BLOCK_COMPILE=0): it would compile {layer} whole, Mamba "
            f"layers included, whose compiled backward failed at a second row length (docs/models.md)")


def _install_lora_passes(model) -> None:
    """HyperSloth's LoRA projections in place of Unsloth's hooks, or one line saying why not (all or nothing)."""
    from HyperSloth.train.lora.install import install_lora_passes

    why = install_lora_passes(model)
    if why is None:
        logger.info("LoRA projections: HyperSloth's passes (no separate low-rank output pass; lora_passes=True)")
    else:
        logger.info(f"LoRA projections: Unsloth's ({why})")


def _install_expert_lora(model, setting: str) -> None:
    """The MoE expert adapters as grouped GEMMs beside the base experts, or one line saying why not (a model
    without adapted experts says nothing)."""
    from HyperSloth.train.lora.experts import install_grouped_expert_lora

    count, why = install_grouped_expert_lora(model)
    if count:
        logger.info(f"expert LoRA: grouped GEMMs beside the base experts in {count} MoE layers "
                    f"(training.expert_lora={setting!r}; PEFT would form every expert's W + BA each step)")
    elif why != "no adapted experts":
        (logger.warning if setting == "grouped" else logger.info)(f"expert LoRA: the library's ({why})")


def _allow_packed_rows(model) -> None:
    """A packed row holds several samples and may exceed max_seq_length; Unsloth refuses it unless told."""
    from unsloth.utils.packing import mark_allow_overlength

    mark_allow_overlength(model)


def _unsloth_lora(FastLanguageModel, model, fast: FastModelArgs, lora: LoraArgs, targets: LoraTargets):
    # target_parameters given explicitly (an empty list too): Unsloth fills None from the MLP names itself
    # (get_moe_target_parameters), and HyperSloth's resolution already did that, checked against the model.
    return FastLanguageModel.get_peft_model(
        model,
        r=lora.r,
        target_modules=list(targets.modules),
        target_parameters=list(targets.parameters),
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        bias=lora.bias,
        use_gradient_checkpointing=fast.use_gradient_checkpointing,
        random_state=lora.random_state,
        use_rslora=lora.use_rslora,
        max_seq_length=fast.max_seq_length,
    )


def _load_transformers(fast: FastModelArgs, lora: LoraArgs | None, dtype: torch.dtype, stamps: dict[str, float],
                       native=None, record: dict[str, Any] | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Remote model code runs only when the config asks for it (trust_remote_code, default False).
    # Unset: transformers' own choice, SDPA where the model supports it, else eager (gpt-oss: its attention sinks).
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": fast.attn_implementation,
                              "trust_remote_code": fast.trust_remote_code}
    extension = rope_extension(native, fast.max_seq_length) if native is not None else None
    if extension is not None:  # the same scaling Unsloth applies, so both backends train the same model
        config = copy.deepcopy(native)
        config.rope_parameters = extension
        config.max_position_embeddings = fast.max_seq_length
        kwargs["config"] = config
    if fast.load_in_4bit or fast.load_in_8bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=fast.load_in_4bit,
            load_in_8bit=fast.load_in_8bit,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
        )
    if torch.cuda.is_available():
        kwargs["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(fast.model_name, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(fast.model_name, trust_remote_code=fast.trust_remote_code)
    if fast.use_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    stamps["model_load"] = time.time()
    if lora is None:
        return model, tokenizer
    model = _attach_peft(model, lora, record)
    stamps["adapter"] = time.time()
    return model, tokenizer


def _attach_peft(model, lora: LoraArgs, record: dict[str, Any] | None = None):
    from peft import LoraConfig, PeftModel, get_peft_model

    if lora.init_adapter_path:
        return PeftModel.from_pretrained(model, lora.init_adapter_path, is_trainable=True)
    targets = _targets(model, lora)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=list(targets.modules) or None,
        target_parameters=list(targets.parameters) or None,
        exclude_modules=list(targets.excluded) or None,
        bias=lora.bias,
        use_rslora=lora.use_rslora,
        task_type="CAUSAL_LM",
    )
    # Seeded so every rank (and the 1-GPU reference run) starts from the same adapter weights.
    torch.manual_seed(lora.random_state)
    model = get_peft_model(model, config)
    _log_targets(model, targets, record)
    return model


def _targets(model, lora: LoraArgs) -> LoraTargets:
    """The adapters this model gets (read from it, or the config's list checked against it). PEFT refuses a
    list that matches nothing, but trains silently with fewer adapters when only some entries match (a typo
    such as "q_prj" next to "v_proj"): every entry must match."""
    targets = resolve_targets(model, lora.target_modules)
    check_expert_settings(targets, lora.lora_dropout)
    return targets


def _log_targets(model, targets: LoraTargets, record: dict[str, Any] | None) -> None:
    """One log line on what got adapters; its record goes into `record` when the caller keeps one."""
    line, described = describe_targets(model, targets)
    logger.info(line)
    if record is not None:
        record.update(described)


def _no_router_loss(model) -> None:
    """Train without an MoE router's load-balancing loss, whatever the checkpoint's config says.

    With `output_router_logits`, transformers adds `router_aux_loss_coef` x a load-balancing loss computed per
    forward (a mean over that micro-batch's tokens) to the loss: a sum over micro-batches then depends on how the
    step's tokens were cut into micro-batches and GPUs, so N GPUs would no longer train what one does. The router
    is frozen (it gets no adapter), so the loss would only push the adapters below it towards balanced routing.
    Off is the default of Qwen3-MoE, Mixtral and gpt-oss configs; a config that turns it on is told in one line."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        config.output_router_logits = False
        logger.info("MoE router load-balancing loss: not added (the checkpoint's config has output_router_logits="
                    "True; the router is frozen and the loss must not depend on how a step is split over GPUs)")


# ---------------------------------------------------------------- RoPE past the checkpoint's context
# Unsloth's FastLanguageModel.from_pretrained (unsloth/models/llama.py, checked at unslothai/unsloth HEAD of
# 2026-12 and 2026.10.9): when max_seq_length exceeds the checkpoint's max_position_embeddings and no
# rope_scaling is passed, it sets linear ("kaiokendev") RoPE scaling with factor max_seq_length / context
# (keeping a native llama3 scaling instead) and raises max_position_embeddings, printing only a one-time
# warning. HyperSloth says in one line what the loaded model has, on both backends.


def rope_parameters(config) -> dict[str, Any]:
    """The config's RoPE parameters as a dict with a `rope_type` ("default" when unscaled)."""
    raw = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(raw) if isinstance(raw, dict) else dict(vars(raw))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_extension(native, max_seq_length: int) -> dict[str, Any] | None:
    """The RoPE parameters the transformers backend loads with when `max_seq_length` exceeds the checkpoint's
    context: linear scaling by max_seq_length / context, as Unsloth does, when the checkpoint has no scaling
    of its own (a checkpoint with one, e.g. yarn or llama3, keeps it: it was built for long context). None
    when nothing changes."""
    context = int(getattr(native, "max_position_embeddings", 0) or 0)
    params = rope_parameters(native)
    if not context or max_seq_length <= context or params["rope_type"] != "default":
        return None
    return {**params, "rope_type": "linear", "factor": max_seq_length / context}


def describe_rope(native, loaded, max_seq_length: int, backend: str) -> str | None:
    """One line on positions past the checkpoint's context (None when max_seq_length fits in it)."""
    context = int(getattr(native, "max_position_embeddings", 0) or 0)
    if not context or max_seq_length <= context:
        return None
    before, after = rope_parameters(native), rope_parameters(loaded)
    head = f"RoPE: max_seq_length {max_seq_length:,} exceeds the checkpoint's context of {context:,} positions; "
    if after["rope_type"] != before["rope_type"] or after.get("factor") != before.get("factor"):
        return (head + f"{backend} applied {after['rope_type']} RoPE scaling, factor {after.get('factor', 1.0):.4g} "
                f"(every position is divided by it, also in samples shorter than {context:,} tokens)")
    if before["rope_type"] != "default":
        return head + f"the checkpoint's own {before['rope_type']} RoPE scaling is kept unchanged"
    return head + "no RoPE scaling applied: positions past the context are extrapolated"


def _checkpoint_config(fast: FastModelArgs):
    """The checkpoint's own config (before any loader changes it), or None when it cannot be read."""
    return read_checkpoint_config(fast.model_name, fast.trust_remote_code)


def read_checkpoint_config(model_name: str, trust_remote_code: bool = False):
    """The config in the model's folder or the Hub cache, without loading weights; None when it cannot be read
    (for the checks that only need the model's shape: the RoPE line, the budget's checkpointing floor)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        logger.debug(f"could not read {model_name}'s config: {err}")
        return None


def release_checkpointing_buffers() -> bool:
    """Shrink Unsloth's offloaded-checkpointing buffers back to their initial size; True if it did.

    With `use_gradient_checkpointing="unsloth"`, unsloth_zoo can stage checkpointed activations through GPU
    buffers and keep them in pinned host buffers; both grow to the largest activation offloaded and stay.
    The budget probe's verifying pass runs the largest micro-batch the run could ever hold (97k tokens on
    the 8B benchmark: by size, up to 0.8 GB per GPU staging buffer and 36 x 0.8 GB of pinned host memory
    per rank, if Unsloth offloads it), so the probe gives them back before training starts, with
    unsloth_zoo's own `reset_unsloth_gradient_checkpointing_buffers` (checked with unsloth_zoo 2026.10.9).
    Measured on 2 x H200 (docs/benchmarks.md): the 8B checkpointed run's GPU peak was 13.55 GiB with and
    without it, so there Unsloth kept the probe's pass on the GPU. Nothing happens when Unsloth's
    checkpointing was never imported (the transformers backend, CPU).
    """
    import sys

    module = sys.modules.get("unsloth_zoo.gradient_checkpointing")
    reset = getattr(module, "reset_unsloth_gradient_checkpointing_buffers", None)
    if reset is None:
        return False
    reset()
    return True


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates (and whose gradients are synced), in a fixed order."""
    return [p for p in model.parameters() if p.requires_grad]
