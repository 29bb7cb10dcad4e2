"""HyperSloth config: 16-bit LoRA on two GPUs.

The base model stays in bfloat16 and only the LoRA adapter trains. Qwen3-0.6B fits easily on one
24 GB card per process; for larger models switch to the qlora-2gpu template (4-bit base weights).

    hypersloth-build-dataset --local_path FILE_OR_DIR --tokenizer MODEL --name my-chat      # tokenise and register your data in data/
    hypersloth-plan hypersloth_config.py             # check the batch plan first
    hypersloth-train hypersloth_config.py

Global batch = per_device_train_batch_size x gradient_accumulation_steps x len(gpus)
             = 4 x 4 x 2 = 32 samples per optimizer step (the same as 1 GPU with 16 accumulation steps).
"""

from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, LoraArgs, TrainingArgsConfig, TrainingConfig

hyper_config_model = HyperConfig(
    # Name given to `hypersloth-build-dataset --name`; looked up in data/data_config.json.
    data=DataConfig(dataset_name="my-chat", data_dir="data"),
    training=TrainingConfig(
        gpus=[0, 1],  # one process per GPU; any ids, e.g. [2, 3]
        loss_type="response_only",  # train on assistant tokens only ("all": every token)
        # batching unset: "packed" (samples concatenated into rows, no compute wasted on padding), or "sorted-pad"
        # where the model cannot keep packed samples apart (checked at start; say batching= to choose yourself)
    ),
    fast_model_args=FastModelArgs(
        model_name="unsloth/Qwen3-0.6B",
        max_seq_length=4096,  # longer samples are cut
        dtype="auto",  # bfloat16 on CUDA
        backend="auto",  # Unsloth when installed, else transformers + PEFT
    ),
    lora_args=LoraArgs(
        r=16,  # adapter rank: capacity of the update
        lora_alpha=16,  # update scale = lora_alpha / r
        lora_dropout=0.0,
        # target_modules unset: read from the model (every linear projection of the decoder and, on an MoE
        # model, its experts; never the head, embeddings or router; docs/models.md)
    ),
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/qwen3-0.6b-lora",
    per_device_train_batch_size=4,  # samples per micro-batch on each GPU
    gradient_accumulation_steps=4,  # micro-batches per optimizer step on each GPU
    learning_rate=2e-4,
    num_train_epochs=1,  # or set max_steps to stop after a fixed number of optimizer steps
    lr_scheduler_type="linear",
    warmup_steps=5,
    optim="adamw_torch_fused",  # "adamw_8bit" saves optimizer memory (bitsandbytes)
    weight_decay=0.01,
    logging_steps=1,
    save_steps=100,
    save_total_limit=2,
    report_to="tensorboard",  # event files under output_dir
)
