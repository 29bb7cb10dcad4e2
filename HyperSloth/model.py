"""Load the base model and attach LoRA adapters, through Unsloth or transformers + PEFT.

Knows nothing about ranks or processes: the worker decides the backend, makes sure Unsloth is imported
before transformers/trl when it is used, and hands the model to the trainer.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from HyperSloth.config import FastModelArgs, LoraArgs

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    backend: str  # "unsloth" or "transformers"
    dtype: torch.dtype


def resolve_backend(args: FastModelArgs) -> str:
    """The backend to use here: "unsloth" or "transformers" (see `FastModelArgs.backend`)."""
    return args.resolved_backend(
        cuda_available=torch.cuda.is_available(),
        unsloth_available=importlib.util.find_spec("unsloth") is not None,
    )


def resolve_dtype(args: FastModelArgs) -> torch.dtype:
    return _DTYPES[args.resolved_dtype(cuda_available=torch.cuda.is_available())]


def import_backend(backend: str) -> None:
    """Import Unsloth first when it is the backend: it patches transformers/trl on import."""
    if backend == "unsloth":
        importlib.import_module("unsloth")


def load_model(fast: FastModelArgs, lora: LoraArgs | None) -> LoadedModel:
    """Load the base model (4-bit, 8-bit or 16/32-bit) and attach LoRA, or leave it whole for full FT."""
    backend = resolve_backend(fast)
    dtype = resolve_dtype(fast)
    if backend == "unsloth":
        model, tokenizer = _load_unsloth(fast, lora, dtype)
    else:
        model, tokenizer = _load_transformers(fast, lora, dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model=model, tokenizer=tokenizer, backend=backend, dtype=dtype)


def _load_unsloth(fast: FastModelArgs, lora: LoraArgs | None, dtype: torch.dtype):
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=fast.model_name,
        max_seq_length=fast.max_seq_length,
        dtype=dtype,
        load_in_4bit=fast.load_in_4bit,
        load_in_8bit=fast.load_in_8bit,
        full_finetuning=fast.full_finetuning,
        trust_remote_code=fast.trust_remote_code,
    )
    if lora is not None and lora.init_adapter_path:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, lora.init_adapter_path, is_trainable=True)
    elif lora is not None:
        model = _unsloth_lora(FastLanguageModel, model, fast, lora)
    _allow_packed_rows(model)
    return model, tokenizer


def _allow_packed_rows(model) -> None:
    """A packed row holds several samples and may exceed max_seq_length; Unsloth refuses it unless told."""
    from unsloth.utils.packing import mark_allow_overlength

    mark_allow_overlength(model)


def _unsloth_lora(FastLanguageModel, model, fast: FastModelArgs, lora: LoraArgs):
    return FastLanguageModel.get_peft_model(
        model,
        r=lora.r,
        target_modules=list(lora.target_modules),
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        bias=lora.bias,
        use_gradient_checkpointing=fast.use_gradient_checkpointing,
        random_state=lora.random_state,
        use_rslora=lora.use_rslora,
        max_seq_length=fast.max_seq_length,
    )


def _load_transformers(fast: FastModelArgs, lora: LoraArgs | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Remote model code runs only when the config asks for it (trust_remote_code, default False).
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": fast.attn_implementation or "sdpa",
                              "trust_remote_code": fast.trust_remote_code}
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
    if lora is None:
        return model, tokenizer
    return _attach_peft(model, lora), tokenizer


def _attach_peft(model, lora: LoraArgs):
    from peft import LoraConfig, PeftModel, get_peft_model

    if lora.init_adapter_path:
        return PeftModel.from_pretrained(model, lora.init_adapter_path, is_trainable=True)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=list(lora.target_modules),
        bias=lora.bias,
        use_rslora=lora.use_rslora,
        task_type="CAUSAL_LM",
    )
    # Seeded so every rank (and the 1-GPU reference run) starts from the same adapter weights.
    torch.manual_seed(lora.random_state)
    return get_peft_model(model, config)


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
