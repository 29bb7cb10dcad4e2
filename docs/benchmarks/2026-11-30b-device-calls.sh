#!/usr/bin/env bash
# The device calls of the second session of 2026-11-30 (kind nvidia-h200-x2, carry .whl), run from the
# repository root as `bash docs/benchmarks/2026-11-30b-device-calls.sh callN`. Every call builds the
# random-weight checkpoints it needs in child processes first (the parent holds no GPU memory).
set -u
source scripts/gpu_env.sh
W=/tmp/hs_bench; L=$OUT/logs; mkdir -p "$L"
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bench() { python3 scripts/benchmark.py --work $W --out $OUT "$@"; }
show() { grep -h "^\[\|FAILED\|out of time\|Error\|error" "$@" | cut -c1-330; }

machine() {
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.max.sm --format=csv > $L/nvsmi.txt 2>&1
  nvidia-smi topo -m > $L/topo.txt 2>&1; nproc > $L/nproc.txt; lscpu > $L/lscpu.txt 2>&1
  python3 -c "import torch, unsloth, trl, transformers, peft; print(torch.__version__, unsloth.__version__, trl.__version__, transformers.__version__, peft.__version__)" > $L/versions.txt 2>&1
  el "versions: $(tail -1 $L/versions.txt)"
}

call1() {  # the 0.6B workloads: anchors and HyperSloth at product defaults; the eval-cost measurement
  machine
  bench --workloads short-0.6b,long-0.6b --slots "" --out $L/rec > $L/build.log 2>&1; el "built: $(ls $W | tr '\n' ' ')"
  # evaluation cost against training, per token: the real run (1 GPU, Unsloth, auto budget) and the direct one
  CUDA_VISIBLE_DEVICES=1 timeout 170 python3 scripts/bench_eval.py --model 0.6b --checkpoint $W/ckpt_0.6b --work $W/eval \
    > $L/eval-run.log 2>&1 &
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 scripts/bench_eval.py --direct --model 0.6b --steps 6 > $L/eval-direct.log 2>&1
  wait
  el "eval: $(grep -h EVAL_BENCH $L/eval-direct.log $L/eval-run.log | cut -c1-600)"; tail -5 $L/eval-run.log
  bench --workloads short-0.6b,long-0.6b --slots "unsloth-best+hypersloth-1,hypersloth-2,unsloth-ddp" --tag s2-c1 \
    --budget-s $(( 540 - ($(date +%s) - T0) )) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
}

call2() {  # 8B 4-bit short chats: anchors (with and without checkpointing), DDP, HyperSloth 2 GPUs (+ -gc)
  machine
  bench --workloads short-8b --slots "" --out $L/rec > $L/build.log 2>&1; el "built: $(ls $W | tr '\n' ' ')"
  bench --workloads short-8b --slots "unsloth-best+unsloth-best-gc,hypersloth-2,unsloth-ddp,hypersloth-2-gc" --tag s2-c2 \
    --budget-s $(( 560 - ($(date +%s) - T0) )) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
}

call3() {  # 8B on 1 GPU (HyperSloth; Unsloth at 16 x 2 without checkpointing), the rank-wait breakdown, stock defaults
  machine
  bench --workloads short-0.6b,short-8b --slots "" --out $L/rec > $L/build.log 2>&1; el "built: $(ls $W | tr '\n' ' ')"
  bench --workloads short-8b --slots "unsloth-best-16x2+hypersloth-1" --tag s2-c3 --budget-s 200 > $L/bench-8b.log 2>&1
  el "8b done"; show $L/bench-8b.log
  bench --workloads short-0.6b,long-0.6b --slots "hypersloth-2-profile" --tag s2-c3 \
    --budget-s $(( 450 - ($(date +%s) - T0) )) > $L/bench-prof.log 2>&1
  el "profile done"; show $L/bench-prof.log
  bench --workloads short-0.6b --slots "unsloth-stock" --tag s2-c3-stock --budget-s $(( 540 - ($(date +%s) - T0) )) \
    > $L/bench-stock.log 2>&1
  el "stock done"; show $L/bench-stock.log
}

call4() {  # after the probe's checkpointing buffers are released: hypersloth-2-gc again, then its anchor
  bench --workloads short-8b --slots "" --out $L/rec > $L/build.log 2>&1; el "built: $(ls $W | tr '\n' ' ')"
  bench --workloads short-8b --slots "hypersloth-2-gc,unsloth-best-gc" --tag s2-c4 --budget-s 250 > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
}

"$@"
