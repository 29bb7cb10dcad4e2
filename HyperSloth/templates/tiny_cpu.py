"""HyperSloth config: the tiny CPU demo (no GPU, no internet needed).

Before training, build the two local inputs this file names:
    hypersloth-tiny-model                                 # random-weight tiny Qwen3 -> build/tiny-qwen3
    hypersloth-build-dataset --local_path data/sample_chat.jsonl --name sample-chat \
        --tokenizer build/tiny-qwen3 --max_seq_length 1024 --overwrite   # registers 'sample-chat' in data/
Then:
    hypersloth-plan hypersloth_config.py                  # show the batch plan, no training
    hypersloth-train hypersloth_config.py

Global batch = per_device_train_batch_size x gradient_accumulation_steps x len(gpus)
             = 4 x 2 x 2 = 16 samples per optimizer step.
"""

from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, LoraArgs, TrainingArgsConfig, TrainingConfig

hyper_config_model = HyperConfig(
    # The dataset is looked up by name in data/data_config.json (written by hypersloth-build-dataset).
    data=DataConfig(dataset_name="sample-chat", data_dir="data"),
    training=TrainingConfig(
        # One process per entry. Without CUDA the ids only count processes: [0, 1] = 2 CPU workers over gloo.
        gpus=[0, 1],
        # Loss on assistant tokens only; "all" also trains on the prompt.
        loss_type="response_only",
        # batching unset: "packed" concatenates samples into rows (no padding, per-sample position ids), or
        # "sorted-pad" (length-sorted, padded rows) where the model cannot keep packed samples apart (checked at
        # start). batching="packed" or "sorted-pad" chooses yourself.
    ),
    fast_model_args=FastModelArgs(
        model_name="build/tiny-qwen3",  # a local folder, made by `hypersloth-tiny-model`
        max_seq_length=1024,  # the longest sample chat is 676 tokens
        dtype="float32",  # CPU kernels are fastest and exact in float32
        backend="transformers",  # Unsloth needs CUDA
    ),
    # A LoRA adapter on every attention and MLP projection; the update is scaled by lora_alpha / r.
    lora_args=LoraArgs(r=16, lora_alpha=16),
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/tiny-cpu",  # `make demo` trains into outputs/tiny-demo (examples/tiny_cpu_demo.py)
    per_device_train_batch_size=4,  # samples per micro-batch on each process
    gradient_accumulation_steps=2,  # micro-batches per optimizer step on each process
    max_steps=30,  # optimizer steps; overrides num_train_epochs
    learning_rate=1e-2,  # high because the model is tiny and random
    warmup_steps=2,
    lr_scheduler_type="linear",
    optim="adamw_torch",  # 8-bit optimizers need CUDA
    logging_steps=1,
    save_steps=10,  # a checkpoint (adapter + resolved config) every 10 steps
    report_to="none",  # "tensorboard" to write event files under output_dir
)
