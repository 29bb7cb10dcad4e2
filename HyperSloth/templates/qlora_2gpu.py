"""HyperSloth config: 4-bit QLoRA on two GPUs.

The base weights are stored in 4-bit (bitsandbytes NF4) and a LoRA adapter trains on top, so an 8B
model fits in about 10 GB per process. Needs CUDA and `pip install 'HyperSloth[gpu]'`.

    hypersloth-build-dataset --local_path FILE_OR_DIR --tokenizer MODEL --name my-chat      # tokenise and register your data in data/
    hypersloth-plan hypersloth_config.py             # check the batch plan first
    hypersloth-train hypersloth_config.py

Global batch = per_device_train_batch_size x gradient_accumulation_steps x len(gpus)
             = 4 x 4 x 2 = 32 samples per optimizer step.
"""

from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, LoraArgs, TrainingArgsConfig, TrainingConfig

hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="my-chat", data_dir="data"),
    training=TrainingConfig(
        gpus=[0, 1],  # one process per GPU; any ids, e.g. [2, 3]
        loss_type="response_only",  # train on assistant tokens only ("all": every token)
        # batching unset: "packed" (samples concatenated into rows, no compute wasted on padding), or "sorted-pad"
        # where the model cannot keep packed samples apart (checked at start; say batching= to choose yourself)
    ),
    fast_model_args=FastModelArgs(
        model_name="unsloth/Qwen3-8B-bnb-4bit",  # pre-quantised checkpoint: smaller download
        max_seq_length=2048,
        load_in_4bit=True,  # QLoRA: frozen 4-bit base, trainable 16-bit adapter
        backend="auto",  # Unsloth when installed, else transformers + PEFT + bitsandbytes
        # Recompute activations in backward; Unsloth's variant also offloads them to CPU RAM.
        use_gradient_checkpointing="unsloth",
    ),
    lora_args=LoraArgs(
        r=16,  # adapter rank: capacity of the update
        lora_alpha=16,  # update scale = lora_alpha / r
    ),
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/qwen3-8b-qlora",
    per_device_train_batch_size=4,  # samples per micro-batch on each GPU
    gradient_accumulation_steps=4,  # micro-batches per optimizer step on each GPU
    learning_rate=2e-4,
    max_steps=100,  # optimizer steps; overrides num_train_epochs
    lr_scheduler_type="linear",
    warmup_steps=5,
    optim="adamw_8bit",  # 8-bit optimizer states (bitsandbytes) save memory
    logging_steps=1,
    save_steps=50,
    save_total_limit=2,
    report_to="tensorboard",
)
