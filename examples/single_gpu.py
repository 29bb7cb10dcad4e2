"""One GPU: the same code path as multi-GPU with a world of one process (no process group traffic).

    hypersloth-train examples/single_gpu.py

Global batch = 4 per device x 8 accumulation x 1 GPU = 32 samples per optimizer step, the same as
sharegpt_lora_2gpus.py, so the two runs are comparable step for step.
"""

from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, LoraArgs, TrainingArgsConfig, TrainingConfig

hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="finetome-1k"),
    training=TrainingConfig(gpus=[0]),
    fast_model_args=FastModelArgs(model_name="unsloth/Qwen3-4B", max_seq_length=2048),
    lora_args=LoraArgs(r=16, lora_alpha=16),
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/qwen3-4b-finetome-1gpu",
    per_device_train_batch_size=4,
    gradient_accumulation_steps=8,  # twice the 2-GPU value keeps the global batch at 32
    learning_rate=2e-4,
    num_train_epochs=1,
    save_steps=50,
)
