"""Why an MoE step differs between stock Unsloth and HyperSloth's loading (issue 32): the same checkpoint loaded
both ways in one process, one after the other, then three forward+backward passes of the same packed row each;
prints the adapters' config, how the experts' forward is routed, the step time and the peak memory.

    python scripts/moe_diag.py CHECKPOINT [--tokens 20000]

Runs where Unsloth and a GPU are (the benchmark's moe-short checkpoint: /tmp/hs_bench/ckpt-30b-a3b-12l).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def stock(path: str):
    from bench_stock import stock_lora_model

    return stock_lora_model(path, max_seq_length=4096, projections=PROJECTIONS, seed=3407,
                            gradient_checkpointing=False)[0]


def ours(path: str, mlp_names: bool):
    from HyperSloth.config import FastModelArgs, LoraArgs
    from HyperSloth.train import model as model_lib

    fast = FastModelArgs(model_name=path, max_seq_length=4096, dtype="bfloat16", backend="unsloth",
                         use_gradient_checkpointing=False)
    lora = LoraArgs(r=16, lora_alpha=16, target_modules=PROJECTIONS if mlp_names else None)
    return model_lib.load_model(fast, lora, lora_passes=True).model


def describe(model) -> None:
    config = model.peft_config["default"]
    experts = model.get_base_model().model.layers[0].mlp.experts
    forward = getattr(type(experts), "forward", None)
    print("  target_modules", sorted(config.target_modules or []), "target_parameters", config.target_parameters)
    print("  experts", type(experts).__name__, "forward", getattr(forward, "__module__", "?"),
          getattr(forward, "__qualname__", "?"), "impl", getattr(model.config, "_experts_implementation", None))


def time_passes(model, tokens: int) -> None:
    import torch

    from HyperSloth.train.budget.probe import probe_batch

    batch = probe_batch(tokens, [700] * 64, vocab_size=151936)
    batch = {k: v if k == "packed_seq_lengths" else v.cuda() for k, v in batch.items()}
    model.train()
    for i in range(3):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        loss = model(**batch, num_items_in_batch=tokens, use_cache=False).loss
        loss.backward()
        torch.cuda.synchronize()
        print(f"  pass {i}: {time.perf_counter() - t:.3f} s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, "
              f"loss {loss.item():.4f}", flush=True)
        model.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("checkpoint")
    p.add_argument("--tokens", type=int, default=20000)
    p.add_argument("--which", default="stock,ours,ours-mlp-names")
    a = p.parse_args()
    import unsloth  # noqa: F401
    import torch

    from HyperSloth.train.patches import enable_unsloth_torch_varlen, pad_unsloth_loss_rows

    enable_unsloth_torch_varlen()
    pad_unsloth_loss_rows()
    for which in a.which.split(","):
        print(which, flush=True)
        model = stock(a.checkpoint) if which == "stock" else ours(a.checkpoint, which.endswith("mlp-names"))
        describe(model)
        time_passes(model, a.tokens)
        del model
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
