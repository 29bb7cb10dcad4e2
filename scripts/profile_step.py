"""Time forward+backward of one rank's share of a step under different batch layouts (GPU only).

    python scripts/profile_step.py --checkpoint CKPT [--four-bit] --layouts packed,pad4,pad8,pad16 \
        [--varlen-shim] [--samples 16] [--iters 6]

Loads the model once through HyperSloth's Unsloth backend, draws `samples` sequences per iteration from
the benchmark's length distribution (different lengths every iteration, as in training), and prints
seconds per iteration and peak memory for each layout: `packed` (one row, restarting positions) or
`padN` (sorted, micro-batches of N padded to their longest). This is how the defaults in
docs/benchmarks.md were chosen.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def batches(layout: str, lengths: np.ndarray, rng, budget: int):
    from HyperSloth.collate import collate_packed, collate_sorted_pad

    samples = [(ids, ids.copy()) for ids in (rng.integers(100, 150000, size=int(n)) for n in lengths)]
    samples.sort(key=lambda s: -len(s[0]))
    if layout == "packed":
        rows, row, used = [], [], 0
        for s in samples:
            if row and used + len(s[0]) > budget:
                rows.append(row)
                row, used = [], 0
            row.append(s)
            used += len(s[0])
        rows.append(row)
        return [collate_packed(r, with_lengths=True) for r in rows]
    size = int(layout[3:])
    return [collate_sorted_pad(samples[k:k + size], pad_token_id=0) for k in range(0, len(samples), size)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--four-bit", action="store_true")
    p.add_argument("--layouts", default="packed,pad4,pad8")
    p.add_argument("--varlen-shim", action="store_true")
    p.add_argument("--gc", default="False")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--iters", type=int, default=6)
    a = p.parse_args()

    import unsloth  # noqa: F401
    import torch

    from HyperSloth.config import FastModelArgs, LoraArgs
    from HyperSloth.model import load_model
    from HyperSloth.patches import enable_unsloth_torch_varlen

    shim = enable_unsloth_torch_varlen() if a.varlen_shim else False
    gc = {"True": True, "False": False}.get(a.gc, a.gc)
    fast = FastModelArgs(model_name=a.checkpoint, max_seq_length=4096, dtype="bfloat16", backend="unsloth",
                         load_in_4bit=a.four_bit, use_gradient_checkpointing=gc)
    model = load_model(fast, LoraArgs(r=16, lora_alpha=16)).model
    model.train()
    rng = np.random.default_rng(0)
    results = {"varlen_shim": shim, "gc": a.gc}
    for layout in a.layouts.split(","):
        times, tokens = [], []
        torch.cuda.reset_peak_memory_stats()
        for _ in range(a.iters):
            lengths = np.clip(np.exp(rng.normal(6.2, 0.8, a.samples)), 32, 4096).astype(int)
            mbs = batches(layout, lengths, rng, a.budget)
            n_items = int(lengths.sum() - len(lengths))
            torch.cuda.synchronize()
            start = time.perf_counter()
            for mb in mbs:
                mb = {k: (v.cuda() if k != "packed_seq_lengths" else v) for k, v in mb.items()}
                loss = model(**mb, num_items_in_batch=n_items, use_cache=False).loss
                loss.backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            tokens.append(int(lengths.sum()))
        warm = times[2:]
        results[layout] = {"s_per_iter": sum(warm) / len(warm), "first": times[:2],
                           "tokens_per_s": sum(tokens[2:]) / sum(warm),
                           "peak_gb": torch.cuda.max_memory_allocated() / 2**30}
        print(layout, json.dumps(results[layout]), flush=True)
    print("PROFILE " + json.dumps(results))


if __name__ == "__main__":
    main()
