"""Export a finished run: its LoRA adapter as a stock PEFT folder, optionally merged into the base model.

`export_run(RUN, OUT)` writes
  OUT/adapter   adapter_config.json + adapter_model.safetensors + tokenizer (+ hypersloth_config.json):
                `peft.PeftModel.from_pretrained(base, OUT/adapter)` loads it
  OUT/merged    (merge=True) base + adapter folded into plain weights, safetensors + tokenizer:
                `transformers.AutoModelForCausalLM.from_pretrained(OUT/merged)` loads it
RUN is a run's output_dir or one of its checkpoint-N folders. The base model is the run's
`fast_model_args.model_name` (from hypersloth_config.json) unless `base` overrides it.

4-bit (QLoRA) runs: the merge never writes quantised weights. The base is loaded *unquantised* in
the chosen dtype from its original weights and the adapter is added to those. This is the usual
QLoRA merge; the result differs from the trained model by the base's quantisation error. A base
stored pre-quantised (e.g. `unsloth/Qwen3-8B-bnb-4bit`, whose config.json holds a
quantization_config) has no original weights to load: for the merge, pass `base` = its 16-bit
original (e.g. `unsloth/Qwen3-8B`); the adapter alone exports against the quantised base as is.
The merge runs on CPU, so it needs about (parameters x dtype size) of RAM.

A full fine-tuning run has no adapter: its weights are already the model, and OUT/merged gets
them re-saved in the chosen dtype. Every user mistake raises `ExportError` with what to change.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from loguru import logger

from HyperSloth.outputs import run_files
from HyperSloth.outputs.run_files import CONFIG_FILE
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
DTYPES = ("bfloat16", "float16", "float32")
Dtype = Literal["bfloat16", "float16", "float32"]
# Suffixes of pre-quantised hub checkpoints, stripped to suggest the original weights.
_QUANT_SUFFIX = re.compile(r"(-unsloth)?-bnb-4bit$|-bnb-8bit$|-4bit$", re.IGNORECASE)


class ExportError(Exception):
    """A user mistake (missing adapter, missing base, existing output...); the message says what to change."""


@dataclass(frozen=True)
class RunSource:
    """What a run (or checkpoint) folder holds."""

    path: Path
    kind: Literal["adapter", "full"]  # a LoRA adapter, or full fine-tuned weights
    base: str | None  # the base model the run names (None: it names none)
    config_dir: Path | None  # folder of the config file the run was trained from
    load_in_4bit: bool


@dataclass(frozen=True)
class ExportResult:
    """Folders written by `export_run` (None where nothing was written) and the base used."""

    adapter_dir: Path | None
    merged_dir: Path | None
    base: str | None


def inspect_run(run_dir: str | os.PathLike) -> RunSource:
    """Classify a run/checkpoint folder; ExportError if it holds neither an adapter nor a full model."""
    path = Path(run_dir).expanduser().resolve()
    if not path.is_dir():
        raise ExportError(f"{path}: no such folder; give a run's output_dir or one of its checkpoint-N folders")
    resolved = _read_json(path / CONFIG_FILE)
    fast = resolved.get("hyper_config", {}).get("fast_model_args", {})
    source = resolved.get("source_path")
    config_dir = Path(source).parent if source else None
    if (path / ADAPTER_CONFIG).is_file() and any((path / name).is_file() for name in ADAPTER_WEIGHTS):
        base = fast.get("model_name") or _read_json(path / ADAPTER_CONFIG).get("base_model_name_or_path")
        return RunSource(path, "adapter", base, config_dir, bool(fast.get("load_in_4bit")))
    if (path / "config.json").is_file() and _has_model_weights(path):
        return RunSource(path, "full", fast.get("model_name"), config_dir, False)
    raise ExportError(f"{path} holds no trained adapter ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS[0]}) and no "
                      f"full model{_checkpoint_hint(path)}")


def export_run(
    run_dir: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    merge: bool = False,
    dtype: Dtype = "bfloat16",
    base: str | None = None,
    force: bool = False,
    verify: bool = True,
) -> ExportResult:
    """Write OUT/adapter (and OUT/merged with `merge`) for a run; OUT defaults to RUN/export.

    OUT must not exist (or be empty) unless `force`, which replaces OUT/adapter and OUT/merged only.
    """
    _check_dtype(dtype)
    source = inspect_run(run_dir)
    out_dir = Path(out).expanduser().resolve() if out is not None else source.path / "export"
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise ExportError(f"{out_dir} already exists: pass --force to replace its adapter/ and merged/ folders, "
                          "or choose another --out")
    if source.kind == "full":
        logger.info(f"{source.path} is a full fine-tune: no adapter to export; writing its weights to merged/")
        merged = save_full_model(source.path, out_dir / "merged", dtype=dtype, force=True)
        return ExportResult(adapter_dir=None, merged_dir=merged, base=source.base)
    base_name = resolve_base(source, base, for_merge=merge)  # before writing anything
    adapter = export_adapter(source.path, out_dir / "adapter", base=base_name, force=True, verify=verify)
    merged = merge_adapter(source.path, out_dir / "merged", base=base_name, dtype=dtype, force=True) if merge else None
    return ExportResult(adapter_dir=adapter, merged_dir=merged, base=base_name)


def export_adapter(
    run_dir: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    base: str | None = None,
    force: bool = False,
    verify: bool = True,
) -> Path:
    """Copy a run's adapter + tokenizer into `dest` as a stock PEFT folder and return `dest`.

    The adapter config's `base_model_name_or_path` is set to the resolved base, so
    `AutoPeftModelForCausalLM.from_pretrained(dest)` finds it too. `verify` loads the folder with
    `PeftModel.from_pretrained` onto a weightless (meta-device) copy of the base and checks that
    every saved tensor lands on a module of the same shape: cheap even for a 70B base.
    """
    source = inspect_run(run_dir)
    if source.kind != "adapter":
        raise ExportError(f"{source.path} holds a full fine-tuned model, not an adapter: use merge/export_run")
    base_name = resolve_base(source, base)
    with _staged(Path(dest), force) as staging:
        for name in (ADAPTER_CONFIG, *ADAPTER_WEIGHTS, CONFIG_FILE):
            if (source.path / name).is_file():
                shutil.copy2(source.path / name, staging / name)
        _set_base_name(staging / ADAPTER_CONFIG, base_name)
        _save_tokenizer(source.path, base_name, staging)
        _check_copied(source.path, staging)
        if verify:
            verify_adapter(staging, base_name)
    logger.info(f"adapter written to {dest}")
    return Path(dest)


def merge_adapter(
    run_dir: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    base: str | None = None,
    dtype: Dtype = "bfloat16",
    force: bool = False,
) -> Path:
    """Merge a run's adapter into its base (loaded unquantised in `dtype`, on CPU) and save to `dest`."""
    _check_dtype(dtype)
    source = inspect_run(run_dir)
    if source.kind != "adapter":
        return save_full_model(source.path, dest, dtype=dtype, force=force)
    base_name = resolve_base(source, base, for_merge=True)
    if source.load_in_4bit:
        logger.info(f"the run trained on a 4-bit base; merging into {base_name}'s unquantised weights in {dtype}")
    with _staged(Path(dest), force) as staging:
        model = _attach_adapter(_load_base(base_name, dtype), source.path, base_name)
        merged = model.merge_and_unload()
        merged.save_pretrained(str(staging), safe_serialization=True)
        _save_tokenizer(source.path, base_name, staging)
    logger.info(f"merged model ({dtype}) written to {dest}")
    return Path(dest)


def save_full_model(
    run_dir: str | os.PathLike, dest: str | os.PathLike, *, dtype: Dtype = "bfloat16", force: bool = False
) -> Path:
    """Re-save a full fine-tuned model folder (weights + tokenizer) in `dtype`."""
    _check_dtype(dtype)
    from transformers import AutoModelForCausalLM

    source = Path(run_dir).expanduser().resolve()
    with _staged(Path(dest), force) as staging:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=_torch_dtype(dtype))
        model.save_pretrained(str(staging), safe_serialization=True)
        _save_tokenizer(source, None, staging)
    return Path(dest)


def resolve_base(source: RunSource, override: str | None = None, *, for_merge: bool = False) -> str:
    """The base model: an absolute local folder or a hub id; ExportError if missing.

    `for_merge` also refuses a pre-quantised base (the merge needs its original weights); an adapter
    alone is exported against whatever base it was trained on.
    """
    name = override or source.base
    if not name:
        raise ExportError(f"{source.path} does not name its base model (no {CONFIG_FILE}, no base_model_name_or_path "
                          "in adapter_config.json): pass --base PATH_OR_HUB_ID")
    folder = _local_folder(name, source.config_dir if override is None else None)
    if folder is not None:
        quant = _read_json(folder / "config.json").get("quantization_config")
        name = str(folder)
    elif _is_local_spelling(name):
        where = "--base" if override else f"the run's {CONFIG_FILE} (fast_model_args.model_name)"
        raise ExportError(f"base model folder {name} (from {where}) not found: pass --base with the folder or hub "
                          "id of the model the run was trained from")
    else:
        quant = _hub_config(name).get("quantization_config")
    if quant and for_merge:
        raise ExportError(_prequantised_message(name, quant))
    return name


def verify_adapter(adapter_dir: str | os.PathLike, base: str) -> None:
    """Load `adapter_dir` with stock PEFT onto a weightless base; ExportError unless every tensor fits."""
    import torch
    from peft import get_peft_model_state_dict, load_peft_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # shapes and names only: no base weights are read
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    model = _attach_adapter(skeleton, adapter_dir, base, low_cpu_mem_usage=True)
    loaded = get_peft_model_state_dict(model)
    saved = load_peft_weights(str(adapter_dir), device="cpu")
    missing, unused = sorted(set(loaded) - set(saved)), sorted(set(saved) - set(loaded))
    wrong = [k for k in set(saved) & set(loaded) if tuple(saved[k].shape) != tuple(loaded[k].shape)]
    if missing or unused or wrong:
        raise ExportError(f"the adapter does not fit base {base}: {len(unused)} saved tensor(s) match no module "
                          f"(e.g. {unused[:2]}), {len(missing)} adapter tensor(s) absent, {len(wrong)} of another "
                          "shape; pass --base with the model the run was trained from")


def _attach_adapter(model, adapter_dir: str | os.PathLike, base: str, **kwargs: Any):
    """`PeftModel.from_pretrained`, with a shape mismatch (adapter of another model) as an ExportError."""
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, str(adapter_dir), **kwargs)
    except (RuntimeError, ValueError, KeyError) as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        reason = next((line for line in lines if "mismatch" in line), lines[0])[:300]
        raise ExportError(f"the adapter does not fit base {base} ({reason}); pass --base with the model the run "
                          "was trained from") from None


def _load_base(name: str, dtype: str):
    from transformers import AutoModelForCausalLM

    # Never a quantization_config: the merge is written in dtype from the original weights.
    return AutoModelForCausalLM.from_pretrained(name, dtype=_torch_dtype(dtype))


def _torch_dtype(dtype: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not supported: choose one of {', '.join(DTYPES)}")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ExportError(f"{path}: cannot read it ({err}); restore it from the run or pass --base") from None
    return content if isinstance(content, dict) else {}


def _has_model_weights(path: Path) -> bool:
    return any(path.glob("model*.safetensors")) or (path / "pytorch_model.bin").is_file()


def _checkpoint_hint(path: Path) -> str:
    checkpoints = sorted(path.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]) if
                         p.name.split("-")[-1].isdigit() else -1)
    if checkpoints:
        return f"; export one of its checkpoints instead, e.g. {checkpoints[-1]}"
    return "; give a finished run's output_dir or one of its checkpoint-N folders"


def _is_local_spelling(name: str) -> bool:
    """Absolute, ./, ../ and ~ paths are folders; anything else may also be a hub id."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1  # hub ids are "org/name"


def _local_folder(name: str, config_dir: Path | None) -> Path | None:
    """`name` as an existing folder: relative to the working directory, else to the run's config file."""
    candidates = [Path(name).expanduser()]
    if config_dir is not None and not Path(name).is_absolute():
        candidates.append(config_dir / name)
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate.resolve()
    return None


def _hub_config(name: str) -> dict[str, Any]:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name).to_dict()
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ExportError(f"base model '{name}' not found: it is not a local folder and cannot be loaded from the "
                          f"Hugging Face Hub or its cache ({first}); pass --base PATH_OR_HUB_ID") from None


def _prequantised_message(name: str, quant: dict[str, Any]) -> str:
    method = quant.get("quant_method", "quantised") if isinstance(quant, dict) else "quantised"
    original = _QUANT_SUFFIX.sub("", name)
    hint = f", e.g. --base {original}" if original != name else ""
    return (f"base model {name} is stored pre-quantised ({method}); a merge needs the original 16-bit weights: "
            f"pass --base with the unquantised model the quantised one was made from{hint}")


def _set_base_name(config_path: Path, base: str) -> None:
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _save_tokenizer(run_path: Path, base: str | None, dest: Path) -> None:
    """The tokenizer the run saved (it may carry a changed chat template), else the base model's."""
    from transformers import AutoTokenizer

    has_own = (run_path / "tokenizer_config.json").is_file()
    if not has_own and base is None:
        raise ExportError(f"{run_path} holds no tokenizer and names no base model to take one from: pass --base")
    AutoTokenizer.from_pretrained(str(run_path) if has_own else base).save_pretrained(str(dest))


def _check_copied(source: Path, staging: Path) -> None:
    for name in ADAPTER_WEIGHTS:
        if (source / name).is_file() and run_files.file_sha256(source / name) != run_files.file_sha256(staging / name):
            raise ExportError(f"copying {source / name} changed its bytes (disk full?); free space and retry")


@contextmanager
def _staged(dest: Path, force: bool) -> Iterator[Path]:
    """Yield a hidden folder beside `dest`, renamed to `dest` on success: a failure leaves no half export."""
    dest = dest.expanduser().resolve()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())) and not force:
        raise ExportError(f"{dest} already exists: pass --force to replace it, or choose another --out")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield staging
        run_files.replace_dir(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
