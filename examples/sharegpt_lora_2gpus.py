"""The quick start: LoRA of Qwen3-4B on 1,000 ShareGPT conversations, two GPUs.

Register the data once (FineTome is ShareGPT-style: {"conversations": [{"from": ..., "value": ...}]}):
    hypersloth-build-dataset --hf_dataset mlabonne/FineTome-100k -n 1000 --name finetome-1k \
        --tokenizer unsloth/Qwen3-4B --max_seq_length 2048   # 1,000 rows
Then:
    hypersloth-plan examples/sharegpt_lora_2gpus.py
    hypersloth-train examples/sharegpt_lora_2gpus.py

Global batch = 4 per device x 4 accumulation x 2 GPUs = 32 samples per optimizer step.
"""

from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, LoraArgs, TrainingArgsConfig, TrainingConfig

hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="finetome-1k"),
    training=TrainingConfig(gpus=[0, 1], loss_type="response_only"),  # batching: packed (checked at start)
    fast_model_args=FastModelArgs(model_name="unsloth/Qwen3-4B", max_seq_length=2048),
    lora_args=LoraArgs(r=16, lora_alpha=16),
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/qwen3-4b-finetome",
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,
    learning_rate=2e-4,
    num_train_epochs=1,
    warmup_steps=5,
    logging_steps=1,
    save_steps=50,
)
