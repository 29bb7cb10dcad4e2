"""4-bit QLoRA of Qwen3-8B on two GPUs, the setting of the original HyperSloth benchmark
(100 steps, global batch 32). Needs CUDA and `pip install 'HyperSloth[gpu]'` (Unsloth, bitsandbytes).

    hypersloth-train examples/qlora_4bit.py
"""

from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, LoraArgs, TrainingArgsConfig, TrainingConfig

hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="finetome-1k"),
    training=TrainingConfig(gpus=[0, 1]),  # batching: packed, or sorted-pad where the model needs it (checked)
    fast_model_args=FastModelArgs(
        model_name="unsloth/Qwen3-8B-bnb-4bit",  # pre-quantised weights
        max_seq_length=2048,
        load_in_4bit=True,
        backend="unsloth",
        use_gradient_checkpointing="unsloth",
    ),
    lora_args=LoraArgs(r=16, lora_alpha=16),
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/qwen3-8b-qlora",
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,  # global batch = 4 x 4 x 2 = 32
    learning_rate=2e-4,
    max_steps=100,
    warmup_steps=5,
    optim="adamw_8bit",  # 8-bit optimizer states (bitsandbytes)
    save_steps=50,
)
