"""Train: one process per GPU. The worker (worker), the process group and gradient sync (dist), model loading
(model, patches), the training methods in rooms of their own (sft/, dpo/), the automatic token budget (budget/),
HyperSloth's LoRA passes (lora/), CUDA graphs (step_graph), the plan as training data (plan_loader, collate), the
exact evaluation (evaluation), step timing (profiling), the loss-exactness references (exactness) and the embedded
tiny model (tiny_model).
"""
