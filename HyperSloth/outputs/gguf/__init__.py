"""GGUF export: a finished run as one file that llama.cpp, Ollama and LM Studio load (`hypersloth-export --gguf`).

`export_run_gguf(RUN, OUT, TYPE)` merges the run (OUT/adapter, OUT/merged as `export_run(merge=True)` writes
them) and writes
  OUT/gguf/<name>-<TYPE>.gguf   the merged model, its tokenizer and chat template (writer.py)
  OUT/gguf/Modelfile            for `ollama create` (modelfile.py)
<name> is the run folder's name (`<run>-checkpoint-N` for a checkpoint). The architecture is checked before
the merge, so a model llama.cpp cannot run is refused before anything is written (architectures.py).
docs/export.md has what llama.cpp itself was measured to load and compute from these files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from HyperSloth.outputs import run_files
from HyperSloth.outputs.export import (
    Dtype,
    ExportError,
    ExportResult,
    export_run,
    inspect_run,
    resolve_base,
)
from HyperSloth.outputs.gguf.architectures import SUPPORTED, architecture_of
from HyperSloth.outputs.gguf.modelfile import modelfile_text
from HyperSloth.outputs.gguf.writer import GGUF_TYPES, read_config, write_gguf

__all__ = ["GGUF_TYPES", "SUPPORTED", "GgufResult", "export_gguf", "export_run_gguf", "write_gguf"]
GGUF_DIR = "gguf"
MODELFILE = "Modelfile"


@dataclass(frozen=True)
class GgufResult:
    """The files `export_gguf` wrote."""

    gguf_file: Path
    modelfile: Path


def export_run_gguf(
    run_dir: str | os.PathLike,
    out: str | os.PathLike | None,
    gguf_type: str,
    *,
    dtype: Dtype = "bfloat16",
    base: str | None = None,
    force: bool = False,
    verify: bool = True,
) -> tuple[ExportResult, GgufResult]:
    """`export_run(merge=True)`, then OUT/gguf/<name>-<TYPE>.gguf and its Modelfile from OUT/merged."""
    if gguf_type not in GGUF_TYPES:
        raise ExportError(f"--gguf {gguf_type!r} is not supported: choose one of {', '.join(GGUF_TYPES)}")
    require_gguf()
    source = inspect_run(run_dir)
    check_architecture(source.path, base)
    result = export_run(source.path, out, merge=True, dtype=dtype, base=base, force=force, verify=verify)
    assert result.merged_dir is not None  # merge=True always writes it
    return result, export_gguf(result.merged_dir, result.merged_dir.parent / GGUF_DIR, gguf_type,
                               name=gguf_name(source.path))


def export_gguf(merged_dir: str | os.PathLike, out_dir: str | os.PathLike, gguf_type: str, *, name: str) -> GgufResult:
    """Write OUT_DIR/<name>-<TYPE>.gguf from a merged model folder, and OUT_DIR/Modelfile naming it."""
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    gguf_file = write_gguf(merged_dir, out_dir / f"{name}-{gguf_type}.gguf", gguf_type, name=name)
    tokenizer = AutoTokenizer.from_pretrained(str(merged_dir))
    text = modelfile_text(gguf_file.name, tokenizer.chat_template, tokenizer.eos_token)
    return GgufResult(gguf_file, run_files.atomic_write_text(out_dir / MODELFILE, text))


def require_gguf() -> None:
    """ExportError naming the install command when the optional `gguf` package is missing."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ExportError("--gguf needs the gguf package (the llama.cpp project's GGUF writer): "
                          "pip install 'HyperSloth[gguf]' (or pip install gguf)") from None


def check_architecture(run_path: Path, base: str | None) -> None:
    """ExportError, before any merge, if the model the run exports is not one the GGUF writer supports."""
    source = inspect_run(run_path)
    if source.kind == "full":
        architecture_of(read_config(source.path), str(source.path))
        return
    name = resolve_base(source, base, for_merge=True)
    if Path(name).is_dir():
        architecture_of(read_config(Path(name)), f"base model {name}")
        return
    from transformers import AutoConfig

    architecture_of(AutoConfig.from_pretrained(name).to_dict(), f"base model {name}")


def gguf_name(run_path: Path) -> str:
    """The run folder's name; a checkpoint's is prefixed with its run's (`run-checkpoint-100`)."""
    if run_files.checkpoint_step(run_path) is not None:
        return f"{run_path.parent.name}-{run_path.name}"
    return run_path.name
