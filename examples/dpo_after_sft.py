"""DPO after SFT: preference-tune the adapter of an earlier SFT run, with that adapter as the reference.

`init_adapter_path` loads the SFT adapter twice: once to train, once frozen as the reference model (the
DPO loss compares the policy's log-probabilities with the reference's; with no initial adapter the
reference is the base model, the adapter disabled). The pairs are a preference dataset registered as
`my-pairs` (prompt/chosen/rejected rows; docs/dpo.md); 5% of them are held out and evaluated every
20 steps (eval_loss, eval_rewards/*).

    hypersloth-build-dataset --local_path pairs.jsonl --tokenizer unsloth/Qwen3-4B --name my-pairs
    hypersloth-plan examples/dpo_after_sft.py
    hypersloth-train examples/dpo_after_sft.py
"""

from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, LoraArgs, TrainingArgsConfig, TrainingConfig

hyper_config_model = HyperConfig(
    data=DataConfig(dataset_name="my-pairs", eval_fraction=0.05),
    training=TrainingConfig(gpus=[0, 1], method="dpo", dpo_beta=0.1),
    fast_model_args=FastModelArgs(model_name="unsloth/Qwen3-4B", max_seq_length=2048),
    lora_args=LoraArgs(
        r=16,  # must match the saved adapter
        lora_alpha=16,
        init_adapter_path="outputs/qwen3-4b-finetome",  # the SFT run's adapter: trained on, and the reference
    ),
)

training_config_model = TrainingArgsConfig(
    output_dir="outputs/qwen3-4b-dpo",
    per_device_train_batch_size=4,  # pairs
    gradient_accumulation_steps=4,  # 4 x 4 x 2 GPUs = 32 pairs per optimizer step
    learning_rate=5e-6,
    num_train_epochs=1,
    warmup_steps=5,
    eval_steps=20,
)
