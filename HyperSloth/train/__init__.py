"""Train: one process per GPU. The worker (worker), the process group and gradient sync (dist), model loading
(model, patches), the training methods in rooms of their own (sft/, dpo/, grpo/), the automatic token budget
(budget/), HyperSloth's LoRA passes and expert adapters (lora/), attention kernels (attention/), CUDA graphs
(step_graph), the plan as training data (plan_loader, collate), packed rows kept exact (packing/: the start-up check
and the loss-exactness references), the exact evaluation (evaluation), step timing (profiling) and the embedded
tiny model (tiny_model, tiny_architectures).
"""
