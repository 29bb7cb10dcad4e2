"""`hypersloth-export RUN_DIR_OR_CHECKPOINT [--out OUT] [--merge] [--dtype D] [--base B] [--force] [--noverify]`.

Writes OUT/adapter (a stock PEFT adapter folder + tokenizer) and, with --merge, OUT/merged (the base
model with the adapter folded in, safetensors + tokenizer). User mistakes exit with code 2 and one
message, no traceback. See HyperSloth/outputs/export.py for what 4-bit and full fine-tuning runs get.
"""

from __future__ import annotations

import sys

from HyperSloth.cli.command import Command, Flag, Positional
from HyperSloth.outputs.export import DTYPES, ExportError, ExportResult, export_run

PROG = "hypersloth-export"


def export(
    run_dir: str,
    out: str | None = None,
    merge: bool = False,
    dtype: str = "bfloat16",
    base: str | None = None,
    force: bool = False,
    verify: bool = True,
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
    """
    if dtype not in DTYPES:
        _fail(f"--dtype {dtype!r} is not supported: choose one of {', '.join(DTYPES)}")
    try:
        result = export_run(
            str(run_dir), None if out is None else str(out), merge=bool(merge), dtype=dtype,  # type: ignore[arg-type]
            base=None if base is None else str(base), force=bool(force), verify=bool(verify),
        )
    except ExportError as err:
        _fail(str(err))
    print(_usage_lines(result, dtype))


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


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


COMMAND = Command(
    prog=PROG,
    summary="""Export a finished run (or one of its checkpoint-N folders) for inference: OUT/adapter is a
stock PEFT adapter folder with the tokenizer; with --merge, OUT/merged is the base model with the
adapter folded in (safetensors + tokenizer). A 4-bit base is loaded unquantised from its original
weights for the merge.""",
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
    ),
    examples=(
        "hypersloth-export outputs/run                      # outputs/run/export/adapter",
        "hypersloth-export outputs/run --merge --dtype float16 --out exported",
        "hypersloth-export outputs/run/checkpoint-100 --noverify",
    ),
    notes="exit codes: 0 exported, 2 nothing exported (a wrong flag or run folder, OUT exists without --force)",
)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `hypersloth-export` (console script via HyperSloth.cli.command)."""
    COMMAND.run(export, argv)


if __name__ == "__main__":
    main()
