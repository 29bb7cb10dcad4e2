"""Benchmark the batching planner: padding, padding saved against random batching, rank imbalance, time.

    .venv/bin/python scripts/bench_planner.py [--samples 1000000] [--repeats 3] [--dataset DIR_OR_NAME]
                                              [--data_dir data]

Distributions: synthetic lengths clip(exp(N(6.2, 0.8)), 32, 4096) (trainable = half), and a built
dataset: a `save_to_disk` folder, or a name registered in DATA_DIR/data_config.json (default
'sample-chat'); skipped with a note when there is none. Layouts: 2 ranks at global batch 32 and
8 ranks at 128 (plus 8 ranks at 256 for sorted-pad), micro-batch 8 for sorted-pad and token budgets
4096 / 8192 / 16384 for packed. Prints a Markdown table; wall and CPU seconds are each the best of `repeats` runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import fire
import numpy as np

from HyperSloth.plan.batching import PlanSpec, PlanStats, adaptive_partition_batches

LAYOUTS = [(2, 32), (8, 128)]
BUDGETS = [4096, 8192, 16384]
HEADER = ("| data | ranks | global batch | mode | padding % | random % | pad tokens cut | pad % cut | imbalance "
          "| bound | worst step | micro-batches/rank/step | wall s | cpu s |")


def synthetic(samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.clip(np.exp(np.random.default_rng(seed).normal(6.2, 0.8, samples)), 32, 4096).astype(np.int64)
    return lengths, lengths // 2


def built_dataset(dataset: str, data_dir: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(lengths, trainable) of a built dataset folder or registered name; None if it is not there."""
    folder = Path(dataset)
    if not folder.is_dir():
        registry = Path(data_dir) / "data_config.json"
        if not registry.is_file():
            return None
        entry = json.loads(registry.read_text())["datasets"].get(dataset)
        if entry is None:
            return None
        folder = Path(entry["path"]) if Path(entry["path"]).is_absolute() else Path(data_dir) / entry["path"]
    import datasets

    table = datasets.load_from_disk(str(folder)).with_format("numpy")
    return np.asarray(table["length"], dtype=np.int64), np.asarray(table["num_trainable"], dtype=np.int64)


def specs(layouts: list[tuple[int, int]] = LAYOUTS, extra_sorted: list[tuple[int, int]] = [(8, 256)]
          ) -> list[tuple[str, PlanSpec]]:
    """(label, spec) of every benchmarked configuration."""
    out = []
    for ranks, batch in layouts + extra_sorted:
        out.append(("sorted-pad B=8", PlanSpec(ranks, batch, mode="sorted-pad", micro_batch_size=8)))
        if (ranks, batch) in layouts:
            out.append(("sorted-pad B=8 grouped", PlanSpec(ranks, batch, mode="sorted-pad", group_by_length=True)))
            out += [(f"packed {b}", PlanSpec(ranks, batch, token_budget=b)) for b in BUDGETS]
    return out


def timed(lengths: np.ndarray, trainable: np.ndarray, spec: PlanSpec,
          repeats: int) -> tuple[PlanStats, float, float]:
    """Stats, and the best wall and CPU seconds of `repeats` runs (CPU time is robust to a busy machine)."""
    wall, cpu, stats = float("inf"), float("inf"), None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        stats = adaptive_partition_batches(lengths, trainable, spec).stats
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return stats, wall, cpu


def row(name: str, label: str, spec: PlanSpec, stats: PlanStats, wall: float, cpu: float) -> str:
    per_step = stats.micro_batches_per_rank / stats.num_steps
    return (f"| {name} | {spec.num_ranks} | {spec.samples_per_step} | {label} | {100 * stats.padding_fraction:.2f} "
            f"| {100 * stats.random_padding_fraction:.2f} | {100 * stats.padding_reduction:.1f}% "
            f"| {100 * (1 - stats.padding_fraction / stats.random_padding_fraction):.1f}% "
            f"| {stats.imbalance:.4f} | {stats.imbalance_bound:.4f} | {stats.max_imbalance:.3f} "
            f"| {per_step:.2f} ({stats.min_micro_batches_per_step}-{stats.max_micro_batches_per_step}) "
            f"| {wall:.3f} | {cpu:.3f} |")


def bench(samples: int = 1_000_000, repeats: int = 3, dataset: str = "sample-chat", data_dir: str = "data",
          layouts: str = "") -> None:
    """Print the benchmark table (see the module docstring). `--layouts 4x32,4x64,8x32,8x128` replaces the
    default RANKSxGLOBAL_BATCH layouts (and drops the extra 8x256 sorted-pad row)."""
    chosen = [tuple(int(v) for v in item.split("x")) for item in str(layouts).split(",") if item]
    sets = [(f"synthetic {samples:,}", *synthetic(samples))]
    built = built_dataset(dataset, data_dir)
    if built is None:
        print(f"note: no built dataset '{dataset}' (folder, or name in {data_dir}/data_config.json): skipped. "
              "Build one with `hypersloth-build-dataset --local_path data/sample_chat.jsonl --name sample-chat ...`")
    else:
        sets.append((f"{Path(dataset).name} {built[0].size:,}", *built))
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    for name, lengths, trainable in sets:
        for label, spec in (specs(chosen, []) if chosen else specs()):
            print(row(name, label, spec, *timed(lengths, trainable, spec, repeats)), flush=True)
    print("pad tokens cut = padding tokens avoided / random batching's padding tokens; pad % cut = 1 - padding % "
          "/ random %; imbalance = mean over steps of max/mean rank load "
          "(load = tokens + 2^-15 x tokens^2 per sequence); bound = mean over steps of the one-item lower "
          "bound of that ratio; random % = the same samples in random micro-batches of 8.")


if __name__ == "__main__":
    fire.Fire(bench)
