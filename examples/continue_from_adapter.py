"""Continue training a saved LoRA adapter on new data.

`init_adapter_path` loads the adapter's weights (and its rank and target modules) instead of a fresh
random adapter; the optimizer and schedule start anew. To resume an interrupted run with its
optimizer state and step counter, set `resume_from_checkpoint` instead.

    hypersloth-train examples/continue_from_adapter.py
"""

from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, LoraArgs, TrainingArgsConfig, TrainingConfig

hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="my-followup-chat"),
    training=TrainingConfig(gpus=[0, 1]),
    fast_model_args=FastModelArgs(model_name="unsloth/Qwen3-4B", max_seq_length=2048),
    lora_args=LoraArgs(
        r=16,  # must match the saved adapter
        lora_alpha=16,
        init_adapter_path="outputs/qwen3-4b-finetome/checkpoint-50",  # a folder with adapter_config.json
    ),
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/qwen3-4b-followup",
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,
    learning_rate=1e-4,  # lower than the first run: refine, do not overwrite
    num_train_epochs=1,
    warmup_steps=5,
)
