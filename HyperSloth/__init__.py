"""HyperSloth: fine-tune LLMs on all the GPUs of a machine with Unsloth speed.

One process per GPU, every optimizer step's global batch planned by `adaptive_partition_batches`,
LoRA gradients summed over NCCL (gloo on CPU) with the exact single-process loss scale.
"""

__version__ = "0.2.0"
