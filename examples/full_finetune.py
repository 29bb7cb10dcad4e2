"""Full fine-tuning (every weight trains) of Qwen3-0.6B on two GPUs.

`lora_args=None` is what selects full fine-tuning; HyperConfig then sets
fast_model_args.full_finetuning=True. Weights, gradients and AdamW states all live on each GPU
(about 16 bytes per parameter: ~10 GB for 0.6B), so keep the model small and the rate low.

    hypersloth-train examples/full_finetune.py
"""

from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, TrainingArgsConfig, TrainingConfig

hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="finetome-1k"),
    training=TrainingConfig(gpus=[0, 1]),
    fast_model_args=FastModelArgs(
        model_name="unsloth/Qwen3-0.6B",
        max_seq_length=2048,
        dtype="bfloat16",
        use_gradient_checkpointing=True,  # activations are recomputed instead of stored
    ),
    lora_args=None,  # no adapter: train the base weights themselves
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/qwen3-0.6b-full",
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,  # global batch = 4 x 4 x 2 = 32
    learning_rate=1e-5,  # full fine-tuning needs a far lower rate than LoRA
    num_train_epochs=1,
    lr_scheduler_type="cosine",
    warmup_steps=10,
    weight_decay=0.01,
    save_steps=100,
    save_total_limit=1,  # full checkpoints are large
)
