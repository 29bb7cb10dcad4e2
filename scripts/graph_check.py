"""GPU check of the CUDA-graphed forward+backward (HyperSloth.train.step_graph): equal to eager, and faster.

On one GPU, with a random-weight Qwen3-shaped checkpoint loaded through Unsloth exactly as training loads it
(bf16 or 4-bit, LoRA r=16 on the seven projections, the varlen shim), for packed rows of each given length:
- eager forward+backward time per micro-batch (median of --repeats after 3 warm-ups),
- the graph's replay time per micro-batch,
- loss and gradients of a replay against eager on the same micro-batch, for two different micro-batches
  per length (the second proves that a replay reads the new data, lengths and denominator), and once more after
  every trainable weight moved ("after-update": a replay reads the weights as they are, no cast copy of the capture's),
- the GPU memory the graphs hold.

    python scripts/graph_check.py --model 0.6b --rows 16384,24576 --out /tmp/graph_check.json

With `--attention fa4` (flash-attn-4 on the path: scripts/fa4_env.sh) the rows attend with FlashAttention-4 through
HyperSloth's hookup (train/attention/fa4.py), and each row gets one more check, "vs-flash": the FA4 replay against
an eager step on torch's bundled flash, next to the eager-vs-eager pair, the noise floor (issue 33, item 3).

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


def micro_batch(rows: int, rng: np.random.Generator, longest: int, pad_token_id: int) -> dict:
    """A packed row of exactly `rows` tokens: lognormal samples (as the benchmark's short chats) + padding."""
    from HyperSloth.train.collate import collate_packed

    samples, total = [], 0
    while True:
        n = int(np.clip(np.exp(rng.normal(6.2, 0.8)), 32, longest))
        if total + n > rows - 64:
            break
        ids = rng.integers(100, 151000, size=n)
        samples.append((ids, ids.copy()))
        total += n
    return collate_packed(samples, with_lengths=True, pad_to=rows, pad_token_id=pad_token_id)


def timed(fn, repeats: int) -> list[float]:
    import torch

    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.6b", help="a scripts/bench_workloads.py SHAPES key: 0.6b, 1.7b, 8b")
    p.add_argument("--checkpoint", default="/tmp/hs_bench/ckpt_{model}")
    p.add_argument("--rows", default="16384,24576", help="packed row lengths (bucket lengths) to check")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="/tmp/graph_check.json")
    p.add_argument("--attention", choices=["flash", "fa4"], default="flash",
                   help="the packed rows' kernel: torch's bundled flash, or FlashAttention-4 (adds the vs-flash check)")
    a = p.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_workloads import FOUR_BIT, PROJECTIONS, checkpoint_for_check

    ckpt = checkpoint_for_check(a.model, Path(a.checkpoint.format(model=a.model)))

    import unsloth  # noqa: F401  (first: it patches transformers)
    import torch

    from HyperSloth.config import FastModelArgs, LoraArgs
    from HyperSloth.train.step_graph import DecoderGraphs, graph_layout
    from HyperSloth.train.model import load_model, trainable_parameters
    from HyperSloth.train.patches import unsloth_static_packed_rows, unsloth_training_patches

    shim = unsloth_training_patches()["torch_varlen"]  # the patches a worker applies
    loaded = load_model(
        FastModelArgs(model_name=str(ckpt), max_seq_length=4096, dtype="bfloat16", load_in_4bit=FOUR_BIT[a.model],
                      backend="unsloth"),
        LoraArgs(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=PROJECTIONS))
    registry = None
    if a.attention == "fa4":
        from HyperSloth.train.attention.fa4 import route_torch_fa4_here
        from HyperSloth.train.attention.setting import torch_registry

        route_torch_fa4_here()
        registry = torch_registry()
        registry.activate_flash_attention_impl("FA4")
    model, params = loaded.model, trainable_parameters(loaded.model)
    model.train()
    device = params[0].device
    rows_list = [int(r) for r in a.rows.split(",")]
    layout = graph_layout(samples_per_micro_batch=64, longest_sample=4096, token_budget=2 * max(rows_list))
    graphs = DecoderGraphs(params, layout, static_packed_info=unsloth_static_packed_rows)
    graphs.install(model.get_base_model().model)

    def step(mb: dict, denominator: int, graphed: bool, bundled_flash: bool = False) -> float:
        for q in params:
            q.grad = None
        graphs.disabled = None if graphed else "off for the eager reference"
        if registry is not None:  # FA4 unless this eager step is the bundled-flash reference
            if bundled_flash:
                registry.restore_flash_attention_impl(_raise_warn=False)
            elif registry.current_flash_attention_impl() != "FA4":
                registry.activate_flash_attention_impl("FA4")
        inputs = {k: (v if k == "packed_seq_lengths" else v.to(device, non_blocking=True)) for k, v in mb.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):  # what HF's bf16 run wraps the forward in
            loss = model(**inputs, num_items_in_batch=denominator, use_cache=False).loss
        loss.backward()
        return loss.detach()

    rng = np.random.default_rng(0)
    report = {"model": a.model, "attention": a.attention, "varlen_shim": shim, "layout": layout.as_dict(), "rows": {}}
    for rows in rows_list:
        batches = [micro_batch(rows, rng, 4096, loaded.tokenizer.pad_token_id) for _ in range(2)]
        for b in batches:
            for k in ("input_ids", "position_ids", "labels", "packed_seq_lengths"):
                b[k] = b[k].pin_memory()
        denominators = [int((b["labels"][..., 1:] != -100).sum()) for b in batches]
        for _ in range(3):
            step(batches[0], denominators[0], graphed=False)
        eager_s = timed(lambda: step(batches[1], denominators[1], graphed=False), a.repeats)
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        step(batches[0], denominators[0], graphed=True)  # captures
        row = {"eager_s": eager_s, "eager_median_s": float(np.median(eager_s)), "captured": rows in graphs.graphs,
               "capture_failure": graphs.disabled, "graph_reserved_gb": (torch.cuda.memory_reserved() - before) / 2**30,
               "segments": [int(len(b["packed_seq_lengths"])) for b in batches]}
        if rows in graphs.graphs:
            checks = []
            for i in (1, 0, 1, "eager-twice", *(["vs-flash"] if registry is not None else []), "after-update"):
                kind = i if isinstance(i, str) else "graphed"
                graphed = kind != "eager-twice"  # eager vs eager: the run-to-run noise floor
                i = 1 if kind != "graphed" else i
                if kind == "after-update":  # an optimizer step's worth of change: replays must read the new weights
                    with torch.no_grad():
                        for q in params:
                            q.add_(torch.randn_like(q), alpha=1e-3)
                loss_g = float(step(batches[i], denominators[i], graphed=graphed))
                grads_g = [q.grad.detach().float().clone() for q in params]
                loss_e = float(step(batches[i], denominators[i], graphed=False, bundled_flash=kind == "vs-flash"))
                grads_e = [q.grad.detach().float().clone() for q in params]
                rel = float(torch.sqrt(sum(((g - e) ** 2).sum() for g, e in zip(grads_g, grads_e)) /
                                       sum((e ** 2).sum() for e in grads_e)))
                checks.append({"batch": i, "kind": kind, "graphed": graphed, "loss_graph": loss_g, "loss_eager": loss_e,
                               "loss_rel_diff": abs(loss_g - loss_e) / abs(loss_e), "grad_rel_l2_diff": rel,
                               "grad_max_abs_diff": max(float((g - e).abs().max()) for g, e in zip(grads_g, grads_e))})
            row["checks"] = checks
            row["graph_s"] = timed(lambda: step(batches[1], denominators[1], graphed=True), a.repeats)
            row["graph_median_s"] = float(np.median(row["graph_s"]))
            row["speedup"] = row["eager_median_s"] / row["graph_median_s"]
        report["rows"][rows] = row
        print(json.dumps({rows: {k: v for k, v in row.items() if k not in ("eager_s", "graph_s")}}, indent=1), flush=True)
        if graphs.capture_traceback:
            print(graphs.capture_traceback[-7000:], flush=True)
            row["capture_traceback"] = graphs.capture_traceback
            break
    report["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"peak {report['peak_gb']:.1f} GB; written {a.out}")


if __name__ == "__main__":
    main()
