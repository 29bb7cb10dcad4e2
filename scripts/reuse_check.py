"""GPU check of attention's outputs kept through gradient checkpointing (HyperSloth.train.attention.recompute): the
loss and LoRA gradients equal the plain recompute's, and the step is faster.

On one GPU, with a random-weight Qwen3-shaped checkpoint loaded through Unsloth as training loads it (bf16, LoRA r=16
on the seven projections, Unsloth's checkpointing), for one packed row of each given length:
- forward+backward time per row, plain recompute and with the outputs kept (median of --repeats after a warm-up),
- loss and gradients with the outputs kept against the plain recompute, next to plain against plain (the run-to-run
  noise floor of the backward's atomic adds), and the kept/reused counts.

    python scripts/reuse_check.py --model 0.6b --rows 32768,131072 --out /tmp/reuse_check.json

Needs CUDA and Unsloth (the device machine: see ../shared/device/README.md); builds the checkpoint with
scripts/benchmark.py in a child process when --checkpoint has none.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.6b", help="a scripts/bench_workloads.py SHAPES key: 0.6b, 1.7b, 8b")
    p.add_argument("--checkpoint", default="/tmp/hs_bench/ckpt_{model}")
    p.add_argument("--rows", default="32768", help="packed row lengths to check, one sample each (long-context rows)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="/tmp/reuse_check.json")
    a = p.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_workloads import FOUR_BIT, PROJECTIONS, checkpoint_for_check

    ckpt = checkpoint_for_check(a.model, Path(a.checkpoint.format(model=a.model)))

    import unsloth  # noqa: F401  (first: it patches transformers)
    import torch

    from HyperSloth.config import FastModelArgs, LoraArgs
    from HyperSloth.train.collate import collate_packed
    from HyperSloth.train.model import load_model, trainable_parameters, training_autocast
    from HyperSloth.train.attention.recompute import install_on_unsloth
    from HyperSloth.train.patches import unsloth_training_patches

    unsloth_training_patches()  # as a worker attends: without it the rows went to SDPA, not the kept path
    rows_list = [int(r) for r in a.rows.split(",")]
    loaded = load_model(
        FastModelArgs(model_name=str(ckpt), max_seq_length=max(rows_list), dtype="bfloat16",
                      load_in_4bit=FOUR_BIT[a.model], backend="unsloth", use_gradient_checkpointing="unsloth"),
        LoraArgs(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=PROJECTIONS))
    model, params = loaded.model, trainable_parameters(loaded.model)
    model.train()
    device = params[0].device
    with torch.no_grad():  # LoRA B starts at zero: move it, so the adapters' gradients depend on attention's
        for q in params:
            q.add_(torch.randn_like(q), alpha=1e-3)
    kept, why = install_on_unsloth(model.get_base_model().model, 60 * 2**30)
    report = {"model": a.model, "installed": kept is not None, "why_not": why, "rows": {}}
    if kept is None:
        print(f"not installed: {why}")
        Path(a.out).write_text(json.dumps(report, indent=1))
        return

    def step(batch: dict, keep: bool) -> tuple[float, list, float]:
        for q in params:
            q.grad = None
        kept.cap_bytes = 60 * 2**30 if keep else 0  # a cap of 0 keeps nothing: every layer recomputes
        torch.cuda.synchronize()
        started = time.perf_counter()
        with training_autocast(model):
            loss = model(**batch, num_items_in_batch=int((batch["labels"][..., 1:] != -100).sum()),
                         use_cache=False).loss
        loss.backward()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        return float(loss.detach()), [q.grad.detach().float().clone() for q in params], seconds

    def rel(a_grads, b_grads) -> float:
        return float(torch.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a_grads, b_grads)) /
                                sum((y ** 2).sum() for y in b_grads)))

    rng = np.random.default_rng(0)
    for rows in rows_list:
        ids = rng.integers(0, int(model.config.vocab_size), rows)
        batch = collate_packed([(ids, ids.copy())], with_lengths=True)
        batch = {k: v if k == "packed_seq_lengths" else v.to(device) for k, v in batch.items()}
        step(batch, keep=False)  # warm-up
        plain = [step(batch, keep=False) for _ in range(a.repeats)]
        before = dict(kept.summary())
        reused = [step(batch, keep=True) for _ in range(a.repeats)]
        after = kept.summary()
        row = {"plain_s": [s for _, _, s in plain], "kept_s": [s for _, _, s in reused],
               "plain_median_s": float(np.median([s for _, _, s in plain])),
               "kept_median_s": float(np.median([s for _, _, s in reused])),
               "loss_plain": plain[0][0], "loss_kept": reused[0][0],
               "grad_rel_l2_kept_vs_plain": rel(reused[0][1], plain[0][1]),
               "grad_rel_l2_plain_vs_plain": rel(plain[1][1], plain[0][1]) if len(plain) > 1 else None,
               "reused_per_step": (after["reused"] - before["reused"]) / a.repeats,
               "peak_kept_gb": after["peak_kept_bytes"] / 2**30}
        row["speedup"] = row["plain_median_s"] / row["kept_median_s"]
        report["rows"][rows] = row
        shown = {k: v for k, v in row.items() if k not in ("plain_s", "kept_s")}
        print(json.dumps({rows: shown}, indent=1), flush=True)
    report["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    unreached = [rows for rows, row in report["rows"].items() if not row["reused_per_step"]]
    report["kept_path_reached"] = not unreached
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"peak {report['peak_gb']:.1f} GB; written {a.out}")
    if unreached:  # the kept rows then compare a plain recompute with itself: not a check of the kept path
        sys.exit(f"the kept path was not reached at {', '.join(map(str, unreached))} tokens (nothing kept or reused); "
                 "training's run summary (attention_reuse) says whether it is reached there")


if __name__ == "__main__":
    main()
