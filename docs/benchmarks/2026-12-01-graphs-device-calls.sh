#!/usr/bin/env bash
# Issue 18 (CUDA graphs over the bucket shapes), 2026-12-01, one H200 (device kind nvidia-h200, carry .whl).
# Run from the repository root on the GPU machine: bash docs/benchmarks/2026-12-01-graphs-device-calls.sh check|bench
set -euo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-/tmp/hs_out}; mkdir -p "$OUT"
case "${1:-}" in
  check)  # a replay against eager, loss and gradients, and the forward+backward time per packed row
    python3 scripts/graph_check.py --model 0.6b --rows 8192,16384,24576 --repeats 8 --out "$OUT/graph_check.json" ;;
  bench)  # HyperSloth-1 at defaults (graphs on), the same with cuda_graphs=False, and Unsloth at its best
    T=2026-12-01-1gpu
    python3 scripts/benchmark.py --workloads short-0.6b --slots "hypersloth-1,unsloth-best,hypersloth-1-eager" \
        --num-gpus 1 --budget-s 285 --out "$OUT" --tag $T
    python3 scripts/benchmark.py --workloads long-0.6b --slots "hypersloth-1,unsloth-best" \
        --num-gpus 1 --budget-s 255 --out "$OUT" --tag $T ;;
  *) echo "usage: $0 check|bench" >&2; exit 2 ;;
esac
