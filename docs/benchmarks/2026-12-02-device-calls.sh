#!/usr/bin/env bash
# 2026-12-02, one H200 (kind nvidia-h200, carry .whl): issue 32's GPU items. Run from the repository root as
# `bash docs/benchmarks/2026-12-02-device-calls.sh callA`. Records and logs land in $OUT.
source scripts/device_calls_lib.sh  # the GPU environment, $W / $L, el, left, bench, show, pack, ...

callA() {  # MoE speed (item 7): a Qwen3-30B-A3B-shaped model (12 layers, 128 experts, 8 active, bf16) on the short
  # chats: HyperSloth at its defaults (targets read from the model: attention + the fused experts through Unsloth's
  # MoE LoRA path) against stock Unsloth + TRL at its best (32 x 1, checkpointing off, same varlen patch; Unsloth maps
  # gate/up/down_proj onto the experts itself), 3 warm-up + 20 timed steps each (~9 minutes)
  bench --workloads moe-short --slots unsloth-best+hypersloth-1 --tag moe --budget-s $(left 540) \
    > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
  grep -h "LoRA targets\|LoRA projections\|eager decoder\|CUDA graphs\|budget\|median step\|memory      peak" \
    $W/moe-short/out_hypersloth-1/logs/rank0.log | cut -c1-500
  pack
}

callB() {  # the fast path per architecture (item 4): every tiny architecture at defaults, graphed and eager, on
  # Unsloth (scripts/arch_check.py; ~6 minutes)
  timeout 560 python3 scripts/arch_check.py --out $OUT/arch --parallel 7 > $L/arch.log 2>&1
  el "arch check done"; cut -c1-1500 $L/arch.log | tail -20
  tar czf $OUT/arch-logs.tgz -C $OUT arch && rm -rf $OUT/arch/*.log
  pack
}

"$@"
