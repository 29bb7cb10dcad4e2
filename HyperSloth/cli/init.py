"""`hypersloth-init`: write a starter config file from a template."""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from HyperSloth.cli.command import Command, Flag, Positional
from HyperSloth.data import SAMPLE_CHAT_PATH, SAMPLE_PREFERENCE_PATH

# Template name on the command line -> file under HyperSloth/templates/.
TEMPLATES: dict[str, str] = {
    "tiny-cpu": "tiny_cpu.py",
    "lora-2gpu": "lora_2gpu.py",
    "qlora-2gpu": "qlora_2gpu.py",
    "dpo-2gpu": "dpo_2gpu.py",
    "tiny-dpo-cpu": "tiny_dpo_cpu.py",
    "grpo-2gpu": "grpo_2gpu.py",
}
# What must exist before training with each template (its model and its registered dataset).
PREPARE: dict[str, list[str]] = {
    "tiny-cpu": ["hypersloth-tiny-model", "hypersloth-build-dataset --local_path data/sample_chat.jsonl --name sample-chat --tokenizer build/tiny-qwen3 --max_seq_length 1024 --overwrite"],
    "lora-2gpu": ["hypersloth-build-dataset --local_path FILE_OR_DIR --tokenizer MODEL --name my-chat   # your data, named as in the config"],
    "qlora-2gpu": ["hypersloth-build-dataset --local_path FILE_OR_DIR --tokenizer MODEL --name my-chat   # your data, named as in the config"],
    "dpo-2gpu": ["hypersloth-build-dataset --local_path FILE_OR_DIR --tokenizer MODEL --name my-pairs   # prompt/chosen/rejected rows"],
    "tiny-dpo-cpu": ["hypersloth-tiny-model", "hypersloth-build-dataset --local_path data/sample_preference.jsonl --name sample-pairs --tokenizer build/tiny-qwen3 --max_seq_length 1024 --overwrite"],
    "grpo-2gpu": ["hypersloth-build-dataset --local_path FILE_OR_DIR --tokenizer MODEL --name my-prompts   # rows with a prompt (+ answer, ...)"],
}


# The sample data as the templates spell it (relative to a HyperSloth checkout) -> the installed package's copy.
SAMPLES = {"data/sample_chat.jsonl": SAMPLE_CHAT_PATH, "data/sample_preference.jsonl": SAMPLE_PREFERENCE_PATH}


def _for_this_folder(text: str, target: Path) -> str:
    """The template's text with commands that work from any folder: the config named as written (not
    hypersloth_config.py) and the shipped sample data by its absolute path (package data: any install has it)."""
    text = text.replace("hypersloth_config.py", str(target))
    for spelled, installed in SAMPLES.items():
        text = text.replace(spelled, str(installed))
    return text


def _template_key(template: str) -> str:
    return template.strip().lower().replace("_", "-")


def template_text(template: str) -> str:
    """Source of a template by name (dashes or underscores); ValueError listing the names if unknown."""
    key = _template_key(template)
    if key not in TEMPLATES:
        raise ValueError(f"unknown template '{template}'; choose one of: {', '.join(TEMPLATES)}")
    return resources.files("HyperSloth").joinpath("templates", TEMPLATES[key]).read_text()


def _fail(message: str) -> None:
    """Print a user error and exit with status 2 (no traceback)."""
    print(f"hypersloth-init: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def init(path: str = "hypersloth_config.py", template: str = "tiny-cpu", force: bool = False) -> None:
    """Write a commented HyperSloth config file from a template.

    Templates:
      tiny-cpu    tiny random Qwen3 on 2 CPU worker processes (no GPU, no download); the default
      lora-2gpu   16-bit LoRA of unsloth/Qwen3-0.6B on GPUs [0, 1]
      qlora-2gpu  4-bit QLoRA of unsloth/Qwen3-8B-bnb-4bit on GPUs [0, 1]
      dpo-2gpu    DPO (preference pairs) of a LoRA adapter of unsloth/Qwen3-0.6B on GPUs [0, 1]
      tiny-dpo-cpu  DPO of the tiny random Qwen3 on the sample pairs, 2 CPU worker processes
      grpo-2gpu   GRPO with format + answer reward functions: LoRA of unsloth/Qwen3-0.6B on GPUs [0, 1]

    Args:
      path: where to write the config file.
      template: one of the templates above (underscores work too: tiny_cpu).
      force: overwrite PATH if it already exists.
    """
    try:
        text = template_text(str(template))
    except ValueError as err:
        _fail(str(err))
    target = Path(str(path))
    if target.exists() and not force:
        _fail(f"{target} already exists; pass --force to overwrite it")
    if target.is_dir():
        _fail(f"{target} is a folder; give a file path such as {target / 'hypersloth_config.py'}")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(_for_this_folder(text, target))
    print(f"Wrote {target} (template {_template_key(str(template))})")
    print("Next:")
    for step in PREPARE[_template_key(str(template))]:
        print(f"  {_for_this_folder(step, target)}")
    print(f"  hypersloth-plan {target}     # check the batch plan")
    print(f"  hypersloth-train {target}    # train")


COMMAND = Command(
    prog="hypersloth-init",
    summary="""Write a commented HyperSloth config file (a Python file) from a template, and print the
commands that prepare its model and dataset. Nothing is written when a flag is wrong.

templates:
  tiny-cpu          tiny random Qwen3 on 2 CPU worker processes (no GPU, no download); the default
  lora-2gpu         16-bit LoRA of unsloth/Qwen3-0.6B on GPUs [0, 1]
  qlora-2gpu        4-bit QLoRA of unsloth/Qwen3-8B-bnb-4bit on GPUs [0, 1]
  dpo-2gpu          DPO on preference pairs: LoRA of unsloth/Qwen3-0.6B on GPUs [0, 1] (docs/dpo.md)
  tiny-dpo-cpu      DPO of the tiny random Qwen3 on the sample pairs, 2 CPU worker processes (no GPU)
  grpo-2gpu         GRPO with reward functions in the config: LoRA of unsloth/Qwen3-0.6B on GPUs [0, 1] (docs/grpo.md)""",
    positionals=(Positional("path", "PATH", "where to write the config (default hypersloth_config.py)", required=False),),
    flags=(
        Flag("template", "one of the templates above (underscores work too: tiny_cpu)", value="NAME"),
        Flag("force", "overwrite PATH if it already exists"),
    ),
    examples=(
        "hypersloth-init                                   # hypersloth_config.py, tiny-cpu",
        "hypersloth-init my_config.py --template lora-2gpu",
    ),
    notes="exit codes: 0 written, 2 nothing written (a wrong flag, an unknown template, PATH exists)",
)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `hypersloth-init` (console script via HyperSloth.cli.command)."""
    COMMAND.run(init, argv)


if __name__ == "__main__":
    main()
