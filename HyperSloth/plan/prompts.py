"""Prompt datasets as the planner sees them (GRPO): one unit per prompt, all its completions on one rank.

The global batch is TRL's, counted in completions (per_device_train_batch_size x gradient_accumulation_steps
x world size); a step holds that many / num_generations prompts. The planner deals prompts, never
completions, so a prompt's whole group is generated, scored and trained on one rank and its advantages
need no exchange. A prompt's planned length is its group's most tokens, num_generations x (prompt +
max_completion_length), so the dealing balances the worst case; the rank packs the real sequences into
micro-batches after generating them. Each prompt counts one unit, so a step's `num_trainable` is its
prompt count.

Torch-free: the resolver and `hypersloth-plan` use it without loading torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from HyperSloth.config import GrpoArgs
from HyperSloth.plan.batching import PlanSpec, int_column

PROMPT_KIND = "prompt"  # the registry's `kind` of a prompt dataset (data/prompts.py builds it)
REQUIRED_PROMPT_COLUMNS = ("prompt_input_ids", "prompt_length", "length", "prompt_json", "columns_json")


def prompt_kind_problem(kind: str, method: str, name: str) -> str | None:
    """Why `method` cannot train on a dataset of `kind` where prompts are involved (one line), or None."""
    if method == "grpo" and kind != PROMPT_KIND:
        return (f"dataset '{name}' holds {'preference pairs' if kind == 'preference' else 'chats'} (kind '{kind}') "
                "but training.method='grpo' trains on prompts: build a prompt dataset from rows with a 'prompt' "
                "with `hypersloth-build-dataset --local_path FILE --tokenizer MODEL --name NAME --kind prompt` "
                "(docs/grpo.md)")
    if method != "grpo" and kind == PROMPT_KIND:
        return (f"dataset '{name}' holds prompts (kind 'prompt') but training.method is '{method}': set "
                "training.method='grpo' (with reward_funcs in the config file) to train on them")
    return None


def grpo_problems(grpo: GrpoArgs, global_batch_size: int, longest_prompt: int | None, max_seq_length: int) -> list[str]:
    """What stops a GRPO run with these numbers (each saying what to change); empty when nothing does."""
    problems = []
    if global_batch_size % grpo.num_generations:
        problems.append(
            f"the global batch is {global_batch_size} completions (per_device_train_batch_size x "
            f"gradient_accumulation_steps x GPUs) and num_generations is {grpo.num_generations}: the batch must hold "
            "whole groups, so make it a multiple of num_generations (TRL's rule)")
    if longest_prompt is not None and longest_prompt + grpo.max_completion_length > max_seq_length:
        problems.append(
            f"the longest prompt has {longest_prompt} tokens and max_completion_length is "
            f"{grpo.max_completion_length}: together more than fast_model_args.max_seq_length ({max_seq_length}); "
            f"raise max_seq_length to {longest_prompt + grpo.max_completion_length} or lower max_completion_length")
    return problems


def prompts_per_step(global_batch_size: int, num_generations: int) -> int:
    """Prompts in one optimizer step: the global batch of completions / completions per prompt."""
    return max(global_batch_size // num_generations, 1)


def prompt_plan_spec(spec: PlanSpec, num_generations: int) -> PlanSpec:
    """The run's planner spec (`inputs.plan_spec_for`) counting prompts instead of completions per step."""
    return dataclasses.replace(spec, samples_per_step=prompts_per_step(spec.samples_per_step, num_generations))


def prompt_plan_inputs(dataset: Any, grpo: GrpoArgs, max_seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(each prompt's planned tokens, ones) for the planner (module docstring); ValueError, saying what to
    change, for an empty dataset or a prompt that leaves no room for max_completion_length."""
    prompts = int_column(dataset, "prompt_length")
    if prompts.size == 0:
        raise ValueError("the dataset is empty: rebuild it from a file with prompts")
    problems = grpo_problems(grpo, grpo.num_generations, int(prompts.max()), max_seq_length)
    if problems:
        raise ValueError(problems[0])
    return grpo.num_generations * (prompts + grpo.max_completion_length), np.ones_like(prompts)
