"""The TRL arguments a config passes through, checked before any worker starts: `extra_args` names and
`report_to` integrations.

Each worker builds TRL's `SFTConfig(**kwargs)` (train/trainer_args.py); a misspelt `extra_args` key or a
`report_to="wandb"` without wandb installed used to fail there, in every worker, after the model loaded.
plan/ imports no transformers or TRL (hypersloth-plan stays fast and torch-free), so the names come from
their installed sources, read as text: `SFTConfig`'s dataclass fields and those of transformers'
`TrainingArguments` it extends (the same set as `dataclasses.fields(SFTConfig)`, checked by the tests).
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
from functools import lru_cache
from pathlib import Path

# (package, file inside it, class): SFTConfig extends TrainingArguments.
_SOURCES = (("transformers", "training_args.py", "TrainingArguments"), ("trl", "trainer/sft_config.py", "SFTConfig"))

# report_to names -> the modules transformers' integration imports for them (any one is enough).
REPORTERS: dict[str, tuple[str, ...]] = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
    "comet_ml": ("comet_ml",),
    "neptune": ("neptune",),
    "clearml": ("clearml",),
    "dvclive": ("dvclive",),
    "trackio": ("trackio",),
    "swanlab": ("swanlab",),
    "codecarbon": ("codecarbon",),
    "azure_ml": ("azureml",),
    "dagshub": ("dagshub",),
    "flyte": ("flytekit",),
}


def _class_fields(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    return {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


@lru_cache(maxsize=1)
def sft_config_fields() -> frozenset[str] | None:
    """Every argument name `trl.SFTConfig` accepts, or None when the sources cannot be read (then nothing is
    checked here and SFTConfig still refuses a wrong name in the workers)."""
    names: set[str] = set()
    try:
        for package, file, cls in _SOURCES:
            spec = importlib.util.find_spec(package)
            if spec is None or spec.origin is None:
                return None
            names |= _class_fields(Path(spec.origin).parent / file, cls)
    except (OSError, SyntaxError, StopIteration):
        return None
    return frozenset(names)


def extra_args_problems(extra_args: dict[str, object]) -> list[str]:
    """One line per `extra_args` key that TRL's SFTConfig does not accept, with the closest valid name."""
    fields = sft_config_fields()
    if fields is None:
        return []
    problems = []
    for key in sorted(set(extra_args) - fields):
        close = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else "see transformers' TrainingArguments and TRL's SFTConfig"
        problems.append(f"training_config.extra_args: '{key}' is not an argument of TRL's SFTConfig — {hint}")
    return problems


def report_to_problems(report_to: str | list[str]) -> list[str]:
    """One line per `report_to` integration that is not installed (or is misspelt)."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    problems = []
    for name in names:
        if name in ("none", "all"):
            continue
        modules = REPORTERS.get(name)
        if modules is None:
            close = difflib.get_close_matches(name, list(REPORTERS), n=1, cutoff=0.7)
            if close:
                problems.append(f"report_to '{name}' is not an integration — did you mean '{close[0]}'?")
            continue  # an integration newer than this list: transformers judges it
        if not any(importlib.util.find_spec(m) is not None for m in modules):
            problems.append(f"report_to '{name}' needs the '{modules[0]}' package, which is not installed: "
                            f"`pip install {modules[0]}`, or set report_to='none' (or 'tensorboard')")
    return problems
