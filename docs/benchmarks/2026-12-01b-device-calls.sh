#!/usr/bin/env bash
# Second session of 2026-12-01, one H200 (kind nvidia-h200, carry .whl); run from the repository root as
# `bash docs/benchmarks/2026-12-01b-device-calls.sh callN`. Each call stays under 9 minutes (the benchmark stops
# starting systems at --budget-s and kills one still running at it). Records and logs land in $OUT.
set -u
source scripts/gpu_env.sh
W=/tmp/hs_bench; L=$OUT/logs; mkdir -p "$L"
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - T0) )); }
bench() { python3 scripts/benchmark.py --work $W --out $OUT --num-gpus 1 "$@"; }
show() { grep -h "^\[\|FAILED\|out of time\|Error\|error\|budget probe\|tokens_per_micro_batch=auto" "$@" | cut -c1-600; }

callA() {  # issue 21: DPO, HyperSloth-1 at defaults against TRL's DPOTrainer + Unsloth at the splits that fit
  # (32 x 1 ran out of memory in the first session), every row in this one call
  bench --workloads dpo-0.6b --slots "hypersloth-1,trl-dpo-16x2,trl-dpo-8x4" --warmup 3 --steps 20 \
    --tag 2026-12-01b-dpo --budget-s $(left 500) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
}

"$@"
