"""Train: one process per GPU. The worker (worker), the process group and gradient sync (dist), model
loading (model, patches), the automatic token budget (budget, probe_cache), the trainer (trainer,
collate), the exact evaluation (evaluation), step timing (profiling), the loss-exactness references
(exactness) and the embedded tiny model (tiny_model).
"""
