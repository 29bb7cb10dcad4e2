"""HyperSloth config: GRPO (reinforcement learning with verifiable rewards) of a LoRA adapter on two GPUs.

Each step samples num_generations completions per prompt, scores them with the reward functions below, and
trains the adapter towards the completions that scored above their group's mean (TRL's GRPO loss; the
reward functions have TRL's signature, so TRL reward functions work unchanged). See docs/grpo.md.

    hypersloth-build-dataset --local_path FILE_OR_DIR --tokenizer MODEL --name my-prompts   # rows with prompt + answer
    hypersloth-plan hypersloth_config.py
    hypersloth-train hypersloth_config.py

Global batch = per_device_train_batch_size x gradient_accumulation_steps x len(gpus)
             = 8 x 4 x 2 = 64 completions per optimizer step = 8 prompts x 8 generations (TRL's rule);
every completion of a prompt is sampled and trained on one GPU.
"""

import re

from HyperSloth.config import (DataConfig, FastModelArgs, GrpoArgs, HyperConfig, LoraArgs, TrainingArgsConfig,
                               TrainingConfig)

ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def _text(completion) -> str:
    """A completion as text: chat prompts give [{"role": "assistant", "content": ...}], text prompts a string."""
    return completion[0]["content"] if isinstance(completion, list) else completion


def format_reward(prompts, completions, **kwargs) -> list[float]:
    """0.5 when the completion puts an answer between <answer> and </answer>."""
    return [0.5 if ANSWER.search(_text(c)) else 0.0 for c in completions]


def answer_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1 when the tagged answer equals the dataset's `answer` column (every other column arrives by name too)."""
    found = [ANSWER.search(_text(c)) for c in completions]
    return [1.0 if m and m.group(1).strip() == str(a).strip() else 0.0 for m, a in zip(found, answer)]


reward_funcs = [format_reward, answer_reward]  # logged as rewards/format_reward/mean, rewards/answer_reward/mean

hyper_config_model = HyperConfig(
    # A prompt dataset (registered with kind "prompt": rows with a `prompt`, text or chat messages).
    data=DataConfig(dataset_name="my-prompts", data_dir="data"),
    training=TrainingConfig(
        gpus=[0, 1],  # one process per GPU; any ids, e.g. [2, 3]
        method="grpo",
        grpo=GrpoArgs(
            num_generations=8,  # completions per prompt (its group)
            max_completion_length=256,
            temperature=1.0,
            beta=0.0,  # TRL's default: no KL term, no reference pass
            loss_type="dapo",  # TRL 1.15's default: token-level over the whole global batch
            reward_weights=None,  # one weight per reward function; None = 1.0 each
        ),
    ),
    fast_model_args=FastModelArgs(
        model_name="unsloth/Qwen3-0.6B",
        max_seq_length=1024,  # the longest prompt + max_completion_length must fit
        dtype="auto",  # bfloat16 on CUDA
        backend="auto",  # Unsloth when installed, else transformers + PEFT
    ),
    lora_args=LoraArgs(r=16, lora_alpha=32, lora_dropout=0.0),
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/qwen3-0.6b-grpo",
    per_device_train_batch_size=8,  # completions per GPU per accumulation step (TRL's meaning)
    gradient_accumulation_steps=4,
    learning_rate=5e-6,
    max_steps=500,
    lr_scheduler_type="constant",
    warmup_steps=0,
    optim="adamw_torch_fused",
    max_grad_norm=1.0,
    logging_steps=1,  # reward, rewards/*/mean, completions/mean_length, clip_ratio/*, ...
    save_steps=50,
    save_total_limit=2,
    report_to="tensorboard",
)
