"""GRPO with rule-based rewards (format + answer) on the CPU: the tiny random Qwen3, 2 worker processes.

The shipped arithmetic prompts (data/sample_prompts.jsonl: a chat `prompt` and an `answer` column) are sampled
4 times each per step; two reward functions score each completion: 0.5 for an <answer>...</answer> tag, 1 for
the right number in it. A random tiny model rarely earns either, so expect rewards near 0: this shows the
mechanics (what is logged, how the config carries the rewards), not learning. On a GPU use the grpo-2gpu template.

    hypersloth-tiny-model
    hypersloth-build-dataset --local_path data/sample_prompts.jsonl --name sample-prompts --tokenizer build/tiny-qwen3
    hypersloth-train examples/grpo_tiny_cpu.py
"""

import re

from HyperSloth.config import (DataConfig, FastModelArgs, GrpoArgs, HyperConfig, LoraArgs, TrainingArgsConfig,
                               TrainingConfig)

ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def format_reward(prompts, completions, **kwargs):
    """0.5 when the completion tags an answer."""
    return [0.5 if ANSWER.search(c[0]["content"]) else 0.0 for c in completions]


def answer_reward(prompts, completions, answer, **kwargs):
    """1 when the tagged answer is the `answer` column's."""
    found = [ANSWER.search(c[0]["content"]) for c in completions]
    return [1.0 if m and m.group(1).strip() == a else 0.0 for m, a in zip(found, answer)]


reward_funcs = [format_reward, answer_reward]

hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="sample-prompts", data_dir="data"),
    training=TrainingConfig(gpus=[0, 1], method="grpo",
                            grpo=GrpoArgs(num_generations=4, max_completion_length=32)),
    fast_model_args=FastModelArgs(model_name="build/tiny-qwen3", max_seq_length=128, dtype="float32"),
    lora_args=LoraArgs(r=16, lora_alpha=16),
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/tiny-grpo",
    per_device_train_batch_size=4,  # 4 completions x 2 accumulation x 2 workers = 16 = 4 prompts x 4 generations
    gradient_accumulation_steps=2,
    learning_rate=1e-2,
    max_steps=10,
    warmup_steps=0,
    logging_steps=1,
    save_steps=10,
    report_to="none",
)
