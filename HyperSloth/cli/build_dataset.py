"""`hypersloth-build-dataset`: turn a chat dataset into a tokenised, response-masked, registered dataset, or
preference pairs (chosen/rejected) into prompt/chosen/rejected token ids for DPO.

Flags and help: `COMMAND` below (`hypersloth-build-dataset --help`), checked before anything runs.
User errors print one line and exit with code 2.
"""

from __future__ import annotations

import sys

from HyperSloth.cli.command import Command, Flag
from HyperSloth.data.formats import DataInputError

PROG = "hypersloth-build-dataset"
DEFAULT_PRINTED_SAMPLES = 3


def build_dataset_cli(
    hf_dataset: str | None = None,
    local_path: str | None = None,
    name: str | None = None,
    tokenizer: str | None = None,
    n: int | None = None,
    seed: int = 42,
    split: str = "train",
    max_seq_length: int = 2048,
    overlength: str = "truncate",
    format: str = "auto",  # noqa: A002 - the flag users type is --format
    chat_template: str | None = None,
    data_dir: str = "data",
    num_proc: int | None = None,
    overwrite: bool = False,
    strict: bool = False,
    print_samples: int | bool = 0,
    history_rewrite: str = "split",
    kind: str = "auto",
) -> None:
    """Build a dataset (see the module docstring / --help for every flag)."""
    from HyperSloth.data.build import build_dataset

    if (hf_dataset is None) == (local_path is None):
        raise DataInputError("give exactly one source: --hf_dataset ID or --local_path FILE_OR_DIR")
    for flag, value in (("--name", name), ("--tokenizer", tokenizer)):
        if value is None or value is True:
            raise DataInputError(f"{flag} is required (see --help)")
    if print_samples is True:  # a bare --print_samples
        print_samples = DEFAULT_PRINTED_SAMPLES
    build_dataset(
        str(hf_dataset if hf_dataset is not None else local_path),
        source_type="hf" if hf_dataset is not None else "local",
        name=str(name),
        tokenizer=str(tokenizer),
        data_dir=str(data_dir),
        max_seq_length=max_seq_length,
        n=n,
        seed=seed,
        split=str(split),
        fmt=format,
        chat_template=chat_template,
        overlength=overlength,
        strict=strict,
        overwrite=overwrite,
        num_proc=num_proc,
        print_samples=int(print_samples),
        history_rewrite=history_rewrite,
        kind=kind,
    )


COMMAND = Command(
    prog=PROG,
    summary="""Turn a chat dataset into a tokenised, response-masked dataset under DATA_DIR/built_dataset/NAME
and register it in DATA_DIR/data_config.json. Give exactly one source (--hf_dataset or --local_path),
and --name and --tokenizer.

Labels train the assistant messages' content and the template's end-of-turn token after each of
them; everything else is -100.

Records with "chosen" and "rejected" (and usually "prompt"; text or chat messages, as TRL's DPO data)
are built as preference pairs instead: prompt_input_ids, chosen_input_ids, rejected_input_ids
(docs/dpo.md). Records with a "prompt" and nothing answering it are built as prompts for GRPO:
prompt_input_ids, every other column kept for the reward functions (docs/grpo.md). --kind forces a reading.""",
    flags=(
        Flag("hf_dataset", "source: a Hugging Face Hub dataset id (needs the Hub; offline, use --local_path)",
             value="ID"),
        Flag("local_path", "source: a .jsonl, .json or .parquet file, or a folder written by save_to_disk",
             value="PATH"),
        Flag("name", "required: registry name; output goes to DATA_DIR/built_dataset/NAME", value="NAME"),
        Flag("tokenizer", "required: tokenizer folder or hub id; its chat template renders the conversations",
             value="NAME_OR_DIR"),
        Flag("n", "take a seeded random sample of N usable conversations (default: all, in order)", value="N",
             short="-n", label="-n"),
        Flag("seed", "seed of that sample (default 42)", value="SEED"),
        Flag("split", "split of a hub dataset or saved DatasetDict (default train)", value="SPLIT"),
        Flag("max_seq_length", "longest sample in tokens (default 2048)", value="L"),
        Flag("overlength", "truncate (default: keep the first L tokens) or drop samples longer than L",
             value="POLICY"),
        Flag("format", "auto (default, detected per record), sharegpt, openai or alpaca", value="FMT"),
        Flag("chat_template", "a Jinja file that replaces the tokenizer's chat template", value="FILE"),
        Flag("data_dir", "folder holding data_config.json and built_dataset/ (default data)", value="DIR"),
        Flag("num_proc", "tokenising processes (default: all cores)", value="P"),
        Flag("overwrite", "replace an existing dataset of the same name"),
        Flag("strict", "any bad record (malformed JSON, missing fields, unknown role, ...) is fatal; by default "
             "bad records are counted per reason, skipped and summarised"),
        Flag("print_samples", f"print N rendered samples (default {DEFAULT_PRINTED_SAMPLES}) with the trained "
             "tokens marked: coloured on a terminal, inside [[...]] otherwise", value="N", optional_value=True),
        Flag("history_rewrite", "when the template renders earlier replies differently once later turns follow "
             "(Qwen3 drops their <think> reasoning): split (default: one sample per reply, trained on that "
             "reply), last (the final reply only) or skip", value="MODE"),
        Flag("kind", "auto (default: preference when the records have chosen and rejected, prompt when they have "
             "a prompt and no answer), sft (chats), preference (chosen/rejected pairs for DPO) or prompt (prompts "
             "for GRPO)", value="KIND"),
    ),
    examples=(
        "hypersloth-build-dataset --hf_dataset mlabonne/FineTome-100k -n 1000 --split train \\",
        "    --name finetome-1k --tokenizer Qwen/Qwen3-8B --print_samples",
        "hypersloth-build-dataset --local_path FILE_OR_DIR --name NAME --tokenizer TOKENIZER_NAME_OR_PATH",
        "hypersloth-build-dataset --local_path data/sample_preference.jsonl --name sample-pref \\",
        "    --tokenizer build/tiny-qwen3 --print_samples 1",
    ),
    notes="exit codes: 0 built and registered, 2 a user error (reported in one line)",
)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `hypersloth-build-dataset` (console script via HyperSloth.cli.command)."""
    try:
        COMMAND.run(build_dataset_cli, argv)
    except DataInputError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
