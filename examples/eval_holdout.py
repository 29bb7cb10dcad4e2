"""Evaluate while training: hold out 5% of the conversations, keep the best adapter, stop early.

The quick start (`sharegpt_lora_2gpus.py`) with an eval set. Register the data once:
    hypersloth-build-dataset --hf_dataset mlabonne/FineTome-100k -n 1000 --name finetome-1k \
        --tokenizer unsloth/Qwen3-4B --max_seq_length 2048   # 1,000 rows
Then:
    hypersloth-plan examples/eval_holdout.py        # the training plan and the eval plan
    hypersloth-train examples/eval_holdout.py

50 of the 1,000 conversations (a seeded choice: `seed` below) are never trained on; every 10
optimizer steps and after the last one, the token-mean loss on their assistant tokens is computed
over both GPUs. The lowest one's adapter is kept in outputs/qwen3-4b-finetome-eval/best_adapter/,
and training stops after 3 evaluations in a row without a new lowest loss. The eval curve is in
report.png / report.md and in TensorBoard (eval/loss). See docs/evaluation.md.
"""

from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, LoraArgs, TrainingArgsConfig, TrainingConfig

hyper_config_model = HyperConfig(
    # eval_fraction: the share of conversations held out (in [0, 0.5]); or eval_dataset_name="..." for a
    # separately built eval dataset.
    data=DataConfig(dataset_name="finetome-1k", eval_fraction=0.05),
    training=TrainingConfig(gpus=[0, 1], loss_type="response_only"),  # batching: packed (checked at start)
    fast_model_args=FastModelArgs(model_name="unsloth/Qwen3-4B", max_seq_length=2048),
    lora_args=LoraArgs(r=16, lora_alpha=16),
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/qwen3-4b-finetome-eval",
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,
    learning_rate=2e-4,
    num_train_epochs=2,
    warmup_steps=5,
    logging_steps=1,
    save_steps=50,
    seed=42,  # also chooses the held-out conversations
    eval_steps=10,  # evaluate every 10 optimizer steps (and always after the last one)
    early_stopping_patience=3,  # stop after 3 evaluations without improvement; None = never stop early
    save_best_adapter=True,  # OUTPUT_DIR/best_adapter/ loads with PeftModel.from_pretrained
)
