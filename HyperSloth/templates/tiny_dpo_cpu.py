"""HyperSloth config: DPO (preference tuning) of the tiny model on 2 CPU workers (no GPU, no internet needed).

The CPU recipe of the dpo-2gpu template: the tiny random-weight Qwen3 and the shipped sample pairs (prompt,
chosen, rejected). The reference model is the same weights with the adapter disabled. See docs/dpo.md.
Before training, build the two local inputs this file names:
    hypersloth-tiny-model                                 # random-weight tiny Qwen3 -> build/tiny-qwen3
    hypersloth-build-dataset --local_path data/sample_preference.jsonl --name sample-pairs \
        --tokenizer build/tiny-qwen3 --max_seq_length 1024 --overwrite   # registers 'sample-pairs' (kind: preference)
Then:
    hypersloth-plan hypersloth_config.py                  # the batch plan, in pairs
    hypersloth-train hypersloth_config.py

Global batch = per_device_train_batch_size x gradient_accumulation_steps x len(gpus)
             = 4 x 2 x 2 = 16 pairs per optimizer step; the loss is the mean over those 16 pairs.
"""

from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, LoraArgs, TrainingArgsConfig, TrainingConfig

hyper_config_model = HyperConfig(
    # A preference dataset (registered with kind "preference"); a chat dataset is refused for DPO.
    data=DataConfig(dataset_name="sample-pairs", data_dir="data"),
    training=TrainingConfig(
        gpus=[0, 1],  # without CUDA the ids only count processes: 2 CPU workers over gloo
        method="dpo",
        dpo_beta=0.1,  # larger keeps the policy closer to the reference
        batching="packed",  # each pair's prompt+chosen and prompt+rejected packed padding-free
    ),
    fast_model_args=FastModelArgs(
        model_name="build/tiny-qwen3",  # a local folder, made by `hypersloth-tiny-model`
        max_seq_length=1024,  # bounds each prompt + completion
        dtype="float32",  # CPU kernels are fastest and exact in float32
        backend="transformers",  # Unsloth needs CUDA
    ),
    lora_args=LoraArgs(r=16, lora_alpha=16, lora_dropout=0.0),  # dropout would make step 1 differ from the reference
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/tiny-dpo-cpu",
    per_device_train_batch_size=4,  # pairs per micro-batch on each process
    gradient_accumulation_steps=2,
    max_steps=24,  # two passes over the 200 pairs
    learning_rate=5e-3,  # high because the model is tiny and random (a real model: ~5e-6)
    warmup_steps=1,
    lr_scheduler_type="linear",
    optim="adamw_torch",  # 8-bit optimizers need CUDA
    logging_steps=1,  # loss and rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins
    save_steps=6,
    report_to="none",  # "tensorboard" to write event files under output_dir
)
