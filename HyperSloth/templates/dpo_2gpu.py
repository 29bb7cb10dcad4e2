"""HyperSloth config: DPO (preference tuning) of a LoRA adapter on two GPUs.

Trains on preference pairs - a prompt, a chosen and a rejected answer - with DPO's sigmoid loss. The
reference model is the same weights with the adapter disabled (no second copy in memory); to DPO after
SFT, set lora_args.init_adapter_path to the SFT adapter: it is trained on, and a frozen copy of it is
the reference. See docs/dpo.md.

    hypersloth-build-dataset --local_path FILE_OR_DIR --tokenizer MODEL --name my-pairs   # prompt/chosen/rejected rows
    hypersloth-plan hypersloth_config.py             # the batch plan, in pairs
    hypersloth-train hypersloth_config.py

Global batch = per_device_train_batch_size x gradient_accumulation_steps x len(gpus)
             = 4 x 4 x 2 = 32 pairs per optimizer step; the loss is the mean over those 32 pairs.
"""

from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, LoraArgs, TrainingArgsConfig, TrainingConfig

hyper_config_model = HyperConfig(
    # A preference dataset (registered with kind "preference"); a chat dataset is refused for DPO.
    data=DataConfig(dataset_name="my-pairs", data_dir="data", eval_fraction=0.05),  # 5% of the pairs held out
    training=TrainingConfig(
        gpus=[0, 1],  # one process per GPU; any ids, e.g. [2, 3]
        method="dpo",
        dpo_beta=0.1,  # larger keeps the policy closer to the reference
        batching="packed",  # each pair's prompt+chosen and prompt+rejected packed padding-free
    ),
    fast_model_args=FastModelArgs(
        model_name="unsloth/Qwen3-0.6B",
        max_seq_length=4096,  # bounds each prompt + completion
        dtype="auto",  # bfloat16 on CUDA
        backend="auto",  # Unsloth when installed, else transformers + PEFT
    ),
    lora_args=LoraArgs(
        r=16,
        lora_alpha=16,
        lora_dropout=0.0,  # dropout makes the policy differ from the reference at step 1
        init_adapter_path=None,  # e.g. "outputs/qwen3-0.6b-lora": DPO after SFT, that adapter is the reference
    ),
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/qwen3-0.6b-dpo",
    per_device_train_batch_size=4,  # pairs per micro-batch on each GPU (sizes the step only: packed)
    gradient_accumulation_steps=4,
    learning_rate=5e-6,  # DPO moves far with small rates (TRL's default is 1e-6)
    num_train_epochs=1,
    lr_scheduler_type="linear",
    warmup_steps=5,
    optim="adamw_torch_fused",
    logging_steps=1,  # loss and rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins
    eval_steps=20,  # eval_loss and eval_rewards/* on the held-out pairs
    save_steps=100,
    save_total_limit=2,
    report_to="tensorboard",
)
