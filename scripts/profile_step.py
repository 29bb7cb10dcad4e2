"""Where one micro-batch's time and memory go, on one GPU (the measurements behind docs/benchmarks.md).

    python scripts/profile_step.py --checkpoint CKPT [--four-bit] [--gc unsloth] --out prof.json \
        [--probe] [--sweep 2048,8192,32768] [--churn 30] [--torch-profile 11264] [--longest 32768,65536]

Loads the model once through HyperSloth's Unsloth backend (varlen shim on), then, as asked:
- `--probe`: the automatic budget's measurement (`HyperSloth.train.budget.probe.measure_on_gpu`) and its decision;
- `--sweep`: seconds and peak memory of forward+backward of packed rows of exactly these token counts,
  built from the short-chat length distribution; fits seconds = fixed + per_token x tokens;
- `--churn N`: N micro-batches of varying length (a new shape almost every time), plain and bucketed
  (`collate.bucket_tokens`): per-iteration seconds, to see whether new shapes cost spikes;
- `--torch-profile T`: torch.profiler over 3 iterations of forward+backward+AdamW step at T tokens:
  the top kernels and CPU ops, kernel launches per iteration, and GPU busy time against wall time;
- `--profile-long T`: the same for one sample of T tokens (a long-context step: one warm-up, one profiled
  iteration), e.g. `--gc unsloth --attention fa4 --profile-long 131072`, and with `--reuse-attention` (attention's
  outputs kept through checkpointing, train/attention/recompute.py) for the A/B;
- `--longest`: one sample of each length alone: does forward+backward fit, and its peak memory.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

VOCAB = 151936


def packed_row(tokens: int, rng, max_len: int = 4096, pad_to: int | None = None) -> dict:
    """Short-chat-like samples (lognormal lengths) filling exactly `tokens` tokens, as one packed row."""
    from HyperSloth.train.collate import collate_packed

    lengths, left = [], tokens
    while left > 0:
        n = int(min(left, np.clip(np.exp(rng.normal(6.2, 0.8)), 32, max_len)))
        lengths.append(n)
        left -= n
    samples = [(ids, ids.copy()) for ids in (rng.integers(100, VOCAB - 100, size=n) for n in lengths)]
    return collate_packed(samples, with_lengths=True, pad_to=pad_to)


def fwd_bwd_seconds(model, batch: dict, optimizer=None) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    batch = {k: v if k == "packed_seq_lengths" else v.cuda(non_blocking=True) for k, v in batch.items()}
    from HyperSloth.train.model import training_autocast

    with training_autocast(model):  # the forward training runs (the backward outside it, as HF's training step)
        loss = model(**batch, num_items_in_batch=int(batch["input_ids"].shape[1]), use_cache=False).loss
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def sweep(model, sizes: list[int], rng) -> dict:
    import torch

    from HyperSloth.train.budget.probe import release_memory

    rows = []
    for tokens in sizes:
        release_memory(model)
        torch.cuda.reset_peak_memory_stats()
        try:
            times = [fwd_bwd_seconds(model, packed_row(tokens, rng)) for _ in range(4)]
        except torch.cuda.OutOfMemoryError:
            rows.append({"tokens": tokens, "oom": True})
            break
        rows.append({"tokens": tokens, "s": float(np.median(times[1:])), "first_s": times[0],
                     "peak_gb": torch.cuda.max_memory_allocated() / 2**30})
        print("sweep", json.dumps(rows[-1]), flush=True)
    release_memory(model)
    ok = [r for r in rows if "s" in r]
    fit = np.polyfit([r["tokens"] for r in ok], [r["s"] for r in ok], 1) if len(ok) >= 2 else [None, None]
    return {"rows": rows, "fixed_s": fit[1], "per_1k_tokens_s": None if fit[0] is None else fit[0] * 1000}


def churn(model, n: int, rng) -> dict:
    """Varying row lengths (8k-14k tokens, as one rank's share of a short-chat step), plain then bucketed."""
    from HyperSloth.train.budget.probe import release_memory
    from HyperSloth.train.collate import bucket_tokens

    out = {}
    for mode in ("plain", "bucketed"):
        times, sizes = [], []
        for _ in range(n):
            tokens = int(rng.integers(8000, 14000))
            pad_to = bucket_tokens(tokens) if mode == "bucketed" else None
            times.append(fwd_bwd_seconds(model, packed_row(tokens, rng, pad_to=pad_to)))
            sizes.append(pad_to or tokens)
        release_memory(model)
        warm = times[3:]
        out[mode] = {"s": times, "tokens": sizes, "median_s": float(np.median(warm)), "max_s": float(max(warm)),
                     "distinct_shapes": len(set(sizes))}
        print("churn", mode, json.dumps({k: v for k, v in out[mode].items() if k not in ("s", "tokens")}),
              [round(t, 3) for t in times], flush=True)
    return out


def torch_profile(model, tokens: int, rng, table_path: str | None, one_sample: bool = False) -> dict:
    """`--torch-profile` (3 iterations of packed short chats after 2 warm-ups) or, with `one_sample`,
    `--profile-long` (one sample of `tokens`, 1 warm-up and 1 profiled iteration)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from HyperSloth.train.budget.probe import release_memory
    from HyperSloth.train.collate import collate_packed

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-9)
    if one_sample:
        ids = rng.integers(100, VOCAB - 100, size=tokens)
        batches = [collate_packed([(ids, ids.copy())], with_lengths=True)] * 2
    else:
        batches = [packed_row(tokens, rng) for _ in range(5)]
    warmups = 1 if one_sample else 2
    iterations = len(batches) - warmups
    for b in batches[:warmups]:
        fwd_bwd_seconds(model, b, optimizer)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in batches[warmups:]:
            fwd_bwd_seconds(model, b, optimizer)
    wall = (time.perf_counter() - start) / iterations
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6 / iterations
    launches = sum(e.count for e in kernels) / iterations
    by_gpu = events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
    by_cpu = events.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70)
    if table_path:
        with open(table_path, "w") as f:
            f.write(f"tokens {tokens}, wall {wall:.4f} s/iter, GPU busy {busy:.4f} s/iter, "
                    f"kernels {launches:.0f}/iter\n\n")
            f.write(by_gpu + "\n\n" + by_cpu)
    print(by_gpu[:6000], flush=True)
    optimizer.zero_grad(set_to_none=True)
    del optimizer
    release_memory(model)
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]
    return {"tokens": tokens, "one_sample": one_sample, "wall_s_per_iter": wall, "gpu_busy_s_per_iter": busy,
            "kernels_per_iter": launches,
            "top_kernels": [(e.key[:90], e.self_device_time_total / 1e6 / iterations, e.count / iterations)
                            for e in top]}


def longest(model, lengths: list[int], rng) -> list[dict]:
    import torch

    from HyperSloth.train.budget.probe import release_memory
    from HyperSloth.train.collate import collate_packed

    rows = []
    for n in lengths:
        release_memory(model)
        torch.cuda.reset_peak_memory_stats()
        ids = rng.integers(100, VOCAB - 100, size=n)
        try:
            s = fwd_bwd_seconds(model, collate_packed([(ids, ids.copy())], with_lengths=True))
            rows.append({"tokens": n, "ok": True, "s": s, "peak_gb": torch.cuda.max_memory_allocated() / 2**30})
        except torch.cuda.OutOfMemoryError:
            rows.append({"tokens": n, "ok": False})
        print("longest", json.dumps(rows[-1]), flush=True)
        if not rows[-1]["ok"]:
            break
    release_memory(model)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--four-bit", action="store_true")
    p.add_argument("--gc", default="False")
    p.add_argument("--max-seq", type=int, default=4096)
    p.add_argument("--probe", action="store_true")
    p.add_argument("--cap", type=int, default=1 << 20, help="the probe's cap on the budget (tokens)")
    p.add_argument("--sweep", default="")
    p.add_argument("--churn", type=int, default=0)
    p.add_argument("--torch-profile", type=int, default=0)
    p.add_argument("--longest", default="")
    p.add_argument("--profile-long", type=int, default=0, help="torch.profiler over one sample of this many tokens")
    p.add_argument("--attention", choices=["flash", "fa4"], default="flash",
                   help="torch's bundled flash, or FlashAttention-4 through torch's flash-impl registry")
    p.add_argument("--reuse-attention", action="store_true",
                   help="keep attention's outputs through checkpointing (needs --gc unsloth; train/attention/recompute.py)")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import unsloth  # noqa: F401
    import torch

    from HyperSloth.config import FastModelArgs, LoraArgs
    from HyperSloth.train.budget import probe as budget_probe
    from HyperSloth.train.model import load_model
    from HyperSloth.train.patches import unsloth_training_patches

    shim = unsloth_training_patches()["torch_varlen"]  # the patches a worker applies: it attends as training does
    results: dict = {"varlen_shim": shim, "gc": a.gc, "checkpoint": a.checkpoint}
    gc = {"True": True, "False": False}.get(a.gc, a.gc)
    max_seq = max([a.max_seq, a.profile_long] + [int(x) for x in a.longest.split(",") if x])
    fast = FastModelArgs(model_name=a.checkpoint, max_seq_length=max_seq, dtype="bfloat16", backend="unsloth",
                         load_in_4bit=a.four_bit, use_gradient_checkpointing=gc)
    started = time.perf_counter()
    model = load_model(fast, LoraArgs(r=16, lora_alpha=16)).model
    results["load_s"] = time.perf_counter() - started
    model.train()
    if a.attention == "fa4":
        from HyperSloth.train.attention.fa4 import route_torch_fa4_here
        from HyperSloth.train.attention.setting import torch_registry

        route_torch_fa4_here()
        torch_registry().activate_flash_attention_impl("FA4")
    results["attention"] = a.attention
    if a.reuse_attention:
        from HyperSloth.train.attention.recompute import install_on_unsloth

        kept, why = install_on_unsloth(model.get_base_model().model, 100 * 2**30)
        results["attention_reuse"] = why or "installed"
    rng = np.random.default_rng(0)

    def save():
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2, default=str)

    if a.probe:
        d = budget_probe.measure_on_gpu(model, lengths=[a.max_seq], vocab_size=VOCAB, cap=a.cap,
                                        gradient_checkpointing=gc)
        results["probe"] = d.as_record()
        print("probe", d.summary(), flush=True)
        save()
    if a.sweep:
        results["sweep"] = sweep(model, [int(x) for x in a.sweep.split(",")], rng)
        save()
    if a.churn:
        results["churn"] = churn(model, a.churn, rng)
        save()
    if a.torch_profile:
        results["torch_profile"] = torch_profile(model, a.torch_profile, rng, a.out.replace(".json", ".txt"))
        save()
    if a.longest:
        results["longest"] = longest(model, [int(x) for x in a.longest.split(",")], rng)
        save()
    if a.profile_long:
        results["profile_long"] = torch_profile(model, a.profile_long, rng, a.out.replace(".json", "-long.txt"),
                                                one_sample=True)
        if a.reuse_attention and kept is not None:
            results["attention_reuse"] = kept.summary()
        save()
    print("PROFILE " + json.dumps({k: v for k, v in results.items() if k != "torch_profile"}, default=str))


if __name__ == "__main__":
    main()
