"""`hypersloth-export RUN_DIR_OR_CHECKPOINT [--out OUT] [--merge] [--dtype D] [--base B] [--force] [--noverify]
[--gguf TYPE]`.

Writes OUT/adapter (a stock PEFT adapter folder + tokenizer) and, with --merge, OUT/merged (the base
model with the adapter folded in, safetensors + tokenizer); --gguf TYPE also merges and writes
OUT/gguf/<name>-<TYPE>.gguf + an Ollama Modelfile (HyperSloth/outputs/gguf). User mistakes exit with code 2
and one message, no traceback. See HyperSloth/outputs/export.py for what 4-bit and full fine-tuning runs get.
"""

from __future__ import annotations

import difflib
import sys

from HyperSloth.cli.command import Command, Flag, Positional
from HyperSloth.outputs.export import DTYPES, ExportError, ExportResult, export_run
from HyperSloth.outputs.gguf import GGUF_TYPES, GgufResult, export_run_gguf

PROG = "hypersloth-export"


def export(
    run_dir: str,
    out: str | None = None,
    merge: bool = False,
    dtype: str = "bfloat16",
    base: str | None = None,
    force: bool = False,
    verify: bool = True,
    gguf: str | None = None,
) -> None:
    """Export a finished run (or one checkpoint-N folder) for inference.

    Args:
      run_dir: the run's output_dir, or one of its checkpoint-N folders.
      out: output folder (default RUN_DIR/export); it gets adapter/ and, with --merge, merged/.
      merge: also merge the adapter into the base model and save a full model in --dtype.
      dtype: dtype of the merged weights: bfloat16 (default), float16 or float32. A 4-bit base is
        loaded unquantised from its original weights for the merge.
      base: base model folder or hub id; default: fast_model_args.model_name of the run's config.
      force: replace OUT/adapter and OUT/merged if OUT already exists.
      verify: load the exported adapter with PEFT onto a weightless base to check it fits (--noverify skips).
      gguf: also write OUT/gguf/<name>-<TYPE>.gguf (implies --merge) and an Ollama Modelfile.
    """
    if dtype not in DTYPES:
        _fail(f"--dtype {dtype!r} is not supported: choose one of {', '.join(DTYPES)}")
    if gguf is not None and str(gguf).lower() not in GGUF_TYPES:
        close = difflib.get_close_matches(str(gguf).lower(), GGUF_TYPES, n=1)
        _fail(f"--gguf {gguf!r} is not a GGUF type: choose one of {', '.join(GGUF_TYPES)}"
              + (f" (did you mean {close[0]}?)" if close else ""))
    common = dict(dtype=dtype, base=None if base is None else str(base), force=bool(force), verify=bool(verify))
    gguf_result = None
    try:
        if gguf is None:
            result = export_run(str(run_dir), None if out is None else str(out), merge=bool(merge), **common)
        else:
            result, gguf_result = export_run_gguf(str(run_dir), None if out is None else str(out),
                                                  str(gguf).lower(), **common)
    except ExportError as err:
        _fail(str(err))
    print(_usage_lines(result, dtype) + (_gguf_lines(gguf_result) if gguf_result else ""))


def _usage_lines(result: ExportResult, dtype: str) -> str:
    lines = []
    if result.adapter_dir is not None:
        lines += [
            f"adapter: {result.adapter_dir}",
            f"  PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({result.base!r}), "
            f"{str(result.adapter_dir)!r})",
        ]
    if result.merged_dir is not None:
        lines += [f"merged ({dtype}): {result.merged_dir}",
                  f"  AutoModelForCausalLM.from_pretrained({str(result.merged_dir)!r})"]
    return "\n".join(lines)


def _gguf_lines(result: GgufResult) -> str:
    return (f"\ngguf: {result.gguf_file}\n  llama-cli -m {result.gguf_file} -cnv"
            f"\n  cd {result.modelfile.parent} && ollama create NAME -f {result.modelfile.name} && ollama run NAME")


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


COMMAND = Command(
    prog=PROG,
    summary="""Export a finished run (or one of its checkpoint-N folders) for inference: OUT/adapter is a
stock PEFT adapter folder with the tokenizer; with --merge, OUT/merged is the base model with the
adapter folded in (safetensors + tokenizer); with --gguf TYPE, also OUT/gguf/<name>-TYPE.gguf for
llama.cpp / Ollama / LM Studio and an Ollama Modelfile (docs/export.md). A 4-bit base is loaded
unquantised from its original weights for the merge.""",
    positionals=(Positional("run_dir", "RUN_DIR", "the run's output_dir, or one of its checkpoint-N folders"),),
    flags=(
        Flag("out", "output folder (default RUN_DIR/export); it gets adapter/ and, with --merge, merged/",
             value="OUT"),
        Flag("merge", "also merge the adapter into the base model and save a full model in --dtype"),
        Flag("dtype", f"dtype of the merged weights: {', '.join(DTYPES)} (default bfloat16)", value="DTYPE"),
        Flag("base", "base model folder or hub id (default: fast_model_args.model_name of the run's config)",
             value="MODEL"),
        Flag("force", "replace OUT/adapter and OUT/merged if OUT already exists"),
        Flag("verify", "skip loading the exported adapter with PEFT onto a weightless base (the check "
             "that it fits, done by default)", label="--noverify"),
        Flag("gguf", f"also write OUT/gguf/<name>-TYPE.gguf for llama.cpp / Ollama (implies --merge) and an "
             f"Ollama Modelfile; TYPE: {', '.join(GGUF_TYPES)}", value="TYPE"),
    ),
    examples=(
        "hypersloth-export outputs/run                      # outputs/run/export/adapter",
        "hypersloth-export outputs/run --merge --dtype float16 --out exported",
        "hypersloth-export outputs/run/checkpoint-100 --noverify",
        "hypersloth-export outputs/run --gguf q8_0          # outputs/run/export/gguf/run-q8_0.gguf",
    ),
    notes="exit codes: 0 exported, 2 nothing exported (a wrong flag or run folder, OUT exists without --force)",
)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `hypersloth-export` (console script via HyperSloth.cli.command)."""
    COMMAND.run(export, argv)


if __name__ == "__main__":
    main()
